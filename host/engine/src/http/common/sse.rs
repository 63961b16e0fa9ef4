//! The one SSE writer: `data: <chunk>\n\n` per generation event, a usage-only chunk when the
//! request asked for one, then `data: [DONE]\n\n`. Each protocol says what its chunks look like
//! ([`Chunks`]); how a stream goes from one to the next, ends, or breaks is written here once.

use bytes::Bytes;
use futures::StreamExt as _;
use futures::stream::BoxStream;
use http::{Response, header};
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;
use serde_json::json;
use switchyard_wire::error::ErrorBody;
use switchyard_wire::sse;
use tokio::sync::mpsc;

use super::error::HttpError;
use super::respond::{Body, BodyError, full};
use crate::scheduler::{Event, Usage};

pub(crate) type Frames = BoxStream<'static, Result<Frame<Bytes>, BodyError>>;

/// What a protocol's stream chunks look like.
pub(crate) trait Chunks: Send + 'static {
    /// The chunk that carries `event`; `first` when it opens the stream.
    fn event(&self, event: Event, first: bool) -> Bytes;
    /// The usage-only chunk after the last event.
    fn usage(&self, usage: Usage) -> Bytes;
}

/// A streamed answer: `rx`'s events as `chunks` writes them.
pub(crate) fn stream(
    chunks: impl Chunks,
    include_usage: bool,
    rx: mpsc::UnboundedReceiver<Event>,
) -> Response<Body> {
    sse_response(event_stream(chunks, include_usage, rx))
}

/// A stream whose 200 head goes out at once (as SGLang's and vLLM's streaming answers do)
/// while `work` still runs: the rendezvous, the pull. A failure after the head becomes one
/// `data: {"error": …}` event, then `[DONE]`. The work lives in the body, so a client that
/// hangs up drops it, and with it whatever its guards hold.
pub(crate) fn stream_after<C, F>(chunks: C, include_usage: bool, work: F) -> Response<Body>
where
    C: Chunks + Clone,
    F: Future<Output = Result<mpsc::UnboundedReceiver<Event>, HttpError>> + Send + 'static,
{
    let frames = futures::stream::once(work)
        .flat_map(move |outcome| match outcome {
            Ok(rx) => event_stream(chunks.clone(), include_usage, rx),
            Err(e) => error_events(e),
        })
        .boxed();
    sse_response(frames)
}

enum Phase {
    Tokens { first: bool },
    Usage(Usage),
    Done,
    Over,
}

/// The frames of a stream. Dropping them (client gone) drops `rx`, which makes the step loop
/// abort the request. Events that end without a finish (the step loop died) end the body with
/// an error, so hyper cuts the connection instead of faking a complete stream.
fn event_stream(
    chunks: impl Chunks,
    include_usage: bool,
    rx: mpsc::UnboundedReceiver<Event>,
) -> Frames {
    let start = (chunks, rx, Phase::Tokens { first: true });
    futures::stream::unfold(start, move |(chunks, mut rx, phase)| async move {
        let (frame, next) = match phase {
            Phase::Tokens { first } => match rx.recv().await {
                Some(event) => {
                    let next = match event.finish {
                        Some((_, usage)) if include_usage => Phase::Usage(usage),
                        Some(_) => Phase::Done,
                        None => Phase::Tokens { first: false },
                    };
                    (chunks.event(event, first), next)
                }
                None => {
                    tracing::error!("generation events ended without a finish; cutting the stream");
                    return Some((Err(BodyError), (chunks, rx, Phase::Over)));
                }
            },
            Phase::Usage(usage) => (chunks.usage(usage), Phase::Done),
            Phase::Done => (Bytes::from_static(sse::DONE_EVENT), Phase::Over),
            Phase::Over => return None,
        };
        Some((Ok(Frame::data(frame)), (chunks, rx, next)))
    })
    .boxed()
}

/// An error inside a stream whose head is sent: SGLang's (and SMG's) shape, then `[DONE]`.
fn error_events(e: HttpError) -> Frames {
    let (status, kind, param) = e.parts();
    let mut body = serde_json::to_value(ErrorBody::new(e.to_string(), kind, param, None))
        .unwrap_or_else(|_| json!({"error": {}}));
    body["error"]["code"] = status.as_u16().into();
    let frames = [
        Ok(Frame::data(sse::event(&body))),
        Ok(Frame::data(Bytes::from_static(sse::DONE_EVENT))),
    ];
    futures::stream::iter(frames).boxed()
}

fn sse_response(frames: Frames) -> Response<Body> {
    Response::builder()
        .status(http::StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(BodyExt::boxed_unsync(StreamBody::new(frames)))
        .unwrap_or_else(|_| Response::new(full("")))
}

#[cfg(test)]
mod tests;
