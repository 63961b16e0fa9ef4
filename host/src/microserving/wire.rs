//! The microserving wire types, field for field as `spec/microserving.md` describes them.
//!
//! Every call carries the full OpenAI `CompletionRequest` body ([`CompletionRequest`]) plus the
//! fields of its step, flattened into the same JSON object. Optional fields are sent as `null`
//! rather than left out, because MLC's router sends the whole pydantic model and its engines
//! were only ever tested against that shape. `debug_config` is always an object: MLC engines
//! answer 500 when it is null.

use serde::{Deserialize, Serialize};

/// The fields of the common body of every microserving call, as the spec lists them (each
/// call adds its own: `end`; `begin`, `end`, `kv_addr_info`, `recv_rank`; `begin`).
pub const COMMON_REQUEST_FIELDS: &[&str] = &[
    "model",
    "prompt",
    "max_tokens",
    "n",
    "stream",
    "stream_options",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "logprobs",
    "frequency_penalty",
    "presence_penalty",
    "logit_bias",
    "echo",
    "suffix",
    "response_format",
    "user",
    "debug_config",
];

/// `stream_options` of a completion request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamOptions {
    pub include_usage: bool,
}

/// The common body of every microserving call: an OpenAI completion request whose prompt is
/// token ids and whose `user` is the upstream request id.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompletionRequest {
    pub model: Option<String>,
    pub prompt: Vec<u32>,
    pub max_tokens: Option<u32>,
    pub n: u32,
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub seed: Option<i64>,
    pub stop: Option<serde_json::Value>,
    pub logprobs: bool,
    pub frequency_penalty: f64,
    pub presence_penalty: f64,
    pub logit_bias: Option<serde_json::Value>,
    pub echo: bool,
    pub suffix: Option<String>,
    pub response_format: Option<serde_json::Value>,
    /// The upstream request id (`<client id>-<attempt>`), the same on every leg of an attempt.
    pub user: Option<String>,
    /// Always an object; see the module docs.
    pub debug_config: serde_json::Map<String, serde_json::Value>,
}

impl CompletionRequest {
    /// A streaming request for `prompt` with defaults for every sampling field.
    pub fn new(prompt: Vec<u32>, max_tokens: u32, user: String) -> Self {
        CompletionRequest {
            model: None,
            prompt,
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
        }
    }
}

/// `POST /microserving/prep_recv` (to the decode engine).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PrepRecvRequest {
    #[serde(flatten)]
    pub common: CompletionRequest,
    /// KV window end, python-style.
    pub end: i64,
}

/// The answer to prep_recv.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrepRecvResponse {
    /// Opaque to the router: forwarded verbatim to the prefill engine as `kv_addr_info`.
    pub kv_append_metadata: String,
    /// Prompt tokens the decode engine already holds (prefix cache).
    pub prefix_matched_length: u32,
}

/// `POST /microserving/remote_send` (to the prefill engine).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RemoteSendRequest {
    #[serde(flatten)]
    pub common: CompletionRequest,
    pub begin: i64,
    pub end: i64,
    pub kv_addr_info: String,
    pub recv_rank: u32,
}

/// `POST /microserving/start_generate` (to the decode engine).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StartGenerateRequest {
    #[serde(flatten)]
    pub common: CompletionRequest,
    pub begin: i64,
}

/// Token counts of a completion.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub total_tokens: u32,
}

/// One choice of a completion response or stream chunk.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Choice {
    #[serde(default)]
    pub index: u32,
    #[serde(default)]
    pub text: String,
    #[serde(default)]
    pub finish_reason: Option<String>,
    #[serde(default)]
    pub logprobs: Option<serde_json::Value>,
}

/// A `CompletionResponse`: one JSON answer, or one SSE chunk of a stream.
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
    pub usage: Option<Usage>,
}

/// The finish reason an engine reports when it aborted a request to free KV pages.
pub const FINISH_PREEMPT: &str = "preempt";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prep_recv_body_has_exactly_the_spec_fields() {
        let body = PrepRecvRequest {
            common: CompletionRequest::new(vec![1, 2, 3], 4, "cmpl-x-1".into()),
            end: -1,
        };
        let json = serde_json::to_value(&body).expect("serializes");
        let mut keys: Vec<_> = json.as_object().expect("object").keys().cloned().collect();
        keys.sort();
        let mut expected: Vec<String> = COMMON_REQUEST_FIELDS
            .iter()
            .chain(&["end"])
            .map(|f| f.to_string())
            .collect();
        expected.sort();
        assert_eq!(keys, expected);
        assert_eq!(json["debug_config"], serde_json::json!({}));
        assert_eq!(json["user"], "cmpl-x-1");
        assert_eq!(json["prompt"], serde_json::json!([1, 2, 3]));
    }

    #[test]
    fn engine_chunks_parse_with_missing_optional_fields() {
        let chunk: CompletionResponse = serde_json::from_str(
            r#"{"id":"c","object":"text_completion","created":1,"model":"m",
                "choices":[{"index":0,"text":"","finish_reason":"preempt","logprobs":null}],
                "usage":null}"#,
        )
        .expect("parses");
        assert_eq!(
            chunk.choices[0].finish_reason.as_deref(),
            Some(FINISH_PREEMPT)
        );
        let usage_only: CompletionResponse = serde_json::from_str(
            r#"{"id":"c","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5,"extra":null}}"#,
        )
        .expect("parses");
        assert_eq!(usage_only.usage.map(|u| u.total_tokens), Some(5));
    }
}
