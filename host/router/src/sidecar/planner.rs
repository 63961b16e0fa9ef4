//! The sidecar's built-in planner: no policy chooses anything here, the gateway's EPP already
//! did. Endpoint 0 is the decode engine; every other endpoint is an allowed prefill engine.
//!
//! - No `x-prefiller-host-port`, or an empty one (llm-d's EPP clears the header to `""` when it
//!   chose not to disaggregate): `forward(decode)`.
//! - A header naming an allowed prefill engine: `handoff(prefill, decode)`, which the executor
//!   runs as the protocol does (MLC's `prep_recv` → `remote_send` → `start_generate`, vLLM's
//!   prefill-then-decode legs, SGLang's bootstrap room).
//! - A header the allowlist refuses: `rejected` (400), before any call.
//! - The decode engine down or ejected: `unavailable` (503); no plan could name it.
//! - The named prefill engine failed the previous attempt, or is not healthy (a rescue):
//!   - MLC and vLLM: the decode engine prefills itself (`forward(decode)`), counted in
//!     `switchyard_sidecar_prefill_fallbacks_total`. It is up (it is this pod's engine), it
//!     needs no second remote engine that may fail the same way, and which prefill engine
//!     should take a request is the EPP's choice, made with the whole pool in view.
//!   - SGLang: a decode engine cannot prefill by itself (its disaggregation mode is fixed), so
//!     the handoff goes, once, to another allowed prefill engine that is healthy (the one with
//!     the fewest of this sidecar's legs in flight), counted in
//!     `switchyard_sidecar_prefill_reroutes_total`; with none, or when that one fails too, the
//!     request is `unavailable` (503).
//!
//! The router's retry loop is what brings the planner back after a failure, so a rescue keeps
//! its backoff, retry budget and continuation.

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
    reroutes: Counter,
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
        let reroutes = Counter::default();
        metrics.register(
            "switchyard_sidecar_prefill_reroutes",
            "Attempts handed to another allowed prefill engine (SGLang) because the prefill engine the request named failed or was not healthy",
            reroutes.clone(),
        );
        SidecarPlanner {
            cluster,
            own,
            fallbacks,
            reroutes,
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

    /// The named prefill engine failed or is down: the decode engine prefills itself where it
    /// can (MLC, vLLM); otherwise (SGLang) another healthy allowed prefill engine takes the
    /// handoff, or the request is `unavailable`.
    fn rescue(
        &self,
        decode: &EndpointSnapshot,
        named: EndpointId,
        endpoints: &[EndpointSnapshot],
        value: &str,
    ) -> Result<Plan, TranslateError> {
        if decode.serves_alone() {
            return Ok(self.prefill_on_decode(value));
        }
        let Some(other) = another_prefill(named, endpoints) else {
            return Err(cannot_prefill(
                decode,
                format!(
                    "the prefill engine {value} is failing and no other allowed prefill engine is healthy"
                ),
            ));
        };
        self.reroutes.inc();
        tracing::info!(
            prefill = value,
            other,
            "another prefill engine takes the handoff"
        );
        Ok(handoff(other))
    }

    /// The request's one rescue failed too (the other prefill engine it was handed to): the
    /// decode engine prefills itself where it can, or the request is `unavailable`.
    fn rescue_failed(
        &self,
        decode: &EndpointSnapshot,
        value: &str,
    ) -> Result<Plan, TranslateError> {
        if decode.serves_alone() {
            return Ok(self.prefill_on_decode(value));
        }
        Err(cannot_prefill(
            decode,
            format!(
                "the prefill engine {value} and the one the request was handed to instead failed"
            ),
        ))
    }

    /// The decode engine alone, counted.
    fn prefill_on_decode(&self, prefill: &str) -> Plan {
        self.fallbacks.inc();
        tracing::info!(prefill, "the decode engine prefills itself");
        forward()
    }
}

/// The healthy allowed prefill engine, other than `named`, with the fewest legs in flight.
fn another_prefill(named: EndpointId, endpoints: &[EndpointSnapshot]) -> Option<EndpointId> {
    endpoints
        .iter()
        .filter(|e| e.id != DECODE && e.id != named && e.health.is_healthy() && e.can_prefill())
        .min_by_key(|e| (e.in_flight, e.id))
        .map(|e| e.id)
}

/// `unavailable`: why the handoff cannot run, and that the decode engine cannot prefill alone.
fn cannot_prefill(decode: &EndpointSnapshot, why: String) -> TranslateError {
    TranslateError::Unavailable {
        policy: NAME.into(),
        message: format!(
            "{why}, and the {} decode engine cannot prefill by itself",
            decode.protocol
        ),
    }
}

/// The decode engine, when plans may name it. It is the sidecar's one engine that generates:
/// while it is down (its probe) or ejected (its failures), every plan would be invalid, and
/// the request is `unavailable` (503) rather than an invalid plan (500).
fn serving_decode(endpoints: &[EndpointSnapshot]) -> Result<&EndpointSnapshot, TranslateError> {
    let unavailable = |message: String| TranslateError::Unavailable {
        policy: NAME.into(),
        message,
    };
    let decode = endpoints
        .iter()
        .find(|e| e.id == DECODE)
        .ok_or_else(|| unavailable("the decode engine is not in the endpoint list".into()))?;
    if !decode.health.is_healthy() {
        return Err(unavailable(format!(
            "the decode engine is not serving ({:?})",
            decode.health
        )));
    }
    Ok(decode)
}

fn handoff(prefill: EndpointId) -> Plan {
    Plan {
        steps: vec![Step::Handoff {
            prefill,
            decode: DECODE,
        }],
    }
}

fn forward() -> Plan {
    Plan {
        steps: vec![Step::Forward { endpoint: DECODE }],
    }
}

/// The header's one value; `None` without it or when it is empty (llm-d's EPP clears a header
/// a client sent to `""` when it does not disaggregate the request).
fn header(headers: &[(String, String)]) -> Result<Option<&str>, TargetError> {
    let mut values = headers
        .iter()
        .filter(|(name, _)| name == PREFILLER)
        .map(|(_, value)| value.trim())
        .filter(|value| !value.is_empty());
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
        let value = header(req.headers).map_err(rejected)?;
        let named = value
            .map(|value| self.prefill_endpoint(value, &ctx.endpoints))
            .transpose()
            .map_err(rejected)?;
        let decode = serving_decode(&ctx.endpoints)?;
        let (Some(value), Some(named)) = (value, named) else {
            return Ok(forward());
        };
        // A preemption is no engine's fault: the attempt is planned as the first was.
        let failed = ctx
            .last_failure
            .filter(|failure| failure.kind != FailureKind::Preempted)
            .map(|failure| failure.endpoint);
        match failed {
            Some(id) if id == named.id => self.rescue(decode, named.id, &ctx.endpoints, value),
            Some(id) if id != DECODE => self.rescue_failed(decode, value),
            _ if !named.health.is_healthy() => self.rescue(decode, named.id, &ctx.endpoints, value),
            _ => Ok(handoff(named.id)),
        }
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
