//! Engines found while serving: `--discovery k8s` and its flags, or the file's `[discovery]`.

use std::time::Duration;

use super::error::ConfigError;
use super::source::Source;
use super::table::{longer_than_zero, not_blank, settings};

/// Where endpoints are discovered while the router serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DiscoveryKind {
    /// Pods from the Kubernetes API.
    K8s,
}

/// `--discovery k8s`: which pods are engines, and how often they are listed afresh.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct K8sDiscovery {
    pub pods: PodSelection,
    /// `None`: the kubeconfig's default namespace (in a cluster: the router pod's).
    pub namespace: Option<String>,
    pub resync: Duration,
}

/// Which pods are engines.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PodSelection {
    /// A label selector, e.g. `app=engine,model=llama`; the port is the container port named
    /// `http` (or the pod's `switchyard.io/port`).
    Selector(String),
    /// The pods an `InferencePool` (`inference.networking.k8s.io/v1`) selects, by its name:
    /// its `spec.selector`, on its first `spec.targetPorts` port, both read again on every
    /// resync.
    InferencePool(String),
}

pub const DEFAULT_K8S_RESYNC: Duration = Duration::from_secs(30);

settings! {
    /// `switchyard serve`'s discovery flags; the file's `[discovery]` table has their keys.
    args DiscoveryArgs, keys DiscoveryKeys, resolved DiscoverySettings, table "discovery";

    /// Find engines while serving, beside any --endpoint: `k8s` watches the pods that match
    /// --k8s-selector through the Kubernetes API (kubeconfig from KUBECONFIG, else the pod's
    /// service account); needs a build with the `k8s` feature.
    #[arg(value_enum)]
    discovery: Option<DiscoveryKind> => DiscoveryKind {
        flag: "discovery",
        key: "kind",
    }
    /// With --discovery k8s: the label selector engine pods match, e.g. `app=engine,model=llama`
    /// (sent whole to the API server).
    #[arg(value_name = "LABELS")]
    k8s_selector: Option<String> => String {
        flag: "k8s-selector",
        key: "k8s_selector",
        check: not_blank,
    }
    /// With --discovery k8s: the InferencePool (`inference.networking.k8s.io/v1`) whose
    /// `spec.selector` picks the engine pods and whose first `spec.targetPorts` is their port,
    /// instead of --k8s-selector.
    #[arg(value_name = "NAME")]
    k8s_inference_pool: Option<String> => String {
        flag: "k8s-inference-pool",
        key: "k8s_inference_pool",
        check: not_blank,
    }
    /// With --discovery k8s: the namespace whose pods are watched [default: the kubeconfig's
    /// namespace, or the router pod's own].
    #[arg(value_name = "NS")]
    k8s_namespace: Option<String> => String {
        flag: "k8s-namespace",
        key: "k8s_namespace",
    }
    /// With --discovery k8s: how often the pods are listed afresh and reconciled, so a watch
    /// that lost events or went silent still converges [default: 30s].
    #[arg(value_parser = humantime::parse_duration)]
    k8s_resync: Option<Duration> => Duration {
        flag: "k8s-resync",
        key: "k8s_resync",
        default: DEFAULT_K8S_RESYNC,
        check: longer_than_zero,
    }
}

impl DiscoverySettings {
    /// The discovery asked for, if any, with its selector.
    pub(super) fn k8s(self) -> Result<Option<K8sDiscovery>, ConfigError> {
        let Some(kind) = self.discovery else {
            // The file's keys without a kind are not used; a flag without one is a mistake.
            let stray_flag = [
                self.k8s_selector.map(|s| s.source),
                self.k8s_inference_pool.map(|s| s.source),
                self.k8s_namespace.map(|s| s.source),
                Some(self.k8s_resync.source),
            ]
            .into_iter()
            .flatten()
            .find(|source| matches!(source, Source::Flag(_)));
            return match stray_flag {
                Some(flag) => Err(ConfigError::K8sWithoutDiscovery(flag)),
                None => Ok(None),
            };
        };
        if !cfg!(feature = "k8s") {
            return Err(ConfigError::DiscoveryNotBuilt(kind.source));
        }
        let pods = match (self.k8s_selector, self.k8s_inference_pool) {
            (Some(selector), None) => PodSelection::Selector(selector.value),
            (None, Some(pool)) => PodSelection::InferencePool(pool.value),
            (None, None) => return Err(ConfigError::NoSelector { kind: kind.source }),
            (Some(selector), Some(pool)) => {
                return Err(ConfigError::SelectorAndPool {
                    selector: selector.source,
                    pool: pool.source,
                });
            }
        };
        Ok(Some(K8sDiscovery {
            pods,
            namespace: self.k8s_namespace.map(|ns| ns.value),
            resync: self.k8s_resync.value,
        }))
    }
}

impl DiscoveryKeys {
    /// Whether the file asks for discovery (its endpoints may then be none).
    pub(super) fn kind_given(&self) -> bool {
        self.discovery.is_some()
    }
}
