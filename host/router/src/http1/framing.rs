//! HTTP/1.1 message bodies as both sides of the router read them: the engine client's answers
//! (`engine_client::http1`) and the server's requests. Only framing lives here (RFC 9112 §6,
//! §7.1): how a body ends and how chunked coding is decoded, on bytes already buffered; each
//! side reads its own socket and parses its own heads.

use bytes::{Buf, Bytes, BytesMut};

/// Longest chunk size line, extensions included.
pub(crate) const MAX_CHUNK_LINE: usize = 4096;

/// Most trailer bytes read after a chunked body's last chunk (CRLFs counted); they are read
/// and dropped. The engine client's bound on a head.
pub(crate) const MAX_TRAILERS: usize = 16 * 1024;

/// A body whose framing is broken: what is wrong with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Error(pub(crate) &'static str);

/// Where a body's reading stands, and how it ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Framing {
    /// This many bytes still to read.
    Length(u64),
    /// Chunked, at a chunk's size line.
    ChunkSize,
    /// Chunked, this many bytes into a chunk's data still to read, then its CRLF.
    ChunkData(u64),
    /// Chunked, at the CRLF after a chunk's data.
    ChunkEnd,
    /// After the last chunk: trailer lines, this many bytes of them so far, until an empty one.
    Trailers(usize),
    /// Until the connection closes.
    Close,
    /// Read to its end.
    Done,
}

/// What a head's framing headers say (RFC 9112 §6.1–6.3, §9.3): its Content-Length, its last
/// transfer coding, and its `Connection` options, read alike on both sides. What to do with an
/// ambiguous pair is each side's own: the server refuses a request, the engine client reads an
/// answer by its coding and does not reuse the connection.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Delimiting {
    /// The Content-Length (repeats of one value allowed).
    pub(crate) length: Option<u64>,
    /// Whether the last transfer coding is `chunked`, when a Transfer-Encoding was sent.
    pub(crate) chunked: Option<bool>,
    close: bool,
    keep_alive: bool,
}

impl Delimiting {
    /// Takes in one header if it is one of these; any other is left alone.
    pub(crate) fn read(&mut self, name: &str, value: &[u8]) -> Result<(), Error> {
        if name.eq_ignore_ascii_case("content-length") {
            for n in tokens(value) {
                let n = content_length(n).ok_or(Error("a Content-Length that is no number"))?;
                if self.length.is_some_and(|l| l != n) {
                    return Err(Error("Content-Lengths that differ"));
                }
                self.length = Some(n);
            }
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            // Only the last coding says how the body ends.
            if let Some(last) = tokens(value).last() {
                self.chunked = Some(last.eq_ignore_ascii_case(b"chunked"));
            }
        } else if name.eq_ignore_ascii_case("connection") {
            for token in tokens(value) {
                self.close |= token.eq_ignore_ascii_case(b"close");
                self.keep_alive |= token.eq_ignore_ascii_case(b"keep-alive");
            }
        }
        Ok(())
    }

    /// Whether the connection may carry another message after this one, as far as the head
    /// says: HTTP/1.1 unless `close`, HTTP/1.0 only with `keep-alive`.
    pub(crate) fn persistent(&self, http10: bool) -> bool {
        match http10 {
            true => self.keep_alive && !self.close,
            false => !self.close,
        }
    }
}

/// The comma-separated tokens of a header value, trimmed, empty ones skipped.
fn tokens(value: &[u8]) -> impl Iterator<Item = &[u8]> {
    value
        .split(|b| *b == b',')
        .map(<[u8]>::trim_ascii)
        .filter(|t| !t.is_empty())
}

/// A Content-Length value's number: ASCII digits only (no sign, no space).
fn content_length(digits: &[u8]) -> Option<u64> {
    if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(digits).ok()?.parse().ok()
}

/// The next body data in `buf`, if any is there, `framing` moved past it; `None` when more
/// must be read first, or at the end ([`Framing::Done`]).
pub(crate) fn decode(framing: &mut Framing, buf: &mut BytesMut) -> Result<Option<Bytes>, Error> {
    loop {
        match *framing {
            Framing::Done => return Ok(None),
            Framing::Length(left) | Framing::ChunkData(left) => {
                if buf.is_empty() {
                    return Ok(None);
                }
                let n = usize::try_from(left).unwrap_or(usize::MAX).min(buf.len());
                let left = left - n as u64;
                *framing = match (*framing, left) {
                    (Framing::Length(_), 0) => Framing::Done,
                    (Framing::Length(_), left) => Framing::Length(left),
                    (_, 0) => Framing::ChunkEnd,
                    (_, left) => Framing::ChunkData(left),
                };
                return Ok(Some(buf.split_to(n).freeze()));
            }
            Framing::Close => {
                return Ok((!buf.is_empty()).then(|| buf.split().freeze()));
            }
            Framing::ChunkEnd => {
                if buf.len() < 2 {
                    return Ok(None);
                }
                if &buf[..2] != b"\r\n" {
                    return Err(Error("a chunk runs past its size"));
                }
                buf.advance(2);
                *framing = Framing::ChunkSize;
            }
            Framing::ChunkSize => {
                let Some(line) = line(buf, MAX_CHUNK_LINE, "a chunk size line too long")? else {
                    return Ok(None);
                };
                *framing = match chunk_size(&line)? {
                    0 => Framing::Trailers(0),
                    size => Framing::ChunkData(size),
                };
            }
            Framing::Trailers(seen) => {
                // Each line's CRLF counts too, so `seen` may pass the bound by two.
                let room = MAX_TRAILERS.saturating_sub(seen);
                let Some(line) = line(buf, room, "trailers too long")? else {
                    return Ok(None);
                };
                *framing = match line.is_empty() {
                    true => Framing::Done,
                    false => Framing::Trailers(seen + line.len() + 2),
                };
            }
        }
    }
}

/// The CRLF-ended line at the front of `buf`, consumed, without its CRLF; an error once `max`
/// bytes came without one.
fn line(buf: &mut BytesMut, max: usize, too_long: &'static str) -> Result<Option<Bytes>, Error> {
    match buf.windows(2).position(|w| w == b"\r\n") {
        Some(end) if end <= max => {
            let line = buf.split_to(end).freeze();
            buf.advance(2);
            Ok(Some(line))
        }
        Some(_) => Err(Error(too_long)),
        None if buf.len() > max => Err(Error(too_long)),
        None => Ok(None),
    }
}

/// A chunk size line's size: hex digits (at most 16), then optional whitespace and
/// `;extensions`, which are ignored.
fn chunk_size(line: &[u8]) -> Result<u64, Error> {
    let bad = Error("a chunk size that is no hex number");
    let digits = line
        .split(|b| *b == b';')
        .next()
        .unwrap_or_default()
        .trim_ascii();
    if digits.is_empty() || digits.len() > 16 || !digits.iter().all(u8::is_ascii_hexdigit) {
        return Err(bad);
    }
    std::str::from_utf8(digits)
        .ok()
        .and_then(|d| u64::from_str_radix(d, 16).ok())
        .ok_or(bad)
}
