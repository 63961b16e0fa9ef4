//! `switchyard lab`: replay a request trace on a simulated cluster, once per policy, and
//! compare the policies.
//!
//! The cluster is the reference engine's own scheduler core ([`switchyard_engine::scheduler`]:
//! continuous batching, a paged KV pool with a prefix cache, preemption under KV pressure,
//! prep_recv reservations and leases), one per engine, with a model that costs nothing and a
//! latency profile that says what each step would take on real hardware
//! ([`switchyard_engine::latency`]); KV moves between engines in the time its bytes take over a
//! link. The policies are the real components, loaded by the policy host with the router's
//! limits, their WASI clocks reading the simulation's virtual clock and their randomness
//! seeded. What the router does around them (plan, validate, run the plan as the endpoints'
//! protocol does, continue a preempted stream, fall back when a policy faults, tell the policy
//! how requests ended) is mirrored in the simulation ([`simulate`]).
//!
//! ```text
//! LabArgs ──validate──▶ LabConfig ──▶ trace ─replay─▶ requests ─draw per seed─▶ arrivals
//!                                        │              (seed 0: as recorded; the same for
//!                                        │               every policy)
//!              per --policy, on threads of their own:
//!              load the component (virtual clock, seed) → simulate → PolicyReport
//!                                        │
//!       (again per --seeds seed, and per --load-sweep load: each figure over the seeds)
//!                                        │
//!                 LabReport ──▶ table (stdout), --json, --out DIR/{*.svg,summary.txt}
//! ```
//!
//! A simulation is deterministic: one thread, integer microseconds, an agenda whose ties
//! break in scheduling order, every draw seeded (the arrivals' re-draw too). The same inputs give the same JSON, byte for
//! byte, but for `wall_seconds`.
//!
//! The lab depends on the engine, the contract, the policy host and the benchmark's trace
//! and statistics code (so a simulated run and `switchyard bench --trace` against a real
//! router compute the same fields the same way); never on the router.
//!
//! ```no_run
//! # fn demo() -> Result<(), switchyard_lab::LabError> {
//! use clap::Parser;
//! #[derive(Parser)]
//! struct Cli {
//!     #[command(flatten)]
//!     lab: switchyard_lab::LabArgs,
//! }
//! let cli = Cli::parse_from([
//!     "lab", "--trace", "examples/traces/mooncake_conversation_trace.jsonl",
//!     "--policy", "round-robin", "--policy", "target/examples/affinity-rust.wasm",
//!     "--engines", "8", "--limit", "2000", "--json", "lab.json",
//! ]);
//! switchyard_lab::run(cli.lab)
//! # }
//! ```
#![forbid(unsafe_code)]

mod args;
mod arrivals;
mod confidence;
mod config;
mod policies;
mod report;
mod sim;

#[cfg(test)]
mod tests;

use std::io::IsTerminal;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use switchyard_bench::trace::{Replay, ScheduledRequest, Trace, TraceError};

pub use args::{LabArgs, LabProtocol, OnOff, TraceFormat};
pub use config::{
    ClusterSpec, Hardware, LabConfig, LoadSweep, PolicySpec, RetryRules, TransferModel,
    engine_defaults,
};
pub use policies::{Planners, SimClock};
pub use report::{LabReport, PolicyReport, SweepPoint, policy_fields, to_json, write_table};
pub use sim::{
    Ended, EngineStats, KvPredictions, Load, LoadSample, SimResult, Transfers, simulate,
};

