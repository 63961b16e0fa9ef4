//! The `switchyard` binary: parse the command line, set up logging, run a subcommand. Every
//! product lives in its own crate (`switchyard-router`, `-engine`, `-policy-host`, `-bench`,
//! `-lab`);
//! this one only wires them to a command line, plus `up` (engines and router together) and the
//! `policy` tooling.

mod policy_cli;
mod policy_new;
mod up;

use std::future::Future;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use switchyard_router::telemetry::{TraceSettings, Tracing};

/// mimalloc rather than glibc's malloc: the router allocates per request and per streamed chunk,
/// and glibc's malloc was ~10% of its CPU under load (perf, `make bench-overhead`). The
/// `system-allocator` feature keeps glibc's, for heaptrack, which sees no mimalloc allocation.
#[cfg(not(feature = "system-allocator"))]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// A router for disaggregated LLM serving whose routing policies are WebAssembly components.
#[derive(Parser)]
#[command(name = "switchyard", version, about, long_about = None)]
struct Cli {
    /// How logs (on stderr) are written: `text` for people, `json` (one object a line) for log
    /// shippers. `RUST_LOG` sets what is logged.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Run the reference MLC-microserving engine.
    Engine(switchyard_engine::EngineArgs),
    /// Load-test a /v1/completions server and measure the router's overhead.
    ///
    /// A run ends after --num-requests requests or --duration seconds, whichever comes first;
    /// requests already sent then finish, each bounded by --request-timeout. Results: a table
    /// on stdout, optionally --json (vLLM benchmark_serving names) and --plot (SVG CDFs).
    /// With --trace FILE it replays a recorded trace instead (see `switchyard trace`).
    Bench(switchyard_bench::BenchArgs),
    /// Summarise a request trace, or write a seeded synthetic one (Mooncake JSONL).
    #[command(subcommand)]
    Trace(switchyard_bench::TraceCommand),
    /// Replay a trace on a simulated cluster, once per policy, and compare the policies.
    ///
    /// The engines are the reference engine's scheduler core on a virtual clock, costed by a
    /// latency profile; the policies are the real components. Results: a table on stdout,
    /// optionally --json (one object per policy, vLLM benchmark names) and --out DIR (latency
    /// CDFs as SVG, the table).
    Lab(switchyard_lab::LabArgs),
    /// Run the router in front of running engines.
    Serve(switchyard_router::config::ServeArgs),
    /// Pick endpoints for a Gateway API gateway: the Inference Extension's Endpoint Picker.
    ///
    /// The gateway (Envoy and those built on it) asks over Envoy's ext_proc where each request
    /// goes; the request's policy plans it as `serve` would, and the gateway sends it to the
    /// planned endpoint itself. The same configuration as `serve`, but no OpenAI listener.
    #[command(mut_arg("port", |arg| arg.hide(true)))]
    Epp(switchyard_router::epp::EppArgs),
    /// Run the handoff a gateway's EPP names, beside one decode engine (P/D behind any gateway).
    ///
    /// A request with `x-prefiller-host-port` runs the disaggregated handoff with that prefill
    /// engine through the router's executor (retries, continuation, no KV left held); without
    /// it, the decode engine serves it. Only prefill engines from --prefill-allow (or
    /// discovery) may be named: any other value is answered 400, and nothing is called. If the
    /// prefill engine fails, the decode engine prefills itself. `serve`'s other flags apply.
    #[command(
        mut_arg("endpoints", |arg| arg.hide(true)),
        mut_arg("endpoint_num_gpus", |arg| arg.hide(true)),
        mut_arg("policy", |arg| arg.hide(true)),
        mut_arg("plugins", |arg| arg.hide(true)),
        mut_arg("policy_config", |arg| arg.hide(true)),
        mut_arg("fallback_policy", |arg| arg.hide(true)),
        mut_arg("no_policy_header", |arg| arg.hide(true)),
        mut_arg("forward_headers", |arg| arg.hide(true)),
        mut_arg("quarantine_faults", |arg| arg.hide(true)),
        mut_arg("quarantine_window_ms", |arg| arg.hide(true))
    )]
    Sidecar(switchyard_router::sidecar::SidecarArgs),
    /// Start reference engines and the router in front of them (the embedded default).
    #[command(mut_arg("model", |arg| arg.help(up::MODEL_HELP).long_help(up::MODEL_HELP)))]
    Up(up::UpArgs),
    /// Check a policy component, or print the plan it makes for one request.
    #[command(subcommand)]
    Policy(policy_cli::PolicyCommand),
}

