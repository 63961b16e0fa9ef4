//! Tokenizer assets and prompt rendering, shared by the router (which tokenizes to route) and the
//! reference engine (which tokenizes to serve): both must turn one prompt into the same ids.
//!
//! - The reference model's tokenizer: byte-level, ids 0..=255 are the bytes themselves, and
//!   `<|eos|>` (id 256) is the only special token. Stored as a standard `tokenizer.json` so the
//!   router (and any Hugging Face tooling) loads it like a real model's.
//! - [`PromptTokenizer`]: a model's `tokenizer.json` (or a GGUF's tokenizer, or the embedded
//!   byte-level one) and, for chat, the model's chat template from `tokenizer_config.json` (or
//!   the GGUF's metadata).
//!
//! Prompts are encoded without special tokens, as MLC's router does: the router needs the
//! prompt length in the engine's tokens, and the engine adds nothing of its own.
//!
//! Chat messages are rendered with the template (minijinja, Jinja2-compatible) with
//! `messages`, `add_generation_prompt = true`, `bos_token` and `eos_token` in scope. A model
//! without a template gets the default rendering `<|role|>\ncontent\n` per message followed by
//! `<|assistant|>\n`.

use std::path::Path;
use std::sync::Arc;

use tokenizers::Tokenizer;

use crate::gguf::ModelFiles;

/// The `tokenizer.json` of the reference model.
pub const BYTE_LEVEL_TOKENIZER_JSON: &[u8] = include_bytes!("../assets/byte-level/tokenizer.json");

/// Its `tokenizer_config.json` (EOS token and a minimal chat template).
pub const BYTE_LEVEL_TOKENIZER_CONFIG_JSON: &[u8] =
    include_bytes!("../assets/byte-level/tokenizer_config.json");

/// Loads the reference model's tokenizer.
pub fn byte_level_tokenizer() -> Tokenizer {
    // The file is part of this crate and its tests load it: failing here is a build defect.
    Tokenizer::from_bytes(BYTE_LEVEL_TOKENIZER_JSON)
        .expect("the embedded byte-level tokenizer.json is valid")
}

/// The rendering used when a model ships no chat template.
pub const DEFAULT_CHAT_TEMPLATE: &str = "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}";

/// Why a model directory's tokenizer could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("cannot load tokenizer {path}: {reason}")]
    Load { path: String, reason: String },
    #[error("cannot read {path}: {reason}")]
    Config { path: String, reason: String },
    #[error("the chat template in {path} does not compile: {reason}")]
    Template { path: String, reason: String },
}

/// One chat message, content already flattened to text.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    /// A request's `messages`, flattened: a content list keeps its text parts, joined. The
    /// router and the reference engine read them alike, so both render the same prompt. The
    /// error says what is wrong with `messages`.
    pub fn read_all(messages: &serde_json::Value) -> Result<Vec<ChatMessage>, &'static str> {
        use serde_json::Value;
        let Value::Array(items) = messages else {
            return Err("messages must be a list of messages");
        };
        if items.is_empty() {
            return Err("messages must not be empty");
        }
        items
            .iter()
            .map(|m| {
                let role = m
                    .get("role")
                    .and_then(Value::as_str)
                    .ok_or("every message needs a string role")?;
                let content = match m.get("content") {
                    None | Some(Value::Null) => String::new(),
                    Some(Value::String(s)) => s.clone(),
                    Some(Value::Array(parts)) => parts
                        .iter()
                        .filter(|p| p.get("type").and_then(Value::as_str) == Some("text"))
                        .filter_map(|p| p.get("text").and_then(Value::as_str))
                        .collect(),
                    Some(_) => return Err("message content must be a string or a list of parts"),
                };
                Ok(ChatMessage {
                    role: role.to_owned(),
                    content,
                })
            })
            .collect()
    }
}

/// Tokenizer plus chat template of the served model.
pub struct PromptTokenizer {
    tokenizer: Arc<Tokenizer>,
    chat: minijinja::Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for PromptTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PromptTokenizer").finish_non_exhaustive()
    }
}

#[derive(Debug, Default, serde::Deserialize)]
struct TokenizerConfig {
    chat_template: Option<serde_json::Value>,
    bos_token: Option<serde_json::Value>,
    eos_token: Option<serde_json::Value>,
}

impl PromptTokenizer {
    /// The reference engine's byte-level tokenizer and template.
    pub fn byte_level() -> Result<Self, TokenizerError> {
        let config: TokenizerConfig = serde_json::from_slice(BYTE_LEVEL_TOKENIZER_CONFIG_JSON)
            .map_err(|e| TokenizerError::Config {
                path: "<embedded>".into(),
                reason: e.to_string(),
            })?;
        Self::assemble(Arc::new(byte_level_tokenizer()), config, "<embedded>")
    }

