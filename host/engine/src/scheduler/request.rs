//! What goes into the core and what comes out of it, as data: requests, the outputs that
//! answer them, refusals, and the counts and gauges a driver publishes.

use switchyard_kv::KvAddrInfo;

use crate::model::Sampling;

/// The core's name for a request it accepted; every [`Output`] about it carries it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub(super) u64);

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

/// A finished generation's counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens this engine did not compute because its own prefix cache held them (whole
    /// pages). A decode that started from a reservation counts what prep_recv matched here,
    /// not the KV another engine pushed into it.
    pub cached_tokens: usize,
}

/// One step's output for one generation: new text, the ids whose text it completes, and how
/// it ended if it did.
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

/// Prefilled KV held for sending: `slots[i]` holds the `i`-th position of the window the
/// request asked for. Its pages stay held until [`Core::release_lease`](super::Core::release_lease)
/// names `id`; `slots.len()` positions is what the handoff moves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    pub id: RequestId,
    pub slots: Vec<u32>,
    /// Positions of the prefill served from the prefix cache rather than computed.
    pub cached_tokens: usize,
}

/// What the core tells its driver, each due at a time ([`Core::take_due`](super::Core::take_due)).
#[derive(Debug)]
pub enum Output {
    /// A generation's text of one step; its last carries the finish.
    Event { id: RequestId, event: Event },
    /// prep_recv's answer: pages reserved, their window open to receivers.
    Reserved { id: RequestId, reply: PrepRecvReply },
    /// A prefill for sending is computed, or a held generation finished (after its finishing
    /// event, unless it was preempted): its slots, held for the handoff.
    Leased(Lease),
    /// What one step did to the prefix cache, in order, as vLLM publishes it: pages that became
    /// full and cached (`BlockStored`, the page keys as block hashes) and pages evicted
    /// (`BlockRemoved`). Due when the step ends, before its other outputs; only from a core
    /// built [`with_kv_events`](super::Core::with_kv_events), and only for a step that changed
    /// the cache.
    KvEvents(Vec<switchyard_wire::kv_events::Event>),
}

/// What the core counted since it started. Each only grows, so a driver publishes differences.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    pub preemptions: u64,
    /// Prompt tokens of admitted requests.
    pub prompt_tokens: u64,
    pub generated_tokens: u64,
    /// Prompt tokens served from the prefix cache: its hits.
    pub prefix_matched_tokens: u64,
    pub remote_send_received: u64,
    pub reservations_expired: u64,
    /// Requests whose caller went away ([`Core::cancel`](super::Core::cancel)).
    pub requests_aborted: u64,
}

/// The core's state, as numbers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Gauges {
    pub running: usize,
    /// Requests waiting for pages, blocked prep_recv calls included.
    pub waiting: usize,
    pub reservations: usize,
    pub kv_pages_used: usize,
    /// Pages an allocation can take: free or idle in the prefix cache.
    pub kv_pages_free: usize,
    pub kv_pages_cached: usize,
}
