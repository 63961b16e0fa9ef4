//! The only part that talks to Kubernetes: one watch of the pods matching the selector, kept in
//! a reflector store, and the live list reconciled with the whole store on every batch of
//! events and on every resync tick.
//!
//! With `--k8s-inference-pool`, the selector and the port are the `InferencePool`'s
//! (`inference.networking.k8s.io/v1`: `spec.selector.matchLabels`, the first
//! `spec.targetPorts`), read before each watch starts: a pool edited to select other pods or
//! another port converges within one resync. A pool that cannot be read keeps the last one
//! read (none yet: no watch until it can be).
//!
//! Each tick also starts the watch afresh, which lists the pods before it watches again: a
//! watch that went silent, or lost a delete (a force-deleted pod, a 410 Gone, a relabelled pod
//! whose event never came), converges within one `--k8s-resync`. The store keeps answering
//! with the previous list until the new one is complete, so a re-list never empties it.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt as _;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{ApiResource, DynamicObject};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt as _, watcher};
use kube::{Api, Client};
use serde_json::Value;
use tokio::task::JoinHandle;

use super::{Applier, Desired, pod};
use crate::config::{K8sDiscovery, PodSelection};
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
    let namespace = settings.namespace.as_deref();
    let pods: Api<Pod> = match namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::default_namespaced(client.clone()),
    };
    let source = match &settings.pods {
        PodSelection::Selector(labels) => Source::Selector(Selection {
            labels: labels.clone(),
            port: None,
        }),
        PodSelection::InferencePool(name) => {
            let resource = ApiResource {
                group: POOL_GROUP.into(),
                version: POOL_VERSION.into(),
                api_version: format!("{POOL_GROUP}/{POOL_VERSION}"),
                kind: "InferencePool".into(),
                plural: "inferencepools".into(),
            };
            let pools = match namespace {
                Some(ns) => Api::namespaced_with(client, ns, &resource),
                None => Api::default_namespaced_with(client, &resource),
            };
            Source::Pool {
                pools: Box::new(pools),
                name: name.clone(),
            }
        }
    };
    tracing::info!(
        pods = ?settings.pods,
        namespace = namespace.unwrap_or("(default)"),
        resync = ?settings.resync,
        "discovering engine pods"
    );
    Ok(Discovery(tokio::spawn(run(
        pods,
        source,
        settings.resync,
        executor,
    ))))
}

/// The InferencePool's API group and version.
pub const POOL_GROUP: &str = "inference.networking.k8s.io";
pub const POOL_VERSION: &str = "v1";

/// Where the pods to watch are named.
enum Source {
    Selector(Selection),
    /// Read again before every watch.
    Pool {
        pools: Box<Api<DynamicObject>>,
        name: String,
    },
}

/// The pods to watch, and the port they serve on when it is not theirs to say.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Selection {
    /// A label selector, sent whole.
    pub labels: String,
    /// An InferencePool's target port.
    pub port: Option<u16>,
}

/// Why an InferencePool gives no selection.
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    #[error("cannot read the InferencePool: {0}")]
    Get(#[from] kube::Error),
    #[error("the InferencePool has no spec.selector.matchLabels")]
    NoSelector,
    #[error("the InferencePool's spec.selector.matchLabels has a value that is not a string")]
    BadSelector,
    #[error("the InferencePool has no spec.targetPorts[0].number in 1..=65535")]
    NoPort,
}

impl Source {
    async fn read(&self) -> Result<Selection, PoolError> {
        match self {
            Source::Selector(selection) => Ok(selection.clone()),
            Source::Pool { pools, name } => pool_selection(&pools.get(name).await?.data),
        }
    }
}

/// The selector and port of an InferencePool object (`spec.selector.matchLabels`, sorted, as
/// `k=v,…`; the first `spec.targetPorts[].number`).
pub fn pool_selection(pool: &Value) -> Result<Selection, PoolError> {
    let spec = &pool["spec"];
    let labels = spec["selector"]["matchLabels"]
        .as_object()
        .filter(|labels| !labels.is_empty())
        .ok_or(PoolError::NoSelector)?;
    let labels = labels
        .iter()
        .map(|(key, value)| Some(format!("{key}={}", value.as_str()?)))
        .collect::<Option<Vec<_>>>()
        .ok_or(PoolError::BadSelector)?
        .join(",");
    let port = spec["targetPorts"][0]["number"]
        .as_u64()
        .and_then(|port| u16::try_from(port).ok())
        .filter(|&port| port > 0)
        .ok_or(PoolError::NoPort)?;
    Ok(Selection {
        labels,
        port: Some(port),
    })
}

