//! The engine's Prometheus metrics: gauges the step loop sets after every step, counters it and
//! the HTTP handlers bump. Cloning shares the underlying atomics.

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
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
    /// vLLM and SGLang handoffs (`--protocol vllm|sglang`); exported only in those modes.
    pub pd: PdMetrics,
}

/// A request label set: `side` is `prefill` or `decode` (SGLang's two legs).
pub type SideLabels = Vec<(&'static str, &'static str)>;

/// The labels of one side.
pub fn side(side: &'static str) -> SideLabels {
    vec![("side", side)]
}

/// What the vLLM and SGLang handoffs did, so a test (or an operator) sees from outside that a
/// router drove them right: every lease pulled, every room transferred, nothing left pending,
/// no protocol violation.
#[derive(Debug, Clone, Default)]
pub struct PdMetrics {
    /// vLLM: prefill leases whose pages are held, waiting for a decode engine's pull.
    pub leases_held: Gauge,
    pub leases_issued: Counter,
    pub leases_pulled: Counter,
    pub leases_expired: Counter,
    /// Freed early by a decode leg cancelled before its pull (vLLM's empty-read notification).
    pub leases_released: Counter,
    /// Pulls that reached this prefill engine but whose push failed.
    pub pull_failures: Counter,
    /// Decode legs answered 500 because their KV could not be loaded (unknown, consumed or
    /// expired params, or a failed pull): vLLM's `kv_load_failure_policy=fail`.
    pub load_failures: Counter,
    /// Requests that broke the protocol's contract (see the specs' router checklists).
    pub protocol_violations: Counter,
    /// SGLang: legs waiting for their counterpart or their KV, per side.
    pub rooms_pending: Family<SideLabels, Gauge>,
    /// SGLang prefill: decode engines' registrations parked on this bootstrap server (their
    /// long poll waits for this engine's push).
    pub registrations: Gauge,
    pub rooms_transferred: Counter,
    pub orphans: Family<SideLabels, Counter>,
    pub cancelled: Family<SideLabels, Counter>,
    /// Rooms whose KV push from this prefill engine failed.
    pub transfer_failures: Counter,
}

impl Metrics {
    /// Renders every metric in the Prometheus text format.
    pub fn render(&self) -> String {
        self.render_as(Exported::Mlc)
    }

    /// Renders every metric for an engine speaking `exported`'s protocol: the engine's own
    /// metrics, plus, for vLLM and SGLang, the load gauges under the names that engine exports
    /// (a router reads them with `EngineLoad::from_prometheus`) and the handoff counters.
    pub fn render_as(&self, exported: Exported<'_>) -> String {
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
        match exported {
            Exported::Mlc => {}
            Exported::Vllm { .. } => self.pd.register_vllm(&mut registry),
            Exported::Sglang { .. } => self.pd.register_sglang(&mut registry),
        }
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &registry);
        let load = self.protocol_load(exported);
        if !load.is_empty() {
            // The registry prefixes every name; the foreign names go in by hand, before `# EOF`.
            let eof = out.rfind("# EOF").unwrap_or(out.len());
            out.insert_str(eof, &load);
        }
        out
    }

    /// vLLM's or SGLang's load gauges, as those engines name them, labelled with the model.
    fn protocol_load(&self, exported: Exported<'_>) -> String {
        let (names, model) = match exported {
            Exported::Mlc => return String::new(),
            Exported::Vllm { model } => (
                [
                    (
                        "vllm:num_requests_running",
                        "Requests in model execution batches",
                    ),
                    (
                        "vllm:num_requests_waiting",
                        "Requests waiting to be processed",
                    ),
                    (
                        "vllm:kv_cache_usage_perc",
                        "KV-cache usage; 1 means 100 percent",
                    ),
                ],
                model,
            ),
            Exported::Sglang { model } => (
                [
                    ("sglang:num_running_reqs", "The number of running requests"),
                    (
                        "sglang:num_queue_reqs",
                        "The number of requests in the waiting queue",
                    ),
                    ("sglang:token_usage", "The token usage of the KV cache"),
                ],
                model,
            ),
        };
        let used = self.kv_pages_used.get() as f64;
        let total = used + self.kv_pages_free.get() as f64;
        let usage = if total > 0.0 { used / total } else { 0.0 };
        let values = [
            self.running.get().to_string(),
            self.waiting.get().to_string(),
            usage.to_string(),
        ];
        let model = model.replace('\\', "\\\\").replace('"', "\\\"");
        let mut out = String::new();
        for ((name, help), value) in names.iter().zip(values) {
            out.push_str(&format!(
                "# HELP {name} {help}.\n# TYPE {name} gauge\n{name}{{model_name=\"{model}\"}} {value}\n"
            ));
        }
        out
    }
}

