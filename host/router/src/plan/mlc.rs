//! MLC's disaggregated flow (`docs/src/engines/mlc.md`): prep_recv on D → remote_send on P
//! (unless D's prefix cache already holds the window) → start_generate on D, whose stream is
//! the generation. Each step is one function in its own tracing span (request id, attempt,
//! endpoint).
//!
//! No KV is left reserved. prep_recv and start_generate run on tasks of their own
//! ([`detached`]): once such a call may have reached D, only its answer says whether D holds
//! pages for the request, so the answer is always read, even when the attempt was dropped
//! meanwhile. Between a successful prep_recv and start_generate, D's pages belong to a
//! [`Reservation`]; an attempt that ends in between (remote_send failed or timed out,
//! start_generate was refused, the client left) frees them in the background ([`release`]).

use std::time::Duration;

use tokio::time::Instant;
use tracing::Instrument;

use switchyard_contract::{EndpointId, RemoteSend};
use switchyard_wire::completion::CompletionRequest;
use switchyard_wire::microserving::{
    PrepRecvRequest, PrepRecvResponse, RemoteSendRequest, StartGenerateRequest,
};
use switchyard_wire::sse::ChunkStream;

use super::attempt::Generation;
use super::error::{Cause, ExecError, StepKind};
use super::leg::{Legs, detached};
use crate::engine_client::{CallError, EngineClient, Release, Upstream};

/// The disaggregated plan: D reserves `[0, end)`, P (if the plan has a remote_send and D's
/// prefix cache leaves something to move) sends it, D generates.
pub(super) async fn disagg(
    legs: &Legs<'_>,
    decode: EndpointId,
    end: u32,
    send: Option<RemoteSend>,
    body: CompletionRequest,
) -> Result<Generation, ExecError> {
    let in_flight = legs.in_flight(decode, StepKind::PrepRecv)?;
    // What D prefills itself: past the window when P sends it (or D's cache holds it), else
    // the whole prompt.
    let d_window = match send {
        Some(_) => end..legs.cached.prompt().end,
        None => legs.cached.prompt(),
    };
    let prefilling = legs.prefilling(decode, d_window, StepKind::PrepRecv)?;
    let (prep, reservation) = prep_recv(legs, decode, end, body).await?;
    let mut remote_send_skipped = false;
    if let Some(send) = send {
        let begin = send.begin.unwrap_or(prep.prefix_matched_length);
        if begin < end {
            let window = Window { begin, end };
            let body = &reservation.request().common;
            remote_send(legs, send.prefill, decode, window, &prep, body).await?;
        } else {
            // D's prefix cache already holds [0, end): nothing to move.
            remote_send_skipped = true;
            tracing::debug!(request = %legs.id.upstream_id, decode, end, "remote_send skipped");
        }
    }
    let chunks = start_generate(legs, decode, reservation).await?;
    Ok(Generation::new(
        chunks,
        decode,
        prep.prefix_matched_length,
        remote_send_skipped,
        in_flight,
    )
    .prefilling(prefilling))
}

/// prep_recv on D; on success, D's pages for `[0, end)` are the returned [`Reservation`]'s.
async fn prep_recv(
    legs: &Legs<'_>,
    decode: EndpointId,
    end: u32,
    body: CompletionRequest,
) -> Result<(PrepRecvResponse, Reservation), ExecError> {
    let id = legs.id;
    let span = tracing::debug_span!("prep_recv", request = %id.upstream_id, attempt = id.attempt, endpoint = decode, end);
    let engine = legs.upstream(decode, StepKind::PrepRecv)?;
    let mut pending = Reservation {
        client: legs.client.clone(),
        engine,
        decode,
        request: Some(StartGenerateRequest {
            common: body,
            begin: i64::from(end),
        }),
        armed: false,
    };
    let request = PrepRecvRequest {
        common: pending.request().common.clone(),
        end: i64::from(end),
    };
    let call = async move {
        let answer = pending.client.prep_recv(&pending.engine, &request).await;
        // Armed before anyone may see it: dropped anywhere from here (with the attempt,
        // or unread in the channel), it frees D's pages.
        if answer.is_ok() {
            pending.arm();
        }
        (answer, pending)
    };
    let (answer, reservation) = detached(call.instrument(span))
        .await
        .ok_or_else(|| legs.fail(Cause::Lost, decode, StepKind::PrepRecv))?;
    let prep = legs.check(answer, decode, StepKind::PrepRecv)?;
    Ok((prep, reservation))
}

/// The KV window a remote_send moves, `[begin, end)`.
struct Window {
    begin: u32,
    end: u32,
}

