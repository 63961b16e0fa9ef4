//! The engine core: a continuous-batching step loop on its own thread.
//!
//! The HTTP handlers never touch engine state; they send a [`Command`] and wait on a reply or an
//! event channel. The loop owns the page pool, the prefix cache, every request and the model,
//! so there are no locks, and one step is:
//!
//! 1. take commands and returned leases; expire prep_recv reservations past their TTL and
//!    return quarantined pages whose time is up;
//! 2. answer blocked prep_recv calls and admit waiting requests while pages last (FIFO);
//! 3. run every running request once: a prefill chunk (shared token budget) or one decode token,
//!    growing pages as it goes; when a decode needs a page and none is free, abort the *last*
//!    running request with `finish_reason: "preempt"` (MLC's behaviour) and retry;
//! 4. publish metrics and sleep what the latency model says the step cost.
//!
//! A request whose client went away (its event receiver is dropped) is aborted the next time the
//! loop looks at it, and its pages are freed.
//!
//! A reservation's slots are opened in the pool's [`SlotGate`](switchyard_kv::SlotGate) when
//! prep_recv answers and closed at start_generate or expiry, so a receiving transport writes
//! nothing else. An expired reservation's pages are *quarantined* before reuse: until no
//! receiver is still writing them, and, for one-sided transports that the gate cannot stop, for
//! [`CoreConfig::expiry_quarantine`] (longer than a router waits on remote_send), so a late
//! push cannot overwrite another request's KV.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot};

use super::kv_pool::{PagePool, extend_page_keys};
use super::latency::{Latency, StepWork};
use super::metrics::Metrics;
use super::model::{Sampled, Sampling};
use backend::{Backend, Planned};
use switchyard_kv::{KvAddrInfo, KvStore};

mod backend;

pub use backend::{LlamaModel, ModelSpec};

/// Settings the core needs; derived from the command line by `engine::run`.
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
    pub latency: Latency,
    /// What computes the tokens.
    pub model: ModelSpec,
}

/// What a request asks the model for.
#[derive(Debug, Clone)]
pub struct GenRequest {
    pub tokens: Vec<u32>,
    pub sampling: Sampling,
    pub max_tokens: usize,
    pub stop: Vec<String>,
    /// Report each generated token's log-probability ([`Event::logprobs`]).
    pub logprobs: bool,
}

/// Why a generation ended, as OpenAI spells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    Stop,
    Length,
    Preempt,
}

impl From<FinishReason> for switchyard_wire::completion::FinishReason {
    fn from(reason: FinishReason) -> Self {
        match reason {
            FinishReason::Stop => Self::Stop,
            FinishReason::Length => Self::Length,
            FinishReason::Preempt => Self::Preempt,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
}

/// One step's output for one request: new text, the ids whose text it completes, and how it
/// ended if it did.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    pub text: String,
    /// The generated ids whose text is now fully streamed (this event's text included); at the
    /// end, every id not sent yet. What a router continues from, token-exactly.
    pub token_ids: Vec<u32>,
    /// The log-probability of each of `token_ids`, in order, when the request asked for them
    /// ([`GenRequest::logprobs`]); else empty.
    pub logprobs: Vec<f32>,
    pub finish: Option<(FinishReason, Usage)>,
}

/// A request the core refuses, always for something the caller sent; the HTTP layer turns it
/// into a 4xx.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CoreError {
    #[error("request id {user:?} is already in flight on this engine")]
    DuplicateUser { user: String },
    #[error("no prep_recv reservation for request id {user:?} on this engine")]
    NoReservation { user: String },
    #[error("start_generate begin {begin} is past the prep_recv window end {end}")]
    BeginPastWindow { begin: usize, end: usize },
    /// Positions before `prefix_matched_length` live in shared prefix-cache pages, which D must
    /// never write.
    #[error(
        "start_generate begin {begin} is before prefix_matched_length {matched}: those positions are shared prefix-cache pages"
    )]
    BeginBeforeMatched { begin: usize, matched: usize },
    #[error("a KV transfer into the reservation of request id {user:?} is still being written")]
    TransferInProgress { user: String },
}

/// prep_recv's answer: where P must write positions `[prefix_matched_length, end)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrepRecvReply {
    pub kv_addr_info: KvAddrInfo,
    pub prefix_matched_length: usize,
}

/// P's prefilled KV, held until the lease drops: `slots[i]` holds position `begin + i`.
///
/// Dropping it (transfer done, failed, or its task cancelled) hands the pages back to the core
/// over a channel of their own: not the command channel, whose disconnection is how the core
/// learns to stop.
#[derive(Debug)]
pub struct SendLease {
    pub id: u64,
    pub slots: Vec<u32>,
    returns: Sender<u64>,
}

impl Drop for SendLease {
    fn drop(&mut self) {
        // The core is gone when this fails, and with it the pages.
        let _ = self.returns.send(self.id);
    }
}

pub type Events = mpsc::UnboundedSender<Event>;

