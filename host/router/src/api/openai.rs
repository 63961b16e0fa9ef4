//! `/v1/completions` and `/v1/chat/completions`: request parsing and validation, and the
//! response and chunk shapes of both APIs.
//!
//! Every limit is checked here, before any engine sees the request: token ids inside the
//! vocabulary, `max_tokens` at least 1 (never clamped), the prompt within
//! `max_prompt_tokens`, prompt and completion within the model's context. A body's fields are
//! read as raw JSON first, so a prompt of token ids is parsed straight into `Vec<u32>` (no
//! `serde_json::Value` per id).
//!
//! A text prompt is tokenized here only when the limits need its length: when its bytes bound
//! its tokens (see [`super::tokenize::tokens_at_most`]) and that bound fits, it is left to be
//! tokenized when something reads it, if anything does ([`RoutePrompt`]).

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;

use serde::Serialize;
use serde_json::value::RawValue;
use serde_json::{Map, Value};

use super::respond::ApiError;
use super::tokenize::{ChatMessage, PromptTokenizer, tokens_at_most};
use crate::router::{RoutePrompt, tokenize};
use switchyard_wire::completion::{CompletionRequest, Stop, StreamOptions, Usage};
use switchyard_wire::sse;

/// Which OpenAI API a request came in on; it decides the response shapes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    Completion,
    Chat,
}

impl Shape {
    /// The GenAI semantic conventions' `gen_ai.operation.name`, for the request's trace span.
    pub fn operation(self) -> &'static str {
        match self {
            Shape::Completion => "text_completion",
            Shape::Chat => "chat",
        }
    }

    /// What a response's id starts with, before its random digits.
    pub fn id_prefix(self) -> &'static str {
        match self {
            Shape::Completion => "cmpl-",
            Shape::Chat => "chatcmpl-",
        }
    }

    /// The route as the engines' wire types name it.
    pub fn wire_route(self) -> switchyard_wire::client::Route {
        match self {
            Shape::Completion => switchyard_wire::client::Route::Completions,
            Shape::Chat => switchyard_wire::client::Route::Chat,
        }
    }

    pub fn route(self) -> &'static str {
        match self {
            Shape::Completion => "/v1/completions",
            Shape::Chat => "/v1/chat/completions",
        }
    }
}

/// A validated client request.
#[derive(Debug, Clone)]
pub struct ParsedRequest {
    /// Its prompt: ids, or text not tokenized yet when the limits did not need its length.
    pub prompt: RoutePrompt,
    pub max_tokens: u32,
    pub stream: bool,
    pub include_usage: bool,
    /// The model to report: the client's, or the served one.
    pub model: String,
    pub user: Option<String>,
    /// Sampling fields for the engines (prompt, max_tokens and user are set per attempt).
    pub template: CompletionRequest,
}

/// Defaults a request does not carry itself, and the limits it must keep.
#[derive(Debug, Clone, Copy)]
pub struct Defaults<'a> {
    pub model: &'a str,
    /// `max_tokens` when the request gives none (less when the context leaves less room).
    pub max_tokens: u32,
    /// Prompt plus completion tokens the model can hold.
    pub context_length: u32,
    /// The longest prompt accepted, in tokens.
    pub max_prompt_tokens: u32,
}

/// Parse a `/v1/completions` body.
pub fn parse_completion(
    body: &[u8],
    tokenizer: &Arc<PromptTokenizer>,
    defaults: Defaults<'_>,
) -> Result<ParsedRequest, ApiError> {
    let object = BodyObject::read(body, Shape::Completion)?;
    completion(body, &object, tokenizer, defaults)
}

/// Parse a `shape` request whose `body` was read as `object` already ([`BodyObject::read`]).
pub fn parse_read(
    shape: Shape,
    body: &[u8],
    object: &BodyObject,
    tokenizer: &Arc<PromptTokenizer>,
    defaults: Defaults<'_>,
) -> Result<ParsedRequest, ApiError> {
    match shape {
        Shape::Completion => completion(body, object, tokenizer, defaults),
        Shape::Chat => chat(body, object, tokenizer, defaults),
    }
}

fn completion(
    body: &[u8],
    object: &BodyObject,
    tokenizer: &Arc<PromptTokenizer>,
    defaults: Defaults<'_>,
) -> Result<ParsedRequest, ApiError> {
    let prompt = match object.big(body)? {
        None => return Err(ApiError::invalid("prompt", "prompt is required")),
        Some(json) => prompt_input(json)?,
    };
    let obj = object.fields();
    if get_bool(obj, "echo")?.unwrap_or(false) {
        return Err(ApiError::invalid("echo", "echo is not supported"));
    }
    if !matches!(obj.get("suffix"), None | Some(Value::Null)) {
        return Err(ApiError::invalid("suffix", "suffix is not supported"));
    }
    let max_tokens = get_max_tokens(obj, "max_tokens")?;
    let measure = Measure {
        param: "prompt",
        empty: "prompt must not be empty",
        tokenizer,
        limits: defaults,
    };
    common(obj, measure.prompt(prompt, max_tokens)?, defaults)
}

