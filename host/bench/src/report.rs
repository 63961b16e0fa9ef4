//! The summary table (stdout) and the `--json` document.
//!
//! JSON names follow vLLM's `benchmark_serving.py` (`completed`, `request_throughput`,
//! `mean_ttft_ms`, `median_ttft_ms`, `p99_ttft_ms`, …) so existing tooling reads our files;
//! we add `p50_`/`p90_` percentiles, `failed`, `prefix_hit_rate`, the per-arm sections and the
//! router's usage. A trace replay also writes the policy lab's fields ([`ReplayMetrics`]) at
//! the top level (its `request_goodput` is then every completed request's rate without an
//! SLO) and a `trace` section: the options, what the caps changed, and both summaries.

use std::io::{self, Write};

use serde_json::{Map, Value, json};

use super::config::{BenchConfig, LoadShape, PromptFormat, TraceConfig};
use super::stats::{Distribution, ReplayMetrics, Summary};
use super::workload::Arm;
use super::{BenchReport, RouterUsage, TraceRun};

/// The metrics with a distribution, by their vLLM name and table title.
const METRICS: [(&str, &str, &str); 4] = [
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
];

/// Most distinct error messages listed in the table.
const ERRORS_SHOWN: usize = 5;

fn distribution(summary: &Summary, metric: &str) -> Distribution {
    match metric {
        "ttft" => summary.ttft_ms,
        "tpot" => summary.tpot_ms,
        "itl" => summary.itl_ms,
        _ => summary.e2el_ms,
    }
}

/// The metrics of one summary as flat vLLM-named keys.
pub fn summary_json(summary: &Summary) -> Map<String, Value> {
    let mut out = Map::new();
    out.insert("completed".into(), json!(summary.completed));
    out.insert("failed".into(), json!(summary.failed));
    out.insert("duration".into(), json!(summary.duration));
    out.insert(
        "total_input_tokens".into(),
        json!(summary.total_input_tokens),
    );
    out.insert(
        "total_output_tokens".into(),
        json!(summary.total_output_tokens),
    );
    out.insert(
        "request_throughput".into(),
        json!(summary.request_throughput),
    );
    out.insert("output_throughput".into(), json!(summary.output_throughput));
    out.insert(
        "total_token_throughput".into(),
        json!(summary.total_token_throughput),
    );
    out.insert("request_goodput".into(), json!(summary.request_goodput));
    out.insert("prefix_hit_rate".into(), json!(summary.prefix_hit_rate));
    for (name, _, _) in METRICS {
        let d = distribution(summary, name);
        out.insert(format!("mean_{name}_ms"), json!(d.mean));
        out.insert(format!("median_{name}_ms"), json!(d.median));
        out.insert(format!("std_{name}_ms"), json!(d.std));
        out.insert(format!("p50_{name}_ms"), json!(d.p50));
        out.insert(format!("p90_{name}_ms"), json!(d.p90));
        out.insert(format!("p99_{name}_ms"), json!(d.p99));
    }
    let errors: Map<String, Value> = summary
        .errors
        .iter()
        .map(|(message, count)| (message.clone(), json!(count)))
        .collect();
    out.insert("error_counts".into(), Value::Object(errors));
    out
}

/// The whole `--json` document.
pub fn to_json(config: &BenchConfig, report: &BenchReport) -> Value {
    let mut out = run_settings(config);
    out.extend(summary_json(&report.overall));
    if let (Some(options), Some(run)) = (&config.trace, &report.trace) {
        out.extend(replay_metrics_json(&run.metrics));
        out.insert("trace".into(), trace_json(options, run));
    }
    out.extend(per_request_arrays(report));
    if !report.arms.is_empty() {
        let arms: Map<String, Value> = report
            .arms
            .iter()
            .map(|(arm, s)| (arm.name().to_owned(), Value::Object(summary_json(s))))
            .collect();
        out.insert("arms".into(), Value::Object(arms));
        out.insert("comparison".into(), comparison_json(report));
    }
    out.insert(
        "router".into(),
        report.router.as_ref().map_or(Value::Null, router_json),
    );
    Value::Object(out)
}

/// The policy lab's per-policy fields, flat.
pub fn replay_metrics_json(metrics: &ReplayMetrics) -> Map<String, Value> {
    match serde_json::to_value(metrics) {
        Ok(Value::Object(fields)) => fields,
        // A struct of numbers always serialises to an object.
        _ => Map::new(),
    }
}

