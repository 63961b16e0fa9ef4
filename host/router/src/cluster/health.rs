//! Background readiness probes (`GET /v1/models` == 200, as MLC's router checks; the ids it
//! lists are the models the endpoint serves), and the engines' KV usage for the policy
//! snapshot. Probe answers are read up to a cap.
//!
//! A healthy endpoint is probed every `interval`; an unhealthy one with exponential backoff
//! from `min_backoff` to `max_backoff`, so a restarted engine comes back quickly without a
//! dead one being hammered. Calls that fail to connect mark an endpoint unhealthy at once
//! (`Cluster::mark_unhealthy`); only a probe marks it healthy again.
//!
//! KV usage rides on the same probe: a ready endpoint's `GET /metrics` is read for the
//! reference engine's gauges `switchyard_engine_kv_pages_used` and `…_kv_pages_free`, and
//! `used / (used + free)` becomes the snapshot's `kv_usage`. That is one small GET per
//! endpoint per probe interval, off the request path. An engine whose metrics lack those
//! gauges (an MLC engine's `/metrics` reports other names) or that is down reports `None`:
//! policies must treat usage as optional, and a stale number is worse than none.

use std::sync::{Arc, Weak};
use std::time::Duration;

use switchyard_wire::metrics::{KV_PAGES_FREE, KV_PAGES_USED};

use super::Cluster;
use crate::microserving::EngineClient;

/// Probe timing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProbeConfig {
    pub interval: Duration,
    pub min_backoff: Duration,
    pub max_backoff: Duration,
}

impl Default for ProbeConfig {
    fn default() -> Self {
        ProbeConfig {
            interval: Duration::from_secs(2),
            min_backoff: Duration::from_millis(50),
            max_backoff: Duration::from_secs(2),
        }
    }
}

/// Start one probe task per endpoint. The tasks end when the cluster is dropped.
pub fn spawn_probes(cluster: &Arc<Cluster>, client: &EngineClient, config: ProbeConfig) {
    for id in 0..cluster.len() as u32 {
        spawn_probe(cluster, client, config, id);
    }
}

/// Start probing endpoint `id`, until it is removed or the cluster is dropped.
pub fn spawn_probe(cluster: &Arc<Cluster>, client: &EngineClient, config: ProbeConfig, id: u32) {
    tokio::spawn(probe_loop(
        Arc::downgrade(cluster),
        client.clone(),
        config,
        id,
    ));
}

async fn probe_loop(cluster: Weak<Cluster>, client: EngineClient, config: ProbeConfig, id: u32) {
    let mut backoff = config.min_backoff;
    loop {
        let Some(endpoint) = cluster.upgrade().and_then(|c| c.endpoint(id)) else {
            return;
        };
        if endpoint.is_removed() {
            return;
        }
        let url = endpoint.url.clone();
        drop(endpoint);
        let models = client.ready(&url).await;
        let ok = models.is_some();
        let kv_usage = if ok {
            client.metrics(&url).await.as_deref().and_then(kv_usage)
        } else {
            None
        };
        let Some(c) = cluster.upgrade() else { return };
        c.set_health(id, ok);
        c.set_kv_usage(id, kv_usage);
        if let Some(models) = models {
            c.set_models(id, models);
        }
        drop(c);
        let wait = if ok {
            backoff = config.min_backoff;
            config.interval
        } else {
            let wait = backoff;
            backoff = (backoff * 2).min(config.max_backoff);
            wait
        };
        tokio::time::sleep(wait).await;
    }
}

/// The share of the KV pool requests hold, from an engine's Prometheus text.
fn kv_usage(metrics: &str) -> Option<f32> {
    let used = gauge(metrics, KV_PAGES_USED)?;
    let free = gauge(metrics, KV_PAGES_FREE)?;
    let total = used + free;
    (total > 0.0).then(|| (used / total) as f32)
}

/// The value of an unlabelled sample `NAME VALUE` in Prometheus text.
fn gauge(metrics: &str, name: &str) -> Option<f64> {
    metrics.lines().find_map(|line| {
        let value = line.strip_prefix(name)?.strip_prefix(' ')?;
        value.trim().parse().ok()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_usage_reads_the_engine_gauges() {
        // As the reference engine renders them (its own test checks the names).
        let metrics = format!(
            "# TYPE {KV_PAGES_USED} gauge\n{KV_PAGES_USED} 3\n# TYPE {KV_PAGES_FREE} gauge\n\
             {KV_PAGES_FREE} 9\nswitchyard_engine_kv_pages_cached 5\n"
        );
        assert_eq!(kv_usage(&metrics), Some(0.25));
    }

    #[test]
    fn kv_usage_is_unknown_without_both_gauges_or_pages() {
        assert_eq!(kv_usage("switchyard_engine_kv_pages_used 3\n"), None);
        assert_eq!(kv_usage("vllm:gpu_cache_usage_perc 0.5\n"), None);
        let empty = "switchyard_engine_kv_pages_used 0\nswitchyard_engine_kv_pages_free 0\n";
        assert_eq!(kv_usage(empty), None);
    }
}
