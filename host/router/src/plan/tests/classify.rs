//! Where failures come from and what they do to their endpoint: the engine's own failures
//! count against it (and one that cannot be reached is marked down); the request's and ours
//! (an endpoint gone since validation, a misconfigured one) never do.

use super::*;
use crate::engine_client::CallError;

fn forward(endpoint: EndpointId) -> ValidPlan {
    ValidPlan::Forward { endpoint }
}

#[test]
fn each_cause_is_classified_once_when_the_error_is_made() {
    let status = |status| {
        Cause::Call(CallError::Status {
            status,
            body: String::new(),
        })
    };
    let cases = [
        // (cause, origin, retryable, blames the endpoint)
        (
            Cause::Call(CallError::Connect {
                reason: "refused".into(),
            }),
            Origin::Upstream,
            true,
            true,
        ),
        (status(503), Origin::Upstream, true, true),
        (status(429), Origin::Upstream, true, false),
        (status(404), Origin::Downstream, false, false),
        (
            Cause::Call(CallError::Decode {
                reason: "not JSON".into(),
            }),
            Origin::Upstream,
            false,
            true,
        ),
        (Cause::Unfinished, Origin::Upstream, true, true),
        (
            Cause::Call(CallError::Url { reason: "no host" }),
            Origin::Internal,
            true,
            false,
        ),
        (Cause::UnknownEndpoint, Origin::Internal, true, false),
        (Cause::NoBootstrapPort, Origin::Internal, true, false),
        (Cause::Lost, Origin::Internal, true, false),
    ];
    for (cause, origin, retryable, blames) in cases {
        let error = ExecError::new(cause, 0, StepKind::Forward, 1);
        assert_eq!(
            (error.origin(), error.retryable(), error.blames_endpoint()),
            (origin, retryable, blames),
            "{error}"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn an_engine_that_refuses_connections_is_marked_down_and_blamed() {
    // No engine answers at e0.
    let h = Harness::new(&[Protocol::Mlc]);
    let error = h.execute(forward(0)).await.expect_err("refused");
    assert!(
        matches!(error.cause, Cause::Call(CallError::Connect { .. })),
        "{error}"
    );
    assert!(!h.healthy(0), "down until its probe answers");
    assert_eq!(h.failures(0), 1);
}

#[tokio::test(start_paused = true)]
async fn an_engine_that_refuses_the_request_is_not_blamed() {
    let h = Harness::new(&[Protocol::Mlc]);
    let mut engine = h.engine(0);
    let refusing = async { engine.next().await.status(400, "prompt too long") };
    let (result, ()) = tokio::join!(h.execute(forward(0)), refusing);
    let error = result.expect_err("refused");
    assert_eq!(error.origin(), Origin::Downstream);
    assert!(!error.retryable());
    assert!(h.healthy(0));
    assert_eq!(h.failures(0), 0);
}

#[tokio::test(start_paused = true)]
async fn an_endpoint_gone_since_validation_is_ours_to_fix() {
    let h = Harness::new(&[Protocol::Mlc]);
    let error = h.execute(forward(5)).await.expect_err("no endpoint 5");
    assert!(matches!(error.cause, Cause::UnknownEndpoint), "{error}");
    assert_eq!(error.origin(), Origin::Internal);
    assert!(error.retryable(), "another plan may work");
    assert!(h.healthy(0));
}

#[tokio::test(start_paused = true)]
async fn an_endpoint_whose_url_makes_no_request_is_not_marked_down() {
    let unusable = EndpointSpec {
        url: "e0:8000".into(),
        ..spec(Protocol::Mlc)
    };
    let h = Harness::with(vec![unusable], Timeouts::default());
    let error = h.execute(forward(0)).await.expect_err("no URI");
    assert!(
        matches!(error.cause, Cause::Call(CallError::Url { .. })),
        "{error}"
    );
    assert_eq!(error.origin(), Origin::Internal);
    assert!(h.healthy(0), "misconfigured, not down");
    assert_eq!(h.failures(0), 0, "never ejected for it");
    assert_eq!(h.in_flight(0), 0);
}

#[tokio::test(start_paused = true)]
async fn an_sglang_prefill_without_a_bootstrap_port_is_ours_and_calls_nothing() {
    let prefill = EndpointSpec {
        role: Role::Prefill,
        ..spec(Protocol::Sglang)
    };
    let decode = EndpointSpec {
        role: Role::Decode,
        ..spec(Protocol::Sglang)
    };
    let h = Harness::with(vec![prefill, decode], Timeouts::default());
    let (mut p, mut d) = (h.engine(0), h.engine(1));
    let plan = ValidPlan::Sglang {
        prefill: 0,
        decode: 1,
    };
    let error = h.execute(plan).await.expect_err("no bootstrap port");
    assert!(matches!(error.cause, Cause::NoBootstrapPort), "{error}");
    assert_eq!((error.endpoint, error.origin()), (0, Origin::Internal));
    assert!(h.healthy(0));
    assert_eq!(h.failures(0), 0);
    settle().await;
    assert!(p.try_next().is_none() && d.try_next().is_none());
    assert_eq!((h.in_flight(0), h.in_flight(1)), (0, 0));
}
