//! A policy of the frozen contract `switchyard:policy@0.1.0` (world `stateful-policy`), built
//! from `wit/deps/policy@0.1.0` with `wit-bindgen` alone, as a policy author would have built it
//! before 0.2.0 existed. It proves that the router still loads 0.1.0 components and runs them as
//! 0.1.0 promised: one instance, calls one at a time, state kept between calls and carried over
//! a hot swap.
//!
//! It forwards request after request to the healthy endpoints in turn, by a counter of the
//! requests it planned (so a test can see that every call reached the same instance, in
//! order), counts the outcomes `on-complete` reports, and hands the counter to its next
//! version. A request header `x-trap` makes it trap, so a test can see a 0.1.0 instance
//! replaced after a fault. Config: any JSON (ignored), e.g. `{"generation": 2}` to load "a new
//! version" of the same bytes.

use std::cell::Cell;

mod bindings {
    #![expect(
        clippy::too_many_arguments,
        reason = "generated canonical-ABI glue takes a record's flattened fields as parameters"
    )]

    wit_bindgen::generate!({
        path: "../../../wit/deps/policy@0.1.0",
        world: "stateful-policy",
    });
}

use bindings::switchyard::policy::types::{
    Context, Level, Outcome, Plan, PolicyError, PolicyInfo, Request, Step,
};
use bindings::{Guest, log};

thread_local! {
    // Components are single-threaded: a thread-local is just a global without `Sync`.
    static PLANNED: Cell<u64> = const { Cell::new(0) };
    static COMPLETED: Cell<u64> = const { Cell::new(0) };
}

struct PolicyV010;

impl Guest for PolicyV010 {
    fn init(_config: String) -> Result<(), String> {
        PLANNED.set(0);
        COMPLETED.set(0);
        Ok(())
    }

    fn describe() -> PolicyInfo {
        PolicyInfo {
            language: "rust".into(),
            prompt_tokens: 0,
        }
    }

    fn translate_request(request: Request, context: Context) -> Result<Plan, PolicyError> {
        if request.headers.iter().any(|h| h.name == "x-trap") {
            panic!("policy-v0-1-0: trapping as the x-trap header asks");
        }
        let healthy: Vec<u32> = context
            .endpoints
            .iter()
            .filter(|e| e.healthy)
            .map(|e| e.id)
            .collect();
        if healthy.is_empty() {
            return Err(PolicyError::Unavailable("no healthy endpoint".into()));
        }
        let planned = PLANNED.get();
        PLANNED.set(planned + 1);
        log(
            Level::Debug,
            &format!(
                "policy-v0-1-0: request {} is number {planned}; {} outcomes so far",
                request.id,
                COMPLETED.get()
            ),
        );
        let turn = (planned % healthy.len() as u64) as usize;
        Ok(Plan {
            steps: vec![Step::Forward(healthy[turn])],
        })
    }

    fn on_complete(_outcome: Outcome) {
        COMPLETED.set(COMPLETED.get() + 1);
    }

    fn export_state() -> Vec<u8> {
        PLANNED.get().to_le_bytes().to_vec()
    }

    fn import_state(state: Vec<u8>) -> Result<(), String> {
        let bytes: [u8; 8] = state
            .as_slice()
            .try_into()
            .map_err(|_| format!("expected 8 bytes of state, got {}", state.len()))?;
        PLANNED.set(u64::from_le_bytes(bytes));
        Ok(())
    }
}

#[allow(
    unsafe_code,
    reason = "the canonical-ABI exports wit-bindgen generates"
)]
const _: () = {
    bindings::export!(PolicyV010 with_types_in bindings);
};
