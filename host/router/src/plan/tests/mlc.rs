//! MLC's disaggregated flow: what each engine is sent, and that no reservation outlives its
//! attempt, whichever step ends it (a failure, a refusal, the client leaving), including when
//! the release itself meets a busy engine.

use std::pin::pin;

use switchyard_contract::RemoteSend;
use tokio::time::Instant;

use super::*;
use crate::engine_client::scripted::Call;

/// P is endpoint 0, D endpoint 1.
const P: EndpointId = 0;
const D: EndpointId = 1;

fn harness() -> Harness {
    Harness::new(&[Protocol::Mlc, Protocol::Mlc])
}

/// Reserve `[0, 4)` on D, send what D lacks from P, generate on D.
fn disagg() -> ValidPlan {
    ValidPlan::Disagg {
        decode: D,
        end: 4,
        remote_send: Some(RemoteSend {
            prefill: P,
            begin: None,
        }),
    }
}

/// D's answer to prep_recv: it holds the first `matched` tokens already.
fn reserved(call: Call, matched: u32) {
    assert_eq!(call.path, "/microserving/prep_recv");
    call.json(
        200,
        json!({"kv_append_metadata": "AwAAAAAAAABbMF0=", "prefix_matched_length": matched}),
    );
}

/// Every call of an attempt carries its upstream id, and asks for what a continuation needs:
/// the generated ids, and `logprobs` (one entry per token) from engines that ignore those.
fn expect_counted(body: &Value) {
    assert_eq!(body["user"], format!("{REQUEST_ID}-1"));
    assert_eq!(body["return_token_ids"], true);
    assert_eq!(body["logprobs"], true);
}

/// The attempt run up to the call that `until` waits for, then dropped (the client left); the
/// call it got to.
async fn dropped_at(h: &Harness, until: impl Future<Output = Call>) -> Call {
    let mut attempt = pin!(h.execute(disagg()));
    tokio::select! {
        result = &mut attempt => panic!("the attempt ended early: {result:?}"),
        call = until => call,
    }
}

/// The release of D's reservation: a start_generate for the attempt's id, hung up on as soon
/// as D takes it.
async fn expect_release(d: &mut Engine) {
    released(d.next().await).await;
}

/// `release` is D's reservation's, and hangs up as soon as D takes it.
async fn released(release: Call) {
    assert_eq!(release.path, "/microserving/start_generate");
    assert_eq!(release.body["user"], format!("{REQUEST_ID}-1"));
    assert_eq!(release.body["begin"], 4);
    let stream = release.stream();
    assert!(
        done_by_now(stream.hung_up()).await,
        "the release hangs up at once: D aborts, which frees the pages"
    );
}

#[tokio::test(start_paused = true)]
async fn a_disaggregated_attempt_reserves_on_d_sends_from_p_and_generates_on_d() {
    let h = harness();
    let (mut p, mut d) = (h.engine(P), h.engine(D));
    let engines = async {
        let prep = d.next().await;
        expect_counted(&prep.body);
        assert_eq!(prep.body["end"], 4);
        assert_eq!(prep.body["prompt"], json!([1, 2, 3, 4, 5]));
        reserved(prep, 1);
        let send = p.next().await;
        assert_eq!(send.path, "/microserving/remote_send");
        expect_counted(&send.body);
        assert_eq!(
            (
                &send.body["begin"],
                &send.body["end"],
                &send.body["recv_rank"]
            ),
            (&json!(1), &json!(4), &json!(1)),
            "from D's prefix to the window's end, into D's device rank"
        );
        assert_eq!(
            send.body["kv_addr_info"], "AwAAAAAAAABbMF0=",
            "D's, verbatim"
        );
        send.json(200, json!({}));
        let start = d.next().await;
        assert_eq!(start.path, "/microserving/start_generate");
        expect_counted(&start.body);
        assert_eq!(start.body["begin"], 4);
        let stream = start.stream();
        stream.event(&chunk_with_ids("hi", &[7], Some("stop")));
        stream.done();
    };
    let (generation, ()) = tokio::join!(h.execute(disagg()), engines);
    let mut generation = generation.expect("D generates");
    assert_eq!(
        (
            generation.generator,
            generation.prefix_matched,
            generation.remote_send_skipped
        ),
        (D, 1, false)
    );
    assert_eq!(h.in_flight(D), 1, "the generation counts on D");
    let client = Client::default();
    let end = relay(&mut generation, &client, 1, &mut Delivered::default()).await;
    assert!(matches!(end, RelayEnd::Finished { .. }), "{end:?}");
    assert_eq!(*client.text.lock(), "hi");
    drop(generation);
    assert_eq!((h.in_flight(P), h.in_flight(D)), (0, 0));
    settle().await;
    assert!(d.try_next().is_none(), "nothing to release: D generated");
}

#[tokio::test(start_paused = true)]
async fn a_prefix_cache_hit_skips_the_remote_send() {
    let h = harness();
    let (mut p, mut d) = (h.engine(P), h.engine(D));
    let engines = async {
        reserved(d.next().await, 4);
        d.next().await.stream().done();
    };
    let (generation, ()) = tokio::join!(h.execute(disagg()), engines);
    let generation = generation.expect("D generates");
    assert!(generation.remote_send_skipped);
    assert!(p.try_next().is_none(), "P is never called");
}

