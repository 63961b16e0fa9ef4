//! SGLang's P/D handoff (bootstrap rooms; `spec/sglang-pd.md`), with real KV movement.
//!
//! The router sends the same body to a prefill engine (P) and a decode engine (D) at once,
//! with `bootstrap_host`, `bootstrap_port` (P's bootstrap server) and a fresh `bootstrap_room`.
//! - **D** reserves pages for all but the last prompt token, registers the room with P's
//!   bootstrap server (its KV address, rank and slots, and a digest of its body) and waits for
//!   P's push, bounded by `--bootstrap-timeout-ms`; then generates from the KV and answers the
//!   client, exactly as a single engine would.
//! - **P** waits (same bound) for D's registration of its room, checks D got the same body,
//!   prefills, pushes the KV into D's slots through the KV transport, marks the room
//!   transferred and answers one token with `finish_reason: "length"`.
//!
//! The bootstrap server (P only; engines only) has `GET /health` → `OK`, `GET /route` (P's
//! parallelism, as SGLang's) and `POST /register` `{bootstrap_room, rank, kv_addr,
//! kv_addr_info, begin, end, digest}`: a long poll that answers 200 once P has pushed
//! positions `[begin, end)` into `kv_addr_info`, 504 when no P leg came for the room within
//! P's bound, 410 when P's leg for the room is gone (cancelled, timed out), 400 when the
//! registration breaks the contract (a room registered twice, another body), 500 when P
//! failed.
//!
//! Cancellation: a leg whose connection the router closes is dropped by hyper with whatever it
//! awaits. A D leg dropped after registering closes its long poll, whose handler, dropped in
//! turn, takes the registration back out of the room (so P never pushes into freed pages), and
//! its reservation is freed. A P leg dropped while it waits leaves a tombstone on its room, so
//! a D that registers later fails at once (410); dropped after taking D's registration, it
//! drops the registration's completion sender, and D's long poll fails at once too: D never
//! waits out its timeout for a P that is gone.

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use prometheus_client::metrics::gauge::Gauge;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio::sync::{mpsc, oneshot};

use switchyard_kv::{KvAddrInfo, PeerAddr};

use super::common::{
    Arrived, Body, Collected, EngineState, Fields, HttpError, Meta, OpenAiRequest, Reserved, Shape,
    body_digest, full, json, parse, prefill_and_hold, push_kv, read_request, replay, request_id,
    respond, serve_whole, stream_after, violation,
};
use crate::args::{DisaggregationMode, EngineArgs};
use crate::metrics::{PdMetrics, side};
use crate::scheduler::{Event, FinishReason};

/// Top-level fields that may differ between the legs (DP-aware routing), left out of the
/// digest that proves both legs got the same body.
const DP_FIELDS: [&str; 2] = ["routed_dp_rank", "disagg_prefill_dp_rank"];

/// An SGLang-mode engine's handoff state.
pub(crate) struct Sglang {
    mode: DisaggregationMode,
    /// This prefill engine's bootstrap server, which P legs must name.
    bootstrap: Option<SocketAddr>,
    timeout: Duration,
    rooms: Mutex<Rooms>,
    metrics: PdMetrics,
}

/// The bootstrap server's table, and every room ever seen (a room is good for one request).
#[derive(Default)]
struct Rooms {
    table: HashMap<u64, Room>,
    /// Rooms of every P leg served here. Grows with the requests served, 8 bytes each.
    prefill_seen: HashSet<u64>,
    /// Rooms every D registration named.
    registered: HashSet<u64>,
}

/// One rendezvous: whichever leg comes first leaves its half here.
#[derive(Default)]
struct Room {
    /// D's registration, until P takes it.
    registration: Option<Registration>,
    /// P waiting for D's registration.
    waiter: Option<oneshot::Sender<Registration>>,
    /// P's leg ended without a transfer (cancelled, orphaned, failed): a D that registers now
    /// is told at once. Swept after the bootstrap timeout.
    prefill_gone: Option<Instant>,
}

