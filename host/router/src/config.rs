//! The router's configuration: flags and an optional TOML file, parsed and validated once at
//! startup into a typed [`Config`]. A bad value is reported with where it came from (the flag,
//! the environment variable, or the file's key and line) before any port is bound.
//!
//! Each setting is declared once, in `settings` (or `discovery` for `[discovery]`): its doc is
//! its `--help` text, and its flag, file key, environment variable, default and check are
//! written beside it. A flag wins over its environment variable, which wins over the file,
//! which wins over the default.
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
//! tls_cert = "/etc/switchyard/tls.crt"        # HTTPS on every listener (HTTP/1.1 and h2, ALPN)
//! tls_key = "/etc/switchyard/tls.key"
//! engine_ca_file = "/etc/engines/ca.pem"      # https:// engines: trust this CA, not the system's
//! engine_client_cert = "/etc/engines/router.crt"  # mTLS to https:// engines
//! engine_client_key = "/etc/engines/router.key"
//! otlp_endpoint = "http://otel-collector:4318"  # traces over OTLP (see crate::telemetry)
//! model_dir = "/models/llama"                  # shorthand for one [[models]] entry: its tokenizer
//! model = "llama"                              # and name (the default model when given)
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
//! worker_spin = "20us"                        # busy-wait before a worker sleeps ("0s": off)
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
//! kv_events_stale_after = "10s"               # an endpoint's KV events silent this long
//!                                             # after it served a prompt: index not trusted
//! kv_events_dp_size = 1                       # DP ranks of an endpoint that does not say
//!
//! [flow_control]                              # how the queue orders what waits
//! enabled = true                              # false: first come, first served
//! fairness = "round-robin"                    # or "least-service" (tokens), between tenants
//! priority_header = "x-priority"              # an integer, higher first
//!
//! saturation_waiting = 5                      # an engine with this many waiting is saturated,
//! saturation_kv_usage = 0.95                  # or with this share of its KV cache in use:
//!                                             # left out of plans while another has room
//! # saturation_in_flight = 64                 # or this many legs in flight (unset: not judged)
//! target_saturation = 0.8                     # what switchyard_desired_replicas aims at
//! # scale_from_zero_timeout_ms = 120000       # hold requests while no endpoint is ready
//!
//! [flow_control.tenant_weights]               # a tenant's share (x-tenant, else `user`)
//! acme = 3                                    # tenants not listed weigh 1
//!
//! [[endpoints]]
//! url = "http://127.0.0.1:8081"
//! protocol = "mlc"    # mlc (default) | vllm | sglang | openai (any OpenAI-compatible server)
//! models = ["llama"]  # pinned: the models it serves (default: what its /v1/models lists)
//! role = "prefill"    # any | prefill | decode (a hint on mlc; binding on vllm and sglang)
//! num_gpus = 1        # mlc: GPUs in the KV-transfer world
//! api_key = { env = "ENGINE_API_KEY" }  # or "…": sent as `Authorization: Bearer` on every call
//!
//! [[endpoints]]
//! url = "https://engine.other-ns.svc:8000"  # TLS: the system's roots, or engine_ca_file
//! protocol = "vllm"
//! ca_file = "/etc/engines/ca.pem"           # this endpoint's own CA, client_cert and
//! client_cert = "/etc/engines/router.crt"   # client_key (each wins over engine_*)
//! client_key = "/etc/engines/router.key"
//!
//! [[endpoints]]
//! url = "http://10.0.0.5:30000"
//! protocol = "sglang"
//! role = "prefill"
//! bootstrap_port = 8998  # an sglang prefill's --disaggregation-bootstrap-port (required)
//! kv_events = "tcp://10.0.0.5:5557"         # the engine's KV-event PUB socket (optional)
//! kv_events_replay = "tcp://10.0.0.5:5558"  # its replay socket (optional)
//! kv_events_topic = "kv"                    # a topic prefix (default: every topic)
//! kv_events_dp_size = 1                     # DP ranks; rank r at both ports + r (default 1)
//!
//!
//! [epp]                                        # `switchyard epp` only (`serve` ignores it)
//! grpc_port = 9002                             # the ext_proc service
//! grpc_health_port = 9003
//! metrics_port = 9090
//! destination_fallbacks = 0                    # endpoints after the pick, for override_host
//!
//! [model_policies]                            # model name -> policy, for requests without
//! llama = "round-robin"                        # an x-switchyard-policy header (shorthand)
//!
//! [[models]]                                   # a model served; the first is the default
//! name = "qwen"                                # unless model/model_dir give one
//! model_dir = "/models/qwen"                   # its tokenizer and chat template (default:
//! policy = "kv-aware"                          # byte-level) and policy (default: `policy`)
//!
//! [discovery]                                  # engines found while serving (feature `k8s`)
//! kind = "k8s"                                 # pods from the Kubernetes API
//! k8s_selector = "app=engine,model=llama"      # one label selector, sent whole
//! # k8s_inference_pool = "llama"               # or an InferencePool's selector and target port
//! k8s_namespace = "serving"                    # default: the kubeconfig's or the pod's own
//! k8s_resync = "30s"                           # list again and reconcile this often
//! ```
//!
//! Flags override the file; `--endpoint` flags replace the file's endpoints. An `--endpoint`
//! is `[PROTOCOL+]URL[,role=ROLE][,bootstrap_port=N][,kv_events=tcp://…[,kv_events_replay=tcp://…]]`, e.g.
//! `--endpoint sglang+http://10.0.0.5:30000,role=prefill,bootstrap_port=8998`.

