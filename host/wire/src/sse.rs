//! Server-sent events, both ways: parsing a stream into its events' data (and into completion
//! chunks), and framing values as events.
//!
//! Every stream of this wire is `data: <JSON>\n\n` per event, ending with `data: [DONE]\n\n`.
//! A stream that ends without `[DONE]` was cut (the engine died or the connection dropped) and
//! is reported as an error, never as a short success.

use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use eventsource_stream::{Event, EventStreamError, Eventsource};
use futures::stream::FusedStream;
use futures::{Stream, StreamExt};

use serde::Serialize;

use crate::completion::CompletionResponse;

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
/// KiB with logprobs). Kept small because the event parser rescans an unfinished event as
/// bytes arrive: the cost of a trickled event grows with the square of its size.
pub const MAX_EVENT_BYTES: usize = 256 << 10;

/// A stream of engine chunks, ending after `[DONE]`. Every one this module returns is fused.
pub type ChunkStream = Pin<Box<dyn Stream<Item = Result<CompletionResponse, SseError>> + Send>>;

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
        events: Box::pin(capped(bytes, MAX_EVENT_BYTES).eventsource()),
        state: Reading::Events,
        on_done: None,
    }
}

/// The data of an SSE stream's events; see [`data_events`].
pub struct DataEvents {
    events: Events,
    state: Reading,
    on_done: Option<Box<dyn FnOnce(BodyRest) + Send>>,
}

/// The parsed events of a body.
type Events = Pin<Box<dyn Stream<Item = Result<Event, EventStreamError<CappedError>>> + Send>>;

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
            BodyRest(self.events).read_to_end().await;
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
            let events = std::mem::replace(&mut self.events, Box::pin(futures::stream::empty()));
            rest(BodyRest(events));
        }
    }
}

/// What follows `[DONE]` in a body: normally nothing but its end (HTTP/1.1's last chunk). A
/// body read to its end leaves its connection reusable; one dropped before it is closed by the
/// HTTP client unless its end came in the same read as `[DONE]` (uvicorn, which serves vLLM and
/// SGLang, writes it apart), and the next request opens a new connection.
pub struct BodyRest(Events);

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
        let this = &mut *self;
        while this.state == Reading::Events {
            let failure = match ready!(this.events.poll_next_unpin(cx)) {
                None => SseError::Truncated,
                Some(Err(EventStreamError::Transport(CappedError::TooLarge))) => {
                    SseError::EventTooLarge
                }
                Some(Err(e)) => SseError::Transport(e.to_string()),
                Some(Ok(event)) => {
                    let data = event.data.trim();
                    if data.is_empty() {
                        continue;
                    }
                    if data == "[DONE]" {
                        this.done();
                        break;
                    }
                    return Poll::Ready(Some(Ok(data.to_owned())));
                }
            };
            this.state = Reading::Failed;
            return Poll::Ready(Some(Err(failure)));
        }
        Poll::Ready(None)
    }
}

impl FusedStream for DataEvents {
    fn is_terminated(&self) -> bool {
        self.state != Reading::Events
    }
}

/// `bytes`, ending with [`SseError::EventTooLarge`] once more than `max` bytes pass without a
/// blank line (the end of an event: `\n\n`, with or without `\r`).
fn capped<S, E>(bytes: S, max: usize) -> impl Stream<Item = Result<Bytes, CappedError>> + Send
where
    S: Stream<Item = Result<Bytes, E>> + Send + 'static,
    E: std::fmt::Display + Send + 'static,
{
    let mut since_blank_line = 0usize;
    let mut after_newline = false;
    bytes.map(move |item| {
        let chunk = item.map_err(|e| CappedError::Transport(e.to_string()))?;
        for &b in chunk.iter() {
            match b {
                b'\n' if after_newline => since_blank_line = 0,
                b'\n' => after_newline = true,
                b'\r' => {}
                _ => after_newline = false,
            }
            since_blank_line += 1;
        }
        if since_blank_line > max {
            return Err(CappedError::TooLarge);
        }
        Ok(chunk)
    })
}

/// Why [`capped`] ended a stream; becomes an [`SseError`].
#[derive(Debug)]
enum CappedError {
    Transport(String),
    TooLarge,
}

impl std::fmt::Display for CappedError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CappedError::Transport(e) => f.write_str(e),
            CappedError::TooLarge => write!(f, "{}", SseError::EventTooLarge),
        }
    }
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
/// [`CompletionResponse::fold_chat`]); see [`data_events`]. A chunk that is not a completion
/// response ends the stream with [`SseError::BadChunk`], an error event with
/// [`SseError::Engine`].
pub fn chunks(events: DataEvents) -> ChunkStream {
    Box::pin(
        events
            .map(|item| {
                item.and_then(|data| {
                    let mut chunk = serde_json::from_str::<CompletionResponse>(&data)
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
pub fn single_chunk(response: CompletionResponse) -> ChunkStream {
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
            .map(|c| c.expect("chunk").choices[0].text.clone())
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

    #[tokio::test]
    async fn garbage_is_a_bad_chunk() {
        let chunks: Vec<_> = stream_of(&["data: not json\n\n"]).collect().await;
        assert!(matches!(chunks[0], Err(SseError::BadChunk(_))));
    }
}
