//! The legs of vLLM's and SGLang's handoffs, and forwards to engines that are not MLC's.
//!
//! vLLM (`shared/spec/vllm-pd.md`): the prefill leg (P) with the `do_remote_decode` stanza and
//! one token, its whole JSON answer read, then the decode leg (D) with the client's body and
//! P's `kv_transfer_params` verbatim. The pair runs on a task of its own ([`detached`]),
//! which hears when the attempt is dropped (the client left). Before P answers, that hangs up
//! on P: vLLM aborts a request whose client is gone, and an aborted prefill holds nothing. Once
//! P answered, it holds the prompt's KV for D under a lease (30 s, 480 s on older vLLM) that
//! only D frees early: D is sent the params anyway, and hung up on as soon as its request has
//! been handed to the connection ([`Delivery`]); D then aborts and tells P to free the blocks
//! (vLLM's early release). The one window left: P's answer on the wire while the router hangs
//! up; vLLM then holds the blocks until the lease ends.
//!
//! SGLang (`shared/spec/sglang-pd.md`): the same body to P and D at once, joined by a fresh
//! bootstrap room on P. Each engine waits for the other (300 s by default), so a leg that
//! fails must take the other down at once: both heads are awaited together and the first
//! failure drops the other leg (closing its connection is how the engine learns of it), and
//! once both answered, a P that fails while D streams ends D's stream too.
//!
//! Both: one upstream id per attempt (`X-Request-Id` on both legs) and a fresh room per SGLang
//! attempt, so a retry never meets a failed attempt's leftovers.

use futures::{FutureExt, StreamExt};
use tokio::sync::oneshot;
use tracing::Instrument;

use switchyard_contract::{EndpointId, Protocol};
use switchyard_wire::sglang;
use switchyard_wire::sse::{ChunkStream, SseError};
use switchyard_wire::vllm::{self, PrefillAnswer};

use super::execute::{
    AttemptBody, AttemptId, ExecError, Executor, Generation, StepKind, detached, streams,
};
use crate::cluster::InFlight;
use crate::engine_client::{CallError, Delivery, Upstream};

/// Which leg of a pair failed, and how.
type LegFailure = (EndpointId, StepKind, CallError);

impl Executor {
    /// The whole request to one vLLM, SGLang or OpenAI engine, on the client's route.
    pub(super) async fn forward_leg(
        &self,
        endpoint: EndpointId,
        protocol: Protocol,
        body: &AttemptBody,
        id: &AttemptId,
    ) -> Result<Generation, ExecError> {
        let span = tracing::debug_span!("forward", request = %id.upstream_id, attempt = id.attempt, endpoint, %protocol);
        let guard = self.guard(endpoint, StepKind::Forward, id)?;
        let engine = self.upstream(endpoint, StepKind::Forward, id)?;
        let (path, fields) = body.leg(protocol);
        let result = self
            .client()
            .generate_leg(
                &engine,
                path,
                &fields,
                &id.upstream_id,
                streams(&fields),
                None,
            )
            .instrument(span)
            .await;
        let chunks = self.check(result, endpoint, StepKind::Forward, id)?;
        Ok(Generation::new(chunks, endpoint, 0, false, guard))
    }

