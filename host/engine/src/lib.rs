//! The reference engine behind `switchyard engine`: it speaks MLC-LLM's microserving API, or
//! (`--protocol vllm|sglang`) vLLM's NIXL pull or SGLang's bootstrap-room P/D protocol, with
//! real KV moving between engine processes in every case.
//!
//! Real MLC engines need GPUs and NVSHMEM; this one needs neither but behaves like an engine: a
//! paged KV pool with finite pages ([`kv_pool`]), continuous batching with a prefix cache,
//! prep_recv reservations that expire, and MLC's preemption under KV pressure, in a scheduler
//! core that is a pure state machine ([`scheduler`]: the engine's step loop drives it in real
//! time, a simulator can drive it in virtual time), a latency model that says when each step's
//! tokens come out ([`latency`]), and a deterministic model that writes real KV bytes and reads
//! them back to choose each token ([`model`]), or, with `--model`, a real LLM (a llama-family
//! GGUF such as SmolLM2-135M) on CPU whose batch-invariant forward pass reads and writes its K/V
//! in the same pool ([`llama`]). KV moves between engines through [`switchyard_kv`], so a
//! disaggregated run yields exactly the tokens of a single-engine run only if every transferred
//! slot is right.
//!
//! `--protocol vllm|sglang` swaps the microserving calls (404 then) for the OpenAI routes
//! (`/v1/completions`, `/v1/chat/completions`, chat rendered with the model's template as the
//! router renders it) and that engine's P/D handoff, so a router's vLLM and SGLang backends are
//! tested end to end with real KV movement:
//! - vLLM (`http/vllm.rs`): a prefill leg answers `kv_transfer_params` and holds its KV under a
//!   lease (`--kv-lease-ms`); the decode leg pulls it over P's side channel
//!   (`--side-channel-port`), and cancelling it tells P to release the lease.
//! - SGLang (`http/sglang.rs`): `--disaggregation-mode prefill|decode`; both legs meet at the
//!   prefill engine's bootstrap server (`--bootstrap-port`, in the ready line), keyed by
//!   `bootstrap_room`, and P pushes the KV into D's reserved slots.
//!
//! Both check the router's side of the contract (counted as protocol violations on
//! `/metrics`, beside vLLM's or SGLang's own load gauges) and notice a leg whose connection
//! the router closed: hyper drops its handler, and guards give back what it held.
//!
//! This crate depends on the wire types (`switchyard-wire`) and the KV data path
//! (`switchyard-kv`) only: never on the router or the policy host, which are its clients.
//!
//! ```no_run
//! # async fn demo() -> Result<(), switchyard_engine::EngineError> {
//! let args = switchyard_engine::EngineArgs::from_flags(["--port", "0", "--prefix-cache"])
//!     .expect("valid flags");
//! let engine = switchyard_engine::start(&args).await?;
//! println!("{}", engine.ready_line());
//! # Ok(()) }
//! ```
#![deny(unsafe_code)]

mod http;
pub mod kv_pool;
pub mod latency;
pub mod llama;
pub mod metrics;
pub mod model;
mod response;
pub mod scheduler;
mod step_loop;

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use latency::{Latency, Profile};
use llama::Llama;
use metrics::Metrics;
use scheduler::{Backend, Core, CoreConfig, LlamaModel, ModelSpec};
use step_loop::StepLoop;
use switchyard_kv::{
    KvDevice, KvError, KvShape, KvStore, KvTransport, PeerAddr, TransportConfig, TransportKind,
    parse_rank_addr,
};
use switchyard_wire::ReadyLine;
use switchyard_wire::gguf::GgufMetadata;
use switchyard_wire::tokenizer::PromptTokenizer;

/// The KV shape the model writes, by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ModelShape {
    /// 2 layers × 2 KV heads × 16 dims × fp16: 256 B per token.
    Small,
    /// Llama-3-8B: 32 layers × 8 KV heads × 128 dims × fp16: 128 KiB per token.
    #[value(name = "llama3-8b")]
    Llama3_8b,
}

