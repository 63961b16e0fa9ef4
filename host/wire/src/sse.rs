//! Server-sent events, both ways: parsing a stream into its events' data (and into completion
//! chunks), and framing values as events.
//!
//! Every stream of this wire is `data: <JSON>\n\n` per event, ending with `data: [DONE]\n\n`.
//! A stream that ends without `[DONE]` was cut (the engine died or the connection dropped) and
//! is reported as an error, never as a short success.

use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use futures::stream::FusedStream;
use futures::{Stream, StreamExt};

use serde::Serialize;

use crate::completion::EngineChunk;

/// The event that ends every stream.
pub const DONE_EVENT: &[u8] = b"data: [DONE]\n\n";

/// Append `data: <value as JSON>\n\n` to `out`, serialised straight into it.
pub fn write_event(out: &mut Vec<u8>, value: &impl Serialize) {
    out.extend_from_slice(b"data: ");
    // Writing plain data structs into a Vec cannot fail.
    serde_json::to_writer(&mut *out, value).expect("an SSE event serialises");
    out.extend_from_slice(b"\n\n");
}

/// `data: <value as JSON>\n\n` as one buffer.
pub fn event(value: &impl Serialize) -> Bytes {
    let mut out = Vec::new();
    write_event(&mut out, value);
    Bytes::from(out)
}

/// Why a chunk stream failed.
#[derive(Debug, thiserror::Error)]
pub enum SseError {
    #[error("reading the stream: {0}")]
    Transport(String),
    #[error("a chunk is not a completion response: {0}")]
    BadChunk(String),
    #[error("the stream ended without [DONE]")]
    Truncated,
    /// The sender went quiet for longer than the reader waits between events.
    #[error("reading the stream: no chunk for {0:?}")]
    Idle(std::time::Duration),
    /// One event grew past [`MAX_EVENT_BYTES`] without ending: a reader must not buffer a
    /// sender's bytes without bound.
    #[error("an event is over {MAX_EVENT_BYTES} bytes")]
    EventTooLarge,
    /// The sender reported a failure in the stream (an `{"error": …}` event).
    #[error("the engine reported an error in the stream: {0}")]
    Engine(String),
}

/// The largest event a reader buffers: an engine's chunks carry a few tokens of text (a few
/// KiB with logprobs); an unfinished event is held until its end comes.
pub const MAX_EVENT_BYTES: usize = 256 << 10;

/// A stream of engine chunks, ending after `[DONE]`. Every one this module returns is fused.
pub type ChunkStream = Pin<Box<dyn Stream<Item = Result<EngineChunk, SseError>> + Send>>;

/// The data of each event of an SSE byte stream, ending after `data: [DONE]`. Events with no
/// data are skipped. A stream that ends without `[DONE]` yields [`SseError::Truncated`], and the
/// first error ends it (it is fused). What follows `[DONE]` is left unread:
/// [`DataEvents::finish`] or [`DataEvents::on_done`] reads it.
pub fn data_events<S, E>(bytes: S) -> DataEvents
where
    S: Stream<Item = Result<Bytes, E>> + Send + 'static,
    E: std::fmt::Display + Send + 'static,
{
    DataEvents {
        body: Box::pin(bytes.map(|item| item.map_err(|e| e.to_string()))),
        framer: Framer::default(),
        state: Reading::Events,
        on_done: None,
    }
}

/// The data of an SSE stream's events; see [`data_events`].
pub struct DataEvents {
    body: Body,
    framer: Framer,
    state: Reading,
    on_done: Option<Box<dyn FnOnce(BodyRest) + Send>>,
}

/// A body's bytes, its transport's errors as text.
type Body = Pin<Box<dyn Stream<Item = Result<Bytes, String>> + Send>>;

/// Where a [`DataEvents`] is in its stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reading {
    Events,
    /// `[DONE]` came: the body's rest (its end, normally) is unread.
    Done,
    /// It failed; nothing more is read.
    Failed,
}

impl DataEvents {
    /// After `[DONE]`, reads the body to its end (see [`BodyRest`]). Does nothing unless
    /// `[DONE]` ended the stream, or if [`DataEvents::on_done`] took the rest.
    pub async fn finish(self) {
        if self.state == Reading::Done {
            BodyRest(self.body).read_to_end().await;
        }
    }

