//! The engine's HTTP surface: MLC's `/microserving/*` calls, `/v1/completions`, `/v1/models`,
//! `/health` and `/metrics`, on hyper; in vLLM and SGLang modes the OpenAI routes of [`openai`]
//! with the handoffs of [`vllm`] and [`sglang`] instead of the microserving calls.
//!
//! Cancellation: hyper's HTTP/1 server reads the socket while a handler is busy and, when the
//! client closes it (an unexpected EOF on a busy connection), ends the connection and *drops*
//! the handler's future, or the response body it was streaming. Every wait in a handler is
//! therefore cancellable for free, and what a leg holds (a reservation, a lease, a room) is
//! owned by a guard whose `Drop` gives it back; `pd_tests` proves it over real sockets.
//!
//! Handlers validate everything a client controls (an MLC engine would crash on some of it; this
//! one answers 400 with an OpenAI error body), then hand the work to the step loop as a
//! [`Command`] and relay its events as one JSON body or SSE chunks.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Sender;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use futures::StreamExt as _;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, Limited, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde::Serialize;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinSet;

use serde::de::DeserializeOwned;
use switchyard_kv::{KvAddrInfo, KvError, KvTransport};
use switchyard_wire::completion::{CompletionRequest, Prompt};
use switchyard_wire::error::{ErrorBody, INVALID_REQUEST_ERROR, SERVER_ERROR};
use switchyard_wire::microserving::{
    PrepRecvRequest, PrepRecvResponse, RemoteSendRequest, StartGenerateRequest,
};
use switchyard_wire::sse;

use super::latency::{Latency, TimingModel as _};
use super::metrics::Metrics;
use super::model::Sampling;
use super::response::{ResponseMeta, Tokens};
use super::scheduler::{CoreError, Event, FinishReason, GenRequest};
use super::step_loop::{Command, SendLease};

/// Bodies above this are refused: a 2000-token prompt with every field is a few KiB, and a
/// 128k-token one as JSON ids well under 2 MiB.
const MAX_BODY_BYTES: usize = 16 << 20;

/// OpenAI's default `max_tokens` for completions.
const DEFAULT_MAX_TOKENS: usize = 16;

type Body = UnsyncBoxBody<Bytes, BodyError>;

/// Why a response body stopped early; hyper then aborts the connection, so the client sees a
/// cut stream (no `[DONE]`), never a short one that looks complete.
#[derive(Debug, thiserror::Error)]
#[error("the engine step loop stopped mid-generation")]
pub(super) struct BodyError;

mod openai;
mod sglang;
mod vllm;

pub(super) use openai::Pd;

/// What every handler of the engine's HTTP surface shares.
pub(super) struct EngineState {
    /// Which routes the engine serves (`--protocol`).
    pub protocol: crate::Protocol,
    /// The vLLM or SGLang handoff state (none in MLC mode).
    pub pd: Pd,
    /// Chat rendering and text tokenization for the OpenAI routes.
    pub prompts: switchyard_wire::tokenizer::PromptTokenizer,
    /// Engine-to-engine calls: the vLLM pull, the SGLang registration.
    pub client: reqwest::Client,
    /// `--kv-transfer-timeout-ms`: bounds a pull (which is one push).
    pub kv_transfer_timeout: Duration,
    /// This engine's rank in the KV-transfer world: where a prefill engine pushes to us.
    pub device_rank: u32,
    pub commands: Sender<Command>,
    /// False once the step loop's thread has ended (it panicked): nothing will be served again.
    pub alive: Arc<AtomicBool>,
    pub tokenizer: Arc<tokenizers::Tokenizer>,
    /// Whether a request's `return_token_ids` is honoured (not with `--ignore-return-token-ids`).
    pub answers_token_ids: bool,
    /// Token ids a prompt may hold: `0..vocab_size`.
    pub vocab_size: u32,
    /// Shared with remote_send's transfer tasks, which may outlive their request.
    pub transport: Arc<KvTransport>,
    pub metrics: Metrics,
    pub latency: Latency,
    pub model_name: String,
    /// The real model's context length (none for the synthetic model, which has no limit).
    pub max_model_len: Option<usize>,
    pub num_pages: u32,
    pub page_size: usize,
    /// `--fail-rate`: the share of calls answered 500 on purpose.
    pub fail_rate: f64,
}

