//! What a run reports: per policy, the fields `switchyard bench` computes from a real run
//! (the same code, from the same kind of per-request records) and what only a simulator
//! knows (KV moved, engine utilisation, policy faults); as a table with each policy's
//! difference to the first, as JSON (over seeds and loads when asked), and as SVG plots
//! (latency CDFs, engines' load over time, SLO attainment against load).

use std::io::{self, Write};
use std::path::Path;
use std::time::Duration;

use serde_json::{Map, Value, json};
use switchyard_bench::trace::TraceSummary;
use switchyard_bench::{
    Corner, LatencySeries, Line, LineChart, PlotError, ReplayMetrics, Summary, replay_metrics_json,
    summary_json, write_line_charts,
};

use crate::config::LabConfig;
use crate::sim::SimResult;

/// One policy's replay.
#[derive(Debug)]
pub struct PolicyReport {
    /// As given on the command line.
    pub name: String,
    pub summary: Summary,
    pub metrics: ReplayMetrics,
    pub sim: SimResult,
}

impl PolicyReport {
    pub fn new(name: String, sim: SimResult, config: &LabConfig) -> PolicyReport {
        let summary = Summary::of(&sim.outcomes, sim.duration, config.slo);
        let preemptions = sim.engines.iter().map(|e| e.counters.preemptions).sum();
        let metrics = ReplayMetrics::of(&summary, sim.outcomes.len(), Some(preemptions));
        PolicyReport {
            name,
            summary,
            metrics,
            sim,
        }
    }

    /// Each engine's busy share of the simulated time.
    pub fn utilisation(&self) -> Vec<f64> {
        let span = self.sim.duration.as_secs_f64();
        self.sim
            .engines
            .iter()
            .map(|e| {
                if span > 0.0 {
                    e.busy.as_secs_f64() / span
                } else {
                    0.0
                }
            })
            .collect()
    }

    fn latencies(&self) -> LatencySeries {
        let timings = || {
            self.sim
                .outcomes
                .iter()
                .filter_map(|o| o.result.as_ref().ok())
        };
        LatencySeries {
            name: self.name.clone(),
            ttft_ms: timings().map(|t| ms(t.ttft)).collect(),
            tpot_ms: timings().filter_map(|t| t.tpot()).map(ms).collect(),
            e2e_ms: timings().map(|t| ms(t.e2e)).collect(),
        }
    }

    /// The share of the replayed requests that completed within the SLO (failed ones did
    /// not); `None` without one.
    pub fn slo_attainment(&self, config: &LabConfig) -> Option<f64> {
        let slo = config.slo?;
        let good = self
            .sim
            .outcomes
            .iter()
            .filter_map(|o| o.result.as_ref().ok())
            .filter(|t| slo.met_by(ms(t.ttft), t.tpot().map(ms)))
            .count();
        let replayed = self.sim.outcomes.len();
        Some(if replayed == 0 {
            0.0
        } else {
            good as f64 / replayed as f64
        })
    }

    /// The mean per-request difference to `base`'s latencies, over the requests both
    /// completed (the same arrivals: a paired comparison, free of the trace's own spread).
    fn paired_difference(&self, base: &PolicyReport) -> Map<String, Value> {
        let pairs: Vec<_> = self
            .sim
            .outcomes
            .iter()
            .zip(&base.sim.outcomes)
            .filter_map(|(o, b)| Some((o.result.as_ref().ok()?, b.result.as_ref().ok()?)))
            .collect();
        let mean_of = |deltas: Vec<f64>| {
            (!deltas.is_empty()).then(|| deltas.iter().sum::<f64>() / deltas.len() as f64)
        };
        let ttft = mean_of(pairs.iter().map(|(o, b)| ms(o.ttft) - ms(b.ttft)).collect());
        let tpot = mean_of(
            pairs
                .iter()
                .filter_map(|(o, b)| Some(ms(o.tpot()?) - ms(b.tpot()?)))
                .collect(),
        );
        let e2e = mean_of(pairs.iter().map(|(o, b)| ms(o.e2e) - ms(b.e2e)).collect());
        let mut out = Map::new();
        out.insert("pairs".into(), json!(pairs.len()));
        out.insert("mean_ttft_ms".into(), json!(ttft));
        out.insert("mean_tpot_ms".into(), json!(tpot));
        out.insert("mean_e2el_ms".into(), json!(e2e));
        out
    }
}