/// Most watch events folded into one reconcile pass.
const BATCH: usize = 256;

async fn run(pods: Api<Pod>, source: Source, resync: Duration, executor: Executor) {
    let cluster = Arc::clone(executor.cluster());
    let (store, mut writer) = reflector::store::<Pod>();
    let mut applier = Applier::new(executor);
    let retired = applier.retired();
    let mut synced = false;
    let mut selection = None;
    loop {
        match source.read().await {
            Ok(read) => selection = Some(read),
            Err(e) => {
                tracing::warn!(error = %e, "InferencePool not read; retrying at the next resync")
            }
        }
        let Some(Selection { labels, port }) = selection.clone() else {
            tokio::time::sleep(resync).await;
            continue;
        };
        // The whole selector in one parameter: the API server filters, never the router.
        let config = watcher::Config::default().labels(&labels);
        let events = watcher(pods.clone(), config.clone())
            .default_backoff()
            .ready_chunks(BATCH);
        tokio::pin!(events);
        // This watcher's own list is complete: only then may the next tick replace it (a
        // resync shorter than a list would otherwise never finish one).
        let mut listed = false;
        let mut relist = tokio::time::interval(resync);
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
                        let wanted = desired(&store, &mut applier, port);
                        applier.reconcile(&wanted);
                        break;
                    }
                }
            }
            // Until the first list is complete the store is empty, not the truth.
            synced |= listed;
            if synced {
                let wanted = desired(&store, &mut applier, port);
                applier.reconcile(&wanted);
                cluster.discovery_synced();
            }
        }
    }
}

/// The endpoints the stored pods describe (on `port`, an InferencePool's, when given); the
/// others are reported to `applier`'s log.
fn desired(store: &Store<Pod>, applier: &mut Applier, port: Option<u16>) -> Desired {
    let mut desired = Desired::new();
    let mut listed = BTreeSet::new();
    for pod in store.state() {
        let Some(uid) = pod.metadata.uid.as_deref().map(Arc::<str>::from) else {
            continue;
        };
        listed.insert(Arc::clone(&uid));
        match pod::endpoint(&pod, port) {
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

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn an_inference_pool_gives_its_selector_and_first_target_port() {
        let pool = json!({
            "apiVersion": "inference.networking.k8s.io/v1",
            "kind": "InferencePool",
            "spec": {
                "selector": {"matchLabels": {"tier": "serve", "app": "engine"}},
                "targetPorts": [{"number": 8000}, {"number": 8001}],
                "endpointPickerRef": {"name": "epp", "port": {"number": 9002}},
            },
        });
        let selection = pool_selection(&pool).expect("a selection");
        assert_eq!(
            selection,
            Selection {
                labels: "app=engine,tier=serve".into(),
                port: Some(8000)
            }
        );
    }

    #[test]
    fn a_pool_without_labels_or_port_gives_none() {
        let with = |spec: Value| pool_selection(&json!({ "spec": spec }));
        assert!(matches!(
            with(json!({"targetPorts": [{"number": 8000}]})),
            Err(PoolError::NoSelector)
        ));
        assert!(matches!(
            with(json!({"selector": {"matchLabels": {}}, "targetPorts": [{"number": 8000}]})),
            Err(PoolError::NoSelector)
        ));
        assert!(matches!(
            with(
                json!({"selector": {"matchLabels": {"app": 1}}, "targetPorts": [{"number": 8000}]})
            ),
            Err(PoolError::BadSelector)
        ));
        for ports in [
            json!([]),
            json!([{"number": 0}]),
            json!([{"number": 70000}]),
        ] {
            assert!(matches!(
                with(json!({"selector": {"matchLabels": {"app": "engine"}}, "targetPorts": ports})),
                Err(PoolError::NoPort)
            ));
        }
    }
}
