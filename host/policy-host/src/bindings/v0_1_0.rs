//! `switchyard:policy@0.1.0` (`wit/deps/policy@0.1.0/policy.wit`), frozen: the first released
//! contract. Its components are always run as one instance, one call at a time, whatever they
//! do with state: 0.1.0 promised that calls are serialised.

mod generated {
    wasmtime::component::bindgen!({
        path: "../../wit/deps/policy@0.1.0",
        world: "policy",
    });
}

pub(super) use generated::{Policy as Guest, PolicyImports as GuestImports, PolicyPre as GuestPre};

use generated::switchyard::policy::types as wit;

super::shared_with_v0_1_0!(
    stateless: |_| false,
    // A 0.1.0 policy says nothing of what it reads: it gets everything, as it always did (the
    // router tokenizes every prompt it plans, so the length is there).
    reads: |_| switchyard_contract::Reads::ALL,
    prompt_len: |len| len.unwrap_or(0),
    steps_beyond_v0_1_0: {},
    request_beyond_v0_1_0: {}
);

/// Every endpoint, removed ones included (unhealthy): 0.1.0 promises `endpoints[id].id == id`.
/// A 0.1.0 policy plans MLC microserving and nothing else, so an endpoint speaking another
/// protocol is listed as unhealthy too: the policy never plans on it.
fn endpoint(e: &switchyard_contract::EndpointSnapshot) -> Option<wit::Endpoint> {
    Some(wit::Endpoint {
        id: e.id,
        role: role(e.role),
        device_rank: e.device_rank,
        healthy: e.health.is_healthy() && e.protocol == switchyard_contract::Protocol::Mlc,
        in_flight: e.in_flight,
        kv_usage: e.kv_usage,
    })
}