fn chat(
    body: &[u8],
    object: &BodyObject,
    tokenizer: &Arc<PromptTokenizer>,
    defaults: Defaults<'_>,
) -> Result<ParsedRequest, ApiError> {
    let messages = match object.big(body)? {
        Some(json) => serde_json::from_str::<Value>(json)
            .map_err(|e| ApiError::MalformedJson(e.to_string()))?,
        None => Value::Null,
    };
    let messages = chat_messages(&messages)?;
    let text = tokenizer.render_chat(&messages).map_err(|e| {
        ApiError::invalid("messages", format!("cannot render the chat template: {e}"))
    })?;
    let obj = object.fields();
    let max_tokens = match get_max_tokens(obj, "max_completion_tokens")? {
        Some(n) => Some(n),
        None => get_max_tokens(obj, "max_tokens")?,
    };
    let measure = Measure {
        param: "messages",
        empty: "the rendered prompt is empty",
        tokenizer,
        limits: defaults,
    };
    common(
        obj,
        measure.prompt(PromptInput::Text(text), max_tokens)?,
        defaults,
    )
}

/// A prompt as the client sent it: token ids, or text (a completion's, a chat's rendering).
enum PromptInput {
    Ids(Vec<u32>),
    Text(String),
}

/// How a prompt is checked against the limits, and what a client's mistake in it is called.
struct Measure<'a> {
    /// The body field the prompt came from.
    param: &'static str,
    /// The error message for an empty prompt.
    empty: &'static str,
    tokenizer: &'a Arc<PromptTokenizer>,
    limits: Defaults<'a>,
}

impl Measure<'_> {
    /// The prompt and the request's `max_tokens` (or the default), after checking both against
    /// the limits: a text prompt is tokenized only when its bound might not fit.
    fn prompt(
        &self,
        input: PromptInput,
        max_tokens: Option<u32>,
    ) -> Result<(RoutePrompt, u32), ApiError> {
        let ids = match input {
            PromptInput::Text(text) if text.is_empty() => {
                return Err(ApiError::invalid(self.param, self.empty));
            }
            PromptInput::Text(text) => {
                if let Some(max_tokens) = self.fits_unmeasured(&text, max_tokens) {
                    let tokenizer = Arc::clone(self.tokenizer);
                    return Ok((RoutePrompt::from_text(text, tokenizer), max_tokens));
                }
                tokenize(self.tokenizer, &text).map_err(ApiError::Tokenize)?
            }
            PromptInput::Ids(ids) => ids,
        };
        if ids.is_empty() {
            return Err(ApiError::invalid(self.param, self.empty));
        }
        check_vocabulary(&ids, self.tokenizer.vocab_size())?;
        let max_tokens = check_length(ids.len(), max_tokens, self.param, self.limits)?;
        Ok((RoutePrompt::from_ids(ids), max_tokens))
    }

    /// The `max_tokens` [`check_length`] would accept `text` with, when the most tokens `text`
    /// can have passes every check: then its exact count cannot fail them, nor change the
    /// default `max_tokens` (the context leaves at least the default after the bound).
    fn fits_unmeasured(&self, text: &str, max_tokens: Option<u32>) -> Option<u32> {
        let bound = tokens_at_most(self.tokenizer, text)?;
        let limits = self.limits;
        let max_tokens = max_tokens.unwrap_or(limits.max_tokens);
        let fits = bound <= u64::from(limits.max_prompt_tokens)
            && bound + u64::from(max_tokens) <= u64::from(limits.context_length);
        fits.then_some(max_tokens)
    }
}

/// A request body read as a JSON object, once: its big field (the prompt, the messages) kept
/// as where its raw JSON lies in the body, parsed only by what reads it, and every other field
/// as a value. Admission reads the small fields before the request has a place
/// (`admission::Claim`); the parse reads the rest once it has one, without reading the body
/// again.
#[derive(Debug)]
pub struct BodyObject {
    big: Option<Range<usize>>,
    fields: Map<String, Value>,
}

impl BodyObject {
    /// `body` read as the object of a `shape` request.
    pub fn read(body: &[u8], shape: Shape) -> Result<BodyObject, ApiError> {
        let big = match shape {
            Shape::Completion => "prompt",
            Shape::Chat => "messages",
        };
        let read: BTreeMap<String, &RawValue> = match serde_json::from_slice(body) {
            Ok(read) => read,
            // Valid JSON that is no object is the client's shape mistake, not a syntax error.
            Err(e) if e.is_data() => {
                return Err(ApiError::invalid(
                    "body",
                    "the request body must be a JSON object",
                ));
            }
            Err(e) => return Err(ApiError::MalformedJson(e.to_string())),
        };
        let mut object = BodyObject {
            big: None,
            fields: Map::new(),
        };
        for (name, raw) in read {
            if name == big {
                // The raw value borrows from `body`: its place there, to find it again.
                let start = raw.get().as_ptr().addr() - body.as_ptr().addr();
                object.big = (raw.get() != "null").then(|| start..start + raw.get().len());
                continue;
            }
            let value = serde_json::from_str(raw.get())
                .map_err(|e| ApiError::MalformedJson(e.to_string()))?;
            object.fields.insert(name, value);
        }
        Ok(object)
    }