/// Which protocol's names `/metrics` exports besides the engine's own.
#[derive(Debug, Clone, Copy)]
pub enum Exported<'a> {
    Mlc,
    Vllm { model: &'a str },
    Sglang { model: &'a str },
}

impl PdMetrics {
    fn register_vllm(&self, registry: &mut Registry) {
        registry.register(
            "vllm_leases_held",
            "Prefill leases holding KV pages until a decode engine pulls them",
            self.leases_held.clone(),
        );
        let counters = [
            (
                "vllm_leases_issued",
                "Prefill leases issued (kv_transfer_params answered)",
                &self.leases_issued,
            ),
            (
                "vllm_leases_pulled",
                "Leases whose KV a decode engine pulled",
                &self.leases_pulled,
            ),
            (
                "vllm_leases_expired",
                "Leases freed by --kv-lease-ms without a pull (leaks)",
                &self.leases_expired,
            ),
            (
                "vllm_leases_released",
                "Leases freed early by a decode leg cancelled before its pull",
                &self.leases_released,
            ),
            (
                "vllm_pull_failures",
                "Pulls of a held lease whose KV push failed",
                &self.pull_failures,
            ),
            (
                "vllm_kv_load_failures",
                "Decode legs answered 500: KV not loadable (bad params, failed pull)",
                &self.load_failures,
            ),
            (
                "vllm_protocol_violations",
                "Requests that broke the vLLM P/D contract",
                &self.protocol_violations,
            ),
        ];
        for (name, help, counter) in counters {
            registry.register(name, help, counter.clone());
        }
    }

    fn register_sglang(&self, registry: &mut Registry) {
        // Both sides always appear, at 0 until used, so a reader can tell 0 from absent.
        for s in ["prefill", "decode"] {
            let _ = self.rooms_pending.get_or_create(&side(s));
            let _ = self.orphans.get_or_create(&side(s));
            let _ = self.cancelled.get_or_create(&side(s));
        }
        registry.register(
            "sglang_rooms_pending",
            "Bootstrap rooms whose leg waits for its counterpart or its KV, per side",
            self.rooms_pending.clone(),
        );
        registry.register(
            "sglang_registrations",
            "Decode registrations waiting on this bootstrap server for the prefill's push",
            self.registrations.clone(),
        );
        registry.register(
            "sglang_rooms_transferred",
            "Rooms whose KV the prefill pushed into the decode engine",
            self.rooms_transferred.clone(),
        );
        registry.register(
            "sglang_orphans",
            "Legs whose counterpart never came within --bootstrap-timeout-ms, per side",
            self.orphans.clone(),
        );
        registry.register(
            "sglang_cancelled",
            "Legs cancelled by their connection closing, per side",
            self.cancelled.clone(),
        );
        registry.register(
            "sglang_transfer_failures",
            "Rooms whose KV push from this prefill engine failed",
            self.transfer_failures.clone(),
        );
        registry.register(
            "sglang_protocol_violations",
            "Requests that broke the SGLang P/D contract",
            self.protocol_violations.clone(),
        );
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
