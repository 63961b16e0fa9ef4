//! The pending prefill each leg counts on its endpoint (`endpoint.pending-prefill`): its
//! prompt less the cached prefix predicted when it was planned, from the moment it is sent
//! until its prefill ends (the first chunk, a prefill leg's answer), and released exactly once
//! however the leg ends (a failure, a broken stream, the client gone).

use std::pin::pin;

use switchyard_contract::{EndpointSnapshot, RemoteSend};

use super::*;
use crate::engine_client::scripted::Body;

/// Runs `relay` until it waits on the engine again, then hands it back unfinished.
async fn relay_until_idle(generation: &mut Generation, client: &Client) {
    let mut delivered = Delivered::default();
    let mut relaying = pin!(relay(generation, client, 1, &mut delivered));
    tokio::select! {
        end = &mut relaying => panic!("the relay ended early: {end:?}"),
        () = settle() => {}
    }
}

/// The test request, planned with endpoint `id`'s cache holding `cached` of its five tokens
/// (every other endpoint's unknown).
fn body_with_cached(id: EndpointId, cached: u32) -> AttemptBody {
    let snapshot = EndpointSnapshot {
        cached_prefix: Some(cached),
        ..EndpointSnapshot::synthetic(id)
    };
    AttemptBody {
        cached: CachedPrefixes::new(5, &[snapshot]),
        ..body()
    }
}

/// A forward to one MLC engine planned with `cached` of the prompt on it; the generation and
/// the engine's stream, its head sent.
async fn forwarded(h: &Harness, cached: u32) -> (Generation, Body) {
    let mut engine = h.engine(0);
    let answer = async {
        let call = engine.next().await;
        assert_eq!(h.pending_prefill(0), 5 - cached, "counted once sent");
        call.stream()
    };
    let plan = ValidPlan::Forward { endpoint: 0 };
    let execute = h.execute_with(plan, body_with_cached(0, cached));
    let (generation, answer) = tokio::join!(execute, answer);
    (generation.expect("the engine answered"), answer)
}

#[tokio::test(start_paused = true)]
async fn a_forward_counts_its_uncached_prompt_until_the_first_chunk() {
    let h = Harness::new(&[Protocol::Mlc]);
    let (mut generation, answer) = forwarded(&h, 2).await;
    assert_eq!(h.pending_prefill(0), 3, "the head came, no token yet");
    answer.event(&chunk("a", None));
    let client = Client::default();
    relay_until_idle(&mut generation, &client).await;
    assert_eq!(
        h.pending_prefill(0),
        0,
        "the first token says the prompt is prefilled"
    );
    answer.event(&chunk("b", Some("stop")));
    answer.done();
    let end = relay(&mut generation, &client, 1, &mut Delivered::default()).await;
    assert!(matches!(end, RelayEnd::Finished { .. }), "{end:?}");
    assert_eq!(h.pending_prefill(0), 0, "released once, not twice");
}

#[tokio::test(start_paused = true)]
async fn a_leg_that_fails_before_its_first_chunk_releases_its_count() {
    let h = Harness::new(&[Protocol::Mlc]);
    // Refused: the attempt fails in execute.
    let mut engine = h.engine(0);
    let refusing = async {
        let call = engine.next().await;
        assert_eq!(h.pending_prefill(0), 5);
        call.status(503, "overloaded");
    };
    let (result, ()) = tokio::join!(h.execute(ValidPlan::Forward { endpoint: 0 }), refusing);
    result.expect_err("refused");
    assert_eq!(h.pending_prefill(0), 0);
    // The stream breaks before its first token: the relay fails and the generation is dropped.
    let h = Harness::new(&[Protocol::Mlc]);
    let (mut generation, answer) = forwarded(&h, 0).await;
    assert_eq!(h.pending_prefill(0), 5);
    answer.break_off();
    let end = relay(
        &mut generation,
        &Client::default(),
        1,
        &mut Delivered::default(),
    )
    .await;
    assert!(matches!(end, RelayEnd::Failed(_)), "{end:?}");
    drop(generation);
    assert_eq!(h.pending_prefill(0), 0);
}

