//! `switchyard serve`: the router in front of engines that are already running.
//!
//! Startup order: tokenizer → policies (every `*.wasm` of the plugins directory loaded,
//! `init`ed and checked; the default must load) → plugins watcher → cluster + health probes →
//! discovery (`--discovery k8s`, feature `k8s`) → bind (and the admin port, if any) → start
//! the connection workers (`--workers`) → serve.
//! `/health` turns 200 once `--min-healthy-endpoints` endpoints answer `GET /v1/models` and
//! discovery, if any, has reconciled its first full list.
//!
//! Shutdown drains ([`RunningRouter::shutdown`]): `/health` 503 at once, every listener closed
//! together after the drain delay, what is still open ended after the grace period.

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;

use switchyard_contract::Planner;
use switchyard_policy_host::{
    DEFAULT_DEBOUNCE, LoadError, PluginWatcher, PolicyHost, PolicyLimits, PolicyRegistry,
    RegistryConfig, RegistryError, WatchError,
};

use crate::Router;
use crate::api::{
    self, AdminAccess, AppState, BuiltinPlanner, DrainConfig, ListenerTlsError, ModelPrompts,
    Planning, PromptTokenizer, TlsAcceptor, TokenizerError,
};
use crate::cluster::{Cluster, EndpointSpec, Owner, ProbeConfig, spawn_probes};
use crate::config::{Config, ModelSource};
use crate::engine_client::{CallError, EngineClient};
use crate::plan::Executor;