fn trace_json(options: &TraceConfig, run: &TraceRun) -> Value {
    let replay = &options.replay;
    let seconds = |ms: Option<u64>| ms.map(|ms| ms as f64 / 1e3);
    json!({
        "file": options.path.display().to_string(),
        "speedup": replay.speedup,
        "window_s": [seconds(replay.window.start_ms), seconds(replay.window.end_ms)],
        "limit": replay.limit,
        "max_input_len": replay.max_input_len,
        "max_output_len": replay.max_output_len,
        "max_concurrency": options.max_concurrency,
        "capped_inputs": run.capped_inputs,
        "capped_outputs": run.capped_outputs,
        "summary": run.file,
        "replayed": run.replayed,
    })
}

fn run_settings(config: &BenchConfig) -> Map<String, Value> {
    let unix_time = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let mut out = Map::new();
    out.insert("backend".into(), json!("switchyard"));
    out.insert("url".into(), json!(config.url));
    out.insert("model_id".into(), json!(config.model));
    out.insert("unix_time".into(), json!(unix_time));
    out.insert(
        "duration_limit".into(),
        json!(config.duration.as_secs_f64()),
    );
    if config.trace.is_none() {
        out.extend(load_settings(config));
    }
    out.insert(
        "prompt_format".into(),
        json!(match config.prompt_format {
            PromptFormat::Text => "text",
            PromptFormat::Tokens => "tokens",
        }),
    );
    out.insert("stream".into(), json!(config.stream));
    out.insert("slo_ttft_ms".into(), json!(config.slo.map(|s| s.ttft_ms)));
    out.insert("slo_tpot_ms".into(), json!(config.slo.map(|s| s.tpot_ms)));
    out
}

/// The generated load's settings (a trace replay has its own, under `trace`).
fn load_settings(config: &BenchConfig) -> Map<String, Value> {
    let (rate, arrivals, concurrency, max_concurrency) = match config.load {
        // vLLM writes "inf" for a run without a rate.
        LoadShape::Closed { concurrency } => (
            json!("inf"),
            Value::Null,
            json!(concurrency),
            json!(concurrency),
        ),
        LoadShape::Open {
            rate,
            arrivals,
            max_concurrency,
        } => (
            json!(rate),
            json!(arrivals.name()),
            Value::Null,
            json!(max_concurrency),
        ),
    };
    let w = &config.workload;
    let mut out = Map::new();
    out.insert("num_prompts".into(), json!(config.num_requests));
    out.insert("request_rate".into(), rate);
    out.insert("arrivals".into(), arrivals);
    out.insert("concurrency".into(), concurrency);
    out.insert("max_concurrency".into(), max_concurrency);
    out.insert("seed".into(), json!(w.seed));
    out.insert(
        "input_len".into(),
        json!([w.input_len.min, w.input_len.max]),
    );
    out.insert(
        "output_len".into(),
        json!([w.output_len.min, w.output_len.max]),
    );
    out.insert(
        "shared_prefix_groups".into(),
        json!(w.shared_prefix.map_or(0, |p| p.0)),
    );
    out.insert(
        "shared_prefix_len".into(),
        json!(w.shared_prefix.map_or(0, |p| p.1)),
    );
    out
}

/// Per-request values in request order, as vLLM lists them (failed requests: 0 and an error).
fn per_request_arrays(report: &BenchReport) -> Map<String, Value> {
    let mut input_lens = Vec::new();
    let mut output_lens = Vec::new();
    let mut ttfts = Vec::new();
    let mut e2els = Vec::new();
    let mut arms = Vec::new();
    let mut errors = Vec::new();
    for o in &report.outcomes {
        input_lens.push(json!(o.input_tokens));
        arms.push(json!(o.arm.name()));
        match &o.result {
            Ok(t) => {
                output_lens.push(json!(t.output_tokens));
                ttfts.push(json!(t.ttft.as_secs_f64()));
                e2els.push(json!(t.e2e.as_secs_f64()));
                errors.push(json!(""));
            }
            Err(e) => {
                output_lens.push(json!(0));
                ttfts.push(json!(0.0));
                e2els.push(json!(0.0));
                errors.push(json!(e));
            }
        }
    }
    let mut out = Map::new();
    out.insert("input_lens".into(), Value::Array(input_lens));
    out.insert("output_lens".into(), Value::Array(output_lens));
    out.insert("ttfts".into(), Value::Array(ttfts));
    out.insert("e2els".into(), Value::Array(e2els));
    out.insert("arms_taken".into(), Value::Array(arms));
    out.insert("errors".into(), Value::Array(errors));
    out
}

