//! The live policies of a router: every `*.wasm` in the plugins directory, by name (the file
//! stem), each with the version serving now.
//!
//! - **Swap**: a reload compiles (cached by sha256), instantiates, runs `init(config)` and the
//!   synthetic plans of `switchyard policy check` off the request path (`spawn_blocking`), carries
//!   the old version's state over (`stateful-policy` world), and only then stores the new
//!   version (`ArcSwap`). Requests in flight keep the `Arc` of the version they started with;
//!   new requests get the new one. Any failure leaves the old version serving, with the error
//!   in [`PolicyView::last_error`], the log and the `reloads{result="failed"}` metric.
//! - **Selection**: the `x-switchyard-policy` header (unless disabled), else the request's
//!   model in the per-model mapping, else the default policy.
//! - **Fallback and quarantine**: a fault (trap, deadline, memory cap, `internal` error, invalid
//!   plan) hands the attempt to the fallback policy, so no client request fails because of a
//!   policy; [`QuarantineRule::faults`] faults within its window quarantine the version, and
//!   the fallback plans all of its requests until a new version is loaded.
//!
//! A policy's config is `<plugins>/<name>.json` when that file exists (`{}` otherwise), except
//! that an explicit config for the default policy (`--policy-config`) wins.

mod metrics;
mod selection;
mod slot;
mod stats;

#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use parking_lot::RwLock;

pub use metrics::append_registry;
pub use selection::Selection;
pub use slot::{LastReload, QuarantineRule, ReloadResult};
pub use stats::CallSummary;

use switchyard_contract::{
    Outcome, Plan, Planner, PlanningError, PolicyContext, PolicyRequest, TranslateError,
};

use super::{CheckError, Contract, ExecutorView, LoadError, PolicyHost, check};
use metrics::PolicyMetrics;
use selection::Served;
use slot::{Slot, Version};

/// The request header that selects a policy by name.
pub const POLICY_HEADER: &str = "x-switchyard-policy";

/// How the registry is set up.
#[derive(Debug, Clone)]
pub struct RegistryConfig {
    /// Where policies live (and are watched).
    pub plugins: PathBuf,
    /// The policy of requests that select none.
    pub default: String,
    /// The default policy's config; overrides `<plugins>/<default>.json`.
    pub default_config: Option<String>,
    /// Plans the attempts of a faulting or quarantined policy; `None`: such attempts fail.
    pub fallback: Option<String>,
    /// Model name → policy name.
    pub models: BTreeMap<String, String>,
    /// Whether the `x-switchyard-policy` header may select a policy.
    pub header: bool,
    pub quarantine: QuarantineRule,
}

/// Why the registry could not start.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error("cannot list the plugins directory {}: {source}", dir.display())]
    ReadDir {
        dir: PathBuf,
        source: std::io::Error,
    },
    #[error("the default policy {name:?} did not load: {reason}")]
    Default { name: String, reason: String },
    #[error("model {model:?} maps to policy {policy:?}, which is not in {}", dir.display())]
    UnknownModelPolicy {
        model: String,
        policy: String,
        dir: PathBuf,
    },
    #[error("cannot start the policy loader: {0}")]
    Join(String),
}

/// Why a reload left the previous version serving.
#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    #[error("no policy named {name:?} in {}", dir.display())]
    Unknown { name: String, dir: PathBuf },
    #[error("cannot read {}: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{} changed while it was read (still being written?)", path.display())]
    Unstable { path: PathBuf },
    #[error("config {}: not valid JSON: {reason}", path.display())]
    Config { path: PathBuf, reason: String },
    #[error(transparent)]
    Load(#[from] LoadError),
    #[error("policy {policy}: failed its check: {source}")]
    Check {
        policy: String,
        /// Boxed: a check error carries a whole plan, and reload results are passed around.
        source: Box<CheckError>,
    },
    #[error("the reload task failed: {0}")]
    Join(String),
}

