//! A request's prompt, tokenized once, when something first needs its token ids: the policy
//! (`reads.prompt-length`, `prompt-tokens > 0`), the router's limits (when a prompt might not
//! fit, see `api::openai`), the KV-event index (`cached-prefix`), an MLC engine (its calls carry
//! token ids), a continuation (the delivered text is appended as ids), or the client's usage when
//! no engine counted the prompt. A request that nothing measures is never tokenized: on a plain
//! forward through a policy that reads nothing, tokenizing was the router's largest CPU cost.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use switchyard_wire::tokenizer::PromptTokenizer;

/// Texts above this many bytes are tokenized on the blocking pool: a megabyte of text takes the
/// tokenizer hundreds of milliseconds, which must not hold up the async worker every other
/// request on it shares.
pub(crate) const TOKENIZE_INLINE_BYTES: usize = 16 << 10;

/// Prompts tokenized since the process started (text prompts only: token ids need none), for
/// `switchyard_prompt_tokenizations_total`.
static TOKENIZATIONS: AtomicU64 = AtomicU64::new(0);

/// Prompts tokenized since the process started.
pub fn tokenizations() -> u64 {
    TOKENIZATIONS.load(Ordering::Relaxed)
}

/// Tokenize `text` with `tokenizer`, counted.
pub(crate) fn tokenize(tokenizer: &PromptTokenizer, text: &str) -> Result<Vec<u32>, String> {
    TOKENIZATIONS.fetch_add(1, Ordering::Relaxed);
    tokenizer.encode(text)
}

/// The prompt of one request: its token ids once known, and until then the text that gives
/// them. Cheap to clone (the text is shared).
#[derive(Debug, Clone)]
pub struct RoutePrompt {
    ids: OnceLock<Vec<u32>>,
    /// The text and its model's tokenizer, for a prompt not tokenized yet.
    text: Option<Arc<PendingText>>,
}

#[derive(Debug)]
struct PendingText {
    text: String,
    tokenizer: Arc<PromptTokenizer>,
}

/// Why a prompt's ids could not be had.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PromptError {
    #[error("cannot tokenize the prompt: {0}")]
    Tokenize(String),
    #[error("the prompt tokenizes to nothing")]
    Empty,
}

impl RoutePrompt {
    /// A prompt whose ids are known (the client sent ids, or the text was tokenized already).
    pub fn from_ids(ids: Vec<u32>) -> Self {
        RoutePrompt {
            ids: OnceLock::from(ids),
            text: None,
        }
    }

    /// A text prompt (a completion's, or a chat's rendered messages), tokenized with
    /// `tokenizer` when first needed.
    pub fn from_text(text: String, tokenizer: Arc<PromptTokenizer>) -> Self {
        RoutePrompt {
            ids: OnceLock::new(),
            text: Some(Arc::new(PendingText { text, tokenizer })),
        }
    }

    /// The ids, if they are known already.
    pub fn known(&self) -> Option<&[u32]> {
        self.ids.get().map(Vec::as_slice)
    }

    /// Its length in tokens, if known already.
    pub fn known_len(&self) -> Option<usize> {
        self.known().map(<[u32]>::len)
    }

    /// The ids, tokenizing the text now, on this thread, if they are not known yet: for callers
    /// off the async workers, or texts known to be short.
    pub fn ids_now(&self) -> Result<&[u32], PromptError> {
        if let Some(ids) = self.known() {
            return Ok(ids);
        }
        let ids = self.encode()?;
        Ok(self.ids.get_or_init(|| ids))
    }

    /// The ids, tokenizing the text if they are not known yet: on the blocking pool when it is
    /// long (see [`TOKENIZE_INLINE_BYTES`]).
    pub async fn ids(&self) -> Result<&[u32], PromptError> {
        if let Some(ids) = self.known() {
            return Ok(ids);
        }
        let long = self
            .text
            .as_ref()
            .is_some_and(|t| t.text.len() > TOKENIZE_INLINE_BYTES);
        if !long {
            return self.ids_now();
        }
        let this = self.clone();
        let ids = tokio::task::spawn_blocking(move || this.encode())
            .await
            .unwrap_or_else(|e| Err(PromptError::Tokenize(format!("cancelled: {e}"))))?;
        Ok(self.ids.get_or_init(|| ids))
    }

    fn encode(&self) -> Result<Vec<u32>, PromptError> {
        // A prompt built from ids always has them: only a text prompt gets here.
        let Some(pending) = &self.text else {
            return Ok(Vec::new());
        };
        let ids = tokenize(&pending.tokenizer, &pending.text).map_err(PromptError::Tokenize)?;
        if ids.is_empty() {
            return Err(PromptError::Empty);
        }
        Ok(ids)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokenizer() -> Arc<PromptTokenizer> {
        Arc::new(PromptTokenizer::byte_level().expect("the embedded tokenizer loads"))
    }

    #[test]
    fn a_text_prompt_is_tokenized_once_when_first_needed() {
        let prompt = RoutePrompt::from_text("hello".to_owned(), tokenizer());
        assert_eq!(
            prompt.known_len(),
            None,
            "nothing tokenized before a reader asks"
        );
        let copy = prompt.clone();
        assert_eq!(prompt.ids_now(), Ok(&b"hello".map(u32::from)[..]));
        assert_eq!(prompt.known_len(), Some(5));
        // A clone made before shares the text, not the ids: each request has one prompt.
        assert_eq!(copy.known_len(), None);
    }

    #[tokio::test]
    async fn a_long_text_is_tokenized_off_the_async_worker() {
        let text = "a".repeat(TOKENIZE_INLINE_BYTES + 1);
        let prompt = RoutePrompt::from_text(text, tokenizer());
        assert_eq!(
            prompt.ids().await.map(<[u32]>::len),
            Ok(TOKENIZE_INLINE_BYTES + 1)
        );
    }

    #[test]
    fn ids_given_are_never_tokenized() {
        let prompt = RoutePrompt::from_ids(vec![1, 2, 3]);
        assert_eq!(prompt.known(), Some(&[1, 2, 3][..]));
    }
}
