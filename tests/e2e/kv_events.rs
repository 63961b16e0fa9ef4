//! The router's KV-event wiring against reference engines that publish their prefix cache
//! (`--prefix-cache --kv-events --kv-events-replay`): an endpoint given `kv_events` is
//! subscribed to, a prompt an engine cached (sent straight to it, past the router) is in the
//! next request's snapshot as that endpoint's cached prefix, the engine's own `cached_tokens`
//! confirms the prediction (the accuracy counter counts a hit) and reaches the client, whole and
//! streamed; `switchyard up --prefix-cache` wires every engine's events to its router, and a
//! repeated prompt through each protocol's P/D handoff is predicted and confirmed; an engine
//! with several DP ranks is subscribed to per rank.

use std::time::Duration;

use serde_json::{Value, json};
use switchyard_tests::{EngineProcess, RouterProcess, free_port};

use crate::http::{post, post_json, sse_payloads};
use crate::router::{eventually, metric, post_or_get};

/// The reference engine's default `--page-size`: the blocks it announces.
const BLOCK: u32 = 16;
/// The longest wait for a subscriber to apply what an engine published.
const WITHIN: Duration = Duration::from_secs(20);

/// The addresses of `engine`'s KV-event publisher and its replay socket, from its ready line.
pub(crate) fn kv_sockets(engine: &EngineProcess) -> (String, String) {
    let events = engine
        .kv_events
        .clone()
        .expect("the ready line names the socket");
    let replay = engine
        .kv_events_replay
        .clone()
        .expect("and the replay socket");
    (events, replay)
}

pub(crate) const PUBLISHING: [&str; 5] = [
    "--prefix-cache",
    "--kv-events",
    "tcp://127.0.0.1:0",
    "--kv-events-replay",
    "tcp://127.0.0.1:0",
];

fn completion(prompt: &[u32]) -> Value {
    json!({"model": "switchyard-reference", "prompt": prompt, "max_tokens": 4})
}

/// 40 tokens, two whole blocks and a part, starting with `first`.
fn prompt_from(first: u32) -> Vec<u32> {
    (first..first + 40).collect()
}

fn cached_tokens(usage: &Value) -> Option<u64> {
    usage["prompt_tokens_details"]["cached_tokens"].as_u64()
}

async fn endpoints(router: &RouterProcess) -> Vec<Value> {
    post_or_get(&router.endpoint("/admin/endpoints")).await["endpoints"]
        .as_array()
        .expect("endpoints")
        .clone()
}

/// The usage chunk of a streamed completion.
async fn streamed_usage(url: &str, prompt: &[u32]) -> Value {
    let mut body = completion(prompt);
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let (status, text) = post(url, &body).await;
    assert_eq!(status, 200, "{text}");
    sse_payloads(&text)
        .iter()
        .filter(|p| *p != "[DONE]")
        .map(|p| serde_json::from_str::<Value>(p).expect("chunk JSON"))
        .find_map(|chunk| (!chunk["usage"].is_null()).then(|| chunk["usage"].clone()))
        .unwrap_or_else(|| panic!("no usage chunk in {text}"))
}

