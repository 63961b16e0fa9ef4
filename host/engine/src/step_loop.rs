//! The engine's step loop: the thread that drives the [scheduler core](crate::scheduler) in
//! real time for the HTTP layer.
//!
//! Handlers never touch engine state: they send a [`Command`] and wait on a reply or an event
//! channel. The loop owns the core (so there are no locks), turns each command into a call on
//! it, and runs its steps one after another. A step's outputs go out when the step's modelled
//! time has passed on the wall clock (it sleeps what the model took less than the profile says),
//! so a client sees a step's tokens when that step would have ended on the hardware the
//! latency profile describes, exactly when the policy lab's simulator delivers them. With the
//! `null` profile steps cost nothing and their outputs go out at once.
//!
//! A request whose client went away (its channel closed) is cancelled in the core before the
//! next step, which frees its pages; a dropped [`SendLease`] hands its pages back the same way.
//! Metrics are published before every delivery, so a caller that reads them right after an
//! answer sees what the answer did (a reservation's pages, a lease held). A step's KV events go
//! to the publisher (`kv_events`) in the same delivery, before its answers.

use std::collections::HashMap;
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::time::Instant;

use tokio::sync::{mpsc, oneshot};

use crate::kv_events::Batches;
use crate::metrics::Metrics;
use crate::scheduler::{
    Core, CoreError, Counters, Event, FinishReason, GenRequest, Lease, Output, PrepRecvReply,
    RequestId, Time,
};

/// Where a generation's events go.
pub(crate) type Events = mpsc::UnboundedSender<Event>;

/// What the HTTP layer asks of the core.
#[derive(Debug)]
pub(crate) enum Command {
    /// `/v1/completions`: prefill and generate.
    Generate { request: GenRequest, events: Events },
    /// Prefill and generate, then keep the prompt's KV ([`Core::generate_and_hold`]): the
    /// lease goes to `hold` after the finishing event; a generation aborted or preempted
    /// drops `hold` instead.
    GenerateAndHold {
        request: GenRequest,
        events: Events,
        hold: oneshot::Sender<SendLease>,
    },
    /// [`Core::cancel_reservation`].
    CancelReservation { user: String },
    /// Reserve pages for `[0, end)`, waiting until they are free ([`Core::prep_recv`]).
    PrepRecv {
        user: String,
        request: GenRequest,
        end: usize,
        reply: oneshot::Sender<Result<PrepRecvReply, CoreError>>,
    },
    /// Generate from a reservation; positions before `begin` are in the pool already.
    StartGenerate {
        user: String,
        begin: usize,
        events: Events,
        reply: oneshot::Sender<Result<(), CoreError>>,
    },
    /// Prefill `tokens` (= `prompt[0:end]`) and lease the slots of `[begin, end)` for sending.
    PrefillForSend {
        tokens: Vec<u32>,
        begin: usize,
        reply: oneshot::Sender<SendLease>,
    },
}

/// Prefilled KV held until the lease drops: `slots[i]` holds the `i`-th position of the window
/// asked for.
///
/// Dropping it (transfer done, failed, or its task cancelled) hands the pages back to the core
/// over a channel of their own: not the command channel, whose disconnection is how the loop
/// learns to stop.
#[derive(Debug)]
pub struct SendLease {
    pub slots: Vec<u32>,
    id: RequestId,
    returns: Sender<RequestId>,
}

impl Drop for SendLease {
    fn drop(&mut self) {
        // The loop is gone when this fails, and with it the pages.
        let _ = self.returns.send(self.id);
    }
}

/// Who waits for a request's outputs.
enum Waiter {
    Events(Events),
    /// A held generation: its events, then its prompt's lease.
    EventsThenLease(Events, oneshot::Sender<SendLease>),
    Lease(oneshot::Sender<SendLease>),
    Reservation(oneshot::Sender<Result<PrepRecvReply, CoreError>>),
}

impl Waiter {
    /// The caller went away. A held generation is judged by its events, as any generation.
    fn gone(&self) -> bool {
        match self {
            Waiter::Events(events) | Waiter::EventsThenLease(events, _) => events.is_closed(),
            Waiter::Lease(reply) => reply.is_closed(),
            Waiter::Reservation(reply) => reply.is_closed(),
        }
    }
}