    /// Every field but the big one.
    pub fn fields(&self) -> &Map<String, Value> {
        &self.fields
    }

    /// The big field's raw JSON in `body`, the body this was read from; `None` when it is
    /// absent or null.
    fn big<'a>(&self, body: &'a [u8]) -> Result<Option<&'a str>, ApiError> {
        let Some(range) = self.big.clone() else {
            return Ok(None);
        };
        body.get(range)
            .and_then(|json| std::str::from_utf8(json).ok())
            .map(Some)
            .ok_or_else(|| ApiError::MalformedJson("the body is not the one read".to_owned()))
    }
}

/// The fields both APIs share, beside the measured prompt and its `max_tokens`.
fn common(
    obj: &Map<String, Value>,
    (prompt, max_tokens): (RoutePrompt, u32),
    defaults: Defaults<'_>,
) -> Result<ParsedRequest, ApiError> {
    let model = get_str(obj, "model")?.unwrap_or(defaults.model).to_owned();
    let stream = get_bool(obj, "stream")?.unwrap_or(false);
    let include_usage = match obj.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(Value::Object(o)) => get_bool(o, "include_usage")?.unwrap_or(false),
        Some(_) => {
            return Err(ApiError::invalid(
                "stream_options",
                "stream_options must be an object",
            ));
        }
    };
    match obj.get("n") {
        None | Some(Value::Null) => {}
        Some(n) if n.as_u64() == Some(1) => {}
        Some(_) => return Err(ApiError::invalid("n", "only n = 1 is supported")),
    }
    let user = get_str(obj, "user")?.map(str::to_owned);
    let mut template = CompletionRequest::new(Vec::new(), 0, String::new());
    template.model = Some(model.clone());
    template.stream = true;
    template.stream_options = Some(StreamOptions {
        include_usage: true,
    });
    template.temperature = get_f64(obj, "temperature")?;
    template.top_p = get_f64(obj, "top_p")?;
    template.seed = get_i64(obj, "seed")?;
    template.frequency_penalty = get_f64(obj, "frequency_penalty")?.unwrap_or(0.0);
    template.presence_penalty = get_f64(obj, "presence_penalty")?.unwrap_or(0.0);
    template.stop = match obj.get("stop") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(Stop::One(s.clone())),
        Some(Value::Array(a)) if a.iter().all(Value::is_string) => Some(Stop::Many(
            a.iter()
                .filter_map(|s| s.as_str().map(str::to_owned))
                .collect(),
        )),
        Some(_) => {
            return Err(ApiError::invalid(
                "stop",
                "stop must be a string or a list of strings",
            ));
        }
    };
    template.logit_bias = match obj.get("logit_bias") {
        None | Some(Value::Null) => None,
        Some(o @ Value::Object(_)) => Some(o.clone()),
        Some(_) => {
            return Err(ApiError::invalid(
                "logit_bias",
                "logit_bias must be an object",
            ));
        }
    };
    template.response_format = match obj.get("response_format") {
        None | Some(Value::Null) => None,
        Some(o @ Value::Object(_)) => Some(o.clone()),
        Some(_) => {
            return Err(ApiError::invalid(
                "response_format",
                "response_format must be an object",
            ));
        }
    };
    Ok(ParsedRequest {
        prompt,
        max_tokens,
        stream,
        include_usage,
        model,
        user,
        template,
    })
}

/// Every id inside the vocabulary: an engine indexes its embeddings with them.
fn check_vocabulary(prompt: &[u32], vocab_size: u32) -> Result<(), ApiError> {
    match prompt.iter().find(|&&id| id >= vocab_size) {
        Some(id) => Err(ApiError::invalid(
            "prompt",
            format!("token id {id} is out of range: the vocabulary has {vocab_size} tokens"),
        )),
        None => Ok(()),
    }
}

/// The request's `max_tokens` (or the default, within what the context leaves), after checking
/// that the prompt and the completion fit: refused, never clamped.
fn check_length(
    prompt_len: usize,
    max_tokens: Option<u32>,
    prompt_param: &'static str,
    limits: Defaults<'_>,
) -> Result<u32, ApiError> {
    let context = u64::from(limits.context_length);
    let prompt_len = prompt_len as u64;
    if prompt_len > u64::from(limits.max_prompt_tokens) {
        return Err(ApiError::invalid(
            prompt_param,
            format!(
                "the prompt has {prompt_len} tokens, more than the {} this router accepts",
                limits.max_prompt_tokens
            ),
        ));
    }
    let room = context.saturating_sub(prompt_len);
    let max_tokens = match max_tokens {
        Some(n) => u64::from(n),
        None if room == 0 => 1,
        None => u64::from(limits.max_tokens).min(room),
    };
    if prompt_len + max_tokens > context {
        // OpenAI's words, so clients that parse them keep working.
        return Err(ApiError::invalid(
            prompt_param,
            format!(
                "This model's maximum context length is {context} tokens. However, you \
                 requested {} tokens ({prompt_len} in the {prompt_param}, {max_tokens} in the \
                 completion). Please reduce the length of the {prompt_param} or completion.",
                prompt_len + max_tokens
            ),
        ));
    }
    // Fits in the context, which is a u32.
    Ok(max_tokens as u32)
}