/// Why no policy can plan a request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SelectError {
    /// The message names only what the client sent: which policies are loaded is the
    /// operator's business (`/admin/policies`).
    #[error("unknown policy {name:?} in {POLICY_HEADER}")]
    Unknown { name: String },
    #[error("policy {name:?} has no loaded version and there is no fallback policy")]
    Unavailable { name: String },
}

/// What a reload did.
#[derive(Debug, Clone, PartialEq)]
pub enum ReloadOutcome {
    /// A new version serves.
    Swapped { sha256: String, ms: f64 },
    /// Same bytes and config as the serving version.
    Unchanged,
    /// The file is gone and the policy was unloaded.
    Unloaded,
    /// The file is gone, but it is the default or fallback policy: the loaded version stays.
    Kept,
    /// The file is still being written; the next change event reloads it.
    InProgress,
}

/// What the registry shares with every [`Selection`].
pub(crate) struct Shared {
    pub(crate) metrics: PolicyMetrics,
    pub(crate) quarantine: QuarantineRule,
}

/// See the module docs.
pub struct PolicyRegistry {
    host: PolicyHost,
    config: RegistryConfig,
    slots: RwLock<BTreeMap<String, Arc<Slot>>>,
    shared: Arc<Shared>,
}

/// A policy as `/admin/policies` shows it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct PolicyView {
    pub name: String,
    /// sha256 of the serving version's component.
    pub sha256: Option<String>,
    /// When the serving version was loaded, in milliseconds since the Unix epoch.
    pub loaded_at: Option<u64>,
    pub source: Option<PathBuf>,
    pub language: Option<String>,
    /// The contract version of the serving version's component (`0.1.0`, `0.2.0`).
    pub contract: Option<Contract>,
    /// The serving version says it keeps no state between calls: a pool of instances serves it.
    pub stateless: Option<bool>,
    /// What the serving version reads (`prompt-length`, `outcomes`): the work the router does
    /// for it on every request.
    pub reads: Option<Vec<&'static str>>,
    /// The serving version's instances now, and the most calls they ran at once.
    #[serde(flatten)]
    pub executor: Option<ExecutorView>,
    #[serde(flatten)]
    pub calls: CallSummary,
    pub state: PolicyState,
    pub last_error: Option<String>,
    /// File change to serving, for the serving version.
    pub last_reload_ms: Option<f64>,
    /// The last reload attempt, whatever its result.
    pub last_reload: Option<LastReload>,
    pub reloads: u64,
    pub reload_failures: u64,
    pub default: bool,
    pub fallback: bool,
}

/// Whether a policy plans its requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PolicyState {
    /// A version is loaded and serving.
    Active,
    /// The serving version faulted too often; the fallback plans its requests.
    Quarantined,
    /// No version ever loaded; the fallback plans its requests.
    Failed,
}

impl PolicyRegistry {
    /// Load every policy in the plugins directory (off the async runtime). A policy that fails
    /// to load is recorded as failed, except the default policy, which must load.
    pub async fn open(
        host: PolicyHost,
        config: RegistryConfig,
    ) -> Result<Arc<PolicyRegistry>, RegistryError> {
        tokio::task::spawn_blocking(move || Self::open_blocking(host, config))
            .await
            .map_err(|e| RegistryError::Join(e.to_string()))?
    }

    fn open_blocking(
        host: PolicyHost,
        config: RegistryConfig,
    ) -> Result<Arc<PolicyRegistry>, RegistryError> {
        let registry = Arc::new(PolicyRegistry {
            host,
            slots: RwLock::new(BTreeMap::new()),
            shared: Arc::new(Shared {
                metrics: PolicyMetrics::new(),
                quarantine: config.quarantine,
            }),
            config,
        });
        for name in registry.names_on_disk()? {
            let slot = registry.slot_or_insert(&name);
            let since = Instant::now();
            let prepared = registry.prepare(&slot, true);
            // A policy that fails to load is recorded (and logged) as failed; only the default
            // must load, which `check_startup` enforces.
            let _ = registry.install(&slot, prepared, since);
        }
        registry.check_startup()?;
        Ok(registry)
    }

