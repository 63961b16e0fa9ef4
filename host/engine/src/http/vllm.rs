//! vLLM's P/D handoff (NixlConnector, pull mode; `spec/vllm-pd.md`), with real KV movement.
//!
//! Every instance can be P or D (vLLM's `kv_both`): the request decides.
//! - **P leg** (`kv_transfer_params.do_remote_decode: true`): the §10 checks, then the whole
//!   prompt is prefilled and one token sampled; the prompt's pages stay held under a *lease*
//!   (`--kv-lease-ms`) and the answer carries `kv_transfer_params` naming them.
//! - **D leg** (`kv_transfer_params.do_remote_prefill: true`): reserves pages for all but the
//!   last prompt token, then *pulls*: asks P over P's side channel to push the leased pages into
//!   those slots through the KV transport (NIXL's READ, done here as P's push), then generates as
//!   a single engine would. A D leg that cannot load its KV answers 500
//!   (`kv_load_failure_policy=fail`).
//!
//! The side channel (vLLM's `VLLM_NIXL_SIDE_CHANNEL_PORT`) is a separate loopback HTTP
//! listener, only for engines:
//! - `POST /pull` `{remote_request_id, remote_engine_id, remote_block_ids, x_request_id, tokens,
//!   body_digest, begin, end, kv_addr_info, recv_rank, kv_addr}`: P checks the lease is its
//!   own, held, and for this request (same X-Request-Id, prompt and body apart from the fields
//!   §3 rewrites), pushes positions `[begin, end)` into `kv_addr_info` at `recv_rank`
//!   (`kv_addr`), frees the lease and answers `{}` once the bytes are in D's pool.
//! - `POST /release` `{remote_request_id, remote_engine_id}`: D gave up before its pull
//!   (vLLM's empty-read notification): P frees the lease now instead of at its expiry.
//! - `GET /health`.

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use switchyard_kv::{KvAddrInfo, PeerAddr};

use super::common::{
    Arrived, Body, EngineState, HttpError, Meta, OpenAiRequest, Reserved, Shape, body_digest,
    empty, json, parse, prefill_and_hold, push_kv, read_request, request_id, respond, serve_whole,
    stream_after, violation,
};
use crate::args::EngineArgs;
use crate::metrics::PdMetrics;
use crate::scheduler::{Event, FinishReason};
use crate::step_loop::SendLease;

/// Top-level fields the P and D legs may differ in (spec §3 and §4): the rest of D's body must
/// be P's (checked at the pull, §11.6).
const LEG_FIELDS: [&str; 7] = [
    "kv_transfer_params",
    "stream",
    "stream_options",
    "max_tokens",
    "max_completion_tokens",
    "min_tokens",
    "min_completion_tokens",
];

/// A vLLM-mode engine's handoff state.
pub(crate) struct Vllm {
    /// `remote_engine_id`: a UUID fixed for this process, so a router sees a restart.
    engine_id: String,
    /// Where decode engines reach the side channel (`remote_host`, `remote_port`).
    side_host: String,
    side_port: u16,
    lease_for: Duration,
    leases: Mutex<HashMap<String, Lease>>,
    /// Every `X-Request-Id` a P leg carried: one per attempt, never reused (§11.1). Grows with
    /// the number of P legs served, a few dozen bytes each: fine for a reference engine.
    seen: Mutex<HashSet<String>>,
    metrics: PdMetrics,
}

/// A P leg's KV, held for a decode engine's pull.
struct Lease {
    kv: SendLease,
    tokens: Vec<u32>,
    /// The P leg's body apart from what §3 lets differ ([`LEG_FIELDS`]).
    body_digest: String,
    request_id: String,
    block_ids: Value,
}

impl Vllm {
    pub(crate) fn new(args: &EngineArgs, side: Option<SocketAddr>, metrics: PdMetrics) -> Vllm {
        let side = side.unwrap_or_else(|| SocketAddr::new(args.host, 0));
        // An unspecified listen address is reachable on loopback at least.
        let host = match side.ip() {
            ip if ip.is_unspecified() => IpAddr::from([127, 0, 0, 1]),
            ip => ip,
        };
        let r: u128 = rand::random();
        Vllm {
            engine_id: format!(
                "{:08x}-{:04x}-4{:03x}-{:04x}-{:012x}",
                (r >> 96) as u32,
                (r >> 80) as u16,
                (r >> 68) as u16 & 0xfff,
                ((r >> 52) as u16 & 0x3fff) | 0x8000,
                r as u64 & 0xffff_ffff_ffff
            ),
            side_host: host.to_string(),
            side_port: side.port(),
            lease_for: Duration::from_millis(args.kv_lease_ms),
            leases: Mutex::new(HashMap::new()),
            seen: Mutex::new(HashSet::new()),
            metrics,
        }
    }

