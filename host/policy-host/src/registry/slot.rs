//! One policy name in the registry: the version serving now (swapped atomically), what the last
//! reload did, and the quarantine bookkeeping of each version.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime};

use arc_swap::ArcSwapOption;
use parking_lot::Mutex;

use super::stats::CallStats;
use crate::Policy;

/// When a version is quarantined: `faults` faults (trap, deadline, memory cap, `internal` error,
/// invalid plan) within `window`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuarantineRule {
    pub faults: u32,
    pub window: Duration,
}

impl Default for QuarantineRule {
    fn default() -> Self {
        QuarantineRule {
            faults: 5,
            window: Duration::from_secs(30),
        }
    }
}

/// One loaded version of a policy. Requests hold an `Arc` of the version they started with, so
/// a swap never changes the policy under a request in flight.
pub(crate) struct Version {
    pub(super) policy: Policy,
    /// The JSON config its `init` got (`None`: `{}`), part of what makes a version "new".
    pub(super) config: Option<String>,
    pub(super) loaded_at: SystemTime,
    /// File change to serving, when this version came from a reload.
    pub(super) reload_ms: Option<f64>,
    quarantined: AtomicBool,
    faults: Mutex<VecDeque<Instant>>,
}

impl Version {
    pub(super) fn new(policy: Policy, config: Option<String>) -> Self {
        Version {
            policy,
            config,
            loaded_at: SystemTime::now(),
            reload_ms: None,
            quarantined: AtomicBool::new(false),
            faults: Mutex::new(VecDeque::new()),
        }
    }

    pub(super) fn is_quarantined(&self) -> bool {
        self.quarantined.load(Ordering::Acquire)
    }

    /// Count one fault at `now`; true when this fault put the version in quarantine.
    pub(super) fn record_fault(&self, rule: QuarantineRule, now: Instant) -> bool {
        let mut faults = self.faults.lock();
        while faults
            .front()
            .is_some_and(|&at| now.duration_since(at) > rule.window)
        {
            faults.pop_front();
        }
        faults.push_back(now);
        let threshold = usize::try_from(rule.faults.max(1)).unwrap_or(usize::MAX);
        faults.len() >= threshold && !self.quarantined.swap(true, Ordering::AcqRel)
    }
}

/// How the last reload attempt of a slot ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ReloadResult {
    /// The new version is serving.
    Swapped,
    /// The file's bytes and config are those of the version serving: nothing to do.
    Unchanged,
    /// The candidate was refused; the previous version (if any) keeps serving.
    Failed,
}

/// The last reload attempt, for operators (and tests waiting for a swap).
#[derive(Debug, Clone, serde::Serialize)]
pub struct LastReload {
    /// sha256 of the bytes that were tried (absent when the file could not be read).
    pub sha256: Option<String>,
    pub result: ReloadResult,
    /// From the file change (or the admin request) to the new version serving or the refusal.
    pub ms: f64,
}

/// What is known about a slot besides its serving version.
#[derive(Debug, Default)]
pub(super) struct SlotStatus {
    pub(super) source: Option<PathBuf>,
    pub(super) last_error: Option<String>,
    pub(super) last_reload: Option<LastReload>,
    pub(super) reloads: u64,
    pub(super) reload_failures: u64,
}

/// A policy name and everything the registry keeps for it.
pub(crate) struct Slot {
    pub(super) name: String,
    pub(super) serving: ArcSwapOption<Version>,
    pub(super) status: Mutex<SlotStatus>,
    pub(super) stats: CallStats,
    /// Serializes reloads of this policy: two file events in a row must not race to swap.
    pub(super) reloading: tokio::sync::Mutex<()>,
}

impl Slot {
    pub(super) fn new(name: String, source: PathBuf) -> Self {
        Slot {
            name,
            serving: ArcSwapOption::empty(),
            status: Mutex::new(SlotStatus {
                source: Some(source),
                ..SlotStatus::default()
            }),
            stats: CallStats::default(),
            reloading: tokio::sync::Mutex::new(()),
        }
    }

    pub(super) fn current(&self) -> Option<Arc<Version>> {
        self.serving.load_full()
    }
}
