//! Every setting of `switchyard serve` and `switchyard up`, each declared once (see
//! [`settings!`]): its `--help` text, its flag, its file key, its environment variable where it
//! has one, its default and its check.

use std::net::IpAddr;
use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::time::Duration;

use switchyard_policy_host::QuarantineRule;

use super::discovery::DiscoveryArgs;
use super::error::Problem;
use super::file::{FileValue as _, json_text};
use super::flow_control::FlowControlArgs;
use super::table::{at_least_one, longer_than_zero, not_empty, settings};
use crate::RetryBudgetConfig;
use crate::api::{AdmissionConfig, ConnectionLimits, DrainConfig};
use crate::cluster::{MAX_DP_SIZE, OutlierConfig};
use crate::engine_client::Timeouts;
use crate::kv_events::SubscriberConfig;

/// `switchyard serve` flags: where the engines are, and how the router runs.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct ServeArgs {
    /// An engine:
    /// `[PROTOCOL+]URL[,role=ROLE][,bootstrap_port=N][,kv_events=tcp://H:P[,kv_events_replay=tcp://H:P][,kv_events_dp_size=N]]`
    /// (repeat for each engine, in id order). PROTOCOL is mlc (the default), vllm, sglang or
    /// openai; ROLE any, prefill or decode (binding on vllm and sglang); an sglang prefill needs
    /// its bootstrap_port; kv_events is the engine's KV-event PUB socket (policies then see each
    /// request's cached prefix), kv_events_replay its replay socket, kv_events_dp_size its
    /// data-parallel ranks (rank r publishing at both ports plus r). E.g.
    /// `http://127.0.0.1:8081`, `vllm+http://10.0.0.4:8000,role=decode,kv_events=tcp://10.0.0.4:5557`.
    #[arg(long = "endpoint", value_name = "ENDPOINT")]
    pub endpoints: Vec<String>,
    /// GPUs of each `--endpoint`, in the same order (default 1 each); device ranks are their
    /// prefix sums.
    #[arg(long = "endpoint-num-gpus")]
    pub endpoint_num_gpus: Vec<u32>,
    /// A TOML config file (see the `config` module docs).
    #[arg(long)]
    pub config: Option<PathBuf>,
    #[command(flatten)]
    pub discovery: DiscoveryArgs,
    #[command(flatten)]
    pub flow_control: FlowControlArgs,
    #[command(flatten)]
    pub router: RouterArgs,
}

const DEFAULT_HOST: IpAddr = IpAddr::V4(std::net::Ipv4Addr::LOCALHOST);
pub const DEFAULT_PORT: u16 = 8000;
pub const DEFAULT_POLICY: &str = "disagg";
const DEFAULT_PLUGINS: &str = "plugins";
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
/// Failed attempts before a request fails, unless `--max-attempts` says otherwise.
pub(crate) const DEFAULT_MAX_ATTEMPTS: u32 = 3;
/// The backoff between attempts, which is not a setting: with [`DEFAULT_MAX_ATTEMPTS`], what
/// [`RetryPolicy::default`](crate::RetryPolicy::default) is made of.
pub(crate) const RETRY_MIN_DELAY: Duration = Duration::from_millis(10);
pub(crate) const RETRY_MAX_DELAY: Duration = Duration::from_secs(1);

