//! The contract between the router and its policies, in the host's own types: the plan a
//! policy returns and its validation, the endpoint snapshot and request a policy sees, the
//! outcome it hears, and the [`Planner`] trait the router plans through.
//!
//! This crate owns the *meaning* of a plan; the WIT world (`wit/deps/policy@0.2.0/policy.wit`) is its wire form,
//! converted to and from these types by `switchyard-policy-host` alone. It must never depend
//! on wasmtime, on an HTTP stack or on any other switchyard crate: the router and the policy
//! host both depend on it, and neither may reach the other through it.
//!
//! ```
//! use switchyard_contract::{
//!     EndpointSnapshot, Plan, SendBegin, Step, ValidPlan, validate,
//! };
//!
//! let endpoints: Vec<EndpointSnapshot> = (0..2).map(EndpointSnapshot::synthetic).collect();
//! let plan = Plan {
//!     steps: vec![
//!         Step::PrepRecv { decode: 1, end: -1 },
//!         Step::RemoteSend { prefill: 0, decode: 1, begin: SendBegin::PrefixMatched, end: -1 },
//!         Step::StartGenerate { decode: 1, begin: -1 },
//!     ],
//! };
//! let valid = validate(&plan, 10, &endpoints).expect("a valid MLC plan");
//! assert!(matches!(valid, ValidPlan::Disagg { decode: 1, end: 9, .. }));
//! ```
#![forbid(unsafe_code)]

mod endpoint;
mod plan;
mod planner;
mod policy;
mod validate;

pub use endpoint::{EndpointSnapshot, Health, Protocol, Role, address_hash};
pub use plan::{EndpointId, Plan, SendBegin, Step};
pub use planner::{Planner, PlanningError};
pub use policy::{
    Failure, FailureKind, Outcome, OutcomeStatus, PolicyContext, PolicyRequest, Reads, RequestFlow,
    TranslateError,
};
pub use validate::{PlanError, RemoteSend, ValidPlan, validate};