#[tokio::test(start_paused = true)]
async fn a_generation_preempted_before_its_first_token_releases_its_count() {
    let h = Harness::new(&[Protocol::Mlc]);
    let (mut generation, answer) = forwarded(&h, 0).await;
    answer.event(&chunk("", Some("preempt")));
    answer.done();
    let end = relay(
        &mut generation,
        &Client::default(),
        1,
        &mut Delivered::default(),
    )
    .await;
    assert!(matches!(end, RelayEnd::Preempted), "{end:?}");
    assert_eq!(h.pending_prefill(0), 0);
}

#[tokio::test(start_paused = true)]
async fn a_client_gone_mid_prefill_releases_the_count() {
    let h = Harness::new(&[Protocol::Mlc]);
    // Gone while the engine has the call.
    let mut engine = h.engine(0);
    {
        let mut attempt = pin!(h.execute(ValidPlan::Forward { endpoint: 0 }));
        tokio::select! {
            result = &mut attempt => panic!("the attempt ended early: {result:?}"),
            _call = engine.next() => {}
        }
        assert_eq!(h.pending_prefill(0), 5);
    }
    assert_eq!(h.pending_prefill(0), 0);
    // Gone once the stream is open, before its first token.
    let (generation, _answer) = forwarded(&h, 1).await;
    assert_eq!(h.pending_prefill(0), 4);
    drop(generation);
    assert_eq!(h.pending_prefill(0), 0);
}

#[tokio::test(start_paused = true)]
async fn vllm_counts_the_prompt_on_p_until_p_answers_and_never_on_d() {
    let h = Harness::new(&[Protocol::Vllm, Protocol::Vllm]);
    let plan = ValidPlan::Vllm {
        prefill: 0,
        decode: 1,
    };
    let (mut p, mut d) = (h.engine(0), h.engine(1));
    let engines = async {
        let prefill = p.next().await;
        assert_eq!((h.pending_prefill(0), h.pending_prefill(1)), (5, 0));
        prefill.json(
            200,
            json!({"choices": [{"index": 0, "text": " w", "finish_reason": "length"}],
                "kv_transfer_params": {"remote_block_ids": [1]}}),
        );
        let decode = d.next().await;
        assert_eq!(
            (h.pending_prefill(0), h.pending_prefill(1)),
            (0, 0),
            "P answered: its prefill is over, and D pulls the KV"
        );
        decode.stream()
    };
    let (generation, _stream) = tokio::join!(h.execute(plan), engines);
    generation.expect("D streams");
    assert_eq!((h.pending_prefill(0), h.pending_prefill(1)), (0, 0));
}

#[tokio::test(start_paused = true)]
async fn vllm_counts_the_prompt_on_d_when_p_hands_it_no_kv() {
    let h = Harness::new(&[Protocol::Vllm, Protocol::Vllm]);
    let plan = ValidPlan::Vllm {
        prefill: 0,
        decode: 1,
    };
    let (mut p, mut d) = (h.engine(0), h.engine(1));
    let engines = async {
        p.next().await.json(
            200,
            json!({"choices": [{"index": 0, "text": " w", "finish_reason": "stop"}]}),
        );
        let decode = d.next().await;
        assert_eq!((h.pending_prefill(0), h.pending_prefill(1)), (0, 5));
        decode.stream()
    };
    let (generation, stream) = tokio::join!(h.execute(plan), engines);
    let mut generation = generation.expect("D streams");
    assert_eq!(h.pending_prefill(1), 5, "D prefills the prompt itself");
    stream.event(&chunk("a", None));
    relay_until_idle(&mut generation, &Client::default()).await;
    assert_eq!(h.pending_prefill(1), 0);
}

/// SGLang's P (with its bootstrap port) and D.
fn sglang() -> Harness {
    let prefill = EndpointSpec {
        role: Role::Prefill,
        bootstrap_port: Some(8998),
        ..spec(Protocol::Sglang)
    };
    let decode = EndpointSpec {
        role: Role::Decode,
        ..spec(Protocol::Sglang)
    };
    Harness::with(vec![prefill, decode], Timeouts::default())
}

