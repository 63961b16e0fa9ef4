//! The core's clock: whole microseconds since its driver started it. The engine's step loop
//! reads it off the wall clock; a simulator advances it itself. Either way the core never
//! looks at a clock: every method that needs the time takes it.

use std::ops::Add;
use std::time::Duration;

/// A point on the core's clock, in whole microseconds since its start.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Time(u64);

impl Time {
    pub const ZERO: Time = Time(0);

    pub const fn from_micros(micros: u64) -> Time {
        Time(micros)
    }

    pub const fn as_micros(self) -> u64 {
        self.0
    }

    /// How long after `earlier` this is; zero if it is not after it.
    pub fn saturating_since(self, earlier: Time) -> Duration {
        Duration::from_micros(self.0.saturating_sub(earlier.0))
    }
}

/// A time `d` later, rounded *up* to a whole microsecond: what is due then is never due before
/// `d` has fully elapsed.
impl Add<Duration> for Time {
    type Output = Time;

    fn add(self, d: Duration) -> Time {
        let micros = d.as_nanos().div_ceil(1_000);
        Time(
            self.0
                .saturating_add(u64::try_from(micros).unwrap_or(u64::MAX)),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adding_a_duration_never_lands_before_it_elapsed() {
        let t = Time::from_micros(10);
        assert_eq!(t + Duration::from_nanos(1), Time::from_micros(11));
        assert_eq!(t + Duration::from_micros(5), Time::from_micros(15));
        assert_eq!(t + Duration::ZERO, t);
        assert_eq!(
            (t + Duration::from_nanos(1_500)).saturating_since(t),
            Duration::from_micros(2)
        );
        assert_eq!(
            t.saturating_since(t + Duration::from_secs(1)),
            Duration::ZERO
        );
        assert_eq!(
            Time::from_micros(u64::MAX) + Duration::from_secs(1),
            Time::from_micros(u64::MAX)
        );
    }
}
