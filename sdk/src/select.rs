//! Endpoint selection helpers shared by policies.
//!
//! All of them break ties by the lowest endpoint id, as MLC's router does (Python's `min`
//! returns the first minimum), so plans are deterministic for a given snapshot.

use crate::types::{Context, Endpoint, EndpointId, Position, Protocol, Role};

/// The healthy endpoints, in id order.
pub fn healthy<'a>(
    endpoints: impl IntoIterator<Item = &'a Endpoint>,
) -> impl Iterator<Item = &'a Endpoint> {
    endpoints.into_iter().filter(|e| e.healthy)
}

/// The endpoints whose operator-assigned role is `role`, in id order (healthy or not).
pub fn by_role<'a>(
    endpoints: impl IntoIterator<Item = &'a Endpoint>,
    role: Role,
) -> impl Iterator<Item = &'a Endpoint> {
    endpoints.into_iter().filter(move |e| e.role == role)
}

/// The healthy endpoint accepted by `filter` with the fewest requests in flight
/// (ties → lowest id), or `None` when there is none.
pub fn least_loaded<'a>(
    endpoints: impl IntoIterator<Item = &'a Endpoint>,
    filter: impl Fn(&Endpoint) -> bool,
) -> Option<&'a Endpoint> {
    healthy(endpoints)
        .filter(|e| filter(e))
        .min_by_key(|e| (e.in_flight, e.id))
}

/// The endpoint the previous attempt failed on, when this is a retry.
pub fn failed_endpoint(context: &Context) -> Option<EndpointId> {
    if context.attempt <= 1 {
        return None;
    }
    context.last_failure.as_ref().map(|f| f.endpoint)
}

/// The healthy endpoints this attempt may use: all of them, minus the one the previous
/// attempt failed on when any other is healthy (retrying on the endpoint that just failed
/// is the last resort, not the default).
pub fn candidates(context: &Context) -> Vec<&Endpoint> {
    let healthy: Vec<&Endpoint> = healthy(&context.endpoints).collect();
    match failed_endpoint(context) {
        Some(failed) if healthy.iter().any(|e| e.id != failed) => {
            healthy.into_iter().filter(|e| e.id != failed).collect()
        }
        _ => healthy,
    }
}

/// The KV window end for MLC's prefill/decode balance: `-1` (the prefill endpoint computes
/// all but the last token) when `factor` is 0, else `int((1 - factor) * prompt_len)` so the
/// decode endpoint computes the last `factor` share itself. Clamped to `0 <= end < prompt_len`
/// for factors outside `[0, 1)`.
pub fn balance_end(prompt_len: u32, factor: f64) -> Position {
    if factor == 0.0 {
        return -1;
    }
    // `as` truncates toward zero like Python's `int()`, and saturates (NaN → 0).
    let end = ((1.0 - factor) * f64::from(prompt_len)) as i64;
    let last = i64::from(prompt_len.max(1) - 1);
    Position::try_from(end.clamp(0, last)).unwrap_or(Position::MAX)
}

/// Whether a [`crate::Plan::handoff`] may prefill on `e`. Roles bind on vLLM (a `decode`
/// endpoint never prefills) and SGLang (an engine's disaggregation mode is fixed); MLC engines
/// are role-less, and OpenAI endpoints have no handoff. The router checks the same rules.
pub fn can_prefill(e: &Endpoint) -> bool {
    match e.protocol {
        Protocol::Mlc => true,
        Protocol::Vllm => e.role != Role::Decode,
        Protocol::Sglang => e.role == Role::Prefill,
        Protocol::Openai => false,
    }
}

/// Whether a [`crate::Plan::handoff`] may decode on `e` (see [`can_prefill`]).
pub fn can_decode(e: &Endpoint) -> bool {
    match e.protocol {
        Protocol::Mlc => true,
        Protocol::Vllm => e.role != Role::Prefill,
        Protocol::Sglang => e.role == Role::Decode,
        Protocol::Openai => false,
    }
}

/// Whether `e` serves a whole request by itself ([`crate::Plan::forward`]): not a vLLM
/// `prefill` endpoint, and of SGLang engines only a role-less (non-disaggregated) one.
pub fn serves_alone(e: &Endpoint) -> bool {
    match e.protocol {
        Protocol::Mlc | Protocol::Openai => true,
        Protocol::Vllm => e.role != Role::Prefill,
        Protocol::Sglang => e.role == Role::Any,
    }
}
