//! A minimal hand-written HTTP/1.1 client, to measure what hyper's client costs an engine
//! connection: no task and no channel per connection, the request written from one buffer
//! freed once written, and a read buffer that starts at [`READ_CHUNK`] and grows only for an
//! answer's head that needs it. The request's task reads the answer inside its response body
//! ([`RawBody`]), decoding `Content-Length` and chunked bodies; a body read to its end leaves
//! its connection to the pool. A prototype: no timeouts, no TLS, no HTTP/2.

use std::collections::HashMap;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, ready};
use std::time::{Duration, Instant};

use bytes::{Buf, Bytes, BytesMut};
use http::uri::Authority;
use http::{Request, Response};
use http_body_util::Full;
use hyper::body::{Body, Frame, SizeHint};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

/// Idle connections older than this are dropped, before uvicorn's (5 s) closes them.
const IDLE_EXPIRY: Duration = Duration::from_secs(4);

/// Idle connections kept per engine.
const MAX_IDLE: usize = 256;

/// What the read buffer grows by when it is full (an SSE event is a few hundred bytes).
const READ_CHUNK: usize = 1024;

/// Largest answer head read.
const MAX_HEAD: usize = 64 * 1024;

/// Most headers an answer head may have.
const MAX_HEADERS: usize = 64;

/// An open connection and what was read on it past the last answer (nothing, between answers).
struct Conn {
    io: TcpStream,
    buf: BytesMut,
}

/// A connection back in the pool, and since when.
struct Idle {
    conn: Conn,
    since: Instant,
}

/// The idle connections by engine, the most recently used last.
#[derive(Default)]
pub struct Pools {
    idle: Mutex<HashMap<Authority, Vec<Idle>>>,
}

/// Why a call failed.
#[derive(Debug, thiserror::Error)]
pub enum RawError {
    #[error("the request URI has no authority")]
    NoAuthority,
    #[error(transparent)]
    Io(#[from] io::Error),
    #[error("the answer's head does not parse: {0}")]
    Head(String),
    /// Closed before any byte of an answer: on a reused connection, the engine closed it as
    /// the request went out, and the request can go once more on a fresh one.
    #[error("the connection closed before an answer")]
    Closed,
}

impl Pools {
    /// `request` (an absolute URI) on a pooled connection to its engine, or a new one; sent
    /// once more on a new connection when a reused one closes before the answer.
    pub async fn request(
        self: &Arc<Self>,
        request: Request<Full<Bytes>>,
    ) -> Result<Response<RawBody>, RawError> {
        let authority = request
            .uri()
            .authority()
            .cloned()
            .ok_or(RawError::NoAuthority)?;
        let (parts, body) = request.into_parts();
        let body = http_body_util::BodyExt::collect(body)
            .await
            .map(|whole| whole.to_bytes())
            .unwrap_or_else(|never| match never {});
        let wire = head_and_body(&parts, &authority, &body);
        if let Some(conn) = self.checkout(&authority) {
            match exchange(conn, &wire).await {
                Err(RawError::Closed) => {}
                answer => return answer.map(|answer| self.raw(answer, authority)),
            }
        }
        let io = TcpStream::connect(authority.as_str()).await?;
        io.set_nodelay(true)?;
        let conn = Conn {
            io,
            buf: BytesMut::new(),
        };
        exchange(conn, &wire)
            .await
            .map(|answer| self.raw(answer, authority))
    }

    fn raw(self: &Arc<Self>, answer: Answer, authority: Authority) -> Response<RawBody> {
        let Answer {
            head,
            conn,
            framing,
            reusable,
        } = answer;
        head.map(|()| RawBody {
            conn: Some(conn),
            framing,
            reusable,
            authority,
            pools: Arc::clone(self),
        })
    }

    /// The most recent idle connection to `authority` that the engine has not closed.
    fn checkout(&self, authority: &Authority) -> Option<Conn> {
        loop {
            let Idle { conn, since } =
                self.with_idle(|idle| idle.get_mut(authority).and_then(Vec::pop))?;
            if since.elapsed() >= IDLE_EXPIRY {
                // Older ones lie below it: all expired.
                self.with_idle(|idle| idle.remove(authority));
                return None;
            }
            // Nothing to read (WouldBlock): still open. An end (0) or stray bytes: unusable.
            if matches!(conn.io.try_read(&mut [0; 1]), Err(e) if e.kind() == io::ErrorKind::WouldBlock)
            {
                return Some(conn);
            }
        }
    }

    fn checkin(&self, authority: Authority, conn: Conn) {
        self.with_idle(|idle| {
            let idle = idle.entry(authority).or_default();
            if idle.len() < MAX_IDLE {
                idle.push(Idle {
                    conn,
                    since: Instant::now(),
                });
            }
        });
    }