    /// Hands the body's rest to `rest` when `[DONE]` comes, before the stream ends: for a
    /// reader that must not wait on the sender after `[DONE]`, to read it elsewhere.
    pub fn on_done(mut self, rest: impl FnOnce(BodyRest) + Send + 'static) -> Self {
        self.on_done = Some(Box::new(rest));
        self
    }

    fn done(&mut self) {
        self.state = Reading::Done;
        if let Some(rest) = self.on_done.take() {
            let body = std::mem::replace(&mut self.body, Box::pin(futures::stream::empty()));
            rest(BodyRest(body));
        }
    }

    /// The next event's data, trimmed and checked to be UTF-8, as a slice of the body's bytes:
    /// no copy when the event came in one read.
    fn poll_data(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Bytes, SseError>>> {
        while self.state == Reading::Events {
            let failure = match self.framer.next_data() {
                Ok(Some(data)) if data.as_ref() == b"[DONE]" => {
                    self.done();
                    break;
                }
                Ok(Some(data)) => return Poll::Ready(Some(Ok(data))),
                Err(e) => e,
                Ok(None) => match ready!(self.body.poll_next_unpin(cx)) {
                    Some(Ok(bytes)) => {
                        self.framer.unread = bytes;
                        continue;
                    }
                    Some(Err(e)) => SseError::Transport(e),
                    None => SseError::Truncated,
                },
            };
            self.state = Reading::Failed;
            return Poll::Ready(Some(Err(failure)));
        }
        Poll::Ready(None)
    }

    /// The events' data as the body's bytes; see [`DataEvents::poll_data`].
    fn data(mut self) -> impl Stream<Item = Result<Bytes, SseError>> + Send {
        futures::stream::poll_fn(move |cx| self.poll_data(cx))
    }
}

/// What follows `[DONE]` in a body: normally nothing but its end (HTTP/1.1's last chunk). A
/// body read to its end leaves its connection reusable; one dropped before it is closed by the
/// HTTP client unless its end came in the same read as `[DONE]` (uvicorn, which serves vLLM and
/// SGLang, writes it apart), and the next request opens a new connection.
pub struct BodyRest(Body);

impl BodyRest {
    /// Reads the body to its end and drops what it holds. Waits as long as the sender keeps
    /// the body open: the caller bounds it.
    pub async fn read_to_end(mut self) {
        while let Some(Ok(_)) = self.0.next().await {}
    }
}

impl Stream for DataEvents {
    type Item = Result<String, SseError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let data = ready!(self.poll_data(cx));
        Poll::Ready(data.map(|data| {
            data.map(|text| {
                String::from_utf8(Vec::from(text)).expect("an event's data was checked as UTF-8")
            })
        }))
    }
}

impl FusedStream for DataEvents {
    fn is_terminated(&self) -> bool {
        self.state != Reading::Events
    }
}

/// Splits a body's bytes into SSE events and keeps each one's data, as the SSE spec reads
/// them: lines end with `\n`, `\r\n` or `\r`; a blank line ends an event; `data:` lines are
/// joined with `\n`; comments (`:`) and other fields (`event:`, `id:`, `retry:`) are skipped.
/// A line is found with `memchr`, and an event that came in one read is a slice of it.
#[derive(Default)]
struct Framer {
    /// Read bytes not yet split into lines.
    unread: Bytes,
    /// The start of a line whose end has not been read yet.
    partial: BytesMut,
    /// The current event's data so far.
    data: EventData,
    /// Bytes of the current event so far, for [`MAX_EVENT_BYTES`].
    event_bytes: usize,
    /// The last line ended with a `\r` that ended its read: a `\n` opening the next read is
    /// that line's end, not a blank line.
    after_cr: bool,
    /// A line has been read: only the first may start with a byte-order mark.
    started: bool,
}

impl Framer {
    /// The data of the next event the unread bytes complete, if they complete one.
    fn next_data(&mut self) -> Result<Option<Bytes>, SseError> {
        while let Some(line) = self.next_line()? {
            if line.is_empty() {
                self.event_bytes = 0;
                let data = std::mem::take(&mut self.data).into_bytes();
                let text = std::str::from_utf8(&data)
                    .map_err(|e| SseError::Transport(format!("an event is not UTF-8: {e}")))?
                    .trim();
                if !text.is_empty() {
                    return Ok(Some(data.slice_ref(text.as_bytes())));
                }
            } else if let Some(value) = data_value(&line) {
                self.data.push(line.slice_ref(value));
            }
        }
        Ok(None)
    }