/// What P needs to push into D, and where to tell D how it went.
struct Registration {
    rank: u32,
    kv_addr: String,
    kv_addr_info: String,
    begin: usize,
    end: usize,
    digest: String,
    done: oneshot::Sender<Result<(), String>>,
}

impl Sglang {
    pub(crate) fn new(
        args: &EngineArgs,
        bootstrap: Option<SocketAddr>,
        metrics: PdMetrics,
    ) -> Self {
        Sglang {
            mode: args.disaggregation_mode,
            bootstrap,
            timeout: Duration::from_millis(args.bootstrap_timeout_ms),
            rooms: Mutex::new(Rooms::default()),
            metrics,
        }
    }

    fn rooms(&self) -> MutexGuard<'_, Rooms> {
        let mut rooms = self.rooms.lock().unwrap_or_else(|e| e.into_inner());
        let timeout = self.timeout;
        rooms
            .table
            .retain(|_, room| room.prefill_gone.is_none_or(|at| at.elapsed() < timeout));
        rooms
    }

    /// Whether `host:port` is this engine's bootstrap server.
    fn is_own(&self, host: &str, port: u16) -> bool {
        let Some(own) = self.bootstrap else {
            return false;
        };
        if port != own.port() {
            return false;
        }
        match host.parse::<IpAddr>() {
            Ok(ip) => ip == own.ip() || own.ip().is_unspecified(),
            Err(_) => host == "localhost" && (own.ip().is_loopback() || own.ip().is_unspecified()),
        }
    }
}

/// The three rendezvous fields of a leg.
#[derive(Debug, Clone)]
struct Bootstrap {
    host: String,
    port: u16,
    room: u64,
}

/// Reads and range-checks the rendezvous fields; their absence or a bad value breaks the
/// contract.
fn bootstrap_fields(state: &EngineState, f: &Fields) -> Result<Bootstrap, HttpError> {
    let m = &state.metrics;
    let host = f
        .bootstrap_host
        .as_ref()
        .and_then(Value::as_str)
        .ok_or_else(|| {
            violation(
                m,
                "bootstrap_host",
                "a P/D leg needs a string bootstrap_host",
            )
        })?;
    let port = f
        .bootstrap_port
        .as_ref()
        .and_then(Value::as_u64)
        .and_then(|p| u16::try_from(p).ok())
        .ok_or_else(|| {
            violation(
                m,
                "bootstrap_port",
                "a P/D leg needs an integer bootstrap_port",
            )
        })?;
    let room = f
        .bootstrap_room
        .as_ref()
        .and_then(Value::as_u64)
        .filter(|&r| r <= i64::MAX as u64)
        .ok_or_else(|| {
            violation(
                m,
                "bootstrap_room",
                "a P/D leg needs an integer bootstrap_room in [0, 2^63-1]",
            )
        })?;
    Ok(Bootstrap {
        host: host.to_owned(),
        port,
        room,
    })
}

/// A completion or chat call, served as the engine's mode says.
pub(super) async fn generate(
    req: Request<Incoming>,
    state: Arc<EngineState>,
    sg: Arc<Sglang>,
    shape: Shape,
) -> Result<Response<Body>, HttpError> {
    let request_id = request_id(&req);
    let body = read_request(req).await?;
    serve(state, sg, Arrived::new(shape, request_id, body)?).await
}

