//! The served model: where the router's tokenizer and chat template come from (`--model-dir`),
//! the name `/v1/models` reports, and the context length when a GGUF declares it.

use std::path::PathBuf;
use std::sync::Arc;

use switchyard_wire::gguf::{GgufMetadata, ModelFiles, served_name};

use super::error::{ConfigError, Problem};
use super::settings::DEFAULT_MODEL;
use super::source::{Source, Sourced};

/// Where the router's tokenizer and chat template come from (`--model-dir`).
#[derive(Debug, Clone)]
pub enum ModelSource {
    /// A Hugging Face-style directory: `tokenizer.json`, and `tokenizer_config.json` for chat.
    Dir(PathBuf),
    /// A GGUF file: the same, from its metadata (read once, here, without the weights).
    Gguf {
        path: PathBuf,
        files: Arc<ModelFiles>,
    },
}

impl ModelSource {
    /// A GGUF file or a directory with a `tokenizer.json`; anything else is refused here,
    /// before any port is bound.
    pub(super) fn open(path: Sourced<PathBuf>) -> Result<Self, ConfigError> {
        let Sourced {
            value: path,
            source,
        } = path;
        let refuse = |problem| ConfigError::Invalid {
            at: source.clone(),
            problem,
        };
        if path.is_file() {
            return match GgufMetadata::read(&path).and_then(|meta| meta.model_files()) {
                Ok(files) => Ok(ModelSource::Gguf {
                    files: Arc::new(files),
                    path,
                }),
                Err(e) => Err(refuse(Problem::NotAGguf {
                    reason: e.to_string(),
                    path,
                })),
            };
        }
        if !path.join("tokenizer.json").is_file() {
            return Err(refuse(Problem::NoTokenizer(path)));
        }
        Ok(ModelSource::Dir(path))
    }

    /// The name `/v1/models` reports unless `--model` says otherwise: the directory's name, or
    /// the GGUF's as the reference engine serves it.
    pub(super) fn default_name(&self) -> String {
        match self {
            ModelSource::Dir(dir) => dir
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| DEFAULT_MODEL.to_owned()),
            ModelSource::Gguf { path, .. } => served_name(path),
        }
    }

    /// The context length the GGUF declares (a directory's is not read).
    pub(super) fn context_length(&self) -> Option<Sourced<u32>> {
        match self {
            ModelSource::Dir(_) => None,
            ModelSource::Gguf { files, path } => {
                let tokens = files.context_length.and_then(|n| u32::try_from(n).ok())?;
                Some(Sourced::new(tokens, Source::Gguf(path.as_path().into())))
            }
        }
    }
}
