//! Endpoint discovery: engines found while the router serves, fed into the live endpoint list
//! through the same calls `/admin/endpoints` makes, each owned by its source (`k8s:<pod uid>`).
//!
//! ```text
//! k8s::start(settings, Executor) -> Discovery    watch pods, reconcile on every event batch and tick
//! pod::endpoint(&Pod) -> Result<(uid, EndpointSpec), Skip>   which pods are endpoints, and how
//! reconcile(&desired, &current) -> Vec<Action>   what to add and what to retire, level-triggered
//! ```
//!
//! Reconciliation compares the whole desired set with the whole current list every time,
//! never a single event with the last one, so a lost delete, a stale watch or a relabelled pod
//! converges on the next pass. It only ever retires what discovery added: endpoints from the
//! command line, the config file or the admin API are left alone.

mod k8s;
mod pod;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use tokio::sync::Notify;

use crate::cluster::{EndpointError, EndpointSpec, OwnedEndpoint, Owner};
use crate::plan::Executor;

pub use k8s::{Discovery, DiscoveryError, start};
pub use pod::{Skip, endpoint};

/// Pod uid → the endpoint it should be.
pub type Desired = BTreeMap<Arc<str>, EndpointSpec>;

/// One change to the live list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Drain endpoint `id`, then remove it once nothing is in flight on it.
    Retire { id: u32 },
    /// Add the endpoint of pod `uid` (boxed: a spec is large beside a retirement).
    Add {
        uid: Arc<str>,
        spec: Box<EndpointSpec>,
    },
}

/// What turns the discovered endpoints in `current` (serving or draining) into `desired`:
/// an endpoint whose pod is gone, or whose pod now describes another endpoint (a new port,
/// role, GPU count or rank), is retired; a pod without a serving endpoint is added. Retires
/// come first, so that a pod replaced at the same address can be added once the old endpoint
/// is gone (adding a URL that is still listed is refused until then).
pub fn reconcile(desired: &Desired, current: &[OwnedEndpoint]) -> Vec<Action> {
    let mut actions = Vec::new();
    let mut serving = BTreeSet::new();
    for e in current.iter().filter(|e| !e.draining) {
        let Owner::Pod(uid) = &e.owner else { continue };
        if desired.get(uid) == Some(&e.spec) && serving.insert(Arc::clone(uid)) {
            continue;
        }
        actions.push(Action::Retire { id: e.id });
    }
    for (uid, spec) in desired {
        if !serving.contains(uid) {
            actions.push(Action::Add {
                uid: Arc::clone(uid),
                spec: Box::new(spec.clone()),
            });
        }
    }
    actions
}

/// Applies [`Action`]s to the live list and remembers what it last said about each pod, so a
/// pod that stays unready or misconfigured is logged once, not on every pass.
pub(crate) struct Applier {
    executor: Executor,
    /// Woken when a retired endpoint is removed: its URL is free for a replacement.
    retired: Arc<Notify>,
    said: HashMap<Arc<str>, String>,
}

impl Applier {
    pub(crate) fn new(executor: Executor) -> Self {
        Applier {
            executor,
            retired: Arc::new(Notify::new()),
            said: HashMap::new(),
        }
    }

    pub(crate) fn retired(&self) -> Arc<Notify> {
        Arc::clone(&self.retired)
    }

    /// Bring the discovered endpoints in line with `desired`.
    pub(crate) fn reconcile(&mut self, desired: &Desired) {
        let cluster = self.executor.cluster();
        let current = cluster.owned_where(Owner::is_pod);
        for action in reconcile(desired, &current) {
            match action {
                Action::Retire { id } => self.retire(id),
                Action::Add { uid, spec } => self.add(uid, &spec),
            }
        }
    }

    /// Forget what was said about pods no longer listed.
    pub(crate) fn forget_all_but(&mut self, listed: &BTreeSet<Arc<str>>) {
        self.said.retain(|uid, _| listed.contains(uid));
    }

    fn retire(&self, id: u32) {
        let cluster = Arc::clone(self.executor.cluster());
        if cluster.drain(id).is_err() {
            return;
        }
        tracing::info!(
            endpoint = id,
            "its pod is gone, unready or changed: draining it"
        );
        let retired = Arc::clone(&self.retired);
        tokio::spawn(async move {
            cluster.remove_when_idle(id).await;
            retired.notify_one();
        });
    }

    fn add(&mut self, uid: Arc<str>, spec: &EndpointSpec) {
        match self
            .executor
            .add_endpoint(spec, Owner::Pod(Arc::clone(&uid)))
        {
            Ok(_) => {
                self.said.remove(&uid);
            }
            // The endpoint of the pod it replaces is still draining at this address; the pass
            // after its removal adds it.
            Err(EndpointError::Duplicate { .. }) if self.duplicate_is_draining(spec) => {}
            Err(e) => self.say(&uid, format!("not added: {e}"), true),
        }
    }

