//! A validated `switchyard lab` run: which requests of which trace, the policies that plan
//! them, and the simulated cluster they run on.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use switchyard_bench::Slo;
use switchyard_bench::trace::ReplayOptions;
use switchyard_contract::{Protocol, Role};
use switchyard_engine::latency::{Latency, Profile, TimingModel, TimingTable};
use switchyard_engine::scheduler::CoreConfig;
use switchyard_engine::{EngineArgs, ModelShape};

/// Everything one run needs, checked.
#[derive(Debug, Clone)]
pub struct LabConfig {
    pub trace: PathBuf,
    pub replay: ReplayOptions,
    /// In the order given: the first is the baseline the others are compared with.
    pub policies: Vec<PolicySpec>,
    /// Plans the attempts of a policy that faults; `None`: those requests fail.
    pub fallback: Option<PolicySpec>,
    pub cluster: ClusterSpec,
    /// Seeds every random draw of a simulation (the arrivals unless 0, the policies' WASI
    /// randomness, retry jitter).
    pub seed: u64,
    pub slo: Option<Slo>,
    /// Also replay at each of these offered loads.
    pub sweep: Option<LoadSweep>,
    /// Each run is repeated with the seeds `seed..seed + seeds`, its figures averaged.
    pub seeds: u32,
    /// Where `cluster.step_table` was read from.
    pub timing_table: Option<PathBuf>,
    pub json: Option<PathBuf>,
    pub out: Option<PathBuf>,
}

impl LabConfig {
    /// The same run with `seed` and arrivals `load` times as fast as the replay's.
    pub fn variant(&self, seed: u64, load: f64) -> LabConfig {
        let mut config = self.clone();
        config.seed = seed;
        config.replay.speedup *= load;
        config
    }

    /// The seeds every run is repeated with.
    pub fn seed_list(&self) -> impl Iterator<Item = u64> + use<> {
        let first = self.seed;
        (0..u64::from(self.seeds)).map(move |k| first.wrapping_add(k))
    }
}

/// `--load-sweep A..B:STEPS`: `steps` offered loads evenly spaced from `from` to `to`, each a
/// multiple of the replay's arrival rate (the trace's, times `--speedup`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LoadSweep {
    pub from: f64,
    pub to: f64,
    pub steps: u32,
}

impl LoadSweep {
    /// The loads, lowest first.
    pub fn loads(&self) -> Vec<f64> {
        let last = f64::from(self.steps - 1);
        (0..self.steps)
            .map(|i| self.from + (self.to - self.from) * f64::from(i) / last)
            .collect()
    }
}

/// One policy under test.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicySpec {
    /// As given on the command line: the key of its results.
    pub name: String,
    pub path: PathBuf,
    /// The JSON given to its `init`; `None` for `{}`.
    pub config: Option<String>,
}

/// The simulated cluster: its engines, how they compute and move KV, and the router's rules
/// around them.
#[derive(Debug, Clone)]
pub struct ClusterSpec {
    /// One per engine, in endpoint order (ids and device ranks `0..n`).
    pub roles: Vec<Role>,
    pub protocol: Protocol,
    /// Costs every step, unless `step_table` does, and sets the link KV moves over.
    pub latency: Latency,
    /// Steps costed from measurements (`--timing-table`) instead of the profile's formula.
    pub step_table: Option<Arc<TimingTable>>,
    pub transfer: TransferModel,
    pub page_size: usize,
    pub kv_pages: u32,
    pub prefix_cache: bool,
    pub prefill_chunk: usize,
    pub max_batch: usize,
    pub reservation_ttl: Duration,
    /// How often the router reads each engine's load (`running`, `waiting`, `kv-usage`):
    /// between probes a policy sees the last reading, as in production.
    pub probe_interval: Duration,
    /// How long after an engine publishes a step's KV events (at the step's end) the router's
    /// index has them: the wire and the router's subscriber.
    pub kv_events_delay: Duration,
    pub retry: RetryRules,
    /// From arrival to the end of the response, over every attempt.
    pub request_timeout: Duration,
}

impl ClusterSpec {
    pub fn engines(&self) -> usize {
        self.roles.len()
    }

    /// The scheduler core each engine runs.
    pub fn core_config(&self) -> CoreConfig {
        let timing: Arc<dyn TimingModel> = match &self.step_table {
            Some(table) => table.clone(),
            None => Arc::new(self.latency),
        };
        CoreConfig {
            page_size: self.page_size,
            num_pages: self.kv_pages,
            prefix_cache: self.prefix_cache,
            prefill_chunk: self.prefill_chunk,
            max_batch: self.max_batch,
            reservation_ttl: self.reservation_ttl,
            // The lab's transfers land only in open windows (a gated transport).
            expiry_quarantine: Duration::ZERO,
            preempt_every: None,
            timing,
        }
    }
}

/// The router's retry rules (its defaults: `switchyard serve --max-attempts` and the backoff
/// it is built with).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RetryRules {
    /// Attempts that deliver nothing before a request fails.
    pub max_attempts: u32,
    pub min_delay: Duration,
    pub max_delay: Duration,
}

impl RetryRules {
    /// The delay before retry number `n` (from 0): exponential from `min_delay`, doubled each
    /// time up to `max_delay`, plus a jitter of up to as much again drawn from `unit`
    /// (`0..1`), capped at `max_delay`.
    pub fn delay(&self, n: u32, unit: f64) -> Duration {
        let base = self
            .min_delay
            .saturating_mul(1u32 << n.min(20))
            .min(self.max_delay);
        base.mul_f64(1.0 + unit.clamp(0.0, 1.0)).min(self.max_delay)
    }
}

