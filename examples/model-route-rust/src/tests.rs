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
fn an_adapter_follows_its_base_models_rule_unless_named_itself() {
    let mut policy =
        Harness::<ModelRoute>::init(r#"{"forward": {"llama": "openai", "sql-lora": "vllm"}}"#)
            .expect("valid config");
    let ctx = endpoints(3)
        .protocol(0, Protocol::Openai, Role::Any)
        .protocol(1, Protocol::Vllm, Role::Any)
        .protocol(2, Protocol::Sglang, Role::Any)
        .context();
    let adapter = |name: &str| request(12).with_adapter(name, "llama");
    assert_eq!(
        policy.translate(&adapter("chat-lora"), &ctx),
        Ok(Plan::forward(0)),
        "an adapter of llama goes where llama goes"
    );
    assert_eq!(
        policy.translate(&adapter("sql-lora"), &ctx),
        Ok(Plan::forward(1)),
        "an adapter named in the config follows its own rule"
    );
    let mut other = request(12);
    other.model = "chat-lora".into();
    assert_eq!(
        policy.translate(&other, &ctx),
        Ok(Plan::forward(2)),
        "the same name on no base model is not llama's"
    );
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