settings! {
    /// How the router runs, whoever started the engines: the flags `switchyard serve` and
    /// `switchyard up` share. Each overrides its key in the `--config` file; unset, the file's
    /// value or the default applies.
    args RouterArgs, keys RouterKeys, resolved RouterSettings, table "";

    /// Address to listen on [default: 127.0.0.1].
    host: Option<IpAddr> => IpAddr {
        flag: "host",
        key: "host",
        default: DEFAULT_HOST,
    }
    /// Port to listen on (0 picks a free one) [default: 8000].
    port: Option<u16> => u16 {
        flag: "port",
        key: "port",
        default: DEFAULT_PORT,
    }
    /// The default policy: `<plugins>/<NAME>.wasm` (the last --policy given wins) [default:
    /// disagg].
    #[arg(overrides_with = "policy")]
    policy: Option<String> => String {
        flag: "policy",
        key: "policy",
        default: DEFAULT_POLICY.to_owned(),
    }
    /// Where policies live: every `*.wasm` in it is loaded, and reloaded when its file (or
    /// `<name>.json` config) changes (the last --plugins given wins) [default: plugins].
    #[arg(overrides_with = "plugins")]
    plugins: Option<PathBuf> => PathBuf {
        flag: "plugins",
        key: "plugins",
        default: PathBuf::from(DEFAULT_PLUGINS),
    }
    /// The default policy's JSON config, given to its `init` (instead of `<plugins>/<NAME>.json`).
    policy_config: Option<String> => String {
        flag: "policy-config",
        key: "policy_config",
        file: json_text,
    }
    /// Plans the requests of a policy that faults or is quarantined (default `round-robin`;
    /// `none`: those requests fail).
    fallback_policy: Option<String> => String {
        flag: "fallback-policy",
        key: "fallback_policy",
    }
    /// Ignore the `x-switchyard-policy` request header (clients cannot pick a policy).
    no_policy_header: bool => bool {
        flag: "no-policy-header",
        key: "policy_header",
        default: false,
        // The file says the opposite: `policy_header = false` ignores the header.
        file: |value| bool::from_toml(value).map(|heeded| !heeded),
    }
    /// A request header policies may route on (repeatable; names are case-insensitive). No
    /// other header reaches a policy [default: x-priority].
    #[arg(value_name = "NAME")]
    forward_headers: Vec<String> => Vec<String> {
        flag: "forward-header",
        key: "forward_headers",
        default: DEFAULT_FORWARD_HEADERS.map(str::to_owned).to_vec(),
        check: |names| header_names(names),
    }
    /// Faults (trap, deadline, memory cap, invalid plan) within --quarantine-window-ms that
    /// quarantine a policy version.
    quarantine_faults: Option<u32> => u32 {
        flag: "quarantine-faults",
        key: "quarantine_faults",
        default: QuarantineRule::default().faults,
        check: at_least_one,
    }
    quarantine_window_ms: Option<u64> => u64 {
        flag: "quarantine-window-ms",
        key: "quarantine_window_ms",
        default: u64::try_from(QuarantineRule::default().window.as_millis()).unwrap_or(u64::MAX),
        check: at_least_one,
    }
    /// Require `Authorization: Bearer TOKEN` on `/admin/*`.
    #[arg(hide_env_values = true)]
    admin_token: Option<String> => String {
        flag: "admin-token",
        key: "admin_token",
        env: "SWITCHYARD_ADMIN_TOKEN",
        check: not_empty,
    }
    /// Serve `/admin/*` on this port (same host) instead of the main port.
    admin_port: Option<u16> => u16 {
        flag: "admin-port",
        key: "admin_port",
    }
    /// Serve HTTPS with this PEM certificate chain (and --tls-key): HTTP/1.1 and HTTP/2,
    /// chosen by ALPN, on the main port and the admin port alike.
    tls_cert: Option<PathBuf> => PathBuf {
        flag: "tls-cert",
        key: "tls_cert",
    }
    /// The PEM private key of --tls-cert.
    tls_key: Option<PathBuf> => PathBuf {
        flag: "tls-key",
        key: "tls_key",
    }
    /// For `https://` engines: the PEM file of the CA that signs their certificates, trusted
    /// instead of the system's roots, for every endpoint that gives no `ca_file` of its own.
    engine_ca_file: Option<PathBuf> => PathBuf {
        flag: "engine-ca-file",
        key: "engine_ca_file",
    }
    /// For `https://` engines that demand one (mTLS): the PEM certificate the router presents
    /// (with --engine-client-key), for every endpoint that gives no `client_cert` of its own.
    engine_client_cert: Option<PathBuf> => PathBuf {
        flag: "engine-client-cert",
        key: "engine_client_cert",
    }
    /// The PEM private key of --engine-client-cert.
    engine_client_key: Option<PathBuf> => PathBuf {
        flag: "engine-client-key",
        key: "engine_client_key",
    }
    /// Export OpenTelemetry traces to this collector (its base URL, e.g.
    /// `http://otel-collector:4318`; `/v1/traces` is appended for OTLP/HTTP), instead of
    /// OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT. Unset and without
    /// them: no traces. OTEL_EXPORTER_OTLP_PROTOCOL (http/protobuf or grpc), OTEL_SERVICE_NAME
    /// and OTEL_TRACES_SAMPLER_ARG apply.
    otlp_endpoint: Option<String> => String {
        flag: "otlp-endpoint",
        key: "otlp_endpoint",
        check: not_empty,
    }
    /// The served model's tokenizer: a directory with `tokenizer.json` (and
    /// `tokenizer_config.json` for chat), or a GGUF file, whose metadata gives the tokenizer,
    /// chat template, default `--model` name and default `--context-length`; default: the
    /// reference engine's byte-level tokenizer.
    model_dir: Option<PathBuf> => PathBuf {
        flag: "model-dir",
        key: "model_dir",
    }
    /// The model name `/v1/models` reports.
    model: Option<String> => String {
        flag: "model",
        key: "model",
    }
    /// Failed attempts (engine errors, preemptions without progress) before a request fails.
    max_attempts: Option<u32> => u32 {
        flag: "max-attempts",
        key: "max_attempts",
        // Checked as the retry policy is built from it.
        default: DEFAULT_MAX_ATTEMPTS,
    }
    /// Largest accepted request body in bytes; larger ones get 413 [default: 4194304, 4 MiB].
    max_body_bytes: Option<usize> => usize {
        flag: "max-body-bytes",
        key: "max_body_bytes",
        default: DEFAULT_MAX_BODY_BYTES,
        check: at_least_one,
    }
    /// `max_tokens` for requests that give none (less when the context leaves less room).
    default_max_tokens: Option<u32> => u32 {
        flag: "default-max-tokens",
        key: "default_max_tokens",
        default: DEFAULT_MAX_TOKENS,
        check: at_least_one,
    }
    /// Prompt plus completion tokens the model holds: a request whose prompt and `max_tokens`
    /// do not fit is refused with 400, never cut short [default: 32768, the reference engine's].
    context_length: Option<u32> => u32 {
        flag: "context-length",
        key: "context_length",
        check: holds_a_prompt,
    }
    /// The longest prompt accepted, in tokens [default: --context-length - 1].
    max_prompt_tokens: Option<u32> => u32 {
        flag: "max-prompt-tokens",
        key: "max_prompt_tokens",
        check: at_least_one,
    }
    /// Longest time from a request's arrival to the end of its response, over every attempt;
    /// a stream still open then ends with an error event [default: 10m].
    #[arg(value_parser = humantime::parse_duration)]
    request_timeout: Option<Duration> => Duration {
        flag: "request-timeout",
        key: "request_timeout",
        default: crate::DEFAULT_REQUEST_TIMEOUT,
        check: longer_than_zero,
    }
    /// Longest wait for a TCP connection to an engine [default: 2s].
    #[arg(value_parser = humantime::parse_duration)]
    connect_timeout: Option<Duration> => Duration {
        flag: "connect-timeout",
        key: "connect_timeout",
        default: Timeouts::default().connect,
        check: longer_than_zero,
    }
    /// Longest wait for a whole prep_recv or remote_send (prep_recv may wait for free KV
    /// pages, remote_send includes the prefill), and for a generation's response headers
    /// [default: 120s].
    #[arg(value_parser = humantime::parse_duration)]
    call_timeout: Option<Duration> => Duration {
        flag: "call-timeout",
        key: "call_timeout",
        default: Timeouts::default().call,
        check: longer_than_zero,
    }
    /// Longest gap between two chunks of a generation before it counts as stalled: the request
    /// continues elsewhere and the engine is blamed [default: 60s].
    #[arg(value_parser = humantime::parse_duration)]
    stream_idle_timeout: Option<Duration> => Duration {
        flag: "stream-idle-timeout",
        key: "stream_idle_timeout",
        default: Timeouts::default().stream_idle,
        check: longer_than_zero,
    }
    /// Healthy endpoints the router needs to report ready (`/health` 200) and serve; requests
    /// are planned over the healthy ones, so one engine down never stops the others
    /// [default: 1].
    min_healthy_endpoints: Option<usize> => usize {
        flag: "min-healthy-endpoints",
        key: "min_healthy_endpoints",
        default: 1,
    }
    /// Consecutive failures of an endpoint's own making (refused connections, timeouts, 5xx,
    /// broken or stalled streams; never a client's 4xx) that eject it from routing for a while;
    /// 0 turns ejection off [default: 3].
    outlier_failures: Option<u32> => u32 {
        flag: "outlier-failures",
        key: "outlier_failures",
        default: OutlierConfig::default().consecutive_failures,
    }
    /// How long an endpoint's first ejection lasts; each further ejection in a row doubles it.
    /// It comes back on trial once the time is up and its readiness probe answers [default: 1s].
    #[arg(value_parser = humantime::parse_duration)]
    outlier_base_ejection: Option<Duration> => Duration {
        flag: "outlier-base-ejection",
        key: "outlier_base_ejection",
        default: OutlierConfig::default().base_ejection,
        check: longer_than_zero,
    }
    /// The longest an ejection lasts [default: 30s].
    #[arg(value_parser = humantime::parse_duration)]
    outlier_max_ejection: Option<Duration> => Duration {
        flag: "outlier-max-ejection",
        key: "outlier_max_ejection",
        default: OutlierConfig::default().max_ejection,
    }
    /// Retries (attempts after an engine failure) the whole router may make per client request
    /// over the last 10 s; past it, failing requests fail at once instead of retrying
    /// [default: 0.2].
    retry_budget_ratio: Option<f64> => f64 {
        flag: "retry-budget-ratio",
        key: "retry_budget_ratio",
        default: RetryBudgetConfig::default().ratio,
        check: percentage,
    }
    /// Retries per second allowed on top of --retry-budget-ratio, so a quiet router still
    /// retries [default: 10].
    retry_budget_min_per_sec: Option<u32> => u32 {
        flag: "retry-budget-min-per-sec",
        key: "retry_budget_min_per_sec",
        default: RetryBudgetConfig::default().min_per_sec,
    }
    /// Completion requests served at once, each from admission (its body read) to the end of
    /// its response, stream included; more wait in a queue [default: 1024].
    max_concurrent_requests: Option<u32> => u32 {
        flag: "max-concurrent-requests",
        key: "max_concurrent_requests",
        default: AdmissionConfig::default().max_concurrent,
        check: at_least_one,
    }
    /// Requests that may wait while --max-concurrent-requests are in flight (ordered by flow
    /// control: priority, tenant, deadline); more are refused at once with 429 and Retry-After,
    /// or displace a less important waiter (0: none wait) [default: 1024].
    max_queued_requests: Option<u32> => u32 {
        flag: "max-queued-requests",
        key: "max_queued_requests",
        default: AdmissionConfig::default().max_queued,
    }
    /// The longest a request waits in the queue; still waiting then, it gets 429 with
    /// Retry-After [default: 5s].
    #[arg(value_parser = humantime::parse_duration)]
    queue_timeout: Option<Duration> => Duration {
        flag: "queue-timeout",
        key: "queue_timeout",
        default: AdmissionConfig::default().queue_timeout,
        check: longer_than_zero,
    }
    /// Deadline from a request's first byte to its whole header; a connection still sending
    /// its header then is closed (slowloris) [default: 10s].
    #[arg(value_parser = humantime::parse_duration)]
    header_read_timeout: Option<Duration> => Duration {
        flag: "header-read-timeout",
        key: "header_read_timeout",
        default: ConnectionLimits::default().header_read_timeout,
        check: longer_than_zero,
    }
    /// Deadline from a request's whole header to its whole body; a slower body gets 408
    /// [default: 30s].
    #[arg(value_parser = humantime::parse_duration)]
    body_read_timeout: Option<Duration> => Duration {
        flag: "body-read-timeout",
        key: "body_read_timeout",
        default: ConnectionLimits::default().body_read_timeout,
        check: longer_than_zero,
    }
    /// How long a client connection stays open with no request on it; keep it above the idle
    /// timeout of a load balancer in front [default: 75s].
    #[arg(value_parser = humantime::parse_duration)]
    keep_alive_timeout: Option<Duration> => Duration {
        flag: "keep-alive-timeout",
        key: "keep_alive_timeout",
        default: ConnectionLimits::default().keep_alive_timeout,
        check: longer_than_zero,
    }
    /// Client connections open at once, per listener; at the limit new ones wait in the
    /// kernel's backlog until one closes [default: 4096].
    max_connections: Option<u32> => u32 {
        flag: "max-connections",
        key: "max_connections",
        default: ConnectionLimits::default().max_connections,
        check: at_least_one,
    }
    /// How long an endpoint with KV events (`kv_events`) may publish nothing after the router
    /// sent it a prompt of at least one block before its index is stale: policies then see
    /// its cached prefix as unknown until events flow again (an idle engine stays trusted)
    /// [default: 10s].
    #[arg(value_parser = humantime::parse_duration)]
    kv_events_stale_after: Option<Duration> => Duration {
        flag: "kv-events-stale-after",
        key: "kv_events_stale_after",
        default: SubscriberConfig::default().stale_after,
        check: longer_than_zero,
    }
    /// How many data-parallel ranks publish KV events for an endpoint whose own
    /// `kv_events_dp_size` does not say: rank r at its `kv_events` and `kv_events_replay`
    /// ports plus r [default: 1].
    kv_events_dp_size: Option<u32> => u32 {
        flag: "kv-events-dp-size",
        key: "kv_events_dp_size",
        default: SubscriberConfig::default().dp_size,
        check: dp_ranks,
    }
    /// Threads serving client connections; each connection, with the engine calls its
    /// requests make, stays on one of them [default: one per core this process may use].
    workers: Option<NonZeroUsize> => NonZeroUsize {
        flag: "workers",
        key: "workers",
        default: std::thread::available_parallelism().unwrap_or(NonZeroUsize::MIN),
    }
    /// How long a worker with nothing to do busy-waits before it sleeps, so that what arrives
    /// meanwhile (an engine's answer, a client's next request) finds it awake: on a VM a
    /// sleeping core's wake-up costs more than this. `0s` turns it off; at most 1ms
    /// [default: 20us].
    #[arg(value_parser = humantime::parse_duration)]
    worker_spin: Option<Duration> => Duration {
        flag: "worker-spin",
        key: "worker_spin",
        default: crate::api::DEFAULT_WORKER_SPIN,
        check: a_brief_spin,
    }
    /// On SIGTERM or SIGINT, how long /health answers 503 while the listeners still accept
    /// and serve, so a load balancer notices; then they stop accepting [default: 5s].
    // Zero is a valid drain, as for the grace: no delay (nothing balances load in front).
    #[arg(value_parser = humantime::parse_duration)]
    drain_delay: Option<Duration> => Duration {
        flag: "drain-delay",
        key: "drain_delay",
        default: DrainConfig::default().delay,
    }
    /// Once the listeners stop accepting, how long requests in flight may take to finish;
    /// streams still open then end with an error event and [DONE]. A second signal ends them
    /// at once [default: 30s].
    #[arg(value_parser = humantime::parse_duration)]
    shutdown_grace: Option<Duration> => Duration {
        flag: "shutdown-grace",
        key: "shutdown_grace",
        default: DrainConfig::default().grace,
    }
}

