//! The sidecar's built-in planner: no policy chooses anything here, the gateway's EPP already
//! did. Endpoint 0 is the decode engine; every other endpoint is an allowed prefill engine.
//!
//! - No `x-prefiller-host-port`: `forward(decode)`.
//! - A header naming an allowed prefill engine: `handoff(prefill, decode)`, which the executor
//!   runs as the protocol does (MLC's `prep_recv` → `remote_send` → `start_generate`, vLLM's
//!   prefill-then-decode legs, SGLang's bootstrap room).
//! - A header the allowlist refuses: `rejected` (400), before any call.
//! - The named prefill engine failed the previous attempt, or is not healthy: the decode engine
//!   prefills itself (`forward(decode)`), counted in
//!   `switchyard_sidecar_prefill_fallbacks_total`. The router's retry loop is what brings the
//!   planner back after the failure, so the fallback keeps its backoff, retry budget and
//!   continuation. An SGLang decode engine cannot prefill by itself (its disaggregation mode
//!   is fixed): there the request is `unavailable` (503).

use std::net::SocketAddr;
use std::sync::Arc;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::registry::Registry;

use switchyard_contract::{
    EndpointId, EndpointSnapshot, FailureKind, Health, Outcome, Plan, Planner, PolicyContext,
    PolicyRequest, Step, TranslateError,
};

use super::target::{Target, TargetError};
use crate::api::BuiltinPlanner;
use crate::cluster::Cluster;
use crate::epp::wire::PREFILLER;

/// The decode engine's id: the sidecar's first endpoint.
pub const DECODE: EndpointId = 0;

/// The name the planner's errors give as their policy's.
const NAME: &str = "sidecar";

/// Plans every request of one sidecar (see the module docs).
pub struct SidecarPlanner {
    cluster: Arc<Cluster>,
    /// Where the sidecar listens: a header naming it is refused.
    own: SocketAddr,
    fallbacks: Counter,
    metrics: Registry,
}

impl SidecarPlanner {
    pub fn new(cluster: Arc<Cluster>, own: SocketAddr) -> Self {
        let fallbacks = Counter::default();
        let mut metrics = Registry::default();
        metrics.register(
            "switchyard_sidecar_prefill_fallbacks",
            "Attempts the decode engine prefilled itself because the prefill engine the request named failed or was not healthy",
            fallbacks.clone(),
        );
        SidecarPlanner {
            cluster,
            own,
            fallbacks,
            metrics,
        }
    }

    /// The allowed prefill endpoint `value` names.
    fn prefill_endpoint<'a>(
        &self,
        value: &str,
        endpoints: &'a [EndpointSnapshot],
    ) -> Result<&'a EndpointSnapshot, TargetError> {
        let target = Target::parse(value)?;
        if target.is(self.own) {
            return Err(TargetError::Itself {
                target: target.to_string(),
            });
        }
        let address = target.address();
        let endpoint = endpoints
            .iter()
            .filter(|e| e.id != DECODE && e.health != Health::Removed)
            .find(|e| self.cluster.address(e.id).as_deref() == Some(address.as_str()))
            .ok_or(TargetError::NotAllowed {
                target: address.clone(),
            })?;
        if !endpoint.can_prefill() {
            return Err(TargetError::CannotPrefill {
                target: address,
                protocol: endpoint.protocol.name(),
            });
        }
        Ok(endpoint)
    }

    /// The decode engine alone, counted; or `unavailable` where it cannot prefill.
    fn fall_back(&self, decode: &EndpointSnapshot, prefill: &str) -> Result<Plan, TranslateError> {
        if !decode.serves_alone() {
            return Err(TranslateError::Unavailable {
                policy: NAME.into(),
                message: format!(
                    "the prefill engine {prefill} is failing, and the {} decode engine cannot prefill by itself",
                    decode.protocol
                ),
            });
        }
        self.fallbacks.inc();
        tracing::info!(prefill, "the decode engine prefills itself");
        Ok(forward())
    }
}

fn forward() -> Plan {
    Plan {
        steps: vec![Step::Forward { endpoint: DECODE }],
    }
}

/// The header's one value; `None` without it.
fn header(headers: &[(String, String)]) -> Result<Option<&str>, TargetError> {
    let mut values = headers
        .iter()
        .filter(|(name, _)| name == PREFILLER)
        .map(|(_, value)| value.as_str());
    match (values.next(), values.next()) {
        (None, _) => Ok(None),
        (Some(value), None) => Ok(Some(value)),
        (Some(_), Some(_)) => Err(TargetError::Several),
    }
}

impl Planner for SidecarPlanner {
    fn translate(
        &self,
        req: &PolicyRequest<'_>,
        ctx: &PolicyContext,
    ) -> Result<Plan, TranslateError> {
        let rejected = |e: TargetError| TranslateError::Rejected {
            policy: NAME.into(),
            message: e.to_string(),
        };
        let Some(value) = header(req.headers).map_err(rejected)? else {
            return Ok(forward());
        };
        let prefill = self
            .prefill_endpoint(value, &ctx.endpoints)
            .map_err(rejected)?;
        let Some(decode) = ctx.endpoints.iter().find(|e| e.id == DECODE) else {
            return Err(TranslateError::Unavailable {
                policy: NAME.into(),
                message: "the decode engine is not in the endpoint list".into(),
            });
        };
        let failed = ctx.last_failure.is_some_and(|failure| {
            failure.endpoint == prefill.id && failure.kind != FailureKind::Preempted
        });
        if failed || !prefill.health.is_healthy() {
            return self.fall_back(decode, value);
        }
        Ok(Plan {
            steps: vec![Step::Handoff {
                prefill: prefill.id,
                decode: DECODE,
            }],
        })
    }

    fn on_complete(&self, _outcome: &Outcome) {}
}

impl BuiltinPlanner for SidecarPlanner {
    fn append_metrics(&self, exposition: &mut String) {
        switchyard_policy_host::append_registry(exposition, &self.metrics);
    }
}

#[cfg(test)]
mod tests;
