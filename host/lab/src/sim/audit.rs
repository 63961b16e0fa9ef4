//! The simulation's invariants, checked as it runs and at its end (as BLIS checks its own):
//! every page of every pool accounted for at every step and all of them back at the end, no
//! leg or reservation left on an engine, every transfer started finished, time never going
//! back. A broken one is a bug of the lab, recorded rather than panicking, so that tests can
//! say which one and a run can refuse to report numbers built on it.

use switchyard_engine::scheduler::Gauges;

use super::Transfers;
use super::engine::Engine;
use crate::config::ClusterSpec;

/// Broken invariants, described; at most [`KEPT`] of them (a broken one usually breaks at
/// every step after).
#[derive(Debug, Default)]
pub(super) struct Audit {
    violations: Vec<String>,
    dropped: usize,
}

const KEPT: usize = 20;

impl Audit {
    pub fn violation(&mut self, what: String) {
        if self.violations.len() < KEPT {
            self.violations.push(what);
        } else {
            self.dropped += 1;
        }
    }

    pub fn check(&mut self, holds: bool, what: impl FnOnce() -> String) {
        if !holds {
            self.violation(what());
        }
    }

    /// After each of engine `e`'s steps: its pages in use and free make its whole pool, and
    /// the idle cached ones are among the free.
    pub fn engine(&mut self, e: usize, gauges: &Gauges, cluster: &ClusterSpec) {
        let total = cluster.kv_pages as usize;
        self.check(
            gauges.kv_pages_used + gauges.kv_pages_free == total
                && gauges.kv_pages_cached <= gauges.kv_pages_free,
            || format!("engine {e}: pages {gauges:?} do not make its pool of {total}"),
        );
    }

    /// Once every request has ended: every engine is empty (no page in use, nothing running,
    /// waiting or reserved, nothing in flight) and every transfer finished.
    pub fn at_end(&mut self, engines: &[Engine], transfers: &Transfers, cluster: &ClusterSpec) {
        for (e, engine) in engines.iter().enumerate() {
            let g = engine.core.gauges();
            self.engine(e, &g, cluster);
            self.check(
                g.kv_pages_used == 0 && g.running == 0 && g.waiting == 0 && g.reservations == 0,
                || format!("engine {e} still holds work after the last request: {g:?}"),
            );
            self.check(engine.in_flight == 0, || {
                format!(
                    "engine {e} counts {} legs in flight after the last request",
                    engine.in_flight
                )
            });
            self.check(engine.waiters.is_empty(), || {
                format!(
                    "engine {e} has {} legs still waiting for outputs",
                    engine.waiters.len()
                )
            });
        }
        self.check(transfers.started == transfers.completed, || {
            format!(
                "{} transfers started, {} completed",
                transfers.started, transfers.completed
            )
        });
    }

    pub fn into_violations(mut self) -> Vec<String> {
        if self.dropped > 0 {
            self.violations
                .push(format!("... and {} more", self.dropped));
        }
        self.violations
    }
}
