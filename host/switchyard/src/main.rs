//! The `switchyard` binary: parse the command line, set up logging, run a subcommand. Every
//! product lives in its own crate (`switchyard-router`, `-engine`, `-policy-host`, `-bench`);
//! this one only wires them to a command line, plus `up` (engines and router together) and the
//! `policy` tooling.

mod policy_cli;
mod policy_new;
mod up;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// mimalloc rather than glibc's malloc: the router allocates per request and per streamed chunk,
/// and glibc's malloc was ~10% of its CPU under load (perf, `make bench-overhead`).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// A router for disaggregated LLM serving whose routing policies are WebAssembly components.
#[derive(Parser)]
#[command(name = "switchyard", version, about, long_about = None)]
struct Cli {
    /// How logs (on stderr) are written: `text` for people, `json` (one object a line) for log
    /// shippers. `RUST_LOG` sets what is logged [default: text].
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
    Bench(switchyard_bench::BenchArgs),
    /// Run the router in front of running engines.
    Serve(switchyard_router::config::ServeArgs),
    /// Start reference engines and the router in front of them (the embedded default).
    Up(up::UpArgs),
    /// Check a policy component, or print the plan it makes for one request.
    #[command(subcommand)]
    Policy(policy_cli::PolicyCommand),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_tracing(cli.log_format);
    let result = match cli.command {
        Command::Engine(args) => engine(args),
        Command::Bench(args) => switchyard_bench::run_blocking(args).map_err(Into::into),
        Command::Serve(args) => serve(&args),
        Command::Up(args) => up(args),
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

fn serve(args: &switchyard_router::config::ServeArgs) -> anyhow::Result<()> {
    let config = match switchyard_router::config::Config::from_args(args) {
        Ok(config) => config,
        Err(e) => {
            eprintln!("switchyard serve: {e}");
            std::process::exit(USAGE_ERROR);
        }
    };
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(switchyard_router::serve::run(config, shutdown_signal()))?;
    Ok(())
}

fn engine(args: switchyard_engine::EngineArgs) -> anyhow::Result<()> {
    if let Some(threads) = args.threads {
        set_model_threads(threads);
    }
    match switchyard_engine::run(args, shutdown_signal()) {
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

fn up(args: up::UpArgs) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Runtime::new()?;
    match runtime.block_on(up::run(args, shutdown_signal())) {
        Err(up::UpError::Config(e)) => {
            eprintln!("switchyard up: {e}");
            std::process::exit(USAGE_ERROR);
        }
        other => Ok(other?),
    }
}

/// Logs go to stderr so commands that print results (`policy plan`) keep stdout clean.
fn init_tracing(format: LogFormat) {
    let logs = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        );
    match format {
        LogFormat::Text => logs.init(),
        LogFormat::Json => logs.json().init(),
    }
}

/// Resolves on SIGINT or SIGTERM.
async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut int), Ok(mut term)) = (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) else {
        // Without signal handlers the process still stops on the default disposition.
        std::future::pending::<()>().await;
        return;
    };
    tokio::select! {
        _ = int.recv() => tracing::info!("SIGINT: shutting down"),
        _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
    }
}
