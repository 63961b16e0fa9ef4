//! vLLM's NIXL handoff (`docs/src/engines/vllm.md`): the prefill leg (P) with the
//! `do_remote_decode` stanza and one token, its whole JSON answer read, then the decode leg (D)
//! with the client's body and P's `kv_transfer_params` verbatim.
//!
//! The pair runs on a task of its own ([`detached`]), which hears when the attempt is dropped
//! (the client left). Before P answers, that hangs up on P: vLLM aborts a request whose client
//! is gone, and an aborted prefill holds nothing. Once P answered, it holds the prompt's KV for
//! D under a lease (30 s, 480 s on older vLLM) that only D frees early: D is sent the params
//! anyway, and hung up on as soon as its request has been handed to the connection
//! ([`Delivery`]); D then aborts and tells P to free the blocks (vLLM's early release). The
//! one window left: P's answer on the wire while the router hangs up; vLLM then holds the
//! blocks until the lease ends.
//!
//! One upstream id per attempt (`X-Request-Id` on both legs), so a retry never meets a failed
//! attempt's leftovers.

use tokio::sync::oneshot;
use tracing::Instrument;

use switchyard_contract::{EndpointId, Protocol};
use switchyard_wire::vllm::{self, PrefillAnswer};

use super::attempt::{AttemptBody, Generation, streams};
use super::error::{Cause, ExecError, StepKind};
use super::leg::{HandoffLegs, Legs, detached};
use crate::engine_client::{CallError, Delivery};

/// P, then D with P's params (see the module docs).
pub(super) async fn handoff(
    legs: &Legs<'_>,
    prefill: EndpointId,
    decode: EndpointId,
    body: &AttemptBody,
) -> Result<Generation, ExecError> {
    let id = legs.id;
    let span = tracing::debug_span!("vllm_handoff", request = %id.upstream_id, attempt = id.attempt, prefill, decode);
    let HandoffLegs {
        prefill_in_flight,
        prefilling,
        decode_in_flight: in_flight,
        prefill: p_engine,
        decode: d_engine,
    } = legs.handoff(prefill, decode)?;
    let (path, fields) = body.leg(Protocol::Vllm);
    let client = legs.client.clone();
    let request_id = id.upstream_id.clone();
    // Counted on D only if P hands it no KV and D prefills the prompt itself.
    let cluster = legs.cluster.clone();
    let d_uncached = legs.cached.uncached(decode, legs.cached.prompt());
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
            head = client
                .answer_leg(&p_engine, path, &p_body, &request_id)
                .instrument(tracing::debug_span!("prefill_leg", endpoint = prefill)) => head,
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
        drop((prefilling, prefill_in_flight));
        let (d_body, d_prefilling) = match answer {
            Ok(PrefillAnswer::Params(params)) => (vllm::decode_body(fields, params), None),
            Ok(PrefillAnswer::NoParams) => {
                // P kept no blocks (vLLM does so when the request ended otherwise than
                // by the length cap): D prefills the prompt itself.
                tracing::warn!(request = %request_id, prefill, "the prefill answered without kv_transfer_params; the decode engine prefills itself");
                (fields, cluster.prefilling(decode, d_uncached))
            }
            Err(e) => return Some(Err((prefill, StepKind::PrefillLeg, e))),
        };
        // P holds the KV for D now, and only D frees it early: D gets the params even if
        // the attempt is gone, and is hung up on once it has them (it then aborts and
        // tells P to drop the blocks).
        let (delivery, delivered) = Delivery::new();
        let d_leg = client
            .generate_leg(
                &d_engine,
                path,
                &d_body,
                &request_id,
                streams(&d_body),
                Some(&delivery),
            )
            .instrument(tracing::debug_span!("decode_leg", endpoint = decode));
        tokio::select! {
            head = d_leg => Some(head.map(|chunks| (chunks, d_prefilling)).map_err(|e| (decode, StepKind::DecodeLeg, e))),
            _ = async {
                let _ = (&mut gone).await;
                let _ = delivered.await;
            } => None,
        }
    };
    let outcome = detached(pair.instrument(span))
        .await
        .flatten()
        .ok_or_else(|| legs.fail(Cause::Lost, decode, StepKind::DecodeLeg))?;
    drop(alive);
    match outcome {
        Ok((chunks, d_prefilling)) => {
            legs.succeeded(prefill);
            legs.succeeded(decode);
            let generation = Generation::new(chunks, decode, 0, false, in_flight);
            Ok(match d_prefilling {
                Some(prefilling) => generation.prefilling(prefilling),
                None => generation,
            })
        }
        Err((endpoint, step, e)) => {
            if step == StepKind::DecodeLeg {
                // P did its part.
                legs.succeeded(prefill);
            }
            Err(legs.fail(e, endpoint, step))
        }
    }
}