/// Names that can be request headers; policies see them lower-cased.
fn header_names(names: &[String]) -> Result<(), Problem> {
    match names
        .iter()
        .find(|name| http::HeaderName::from_bytes(name.as_bytes()).is_err())
    {
        Some(name) => Err(Problem::HeaderName(name.clone())),
        None => Ok(()),
    }
}

/// A context holds at least a one-token prompt and one generated token.
pub(super) fn holds_a_prompt(tokens: &u32) -> Result<(), Problem> {
    if *tokens < 2 {
        return Err(Problem::AtLeast(2));
    }
    Ok(())
}

/// A number of data-parallel ranks, each a subscriber of its own.
fn dp_ranks(size: &u32) -> Result<(), Problem> {
    if !(1..=MAX_DP_SIZE).contains(size) {
        return Err(Problem::OutOfRange {
            value: *size,
            low: 1,
            high: MAX_DP_SIZE,
        });
    }
    Ok(())
}

/// A spin long enough to bridge a wake-up, too short to burn a core.
fn a_brief_spin(spin: &Duration) -> Result<(), Problem> {
    if *spin > crate::api::MAX_WORKER_SPIN {
        return Err(Problem::SpinTooLong(crate::api::MAX_WORKER_SPIN));
    }
    Ok(())
}

fn percentage(ratio: &f64) -> Result<(), Problem> {
    if !(0.0..=100.0).contains(ratio) {
        return Err(Problem::NotAPercentage(*ratio));
    }
    Ok(())
}
