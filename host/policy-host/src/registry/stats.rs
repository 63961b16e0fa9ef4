//! Per-policy call counters and call-time percentiles for `/admin/policies`. The percentiles
//! are over the most recent calls (a bounded window), so they follow the version serving now
//! rather than averaging over the router's whole life.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;

/// Calls kept for the percentiles.
const WINDOW: usize = 1024;

#[derive(Debug, Default)]
pub(crate) struct CallStats {
    calls: AtomicU64,
    errors: AtomicU64,
    recent: Mutex<VecDeque<Duration>>,
}

/// A copy of the counters, with p50/p99 of the recent call times in microseconds.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct CallSummary {
    pub calls: u64,
    pub errors: u64,
    pub p50_us: Option<f64>,
    pub p99_us: Option<f64>,
}

impl CallStats {
    /// One `translate-request` call that took `took`.
    pub(crate) fn call(&self, took: Duration) {
        self.calls.fetch_add(1, Ordering::Relaxed);
        let mut recent = self.recent.lock();
        if recent.len() == WINDOW {
            recent.pop_front();
        }
        recent.push_back(took);
    }

    /// One call whose answer could not be used (an error or an invalid plan).
    pub(crate) fn error(&self) {
        self.errors.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn summary(&self) -> CallSummary {
        let mut times: Vec<Duration> = self.recent.lock().iter().copied().collect();
        times.sort_unstable();
        CallSummary {
            calls: self.calls.load(Ordering::Relaxed),
            errors: self.errors.load(Ordering::Relaxed),
            p50_us: percentile(&times, 0.50),
            p99_us: percentile(&times, 0.99),
        }
    }
}

/// Nearest-rank percentile of sorted `times`, in microseconds.
fn percentile(times: &[Duration], q: f64) -> Option<f64> {
    let last = times.len().checked_sub(1)?;
    let rank = ((times.len() as f64 * q).ceil() as usize).saturating_sub(1);
    Some(times[rank.min(last)].as_secs_f64() * 1e6)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_nearest_rank_over_the_recent_window() {
        let stats = CallStats::default();
        assert_eq!(stats.summary().p50_us, None);
        for us in 1..=100 {
            stats.call(Duration::from_micros(us));
        }
        stats.error();
        let s = stats.summary();
        assert_eq!((s.calls, s.errors), (100, 1));
        assert_eq!(s.p50_us, Some(50.0));
        assert_eq!(s.p99_us, Some(99.0));
        for _ in 0..WINDOW {
            stats.call(Duration::from_micros(7));
        }
        assert_eq!(
            stats.summary().p99_us,
            Some(7.0),
            "old calls left the window"
        );
    }
}
