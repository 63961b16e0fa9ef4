//! The router's configuration: flags and an optional TOML file, parsed and validated once at
//! startup into a typed [`Config`]. A bad value is reported with the flag or key it came from,
//! before any port is bound.
//!
//! ```toml
//! host = "127.0.0.1"
//! port = 8000
//! policy = "disagg"                          # the default policy: plugins/disagg.wasm
//! plugins = "plugins"                         # every *.wasm in it is loaded, and watched
//! policy_config = { pd_balance_factor = 0.1 } # the default policy's config, or a JSON string
//!                                             # (other policies: plugins/<name>.json)
//! fallback_policy = "round-robin"             # plans a faulting policy's requests ("none": off)
//! policy_header = true                        # x-switchyard-policy may select a policy
//! forward_headers = ["x-priority"]           # request headers policies may route on
//! quarantine_faults = 5                       # faults within the window that quarantine
//! quarantine_window_ms = 30000
//! admin_token = "s3cret"                      # /admin/* then needs `Authorization: Bearer …`
//! admin_port = 9001                           # /admin/* on its own port instead of `port`
//! model_dir = "/models/llama"                  # tokenizer.json + tokenizer_config.json, or a .gguf
//! model = "llama"                              # name reported by /v1/models
//! max_attempts = 3
//! min_healthy_endpoints = 1                   # healthy endpoints needed to be ready
//! max_body_bytes = 4194304                   # 4 MiB; larger bodies get 413
//! default_max_tokens = 256
//! context_length = 32768                      # prompt + completion tokens the model holds
//! max_prompt_tokens = 32767                   # default: context_length - 1
//! max_concurrent_requests = 1024              # served at once; more wait in the queue
//! max_queued_requests = 1024                  # beyond them: 429 with Retry-After
//! queue_timeout = "5s"                        # the longest wait in the queue
//! header_read_timeout = "10s"                 # first byte of a request to its whole header
//! body_read_timeout = "30s"                   # whole header to whole body
//! keep_alive_timeout = "75s"                  # a connection with no request on it
//! max_connections = 4096                      # client connections per listener
//! workers = 2                                 # threads serving connections (default: one per core)
//! drain_delay = "5s"                          # SIGTERM: /health 503 this long, then stop accepting
//! shutdown_grace = "30s"                      # then in-flight requests have this long
//! request_timeout = "10m"                      # durations: "500ms", "30s", "10m"
//! connect_timeout = "2s"                      # TCP connect to an engine
//! call_timeout = "120s"                       # a prep_recv or remote_send, a stream's headers
//! stream_idle_timeout = "60s"                 # longest gap between two chunks of a stream
//! outlier_failures = 3                        # consecutive failures that eject (0: off)
//! outlier_base_ejection = "1s"                # doubled for each ejection in a row
//! outlier_max_ejection = "30s"
//! retry_budget_ratio = 0.2                    # retries per request over the last 10 s
//! retry_budget_min_per_sec = 10               # plus this many per second
//!
//! [[endpoints]]
//! url = "http://127.0.0.1:8081"
//! protocol = "mlc"    # mlc (default) | vllm | sglang | openai (any OpenAI-compatible server)
//! role = "prefill"    # any | prefill | decode (a hint on mlc; binding on vllm and sglang)
//! num_gpus = 1        # mlc: GPUs in the KV-transfer world
//! api_key = { env = "ENGINE_API_KEY" }  # or "…": sent as `Authorization: Bearer` on every call
//!
//! [[endpoints]]
//! url = "http://10.0.0.5:30000"
//! protocol = "sglang"
//! role = "prefill"
//! bootstrap_port = 8998  # an sglang prefill's --disaggregation-bootstrap-port (required)
//!
//!
//! [model_policies]                            # model name -> policy, for requests without
//! llama = "round-robin"                        # an x-switchyard-policy header
//!
//! [discovery]                                  # engines found while serving (feature `k8s`)
//! kind = "k8s"                                 # pods from the Kubernetes API
//! k8s_selector = "app=engine,model=llama"      # one label selector, sent whole
//! k8s_namespace = "serving"                    # default: the kubeconfig's or the pod's own
//! k8s_resync = "30s"                           # list again and reconcile this often
//! ```
//!
//! Flags override the file; `--endpoint` flags replace the file's endpoints. An `--endpoint`
//! is `[PROTOCOL+]URL[,role=ROLE][,bootstrap_port=N]`, e.g.
//! `--endpoint sglang+http://10.0.0.5:30000,role=prefill,bootstrap_port=8998`.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::num::NonZeroUsize;
use std::path::{Path, PathBuf};
use std::time::Duration;

use switchyard_contract::{Protocol, Role};
use switchyard_policy_host::QuarantineRule;
use switchyard_wire::gguf::{GgufMetadata, ModelFiles, served_name};

use crate::api::{AdmissionConfig, ConnectionLimits, DrainConfig, RequestLimits};
use crate::cluster::{EndpointSpec, OutlierConfig};
use crate::engine_client::Timeouts;
use crate::{RetryBudgetConfig, RetryPolicy, RetryPolicyError, RouterConfig};

/// `switchyard serve` flags: where the engines are, and how the router runs.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct ServeArgs {
    /// An engine: `[PROTOCOL+]URL[,role=ROLE][,bootstrap_port=N]` (repeat for each engine, in
    /// id order). PROTOCOL is mlc (the default), vllm, sglang or openai; ROLE any, prefill or
    /// decode (binding on vllm and sglang); an sglang prefill needs its bootstrap_port. E.g.
    /// `http://127.0.0.1:8081`, `vllm+http://10.0.0.4:8000,role=decode`.
    #[arg(long = "endpoint", value_name = "ENDPOINT")]
    pub endpoints: Vec<String>,
    /// GPUs of each `--endpoint`, in the same order (default 1 each); device ranks are their
    /// prefix sums.
    #[arg(long = "endpoint-num-gpus")]
    pub endpoint_num_gpus: Vec<u32>,
    /// A TOML config file (see the `config` module docs).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Find engines while serving, beside any --endpoint: `k8s` watches the pods that match
    /// --k8s-selector through the Kubernetes API (kubeconfig from KUBECONFIG, else the pod's
    /// service account); needs a build with the `k8s` feature.
    #[arg(long, value_enum)]
    pub discovery: Option<DiscoveryKind>,
    /// With --discovery k8s: the label selector engine pods match, e.g. `app=engine,model=llama`
    /// (sent whole to the API server).
    #[arg(long, value_name = "LABELS")]
    pub k8s_selector: Option<String>,
    /// With --discovery k8s: the namespace whose pods are watched [default: the kubeconfig's
    /// namespace, or the router pod's own].
    #[arg(long, value_name = "NS")]
    pub k8s_namespace: Option<String>,
    /// With --discovery k8s: how often the pods are listed afresh and reconciled, so a watch
    /// that lost events or went silent still converges [default: 30s].
    #[arg(long, value_parser = humantime::parse_duration)]
    pub k8s_resync: Option<Duration>,
    #[command(flatten)]
    pub router: RouterArgs,
}

/// Where endpoints are discovered while the router serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DiscoveryKind {
    /// Pods from the Kubernetes API.
    K8s,
}

/// `--discovery k8s`: which pods are engines, and how often they are listed afresh.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct K8sDiscovery {
    /// A label selector, e.g. `app=engine,model=llama`.
    pub selector: String,
    /// `None`: the kubeconfig's default namespace (in a cluster: the router pod's).
    pub namespace: Option<String>,
    pub resync: Duration,
}

pub const DEFAULT_K8S_RESYNC: Duration = Duration::from_secs(30);

