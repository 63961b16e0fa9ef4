//! Calls on the step loop as handlers make them, and what they hold while they wait: a whole
//! generation, a prefill leg's kept KV, a decode leg's reservation, and the push of leased KV
//! to another engine.

use std::sync::Arc;

use http::Response;
use switchyard_kv::{KvAddrInfo, KvTransport};
use tokio::sync::{mpsc, oneshot};

use super::answer::{Collected, Meta, collect, respond};
use super::error::HttpError;
use super::request::OpenAiRequest;
use super::respond::Body;
use super::state::EngineState;
use crate::latency::TimingModel;
use crate::scheduler::{Event, FinishReason, PrepRecvReply};
use crate::step_loop::{Command, SendLease};

/// Hands `cmd` to the step loop.
pub(crate) fn send(state: &EngineState, cmd: Command) -> Result<(), HttpError> {
    state.commands.send(cmd).map_err(|_| HttpError::CoreGone)
}

/// A request served by this engine alone (no handoff).
pub(crate) async fn serve_whole(
    state: &Arc<EngineState>,
    request: OpenAiRequest,
) -> Result<Response<Body>, HttpError> {
    let meta = Meta::new(state, &request);
    let (events, rx) = mpsc::unbounded_channel();
    let (stream, include_usage) = (request.stream, request.include_usage);
    send(
        state,
        Command::Generate {
            request: request.generation,
            events,
        },
    )?;
    respond(meta, stream, include_usage, rx).await
}

/// Runs the prompt with `max_tokens` 1 and keeps its KV: a prefill leg's work. Returns the
/// one-token answer and the lease on the prompt's slots (none when it was preempted).
pub(crate) async fn prefill_and_hold(
    state: &EngineState,
    request: &OpenAiRequest,
) -> Result<(Collected, Option<SendLease>), HttpError> {
    let mut generation = request.generation.clone();
    generation.max_tokens = 1;
    let (events, rx) = mpsc::unbounded_channel();
    let (hold, held) = oneshot::channel();
    send(
        state,
        Command::GenerateAndHold {
            request: generation,
            events,
            hold,
        },
    )?;
    let done = collect(rx).await?;
    // The lease is sent in the same step as the finish event; a preempted generation has none.
    let lease = match done.finish {
        FinishReason::Preempt => None,
        FinishReason::Length | FinishReason::Stop => held.await.ok(),
    };
    Ok((done, lease))
}

/// A decode leg's reservation of the prompt positions it will not compute: all but the last
/// (MLC's prep_recv with `end = -1`). Dropping it before [`Reserved::start`] hands the pages
/// back at once (through the expiry quarantine), so a cancelled or failed leg leaks nothing.
pub(crate) struct Reserved {
    cancel: CancelReservation,
    pub reply: PrepRecvReply,
    /// Positions `[reply.prefix_matched_length, end)` are the window P writes.
    pub end: usize,
}

/// Cancels `user`'s reservation when dropped while armed. Commands are handled in order, so a
/// cancel sent after the reservation's command never overtakes it, and one for a reservation
/// that never came to be (or was taken over by a generation) is ignored.
struct CancelReservation {
    state: Arc<EngineState>,
    user: String,
    armed: bool,
}

impl Drop for CancelReservation {
    fn drop(&mut self) {
        if self.armed {
            let user = std::mem::take(&mut self.user);
            let _ = self
                .state
                .commands
                .send(Command::CancelReservation { user });
        }
    }
}

impl Reserved {
    pub(crate) async fn new(
        state: &Arc<EngineState>,
        request: &OpenAiRequest,
    ) -> Result<Reserved, HttpError> {
        let user = format!("pd-{:032x}", rand::random::<u128>());
        let end = request.tokens.len() - 1;
        let (reply, answer) = oneshot::channel();
        // Armed before the command leaves: dropped anywhere from here (the leg's connection
        // closed), the reservation is cancelled, even one the core made and answered just as
        // the answer's reader went away.
        let cancel = CancelReservation {
            state: state.clone(),
            user: user.clone(),
            armed: true,
        };
        send(
            state,
            Command::PrepRecv {
                user,
                request: request.generation.clone(),
                end,
                reply,
            },
        )?;
        let reply = answer.await.map_err(|_| HttpError::CoreGone)??;
        Ok(Reserved { cancel, reply, end })
    }

    /// Where P must write: the encoded slots of the window.
    pub(crate) fn kv_addr_info(&self) -> String {
        self.reply.kv_addr_info.encode()
    }

    pub(crate) fn begin(&self) -> usize {
        self.reply.prefix_matched_length
    }

    /// Generates from the reservation once the KV is in: the last prompt token is computed
    /// here, as a single engine would, so the output matches only if the KV moved right.
    pub(crate) async fn start(mut self) -> Result<mpsc::UnboundedReceiver<Event>, HttpError> {
        let (events, rx) = mpsc::unbounded_channel();
        let (reply, answer) = oneshot::channel();
        send(
            &self.cancel.state,
            Command::StartGenerate {
                user: self.cancel.user.clone(),
                begin: self.end,
                events,
                reply,
            },
        )?;
        let started = answer.await.map_err(|_| HttpError::CoreGone)?;
        if started.is_ok() {
            // The generation owns the pages now (and frees them when its events go unread).
            self.cancel.armed = false;
        }
        started?;
        Ok(rx)
    }
}

/// Pushes the leased slots `window` (indices into `lease.slots`) into `rank`'s pool, then waits
/// out the simulated transfer cost; the lease (P's pages) is released when this returns.
pub(crate) async fn push_kv(
    transport: Arc<KvTransport>,
    timing: Arc<dyn TimingModel>,
    lease: SendLease,
    window: std::ops::Range<usize>,
    rank: u32,
    info: KvAddrInfo,
) -> Result<(), HttpError> {
    let slots = lease.slots.get(window).unwrap_or_default();
    let stats = transport
        .send(rank, slots, &info)
        .await
        .map_err(|source| HttpError::Transfer { rank, source })?;
    let cost = timing.transfer(stats.bytes as usize);
    if !cost.is_zero() {
        tokio::time::sleep(cost.saturating_sub(stats.elapsed)).await;
    }
    Ok(())
}