    fn duplicate_is_draining(&self, spec: &EndpointSpec) -> bool {
        self.executor
            .cluster()
            .owned_where(Owner::is_pod)
            .iter()
            .any(|e| e.draining && e.spec.url == spec.url)
    }

    /// Why pod `uid` is not an endpoint, logged when it changes.
    pub(crate) fn skipped(&mut self, uid: Arc<str>, name: &str, skip: &Skip) {
        self.say(&uid, format!("pod {name}: {skip}"), skip.is_misconfigured());
    }

    fn say(&mut self, uid: &Arc<str>, what: String, warn: bool) {
        if self.said.get(uid) == Some(&what) {
            return;
        }
        if warn {
            tracing::warn!(pod_uid = %uid, "{what}");
        } else {
            tracing::info!(pod_uid = %uid, "{what}");
        }
        self.said.insert(Arc::clone(uid), what);
    }
}

#[cfg(test)]
mod tests {
    use switchyard_contract::Role;

    use super::*;

    fn spec(port: u16, role: Role) -> EndpointSpec {
        EndpointSpec {
            role,
            ..EndpointSpec::new(format!("http://10.0.0.1:{port}"))
        }
    }

    fn owned(id: u32, owner: Owner, spec: EndpointSpec, draining: bool) -> OwnedEndpoint {
        OwnedEndpoint {
            id,
            owner,
            spec,
            draining,
        }
    }

    fn pod(uid: &str) -> Owner {
        Owner::Pod(uid.into())
    }

    fn desired(pods: &[(&str, EndpointSpec)]) -> Desired {
        pods.iter()
            .map(|(uid, spec)| (Arc::from(*uid), spec.clone()))
            .collect()
    }

    #[test]
    fn new_pods_are_added_and_gone_ones_retired() {
        let current = [
            owned(0, pod("a"), spec(1, Role::Any), false),
            owned(1, pod("gone"), spec(2, Role::Any), false),
        ];
        let actions = reconcile(
            &desired(&[("a", spec(1, Role::Any)), ("b", spec(3, Role::Decode))]),
            &current,
        );
        assert_eq!(
            actions,
            [
                Action::Retire { id: 1 },
                Action::Add {
                    uid: "b".into(),
                    spec: Box::new(spec(3, Role::Decode))
                }
            ]
        );
        assert_eq!(
            reconcile(&desired(&[("a", spec(1, Role::Any))]), &current[..1]),
            [],
            "nothing to do when the list is what the pods say"
        );
    }

    #[test]
    fn a_changed_pod_is_retired_and_added_again() {
        // An annotation moved the role: the old endpoint drains, the new one is added.
        let current = [owned(4, pod("a"), spec(1, Role::Prefill), false)];
        let actions = reconcile(&desired(&[("a", spec(1, Role::Decode))]), &current);
        assert_eq!(
            actions,
            [
                Action::Retire { id: 4 },
                Action::Add {
                    uid: "a".into(),
                    spec: Box::new(spec(1, Role::Decode))
                }
            ]
        );
    }

    #[test]
    fn a_pod_replaced_at_the_same_address_is_a_new_endpoint() {
        let current = [owned(0, pod("old"), spec(1, Role::Any), false)];
        let actions = reconcile(&desired(&[("new", spec(1, Role::Any))]), &current);
        assert_eq!(
            actions,
            [
                Action::Retire { id: 0 },
                Action::Add {
                    uid: "new".into(),
                    spec: Box::new(spec(1, Role::Any))
                }
            ]
        );
    }

    #[test]
    fn only_discovered_serving_endpoints_are_touched() {
        let current = [
            owned(0, Owner::Static, spec(1, Role::Any), false),
            owned(1, Owner::Admin, spec(2, Role::Any), false),
            // Draining already: neither retired again nor counted as serving its pod.
            owned(2, pod("a"), spec(3, Role::Any), true),
        ];
        assert_eq!(
            reconcile(&desired(&[]), &current),
            [],
            "static and admin endpoints survive"
        );
        assert_eq!(
            reconcile(&desired(&[("a", spec(3, Role::Any))]), &current),
            [Action::Add {
                uid: "a".into(),
                spec: Box::new(spec(3, Role::Any))
            }]
        );
    }

    #[test]
    fn two_endpoints_of_one_pod_keep_one() {
        let current = [
            owned(0, pod("a"), spec(1, Role::Any), false),
            owned(1, pod("a"), spec(1, Role::Any), false),
        ];
        assert_eq!(
            reconcile(&desired(&[("a", spec(1, Role::Any))]), &current),
            [Action::Retire { id: 1 }]
        );
    }
}
