//! The served models: each one's name, where its tokenizer and chat template come from
//! (`[[models]]`' `model_dir`, or the shorthand `--model-dir`), the policy that plans its
//! requests, and the context length when a GGUF declares it.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use switchyard_wire::gguf::{GgufMetadata, ModelFiles, served_name};

use super::error::{ConfigError, Problem};
use super::settings::{DEFAULT_MODEL, RouterSettings};
use super::source::{Source, Sourced};
use crate::api::RequestLimits;

/// One `[[models]]` entry as the file gives it.
#[derive(Debug, Clone, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ModelEntry {
    name: String,
    /// Its tokenizer and chat template; none: the byte-level tokenizer.
    #[serde(default)]
    model_dir: Option<PathBuf>,
    /// The policy that plans its requests; none: the default policy.
    #[serde(default)]
    policy: Option<String>,
}

/// A model the router serves: its name, where its tokenizer comes from and how long its
/// requests may be.
#[derive(Debug, Clone)]
pub struct ServedModel {
    pub name: String,
    /// `None`: the byte-level tokenizer.
    pub source: Option<ModelSource>,
    pub limits: RequestLimits,
}

/// The served models: the default one (the shorthand's, `model` and `model_dir`, when either
/// is given; else the first `[[models]]` entry; else [`DEFAULT_MODEL`], byte-level), then the
/// other `[[models]]` entries. Each entry's policy joins `policies` (model → policy, where
/// `[model_policies]` put theirs). A model named twice, by two entries or by an entry and a
/// shorthand, is refused with both places.
pub(super) fn served(
    s: &RouterSettings,
    entries: Vec<Sourced<ModelEntry>>,
    policies: &mut BTreeMap<String, Sourced<String>>,
    limits: impl Fn(Option<&ModelSource>) -> Result<RequestLimits, ConfigError>,
) -> Result<(ServedModel, Vec<ServedModel>), ConfigError> {
    let shorthand = s
        .model
        .as_ref()
        .map(|name| name.source.clone())
        .or_else(|| s.model_dir.as_ref().map(|dir| dir.source.clone()));
    let mut entries = entries.into_iter();
    let (default, default_at) = match shorthand {
        Some(at) => shorthand_model(s, at, &limits)?,
        None => match entries.next() {
            Some(first) => entry_model(first, policies, &limits)?,
            None => shorthand_model(s, Source::Default("model"), &limits)?,
        },
    };
    let mut named: Vec<(String, Source)> = vec![(default.name.clone(), default_at)];
    let mut others = Vec::new();
    for entry in entries {
        if let Some((_, first)) = named.iter().find(|(name, _)| *name == entry.value.name) {
            return Err(ConfigError::ModelTwice {
                name: entry.value.name,
                first: first.clone(),
                again: entry.source,
            });
        }
        let (model, at) = entry_model(entry, policies, &limits)?;
        named.push((model.name.clone(), at));
        others.push(model);
    }
    Ok((default, others))
}

/// The model `model` and `model_dir` describe (each may be absent), given at `at`.
fn shorthand_model(
    s: &RouterSettings,
    at: Source,
    limits: &impl Fn(Option<&ModelSource>) -> Result<RequestLimits, ConfigError>,
) -> Result<(ServedModel, Source), ConfigError> {
    let source = s.model_dir.clone().map(ModelSource::open).transpose()?;
    let name = match &s.model {
        Some(name) => name.value.clone(),
        None => source
            .as_ref()
            .map_or_else(|| DEFAULT_MODEL.to_owned(), ModelSource::default_name),
    };
    let model = ServedModel {
        name,
        limits: limits(source.as_ref())?,
        source,
    };
    Ok((model, at))
}

/// A `[[models]]` entry's model, its tokenizer opened and its policy put in `policies`.
fn entry_model(
    entry: Sourced<ModelEntry>,
    policies: &mut BTreeMap<String, Sourced<String>>,
    limits: &impl Fn(Option<&ModelSource>) -> Result<RequestLimits, ConfigError>,
) -> Result<(ServedModel, Source), ConfigError> {
    let Sourced {
        value: ModelEntry {
            name,
            model_dir,
            policy,
        },
        source: at,
    } = entry;
    // `[model_policies]` is the shorthand for an entry's policy: one model, one form.
    if let Some(given) = policies.get(&name) {
        return Err(ConfigError::ModelTwice {
            name,
            first: given.source.clone(),
            again: at,
        });
    }
    if let Some(policy) = policy {
        policies.insert(name.clone(), Sourced::new(policy, at.clone()));
    }
    let source = model_dir
        .map(|dir| ModelSource::open(Sourced::new(dir, at.clone())))
        .transpose()?;
    let model = ServedModel {
        name,
        limits: limits(source.as_ref())?,
        source,
    };
    Ok((model, at))
}

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
