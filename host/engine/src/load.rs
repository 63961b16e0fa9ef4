//! Model loading: `--model` names the synthetic model or a llama-family GGUF, which is loaded
//! with its tokenizer, chat template and vocabulary.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use switchyard_kv::KvShape;
use switchyard_wire::gguf::GgufMetadata;
use switchyard_wire::tokenizer::PromptTokenizer;

use crate::args::ModelShape;
use crate::error::EngineError;
use crate::llama::{Llama, LlamaError};
use crate::scheduler::{LlamaModel, ModelSpec};

/// The model an engine runs, with its tokenizer and the name it reports by default.
pub(crate) struct LoadedModel {
    pub spec: ModelSpec,
    pub tokenizer: tokenizers::Tokenizer,
    /// The tokenizer with the model's chat template: how `/v1/chat/completions` renders
    /// `messages`, exactly as the router does.
    pub prompts: PromptTokenizer,
    pub default_name: String,
}

impl LoadedModel {
    /// The pool slot shape: the real model's, or the synthetic one's as `--model-shape` says.
    pub fn kv_shape(&self, synthetic: ModelShape) -> KvShape {
        match &self.spec {
            ModelSpec::Synthetic => synthetic.kv_shape(),
            ModelSpec::Llama(m) => m.llama.config().kv_shape(),
        }
    }

    /// The real model's context length (the synthetic model has no limit).
    pub fn max_model_len(&self) -> Option<usize> {
        match &self.spec {
            ModelSpec::Synthetic => None,
            ModelSpec::Llama(m) => Some(m.llama.config().context),
        }
    }
}

/// The GGUF `--model` names: `smollm2` is the cached SmolLM2, anything else but `synthetic`
/// a path.
pub fn model_path(model: &str) -> Option<PathBuf> {
    match model {
        "synthetic" => None,
        "smollm2" => Some(
            switchyard_wire::gguf::smollm2_path()
                .unwrap_or_else(|| PathBuf::from(switchyard_wire::gguf::SMOLLM2_FILE)),
        ),
        path => Some(PathBuf::from(path)),
    }
}

/// What to add to an error about `--model`: how to fetch it, where fetching is ours to do.
pub fn fetch_hint(model: &str) -> &'static str {
    if model == "smollm2" {
        " (run `make model` to fetch it)"
    } else {
        ""
    }
}

pub(crate) async fn load_model(model: &str) -> Result<LoadedModel, EngineError> {
    let Some(path) = model_path(model) else {
        return Ok(LoadedModel {
            spec: ModelSpec::Synthetic,
            tokenizer: switchyard_wire::tokenizer::byte_level_tokenizer(),
            prompts: PromptTokenizer::byte_level().map_err(|e| EngineError::Model {
                model: model.into(),
                reason: e.to_string(),
            })?,
            default_name: "switchyard-reference".into(),
        });
    };
    let fail = |reason: String| EngineError::Model {
        model: path.display().to_string(),
        reason: format!("{reason}{}", fetch_hint(model)),
    };
    let load_path = path.clone();
    // Loading requantizes every weight: seconds of CPU, off the async threads.
    let loaded = tokio::task::spawn_blocking(move || load_gguf(&load_path))
        .await
        .map_err(|e| fail(e.to_string()))?;
    let (model, tokenizer) = loaded.map_err(|e| fail(e.to_string()))?;
    let prompts = GgufMetadata::read(&path)
        .map_err(|e| e.to_string())
        .and_then(|meta| meta.model_files().map_err(|e| e.to_string()))
        .and_then(|files| PromptTokenizer::from_gguf(&files, &path).map_err(|e| e.to_string()))
        .map_err(fail)?;
    Ok(LoadedModel {
        spec: ModelSpec::Llama(Arc::new(model)),
        tokenizer,
        prompts,
        default_name: switchyard_wire::gguf::served_name(&path),
    })
}

/// The GGUF at `path` with its tokenizer, and what the core needs beside the weights: each
/// token's bytes and the ids that end a generation.
fn load_gguf(path: &Path) -> Result<(LlamaModel, tokenizers::Tokenizer), LlamaError> {
    let meta = GgufMetadata::read(path)?;
    let tokenizer = meta.model_files()?.tokenizer()?;
    let vocabulary = meta.vocabulary()?;
    let llama = Llama::load(path, &meta)?;
    let model = LlamaModel {
        llama,
        token_bytes: vocabulary.token_bytes,
        eos: vocabulary.stop_ids,
    };
    Ok((model, tokenizer))
}

/// SmolLM2 from the cache `make model` fills, loaded once per test binary.
#[cfg(test)]
pub(crate) fn test_smollm2() -> &'static (Arc<LlamaModel>, tokenizers::Tokenizer) {
    static MODEL: std::sync::OnceLock<(Arc<LlamaModel>, tokenizers::Tokenizer)> =
        std::sync::OnceLock::new();
    MODEL.get_or_init(|| {
        let path = switchyard_wire::gguf::smollm2_path().expect("HOME or SWITCHYARD_CACHE");
        let (model, tokenizer) =
            load_gguf(&path).unwrap_or_else(|e| panic!("{e}: run `make model` to fetch SmolLM2"));
        (Arc::new(model), tokenizer)
    })
}
