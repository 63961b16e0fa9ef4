//! The policy host: routing policies are WebAssembly components implementing
//! `wit/deps/policy@0.2.0/policy.wit`, loaded into a wasmtime sandbox and asked for a plan per request attempt.
//!
//! This crate owns everything wasmtime: the sandbox, loading and checks, the compile cache, the
//! hot-swapping [`PolicyRegistry`] and its plugins [`watch`]er. It speaks to the router only
//! through `switchyard-contract` (a loaded policy and a registry selection are
//! [`Planner`](switchyard_contract::Planner)s) and must never depend on an HTTP client or on
//! the router: a policy can reach nothing but its `log` import.
//!
//! ```no_run
//! use switchyard_contract::{PolicyContext, PolicyRequest};
//! use switchyard_policy_host::{PolicyHost, PolicyLimits};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let host = PolicyHost::new(PolicyLimits::default())?;
//! let policy = host.load_file("plugins/disagg.wasm".as_ref(), None)?;
//! let prompt = [1, 2, 3];
//! let request = PolicyRequest { id: 1, prompt: Some(&prompt), max_tokens: 16, stream: false,
//!     model: "m", user: None, headers: &[], flow: Default::default(), base_model: None };
//! let context = PolicyContext { attempt: 1, last_failure: None, endpoints: vec![] };
//! let plan = policy.translate(&request, &context)?; // validate with `switchyard_contract::validate`
//! # Ok(()) }
//! ```
//!
//! Components of every contract version load side by side (`switchyard:policy@0.1.0` and
//! `@0.2.0`, see `bindings`). Every call runs on a warm instance, on the caller's thread, under
//! a CPU-time deadline and the store's caps; a call that traps, overruns, passes a cap or
//! answers past a bound fails with a [`TranslateError`] and its instance is replaced by a spare
//! built ahead, so a misbehaving policy fails its own requests and nothing else. A stateful
//! policy runs on one instance, one call at a time; a stateless one (0.2.0) on a pool of them
//! (see `executor`).
//!
//! A router serves many policies through a [`PolicyRegistry`] (every `*.wasm` of the plugins
//! directory, hot-swapped by the [`watch`]er when a file changes, with a fallback policy and
//! quarantine for faulting ones); [`Policy::carry_state_from`] hands a policy's state to its
//! next version.

mod bindings;
mod blocking_io;
mod check;
mod deadline;
mod environment;
mod executor;
mod instance;
mod load;
mod registry;
mod sandbox;
mod wasm;
mod watch;

#[cfg(test)]
mod tests;

/// The synthetic endpoints and prompts [`check`] plans over, for tools that show a policy's
/// plans without a router (`switchyard policy plan`).
pub mod synthetic {
    pub use crate::check::{snapshot, split_roles, synthetic_prompt as prompt};
}

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

pub use bindings::Contract;
pub use check::{CheckError, CheckReport, check};
pub use environment::{GuestClock, GuestEnvironment};
pub use executor::ExecutorView;
pub use registry::{
    CallSummary, LastReload, POLICY_HEADER, PolicyRegistry, PolicyState, PolicyView,
    QuarantineRule, RegistryConfig, RegistryError, ReloadError, ReloadOutcome, ReloadResult,
    SelectError, Selection, append_registry,
};
pub use sandbox::{
    LOG_BYTES_PER_CALL, LOG_LINES_PER_CALL, MAX_ERROR_BYTES, MAX_INSTANCES, MAX_LOG_LINE,
    MAX_MEMORIES, MAX_PLAN_STEPS, MAX_TABLE_ELEMENTS, MAX_TABLES,
};
pub use watch::{DEFAULT_DEBOUNCE, PluginWatcher, WatchError, watch};

use switchyard_contract::{
    Outcome, Plan, Planner, PolicyContext, PolicyRequest, Reads, TranslateError,
};

use executor::Executor;
use sandbox::Linkers;
use wasm::WasmEngine;

