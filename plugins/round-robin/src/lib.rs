//! The built-in round-robin policy, with MLC-LLM router parity.
//!
//! Despite its name, MLC's `round-robin` mode sends each whole request to the endpoint with
//! the fewest requests in flight (`_handle_completion_round_robin`). This policy does the
//! same, skipping unhealthy endpoints and, on a retry, the endpoint that just failed. Of vLLM
//! and SGLang engines it uses those that serve a whole request alone (not a vLLM prefill
//! endpoint, not an SGLang engine in prefill or decode mode).
//!
//! Config: none (`{}`).

use switchyard_policy::select::{candidates, least_loaded, serves_alone};
use switchyard_policy::types::{Context, Reads, Request, State};
use switchyard_policy::{Config, Plan, Policy, PolicyError};

/// Forward each request to the least-loaded healthy endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoundRobin;

impl Policy for RoundRobin {
    // It keeps no turn: each answer comes from the endpoint snapshot alone, so the router may
    // call a pool of instances in parallel.
    const STATE: State = State::Stateless;
    // It routes on the endpoints alone: the router need not tokenize the prompt for it.
    const READS: Reads = Reads::empty();

    fn init(config: &str) -> Result<Self, String> {
        Config::parse(config)?.deny_unknown(&[])?;
        Ok(RoundRobin)
    }

    fn translate(&mut self, _request: &Request, context: &Context) -> Result<Plan, PolicyError> {
        least_loaded(candidates(context), serves_alone)
            .map(|e| Plan::forward(e.id))
            .ok_or_else(|| PolicyError::Unavailable("no healthy endpoint".into()))
    }
}

switchyard_policy::export_policy!(RoundRobin);

#[cfg(test)]
mod tests;
