//! One simulation: a trace replayed on a simulated cluster, planned by one policy, on a
//! virtual clock in whole microseconds, on one thread, with no timer but its own agenda.
//!
//! ```text
//!  arrivals ──▶ attempt: plan (policy, fallback) → validate → route ──▶ engine cores
//!     ▲            ▲                                                      │ outputs, each due
//!     │            └── retry / continue after preemption, with backoff    │ when its step ends
//!  agenda ◀── turns and step ends, transfers, probes, deadlines ◀─────────┘
//! ```
//!
//! Each engine is the reference engine's scheduler core with a model that costs nothing,
//! driven the way its step loop drives it: a step at a time, a step's outputs handed out when
//! its modelled cost has passed, a turn at once after any command and otherwise when the core
//! asks for one. The router's side is mirrored from `switchyard-router`: each attempt asks the
//! policy for a plan against a snapshot of the endpoints (in-flight counts exact, the engines'
//! load as last probed), validates it, and runs it the way the endpoints' protocol does (MLC's
//! prep_recv → remote_send → start_generate, vLLM's pull, SGLang's push, or a forward); a
//! preempted generation continues with the tokens already delivered; a policy that faults is
//! replaced for the attempt by the fallback; the policy hears every outcome.
//!
//! Ties at one instant are taken in the order they were scheduled, every random draw comes
//! from the run's seed, and nothing iterates a hash map where its order could matter, so the
//! same inputs give the same run.

mod attempt;
mod audit;
mod engine;
mod kv;
mod queue;
mod request;
#[cfg(test)]
mod tests;

use std::sync::Arc;
use std::time::Duration;

use indicatif::ProgressBar;
use rand::SeedableRng;
use rand::rngs::StdRng;
use switchyard_bench::RequestOutcome;
use switchyard_bench::trace::ScheduledRequest;
use switchyard_contract::{EndpointSnapshot, Health, address_hash};
use switchyard_engine::scheduler::{Backend, Core, Counters, Output, Time};

use crate::config::ClusterSpec;
use crate::policies::{Planners, SimClock};
use audit::Audit;
use engine::{Engine, Leg, Waiter};
use kv::{KvView, Published};
use queue::Agenda;
use request::Request;

pub use engine::Load;
pub use kv::KvPredictions;
pub use request::Ended;

/// What happens at a point of virtual time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Event {
    /// Request `n` of the replay arrives.
    Arrival(usize),
    /// An engine's turn, unless a command brought it forward (its `epoch` moved on).
    Turn { engine: usize, epoch: u64 },
    /// An engine's step has taken its modelled time: its outputs are out.
    StepEnd(usize),
    /// KV leased on `prefill` reached the decode engine of an attempt.
    TransferDone {
        request: usize,
        attempt: u32,
        prefill: usize,
        lease: switchyard_engine::scheduler::RequestId,
    },
    /// The backoff before a request's next attempt is over.
    Retry(usize),
    /// A request's timeout, counted from its arrival.
    Deadline(usize),
    /// The router reads every engine's load.
    Probe,
    /// The oldest batch of KV events in transit reaches the router's index.
    KvEventsArrive,
}

/// Everything one simulation produced.
#[derive(Debug)]
pub struct SimResult {
    /// One per request, in replay order, as `switchyard bench` records a real run.
    pub outcomes: Vec<RequestOutcome>,
    pub ended: Vec<Ended>,
    /// From the first arrival until the last request ended.
    pub duration: Duration,
    pub engines: Vec<EngineStats>,
    pub transfers: Transfers,
    /// Attempts the policy faulted on (the fallback, if any, planned them).
    pub policy_faults: u64,
    /// How well the index's `cached-prefix` foretold what engines served from cache.
    pub kv_predictions: KvPredictions,
    /// Every engine's load at each of the router's probes, in time order.
    pub timeline: Vec<LoadSample>,
    /// Every broken invariant, described (none, unless the lab has a bug).
    pub violations: Vec<String>,
}

/// What one probe of the router read: each engine's load, in endpoint order.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadSample {
    /// Since the run's start.
    pub at: Duration,
    pub engines: Vec<Load>,
}

/// One engine over the run.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineStats {
    /// Modelled time its steps took.
    pub busy: Duration,
    pub steps: u64,
    pub counters: Counters,
}

/// KV moved between engines.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Transfers {
    pub started: u64,
    pub completed: u64,
    pub tokens: u64,
    pub bytes: u64,
}

/// The model name requests carry, as the router's default.
const MODEL: &str = "switchyard-reference";

