//! The reference model's tokenizer: byte-level, ids 0..=255 are the bytes themselves, and
//! `<|eos|>` (id 256) is the only special token. Stored as a standard `tokenizer.json` so the
//! router (and any Hugging Face tooling) loads it like a real model's.

use tokenizers::Tokenizer;

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
}
