//! The seam between the router and its policies: whoever plans requests implements
//! [`Planner`]; the router asks it for plans and tells it how requests ended.

use std::sync::Arc;

use crate::policy::{Outcome, PolicyContext, PolicyRequest, Reads, TranslateError};
use crate::{Plan, PlanError};

/// Asks for plans and hears how requests ended: a loaded policy, a policy registry's
/// per-request selection, or a fake in tests.
pub trait Planner: Send + Sync {
    fn translate(
        &self,
        req: &PolicyRequest<'_>,
        ctx: &PolicyContext,
    ) -> Result<Plan, TranslateError>;

    /// Hears how a request ended; the router calls it only when [`Planner::reads`] has
    /// `outcomes`.
    fn on_complete(&self, outcome: &Outcome);

    /// What this planner reads (the fallback it names included): the router tokenizes a
    /// request's prompt for it only when `prompt` is set, and reports outcomes only when
    /// `outcomes` is. The default, everything, is always correct.
    fn reads(&self) -> Reads {
        Reads::ALL
    }

    /// This planner's answer for an attempt could not be used (a fault:
    /// [`PlanningError::is_fault`]). Returns the planner that plans this attempt instead;
    /// `None` (the default) ends the request with the error.
    fn fallback(&self, error: &PlanningError) -> Option<Arc<dyn Planner>> {
        let _ = error;
        None
    }
}

/// Why a planner gave no plan the router can run for an attempt.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanningError {
    /// The policy answered with an error, or the sandbox stopped it.
    #[error(transparent)]
    Translate(TranslateError),
    /// The policy's plan failed [`crate::validate`].
    #[error("the policy returned an invalid plan: {0}")]
    InvalidPlan(PlanError),
}

impl PlanningError {
    /// A fault of the policy rather than an answer: a sandbox fault, an `internal` error or an
    /// invalid plan. Faults go to the planner's fallback; `unavailable` and `rejected` are
    /// answers, and end the request.
    pub fn is_fault(&self) -> bool {
        match self {
            PlanningError::Translate(e) => {
                e.is_fault() || matches!(e, TranslateError::Internal { .. })
            }
            PlanningError::InvalidPlan(_) => true,
        }
    }
}