/// remote_send on P: compute the window and push its KV into D's reservation.
async fn remote_send(
    legs: &Legs<'_>,
    prefill: EndpointId,
    decode: EndpointId,
    Window { begin, end }: Window,
    prep: &PrepRecvResponse,
    body: &CompletionRequest,
) -> Result<(), ExecError> {
    let id = legs.id;
    let span = tracing::debug_span!("remote_send", request = %id.upstream_id, attempt = id.attempt, endpoint = prefill, decode, begin, end);
    let _in_flight = legs.in_flight(prefill, StepKind::RemoteSend)?;
    // P computes the window's KV from the prompt's start, less what its own cache holds;
    // counted until it answers.
    let _prefilling = legs.prefilling(prefill, 0..end, StepKind::RemoteSend)?;
    let recv_rank = legs
        .cluster
        .device_rank(decode)
        .ok_or_else(|| legs.fail(Cause::UnknownEndpoint, decode, StepKind::RemoteSend))?;
    let request = RemoteSendRequest {
        common: body.clone(),
        begin: i64::from(begin),
        end: i64::from(end),
        // Opaque to the router: D's metadata goes to P verbatim.
        kv_addr_info: prep.kv_append_metadata.clone(),
        recv_rank,
    };
    let engine = legs.upstream(prefill, StepKind::RemoteSend)?;
    let result = legs
        .client
        .remote_send(&engine, &request)
        .instrument(span)
        .await;
    legs.check(result, prefill, StepKind::RemoteSend)
}

/// start_generate on D, which takes the reservation's pages over: from the moment the call
/// may reach D, D frees them itself (it aborts a generation whose client is gone), so the
/// answer is read even if the attempt is dropped, and a stream nobody wants is hung up on.
/// Only a refusal leaves the pages reserved, and frees them like any other dropped
/// reservation.
async fn start_generate(
    legs: &Legs<'_>,
    decode: EndpointId,
    mut reservation: Reservation,
) -> Result<ChunkStream, ExecError> {
    let id = legs.id;
    let span = tracing::debug_span!("start_generate", request = %id.upstream_id, attempt = id.attempt, endpoint = decode);
    let mut taken = reservation.disarm();
    let call = async move {
        let answer = taken
            .client
            .start_generate(&taken.engine, taken.request())
            .await;
        if matches!(answer, Err(CallError::Status { .. })) {
            taken.arm();
        }
        answer
    };
    let answer = detached(call.instrument(span))
        .await
        .ok_or_else(|| legs.fail(Cause::Lost, decode, StepKind::StartGenerate))?;
    legs.check(answer, decode, StepKind::StartGenerate)
}

// === impl Reservation ===

/// D's pages for one attempt, from a successful prep_recv until start_generate takes them
/// over. Dropped while armed, whatever the reason, it frees them in the background
/// ([`release`]).
struct Reservation {
    client: EngineClient,
    /// D.
    engine: Upstream,
    decode: EndpointId,
    /// The start_generate that takes the pages over, and the one a release sends.
    request: Option<StartGenerateRequest>,
    armed: bool,
}

impl Reservation {
    fn request(&self) -> &StartGenerateRequest {
        // Taken only by `drop`.
        self.request
            .as_ref()
            .expect("the request lives as long as the reservation")
    }

    /// This reservation, unarmed (a call in flight decides what it becomes), leaving an
    /// empty, unarmed one behind.
    fn disarm(&mut self) -> Reservation {
        self.armed = false;
        Reservation {
            client: self.client.clone(),
            engine: self.engine.clone(),
            decode: self.decode,
            request: self.request.take(),
            armed: false,
        }
    }

    /// D holds the pages: free them if this is dropped.
    fn arm(&mut self) {
        self.armed = true;
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let (true, Some(request)) = (self.armed, self.request.take()) else {
            return;
        };
        // Drop runs on the runtime; one that is shutting down has no engines left to call.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let engine = self.engine.clone();
            runtime.spawn(release(self.client.clone(), engine, self.decode, request));
        }
    }
}

/// How long a release keeps trying: a decode engine frozen for minutes still gets its pages
/// back when it resumes, and nothing keeps trying forever.
const RELEASE_PATIENCE: Duration = Duration::from_secs(600);
const RELEASE_BACKOFF_MIN: Duration = Duration::from_millis(50);
const RELEASE_BACKOFF_MAX: Duration = Duration::from_secs(5);

/// Free D's reservation for `request.common.user`: try, and while the engine is busy with it
/// (a transfer still writing it), frozen or failing, try again with backoff, for at most
/// [`RELEASE_PATIENCE`]. An engine whose process is gone took its reservations with it.
async fn release(
    client: EngineClient,
    engine: Upstream,
    decode: EndpointId,
    request: StartGenerateRequest,
) {
    let user = request.common.user.clone().unwrap_or_default();
    let give_up = Instant::now() + RELEASE_PATIENCE;
    let mut backoff = RELEASE_BACKOFF_MIN;
    loop {
        match client.release(&engine, &request).await {
            Release::Freed => {
                tracing::debug!(request = %user, endpoint = decode, "KV reservation released");
                return;
            }
            Release::Gone(why) => {
                tracing::debug!(request = %user, endpoint = decode, %why, "KV reservation already gone");
                return;
            }
            Release::Later(why) if Instant::now() + backoff < give_up => {
                tracing::debug!(request = %user, endpoint = decode, %why, retry_in = ?backoff, "KV reservation not released yet");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(RELEASE_BACKOFF_MAX);
            }
            Release::Later(why) => {
                tracing::warn!(request = %user, endpoint = decode, %why, "gave up releasing a KV reservation; the engine must expire it");
                return;
            }
        }
    }
}
