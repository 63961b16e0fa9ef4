//! The generated bindings of every contract version the host loads, one module per version
//! (`v0_1_0`, `v0_2_0`, as Zed's extension host and Spin keep theirs), and the one place that
//! dispatches over them. This module and its children are the only ones that name a generated
//! type: the rest of the host speaks `switchyard_contract`'s plan, snapshot, request, context
//! and outcome types, and [`Guest`]/[`GuestPre`], which hide the version.
//!
//! A component is matched to a version by type-checking it against each version's world,
//! newest first: the worlds differ in their exports' types (0.2.0's `policy-info` has a
//! `state`), so at most one matches.

mod v0_1_0;
mod v0_2_0;

use std::fmt;

use switchyard_contract::{Outcome, Plan, PolicyContext, PolicyRequest, Reads};
use wasmtime::Store;
use wasmtime::component::{Instance, InstancePre, Linker};

use super::sandbox::StoreState;

/// A released (or, for the newest, upcoming) version of the `switchyard:policy` contract.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
pub enum Contract {
    /// `switchyard:policy@0.1.0`, frozen: one instance per policy, calls one at a time.
    #[serde(rename = "0.1.0")]
    V0_1_0,
    /// `switchyard:policy@0.2.0`: a policy declares whether it keeps state between calls.
    #[serde(rename = "0.2.0")]
    V0_2_0,
}

impl Contract {
    /// Every version the host loads, newest first (the order components are matched in).
    pub const ALL: [Contract; 2] = [Contract::V0_2_0, Contract::V0_1_0];

    /// The version number, e.g. `0.2.0`.
    pub fn version(self) -> &'static str {
        match self {
            Contract::V0_1_0 => "0.1.0",
            Contract::V0_2_0 => "0.2.0",
        }
    }
}

impl fmt::Display for Contract {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "switchyard:policy@{}", self.version())
    }
}

/// What `describe` answered, read once at load, in host terms.
pub(super) struct Described {
    pub(super) language: String,
    pub(super) prompt_tokens: u32,
    /// The policy keeps no state between calls (0.2.0's `state: stateless`); a 0.1.0
    /// component never says so.
    pub(super) stateless: bool,
    /// What it reads (0.2.0's `reads`, `prompt-tokens > 0` counting as the prompt); a 0.1.0
    /// component reads everything.
    pub(super) reads: Reads,
}

/// A policy's own error answer to `translate-request`.
pub(super) enum Refusal {
    Unavailable(String),
    Rejected(String),
    Internal(String),
}

/// Add the world imports of `contract` (its `log`, its `types` interface) to `linker`.
pub(super) fn add_to_linker(
    contract: Contract,
    linker: &mut Linker<StoreState>,
) -> wasmtime::Result<()> {
    match contract {
        Contract::V0_1_0 => v0_1_0::add_to_linker(linker),
        Contract::V0_2_0 => v0_2_0::add_to_linker(linker),
    }
}

/// A component type-checked against one version's world: instantiates it cheaply, any number
/// of times.
pub(super) enum GuestPre {
    V0_1_0(v0_1_0::GuestPre<StoreState>),
    V0_2_0(v0_2_0::GuestPre<StoreState>),
}

impl GuestPre {
    /// Check `pre` (the component linked with `contract`'s linker) against `contract`'s world.
    pub(super) fn new(contract: Contract, pre: InstancePre<StoreState>) -> wasmtime::Result<Self> {
        Ok(match contract {
            Contract::V0_1_0 => GuestPre::V0_1_0(v0_1_0::GuestPre::new(pre)?),
            Contract::V0_2_0 => GuestPre::V0_2_0(v0_2_0::GuestPre::new(pre)?),
        })
    }

    pub(super) fn contract(&self) -> Contract {
        match self {
            GuestPre::V0_1_0(_) => Contract::V0_1_0,
            GuestPre::V0_2_0(_) => Contract::V0_2_0,
        }
    }

    /// Instantiate through the raw `InstancePre` rather than the generated one, so the caller
    /// can look optional exports (the state carry-over functions) up on the same instance.
    pub(super) fn instantiate(
        &self,
        store: &mut Store<StoreState>,
    ) -> wasmtime::Result<(Guest, Instance)> {
        match self {
            GuestPre::V0_1_0(pre) => {
                let instance = pre.instance_pre().instantiate(&mut *store)?;
                Ok((
                    Guest::V0_1_0(v0_1_0::Guest::new(store, &instance)?),
                    instance,
                ))
            }
            GuestPre::V0_2_0(pre) => {
                let instance = pre.instance_pre().instantiate(&mut *store)?;
                Ok((
                    Guest::V0_2_0(v0_2_0::Guest::new(store, &instance)?),
                    instance,
                ))
            }
        }
    }
}