impl ModelShape {
    pub fn kv_shape(self) -> KvShape {
        match self {
            ModelShape::Small => KvShape::SMALL,
            ModelShape::Llama3_8b => KvShape::LLAMA3_8B,
        }
    }
}

/// Which disaggregation protocol the engine speaks: the router must drive each one its own way,
/// and the engine checks that it does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Protocol {
    /// MLC-LLM microserving: `/microserving/prep_recv`, `remote_send`, `start_generate`.
    Mlc,
    /// vLLM with the NixlConnector (`kv_both`): a prefill leg answers `kv_transfer_params`
    /// and holds its KV under a lease; the decode leg pulls it over P's side channel.
    Vllm,
    /// SGLang: both legs get the same body at once and meet at the prefill engine's bootstrap
    /// server, keyed by `bootstrap_room`; P pushes the KV into D.
    Sglang,
}

/// SGLang's `--disaggregation-mode`: what role an SGLang-mode engine plays.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DisaggregationMode {
    /// A plain server: every request is served whole.
    Null,
    /// Runs a bootstrap server; serves only P legs.
    Prefill,
    /// Serves only D legs.
    Decode,
}

/// `switchyard engine` flags.
#[derive(Debug, Clone, clap::Args)]
pub struct EngineArgs {
    /// HTTP port (0 picks a free one; the ready line says which).
    #[arg(long)]
    pub port: u16,
    /// HTTP listen address.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: IpAddr,
    /// This engine's first GPU id in the shared KV-transfer world (MLC's recv_rank).
    #[arg(long, default_value_t = 0)]
    pub device_rank: u32,
    /// KV pool size in pages.
    #[arg(long, default_value_t = 2048, value_parser = clap::value_parser!(u32).range(1..))]
    pub kv_pages: u32,
    /// Token positions per KV page (the prefix cache shares whole pages).
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..))]
    pub page_size: u32,
    /// Reuse KV of earlier requests with the same token prefix (whole pages).
    #[arg(long)]
    pub prefix_cache: bool,
    /// The KV shape the model writes (bytes per token, which sets transfer sizes).
    #[arg(long, value_enum, default_value = "small")]
    pub model_shape: ModelShape,
    /// Latency profile: `null` (no delays) or `llama3-8b-h100`.
    #[arg(long, default_value = "null", value_parser = clap::builder::PossibleValuesParser::new(Profile::ALL.map(|p| p.name)))]
    pub profile: String,
    /// Multiplies every simulated delay (0 = as fast as possible).
    #[arg(long, default_value_t = 1.0, value_parser = parse_time_scale)]
    pub time_scale: f64,
    /// How KV moves between engines: `tcp` (any host), `shm` (same host), `cuda` (GPU pools).
    #[arg(long, value_enum, default_value = "tcp")]
    pub kv_transport: TransportKind,
    /// Where the KV pool lives: `cpu`, or `cuda:N` for GPU N (with `--kv-transport cuda`, in a
    /// build with `--features cuda`).
    #[arg(long, default_value = "cpu")]
    pub kv_device: KvDevice,
    /// Where to receive KV transfers (`tcp:IP:PORT`, `unix:/path`, `unix:@name`); default: an
    /// ephemeral one, printed in the ready line. Whoever reaches a tcp address can write this
    /// engine's reserved KV slots: keep it on loopback or a trusted network.
    #[arg(long)]
    pub kv_listen: Option<PeerAddr>,
    /// Another engine's KV address, `RANK=ADDR` (repeatable).
    #[arg(long = "kv-peer", value_parser = parse_rank_addr)]
    pub kv_peers: Vec<(u32, PeerAddr)>,
    /// Bound on one whole KV push to a peer (remote_send, a vLLM pull, an SGLang room's
    /// push), connecting included.
    #[arg(long, default_value_t = 60_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub kv_transfer_timeout_ms: u64,
    /// Fault injection: preempt every K-th decoding request half-way through its max_tokens.
    #[arg(long)]
    pub preempt_every: Option<u64>,
    /// Ignore `return_token_ids`, as MLC-LLM's engines do (they do not know the field): for
    /// testing how a router continues a stream whose engine never says which ids it generated.
    #[arg(long)]
    pub ignore_return_token_ids: bool,
    /// Fault injection: answer this share (0 to 1) of POST calls (completions, chat, the
    /// microserving calls, either leg of a vLLM or SGLang handoff) with HTTP 500 before doing
    /// anything, as an engine failing internally would. Readiness and metrics keep answering.
    #[arg(long, default_value_t = 0.0, value_parser = parse_fail_rate)]
    pub fail_rate: f64,
    /// What computes the tokens: `synthetic` (the deterministic stand-in, fast), `smollm2`
    /// (SmolLM2-135M-Instruct from the cache `make model` fills) or the path of a llama-family
    /// GGUF file (run on CPU; see `llama`).
    #[arg(long, default_value = "synthetic")]
    pub model: String,
    /// The model name `/v1/models` reports and responses carry by default (default:
    /// `switchyard-reference` for the synthetic model, else the GGUF's file stem).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Threads for the real model's matmuls (candle reads it from `CANDLE_NUM_THREADS`, which
    /// `switchyard engine` sets from this flag before anything starts; default: every core).
    /// Engines sharing a machine should split its cores, or their spinning workers fight.
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..))]
    pub threads: Option<u16>,
    /// A prep_recv reservation not followed by start_generate is freed after this long. Must
    /// exceed --kv-transfer-timeout-ms, and should exceed how long the router waits on
    /// remote_send (120 s by default), or a slow prefill outlives the reservation it pushes to.
    #[arg(long, default_value_t = 150_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub reservation_ttl_ms: u64,
    /// Prefill token budget per step (chunked prefill).
    #[arg(long, default_value_t = 2048, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub prefill_chunk: usize,
    /// Most requests in the running batch.
    #[arg(long, default_value_t = 256, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub max_batch: usize,
    /// The disaggregation protocol: `mlc` (microserving calls), `vllm` (P answers
    /// kv_transfer_params, D pulls the KV) or `sglang` (both legs at once, bootstrap rooms).
    /// In `vllm` and `sglang` modes the engine serves `/v1/completions` and
    /// `/v1/chat/completions` and the microserving routes answer 404.
    #[arg(long, value_enum, default_value = "mlc")]
    pub protocol: Protocol,
    /// vLLM: how long a prefill leg's KV stays held for a decode engine's pull before it is
    /// freed and counted expired (vLLM's `kv_lease_duration`).
    #[arg(long, default_value_t = 30_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub kv_lease_ms: u64,
    /// vLLM: the port of this engine's side channel, where decode engines pull leased KV
    /// (vLLM's `VLLM_NIXL_SIDE_CHANNEL_PORT`; 0 picks a free one). It listens on --host;
    /// only engines talk to it, and it is reported in every `kv_transfer_params`.
    #[arg(long, default_value_t = 0)]
    pub side_channel_port: u16,
    /// SGLang: `null` (a plain server), `prefill` (serves P legs, runs the bootstrap server) or
    /// `decode` (serves D legs). Needs `--protocol sglang` unless `null`.
    #[arg(long, value_enum, default_value = "null")]
    pub disaggregation_mode: DisaggregationMode,
    /// SGLang prefill: the bootstrap server's port, which routers put in `bootstrap_port`
    /// (0 picks a free one; the ready line says which). Required with
    /// `--disaggregation-mode prefill`, refused otherwise.
    #[arg(long)]
    pub bootstrap_port: Option<u16>,
    /// SGLang: how long a leg waits for its counterpart (P for D's registration, D for P's
    /// KV) before it is an orphan, answered with a timeout error
    /// (`SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT`).
    #[arg(long, default_value_t = 300_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub bootstrap_timeout_ms: u64,
}