/// The mode decides: a null engine serves everything whole; a prefill or decode engine only
/// serves its leg of a P/D pair.
async fn serve(
    state: Arc<EngineState>,
    sg: Arc<Sglang>,
    arrived: Arrived,
) -> Result<Response<Body>, HttpError> {
    if sg.mode == DisaggregationMode::Null {
        let request = parse(&state, arrived)?;
        return serve_whole(&state, request).await;
    }
    let boot = bootstrap_fields(&state, &arrived.fields)?;
    let digest = body_digest(&arrived.raw, &DP_FIELDS);
    let request = Arc::new(parse(&state, arrived)?);
    let meta = Meta::new(&state, &request);
    let (stream, include_usage) = (request.stream, request.include_usage);
    match sg.mode {
        DisaggregationMode::Prefill => {
            if !sg.is_own(&boot.host, boot.port) {
                return Err(violation(
                    &state.metrics,
                    "bootstrap_port",
                    format!(
                        "bootstrap {}:{} is not this prefill engine's bootstrap server",
                        boot.host, boot.port
                    ),
                ));
            }
            if !sg.rooms().prefill_seen.insert(boot.room) {
                return Err(violation(
                    &state.metrics,
                    "bootstrap_room",
                    format!("bootstrap_room {} was used before", boot.room),
                ));
            }
            let work = prefill(state, sg, request.clone(), boot.room, digest);
            if stream {
                let replayed = async move { work.await.map(|done| replay(done.events)) };
                Ok(stream_after(meta, include_usage, replayed))
            } else {
                let done = work.await?;
                Ok(json(StatusCode::OK, &meta.full(&done, None)))
            }
        }
        DisaggregationMode::Decode | DisaggregationMode::Null => {
            let work = decode(state, sg, request.clone(), boot, digest);
            if stream {
                Ok(stream_after(meta, include_usage, work))
            } else {
                let rx = work.await?;
                respond(meta, stream, include_usage, rx).await
            }
        }
    }
}

/// How a leg ended, for its guard: only a leg still waiting when dropped was cancelled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Waiting,
    Orphan,
    Failed,
    Transferred,
}

/// One pending leg in `rooms_pending{side}` for as long as it lives.
struct Pending(Gauge);

impl Pending {
    fn new(metrics: &PdMetrics, s: &'static str) -> Pending {
        let gauge = metrics.rooms_pending.get_or_create(&side(s)).clone();
        gauge.inc();
        Pending(gauge)
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        self.0.dec();
    }
}

// === P ===

/// P's room, from its arrival to its answer. Dropped before a transfer (cancelled, orphaned,
/// failed) it leaves a tombstone and drops any registration it took, so D learns at once.
struct PrefillLeg {
    sg: Arc<Sglang>,
    room: u64,
    outcome: Outcome,
    _pending: Pending,
}

impl Drop for PrefillLeg {
    fn drop(&mut self) {
        let mut rooms = self.sg.rooms();
        if self.outcome == Outcome::Transferred {
            rooms.table.remove(&self.room);
        } else {
            let room = rooms.table.entry(self.room).or_default();
            room.waiter = None;
            // A registration still here is D's: fail it now rather than at D's timeout.
            room.registration = None;
            room.prefill_gone = Some(Instant::now());
        }
        drop(rooms);
        if self.outcome == Outcome::Waiting {
            tracing::debug!(room = self.room, "SGLang prefill leg cancelled");
            self.sg
                .metrics
                .cancelled
                .get_or_create(&side("prefill"))
                .inc();
        }
    }
}

