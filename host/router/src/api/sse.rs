//! SSE framing to the client: one `data: <json>\n\n` per chunk, `data: [DONE]\n\n` last, and
//! an OpenAI error event before `[DONE]` when the router gives up mid-stream or its shutdown
//! grace period ends (never a silent truncation). A stream the client abandons is counted with
//! status 499 in `/metrics`.
//!
//! The response body drives the request itself ([`Routing`] has no task of its own): each time
//! hyper asks for more, the body polls the routing, which reads whatever the engine has sent,
//! and the events it yields go out in one frame, so tokens that arrive together cost one write
//! to the client (see [`Coalescer`]).

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use futures::Stream;
use http::{Response, header};
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;
use tokio::time::Instant;
use tokio_util::sync::WaitForCancellationFutureOwned;

use super::openai::{Responder, TextFrames};
use super::respond::ApiError;
use super::{AppState, Body};
use crate::{Done, Event, Failed, Routing};

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
        text_frames: responder.text_frames(),
        grace_over: Box::pin(state.drain.grace_over()),
        state,
        responder,
        routing,
        unsent: opening,
        coalescer: Coalescer::default(),
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
    /// Each token's frame, rendered around its text.
    text_frames: TextFrames,
    routing: Routing,
    /// Bytes framed but not yet handed to hyper (at first, the chat role chunk).
    unsent: Vec<u8>,
    coalescer: Coalescer,
    /// The first event, received before the response was committed.
    pending: Option<Event>,
    last_text: Option<Instant>,
    done: bool,
    arrived: Instant,
    /// The router's shutdown grace period is over: end with an error event.
    grace_over: Pin<Box<WaitForCancellationFutureOwned>>,
}

/// Most bytes of events written to the client in one frame.
const COALESCE_LIMIT: usize = 64 << 10;

/// Room made for each event framed: a text chunk's JSON is 150–300 bytes, and a frame grown
/// from empty reallocated five times on the way (8, 16, … 256 bytes) for every token.
const EVENT_BYTES: usize = 512;

impl Stream for StreamRelay {
    type Item = Result<Frame<Bytes>, Infallible>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        let mut out = std::mem::take(&mut this.unsent);
        let mut events = 0;
        if let Some(first) = this.pending.take() {
            this.frame(first, &mut out);
            events += 1;
        }
        if !this.done && this.grace_over.as_mut().poll(cx).is_ready() {
            this.shut_down(&mut out);
        }
        // Everything the routing has ready goes in this frame.
        while !this.done && out.len() < COALESCE_LIMIT {
            match Pin::new(&mut this.routing).poll_next(cx) {
                Poll::Ready(Some(event)) => this.frame(event, &mut out),
                Poll::Ready(None) => this.abandoned(&mut out),
                Poll::Pending => break,
            }
            events += 1;
        }
        this.coalescer.polled(events);
        if !out.is_empty() && !this.done && this.coalescer.hold(out.len()) {
            this.unsent = out;
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        match (out.is_empty(), this.done) {
            (false, _) => {
                this.coalescer.wrote();
                Poll::Ready(Some(Ok(Frame::data(Bytes::from(out)))))
            }
            (true, true) => Poll::Ready(None),
            (true, false) => Poll::Pending,
        }
    }
}

/// Whether a frame is held back for more events before it is written.
///
/// The HTTP client hands the engine's chunks over one task switch at a time, even when one
/// read brought many, so a frame written at the first lull carries one token. Holding it for
/// up to [`QUIET_TURNS`] scheduler turns without a new event (a self-wake each) lets the rest
/// arrive first: with null engines (32 tokens per request, concurrency 4, 2 vCPUs) that made
/// 4 writes per request instead of 33 and cut the router's CPU per request by a third.
///
/// The first frame is never held: it carries the first token, which is what the client is
/// waiting for, and a real engine sends it alone. A turn is not free either: on a machine
/// with idle cores each self-wake also wakes a parked worker, and holding the first frame
/// added 150–300 µs to the time to first token on 16 vCPUs (50–100 µs on 2).
#[derive(Debug, Default)]
struct Coalescer {
    first_written: bool,
    /// Turns given up for the frame being built, and how many of the last ones in a row
    /// brought no event.
    turns: u32,
    quiet_turns: u32,
}

/// Turns in a row without a new event after which a held frame is written.
const QUIET_TURNS: u32 = 2;