    /// The default policy must serve; model mappings must name policies that exist; a missing
    /// fallback only means faults fail their requests.
    fn check_startup(&self) -> Result<(), RegistryError> {
        let default = &self.config.default;
        match self.slot(default) {
            Some(slot) if slot.current().is_some() => {}
            slot => {
                let reason = slot
                    .and_then(|s| s.status.lock().last_error.clone())
                    .unwrap_or_else(|| {
                        format!("{} does not exist", self.wasm_path(default).display())
                    });
                return Err(RegistryError::Default {
                    name: default.clone(),
                    reason,
                });
            }
        }
        for (model, policy) in &self.config.models {
            if self.slot(policy).is_none() {
                return Err(RegistryError::UnknownModelPolicy {
                    model: model.clone(),
                    policy: policy.clone(),
                    dir: self.config.plugins.clone(),
                });
            }
        }
        if let Some(fallback) = &self.config.fallback
            && self.slot(fallback).and_then(|s| s.current()).is_none()
        {
            tracing::warn!(%fallback, plugins = %self.config.plugins.display(),
                "the fallback policy is not loaded: a faulting policy's requests will fail");
        }
        Ok(())
    }

    pub fn plugins_dir(&self) -> &Path {
        &self.config.plugins
    }

    pub fn default_name(&self) -> &str {
        &self.config.default
    }

    /// The planner for one request: `header` is the `x-switchyard-policy` value, if any.
    pub fn select(&self, header: Option<&str>, model: &str) -> Result<Selection, SelectError> {
        let slots = self.slots.read();
        let by_header = header.filter(|_| self.config.header);
        let slot = match by_header {
            Some(name) => slots.get(name).ok_or_else(|| SelectError::Unknown {
                name: name.to_owned(),
            })?,
            // A mapped policy whose file was deleted since startup: serve with the default.
            None => self
                .config
                .models
                .get(model)
                .and_then(|name| slots.get(name))
                .or_else(|| slots.get(&self.config.default))
                .ok_or_else(|| SelectError::Unavailable {
                    name: self.config.default.clone(),
                })?,
        };
        let served = |slot: &Arc<Slot>| {
            slot.current().map(|version| Served {
                slot: Arc::clone(slot),
                version,
                shared: Arc::clone(&self.shared),
            })
        };
        let fallback = self
            .config
            .fallback
            .as_deref()
            .filter(|&name| name != slot.name)
            .and_then(|name| slots.get(name))
            .and_then(served);
        let selected = slot.name.clone();
        match (served(slot), fallback) {
            (Some(first), fallback) => Ok(Selection::new(selected, first, fallback)),
            (None, Some(fallback)) => Ok(Selection::new(selected, fallback, None)),
            (None, None) => Err(SelectError::Unavailable { name: selected }),
        }
    }

    /// Reload `name` from its file. `force` reloads even when bytes and config are unchanged
    /// (an operator asking, or a quarantined version to be given a fresh start). `since` is
    /// when the change was noticed: the reload latency is measured from it.
    pub async fn reload(
        self: &Arc<Self>,
        name: &str,
        since: Instant,
        force: bool,
    ) -> Result<ReloadOutcome, ReloadError> {
        let slot = match self.slot(name) {
            Some(slot) => slot,
            None if self.wasm_path(name).is_file() => self.slot_or_insert(name),
            None => {
                return Err(ReloadError::Unknown {
                    name: name.to_owned(),
                    dir: self.config.plugins.clone(),
                });
            }
        };
        let _one_at_a_time = slot.reloading.lock().await;
        let registry = Arc::clone(self);
        let for_task = Arc::clone(&slot);
        let prepared = tokio::task::spawn_blocking(move || registry.prepare(&for_task, force))
            .await
            .unwrap_or_else(|e| Prepared::Failed(None, ReloadError::Join(e.to_string())));
        self.install(&slot, prepared, since)
    }