/// What the HTTP layer asks of the core.
#[derive(Debug)]
pub enum Command {
    /// `/v1/completions`: prefill and generate.
    Generate { request: GenRequest, events: Events },
    /// Prefill and generate as [`Command::Generate`], then, when the generation ends, keep the
    /// prompt's KV instead of freeing it: the slots of positions `[0, prompt_len)` go to `hold`
    /// as a [`SendLease`]. A vLLM prefill leg (its blocks wait under a lease for D's pull) and an
    /// SGLang prefill leg (it pushes them to D) both sample their one token this way, so P
    /// computes the prompt once. A generation aborted or preempted keeps nothing.
    GenerateAndHold {
        request: GenRequest,
        events: Events,
        hold: oneshot::Sender<SendLease>,
    },
    /// Drop a prep_recv reservation whose caller gave up before start_generate (a vLLM or
    /// SGLang decode leg cancelled while it waited for the KV): it goes through the expiry
    /// quarantine at once instead of holding its pages until the TTL. Unknown ids are ignored.
    CancelReservation { user: String },
    /// Reserve pages for `[0, end)`, waiting until they are free.
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

// === Sequences ===

#[derive(Debug)]
struct Seq {
    id: u64,
    /// The microserving request id, reserved in `Core::users` until the sequence ends.
    user: Option<String>,
    tokens: Vec<u32>,
    prompt_len: usize,
    pages: Vec<u32>,
    page_keys: Vec<u64>,
    registered_pages: usize,
    /// Join the prefix cache only once the generation finishes: its first pages arrived from a
    /// prefill engine, unchecked (see [`Core::start_generate`]).
    cache_after_finish: bool,
    /// Positions whose KV is in the pool.
    computed: usize,
    /// The model's hash chain after `computed` tokens.
    chain: u64,
    work: Work,
}

#[derive(Debug)]
enum Work {
    Generate(GenState),
    /// P's half of remote_send: prefill, then lease the slots from `begin`.
    Prefill {
        begin: usize,
        reply: Option<oneshot::Sender<SendLease>>,
    },
}

#[derive(Debug)]
struct GenState {
    sampling: Sampling,
    logprobs: bool,
    max_tokens: usize,
    stop: Vec<String>,
    events: Events,
    generated: usize,
    /// Bytes of generated tokens not yet valid UTF-8 (a character split across tokens).
    pending: Vec<u8>,
    text: String,
    emitted: usize,
    /// Generated tokens not yet sent.
    unsent_ids: VecDeque<Unsent>,
    preempt_at: Option<usize>,
    counted: bool,
    /// Where the prompt's KV goes when the generation finishes ([`Command::GenerateAndHold`]).
    hold: Option<oneshot::Sender<SendLease>>,
}

impl Seq {
    fn target(&self) -> usize {
        self.tokens.len()
    }

    fn generates(&self) -> bool {
        matches!(self.work, Work::Generate(_))
    }

    fn events(&self) -> Option<&Events> {
        match &self.work {
            Work::Generate(g) => Some(&g.events),
            Work::Prefill { .. } => None,
        }
    }

    fn client_gone(&self) -> bool {
        match &self.work {
            Work::Generate(g) => g.events.is_closed(),
            Work::Prefill { reply, .. } => reply.as_ref().is_none_or(|r| r.is_closed()),
        }
    }
}

#[derive(Debug)]
struct PendingPrep {
    user: String,
    request: GenRequest,
    end: usize,
    reply: oneshot::Sender<Result<PrepRecvReply, CoreError>>,
}

#[derive(Debug)]
struct Reservation {
    request: GenRequest,
    pages: Vec<u32>,
    page_keys: Vec<u64>,
    matched: usize,
    end: usize,
    deadline: Instant,
}

/// Pages of an expired reservation, kept out of use until `until` and until no receiver is
/// writing their slots.
#[derive(Debug)]
struct Quarantined {
    pages: Vec<u32>,
    slots: Vec<u32>,
    until: Instant,
}

/// The engine core. Build it with [`Core::new`], then run [`Core::run`] on a dedicated thread.
pub struct Core {
    cfg: CoreConfig,
    backend: Backend,
    store: Arc<KvStore>,
    pool: PagePool,
    metrics: Metrics,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    pending_preps: VecDeque<PendingPrep>,
    reservations: HashMap<String, Reservation>,
    quarantine: Vec<Quarantined>,
    leases: HashMap<u64, Seq>,
    /// Where dropped [`SendLease`]s send their id, and the receiving end the loop drains.
    lease_returns: (Sender<u64>, Receiver<u64>),
    users: HashSet<String>,
    next_id: u64,
    decode_counter: u64,
    /// Pages were freed since the loop last tried to admit: do not block on commands.
    freed: bool,
}

impl Core {
    pub fn new(cfg: CoreConfig, store: Arc<KvStore>, metrics: Metrics) -> Self {
        let backend = Backend::new(&cfg.model, &store);
        let pool = PagePool::new(cfg.num_pages, cfg.page_size, cfg.prefix_cache);
        Core {
            backend,
            pool,
            metrics,
            waiting: VecDeque::new(),
            running: Vec::new(),
            pending_preps: VecDeque::new(),
            reservations: HashMap::new(),
            quarantine: Vec::new(),
            leases: HashMap::new(),
            lease_returns: std::sync::mpsc::channel(),
            users: HashSet::new(),
            next_id: 0,
            decode_counter: 0,
            freed: false,
            store,
            cfg,
        }
    }

