//! One policy instance (a store and the component instantiated in it) and the [`Factory`] that
//! builds instances of one policy version and calls into them. Every call runs under the
//! CPU-time deadline of `deadline` and the store's caps, and its answer is bounded; a call that
//! traps, overruns, passes a cap or answers past a bound is a [`Fault`], after which the
//! instance is never entered again (the executor drops it and takes another).

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use wasmtime::component::{Instance as ComponentInstance, TypedFunc};
use wasmtime::{AsContextMut, Engine, Store, Trap};

use super::PolicyLimits;
use super::bindings::{Described, Guest, GuestPre, Refusal};
use super::blocking_io::allow_blocking;
use super::environment::GuestEnvironment;
use super::sandbox::{MAX_ERROR_BYTES, MAX_PLAN_STEPS, StoreState};
use super::wasm::EpochTicker;
use switchyard_contract::{Outcome, Plan, PolicyContext, PolicyRequest, TranslateError};

/// Why a guest call produced no usable value. Converted into `TranslateError` or `LoadError` by
/// the caller, which knows what was being done.
#[derive(Debug)]
pub(super) enum Fault {
    /// The call used its CPU-time budget.
    Deadline(Duration),
    /// The guest tried to grow its memories past the cap (bytes, all memories together).
    MemoryExceeded(usize),
    /// Any other trap (or a host panic while serving the guest), with wasmtime's description.
    Trap(String),
    /// No instance could be built to take the call.
    Instantiate(String),
    /// The answer passed a bound (plan length, error message size).
    Oversized(String),
    /// Every instance faulted and their replacements are still being built: the call is
    /// refused at once rather than made to wait for a build.
    NoInstance,
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
            Fault::Oversized(reason) => TranslateError::Oversized { policy, reason },
            Fault::NoInstance => TranslateError::Instantiate {
                policy,
                reason: NO_INSTANCE.to_owned(),
            },
        }
    }
}

const NO_INSTANCE: &str = "every instance faulted and a new one is still being built";

impl std::fmt::Display for Fault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Fault::Deadline(d) => write!(f, "ran past its {} ms deadline", d.as_millis()),
            Fault::MemoryExceeded(limit) => {
                write!(f, "tried to use more than its {limit} bytes of memory")
            }
            Fault::Trap(reason) => write!(f, "trapped: {reason}"),
            Fault::Instantiate(reason) => write!(f, "cannot be instantiated: {reason}"),
            Fault::Oversized(reason) => write!(f, "answered past a bound: {reason}"),
            Fault::NoInstance => f.write_str(NO_INSTANCE),
        }
    }
}

/// Why an instance could not be built.
pub(super) enum BuildError {
    Fault(Fault),
    /// `init` returned an error (cut to [`MAX_ERROR_BYTES`]).
    Init(String),
}

impl std::fmt::Display for BuildError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BuildError::Fault(fault) => fault.fmt(f),
            BuildError::Init(message) => write!(f, "init failed: {message}"),
        }
    }
}

/// A live instance and the store that owns it. Used by one call at a time (the executor lends
/// it out), and dropped, never re-entered, after a fault.
pub(super) struct Instance {
    store: Store<StoreState>,
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
    fn find(mut store: impl AsContextMut, instance: &ComponentInstance) -> Option<Self> {
        let export = instance
            .get_typed_func::<(), (Vec<u8>,)>(&mut store, "export-state")
            .ok()?;
        let import = instance
            .get_typed_func::<(Vec<u8>,), (Result<(), String>,)>(&mut store, "import-state")
            .ok()?;
        Some(StateExports { export, import })
    }
}

// === impl Factory ===

/// Everything needed to build and call instances of one policy version: the type-checked
/// component, its config and the limits. Shared by the executor and its builder thread.
pub(super) struct Factory {
    name: Arc<str>,
    engine: Engine,
    /// Keeps the epoch advancing while this policy's code runs (and alive while it exists).
    ticker: Arc<EpochTicker>,
    pre: GuestPre,
    config: String,
    limits: PolicyLimits,
    environment: GuestEnvironment,
    /// Instances built so far: the next one's number, which picks its random stream.
    built: AtomicU64,
}