/// The core, the callers waiting on it, and what it published so far.
pub(crate) struct StepLoop {
    core: Core,
    metrics: Metrics,
    published: Counters,
    waiters: HashMap<RequestId, Waiter>,
    /// Where dropped [`SendLease`]s send their id, and the receiving end the loop drains.
    lease_returns: (Sender<RequestId>, Receiver<RequestId>),
    /// The KV-event publisher, with `--kv-events`.
    kv_events: Option<Batches>,
}

impl StepLoop {
    pub(crate) fn new(core: Core, metrics: Metrics) -> Self {
        StepLoop {
            core,
            metrics,
            published: Counters::default(),
            waiters: HashMap::new(),
            lease_returns: std::sync::mpsc::channel(),
            kv_events: None,
        }
    }

    /// Hands the core's KV events ([`Output::KvEvents`]) to the publisher as they fall due.
    pub(crate) fn publishing(mut self, batches: Batches) -> Self {
        self.kv_events = Some(batches);
        self
    }

    /// Runs steps until every command sender is gone, each step's outputs delivered when its
    /// modelled time has passed.
    pub(crate) fn run(mut self, commands: Receiver<Command>) {
        let clock = WallClock::start();
        while self.take_commands(&commands, &clock) {
            let end = self.turn(clock.now());
            clock.sleep_until(end);
            self.deliver(end);
        }
    }

    /// Waits for a command while the core has nothing to do before its next turn, then drains
    /// the queue. `false` when the engine is shutting down.
    fn take_commands(&mut self, commands: &Receiver<Command>, clock: &WallClock) -> bool {
        let now = clock.now();
        let first = match self.core.next_turn(now) {
            Some(at) if at <= now => None,
            Some(at) => match commands.recv_timeout(at.saturating_since(now)) {
                Ok(command) => Some(command),
                Err(RecvTimeoutError::Timeout) => None,
                Err(RecvTimeoutError::Disconnected) => return false,
            },
            None => match commands.recv() {
                Ok(command) => Some(command),
                Err(_) => return false,
            },
        };
        if let Some(command) = first {
            self.handle(command, clock.now());
        }
        loop {
            match commands.try_recv() {
                Ok(command) => self.handle(command, clock.now()),
                Err(TryRecvError::Empty) => return true,
                Err(TryRecvError::Disconnected) => return false,
            }
        }
    }

    /// Turns a command into a call on the core; answers at once what it answers at once.
    pub(crate) fn handle(&mut self, command: Command, now: Time) {
        match command {
            Command::Generate { request, events } => {
                let id = self.core.generate(request);
                self.waiters.insert(id, Waiter::Events(events));
            }
            Command::GenerateAndHold {
                request,
                events,
                hold,
            } => {
                let id = self.core.generate_and_hold(request);
                self.waiters
                    .insert(id, Waiter::EventsThenLease(events, hold));
            }
            Command::CancelReservation { user } => self.core.cancel_reservation(&user, now),
            Command::PrepRecv {
                user,
                request,
                end,
                reply,
            } => match self.core.prep_recv(user, request, end) {
                Ok(id) => {
                    self.waiters.insert(id, Waiter::Reservation(reply));
                }
                Err(e) => {
                    let _ = reply.send(Err(e));
                }
            },
            Command::StartGenerate {
                user,
                begin,
                events,
                reply,
            } => {
                let started = self.core.start_generate(user, begin);
                if let Ok(id) = started {
                    self.waiters.insert(id, Waiter::Events(events));
                }
                let _ = reply.send(started.map(|_| ()));
            }
            Command::PrefillForSend {
                tokens,
                begin,
                reply,
            } => {
                let id = self.core.prefill_for_send(tokens, begin);
                self.waiters.insert(id, Waiter::Lease(reply));
            }
        }
    }

    /// One step at `now` after the leases and callers that went away are handed back; what it
    /// answers at once is delivered. Returns when the step's own outputs are due
    /// ([`StepLoop::deliver`] them then).
    pub(crate) fn turn(&mut self, now: Time) -> Time {
        while let Ok(id) = self.lease_returns.1.try_recv() {
            self.core.release_lease(id);
        }
        let gone: Vec<RequestId> = self
            .waiters
            .iter()
            .filter(|(_, waiter)| waiter.gone())
            .map(|(id, _)| *id)
            .collect();
        for id in gone {
            self.waiters.remove(&id);
            self.core.cancel(id, now);
        }
        let step = self.core.step(now);
        self.deliver(now);
        step.end
    }

