//! The OpenAI HTTP surface (hyper 1, no framework): routes → handlers over one shared
//! [`AppState`].
//!
//! | route | handler |
//! |---|---|
//! | `POST /v1/completions` | [`openai`] parse → [`Router::start_with`] → JSON or SSE |
//! | `POST /v1/chat/completions` | the same, with the chat template and chat shapes |
//! | `GET /v1/models`, `GET /health` | 503 until the endpoints are ready, then 200; `/health` 503 again once draining |
//! | `GET /livez` | 200 while the process lives, draining included |
//! | `GET /metrics` | Prometheus text |
//! | `GET /admin/endpoints` | id, url, role, device rank, health, in-flight per endpoint |
//! | `GET /admin/policies` | every loaded policy: version, state, calls, last reload |
//! | `POST /admin/policies/{name}/reload` | reload one policy from its file now |
//!
//! `/admin/*` needs a bearer token when one is configured, and moves to its own listener
//! ([`serve_admin`]) when an admin port is configured. A request may pick its policy with the
//! `x-switchyard-policy` header (unless disabled); an unknown name gets 400.
//!
//! Connections are accepted on the caller's runtime and served on the [`Workers`], one thread
//! each. Generating requests pass [`admission`] once their body is read; every connection is
//! watched by [`connection`]'s deadlines; a [`Drain`] stops it all in order.
//!
//! Every error body is written by [`respond`].

mod admin;
mod admission;
mod connection;
mod drain;
mod guarded;
mod incoming;
mod metrics;
mod openai;
mod respond;
mod sse;
mod tls;
mod tokenize;
mod workers;

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use futures::StreamExt;
use http::{HeaderMap, Method, Request, Response, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::time::Instant;
use tokio_util::either::Either;
use tokio_util::sync::CancellationToken;

pub(crate) use admission::Permit;
pub use admission::{
    Admission, AdmissionConfig, BadDeadline, Claim, DEFAULT_PRIORITY_HEADER, Fairness, FlowControl,
    Refusal,
};
pub use connection::ConnectionLimits;
pub use drain::{Drain, DrainConfig};
pub use incoming::Incoming;
pub use metrics::{AdmissionMetrics, Metrics};
use openai::BodyObject;
pub use openai::Shape;
pub use respond::ApiError;
pub(crate) use sse::CLIENT_CLOSED_REQUEST;
pub use tls::{ListenerTlsError, TlsAcceptor};
pub use workers::{DEFAULT_WORKER_SPIN, MAX_WORKER_SPIN, Workers};
// The request path's pure pieces, for the hot-path benchmarks (host/router/benches/hot_path.rs).
pub use openai::{Defaults, ParsedRequest, Responder, parse_completion};
pub use tokenize::{ChatMessage, DEFAULT_CHAT_TEMPLATE, PromptTokenizer, TokenizerError};

use switchyard_contract::Planner;
use switchyard_policy_host::{POLICY_HEADER, PolicyRegistry, SelectError};
use switchyard_wire::client::ClientBody;

use crate::Event;
use crate::{Flow, RouteRequest, Router, Routing};

/// Every response body the router writes.
pub type Body = UnsyncBoxBody<Bytes, Infallible>;

/// A whole body.
pub fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into()).boxed_unsync()
}

/// What every handler shares.
pub struct AppState {
    pub router: Arc<Router>,
    pub tokenizer: Arc<PromptTokenizer>,
    pub metrics: Metrics,
    /// The served model's name (responses carry the client's when it named one).
    pub model: String,
    /// Who plans each request: the policy it selects, or the mode's built-in planner.
    pub planning: Planning,
    pub admin: AdminAccess,
    /// The request headers policies see (lower-case names).
    pub forward_headers: Vec<String>,
    pub max_body_bytes: usize,
    pub default_max_tokens: u32,
    pub limits: RequestLimits,
    /// Model names served besides those the endpoints list: the other `[[models]]` and the
    /// names mapped to policies.
    pub models: Vec<String>,
    /// The other `[[models]]`' tokenizers and limits, by name (empty: every request is
    /// measured as the default model's).
    pub model_prompts: HashMap<String, ModelPrompts>,
    /// Generating requests served at once, and the queue for more.
    pub admission: Admission,
    /// Deadlines and the cap on client connections, per listener.
    pub connections: ConnectionLimits,
    /// Where the router is in its shutdown.
    pub drain: Drain,
    next_id: AtomicU64,
}

/// How a model's prompts are measured: its tokenizer and chat template, and its limits.
pub struct ModelPrompts {
    pub tokenizer: Arc<PromptTokenizer>,
    pub limits: RequestLimits,
}

