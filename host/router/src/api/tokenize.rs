//! Prompts to token ids: the tokenizer and chat template live in `switchyard-wire`
//! ([`switchyard_wire::tokenizer`]), shared with the reference engine, which must render chat
//! prompts exactly as the router does.

pub use switchyard_wire::tokenizer::{
    ChatMessage, DEFAULT_CHAT_TEMPLATE, PromptTokenizer, TokenizerError,
};
