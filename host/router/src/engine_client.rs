//! The HTTP client for every engine, one module per kind of call:
//!
//! ```text
//! EngineClient::new(Timeouts)     keep-alive HTTP/1.1 connections to all engines, pooled per thread
//!   http1          one connection's HTTP/1.1: the request written, the answer's head and body read
//!                  (httparse), what it refuses
//!   pool           connections made (TCP, TLS, in tests a pipe), kept idle per thread and engine,
//!                  closed after 4 s idle; an answer's body, which gives its connection back
//!   microserving   MLC-LLM's calls: prep_recv, remote_send, start_generate, forward, and
//!                  release (frees a prep_recv reservation)
//!   openai         the OpenAI routes as vLLM, SGLang and OpenAI-compatible engines take them:
//!                  generate_leg (streamed or whole), answer_leg (vLLM's prefill answer)
//!   probe          ready (GET [/health,] /v1/models), metrics (GET /metrics)
//!   tls            what an `https://` engine's connections trust and present, and TlsError
//! ```
//!
//! Every call fails with a [`CallError`] that says what went wrong on the wire; what that means
//! for the attempt (retry, blame, the policy's view) is the plan executor's decision.
//!
//! An [`Upstream`] is an engine's base URL and, for an engine that wants an API key, its
//! `Authorization: Bearer …` header, sent on every call, probes included, and for an
//! `https://` engine its [`EngineTls`].
//!
//! The router asks MLC engines to stream, even for a non-streaming client: one code path
//! relays, counts and resumes every generation, and time to first token is measurable. Other
//! engines get the client's own `stream` (their protocols define each leg's body), and a whole
//! answer is relayed as one chunk.

mod http1;
mod microserving;
mod openai;
mod pool;
mod probe;
#[cfg(test)]
pub(crate) mod scripted;
#[cfg(test)]
mod tests;
mod tls;

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures::{FutureExt, StreamExt, TryStreamExt};
use http::uri::{Authority, Scheme};
use http_body_util::BodyExt;
use serde::Serialize;
use serde::de::DeserializeOwned;
use switchyard_wire::completion::EngineChunk;
use switchyard_wire::error_chain;
use switchyard_wire::microserving::DEFAULT_CALL_TIMEOUT;
use switchyard_wire::sse::{self, ChunkStream, SseError, single_chunk};
use switchyard_wire::vllm::REQUEST_ID_HEADER;

use http1::Http1Error;
use pool::{EngineBody, Pool, Route, SendError};

pub use microserving::Release;
pub use openai::Answer;
pub use probe::ModelCard;
pub use tls::{EngineTls, TlsError, TlsFiles, TlsSetupError};

/// Largest non-streamed answer (a microserving JSON reply, a completion, an error body) read
/// from an engine: real ones are a few KiB, and an engine must not make the router buffer
/// without bound.
const MAX_ANSWER_BYTES: usize = 1 << 20;

/// How long a streamed body may stay open after `[DONE]` before its connection is dropped.
/// uvicorn (vLLM, SGLang) writes the body's end apart, right after `[DONE]`: a body dropped
/// unread at `[DONE]` closed its connection and every stream opened a new one. The reading
/// is detached, so only an engine that holds the body open waits this long, holding a task
/// and its connection, not a client.
const BODY_END_AFTER_DONE: Duration = Duration::from_secs(1);

/// How long the router waits on an engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    /// TCP connect.
    pub connect: Duration,
    /// A whole prep_recv or remote_send, and the response headers of a generation. prep_recv
    /// may block until the decode engine has free KV pages, and remote_send includes the
    /// prefill, so this is generous.
    pub call: Duration,
    /// Longest gap between two chunks of a generation.
    pub stream_idle: Duration,
    /// A readiness probe.
    pub probe: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts {
            connect: Duration::from_secs(2),
            call: DEFAULT_CALL_TIMEOUT,
            stream_idle: Duration::from_secs(60),
            probe: Duration::from_secs(2),
        }
    }
}

