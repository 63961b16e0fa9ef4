//! SSE framing to the client: one `data: <json>\n\n` per chunk, `data: [DONE]\n\n` last, and
//! an OpenAI error event before `[DONE]` when the router gives up mid-stream (never a silent
//! truncation). A stream the client abandons is counted with status 499 in `/metrics`.

use std::convert::Infallible;
use std::sync::Arc;

use bytes::Bytes;
use futures::StreamExt;
use http::{Response, header};
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::openai::Responder;
use super::respond::ApiError;
use super::{AppState, Body};
use crate::plan::Event;

/// Stream `events` (starting with `first`, already received) to the client.
pub fn stream_response(
    state: Arc<AppState>,
    responder: Responder,
    first: Event,
    events: mpsc::Receiver<Event>,
    arrived: Instant,
) -> Response<Body> {
    let mut opening = responder
        .opening_chunk()
        .map(|c| data(&c))
        .unwrap_or_default();
    let relay = StreamRelay {
        state,
        responder,
        events,
        pending: Some(first),
        last_text: None,
        done: false,
        arrived,
    };
    let frames = futures::stream::unfold(relay, |mut relay| async move {
        let bytes = relay.next_bytes().await?;
        Some((Ok::<_, Infallible>(Frame::data(bytes)), relay))
    });
    let frames = frames.map(move |frame| {
        // Prepend the chat role chunk to the first frame.
        match (frame, opening.is_empty()) {
            (Ok(f), false) => {
                let mut bytes = std::mem::take(&mut opening);
                if let Ok(d) = f.into_data() {
                    bytes.extend_from_slice(&d);
                }
                Ok(Frame::data(Bytes::from(bytes)))
            }
            (f, _) => f,
        }
    });
    let mut response = Response::new(BodyExt::boxed(StreamBody::new(frames)));
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("text/event-stream"),
    );
    headers.insert(
        header::CACHE_CONTROL,
        header::HeaderValue::from_static("no-cache"),
    );
    response
}

struct StreamRelay {
    state: Arc<AppState>,
    responder: Responder,
    events: mpsc::Receiver<Event>,
    pending: Option<Event>,
    last_text: Option<Instant>,
    done: bool,
    arrived: Instant,
}

/// Most bytes of queued events written to the client in one frame.
const COALESCE_LIMIT: usize = 64 << 10;

impl StreamRelay {
    async fn next_bytes(&mut self) -> Option<Bytes> {
        if self.done {
            return None;
        }
        let event = match self.pending.take() {
            Some(e) => Some(e),
            None => self.events.recv().await,
        };
        let mut bytes = self.frame(event);
        // Events already queued (the client's socket or this task fell behind the engine) go
        // out in the same frame: one write instead of one per token. Nothing waits for more.
        while !self.done && bytes.len() < COALESCE_LIMIT {
            let Ok(event) = self.events.try_recv() else {
                break;
            };
            bytes.extend_from_slice(&self.frame(Some(event)));
        }
        Some(Bytes::from(bytes))
    }

    /// The client's bytes for one event (`None`: the routing task ended without a last one).
    fn frame(&mut self, event: Option<Event>) -> Vec<u8> {
        let route = self.responder.shape.route();
        match event {
            Some(Event::Text(text)) => {
                let now = Instant::now();
                if let Some(last) = self.last_text.replace(now) {
                    self.state.metrics.inter_token(now - last);
                }
                data(&self.responder.text_chunk(&text))
            }
            Some(Event::Done {
                finish_reason,
                usage,
                summary,
            }) => {
                self.done = true;
                self.state.metrics.request(route, 200);
                self.state
                    .metrics
                    .finished(&summary, self.arrived.elapsed());
                let mut out = data(&self.responder.finish_chunk(&finish_reason));
                if let Some(u) = self.responder.usage_chunk(&usage) {
                    out.extend_from_slice(&data(&u));
                }
                out.extend_from_slice(b"data: [DONE]\n\n");
                out
            }
            Some(Event::Failed { error, summary }) => {
                self.done = true;
                let error = ApiError::Route(error);
                self.state.metrics.request(route, error.status().as_u16());
                self.state
                    .metrics
                    .finished(&summary, self.arrived.elapsed());
                let mut out = error.sse_event().to_vec();
                out.extend_from_slice(b"data: [DONE]\n\n");
                out
            }
            None => {
                // The routing task ended without a last event: say so rather than truncate.
                self.done = true;
                let error = ApiError::NotReady("the request was abandoned by the router");
                let mut out = error.sse_event().to_vec();
                out.extend_from_slice(b"data: [DONE]\n\n");
                out
            }
        }
    }
}

/// What `/metrics` counts a stream as when the client hung up before its last event: nginx's
/// "client closed request", so disconnects are visible next to the real statuses.
pub(super) const CLIENT_CLOSED_REQUEST: u16 = 499;

impl Drop for StreamRelay {
    fn drop(&mut self) {
        // Dropped before its last event: hyper dropped the body because the client went away
        // (the router's task sees the closed channel and cancels every upstream leg).
        if !self.done {
            self.state
                .metrics
                .request(self.responder.shape.route(), CLIENT_CLOSED_REQUEST);
        }
    }
}

/// One SSE `data:` frame for the client.
pub fn data(value: &serde_json::Value) -> Vec<u8> {
    format!("data: {value}\n\n").into_bytes()
}
