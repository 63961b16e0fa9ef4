//! Endpoints: roles, device ranks, health and load, and the snapshot given to policies.
//!
//! ```text
//! Cluster::new(Vec<EndpointSpec>)      ids in order, device ranks = prefix sums of GPUs (as MLC)
//!   snapshot() -> Vec<EndpointSnapshot>  what a policy sees, ordered by id
//!   in_flight(id) -> InFlight            RAII: counts a leg until dropped (error, cancel, done)
//!   mark_unhealthy(id) / set_health(id, ok) / set_kv_usage(id, usage)
//!   url(id) / device_rank(id) / is_ready()
//! health::spawn_probes(Arc<Cluster>, EngineClient, ProbeConfig)   background readiness + KV usage probes
//! ```

mod health;
mod inflight;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

pub use health::{ProbeConfig, spawn_probes};
pub use inflight::InFlight;
use switchyard_contract::{EndpointSnapshot, Role};

/// An endpoint as the operator configured it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct EndpointSpec {
    /// Base URL, e.g. `http://127.0.0.1:8081` (no trailing slash needed).
    pub url: String,
    #[serde(default)]
    pub role: Role,
    /// GPUs the engine owns; device ranks are the prefix sums of these.
    #[serde(default = "one")]
    pub num_gpus: u32,
}

fn one() -> u32 {
    1
}

/// The live state of one endpoint.
#[derive(Debug)]
pub(crate) struct EndpointState {
    id: u32,
    url: String,
    role: Role,
    device_rank: u32,
    healthy: AtomicBool,
    /// Set once the first readiness probe succeeded: `/health` stays 503 until every
    /// endpoint has been ready once.
    ever_ready: AtomicBool,
    in_flight: AtomicU32,
    /// The engine's KV pool usage as `f32` bits; [`NO_KV_USAGE`] when unknown.
    kv_usage: AtomicU32,
}

/// `kv_usage` bits meaning "unknown": a NaN, which no measured usage in `[0, 1]` can be.
const NO_KV_USAGE: u32 = u32::MAX;

impl EndpointState {
    fn kv_usage(&self) -> Option<f32> {
        let bits = self.kv_usage.load(Ordering::Acquire);
        (bits != NO_KV_USAGE).then(|| f32::from_bits(bits))
    }
}

/// Every endpoint the router routes to, by id.
#[derive(Debug)]
pub struct Cluster {
    endpoints: Vec<Arc<EndpointState>>,
}

/// The row `/admin/endpoints` shows for an endpoint.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct EndpointStatus {
    pub id: u32,
    pub url: String,
    pub role: Role,
    pub device_rank: u32,
    pub healthy: bool,
    pub in_flight: u32,
    pub kv_usage: Option<f32>,
}

impl Cluster {
    /// Endpoints start unhealthy until a probe (or [`Cluster::set_health`]) says otherwise.
    pub fn new(specs: Vec<EndpointSpec>) -> Self {
        let mut rank = 0u32;
        let endpoints = specs
            .into_iter()
            .enumerate()
            .map(|(id, spec)| {
                let device_rank = rank;
                rank = rank.saturating_add(spec.num_gpus);
                Arc::new(EndpointState {
                    id: id as u32,
                    url: spec.url.trim_end_matches('/').to_owned(),
                    role: spec.role,
                    device_rank,
                    healthy: AtomicBool::new(false),
                    ever_ready: AtomicBool::new(false),
                    in_flight: AtomicU32::new(0),
                    kv_usage: AtomicU32::new(NO_KV_USAGE),
                })
            })
            .collect();
        Cluster { endpoints }
    }

    pub fn len(&self) -> usize {
        self.endpoints.len()
    }

    pub fn is_empty(&self) -> bool {
        self.endpoints.is_empty()
    }

    /// What a policy sees, ordered by id.
    pub fn snapshot(&self) -> Vec<EndpointSnapshot> {
        self.endpoints
            .iter()
            .map(|e| EndpointSnapshot {
                id: e.id,
                role: e.role,
                device_rank: e.device_rank,
                healthy: e.healthy.load(Ordering::Acquire),
                in_flight: e.in_flight.load(Ordering::Acquire),
                kv_usage: e.kv_usage(),
            })
            .collect()
    }

    /// What `/admin/endpoints` shows.
    pub fn status(&self) -> Vec<EndpointStatus> {
        self.endpoints
            .iter()
            .map(|e| EndpointStatus {
                id: e.id,
                url: e.url.clone(),
                role: e.role,
                device_rank: e.device_rank,
                healthy: e.healthy.load(Ordering::Acquire),
                in_flight: e.in_flight.load(Ordering::Acquire),
                kv_usage: e.kv_usage(),
            })
            .collect()
    }

    /// The endpoint's base URL; `None` for an id out of range.
    pub fn url(&self, id: u32) -> Option<&str> {
        self.endpoint(id).map(|e| e.url.as_str())
    }

