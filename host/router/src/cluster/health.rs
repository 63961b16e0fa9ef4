//! Background readiness probes (`GET /v1/models` == 200, as MLC's router checks; the ids it
//! lists are the models the endpoint serves), and the engines' KV usage for the policy
//! snapshot. Probe answers are read up to a cap. Why a probe failed is kept for
//! `/admin/endpoints` (a TLS failure named as one) and logged when it changes.
//!
//! A healthy endpoint is probed every `interval`; an unhealthy one with exponential backoff
//! from `min_backoff` to `max_backoff`, so a restarted engine comes back quickly without a
//! dead one being hammered. Calls that fail to connect mark an endpoint unhealthy at once
//! (`Cluster::mark_unhealthy`); only a probe marks it healthy again.
//!
//! The engine's own load rides on the same probe: a ready endpoint's `GET /metrics` is read
//! for the requests it runs and queues and its KV usage (the reference engine's, vLLM's or
//! SGLang's gauges: `switchyard_wire::metrics::EngineLoad`). That is one small GET per
//! endpoint per probe interval, off the request path, and every router replica reads the
//! same figures. The same read watches for a restart: a ready endpoint whose probe fails, or
//! whose `process_start_time_seconds` changes, has its KV event index cleared and rebuilt (a
//! new engine process holds a cold cache, and the protocol has no epoch to say so). An engine
//! whose metrics lack those gauges (an MLC engine's `/metrics`
//! reports other names) or that is down reports `None`: policies must treat load as
//! optional, and a stale number is worse than none.

use std::sync::{Arc, Weak};
use std::time::Duration;

use switchyard_wire::metrics::{EngineLoad, process_start_time};

use super::Cluster;
use crate::engine_client::EngineClient;
use crate::kv_events::ResyncReason;

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

/// What the probes saw of the engine's process, to tell when it may have restarted.
#[derive(Debug, Default)]
struct Process {
    ready: bool,
    /// The last `process_start_time_seconds` it reported.
    started: Option<f64>,
}

impl Process {
    /// Records a probe (`ready`, and the start time its metrics gave); whether the engine may
    /// have restarted since the last one: a ready engine stopped answering, or it reports
    /// another start time (a restart quicker than a probe interval shows only there).
    fn probed(&mut self, ready: bool, started: Option<f64>) -> bool {
        let lost = self.ready && !ready;
        let new_process = matches!(
            (self.started, started),
            (Some(before), Some(now)) if before != now
        );
        self.ready = ready;
        self.started = started.or(self.started);
        lost || new_process
    }
}

async fn probe_loop(cluster: Weak<Cluster>, client: EngineClient, config: ProbeConfig, id: u32) {
    let mut backoff = config.min_backoff;
    let mut process = Process::default();
    loop {
        let Some(endpoint) = cluster.upgrade().and_then(|c| c.endpoint(id)) else {
            return;
        };
        if endpoint.is_removed() {
            return;
        }
        let (engine, protocol) = (endpoint.upstream.clone(), endpoint.protocol);
        drop(endpoint);
        let models = client.ready(&engine, protocol).await;
        let ok = models.is_ok();
        let metrics = match ok {
            true => client.metrics(&engine).await,
            false => None,
        };
        let load = metrics.as_deref().map(EngineLoad::from_prometheus);
        let now_started = metrics.as_deref().and_then(process_start_time);
        let Some(c) = cluster.upgrade() else { return };
        if process.probed(ok, now_started) {
            c.resync_kv_events(id, ResyncReason::EngineRestarted);
        }
        // Models and load first: a request held for readiness (scale from zero) is released
        // by `set_health` and then asks which models are served.
        c.set_probe_error(id, models.as_ref().err());
        if let Ok(models) = models {
            c.set_models(id, models);
        }
        c.set_engine_load(id, load.unwrap_or_default());
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

#[cfg(test)]
mod tests {
    use super::Process;

    #[test]
    fn a_lost_engine_or_a_new_start_time_may_be_a_restart() {
        let mut process = Process::default();
        assert!(!process.probed(false, None), "never ready yet");
        assert!(!process.probed(true, Some(100.0)), "first seen");
        assert!(!process.probed(true, Some(100.0)), "the same process");
        assert!(
            process.probed(true, Some(250.0)),
            "restarted between two probes"
        );
        assert!(
            !process.probed(true, None),
            "metrics without the gauge say nothing"
        );
        assert!(
            process.probed(false, None),
            "a ready engine stopped answering"
        );
        assert!(
            !process.probed(false, None),
            "still down: one resync is enough"
        );
        assert!(
            process.probed(true, Some(300.0)),
            "back as a new process: rebuild again"
        );
        assert!(!process.probed(true, Some(300.0)));
    }
}
