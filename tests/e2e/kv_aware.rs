//! The built-in `kv-aware` policy served by the router in front of reference engines, loaded by
//! name from the checkout's `plugins/` as `disagg` is. Outputs equal a single engine's; the
//! engines' own metrics show what the policy planned (forwarded whole, or disaggregated with the
//! KV the decode engine holds left where it is) and, on the engines' KV events, where each
//! follow-up went: to the engine holding its prefix, away from one that evicted or lost it.

use serde_json::{Value, json};
use switchyard_tests::{EngineProcess, RouterProcess};

use crate::examples::{PREFIX_MATCHED, REMOTE_SENDS, page_aligned_prompts};
use crate::http::post_json;
use crate::router::{assert_completion_matches, metric, post_or_get, prompts, reference};

/// `name` summed over the `/metrics` of every engine the router at `router` lists.
async fn engine_total(router: &RouterProcess, name: &str) -> f64 {
    let status = post_or_get(&router.endpoint("/admin/endpoints")).await;
    let mut total = 0.0;
    for e in status["endpoints"].as_array().expect("an endpoint list") {
        let url = e["url"].as_str().expect("endpoint url");
        total += metric(&format!("{url}/metrics"), name).await;
    }
    total
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_roleless_cluster_without_events_it_forwards_every_request_whole() {
    let truth = EngineProcess::spawn(&[]);
    let engines: Vec<EngineProcess> = (0..3).map(|_| EngineProcess::spawn(&[])).collect();
    let urls: Vec<&str> = engines.iter().map(|e| e.url.as_str()).collect();
    let router = RouterProcess::serve(&urls, &["--policy", "kv-aware"]);
    let status = post_or_get(&router.endpoint("/admin/endpoints")).await;
    assert_eq!(status["policy"], "kv-aware", "{status}");
    let cases = prompts(71, 6);
    for (prompt, max_tokens) in &cases {
        let body = json!({"prompt": prompt, "max_tokens": max_tokens});
        assert_completion_matches(&router.endpoint("/v1/completions"), &truth, &body).await;
    }
    // Each case is posted twice (streamed and not), each a single call on one engine.
    let calls = engine_total(&router, "switchyard_engine_calls_received").await;
    assert_eq!(calls, 2.0 * cases.len() as f64);
    assert_eq!(engine_total(&router, REMOTE_SENDS).await, 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_mlc_roles_it_disaggregates_and_leaves_what_the_decode_engine_holds() {
    const MAX_TOKENS: u32 = 8;
    let truth = EngineProcess::spawn(&[]);
    let router = RouterProcess::up(&[
        "--prefill",
        "1",
        "--decode",
        "2",
        "--prefix-cache",
        "--policy",
        "kv-aware",
    ]);
    let url = router.endpoint("/v1/completions");
    let prompts = page_aligned_prompts(72, 3);
    let text = |answer: &Value| answer["choices"][0]["text"].as_str().map(str::to_owned);
    let mut expected = Vec::new();
    for p in &prompts {
        let (reference_text, _) = reference(&truth, p, MAX_TOKENS).await;
        let answer = post_json(&url, &json!({"prompt": p, "max_tokens": MAX_TOKENS})).await;
        assert_eq!(text(&answer), Some(reference_text.clone()), "first sight");
        expected.push(reference_text);
    }
    assert_eq!(
        engine_total(&router, REMOTE_SENDS).await,
        prompts.len() as f64,
        "every new prompt is prefilled and its KV moved once"
    );
    let matched = engine_total(&router, PREFIX_MATCHED).await;

    // One at a time the decode engines are equally idle, so each repeat goes to the decode
    // engine that took it the first time; it holds the whole KV window, and nothing moves.
    for (p, reference_text) in prompts.iter().zip(&expected) {
        let answer = post_json(&url, &json!({"prompt": p, "max_tokens": MAX_TOKENS})).await;
        assert_eq!(text(&answer).as_ref(), Some(reference_text), "repeat");
    }
    assert_eq!(
        engine_total(&router, REMOTE_SENDS).await,
        prompts.len() as f64,
        "no repeat moved KV"
    );
    let window: usize = prompts.iter().map(|p| p.len() - 1).sum();
    let matched_again = engine_total(&router, PREFIX_MATCHED).await - matched;
    assert!(
        matched_again >= window as f64,
        "the decode engine took every repeat's whole KV window ({window} tokens) from its \
         prefix cache, got {matched_again}"
    );
}

// === on the engines' KV events ===
//
// Each engine publishes its prefix cache's events (`--kv-events`, `--kv-events-replay`) and the
// router subscribes (`--endpoint URL,kv_events=…,kv_events_replay=…`): the cache state the
// policy routes on is made by requests sent straight to the engines, behind the router's back.

/// Engines in the event tests: enough that chance (about 1/N) and the policy are far apart.
const ENGINES: usize = 4;
/// Follow-up requests in the routing test, one per seeded conversation.
const CONVERSATIONS: usize = 16;
/// How long the router may take to index what an engine published (it is milliseconds on
/// loopback; the bound is for a loaded 2-core machine).
const INDEX_DEADLINE: std::time::Duration = std::time::Duration::from_secs(20);

/// `ENGINES` reference engines publishing KV events (and answering replays), and a router
/// subscribed to all of them serving `kv-aware`.
struct EventCluster {
    engines: Vec<EngineProcess>,
    router: RouterProcess,
}

impl EventCluster {
    /// Engines with `kv_pages` pages each, and the router.
    fn start(kv_pages: u32) -> EventCluster {
        Self::route(publishing_engines(kv_pages))
    }

    /// The router in front of engines already running.
    fn route((engines, endpoints): (Vec<EngineProcess>, Vec<String>)) -> EventCluster {
        let refs: Vec<&str> = endpoints.iter().map(String::as_str).collect();
        let router = RouterProcess::serve(&refs, &["--policy", "kv-aware"]);
        EventCluster { engines, router }
    }

    /// Which engine served one routed completion of `prompt` (by their `calls_received`).
    async fn routed_to(&self, prompt: &str, policy: &str) -> usize {
        let before = self.calls().await;
        let client = crate::http::client();
        let response = client
            .post(self.router.endpoint("/v1/completions"))
            .header("x-switchyard-policy", policy)
            .json(&json!({"prompt": prompt, "max_tokens": 1}))
            .send()
            .await
            .expect("router reachable");
        assert_eq!(response.status().as_u16(), 200, "{prompt:?}");
        let after = self.calls().await;
        let served: Vec<usize> = (0..ENGINES).filter(|&i| after[i] > before[i]).collect();
        assert_eq!(
            served.len(),
            1,
            "one engine served it: {before:?} -> {after:?}"
        );
        served[0]
    }

    async fn calls(&self) -> Vec<f64> {
        let mut calls = Vec::new();
        for e in &self.engines {
            calls.push(metric(&e.endpoint("/metrics"), "switchyard_engine_calls_received").await);
        }
        calls
    }

    /// Waits until the router routes by what engine `at` published: a fresh prompt sent
    /// straight to it, then through the router, lands there. Each try uses a new prompt, so a
    /// try routed before the index caught up leaves nothing that sways the next one.
    async fn wait_until_indexed(&self, at: usize) {
        let deadline = std::time::Instant::now() + INDEX_DEADLINE;
        for attempt in 0.. {
            let probe = conversation(1000 + attempt, at);
            straight_to(&self.engines[at], &probe).await;
            if self.routed_to(&probe, "kv-aware").await == at {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the router did not route on engine {at}'s events within {INDEX_DEADLINE:?}"
            );
        }
    }
}

/// `ENGINES` engines publishing their KV events, and how the router subscribes to each:
/// `URL,kv_events=tcp://…,kv_events_replay=tcp://…`.
fn publishing_engines(kv_pages: u32) -> (Vec<EngineProcess>, Vec<String>) {
    (0..ENGINES).map(|_| publishing_engine(kv_pages)).unzip()
}

/// Tries to start an engine with its event sockets on ports that were free a moment ago.
const PORT_TRIES: usize = 3;

/// One engine publishing its KV events, and its router endpoint. The engine binds ports chosen
/// here (it does not say which it bound for port 0), so another process may take one between
/// the choice and the bind: then the engine exits at start, and it is tried again on new ports.
fn publishing_engine(kv_pages: u32) -> (EngineProcess, String) {
    let mut tries = 0;
    loop {
        tries += 1;
        match std::panic::catch_unwind(|| spawn_publishing(kv_pages)) {
            Ok(started) => return started,
            Err(panic) if tries == PORT_TRIES => std::panic::resume_unwind(panic),
            Err(_) => {}
        }
    }
}

fn spawn_publishing(kv_pages: u32) -> (EngineProcess, String) {
    let (events, replay) = (event_socket(), event_socket());
    let engine = EngineProcess::spawn(&[
        "--prefix-cache",
        "--kv-pages",
        &kv_pages.to_string(),
        "--kv-events",
        &events,
        "--kv-events-replay",
        &replay,
    ]);
    let endpoint = format!(
        "{},kv_events={events},kv_events_replay={replay}",
        engine.url
    );
    (engine, endpoint)
}

fn event_socket() -> String {
    format!("tcp://127.0.0.1:{}", switchyard_tests::free_port())
}

/// Whole 16-token pages in a conversation's history: 1024 cached tokens outweigh one more
/// request in the holder's queue (512 by default), so an engine probe that catches a request
/// running there does not send the follow-up elsewhere.
const HISTORY_PAGES: usize = 64;

/// Conversation `n`'s history: `HISTORY_PAGES` whole 16-token pages of its own (distinct from
/// the first page on), then one more token, so every page of it is cached once an engine has
/// served it. `home` only makes the text say where it was sent first.
fn conversation(n: usize, home: usize) -> String {
    let head = format!("conversation {n} on engine {home}: ");
    let body = head + &"the user asks and the model answers. ".repeat(HISTORY_PAGES);
    body[..16 * HISTORY_PAGES + 1].to_owned()
}

/// Serves `prompt` on `engine` itself, behind the router's back.
async fn straight_to(engine: &EngineProcess, prompt: &str) {
    let answer = post_json(
        &engine.endpoint("/v1/completions"),
        &json!({"prompt": prompt, "max_tokens": 1}),
    )
    .await;
    assert!(answer["choices"][0]["text"].is_string(), "{answer}");
}

/// Conversation `n`'s next turn: its history and a new question.
fn follow_up(history: &str) -> String {
    format!("{history} and then a new question")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn follow_ups_go_to_the_engine_that_cached_their_prefix_behind_the_routers_back() {
    let cluster = EventCluster::start(2048);
    let histories: Vec<(String, usize)> = (0..CONVERSATIONS)
        .map(|n| (conversation(n, n % ENGINES), n % ENGINES))
        .collect();
    for (history, home) in &histories {
        straight_to(&cluster.engines[*home], history).await;
    }
    cluster.wait_until_indexed(ENGINES - 1).await;
    let mut kv_aware_hits = 0;
    for (history, home) in &histories {
        if cluster.routed_to(&follow_up(history), "kv-aware").await == *home {
            kv_aware_hits += 1;
        }
    }
    // The same follow-ups again under the cache-blind built-in: chance, about 1 in ENGINES.
    let mut blind_hits = 0;
    for (history, home) in &histories {
        let again = follow_up(&follow_up(history));
        if cluster.routed_to(&again, "round-robin").await == *home {
            blind_hits += 1;
        }
    }
    assert!(
        kv_aware_hits * 10 >= CONVERSATIONS * 9,
        "kv-aware sent {kv_aware_hits} of {CONVERSATIONS} follow-ups to their prefix's engine"
    );
    assert!(
        blind_hits * 2 <= CONVERSATIONS,
        "round-robin hit {blind_hits} of {CONVERSATIONS}: the test would not tell them apart"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_evicted_prefix_no_longer_draws_its_follow_ups() {
    // Three 65-page conversations fill an engine of 200 pages; four more evict the first.
    let cluster = EventCluster::start(200);
    let held = conversation(0, 1);
    straight_to(&cluster.engines[1], &held).await;
    cluster.wait_until_indexed(1).await;
    assert_eq!(cluster.routed_to(&follow_up(&held), "kv-aware").await, 1);
    for n in 1..=4 {
        straight_to(&cluster.engines[1], &conversation(n, 1)).await;
    }
    cluster.wait_until_indexed(1).await;
    // Engine 1 no longer holds it and nobody else does: the cost is load alone, and the idle
    // engine with the lowest id wins.
    let again = follow_up(&follow_up(&held));
    assert_eq!(cluster.routed_to(&again, "kv-aware").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_published_before_the_router_subscribed_are_recovered_by_replay() {
    let engines = publishing_engines(2048);
    // Engine 2 caches a conversation while no router listens: its batches are gone from the
    // PUB socket, and only the replay socket still has them.
    let history = conversation(0, 2);
    straight_to(&engines.0[2], &history).await;
    // On connecting, the router asks each engine's replay socket for what it buffers.
    let cluster = EventCluster::route(engines);
    cluster.wait_until_indexed(2).await;
    assert_eq!(cluster.routed_to(&follow_up(&history), "kv-aware").await, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_engines_index_is_rebuilt_from_its_new_events() {
    let mut cluster = EventCluster::start(2048);
    let lost = conversation(0, 3);
    straight_to(&cluster.engines[3], &lost).await;
    cluster.wait_until_indexed(3).await;
    cluster.engines[3].restart();
    // Its cache is empty now, whatever the router had indexed: a new conversation there is
    // routed to it, the lost one no longer is.
    cluster.wait_until_indexed(3).await;
    assert_eq!(cluster.routed_to(&follow_up(&lost), "kv-aware").await, 0);
}
