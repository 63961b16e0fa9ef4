//! SGLang's bootstrap handoff (`docs/src/engines/sglang.md`): the same body to P and D at once,
//! joined by a fresh bootstrap room on P.
//!
//! Each engine waits for the other (300 s by default), so a leg that fails must take the other
//! down at once: both heads are awaited together and the first failure drops the other leg
//! (closing its connection is how the engine learns of it), and once both answered, a P that
//! fails while D streams ends D's stream too, blamed on P ([`Partner`]).
//!
//! One upstream id per attempt (`X-Request-Id` on both legs) and a fresh room per attempt, so a
//! retry never meets a failed attempt's leftovers.

use std::time::Duration;

use futures::future::Either;
use futures::{FutureExt, StreamExt};
use tracing::Instrument;

use switchyard_contract::{EndpointId, Protocol};
use switchyard_wire::sglang;
use switchyard_wire::sse::ChunkStream;

use super::attempt::{AttemptBody, Generation, Partner, streams};
use super::error::{Cause, ExecError, StepKind};
use super::leg::{HandoffLegs, Legs};
use crate::cluster::{InFlight, Prefilling};
use crate::engine_client::CallError;

/// Both legs at once (see the module docs).
pub(super) async fn handoff(
    legs: &Legs<'_>,
    prefill: EndpointId,
    decode: EndpointId,
    body: &AttemptBody,
) -> Result<Generation, ExecError> {
    let id = legs.id;
    let span = tracing::debug_span!("sglang_handoff", request = %id.upstream_id, attempt = id.attempt, prefill, decode);
    let HandoffLegs {
        prefill_in_flight,
        prefilling,
        decode_in_flight: in_flight,
        prefill: p_engine,
        decode: d_engine,
    } = legs.handoff(prefill, decode)?;
    // A misconfigured endpoint, not a failing one: the cluster hears nothing of it.
    let (host, port) = legs
        .cluster
        .bootstrap(prefill)
        .ok_or_else(|| legs.fail(Cause::NoBootstrapPort, prefill, StepKind::PrefillLeg))?;
    let room = sglang::room(rand::random());
    let (path, fields) = body.leg(Protocol::Sglang);
    let paired = sglang::paired_body(&fields, &host, port, room);
    tracing::debug!(parent: &span, room, "bootstrap room");
    let leg = |engine, endpoint, step, span: tracing::Span| {
        let paired = &paired;
        async move {
            legs.client
                .generate_leg(engine, path, paired, &id.upstream_id, streams(paired), None)
                .instrument(span)
                .await
                .map_err(|e| (endpoint, step, e))
        }
    };
    let (p_span, d_span) = span.in_scope(|| {
        (
            tracing::debug_span!("prefill_leg", endpoint = prefill),
            tracing::debug_span!("decode_leg", endpoint = decode),
        )
    });
    let p_leg = leg(&p_engine, prefill, StepKind::PrefillLeg, p_span);
    let d_leg = leg(&d_engine, decode, StepKind::DecodeLeg, d_span);
    let (p_chunks, d_chunks) = both_heads(p_leg, d_leg)
        .instrument(span)
        .await
        .map_err(|(endpoint, step, e): (_, _, CallError)| legs.fail(e, endpoint, step))?;
    legs.succeeded(prefill);
    legs.succeeded(decode);
    let partner = Partner {
        endpoint: prefill,
        step: StepKind::PrefillLeg,
        answer: drain(p_chunks, prefill_in_flight, prefilling.clone()).boxed(),
    };
    // P's prompt is prefilled by the time D streams, or P answered: whichever the router sees
    // first ends its count.
    Ok(Generation::new(d_chunks, decode, 0, false, in_flight)
        .with_partner(partner)
        .prefilling(prefilling))
}

/// How long a decode leg's failure waits for the prefill leg's before it is blamed on D.
///
/// D bootstraps from P: when P dies, D answers an error (it cannot reach the bootstrap server)
/// at about the moment the router sees P's connection fail, and whichever the router reads
/// first would be blamed. Blamed on D, a dead P ejects the decode engine (a sidecar's only
/// one). A P that is gone fails its leg at once (a reset or a refused connection), so a short
/// wait for P's answer tells the two apart; a P still working at the end of it is not failing,
/// and D's failure is D's. Only a failing D waits, and only this long.
const PARTNER_VERDICT: Duration = Duration::from_millis(250);

/// Both legs' heads. The first leg to fail drops the other, mid-call: its engine sees the
/// connection close and stops waiting for its partner. A failing D first waits
/// [`PARTNER_VERDICT`] for P's verdict: P failing too is P's failure.
async fn both_heads<T, E>(
    p_leg: impl Future<Output = Result<T, E>>,
    d_leg: impl Future<Output = Result<T, E>>,
) -> Result<(T, T), E> {
    let (p_leg, d_leg) = (std::pin::pin!(p_leg), std::pin::pin!(d_leg));
    match futures::future::select(p_leg, d_leg).await {
        Either::Left((p, d_leg)) => Ok((p?, d_leg.await?)),
        Either::Right((Ok(d), p_leg)) => Ok((p_leg.await?, d)),
        Either::Right((Err(d_failed), p_leg)) => {
            match tokio::time::timeout(PARTNER_VERDICT, p_leg).await {
                Ok(Err(p_failed)) => Err(p_failed),
                Ok(Ok(_)) | Err(_) => Err(d_failed),
            }
        }
    }
}

/// Read P's answer to its end (nobody shows it: the client's answer is D's), counting P's leg
/// in flight, and its prompt as not prefilled, until then. An error event, a broken stream or
/// an idle one is P's failure.
async fn drain(
    mut chunks: ChunkStream,
    in_flight: InFlight,
    prefilling: Prefilling,
) -> Result<(), CallError> {
    while let Some(chunk) = chunks.next().await {
        chunk?;
    }
    drop((prefilling, in_flight));
    Ok(())
}
