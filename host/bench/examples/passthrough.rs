//! The floor under any HTTP router built on switchyard's stack: a reverse proxy that does only
//! what every router must. It forwards each request (method, path, body unread) to the engines
//! in turn (round-robin) and streams their answers back unread, on hyper's stack (hyper server,
//! hyper-util's client with pooled keep-alive connections, a multi-thread Tokio runtime,
//! TCP_NODELAY on both sides). switchyard calls its engines on an HTTP/1.1 client of its own
//! (`engine_client::http1`), leaner than hyper-util's; the book's "An engine connection driven
//! by the request's task" has both measured.
//!
//! `scripts/bench-overhead.sh` runs the forward scenario through it as well, so the table can say
//! how much of switchyard's added latency any proxy hop pays here (an extra loopback round trip,
//! two HTTP parses, task wake-ups) and how much is switchyard's own work.
//!
//! `--own-server` serves the client's HTTP/1.1 connections on a minimal server of this file's
//! own, on `httparse` (a head read into a buffer that grows only when it must, Content-Length
//! request bodies, the response's head and body written in one write, keep-alive), instead of
//! hyper's: what a server connection of switchyard's own would save per request and per open
//! stream before one is built. Measured on the 2-core box (nginx responder, interleaved): wrk
//! `-t1 -c32` forward 19.1–22.0 µs of CPU per request against hyper's 22.0–28.6 (medians of six
//! interleaved rounds 20.2 and 23.6); `scripts/bench-streams.sh` at 1,024 streams (ROUTER_BIN= a
//! wrapper) 23.8 KiB of RSS per open stream against 33.1.
//!
//! Usage: passthrough [--own-server] PORT ENGINE_URL [ENGINE_URL...]

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
    let mut args = std::env::args().skip(1).peekable();
    let usage = "usage: passthrough [--own-server] PORT ENGINE_URL [ENGINE_URL...]";
    let own_server = args.next_if(|arg| arg == "--own-server").is_some();
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
        if own_server {
            tokio::spawn(own::serve(stream, upstreams));
            continue;
        }
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| proxy(upstreams.clone(), req));
            let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