/// A string, a list of token ids, or a one-element list of either, parsed from raw JSON: ids
/// go straight into a `Vec<u32>`.
fn prompt_input(json: &str) -> Result<PromptInput, ApiError> {
    // A batch of one prompt (as the OpenAI client sends `[[1, 2, 3]]`). One level only:
    // however deep the client nests, nothing here recurses. (A text prompt, the common case,
    // is not tried as a list: a failed parse builds an error message.)
    let batch_of_one = if json.starts_with('[') {
        serde_json::from_str::<[&RawValue; 1]>(json).ok()
    } else {
        None
    };
    match batch_of_one {
        Some([one]) if one.get().starts_with(['"', '[']) => one_prompt(one.get()),
        _ => one_prompt(json),
    }
}

/// A string or a list of token ids.
fn one_prompt(json: &str) -> Result<PromptInput, ApiError> {
    if json.starts_with('"') {
        let text: String =
            serde_json::from_str(json).map_err(|e| ApiError::MalformedJson(e.to_string()))?;
        Ok(PromptInput::Text(text))
    } else if let Ok(ids) = serde_json::from_str::<Vec<u32>>(json) {
        Ok(PromptInput::Ids(ids))
    } else {
        let why = match serde_json::from_str::<Value>(json) {
            Ok(Value::Array(items)) if items.iter().all(Value::is_number) => {
                "token ids are integers from 0 to 4294967295"
            }
            Ok(Value::Array(_)) => {
                "prompt must be a string or a list of token ids (batches of prompts are not supported)"
            }
            _ => "prompt must be a string or a list of token ids",
        };
        Err(ApiError::invalid("prompt", why))
    }
}

fn chat_messages(messages: &Value) -> Result<Vec<ChatMessage>, ApiError> {
    ChatMessage::read_all(messages).map_err(|reason| ApiError::invalid("messages", reason))
}

/// At least 1; a number too large for any context is refused by the length check (as
/// `u32::MAX`, which no context holds), never clamped to what fits.
fn get_max_tokens(obj: &Map<String, Value>, key: &'static str) -> Result<Option<u32>, ApiError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) if n.as_u64().is_some_and(|v| v >= 1) => {
            Ok(n.as_u64().map(|v| u32::try_from(v).unwrap_or(u32::MAX)))
        }
        Some(Value::Number(n)) if n.is_i64() => {
            Err(ApiError::invalid(key, format!("{key} must be at least 1")))
        }
        Some(_) => Err(ApiError::invalid(key, format!("{key} must be an integer"))),
    }
}

fn get_str<'a>(
    obj: &'a Map<String, Value>,
    key: &'static str,
) -> Result<Option<&'a str>, ApiError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(ApiError::invalid(key, format!("{key} must be a string"))),
    }
}

fn get_bool(obj: &Map<String, Value>, key: &'static str) -> Result<Option<bool>, ApiError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(ApiError::invalid(key, format!("{key} must be a boolean"))),
    }
}

fn get_f64(obj: &Map<String, Value>, key: &'static str) -> Result<Option<f64>, ApiError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => Ok(n.as_f64()),
        Some(_) => Err(ApiError::invalid(key, format!("{key} must be a number"))),
    }
}

fn get_i64(obj: &Map<String, Value>, key: &'static str) -> Result<Option<i64>, ApiError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) if n.as_i64().is_some() => Ok(n.as_i64()),
        Some(_) => Err(ApiError::invalid(key, format!("{key} must be an integer"))),
    }
}

// === impl Responder ===

/// Writes the response and chunk JSON of one request in its API's shape.
#[derive(Debug, Clone)]
pub struct Responder {
    pub shape: Shape,
    pub id: String,
    pub created: u64,
    pub model: String,
    pub include_usage: bool,
}

impl Responder {
    /// The first frame of a chat stream announces the assistant role; completions have none.
    pub fn opening_frame(&self, out: &mut Vec<u8>) {
        if self.shape == Shape::Chat {
            self.write_choice(out, Some("assistant"), Some(""), None);
        }
    }

    /// The frames of a stream's generated text, with what every one of them repeats
    /// rendered once (see [`TextFrames`]).
    pub fn text_frames(&self) -> TextFrames {
        // A text no id or model can end with: the frame's last string is its text.
        const MARK: &str = "\u{0}";
        let mut frame = Vec::new();
        self.write_choice(&mut frame, None, Some(MARK), None);
        let mark = serde_json::to_vec(MARK).expect("a string serialises");
        let at = frame
            .windows(mark.len())
            .rposition(|w| w == mark)
            .expect("the frame holds its text");
        frame.drain(at..at + mark.len());
        TextFrames {
            around: frame.into_boxed_slice(),
            text_at: at,
        }
    }