    fn leases(&self) -> MutexGuard<'_, HashMap<String, Lease>> {
        self.leases.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes a lease out of the table (the gauge follows); dropping it frees P's pages.
    fn take(&self, id: &str) -> Option<Lease> {
        let mut leases = self.leases();
        let lease = leases.remove(id);
        self.metrics.leases_held.set(leases.len() as i64);
        lease
    }
}

/// A completion or chat call: its body read ([`read_body_or_release`]), then served as the leg
/// its `kv_transfer_params` make it.
pub(super) async fn generate(
    req: Request<Incoming>,
    state: Arc<EngineState>,
    v: Arc<Vllm>,
    shape: Shape,
) -> Result<Response<Body>, HttpError> {
    let request_id = request_id(&req);
    let body = read_body_or_release(&state, req).await?;
    serve(state, v, Arrived::new(shape, request_id, body)?).await
}

/// `kv_transfer_params` decides the leg: P, D, or a plain request served whole.
async fn serve(
    state: Arc<EngineState>,
    v: Arc<Vllm>,
    arrived: Arrived,
) -> Result<Response<Body>, HttpError> {
    let params = arrived
        .fields
        .kv_transfer_params
        .clone()
        .filter(|p| !p.is_null());
    let flag = |key: &str| {
        params
            .as_ref()
            .and_then(|p| p.get(key))
            .and_then(Value::as_bool)
    };
    if flag("do_remote_decode") == Some(true) {
        prefill(state, v, arrived).await
    } else if flag("do_remote_prefill") == Some(true) {
        let params = params.unwrap_or(Value::Null);
        decode(state, arrived, params).await
    } else {
        let request = parse(&state, arrived)?;
        serve_whole(&state, request).await
    }
}

// === P ===

/// The P leg: §10's checks, prefill, one token, a lease, and the params that name it.
async fn prefill(
    state: Arc<EngineState>,
    v: Arc<Vllm>,
    arrived: Arrived,
) -> Result<Response<Body>, HttpError> {
    let m = &state.metrics;
    let f = &arrived.fields;
    if f.max_tokens != Some(1) {
        return Err(violation(
            m,
            "max_tokens",
            "a prefill leg needs max_tokens 1",
        ));
    }
    if f.max_completion_tokens.is_some_and(|n| n != 1) {
        return Err(violation(
            m,
            "max_completion_tokens",
            "a prefill leg needs max_completion_tokens 1 when it is present",
        ));
    }
    if f.stream == Some(true) {
        return Err(violation(m, "stream", "a prefill leg must not stream"));
    }
    if f.stream_options.is_some() {
        return Err(violation(
            m,
            "stream_options",
            "a prefill leg must not carry stream_options",
        ));
    }
    if f.min_tokens.is_some_and(|n| n > 1) {
        return Err(violation(
            m,
            "min_tokens",
            "a prefill leg needs min_tokens <= 1",
        ));
    }
    if f.n.is_some_and(|n| n > 1) {
        return Err(violation(m, "n", "vLLM P/D does not support n > 1"));
    }
    let Some(request_id) = arrived.request_id.clone() else {
        return Err(violation(
            m,
            "x-request-id",
            "a prefill leg needs an X-Request-Id",
        ));
    };
    {
        let mut seen = v.seen.lock().unwrap_or_else(|e| e.into_inner());
        if !seen.insert(request_id.clone()) {
            return Err(violation(
                m,
                "x-request-id",
                format!("X-Request-Id {request_id:?} was used before: one per attempt"),
            ));
        }
    }
    let digest = body_digest(&arrived.raw, &LEG_FIELDS);
    let request = parse(&state, arrived)?;
    let meta = Meta::new(&state, &request);
    // Cancelled here (the router closed P's connection): the generation aborts and no lease
    // is made, as vLLM aborts a request on disconnect.
    let (done, lease) = prefill_and_hold(&state, &request).await?;
    let params = match lease {
        Some(kv) if done.finish == FinishReason::Length => {
            issue(&state, &v, kv, &request, &request_id, digest)
        }
        // Not length-capped (EOS, preempted): vLLM keeps no blocks and answers null params;
        // the lease, if any, drops here.
        _ => Value::Null,
    };
    Ok(json(
        StatusCode::OK,
        &meta.full(&done, Some(("kv_transfer_params", params))),
    ))
}

