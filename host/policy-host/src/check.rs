//! `check`: run a loaded policy on a fixed set of synthetic requests and endpoint snapshots and
//! validate every plan, so a broken policy is caught before it serves traffic (used by
//! `switchyard policy check` and the plugin watcher alike).

use std::fmt;

use switchyard_contract::{
    EndpointSnapshot, Failure, FailureKind, Health, PlanError, PolicyContext, PolicyRequest, Role,
    TranslateError, ValidPlan, validate,
};

use super::{Contract, Policy};

/// One synthetic situation a policy is asked to plan for.
#[derive(Debug, Clone)]
pub(super) struct Case {
    pub(super) prompt_len: u32,
    pub(super) context: PolicyContext,
}

impl fmt::Display for Case {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let e = &self.context.endpoints;
        let count = |role| e.iter().filter(|x| x.role == role).count();
        write!(
            f,
            "{} endpoints ({} any, {} prefill, {} decode",
            e.len(),
            count(Role::Any),
            count(Role::Prefill),
            count(Role::Decode)
        )?;
        let unhealthy: Vec<u32> = e
            .iter()
            .filter(|x| !x.health.is_healthy())
            .map(|x| x.id)
            .collect();
        if !unhealthy.is_empty() {
            write!(f, ", unhealthy {unhealthy:?}")?;
        }
        write!(
            f,
            "), prompt {} tokens, attempt {}",
            self.prompt_len, self.context.attempt
        )?;
        if let Some(failure) = self.context.last_failure {
            write!(
                f,
                " after {:?} on endpoint {}",
                failure.kind, failure.endpoint
            )?;
        }
        Ok(())
    }
}

/// What `check` found: one line per case.
#[derive(Debug, Clone)]
pub struct CheckReport {
    pub policy: String,
    pub language: String,
    pub sha256: String,
    /// The contract version the component was built against.
    pub contract: Contract,
    /// It says it keeps no state: the router will serve it with a pool of instances.
    pub stateless: bool,
    /// `(case, result)` in the order run, e.g. `("8 endpoints …", "disagg on 5 …")`.
    pub cases: Vec<(String, String)>,
    pub plans: usize,
    pub declined: usize,
}

impl fmt::Display for CheckReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "policy {} ({}, {}, {}, sha256 {}): {} cases, {} valid plans, {} declined",
            self.policy,
            self.language,
            self.contract,
            if self.stateless {
                "stateless: a pool of instances"
            } else {
                "stateful: one instance"
            },
            &self.sha256[..self.sha256.len().min(12)],
            self.cases.len(),
            self.plans,
            self.declined
        )?;
        for (case, result) in &self.cases {
            writeln!(f, "  ok  {case}: {result}")?;
        }
        Ok(())
    }
}

/// Why a policy failed its check, naming the case.
#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    #[error("for {case}: {error}")]
    Translate { case: String, error: TranslateError },
    #[error("for {case}: invalid plan {plan}: {error}")]
    InvalidPlan {
        case: String,
        plan: String,
        error: PlanError,
    },
    #[error("policy {policy} declined every request; it never produced a plan")]
    NoPlan { policy: String },
}

/// Run `policy` on the synthetic cases and validate each plan. `unavailable`/`rejected` answers
/// are accepted (and counted); a sandbox fault, an `internal` error or an invalid plan fails.
pub fn check(policy: &Policy) -> Result<CheckReport, CheckError> {
    let info = policy.info();
    let mut report = CheckReport {
        policy: info.name.clone(),
        language: info.language.clone(),
        sha256: info.sha256.clone(),
        contract: info.contract,
        stateless: info.stateless,
        cases: Vec::new(),
        plans: 0,
        declined: 0,
    };
    for (i, case) in cases().into_iter().enumerate() {
        let result = run_case(policy, &case, i as u64 + 1)?;
        match &result {
            Ok(_) => report.plans += 1,
            Err(_) => report.declined += 1,
        }
        let summary = match result {
            Ok(plan) => describe(&plan),
            Err(e) => e.to_string(),
        };
        report.cases.push((case.to_string(), summary));
    }
    if report.plans == 0 {
        return Err(CheckError::NoPlan {
            policy: report.policy,
        });
    }
    Ok(report)
}

