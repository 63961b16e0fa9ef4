//! Why a configuration is refused: each error names where the bad value came from (a flag, an
//! environment variable, or a key and line of the file), before any port is bound.

use std::path::PathBuf;
use std::time::Duration;

use super::source::{Source, Sourced};
use crate::RetryPolicyError;

/// Why the configuration is unusable.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {}: {source}", path.display())]
    ReadFile {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The file is not TOML.
    #[error("{} line {line}: {reason}", path.display())]
    Syntax {
        path: PathBuf,
        line: usize,
        reason: String,
    },
    #[error("{at}: unknown key (the keys here are {})", expected.join(", "))]
    UnknownKey {
        at: Source,
        expected: Vec<&'static str>,
    },
    /// One setting's value is refused, for a reason of its own.
    #[error("{at}: {problem}")]
    Invalid { at: Source, problem: Problem },
    #[error(
        "no endpoints: give --endpoint URL (repeatable), [[endpoints]] in --config, or --discovery"
    )]
    NoEndpoints,
    #[error(
        "{kind} (k8s) needs a label selector or an InferencePool: --k8s-selector (e.g. \
         app=engine) or --k8s-inference-pool, or k8s_selector or k8s_inference_pool in [discovery]"
    )]
    NoSelector { kind: Source },
    #[error(
        "{selector} and {pool}: pods are picked by a label selector or an InferencePool, not both"
    )]
    SelectorAndPool { selector: Source, pool: Source },
    #[error("{0} needs --discovery k8s")]
    K8sWithoutDiscovery(Source),
    #[error("{0} (k8s): this switchyard was built without the `k8s` feature")]
    DiscoveryNotBuilt(Source),
    #[error(
        "{at}: endpoint {index}{}: {reason}",
        url.as_ref().map(|url| format!(" ({url:?})")).unwrap_or_default()
    )]
    BadEndpoint {
        at: Source,
        index: usize,
        /// `None` when the entry did not even parse.
        url: Option<String>,
        reason: String,
    },
    #[error("{given} needs --{needs} (or its key in the config file) too")]
    TlsPair { given: Source, needs: &'static str },
    #[error("endpoint {index} ({url:?}): its TLS files cannot be used: {reason}")]
    EngineTls {
        index: usize,
        url: String,
        reason: String,
    },
    #[error(
        "--endpoint-num-gpus: {given} values for {endpoints} endpoints (give one per --endpoint)"
    )]
    NumGpusCount { given: usize, endpoints: usize },
    #[error(
        "{} ({}) must be below the context length, {} ({})",
        max_prompt_tokens.source,
        max_prompt_tokens.value,
        context_length.value,
        context_length.source
    )]
    PromptNotBelowContext {
        max_prompt_tokens: Sourced<u32>,
        context_length: Sourced<u32>,
    },
    #[error(
        "{} ({:?}) must be at most {} ({:?})",
        base.source, base.value, max.source, max.value
    )]
    Ejection {
        base: Sourced<Duration>,
        max: Sourced<Duration>,
    },
    #[error(
        "{} ({}) is the main port ({}); give another one or leave it out",
        admin_port.source, admin_port.value, port
    )]
    AdminPort {
        admin_port: Sourced<u16>,
        port: Source,
    },
    #[error(
        "{} ({}) is more than the {endpoints} endpoints configured",
        wanted.source, wanted.value
    )]
    MinHealthy {
        wanted: Sourced<usize>,
        endpoints: usize,
    },
    #[error(transparent)]
    Traces(#[from] crate::telemetry::TelemetryError),
    #[error(
        "{again}: model {name:?} is already given by {first}: give each model once, as a \
         [[models]] entry or by its shorthand (model, model_dir, [model_policies])"
    )]
    ModelTwice {
        name: String,
        first: Source,
        again: Source,
    },
}

/// What is wrong with one value.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Problem {
    /// The file's value is not of the setting's kind (a string for a number, a number out of
    /// range, text that is no duration, an unknown name): the parser's words.
    #[error("{0}")]
    Value(String),
    #[error("must be at least {0}")]
    AtLeast(u32),
    #[error("{value} is not from {low} to {high}")]
    OutOfRange { value: u32, low: u32, high: u32 },
    #[error("must be longer than zero")]
    ZeroDuration,
    #[error("must be at most {0:?}: a longer spin keeps a core busy for nothing")]
    SpinTooLong(std::time::Duration),
    #[error("{0} is not a number from 0 to 100")]
    NotAPercentage(f64),
    #[error("{0} is not a share above 0 and at most 1")]
    NotAShare(f64),
    #[error("must not be empty")]
    Empty,
    #[error("{0:?} is not a header name")]
    HeaderName(String),
    #[error("tenant {tenant:?}: weight {weight} is not a number above 0")]
    Weight { tenant: String, weight: f64 },
    #[error("not valid JSON: {0}")]
    Json(String),
    #[error(transparent)]
    Retry(#[from] RetryPolicyError),
    #[error("{0:?} is not a policy name: a policy name is a file stem in the plugins directory")]
    PolicyName(String),
    #[error(
        "policy {name:?}: {} does not exist (build the built-in policies with `make plugins`)",
        path.display()
    )]
    NoPolicy { name: String, path: PathBuf },
    #[error("{}: not a usable GGUF: {reason}", path.display())]
    NotAGguf { path: PathBuf, reason: String },
    #[error("{}: neither a GGUF file nor a directory with a tokenizer.json", .0.display())]
    NoTokenizer(PathBuf),
}