/// How long a request may be, in tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestLimits {
    /// Prompt plus completion tokens the model holds.
    pub context_length: u32,
    /// The longest prompt accepted.
    pub max_prompt_tokens: u32,
}

impl Default for RequestLimits {
    fn default() -> Self {
        RequestLimits {
            context_length: crate::config::DEFAULT_CONTEXT_LENGTH,
            max_prompt_tokens: crate::config::DEFAULT_CONTEXT_LENGTH - 1,
        }
    }
}

impl AppState {
    pub fn new(
        router: Arc<Router>,
        tokenizer: Arc<PromptTokenizer>,
        model: String,
        planning: Planning,
        max_body_bytes: usize,
        default_max_tokens: u32,
    ) -> Self {
        let metrics = Metrics::new();
        AppState {
            router,
            tokenizer,
            admission: Admission::new(AdmissionConfig::default(), metrics.admission()),
            metrics,
            model,
            planning,
            admin: AdminAccess::default(),
            forward_headers: crate::config::DEFAULT_FORWARD_HEADERS
                .map(str::to_owned)
                .to_vec(),
            max_body_bytes,
            default_max_tokens,
            limits: RequestLimits::default(),
            models: Vec::new(),
            model_prompts: HashMap::new(),
            connections: ConnectionLimits::default(),
            drain: Drain::default(),
            next_id: AtomicU64::new(1),
        }
    }

    /// How the server edge protects the router: admission control and connection limits.
    pub fn with_edge(mut self, admission: AdmissionConfig, connections: ConnectionLimits) -> Self {
        self.admission = Admission::new(admission, self.metrics.admission());
        self.connections = connections;
        self
    }

    /// Who may use `/admin/*`, and on which listener.
    pub fn with_admin(mut self, admin: AdminAccess) -> Self {
        self.admin = admin;
        self
    }

    /// How long requests may be.
    pub fn with_limits(mut self, limits: RequestLimits) -> Self {
        self.limits = limits;
        self
    }

    /// Model names served besides those the endpoints list.
    pub fn with_models(mut self, models: Vec<String>) -> Self {
        self.models = models;
        self
    }

    /// The tokenizers and limits of models besides the default one.
    pub fn with_model_prompts(mut self, prompts: HashMap<String, ModelPrompts>) -> Self {
        self.model_prompts = prompts;
        self
    }

    /// The tokenizer and limits of the model `object` names: the default model's unless it
    /// names another configured one.
    fn prompts_for(&self, object: &BodyObject) -> (&Arc<PromptTokenizer>, RequestLimits) {
        let other = (!self.model_prompts.is_empty())
            .then(|| object.fields().get("model")?.as_str())
            .flatten()
            .and_then(|model| self.model_prompts.get(model));
        match other {
            Some(prompts) => (&prompts.tokenizer, prompts.limits),
            None => (&self.tokenizer, self.limits),
        }
    }

    /// Whether the router serves `model`: the served name, a name mapped to a policy, or one
    /// an endpoint lists at `/v1/models`.
    pub fn serves(&self, model: &str) -> bool {
        model == self.model
            || self.models.iter().any(|m| m == model)
            || self.router.executor().cluster().serves(model)
    }

    /// Whether a healthy endpoint may take a request for `model`, a served one: one that lists
    /// or pins it. The default model no endpoint lists goes to any endpoint (engines may call
    /// it something else); another configured model no endpoint lists has none.
    fn can_route(&self, model: &str) -> bool {
        match self.router.executor().cluster().healthy_serving(model) {
            Some(healthy) => healthy > 0,
            None => model == self.model,
        }
    }

    /// Which request headers policies see.
    pub fn with_forward_headers(mut self, names: Vec<String>) -> Self {
        self.forward_headers = names;
        self
    }

    /// Enough endpoints are healthy (the policy was loaded before the state existed).
    pub fn is_ready(&self) -> bool {
        self.router.executor().cluster().is_ready()
    }
}

/// Who plans a router's requests.
#[derive(Clone)]
pub enum Planning {
    /// The live policies (`serve`, `epp`): each request is planned by the one it selects.
    Policies(Arc<PolicyRegistry>),
    /// One planner built into the mode (`sidecar`), which plans every request without a policy.
    Builtin(Arc<dyn BuiltinPlanner>),
}

/// A planner built into the router, with metrics of its own on `/metrics`.
pub trait BuiltinPlanner: Planner {
    /// Append this planner's metrics to an OpenMetrics exposition (ending in `# EOF`).
    fn append_metrics(&self, exposition: &mut String);
}