    /// Publishes the metrics, then hands every output due by `now` to its waiter.
    pub(crate) fn deliver(&mut self, now: Time) {
        let outputs = self.core.take_due(now);
        self.publish();
        for output in outputs {
            self.hand_over(output, now);
        }
    }

    fn hand_over(&mut self, output: Output, now: Time) {
        match output {
            Output::Event { id, event } => {
                let Some(waiter) = self.waiters.remove(&id) else {
                    return;
                };
                let finish = event.finish.map(|(reason, _)| reason);
                let (events, hold) = match waiter {
                    Waiter::Events(events) => (events, None),
                    Waiter::EventsThenLease(events, hold) => (events, Some(hold)),
                    other => {
                        self.waiters.insert(id, other);
                        return;
                    }
                };
                if events.send(event).is_err() {
                    // The generation is over if this was its last event; if not, it stops here.
                    self.core.cancel(id, now);
                    return;
                }
                let next = match (finish, hold) {
                    (None, None) => Some(Waiter::Events(events)),
                    (None, Some(hold)) => Some(Waiter::EventsThenLease(events, hold)),
                    // A preempted generation keeps nothing: dropping `hold` says so.
                    (Some(FinishReason::Preempt), _) | (Some(_), None) => None,
                    // The lease follows in the same delivery.
                    (Some(_), Some(hold)) => Some(Waiter::Lease(hold)),
                };
                if let Some(next) = next {
                    self.waiters.insert(id, next);
                }
            }
            Output::Reserved { id, reply } => {
                if let Some(Waiter::Reservation(answer)) = self.waiters.remove(&id)
                    && answer.send(Ok(reply)).is_err()
                {
                    // Nobody learnt the slots.
                    self.core.cancel(id, now);
                }
            }
            Output::Leased(Lease { id, slots, .. }) => {
                let lease = SendLease {
                    slots,
                    id,
                    returns: self.lease_returns.0.clone(),
                };
                // A caller that went away drops the lease right here, which returns the pages.
                if let Some(Waiter::Lease(reply)) = self.waiters.remove(&id) {
                    let _ = reply.send(lease);
                }
            }
            Output::KvEvents(events) => {
                if let Some(publisher) = &self.kv_events {
                    publisher.send(events);
                }
            }
        }
    }

    /// The core's gauges as they are, and its counters' growth since the last publication.
    fn publish(&mut self) {
        let m = &self.metrics;
        let g = self.core.gauges();
        m.running.set(g.running as i64);
        m.waiting.set(g.waiting as i64);
        m.reservations.set(g.reservations as i64);
        m.kv_pages_used.set(g.kv_pages_used as i64);
        m.kv_pages_free.set(g.kv_pages_free as i64);
        m.kv_pages_cached.set(g.kv_pages_cached as i64);
        let now = self.core.counters();
        let was = std::mem::replace(&mut self.published, now);
        let grown = [
            (&m.preemptions, now.preemptions - was.preemptions),
            (&m.prompt_tokens, now.prompt_tokens - was.prompt_tokens),
            (
                &m.generated_tokens,
                now.generated_tokens - was.generated_tokens,
            ),
            (
                &m.prefix_matched_tokens,
                now.prefix_matched_tokens - was.prefix_matched_tokens,
            ),
            (
                &m.remote_send_received,
                now.remote_send_received - was.remote_send_received,
            ),
            (
                &m.reservations_expired,
                now.reservations_expired - was.reservations_expired,
            ),
            (
                &m.requests_aborted,
                now.requests_aborted - was.requests_aborted,
            ),
        ];
        for (counter, by) in grown {
            if by > 0 {
                counter.inc_by(by);
            }
        }
    }
}

/// The core's clock read off the wall clock: microseconds since the loop started.
struct WallClock {
    start: Instant,
}

impl WallClock {
    fn start() -> Self {
        WallClock {
            start: Instant::now(),
        }
    }

    /// Rounded down, so a step's end (rounded up) is never reached before its cost elapsed.
    fn now(&self) -> Time {
        let micros = self.start.elapsed().as_micros();
        Time::from_micros(u64::try_from(micros).unwrap_or(u64::MAX))
    }

    fn sleep_until(&self, at: Time) {
        let wait = at.saturating_since(self.now());
        if !wait.is_zero() {
            std::thread::sleep(wait);
        }
    }
}
