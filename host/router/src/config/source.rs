//! Where a setting's value came from, kept beside the value until the configuration is checked,
//! so that an error names the flag, the environment variable or the file's line to fix.

use std::path::Path;
use std::sync::Arc;

/// Where one value came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// A command-line flag, named without its dashes (`max-body-bytes`).
    Flag(&'static str),
    /// An environment variable clap reads when the flag is absent.
    Env(&'static str),
    File(Box<FileKey>),
    /// The context length in a GGUF's metadata (`--model-dir`).
    Gguf(Arc<Path>),
    /// Nothing gave the setting whose flag this is: its default applies.
    Default(&'static str),
}

impl Source {
    /// A flag's value, or the environment variable's when it holds the same text: clap puts
    /// the variable's value in the flag's place when the flag is absent, and does not say
    /// which it did. A flag given the variable's very text is reported as the variable, which
    /// is as true of the value.
    pub(super) fn flag_or_env(flag: &'static str, env: &'static str, value: &str) -> Source {
        if std::env::var_os(env).is_some_and(|from_env| from_env == value) {
            Source::Env(env)
        } else {
            Source::Flag(flag)
        }
    }
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Source::Flag(flag) => write!(f, "--{flag}"),
            Source::Env(name) => write!(f, "{name} in the environment"),
            Source::File(at) => write!(f, "{} in {} line {}", at.key, at.path.display(), at.line),
            Source::Gguf(path) => write!(f, "the context length of {}", path.display()),
            Source::Default(flag) => write!(f, "the default --{flag}"),
        }
    }
}

/// A key of the `--config` file (`discovery.k8s_resync` for a key in a table), and the line
/// it is on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileKey {
    pub path: Arc<Path>,
    pub line: usize,
    pub key: String,
}

/// A value and where it came from.
#[derive(Debug, Clone, PartialEq)]
pub struct Sourced<T> {
    pub value: T,
    pub source: Source,
}

impl<T> Sourced<T> {
    pub fn new(value: T, source: Source) -> Self {
        Sourced { value, source }
    }
}
