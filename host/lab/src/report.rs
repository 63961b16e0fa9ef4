//! What a run reports: per policy, the fields `switchyard bench` computes from a real run
//! (the same code, from the same kind of per-request records) and what only a simulator
//! knows (KV moved, engine utilisation, policy faults); as a table with each policy's
//! difference to the first, as JSON, and as latency CDFs.

use std::io::{self, Write};
use std::path::Path;
use std::time::Duration;

use serde_json::{Map, Value, json};
use switchyard_bench::trace::TraceSummary;
use switchyard_bench::{LatencySeries, ReplayMetrics, Summary, replay_metrics_json, summary_json};

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
        let (ttft_ms, e2e_ms) = self
            .sim
            .outcomes
            .iter()
            .filter_map(|o| o.result.as_ref().ok())
            .map(|t| (ms(t.ttft), ms(t.e2e)))
            .unzip();
        LatencySeries {
            name: self.name.clone(),
            ttft_ms,
            e2e_ms,
        }
    }
}

/// A whole run.
#[derive(Debug)]
pub struct LabReport {
    /// The requests replayed (after --window and --limit), counted once.
    pub simulated_requests: usize,
    pub replayed: TraceSummary,
    /// The whole command: loading the trace, compiling the policies, every simulation.
    pub wall: Duration,
    pub policies: Vec<PolicyReport>,
}

impl LabReport {
    /// Requests simulated per second of the command's wall time, counted once.
    pub fn simulated_per_second(&self) -> f64 {
        let secs = self.wall.as_secs_f64();
        if secs > 0.0 {
            self.simulated_requests as f64 / secs
        } else {
            0.0
        }
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// The JSON document: the run's settings, then one object per policy under `policies`, keyed
/// by its name as given, each with the lab's fields (bench's [`ReplayMetrics`] names), vLLM's
/// benchmark fields, what only a simulation knows, and its difference to the first policy.
/// `wall_seconds` is its only wall-clock figure: the rest is the same for the same inputs.
pub fn to_json(config: &LabConfig, report: &LabReport) -> Value {
    let cluster = &config.cluster;
    let replay = &config.replay;
    let seconds = |ms: Option<u64>| ms.map(|ms| ms as f64 / 1e3);
    let baseline = report.policies.first();
    let policies: Map<String, Value> = report
        .policies
        .iter()
        .map(|p| {
            let mut fields = replay_metrics_json(&p.metrics);
            for (key, value) in summary_json(&p.summary) {
                fields.entry(key).or_insert(value);
            }
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
            }
            (p.name.clone(), Value::Object(fields))
        })
        .collect();
    json!({
        "seed": config.seed,
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
        "policies": policies,
    })
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
        cluster.latency.profile.name,
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
    writeln!(
        out,
        "{} requests × {} policies simulated in {:.2} s of wall time: {:.0} simulated requests/s",
        report.simulated_requests,
        report.policies.len(),
        report.wall.as_secs_f64(),
        report.simulated_per_second()
    )
}

/// The TTFT and end-to-end latency CDFs of every policy, side by side.
pub fn write_plot(path: &Path, report: &LabReport) -> Result<(), switchyard_bench::PlotError> {
    let series = report
        .policies
        .iter()
        .map(PolicyReport::latencies)
        .collect();
    switchyard_bench::write_latency_cdfs(path, series)
}
