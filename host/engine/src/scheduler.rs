//! The scheduler core: continuous batching over a paged KV pool with a prefix cache, prep_recv
//! reservations that expire, leases for sending, and MLC's preemption under KV pressure, as a
//! state machine that owns no thread, channel or clock.
//!
//! Two drivers run it the same way. The engine's step loop (`step_loop`) turns the
//! HTTP layer's commands into calls and reads its time off the wall clock; the policy lab's
//! simulator calls it on a virtual clock. Commands go in as method calls ([`Core::generate`],
//! [`Core::prep_recv`], [`Core::start_generate`], ...); time goes in as an argument ([`Time`]);
//! everything the core has to say comes out as data ([`Output`]), each due at a time.
//!
//! One [`Core::step`] at `now`:
//!
//! 1. expires prep_recv reservations past their TTL and returns quarantined pages whose time
//!    is up (`reservations`);
//! 2. answers blocked prep_recv calls and admits waiting requests while pages last, FIFO
//!    (`admission`); these answers are due at `now`;
//! 3. runs every running request once (`batch`): a prefill chunk (shared token budget) or
//!    one decode token, growing pages as it goes; when a decode needs a page and none is free,
//!    it preempts the *last* running generation with `finish_reason: "preempt"` (MLC's
//!    behaviour); sampled tokens stream as text (`text`); finished prefills become leases
//!    (`leases`);
//! 4. costs the step with the [`TimingModel`]: what the step produced is due at `now + cost`,
//!    when the step would end on the hardware the model describes. A driver hands out
//!    [`Core::take_due`] at that time and steps again no earlier.
//!
//! A reservation's slots are opened in the pool's [`SlotGate`](switchyard_kv::SlotGate) when
//! prep_recv answers and closed at start_generate or expiry, so a receiving transport writes
//! nothing else. An expired reservation's pages are *quarantined* before reuse: until no
//! receiver is still writing them, and, for one-sided transports that the gate cannot stop, for
//! [`CoreConfig::expiry_quarantine`] (longer than a router waits on remote_send), so a late
//! push cannot overwrite another request's KV.
//!
//! The prefix cache stores and evicts pages in one place each, [`PagePool::register`] and
//! [`PagePool::alloc`]. A core built [`with_kv_events`](Core::with_kv_events) reports both,
//! one [`Output::KvEvents`] per step that changed the cache, due with the step's other
//! outputs: what an engine publishes on its KV-events socket and a simulator feeds its index.
//!
//! ```
//! use std::sync::Arc;
//! use std::time::Duration;
//! use switchyard_engine::latency::{Latency, Profile, TimingModel};
//! use switchyard_engine::model::Sampling;
//! use switchyard_engine::scheduler::{Backend, Core, CoreConfig, GenRequest, Output, Time};
//!
//! let timing: Arc<dyn TimingModel> =
//!     Arc::new(Latency { profile: Profile::LLAMA3_8B_H100, time_scale: 1.0 });
//! let config = CoreConfig {
//!     page_size: 16, num_pages: 64, prefix_cache: true, prefill_chunk: 2048, max_batch: 256,
//!     reservation_ttl: Duration::from_secs(150), expiry_quarantine: Duration::ZERO,
//!     preempt_every: None, timing,
//! };
//! let mut core = Core::new(config, Backend::costless());
//! let request = GenRequest {
//!     tokens: vec![7; 100], sampling: Sampling::GREEDY, max_tokens: 4, stop: Vec::new(),
//!     logprobs: false,
//! };
//! let id = core.generate(request);
//! let step = core.step(Time::ZERO);
//! // The prefill's first token is out only once the step's modelled cost has passed.
//! assert!(core.take_due(Time::ZERO).is_empty());
//! let out = core.take_due(step.end);
//! assert!(matches!(&out[..], [Output::Event { id: got, .. }] if *got == id));
//! ```

mod admission;
mod backend;
mod batch;
mod leases;
mod request;
mod reservations;
mod seq;
mod text;
mod time;

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use crate::kv_pool::PagePool;
use crate::latency::{StepWork, TimingModel};
use reservations::{PendingPrep, Quarantined, Reservation};
use seq::Seq;

pub use backend::{Backend, LlamaModel, ModelSpec};
pub use request::{
    CoreError, Counters, Event, FinishReason, Gauges, GenRequest, Lease, Output, PrepRecvReply,
    RequestId, Usage,
};
pub use time::Time;

