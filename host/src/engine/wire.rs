//! Request and response bodies of the engine's HTTP surface, as MLC engines accept and send them
//! (spec/microserving.md). Requests are lenient (every field but `prompt` optional, unknown
//! fields ignored); responses are exact.

use serde::{Deserialize, Serialize};

use super::scheduler::{FinishReason, Usage};

/// An OpenAI `CompletionRequest` plus the microserving fields. Fields the engine does not use
/// (`logprobs`, penalties, `logit_bias`, `echo`, `suffix`, `response_format`, `debug_config`)
/// are accepted and ignored.
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    #[serde(default)]
    pub model: Option<String>,
    pub prompt: Prompt,
    #[serde(default)]
    pub max_tokens: Option<i64>,
    #[serde(default)]
    pub n: Option<i64>,
    #[serde(default)]
    pub stream: Option<bool>,
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
    /// The request id on microserving calls.
    #[serde(default)]
    pub user: Option<String>,
    // --- microserving step fields ---
    #[serde(default)]
    pub end: Option<i64>,
    #[serde(default)]
    pub begin: Option<i64>,
    #[serde(default)]
    pub kv_addr_info: Option<String>,
    #[serde(default)]
    pub recv_rank: Option<i64>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<i64>),
}

#[derive(Debug, Clone, Deserialize)]
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

#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: Option<bool>,
}

impl CompletionRequest {
    pub fn streaming(&self) -> bool {
        self.stream.unwrap_or(false)
    }

    pub fn include_usage(&self) -> bool {
        self.stream_options
            .as_ref()
            .and_then(|o| o.include_usage)
            .unwrap_or(false)
    }
}

/// `prep_recv`'s answer.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct PrepRecvResponse {
    pub kv_append_metadata: String,
    pub prefix_matched_length: usize,
}

/// A completion, whole or one SSE chunk of it.
#[derive(Debug, Clone, Serialize)]
pub struct CompletionResponse<'a> {
    pub id: &'a str,
    pub object: &'static str,
    pub created: u64,
    pub model: &'a str,
    pub choices: Vec<Choice>,
    pub usage: Option<UsageBody>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Choice {
    pub index: u32,
    pub text: String,
    pub finish_reason: Option<&'static str>,
    pub logprobs: Option<()>,
}

#[derive(Debug, Clone, Copy, Serialize)]
pub struct UsageBody {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    pub extra: Option<()>,
}

impl From<Usage> for UsageBody {
    fn from(u: Usage) -> Self {
        UsageBody {
            prompt_tokens: u.prompt_tokens,
            completion_tokens: u.completion_tokens,
            total_tokens: u.prompt_tokens + u.completion_tokens,
            extra: None,
        }
    }
}

/// Identity of one response: every chunk of a stream repeats it.
#[derive(Debug, Clone)]
pub struct ResponseMeta {
    pub id: String,
    pub created: u64,
    pub model: String,
}

impl ResponseMeta {
    pub fn body(&self, choices: Vec<Choice>, usage: Option<UsageBody>) -> CompletionResponse<'_> {
        CompletionResponse {
            id: &self.id,
            object: "text_completion",
            created: self.created,
            model: &self.model,
            choices,
            usage,
        }
    }

    /// One choice with `text`, ended by `finish` if it is the last.
    pub fn chunk(&self, text: String, finish: Option<FinishReason>) -> CompletionResponse<'_> {
        let choice = Choice {
            index: 0,
            text,
            finish_reason: finish.map(FinishReason::as_str),
            logprobs: None,
        };
        self.body(vec![choice], None)
    }
}

/// OpenAI's error body: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Clone, Serialize)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Clone, Serialize)]
pub struct ErrorDetail {
    pub message: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub param: Option<&'static str>,
    pub code: Option<&'static str>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_mlc_bodies_and_ignores_unknown_fields() {
        let body = r#"{"model": null, "prompt": [1, 2, 3], "max_tokens": 4, "n": 1, "stream": true,
            "stream_options": {"include_usage": true}, "temperature": 0.0, "top_p": 1.0,
            "seed": null, "stop": null, "logprobs": false, "frequency_penalty": 0.0,
            "presence_penalty": 0.0, "logit_bias": null, "echo": false, "suffix": null,
            "response_format": null, "user": "cmpl-0123", "debug_config": {}, "end": -1,
            "something_new": [1, {"x": 2}]}"#;
        let req: CompletionRequest = serde_json::from_str(body).unwrap();
        assert!(matches!(req.prompt, Prompt::Tokens(ref t) if t == &[1, 2, 3]));
        assert!(req.streaming() && req.include_usage());
        assert_eq!(req.end, Some(-1));
        let minimal: CompletionRequest = serde_json::from_str(r#"{"prompt": "hi"}"#).unwrap();
        assert!(!minimal.streaming() && !minimal.include_usage());
        assert!(serde_json::from_str::<CompletionRequest>(r#"{"model": "m"}"#).is_err());
    }

    #[test]
    fn response_shape_matches_openai() {
        let meta = ResponseMeta {
            id: "cmpl-1".into(),
            created: 7,
            model: "m".into(),
        };
        let usage = UsageBody::from(Usage {
            prompt_tokens: 3,
            completion_tokens: 2,
        });
        let json = serde_json::to_value(meta.body(vec![], Some(usage))).unwrap();
        assert_eq!(
            json,
            serde_json::json!({"id": "cmpl-1", "object": "text_completion", "created": 7,
                "model": "m", "choices": [], "usage": {"prompt_tokens": 3,
                "completion_tokens": 2, "total_tokens": 5, "extra": null}})
        );
        let chunk =
            serde_json::to_value(meta.chunk("a".into(), Some(FinishReason::Preempt))).unwrap();
        assert_eq!(
            chunk["choices"],
            serde_json::json!([{"index": 0, "text": "a", "finish_reason": "preempt", "logprobs": null}])
        );
        assert_eq!(chunk["usage"], serde_json::Value::Null);
    }
}