    /// vLLM's NIXL handoff: P, then D with P's params (see the module docs).
    pub(super) async fn vllm_handoff(
        &self,
        prefill: EndpointId,
        decode: EndpointId,
        body: &AttemptBody,
        id: &AttemptId,
    ) -> Result<Generation, ExecError> {
        let span = tracing::debug_span!("vllm_handoff", request = %id.upstream_id, attempt = id.attempt, prefill, decode);
        let Ends {
            guard,
            prefill_guard,
            p_engine,
            d_engine,
        } = self.ends(prefill, decode, id)?;
        let (path, fields) = body.leg(Protocol::Vllm);
        let client = self.client().clone();
        let request_id = id.upstream_id.clone();
        // The pair runs on a task of its own, told of the attempt's end by `gone` (its sender
        // lives as long as the attempt waits here).
        let (alive, mut gone) = oneshot::channel::<()>();
        let pair = async move {
            // Until P answers, P is the attempt's to cancel: hung up on, vLLM aborts it and it
            // holds nothing. Once its answer's head is in, P holds the KV: an answer and a
            // hang-up both ready go the answer's way (`biased`).
            let p_body = vllm::prefill_body(&fields);
            let head = tokio::select! {
                biased;
                head = client.answer_leg(&p_engine, path, &p_body, &request_id) => head,
                _ = &mut gone => return None,
            };
            let answer = match head {
                Ok(head) => head.read().await.and_then(|bytes| {
                    PrefillAnswer::parse(&bytes).ok_or_else(|| CallError::Decode {
                        reason: "the prefill answer is not a JSON object".into(),
                    })
                }),
                Err(e) => Err(e),
            };
            drop(prefill_guard);
            let d_body = match answer {
                Ok(PrefillAnswer::Params(params)) => vllm::decode_body(fields, params),
                Ok(PrefillAnswer::NoParams) => {
                    // P kept no blocks (vLLM does so when the request ended otherwise than
                    // by the length cap): D prefills the prompt itself.
                    tracing::warn!(request = %request_id, prefill, "the prefill answered without kv_transfer_params; the decode engine prefills itself");
                    fields
                }
                Err(e) => return Some(Err((prefill, StepKind::PrefillLeg, e))),
            };
            // P holds the KV for D now, and only D frees it early: D gets the params even if
            // the attempt is gone, and is hung up on once it has them (it then aborts and
            // tells P to drop the blocks).
            let (delivery, delivered) = Delivery::new();
            let d_leg = client.generate_leg(
                &d_engine,
                path,
                &d_body,
                &request_id,
                streams(&d_body),
                Some(&delivery),
            );
            tokio::select! {
                head = d_leg => Some(head.map_err(|e| (decode, StepKind::DecodeLeg, e))),
                _ = async {
                    let _ = (&mut gone).await;
                    let _ = delivered.await;
                } => None,
            }
        };
        let outcome = detached(pair.instrument(span))
            .await
            .flatten()
            .ok_or_else(|| self.lost(decode, StepKind::DecodeLeg, id))?;
        drop(alive);
        let chunks = match outcome {
            Ok(chunks) => {
                self.check(Ok(()), prefill, StepKind::PrefillLeg, id)?;
                self.check(Ok(chunks), decode, StepKind::DecodeLeg, id)?
            }
            Err((endpoint, step, e)) => {
                if step == StepKind::DecodeLeg {
                    // P did its part.
                    self.check(Ok(()), prefill, StepKind::PrefillLeg, id)?;
                }
                return Err(self.failed(e, endpoint, step, id));
            }
        };
        Ok(Generation::new(chunks, decode, 0, false, guard))
    }