/// Settings of a core; the engine derives them from its command line.
#[derive(Debug, Clone)]
pub struct CoreConfig {
    pub page_size: usize,
    pub num_pages: u32,
    pub prefix_cache: bool,
    /// Token budget for prefill chunks in one step, shared by all prefilling requests.
    pub prefill_chunk: usize,
    pub max_batch: usize,
    pub reservation_ttl: Duration,
    /// How long an expired reservation's pages stay out of use. Zero when the transport is gated
    /// (tcp: the receiver refuses closed slots); for one-sided transports (shm, cuda) longer than
    /// a router waits on remote_send, so a push that starts late still lands in unused pages.
    pub expiry_quarantine: Duration,
    /// Preempt every K-th decoding request half-way through its `max_tokens` (fault injection).
    pub preempt_every: Option<u64>,
    /// What a step costs.
    pub timing: Arc<dyn TimingModel>,
}

/// What one step did: its work, what that cost, and when its outputs are due.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Step {
    pub work: StepWork,
    pub cost: Duration,
    /// `now + cost`: when the step's outputs are due and the next step may start.
    pub end: Time,
}

/// The scheduler core. Build it with [`Core::new`]; drive it with the command methods,
/// [`Core::step`] and [`Core::take_due`].
pub struct Core {
    cfg: CoreConfig,
    backend: Backend,
    pool: PagePool,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    pending_preps: VecDeque<PendingPrep>,
    reservations: HashMap<String, Reservation>,
    quarantine: Vec<Quarantined>,
    leases: HashMap<RequestId, Seq>,
    users: HashSet<String>,
    next_id: u64,
    decode_counter: u64,
    /// Pages were freed since the driver last asked for [`Core::next_turn`]: admit again.
    freed: bool,
    counters: Counters,
    /// Outputs of the phase under way, dated when it ends.
    produced: Vec<Output>,
    /// Dated outputs, in due order.
    outbox: VecDeque<(Time, Output)>,
}

/// How soon a core with blocked work wants a turn without a call: pages that leases and
/// receivers give back come without one, and the engine's step loop learns of them only then.
const RECHECK: Duration = Duration::from_millis(50);

impl Core {
    pub fn new(cfg: CoreConfig, backend: Backend) -> Self {
        let pool = PagePool::new(cfg.num_pages, cfg.page_size, cfg.prefix_cache);
        Core {
            backend,
            pool,
            waiting: VecDeque::new(),
            running: Vec::new(),
            pending_preps: VecDeque::new(),
            reservations: HashMap::new(),
            quarantine: Vec::new(),
            leases: HashMap::new(),
            users: HashSet::new(),
            next_id: 0,
            decode_counter: 0,
            freed: false,
            counters: Counters::default(),
            produced: Vec::new(),
            outbox: VecDeque::new(),
            cfg,
        }
    }

    /// Reports the prefix cache's changes from now on ([`Output::KvEvents`]), its block hashes
    /// being page keys chained from `hash_seed`: an engine draws the seed at random once per
    /// process, as vLLM draws its `NONE_HASH`, so its hashes name its own blocks and nothing
    /// else's; a simulator passes its own seed. Call it on a new core, before any command:
    /// keys computed from another seed never match again. Without a prefix cache there is
    /// nothing to report.
    pub fn with_kv_events(mut self, hash_seed: u64) -> Core {
        self.pool.record_events(hash_seed);
        self
    }

    /// One step at `now` (see the module docs). What admission answers is due at `now`, what
    /// the batch produces at the returned [`Step::end`]. `now` must not be before the last
    /// step's end: the engine runs one step at a time.
    pub fn step(&mut self, now: Time) -> Step {
        debug_assert!(
            self.outbox.back().is_none_or(|(due, _)| *due <= now),
            "a step at {now:?} overlaps the last one"
        );
        self.expire_reservations(now);
        self.release_quarantined(now);
        self.serve_pending_preps(now);
        self.admit_waiting();
        self.post(now);
        let work = self.run_batch();
        let cost = self.cfg.timing.step(&work);
        let end = now + cost;
        // The cache's changes go first: an answer the step made possible never reaches its
        // caller before the news of the pages it left cached.
        if let Some(events) = self.pool.take_events() {
            self.outbox.push_back((end, Output::KvEvents(events)));
        }
        self.post(end);
        Step { work, cost, end }
    }

    /// Every output due by `now`, in the order produced.
    pub fn take_due(&mut self, now: Time) -> Vec<Output> {
        let due = self.outbox.iter().take_while(|(at, _)| *at <= now).count();
        self.outbox.drain(..due).map(|(_, output)| output).collect()
    }

