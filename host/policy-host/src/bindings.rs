//! The generated bindings for `wit/policy.wit` and the conversions between them and the host's
//! own types. This is the only file that names a generated type: the rest of the host speaks
//! `plan::Plan`, `cluster::EndpointSnapshot` and the request/context/outcome types of `policy`.

use switchyard_contract::{
    EndpointSnapshot, FailureKind, Outcome, OutcomeStatus, Plan, PolicyContext, PolicyRequest,
    Role, SendBegin, Step,
};

mod generated {
    wasmtime::component::bindgen!({
        path: "../../wit",
        world: "policy",
    });
}

pub(super) use generated::switchyard::policy::types::{Host as TypesHost, Level, PolicyError};
pub(super) use generated::{Policy as Guest, PolicyImports as GuestImports, PolicyPre as GuestPre};

use generated::switchyard::policy::types as wit;

/// The request as the guest sees it. `prompt-prefix` holds only the tokens the policy asked for
/// in `policy-info.prompt-tokens`: copying a 4k-token prompt into the guest on every call would
/// cost more than the policy itself.
pub(super) fn request(req: &PolicyRequest<'_>, prompt_tokens: u32) -> wit::Request {
    let wanted = usize::try_from(prompt_tokens).unwrap_or(usize::MAX);
    let prefix = &req.prompt[..req.prompt.len().min(wanted)];
    wit::Request {
        id: req.id,
        prompt_len: u32::try_from(req.prompt.len()).unwrap_or(u32::MAX),
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
        endpoints: ctx.endpoints.iter().map(endpoint).collect(),
    }
}

fn endpoint(e: &EndpointSnapshot) -> wit::Endpoint {
    wit::Endpoint {
        id: e.id,
        role: match e.role {
            Role::Any => wit::Role::Any,
            Role::Prefill => wit::Role::Prefill,
            Role::Decode => wit::Role::Decode,
        },
        device_rank: e.device_rank,
        healthy: e.healthy,
        in_flight: e.in_flight,
        kv_usage: e.kv_usage,
    }
}

pub(super) fn plan(plan: wit::Plan) -> Plan {
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
    }
}

pub(super) fn outcome(o: &Outcome) -> wit::Outcome {
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
