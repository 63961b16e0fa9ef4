//! The `switchyard lab` command line, validated once into a [`LabConfig`].

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use clap::{Args, ValueEnum};
use switchyard_bench::Slo;
use switchyard_bench::trace::{ReplayOptions, Window, parse_window};
use switchyard_contract::{Protocol, Role};
use switchyard_engine::ModelShape;
use switchyard_engine::latency::{Latency, Profile, TimingTable};

use crate::LabError;
use crate::config::{
    ClusterSpec, Hardware, LabConfig, LoadSweep, PolicySpec, ROUTER_PROBE_INTERVAL,
    ROUTER_REQUEST_TIMEOUT, ROUTER_RETRY, TransferModel, engine_defaults,
};

/// Bounds that keep a run finite.
const MAX_ENGINES: u32 = 4096;
const MAX_REQUESTS: u64 = 1_000_000;
const MAX_SPEEDUP: f64 = 1e6;
const MAX_TOKENS_PER_PROMPT: u32 = 1 << 20;
const MAX_SWEEP_STEPS: u32 = 64;
const MAX_SEEDS: u32 = 1000;
/// The router's request timeout: an index later than that is no index.
const MAX_KV_EVENTS_DELAY_MS: u64 = ROUTER_REQUEST_TIMEOUT.as_secs() * 1000;

/// Replay a request trace on a simulated cluster, once per policy, and compare the policies.
///
/// The engines are the reference engine's scheduler core (continuous batching, paged KV with a
/// prefix cache, preemption under KV pressure, the MLC, vLLM and SGLang handoffs) on a virtual
/// clock, costed by a latency profile; the policies are the real components, loaded as the
/// router loads them. Every policy sees the same arrivals. Results: a table on stdout, --json,
/// and under --out the TTFT and end-to-end latency CDFs (SVG).
#[derive(Debug, Clone, Args)]
pub struct LabArgs {
    /// The trace to replay (Mooncake JSONL: `timestamp` ms, `input_length`, `output_length`,
    /// `hash_ids` of 512-token blocks; see `switchyard trace`).
    #[arg(long, value_name = "FILE")]
    pub trace: PathBuf,

    /// The trace's format.
    #[arg(long, value_enum, default_value = "mooncake")]
    pub trace_format: TraceFormat,

    /// A policy to replay the trace with: a name resolved in --plugins (`round-robin` is
    /// `PLUGINS/round-robin.wasm`) or the path of a `.wasm` component. Repeat to compare
    /// policies on the same arrivals; the first is the baseline.
    #[arg(long = "policy", value_name = "NAME_OR_WASM", required = true)]
    pub policies: Vec<String>,

    /// The JSON config given to a policy's `init`, NAME being the --policy as given (or its
    /// file stem), e.g. `disagg={"pd_balance_factor":0.1}` (repeatable; default: PLUGINS/NAME.json
    /// for a named policy when it exists, else `{}`).
    #[arg(long = "policy-config", value_name = "NAME=JSON", value_parser = parse_policy_config)]
    pub policy_configs: Vec<(String, String)>,

    /// Where named policies are found.
    #[arg(long, value_name = "DIR", default_value = "plugins")]
    pub plugins: PathBuf,

    /// Plans the attempts of a policy that faults (trap, deadline, memory cap, invalid plan), as
    /// the router's fallback does; `none`: those requests fail.
    #[arg(long, value_name = "NAME_OR_WASM", default_value = "round-robin")]
    pub fallback_policy: String,

    /// Role-less engines (endpoint ids 0..N).
    #[arg(long, value_name = "N", conflicts_with_all = ["prefill", "decode"])]
    pub engines: Option<u32>,

    /// Engines with the prefill role (endpoint ids 0..P); needs --decode.
    #[arg(long, value_name = "P", requires = "decode")]
    pub prefill: Option<u32>,

    /// Engines with the decode role (endpoint ids P..P+D); needs --prefill.
    #[arg(long, value_name = "D", requires = "prefill")]
    pub decode: Option<u32>,

    /// The protocol the engines speak, which sets how a handoff moves KV: `mlc` (prep_recv,
    /// remote_send, start_generate), `vllm` (P prefills and holds its KV, D pulls it) or
    /// `sglang` (both legs at once, P pushes into D's reserved slots).
    #[arg(long, value_enum, default_value = "mlc")]
    pub protocol: LabProtocol,