    /// When the core next wants a step if no call comes first: `now` while it has a batch to
    /// run or pages were freed since the last ask; else the next reservation expiry or
    /// quarantine end, or 50 ms from now while work waits on pages (`RECHECK`); `None` when
    /// only a call can give it work.
    pub fn next_turn(&mut self, now: Time) -> Option<Time> {
        if !self.running.is_empty() || std::mem::take(&mut self.freed) {
            return Some(now);
        }
        let expiry = self.reservations.values().map(|r| r.deadline).min();
        // A quarantine past its time but still claimed by a receiver is looked at again soon.
        let quarantine = self
            .quarantine
            .iter()
            .map(|q| q.until.max(now + RECHECK))
            .min();
        let recheck =
            (!self.waiting.is_empty() || !self.pending_preps.is_empty() || !self.leases.is_empty())
                .then(|| now + RECHECK);
        [expiry, quarantine, recheck].into_iter().flatten().min()
    }

    /// The caller of request `id` went away. A generation or a prefill is aborted and its
    /// pages freed; a prep_recv not answered yet is dropped; a reservation whose answer never
    /// reached anyone closes its window and goes through the quarantine without waiting (its
    /// slots were open a moment: a stray claim is waited out like any other). Leases and
    /// finished requests are not affected.
    pub fn cancel(&mut self, id: RequestId, now: Time) {
        if let Some(i) = self.running.iter().position(|s| s.id == id) {
            let seq = self.running.remove(i);
            self.abort(seq);
        } else if let Some(i) = self.waiting.iter().position(|s| s.id == id) {
            if let Some(seq) = self.waiting.remove(i) {
                self.abort(seq);
            }
        } else if let Some(i) = self.pending_preps.iter().position(|p| p.id == id) {
            if let Some(prep) = self.pending_preps.remove(i) {
                self.users.remove(&prep.user);
            }
        } else if let Some(user) = self
            .reservations
            .iter()
            .find(|(_, r)| r.id == id)
            .map(|(user, _)| user.clone())
            && let Some(r) = self.reservations.remove(&user)
        {
            self.retire(r, now);
            self.users.remove(&user);
        }
    }

    /// Leading positions of `prompt` that the prefix cache holds, in whole pages; what a
    /// router learns from the engine's KV events, read without changing anything (a
    /// simulator's view of its engines' caches).
    pub fn cached_prefix(&self, prompt: &[u32]) -> usize {
        self.pool.cached_pages(prompt) * self.pool.page_size()
    }

    /// What the core counted since it started.
    pub fn counters(&self) -> Counters {
        self.counters
    }

    pub fn gauges(&self) -> Gauges {
        Gauges {
            running: self.running.len(),
            waiting: self.waiting.len() + self.pending_preps.len(),
            reservations: self.reservations.len(),
            kv_pages_used: self.pool.used(),
            kv_pages_free: self.pool.available(),
            kv_pages_cached: self.pool.cached_idle(),
        }
    }

    fn take_id(&mut self) -> RequestId {
        self.next_id += 1;
        RequestId(self.next_id)
    }

    /// Dates what the phase that just ended produced.
    fn post(&mut self, due: Time) {
        let produced = std::mem::take(&mut self.produced);
        self.outbox
            .extend(produced.into_iter().map(|output| (due, output)));
    }

    // === endings ===

    fn end(&mut self, seq: Seq) {
        self.backend.forget(seq.id);
        self.pool.release(&seq.pages);
        self.freed = true;
        if let Some(user) = &seq.user {
            self.users.remove(user);
        }
    }

    fn abort(&mut self, seq: Seq) {
        tracing::debug!(id = ?seq.id, user = ?seq.user, "client went away; request aborted");
        self.counters.requests_aborted += 1;
        self.end(seq);
    }

    /// MLC's preemption: one event with `finish_reason: "preempt"`, empty text, zero usage.
    fn preempt(&mut self, seq: Seq) {
        // Routine under KV pressure (the preemptions metric counts them): not worth a log line
        // per request at info.
        let pages = seq.pages.len();
        tracing::debug!(id = ?seq.id, user = ?seq.user, pages, "request preempted");
        self.counters.preemptions += 1;
        if seq.generates() {
            self.produced.push(Output::Event {
                id: seq.id,
                event: Event {
                    text: String::new(),
                    token_ids: Vec::new(),
                    logprobs: Vec::new(),
                    finish: Some((FinishReason::Preempt, Usage::default())),
                },
            });
        }
        self.end(seq);
    }
}

/// The slots of positions `[from, to)` of a sequence holding `pages`.
fn window_slots(pool: &PagePool, pages: &[u32], from: usize, to: usize) -> Vec<u32> {
    (from..to).map(|pos| pool.slot(pages, pos)).collect()
}

#[cfg(test)]
mod tests;
