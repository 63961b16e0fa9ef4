//! `switchyard policy check|plan`: load a policy file outside the router and show what it does;
//! `switchyard policy new`: start a policy project from a template.

use std::io::Write;
use std::path::PathBuf;

use switchyard_contract::{
    Failure, FailureKind, PlanError, PolicyContext, PolicyRequest, Protocol, Role, TranslateError,
    validate,
};
use switchyard_policy_host::synthetic::{prompt as synthetic_prompt, snapshot, split_roles};
use switchyard_policy_host::{CheckError, LoadError, PolicyHost, PolicyLimits, check};

use crate::policy_new::{NewArgs, NewError, scaffold};

/// Inspect a policy component without starting the router.
#[derive(Debug, clap::Subcommand)]
pub enum PolicyCommand {
    /// Load a policy and run it against synthetic requests; exit non-zero if any plan is invalid.
    Check {
        /// The policy component (`.wasm`).
        file: PathBuf,
        /// JSON config passed to the policy's `init`.
        #[arg(long)]
        config: Option<String>,
    },
    /// Print, as JSON, the validated plan a policy makes for one synthetic request.
    Plan {
        /// The policy component (`.wasm`).
        file: PathBuf,
        /// Prompt length in tokens.
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
        prompt_len: u32,
        /// Number of endpoints: one `any`, or the first half prefill and the rest decode.
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..=4096))]
        endpoints: u32,
        /// JSON config passed to the policy's `init`.
        #[arg(long)]
        config: Option<String>,
        /// Attempt number (1 = first try).
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
        attempt: u32,
        /// Why the previous attempt failed, `KIND:ENDPOINT` with KIND one of `preempted`,
        /// `endpoint-error`, `timeout` (default for attempts > 1: `endpoint-error:0`).
        #[arg(long, value_parser = parse_failure)]
        failure: Option<Failure>,
        /// Roles by endpoint id (`any`, `prefill`, `decode`), overriding the default split.
        #[arg(long, value_delimiter = ',', value_parser = parse_role)]
        roles: Vec<Role>,
        /// Protocols by endpoint id (`mlc`, `vllm`, `sglang`, `openai`; default: all `mlc`), e.g.
        /// `vllm,vllm,openai`.
        #[arg(long, value_delimiter = ',', value_parser = parse_protocol)]
        protocols: Vec<Protocol>,
        /// The model the request names (policies may route on it).
        #[arg(long, default_value = "plan")]
        model: String,
        /// In-flight requests by endpoint id, e.g. `3,0,1`.
        #[arg(long, value_delimiter = ',')]
        in_flight: Vec<u32>,
        /// Ids of endpoints to mark unhealthy, e.g. `0,2`.
        #[arg(long, value_delimiter = ',')]
        unhealthy: Vec<u32>,
        /// Prompt tokens each endpoint's KV cache holds by its KV events, by endpoint id, e.g.
        /// `512,0,1024` (endpoint.cached-prefix; endpoints beyond the list publish no events).
        #[arg(long, value_delimiter = ',')]
        cached_prefix: Vec<u32>,
        /// Prompt tokens this router sent each endpoint that it has not prefilled yet, by
        /// endpoint id, e.g. `8192,0,512` (endpoint.pending-prefill; endpoints beyond the list:
        /// 0).
        #[arg(long, value_delimiter = ',')]
        pending_prefill: Vec<u32>,
    },
    /// Write a new policy project (Rust, Python or JavaScript) that builds as is.
    New(NewArgs),
}