async fn prefill(
    state: Arc<EngineState>,
    sg: Arc<Sglang>,
    request: Arc<OpenAiRequest>,
    room: u64,
    digest: String,
) -> Result<Collected, HttpError> {
    let mut leg = PrefillLeg {
        sg: sg.clone(),
        room,
        outcome: Outcome::Waiting,
        _pending: Pending::new(&sg.metrics, "prefill"),
    };
    let registered = {
        let mut rooms = sg.rooms();
        let entry = rooms.table.entry(room).or_default();
        match entry.registration.take() {
            Some(registration) => Ok(registration),
            None => {
                let (tx, rx) = oneshot::channel();
                entry.waiter = Some(tx);
                Err(rx)
            }
        }
    };
    let registration = match registered {
        Ok(registration) => registration,
        Err(rx) => match tokio::time::timeout(sg.timeout, rx).await {
            Ok(Ok(registration)) => registration,
            Ok(Err(_)) => {
                leg.outcome = Outcome::Failed;
                return Err(HttpError::status(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!("bootstrap room {room} was dropped"),
                ));
            }
            Err(_) => {
                leg.outcome = Outcome::Orphan;
                sg.metrics.orphans.get_or_create(&side("prefill")).inc();
                return Err(timed_out(room, sg.timeout, "KVPoll.Bootstrapping"));
            }
        },
    };
    let refuse = |why: String| {
        let e = violation(&state.metrics, "bootstrap_room", why);
        (e.to_string(), e)
    };
    let check = if registration.digest != digest {
        Err(refuse(format!(
            "the decode leg of bootstrap room {room} got another body than the prefill leg"
        )))
    } else if registration.begin > registration.end || registration.end >= request.tokens.len() {
        Err(refuse(format!(
            "the decode leg's window [{}, {}) does not fit the {}-token prompt",
            registration.begin,
            registration.end,
            request.tokens.len()
        )))
    } else {
        Ok(())
    };
    if let Err((message, e)) = check {
        leg.outcome = Outcome::Failed;
        let _ = registration.done.send(Err(message));
        return Err(e);
    }
    let failed = |leg: &mut PrefillLeg, registration: Registration, e: HttpError| {
        leg.outcome = Outcome::Failed;
        let _ = registration.done.send(Err(e.to_string()));
        e
    };
    let (done, lease) = match prefill_and_hold(&state, &request).await {
        Ok((done, Some(lease))) if done.finish != FinishReason::Preempt => (done, lease),
        Ok(_) => {
            let e = HttpError::status(
                StatusCode::INTERNAL_SERVER_ERROR,
                "the prefill was preempted before its KV could be sent",
            );
            return Err(failed(&mut leg, registration, e));
        }
        Err(e) => return Err(failed(&mut leg, registration, e)),
    };
    if registration.done.is_closed() {
        // D's long poll is gone (D cancelled): its slots are no longer its own.
        leg.outcome = Outcome::Failed;
        return Err(HttpError::status(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("the decode leg of bootstrap room {room} went away"),
        ));
    }
    let window = registration.begin..registration.end;
    let pushed = if window.is_empty() {
        Ok(())
    } else {
        async {
            let info = KvAddrInfo::decode_within(&registration.kv_addr_info, window.len())
                .map_err(|e| HttpError::status(StatusCode::BAD_REQUEST, e.to_string()))?;
            if info.models.len() != 1 || info.total_len() as usize != window.len() {
                return Err(HttpError::status(
                    StatusCode::BAD_REQUEST,
                    "kv_addr_info does not cover the window",
                ));
            }
            let addr: PeerAddr = registration
                .kv_addr
                .parse()
                .map_err(|e| HttpError::status(StatusCode::BAD_REQUEST, format!("kv_addr: {e}")))?;
            state
                .transport
                .add_peer(registration.rank, addr)
                .map_err(|e| HttpError::status(StatusCode::BAD_REQUEST, format!("kv_addr: {e}")))?;
            // On a task of its own that owns the lease: a copy under way still reads P's
            // slots if this leg is dropped.
            let push = tokio::spawn(push_kv(
                state.transport.clone(),
                state.timing.clone(),
                lease,
                window.clone(),
                registration.rank,
                info,
            ));
            push.await.map_err(|_| HttpError::CoreGone)?
        }
        .await
    };
    if let Err(e) = pushed {
        sg.metrics.transfer_failures.inc();
        return Err(failed(&mut leg, registration, e));
    }
    sg.metrics.rooms_transferred.inc();
    leg.outcome = Outcome::Transferred;
    let _ = registration.done.send(Ok(()));
    Ok(done)
}

/// SGLang's words for a leg whose counterpart never came.
fn timed_out(room: u64, after: Duration, poll: &str) -> HttpError {
    HttpError::status(
        StatusCode::INTERNAL_SERVER_ERROR,
        format!(
            "Request with bootstrap_room {room} timed out after {:.1}s in {poll}",
            after.as_secs_f64()
        ),
    )
}

// === D ===

/// D's leg until it generates; dropped while still waiting, it was cancelled.
struct DecodeLeg {
    metrics: PdMetrics,
    room: u64,
    outcome: Outcome,
    _pending: Pending,
}

