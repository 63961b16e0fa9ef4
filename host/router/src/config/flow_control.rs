//! Flow control: `switchyard serve`'s flags, or the file's `[flow_control]` table.

use std::collections::HashMap;
use std::time::Duration;

use super::error::Problem;
use super::file::{FileValue, deserialize};
use super::table::{at_least_one, settings};
use crate::api::{DEFAULT_PRIORITY_HEADER, Fairness, FlowControl};
use crate::cluster::SaturationConfig;

settings! {
    /// How the admission queue orders what waits: by priority, by tenant, by deadline
    /// (`switchyard serve` only; the file's `[flow_control]` table has their keys).
    args FlowControlArgs, keys FlowControlKeys, resolved FlowControlSettings, table "flow_control";

    /// Queue first come, first served: no priority, tenant or deadline is read from requests.
    no_flow_control: bool => bool {
        flag: "no-flow-control",
        key: "enabled",
        default: false,
        // The file says the opposite: `enabled = false` turns flow control off.
        file: |value| bool::from_toml(value).map(|on| !on),
    }
    /// How tenants of one priority share the places: `round-robin` (turns, by weight) or
    /// `least-service` (the tenant with the fewest tokens asked for, over its weight, goes
    /// next) [default: round-robin].
    #[arg(value_enum)]
    fairness: Option<Fairness> => Fairness {
        flag: "fairness",
        key: "fairness",
        default: Fairness::RoundRobin,
    }
    /// The request header that carries a priority (an integer, higher first) [default:
    /// x-priority].
    #[arg(value_name = "NAME")]
    priority_header: Option<String> => String {
        flag: "priority-header",
        key: "priority_header",
        default: DEFAULT_PRIORITY_HEADER.to_owned(),
        check: |name| header_name(name),
    }
    /// A tenant's weight in its priority's share of places, `TENANT=WEIGHT` (repeatable; the
    /// file's `[flow_control.tenant_weights]` table); a tenant not listed weighs 1.
    #[arg(value_name = "TENANT=WEIGHT", value_parser = tenant_weight)]
    tenant_weights: Vec<(String, f64)> => Vec<(String, f64)> {
        flag: "tenant-weight",
        key: "tenant_weights",
        default: Vec::new(),
        check: |weights| positive_weights(weights),
    }
    /// An endpoint is saturated with this many requests waiting in its engine's queue (its
    /// `/metrics`): left out of new plans while another of its role has room [default: 5].
    #[arg(value_name = "N")]
    saturation_waiting: Option<u32> => u32 {
        flag: "saturation-waiting",
        key: "saturation_waiting",
        default: SaturationConfig::default().waiting,
        check: at_least_one,
    }
    /// An endpoint is saturated at this share of its engine's KV cache in use [default: 0.95].
    #[arg(value_name = "SHARE")]
    saturation_kv_usage: Option<f64> => f64 {
        flag: "saturation-kv-usage",
        key: "saturation_kv_usage",
        default: SaturationConfig::default().kv_usage,
        check: share,
    }
    /// An endpoint is saturated with this many legs of this router in flight on it; not
    /// judged unless given.
    #[arg(value_name = "N")]
    saturation_in_flight: Option<u32> => u32 {
        flag: "saturation-in-flight",
        key: "saturation_in_flight",
        check: at_least_one,
    }
    /// The saturation `switchyard_desired_replicas` aims each endpoint at [default: 0.8].
    #[arg(value_name = "SHARE")]
    target_saturation: Option<f64> => f64 {
        flag: "target-saturation",
        key: "target_saturation",
        default: SaturationConfig::default().target,
        check: share,
    }
    /// While no endpoint is ready, hold requests up to this long until one is (scale from
    /// zero) instead of answering 503 at once; off unless given.
    #[arg(value_name = "MS")]
    scale_from_zero_timeout_ms: Option<u64> => u64 {
        flag: "scale-from-zero-timeout-ms",
        key: "scale_from_zero_timeout_ms",
        check: at_least_one,
    }
}

impl FlowControlSettings {
    pub(super) fn flow_control(&self) -> FlowControl {
        FlowControl {
            enabled: !self.no_flow_control.value,
            fairness: self.fairness.value,
            priority_header: http::HeaderName::from_bytes(self.priority_header.value.as_bytes())
                .expect("checked as a header name"),
            tenant_weights: self
                .tenant_weights
                .value
                .iter()
                .cloned()
                .collect::<HashMap<_, _>>(),
            scale_from_zero: self
                .scale_from_zero_timeout_ms
                .as_ref()
                .map(|ms| Duration::from_millis(ms.value)),
        }
    }

    /// When endpoints are saturated; `None` with flow control off (nothing is judged).
    pub(super) fn saturation(&self) -> Option<SaturationConfig> {
        (!self.no_flow_control.value).then(|| SaturationConfig {
            waiting: self.saturation_waiting.value,
            kv_usage: self.saturation_kv_usage.value,
            in_flight: self.saturation_in_flight.as_ref().map(|n| n.value),
            target: self.target_saturation.value,
        })
    }
}

impl FileValue for Fairness {
    fn from_toml(value: toml::de::ValueDeserializer<'_>) -> Result<Self, String> {
        deserialize(value)
    }
}

/// `[flow_control.tenant_weights]`: `name = weight`.
impl FileValue for Vec<(String, f64)> {
    fn from_toml(value: toml::de::ValueDeserializer<'_>) -> Result<Self, String> {
        let table: std::collections::BTreeMap<String, f64> = deserialize(value)?;
        Ok(table.into_iter().collect())
    }
}

/// `TENANT=WEIGHT`.
fn tenant_weight(text: &str) -> Result<(String, f64), String> {
    let (tenant, weight) = text
        .split_once('=')
        .ok_or_else(|| format!("{text:?} is not TENANT=WEIGHT"))?;
    let weight = weight
        .parse()
        .map_err(|_| format!("{weight:?} is not a number"))?;
    Ok((tenant.to_owned(), weight))
}

fn header_name(name: &str) -> Result<(), Problem> {
    match http::HeaderName::from_bytes(name.as_bytes()) {
        Ok(_) => Ok(()),
        Err(_) => Err(Problem::HeaderName(name.to_owned())),
    }
}

/// KV usage and saturation are shares: 0 would saturate every endpoint at once.
fn share(value: &f64) -> Result<(), Problem> {
    match *value > 0.0 && *value <= 1.0 {
        true => Ok(()),
        false => Err(Problem::NotAShare(*value)),
    }
}

/// A weight of 0 would starve its tenant whenever another waits; a negative one means nothing.
fn positive_weights(weights: &[(String, f64)]) -> Result<(), Problem> {
    match weights.iter().find(|(_, w)| !(w.is_finite() && *w > 0.0)) {
        Some((tenant, weight)) => Err(Problem::Weight {
            tenant: tenant.clone(),
            weight: *weight,
        }),
        None => Ok(()),
    }
}
