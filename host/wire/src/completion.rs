//! OpenAI completion bodies as the engines of a microserving deployment exchange them: the
//! request every call carries, and the answer (one JSON, or one SSE chunk of a stream).
//!
//! Requests are written whole (every field, `null` where unset: MLC's router sends the whole
//! pydantic model and its engines were only ever tested against that shape) and read leniently
//! (every field but `prompt` may be missing; unknown fields are ignored), so one type serves the
//! router that sends it and the reference engine that receives it. Answers are written as a
//! [`CompletionResponse`] and read by a router as an [`EngineChunk`], which keeps only what a
//! router uses of each chunk.

use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::{Deserialize, Serialize};

/// Why a generation ended (`finish_reason`), as OpenAI and the engines spell it. Read and
/// written as the same strings; a reason this enum does not name passes through unchanged
/// ([`FinishReason::Other`]), so a router relays whatever its engine said.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum FinishReason {
    /// EOS or a stop string: `"stop"`.
    Stop,
    /// `max_tokens` reached: `"length"`.
    Length,
    /// The engine aborted the request to free KV pages (MLC's engines, the reference
    /// engine): `"preempt"`. The generation may be continued elsewhere.
    Preempt,
    /// The engine aborted the request (vLLM, SGLang): `"abort"`.
    Abort,
    /// The model called tools: `"tool_calls"`.
    ToolCalls,
    /// Output withheld by a content filter: `"content_filter"`.
    ContentFilter,
    /// Any other reason, verbatim.
    Other(String),
}

impl FinishReason {
    /// The reason as the wire spells it.
    pub fn as_str(&self) -> &str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Preempt => "preempt",
            FinishReason::Abort => "abort",
            FinishReason::ToolCalls => "tool_calls",
            FinishReason::ContentFilter => "content_filter",
            FinishReason::Other(reason) => reason,
        }
    }

    /// The named reason `reason` spells, if any.
    fn named(reason: &str) -> Option<FinishReason> {
        Some(match reason {
            "stop" => FinishReason::Stop,
            "length" => FinishReason::Length,
            "preempt" => FinishReason::Preempt,
            "abort" => FinishReason::Abort,
            "tool_calls" => FinishReason::ToolCalls,
            "content_filter" => FinishReason::ContentFilter,
            _ => return None,
        })
    }
}

impl From<&str> for FinishReason {
    fn from(reason: &str) -> Self {
        FinishReason::named(reason).unwrap_or_else(|| FinishReason::Other(reason.to_owned()))
    }
}

impl From<String> for FinishReason {
    fn from(reason: String) -> Self {
        FinishReason::named(&reason).unwrap_or(FinishReason::Other(reason))
    }
}

impl std::fmt::Display for FinishReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for FinishReason {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for FinishReason {
    /// From a borrowed string when the input allows: a named reason (every chunk's last one)
    /// costs no allocation.
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct ReasonVisitor;
        impl Visitor<'_> for ReasonVisitor {
            type Value = FinishReason;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a finish reason string")
            }
            fn visit_str<E: de::Error>(self, reason: &str) -> Result<FinishReason, E> {
                Ok(reason.into())
            }
            fn visit_string<E: de::Error>(self, reason: String) -> Result<FinishReason, E> {
                Ok(reason.into())
            }
        }
        deserializer.deserialize_str(ReasonVisitor)
    }
}

