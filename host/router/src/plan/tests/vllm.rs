//! vLLM's handoff: P first, then D with P's `kv_transfer_params`; who is hung up on when the
//! client leaves before or after P answered, and who is blamed when a leg fails.

use std::pin::pin;

use super::*;

const P: EndpointId = 0;
const D: EndpointId = 1;

fn harness() -> Harness {
    Harness::new(&[Protocol::Vllm, Protocol::Vllm])
}

fn handoff() -> ValidPlan {
    ValidPlan::Vllm {
        prefill: P,
        decode: D,
    }
}

/// What vLLM's prefill answers: one token, and the params D pulls the KV with.
fn prefill_answer() -> Value {
    json!({"id": "cmpl-p", "object": "text_completion", "created": 0, "model": "m",
        "choices": [{"index": 0, "text": " w", "finish_reason": "length"}],
        "kv_transfer_params": {"remote_engine_id": "p-engine", "remote_block_ids": [1, 2]}})
}

#[tokio::test(start_paused = true)]
async fn p_answers_then_d_gets_its_params_and_generates() {
    let h = harness();
    let (mut p, mut d) = (h.engine(P), h.engine(D));
    let engines = async {
        let prefill = p.next().await;
        assert_eq!(prefill.path, "/v1/completions");
        assert_eq!(
            prefill.body["max_tokens"], 1,
            "P computes the prompt and one token"
        );
        assert_eq!(prefill.headers["x-request-id"], format!("{REQUEST_ID}-1"));
        prefill.json(200, prefill_answer());
        let decode = d.next().await;
        assert_eq!(
            decode.body["kv_transfer_params"],
            prefill_answer()["kv_transfer_params"]
        );
        assert_eq!(decode.headers["x-request-id"], format!("{REQUEST_ID}-1"));
        let stream = decode.stream();
        stream.event(&chunk("hello", Some("stop")));
        stream.done();
    };
    let (generation, ()) = tokio::join!(h.execute(handoff()), engines);
    let mut generation = generation.expect("D generates");
    assert_eq!(generation.generator, D);
    let client = Client::default();
    let end = relay(&mut generation, &client, 1, &mut Delivered::default()).await;
    assert!(matches!(end, RelayEnd::Finished { .. }), "{end:?}");
    assert_eq!(*client.text.lock(), "hello");
}

#[tokio::test(start_paused = true)]
async fn a_leg_to_an_endpoint_pinned_to_a_dp_rank_names_it_and_the_other_does_not() {
    let h = harness();
    let (mut p, mut d) = (h.engine(P), h.engine(D));
    let mut pinned = body();
    pinned.cached = pinned.cached.pinned([(D, 2)].into_iter().collect());
    let engines = async {
        let prefill = p.next().await;
        assert_eq!(prefill.headers.get("x-data-parallel-rank"), None);
        prefill.json(200, prefill_answer());
        let decode = d.next().await;
        assert_eq!(decode.headers["x-data-parallel-rank"], "2");
        let stream = decode.stream();
        stream.event(&chunk("hello", Some("stop")));
        stream.done();
    };
    let (generation, ()) = tokio::join!(h.execute_with(handoff(), pinned), engines);
    assert_eq!(generation.expect("D generates").generator, D);
}

#[tokio::test(start_paused = true)]
async fn a_client_gone_before_p_answers_hangs_up_on_p_and_never_calls_d() {
    let h = harness();
    let (mut p, mut d) = (h.engine(P), h.engine(D));
    let prefill = {
        let mut attempt = pin!(h.execute(handoff()));
        tokio::select! {
            result = &mut attempt => panic!("the attempt ended early: {result:?}"),
            call = p.next() => call,
        }
    };
    // vLLM aborts a request whose client is gone: an aborted prefill holds nothing.
    assert!(done_by_now(prefill.hung_up()).await, "P is hung up on");
    settle().await;
    assert!(d.try_next().is_none(), "D is never called");
    assert_eq!((h.in_flight(P), h.in_flight(D)), (0, 0));
}

#[tokio::test(start_paused = true)]
async fn a_client_gone_after_p_answered_still_gives_d_the_params_then_hangs_up() {
    let h = harness();
    let (mut p, mut d) = (h.engine(P), h.engine(D));
    let answer = {
        let mut attempt = pin!(h.execute(handoff()));
        let prefill = tokio::select! {
            result = &mut attempt => panic!("the attempt ended early: {result:?}"),
            call = p.next() => call,
        };
        // P commits to its answer (the head is out): from here P holds the KV for D.
        let answer = prefill.json_in_parts();
        settle().await;
        answer
    };
    // The client has left; the rest of P's answer arrives anyway.
    answer.bytes(prefill_answer().to_string().as_bytes());
    drop(answer);
    let decode = d.next().await;
    assert_eq!(
        decode.body["kv_transfer_params"],
        prefill_answer()["kv_transfer_params"],
        "only D frees P's blocks early, so D must get the params"
    );
    assert!(
        done_by_now(decode.hung_up()).await,
        "D is hung up on once it has the request: it aborts and tells P to free the blocks"
    );
    assert_eq!((h.in_flight(P), h.in_flight(D)), (0, 0));
}

#[tokio::test(start_paused = true)]
async fn a_failed_prefill_blames_p_and_never_calls_d() {
    let h = harness();
    let (mut p, mut d) = (h.engine(P), h.engine(D));
    let engines = async { p.next().await.status(500, "prefill crashed") };
    let (result, ()) = tokio::join!(h.execute(handoff()), engines);
    let error = result.expect_err("the prefill failed");
    assert_eq!((error.endpoint, error.step), (P, StepKind::PrefillLeg));
    assert!(error.retryable() && error.blames_endpoint(), "{error}");
    assert_eq!((h.failures(P), h.failures(D)), (1, 0));
    settle().await;
    assert!(d.try_next().is_none(), "D is never called");
}

#[tokio::test(start_paused = true)]
async fn a_failed_decode_leg_blames_d_and_counts_p_as_done() {
    let h = harness();
    let (mut p, mut d) = (h.engine(P), h.engine(D));
    let engines = async {
        p.next().await.json(200, prefill_answer());
        d.next().await.status(503, "decode overloaded");
    };
    let (result, ()) = tokio::join!(h.execute(handoff()), engines);
    let error = result.expect_err("the decode leg failed");
    assert_eq!((error.endpoint, error.step), (D, StepKind::DecodeLeg));
    assert_eq!((h.failures(P), h.failures(D)), (0, 1));
}
