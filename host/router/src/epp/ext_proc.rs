//! `envoy.service.ext_proc.v3.ExternalProcessor/Process`: one bidirectional stream per HTTP
//! request, in `FULL_DUPLEX_STREAMED` mode for both bodies.
//!
//! ```text
//! request headers  ── end_of_stream ──→ pick now (no body) → headers answer with the destination
//!                  └─ else: wait for the body
//! request body     → buffered, bounded by --max-body-bytes (over it: 413, immediate)
//!                  → at end_of_stream (or the trailers): pick → the headers answer with the
//!                    destination, then every chunk back unchanged, the last one ending the body
//! response headers → passed on, their `:status` noted
//! response body    → every chunk passed on at once, unchanged (an SSE stream stays one)
//! end of response  → the policy's `on-complete`, with the endpoint the gateway served it from
//! ```
//!
//! A pick that fails answers the client at once (an OpenAI error body): 400 for the client's
//! mistake or a policy's `rejected`, 429 when admission control sheds it, 503 when no endpoint
//! can take it.
//!
//! The exchange runs inside the gRPC response stream: Envoy's next message is read and handled
//! when the connection polls for the next answer, in the stream's own task, with no task and
//! channel of its own between them (one wake-up less per message each way). When Envoy goes
//! away mid-request, the stream is dropped and the request counts as cancelled.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::Arc;

use bytes::Bytes;
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessor;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as Message;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse,
};
use futures::{Stream, stream};
use http_body_util::BodyExt;
use tokio::time::Instant;
use tonic::{Status, Streaming};

use super::pick::{self, Pick, Served};
use super::wire::{self, Head};
use crate::api::{ApiError, AppState};

/// The ext_proc service over the router's state.
#[derive(Clone)]
pub struct ExtProc {
    state: Arc<AppState>,
    /// Endpoints each answer names after the pick.
    fallbacks: usize,
}

impl ExtProc {
    pub fn new(state: Arc<AppState>, fallbacks: usize) -> Self {
        ExtProc { state, fallbacks }
    }
}

type Answers = Pin<Box<dyn Stream<Item = Result<ProcessingResponse, Status>> + Send>>;

#[tonic::async_trait]
impl ExternalProcessor for ExtProc {
    type ProcessStream = Answers;

    async fn process(
        &self,
        request: tonic::Request<Streaming<ProcessingRequest>>,
    ) -> Result<tonic::Response<Self::ProcessStream>, Status> {
        let exchange = Exchange {
            state: Arc::clone(&self.state),
            fallbacks: self.fallbacks,
            inbound: request.into_inner(),
            answers: VecDeque::new(),
            over: false,
            request: None,
            served: None,
            status: None,
            served_by: None,
        };
        Ok(tonic::Response::new(Box::pin(exchange.answers())))
    }
}

/// The exchange is over: the EPP answered the request itself, or Envoy broke the protocol.
struct Over;

/// One request's stream.
struct Exchange {
    state: Arc<AppState>,
    fallbacks: usize,
    /// Envoy's messages.
    inbound: Streaming<ProcessingRequest>,
    /// Answers made and not yet taken by the response stream: a message may have several (the
    /// destination, then the request's body chunks) or none (a body chunk before the last).
    answers: VecDeque<Result<ProcessingResponse, Status>>,
    /// The EPP has answered its last: the stream ends once `answers` is empty.
    over: bool,
    /// The request until it is picked: its head and the body chunks so far.
    request: Option<Buffered>,
    /// The request once picked, until its response ends.
    served: Option<Served>,
    /// The response's `:status`.
    status: Option<u16>,
    /// The endpoint the gateway says served the response.
    served_by: Option<String>,
}

struct Buffered {
    head: Head,
    subset: Option<Vec<String>>,
    chunks: Vec<Vec<u8>>,
    size: usize,
    arrived: Instant,
}

impl Exchange {
    /// The gRPC response stream: each answer in turn, Envoy's next message read and handled
    /// when none is left. A response still open when the stream ends or is dropped counts as
    /// cancelled.
    fn answers(self) -> impl Stream<Item = Result<ProcessingResponse, Status>> + Send {
        stream::unfold(self, |mut exchange| async move {
            let answer = exchange.next_answer().await?;
            Some((answer, exchange))
        })
    }

    async fn next_answer(&mut self) -> Option<Result<ProcessingResponse, Status>> {
        loop {
            if let Some(answer) = self.answers.pop_front() {
                return Some(answer);
            }
            if self.over {
                return None;
            }
            let message = match self.inbound.message().await {
                Ok(Some(message)) => message,
                Ok(None) => return None,
                Err(status) => {
                    tracing::debug!(%status, "ext_proc stream ended by the gateway");
                    return None;
                }
            };
            if self.handle(message).await.is_err() {
                self.over = true;
            }
        }
    }