/// Why one call to an engine failed. The messages name no URL: they reach clients (whose
/// error bodies name endpoints by id) and the log alike.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// The request could not be written (its body does not serialize).
    #[error("cannot build the request: {reason}")]
    Build { reason: String },
    /// The endpoint's URL makes no request URI: the endpoint is misconfigured, and the call
    /// never left.
    #[error("the endpoint's URL is unusable: {reason}")]
    Url { reason: &'static str },
    /// Refused: nothing listens there (a sign the engine is down).
    #[error("cannot connect: {reason}")]
    Connect { reason: String },
    /// The connection closed or reset before an answer started: the engine went away mid-call.
    #[error("the connection closed before an answer: {reason}")]
    Closed { reason: String },
    #[error("no answer within {after:?}")]
    Timeout { after: Duration },
    #[error("answered HTTP {status}: {body}")]
    Status { status: u16, body: String },
    #[error("sent an answer that does not parse: {reason}")]
    Decode { reason: String },
    #[error(transparent)]
    Stream(#[from] SseError),
    /// The TLS handshake failed, or the endpoint's TLS files are unusable: no call reaches
    /// the engine until that is fixed.
    #[error(transparent)]
    Tls(#[from] TlsError),
}

impl CallError {
    /// Whether the engine failed to answer in time (as opposed to answering badly).
    pub fn is_timeout(&self) -> bool {
        matches!(self, CallError::Timeout { .. })
    }

    /// Whether the engine could not be reached at all (a sign it is down, or that no TLS
    /// connection to it can be made). A connection that breaks after the answer started is a
    /// [`CallError::Stream`] instead: the engine was up.
    pub fn is_unreachable(&self) -> bool {
        matches!(self, CallError::Connect { .. } | CallError::Tls(_))
    }

    /// A short name for the failure, as `/admin/endpoints` shows a probe's.
    pub fn kind(&self) -> &'static str {
        match self {
            CallError::Build { .. } => "build",
            CallError::Url { .. } => "url",
            CallError::Connect { .. } => "connect",
            CallError::Closed { .. } => "closed",
            CallError::Timeout { .. } => "timeout",
            CallError::Status { .. } => "status",
            CallError::Decode { .. } => "decode",
            CallError::Stream(_) => "stream",
            CallError::Tls(tls) => tls.kind(),
        }
    }
}

/// One engine as every call to it needs it: its base URL, when it wants one the
/// `Authorization` header (marked sensitive: never logged, and shown as redacted), and how
/// its connections are made.
#[derive(Clone)]
pub struct Upstream {
    base: Arc<str>,
    /// `base` split once (`None` if it is no `http(s)://HOST[:PORT][/PREFIX]` URI: every call
    /// then fails with [`CallError::Url`]), so a call's URI is assembled, not parsed.
    target: Option<Target>,
    auth: Option<http::HeaderValue>,
    /// Sent as `X-data-parallel-rank`: the engine's DP rank a call must run on.
    dp_rank: Option<http::HeaderValue>,
    transport: Transport,
}

/// vLLM's header pinning a request to one of its data-parallel ranks (its OpenAI server reads
/// it on the completion and chat routes and hands the rank to its engine client).
const DP_RANK_HEADER: http::HeaderName = http::HeaderName::from_static("x-data-parallel-rank");

/// The request id's header as a name made once: a `&str` name is parsed again on every call.
const REQUEST_ID: http::HeaderName = http::HeaderName::from_static(REQUEST_ID_HEADER);

/// Every call's body is JSON.
const JSON: http::HeaderValue = http::HeaderValue::from_static("application/json");

/// How an engine's connections are made.
#[derive(Clone)]
enum Transport {
    /// Plain TCP (`http://`).
    Plain,
    /// TLS (`https://`).
    Tls(EngineTls),
    /// `https://`, with TLS files that cannot be used: every call fails with
    /// [`TlsError::Setup`] (as an unusable URL fails with [`CallError::Url`]).
    Unusable(Arc<TlsSetupError>),
}

/// An engine's base URI in the parts every call's URI shares.
#[derive(Clone, PartialEq, Eq)]
struct Target {
    scheme: Scheme,
    authority: Authority,
    /// The base's path without its trailing slash: empty, or e.g. `/engine`.
    prefix: Box<str>,
    /// The `Host` header of every call, made once: the HTTP client writes one otherwise,
    /// formatting `host:port` again for each request.
    host: http::HeaderValue,
}

impl Target {
    fn parse(base: &str) -> Option<Target> {
        let uri: http::Uri = base.parse().ok()?;
        let parts = uri.into_parts();
        let scheme = parts.scheme?;
        let authority = parts.authority?;
        let host = host_header(&scheme, &authority)?;
        Some(Target {
            scheme,
            authority,
            prefix: parts
                .path_and_query
                .as_ref()
                .map_or("", |p| p.path())
                .trim_end_matches('/')
                .into(),
            host,
        })
    }
}

/// The `Host` header hyper-util's client would write for `authority`: its host, and its port
/// unless it is the scheme's default (no user info).
fn host_header(scheme: &Scheme, authority: &Authority) -> Option<http::HeaderValue> {
    let default_port = match scheme.as_str() {
        "http" => Some(80),
        "https" => Some(443),
        _ => None,
    };
    let host = match authority.port_u16() {
        Some(port) if Some(port) != default_port => {
            http::HeaderValue::try_from(format!("{}:{port}", authority.host()))
        }
        _ => http::HeaderValue::try_from(authority.host()),
    };
    host.ok()
}

impl Upstream {
    /// `base` (`http://host:port` or `https://…`, no trailing slash), called with `auth` when
    /// given; an `https://` engine's certificate is checked against the system's roots.
    pub fn new(base: Arc<str>, auth: Option<http::HeaderValue>) -> Upstream {
        Upstream::with_tls(base, auth, &TlsFiles::default())
    }

    /// [`Upstream::new`], an `https://` engine's connections made with `tls` (read here;
    /// files that cannot be used fail every call, see [`Upstream::tls_error`]). A plain
    /// `http://` engine ignores them.
    pub fn with_tls(base: Arc<str>, auth: Option<http::HeaderValue>, tls: &TlsFiles) -> Upstream {
        let target = Target::parse(&base);
        let transport = match &target {
            Some(target) if target.scheme == Scheme::HTTPS => match EngineTls::load(tls) {
                Ok(tls) => Transport::Tls(tls),
                Err(e) => Transport::Unusable(Arc::new(e)),
            },
            _ => Transport::Plain,
        };
        Upstream {
            base,
            target,
            auth,
            dp_rank: None,
            transport,
        }
    }

    /// The same engine, every call pinned to its data-parallel rank `rank`.
    #[must_use]
    pub fn pinned_to_rank(self, rank: u32) -> Upstream {
        Upstream {
            dp_rank: Some(http::HeaderValue::from(rank)),
            ..self
        }
    }

    /// Why its TLS files cannot be used, if they cannot.
    pub fn tls_error(&self) -> Option<&TlsSetupError> {
        match &self.transport {
            Transport::Unusable(e) => Some(e),
            Transport::Plain | Transport::Tls(_) => None,
        }
    }

    pub fn base(&self) -> &str {
        &self.base
    }

    /// The base URL, shared.
    pub fn base_url(&self) -> Arc<str> {
        Arc::clone(&self.base)
    }

    /// `method` on `base` + `path` (a route of the router's, from `/`), with the engine's
    /// `Authorization` when it wants one, written as it goes on the wire; room for `body_len`
    /// bytes of body.
    fn request(
        &self,
        method: &http::Method,
        path: &str,
        body_len: usize,
    ) -> Result<http1::Request, CallError> {
        let target = self.target.as_ref().ok_or(CallError::Url {
            reason: "it is no http(s)://HOST:PORT",
        })?;
        let mut request = http1::Request::start(method, &target.prefix, path, body_len);
        request.header(&http::header::HOST, target.host.as_bytes());
        if let Some(auth) = &self.auth {
            request.header(&http::header::AUTHORIZATION, auth.as_bytes());
        }
        if let Some(rank) = &self.dp_rank {
            request.header(&DP_RANK_HEADER, rank.as_bytes());
        }
        Ok(request)
    }
}

impl std::fmt::Debug for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let auth = self.auth.as_ref().map(|_| "<redacted>");
        f.debug_struct("Upstream")
            .field("base", &self.base)
            .field("auth", &auth)
            .field("dp_rank", &self.dp_rank)
            .finish()
    }
}

