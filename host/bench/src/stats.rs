//! Exact statistics over sorted samples, and the per-arm summary built from request outcomes.
//!
//! Runs are bounded to a million requests, so keeping every sample and sorting is cheap and
//! gives exact percentiles (numpy's default linear interpolation, as vLLM reports them).

use std::time::Duration;

use super::config::Slo;
use super::workload::Arm;

/// What happened to one request.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestOutcome {
    pub index: u64,
    pub arm: Arm,
    pub input_tokens: u32,
    pub result: Result<Timing, String>,
}

/// Latencies of one successful request, all from its scheduled send time.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Timing {
    /// Time to the first chunk carrying a choice.
    pub ttft: Duration,
    /// Time to the end of the response.
    pub e2e: Duration,
    /// Gaps between consecutive choice chunks.
    pub itl: Vec<Duration>,
    pub output_tokens: u32,
    /// Prompt tokens served from the server's prefix cache, when it says
    /// (`usage.prompt_tokens_details.cached_tokens`; a simulator knows).
    pub cached_tokens: Option<u32>,
}

impl Timing {
    /// (e2e - ttft) / (tokens - 1); undefined for a single token.
    pub fn tpot(&self) -> Option<Duration> {
        let gaps = self.output_tokens.checked_sub(1).filter(|&g| g > 0)?;
        Some(self.e2e.saturating_sub(self.ttft) / gaps)
    }
}

/// Mean, spread and percentiles of one metric, in milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Distribution {
    pub count: usize,
    pub mean: f64,
    pub std: f64,
    pub median: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub min: f64,
    pub max: f64,
}

impl Distribution {
    /// Summarises samples; all zeros when there are none (as vLLM reports an empty metric).
    pub fn of(mut samples: Vec<f64>) -> Self {
        samples.retain(|v| v.is_finite());
        if samples.is_empty() {
            return Self::default();
        }
        samples.sort_by(f64::total_cmp);
        let count = samples.len();
        let mean = samples.iter().sum::<f64>() / count as f64;
        let variance = samples.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / count as f64;
        let at = |p| percentile(&samples, p).unwrap_or(0.0);
        Self {
            count,
            mean,
            std: variance.sqrt(),
            median: at(50.0),
            p50: at(50.0),
            p90: at(90.0),
            p99: at(99.0),
            min: samples[0],
            max: samples[count - 1],
        }
    }
}

/// The `p`-th percentile (0..=100) of ascending `sorted`, interpolating linearly between the
/// two nearest ranks (numpy's default). `None` for no samples or `p` out of range.
pub fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() || !(0.0..=100.0).contains(&p) {
        return None;
    }
    let rank = p / 100.0 * (sorted.len() - 1) as f64;
    let lower = rank.floor() as usize;
    let upper = rank.ceil() as usize;
    let weight = rank - lower as f64;
    Some(sorted[lower] + (sorted[upper] - sorted[lower]) * weight)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Everything reported for one set of requests (an arm, or the whole run).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Summary {
    pub completed: usize,
    pub failed: usize,
    pub total_input_tokens: u64,
    pub total_output_tokens: u64,
    /// Wall time of the run in seconds (shared by all arms).
    pub duration: f64,
    pub request_throughput: f64,
    pub output_throughput: f64,
    pub total_token_throughput: f64,
    /// Good requests per second; `None` without an SLO.
    pub request_goodput: Option<f64>,
    /// Cached prompt tokens over prompt tokens (0..1), over the completed requests whose
    /// cached tokens are known; `None` when no request's are.
    pub prefix_hit_rate: Option<f64>,
    pub ttft_ms: Distribution,
    pub tpot_ms: Distribution,
    pub itl_ms: Distribution,
    pub e2el_ms: Distribution,
    /// Each distinct error message and how often it happened, most frequent first.
    pub errors: Vec<(String, usize)>,
}

