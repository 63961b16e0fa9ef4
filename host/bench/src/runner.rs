//! Releases requests (closed or open loop), sends each on its arm and collects the outcomes.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use indicatif::ProgressBar;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::client::{self, RequestError};
use super::config::{LoadShape, PromptFormat};
use super::connection::{Connection, Target};
use super::direct::DirectArm;
use super::schedule::ArrivalSchedule;
use super::stats::{RequestOutcome, Timing};
use super::workload::{Arm, RequestSpec, Workload};

/// Sends one request on its arm.
#[derive(Debug)]
pub struct Executor {
    pub client: reqwest::Client,
    /// `{url}/v1/completions` of the server under test.
    pub completions_url: String,
    pub model: Option<String>,
    pub prompt_format: PromptFormat,
    pub stream: bool,
    pub request_timeout: Duration,
    pub direct: Option<DirectArm>,
    /// `--connection-per-client`: each closed-loop client sends on a connection of its own to
    /// this target instead of through `client`'s pool.
    pub own_connections: Option<Target>,
}

impl Executor {
    /// Sends `spec` and times it from `start` (its scheduled send time), on `connection` when
    /// the client has one of its own.
    pub async fn run_one(
        &self,
        spec: RequestSpec,
        start: Instant,
        connection: Option<&mut Connection>,
    ) -> RequestOutcome {
        let send = self.send(&spec, start, connection);
        let result = client::with_timeout(self.request_timeout, send).await;
        RequestOutcome {
            index: spec.index,
            arm: spec.arm,
            input_tokens: u32::try_from(spec.prompt.len()).unwrap_or(u32::MAX),
            result: result.map_err(|e| e.to_string()),
        }
    }

    async fn send(
        &self,
        spec: &RequestSpec,
        start: Instant,
        connection: Option<&mut Connection>,
    ) -> Result<Timing, RequestError> {
        match (spec.arm, &self.direct) {
            (Arm::Direct, Some(direct)) => direct.send(&self.client, spec, start).await,
            _ => self.send_routed(spec, start, connection).await,
        }
    }

    async fn send_routed(
        &self,
        spec: &RequestSpec,
        start: Instant,
        connection: Option<&mut Connection>,
    ) -> Result<Timing, RequestError> {
        let body =
            client::completion_body(spec, self.model.as_deref(), self.prompt_format, self.stream);
        if let Some(connection) = connection {
            return connection
                .post_completion("completions", &body, start, self.stream)
                .await;
        }
        let response =
            client::post_json(&self.client, "completions", &self.completions_url, &body).await?;
        client::time_completion("completions", response, start, self.stream).await
    }
}

/// When a run stops releasing requests.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub num_requests: u64,
    pub duration: Duration,
}

/// Runs the whole load; returns every outcome and the wall time until the last one finished.
pub async fn drive(
    executor: Arc<Executor>,
    workload: Arc<Workload>,
    load: LoadShape,
    limits: Limits,
    seed: u64,
    progress: ProgressBar,
) -> (Vec<RequestOutcome>, Duration) {
    let started = Instant::now();
    let outcomes = match load {
        LoadShape::Closed { concurrency } => {
            closed_loop(executor, workload, concurrency, limits, started, progress).await
        }
        LoadShape::Open {
            rate,
            arrivals,
            max_concurrency,
        } => {
            let due = (0..limits.num_requests)
                .zip(ArrivalSchedule::new(rate, arrivals, seed))
                .map(|(index, offset)| (offset, workload.request(index)));
            open_loop(
                executor,
                due,
                max_concurrency,
                limits.duration,
                started,
                progress,
            )
            .await
        }
    };
    (outcomes, started.elapsed())
}

/// Sends each request at its offset from the start (open loop), until the offsets pass
/// `duration`; returns every outcome and the wall time until the last one finished.
pub async fn replay(
    executor: Arc<Executor>,
    due: impl Iterator<Item = (Duration, RequestSpec)>,
    max_concurrency: Option<u32>,
    duration: Duration,
    progress: ProgressBar,
) -> (Vec<RequestOutcome>, Duration) {
    let started = Instant::now();
    let outcomes = open_loop(executor, due, max_concurrency, duration, started, progress).await;
    (outcomes, started.elapsed())
}

/// `concurrency` workers; each sends its next request as soon as its last one finished.
async fn closed_loop(
    executor: Arc<Executor>,
    workload: Arc<Workload>,
    concurrency: u32,
    limits: Limits,
    started: Instant,
    progress: ProgressBar,
) -> Vec<RequestOutcome> {
    let next = Arc::new(AtomicU64::new(0));
    let deadline = started + limits.duration;
    let workers = u64::from(concurrency).min(limits.num_requests);
    let mut tasks = JoinSet::new();
    for _ in 0..workers {
        let (executor, workload, next, progress) = (
            executor.clone(),
            workload.clone(),
            next.clone(),
            progress.clone(),
        );
        tasks.spawn(async move {
            let mut connection = executor.own_connections.clone().map(Connection::new);
            let mut outcomes = Vec::new();
            while Instant::now() < deadline {
                let index = next.fetch_add(1, Ordering::Relaxed);
                if index >= limits.num_requests {
                    break;
                }
                let spec = workload.request(index);
                let outcome = executor
                    .run_one(spec, Instant::now(), connection.as_mut())
                    .await;
                outcomes.push(outcome);
                progress.inc(1);
            }
            outcomes
        });
    }
    let mut outcomes = Vec::new();
    while let Some(joined) = tasks.join_next().await {
        match joined {
            Ok(done) => outcomes.extend(done),
            Err(e) => tracing::error!("a load worker failed: {e}"),
        }
    }
    outcomes.sort_by_key(|o| o.index);
    outcomes
}

/// Sends each request at its offset whatever happened to the earlier ones. `due` yields each
/// request before its time comes, so building it (a prompt) does not delay the send.
async fn open_loop(
    executor: Arc<Executor>,
    due: impl Iterator<Item = (Duration, RequestSpec)>,
    max_concurrency: Option<u32>,
    duration: Duration,
    started: Instant,
    progress: ProgressBar,
) -> Vec<RequestOutcome> {
    let cap = max_concurrency.map(|c| Arc::new(Semaphore::new(c as usize)));
    let mut tasks = JoinSet::new();
    let mut outcomes = Vec::new();
    for (offset, spec) in due {
        if offset >= duration {
            break;
        }
        let due = started + offset;
        tokio::time::sleep_until(due).await;
        let (executor, cap, progress) = (executor.clone(), cap.clone(), progress.clone());
        tasks.spawn(async move {
            // Waiting for a slot under --max-concurrency counts in the latency: `due` is fixed.
            let _permit = match cap {
                Some(cap) => cap.acquire_owned().await.ok(),
                None => None,
            };
            let outcome = executor.run_one(spec, due, None).await;
            progress.inc(1);
            outcome
        });
        // Collect what has finished so a long run does not hold every task.
        while let Some(joined) = tasks.try_join_next() {
            collect(joined, &mut outcomes);
        }
    }
    while let Some(joined) = tasks.join_next().await {
        collect(joined, &mut outcomes);
    }
    outcomes.sort_by_key(|o| o.index);
    outcomes
}

fn collect(
    joined: Result<RequestOutcome, tokio::task::JoinError>,
    outcomes: &mut Vec<RequestOutcome>,
) {
    match joined {
        Ok(outcome) => outcomes.push(outcome),
        Err(e) => tracing::error!("a request task failed: {e}"),
    }
}