/// Routed minus direct, per percentile: what the router adds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Overhead {
    pub diff_us: f64,
    /// routed / direct; 0 when the direct value is 0.
    pub ratio: f64,
}

impl Overhead {
    pub fn of(routed_ms: f64, direct_ms: f64) -> Self {
        Self {
            diff_us: (routed_ms - direct_ms) * 1e3,
            ratio: if direct_ms > 0.0 {
                routed_ms / direct_ms
            } else {
                0.0
            },
        }
    }
}

fn comparison_json(report: &BenchReport) -> Value {
    let (Some(routed), Some(direct)) = (report.arm(Arm::Routed), report.arm(Arm::Direct)) else {
        return Value::Null;
    };
    let mut out = Map::new();
    out.insert(
        "direct_plan".into(),
        json!(report.direct_plan.map(|p| p.name())),
    );
    for (name, metric) in [("ttft", "ttft"), ("e2el", "e2el")] {
        let (r, d) = (distribution(routed, metric), distribution(direct, metric));
        let p50 = Overhead::of(r.p50, d.p50);
        let p99 = Overhead::of(r.p99, d.p99);
        out.insert(format!("p50_{name}_diff_us"), json!(p50.diff_us));
        out.insert(format!("p50_{name}_ratio"), json!(p50.ratio));
        out.insert(format!("p99_{name}_diff_us"), json!(p99.diff_us));
        out.insert(format!("p99_{name}_ratio"), json!(p99.ratio));
    }
    Value::Object(out)
}

fn router_json(usage: &RouterUsage) -> Value {
    json!({
        "pid": usage.pid,
        "cpu_seconds": usage.cpu.as_secs_f64(),
        "cpu_us_per_request": usage.cpu_per_request_us,
        "idle_cpu_rate": usage.idle_cpu_rate,
        "net_cpu_us_per_request": usage.net_cpu_per_request_us,
        "peak_rss_kib": usage.peak_rss_kib,
    })
}

/// The human-readable summary, laid out like vLLM's.
pub fn write_table(
    out: &mut impl Write,
    config: &BenchConfig,
    report: &BenchReport,
) -> io::Result<()> {
    let s = &report.overall;
    writeln!(out, "{:=^50}", " Serving Benchmark Result ")?;
    row(out, "Successful requests:", s.completed)?;
    row(out, "Failed requests:", s.failed)?;
    row(out, "Benchmark duration (s):", format!("{:.2}", s.duration))?;
    row(out, "Total input tokens:", s.total_input_tokens)?;
    row(out, "Total generated tokens:", s.total_output_tokens)?;
    row(
        out,
        "Request throughput (req/s):",
        format!("{:.2}", s.request_throughput),
    )?;
    row(
        out,
        "Output token throughput (tok/s):",
        format!("{:.2}", s.output_throughput),
    )?;
    row(
        out,
        "Total Token throughput (tok/s):",
        format!("{:.2}", s.total_token_throughput),
    )?;
    if let Some(goodput) = s.request_goodput {
        row(out, "Request goodput (req/s):", format!("{goodput:.2}"))?;
    }
    for (name, short, title) in METRICS {
        if name != "ttft" && name != "e2el" && !config.stream {
            continue;
        }
        writeln!(out, "{:-^50}", title)?;
        let d = distribution(s, name);
        row(
            out,
            &format!("Mean {short} (ms):"),
            format!("{:.2}", d.mean),
        )?;
        row(
            out,
            &format!("Median {short} (ms):"),
            format!("{:.2}", d.median),
        )?;
        row(out, &format!("P90 {short} (ms):"), format!("{:.2}", d.p90))?;
        row(out, &format!("P99 {short} (ms):"), format!("{:.2}", d.p99))?;
    }
    if !report.arms.is_empty() {
        write_comparison(out, report)?;
    }
    if let (Some(options), Some(run)) = (&config.trace, &report.trace) {
        write_trace(out, options, run)?;
    }
    if let Some(usage) = &report.router {
        writeln!(out, "{:-^50}", format!(" Router (pid {}) ", usage.pid))?;
        row(
            out,
            "CPU per routed request (us):",
            format!("{:.1}", usage.cpu_per_request_us),
        )?;
        row(
            out,
            "Net of idle CPU per request (us):",
            format!("{:.1}", usage.net_cpu_per_request_us),
        )?;
        row(
            out,
            "Idle CPU (% of a core):",
            format!("{:.2}", usage.idle_cpu_rate * 100.0),
        )?;
        row(
            out,
            "CPU time (s):",
            format!("{:.3}", usage.cpu.as_secs_f64()),
        )?;
        row(
            out,
            "Peak RSS (MiB):",
            format!("{:.1}", usage.peak_rss_kib as f64 / 1024.0),
        )?;
    }
    if !s.errors.is_empty() {
        writeln!(out, "{:-^50}", " Errors ")?;
        for (message, count) in s.errors.iter().take(ERRORS_SHOWN) {
            writeln!(out, "{count:>6} × {message}")?;
        }
    }
    writeln!(out, "{:=^50}", "")
}