/// The router's defaults, which the lab mirrors: three attempts without progress, a backoff
/// from 10 ms to 1 s, a 600 s request timeout and a 2 s load probe (`switchyard serve`'s
/// `--max-attempts`, `--request-timeout` and its health probe). The router is no dependency of
/// the lab (nor the lab of it), so they are restated here.
pub const ROUTER_RETRY: RetryRules = RetryRules {
    max_attempts: 3,
    min_delay: Duration::from_millis(10),
    max_delay: Duration::from_secs(1),
};
pub const ROUTER_REQUEST_TIMEOUT: Duration = Duration::from_secs(600);
pub const ROUTER_PROBE_INTERVAL: Duration = Duration::from_secs(2);

/// How long moving KV between two engines takes: a fixed cost per transfer plus its bytes over
/// a bandwidth, stretched by the time scale as the engines' steps are.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TransferModel {
    pub base_us: f64,
    /// Bytes per microsecond (1 GB/s = 1,000 bytes/µs); `None`: transfers cost only their base.
    pub bytes_per_us: Option<f64>,
    pub bytes_per_token: usize,
    pub time_scale: f64,
}

impl TransferModel {
    /// The profile's own link (its per-byte cost), or `bandwidth_gb_s` when given.
    pub fn new(latency: Latency, shape: ModelShape, bandwidth_gb_s: Option<f64>) -> TransferModel {
        let profile = latency.profile;
        let bytes_per_us = match bandwidth_gb_s {
            Some(gb_s) => Some(gb_s * 1e3),
            None => {
                (profile.transfer_us_per_byte > 0.0).then(|| 1.0 / profile.transfer_us_per_byte)
            }
        };
        TransferModel {
            base_us: profile.transfer_us_base,
            bytes_per_us,
            bytes_per_token: shape.kv_shape().bytes_per_token(),
            time_scale: latency.time_scale,
        }
    }

    pub fn bytes(&self, tokens: usize) -> u64 {
        (tokens as u64).saturating_mul(self.bytes_per_token as u64)
    }

    /// Moving `tokens` positions' KV; nothing when there are none.
    pub fn time(&self, tokens: usize) -> Duration {
        if tokens == 0 {
            return Duration::ZERO;
        }
        let wire = self
            .bytes_per_us
            .map_or(0.0, |rate| self.bytes(tokens) as f64 / rate);
        let us = (self.base_us + wire) * self.time_scale;
        if us.is_finite() && us > 0.0 {
            Duration::from_secs_f64(us / 1e6)
        } else {
            Duration::ZERO
        }
    }
}

/// What the lab assumes of the hardware a latency profile stands for, beside its step costs:
/// the model's KV shape (bytes per token, which sets transfer sizes) and how many KV pages
/// fit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hardware {
    pub shape: ModelShape,
    pub kv_pages: u32,
}

impl Hardware {
    /// `llama3-8b-h100`: Llama-3-8B's KV (128 KiB per token), and 25,600 pages of 16 positions
    /// (409,600 tokens, 50 GiB: an H100's 80 GB at vLLM's 90% memory use, less 16 GB of bf16
    /// weights and a few of activations). Any other profile: the reference engine's defaults
    /// (`switchyard engine`: the small shape, 2048 pages).
    pub fn of(profile: &Profile, engine: &EngineArgs) -> Hardware {
        if profile.name == Profile::LLAMA3_8B_H100.name {
            return Hardware {
                shape: ModelShape::Llama3_8b,
                kv_pages: 25_600,
            };
        }
        Hardware {
            shape: engine.model_shape,
            kv_pages: engine.kv_pages,
        }
    }
}

/// `switchyard engine`'s defaults: a simulated engine is one started without flags.
pub fn engine_defaults() -> EngineArgs {
    EngineArgs::from_flags(["--port", "0"]).expect("the engine's defaults parse")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sweep_spaces_its_loads_evenly_from_the_lowest() {
        let sweep = LoadSweep {
            from: 0.5,
            to: 2.0,
            steps: 4,
        };
        assert_eq!(sweep.loads(), [0.5, 1.0, 1.5, 2.0]);
    }

    #[test]
    fn retry_delays_grow_to_their_cap() {
        let r = ROUTER_RETRY;
        assert_eq!(r.delay(0, 0.0), Duration::from_millis(10));
        assert_eq!(r.delay(3, 0.0), Duration::from_millis(80));
        assert_eq!(r.delay(3, 0.5), Duration::from_millis(120));
        assert_eq!(r.delay(40, 0.9), Duration::from_secs(1));
    }

    #[test]
    fn a_transfer_costs_its_base_plus_its_bytes_over_the_link() {
        let latency = Latency {
            profile: Profile::LLAMA3_8B_H100,
            time_scale: 1.0,
        };
        let link = TransferModel::new(latency, ModelShape::Llama3_8b, None);
        assert_eq!(link.time(0), Duration::ZERO);
        // 1000 tokens of 128 KiB over 150 GB/s: 873.8 µs, plus 10 µs.
        let t = link.time(1000).as_secs_f64() * 1e6;
        assert!((t - 883.8).abs() < 0.5, "{t}");
        let slow = TransferModel::new(latency, ModelShape::Llama3_8b, Some(15.0));
        let t = slow.time(1000).as_secs_f64() * 1e6;
        assert!((t - 8748.1).abs() < 0.5, "{t}");
        let null = Latency {
            profile: Profile::NULL,
            time_scale: 1.0,
        };
        assert_eq!(
            TransferModel::new(null, ModelShape::Small, None).time(1000),
            Duration::ZERO
        );
    }
}
