//! `switchyard epp`: the router as a Gateway API Inference Extension *Endpoint Picker*. A
//! gateway (Envoy, and the gateways built on it) asks over Envoy's ext_proc where each request
//! goes; the EPP answers with the endpoint the request's policy plans on, and the gateway sends
//! the request there itself.
//!
//! Everything but the data path is the router's: the same configuration, cluster (probes,
//! discovery, outlier ejection), policies (hot-swapped), admission control and request
//! parsing. What differs is the end of the pipeline: `api` parses and selects the policy,
//! [`crate::Router::plan_only`] plans exactly as a first attempt, and the plan is answered
//! rather than executed (`pick`): `forward(e)` → `x-gateway-destination-endpoint: e`;
//! a handoff → the decode endpoint, with `x-prefiller-host-port` naming the prefill one.
//! Retries, continuation and the handoff's legs are the gateway's and the engines' sidecars'.
//!
//! Listeners: the ext_proc service on `--grpc-port`; gRPC health (`liveness`, `readiness`,
//! the ext_proc service's name, and the server as a whole, `""`) on `--grpc-health-port`;
//! `/metrics` (with `/health` and `/livez`) on `--metrics-port`; `/admin/*` on `--admin-port`
//! when one is given. No OpenAI listener.

mod ext_proc;
mod pick;
pub mod wire;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessorServer;
use tokio::task::JoinHandle;
use tonic::transport::server::TcpIncoming;
use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;

use crate::api::{self, AppState, Drain};
use crate::config::{Config, ConfigError, EndpointPickerArgs, ServeArgs};
use crate::serve::{RunningRouter, ServeError, bind, listener_tls, load, serve_admin_port};

pub use ext_proc::ExtProc;

/// `switchyard epp` flags: `serve`'s (but its OpenAI `--port`, which the EPP does not open),
/// and the EPP's own.
#[derive(Debug, Clone, clap::Args)]
pub struct EppArgs {
    #[command(flatten)]
    pub serve: ServeArgs,
    #[command(flatten)]
    pub epp: EndpointPickerArgs,
}

/// The validated configuration of `switchyard epp`.
#[derive(Debug, Clone)]
pub struct EppConfig {
    pub router: Config,
    pub grpc: SocketAddr,
    pub grpc_health: SocketAddr,
    pub metrics: SocketAddr,
    /// Endpoints the answer names after the pick (`--destination-fallbacks`).
    pub fallbacks: usize,
}

impl EppConfig {
    /// Parse and validate `args` (and the file they name); the ports listen on `--host`.
    pub fn from_args(args: &EppArgs) -> Result<EppConfig, ConfigError> {
        let (router, picker) = Config::for_epp(&args.serve, &args.epp)?;
        let on = |port| SocketAddr::new(router.listen.ip(), port);
        Ok(EppConfig {
            grpc: on(picker.grpc_port),
            grpc_health: on(picker.grpc_health_port),
            metrics: on(picker.metrics_port),
            fallbacks: picker.destination_fallbacks,
            router,
        })
    }
}

/// A started EPP: the router behind its listeners. Dropping it stops them.
pub struct RunningEpp {
    router: RunningRouter,
    grpc_health: SocketAddr,
    metrics: SocketAddr,
}

impl RunningEpp {
    /// The ext_proc service's address.
    pub fn grpc_addr(&self) -> SocketAddr {
        self.router.addr()
    }

    pub fn grpc_health_addr(&self) -> SocketAddr {
        self.grpc_health
    }

    pub fn metrics_addr(&self) -> SocketAddr {
        self.metrics
    }

    pub fn state(&self) -> &Arc<AppState> {
        self.router.state()
    }

    /// [`RunningRouter::shutdown_or_hurry`]: readiness turns `NOT_SERVING` at once, the
    /// listeners close after the drain delay, open streams have the grace period.
    pub async fn shutdown_or_hurry(
        self,
        hurry: impl Future<Output = ()>,
    ) -> Result<(), ServeError> {
        self.router.shutdown_or_hurry(hurry).await
    }
}