    async fn handle(&mut self, message: ProcessingRequest) -> Result<(), Over> {
        // Only the first message says how the filter is configured. Any other request body
        // mode would wait for an answer to the headers the EPP gives only once the body is in.
        if let Some(config) = &message.protocol_config
            && config.request_body_mode != BodySendMode::FullDuplexStreamed as i32
        {
            let what = "the EPP needs the ext_proc filter's request_body_mode FULL_DUPLEX_STREAMED";
            return Err(self.protocol_error(what));
        }
        let Some(request) = message.request else {
            // Flow-control updates alone: nothing to answer.
            return Ok(());
        };
        match request {
            Message::RequestHeaders(headers) => {
                self.request_headers(headers, &message.metadata_context)
                    .await
            }
            Message::RequestBody(body) => self.request_body(body).await,
            Message::RequestTrailers(_) => {
                if self.request.is_some() {
                    self.pick_and_pass(false).await?;
                }
                self.answer(wire::continue_trailers(true));
                Ok(())
            }
            Message::ResponseHeaders(headers) => {
                self.response_headers(headers, &message.metadata_context);
                Ok(())
            }
            Message::ResponseBody(body) => {
                self.response_body(body);
                Ok(())
            }
            Message::ResponseTrailers(_) => {
                self.answer(wire::continue_trailers(false));
                self.finish();
                Ok(())
            }
        }
    }

    async fn request_headers(
        &mut self,
        headers: HttpHeaders,
        metadata: &Option<envoy_types::pb::envoy::config::core::v3::Metadata>,
    ) -> Result<(), Over> {
        self.request = Some(Buffered {
            head: wire::head(headers.headers.as_ref()),
            subset: wire::subset_hint(metadata.as_ref()),
            chunks: Vec::new(),
            size: 0,
            arrived: Instant::now(),
        });
        if headers.end_of_stream {
            return self.pick_and_pass(true).await;
        }
        Ok(())
    }

    async fn request_body(&mut self, body: HttpBody) -> Result<(), Over> {
        let limit = self.state.max_body_bytes;
        let Some(request) = self.request.as_mut() else {
            return Err(self.protocol_error("a request body before its headers"));
        };
        request.size += body.body.len();
        if request.size > limit {
            let route = pick::route(&request.head);
            return Err(self.refuse(route, ApiError::BodyTooLarge { limit }).await);
        }
        if !body.body.is_empty() || body.end_of_stream {
            request.chunks.push(body.body);
        }
        if body.end_of_stream {
            return self.pick_and_pass(true).await;
        }
        Ok(())
    }

    /// The request is whole: pick its endpoints, answer its headers with them, and pass its
    /// body chunks back as they came (`ends` when the last one ends the body; not when
    /// trailers follow).
    async fn pick_and_pass(&mut self, ends: bool) -> Result<(), Over> {
        let Some(request) = self.request.take() else {
            return Ok(());
        };
        let route = pick::route(&request.head);
        let headers_only = request.chunks.is_empty();
        let body = Bytes::from(request.chunks.concat());
        let chunks = request.chunks;
        let req = pick::Request {
            head: request.head,
            body,
            subset: request.subset,
            arrived: request.arrived,
        };
        let Pick {
            destinations,
            prefiller,
            served,
        } = match pick::pick(&self.state, req, self.fallbacks).await {
            Ok(pick) => pick,
            Err(error) => return Err(self.refuse(route, error).await),
        };
        tracing::debug!(?destinations, ?prefiller, "picked");
        self.served = Some(served);
        self.answer(wire::destination(&destinations, prefiller.as_deref()));
        if headers_only {
            return Ok(());
        }
        let last = chunks.len() - 1;
        for (i, chunk) in chunks.into_iter().enumerate() {
            self.answer(wire::body_chunk(true, chunk, ends && i == last));
        }
        Ok(())
    }

    fn response_headers(
        &mut self,
        headers: HttpHeaders,
        metadata: &Option<envoy_types::pb::envoy::config::core::v3::Metadata>,
    ) {
        self.status = wire::status(headers.headers.as_ref());
        self.served_by = wire::served(metadata.as_ref());
        self.answer(wire::continue_headers(false));
        if headers.end_of_stream {
            self.finish();
        }
    }

    fn response_body(&mut self, body: HttpBody) {
        if let Some(served) = self.served.as_mut() {
            served.first_byte();
        }
        let ends = body.end_of_stream;
        self.answer(wire::body_chunk(false, body.body, ends));
        if ends {
            self.finish();
        }
    }

    /// The response is over: its policy hears how it went.
    fn finish(&mut self) {
        if let Some(served) = self.served.take() {
            served.finish(self.status, self.served_by.as_deref());
        }
    }

    /// Answer the request (on `route`) in the gateway with `error`, and end the exchange.
    async fn refuse(&mut self, route: &'static str, error: ApiError) -> Over {
        tracing::debug!(%error, "answered by the EPP");
        self.state.metrics.request(route, error.status().as_u16());
        let response = error.response();
        let (parts, body) = response.into_parts();
        let body = match body.collect().await {
            Ok(collected) => collected.to_bytes().to_vec(),
            Err(never) => match never {},
        };
        let code = error.body().error.code.unwrap_or("error");
        self.answer(wire::immediate(parts.status, &parts.headers, body, code));
        Over
    }

    /// Envoy broke the protocol: end the stream with an error status.
    fn protocol_error(&mut self, what: &str) -> Over {
        tracing::warn!(what, "ext_proc protocol error");
        self.answers
            .push_back(Err(Status::failed_precondition(what.to_owned())));
        Over
    }

    fn answer(&mut self, answer: ProcessingResponse) {
        self.answers.push_back(Ok(answer));
    }
}