    /// Runs the step loop until every command sender is gone.
    pub fn run(mut self, commands: Receiver<Command>) {
        loop {
            let idle = self.running.is_empty() && !std::mem::take(&mut self.freed);
            if !self.take_commands(&commands, idle) {
                return;
            }
            let cost = self.turn(Instant::now());
            if !cost.is_zero() {
                std::thread::sleep(cost);
            }
        }
    }

    /// One pass of the loop after the commands are in, as of `now`; returns what the step cost.
    /// Tests drive this directly with a clock of their own.
    fn turn(&mut self, now: Instant) -> Duration {
        self.return_leases();
        self.expire_reservations(now);
        self.release_quarantined(now);
        self.serve_pending_preps(now);
        self.admit_waiting();
        let work = self.step();
        self.publish_gauges();
        self.cfg.latency.step(&work)
    }

    /// Blocks for a command when there is nothing to run, then drains the queue. `false` when the
    /// engine is shutting down.
    fn take_commands(&mut self, commands: &Receiver<Command>, block: bool) -> bool {
        if block {
            let first = match self.next_deadline() {
                Some(deadline) => {
                    match commands.recv_timeout(deadline.saturating_duration_since(Instant::now()))
                    {
                        Ok(cmd) => Some(cmd),
                        Err(RecvTimeoutError::Timeout) => None,
                        Err(RecvTimeoutError::Disconnected) => return false,
                    }
                }
                None => match commands.recv() {
                    Ok(cmd) => Some(cmd),
                    Err(_) => return false,
                },
            };
            if let Some(cmd) = first {
                self.handle(cmd);
            }
        }
        loop {
            match commands.try_recv() {
                Ok(cmd) => self.handle(cmd),
                Err(TryRecvError::Empty) => return true,
                Err(TryRecvError::Disconnected) => return false,
            }
        }
    }

    /// Releases the pages of every lease dropped since the last look.
    fn return_leases(&mut self) {
        while let Ok(id) = self.lease_returns.1.try_recv() {
            if let Some(seq) = self.leases.remove(&id) {
                self.pool.release(&seq.pages);
                self.freed = true;
            }
        }
    }