/// Load everything, bind the EPP's ports, and start serving in the background.
pub async fn start(config: &EppConfig) -> Result<RunningEpp, ServeError> {
    let loaded = load(&config.router).await?;
    let state = Arc::clone(&loaded.state);
    let (grpc, grpc_addr) = bind(config.grpc).await?;
    let (health, grpc_health) = bind(config.grpc_health).await?;
    let (metrics_listener, metrics) = bind(config.metrics).await?;
    let mut listeners = Vec::with_capacity(4);
    // `--tls-cert` makes the admin port HTTPS; ext_proc and the metrics port stay plain.
    let tls = listener_tls(&config.router)?;
    let admin_addr = serve_admin_port(&config.router, &state, &mut listeners, tls).await?;
    listeners.push(tokio::spawn(api::serve_metrics(
        metrics_listener,
        Arc::clone(&state),
    )));
    let (reporter, health_service) = tonic_health::server::health_reporter();
    tokio::spawn(report_health(reporter, Arc::clone(&state)));
    let drain = state.drain.clone();
    let stopped = drain.clone();
    listeners.push(until_grace_over(
        "gRPC health",
        drain.clone(),
        tonic::transport::Server::builder().serve_with_incoming_shutdown(
            health_service,
            incoming(health),
            async move { stopped.accepting_stopped().await },
        ),
    ));
    let stopped = drain.clone();
    listeners.push(until_grace_over(
        "ext_proc",
        drain,
        tonic::transport::Server::builder().serve_with_incoming_shutdown(
            ExternalProcessorServer::new(ExtProc::new(Arc::clone(&state), config.fallbacks)),
            incoming(grpc),
            async move { stopped.accepting_stopped().await },
        ),
    ));
    tracing::info!(%grpc_addr, %grpc_health, %metrics, endpoints = config.router.endpoints.len(), "endpoint picker listening");
    Ok(RunningEpp {
        router: loaded.running(&config.router, grpc_addr, admin_addr, listeners),
        grpc_health,
        metrics,
    })
}

fn incoming(listener: tokio::net::TcpListener) -> TcpIncoming {
    TcpIncoming::from(listener).with_nodelay(Some(true))
}

/// A gRPC server as a listener task: it stops accepting when the drain says so, waits for its
/// open streams, and drops those still open when the grace period is over.
fn until_grace_over(
    what: &'static str,
    drain: Drain,
    serve: impl Future<Output = Result<(), tonic::transport::Error>> + Send + 'static,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        tokio::select! {
            served = serve => if let Err(e) = served {
                tracing::error!(what, error = %e, "gRPC listener failed");
            },
            () = drain.grace_over() => {}
        }
    })
}

/// How often the gRPC readiness follows the cluster's (readiness has no event to wait on: it
/// is the probes' count of healthy endpoints).
const HEALTH_EVERY: Duration = Duration::from_millis(500);

/// `liveness` serves while the process lives; `readiness`, the ext_proc service's name and the
/// whole server (`""`) serve while enough endpoints are healthy and the EPP is not draining.
async fn report_health(reporter: HealthReporter, state: Arc<AppState>) {
    reporter
        .set_service_status("liveness", ServingStatus::Serving)
        .await;
    let mut ticks = tokio::time::interval(HEALTH_EVERY);
    let mut last = None;
    loop {
        tokio::select! {
            _ = ticks.tick() => {}
            () = state.drain.grace_over() => return,
        }
        let ready = state.is_ready() && !state.drain.is_draining();
        if last == Some(ready) {
            continue;
        }
        last = Some(ready);
        let status = if ready {
            ServingStatus::Serving
        } else {
            ServingStatus::NotServing
        };
        for service in [
            "readiness",
            "",
            <ExternalProcessorServer<ExtProc> as tonic::server::NamedService>::NAME,
        ] {
            reporter.set_service_status(service, status).await;
        }
    }
}

/// Run the EPP until `shutdown` resolves, then drain it, skipping what is left of the drain
/// when `hurry` resolves.
pub async fn run(
    config: EppConfig,
    shutdown: impl Future<Output = ()>,
    hurry: impl Future<Output = ()>,
) -> Result<(), ServeError> {
    let epp = start(&config).await?;
    println!(
        "switchyard epp listening on grpc://{} (health grpc://{}, metrics http://{})",
        epp.grpc_addr(),
        epp.grpc_health_addr(),
        epp.metrics_addr()
    );
    shutdown.await;
    epp.shutdown_or_hurry(hurry).await
}