mod discovery;
mod endpoints;
mod epp;
mod error;
mod file;
mod flow_control;
mod model;
mod policy;
mod settings;
mod source;
mod table;
#[cfg(test)]
mod tests;
mod tls;

use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::path::PathBuf;

use crate::api::{AdmissionConfig, ConnectionLimits, DrainConfig, RequestLimits};
use crate::cluster::{EndpointSpec, OutlierConfig, SaturationConfig};
use crate::engine_client::{Timeouts, TlsFiles};
use crate::kv_events::SubscriberConfig;
use crate::telemetry::TraceSettings;
use crate::{RetryBudgetConfig, RetryPolicy, RouterConfig};

pub use discovery::{DEFAULT_K8S_RESYNC, DiscoveryArgs, DiscoveryKind, K8sDiscovery, PodSelection};
pub use endpoints::endpoints_in_file;
pub use epp::{
    DEFAULT_GRPC_HEALTH_PORT, DEFAULT_GRPC_PORT, DEFAULT_METRICS_PORT, EndpointPicker,
    EndpointPickerArgs,
};
pub use error::{ConfigError, Problem};
pub use flow_control::FlowControlArgs;
pub use model::{ModelSource, ServedModel};
pub use policy::PolicySettings;
pub use settings::{
    DEFAULT_CONTEXT_LENGTH, DEFAULT_FALLBACK_POLICY, DEFAULT_FORWARD_HEADERS,
    DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_TOKENS, DEFAULT_MODEL, DEFAULT_POLICY, DEFAULT_PORT,
    NO_FALLBACK, RouterArgs, ServeArgs,
};
pub(crate) use settings::{DEFAULT_MAX_ATTEMPTS, RETRY_MAX_DELAY, RETRY_MIN_DELAY};
pub use source::{FileKey, Source, Sourced};
pub use tls::ListenerTls;

use file::ConfigFile;
use settings::RouterSettings;
use table::Checked as _;

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
    /// Where the default model's tokenizer and chat template come from; `None`: the
    /// byte-level tokenizer.
    pub model_source: Option<ModelSource>,
    /// The default model: requests that name none get it.
    pub model: String,
    /// The other `[[models]]`, each with its own tokenizer and limits.
    pub models: Vec<ServedModel>,
    /// Retries, the retry budget and the request deadline.
    pub routing: RouterConfig,
    /// Healthy endpoints needed to be ready.
    pub min_healthy_endpoints: usize,
    /// How long the router waits on engines.
    pub timeouts: Timeouts,
    pub outlier: OutlierConfig,
    pub max_body_bytes: usize,
    pub default_max_tokens: u32,
    /// The default model's.
    pub limits: RequestLimits,
    /// How many requests are served at once, and how many may wait.
    pub admission: AdmissionConfig,
    /// When an endpoint is saturated; `None` with flow control off.
    pub saturation: Option<SaturationConfig>,
    /// Client connections: deadlines and a cap.
    pub connections: ConnectionLimits,
    /// What SIGTERM does, step by step.
    pub drain: DrainConfig,
    /// Threads serving client connections.
    pub workers: NonZeroUsize,
    /// How long each busy-waits before it sleeps.
    pub worker_spin: std::time::Duration,
    /// How endpoints' KV event subscribers run.
    pub kv_events: SubscriberConfig,
    /// The TLS files of `https://` endpoints that name none of their own.
    pub engine_tls: TlsFiles,
    /// HTTPS on the listeners; `None`: plain HTTP.
    pub tls: Option<ListenerTls>,
    /// Where traces go; `None`: tracing off.
    pub traces: Option<TraceSettings>,
}

