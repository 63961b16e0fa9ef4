//! The registry's Prometheus metrics, appended to the router's `/metrics`: reloads by result,
//! reload latency, per-policy call time, quarantines and fallbacks.

use std::time::Duration;

use prometheus_client::encoding::text::{encode_eof, encode_registry};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use super::slot::ReloadResult;

type Labels = Vec<(&'static str, String)>;

/// The OpenMetrics terminator the router's own exposition ends with.
const EOF_LINE: &str = "# EOF\n";

#[derive(Debug)]
pub(crate) struct PolicyMetrics {
    registry: Registry,
    reloads: Family<Labels, Counter>,
    reload_seconds: Histogram,
    call_seconds: Family<Labels, Histogram>,
    quarantines: Family<Labels, Counter>,
    fallbacks: Family<Labels, Counter>,
}

impl PolicyMetrics {
    pub(crate) fn new() -> Self {
        let mut registry = Registry::with_prefix("switchyard_policy");
        let reloads = Family::<Labels, Counter>::default();
        let reload_seconds = Histogram::new(exponential_buckets(0.001, 2.0, 14));
        let call_seconds = Family::<Labels, Histogram>::new_with_constructor(
            (|| Histogram::new(exponential_buckets(0.000_001, 2.0, 20))) as fn() -> Histogram,
        );
        let quarantines = Family::<Labels, Counter>::default();
        let fallbacks = Family::<Labels, Counter>::default();
        registry.register(
            "reloads",
            "Policy reload attempts by policy and result (swapped, unchanged, failed)",
            reloads.clone(),
        );
        registry.register(
            "reload_seconds",
            "File change (or admin request) to the new version serving",
            reload_seconds.clone(),
        );
        registry.register(
            "call_seconds",
            "Duration of one translate-request call, by policy",
            call_seconds.clone(),
        );
        registry.register(
            "quarantines",
            "Policy versions put in quarantine after repeated faults",
            quarantines.clone(),
        );
        registry.register(
            "fallbacks",
            "Attempts planned by the fallback policy instead of the selected one, by selected policy",
            fallbacks.clone(),
        );
        PolicyMetrics {
            registry,
            reloads,
            reload_seconds,
            call_seconds,
            quarantines,
            fallbacks,
        }
    }

    pub(crate) fn reload(&self, policy: &str, result: ReloadResult, took: Duration) {
        let result = match result {
            ReloadResult::Swapped => "swapped",
            ReloadResult::Unchanged => "unchanged",
            ReloadResult::Failed => "failed",
        };
        self.reloads
            .get_or_create(&vec![
                ("policy", policy.to_owned()),
                ("result", result.to_owned()),
            ])
            .inc();
        if result == "swapped" {
            self.reload_seconds.observe(took.as_secs_f64());
        }
    }

    pub(crate) fn call(&self, policy: &str, took: Duration) {
        self.call_seconds
            .get_or_create(&vec![("policy", policy.to_owned())])
            .observe(took.as_secs_f64());
    }

    pub(crate) fn quarantine(&self, policy: &str) {
        self.quarantines
            .get_or_create(&vec![("policy", policy.to_owned())])
            .inc();
    }

    pub(crate) fn fallback(&self, policy: &str) {
        self.fallbacks
            .get_or_create(&vec![("policy", policy.to_owned())])
            .inc();
    }

    /// Append these metrics to an OpenMetrics exposition, keeping its `# EOF` last.
    pub(crate) fn append_to(&self, exposition: &mut String) {
        append_registry(exposition, &self.registry);
    }
}

/// Append `registry`'s metrics to an OpenMetrics exposition, keeping its `# EOF` last: how
/// anything beside the router's own metrics (the policy registry, a built-in planner) joins
/// its `/metrics`.
pub fn append_registry(exposition: &mut String, registry: &Registry) {
    if exposition.ends_with(EOF_LINE) {
        exposition.truncate(exposition.len() - EOF_LINE.len());
    }
    // Writing into a String cannot fail.
    let _ = encode_registry(exposition, registry);
    let _ = encode_eof(exposition);
}
