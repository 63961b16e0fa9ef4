//! `switchyard bench`: a load generator for `/v1/completions` and a rerunnable measurement of
//! the router's overhead.
//!
//! It speaks to servers only through the wire types (`switchyard-wire`): its direct arm does the
//! router's MLC sequence itself, so it must not depend on the router it measures.
//!
//! ```text
//! BenchArgs ──validate──▶ BenchConfig ──execute──▶ BenchReport ──▶ table (stdout), --json, --plot
//!                                  │
//!             Workload (prompt i = f(seed, i)) + closed loop | Poisson open loop
//!                                  │
//!        each request: routed arm (POST URL/v1/completions)
//!                      or, with --compare-direct, the direct arm (the router's work done here)
//! ```
//!
//! `--trace FILE` replays a recorded trace instead ([`trace`]: Mooncake JSONL, expanded into
//! the same token ids the policy lab simulates), open loop at the trace's timestamps, and writes
//! the lab's per-policy fields ([`ReplayMetrics`]) at the top of its JSON; `switchyard trace`
//! ([`TraceCommand`]) summarises traces and writes seeded synthetic ones.
//!
//! Latency counts from each request's *scheduled* send time. With `--compare-direct` both arms
//! run interleaved (each request's arm is drawn from the seed), so noise on the machine hits
//! both alike, and the report gives the router's cost as the p50 difference and ratio.
//!
//! To measure the router alone, run the engines as their own processes (`switchyard up`
//! embeds them in the router's process, so `--router-pid` would count their CPU too):
//!
//! ```text
//! switchyard engine --port 18101 --device-rank 0 --kv-transport tcp \
//!     --kv-listen tcp:127.0.0.1:18201 --kv-peer 1=tcp:127.0.0.1:18202 &
//! switchyard engine --port 18102 --device-rank 1 --kv-transport tcp \
//!     --kv-listen tcp:127.0.0.1:18202 --kv-peer 0=tcp:127.0.0.1:18201 &
//! switchyard serve --port 18100 --policy disagg \
//!     --endpoint http://127.0.0.1:18101 --endpoint http://127.0.0.1:18102 &
//! switchyard bench --url http://127.0.0.1:18100 --compare-direct --router-pid $! \
//!     --num-requests 2000 --concurrency 4 --json overhead.json --plot overhead.svg
//! ```
//!
//! ```no_run
//! # async fn demo() -> Result<(), switchyard_bench::BenchError> {
//! use clap::Parser;
//! #[derive(Parser)]
//! struct Cli {
//!     #[command(flatten)]
//!     bench: switchyard_bench::BenchArgs,
//! }
//! let cli = Cli::parse_from(["bench", "--url", "http://127.0.0.1:8000", "--rate", "4"]);
//! switchyard_bench::run(cli.bench).await
//! # }
//! ```

mod client;
mod config;
mod connection;
mod direct;
mod plot;
mod procstat;
mod report;
mod runner;
mod schedule;
mod server_metrics;
mod stats;
pub mod trace;
mod trace_command;
mod workload;

#[cfg(test)]
mod tests;

use std::io::IsTerminal;
use std::sync::Arc;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

pub use config::{
    BenchArgs, BenchConfig, LenRange, LoadShape, PlanKind, PromptFormat, Slo, TraceConfig,
    parse_slo,
};
pub use direct::DirectPlan;
pub use plot::{
    Corner, LatencySeries, Line, LineChart, PlotError, write_latency_cdfs, write_line_charts,
};
pub use report::{replay_metrics_json, summary_json};
pub use schedule::Arrivals;
pub use stats::{Distribution, ReplayMetrics, RequestOutcome, Summary, Timing, percentile};
pub use trace_command::{TraceCommand, run_trace_command};
pub use workload::Arm;

use direct::{DirectArm, DirectOptions};
use runner::{Executor, Limits};
use trace::{Replay, Trace, TraceError, TraceSummary};
use workload::{RequestSpec, Workload};

