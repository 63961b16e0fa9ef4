//! Starting an engine: the flags checked, the model loaded, the KV pool and transport up, the
//! step loop on its thread, then the HTTP server (and the side channel or bootstrap server)
//! listening; and `switchyard engine`'s run until shutdown.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use switchyard_kv::{KvStore, KvTransport, PeerAddr, TransportConfig, TransportKind};
use switchyard_wire::ReadyLine;

use crate::args::{DisaggregationMode, EngineArgs, Protocol};
use crate::error::EngineError;
use crate::http;
use crate::kv_events::{Publisher, PublisherConfig};
use crate::latency::TimingModel;
use crate::load::load_model;
use crate::metrics::Metrics;
use crate::scheduler::{Backend, Core, CoreConfig};
use crate::step_loop::StepLoop;

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
    /// `--kv-events`: the publisher, stopped with the engine.
    kv_events: Option<Publisher>,
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

    /// `--kv-events`: where the PUB socket is bound (the port chosen if the flag said 0).
    pub fn kv_events_addr(&self) -> Option<SocketAddr> {
        self.kv_events.as_ref().map(Publisher::events_addr)
    }

    /// `--kv-events-replay`: where the replay socket is bound.
    pub fn kv_events_replay_addr(&self) -> Option<SocketAddr> {
        self.kv_events.as_ref().and_then(Publisher::replay_addr)
    }

    /// The line `switchyard engine` prints once it accepts requests.
    pub fn ready_line(&self) -> ReadyLine {
        ReadyLine {
            http_addr: self.http_addr,
            device_rank: self.device_rank,
            kv_addr: self.kv_addr.to_string(),
            bootstrap_port: self.bootstrap_addr.map(|a| a.port()),
            kv_events: self.kv_events_addr(),
            kv_events_replay: self.kv_events_replay_addr(),
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
    let latency = args.latency()?;
    let num_slots = args.pool_slots()?;
    args.check_reservation_ttl()?;
    args.check_protocol()?;
    args.check_kv_events()?;
    let model = load_model(&args.model).await?;
    let store = KvStore::new_on(args.kv_device, model.kv_shape(args.model_shape), num_slots)?;
    let store = Arc::new(store.with_guarded_slots());
    let transport = start_transport(args, store.clone()).await?;
    let kv_addr = transport.listen_addr();

    let metrics = Metrics::default();
    let timing: Arc<dyn TimingModel> = Arc::new(latency);
    let config = CoreConfig {
        page_size: args.page_size as usize,
        num_pages: args.kv_pages,
        prefix_cache: args.prefix_cache,
        prefill_chunk: args.prefill_chunk,
        max_batch: args.max_batch,
        reservation_ttl: Duration::from_millis(args.reservation_ttl_ms),
        expiry_quarantine: expiry_quarantine(args.kv_transport),
        preempt_every: args.preempt_every.filter(|&k| k > 0),
        timing: timing.clone(),
    };
    let core = Core::new(config, Backend::new(&model.spec, store));
    let (step_loop, kv_events) = match args.kv_events {
        Some(events) => {
            let config = PublisherConfig {
                events,
                replay: args.kv_events_replay,
                encoding: args.kv_events_encoding,
                buffer_steps: args.kv_events_buffer_steps,
                dp_rank: args.kv_events_dp_rank,
            };
            let (publisher, batches) = Publisher::start(config).await?;
            // A seed per process, as vLLM's NONE_HASH: this engine's hashes are its own.
            let core = core.with_kv_events(rand::random());
            let step_loop = StepLoop::new(core, metrics.clone()).publishing(batches);
            (step_loop, Some(publisher))
        }
        None => (StepLoop::new(core, metrics.clone()), None),
    };
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
        disaggregation_mode: args.disaggregation_mode,
        vocab_size: model.tokenizer.get_vocab_size(true) as u32,
        max_model_len: model.max_model_len(),
        prompts: model.prompts,
        client: reqwest::Client::new(),
        commands,
        alive,
        tokenizer: Arc::new(model.tokenizer),
        answers_token_ids: !args.ignore_return_token_ids,
        transport: Arc::new(transport),
        metrics,
        timing,
        model_name: args.served_model_name.clone().unwrap_or(model.default_name),
        num_pages: args.kv_pages,
        page_size: args.page_size as usize,
        fail_rate: args.fail_rate,
        kv_transfer_timeout: Duration::from_millis(args.kv_transfer_timeout_ms),
        device_rank: args.device_rank,
    });
    let aux_server = aux_listener.map(|(listener, _)| {
        let (state, pd) = (state.clone(), pd.clone());
        tokio::spawn(http::serve(listener, move |req| {
            http::aux_route(req, state.clone(), pd.clone())
        }))
    });
    let server = tokio::spawn(http::serve(listener, move |req| {
        http::route(req, state.clone(), pd.clone())
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
        kv_events,
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
        tracing::info!(
            http = %engine.http_addr(),
            kv = %engine.kv_addr(),
            kv_events = ?engine.kv_events_addr(),
            kv_events_replay = ?engine.kv_events_replay_addr(),
            "engine ready"
        );
        shutdown.await;
        Ok(())
    })
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
