//! Kubernetes discovery (`serve --discovery k8s`, feature `k8s`; an InferencePool's pods for
//! `serve`, `epp` and `sidecar`) against a fake API server
//! (`fake_api`) over HTTP: the router's real `kube` watcher and reconciler follow engine pods
//! that are reference engines on loopback (pod IP 127.0.0.1, the engine's port as the
//! container port named `http`), under steady streaming load.
//!
//! Every selector the router sends must hold both labels of a two-label selector, or the fake
//! refuses it: a selector sent in part fails the test.

mod fake_api;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};
use switchyard_tests::{EngineProcess, EppProcess, RouterProcess};

use crate::faults::{Load, Truth, let_run};
use crate::http::client;
use crate::router::{eventually, metric, post_or_get};
use fake_api::FakeApi;

const NAMESPACE: &str = "serving";
const SELECTOR: &str = "app=engine,tier=serve";
/// How long a change may take to reach the router's endpoint list.
const CONVERGE: Duration = Duration::from_secs(30);

/// A pod named `name` (uid `uid`) running `engine`, matching [`SELECTOR`].
fn pod(name: &str, uid: &str, engine: &EngineProcess, ready: bool) -> Value {
    pod_on(name, uid, engine.http_addr.port(), ready)
}

/// A pod named `name` (uid `uid`) serving on loopback port `port`, matching [`SELECTOR`].
fn pod_on(name: &str, uid: &str, port: u16, ready: bool) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name, "namespace": NAMESPACE, "uid": uid,
            "labels": {"app": "engine", "tier": "serve"},
            "annotations": {"switchyard.io/protocol": "mlc"},
        },
        "spec": {"containers": [{
            "name": "engine",
            "image": "switchyard",
            "ports": [{"name": "http", "containerPort": port}],
        }]},
        "status": {
            "podIP": "127.0.0.1",
            "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}],
        },
    })
}

/// A kubeconfig for `fake` in a temporary directory (kept alive by the first value).
fn kubeconfig(fake: &FakeApi) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("kubeconfig");
    std::fs::write(&path, fake.kubeconfig()).expect("write the kubeconfig");
    (dir, path)
}

/// `switchyard serve --discovery k8s` with `args`, talking to the fake through `config`.
fn router(endpoints: &[&str], config: &std::path::Path, args: &[&str]) -> RouterProcess {
    let mut all = vec![
        "--discovery",
        "k8s",
        "--k8s-selector",
        SELECTOR,
        "--policy",
        "round-robin",
    ];
    all.extend(args);
    RouterProcess::serve_listening(endpoints, &all, &[("KUBECONFIG", config)])
}

async fn rows(router: &RouterProcess) -> Vec<Value> {
    post_or_get(&router.endpoint("/admin/endpoints")).await["endpoints"]
        .as_array()
        .expect("a list of endpoints")
        .clone()
}

/// The rows not removed.
async fn listed(router: &RouterProcess) -> Vec<Value> {
    let mut rows = rows(router).await;
    rows.retain(|row| row["health"] != "removed");
    rows
}

/// The listed, healthy endpoint owned by `owner` that satisfies `check`, if any.
async fn serving_row(
    router: &RouterProcess,
    owner: &str,
    check: &impl Fn(&Value) -> bool,
) -> Result<Value, String> {
    let rows = listed(router).await;
    rows.iter()
        .find(|r| r["owner"] == owner && r["healthy"] == true && check(r))
        .cloned()
        .ok_or_else(|| format!("no such healthy endpoint of {owner} in {rows:?}"))
}

/// Waits until a listed, healthy endpoint is owned by `owner` and satisfies `check`; its row.
async fn wait_serving(
    router: &RouterProcess,
    owner: &str,
    check: impl Fn(&Value) -> bool,
) -> Value {
    eventually(CONVERGE, || async {
        serving_row(router, owner, &check).await.err()
    })
    .await;
    serving_row(router, owner, &check)
        .await
        .expect("it stays serving")
}