/// How the router runs, whoever started the engines: the flags `switchyard serve` and
/// `switchyard up` share. Each overrides its key in the `--config` file; unset, the file's
/// value or the default applies.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct RouterArgs {
    /// Address to listen on [default: 127.0.0.1].
    #[arg(long)]
    pub host: Option<IpAddr>,
    /// Port to listen on (0 picks a free one) [default: 8000].
    #[arg(long)]
    pub port: Option<u16>,
    /// The default policy: `<plugins>/<NAME>.wasm` (the last --policy given wins) [default:
    /// disagg].
    #[arg(long, overrides_with = "policy")]
    pub policy: Option<String>,
    /// Where policies live: every `*.wasm` in it is loaded, and reloaded when its file (or
    /// `<name>.json` config) changes (the last --plugins given wins) [default: plugins].
    #[arg(long, overrides_with = "plugins")]
    pub plugins: Option<PathBuf>,
    /// The default policy's JSON config, given to its `init` (instead of `<plugins>/<NAME>.json`).
    #[arg(long)]
    pub policy_config: Option<String>,
    /// Plans the requests of a policy that faults or is quarantined (default `round-robin`;
    /// `none`: those requests fail).
    #[arg(long)]
    pub fallback_policy: Option<String>,
    /// Ignore the `x-switchyard-policy` request header (clients cannot pick a policy).
    #[arg(long)]
    pub no_policy_header: bool,
    /// A request header policies may route on (repeatable; names are case-insensitive). No
    /// other header reaches a policy [default: x-priority].
    #[arg(long = "forward-header", value_name = "NAME")]
    pub forward_headers: Vec<String>,
    /// Faults (trap, deadline, memory cap, invalid plan) within --quarantine-window-ms that
    /// quarantine a policy version.
    #[arg(long)]
    pub quarantine_faults: Option<u32>,
    #[arg(long)]
    pub quarantine_window_ms: Option<u64>,
    /// Require `Authorization: Bearer TOKEN` on `/admin/*`.
    #[arg(long, env = "SWITCHYARD_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
    /// Serve `/admin/*` on this port (same host) instead of the main port.
    #[arg(long)]
    pub admin_port: Option<u16>,
    /// The served model's tokenizer: a directory with `tokenizer.json` (and
    /// `tokenizer_config.json` for chat), or a GGUF file, whose metadata gives the tokenizer,
    /// chat template, default `--model` name and default `--context-length`; default: the
    /// reference engine's byte-level tokenizer.
    #[arg(long)]
    pub model_dir: Option<PathBuf>,
    /// The model name `/v1/models` reports.
    #[arg(long)]
    pub model: Option<String>,
    /// Failed attempts (engine errors, preemptions without progress) before a request fails.
    #[arg(long)]
    pub max_attempts: Option<u32>,
    /// Largest accepted request body in bytes; larger ones get 413 [default: 4194304, 4 MiB].
    #[arg(long)]
    pub max_body_bytes: Option<usize>,
    /// `max_tokens` for requests that give none (less when the context leaves less room).
    #[arg(long)]
    pub default_max_tokens: Option<u32>,
    /// Prompt plus completion tokens the model holds: a request whose prompt and `max_tokens`
    /// do not fit is refused with 400, never cut short [default: 32768, the reference engine's].
    #[arg(long)]
    pub context_length: Option<u32>,
    /// The longest prompt accepted, in tokens [default: --context-length - 1].
    #[arg(long)]
    pub max_prompt_tokens: Option<u32>,
    /// Longest time from a request's arrival to the end of its response, over every attempt;
    /// a stream still open then ends with an error event [default: 10m].
    #[arg(long, value_parser = humantime::parse_duration)]
    pub request_timeout: Option<Duration>,
    /// Longest wait for a TCP connection to an engine [default: 2s].
    #[arg(long, value_parser = humantime::parse_duration)]
    pub connect_timeout: Option<Duration>,
    /// Longest wait for a whole prep_recv or remote_send (prep_recv may wait for free KV
    /// pages, remote_send includes the prefill), and for a generation's response headers
    /// [default: 120s].
    #[arg(long, value_parser = humantime::parse_duration)]
    pub call_timeout: Option<Duration>,
    /// Longest gap between two chunks of a generation before it counts as stalled: the request
    /// continues elsewhere and the engine is blamed [default: 60s].
    #[arg(long, value_parser = humantime::parse_duration)]
    pub stream_idle_timeout: Option<Duration>,
    /// Healthy endpoints the router needs to report ready (`/health` 200) and serve; requests
    /// are planned over the healthy ones, so one engine down never stops the others
    /// [default: 1].
    #[arg(long)]
    pub min_healthy_endpoints: Option<usize>,
    /// Consecutive failures of an endpoint's own making (refused connections, timeouts, 5xx,
    /// broken or stalled streams; never a client's 4xx) that eject it from routing for a while;
    /// 0 turns ejection off [default: 3].
    #[arg(long)]
    pub outlier_failures: Option<u32>,
    /// How long an endpoint's first ejection lasts; each further ejection in a row doubles it.
    /// It comes back on trial once the time is up and its readiness probe answers [default: 1s].
    #[arg(long, value_parser = humantime::parse_duration)]
    pub outlier_base_ejection: Option<Duration>,
    /// The longest an ejection lasts [default: 30s].
    #[arg(long, value_parser = humantime::parse_duration)]
    pub outlier_max_ejection: Option<Duration>,
    /// Retries (attempts after an engine failure) the whole router may make per client request
    /// over the last 10 s; past it, failing requests fail at once instead of retrying
    /// [default: 0.2].
    #[arg(long)]
    pub retry_budget_ratio: Option<f64>,
    /// Retries per second allowed on top of --retry-budget-ratio, so a quiet router still
    /// retries [default: 10].
    #[arg(long)]
    pub retry_budget_min_per_sec: Option<u32>,
    /// Completion requests served at once, each from admission (its body read) to the end of
    /// its response, stream included; more wait in a queue [default: 1024].
    #[arg(long)]
    pub max_concurrent_requests: Option<u32>,
    /// Requests that may wait, first come first served, while --max-concurrent-requests are in
    /// flight; more are refused at once with 429 and Retry-After (0: none wait)
    /// [default: 1024].
    #[arg(long)]
    pub max_queued_requests: Option<u32>,
    /// The longest a request waits in the queue; still waiting then, it gets 429 with
    /// Retry-After [default: 5s].
    #[arg(long, value_parser = humantime::parse_duration)]
    pub queue_timeout: Option<Duration>,
    /// Deadline from a request's first byte to its whole header; a connection still sending
    /// its header then is closed (slowloris) [default: 10s].
    #[arg(long, value_parser = humantime::parse_duration)]
    pub header_read_timeout: Option<Duration>,
    /// Deadline from a request's whole header to its whole body; a slower body gets 408
    /// [default: 30s].
    #[arg(long, value_parser = humantime::parse_duration)]
    pub body_read_timeout: Option<Duration>,
    /// How long a client connection stays open with no request on it; keep it above the idle
    /// timeout of a load balancer in front [default: 75s].
    #[arg(long, value_parser = humantime::parse_duration)]
    pub keep_alive_timeout: Option<Duration>,
    /// Client connections open at once, per listener; at the limit new ones wait in the
    /// kernel's backlog until one closes [default: 4096].
    #[arg(long)]
    pub max_connections: Option<u32>,
    /// Threads serving client connections; each connection, with the engine calls its
    /// requests make, stays on one of them [default: one per core this process may use].
    #[arg(long)]
    pub workers: Option<NonZeroUsize>,
    /// On SIGTERM or SIGINT, how long /health answers 503 while the listeners still accept
    /// and serve, so a load balancer notices; then they stop accepting [default: 5s].
    #[arg(long, value_parser = humantime::parse_duration)]
    pub drain_delay: Option<Duration>,
    /// Once the listeners stop accepting, how long requests in flight may take to finish;
    /// streams still open then end with an error event and [DONE]. A second signal ends them
    /// at once [default: 30s].
    #[arg(long, value_parser = humantime::parse_duration)]
    pub shutdown_grace: Option<Duration>,
}