impl EngineArgs {
    /// Parses engine flags as the command line would (for starting engines in-process).
    pub fn from_flags<I, T>(flags: I) -> Result<EngineArgs, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        #[derive(clap::Parser)]
        struct Flags {
            #[command(flatten)]
            args: EngineArgs,
        }
        let argv = std::iter::once(std::ffi::OsString::from("engine"))
            .chain(flags.into_iter().map(Into::into));
        <Flags as clap::Parser>::try_parse_from(argv).map(|f| f.args)
    }
}

fn parse_fail_rate(s: &str) -> Result<f64, String> {
    s.parse::<f64>()
        .ok()
        .filter(|r| (0.0..=1.0).contains(r))
        .ok_or_else(|| format!("{s:?} is not a number from 0 to 1"))
}

fn parse_time_scale(s: &str) -> Result<f64, String> {
    s.parse::<f64>()
        .ok()
        .filter(|t| t.is_finite() && *t >= 0.0)
        .ok_or_else(|| format!("{s:?} is not a finite number >= 0"))
}

/// Why the engine could not start or keep running.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("invalid engine option --{flag}: {reason}")]
    BadArg { flag: &'static str, reason: String },
    #[error(transparent)]
    Kv(#[from] KvError),
    #[error("cannot listen for HTTP on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("cannot load the model {model}: {reason}")]
    Model { model: String, reason: String },
    #[error("cannot start the engine's {what}: {source}")]
    Start {
        what: &'static str,
        source: std::io::Error,
    },
}

impl EngineError {
    /// Whether the command line is at fault (the process exits with a usage code).
    pub fn is_usage(&self) -> bool {
        matches!(self, EngineError::BadArg { .. })
    }
}

/// A started engine. Dropping it stops the HTTP server and every connection it accepted, which
/// releases the last handles on the step loop and the KV receiver, so both stop too.
pub struct RunningEngine {
    http_addr: SocketAddr,
    kv_addr: PeerAddr,
    device_rank: u32,
    /// vLLM mode: where decode engines pull this engine's leased KV.
    side_channel_addr: Option<SocketAddr>,
    /// SGLang prefill mode: the bootstrap server.
    bootstrap_addr: Option<SocketAddr>,
    server: tokio::task::JoinHandle<()>,
    /// The side channel's or bootstrap server's accept loop, stopped with the engine.
    aux_server: Option<tokio::task::JoinHandle<()>>,
}

impl RunningEngine {
    pub fn http_addr(&self) -> SocketAddr {
        self.http_addr
    }

    pub fn kv_addr(&self) -> &PeerAddr {
        &self.kv_addr
    }

    pub fn device_rank(&self) -> u32 {
        self.device_rank
    }

    /// vLLM mode: the side channel decode engines pull KV from.
    pub fn side_channel_addr(&self) -> Option<SocketAddr> {
        self.side_channel_addr
    }

    /// SGLang prefill mode: the bootstrap server (its port goes in every leg's
    /// `bootstrap_port`).
    pub fn bootstrap_addr(&self) -> Option<SocketAddr> {
        self.bootstrap_addr
    }

    /// The line `switchyard engine` prints once it accepts requests.
    pub fn ready_line(&self) -> ReadyLine {
        ReadyLine {
            http_addr: self.http_addr,
            device_rank: self.device_rank,
            kv_addr: self.kv_addr.to_string(),
            bootstrap_port: self.bootstrap_addr.map(|a| a.port()),
        }
    }
}

impl Drop for RunningEngine {
    fn drop(&mut self) {
        self.server.abort();
        if let Some(aux) = &self.aux_server {
            aux.abort();
        }
    }
}

/// Starts an engine inside the current tokio runtime.
pub async fn start(args: &EngineArgs) -> Result<RunningEngine, EngineError> {
    let latency = latency_from(args)?;
    let num_slots = pool_slots(args)?;
    check_reservation_ttl(args)?;
    check_protocol(args)?;
    let model = load_model(&args.model).await?;
    let store = KvStore::new_on(args.kv_device, model.kv_shape(args.model_shape), num_slots)?;
    let store = Arc::new(store.with_guarded_slots());
    let transport = start_transport(args, store.clone()).await?;
    let kv_addr = transport.listen_addr();

    let metrics = Metrics::default();
    let config = CoreConfig {
        page_size: args.page_size as usize,
        num_pages: args.kv_pages,
        prefix_cache: args.prefix_cache,
        prefill_chunk: args.prefill_chunk,
        max_batch: args.max_batch,
        reservation_ttl: Duration::from_millis(args.reservation_ttl_ms),
        expiry_quarantine: expiry_quarantine(args.kv_transport),
        preempt_every: args.preempt_every.filter(|&k| k > 0),
        timing: Arc::new(latency),
    };
    let core = Core::new(config, Backend::new(&model.spec, store));
    let step_loop = StepLoop::new(core, metrics.clone());
    let (commands, queue) = std::sync::mpsc::channel();
    let alive = Arc::new(AtomicBool::new(true));
    let alive_while = StepLoopAlive(alive.clone());
    std::thread::Builder::new()
        .name(format!("engine-step-{}", args.device_rank))
        .spawn(move || {
            let _alive = alive_while;
            step_loop.run(queue);
        })
        .map_err(|source| EngineError::Start {
            what: "step loop thread",
            source,
        })?;

    let addr = SocketAddr::new(args.host, args.port);
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| EngineError::Bind { addr, source })?;
    let http_addr = listener
        .local_addr()
        .map_err(|source| EngineError::Bind { addr, source })?;
    // The side channel or bootstrap server binds before the engine is ready: its address goes
    // into every answer (vLLM) or the ready line (SGLang).
    let aux_listener = match (args.protocol, args.disaggregation_mode) {
        (Protocol::Vllm, _) => Some(bind(args.host, args.side_channel_port).await?),
        (Protocol::Sglang, DisaggregationMode::Prefill) => {
            Some(bind(args.host, args.bootstrap_port.unwrap_or(0)).await?)
        }
        _ => None,
    };
    let aux_addr = aux_listener.as_ref().map(|(_, addr)| *addr);
    let pd = http::Pd::new(args, aux_addr, &metrics);
    let state = Arc::new(http::EngineState {
        protocol: args.protocol,
        pd,
        prompts: model.prompts,
        client: reqwest::Client::new(),
        commands,
        alive,
        vocab_size: model.tokenizer.get_vocab_size(true) as u32,
        max_model_len: match &model.spec {
            ModelSpec::Synthetic => None,
            ModelSpec::Llama(m) => Some(m.llama.config().context),
        },
        tokenizer: Arc::new(model.tokenizer),
        answers_token_ids: !args.ignore_return_token_ids,
        transport: Arc::new(transport),
        metrics,
        latency,
        model_name: args.served_model_name.clone().unwrap_or(model.default_name),
        num_pages: args.kv_pages,
        page_size: args.page_size as usize,
        fail_rate: args.fail_rate,
        kv_transfer_timeout: Duration::from_millis(args.kv_transfer_timeout_ms),
        device_rank: args.device_rank,
    });
    let aux_server = aux_listener.map(|(listener, _)| {
        let state = state.clone();
        tokio::spawn(http::serve(listener, move |req| {
            http::aux_route(req, state.clone())
        }))
    });
    let server = tokio::spawn(http::serve(listener, move |req| {
        http::route(req, state.clone())
    }));
    Ok(RunningEngine {
        http_addr,
        kv_addr,
        device_rank: args.device_rank,
        side_channel_addr: (args.protocol == Protocol::Vllm)
            .then_some(aux_addr)
            .flatten(),
        bootstrap_addr: (args.protocol == Protocol::Sglang)
            .then_some(aux_addr)
            .flatten(),
        server,
        aux_server,
    })
}

