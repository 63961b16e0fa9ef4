//! MLC-LLM's microserving calls, field for field as `spec/microserving.md` describes them.
//!
//! Every call carries the full OpenAI [`CompletionRequest`] body plus the fields of its step,
//! flattened into the same JSON object.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::completion::CompletionRequest;

/// How long switchyard's router waits, by default, for a prep_recv or remote_send answer (and
/// for a generation's response headers). prep_recv may wait for free KV pages and remote_send
/// includes the prefill, so it is generous; engines size their safety margins from it (the
/// reference engine keeps an expired reservation's pages unused this long on one-sided
/// transports, which may still be writing into them).
pub const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(120);

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
}
