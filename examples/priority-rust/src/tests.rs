//! The policy driven natively through the SDK's harness; every plan is also checked with the
//! router's plan rules.

use switchyard_policy::testing::{Harness, check_plan, endpoints, request};
use switchyard_policy::types::{FailureKind, Header, Request, State};
use switchyard_policy::{Plan, PolicyError};

use super::PriorityRouter;

fn policy(config: &str) -> Harness<PriorityRouter> {
    Harness::init(config).expect("valid config")
}

fn from_user(user: &str, prompt_len: u32) -> Request {
    Request {
        user: Some(user.into()),
        ..request(prompt_len)
    }
}

fn with_header(name: &str, value: &str, prompt_len: u32) -> Request {
    Request {
        headers: vec![Header {
            name: name.into(),
            value: value.into(),
        }],
        ..request(prompt_len)
    }
}

/// Plan `req` on `cluster` and check the plan as the router would.
fn plan(
    policy: &mut Harness<PriorityRouter>,
    req: &Request,
    cluster: &switchyard_policy::testing::Cluster,
) -> Result<Plan, PolicyError> {
    let ctx = cluster.context();
    let plan = policy.translate(req, &ctx);
    if let Ok(plan) = &plan {
        check_plan(plan, req.prompt_length(), &ctx.endpoints)
            .expect("plan passes the router's rules");
    }
    plan
}

#[test]
fn priority_users_are_forwarded_to_the_least_loaded_endpoint() {
    let mut p = policy("{}");
    let cluster = endpoints(3).with_in_flight(&[2, 5, 1]);
    let got = plan(&mut p, &from_user("priority-alice", 100), &cluster);
    assert_eq!(got, Ok(Plan::forward(2)));
    // Endpoint 0 is a candidate too: a forward does not need a separate prefill endpoint.
    let cluster = endpoints(3).with_in_flight(&[0, 5, 1]);
    let got = plan(&mut p, &from_user("priority-bob", 100), &cluster);
    assert_eq!(got, Ok(Plan::forward(0)));
}

#[test]
fn the_priority_header_forwards_too() {
    let mut p = policy("{}");
    let cluster = endpoints(3).with_in_flight(&[2, 5, 1]);
    for value in ["high", "HIGH"] {
        let got = plan(&mut p, &with_header("x-priority", value, 100), &cluster);
        assert_eq!(got, Ok(Plan::forward(2)), "x-priority: {value}");
    }
    let got = plan(&mut p, &with_header("x-priority", "low", 100), &cluster);
    assert_eq!(got, Ok(Plan::disagg(0, 2, -1)));
}

#[test]
fn other_requests_take_mlc_disaggregated_path() {
    let mut p = policy("{}");
    let cluster = endpoints(4).with_in_flight(&[0, 3, 1, 2]);
    for req in [
        request(17),
        from_user("alice", 17),
        from_user("xpriority-", 17),
    ] {
        // P = endpoint 0 even though it is idle; D = least in-flight among the rest.
        assert_eq!(plan(&mut p, &req, &cluster), Ok(Plan::disagg(0, 2, -1)));
    }
}

#[test]
fn config_sets_the_user_prefix_and_balance() {
    let mut p = policy(r#"{"user_prefix": "vip:", "pd_balance_factor": 0.1}"#);
    let cluster = endpoints(2).with_in_flight(&[1, 0]);
    assert_eq!(
        plan(&mut p, &from_user("vip:carol", 100), &cluster),
        Ok(Plan::forward(1))
    );
    assert_eq!(
        plan(&mut p, &from_user("priority-alice", 100), &cluster),
        Ok(Plan::disagg(0, 1, 90))
    );
}

#[test]
fn bad_configs_are_refused_with_a_reason() {
    let err = |config: &str| Harness::<PriorityRouter>::init(config).unwrap_err();
    assert!(err(r#"{"user_prefix": ""}"#).contains("must not be empty"));
    assert!(err(r#"{"pd_balance_factor": 1}"#).contains("below 1"));
    assert!(err(r#"{"prefix": "x"}"#).contains("unknown config key"));
    assert!(err("[]").contains("JSON object"));
}

#[test]
fn unhealthy_and_failed_endpoints_are_avoided() {
    let mut p = policy("{}");
    // Endpoint 0 down: the lowest healthy endpoint prefills.
    let cluster = endpoints(3).with_in_flight(&[0, 4, 1]).unhealthy(0);
    assert_eq!(
        plan(&mut p, &request(50), &cluster),
        Ok(Plan::disagg(1, 2, -1))
    );
    // A retry after endpoint 2 failed: priority goes elsewhere even though 2 is idle.
    let cluster = endpoints(3)
        .with_in_flight(&[3, 1, 0])
        .retry(2, FailureKind::EndpointError, 2);
    let got = plan(&mut p, &from_user("priority-x", 50), &cluster);
    assert_eq!(got, Ok(Plan::forward(1)));
}

#[test]
fn one_endpoint_serves_alone_and_none_is_unavailable() {
    let mut p = policy("{}");
    let cluster = endpoints(2).unhealthy(1);
    assert_eq!(plan(&mut p, &request(50), &cluster), Ok(Plan::forward(0)));
    let cluster = endpoints(2).unhealthy(0).unhealthy(1);
    for req in [request(50), from_user("priority-x", 50)] {
        assert!(matches!(
            plan(&mut p, &req, &cluster),
            Err(PolicyError::Unavailable(_))
        ));
    }
}

#[test]
fn describes_itself_as_stateless_rust_needing_no_tokens() {
    let info = policy("{}").describe();
    assert_eq!((info.language.as_str(), info.prompt_tokens), ("rust", 0));
    assert_eq!(info.state, State::Stateless);
}