impl PartialEq for Upstream {
    /// The same engine, called the same way: TLS made of the same files.
    fn eq(&self, other: &Upstream) -> bool {
        fn files(upstream: &Upstream) -> Option<&TlsFiles> {
            match &upstream.transport {
                Transport::Plain | Transport::Unusable(_) => None,
                Transport::Tls(tls) => Some(tls.files()),
            }
        }
        self.base == other.base
            && self.auth == other.auth
            && self.dp_rank == other.dp_rank
            && files(self) == files(other)
    }
}

impl Eq for Upstream {}

/// The HTTP/1 client for every call to every engine: keep-alive connections pooled per engine
/// and thread ([`pool`]), each answer read by the request's own task ([`http1`]).
///
/// Each thread has idle connections of its own: a connection is driven by the reactor of the
/// thread that opened it, so a request on the connection workers (`api::Workers`) uses
/// connections its own thread drives and wakes no other thread. Clones share the pools.
#[derive(Debug, Clone)]
pub struct EngineClient {
    pool: Arc<Pool>,
    timeouts: Timeouts,
}

/// An engine's answer as far as the router reads its head, its body still to read.
#[derive(Debug)]
struct EngineResponse {
    status: http::StatusCode,
    /// Whether it is an SSE stream (`Content-Type: text/event-stream`).
    event_stream: bool,
    body: EngineBody,
}