#[tokio::test]
async fn a_prompt_the_engine_cached_is_predicted_and_its_cached_tokens_confirm_it() {
    let engine = EngineProcess::spawn(&PUBLISHING);
    let (events, replay) = kv_sockets(&engine);
    let endpoint = format!(
        "{},kv_events={events},kv_events_replay={replay}",
        engine.url
    );
    let router = RouterProcess::serve_ready(&[&endpoint], &["--policy", "round-robin"]);
    let shown = endpoints(&router).await[0]["kv_events"].clone();
    assert_eq!(
        (shown["events"].as_str(), shown["replay"].as_str()),
        (Some(events.as_str()), Some(replay.as_str())),
        "{shown}"
    );

    // Straight to the engine, past the router. A SUB socket misses what was published before
    // it joined (the replay then fills only gaps it sees): new prompts until one is indexed.
    let mut prompt = Vec::new();
    for first in 1..=20 {
        prompt = prompt_from(first);
        let answer = post_json(&engine.endpoint("/v1/completions"), &completion(&prompt)).await;
        assert_eq!(cached_tokens(&answer["usage"]), Some(0), "{answer}");
        let indexed = tokio::time::timeout(Duration::from_secs(1), async {
            while endpoints(&router).await[0]["kv_events"]["blocks"]
                .as_u64()
                .unwrap_or(0)
                < 2
            {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        });
        if indexed.await.is_ok() {
            break;
        }
    }
    let kv = endpoints(&router).await[0]["kv_events"].clone();
    assert!(kv["blocks"].as_u64() >= Some(2), "never indexed: {kv}");
    assert_eq!(kv["block_size"], BLOCK, "{kv}");

    // Through the router: the snapshot predicted the two whole blocks, the engine served them
    // from its cache, and the client sees that.
    let metrics = router.endpoint("/metrics");
    let answer = post_json(&router.endpoint("/v1/completions"), &completion(&prompt)).await;
    assert_eq!(
        (
            answer["usage"]["prompt_tokens"].as_u64(),
            cached_tokens(&answer["usage"])
        ),
        (Some(40), Some(u64::from(2 * BLOCK))),
        "{answer}"
    );
    assert_eq!(metric(&metrics, "switchyard_kv_predictions").await, 1.0);
    // The reference engine always reports cached_tokens: every prediction is checked.
    assert_eq!(
        metric(&metrics, "switchyard_kv_predictions_checked").await,
        1.0
    );
    assert_eq!(
        metric(&metrics, "switchyard_kv_predicted_prefix_tokens").await,
        f64::from(2 * BLOCK)
    );
    assert_eq!(metric(&metrics, "switchyard_kv_prediction_hits").await, 1.0);

    // Streamed, the usage chunk says the same.
    let usage = streamed_usage(&router.endpoint("/v1/completions"), &prompt).await;
    assert_eq!(cached_tokens(&usage), Some(u64::from(2 * BLOCK)), "{usage}");
    assert_eq!(metric(&metrics, "switchyard_kv_prediction_hits").await, 2.0);

    // Its first two blocks alone: both are predicted, but the engine computes the last prompt
    // token itself and reports one block: still a hit.
    let aligned = &prompt[..2 * BLOCK as usize];
    let answer = post_json(&router.endpoint("/v1/completions"), &completion(aligned)).await;
    assert_eq!(
        cached_tokens(&answer["usage"]),
        Some(u64::from(BLOCK)),
        "{answer}"
    );
    assert_eq!(
        metric(&metrics, "switchyard_kv_predicted_prefix_tokens").await,
        f64::from(3 * 2 * BLOCK)
    );
    assert_eq!(metric(&metrics, "switchyard_kv_prediction_hits").await, 3.0);
}

#[tokio::test]
async fn without_events_the_client_still_sees_the_engines_cached_tokens() {
    let engine = EngineProcess::spawn(&["--prefix-cache"]);
    let router = RouterProcess::serve_ready(&[&engine.url], &["--policy", "round-robin"]);
    let url = router.endpoint("/v1/completions");
    let prompt = prompt_from(7);
    let first = post_json(&url, &completion(&prompt)).await;
    assert_eq!(cached_tokens(&first["usage"]), Some(0), "{first}");
    let again = post_json(&url, &completion(&prompt)).await;
    assert_eq!(
        cached_tokens(&again["usage"]),
        Some(u64::from(2 * BLOCK)),
        "{again}"
    );
    assert_eq!(
        metric(&router.endpoint("/metrics"), "switchyard_kv_predictions").await,
        0.0,
        "nothing publishes: nothing predicted"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_with_the_prefix_cache_subscribes_its_router_to_every_engine() {
    let router = RouterProcess::up(&["--prefix-cache"]);
    let all = endpoints(&router).await;
    assert_eq!(all.len(), 3, "1 prefill + 2 decode");
    for e in &all {
        let events = e["kv_events"]["events"].as_str().unwrap_or_default();
        assert!(events.starts_with("tcp://127.0.0.1:"), "{e}");
        assert!(e["kv_events"]["replay"].is_string(), "{e}");
    }

    // What the engines cache reaches the router's index; a request then has a prediction.
    let url = router.endpoint("/v1/completions");
    let answer = post_json(&url, &completion(&prompt_from(1))).await;
    assert_eq!(answer["usage"]["prompt_tokens"], 40, "{answer}");
    eventually(WITHIN, || async {
        let blocks: u64 = endpoints(&router)
            .await
            .iter()
            .filter_map(|e| e["kv_events"]["blocks"].as_u64())
            .sum();
        (blocks < 2).then(|| format!("{blocks} blocks indexed"))
    })
    .await;
    post_json(&url, &completion(&prompt_from(1))).await;
    // Every endpoint's index was trusted: both requests' generators had a prediction.
    let metrics = router.endpoint("/metrics");
    assert_eq!(metric(&metrics, "switchyard_kv_predictions").await, 2.0);
}

/// `switchyard up --prefix-cache` over one prefill and one decode engine of `protocol`: a
/// prompt sent twice is served from the decode engine's cache the second time, the client's
/// usage says so, and the index predicted it (a checked hit).
async fn a_repeated_prompt_through_a_handoff_is_predicted_and_confirmed(protocol: &str) {
    let router = RouterProcess::up(&["--prefix-cache", "--protocol", protocol, "--decode", "1"]);
    let url = router.endpoint("/v1/completions");
    let prompt = prompt_from(1);
    let first = post_json(&url, &completion(&prompt)).await;
    assert_eq!(cached_tokens(&first["usage"]), Some(0), "{first}");
    // The decode engine (endpoint 1) publishes what it stored; the next request's snapshot
    // needs it.
    eventually(WITHIN, || async {
        let decode = endpoints(&router).await[1]["kv_events"].clone();
        (decode["blocks"].as_u64().unwrap_or(0) < 2).then(|| format!("decode: {decode}"))
    })
    .await;
    let again = post_json(&url, &completion(&prompt)).await;
    assert_eq!(
        cached_tokens(&again["usage"]),
        Some(u64::from(2 * BLOCK)),
        "{again}"
    );
    let metrics = router.endpoint("/metrics");
    assert_eq!(metric(&metrics, "switchyard_kv_predictions").await, 2.0);
    assert_eq!(
        metric(&metrics, "switchyard_kv_predictions_checked").await,
        2.0
    );
    assert_eq!(
        metric(&metrics, "switchyard_kv_predicted_prefix_tokens").await,
        f64::from(2 * BLOCK),
        "nothing the first time, two blocks the second"
    );
    assert_eq!(metric(&metrics, "switchyard_kv_prediction_hits").await, 2.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_prompt_through_mlc_microserving_is_predicted_and_confirmed() {
    a_repeated_prompt_through_a_handoff_is_predicted_and_confirmed("mlc").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_prompt_through_a_vllm_handoff_is_predicted_and_confirmed() {
    a_repeated_prompt_through_a_handoff_is_predicted_and_confirmed("vllm").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_prompt_through_an_sglang_handoff_is_predicted_and_confirmed() {
    a_repeated_prompt_through_a_handoff_is_predicted_and_confirmed("sglang").await;
}

#[tokio::test]
async fn up_without_the_prefix_cache_subscribes_to_nothing() {
    let router = RouterProcess::up(&[]);
    for e in endpoints(&router).await {
        assert!(e.get("kv_events").is_none_or(Value::is_null), "{e}");
    }
}

/// Two loopback ports in a row that were free a moment ago: where a DP engine's ranks 0 and 1
/// publish.
fn consecutive_free_ports() -> u16 {
    for _ in 0..50 {
        let first = free_port();
        if first < u16::MAX && std::net::TcpListener::bind(("127.0.0.1", first + 1)).is_ok() {
            return first;
        }
    }
    panic!("no two consecutive free ports");
}

/// A two-rank DP engine as vLLM lays its KV events out (rank r on the configured port plus r,
/// stamping r), played by two reference engines: the endpoint is rank 0's HTTP server, and
/// rank 1's cache is filled straight at its own engine. The router subscribes to both ranks,
/// keeps them apart, and predicts the most a rank holds.
#[tokio::test]
async fn each_dp_rank_is_subscribed_at_its_port_and_the_endpoint_shows_the_most_a_rank_holds() {
    let port = consecutive_free_ports();
    let rank0_events = format!("tcp://127.0.0.1:{port}");
    let rank1_events = format!("tcp://127.0.0.1:{}", port + 1);
    let rank0 = EngineProcess::spawn(&["--prefix-cache", "--kv-events", &rank0_events]);
    let rank1 = EngineProcess::spawn(&[
        "--prefix-cache",
        "--kv-events",
        &rank1_events,
        "--kv-events-dp-rank",
        "1",
    ]);
    let endpoint = format!("{},kv_events={rank0_events},kv_events_dp_size=2", rank0.url);
    let router = RouterProcess::serve_ready(&[&endpoint], &["--policy", "round-robin"]);
    let shown = endpoints(&router).await[0]["kv_events"].clone();
    assert_eq!(
        (
            shown["events"].as_str(),
            shown["dp_ranks"][0]["events"].as_str(),
            shown["dp_ranks"][0]["dp_rank"].as_u64()
        ),
        (
            Some(rank0_events.as_str()),
            Some(rank1_events.as_str()),
            Some(1)
        ),
        "{shown}"
    );

    // Rank 1 caches a prompt (a SUB socket misses what was published before it joined: new
    // prompts until one is indexed); rank 0's index stays empty.
    let rank1_blocks = || async {
        endpoints(&router).await[0]["kv_events"]["dp_ranks"][0]["blocks"]
            .as_u64()
            .unwrap_or(0)
    };
    let mut prompt = Vec::new();
    for first in 1..=20 {
        prompt = prompt_from(first);
        post_json(&rank1.endpoint("/v1/completions"), &completion(&prompt)).await;
        let indexed = tokio::time::timeout(Duration::from_secs(1), async {
            while rank1_blocks().await < 2 {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        });
        if indexed.await.is_ok() {
            break;
        }
    }
    let kv = endpoints(&router).await[0]["kv_events"].clone();
    assert!(
        kv["dp_ranks"][0]["blocks"].as_u64() >= Some(2),
        "never indexed: {kv}"
    );
    assert_eq!(kv["blocks"], 0, "rank 0 cached nothing: {kv}");
    assert_eq!(kv["dp_ranks"][0]["rank_mismatches"], Value::Null, "{kv}");

    // Through the router: the prediction is rank 1's two whole blocks (the request pinned to
    // rank 1; the reference engine, one rank, does not read the header).
    post_json(&router.endpoint("/v1/completions"), &completion(&prompt)).await;
    let metrics = router.endpoint("/metrics");
    assert_eq!(metric(&metrics, "switchyard_kv_predictions").await, 1.0);
    assert_eq!(
        metric(&metrics, "switchyard_kv_predicted_prefix_tokens").await,
        f64::from(2 * BLOCK)
    );
}

/// An engine publishing another rank than its socket's: each batch counted and dropped.
#[tokio::test]
async fn a_rank_publishing_on_another_ranks_port_is_counted_and_dropped() {
    let port = consecutive_free_ports();
    let rank0_events = format!("tcp://127.0.0.1:{port}");
    let rank1_events = format!("tcp://127.0.0.1:{}", port + 1);
    let rank0 = EngineProcess::spawn(&["--prefix-cache", "--kv-events", &rank0_events]);
    // Stamps rank 0 on rank 1's port: a misconfigured deployment.
    let stray = EngineProcess::spawn(&["--prefix-cache", "--kv-events", &rank1_events]);
    let endpoint = format!("{},kv_events={rank0_events},kv_events_dp_size=2", rank0.url);
    let router = RouterProcess::serve_ready(&[&endpoint], &["--policy", "round-robin"]);
    // A new prompt each time: a SUB socket misses what was published before it joined, and a
    // prompt cached already publishes nothing.
    let mut sent = 0;
    eventually(WITHIN, || {
        sent += 1;
        let prompt = prompt_from(sent * 50);
        let (router, stray) = (&router, &stray);
        async move {
            post_json(&stray.endpoint("/v1/completions"), &completion(&prompt)).await;
            let rank1 = endpoints(router).await[0]["kv_events"]["dp_ranks"][0].clone();
            let mismatches = rank1["rank_mismatches"].as_u64().unwrap_or(0);
            (mismatches == 0).then(|| format!("no mismatch counted yet: {rank1}"))
        }
    })
    .await;
    let rank1 = endpoints(&router).await[0]["kv_events"]["dp_ranks"][0].clone();
    assert_eq!(rank1["blocks"], 0, "{rank1}");
}