/// Who may use `/admin/*`, and where.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct AdminSettings {
    /// The bearer token `/admin/*` requires; `None`: no token.
    pub token: Option<String>,
    /// A separate listener for `/admin/*`; `None`: the main port serves them.
    pub listen: Option<SocketAddr>,
}

/// Whether the configured policy file must exist: not for a built-in planner.
#[derive(Debug, Clone, Copy)]
enum PolicyFile {
    MustExist,
    Unused,
}

impl Config {
    /// Parse and validate `args` (and the file it names).
    pub fn from_args(args: &ServeArgs) -> Result<Config, ConfigError> {
        Self::from_file(args, ConfigFile::named(args)?, PolicyFile::MustExist)
    }

    /// `switchyard epp`'s configuration: the router's, and the EPP's own settings (`epp`,
    /// else the same file's `[epp]` table).
    pub fn for_epp(
        args: &ServeArgs,
        epp: &EndpointPickerArgs,
    ) -> Result<(Config, EndpointPicker), ConfigError> {
        let mut file = ConfigFile::named(args)?;
        let picker = epp.resolve(std::mem::take(&mut file.epp))?;
        Ok((
            Self::from_file(args, file, PolicyFile::MustExist)?,
            picker.endpoint_picker(),
        ))
    }

    /// [`Config::from_args`] for a router whose requests a built-in planner plans
    /// (`switchyard sidecar`): no policy file need exist.
    pub fn with_builtin_planner(args: &ServeArgs) -> Result<Config, ConfigError> {
        Self::from_file(args, ConfigFile::named(args)?, PolicyFile::Unused)
    }

    fn from_file(
        args: &ServeArgs,
        file: ConfigFile,
        policy_file: PolicyFile,
    ) -> Result<Config, ConfigError> {
        let discovery = args.discovery.resolve(file.discovery)?.k8s()?;
        let endpoints = endpoints::resolve(args, file.endpoints, discovery.is_some())?;
        let s = args.router.resolve(file.router)?;
        let flow_control = args.flow_control.resolve(file.flow_control)?;
        let flow = flow_control.flow_control();
        let policy_path = match policy_file {
            PolicyFile::MustExist => policy::existing(&s.plugins.value, &s.policy)?,
            PolicyFile::Unused => policy::path(&s.plugins.value, &s.policy.value),
        };
        let policy_config = s
            .policy_config
            .as_ref()
            .map(policy::compact_json)
            .transpose()?;
        let mut model_policies = file.model_policies;
        let (default_model, models) =
            model::served(&s, file.models, &mut model_policies, |source| {
                request_limits(&s, source)
            })?;
        let policies = PolicySettings::new(&s, model_policies)?;
        let admin = AdminSettings::new(&s)?;
        let engine_tls = tls::engines(&s)?;
        tls::check_engines(&endpoints, &engine_tls)?;
        // Discovered endpoints are not known yet: any number may be wanted.
        if discovery.is_none() && s.min_healthy_endpoints.value > endpoints.len() {
            return Err(ConfigError::MinHealthy {
                wanted: s.min_healthy_endpoints,
                endpoints: endpoints.len(),
            });
        }
        Ok(Config {
            listen: SocketAddr::new(s.host.value, s.port.value),
            endpoints,
            endpoints_file: args.config.clone().filter(|_| args.endpoints.is_empty()),
            discovery,
            policy_name: s.policy.value.clone(),
            policy_path,
            policy_config,
            plugins: s.plugins.value.clone(),
            policies,
            admin,
            model_source: default_model.source,
            model: default_model.name,
            models,
            routing: routing(&s)?,
            min_healthy_endpoints: s.min_healthy_endpoints.value,
            timeouts: Timeouts {
                connect: s.connect_timeout.value,
                call: s.call_timeout.value,
                stream_idle: s.stream_idle_timeout.value,
                ..Timeouts::default()
            },
            outlier: outlier(&s)?,
            max_body_bytes: s.max_body_bytes.value,
            default_max_tokens: s.default_max_tokens.value,
            limits: default_model.limits,
            admission: AdmissionConfig {
                max_concurrent: s.max_concurrent_requests.value,
                max_queued: s.max_queued_requests.value,
                queue_timeout: s.queue_timeout.value,
                flow,
            },
            saturation: flow_control.saturation(),
            connections: ConnectionLimits {
                header_read_timeout: s.header_read_timeout.value,
                body_read_timeout: s.body_read_timeout.value,
                keep_alive_timeout: s.keep_alive_timeout.value,
                max_connections: s.max_connections.value,
            },
            drain: DrainConfig {
                delay: s.drain_delay.value,
                grace: s.shutdown_grace.value,
            },
            workers: s.workers.value,
            worker_spin: s.worker_spin.value,
            kv_events: SubscriberConfig {
                stale_after: s.kv_events_stale_after.value,
                dp_size: s.kv_events_dp_size.value,
                ..SubscriberConfig::default()
            },
            engine_tls,
            tls: tls::listener(&s)?,
            traces: TraceSettings::resolve(s.otlp_endpoint.as_ref().map(|e| e.value.as_str()))?,
        })
    }
}

