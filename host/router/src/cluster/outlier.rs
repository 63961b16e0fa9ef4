//! Outlier ejection: an endpoint whose calls keep failing of its own making is taken out of the
//! policy's snapshot for a while, longer each time it fails again, and readmitted on trial.
//!
//! ```text
//!            failure × consecutive_failures              ejection time passes
//!   serving ───────────────────────────────▶ ejected ─────────────────────────▶ on trial
//!      ▲                                        ▲                                  │
//!      │ success                                └──────── one failure ─────────────┤
//!      └───────────────────────────────────────────────── success ─────────────────┘
//! ```
//!
//! The n-th ejection in a row lasts `base_ejection × 2^(n-1)`, capped at `max_ejection`; a
//! success anywhere resets both counts. While ejected the readiness probe keeps running, and
//! an endpoint comes back only when its ejection time has passed *and* the probe answers
//! (`Cluster` combines the two): the half-open state is that first request on trial.
//!
//! What counts as a failure is the caller's decision (`ExecError::blames_endpoint`): refused
//! connections, timeouts, 5xx, broken or stalled streams. A client's 4xx never does, and a
//! failure on the prefill leg blames the prefill endpoint, not the decode one.

use std::time::Duration;

use tokio::time::Instant;

/// When endpoints are ejected, and for how long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutlierConfig {
    /// Consecutive failures that eject an endpoint; 0 turns ejection off.
    pub consecutive_failures: u32,
    /// The first ejection's length; each further ejection in a row doubles it.
    pub base_ejection: Duration,
    /// The longest an ejection lasts.
    pub max_ejection: Duration,
}

impl Default for OutlierConfig {
    fn default() -> Self {
        OutlierConfig {
            consecutive_failures: 3,
            base_ejection: Duration::from_secs(1),
            max_ejection: Duration::from_secs(30),
        }
    }
}

/// One endpoint's failure record.
#[derive(Debug, Default)]
pub(super) struct Outlier {
    consecutive: u32,
    /// Ejections since the last success: the exponent of the next ejection's length.
    ejections_in_a_row: u32,
    ejected_until: Option<Instant>,
    /// Readmitted after an ejection and not yet proven: one failure ejects again.
    on_trial: bool,
    /// Every ejection since the router started.
    total_ejections: u64,
    /// What the last failure was, for `/admin/endpoints` and the log.
    last_failure: Option<String>,
}

/// An ejection that just started, for the log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Ejected {
    pub duration: Duration,
    pub failures: u32,
}

impl Outlier {
    /// A call to the endpoint succeeded: it is serving. A call that started before an
    /// ejection and ends during it proves nothing about the trial to come.
    pub fn success(&mut self, now: Instant) {
        if self.is_ejected(now) {
            return;
        }
        self.consecutive = 0;
        self.ejections_in_a_row = 0;
        self.ejected_until = None;
        self.on_trial = false;
    }

    /// A call failed of the endpoint's own making; `Some` when this failure ejects it.
    pub fn failure(
        &mut self,
        config: &OutlierConfig,
        now: Instant,
        reason: String,
    ) -> Option<Ejected> {
        self.last_failure = Some(reason);
        if config.consecutive_failures == 0 || self.is_ejected(now) {
            return None;
        }
        self.consecutive += 1;
        if self.ejected_until.is_some() {
            // The ejection ran out: the endpoint is on trial, and this was its answer.
            self.on_trial = true;
            self.ejected_until = None;
        }
        if !self.on_trial && self.consecutive < config.consecutive_failures {
            return None;
        }
        let shift = self.ejections_in_a_row.min(16);
        let duration = config
            .base_ejection
            .saturating_mul(1 << shift)
            .min(config.max_ejection);
        let failures = self.consecutive;
        self.ejections_in_a_row += 1;
        self.total_ejections += 1;
        self.ejected_until = Some(now + duration);
        self.consecutive = 0;
        self.on_trial = false;
        Some(Ejected { duration, failures })
    }