/// Bounds on what one policy may do, and how many instances it may have. The bounds that are
/// not settings (counts of memories and tables, plan length, log budget) are the `MAX_*` and
/// `LOG_*` constants.
#[derive(Debug, Clone)]
pub struct PolicyLimits {
    /// CPU-time budget of one guest call on a warm instance (`translate-request`,
    /// `on-complete`, state carry-over): only the time the call runs (or sleeps by its own
    /// choice) counts, never time spent waiting for a CPU.
    pub deadline: Duration,
    /// CPU-time budget of building an instance: instantiation plus `init`. Kept apart from
    /// `deadline` because a Python or JavaScript guest takes milliseconds to start, and a
    /// request-sized budget would refuse to load it at all.
    pub setup_deadline: Duration,
    /// Cap on the bytes of all linear memories of one instance together.
    pub memory_bytes: usize,
    /// Bytes of stdout+stderr per stream and instance forwarded to the log; the rest is dropped.
    pub output_bytes: usize,
    /// Most instances of one stateless policy serving at once (a spare comes on top).
    pub pool_size: usize,
    /// Where compiled components are kept across restarts; `None` keeps them in memory only.
    pub cache_dir: Option<PathBuf>,
}

impl Default for PolicyLimits {
    fn default() -> Self {
        PolicyLimits {
            deadline: Duration::from_millis(50),
            setup_deadline: Duration::from_secs(5),
            memory_bytes: 64 << 20,
            output_bytes: 64 << 10,
            pool_size: default_pool_size(),
            cache_dir: default_cache_dir(),
        }
    }
}

/// One instance per CPU (calls run on the router's worker threads, one per CPU), at least 2 and
/// at most 16.
pub fn default_pool_size() -> usize {
    std::thread::available_parallelism().map_or(2, |n| n.get().clamp(2, 16))
}

/// `$SWITCHYARD_CACHE`, else the user's cache directory + `switchyard`: the one cache compiled
/// policies and fetched models share (`switchyard_wire::gguf::model_cache_dir` follows the same rule).
pub fn default_cache_dir() -> Option<PathBuf> {
    std::env::var_os("SWITCHYARD_CACHE")
        .filter(|dir| !dir.is_empty())
        .map(PathBuf::from)
        .or_else(|| dirs::cache_dir().map(|dir| dir.join("switchyard")))
}

/// What is known about a loaded policy.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct PolicyInfo {
    pub name: String,
    /// sha256 of the component's bytes, lower-case hex.
    pub sha256: String,
    /// As the policy describes itself (`rust`, `python`, ...).
    pub language: String,
    /// Leading prompt tokens the policy wants to see.
    pub prompt_tokens: u32,
    /// The file it was loaded from, if any.
    pub source: Option<PathBuf>,
    /// The contract version the component was built against.
    pub contract: Contract,
    /// The policy says it keeps no state between calls (0.2.0 `state: stateless`): it is
    /// served by a pool of instances.
    pub stateless: bool,
    /// What the policy reads (0.2.0 `reads`; everything for 0.1.0).
    #[serde(serialize_with = "serialize_reads")]
    pub reads: Reads,
}

/// What a policy reads, as operators see it: the contract's flag names.
pub fn reads_names(reads: Reads) -> Vec<&'static str> {
    let mut names = Vec::new();
    if reads.prompt {
        names.push("prompt-length");
    }
    if reads.outcomes {
        names.push("outcomes");
    }
    names
}

fn serialize_reads<S: serde::Serializer>(reads: &Reads, s: S) -> Result<S::Ok, S::Error> {
    s.collect_seq(reads_names(*reads))
}

/// Why a policy could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("cannot read policy file {}: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("policy {policy}: not a WebAssembly component: {reason}")]
    NotAComponent { policy: String, reason: String },
    #[error("policy {policy}: config is not valid JSON: {reason}")]
    Config { policy: String, reason: String },
    #[error("policy {policy}: cannot compile the component: {reason}")]
    Compile { policy: String, reason: String },
    #[error("policy {policy}: not a switchyard policy: {reason}")]
    WrongWorld { policy: String, reason: String },
    #[error("policy {policy}: cannot start an instance: {reason}")]
    Instantiate { policy: String, reason: String },
    #[error("policy {policy}: init rejected its config: {message}")]
    Init { policy: String, message: String },
    #[error("policy engine: {reason}")]
    Engine { reason: String },
}