/// One load of a `--load-sweep`: each policy's JSON fields there, over the seeds.
#[derive(Debug, Clone, PartialEq)]
pub struct SweepPoint {
    /// A multiple of the replayed arrival rate.
    pub load: f64,
    /// The replay's arrival rate at this load, requests per second.
    pub request_rate: f64,
    pub policies: Map<String, Value>,
}

/// A whole run.
#[derive(Debug)]
pub struct LabReport {
    /// The requests replayed (after --window and --limit), counted once.
    pub simulated_requests: usize,
    pub replayed: TraceSummary,
    /// The whole command: loading the trace, compiling the policies, every simulation.
    pub wall: Duration,
    /// Simulations run, every seed and load counted.
    pub simulations: usize,
    /// The first seed's replay at the configured load: the table's and the plots'.
    pub policies: Vec<PolicyReport>,
    /// Each policy's JSON fields at the configured load ([`policy_fields`]), over every seed
    /// ([`crate::confidence::over_seeds`]), keyed by name in the policies' order.
    pub over_seeds: Map<String, Value>,
    /// With `--load-sweep`, each load, lowest first.
    pub sweep: Vec<SweepPoint>,
}

impl LabReport {
    /// Requests simulated per second of the command's wall time, each seed's and load's
    /// replay counted once.
    pub fn simulated_per_second(&self) -> f64 {
        let secs = self.wall.as_secs_f64();
        let runs = self.simulations / self.policies.len().max(1);
        if secs > 0.0 {
            (self.simulated_requests * runs) as f64 / secs
        } else {
            0.0
        }
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Each policy's JSON fields for one replay, keyed by its name as given: the lab's fields
/// (bench's [`ReplayMetrics`] names), vLLM's benchmark fields, what only a simulation knows,
/// the SLO attainment, and its difference to the first policy, figure by figure (`vs_first`)
/// and request by request (`paired_vs_first`).
pub fn policy_fields(config: &LabConfig, policies: &[PolicyReport]) -> Map<String, Value> {
    let baseline = policies.first();
    policies
        .iter()
        .map(|p| {
            let mut fields = replay_metrics_json(&p.metrics);
            for (key, value) in summary_json(&p.summary) {
                fields.entry(key).or_insert(value);
            }
            fields.insert("slo_attainment".into(), json!(p.slo_attainment(config)));
            fields.insert("policy_faults".into(), json!(p.sim.policy_faults));
            let predictions = &p.sim.kv_predictions;
            fields.insert("prefix_predictions".into(), json!(predictions.made));
            fields.insert(
                "prefix_prediction_accuracy".into(),
                json!(predictions.accuracy()),
            );
            fields.insert("kv_transfers".into(), json!(p.sim.transfers.completed));
            fields.insert("kv_moved_tokens".into(), json!(p.sim.transfers.tokens));
            fields.insert("kv_moved_bytes".into(), json!(p.sim.transfers.bytes));
            fields.insert("engine_utilisation".into(), json!(p.utilisation()));
            let steps: Vec<u64> = p.sim.engines.iter().map(|e| e.steps).collect();
            fields.insert("engine_steps".into(), json!(steps));
            if let Some(base) = baseline {
                fields.insert(
                    "vs_first".into(),
                    Value::Object(difference(&base.metrics, &p.metrics)),
                );
                fields.insert(
                    "paired_vs_first".into(),
                    Value::Object(p.paired_difference(base)),
                );
            }
            (p.name.clone(), Value::Object(fields))
        })
        .collect()
}

/// The JSON document: the run's settings, then one object per policy under `policies` (over
/// the seeds: [`LabReport::over_seeds`]) and, with `--load-sweep`, one per load under `sweep`.
/// `wall_seconds` is its only wall-clock figure: the rest is the same for the same inputs.
pub fn to_json(config: &LabConfig, report: &LabReport) -> Value {
    let cluster = &config.cluster;
    let replay = &config.replay;
    let seconds = |ms: Option<u64>| ms.map(|ms| ms as f64 / 1e3);
    let mut doc = json!({
        "seed": config.seed,
        "seeds": config.seeds,
        "simulated_requests": report.simulated_requests,
        "wall_seconds": report.wall.as_secs_f64(),
        "trace": {
            "file": config.trace.display().to_string(),
            "format": "mooncake",
            "speedup": replay.speedup,
            "window_s": [seconds(replay.window.start_ms), seconds(replay.window.end_ms)],
            "limit": replay.limit,
            "max_input_len": replay.max_input_len,
            "max_output_len": replay.max_output_len,
            "replayed": report.replayed,
        },
        "cluster": {
            "engines": cluster.engines(),
            "roles": cluster.roles,
            "protocol": cluster.protocol,
            "profile": cluster.latency.profile.name,
            "time_scale": cluster.latency.time_scale,
            "timing_table": config.timing_table.as_ref().map(|p| p.display().to_string()),
            "kv_bytes_per_token": cluster.transfer.bytes_per_token,
            "kv_bandwidth_gb_s": cluster.transfer.bytes_per_us.map(|b| b / 1e3),
            "kv_pages": cluster.kv_pages,
            "page_size": cluster.page_size,
            "prefix_cache": cluster.prefix_cache,
            "probe_interval_ms": cluster.probe_interval.as_millis() as u64,
            "kv_events_delay_ms": cluster.kv_events_delay.as_millis() as u64,
        },
        "fallback_policy": config.fallback.as_ref().map(|f| f.name.clone()),
        "slo_ttft_ms": config.slo.map(|s| s.ttft_ms),
        "slo_tpot_ms": config.slo.map(|s| s.tpot_ms),
        "policies": report.over_seeds,
    });
    if config.sweep.is_some() {
        let sweep: Vec<Value> = report
            .sweep
            .iter()
            .map(|point| {
                json!({
                    "load": point.load,
                    "request_rate": point.request_rate,
                    "policies": point.policies,
                })
            })
            .collect();
        doc["sweep"] = Value::Array(sweep);
    }
    doc
}

/// `other - base` for each numeric lab field.
fn difference(base: &ReplayMetrics, other: &ReplayMetrics) -> Map<String, Value> {
    let (base, other) = (replay_metrics_json(base), replay_metrics_json(other));
    other
        .iter()
        .filter_map(|(key, value)| {
            let delta = value.as_f64()? - base.get(key)?.as_f64()?;
            Some((key.clone(), json!(delta)))
        })
        .collect()
}

/// A row of the table: its title and each policy's figure.
struct Row {
    title: &'static str,
    value: fn(&PolicyReport) -> f64,
    /// How a figure is written, and how its difference to the first policy's is.
    format: Format,
}

#[derive(Clone, Copy)]
enum Format {
    Count,
    Millis,
    Rate,
    Share,
    GiB,
}

impl Format {
    fn value(self, v: f64) -> String {
        match self {
            Format::Count => format!("{v:.0}"),
            Format::Millis => format!("{v:.1}"),
            Format::Rate => format!("{v:.3}"),
            Format::Share => format!("{:.1}%", v * 100.0),
            Format::GiB => format!("{:.2}", v / f64::from(1u32 << 30)),
        }
    }

    fn difference(self, v: f64, base: f64) -> String {
        match self {
            Format::Count => format!("{:+.0}", v - base),
            Format::Share => format!("{:+.1} pt", (v - base) * 100.0),
            Format::GiB => format!("{:+.2}", (v - base) / f64::from(1u32 << 30)),
            Format::Millis | Format::Rate if base.abs() > f64::EPSILON => {
                format!("{:+.1}%", (v - base) / base * 100.0)
            }
            Format::Millis | Format::Rate => format!("{:+.3}", v - base),
        }
    }
}

const ROWS: &[Row] = &[
    Row {
        title: "completed",
        value: |p| p.summary.completed as f64,
        format: Format::Count,
    },
    Row {
        title: "failed",
        value: |p| p.summary.failed as f64,
        format: Format::Count,
    },
    Row {
        title: "goodput (req/s)",
        value: |p| p.metrics.request_goodput,
        format: Format::Rate,
    },
    Row {
        title: "prefix hit rate",
        value: |p| p.metrics.prefix_hit_rate.unwrap_or(0.0),
        format: Format::Share,
    },
    Row {
        title: "prefix prediction accuracy",
        value: |p| p.sim.kv_predictions.accuracy().unwrap_or(0.0),
        format: Format::Share,
    },
    Row {
        title: "TTFT mean (ms)",
        value: |p| p.summary.ttft_ms.mean,
        format: Format::Millis,
    },
    Row {
        title: "TTFT p50 (ms)",
        value: |p| p.summary.ttft_ms.p50,
        format: Format::Millis,
    },
    Row {
        title: "TTFT p90 (ms)",
        value: |p| p.summary.ttft_ms.p90,
        format: Format::Millis,
    },
    Row {
        title: "TTFT p99 (ms)",
        value: |p| p.summary.ttft_ms.p99,
        format: Format::Millis,
    },
    Row {
        title: "TPOT p50 (ms)",
        value: |p| p.summary.tpot_ms.p50,
        format: Format::Millis,
    },
    Row {
        title: "TPOT p90 (ms)",
        value: |p| p.summary.tpot_ms.p90,
        format: Format::Millis,
    },
    Row {
        title: "TPOT p99 (ms)",
        value: |p| p.summary.tpot_ms.p99,
        format: Format::Millis,
    },
    Row {
        title: "ITL p50 (ms)",
        value: |p| p.summary.itl_ms.p50,
        format: Format::Millis,
    },
    Row {
        title: "ITL p90 (ms)",
        value: |p| p.summary.itl_ms.p90,
        format: Format::Millis,
    },
    Row {
        title: "ITL p99 (ms)",
        value: |p| p.summary.itl_ms.p99,
        format: Format::Millis,
    },
    Row {
        title: "E2E mean (ms)",
        value: |p| p.summary.e2el_ms.mean,
        format: Format::Millis,
    },
    Row {
        title: "E2E p50 (ms)",
        value: |p| p.summary.e2el_ms.p50,
        format: Format::Millis,
    },
    Row {
        title: "E2E p90 (ms)",
        value: |p| p.summary.e2el_ms.p90,
        format: Format::Millis,
    },
    Row {
        title: "E2E p99 (ms)",
        value: |p| p.summary.e2el_ms.p99,
        format: Format::Millis,
    },
    Row {
        title: "preemptions",
        value: |p| p.metrics.preemptions.unwrap_or(0) as f64,
        format: Format::Count,
    },
    Row {
        title: "KV moved (GiB)",
        value: |p| p.sim.transfers.bytes as f64,
        format: Format::GiB,
    },
    Row {
        title: "policy faults",
        value: |p| p.sim.policy_faults as f64,
        format: Format::Count,
    },
    Row {
        title: "engine busy, mean",
        value: |p| mean(&p.utilisation()),
        format: Format::Share,
    },
    Row {
        title: "engine busy, min",
        value: |p| p.utilisation().into_iter().fold(f64::INFINITY, f64::min),
        format: Format::Share,
    },
    Row {
        title: "engine busy, max",
        value: |p| p.utilisation().into_iter().fold(0.0, f64::max),
        format: Format::Share,
    },
];

fn mean(values: &[f64]) -> f64 {
    if values.is_empty() {
        0.0
    } else {
        values.iter().sum::<f64>() / values.len() as f64
    }
}

/// The table: a row per metric, a column per policy, each after the first with its difference
/// to the first; then what the run cost.
pub fn write_table(out: &mut impl Write, config: &LabConfig, report: &LabReport) -> io::Result<()> {
    let cluster = &config.cluster;
    writeln!(
        out,
        "switchyard lab: {} requests of {} on {} engines ({}, {}, prefix cache {}), seed {}",
        report.simulated_requests,
        config.trace.display(),
        cluster.engines(),
        cluster.protocol,
        match &config.timing_table {
            Some(table) => format!("steps from {}", table.display()),
            None => cluster.latency.profile.name.to_owned(),
        },
        if cluster.prefix_cache { "on" } else { "off" },
        config.seed
    )?;
    let cells: Vec<Vec<String>> = ROWS
        .iter()
        .map(|row| {
            let base = report.policies.first().map(row.value);
            report
                .policies
                .iter()
                .enumerate()
                .map(|(i, p)| {
                    let v = (row.value)(p);
                    match base {
                        Some(base) if i > 0 => {
                            format!(
                                "{} ({})",
                                row.format.value(v),
                                row.format.difference(v, base)
                            )
                        }
                        _ => row.format.value(v),
                    }
                })
                .collect()
        })
        .collect();
    let title_width = ROWS.iter().map(|r| r.title.len()).max().unwrap_or(0);
    let widths: Vec<usize> = report
        .policies
        .iter()
        .enumerate()
        .map(|(i, p)| {
            cells
                .iter()
                .map(|row| row[i].len())
                .chain([p.name.len()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    write!(out, "{:title_width$}", "")?;
    for (p, w) in report.policies.iter().zip(&widths) {
        write!(out, "  {:>w$}", p.name)?;
    }
    writeln!(out)?;
    for (row, cells) in ROWS.iter().zip(&cells) {
        write!(out, "{:title_width$}", row.title)?;
        for (cell, w) in cells.iter().zip(&widths) {
            write!(out, "  {cell:>w$}")?;
        }
        writeln!(out)?;
    }
    if config.seeds > 1 {
        write_seeds(out, config, report)?;
    }
    if !report.sweep.is_empty() {
        write_sweep(out, report)?;
    }
    writeln!(
        out,
        "{} requests × {} simulations in {:.2} s of wall time: {:.0} simulated requests/s",
        report.simulated_requests,
        report.simulations,
        report.wall.as_secs_f64(),
        report.simulated_per_second()
    )
}

/// The JSON fields the seeds' summary shows, with their titles.
const SEED_FIGURES: &[(&str, &str)] = &[
    ("request_goodput", "goodput (req/s)"),
    ("slo_attainment", "SLO attainment"),
    ("mean_ttft_ms", "TTFT mean (ms)"),
    ("p90_ttft_ms", "TTFT p90 (ms)"),
    ("mean_tpot_ms", "TPOT mean (ms)"),
    ("mean_e2el_ms", "E2E mean (ms)"),
];

/// Each policy's main figures over the seeds, as `mean [low, high]`, and its per-request
/// difference to the first policy the same way.
fn write_seeds(out: &mut impl Write, config: &LabConfig, report: &LabReport) -> io::Result<()> {
    writeln!(
        out,
        "over {} seeds ({}..={}), mean [95% confidence interval]:",
        config.seeds,
        config.seed,
        config.seed_list().last().unwrap_or(config.seed)
    )?;
    for policy in &report.policies {
        let (name, fields) = (&policy.name, &report.over_seeds[&policy.name]);
        writeln!(out, "  {name}")?;
        let paired = &fields["paired_vs_first"];
        let figures = SEED_FIGURES
            .iter()
            .map(|&(key, title)| (fields, key, title))
            .chain([
                (
                    paired,
                    "mean_ttft_ms",
                    "paired TTFT difference to the first (ms)",
                ),
                (
                    paired,
                    "mean_e2el_ms",
                    "paired E2E difference to the first (ms)",
                ),
            ]);
        for (fields, key, title) in figures {
            let Some(mean) = fields[key].as_f64() else {
                continue;
            };
            let ci = &fields[format!("{key}_ci95")];
            match (ci[0].as_f64(), ci[1].as_f64()) {
                (Some(low), Some(high)) => {
                    writeln!(out, "    {title:42} {mean:>10.3} [{low:.3}, {high:.3}]")?;
                }
                _ => writeln!(out, "    {title:42} {mean:>10.3}")?,
            }
        }
    }
    Ok(())
}

/// Each load of the sweep: each policy's SLO attainment, goodput and TTFT p90.
fn write_sweep(out: &mut impl Write, report: &LabReport) -> io::Result<()> {
    writeln!(
        out,
        "load sweep (× the replayed rate): SLO attainment / goodput (req/s) / TTFT p90 (ms)"
    )?;
    let names: Vec<&String> = report.policies.iter().map(|p| &p.name).collect();
    let width = names.iter().map(|n| n.len()).max().unwrap_or(0).max(24);
    write!(out, "{:>6} {:>9}", "load", "req/s")?;
    for name in &names {
        write!(out, "  {name:>width$}")?;
    }
    writeln!(out)?;
    for point in &report.sweep {
        write!(out, "{:>6.2} {:>9.3}", point.load, point.request_rate)?;
        for name in &names {
            let fields = &point.policies[name.as_str()];
            let figure = |key: &str| fields[key].as_f64().unwrap_or(f64::NAN);
            let cell = format!(
                "{:.1}% / {:.3} / {:.0}",
                figure("slo_attainment") * 100.0,
                figure("request_goodput"),
                figure("p90_ttft_ms")
            );
            write!(out, "  {cell:>width$}")?;
        }
        writeln!(out)?;
    }
    Ok(())
}

/// The plots under `--out`, each named with its file: the TTFT, TPOT and end-to-end latency
/// CDFs of every policy; each policy's engines' queue depth and KV usage over time; with a
/// sweep, SLO attainment, goodput and TTFT p90 against load.
pub fn write_plots(dir: &Path, report: &LabReport) -> Result<(), (String, PlotError)> {
    let at = |file: String, result: Result<(), PlotError>| result.map_err(|e| (file, e));
    let series = report
        .policies
        .iter()
        .map(PolicyReport::latencies)
        .collect();
    let cdfs = "latency_cdf.svg".to_owned();
    at(
        cdfs.clone(),
        switchyard_bench::write_latency_cdfs(&dir.join(&cdfs), series),
    )?;
    for (i, policy) in report.policies.iter().enumerate() {
        let file = format!("engines_{i}_{}.svg", file_safe(&policy.name));
        at(
            file.clone(),
            write_line_charts(&dir.join(&file), &engine_charts(policy)),
        )?;
    }
    if !report.sweep.is_empty() {
        let file = "attainment_vs_load.svg".to_owned();
        at(
            file.clone(),
            write_line_charts(&dir.join(&file), &sweep_charts(report)),
        )?;
    }
    Ok(())
}

/// A policy's name as a file name's part: its file stem, letters, digits, `-` and `_` kept.
fn file_safe(name: &str) -> String {
    let stem = Path::new(name)
        .file_stem()
        .and_then(|s| s.to_str())
        .unwrap_or(name);
    stem.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// Each engine's queue (requests waiting for a batch slot) and KV usage at every probe.
fn engine_charts(policy: &PolicyReport) -> [LineChart; 2] {
    let timeline = &policy.sim.timeline;
    let engines = timeline.first().map_or(0, |s| s.engines.len());
    let lines = |value: fn(&crate::sim::Load) -> f64| {
        (0..engines)
            .map(|e| Line {
                name: format!("engine {e}"),
                points: timeline
                    .iter()
                    .map(|s| (s.at.as_secs_f64(), value(&s.engines[e])))
                    .collect(),
            })
            .collect()
    };
    [
        LineChart {
            title: format!("{}: queue depth", policy.name),
            x_desc: "simulated time (s)".into(),
            y_desc: "requests waiting".into(),
            y_range: None,
            legend: Corner::UpperRight,
            lines: lines(|l| f64::from(l.waiting)),
        },
        LineChart {
            title: format!("{}: KV usage", policy.name),
            x_desc: "simulated time (s)".into(),
            y_desc: "share of KV pages used".into(),
            y_range: Some(0.0..1.0),
            legend: Corner::UpperRight,
            lines: lines(|l| f64::from(l.kv_usage)),
        },
    ]
}

/// Per policy, SLO attainment, goodput and TTFT p90 against the sweep's loads.
fn sweep_charts(report: &LabReport) -> [LineChart; 3] {
    let chart = |title: &str, y_desc: &str, key: &str, y_range: Option<std::ops::Range<f64>>| {
        let lines = report
            .policies
            .iter()
            .map(|p| &p.name)
            .map(|name| Line {
                name: name.clone(),
                points: report
                    .sweep
                    .iter()
                    .filter_map(|p| Some((p.load, p.policies[name.as_str()][key].as_f64()?)))
                    .collect(),
            })
            .collect();
        LineChart {
            title: title.to_owned(),
            x_desc: "offered load (× the replayed rate)".into(),
            y_desc: y_desc.to_owned(),
            y_range,
            legend: Corner::LowerRight,
            lines,
        }
    };
    [
        chart(
            "SLO attainment",
            "share of requests within the SLO",
            "slo_attainment",
            Some(0.0..1.0),
        ),
        chart(
            "Goodput",
            "requests/s within the SLO",
            "request_goodput",
            None,
        ),
        chart("TTFT p90", "ms", "p90_ttft_ms", None),
    ]
}