/// Records a lease and returns the params D must bring back; the lease frees itself at expiry.
fn issue(
    state: &EngineState,
    v: &Arc<Vllm>,
    kv: SendLease,
    request: &OpenAiRequest,
    request_id: &str,
    body_digest: String,
) -> Value {
    let page_size = state.page_size as u32;
    let mut pages: Vec<u32> = Vec::new();
    for slot in &kv.slots {
        let page = slot / page_size;
        if pages.last() != Some(&page) {
            pages.push(page);
        }
    }
    let block_ids = json!([pages]);
    let remote_request_id = format!("cmpl-{request_id}-{:08x}", rand::random::<u32>());
    let params = json!({
        "do_remote_prefill": true,
        "do_remote_decode": false,
        "remote_block_ids": block_ids,
        "remote_engine_id": v.engine_id,
        "remote_request_id": remote_request_id,
        "remote_host": v.side_host,
        "remote_port": v.side_port,
        "tp_size": 1,
    });
    {
        let mut leases = v.leases();
        leases.insert(
            remote_request_id.clone(),
            Lease {
                kv,
                tokens: request.tokens.clone(),
                body_digest,
                request_id: request_id.to_owned(),
                block_ids,
            },
        );
        v.metrics.leases_held.set(leases.len() as i64);
    }
    v.metrics.leases_issued.inc();
    // The timer holds the table weakly: a dropped engine does not live on for its leases.
    let table = Arc::downgrade(v);
    let lease_for = v.lease_for;
    tokio::spawn(async move {
        tokio::time::sleep(lease_for).await;
        if let Some(v) = table.upgrade()
            && v.take(&remote_request_id).is_some()
        {
            tracing::debug!(%remote_request_id, "vLLM lease expired without a pull");
            v.metrics.leases_expired.inc();
        }
    });
    params
}

// === D ===

/// What D reads from P's params; anything missing means the KV cannot be loaded.
#[derive(Debug, Deserialize)]
struct Params {
    remote_request_id: String,
    remote_engine_id: String,
    remote_host: String,
    remote_port: u16,
    remote_block_ids: Value,
}

/// The D leg: reserve, pull, generate. Streaming answers send their head at once (vLLM's
/// StreamingResponse), so a failed pull is then an error event.
async fn decode(
    state: Arc<EngineState>,
    arrived: Arrived,
    params: Value,
) -> Result<Response<Body>, HttpError> {
    let digest = body_digest(&arrived.raw, &LEG_FIELDS);
    // From here, a leg that goes away before P has answered its pull (cancelled while it
    // waits for pages or for the pull, failed, or a stream whose body was never polled) tells
    // P to drop the lease.
    let release = Release::for_params(&state, &params);
    let request = parse(&state, arrived)?;
    let meta = Meta::new(&state, &request);
    let request = Arc::new(request);
    let work = {
        let (state, request) = (state.clone(), request.clone());
        async move { pull_and_start(state, &request, params, release, digest).await }
    };
    if request.stream {
        Ok(stream_after(meta, request.include_usage, work))
    } else {
        let rx = work.await?;
        respond(meta, request.stream, request.include_usage, rx).await
    }
}

async fn pull_and_start(
    state: Arc<EngineState>,
    request: &OpenAiRequest,
    params: Value,
    mut release: Option<Release>,
    body_digest: String,
) -> Result<tokio::sync::mpsc::UnboundedReceiver<Event>, HttpError> {
    let metrics = &state.metrics.pd;
    let load_failure = |message: String| {
        metrics.load_failures.inc();
        tracing::debug!(%message, "vLLM KV load failed");
        HttpError::status(StatusCode::INTERNAL_SERVER_ERROR, message)
    };
    let params: Params = serde_json::from_value(params).map_err(|e| {
        metrics.protocol_violations.inc();
        load_failure(format!("invalid kv_transfer_params: {e}"))
    })?;
    let side = side_url(&params.remote_host, params.remote_port);
    let reserved = Reserved::new(&state, request).await?;
    let pull = PullRequest {
        remote_request_id: params.remote_request_id.clone(),
        remote_engine_id: params.remote_engine_id.clone(),
        remote_block_ids: params.remote_block_ids.clone(),
        x_request_id: request.request_id.clone(),
        tokens: request.tokens.clone(),
        body_digest,
        begin: reserved.begin(),
        end: reserved.end,
        kv_addr_info: reserved.kv_addr_info(),
        recv_rank: state.device_rank,
        kv_addr: state.transport.listen_addr().to_string(),
    };
    let answer = state
        .client
        .post(format!("{side}/pull"))
        .timeout(state.kv_transfer_timeout + Duration::from_secs(10))
        .json(&pull)
        .send()
        .await;
    match answer {
        Ok(r) if r.status().is_success() => {
            // P freed the lease itself.
            if let Some(release) = release.as_mut() {
                release.body = None;
            }
        }
        Ok(r) => {
            let status = r.status();
            let text = r.text().await.unwrap_or_default();
            return Err(load_failure(format!(
                "KV pull from {side} for {} failed ({status}): {text}",
                params.remote_request_id
            )));
        }
        Err(e) => {
            return Err(load_failure(format!(
                "KV pull from {side} for {} failed: {}",
                params.remote_request_id,
                switchyard_wire::error_chain(&e)
            )));
        }
    }
    drop(release);
    reserved.start().await
}

