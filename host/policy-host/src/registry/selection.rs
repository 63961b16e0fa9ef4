//! The policy one request is planned with: the version of the selected policy that was serving
//! when the request arrived (kept for all its attempts), and the fallback policy that plans an
//! attempt when that version faults, returns an invalid plan, is quarantined or never loaded.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use super::Shared;
use super::slot::{Slot, Version};
use switchyard_contract::{
    Outcome, Plan, Planner, PlanningError, PolicyContext, PolicyRequest, Reads, TranslateError,
};

/// One version of one policy, as a planner: calls are counted and timed for its slot.
#[derive(Clone)]
pub(crate) struct Served {
    pub(super) slot: Arc<Slot>,
    pub(super) version: Arc<Version>,
    pub(super) shared: Arc<Shared>,
}

impl Served {
    fn name(&self) -> &str {
        &self.slot.name
    }

    /// Count a fault of this version (from `translate-request`, its plan or `on-complete`),
    /// quarantining the version at the threshold.
    fn fault(&self, error: &dyn std::fmt::Display) {
        let shared = &self.shared;
        if !self.version.record_fault(shared.quarantine, Instant::now()) {
            return;
        }
        shared.metrics.quarantine(self.name());
        let message = format!(
            "quarantined after {} faults within {:?}; the fallback policy serves its requests \
             until a new version is loaded. Last fault: {error}",
            shared.quarantine.faults, shared.quarantine.window
        );
        tracing::warn!(policy = %self.name(), sha256 = %self.version.policy.info().sha256,
            "{message}");
        self.slot.status.lock().last_error = Some(message);
    }
}

impl Planner for Served {
    fn translate(
        &self,
        req: &PolicyRequest<'_>,
        ctx: &PolicyContext,
    ) -> Result<Plan, TranslateError> {
        let started = Instant::now();
        let plan = self.version.policy.translate(req, ctx);
        let took = started.elapsed();
        self.slot.stats.call(took);
        self.shared.metrics.call(self.name(), took);
        if plan.is_err() {
            self.slot.stats.error();
        }
        plan
    }

    /// A fault in `on-complete` counts toward quarantine like one in `translate-request`: a
    /// policy that spins there on every request would otherwise cost every request its
    /// deadline forever.
    fn on_complete(&self, outcome: &Outcome) {
        if let Err(fault) = self.version.policy.on_complete(outcome) {
            tracing::warn!(policy = %self.name(), request_id = outcome.request_id, %fault,
                "on-complete failed");
            self.slot.stats.error();
            self.fault(&fault);
        }
    }

    fn reads(&self) -> Reads {
        self.version.policy.info().reads
    }
}

/// The planner of one request. See the module docs.
pub struct Selection {
    /// The policy the request selected (header, model mapping or default).
    selected: String,
    /// Plans attempts: the selected policy's version, or the fallback's when the selected
    /// policy has no loaded version.
    first: Served,
    /// Takes over from `first` when it faults or is quarantined.
    fallback: Option<Served>,
    /// Whether the last attempt was planned by the fallback: its faults are not the selected
    /// policy's, and there is nothing further to fall back to.
    used_fallback: AtomicBool,
}

impl Selection {
    pub(super) fn new(selected: String, first: Served, fallback: Option<Served>) -> Self {
        Selection {
            selected,
            first,
            fallback,
            used_fallback: AtomicBool::new(false),
        }
    }

    /// The policy the request selected.
    pub fn policy(&self) -> &str {
        &self.selected
    }

    fn first_is_selected(&self) -> bool {
        self.first.name() == self.selected
    }

    /// Who plans the next attempt, and whether that is a fallback: the selected version unless
    /// it is quarantined (or was never loaded) and a fallback exists.
    fn planner(&self) -> (&Served, bool) {
        let quarantined = self.first.version.is_quarantined();
        let planner = match &self.fallback {
            Some(fallback) if quarantined => (fallback, true),
            // Quarantined with nowhere to go: the selected version beats failing the request.
            _ => (&self.first, !self.first_is_selected()),
        };
        if planner.1 {
            self.first.shared.metrics.fallback(&self.selected);
        }
        planner
    }

    /// Whoever planned the last attempt (it hears the outcome).
    fn last_planner(&self) -> &Served {
        match &self.fallback {
            Some(fallback) if self.used_fallback.load(Ordering::Relaxed) => fallback,
            _ => &self.first,
        }
    }
}

impl Planner for Selection {
    fn translate(
        &self,
        req: &PolicyRequest<'_>,
        ctx: &PolicyContext,
    ) -> Result<Plan, TranslateError> {
        let (planner, is_fallback) = self.planner();
        self.used_fallback.store(is_fallback, Ordering::Relaxed);
        planner.translate(req, ctx)
    }

    fn on_complete(&self, outcome: &Outcome) {
        self.last_planner().on_complete(outcome);
    }

    /// The selected version's reads and the fallback's: the fallback may plan any attempt, and
    /// the prompt is tokenized (or not) before the first.
    fn reads(&self) -> Reads {
        let fallback = self.fallback.as_ref().map_or(Reads::NOTHING, Served::reads);
        self.first.reads().union(fallback)
    }

    /// Count the fault against the selected version (quarantining it at the threshold) and hand
    /// the attempt to the fallback policy.
    fn fallback(&self, error: &PlanningError) -> Option<Arc<dyn Planner>> {
        if self.used_fallback.load(Ordering::Relaxed) {
            return None;
        }
        let selected = &self.first;
        if matches!(error, PlanningError::InvalidPlan(_)) {
            selected.slot.stats.error();
        }
        selected.fault(error);
        let fallback = self.fallback.as_ref()?;
        selected.shared.metrics.fallback(selected.name());
        tracing::info!(policy = %selected.name(), fallback = %fallback.name(), %error,
            "policy fault; the fallback policy plans this attempt");
        self.used_fallback.store(true, Ordering::Relaxed);
        Some(Arc::new(fallback.clone()))
    }
}
