//! A policy whose state survives a hot swap: it forwards request after request to the healthy
//! endpoints in turn, counting the requests it planned, and hands that count to its next
//! version (`export-state` → `import-state`). Without the carry-over a new version would start
//! again at the first endpoint, which is what the router's tests look for.
//!
//! It reads nothing (`reads` is empty), and its `on-complete` traps: a router that calls it
//! anyway faults the policy, which is what the router's tests look for too.
//!
//! Config: `{"generation": N}` (optional, any number): lets a test load "a new version" of the
//! same component, since the router skips a reload that changes neither bytes nor config.

use switchyard_policy::select::candidates;
use switchyard_policy::types::{Context, Outcome, Reads, Request};
use switchyard_policy::{Config, Plan, Policy, PolicyError};

/// Round-robin over the healthy endpoints, by a counter that carries over.
#[derive(Debug, Default)]
pub struct Stateful {
    planned: u64,
}

impl Policy for Stateful {
    const READS: Reads = Reads::empty();

    fn init(config: &str) -> Result<Self, String> {
        let config = Config::parse(config)?;
        config.deny_unknown(&["generation"])?;
        config.f64("generation")?;
        Ok(Stateful::default())
    }

    fn translate(&mut self, _request: &Request, context: &Context) -> Result<Plan, PolicyError> {
        let usable = candidates(context);
        if usable.is_empty() {
            return Err(PolicyError::Unavailable("no healthy endpoint".into()));
        }
        let turn = (self.planned % usable.len() as u64) as usize;
        self.planned += 1;
        Ok(Plan::forward(usable[turn].id))
    }

    fn on_complete(&mut self, outcome: &Outcome) {
        panic!(
            "stateful: on-complete was called for request {}, yet this policy does not read outcomes",
            outcome.request_id
        );
    }

    fn export_state(&self) -> Vec<u8> {
        self.planned.to_le_bytes().to_vec()
    }

    fn import_state(&mut self, state: &[u8]) -> Result<(), String> {
        let bytes: [u8; 8] = state
            .try_into()
            .map_err(|_| format!("expected 8 bytes of state, got {}", state.len()))?;
        self.planned = u64::from_le_bytes(bytes);
        Ok(())
    }
}

switchyard_policy::export_policy!(Stateful);

#[cfg(test)]
mod tests {
    use switchyard_policy::Plan;
    use switchyard_policy::testing::{Harness, endpoints, request};

    use super::Stateful;

    #[test]
    fn the_turn_carries_over_a_swap() {
        let ctx = endpoints(3).context();
        let mut v1 = Harness::<Stateful>::init("{}").unwrap();
        for id in [0, 1] {
            assert_eq!(v1.translate(&request(4), &ctx), Ok(Plan::forward(id)));
        }
        let mut v2 = v1.swap(r#"{"generation": 2}"#).unwrap();
        assert_eq!(v2.translate(&request(4), &ctx), Ok(Plan::forward(2)));
        let mut fresh = Harness::<Stateful>::init("{}").unwrap();
        assert_eq!(fresh.translate(&request(4), &ctx), Ok(Plan::forward(0)));
    }

    #[test]
    fn a_state_of_the_wrong_size_is_refused() {
        let err = switchyard_policy::Policy::import_state(&mut Stateful::default(), b"xy");
        assert_eq!(err, Err("expected 8 bytes of state, got 2".into()));
    }
}