/// Why a policy's state could not be carried over to its next version.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StateError {
    #[error("policy {policy}: export-state failed: {reason}")]
    Export { policy: String, reason: String },
    #[error("policy {policy}: import-state failed: {reason}")]
    Import { policy: String, reason: String },
}

// === impl PolicyHost ===

/// Loads policies: owns the wasmtime engine, its epoch ticker, the compile cache, the linker and
/// the limits. Cheap to clone.
#[derive(Clone)]
pub struct PolicyHost {
    inner: Arc<HostInner>,
}

struct HostInner {
    engine: WasmEngine,
    linkers: Linkers,
    limits: PolicyLimits,
    environment: GuestEnvironment,
}

impl PolicyHost {
    pub fn new(limits: PolicyLimits) -> Result<Self, LoadError> {
        Self::with_environment(limits, GuestEnvironment::default())
    }

    /// A host whose guests read `environment`'s clock and seeded randomness instead of the
    /// host's own (the policy lab's virtual time).
    pub fn with_environment(
        limits: PolicyLimits,
        environment: GuestEnvironment,
    ) -> Result<Self, LoadError> {
        let engine = WasmEngine::new(limits.cache_dir.clone())?;
        let linkers = Linkers::new(engine.engine())?;
        Ok(PolicyHost {
            inner: Arc::new(HostInner {
                engine,
                linkers,
                limits,
                environment,
            }),
        })
    }

    /// Load a policy from its component bytes; `config_json` is given to its `init` (`{}` when
    /// `None`).
    pub fn load(
        &self,
        name: &str,
        bytes: &[u8],
        config_json: Option<&str>,
    ) -> Result<Policy, LoadError> {
        load::load(&self.inner, name, bytes, config_json, None)
    }

    /// [`PolicyHost::load`], naming the file the bytes were read from.
    pub fn load_from(
        &self,
        name: &str,
        bytes: &[u8],
        config_json: Option<&str>,
        source: Option<PathBuf>,
    ) -> Result<Policy, LoadError> {
        load::load(&self.inner, name, bytes, config_json, source)
    }

    /// Load a policy from a file; its name is the file stem (`plugins/disagg.wasm` → `disagg`).
    pub fn load_file(&self, path: &Path, config_json: Option<&str>) -> Result<Policy, LoadError> {
        let bytes = std::fs::read(path).map_err(|source| LoadError::Read {
            path: path.to_owned(),
            source,
        })?;
        let name = path
            .file_stem()
            .map(|stem| stem.to_string_lossy().into_owned())
            .unwrap_or_else(|| path.display().to_string());
        load::load(
            &self.inner,
            &name,
            &bytes,
            config_json,
            Some(path.to_owned()),
        )
    }

    pub fn limits(&self) -> &PolicyLimits {
        &self.inner.limits
    }

    /// Components really compiled so far (not served by the compile cache).
    #[cfg(test)]
    fn compiles(&self) -> u64 {
        self.inner.engine.compiles()
    }
}

// === impl Policy ===

/// A loaded policy with its warm instances. Cheap to clone. A stateful policy's calls run one
/// at a time on one instance, so it may keep state between them; a stateless one's run in
/// parallel on a pool.
#[derive(Clone)]
pub struct Policy {
    inner: Arc<PolicyInner>,
}

struct PolicyInner {
    info: PolicyInfo,
    executor: Executor,
}

impl Policy {
    fn new(info: PolicyInfo, executor: Executor) -> Self {
        Policy {
            inner: Arc::new(PolicyInner { info, executor }),
        }
    }

    pub fn info(&self) -> &PolicyInfo {
        &self.inner.info
    }