impl Planning {
    /// The policy registry, when policies plan the requests.
    pub fn policies(&self) -> Option<&Arc<PolicyRegistry>> {
        match self {
            Planning::Policies(policies) => Some(policies),
            Planning::Builtin(_) => None,
        }
    }

    /// The planner of one request: the policy `header` (`x-switchyard-policy`) or `model`
    /// selects, or the built-in one. The policy's name goes on the request's trace `span`.
    fn select(
        &self,
        header: Option<&str>,
        model: &str,
        span: &tracing::Span,
    ) -> Result<Arc<dyn Planner>, ApiError> {
        let policies = match self {
            Planning::Policies(policies) => policies,
            Planning::Builtin(planner) => {
                crate::telemetry::record_policy(span, "built-in");
                return Ok(Arc::clone(planner) as Arc<dyn Planner>);
            }
        };
        match policies.select(header, model) {
            Ok(selection) => {
                crate::telemetry::record_policy(span, selection.policy());
                Ok(Arc::new(selection))
            }
            Err(e @ SelectError::Unknown { .. }) => {
                Err(ApiError::invalid(POLICY_HEADER, e.to_string()))
            }
            Err(SelectError::Unavailable { .. }) => {
                Err(ApiError::NotReady("no policy can plan the request"))
            }
        }
    }

    /// Append the planners' metrics to an OpenMetrics exposition.
    pub fn append_metrics(&self, exposition: &mut String) {
        match self {
            Planning::Policies(policies) => policies.append_metrics(exposition),
            Planning::Builtin(planner) => planner.append_metrics(exposition),
        }
    }
}

/// Who may use `/admin/*`, and where it is served.
#[derive(Debug, Clone, Default)]
pub struct AdminAccess {
    /// The bearer token `/admin/*` requires; `None`: none.
    pub token: Option<String>,
    /// `/admin/*` has a listener of its own ([`serve_admin`]); the main port then answers 404.
    pub separate_port: bool,
}

/// The address a request's connection came from, in its extensions.
#[derive(Debug, Clone, Copy)]
pub struct Peer(pub SocketAddr);

/// How long connections may take to write what ends them once the grace period is over (an
/// error event and `[DONE]`) before they are dropped.
const LAST_WRITES: std::time::Duration = std::time::Duration::from_secs(2);

/// Serve HTTP on `listener` until `state.drain` stops accepting, then let open connections
/// finish until its grace period is over. Connections are accepted here and served on
/// `workers`. With `tls`, every connection is HTTPS.
pub async fn serve(
    listener: TcpListener,
    state: Arc<AppState>,
    workers: Arc<Workers>,
    tls: Option<TlsAcceptor>,
) {
    serve_with(listener, state, handle, Some(workers), tls).await;
}

/// Serve only `/admin/*` on `listener` (the admin port), as [`serve`] does, on this runtime:
/// its few requests need no worker of their own.
pub async fn serve_admin(listener: TcpListener, state: Arc<AppState>, tls: Option<TlsAcceptor>) {
    serve_with(listener, state, admin::handle, None, tls).await;
}

/// Serve `/metrics`, `/health` and `/livez` alone on `listener`, as [`serve`] does, on this
/// runtime: the listener of a router with no OpenAI one (`switchyard epp`'s metrics port).
pub async fn serve_metrics(listener: TcpListener, state: Arc<AppState>) {
    serve_with(listener, state, observe, None, None).await;
}

async fn observe(state: Arc<AppState>, req: Request<Incoming>) -> Response<Body> {
    match (req.method(), req.uri().path()) {
        (&Method::GET, "/metrics") => admin::metrics(&state),
        (&Method::GET, "/health") => admin::health(&state),
        (&Method::GET, "/livez") => admin::livez(),
        (method, path) => ApiError::NotFound {
            method: method.to_string(),
            path: path.to_owned(),
        }
        .response(),
    }
}