/// Why a lab run could not be done.
#[derive(Debug, thiserror::Error)]
pub enum LabError {
    #[error("invalid lab options: {0}")]
    Config(String),
    #[error(transparent)]
    Trace(#[from] TraceError),
    #[error(transparent)]
    TimingTable(#[from] switchyard_engine::latency::TableError),
    #[error("--window and --limit select no request of {0}")]
    NothingToReplay(String),
    #[error("loading policy {policy}: {source}")]
    Policy {
        policy: String,
        #[source]
        source: switchyard_policy_host::LoadError,
    },
    /// A simulation broke one of its invariants: a bug of the lab, whose numbers are not
    /// reported.
    #[error("the simulation of policy {policy} broke its invariants: {}", violations.join("; "))]
    Invariants {
        policy: String,
        violations: Vec<String>,
    },
    #[error("writing {path}: {reason}")]
    Output { path: String, reason: String },
}

/// The whole command: validate, simulate every policy, print the table, write `--json` and
/// `--out`.
pub fn run(args: LabArgs) -> Result<(), LabError> {
    let started = Instant::now();
    let config = args.validate()?;
    let mut report = execute(&config, progress_target())?;
    report.wall = started.elapsed();
    let mut table = Vec::new();
    write_table(&mut table, &config, &report).map_err(|e| output_error("stdout", e))?;
    std::io::Write::write_all(&mut std::io::stdout().lock(), &table)
        .map_err(|e| output_error("stdout", e))?;
    if let Some(path) = &config.json {
        let text = serde_json::to_string_pretty(&to_json(&config, &report))
            .map_err(|e| output_error(&path.display().to_string(), e))?;
        std::fs::write(path, text).map_err(|e| output_error(&path.display().to_string(), e))?;
    }
    if let Some(dir) = &config.out {
        let name = |file: &str| dir.join(file).display().to_string();
        std::fs::create_dir_all(dir).map_err(|e| output_error(&dir.display().to_string(), e))?;
        let summary = dir.join("summary.txt");
        std::fs::write(&summary, &table).map_err(|e| output_error(&name("summary.txt"), e))?;
        report::write_plots(dir, &report).map_err(|(file, e)| output_error(&name(&file), e))?;
    }
    Ok(())
}

fn output_error(path: &str, e: impl std::fmt::Display) -> LabError {
    LabError::Output {
        path: path.to_owned(),
        reason: e.to_string(),
    }
}

/// Reads the trace and simulates every policy on it with each seed, at the configured load
/// and at each load of the sweep, as many at once as there are CPUs, each on a thread of its
/// own (compiling its component included); draws progress on `progress`. The report's `wall`
/// is this call's.
pub fn execute(config: &LabConfig, progress: ProgressDrawTarget) -> Result<LabReport, LabError> {
    let started = Instant::now();
    let trace = Trace::read(&config.trace)?;
    let loads: Vec<f64> = std::iter::once(1.0)
        .chain(config.sweep.iter().flat_map(|s| s.loads()))
        .collect();
    let replays: Vec<Replay> = loads
        .iter()
        .map(|&load| trace.replay(&config.variant(config.seed, load).replay))
        .collect();
    if replays[0].is_empty() {
        return Err(LabError::NothingToReplay(
            config.trace.display().to_string(),
        ));
    }
    // One run per load and seed, the configured load's first; each seed's arrivals drawn
    // once per load, for every policy.
    let runs: Vec<(usize, LabConfig)> = loads
        .iter()
        .enumerate()
        .flat_map(|(l, &load)| config.seed_list().map(move |seed| (l, seed, load)))
        .map(|(l, seed, load)| (l, config.variant(seed, load)))
        .collect();
    let arrivals: Vec<Vec<ScheduledRequest>> = runs
        .iter()
        .map(|(l, run)| arrivals::draw(replays[*l].requests(), run.seed))
        .collect();
    let bars = MultiProgress::with_draw_target(progress);
    let mut results = simulate_all(config, &runs, &arrivals, &bars).into_iter();
    let mut first: Option<Vec<PolicyReport>> = None;
    let mut fields: Vec<Vec<serde_json::Map<String, serde_json::Value>>> =
        vec![Vec::new(); loads.len()];
    for (l, run) in &runs {
        let policies = config
            .policies
            .iter()
            .map(|spec| {
                let sim = results.next().expect("a result per policy and run")?;
                if !sim.violations.is_empty() {
                    return Err(LabError::Invariants {
                        policy: spec.name.clone(),
                        violations: sim.violations,
                    });
                }
                Ok(PolicyReport::new(spec.name.clone(), sim, run))
            })
            .collect::<Result<Vec<_>, _>>()?;
        fields[*l].push(report::policy_fields(run, &policies));
        first.get_or_insert(policies);
    }
    let mut over_loads = fields.into_iter().map(confidence::over_seeds);
    let over_seeds = over_loads.next().expect("the configured load");
    let sweep = loads[1..]
        .iter()
        .zip(&replays[1..])
        .zip(over_loads)
        .map(|((&load, replay), policies)| report::SweepPoint {
            load,
            // The summary's rate is the trace's own, in trace time.
            request_rate: replay.summary().request_rate * config.replay.speedup * load,
            policies,
        })
        .collect();
    Ok(LabReport {
        simulated_requests: replays[0].len(),
        replayed: replays[0].summary(),
        wall: started.elapsed(),
        simulations: runs.len() * config.policies.len(),
        policies: first.expect("one run at least"),
        over_seeds,
        sweep,
    })
}

/// Every policy's simulation of every run (a load and a seed, replaying the arrivals beside
/// it), in that order, on up to one thread per CPU.
fn simulate_all(
    config: &LabConfig,
    runs: &[(usize, LabConfig)],
    arrivals: &[Vec<ScheduledRequest>],
    bars: &MultiProgress,
) -> Vec<Result<SimResult, LabError>> {
    let slots: Vec<_> = runs
        .iter()
        .zip(arrivals)
        .flat_map(|((_, run), arrivals)| {
            config
                .policies
                .iter()
                .map(move |spec| (run, spec, arrivals.as_slice()))
        })
        .map(|(run, spec, arrivals)| {
            let bar = bars.add(progress_bar(spec, run, arrivals.len() as u64));
            (run, spec, arrivals, bar)
        })
        .collect();
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(slots.len());
    let next = AtomicUsize::new(0);
    let mut results: Vec<Option<Result<SimResult, LabError>>> =
        std::iter::repeat_with(|| None).take(slots.len()).collect();
    std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                scope.spawn(|| {
                    let mut done = Vec::new();
                    loop {
                        let index = next.fetch_add(1, Ordering::Relaxed);
                        let Some((run, spec, arrivals, bar)) = slots.get(index) else {
                            return done;
                        };
                        done.push((index, simulate_policy(run, spec, arrivals, bar)));
                        bar.finish_and_clear();
                    }
                })
            })
            .collect();
        for worker in workers {
            let finished = worker
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
            for (index, result) in finished {
                results[index] = Some(result);
            }
        }
    });
    results
        .into_iter()
        .map(|r| r.expect("every policy was simulated"))
        .collect()
}

