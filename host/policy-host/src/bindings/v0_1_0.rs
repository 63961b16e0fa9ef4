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

super::shared_with_v0_1_0!(stateless: |_| false);

/// Every endpoint, removed ones included (unhealthy): 0.1.0 promises `endpoints[id].id == id`.
fn endpoint(e: &switchyard_contract::EndpointSnapshot) -> Option<wit::Endpoint> {
    Some(wit::Endpoint {
        id: e.id,
        role: role(e.role),
        device_rank: e.device_rank,
        healthy: e.health.is_healthy(),
        in_flight: e.in_flight,
        kv_usage: e.kv_usage,
    })
}
