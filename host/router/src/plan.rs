//! Executing a validated plan ([`switchyard_contract::ValidPlan`]) against the engines, and
//! relaying the generation it starts to the client while counting what was delivered.

mod execute;
mod handoff;
mod relay;

pub use execute::{AttemptBody, AttemptId, ExecError, Execute, Executor, Generation, StepKind};
pub use relay::{Delivered, Event, RelayEnd, relay};
