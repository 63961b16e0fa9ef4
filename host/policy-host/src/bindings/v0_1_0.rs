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
        stateless: false,
    })
}