impl EngineResponse {
    fn status(&self) -> http::StatusCode {
        self.status
    }

    fn into_body(self) -> EngineBody {
        self.body
    }
}

impl EngineClient {
    pub fn new(timeouts: Timeouts) -> Self {
        EngineClient {
            pool: Arc::new(Pool::tcp(timeouts.connect)),
            timeouts,
        }
    }

    /// A client whose connections reach the in-process engines behind `connector`.
    #[cfg(test)]
    pub(crate) fn scripted(timeouts: Timeouts, connector: scripted::Connector) -> Self {
        EngineClient {
            pool: Arc::new(Pool::scripted(connector)),
            timeouts,
        }
    }

    /// `wire` (a request as written, see [`Upstream::request`]) to `engine` on this thread's
    /// pool: on an idle connection when there is one and `reuse`, and when the engine closed
    /// that one as the request went out, once more on a fresh one (the request never reached
    /// it). An engine whose TLS files are unusable fails here, before any connection.
    async fn exchange(
        &self,
        engine: &Upstream,
        wire: &[u8],
        delivery: Option<&Delivery>,
        reuse: bool,
    ) -> Result<EngineResponse, Failed> {
        let route = route(engine).map_err(Failed::Call)?;
        let sent = match self.pool.send(&route, wire, reuse, delivery).await {
            Err(SendError::Stale(e)) => {
                let engine = engine.base();
                tracing::debug!(engine, reason = %error_chain(&e), "pooled connection closed; sending again");
                self.pool.send(&route, wire, false, delivery).await
            }
            sent => sent,
        };
        let (head, body) = sent.map_err(Failed::Send)?;
        Ok(EngineResponse {
            status: head.status,
            event_stream: head.event_stream,
            body,
        })
    }

    pub fn timeouts(&self) -> Timeouts {
        self.timeouts
    }

    /// When a call (or the rest of an answer) started now is due: the call timeout from now.
    fn call_deadline(&self) -> tokio::time::Instant {
        tokio::time::Instant::now() + self.timeouts.call
    }