async fn bind(
    host: IpAddr,
    port: u16,
) -> Result<(tokio::net::TcpListener, SocketAddr), EngineError> {
    let addr = SocketAddr::new(host, port);
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| EngineError::Bind { addr, source })?;
    let bound = listener
        .local_addr()
        .map_err(|source| EngineError::Bind { addr, source })?;
    Ok((listener, bound))
}

/// The protocol flags fit together: a disaggregation mode and a bootstrap port are SGLang's,
/// and an SGLang prefill engine must have a bootstrap port (routers are configured with it).
fn check_protocol(args: &EngineArgs) -> Result<(), EngineError> {
    let sglang = args.protocol == Protocol::Sglang;
    let prefill = sglang && args.disaggregation_mode == DisaggregationMode::Prefill;
    if !sglang && args.disaggregation_mode != DisaggregationMode::Null {
        return Err(EngineError::BadArg {
            flag: "disaggregation-mode",
            reason: "needs --protocol sglang".into(),
        });
    }
    match (prefill, args.bootstrap_port) {
        (true, None) => Err(EngineError::BadArg {
            flag: "bootstrap-port",
            reason: "required with --disaggregation-mode prefill (0 picks a free port)".into(),
        }),
        (false, Some(_)) => Err(EngineError::BadArg {
            flag: "bootstrap-port",
            reason: "only an SGLang prefill engine (--protocol sglang --disaggregation-mode prefill) runs a bootstrap server".into(),
        }),
        _ => Ok(()),
    }
}