/// `http://host:port`, brackets around an IPv6 host.
fn side_url(host: &str, port: u16) -> String {
    match host.parse::<IpAddr>() {
        Ok(ip) => format!("http://{}", SocketAddr::new(ip, port)),
        Err(_) => format!("http://{host}:{port}"),
    }
}

/// vLLM's empty-read notification, sent when dropped while armed: a D leg that goes away
/// (cancelled, or failed to load) before P pushed tells P to free the lease now.
struct Release {
    client: reqwest::Client,
    url: String,
    body: Option<Value>,
}

impl Drop for Release {
    fn drop(&mut self) {
        let Some(body) = self.body.take() else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let request = self
            .client
            .post(std::mem::take(&mut self.url))
            .timeout(Duration::from_secs(10))
            .json(&body);
        runtime.spawn(async move {
            if let Err(e) = request.send().await {
                tracing::debug!(error = %e, "cannot tell the prefill engine to release its lease");
            }
        });
    }
}

impl Release {
    /// The release a decode leg's body calls for: `None` unless it carries P's params.
    fn for_decode_leg(state: &EngineState, body: &Value) -> Option<Release> {
        let params = body.get("kv_transfer_params")?;
        if params.get("do_remote_prefill").and_then(Value::as_bool) != Some(true) {
            return None;
        }
        Self::for_params(state, params)
    }

    /// The release of the lease `params` (P's `kv_transfer_params`) name; `None` if they name
    /// none (a violation the pull reports).
    fn for_params(state: &EngineState, params: &Value) -> Option<Release> {
        let params: Params = serde_json::from_value(params.clone()).ok()?;
        Some(Release {
            client: state.client.clone(),
            url: format!(
                "{}/release",
                side_url(&params.remote_host, params.remote_port)
            ),
            body: Some(json!({
                "remote_request_id": params.remote_request_id,
                "remote_engine_id": params.remote_engine_id,
            })),
        })
    }
}

/// The request body, read on a task of its own: a request that arrived whole is vLLM's even
/// if its connection closed before this handler read it (hyper drops a handler whose client
/// is gone, buffered body or not), and vLLM aborts such a request, which for a decode leg
/// tells its prefill to drop the lease. So when nobody is left to take the body, a decode
/// leg's release is sent from here.
async fn read_body_or_release(
    state: &Arc<EngineState>,
    req: Request<Incoming>,
) -> Result<Value, HttpError> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let state = state.clone();
    tokio::spawn(async move {
        let body = read_request::<Value>(req).await;
        if let Err(Ok(body)) = tx.send(body) {
            drop(Release::for_decode_leg(&state, &body));
        }
    });
    rx.await.map_err(|_| HttpError::CoreGone)?
}

// === the side channel ===

#[derive(Debug, Serialize, Deserialize)]
struct PullRequest {
    remote_request_id: String,
    remote_engine_id: String,
    remote_block_ids: Value,
    x_request_id: Option<String>,
    tokens: Vec<u32>,
    body_digest: String,
    begin: usize,
    end: usize,
    kv_addr_info: String,
    recv_rank: u32,
    kv_addr: String,
}

#[derive(Debug, Deserialize)]
struct ReleaseRequest {
    remote_request_id: String,
    remote_engine_id: String,
}

/// Routes of the side channel.
pub(super) async fn side_channel(
    req: Request<Incoming>,
    v: Arc<Vllm>,
    state: Arc<EngineState>,
) -> Result<Response<Body>, HttpError> {
    let path = req.uri().path().to_owned();
    match (req.method(), path.as_str()) {
        (&Method::GET, "/health") => Ok(empty(StatusCode::OK)),
        (&Method::POST, "/pull") => {
            let pull: PullRequest = read_request(req).await?;
            serve_pull(&state, &v, pull).await
        }
        (&Method::POST, "/release") => {
            let release: ReleaseRequest = read_request(req).await?;
            if release.remote_engine_id == v.engine_id
                && v.take(&release.remote_request_id).is_some()
            {
                v.metrics.leases_released.inc();
            }
            Ok(json(StatusCode::OK, &json!({})))
        }
        _ => Err(HttpError::NotFound { path }),
    }
}