/// `Ok(Ok(plan))` for a valid plan, `Ok(Err(..))` for an accepted refusal.
fn run_case(
    policy: &Policy,
    case: &Case,
    id: u64,
) -> Result<Result<ValidPlan, TranslateError>, CheckError> {
    let prompt = synthetic_prompt(case.prompt_len);
    let request = PolicyRequest {
        id,
        prompt: Some(&prompt),
        max_tokens: 64,
        stream: true,
        model: "check",
        user: None,
        headers: &[],
        flow: Default::default(),
        base_model: None,
    };
    match policy.translate(&request, &case.context) {
        Ok(plan) => validate(&plan, case.prompt_len, &case.context.endpoints)
            .map(Ok)
            .map_err(|error| CheckError::InvalidPlan {
                case: case.to_string(),
                plan: serde_json::to_string(&plan).unwrap_or_else(|_| format!("{plan:?}")),
                error,
            }),
        Err(e @ (TranslateError::Unavailable { .. } | TranslateError::Rejected { .. })) => {
            Ok(Err(e))
        }
        Err(error) => Err(CheckError::Translate {
            case: case.to_string(),
            error,
        }),
    }
}

fn describe(plan: &ValidPlan) -> String {
    match plan {
        ValidPlan::Forward { endpoint } => format!("forward to {endpoint}"),
        ValidPlan::Disagg {
            decode,
            end,
            remote_send: None,
        } => format!("decode on {decode}, kv [0, {end}) computed there"),
        ValidPlan::Disagg {
            decode,
            end,
            remote_send: Some(send),
        } => format!(
            "decode on {decode}, kv [{}, {end}) prefilled on {}",
            send.begin
                .map_or_else(|| "matched".to_owned(), |b| b.to_string()),
            send.prefill
        ),
        ValidPlan::Vllm { prefill, decode } => {
            format!("decode on {decode}, vLLM handoff from {prefill}")
        }
        ValidPlan::Sglang { prefill, decode } => {
            format!("decode on {decode}, SGLang handoff from {prefill}")
        }
    }
}

/// The synthetic cases: endpoint counts 1, 2, 3, 8 × prompt lengths 1, 2, 17, 4096, then
/// retries after each kind of failure, unhealthy endpoints, and role-less clusters.
pub(super) fn cases() -> Vec<Case> {
    let mut cases = Vec::new();
    for endpoints in [1, 2, 3, 8] {
        for prompt_len in [1, 2, 17, 4096] {
            cases.push(case(prompt_len, 1, None, split_roles(endpoints, &[], &[])));
        }
    }
    let failures = [
        (FailureKind::Preempted, 1),
        (FailureKind::EndpointError, 0),
        (FailureKind::Timeout, 1),
    ];
    for (kind, endpoint) in failures {
        let failure = Failure { kind, endpoint };
        cases.push(case(17, 2, Some(failure), split_roles(2, &[], &[])));
        cases.push(case(4096, 2, Some(failure), split_roles(8, &[], &[3, 1])));
    }
    cases.push(case(17, 1, None, split_roles(3, &[0], &[])));
    cases.push(case(17, 1, None, split_roles(8, &[7], &[2, 2, 2])));
    cases.push(case(17, 2, None, split_roles(2, &[0, 1], &[])));
    cases.push(case(17, 1, None, snapshot(&[Role::Any; 4], &[], &[])));
    cases
}

fn case(
    prompt_len: u32,
    attempt: u32,
    last_failure: Option<Failure>,
    endpoints: Vec<EndpointSnapshot>,
) -> Case {
    Case {
        prompt_len,
        context: PolicyContext {
            attempt,
            last_failure,
            endpoints,
        },
    }
}

/// `n` endpoints: one `any` when alone, else the first half prefill and the rest decode.
pub fn split_roles(n: u32, unhealthy: &[u32], in_flight: &[u32]) -> Vec<EndpointSnapshot> {
    let roles: Vec<Role> = (0..n)
        .map(|i| match (n, i < n / 2) {
            (1, _) => Role::Any,
            (_, true) => Role::Prefill,
            (_, false) => Role::Decode,
        })
        .collect();
    snapshot(&roles, unhealthy, in_flight)
}

/// A snapshot with the given roles; endpoint `i` is [`EndpointSnapshot::synthetic`]`(i)`,
/// unhealthy when listed, with `in_flight[i]` requests (0 when the list is shorter).
pub fn snapshot(roles: &[Role], unhealthy: &[u32], in_flight: &[u32]) -> Vec<EndpointSnapshot> {
    roles
        .iter()
        .zip(0u32..)
        .map(|(&role, id)| EndpointSnapshot {
            role,
            health: if unhealthy.contains(&id) {
                Health::NotReady
            } else {
                Health::Healthy
            },
            in_flight: in_flight.get(id as usize).copied().unwrap_or(0),
            ..EndpointSnapshot::synthetic(id)
        })
        .collect()
}

/// Distinct, deterministic token ids (a policy hashing the prefix sees varied input).
pub fn synthetic_prompt(len: u32) -> Vec<u32> {
    (0..len)
        .map(|i| i.wrapping_mul(2_654_435_761) % 32_000)
        .collect()
}
