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

use std::sync::Arc;
use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
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
    /// The HTTP client itself could not be set up (at startup, before any engine is called).
    #[error("cannot build the HTTP client for engines: {reason}")]
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
    /// `base` parsed once (`None` if it does not parse: each call then fails as the client
    /// reports), so a call's URL is a copy with its path set rather than a string to parse.
    url: Option<reqwest::Url>,
    auth: Option<http::HeaderValue>,
}

impl Upstream {
    /// `base` (`http://host:port`, no trailing slash), called with `auth` when given.
    pub fn new(base: Arc<str>, auth: Option<http::HeaderValue>) -> Upstream {
        let url = reqwest::Url::parse(&base).ok();
        Upstream { base, url, auth }
    }

    pub fn base(&self) -> &str {
        &self.base
    }

    /// The base URL, shared.
    pub fn base_url(&self) -> Arc<str> {
        Arc::clone(&self.base)
    }

    fn post(&self, http: &reqwest::Client, path: &str) -> reqwest::RequestBuilder {
        self.request(http, reqwest::Method::POST, path)
    }

    fn get(&self, http: &reqwest::Client, path: &str) -> reqwest::RequestBuilder {
        self.request(http, reqwest::Method::GET, path)
    }

    /// `method` on `base` + `path`, with the engine's `Authorization` when it wants one.
    fn request(
        &self,
        http: &reqwest::Client,
        method: reqwest::Method,
        path: &str,
    ) -> reqwest::RequestBuilder {
        let request = match &self.url {
            Some(base) => http.request(method, with_path(base, path)),
            None => http.request(method, format!("{}{path}", self.base)),
        };
        match &self.auth {
            Some(auth) => request.header(http::header::AUTHORIZATION, auth.clone()),
            None => request,
        }
    }
}