    /// Everything `/admin/policies` shows, by name.
    pub fn view(&self) -> Vec<PolicyView> {
        let slots: Vec<Arc<Slot>> = self.slots.read().values().cloned().collect();
        slots.iter().map(|slot| self.view_of(slot)).collect()
    }

    /// One policy's view, if it is known.
    pub fn view_one(&self, name: &str) -> Option<PolicyView> {
        self.slot(name).map(|slot| self.view_of(&slot))
    }

    /// Append the registry's metrics to the router's OpenMetrics exposition.
    pub fn append_metrics(&self, exposition: &mut String) {
        self.shared.metrics.append_to(exposition);
    }

    fn view_of(&self, slot: &Slot) -> PolicyView {
        let version = slot.current();
        let status = slot.status.lock();
        let info = version.as_ref().map(|v| v.policy.info());
        let state = match &version {
            None => PolicyState::Failed,
            Some(v) if v.is_quarantined() => PolicyState::Quarantined,
            Some(_) => PolicyState::Active,
        };
        PolicyView {
            name: slot.name.clone(),
            sha256: info.map(|i| i.sha256.clone()),
            loaded_at: version.as_ref().map(|v| unix_ms(v.loaded_at)),
            source: status.source.clone(),
            language: info.map(|i| i.language.clone()),
            contract: info.map(|i| i.contract),
            stateless: info.map(|i| i.stateless),
            reads: info.map(|i| crate::reads_names(i.reads)),
            executor: version.as_ref().map(|v| v.policy.executor()),
            calls: slot.stats.summary(),
            state,
            last_error: status.last_error.clone(),
            last_reload_ms: version.as_ref().and_then(|v| v.reload_ms),
            last_reload: status.last_reload.clone(),
            reloads: status.reloads,
            reload_failures: status.reload_failures,
            default: slot.name == self.config.default,
            fallback: self.config.fallback.as_deref() == Some(slot.name.as_str()),
        }
    }

    fn slot(&self, name: &str) -> Option<Arc<Slot>> {
        self.slots.read().get(name).cloned()
    }

    fn slot_or_insert(&self, name: &str) -> Arc<Slot> {
        let source = self.wasm_path(name);
        let mut slots = self.slots.write();
        Arc::clone(
            slots
                .entry(name.to_owned())
                .or_insert_with(|| Arc::new(Slot::new(name.to_owned(), source))),
        )
    }

    fn wasm_path(&self, name: &str) -> PathBuf {
        self.config.plugins.join(format!("{name}.wasm"))
    }

    /// The policy names in the plugins directory: stems of `*.wasm` files, hidden ones skipped.
    fn names_on_disk(&self) -> Result<Vec<String>, RegistryError> {
        let dir = &self.config.plugins;
        let entries = std::fs::read_dir(dir).map_err(|source| RegistryError::ReadDir {
            dir: dir.clone(),
            source,
        })?;
        let mut names: Vec<String> = entries
            .filter_map(Result::ok)
            .filter_map(|entry| policy_name(&entry.path(), "wasm"))
            .collect();
        names.sort();
        Ok(names)
    }

