//! The RAII in-flight counter: every exit path (success, error, cancellation by drop,
//! preemption) releases the count because the guard's `Drop` does it.

use std::sync::Arc;
use std::sync::atomic::Ordering;

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
