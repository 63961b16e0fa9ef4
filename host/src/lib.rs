//! switchyard: a router for disaggregated LLM serving whose routing policies are WebAssembly
//! components.
//!
//! A request flows one way: `api` parses and tokenizes it → `policy` asks the policy component
//! for a plan over a `cluster` snapshot → `plan` validates it and runs it through
//! `microserving` → the response streams back through `api`. `engine` is the reference
//! MLC-microserving engine used for development, tests and benchmarks; `kv` is the KV-cache
//! transfer data path between engines.
#![deny(unsafe_code)]

pub mod api;
pub mod bench;
pub mod cluster;
pub mod config;
pub mod engine;
pub mod kv;
pub mod microserving;
pub mod plan;
pub mod policy;
pub mod serve;
#[cfg(feature = "test-util")]
pub mod test_util;
pub mod up;
