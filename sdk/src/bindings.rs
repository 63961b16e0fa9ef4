//! The bindings `wit-bindgen` generates from `wit/deps/policy@0.2.0/policy.wit`
//! (`switchyard:policy@0.2.0`, frozen), for the world `stateful-policy` (the `policy` world plus `export-state`/`import-state`): a
//! component exports one set of functions, so every SDK policy exports the superset, and a
//! policy that keeps no state answers `export-state` with nothing (see
//! [`crate::Policy::export_state`]). The router treats a component of either world as a policy.
//!
//! Public only so that `export_policy!` can name them from a policy crate; policy authors use
//! the re-exports in [`crate::types`] instead. `wit-bindgen` allows the lints its output trips
//! (docs, unsafe code) itself, except clippy's argument count.

#![expect(
    clippy::too_many_arguments,
    reason = "generated canonical-ABI glue takes a record's flattened fields as parameters"
)]

wit_bindgen::generate!({
    // The frozen 0.2.0 file alone: its siblings in `wit/deps/` are the other versions, which
    // are not this SDK's business.
    path: "../wit/deps/policy@0.2.0/policy.wit",
    world: "stateful-policy",
    // Policy crates export through the SDK: the macro is `#[macro_export]`ed from here and
    // finds these bindings (and the `wit_bindgen` runtime) through this crate's paths, so a
    // policy crate needs no direct `wit-bindgen` dependency.
    pub_export_macro: true,
    export_macro_name: "__export_policy_world",
    default_bindings_module: "::switchyard_policy::bindings",
    runtime_path: "::switchyard_policy::__rt::wit_bindgen::rt",
    additional_derives: [PartialEq],
});