/// An OpenAI `CompletionRequest` as microserving calls carry it. On a microserving call the
/// prompt is token ids and `user` is the upstream request id.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompletionRequest {
    #[serde(default)]
    pub model: Option<String>,
    pub prompt: Prompt,
    #[serde(default)]
    pub max_tokens: Option<u32>,
    #[serde(default = "one")]
    pub n: u32,
    #[serde(default)]
    pub stream: bool,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub temperature: Option<f64>,
    #[serde(default)]
    pub top_p: Option<f64>,
    #[serde(default)]
    pub seed: Option<i64>,
    #[serde(default)]
    pub stop: Option<Stop>,
    #[serde(default)]
    pub logprobs: bool,
    #[serde(default)]
    pub frequency_penalty: f64,
    #[serde(default)]
    pub presence_penalty: f64,
    #[serde(default)]
    pub logit_bias: Option<serde_json::Value>,
    #[serde(default)]
    pub echo: bool,
    #[serde(default)]
    pub suffix: Option<String>,
    #[serde(default)]
    pub response_format: Option<serde_json::Value>,
    /// The request id on microserving calls (`<client id>-<attempt>` from switchyard's router),
    /// the same on every leg of an attempt.
    #[serde(default)]
    pub user: Option<String>,
    /// Always an object when written: MLC engines answer 500 when it is null.
    #[serde(default)]
    pub debug_config: serde_json::Map<String, serde_json::Value>,
    /// Ask for the generated ids on every choice (vLLM's `return_token_ids`); written only
    /// when set, since other engines may refuse fields they do not know.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub return_token_ids: bool,
}

fn one() -> u32 {
    1
}

impl CompletionRequest {
    /// A streaming request (with usage) for `prompt`, with defaults for every sampling field.
    pub fn new(prompt: Vec<u32>, max_tokens: u32, user: String) -> Self {
        CompletionRequest {
            model: None,
            prompt: Prompt::Tokens(prompt),
            max_tokens: Some(max_tokens),
            n: 1,
            stream: true,
            stream_options: Some(StreamOptions {
                include_usage: true,
            }),
            temperature: None,
            top_p: None,
            seed: None,
            stop: None,
            logprobs: false,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            logit_bias: None,
            echo: false,
            suffix: None,
            response_format: None,
            user: Some(user),
            debug_config: serde_json::Map::new(),
            return_token_ids: false,
        }
    }

    /// Whether the usage-only chunk ends the stream.
    pub fn include_usage(&self) -> bool {
        self.stream_options.is_some_and(|o| o.include_usage)
    }
}

/// A prompt: text, or token ids (what a router sends, having tokenized it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub enum Prompt {
    Tokens(Vec<u32>),
    Text(String),
}

impl Prompt {
    /// The token ids, when the prompt is already tokenized.
    pub fn tokens(&self) -> Option<&[u32]> {
        match self {
            Prompt::Tokens(ids) => Some(ids),
            Prompt::Text(_) => None,
        }
    }
}

/// Read by hand rather than `untagged`, so a bad prompt says what is wrong with it instead of
/// "data did not match any variant".
impl<'de> Deserialize<'de> for Prompt {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct PromptVisitor;

        impl<'de> Visitor<'de> for PromptVisitor {
            type Value = Prompt;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a string or a list of token ids (integers in 0..2^32)")
            }

            fn visit_str<E: de::Error>(self, text: &str) -> Result<Prompt, E> {
                Ok(Prompt::Text(text.to_owned()))
            }

            fn visit_string<E: de::Error>(self, text: String) -> Result<Prompt, E> {
                Ok(Prompt::Text(text))
            }

            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Prompt, A::Error> {
                let mut ids = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 20));
                while let Some(id) = seq.next_element::<u32>()? {
                    ids.push(id);
                }
                Ok(Prompt::Tokens(ids))
            }
        }

        deserializer.deserialize_any(PromptVisitor)
    }
}

/// `stop`: one string or several.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

impl Stop {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            Stop::One(s) => vec![s],
            Stop::Many(v) => v,
        }
    }
}

/// `stream_options` of a completion request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// Token counts of a completion, as OpenAI reports them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub total_tokens: u32,
    /// How the prompt was served, where the engine says: vLLM with
    /// `--enable-prompt-tokens-details`, SGLang with cache reporting on, the reference engine
    /// always. Left out of what is written when absent, so answers without it are unchanged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_tokens_details: Option<PromptTokensDetails>,
}

impl Usage {
    /// `prompt + completion`, saturating.
    pub fn new(prompt_tokens: u32, completion_tokens: u32) -> Self {
        Usage {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens.saturating_add(completion_tokens),
            prompt_tokens_details: None,
        }
    }

    /// The same counts, saying that `cached` prompt tokens came from the engine's prefix cache.
    pub fn with_cached_tokens(self, cached: u32) -> Self {
        Usage {
            prompt_tokens_details: Some(PromptTokensDetails {
                cached_tokens: Some(cached),
            }),
            ..self
        }
    }

