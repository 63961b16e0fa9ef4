//! The HTTP client for every engine: MLC-LLM's microserving calls (`/microserving/*`,
//! `/v1/completions`), the legs of vLLM's and SGLang's handoffs and forwards to any
//! OpenAI-compatible engine (`generate_leg`, `answer_leg`), and the probes.
//!
//! ```text
//! EngineClient::new(Timeouts)                         one pooled keep-alive client for all engines
//!   prep_recv(&Upstream, &PrepRecvRequest)   -> PrepRecvResponse
//!   remote_send(&Upstream, &RemoteSendRequest) -> ()
//!   start_generate(&Upstream, &StartGenerateRequest) -> ChunkStream (SSE, or one JSON as one chunk)
//!   forward(&Upstream, &CompletionRequest)   -> ChunkStream
//!   release(&Upstream, &StartGenerateRequest) -> Release        (frees a prep_recv reservation)
//!   generate_leg(&Upstream, path, body, request id) -> ChunkStream  (vLLM, SGLang, OpenAI)
//!   answer_leg(&Upstream, path, body, request id)   -> Answer       (vLLM's prefill answer)
//!   ready(&Upstream, Protocol)               -> Option<models>  (GET [/health,] /v1/models)
//!   metrics(&Upstream)                       -> Option<String>  (GET /metrics, Prometheus text)
//! ```
//!
//! An [`Upstream`] is an engine's base URL and, for an engine that wants an API key, its
//! `Authorization: Bearer …` header, sent on every call, probes included.
//!
//! The router asks MLC engines to stream, even for a non-streaming client: one code path
//! relays, counts and resumes every generation, and time to first token is measurable. Other
//! engines get the client's own `stream` (their protocols define each leg's body), and a whole
//! answer is relayed as one chunk.

#[cfg(test)]
mod tests;

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use http::uri::{Authority, PathAndQuery, Scheme};
use http_body_util::BodyExt;
use hyper::body::{Frame, Incoming, SizeHint};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use serde::Serialize;
use serde::de::DeserializeOwned;
use switchyard_contract::Protocol;
use switchyard_wire::completion::{CompletionRequest, CompletionResponse};
use switchyard_wire::error_chain;
use switchyard_wire::microserving::{
    DEFAULT_CALL_TIMEOUT, PrepRecvRequest, PrepRecvResponse, RemoteSendRequest,
    StartGenerateRequest,
};
use switchyard_wire::sse::{ChunkStream, SseError, parse_chunks, single_chunk};
use switchyard_wire::vllm::REQUEST_ID_HEADER;
use thread_local::ThreadLocal;

/// Largest non-streamed answer (a microserving JSON reply, a completion, an error body) read
/// from an engine: real ones are a few KiB, and an engine must not make the router buffer
/// without bound.
const MAX_ANSWER_BYTES: usize = 1 << 20;

/// Largest probe answer read (`/v1/models`, `/metrics`): an engine's are a few KiB.
const MAX_PROBE_BYTES: usize = 256 << 10;

/// How long an idle pooled connection to an engine is kept.
const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(4);

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
}

impl CallError {
    /// Whether the engine failed to answer in time (as opposed to answering badly).
    pub fn is_timeout(&self) -> bool {
        matches!(self, CallError::Timeout { .. })
    }

    /// Whether the engine could not be reached at all (a sign it is down). A connection that
    /// breaks after the answer started is a [`CallError::Stream`] instead: the engine was up.
    pub fn is_unreachable(&self) -> bool {
        matches!(self, CallError::Connect { .. })
    }
}

/// How one try to free a decode engine's prep_recv reservation ended (see
/// [`EngineClient::release`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Release {
    /// The engine took the reservation over and saw the connection close: it is freed.
    Freed,
    /// Nothing left to do: the engine no longer holds it (it said so, or its process is gone
    /// and with it the reservation), or the release was sent and the engine frees it when it
    /// runs it.
    Gone(String),
    /// Refused for now, or never sent: the engine is busy with the reservation (a transfer is
    /// still writing it), failing, or could not be connected to; try again later.
    Later(String),
}

/// One engine as every call to it needs it: its base URL and, when it wants one, the
/// `Authorization` header (marked sensitive: never logged, and shown as redacted).
#[derive(Clone, PartialEq, Eq)]
pub struct Upstream {
    base: Arc<str>,
    /// `base` split once (`None` if it is no `http://HOST[:PORT][/PREFIX]` URI: every call
    /// then fails to connect), so a call's URI is assembled, not parsed.
    target: Option<Target>,
    auth: Option<http::HeaderValue>,
}