/// The validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    pub listen: SocketAddr,
    pub endpoints: Vec<EndpointSpec>,
    /// The `--config` file whose `[[endpoints]]` a SIGHUP re-reads; `None` when there is no
    /// file or `--endpoint` flags replace its endpoints.
    pub endpoints_file: Option<PathBuf>,
    /// Endpoints discovered while serving, beside `endpoints`.
    pub discovery: Option<K8sDiscovery>,
    /// The default policy.
    pub policy_name: String,
    pub policy_path: PathBuf,
    /// The default policy's config, compact JSON; `None`: `<plugins>/<name>.json` or `{}`.
    pub policy_config: Option<String>,
    pub plugins: PathBuf,
    pub policies: PolicySettings,
    pub admin: AdminSettings,
    /// Where the tokenizer and chat template come from; `None`: the byte-level tokenizer.
    pub model_source: Option<ModelSource>,
    pub model: String,
    /// Retries, the retry budget and the request deadline.
    pub routing: RouterConfig,
    /// Healthy endpoints needed to be ready.
    pub min_healthy_endpoints: usize,
    /// How long the router waits on engines.
    pub timeouts: Timeouts,
    pub outlier: OutlierConfig,
    pub max_body_bytes: usize,
    pub default_max_tokens: u32,
    pub limits: RequestLimits,
    /// How many requests are served at once, and how many may wait.
    pub admission: AdmissionConfig,
    /// Client connections: deadlines and a cap.
    pub connections: ConnectionLimits,
    /// What SIGTERM does, step by step.
    pub drain: DrainConfig,
    /// Threads serving client connections.
    pub workers: NonZeroUsize,
}

/// How requests find their policy, and what happens when it faults.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicySettings {
    pub fallback: Option<String>,
    /// Model name → policy name.
    pub models: BTreeMap<String, String>,
    /// Whether `x-switchyard-policy` may select a policy.
    pub header: bool,
    /// The request headers policies see (lower-case names).
    pub forward_headers: Vec<String>,
    pub quarantine: QuarantineRule,
}

/// Who may use `/admin/*`, and where.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct AdminSettings {
    /// The bearer token `/admin/*` requires; `None`: no token.
    pub token: Option<String>,
    /// A separate listener for `/admin/*`; `None`: the main port serves them.
    pub listen: Option<SocketAddr>,
}

/// Where the router's tokenizer and chat template come from (`--model-dir`).
#[derive(Debug, Clone)]
pub enum ModelSource {
    /// A Hugging Face-style directory: `tokenizer.json`, and `tokenizer_config.json` for chat.
    Dir(PathBuf),
    /// A GGUF file: the same, from its metadata (read once, here, without the weights).
    Gguf {
        path: PathBuf,
        files: std::sync::Arc<ModelFiles>,
    },
}

impl ModelSource {
    /// A GGUF file or a directory with a `tokenizer.json`; anything else is refused here,
    /// before any port is bound.
    fn open(path: PathBuf) -> Result<Self, ConfigError> {
        let refuse = |reason: String| ConfigError::ModelDir {
            path: path.clone(),
            reason,
        };
        if path.is_file() {
            let files = GgufMetadata::read(&path)
                .and_then(|meta| meta.model_files())
                .map_err(|e| refuse(format!("not a usable GGUF: {e}")))?;
            return Ok(ModelSource::Gguf {
                files: std::sync::Arc::new(files),
                path,
            });
        }
        if !path.join("tokenizer.json").is_file() {
            return Err(refuse(
                "neither a GGUF file nor a directory with a tokenizer.json".into(),
            ));
        }
        Ok(ModelSource::Dir(path))
    }

    /// The name `/v1/models` reports unless `--model` says otherwise: the directory's name, or
    /// the GGUF's as the reference engine serves it.
    fn default_name(&self) -> String {
        match self {
            ModelSource::Dir(dir) => dir
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| DEFAULT_MODEL.to_owned()),
            ModelSource::Gguf { path, .. } => served_name(path),
        }
    }

    /// The context length the GGUF declares (a directory's is not read).
    fn context_length(&self) -> Option<u32> {
        match self {
            ModelSource::Dir(_) => None,
            ModelSource::Gguf { files, .. } => {
                files.context_length.and_then(|n| u32::try_from(n).ok())
            }
        }
    }
}

/// Why the configuration is unusable; each names the flag or key.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {}: {source}", path.display())]
    ReadFile {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("config file {}: {reason}", path.display())]
    ParseFile { path: PathBuf, reason: String },
    #[error(
        "no endpoints: give --endpoint URL (repeatable), [[endpoints]] in --config, or --discovery"
    )]
    NoEndpoints,
    #[error("--discovery k8s needs --k8s-selector (a label selector, e.g. app=engine)")]
    NoSelector,
    #[error("--k8s-selector, --k8s-namespace and --k8s-resync need --discovery k8s")]
    K8sWithoutDiscovery,
    #[error("--discovery k8s: this switchyard was built without the `k8s` feature")]
    DiscoveryNotBuilt,
    #[error("endpoint {index} ({url:?}): {reason}")]
    BadEndpoint {
        index: usize,
        url: String,
        reason: String,
    },
    #[error(
        "--endpoint-num-gpus: {given} values for {endpoints} endpoints (give one per --endpoint)"
    )]
    NumGpusCount { given: usize, endpoints: usize },
    #[error("--policy {name:?}: {reason}")]
    BadPolicy { name: String, reason: String },
    #[error("--policy-config is not valid JSON: {0}")]
    PolicyConfig(String),
    #[error("--fallback-policy {name:?}: {reason}")]
    BadFallback { name: String, reason: String },
    #[error("model_policies: model {model:?} -> policy {name:?}: {reason}")]
    BadModelPolicy {
        model: String,
        name: String,
        reason: String,
    },
    #[error("--quarantine-faults and --quarantine-window-ms must be at least 1")]
    Quarantine,
    #[error("--admin-token must not be empty")]
    AdminToken,
    #[error("--admin-port {0} is the main port; give another one or leave it out")]
    AdminPort(u16),
    #[error("--model-dir {}: {reason}", path.display())]
    ModelDir { path: PathBuf, reason: String },
    #[error("--forward-header {0:?} is not a header name")]
    ForwardHeader(String),
    #[error("--max-attempts: {0}")]
    Retry(#[from] RetryPolicyError),
    #[error("--max-body-bytes must be at least 1")]
    BodyLimit,
    #[error("--default-max-tokens must be at least 1")]
    DefaultMaxTokens,
    #[error("--context-length must be at least 2, and --max-prompt-tokens from 1 to below it")]
    Lengths,
    #[error("--{0} must be longer than zero")]
    ZeroTimeout(&'static str),
    #[error("--min-healthy-endpoints {wanted} is more than the {endpoints} endpoints configured")]
    MinHealthy { wanted: usize, endpoints: usize },
    #[error("--{0} must be at least 1")]
    ZeroLimit(&'static str),
    #[error(
        "--outlier-base-ejection {base:?} must be longer than zero and at most --outlier-max-ejection {max:?}"
    )]
    Ejection { base: Duration, max: Duration },
    #[error("--retry-budget-ratio {0} must be a number from 0 to 100")]
    RetryBudgetRatio(f64),
}

/// The TOML file, every key optional.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    host: Option<IpAddr>,
    port: Option<u16>,
    policy: Option<String>,
    plugins: Option<PathBuf>,
    policy_config: Option<toml::Value>,
    fallback_policy: Option<String>,
    policy_header: Option<bool>,
    forward_headers: Option<Vec<String>>,
    #[serde(default)]
    model_policies: BTreeMap<String, String>,
    quarantine_faults: Option<u32>,
    quarantine_window_ms: Option<u64>,
    admin_token: Option<String>,
    admin_port: Option<u16>,
    model_dir: Option<PathBuf>,
    model: Option<String>,
    max_attempts: Option<u32>,
    max_body_bytes: Option<usize>,
    default_max_tokens: Option<u32>,
    context_length: Option<u32>,
    max_prompt_tokens: Option<u32>,
    request_timeout: Option<TextDuration>,
    min_healthy_endpoints: Option<usize>,
    connect_timeout: Option<TextDuration>,
    call_timeout: Option<TextDuration>,
    stream_idle_timeout: Option<TextDuration>,
    outlier_failures: Option<u32>,
    outlier_base_ejection: Option<TextDuration>,
    outlier_max_ejection: Option<TextDuration>,
    retry_budget_ratio: Option<f64>,
    retry_budget_min_per_sec: Option<u32>,
    max_concurrent_requests: Option<u32>,
    max_queued_requests: Option<u32>,
    queue_timeout: Option<TextDuration>,
    header_read_timeout: Option<TextDuration>,
    body_read_timeout: Option<TextDuration>,
    keep_alive_timeout: Option<TextDuration>,
    max_connections: Option<u32>,
    drain_delay: Option<TextDuration>,
    shutdown_grace: Option<TextDuration>,
    workers: Option<NonZeroUsize>,
    #[serde(default)]
    endpoints: Vec<EndpointSpec>,
    #[serde(default)]
    discovery: DiscoveryKeys,
}

