//! The `switchyard bench` command line, validated once into a [`BenchConfig`].

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, ValueEnum};

use super::BenchError;
use super::schedule::{Arrivals, parse_arrivals};
use super::trace::{ReplayOptions, Window, parse_window};

/// Upper bounds that keep every run finite and its memory small.
const MAX_REQUESTS: u64 = 1_000_000;
const MAX_DURATION_S: f64 = 7.0 * 24.0 * 3600.0;
const MAX_CONCURRENCY: u32 = 100_000;
const MAX_TOKENS_PER_PROMPT: u32 = 1 << 20;
const MAX_IDLE_SAMPLE_S: f64 = 600.0;
const MAX_SPEEDUP: f64 = 1e6;

/// Load generator for an OpenAI-compatible `/v1/completions` server (the switchyard router,
/// an engine, or anything else that speaks the API).
///
/// A run ends after `--num-requests` requests or `--duration` seconds, whichever comes first;
/// requests already sent then finish (each bounded by `--request-timeout`).
///
/// With `--trace FILE` the load is a recorded trace instead (Mooncake JSONL): each request is
/// sent at its timestamp whatever the earlier ones do, its prompt made from its `hash_ids` (equal
/// ids, equal prefixes), still within `--duration`.
#[derive(Debug, Clone, Args)]
pub struct BenchArgs {
    /// Base URL of the server under test, e.g. http://127.0.0.1:8000 (requests go to
    /// URL/v1/completions).
    #[arg(long)]
    pub url: String,

    /// Model name sent in every request (omitted when not given).
    #[arg(long)]
    pub model: Option<String>,

    /// Stop after sending this many requests.
    #[arg(long, default_value_t = 200)]
    pub num_requests: u64,

    /// Stop sending new requests after this many seconds.
    #[arg(long, default_value_t = 600.0)]
    pub duration: f64,

    /// Closed loop: keep exactly N requests in flight, sending the next when one finishes.
    /// This is the default (with N = 1) unless --rate is given.
    #[arg(long, conflicts_with = "rate")]
    pub concurrency: Option<u32>,

    /// Closed loop only: each of the N clients sends on an HTTP/1.1 connection of its own (as
    /// wrk does), so the server holds exactly N; without it requests share a pool, where a
    /// client may find its last stream's connection not yet returned and open another. Needs an
    /// http:// URL.
    #[arg(long, conflicts_with_all = ["rate", "trace", "compare_direct"])]
    pub connection_per_client: bool,

    /// Open loop: send requests at R per second on average, with Poisson arrivals drawn from
    /// --seed. Latencies count from each request's scheduled send time, so a slow server
    /// cannot hide its queueing (no coordinated omission).
    #[arg(long)]
    pub rate: Option<f64>,

    /// Open loop (--rate or --trace) only: cap on requests in flight; requests over the cap
    /// wait, and their wait counts in their latency.
    #[arg(long)]
    pub max_concurrency: Option<u32>,