    fn with_idle<R>(&self, f: impl FnOnce(&mut HashMap<Authority, Vec<Idle>>) -> R) -> R {
        f(&mut self.idle.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

/// The request as written: its head (origin-form, `Host`, `Content-Length`) and body.
fn head_and_body(parts: &http::request::Parts, authority: &Authority, body: &Bytes) -> Vec<u8> {
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let mut wire = Vec::with_capacity(256 + body.len());
    wire.extend_from_slice(parts.method.as_str().as_bytes());
    wire.push(b' ');
    wire.extend_from_slice(path.as_bytes());
    wire.extend_from_slice(b" HTTP/1.1\r\nhost: ");
    wire.extend_from_slice(authority.as_str().as_bytes());
    for (name, value) in &parts.headers {
        if name != http::header::HOST && name != http::header::CONTENT_LENGTH {
            wire.extend_from_slice(b"\r\n");
            wire.extend_from_slice(name.as_str().as_bytes());
            wire.extend_from_slice(b": ");
            wire.extend_from_slice(value.as_bytes());
        }
    }
    wire.extend_from_slice(format!("\r\ncontent-length: {}\r\n\r\n", body.len()).as_bytes());
    wire.extend_from_slice(body);
    wire
}

/// An answer's head, the connection its body is to be read from, and how.
struct Answer {
    head: Response<()>,
    conn: Conn,
    framing: Framing,
    reusable: bool,
}

/// How an answer's body ends.
#[derive(Debug, Clone, Copy)]
enum Framing {
    /// This many bytes still to read.
    Length(u64),
    /// Chunked: at a chunk's size line, or this many bytes into a chunk's data (then its CRLF).
    ChunkSize,
    ChunkData(u64),
    ChunkEnd,
    /// After the last chunk: trailer lines until an empty one.
    Trailers,
    /// Until the connection closes.
    Close,
    Done,
}

/// `wire` written on `conn`, and the answer's head read.
async fn exchange(mut conn: Conn, wire: &[u8]) -> Result<Answer, RawError> {
    if conn.io.write_all(wire).await.is_err() {
        return Err(RawError::Closed);
    }
    loop {
        if let Some(answer) = parse_head(&mut conn.buf)? {
            let (head, framing, reusable) = answer;
            return Ok(Answer {
                head,
                conn,
                framing,
                reusable,
            });
        }
        if conn.buf.len() >= MAX_HEAD {
            return Err(RawError::Head("over 64 KiB".into()));
        }
        conn.buf.reserve(READ_CHUNK);
        let read = std::future::poll_fn(|cx| poll_read_buf(&mut conn.io, &mut conn.buf, cx)).await;
        match read {
            Ok(0) | Err(_) if conn.buf.is_empty() => return Err(RawError::Closed),
            Ok(0) => return Err(RawError::Head("closed within the head".into())),
            Ok(_) => {}
            Err(e) => return Err(e.into()),
        }
    }
}

/// Read what the socket has into `buf`'s spare capacity.
fn poll_read_buf(
    io: &mut TcpStream,
    buf: &mut BytesMut,
    cx: &mut Context<'_>,
) -> Poll<io::Result<usize>> {
    loop {
        ready!(io.poll_read_ready(cx))?;
        match io.try_read_buf(buf) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            read => return Poll::Ready(read),
        }
    }
}

type Head = (Response<()>, Framing, bool);

/// The answer's head from the front of `buf`, once it is all there.
fn parse_head(buf: &mut BytesMut) -> Result<Option<Head>, RawError> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut parsed = httparse::Response::new(&mut headers);
    let httparse::Status::Complete(len) = parsed
        .parse(buf)
        .map_err(|e| RawError::Head(e.to_string()))?
    else {
        return Ok(None);
    };
    let status = parsed.code.unwrap_or(0);
    let mut head = Response::builder().status(status);
    let mut framing = Framing::Close;
    let mut reusable = parsed.version == Some(1);
    for header in parsed.headers.iter() {
        let name = header.name;
        if name.eq_ignore_ascii_case("content-length") {
            let length = std::str::from_utf8(header.value)
                .ok()
                .and_then(|v| v.trim().parse().ok())
                .ok_or_else(|| RawError::Head("a bad Content-Length".into()))?;
            framing = Framing::Length(length);
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            framing = Framing::ChunkSize;
        } else if name.eq_ignore_ascii_case("connection") {
            reusable &= !header.value.eq_ignore_ascii_case(b"close");
        } else {
            head = head.header(name, header.value);
        }
    }
    if matches!(framing, Framing::Close) {
        reusable = false;
    }
    let head = head.body(()).map_err(|e| RawError::Head(e.to_string()))?;
    buf.advance(len);
    Ok(Some((head, framing, reusable)))
}

/// An engine's answer body, read from its connection in the request's task.
pub struct RawBody {
    /// `None` once the body ended and its connection went back to the pool.
    conn: Option<Conn>,
    framing: Framing,
    reusable: bool,
    authority: Authority,
    pools: Arc<Pools>,
}

impl RawBody {
    /// The next piece of body data in `buf`, if a whole one is there; moves the framing on.
    fn decode(&mut self) -> Result<Option<Bytes>, io::Error> {
        let Some(conn) = self.conn.as_mut() else {
            return Ok(None);
        };
        let buf = &mut conn.buf;
        loop {
            match self.framing {
                Framing::Length(0) | Framing::Done => {
                    self.framing = Framing::Done;
                    return Ok(None);
                }
                Framing::Length(left) | Framing::ChunkData(left) => {
                    if buf.is_empty() {
                        return Ok(None);
                    }
                    let n = (left as usize).min(buf.len());
                    let data = buf.split_to(n).freeze();
                    self.framing = match self.framing {
                        Framing::Length(_) => Framing::Length(left - n as u64),
                        _ if left == n as u64 => Framing::ChunkEnd,
                        _ => Framing::ChunkData(left - n as u64),
                    };
                    return Ok(Some(data));
                }
                Framing::Close => {
                    if buf.is_empty() {
                        return Ok(None);
                    }
                    return Ok(Some(buf.split().freeze()));
                }
                Framing::ChunkEnd => {
                    if buf.len() < 2 {
                        return Ok(None);
                    }
                    if &buf[..2] != b"\r\n" {
                        return Err(io::Error::other("a chunk without its CRLF"));
                    }
                    buf.advance(2);
                    self.framing = Framing::ChunkSize;
                }
                Framing::ChunkSize | Framing::Trailers => {
                    let Some(end) = buf.windows(2).position(|w| w == b"\r\n") else {
                        return Ok(None);
                    };
                    let line = buf.split_to(end + 2);
                    let line = &line[..end];
                    if let Framing::Trailers = self.framing {
                        if line.is_empty() {
                            self.framing = Framing::Done;
                        }
                        continue;
                    }
                    let hex = line.split(|b| *b == b';').next().unwrap_or_default();
                    let size = std::str::from_utf8(hex)
                        .ok()
                        .and_then(|h| u64::from_str_radix(h.trim(), 16).ok())
                        .ok_or_else(|| io::Error::other("a bad chunk size"))?;
                    self.framing = if size == 0 {
                        Framing::Trailers
                    } else {
                        Framing::ChunkData(size)
                    };
                }
            }
        }
    }

