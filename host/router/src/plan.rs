//! Executing a validated plan ([`switchyard_contract::ValidPlan`]) against the engines, and
//! relaying the generation it starts to the client while counting what was delivered.
//!
//! One way down: [`Executor::execute`] hands the plan to its protocol's module (MLC's
//! microserving steps, vLLM's or SGLang's handoff, a forward), which runs its legs over shared
//! helpers and the engine client; [`relay`] then reads the generation. Every failure is one
//! [`ExecError`], classified where it is detected ([`Origin`], retryable, whether it blames the
//! endpoint). This module knows nothing of the router above it: the relay reports how the
//! generation ended ([`RelayEnd`]) and sends text through the caller's [`TextSink`].

mod attempt;
mod error;
mod execute;
mod forward;
mod leg;
mod mlc;
mod relay;
mod sglang;
mod vllm;

#[cfg(test)]
mod tests;

pub use attempt::{AttemptBody, AttemptId, CachedPrefixes, Generation};
pub use error::{Cause, ExecError, Origin, StepKind};
pub use execute::{Execute, Executor};
pub use relay::{ClientGone, Delivered, RelayEnd, TextSink, relay};
