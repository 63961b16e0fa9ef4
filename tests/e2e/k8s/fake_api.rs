//! A fake Kubernetes API server: pods (and `InferencePool`s, read whole), in one namespace, over
//! plain HTTP on loopback.
//!
//! What a real API server does and the router's watcher depends on: `GET …/pods` lists with a
//! `resourceVersion`, `?watch=true&resourceVersion=N` streams newline-delimited watch events
//! after N, `labelSelector` filters both (a pod relabelled out of the selector is `DELETED`
//! for that watch, one relabelled in is `ADDED`), and a watch from a compacted version gets a
//! `410 Gone` ERROR event. What tests add: selectors that lack a required term are refused
//! with 400 (so a selector sent in part fails loudly), lists can be made to fail, and the
//! server can go silent: watches stay open and deliver nothing. Enough discovery (`/api`,
//! `/apis`, `/api/v1`) is served for kubectl to find pods; `tests/e2e/k8s.rs` checks the wire
//! format with kubectl and the official Python client.
//!
//! It runs on a thread of its own with its own runtime, so tests that block (starting a
//! process, waiting for it) never starve it; dropping it stops it and closes every watch.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::Arc;

use bytes::Bytes;
use futures::channel::mpsc;
use http_body_util::{BodyExt as _, Full, StreamBody, combinators::UnsyncBoxBody};
use hyper::body::{Frame, Incoming};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use parking_lot::Mutex;
use serde_json::{Value, json};

/// A running fake; its address goes in a kubeconfig ([`FakeApi::kubeconfig`]).
pub(crate) struct FakeApi {
    state: Arc<Mutex<State>>,
    pub(crate) url: String,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// One change to a pod: what it was and what it is (`None`: absent).
struct Change {
    version: u64,
    old: Option<Value>,
    new: Option<Value>,
}

/// A watch in progress: its selector and where its events go.
struct Watch {
    selector: Vec<(String, String)>,
    events: mpsc::UnboundedSender<Result<Frame<Bytes>, Infallible>>,
}

struct State {
    namespace: String,
    /// Every selector must contain these `key=value` terms.
    required: Vec<(String, String)>,
    version: u64,
    pods: BTreeMap<String, Value>,
    /// `inference.networking.k8s.io/v1` InferencePools by name: `GET` one, nothing else.
    pools: BTreeMap<String, Value>,
    history: Vec<Change>,
    /// Watches from before this version get 410 Gone.
    oldest: u64,
    watches: Vec<Watch>,
    silent: bool,
    failing_lists: bool,
    /// `labelSelector` of every list and watch, in order.
    selectors_seen: Vec<String>,
    refused: u32,
    lists: u32,
}

type Body = UnsyncBoxBody<Bytes, Infallible>;

impl FakeApi {
    /// Serve pods of `namespace`, refusing any selector without every term of `required`
    /// (`a=b,c=d`).
    pub(crate) fn start(namespace: &str, required: &str) -> FakeApi {
        let state = Arc::new(Mutex::new(State {
            namespace: namespace.to_owned(),
            required: parse_selector(required).expect("a valid required selector"),
            version: 1,
            pods: BTreeMap::new(),
            pools: BTreeMap::new(),
            history: Vec::new(),
            oldest: 1,
            watches: Vec::new(),
            silent: false,
            failing_lists: false,
            selectors_seen: Vec::new(),
            refused: 0,
            lists: 0,
        }));
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a loopback port");
        listener.set_nonblocking(true).expect("nonblocking");
        let url = format!("http://{}", listener.local_addr().expect("bound"));
        let (stop, stopped) = tokio::sync::oneshot::channel();
        let serving = Arc::clone(&state);
        let thread = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a runtime");
            runtime.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener).expect("tokio");
                tokio::select! {
                    () = accept(listener, serving) => {}
                    _ = stopped => {}
                }
            });
        });
        FakeApi {
            state,
            url,
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    /// A kubeconfig pointing at this server, its namespace the default.
    pub(crate) fn kubeconfig(&self) -> String {
        let namespace = self.state.lock().namespace.clone();
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: {url}\n\
             contexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\n    namespace: {namespace}\n\
             current-context: fake\nusers:\n- name: fake\n  user: {{}}\n",
            url = self.url
        )
    }

    /// Create or replace the pod named in `pod`'s metadata.
    pub(crate) fn apply(&self, mut pod: Value) {
        let name = pod["metadata"]["name"]
            .as_str()
            .expect("a pod name")
            .to_owned();
        let mut state = self.state.lock();
        let version = state.next_version();
        pod["metadata"]["resourceVersion"] = json!(version.to_string());
        let old = state.pods.insert(name, pod.clone());
        state.record(version, old, Some(pod));
    }

    /// Create or replace the InferencePool named in `pool`'s metadata.
    pub(crate) fn apply_pool(&self, mut pool: Value) {
        let name = pool["metadata"]["name"]
            .as_str()
            .expect("a pool name")
            .to_owned();
        let mut state = self.state.lock();
        let version = state.next_version();
        pool["metadata"]["resourceVersion"] = json!(version.to_string());
        state.pools.insert(name, pool);
    }

    /// Change the stored pod `name` with `edit`.
    pub(crate) fn edit(&self, name: &str, edit: impl FnOnce(&mut Value)) {
        let mut pod = self.state.lock().pods[name].clone();
        edit(&mut pod);
        self.apply(pod);
    }

    /// A graceful delete begins: the pod gets a deletion timestamp and stays listed.
    pub(crate) fn terminate(&self, name: &str) {
        self.edit(name, |pod| {
            pod["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
        });
    }

    /// The pod is gone (after a graceful delete, or force-deleted: then the DELETED event is
    /// the first and only sign, with no deletion timestamp).
    pub(crate) fn delete(&self, name: &str) {
        let mut state = self.state.lock();
        let version = state.next_version();
        let mut last = state.pods.remove(name).expect("the pod exists");
        // The DELETED event carries the last state, at the new version.
        last["metadata"]["resourceVersion"] = json!(version.to_string());
        state.record(version, Some(last), None);
    }

    /// Forget the history: every open watch gets `410 Gone` and ends, and a watch from an
    /// older version is refused the same way, so the client must list again.
    pub(crate) fn expire(&self) {
        let mut state = self.state.lock();
        state.history.clear();
        state.oldest = state.version + 1;
        let gone = event_line("ERROR", &gone_status());
        for watch in state.watches.drain(..) {
            let _ = watch.events.unbounded_send(Ok(Frame::data(gone.clone())));
        }
    }

    /// Silent: watches stay open and deliver no event (lists still answer).
    pub(crate) fn set_silent(&self, silent: bool) {
        self.state.lock().silent = silent;
    }

    /// Lists answer 500 while `failing`.
    pub(crate) fn set_failing_lists(&self, failing: bool) {
        self.state.lock().failing_lists = failing;
    }

    /// Every `labelSelector` received so far, and how many requests were refused for one.
    pub(crate) fn selectors(&self) -> (Vec<String>, u32) {
        let state = self.state.lock();
        (state.selectors_seen.clone(), state.refused)
    }

    /// Lists answered so far.
    pub(crate) fn lists(&self) -> u32 {
        self.state.lock().lists
    }
}

