//! `/v1/completions` and `/v1/chat/completions`: request parsing and validation, and the
//! response and chunk shapes of both APIs.

use serde::Serialize;
use serde_json::{Map, Value, json};

use super::respond::ApiError;
use super::tokenize::{ChatMessage, PromptTokenizer};
use switchyard_wire::completion::{CompletionRequest, Stop, StreamOptions, Usage};
use switchyard_wire::sse;

/// Which OpenAI API a request came in on; it decides the response shapes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    Completion,
    Chat,
}

impl Shape {
    pub fn id_prefix(self) -> &'static str {
        match self {
            Shape::Completion => "cmpl",
            Shape::Chat => "chatcmpl",
        }
    }

    pub fn route(self) -> &'static str {
        match self {
            Shape::Completion => "/v1/completions",
            Shape::Chat => "/v1/chat/completions",
        }
    }
}

/// A validated client request, tokenized.
#[derive(Debug, Clone)]
pub struct ParsedRequest {
    pub prompt: Vec<u32>,
    pub max_tokens: u32,
    pub stream: bool,
    pub include_usage: bool,
    /// The model to report: the client's, or the served one.
    pub model: String,
    pub user: Option<String>,
    /// Sampling fields for the engines (prompt, max_tokens and user are set per attempt).
    pub template: CompletionRequest,
}

/// Defaults a request does not carry itself.
#[derive(Debug, Clone, Copy)]
pub struct Defaults<'a> {
    pub model: &'a str,
    pub max_tokens: u32,
}

/// Parse a `/v1/completions` body.
pub fn parse_completion(
    body: &[u8],
    tokenizer: &PromptTokenizer,
    defaults: Defaults<'_>,
) -> Result<ParsedRequest, ApiError> {
    let obj = parse_object(body)?;
    let prompt = match obj.get("prompt") {
        None | Some(Value::Null) => return Err(ApiError::invalid("prompt", "prompt is required")),
        Some(p) => prompt_tokens(p, tokenizer)?,
    };
    if get_bool(&obj, "echo")?.unwrap_or(false) {
        return Err(ApiError::invalid("echo", "echo is not supported"));
    }
    if !matches!(obj.get("suffix"), None | Some(Value::Null)) {
        return Err(ApiError::invalid("suffix", "suffix is not supported"));
    }
    let max_tokens = get_max_tokens(&obj, "max_tokens")?;
    common(&obj, prompt, max_tokens, defaults)
}

/// Parse a `/v1/chat/completions` body.
pub fn parse_chat(
    body: &[u8],
    tokenizer: &PromptTokenizer,
    defaults: Defaults<'_>,
) -> Result<ParsedRequest, ApiError> {
    let obj = parse_object(body)?;
    let messages = chat_messages(obj.get("messages"))?;
    let text = tokenizer.render_chat(&messages).map_err(|e| {
        ApiError::invalid("messages", format!("cannot render the chat template: {e}"))
    })?;
    let prompt = tokenizer.encode(&text).map_err(ApiError::Tokenize)?;
    if prompt.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "the rendered prompt is empty",
        ));
    }
    let max_tokens = match get_max_tokens(&obj, "max_completion_tokens")? {
        Some(n) => Some(n),
        None => get_max_tokens(&obj, "max_tokens")?,
    };
    common(&obj, prompt, max_tokens, defaults)
}

fn parse_object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(obj)) => Ok(obj),
        Ok(_) => Err(ApiError::invalid(
            "body",
            "the request body must be a JSON object",
        )),
        Err(e) => Err(ApiError::MalformedJson(e.to_string())),
    }
}

/// The fields both APIs share.
fn common(
    obj: &Map<String, Value>,
    prompt: Vec<u32>,
    max_tokens: Option<u32>,
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
        max_tokens: max_tokens.unwrap_or(defaults.max_tokens),
        stream,
        include_usage,
        model,
        user,
        template,
    })
}

/// A string, a list of token ids, or a one-element list of either.
fn prompt_tokens(prompt: &Value, tokenizer: &PromptTokenizer) -> Result<Vec<u32>, ApiError> {
    let tokens = match prompt {
        Value::String(text) => tokenizer.encode(text).map_err(ApiError::Tokenize)?,
        Value::Array(items) if items.iter().all(Value::is_number) => token_ids(items)?,
        Value::Array(items) if items.len() == 1 => return prompt_tokens(&items[0], tokenizer),
        Value::Array(items) if items.is_empty() => Vec::new(),
        Value::Array(_) => {
            return Err(ApiError::invalid(
                "prompt",
                "prompt must be a string or a list of token ids (batches of prompts are not supported)",
            ));
        }
        _ => {
            return Err(ApiError::invalid(
                "prompt",
                "prompt must be a string or a list of token ids",
            ));
        }
    };
    if tokens.is_empty() {
        return Err(ApiError::invalid("prompt", "prompt must not be empty"));
    }
    Ok(tokens)
}