    /// Open loop only: how the gaps between arrivals are drawn: poisson, or gamma:CV for gaps
    /// whose coefficient of variation is CV (above 1 burstier than Poisson, below 1 smoother).
    #[arg(long, value_name = "poisson|gamma:CV", value_parser = parse_arrivals,
          default_value = "poisson", requires = "rate")]
    pub arrivals: Arrivals,

    /// Replay this trace (Mooncake JSONL: `timestamp` ms, `input_length`, `output_length`,
    /// `hash_ids` of 512-token blocks) instead of generated requests. Latencies count from each
    /// request's due time. Prompts go as token ids unless --prompt-format says otherwise.
    #[arg(long, value_name = "FILE", conflicts_with_all = [
        "num_requests", "concurrency", "rate", "seed", "input_len", "input_len_range",
        "output_len", "output_len_range", "shared_prefix_groups", "shared_prefix_len",
        "compare_direct",
    ])]
    pub trace: Option<PathBuf>,

    /// Trace replay: arrivals X times faster than recorded (2: twice the load).
    #[arg(long, value_name = "X", default_value_t = 1.0, requires = "trace")]
    pub speedup: f64,

    /// Trace replay: only the requests whose timestamp is in START..END, in seconds of trace
    /// time (either side may be left out: 600.. or ..900). The first one is sent at once.
    #[arg(long, value_name = "START..END", value_parser = parse_window, requires = "trace")]
    pub window: Option<Window>,

    /// Trace replay: only the first N requests (after --window).
    #[arg(long, value_name = "N", requires = "trace")]
    pub limit: Option<u64>,

    /// Trace replay: cut longer prompts to this many tokens, keeping their leading blocks (so
    /// shared prefixes stay shared). The report counts the prompts cut.
    #[arg(long, value_name = "TOKENS", requires = "trace")]
    pub max_input_len: Option<u32>,

    /// Trace replay: ask for at most this many tokens per request. The report counts the
    /// requests lowered.
    #[arg(long, value_name = "TOKENS", requires = "trace")]
    pub max_output_len: Option<u32>,

    /// Seed for prompts, arrivals and the arm each request takes: equal seeds give equal runs.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,

    /// Prompt length in tokens (printable ASCII; one byte is one token for the reference
    /// engine's byte-level tokenizer).
    #[arg(long, default_value_t = 128, conflicts_with = "input_len_range")]
    pub input_len: u32,

    /// Prompt length drawn uniformly from A..=B tokens per request, e.g. 100:300.
    #[arg(long, value_name = "A:B", value_parser = parse_len_range)]
    pub input_len_range: Option<LenRange>,

    /// Tokens to generate per request (sent as max_tokens).
    #[arg(long, default_value_t = 32, conflicts_with = "output_len_range")]
    pub output_len: u32,

    /// max_tokens drawn uniformly from A..=B per request, e.g. 16:64.
    #[arg(long, value_name = "A:B", value_parser = parse_len_range)]
    pub output_len_range: Option<LenRange>,

    /// Number of prompt groups whose members share a common prefix (0: no sharing).
    /// Request i belongs to group i mod G.
    #[arg(long, default_value_t = 0, requires = "shared_prefix_len")]
    pub shared_prefix_groups: u32,

    /// Length in tokens of each group's shared prefix; prompts must be longer than this.
    #[arg(long, default_value_t = 0, requires = "shared_prefix_groups")]
    pub shared_prefix_len: u32,

    /// Send prompts as text or as lists of token ids (byte values) [default: text; tokens with
    /// --trace, so a server with any tokenizer gets exactly the trace's lengths and prefixes].
    #[arg(long, value_enum)]
    pub prompt_format: Option<PromptFormat>,

    /// Stream responses (SSE); needed to measure TTFT and ITL. The default.
    #[arg(long, overrides_with = "no_stream")]
    pub stream: bool,

    /// Ask for whole responses instead: TTFT is then the end-to-end latency.
    #[arg(long, overrides_with = "stream")]
    pub no_stream: bool,

    /// Service-level objective "TTFT_MS,TPOT_MS" for goodput: a request is good when it
    /// meets both, e.g. 500,50.
    #[arg(long, value_name = "TTFT_MS,TPOT_MS", value_parser = parse_slo)]
    pub slo: Option<Slo>,

    /// Give up on a request (and count it failed) after this many seconds.
    #[arg(long, default_value_t = 120.0)]
    pub request_timeout: f64,

    /// Write the results as JSON (vLLM benchmark_serving names) to FILE.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,

    /// Draw TTFT and E2E latency CDFs per arm to FILE (SVG).
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<PathBuf>,

    /// Add a direct arm: half the requests (chosen at random from --seed, interleaved with the
    /// routed ones) skip the router, the load generator doing the router's work itself
    /// against the same engines. Reports the router's overhead as the difference.
    #[arg(long)]
    pub compare_direct: bool,

    /// Engine base URL for the direct arm (repeat for each engine, in endpoint order).
    /// Default: the list from URL/admin/endpoints. Given here, engine i has device rank i.
    #[arg(long = "endpoint", value_name = "URL", requires = "compare_direct")]
    pub endpoints: Vec<String>,

    /// What the direct arm does: disagg = prep_recv on D, remote_send on P (skipped when D's
    /// prefix cache covers the window), start_generate on D, with P = endpoint 0 and D = the
    /// other endpoint with the fewest direct requests in flight; forward = one /v1/completions
    /// on the endpoint with the fewest in flight; auto = disagg with two or more endpoints.
    #[arg(long, value_enum, default_value_t = PlanKind::Auto, requires = "compare_direct")]
    pub plan: PlanKind,

    /// Direct disagg arm: the share of the prompt D prefills itself, as MLC's
    /// pd_balance_factor (0: D receives all but the last token's KV; f: the KV window ends at
    /// int((1 - f) * prompt length)). Match the router's policy config.
    #[arg(long, default_value_t = 0.0, requires = "compare_direct")]
    pub pd_balance_factor: f64,

    /// Process id of the router: report its CPU time per routed request and its peak RSS
    /// (Linux /proc).
    #[arg(long, value_name = "PID")]
    pub router_pid: Option<u32>,

    /// Seconds to watch the idle router before the run: its background CPU rate (health
    /// probes, timers) over the run is then subtracted for a net CPU per request. 0: skip.
    #[arg(long, default_value_t = 2.0, requires = "router_pid")]
    pub router_idle_sample: f64,
}