/// Replays `arrivals` on `cluster`, planned by `planners`, whose guests read `clock`; `seed`
/// drives the run's own draws (retry jitter). `progress` counts requests as they end.
pub fn simulate(
    cluster: &ClusterSpec,
    arrivals: &[ScheduledRequest],
    planners: Planners,
    clock: Arc<SimClock>,
    seed: u64,
    progress: &ProgressBar,
) -> SimResult {
    Simulation::new(cluster, arrivals, planners, clock, seed, progress).run()
}

struct Simulation<'a> {
    cluster: &'a ClusterSpec,
    arrivals: &'a [ScheduledRequest],
    planners: Planners,
    clock: Arc<SimClock>,
    progress: &'a ProgressBar,
    now: Time,
    agenda: Agenda<Event>,
    engines: Vec<Engine>,
    /// The endpoints as policies see them, their load filled in per call.
    endpoints: Vec<EndpointSnapshot>,
    /// The router's index of the caches, with prefix caches on.
    kv: Option<KvView>,
    kv_predictions: KvPredictions,
    /// Requests in flight, by replay index.
    requests: Vec<Option<Request>>,
    outcomes: Vec<Option<(RequestOutcome, Ended)>>,
    live: usize,
    /// Arrivals handled so far (the next one is on the agenda, if any is left).
    arrived: usize,
    last_end: Time,
    rng: StdRng,
    transfers: Transfers,
    policy_faults: u64,
    timeline: Vec<LoadSample>,
    audit: Audit,
}

impl<'a> Simulation<'a> {
    fn new(
        cluster: &'a ClusterSpec,
        arrivals: &'a [ScheduledRequest],
        planners: Planners,
        clock: Arc<SimClock>,
        seed: u64,
        progress: &'a ProgressBar,
    ) -> Self {
        // Each engine's block hashes chain from a seed of its own, as each engine process draws
        // one; the index keys blocks by their tokens, whatever the hashes.
        let engines = (0..cluster.engines())
            .map(|e| {
                let core = Core::new(cluster.core_config(), Backend::costless());
                Engine::new(core.with_kv_events(seed ^ e as u64))
            })
            .collect();
        let endpoints = cluster
            .roles
            .iter()
            .zip(0u32..)
            .map(|(&role, id)| EndpointSnapshot {
                id,
                protocol: cluster.protocol,
                role,
                device_rank: id,
                health: Health::Healthy,
                address_hash: address_hash(&format!("lab://engine-{id}")),
                ..EndpointSnapshot::default()
            })
            .collect();
        Simulation {
            cluster,
            arrivals,
            planners,
            clock,
            progress,
            now: Time::ZERO,
            agenda: Agenda::default(),
            engines,
            endpoints,
            kv: cluster
                .prefix_cache
                .then(|| KvView::new(cluster.engines(), cluster.kv_events_delay)),
            kv_predictions: KvPredictions::default(),
            requests: std::iter::repeat_with(|| None)
                .take(arrivals.len())
                .collect(),
            outcomes: std::iter::repeat_with(|| None)
                .take(arrivals.len())
                .collect(),
            live: 0,
            arrived: 0,
            last_end: Time::ZERO,
            rng: StdRng::seed_from_u64(seed),
            transfers: Transfers::default(),
            policy_faults: 0,
            timeline: Vec::new(),
            audit: Audit::default(),
        }
    }

    fn run(mut self) -> SimResult {
        self.start();
        // Every request in flight has its deadline on the agenda.
        while !self.all_ended() && self.next_event().is_some() {}
        self.settle();
        self.finish()
    }

    /// The first probe and the first arrival go on the agenda.
    fn start(&mut self) {
        self.agenda.schedule(Time::ZERO, Event::Probe);
        self.schedule_arrival(0);
    }

    /// Takes the earliest event on the agenda, if there is one, and says which it was.
    fn next_event(&mut self) -> Option<Event> {
        let (at, event) = self.agenda.pop()?;
        self.advance(at);
        self.handle(event);
        Some(event)
    }

    fn advance(&mut self, at: Time) {
        self.audit.check(at >= self.now, || {
            format!("time went back from {:?} to {at:?}", self.now)
        });
        self.now = at;
        self.clock.set(at);
    }