impl Factory {
    pub(super) fn new(
        name: Arc<str>,
        engine: Engine,
        ticker: Arc<EpochTicker>,
        pre: GuestPre,
        config: String,
        limits: PolicyLimits,
        environment: GuestEnvironment,
    ) -> Self {
        Factory {
            name,
            engine,
            ticker,
            pre,
            config,
            limits,
            environment,
            built: AtomicU64::new(0),
        }
    }

    pub(super) fn name(&self) -> &str {
        &self.name
    }

    /// A fresh store and instance with `init(config)` done.
    pub(super) fn build(&self) -> Result<Instance, BuildError> {
        let mut instance = self.instantiate().map_err(BuildError::Fault)?;
        let config = self.config.as_str();
        let deadline = self.limits.setup_deadline;
        match self.run(&mut instance, deadline, |guest, store| {
            guest.init(store, config)
        }) {
            Ok(Ok(())) => Ok(instance),
            Ok(Err(message)) => Err(BuildError::Init(cut(message))),
            Err(fault) => Err(BuildError::Fault(fault)),
        }
    }

    /// `describe`, on an instance just built.
    pub(super) fn describe(&self, instance: &mut Instance) -> Result<Described, Fault> {
        let mut described = self.call(instance, |guest, store| guest.describe(store))?;
        described.language = cut(described.language);
        Ok(described)
    }

    /// `translate-request`: `Err` is a fault (the instance must be dropped), `Ok(Err(..))` the
    /// policy's own refusal.
    pub(super) fn translate(
        &self,
        instance: &mut Instance,
        req: &PolicyRequest<'_>,
        ctx: &PolicyContext,
        prompt_tokens: u32,
    ) -> Result<Result<Plan, TranslateError>, Fault> {
        let answer = self.call(instance, |guest, store| {
            guest.translate(store, req, ctx, prompt_tokens)
        })?;
        let refusal = match answer {
            Ok(plan) if plan.steps.len() > MAX_PLAN_STEPS => {
                return Err(Fault::Oversized(format!(
                    "a plan of {} steps (at most {MAX_PLAN_STEPS})",
                    plan.steps.len()
                )));
            }
            Ok(plan) => return Ok(Ok(plan)),
            Err(refusal) => refusal,
        };
        let (Refusal::Unavailable(message)
        | Refusal::Rejected(message)
        | Refusal::Internal(message)) = &refusal;
        if message.len() > MAX_ERROR_BYTES {
            return Err(Fault::Oversized(format!(
                "an error message of {} bytes (at most {MAX_ERROR_BYTES})",
                message.len()
            )));
        }
        let policy = self.name.to_string();
        Ok(Err(match refusal {
            Refusal::Unavailable(message) => TranslateError::Unavailable { policy, message },
            Refusal::Rejected(message) => TranslateError::Rejected { policy, message },
            Refusal::Internal(message) => TranslateError::Internal { policy, message },
        }))
    }

    pub(super) fn on_complete(
        &self,
        instance: &mut Instance,
        outcome: &Outcome,
    ) -> Result<(), Fault> {
        self.call(instance, |guest, store| guest.on_complete(store, outcome))
    }

    /// The instance's `export-state`, or `None` when the component does not export one.
    pub(super) fn export_state(&self, instance: &mut Instance) -> Result<Option<Vec<u8>>, Fault> {
        let Some(state) = &instance.state else {
            return Ok(None);
        };
        let export = state.export;
        self.call(instance, |_, store| {
            export.call(store, ()).map(|(bytes,)| Some(bytes))
        })
    }

    /// Hand `state` to the instance's `import-state`: `Ok(Err(..))` when the policy refused
    /// it, `Ok(Ok(false))` when the component does not export the function.
    pub(super) fn import_state(
        &self,
        instance: &mut Instance,
        state: &[u8],
    ) -> Result<Result<bool, String>, Fault> {
        let Some(functions) = &instance.state else {
            return Ok(Ok(false));
        };
        let import = functions.import;
        self.call(instance, |_, store| {
            import
                .call(store, (state.to_vec(),))
                .map(|(answer,)| answer.map(|()| true).map_err(cut))
        })
    }