fn token_ids(items: &[Value]) -> Result<Vec<u32>, ApiError> {
    items
        .iter()
        .map(|v| {
            v.as_u64()
                .and_then(|id| u32::try_from(id).ok())
                .ok_or_else(|| ApiError::invalid("prompt", format!("{v} is not a token id")))
        })
        .collect()
}

fn chat_messages(messages: Option<&Value>) -> Result<Vec<ChatMessage>, ApiError> {
    let Some(Value::Array(items)) = messages else {
        return Err(ApiError::invalid(
            "messages",
            "messages must be a list of messages",
        ));
    };
    if items.is_empty() {
        return Err(ApiError::invalid("messages", "messages must not be empty"));
    }
    items
        .iter()
        .map(|m| {
            let role = m.get("role").and_then(Value::as_str).ok_or_else(|| {
                ApiError::invalid("messages", "every message needs a string role")
            })?;
            let content = match m.get("content") {
                None | Some(Value::Null) => String::new(),
                Some(Value::String(s)) => s.clone(),
                // Content parts: keep the text ones.
                Some(Value::Array(parts)) => parts
                    .iter()
                    .filter(|p| p.get("type").and_then(Value::as_str) == Some("text"))
                    .filter_map(|p| p.get("text").and_then(Value::as_str))
                    .collect(),
                Some(_) => {
                    return Err(ApiError::invalid(
                        "messages",
                        "message content must be a string or a list of parts",
                    ));
                }
            };
            Ok(ChatMessage {
                role: role.to_owned(),
                content,
            })
        })
        .collect()
}

fn get_max_tokens(obj: &Map<String, Value>, key: &'static str) -> Result<Option<u32>, ApiError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => match n.as_i64() {
            Some(v) if v >= 1 => Ok(Some(u32::try_from(v).unwrap_or(u32::MAX))),
            Some(_) => Err(ApiError::invalid(key, format!("{key} must be at least 1"))),
            None => Err(ApiError::invalid(key, format!("{key} must be an integer"))),
        },
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

    /// One frame of generated text.
    pub fn text_frame(&self, out: &mut Vec<u8>, text: &str) {
        self.write_choice(out, None, Some(text), None);
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
    pub fn full_response(&self, text: String, finish_reason: &str, usage: &Usage) -> Value {
        match self.shape {
            Shape::Completion => json!({
                "id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model,
                "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": null}],
                "usage": usage_json(usage),
            }),
            Shape::Chat => json!({
                "id": self.id, "object": "chat.completion", "created": self.created,
                "model": self.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "finish_reason": finish_reason, "logprobs": null}],
                "usage": usage_json(usage),
            }),
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

fn usage_json(usage: &Usage) -> Value {
    json!({
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn defaults() -> Defaults<'static> {
        Defaults {
            model: "served",
            max_tokens: 16,
        }
    }

    fn parse(body: &str) -> Result<ParsedRequest, ApiError> {
        let t = PromptTokenizer::byte_level().expect("tokenizer");
        parse_completion(body.as_bytes(), &t, defaults())
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
        assert_eq!(r.prompt, [97, 98, 99]);
        assert_eq!(
            (r.max_tokens, r.stream, r.model.as_str()),
            (16, false, "served")
        );
        let r = parse(
            r#"{"prompt": [5, 6], "max_tokens": 3, "stream": true, "model": "m",
            "stream_options": {"include_usage": true}, "temperature": 0.5, "stop": ["x"]}"#,
        )
        .expect("valid");
        assert_eq!(r.prompt, [5, 6]);
        assert_eq!((r.max_tokens, r.stream, r.include_usage), (3, true, true));
        assert_eq!(r.template.temperature, Some(0.5));
        assert_eq!(r.template.model.as_deref(), Some("m"));
        let r = parse(r#"{"prompt": ["abc"]}"#).expect("one-element batch");
        assert_eq!(r.prompt.len(), 3);
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
        assert_eq!(
            param_of(parse(r#"{"prompt": "a", "temperature": "hot"}"#)),
            "temperature"
        );
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
        r.text_frame(&mut out, "he said \"hi\"\n");
        r.finish_frame(&mut out, "stop");
        let usage = Usage {
            prompt_tokens: 3,
            completion_tokens: 2,
            total_tokens: 5,
        };
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

    #[test]
    fn chat_chunks_have_the_openai_shape_and_no_usage_unless_asked() {
        let r = responder(Shape::Chat, false);
        let mut out = Vec::new();
        r.opening_frame(&mut out);
        r.text_frame(&mut out, "hi");
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
        let t = PromptTokenizer::byte_level().expect("tokenizer");
        let body =
            r#"{"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 4}"#;
        let r = parse_chat(body.as_bytes(), &t, defaults()).expect("valid");
        assert_eq!(r.prompt.len(), "<|user|>\nHi\n<|assistant|>\n".len());
        assert_eq!(r.max_tokens, 4);
        let err = parse_chat(br#"{"messages": []}"#, &t, defaults());
        assert_eq!(param_of(err), "messages");
    }
}