/// The file's `[discovery]` table.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct DiscoveryKeys {
    kind: Option<DiscoveryKind>,
    k8s_selector: Option<String>,
    k8s_namespace: Option<String>,
    k8s_resync: Option<TextDuration>,
}

/// A duration in the TOML file, written as the flags take it: `"500ms"`, `"30s"`, `"10m"`.
#[derive(Debug, Clone, Copy)]
struct TextDuration(Duration);

impl<'de> serde::Deserialize<'de> for TextDuration {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        humantime::parse_duration(&text)
            .map(TextDuration)
            .map_err(|e| serde::de::Error::custom(format!("{text:?} is not a duration: {e}")))
    }
}

/// The flag's value, else the file's, else `default`.
fn duration(flag: Option<Duration>, file: Option<TextDuration>, default: Duration) -> Duration {
    flag.or(file.map(|d| d.0)).unwrap_or(default)
}

pub const DEFAULT_PORT: u16 = 8000;
pub const DEFAULT_POLICY: &str = "disagg";
pub const DEFAULT_FALLBACK_POLICY: &str = "round-robin";
/// `--fallback-policy none` turns the fallback off.
pub const NO_FALLBACK: &str = "none";
/// Far above any prompt a model takes as text (a 128k-token context is ~0.5 MiB of text, 1 MiB
/// as token ids), small enough that many at once do not exhaust memory.
pub const DEFAULT_MAX_BODY_BYTES: usize = 4 << 20;
pub const DEFAULT_MAX_TOKENS: u32 = 256;
/// The reference engine's: 2048 KV pages of 16 positions.
pub const DEFAULT_CONTEXT_LENGTH: u32 = 32768;
pub const DEFAULT_MODEL: &str = "switchyard-reference";
/// The request headers policies see unless configured otherwise.
pub const DEFAULT_FORWARD_HEADERS: [&str; 1] = ["x-priority"];

impl Config {
    /// Parse and validate `args` (and the file it names).
    pub fn from_args(args: &ServeArgs) -> Result<Config, ConfigError> {
        let file = match &args.config {
            Some(path) => read_file(path)?,
            None => FileConfig::default(),
        };
        let discovery = discovery(args, file.discovery)?;
        let endpoints = endpoints(args, file.endpoints, discovery.is_some())?;
        let host = args
            .router
            .host
            .or(file.host)
            .unwrap_or(IpAddr::from([127, 0, 0, 1]));
        let port = args.router.port.or(file.port).unwrap_or(DEFAULT_PORT);
        let policy_name = args
            .router
            .policy
            .clone()
            .or(file.policy)
            .unwrap_or_else(|| DEFAULT_POLICY.to_owned());
        let plugins = args
            .router
            .plugins
            .clone()
            .or(file.plugins)
            .unwrap_or_else(|| PathBuf::from("plugins"));
        let policy_path = policy_path(&plugins, &policy_name)?;
        let policy_config = match (&args.router.policy_config, file.policy_config) {
            (Some(json), _) => Some(compact_json(json)?),
            (None, Some(toml::Value::String(json))) => Some(compact_json(&json)?),
            (None, Some(value)) => Some(
                serde_json::to_string(&value)
                    .map_err(|e| ConfigError::PolicyConfig(e.to_string()))?,
            ),
            (None, None) => None,
        };
        let policy_keys = PolicyKeys {
            fallback: file.fallback_policy,
            header: file.policy_header,
            forward_headers: file.forward_headers,
            models: file.model_policies,
            faults: file.quarantine_faults,
            window_ms: file.quarantine_window_ms,
        };
        let policies = policy_settings(&args.router, policy_keys, &plugins)?;
        let admin = admin_settings(&args.router, file.admin_token, file.admin_port, host, port)?;
        let model_source = match args.router.model_dir.clone().or(file.model_dir) {
            Some(path) => Some(ModelSource::open(path)?),
            None => None,
        };
        let model = args
            .router
            .model
            .clone()
            .or(file.model)
            .or_else(|| model_source.as_ref().map(ModelSource::default_name))
            .unwrap_or_else(|| DEFAULT_MODEL.to_owned());
        let defaults = RetryPolicy::default();
        let retry = RetryPolicy::try_new(
            args.router
                .max_attempts
                .or(file.max_attempts)
                .unwrap_or(defaults.max_attempts()),
            Duration::from_millis(10),
            Duration::from_secs(1),
        )?;
        let max_body_bytes = args
            .router
            .max_body_bytes
            .or(file.max_body_bytes)
            .unwrap_or(DEFAULT_MAX_BODY_BYTES);
        if max_body_bytes == 0 {
            return Err(ConfigError::BodyLimit);
        }
        let default_max_tokens = args
            .router
            .default_max_tokens
            .or(file.default_max_tokens)
            .unwrap_or(DEFAULT_MAX_TOKENS);
        if default_max_tokens == 0 {
            return Err(ConfigError::DefaultMaxTokens);
        }
        let r = &args.router;
        let context_length = r
            .context_length
            .or(file.context_length)
            .or_else(|| model_source.as_ref().and_then(ModelSource::context_length))
            .unwrap_or(DEFAULT_CONTEXT_LENGTH);
        let max_prompt_tokens = r
            .max_prompt_tokens
            .or(file.max_prompt_tokens)
            .unwrap_or(context_length.saturating_sub(1));
        if context_length < 2 || max_prompt_tokens == 0 || max_prompt_tokens >= context_length {
            return Err(ConfigError::Lengths);
        }
        let limits = RequestLimits {
            context_length,
            max_prompt_tokens,
        };
        let edge = edge_settings(
            r,
            EdgeKeys {
                max_concurrent_requests: file.max_concurrent_requests,
                max_queued_requests: file.max_queued_requests,
                queue_timeout: file.queue_timeout,
                header_read_timeout: file.header_read_timeout,
                body_read_timeout: file.body_read_timeout,
                keep_alive_timeout: file.keep_alive_timeout,
                max_connections: file.max_connections,
                drain_delay: file.drain_delay,
                shutdown_grace: file.shutdown_grace,
            },
        )?;
        let request_timeout = duration(
            r.request_timeout,
            file.request_timeout,
            crate::DEFAULT_REQUEST_TIMEOUT,
        );
        let default_timeouts = Timeouts::default();
        let timeouts = Timeouts {
            connect: duration(
                r.connect_timeout,
                file.connect_timeout,
                default_timeouts.connect,
            ),
            call: duration(r.call_timeout, file.call_timeout, default_timeouts.call),
            stream_idle: duration(
                r.stream_idle_timeout,
                file.stream_idle_timeout,
                default_timeouts.stream_idle,
            ),
            ..default_timeouts
        };
        for (flag, value) in [
            ("request-timeout", request_timeout),
            ("connect-timeout", timeouts.connect),
            ("call-timeout", timeouts.call),
            ("stream-idle-timeout", timeouts.stream_idle),
        ] {
            if value.is_zero() {
                return Err(ConfigError::ZeroTimeout(flag));
            }
        }
        let min_healthy_endpoints = r
            .min_healthy_endpoints
            .or(file.min_healthy_endpoints)
            .unwrap_or(1);
        // Discovered endpoints are not known yet: any number may be wanted.
        if discovery.is_none() && min_healthy_endpoints > endpoints.len() {
            return Err(ConfigError::MinHealthy {
                wanted: min_healthy_endpoints,
                endpoints: endpoints.len(),
            });
        }
        let budget_defaults = RetryBudgetConfig::default();
        let retry_budget = RetryBudgetConfig {
            ratio: r
                .retry_budget_ratio
                .or(file.retry_budget_ratio)
                .unwrap_or(budget_defaults.ratio),
            min_per_sec: r
                .retry_budget_min_per_sec
                .or(file.retry_budget_min_per_sec)
                .unwrap_or(budget_defaults.min_per_sec),
        };
        if !(0.0..=100.0).contains(&retry_budget.ratio) {
            return Err(ConfigError::RetryBudgetRatio(retry_budget.ratio));
        }
        let outlier_defaults = OutlierConfig::default();
        let outlier = OutlierConfig {
            consecutive_failures: r
                .outlier_failures
                .or(file.outlier_failures)
                .unwrap_or(outlier_defaults.consecutive_failures),
            base_ejection: duration(
                r.outlier_base_ejection,
                file.outlier_base_ejection,
                outlier_defaults.base_ejection,
            ),
            max_ejection: duration(
                r.outlier_max_ejection,
                file.outlier_max_ejection,
                outlier_defaults.max_ejection,
            ),
        };
        if outlier.base_ejection.is_zero() || outlier.base_ejection > outlier.max_ejection {
            return Err(ConfigError::Ejection {
                base: outlier.base_ejection,
                max: outlier.max_ejection,
            });
        }
        Ok(Config {
            listen: SocketAddr::new(host, port),
            endpoints,
            endpoints_file: args.config.clone().filter(|_| args.endpoints.is_empty()),
            discovery,
            policy_name,
            policy_path,
            policy_config,
            plugins,
            policies,
            admin,
            model_source,
            model,
            routing: RouterConfig {
                retry,
                retry_budget,
                request_timeout,
            },
            min_healthy_endpoints,
            timeouts,
            outlier,
            max_body_bytes,
            default_max_tokens,
            limits,
            admission: edge.admission,
            connections: edge.connections,
            drain: edge.drain,
            workers: r.workers.or(file.workers).unwrap_or_else(|| {
                std::thread::available_parallelism().unwrap_or(NonZeroUsize::MIN)
            }),
        })
    }
}