    /// The frame that ends the choice with its finish reason.
    pub fn finish_frame(&self, out: &mut Vec<u8>, finish_reason: &str) {
        self.write_choice(out, None, None, Some(finish_reason));
    }

    /// The usage-only frame that ends a stream when `stream_options.include_usage` is set.
    pub fn usage_frame(&self, out: &mut Vec<u8>, usage: &Usage) {
        if self.include_usage {
            self.write_chunk(out, &[], Some(usage));
        }
    }

    /// A frame of one choice: a chat choice carries a `delta` of `role` and `content`, a
    /// completion choice the `text` alone.
    fn write_choice(
        &self,
        out: &mut Vec<u8>,
        role: Option<&str>,
        content: Option<&str>,
        finish_reason: Option<&str>,
    ) {
        let (text, delta) = match self.shape {
            Shape::Completion => (Some(content.unwrap_or("")), None),
            Shape::Chat => (None, Some(Delta { role, content })),
        };
        let choice = ChunkChoice {
            index: 0,
            text,
            delta,
            finish_reason,
            logprobs: (),
        };
        self.write_chunk(out, &[choice], None);
    }

    /// `data: <chunk>\n\n`, serialised straight into `out` (no intermediate JSON value: this runs
    /// once per streamed token).
    fn write_chunk(&self, out: &mut Vec<u8>, choices: &[ChunkChoice<'_>], usage: Option<&Usage>) {
        let chunk = Chunk {
            id: &self.id,
            object: match self.shape {
                Shape::Completion => "text_completion",
                Shape::Chat => "chat.completion.chunk",
            },
            created: self.created,
            model: &self.model,
            choices,
            // With include_usage every chunk has the field, null but on the last one.
            usage: self.include_usage.then_some(usage),
        };
        sse::write_event(out, &chunk);
    }

    /// A complete non-streaming response.
    pub fn full_response<'a>(
        &'a self,
        text: String,
        finish_reason: &'a str,
        usage: &Usage,
    ) -> FullResponse<'a> {
        let (object, text, message) = match self.shape {
            Shape::Completion => ("text_completion", Some(text), None),
            Shape::Chat => (
                "chat.completion",
                None,
                Some(Message {
                    content: text,
                    role: "assistant",
                }),
            ),
        };
        FullResponse {
            choices: [FullChoice {
                finish_reason,
                index: 0,
                logprobs: (),
                message,
                text,
            }],
            created: self.created,
            id: &self.id,
            model: &self.model,
            object,
            usage: FullUsage::from(usage),
        }
    }
}

/// The frames of one stream's text, each `data: <chunk>\n\n` as [`Responder`] writes it: the
/// bytes before and after the text (the id, object, created, model, the choice's other fields,
/// a null usage) are the same on every token of a stream and are rendered once, so a token
/// costs its text's escaping and two copies. Through serde, each token wrote the id, object
/// and model again, escaping each.
#[derive(Debug)]
pub struct TextFrames {
    /// A frame without its text: `data: {"id":…,"choices":[{"index":0,"text":` (chat:
    /// `…"delta":{"content":`), then `,"finish_reason":null,"logprobs":null}]…}` and the
    /// event's end. One buffer: it lives as long as the stream.
    around: Box<[u8]>,
    /// Where the text goes.
    text_at: usize,
}

impl TextFrames {
    /// Append the frame of `text`.
    pub fn write(&self, out: &mut Vec<u8>, text: &str) {
        let (head, tail) = self.around.split_at(self.text_at);
        out.extend_from_slice(head);
        // Escaped and quoted exactly as the chunk's other strings are.
        serde_json::to_writer(&mut *out, text).expect("a string serialises");
        out.extend_from_slice(tail);
    }
}

/// A complete non-streaming response, written straight from its fields (a `json!` tree cost
/// an allocation per key and value). The fields are in the sorted order the tree wrote them,
/// so answers are byte for byte what they were.
#[derive(Serialize)]
pub struct FullResponse<'a> {
    choices: [FullChoice<'a>; 1],
    created: u64,
    id: &'a str,
    model: &'a str,
    object: &'static str,
    usage: FullUsage,
}

/// The one choice: `text` for completions, `message` for chat.
#[derive(Serialize)]
struct FullChoice<'a> {
    finish_reason: &'a str,
    index: u32,
    /// Always null: logprobs are not supported.
    logprobs: (),
    #[serde(skip_serializing_if = "Option::is_none")]
    message: Option<Message>,
    #[serde(skip_serializing_if = "Option::is_none")]
    text: Option<String>,
}

#[derive(Serialize)]
struct Message {
    content: String,
    role: &'static str,
}

/// `usage`, its keys sorted; `prompt_tokens_details` only where the generating engine reported
/// cached tokens: OpenAI clients read it as cache hits.
#[derive(Debug, PartialEq, Serialize)]
struct FullUsage {
    completion_tokens: u32,
    prompt_tokens: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    prompt_tokens_details: Option<CachedTokens>,
    total_tokens: u32,
}

