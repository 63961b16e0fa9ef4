//! The built-in disaggregated policy, with MLC-LLM router parity.
//!
//! MLC's `_handle_completion_disagg` prefills on endpoint 0, decodes on the least-loaded of
//! the others, and lets `pd_balance_factor` move the last share of the prompt from the prefill
//! to the decode endpoint. This policy does the same on a healthy, role-less cluster, and in
//! addition follows operator roles, skips unhealthy endpoints and avoids the endpoint a retry
//! failed on.
//!
//! Config: `{"pd_balance_factor": f}` with `0 <= f < 1` (default 0).

use switchyard_policy::select::{balance_end, candidates, least_loaded};
use switchyard_policy::types::{Context, Endpoint, Request, Role, State};
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
        let usable = candidates(context);
        let Some(prefill) = pick_prefill(&usable) else {
            return Err(PolicyError::Unavailable("no healthy endpoint".into()));
        };
        let Some(decode) = pick_decode(&usable, prefill.id) else {
            // One usable endpoint: it serves the request alone.
            return Ok(Plan::forward(prefill.id));
        };
        let end = balance_end(request.prompt_len, self.pd_balance_factor);
        Ok(Plan::disagg(prefill.id, decode.id, end))
    }
}

/// The first endpoint whose role is `prefill`; else endpoint 0 as in MLC; else the lowest id.
/// `usable` is healthy and in id order.
fn pick_prefill<'a>(usable: &[&'a Endpoint]) -> Option<&'a Endpoint> {
    usable
        .iter()
        .find(|e| e.role == Role::Prefill)
        .or_else(|| usable.first())
        .copied()
}

/// The least-loaded other endpoint, preferring those not reserved for prefill.
fn pick_decode<'a>(usable: &[&'a Endpoint], prefill: u32) -> Option<&'a Endpoint> {
    let others = || usable.iter().copied().filter(move |e| e.id != prefill);
    least_loaded(others(), |e| e.role != Role::Prefill).or_else(|| least_loaded(others(), |_| true))
}

switchyard_policy::export_policy!(Disagg);

#[cfg(test)]
mod tests;