/// How long the reachability check waits before calling the server unreachable.
const PREFLIGHT_TIMEOUT: Duration = Duration::from_secs(5);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Why a benchmark could not run (single request failures are counted, not errors).
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("invalid bench options: {0}")]
    Config(String),
    #[error("cannot reach {url}: {reason}")]
    Unreachable { url: String, reason: String },
    #[error("direct arm: {0}")]
    Endpoints(String),
    #[error("building the HTTP client: {0}")]
    Client(String),
    #[error("measuring the router process: {0}")]
    Router(#[from] procstat::ProcError),
    #[error("writing {path}: {reason}")]
    Output { path: String, reason: String },
    #[error(transparent)]
    Trace(#[from] TraceError),
    #[error(transparent)]
    Synth(#[from] trace::SynthError),
}

/// The router's resource use over the run.
#[derive(Debug, Clone, PartialEq)]
pub struct RouterUsage {
    pub pid: u32,
    /// CPU time (user + system) the router used during the run.
    pub cpu: Duration,
    /// `cpu` divided by the routed requests sent.
    pub cpu_per_request_us: f64,
    /// CPU seconds per second the router used while idle before the run (0 if not sampled).
    pub idle_cpu_rate: f64,
    /// `cpu` less the idle rate over the run's duration, per routed request.
    pub net_cpu_per_request_us: f64,
    /// Peak resident set size over the process's life.
    pub peak_rss_kib: u64,
}

/// Everything one run measured.
#[derive(Debug, Clone)]
pub struct BenchReport {
    /// Wall time from the first send until the last response ended.
    pub duration: Duration,
    /// One per request sent, in request order.
    pub outcomes: Vec<RequestOutcome>,
    /// All requests together.
    pub overall: Summary,
    /// Per arm, only with `--compare-direct`.
    pub arms: Vec<(Arm, Summary)>,
    /// The direct arm's plan, with `--compare-direct`.
    pub direct_plan: Option<DirectPlan>,
    pub router: Option<RouterUsage>,
    /// What was replayed, with `--trace`.
    pub trace: Option<TraceRun>,
}

/// A trace replay's inputs and the figures only a replay has.
#[derive(Debug, Clone)]
pub struct TraceRun {
    /// The whole trace file.
    pub file: TraceSummary,
    /// The requests selected (window, limit) with their capped lengths.
    pub replayed: TraceSummary,
    /// Prompts cut by `--max-input-len`, and requests whose output `--max-output-len` lowered.
    pub capped_inputs: usize,
    pub capped_outputs: usize,
    /// The lab's fields for this run.
    pub metrics: ReplayMetrics,
}

impl BenchReport {
    /// The summary of one arm, if that arm ran.
    pub fn arm(&self, arm: Arm) -> Option<&Summary> {
        self.arms.iter().find(|(a, _)| *a == arm).map(|(_, s)| s)
    }
}

/// [`run`] on a new multi-threaded runtime, for the `switchyard bench` command.
pub fn run_blocking(args: BenchArgs) -> Result<(), BenchError> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| BenchError::Client(format!("starting the async runtime: {e}")))?;
    runtime.block_on(run(args))
}

/// The whole command: validate, run, print the table, write `--json` and `--plot`.
pub async fn run(args: BenchArgs) -> Result<(), BenchError> {
    let config = args.validate()?;
    let progress = progress_bar(config.num_requests);
    let report = execute(&config, progress.clone()).await?;
    progress.finish_and_clear();
    let mut stdout = std::io::stdout().lock();
    report::write_table(&mut stdout, &config, &report).map_err(|e| BenchError::Output {
        path: "stdout".into(),
        reason: e.to_string(),
    })?;
    if let Some(path) = &config.json {
        let json = report::to_json(&config, &report);
        let text = serde_json::to_string_pretty(&json).map_err(|e| output_error(path, e))?;
        std::fs::write(path, text).map_err(|e| output_error(path, e))?;
    }
    if let Some(path) = &config.plot {
        plot::write_cdfs(path, &report).map_err(|e| output_error(path, e))?;
    }
    Ok(())
}

fn output_error(path: &std::path::Path, e: impl std::fmt::Display) -> BenchError {
    BenchError::Output {
        path: path.display().to_string(),
        reason: e.to_string(),
    }
}

