//! The router: one OpenAI request in, a policy's plan of engine calls executed, the answer
//! streamed back.
//!
//! A request flows one way, and the modules follow it:
//!
//! ```text
//! api        admits, parses and tokenizes the OpenAI request; answers JSON or SSE
//!  → Router  asks the request's policy (a switchyard_contract::Planner) for a plan over the
//!            cluster's endpoint snapshot, validates it, runs it, retries and continues
//!  → plan    executes one validated plan: prep_recv → remote_send → start_generate, or forward
//!  → microserving   the HTTP client for the engines' calls
//! cluster    endpoints, health probes, in-flight counts: the snapshot policies see
//! config     flags and TOML, parsed once;   serve   wires it all up and listens
//! discovery  (feature `k8s`) engine pods from the Kubernetes API, fed into the cluster
//! ```
//!
//! Nothing flows backwards but the outcome report to the policy. The router depends on the wire
//! types (`switchyard-wire`), the contract (`switchyard-contract`) and the policy host
//! (`switchyard-policy-host`); never on the reference engine, which is just another engine to
//! it.
#![forbid(unsafe_code)]

pub mod api;
pub mod cluster;
pub mod config;
#[cfg(feature = "k8s")]
pub mod discovery;
pub mod kv_events;
pub mod microserving;
pub mod plan;
mod router;
pub mod serve;

pub use router::{
    DEFAULT_REQUEST_TIMEOUT, RetryBudgetConfig, RetryPolicy, RetryPolicyError, RouteError,
    RouteRequest, Router, RouterConfig, Routing, Summary,
};
