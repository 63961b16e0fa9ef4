//! SGLang's handoff: both legs at once with one bootstrap room; a leg that fails takes the
//! other down, and a prefill that fails while D streams ends D's stream, blamed on P.

use super::*;

const P: EndpointId = 0;
const D: EndpointId = 1;

/// P (with its bootstrap port) and D.
fn harness() -> Harness {
    let prefill = EndpointSpec {
        role: Role::Prefill,
        bootstrap_port: Some(8998),
        kv_events: None,
        kv_events_replay: None,
        kv_events_topic: None,
        ..spec(Protocol::Sglang)
    };
    let decode = EndpointSpec {
        role: Role::Decode,
        ..spec(Protocol::Sglang)
    };
    Harness::with(vec![prefill, decode], Timeouts::default())
}

fn handoff() -> ValidPlan {
    ValidPlan::Sglang {
        prefill: P,
        decode: D,
    }
}

#[tokio::test(start_paused = true)]
async fn both_legs_get_one_room_and_d_streams_while_ps_answer_is_read_to_its_end() {
    let h = harness();
    let (mut p, mut d) = (h.engine(P), h.engine(D));
    let engines = async {
        let (prefill, decode) = (p.next().await, d.next().await);
        for body in [&prefill.body, &decode.body] {
            assert_eq!(
                (&body["bootstrap_host"], &body["bootstrap_port"]),
                (&json!("e0"), &json!(8998))
            );
        }
        assert_eq!(prefill.body, decode.body, "the same body to both legs");
        (prefill.stream(), decode.stream())
    };
    let (generation, (p_answer, d_answer)) = tokio::join!(h.execute(handoff()), engines);
    let mut generation = generation.expect("both legs answered");
    d_answer.event(&chunk("hello", Some("stop")));
    d_answer.done();
    let client = Client::default();
    let end = relay(&mut generation, &client, 1, &mut Delivered::default()).await;
    assert!(matches!(end, RelayEnd::Finished { .. }), "{end:?}");
    drop(generation);
    // D's stream ended first: P's answer is still read, not hung up on, and P counts in
    // flight until it ends.
    assert!(
        !done_by_now(p_answer.hung_up()).await,
        "P is not hung up on"
    );
    assert_eq!(h.in_flight(P), 1);
    p_answer.event(&chunk(" w", Some("length")));
    p_answer.done();
    settle().await;
    assert_eq!((h.in_flight(P), h.in_flight(D)), (0, 0));
    assert_eq!((h.failures(P), h.failures(D)), (0, 0));
}

#[tokio::test(start_paused = true)]
async fn a_prefill_leg_that_fails_first_drops_the_decode_leg() {
    let h = harness();
    let (mut p, mut d) = (h.engine(P), h.engine(D));
    let engines = async {
        let (prefill, decode) = (p.next().await, d.next().await);
        prefill.status(500, "prefill crashed");
        decode
    };
    let (result, decode) = tokio::join!(h.execute(handoff()), engines);
    let error = result.expect_err("the prefill leg failed");
    assert_eq!((error.endpoint, error.step), (P, StepKind::PrefillLeg));
    assert!(
        done_by_now(decode.hung_up()).await,
        "D stops waiting for its partner"
    );
    assert_eq!((h.failures(P), h.failures(D)), (1, 0));
}

#[tokio::test(start_paused = true)]
async fn a_decode_leg_that_fails_first_drops_the_prefill_leg() {
    let h = harness();
    let (mut p, mut d) = (h.engine(P), h.engine(D));
    let engines = async {
        let (prefill, decode) = (p.next().await, d.next().await);
        decode.status(503, "decode overloaded");
        prefill
    };
    let (result, prefill) = tokio::join!(h.execute(handoff()), engines);
    let error = result.expect_err("the decode leg failed");
    assert_eq!((error.endpoint, error.step), (D, StepKind::DecodeLeg));
    assert!(
        done_by_now(prefill.hung_up()).await,
        "P stops waiting for its partner"
    );
    assert_eq!((h.failures(P), h.failures(D)), (0, 1));
}

