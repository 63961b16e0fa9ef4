//! HTTP/1.1 on one engine connection, written here on `httparse` rather than driven by hyper's
//! client: no task and no request channel per connection, the request written from one buffer,
//! and a read buffer that starts empty and grows [`READ_CHUNK`] at a time. The request's own
//! task reads the answer, its head in [`Conn::read_head`] and its body in
//! [`Conn::poll_body`] (hyper's client took 27.8 KiB more heap per open stream and 3–5 µs more
//! CPU per call on the pass-through proxy; the book's "An engine connection driven by the
//! request's task").
//!
//! What it reads of an answer, and what it refuses:
//!
//! ```text
//! head       at most MAX_HEAD bytes and MAX_HEADERS headers (hyper's 100); 1xx heads skipped,
//!            101 refused (the router upgrades nothing)
//! body       none for 204 and 304 (the router sends no HEAD); chunked when Transfer-Encoding
//!            ends in `chunked` (decoded by `crate::http1::framing`); Content-Length; otherwise
//!            until the connection closes
//! keep-alive HTTP/1.1 unless `Connection: close`, HTTP/1.0 only with `Connection: keep-alive`,
//!            never after a close-delimited body, a Transfer-Encoding beside a Content-Length,
//!            or bytes past the body's end
//! ```

use std::io::{self, Write as _};
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::{Buf, Bytes, BytesMut};
use http::{HeaderMap, HeaderName, StatusCode};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};

use crate::http1::framing::{self, Delimiting, Framing, decode};

/// What the read buffer grows by when it runs short: an SSE event is a few hundred bytes, and
/// a stream's buffer is most of what a connection costs while it is open. It also bounds what
/// is read ahead of the relay: a backlog the client has not taken waits in the kernel's socket
/// buffer, and TCP slows the engine down.
const READ_CHUNK: usize = 1024;

/// Largest answer head read (status line, headers, the blank line): the 16 KiB hyper's read
/// buffer was held to before. Engines' heads are a few hundred bytes.
pub(super) const MAX_HEAD: usize = 16 * 1024;

/// Most headers an answer head may have (hyper's default).
const MAX_HEADERS: usize = 100;

/// The media type of a streamed answer.
const EVENT_STREAM: &[u8] = b"text/event-stream";

