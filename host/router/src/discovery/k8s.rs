//! The only part that talks to Kubernetes: one watch of the pods matching the selector, kept in
//! a reflector store, and the live list reconciled with the whole store on every batch of
//! events and on every resync tick.
//!
//! Each tick also starts the watch afresh, which lists the pods before it watches again: a
//! watch that went silent, or lost a delete (a force-deleted pod, a 410 Gone, a relabelled pod
//! whose event never came), converges within one `--k8s-resync`. The store keeps answering
//! with the previous list until the new one is complete, so a re-list never empties it.

use std::collections::BTreeSet;
use std::sync::Arc;

use futures::StreamExt as _;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt as _, watcher};
use kube::{Api, Client};
use tokio::task::JoinHandle;

use super::{Applier, Desired, pod};
use crate::config::K8sDiscovery;
use crate::plan::Executor;

/// Why discovery could not start.
#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    #[error(
        "--discovery k8s: no Kubernetes config (KUBECONFIG, ~/.kube/config or the pod's service account): {0}"
    )]
    Config(#[from] kube::config::InferConfigError),
    #[error("--discovery k8s: cannot build the Kubernetes client: {0}")]
    Client(#[from] kube::Error),
}

/// The running discovery task; dropping it stops the watch (what it added stays listed).
#[derive(Debug)]
pub struct Discovery(JoinHandle<()>);

impl Drop for Discovery {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Connect with the kubeconfig from `KUBECONFIG` (or `~/.kube/config`), else the pod's service
/// account, and start watching. The cluster calls itself ready only after the first full list
/// has been reconciled ([`crate::cluster::Cluster::discovery_synced`]).
pub async fn start(
    settings: &K8sDiscovery,
    executor: Executor,
) -> Result<Discovery, DiscoveryError> {
    let config = kube::Config::infer().await?;
    let client = Client::try_from(config)?;
    let pods: Api<Pod> = match &settings.namespace {
        Some(ns) => Api::namespaced(client, ns),
        None => Api::default_namespaced(client),
    };
    tracing::info!(
        selector = %settings.selector,
        namespace = settings.namespace.as_deref().unwrap_or("(default)"),
        resync = ?settings.resync,
        "discovering engine pods"
    );
    Ok(Discovery(tokio::spawn(run(
        pods,
        settings.clone(),
        executor,
    ))))
}

/// Most watch events folded into one reconcile pass.
const BATCH: usize = 256;

async fn run(pods: Api<Pod>, settings: K8sDiscovery, executor: Executor) {
    let cluster = Arc::clone(executor.cluster());
    let (store, mut writer) = reflector::store::<Pod>();
    // The whole selector in one parameter: the API server filters, never the router.
    let config = watcher::Config::default().labels(&settings.selector);
    let mut applier = Applier::new(executor);
    let retired = applier.retired();
    let mut synced = false;
    loop {
        let events = watcher(pods.clone(), config.clone())
            .default_backoff()
            .ready_chunks(BATCH);
        tokio::pin!(events);
        // This watcher's own list is complete: only then may the next tick replace it (a
        // resync shorter than a list would otherwise never finish one).
        let mut listed = false;
        let mut relist = tokio::time::interval(settings.resync);
        relist.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        relist.reset();
        loop {
            tokio::select! {
                batch = events.next() => {
                    let Some(batch) = batch else { break };
                    for event in batch {
                        match event {
                            Ok(event) => {
                                listed |= matches!(event, watcher::Event::InitDone);
                                writer.apply_watcher_event(&event);
                            }
                            Err(e) => tracing::warn!(error = %e, "pod watch failed; retrying"),
                        }
                    }
                }
                () = retired.notified() => {}
                _ = relist.tick() => {
                    if listed {
                        let wanted = desired(&store, &mut applier);
                        applier.reconcile(&wanted);
                        break;
                    }
                }
            }
            // Until the first list is complete the store is empty, not the truth.
            synced |= listed;
            if synced {
                let wanted = desired(&store, &mut applier);
                applier.reconcile(&wanted);
                cluster.discovery_synced();
            }
        }
    }
}

/// The endpoints the stored pods describe; the others are reported to `applier`'s log.
fn desired(store: &Store<Pod>, applier: &mut Applier) -> Desired {
    let mut desired = Desired::new();
    let mut listed = BTreeSet::new();
    for pod in store.state() {
        let Some(uid) = pod.metadata.uid.as_deref().map(Arc::<str>::from) else {
            continue;
        };
        listed.insert(Arc::clone(&uid));
        match pod::endpoint(&pod) {
            Ok((uid, spec)) => {
                desired.insert(uid, spec);
            }
            Err(skip) => {
                let name = pod.metadata.name.as_deref().unwrap_or("?");
                applier.skipped(uid, name, &skip);
            }
        }
    }
    applier.forget_all_but(&listed);
    desired
}