    /// `prompt_tokens_details.cached_tokens`, when the engine reported it.
    pub fn cached_tokens(&self) -> Option<u32> {
        self.prompt_tokens_details?.cached_tokens
    }
}

/// OpenAI's `usage.prompt_tokens_details`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PromptTokensDetails {
    /// Prompt tokens the engine did not compute because its prefix cache held their KV.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cached_tokens: Option<u32>,
}

/// Usage as an MLC engine reports it: OpenAI's counts plus MLC's `extra` (engine debug data,
/// `null` unless asked for).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct EngineUsage {
    #[serde(flatten)]
    pub counts: Usage,
    #[serde(default)]
    pub extra: Option<serde_json::Value>,
}

impl From<Usage> for EngineUsage {
    fn from(counts: Usage) -> Self {
        EngineUsage {
            counts,
            extra: None,
        }
    }
}

/// One choice of a completion answer or stream chunk.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Choice {
    #[serde(default)]
    pub index: u32,
    #[serde(default)]
    pub text: String,
    #[serde(default)]
    pub finish_reason: Option<FinishReason>,
    #[serde(default)]
    pub logprobs: Option<Logprobs>,
    /// The generated token ids this choice's text completes, when the request asked for them
    /// (`return_token_ids`, vLLM's spelling; SGLang's chat answers say `response_token_ids`):
    /// what a router continues a broken stream from.
    #[serde(
        default,
        alias = "response_token_ids",
        skip_serializing_if = "Option::is_none"
    )]
    pub token_ids: Option<Vec<u32>>,
    /// A chat chunk's text (`delta.content`); [`EngineChunk::fold_chat`] moves it to `text`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delta: Option<ChatContent>,
    /// A whole chat answer's text (`message.content`), likewise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<ChatContent>,
}

impl Choice {
    /// How many generated tokens this choice completes, when the engine says: its
    /// `token_ids`, else its `logprobs` entries (one per token, which MLC's engines send when
    /// asked though they ignore `return_token_ids`).
    pub fn generated(&self) -> Option<usize> {
        match (&self.token_ids, &self.logprobs) {
            (Some(ids), _) => Some(ids.len()),
            (None, Some(logprobs)) => logprobs.tokens(),
            _ => None,
        }
    }
}

/// A choice's `logprobs` as MLC's engines (and OpenAI's chat) write them: `{"content": [...]}`,
/// one entry per generated token. An engine writes the entries; a router needs only how many
/// there are, so reading keeps the count and no entry (every chunk of a stream carries them).
#[derive(Debug, Clone, PartialEq)]
pub enum Logprobs {
    /// The entries, as an engine writes them.
    Entries(Vec<TokenLogprob>),
    /// As read: how many entries `content` held; `None` without a `content` list (OpenAI's
    /// legacy completions shape, `tokens`/`token_logprobs`).
    Counted(Option<usize>),
}

impl Logprobs {
    /// How many generated tokens the entries cover, when there is a `content` list.
    pub fn tokens(&self) -> Option<usize> {
        match self {
            Logprobs::Entries(entries) => Some(entries.len()),
            Logprobs::Counted(n) => *n,
        }
    }
}

impl Serialize for Logprobs {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = serializer.serialize_map(Some(1))?;
        match self {
            Logprobs::Entries(entries) => map.serialize_entry("content", entries)?,
            // A count has no entries to write.
            Logprobs::Counted(_) => map.serialize_entry("content", &())?,
        }
        map.end()
    }
}

impl<'de> Deserialize<'de> for Logprobs {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        use serde::de::{IgnoredAny, MapAccess, SeqAccess, Visitor};