/// `base` (no trailing slash) followed by `path` (from `/`), as concatenating the two strings
/// would give.
fn with_path(base: &reqwest::Url, path: &str) -> reqwest::Url {
    let mut url = base.clone();
    match base.path() {
        "/" => url.set_path(path),
        prefix => url.set_path(&format!("{prefix}{path}")),
    }
    url
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

/// One HTTP client shared by every call to every engine (connections are pooled per host).
#[derive(Debug, Clone)]
pub struct EngineClient {
    http: reqwest::Client,
    timeouts: Timeouts,
}

impl EngineClient {
    pub fn new(timeouts: Timeouts) -> Result<Self, CallError> {
        let http = reqwest::Client::builder()
            .connect_timeout(timeouts.connect)
            // Below common engine keep-alive timeouts (uvicorn closes idle connections after
            // 5 s), so a request is not sent on a connection the engine is closing.
            .pool_idle_timeout(POOL_IDLE_TIMEOUT)
            .tcp_nodelay(true)
            .build()
            .map_err(|e| CallError::Build {
                reason: e.to_string(),
            })?;
        Ok(EngineClient { http, timeouts })
    }

    pub fn timeouts(&self) -> Timeouts {
        self.timeouts
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
        let sent = engine
            .post(&self.http, "/microserving/start_generate")
            .json(body)
            .timeout(self.timeouts.call)
            .send()
            .await;
        match sent {
            // Dropping the response closes the connection before the generation ends.
            Ok(response) if response.status().is_success() => Release::Freed,
            // A transfer into the reservation is still being written (reference engine).
            Ok(response) if response.status() == reqwest::StatusCode::CONFLICT => {
                Release::Later("a KV transfer into it is still under way".into())
            }
            Ok(response) if response.status().is_client_error() => {
                Release::Gone(format!("the engine answered HTTP {}", response.status()))
            }
            Ok(response) => {
                Release::Later(format!("the engine answered HTTP {}", response.status()))
            }
            // Not even connected: the request never left, so it is safe to send again.
            Err(e) if e.is_connect() && e.is_timeout() => Release::Later(reason(e)),
            // Refused: the engine process is gone, and its reservations with it.
            Err(e) if e.is_connect() => Release::Gone(reason(e)),
            // Sent, but no answer came (a frozen engine): the engine runs it when it can, sees
            // the connection gone and aborts, which frees the pages. Sending it again could
            // reach an MLC engine for an id it no longer holds, which it does not survive.
            Err(e) => Release::Gone(format!("sent, answer lost: {}", reason(e))),
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
    async fn probe(&self, engine: &Upstream, path: &str) -> Option<bytes::Bytes> {
        let response = engine
            .get(&self.http, path)
            .timeout(self.timeouts.probe)
            .send()
            .await
            .ok()?;
        if response.status() != reqwest::StatusCode::OK {
            return None;
        }
        read_capped(response, self.timeouts.probe, MAX_PROBE_BYTES)
            .await
            .ok()
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
        let response = self
            .send(
                engine,
                path,
                body,
                Some(self.timeouts.call),
                Some(request_id),
                None,
            )
            .await?;
        Ok(Answer {
            response,
            within: self.timeouts.call,
        })
    }

    async fn send<B: Serialize>(
        &self,
        engine: &Upstream,
        path: &str,
        body: &B,
        timeout: Option<Duration>,
        request_id: Option<&str>,
        delivery: Option<&Delivery>,
    ) -> Result<reqwest::Response, CallError> {
        let bytes = bytes::Bytes::from(serde_json::to_vec(body).map_err(|e| CallError::Build {
            reason: format!("cannot write the request body: {e}"),
        })?);
        let send = || {
            let body = match delivery {
                Some(delivery) => delivery.body(bytes.clone()),
                None => reqwest::Body::from(bytes.clone()),
            };
            let mut request = engine
                .post(&self.http, path)
                .header(http::header::CONTENT_TYPE, "application/json")
                .body(body);
            if let Some(id) = request_id {
                request = request.header(REQUEST_ID_HEADER, id);
            }
            match timeout {
                Some(t) => request.timeout(t).send(),
                None => request.send(),
            }
        };
        let response = match send().await.map_err(|e| classify(e, self.timeouts.call)) {
            // The engine closed a pooled connection just as the request went out (its
            // keep-alive ran out): once more, on a fresh connection, without blaming it.
            Err(CallError::Closed { reason }) => {
                let engine = engine.base();
                tracing::debug!(engine, path, %reason, "connection closed before an answer; sending again");
                send().await.map_err(|e| classify(e, self.timeouts.call))
            }
            answer => answer,
        }?;
        let status = response.status();
        if status.is_success() {
            return Ok(response);
        }
        // The body only explains the status: a cut or oversized one still yields the status.
        let body = read_capped(response, self.timeouts.call, MAX_ANSWER_BYTES)
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
        let response = self
            .send(engine, path, body, Some(self.timeouts.call), None, None)
            .await?;
        let bytes = read_capped(response, self.timeouts.call, MAX_ANSWER_BYTES).await?;
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
            .get(reqwest::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/event-stream"));
        if !is_sse {
            let bytes = read_capped(response, self.timeouts.call, MAX_ANSWER_BYTES).await?;
            let mut one: CompletionResponse =
                serde_json::from_slice(&bytes).map_err(|e| CallError::Decode {
                    reason: e.to_string(),
                })?;
            one.fold_chat();
            return Ok(single_chunk(one));
        }
        let bytes = response.bytes_stream().map_err(reqwest::Error::without_url);
        Ok(with_idle_timeout(
            parse_chunks(bytes),
            self.timeouts.stream_idle,
        ))
    }
}

/// A 2xx answer whose body is still to be read; see [`EngineClient::answer_leg`].
#[derive(Debug)]
pub struct Answer {
    response: reqwest::Response,
    within: Duration,
}

impl Answer {
    /// The whole body, at most [`MAX_ANSWER_BYTES`], within the call timeout.
    pub async fn read(self) -> Result<bytes::Bytes, CallError> {
        read_capped(self.response, self.within, MAX_ANSWER_BYTES).await
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

    fn body(&self, bytes: bytes::Bytes) -> reqwest::Body {
        let signal = self.0.clone();
        let delivered = futures::stream::poll_fn(move |_| {
            if let Some(tx) = signal.lock().ok().and_then(|mut tx| tx.take()) {
                let _ = tx.send(());
            }
            std::task::Poll::Ready(None::<Result<bytes::Bytes, std::io::Error>>)
        });
        reqwest::Body::wrap_stream(futures::stream::iter([Ok(bytes)]).chain(delivered))
    }
}

/// A whole non-streamed answer, at most `cap` bytes, within `within`.
async fn read_capped(
    mut response: reqwest::Response,
    within: Duration,
    cap: usize,
) -> Result<bytes::Bytes, CallError> {
    let read = async {
        let mut body = Vec::new();
        while let Some(chunk) = response.chunk().await.map_err(broken_answer)? {
            if body.len() + chunk.len() > cap {
                return Err(CallError::Decode {
                    reason: format!("the answer is over {cap} bytes"),
                });
            }
            body.extend_from_slice(&chunk);
        }
        Ok(bytes::Bytes::from(body))
    };
    tokio::time::timeout(within, read)
        .await
        .map_err(|_| CallError::Timeout { after: within })?
}

/// An answer that started and then broke off: the engine is up (it answered), so this is a
/// failed call to retry, not a sign the endpoint is down, and not a malformed answer either
/// (reqwest reports body failures as "decode" errors).
fn broken_answer(e: reqwest::Error) -> CallError {
    CallError::Stream(SseError::Transport(reason(e)))
}

/// A reqwest error's message and causes, without the URL reqwest puts in it.
fn reason(e: reqwest::Error) -> String {
    error_chain(&e.without_url())
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

fn classify(e: reqwest::Error, after: Duration) -> CallError {
    if e.is_timeout() {
        CallError::Timeout { after }
    } else if e.is_connect() {
        CallError::Connect { reason: reason(e) }
    } else if e.is_decode() {
        CallError::Decode { reason: reason(e) }
    } else {
        // Reset or closed before any answer. (Once an answer has started, a break is
        // `broken_answer`'s, not this.)
        CallError::Closed { reason: reason(e) }
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
