//! What a policy is asked and what it answers with: the request and context of one attempt,
//! the outcome report, and the errors a planning call can end in.

use std::time::Duration;

use crate::endpoint::EndpointSnapshot;
use crate::plan::EndpointId;

/// The request as a policy sees it. Only the first `PolicyInfo::prompt_tokens` tokens of
/// `prompt` are copied into the guest.
#[derive(Debug, Clone, Copy)]
pub struct PolicyRequest<'a> {
    pub id: u64,
    /// The prompt's token ids; `None` when no reader needed it tokenized (see [`Reads`]).
    pub prompt: Option<&'a [u32]>,
    pub max_tokens: u32,
    pub stream: bool,
    pub model: &'a str,
    pub user: Option<&'a str>,
    /// The request's `x-*` headers, names lower-case.
    pub headers: &'a [(String, String)],
    /// Flow control's view of it (0.2.0 policies see it).
    pub flow: RequestFlow<'a>,
    /// The base model `model` runs on when it is a LoRA adapter (0.2.0 policies see it).
    pub base_model: Option<&'a str>,
}

/// A request's priority, tenant and deadline, as the router's flow control read them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RequestFlow<'a> {
    /// Higher is more important; negative is sheddable.
    pub priority: i32,
    /// `None`: the shared tenant.
    pub tenant: Option<&'a str>,
    /// Milliseconds left before its deadline when the policy is called.
    pub deadline_ms: Option<u32>,
}

/// What a planner reads beyond a request's ids and small fields: the work the router does for
/// it on every request (the contract's `policy-info.reads`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Reads {
    /// The prompt's length or tokens: the router tokenizes the prompt before planning.
    pub prompt: bool,
    /// How each request ended: the router builds an [`Outcome`] and reports it.
    pub outcomes: bool,
}

impl Reads {
    /// Everything: what a planner that does not say reads (a 0.1.0 policy, a test fake).
    pub const ALL: Reads = Reads {
        prompt: true,
        outcomes: true,
    };
    /// Nothing: a planner that routes on the endpoints and the request's small fields alone.
    pub const NOTHING: Reads = Reads {
        prompt: false,
        outcomes: false,
    };

    /// Both planners' reads together.
    pub fn union(self, other: Reads) -> Reads {
        Reads {
            prompt: self.prompt || other.prompt,
            outcomes: self.outcomes || other.outcomes,
        }
    }
}

/// What the router knows when it plans one attempt.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyContext {
    /// 1 for the first attempt.
    pub attempt: u32,
    pub last_failure: Option<Failure>,
    /// Every endpoint, ordered by id.
    pub endpoints: Vec<EndpointSnapshot>,
}

/// Why the previous attempt failed, and where.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Failure {
    pub kind: FailureKind,
    pub endpoint: EndpointId,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureKind {
    Preempted,
    EndpointError,
    Timeout,
}

/// How a request ended, reported to the policy's `on-complete`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Outcome {
    pub request_id: u64,
    pub status: OutcomeStatus,
    pub attempts: u32,
    pub generator: Option<EndpointId>,
    pub prefix_matched: u32,
    pub completion_tokens: u32,
    pub ttft_us: u64,
    pub e2e_us: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutcomeStatus {
    Ok,
    Failed,
    Cancelled,
}

/// Why a policy gave no plan for a request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TranslateError {
    /// The policy says no endpoint can serve the request now.
    #[error("policy {policy}: unavailable: {message}")]
    Unavailable { policy: String, message: String },
    /// The policy refuses this request.
    #[error("policy {policy}: rejected the request: {message}")]
    Rejected { policy: String, message: String },
    /// The policy reports a bug or unexpected state of its own.
    #[error("policy {policy}: internal error: {message}")]
    Internal { policy: String, message: String },
    #[error("policy {policy}: ran past its {} ms deadline", deadline.as_millis())]
    Deadline { policy: String, deadline: Duration },
    #[error("policy {policy}: exceeded its memory cap of {limit_bytes} bytes")]
    MemoryExceeded { policy: String, limit_bytes: usize },
    #[error("policy {policy}: trapped: {reason}")]
    Trap { policy: String, reason: String },
    /// The instance died earlier and could not be rebuilt.
    #[error("policy {policy}: no instance available: {reason}")]
    Instantiate { policy: String, reason: String },
    /// The policy answered past the sandbox's bounds on an answer (a plan too long, an error
    /// message too large): the answer is refused.
    #[error("policy {policy}: answer refused: {reason}")]
    Oversized { policy: String, reason: String },
}

impl TranslateError {
    /// True when the sandbox stopped the policy (trap, deadline, memory, an oversized answer),
    /// as opposed to the policy answering with an error of its own.
    pub fn is_fault(&self) -> bool {
        matches!(
            self,
            TranslateError::Deadline { .. }
                | TranslateError::MemoryExceeded { .. }
                | TranslateError::Trap { .. }
                | TranslateError::Instantiate { .. }
                | TranslateError::Oversized { .. }
        )
    }
}