        /// `content`'s length, skipping every entry.
        struct Count(Option<usize>);
        impl<'de> Deserialize<'de> for Count {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                struct CountVisitor;
                impl<'de> Visitor<'de> for CountVisitor {
                    type Value = Count;
                    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                        f.write_str("a list of logprobs entries, or null")
                    }
                    fn visit_unit<E>(self) -> Result<Count, E> {
                        Ok(Count(None))
                    }
                    fn visit_none<E>(self) -> Result<Count, E> {
                        Ok(Count(None))
                    }
                    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Count, A::Error> {
                        let mut n = 0;
                        while seq.next_element::<IgnoredAny>()?.is_some() {
                            n += 1;
                        }
                        Ok(Count(Some(n)))
                    }
                }
                d.deserialize_any(CountVisitor)
            }
        }

        struct LogprobsVisitor;
        impl<'de> Visitor<'de> for LogprobsVisitor {
            type Value = Logprobs;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a logprobs object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Logprobs, A::Error> {
                let mut count = None;
                while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
                    if key == "content" {
                        count = map.next_value::<Count>()?.0;
                    } else {
                        map.next_value::<IgnoredAny>()?;
                    }
                }
                Ok(Logprobs::Counted(count))
            }
        }
        deserializer.deserialize_map(LogprobsVisitor)
    }
}

/// One generated token's log-probability, as an engine writes it (a router reads only how many
/// there are: [`Logprobs::Counted`]).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TokenLogprob {
    pub token: String,
    pub logprob: f32,
    /// The token's UTF-8 bytes.
    pub bytes: Option<Vec<u8>>,
    /// Alternatives (`top_logprobs`), when served.
    pub top_logprobs: Vec<serde_json::Value>,
}

/// The part of a chat `delta` or `message` a router relays.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatContent {
    #[serde(default)]
    pub content: Option<String>,
}

/// A `CompletionResponse` as an engine writes it: one JSON answer, or one SSE chunk of a
/// stream. A router reads it as an [`EngineChunk`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompletionResponse {
    #[serde(default)]
    pub id: String,
    #[serde(default)]
    pub object: String,
    #[serde(default)]
    pub created: u64,
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub choices: Vec<Choice>,
    #[serde(default)]
    pub usage: Option<EngineUsage>,
    /// An engine that fails after its stream started says so in an event of its own
    /// (`data: {"error": {...}}`, vLLM and SGLang alike).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<serde_json::Value>,
}

/// One chunk of a generation as a router reads it (or a whole answer, read as one chunk): the
/// first choice's text, ids, finish reason and `logprobs` count, the usage, an error event.
/// The rest of what an engine writes (`id`, `object`, `created`, `model`, a usage's `extra`,
/// further choices) is skipped unread: the router writes the client's chunk itself, and each
/// declared `String` or `Vec` cost an allocation per token (a router asks for one choice, `n` = 1).
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct EngineChunk {
    /// The first of the chunk's `choices`; `None` for a usage-only chunk.
    #[serde(default, rename = "choices", deserialize_with = "first_choice")]
    pub choice: Option<Choice>,
    #[serde(default)]
    pub usage: Option<Usage>,
    /// An engine that fails after its stream started says so in an event of its own
    /// (`data: {"error": {...}}`, vLLM and SGLang alike).
    #[serde(default)]
    pub error: Option<serde_json::Value>,
}

impl EngineChunk {
    /// Read a chat chunk or answer as a completion one: the choice's `delta.content` or
    /// `message.content` becomes its `text` (moved, not copied). A completion chunk is left as
    /// it is.
    pub fn fold_chat(&mut self) {
        let Some(choice) = &mut self.choice else {
            return;
        };
        let content = choice
            .delta
            .take()
            .or_else(|| choice.message.take())
            .and_then(|c| c.content);
        match content {
            Some(content) if choice.text.is_empty() => choice.text = content,
            Some(content) => choice.text.push_str(&content),
            None => {}
        }
    }

    /// The message of an error event, when this is one.
    pub fn error_message(&self) -> Option<String> {
        let error = self.error.as_ref()?;
        Some(
            error
                .get("message")
                .and_then(serde_json::Value::as_str)
                .map_or_else(|| error.to_string(), str::to_owned),
        )
    }
}