impl AdminSettings {
    fn new(s: &RouterSettings) -> Result<AdminSettings, ConfigError> {
        if let Some(admin_port) = &s.admin_port
            && admin_port.value == s.port.value
            && s.port.value != 0
        {
            return Err(ConfigError::AdminPort {
                admin_port: admin_port.clone(),
                port: s.port.source.clone(),
            });
        }
        Ok(AdminSettings {
            token: s.admin_token.as_ref().map(|token| token.value.clone()),
            listen: s
                .admin_port
                .as_ref()
                .map(|port| SocketAddr::new(s.host.value, port.value)),
        })
    }
}

/// The context length (given, else the GGUF's, else the reference engine's) and the longest
/// prompt (given, else one token less).
fn request_limits(
    s: &RouterSettings,
    model: Option<&ModelSource>,
) -> Result<RequestLimits, ConfigError> {
    let context_length = s
        .context_length
        .clone()
        .or_else(|| model.and_then(ModelSource::context_length))
        .unwrap_or_else(|| Sourced::new(DEFAULT_CONTEXT_LENGTH, Source::Default("context-length")));
    // A GGUF's length is put to the check a given one was.
    context_length.check(settings::holds_a_prompt)?;
    let max_prompt_tokens = match &s.max_prompt_tokens {
        Some(given) if given.value >= context_length.value => {
            return Err(ConfigError::PromptNotBelowContext {
                max_prompt_tokens: given.clone(),
                context_length,
            });
        }
        Some(given) => given.value,
        None => context_length.value - 1,
    };
    Ok(RequestLimits {
        context_length: context_length.value,
        max_prompt_tokens,
    })
}

fn routing(s: &RouterSettings) -> Result<RouterConfig, ConfigError> {
    let attempts = &s.max_attempts;
    let retry =
        RetryPolicy::try_new(attempts.value, RETRY_MIN_DELAY, RETRY_MAX_DELAY).map_err(|e| {
            ConfigError::Invalid {
                at: attempts.source.clone(),
                problem: e.into(),
            }
        })?;
    Ok(RouterConfig {
        retry,
        retry_budget: RetryBudgetConfig {
            ratio: s.retry_budget_ratio.value,
            min_per_sec: s.retry_budget_min_per_sec.value,
        },
        request_timeout: s.request_timeout.value,
    })
}

fn outlier(s: &RouterSettings) -> Result<OutlierConfig, ConfigError> {
    let (base, max) = (&s.outlier_base_ejection, &s.outlier_max_ejection);
    if base.value > max.value {
        return Err(ConfigError::Ejection {
            base: base.clone(),
            max: max.clone(),
        });
    }
    Ok(OutlierConfig {
        consecutive_failures: s.outlier_failures.value,
        base_ejection: base.value,
        max_ejection: max.value,
    })
}