    pub fn device_rank(&self, id: u32) -> Option<u32> {
        self.endpoint(id).map(|e| e.device_rank)
    }

    /// Count one leg in flight on `id` until the guard drops. `None` for an id out of range.
    pub fn in_flight(&self, id: u32) -> Option<InFlight> {
        self.endpoint(id).map(|e| InFlight::new(e.clone()))
    }

    /// A call to the endpoint failed in a way that says it is down; the probe brings it back.
    pub fn mark_unhealthy(&self, id: u32) {
        if let Some(e) = self.endpoint(id)
            && e.healthy.swap(false, Ordering::AcqRel)
        {
            tracing::warn!(endpoint = id, url = %e.url, "endpoint marked unhealthy");
        }
    }

    pub fn set_health(&self, id: u32, healthy: bool) {
        if let Some(e) = self.endpoint(id) {
            let was = e.healthy.swap(healthy, Ordering::AcqRel);
            if healthy {
                e.ever_ready.store(true, Ordering::Release);
            }
            if was != healthy {
                tracing::info!(endpoint = id, url = %e.url, healthy, "endpoint health changed");
            }
        }
    }

    /// The share of the endpoint's KV pool in use, as its engine last reported it (`None`:
    /// unknown). Values are clamped to `[0, 1]`.
    pub fn set_kv_usage(&self, id: u32, usage: Option<f32>) {
        if let Some(e) = self.endpoint(id) {
            let bits = usage.map_or(NO_KV_USAGE, |u| u.clamp(0.0, 1.0).to_bits());
            e.kv_usage.store(bits, Ordering::Release);
        }
    }

    /// Every endpoint has been ready once and at least one is healthy now.
    pub fn is_ready(&self) -> bool {
        !self.endpoints.is_empty()
            && self
                .endpoints
                .iter()
                .all(|e| e.ever_ready.load(Ordering::Acquire))
            && self
                .endpoints
                .iter()
                .any(|e| e.healthy.load(Ordering::Acquire))
    }

    fn endpoint(&self, id: u32) -> Option<&Arc<EndpointState>> {
        self.endpoints.get(id as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(url: &str, num_gpus: u32) -> EndpointSpec {
        EndpointSpec {
            url: url.into(),
            role: Role::Any,
            num_gpus,
        }
    }

    #[test]
    fn device_ranks_are_prefix_sums_of_gpus() {
        let cluster = Cluster::new(vec![
            spec("http://a/", 4),
            spec("http://b", 2),
            spec("http://c", 1),
        ]);
        let ranks: Vec<_> = cluster.snapshot().iter().map(|e| e.device_rank).collect();
        assert_eq!(ranks, [0, 4, 6]);
        assert_eq!(cluster.url(0), Some("http://a"));
        assert_eq!(cluster.url(3), None);
    }

    #[test]
    fn in_flight_guards_count_until_dropped() {
        let cluster = Cluster::new(vec![spec("http://a", 1), spec("http://b", 1)]);
        let a = cluster.in_flight(1).expect("id in range");
        let b = cluster.in_flight(1).expect("id in range");
        assert_eq!(cluster.snapshot()[1].in_flight, 2);
        drop(a);
        assert_eq!(cluster.snapshot()[1].in_flight, 1);
        drop(b);
        assert_eq!(cluster.snapshot()[1].in_flight, 0);
        assert!(cluster.in_flight(2).is_none());
    }

    #[test]
    fn kv_usage_is_unknown_until_reported_and_clamped() {
        let cluster = Cluster::new(vec![spec("http://a", 1), spec("http://b", 1)]);
        assert_eq!(cluster.snapshot()[0].kv_usage, None);
        cluster.set_kv_usage(0, Some(0.25));
        cluster.set_kv_usage(1, Some(1.5));
        let usage: Vec<_> = cluster.snapshot().iter().map(|e| e.kv_usage).collect();
        assert_eq!(usage, [Some(0.25), Some(1.0)]);
        assert_eq!(cluster.status()[0].kv_usage, Some(0.25));
        cluster.set_kv_usage(0, None);
        assert_eq!(cluster.snapshot()[0].kv_usage, None);
    }

    #[test]
    fn ready_once_every_endpoint_answered_and_one_is_healthy() {
        let cluster = Cluster::new(vec![spec("http://a", 1), spec("http://b", 1)]);
        assert!(!cluster.is_ready());
        cluster.set_health(0, true);
        assert!(!cluster.is_ready());
        cluster.set_health(1, true);
        assert!(cluster.is_ready());
        cluster.mark_unhealthy(0);
        assert!(cluster.is_ready());
        assert!(!cluster.snapshot()[0].healthy);
        cluster.mark_unhealthy(1);
        assert!(!cluster.is_ready());
    }
}
