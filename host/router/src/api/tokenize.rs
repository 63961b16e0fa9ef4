//! Prompts to token ids: the tokenizer and chat template live in `switchyard-wire`
//! ([`switchyard_wire::tokenizer`]), shared with the reference engine, which must render chat
//! prompts exactly as the router does.

use tokenizers::pre_tokenizers::PreTokenizerWrapper;

pub use switchyard_wire::tokenizer::{
    ChatMessage, DEFAULT_CHAT_TEMPLATE, PromptTokenizer, TokenizerError,
};

/// The most tokens `text` can encode to with `tokenizer`, without encoding it: its length in
/// bytes, for a byte-level tokenizer with no normalizer (GPT-2's family: Llama 3, Qwen, SmolLM,
/// the reference engine's). Such a tokenizer maps each byte to one symbol and every token is one
/// or more symbols (an added token matched in the text is one or more bytes of it), and prompts
/// are encoded without special tokens. `None` for any other tokenizer: a normalizer may expand
/// a character (NFKC turns one into up to 18), and SentencePiece adds word markers.
pub fn tokens_at_most(tokenizer: &PromptTokenizer, text: &str) -> Option<u64> {
    let tokenizer = tokenizer.tokenizer();
    if tokenizer.get_normalizer().is_some() {
        return None;
    }
    byte_level(tokenizer.get_pre_tokenizer()?).then_some(text.len() as u64)
}

/// A pre-tokenizer that ends in byte-level symbols and adds none: `ByteLevel`, alone or after
/// splits (which cut the text without changing it).
fn byte_level(pre: &PreTokenizerWrapper) -> bool {
    match pre {
        PreTokenizerWrapper::ByteLevel(_) => true,
        PreTokenizerWrapper::Sequence(steps) => {
            let steps: &[PreTokenizerWrapper] = steps.as_ref();
            steps
                .iter()
                .any(|s| matches!(s, PreTokenizerWrapper::ByteLevel(_)))
                && steps.iter().all(|s| {
                    matches!(
                        s,
                        PreTokenizerWrapper::ByteLevel(_)
                            | PreTokenizerWrapper::Split(_)
                            | PreTokenizerWrapper::Digits(_)
                            | PreTokenizerWrapper::Punctuation(_)
                    )
                })
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_byte_level_tokenizer_bounds_a_text_by_its_bytes() {
        let tokenizer = PromptTokenizer::byte_level().expect("the embedded tokenizer loads");
        let text = "naïve <|eos|> text";
        let bound = tokens_at_most(&tokenizer, text).expect("byte-level");
        let ids = tokenizer.encode(text).expect("encodes");
        assert_eq!(bound, text.len() as u64);
        assert!(ids.len() as u64 <= bound, "{} > {bound}", ids.len());
    }
}
