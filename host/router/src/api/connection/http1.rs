//! The server side of an HTTP/1.1 client connection, written here on `httparse` rather than
//! served by hyper's `http1::Builder`: a read buffer that starts empty, grows [`READ_CHUNK`] at
//! a time (more only for a big head or body) and is shrunk back between requests; a response
//! head written from a small buffer reused across requests, with the first body bytes when they
//! are ready; the request's body read by the handler's own task from the connection it borrows
//! (hyper's server held two 8 KiB read buffers and an 8 KiB head buffer per open stream:
//! `passthrough --own-server` measured 9.3 KiB of RSS and 3.6 µs of CPU per request less).
//!
//! What it reads of a request, and what it refuses:
//!
//! ```text
//! head       at most MAX_HEAD bytes and MAX_HEADERS headers, else 431 and the connection
//!            closed; anything httparse refuses (obsolete line folding included) 400 and closed
//! body       Content-Length (one value, or repeats of the same one); chunked when
//!            Transfer-Encoding ends in `chunked` (crate::http1::framing); none otherwise.
//!            400 and closed for both headers at once, a Content-Length that is no number or
//!            two that differ, a Transfer-Encoding not ending in chunked (RFC 9112 §6.3)
//! expect     `100-continue` answered when the handler first reads the body
//! keep-alive HTTP/1.1 unless `Connection: close`, HTTP/1.0 only with `Connection: keep-alive`;
//!            after a body the handler did not read to its end only when the rest is already
//!            buffered; requests pipelined behind one are served in order
//! ```
//!
//! And what it writes: `content-length` when the response body's size is known, chunked when
//! not (close-delimited to an HTTP/1.0 client), no body to a HEAD, `date` once per second per
//! thread as hyper writes it. A client that closes its connection while a response streams ends
//! the response (its body is dropped, so the handler's guards fire); a write error ends the
//! connection.

use std::cell::RefCell;
use std::future::Future;
use std::io::{self, Write as _};
use std::pin::{Pin, pin};
use std::task::{Context, Poll, ready};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::{Buf, Bytes, BytesMut};
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, Response, StatusCode, Version};
use hyper::body::{Body as HttpBody, Frame, SizeHint};
use switchyard_wire::error::{ErrorBody, INVALID_REQUEST_ERROR};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::sync::oneshot;

use crate::http1::framing::{self, Delimiting, Framing, decode};

/// What the read buffer grows by when it runs short: a request head is a few hundred bytes.
const READ_CHUNK: usize = 1024;

/// Largest request head (request line, headers, the blank line). hyper's bound was ~400 KiB;
/// the router's clients send a few hundred bytes, and a head is buffered whole.
pub const MAX_HEAD: usize = 64 * 1024;

/// Most headers a request may have (hyper's default).
const MAX_HEADERS: usize = 100;

/// Above this much spare room, the read buffer is let go between requests.
const KEEP_BUF: usize = 4 * READ_CHUNK;

/// Response body bytes gathered into one write: a frame that would take the gathered bytes past
/// this goes out on its own instead of being copied. What is gathered waits in the
/// connection's buffer while the client is slow to read, for every open stream at once (at
/// 16 KiB, 4,096 streams that fell behind grew the router's RSS by 109–111 KiB each, at 4 KiB
/// by 48–55; 1,024 that kept up, 27–31 either way).
const COALESCE: usize = 4 * 1024;

/// A connection's byte stream, as the server and a request's body take turns with it.
pub trait Io: AsyncRead + AsyncWrite + Send + Sync + Unpin + 'static {}

impl<T: AsyncRead + AsyncWrite + Send + Sync + Unpin + 'static> Io for T {}

