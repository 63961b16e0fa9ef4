//! Endpoints: roles, device ranks, health and load, the snapshot given to policies, and the
//! live list itself: endpoints are added, drained and removed while the router serves.
//!
//! ```text
//! Cluster::new(Vec<EndpointSpec>, OutlierConfig)   ids in order, device ranks = prefix sums of GPUs (as MLC)
//!   snapshot() -> Vec<EndpointSnapshot>  what a policy sees, ordered by id (saturated endpoints
//!                                        shown draining while others have room: `saturation`)
//!   demand() -> Vec<(model, role, Demand)>   saturation and desired replicas, for autoscalers
//!   until_ready().await                  woken when the router becomes ready (scale from zero)
//!   snapshot_for(model, prompt)          the same for one model's request: endpoints not serving
//!                                        it shown removed (see `models`), each endpoint's cached
//!                                        prefix filled in (see `kv`)
//!   snapshot_pinned(model, prompt)       the same, pinning DP ranks (see `kv`)
//!   set_models(id, cards) / models() / serves(model) / healthy_serving(model) / base_model(model)
//!                                        what each endpoint serves (its /v1/models, or pinned)
//!   subscribe_kv_events(id) / note_served(ids, len) / resync_kv_events(id, why)   KV events
//!   in_flight(id) -> InFlight            RAII: counts a leg until dropped (error, cancel, done)
//!   prefilling(id, tokens) -> Prefilling RAII: counts a leg's prompt tokens until its prefill ends
//!   record_success(id) / record_failure(id, why)   outlier ejection (see `outlier`)
//!   mark_unhealthy(id) / set_health(id, ok) / set_probe_error(id, error) / set_engine_load(id, load)
//!   add(spec, owner) / drain(id) / remove(id) / remove_when_idle(id)   the live list
//!   owned_where(|owner| …)                          what the config file, the API or discovery added
//!   url(id) / device_rank(id) / is_ready()
//! health::spawn_probes(Arc<Cluster>, EngineClient, ProbeConfig)   background readiness + engine load probes
//! ```
//!
//! An endpoint is healthy in the snapshot when its readiness probe answers, it is not ejected,
//! draining or removed; plans may name only healthy endpoints. Ids are positions in the list
//! and are never reused: a removed endpoint stays in the snapshot as a tombstone (`removed`),
//! so `snapshot[id].id == id` holds here and for 0.1.0 policies; the 0.2.0 bindings leave
//! tombstones out of what a policy sees. A new endpoint's device rank follows MLC's
//! prefix-sum rule over the whole list.

mod health;
mod inflight;
mod kv;
mod models;
mod outlier;
mod saturation;

use std::fmt::Display;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

use parking_lot::{Mutex, RwLock};
use switchyard_contract::{EndpointSnapshot, Health, Protocol, Role};
use switchyard_wire::metrics::EngineLoad;
use tokio::time::Instant;

use crate::engine_client::{CallError, ModelCard, TlsFiles, Upstream};
use crate::kv_events::{KvEventsSource, ResyncReason, SubscriberConfig};
use kv::{EndpointKv, KvCache};
use models::ModelIndex;
use outlier::Outlier;

pub use health::{ProbeConfig, spawn_probe, spawn_probes};
pub use inflight::{InFlight, Prefilling};
pub use kv::{IndexCounts, KvEventsStatus, RankPins};
pub use outlier::{OutlierConfig, OutlierView};
pub use saturation::{Demand, SaturationConfig};

/// An endpoint as the operator configured it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EndpointSpec {
    /// Base URL, e.g. `http://127.0.0.1:8081` (no trailing slash needed).
    pub url: String,
    #[serde(default)]
    pub role: Role,
    /// GPUs the engine owns; device ranks are the prefix sums of these.
    #[serde(default = "one")]
    pub num_gpus: u32,
    /// The engine's device rank when it is not the prefix sum (an MLC engine started with an
    /// explicit `--device-rank`, a pod's `switchyard.io/device-rank` annotation).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_rank: Option<u32>,
    /// Sent as `Authorization: Bearer …` on every call to the engine (one started with
    /// `--api-key`): `api_key = "…"`, or `api_key = { env = "NAME" }` to read it from the
    /// router's environment. Never shown by `/admin/endpoints` nor logged.
    #[serde(default, skip_serializing)]
    pub api_key: Option<ApiKey>,
    /// The wire protocol the engine speaks: `mlc` (the default), `vllm`, `sglang` or `openai`.
    #[serde(default)]
    pub protocol: Protocol,
    /// The models the engine serves, pinned: routing then ignores what its `/v1/models`
    /// lists. Absent: the ids (and adapters) its readiness probe last read there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub models: Option<Vec<String>>,
    /// An SGLang prefill engine's bootstrap port (`--disaggregation-bootstrap-port`), where
    /// decode engines meet it; required for SGLang prefill endpoints and for them alone. The
    /// host is the URL's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bootstrap_port: Option<u16>,
    /// The engine's KV-cache event socket (ZeroMQ PUB, `tcp://HOST:PORT`): the router keeps
    /// an index of what its prefix cache holds and tells policies each request's cached
    /// prefix. Without it the endpoint's `cached_prefix` is unknown.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_events: Option<String>,
    /// The engine's replay socket (ZeroMQ ROUTER, `tcp://HOST:PORT`), asked for the batches a
    /// gap lost; without it a gap clears the endpoint's index until new events rebuild it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_events_replay: Option<String>,
    /// The topic subscribed to (a prefix); absent: every topic.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_events_topic: Option<String>,
    /// The engine's data-parallel ranks (vLLM's `--data-parallel-size`), each publishing on
    /// its own sockets: rank r at the `kv_events` and `kv_events_replay` ports plus r, as vLLM
    /// binds them. Each rank gets its own subscriber and index; absent: one rank.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_events_dp_size: Option<u32>,
    /// For an `https://` engine: the PEM file of the CA that signs its certificate, trusted
    /// instead of the system's roots (default: the top-level `engine_ca_file`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_file: Option<PathBuf>,
    /// For an `https://` engine that demands one (mTLS): the PEM certificate the router
    /// presents, with `client_key` (default: the top-level `engine_client_cert`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_cert: Option<PathBuf>,
    /// The PEM private key of `client_cert`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_key: Option<PathBuf>,
}

fn one() -> u32 {
    1
}

/// The most data-parallel ranks one endpoint's KV events may come from (vLLM's DP
/// deployments go to a few dozen; each rank is a subscriber task and an index).
pub(crate) const MAX_DP_SIZE: u32 = 256;

/// `tcp://HOST:PORT`, the only ZeroMQ transport engines publish KV events on, whose port plus
/// `last_rank` (where the engine's last DP rank publishes) is a port too.
fn check_tcp_url(key: &str, url: &str, last_rank: u32) -> Result<(), String> {
    let bad = || format!("{key} {url:?} is not a tcp://HOST:PORT address");
    let (host, port) = url
        .strip_prefix("tcp://")
        .and_then(|address| address.rsplit_once(':'))
        .ok_or_else(bad)?;
    match port.parse::<u16>() {
        Ok(port) if port != 0 && !host.is_empty() => {
            if u32::from(port) + last_rank > u32::from(u16::MAX) {
                return Err(format!(
                    "{key} {url:?}: DP rank {last_rank} would publish past port 65535"
                ));
            }
            Ok(())
        }
        _ => Err(bad()),
    }
}

/// An engine's API key, as the `Authorization` header it becomes. Its `Debug` never shows it.
#[derive(Clone, PartialEq, Eq)]
pub struct ApiKey {
    header: http::HeaderValue,
    /// The environment variable it was read from, if any.
    env: Option<String>,
}

impl ApiKey {
    /// `key` as a bearer credential; refused when empty or not a valid header value.
    pub fn new(key: &str) -> Result<ApiKey, String> {
        Self::with_source(key, None)
    }

    fn with_source(key: &str, env: Option<String>) -> Result<ApiKey, String> {
        if key.trim().is_empty() {
            return Err("the API key is empty".into());
        }
        let mut header = http::HeaderValue::from_str(&format!("Bearer {key}"))
            .map_err(|_| "the API key has characters a header cannot carry".to_owned())?;
        header.set_sensitive(true);
        Ok(ApiKey { header, env })
    }

    /// Whether it came from the router's environment (`{ env = "NAME" }`).
    pub fn is_from_env(&self) -> bool {
        self.env.is_some()
    }
}

impl std::fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.env {
            Some(name) => write!(f, "ApiKey(from ${name})"),
            None => f.write_str("ApiKey(<redacted>)"),
        }
    }
}

