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

use super::Described;

super::shared_with_v0_1_0!();

pub(super) fn describe(
    guest: &Guest,
    store: &mut Store<StoreState>,
) -> wasmtime::Result<Described> {
    let info = guest.call_describe(store)?;
    Ok(Described {
        language: info.language,
        prompt_tokens: info.prompt_tokens,
        stateless: info.state == wit::State::Stateless,
    })
}
