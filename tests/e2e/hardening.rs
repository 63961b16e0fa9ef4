//! The router protecting itself and the cluster, as separate processes on loopback: it starts
//! and serves with an engine down, refuses what it should refuse before any engine sees it,
//! takes endpoints in and out while serving, and stays up through a fuzz run of malformed
//! requests.

use std::sync::Arc;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng as _, SeedableRng as _};
use serde_json::{Value, json};
use switchyard_tests::{EngineProcess, RouterProcess, free_port};

use crate::faults::{Load, Truth, assert_engines_idle, endpoint_row, let_run, stream_one};
use crate::http::client;
use crate::router::{eventually, metric, post_or_get, reference};

/// The router's view of endpoint `id` (`/admin/endpoints`).
async fn endpoint_health(router: &RouterProcess, id: usize) -> Value {
    post_or_get(&router.endpoint("/admin/endpoints")).await["endpoints"][id]["health"].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_started_with_an_engine_down_serves_from_the_first_request() {
    let truth = EngineProcess::spawn(&[]);
    let (a, b) = (EngineProcess::spawn(&[]), EngineProcess::spawn(&[]));
    // The third engine's address, where nothing listens yet.
    let late_port = free_port();
    let late_url = format!("http://127.0.0.1:{late_port}");
    // Engines without KV peers: the round-robin policy forwards whole requests.
    let router =
        RouterProcess::serve_ready(&[&a.url, &b.url, &late_url], &["--policy", "round-robin"]);
    // Ready with two of three: /health says which one is down.
    let health = post_or_get(&router.endpoint("/health")).await;
    assert_eq!(health["status"], "ready", "{health}");
    assert!(
        health["down"]
            .as_array()
            .is_some_and(|down| down.iter().any(|d| d["id"] == 2)),
        "{health}"
    );
    let url = router.endpoint("/v1/completions");
    for (i, prompt) in ["first", "second request", "a third one"]
        .iter()
        .enumerate()
    {
        let (expected, _) = reference(&truth, prompt, 12).await;
        let response = client()
            .post(&url)
            .header("x-request-id", format!("trace-{i}"))
            .json(&json!({"prompt": prompt, "max_tokens": 12}))
            .send()
            .await
            .expect("router reachable");
        assert_eq!(response.status(), 200);
        assert_eq!(
            response.headers()["x-request-id"],
            format!("trace-{i}").as_str()
        );
        let body: Value = response.json().await.expect("JSON");
        assert_eq!(body["choices"][0]["text"], expected.as_str());
    }
    // Every response carries an id, errors included, made up when the client sent none.
    let missing = client()
        .post(&url)
        .json(&json!({"max_tokens": 4}))
        .send()
        .await
        .expect("reachable");
    assert_eq!(missing.status(), 400);
    assert_eq!(missing.headers()["x-request-id"].len(), 32);

    // The late engine joins when it starts.
    let late = EngineProcess::spawn_on(late_port, &[]);
    assert_eq!(late.url, late_url);
    eventually(Duration::from_secs(30), || async {
        let health = endpoint_health(&router, 2).await;
        (health != "healthy").then(|| format!("endpoint 2 is {health}"))
    })
    .await;
    let health = post_or_get(&router.endpoint("/health")).await;
    assert_eq!(health["down"], json!([]), "{health}");
}

/// P (rank 0) with KV peers for decode engines of ranks 1 and 2, over tcp.
fn prefill_and_two_decodes() -> (EngineProcess, EngineProcess, EngineProcess) {
    let slow = ["--profile", "llama3-8b-h100", "--time-scale", "0.3"];
    let decode = |rank: &str| {
        let mut args = vec!["--device-rank", rank, "--kv-transport", "tcp"];
        args.extend(slow);
        EngineProcess::spawn(&args)
    };
    let (d1, d2) = (decode("1"), decode("2"));
    let (peer1, peer2) = (format!("1={}", d1.kv_addr), format!("2={}", d2.kv_addr));
    let mut args = vec![
        "--kv-transport",
        "tcp",
        "--kv-peer",
        &peer1,
        "--kv-peer",
        &peer2,
    ];
    args.extend(slow);
    (EngineProcess::spawn(&args), d1, d2)
}

async fn admin(method: reqwest::Method, url: String, body: Option<Value>) -> (u16, Value) {
    let mut request = client().request(method, url);
    if let Some(body) = body {
        request = request.json(&body);
    }
    let response = request.send().await.expect("router reachable");
    let status = response.status().as_u16();
    (status, response.json().await.expect("a JSON answer"))
}

async fn calls_received(engine: &EngineProcess) -> f64 {
    metric(
        &engine.endpoint("/metrics"),
        "switchyard_engine_calls_received",
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoints_added_drained_and_removed_under_load_fail_no_request() {
    let truth = Arc::new(Truth::new(31, 16).await);
    let (p, d1, d2) = prefill_and_two_decodes();
    let router = RouterProcess::serve(&[&p.url, &d1.url], &[]);
    let load = Load::start(&router.url, &truth, 4);
    let_run(&load, 8).await;

    // A third engine joins: it gets the next id and device rank, and soon its share of work.
    let base = router.endpoint("/admin/endpoints");
    let (status, row) = admin(
        reqwest::Method::POST,
        base.clone(),
        Some(json!({"url": d2.url, "role": "decode"})),
    )
    .await;
    assert_eq!(status, 201, "{row}");
    assert_eq!(
        (row["id"].as_u64(), row["device_rank"].as_u64()),
        (Some(2), Some(2))
    );
    assert_eq!(row["owner"], "admin");
    eventually(Duration::from_secs(30), || async {
        let calls = calls_received(&d2).await;
        (calls < 10.0).then(|| format!("the new engine served {calls} calls"))
    })
    .await;

    // D1 drains: nothing new reaches it once its last legs are done, and then it leaves.
    let (status, row) = admin(reqwest::Method::POST, format!("{base}/1/drain"), None).await;
    assert_eq!(status, 200, "{row}");
    assert_eq!(row["health"], "draining");
    eventually(Duration::from_secs(30), || async {
        let in_flight = endpoint_row(&router, 1).await["in_flight"].as_u64();
        (in_flight != Some(0)).then(|| format!("{in_flight:?} legs still in flight on it"))
    })
    .await;
    let drained_at = calls_received(&d1).await;
    let_run(&load, 16).await;
    assert_eq!(
        calls_received(&d1).await,
        drained_at,
        "a drained endpoint receives no new request"
    );
    let (status, row) = admin(reqwest::Method::DELETE, format!("{base}/1"), None).await;
    assert_eq!(status, 200, "{row}");
    assert_eq!(row["health"], "removed");
    let (status, _) = admin(reqwest::Method::DELETE, format!("{base}/1"), None).await;
    assert_eq!(status, 409, "removed twice");
    let_run(&load, 8).await;
    let tally = load.stop().await;
    tally.report("endpoints changed under load");
    assert_eq!(tally.error_events, 0, "nothing failed: no engine failed");
    assert_engines_idle(&[&p, &d1, &d2]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_the_config_files_endpoints_and_leaves_admin_ones() {
    let (p, d1, d2) = prefill_and_two_decodes();
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("router.toml");
    let write = |urls: &[&str]| {
        let endpoints: String = urls
            .iter()
            .map(|url| format!("[[endpoints]]\nurl = \"{url}\"\n"))
            .collect();
        std::fs::write(&file, endpoints).expect("write the config")
    };
    write(&[&p.url, &d1.url]);
    let config = file.display().to_string();
    // Round-robin: a re-added engine gets a new device rank that P has no KV peer for.
    let router = RouterProcess::serve(&[], &["--config", &config, "--policy", "round-robin"]);
    // d2 comes in through the admin API; a reload must leave it alone.
    let base = router.endpoint("/admin/endpoints");
    let (status, _) = admin(
        reqwest::Method::POST,
        base.clone(),
        Some(json!({"url": d2.url})),
    )
    .await;
    assert_eq!(status, 201);
    // A new endpoint serves once its first probe answers.
    eventually(Duration::from_secs(30), || async {
        let health = endpoint_row(&router, 2).await["health"].clone();
        (health != "healthy").then(|| format!("endpoint 2 is {health}"))
    })
    .await;

    // The file now lists P only: D1 drains and goes, d2 (admin's) stays.
    write(&[&p.url]);
    router.signal(rustix::process::Signal::HUP);
    eventually(Duration::from_secs(30), || async {
        let health = endpoint_row(&router, 1).await["health"].clone();
        (health != "removed").then(|| format!("endpoint 1 is {health}"))
    })
    .await;
    assert_eq!(endpoint_row(&router, 2).await["health"], "healthy");
    // And back: the file's endpoint returns under a new id.
    write(&[&p.url, &d1.url]);
    router.signal(rustix::process::Signal::HUP);
    eventually(Duration::from_secs(30), || async {
        let row = endpoint_row(&router, 3).await;
        (row["health"] != "healthy" || row["url"] != d1.url.as_str())
            .then(|| format!("endpoint 3 is {row}"))
    })
    .await;
    let (prompt, max_tokens) = ("back again", 8);
    let (expected, _) = reference(&p, prompt, max_tokens).await;
    let url = router.endpoint("/v1/completions");
    assert_eq!(
        stream_one(&url, prompt, max_tokens, &expected).await,
        Ok(true)
    );
}

// === fuzzing through the real HTTP server ===

/// One malformed request: a method, a path, body bytes, and the policy it names, if any.
struct Malformed {
    method: reqwest::Method,
    path: &'static str,
    body: Vec<u8>,
    policy: Option<&'static str>,
}

/// Context and body limits the fuzzed router runs with, small so that requests over them are
/// cheap to make.
const FUZZ_CONTEXT: usize = 512;
const FUZZ_BODY_LIMIT: usize = 64 << 10;

/// A request that must be refused with a 4xx: the `i`-th of a seeded mix of every kind of bad
/// input the router takes.
fn malformed(rng: &mut StdRng) -> Malformed {
    use reqwest::Method;
    let post = |path, body: Vec<u8>| Malformed {
        method: Method::POST,
        path,
        body,
        policy: None,
    };
    let completion = |fields: &str| post("/v1/completions", format!("{{{fields}}}").into_bytes());
    let chat = |fields: &str| post("/v1/chat/completions", format!("{{{fields}}}").into_bytes());
    match rng.random_range(0..14) {
        // Random bytes.
        0 => {
            let len = rng.random_range(0..512);
            let path = ["/v1/completions", "/v1/chat/completions"][rng.random_range(0..2)];
            post(path, (0..len).map(|_| rng.random()).collect())
        }
        // A valid body cut short.
        1 => {
            let body = br#"{"prompt": "a sound prompt", "max_tokens": 8, "stream": true}"#;
            post(
                "/v1/completions",
                body[..rng.random_range(0..body.len() - 1)].to_vec(),
            )
        }
        // Nested deeper than any parser should follow.
        2 => {
            let depth = rng.random_range(200..5_000);
            let body = format!(
                r#"{{"prompt": {}1{}}}"#,
                "[".repeat(depth),
                "]".repeat(depth)
            );
            post("/v1/completions", body.into_bytes())
        }
        // Wrong types.
        3 => {
            let wrong = [
                r#""prompt": 5"#,
                r#""prompt": true"#,
                r#""prompt": {"a": 1}"#,
                r#""prompt": [true]"#,
                r#""prompt": "a", "max_tokens": "5""#,
                r#""prompt": "a", "max_tokens": 1.5"#,
                r#""prompt": "a", "stream": "yes""#,
                r#""prompt": "a", "temperature": "hot""#,
                r#""prompt": "a", "stop": 5"#,
                r#""prompt": "a", "n": 2"#,
                r#""prompt": "a", "stream_options": 3"#,
                r#""prompt": "a", "logit_bias": []"#,
                r#""prompt": "a", "model": 7"#,
                r#""prompt": "a", "echo": true"#,
            ];
            completion(wrong[rng.random_range(0..wrong.len())])
        }
        // Huge numbers.
        4 => {
            let huge = [
                r#""prompt": [4294967296]"#,
                r#""prompt": [-1]"#,
                r#""prompt": [1e20]"#,
                r#""prompt": "a", "max_tokens": 1e309"#,
                r#""prompt": "a", "max_tokens": 99999999999999999999999"#,
                r#""prompt": "a", "seed": 1e400"#,
            ];
            completion(huge[rng.random_range(0..huge.len())])
        }
        // Invalid UTF-8 inside a string.
        5 => {
            let mut body = br#"{"prompt": "abc"#.to_vec();
            body.extend([0xff, 0xfe, rng.random_range(0x80..=0xbf)]);
            body.extend(br#"", "max_tokens": 4}"#);
            post("/v1/completions", body)
        }
        // Token ids outside the vocabulary.
        6 => completion(&format!(
            r#""prompt": [1, 2, {}], "max_tokens": 4"#,
            rng.random_range(300..u32::MAX)
        )),
        // max_tokens that no context holds, or none at all.
        7 => {
            let max_tokens = ["0", "-1", "-100", "1099511627776", "4294967295"];
            completion(&format!(
                r#""prompt": "abc", "max_tokens": {}"#,
                max_tokens[rng.random_range(0..max_tokens.len())]
            ))
        }
        // A prompt over the context, as text or token ids.
        8 => {
            let n = FUZZ_CONTEXT + rng.random_range(0..100);
            if rng.random_bool(0.5) {
                completion(&format!(r#""prompt": "{}""#, "x".repeat(n)))
            } else {
                let ids = vec!["97"; n].join(",");
                completion(&format!(r#""prompt": [{ids}]"#))
            }
        }
        // Bodies over the limit.
        9 => post(
            "/v1/completions",
            vec![b' '; FUZZ_BODY_LIMIT + rng.random_range(1..1024)],
        ),
        // Bad chats.
        10 => {
            let bad = [
                r#""messages": "hello""#,
                r#""messages": []"#,
                r#""messages": [{"role": 5, "content": "x"}]"#,
                r#""messages": [{"content": "x"}]"#,
                r#""messages": [{"role": "user", "content": 5}]"#,
                r#""messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0"#,
            ];
            chat(bad[rng.random_range(0..bad.len())])
        }
        // A model nobody serves.
        11 => completion(&format!(
            r#""prompt": "abc", "model": "no-such-model-{}""#,
            rng.random::<u32>()
        )),
        // Routes and methods that do not exist.
        12 => {
            let methods = [Method::GET, Method::PUT, Method::DELETE, Method::PATCH];
            let paths = [
                "/v1/completions",
                "/v1/chat/completions",
                "/nope",
                "/v2/models",
                "/",
            ];
            Malformed {
                method: methods[rng.random_range(0..methods.len())].clone(),
                path: paths[rng.random_range(0..paths.len())],
                body: Vec::new(),
                policy: None,
            }
        }
        // A sound request naming a policy that is not loaded.
        _ => Malformed {
            policy: Some("no-such-policy"),
            ..completion(r#""prompt": "abc", "max_tokens": 2"#)
        },
    }
}

/// Bytes that are no HTTP at all, on a raw connection: the router answers 400 or hangs up.
async fn send_raw(addr: &str, bytes: &[u8]) -> Result<(), String> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut stream = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| e.to_string())?;
    let _ = stream.write_all(bytes).await;
    let _ = stream.shutdown().await;
    let mut answer = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut answer));
    match read.await {
        Err(_) => Err("no answer and no hang-up within 10 s".into()),
        Ok(_) if answer.is_empty() => Ok(()),
        Ok(_) if answer.starts_with(b"HTTP/1.1 4") => Ok(()),
        Ok(_) => Err(format!(
            "answered {:?}",
            String::from_utf8_lossy(&answer[..answer.len().min(64)])
        )),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_malformed_requests_get_4xx_openai_errors_and_the_router_stays_up() {
    let engine = EngineProcess::spawn(&[]);
    let log = tempfile::NamedTempFile::new().expect("a log file");
    let context = FUZZ_CONTEXT.to_string();
    let body_limit = FUZZ_BODY_LIMIT.to_string();
    let router = RouterProcess::serve_logging_to(
        &[&engine.url],
        &[
            "--policy",
            "round-robin",
            "--context-length",
            &context,
            "--max-body-bytes",
            &body_limit,
        ],
        log.path(),
    );
    const REQUESTS: usize = 10_000;
    const CLIENTS: u64 = 4;
    let base = router.url.clone();
    let addr = router.url.trim_start_matches("http://").to_owned();
    let outcomes = futures::future::join_all((0..CLIENTS).map(|seed| {
        let (base, addr) = (base.clone(), addr.clone());
        async move {
            let http = client();
            let mut rng = StdRng::seed_from_u64(seed);
            let mut statuses = std::collections::BTreeMap::<u16, usize>::new();
            let mut wrong = Vec::new();
            for i in 0..REQUESTS / CLIENTS as usize {
                if i % 50 == 0 {
                    let garbage: Vec<u8> = (0..rng.random_range(1..256))
                        .map(|_| rng.random())
                        .collect();
                    if let Err(e) = send_raw(&addr, &garbage).await {
                        wrong.push(format!("raw bytes: {e}"));
                    }
                    continue;
                }
                let m = malformed(&mut rng);
                let mut request = http
                    .request(m.method.clone(), format!("{base}{}", m.path))
                    .header("content-type", "application/json")
                    .body(m.body);
                if let Some(policy) = m.policy {
                    request = request.header("x-switchyard-policy", policy);
                }
                let response = match request.send().await {
                    Ok(r) => r,
                    Err(e) => {
                        wrong.push(format!("{} {}: no answer: {e}", m.method, m.path));
                        continue;
                    }
                };
                let status = response.status().as_u16();
                *statuses.entry(status).or_default() += 1;
                let text = response.text().await.unwrap_or_default();
                let body: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
                if !(400..500).contains(&status) || !body["error"]["message"].is_string() {
                    wrong.push(format!("{} {}: {status} {text}", m.method, m.path));
                }
            }
            (statuses, wrong)
        }
    }))
    .await;
    let mut statuses = std::collections::BTreeMap::<u16, usize>::new();
    let mut wrong = Vec::new();
    for (s, w) in outcomes {
        for (status, n) in s {
            *statuses.entry(status).or_default() += n;
        }
        wrong.extend(w);
    }
    eprintln!("{REQUESTS} malformed requests: answers by status {statuses:?}");
    assert!(
        wrong.is_empty(),
        "{} went wrong, first: {:?}",
        wrong.len(),
        &wrong[..wrong.len().min(5)]
    );
    assert!(
        [400, 404, 413].iter().all(|s| statuses.contains_key(s)),
        "the mix reaches every kind of refusal: {statuses:?}"
    );
    // Still serving, and nothing panicked.
    let (expected, _) = reference(&engine, "still here", 8).await;
    let url = router.endpoint("/v1/completions");
    assert_eq!(stream_one(&url, "still here", 8, &expected).await, Ok(true));
    let logged = std::fs::read_to_string(log.path()).expect("the router's log");
    assert!(
        !logged.contains("panicked"),
        "the router panicked:\n{logged}"
    );
}