/// An engine's base URI in the parts every call's URI shares.
#[derive(Clone, PartialEq, Eq)]
struct Target {
    scheme: Scheme,
    authority: Authority,
    /// The base's path without its trailing slash: empty, or e.g. `/engine`.
    prefix: Box<str>,
}

impl Target {
    fn parse(base: &str) -> Option<Target> {
        let uri: http::Uri = base.parse().ok()?;
        let parts = uri.into_parts();
        Some(Target {
            scheme: parts.scheme?,
            authority: parts.authority?,
            prefix: parts
                .path_and_query
                .as_ref()
                .map_or("", |p| p.path())
                .trim_end_matches('/')
                .into(),
        })
    }

    /// This base followed by `path` (from `/`), as concatenating the two strings would give.
    fn with_path(&self, path: &str) -> Result<http::Uri, http::Error> {
        let path = match &*self.prefix {
            "" => PathAndQuery::try_from(path)?,
            prefix => PathAndQuery::try_from(format!("{prefix}{path}"))?,
        };
        http::Uri::builder()
            .scheme(self.scheme.clone())
            .authority(self.authority.clone())
            .path_and_query(path)
            .build()
    }
}

impl Upstream {
    /// `base` (`http://host:port`, no trailing slash), called with `auth` when given.
    pub fn new(base: Arc<str>, auth: Option<http::HeaderValue>) -> Upstream {
        let target = Target::parse(&base);
        Upstream { base, target, auth }
    }

    pub fn base(&self) -> &str {
        &self.base
    }

    /// The base URL, shared.
    pub fn base_url(&self) -> Arc<str> {
        Arc::clone(&self.base)
    }

    /// `method` on `base` + `path`, with the engine's `Authorization` when it wants one.
    fn request(
        &self,
        method: http::Method,
        path: &str,
    ) -> Result<http::request::Builder, CallError> {
        let uri = self
            .target
            .as_ref()
            .ok_or("the endpoint's URL is no http://HOST:PORT")
            .and_then(|target| {
                target
                    .with_path(path)
                    .map_err(|_| "the path does not make a URI")
            })
            .map_err(|why| CallError::Connect { reason: why.into() })?;
        let request = http::Request::builder().method(method).uri(uri);
        Ok(match &self.auth {
            Some(auth) => request.header(http::header::AUTHORIZATION, auth.clone()),
            None => request,
        })
    }
}

impl std::fmt::Debug for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let auth = self.auth.as_ref().map(|_| "<redacted>");
        f.debug_struct("Upstream")
            .field("base", &self.base)
            .field("auth", &auth)
            .finish()
    }
}

/// The HTTP/1 client for every call to every engine (keep-alive connections pooled per host):
/// hyper-util's pooled client, the one under reqwest, called directly. reqwest's layers above
/// it (its redirect policy parses every request's URI into a URL again, its tower stack) cost
/// a proxy hop about 15 µs of CPU per request here (`host/bench/examples/passthrough.rs` both
/// ways), and the router follows no redirects from engines.
///
/// Each thread has a pool of its own: an engine connection is driven by a task on the thread
/// that opened it, so a request on the connection workers (`api::Workers`) uses connections
/// its own thread drives and wakes no other thread. Clones share the pools.
#[derive(Debug, Clone)]
pub struct EngineClient {
    http: Arc<ThreadLocal<Client<HttpConnector, CallBody>>>,
    timeouts: Timeouts,
}

/// An engine's answer, its body still to read.
type EngineResponse = http::Response<Incoming>;

impl EngineClient {
    pub fn new(timeouts: Timeouts) -> Self {
        EngineClient {
            http: Arc::default(),
            timeouts,
        }
    }

    /// This thread's pooled client.
    fn http(&self) -> &Client<HttpConnector, CallBody> {
        self.http.get_or(|| {
            let mut connector = HttpConnector::new();
            connector.set_connect_timeout(Some(self.timeouts.connect));
            connector.set_nodelay(true);
            Client::builder(TokioExecutor::new())
                // Below common engine keep-alive timeouts (uvicorn closes idle connections
                // after 5 s), so a request is not sent on a connection the engine is closing.
                .pool_idle_timeout(POOL_IDLE_TIMEOUT)
                .pool_timer(TokioTimer::new())
                .build(connector)
        })
    }

    pub fn timeouts(&self) -> Timeouts {
        self.timeouts
    }

    /// When a call (or the rest of an answer) started now is due: the call timeout from now.
    fn call_deadline(&self) -> tokio::time::Instant {
        tokio::time::Instant::now() + self.timeouts.call
    }