impl<'de> serde::Deserialize<'de> for ApiKey {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        #[derive(serde::Deserialize)]
        #[serde(untagged, deny_unknown_fields)]
        enum Source {
            Literal(String),
            Env { env: String },
        }
        let key = match Source::deserialize(deserializer)? {
            Source::Literal(key) => ApiKey::new(&key),
            Source::Env { env } => match std::env::var(&env) {
                Ok(key) => ApiKey::with_source(&key, Some(env)),
                Err(_) => Err(format!("the environment variable {env} is not set")),
            },
        };
        key.map_err(serde::de::Error::custom)
    }
}

impl EndpointSpec {
    /// An MLC endpoint at `url` with what a file's `[[endpoints]]` entry gives when it says
    /// nothing else: any role, one GPU, no key, no bootstrap port, no KV events. Set the rest
    /// with struct update syntax (`EndpointSpec { role, ..EndpointSpec::new(url) }`).
    pub fn new(url: impl Into<String>) -> Self {
        EndpointSpec {
            url: url.into(),
            role: Role::default(),
            num_gpus: 1,
            device_rank: None,
            api_key: None,
            protocol: Protocol::default(),
            models: None,
            bootstrap_port: None,
            kv_events: None,
            kv_events_replay: None,
            kv_events_topic: None,
            kv_events_dp_size: None,
            ca_file: None,
            client_cert: None,
            client_key: None,
        }
    }

    /// The TLS files it names itself.
    pub fn tls_files(&self) -> TlsFiles {
        TlsFiles {
            ca_file: self.ca_file.clone(),
            client_cert: self.client_cert.clone(),
            client_key: self.client_key.clone(),
        }
    }

    /// An `http(s)://HOST[:PORT]` URL and at least one GPU; the reason otherwise.
    pub fn check(&self) -> Result<(), String> {
        let url: http::Uri = self
            .url
            .parse()
            .map_err(|e: http::uri::InvalidUri| e.to_string())?;
        let https = match url.scheme_str() {
            Some("http") => false,
            Some("https") => true,
            _ => return Err("expected http://HOST:PORT or https://HOST:PORT".into()),
        };
        if url.host().is_none() {
            return Err("expected http://HOST:PORT or https://HOST:PORT".into());
        }
        let tls = self.tls_files();
        // Refused rather than ignored: a plain endpoint given TLS files is a mistake in one
        // or the other.
        if !https && !tls.is_empty() {
            return Err("ca_file, client_cert and client_key are for https:// endpoints".into());
        }
        tls.check()?;
        if self.num_gpus == 0 {
            return Err("num_gpus must be at least 1".into());
        }
        if self.models.as_ref().is_some_and(Vec::is_empty) {
            return Err(
                "models = [] pins no model: leave it out to serve what its /v1/models lists".into(),
            );
        }
        let sglang_prefill = self.protocol == Protocol::Sglang && self.role == Role::Prefill;
        match (sglang_prefill, self.bootstrap_port) {
            (true, None) => Err(
                "an sglang prefill endpoint needs bootstrap_port (its --disaggregation-bootstrap-port)"
                    .into(),
            ),
            (true, Some(0)) => Err("bootstrap_port must be 1..65535".into()),
            (false, Some(_)) => Err(format!(
                "bootstrap_port is for sglang prefill endpoints, not {} {}",
                self.protocol,
                match self.role {
                    Role::Any => "endpoints without a role",
                    Role::Prefill => "prefill endpoints",
                    Role::Decode => "decode endpoints",
                }
            )),
            _ => Ok(()),
        }?;
        self.check_kv_events()
    }

    /// `kv_events` and `kv_events_replay` are `tcp://HOST:PORT`, and so is each DP rank's
    /// (the port plus the rank); a replay socket, a topic or ranks without an event socket
    /// would never be used.
    fn check_kv_events(&self) -> Result<(), String> {
        let Some(events) = &self.kv_events else {
            return match (
                &self.kv_events_replay,
                &self.kv_events_topic,
                self.kv_events_dp_size,
            ) {
                (None, None, None) => Ok(()),
                (Some(_), _, _) => {
                    Err("kv_events_replay needs kv_events (the event socket)".into())
                }
                (None, Some(_), _) => {
                    Err("kv_events_topic needs kv_events (the event socket)".into())
                }
                (None, None, Some(_)) => {
                    Err("kv_events_dp_size needs kv_events (the event socket)".into())
                }
            };
        };
        let last_rank = match self.kv_events_dp_size {
            None => 0,
            Some(size @ 1..=MAX_DP_SIZE) => size - 1,
            Some(size) => {
                return Err(format!("kv_events_dp_size {size} is not 1..{MAX_DP_SIZE}"));
            }
        };
        check_tcp_url("kv_events", events, last_rank)?;
        match &self.kv_events_replay {
            Some(replay) => check_tcp_url("kv_events_replay", replay, last_rank),
            None => Ok(()),
        }
    }

    /// How many data-parallel ranks publish KV events (1 unless `kv_events_dp_size` says).
    pub fn kv_events_dp_size(&self) -> u32 {
        self.kv_events_dp_size.unwrap_or(1)
    }

    /// Where the engine publishes its KV events, if it does.
    pub fn kv_events_source(&self) -> Option<KvEventsSource> {
        let mut source = KvEventsSource::new(self.kv_events.clone()?);
        if let Some(replay) = &self.kv_events_replay {
            source = source.with_replay(replay.clone());
        }
        if let Some(topic) = &self.kv_events_topic {
            source = source.with_topic(topic.clone());
        }
        Some(source)
    }

    /// The host decode engines reach this one's bootstrap server at, and its port, for an
    /// SGLang prefill endpoint.
    pub fn bootstrap(&self) -> Option<(String, u16)> {
        let port = self.bootstrap_port?;
        let url: http::Uri = self.url.parse().ok()?;
        Some((url.host()?.trim_matches(['[', ']']).to_owned(), port))
    }

    fn base_url(&self) -> String {
        self.url.trim_end_matches('/').to_owned()
    }
}

/// Who put an endpoint in the list: reconciling the config file, or a discovery source, only
/// ever removes what it added.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Owner {
    /// The command line or the `--config` file.
    Static,
    /// `POST /admin/endpoints`.
    Admin,
    /// Kubernetes discovery, for the pod with this uid.
    Pod(Arc<str>),
}

impl Owner {
    pub fn is_pod(&self) -> bool {
        matches!(self, Owner::Pod(_))
    }
}

/// `static`, `admin` or `k8s:<pod uid>`, as `/admin/endpoints` shows it.
impl Display for Owner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Owner::Static => f.write_str("static"),
            Owner::Admin => f.write_str("admin"),
            Owner::Pod(uid) => write!(f, "k8s:{uid}"),
        }
    }
}

impl serde::Serialize for Owner {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// An endpoint still in the list (serving or draining), with who put it there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnedEndpoint {
    pub id: u32,
    pub owner: Owner,
    pub spec: EndpointSpec,
    pub draining: bool,
}

/// Where an endpoint is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Serving,
    /// No new request; those in flight finish.
    Draining,
    /// Gone; its id is never reused.
    Removed,
}

/// The live state of one endpoint.
#[derive(Debug)]
pub(crate) struct EndpointState {
    id: u32,
    /// The base URL and credentials every call to the engine takes.
    upstream: Upstream,
    api_key: Option<ApiKey>,
    /// The TLS files its spec named itself (the cluster's defaults aside).
    tls: TlsFiles,
    protocol: Protocol,
    /// An SGLang prefill endpoint's bootstrap host and port.
    bootstrap: Option<(Arc<str>, u16)>,
    role: Role,
    device_rank: u32,
    /// Whether `device_rank` was given rather than summed.
    explicit_rank: bool,
    num_gpus: u32,
    owner: Owner,
    phase: Mutex<Phase>,
    /// The readiness probe answers (and no call failed to connect since).
    ready: AtomicBool,
    in_flight: AtomicU32,
    /// Woken when `in_flight` drops to zero, for `remove_when_idle`.
    idle: tokio::sync::Notify,
    /// Prompt tokens sent to the engine that it has not prefilled yet ([`Prefilling`]).
    pending_prefill: AtomicU32,
    /// The load the engine last reported (its `/metrics`).
    load: Mutex<EngineLoad>,
    /// `switchyard_contract::address_hash` of `url`: the key every router replica agrees on.
    address_hash: u64,
    outlier: Mutex<Outlier>,
    /// The models it serves: those its `/v1/models` last listed, or the pinned ones.
    models: RwLock<Vec<ModelCard>>,
    /// `models` was pinned by the operator: the probe's list does not replace it.
    pinned: bool,
    /// Why its last readiness probe failed, if it did.
    probe_error: Mutex<Option<ProbeError>>,
    /// Where its engine publishes KV events, and the subscriber reading them.
    kv: EndpointKv,
}