#[tokio::test(start_paused = true)]
async fn a_failed_remote_send_blames_p_and_releases_ds_reservation() {
    let h = harness();
    let (mut p, mut d) = (h.engine(P), h.engine(D));
    let engines = async {
        reserved(d.next().await, 0);
        p.next().await.status(500, "prefill crashed");
    };
    let (result, ()) = tokio::join!(h.execute(disagg()), engines);
    let error = result.expect_err("remote_send failed");
    assert_eq!((error.endpoint, error.step), (P, StepKind::RemoteSend));
    assert_eq!(error.origin(), Origin::Upstream);
    assert!(error.retryable() && error.blames_endpoint(), "{error}");
    assert_eq!((h.failures(P), h.failures(D)), (1, 0));
    expect_release(&mut d).await;
    settle().await;
    assert!(d.try_next().is_none(), "released once");
}

#[tokio::test(start_paused = true)]
async fn a_release_that_finds_d_busy_tries_again_with_backoff() {
    let h = harness();
    let (mut p, mut d) = (h.engine(P), h.engine(D));
    let engines = async {
        reserved(d.next().await, 0);
        p.next().await.status(503, "");
    };
    let (result, ()) = tokio::join!(h.execute(disagg()), engines);
    result.expect_err("remote_send failed");
    let mut tried = Vec::new();
    for _ in 0..3 {
        let busy = d.next().await;
        tried.push(Instant::now());
        // A transfer still writes into the reservation (the reference engine's 409).
        busy.status(409, "busy");
    }
    let release = d.next().await;
    tried.push(Instant::now());
    released(release).await;
    let gaps: Vec<Duration> = tried.windows(2).map(|w| w[1] - w[0]).collect();
    assert_eq!(
        gaps,
        [50, 100, 200].map(Duration::from_millis),
        "doubling from 50 ms"
    );
    settle().await;
    assert!(d.try_next().is_none(), "freed: no more tries");
}

#[tokio::test(start_paused = true)]
async fn a_release_gives_up_after_its_patience() {
    let h = harness();
    let (mut p, mut d) = (h.engine(P), h.engine(D));
    let engines = async {
        reserved(d.next().await, 0);
        p.next().await.status(503, "");
    };
    let (result, ()) = tokio::join!(h.execute(disagg()), engines);
    result.expect_err("remote_send failed");
    let first = Instant::now();
    let mut last = first;
    let mut tries = 0;
    // Far more than the patience allows at the capped backoff (5 s): the loop ends when the
    // release stops trying.
    while let Ok(busy) = tokio::time::timeout(Duration::from_secs(60), d.next()).await {
        tries += 1;
        assert!(tries < 1_000, "a release that never gives up");
        last = Instant::now();
        busy.status(409, "busy");
    }
    let patience = Duration::from_secs(600);
    assert!(
        last - first < patience && last - first + Duration::from_secs(5) >= patience,
        "the last try {:?} after the first is within one capped backoff of the patience",
        last - first
    );
}

#[tokio::test(start_paused = true)]
async fn a_refused_start_generate_is_the_requests_fault_and_releases_the_reservation() {
    let h = harness();
    let (mut p, mut d) = (h.engine(P), h.engine(D));
    let engines = async {
        reserved(d.next().await, 0);
        p.next().await.json(200, json!({}));
        d.next().await.status(400, "prompt too long");
    };
    let (result, ()) = tokio::join!(h.execute(disagg()), engines);
    let error = result.expect_err("start_generate refused");
    assert_eq!((error.endpoint, error.step), (D, StepKind::StartGenerate));
    assert_eq!(error.origin(), Origin::Downstream);
    assert!(!error.retryable() && !error.blames_endpoint(), "{error}");
    assert_eq!(h.failures(D), 0);
    expect_release(&mut d).await;
}

#[tokio::test(start_paused = true)]
async fn a_client_gone_during_prep_recv_leaves_nothing_reserved() {
    let h = harness();
    let (mut p, mut d) = (h.engine(P), h.engine(D));
    let prep = dropped_at(&h, d.next()).await;
    // The answer still comes, to nobody: the reservation it made is released.
    reserved(prep, 0);
    expect_release(&mut d).await;
    settle().await;
    assert!(p.try_next().is_none(), "P is never called");
    assert_eq!((h.in_flight(P), h.in_flight(D)), (0, 0));
}

#[tokio::test(start_paused = true)]
async fn a_client_gone_during_a_failed_prep_recv_has_nothing_to_release() {
    let h = harness();
    let mut d = h.engine(D);
    let prep = dropped_at(&h, d.next()).await;
    prep.status(503, "out of pages");
    settle().await;
    assert!(d.try_next().is_none(), "nothing reserved, nothing released");
}

#[tokio::test(start_paused = true)]
async fn a_client_gone_during_remote_send_hangs_up_on_p_and_releases_d() {
    let h = harness();
    let (mut p, mut d) = (h.engine(P), h.engine(D));
    let send = dropped_at(&h, async {
        reserved(d.next().await, 0);
        p.next().await
    })
    .await;
    assert!(done_by_now(send.hung_up()).await, "P is hung up on");
    expect_release(&mut d).await;
    assert_eq!((h.in_flight(P), h.in_flight(D)), (0, 0));
}

#[tokio::test(start_paused = true)]
async fn a_client_gone_during_start_generate_hangs_up_on_ds_stream_without_a_release() {
    let h = harness();
    let (mut p, mut d) = (h.engine(P), h.engine(D));
    let start = dropped_at(&h, async {
        reserved(d.next().await, 0);
        p.next().await.json(200, json!({}));
        d.next().await
    })
    .await;
    // D answers to nobody: its stream is hung up on, and D frees the pages itself.
    let stream = start.stream();
    assert!(
        done_by_now(stream.hung_up()).await,
        "D's stream is hung up on"
    );
    settle().await;
    assert!(
        d.try_next().is_none(),
        "D took the reservation over: no release"
    );
}