/// P's half of a pull: the checks, then the push, which runs on a task of its own that owns the
/// lease (a copy under way still reads P's slots if D hangs up).
async fn serve_pull(
    state: &EngineState,
    v: &Vllm,
    pull: PullRequest,
) -> Result<Response<Body>, HttpError> {
    let m = &state.metrics;
    let lease = {
        let leases = v.leases();
        let lease = leases.get(&pull.remote_request_id);
        let bad = |reason: String| Some((StatusCode::BAD_REQUEST, reason));
        let refusal = match lease {
            _ if pull.remote_engine_id != v.engine_id => bad(format!(
                "remote_engine_id {:?} is not this engine ({})",
                pull.remote_engine_id, v.engine_id
            )),
            None => Some((
                StatusCode::NOT_FOUND,
                format!(
                    "no lease for remote_request_id {:?}: unknown, already pulled or expired",
                    pull.remote_request_id
                ),
            )),
            Some(l) if l.block_ids != pull.remote_block_ids => {
                bad("remote_block_ids differ from the ones issued".into())
            }
            Some(l) if pull.x_request_id.as_deref() != Some(l.request_id.as_str()) => bad(format!(
                "X-Request-Id {:?} differs from the prefill leg's {:?}",
                pull.x_request_id, l.request_id
            )),
            Some(l) if l.tokens != pull.tokens => {
                bad("the decode leg's prompt differs from the prefill leg's".into())
            }
            Some(l) if l.body_digest != pull.body_digest => bad(
                "the decode leg's body differs from the prefill leg's beyond the fields P/D may change"
                    .into(),
            ),
            Some(l) if pull.begin > pull.end || pull.end > l.tokens.len() => bad(format!(
                "window [{}, {}) is outside the {}-token prompt",
                pull.begin,
                pull.end,
                l.tokens.len()
            )),
            Some(_) => None,
        };
        if let Some((status, reason)) = refusal {
            m.pd.protocol_violations.inc();
            return Err(HttpError::status(status, reason));
        }
        drop(leases);
        v.take(&pull.remote_request_id)
            .ok_or_else(|| HttpError::status(StatusCode::NOT_FOUND, "the lease went away"))?
    };
    let window = pull.begin..pull.end;
    if window.is_empty() {
        v.metrics.leases_pulled.inc();
        return Ok(json(StatusCode::OK, &json!({})));
    }
    // A pull refused from here on has taken the lease: it counts as a failed pull.
    let refused = |e: HttpError| {
        v.metrics.pull_failures.inc();
        e
    };
    let pushed = async {
        let info = KvAddrInfo::decode_within(&pull.kv_addr_info, window.len())
            .map_err(|e| refused(HttpError::status(StatusCode::BAD_REQUEST, e.to_string())))?;
        if info.models.len() != 1 || info.total_len() as usize != window.len() {
            return Err(refused(HttpError::status(
                StatusCode::BAD_REQUEST,
                "kv_addr_info does not cover the window",
            )));
        }
        let addr: PeerAddr = pull.kv_addr.parse().map_err(|e| {
            refused(HttpError::status(
                StatusCode::BAD_REQUEST,
                format!("kv_addr: {e}"),
            ))
        })?;
        state
            .transport
            .add_peer(pull.recv_rank, addr)
            .map_err(|e| {
                refused(HttpError::status(
                    StatusCode::BAD_REQUEST,
                    format!("kv_addr: {e}"),
                ))
            })?;
        // The push owns the lease and is counted on its own task: a decode leg that hangs up
        // mid-pull (its connection to this side channel closes) drops this handler, not the
        // push, whose outcome still counts.
        let metrics = v.metrics.clone();
        let push = push_kv(
            state.transport.clone(),
            state.timing.clone(),
            lease.kv,
            window,
            pull.recv_rank,
            info,
        );
        let push = tokio::spawn(async move {
            let pushed = push.await;
            match &pushed {
                Ok(()) => metrics.leases_pulled.inc(),
                Err(_) => metrics.pull_failures.inc(),
            };
            pushed
        });
        push.await.map_err(|_| HttpError::CoreGone)?
    }
    .await;
    pushed.map(|()| json(StatusCode::OK, &json!({})))
}