/// The model an engine runs, with its tokenizer and the name it reports by default.
struct LoadedModel {
    spec: ModelSpec,
    tokenizer: tokenizers::Tokenizer,
    /// The tokenizer with the model's chat template: how `/v1/chat/completions` renders
    /// `messages`, exactly as the router does.
    prompts: PromptTokenizer,
    default_name: String,
}

impl LoadedModel {
    /// The pool slot shape: the real model's, or the synthetic one's as `--model-shape` says.
    fn kv_shape(&self, synthetic: ModelShape) -> KvShape {
        match &self.spec {
            ModelSpec::Synthetic => synthetic.kv_shape(),
            ModelSpec::Llama(m) => m.llama.config().kv_shape(),
        }
    }
}

/// The GGUF `--model` names: `smollm2` is the cached SmolLM2, anything else but `synthetic`
/// a path.
pub fn model_path(model: &str) -> Option<PathBuf> {
    match model {
        "synthetic" => None,
        "smollm2" => Some(
            switchyard_wire::gguf::smollm2_path()
                .unwrap_or_else(|| PathBuf::from(switchyard_wire::gguf::SMOLLM2_FILE)),
        ),
        path => Some(PathBuf::from(path)),
    }
}

/// What to add to an error about `--model`: how to fetch it, where fetching is ours to do.
pub fn fetch_hint(model: &str) -> &'static str {
    if model == "smollm2" {
        " (run `make model` to fetch it)"
    } else {
        ""
    }
}