/// Why a connection ended other than by a close between requests.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("reading the connection failed")]
    Read(#[source] io::Error),
    #[error("writing the connection failed")]
    Write(#[source] io::Error),
    #[error("the request's head is refused: {0}")]
    Head(&'static str),
    #[error("the client closed the connection while its response streamed")]
    ClientGone,
    #[error("the response's body failed")]
    ResponseBody,
    /// More or fewer bytes than the body's exact size said: the connection is closed rather
    /// than leave the client to read a response's end in the wrong place.
    #[error("the response's body is not the size it said")]
    BodyLength,
}

/// Why a request's body could not be read.
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    #[error("the request body's framing is broken")]
    Framing(#[from] framing::Error),
    #[error("the connection broke off within the request body")]
    Broken(#[source] io::Error),
}

/// The connection and what was read on it and not yet consumed.
struct Conn {
    io: Box<dyn Io>,
    buf: BytesMut,
}

impl Conn {
    /// What the socket has, into the buffer's spare room (grown by `want`, at least
    /// [`READ_CHUNK`], when short).
    fn poll_read(&mut self, cx: &mut Context<'_>, want: usize) -> Poll<io::Result<usize>> {
        if self.buf.capacity() - self.buf.len() < READ_CHUNK / 4 {
            self.buf.reserve(want.clamp(READ_CHUNK, 64 * 1024));
        }
        tokio_util::io::poll_read_buf(Pin::new(&mut self.io), cx, &mut self.buf)
    }

    async fn read(&mut self, want: usize) -> io::Result<usize> {
        std::future::poll_fn(|cx| self.poll_read(cx, want)).await
    }

    /// Between requests: a buffer grown for a big head or body is let go.
    fn shrink(&mut self) {
        if self.buf.is_empty() && self.buf.capacity() > KEEP_BUF {
            self.buf = BytesMut::new();
        }
    }
}

/// A request's body, read from its connection by whoever holds it; the connection goes back to
/// the server when the body is dropped.
pub struct Body {
    conn: Option<Conn>,
    framing: Framing,
    /// `100 Continue` still to be written before the first read (its bytes left).
    interim: &'static [u8],
    back: Option<oneshot::Sender<(Conn, Framing)>>,
}

const CONTINUE: &[u8] = b"HTTP/1.1 100 Continue\r\n\r\n";

impl std::fmt::Debug for Body {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Body")
            .field("framing", &self.framing)
            .finish_non_exhaustive()
    }
}

impl Drop for Body {
    fn drop(&mut self) {
        if let (Some(conn), Some(back)) = (self.conn.take(), self.back.take()) {
            let _ = back.send((conn, self.framing));
        }
    }
}

impl HttpBody for Body {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let this = &mut *self;
        let Some(conn) = this.conn.as_mut() else {
            return Poll::Ready(None);
        };
        if this.framing == Framing::Done {
            return Poll::Ready(None);
        }
        while !this.interim.is_empty() {
            let n = ready!(Pin::new(&mut conn.io).poll_write(cx, this.interim))
                .map_err(BodyError::Broken)?;
            if n == 0 {
                let closed = io::ErrorKind::WriteZero.into();
                return Poll::Ready(Some(Err(BodyError::Broken(closed))));
            }
            this.interim = &this.interim[n..];
        }
        loop {
            if let Some(data) = decode(&mut this.framing, &mut conn.buf)? {
                return Poll::Ready(Some(Ok(Frame::data(data))));
            }
            if this.framing == Framing::Done {
                return Poll::Ready(None);
            }
            let want = match this.framing {
                Framing::Length(left) | Framing::ChunkData(left) => {
                    usize::try_from(left).unwrap_or(usize::MAX)
                }
                _ => READ_CHUNK,
            };
            match ready!(conn.poll_read(cx, want)) {
                Ok(0) => {
                    let eof = io::ErrorKind::UnexpectedEof.into();
                    return Poll::Ready(Some(Err(BodyError::Broken(eof))));
                }
                Ok(_) => {}
                Err(e) => return Poll::Ready(Some(Err(BodyError::Broken(e)))),
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.framing == Framing::Done
    }

    fn size_hint(&self) -> SizeHint {
        match self.framing {
            Framing::Length(left) => SizeHint::with_exact(left),
            Framing::Done => SizeHint::with_exact(0),
            _ => SizeHint::default(),
        }
    }
}

/// A request's head as parsed, and what it says about the connection.
struct Head {
    request: Request<()>,
    framing: Framing,
    keep_alive: bool,
    expect_continue: bool,
}

/// Why a head was refused: the status answered before the connection is closed.
struct Refused {
    status: StatusCode,
    why: &'static str,
}

impl Refused {
    fn bad(why: &'static str) -> Refused {
        Refused {
            status: StatusCode::BAD_REQUEST,
            why,
        }
    }
}

/// The head at the front of `buf`, consumed, once it is all there.
fn parse_head(buf: &mut BytesMut) -> Result<Option<Head>, Refused> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut parsed = httparse::Request::new(&mut headers);
    let len = match parsed.parse(buf) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(httparse::Error::TooManyHeaders) => {
            return Err(Refused {
                status: StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
                why: "too many headers",
            });
        }
        Err(_) => return Err(Refused::bad("the head does not parse")),
    };
    let version = match parsed.version {
        Some(0) => Version::HTTP_10,
        _ => Version::HTTP_11,
    };
    let method = Method::from_bytes(parsed.method.unwrap_or_default().as_bytes())
        .map_err(|_| Refused::bad("a method"))?;
    let uri: http::Uri = parsed
        .path
        .unwrap_or_default()
        .parse()
        .map_err(|_| Refused::bad("a request target"))?;
    let mut map = HeaderMap::with_capacity(parsed.headers.len());
    let mut delimiting = Delimiting::default();
    let mut expect_continue = false;
    for header in parsed.headers.iter() {
        let name = HeaderName::from_bytes(header.name.as_bytes())
            .map_err(|_| Refused::bad("a header name"))?;
        let value =
            HeaderValue::from_bytes(header.value).map_err(|_| Refused::bad("a header value"))?;
        delimiting
            .read(header.name, header.value)
            .map_err(|e| Refused::bad(e.0))?;
        if name == http::header::EXPECT {
            expect_continue = header.value.eq_ignore_ascii_case(b"100-continue");
        }
        map.append(name, value);
    }
    // Both framings, or a coding the server cannot end: the way to request smuggling.
    let framing = match (delimiting.chunked, delimiting.length) {
        (Some(_), Some(_)) => return Err(Refused::bad("Transfer-Encoding beside Content-Length")),
        (Some(false), None) => return Err(Refused::bad("a Transfer-Encoding not chunked")),
        (Some(true), None) => Framing::ChunkSize,
        (None, None | Some(0)) => Framing::Done,
        (None, Some(n)) => Framing::Length(n),
    };
    let keep_alive = delimiting.persistent(version == Version::HTTP_10);
    let mut request = Request::new(());
    *request.method_mut() = method;
    *request.uri_mut() = uri;
    *request.version_mut() = version;
    *request.headers_mut() = map;
    buf.advance(len);
    Ok(Some(Head {
        request,
        framing,
        keep_alive,
        expect_continue: expect_continue && version == Version::HTTP_11 && framing != Framing::Done,
    }))
}

/// Serves HTTP/1.1 on `io` until the client closes it, a request asks for the close, an error
/// ends it, or `draining` resolves: then an idle connection closes at once and a busy one
/// after its response, which says `connection: close`.
pub async fn serve<H, F, B>(
    io: impl Io,
    mut handler: H,
    draining: impl Future<Output = ()>,
) -> Result<(), ServeError>
where
    H: FnMut(Request<Body>) -> F,
    F: Future<Output = Response<B>>,
    B: HttpBody<Data = Bytes> + Unpin,
{
    let mut conn = Conn {
        io: Box::new(io),
        buf: BytesMut::new(),
    };
    let mut out = Vec::new();
    let mut draining = pin!(futures::FutureExt::fuse(draining));
    loop {
        conn.shrink();
        let head = tokio::select! {
            head = read_head(&mut conn) => head,
            () = &mut draining, if conn.buf.is_empty() => return Ok(()),
        };
        let head = match head {
            Ok(Some(head)) => head,
            Ok(None) => return Ok(()),
            Err(HeadError::Read(e)) => return Err(ServeError::Read(e)),
            Err(HeadError::Refused(refused)) => {
                write_refusal(&mut conn, &mut out, &refused).await;
                return Err(ServeError::Head(refused.why));
            }
        };
        let Head {
            request,
            framing,
            keep_alive,
            expect_continue,
        } = head;
        let (parts, ()) = request.into_parts();
        let (back, returned) = oneshot::channel();
        let body = Body {
            conn: Some(conn),
            framing,
            interim: if expect_continue { CONTINUE } else { b"" },
            back: Some(back),
        };
        let is_head = parts.method == Method::HEAD;
        let version = parts.version;
        let handled = handler(Request::from_parts(parts, body));
        let (response, returned) = await_handler(handled, returned).await?;
        let (returned, framing) = returned;
        conn = returned;
        let rest_read = matches!(decode_buffered(framing, &mut conn.buf), Ok(Framing::Done));
        let draining_now = futures::poll!(&mut draining).is_ready();
        let keep_alive = keep_alive && rest_read && !draining_now;
        let reply = Reply {
            version,
            is_head,
            keep_alive,
        };
        if !write_response(&mut conn, &mut out, response, reply).await? {
            return Ok(());
        }
    }
}

/// The handler's response, and the connection its request's body gave back. Once the body is
/// back, the connection is watched while the handler works: the client closing it (hyper's
/// default, with no half-close) drops the handler, as hyper's server did.
async fn await_handler<F: Future>(
    handled: F,
    mut returned: oneshot::Receiver<(Conn, Framing)>,
) -> Result<(F::Output, (Conn, Framing)), ServeError> {
    let mut handled = pin!(handled);
    let mut back = None::<(Conn, Framing)>;
    let response = std::future::poll_fn(|cx| {
        if let Poll::Ready(response) = handled.as_mut().poll(cx) {
            return Poll::Ready(Ok(response));
        }
        if back.is_none() {
            match Pin::new(&mut returned).poll(cx) {
                Poll::Ready(Ok(conn)) => back = Some(conn),
                // The body was leaked with the connection in it: nothing to answer on.
                Poll::Ready(Err(_)) => return Poll::Ready(Err(ServeError::ClientGone)),
                Poll::Pending => return Poll::Pending,
            }
        }
        let Some((conn, _)) = back.as_mut() else {
            return Poll::Pending;
        };
        watch_close(conn, cx)
    })
    .await?;
    let back = match back {
        Some(back) => back,
        // The body comes back when the handler drops it, at the latest with its future.
        None => returned.await.map_err(|_| ServeError::ClientGone)?,
    };
    Ok((response, back))
}

/// Reads ahead on an otherwise idle connection (a pipelined request is buffered, up to a
/// head's bound) until it closes: `Ready` only with [`ServeError::ClientGone`].
fn watch_close<T>(conn: &mut Conn, cx: &mut Context<'_>) -> Poll<Result<T, ServeError>> {
    while conn.buf.len() < MAX_HEAD {
        match ready!(conn.poll_read(cx, READ_CHUNK)) {
            Ok(0) | Err(_) => return Poll::Ready(Err(ServeError::ClientGone)),
            Ok(_) => {}
        }
    }
    Poll::Pending
}

enum HeadError {
    Read(io::Error),
    Refused(Refused),
}

/// The next request's head; `None` when the client closed the connection between requests.
async fn read_head(conn: &mut Conn) -> Result<Option<Head>, HeadError> {
    loop {
        if !conn.buf.is_empty() {
            if let Some(head) = parse_head(&mut conn.buf).map_err(HeadError::Refused)? {
                return Ok(Some(head));
            }
            if conn.buf.len() >= MAX_HEAD {
                return Err(HeadError::Refused(Refused {
                    status: StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
                    why: "the head is too large",
                }));
            }
        }
        match conn.read(READ_CHUNK).await {
            Ok(0) if conn.buf.is_empty() => return Ok(None),
            Ok(0) => {
                return Err(HeadError::Read(io::ErrorKind::UnexpectedEof.into()));
            }
            Ok(_) => {}
            Err(e) => return Err(HeadError::Read(e)),
        }
    }
}

/// What is left of a body the handler did not read, decoded from what is already buffered
/// (and dropped): `Done` when it was all there.
fn decode_buffered(mut framing: Framing, buf: &mut BytesMut) -> Result<Framing, framing::Error> {
    while decode(&mut framing, buf)?.is_some() {}
    Ok(framing)
}

/// How a response is written.
#[derive(Clone, Copy)]
struct Reply {
    version: Version,
    is_head: bool,
    keep_alive: bool,
}

/// A refused head's answer: the status and an OpenAI error saying why (hyper's had no body),
/// the connection closing.
async fn write_refusal(conn: &mut Conn, out: &mut Vec<u8>, refused: &Refused) {
    let (message, code) = match refused.status {
        StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE => (
            format!(
                "the request's head is too large ({}; at most {MAX_HEAD} bytes and \
                 {MAX_HEADERS} headers)",
                refused.why
            ),
            "request_header_fields_too_large",
        ),
        _ => (
            format!("the request's head is malformed ({})", refused.why),
            "malformed_request",
        ),
    };
    let body = ErrorBody::new(message, INVALID_REQUEST_ERROR, None, Some(code));
    // Serializing strings and options into a Vec cannot fail.
    let body = serde_json::to_vec(&body).unwrap_or_default();
    out.clear();
    status_line(out, refused.status);
    let _ = write!(
        out,
        "content-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n",
        body.len()
    );
    date(out);
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(&body);
    let _ = conn.io.write_all(out).await;
    let _ = conn.io.shutdown().await;
}

/// How the body of a response goes on the wire.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Sending {
    None,
    /// This many bytes, the body's exact size: more or fewer end the connection.
    Length(u64),
    Chunked,
    UntilClose,
}