/// A live instance's exports, whatever its version.
pub(super) enum Guest {
    V0_1_0(v0_1_0::Guest),
    V0_2_0(v0_2_0::Guest),
}

impl Guest {
    pub(super) fn init(
        &self,
        store: &mut Store<StoreState>,
        config: &str,
    ) -> wasmtime::Result<Result<(), String>> {
        match self {
            Guest::V0_1_0(guest) => guest.call_init(store, config),
            Guest::V0_2_0(guest) => guest.call_init(store, config),
        }
    }

    pub(super) fn describe(&self, store: &mut Store<StoreState>) -> wasmtime::Result<Described> {
        match self {
            Guest::V0_1_0(guest) => v0_1_0::describe(guest, store),
            Guest::V0_2_0(guest) => v0_2_0::describe(guest, store),
        }
    }

    /// `translate-request`, with only the first `prompt_tokens` prompt ids copied in.
    pub(super) fn translate(
        &self,
        store: &mut Store<StoreState>,
        req: &PolicyRequest<'_>,
        ctx: &PolicyContext,
        prompt_tokens: u32,
    ) -> wasmtime::Result<Result<Plan, Refusal>> {
        match self {
            Guest::V0_1_0(guest) => v0_1_0::translate(guest, store, req, ctx, prompt_tokens),
            Guest::V0_2_0(guest) => v0_2_0::translate(guest, store, req, ctx, prompt_tokens),
        }
    }

    pub(super) fn on_complete(
        &self,
        store: &mut Store<StoreState>,
        outcome: &Outcome,
    ) -> wasmtime::Result<()> {
        match self {
            Guest::V0_1_0(guest) => v0_1_0::on_complete(guest, store, outcome),
            Guest::V0_2_0(guest) => v0_2_0::on_complete(guest, store, outcome),
        }
    }
}