/// How prompts travel on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PromptFormat {
    /// A JSON string.
    Text,
    /// A JSON array of token ids (the prompt's bytes).
    Tokens,
}

/// The direct arm's plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PlanKind {
    /// Disagg with two or more endpoints, forward with one.
    Auto,
    /// prep_recv → remote_send → start_generate.
    Disagg,
    /// One /v1/completions.
    Forward,
}

/// An inclusive token-count range `A:B`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LenRange {
    pub min: u32,
    pub max: u32,
}

impl LenRange {
    /// A range of exactly one value.
    pub fn fixed(len: u32) -> Self {
        Self { min: len, max: len }
    }
}

/// Goodput thresholds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Slo {
    pub ttft_ms: f64,
    pub tpot_ms: f64,
}

impl Slo {
    /// Whether a completed request with this TTFT and TPOT is good. A single-token request has
    /// no TPOT and is judged on TTFT alone (vLLM does the same).
    pub fn met_by(self, ttft_ms: f64, tpot_ms: Option<f64>) -> bool {
        ttft_ms <= self.ttft_ms && tpot_ms.is_none_or(|t| t <= self.tpot_ms)
    }
}

/// How requests are released.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LoadShape {
    /// `concurrency` workers, each sending its next request when the last one finishes.
    Closed { concurrency: u32 },
    /// Arrivals at `rate` per second on average, optionally capped in flight.
    Open {
        rate: f64,
        arrivals: Arrivals,
        max_concurrency: Option<u32>,
    },
}

/// A trace replay, which replaces the generated load and workload.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceConfig {
    pub path: PathBuf,
    pub replay: ReplayOptions,
    /// Cap on requests in flight, as `--max-concurrency` in an open loop.
    pub max_concurrency: Option<u32>,
}

/// What prompts look like.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkloadConfig {
    pub seed: u64,
    pub input_len: LenRange,
    pub output_len: LenRange,
    /// `(groups, prefix_len)` when prompts share prefixes.
    pub shared_prefix: Option<(u32, u32)>,
    /// Whether requests are split between the routed and the direct arm.
    pub compare_direct: bool,
}

/// A validated `bench` invocation.
#[derive(Debug, Clone)]
pub struct BenchConfig {
    /// Base URL without a trailing slash.
    pub url: String,
    pub model: Option<String>,
    pub num_requests: u64,
    pub duration: Duration,
    pub load: LoadShape,
    /// Each closed-loop client on a connection of its own (`--connection-per-client`).
    pub connection_per_client: bool,
    pub workload: WorkloadConfig,
    pub prompt_format: PromptFormat,
    pub stream: bool,
    pub slo: Option<Slo>,
    pub request_timeout: Duration,
    pub json: Option<PathBuf>,
    pub plot: Option<PathBuf>,
    pub endpoints: Vec<String>,
    pub plan: PlanKind,
    pub pd_balance_factor: f64,
    pub router_pid: Option<u32>,
    pub router_idle_sample: Duration,
    /// When set, the run replays this trace and `num_requests`, `load` and `workload` are unused.
    pub trace: Option<TraceConfig>,
}