    /// The config for `name`: the explicit default config, else `<name>.json`, else `None`.
    fn config_for(&self, name: &str) -> Result<Option<String>, ReloadError> {
        if name == self.config.default && self.config.default_config.is_some() {
            return Ok(self.config.default_config.clone());
        }
        let path = self.config.plugins.join(format!("{name}.json"));
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => return Err(ReloadError::Read { path, source }),
        };
        let value: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| ReloadError::Config {
                path,
                reason: e.to_string(),
            })?;
        Ok(Some(value.to_string()))
    }

    /// The blocking half of a reload: read, compile, `init`, check, carry the state over.
    fn prepare(&self, slot: &Slot, force: bool) -> Prepared {
        let path = self.wasm_path(&slot.name);
        let bytes = match read_complete(&path) {
            Ok(Some(bytes)) => bytes,
            Ok(None) => return Prepared::Deleted,
            Err(ReloadError::Unstable { .. }) => return Prepared::InProgress,
            Err(error) => return Prepared::Failed(None, error),
        };
        let sha256 = super::load::sha256_hex(&bytes);
        let config = match self.config_for(&slot.name) {
            Ok(config) => config,
            Err(error) => return Prepared::Failed(Some(sha256), error),
        };
        let serving = slot.current();
        if !force
            && let Some(old) = &serving
            && old.policy.info().sha256 == sha256
            && old.config == config
        {
            return Prepared::Unchanged(sha256);
        }
        match self.load_checked(&slot.name, &bytes, config, path) {
            Ok(version) => {
                if let Some(old) = &serving {
                    carry_state(&old.policy, &version.policy);
                }
                Prepared::Ready(version)
            }
            Err(error) => Prepared::Failed(Some(sha256), error),
        }
    }

    fn load_checked(
        &self,
        name: &str,
        bytes: &[u8],
        config: Option<String>,
        path: PathBuf,
    ) -> Result<Version, ReloadError> {
        let policy = self
            .host
            .load_from(name, bytes, config.as_deref(), Some(path))?;
        check(&policy).map_err(|source| ReloadError::Check {
            policy: name.to_owned(),
            source: Box::new(source),
        })?;
        Ok(Version::new(policy, config))
    }

    /// The quick half of a reload: swap (or not), and record what happened.
    fn install(
        &self,
        slot: &Arc<Slot>,
        prepared: Prepared,
        since: Instant,
    ) -> Result<ReloadOutcome, ReloadError> {
        let name = slot.name.as_str();
        let (sha256, result) = match prepared {
            Prepared::Ready(mut version) => {
                let sha256 = version.policy.info().sha256.clone();
                let ms = since.elapsed().as_secs_f64() * 1e3;
                version.reload_ms = Some(ms);
                slot.serving.store(Some(Arc::new(version)));
                tracing::info!(policy = name, %sha256, reload_ms = ms, "policy version swapped in");
                self.record(slot, Some(sha256.clone()), Ok(()), since);
                return Ok(ReloadOutcome::Swapped { sha256, ms });
            }
            Prepared::Unchanged(sha256) => (Some(sha256), Ok(ReloadOutcome::Unchanged)),
            Prepared::InProgress => {
                tracing::debug!(
                    policy = name,
                    "policy file still being written; waiting for the next change"
                );
                return Ok(ReloadOutcome::InProgress);
            }
            Prepared::Deleted => return Ok(self.deleted(slot)),
            Prepared::Failed(sha256, error) => (sha256, Err(error)),
        };
        match result {
            Ok(outcome) => {
                let took = since.elapsed();
                slot.status.lock().last_reload = Some(LastReload {
                    sha256,
                    result: ReloadResult::Unchanged,
                    ms: took.as_secs_f64() * 1e3,
                });
                self.shared
                    .metrics
                    .reload(name, ReloadResult::Unchanged, took);
                Ok(outcome)
            }
            Err(error) => {
                tracing::warn!(policy = name, %error, serving = ?slot.current().map(|v| v.policy.info().sha256.clone()),
                    "policy reload failed; the previous version keeps serving");
                self.record(slot, sha256, Err(error.to_string()), since);
                Err(error)
            }
        }
    }

    /// Count a swap or a failure in the slot's status and the metrics.
    fn record(
        &self,
        slot: &Slot,
        sha256: Option<String>,
        result: Result<(), String>,
        since: Instant,
    ) {
        let took = since.elapsed();
        let outcome = if result.is_ok() {
            ReloadResult::Swapped
        } else {
            ReloadResult::Failed
        };
        let mut status = slot.status.lock();
        status.last_reload = Some(LastReload {
            sha256,
            result: outcome,
            ms: took.as_secs_f64() * 1e3,
        });
        match result {
            Ok(()) => {
                status.reloads += 1;
                status.last_error = None;
            }
            Err(message) => {
                status.reload_failures += 1;
                status.last_error = Some(message);
            }
        }
        self.shared.metrics.reload(&slot.name, outcome, took);
    }

    /// The file is gone: unload the policy, unless requests rely on it by default.
    fn deleted(&self, slot: &Arc<Slot>) -> ReloadOutcome {
        let name = slot.name.as_str();
        let essential =
            name == self.config.default || self.config.fallback.as_deref() == Some(name);
        if essential && slot.current().is_some() {
            let message = format!(
                "{} was deleted; the loaded version keeps serving because this is the {} policy",
                self.wasm_path(name).display(),
                if name == self.config.default {
                    "default"
                } else {
                    "fallback"
                }
            );
            tracing::warn!(policy = name, "{message}");
            slot.status.lock().last_error = Some(message);
            return ReloadOutcome::Kept;
        }
        self.slots.write().remove(name);
        tracing::info!(
            policy = name,
            "policy file deleted; policy unloaded (requests in flight finish on it)"
        );
        ReloadOutcome::Unloaded
    }
}

