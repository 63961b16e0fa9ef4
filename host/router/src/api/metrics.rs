//! Prometheus metrics for `/metrics`: requests by status, latency histograms, retries,
//! preemptions, remote_sends skipped, policy call latency, and per endpoint: legs in flight,
//! health (`1` healthy, `0` not ready, `-1` ejected, `-2` draining, `-3` removed) and
//! ejections.

use std::sync::atomic::Ordering;
use std::time::Duration;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use switchyard_contract::Health;

use crate::Summary;
use crate::cluster::Cluster;

type Labels = Vec<(&'static str, String)>;

/// Every metric the router exports.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    requests: Family<Labels, Counter>,
    ttft: Histogram,
    itl: Histogram,
    e2e: Histogram,
    policy_call: Histogram,
    retries: Counter,
    preemptions: Counter,
    remote_sends_skipped: Counter,
    in_flight: Family<Labels, Gauge>,
    health: Family<Labels, Gauge>,
    ejections: Family<Labels, Counter>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("switchyard");
        let requests = Family::<Labels, Counter>::default();
        let latency = || Histogram::new(exponential_buckets(0.0005, 2.0, 18));
        let (ttft, itl, e2e) = (latency(), latency(), latency());
        let policy_call = Histogram::new(exponential_buckets(0.000_001, 2.0, 20));
        let (retries, preemptions, remote_sends_skipped) =
            (Counter::default(), Counter::default(), Counter::default());
        let in_flight = Family::<Labels, Gauge>::default();
        let health = Family::<Labels, Gauge>::default();
        let ejections = Family::<Labels, Counter>::default();
        registry.register(
            "requests",
            "Client requests by route and HTTP status",
            requests.clone(),
        );
        registry.register("ttft_seconds", "Time to first token", ttft.clone());
        registry.register(
            "itl_seconds",
            "Time between two streamed text chunks",
            itl.clone(),
        );
        registry.register("e2e_seconds", "Arrival to end of response", e2e.clone());
        registry.register(
            "policy_call_seconds",
            "Duration of one translate-request call",
            policy_call.clone(),
        );
        registry.register(
            "retries",
            "Attempts started after an engine failure",
            retries.clone(),
        );
        registry.register(
            "preemptions",
            "Generations preempted by an engine and continued",
            preemptions.clone(),
        );
        registry.register("remote_sends_skipped", "remote_send steps skipped because the decode endpoint's prefix cache covered the window", remote_sends_skipped.clone());
        registry.register(
            "endpoint_in_flight",
            "Legs in flight per endpoint",
            in_flight.clone(),
        );
        registry.register(
            "endpoint_health",
            "1 healthy, 0 not ready (probe), -1 ejected after consecutive failures, -2 draining, -3 removed",
            health.clone(),
        );
        registry.register(
            "endpoint_ejections",
            "Outlier ejections per endpoint",
            ejections.clone(),
        );
        Metrics {
            registry,
            requests,
            ttft,
            itl,
            e2e,
            policy_call,
            retries,
            preemptions,
            remote_sends_skipped,
            in_flight,
            health,
            ejections,
        }
    }

    /// Count a response by route and status code.
    pub fn request(&self, route: &'static str, status: u16) {
        self.requests
            .get_or_create(&vec![
                ("route", route.to_owned()),
                ("status", status.to_string()),
            ])
            .inc();
    }

    pub fn inter_token(&self, gap: Duration) {
        self.itl.observe(gap.as_secs_f64());
    }

    /// Record what the router did for one finished request.
    pub fn finished(&self, summary: &Summary, e2e: Duration) {
        if let Some(ttft) = summary.ttft {
            self.ttft.observe(ttft.as_secs_f64());
        }
        self.e2e.observe(e2e.as_secs_f64());
        for call in &summary.policy_calls {
            self.policy_call.observe(call.as_secs_f64());
        }
        self.retries.inc_by(u64::from(summary.retries));
        self.preemptions.inc_by(u64::from(summary.preemptions));
        self.remote_sends_skipped
            .inc_by(u64::from(summary.remote_sends_skipped));
    }

    /// The Prometheus text exposition, with the endpoint gauges read from `cluster` now.
    pub fn render(&self, cluster: &Cluster) -> String {
        for endpoint in cluster.status() {
            let labels = vec![("endpoint", endpoint.id.to_string()), ("url", endpoint.url)];
            self.in_flight
                .get_or_create(&labels)
                .set(i64::from(endpoint.in_flight));
            self.health
                .get_or_create(&labels)
                .set(match endpoint.health {
                    Health::Healthy => 1,
                    Health::NotReady => 0,
                    Health::Ejected => -1,
                    Health::Draining => -2,
                    Health::Removed => -3,
                });
            // The cluster counts ejections (it decides them); this counter mirrors its count.
            self.ejections
                .get_or_create(&labels)
                .inner()
                .store(endpoint.outlier.ejections, Ordering::Relaxed);
        }
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}