    /// `body` to `path`, its answer's head by `deadline` when given: a 2xx answer, or the
    /// error status (with the start of its body) as the error.
    async fn send<B: Serialize>(
        &self,
        engine: &Upstream,
        path: &str,
        body: &B,
        deadline: Option<tokio::time::Instant>,
        request_id: Option<&str>,
        delivery: Option<&Delivery>,
    ) -> Result<EngineResponse, CallError> {
        let json = to_json(body)?;
        let mut request = engine.request(&http::Method::POST, path, json.len())?;
        if let Some(id) = request_id {
            if !http1::is_header_value(id.as_bytes()) {
                return Err(CallError::Build {
                    reason: "the request id is no header value".into(),
                });
            }
            request.header(&REQUEST_ID, id.as_bytes());
        }
        // The leg's span (the current one) as the engine's parent: its spans join the trace.
        if crate::telemetry::is_on() {
            let mut headers = http::HeaderMap::new();
            crate::telemetry::inject(&mut headers);
            request.headers(&headers);
        }
        let wire = &json_request(request, &json);
        let send = |reuse| async move {
            let sent = self.exchange(engine, wire, delivery, reuse);
            match deadline {
                Some(deadline) => tokio::time::timeout_at(deadline, sent).await.map_err(|_| {
                    CallError::Timeout {
                        after: self.timeouts.call,
                    }
                })?,
                None => sent.await,
            }
            .map_err(|e| e.classify(engine))
        };
        let response = match send(true).await {
            // The connection closed before an answer (a fresh one too): once more, on a fresh
            // connection, without blaming the engine.
            Err(CallError::Closed { reason }) => {
                let engine = engine.base();
                tracing::debug!(engine, path, %reason, "connection closed before an answer; sending again");
                send(false).await
            }
            answer => answer,
        }?;
        let status = response.status();
        if status.is_success() {
            return Ok(response);
        }
        // The body only explains the status: a cut or oversized one still yields the status.
        let deadline = deadline.unwrap_or_else(|| self.call_deadline());
        let body = read_capped(response, deadline, MAX_ANSWER_BYTES)
            .await
            .map(|bytes| String::from_utf8_lossy(&bytes).into_owned())
            .unwrap_or_default();
        Err(CallError::Status {
            status: status.as_u16(),
            body: truncate(body, 512),
        })
    }

    /// `body` to `path`, its whole JSON answer read by the call's deadline.
    async fn call_json<B: Serialize, R: DeserializeOwned>(
        &self,
        engine: &Upstream,
        path: &str,
        body: &B,
    ) -> Result<R, CallError> {
        let deadline = self.call_deadline();
        let response = self
            .send(engine, path, body, Some(deadline), None, None)
            .await?;
        let bytes = read_capped(response, deadline, MAX_ANSWER_BYTES).await?;
        serde_json::from_slice(&bytes).map_err(|e| CallError::Decode {
            reason: e.to_string(),
        })
    }

    /// `body` to `path`, answered by a generation: an SSE stream, or one JSON answer relayed
    /// as one chunk (chat read as completion).
    async fn generate<B: Serialize>(
        &self,
        engine: &Upstream,
        path: &str,
        body: &B,
        request_id: Option<&str>,
        head_within: Option<Duration>,
        delivery: Option<&Delivery>,
    ) -> Result<ChunkStream, CallError> {
        // No whole-request timeout on a stream: it lives as long as the generation. The
        // headers get `head_within`, each chunk after that gets `stream_idle`.
        let send = self.send(engine, path, body, None, request_id, delivery);
        let response = match head_within {
            Some(within) => tokio::time::timeout(within, send)
                .await
                .map_err(|_| CallError::Timeout { after: within })??,
            None => send.await?,
        };
        if !response.event_stream {
            let deadline = self.call_deadline();
            let bytes = read_capped(response, deadline, MAX_ANSWER_BYTES).await?;
            let mut one: EngineChunk =
                serde_json::from_slice(&bytes).map_err(|e| CallError::Decode {
                    reason: e.to_string(),
                })?;
            one.fold_chat();
            return Ok(single_chunk(one));
        }
        let bytes = response
            .into_body()
            .into_data_stream()
            .map_err(|e| error_chain(&e));
        // The body's end is read in the background, so that `[DONE]` reaches the client at
        // once and the connection stays pooled (see `BODY_END_AFTER_DONE`).
        // An end that has already arrived is read here, without a task; only a body still open
        // after `[DONE]` costs one.
        let events = sse::data_events(bytes).on_done(|rest| {
            let mut end = Box::pin(tokio::time::timeout(
                BODY_END_AFTER_DONE,
                rest.read_to_end(),
            ));
            if (&mut end).now_or_never().is_none() {
                tokio::spawn(end);
            }
        });
        Ok(with_idle_timeout(
            sse::chunks(events),
            self.timeouts.stream_idle,
        ))
    }
}

