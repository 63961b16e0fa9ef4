//! Pure plan checks. A plan that fails here is the policy's error, never a request to an engine:
//! an MLC engine crashes on out-of-range windows, so nothing unchecked may reach one.

use crate::endpoint::{EndpointSnapshot, Protocol, Role};
use crate::plan::{EndpointId, Plan, SendBegin, Step};

/// Why a plan was rejected, naming the step (0-based) it is about.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}", describe(.step, .step_name, .reason))]
pub struct PlanError {
    /// Index of the offending step, or `None` for the plan as a whole.
    pub step: Option<usize>,
    /// The step's WIT name (`prep-recv`, ...), empty for the plan as a whole.
    pub step_name: &'static str,
    pub reason: String,
}

fn describe(step: &Option<usize>, name: &str, reason: &str) -> String {
    match step {
        Some(i) => format!("step {i} ({name}): {reason}"),
        None => format!("plan: {reason}"),
    }
}

/// A plan checked against one prompt length and endpoint snapshot, positions resolved.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case", tag = "kind")]
pub enum ValidPlan {
    /// Send the whole request to one endpoint.
    Forward { endpoint: EndpointId },
    /// MLC: prep-recv on `decode` for `[0, end)`, optionally remote-send from `prefill`, then
    /// start-generate on `decode` from `end`.
    Disagg {
        decode: EndpointId,
        /// Resolved KV window end: `0 <= end < prompt_len`.
        end: u32,
        /// Absent when the plan sends no KV (D prefills everything itself).
        remote_send: Option<RemoteSend>,
    },
    /// vLLM's NIXL handoff: the prefill leg on `prefill`, then the decode leg on `decode` with
    /// the `kv_transfer_params` the prefill answered; `decode` pulls the KV.
    Vllm {
        prefill: EndpointId,
        decode: EndpointId,
    },
    /// SGLang's bootstrap handoff: the same body to both at once, joined by a fresh bootstrap
    /// room on `prefill`, which pushes the KV to `decode`.
    Sglang {
        prefill: EndpointId,
        decode: EndpointId,
    },
}

/// The resolved remote-send of a disaggregated plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct RemoteSend {
    pub prefill: EndpointId,
    /// `None` = from the prefix the decode endpoint reports; otherwise a resolved position.
    pub begin: Option<u32>,
}

impl ValidPlan {
    /// The endpoint that generates the tokens the client sees.
    pub fn generator(&self) -> EndpointId {
        match self {
            ValidPlan::Forward { endpoint } => *endpoint,
            ValidPlan::Disagg { decode, .. }
            | ValidPlan::Vllm { decode, .. }
            | ValidPlan::Sglang { decode, .. } => *decode,
        }
    }

    /// The endpoint that computes prompt KV for the generator, when another one does: a
    /// handoff's prefill endpoint, or the source of MLC's `remote-send` (none without one).
    pub fn prefiller(&self) -> Option<EndpointId> {
        match self {
            ValidPlan::Forward { .. } => None,
            ValidPlan::Disagg { remote_send, .. } => remote_send.map(|send| send.prefill),
            ValidPlan::Vllm { prefill, .. } | ValidPlan::Sglang { prefill, .. } => Some(*prefill),
        }
    }
}

/// Check `plan` for a prompt of `prompt_len` tokens against `endpoints` (ordered by id).
///
/// Accepted shapes are `[forward]`, `[handoff]` and, on MLC endpoints,
/// `[prep-recv, remote-send?, start-generate]` on one decode endpoint; everything else is
/// rejected with the first step that breaks the rules, including what the endpoints'
/// protocols cannot do (a microserving step on a vLLM endpoint, a handoff between protocols, a
/// plain request to an SGLang prefill engine).
pub fn validate(
    plan: &Plan,
    prompt_len: u32,
    endpoints: &[EndpointSnapshot],
) -> Result<ValidPlan, PlanError> {
    let Some((last, body)) = plan.steps.split_last() else {
        return Err(whole("is empty: it needs a start-generate or forward step"));
    };
    for (i, step) in plan.steps.iter().enumerate() {
        check_endpoints(i, step, endpoints)?;
        check_protocols(i, step, endpoints)?;
    }
    let last_index = plan.steps.len() - 1;
    if let Some(i) = body.iter().position(is_generating) {
        return Err(at(
            i,
            &body[i],
            "a generating step must be the last step of the plan",
        ));
    }
    match last {
        Step::Forward { endpoint } if body.is_empty() => Ok(ValidPlan::Forward {
            endpoint: *endpoint,
        }),
        Step::Forward { .. } => Err(at(
            0,
            &body[0],
            "a forward plan has no other steps: forward sends the whole request",
        )),
        Step::Handoff { prefill, decode } if body.is_empty() => {
            Ok(handoff(*prefill, *decode, prompt_len, endpoints))
        }
        Step::Handoff { .. } => Err(at(
            0,
            &body[0],
            "a handoff plan has no other steps: the handoff is the whole disaggregated flow",
        )),
        Step::StartGenerate { decode, begin } => {
            validate_disagg(body, last_index, *decode, *begin, prompt_len)
        }
        other => Err(at(
            last_index,
            other,
            "the last step must be start-generate, handoff or forward",
        )),
    }
}