    /// Ask the decode engine to reserve KV slots for `[0, end)`.
    pub async fn prep_recv(
        &self,
        engine: &Upstream,
        body: &PrepRecvRequest,
    ) -> Result<PrepRecvResponse, CallError> {
        self.call_json(engine, "/microserving/prep_recv", body)
            .await
    }

    /// Ask the prefill engine to compute the prompt and push KV into the decode engine.
    pub async fn remote_send(
        &self,
        engine: &Upstream,
        body: &RemoteSendRequest,
    ) -> Result<(), CallError> {
        let _: serde_json::Value = self
            .call_json(engine, "/microserving/remote_send", body)
            .await?;
        Ok(())
    }

    /// Start generating on the decode engine; the answer is streamed.
    pub async fn start_generate(
        &self,
        engine: &Upstream,
        body: &StartGenerateRequest,
    ) -> Result<ChunkStream, CallError> {
        self.generate(engine, "/microserving/start_generate", body)
            .await
    }

    /// Send the whole request to one engine's `/v1/completions`.
    pub async fn forward(
        &self,
        engine: &Upstream,
        body: &CompletionRequest,
    ) -> Result<ChunkStream, CallError> {
        self.generate(engine, "/v1/completions", body).await
    }

    /// Free the reservation a successful prep_recv made for `body.common.user`, the one way
    /// the microserving protocol offers: start generating from it and hang up at once. Both
    /// an MLC engine and the reference engine abort a generation whose client is gone, and
    /// aborting frees its KV. Only for an id whose prep_recv answered: an MLC engine crashes on
    /// a start_generate for an id it never prepared.
    pub async fn release(&self, engine: &Upstream, body: &StartGenerateRequest) -> Release {
        let request = engine
            .request(http::Method::POST, "/microserving/start_generate")
            .and_then(|request| json_request(request, to_json(body)?, None));
        let request = match request {
            Ok(request) => request,
            Err(e) => return Release::Later(e.to_string()),
        };
        let within = self.timeouts.call;
        let Ok(sent) = tokio::time::timeout(within, self.http().request(request)).await else {
            // Sent, but no answer came (a frozen engine): see below.
            return Release::Gone(format!("sent, answer lost: no answer within {within:?}"));
        };
        match sent {
            // Dropping the response closes the connection before the generation ends.
            Ok(response) if response.status().is_success() => Release::Freed,
            // A transfer into the reservation is still being written (reference engine).
            Ok(response) if response.status() == http::StatusCode::CONFLICT => {
                Release::Later("a KV transfer into it is still under way".into())
            }
            Ok(response) if response.status().is_client_error() => {
                Release::Gone(format!("the engine answered HTTP {}", response.status()))
            }
            Ok(response) => {
                Release::Later(format!("the engine answered HTTP {}", response.status()))
            }
            // Not even connected: the request never left, so it is safe to send again.
            Err(e) if e.is_connect() && connect_timed_out(&e) => Release::Later(error_chain(&e)),
            // Refused: the engine process is gone, and its reservations with it.
            Err(e) if e.is_connect() => Release::Gone(error_chain(&e)),
            // Sent, but no answer came (a frozen engine): the engine runs it when it can, sees
            // the connection gone and aborts, which frees the pages. Sending it again could
            // reach an MLC engine for an id it no longer holds, which it does not survive.
            Err(e) => Release::Gone(format!("sent, answer lost: {}", error_chain(&e))),
        }
    }

    /// Readiness, as each protocol's engines report it: vLLM and SGLang answer `GET /health`
    /// with 200 once they serve, and every engine lists its models on `GET /v1/models`; `Some`
    /// with the ids of the models it serves (none when the list does not parse).
    pub async fn ready(&self, engine: &Upstream, protocol: Protocol) -> Option<Vec<String>> {
        if matches!(protocol, Protocol::Vllm | Protocol::Sglang) {
            self.probe(engine, "/health").await?;
        }
        #[derive(serde::Deserialize)]
        struct Models {
            data: Vec<Model>,
        }
        #[derive(serde::Deserialize)]
        struct Model {
            id: String,
        }
        let body = self.probe(engine, "/v1/models").await?;
        let ids = serde_json::from_slice::<Models>(&body)
            .map(|m| m.data.into_iter().map(|m| m.id).collect())
            .unwrap_or_default();
        Some(ids)
    }

    /// The engine's Prometheus text (`GET /metrics`); `None` when it has none or does not
    /// answer within the probe timeout.
    pub async fn metrics(&self, engine: &Upstream) -> Option<String> {
        let body = self.probe(engine, "/metrics").await?;
        String::from_utf8(body.to_vec()).ok()
    }