    /// The body ended: its connection back to the pool when it can take another request.
    fn finish(&mut self) {
        if let Some(conn) = self.conn.take()
            && self.reusable
            && conn.buf.is_empty()
        {
            self.pools.checkin(
                self.authority.clone(),
                Conn {
                    io: conn.io,
                    // Between answers a connection holds no buffer.
                    buf: BytesMut::new(),
                },
            );
        }
    }
}

impl Body for RawBody {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        let this = self.get_mut();
        loop {
            if let Some(data) = this.decode()? {
                if matches!(this.framing, Framing::Length(0)) {
                    this.framing = Framing::Done;
                    this.finish();
                }
                return Poll::Ready(Some(Ok(Frame::data(data))));
            }
            if matches!(this.framing, Framing::Done) {
                this.finish();
                return Poll::Ready(None);
            }
            let Some(conn) = this.conn.as_mut() else {
                return Poll::Ready(None);
            };
            if conn.buf.capacity() == conn.buf.len() {
                conn.buf.reserve(READ_CHUNK);
            }
            if ready!(poll_read_buf(&mut conn.io, &mut conn.buf, cx))? == 0 {
                this.conn = None;
                return Poll::Ready(match this.framing {
                    Framing::Close => None,
                    _ => Some(Err(io::ErrorKind::UnexpectedEof.into())),
                });
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(self.framing, Framing::Done | Framing::Length(0))
    }

    fn size_hint(&self) -> SizeHint {
        match self.framing {
            Framing::Length(left) => SizeHint::with_exact(left),
            Framing::Done => SizeHint::with_exact(0),
            _ => SizeHint::default(),
        }
    }
}

impl Drop for RawBody {
    /// A body the server stopped reading at its end (`is_end_stream`) still returns its
    /// connection; one dropped before (the client went away) closes it.
    fn drop(&mut self) {
        if self.is_end_stream() {
            self.finish();
        }
    }
}