/// Why an exchange on a connection failed.
#[derive(Debug, thiserror::Error)]
pub(super) enum Http1Error {
    /// Closed, reset or unwritable before any byte of an answer: on a reused connection, the
    /// engine closed it as the request went out.
    #[error("the connection closed before an answer")]
    Closed(#[source] io::Error),
    #[error("the answer's head does not parse")]
    Head(#[from] httparse::Error),
    #[error("the answer's head is unusable: {0}")]
    HeadField(&'static str),
    #[error("the answer's head is over {MAX_HEAD} bytes")]
    HeadTooLarge,
    #[error("the answer's body is malformed")]
    Framing(#[from] framing::Error),
    /// The answer started and then broke off (closed early, reset, unreadable).
    #[error("the answer broke off")]
    Broken(#[source] io::Error),
}

/// An open connection and the bytes read on it that nothing has consumed yet (none between
/// answers, when it holds no buffer at all).
#[derive(Debug)]
pub(super) struct Conn<IO> {
    io: IO,
    buf: BytesMut,
}

/// An answer's head as far as the router reads it, its body still on the connection. Of the
/// headers only the framing ones and whether the body is an event stream are kept: no header
/// map is built (and every value copied into it) only to be dropped unread.
#[derive(Debug)]
pub(super) struct Head {
    pub(super) status: StatusCode,
    /// Whether `Content-Type` says `text/event-stream`.
    pub(super) event_stream: bool,
    pub(super) body: Framing,
    /// Whether the connection can take another request once the body is read to its end.
    pub(super) keep_alive: bool,
}

impl<IO: AsyncRead + AsyncWrite + Unpin> Conn<IO> {
    pub(super) fn new(io: IO) -> Conn<IO> {
        Conn {
            io,
            buf: BytesMut::new(),
        }
    }

    /// `request` written whole. A failure here is [`Http1Error::Closed`]: no answer started.
    pub(super) async fn write(&mut self, request: &[u8]) -> Result<(), Http1Error> {
        self.io
            .write_all(request)
            .await
            .map_err(Http1Error::Closed)?;
        self.io.flush().await.map_err(Http1Error::Closed)
    }

    /// The answer's head, 1xx ones skipped.
    pub(super) async fn read_head(&mut self) -> Result<Head, Http1Error> {
        let mut answered = false;
        loop {
            if let Some(head) = parse_head(&mut self.buf)? {
                if !head.status.is_informational() {
                    return Ok(head);
                }
                answered = true;
                continue;
            }
            if self.buf.len() >= MAX_HEAD {
                return Err(Http1Error::HeadTooLarge);
            }
            let read = std::future::poll_fn(|cx| self.poll_read(cx)).await;
            let started = answered || !self.buf.is_empty();
            match read {
                Ok(0) if !started => {
                    return Err(Http1Error::Closed(io::ErrorKind::UnexpectedEof.into()));
                }
                Err(e) if !started => return Err(Http1Error::Closed(e)),
                Ok(0) => return Err(Http1Error::Broken(io::ErrorKind::UnexpectedEof.into())),
                Err(e) => return Err(Http1Error::Broken(e)),
                Ok(_) => {}
            }
        }
    }

    /// The body's next data, as far as `framing` (moved on) says it goes: `None` at its end.
    /// Bytes past the end stay in the buffer (see [`Conn::is_reusable`]).
    pub(super) fn poll_body(
        &mut self,
        framing: &mut Framing,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Bytes, Http1Error>>> {
        loop {
            if let Some(data) = decode(framing, &mut self.buf)? {
                return Poll::Ready(Some(Ok(data)));
            }
            if *framing == Framing::Done {
                return Poll::Ready(None);
            }
            match ready!(self.poll_read(cx)) {
                Ok(0) if *framing == Framing::Close => {
                    *framing = Framing::Done;
                    return Poll::Ready(None);
                }
                Ok(0) => {
                    let eof = io::ErrorKind::UnexpectedEof.into();
                    return Poll::Ready(Some(Err(Http1Error::Broken(eof))));
                }
                Ok(_) => {}
                Err(e) => return Poll::Ready(Some(Err(Http1Error::Broken(e)))),
            }
        }
    }

    /// Whether the connection, its last answer read to the end, has nothing left over: a
    /// byte past the body is one the engine should not have sent.
    pub(super) fn is_reusable(&self) -> bool {
        self.buf.is_empty()
    }

    /// The connection as it waits between answers: no buffer.
    pub(super) fn idle(self) -> Conn<IO> {
        Conn {
            io: self.io,
            buf: BytesMut::new(),
        }
    }

    /// Whether an idle connection still looks open: nothing to read yet. An end (the engine
    /// closed it), an error, or a stray byte each make it unusable. Checked without waiting,
    /// so it cannot catch a close that is on its way: that is [`Http1Error::Closed`]'s case.
    pub(super) fn is_open(&mut self) -> bool {
        let mut byte = [0u8; 1];
        let mut probe = ReadBuf::new(&mut byte);
        let mut cx = Context::from_waker(std::task::Waker::noop());
        matches!(
            Pin::new(&mut self.io).poll_read(&mut cx, &mut probe),
            Poll::Pending
        )
    }

    /// What the socket has, into the buffer's spare room (grown when it runs short).
    fn poll_read(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        if self.buf.capacity() - self.buf.len() < READ_CHUNK / 4 {
            self.buf.reserve(READ_CHUNK);
        }
        tokio_util::io::poll_read_buf(Pin::new(&mut self.io), cx, &mut self.buf)
    }
}

/// The head at the front of `buf`, consumed, once it is all there.
fn parse_head(buf: &mut BytesMut) -> Result<Option<Head>, Http1Error> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut parsed = httparse::Response::new(&mut headers);
    let httparse::Status::Complete(len) = parsed.parse(buf)? else {
        return Ok(None);
    };
    let status = parsed
        .code
        .and_then(|code| StatusCode::from_u16(code).ok())
        .ok_or(Http1Error::HeadField("a status outside 100-999"))?;
    if status == StatusCode::SWITCHING_PROTOCOLS {
        return Err(Http1Error::HeadField("101: the router upgrades nothing"));
    }
    let mut content_type = None;
    let mut delimiting = Delimiting::default();
    for header in parsed.headers.iter() {
        // httparse has checked the name is a token; the value as `HeaderValue` would.
        if !is_header_value(header.value) {
            return Err(Http1Error::HeadField("a header value"));
        }
        delimiting
            .read(header.name, header.value)
            .map_err(|e| Http1Error::HeadField(e.0))?;
        if header.name.eq_ignore_ascii_case("content-type") {
            content_type.get_or_insert(header.value);
        }
    }
    let Delimiting {
        length, chunked, ..
    } = delimiting;
    let body = if status.is_informational()
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED
    {
        Framing::Done
    } else {
        match (chunked, length) {
            (Some(true), _) => Framing::ChunkSize,
            (Some(false), _) | (None, None) => Framing::Close,
            (None, Some(0)) => Framing::Done,
            (None, Some(n)) => Framing::Length(n),
        }
    };
    // A Transfer-Encoding beside a Content-Length may be a smuggling attempt: read by the
    // former, never reused (RFC 9112 §6.3).
    let ambiguous = chunked.is_some() && length.is_some();
    let keep_alive =
        delimiting.persistent(parsed.version == Some(0)) && body != Framing::Close && !ambiguous;
    // The first Content-Type, as text (as `HeaderValue::to_str` reads it).
    let event_stream = content_type.is_some_and(|v| v.is_ascii() && v.starts_with(EVENT_STREAM));
    buf.advance(len);
    Ok(Some(Head {
        status,
        event_stream,
        body,
        keep_alive,
    }))
}

/// A request as it goes on the wire, written straight into the one buffer it is sent from:
/// the request line, the headers, then `Content-Length` and the body ([`Request::finish`]).
/// No `http::Request` is built only to be written out again.
#[derive(Debug)]
pub(super) struct Request(Vec<u8>);

impl Request {
    /// The request line of `method` on `prefix` followed by `path` (both from `/`), with room
    /// for `body_len` bytes of body. The caller vouches for the path: the engine's base URI's
    /// own, and the router's route.
    pub(super) fn start(
        method: &http::Method,
        prefix: &str,
        path: &str,
        body_len: usize,
    ) -> Request {
        let mut wire = Vec::with_capacity(256 + body_len);
        wire.extend_from_slice(method.as_str().as_bytes());
        wire.push(b' ');
        wire.extend_from_slice(prefix.as_bytes());
        wire.extend_from_slice(path.as_bytes());
        wire.extend_from_slice(b" HTTP/1.1\r\n");
        Request(wire)
    }

    /// One header line; `value` is a valid header value (see [`is_header_value`]).
    pub(super) fn header(&mut self, name: &HeaderName, value: &[u8]) {
        self.0.extend_from_slice(name.as_str().as_bytes());
        self.0.extend_from_slice(b": ");
        self.0.extend_from_slice(value);
        self.0.extend_from_slice(b"\r\n");
    }

    /// Every header of `headers`.
    pub(super) fn headers(&mut self, headers: &HeaderMap) {
        for (name, value) in headers {
            self.header(name, value.as_bytes());
        }
    }

    /// The request as written: `Content-Length` when it has a body, and the body.
    pub(super) fn finish(self, body: Option<&[u8]>) -> Vec<u8> {
        let mut wire = self.0;
        if let Some(body) = body {
            // Writing into a Vec cannot fail.
            let _ = write!(wire, "content-length: {}\r\n\r\n", body.len());
            wire.extend_from_slice(body);
        } else {
            wire.extend_from_slice(b"\r\n");
        }
        wire
    }
}

/// Whether `value` may be written as a header's value as it is: what `http::HeaderValue`
/// accepts (visible bytes, spaces and tabs; no control byte, so no line break).
pub(super) fn is_header_value(value: &[u8]) -> bool {
    value
        .iter()
        .all(|&b| b == b'\t' || (b >= b' ' && b != 0x7f))
}

#[cfg(test)]
mod tests;
