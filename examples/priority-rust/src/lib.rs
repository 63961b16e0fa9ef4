//! Example policy: MLC's `PriorityRouter`, as a switchyard component.
//!
//! MLC's documentation subclasses its router so that requests from priority users bypass
//! disaggregation. This policy does the same: a request whose `user` starts with
//! `priority-` (or with the configured prefix), or that carries the header `x-priority: high`,
//! is forwarded whole to the least-loaded healthy endpoint, so it does not wait behind other
//! requests' prefills. Every other request takes MLC's disaggregated path: prefill on
//! endpoint 0, decode on the other endpoint with the fewest requests in flight.
//!
//! Config (all optional): `{"user_prefix": "priority-", "pd_balance_factor": 0.0}`.

use switchyard_policy::select::{balance_end, candidates, least_loaded};
use switchyard_policy::types::{Context, Reads, Request, State};
use switchyard_policy::{Config, Plan, Policy, PolicyError, log_info};

/// The header that marks a request as priority, and the value that does.
const PRIORITY_HEADER: (&str, &str) = ("x-priority", "high");
const DEFAULT_USER_PREFIX: &str = "priority-";

/// Priority requests go whole to the least-loaded endpoint; the rest are disaggregated.
#[derive(Debug, Clone, PartialEq)]
pub struct PriorityRouter {
    /// Users whose name starts with this are priority users.
    user_prefix: String,
    /// The share of the prompt the decode endpoint computes itself, `0 <= f < 1` (MLC's
    /// `pd_balance_factor`).
    pd_balance_factor: f64,
}

impl Policy for PriorityRouter {
    // Each answer comes from the request, the endpoints and the config alone: the router may
    // run a pool of instances in parallel.
    const STATE: State = State::Stateless;
    // `balance_end` places MLC's KV window by the prompt's length.
    const READS: Reads = Reads::PROMPT_LENGTH;

    fn init(config: &str) -> Result<Self, String> {
        let config = Config::parse(config)?;
        config.deny_unknown(&["user_prefix", "pd_balance_factor"])?;
        let user_prefix = config
            .str("user_prefix")?
            .unwrap_or(DEFAULT_USER_PREFIX)
            .to_owned();
        if user_prefix.is_empty() {
            // An empty prefix would make every user a priority user: surely a mistake.
            return Err("user_prefix must not be empty".into());
        }
        let pd_balance_factor = config.f64("pd_balance_factor")?.unwrap_or(0.0);
        if !(0.0..1.0).contains(&pd_balance_factor) {
            return Err(format!(
                "pd_balance_factor must be at least 0 and below 1, got {pd_balance_factor}"
            ));
        }
        log_info(&format!(
            "priority users: {user_prefix:?}* or header x-priority: high; \
             pd_balance_factor {pd_balance_factor}"
        ));
        Ok(PriorityRouter {
            user_prefix,
            pd_balance_factor,
        })
    }

    fn translate(&mut self, request: &Request, context: &Context) -> Result<Plan, PolicyError> {
        if self.is_priority(request) {
            return forward_least_loaded(context);
        }
        self.disaggregate(request, context)
    }
}

impl PriorityRouter {
    fn is_priority(&self, request: &Request) -> bool {
        let by_user = request
            .user
            .as_deref()
            .is_some_and(|user| user.starts_with(&self.user_prefix));
        let (name, value) = PRIORITY_HEADER;
        let by_header = request
            .headers
            .iter()
            .any(|h| h.name == name && h.value.eq_ignore_ascii_case(value));
        by_user || by_header
    }

    /// MLC's disaggregated plan: prefill on the first usable endpoint (endpoint 0 while it is
    /// healthy), decode on the least-loaded other one; alone, an endpoint serves it whole.
    fn disaggregate(&self, request: &Request, context: &Context) -> Result<Plan, PolicyError> {
        let usable = candidates(context);
        let Some(prefill) = usable.first() else {
            return Err(no_endpoint());
        };
        let decode = least_loaded(usable.iter().copied(), |e| e.id != prefill.id);
        Ok(match decode {
            Some(decode) => Plan::disagg(
                prefill.id,
                decode.id,
                balance_end(request.prompt_length(), self.pd_balance_factor),
            ),
            None => Plan::forward(prefill.id),
        })
    }
}

fn forward_least_loaded(context: &Context) -> Result<Plan, PolicyError> {
    least_loaded(candidates(context), |_| true)
        .map(|e| Plan::forward(e.id))
        .ok_or_else(no_endpoint)
}

fn no_endpoint() -> PolicyError {
    PolicyError::Unavailable("no healthy endpoint".into())
}

switchyard_policy::export_policy!(PriorityRouter);

#[cfg(test)]
mod tests;
