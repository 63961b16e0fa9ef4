use super::*;

/// The GGUF `make model` fetched; the tests that need it say how to get it.
fn smollm2() -> GgufMetadata {
    let path = smollm2_path().expect("HOME or SWITCHYARD_CACHE is set");
    GgufMetadata::read(&path)
        .unwrap_or_else(|e| panic!("{e}: run `make model` to fetch SmolLM2 into the cache"))
}

#[test]
fn cache_dir_follows_switchyard_then_xdg_then_home() {
    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        move |key: &str| {
            pairs
                .iter()
                .find(|(k, _)| *k == key)
                .map(|(_, v)| (*v).to_owned())
        }
    }
    let all = [
        ("SWITCHYARD_CACHE", "/c"),
        ("XDG_CACHE_HOME", "/x"),
        ("HOME", "/h"),
    ];
    assert_eq!(model_cache_dir(env(&all)), Some("/c".into()));
    assert_eq!(
        model_cache_dir(env(&all[1..])),
        Some("/x/switchyard".into())
    );
    assert_eq!(
        model_cache_dir(env(&[("XDG_CACHE_HOME", ""), ("HOME", "/h")])),
        Some("/h/.cache/switchyard".into())
    );
    assert_eq!(model_cache_dir(env(&[])), None);
}

#[test]
fn smollm2_metadata() {
    let meta = smollm2();
    assert_eq!(meta.architecture().unwrap(), "llama");
    assert_eq!(meta.arch_uint("block_count").unwrap(), 30);
    assert_eq!(meta.arch_uint("context_length").unwrap(), 8192);
    assert_eq!(meta.tensor_count, 272);
    assert!(meta.str("general.architecture").is_ok());
    assert!(matches!(
        meta.uint("general.name"),
        Err(GgufError::Key { .. })
    ));
}

#[test]
fn smollm2_tokenizer_matches_the_reference_ids() {
    let files = smollm2().model_files().unwrap();
    let tokenizer = files.tokenizer().unwrap();
    let encode = |text: &str| tokenizer.encode(text, false).unwrap().get_ids().to_vec();
    assert_eq!(
        encode("The capital of France is"),
        [504, 3575, 282, 4649, 314]
    );
    // Digits split one by one (SmolLM's pre-tokenizer), control tokens stay whole.
    let ids = encode("<|im_start|>user\n2024");
    assert_eq!(ids[0], 1);
    assert_eq!(ids.len(), 1 + encode("user\n").len() + 4);
    for text in ["héllo wörld 🦀", "  two  spaces\n\ttab", "x = 3.14159"] {
        let ids = encode(text);
        assert_eq!(tokenizer.decode(&ids, false).unwrap(), text);
    }
    assert_eq!(files.eos_id, Some(2));
    assert_eq!(files.context_length, Some(8192));
    let config: serde_json::Value = serde_json::from_str(&files.tokenizer_config_json).unwrap();
    assert_eq!(config["eos_token"], "<|im_end|>");
    assert!(
        config["chat_template"]
            .as_str()
            .unwrap()
            .contains("<|im_start|>")
    );
}

#[test]
fn not_a_gguf_file_is_a_format_error() {
    let path = std::env::temp_dir().join(format!("not-gguf-{}", std::process::id()));
    std::fs::write(&path, b"GGML\x03\0\0\0").unwrap();
    let err = GgufMetadata::read(&path).unwrap_err();
    std::fs::remove_file(&path).unwrap();
    assert!(matches!(err, GgufError::Format { .. }), "{err}");
}

#[test]
fn smollm2_vocabulary_spells_what_the_tokenizer_encodes() {
    let meta = smollm2();
    let tokenizer = meta.model_files().unwrap().tokenizer().unwrap();
    let vocab = meta.vocabulary().unwrap();
    // Byte-level symbols (Ġ for a space, Ċ for a newline, a character split into its bytes)
    // decode to the bytes they stand for.
    for text in ["The capital of France is", "héllo wörld 🦀\n\tx = 3.14159"] {
        let ids = tokenizer.encode(text, false).unwrap();
        let bytes: Vec<u8> = ids
            .get_ids()
            .iter()
            .flat_map(|&id| vocab.token_bytes[id as usize].iter().copied())
            .collect();
        assert_eq!(bytes, text.as_bytes());
    }
    // The EOS (`<|im_end|>`) first, then the control token `<|endoftext|>`, which is never
    // streamed.
    let endoftext = tokenizer.token_to_id("<|endoftext|>").unwrap();
    assert_eq!(vocab.stop_ids, [2, endoftext]);
    assert!(vocab.token_bytes[endoftext as usize].is_empty());
    assert_eq!(vocab.token_bytes.len(), tokenizer.get_vocab_size(true));
}