/// The `[[endpoints]]` of the config file at `path`, checked as at startup: what a SIGHUP
/// reconciles the live list with.
pub fn endpoints_in_file(path: &Path) -> Result<Vec<EndpointSpec>, ConfigError> {
    let args = ServeArgs {
        config: Some(path.to_owned()),
        ..ServeArgs::default()
    };
    let file = read_file(path)?;
    let discovered = file.discovery.kind.is_some();
    endpoints(&args, file.endpoints, discovered)
}

/// `--discovery` and its flags over the file's `[discovery]`, checked.
fn discovery(args: &ServeArgs, file: DiscoveryKeys) -> Result<Option<K8sDiscovery>, ConfigError> {
    let Some(DiscoveryKind::K8s) = args.discovery.or(file.kind) else {
        let k8s_flags = args.k8s_selector.is_some()
            || args.k8s_namespace.is_some()
            || args.k8s_resync.is_some();
        return if k8s_flags {
            Err(ConfigError::K8sWithoutDiscovery)
        } else {
            Ok(None)
        };
    };
    if !cfg!(feature = "k8s") {
        return Err(ConfigError::DiscoveryNotBuilt);
    }
    let selector = args
        .k8s_selector
        .clone()
        .or(file.k8s_selector)
        .filter(|s| !s.trim().is_empty())
        .ok_or(ConfigError::NoSelector)?;
    let resync = duration(args.k8s_resync, file.k8s_resync, DEFAULT_K8S_RESYNC);
    if resync.is_zero() {
        return Err(ConfigError::ZeroTimeout("k8s-resync"));
    }
    Ok(Some(K8sDiscovery {
        selector,
        namespace: args.k8s_namespace.clone().or(file.k8s_namespace),
        resync,
    }))
}

/// The server edge's keys of the config file.
struct EdgeKeys {
    max_concurrent_requests: Option<u32>,
    max_queued_requests: Option<u32>,
    queue_timeout: Option<TextDuration>,
    header_read_timeout: Option<TextDuration>,
    body_read_timeout: Option<TextDuration>,
    keep_alive_timeout: Option<TextDuration>,
    max_connections: Option<u32>,
    drain_delay: Option<TextDuration>,
    shutdown_grace: Option<TextDuration>,
}

/// Admission, connection limits and drain, validated.
struct Edge {
    admission: AdmissionConfig,
    connections: ConnectionLimits,
    drain: DrainConfig,
}

fn edge_settings(r: &RouterArgs, file: EdgeKeys) -> Result<Edge, ConfigError> {
    let (admission, connections, drain) = (
        AdmissionConfig::default(),
        ConnectionLimits::default(),
        DrainConfig::default(),
    );
    let admission = AdmissionConfig {
        max_concurrent: r
            .max_concurrent_requests
            .or(file.max_concurrent_requests)
            .unwrap_or(admission.max_concurrent),
        max_queued: r
            .max_queued_requests
            .or(file.max_queued_requests)
            .unwrap_or(admission.max_queued),
        queue_timeout: duration(r.queue_timeout, file.queue_timeout, admission.queue_timeout),
    };
    let connections = ConnectionLimits {
        header_read_timeout: duration(
            r.header_read_timeout,
            file.header_read_timeout,
            connections.header_read_timeout,
        ),
        body_read_timeout: duration(
            r.body_read_timeout,
            file.body_read_timeout,
            connections.body_read_timeout,
        ),
        keep_alive_timeout: duration(
            r.keep_alive_timeout,
            file.keep_alive_timeout,
            connections.keep_alive_timeout,
        ),
        max_connections: r
            .max_connections
            .or(file.max_connections)
            .unwrap_or(connections.max_connections),
    };
    // Zero is a valid drain: no delay (nothing balances load in front), or no grace.
    let drain = DrainConfig {
        delay: duration(r.drain_delay, file.drain_delay, drain.delay),
        grace: duration(r.shutdown_grace, file.shutdown_grace, drain.grace),
    };
    for (flag, value) in [
        ("queue-timeout", admission.queue_timeout),
        ("header-read-timeout", connections.header_read_timeout),
        ("body-read-timeout", connections.body_read_timeout),
        ("keep-alive-timeout", connections.keep_alive_timeout),
    ] {
        if value.is_zero() {
            return Err(ConfigError::ZeroTimeout(flag));
        }
    }
    for (flag, value) in [
        ("max-concurrent-requests", admission.max_concurrent),
        ("max-connections", connections.max_connections),
    ] {
        if value == 0 {
            return Err(ConfigError::ZeroLimit(flag));
        }
    }
    Ok(Edge {
        admission,
        connections,
        drain,
    })
}

fn read_file(path: &Path) -> Result<FileConfig, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::ReadFile {
        path: path.to_owned(),
        source,
    })?;
    toml::from_str(&text).map_err(|e| ConfigError::ParseFile {
        path: path.to_owned(),
        reason: e.to_string(),
    })
}

/// The static endpoints; none is an error unless `discovered` ones will come.
fn endpoints(
    args: &ServeArgs,
    from_file: Vec<EndpointSpec>,
    discovered: bool,
) -> Result<Vec<EndpointSpec>, ConfigError> {
    let specs = if args.endpoints.is_empty() {
        if !args.endpoint_num_gpus.is_empty() {
            return Err(ConfigError::NumGpusCount {
                given: args.endpoint_num_gpus.len(),
                endpoints: 0,
            });
        }
        from_file
    } else {
        let n = args.endpoints.len();
        let gpus = match args.endpoint_num_gpus.len() {
            0 => vec![1; n],
            given if given == n => args.endpoint_num_gpus.clone(),
            given => {
                return Err(ConfigError::NumGpusCount {
                    given,
                    endpoints: n,
                });
            }
        };
        args.endpoints
            .iter()
            .zip(gpus)
            .enumerate()
            .map(|(index, (flag, num_gpus))| {
                let mut spec = endpoint_flag(flag).map_err(|reason| ConfigError::BadEndpoint {
                    index,
                    url: flag.clone(),
                    reason,
                })?;
                spec.num_gpus = num_gpus;
                Ok(spec)
            })
            .collect::<Result<_, ConfigError>>()?
    };
    if specs.is_empty() && !discovered {
        return Err(ConfigError::NoEndpoints);
    }
    for (index, spec) in specs.iter().enumerate() {
        spec.check().map_err(|reason| ConfigError::BadEndpoint {
            index,
            url: spec.url.clone(),
            reason,
        })?;
    }
    Ok(specs)
}