    /// SGLang's bootstrap handoff: both legs at once (see the module docs).
    pub(super) async fn sglang_handoff(
        &self,
        prefill: EndpointId,
        decode: EndpointId,
        body: &AttemptBody,
        id: &AttemptId,
    ) -> Result<Generation, ExecError> {
        let span = tracing::debug_span!("sglang_handoff", request = %id.upstream_id, attempt = id.attempt, prefill, decode);
        let Ends {
            guard,
            prefill_guard,
            p_engine,
            d_engine,
        } = self.ends(prefill, decode, id)?;
        let (host, port) = self.cluster().bootstrap(prefill).ok_or_else(|| ExecError {
            endpoint: prefill,
            step: StepKind::PrefillLeg,
            attempt: id.attempt,
            source: CallError::Connect {
                reason: "the endpoint has no bootstrap port".into(),
            },
        })?;
        let room = sglang::room(rand::random());
        let (path, fields) = body.leg(Protocol::Sglang);
        let paired = sglang::paired_body(&fields, &host, port, room);
        tracing::debug!(parent: &span, room, "bootstrap room");
        let client = self.client();
        let leg = |engine, endpoint, step| {
            let paired = &paired;
            async move {
                let result: Result<ChunkStream, LegFailure> = client
                    .generate_leg(engine, path, paired, &id.upstream_id, streams(paired), None)
                    .await
                    .map_err(|e| (endpoint, step, e));
                result
            }
        };
        let p_leg = leg(&p_engine, prefill, StepKind::PrefillLeg);
        let d_leg = leg(&d_engine, decode, StepKind::DecodeLeg);
        // The first leg to fail drops the other, mid-call: its engine sees the connection
        // close and stops waiting for its partner.
        let heads: Result<_, LegFailure> = futures::future::try_join(p_leg, d_leg)
            .instrument(span)
            .await;
        let (p_chunks, d_chunks) = match heads {
            Ok(heads) => heads,
            Err((endpoint, step, e)) => {
                return Err(self.failed(e, endpoint, step, id));
            }
        };
        self.check(Ok(()), prefill, StepKind::PrefillLeg, id)?;
        self.check(Ok(()), decode, StepKind::DecodeLeg, id)?;
        let chunks = ended_by_prefill(d_chunks, drain(p_chunks, prefill_guard));
        Ok(Generation::new(chunks, decode, 0, false, guard))
    }
}

/// Both ends of a pair: their engines, each counted in flight (D's count is the generation's).
struct Ends {
    guard: InFlight,
    prefill_guard: InFlight,
    p_engine: Upstream,
    d_engine: Upstream,
}

impl Executor {
    fn ends(
        &self,
        prefill: EndpointId,
        decode: EndpointId,
        id: &AttemptId,
    ) -> Result<Ends, ExecError> {
        Ok(Ends {
            guard: self.guard(decode, StepKind::DecodeLeg, id)?,
            prefill_guard: self.guard(prefill, StepKind::PrefillLeg, id)?,
            p_engine: self.upstream(prefill, StepKind::PrefillLeg, id)?,
            d_engine: self.upstream(decode, StepKind::DecodeLeg, id)?,
        })
    }
}

/// Read P's answer to its end (nobody shows it: the client's answer is D's), counting P's leg
/// in flight until then. An error event, a broken stream or an idle one is P's failure.
async fn drain(mut chunks: ChunkStream, in_flight: InFlight) -> Result<(), SseError> {
    while let Some(chunk) = chunks.next().await {
        chunk?;
    }
    drop(in_flight);
    Ok(())
}

/// D's chunks, ended with P's error if P fails before D's stream ends: D would otherwise wait
/// for KV that never comes. Once D's stream ends, what is left of P's answer is read on a task
/// of its own (it is due at once: P answers when its push is done).
fn ended_by_prefill(
    decode: ChunkStream,
    prefill: impl Future<Output = Result<(), SseError>> + Send + 'static,
) -> ChunkStream {
    struct Pair {
        decode: ChunkStream,
        prefill: Option<futures::future::BoxFuture<'static, Result<(), SseError>>>,
        failed: bool,
    }
    let pair = Pair {
        decode,
        prefill: Some(prefill.boxed()),
        failed: false,
    };
    Box::pin(futures::stream::unfold(pair, |mut pair| async move {
        if pair.failed {
            return None;
        }
        loop {
            let Some(prefill) = pair.prefill.as_mut() else {
                let item = pair.decode.next().await?;
                return Some((item, pair));
            };
            tokio::select! {
                item = pair.decode.next() => match item {
                    Some(item) => return Some((item, pair)),
                    None => {
                        if let Some(rest) = pair.prefill.take() {
                            tokio::spawn(rest);
                        }
                        return None;
                    }
                },
                result = prefill => {
                    pair.prefill = None;
                    if let Err(e) = result {
                        pair.failed = true;
                        let why = SseError::Transport(format!("the prefill leg failed: {e}"));
                        return Some((Err(why), pair));
                    }
                }
            }
        }
    }))
}
