//! The engine's answers in MLC's shape: one identity ([`ResponseMeta`]) per response, repeated
//! by every chunk of a stream.

use std::sync::Arc;

use bytes::Bytes;
use switchyard_wire::completion::{
    Choice, CompletionResponse, EngineUsage, Logprobs, TokenLogprob, Usage,
};

use crate::http::common::{Chunks, Tokens};
use crate::scheduler::{self, FinishReason};

/// Identity of one response: every chunk of a stream repeats it.
#[derive(Debug, Clone)]
pub struct ResponseMeta {
    pub id: String,
    pub created: u64,
    pub model: String,
    /// Whether each choice carries its generated ids (the request's `return_token_ids`).
    pub token_ids: bool,
    /// The tokenizer that names the tokens of a `logprobs` answer, when the request asked
    /// for one (`logprobs: true`).
    pub logprobs: Option<Arc<tokenizers::Tokenizer>>,
}

impl ResponseMeta {
    pub fn body(
        &self,
        choices: Vec<Choice>,
        usage: Option<scheduler::Usage>,
    ) -> CompletionResponse {
        CompletionResponse {
            id: self.id.clone(),
            object: "text_completion".into(),
            created: self.created,
            model: Some(self.model.clone()),
            choices,
            usage: usage.map(engine_usage),
            error: None,
        }
    }

    /// One chunk of a stream: the event's text, its tokens, and how it ended if it did.
    pub fn chunk(&self, event: scheduler::Event) -> CompletionResponse {
        let finish = event.finish.map(|f| f.0);
        let tokens = Tokens {
            ids: event.token_ids,
            logprobs: event.logprobs,
        };
        self.body(vec![self.choice(event.text, tokens, finish)], None)
    }

    /// One choice with `text` (completing `tokens`), ended by `finish` if it is the last.
    pub fn choice(&self, text: String, tokens: Tokens, finish: Option<FinishReason>) -> Choice {
        Choice {
            index: 0,
            text,
            finish_reason: finish.map(Into::into),
            logprobs: self.logprobs.as_ref().map(|t| logprobs(t, &tokens)),
            token_ids: self.token_ids.then_some(tokens.ids),
            delta: None,
            message: None,
        }
    }
}

/// MLC's `logprobs` of a choice: one entry per generated token, in order, with the token's
/// text and UTF-8 bytes (a token that is part of a character decodes lossily) and no
/// alternatives (`top_logprobs` is not served).
fn logprobs(tokenizer: &tokenizers::Tokenizer, tokens: &Tokens) -> Logprobs {
    let content = tokens
        .ids
        .iter()
        .zip(&tokens.logprobs)
        .map(|(&id, &logprob)| {
            let token = tokenizer.decode(&[id], false).unwrap_or_default();
            TokenLogprob {
                bytes: Some(token.as_bytes().to_vec()),
                token,
                logprob,
                top_logprobs: Vec::new(),
            }
        })
        .collect();
    Logprobs::Entries(content)
}

impl Chunks for ResponseMeta {
    fn event(&self, event: scheduler::Event, _first: bool) -> Bytes {
        switchyard_wire::sse::event(&self.chunk(event))
    }

    fn usage(&self, usage: scheduler::Usage) -> Bytes {
        switchyard_wire::sse::event(&self.body(Vec::new(), Some(usage)))
    }
}

/// MLC's usage, plus the prompt tokens the prefix cache served (OpenAI's
/// `prompt_tokens_details.cached_tokens`, which MLC's own engines do not report).
fn engine_usage(u: scheduler::Usage) -> EngineUsage {
    let count = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
    EngineUsage::from(
        Usage::new(count(u.prompt_tokens), count(u.completion_tokens))
            .with_cached_tokens(count(u.cached_tokens)),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn response_shape_matches_openai() {
        let meta = ResponseMeta {
            id: "cmpl-1".into(),
            created: 7,
            model: "m".into(),
            token_ids: false,
            logprobs: None,
        };
        let usage = scheduler::Usage {
            prompt_tokens: 3,
            completion_tokens: 2,
            cached_tokens: 0,
        };
        let json = serde_json::to_value(meta.body(vec![], Some(usage))).expect("serializes");
        assert_eq!(
            json,
            serde_json::json!({"id": "cmpl-1", "object": "text_completion", "created": 7,
                "model": "m", "choices": [], "usage": {"prompt_tokens": 3,
                "completion_tokens": 2, "total_tokens": 5,
                "prompt_tokens_details": {"cached_tokens": 0}, "extra": null}})
        );
        let chunk =
            serde_json::to_value(meta.chunk(event("a", &[97], &[-0.5]))).expect("serializes");
        assert_eq!(
            chunk["choices"],
            serde_json::json!([{"index": 0, "text": "a", "finish_reason": "preempt", "logprobs": null}])
        );
        assert_eq!(chunk["usage"], serde_json::Value::Null);
    }

    fn event(text: &str, ids: &[u32], logprobs: &[f32]) -> scheduler::Event {
        scheduler::Event {
            text: text.into(),
            token_ids: ids.to_vec(),
            logprobs: logprobs.to_vec(),
            finish: Some((FinishReason::Preempt, scheduler::Usage::default())),
        }
    }

    #[test]
    fn logprobs_name_every_token_of_a_chunk_once() {
        let meta = ResponseMeta {
            id: "cmpl-1".into(),
            created: 7,
            model: "m".into(),
            token_ids: false,
            logprobs: Some(Arc::new(switchyard_wire::tokenizer::byte_level_tokenizer())),
        };
        let chunk = serde_json::to_value(meta.chunk(event(
            "hi",
            b"hi".map(u32::from).as_slice(),
            &[-0.5, -1.25],
        )))
        .expect("serializes");
        assert_eq!(
            chunk["choices"][0]["logprobs"],
            serde_json::json!({"content": [
                {"token": "h", "logprob": -0.5, "bytes": [104], "top_logprobs": []},
                {"token": "i", "logprob": -1.25, "bytes": [105], "top_logprobs": []}]})
        );
        assert!(chunk["choices"][0].get("token_ids").is_none());
    }
}