    /// One call under the call deadline.
    fn call<R>(
        &self,
        instance: &mut Instance,
        f: impl FnOnce(&Guest, &mut Store<StoreState>) -> wasmtime::Result<R>,
    ) -> Result<R, Fault> {
        let result = self.run(instance, self.limits.deadline, f);
        if let Err(fault) = &result {
            tracing::warn!(policy = %self.name, %fault, "policy call failed; its instance is replaced");
        }
        result
    }

    /// One call under `deadline`. A host panic while serving the guest is caught and treated
    /// like a trap.
    fn run<R>(
        &self,
        instance: &mut Instance,
        deadline: Duration,
        f: impl FnOnce(&Guest, &mut Store<StoreState>) -> wasmtime::Result<R>,
    ) -> Result<R, Fault> {
        let Instance { store, guest, .. } = instance;
        let result = self.under_deadline(store, deadline, |store| {
            catch_unwind(AssertUnwindSafe(|| f(guest, store)))
        });
        match result {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(error)) => Err(self.classify(store, &error)),
            Err(panic) => Err(Fault::Trap(format!(
                "the host panicked while serving the policy: {}",
                panic_message(&*panic)
            ))),
        }
    }

    /// Run guest code in `store` under `deadline`: the call's clock starts on this thread, and
    /// the epoch ticker keeps ticking until `f` returns (a sleeping ticker would never check a
    /// runaway guest).
    fn under_deadline<R>(
        &self,
        store: &mut Store<StoreState>,
        deadline: Duration,
        f: impl FnOnce(&mut Store<StoreState>) -> R,
    ) -> R {
        let ticks = store.data_mut().begin_call(deadline);
        store.set_epoch_deadline(ticks);
        let result = {
            let _running = self.ticker.running();
            f(store)
        };
        store.data_mut().end_call();
        result
    }

    fn classify(&self, store: &Store<StoreState>, error: &wasmtime::Error) -> Fault {
        let state = store.data();
        if state.limiter.exceeded() {
            return Fault::MemoryExceeded(state.limiter.memory_cap());
        }
        let trap = error.downcast_ref::<Trap>();
        if state.clock.overran() || trap == Some(&Trap::Interrupt) {
            return Fault::Deadline(state.clock.budget());
        }
        // The full error carries a multi-line wasm backtrace: keep it for debugging, and give
        // callers (and HTTP error bodies) the one-line cause.
        tracing::debug!(policy = %self.name, error = ?error, "policy trapped");
        match trap {
            Some(trap) => Fault::Trap(trap.to_string()),
            None => Fault::Trap(error.root_cause().to_string()),
        }
    }

    /// A fresh store with the component instantiated in it (no `init`).
    pub(super) fn instantiate(&self) -> Result<Instance, Fault> {
        let state = StoreState::new(
            Arc::clone(&self.name),
            self.limits.memory_bytes,
            self.limits.output_bytes,
            (
                &self.environment,
                self.built.fetch_add(1, Ordering::Relaxed),
            ),
        );
        let mut store = Store::new(&self.engine, state);
        store.limiter(|s| &mut s.limiter);
        store.epoch_deadline_callback(|mut store| Ok(store.data_mut().clock.on_epoch()));
        let deadline = self.limits.setup_deadline;
        // A guest's start-up (Python's) may use any WASI function, blocking ones included.
        let instantiated = self.under_deadline(&mut store, deadline, |store| {
            allow_blocking(|| self.pre.instantiate(store))
        });
        match instantiated {
            Ok((guest, instance)) => {
                let state = StateExports::find(&mut store, &instance);
                Ok(Instance {
                    store,
                    guest,
                    state,
                })
            }
            Err(error) => match self.classify(&store, &error) {
                Fault::Trap(reason) => Err(Fault::Instantiate(reason)),
                fault => Err(fault),
            },
        }
    }
}

/// `message`, cut to [`MAX_ERROR_BYTES`] (at a char boundary) with the cut marked: a string the
/// host keeps (an `init` error, a language name) must not be a policy's way to bloat the router.
fn cut(mut message: String) -> String {
    if message.len() <= MAX_ERROR_BYTES {
        return message;
    }
    let total = message.len();
    let mut end = MAX_ERROR_BYTES;
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    message.truncate(end);
    message.push_str(&format!(" [{} bytes cut]", total - end));
    message
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