async fn serve_with<H, F>(
    listener: TcpListener,
    state: Arc<AppState>,
    handler: H,
    workers: Option<Arc<Workers>>,
    tls: Option<TlsAcceptor>,
) where
    H: Fn(Arc<AppState>, Request<Incoming>) -> F + Copy + Send + Sync + 'static,
    F: Future<Output = Response<Body>> + Send + 'static,
{
    let graceful = GracefulShutdown::new();
    let servers = connection::Servers::new();
    // A place per open connection: at the cap the loop stops accepting, and new connections
    // wait in the kernel's backlog.
    let places = Arc::new(Semaphore::new(state.connections.max_connections as usize));
    let mut backoff = connection::AcceptBackoff::default();
    let metrics = state.metrics.connections();
    // Cancelled when the connections still open after the grace period are dropped.
    let cut = CancellationToken::new();
    loop {
        let place = tokio::select! {
            place = Arc::clone(&places).acquire_owned() => place,
            () = state.drain.accepting_stopped() => break,
        };
        // The semaphore is never closed.
        let Ok(place) = place else { break };
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(conn) => conn,
                Err(e) => {
                    metrics.accept_errors.inc();
                    let pause = backoff.failed(&e);
                    tracing::warn!(error = %e, ?pause, "accept failed; serving the open connections");
                    if let Some(pause) = pause {
                        tokio::select! {
                            () = tokio::time::sleep(pause) => {}
                            () = state.drain.accepting_stopped() => break,
                        }
                    }
                    continue;
                }
            },
            () = state.drain.accepting_stopped() => break,
        };
        backoff.accepted();
        let _ = stream.set_nodelay(true);
        let (state, servers, watcher) = (state.clone(), servers.clone(), graceful.watcher());
        let (limits, metrics, cut) = (state.connections, metrics.clone(), cut.clone());
        let tls = tls.clone();
        let serve = move |stream| async move {
            let stream = match tls {
                None => Either::Left(stream),
                Some(tls) => {
                    // Boxed: inline, the handshake's state would be room in every connection's
                    // task, plain ones included, for as long as it is open.
                    let handshake = Box::pin(tls.accept(stream));
                    match tokio::time::timeout(limits.header_read_timeout, handshake).await {
                        Ok(Ok(stream)) => stream,
                        Ok(Err(e)) => {
                            tracing::debug!(%peer, error = %e, "TLS handshake failed");
                            return;
                        }
                        Err(_) => {
                            tracing::debug!(%peer, "TLS handshake not done by the header deadline");
                            return;
                        }
                    }
                }
            };
            metrics.open.inc();
            let activity = connection::Activity::new();
            // Each request is the peer's, and the connection is busy until its response ends.
            let serve_request = {
                let activity = Arc::clone(&activity);
                let state = state.clone();
                move |mut req: Request<Incoming>| {
                    req.extensions_mut().insert(Peer(peer));
                    let in_request = activity.request_started();
                    // Boxed: the server keeps room for the handler's future as long as the
                    // connection is open, and a handler's is the request's whole parse and
                    // plan (~3 KiB); boxed, that room is freed once the response has started.
                    let handled = Box::pin(handler(state.clone(), req));
                    async move { guarded::hold(handled.await, in_request) }
                }
            };
            let served = async {
                let server = tokio::select! {
                    server = servers.for_connection(&stream) => server,
                    // As a connection still reading its first bytes is closed at a graceful
                    // shutdown.
                    () = state.drain.accepting_stopped() => return Ok(()),
                };
                let io = connection::Watched::new(stream, Arc::clone(&activity));
                match server {
                    connection::Server::Http1 => connection::http1::serve(
                        io,
                        |req: Request<connection::http1::Body>| {
                            serve_request(req.map(Incoming::Http1))
                        },
                        state.drain.accepting_stopped(),
                    )
                    .await
                    .map_err(Into::into),
                    // Boxed: its room for an HTTP/2 connection would be in every connection's
                    // task.
                    connection::Server::Auto(auto) => {
                        let service =
                            hyper::service::service_fn(|req: Request<hyper::body::Incoming>| {
                                let handled = serve_request(req.map(Incoming::Hyper));
                                async move { Ok::<_, Infallible>(handled.await) }
                            });
                        Box::pin(
                            watcher.watch(
                                auto.serve_connection(TokioIo::new(io), service)
                                    .into_owned(),
                            ),
                        )
                        .await
                    }
                }
            };
            tokio::select! {
                result = served => if let Err(e) = result {
                    tracing::debug!(%peer, error = %e, "connection ended with an error");
                },
                expired = activity.expired(&limits) => {
                    metrics.closed.get_or_create(&vec![("reason", expired.reason().to_owned())]).inc();
                    tracing::debug!(%peer, reason = expired.reason(), "closing the connection");
                }
                () = cut.cancelled() => {}
            }
            metrics.open.dec();
            drop(place);
        };
        match &workers {
            Some(workers) => {
                if let Err(e) = workers.serve(stream, serve) {
                    tracing::warn!(%peer, error = %e, "cannot hand a connection to a worker");
                }
            }
            None => drop(tokio::spawn(serve(stream))),
        }
    }
    drop(listener);
    tracing::info!("listener closed: waiting for open connections to finish");
    // hyper-util's connections end at its graceful shutdown, the router's own HTTP/1 ones at
    // the drain; each holds its place until it has ended.
    let finished = async {
        graceful.shutdown().await;
        let every_place = state.connections.max_connections;
        let _ = places.acquire_many(every_place).await;
    };
    tokio::pin!(finished);
    tokio::select! {
        () = &mut finished => return,
        () = state.drain.grace_over() => {}
    }
    // Open responses were just told to end (an error event, or a 503): let them write it.
    if tokio::time::timeout(LAST_WRITES, finished).await.is_err() {
        tracing::warn!("connections still open after the grace period; dropping them");
    }
    cut.cancel();
}