/// D bootstraps from P: a P that dies makes D fail too, and the router may read D's failure
/// first. It is P's: D is not blamed (three in a row would eject a sidecar's only decode
/// engine), and the attempt names P, so a retry or the sidecar's reroute avoids it.
#[tokio::test(start_paused = true)]
async fn a_decode_leg_that_fails_because_its_prefill_engine_died_is_blamed_on_p() {
    let h = harness();
    let (mut p, mut d) = (h.engine(P), h.engine(D));
    let engines = async move {
        let (prefill, decode) = (p.next().await, d.next().await);
        decode.status(500, "cannot reach the bootstrap server");
        // The router has read D's failure and waits for P's verdict...
        settle().await;
        // ...which comes: P dies, its connection closed without an answer, and it takes
        // no call again.
        drop((prefill, p));
    };
    let (result, ()) = tokio::join!(h.execute(handoff()), engines);
    let error = result.expect_err("the handoff failed");
    assert_eq!((error.endpoint, error.step), (P, StepKind::PrefillLeg));
    assert_eq!(
        (h.failures(P), h.failures(D)),
        (1, 0),
        "P is to blame, not D"
    );
}

/// A P still working when D fails is not failing: D's failure is D's, at the end of the
/// bounded wait for P's verdict, and P is hung up on.
#[tokio::test(start_paused = true)]
async fn a_decode_leg_that_fails_while_p_works_is_blamed_on_d_after_a_bounded_wait() {
    let h = harness();
    let (mut p, mut d) = (h.engine(P), h.engine(D));
    let engines = async {
        let (prefill, decode) = (p.next().await, d.next().await);
        decode.status(500, "decode crashed");
        prefill
    };
    let started = tokio::time::Instant::now();
    let (result, prefill) = tokio::join!(h.execute(handoff()), engines);
    let error = result.expect_err("the decode leg failed");
    assert_eq!((error.endpoint, error.step), (D, StepKind::DecodeLeg));
    assert!(
        started.elapsed() <= Duration::from_millis(251),
        "D's failure waited {:?} for P's verdict",
        started.elapsed()
    );
    assert!(done_by_now(prefill.hung_up()).await, "P is hung up on");
    assert_eq!((h.failures(P), h.failures(D)), (0, 1));
}

#[tokio::test(start_paused = true)]
async fn a_prefill_that_fails_while_d_streams_ends_the_stream_blamed_on_p() {
    let h = harness();
    let (mut p, mut d) = (h.engine(P), h.engine(D));
    let engines = async { (p.next().await.stream(), d.next().await.stream()) };
    let (generation, (p_answer, d_answer)) = tokio::join!(h.execute(handoff()), engines);
    let mut generation = generation.expect("both legs answered");
    d_answer.event(&chunk("a", None));
    let client = Client::default();
    let mut delivered = Delivered::default();
    let relayed = relay(&mut generation, &client, 1, &mut delivered);
    let failing = async {
        settle().await;
        // D waits for KV that will never come.
        p_answer.break_off();
    };
    let (end, ()) = tokio::join!(relayed, failing);
    let RelayEnd::Failed(error) = end else {
        panic!("expected the relay to fail, got {end:?}");
    };
    assert_eq!((error.endpoint, error.step), (P, StepKind::PrefillLeg));
    assert!(error.retryable(), "{error}");
    assert_eq!(delivered.text, "a", "what D sent before is delivered");
    // The router records a relay's failure against the endpoint it names.
    error.record(h.cluster());
    assert_eq!(
        (h.failures(P), h.failures(D)),
        (1, 0),
        "P is to blame, not D"
    );
    drop(generation);
    assert!(done_by_now(d_answer.hung_up()).await, "D is hung up on");
}