impl Drop for DecodeLeg {
    fn drop(&mut self) {
        if self.outcome == Outcome::Waiting {
            tracing::debug!(room = self.room, "SGLang decode leg cancelled");
            self.metrics.cancelled.get_or_create(&side("decode")).inc();
        }
    }
}

#[derive(Debug, Serialize, Deserialize)]
struct RegisterRequest {
    bootstrap_room: u64,
    rank: u32,
    kv_addr: String,
    kv_addr_info: String,
    begin: usize,
    end: usize,
    digest: String,
}

async fn decode(
    state: Arc<EngineState>,
    sg: Arc<Sglang>,
    request: Arc<OpenAiRequest>,
    boot: Bootstrap,
    digest: String,
) -> Result<mpsc::UnboundedReceiver<Event>, HttpError> {
    let mut leg = DecodeLeg {
        metrics: sg.metrics.clone(),
        room: boot.room,
        outcome: Outcome::Waiting,
        _pending: Pending::new(&sg.metrics, "decode"),
    };
    // Dropped on any way out but `start`, the reservation frees its pages at once.
    let reserved = match Reserved::new(&state, &request).await {
        Ok(reserved) => reserved,
        Err(e) => {
            leg.outcome = Outcome::Failed;
            return Err(e);
        }
    };
    let url = match boot.host.parse::<IpAddr>() {
        Ok(ip) => format!("http://{}/register", SocketAddr::new(ip, boot.port)),
        Err(_) => format!("http://{}:{}/register", boot.host, boot.port),
    };
    let registration = RegisterRequest {
        bootstrap_room: boot.room,
        rank: state.device_rank,
        kv_addr: state.transport.listen_addr().to_string(),
        kv_addr_info: reserved.kv_addr_info(),
        begin: reserved.begin(),
        end: reserved.end,
        digest,
    };
    // The long poll answers when P has pushed; P's own bound answers 504 first, this one is
    // the backstop for a P that stopped answering at all.
    let answer = state
        .client
        .post(url)
        .timeout(sg.timeout)
        .json(&registration)
        .send()
        .await;
    let orphan = |leg: &mut DecodeLeg| {
        leg.outcome = Outcome::Orphan;
        sg.metrics.orphans.get_or_create(&side("decode")).inc();
        timed_out(boot.room, sg.timeout, "KVPoll.WaitingForInput")
    };
    match answer {
        Ok(r) if r.status().is_success() => {}
        Ok(r) if r.status() == StatusCode::GATEWAY_TIMEOUT => return Err(orphan(&mut leg)),
        Ok(r) => {
            leg.outcome = Outcome::Failed;
            let status = r.status();
            let text = r.text().await.unwrap_or_default();
            return Err(HttpError::status(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!(
                    "KV transfer for bootstrap room {} failed ({status}): {text}",
                    boot.room
                ),
            ));
        }
        Err(e) if e.is_timeout() => return Err(orphan(&mut leg)),
        Err(e) => {
            leg.outcome = Outcome::Failed;
            return Err(HttpError::status(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!(
                    "cannot reach the bootstrap server {}:{}: {}",
                    boot.host,
                    boot.port,
                    switchyard_wire::error_chain(&e)
                ),
            ));
        }
    }
    leg.outcome = Outcome::Transferred;
    reserved.start().await
}

// === the bootstrap server ===

/// Routes of the bootstrap server.
pub(super) async fn bootstrap_route(
    req: Request<Incoming>,
    sg: Arc<Sglang>,
    state: Arc<EngineState>,
) -> Result<Response<Body>, HttpError> {
    let path = req.uri().path().to_owned();
    match (req.method(), path.as_str()) {
        (&Method::GET, "/health") => Ok(Response::new(full("OK"))),
        (&Method::GET, "/route") => Ok(json(
            StatusCode::OK,
            &json!({"attn_tp_size": 1, "attn_dp_size": 1, "pp_size": 1,
                "page_size": state.page_size, "kv_addr": state.transport.listen_addr().to_string(),
                "rank": state.device_rank}),
        )),
        (&Method::POST, "/register") => {
            let registration: RegisterRequest = read_request(req).await?;
            register(&state, &sg, registration).await
        }
        _ => Err(HttpError::NotFound { path }),
    }
}