    /// The next whole line of the unread bytes, without its end; an error once the current
    /// event is over [`MAX_EVENT_BYTES`].
    fn next_line(&mut self) -> Result<Option<Bytes>, SseError> {
        if self.after_cr && !self.unread.is_empty() {
            self.after_cr = false;
            if self.unread[0] == b'\n' {
                self.unread.advance(1);
            }
        }
        let Some(end) = memchr::memchr2(b'\n', b'\r', &self.unread) else {
            self.event_bytes += self.unread.len();
            self.partial
                .extend_from_slice(&std::mem::take(&mut self.unread));
            return self.within_cap().map(|()| None);
        };
        let mut line = self.unread.split_to(end);
        let cr = self.unread[0] == b'\r';
        self.unread.advance(1);
        self.event_bytes += end + 1;
        if cr {
            match self.unread.first() {
                Some(b'\n') => self.unread.advance(1),
                Some(_) => {}
                None => self.after_cr = true,
            }
        }
        if !self.partial.is_empty() {
            self.partial.extend_from_slice(&line);
            line = self.partial.split().freeze();
        }
        if !std::mem::replace(&mut self.started, true) && line.starts_with(BOM) {
            line.advance(BOM.len());
        }
        self.within_cap().map(|()| Some(line))
    }

    fn within_cap(&self) -> Result<(), SseError> {
        if self.event_bytes > MAX_EVENT_BYTES {
            return Err(SseError::EventTooLarge);
        }
        Ok(())
    }
}

/// The UTF-8 byte-order mark a stream may start with.
const BOM: &[u8] = "\u{feff}".as_bytes();

/// The value of a `data` field's line (after `data:` and one space), `None` for a comment or
/// another field.
fn data_value(line: &[u8]) -> Option<&[u8]> {
    let value = match line.strip_prefix(b"data")? {
        [] => &[][..],
        [b':', value @ ..] => value,
        _ => return None,
    };
    Some(value.strip_prefix(b" ").unwrap_or(value))
}

/// An event's `data` lines so far: one line (the usual event) stays a slice of what was read.
#[derive(Default)]
enum EventData {
    #[default]
    None,
    One(Bytes),
    Many(BytesMut),
}

impl EventData {
    fn push(&mut self, line: Bytes) {
        *self = match std::mem::take(self) {
            EventData::None => EventData::One(line),
            EventData::One(first) => EventData::Many(joined(BytesMut::from(&first[..]), &line)),
            EventData::Many(data) => EventData::Many(joined(data, &line)),
        };
    }

    fn into_bytes(self) -> Bytes {
        match self {
            EventData::None => Bytes::new(),
            EventData::One(data) => data,
            EventData::Many(data) => data.freeze(),
        }
    }
}

/// `data`, then a line feed and `line`: the SSE spec joins an event's data lines so.
fn joined(mut data: BytesMut, line: &[u8]) -> BytesMut {
    data.put_u8(b'\n');
    data.extend_from_slice(line);
    data
}

/// Parse an SSE byte stream into completion chunks; see [`chunks`].
pub fn parse_chunks<S, E>(bytes: S) -> ChunkStream
where
    S: Stream<Item = Result<Bytes, E>> + Send + 'static,
    E: std::fmt::Display + Send + 'static,
{
    chunks(data_events(bytes))
}

/// Parse events into completion chunks (chat chunks read as completion ones, see
/// [`EngineChunk::fold_chat`]); see [`data_events`]. A chunk that is not a completion
/// response ends the stream with [`SseError::BadChunk`], an error event with
/// [`SseError::Engine`].
pub fn chunks(events: DataEvents) -> ChunkStream {
    Box::pin(
        events
            .data()
            .map(|item| {
                item.and_then(|data| {
                    let mut chunk = serde_json::from_slice::<EngineChunk>(&data)
                        .map_err(|e| SseError::BadChunk(e.to_string()))?;
                    if let Some(message) = chunk.error_message() {
                        return Err(SseError::Engine(message));
                    }
                    chunk.fold_chat();
                    Ok(chunk)
                })
            })
            // A bad chunk ends the stream as a transport error does.
            .scan(false, |ended, item| {
                if *ended {
                    return futures::future::ready(None);
                }
                *ended = item.is_err();
                futures::future::ready(Some(item))
            })
            .fuse(),
    )
}

/// A complete (non-streaming) answer presented as a one-chunk stream.
pub fn single_chunk(response: EngineChunk) -> ChunkStream {
    Box::pin(futures::stream::once(async move { Ok(response) }).fuse())
}