    /// A probe's `GET`: the body of a 200 answer, at most [`MAX_PROBE_BYTES`], within the
    /// probe timeout.
    async fn probe(&self, engine: &Upstream, path: &str) -> Option<Bytes> {
        let deadline = tokio::time::Instant::now() + self.timeouts.probe;
        let request = engine
            .request(http::Method::GET, path)
            .ok()?
            .body(CallBody::empty())
            .ok()?;
        let response = tokio::time::timeout_at(deadline, self.http().request(request))
            .await
            .ok()?
            .ok()?;
        if response.status() != http::StatusCode::OK {
            return None;
        }
        read_capped(response, deadline, MAX_PROBE_BYTES).await.ok()
    }

    /// One leg of a vLLM or SGLang handoff, or a forward to a non-MLC engine: `body` to
    /// `path`, tagged with the attempt's `request_id` (`X-Request-Id`, which vLLM bases its own
    /// ids on); the answer is streamed or whole, as `body` asked (`streamed`), chat read as
    /// completion. A whole answer comes with its head once the generation is over, however long
    /// that takes: its wait is bounded by the request's own deadline (`--request-timeout`),
    /// not by the call timeout a stream's head gets.
    ///
    /// With `delivery`, it says when the body has all been handed to the connection (see
    /// [`Delivery`]).
    pub async fn generate_leg(
        &self,
        engine: &Upstream,
        path: &str,
        body: &impl Serialize,
        request_id: &str,
        streamed: bool,
        delivery: Option<&Delivery>,
    ) -> Result<ChunkStream, CallError> {
        let head_within = streamed.then_some(self.timeouts.call);
        self.generate_with(engine, path, body, Some(request_id), head_within, delivery)
            .await
    }

