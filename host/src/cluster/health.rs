//! Background readiness probes (`GET /v1/models` == 200, as MLC's router checks).
//!
//! A healthy endpoint is probed every `interval`; an unhealthy one with exponential backoff
//! from `min_backoff` to `max_backoff`, so a restarted engine comes back quickly without a
//! dead one being hammered. Calls that fail to connect mark an endpoint unhealthy at once
//! (`Cluster::mark_unhealthy`); only a probe marks it healthy again.

use std::sync::{Arc, Weak};
use std::time::Duration;

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
pub fn spawn_probes(cluster: &Arc<Cluster>, client: EngineClient, config: ProbeConfig) {
    for id in 0..cluster.len() as u32 {
        tokio::spawn(probe_loop(
            Arc::downgrade(cluster),
            client.clone(),
            config,
            id,
        ));
    }
}

async fn probe_loop(cluster: Weak<Cluster>, client: EngineClient, config: ProbeConfig, id: u32) {
    let mut backoff = config.min_backoff;
    loop {
        let Some(url) = cluster.upgrade().and_then(|c| c.url(id).map(str::to_owned)) else {
            return;
        };
        let ok = client.ready(&url).await;
        let Some(c) = cluster.upgrade() else { return };
        c.set_health(id, ok);
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