/// What the blocking half of a reload produced.
enum Prepared {
    Ready(Version),
    Unchanged(String),
    InProgress,
    Deleted,
    /// The sha256 of the bytes tried, when they could be read.
    Failed(Option<String>, ReloadError),
}

/// The file's bytes if it is complete: its size and modification time are the same before and
/// after the read (an editor or `cp` writing in place changes them). `None` when it is gone.
fn read_complete(path: &Path) -> Result<Option<Vec<u8>>, ReloadError> {
    let read_error = |source: std::io::Error| ReloadError::Read {
        path: path.to_owned(),
        source,
    };
    let stamp = |meta: std::fs::Metadata| (meta.len(), meta.modified().ok());
    let before = match std::fs::metadata(path) {
        Ok(meta) => stamp(meta),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(read_error(e)),
    };
    let bytes = match std::fs::read(path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(read_error(e)),
    };
    let after = std::fs::metadata(path).map(stamp).map_err(read_error)?;
    if before != after || before.0 != bytes.len() as u64 {
        return Err(ReloadError::Unstable {
            path: path.to_owned(),
        });
    }
    Ok(Some(bytes))
}

/// Hand the old version's state to the new one; a failure is logged, never fatal: the new
/// version then serves with the state its `init` gave it.
fn carry_state(old: &super::Policy, new: &super::Policy) {
    match new.carry_state_from(old) {
        Ok(0) => {}
        Ok(bytes) => tracing::info!(policy = %new.info().name, bytes, "policy state carried over"),
        Err(error) => {
            tracing::warn!(policy = %new.info().name, %error, "policy state not carried over")
        }
    }
}

/// The policy name of a plugins-directory path with extension `ext`: its stem, unless hidden
/// (editors' and installers' temporary files start with a dot).
pub(super) fn policy_name(path: &Path, ext: &str) -> Option<String> {
    if path.extension()? != ext {
        return None;
    }
    let stem = path.file_stem()?.to_str()?;
    (!stem.is_empty() && !stem.starts_with('.')).then(|| stem.to_owned())
}

fn unix_ms(at: SystemTime) -> u64 {
    at.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// The router's default planner (`Router::start`): each call plans with the default policy's
/// version serving at that moment. The HTTP API plans through a per-request [`Selection`]
/// instead, which keeps one version for all of a request's attempts.
impl Planner for PolicyRegistry {
    fn translate(
        &self,
        req: &PolicyRequest<'_>,
        ctx: &PolicyContext,
    ) -> Result<Plan, TranslateError> {
        match self.select(None, req.model) {
            Ok(selection) => selection.translate(req, ctx),
            Err(error) => Err(TranslateError::Unavailable {
                policy: self.config.default.clone(),
                message: error.to_string(),
            }),
        }
    }

    fn on_complete(&self, outcome: &Outcome) {
        if let Ok(selection) = self.select(None, "") {
            selection.on_complete(outcome);
        }
    }

    fn fallback(&self, error: &PlanningError) -> Option<Arc<dyn Planner>> {
        self.select(None, "").ok()?.fallback(error)
    }
}