/// Most scheduler turns one frame is held: bounds the delay a fast stream adds to the first
/// bytes of a frame.
const MAX_TURNS: u32 = 64;

impl Coalescer {
    /// One poll of the routing framed `events` events.
    fn polled(&mut self, events: u32) {
        self.quiet_turns = if events > 0 { 0 } else { self.quiet_turns + 1 };
    }

    /// Whether to hold the frame being built (`unsent` bytes so far) for another turn.
    fn hold(&mut self, unsent: usize) -> bool {
        let hold = self.first_written
            && unsent < COALESCE_LIMIT
            && self.quiet_turns < QUIET_TURNS
            && self.turns < MAX_TURNS;
        self.turns += u32::from(hold);
        hold
    }

    /// The frame was written.
    fn wrote(&mut self) {
        self.first_written = true;
        self.turns = 0;
        self.quiet_turns = 0;
    }
}

impl StreamRelay {
    /// Append the client's bytes for one event.
    fn frame(&mut self, event: Event, out: &mut Vec<u8>) {
        out.reserve(EVENT_BYTES);
        let route = self.responder.shape.route();
        match event {
            Event::Text(text) => {
                let now = Instant::now();
                if let Some(last) = self.last_text.replace(now) {
                    self.state.metrics.inter_token(now - last);
                }
                self.text_frames.write(out, &text);
            }
            Event::Done(done) => {
                let Done {
                    finish_reason,
                    usage,
                    summary,
                } = *done;
                self.done = true;
                self.state.metrics.request(route, 200);
                self.state
                    .metrics
                    .finished(&summary, self.arrived.elapsed());
                self.responder.finish_frame(out, finish_reason.as_str());
                if let Some(usage) = &usage {
                    self.responder.usage_frame(out, usage);
                }
                out.extend_from_slice(switchyard_wire::sse::DONE_EVENT);
            }
            Event::Failed(failed) => {
                let Failed { error, summary } = *failed;
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

    /// The router's grace period is over: say so rather than truncate. Dropping the stream
    /// afterwards cancels its upstream legs.
    fn shut_down(&mut self, out: &mut Vec<u8>) {
        let error = ApiError::ShuttingDown;
        self.state
            .metrics
            .request(self.responder.shape.route(), error.status().as_u16());
        self.end_with(&error, out);
    }

    /// End the stream with `error`'s OpenAI error event, then `[DONE]`.
    fn end_with(&mut self, error: &ApiError, out: &mut Vec<u8>) {
        self.done = true;
        out.extend_from_slice(&error.sse_event());
        out.extend_from_slice(switchyard_wire::sse::DONE_EVENT);
    }
}

/// What `/metrics` counts a stream as when the client hung up before its last event: nginx's
/// "client closed request", so disconnects are visible next to the real statuses.
pub(crate) const CLIENT_CLOSED_REQUEST: u16 = 499;

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

#[cfg(test)]
mod tests {
    use super::*;

    /// Drives one frame: the first poll frames `first` events, each held turn then frames the
    /// next of `turns` (0 when it runs out). Returns the turns the frame was held for.
    fn frame(c: &mut Coalescer, first: u32, turns: &[u32]) -> u32 {
        c.polled(first);
        let mut more = turns.iter().copied();
        let mut held = 0;
        while c.hold(100) {
            held += 1;
            c.polled(more.next().unwrap_or(0));
        }
        c.wrote();
        held
    }

    #[test]
    fn the_first_frame_is_never_held() {
        let mut c = Coalescer::default();
        assert_eq!(frame(&mut c, 1, &[5]), 0);
    }

    #[test]
    fn a_later_frame_is_held_while_turns_bring_events_then_for_two_quiet_ones() {
        let mut c = Coalescer::default();
        frame(&mut c, 1, &[]);
        // Events on turns 1, 2 and 4; then two quiet turns (5, 6) end the hold.
        assert_eq!(frame(&mut c, 1, &[1, 1, 0, 1]), 6);
        assert_eq!(frame(&mut c, 1, &[]), QUIET_TURNS);
    }

    #[test]
    fn a_hold_is_bounded_by_turns_and_bytes() {
        let mut c = Coalescer::default();
        frame(&mut c, 1, &[]);
        assert_eq!(frame(&mut c, 1, &[1; 100]), MAX_TURNS);
        c.polled(1);
        assert!(!c.hold(COALESCE_LIMIT), "a full frame is written");
    }
}
