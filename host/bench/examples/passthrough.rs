//! The floor under any HTTP router built on switchyard's stack: a reverse proxy that does only
//! what every router must. It forwards each request (method, path, body unread) to the engines
//! in turn (round-robin) and streams their answers back unread, on the same stack as switchyard
//! (hyper server, hyper-util's client with pooled keep-alive connections, a multi-thread Tokio
//! runtime, TCP_NODELAY on both sides).
//!
//! `scripts/bench-overhead.sh` runs the forward scenario through it as well, so the table can say
//! how much of switchyard's added latency any proxy hop pays here (an extra loopback round trip,
//! two HTTP parses, task wake-ups) and how much is switchyard's own work.
//!
//! Two other engine clients, in the same binary so that one run compares them (the book's
//! "An engine connection driven by the request's task"):
//!
//! ```text
//! --own-task  hyper's HTTP/1 connections (`hyper::client::conn::http1` pairs) pooled idle,
//!             each driven inside the request's own task and response body instead of on a
//!             task of the connection's ([`driven`]): an answer wakes one task, not two
//! --raw       a minimal hand-written HTTP/1.1 client (httparse), driven the same way, with
//!             no request channel and buffers that start small ([`raw`])
//! ```
//!
//! Usage: passthrough [--own-task | --raw] PORT ENGINE_URL [ENGINE_URL...]

#[path = "passthrough/driven.rs"]
mod driven;
#[path = "passthrough/raw.rs"]
mod raw;
#[cfg(test)]
#[path = "passthrough/tests.rs"]
mod tests;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use http_body_util::{BodyExt, Full, combinators::BoxBody};
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use hyper_util::client::legacy::{Client, connect::HttpConnector};
use hyper_util::rt::{TokioExecutor, TokioIo};

struct Upstreams {
    client: Engines,
    urls: Vec<String>,
    next: AtomicUsize,
}

/// How the engines are called: hyper-util's pooled client (a task per connection), or
/// connections driven by the requests' own tasks.
#[expect(clippy::large_enum_variant, reason = "one per process")]
enum Engines {
    Pooled(Client<HttpConnector, Full<bytes::Bytes>>),
    OwnTask(Arc<driven::Pools>),
    Raw(Arc<raw::Pools>),
}

impl Engines {
    /// `request` (an absolute URI) to its engine, answered with the engine's body unread.
    async fn request(
        &self,
        request: Request<Full<bytes::Bytes>>,
    ) -> anyhow::Result<Response<Body>> {
        Ok(match self {
            Engines::Pooled(client) => client
                .request(request)
                .await?
                .map(|body| body.map_err(std::io::Error::other).boxed()),
            Engines::OwnTask(pools) => pools.request(request).await?.map(BodyExt::boxed),
            Engines::Raw(pools) => pools.request(request).await?.map(BodyExt::boxed),
        })
    }
}

type Body = BoxBody<bytes::Bytes, std::io::Error>;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let usage = "usage: passthrough [--own-task | --raw] PORT ENGINE_URL [ENGINE_URL...]";
    let mut first = args.next().ok_or_else(|| anyhow::anyhow!(usage))?;
    let client = first.clone();
    if client.starts_with("--") {
        first = args.next().ok_or_else(|| anyhow::anyhow!(usage))?;
    }
    let port: u16 = first.parse()?;
    let urls: Vec<String> = args.collect();
    anyhow::ensure!(!urls.is_empty(), usage);
    let upstreams = Arc::new(Upstreams {
        client: match client.as_str() {
            "--own-task" => Engines::OwnTask(Arc::default()),
            "--raw" => Engines::Raw(Arc::default()),
            flag if flag.starts_with("--") => anyhow::bail!(usage),
            _ => {
                let mut connector = HttpConnector::new();
                connector.set_nodelay(true);
                Engines::Pooled(Client::builder(TokioExecutor::new()).build(connector))
            }
        },
        urls,
        next: AtomicUsize::new(0),
    });
    let listener = tokio::net::TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], port))).await?;
    loop {
        let (stream, _) = listener.accept().await?;
        stream.set_nodelay(true)?;
        let upstreams = upstreams.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| proxy(upstreams.clone(), req));
            let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

async fn proxy(up: Arc<Upstreams>, req: Request<Incoming>) -> Result<Response<Body>, Infallible> {
    let base = &up.urls[up.next.fetch_add(1, Ordering::Relaxed) % up.urls.len()];
    let (parts, body) = req.into_parts();
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let Ok(body) = body.collect().await.map(|b| b.to_bytes()) else {
        return Ok(status(StatusCode::BAD_REQUEST));
    };
    let mut request = Request::builder()
        .method(parts.method)
        .uri(format!("{base}{path}"));
    if let Some(kind) = parts.headers.get(http::header::CONTENT_TYPE) {
        request = request.header(http::header::CONTENT_TYPE, kind);
    }
    let Ok(request) = request.body(Full::new(body)) else {
        return Ok(status(StatusCode::BAD_REQUEST));
    };
    let Ok(answer) = up.client.request(request).await else {
        return Ok(status(StatusCode::BAD_GATEWAY));
    };
    let mut response = Response::builder().status(answer.status());
    if let Some(kind) = answer.headers().get(http::header::CONTENT_TYPE) {
        response = response.header(http::header::CONTENT_TYPE, kind);
    }
    let frames = answer.into_body();
    // The status and content type are the engine's own, so the response builds.
    Ok(response
        .body(frames)
        .unwrap_or_else(|_| status(StatusCode::BAD_GATEWAY)))
}

fn status(code: StatusCode) -> Response<Body> {
    let empty = http_body_util::Empty::new().map_err(|never| match never {});
    let mut response = Response::new(BodyExt::boxed(empty));
    *response.status_mut() = code;
    response
}