impl Command {
    /// Whether the command runs a router, which may export traces: its logging starts once
    /// its configuration says where they go.
    fn routes(&self) -> bool {
        matches!(
            self,
            Command::Serve(_) | Command::Epp(_) | Command::Sidecar(_) | Command::Up(_)
        )
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let logs = cli.log_format;
    if !cli.command.routes() {
        init_logs(logs, None);
    }
    let result = match cli.command {
        Command::Engine(args) => engine(args),
        Command::Bench(args) => {
            // 4,096 streaming clients need 4,096 connections at once.
            raise_open_files_limit();
            switchyard_bench::run_blocking(args).map_err(Into::into)
        }
        Command::Trace(command) => switchyard_bench::run_trace_command(command).map_err(Into::into),
        Command::Lab(args) => switchyard_lab::run(args).map_err(Into::into),
        Command::Serve(args) => serve(&args, logs),
        Command::Epp(args) => epp(&args, logs),
        Command::Sidecar(args) => sidecar(&args, logs),
        Command::Up(mut args) => {
            // The engines log to the same stderr: in the same format.
            if logs == LogFormat::Json {
                args.engine_args.push("--log-format=json".into());
            }
            up(args, logs)
        }
        Command::Policy(command) => policy_cli::run_cli(command).map_err(Into::into),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // The error and its causes on one line. Not anyhow's `Debug`, which appends a stack
            // backtrace whenever RUST_BACKTRACE is set: noise for a bad file or a refused port.
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Exit code for a bad command line or config (as `clap` uses), before any port is bound.
const USAGE_ERROR: i32 = 2;

fn serve(args: &switchyard_router::config::ServeArgs, logs: LogFormat) -> anyhow::Result<()> {
    let config = match switchyard_router::config::Config::from_args(args) {
        Ok(config) => config,
        Err(e) => {
            eprintln!("switchyard serve: {e}");
            std::process::exit(USAGE_ERROR);
        }
    };
    let runtime = control_runtime()?;
    let traces = start_logs(logs, config.traces.as_ref(), runtime.handle())?;
    raise_open_files_limit();
    let (shutdown, hurry) = shutdown_signals();
    let served = runtime.block_on(switchyard_router::serve::run(config, shutdown, hurry));
    flush(traces);
    Ok(served?)
}

fn epp(args: &switchyard_router::epp::EppArgs, logs: LogFormat) -> anyhow::Result<()> {
    let config = match switchyard_router::epp::EppConfig::from_args(args) {
        Ok(config) => config,
        Err(e) => {
            eprintln!("switchyard epp: {e}");
            std::process::exit(USAGE_ERROR);
        }
    };
    // The ext_proc streams run on this runtime, with `--workers` threads (one per core by
    // default). Each gateway message wakes the stream's task and the connection's: on a box
    // the gateway shares, fewer threads mean fewer cross-thread wake-ups per request.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(config.router.workers.get())
        .thread_name("switchyard-epp")
        .enable_all()
        .build()?;
    let traces = start_logs(logs, config.router.traces.as_ref(), runtime.handle())?;
    raise_open_files_limit();
    let (shutdown, hurry) = shutdown_signals();
    let served = runtime.block_on(switchyard_router::epp::run(config, shutdown, hurry));
    flush(traces);
    Ok(served?)
}

fn sidecar(args: &switchyard_router::sidecar::SidecarArgs, logs: LogFormat) -> anyhow::Result<()> {
    let config = match switchyard_router::sidecar::SidecarConfig::from_args(args) {
        Ok(config) => config,
        Err(e) => {
            eprintln!("switchyard sidecar: {e}");
            std::process::exit(USAGE_ERROR);
        }
    };
    let runtime = control_runtime()?;
    let traces = start_logs(logs, config.router.traces.as_ref(), runtime.handle())?;
    raise_open_files_limit();
    let (shutdown, hurry) = shutdown_signals();
    let served = runtime.block_on(switchyard_router::sidecar::run(config, shutdown, hurry));
    flush(traces);
    Ok(served?)
}

/// The router's control plane: accepting connections, health probes, discovery, the plugins
/// watcher, the admin port, and (`up`) the engines' child processes. Requests are served on the
/// connection workers (`--workers`), which the router starts itself, so one thread is enough.
fn control_runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("switchyard-control")
        .enable_all()
        .build()
}

fn engine(args: switchyard_engine::EngineArgs) -> anyhow::Result<()> {
    if let Some(threads) = args.threads {
        set_model_threads(threads);
    }
    let (shutdown, _) = shutdown_signals();
    match switchyard_engine::run(args, shutdown) {
        Err(e) if e.is_usage() => {
            eprintln!("switchyard engine: {e}");
            std::process::exit(USAGE_ERROR);
        }
        other => Ok(other?),
    }
}

/// candle sizes its matmul thread pool from `CANDLE_NUM_THREADS` when it first runs, and has
/// no other knob: set it while this process has one thread, before any runtime starts.
#[expect(
    unsafe_code,
    reason = "set_var is unsafe while other threads may read the environment; none exist yet"
)]
fn set_model_threads(threads: u16) {
    // SAFETY: called from main before the tokio runtime, the step loop or any other thread
    // starts (tracing's subscriber spawns none), so nothing reads the environment concurrently.
    unsafe { std::env::set_var("CANDLE_NUM_THREADS", threads.to_string()) };
}