/// Writes `response`; `false` when the connection closes after it.
async fn write_response<B>(
    conn: &mut Conn,
    out: &mut Vec<u8>,
    response: Response<B>,
    reply: Reply,
) -> Result<bool, ServeError>
where
    B: HttpBody<Data = Bytes> + Unpin,
{
    let (parts, mut body) = response.into_parts();
    let bodiless = parts.status.is_informational()
        || parts.status == StatusCode::NO_CONTENT
        || parts.status == StatusCode::NOT_MODIFIED;
    let size = body.size_hint().exact();
    let sending = match (bodiless || reply.is_head, size, reply.version) {
        (true, ..) => Sending::None,
        (false, Some(size), _) => Sending::Length(size),
        (false, None, Version::HTTP_10) => Sending::UntilClose,
        (false, None, _) => Sending::Chunked,
    };
    let keep_alive = reply.keep_alive && sending != Sending::UntilClose;
    out.clear();
    status_line(out, parts.status);
    for (name, value) in &parts.headers {
        // The framing is the server's alone, from the body it writes: a handler's own length
        // or coding could disagree with it, and the client would read the next response out
        // of this one's bytes.
        if name == http::header::TRANSFER_ENCODING
            || name == http::header::CONNECTION
            || name == http::header::CONTENT_LENGTH
        {
            continue;
        }
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    if !bodiless && let Some(size) = size {
        // Writing into a Vec cannot fail.
        let _ = write!(out, "content-length: {size}\r\n");
    }
    if sending == Sending::Chunked {
        out.extend_from_slice(b"transfer-encoding: chunked\r\n");
    }
    match (keep_alive, reply.version) {
        (false, _) => out.extend_from_slice(b"connection: close\r\n"),
        (true, Version::HTTP_10) => out.extend_from_slice(b"connection: keep-alive\r\n"),
        (true, _) => {}
    }
    if !parts.headers.contains_key(http::header::DATE) {
        date(out);
    }
    out.extend_from_slice(b"\r\n");
    if sending != Sending::None {
        send_body(conn, out, &mut body, sending).await?;
    }
    drop(body);
    if !out.is_empty() {
        conn.io.write_all(out).await.map_err(ServeError::Write)?;
    }
    conn.io.flush().await.map_err(ServeError::Write)?;
    if out.capacity() > COALESCE {
        *out = Vec::new();
    }
    out.clear();
    if !keep_alive {
        let _ = conn.io.shutdown().await;
    }
    Ok(keep_alive)
}

/// The body's frames written behind the head in `out`: the frames ready at once gathered into
/// one write (up to [`COALESCE`] bytes), which goes out before the server waits for the next;
/// chunked when the size is not known. The client closing the connection while the server
/// waits ends the body.
async fn send_body<B>(
    conn: &mut Conn,
    out: &mut Vec<u8>,
    body: &mut B,
    sending: Sending,
) -> Result<(), ServeError>
where
    B: HttpBody<Data = Bytes> + Unpin,
{
    let mut left = match sending {
        Sending::Length(size) => size,
        _ => 0,
    };
    loop {
        let ready = std::future::poll_fn(|cx| Poll::Ready(poll_data(body, cx))).await;
        let next = match ready {
            Poll::Ready(next) => next?,
            Poll::Pending => {
                // Nothing more now: what is gathered goes out (a token must not wait).
                if !out.is_empty() {
                    conn.io.write_all(out).await.map_err(ServeError::Write)?;
                    out.clear();
                }
                std::future::poll_fn(|cx| match poll_data(body, cx) {
                    Poll::Ready(next) => Poll::Ready(next),
                    Poll::Pending => watch_close(conn, cx),
                })
                .await?
            }
        };
        let Some(data) = next else { break };
        if let Sending::Length(_) = sending {
            left = left
                .checked_sub(data.len() as u64)
                .ok_or(ServeError::BodyLength)?;
        }
        if sending == Sending::Chunked {
            // Writing into a Vec cannot fail.
            let _ = write!(out, "{:x}\r\n", data.len());
        }
        if out.len() + data.len() <= COALESCE {
            out.extend_from_slice(&data);
        } else {
            conn.io.write_all(out).await.map_err(ServeError::Write)?;
            out.clear();
            conn.io.write_all(&data).await.map_err(ServeError::Write)?;
        }
        if sending == Sending::Chunked {
            out.extend_from_slice(b"\r\n");
        }
        if out.len() >= COALESCE {
            conn.io.write_all(out).await.map_err(ServeError::Write)?;
            out.clear();
        }
    }
    match sending {
        Sending::Chunked => out.extend_from_slice(b"0\r\n\r\n"),
        Sending::Length(_) if left > 0 => return Err(ServeError::BodyLength),
        _ => {}
    }
    Ok(())
}

/// The body's next data, `None` at its end (trailers skipped: HTTP/1.1 responses here carry
/// none, and empty frames too).
fn poll_data<B>(body: &mut B, cx: &mut Context<'_>) -> Poll<Result<Option<Bytes>, ServeError>>
where
    B: HttpBody<Data = Bytes> + Unpin,
{
    loop {
        match ready!(Pin::new(&mut *body).poll_frame(cx)) {
            None => return Poll::Ready(Ok(None)),
            Some(Err(_)) => return Poll::Ready(Err(ServeError::ResponseBody)),
            Some(Ok(frame)) => match frame.into_data() {
                Ok(data) if !data.is_empty() => return Poll::Ready(Ok(Some(data))),
                _ => continue,
            },
        }
    }
}

fn status_line(out: &mut Vec<u8>, status: StatusCode) {
    out.extend_from_slice(b"HTTP/1.1 ");
    out.extend_from_slice(status.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(status.canonical_reason().unwrap_or("<none>").as_bytes());
    out.extend_from_slice(b"\r\n");
}

/// The `date` header, formatted once per second per thread as hyper caches it.
fn date(out: &mut Vec<u8>) {
    thread_local! {
        static DATE: RefCell<(u64, String)> = const { RefCell::new((0, String::new())) };
    }
    let now = SystemTime::now();
    let second = now
        .duration_since(UNIX_EPOCH)
        .unwrap_or(Duration::ZERO)
        .as_secs();
    DATE.with_borrow_mut(|(cached, text)| {
        if *cached != second || text.is_empty() {
            *cached = second;
            *text = httpdate::fmt_http_date(now);
        }
        out.extend_from_slice(b"date: ");
        out.extend_from_slice(text.as_bytes());
        out.extend_from_slice(b"\r\n");
    });
}

#[cfg(test)]
mod tests;
