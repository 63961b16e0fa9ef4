use switchyard_policy::testing::{Harness, check_plan, endpoints, request};
use switchyard_policy::types::{Protocol, Role};
use switchyard_policy::{Plan, PolicyError};

use super::ModelRoute;

fn policy() -> Harness<ModelRoute> {
    Harness::init(r#"{"forward": {"gpt-4o-mini": "openai"}}"#).expect("valid config")
}

/// 0: an OpenAI server, 1: a vLLM prefill, 2 and 3: vLLM decodes (3 less loaded).
fn mixed() -> switchyard_policy::testing::Cluster {
    endpoints(4)
        .protocol(0, Protocol::Openai, Role::Any)
        .protocol(1, Protocol::Vllm, Role::Prefill)
        .protocol(2, Protocol::Vllm, Role::Decode)
        .protocol(3, Protocol::Vllm, Role::Decode)
        .with_in_flight(&[5, 0, 2, 1])
}

#[test]
fn named_models_go_whole_to_their_protocol_and_the_rest_are_disaggregated() {
    let mut policy = policy();
    let ctx = mixed().context();
    let mut forwarded = request(12);
    forwarded.model = "gpt-4o-mini".into();
    let plan = policy.translate(&forwarded, &ctx).expect("a plan");
    assert_eq!(plan, Plan::forward(0));
    let plan = policy.translate(&request(12), &ctx).expect("a plan");
    assert_eq!(plan, Plan::handoff(1, 3));
    check_plan(&plan, 12, &ctx.endpoints).expect("valid");
}

#[test]
fn a_named_model_without_its_endpoints_is_unavailable() {
    let mut policy = policy();
    let ctx = mixed().unhealthy(0).context();
    let mut forwarded = request(12);
    forwarded.model = "gpt-4o-mini".into();
    assert!(matches!(
        policy.translate(&forwarded, &ctx),
        Err(PolicyError::Unavailable(_))
    ));
}

#[test]
fn config_names_protocols() {
    assert!(Harness::<ModelRoute>::init("{}").is_ok());
    let err = Harness::<ModelRoute>::init(r#"{"forward": {"m": "grpc"}}"#).expect_err("bad");
    assert!(err.contains("forward.m"), "{err}");
    let err = Harness::<ModelRoute>::init(r#"{"route": {}}"#).expect_err("unknown key");
    assert!(err.contains("route"), "{err}");
}
