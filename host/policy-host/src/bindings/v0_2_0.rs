//! `switchyard:policy@0.2.0` (`wit/policy.wit`), the newest contract: 0.1.0 plus a policy's
//! declaration of whether it keeps state between calls (`policy-info.state`).

mod generated {
    wasmtime::component::bindgen!({
        path: "../../wit/policy.wit",
        world: "policy",
    });
}

pub(super) use generated::{Policy as Guest, PolicyImports as GuestImports, PolicyPre as GuestPre};

use generated::switchyard::policy::types as wit;

super::shared_with_v0_1_0!(stateless: |info| info.state == wit::State::Stateless);
