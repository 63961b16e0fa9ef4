//! The engine's answers in MLC's shape: one identity ([`ResponseMeta`]) per response, repeated
//! by every chunk of a stream.

use switchyard_wire::completion::{Choice, CompletionResponse, EngineUsage, Usage};

use crate::scheduler::{self, FinishReason};

/// Identity of one response: every chunk of a stream repeats it.
#[derive(Debug, Clone)]
pub struct ResponseMeta {
    pub id: String,
    pub created: u64,
    pub model: String,
    /// Whether each choice carries its generated ids (the request's `return_token_ids`).
    pub token_ids: bool,
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

    /// One choice with `text` (completing `ids`), ended by `finish` if it is the last.
    pub fn chunk(
        &self,
        text: String,
        ids: Vec<u32>,
        finish: Option<FinishReason>,
    ) -> CompletionResponse {
        self.body(vec![self.choice(text, ids, finish)], None)
    }

    /// One choice with `text` (completing `ids`), ended by `finish` if it is the last.
    pub fn choice(&self, text: String, ids: Vec<u32>, finish: Option<FinishReason>) -> Choice {
        Choice {
            index: 0,
            text,
            finish_reason: finish.map(|f| f.as_str().to_owned()),
            logprobs: None,
            token_ids: self.token_ids.then_some(ids),
            delta: None,
            message: None,
        }
    }
}

fn engine_usage(u: scheduler::Usage) -> EngineUsage {
    let count = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
    EngineUsage::from(Usage::new(
        count(u.prompt_tokens),
        count(u.completion_tokens),
    ))
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
        };
        let usage = scheduler::Usage {
            prompt_tokens: 3,
            completion_tokens: 2,
        };
        let json = serde_json::to_value(meta.body(vec![], Some(usage))).expect("serializes");
        assert_eq!(
            json,
            serde_json::json!({"id": "cmpl-1", "object": "text_completion", "created": 7,
                "model": "m", "choices": [], "usage": {"prompt_tokens": 3,
                "completion_tokens": 2, "total_tokens": 5, "extra": null}})
        );
        let chunk =
            serde_json::to_value(meta.chunk("a".into(), vec![97], Some(FinishReason::Preempt)))
                .expect("serializes");
        assert_eq!(
            chunk["choices"],
            serde_json::json!([{"index": 0, "text": "a", "finish_reason": "preempt", "logprobs": null}])
        );
        assert_eq!(chunk["usage"], serde_json::Value::Null);
    }
}
