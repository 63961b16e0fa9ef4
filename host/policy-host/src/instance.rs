//! One warm policy instance, reused across calls, and the rules for calling into it: every call
//! runs under an epoch deadline and a memory cap; a call that traps, overruns or passes the cap
//! drops the whole store (a trapped instance is never entered again) and a fresh one is built
//! from the `InstancePre` with `init` run again.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::time::Duration;

use wasmtime::component::{Instance, TypedFunc};
use wasmtime::{AsContextMut, Engine, Store, Trap};

use super::bindings::{self, Guest, GuestPre, PolicyError};
use super::blocking_io::allow_blocking;
use super::sandbox::StoreState;
use super::wasm::{EPOCH_TICK, EpochTicker};
use switchyard_contract::{Outcome, Plan, PolicyContext, PolicyRequest, TranslateError};

use super::PolicyLimits;

/// Why a guest call produced no value. Converted into `TranslateError` or `LoadError` by the
/// caller, which knows what was being done.
#[derive(Debug)]
pub(super) enum Fault {
    /// The call ran past its epoch deadline.
    Deadline(Duration),
    /// The guest tried to grow its memory past the cap (bytes).
    MemoryExceeded(usize),
    /// Any other trap (or a host panic while serving the guest), with wasmtime's description.
    Trap(String),
    /// No instance could be built to take the call.
    Instantiate(String),
}

impl Fault {
    pub(super) fn into_translate_error(self, policy: &str) -> TranslateError {
        let policy = policy.to_owned();
        match self {
            Fault::Deadline(deadline) => TranslateError::Deadline { policy, deadline },
            Fault::MemoryExceeded(limit_bytes) => TranslateError::MemoryExceeded {
                policy,
                limit_bytes,
            },
            Fault::Trap(reason) => TranslateError::Trap { policy, reason },
            Fault::Instantiate(reason) => TranslateError::Instantiate { policy, reason },
        }
    }
}

impl std::fmt::Display for Fault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Fault::Deadline(d) => write!(f, "ran past its {} ms deadline", d.as_millis()),
            Fault::MemoryExceeded(limit) => {
                write!(f, "tried to use more than its {limit} bytes of memory")
            }
            Fault::Trap(reason) => write!(f, "trapped: {reason}"),
            Fault::Instantiate(reason) => write!(f, "cannot be instantiated: {reason}"),
        }
    }
}

/// What `describe` answered, read once at load.
pub(super) struct Described {
    pub(super) language: String,
    pub(super) prompt_tokens: u32,
}

/// A policy's instance slot: the `InstancePre` to rebuild from and the live instance, if any.
pub(super) struct Instances {
    name: Arc<str>,
    engine: Engine,
    /// Keeps the epoch advancing while this policy's code runs (and alive while it exists).
    ticker: Arc<EpochTicker>,
    pre: GuestPre<StoreState>,
    config: String,
    limits: PolicyLimits,
    warm: Option<Warm>,
}

/// A live instance and the store that owns it.
struct Warm {
    store: Store<StoreState>,
    exports: Exports,
}

/// What a live instance exports: the `policy` world, and the state carry-over functions of the
/// `stateful-policy` world when the component has them.
struct Exports {
    guest: Guest,
    state: Option<StateExports>,
}

/// `export-state` and `import-state`, looked up by name because they are optional: a component
/// of the plain `policy` world is just as valid.
struct StateExports {
    export: TypedFunc<(), (Vec<u8>,)>,
    import: TypedFunc<(Vec<u8>,), (Result<(), String>,)>,
}

impl StateExports {
    /// Both functions with the WIT signatures, or `None` (a component exporting only one of
    /// them, or with other types, keeps no state as far as the host is concerned).
    fn find(mut store: impl AsContextMut, instance: &Instance) -> Option<Self> {
        let export = instance
            .get_typed_func::<(), (Vec<u8>,)>(&mut store, "export-state")
            .ok()?;
        let import = instance
            .get_typed_func::<(Vec<u8>,), (Result<(), String>,)>(&mut store, "import-state")
            .ok()?;
        Some(StateExports { export, import })
    }
}

/// Why the first instance of a policy could not be started.
pub(super) enum StartError {
    Fault(Fault),
    /// `init` returned an error.
    Init(String),
}