fn write_comparison(out: &mut impl Write, report: &BenchReport) -> io::Result<()> {
    let (Some(routed), Some(direct)) = (report.arm(Arm::Routed), report.arm(Arm::Direct)) else {
        return Ok(());
    };
    let plan = report.direct_plan.map_or("?", |p| p.name());
    writeln!(out, "{:-^50}", format!(" Routed vs direct ({plan}) "))?;
    writeln!(
        out,
        "{:<12}{:>9}{:>9}{:>11}{:>8}",
        "", "routed", "direct", "diff (us)", "ratio"
    )?;
    writeln!(
        out,
        "{:<12}{:>9}{:>9}",
        "completed", routed.completed, direct.completed
    )?;
    writeln!(
        out,
        "{:<12}{:>9}{:>9}",
        "failed", routed.failed, direct.failed
    )?;
    for (label, r, d) in [
        ("p50 TTFT ms", routed.ttft_ms.p50, direct.ttft_ms.p50),
        ("p99 TTFT ms", routed.ttft_ms.p99, direct.ttft_ms.p99),
        ("p50 E2E ms", routed.e2el_ms.p50, direct.e2el_ms.p50),
        ("p99 E2E ms", routed.e2el_ms.p99, direct.e2el_ms.p99),
    ] {
        let o = Overhead::of(r, d);
        writeln!(
            out,
            "{label:<12}{r:>9.3}{d:>9.3}{:>11.1}{:>8.3}",
            o.diff_us, o.ratio
        )?;
    }
    Ok(())
}

fn write_trace(out: &mut impl Write, options: &TraceConfig, run: &TraceRun) -> io::Result<()> {
    writeln!(out, "{:-^50}", " Trace replay ")?;
    row(out, "Trace:", options.path.display())?;
    row(
        out,
        "Requests in trace / replayed:",
        format!("{} / {}", run.file.requests, run.metrics.replayed_requests),
    )?;
    row(
        out,
        "Replayed trace time (s):",
        format!("{:.1}", run.replayed.duration_s),
    )?;
    row(out, "Speed-up:", options.replay.speedup)?;
    row(
        out,
        "Prompts cut / outputs lowered:",
        format!("{} / {}", run.capped_inputs, run.capped_outputs),
    )?;
    row(
        out,
        "Prefix-sharing ceiling (replayed):",
        format!("{:.1}%", run.replayed.prefix_sharing_ceiling * 100.0),
    )?;
    row(
        out,
        "Prefix hit rate:",
        run.metrics.prefix_hit_rate.map_or_else(
            || "not reported by the server".to_owned(),
            |rate| format!("{:.1}%", rate * 100.0),
        ),
    )?;
    row(
        out,
        "Preemptions:",
        run.metrics
            .preemptions
            .map_or_else(|| "not counted by the server".to_owned(), |n| n.to_string()),
    )
}

fn row(out: &mut impl Write, label: &str, value: impl std::fmt::Display) -> io::Result<()> {
    writeln!(out, "{label:<40}{value:<10}")
}
