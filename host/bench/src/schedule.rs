//! Open-loop arrivals drawn from a seed, fixed before the run starts: a Poisson process, or a
//! gamma renewal process for traffic burstier (CV > 1) or smoother (CV < 1) than Poisson.
//!
//! Fixing the send times up front is what avoids coordinated omission: a request that the
//! server makes wait is still *due* at its scheduled time, and its latency counts from then.

use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Gamma};

const SCHEDULE_STREAM: u64 = 0x7363_6865_6475_6c65;

/// The gaps' coefficient of variation accepted for gamma arrivals: beyond these bounds the
/// distribution's shape (1 / CV²) is too extreme to sample meaningfully.
const MIN_CV: f64 = 0.01;
const MAX_CV: f64 = 100.0;

/// How inter-arrival gaps are distributed (their mean is always 1 / rate).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Arrivals {
    /// Exponential gaps: independent arrivals.
    Poisson,
    /// Gamma-distributed gaps with coefficient of variation `cv` (1 is Poisson's).
    Gamma {
        cv: f64,
        /// Gamma(1 / CV², CV²): mean 1, scaled by the mean gap when drawn.
        unit: Gamma<f64>,
    },
}

impl Arrivals {
    /// Gamma arrivals whose gaps have coefficient of variation `cv`.
    pub fn gamma(cv: f64) -> Result<Self, String> {
        if !(MIN_CV..=MAX_CV).contains(&cv) {
            return Err(format!(
                "the gamma CV must be in {MIN_CV}..={MAX_CV}, got {cv}"
            ));
        }
        let unit = Gamma::new(1.0 / (cv * cv), cv * cv).map_err(|e| format!("gamma({cv}): {e}"))?;
        Ok(Arrivals::Gamma { cv, unit })
    }

    /// `poisson` or `gamma:CV`, as the command line and reports write it.
    pub fn name(&self) -> String {
        match self {
            Arrivals::Poisson => "poisson".into(),
            Arrivals::Gamma { cv, .. } => format!("gamma:{cv}"),
        }
    }
}

/// Parses `poisson` or `gamma:CV`.
pub fn parse_arrivals(raw: &str) -> Result<Arrivals, String> {
    match raw.split_once(':') {
        None if raw == "poisson" => Ok(Arrivals::Poisson),
        Some(("gamma", cv)) => {
            let cv = cv
                .trim()
                .parse::<f64>()
                .map_err(|e| format!("bad CV {cv:?} in {raw:?}: {e}"))?;
            Arrivals::gamma(cv)
        }
        _ => Err(format!("expected poisson or gamma:CV, got {raw:?}")),
    }
}

/// Send offsets from the start of the run, as an endless iterator.
#[derive(Debug, Clone)]
pub struct ArrivalSchedule {
    rng: StdRng,
    arrivals: Arrivals,
    /// Mean gap in seconds (1 / rate).
    mean_gap: f64,
    elapsed: f64,
}

impl ArrivalSchedule {
    /// `rate` must be positive and finite (the configs check it).
    pub fn new(rate: f64, arrivals: Arrivals, seed: u64) -> Self {
        Self {
            rng: StdRng::seed_from_u64(seed ^ SCHEDULE_STREAM),
            arrivals,
            mean_gap: 1.0 / rate,
            elapsed: 0.0,
        }
    }

    fn next_gap(&mut self) -> f64 {
        match self.arrivals {
            Arrivals::Poisson => exponential(&mut self.rng, self.mean_gap),
            Arrivals::Gamma { unit, .. } => unit.sample(&mut self.rng) * self.mean_gap,
        }
    }
}

impl Iterator for ArrivalSchedule {
    type Item = Duration;

    /// The first request is due at once, each later one a gap after the last.
    fn next(&mut self) -> Option<Duration> {
        let due = Duration::try_from_secs_f64(self.elapsed).unwrap_or(Duration::MAX);
        self.elapsed += self.next_gap();
        Some(due)
    }
}

/// One exponential draw of mean `mean` by inversion; `1 - u` is in (0, 1], so `ln` is finite.
pub fn exponential(rng: &mut StdRng, mean: f64) -> f64 {
    let u: f64 = rng.random();
    -(1.0 - u).ln() * mean
}