/// Why the router could not start.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error(transparent)]
    Policy(#[from] LoadError),
    #[error(transparent)]
    Policies(#[from] RegistryError),
    #[error(transparent)]
    Watch(#[from] WatchError),
    #[error("cannot build the engine client: {0}")]
    Client(#[from] CallError),
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[cfg(feature = "k8s")]
    #[error(transparent)]
    Discovery(#[from] crate::discovery::DiscoveryError),
    #[error("cannot start the connection workers: {0}")]
    Workers(std::io::Error),
    #[error("a listener stopped unexpectedly: {0}")]
    Listener(tokio::task::JoinError),
    #[error("cannot serve HTTPS: {0}")]
    ListenerTls(#[from] ListenerTlsError),
}

/// A started router. Dropping it stops every listener at once (open streams end with an error
/// event) and the watcher.
pub struct RunningRouter {
    addr: SocketAddr,
    admin_addr: Option<SocketAddr>,
    state: Arc<AppState>,
    drain: DrainConfig,
    /// The main listener's task and the admin one's, if any; each ends when the drain is over.
    listeners: Vec<JoinHandle<()>>,
    _watcher: Option<PluginWatcher>,
    #[cfg(feature = "k8s")]
    _discovery: Option<crate::discovery::Discovery>,
}

impl RunningRouter {
    /// The address the router listens on: the OpenAI listener's (`switchyard epp`: the
    /// ext_proc service's).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn state(&self) -> &Arc<AppState> {
        &self.state
    }

    /// The admin listener's address, when `/admin/*` has a port of its own.
    pub fn admin_addr(&self) -> Option<SocketAddr> {
        self.admin_addr
    }

    /// Wait until `/health` would answer 200, at most `timeout`.
    pub async fn wait_ready(&self, timeout: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        while !self.state.is_ready() {
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        true
    }

    /// Drain, then return: `/health` answers 503 at once while the listeners keep accepting
    /// for the drain delay; then every listener closes at once and requests in flight have
    /// the grace period to finish; streams still open then end with an error event and
    /// `[DONE]`.
    pub async fn shutdown(self) -> Result<(), ServeError> {
        self.shutdown_or_hurry(std::future::pending()).await
    }

    /// [`RunningRouter::shutdown`], cut short when `hurry` resolves (a second Ctrl-C): what is
    /// left of the delay and the grace period is skipped.
    pub async fn shutdown_or_hurry(
        mut self,
        hurry: impl Future<Output = ()>,
    ) -> Result<(), ServeError> {
        let drain = self.state.drain.clone();
        let DrainConfig { delay, grace } = self.drain;
        let listeners = futures::future::join_all(self.listeners.drain(..));
        let steps = async {
            drain.begin();
            tracing::info!(?delay, ?grace, "draining: /health answers 503");
            tokio::select! {
                () = tokio::time::sleep(delay) => {}
                () = drain.accepting_stopped() => {}
            }
            drain.stop_accepting();
            tokio::pin!(listeners);
            tokio::select! {
                ended = &mut listeners => return ended,
                () = tokio::time::sleep(grace) => tracing::warn!(
                    ?grace,
                    "grace period over: ending what is still open with an error"
                ),
                () = drain.grace_over() => {}
            }
            drain.end_grace();
            listeners.await
        };
        tokio::pin!(steps);
        let ended = tokio::select! {
            ended = &mut steps => ended,
            () = hurry => {
                tracing::warn!("hurried: ending what is still open now");
                drain.end_grace();
                steps.await
            }
        };
        ended
            .into_iter()
            .find_map(Result::err)
            .map_or(Ok(()), |e| Err(ServeError::Listener(e)))
    }
}

impl Drop for RunningRouter {
    fn drop(&mut self) {
        self.state.drain.end_grace();
    }
}

/// What the policy registry needs from the router's configuration.
fn registry_config(config: &Config) -> RegistryConfig {
    RegistryConfig {
        plugins: config.plugins.clone(),
        default: config.policy_name.clone(),
        default_config: config.policy_config.clone(),
        fallback: config.policies.fallback.clone(),
        models: config.policies.models.clone(),
        header: config.policies.header,
        quarantine: config.policies.quarantine,
    }
}

/// Load everything, bind, and start serving in the background.
pub async fn start(config: &Config) -> Result<RunningRouter, ServeError> {
    let loaded = load(config).await?;
    let (listener, addr) = bind(config.listen).await?;
    serve_openai(config, loaded, listener, addr).await
}

/// Serve a loaded router's OpenAI API on `listener` (bound to `addr`), and `/admin/*` on the
/// admin port if there is one: what `serve` and `sidecar` share.
pub(crate) async fn serve_openai(
    config: &Config,
    loaded: Loaded,
    listener: tokio::net::TcpListener,
    addr: SocketAddr,
) -> Result<RunningRouter, ServeError> {
    let tls = listener_tls(config)?;
    let state = Arc::clone(&loaded.state);
    let mut listeners = Vec::with_capacity(2);
    let admin_addr = serve_admin_port(config, &state, &mut listeners, tls.clone()).await?;
    let workers = Arc::new(
        api::Workers::start(config.workers, config.worker_spin).map_err(ServeError::Workers)?,
    );
    let https = tls.is_some();
    listeners.push(tokio::spawn(api::serve(listener, state, workers, tls)));
    tracing::info!(%addr, endpoints = config.endpoints.len(), workers = config.workers, https, "router listening");
    Ok(loaded.running(config, addr, admin_addr, listeners))
}

/// The listeners' TLS, when `--tls-cert` and `--tls-key` are given: one certificate for the
/// main port and the admin port.
pub(crate) fn listener_tls(config: &Config) -> Result<Option<TlsAcceptor>, ServeError> {
    let Some(tls) = &config.tls else {
        return Ok(None);
    };
    Ok(Some(TlsAcceptor::load(&tls.cert, &tls.key)?))
}

/// A router loaded and wired, its listeners not yet bound: what `serve`, `epp` and `sidecar`
/// share.
pub(crate) struct Loaded {
    pub state: Arc<AppState>,
    /// The plugins directory's watcher, when policies plan the requests.
    watcher: Option<PluginWatcher>,
    #[cfg(feature = "k8s")]
    discovery: Option<crate::discovery::Discovery>,
}

impl Loaded {
    /// The running router whose listeners (`addr`'s first, the admin one's if any) are
    /// `listeners`.
    pub(crate) fn running(
        self,
        config: &Config,
        addr: SocketAddr,
        admin_addr: Option<SocketAddr>,
        listeners: Vec<JoinHandle<()>>,
    ) -> RunningRouter {
        RunningRouter {
            addr,
            admin_addr,
            state: self.state,
            drain: config.drain,
            listeners,
            _watcher: self.watcher,
            #[cfg(feature = "k8s")]
            _discovery: self.discovery,
        }
    }
}

/// Tokenizer, policies and their watcher, cluster and probes, discovery, router and state.
pub(crate) async fn load(config: &Config) -> Result<Loaded, ServeError> {
    let tokenizer = tokenizer(config.model_source.as_ref())?;
    let host = PolicyHost::new(PolicyLimits::default())?;
    let policies = PolicyRegistry::open(host, registry_config(config)).await?;
    let watcher = switchyard_policy_host::watch(Arc::clone(&policies), DEFAULT_DEBOUNCE)?;
    let mut loaded = wire(config, tokenizer, |_| Planning::Policies(policies)).await?;
    loaded.watcher = Some(watcher);
    Ok(loaded)
}

/// [`load`] for a router whose requests one built-in planner plans (`switchyard sidecar`):
/// no policy is loaded; `planner` is made once the router's executor exists.
pub(crate) async fn load_builtin(
    config: &Config,
    planner: impl FnOnce(&Executor) -> Arc<dyn BuiltinPlanner>,
) -> Result<Loaded, ServeError> {
    let tokenizer = tokenizer(config.model_source.as_ref())?;
    wire(config, tokenizer, |executor| {
        Planning::Builtin(planner(executor))
    })
    .await
}

/// A model's tokenizer and chat template; no source: the byte-level tokenizer.
fn tokenizer(source: Option<&ModelSource>) -> Result<Arc<PromptTokenizer>, ServeError> {
    let tokenizer = match source {
        Some(ModelSource::Dir(dir)) => PromptTokenizer::from_model_dir(dir)?,
        Some(ModelSource::Gguf { path, files }) => PromptTokenizer::from_gguf(files, path)?,
        None => PromptTokenizer::byte_level()?,
    };
    Ok(Arc::new(tokenizer))
}

/// The other `[[models]]`' tokenizers and limits, by name.
fn model_prompts(config: &Config) -> Result<HashMap<String, ModelPrompts>, ServeError> {
    config
        .models
        .iter()
        .map(|model| {
            let prompts = ModelPrompts {
                tokenizer: tokenizer(model.source.as_ref())?,
                limits: model.limits,
            };
            Ok((model.name.clone(), prompts))
        })
        .collect()
}

/// Cluster and probes, discovery, router and state, planned as `planning` says.
async fn wire(
    config: &Config,
    tokenizer: Arc<PromptTokenizer>,
    planning: impl FnOnce(&Executor) -> Planning,
) -> Result<Loaded, ServeError> {
    let mut cluster = Cluster::with_engine_tls(
        config.endpoints.clone(),
        config.outlier,
        config.engine_tls.clone(),
    )
    .with_min_healthy(config.min_healthy_endpoints)
    .with_kv_events(config.kv_events)
    .with_saturation(config.saturation);
    if config.discovery.is_some() {
        cluster = cluster.awaiting_discovery();
    }
    let cluster = Arc::new(cluster);
    let client = EngineClient::new(config.timeouts);
    spawn_probes(&cluster, &client, ProbeConfig::default());
    for id in 0..cluster.len() as u32 {
        cluster.subscribe_kv_events(id);
    }
    let executor = Executor::new(cluster, client);
    let planning = planning(&executor);
    let planner: Arc<dyn Planner> = match &planning {
        Planning::Policies(policies) => policies.clone(),
        Planning::Builtin(planner) => planner.clone(),
    };
    if let Some(path) = &config.endpoints_file {
        reload_endpoints_on_sighup(path.clone(), executor.clone());
    }
    #[cfg(feature = "k8s")]
    let discovery = match &config.discovery {
        Some(settings) => Some(crate::discovery::start(settings, executor.clone()).await?),
        None => None,
    };
    let router = Arc::new(Router::new(
        executor,
        planner,
        config.routing,
        tokenizer.tokenizer(),
    ));
    let state = Arc::new(
        AppState::new(
            router,
            tokenizer,
            config.model.clone(),
            planning,
            config.max_body_bytes,
            config.default_max_tokens,
        )
        .with_admin(AdminAccess {
            token: config.admin.token.clone(),
            separate_port: config.admin.listen.is_some(),
        })
        .with_forward_headers(config.policies.forward_headers.clone())
        .with_limits(config.limits)
        .with_models(
            config
                .policies
                .models
                .keys()
                .cloned()
                .chain(config.models.iter().map(|m| m.name.clone()))
                .collect(),
        )
        .with_model_prompts(model_prompts(config)?)
        .with_edge(config.admission.clone(), config.connections),
    );
    Ok(Loaded {
        state,
        watcher: None,
        #[cfg(feature = "k8s")]
        discovery,
    })
}

/// Bind the admin port, if one is configured, and serve `/admin/*` on it.
pub(crate) async fn serve_admin_port(
    config: &Config,
    state: &Arc<AppState>,
    listeners: &mut Vec<JoinHandle<()>>,
    tls: Option<TlsAcceptor>,
) -> Result<Option<SocketAddr>, ServeError> {
    let Some(admin_addr) = config.admin.listen else {
        return Ok(None);
    };
    let (admin_listener, admin_addr) = bind(admin_addr).await?;
    let scheme = if tls.is_some() { "https" } else { "http" };
    listeners.push(tokio::spawn(api::serve_admin(
        admin_listener,
        Arc::clone(state),
        tls,
    )));
    println!("switchyard admin listening on {scheme}://{admin_addr}");
    Ok(Some(admin_addr))
}

pub(crate) async fn bind(
    addr: SocketAddr,
) -> Result<(tokio::net::TcpListener, SocketAddr), ServeError> {
    let bind_error = |source| ServeError::Bind { addr, source };
    let listener = api::bind(addr).await.map_err(bind_error)?;
    let local = listener.local_addr().map_err(bind_error)?;
    Ok((listener, local))
}

/// On SIGHUP, re-read the `[[endpoints]]` of `path` and bring the live list in line with it:
/// endpoints the file lists and the list lacks are added; endpoints the file put in and no
/// longer lists are drained, then removed once nothing is in flight on them. Endpoints added
/// through `/admin/endpoints` are left alone. A file that does not parse changes nothing.
fn reload_endpoints_on_sighup(path: PathBuf, executor: Executor) {
    use tokio::signal::unix::{SignalKind, signal};
    let Ok(mut hangups) = signal(SignalKind::hangup()) else {
        tracing::warn!("cannot listen for SIGHUP: the endpoint list will not be reloaded");
        return;
    };
    tokio::spawn(async move {
        while hangups.recv().await.is_some() {
            match crate::config::endpoints_in_file(&path) {
                Ok(specs) => reconcile(&executor, &specs),
                Err(e) => {
                    tracing::warn!(file = %path.display(), error = %e, "SIGHUP: endpoints not reloaded")
                }
            }
        }
    });
}

/// Make the file's endpoints (`Owner::Static`) those of `specs`, matched by URL.
fn reconcile(executor: &Executor, specs: &[EndpointSpec]) {
    let cluster = executor.cluster();
    let current = cluster.owned_by(&Owner::Static);
    let base = |url: &str| url.trim_end_matches('/').to_owned();
    for spec in specs {
        if !current.iter().any(|(_, c)| base(&c.url) == base(&spec.url))
            && let Err(e) = executor.add_endpoint(spec, Owner::Static)
        {
            tracing::warn!(url = %spec.url, error = %e, "SIGHUP: endpoint not added");
        }
    }
    for (id, old) in current {
        if !specs.iter().any(|s| base(&s.url) == base(&old.url)) && cluster.drain(id).is_ok() {
            let cluster = Arc::clone(cluster);
            tokio::spawn(async move { cluster.remove_when_idle(id).await });
        }
    }
}

/// Run the router until `shutdown` resolves, then drain it ([`RunningRouter::shutdown`]),
/// skipping what is left of the drain when `hurry` resolves.
pub async fn run(
    config: Config,
    shutdown: impl Future<Output = ()>,
    hurry: impl Future<Output = ()>,
) -> Result<(), ServeError> {
    let router = start(&config).await?;
    let scheme = if config.tls.is_some() {
        "https"
    } else {
        "http"
    };
    println!(
        "switchyard router listening on {scheme}://{}",
        router.addr()
    );
    shutdown.await;
    router.shutdown_or_hurry(hurry).await
}