    fn handle(&mut self, event: Event) {
        match event {
            Event::Arrival(index) => {
                self.arrived += 1;
                self.arrive(index);
                self.schedule_arrival(index + 1);
            }
            Event::Turn { engine, epoch } => {
                let e = &mut self.engines[engine];
                if e.epoch == epoch && !e.busy {
                    e.wake = None;
                    self.step(engine);
                }
            }
            Event::StepEnd(engine) => self.step_end(engine),
            Event::TransferDone {
                request,
                attempt,
                prefill,
                lease,
            } => self.transfer_done(request, attempt, prefill, lease),
            Event::Retry(request) => {
                if self.requests[request]
                    .as_ref()
                    .is_some_and(|r| r.attempt.is_none())
                {
                    self.start_attempt(request);
                }
            }
            Event::Deadline(request) => {
                if self.requests[request].is_some() {
                    let timeout = self.cluster.request_timeout;
                    self.fail(
                        request,
                        format!("the request did not finish within {timeout:?} (request timeout)"),
                    );
                }
            }
            Event::Probe => {
                for e in &mut self.engines {
                    e.probed = Load::of(&e.core.gauges());
                }
                self.timeline.push(LoadSample {
                    at: self.now.saturating_since(Time::ZERO),
                    engines: self.engines.iter().map(|e| e.probed).collect(),
                });
                if !self.all_ended() {
                    let next = self.now + self.cluster.probe_interval;
                    self.agenda.schedule(next, Event::Probe);
                }
            }
            Event::KvEventsArrive => {
                if let Some(kv) = self.kv.as_mut() {
                    kv.arrive();
                }
            }
        }
    }

    /// Once every request has ended, lets the engines finish what their own clocks still hold
    /// (reservations cancelled last go back to the pool on the engine's next turn, which comes
    /// by itself), up to a bound that no honest wait reaches: then the audit says what is left.
    fn settle(&mut self) {
        let bound = self.now + self.cluster.reservation_ttl * 2;
        while let Some((at, event)) = self.agenda.pop() {
            if at > bound {
                break;
            }
            if matches!(
                event,
                Event::Turn { .. }
                    | Event::StepEnd(_)
                    | Event::TransferDone { .. }
                    | Event::KvEventsArrive
            ) {
                self.advance(at);
                self.handle(event);
            }
        }
    }

    /// Every request has arrived and ended.
    fn all_ended(&self) -> bool {
        self.live == 0 && self.arrived == self.arrivals.len()
    }

    /// Arrivals go on the agenda one at a time, each when the one before it arrives.
    fn schedule_arrival(&mut self, index: usize) {
        if let Some(next) = self.arrivals.get(index) {
            self.agenda
                .schedule(Time::ZERO + next.at, Event::Arrival(index));
        }
    }

    // === engines ===

    /// A command went to engine `e`: it takes a turn now unless a step is under way (then at
    /// that step's end) or a turn is due now already.
    fn poke(&mut self, e: usize) {
        let engine = &mut self.engines[e];
        engine.commanded = true;
        if engine.busy || engine.wake.is_some_and(|at| at <= self.now) {
            return;
        }
        engine.epoch += 1;
        engine.wake = Some(self.now);
        let epoch = engine.epoch;
        self.agenda
            .schedule(self.now, Event::Turn { engine: e, epoch });
    }

    /// One step of engine `e` now: what admission answers goes out at once, the rest at the
    /// step's end.
    fn step(&mut self, e: usize) {
        let engine = &mut self.engines[e];
        engine.commanded = false;
        engine.busy = true;
        let step = engine.core.step(self.now);
        engine.busy_us += step.end.as_micros() - self.now.as_micros();
        engine.steps += 1;
        let outputs = engine.core.take_due(self.now);
        self.hand_over(e, outputs);
        self.agenda.schedule(step.end, Event::StepEnd(e));
    }

    /// Engine `e`'s step has ended: its outputs go out, then it steps again at once if a
    /// command came or the core has work, else when the core says.
    fn step_end(&mut self, e: usize) {
        let outputs = self.engines[e].core.take_due(self.now);
        self.hand_over(e, outputs);
        self.audit
            .engine(e, &self.engines[e].core.gauges(), self.cluster);
        let engine = &mut self.engines[e];
        engine.busy = false;
        let next = engine.core.next_turn(self.now);
        if engine.commanded || next.is_some_and(|at| at <= self.now) {
            self.step(e);
        } else if let Some(at) = next {
            engine.epoch += 1;
            engine.wake = Some(at);
            let epoch = engine.epoch;
            self.agenda.schedule(at, Event::Turn { engine: e, epoch });
        } else {
            engine.wake = None;
        }
    }