/// One `--endpoint` flag: `[PROTOCOL+]URL[,role=ROLE][,bootstrap_port=N]`.
fn endpoint_flag(flag: &str) -> Result<EndpointSpec, String> {
    let mut parts = flag.split(',');
    let url = parts.next().unwrap_or_default();
    let (protocol, url) = match url.split_once('+') {
        Some((protocol, url)) => (protocol.parse::<Protocol>()?, url),
        None => (Protocol::Mlc, url),
    };
    let mut spec = EndpointSpec {
        url: url.to_owned(),
        role: Role::Any,
        num_gpus: 1,
        device_rank: None,
        api_key: None,
        protocol,
        bootstrap_port: None,
    };
    for option in parts {
        match option.split_once('=') {
            Some(("role", role)) => {
                spec.role = match role {
                    "any" => Role::Any,
                    "prefill" => Role::Prefill,
                    "decode" => Role::Decode,
                    other => {
                        return Err(format!(
                            "unknown role {other:?}: expected any, prefill or decode"
                        ));
                    }
                };
            }
            Some(("bootstrap_port", port)) => {
                spec.bootstrap_port = Some(
                    port.parse()
                        .map_err(|_| format!("bootstrap_port {port:?} is not a port number"))?,
                );
            }
            _ => {
                return Err(format!(
                    "unknown option {option:?}: expected role=ROLE or bootstrap_port=N"
                ));
            }
        }
    }
    Ok(spec)
}

fn policy_path(plugins: &Path, name: &str) -> Result<PathBuf, ConfigError> {
    existing_policy(plugins, name).map_err(|reason| ConfigError::BadPolicy {
        name: name.to_owned(),
        reason,
    })
}

/// `<plugins>/<name>.wasm`, if `name` is a plain file stem and the file exists.
fn existing_policy(plugins: &Path, name: &str) -> Result<PathBuf, String> {
    if name.is_empty() || name.contains(['/', '\\']) || name.starts_with('.') {
        return Err("a policy name is a file stem in the plugins directory".into());
    }
    let path = plugins.join(format!("{name}.wasm"));
    if !path.is_file() {
        return Err(format!(
            "{} does not exist (build the built-in policies with `make plugins`)",
            path.display()
        ));
    }
    Ok(path)
}

/// The policy keys of the config file.
struct PolicyKeys {
    fallback: Option<String>,
    header: Option<bool>,
    forward_headers: Option<Vec<String>>,
    models: BTreeMap<String, String>,
    faults: Option<u32>,
    window_ms: Option<u64>,
}

