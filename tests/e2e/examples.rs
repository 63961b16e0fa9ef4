//! The example policies (`examples/`: Rust, Python, JavaScript) deployed as a user deploys
//! them: copied into a plugins directory and served by `switchyard up` in front of reference
//! engines. Outputs equal a single engine's; the engines' own metrics show that each policy's
//! decision took effect (which requests were disaggregated, which KV transfers were skipped).
//!
//! Needs the built components: `make examples` (writes `target/examples/*.wasm`).

use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use futures::future::join_all;
use serde_json::{Value, json};
use switchyard_tests::{EngineProcess, UpProcess};

use crate::http::{client, post_json};
use crate::router::{assert_completion_matches, metric, post_or_get, prompts, reference};

/// `remote_send` calls an engine received: the prefill engine's, which computes the prompt and
/// pushes its KV to the decode engine.
pub(crate) const REMOTE_SENDS: &str = "switchyard_engine_remote_send_received";
/// Prompt tokens an engine took from its prefix cache instead of receiving or computing them.
pub(crate) const PREFIX_MATCHED: &str = "switchyard_engine_prefix_matched_tokens";

/// `target/examples/NAME.wasm`, or a failure that says how to build it.
pub(crate) fn built_example(name: &str) -> PathBuf {
    let path = workspace_target().join(format!("examples/{name}.wasm"));
    assert!(
        path.is_file(),
        "{} is missing: build the example policies first: make examples",
        path.display()
    );
    path
}

fn workspace_target() -> PathBuf {
    switchyard_tests::checkout().join("target")
}

/// Held while one router starts (see `deploy`).
static STARTING: Mutex<()> = Mutex::new(());

/// An example policy served by `switchyard up` (1 prefill + 2 decode reference engines) from
/// a plugins directory that holds only that example.
struct Deployed {
    router: UpProcess,
    /// Engine base URLs by endpoint id, as the router reports them.
    engines: Vec<String>,
    plugins: tempfile::TempDir,
}

/// Copy the built example into a fresh plugins directory and start `switchyard up --policy
/// NAME` over it. The compile cache is the one
/// `host/policy-host/tests/examples.rs` fills, so the Python and JavaScript components compile once.
async fn deploy(name: &str, up_args: &[&str]) -> Deployed {
    let plugins = tempfile::tempdir().expect("temporary plugins directory");
    std::fs::copy(
        built_example(name),
        plugins.path().join(format!("{name}.wasm")),
    )
    .expect("copy the example into the plugins directory");
    let cache = workspace_target().join("examples/compiled");
    let mut args = vec!["--policy", name];
    args.extend_from_slice(up_args);
    // Routers start one at a time: a cold compile of one example holds both CI cores, and
    // another router instantiating its policy meanwhile could overrun the 50 ms call deadline.
    // Blocking is fine here: nothing else runs on this test's runtime yet.
    let router = {
        let _turn = STARTING.lock().unwrap_or_else(PoisonError::into_inner);
        UpProcess::up_with_plugins(plugins.path(), &cache, &args)
    };
    let status = post_or_get(&router.endpoint("/admin/endpoints")).await;
    assert_eq!(status["policy"], name, "{status}");
    let engines = status["endpoints"]
        .as_array()
        .expect("an endpoint list")
        .iter()
        .map(|e| e["url"].as_str().expect("endpoint url").to_owned())
        .collect();
    Deployed {
        router,
        engines,
        plugins,
    }
}

impl Deployed {
    fn completions(&self) -> String {
        self.router.endpoint("/v1/completions")
    }

    /// `name` summed over every engine's `/metrics`.
    async fn engine_total(&self, name: &str) -> f64 {
        let mut total = 0.0;
        for url in &self.engines {
            total += metric(&format!("{url}/metrics"), name).await;
        }
        total
    }
}

