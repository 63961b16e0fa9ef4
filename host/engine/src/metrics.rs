//! The engine's Prometheus metrics: gauges the step loop sets after every step, counters it and
//! the HTTP handlers bump. Cloning shares the underlying atomics.

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

#[derive(Debug, Clone, Default)]
pub struct Metrics {
    pub running: Gauge,
    pub waiting: Gauge,
    pub reservations: Gauge,
    pub kv_pages_used: Gauge,
    pub kv_pages_free: Gauge,
    pub kv_pages_cached: Gauge,
    pub preemptions: Counter,
    pub prompt_tokens: Counter,
    pub generated_tokens: Counter,
    pub prefix_matched_tokens: Counter,
    pub remote_send_received: Counter,
    pub reservations_expired: Counter,
    pub requests_aborted: Counter,
    pub calls_received: Counter,
    pub injected_failures: Counter,
}

impl Metrics {
    /// Renders every metric in the Prometheus text format.
    pub fn render(&self) -> String {
        let mut registry = Registry::with_prefix("switchyard_engine");
        let gauges = [
            (
                "running_requests",
                "Requests in the running batch",
                &self.running,
            ),
            (
                "waiting_requests",
                "Requests waiting for KV pages (including blocked prep_recv)",
                &self.waiting,
            ),
            (
                "reservations",
                "prep_recv reservations awaiting start_generate",
                &self.reservations,
            ),
            (
                "kv_pages_used",
                "KV pages referenced by a request",
                &self.kv_pages_used,
            ),
            (
                "kv_pages_free",
                "KV pages an allocation can take (free or idle-cached)",
                &self.kv_pages_free,
            ),
            (
                "kv_pages_cached",
                "Idle KV pages kept by the prefix cache",
                &self.kv_pages_cached,
            ),
        ];
        for (name, help, gauge) in gauges {
            registry.register(name, help, gauge.clone());
        }
        let counters = [
            (
                "preemptions",
                "Requests aborted with finish_reason preempt",
                &self.preemptions,
            ),
            (
                "prompt_tokens",
                "Prompt tokens of admitted requests",
                &self.prompt_tokens,
            ),
            (
                "generated_tokens",
                "Tokens generated",
                &self.generated_tokens,
            ),
            (
                "prefix_matched_tokens",
                "Prompt tokens served from the prefix cache",
                &self.prefix_matched_tokens,
            ),
            (
                "remote_send_received",
                "remote_send calls received",
                &self.remote_send_received,
            ),
            (
                "reservations_expired",
                "prep_recv reservations freed after their TTL",
                &self.reservations_expired,
            ),
            (
                "requests_aborted",
                "Requests aborted because the client went away",
                &self.requests_aborted,
            ),
            (
                "calls_received",
                "POST calls received (completions and microserving), failed ones included",
                &self.calls_received,
            ),
            (
                "injected_failures",
                "Calls answered 500 by --fail-rate",
                &self.injected_failures,
            ),
        ];
        for (name, help, counter) in counters {
            registry.register(name, help, counter.clone());
        }
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &registry);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The router reads these gauges by the names the wire crate gives them.
    #[test]
    fn exports_the_gauges_a_router_reads() {
        let m = Metrics::default();
        m.kv_pages_used.set(3);
        m.kv_pages_free.set(9);
        m.running.set(2);
        m.waiting.set(1);
        let load = switchyard_wire::metrics::EngineLoad::from_prometheus(&m.render());
        assert_eq!(load.running, Some(2));
        assert_eq!(load.waiting, Some(1));
        assert_eq!(load.kv_usage, Some(0.25));
    }

    #[test]
    fn renders_prometheus_text() {
        let m = Metrics::default();
        m.kv_pages_free.set(12);
        m.preemptions.inc();
        let text = m.render();
        assert!(
            text.contains("switchyard_engine_kv_pages_free 12"),
            "{text}"
        );
        assert!(
            text.contains("switchyard_engine_preemptions_total 1"),
            "{text}"
        );
        assert!(text.ends_with("# EOF\n"));
    }
}