/// Fallback, per-model mapping, header switch and quarantine rule. The default fallback may be
/// missing from the plugins directory (faults then fail their requests); one named explicitly
/// must exist.
fn policy_settings(
    args: &RouterArgs,
    file: PolicyKeys,
    plugins: &Path,
) -> Result<PolicySettings, ConfigError> {
    let fallback = match args.fallback_policy.clone().or(file.fallback) {
        Some(name) if name == NO_FALLBACK => None,
        Some(name) => {
            existing_policy(plugins, &name).map_err(|reason| ConfigError::BadFallback {
                name: name.clone(),
                reason,
            })?;
            Some(name)
        }
        None => Some(DEFAULT_FALLBACK_POLICY.to_owned()),
    };
    for (model, name) in &file.models {
        existing_policy(plugins, name).map_err(|reason| ConfigError::BadModelPolicy {
            model: model.clone(),
            name: name.clone(),
            reason,
        })?;
    }
    let defaults = QuarantineRule::default();
    let faults = args
        .quarantine_faults
        .or(file.faults)
        .unwrap_or(defaults.faults);
    let window_ms = args
        .quarantine_window_ms
        .or(file.window_ms)
        .unwrap_or(u64::try_from(defaults.window.as_millis()).unwrap_or(u64::MAX));
    if faults == 0 || window_ms == 0 {
        return Err(ConfigError::Quarantine);
    }
    let forward_headers = if args.forward_headers.is_empty() {
        file.forward_headers
            .unwrap_or_else(|| DEFAULT_FORWARD_HEADERS.map(str::to_owned).to_vec())
    } else {
        args.forward_headers.clone()
    };
    let forward_headers = forward_headers
        .into_iter()
        .map(|name| match http::HeaderName::from_bytes(name.as_bytes()) {
            Ok(header) => Ok(header.as_str().to_owned()),
            Err(_) => Err(ConfigError::ForwardHeader(name)),
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(PolicySettings {
        fallback,
        models: file.models,
        header: !args.no_policy_header && file.header.unwrap_or(true),
        forward_headers,
        quarantine: QuarantineRule {
            faults,
            window: Duration::from_millis(window_ms),
        },
    })
}

fn admin_settings(
    args: &RouterArgs,
    file_token: Option<String>,
    file_port: Option<u16>,
    host: IpAddr,
    port: u16,
) -> Result<AdminSettings, ConfigError> {
    let token = args.admin_token.clone().or(file_token);
    if token.as_deref().is_some_and(str::is_empty) {
        return Err(ConfigError::AdminToken);
    }
    let admin_port = args.admin_port.or(file_port);
    if let Some(admin_port) = admin_port
        && admin_port == port
        && port != 0
    {
        return Err(ConfigError::AdminPort(admin_port));
    }
    Ok(AdminSettings {
        token,
        listen: admin_port.map(|p| SocketAddr::new(host, p)),
    })
}

fn compact_json(text: &str) -> Result<String, ConfigError> {
    let value: serde_json::Value =
        serde_json::from_str(text).map_err(|e| ConfigError::PolicyConfig(e.to_string()))?;
    Ok(value.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plugins_with(name: &str) -> tempfile::TempDir {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join(format!("{name}.wasm")), b"\0asm").expect("write");
        dir
    }

    fn args(plugins: &Path) -> ServeArgs {
        ServeArgs {
            endpoints: vec!["http://127.0.0.1:1".into(), "http://127.0.0.1:2".into()],
            router: RouterArgs {
                plugins: Some(plugins.to_owned()),
                ..RouterArgs::default()
            },
            ..ServeArgs::default()
        }
    }

    #[test]
    fn model_dir_must_hold_a_tokenizer_or_be_a_gguf() {
        let plugins = plugins_with("disagg");
        let with = |path: &Path| {
            let mut a = args(plugins.path());
            a.router.model_dir = Some(path.to_owned());
            Config::from_args(&a)
        };
        let empty = tempfile::tempdir().expect("tempdir");
        let err = with(empty.path()).expect_err("no tokenizer.json");
        assert!(matches!(err, ConfigError::ModelDir { .. }), "{err}");
        let not_gguf = empty.path().join("weights.gguf");
        std::fs::write(&not_gguf, b"GGML but not GGUF").expect("write");
        let err = with(&not_gguf).expect_err("not a GGUF");
        assert!(err.to_string().contains("not a usable GGUF"), "{err}");
        // A directory is named after itself, and leaves the context length at the default.
        let model = tempfile::tempdir().expect("tempdir");
        let dir = model.path().join("tiny-llama");
        std::fs::create_dir(&dir).expect("mkdir");
        std::fs::write(dir.join("tokenizer.json"), b"{}").expect("write");
        let config = with(&dir).expect("a model directory");
        assert_eq!(config.model, "tiny-llama");
        assert_eq!(config.limits.context_length, DEFAULT_CONTEXT_LENGTH);
    }

    #[test]
    fn flags_give_a_config_with_defaults() {
        let dir = plugins_with("disagg");
        let config = Config::from_args(&args(dir.path())).expect("valid");
        assert_eq!(config.listen, "127.0.0.1:8000".parse().expect("addr"));
        assert_eq!(config.endpoints.len(), 2);
        assert_eq!(config.policy_path, dir.path().join("disagg.wasm"));
        assert_eq!(config.max_body_bytes, DEFAULT_MAX_BODY_BYTES);
        assert_eq!(config.routing, RouterConfig::default());
        assert_eq!(config.timeouts, Timeouts::default());
        assert_eq!(config.outlier, OutlierConfig::default());
        // The defaults `--help` and the README give.
        assert_eq!(config.max_body_bytes, 4 << 20);
        assert_eq!(
            config.admission,
            AdmissionConfig {
                max_concurrent: 1024,
                max_queued: 1024,
                queue_timeout: Duration::from_secs(5),
            }
        );
        assert_eq!(
            config.connections,
            ConnectionLimits {
                header_read_timeout: Duration::from_secs(10),
                body_read_timeout: Duration::from_secs(30),
                keep_alive_timeout: Duration::from_secs(75),
                max_connections: 4096,
            }
        );
        assert_eq!(
            config.drain,
            DrainConfig {
                delay: Duration::from_secs(5),
                grace: Duration::from_secs(30),
            }
        );
    }

    #[test]
    fn edge_settings_come_from_flags_over_the_file_and_are_checked() {
        let dir = plugins_with("disagg");
        let file = dir.path().join("router.toml");
        std::fs::write(
            &file,
            format!(
                "plugins = {:?}\nmax_concurrent_requests = 8\nmax_queued_requests = 0\n\
                 queue_timeout = \"250ms\"\nheader_read_timeout = \"2s\"\n\
                 body_read_timeout = \"3s\"\nkeep_alive_timeout = \"4s\"\nmax_connections = 16\n\
                 drain_delay = \"0s\"\nshutdown_grace = \"1m\"\n\
                 [[endpoints]]\nurl = \"http://127.0.0.1:1\"\n",
                dir.path()
            ),
        )
        .expect("write");
        let mut a = ServeArgs {
            config: Some(file),
            ..ServeArgs::default()
        };
        let config = Config::from_args(&a).expect("valid");
        assert_eq!(
            config.admission,
            AdmissionConfig {
                max_concurrent: 8,
                max_queued: 0,
                queue_timeout: Duration::from_millis(250),
            }
        );
        assert_eq!(
            config.connections,
            ConnectionLimits {
                header_read_timeout: Duration::from_secs(2),
                body_read_timeout: Duration::from_secs(3),
                keep_alive_timeout: Duration::from_secs(4),
                max_connections: 16,
            }
        );
        assert_eq!(
            config.drain,
            DrainConfig {
                delay: Duration::ZERO,
                grace: Duration::from_secs(60),
            }
        );
        a.router.max_concurrent_requests = Some(2);
        a.router.drain_delay = Some(Duration::from_secs(1));
        let config = Config::from_args(&a).expect("valid");
        assert_eq!(config.admission.max_concurrent, 2);
        assert_eq!(config.drain.delay, Duration::from_secs(1));

        a.router.max_concurrent_requests = Some(0);
        assert!(matches!(
            Config::from_args(&a),
            Err(ConfigError::ZeroLimit("max-concurrent-requests"))
        ));
        a.router.max_concurrent_requests = None;
        a.router.max_connections = Some(0);
        assert!(matches!(
            Config::from_args(&a),
            Err(ConfigError::ZeroLimit("max-connections"))
        ));
        a.router.max_connections = None;
        a.router.header_read_timeout = Some(Duration::ZERO);
        assert!(matches!(
            Config::from_args(&a),
            Err(ConfigError::ZeroTimeout("header-read-timeout"))
        ));
    }

    #[test]
    fn workers_come_from_the_flag_over_the_file_over_the_cores() {
        let dir = plugins_with("disagg");
        let file = dir.path().join("router.toml");
        let write = |workers: &str| {
            std::fs::write(
                &file,
                format!(
                    "plugins = {:?}\n{workers}\n[[endpoints]]\nurl = \"http://127.0.0.1:1\"\n",
                    dir.path()
                ),
            )
            .expect("write")
        };
        let mut a = ServeArgs {
            config: Some(file.clone()),
            ..ServeArgs::default()
        };
        write("");
        let cores = std::thread::available_parallelism().expect("a core count");
        assert_eq!(Config::from_args(&a).expect("valid").workers, cores);
        write("workers = 3");
        assert_eq!(Config::from_args(&a).expect("valid").workers.get(), 3);
        a.router.workers = NonZeroUsize::new(5);
        assert_eq!(Config::from_args(&a).expect("valid").workers.get(), 5);
        a.router.workers = None;
        write("workers = 0");
        let refused = Config::from_args(&a).expect_err("zero workers");
        assert!(refused.to_string().contains("workers"), "{refused}");
    }

    #[test]
    fn fault_settings_come_from_flags_over_the_file_and_are_checked() {
        let dir = plugins_with("disagg");
        let file = dir.path().join("router.toml");
        std::fs::write(
            &file,
            format!(
                "plugins = {:?}\nrequest_timeout = \"90s\"\noutlier_failures = 5\n\
                 outlier_base_ejection = \"250ms\"\noutlier_max_ejection = \"1m\"\n\
                 retry_budget_ratio = 0.5\nretry_budget_min_per_sec = 2\n\
                 [[endpoints]]\nurl = \"http://127.0.0.1:1\"\n",
                dir.path()
            ),
        )
        .expect("write");
        let mut a = ServeArgs {
            config: Some(file.clone()),
            ..ServeArgs::default()
        };
        let config = Config::from_args(&a).expect("valid");
        assert_eq!(config.routing.request_timeout, Duration::from_secs(90));
        assert_eq!(
            config.outlier,
            OutlierConfig {
                consecutive_failures: 5,
                base_ejection: Duration::from_millis(250),
                max_ejection: Duration::from_secs(60),
            }
        );
        assert_eq!(
            config.routing.retry_budget,
            RetryBudgetConfig {
                ratio: 0.5,
                min_per_sec: 2
            }
        );
        a.router.request_timeout = Some(Duration::from_secs(5));
        a.router.outlier_failures = Some(0);
        let config = Config::from_args(&a).expect("valid");
        assert_eq!(config.routing.request_timeout, Duration::from_secs(5));
        assert_eq!(config.outlier.consecutive_failures, 0);

        a.router.outlier_base_ejection = Some(Duration::from_secs(120));
        assert!(matches!(
            Config::from_args(&a),
            Err(ConfigError::Ejection { .. })
        ));
        a.router.outlier_base_ejection = None;
        a.router.retry_budget_ratio = Some(-1.0);
        assert!(matches!(
            Config::from_args(&a),
            Err(ConfigError::RetryBudgetRatio(_))
        ));
        a.router.retry_budget_ratio = None;
        a.router.request_timeout = Some(Duration::ZERO);
        assert!(matches!(
            Config::from_args(&a),
            Err(ConfigError::ZeroTimeout("request-timeout"))
        ));
        a.router.request_timeout = None;
        a.router.stream_idle_timeout = Some(Duration::from_millis(1500));
        let config = Config::from_args(&a).expect("valid");
        assert_eq!(config.timeouts.stream_idle, Duration::from_millis(1500));
        assert_eq!(config.timeouts.call, Timeouts::default().call);
        std::fs::write(&file, "request_timeout = \"soon\"\n").expect("write");
        let error = Config::from_args(&a)
            .expect_err("not a duration")
            .to_string();
        assert!(error.contains("\"soon\" is not a duration"), "{error}");
    }

    #[test]
    fn bad_values_name_what_is_wrong() {
        let dir = plugins_with("disagg");
        let mut a = args(dir.path());
        a.endpoints.clear();
        assert!(matches!(
            Config::from_args(&a),
            Err(ConfigError::NoEndpoints)
        ));
        let mut a = args(dir.path());
        a.endpoints.push("ftp://x".into());
        assert!(matches!(
            Config::from_args(&a),
            Err(ConfigError::BadEndpoint { index: 2, .. })
        ));
        let mut a = args(dir.path());
        a.endpoint_num_gpus = vec![1];
        assert!(matches!(
            Config::from_args(&a),
            Err(ConfigError::NumGpusCount {
                given: 1,
                endpoints: 2
            })
        ));
        let mut a = args(dir.path());
        a.router.policy = Some("missing".into());
        assert!(matches!(
            Config::from_args(&a),
            Err(ConfigError::BadPolicy { .. })
        ));
        let mut a = args(dir.path());
        a.router.policy_config = Some("{oops".into());
        assert!(matches!(
            Config::from_args(&a),
            Err(ConfigError::PolicyConfig(_))
        ));
        let mut a = args(dir.path());
        a.router.max_attempts = Some(0);
        assert!(matches!(Config::from_args(&a), Err(ConfigError::Retry(_))));
    }

    #[test]
    fn policy_and_admin_settings_have_defaults_and_are_checked() {
        let dir = plugins_with("disagg");
        let config = Config::from_args(&args(dir.path())).expect("valid");
        assert_eq!(config.plugins, dir.path());
        assert_eq!(
            config.policies.fallback.as_deref(),
            Some(DEFAULT_FALLBACK_POLICY)
        );
        assert!(config.policies.header);
        assert_eq!(config.policies.forward_headers, ["x-priority"]);
        assert_eq!(config.policies.quarantine, QuarantineRule::default());
        assert_eq!(config.admin, AdminSettings::default());

        let mut a = args(dir.path());
        a.router.fallback_policy = Some(NO_FALLBACK.into());
        a.router.no_policy_header = true;
        a.router.admin_token = Some("s3cret".into());
        a.router.admin_port = Some(9001);
        a.router.forward_headers = vec!["X-Tenant".into(), "x-priority".into()];
        let config = Config::from_args(&a).expect("valid");
        assert_eq!(config.policies.forward_headers, ["x-tenant", "x-priority"]);
        assert_eq!(config.policies.fallback, None);
        assert!(!config.policies.header);
        assert_eq!(config.admin.token.as_deref(), Some("s3cret"));
        assert_eq!(
            config.admin.listen,
            Some("127.0.0.1:9001".parse().expect("addr"))
        );

        let refused = |edit: &dyn Fn(&mut ServeArgs)| {
            let mut a = args(dir.path());
            edit(&mut a);
            Config::from_args(&a).expect_err("refused")
        };
        assert!(matches!(
            refused(&|a| a.router.fallback_policy = Some("missing".into())),
            ConfigError::BadFallback { .. }
        ));
        assert!(matches!(
            refused(&|a| a.router.admin_token = Some(String::new())),
            ConfigError::AdminToken
        ));
        assert!(matches!(
            refused(&|a| a.router.admin_port = Some(DEFAULT_PORT)),
            ConfigError::AdminPort(DEFAULT_PORT)
        ));
        assert!(matches!(
            refused(&|a| a.router.quarantine_faults = Some(0)),
            ConfigError::Quarantine
        ));
        assert!(matches!(
            refused(&|a| a.router.forward_headers = vec!["bad header".into()]),
            ConfigError::ForwardHeader(_)
        ));
    }

    #[test]
    fn the_file_maps_models_to_policies_that_exist() {
        let dir = plugins_with("disagg");
        std::fs::write(dir.path().join("round-robin.wasm"), b"\0asm").expect("write");
        let file = dir.path().join("router.toml");
        let write = |mapping: &str| {
            std::fs::write(
                &file,
                format!(
                    "plugins = {:?}\nquarantine_faults = 2\n[model_policies]\n{mapping}\n",
                    dir.path()
                ),
            )
            .expect("write")
        };
        let with_file = ServeArgs {
            config: Some(file.clone()),
            endpoints: vec!["http://127.0.0.1:1".into()],
            ..ServeArgs::default()
        };
        write(r#"small = "round-robin""#);
        let config = Config::from_args(&with_file).expect("valid");
        assert_eq!(
            config.policies.models.get("small").map(String::as_str),
            Some("round-robin")
        );
        assert_eq!(config.policies.quarantine.faults, 2);
        write(r#"small = "missing""#);
        assert!(matches!(
            Config::from_args(&with_file),
            Err(ConfigError::BadModelPolicy { .. })
        ));
    }

    #[test]
    fn discovery_comes_from_flags_over_the_file_and_needs_a_selector() {
        let dir = plugins_with("disagg");
        let file = dir.path().join("router.toml");
        std::fs::write(
            &file,
            format!(
                "plugins = {:?}\n[discovery]\nkind = \"k8s\"\n\
                 k8s_selector = \"app=engine,tier=serve\"\nk8s_resync = \"5s\"\n",
                dir.path()
            ),
        )
        .expect("write");
        let from_file = ServeArgs {
            config: Some(file),
            ..ServeArgs::default()
        };
        let flags = ServeArgs {
            discovery: Some(DiscoveryKind::K8s),
            k8s_selector: Some("app=engine".into()),
            k8s_namespace: Some("serving".into()),
            endpoints: Vec::new(),
            ..args(dir.path())
        };
        if !cfg!(feature = "k8s") {
            assert!(matches!(
                Config::from_args(&from_file),
                Err(ConfigError::DiscoveryNotBuilt)
            ));
            return;
        }
        // No static endpoint is needed, and any number may be wanted healthy.
        let config = Config::from_args(&from_file).expect("valid");
        assert!(config.endpoints.is_empty());
        assert_eq!(
            config.discovery,
            Some(K8sDiscovery {
                selector: "app=engine,tier=serve".into(),
                namespace: None,
                resync: Duration::from_secs(5),
            })
        );
        let config = Config::from_args(&flags).expect("valid");
        assert_eq!(
            config.discovery,
            Some(K8sDiscovery {
                selector: "app=engine".into(),
                namespace: Some("serving".into()),
                resync: DEFAULT_K8S_RESYNC,
            })
        );
        let no_selector = ServeArgs {
            k8s_selector: Some(" ".into()),
            ..flags.clone()
        };
        assert!(matches!(
            Config::from_args(&no_selector),
            Err(ConfigError::NoSelector)
        ));
        let zero = ServeArgs {
            k8s_resync: Some(Duration::ZERO),
            ..flags.clone()
        };
        assert!(matches!(
            Config::from_args(&zero),
            Err(ConfigError::ZeroTimeout("k8s-resync"))
        ));
        let stray = ServeArgs {
            discovery: None,
            ..flags
        };
        assert!(matches!(
            Config::from_args(&stray),
            Err(ConfigError::K8sWithoutDiscovery)
        ));
    }

    #[test]
    fn a_toml_file_gives_endpoints_roles_and_policy_config() {
        let dir = plugins_with("disagg");
        let file = dir.path().join("router.toml");
        std::fs::write(
            &file,
            format!(
                "port = 9000\nplugins = {:?}\npolicy_config = {{ pd_balance_factor = 0.1 }}\n\
                 [[endpoints]]\nurl = \"http://127.0.0.1:1\"\nrole = \"prefill\"\nnum_gpus = 4\n\
                 [[endpoints]]\nurl = \"http://127.0.0.1:2\"\nrole = \"decode\"\n",
                dir.path()
            ),
        )
        .expect("write");
        let config = Config::from_args(&ServeArgs {
            config: Some(file),
            ..ServeArgs::default()
        })
        .expect("valid");
        assert_eq!(config.listen.port(), 9000);
        assert_eq!(config.endpoints[0].role, Role::Prefill);
        assert_eq!(config.endpoints[0].num_gpus, 4);
        assert_eq!(config.endpoints[1].num_gpus, 1);
        assert_eq!(
            config.policy_config.as_deref(),
            Some(r#"{"pd_balance_factor":0.1}"#)
        );
    }

    #[test]
    fn an_unknown_key_anywhere_in_the_file_is_an_error_that_names_it() {
        let dir = plugins_with("disagg");
        let file = dir.path().join("router.toml");
        let args = ServeArgs {
            config: Some(file.clone()),
            ..ServeArgs::default()
        };
        for (text, key) in [
            ("prot = 9000\n", "prot"),
            (
                "[[endpoints]]\nurl = \"http://127.0.0.1:1\"\nnum_gpu = 2\n",
                "num_gpu",
            ),
        ] {
            std::fs::write(&file, format!("plugins = {:?}\n{text}", dir.path())).expect("write");
            let error = Config::from_args(&args)
                .expect_err("unknown key")
                .to_string();
            assert!(error.contains(key), "{error}");
        }
    }
}
