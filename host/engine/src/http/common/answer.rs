//! Waiting on a generation and answering with it: its events gathered into one answer, and
//! the answers of the OpenAI routes in the shapes vLLM and SGLang give them.
//!
//! Completions carry `text`; a chat answer `choices[0].message`, a chat chunk
//! `choices[0].delta`; a stream ends with a usage-only chunk (`"choices": []`) when
//! `stream_options.include_usage`, then `data: [DONE]`. Usage always says how many prompt
//! tokens the prefix cache served (`prompt_tokens_details.cached_tokens`). With `return_token_ids` every choice
//! carries the generated ids it completes, which is what a router continues a broken stream
//! from.

use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::{Response, StatusCode};
use serde_json::{Map, Value, json};
use switchyard_wire::completion::FinishReason as WireFinish;
use tokio::sync::mpsc;

use super::error::HttpError;
use super::request::{OpenAiRequest, Shape};
use super::respond::{Body, json};
use super::sse::{self, Chunks};
use super::state::EngineState;
use crate::scheduler::{Event, FinishReason, Usage};

/// Generated tokens a choice completes: ids and their log-probabilities, in order.
#[derive(Debug, Default)]
pub(crate) struct Tokens {
    pub ids: Vec<u32>,
    pub logprobs: Vec<f32>,
}

impl Tokens {
    pub fn extend(&mut self, event: &Event) {
        self.ids.extend(&event.token_ids);
        self.logprobs.extend(&event.logprobs);
    }
}

/// A finished generation, gathered.
pub(crate) struct Collected {
    pub text: String,
    pub tokens: Tokens,
    pub finish: FinishReason,
    pub usage: Usage,
    /// The events as they came, for a prefill leg that answers only after its push (SGLang).
    pub events: Vec<Event>,
}

/// Waits for a whole generation. A preempted one answers with empty text, as MLC's does.
pub(crate) async fn collect(
    mut rx: mpsc::UnboundedReceiver<Event>,
) -> Result<Collected, HttpError> {
    let mut text = String::new();
    let mut tokens = Tokens::default();
    let mut events = Vec::new();
    while let Some(event) = rx.recv().await {
        text.push_str(&event.text);
        tokens.extend(&event);
        let finish = event.finish;
        events.push(event);
        if let Some((finish, usage)) = finish {
            if finish == FinishReason::Preempt {
                text.clear();
                tokens = Tokens::default();
            }
            return Ok(Collected {
                text,
                tokens,
                finish,
                usage,
                events,
            });
        }
    }
    tracing::error!("generation events ended without a finish");
    Err(HttpError::CoreGone)
}

/// Events already gathered, as a receiver again (a prefill leg replays its one token).
pub(crate) fn replay(events: Vec<Event>) -> mpsc::UnboundedReceiver<Event> {
    let (tx, rx) = mpsc::unbounded_channel();
    for event in events {
        let _ = tx.send(event);
    }
    rx
}

/// Identity of one answer: every chunk of a stream repeats it.
#[derive(Debug, Clone)]
pub(crate) struct Meta {
    pub id: String,
    pub created: u64,
    pub model: String,
    pub shape: Shape,
    pub token_ids: bool,
}

impl Meta {
    /// vLLM's ids: `cmpl-<X-Request-Id>` / `chatcmpl-<X-Request-Id>`, random without it.
    pub(crate) fn new(state: &EngineState, request: &OpenAiRequest) -> Meta {
        let base = request
            .request_id
            .clone()
            .unwrap_or_else(|| format!("{:032x}", rand::random::<u128>()));
        let prefix = match request.shape {
            Shape::Completion => "cmpl",
            Shape::Chat => "chatcmpl",
        };
        Meta {
            id: format!("{prefix}-{base}"),
            created: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            model: request
                .fields
                .model
                .clone()
                .unwrap_or_else(|| state.model_name.clone()),
            shape: request.shape,
            token_ids: request.fields.return_token_ids.unwrap_or(false),
        }
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.shape, chunk) {
            (Shape::Completion, _) => "text_completion",
            (Shape::Chat, false) => "chat.completion",
            (Shape::Chat, true) => "chat.completion.chunk",
        }
    }

    fn envelope(&self, chunk: bool, choices: Vec<Value>) -> Map<String, Value> {
        let mut body = Map::new();
        body.insert("id".into(), self.id.clone().into());
        body.insert("object".into(), self.object(chunk).into());
        body.insert("created".into(), self.created.into());
        body.insert("model".into(), self.model.clone().into());
        body.insert("choices".into(), Value::Array(choices));
        body
    }

    fn with_ids(&self, mut choice: Value, ids: &[u32]) -> Value {
        if self.token_ids {
            choice["token_ids"] = json!(ids);
        }
        choice
    }

    /// The one JSON answer; `extra` adds a top-level field (vLLM's `kv_transfer_params`).
    pub(crate) fn full(&self, done: &Collected, extra: Option<(&str, Value)>) -> Value {
        let finish = WireFinish::from(done.finish);
        let choice = match self.shape {
            Shape::Completion => json!({"index": 0, "text": done.text, "logprobs": null,
                "finish_reason": finish, "stop_reason": null}),
            Shape::Chat => json!({"index": 0,
                "message": {"role": "assistant", "content": done.text},
                "logprobs": null, "finish_reason": finish, "stop_reason": null}),
        };
        let mut body = self.envelope(false, vec![self.with_ids(choice, &done.tokens.ids)]);
        body.insert("usage".into(), usage_json(done.usage));
        if let Some((key, value)) = extra {
            body.insert(key.into(), value);
        }
        Value::Object(body)
    }

    /// One streamed chunk; the first chat chunk also says the role.
    fn chunk(&self, event: &Event, first: bool) -> Value {
        let finish = event.finish.map(|(f, _)| WireFinish::from(f));
        let choice = match self.shape {
            Shape::Completion => json!({"index": 0, "text": event.text, "logprobs": null,
                "finish_reason": finish}),
            Shape::Chat => {
                let delta = if first {
                    json!({"role": "assistant", "content": event.text})
                } else {
                    json!({"content": event.text})
                };
                json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish})
            }
        };
        Value::Object(self.envelope(true, vec![self.with_ids(choice, &event.token_ids)]))
    }

    fn usage_chunk(&self, usage: Usage) -> Value {
        let mut body = self.envelope(true, Vec::new());
        body.insert("usage".into(), usage_json(usage));
        Value::Object(body)
    }
}

/// vLLM's usage, with `prompt_tokens_details` always (vLLM writes it with
/// `--enable-prompt-tokens-details`): what a router compares its predicted prefix with.
fn usage_json(u: Usage) -> Value {
    json!({"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens}})
}

/// Answers `rx` as the request asked: SSE (`stream`, with a usage chunk if `include_usage`),
/// or one JSON with usage.
pub(crate) async fn respond(
    meta: Meta,
    stream: bool,
    include_usage: bool,
    rx: mpsc::UnboundedReceiver<Event>,
) -> Result<Response<Body>, HttpError> {
    if stream {
        Ok(sse::stream(meta, include_usage, rx))
    } else {
        let done = collect(rx).await?;
        Ok(json(StatusCode::OK, &meta.full(&done, None)))
    }
}

impl Chunks for Meta {
    fn event(&self, event: Event, first: bool) -> Bytes {
        switchyard_wire::sse::event(&self.chunk(&event, first))
    }

    fn usage(&self, usage: Usage) -> Bytes {
        switchyard_wire::sse::event(&self.usage_chunk(usage))
    }
}
