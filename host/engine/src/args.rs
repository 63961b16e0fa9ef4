//! `switchyard engine`'s flags, and the checks that need more than one of them.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use switchyard_kv::{KvDevice, KvShape, PeerAddr, TransportKind, parse_rank_addr};

use crate::error::EngineError;
use crate::latency::{Latency, Profile};

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

/// How the engine writes its KV events (`--kv-events-encoding`), and with them which replay
/// answer it gives: each is one era of vLLM's publisher.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum KvEventsEncoding {
    /// Events as maps tagged by `"type"`, replay answers with the topic frame (vLLM >= 0.26).
    #[default]
    Map,
    /// Events as positional arrays tagged by name, replay answers without the topic frame
    /// (vLLM < 0.26, older SGLang).
    Array,
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
    /// Publish the prefix cache's changes as vLLM's KV events on a ZeroMQ PUB socket bound here
    /// (`tcp://*:PORT` or `tcp://IP:PORT`; port 0 picks a free one): one batch per step that
    /// stored or evicted pages, `[topic "", seq, payload]` with seq from 0. Needs
    /// --prefix-cache.
    #[arg(long, value_name = "ENDPOINT", value_parser = parse_kv_events_endpoint)]
    pub kv_events: Option<SocketAddr>,
    /// Answer replay requests on a ZeroMQ ROUTER socket bound here (`tcp://*:PORT` or
    /// `tcp://IP:PORT`): every buffered batch from the sequence number asked for, then the end
    /// marker. Needs --kv-events.
    #[arg(long, value_name = "ENDPOINT", value_parser = parse_kv_events_endpoint)]
    pub kv_events_replay: Option<SocketAddr>,
    /// How events are written: `map` (vLLM >= 0.26) or `array` (older vLLM and SGLang); the
    /// replay answers take the same era's shape.
    #[arg(long, value_enum, default_value = "map")]
    pub kv_events_encoding: KvEventsEncoding,
    /// How many of the latest batches the replay socket can send again (vLLM's
    /// `buffer_steps`).
    #[arg(long, default_value_t = 10_000, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub kv_events_buffer_steps: usize,
    /// The data-parallel rank stamped in every batch (vLLM stamps each engine core's; one
    /// reference engine stands for one rank of a DP deployment, on the ports vLLM gives it).
    #[arg(long, default_value_t = 0)]
    pub kv_events_dp_rank: u32,
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

/// A ZeroMQ endpoint the engine binds: `tcp://*:PORT` (every interface, as ZeroMQ spells it)
/// or `tcp://IP:PORT`.
fn parse_kv_events_endpoint(s: &str) -> Result<SocketAddr, String> {
    let address = s
        .strip_prefix("tcp://")
        .ok_or_else(|| format!("{s:?} is not a tcp:// endpoint (the engine binds it)"))?;
    if let Some(port) = address.strip_prefix("*:") {
        let port = port
            .parse::<u16>()
            .map_err(|_| format!("{s:?}: {port:?} is not a port"))?;
        return Ok(SocketAddr::new(Ipv4Addr::UNSPECIFIED.into(), port));
    }
    address
        .parse()
        .map_err(|_| format!("{s:?} is not tcp://*:PORT or tcp://IP:PORT"))
}

fn parse_time_scale(s: &str) -> Result<f64, String> {
    s.parse::<f64>()
        .ok()
        .filter(|t| t.is_finite() && *t >= 0.0)
        .ok_or_else(|| format!("{s:?} is not a finite number >= 0"))
}

/// Checks of flags that go together, run when the engine starts.
impl EngineArgs {
    /// The latency model `--profile` and `--time-scale` name. Parsing checked them; an
    /// `EngineArgs` built by hand is checked again here.
    pub(crate) fn latency(&self) -> Result<Latency, EngineError> {
        let profile = Profile::by_name(&self.profile).ok_or_else(|| EngineError::BadArg {
            flag: "profile",
            reason: format!(
                "unknown profile {:?}; known: {}",
                self.profile,
                Profile::ALL.map(|p| p.name).join(", ")
            ),
        })?;
        if !(self.time_scale.is_finite() && self.time_scale >= 0.0) {
            return Err(EngineError::BadArg {
                flag: "time-scale",
                reason: "must be a finite number >= 0".into(),
            });
        }
        Ok(Latency {
            profile,
            time_scale: self.time_scale,
        })
    }

    /// A reservation must outlive any push that may still be under way into it: P gives up on a
    /// push after the transfer timeout, so a shorter TTL could free pages P is still writing.
    pub(crate) fn check_reservation_ttl(&self) -> Result<(), EngineError> {
        if self.reservation_ttl_ms <= self.kv_transfer_timeout_ms {
            return Err(EngineError::BadArg {
                flag: "reservation-ttl-ms",
                reason: format!(
                    "{} ms must exceed --kv-transfer-timeout-ms ({} ms)",
                    self.reservation_ttl_ms, self.kv_transfer_timeout_ms
                ),
            });
        }
        Ok(())
    }

    /// The protocol flags fit together: a disaggregation mode and a bootstrap port are SGLang's,
    /// and an SGLang prefill engine must have a bootstrap port (routers are configured with it).
    pub(crate) fn check_protocol(&self) -> Result<(), EngineError> {
        let sglang = self.protocol == Protocol::Sglang;
        let prefill = sglang && self.disaggregation_mode == DisaggregationMode::Prefill;
        if !sglang && self.disaggregation_mode != DisaggregationMode::Null {
            return Err(EngineError::BadArg {
                flag: "disaggregation-mode",
                reason: "needs --protocol sglang".into(),
            });
        }
        match (prefill, self.bootstrap_port) {
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

    /// KV events come from the prefix cache, and a replay socket serves what the PUB socket
    /// published.
    pub(crate) fn check_kv_events(&self) -> Result<(), EngineError> {
        if self.kv_events.is_some() && !self.prefix_cache {
            return Err(EngineError::BadArg {
                flag: "kv-events",
                reason:
                    "needs --prefix-cache: KV events report what the prefix cache stores and evicts"
                        .into(),
            });
        }
        if self.kv_events.is_none() && self.kv_events_replay.is_some() {
            return Err(EngineError::BadArg {
                flag: "kv-events-replay",
                reason: "needs --kv-events: it replays what that socket published".into(),
            });
        }
        Ok(())
    }

    /// Slots in the KV pool: `--kv-pages` × `--page-size`.
    pub(crate) fn pool_slots(&self) -> Result<u32, EngineError> {
        if self.page_size == 0 || self.kv_pages == 0 {
            return Err(EngineError::BadArg {
                flag: if self.page_size == 0 {
                    "page-size"
                } else {
                    "kv-pages"
                },
                reason: "must be positive".into(),
            });
        }
        self.kv_pages
            .checked_mul(self.page_size)
            .ok_or_else(|| EngineError::BadArg {
                flag: "kv-pages",
                reason: "kv-pages × page-size overflows the slot id space".into(),
            })
    }
}
