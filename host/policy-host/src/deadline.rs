//! The deadline of one guest call, counted in the CPU time of the thread that runs it.
//!
//! A wall-clock deadline faults a healthy policy whenever the machine is busy: a call that
//! needs 100 µs of CPU but waits 60 ms for one (other processes, other requests, a
//! saturated VM) would be stopped and counted toward quarantine for the machine's load, not for
//! anything it did. So a call is charged only for what it did: the CPU time its thread used
//! since the call began (`CLOCK_THREAD_CPUTIME_ID`; a guest call never leaves its thread),
//! plus the wall time it spent blocked in a host call by its own choice (WASI `poll`, e.g. a
//! sleep; see `blocking_io`).
//!
//! Reading a thread's CPU clock is a system call (no vDSO serves it), and a request makes two
//! guest calls: a call starts from the thread's last reading when that is at most
//! [`START_READING_REUSE`] old, so it may be charged that much of the CPU its thread used just
//! before it began (never less than it used).
//!
//! The epoch ticker still drives the checks: the store's epoch deadline is set to the budget in
//! wall-clock ticks, and when it is reached [`CallClock::on_epoch`] looks at the CPU time.
//! A call that was starved has used less than its budget and is given the rest; a call that
//! spent its budget computing is interrupted. So a runaway guest stops after its budget plus at
//! most a tick (two when it was starved before a check: the next check comes a tick after the
//! rest of the budget could have been used, from the tick it is set on), more only when the
//! ticker thread itself waits for a CPU; and a guest starved of CPU is never stopped for it.

use std::cell::Cell;
use std::time::{Duration, Instant};

use wasmtime::UpdateDeadline;

use super::wasm::EPOCH_TICK;

/// The budget of the call running in a store, and what it has used.
#[derive(Debug, Default)]
pub(super) struct CallClock {
    budget: Duration,
    /// The thread's CPU time when the call began.
    cpu_at_start: Duration,
    /// Wall time the call spent blocked in host calls it chose to make (sleeping, polling).
    waited: Duration,
    /// The call used its whole budget and was stopped.
    overran: bool,
}

impl CallClock {
    /// A call with `budget` begins on this thread. Returns the epoch deadline to set, in ticks.
    pub(super) fn start(&mut self, budget: Duration) -> u64 {
        *self = CallClock {
            budget,
            cpu_at_start: thread_cpu_time_within(START_READING_REUSE),
            waited: Duration::ZERO,
            overran: false,
        };
        ticks(budget)
    }

    /// CPU time and chosen waits since the call began.
    pub(super) fn used(&self) -> Duration {
        thread_cpu_time().saturating_sub(self.cpu_at_start) + self.waited
    }

    /// What is left of the budget (zero once spent).
    pub(super) fn remaining(&self) -> Duration {
        self.budget.saturating_sub(self.used())
    }

    /// The call spent `waited` blocked in a host call it chose to make.
    pub(super) fn charge_wait(&mut self, waited: Duration) {
        self.waited += waited;
    }

    /// The call is being stopped for running past its budget (also while blocked).
    pub(super) fn overrun(&mut self) {
        self.overran = true;
    }

    /// Whether the call was stopped for running past its budget.
    pub(super) fn overran(&self) -> bool {
        self.overran
    }

    pub(super) fn budget(&self) -> Duration {
        self.budget
    }

    /// The store's epoch deadline was reached: stop the call if it used its budget, else let
    /// it run until the rest of the budget could have been used.
    pub(super) fn on_epoch(&mut self) -> UpdateDeadline {
        let remaining = self.remaining();
        if remaining.is_zero() {
            self.overrun();
            return UpdateDeadline::Interrupt;
        }
        UpdateDeadline::Continue(ticks(remaining))
    }
}

/// Epoch ticks until `budget` could have been used: rounded up, plus one because the current
/// tick may end at once.
fn ticks(budget: Duration) -> u64 {
    let tick = EPOCH_TICK.as_nanos().max(1);
    let ticks = budget.as_nanos().div_ceil(tick);
    u64::try_from(ticks).unwrap_or(u64::MAX).saturating_add(1)
}

/// How old a reading of the thread's CPU time may be and still start a call (see the module
/// doc): at most this much of the thread's CPU time before a call is charged to it, against
/// budgets of tens of milliseconds, and a busy worker reads its clock about once per
/// millisecond instead of twice per request.
pub(super) const START_READING_REUSE: Duration = Duration::from_millis(1);

thread_local! {
    /// This thread's last reading of its CPU time, and when (wall clock) it was taken.
    static LAST_READING: Cell<Option<(Instant, Duration)>> = const { Cell::new(None) };
}

/// The calling thread's CPU time, read less than `within` ago: never more than it is now.
fn thread_cpu_time_within(within: Duration) -> Duration {
    let now = Instant::now();
    LAST_READING.with(|last| match last.get() {
        Some((at, cpu)) if now.saturating_duration_since(at) < within => cpu,
        _ => {
            let cpu = thread_cpu_time();
            last.set(Some((now, cpu)));
            cpu
        }
    })
}

/// CPU time the calling thread has used since it started.
pub(super) fn thread_cpu_time() -> Duration {
    let now = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    let secs = u64::try_from(now.tv_sec).unwrap_or(0);
    let nanos = u32::try_from(now.tv_nsec).unwrap_or(0);
    Duration::new(secs, nanos)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_that_sleeps_uses_no_budget_and_one_that_spins_does() {
        let mut clock = CallClock::default();
        clock.start(Duration::from_millis(20));
        std::thread::sleep(Duration::from_millis(60));
        assert!(
            matches!(clock.on_epoch(), UpdateDeadline::Continue(_)),
            "slept {:?} of wall time, used {:?}",
            Duration::from_millis(60),
            clock.used()
        );
        assert!(!clock.overran());
        let spin_until = thread_cpu_time() + Duration::from_millis(25);
        while thread_cpu_time() < spin_until {
            std::hint::spin_loop();
        }
        assert!(matches!(clock.on_epoch(), UpdateDeadline::Interrupt));
        assert!(clock.overran());
    }

    #[test]
    fn a_recent_reading_of_the_thread_clock_starts_a_call_and_an_old_one_does_not() {
        let cpu = thread_cpu_time();
        let earlier = cpu.saturating_sub(Duration::from_millis(1));
        LAST_READING.with(|last| last.set(Some((Instant::now(), earlier))));
        assert_eq!(thread_cpu_time_within(Duration::from_secs(3600)), earlier);
        let fresh = thread_cpu_time_within(Duration::ZERO);
        assert!(fresh >= cpu, "a fresh reading: {fresh:?} < {cpu:?}");
        assert_eq!(
            LAST_READING.with(Cell::get).map(|(_, cpu)| cpu),
            Some(fresh)
        );
    }

    #[test]
    fn chosen_waits_count_against_the_budget() {
        let mut clock = CallClock::default();
        clock.start(Duration::from_millis(20));
        clock.charge_wait(Duration::from_millis(30));
        assert_eq!(clock.remaining(), Duration::ZERO);
        assert!(matches!(clock.on_epoch(), UpdateDeadline::Interrupt));
    }

    #[test]
    fn the_first_check_comes_after_the_budget_in_ticks() {
        assert_eq!(ticks(EPOCH_TICK * 10), 11);
        assert_eq!(ticks(EPOCH_TICK * 10 + Duration::from_nanos(1)), 12);
        assert_eq!(ticks(Duration::ZERO), 1);
    }
}