fn up(args: up::UpArgs, logs: LogFormat) -> anyhow::Result<()> {
    // The flag and the environment: `up`'s logging starts before its config file is read.
    let settings = match TraceSettings::resolve(args.router.otlp_endpoint.as_deref()) {
        Ok(settings) => settings,
        Err(e) => {
            eprintln!("switchyard up: {e}");
            std::process::exit(USAGE_ERROR);
        }
    };
    let runtime = control_runtime()?;
    let traces = start_logs(logs, settings.as_ref(), runtime.handle())?;
    raise_open_files_limit();
    let (shutdown, hurry) = shutdown_signals();
    let ran = runtime.block_on(up::run(args, shutdown, hurry));
    flush(traces);
    match ran {
        Err(up::UpError::Config(e)) => {
            eprintln!("switchyard up: {e}");
            std::process::exit(USAGE_ERROR);
        }
        other => Ok(other?),
    }
}

/// Lifts the soft limit on open files to the hard one, as Go's runtime does for every
/// program: the router holds a connection per client and more to the engines, and the usual
/// soft limit (1024) would refuse connections long before `--max-connections`.
fn raise_open_files_limit() {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let limit = getrlimit(Resource::Nofile);
    if let (Some(current), Some(maximum)) = (limit.current, limit.maximum)
        && current < maximum
    {
        let raised = Rlimit {
            current: Some(maximum),
            maximum: Some(maximum),
        };
        if let Err(e) = setrlimit(Resource::Nofile, raised) {
            tracing::warn!(error = %e, current, "cannot raise the open files limit");
        }
    }
}

/// Logs go to stderr so commands that print results (`policy plan`) keep stdout clean. With
/// `traces`, the router's spans are exported too, whatever `RUST_LOG` logs.
fn init_logs(format: LogFormat, traces: Option<&Tracing>) {
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::util::SubscriberInitExt as _;
    use tracing_subscriber::{EnvFilter, Layer as _};

    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let Some(traces) = traces else {
        let logs = tracing_subscriber::fmt()
            .with_writer(std::io::stderr)
            .with_env_filter(filter);
        match format {
            LogFormat::Text => logs.init(),
            LogFormat::Json => logs.json().init(),
        }
        return;
    };
    // Each layer with its own filter: the exporter's spans are not the log's.
    let logs = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let subscriber = tracing_subscriber::registry().with(traces.layer());
    match format {
        LogFormat::Text => subscriber.with(logs.with_filter(filter)).init(),
        LogFormat::Json => subscriber.with(logs.json().with_filter(filter)).init(),
    }
}

/// A router's logging, and its traces when `settings` says where they go; the exports run
/// on `runtime`.
fn start_logs(
    format: LogFormat,
    settings: Option<&TraceSettings>,
    runtime: &tokio::runtime::Handle,
) -> anyhow::Result<Option<Tracing>> {
    let traces = settings
        .map(|settings| Tracing::start(settings, runtime))
        .transpose()?;
    init_logs(format, traces.as_ref());
    if let Some(settings) = settings {
        tracing::info!(endpoint = %settings.endpoint, service = %settings.service_name, ratio = settings.ratio, "exporting traces");
    }
    Ok(traces)
}

/// Send the spans still batched before the process exits.
fn flush(traces: Option<Tracing>) {
    if let Some(traces) = traces {
        traces.shutdown();
    }
}

/// Two futures: the first resolves on SIGINT or SIGTERM (shut down, draining), the second on
/// the next one (stop now). Handlers are installed when the first is first polled, inside the
/// runtime; until then, and if they cannot be installed, a signal has its default effect.
fn shutdown_signals() -> (impl Future<Output = ()>, impl Future<Output = ()>) {
    let (handoff, handed) = tokio::sync::oneshot::channel();
    let first = async move {
        let Some(mut signals) = Signals::install() else {
            return std::future::pending().await;
        };
        signals
            .next("shutting down (send another to stop at once)")
            .await;
        let _ = handoff.send(signals);
    };
    let second = async move {
        match handed.await {
            Ok(mut signals) => signals.next("stopping now").await,
            Err(_) => std::future::pending().await,
        }
    };
    (first, second)
}

/// SIGINT and SIGTERM handlers.
struct Signals {
    int: tokio::signal::unix::Signal,
    term: tokio::signal::unix::Signal,
}

impl Signals {
    fn install() -> Option<Signals> {
        use tokio::signal::unix::{SignalKind, signal};
        Some(Signals {
            int: signal(SignalKind::interrupt()).ok()?,
            term: signal(SignalKind::terminate()).ok()?,
        })
    }

    /// Waits for the next signal and logs it with `what` happens now.
    async fn next(&mut self, what: &str) {
        tokio::select! {
            _ = self.int.recv() => tracing::info!("SIGINT: {what}"),
            _ = self.term.recv() => tracing::info!("SIGTERM: {what}"),
        }
    }
}
