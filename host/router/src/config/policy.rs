//! Which policy plans a request: the default one, the fallback, the file's model → policy
//! map and the `x-switchyard-policy` header; what a policy sees; when it is quarantined.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use switchyard_policy_host::QuarantineRule;

use super::error::{ConfigError, Problem};
use super::settings::{DEFAULT_FALLBACK_POLICY, NO_FALLBACK, RouterSettings};
use super::source::Sourced;

/// How requests find their policy, and what happens when it faults.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicySettings {
    pub fallback: Option<String>,
    /// Model name → policy name.
    pub models: BTreeMap<String, String>,
    /// Whether `x-switchyard-policy` may select a policy.
    pub header: bool,
    /// The request headers policies see (lower-case names).
    pub forward_headers: Vec<String>,
    pub quarantine: QuarantineRule,
}

impl PolicySettings {
    /// Fallback, per-model mapping, header switch and quarantine rule. The default fallback
    /// may be missing from the plugins directory (faults then fail their requests); one named
    /// explicitly must exist.
    pub(super) fn new(
        settings: &RouterSettings,
        models: BTreeMap<String, Sourced<String>>,
    ) -> Result<PolicySettings, ConfigError> {
        let plugins = &settings.plugins.value;
        let fallback = match &settings.fallback_policy {
            Some(name) if name.value == NO_FALLBACK => None,
            Some(name) => {
                existing(plugins, name)?;
                Some(name.value.clone())
            }
            None => Some(DEFAULT_FALLBACK_POLICY.to_owned()),
        };
        for policy in models.values() {
            existing(plugins, policy)?;
        }
        Ok(PolicySettings {
            fallback,
            models: models
                .into_iter()
                .map(|(model, policy)| (model, policy.value))
                .collect(),
            header: !settings.no_policy_header.value,
            forward_headers: settings
                .forward_headers
                .value
                .iter()
                .map(|name| name.to_ascii_lowercase())
                .collect(),
            quarantine: QuarantineRule {
                faults: settings.quarantine_faults.value,
                window: Duration::from_millis(settings.quarantine_window_ms.value),
            },
        })
    }
}

/// `<plugins>/<name>.wasm`, if `name` is a plain file stem and the file exists.
pub(super) fn existing(plugins: &Path, name: &Sourced<String>) -> Result<PathBuf, ConfigError> {
    let refuse = |problem| ConfigError::Invalid {
        at: name.source.clone(),
        problem,
    };
    let stem = &name.value;
    if stem.is_empty() || stem.contains(['/', '\\']) || stem.starts_with('.') {
        return Err(refuse(Problem::PolicyName(stem.clone())));
    }
    let path = path(plugins, stem);
    if !path.is_file() {
        return Err(refuse(Problem::NoPolicy {
            name: stem.clone(),
            path,
        }));
    }
    Ok(path)
}

/// Where policy `name`'s component is.
pub(super) fn path(plugins: &Path, name: &str) -> PathBuf {
    plugins.join(format!("{name}.wasm"))
}

/// The default policy's config as compact JSON.
pub(super) fn compact_json(text: &Sourced<String>) -> Result<String, ConfigError> {
    match serde_json::from_str::<serde_json::Value>(&text.value) {
        Ok(value) => Ok(value.to_string()),
        Err(e) => Err(ConfigError::Invalid {
            at: text.source.clone(),
            problem: Problem::Json(e.to_string()),
        }),
    }
}