    /// Whether the endpoint is out of the snapshot at `now`.
    pub fn is_ejected(&self, now: Instant) -> bool {
        self.ejected_until.is_some_and(|until| now < until)
    }

    /// What `/admin/endpoints` shows.
    pub fn view(&self, now: Instant) -> OutlierView {
        OutlierView {
            ejected_for_ms: self
                .ejected_until
                .filter(|&until| now < until)
                .map(|until| (until - now).as_millis() as u64),
            consecutive_failures: self.consecutive,
            ejections: self.total_ejections,
            last_failure: self.last_failure.clone(),
        }
    }
}

/// An endpoint's failure record as `/admin/endpoints` shows it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct OutlierView {
    /// Time left in the current ejection; `None`: not ejected.
    pub ejected_for_ms: Option<u64>,
    pub consecutive_failures: u32,
    /// Ejections since the router started.
    pub ejections: u64,
    pub last_failure: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    const CONFIG: OutlierConfig = OutlierConfig {
        consecutive_failures: 3,
        base_ejection: Duration::from_secs(1),
        max_ejection: Duration::from_secs(5),
    };

    fn fail(o: &mut Outlier, now: Instant) -> Option<Ejected> {
        o.failure(&CONFIG, now, "HTTP 500".into())
    }

    #[test]
    fn consecutive_failures_eject_and_a_success_in_between_resets_the_count() {
        let now = Instant::now();
        let mut o = Outlier::default();
        assert_eq!(fail(&mut o, now), None);
        assert_eq!(fail(&mut o, now), None);
        o.success(now);
        assert_eq!(fail(&mut o, now), None);
        assert_eq!(fail(&mut o, now), None);
        let ejected = fail(&mut o, now).expect("the third failure in a row ejects");
        assert_eq!(ejected.duration, Duration::from_secs(1));
        assert!(o.is_ejected(now));
        assert!(!o.is_ejected(now + Duration::from_secs(1)));
        assert_eq!(o.view(now).ejections, 1);
    }

    #[test]
    fn a_failure_on_trial_ejects_again_for_twice_as_long_up_to_the_cap() {
        let mut now = Instant::now();
        let mut o = Outlier::default();
        for _ in 0..3 {
            fail(&mut o, now);
        }
        let mut lengths = vec![];
        for _ in 0..4 {
            now += Duration::from_secs(10);
            let ejected = fail(&mut o, now).expect("one failure on trial ejects");
            lengths.push(ejected.duration.as_secs());
        }
        assert_eq!(lengths, [2, 4, 5, 5]);
        // Proven again: the next ejection takes three failures and starts short.
        o.success(now + Duration::from_secs(1));
        assert_eq!(
            fail(&mut o, now).map(|e| e.duration.as_secs()),
            None,
            "still ejected"
        );
        now += Duration::from_secs(10);
        o.success(now);
        assert_eq!(fail(&mut o, now), None);
        assert_eq!(fail(&mut o, now), None);
        assert_eq!(fail(&mut o, now).map(|e| e.duration.as_secs()), Some(1));
    }

    #[test]
    fn failures_while_ejected_do_not_extend_it_and_zero_turns_ejection_off() {
        let now = Instant::now();
        let mut o = Outlier::default();
        for _ in 0..3 {
            fail(&mut o, now);
        }
        assert_eq!(fail(&mut o, now + Duration::from_millis(500)), None);
        assert!(!o.is_ejected(now + Duration::from_secs(1)));
        assert_eq!(o.view(now).last_failure.as_deref(), Some("HTTP 500"));

        let off = OutlierConfig {
            consecutive_failures: 0,
            ..CONFIG
        };
        let mut o = Outlier::default();
        for _ in 0..10 {
            assert_eq!(o.failure(&off, now, "x".into()), None);
        }
        assert!(!o.is_ejected(now));
    }
}
