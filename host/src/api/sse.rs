//! SSE framing to the client: one `data: <json>\n\n` per chunk, `data: [DONE]\n\n` last, and
//! an OpenAI error event before `[DONE]` when the router gives up mid-stream (never a silent
//! truncation). A stream the client abandons is counted with status 499 in `/metrics`.
//!
//! The response body drives the request itself ([`Routing`] has no task of its own): each time
//! hyper asks for more, the body polls the routing, which reads whatever the engine has sent,
//! and the events it yields go out in one frame, so tokens that arrive together cost one write
//! to the client (see [`StreamRelay::wait_for_more`]).

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use futures::Stream;
use http::{Response, header};
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;
use tokio::time::Instant;

use super::openai::Responder;
use super::respond::ApiError;
use super::{AppState, Body};
use crate::plan::{Event, Routing};

/// Stream `routing`'s events (starting with `first`, already received) to the client.
pub fn stream_response(
    state: Arc<AppState>,
    responder: Responder,
    first: Event,
    routing: Routing,
    arrived: Instant,
) -> Response<Body> {
    let mut opening = Vec::new();
    responder.opening_frame(&mut opening);
    let relay = StreamRelay {
        state,
        responder,
        routing,
        unsent: opening,
        turns: 0,
        quiet_turns: 0,
        pending: Some(first),
        last_text: None,
        done: false,
        arrived,
    };
    let mut response = Response::new(BodyExt::boxed_unsync(StreamBody::new(relay)));
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
    routing: Routing,
    /// Bytes framed but not yet handed to hyper (at first, the chat role chunk).
    unsent: Vec<u8>,
    /// Scheduler turns given up for the frame being built, and how many of the last ones in
    /// a row brought no event.
    turns: u32,
    quiet_turns: u32,
    /// The first event, received before the response was committed.
    pending: Option<Event>,
    last_text: Option<Instant>,
    done: bool,
    arrived: Instant,
}

/// Most bytes of events written to the client in one frame.
const COALESCE_LIMIT: usize = 64 << 10;

/// Turns in a row without a new event after which the frame is written.
const QUIET_TURNS: u32 = 2;

/// Most scheduler turns one frame waits: bounds the delay a fast stream adds to its first
/// bytes in a frame.
const MAX_TURNS: u32 = 64;

impl Stream for StreamRelay {
    type Item = Result<Frame<Bytes>, Infallible>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        let mut out = std::mem::take(&mut this.unsent);
        let mut progressed = false;
        if let Some(first) = this.pending.take() {
            this.frame(first, &mut out);
            progressed = true;
        }
        // Everything the routing has ready goes in this frame.
        while !this.done && out.len() < COALESCE_LIMIT {
            match Pin::new(&mut this.routing).poll_next(cx) {
                Poll::Ready(Some(event)) => this.frame(event, &mut out),
                Poll::Ready(None) => this.abandoned(&mut out),
                Poll::Pending => break,
            }
            progressed = true;
        }
        this.quiet_turns = if progressed { 0 } else { this.quiet_turns + 1 };
        if !out.is_empty() && this.wait_for_more(out.len()) {
            this.unsent = out;
            this.turns += 1;
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        this.turns = 0;
        this.quiet_turns = 0;
        match (out.is_empty(), this.done) {
            (false, _) => Poll::Ready(Some(Ok(Frame::data(Bytes::from(out))))),
            (true, true) => Poll::Ready(None),
            (true, false) => Poll::Pending,
        }
    }
}

impl StreamRelay {
    /// Whether to give the scheduler another turn before writing `unsent` bytes. The HTTP
    /// client hands the engine's chunks over one task switch at a time, even when one read
    /// brought many, so a frame written at the first lull carries one token. Measured with
    /// null engines (32 tokens per request, concurrency 4): writing at the first quiet turn
    /// made 33 writes per request, waiting for the second made 4 and cut the router's CPU per
    /// request by a third. Widely spaced tokens (a real engine's) cost two extra polls each.
    fn wait_for_more(&self, unsent: usize) -> bool {
        !self.done
            && unsent < COALESCE_LIMIT
            && self.quiet_turns < QUIET_TURNS
            && self.turns < MAX_TURNS
    }

    /// Append the client's bytes for one event.
    fn frame(&mut self, event: Event, out: &mut Vec<u8>) {
        let route = self.responder.shape.route();
        match event {
            Event::Text(text) => {
                let now = Instant::now();
                if let Some(last) = self.last_text.replace(now) {
                    self.state.metrics.inter_token(now - last);
                }
                self.responder.text_frame(out, &text);
            }
            Event::Done {
                finish_reason,
                usage,
                summary,
            } => {
                self.done = true;
                self.state.metrics.request(route, 200);
                self.state
                    .metrics
                    .finished(&summary, self.arrived.elapsed());
                self.responder.finish_frame(out, &finish_reason);
                self.responder.usage_frame(out, &usage);
                out.extend_from_slice(b"data: [DONE]\n\n");
            }
            Event::Failed { error, summary } => {
                let error = ApiError::Route(error);
                self.state.metrics.request(route, error.status().as_u16());
                self.state
                    .metrics
                    .finished(&summary, self.arrived.elapsed());
                self.end_with(&error, out);
            }
        }
    }

    /// The routing ended without a last event: say so rather than truncate.
    fn abandoned(&mut self, out: &mut Vec<u8>) {
        self.end_with(
            &ApiError::NotReady("the request was abandoned by the router"),
            out,
        );
    }

    /// End the stream with `error`'s OpenAI error event, then `[DONE]`.
    fn end_with(&mut self, error: &ApiError, out: &mut Vec<u8>) {
        self.done = true;
        out.extend_from_slice(&error.sse_event());
        out.extend_from_slice(b"data: [DONE]\n\n");
    }
}

/// What `/metrics` counts a stream as when the client hung up before its last event: nginx's
/// "client closed request", so disconnects are visible next to the real statuses.
pub(super) const CLIENT_CLOSED_REQUEST: u16 = 499;

impl Drop for StreamRelay {
    fn drop(&mut self) {
        // Dropped before its last event: hyper dropped the body because the client went away
        // (the routing is dropped with it, which cancels every upstream leg).
        if !self.done {
            self.state
                .metrics
                .request(self.responder.shape.route(), CLIENT_CLOSED_REQUEST);
        }
    }
}