    /// The latency profile that costs every engine step and transfer (the engine's
    /// `--profile`).
    #[arg(long, default_value = "llama3-8b-h100",
          value_parser = clap::builder::PossibleValuesParser::new(Profile::ALL.map(|p| p.name)))]
    pub profile: String,

    /// Cost every engine step from this table of measured step times instead of --profile's
    /// formula (CSV `kind,tokens,batch,context,ms`: prefill lengths, decode batches ×
    /// contexts); --profile still sets the KV link, shape and pages.
    #[arg(long, value_name = "CSV")]
    pub timing_table: Option<PathBuf>,

    /// Multiplies every modelled time, as the engine's --time-scale does.
    #[arg(long, value_name = "X", default_value_t = 1.0)]
    pub time_scale: f64,

    /// The model's KV shape, which sets how many bytes a transfer moves [default: llama3-8b
    /// with the llama3-8b-h100 profile, else the engine's default].
    #[arg(long, value_enum)]
    pub model_shape: Option<ModelShape>,

    /// Bandwidth of the link KV moves over between engines, in GB/s [default: the profile's:
    /// 150 for llama3-8b-h100 (NVLink with one-sided puts), none for null].
    #[arg(long, value_name = "GB_PER_S")]
    pub kv_bandwidth: Option<f64>,

    /// The engines' prefix cache.
    #[arg(long, value_enum, default_value = "on")]
    pub prefix_cache: OnOff,

    /// KV pages per engine, of 16 positions [default: 25600 with the llama3-8b-h100 profile
    /// (an H100's KV memory for Llama-3-8B), else the engine's default 2048].
    #[arg(long, value_name = "N")]
    pub kv_pages: Option<u32>,

    /// How often the router reads each engine's load, in milliseconds: between readings a
    /// policy sees the last one.
    #[arg(long, value_name = "MS", default_value_t = ROUTER_PROBE_INTERVAL.as_millis() as u64)]
    pub probe_interval_ms: u64,

    /// How long after an engine publishes a step's KV events (at the step's end) the router's
    /// index has them, in milliseconds: policies see `cached-prefix` that much later.
    #[arg(long, value_name = "MS", default_value_t = 0)]
    pub kv_events_delay_ms: u64,

    /// Arrivals X times faster than recorded (2: twice the load).
    #[arg(long, value_name = "X", default_value_t = 1.0)]
    pub speedup: f64,

    /// Only the requests whose timestamp is in START..END, in seconds of trace time (either
    /// side may be left out: 600.. or ..900).
    #[arg(long, value_name = "START..END", value_parser = parse_window)]
    pub window: Option<Window>,

    /// Only the first N requests (after --window).
    #[arg(long, value_name = "N")]
    pub limit: Option<u64>,

    /// Cut longer prompts to this many tokens, keeping their leading blocks.
    #[arg(long, value_name = "TOKENS")]
    pub max_input_len: Option<u32>,

    /// Ask for at most this many tokens per request.
    #[arg(long, value_name = "TOKENS")]
    pub max_output_len: Option<u32>,

    /// Seeds every random draw of the simulation: when requests arrive (0: the trace's own
    /// timestamps; any other seed re-draws each gap between arrivals around the recorded one,
    /// keeping the order, the contents and the mean rate), the policies' WASI randomness and
    /// the retry jitter. The same seed gives the same results, byte for byte.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,

    /// Service-level objective "TTFT_MS,TPOT_MS" for goodput: a request is good when it
    /// meets both, e.g. 2000,100.
    #[arg(long, value_name = "TTFT_MS,TPOT_MS", value_parser = switchyard_bench::parse_slo)]
    pub slo: Option<Slo>,

    /// Also replay at each of STEPS offered loads evenly spaced from A to B, each a multiple of
    /// the replayed arrival rate (the trace's, times --speedup), e.g. 0.25..2:8; needs --slo.
    /// Per load and policy: SLO attainment, goodput and the latencies (the JSON's `sweep`,
    /// `attainment_vs_load.svg` under --out).
    #[arg(long, value_name = "A..B:STEPS", value_parser = parse_load_sweep, requires = "slo")]
    pub load_sweep: Option<LoadSweep>,

    /// Repeat every run with K seeds (--seed, --seed + 1, ...), each its own draw of the
    /// arrivals, every policy on the same ones: each figure is their mean, with its 95%
    /// confidence interval beside it (`F_ci95`, Student's t over the seeds).
    #[arg(long, value_name = "K", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..=MAX_SEEDS as i64))]
    pub seeds: u32,

    /// Write the results as JSON (one object per policy under `policies`, vLLM benchmark
    /// names) to FILE.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,

    /// Write the TTFT, TPOT and end-to-end latency CDFs per policy (`latency_cdf.svg`), each
    /// policy's engines' queue depth and KV usage over time (`engines_N_POLICY.svg`), the
    /// sweep's SLO attainment against load (`attainment_vs_load.svg`) and the table
    /// (`summary.txt`) into DIR.
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum TraceFormat {
    /// Mooncake's JSONL (FAST '25).
    Mooncake,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LabProtocol {
    Mlc,
    Vllm,
    Sglang,
}

impl From<LabProtocol> for Protocol {
    fn from(p: LabProtocol) -> Protocol {
        match p {
            LabProtocol::Mlc => Protocol::Mlc,
            LabProtocol::Vllm => Protocol::Vllm,
            LabProtocol::Sglang => Protocol::Sglang,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OnOff {
    On,
    Off,
}

/// `A..B:STEPS`: at least two loads, positive and rising.
fn parse_load_sweep(raw: &str) -> Result<LoadSweep, String> {
    let usage = || format!("expected A..B:STEPS (e.g. 0.25..2:8), got {raw:?}");
    let (range, steps) = raw.split_once(':').ok_or_else(usage)?;
    let (from, to) = range.split_once("..").ok_or_else(usage)?;
    let load = |s: &str| s.trim().parse::<f64>().map_err(|_| usage());
    let (from, to) = (load(from)?, load(to)?);
    let steps: u32 = steps.trim().parse().map_err(|_| usage())?;
    if !(from.is_finite() && to.is_finite() && from > 0.0 && from < to) {
        return Err(format!("the loads of {raw:?} must be positive, A below B"));
    }
    if !(2..=MAX_SWEEP_STEPS).contains(&steps) {
        return Err(format!(
            "STEPS must be in 2..={MAX_SWEEP_STEPS}, got {steps}"
        ));
    }
    Ok(LoadSweep { from, to, steps })
}

/// `NAME=JSON`: the JSON is checked when the policy loads (naming it), not here.
fn parse_policy_config(raw: &str) -> Result<(String, String), String> {
    let (name, json) = raw
        .split_once('=')
        .ok_or_else(|| format!("expected NAME=JSON, got {raw:?}"))?;
    if name.is_empty() {
        return Err(format!("no policy name before '=' in {raw:?}"));
    }
    Ok((name.to_owned(), json.to_owned()))
}

fn check(ok: bool, message: impl FnOnce() -> String) -> Result<(), LabError> {
    if ok {
        Ok(())
    } else {
        Err(LabError::Config(message()))
    }
}

impl LabArgs {
    /// Checks every value once, so the run itself never meets a bad one.
    pub fn validate(self) -> Result<LabConfig, LabError> {
        let replay = self.replay_options()?;
        let cluster = self.cluster()?;
        let policies = self.policy_specs()?;
        let fallback = match self.fallback_policy.as_str() {
            "none" => None,
            name => Some(self.resolve(name, None)?),
        };
        if let Some(slo) = self.slo {
            check(slo.ttft_ms > 0.0 && slo.tpot_ms > 0.0, || {
                "--slo thresholds must be positive".into()
            })?;
        }
        Ok(LabConfig {
            trace: self.trace,
            replay,
            policies,
            fallback,
            cluster,
            seed: self.seed,
            slo: self.slo,
            sweep: self.load_sweep,
            seeds: self.seeds,
            timing_table: self.timing_table,
            json: self.json,
            out: self.out,
        })
    }

    fn replay_options(&self) -> Result<ReplayOptions, LabError> {
        check(
            self.speedup.is_finite() && self.speedup > 0.0 && self.speedup <= MAX_SPEEDUP,
            || format!("--speedup must be a positive factor up to {MAX_SPEEDUP}"),
        )?;
        if let Some(sweep) = self.load_sweep {
            check(self.speedup * sweep.to <= MAX_SPEEDUP, || {
                format!("--speedup times the sweep's highest load must be at most {MAX_SPEEDUP}")
            })?;
        }
        if let Some(limit) = self.limit {
            check((1..=MAX_REQUESTS).contains(&limit), || {
                format!("--limit must be in 1..={MAX_REQUESTS}")
            })?;
        }
        for (flag, cap) in [
            ("--max-input-len", self.max_input_len),
            ("--max-output-len", self.max_output_len),
        ] {
            check(
                cap.is_none_or(|c| (1..=MAX_TOKENS_PER_PROMPT).contains(&c)),
                || format!("{flag} must be in 1..={MAX_TOKENS_PER_PROMPT}"),
            )?;
        }
        Ok(ReplayOptions {
            window: self.window.unwrap_or_default(),
            limit: self.limit.map(|n| n as usize),
            speedup: self.speedup,
            max_input_len: self.max_input_len,
            max_output_len: self.max_output_len,
        })
    }

    fn cluster(&self) -> Result<ClusterSpec, LabError> {
        let roles = self.roles()?;
        check(
            self.time_scale.is_finite() && self.time_scale >= 0.0,
            || "--time-scale must be a finite number >= 0".into(),
        )?;
        check(
            self.kv_bandwidth.is_none_or(|b| b.is_finite() && b > 0.0),
            || "--kv-bandwidth must be a positive number of GB/s".into(),
        )?;
        check(self.probe_interval_ms > 0, || {
            "--probe-interval-ms must be positive".into()
        })?;
        check(self.kv_events_delay_ms <= MAX_KV_EVENTS_DELAY_MS, || {
            format!("--kv-events-delay-ms must be at most {MAX_KV_EVENTS_DELAY_MS}")
        })?;
        let profile = Profile::by_name(&self.profile)
            .ok_or_else(|| LabError::Config(format!("unknown --profile {:?}", self.profile)))?;
        let engine = engine_defaults();
        let hardware = Hardware::of(&profile, &engine);
        let shape = self.model_shape.unwrap_or(hardware.shape);
        let kv_pages = self.kv_pages.unwrap_or(hardware.kv_pages);
        check(kv_pages > 0, || "--kv-pages must be positive".into())?;
        let latency = Latency {
            profile,
            time_scale: self.time_scale,
        };
        let step_table = match &self.timing_table {
            Some(path) => Some(Arc::new(TimingTable::read(path, self.time_scale, latency)?)),
            None => None,
        };
        Ok(ClusterSpec {
            roles,
            protocol: self.protocol.into(),
            latency,
            step_table,
            transfer: TransferModel::new(latency, shape, self.kv_bandwidth),
            page_size: engine.page_size as usize,
            kv_pages,
            prefix_cache: self.prefix_cache == OnOff::On,
            prefill_chunk: engine.prefill_chunk,
            max_batch: engine.max_batch,
            reservation_ttl: Duration::from_millis(engine.reservation_ttl_ms),
            probe_interval: Duration::from_millis(self.probe_interval_ms),
            kv_events_delay: Duration::from_millis(self.kv_events_delay_ms),
            retry: ROUTER_RETRY,
            request_timeout: ROUTER_REQUEST_TIMEOUT,
        })
    }

    /// `--engines N` role-less, or `--prefill P --decode D` with roles, as `switchyard up`
    /// gives them (prefill engines first).
    fn roles(&self) -> Result<Vec<Role>, LabError> {
        let roles = match (self.engines, self.prefill, self.decode) {
            (Some(n), _, _) => vec![Role::Any; n as usize],
            (None, Some(p), Some(d)) => {
                let mut roles = vec![Role::Prefill; p as usize];
                roles.resize((p + d) as usize, Role::Decode);
                roles
            }
            _ => {
                return Err(LabError::Config(
                    "give the cluster: --engines N, or --prefill P and --decode D".into(),
                ));
            }
        };
        check((1..=MAX_ENGINES as usize).contains(&roles.len()), || {
            format!("the cluster must have 1..={MAX_ENGINES} engines")
        })?;
        Ok(roles)
    }

    fn policy_specs(&self) -> Result<Vec<PolicySpec>, LabError> {
        let mut specs: Vec<PolicySpec> = Vec::new();
        for name in &self.policies {
            check(!specs.iter().any(|s| &s.name == name), || {
                format!("--policy {name} is given twice")
            })?;
            let config = self
                .policy_configs
                .iter()
                .rev()
                .find(|(key, _)| key == name || Some(key.as_str()) == file_stem(name))
                .map(|(_, json)| json.clone());
            specs.push(self.resolve(name, config)?);
        }
        for (key, _) in &self.policy_configs {
            check(
                specs
                    .iter()
                    .any(|s| &s.name == key || Some(key.as_str()) == file_stem(&s.name)),
                || format!("--policy-config names {key:?}, which is no --policy"),
            )?;
        }
        Ok(specs)
    }

    /// A name in --plugins, or a path to a component; a named policy's config defaults to
    /// `PLUGINS/NAME.json`, as the router's registry reads it.
    fn resolve(&self, name: &str, config: Option<String>) -> Result<PolicySpec, LabError> {
        let is_path = name.ends_with(".wasm") || name.contains('/');
        let path = if is_path {
            PathBuf::from(name)
        } else {
            self.plugins.join(format!("{name}.wasm"))
        };
        check(path.is_file(), || {
            if is_path {
                format!("policy {name}: {} is not a file", path.display())
            } else {
                format!(
                    "policy {name}: no {} (`make plugins` builds the built-in policies; a \
                     component elsewhere is given by its path)",
                    path.display()
                )
            }
        })?;
        let config = match config {
            Some(json) => Some(json),
            None if !is_path => read_config(&self.plugins.join(format!("{name}.json")))?,
            None => None,
        };
        Ok(PolicySpec {
            name: name.to_owned(),
            path,
            config,
        })
    }
}

fn file_stem(name: &str) -> Option<&str> {
    Path::new(name).file_stem().and_then(|s| s.to_str())
}

fn read_config(path: &Path) -> Result<Option<String>, LabError> {
    match std::fs::read_to_string(path) {
        Ok(json) => Ok(Some(json)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(LabError::Config(format!(
            "cannot read {}: {e}",
            path.display()
        ))),
    }
}