async fn load_model(model: &str) -> Result<LoadedModel, EngineError> {
    let Some(path) = model_path(model) else {
        return Ok(LoadedModel {
            spec: ModelSpec::Synthetic,
            tokenizer: switchyard_wire::tokenizer::byte_level_tokenizer(),
            prompts: PromptTokenizer::byte_level().map_err(|e| EngineError::Model {
                model: model.into(),
                reason: e.to_string(),
            })?,
            default_name: "switchyard-reference".into(),
        });
    };
    let fail = |reason: String| EngineError::Model {
        model: path.display().to_string(),
        reason: format!("{reason}{}", fetch_hint(model)),
    };
    let load_path = path.clone();
    // Loading requantizes every weight: seconds of CPU, off the async threads.
    let loaded = tokio::task::spawn_blocking(move || load_gguf(&load_path))
        .await
        .map_err(|e| fail(e.to_string()))?;
    let (model, tokenizer) = loaded.map_err(|e| fail(e.to_string()))?;
    let prompts = GgufMetadata::read(&path)
        .map_err(|e| e.to_string())
        .and_then(|meta| meta.model_files().map_err(|e| e.to_string()))
        .and_then(|files| PromptTokenizer::from_gguf(&files, &path).map_err(|e| e.to_string()))
        .map_err(fail)?;
    Ok(LoadedModel {
        spec: ModelSpec::Llama(Arc::new(model)),
        tokenizer,
        prompts,
        default_name: switchyard_wire::gguf::served_name(&path),
    })
}