impl EndpointState {
    fn new(
        id: u32,
        spec: &EndpointSpec,
        upstream: Upstream,
        device_rank: u32,
        owner: Owner,
    ) -> Self {
        EndpointState {
            id,
            address_hash: switchyard_contract::address_hash(upstream.base()),
            upstream,
            api_key: spec.api_key.clone(),
            tls: spec.tls_files(),
            protocol: spec.protocol,
            bootstrap: spec.bootstrap().map(|(host, port)| (host.into(), port)),
            role: spec.role,
            device_rank,
            explicit_rank: spec.device_rank.is_some(),
            num_gpus: spec.num_gpus,
            owner,
            phase: Mutex::new(Phase::Serving),
            ready: AtomicBool::new(false),
            in_flight: AtomicU32::new(0),
            idle: tokio::sync::Notify::new(),
            pending_prefill: AtomicU32::new(0),
            load: Mutex::new(EngineLoad::default()),
            outlier: Mutex::new(Outlier::default()),
            models: RwLock::new(
                spec.models
                    .iter()
                    .flatten()
                    .map(|id| ModelCard::base(id.as_str()))
                    .collect(),
            ),
            pinned: spec.models.is_some(),
            probe_error: Mutex::new(None),
            kv: EndpointKv::new(spec.kv_events_source(), spec.kv_events_dp_size),
        }
    }

    fn url(&self) -> &str {
        self.upstream.base()
    }

    fn phase(&self) -> Phase {
        *self.phase.lock()
    }

    pub(crate) fn is_removed(&self) -> bool {
        self.phase() == Phase::Removed
    }

    fn health(&self, now: Instant) -> Health {
        match self.phase() {
            Phase::Removed => Health::Removed,
            Phase::Draining => Health::Draining,
            Phase::Serving if self.outlier.lock().is_ejected(now) => Health::Ejected,
            Phase::Serving if self.ready.load(Ordering::Acquire) => Health::Healthy,
            Phase::Serving => Health::NotReady,
        }
    }
}

/// Every endpoint the router routes to, by id.
#[derive(Debug)]
pub struct Cluster {
    endpoints: RwLock<Vec<Arc<EndpointState>>>,
    outlier: OutlierConfig,
    /// Healthy endpoints the router needs to call itself ready.
    min_healthy: usize,
    /// False until endpoint discovery has listed its source once: a router that has not yet
    /// seen every pod must not call itself ready on the first one.
    discovered: AtomicBool,
    /// The endpoints' KV caches, from their events.
    kv: KvCache,
    /// When an endpoint has no room for more; `None`: never judged (flow control off).
    saturation: Option<SaturationConfig>,
    /// Woken whenever an endpoint turns healthy or discovery syncs: readiness may have come.
    readiness_changed: tokio::sync::Notify,
    /// The TLS files of `https://` endpoints that name none of their own (the top-level
    /// `engine_ca_file`, `engine_client_cert`, `engine_client_key`).
    engine_tls: TlsFiles,
    /// Which endpoints serve which model, rebuilt when a list changes.
    serving: RwLock<ModelIndex>,
}

/// What `/health` says: whether the router can serve, and which endpoints are down.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Readiness {
    pub ready: bool,
    /// Endpoint discovery (if any) has listed its source once.
    pub discovered: bool,
    pub healthy: usize,
    pub min_healthy: usize,
    pub down: Vec<Down>,
}

/// An endpoint plans may not name, and why (removed ones are not listed).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Down {
    pub id: u32,
    pub health: Health,
}

/// The row `/admin/endpoints` shows for an endpoint.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct EndpointStatus {
    pub id: u32,
    pub url: String,
    pub protocol: Protocol,
    /// An SGLang prefill endpoint's bootstrap port.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bootstrap_port: Option<u16>,
    pub role: Role,
    pub device_rank: u32,
    pub num_gpus: u32,
    pub owner: Owner,
    pub healthy: bool,
    pub health: Health,
    pub in_flight: u32,
    /// Prompt tokens sent to the endpoint that it has not prefilled yet.
    pub pending_prefill: u32,
    pub kv_usage: Option<f32>,
    pub running: Option<u32>,
    pub waiting: Option<u32>,
    pub outlier: OutlierView,
    /// Its KV event subscriber's state, when its engine publishes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_events: Option<KvEventsStatus>,
    /// Why its last readiness probe failed (a TLS failure is named here).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub probe_error: Option<ProbeError>,
    /// The models it serves: pinned, or its `/v1/models` as last read (adapters with their
    /// `parent`).
    pub models: Vec<ModelCard>,
}

/// Why a readiness probe failed: the failure's kind (e.g. `connect`, `timeout`,
/// `tls_certificate_not_trusted`, `tls_client_certificate_required`) and its message.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ProbeError {
    pub kind: &'static str,
    pub message: String,
}

impl From<&CallError> for ProbeError {
    fn from(error: &CallError) -> ProbeError {
        ProbeError {
            kind: error.kind(),
            message: error.to_string(),
        }
    }
}

/// Why a change to the live list was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EndpointError {
    #[error("endpoint {0} does not exist")]
    Unknown(u32),
    #[error("endpoint {0} was removed")]
    Removed(u32),
    #[error("endpoint {id} has {in_flight} legs in flight: drain it and wait until none are left")]
    Busy { id: u32, in_flight: u32 },
    #[error("{url} is already endpoint {id}")]
    Duplicate { url: String, id: u32 },
    #[error("{url:?}: {reason}")]
    Invalid { url: String, reason: String },
}

impl Cluster {
    /// Endpoints start unhealthy until a probe (or [`Cluster::set_health`]) says otherwise.
    pub fn new(specs: Vec<EndpointSpec>, outlier: OutlierConfig) -> Self {
        Cluster::with_engine_tls(specs, outlier, TlsFiles::default())
    }

    /// [`Cluster::new`], `https://` endpoints that name no TLS files of their own (those
    /// added later included) taking `engine_tls`'.
    pub fn with_engine_tls(
        specs: Vec<EndpointSpec>,
        outlier: OutlierConfig,
        engine_tls: TlsFiles,
    ) -> Self {
        let cluster = Cluster {
            endpoints: RwLock::new(Vec::new()),
            outlier,
            min_healthy: 1,
            discovered: AtomicBool::new(true),
            kv: KvCache::new(SubscriberConfig::default()),
            saturation: None,
            readiness_changed: tokio::sync::Notify::new(),
            engine_tls,
            serving: RwLock::new(ModelIndex::default()),
        };
        for spec in &specs {
            // Checked with the configuration: unusable TLS files fail its calls, named by
            // its probe.
            cluster.push(spec, cluster.upstream_for(spec), Owner::Static);
        }
        cluster
    }

    /// Ready once at least `n` endpoints are healthy (default 1).
    pub fn with_min_healthy(mut self, n: usize) -> Self {
        self.min_healthy = n;
        self
    }

    /// How endpoints' KV event subscribers run (`kv_events_stale_after`).
    pub fn with_kv_events(mut self, config: SubscriberConfig) -> Self {
        self.kv = KvCache::new(config);
        self
    }

    /// Judge endpoints' saturation by `config` (see [`SaturationConfig`]).
    pub fn with_saturation(mut self, config: Option<SaturationConfig>) -> Self {
        self.saturation = config;
        self
    }

    /// Not ready until [`Cluster::discovery_synced`]: endpoints come from a discovery source.
    pub fn awaiting_discovery(self) -> Self {
        self.discovered.store(false, Ordering::Release);
        self
    }

    /// Discovery has listed its source once (and added what it found).
    pub fn discovery_synced(&self) {
        if !self.discovered.swap(true, Ordering::AcqRel) {
            tracing::info!("endpoint discovery synced");
            self.readiness_changed.notify_waiters();
        }
    }