/// A checked handoff, as its protocol runs it. On MLC it is the MLC router's own flow: the
/// prefill computes all but the last token and sends what D's prefix cache lacks.
fn handoff(
    prefill: EndpointId,
    decode: EndpointId,
    prompt_len: u32,
    endpoints: &[EndpointSnapshot],
) -> ValidPlan {
    match protocol_of(decode, endpoints) {
        Protocol::Vllm => ValidPlan::Vllm { prefill, decode },
        Protocol::Sglang => ValidPlan::Sglang { prefill, decode },
        // `check_protocols` lets no openai endpoint into a handoff.
        Protocol::Mlc | Protocol::Openai => ValidPlan::Disagg {
            decode,
            end: prompt_len.saturating_sub(1),
            remote_send: Some(RemoteSend {
                prefill,
                begin: None,
            }),
        },
    }
}

fn validate_disagg(
    body: &[Step],
    generate_index: usize,
    generate_decode: EndpointId,
    generate_begin: i32,
    prompt_len: u32,
) -> Result<ValidPlan, PlanError> {
    let Some(Step::PrepRecv { decode, end }) = body.first() else {
        return Err(match body.first() {
            Some(step) => at(
                0,
                step,
                "a plan ending in start-generate must begin with a prep-recv on its decode endpoint",
            ),
            None => PlanError {
                step: Some(generate_index),
                step_name: "start-generate",
                reason: "start-generate needs a prep-recv on the same decode endpoint first".into(),
            },
        });
    };
    let prep = &body[0];
    let end = resolve(*end, prompt_len).map_err(|r| at(0, prep, &r))?;
    let remote_send = match &body[1..] {
        [] => None,
        [
            send @ Step::RemoteSend {
                prefill,
                decode: send_decode,
                begin,
                end: send_end,
            },
        ] => {
            if send_decode != decode {
                return Err(at(
                    1,
                    send,
                    &format!(
                        "serves decode endpoint {send_decode} but the prep-recv is on endpoint {decode}"
                    ),
                ));
            }
            if prefill == decode {
                return Err(at(
                    1,
                    send,
                    "prefill and decode must be different endpoints",
                ));
            }
            let send_end = resolve(*send_end, prompt_len).map_err(|r| at(1, send, &r))?;
            if send_end != end {
                return Err(at(
                    1,
                    send,
                    &format!("end {send_end} differs from the prep-recv's end {end}"),
                ));
            }
            let begin = match begin {
                SendBegin::PrefixMatched => None,
                SendBegin::At(p) => {
                    let b = resolve(*p, prompt_len).map_err(|r| at(1, send, &r))?;
                    if b > end {
                        return Err(at(1, send, &format!("begin {b} is after end {end}")));
                    }
                    Some(b)
                }
            };
            Some(RemoteSend {
                prefill: *prefill,
                begin,
            })
        }
        [_, extra, ..] => {
            return Err(at(
                2,
                extra,
                "a plan has at most one remote-send, between prep-recv and start-generate",
            ));
        }
        [other] => {
            return Err(at(
                1,
                other,
                "only a remote-send may stand between prep-recv and start-generate",
            ));
        }
    };
    if generate_decode != *decode {
        return Err(PlanError {
            step: Some(generate_index),
            step_name: "start-generate",
            reason: format!(
                "runs on endpoint {generate_decode} but the prep-recv reserved KV on endpoint {decode}"
            ),
        });
    }
    let begin = resolve(generate_begin, prompt_len).map_err(|reason| PlanError {
        step: Some(generate_index),
        step_name: "start-generate",
        reason,
    })?;
    if begin != end {
        return Err(PlanError {
            step: Some(generate_index),
            step_name: "start-generate",
            reason: format!("begin {begin} must equal the prep-recv's end {end}"),
        });
    }
    Ok(ValidPlan::Disagg {
        decode: *decode,
        end,
        remote_send,
    })
}

fn is_generating(step: &Step) -> bool {
    matches!(
        step,
        Step::StartGenerate { .. } | Step::Forward { .. } | Step::Handoff { .. }
    )
}

/// The endpoint's protocol; `check_endpoints` ran first, so it exists.
fn protocol_of(id: EndpointId, endpoints: &[EndpointSnapshot]) -> Protocol {
    endpoints
        .get(id as usize)
        .map_or(Protocol::Mlc, |e| e.protocol)
}