    /// When the loop must wake up without a command: the next reservation expiry or quarantine
    /// end, or soon when blocked requests should look again for a gone client (and for pages
    /// that leases or receivers give back, which send no command).
    fn next_deadline(&self) -> Option<Instant> {
        let expiry = self.reservations.values().map(|r| r.deadline).min();
        // A quarantine past its time but still claimed by a receiver is looked at again soon.
        let quarantine = self
            .quarantine
            .iter()
            .map(|q| q.until.max(Instant::now() + RECHECK))
            .min();
        let recheck =
            (!self.waiting.is_empty() || !self.pending_preps.is_empty() || !self.leases.is_empty())
                .then(|| Instant::now() + RECHECK);
        [expiry, quarantine, recheck].into_iter().flatten().min()
    }

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Generate { request, events } => {
                let seq = self.new_generation(None, request, events);
                self.metrics.prompt_tokens.inc_by(seq.prompt_len as u64);
                self.waiting.push_back(seq);
            }
            Command::GenerateAndHold {
                request,
                events,
                hold,
            } => {
                let mut seq = self.new_generation(None, request, events);
                if let Work::Generate(g) = &mut seq.work {
                    g.hold = Some(hold);
                }
                self.metrics.prompt_tokens.inc_by(seq.prompt_len as u64);
                self.waiting.push_back(seq);
            }
            Command::CancelReservation { user } => {
                let now = Instant::now();
                if let Some(r) = self.reservations.remove(&user) {
                    tracing::debug!(%user, pages = r.pages.len(), "reservation cancelled");
                    self.retire(r, now + self.cfg.expiry_quarantine);
                    self.users.remove(&user);
                } else if let Some(i) = self.pending_preps.iter().position(|p| p.user == user) {
                    self.pending_preps.remove(i);
                    self.users.remove(&user);
                }
            }
            Command::PrepRecv {
                user,
                request,
                end,
                reply,
            } => {
                if self.users.contains(&user) {
                    let _ = reply.send(Err(CoreError::DuplicateUser { user }));
                    return;
                }
                self.users.insert(user.clone());
                self.pending_preps.push_back(PendingPrep {
                    user,
                    request,
                    end,
                    reply,
                });
            }
            Command::StartGenerate {
                user,
                begin,
                events,
                reply,
            } => {
                let result = self.start_generate(user, begin, events);
                let _ = reply.send(result);
            }
            Command::PrefillForSend {
                tokens,
                begin,
                reply,
            } => {
                let id = self.take_id();
                self.metrics.remote_send_received.inc();
                self.waiting.push_back(Seq {
                    id,
                    user: None,
                    prompt_len: tokens.len(),
                    tokens,
                    pages: Vec::new(),
                    page_keys: Vec::new(),
                    registered_pages: 0,
                    cache_after_finish: false,
                    computed: 0,
                    chain: self.backend.chain_at(&[], 0),
                    work: Work::Prefill {
                        begin,
                        reply: Some(reply),
                    },
                });
            }
        }
    }

    fn take_id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    fn new_generation(&mut self, user: Option<String>, request: GenRequest, events: Events) -> Seq {
        let id = self.take_id();
        Seq {
            id,
            user,
            prompt_len: request.tokens.len(),
            tokens: request.tokens,
            pages: Vec::new(),
            page_keys: Vec::new(),
            registered_pages: 0,
            cache_after_finish: false,
            computed: 0,
            chain: self.backend.chain_at(&[], 0),
            work: Work::Generate(GenState {
                sampling: request.sampling,
                logprobs: request.logprobs,
                max_tokens: request.max_tokens,
                stop: request.stop,
                events,
                generated: 0,
                pending: Vec::new(),
                text: String::new(),
                emitted: 0,
                unsent_ids: VecDeque::new(),
                preempt_at: None,
                counted: false,
                hold: None,
            }),
        }
    }

    // === prep_recv reservations ===

    /// Answers blocked prep_recv calls in order while their pages fit.
    fn serve_pending_preps(&mut self, now: Instant) {
        while let Some(prep) = self.pending_preps.front() {
            if prep.reply.is_closed() {
                let prep = self.pending_preps.pop_front().map(|p| p.user);
                prep.map(|user| self.users.remove(&user));
                continue;
            }
            let ps = self.pool.page_size();
            let mut page_keys = Vec::new();
            extend_page_keys(&mut page_keys, &prep.request.tokens, ps);
            // Only whole pages inside [0, end) may be shared: D writes from `matched` on.
            let matched_pages = self.pool.match_prefix(&page_keys, prep.end / ps);
            let need = self
                .pool
                .pages_for(prep.end)
                .saturating_sub(matched_pages.len());
            let Some(fresh) = self.pool.alloc(need) else {
                self.pool.release(&matched_pages);
                return;
            };
            let Some(prep) = self.pending_preps.pop_front() else {
                return;
            };
            let matched = matched_pages.len() * ps;
            let mut pages = matched_pages;
            pages.extend(fresh);
            let slots = window_slots(&self.pool, &pages, matched, prep.end);
            // Open before answering: P can push as soon as the router has the answer.
            self.store.gate().open(slots.iter().copied());
            let reply = PrepRecvReply {
                kv_addr_info: KvAddrInfo::from_slots(slots),
                prefix_matched_length: matched,
            };
            let deadline = now + self.cfg.reservation_ttl;
            let reservation = Reservation {
                request: prep.request,
                pages,
                page_keys,
                matched,
                end: prep.end,
                deadline,
            };
            self.reservations.insert(prep.user.clone(), reservation);
            // Metrics first, so a caller that reads them right after the answer sees the pages.
            self.publish_gauges();
            if prep.reply.send(Ok(reply)).is_err() {
                // Nobody learnt the slots, but they were open for a moment: go through the
                // quarantine (with no wait) so a stray claim is waited out like any other.
                if let Some(r) = self.reservations.remove(&prep.user) {
                    self.retire(r, now);
                }
                self.users.remove(&prep.user);
                continue;
            }
            self.metrics.prefix_matched_tokens.inc_by(matched as u64);
        }
    }

    fn expire_reservations(&mut self, now: Instant) {
        let expired: Vec<String> = self
            .reservations
            .iter()
            .filter(|(_, r)| r.deadline <= now)
            .map(|(u, _)| u.clone())
            .collect();
        for user in expired {
            if let Some(r) = self.reservations.remove(&user) {
                tracing::debug!(%user, pages = r.pages.len(), "prep_recv reservation expired");
                self.retire(r, now + self.cfg.expiry_quarantine);
                self.users.remove(&user);
                self.metrics.reservations_expired.inc();
            }
        }
    }

    /// Closes a dropped reservation's window and quarantines its pages until `until` (and until
    /// no receiver writes them); [`Core::release_quarantined`] frees them.
    fn retire(&mut self, r: Reservation, until: Instant) {
        let slots = self.reservation_slots(&r);
        self.store.gate().close(slots.iter().copied());
        self.quarantine.push(Quarantined {
            pages: r.pages,
            slots,
            until,
        });
    }

    /// Frees quarantined pages whose time is up and that no receiver is still writing.
    fn release_quarantined(&mut self, now: Instant) {
        let gate = self.store.gate();
        let (done, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut self.quarantine)
            .into_iter()
            .partition(|q| q.until <= now && !gate.any_claimed(q.slots.iter().copied()));
        self.quarantine = kept;
        for q in done {
            self.pool.release(&q.pages);
            self.freed = true;
        }
    }

    /// The slots of a reservation's window `[matched, end)`: what its prep_recv handed out.
    fn reservation_slots(&self, r: &Reservation) -> Vec<u32> {
        window_slots(&self.pool, &r.pages, r.matched, r.end)
    }

    fn start_generate(
        &mut self,
        user: String,
        begin: usize,
        events: Events,
    ) -> Result<(), CoreError> {
        let Some(r) = self.reservations.get(&user) else {
            return Err(CoreError::NoReservation { user });
        };
        if begin > r.end {
            return Err(CoreError::BeginPastWindow { begin, end: r.end });
        }
        if begin < r.matched {
            return Err(CoreError::BeginBeforeMatched {
                begin,
                matched: r.matched,
            });
        }
        // From here on only this engine touches the window.
        if !self
            .store
            .gate()
            .close_unless_claimed(&self.reservation_slots(r))
        {
            return Err(CoreError::TransferInProgress { user });
        }
        let Some(r) = self.reservations.remove(&user) else {
            return Err(CoreError::NoReservation { user });
        };
        // P wrote [matched, end) behind our back: read those slots now so decode steps see the
        // bytes that actually arrived. Whether they are all there, nobody here can tell: a
        // router also calls start_generate to free a reservation whose remote_send failed,
        // hanging up at once. So the pages join the prefix cache only when the generation
        // finishes; one aborted or preempted leaves no unchecked page behind for others.
        for pos in r.matched..r.end {
            let slot = self.pool.slot(&r.pages, pos);
            self.backend.received(&self.store, slot);
        }
        self.metrics
            .prompt_tokens
            .inc_by(r.request.tokens.len() as u64);
        let mut seq = self.new_generation(Some(user), r.request, events);
        seq.pages = r.pages;
        seq.page_keys = r.page_keys;
        seq.registered_pages = r.matched / self.pool.page_size();
        seq.cache_after_finish = true;
        seq.computed = begin;
        seq.chain = self.backend.chain_at(&seq.tokens, begin);
        self.waiting.push_back(seq);
        Ok(())
    }

    // === admission ===

    fn admit_waiting(&mut self) {
        while self.running.len() < self.cfg.max_batch {
            let Some(seq) = self.waiting.front() else {
                return;
            };
            if seq.client_gone() {
                if let Some(seq) = self.waiting.pop_front() {
                    self.abort(seq);
                }
                continue;
            }
            let Some(mut seq) = self.waiting.pop_front() else {
                return;
            };
            if self.try_admit(&mut seq) {
                self.running.push(seq);
            } else {
                self.waiting.push_front(seq);
                if self.running.is_empty() {
                    self.break_waiting_deadlock();
                }
                return;
            }
        }
    }

    /// Gives `seq` pages for every known token (after a prefix-cache match if it has none yet);
    /// `false`, with nothing changed, when the pool cannot.
    fn try_admit(&mut self, seq: &mut Seq) -> bool {
        let ps = self.pool.page_size();
        let fresh_start = seq.pages.is_empty() && seq.computed == 0;
        let mut matched_pages = Vec::new();
        if fresh_start {
            extend_page_keys(&mut seq.page_keys, &seq.tokens, ps);
            // A generation must compute at least its last prompt token itself (that pass yields
            // the first output token); a prefill for remote_send may be served entirely.
            let limit = match seq.work {
                Work::Generate(_) => (seq.target() - 1) / ps,
                Work::Prefill { .. } => seq.target() / ps,
            };
            matched_pages = self.pool.match_prefix(&seq.page_keys, limit);
        }
        let need = self
            .pool
            .pages_for(seq.target())
            .saturating_sub(seq.pages.len() + matched_pages.len());
        let Some(fresh) = self.pool.alloc(need) else {
            self.pool.release(&matched_pages);
            return false;
        };
        if fresh_start {
            let matched = matched_pages.len() * ps;
            self.metrics.prefix_matched_tokens.inc_by(matched as u64);
            seq.registered_pages = matched_pages.len();
            seq.computed = matched;
            seq.chain = self.backend.chain_at(&seq.tokens, matched);
            seq.pages = matched_pages;
        }
        seq.pages.extend(fresh);
        true
    }

    /// Nothing runs and the head cannot get pages: if other waiting requests hold pages (started
    /// reservations), preempt the last of them, or the pool would stay stuck.
    fn break_waiting_deadlock(&mut self) {
        let holder = (1..self.waiting.len())
            .rev()
            .find(|&i| !self.waiting[i].pages.is_empty());
        if let Some(seq) = holder.and_then(|i| self.waiting.remove(i)) {
            self.preempt(seq);
        }
    }

    // === the step ===

    fn step(&mut self) -> StepWork {
        let plan = self.plan_step();
        let mut work = StepWork::default();
        for &(_, n, decoding, context) in &plan {
            if decoding {
                work.decode_seqs += 1;
                work.decode_ctx_tokens += context + 1;
            } else {
                work.prefill_tokens += n;
                work.prefill_token_ctx += n * context;
            }
        }
        self.compute(&plan);
        // Sequences that processed every known token choose their next one (or lease their
        // slots), in plan order.
        for &(id, ..) in &plan {
            let Some(i) = self.running.iter().position(|s| s.id == id) else {
                continue;
            };
            if self.running[i].computed >= self.running[i].target() {
                self.finish_pass(i);
            }
        }
        work
    }

    /// Who runs how many positions this step: `(id, n, decoding, context)` per sequence, each
    /// holding the pages it needs (preempting the last running generations while none are
    /// free). The positions run afterwards in one batch.
    fn plan_step(&mut self) -> Vec<(u64, usize, bool, usize)> {
        let mut plan = Vec::new();
        let mut budget = self.cfg.prefill_chunk;
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].client_gone() {
                let seq = self.running.remove(i);
                self.abort(seq);
                continue;
            }
            let seq = &self.running[i];
            let remaining = seq.target() - seq.computed;
            let decoding = remaining == 1 && seq.generates();
            let n = if decoding { 1 } else { remaining.min(budget) };
            if n == 0 && remaining > 0 {
                i += 1;
                continue;
            }
            let extra = seq_pages_needed(&self.pool, seq, n);
            match self.ensure_pages(i, extra) {
                Growth::Ready => {}
                Growth::SelfPreempted => continue,
                Growth::EarlierPreempted => {
                    i -= 1;
                    continue;
                }
            }
            if !decoding {
                budget -= n;
            }
            let seq = &self.running[i];
            plan.push((seq.id, n, decoding, seq.computed));
            i += 1;
        }
        // A sequence preempted to make room for a later one leaves the plan.
        plan.retain(|p| self.running.iter().any(|s| s.id == p.0));
        plan
    }

    /// Makes `running[i]` own `extra` more pages, preempting the last running generation while
    /// none are free.
    fn ensure_pages(&mut self, i: usize, extra: usize) -> Growth {
        loop {
            if extra == 0 {
                return Growth::Ready;
            }
            if let Some(pages) = self.pool.alloc(extra) {
                self.running[i].pages.extend(pages);
                return Growth::Ready;
            }
            let victim = self
                .running
                .iter()
                .rposition(|s| matches!(s.work, Work::Generate(_)))
                .unwrap_or(i);
            let seq = self.running.remove(victim);
            self.preempt(seq);
            match victim.cmp(&i) {
                std::cmp::Ordering::Equal => return Growth::SelfPreempted,
                std::cmp::Ordering::Less => return Growth::EarlierPreempted,
                std::cmp::Ordering::Greater => {}
            }
        }
    }

    /// Runs the model over the planned positions, writing their KV.
    fn compute(&mut self, plan: &[(u64, usize, bool, usize)]) {
        let n_of: HashMap<u64, usize> = plan.iter().map(|p| (p.0, p.1)).collect();
        let mut planned: Vec<Planned<'_>> = self
            .running
            .iter_mut()
            .filter_map(|seq| n_of.get(&seq.id).map(|&n| Planned { seq, n }))
            .collect();
        self.backend.compute(&self.store, &self.pool, &mut planned);
        for p in planned {
            register_full_pages(&mut self.pool, p.seq);
        }
    }

    /// `running[i]` has processed every known token. Returns whether it is still running.
    fn finish_pass(&mut self, i: usize) -> bool {
        if matches!(self.running[i].work, Work::Prefill { .. }) {
            let seq = self.running.remove(i);
            self.lease(seq);
            return false;
        }
        let seq = &self.running[i];
        let Work::Generate(g) = &seq.work else {
            return true;
        };
        let sampled = self
            .backend
            .next_token(&self.pool, seq, &g.sampling, g.logprobs);
        let outcome = self.accept_token(i, sampled);
        match outcome {
            StepResult::Continue => true,
            StepResult::Finished | StepResult::ClientGone => {
                let mut seq = self.running.remove(i);
                if outcome == StepResult::ClientGone {
                    self.abort(seq);
                } else {
                    if seq.cache_after_finish {
                        seq.cache_after_finish = false;
                        register_full_pages(&mut self.pool, &mut seq);
                    }
                    let hold = match &mut seq.work {
                        Work::Generate(g) => g.hold.take(),
                        Work::Prefill { .. } => None,
                    };
                    match hold {
                        Some(hold) => self.hold_prompt(seq, hold),
                        None => self.end(seq),
                    }
                }
                false
            }
            StepResult::Preempt => {
                let seq = self.running.remove(i);
                self.preempt(seq);
                false
            }
        }
    }

    /// Appends a sampled token, streams its text, and decides whether the generation ends.
    fn accept_token(&mut self, i: usize, Sampled { token, logprob }: Sampled) -> StepResult {
        let preempt_every = self.cfg.preempt_every;
        let seq = &mut self.running[i];
        let prompt_len = seq.prompt_len;
        let Work::Generate(g) = &mut seq.work else {
            return StepResult::Continue;
        };
        if !g.counted {
            g.counted = true;
            self.decode_counter += 1;
            if preempt_every.is_some_and(|k| k > 0 && self.decode_counter.is_multiple_of(k))
                && g.max_tokens >= 2
            {
                g.preempt_at = Some(g.max_tokens / 2);
            }
        }
        let mut finish = None;
        if self.backend.is_eos(token) {
            finish = Some(FinishReason::Stop);
        } else {
            seq.tokens.push(token);
            g.generated += 1;
            self.metrics.generated_tokens.inc();
            let before = g.text.len();
            g.pending.extend_from_slice(self.backend.token_bytes(token));
            decode_pending(&mut g.pending, &mut g.text, false);
            g.unsent_ids.push_back(Unsent {
                id: token,
                logprob: logprob.filter(|_| g.logprobs),
                covered: usize::MAX,
            });
            if g.pending.is_empty() {
                let covered = g.text.len();
                for unsent in g.unsent_ids.iter_mut().rev() {
                    if unsent.covered != usize::MAX {
                        break;
                    }
                    unsent.covered = covered;
                }
            }
            if let Some(at) = first_stop_match(&g.text, &g.stop, g.text.len() - before) {
                g.text.truncate(at);
                finish = Some(FinishReason::Stop);
            } else if g.generated >= g.max_tokens {
                finish = Some(FinishReason::Length);
            }
        }
        if finish.is_none() && g.preempt_at == Some(g.generated) {
            // Text held back as a possible stop-string start stays unsent: the preemption chunk
            // carries no text (MLC's), and the rerun produces it again anyway.
            let (delta, token_ids, logprobs) = take_safe_text(g, false);
            if !delta.is_empty()
                && g.events
                    .send(Event {
                        text: delta,
                        token_ids,
                        logprobs,
                        finish: None,
                    })
                    .is_err()
            {
                return StepResult::ClientGone;
            }
            return StepResult::Preempt;
        }
        if finish.is_some() {
            decode_pending(&mut g.pending, &mut g.text, true);
        }
        let (delta, token_ids, logprobs) = take_safe_text(g, finish.is_some());
        let usage = Usage {
            prompt_tokens: prompt_len,
            completion_tokens: g.generated,
        };
        let event = Event {
            text: delta,
            token_ids,
            logprobs,
            finish: finish.map(|f| (f, usage)),
        };
        let silent = event.text.is_empty() && event.finish.is_none();
        if !silent && g.events.send(event).is_err() {
            return StepResult::ClientGone;
        }
        if finish.is_some() {
            StepResult::Finished
        } else {
            StepResult::Continue
        }
    }

    /// Hands P's prefilled slots to the remote_send handler. The pages are held from here
    /// until the lease drops, wherever that happens (a lease the handler never received drops
    /// right here), so they always come back through [`Core::return_leases`].
    fn lease(&mut self, mut seq: Seq) {
        let Work::Prefill { begin, reply } = &mut seq.work else {
            return;
        };
        let lease = SendLease {
            id: seq.id,
            slots: window_slots(&self.pool, &seq.pages, *begin, seq.computed),
            returns: self.lease_returns.0.clone(),
        };
        let reply = reply.take();
        self.backend.forget(seq.id);
        self.leases.insert(seq.id, seq);
        if let Some(reply) = reply {
            let _ = reply.send(lease);
        }
    }

    /// Leases the prompt's slots of a finished generation ([`Command::GenerateAndHold`]); the
    /// pages come back through [`Core::return_leases`] like any lease's.
    fn hold_prompt(&mut self, seq: Seq, hold: oneshot::Sender<SendLease>) {
        let lease = SendLease {
            id: seq.id,
            slots: window_slots(&self.pool, &seq.pages, 0, seq.prompt_len),
            returns: self.lease_returns.0.clone(),
        };
        self.backend.forget(seq.id);
        if let Some(user) = &seq.user {
            self.users.remove(user);
        }
        self.leases.insert(seq.id, seq);
        // Metrics first, so a caller that reads them right after the answer sees the pages held.
        self.publish_gauges();
        // A handler that went away drops the lease right here, which returns the pages.
        let _ = hold.send(lease);
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
        tracing::debug!(id = seq.id, user = ?seq.user, "client went away; request aborted");
        self.metrics.requests_aborted.inc();
        self.end(seq);
    }

    /// MLC's preemption: one chunk with `finish_reason: "preempt"`, empty text, zero usage.
    fn preempt(&mut self, seq: Seq) {
        // Routine under KV pressure (the preemptions metric counts them): not worth a log line
        // per request at info.
        tracing::debug!(id = seq.id, user = ?seq.user, pages = seq.pages.len(), "request preempted");
        self.metrics.preemptions.inc();
        if let Some(events) = seq.events() {
            let _ = events.send(Event {
                text: String::new(),
                token_ids: Vec::new(),
                logprobs: Vec::new(),
                finish: Some((FinishReason::Preempt, Usage::default())),
            });
        }
        self.end(seq);
    }

    fn publish_gauges(&self) {
        let m = &self.metrics;
        m.running.set(self.running.len() as i64);
        m.waiting
            .set((self.waiting.len() + self.pending_preps.len()) as i64);
        m.reservations.set(self.reservations.len() as i64);
        m.kv_pages_used.set(self.pool.used() as i64);
        m.kv_pages_free.set(self.pool.available() as i64);
        m.kv_pages_cached.set(self.pool.cached_idle() as i64);
    }
}