/// Takes D's registration back out of its room when its long poll ends before P took it
/// (D hung up, or the wait timed out), so P never pushes into pages D no longer holds.
struct Registered<'a> {
    sg: &'a Sglang,
    room: u64,
}

impl<'a> Registered<'a> {
    fn new(sg: &'a Sglang, room: u64) -> Self {
        sg.metrics.registrations.inc();
        Registered { sg, room }
    }
}

impl Drop for Registered<'_> {
    fn drop(&mut self) {
        self.sg.metrics.registrations.dec();
        let mut rooms = self.sg.rooms();
        if let Some(room) = rooms.table.get_mut(&self.room)
            && room.registration.take().is_some()
            && room.waiter.is_none()
            && room.prefill_gone.is_none()
        {
            rooms.table.remove(&self.room);
        }
    }
}

async fn register(
    state: &EngineState,
    sg: &Sglang,
    r: RegisterRequest,
) -> Result<Response<Body>, HttpError> {
    let room = r.bootstrap_room;
    let (done, outcome) = oneshot::channel();
    {
        let mut rooms = sg.rooms();
        if !rooms.registered.insert(room) {
            return Err(violation(
                &state.metrics,
                "bootstrap_room",
                format!("bootstrap room {room} was registered before"),
            ));
        }
        let entry = rooms.table.entry(room).or_default();
        if entry.prefill_gone.is_some() {
            return Err(HttpError::status(
                StatusCode::GONE,
                format!(
                    "the prefill leg of bootstrap room {room} is gone (cancelled, timed out or failed)"
                ),
            ));
        }
        let registration = Registration {
            rank: r.rank,
            kv_addr: r.kv_addr,
            kv_addr_info: r.kv_addr_info,
            begin: r.begin,
            end: r.end,
            digest: r.digest,
            done,
        };
        match entry.waiter.take() {
            Some(waiter) => {
                if let Err(registration) = waiter.send(registration) {
                    entry.registration = Some(registration);
                }
            }
            None => entry.registration = Some(registration),
        }
    }
    let _registered = Registered::new(sg, room);
    match tokio::time::timeout(sg.timeout, outcome).await {
        Ok(Ok(Ok(()))) => Ok(json(StatusCode::OK, &json!({"status": "transferred"}))),
        Ok(Ok(Err(message))) => Err(HttpError::status(
            StatusCode::INTERNAL_SERVER_ERROR,
            message,
        )),
        Ok(Err(_)) => Err(HttpError::status(
            StatusCode::GONE,
            format!("the prefill leg of bootstrap room {room} ended without sending its KV"),
        )),
        Err(_) => Err(HttpError::status(
            StatusCode::GATEWAY_TIMEOUT,
            format!("no prefill leg for bootstrap room {room} came within the bootstrap timeout"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::Map;

    use super::*;

    #[test]
    fn the_digest_ignores_key_order_and_dp_fields() {
        let a: Map<String, Value> =
            serde_json::from_str(r#"{"a": 1, "b": {"y": [1, 2], "x": "s"}, "routed_dp_rank": 0}"#)
                .unwrap();
        let b: Map<String, Value> = serde_json::from_str(
            r#"{"b": {"x": "s", "y": [1, 2]}, "a": 1, "routed_dp_rank": 3, "disagg_prefill_dp_rank": 0}"#,
        )
        .unwrap();
        let c: Map<String, Value> =
            serde_json::from_str(r#"{"a": 2, "b": {"x": "s", "y": [1, 2]}}"#).unwrap();
        assert_eq!(body_digest(&a, &DP_FIELDS), body_digest(&b, &DP_FIELDS));
        assert_ne!(body_digest(&a, &DP_FIELDS), body_digest(&c, &DP_FIELDS));
    }
}