impl BenchArgs {
    /// Checks every bound once, so the run itself never meets a bad value.
    pub fn validate(self) -> Result<BenchConfig, BenchError> {
        let url = validate_url(&self.url)?;
        check(
            !self.connection_per_client
                || url
                    .get(..7)
                    .is_some_and(|s| s.eq_ignore_ascii_case("http://")),
            "--connection-per-client needs an http:// URL".into(),
        )?;
        let endpoints = self
            .endpoints
            .iter()
            .map(|u| validate_url(u))
            .collect::<Result<Vec<_>, _>>()?;
        check(
            (1..=MAX_REQUESTS).contains(&self.num_requests),
            format!("--num-requests must be in 1..={MAX_REQUESTS}"),
        )?;
        check(
            self.duration.is_finite() && self.duration > 0.0 && self.duration <= MAX_DURATION_S,
            format!("--duration must be a positive number of seconds up to {MAX_DURATION_S}"),
        )?;
        check(
            self.request_timeout.is_finite() && self.request_timeout > 0.0,
            "--request-timeout must be a positive number of seconds".into(),
        )?;
        let trace = match &self.trace {
            Some(path) => Some(self.validate_trace(path.clone())?),
            None => None,
        };
        let load = match trace {
            // The trace's own load; the default shape stands in, unused.
            Some(_) => LoadShape::Closed { concurrency: 1 },
            None => validate_load(
                self.concurrency,
                self.rate,
                self.arrivals,
                self.max_concurrency,
            )?,
        };
        let input_len = self
            .input_len_range
            .unwrap_or(LenRange::fixed(self.input_len));
        let output_len = self
            .output_len_range
            .unwrap_or(LenRange::fixed(self.output_len));
        validate_len("input length", input_len)?;
        validate_len("output length", output_len)?;
        let shared_prefix =
            validate_shared_prefix(self.shared_prefix_groups, self.shared_prefix_len, input_len)?;
        check(
            (0.0..1.0).contains(&self.pd_balance_factor),
            "--pd-balance-factor must be in [0, 1)".into(),
        )?;
        check(
            self.router_idle_sample.is_finite()
                && (0.0..=MAX_IDLE_SAMPLE_S).contains(&self.router_idle_sample),
            format!("--router-idle-sample must be in 0..={MAX_IDLE_SAMPLE_S} seconds"),
        )?;
        if let Some(slo) = self.slo {
            check(
                slo.ttft_ms > 0.0 && slo.tpot_ms > 0.0,
                "--slo thresholds must be positive".into(),
            )?;
        }
        Ok(BenchConfig {
            url,
            model: self.model,
            num_requests: self.num_requests,
            duration: Duration::from_secs_f64(self.duration),
            load,
            connection_per_client: self.connection_per_client,
            workload: WorkloadConfig {
                seed: self.seed,
                input_len,
                output_len,
                shared_prefix,
                compare_direct: self.compare_direct,
            },
            prompt_format: self.prompt_format.unwrap_or(match trace {
                Some(_) => PromptFormat::Tokens,
                None => PromptFormat::Text,
            }),
            stream: !self.no_stream,
            slo: self.slo,
            request_timeout: Duration::from_secs_f64(self.request_timeout),
            json: self.json,
            plot: self.plot,
            endpoints,
            plan: self.plan,
            pd_balance_factor: self.pd_balance_factor,
            router_pid: self.router_pid,
            router_idle_sample: Duration::from_secs_f64(self.router_idle_sample),
            trace,
        })
    }

    fn validate_trace(&self, path: PathBuf) -> Result<TraceConfig, BenchError> {
        check(
            self.speedup.is_finite() && self.speedup > 0.0 && self.speedup <= MAX_SPEEDUP,
            format!("--speedup must be a positive factor up to {MAX_SPEEDUP}"),
        )?;
        if let Some(limit) = self.limit {
            check(
                (1..=MAX_REQUESTS).contains(&limit),
                format!("--limit must be in 1..={MAX_REQUESTS}"),
            )?;
        }
        for (flag, cap) in [
            ("--max-input-len", self.max_input_len),
            ("--max-output-len", self.max_output_len),
        ] {
            if let Some(cap) = cap {
                check(
                    (1..=MAX_TOKENS_PER_PROMPT).contains(&cap),
                    format!("{flag} must be in 1..={MAX_TOKENS_PER_PROMPT}"),
                )?;
            }
        }
        validate_max_concurrency(self.max_concurrency)?;
        Ok(TraceConfig {
            path,
            replay: ReplayOptions {
                window: self.window.unwrap_or_default(),
                limit: self.limit.map(|n| n as usize),
                speedup: self.speedup,
                max_input_len: self.max_input_len,
                max_output_len: self.max_output_len,
            },
            max_concurrency: self.max_concurrency,
        })
    }
}