/// What the endpoints' protocols allow this step to ask of them.
fn check_protocols(i: usize, step: &Step, endpoints: &[EndpointSnapshot]) -> Result<(), PlanError> {
    // `check_endpoints` ran first: every id exists.
    let endpoint = |id: EndpointId| &endpoints[id as usize];
    match step {
        Step::PrepRecv { decode, .. } | Step::StartGenerate { decode, .. } => {
            only_mlc(i, step, endpoint(*decode))
        }
        Step::RemoteSend {
            prefill, decode, ..
        } => {
            only_mlc(i, step, endpoint(*prefill))?;
            only_mlc(i, step, endpoint(*decode))
        }
        Step::Forward { endpoint: id } => {
            let e = endpoint(*id);
            if e.serves_alone() {
                return Ok(());
            }
            Err(at(
                i,
                step,
                &format!(
                    "endpoint {id} ({}, {}) serves only its leg of a handoff",
                    e.protocol,
                    role_name(e.role)
                ),
            ))
        }
        Step::Handoff { prefill, decode } => {
            let (p, d) = (endpoint(*prefill), endpoint(*decode));
            if prefill == decode {
                return Err(at(
                    i,
                    step,
                    "prefill and decode must be different endpoints",
                ));
            }
            if p.protocol != d.protocol {
                return Err(at(
                    i,
                    step,
                    &format!(
                        "endpoint {prefill} speaks {} and endpoint {decode} speaks {}: a handoff needs one protocol on both ends",
                        p.protocol, d.protocol
                    ),
                ));
            }
            if p.protocol == Protocol::Openai {
                return Err(at(
                    i,
                    step,
                    "openai endpoints have no KV handoff: they serve forward plans only",
                ));
            }
            if !p.can_prefill() {
                return Err(at(
                    i,
                    step,
                    &format!(
                        "endpoint {prefill} ({}, {}) cannot prefill: roles bind on {}",
                        p.protocol,
                        role_name(p.role),
                        p.protocol
                    ),
                ));
            }
            if !d.can_decode() {
                return Err(at(
                    i,
                    step,
                    &format!(
                        "endpoint {decode} ({}, {}) cannot decode: roles bind on {}",
                        d.protocol,
                        role_name(d.role),
                        d.protocol
                    ),
                ));
            }
            Ok(())
        }
    }
}

/// The microserving steps exist on MLC engines only; elsewhere a KV window cannot be asked for.
fn only_mlc(i: usize, step: &Step, e: &EndpointSnapshot) -> Result<(), PlanError> {
    if e.protocol == Protocol::Mlc {
        return Ok(());
    }
    Err(at(
        i,
        step,
        &format!(
            "endpoint {} speaks {}, which has no {} (microserving steps and KV windows are MLC's): plan a handoff",
            e.id,
            e.protocol,
            step.name()
        ),
    ))
}

fn role_name(role: Role) -> &'static str {
    match role {
        Role::Any => "no role",
        Role::Prefill => "role prefill",
        Role::Decode => "role decode",
    }
}

fn check_endpoints(i: usize, step: &Step, endpoints: &[EndpointSnapshot]) -> Result<(), PlanError> {
    let ids: &[EndpointId] = match step {
        Step::PrepRecv { decode, .. } | Step::StartGenerate { decode, .. } => &[*decode],
        Step::RemoteSend {
            prefill, decode, ..
        } => &[*prefill, *decode],
        Step::Forward { endpoint } => &[*endpoint],
        Step::Handoff { prefill, decode } => &[*prefill, *decode],
    };
    for &id in ids {
        match endpoints.get(id as usize) {
            None => {
                return Err(at(
                    i,
                    step,
                    &format!(
                        "endpoint {id} does not exist (the router has {} endpoints)",
                        endpoints.len()
                    ),
                ));
            }
            Some(e) if !e.health.is_healthy() => {
                return Err(at(i, step, &format!("endpoint {id} is unhealthy")));
            }
            Some(_) => {}
        }
    }
    Ok(())
}

/// Resolve a python-style position to `0 <= p < len` (a KV window end is never the whole prompt:
/// the decode engine must process at least the last token itself).
fn resolve(position: i32, len: u32) -> Result<u32, String> {
    let len = i64::from(len);
    let p = i64::from(position);
    let resolved = if p < 0 { len + p } else { p };
    if (0..len).contains(&resolved) {
        Ok(resolved as u32)
    } else {
        Err(format!(
            "position {position} is out of range for a {len}-token prompt (it must resolve to 0..{len})"
        ))
    }
}

fn at(i: usize, step: &Step, reason: &str) -> PlanError {
    PlanError {
        step: Some(i),
        step_name: step.name(),
        reason: reason.to_owned(),
    }
}

fn whole(reason: &str) -> PlanError {
    PlanError {
        step: None,
        step_name: "",
        reason: reason.to_owned(),
    }
}

#[cfg(test)]
mod tests;