/// Why a `policy` subcommand failed.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    #[error(transparent)]
    Load(#[from] LoadError),
    /// Not `#[from]`: that would make the check error the source too and print it twice.
    #[error("check failed: {0}")]
    Check(CheckError),
    #[error(transparent)]
    Translate(#[from] TranslateError),
    #[error("the policy returned an invalid plan {plan}: {error}")]
    InvalidPlan { plan: String, error: PlanError },
    #[error("{0}")]
    Usage(String),
    #[error("cannot write the result: {0}")]
    Output(String),
    #[error(transparent)]
    New(#[from] NewError),
}

impl From<CheckError> for CliError {
    fn from(error: CheckError) -> Self {
        CliError::Check(error)
    }
}

/// Run a `policy` subcommand, printing its result on stdout.
pub fn run_cli(command: PolicyCommand) -> Result<(), CliError> {
    // Built only by the commands that load a policy: scaffolding needs no wasmtime engine.
    let host = || PolicyHost::new(PolicyLimits::default());
    match command {
        PolicyCommand::New(args) => print(&scaffold(&args)?.to_string()),
        PolicyCommand::Check { file, config } => {
            let policy = host()?.load_file(&file, config.as_deref())?;
            let report = check(&policy)?;
            print(&report.to_string())
        }
        PolicyCommand::Plan {
            file,
            prompt_len,
            endpoints,
            config,
            attempt,
            failure,
            roles,
            protocols,
            model,
            in_flight,
            unhealthy,
            cached_prefix,
            pending_prefill,
        } => {
            let mut endpoints = if roles.is_empty() {
                split_roles(endpoints, &unhealthy, &in_flight)
            } else if roles.len() == endpoints as usize {
                snapshot(&roles, &unhealthy, &in_flight)
            } else {
                return Err(CliError::Usage(format!(
                    "--roles names {} endpoints but --endpoints is {endpoints}",
                    roles.len()
                )));
            };
            if !protocols.is_empty() && protocols.len() != endpoints.len() {
                return Err(CliError::Usage(format!(
                    "--protocols names {} endpoints but --endpoints is {}",
                    protocols.len(),
                    endpoints.len()
                )));
            }
            for (endpoint, protocol) in endpoints.iter_mut().zip(protocols) {
                endpoint.protocol = protocol;
            }
            at_most_one_each("--cached-prefix", cached_prefix.len(), endpoints.len())?;
            for (endpoint, tokens) in endpoints.iter_mut().zip(cached_prefix) {
                endpoint.cached_prefix = Some(tokens);
            }
            at_most_one_each("--pending-prefill", pending_prefill.len(), endpoints.len())?;
            for (endpoint, tokens) in endpoints.iter_mut().zip(pending_prefill) {
                endpoint.pending_prefill = tokens;
            }
            let last_failure = failure.or((attempt > 1).then_some(Failure {
                kind: FailureKind::EndpointError,
                endpoint: 0,
            }));
            let context = PolicyContext {
                attempt,
                last_failure,
                endpoints,
            };
            let policy = host()?.load_file(&file, config.as_deref())?;
            let prompt = synthetic_prompt(prompt_len);
            let request = PolicyRequest {
                id: 1,
                prompt: Some(&prompt),
                max_tokens: 64,
                stream: true,
                model: &model,
                user: None,
                headers: &[],
                flow: Default::default(),
                base_model: None,
            };
            let plan = policy.translate(&request, &context)?;
            let resolved = validate(&plan, prompt_len, &context.endpoints).map_err(|error| {
                CliError::InvalidPlan {
                    plan: serde_json::to_string(&plan).unwrap_or_default(),
                    error,
                }
            })?;
            let out = serde_json::json!({
                "policy": policy.info().name,
                "steps": plan.steps,
                "resolved": resolved,
            });
            let pretty =
                serde_json::to_string_pretty(&out).map_err(|e| CliError::Output(e.to_string()))?;
            print(&pretty)
        }
    }
}

/// A per-endpoint list given as `flag` may name every endpoint, or fewer, never more.
fn at_most_one_each(flag: &str, given: usize, endpoints: usize) -> Result<(), CliError> {
    if given > endpoints {
        return Err(CliError::Usage(format!(
            "{flag} names {given} endpoints but --endpoints is {endpoints}"
        )));
    }
    Ok(())
}

fn print(text: &str) -> Result<(), CliError> {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{}", text.trim_end()).map_err(|e| CliError::Output(e.to_string()))
}

fn parse_protocol(s: &str) -> Result<Protocol, String> {
    s.parse()
}

fn parse_role(s: &str) -> Result<Role, String> {
    match s {
        "any" => Ok(Role::Any),
        "prefill" => Ok(Role::Prefill),
        "decode" => Ok(Role::Decode),
        other => Err(format!(
            "unknown role `{other}` (expected any, prefill or decode)"
        )),
    }
}

fn parse_failure(s: &str) -> Result<Failure, String> {
    let (kind, endpoint) = s
        .split_once(':')
        .ok_or_else(|| format!("expected KIND:ENDPOINT, got `{s}`"))?;
    let kind = match kind {
        "preempted" => FailureKind::Preempted,
        "endpoint-error" => FailureKind::EndpointError,
        "timeout" => FailureKind::Timeout,
        other => {
            return Err(format!(
                "unknown failure kind `{other}` (expected preempted, endpoint-error or timeout)"
            ));
        }
    };
    let endpoint = endpoint
        .parse()
        .map_err(|_| format!("`{endpoint}` is not an endpoint id"))?;
    Ok(Failure { kind, endpoint })
}