#[cfg(test)]
mod tests {
    use futures::FutureExt;

    use super::*;

    fn stream_of(parts: &[&'static str]) -> ChunkStream {
        let parts: Vec<Result<Bytes, std::io::Error>> = parts
            .iter()
            .map(|p| Ok(Bytes::from_static(p.as_bytes())))
            .collect();
        parse_chunks(futures::stream::iter(parts))
    }

    #[tokio::test]
    async fn chunks_split_anywhere_parse_and_done_ends_the_stream() {
        let chunks: Vec<_> = stream_of(&[
            "data: {\"id\":\"a\",\"choices\":[{\"index\":0,\"text\":\"he\",\"finish_reason\":null}]}\n",
            "\ndata: {\"id\":\"a\",\"choices\":[{\"index\":0,\"te",
            "xt\":\"llo\",\"finish_reason\":\"stop\"}]}\n\ndata: [DONE]\n\n",
        ])
        .collect()
        .await;
        let texts: Vec<_> = chunks
            .into_iter()
            .map(|c| c.expect("chunk").choice.expect("a choice").text)
            .collect();
        assert_eq!(texts, ["he", "llo"]);
    }

    #[tokio::test]
    async fn a_stream_without_done_is_truncated() {
        let chunks: Vec<_> = stream_of(&["data: {\"id\":\"a\",\"choices\":[]}\n\n"])
            .collect()
            .await;
        assert_eq!(chunks.len(), 2);
        assert!(matches!(chunks[1], Err(SseError::Truncated)));
    }

    #[tokio::test]
    async fn streams_answer_none_again_after_their_end() {
        let mut done = stream_of(&["data: [DONE]\n\n"]);
        assert!(done.next().await.is_none());
        assert!(done.next().await.is_none(), "polled after the end");
        let mut one = single_chunk(serde_json::from_str("{}").expect("empty response"));
        assert!(one.next().await.is_some());
        assert!(one.next().await.is_none());
        assert!(one.next().await.is_none());
    }

    #[tokio::test]
    async fn an_event_that_never_ends_is_refused_not_buffered() {
        let kib = Bytes::from(vec![b'a'; 1024]);
        let endless = futures::stream::iter(
            std::iter::once(Bytes::from_static(b"data: {\"id\":\""))
                .chain(std::iter::repeat_n(kib, MAX_EVENT_BYTES / 1024 + 1))
                .map(Ok::<_, std::io::Error>),
        );
        let chunks: Vec<_> = parse_chunks(endless).collect().await;
        assert!(
            matches!(chunks.as_slice(), [Err(SseError::EventTooLarge)]),
            "{chunks:?}"
        );
        // Many events, each small, add up to more than the cap: fine.
        let many = futures::stream::iter(
            std::iter::repeat_n("data: {\"id\":\"a\",\"choices\":[]}\r\n\r\n", 10_000)
                .chain(std::iter::once("data: [DONE]\n\n"))
                .map(|p| Ok::<_, std::io::Error>(Bytes::from_static(p.as_bytes()))),
        );
        let chunks: Vec<_> = parse_chunks(many).collect().await;
        assert_eq!(chunks.len(), 10_000);
        assert!(chunks.iter().all(Result::is_ok));
    }

    type Sender = futures::channel::mpsc::UnboundedSender<Result<Bytes, std::io::Error>>;

    /// Events over a body that stays open until the sender is dropped.
    fn open_body() -> (Sender, DataEvents) {
        let (tx, rx) = futures::channel::mpsc::unbounded();
        (tx, data_events(rx))
    }

    fn send(tx: &Sender, bytes: impl Into<Bytes>) {
        tx.unbounded_send(Ok(bytes.into())).expect("receiver alive");
    }

    #[tokio::test]
    async fn done_ends_the_stream_and_finish_reads_the_body_to_its_end() {
        let (tx, mut events) = open_body();
        send(&tx, "data: 1\n\ndata: [DONE]\n\n");
        assert_eq!(events.next().await.expect("an event").expect("data"), "1");
        assert!(
            events.next().await.is_none(),
            "[DONE] ends it, the body still open"
        );
        let mut finish = Box::pin(events.finish());
        assert!(
            futures::poll!(&mut finish).is_pending(),
            "waits for the end"
        );
        send(&tx, "\n");
        assert!(futures::poll!(&mut finish).is_pending());
        drop(tx);
        finish.await;
    }

    #[tokio::test]
    async fn on_done_hands_the_rest_over_before_the_stream_ends() {
        let rest = std::sync::Arc::new(std::sync::Mutex::new(None));
        let (tx, events) = open_body();
        let slot = rest.clone();
        let mut events = events.on_done(move |r| *slot.lock().expect("slot") = Some(r));
        send(&tx, "data: [DONE]\n\n");
        assert!(events.next().await.is_none());
        let rest = rest
            .lock()
            .expect("slot")
            .take()
            .expect("handed over at [DONE]");
        // The stream's own finish has nothing left to read.
        assert!(events.finish().now_or_never().is_some());
        let mut to_end = Box::pin(rest.read_to_end());
        assert!(futures::poll!(&mut to_end).is_pending());
        drop(tx);
        to_end.await;
    }

    #[tokio::test]
    async fn finish_reads_nothing_after_a_failure() {
        let (tx, mut events) = open_body();
        send(&tx, "data: {\"id\":\"");
        for _ in 0..=MAX_EVENT_BYTES / 1024 {
            send(&tx, vec![b'a'; 1024]);
        }
        assert!(matches!(
            events.next().await,
            Some(Err(SseError::EventTooLarge))
        ));
        assert!(
            events.finish().now_or_never().is_some(),
            "the body stays open"
        );
        drop(tx);
    }

    /// The data of every event of `parts`, each part one read.
    async fn data_of(parts: &[&'static [u8]]) -> Vec<Result<String, SseError>> {
        let parts: Vec<_> = parts
            .iter()
            .map(|p| Ok::<_, std::io::Error>(Bytes::from_static(p)))
            .collect();
        data_events(futures::stream::iter(parts)).collect().await
    }

    fn texts(data: Vec<Result<String, SseError>>) -> Vec<String> {
        data.into_iter().map(|d| d.expect("data")).collect()
    }

    #[tokio::test]
    async fn every_line_end_the_spec_allows_ends_a_line_even_split_between_reads() {
        let data = data_of(&[
            b"data: crlf\r\n\r",
            b"\ndata: cr\r\r",
            b"data: lf\n",
            b"\n",
            b"data: [DONE]\r",
            b"\r",
        ])
        .await;
        assert_eq!(texts(data), ["crlf", "cr", "lf"]);
    }

    #[tokio::test]
    async fn comments_and_other_fields_are_skipped_and_data_lines_joined() {
        let data = data_of(&[
            "\u{feff}: a comment\nevent: completion\nid: 7\nretry: 10\ndata:{\"a\":\ndata\ndata: 1}\n\n"
                .as_bytes(),
            b": keep-alive\n\nevent: ping\n\ndata:  [DONE]\n\n",
        ])
        .await;
        assert_eq!(texts(data), ["{\"a\":\n\n1}"]);
    }

    #[tokio::test]
    async fn an_event_read_in_one_piece_is_not_copied() {
        let read = Bytes::from_static(b"data: {\"id\":\"a\"}\n\n");
        let mut events = data_events(futures::stream::iter([Ok::<_, std::io::Error>(
            read.clone(),
        )]));
        let data = futures::future::poll_fn(|cx| events.poll_data(cx))
            .await
            .expect("an event")
            .expect("data");
        assert_eq!(data, b"{\"id\":\"a\"}"[..]);
        assert!(
            read.as_ptr_range().contains(&data.as_ptr()),
            "a slice of the read"
        );
    }

    #[tokio::test]
    async fn an_error_event_ends_the_stream_and_bad_utf8_is_refused() {
        let chunks: Vec<_> =
            stream_of(&["data: {\"error\":{\"message\":\"out of pages\"}}\n\ndata: [DONE]\n\n"])
                .collect()
                .await;
        assert!(
            matches!(chunks.as_slice(), [Err(SseError::Engine(m))] if m.contains("out of pages")),
            "{chunks:?}"
        );
        let data = data_of(&[b"data: \xff\n\n", b"data: [DONE]\n\n"]).await;
        assert!(
            matches!(data.as_slice(), [Err(SseError::Transport(_))]),
            "{data:?}"
        );
    }

    #[tokio::test]
    async fn garbage_is_a_bad_chunk() {
        let chunks: Vec<_> = stream_of(&["data: not json\n\n"]).collect().await;
        assert!(matches!(chunks[0], Err(SseError::BadChunk(_))));
    }
}