/// The GGUF at `path` with its tokenizer.
fn load_gguf(
    path: &std::path::Path,
) -> Result<(LlamaModel, tokenizers::Tokenizer), llama::LlamaError> {
    let meta = GgufMetadata::read(path)?;
    let files = meta.model_files()?;
    let tokenizer = files.tokenizer()?;
    let llama = Llama::load(path, &meta)?;
    Ok((llama_model(llama, &meta, files.eos_id)?, tokenizer))
}

/// SmolLM2 from the cache `make model` fills, loaded once per test binary.
#[cfg(test)]
fn test_smollm2() -> &'static (Arc<LlamaModel>, tokenizers::Tokenizer) {
    static MODEL: std::sync::OnceLock<(Arc<LlamaModel>, tokenizers::Tokenizer)> =
        std::sync::OnceLock::new();
    MODEL.get_or_init(|| {
        let path = switchyard_wire::gguf::smollm2_path().expect("HOME or SWITCHYARD_CACHE");
        let (model, tokenizer) =
            load_gguf(&path).unwrap_or_else(|e| panic!("{e}: run `make model` to fetch SmolLM2"));
        (Arc::new(model), tokenizer)
    })
}

/// What the step loop needs beside the weights: each token's bytes and the ids that end a
/// generation (the GGUF's EOS, and `<|endoftext|>` where it is a control token).
fn llama_model(
    llama: Llama,
    meta: &GgufMetadata,
    eos: Option<u32>,
) -> Result<LlamaModel, llama::LlamaError> {
    let tokens = meta.strings("tokenizer.ggml.tokens")?;
    let types = meta.ints("tokenizer.ggml.token_type")?;
    let byte_of = gpt2_byte_decoder();
    let mut ends: Vec<u32> = eos.into_iter().collect();
    let token_bytes = tokens
        .iter()
        .zip(types.iter().chain(std::iter::repeat(&1)))
        .enumerate()
        .map(|(id, (text, &ty))| {
            if ty == TOKEN_TYPE_CONTROL {
                if *text == "<|endoftext|>" && !ends.contains(&(id as u32)) {
                    ends.push(id as u32);
                }
                return Vec::new();
            }
            let mut bytes = Vec::with_capacity(text.len());
            for ch in text.chars() {
                match byte_of.get(&ch) {
                    Some(&b) => bytes.push(b),
                    // Not a byte-level symbol (a user-defined token): its text as is.
                    None => bytes.extend_from_slice(ch.encode_utf8(&mut [0; 4]).as_bytes()),
                }
            }
            bytes
        })
        .collect();
    Ok(LlamaModel {
        llama,
        token_bytes,
        eos: ends,
    })
}

const TOKEN_TYPE_CONTROL: i64 = 3;

/// GPT-2's byte-level alphabet, reversed: the char each byte is written as in a token, to the
/// byte. Printable bytes stand for themselves; the rest map to U+0100 onwards in order.
fn gpt2_byte_decoder() -> HashMap<char, u8> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut next = 256u32;
    (0..=255u8)
        .map(|b| {
            if printable(b) {
                (char::from(b), b)
            } else {
                let ch = char::from_u32(next).unwrap_or(char::REPLACEMENT_CHARACTER);
                next += 1;
                (ch, b)
            }
        })
        .collect()
}

/// Marks the step loop dead when its thread ends, however it ends, so the HTTP side stops
/// reporting ready and cuts streams instead of finishing them.
struct StepLoopAlive(Arc<AtomicBool>);

impl Drop for StepLoopAlive {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
        if std::thread::panicking() {
            tracing::error!("the engine step loop panicked; the engine answers 503 from now on");
        }
    }
}

