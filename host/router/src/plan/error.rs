//! The one error of plan execution, classified once, where the failure is detected.
//!
//! Modelled on Pingora's `Error { etype, esource, retry }`: an [`ExecError`] names the endpoint,
//! the step and the attempt, says what went wrong ([`Cause`]), where it came from ([`Origin`])
//! and whether another attempt may help. Those are set when the error is made, from its cause;
//! the retry loop, the outlier detector and the HTTP mapping read them and never a message.
//!
//! | cause                                   | origin     | retry | blames the endpoint |
//! |-----------------------------------------|------------|-------|---------------------|
//! | unreachable, closed, timeout, 5xx       | upstream   | yes   | yes (unreachable also marks it down) |
//! | a broken or idle stream, no finish      | upstream   | yes   | yes                 |
//! | 429 (the engine pacing its load)        | upstream   | yes   | no                  |
//! | an answer that does not parse           | upstream   | no    | yes                 |
//! | another status (3xx)                    | upstream   | no    | no                  |
//! | 4xx (the engine refused the request)    | downstream | no    | no                  |
//! | a body that does not serialize          | internal   | no    | no                  |
//! | an endpoint gone since validation, a missing bootstrap port, an unusable URL, a lost call task | internal | yes | no |
//!
//! Internal failures are ours (the cluster changed under the plan, an endpoint is
//! misconfigured, a task was lost): they never mark an endpoint down or count toward ejecting
//! it, but another plan, on other endpoints, may well work, so they are retried through the
//! policy, which hears of them as an endpoint error.

use switchyard_contract::{EndpointId, FailureKind};
use switchyard_wire::sse::SseError;

use crate::cluster::Cluster;
use crate::engine_client::CallError;

/// The step an error happened in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepKind {
    PrepRecv,
    RemoteSend,
    StartGenerate,
    Forward,
    /// The prefill leg of a vLLM or SGLang handoff (for SGLang, until its answer ends, which
    /// may be while the decode leg streams).
    PrefillLeg,
    /// The decode leg of a vLLM or SGLang handoff, up to its answer's head.
    DecodeLeg,
    /// Reading the generation stream after it started.
    Relay,
}

impl std::fmt::Display for StepKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            StepKind::PrepRecv => "prep_recv",
            StepKind::RemoteSend => "remote_send",
            StepKind::StartGenerate => "start_generate",
            StepKind::Forward => "forward",
            StepKind::PrefillLeg => "prefill leg",
            StepKind::DecodeLeg => "decode leg",
            StepKind::Relay => "relay",
        })
    }
}

/// Where a failure came from: who must change for it to go away (Pingora's `ErrorSource`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// The engine: down, slow, failing, or breaking its protocol.
    Upstream,
    /// The request: an engine refused it as it is.
    Downstream,
    /// The router: its view of the cluster, an endpoint's configuration, its own tasks.
    Internal,
}

/// What went wrong.
#[derive(Debug, thiserror::Error)]
pub enum Cause {
    /// A call to the engine failed.
    #[error(transparent)]
    Call(#[from] CallError),
    /// The engine's stream ended (with `[DONE]`) without a finish_reason: it broke the
    /// protocol, and the generation may be incomplete.
    #[error("the stream ended without a finish_reason")]
    Unfinished,
    /// The plan names an endpoint the cluster no longer has (removed since the plan was
    /// validated against its snapshot).
    #[error("the endpoint no longer exists")]
    UnknownEndpoint,
    /// An SGLang prefill endpoint without a bootstrap port: its legs cannot be paired.
    #[error("the endpoint has no bootstrap port")]
    NoBootstrapPort,
    /// A call's task ended without an answer (it panicked, or the runtime is shutting down).
    #[error("the call ended without an answer")]
    Lost,
}

impl Cause {
    fn origin(&self) -> Origin {
        match self {
            Cause::Call(CallError::Status { status, .. }) if is_refusal(*status) => {
                Origin::Downstream
            }
            Cause::Call(CallError::Build { .. } | CallError::Url { .. })
            | Cause::UnknownEndpoint
            | Cause::NoBootstrapPort
            | Cause::Lost => Origin::Internal,
            Cause::Call(_) | Cause::Unfinished => Origin::Upstream,
        }
    }

    /// Whether another attempt may succeed: not for a request the engine refused, nor for an
    /// answer that does not parse (an engine speaking another protocol will not learn it), nor
    /// for a body we cannot write. Of the statuses, 5xx and 429 are retried.
    fn retryable(&self) -> bool {
        match self {
            Cause::Call(CallError::Status { status, .. }) => *status >= 500 || *status == 429,
            Cause::Call(CallError::Decode { .. } | CallError::Build { .. }) => false,
            _ => true,
        }
    }

    /// Whether the endpoint itself is to blame: of the statuses only 5xx (429 is an engine
    /// pacing its load, not failing); of the rest, what came from the engine.
    fn blames_endpoint(&self) -> bool {
        match self {
            Cause::Call(CallError::Status { status, .. }) => *status >= 500,
            cause => cause.origin() == Origin::Upstream,
        }
    }
}

/// A 4xx other than 429: the engine refused the request itself.
fn is_refusal(status: u16) -> bool {
    (400..500).contains(&status) && status != 429
}

/// A failed step of one attempt.
#[derive(Debug, thiserror::Error)]
#[error("attempt {attempt}: {step} on endpoint {endpoint} failed: {cause}")]
pub struct ExecError {
    /// The endpoint that failed: for a pair's leg, that leg's endpoint, even when the failure
    /// surfaced in the other leg's stream.
    pub endpoint: EndpointId,
    pub step: StepKind,
    pub attempt: u32,
    #[source]
    pub cause: Cause,
    origin: Origin,
    retry: bool,
    blame: bool,
}

impl ExecError {
    /// `cause`, detected in `step` on `endpoint` during `attempt`, classified.
    pub fn new(
        cause: impl Into<Cause>,
        endpoint: EndpointId,
        step: StepKind,
        attempt: u32,
    ) -> Self {
        let cause = cause.into();
        ExecError {
            endpoint,
            step,
            attempt,
            origin: cause.origin(),
            retry: cause.retryable(),
            blame: cause.blames_endpoint(),
            cause,
        }
    }

    pub fn origin(&self) -> Origin {
        self.origin
    }

    /// Whether another attempt (through the policy) may succeed.
    pub fn retryable(&self) -> bool {
        self.retry
    }

    /// Whether the failure counts toward ejecting [`ExecError::endpoint`].
    pub fn blames_endpoint(&self) -> bool {
        self.blame
    }

    /// Whether the engine did not answer in time (its answer's head or body; a stream that
    /// went quiet is [`FailureKind::Timeout`] to the policy but broke, to the client).
    pub fn timed_out(&self) -> bool {
        matches!(&self.cause, Cause::Call(call) if call.is_timeout())
    }

    /// Tell the cluster: an endpoint that could not be reached is down until its probe
    /// answers again, and a failure it is to blame for counts toward ejecting it.
    pub fn record(&self, cluster: &Cluster) {
        if matches!(&self.cause, Cause::Call(call) if call.is_unreachable()) {
            cluster.mark_unhealthy(self.endpoint);
        }
        if self.blame {
            cluster.record_failure(self.endpoint, self);
        }
    }

    /// How the policy hears about this failure on the next attempt.
    pub fn failure_kind(&self) -> FailureKind {
        match &self.cause {
            Cause::Call(CallError::Timeout { .. } | CallError::Stream(SseError::Idle(_))) => {
                FailureKind::Timeout
            }
            _ => FailureKind::EndpointError,
        }
    }
}