async fn proxy(up: Arc<Upstreams>, req: Request<Incoming>) -> Result<Response<Body>, Infallible> {
    let (parts, body) = req.into_parts();
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let Ok(body) = body.collect().await.map(|b| b.to_bytes()) else {
        return Ok(status(StatusCode::BAD_REQUEST));
    };
    let content_type = parts.headers.get(http::header::CONTENT_TYPE).cloned();
    let answer = match forward(&up, parts.method, path, content_type, body).await {
        Ok(answer) => answer,
        Err(code) => return Ok(status(code)),
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

/// Sends one request to the next engine; its answer, or the status to answer the client with.
async fn forward(
    up: &Upstreams,
    method: http::Method,
    path: &str,
    content_type: Option<http::HeaderValue>,
    body: bytes::Bytes,
) -> Result<Response<Incoming>, StatusCode> {
    let base = &up.urls[up.next.fetch_add(1, Ordering::Relaxed) % up.urls.len()];
    let mut request = Request::builder()
        .method(method)
        .uri(format!("{base}{path}"));
    if let Some(kind) = content_type {
        request = request.header(http::header::CONTENT_TYPE, kind);
    }
    let request = request
        .body(Full::new(body))
        .map_err(|_| StatusCode::BAD_REQUEST)?;
    up.client
        .request(request)
        .await
        .map_err(|_| StatusCode::BAD_GATEWAY)
}

fn status(code: StatusCode) -> Response<Body> {
    let empty = http_body_util::Empty::new().map_err(|never| match never {});
    let mut response = Response::new(BodyExt::boxed(empty));
    *response.status_mut() = code;
    response
}

/// The minimal HTTP/1.1 server connection `--own-server` runs: enough for wrk and
/// `switchyard bench` (no chunked request bodies, no 100-continue, no pipelining guarantees
/// beyond reading what follows a request), to measure what hyper's server costs.
mod own {
    use std::io::Write as _;
    use std::sync::Arc;
    use std::time::{Duration, SystemTime};

    use bytes::{Buf, Bytes, BytesMut};
    use http_body_util::BodyExt;
    use hyper::StatusCode;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    use super::Upstreams;

    /// What the read buffer starts at and grows by: a request head is a few hundred bytes.
    const READ_CHUNK: usize = 1024;
    const MAX_HEAD: usize = 64 * 1024;
    const MAX_HEADERS: usize = 64;

    /// One request's head, copied out of the read buffer.
    struct Head {
        method: http::Method,
        path: String,
        content_type: Option<http::HeaderValue>,
        content_length: usize,
        keep_alive: bool,
        head_len: usize,
    }

    pub(super) async fn serve(mut io: TcpStream, up: Arc<Upstreams>) {
        let mut buf = BytesMut::new();
        let mut out = Vec::new();
        loop {
            let Some(head) = read_head(&mut io, &mut buf).await else {
                return;
            };
            buf.advance(head.head_len);
            while buf.len() < head.content_length {
                buf.reserve(head.content_length - buf.len());
                match io.read_buf(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
            }
            let body = Bytes::copy_from_slice(&buf[..head.content_length]);
            buf.advance(head.content_length);
            let answer =
                super::forward(&up, head.method, &head.path, head.content_type, body).await;
            let written = match answer {
                Ok(answer) => respond(&mut io, &mut out, answer, head.keep_alive).await,
                Err(code) => {
                    write_head(&mut out, code, None, Some(0), head.keep_alive);
                    io.write_all(&out).await.is_ok()
                }
            };
            if !written || !head.keep_alive {
                return;
            }
        }
    }

    /// Reads until a whole head is buffered; None when the connection ends or the head is bad.
    async fn read_head(io: &mut TcpStream, buf: &mut BytesMut) -> Option<Head> {
        loop {
            if !buf.is_empty()
                && let Some(head) = parse(buf)?
            {
                return Some(head);
            }
            if buf.len() >= MAX_HEAD {
                return None;
            }
            buf.reserve(READ_CHUNK);
            if io.read_buf(buf).await.ok()? == 0 {
                return None;
            }
        }
    }

    /// The head at the buffer's start: Some(None) when it is not all there yet.
    fn parse(buf: &[u8]) -> Option<Option<Head>> {
        let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut request = httparse::Request::new(&mut headers);
        let head_len = match request.parse(buf).ok()? {
            httparse::Status::Partial => return Some(None),
            httparse::Status::Complete(len) => len,
        };
        let mut keep_alive = request.version == Some(1);
        let (mut content_type, mut content_length) = (None, 0);
        for header in request.headers.iter() {
            if header.name.eq_ignore_ascii_case("content-length") {
                content_length = std::str::from_utf8(header.value).ok()?.parse().ok()?;
            } else if header.name.eq_ignore_ascii_case("content-type") {
                content_type = http::HeaderValue::from_bytes(header.value).ok();
            } else if header.name.eq_ignore_ascii_case("connection") {
                keep_alive = if header.value.eq_ignore_ascii_case(b"close") {
                    false
                } else {
                    keep_alive || header.value.eq_ignore_ascii_case(b"keep-alive")
                };
            } else if header.name.eq_ignore_ascii_case("transfer-encoding") {
                return None;
            }
        }
        Some(Some(Head {
            method: http::Method::from_bytes(request.method?.as_bytes()).ok()?,
            path: request.path?.to_owned(),
            content_type,
            content_length,
            keep_alive,
            head_len,
        }))
    }

    /// Writes the engine's answer: head and body in one write when its size is known, chunked
    /// frames as they come otherwise. False when the connection cannot go on.
    async fn respond(
        io: &mut TcpStream,
        out: &mut Vec<u8>,
        answer: hyper::Response<hyper::body::Incoming>,
        keep_alive: bool,
    ) -> bool {
        let kind = answer.headers().get(http::header::CONTENT_TYPE).cloned();
        let size = hyper::body::Body::size_hint(answer.body()).exact();
        write_head(out, answer.status(), kind.as_ref(), size, keep_alive);
        let mut body = answer.into_body();
        while let Some(frame) = body.frame().await {
            let Ok(Some(data)) = frame.map(|frame| frame.into_data().ok()) else {
                return false;
            };
            if size.is_some() {
                out.extend_from_slice(&data);
            } else {
                let _ = write!(out, "{:x}\r\n", data.len());
                out.extend_from_slice(&data);
                out.extend_from_slice(b"\r\n");
                if io.write_all(out).await.is_err() {
                    return false;
                }
                out.clear();
            }
        }
        if size.is_none() {
            out.extend_from_slice(b"0\r\n\r\n");
        }
        let written = io.write_all(out).await.is_ok();
        out.clear();
        written
    }

    fn write_head(
        out: &mut Vec<u8>,
        status: StatusCode,
        kind: Option<&http::HeaderValue>,
        size: Option<u64>,
        keep_alive: bool,
    ) {
        out.clear();
        let _ = write!(
            out,
            "HTTP/1.1 {} {}\r\n",
            status.as_str(),
            status.canonical_reason().unwrap_or("")
        );
        if let Some(kind) = kind {
            out.extend_from_slice(b"content-type: ");
            out.extend_from_slice(kind.as_bytes());
            out.extend_from_slice(b"\r\n");
        }
        match size {
            Some(size) => {
                let _ = write!(out, "content-length: {size}\r\n");
            }
            None => out.extend_from_slice(b"transfer-encoding: chunked\r\n"),
        }
        if !keep_alive {
            out.extend_from_slice(b"connection: close\r\n");
        }
        DATE.with_borrow_mut(|date| {
            out.extend_from_slice(b"date: ");
            out.extend_from_slice(date.now());
            out.extend_from_slice(b"\r\n\r\n");
        });
    }

    thread_local! {
        static DATE: std::cell::RefCell<Date> = const {
            std::cell::RefCell::new(Date { second: 0, text: Vec::new() })
        };
    }

    /// The `date` header's value, formatted once per second per thread (as hyper caches it).
    struct Date {
        second: u64,
        text: Vec<u8>,
    }

    impl Date {
        fn now(&mut self) -> &[u8] {
            let now = SystemTime::now();
            let second = now
                .duration_since(SystemTime::UNIX_EPOCH)
                .unwrap_or(Duration::ZERO)
                .as_secs();
            if second != self.second || self.text.is_empty() {
                self.second = second;
                self.text = httpdate::fmt_http_date(now).into_bytes();
            }
            &self.text
        }
    }
}