/// Route one request. Every response carries `x-request-id`: the client's, when it sent a
/// usable one, else one made up here, so a client and the router's log can name the request.
pub async fn handle(state: Arc<AppState>, req: Request<Incoming>) -> Response<Body> {
    let request_id = request_id(req.headers());
    let mut response = route(state, req).await;
    response.headers_mut().insert(REQUEST_ID, request_id);
    response
}

const REQUEST_ID: http::HeaderName = http::HeaderName::from_static("x-request-id");

/// The client's `x-request-id` when it is short printable text, else a fresh one.
fn request_id(headers: &HeaderMap) -> http::HeaderValue {
    headers
        .get(&REQUEST_ID)
        .filter(|v| {
            !v.is_empty() && v.len() <= 128 && v.as_bytes().iter().all(u8::is_ascii_graphic)
        })
        .cloned()
        .unwrap_or_else(|| {
            http::HeaderValue::try_from(random_id("")).expect("hex digits make a header value")
        })
}

/// `prefix` and 32 random hex digits: an id made for every request, so written without the
/// formatting machinery, which showed in the forward path's profile.
fn random_id(prefix: &str) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut bits = rand::random::<u128>();
    let mut id = String::with_capacity(prefix.len() + 32);
    id.push_str(prefix);
    for _ in 0..32 {
        id.push(char::from(HEX[(bits >> 124) as usize]));
        bits <<= 4;
    }
    id
}

async fn route(state: Arc<AppState>, req: Request<Incoming>) -> Response<Body> {
    if req.uri().path().starts_with("/admin/") && !state.admin.separate_port {
        return admin::handle(state, req).await;
    }
    let (parts, body) = req.into_parts();
    match (&parts.method, parts.uri.path()) {
        (&Method::POST, "/v1/completions") => {
            generate(state, Shape::Completion, &parts.headers, body).await
        }
        (&Method::POST, "/v1/chat/completions") => {
            generate(state, Shape::Chat, &parts.headers, body).await
        }
        (&Method::GET, "/v1/models") => admin::models(&state),
        (&Method::GET, "/health") => admin::health(&state),
        (&Method::GET, "/livez") => admin::livez(),
        (&Method::GET, "/metrics") => admin::metrics(&state),
        (method, path) => ApiError::NotFound {
            method: method.to_string(),
            path: path.to_owned(),
        }
        .response(),
    }
}

/// Bytes of an oversized body read and thrown away before answering 413: a client still
/// sending when the connection closes sees a reset, not the answer. Larger bodies are cut off.
const DRAIN_OVERSIZE_BYTES: u64 = 1 << 20;

/// Read at most `limit` bytes of body, within `deadline`.
async fn read_body(
    body: Incoming,
    headers: &HeaderMap,
    limit: usize,
    deadline: std::time::Duration,
) -> Result<Bytes, ApiError> {
    let declared = headers
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        let _ =
            tokio::time::timeout(deadline, drain(body, limit as u64 + DRAIN_OVERSIZE_BYTES)).await;
        return Err(ApiError::BodyTooLarge { limit });
    }
    let read = async {
        let mut body = body;
        let mut collected = Vec::new();
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| ApiError::BodyRead(e.to_string()))?;
            if let Some(data) = frame.data_ref() {
                if collected.len() + data.len() > limit {
                    drain(body, DRAIN_OVERSIZE_BYTES).await;
                    return Err(ApiError::BodyTooLarge { limit });
                }
                collected.extend_from_slice(data);
            }
        }
        Ok(Bytes::from(collected))
    };
    tokio::time::timeout(deadline, read)
        .await
        .unwrap_or(Err(ApiError::BodyTimeout(deadline)))
}

/// Read and discard up to `max` more bytes of `body`.
async fn drain(mut body: Incoming, max: u64) {
    let mut read = 0u64;
    while read <= max {
        match body.frame().await {
            Some(Ok(frame)) => read += frame.data_ref().map_or(0, |d| d.len() as u64),
            _ => return,
        }
    }
}