    /// Endpoints ever listed, removed ones included: ids are `0..len()`.
    pub fn len(&self) -> usize {
        self.endpoints.read().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Add an endpoint at the end of the list; its id and device rank. It starts unhealthy: a
    /// probe (see [`spawn_probe`]) admits it.
    pub fn add(&self, spec: &EndpointSpec, owner: Owner) -> Result<u32, EndpointError> {
        spec.check().map_err(|reason| EndpointError::Invalid {
            url: spec.url.clone(),
            reason,
        })?;
        let url = spec.base_url();
        if let Some(e) = self
            .endpoints
            .read()
            .iter()
            .find(|e| !e.is_removed() && e.url() == url)
        {
            return Err(EndpointError::Duplicate { url, id: e.id });
        }
        let upstream = self.upstream_for(spec);
        if let Some(e) = upstream.tls_error() {
            return Err(EndpointError::Invalid {
                url: spec.url.clone(),
                reason: e.to_string(),
            });
        }
        let id = self.push(spec, upstream, owner.clone());
        tracing::info!(endpoint = id, %url, %owner, "endpoint added");
        Ok(id)
    }

    /// What calls to `spec`'s engine take: its URL, its key, and its TLS files or the
    /// cluster's.
    fn upstream_for(&self, spec: &EndpointSpec) -> Upstream {
        Upstream::with_tls(
            spec.base_url().into(),
            spec.api_key.as_ref().map(|k| k.header.clone()),
            &spec.tls_files().or(&self.engine_tls),
        )
    }

    fn push(&self, spec: &EndpointSpec, upstream: Upstream, owner: Owner) -> u32 {
        let mut endpoints = self.endpoints.write();
        let id = endpoints.len() as u32;
        // MLC's rule: a device rank is the sum of the GPUs of every endpoint before it.
        let device_rank = spec.device_rank.unwrap_or_else(|| {
            endpoints
                .last()
                .map_or(0, |e| e.device_rank.saturating_add(e.num_gpus))
        });
        endpoints.push(Arc::new(EndpointState::new(
            id,
            spec,
            upstream,
            device_rank,
            owner,
        )));
        if spec.models.is_some() {
            *self.serving.write() = ModelIndex::build(&endpoints);
        }
        id
    }

    /// Take endpoint `id` out of new plans; what is in flight on it finishes.
    pub fn drain(&self, id: u32) -> Result<(), EndpointError> {
        let e = self.endpoint(id).ok_or(EndpointError::Unknown(id))?;
        let mut phase = e.phase.lock();
        match *phase {
            Phase::Removed => Err(EndpointError::Removed(id)),
            Phase::Draining => Ok(()),
            Phase::Serving => {
                *phase = Phase::Draining;
                tracing::info!(endpoint = id, url = e.url(), "endpoint draining");
                Ok(())
            }
        }
    }

    /// Remove endpoint `id`: refused while legs are in flight on it, which draining it first
    /// lets finish. Its id stays taken.
    pub fn remove(&self, id: u32) -> Result<(), EndpointError> {
        let e = self.endpoint(id).ok_or(EndpointError::Unknown(id))?;
        let mut phase = e.phase.lock();
        if *phase == Phase::Removed {
            return Err(EndpointError::Removed(id));
        }
        let in_flight = e.in_flight.load(Ordering::Acquire);
        if in_flight > 0 {
            return Err(EndpointError::Busy { id, in_flight });
        }
        *phase = Phase::Removed;
        drop(phase);
        self.reindex_models();
        self.kv.unsubscribe(id, &e.kv);
        tracing::info!(endpoint = id, url = e.url(), "endpoint removed");
        Ok(())
    }

    /// Remove a draining endpoint once nothing is in flight on it (every request ends by its
    /// deadline, so this ends too).
    pub async fn remove_when_idle(&self, id: u32) {
        let Some(e) = self.endpoint(id) else { return };
        loop {
            // Registered before the check, so a last leg ending in between still wakes us.
            let idle = e.idle.notified();
            tokio::pin!(idle);
            idle.as_mut().enable();
            match self.remove(id) {
                Err(EndpointError::Busy { .. }) => idle.await,
                _ => return,
            }
        }
    }

    /// Ids and specs of the endpoints `owner` put in the list and that are not removed.
    pub fn owned_by(&self, owner: &Owner) -> Vec<(u32, EndpointSpec)> {
        self.owned_where(|o| o == owner)
            .into_iter()
            .map(|e| (e.id, e.spec))
            .collect()
    }

    /// The endpoints not removed whose owner `keep` accepts, serving or draining.
    pub fn owned_where(&self, keep: impl Fn(&Owner) -> bool) -> Vec<OwnedEndpoint> {
        self.endpoints
            .read()
            .iter()
            .filter(|e| keep(&e.owner))
            .filter_map(|e| {
                let draining = match e.phase() {
                    Phase::Removed => return None,
                    Phase::Draining => true,
                    Phase::Serving => false,
                };
                Some(OwnedEndpoint {
                    id: e.id,
                    owner: e.owner.clone(),
                    spec: EndpointSpec {
                        url: e.url().to_owned(),
                        role: e.role,
                        num_gpus: e.num_gpus,
                        device_rank: e.explicit_rank.then_some(e.device_rank),
                        api_key: e.api_key.clone(),
                        protocol: e.protocol,
                        bootstrap_port: e.bootstrap.as_ref().map(|(_, port)| *port),
                        kv_events: e.kv.source.as_ref().map(|s| s.events.clone()),
                        kv_events_replay: e.kv.source.as_ref().and_then(|s| s.replay.clone()),
                        kv_events_topic: e
                            .kv
                            .source
                            .as_ref()
                            .map(|s| s.topic.clone())
                            .filter(|topic| !topic.is_empty()),
                        kv_events_dp_size: e.kv.dp_size,
                        ca_file: e.tls.ca_file.clone(),
                        client_cert: e.tls.client_cert.clone(),
                        client_key: e.tls.client_key.clone(),
                        models: e
                            .pinned
                            .then(|| e.models.read().iter().map(|m| m.id.clone()).collect()),
                    },
                    draining,
                })
            })
            .collect()
    }

    /// What a policy sees, ordered by id: each endpoint's health, with a saturated one shown
    /// draining while another of its role has room.
    pub fn snapshot(&self) -> Vec<EndpointSnapshot> {
        let mut snapshot = self.engines_snapshot();
        if let Some(saturation) = &self.saturation {
            saturation.hide_saturated(&mut snapshot);
        }
        snapshot
    }

    /// Per model (each endpoint counts for every model its `/v1/models` lists) and role, what
    /// an autoscaler reads of the healthy endpoints; empty when saturation is not judged.
    pub fn demand(&self) -> Vec<(String, Role, Demand)> {
        let Some(saturation) = &self.saturation else {
            return Vec::new();
        };
        let snapshot = self.engines_snapshot();
        let endpoints = self.endpoints.read();
        // A group is kept with no endpoint ready: its hint is then 0.
        let mut groups: Vec<(String, Role, Vec<&EndpointSnapshot>)> = Vec::new();
        for (e, seen) in endpoints.iter().zip(&snapshot) {
            if e.is_removed() {
                continue;
            }
            for ModelCard { id: model, .. } in e.models.read().iter() {
                let at = match groups
                    .iter()
                    .position(|(m, r, _)| m == model && *r == e.role)
                {
                    Some(at) => at,
                    None => {
                        groups.push((model.clone(), e.role, Vec::new()));
                        groups.len() - 1
                    }
                };
                if seen.health.is_healthy() {
                    groups[at].2.push(seen);
                }
            }
        }
        groups
            .into_iter()
            .map(|(model, role, ready)| (model, role, saturation.demand(ready)))
            .collect()
    }

    /// Each endpoint as it is, saturated or not.
    fn engines_snapshot(&self) -> Vec<EndpointSnapshot> {
        let now = Instant::now();
        self.endpoints
            .read()
            .iter()
            .map(|e| {
                let load = *e.load.lock();
                EndpointSnapshot {
                    id: e.id,
                    protocol: e.protocol,
                    role: e.role,
                    device_rank: e.device_rank,
                    health: e.health(now),
                    in_flight: e.in_flight.load(Ordering::Acquire),
                    kv_usage: load.kv_usage,
                    running: load.running,
                    waiting: load.waiting,
                    address_hash: e.address_hash,
                    // Per request: the router fills it from the KV index for each prompt.
                    cached_prefix: None,
                    pending_prefill: e.pending_prefill.load(Ordering::Acquire),
                }
            })
            .collect()
    }

    /// What a policy sees for a request for `model` whose prompt (the continuation's, on
    /// later attempts) is `prompt`: [`Cluster::snapshot`] with the endpoints that do not serve
    /// `model` shown as tombstones (see `models`) and saturation judged among those that do,
    /// and each endpoint's cached prefix filled in where its KV events are trusted. No lookup
    /// when no endpoint publishes events. An endpoint with several DP ranks shows what the
    /// rank holding the least holds: nothing pins the request to a rank
    /// ([`Cluster::snapshot_pinned`] does).
    pub fn snapshot_for(&self, model: &str, prompt: &[u32]) -> Vec<EndpointSnapshot> {
        self.snapshot_with_kv(model, prompt, false).0
    }

    /// [`Cluster::snapshot_for`] for a request the router sends itself: an endpoint with
    /// several DP ranks shows the most any trusted rank holds, and the pins name the rank the
    /// request must then be sent to (`X-data-parallel-rank`).
    pub fn snapshot_pinned(
        &self,
        model: &str,
        prompt: &[u32],
    ) -> (Vec<EndpointSnapshot>, RankPins) {
        self.snapshot_with_kv(model, prompt, true)
    }

    fn snapshot_with_kv(
        &self,
        model: &str,
        prompt: &[u32],
        pinning: bool,
    ) -> (Vec<EndpointSnapshot>, RankPins) {
        let mut snapshot = self.engines_snapshot();
        self.serving.read().hide_others(model, &mut snapshot);
        // After the model's filter: an endpoint is saturated while another serving the same
        // model has room.
        if let Some(saturation) = &self.saturation {
            saturation.hide_saturated(&mut snapshot);
        }
        let mut pins = RankPins::default();
        if self.kv.is_active() {
            let handles: Vec<_> = self
                .endpoints
                .read()
                .iter()
                .map(|e| e.kv.handles())
                .collect();
            pins = self
                .kv
                .fill(&mut snapshot, &handles, prompt, Instant::now(), pinning);
        }
        (snapshot, pins)
    }

    /// Whether an endpoint publishes KV events, so that a snapshot's `cached-prefix` needs the
    /// request's prompt ids (the router then tokenizes every prompt it plans).
    pub fn indexes_kv(&self) -> bool {
        self.kv.is_active()
    }

    /// `endpoints` were sent a prompt of `prompt_len` tokens (an attempt's plan started),
    /// pinned to the DP ranks `pins` names: from then on their engines must publish what they
    /// stored.
    pub fn note_served(
        &self,
        endpoints: impl IntoIterator<Item = u32>,
        prompt_len: usize,
        pins: &RankPins,
    ) {
        if !self.kv.is_active() {
            return;
        }
        let now = Instant::now();
        for id in endpoints {
            if let Some(handles) = self.endpoint(id).and_then(|e| e.kv.handles()) {
                self.kv
                    .note_served(&handles, pins.rank(id), prompt_len, now);
            }
        }
    }

    /// Whether `predicted`, endpoint `id`'s cached prefix of an attempt's `prompt_len`-token
    /// prompt, is what its engine then reported having cached (`cached`, rounded down to its
    /// block size; at most the whole blocks before the prompt's last token).
    pub fn kv_prediction_hit(&self, id: u32, predicted: u32, cached: u32, prompt_len: u32) -> bool {
        self.kv.prediction_hit(id, predicted, cached, prompt_len)
    }

    /// Starts endpoint `id`'s KV event subscriber when its engine publishes and none runs (on
    /// the current Tokio runtime): at startup for every endpoint, then for each one added.
    pub fn subscribe_kv_events(&self, id: u32) {
        if let Some(e) = self.endpoint(id)
            && !e.is_removed()
        {
            self.kv.subscribe(id, &e.kv);
        }
    }

    /// Endpoint `id`'s engine may have restarted (a failed probe, a new process start time):
    /// its KV index is cleared and rebuilt from what the engine publishes next.
    pub fn resync_kv_events(&self, id: u32, reason: ResyncReason) {
        if let Some(e) = self.endpoint(id) {
            e.kv.resync(reason);
        }
    }

    /// The heap the KV index holds (every endpoint's blocks).
    pub fn kv_index_bytes(&self) -> usize {
        self.kv.heap_bytes()
    }

    /// What `/admin/endpoints` shows.
    pub fn status(&self) -> Vec<EndpointStatus> {
        let now = Instant::now();
        self.endpoints
            .read()
            .iter()
            .map(|e| {
                let health = e.health(now);
                let load = *e.load.lock();
                EndpointStatus {
                    id: e.id,
                    url: e.url().to_owned(),
                    protocol: e.protocol,
                    bootstrap_port: e.bootstrap.as_ref().map(|(_, port)| *port),
                    role: e.role,
                    device_rank: e.device_rank,
                    num_gpus: e.num_gpus,
                    owner: e.owner.clone(),
                    healthy: health.is_healthy(),
                    health,
                    in_flight: e.in_flight.load(Ordering::Acquire),
                    pending_prefill: e.pending_prefill.load(Ordering::Acquire),
                    kv_usage: load.kv_usage,
                    running: load.running,
                    waiting: load.waiting,
                    outlier: e.outlier.lock().view(now),
                    kv_events: e
                        .kv
                        .source
                        .as_ref()
                        .and_then(|source| self.kv.status(source, &e.kv.handles()?, now)),
                    probe_error: e.probe_error.lock().clone(),
                    models: e.models.read().clone(),
                }
            })
            .collect()
    }

    /// A call to the endpoint succeeded.
    pub fn record_success(&self, id: u32) {
        if let Some(e) = self.endpoint(id) {
            e.outlier.lock().success(Instant::now());
        }
    }

    /// A call to the endpoint failed of the endpoint's own making (never a client's 4xx);
    /// enough of these in a row eject it.
    pub fn record_failure(&self, id: u32, why: &dyn Display) {
        let Some(e) = self.endpoint(id) else { return };
        let ejected = e
            .outlier
            .lock()
            .failure(&self.outlier, Instant::now(), why.to_string());
        if let Some(ejected) = ejected {
            tracing::warn!(
                endpoint = id,
                url = e.url(),
                failures = ejected.failures,
                ejected_for = ?ejected.duration,
                last = %why,
                "endpoint ejected"
            );
        }
    }

    /// The endpoint's base URL; `None` for an id out of range.
    pub fn url(&self, id: u32) -> Option<Arc<str>> {
        self.endpoint(id).map(|e| e.upstream.base_url())
    }

    /// The endpoint's `host:port`, as a gateway or an EPP's `x-prefiller-host-port` names it:
    /// its URL's authority, with the scheme's port when the URL names none.
    pub fn address(&self, id: u32) -> Option<String> {
        let url: http::Uri = self.url(id)?.parse().ok()?;
        let authority = url.authority()?;
        let port = authority.port_u16().unwrap_or(match url.scheme_str() {
            Some("https") => 443,
            _ => 80,
        });
        Some(format!("{}:{port}", authority.host()))
    }

    /// What a call to the endpoint takes (URL and credentials); `None` for an id out of range.
    pub fn upstream(&self, id: u32) -> Option<Upstream> {
        self.endpoint(id).map(|e| e.upstream.clone())
    }

    pub fn device_rank(&self, id: u32) -> Option<u32> {
        self.endpoint(id).map(|e| e.device_rank)
    }

    pub fn protocol(&self, id: u32) -> Option<Protocol> {
        self.endpoint(id).map(|e| e.protocol)
    }

    /// An SGLang prefill endpoint's bootstrap host and port.
    pub fn bootstrap(&self, id: u32) -> Option<(Arc<str>, u16)> {
        self.endpoint(id).and_then(|e| e.bootstrap.clone())
    }

    /// Count one leg in flight on `id` until the guard drops. `None` for an id out of range.
    pub fn in_flight(&self, id: u32) -> Option<InFlight> {
        self.endpoint(id).map(InFlight::new)
    }

    /// Count `tokens` prompt tokens sent to `id` and not prefilled yet, until the guard is
    /// done or dropped. `None` for an id out of range.
    pub fn prefilling(&self, id: u32, tokens: u32) -> Option<Prefilling> {
        self.endpoint(id).map(|e| Prefilling::new(e, tokens))
    }

    /// A call to the endpoint failed in a way that says it is down; the probe brings it back.
    pub fn mark_unhealthy(&self, id: u32) {
        if let Some(e) = self.endpoint(id)
            && e.ready.swap(false, Ordering::AcqRel)
        {
            tracing::warn!(endpoint = id, url = e.url(), "endpoint marked unhealthy");
        }
    }

    pub fn set_health(&self, id: u32, healthy: bool) {
        if let Some(e) = self.endpoint(id) {
            let was = e.ready.swap(healthy, Ordering::AcqRel);
            // Every healthy probe, not only a change: an ejection that ran out makes the router
            // ready without any endpoint changing its readiness.
            if healthy {
                self.readiness_changed.notify_waiters();
            }
            if was != healthy {
                tracing::info!(
                    endpoint = id,
                    url = e.url(),
                    healthy,
                    "endpoint health changed"
                );
            }
        }
    }

    /// What the endpoint's last readiness probe failed with (`None`: it answered). A new kind
    /// of failure is logged once, so a TLS misconfiguration is named in the log as it is on
    /// `/admin/endpoints`.
    pub fn set_probe_error(&self, id: u32, error: Option<&CallError>) {
        let Some(e) = self.endpoint(id) else { return };
        let error = error.map(ProbeError::from);
        let mut last = e.probe_error.lock();
        let new_kind = error.as_ref().map(|error| error.kind);
        if new_kind.is_some() && new_kind != last.as_ref().map(|last| last.kind) {
            let error = error.as_ref().map_or("", |error| &error.message);
            tracing::warn!(
                endpoint = id,
                url = e.url(),
                error,
                "readiness probe failed"
            );
        }
        *last = error;
    }

    /// The load the endpoint's engine last reported; KV usage is clamped to `[0, 1]`.
    pub fn set_engine_load(&self, id: u32, load: EngineLoad) {
        if let Some(e) = self.endpoint(id) {
            *e.load.lock() = EngineLoad {
                kv_usage: load.kv_usage.map(|u| u.clamp(0.0, 1.0)),
                ..load
            };
        }
    }

    /// The models endpoint `id` lists at `/v1/models`, as its probe last read them; ignored
    /// when its models are pinned. The per-model index is rebuilt only when the list changed.
    pub fn set_models(&self, id: u32, models: Vec<ModelCard>) {
        let Some(e) = self.endpoint(id) else { return };
        if e.pinned || *e.models.read() == models {
            return;
        }
        *e.models.write() = models;
        self.reindex_models();
    }

    /// Locks `endpoints` before `serving`, as every method taking both does.
    fn reindex_models(&self) {
        let endpoints = self.endpoints.read();
        *self.serving.write() = ModelIndex::build(&endpoints);
    }

    /// The models the endpoints serve (listed or pinned), removed ones aside, each once (the
    /// first endpoint's card when two disagree on an adapter's parent).
    pub fn models(&self) -> Vec<ModelCard> {
        let mut models: Vec<ModelCard> = Vec::new();
        for e in self.endpoints.read().iter().filter(|e| !e.is_removed()) {
            for card in e.models.read().iter() {
                if !models.iter().any(|m| m.id == card.id) {
                    models.push(card.clone());
                }
            }
        }
        models
    }

    /// Whether any endpoint still in the list serves `model` (lists or pins it).
    pub fn serves(&self, model: &str) -> bool {
        self.serving.read().serving(model).is_some()
    }

    /// How many healthy endpoints serve `model`; `None` when no endpoint lists or pins it.
    pub fn healthy_serving(&self, model: &str) -> Option<usize> {
        let endpoints = self.endpoints.read();
        let serving = self.serving.read();
        let ids = serving.serving(model)?;
        let now = Instant::now();
        Some(
            ids.iter()
                .filter_map(|&id| endpoints.get(id as usize))
                .filter(|e| e.health(now).is_healthy())
                .count(),
        )
    }

    /// The base model `model` runs on when an engine lists it as a LoRA adapter.
    pub fn base_model(&self, model: &str) -> Option<String> {
        self.serving.read().parent(model).map(str::to_owned)
    }

    /// Whether enough endpoints are healthy to serve, and which are not.
    pub fn readiness(&self) -> Readiness {
        let now = Instant::now();
        let mut healthy = 0;
        let mut down = Vec::new();
        for e in self.endpoints.read().iter() {
            match e.health(now) {
                Health::Healthy => healthy += 1,
                Health::Removed => {}
                health => down.push(Down { id: e.id, health }),
            }
        }
        let discovered = self.discovered.load(Ordering::Acquire);
        Readiness {
            ready: discovered && healthy >= self.min_healthy,
            discovered,
            healthy,
            min_healthy: self.min_healthy,
            down,
        }
    }

    /// At least `min_healthy` endpoints are healthy now.
    pub fn is_ready(&self) -> bool {
        self.readiness().ready
    }

    /// Returns once the router is ready: at once if it is, else when an endpoint turning
    /// healthy (or discovery syncing) makes it so. Woken by those events, never by a timer.
    pub async fn until_ready(&self) {
        loop {
            // Registered before the check, so an endpoint turning healthy in between still
            // wakes us.
            let changed = self.readiness_changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if self.is_ready() {
                return;
            }
            changed.await;
        }
    }

    pub(crate) fn endpoint(&self, id: u32) -> Option<Arc<EndpointState>> {
        self.endpoints.read().get(id as usize).cloned()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn spec(url: &str, num_gpus: u32) -> EndpointSpec {
        EndpointSpec {
            num_gpus,
            ..EndpointSpec::new(url)
        }
    }

    #[test]
    fn device_ranks_are_prefix_sums_of_gpus() {
        let cluster = Cluster::new(
            vec![
                spec("http://a/", 4),
                spec("http://b", 2),
                spec("http://c", 1),
            ],
            OutlierConfig::default(),
        );
        let ranks: Vec<_> = cluster.snapshot().iter().map(|e| e.device_rank).collect();
        assert_eq!(ranks, [0, 4, 6]);
        assert_eq!(cluster.url(0).as_deref(), Some("http://a"));
        assert_eq!(cluster.url(3), None);
    }

    #[test]
    fn in_flight_guards_count_until_dropped() {
        let cluster = Cluster::new(
            vec![spec("http://a", 1), spec("http://b", 1)],
            OutlierConfig::default(),
        );
        let a = cluster.in_flight(1).expect("id in range");
        let b = cluster.in_flight(1).expect("id in range");
        assert_eq!(cluster.snapshot()[1].in_flight, 2);
        drop(a);
        assert_eq!(cluster.snapshot()[1].in_flight, 1);
        drop(b);
        assert_eq!(cluster.snapshot()[1].in_flight, 0);
        assert!(cluster.in_flight(2).is_none());
    }

    #[test]
    fn pending_prefill_is_released_once_by_done_or_drop_whichever_comes_first() {
        let cluster = Cluster::new(
            vec![spec("http://a", 1), spec("http://b", 1)],
            OutlierConfig::default(),
        );
        let pending = |id: usize| {
            let (snapshot, status) = (cluster.snapshot(), cluster.status());
            assert_eq!(snapshot[id].pending_prefill, status[id].pending_prefill);
            snapshot[id].pending_prefill
        };
        let a = cluster.prefilling(1, 8000).expect("id in range");
        let b = cluster.prefilling(1, 500).expect("id in range");
        assert_eq!((pending(0), pending(1)), (0, 8500));
        a.done();
        assert_eq!(pending(1), 500);
        a.done();
        drop(a);
        assert_eq!(pending(1), 500, "done, then dropped: released once");
        // Clones share the count: the first one done or dropped releases it.
        let c = b.clone();
        drop(c);
        assert_eq!(pending(1), 0);
        b.done();
        drop(b);
        assert_eq!(pending(1), 0);
        assert!(cluster.prefilling(2, 1).is_none());
    }

    #[test]
    fn engine_load_is_unknown_until_reported_and_usage_clamped() {
        let cluster = Cluster::new(
            vec![spec("http://a", 1), spec("http://b", 1)],
            OutlierConfig::default(),
        );
        let unknown = (None, None, None);
        let load = |e: &EndpointSnapshot| (e.running, e.waiting, e.kv_usage);
        assert_eq!(load(&cluster.snapshot()[0]), unknown);
        let reported = |kv_usage| EngineLoad {
            running: Some(3),
            waiting: Some(1),
            kv_usage: Some(kv_usage),
        };
        cluster.set_engine_load(0, reported(0.25));
        cluster.set_engine_load(1, reported(1.5));
        let loads: Vec<_> = cluster.snapshot().iter().map(load).collect();
        assert_eq!(
            loads,
            [
                (Some(3), Some(1), Some(0.25)),
                (Some(3), Some(1), Some(1.0))
            ]
        );
        let status = &cluster.status()[0];
        assert_eq!((status.running, status.kv_usage), (Some(3), Some(0.25)));
        cluster.set_engine_load(0, EngineLoad::default());
        assert_eq!(load(&cluster.snapshot()[0]), unknown);
    }

    #[test]
    fn api_keys_come_from_the_file_or_the_environment_and_never_show() {
        let parse = |toml_value: &str| {
            toml::from_str::<EndpointSpec>(&format!(
                "url = \"http://a:1\"\napi_key = {toml_value}\n"
            ))
        };
        let literal = parse("\"sk-123\"").expect("a literal key");
        let key = literal.api_key.expect("a key");
        assert_eq!(key.header, "Bearer sk-123");
        assert!(!key.is_from_env());
        assert!(!format!("{key:?}").contains("sk-123"));
        // PATH is set wherever tests run; its value is not the point.
        let from_env = parse("{ env = \"PATH\" }").expect("a key from the environment");
        assert!(from_env.api_key.expect("a key").is_from_env());
        let unset = parse("{ env = \"SWITCHYARD_NO_SUCH_VARIABLE_SET\" }").unwrap_err();
        assert!(unset.to_string().contains("not set"), "{unset}");
        assert!(parse("\"\"").is_err(), "an empty key");
        assert!(parse("\"a\\nb\"").is_err(), "a key a header cannot carry");
        // What the admin API and SIGHUP reconciliation compare and show: never the key.
        let shown = serde_json::to_string(&parse("\"sk-123\"").expect("a key")).expect("JSON");
        assert!(!shown.contains("sk-"), "{shown}");
    }

    #[tokio::test(start_paused = true)]
    async fn until_ready_wakes_when_an_endpoint_turns_healthy_not_on_a_timer() {
        let cluster = Arc::new(Cluster::new(
            vec![spec("http://a", 1), spec("http://b", 1)],
            OutlierConfig::default(),
        ));
        let waiting = tokio::spawn({
            let cluster = Arc::clone(&cluster);
            async move { cluster.until_ready().await }
        });
        // Hours of paused time: nothing but an event can end the wait.
        tokio::time::sleep(Duration::from_secs(3600)).await;
        assert!(!waiting.is_finished());
        cluster.set_health(1, false);
        tokio::task::yield_now().await;
        assert!(
            !waiting.is_finished(),
            "an endpoint still down wakes nobody"
        );
        cluster.set_health(0, true);
        tokio::time::timeout(Duration::from_millis(1), waiting)
            .await
            .expect("woken by the endpoint turning healthy")
            .expect("the waiter does not panic");
        // Ready already: no wait at all.
        tokio::time::timeout(Duration::ZERO, cluster.until_ready())
            .await
            .expect("ready at once");
    }

    #[test]
    fn saturated_endpoints_are_hidden_from_policies_and_counted_for_autoscalers() {
        let decode = |url: &str| EndpointSpec {
            role: Role::Decode,
            ..spec(url, 1)
        };
        let cluster = Cluster::new(
            vec![decode("http://a"), decode("http://b"), decode("http://c")],
            OutlierConfig::default(),
        )
        .with_saturation(Some(SaturationConfig::default()));
        for id in 0..3 {
            cluster.set_models(id, vec![ModelCard::base("m")]);
        }
        cluster.set_health(0, true);
        cluster.set_health(1, true);
        let load = |waiting| EngineLoad {
            running: Some(8),
            waiting: Some(waiting),
            kv_usage: Some(0.5),
        };
        cluster.set_engine_load(0, load(10));
        cluster.set_engine_load(1, load(1));
        let health = |c: &Cluster| c.snapshot().iter().map(|e| e.health).collect::<Vec<_>>();
        assert_eq!(
            health(&cluster),
            [Health::Draining, Health::Healthy, Health::NotReady]
        );
        assert_eq!(
            cluster.status()[0].health,
            Health::Healthy,
            "the operator sees the truth"
        );
        let [(model, role, demand)] = &cluster.demand()[..] else {
            panic!("one model, one role: {:?}", cluster.demand());
        };
        assert_eq!((model.as_str(), *role), ("m", Role::Decode));
        // Loads 2 (10 of 5 waiting) and 0.53 (KV 0.5 of 0.95): 3.2 endpoints at 0.8.
        assert_eq!((demand.ready, demand.desired_replicas), (2, 4));
        assert!((demand.saturation - (1.0 + 0.5 / 0.95) / 2.0).abs() < 1e-6);
        cluster.set_engine_load(1, load(6));
        assert_eq!(
            health(&cluster),
            [Health::Healthy, Health::Healthy, Health::NotReady],
            "all saturated: all plannable"
        );
        let off = Cluster::new(
            vec![decode("http://a"), decode("http://b")],
            OutlierConfig::default(),
        );
        off.set_health(0, true);
        off.set_health(1, true);
        off.set_engine_load(0, load(10));
        assert_eq!(health(&off), [Health::Healthy, Health::Healthy]);
        assert!(off.demand().is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn remove_when_idle_returns_when_the_last_leg_ends_not_on_a_timer() {
        let cluster = Arc::new(Cluster::new(
            vec![spec("http://a", 1)],
            OutlierConfig::default(),
        ));
        let legs = [cluster.in_flight(0), cluster.in_flight(0)];
        cluster.drain(0).expect("drains");
        let started = Instant::now();
        let removing = tokio::spawn({
            let cluster = Arc::clone(&cluster);
            async move { cluster.remove_when_idle(0).await }
        });
        let [first, second] = legs;
        drop(first);
        tokio::task::yield_now().await;
        assert!(!removing.is_finished(), "a leg is still in flight");
        drop(second);
        removing.await.expect("the removal ends");
        assert_eq!(cluster.remove(0), Err(EndpointError::Removed(0)));
        // The clock is paused and advances only when every task sleeps: no timer was needed.
        assert_eq!(started.elapsed(), std::time::Duration::ZERO);
    }

    #[test]
    fn address_hashes_follow_the_url_not_the_id() {
        let one = Cluster::new(
            vec![spec("http://a", 1), spec("http://b", 1)],
            OutlierConfig::default(),
        );
        let other = Cluster::new(
            vec![spec("http://b", 1), spec("http://a", 1)],
            OutlierConfig::default(),
        );
        let (one, other) = (one.snapshot(), other.snapshot());
        assert_eq!(one[0].address_hash, other[1].address_hash);
        assert_eq!(one[1].address_hash, other[0].address_hash);
        assert_ne!(one[0].address_hash, one[1].address_hash);
    }

    #[test]
    fn ready_with_enough_healthy_endpoints_whichever_they_are() {
        let specs = || {
            vec![
                spec("http://a", 1),
                spec("http://b", 1),
                spec("http://c", 1),
            ]
        };
        let cluster = Cluster::new(specs(), OutlierConfig::default());
        assert!(!cluster.is_ready(), "nothing has answered yet");
        // One of three answers: that is enough by default, the others are reported down.
        cluster.set_health(1, true);
        let readiness = cluster.readiness();
        assert!(readiness.ready);
        assert_eq!(readiness.healthy, 1);
        let down: Vec<_> = readiness.down.iter().map(|d| (d.id, d.health)).collect();
        assert_eq!(down, [(0, Health::NotReady), (2, Health::NotReady)]);
        cluster.mark_unhealthy(1);
        assert!(!cluster.is_ready());
        assert_eq!(cluster.snapshot()[1].health, Health::NotReady);

        let two = Cluster::new(specs(), OutlierConfig::default()).with_min_healthy(2);
        two.set_health(0, true);
        assert!(!two.is_ready());
        two.set_health(2, true);
        assert!(two.is_ready());
    }

    #[test]
    fn a_discovering_cluster_is_not_ready_before_its_first_sync() {
        let cluster =
            Cluster::new(vec![spec("http://a", 1)], OutlierConfig::default()).awaiting_discovery();
        cluster.set_health(0, true);
        let readiness = cluster.readiness();
        assert!(!readiness.ready && !readiness.discovered);
        cluster.discovery_synced();
        assert!(cluster.is_ready());
    }

    #[test]
    fn owners_show_as_text_and_an_explicit_rank_is_kept() {
        let cluster = Cluster::new(vec![spec("http://a", 2)], OutlierConfig::default());
        let pod = Owner::Pod("3f2a".into());
        let ranked = EndpointSpec {
            device_rank: Some(7),
            ..spec("http://b", 1)
        };
        assert_eq!(cluster.add(&ranked, pod.clone()), Ok(1));
        assert_eq!(cluster.device_rank(1), Some(7));
        let owners: Vec<String> = cluster
            .status()
            .iter()
            .map(|e| e.owner.to_string())
            .collect();
        assert_eq!(owners, ["static", "k8s:3f2a"]);
        assert_eq!(
            serde_json::to_value(&cluster.status()[1].owner).expect("JSON"),
            "k8s:3f2a"
        );
        let discovered = cluster.owned_where(Owner::is_pod);
        assert_eq!(discovered.len(), 1);
        assert_eq!(discovered[0].spec, ranked);
        assert!(!discovered[0].draining);
        cluster.drain(1).expect("drains");
        assert!(cluster.owned_where(Owner::is_pod)[0].draining);
    }

    #[tokio::test(start_paused = true)]
    async fn consecutive_failures_eject_until_the_time_is_up_and_successes_reset() {
        let config = OutlierConfig {
            consecutive_failures: 2,
            base_ejection: Duration::from_secs(1),
            max_ejection: Duration::from_secs(10),
        };
        let cluster = Cluster::new(vec![spec("http://a", 1), spec("http://b", 1)], config);
        cluster.set_health(0, true);
        cluster.set_health(1, true);
        cluster.record_failure(0, &"HTTP 500");
        cluster.record_success(0);
        cluster.record_failure(0, &"HTTP 500");
        assert_eq!(cluster.snapshot()[0].health, Health::Healthy);
        cluster.record_failure(0, &"timed out");
        assert_eq!(cluster.snapshot()[0].health, Health::Ejected);
        assert_eq!(cluster.snapshot()[1].health, Health::Healthy);
        let status = &cluster.status()[0];
        assert!(!status.healthy);
        assert_eq!(status.outlier.ejections, 1);
        assert_eq!(status.outlier.last_failure.as_deref(), Some("timed out"));
        assert_eq!(status.outlier.ejected_for_ms, Some(1000));

        tokio::time::advance(Duration::from_secs(1)).await;
        // On trial: healthy again, and one failure ejects it for twice as long.
        assert_eq!(cluster.snapshot()[0].health, Health::Healthy);
        cluster.record_failure(0, &"HTTP 503");
        assert_eq!(cluster.status()[0].outlier.ejected_for_ms, Some(2000));
        let ejections: Vec<_> = cluster
            .status()
            .iter()
            .map(|e| e.outlier.ejections)
            .collect();
        assert_eq!(ejections, [2, 0]);
        // An ejected endpoint whose probe fails stays out after the ejection too.
        cluster.mark_unhealthy(0);
        tokio::time::advance(Duration::from_secs(2)).await;
        assert_eq!(cluster.snapshot()[0].health, Health::NotReady);
    }

    #[test]
    fn endpoints_join_drain_and_leave_and_ids_are_never_reused() {
        let cluster = Cluster::new(
            vec![spec("http://a", 2), spec("http://b", 1)],
            OutlierConfig::default(),
        );
        let added = cluster
            .add(&spec("http://c/", 4), Owner::Admin)
            .expect("a new URL");
        assert_eq!(added, 2);
        assert_eq!(
            cluster.device_rank(2),
            Some(3),
            "the prefix sum of the GPUs before it"
        );
        assert!(matches!(
            cluster.add(&spec("http://c", 1), Owner::Admin),
            Err(EndpointError::Duplicate { id: 2, .. })
        ));
        assert!(matches!(
            cluster.add(&spec("ftp://d", 1), Owner::Admin),
            Err(EndpointError::Invalid { .. })
        ));
        // An https endpoint whose CA file cannot be read, and a plain one given TLS files.
        let ca_file = Some(PathBuf::from("/nonexistent/ca.pem"));
        for url in ["https://e", "http://e"] {
            let spec = EndpointSpec {
                ca_file: ca_file.clone(),
                ..spec(url, 1)
            };
            let added = cluster.add(&spec, Owner::Admin);
            assert!(
                matches!(added, Err(EndpointError::Invalid { .. })),
                "{url}: {added:?}"
            );
        }
        for id in 0..3 {
            cluster.set_health(id, true);
        }

        // Draining: out of new plans at once, busy until its legs finish.
        let leg = cluster.in_flight(1).expect("exists");
        cluster.drain(1).expect("drains");
        assert_eq!(cluster.snapshot()[1].health, Health::Draining);
        assert!(matches!(
            cluster.remove(1),
            Err(EndpointError::Busy {
                id: 1,
                in_flight: 1
            })
        ));
        drop(leg);
        cluster.remove(1).expect("idle now");
        assert!(matches!(cluster.drain(1), Err(EndpointError::Removed(1))));
        assert!(matches!(cluster.remove(7), Err(EndpointError::Unknown(7))));

        // A tombstone keeps its place: ids stay positions, and a new endpoint gets a new id
        // (even at a removed one's URL) and the next device rank.
        let snapshot = cluster.snapshot();
        assert_eq!(snapshot.len(), 3);
        assert_eq!(snapshot[1].health, Health::Removed);
        assert!(snapshot.iter().enumerate().all(|(i, e)| e.id == i as u32));
        assert_eq!(cluster.add(&spec("http://b", 1), Owner::Admin), Ok(3));
        assert_eq!(cluster.device_rank(3), Some(7));
        let readiness = cluster.readiness();
        assert_eq!(readiness.healthy, 2);
        assert!(
            readiness.down.iter().all(|d| d.id != 1),
            "removed ones are not down"
        );
        let owned: Vec<u32> = cluster
            .owned_by(&Owner::Static)
            .iter()
            .map(|(id, _)| *id)
            .collect();
        assert_eq!(owned, [0]);
    }

    fn healthy_ids(snapshot: &[EndpointSnapshot]) -> Vec<u32> {
        snapshot
            .iter()
            .filter(|e| e.health.is_healthy())
            .map(|e| e.id)
            .collect()
    }

    #[test]
    fn a_requests_snapshot_shows_only_the_endpoints_serving_its_model() {
        let pinned = EndpointSpec {
            models: Some(vec!["llama".into()]),
            ..spec("http://c", 1)
        };
        let cluster = Cluster::new(
            vec![spec("http://a", 1), spec("http://b", 1), pinned],
            OutlierConfig::default(),
        );
        cluster.set_models(0, vec![ModelCard::base("llama")]);
        let adapter = ModelCard {
            id: "sql-lora".into(),
            parent: Some("qwen".into()),
        };
        cluster.set_models(1, vec![ModelCard::base("qwen"), adapter]);
        // A pinned endpoint's list is the operator's, whatever its engine says.
        cluster.set_models(2, vec![ModelCard::base("qwen")]);
        for id in 0..3 {
            cluster.set_health(id, true);
        }

        assert_eq!(healthy_ids(&cluster.snapshot_for("llama", &[])), [0, 2]);
        assert_eq!(healthy_ids(&cluster.snapshot_for("qwen", &[])), [1]);
        assert_eq!(healthy_ids(&cluster.snapshot_for("sql-lora", &[])), [1]);
        // Ids stay positions: the others are tombstones, not gaps.
        let snapshot = cluster.snapshot_for("qwen", &[]);
        assert!(snapshot.iter().enumerate().all(|(i, e)| e.id == i as u32));
        assert_eq!(snapshot[0].health, Health::Removed);
        // A name no endpoint lists (the router's own, engines calling it otherwise) goes anywhere.
        assert_eq!(
            healthy_ids(&cluster.snapshot_for("router-name", &[])),
            [0, 1, 2]
        );

        assert_eq!(cluster.base_model("sql-lora").as_deref(), Some("qwen"));
        assert_eq!(cluster.base_model("qwen"), None);
        assert_eq!(cluster.healthy_serving("llama"), Some(2));
        assert_eq!(cluster.healthy_serving("router-name"), None);
        cluster.set_health(1, false);
        assert_eq!(cluster.healthy_serving("sql-lora"), Some(0));
        assert!(cluster.serves("sql-lora"));
    }

    #[test]
    fn what_an_endpoint_serves_follows_its_list_and_its_removal() {
        let cluster = Cluster::new(
            vec![spec("http://a", 1), spec("http://b", 1)],
            OutlierConfig::default(),
        );
        cluster.set_models(0, vec![ModelCard::base("llama")]);
        cluster.set_models(1, vec![ModelCard::base("llama")]);
        assert_eq!(
            cluster.models(),
            [ModelCard::base("llama")],
            "each model once"
        );
        cluster.set_models(1, vec![ModelCard::base("qwen")]);
        assert!(cluster.serves("qwen"));
        assert_eq!(cluster.healthy_serving("llama"), Some(0));
        cluster.remove(1).expect("idle");
        assert!(!cluster.serves("qwen"));
        assert_eq!(cluster.models(), [ModelCard::base("llama")]);
        // Pinned at run time (the admin API, a SIGHUP): served before any probe answers.
        let pinned = EndpointSpec {
            models: Some(vec!["mistral".into()]),
            ..spec("http://c", 1)
        };
        let pins_nothing = EndpointSpec {
            models: Some(Vec::new()),
            ..spec("http://d", 1)
        };
        assert!(matches!(
            cluster.add(&pins_nothing, Owner::Admin),
            Err(EndpointError::Invalid { .. })
        ));
        let id = cluster.add(&pinned, Owner::Admin).expect("added");
        assert_eq!(cluster.owned_by(&Owner::Admin), [(id, pinned.clone())]);
        assert!(cluster.serves("mistral"));
    }

    #[test]
    fn saturation_is_judged_among_the_endpoints_serving_the_requests_model() {
        let decode = |url: &str| EndpointSpec {
            role: Role::Decode,
            ..spec(url, 1)
        };
        let cluster = Cluster::new(
            vec![decode("http://a"), decode("http://b")],
            OutlierConfig::default(),
        )
        .with_saturation(Some(SaturationConfig::default()));
        cluster.set_models(0, vec![ModelCard::base("llama")]);
        cluster.set_models(1, vec![ModelCard::base("qwen")]);
        let waiting = |n| EngineLoad {
            waiting: Some(n),
            ..EngineLoad::default()
        };
        cluster.set_engine_load(0, waiting(10));
        cluster.set_engine_load(1, waiting(0));
        for id in 0..2 {
            cluster.set_health(id, true);
        }
        // qwen's room is no room for llama: its one endpoint, saturated, still takes it.
        let llama: Vec<_> = cluster
            .snapshot_for("llama", &[])
            .iter()
            .map(|e| e.health)
            .collect();
        assert_eq!(llama, [Health::Healthy, Health::Removed]);
    }
}