/// Says when a request has all been written to its connection. A caller that must not hang
/// up before the engine has the request (vLLM's decode leg, which frees the prefill's KV lease
/// only if it got the params) waits for it before dropping the call. A request sent again on a
/// fresh connection (the pooled one closed under it) does not signal twice.
#[derive(Debug, Clone)]
pub struct Delivery(Arc<std::sync::Mutex<Option<tokio::sync::oneshot::Sender<()>>>>);

impl Delivery {
    pub fn new() -> (Delivery, tokio::sync::oneshot::Receiver<()>) {
        let (tx, rx) = tokio::sync::oneshot::channel();
        (Delivery(Arc::new(std::sync::Mutex::new(Some(tx)))), rx)
    }

    fn delivered(&self) {
        if let Some(tx) = self.0.lock().ok().and_then(|mut tx| tx.take()) {
            let _ = tx.send(());
        }
    }
}

/// `body` as JSON.
fn to_json(body: &impl Serialize) -> Result<Vec<u8>, CallError> {
    serde_json::to_vec(body).map_err(|e| CallError::Build {
        reason: format!("cannot write the request body: {e}"),
    })
}

/// `request` with `json` as its body, as written.
fn json_request(mut request: http1::Request, json: &[u8]) -> Vec<u8> {
    request.header(&http::header::CONTENT_TYPE, JSON.as_bytes());
    request.finish(Some(json))
}

/// A whole non-streamed answer, at most `cap` bytes, by `deadline`.
async fn read_capped(
    response: EngineResponse,
    deadline: tokio::time::Instant,
    cap: usize,
) -> Result<Bytes, CallError> {
    let started = tokio::time::Instant::now();
    let read = async {
        // Most answers are one frame, kept as it came; only a second one makes a copy.
        let mut first = None::<Bytes>;
        let mut joined = BytesMut::new();
        let mut len = 0;
        let mut frames = response.into_body();
        while let Some(frame) = frames.frame().await {
            let Ok(chunk) = frame.map_err(broken_answer)?.into_data() else {
                continue; // trailers
            };
            len += chunk.len();
            if len > cap {
                return Err(CallError::Decode {
                    reason: format!("the answer is over {cap} bytes"),
                });
            }
            match first.take() {
                None if joined.is_empty() => first = Some(chunk),
                Some(before) => {
                    joined.extend_from_slice(&before);
                    joined.extend_from_slice(&chunk);
                }
                None => joined.extend_from_slice(&chunk),
            }
        }
        Ok(first.unwrap_or_else(|| joined.freeze()))
    };
    tokio::time::timeout_at(deadline, read)
        .await
        .map_err(|_| CallError::Timeout {
            after: deadline.saturating_duration_since(started),
        })?
}

/// An answer that started and then broke off: the engine is up (it answered), so this is a
/// failed call to retry, not a sign the endpoint is down, and not a malformed answer either.
fn broken_answer(e: Http1Error) -> CallError {
    CallError::Stream(SseError::Transport(error_chain(&e)))
}