/// The parts of a version module that are the same in every version so far: the conversions
/// between the host's types and the version's generated ones (0.2.0's request, context, plan
/// and outcome have 0.1.0's shape), the calls, and the `log` import; `stateless` and `reads`
/// read a `policy-info`'s declarations, and `prompt_len` writes the request's `prompt-len` from
/// the prompt the host has (`None`: not tokenized). Expanded inside a version module whose generated `types`
/// interface is `wit`, whose world is `Guest` and whose world imports trait is `GuestImports`,
/// and which converts an endpoint itself (`fn endpoint(&EndpointSnapshot) ->
/// Option<wit::Endpoint>`: 0.2.0's says why an endpoint is down and leaves removed ones out).
/// A version whose types diverge further writes those parts itself. `steps_beyond_v0_1_0` holds the match arms converting a version's newer
/// `step` cases; `request_beyond_v0_1_0` each newer `request` field, read from the host's request
/// by a function.
macro_rules! shared_with_v0_1_0 {
    (
        stateless: $stateless:expr,
        reads: $reads:expr,
        prompt_len: $prompt_len:expr,
        steps_beyond_v0_1_0: { $($beyond:tt)* },
        request_beyond_v0_1_0: { $($field:ident: $read:expr),* $(,)? }
    ) => {
        use switchyard_contract::{
            FailureKind, Outcome, OutcomeStatus, Plan, PolicyContext, PolicyRequest, Role,
            SendBegin, Step,
        };
        use wasmtime::Store;
        use wasmtime::component::{HasSelf, Linker};

        use crate::bindings::{Described, Refusal};
        use crate::sandbox::{Level, StoreState};

        pub(super) fn describe(
            guest: &Guest,
            store: &mut Store<StoreState>,
        ) -> wasmtime::Result<Described> {
            let info = guest.call_describe(store)?;
            let stateless: fn(&wit::PolicyInfo) -> bool = $stateless;
            let reads: fn(&wit::PolicyInfo) -> switchyard_contract::Reads = $reads;
            Ok(Described {
                stateless: stateless(&info),
                reads: reads(&info),
                language: info.language,
                prompt_tokens: info.prompt_tokens,
            })
        }

        pub(super) fn add_to_linker(linker: &mut Linker<StoreState>) -> wasmtime::Result<()> {
            Guest::add_to_linker::<StoreState, HasSelf<StoreState>>(linker, |s| s)
        }

        /// The `types` interface has no functions; the generated bindings still want it
        /// implemented.
        impl wit::Host for StoreState {}

        impl GuestImports for StoreState {
            fn log(&mut self, level: wit::Level, message: String) {
                let level = match level {
                    wit::Level::Trace => Level::Trace,
                    wit::Level::Debug => Level::Debug,
                    wit::Level::Info => Level::Info,
                    wit::Level::Warn => Level::Warn,
                    wit::Level::Error => Level::Error,
                };
                self.log(level, &message);
            }
        }

        pub(super) fn translate(
            guest: &Guest,
            store: &mut Store<StoreState>,
            req: &PolicyRequest<'_>,
            ctx: &PolicyContext,
            prompt_tokens: u32,
        ) -> wasmtime::Result<Result<Plan, Refusal>> {
            let answer =
                guest.call_translate_request(store, &request(req, prompt_tokens), &context(ctx))?;
            Ok(answer.map(plan).map_err(|error| match error {
                wit::PolicyError::Unavailable(message) => Refusal::Unavailable(message),
                wit::PolicyError::Rejected(message) => Refusal::Rejected(message),
                wit::PolicyError::Internal(message) => Refusal::Internal(message),
            }))
        }

        pub(super) fn on_complete(
            guest: &Guest,
            store: &mut Store<StoreState>,
            outcome: &Outcome,
        ) -> wasmtime::Result<()> {
            guest.call_on_complete(store, self::outcome(outcome))
        }

        /// The request as the guest sees it. `prompt-prefix` holds only the tokens the policy
        /// asked for in `policy-info.prompt-tokens`: copying a 4k-token prompt into the guest on
        /// every call would cost more than the policy itself.
        pub(super) fn request(req: &PolicyRequest<'_>, prompt_tokens: u32) -> wit::Request {
            let wanted = usize::try_from(prompt_tokens).unwrap_or(usize::MAX);
            let prompt = req.prompt.unwrap_or_default();
            let prefix = &prompt[..prompt.len().min(wanted)];
            let prompt_len: fn(Option<u32>) -> _ = $prompt_len;
            wit::Request {
                id: req.id,
                prompt_len: prompt_len(
                    req.prompt.map(|p| u32::try_from(p.len()).unwrap_or(u32::MAX)),
                ),
                prompt_prefix: prefix.to_vec(),
                max_tokens: req.max_tokens,
                stream: req.stream,
                model: req.model.to_owned(),
                user: req.user.map(str::to_owned),
                headers: req
                    .headers
                    .iter()
                    .map(|(name, value)| wit::Header {
                        name: name.clone(),
                        value: value.clone(),
                    })
                    .collect(),
                $($field: ($read)(req),)*
            }
        }

        pub(super) fn context(ctx: &PolicyContext) -> wit::Context {
            wit::Context {
                attempt: ctx.attempt,
                last_failure: ctx.last_failure.map(|f| wit::Failure {
                    kind: match f.kind {
                        FailureKind::Preempted => wit::FailureKind::Preempted,
                        FailureKind::EndpointError => wit::FailureKind::EndpointError,
                        FailureKind::Timeout => wit::FailureKind::Timeout,
                    },
                    endpoint: f.endpoint,
                }),
                endpoints: ctx.endpoints.iter().filter_map(endpoint).collect(),
            }
        }

        fn role(role: Role) -> wit::Role {
            match role {
                Role::Any => wit::Role::Any,
                Role::Prefill => wit::Role::Prefill,
                Role::Decode => wit::Role::Decode,
            }
        }

        fn plan(plan: wit::Plan) -> Plan {
            Plan {
                steps: plan.steps.into_iter().map(step).collect(),
            }
        }

        fn step(step: wit::Step) -> Step {
            match step {
                wit::Step::PrepRecv(s) => Step::PrepRecv {
                    decode: s.decode,
                    end: s.end,
                },
                wit::Step::RemoteSend(s) => Step::RemoteSend {
                    prefill: s.prefill,
                    decode: s.decode,
                    begin: match s.begin {
                        wit::SendBegin::PrefixMatched => SendBegin::PrefixMatched,
                        wit::SendBegin::At(p) => SendBegin::At(p),
                    },
                    end: s.end,
                },
                wit::Step::StartGenerate(s) => Step::StartGenerate {
                    decode: s.decode,
                    begin: s.begin,
                },
                wit::Step::Forward(endpoint) => Step::Forward { endpoint },
                $($beyond)*
            }
        }

        fn outcome(o: &Outcome) -> wit::Outcome {
            wit::Outcome {
                request_id: o.request_id,
                status: match o.status {
                    OutcomeStatus::Ok => wit::Status::Ok,
                    OutcomeStatus::Failed => wit::Status::Failed,
                    OutcomeStatus::Cancelled => wit::Status::Cancelled,
                },
                attempts: o.attempts,
                generator: o.generator,
                prefix_matched: o.prefix_matched,
                completion_tokens: o.completion_tokens,
                ttft_us: o.ttft_us,
                e2e_us: o.e2e_us,
            }
        }
    };
}

use shared_with_v0_1_0;

#[cfg(test)]
mod tests;
