//! `switchyard serve`: the router in front of engines that are already running.
//!
//! Startup order: tokenizer → policies (every `*.wasm` of the plugins directory loaded,
//! `init`ed and checked; the default must load) → plugins watcher → cluster + health probes →
//! bind (and the admin port, if any) → serve. `/health` turns 200 once
//! `--min-healthy-endpoints` endpoints answer `GET /v1/models`.

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use switchyard_contract::Planner;
use switchyard_policy_host::{
    DEFAULT_DEBOUNCE, LoadError, PluginWatcher, PolicyHost, PolicyLimits, PolicyRegistry,
    RegistryConfig, RegistryError, WatchError,
};

use crate::Router;
use crate::api::{self, AdminAccess, AppState, PromptTokenizer, TokenizerError};
use crate::cluster::{Cluster, EndpointSpec, Owner, ProbeConfig, spawn_probes};
use crate::config::Config;
use crate::microserving::{CallError, EngineClient};
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
    #[error("the server failed: {0}")]
    Serve(std::io::Error),
}

/// A started router. Dropping it stops the server (and the admin listener and the watcher).
pub struct RunningRouter {
    addr: SocketAddr,
    state: Arc<AppState>,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<std::io::Result<()>>,
    admin: Option<Listener>,
    _watcher: PluginWatcher,
}

/// A background HTTP server and the way to stop it.
struct Listener {
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<std::io::Result<()>>,
}

impl Listener {
    async fn stop(mut self) -> Result<(), ServeError> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        match (&mut self.task).await {
            Ok(result) => result.map_err(ServeError::Serve),
            Err(e) => Err(ServeError::Serve(std::io::Error::other(e))),
        }
    }
}

impl RunningRouter {
    /// The address the router listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn state(&self) -> &Arc<AppState> {
        &self.state
    }

    /// The admin listener's address, when `/admin/*` has a port of its own.
    pub fn admin_addr(&self) -> Option<SocketAddr> {
        self.admin.as_ref().map(|a| a.addr)
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

    /// Stop accepting, let open responses finish, and return.
    pub async fn shutdown(mut self) -> Result<(), ServeError> {
        if let Some(admin) = self.admin.take() {
            admin.stop().await?;
        }
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        match (&mut self.task).await {
            Ok(result) => result.map_err(ServeError::Serve),
            Err(e) => Err(ServeError::Serve(std::io::Error::other(e))),
        }
    }
}

impl Drop for RunningRouter {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(stop) = self.admin.as_mut().and_then(|a| a.stop.take()) {
            let _ = stop.send(());
        }
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
    let tokenizer = match &config.model_dir {
        Some(dir) => PromptTokenizer::from_model_dir(dir)?,
        None => PromptTokenizer::byte_level()?,
    };
    let tokenizer = Arc::new(tokenizer);
    let host = PolicyHost::new(PolicyLimits::default())?;
    let policies = PolicyRegistry::open(host, registry_config(config)).await?;
    let watcher = switchyard_policy_host::watch(Arc::clone(&policies), DEFAULT_DEBOUNCE)?;
    let planner: Arc<dyn Planner> = policies.clone();

    let cluster = Arc::new(
        Cluster::new(config.endpoints.clone(), config.outlier)
            .with_min_healthy(config.min_healthy_endpoints),
    );
    let client = EngineClient::new(config.timeouts)?;
    spawn_probes(&cluster, &client, ProbeConfig::default());
    let executor = Executor::new(cluster, client);
    if let Some(path) = &config.endpoints_file {
        reload_endpoints_on_sighup(path.clone(), executor.clone());
    }
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
            policies,
            config.max_body_bytes,
            config.default_max_tokens,
        )
        .with_admin(AdminAccess {
            token: config.admin.token.clone(),
            separate_port: config.admin.listen.is_some(),
        })
        .with_forward_headers(config.policies.forward_headers.clone())
        .with_limits(config.limits)
        .with_models(config.policies.models.keys().cloned().collect()),
    );

    let (listener, addr) = bind(config.listen).await?;
    let admin = match config.admin.listen {
        Some(admin_addr) => {
            let (admin_listener, admin_addr) = bind(admin_addr).await?;
            let (stop, stopped) = oneshot::channel::<()>();
            let task = tokio::spawn(api::serve_admin(
                admin_listener,
                state.clone(),
                async move {
                    let _ = stopped.await;
                },
            ));
            println!("switchyard admin listening on http://{admin_addr}");
            Some(Listener {
                addr: admin_addr,
                stop: Some(stop),
                task,
            })
        }
        None => None,
    };
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(api::serve(listener, state.clone(), async move {
        let _ = stopped.await;
    }));
    tracing::info!(%addr, endpoints = config.endpoints.len(), "router listening");
    Ok(RunningRouter {
        addr,
        state,
        stop: Some(stop),
        task,
        admin,
        _watcher: watcher,
    })
}

async fn bind(addr: SocketAddr) -> Result<(tokio::net::TcpListener, SocketAddr), ServeError> {
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
    let current = cluster.owned_by(Owner::Static);
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
            tokio::spawn(remove_when_idle(Arc::clone(cluster), id));
        }
    }
}

/// Remove a draining endpoint once nothing is in flight on it (every request ends by its
/// deadline, so this ends too).
async fn remove_when_idle(cluster: Arc<Cluster>, id: u32) {
    const POLL: Duration = Duration::from_millis(100);
    loop {
        match cluster.remove(id) {
            Err(crate::cluster::EndpointError::Busy { .. }) => tokio::time::sleep(POLL).await,
            _ => return,
        }
    }
}

/// Run the router until `shutdown` resolves.
pub async fn run(config: Config, shutdown: impl Future<Output = ()>) -> Result<(), ServeError> {
    let router = start(&config).await?;
    println!("switchyard router listening on http://{}", router.addr());
    shutdown.await;
    router.shutdown().await
}