impl Summary {
    /// Summarises `outcomes` of a run that took `duration`.
    pub fn of<'a>(
        outcomes: impl IntoIterator<Item = &'a RequestOutcome>,
        duration: Duration,
        slo: Option<Slo>,
    ) -> Self {
        let mut ttft = Vec::new();
        let mut tpot = Vec::new();
        let mut itl = Vec::new();
        let mut e2el = Vec::new();
        let mut errors = std::collections::BTreeMap::<String, usize>::new();
        let mut s = Summary::default();
        let mut good = 0usize;
        // (cached, prompt) tokens of the requests that report their cached tokens.
        let mut cache: Option<(u64, u64)> = None;
        for outcome in outcomes {
            match &outcome.result {
                Ok(t) => {
                    s.completed += 1;
                    s.total_input_tokens += u64::from(outcome.input_tokens);
                    s.total_output_tokens += u64::from(t.output_tokens);
                    ttft.push(ms(t.ttft));
                    e2el.push(ms(t.e2e));
                    itl.extend(t.itl.iter().copied().map(ms));
                    let t_tpot = t.tpot().map(ms);
                    tpot.extend(t_tpot);
                    if slo.is_some_and(|slo| slo.met_by(ms(t.ttft), t_tpot)) {
                        good += 1;
                    }
                    if let Some(cached) = t.cached_tokens {
                        let (hit, of) = cache.get_or_insert((0, 0));
                        *hit += u64::from(cached);
                        *of += u64::from(outcome.input_tokens);
                    }
                }
                Err(e) => {
                    s.failed += 1;
                    *errors.entry(e.clone()).or_default() += 1;
                }
            }
        }
        let secs = duration.as_secs_f64();
        let per_sec = |n: f64| if secs > 0.0 { n / secs } else { 0.0 };
        s.duration = secs;
        s.request_throughput = per_sec(s.completed as f64);
        s.output_throughput = per_sec(s.total_output_tokens as f64);
        s.total_token_throughput = per_sec((s.total_input_tokens + s.total_output_tokens) as f64);
        s.request_goodput = slo.map(|_| per_sec(good as f64));
        s.prefix_hit_rate =
            cache.map(|(hit, of)| if of > 0 { hit as f64 / of as f64 } else { 0.0 });
        s.ttft_ms = Distribution::of(ttft);
        s.tpot_ms = Distribution::of(tpot);
        s.itl_ms = Distribution::of(itl);
        s.e2el_ms = Distribution::of(e2el);
        s.errors = errors.into_iter().collect();
        s.errors
            .sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        s
    }
}

/// The figures the policy lab reports for each policy it replays a trace with, filled from a
/// real run's [`Summary`] (`switchyard bench --trace`) or a simulated one alike, so the two can
/// be compared field for field.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ReplayMetrics {
    pub completed: usize,
    pub failed: usize,
    /// Requests per second meeting the SLO; every completed one without an SLO.
    pub request_goodput: f64,
    pub mean_ttft_ms: f64,
    pub p50_ttft_ms: f64,
    pub p99_ttft_ms: f64,
    pub p50_tpot_ms: f64,
    pub p99_tpot_ms: f64,
    pub mean_e2el_ms: f64,
    pub p50_e2el_ms: f64,
    pub p99_e2el_ms: f64,
    /// Token-weighted prefix-cache hit rate (0..1); `None` when nothing reported cached tokens.
    pub prefix_hit_rate: Option<f64>,
    /// Generations preempted during the run; `None` when the server does not count them.
    pub preemptions: Option<u64>,
    /// Requests the replay selected (after its window and limit), sent or not.
    pub replayed_requests: usize,
}

impl ReplayMetrics {
    pub fn of(summary: &Summary, replayed_requests: usize, preemptions: Option<u64>) -> Self {
        Self {
            completed: summary.completed,
            failed: summary.failed,
            request_goodput: summary
                .request_goodput
                .unwrap_or(summary.request_throughput),
            mean_ttft_ms: summary.ttft_ms.mean,
            p50_ttft_ms: summary.ttft_ms.p50,
            p99_ttft_ms: summary.ttft_ms.p99,
            p50_tpot_ms: summary.tpot_ms.p50,
            p99_tpot_ms: summary.tpot_ms.p99,
            mean_e2el_ms: summary.e2el_ms.mean,
            p50_e2el_ms: summary.e2el_ms.p50,
            p99_e2el_ms: summary.e2el_ms.p99,
            prefix_hit_rate: summary.prefix_hit_rate,
            preemptions,
            replayed_requests,
        }
    }
}
