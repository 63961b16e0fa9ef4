//! The [`Policy`] trait and the glue that exports one as the WIT world `stateful-policy`.
//!
//! A component holds exactly one policy, so the instance lives in one SDK-wide slot set by
//! `init`; the generic [`Exported`] adapter implements the generated `Guest` trait over it.

use std::any::Any;
use std::cell::RefCell;
use std::marker::PhantomData;

use crate::bindings::Guest;
use crate::types::{Context, Outcome, Plan, PolicyError, PolicyInfo, Reads, Request, State};

/// A routing policy. Implement it, then call [`export_policy!`](crate::export_policy).
pub trait Policy: Sized + 'static {
    /// The language the policy is written in, shown to operators.
    const LANGUAGE: &'static str = "rust";

    /// How many leading prompt token ids `translate` needs in `request.prompt_prefix`:
    /// 0 when the prompt length is enough, `u32::MAX` for all of them. Every token crosses
    /// the component boundary on every call, so ask only for what you use.
    const PROMPT_TOKENS: u32 = 0;

    /// Whether the policy keeps state between calls. [`State::Stateful`] (the default) is
    /// always correct: the router runs one instance and calls it one call at a time.
    /// [`State::Stateless`] promises that every answer depends only on the call's arguments and
    /// the config, so the router may run a pool of instances and call them in parallel (and
    /// any of them hears `on_complete`). A policy with a counter, a cache or anything learnt in
    /// `on_complete` is stateful.
    const STATE: State = State::Stateful;

    /// What the policy reads, so the router does that work for it and no more:
    /// [`Reads::PROMPT_LENGTH`] to get `request.prompt_len` (the router tokenizes the prompt
    /// for it; read it with [`Request::prompt_length`]), [`Reads::OUTCOMES`] to have
    /// [`Policy::on_complete`] called. The default, [`Reads::all()`], is always correct; a
    /// policy that routes on the endpoints and the request's small fields alone says
    /// `Reads::empty()` and saves the router a tokenization per request.
    /// `PROMPT_TOKENS > 0` implies the prompt length.
    const READS: Reads = Reads::all();

    /// Build the policy from its JSON config (`"{}"` when the operator gave none).
    /// An error stops the policy from loading; say what is wrong with the config.
    fn init(config: &str) -> Result<Self, String>;

    /// Turn one attempt of one request into a plan.
    fn translate(&mut self, request: &Request, context: &Context) -> Result<Plan, PolicyError>;

    /// Learn how a request ended. Called only when [`Policy::READS`] has
    /// [`Reads::OUTCOMES`]. The default ignores it.
    fn on_complete(&mut self, _outcome: &Outcome) {}

    /// Opt in to state carry-over on hot swap: the state to hand to the next version of this
    /// policy (its [`Policy::import_state`]), in a format of your choosing. The default, an
    /// empty list, means "nothing to carry over": the router then does not call the new
    /// version's `import_state` at all. Only stateful policies take part (see
    /// [`Policy::STATE`]).
    fn export_state(&self) -> Vec<u8> {
        Vec::new()
    }

    /// Take over the state the previous version exported. Called after `init` and before the
    /// first `translate`; an error is logged by the router and this version keeps the state
    /// `init` gave it. The default ignores the state.
    fn import_state(&mut self, _state: &[u8]) -> Result<(), String> {
        Ok(())
    }
}

thread_local! {
    // Components are single-threaded: a thread-local is just a global without `Sync`.
    static INSTANCE: RefCell<Option<Box<dyn Any>>> = const { RefCell::new(None) };
}

/// Runs `f` on the live policy instance, or returns `None` before a successful `init`.
fn with_instance<P: Policy, R>(f: impl FnOnce(&mut P) -> R) -> Option<R> {
    INSTANCE.with(|slot| {
        let mut slot = slot.borrow_mut();
        slot.as_mut()?.downcast_mut::<P>().map(f)
    })
}

/// Implements the generated `Guest` trait for policy `P`; named only by `export_policy!`.
pub struct Exported<P>(PhantomData<P>);

impl<P: Policy> Guest for Exported<P> {
    fn init(config: String) -> Result<(), String> {
        // A failed init must not leave an older instance answering calls.
        INSTANCE.with(|slot| slot.borrow_mut().take());
        let policy = P::init(&config)?;
        INSTANCE.with(|slot| *slot.borrow_mut() = Some(Box::new(policy)));
        Ok(())
    }

    fn describe() -> PolicyInfo {
        describe::<P>()
    }

    fn translate_request(request: Request, context: Context) -> Result<Plan, PolicyError> {
        with_instance::<P, _>(|p| p.translate(&request, &context)).unwrap_or_else(|| {
            Err(PolicyError::Internal(
                "translate-request was called before a successful init".into(),
            ))
        })
    }

    fn on_complete(outcome: crate::types::Outcome) {
        // Nothing to learn from before init; the host never does this anyway.
        let _ = with_instance::<P, _>(|p| p.on_complete(&outcome));
    }

    fn export_state() -> Vec<u8> {
        with_instance::<P, _>(|p| p.export_state()).unwrap_or_default()
    }

    fn import_state(state: Vec<u8>) -> Result<(), String> {
        with_instance::<P, _>(|p| p.import_state(&state))
            .unwrap_or_else(|| Err("import-state was called before a successful init".into()))
    }
}

/// The `policy-info` a policy type reports.
pub(crate) fn describe<P: Policy>() -> PolicyInfo {
    PolicyInfo {
        language: P::LANGUAGE.into(),
        prompt_tokens: P::PROMPT_TOKENS,
        state: P::STATE,
        reads: P::READS,
    }
}

/// Export a [`Policy`] type as this component's `switchyard:policy/stateful-policy` world (the
/// `policy` world plus the state carry-over functions, which default to "no state").
///
/// Use it once, at the root of a `cdylib` policy crate: `export_policy!(MyPolicy);`.
/// It also stamps the SDK version into the custom section `switchyard-sdk-version`.
#[macro_export]
macro_rules! export_policy {
    ($policy:ty) => {
        #[allow(
            unsafe_code,
            reason = "the canonical-ABI exports wit-bindgen generates"
        )]
        const _: () = {
            type SwitchyardExportedPolicy = $crate::__rt::Exported<$policy>;
    $crate::bindings::__export_policy_world!(SwitchyardExportedPolicy with_types_in $crate::bindings);

            #[cfg(target_arch = "wasm32")]
            #[unsafe(link_section = "switchyard-sdk-version")]
            #[used]
            static SWITCHYARD_SDK_VERSION: [u8; $crate::SDK_VERSION.len()] =
                $crate::__rt::SDK_VERSION_BYTES;
        };
    };
}