/// Both legs of an SGLang handoff answered with streams: the generation and P's, D's streams.
async fn sglang_streams(h: &Harness) -> (Generation, Body, Body) {
    let plan = ValidPlan::Sglang {
        prefill: 0,
        decode: 1,
    };
    let (mut p, mut d) = (h.engine(0), h.engine(1));
    let engines = async {
        let (prefill, decode) = (p.next().await, d.next().await);
        assert_eq!((h.pending_prefill(0), h.pending_prefill(1)), (5, 0));
        (prefill.stream(), decode.stream())
    };
    let (generation, (p_answer, d_answer)) = tokio::join!(h.execute(plan), engines);
    (generation.expect("both legs answered"), p_answer, d_answer)
}

#[tokio::test(start_paused = true)]
async fn sglang_counts_the_prompt_on_p_until_ds_first_token_or_ps_answer_whichever_is_first() {
    // D's first token first: P's answer is still open.
    let h = sglang();
    let (mut generation, _p_answer, d_answer) = sglang_streams(&h).await;
    assert_eq!(h.pending_prefill(0), 5);
    d_answer.event(&chunk("a", None));
    relay_until_idle(&mut generation, &Client::default()).await;
    assert_eq!((h.pending_prefill(0), h.pending_prefill(1)), (0, 0));
    drop(generation);
    assert_eq!(h.pending_prefill(0), 0, "released once");

    // P's answer ends first: D has sent nothing yet.
    let h = sglang();
    let (mut generation, p_answer, _d_answer) = sglang_streams(&h).await;
    p_answer.event(&chunk(" w", Some("length")));
    p_answer.done();
    relay_until_idle(&mut generation, &Client::default()).await;
    assert_eq!((h.pending_prefill(0), h.pending_prefill(1)), (0, 0));
}

#[tokio::test(start_paused = true)]
async fn mlc_counts_the_window_on_p_until_remote_send_returns_and_the_tail_on_d() {
    let h = Harness::new(&[Protocol::Mlc, Protocol::Mlc]);
    // [0, 4) from P, whose cache holds 1 token of it; D computes the last token itself.
    let plan = ValidPlan::Disagg {
        decode: 1,
        end: 4,
        remote_send: Some(RemoteSend {
            prefill: 0,
            begin: None,
        }),
    };
    let (mut p, mut d) = (h.engine(0), h.engine(1));
    let engines = async {
        let prep = d.next().await;
        assert_eq!((h.pending_prefill(0), h.pending_prefill(1)), (0, 1));
        prep.json(
            200,
            json!({"kv_append_metadata": "AwAAAAAAAABbMF0=", "prefix_matched_length": 0}),
        );
        let send = p.next().await;
        assert_eq!((h.pending_prefill(0), h.pending_prefill(1)), (3, 1));
        send.json(200, json!({}));
        let start = d.next().await;
        assert_eq!((h.pending_prefill(0), h.pending_prefill(1)), (0, 1));
        start.stream()
    };
    let execute = h.execute_with(plan, body_with_cached(0, 1));
    let (generation, stream) = tokio::join!(execute, engines);
    let mut generation = generation.expect("D generates");
    stream.event(&chunk("a", None));
    relay_until_idle(&mut generation, &Client::default()).await;
    assert_eq!((h.pending_prefill(0), h.pending_prefill(1)), (0, 0));
}

#[tokio::test(start_paused = true)]
async fn mlc_without_a_remote_send_counts_the_whole_uncached_prompt_on_d() {
    let h = Harness::new(&[Protocol::Mlc]);
    let plan = ValidPlan::Disagg {
        decode: 0,
        end: 4,
        remote_send: None,
    };
    let mut d = h.engine(0);
    let engine = async {
        let prep = d.next().await;
        assert_eq!(h.pending_prefill(0), 3);
        // D fails: the attempt ends, its count with it.
        prep.status(500, "boom");
    };
    let execute = h.execute_with(plan, body_with_cached(0, 2));
    let (result, ()) = tokio::join!(execute, engine);
    result.expect_err("prep_recv failed");
    assert_eq!(h.pending_prefill(0), 0);
}
