//! The executor and the relay against scripted engines (`engine_client::scripted`) on a paused
//! clock, one file per protocol: each test drives its engines call by call, as
//! linkerd2-proxy's logical-stack tests drive their mock services, and checks what the engines
//! saw, what the attempt returned, and what the cluster was told.
//!
//! In-memory I/O wakes tasks at once, so the paused clock only moves when everything waits on
//! a timer: timeouts and backoffs take their exact durations, and a sleep in a test ends only
//! once every other task is idle ([`settle`]).

mod classify;
mod mlc;
mod prefill;
mod relay;
mod sglang;
mod vllm;

use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use serde_json::{Value, json};
use switchyard_contract::{EndpointId, Protocol, Role, ValidPlan};
use switchyard_wire::completion::CompletionRequest;

use super::*;
use crate::cluster::{Cluster, EndpointSpec, OutlierConfig};
use crate::engine_client::scripted::{Engine, Engines};
use crate::engine_client::{EngineClient, Timeouts};

const REQUEST_ID: &str = "cmpl-0123456789abcdef0123456789abcdef";

/// The engines of a test, named `e0`, `e1`… (endpoint `i` is `http://e{i}`), a cluster of them
/// and an executor over both.
struct Harness {
    engines: Engines,
    executor: Executor,
}

impl Harness {
    /// Endpoints speaking `protocols`, all healthy, with default timeouts.
    fn new(protocols: &[Protocol]) -> Self {
        Self::with(
            protocols.iter().map(|&p| spec(p)).collect(),
            Timeouts::default(),
        )
    }

    /// Endpoints as `specs` say, each at `http://e{i}` unless its spec names a URL; all
    /// healthy.
    fn with(mut specs: Vec<EndpointSpec>, timeouts: Timeouts) -> Self {
        for (i, spec) in specs.iter_mut().enumerate() {
            if spec.url.is_empty() {
                spec.url = format!("http://e{i}");
            }
        }
        let n = specs.len();
        let cluster = Arc::new(Cluster::new(specs, OutlierConfig::default()));
        for id in 0..n as u32 {
            cluster.set_health(id, true);
        }
        let engines = Engines::default();
        let client = EngineClient::scripted(timeouts, engines.connector());
        Harness {
            engines,
            executor: Executor::new(cluster, client),
        }
    }

    /// Endpoint `id`'s engine, answering from now on.
    fn engine(&self, id: EndpointId) -> Engine {
        self.engines.engine(&format!("e{id}"))
    }

    fn cluster(&self) -> &Arc<Cluster> {
        self.executor.cluster()
    }

    /// Run `plan` as attempt 1 of the test request.
    async fn execute(&self, plan: ValidPlan) -> Result<Generation, ExecError> {
        self.execute_with(plan, body()).await
    }

    /// Run `plan` as attempt 1 of a request with `body`.
    async fn execute_with(
        &self,
        plan: ValidPlan,
        body: AttemptBody,
    ) -> Result<Generation, ExecError> {
        self.executor.execute(&plan, body, &attempt()).await
    }

    /// Whether endpoint `id` is still taken to be up.
    fn healthy(&self, id: EndpointId) -> bool {
        self.cluster().status()[id as usize].healthy
    }

    /// The failures in a row counted against endpoint `id`.
    fn failures(&self, id: EndpointId) -> u32 {
        self.cluster().status()[id as usize]
            .outlier
            .consecutive_failures
    }

    /// Legs in flight on endpoint `id`.
    fn in_flight(&self, id: EndpointId) -> u32 {
        self.cluster().snapshot()[id as usize].in_flight
    }

    /// Prompt tokens counted as not prefilled yet on endpoint `id`.
    fn pending_prefill(&self, id: EndpointId) -> u32 {
        self.cluster().snapshot()[id as usize].pending_prefill
    }
}

/// An endpoint speaking `protocol`, at the URL its position gives it ([`Harness::with`]).
fn spec(protocol: Protocol) -> EndpointSpec {
    EndpointSpec {
        protocol,
        ..EndpointSpec::new("")
    }
}

fn attempt() -> AttemptId {
    AttemptId::new(REQUEST_ID, 1)
}

/// The test request: a five-token prompt, up to eight new tokens, streamed, planned without
/// any endpoint's cached prefix known (every leg prefills all five tokens).
fn body() -> AttemptBody {
    let mut tokens = CompletionRequest::new(vec![1, 2, 3, 4, 5], 8, String::new());
    tokens.stream = true;
    AttemptBody {
        tokens,
        client: None,
        cached: CachedPrefixes::new(5, &[]),
    }
}

/// A completion chunk with `text` and, when it is the last, its finish reason.
fn chunk(text: &str, finish: Option<&str>) -> Value {
    json!({"id": "c", "object": "text_completion", "created": 0, "model": "m",
        "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": null}]})
}

/// A chunk carrying the ids its text completes.
fn chunk_with_ids(text: &str, ids: &[u32], finish: Option<&str>) -> Value {
    let mut chunk = chunk(text, finish);
    chunk["choices"][0]["token_ids"] = json!(ids);
    chunk
}

/// Let every task run until all of them wait: on the paused clock, this sleep ends only once
/// nothing else can happen before it, so whatever the code under test was going to send by
/// now has been sent.
async fn settle() {
    tokio::time::sleep(Duration::from_millis(1)).await;
}

/// Whether `wait` is over once every task has run as far as it can.
async fn done_by_now(wait: impl Future<Output = ()>) -> bool {
    let mut wait = std::pin::pin!(wait);
    settle().await;
    (&mut wait).now_or_never().is_some()
}

/// Collects the relay's text; a closed sink is a client that left.
#[derive(Default)]
struct Client {
    text: parking_lot::Mutex<String>,
    gone: bool,
}

impl TextSink for Client {
    async fn text(&self, text: String) -> Result<(), ClientGone> {
        if self.gone {
            return Err(ClientGone);
        }
        self.text.lock().push_str(&text);
        Ok(())
    }
}