/// Loads one policy (and the fallback) for a simulation of its own, and runs it.
fn simulate_policy(
    config: &LabConfig,
    spec: &PolicySpec,
    arrivals: &[ScheduledRequest],
    bar: &ProgressBar,
) -> Result<SimResult, LabError> {
    let clock = Arc::new(SimClock::default());
    let planners = policies::load(spec, config.fallback.as_ref(), clock.clone(), config.seed)?;
    Ok(simulate(
        &config.cluster,
        arrivals,
        planners,
        clock,
        config.seed,
        bar,
    ))
}

/// Bars on stderr when it is a terminal (logs and CI stay clean).
fn progress_target() -> ProgressDrawTarget {
    if std::io::stderr().is_terminal() {
        ProgressDrawTarget::stderr()
    } else {
        ProgressDrawTarget::hidden()
    }
}

fn progress_bar(spec: &PolicySpec, run: &LabConfig, total: u64) -> ProgressBar {
    let bar = ProgressBar::new(total);
    if let Ok(style) =
        ProgressStyle::with_template("{elapsed_precise} [{wide_bar}] {pos}/{len} requests {msg}")
    {
        bar.set_style(style);
    }
    bar.set_message(format!(
        "{} (seed {}, speedup {})",
        spec.name, run.seed, run.replay.speedup
    ));
    bar
}
