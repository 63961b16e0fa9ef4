//! The relay over a forwarded MLC stream: how a generation ends (finished, preempted with what
//! it delivered counted, stalled, unfinished, the client gone) and what it reports.

use switchyard_contract::FailureKind;
use switchyard_wire::completion::FinishReason;
use switchyard_wire::sse::SseError;
use tokio::time::Instant;

use super::*;
use crate::engine_client::CallError;
use crate::engine_client::scripted::Body;

const E: EndpointId = 0;

/// A forward to one MLC engine whose stream the test writes, and the generation it started.
async fn streaming(h: &Harness) -> (Generation, Body) {
    let mut engine = h.engine(E);
    let answer = async { engine.next().await.stream() };
    let (generation, answer) = tokio::join!(h.execute(ValidPlan::Forward { endpoint: E }), answer);
    (generation.expect("the engine answered"), answer)
}

fn idle_after(idle: Duration) -> Harness {
    let timeouts = Timeouts {
        stream_idle: idle,
        ..Timeouts::default()
    };
    Harness::with(vec![spec(Protocol::Mlc)], timeouts)
}

#[tokio::test(start_paused = true)]
async fn a_finished_stream_reports_its_reason_and_the_engines_usage() {
    let h = Harness::new(&[Protocol::Mlc]);
    let (mut generation, answer) = streaming(&h).await;
    answer.event(&chunk_with_ids("ab", &[1, 2], None));
    answer.event(&chunk_with_ids("c", &[3], Some("length")));
    let mut usage = chunk("", None);
    usage["choices"] = json!([]);
    usage["usage"] = json!({"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8});
    answer.event(&usage);
    answer.done();
    let client = Client::default();
    let end = relay(&mut generation, &client, 1, &mut Delivered::default()).await;
    let RelayEnd::Finished {
        finish_reason,
        usage,
    } = end
    else {
        panic!("expected a finish, got {end:?}");
    };
    assert_eq!(finish_reason, FinishReason::Length);
    assert_eq!(usage.map(|u| u.completion_tokens), Some(3));
    assert_eq!(*client.text.lock(), "abc");
}

#[tokio::test(start_paused = true)]
async fn a_preempted_stream_returns_what_it_delivered() {
    let h = Harness::new(&[Protocol::Mlc]);
    let (mut generation, answer) = streaming(&h).await;
    answer.event(&chunk_with_ids("ab", &[1, 2], None));
    answer.event(&chunk_with_ids("c", &[3], None));
    answer.event(&chunk("", Some("preempt")));
    answer.done();
    let client = Client::default();
    let mut delivered = Delivered::default();
    let end = relay(&mut generation, &client, 1, &mut delivered).await;
    assert!(matches!(end, RelayEnd::Preempted), "{end:?}");
    assert_eq!(delivered.text, "abc");
    assert_eq!(delivered.token_ids.as_deref(), Some(&[1, 2, 3][..]));
    assert_eq!(delivered.generated, Some(3));
    assert_eq!(
        *client.text.lock(),
        "abc",
        "the client has what was counted"
    );
}

#[tokio::test(start_paused = true)]
async fn a_stream_that_goes_quiet_fails_as_a_timeout_after_the_idle_limit() {
    let idle = Duration::from_secs(5);
    let h = idle_after(idle);
    let (mut generation, answer) = streaming(&h).await;
    answer.event(&chunk("a", None));
    let client = Client::default();
    let mut delivered = Delivered::default();
    let started = Instant::now();
    let end = relay(&mut generation, &client, 1, &mut delivered).await;
    assert_eq!(
        Instant::now() - started,
        idle,
        "it fails exactly when the gap exceeds the limit"
    );
    let RelayEnd::Failed(error) = end else {
        panic!("expected a failure, got {end:?}");
    };
    assert!(
        matches!(
            error.cause,
            Cause::Call(CallError::Stream(SseError::Idle(_)))
        ),
        "{error}"
    );
    assert_eq!((error.endpoint, error.step), (E, StepKind::Relay));
    assert_eq!(error.failure_kind(), FailureKind::Timeout);
    assert!(error.retryable() && error.blames_endpoint());
    drop(generation);
    assert!(
        done_by_now(answer.hung_up()).await,
        "the stalled engine is hung up on"
    );
}

#[tokio::test(start_paused = true)]
async fn a_stream_that_ends_without_a_finish_reason_broke_the_protocol() {
    let h = Harness::new(&[Protocol::Mlc]);
    let (mut generation, answer) = streaming(&h).await;
    answer.event(&chunk("a", None));
    answer.done();
    let end = relay(
        &mut generation,
        &Client::default(),
        1,
        &mut Delivered::default(),
    )
    .await;
    let RelayEnd::Failed(error) = end else {
        panic!("expected a failure, got {end:?}");
    };
    assert!(matches!(error.cause, Cause::Unfinished), "{error}");
    assert_eq!(error.origin(), Origin::Upstream);
    assert!(error.retryable() && error.blames_endpoint());
}

#[tokio::test(start_paused = true)]
async fn a_broken_tail_after_the_finish_loses_nothing() {
    let h = Harness::new(&[Protocol::Mlc]);
    let (mut generation, answer) = streaming(&h).await;
    answer.event(&chunk("a", Some("stop")));
    answer.break_off();
    let end = relay(
        &mut generation,
        &Client::default(),
        1,
        &mut Delivered::default(),
    )
    .await;
    assert!(
        matches!(
            end,
            RelayEnd::Finished {
                finish_reason: FinishReason::Stop,
                ..
            }
        ),
        "{end:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_client_gone_ends_the_relay_and_hangs_up_on_the_engine() {
    let h = Harness::new(&[Protocol::Mlc]);
    let (mut generation, answer) = streaming(&h).await;
    answer.event(&chunk("a", None));
    let gone = Client {
        gone: true,
        ..Client::default()
    };
    let end = relay(&mut generation, &gone, 1, &mut Delivered::default()).await;
    assert!(matches!(end, RelayEnd::ClientGone), "{end:?}");
    drop(generation);
    assert!(done_by_now(answer.hung_up()).await);
    assert_eq!(h.in_flight(E), 0);
}