/// Runs the load described by `config` and summarises it; prints nothing.
pub async fn execute(
    config: &BenchConfig,
    progress: ProgressBar,
) -> Result<BenchReport, BenchError> {
    let client = reqwest::Client::builder()
        .connect_timeout(CONNECT_TIMEOUT)
        .tcp_nodelay(true)
        .build()
        .map_err(|e| BenchError::Client(e.to_string()))?;
    check_reachable(&client, &config.url).await?;
    if let Some(trace) = &config.trace {
        return execute_trace(config, trace, client, progress).await;
    }
    let direct = if config.workload.compare_direct {
        Some(
            DirectArm::discover(
                &client,
                &config.url,
                &config.endpoints,
                DirectOptions {
                    plan: config.plan,
                    pd_balance_factor: config.pd_balance_factor,
                    model: config.model.clone(),
                    stream: config.stream,
                },
            )
            .await?,
        )
    } else {
        None
    };
    let direct_plan = direct.as_ref().map(DirectArm::plan);
    let executor = executor(config, client, direct);
    let workload = Arc::new(Workload::new(config.workload.clone()));
    let limits = Limits {
        num_requests: config.num_requests,
        duration: config.duration,
    };
    let router_before = router_baseline(config).await?;
    let (outcomes, duration) = runner::drive(
        executor,
        workload,
        config.load,
        limits,
        config.workload.seed,
        progress,
    )
    .await;
    let router = router_after(config, router_before, duration, &outcomes)?;
    let overall = Summary::of(&outcomes, duration, config.slo);
    let arms = if config.workload.compare_direct {
        [Arm::Routed, Arm::Direct]
            .into_iter()
            .map(|arm| {
                let mine = outcomes.iter().filter(|o| o.arm == arm);
                (arm, Summary::of(mine, duration, config.slo))
            })
            .collect()
    } else {
        Vec::new()
    };
    Ok(BenchReport {
        duration,
        outcomes,
        overall,
        arms,
        direct_plan,
        router,
        trace: None,
    })
}

fn executor(
    config: &BenchConfig,
    client: reqwest::Client,
    direct: Option<DirectArm>,
) -> Arc<Executor> {
    let completions_url = format!("{}/v1/completions", config.url);
    // The config accepts --connection-per-client only with an http:// URL, which `of` takes.
    let own_connections = config
        .connection_per_client
        .then(|| connection::Target::of(&completions_url, CONNECT_TIMEOUT))
        .flatten();
    Arc::new(Executor {
        client,
        completions_url,
        model: config.model.clone(),
        prompt_format: config.prompt_format,
        stream: config.stream,
        request_timeout: config.request_timeout,
        direct,
        own_connections,
    })
}

/// Replays `trace` open loop against the server and summarises it as the lab would.
async fn execute_trace(
    config: &BenchConfig,
    trace: &TraceConfig,
    client: reqwest::Client,
    progress: ProgressBar,
) -> Result<BenchReport, BenchError> {
    let file = Trace::read(&trace.path)?;
    let replay = file.replay(&trace.replay);
    if replay.is_empty() {
        return Err(BenchError::Config(format!(
            "--window and --limit select no request of {}",
            trace.path.display()
        )));
    }
    if let Some(last) = replay.requests().last()
        && last.at >= config.duration
    {
        tracing::warn!(
            "the replay spans {:.1} s but --duration is {:.1} s: requests due later are not sent",
            last.at.as_secs_f64(),
            config.duration.as_secs_f64()
        );
    }
    progress.set_length(replay.len() as u64);
    let preemptions_before =
        server_metrics::fetch_counter(&client, &config.url, server_metrics::PREEMPTIONS).await;
    let executor = executor(config, client.clone(), None);
    let router_before = router_baseline(config).await?;
    let (outcomes, duration) = runner::replay(
        executor,
        due_requests(&replay),
        trace.max_concurrency,
        config.duration,
        progress,
    )
    .await;
    let router = router_after(config, router_before, duration, &outcomes)?;
    let preemptions_after =
        server_metrics::fetch_counter(&client, &config.url, server_metrics::PREEMPTIONS).await;
    let overall = Summary::of(&outcomes, duration, config.slo);
    let metrics = ReplayMetrics::of(
        &overall,
        replay.len(),
        server_metrics::growth(preemptions_before, preemptions_after),
    );
    Ok(BenchReport {
        duration,
        outcomes,
        overall,
        arms: Vec::new(),
        direct_plan: None,
        router,
        trace: Some(TraceRun {
            file: file.summary(),
            replayed: replay.summary(),
            capped_inputs: replay.capped_inputs(),
            capped_outputs: replay.capped_outputs(),
            metrics,
        }),
    })
}