    /// A leg whose whole answer the router reads itself (vLLM's prefill leg), in two steps: the
    /// head of a 2xx answer (an error status is read and returned as the error), within the call
    /// timeout ([`Answer::read`] then reads the body). The head is its own step because it is
    /// when the engine has committed to the answer.
    pub async fn answer_leg(
        &self,
        engine: &Upstream,
        path: &str,
        body: &impl Serialize,
        request_id: &str,
    ) -> Result<Answer, CallError> {
        let deadline = self.call_deadline();
        let response = self
            .send(engine, path, body, Some(deadline), Some(request_id), None)
            .await?;
        Ok(Answer { response, deadline })
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
        let send = || async {
            let mut request = engine.request(http::Method::POST, path)?;
            if let Some(id) = request_id {
                request = request.header(REQUEST_ID_HEADER, id);
            }
            let request = json_request(request, json.clone(), delivery.cloned())?;
            let sent = self.http().request(request);
            match deadline {
                Some(deadline) => tokio::time::timeout_at(deadline, sent).await.map_err(|_| {
                    CallError::Timeout {
                        after: self.timeouts.call,
                    }
                })?,
                None => sent.await,
            }
            .map_err(classify)
        };
        let response = match send().await {
            // The engine closed a pooled connection just as the request went out (its
            // keep-alive ran out): once more, on a fresh connection, without blaming it.
            Err(CallError::Closed { reason }) => {
                let engine = engine.base();
                tracing::debug!(engine, path, %reason, "connection closed before an answer; sending again");
                send().await
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

    async fn generate<B: Serialize>(
        &self,
        engine: &Upstream,
        path: &str,
        body: &B,
    ) -> Result<ChunkStream, CallError> {
        self.generate_with(engine, path, body, None, Some(self.timeouts.call), None)
            .await
    }

    async fn generate_with<B: Serialize>(
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
        let is_sse = response
            .headers()
            .get(http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/event-stream"));
        if !is_sse {
            let deadline = self.call_deadline();
            let bytes = read_capped(response, deadline, MAX_ANSWER_BYTES).await?;
            let mut one: CompletionResponse =
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
        Ok(with_idle_timeout(
            parse_chunks(bytes),
            self.timeouts.stream_idle,
        ))
    }
}

/// A 2xx answer whose body is still to be read; see [`EngineClient::answer_leg`].
#[derive(Debug)]
pub struct Answer {
    response: EngineResponse,
    /// The call's: the whole answer is due within the call timeout of its sending.
    deadline: tokio::time::Instant,
}

impl Answer {
    /// The whole body, at most [`MAX_ANSWER_BYTES`], by the call's deadline.
    pub async fn read(self) -> Result<Bytes, CallError> {
        read_capped(self.response, self.deadline, MAX_ANSWER_BYTES).await
    }
}

/// Says when a request's body has all been handed to its connection: its receiver resolves
/// once the HTTP client has taken the body's last byte to write (the body is sent chunked, so
/// the client asks for more until it knows the end). A caller that must not hang up before the
/// engine has the request (vLLM's decode leg, which frees the prefill's KV lease only if it
/// got the params) waits for it before dropping the call. A request sent again on a fresh
/// connection (the pooled one closed under it) does not signal twice.
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

/// A call's body: its JSON in one frame, sent with its length, and the [`Delivery`] to signal
/// when the client takes that frame to write (its last byte).
#[derive(Debug)]
pub struct CallBody {
    json: Option<Bytes>,
    delivery: Option<Delivery>,
}

impl CallBody {
    fn new(json: Bytes, delivery: Option<Delivery>) -> CallBody {
        CallBody {
            json: Some(json),
            delivery,
        }
    }

    fn empty() -> CallBody {
        CallBody {
            json: None,
            delivery: None,
        }
    }
}

impl hyper::body::Body for CallBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let this = self.get_mut();
        let frame = this.json.take().map(|json| Ok(Frame::data(json)));
        if let Some(delivery) = this.delivery.take() {
            delivery.delivered();
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.json.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.json.as_ref().map_or(0, |json| json.len() as u64))
    }
}

/// `body` as JSON.
fn to_json(body: &impl Serialize) -> Result<Bytes, CallError> {
    serde_json::to_vec(body)
        .map(Bytes::from)
        .map_err(|e| CallError::Build {
            reason: format!("cannot write the request body: {e}"),
        })
}

/// `request` with `json` as its body.
fn json_request(
    request: http::request::Builder,
    json: Bytes,
    delivery: Option<Delivery>,
) -> Result<http::Request<CallBody>, CallError> {
    request
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(CallBody::new(json, delivery))
        .map_err(|e| CallError::Build {
            reason: e.to_string(),
        })
}

/// A whole non-streamed answer, at most `cap` bytes, by `deadline`.
async fn read_capped(
    response: EngineResponse,
    deadline: tokio::time::Instant,
    cap: usize,
) -> Result<Bytes, CallError> {
    let started = tokio::time::Instant::now();
    let read = async {
        let mut body = Vec::new();
        let mut frames = response.into_body();
        while let Some(frame) = frames.frame().await {
            let Ok(chunk) = frame.map_err(broken_answer)?.into_data() else {
                continue; // trailers
            };
            if body.len() + chunk.len() > cap {
                return Err(CallError::Decode {
                    reason: format!("the answer is over {cap} bytes"),
                });
            }
            body.extend_from_slice(&chunk);
        }
        Ok(Bytes::from(body))
    };
    tokio::time::timeout_at(deadline, read)
        .await
        .map_err(|_| CallError::Timeout {
            after: deadline.saturating_duration_since(started),
        })?
}

/// An answer that started and then broke off: the engine is up (it answered), so this is a
/// failed call to retry, not a sign the endpoint is down, and not a malformed answer either.
fn broken_answer(e: hyper::Error) -> CallError {
    CallError::Stream(SseError::Transport(error_chain(&e)))
}

/// Whether a connect failed by timing out (the request never left), not by being refused.
fn connect_timed_out(e: &hyper_util::client::legacy::Error) -> bool {
    let mut cause = std::error::Error::source(e);
    while let Some(e) = cause {
        if e.downcast_ref::<std::io::Error>()
            .is_some_and(|e| e.kind() == std::io::ErrorKind::TimedOut)
        {
            return true;
        }
        cause = e.source();
    }
    false
}

/// End a chunk stream with an error when the engine goes quiet for longer than `idle`. Fused:
/// polling it again after its end keeps answering `None`.
fn with_idle_timeout(chunks: ChunkStream, idle: Duration) -> ChunkStream {
    Box::pin(
        futures::stream::unfold((chunks, false), move |(mut chunks, done)| async move {
            if done {
                return None;
            }
            match tokio::time::timeout(idle, chunks.next()).await {
                Ok(Some(item)) => Some((item, (chunks, false))),
                Ok(None) => None,
                Err(_) => Some((Err(SseError::Idle(idle)), (chunks, true))),
            }
        })
        .fuse(),
    )
}

fn classify(e: hyper_util::client::legacy::Error) -> CallError {
    if e.is_connect() {
        CallError::Connect {
            reason: error_chain(&e),
        }
    } else {
        // Reset or closed before any answer (or one that is no HTTP). Once an answer has
        // started, a break is `broken_answer`'s, not this.
        CallError::Closed {
            reason: error_chain(&e),
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
