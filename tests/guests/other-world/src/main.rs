//! Built for `wasm32-wasip2`, an empty binary is a component of the world `wasi:cli/command`:
//! a well-formed component that exports `wasi:cli/run` instead of the policy world.

fn main() {}
