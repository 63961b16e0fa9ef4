//! Relays a generation to the client chunk by chunk and keeps count of what was delivered, so
//! a preempted or broken generation can be continued exactly where the client's copy ends.
//!
//! The relay knows nothing of the client's side: text goes out through a [`TextSink`] the
//! caller provides, and how the generation ended comes back as a [`RelayEnd`], for the caller
//! to act on (finish, continue, retry or stop).

use futures::StreamExt;
use tokio::time::Instant;

use switchyard_wire::completion::{EngineChunk, FinishReason, Usage};
use switchyard_wire::sse::SseError;

use super::attempt::Generation;
use super::error::{Cause, ExecError, StepKind};
use crate::engine_client::CallError;

/// Where the relay sends the client's text.
pub trait TextSink {
    /// Hand `text` to the client; `Err` once the client is gone.
    fn text(&self, text: String) -> impl Future<Output = Result<(), ClientGone>> + Send;
}

/// The client went away: nobody reads the text any more.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientGone;

/// What the client has received so far, over every attempt.
#[derive(Debug)]
pub struct Delivered {
    pub text: String,
    /// The ids the engines generated for `text`, while every chunk with text carried its ids
    /// (engines that honour `return_token_ids`, as the reference engine and vLLM do); `None`
    /// from the first chunk that did not. A continuation starts from these exact ids: text
    /// re-tokenized with a BPE tokenizer may give other ids, and another count.
    pub token_ids: Option<Vec<u32>>,
    /// How many tokens the engines generated for `text`, counted from their chunks (ids, or
    /// `logprobs` entries from engines that ignore `return_token_ids`, as MLC's do), while
    /// every chunk with text said; `None` from the first that did not. Where the ids are
    /// unknown, a continuation re-tokenizes `text` (other ids, maybe another count, with a
    /// BPE tokenizer), but still stops at `max_tokens` and reports a usage counting exactly
    /// what the engines generated.
    pub generated: Option<u32>,
    /// When the first text reached the client's channel.
    pub first_at: Option<Instant>,
}

impl Default for Delivered {
    fn default() -> Self {
        Delivered {
            text: String::new(),
            token_ids: Some(Vec::new()),
            generated: Some(0),
            first_at: None,
        }
    }
}

/// How one attempt's generation ended.
#[derive(Debug)]
pub enum RelayEnd {
    /// The engine finished; `usage` is the engine's own count for this attempt, if it sent one.
    Finished {
        finish_reason: FinishReason,
        usage: Option<Usage>,
    },
    /// The engine aborted the request to free KV ([`FinishReason::Preempt`]); what it
    /// delivered before is in [`Delivered`].
    Preempted,
    /// The stream broke, went quiet or ended unfinished, or the generation's partner leg
    /// failed (blamed on the partner).
    Failed(ExecError),
    /// The client went away: stop everything.
    ClientGone,
}

/// Forward `generation`'s text to `sink` until it ends.
pub async fn relay(
    generation: &mut Generation,
    sink: &impl TextSink,
    attempt: u32,
    delivered: &mut Delivered,
) -> RelayEnd {
    let mut finish_reason: Option<FinishReason> = None;
    let mut usage = None;
    while let Some(item) = next_chunk(generation, attempt).await {
        let chunk = match item {
            Ok(chunk) => chunk,
            // The engine said it finished; a broken tail (e.g. a lost [DONE], or a partner
            // failing after the last token) loses nothing.
            Err(_) if finish_reason.is_some() => break,
            Err(error) => return RelayEnd::Failed(error),
        };
        // Whatever the engine sends first comes after the prompt's prefill.
        generation.started();
        if chunk.usage.is_some() {
            usage = chunk.usage;
        }
        let Some(choice) = chunk.choice else {
            continue;
        };
        if choice.finish_reason == Some(FinishReason::Preempt) {
            return RelayEnd::Preempted;
        }
        match (&mut delivered.generated, choice.generated()) {
            (Some(n), Some(new)) => *n = n.saturating_add(u32::try_from(new).unwrap_or(u32::MAX)),
            (Some(_), None) if !choice.text.is_empty() => delivered.generated = None,
            _ => {}
        }
        match (&mut delivered.token_ids, choice.token_ids) {
            (Some(ids), Some(new)) => ids.extend(new),
            (Some(_), None) if !choice.text.is_empty() => delivered.token_ids = None,
            _ => {}
        }
        if !choice.text.is_empty() {
            delivered.text.push_str(&choice.text);
            delivered.first_at.get_or_insert_with(Instant::now);
            if sink.text(choice.text).await.is_err() {
                return RelayEnd::ClientGone;
            }
        }
        if let Some(reason) = choice.finish_reason {
            finish_reason = Some(reason);
        }
    }
    match finish_reason {
        Some(finish_reason) => RelayEnd::Finished {
            finish_reason,
            usage,
        },
        None => RelayEnd::Failed(ExecError::new(
            Cause::Unfinished,
            generation.generator,
            StepKind::Relay,
            attempt,
        )),
    }
}

/// The generator's next chunk, its failure classified: its own stream's, or its partner's if
/// the partner fails first. When the generator's stream ends, the partner is left to finish on
/// its own.
async fn next_chunk(
    generation: &mut Generation,
    attempt: u32,
) -> Option<Result<EngineChunk, ExecError>> {
    let generator = generation.generator;
    let broken =
        |e: SseError| ExecError::new(CallError::Stream(e), generator, StepKind::Relay, attempt);
    loop {
        let Some(partner) = generation.partner.as_mut() else {
            let item = generation.chunks.next().await?;
            return Some(item.map_err(broken));
        };
        let (endpoint, step) = (partner.endpoint, partner.step);
        // The generator's chunks first: text that is ready reaches the client before a
        // partner's failure ends the stream.
        tokio::select! {
            biased;
            item = generation.chunks.next() => match item {
                Some(item) => return Some(item.map_err(broken)),
                None => {
                    if let Some(partner) = generation.partner.take() {
                        partner.detach();
                    }
                    return None;
                }
            },
            answer = &mut partner.answer => {
                generation.partner = None;
                if let Err(e) = answer {
                    return Some(Err(ExecError::new(e, endpoint, step, attempt)));
                }
            }
        }
    }
}
