//! The RAII counters of what this router has sent an endpoint: every exit path (success, error,
//! cancellation by drop, preemption) releases the count because the guard's `Drop` does it.
//!
//! - [`InFlight`]: one leg, until it ends.
//! - [`Prefilling`]: a leg's prompt tokens the engine has not prefilled yet, until the prefill
//!   ends (the first token, a prefill leg's answer) or the leg does.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use super::EndpointState;

/// One leg in flight on one endpoint, counted until dropped.
#[derive(Debug)]
pub struct InFlight {
    endpoint: Arc<EndpointState>,
}

impl InFlight {
    pub(super) fn new(endpoint: Arc<EndpointState>) -> Self {
        endpoint.in_flight.fetch_add(1, Ordering::AcqRel);
        InFlight { endpoint }
    }

    pub fn endpoint(&self) -> u32 {
        self.endpoint.id
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if self.endpoint.in_flight.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.endpoint.idle.notify_waiters();
        }
    }
}

// === impl Prefilling ===

/// Prompt tokens sent to one endpoint that it has not prefilled yet, counted in the endpoint's
/// `pending_prefill` until [`Prefilling::done`] or the guard is dropped, whichever comes first.
///
/// Clones share one count, released exactly once by the first clone to be done or dropped: an
/// SGLang prefill leg's tokens are released by the decode leg's first token or by the prefill
/// leg's answer, whichever the router sees first.
#[derive(Debug, Clone)]
pub struct Prefilling(Arc<Pending>);

#[derive(Debug)]
struct Pending {
    endpoint: Arc<EndpointState>,
    /// What is still counted: the tokens until released, then 0.
    tokens: AtomicU32,
}

impl Prefilling {
    pub(super) fn new(endpoint: Arc<EndpointState>, tokens: u32) -> Self {
        endpoint.pending_prefill.fetch_add(tokens, Ordering::AcqRel);
        Prefilling(Arc::new(Pending {
            endpoint,
            tokens: AtomicU32::new(tokens),
        }))
    }

    /// The endpoint has prefilled these tokens: no longer counted (a no-op after the first
    /// call, by any clone).
    pub fn done(&self) {
        let tokens = self.0.tokens.swap(0, Ordering::AcqRel);
        if tokens > 0 {
            self.0
                .endpoint
                .pending_prefill
                .fetch_sub(tokens, Ordering::AcqRel);
        }
    }
}

impl Drop for Prefilling {
    fn drop(&mut self) {
        self.done();
    }
}