/// `switchyard engine`: starts the engine, prints the ready line, serves until `shutdown`
/// resolves (the binary passes SIGINT/SIGTERM).
pub fn run(args: EngineArgs, shutdown: impl Future<Output = ()>) -> Result<(), EngineError> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|source| EngineError::Start {
            what: "tokio runtime",
            source,
        })?;
    runtime.block_on(async {
        let engine = start(&args).await?;
        println!("{}", engine.ready_line());
        use std::io::Write as _;
        let _ = std::io::stdout().flush();
        tracing::info!(http = %engine.http_addr(), kv = %engine.kv_addr(), "engine ready");
        shutdown.await;
        Ok(())
    })
}

/// The flags are parsed already; an `EngineArgs` built by hand is checked here again.
fn latency_from(args: &EngineArgs) -> Result<Latency, EngineError> {
    let profile = Profile::by_name(&args.profile).ok_or_else(|| EngineError::BadArg {
        flag: "profile",
        reason: format!(
            "unknown profile {:?}; known: {}",
            args.profile,
            Profile::ALL.map(|p| p.name).join(", ")
        ),
    })?;
    if !(args.time_scale.is_finite() && args.time_scale >= 0.0) {
        return Err(EngineError::BadArg {
            flag: "time-scale",
            reason: "must be a finite number >= 0".into(),
        });
    }
    Ok(Latency {
        profile,
        time_scale: args.time_scale,
    })
}

/// A reservation must outlive any push that may still be under way into it: P gives up on a
/// push after the transfer timeout, so a shorter TTL could free pages P is still writing.
fn check_reservation_ttl(args: &EngineArgs) -> Result<(), EngineError> {
    if args.reservation_ttl_ms <= args.kv_transfer_timeout_ms {
        return Err(EngineError::BadArg {
            flag: "reservation-ttl-ms",
            reason: format!(
                "{} ms must exceed --kv-transfer-timeout-ms ({} ms)",
                args.reservation_ttl_ms, args.kv_transfer_timeout_ms
            ),
        });
    }
    Ok(())
}

/// How long an expired reservation's pages stay unused. The tcp receiver refuses closed slots,
/// so it needs none; one-sided transports write without asking, so their pages wait out the
/// longest a router (with default timeouts) keeps a remote_send going.
fn expiry_quarantine(kind: TransportKind) -> Duration {
    match kind {
        TransportKind::Tcp => Duration::ZERO,
        TransportKind::Shm | TransportKind::Cuda => {
            switchyard_wire::microserving::DEFAULT_CALL_TIMEOUT
        }
    }
}

fn pool_slots(args: &EngineArgs) -> Result<u32, EngineError> {
    if args.page_size == 0 || args.kv_pages == 0 {
        return Err(EngineError::BadArg {
            flag: if args.page_size == 0 {
                "page-size"
            } else {
                "kv-pages"
            },
            reason: "must be positive".into(),
        });
    }
    args.kv_pages
        .checked_mul(args.page_size)
        .ok_or_else(|| EngineError::BadArg {
            flag: "kv-pages",
            reason: "kv-pages × page-size overflows the slot id space".into(),
        })
}

/// Starts the KV transport; this engine's own rank is always a peer, so a request whose P and D
/// are the same engine works like any other.
async fn start_transport(
    args: &EngineArgs,
    store: Arc<KvStore>,
) -> Result<KvTransport, EngineError> {
    let peers: HashMap<u32, PeerAddr> = args.kv_peers.iter().cloned().collect();
    let config = TransportConfig {
        rank: Some(args.device_rank),
        listen: args.kv_listen.clone(),
        peers: peers.clone(),
        transfer_timeout: Duration::from_millis(args.kv_transfer_timeout_ms),
        ..TransportConfig::new(args.kv_transport)
    };
    let transport = KvTransport::start_with(config, store).await?;
    if !peers.contains_key(&args.device_rank) {
        transport.add_peer(args.device_rank, transport.listen_addr())?;
    }
    Ok(transport)
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod pd_tests;
