//! The built-in disaggregated policy, with MLC-LLM router parity.
//!
//! MLC's `_handle_completion_disagg` prefills on endpoint 0, decodes on the least-loaded of
//! the others, and lets `pd_balance_factor` move the last share of the prompt from the prefill
//! to the decode endpoint. This policy does the same on a healthy, role-less cluster, and in
//! addition follows operator roles, skips unhealthy endpoints and avoids the endpoint a retry
//! failed on.
//!
//! It serves every protocol unchanged: it chooses *where* (a prefill endpoint, then a decode
//! endpoint of the same protocol that may decode); on MLC it plans MLC's microserving steps
//! with the `pd_balance_factor` window, elsewhere a `handoff`, which the router runs as vLLM's
//! NIXL handoff or SGLang's bootstrap handoff (only MLC has KV windows). With no pair to be had, one
//! endpoint that serves alone gets the whole request (never an SGLang prefill or decode
//! engine, nor a vLLM prefill one); with none, the client gets 503.
//!
//! Config: `{"pd_balance_factor": f}` with `0 <= f < 1` (default 0).

use switchyard_policy::select::{
    balance_end, can_decode, can_prefill, candidates, healthy, least_loaded, serves_alone,
};
use switchyard_policy::types::{Context, Endpoint, Protocol, Reads, Request, Role, State};
use switchyard_policy::{Config, Plan, Policy, PolicyError};

/// Prefill on one endpoint, decode on the least-loaded other one.
#[derive(Debug, Clone, PartialEq)]
pub struct Disagg {
    /// The share of the prompt the decode endpoint computes itself, `0 <= f < 1`.
    pd_balance_factor: f64,
}

impl Policy for Disagg {
    // Each answer comes from the request, the endpoint snapshot and the config alone, so the
    // router may call a pool of instances in parallel.
    const STATE: State = State::Stateless;
    // `balance_end` places MLC's KV window by the prompt's length.
    const READS: Reads = Reads::PROMPT_LENGTH;

    fn init(config: &str) -> Result<Self, String> {
        let config = Config::parse(config)?;
        config.deny_unknown(&["pd_balance_factor"])?;
        let pd_balance_factor = config.f64("pd_balance_factor")?.unwrap_or(0.0);
        if !(0.0..1.0).contains(&pd_balance_factor) {
            return Err(format!(
                "pd_balance_factor must be at least 0 and below 1, got {pd_balance_factor}"
            ));
        }
        Ok(Disagg { pd_balance_factor })
    }

    fn translate(&mut self, request: &Request, context: &Context) -> Result<Plan, PolicyError> {
        // A retry avoids the endpoint that just failed while others can do the work: first a
        // pair without it, else one endpoint without it serving alone; only then, since roles
        // bind on vLLM and SGLang and a lone pair has no stand-in, the pair that failed.
        let preferred = candidates(context);
        let all: Vec<&Endpoint> = healthy(&context.endpoints).collect();
        let serve_alone = |usable: &[&Endpoint]| {
            least_loaded(usable.iter().copied(), serves_alone).map(|e| Plan::forward(e.id))
        };
        let plan = self
            .pair(request, &preferred)
            .or_else(|| serve_alone(&preferred))
            .or_else(|| self.pair(request, &all))
            .or_else(|| serve_alone(&all));
        plan.ok_or_else(|| {
            PolicyError::Unavailable("no healthy endpoint can serve the request".into())
        })
    }
}

impl Disagg {
    /// A disaggregated plan on a pair of `usable` endpoints, if there is one.
    fn pair(&self, request: &Request, usable: &[&Endpoint]) -> Option<Plan> {
        let prefill = pick_prefill(usable)?;
        let decode = pick_decode(usable, prefill)?;
        if prefill.protocol == Protocol::Mlc {
            // MLC's own plan, window and all (with factor 0 it is what a handoff runs).
            let end = balance_end(request.prompt_length(), self.pd_balance_factor);
            return Some(Plan::disagg(prefill.id, decode.id, end));
        }
        Some(Plan::handoff(prefill.id, decode.id))
    }
}

/// The first endpoint whose role is `prefill` and that has a decode partner; else endpoint 0
/// as in MLC (the first that may prefill and has one). `usable` is healthy and in id order.
fn pick_prefill<'a>(usable: &[&'a Endpoint]) -> Option<&'a Endpoint> {
    let paired = || {
        usable
            .iter()
            .copied()
            .filter(|p| can_prefill(p) && pick_decode(usable, p).is_some())
    };
    paired()
        .find(|e| e.role == Role::Prefill)
        .or_else(|| paired().next())
}

/// The least-loaded other endpoint of the prefill's protocol that may decode, preferring those
/// not reserved for prefill.
fn pick_decode<'a>(usable: &[&'a Endpoint], prefill: &Endpoint) -> Option<&'a Endpoint> {
    let others = || {
        usable
            .iter()
            .copied()
            .filter(move |e| e.id != prefill.id && e.protocol == prefill.protocol && can_decode(e))
    };
    least_loaded(others(), |e| e.role != Role::Prefill).or_else(|| least_loaded(others(), |_| true))
}

switchyard_policy::export_policy!(Disagg);

#[cfg(test)]
mod tests;