/// `/v1/completions` and `/v1/chat/completions`.
async fn generate(
    state: Arc<AppState>,
    shape: Shape,
    headers: &HeaderMap,
    body: Incoming,
) -> Response<Body> {
    let arrived = Instant::now();
    let deadline = state.connections.body_read_timeout;
    let bytes = match read_body(body, headers, state.max_body_bytes, deadline).await {
        Ok(bytes) => bytes,
        Err(e) => return reject(&state, shape, &e),
    };
    let body = RequestBody::read(shape, bytes);
    // Admitted once the body is in and read, before any other work on it: a slow client holds
    // a connection, never a place; the place is held until the response ends.
    let (permit, flow) = match admit(&state, headers, &body, arrived).await {
        Ok(admitted) => admitted,
        Err(error) => return reject(&state, shape, &error),
    };
    guarded::hold(
        admitted(state, shape, headers, body, arrived, flow).await,
        permit,
    )
}

/// A generating request's body: its bytes and its JSON object, read once ([`BodyObject`]).
/// Admission reads the object's small fields (priority, tenant, cost, model); the parse reads
/// the rest once the request has a place. A body that is no JSON object claims nothing and is
/// answered 400 by the parse, once admitted, as before the object was read ahead.
pub(crate) struct RequestBody {
    bytes: Bytes,
    object: Result<BodyObject, ApiError>,
}

impl RequestBody {
    pub(crate) fn read(shape: Shape, bytes: Bytes) -> RequestBody {
        let object = BodyObject::read(&bytes, shape);
        RequestBody { bytes, object }
    }
}

/// A place among the requests served at once, granted in flow-control order (priority band,
/// tenant's share, deadline), or the 429 that says when to try again (504: the deadline
/// passed while queued); with the request's flow, which its policy sees.
pub(crate) async fn admit(
    state: &AppState,
    headers: &HeaderMap,
    body: &RequestBody,
    arrived: Instant,
) -> Result<(admission::Permit, Flow), ApiError> {
    let mut claim = claim(state, headers, body, arrived)?;
    if !state.is_ready() {
        let held = hold_until_ready(state, &claim.model).await?;
        claim.deadline = claim.deadline.map(|left| left.saturating_sub(held));
    }
    let flow = Flow {
        priority: claim.priority,
        tenant: (!claim.tenant.is_empty()).then(|| Arc::clone(&claim.tenant)),
        deadline: claim.deadline.map(|left| Instant::now() + left),
    };
    let permit = state
        .admission
        .admit(claim)
        .await
        .map_err(|refusal| ApiError::Overloaded {
            refusal,
            retry_after: state.admission.retry_after(),
        })?;
    Ok((permit, flow))
}

/// Scale from zero: while no endpoint is ready, a request is held until one is, up to
/// `scale_from_zero_timeout_ms`, and then admitted as any other; how long it was held. 503 when
/// the timeout passes first; without one, nothing is held (`prepare` answers 503).
async fn hold_until_ready(state: &AppState, model: &str) -> Result<Duration, ApiError> {
    let Some(timeout) = state.admission.config().flow.scale_from_zero else {
        return Ok(Duration::ZERO);
    };
    let cluster = state.router.executor().cluster();
    state
        .admission
        .hold(model.to_owned(), timeout, cluster.until_ready())
        .await
        .ok_or(ApiError::NotReady(
            "no endpoint became ready within scale_from_zero_timeout_ms",
        ))
}

/// What admission reads of the request; its queue metrics are labelled with its model when
/// the router serves it, else with the served model's name (so clients cannot mint series).
fn claim(
    state: &AppState,
    headers: &HeaderMap,
    body: &RequestBody,
    arrived: Instant,
) -> Result<Claim, ApiError> {
    let flow = &state.admission.config().flow;
    let mut claim = Claim::read(
        flow,
        headers,
        body.object.as_ref().ok().map(BodyObject::fields),
        body.bytes.len(),
        state.default_max_tokens,
        arrived.elapsed(),
    )
    .map_err(|e| ApiError::invalid("x-request-deadline-ms", e.to_string()))?;
    if !state.serves(&claim.model) {
        claim.model.clone_from(&state.model);
    }
    Ok(claim)
}