/// Waits until no listed endpoint is owned by `owner`.
async fn wait_gone(router: &RouterProcess, owner: &str) {
    eventually(CONVERGE, || async {
        let rows = listed(router).await;
        rows.iter()
            .any(|r| r["owner"] == owner)
            .then(|| format!("{owner} is still listed: {rows:?}"))
    })
    .await;
}

async fn health(router: &RouterProcess) -> (u16, Value) {
    let response = client()
        .get(router.endpoint("/health"))
        .send()
        .await
        .expect("router reachable");
    let status = response.status().as_u16();
    (status, response.json().await.expect("JSON"))
}

async fn wait_ready(router: &RouterProcess) {
    eventually(CONVERGE, || async {
        let (status, body) = health(router).await;
        (status != 200).then(|| format!("/health {status}: {body}"))
    })
    .await;
}

/// The fake saw only whole selectors and refused none.
fn assert_selectors_whole(fake: &FakeApi) {
    let (seen, refused) = fake.selectors();
    assert_eq!(refused, 0, "selectors refused: {seen:?}");
    assert!(!seen.is_empty());
    assert!(seen.iter().all(|s| s == SELECTOR), "{seen:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_that_come_change_and_go_are_followed_under_load_and_no_request_fails() {
    let truth = Arc::new(Truth::new(41, 16).await);
    let (a, b, c) = (
        EngineProcess::spawn(&[]),
        EngineProcess::spawn(&[]),
        EngineProcess::spawn(&[]),
    );
    let by_hand = EngineProcess::spawn(&[]);
    let outsider = EngineProcess::spawn(&[]);
    let fake = FakeApi::start(NAMESPACE, SELECTOR);
    fake.apply(pod("engine-a", "uid-a", &a, true));
    fake.apply(pod("engine-b", "uid-b", &b, false));
    // Half the selector: a router that sent only `app=engine` would route to it.
    let mut half = pod("outsider", "uid-outsider", &outsider, true);
    half["metadata"]["labels"] = json!({"app": "engine"});
    fake.apply(half);
    let (_dir, config) = kubeconfig(&fake);
    // A long resync: every change below reaches the router through the watch alone.
    let router = router(&[], &config, &["--k8s-resync", "10m"]);
    wait_ready(&router).await;
    let first = listed(&router).await;
    assert_eq!(first.len(), 1, "only the ready pod: {first:?}");
    assert_eq!(first[0]["owner"], "k8s:uid-a");
    assert_eq!(first[0]["url"], a.url.as_str());

    // An endpoint added by hand, which no reconciliation may touch.
    let response = client()
        .post(router.endpoint("/admin/endpoints"))
        .json(&json!({"url": by_hand.url}))
        .send()
        .await
        .expect("router reachable");
    assert_eq!(response.status(), 201);
    wait_serving(&router, "admin", |_| true).await;

    let load = Load::start(&router.url, &truth, 4);
    let_run(&load, 8).await;

    // Ready late: it joins when its Ready condition turns true.
    fake.edit("engine-b", |p| {
        p["status"]["conditions"][0]["status"] = json!("True");
    });
    let b_row = wait_serving(&router, "k8s:uid-b", |r| r["url"] == b.url.as_str()).await;
    let_run(&load, 8).await;

    // An annotation changes what the endpoint is: the old one drains, a new one replaces it.
    fake.edit("engine-b", |p| {
        p["metadata"]["annotations"]["switchyard.io/device-rank"] = json!("7");
    });
    let moved = wait_serving(&router, "k8s:uid-b", |r| r["device_rank"] == 7).await;
    assert_ne!(moved["id"], b_row["id"], "a new endpoint");
    let_run(&load, 8).await;

    // Deleted normally: terminating first (drained at once), then gone.
    fake.terminate("engine-a");
    wait_gone(&router, "k8s:uid-a").await;
    fake.delete("engine-a");
    let_run(&load, 8).await;

    // Replaced at the same address by a pod with a new uid: a new endpoint.
    fake.apply(pod("engine-a", "uid-a2", &a, true));
    let replaced = wait_serving(&router, "k8s:uid-a2", |r| r["url"] == a.url.as_str()).await;
    assert_ne!(replaced["id"], first[0]["id"]);
    let_run(&load, 8).await;

    // Force-deleted: the DELETED event is the only sign, no deletion timestamp before it.
    fake.delete("engine-a");
    wait_gone(&router, "k8s:uid-a2").await;

    // Relabelled out of the selector: the watch says DELETED, the pod itself lives on.
    fake.edit("engine-b", |p| {
        p["metadata"]["labels"] = json!({"app": "engine"});
    });
    wait_gone(&router, "k8s:uid-b").await;
    let_run(&load, 8).await;

    // 410 Gone ends the watch: the watcher lists again and finds what changed meanwhile.
    let lists = fake.lists();
    fake.expire();
    fake.apply(pod("engine-c", "uid-c", &c, true));
    wait_serving(&router, "k8s:uid-c", |r| r["url"] == c.url.as_str()).await;
    assert!(fake.lists() > lists, "a 410 makes the watcher list again");
    let_run(&load, 8).await;

    // A protocol the router does not know: the pod is skipped, its endpoint retired.
    fake.edit("engine-c", |p| {
        p["metadata"]["annotations"]["switchyard.io/protocol"] = json!("grpc");
    });
    wait_gone(&router, "k8s:uid-c").await;
    let_run(&load, 8).await;

    let tally = load.stop().await;
    tally.report("pods changing under load");
    assert_eq!(tally.error_events, 0, "no request failed");
    let left = listed(&router).await;
    assert_eq!(left.len(), 1, "only the endpoint added by hand: {left:?}");
    assert_eq!(left[0]["owner"], "admin");
    assert_eq!(left[0]["healthy"], true);
    assert!(
        rows(&router)
            .await
            .iter()
            .all(|r| r["url"] != outsider.url.as_str()),
        "a pod matching half the selector is never an endpoint"
    );
    assert_selectors_whole(&fake);
}

/// An `inference.networking.k8s.io/v1` InferencePool selecting [`SELECTOR`]'s pods on `port`.
fn inference_pool(name: &str, port: u16) -> Value {
    json!({
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": name, "namespace": NAMESPACE, "uid": format!("uid-{name}")},
        "spec": {
            "selector": {"matchLabels": {"app": "engine", "tier": "serve"}},
            "targetPorts": [{"number": port}],
            "endpointPickerRef": {"name": "epp", "port": {"number": 9002}},
        },
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_inference_pool_names_the_engines_of_serve_and_epp_and_the_prefill_engines_a_sidecar_may_call()
 {
    let prefill = EngineProcess::spawn(&["--protocol", "vllm"]);
    let decode = EngineProcess::spawn(&["--protocol", "vllm"]);
    let stranger = EngineProcess::spawn(&["--protocol", "vllm"]);
    let fake = FakeApi::start(NAMESPACE, SELECTOR);
    // The pod's own `http` port is wrong: the pool's target port is the one that serves.
    let mut pod = pod_on("prefill-0", "uid-p", stranger.http_addr.port(), true);
    pod["metadata"]["annotations"]["switchyard.io/protocol"] = json!("vllm");
    fake.apply(pod);
    fake.apply_pool(inference_pool("pool", prefill.http_addr.port()));
    let (_dir, config) = kubeconfig(&fake);
    let pool = ["--discovery", "k8s", "--k8s-inference-pool", "pool"];

    let mut args = pool.to_vec();
    args.extend(["--policy", "round-robin"]);
    let serve = RouterProcess::serve_listening(&[], &args, &[("KUBECONFIG", &config)]);
    wait_ready(&serve).await;
    let rows = listed(&serve).await;
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(rows[0]["url"], prefill.url.as_str());
    assert_eq!(rows[0]["owner"], "k8s:uid-p");
    let body = json!({"prompt": "From the pool", "max_tokens": 4});
    let (status, text) = crate::http::post(&serve.endpoint("/v1/completions"), &body).await;
    assert_eq!(status, 200, "{text}");
    assert_selectors_whole(&fake);

    // The EPP picks among the pool's pods, on the pool's port.
    let mut args = pool.to_vec();
    args.extend(["--policy", "round-robin"]);
    let epp = EppProcess::start_with_env(&[], &args, &[("KUBECONFIG", &config)]);
    let metrics = client()
        .get(format!("{}/metrics", epp.metrics_url))
        .send()
        .await
        .expect("the EPP answers")
        .text()
        .await
        .expect("text");
    let url = format!("url=\"{}\"", prefill.url);
    assert!(metrics.contains(&url), "the EPP lists {url}:\n{metrics}");
    assert!(
        !metrics.contains(&format!("{}\"", stranger.http_addr.port())),
        "{metrics}"
    );
    drop(epp);

    // The sidecar's allowlist is the pool's pods: the prefill engine, not the stranger.
    let mut args = vec!["--decode", &decode.url, "--protocol", "vllm"];
    args.extend(pool);
    let sidecar = RouterProcess::sidecar(&args, &[("KUBECONFIG", &config)]);
    let calls = |engine: &EngineProcess| {
        let url = engine.endpoint("/metrics");
        async move { metric(&url, "switchyard_engine_calls_received").await }
    };
    let (p_before, s_before) = (calls(&prefill).await, calls(&stranger).await);
    let ask = |prefiller: String| {
        let url = sidecar.endpoint("/v1/completions");
        let body = body.clone();
        async move {
            client()
                .post(url)
                .header("x-prefiller-host-port", prefiller)
                .json(&body)
                .send()
                .await
                .expect("the sidecar answers")
                .status()
                .as_u16()
        }
    };
    assert_eq!(ask(prefill.http_addr.to_string()).await, 200);
    assert!(
        calls(&prefill).await > p_before,
        "the handoff prefilled on the pool's pod"
    );
    assert_eq!(ask(stranger.http_addr.to_string()).await, 400);
    assert_eq!(
        calls(&stranger).await,
        s_before,
        "the stranger was never called"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_waits_for_the_first_list_and_a_silent_watch_converges_on_resync() {
    let (a, b, fixed) = (
        EngineProcess::spawn(&[]),
        EngineProcess::spawn(&[]),
        EngineProcess::spawn(&[]),
    );
    let fake = FakeApi::start(NAMESPACE, SELECTOR);
    fake.set_failing_lists(true);
    fake.apply(pod("engine-a", "uid-a", &a, true));
    let (_dir, config) = kubeconfig(&fake);
    let router = router(
        &[&fixed.url],
        &config,
        &["--k8s-namespace", NAMESPACE, "--k8s-resync", "500ms"],
    );
    // The static endpoint is healthy, yet the router is not ready before discovery has listed.
    wait_serving(&router, "static", |_| true).await;
    let (status, body) = health(&router).await;
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["discovery_synced"], false, "{body}");
    fake.set_failing_lists(false);
    wait_ready(&router).await;
    wait_serving(&router, "k8s:uid-a", |_| true).await;

    // The watch goes silent: changes reach the router only through the periodic re-list.
    fake.set_silent(true);
    let lists = fake.lists();
    fake.delete("engine-a");
    fake.apply(pod("engine-b", "uid-b", &b, true));
    wait_gone(&router, "k8s:uid-a").await;
    wait_serving(&router, "k8s:uid-b", |r| r["url"] == b.url.as_str()).await;
    assert!(fake.lists() > lists, "converged by listing again");
    wait_serving(&router, "static", |_| true).await;
    assert_selectors_whole(&fake);
}

// === the fake's wire format, as real clients read it ===

/// Lines a child process prints, read on a thread of their own so a test can wait for one
/// with a bound.
struct Lines {
    child: std::process::Child,
    lines: std::sync::mpsc::Receiver<String>,
}

impl Lines {
    fn spawn(command: &mut std::process::Command) -> Lines {
        let mut child = command
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("start {command:?}: {e}"));
        let stdout = child.stdout.take().expect("piped stdout");
        let (send, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufRead::lines(std::io::BufReader::new(stdout)) {
                let Ok(line) = line else { return };
                if send.send(line).is_err() {
                    return;
                }
            }
        });
        Lines { child, lines }
    }

    /// The next line, waiting at most [`CONVERGE`].
    fn next(&self, what: &str) -> String {
        self.lines
            .recv_timeout(CONVERGE)
            .unwrap_or_else(|e| panic!("no line from {what} within {CONVERGE:?}: {e}"))
    }
}

impl Drop for Lines {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Lists the pods, prints `{"names": [...]}`, then watches from the list's version and prints
/// `{"type": ..., "name": ..., "port": ...}` per event: the official client's own models
/// parse every object, so a field of the wrong shape fails here.
const PYTHON_CLIENT: &str = r#"
import json, sys
from kubernetes import client, config, watch
kubeconfig, namespace, selector = sys.argv[1:4]
config.load_kube_config(config_file=kubeconfig)
api = client.CoreV1Api()
pods = api.list_namespaced_pod(namespace, label_selector=selector)
print(json.dumps({"names": [p.metadata.name for p in pods.items]}), flush=True)
for event in watch.Watch().stream(api.list_namespaced_pod, namespace,
                                  label_selector=selector,
                                  resource_version=pods.metadata.resource_version,
                                  timeout_seconds=60):
    pod = event["object"]
    print(json.dumps({"type": event["type"], "name": pod.metadata.name,
                      "port": pod.spec.containers[0].ports[0].container_port}), flush=True)
"#;

#[test]
fn kubectl_and_the_python_client_list_and_watch_the_fake() {
    let fake = FakeApi::start(NAMESPACE, SELECTOR);
    fake.apply(pod_on("a", "uid-a", 8001, true));
    let (dir, config) = kubeconfig(&fake);
    let kubectl = || {
        let mut command = std::process::Command::new(switchyard_tests::kubectl());
        command
            .env("KUBECONFIG", &config)
            .arg("--cache-dir")
            .arg(dir.path().join("kube-cache"))
            .args(["get", "pods", "-l", SELECTOR]);
        command
    };

    // kubectl: discovery, a list, and a watch that sees a pod arrive.
    let listed = kubectl()
        .args(["-o", "json"])
        .output()
        .expect("run kubectl");
    assert!(
        listed.status.success(),
        "kubectl get pods: {}",
        String::from_utf8_lossy(&listed.stderr)
    );
    let list: Value = serde_json::from_slice(&listed.stdout).expect("kubectl prints JSON");
    assert_eq!(list["items"][0]["metadata"]["name"], "a", "{list}");
    let watching = Lines::spawn(kubectl().args(["--watch", "-o", "name"]));
    assert_eq!(watching.next("kubectl --watch"), "pod/a");
    fake.apply(pod_on("b", "uid-b", 8002, false));
    assert_eq!(watching.next("kubectl --watch"), "pod/b");
    drop(watching);

    // The Python client: a list, then a watch from its version that sees an add, a change
    // and a delete, each parsed into the client's models.
    let python = Lines::spawn(
        std::process::Command::new(switchyard_tests::venv_tool("python"))
            .args(["-c", PYTHON_CLIENT])
            .arg(&config)
            .args([NAMESPACE, SELECTOR]),
    );
    let first: Value = serde_json::from_str(&python.next("the Python client")).expect("JSON");
    assert_eq!(first["names"], json!(["a", "b"]));
    fake.apply(pod_on("c", "uid-c", 8003, true));
    fake.edit("b", |pod| {
        pod["spec"]["containers"][0]["ports"][0]["containerPort"] = json!(8012)
    });
    fake.delete("a");
    let events: Vec<Value> = (0..3)
        .map(|_| serde_json::from_str(&python.next("the Python watch")).expect("JSON"))
        .collect();
    assert_eq!(
        events,
        [
            json!({"type": "ADDED", "name": "c", "port": 8003}),
            json!({"type": "MODIFIED", "name": "b", "port": 8012}),
            json!({"type": "DELETED", "name": "a", "port": 8001}),
        ]
    );
    let (selectors, refused) = fake.selectors();
    assert_eq!(
        refused, 0,
        "every client sent the whole selector: {selectors:?}"
    );
}
