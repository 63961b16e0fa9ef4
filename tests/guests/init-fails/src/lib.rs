//! A well-formed policy component whose `init` always fails, whatever its config: the router
//! must keep serving the version it replaces and show the error.

use switchyard_policy::types::{Context, Reads, Request};
use switchyard_policy::{Plan, Policy, PolicyError};

/// Never starts.
#[derive(Debug)]
pub struct InitFails;

impl Policy for InitFails {
    const READS: Reads = Reads::empty();

    fn init(_config: &str) -> Result<Self, String> {
        Err("init-fails: this policy never starts".into())
    }

    fn translate(&mut self, _request: &Request, _context: &Context) -> Result<Plan, PolicyError> {
        Err(PolicyError::Internal(
            "unreachable: init never succeeds".into(),
        ))
    }
}

switchyard_policy::export_policy!(InitFails);