/// A `choices` list's first choice; the others are skipped unread.
fn first_choice<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<Choice>, D::Error> {
    struct FirstVisitor;
    impl<'de> Visitor<'de> for FirstVisitor {
        type Value = Option<Choice>;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a list of choices")
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Option<Choice>, A::Error> {
            let first = seq.next_element::<Choice>()?;
            while seq.next_element::<de::IgnoredAny>()?.is_some() {}
            Ok(first)
        }
    }
    deserializer.deserialize_seq(FirstVisitor)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mlc_bodies_parse_and_unknown_fields_are_ignored() {
        let body = r#"{"model": null, "prompt": [1, 2, 3], "max_tokens": 4, "n": 1, "stream": true,
            "stream_options": {"include_usage": true}, "temperature": 0.0, "top_p": 1.0,
            "seed": null, "stop": null, "logprobs": false, "frequency_penalty": 0.0,
            "presence_penalty": 0.0, "logit_bias": null, "echo": false, "suffix": null,
            "response_format": null, "user": "cmpl-0123", "debug_config": {}, "end": -1,
            "something_new": [1, {"x": 2}]}"#;
        let req: CompletionRequest = serde_json::from_str(body).expect("parses");
        assert_eq!(req.prompt, Prompt::Tokens(vec![1, 2, 3]));
        assert!(req.stream && req.include_usage());
        let minimal: CompletionRequest =
            serde_json::from_str(r#"{"prompt": "hi"}"#).expect("parses");
        assert_eq!(minimal.prompt, Prompt::Text("hi".into()));
        assert!(!minimal.stream && !minimal.include_usage());
        assert_eq!(minimal.n, 1);
        assert!(serde_json::from_str::<CompletionRequest>(r#"{"model": "m"}"#).is_err());
    }

    #[test]
    fn a_bad_prompt_says_what_a_prompt_is() {
        for bad in [
            r#"{"prompt": [1, -2]}"#,
            r#"{"prompt": 5}"#,
            r#"{"prompt": [1.5]}"#,
        ] {
            let e = serde_json::from_str::<CompletionRequest>(bad).expect_err(bad);
            assert!(
                e.to_string().contains("u32") || e.to_string().contains("token ids"),
                "{bad}: {e}"
            );
        }
    }

    /// A router reads the first choice, the usage and an error; the rest of the chunk (its ids,
    /// model, a usage's `extra`, fields it has never heard of, further choices) is skipped.
    #[test]
    fn engine_chunks_read_what_a_router_uses_and_skip_the_rest() {
        let chunk: EngineChunk = serde_json::from_str(
            r#"{"id":"cmpl-1","object":"text_completion","created":1,"model":"m",
                "system_fingerprint":{"new":[1,"x"]},
                "choices":[{"index":0,"text":"he\"y","finish_reason":null,"logprobs":null,
                    "token_ids":[7,8],"stop_reason":null},
                    {"index":1,"text":"other","finish_reason":"stop"}],
                "usage":null}"#,
        )
        .expect("parses");
        let choice = chunk.choice.as_ref().expect("the first choice");
        assert_eq!(
            (choice.text.as_str(), choice.token_ids.as_deref()),
            ("he\"y", Some(&[7, 8][..]))
        );
        assert_eq!((choice.finish_reason.as_ref(), chunk.usage), (None, None));
        let preempt: EngineChunk = serde_json::from_str(
            r#"{"choices":[{"index":0,"text":"","finish_reason":"preempt","logprobs":null}]}"#,
        )
        .expect("parses");
        let reason = preempt.choice.and_then(|c| c.finish_reason);
        assert_eq!(reason, Some(FinishReason::Preempt));
        let usage_only: EngineChunk = serde_json::from_str(
            r#"{"id":"c","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2,
                "total_tokens":5,"extra":{"debug":[1,2]},
                "prompt_tokens_details":{"cached_tokens":1}}}"#,
        )
        .expect("parses");
        assert_eq!(usage_only.choice, None);
        assert_eq!(
            usage_only.usage,
            Some(Usage::new(3, 2).with_cached_tokens(1))
        );
        assert_eq!(
            serde_json::from_str::<EngineChunk>("{}").expect("parses"),
            EngineChunk::default()
        );
        for bad in [
            r#"{"choices":{"text":"a"}}"#,
            r#"{"choices":[{"text":5}]}"#,
            r#"{"usage":{"prompt_tokens":3}}"#,
        ] {
            assert!(serde_json::from_str::<EngineChunk>(bad).is_err(), "{bad}");
        }
    }

    /// What the reference engine writes reads back as what it meant: the writer's type and the
    /// reader's agree on every field a router uses.
    #[test]
    fn a_written_completion_response_reads_as_its_engine_chunk() {
        let written = CompletionResponse {
            id: "cmpl-9".into(),
            object: "text_completion".into(),
            created: 3,
            model: Some("m".into()),
            choices: vec![Choice {
                index: 0,
                text: "Hi".into(),
                finish_reason: Some(FinishReason::Length),
                logprobs: Some(Logprobs::Entries(Vec::new())),
                token_ids: Some(vec![1, 2]),
                delta: None,
                message: None,
            }],
            usage: Some(Usage::new(4, 2).into()),
            error: None,
        };
        let json = serde_json::to_vec(&written).expect("serializes");
        let read: EngineChunk = serde_json::from_slice(&json).expect("parses");
        let choice = read.choice.expect("a choice");
        assert_eq!(choice.text, "Hi");
        assert_eq!(choice.finish_reason, Some(FinishReason::Length));
        assert_eq!(choice.token_ids, Some(vec![1, 2]));
        assert_eq!(choice.logprobs, Some(Logprobs::Counted(Some(0))));
        assert_eq!(read.usage, Some(Usage::new(4, 2)));
    }

    /// Every reason reads as its variant and writes back as the same string; one this crate
    /// does not name passes through unchanged.
    #[test]
    fn finish_reasons_read_and_write_as_the_same_strings() {
        for (wire, reason) in [
            ("stop", FinishReason::Stop),
            ("length", FinishReason::Length),
            ("preempt", FinishReason::Preempt),
            ("abort", FinishReason::Abort),
            ("tool_calls", FinishReason::ToolCalls),
            ("content_filter", FinishReason::ContentFilter),
            ("eos_token", FinishReason::Other("eos_token".into())),
        ] {
            let json = format!(r#"{{"text":"","finish_reason":"{wire}"}}"#);
            let choice: Choice = serde_json::from_str(&json).expect("parses");
            assert_eq!(choice.finish_reason.as_ref(), Some(&reason), "{wire}");
            let written = serde_json::to_value(&choice).expect("serializes");
            assert_eq!(written["finish_reason"], wire);
        }
        let open: Choice =
            serde_json::from_str(r#"{"text":"a","finish_reason":null}"#).expect("parses");
        assert_eq!(open.finish_reason, None);
        assert!(serde_json::from_str::<Choice>(r#"{"text":"a","finish_reason":3}"#).is_err());
    }

    /// Reading counts `logprobs` entries (what a router needs), in MLC's shape; other shapes
    /// and `null` say nothing of the count, and the ids win when both are there.
    #[test]
    fn logprobs_read_as_a_count_of_generated_tokens() {
        let choice = |json: &str| -> Choice { serde_json::from_str(json).expect("parses") };
        let mlc = choice(
            r#"{"text":"Hi!","logprobs":{"content":[
                {"token":"Hi","logprob":-0.1,"bytes":[72,105],"top_logprobs":[]},
                {"token":"!","logprob":-2.5,"bytes":[33],"top_logprobs":[{"token":"?","logprob":-3}]}]}}"#,
        );
        assert_eq!(mlc.generated(), Some(2));
        assert_eq!(
            choice(r#"{"text":"","logprobs":{"content":[]}}"#).generated(),
            Some(0)
        );
        let legacy = choice(
            r#"{"text":"Hi","logprobs":{"tokens":["Hi"],"token_logprobs":[-0.1],
                "top_logprobs":null,"text_offset":[0]}}"#,
        );
        assert_eq!(legacy.generated(), None);
        assert_eq!(choice(r#"{"text":"Hi","logprobs":null}"#).generated(), None);
        assert_eq!(choice(r#"{"text":"Hi"}"#).generated(), None);
        let both = choice(r#"{"text":"Hi","token_ids":[1,2,3],"logprobs":{"content":[{}]}}"#);
        assert_eq!(both.generated(), Some(3));
        // What an engine writes reads back as its count.
        let entry = TokenLogprob {
            token: "Hi".into(),
            logprob: -0.1,
            bytes: Some(b"Hi".to_vec()),
            top_logprobs: Vec::new(),
        };
        let written = serde_json::to_string(&Logprobs::Entries(vec![entry.clone(), entry]))
            .expect("serializes");
        let read: Logprobs = serde_json::from_str(&written).expect("parses");
        assert_eq!(read, Logprobs::Counted(Some(2)));
    }

    #[test]
    fn chat_chunks_and_answers_read_as_completion_ones() {
        let read = |json: &str| -> Choice {
            let mut chunk: EngineChunk = serde_json::from_str(json).expect(json);
            chunk.fold_chat();
            chunk.choice.expect("a choice")
        };
        let chunk = read(
            r#"{"id":"c","object":"chat.completion.chunk","choices":[{"index":0,
                "delta":{"content":"Hel"},"finish_reason":null,"token_ids":[5,6]}]}"#,
        );
        assert_eq!(chunk.text, "Hel");
        assert_eq!(chunk.token_ids, Some(vec![5, 6]));
        assert_eq!((chunk.delta, chunk.message), (None, None));
        let answer = read(
            r#"{"choices":[{"message":{"role":"assistant","content":"Hi"},
                "finish_reason":"stop","response_token_ids":[7]}]}"#,
        );
        assert_eq!(answer.text, "Hi");
        assert_eq!(answer.token_ids, Some(vec![7]));
        // A role-only opening chunk has no text; a completion chunk keeps its own.
        assert_eq!(
            read(r#"{"choices":[{"delta":{"role":"assistant"}}]}"#).text,
            ""
        );
        assert_eq!(read(r#"{"choices":[{"text":"as is"}]}"#).text, "as is");
    }

    /// An `{"error": …}` event says its message, or the whole error when it has none.
    #[test]
    fn error_events_say_their_message() {
        let message = |json: &str| {
            let chunk: EngineChunk = serde_json::from_str(json).expect(json);
            chunk.error_message()
        };
        assert_eq!(
            message(r#"{"error":{"message":"KV load failed","code":500}}"#).as_deref(),
            Some("KV load failed")
        );
        assert_eq!(
            message(r#"{"error":{"code":500}}"#).as_deref(),
            Some(r#"{"code":500}"#)
        );
        assert_eq!(message(r#"{"choices":[{"text":"a"}]}"#), None);
    }

    #[test]
    fn engine_usage_is_written_in_mlc_shape() {
        let usage = EngineUsage::from(Usage::new(3, 2));
        assert_eq!(
            serde_json::to_value(usage).expect("serializes"),
            serde_json::json!({"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                "extra": null})
        );
    }

    #[test]
    fn cached_tokens_travel_in_prompt_tokens_details_when_reported() {
        let cached = EngineUsage::from(Usage::new(40, 2).with_cached_tokens(32));
        let written = serde_json::to_value(&cached).expect("serializes");
        assert_eq!(
            written,
            serde_json::json!({"prompt_tokens": 40, "completion_tokens": 2, "total_tokens": 42,
                "prompt_tokens_details": {"cached_tokens": 32}, "extra": null})
        );
        let read: EngineUsage = serde_json::from_value(written).expect("reads back");
        assert_eq!(read.counts.cached_tokens(), Some(32));
        // vLLM's answer without the flag, and servers that report other details only.
        for (usage, cached) in [
            (
                r#"{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}"#,
                None,
            ),
            (
                r#"{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5,"prompt_tokens_details":null}"#,
                None,
            ),
            (
                r#"{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5,"prompt_tokens_details":{"audio_tokens":0}}"#,
                None,
            ),
            (
                r#"{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5,"prompt_tokens_details":{"cached_tokens":0}}"#,
                Some(0),
            ),
        ] {
            let read: Usage = serde_json::from_str(usage).expect(usage);
            assert_eq!(read.cached_tokens(), cached, "{usage}");
        }
    }
}
