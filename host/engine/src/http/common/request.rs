//! Reading requests: bodies as their route's wire type, prompts as token ids checked against the
//! vocabulary and the pool, positions as the specs resolve them, and the OpenAI completion and
//! chat bodies the vLLM and SGLang modes serve.

use http::Request;
use http_body_util::{BodyExt as _, Limited};
use hyper::body::Incoming;
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Map, Value};
use switchyard_wire::completion::{Prompt, Stop, StreamOptions};
use switchyard_wire::tokenizer::ChatMessage;

use super::error::{HttpError, invalid};
use super::state::EngineState;
use crate::model::Sampling;
use crate::scheduler::GenRequest;

/// Bodies above this are refused: a 2000-token prompt with every field is a few KiB, and a
/// 128k-token one as JSON ids well under 2 MiB.
const MAX_BODY_BYTES: usize = 16 << 20;

/// OpenAI's default `max_tokens` for completions.
pub(crate) const DEFAULT_MAX_TOKENS: usize = 16;

/// The body of a call, as the wire type of its route.
pub(crate) async fn read_request<T: DeserializeOwned>(
    req: Request<Incoming>,
) -> Result<T, HttpError> {
    let bytes = Limited::new(req.into_body(), MAX_BODY_BYTES)
        .collect()
        .await
        .map_err(|e| HttpError::Invalid {
            message: format!("cannot read the request body: {e}"),
            param: None,
        })?
        .to_bytes();
    serde_json::from_slice(&bytes).map_err(|e| HttpError::Invalid {
        message: format!("invalid request body: {e}"),
        param: None,
    })
}

pub(crate) fn prompt_tokens(state: &EngineState, prompt: &Prompt) -> Result<Vec<u32>, HttpError> {
    let tokens = match prompt {
        Prompt::Text(text) => state
            .tokenizer
            .encode(text.as_str(), false)
            .map_err(|e| invalid("prompt", format!("cannot tokenize the prompt: {e}")))?
            .get_ids()
            .to_vec(),
        Prompt::Tokens(ids) if ids.iter().all(|&t| t < state.vocab_size) => ids.clone(),
        Prompt::Tokens(_) => {
            return Err(invalid(
                "prompt",
                format!("token ids must be in 0..{}", state.vocab_size),
            ));
        }
    };
    if tokens.is_empty() {
        return Err(invalid("prompt", "the prompt is empty"));
    }
    Ok(tokens)
}

/// The request's `end`, resolved and checked: `0 <= end < len` (spec: prep_recv and remote_send).
pub(crate) fn resolve_end(end: i64, len: usize) -> Result<usize, HttpError> {
    resolve_position(end, len)
        .filter(|&e| e < len)
        .ok_or_else(|| {
            invalid(
                "end",
                format!("end {end} is out of range for a prompt of {len} tokens"),
            )
        })
}

/// Python-style position: negative counts from the end.
fn resolve_position(pos: i64, len: usize) -> Option<usize> {
    let len = i64::try_from(len).ok()?;
    let resolved = if pos < 0 { len + pos } else { pos };
    usize::try_from(resolved).ok()
}

/// Refuses work that could never get its pages, instead of letting it wait forever.
pub(crate) fn check_fits(
    state: &EngineState,
    positions: usize,
    param: &'static str,
) -> Result<(), HttpError> {
    let pages = positions.div_ceil(state.page_size);
    if pages > state.num_pages as usize {
        return Err(invalid(
            param,
            format!(
                "{positions} positions need {pages} KV pages; this engine has {}",
                state.num_pages
            ),
        ));
    }
    Ok(())
}

// === the OpenAI bodies of the vLLM and SGLang modes ===

/// Which OpenAI route a request came in on: it decides the prompt field and the answer's shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Shape {
    Completion,
    Chat,
}

/// `X-Request-Id`: vLLM builds the response id from it, and the P/D checks need it.
pub(crate) fn request_id(req: &Request<Incoming>) -> Option<String> {
    req.headers()
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty())
        .map(str::to_owned)
}

/// A request as it arrived, before the protocol decides what it is.
pub(crate) struct Arrived {
    pub shape: Shape,
    /// The body as sent: SGLang compares P's and D's; unknown fields are kept (and ignored).
    pub raw: Map<String, Value>,
    pub fields: Fields,
    /// `X-Request-Id`: vLLM builds the response id from it, and its P/D checks need it.
    pub request_id: Option<String>,
}

impl Arrived {
    /// A `shape` request whose JSON body is `body`.
    pub(crate) fn new(
        shape: Shape,
        request_id: Option<String>,
        body: Value,
    ) -> Result<Arrived, HttpError> {
        let Value::Object(raw) = body else {
            return Err(invalid("body", "the request body must be a JSON object"));
        };
        let fields: Fields =
            serde_json::from_value(Value::Object(raw.clone())).map_err(|e| HttpError::Invalid {
                message: format!("invalid request body: {e}"),
                param: None,
            })?;
        Ok(Arrived {
            shape,
            raw,
            fields,
            request_id,
        })
    }
}