    /// A GGUF model's tokenizer and chat template, read from its metadata (`path` names the
    /// file in errors).
    pub fn from_gguf(files: &ModelFiles, path: &Path) -> Result<Self, TokenizerError> {
        let path = path.display().to_string();
        let tokenizer = files.tokenizer().map_err(|e| TokenizerError::Load {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        let config = serde_json::from_str(&files.tokenizer_config_json).map_err(|e| {
            TokenizerError::Config {
                path: path.clone(),
                reason: e.to_string(),
            }
        })?;
        Self::assemble(Arc::new(tokenizer), config, &path)
    }

    /// `DIR/tokenizer.json`, and `DIR/tokenizer_config.json` when present.
    pub fn from_model_dir(dir: &Path) -> Result<Self, TokenizerError> {
        let path = dir.join("tokenizer.json");
        let tokenizer = Tokenizer::from_file(&path).map_err(|e| TokenizerError::Load {
            path: path.display().to_string(),
            reason: e.to_string(),
        })?;
        let config_path = dir.join("tokenizer_config.json");
        let config = match std::fs::read(&config_path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| TokenizerError::Config {
                path: config_path.display().to_string(),
                reason: e.to_string(),
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => TokenizerConfig::default(),
            Err(e) => {
                return Err(TokenizerError::Config {
                    path: config_path.display().to_string(),
                    reason: e.to_string(),
                });
            }
        };
        Self::assemble(
            Arc::new(tokenizer),
            config,
            &config_path.display().to_string(),
        )
    }

    fn assemble(
        tokenizer: Arc<Tokenizer>,
        config: TokenizerConfig,
        path: &str,
    ) -> Result<Self, TokenizerError> {
        let template = match config.chat_template {
            Some(serde_json::Value::String(t)) => t,
            // A list of named templates: use "default".
            Some(serde_json::Value::Array(named)) => named
                .iter()
                .find(|t| t["name"] == "default")
                .and_then(|t| t["template"].as_str())
                .unwrap_or(DEFAULT_CHAT_TEMPLATE)
                .to_owned(),
            _ => DEFAULT_CHAT_TEMPLATE.to_owned(),
        };
        let mut chat = minijinja::Environment::new();
        chat.add_function(
            "raise_exception",
            |message: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    message,
                ))
            },
        );
        chat.add_template_owned("chat", template)
            .map_err(|e| TokenizerError::Template {
                path: path.to_owned(),
                reason: e.to_string(),
            })?;
        Ok(PromptTokenizer {
            tokenizer,
            chat,
            bos_token: token_text(config.bos_token),
            eos_token: token_text(config.eos_token),
        })
    }

    /// The tokenizer, shared with whoever re-tokenizes text (the router's retry loop).
    pub fn tokenizer(&self) -> Arc<Tokenizer> {
        self.tokenizer.clone()
    }

    /// Token ids below this are in the vocabulary (added tokens included).
    pub fn vocab_size(&self) -> u32 {
        u32::try_from(self.tokenizer.get_vocab_size(true)).unwrap_or(u32::MAX)
    }

    /// Token ids of `text`, without special tokens.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        // `encode_fast` skips the character offsets, which nobody here reads: the same
        // ids for a fraction of the allocations.
        self.tokenizer
            .encode_fast(text, false)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| e.to_string())
    }

    /// The prompt text for a chat conversation.
    pub fn render_chat(&self, messages: &[ChatMessage]) -> Result<String, String> {
        let template = self.chat.get_template("chat").map_err(|e| e.to_string())?;
        template
            .render(minijinja::context! {
                messages => messages,
                add_generation_prompt => true,
                bos_token => &self.bos_token,
                eos_token => &self.eos_token,
            })
            .map_err(|e| e.to_string())
    }
}

/// `bos_token`/`eos_token` are a string or an `AddedToken` object with `content`.
fn token_text(value: Option<serde_json::Value>) -> String {
    match value {
        Some(serde_json::Value::String(s)) => s,
        Some(serde_json::Value::Object(o)) => o
            .get("content")
            .and_then(|c| c.as_str())
            .unwrap_or_default()
            .to_owned(),
        _ => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encode(t: &Tokenizer, text: &str) -> Vec<u32> {
        t.encode(text, false).unwrap().get_ids().to_vec()
    }

    #[test]
    fn ascii_ids_are_the_bytes() {
        let t = byte_level_tokenizer();
        let text = " Hello, world!\n\t~ 0123 ";
        assert_eq!(
            encode(&t, text),
            text.bytes().map(u32::from).collect::<Vec<_>>()
        );
        assert_eq!(t.get_vocab_size(true), 257);
        assert_eq!(t.token_to_id("<|eos|>"), Some(256));
    }

    #[test]
    fn arbitrary_utf8_round_trips() {
        let t = byte_level_tokenizer();
        for text in [
            "",
            "héllo wörld",
            "日本語のテキスト",
            "emoji 🦀🚀 mixed\u{0}\u{7f}",
            "  two  spaces  ",
        ] {
            let ids = encode(&t, text);
            assert_eq!(
                ids,
                text.bytes().map(u32::from).collect::<Vec<_>>(),
                "{text:?}"
            );
            assert_eq!(t.decode(&ids, false).unwrap(), text);
        }
        // Every byte value is its own token.
        let all: Vec<u32> = (0..256).collect();
        let decoded = t.decode(&all, false).unwrap();
        assert!(!decoded.is_empty());
    }

    #[test]
    fn special_tokens_are_not_added_or_split_from_plain_text() {
        let t = byte_level_tokenizer();
        assert_eq!(encode(&t, "a<|eos|>").first(), Some(&97));
        assert_eq!(t.decode(&[104, 105, 256], true).unwrap(), "hi");
        let config: serde_json::Value =
            serde_json::from_slice(BYTE_LEVEL_TOKENIZER_CONFIG_JSON).unwrap();
        assert_eq!(config["eos_token"], "<|eos|>");
    }

    #[test]
    fn byte_level_prompts_are_one_token_per_byte_and_round_trip() {
        let t = PromptTokenizer::byte_level().expect("embedded tokenizer loads");
        let ids = t.encode("Hello, world").expect("encodes");
        assert_eq!(ids.len(), "Hello, world".len());
        assert_eq!(ids[0], u32::from(b'H'));
    }

    #[test]
    fn chat_renders_with_the_template() {
        let t = PromptTokenizer::byte_level().expect("embedded tokenizer loads");
        let text = t
            .render_chat(&[
                ChatMessage {
                    role: "system".into(),
                    content: "Be brief.".into(),
                },
                ChatMessage {
                    role: "user".into(),
                    content: "Hi".into(),
                },
            ])
            .expect("renders");
        assert_eq!(text, "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n");
    }
}