impl Instances {
    /// Instantiate, `init(config)` and `describe`: the last steps of loading a policy.
    pub(super) fn start(
        name: Arc<str>,
        engine: Engine,
        ticker: Arc<EpochTicker>,
        pre: GuestPre<StoreState>,
        config: String,
        limits: PolicyLimits,
    ) -> Result<(Self, Described), StartError> {
        let mut instances = Instances {
            name,
            engine,
            ticker,
            pre,
            config,
            limits,
            warm: None,
        };
        let warm = instances.build().map_err(|e| match e {
            BuildError::Fault(f) => StartError::Fault(f),
            BuildError::Init(m) => StartError::Init(m),
        })?;
        instances.warm = Some(warm);
        let info = instances
            .call(|exports, store| exports.guest.call_describe(store))
            .map_err(StartError::Fault)?;
        let described = Described {
            language: info.language,
            prompt_tokens: info.prompt_tokens,
        };
        Ok((instances, described))
    }

    pub(super) fn translate(
        &mut self,
        req: &PolicyRequest<'_>,
        ctx: &PolicyContext,
        prompt_tokens: u32,
    ) -> Result<Plan, TranslateError> {
        let request = bindings::request(req, prompt_tokens);
        let context = bindings::context(ctx);
        let answer = self
            .call(|exports, store| {
                exports
                    .guest
                    .call_translate_request(store, &request, &context)
            })
            .map_err(|fault| fault.into_translate_error(&self.name))?;
        let policy = self.name.to_string();
        match answer {
            Ok(plan) => Ok(bindings::plan(plan)),
            Err(PolicyError::Unavailable(message)) => {
                Err(TranslateError::Unavailable { policy, message })
            }
            Err(PolicyError::Rejected(message)) => {
                Err(TranslateError::Rejected { policy, message })
            }
            Err(PolicyError::Internal(message)) => {
                Err(TranslateError::Internal { policy, message })
            }
        }
    }

    pub(super) fn on_complete(&mut self, outcome: &Outcome) -> Result<(), Fault> {
        let outcome = bindings::outcome(outcome);
        self.call(|exports, store| exports.guest.call_on_complete(store, outcome))
    }

    /// The instance's `export-state`, or `None` when the component does not export one.
    pub(super) fn export_state(&mut self) -> Result<Option<Vec<u8>>, Fault> {
        self.call(|exports, store| match &exports.state {
            Some(state) => state.export.call(store, ()).map(|(bytes,)| Some(bytes)),
            None => Ok(None),
        })
    }

    /// Hand `state` to the instance's `import-state`: `Ok(Err(..))` when the policy refused
    /// it, `Ok(Ok(false))` when the component does not export the function.
    pub(super) fn import_state(&mut self, state: &[u8]) -> Result<Result<bool, String>, Fault> {
        self.call(|exports, store| match &exports.state {
            Some(functions) => functions
                .import
                .call(store, (state.to_vec(),))
                .map(|(answer,)| answer.map(|()| true)),
            None => Ok(Ok(false)),
        })
    }

    /// Instantiate from the `InstancePre` without `init`, for the instantiation benchmark.
    pub(super) fn instantiate_only(&self) -> Result<(), Fault> {
        self.instantiate().map(drop)
    }

    /// Run one guest call on the warm instance (building one first if the last call killed it).
    /// On any fault the instance is dropped, never re-entered, and a fresh one is built right
    /// away so the next request does not pay for it.
    fn call<R>(
        &mut self,
        f: impl FnOnce(&Exports, &mut Store<StoreState>) -> wasmtime::Result<R>,
    ) -> Result<R, Fault> {
        let mut warm = match self.warm.take() {
            Some(warm) => warm,
            None => self.build().map_err(BuildError::into_fault)?,
        };
        match self.run(&mut warm, self.limits.deadline, f) {
            Ok(value) => {
                self.warm = Some(warm);
                Ok(value)
            }
            Err(fault) => {
                drop(warm);
                tracing::warn!(policy = %self.name, %fault, "policy call failed; rebuilding its instance");
                self.rebuild_after_fault();
                Err(fault)
            }
        }
    }

    fn rebuild_after_fault(&mut self) {
        match self.build() {
            Ok(warm) => self.warm = Some(warm),
            Err(e) => {
                tracing::error!(policy = %self.name, error = %e.into_fault(),
                    "cannot rebuild policy instance; will retry on the next call");
            }
        }
    }