/// The fields of a completion or chat body the engine reads; every other one is ignored.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct Fields {
    pub model: Option<String>,
    pub prompt: Option<Prompt>,
    pub messages: Option<Value>,
    pub max_tokens: Option<u32>,
    pub max_completion_tokens: Option<u32>,
    pub min_tokens: Option<u32>,
    pub n: Option<u32>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub seed: Option<i64>,
    pub stop: Option<Stop>,
    pub return_token_ids: Option<bool>,
    /// vLLM's handoff stanza: `do_remote_decode` on P, P's answer on D.
    pub kv_transfer_params: Option<Value>,
    /// SGLang's rendezvous, the same on both legs.
    pub bootstrap_host: Option<Value>,
    pub bootstrap_port: Option<Value>,
    pub bootstrap_room: Option<Value>,
}

/// A request ready to run: its prompt in tokens and what to generate.
pub(crate) struct OpenAiRequest {
    pub shape: Shape,
    pub fields: Fields,
    pub request_id: Option<String>,
    pub tokens: Vec<u32>,
    /// What the client asked for (`max_tokens` as the client set it).
    pub generation: GenRequest,
    pub stream: bool,
    pub include_usage: bool,
}

/// Checks a body as vLLM does and tokenizes its prompt (chat: rendered with the template).
pub(crate) fn parse(state: &EngineState, incoming: Arrived) -> Result<OpenAiRequest, HttpError> {
    let Arrived {
        shape,
        raw: _,
        fields: f,
        request_id,
    } = incoming;
    if f.n.is_some_and(|n| n != 1) {
        return Err(invalid("n", "only n = 1 is supported"));
    }
    let stream = f.stream.unwrap_or(false);
    if f.stream_options.is_some() && !stream {
        // vLLM's check, word for word.
        return Err(invalid(
            "stream_options",
            "Stream options can only be defined when `stream=True`.",
        ));
    }
    let tokens = match shape {
        Shape::Completion => {
            let prompt = f
                .prompt
                .as_ref()
                .ok_or_else(|| invalid("prompt", "a completion needs a prompt"))?;
            prompt_tokens(state, prompt)?
        }
        Shape::Chat => {
            let messages = f
                .messages
                .as_ref()
                .ok_or_else(|| invalid("messages", "a chat completion needs messages"))?;
            let text = state
                .prompts
                .render_chat(&chat_messages(messages)?)
                .map_err(|e| invalid("messages", format!("cannot render the chat: {e}")))?;
            prompt_tokens(state, &Prompt::Text(text))?
        }
    };
    // Chat prefers max_completion_tokens, as vLLM does.
    let (limit, param) = match shape {
        Shape::Chat if f.max_completion_tokens.is_some() => {
            (f.max_completion_tokens, "max_completion_tokens")
        }
        _ => (f.max_tokens, "max_tokens"),
    };
    let max_tokens = match limit {
        None => DEFAULT_MAX_TOKENS,
        Some(0) => return Err(invalid(param, format!("{param} must be positive"))),
        Some(m) => m as usize,
    };
    if f.min_tokens.is_some_and(|m| m as usize > max_tokens) {
        return Err(invalid(
            "min_tokens",
            "min_tokens must be less than or equal to max_tokens",
        ));
    }
    let temperature = f.temperature.unwrap_or(0.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(invalid("temperature", "temperature must be in [0, 2]"));
    }
    let top_p = f.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(invalid("top_p", "top_p must be in (0, 1]"));
    }
    check_fits(state, tokens.len() + 1, "prompt")?;
    let generation = GenRequest {
        tokens: tokens.clone(),
        sampling: Sampling {
            temperature,
            top_p,
            // Unseeded sampling is seeded with 0: a direct and a disaggregated request agree.
            seed: f.seed.unwrap_or(0) as u64,
        },
        max_tokens,
        stop: f.stop.clone().map(Stop::into_vec).unwrap_or_default(),
        // The OpenAI routes do not serve logprobs.
        logprobs: false,
    };
    Ok(OpenAiRequest {
        shape,
        request_id,
        tokens,
        generation,
        stream,
        include_usage: f.stream_options.is_some_and(|o| o.include_usage),
        fields: f,
    })
}

/// `messages` flattened as the router flattens them, so both render the same prompt.
fn chat_messages(messages: &Value) -> Result<Vec<ChatMessage>, HttpError> {
    ChatMessage::read_all(messages).map_err(|reason| invalid("messages", reason))
}

/// A digest of the body apart from the top-level fields `skip` (those the protocol lets the
/// legs differ in): FNV-1a over its canonical JSON (keys sorted at every level), so the legs'
/// key order and whitespace do not matter. How an engine checks that a router sent both legs
/// the client's body.
pub(crate) fn body_digest(raw: &Map<String, Value>, skip: &[&str]) -> String {
    let mut body = raw.clone();
    for field in skip {
        body.remove(*field);
    }
    let mut text = String::new();
    canonical(&Value::Object(body), &mut text);
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in text.bytes() {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{hash:016x}")
}

fn canonical(value: &Value, out: &mut String) {
    match value {
        Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            out.push('{');
            for (i, key) in keys.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&Value::String(key.clone()).to_string());
                out.push(':');
                canonical(&map[key], out);
            }
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                canonical(item, out);
            }
            out.push(']');
        }
        other => out.push_str(&other.to_string()),
    }
}