/// The replay's requests as the runner sends them, each prompt built as its turn comes.
fn due_requests(replay: &Replay) -> impl Iterator<Item = (Duration, RequestSpec)> + '_ {
    replay.requests().iter().zip(0..).map(|(scheduled, index)| {
        let request = &scheduled.request;
        let spec = RequestSpec {
            index,
            prompt: request.prompt(),
            max_tokens: request.output_length,
            arm: Arm::Routed,
        };
        (scheduled.at, spec)
    })
}

/// Any HTTP answer means the server is there; only a failed connection stops the run.
async fn check_reachable(client: &reqwest::Client, url: &str) -> Result<(), BenchError> {
    let probe = format!("{url}/v1/models");
    match client.get(&probe).timeout(PREFLIGHT_TIMEOUT).send().await {
        Ok(_) => Ok(()),
        Err(e) => Err(BenchError::Unreachable {
            url: url.to_owned(),
            reason: switchyard_wire::error_chain(&e),
        }),
    }
}

/// With `--router-pid`, the router's CPU before the load starts.
async fn router_baseline(config: &BenchConfig) -> Result<Option<RouterBaseline>, BenchError> {
    match config.router_pid {
        Some(pid) => Ok(Some(
            sample_idle_router(pid, config.router_idle_sample).await?,
        )),
        None => Ok(None),
    }
}

/// With `--router-pid`, what the router used over the run.
fn router_after(
    config: &BenchConfig,
    before: Option<RouterBaseline>,
    duration: Duration,
    outcomes: &[RequestOutcome],
) -> Result<Option<RouterUsage>, BenchError> {
    match (config.router_pid, before) {
        (Some(pid), Some(before)) => Ok(Some(router_usage(pid, before, duration, outcomes)?)),
        _ => Ok(None),
    }
}

/// The router's CPU time at the start of the run, and its idle CPU rate just before.
#[derive(Debug, Clone, Copy)]
struct RouterBaseline {
    cpu: Duration,
    idle_rate: f64,
}

/// Watches the router for `window` before any load: a router burns some CPU while idle
/// (probes, timers), which would otherwise be charged to the requests.
async fn sample_idle_router(pid: u32, window: Duration) -> Result<RouterBaseline, BenchError> {
    let start = procstat::cpu_time(pid)?;
    if window.is_zero() {
        return Ok(RouterBaseline {
            cpu: start,
            idle_rate: 0.0,
        });
    }
    tokio::time::sleep(window).await;
    let cpu = procstat::cpu_time(pid)?;
    Ok(RouterBaseline {
        cpu,
        idle_rate: cpu.saturating_sub(start).as_secs_f64() / window.as_secs_f64(),
    })
}

fn router_usage(
    pid: u32,
    before: RouterBaseline,
    duration: Duration,
    outcomes: &[RequestOutcome],
) -> Result<RouterUsage, BenchError> {
    let cpu = procstat::cpu_time(pid)?.saturating_sub(before.cpu);
    let background = before.idle_rate * duration.as_secs_f64();
    let net = (cpu.as_secs_f64() - background).max(0.0);
    let routed = outcomes.iter().filter(|o| o.arm == Arm::Routed).count();
    let per_request_us = |secs: f64| {
        if routed == 0 {
            0.0
        } else {
            secs * 1e6 / routed as f64
        }
    };
    Ok(RouterUsage {
        pid,
        cpu,
        cpu_per_request_us: per_request_us(cpu.as_secs_f64()),
        idle_cpu_rate: before.idle_rate,
        net_cpu_per_request_us: per_request_us(net),
        peak_rss_kib: procstat::peak_rss_kib(pid)?,
    })
}

/// A bar on stderr, drawn only when stderr is a terminal (logs and CI stay clean).
fn progress_bar(total: u64) -> ProgressBar {
    let target = if std::io::stderr().is_terminal() {
        ProgressDrawTarget::stderr()
    } else {
        ProgressDrawTarget::hidden()
    };
    let bar = ProgressBar::with_draw_target(Some(total), target);
    if let Ok(style) =
        ProgressStyle::with_template("{elapsed_precise} [{wide_bar}] {pos}/{len} requests")
    {
        bar.set_style(style);
    }
    bar
}