/// Accepts connections until the task is aborted. Each connection is served on a task of this
/// one's [`JoinSet`], so aborting it ends every connection too: none keeps the state (the step
/// loop's command sender, the KV transport) alive after the engine is dropped.
pub(super) async fn serve<F, Fut>(listener: TcpListener, route: F)
where
    F: Fn(Request<Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Result<Response<Body>, Infallible>> + Send + 'static,
{
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    connections.spawn(serve_connection(stream, peer, route.clone()));
                }
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    // Typically EMFILE: back off instead of spinning.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            Some(_) = connections.join_next() => {}
        }
    }
}

async fn serve_connection<F, Fut>(stream: tokio::net::TcpStream, peer: SocketAddr, route: F)
where
    F: Fn(Request<Incoming>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Response<Body>, Infallible>> + Send + 'static,
{
    // SSE chunks are small writes: with Nagle on, each one after the first waits for the
    // client's delayed ACK (~40 ms on Linux) before it leaves.
    if let Err(e) = stream.set_nodelay(true) {
        tracing::debug!(%peer, error = %e, "cannot set TCP_NODELAY");
    }
    let service = hyper::service::service_fn(route);
    let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    if let Err(e) = builder
        .serve_connection(TokioIo::new(stream), service)
        .await
    {
        tracing::debug!(%peer, error = %e, "connection ended with an error");
    }
}

pub(super) async fn route(
    req: Request<Incoming>,
    state: Arc<EngineState>,
) -> Result<Response<Body>, Infallible> {
    let path = req.uri().path().to_owned();
    let alive = state.alive.load(Ordering::Acquire);
    if req.method() == Method::POST {
        state.metrics.calls_received.inc();
        if state.fail_rate > 0.0 && rand::random_bool(state.fail_rate) {
            state.metrics.injected_failures.inc();
            return Ok(HttpError::Injected.into_response());
        }
    }
    if state.protocol != crate::Protocol::Mlc {
        let response = openai::route(req, state, alive).await;
        return Ok(response.unwrap_or_else(|e| e.into_response()));
    }
    let response = match (req.method(), path.as_str()) {
        // Readiness and health follow the step loop: an engine whose loop died must not look
        // ready to a router.
        (&Method::GET, "/v1/models" | "/health") if !alive => Err(HttpError::CoreGone),
        (&Method::GET, "/v1/models") => Ok(models(&state)),
        (&Method::GET, "/health") => Ok(json(StatusCode::OK, &serde_json::json!({"status": "ok"}))),
        (&Method::GET, "/metrics") => Ok(metrics(&state)),
        (&Method::POST, "/v1/completions") => completions(req, &state).await,
        (&Method::POST, "/microserving/prep_recv") => prep_recv(req, &state).await,
        (&Method::POST, "/microserving/remote_send") => remote_send(req, &state).await,
        (&Method::POST, "/microserving/start_generate") => start_generate(req, &state).await,
        (_, "/v1/models" | "/health" | "/metrics") => Err(HttpError::MethodNotAllowed),
        (_, p) if p.starts_with("/microserving/") || p == "/v1/completions" => {
            Err(HttpError::MethodNotAllowed)
        }
        _ => Err(HttpError::NotFound { path }),
    };
    Ok(response.unwrap_or_else(|e| e.into_response()))
}

/// The vLLM side channel or the SGLang bootstrap server: only engines call it.
pub(super) async fn aux_route(
    req: Request<Incoming>,
    state: Arc<EngineState>,
) -> Result<Response<Body>, Infallible> {
    let response = match &state.pd {
        Pd::Vllm(v) => vllm::side_channel(req, v.clone(), state.clone()).await,
        Pd::Sglang(s) => sglang::bootstrap_route(req, s.clone(), state.clone()).await,
        Pd::None => Err(HttpError::NotFound {
            path: req.uri().path().to_owned(),
        }),
    };
    Ok(response.unwrap_or_else(|e| e.into_response()))
}

// === errors ===

/// Why a request failed; [`HttpError::into_response`] is the only place these become HTTP.
#[derive(Debug, thiserror::Error)]
enum HttpError {
    #[error("{message}")]
    Invalid {
        message: String,
        param: Option<&'static str>,
    },
    #[error(transparent)]
    Core(#[from] CoreError),
    #[error("KV transfer to device rank {rank} failed: {source}")]
    Transfer { rank: u32, source: KvError },
    #[error("the engine is shutting down")]
    CoreGone,
    #[error("injected failure (--fail-rate)")]
    Injected,
    #[error("no route for {path}")]
    NotFound { path: String },
    #[error("method not allowed")]
    MethodNotAllowed,
    /// Any other answer with its own status (the vLLM and SGLang handoffs' failures).
    #[error("{message}")]
    Status {
        status: StatusCode,
        message: String,
        param: Option<&'static str>,
    },
}

impl HttpError {
    fn status(status: StatusCode, message: impl Into<String>) -> HttpError {
        HttpError::Status {
            status,
            message: message.into(),
            param: None,
        }
    }

    fn parts(&self) -> (StatusCode, &'static str, Option<&'static str>) {
        const CLIENT: &str = INVALID_REQUEST_ERROR;
        const SERVER: &str = SERVER_ERROR;
        match self {
            HttpError::Invalid { param, .. } => (StatusCode::BAD_REQUEST, CLIENT, *param),
            HttpError::Core(e) => core_fault(e),
            HttpError::Transfer { source, .. } => transfer_fault(source),
            HttpError::CoreGone => (StatusCode::SERVICE_UNAVAILABLE, SERVER, None),
            HttpError::Injected => (StatusCode::INTERNAL_SERVER_ERROR, SERVER, None),
            HttpError::NotFound { .. } => (StatusCode::NOT_FOUND, CLIENT, None),
            HttpError::MethodNotAllowed => (StatusCode::METHOD_NOT_ALLOWED, CLIENT, None),
            HttpError::Status { status, param, .. } => {
                let kind = if status.is_client_error() {
                    CLIENT
                } else {
                    SERVER
                };
                (*status, kind, *param)
            }
        }
    }
}

fn invalid(param: &'static str, message: impl Into<String>) -> HttpError {
    HttpError::Invalid {
        message: message.into(),
        param: Some(param),
    }
}

impl HttpError {
    fn into_response(self) -> Response<Body> {
        let (status, kind, param) = self.parts();
        // Debug, not warn: under a failing peer every request would log; the caller gets the
        // whole message in the body.
        if status.is_server_error() {
            tracing::debug!(error = %self, "request failed");
        }
        json(status, &ErrorBody::new(self.to_string(), kind, param, None))
    }
}

/// Status, type and param of a refused core command. The spec sets no codes (an MLC engine
/// crashes on these); a request id already in use, or a reservation still being written, is a
/// conflict with the engine's state rather than a malformed request.
fn core_fault(e: &CoreError) -> (StatusCode, &'static str, Option<&'static str>) {
    match e {
        CoreError::DuplicateUser { .. } | CoreError::TransferInProgress { .. } => {
            (StatusCode::CONFLICT, INVALID_REQUEST_ERROR, Some("user"))
        }
        CoreError::NoReservation { .. } => {
            (StatusCode::BAD_REQUEST, INVALID_REQUEST_ERROR, Some("user"))
        }
        CoreError::BeginPastWindow { .. } | CoreError::BeginBeforeMatched { .. } => (
            StatusCode::BAD_REQUEST,
            INVALID_REQUEST_ERROR,
            Some("begin"),
        ),
    }
}

/// Status, type and param of a failed KV push. Only what the destination says about
/// `kv_addr_info` is the caller's fault; an unknown `recv_rank` is this engine's `--kv-peer`
/// configuration, and a bad source slot is a bug here.
fn transfer_fault(e: &KvError) -> (StatusCode, &'static str, Option<&'static str>) {
    match e {
        KvError::SlotOutOfRange {
            side: "destination",
            ..
        }
        | KvError::LengthMismatch { .. }
        | KvError::ModelCount { .. }
        | KvError::Metadata { .. }
        | KvError::Rejected { .. } => (
            StatusCode::BAD_REQUEST,
            INVALID_REQUEST_ERROR,
            Some("kv_addr_info"),
        ),
        KvError::UnknownRank { .. } => (
            StatusCode::INTERNAL_SERVER_ERROR,
            SERVER_ERROR,
            Some("recv_rank"),
        ),
        _ => (StatusCode::INTERNAL_SERVER_ERROR, SERVER_ERROR, None),
    }
}

// === plain endpoints ===

fn models(state: &EngineState) -> Response<Body> {
    let mut model = serde_json::json!({
        "id": state.model_name, "object": "model", "created": 0, "owned_by": "switchyard"
    });
    if let Some(len) = state.max_model_len {
        // vLLM's name for the context length.
        model["max_model_len"] = len.into();
    }
    json(
        StatusCode::OK,
        &serde_json::json!({"object": "list", "data": [model]}),
    )
}

fn metrics(state: &EngineState) -> Response<Body> {
    let body = state.metrics.render();
    Response::builder()
        .status(StatusCode::OK)
        .header(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )
        .body(full(body))
        .unwrap_or_else(|_| Response::new(full("")))
}

// === completions and the microserving calls ===

async fn completions(
    req: Request<Incoming>,
    state: &EngineState,
) -> Result<Response<Body>, HttpError> {
    let body: CompletionRequest = read_request(req).await?;
    let request = generation_request(state, &body)?;
    check_fits(state, request.tokens.len() + 1, "prompt")?;
    let (events, rx) = mpsc::unbounded_channel();
    send(state, Command::Generate { request, events })?;
    let meta = response_meta(
        state,
        &body,
        format!("cmpl-{:032x}", rand::random::<u128>()),
    );
    Ok(respond(&body, meta, rx).await)
}

async fn prep_recv(
    req: Request<Incoming>,
    state: &EngineState,
) -> Result<Response<Body>, HttpError> {
    let PrepRecvRequest { common: body, end } = read_request(req).await?;
    let request = generation_request(state, &body)?;
    let user = required_user(&body)?;
    let len = request.tokens.len();
    let end = resolve_end(end, len)?;
    check_fits(state, len + 1, "prompt")?;
    let (reply, answer) = oneshot::channel();
    send(
        state,
        Command::PrepRecv {
            user,
            request,
            end,
            reply,
        },
    )?;
    let reply = answer.await.map_err(|_| HttpError::CoreGone)??;
    let response = PrepRecvResponse {
        kv_append_metadata: reply.kv_addr_info.encode(),
        prefix_matched_length: u32::try_from(reply.prefix_matched_length).unwrap_or(u32::MAX),
    };
    Ok(json(StatusCode::OK, &response))
}

async fn remote_send(
    req: Request<Incoming>,
    state: &EngineState,
) -> Result<Response<Body>, HttpError> {
    let RemoteSendRequest {
        common: body,
        begin,
        end,
        kv_addr_info,
        recv_rank: rank,
    } = read_request(req).await?;
    let tokens = prompt_tokens(state, &body.prompt)?;
    let len = tokens.len();
    let end = resolve_end(end, len)?;
    let begin = usize::try_from(begin)
        .ok()
        .filter(|&b| b < end)
        .ok_or_else(|| {
            invalid(
                "begin",
                format!("need 0 <= begin < end, got begin {begin}, end {end}"),
            )
        })?;
    let info = KvAddrInfo::decode_within(&kv_addr_info, end - begin)
        .map_err(|e| invalid("kv_addr_info", e.to_string()))?;
    if info.models.len() != 1 {
        return Err(invalid(
            "kv_addr_info",
            format!("names {} models; this engine has one", info.models.len()),
        ));
    }
    if info.total_len() as usize != end - begin {
        return Err(invalid(
            "kv_addr_info",
            format!(
                "slot runs cover {} positions but end - begin = {}",
                info.total_len(),
                end - begin
            ),
        ));
    }
    check_fits(state, end, "end")?;

    let (reply, answer) = oneshot::channel();
    send(
        state,
        Command::PrefillForSend {
            tokens: tokens[..end].to_vec(),
            begin,
            reply,
        },
    )?;
    let lease = answer.await.map_err(|_| HttpError::CoreGone)?;
    // The push runs on a task of its own that owns the lease: if this handler is cancelled (the
    // router gave up), a copy already under way (shm's runs on the blocking pool) still reads
    // P's slots, so they must stay held until it ends, not until the handler does.
    let window = 0..lease.slots.len();
    let push = tokio::spawn(push_kv(
        state.transport.clone(),
        state.latency,
        lease,
        window,
        rank,
        info,
    ));
    push.await.map_err(|_| HttpError::CoreGone)??;
    Ok(json(StatusCode::OK, &serde_json::json!({})))
}

/// Pushes the leased slots `window` (indices into `lease.slots`) into `rank`'s pool, then waits
/// out the simulated transfer cost; the lease (P's pages) is released when this returns.
async fn push_kv(
    transport: Arc<KvTransport>,
    latency: Latency,
    lease: SendLease,
    window: std::ops::Range<usize>,
    rank: u32,
    info: KvAddrInfo,
) -> Result<(), HttpError> {
    let slots = lease.slots.get(window).unwrap_or_default();
    let stats = transport
        .send(rank, slots, &info)
        .await
        .map_err(|source| HttpError::Transfer { rank, source })?;
    let cost = latency.transfer(stats.bytes as usize);
    if !cost.is_zero() {
        tokio::time::sleep(cost.saturating_sub(stats.elapsed)).await;
    }
    Ok(())
}

async fn start_generate(
    req: Request<Incoming>,
    state: &EngineState,
) -> Result<Response<Body>, HttpError> {
    let StartGenerateRequest {
        common: body,
        begin,
    } = read_request(req).await?;
    let len = prompt_tokens(state, &body.prompt)?.len();
    let user = required_user(&body)?;
    let begin = usize::try_from(begin)
        .ok()
        .filter(|&b| b < len)
        .ok_or_else(|| {
            invalid(
                "begin",
                format!("begin {begin} is out of range for a prompt of {len} tokens"),
            )
        })?;
    let (events, rx) = mpsc::unbounded_channel();
    let (reply, answer) = oneshot::channel();
    send(
        state,
        Command::StartGenerate {
            user: user.clone(),
            begin,
            events,
            reply,
        },
    )?;
    answer.await.map_err(|_| HttpError::CoreGone)??;
    let meta = response_meta(state, &body, user);
    Ok(respond(&body, meta, rx).await)
}

// === request parsing ===

/// The body of a call, as the wire type of its route.
async fn read_request<T: DeserializeOwned>(req: Request<Incoming>) -> Result<T, HttpError> {
    let bytes = Limited::new(req.into_body(), MAX_BODY_BYTES)
        .collect()
        .await
        .map_err(|e| HttpError::Invalid {
            message: format!("cannot read the request body: {e}"),
            param: None,
        })?
        .to_bytes();
    serde_json::from_slice(&bytes).map_err(|e| HttpError::Invalid {
        message: format!("invalid request body: {e}"),
        param: None,
    })
}

fn prompt_tokens(state: &EngineState, prompt: &Prompt) -> Result<Vec<u32>, HttpError> {
    let tokens = match prompt {
        Prompt::Text(text) => state
            .tokenizer
            .encode(text.as_str(), false)
            .map_err(|e| invalid("prompt", format!("cannot tokenize the prompt: {e}")))?
            .get_ids()
            .to_vec(),
        Prompt::Tokens(ids) if ids.iter().all(|&t| t < state.vocab_size) => ids.clone(),
        Prompt::Tokens(_) => {
            return Err(invalid(
                "prompt",
                format!("token ids must be in 0..{}", state.vocab_size),
            ));
        }
    };
    if tokens.is_empty() {
        return Err(invalid("prompt", "the prompt is empty"));
    }
    Ok(tokens)
}

fn generation_request(
    state: &EngineState,
    body: &CompletionRequest,
) -> Result<GenRequest, HttpError> {
    let tokens = prompt_tokens(state, &body.prompt)?;
    if body.n != 1 {
        return Err(invalid("n", "only n = 1 is supported"));
    }
    let max_tokens = match body.max_tokens {
        None => DEFAULT_MAX_TOKENS,
        Some(0) => return Err(invalid("max_tokens", "max_tokens must be positive")),
        Some(m) => m as usize,
    };
    let temperature = body.temperature.unwrap_or(0.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(invalid("temperature", "temperature must be in [0, 2]"));
    }
    let top_p = body.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(invalid("top_p", "top_p must be in (0, 1]"));
    }
    // Unseeded sampling is seeded with 0: the reference engine is deterministic by design.
    let seed = body.seed.unwrap_or(0) as u64;
    let stop = body.stop.clone().map(|s| s.into_vec()).unwrap_or_default();
    Ok(GenRequest {
        tokens,
        sampling: Sampling {
            temperature,
            top_p,
            seed,
        },
        max_tokens,
        stop,
        logprobs: body.logprobs,
    })
}

fn required_user(body: &CompletionRequest) -> Result<String, HttpError> {
    body.user
        .clone()
        .filter(|u| !u.is_empty())
        .ok_or_else(|| invalid("user", "microserving calls need the request id in \"user\""))
}

/// The request's `end`, resolved and checked: `0 <= end < len` (spec: prep_recv and remote_send).
fn resolve_end(end: i64, len: usize) -> Result<usize, HttpError> {
    resolve_position(end, len)
        .filter(|&e| e < len)
        .ok_or_else(|| {
            invalid(
                "end",
                format!("end {end} is out of range for a prompt of {len} tokens"),
            )
        })
}

/// Python-style position: negative counts from the end.
fn resolve_position(pos: i64, len: usize) -> Option<usize> {
    let len = i64::try_from(len).ok()?;
    let resolved = if pos < 0 { len + pos } else { pos };
    usize::try_from(resolved).ok()
}

/// Refuses work that could never get its pages, instead of letting it wait forever.
fn check_fits(state: &EngineState, positions: usize, param: &'static str) -> Result<(), HttpError> {
    let pages = positions.div_ceil(state.page_size);
    if pages > state.num_pages as usize {
        return Err(invalid(
            param,
            format!(
                "{positions} positions need {pages} KV pages; this engine has {}",
                state.num_pages
            ),
        ));
    }
    Ok(())
}

fn send(state: &EngineState, cmd: Command) -> Result<(), HttpError> {
    state.commands.send(cmd).map_err(|_| HttpError::CoreGone)
}

fn response_meta(state: &EngineState, body: &CompletionRequest, id: String) -> ResponseMeta {
    let created = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let model = body
        .model
        .clone()
        .unwrap_or_else(|| state.model_name.clone());
    ResponseMeta {
        id,
        created,
        model,
        token_ids: body.return_token_ids && state.answers_token_ids,
        logprobs: body.logprobs.then(|| Arc::clone(&state.tokenizer)),
    }
}

// === responses ===

async fn respond(
    body: &CompletionRequest,
    meta: ResponseMeta,
    rx: mpsc::UnboundedReceiver<Event>,
) -> Response<Body> {
    if body.stream {
        sse(meta, body.include_usage(), rx)
    } else {
        collect(meta, rx)
            .await
            .unwrap_or_else(HttpError::into_response)
    }
}

/// Waits for the whole generation. A preempted request answers with empty text and zero usage,
/// as MLC does.
async fn collect(
    meta: ResponseMeta,
    mut rx: mpsc::UnboundedReceiver<Event>,
) -> Result<Response<Body>, HttpError> {
    let mut text = String::new();
    let mut tokens = Tokens::default();
    while let Some(event) = rx.recv().await {
        text.push_str(&event.text);
        tokens.extend(&event);
        if let Some((reason, usage)) = event.finish {
            if reason == FinishReason::Preempt {
                text.clear();
                tokens = Tokens::default();
            }
            return Ok(json(
                StatusCode::OK,
                &meta.body(vec![meta.choice(text, tokens, Some(reason))], Some(usage)),
            ));
        }
    }
    tracing::error!("generation events ended without a finish; answering 503");
    Err(HttpError::CoreGone)
}

enum SsePhase {
    Tokens,
    Usage(crate::scheduler::Usage),
    Done,
    Over,
}

/// `data: <chunk>\n\n` per event, a usage-only chunk if asked for, then `data: [DONE]\n\n`.
/// Dropping the body (client gone) drops `rx`, which makes the step loop abort the request.
/// Events that end without a finish (the step loop died) end the body with an error: hyper
/// then aborts the connection, and no `[DONE]` makes the cut look complete.
fn sse(
    meta: ResponseMeta,
    include_usage: bool,
    rx: mpsc::UnboundedReceiver<Event>,
) -> Response<Body> {
    let state = (meta, rx, SsePhase::Tokens);
    let stream = futures::stream::unfold(state, move |(meta, mut rx, phase)| async move {
        let (frame, next) = match phase {
            SsePhase::Tokens => match rx.recv().await {
                Some(event) => {
                    let finish = event.finish;
                    let frame = sse::event(&meta.chunk(event));
                    let next = match finish {
                        Some((_, usage)) if include_usage => SsePhase::Usage(usage),
                        Some(_) => SsePhase::Done,
                        None => SsePhase::Tokens,
                    };
                    (frame, next)
                }
                None => {
                    tracing::error!("generation events ended without a finish; cutting the stream");
                    return Some((Err(BodyError), (meta, rx, SsePhase::Over)));
                }
            },
            SsePhase::Usage(usage) => (
                sse::event(&meta.body(Vec::new(), Some(usage))),
                SsePhase::Done,
            ),
            SsePhase::Done => (Bytes::from_static(sse::DONE_EVENT), SsePhase::Over),
            SsePhase::Over => return None,
        };
        Some((Ok(Frame::data(frame)), (meta, rx, next)))
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(BodyExt::boxed_unsync(StreamBody::new(stream.boxed())))
        .unwrap_or_else(|_| Response::new(full("")))
}

fn json(status: StatusCode, value: &impl Serialize) -> Response<Body> {
    let body = serde_json::to_vec(value).unwrap_or_default();
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, "application/json")
        .body(full(body))
        .unwrap_or_else(|_| Response::new(full("")))
}

fn full(bytes: impl Into<Bytes>) -> Body {
    BodyExt::boxed_unsync(Full::new(bytes.into()).map_err(|never| match never {}))
}

#[cfg(test)]
mod tests;