/// An admitted request: parse, plan, run, answer.
async fn admitted(
    state: Arc<AppState>,
    shape: Shape,
    headers: &HeaderMap,
    body: RequestBody,
    arrived: Instant,
    flow: Flow,
) -> Response<Body> {
    let Prepared { route, planner } =
        match prepare(&state, shape, headers, body, arrived, flow).await {
            Ok(prepared) => prepared,
            Err(e) => return reject(&state, shape, &e),
        };
    let responder = Responder {
        shape,
        id: route.request_id.clone(),
        created: unix_now(),
        model: route.model.clone(),
        include_usage: route.include_usage,
    };
    let stream = route.stream;
    let mut routing = state.router.start_with(route, planner);
    // Nothing is committed until the first event: a request that fails before any text gets
    // a real error status instead of a 200 stream. The wait may be long (a non-streamed vLLM
    // or SGLang answer is its first event): a client gone meanwhile is counted as 499 here.
    let mut abandoned = CountIfAbandoned {
        state: &state,
        route: shape.route(),
        armed: true,
    };
    let first = routing.next().await;
    abandoned.armed = false;
    drop(abandoned);
    let Some(first) = first else {
        return reject(
            &state,
            shape,
            &ApiError::NotReady("the request was abandoned by the router"),
        );
    };
    if let Event::Failed(failed) = first {
        let crate::Failed { error, summary } = *failed;
        state.metrics.finished(&summary, arrived.elapsed());
        return reject(&state, shape, &ApiError::Route(error));
    }
    if stream {
        return sse::stream_response(state, responder, first, routing, arrived);
    }
    collect(state, responder, first, routing, arrived).await
}

/// A generating request ready to be planned: parsed (its prompt tokenized if a reader needs
/// it), its model served, its policy selected. The router runs it (`admitted`); `switchyard epp` plans it and answers the
/// gateway with the plan's endpoints instead.
pub(crate) struct Prepared {
    pub route: RouteRequest,
    /// The policy the request selected; it plans every attempt.
    pub planner: Arc<dyn Planner>,
}

/// Everything between an admitted body and the router: parse, check the model and readiness,
/// select the policy (`x-switchyard-policy` or the model's), keep the headers policies see.
pub(crate) async fn prepare(
    state: &Arc<AppState>,
    shape: Shape,
    headers: &HeaderMap,
    body: RequestBody,
    arrived: Instant,
    flow: Flow,
) -> Result<Prepared, ApiError> {
    let raw = body.bytes.clone();
    let parsed = parse(state, shape, body).await?;
    if !state.serves(&parsed.model) {
        return Err(ApiError::ModelNotFound(parsed.model));
    }
    if !state.is_ready() {
        return Err(ApiError::NotReady("too few endpoints are healthy"));
    }
    if !state.can_route(&parsed.model) {
        return Err(ApiError::ModelUnavailable(parsed.model));
    }
    let span = crate::telemetry::request_span(headers, shape.operation(), &parsed.model);
    let planner = state
        .planning
        .select(policy_header(headers).as_deref(), &parsed.model, &span)?;
    // Tokenized here when the policy or the KV index reads it, so that a prompt that cannot
    // be tokenized is the client's 400 (`invalid_prompt`), not a routing failure; the
    // router's attempts then find the ids made.
    if state.router.reads_prompt_up_front(planner.as_ref()) {
        parsed
            .prompt
            .ids()
            .await
            .map_err(|e| ApiError::Tokenize(e.to_string()))?;
    }
    if let Some(tokens) = parsed.prompt.known_len() {
        crate::telemetry::record_input_tokens(&span, tokens);
    }
    let tokenizer = state
        .model_prompts
        .get(&parsed.model)
        .map(|prompts| prompts.tokenizer.tokenizer());
    let route = RouteRequest {
        id: state.next_id.fetch_add(1, Ordering::Relaxed),
        request_id: random_id(shape.id_prefix()),
        prompt: parsed.prompt,
        max_tokens: parsed.max_tokens,
        stream: parsed.stream,
        include_usage: parsed.include_usage,
        model: parsed.model,
        user: parsed.user,
        headers: forwarded_headers(headers, &state.forward_headers),
        template: parsed.template,
        client: Some(Arc::new(ClientBody::new(shape.wire_route(), raw))),
        arrived,
        flow,
        span,
        tokenizer,
    };
    Ok(Prepared { route, planner })
}

/// Bodies above this have their prompt or messages parsed (and tokenized, when the limits need
/// it) on the blocking pool, as a prompt tokenized later is
/// ([`crate::router::RoutePrompt::ids`]). The object around them was read on the worker, before
/// admission ([`RequestBody`]).
const PARSE_INLINE_BYTES: usize = crate::router::TOKENIZE_INLINE_BYTES;

async fn parse(
    state: &Arc<AppState>,
    shape: Shape,
    body: RequestBody,
) -> Result<ParsedRequest, ApiError> {
    let RequestBody { bytes, object } = body;
    let object = object?;
    if bytes.len() <= PARSE_INLINE_BYTES {
        return parse_now(state, shape, &bytes, &object);
    }
    let state = Arc::clone(state);
    tokio::task::spawn_blocking(move || parse_now(&state, shape, &bytes, &object))
        .await
        .unwrap_or_else(|e| Err(ApiError::Tokenize(format!("the parse was cancelled: {e}"))))
}