    /// How its calls are spread over its instances, and how many there are now.
    pub fn executor(&self) -> ExecutorView {
        self.inner.executor.view()
    }

    /// Ask the policy for a plan. The plan is returned as the policy wrote it: validate it with
    /// [`switchyard_contract::validate`] before running it.
    pub fn translate(
        &self,
        req: &PolicyRequest<'_>,
        ctx: &PolicyContext,
    ) -> Result<Plan, TranslateError> {
        let prompt_tokens = self.inner.info.prompt_tokens;
        self.inner
            .executor
            .call(|factory, instance| factory.translate(instance, req, ctx, prompt_tokens))
            .unwrap_or_else(|fault| Err(self.fault(fault)))
    }

    /// Tell the policy how a request ended, when it reads outcomes (else nothing is called). A
    /// fault is returned, for the caller to count (the request is over either way); the
    /// faulted instance is replaced.
    pub fn on_complete(&self, outcome: &Outcome) -> Result<(), TranslateError> {
        if !self.inner.info.reads.outcomes {
            return Ok(());
        }
        self.inner
            .executor
            .call(|factory, instance| factory.on_complete(instance, outcome))
            .map_err(|fault| self.fault(fault))
    }

    fn fault(&self, fault: instance::Fault) -> TranslateError {
        fault.into_translate_error(&self.inner.info.name)
    }

    /// Hand `previous`'s state to this policy (`export-state` there, `import-state` here), when
    /// both are stateful components of the `stateful-policy` world and `previous` has state to
    /// give. Returns the bytes carried over (0: nothing to carry).
    pub fn carry_state_from(&self, previous: &Policy) -> Result<usize, StateError> {
        if self.info().stateless || previous.info().stateless {
            return Ok(0);
        }
        let exported = previous
            .inner
            .executor
            .call(|factory, instance| factory.export_state(instance));
        let state = match exported {
            Ok(Some(state)) if !state.is_empty() => state,
            Ok(_) => return Ok(0),
            Err(fault) => {
                return Err(StateError::Export {
                    policy: previous.inner.info.name.clone(),
                    reason: fault.to_string(),
                });
            }
        };
        let import_error = |reason: String| StateError::Import {
            policy: self.inner.info.name.clone(),
            reason,
        };
        let imported = self
            .inner
            .executor
            .call(|factory, instance| factory.import_state(instance, &state));
        match imported {
            Ok(Ok(true)) => Ok(state.len()),
            Ok(Ok(false)) => Ok(0),
            Ok(Err(refused)) => Err(import_error(refused)),
            Err(fault) => Err(import_error(fault.to_string())),
        }
    }

    /// Wait until the instances being built in the background (the spare, a pool's growth)
    /// are there; true when all of them are. Requests never wait for this: tests and
    /// benchmarks do, so that they measure a policy at rest rather than race its builder.
    #[doc(hidden)]
    pub fn settle(&self) -> bool {
        self.inner.executor.settle()
    }

    /// Instantiate a fresh store from the policy's `InstancePre` (no `init`), for the
    /// instantiation benchmark. Not part of the API.
    #[doc(hidden)]
    pub fn bench_instantiate(&self) -> Result<(), TranslateError> {
        self.inner
            .executor
            .factory()
            .instantiate()
            .map(drop)
            .map_err(|fault| self.fault(fault))
    }
}

impl std::fmt::Debug for Policy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Policy")
            .field("info", &self.inner.info)
            .finish_non_exhaustive()
    }
}

impl Planner for Policy {
    fn translate(
        &self,
        req: &PolicyRequest<'_>,
        ctx: &PolicyContext,
    ) -> Result<Plan, TranslateError> {
        Policy::translate(self, req, ctx)
    }

    fn on_complete(&self, outcome: &Outcome) {
        if let Err(fault) = Policy::on_complete(self, outcome) {
            tracing::warn!(policy = %self.inner.info.name, request_id = outcome.request_id,
                %fault, "on-complete failed");
        }
    }

    fn reads(&self) -> Reads {
        self.inner.info.reads
    }
}
