//! What every protocol's legs share: looking an endpoint up, counting it in flight and the
//! prompt tokens it has to prefill, turning a call's result into the attempt's (telling the
//! cluster how the endpoint did), and running a call on a task of its own.

use std::ops::Range;
use std::sync::Arc;

use switchyard_contract::EndpointId;

use super::attempt::{AttemptId, CachedPrefixes};
use super::error::{Cause, ExecError, StepKind};
use crate::cluster::{Cluster, InFlight, Prefilling};
use crate::engine_client::{CallError, EngineClient, Upstream};

/// One attempt's view of the engines: the cluster, the client, the attempt's identity, and
/// what each engine was predicted to hold of its prompt.
pub(super) struct Legs<'a> {
    pub(super) cluster: &'a Arc<Cluster>,
    pub(super) client: &'a EngineClient,
    pub(super) id: &'a AttemptId,
    pub(super) cached: &'a CachedPrefixes,
}

/// The two legs of a P/D handoff (vLLM's, SGLang's), each endpoint counted in flight and
/// looked up before either is called, and the prompt counted on P until P has prefilled it.
pub(super) struct HandoffLegs {
    pub(super) prefill_in_flight: InFlight,
    pub(super) prefilling: Prefilling,
    pub(super) decode_in_flight: InFlight,
    pub(super) prefill: Upstream,
    pub(super) decode: Upstream,
}

impl Legs<'_> {
    /// Both legs of a handoff, or the first endpoint gone since validation (its guards
    /// dropped with the error, so nothing stays counted).
    pub(super) fn handoff(
        &self,
        prefill: EndpointId,
        decode: EndpointId,
    ) -> Result<HandoffLegs, ExecError> {
        let decode_in_flight = self.in_flight(decode, StepKind::DecodeLeg)?;
        let prefill_in_flight = self.in_flight(prefill, StepKind::PrefillLeg)?;
        let prompt = self.cached.prompt();
        let prefilling = self.prefilling(prefill, prompt, StepKind::PrefillLeg)?;
        Ok(HandoffLegs {
            prefill_in_flight,
            prefilling,
            decode_in_flight,
            prefill: self.upstream(prefill, StepKind::PrefillLeg)?,
            decode: self.upstream(decode, StepKind::DecodeLeg)?,
        })
    }

    /// `endpoint`, counted in flight until the returned guard is dropped.
    pub(super) fn in_flight(
        &self,
        endpoint: EndpointId,
        step: StepKind,
    ) -> Result<InFlight, ExecError> {
        self.cluster
            .in_flight(endpoint)
            .ok_or_else(|| self.fail(Cause::UnknownEndpoint, endpoint, step))
    }

    /// The tokens of `window` (a range of prompt positions) that `endpoint` has to prefill, as
    /// its predicted cached prefix leaves them, counted on it until the guard is done or dropped.
    pub(super) fn prefilling(
        &self,
        endpoint: EndpointId,
        window: Range<u32>,
        step: StepKind,
    ) -> Result<Prefilling, ExecError> {
        let tokens = self.cached.uncached(endpoint, window);
        self.cluster
            .prefilling(endpoint, tokens)
            .ok_or_else(|| self.fail(Cause::UnknownEndpoint, endpoint, step))
    }

    /// How to call `endpoint`: pinned to the DP rank that holds the prompt, if the snapshot
    /// pinned one.
    pub(super) fn upstream(
        &self,
        endpoint: EndpointId,
        step: StepKind,
    ) -> Result<Upstream, ExecError> {
        let upstream = self
            .cluster
            .upstream(endpoint)
            .ok_or_else(|| self.fail(Cause::UnknownEndpoint, endpoint, step))?;
        Ok(match self.cached.rank(endpoint) {
            Some(rank) => upstream.pinned_to_rank(rank),
            None => upstream,
        })
    }

    /// A call's result as the attempt's, the cluster told how the endpoint did.
    pub(super) fn check<T>(
        &self,
        result: Result<T, CallError>,
        endpoint: EndpointId,
        step: StepKind,
    ) -> Result<T, ExecError> {
        match result {
            Ok(value) => {
                self.cluster.record_success(endpoint);
                Ok(value)
            }
            Err(e) => Err(self.fail(e, endpoint, step)),
        }
    }

    /// `endpoint` did its part.
    pub(super) fn succeeded(&self, endpoint: EndpointId) {
        self.cluster.record_success(endpoint);
    }

    /// `cause`, in `step` on `endpoint`: classified once, here, and told to the cluster.
    pub(super) fn fail(
        &self,
        cause: impl Into<Cause>,
        endpoint: EndpointId,
        step: StepKind,
    ) -> ExecError {
        let error = ExecError::new(cause, endpoint, step, self.id.attempt);
        error.record(self.cluster);
        error
    }
}

/// Runs `call` on a task of its own, so it runs to its answer even if the caller is dropped.
/// An answer nobody reads is dropped: answers clean up after themselves when dropped (an armed
/// reservation frees its pages, a stream hangs up). `None`: the task ended without an answer
/// ([`Cause::Lost`]).
pub(super) async fn detached<T: Send + 'static>(
    call: impl Future<Output = T> + Send + 'static,
) -> Option<T> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        // Nobody listening: the answer is dropped here.
        let _ = tx.send(call.await);
    });
    rx.await.ok()
}
