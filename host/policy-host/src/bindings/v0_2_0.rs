//! `switchyard:policy@0.2.0` (`wit/deps/policy@0.2.0/policy.wit`), the newest contract: 0.1.0 plus a policy's
//! declaration of whether it keeps state between calls (`policy-info.state`), why an endpoint
//! is down (`endpoint.down-reason`), the load each engine reports (`endpoint.running`,
//! `endpoint.waiting`), a key every router replica agrees on (`endpoint.address-hash`), the
//! prompt's cached prefix on each endpoint (`endpoint.cached-prefix`), the prompt tokens this
//! router has sent each endpoint and it has not prefilled yet (`endpoint.pending-prefill`),
//! endpoint protocols (`endpoint.protocol`) with the `handoff` step that disaggregates on any,
//! the request's flow control (`request.priority`, `request.tenant`, `request.deadline-ms`),
//! the base model of a LoRA adapter (`request.base-model`), and what a policy reads
//! (`policy-info.reads`), with `request.prompt-len` given only when the prompt was tokenized.

mod generated {
    wasmtime::component::bindgen!({
        path: "../../wit/deps/policy@0.2.0/policy.wit",
        world: "policy",
    });
}

pub(super) use generated::{Policy as Guest, PolicyImports as GuestImports, PolicyPre as GuestPre};

use generated::switchyard::policy::types as wit;

super::shared_with_v0_1_0!(
    stateless: |info| info.state == wit::State::Stateless,
    reads: |info| switchyard_contract::Reads {
        prompt: info.reads.contains(wit::Reads::PROMPT_LENGTH) || info.prompt_tokens > 0,
        outcomes: info.reads.contains(wit::Reads::OUTCOMES),
    },
    prompt_len: |len| len,
    steps_beyond_v0_1_0: {
        wit::Step::Handoff(h) => Step::Handoff {
            prefill: h.prefill,
            decode: h.decode,
        },
    },
    request_beyond_v0_1_0: {
        priority: |req: &PolicyRequest<'_>| req.flow.priority,
        tenant: |req: &PolicyRequest<'_>| req.flow.tenant.map(str::to_owned),
        deadline_ms: |req: &PolicyRequest<'_>| req.flow.deadline_ms,
        base_model: |req: &PolicyRequest<'_>| req.base_model.map(str::to_owned),
    }
);

/// The endpoint as a 0.2.0 policy sees it; `None` for a removed one, which 0.2.0 leaves out
/// (ids are never reused, so a long-lived router would otherwise send every endpoint it ever
/// had across the sandbox boundary on every call).
fn endpoint(e: &switchyard_contract::EndpointSnapshot) -> Option<wit::Endpoint> {
    use switchyard_contract::{Health, Protocol};
    let down_reason = match e.health {
        Health::Removed => return None,
        Health::Healthy => None,
        Health::NotReady => Some(wit::DownReason::NotReady),
        Health::Ejected => Some(wit::DownReason::Ejected),
        Health::Draining => Some(wit::DownReason::Draining),
    };
    Some(wit::Endpoint {
        id: e.id,
        protocol: match e.protocol {
            Protocol::Mlc => wit::Protocol::Mlc,
            Protocol::Vllm => wit::Protocol::Vllm,
            Protocol::Sglang => wit::Protocol::Sglang,
            Protocol::Openai => wit::Protocol::Openai,
        },
        role: role(e.role),
        device_rank: e.device_rank,
        healthy: e.health.is_healthy(),
        down_reason,
        in_flight: e.in_flight,
        kv_usage: e.kv_usage,
        running: e.running,
        waiting: e.waiting,
        address_hash: e.address_hash,
        cached_prefix: e.cached_prefix,
        pending_prefill: e.pending_prefill,
    })
}
