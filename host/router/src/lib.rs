//! The router: one OpenAI request in, a policy's plan of engine calls executed, the answer
//! streamed back.
//!
//! A request flows one way, and the modules follow it:
//!
//! ```text
//! api        admits, parses and tokenizes the OpenAI request; answers JSON or SSE
//!  → Router  asks the request's policy (a switchyard_contract::Planner) for a plan over the
//!            cluster's endpoint snapshot, validates it, runs it, retries and continues
//!  → plan    executes one validated plan through its protocol's steps (MLC's prep_recv →
//!            remote_send → start_generate, vLLM's or SGLang's handoff, a forward) and relays
//!            the generation; never looks back up at the Router or api
//!  → engine_client  the HTTP client for the engines' calls, per protocol, and their probes
//! cluster    endpoints, health probes, in-flight counts: the snapshot policies see
//! config     flags and TOML, parsed once;   serve   wires it all up and listens
//! epp        the same router as a gateway's Endpoint Picker (Envoy ext_proc): plans, and
//!            answers with the plan's endpoints instead of running it
//! discovery  (feature `k8s`) engine pods from the Kubernetes API, fed into the cluster
//! kv_events  subscribers to the engines' KV events, keeping the KV index of every endpoint
//! sidecar    the same router in a decode pod: runs the handoff a gateway's EPP names in
//!            `x-prefiller-host-port`, planned by a built-in planner instead of a policy
//! telemetry  OpenTelemetry traces: the exporter, the request span, `traceparent` in and out
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
pub mod engine_client;
pub mod epp;
mod http1;
pub mod kv_events;
mod pem;
pub mod plan;
mod router;
pub mod serve;
pub mod sidecar;
pub mod telemetry;

pub use pem::PemError;
pub use router::{
    DEFAULT_REQUEST_TIMEOUT, Done, Event, Failed, Flow, PromptError, RetryBudgetConfig,
    RetryPolicy, RetryPolicyError, RouteError, RoutePrompt, RouteRequest, Router, RouterConfig,
    Routing, Summary,
};