impl Drop for FakeApi {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl State {
    fn next_version(&mut self) -> u64 {
        self.version += 1;
        self.version
    }

    /// Keep the change for later watches and send it to the open ones (unless silent).
    fn record(&mut self, version: u64, old: Option<Value>, new: Option<Value>) {
        let change = Change { version, old, new };
        if !self.silent {
            self.watches
                .retain(|watch| match event_for(&change, &watch.selector) {
                    Some(line) => watch.events.unbounded_send(Ok(Frame::data(line))).is_ok(),
                    None => !watch.events.is_closed(),
                });
        }
        self.history.push(change);
    }
}

async fn accept(listener: tokio::net::TcpListener, state: Arc<Mutex<State>>) {
    let mut connections = tokio::task::JoinSet::new();
    while let Ok((stream, _)) = listener.accept().await {
        let state = Arc::clone(&state);
        let service = hyper::service::service_fn(move |req| {
            let state = Arc::clone(&state);
            async move { Ok::<_, Infallible>(handle(&state, req)) }
        });
        connections.spawn(async move {
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

fn handle(state: &Mutex<State>, req: Request<Incoming>) -> Response<Body> {
    let mut state = state.lock();
    let path = format!("/api/v1/namespaces/{}/pods", state.namespace);
    if req.method() != hyper::Method::GET {
        return status(
            StatusCode::METHOD_NOT_ALLOWED,
            "MethodNotAllowed",
            "only GET",
        );
    }
    if let Some(answer) = discovery(req.uri().path()) {
        return json_response(StatusCode::OK, &answer);
    }
    let pools = format!(
        "/apis/inference.networking.k8s.io/v1/namespaces/{}/inferencepools/",
        state.namespace
    );
    if let Some(name) = req.uri().path().strip_prefix(&pools) {
        return match state.pools.get(name) {
            Some(pool) => json_response(StatusCode::OK, pool),
            None => status(StatusCode::NOT_FOUND, "NotFound", "no such InferencePool"),
        };
    }
    if req.uri().path() != path {
        return status(StatusCode::NOT_FOUND, "NotFound", "only pods are served");
    }
    let query = query(req.uri().query().unwrap_or(""));
    let given = query.get("labelSelector").cloned().unwrap_or_default();
    state.selectors_seen.push(given.clone());
    let selector = match parse_selector(&given) {
        Some(s) if state.required.iter().all(|term| s.contains(term)) => s,
        _ => {
            state.refused += 1;
            let message = format!("labelSelector {given:?} lacks a required term");
            return status(StatusCode::BAD_REQUEST, "BadRequest", &message);
        }
    };
    if matches!(query.get("watch").map(String::as_str), Some("true" | "1")) {
        let from = query
            .get("resourceVersion")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        return watch(&mut state, selector, from);
    }
    if state.failing_lists {
        return status(
            StatusCode::INTERNAL_SERVER_ERROR,
            "InternalError",
            "lists fail",
        );
    }
    state.lists += 1;
    let items: Vec<&Value> = state
        .pods
        .values()
        .filter(|pod| matches(pod, &selector))
        .collect();
    let list = json!({
        "apiVersion": "v1",
        "kind": "PodList",
        "metadata": {"resourceVersion": state.version.to_string()},
        "items": items,
    });
    json_response(StatusCode::OK, &list)
}

/// The legacy discovery documents kubectl reads before it can name `pods`: the core group's
/// versions, no other group, and v1's one resource. (kubectl asks for aggregated discovery
/// first and accepts plain JSON, as from API servers before 1.26.)
fn discovery(path: &str) -> Option<Value> {
    match path {
        "/api" => Some(json!({"kind": "APIVersions", "versions": ["v1"],
            "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": "127.0.0.1"}]})),
        "/apis" => Some(json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": []})),
        "/api/v1" => Some(
            json!({"kind": "APIResourceList", "groupVersion": "v1", "resources": [{
                "name": "pods", "singularName": "pod", "namespaced": true, "kind": "Pod",
                "verbs": ["get", "list", "watch"], "shortNames": ["po"], "categories": ["all"],
            }]}),
        ),
        _ => None,
    }
}

/// Replay what happened after `from`, then stream what happens next.
fn watch(state: &mut State, selector: Vec<(String, String)>, from: u64) -> Response<Body> {
    let (events, stream) = mpsc::unbounded();
    if from + 1 < state.oldest {
        let _ = events.unbounded_send(Ok(Frame::data(event_line("ERROR", &gone_status()))));
    } else if !state.silent {
        for change in state.history.iter().filter(|c| c.version > from) {
            if let Some(line) = event_for(change, &selector) {
                let _ = events.unbounded_send(Ok(Frame::data(line)));
            }
        }
        state.watches.push(Watch { selector, events });
    } else {
        // Silent: the stream stays open and says nothing.
        state.watches.push(Watch { selector, events });
    }
    Response::builder()
        .header("content-type", "application/json")
        .body(StreamBody::new(stream).boxed_unsync())
        .expect("a response")
}

/// The event a watch with `selector` sees for `change`, if any.
fn event_for(change: &Change, selector: &[(String, String)]) -> Option<Bytes> {
    let was = change.old.as_ref().filter(|p| matches(p, selector));
    let is = change.new.as_ref().filter(|p| matches(p, selector));
    match (was, is, &change.new) {
        (Some(_), Some(new), _) => Some(event_line("MODIFIED", new)),
        (None, Some(new), _) => Some(event_line("ADDED", new)),
        // Relabelled out of the selector: gone, as far as this watch can tell.
        (Some(_), None, Some(new)) => Some(event_line("DELETED", new)),
        (Some(old), None, None) => Some(event_line("DELETED", old)),
        (None, None, _) => None,
    }
}

fn event_line(kind: &str, object: &Value) -> Bytes {
    let mut line = json!({"type": kind, "object": object}).to_string();
    line.push('\n');
    Bytes::from(line)
}

fn gone_status() -> Value {
    json!({"apiVersion": "v1", "kind": "Status", "status": "Failure", "code": 410,
           "reason": "Expired", "message": "too old resource version"})
}

fn matches(pod: &Value, selector: &[(String, String)]) -> bool {
    selector
        .iter()
        .all(|(k, v)| pod["metadata"]["labels"][k].as_str() == Some(v.as_str()))
}

/// `a=b,c==d` as terms; `None` for anything else (set-based selectors are not needed here).
fn parse_selector(text: &str) -> Option<Vec<(String, String)>> {
    text.split(',')
        .filter(|term| !term.is_empty())
        .map(|term| {
            let (k, v) = term.split_once("==").or_else(|| term.split_once('='))?;
            Some((k.trim().to_owned(), v.trim().to_owned()))
        })
        .collect()
}

fn query(text: &str) -> BTreeMap<String, String> {
    text.split('&')
        .filter_map(|pair| pair.split_once('='))
        .map(|(k, v)| (percent_decode(k), percent_decode(v)))
        .collect()
}

fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (bytes[i], hex) {
            (b'%', Some(byte)) => {
                out.push(byte);
                i += 3;
            }
            (b'+', _) => {
                out.push(b' ');
                i += 1;
            }
            (byte, _) => {
                out.push(byte);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn status(code: StatusCode, reason: &str, message: &str) -> Response<Body> {
    let body = json!({"apiVersion": "v1", "kind": "Status", "status": "Failure",
                      "code": code.as_u16(), "reason": reason, "message": message});
    json_response(code, &body)
}

fn json_response(code: StatusCode, body: &Value) -> Response<Body> {
    Response::builder()
        .status(code)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())).boxed_unsync())
        .expect("a response")
}