/// How often an idle loop looks again at blocked work and at pages given back without a command.
const RECHECK: Duration = Duration::from_millis(50);

enum Growth {
    Ready,
    SelfPreempted,
    EarlierPreempted,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StepResult {
    Continue,
    Finished,
    ClientGone,
    Preempt,
}

fn seq_pages_needed(pool: &PagePool, seq: &Seq, n: usize) -> usize {
    pool.pages_for(seq.computed + n)
        .saturating_sub(seq.pages.len())
}

/// Offers the sequence's newly completed pages to the prefix cache.
fn register_full_pages(pool: &mut PagePool, seq: &mut Seq) {
    if seq.cache_after_finish {
        return;
    }
    let ps = pool.page_size();
    let full = seq.computed / ps;
    if full <= seq.registered_pages {
        return;
    }
    extend_page_keys(&mut seq.page_keys, &seq.tokens[..full * ps], ps);
    for p in seq.registered_pages..full {
        pool.register(seq.pages[p], seq.page_keys[p]);
    }
    seq.registered_pages = full;
}

/// Byte offset of the earliest stop string in `text`, which had none before its last `added`
/// bytes: a match must end in them, so only that tail is searched (a long generation with stop
/// strings stays linear).
fn first_stop_match(text: &str, stops: &[String], added: usize) -> Option<usize> {
    let longest = stops.iter().map(String::len).max().unwrap_or(0);
    let mut start = text.len().saturating_sub(added + longest.saturating_sub(1));
    while !text.is_char_boundary(start) {
        start -= 1;
    }
    stops
        .iter()
        .filter(|s| !s.is_empty())
        .filter_map(|s| text[start..].find(s.as_str()))
        .min()
        .map(|at| start + at)
}

/// The slots of positions `[from, to)` of a sequence holding `pages`.
fn window_slots(pool: &PagePool, pages: &[u32], from: usize, to: usize) -> Vec<u32> {
    (from..to).map(|pos| pool.slot(pages, pos)).collect()
}

/// The text not yet streamed that can no longer turn out to be the start of a stop string (all
/// of it when the generation is over), and the ids whose text that completes (all of them at
/// the end).
/// A generated token not sent yet, with the text length that covers it (`usize::MAX` while its
/// bytes are still pending).
#[derive(Debug)]
struct Unsent {
    id: u32,
    logprob: Option<f32>,
    covered: usize,
}

/// The text that can be sent now, with the ids (and their log-probabilities) it completes.
fn take_safe_text(g: &mut GenState, flush: bool) -> (String, Vec<u32>, Vec<f32>) {
    let bytes = g.text.as_bytes();
    let mut safe = bytes.len();
    if !flush {
        for start in g.emitted..bytes.len() {
            let tail = &bytes[start..];
            if g.stop
                .iter()
                .any(|s| s.len() > tail.len() && s.as_bytes().starts_with(tail))
            {
                safe = start;
                break;
            }
        }
    }
    let safe = safe.max(g.emitted);
    let out = g.text.get(g.emitted..safe).unwrap_or_default().to_owned();
    g.emitted = safe;
    let sent = if flush {
        g.unsent_ids.len()
    } else {
        g.unsent_ids
            .iter()
            .take_while(|u| u.covered <= safe)
            .count()
    };
    let mut ids = Vec::with_capacity(sent);
    let mut logprobs = Vec::new();
    for unsent in g.unsent_ids.drain(..sent) {
        ids.push(unsent.id);
        logprobs.extend(unsent.logprob);
    }
    (out, ids, logprobs)
}

/// Moves the complete UTF-8 characters at the front of `pending` into `text`, so a streamed
/// chunk never carries half a character; bytes that can never become valid are replaced by
/// U+FFFD, and so is an unfinished character when `flush` (the generation ended).
fn decode_pending(pending: &mut Vec<u8>, text: &mut String, flush: bool) {
    let mut rest = pending.as_slice();
    loop {
        match std::str::from_utf8(rest) {
            Ok(valid) => {
                text.push_str(valid);
                rest = &[];
                break;
            }
            Err(e) => {
                let (valid, after) = rest.split_at(e.valid_up_to());
                text.push_str(std::str::from_utf8(valid).unwrap_or_default());
                match e.error_len() {
                    Some(bad) => {
                        text.push(char::REPLACEMENT_CHARACTER);
                        rest = &after[bad..];
                    }
                    None if flush => {
                        text.push(char::REPLACEMENT_CHARACTER);
                        rest = &[];
                        break;
                    }
                    None => {
                        rest = after;
                        break;
                    }
                }
            }
        }
    }
    let keep = rest.len();
    pending.drain(..pending.len() - keep);
}

#[cfg(test)]
mod tests;
