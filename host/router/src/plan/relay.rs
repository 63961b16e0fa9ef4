//! Relays a generation to the client chunk by chunk and keeps count of what was delivered, so
//! a preempted or broken generation can be continued exactly where the client's copy ends.

use futures::StreamExt;
use tokio::sync::mpsc;
use tokio::time::Instant;

use switchyard_wire::completion::{FinishReason, Usage};
use switchyard_wire::sse::SseError;

use super::execute::{ExecError, Generation, StepKind};
use crate::RouteError;
use crate::Summary;
use crate::engine_client::CallError;

/// What the client side of a request receives, in order: text deltas, then exactly one
/// `Done` or `Failed`.
#[derive(Debug)]
pub enum Event {
    /// New text for the client.
    Text(String),
    /// The response is complete.
    Done {
        finish_reason: FinishReason,
        usage: Usage,
        summary: Summary,
    },
    /// The router gave up; whatever text was sent stays sent.
    Failed { error: RouteError, summary: Summary },
}

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
    /// The engine aborted the request to free KV ([`FinishReason::Preempt`]).
    Preempted,
    /// The stream broke or went quiet.
    Failed(ExecError),
    /// The client went away: stop everything.
    ClientGone,
}

/// Forward `generation`'s text to `sink` until it ends.
pub async fn relay(
    generation: &mut Generation,
    sink: &mpsc::Sender<Event>,
    attempt: u32,
    delivered: &mut Delivered,
) -> RelayEnd {
    let mut finish_reason: Option<FinishReason> = None;
    let mut usage = None;
    while let Some(item) = generation.chunks.next().await {
        let chunk = match item {
            Ok(chunk) => chunk,
            // The engine said it finished; a broken tail (e.g. a lost [DONE]) loses nothing.
            Err(_) if finish_reason.is_some() => break,
            Err(source) => {
                return RelayEnd::Failed(ExecError {
                    endpoint: generation.generator,
                    step: StepKind::Relay,
                    attempt,
                    source: CallError::Stream(source),
                });
            }
        };
        if let Some(u) = chunk.usage {
            usage = Some(u.counts);
        }
        let Some(choice) = chunk.choices.into_iter().next() else {
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
            if sink.send(Event::Text(choice.text)).await.is_err() {
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
        None => RelayEnd::Failed(ExecError {
            endpoint: generation.generator,
            step: StepKind::Relay,
            attempt,
            source: CallError::Stream(SseError::Transport(
                "the stream ended without a finish_reason".into(),
            )),
        }),
    }
}
