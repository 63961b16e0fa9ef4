//! Open-loop arrivals: a Poisson process drawn from a seed, fixed before the run starts.
//!
//! Fixing the send times up front is what avoids coordinated omission: a request that the
//! server makes wait is still *due* at its scheduled time, and its latency counts from then.

use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const SCHEDULE_STREAM: u64 = 0x7363_6865_6475_6c65;

/// Send offsets from the start of the run, as an endless iterator.
#[derive(Debug, Clone)]
pub struct PoissonSchedule {
    rng: StdRng,
    /// Mean gap in seconds (1 / rate).
    mean_gap: f64,
    elapsed: f64,
}

impl PoissonSchedule {
    /// `rate` must be positive and finite (the config checks it).
    pub fn new(rate: f64, seed: u64) -> Self {
        Self {
            rng: StdRng::seed_from_u64(seed ^ SCHEDULE_STREAM),
            mean_gap: 1.0 / rate,
            elapsed: 0.0,
        }
    }

    /// One exponential gap by inversion; `1 - u` is in (0, 1], so `ln` is finite.
    fn next_gap(&mut self) -> f64 {
        let u: f64 = self.rng.random();
        -(1.0 - u).ln() * self.mean_gap
    }
}

impl Iterator for PoissonSchedule {
    type Item = Duration;

    /// The first request is due at once, each later one an exponential gap after the last.
    fn next(&mut self) -> Option<Duration> {
        let due = Duration::try_from_secs_f64(self.elapsed).unwrap_or(Duration::MAX);
        self.elapsed += self.next_gap();
        Some(due)
    }
}