/// Each request is posted twice by `assert_completion_matches`: once streamed, once not.
const POSTS_PER_REQUEST: f64 = 2.0;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn priority_rust_serves_priority_users_whole_and_disaggregates_the_rest() {
    let truth = EngineProcess::spawn(&[]);
    let d = deploy("priority-rust", &[]).await;
    let mut disaggregated = 0.0;
    for (i, (prompt, max_tokens)) in prompts(61, 8).into_iter().enumerate() {
        let priority = i % 2 == 0;
        let user = if priority { "priority-alice" } else { "bob" };
        let body = json!({"prompt": prompt, "max_tokens": max_tokens, "user": user});
        assert_completion_matches(&d.completions(), &truth, &body).await;
        if !priority {
            disaggregated += POSTS_PER_REQUEST;
        }
    }
    // Forwarded requests never reach `remote_send`; every disaggregated one does once (no
    // prefix cache, and every prompt is longer than one token).
    assert_eq!(d.engine_total(REMOTE_SENDS).await, disaggregated);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slo_js_disaggregates_long_prompts_and_forwards_short_ones() {
    const LONG_PROMPT_TOKENS: usize = 256; // the example's default threshold
    let truth = EngineProcess::spawn(&[]);
    let d = deploy("slo-js", &[]).await;
    let cases = prompts(62, 10);
    let long = cases
        .iter()
        .filter(|(prompt, _)| prompt.len() >= LONG_PROMPT_TOKENS)
        .count();
    assert!(
        0 < long && long < cases.len(),
        "the seed gives both short and long prompts ({long} of {} long)",
        cases.len()
    );
    for (prompt, max_tokens) in &cases {
        let body = json!({"prompt": prompt, "max_tokens": max_tokens});
        assert_completion_matches(&d.completions(), &truth, &body).await;
    }
    // The reference engine's tokenizer is byte-level: prompt tokens = prompt bytes.
    assert_eq!(
        d.engine_total(REMOTE_SENDS).await,
        long as f64 * POSTS_PER_REQUEST
    );
}

/// `count` different prompts of `16 * k + 1` bytes: the KV window `[0, len - 1)` that
/// `prep-recv` reserves is whole 16-token pages (the engines' and the policy's default page
/// size), so a prefix-cache hit covers all of it and the host skips `remote_send`.
pub(crate) fn page_aligned_prompts(seed: u64, count: usize) -> Vec<String> {
    prompts(seed, count)
        .into_iter()
        .enumerate()
        .map(|(i, (words, _))| {
            // A distinct head keeps the prompts apart in the policy's prefix memory.
            let text = format!("{i} {words} {}", "decode ".repeat(40));
            let pages = 6 + i;
            text[..16 * pages + 1].to_owned()
        })
        .collect()
}

/// Every prompt at once, so the decode endpoints' loads differ while they are planned.
async fn post_all(url: &str, prompts: &[&String], max_tokens: u32) -> Vec<Value> {
    let bodies: Vec<Value> = prompts
        .iter()
        .map(|p| json!({"prompt": p, "max_tokens": max_tokens}))
        .collect();
    join_all(bodies.iter().map(|body| post_json(url, body))).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_aware_python_skips_remote_send_for_repeated_prompts() {
    const MAX_TOKENS: u32 = 8;
    let truth = EngineProcess::spawn(&[]);
    let d = deploy("prefix-aware-python", &["--prefix-cache"]).await;
    let prompts = page_aligned_prompts(63, 4);
    let mut expected = Vec::new();
    for p in &prompts {
        expected.push(reference(&truth, p, MAX_TOKENS).await.0);
    }
    let texts = |answers: Vec<Value>| -> Vec<String> {
        answers
            .iter()
            .map(|r| r["choices"][0]["text"].as_str().expect("text").to_owned())
            .collect()
    };

    let first_round: Vec<&String> = prompts.iter().collect();
    let answers = post_all(&d.completions(), &first_round, MAX_TOKENS).await;
    assert_eq!(texts(answers), expected, "first sight");
    let sends = d.engine_total(REMOTE_SENDS).await;
    assert_eq!(
        sends,
        prompts.len() as f64,
        "every new prompt moves its KV once"
    );
    let matched = d.engine_total(PREFIX_MATCHED).await;

    // The same prompts again, all at once and in the other order: least-loaded alone would
    // scatter them; the policy sends each to the decode engine that already holds its KV.
    let second_round: Vec<&String> = prompts.iter().rev().collect();
    let answers = post_all(&d.completions(), &second_round, MAX_TOKENS).await;
    let mut reversed = expected.clone();
    reversed.reverse();
    assert_eq!(texts(answers), reversed, "repeats");
    assert_eq!(
        d.engine_total(REMOTE_SENDS).await,
        sends,
        "no repeated prompt moved KV"
    );
    let window: usize = prompts.iter().map(|p| p.len() - 1).sum();
    let matched_again = d.engine_total(PREFIX_MATCHED).await - matched;
    assert!(
        matched_again >= window as f64,
        "the decode engines took every repeat's whole KV window ({window} tokens) from their \
         prefix cache, got {matched_again}"
    );
}

/// How long a policy dropped into the plugins directory may take to serve: a cold compile of
/// the JavaScript runtime on two busy cores takes tens of seconds.
const DEPLOY_DEADLINE: Duration = Duration::from_secs(90);

/// The README's deploy: write a hidden temporary file, then rename it into place, so the
/// router's watcher never sees half a component.
fn install(plugins: &Path, name: &str) {
    let tmp = plugins.join(format!(".{name}.wasm.tmp"));
    std::fs::copy(built_example(name), &tmp).expect("write the temporary file");
    std::fs::rename(&tmp, plugins.join(format!("{name}.wasm"))).expect("rename into place");
}

/// Poll `/admin/policies` until `name` is active, within [`DEPLOY_DEADLINE`].
async fn wait_until_active(router: &UpProcess, name: &str) {
    let deadline = Instant::now() + DEPLOY_DEADLINE;
    loop {
        let policies = post_or_get(&router.endpoint("/admin/policies")).await;
        let entry = policies
            .as_array()
            .expect("a policy list")
            .iter()
            .find(|p| p["name"] == name)
            .cloned();
        if entry.as_ref().is_some_and(|p| p["state"] == "active") {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{name} not active within {DEPLOY_DEADLINE:?}: {entry:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_example_copied_into_a_running_router_serves_its_requests() {
    let truth = EngineProcess::spawn(&[]);
    let d = deploy("priority-rust", &[]).await;
    install(d.plugins.path(), "slo-js");
    wait_until_active(&d.router, "slo-js").await;
    let prompt = "a short prompt, forwarded whole by slo-js";
    let body = json!({"prompt": prompt, "max_tokens": 8});
    let (expected, _) = reference(&truth, prompt, 8).await;
    let sends = d.engine_total(REMOTE_SENDS).await;
    let by_header = client()
        .post(d.completions())
        .header("x-switchyard-policy", "slo-js")
        .json(&body)
        .send()
        .await
        .expect("router reachable");
    assert_eq!(by_header.status(), 200);
    let answer: Value = by_header.json().await.expect("JSON body");
    assert_eq!(answer["choices"][0]["text"], expected.as_str());
    assert_eq!(
        d.engine_total(REMOTE_SENDS).await,
        sends,
        "slo-js forwarded the short prompt"
    );
    // The default policy still plans requests that select no policy: priority-rust
    // disaggregates a non-priority user's prompt, whatever its length.
    assert_eq!(
        post_json(&d.completions(), &body).await["choices"][0]["text"],
        expected.as_str()
    );
    assert_eq!(d.engine_total(REMOTE_SENDS).await, sends + 1.0);
}