#[derive(Debug, PartialEq, Serialize)]
struct CachedTokens {
    cached_tokens: u32,
}

impl From<&Usage> for FullUsage {
    fn from(usage: &Usage) -> Self {
        FullUsage {
            completion_tokens: usage.completion_tokens,
            prompt_tokens: usage.prompt_tokens,
            prompt_tokens_details: usage
                .cached_tokens()
                .map(|cached_tokens| CachedTokens { cached_tokens }),
            total_tokens: usage.total_tokens,
        }
    }
}

/// One streamed chunk, in either API's shape.
#[derive(Serialize)]
struct Chunk<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: &'a [ChunkChoice<'a>],
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<Option<&'a Usage>>,
}

/// A streamed choice: `text` for completions, `delta` for chat.
#[derive(Serialize)]
struct ChunkChoice<'a> {
    index: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    text: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    delta: Option<Delta<'a>>,
    finish_reason: Option<&'a str>,
    /// Always null: logprobs are not supported.
    logprobs: (),
}

#[derive(Serialize)]
struct Delta<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    role: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    content: Option<&'a str>,
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn defaults() -> Defaults<'static> {
        Defaults {
            model: "served",
            max_tokens: 16,
            context_length: 64,
            max_prompt_tokens: 50,
        }
    }

    fn tokenizer() -> Arc<PromptTokenizer> {
        Arc::new(PromptTokenizer::byte_level().expect("tokenizer"))
    }

    fn parse(body: &str) -> Result<ParsedRequest, ApiError> {
        parse_completion(body.as_bytes(), &tokenizer(), defaults())
    }

    fn parse_chat(
        body: &[u8],
        tokenizer: &Arc<PromptTokenizer>,
    ) -> Result<ParsedRequest, ApiError> {
        let object = BodyObject::read(body, Shape::Chat)?;
        parse_read(Shape::Chat, body, &object, tokenizer, defaults())
    }

    /// The prompt's ids, tokenizing it if the parse did not.
    fn ids(r: &ParsedRequest) -> Vec<u32> {
        r.prompt.ids_now().expect("tokenizes").to_vec()
    }

    /// The prompt is read back from where the object read found it in the body, wherever it
    /// lies among the fields and however its text is escaped.
    #[test]
    fn the_prompt_is_read_from_where_it_lies_in_the_body() {
        let plain = parse(r#"{"prompt": "é \"x\""}"#).expect("valid");
        for body in [
            r#"{"model": "m", "prompt": "\u00e9 \"x\"", "user": "u"}"#,
            r#"{"user": "u","prompt":"é \"x\""}"#,
        ] {
            let parsed = parse(body).expect("valid");
            assert_eq!(ids(&parsed), ids(&plain), "{body}");
        }
    }

    fn param_of(result: Result<ParsedRequest, ApiError>) -> String {
        match result {
            Err(e) => {
                assert_eq!(e.status(), http::StatusCode::BAD_REQUEST, "{e}");
                e.body().error.param.unwrap_or("").to_owned()
            }
            Ok(r) => panic!("accepted: {r:?}"),
        }
    }

    #[test]
    fn accepts_strings_token_ids_and_defaults() {
        let r = parse(r#"{"prompt": "abc"}"#).expect("valid");
        assert_eq!(ids(&r), [97, 98, 99]);
        assert_eq!(
            (r.max_tokens, r.stream, r.model.as_str()),
            (16, false, "served")
        );
        let r = parse(
            r#"{"prompt": [5, 6], "max_tokens": 3, "stream": true, "model": "m",
            "stream_options": {"include_usage": true}, "temperature": 0.5, "stop": ["x"]}"#,
        )
        .expect("valid");
        assert_eq!(ids(&r), [5, 6]);
        assert_eq!((r.max_tokens, r.stream, r.include_usage), (3, true, true));
        assert_eq!(r.template.temperature, Some(0.5));
        assert_eq!(r.template.model.as_deref(), Some("m"));
        let r = parse(r#"{"prompt": ["abc"]}"#).expect("one-element batch");
        assert_eq!(ids(&r).len(), 3);
    }

    #[test]
    fn a_text_prompt_is_tokenized_only_when_the_limits_need_its_count() {
        // 40 bytes are at most 40 byte-level tokens: within 50, with the default 16 of 64.
        let r = parse(&format!(r#"{{"prompt": "{}"}}"#, "x".repeat(40))).expect("valid");
        assert_eq!((r.prompt.known_len(), r.max_tokens), (None, 16));
        // 49 bytes might leave less than the default 16: counted, and the default shrinks.
        let r = parse(&format!(r#"{{"prompt": "{}"}}"#, "x".repeat(49))).expect("valid");
        assert_eq!((r.prompt.known_len(), r.max_tokens), (Some(49), 15));
        // 56 bytes might be past 50 tokens; counted, they are 8 (`<|eos|>` is one token).
        let eight = "<|eos|>".repeat(8);
        let r = parse(&format!(r#"{{"prompt": "{eight}", "max_tokens": 4}}"#)).expect("valid");
        assert_eq!((r.prompt.known_len(), r.max_tokens), (Some(8), 4));
    }

    #[test]
    fn rejects_bad_fields_naming_the_param() {
        assert!(matches!(
            parse("{not json"),
            Err(ApiError::MalformedJson(_))
        ));
        assert_eq!(param_of(parse("[1]")), "body");
        assert_eq!(param_of(parse("{}")), "prompt");
        assert_eq!(param_of(parse(r#"{"prompt": ""}"#)), "prompt");
        assert_eq!(param_of(parse(r#"{"prompt": []}"#)), "prompt");
        assert_eq!(param_of(parse(r#"{"prompt": 5}"#)), "prompt");
        assert_eq!(param_of(parse(r#"{"prompt": [-1]}"#)), "prompt");
        assert_eq!(
            param_of(parse(r#"{"prompt": "a", "max_tokens": 0}"#)),
            "max_tokens"
        );
        assert_eq!(
            param_of(parse(r#"{"prompt": "a", "max_tokens": -3}"#)),
            "max_tokens"
        );
        assert_eq!(
            param_of(parse(r#"{"prompt": "a", "max_tokens": "5"}"#)),
            "max_tokens"
        );
        assert_eq!(
            param_of(parse(r#"{"prompt": "a", "stream": "yes"}"#)),
            "stream"
        );
        assert_eq!(param_of(parse(r#"{"prompt": "a", "n": 2}"#)), "n");
        assert_eq!(param_of(parse(r#"{"prompt": [1.5]}"#)), "prompt");
        // Nesting as deep as a client likes recurses nowhere (this overflowed the stack once).
        let deep = format!(
            r#"{{"prompt": {}1{}}}"#,
            "[".repeat(20_000),
            "]".repeat(20_000)
        );
        assert_eq!(param_of(parse(&deep)), "prompt");
        assert_eq!(param_of(parse(r#"{"prompt": [[1], [2]]}"#)), "prompt");
        assert_eq!(
            param_of(parse(r#"{"prompt": "a", "temperature": "hot"}"#)),
            "temperature"
        );
    }

    #[test]
    fn limits_refuse_what_does_not_fit_and_never_clamp() {
        // The byte-level vocabulary: ids 0..=255 (and EOS).
        let vocab = PromptTokenizer::byte_level()
            .expect("tokenizer")
            .vocab_size();
        assert!(parse(&format!(r#"{{"prompt": [{}]}}"#, vocab - 1)).is_ok());
        let e = parse(&format!(r#"{{"prompt": [{vocab}]}}"#)).expect_err("out of vocabulary");
        assert!(e.to_string().contains("out of range"), "{e}");
        // Context 64, prompts of at most 50 tokens.
        let over = |prompt: usize, max_tokens: u64| {
            let body = format!(
                r#"{{"prompt": "{}", "max_tokens": {max_tokens}}}"#,
                "x".repeat(prompt)
            );
            parse(&body)
        };
        assert_eq!(over(40, 24).expect("fits exactly").max_tokens, 24);
        assert_eq!(param_of(over(40, 25)), "prompt");
        let e = over(40, 25).expect_err("one too many");
        assert!(
            e.to_string().contains(
                "maximum context length is 64 tokens. However, you requested 65 tokens \
                 (40 in the prompt, 25 in the completion)"
            ),
            "{e}"
        );
        assert_eq!(
            param_of(over(1, 1 << 40)),
            "prompt",
            "2^40 is refused, not clamped"
        );
        assert_eq!(
            param_of(over(51, 1)),
            "prompt",
            "longer than max_prompt_tokens"
        );
        // Without max_tokens, the default shrinks to the room the context leaves.
        let r = parse(&format!(r#"{{"prompt": "{}"}}"#, "x".repeat(50))).expect("valid");
        assert_eq!(r.max_tokens, 14);
        let r = parse(r#"{"prompt": [[7, 8]]}"#).expect("a batch of one");
        assert_eq!(ids(&r), [7, 8]);
    }

    /// The JSON of each `data:` frame in `out`.
    fn frames(out: &[u8]) -> Vec<Value> {
        std::str::from_utf8(out)
            .expect("utf-8")
            .split_terminator("\n\n")
            .map(|f| {
                let json = f.strip_prefix("data: ").expect("a data frame");
                serde_json::from_str(json).expect("a JSON chunk")
            })
            .collect()
    }

    fn responder(shape: Shape, include_usage: bool) -> Responder {
        Responder {
            shape,
            id: "id-1".into(),
            created: 7,
            model: "m".into(),
            include_usage,
        }
    }

    #[test]
    fn completion_chunks_have_the_openai_shape() {
        let r = responder(Shape::Completion, true);
        let mut out = Vec::new();
        r.opening_frame(&mut out);
        assert!(out.is_empty(), "completions have no role chunk");
        r.text_frames().write(&mut out, "he said \"hi\"\n");
        r.finish_frame(&mut out, "stop");
        let usage = Usage::new(3, 2);
        r.usage_frame(&mut out, &usage);
        let envelope =
            json!({"id": "id-1", "object": "text_completion", "created": 7, "model": "m"});
        let with = |choices: Value, usage: Value| {
            let mut chunk = envelope.clone();
            chunk["choices"] = choices;
            chunk["usage"] = usage;
            chunk
        };
        assert_eq!(
            frames(&out),
            [
                with(
                    json!([{"index": 0, "text": "he said \"hi\"\n", "finish_reason": null, "logprobs": null}]),
                    Value::Null
                ),
                with(
                    json!([{"index": 0, "text": "", "finish_reason": "stop", "logprobs": null}]),
                    Value::Null
                ),
                with(
                    json!([]),
                    json!({"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5})
                ),
            ]
        );
    }

    /// A text frame rendered around its text is, byte for byte, the chunk serde writes, in
    /// either shape, with or without usage, whatever the text, id and model hold.
    #[test]
    fn text_frames_are_the_chunks_serde_writes() {
        let texts = [
            "",
            "hi",
            "he said \"hi\"\n",
            "\u{0}\\\u{1f}é🙂",
            "\",\"finish_reason\":",
        ];
        let ids = ["id-1", "\u{0}", "id \"\u{0}\" x"];
        for shape in [Shape::Completion, Shape::Chat] {
            for include_usage in [false, true] {
                for id in ids {
                    let mut r = responder(shape, include_usage);
                    r.id = id.into();
                    r.model = format!("m\u{0}{id}");
                    let frames = r.text_frames();
                    for text in texts {
                        let (mut rendered, mut serialised) = (Vec::new(), Vec::new());
                        frames.write(&mut rendered, text);
                        r.write_choice(&mut serialised, None, Some(text), None);
                        assert_eq!(
                            String::from_utf8(rendered).expect("utf-8"),
                            String::from_utf8(serialised).expect("utf-8"),
                            "{shape:?}, usage {include_usage}, id {id:?}, text {text:?}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn cached_tokens_show_only_where_the_engine_reported_them() {
        let usage = |usage: &Usage| serde_json::to_value(FullUsage::from(usage)).unwrap();
        assert_eq!(
            usage(&Usage::new(3, 2).with_cached_tokens(2)),
            json!({"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                "prompt_tokens_details": {"cached_tokens": 2}})
        );
        assert_eq!(usage(&Usage::new(3, 2)).get("prompt_tokens_details"), None);
    }

    /// The whole answer's bytes, keys sorted as clients have always seen them.
    #[test]
    fn full_responses_are_written_with_their_keys_sorted() {
        let written = |shape, usage: &Usage| {
            let r = responder(shape, false);
            let body = r.full_response(" Paris.".to_owned(), "length", usage);
            String::from_utf8(serde_json::to_vec(&body).unwrap()).unwrap()
        };
        assert_eq!(
            written(Shape::Completion, &Usage::new(6, 2)),
            r#"{"choices":[{"finish_reason":"length","index":0,"logprobs":null,"text":" Paris."}],"created":7,"id":"id-1","model":"m","object":"text_completion","usage":{"completion_tokens":2,"prompt_tokens":6,"total_tokens":8}}"#
        );
        assert_eq!(
            written(Shape::Chat, &Usage::new(6, 2).with_cached_tokens(4)),
            r#"{"choices":[{"finish_reason":"length","index":0,"logprobs":null,"message":{"content":" Paris.","role":"assistant"}}],"created":7,"id":"id-1","model":"m","object":"chat.completion","usage":{"completion_tokens":2,"prompt_tokens":6,"prompt_tokens_details":{"cached_tokens":4},"total_tokens":8}}"#
        );
    }

    #[test]
    fn chat_chunks_have_the_openai_shape_and_no_usage_unless_asked() {
        let r = responder(Shape::Chat, false);
        let mut out = Vec::new();
        r.opening_frame(&mut out);
        r.text_frames().write(&mut out, "hi");
        r.finish_frame(&mut out, "length");
        r.usage_frame(&mut out, &Usage::default());
        let envelope =
            json!({"id": "id-1", "object": "chat.completion.chunk", "created": 7, "model": "m"});
        let with = |delta: Value, finish_reason: Value| {
            let mut chunk = envelope.clone();
            chunk["choices"] = json!([{"index": 0, "delta": delta,
                "finish_reason": finish_reason, "logprobs": null}]);
            chunk
        };
        assert_eq!(
            frames(&out),
            [
                with(json!({"role": "assistant", "content": ""}), Value::Null),
                with(json!({"content": "hi"}), Value::Null),
                with(json!({}), json!("length")),
            ]
        );
    }

    #[test]
    fn chat_uses_the_template_and_max_completion_tokens() {
        let t = tokenizer();
        let body =
            r#"{"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 4}"#;
        let r = parse_chat(body.as_bytes(), &t).expect("valid");
        assert_eq!(ids(&r).len(), "<|user|>\nHi\n<|assistant|>\n".len());
        assert_eq!(r.max_tokens, 4);
        let err = parse_chat(br#"{"messages": []}"#, &t);
        assert_eq!(param_of(err), "messages");
    }
}