    /// Hands each output to the leg waiting for it. An answer whose attempt is gone cleans up
    /// after itself, as the engine's step loop does when its caller went away: a reservation
    /// nobody learnt of is cancelled, a lease nobody took is released.
    fn hand_over(&mut self, e: usize, outputs: Vec<Output>) {
        for output in outputs {
            match output {
                Output::Event { id, event } => {
                    let waiters = &mut self.engines[e].waiters;
                    let Some(&waiter) = waiters.get(&id) else {
                        continue;
                    };
                    // A held prefill's finish is followed by its lease, unless it was preempted.
                    let over = match (waiter.leg, &event.finish) {
                        (_, None) => false,
                        (Leg::HeldPrefill, Some((reason, _))) => {
                            *reason == switchyard_engine::scheduler::FinishReason::Preempt
                        }
                        (_, Some(_)) => true,
                    };
                    if over {
                        waiters.remove(&id);
                    }
                    if self.is_current(waiter) {
                        self.on_event(waiter, event);
                    }
                }
                Output::Reserved { id, reply } => match self.engines[e].waiters.remove(&id) {
                    Some(waiter) if self.is_current(waiter) => {
                        self.on_reserved(waiter, reply.prefix_matched_length);
                    }
                    _ => {
                        self.engines[e].core.cancel(id, self.now);
                        self.poke(e);
                    }
                },
                Output::Leased(lease) => match self.engines[e].waiters.remove(&lease.id) {
                    Some(waiter) if self.is_current(waiter) => self.on_leased(waiter, lease),
                    _ => {
                        self.engines[e].core.release_lease(lease.id);
                        self.poke(e);
                    }
                },
                Output::KvEvents(events) => self.publish(e, events),
            }
        }
    }

    /// Engine `e` publishes its step's KV events: the index has them now, or after the delay.
    fn publish(&mut self, e: usize, events: Vec<switchyard_wire::kv_events::Event>) {
        let Some(kv) = self.kv.as_mut() else {
            return;
        };
        if let Published::InTransit(delay) = kv.publish(e, events) {
            self.agenda
                .schedule(self.now + delay, Event::KvEventsArrive);
        }
    }

    fn is_current(&self, waiter: Waiter) -> bool {
        self.requests[waiter.request]
            .as_ref()
            .and_then(|r| r.attempt.as_ref())
            .is_some_and(|a| a.number == waiter.attempt)
    }

    /// The endpoints as the router would show them now to an attempt sending `prompt`:
    /// in-flight counts and pending prefill tokens exact, the engines' load as last probed,
    /// and with prefix caches on, how much of `prompt` each engine's cache holds as the
    /// router's KV index knows it (from the events published so far: `kv`).
    fn snapshot(&self, prompt: &[u32]) -> Vec<EndpointSnapshot> {
        let cached = self.kv.as_ref().map(|kv| kv.cached_prefixes(prompt));
        self.endpoints
            .iter()
            .zip(&self.engines)
            .enumerate()
            .map(|(e, (endpoint, engine))| EndpointSnapshot {
                in_flight: engine.in_flight,
                pending_prefill: engine.pending_prefill,
                kv_usage: Some(engine.probed.kv_usage),
                running: Some(engine.probed.running),
                waiting: Some(engine.probed.waiting),
                cached_prefix: cached.as_ref().map(|c| c[e]),
                ..endpoint.clone()
            })
            .collect()
    }

    /// What the router's KV index says `engine`'s cache holds of `prompt`: none without
    /// prefix caches.
    fn finish(mut self) -> SimResult {
        self.audit
            .at_end(&self.engines, &self.transfers, self.cluster);
        let mut outcomes = Vec::with_capacity(self.outcomes.len());
        let mut ended = Vec::with_capacity(self.outcomes.len());
        for (index, slot) in self.outcomes.into_iter().enumerate() {
            match slot {
                Some((outcome, end)) => {
                    outcomes.push(outcome);
                    ended.push(end);
                }
                None => self.audit.violation(format!("request {index} never ended")),
            }
        }
        SimResult {
            outcomes,
            ended,
            duration: self.last_end.saturating_since(Time::ZERO),
            engines: self
                .engines
                .iter()
                .map(|e| EngineStats {
                    busy: Duration::from_micros(e.busy_us),
                    steps: e.steps,
                    counters: e.core.counters(),
                })
                .collect(),
            transfers: self.transfers,
            policy_faults: self.policy_faults,
            kv_predictions: self.kv_predictions,
            timeline: self.timeline,
            violations: self.audit.into_violations(),
        }
    }
}