/// End a chunk stream with an error when the engine goes quiet for longer than `idle`. Fused:
/// polling it again after its end keeps answering `None`.
fn with_idle_timeout(chunks: ChunkStream, idle: Duration) -> ChunkStream {
    Box::pin(IdleTimeout {
        chunks,
        idle,
        waiting_since: None,
        timer: Box::pin(tokio::time::sleep(idle)),
        over: false,
    })
}

/// A chunk stream that fails with [`SseError::Idle`] once its reader has waited `idle` for a
/// chunk. The gap is measured while the reader waits (polled, nothing ready), so a client that
/// is slow to take chunks never makes the engine look quiet.
///
/// One timer per stream, not one per chunk: a chunk only clears `waiting_since`, and the timer
/// is set again when it fires early (once per `idle` at most). A timeout around each chunk's
/// read registered and cancelled a timer entry in the runtime's wheel for every token.
struct IdleTimeout {
    chunks: ChunkStream,
    idle: Duration,
    /// When the reader started waiting for the next chunk; `None` while one is ready or read.
    waiting_since: Option<tokio::time::Instant>,
    /// Fires at or before `waiting_since + idle` (a wait that began later moves it on).
    timer: Pin<Box<tokio::time::Sleep>>,
    over: bool,
}

impl futures::Stream for IdleTimeout {
    type Item = Result<EngineChunk, SseError>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        if this.over {
            return Poll::Ready(None);
        }
        if let Poll::Ready(item) = this.chunks.poll_next_unpin(cx) {
            this.waiting_since = None;
            this.over = item.is_none();
            return Poll::Ready(item);
        }
        let since = *this
            .waiting_since
            .get_or_insert_with(tokio::time::Instant::now);
        let due = since + this.idle;
        while this.timer.as_mut().poll(cx).is_ready() {
            if due <= tokio::time::Instant::now() {
                this.over = true;
                return Poll::Ready(Some(Err(SseError::Idle(this.idle))));
            }
            this.timer.as_mut().reset(due);
        }
        Poll::Pending
    }
}

/// Where `engine`'s connections go; why none can be made when its URL or TLS files are
/// unusable.
fn route(engine: &Upstream) -> Result<Route<'_>, CallError> {
    let target = engine.target.as_ref().ok_or(CallError::Url {
        reason: "it is no http(s)://HOST:PORT",
    })?;
    let tls = match &engine.transport {
        Transport::Plain => None,
        Transport::Tls(tls) => Some(tls),
        Transport::Unusable(e) => return Err(TlsError::Setup(Arc::clone(e)).into()),
    };
    let default_port = match target.scheme == Scheme::HTTPS {
        true => 443,
        false => 80,
    };
    Ok(Route {
        authority: &target.authority,
        default_port,
        tls,
    })
}

/// Why [`EngineClient::exchange`] got no answer's head.
#[derive(Debug)]
enum Failed {
    /// Before any connection: the endpoint is unusable as configured.
    Call(CallError),
    Send(SendError),
}

impl Failed {
    /// What the failure says about `engine`: a TLS failure (during the handshake, or an
    /// engine's alert that it refused the client's certificate, which TLS 1.3 delivers with
    /// the first read), a failed connect, a connection closed before an answer, or a head that
    /// is no HTTP answer.
    fn classify(self, engine: &Upstream) -> CallError {
        let e = match self {
            Failed::Call(e) => return e,
            Failed::Send(e) => e,
        };
        if let Transport::Tls(tls) = &engine.transport
            && let Some(failure) = TlsError::find(&e, tls.presents_certificate())
        {
            return failure.into();
        }
        let reason = error_chain(&e);
        match e {
            e if e.is_connect() => CallError::Connect { reason },
            e if e.is_closed() => CallError::Closed { reason },
            // Once an answer has started, a break is a broken answer (the engine is up).
            SendError::Http1(e @ Http1Error::Broken(_)) => broken_answer(e),
            _ => CallError::Decode { reason },
        }
    }
}

fn truncate(mut s: String, max: usize) -> String {
    if s.len() > max {
        let mut cut = max;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
        s.push('…');
    }
    s
}