    /// One call under `deadline`. A host panic while serving the guest is caught and treated
    /// like a trap: the instance is dropped.
    fn run<R>(
        &self,
        warm: &mut Warm,
        deadline: Duration,
        f: impl FnOnce(&Exports, &mut Store<StoreState>) -> wasmtime::Result<R>,
    ) -> Result<R, Fault> {
        let Warm { store, exports } = warm;
        let result = self.under_deadline(store, deadline, |store| {
            catch_unwind(AssertUnwindSafe(|| f(exports, store)))
        });
        match result {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(error)) => Err(self.classify(store, &error, deadline)),
            Err(panic) => Err(Fault::Trap(format!(
                "the host panicked while serving the policy: {}",
                panic_message(&*panic)
            ))),
        }
    }

    /// Run guest code in `store` under `deadline`: the deadline is set, and the epoch ticker
    /// kept ticking until `f` returns (a sleeping ticker would never end a runaway guest).
    fn under_deadline<R>(
        &self,
        store: &mut Store<StoreState>,
        deadline: Duration,
        f: impl FnOnce(&mut Store<StoreState>) -> R,
    ) -> R {
        store.set_epoch_deadline(deadline_ticks(deadline));
        let _running = self.ticker.running();
        f(store)
    }

    fn classify(
        &self,
        store: &Store<StoreState>,
        error: &wasmtime::Error,
        deadline: Duration,
    ) -> Fault {
        if store.data().limiter.exceeded() {
            return Fault::MemoryExceeded(self.limits.memory_bytes);
        }
        let trap = error.downcast_ref::<Trap>();
        if trap == Some(&Trap::Interrupt) {
            return Fault::Deadline(deadline);
        }
        // The full error carries a multi-line wasm backtrace: keep it for debugging, and give
        // callers (and HTTP error bodies) the one-line cause.
        tracing::debug!(policy = %self.name, error = ?error, "policy trapped");
        match trap {
            Some(trap) => Fault::Trap(trap.to_string()),
            None => Fault::Trap(error.root_cause().to_string()),
        }
    }

    /// A fresh store and instance with `init(config)` done.
    fn build(&self) -> Result<Warm, BuildError> {
        let mut warm = self.instantiate().map_err(BuildError::Fault)?;
        let config = self.config.as_str();
        let deadline = self.limits.setup_deadline;
        match self.run(&mut warm, deadline, |exports, store| {
            exports.guest.call_init(store, config)
        }) {
            Ok(Ok(())) => Ok(warm),
            Ok(Err(message)) => Err(BuildError::Init(message)),
            Err(fault) => Err(BuildError::Fault(fault)),
        }
    }

    fn instantiate(&self) -> Result<Warm, Fault> {
        let state = StoreState::new(
            Arc::clone(&self.name),
            self.limits.memory_bytes,
            self.limits.output_bytes,
        );
        let mut store = Store::new(&self.engine, state);
        store.limiter(|s| &mut s.limiter);
        store.epoch_deadline_trap();
        let deadline = self.limits.setup_deadline;
        // A guest's start-up (Python's) may use any WASI function, blocking ones included.
        let instantiated = self.under_deadline(&mut store, deadline, |store| {
            allow_blocking(|| self.instantiate_in(store))
        });
        match instantiated {
            Ok(exports) => Ok(Warm { store, exports }),
            Err(error) => match self.classify(&store, &error, deadline) {
                Fault::Trap(reason) => Err(Fault::Instantiate(reason)),
                fault => Err(fault),
            },
        }
    }

    /// Instantiate through the raw `InstancePre` rather than the generated one, so the optional
    /// state exports can be looked up on the same instance.
    fn instantiate_in(&self, store: &mut Store<StoreState>) -> wasmtime::Result<Exports> {
        let instance = self.pre.instance_pre().instantiate(&mut *store)?;
        let guest = Guest::new(&mut *store, &instance)?;
        let state = StateExports::find(&mut *store, &instance);
        Ok(Exports { guest, state })
    }
}

enum BuildError {
    Fault(Fault),
    Init(String),
}

impl BuildError {
    fn into_fault(self) -> Fault {
        match self {
            BuildError::Fault(fault) => fault,
            BuildError::Init(message) => Fault::Instantiate(format!("init failed: {message}")),
        }
    }
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic".to_owned()
    }
}

/// Ticks until `deadline`: rounded up, plus one because the current tick may end at once.
fn deadline_ticks(deadline: Duration) -> u64 {
    let tick = EPOCH_TICK.as_nanos().max(1);
    let ticks = deadline.as_nanos().div_ceil(tick);
    u64::try_from(ticks).unwrap_or(u64::MAX).saturating_add(1)
}