fn check(ok: bool, message: String) -> Result<(), BenchError> {
    if ok {
        Ok(())
    } else {
        Err(BenchError::Config(message))
    }
}

/// Accepts http(s) base URLs and drops a trailing slash so paths can be appended.
fn validate_url(raw: &str) -> Result<String, BenchError> {
    let parsed = reqwest::Url::parse(raw)
        .map_err(|e| BenchError::Config(format!("invalid URL {raw:?}: {e}")))?;
    check(
        matches!(parsed.scheme(), "http" | "https") && parsed.host().is_some(),
        format!("URL {raw:?} must be http://HOST[:PORT]"),
    )?;
    Ok(raw.trim_end_matches('/').to_owned())
}

fn validate_load(
    concurrency: Option<u32>,
    rate: Option<f64>,
    arrivals: Arrivals,
    max_concurrency: Option<u32>,
) -> Result<LoadShape, BenchError> {
    match rate {
        Some(rate) => {
            check(
                rate.is_finite() && rate > 0.0,
                "--rate must be a positive number of requests per second".into(),
            )?;
            validate_max_concurrency(max_concurrency)?;
            Ok(LoadShape::Open {
                rate,
                arrivals,
                max_concurrency,
            })
        }
        None => {
            check(
                max_concurrency.is_none(),
                "--max-concurrency needs an open loop: --rate or --trace".into(),
            )?;
            let concurrency = concurrency.unwrap_or(1);
            check(
                (1..=MAX_CONCURRENCY).contains(&concurrency),
                format!("--concurrency must be in 1..={MAX_CONCURRENCY}"),
            )?;
            Ok(LoadShape::Closed { concurrency })
        }
    }
}

fn validate_max_concurrency(cap: Option<u32>) -> Result<(), BenchError> {
    check(
        cap.is_none_or(|cap| (1..=MAX_CONCURRENCY).contains(&cap)),
        format!("--max-concurrency must be in 1..={MAX_CONCURRENCY}"),
    )
}

fn validate_len(what: &str, range: LenRange) -> Result<(), BenchError> {
    check(
        range.min >= 1 && range.min <= range.max && range.max <= MAX_TOKENS_PER_PROMPT,
        format!("{what} must satisfy 1 <= A <= B <= {MAX_TOKENS_PER_PROMPT}"),
    )
}

fn validate_shared_prefix(
    groups: u32,
    len: u32,
    input_len: LenRange,
) -> Result<Option<(u32, u32)>, BenchError> {
    if groups == 0 && len == 0 {
        return Ok(None);
    }
    check(
        groups >= 1 && len >= 1,
        "--shared-prefix-groups and --shared-prefix-len must both be positive".into(),
    )?;
    // Each prompt needs at least one token of its own after the prefix, or every member of a
    // group would be the same prompt.
    check(
        input_len.min > len,
        format!(
            "prompts ({} tokens at least) must be longer than the shared prefix ({len})",
            input_len.min
        ),
    )?;
    Ok(Some((groups, len)))
}

pub(crate) fn parse_len_range(raw: &str) -> Result<LenRange, String> {
    let (a, b) = raw
        .split_once(':')
        .ok_or_else(|| format!("expected A:B, got {raw:?}"))?;
    let parse = |s: &str| {
        s.trim()
            .parse::<u32>()
            .map_err(|e| format!("bad number {s:?} in {raw:?}: {e}"))
    };
    Ok(LenRange {
        min: parse(a)?,
        max: parse(b)?,
    })
}

/// `--slo TTFT_MS,TPOT_MS` as `bench` and the policy lab read it (positivity is checked with the
/// other flags).
pub fn parse_slo(raw: &str) -> Result<Slo, String> {
    let (a, b) = raw
        .split_once(',')
        .ok_or_else(|| format!("expected TTFT_MS,TPOT_MS, got {raw:?}"))?;
    let parse = |s: &str| {
        s.trim()
            .parse::<f64>()
            .map_err(|e| format!("bad number {s:?} in {raw:?}: {e}"))
    };
    Ok(Slo {
        ttft_ms: parse(a)?,
        tpot_ms: parse(b)?,
    })
}
