//! The floor under any HTTP router built on switchyard's stack: a reverse proxy that does only
//! what every router must. It forwards each request (method, path, body unread) to the engines
//! in turn (round-robin) and streams their answers back unread, on hyper's stack (hyper server,
//! hyper-util's client with pooled keep-alive connections, a multi-thread Tokio runtime,
//! TCP_NODELAY on both sides). switchyard calls its engines on an HTTP/1.1 client of its own
//! (`engine_client::http1`), leaner than hyper-util's, and serves HTTP/1.1 clients on a server
//! connection of its own (`api::connection::http1`), leaner than hyper's; the book's "An engine
//! connection driven by the request's task" and "switchyard's own HTTP/1 server connection" have
//! each measured against hyper's.
//!
//! `scripts/bench-overhead.sh` runs the forward scenario through it as well, so the table can say
//! how much of switchyard's added latency any proxy hop pays here (an extra loopback round trip,
//! two HTTP parses, task wake-ups) and how much is switchyard's own work.
//!
//! Usage: passthrough PORT ENGINE_URL [ENGINE_URL...]

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
    client: Client<HttpConnector, Full<bytes::Bytes>>,
    urls: Vec<String>,
    next: AtomicUsize,
}

type Body = BoxBody<bytes::Bytes, std::io::Error>;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let usage = "usage: passthrough PORT ENGINE_URL [ENGINE_URL...]";
    let port: u16 = args.next().ok_or_else(|| anyhow::anyhow!(usage))?.parse()?;
    let urls: Vec<String> = args.collect();
    anyhow::ensure!(!urls.is_empty(), usage);
    let upstreams = Arc::new(Upstreams {
        client: {
            let mut connector = HttpConnector::new();
            connector.set_nodelay(true);
            Client::builder(TokioExecutor::new()).build(connector)
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
    let frames = answer.into_body().map_err(std::io::Error::other);
    // The status and content type are the engine's own, so the response builds.
    Ok(response
        .body(frames.boxed())
        .unwrap_or_else(|_| status(StatusCode::BAD_GATEWAY)))
}

fn status(code: StatusCode) -> Response<Body> {
    let empty = http_body_util::Empty::new().map_err(|never| match never {});
    let mut response = Response::new(BodyExt::boxed(empty));
    *response.status_mut() = code;
    response
}