fn parse_now(
    state: &AppState,
    shape: Shape,
    body: &[u8],
    object: &BodyObject,
) -> Result<ParsedRequest, ApiError> {
    let (tokenizer, limits) = state.prompts_for(object);
    let defaults = Defaults {
        model: &state.model,
        max_tokens: state.default_max_tokens,
        context_length: limits.context_length,
        max_prompt_tokens: limits.max_prompt_tokens,
    };
    openai::parse_read(shape, body, object, tokenizer, defaults)
}

/// A non-streaming response: concatenate the text, answer with the real usage.
async fn collect(
    state: Arc<AppState>,
    responder: Responder,
    first: Event,
    mut routing: Routing,
    arrived: Instant,
) -> Response<Body> {
    let mut abandoned = CountIfAbandoned {
        state: &state,
        route: responder.shape.route(),
        armed: true,
    };
    let response = tokio::select! {
        response = collect_events(&state, &responder, first, &mut routing, arrived) => response,
        () = state.drain.grace_over() => reject(&state, responder.shape, &ApiError::ShuttingDown),
    };
    abandoned.armed = false;
    response
}

/// Counts a request whose client hung up before its answer began (or, not streaming, before it
/// was whole) as 499, as an abandoned stream is: hyper then drops the handler's future, and
/// this guard with it.
struct CountIfAbandoned<'a> {
    state: &'a AppState,
    route: &'static str,
    armed: bool,
}

impl Drop for CountIfAbandoned<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.state
                .metrics
                .request(self.route, sse::CLIENT_CLOSED_REQUEST);
        }
    }
}

async fn collect_events(
    state: &AppState,
    responder: &Responder,
    first: Event,
    routing: &mut Routing,
    arrived: Instant,
) -> Response<Body> {
    let mut text = String::new();
    let mut next = Some(first);
    loop {
        let event = match next.take() {
            Some(e) => Some(e),
            None => routing.next().await,
        };
        match event {
            Some(Event::Text(t)) => text.push_str(&t),
            Some(Event::Done(done)) => {
                let crate::Done {
                    finish_reason,
                    usage,
                    summary,
                } = *done;
                state.metrics.finished(&summary, arrived.elapsed());
                state.metrics.request(responder.shape.route(), 200);
                // A whole answer's usage is always read (`RouteRequest::reads_usage`).
                debug_assert!(usage.is_some(), "a whole answer without its usage");
                let usage = usage.unwrap_or_default();
                let body = responder.full_response(text, finish_reason.as_str(), &usage);
                return respond::json_response(StatusCode::OK, &body);
            }
            Some(Event::Failed(failed)) => {
                let crate::Failed { error, summary } = *failed;
                state.metrics.finished(&summary, arrived.elapsed());
                return reject(state, responder.shape, &ApiError::Route(error));
            }
            None => {
                return reject(
                    state,
                    responder.shape,
                    &ApiError::NotReady("the request was abandoned by the router"),
                );
            }
        }
    }
}

fn reject(state: &AppState, shape: Shape, error: &ApiError) -> Response<Body> {
    state
        .metrics
        .request(shape.route(), error.status().as_u16());
    error.response()
}

/// The policy the request names, if any (a value that is not UTF-8 names no policy that exists).
fn policy_header(headers: &HeaderMap) -> Option<String> {
    headers
        .get(POLICY_HEADER)
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
}

/// The headers a policy may route on: those the operator allowed (`--forward-header`), with
/// text values. A client's other headers (cookies, tokens) never reach a policy.
fn forwarded_headers(headers: &HeaderMap, allowed: &[String]) -> Vec<(String, String)> {
    allowed
        .iter()
        .flat_map(|name| {
            headers
                .get_all(name.as_str())
                .iter()
                .filter_map(move |value| value.to_str().ok().map(|v| (name.clone(), v.to_owned())))
        })
        .collect()
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Bind `addr` (port 0 picks a free one).
pub async fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_usable_client_request_id_is_kept_and_anything_else_replaced() {
        let with = |value: &[u8]| {
            let mut headers = HeaderMap::new();
            headers.insert(
                REQUEST_ID,
                http::HeaderValue::from_bytes(value).expect("a header value"),
            );
            request_id(&headers)
        };
        assert_eq!(with(b"trace-42"), "trace-42");
        for bad in [&b""[..], b"has space", &[b'a'; 129]] {
            let replaced = with(bad);
            assert_ne!(replaced.as_bytes(), bad);
            assert_eq!(replaced.len(), 32, "a fresh id: {replaced:?}");
        }
        assert_eq!(request_id(&HeaderMap::new()).len(), 32);
    }
}
