//! The retry budget: retries, across every request of the router, may add at most a fraction
//! of the recent request rate plus a small floor (Finagle's `RetryBudget`, Envoy's retry
//! budgets). During an outage every request fails and wants retries; without a budget the
//! surviving engines would see the load multiplied by the attempts per request just when they
//! can least take it.
//!
//! The window is the last [`WINDOW`] in one-second buckets: a retry is allowed while the
//! retries in the window stay below `min_per_sec × WINDOW + ratio × requests in the window`.
//! Continuations after a preemption are not retries (the request made progress) and never
//! draw on the budget.

use std::time::Duration;

use parking_lot::Mutex;
use tokio::time::Instant;

/// How far back the budget looks.
pub const WINDOW: Duration = Duration::from_secs(10);
const BUCKETS: usize = 10;

/// What the budget allows.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RetryBudgetConfig {
    /// Retries allowed per request in the window (0.2: one retry for every five requests).
    pub ratio: f64,
    /// Retries per second allowed whatever the request rate, so a quiet router still retries.
    pub min_per_sec: u32,
}

impl Default for RetryBudgetConfig {
    fn default() -> Self {
        RetryBudgetConfig {
            ratio: 0.2,
            min_per_sec: 10,
        }
    }
}

/// Requests and retries over the last [`WINDOW`], shared by every request.
#[derive(Debug)]
pub struct RetryBudget {
    config: RetryBudgetConfig,
    start: Instant,
    window: Mutex<Window>,
}

#[derive(Debug, Default)]
struct Window {
    /// The second (since `start`) that `buckets[second % BUCKETS]` counts.
    second: [u64; BUCKETS],
    requests: [u64; BUCKETS],
    retries: [u64; BUCKETS],
}

impl Window {
    /// The bucket of `second`, emptied if it last counted an older second.
    fn bucket(&mut self, second: u64) -> usize {
        let i = (second % BUCKETS as u64) as usize;
        if self.second[i] != second {
            self.second[i] = second;
            self.requests[i] = 0;
            self.retries[i] = 0;
        }
        i
    }

    /// Requests and retries counted in the window ending at `second`.
    fn totals(&self, second: u64) -> (u64, u64) {
        (0..BUCKETS)
            .filter(|&i| second.saturating_sub(self.second[i]) < BUCKETS as u64)
            .fold((0, 0), |(req, ret), i| {
                (req + self.requests[i], ret + self.retries[i])
            })
    }
}

impl RetryBudget {
    pub fn new(config: RetryBudgetConfig) -> Self {
        RetryBudget {
            config,
            start: Instant::now(),
            window: Mutex::new(Window::default()),
        }
    }

    /// A new client request arrived.
    pub fn deposit(&self) {
        let second = self.second();
        let mut w = self.window.lock();
        let i = w.bucket(second);
        w.requests[i] += 1;
    }

    /// Take one retry from the budget; `false` (and nothing taken) when it is spent.
    pub fn try_withdraw(&self) -> bool {
        let second = self.second();
        let mut w = self.window.lock();
        let i = w.bucket(second);
        let (requests, retries) = w.totals(second);
        let floor = f64::from(self.config.min_per_sec) * WINDOW.as_secs_f64();
        if (retries as f64) < floor + self.config.ratio * requests as f64 {
            w.retries[i] += 1;
            true
        } else {
            false
        }
    }

    fn second(&self) -> u64 {
        // The buckets start at 1 so that a zeroed bucket never passes for second 0.
        self.start.elapsed().as_secs() + 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn withdrawals(budget: &RetryBudget, tries: u32) -> u32 {
        (0..tries).filter(|_| budget.try_withdraw()).count() as u32
    }

    #[tokio::test(start_paused = true)]
    async fn retries_are_capped_by_the_floor_plus_a_share_of_requests() {
        let budget = RetryBudget::new(RetryBudgetConfig {
            ratio: 0.2,
            min_per_sec: 1,
        });
        // No requests: the floor alone, 1 per second over 10 s.
        assert_eq!(withdrawals(&budget, 100), 10);
        for _ in 0..100 {
            budget.deposit();
        }
        // 100 requests add 20 more.
        assert_eq!(withdrawals(&budget, 100), 20);
    }

    #[tokio::test(start_paused = true)]
    async fn the_window_forgets_what_is_older_than_ten_seconds() {
        let budget = RetryBudget::new(RetryBudgetConfig {
            ratio: 0.5,
            min_per_sec: 0,
        });
        for _ in 0..10 {
            budget.deposit();
        }
        assert_eq!(withdrawals(&budget, 100), 5);
        tokio::time::advance(Duration::from_secs(5)).await;
        // Still inside the window: spent.
        assert_eq!(withdrawals(&budget, 100), 0);
        tokio::time::advance(Duration::from_secs(6)).await;
        // The requests and retries of 11 s ago are forgotten: nothing to draw on.
        assert_eq!(withdrawals(&budget, 100), 0);
        for _ in 0..4 {
            budget.deposit();
        }
        assert_eq!(withdrawals(&budget, 100), 2);
    }
}
