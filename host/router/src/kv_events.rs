//! KV-cache event subscribers: one task per endpoint whose engine publishes its prefix cache
//! (vLLM, SGLang: shared/spec/kv-events.md), keeping that endpoint's part of the router's one
//! [`KvIndex`] exact, or empty when it cannot be.
//!
//! A task dials the engine's PUB socket (ZeroMQ, `zeromq` crate: SUB reconnects and
//! resubscribes by itself when the engine comes back), applies each batch once and in
//! sequence order, and asks the engine's replay socket (DEALER, both reply shapes) for what a
//! gap lost. The protocol has no epoch: a lost connection, a sequence number going back, a
//! replay that cannot cover a gap, or a signal that the engine restarted ([`SubscriberHandle::resync`])
//! all mean the same: clear the endpoint, replay whatever the engine still buffers from 0, and
//! go on from the live stream.
//!
//! [`SubscriberHandle`] is what the rest of the router reads: the last applied sequence
//! number (a watch), [`Counters`] for metrics, and staleness: an endpoint that served requests
//! and then published nothing for `stale_after` is stale; an idle one stays trusted.
//!
//! ```no_run
//! # async fn example() {
//! use switchyard_router::kv_events::{KvEventsSource, SubscriberConfig, shared_index, spawn};
//!
//! let index = shared_index(100_000);
//! let source = KvEventsSource::new("tcp://10.0.0.7:5557")
//!     .with_replay("tcp://10.0.0.7:5558");
//! let subscription = spawn(3, source, SubscriberConfig::default(), index.clone());
//! // On the request path:
//! let matches = index.read().lookup(
//!     &[1, 2, 3],
//!     switchyard_kv_index::Adapter::Base,
//!     switchyard_kv_index::MediumSet::GPU,
//! );
//! # drop((matches, subscription));
//! # }
//! ```

mod replay;
mod status;
mod subscriber;
#[cfg(test)]
mod tests;

use std::sync::Arc;
use std::time::Duration;

use parking_lot::RwLock;
use switchyard_contract::EndpointId;
use switchyard_kv_index::KvIndex;
use tokio_util::sync::{CancellationToken, DropGuard};

pub use replay::ReplayError;
pub use status::{Counters, ResyncReason, SubscriberHandle};

/// The router's one index, written by every subscriber (a write lock per step of at most 64
/// blocks of a batch) and read by every request (a read lock per lookup).
pub type SharedIndex = Arc<RwLock<KvIndex>>;

/// An empty shared index keeping at most `blocks_per_endpoint` blocks per endpoint.
pub fn shared_index(blocks_per_endpoint: usize) -> SharedIndex {
    Arc::new(RwLock::new(KvIndex::new(blocks_per_endpoint)))
}

/// Where one engine publishes: `kv_events`, `kv_events_replay`, `kv_events_topic`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvEventsSource {
    /// The engine's PUB socket, `tcp://host:port`.
    pub events: String,
    /// The engine's ROUTER replay socket; without one, every gap clears the endpoint.
    pub replay: Option<String>,
    /// The topic prefix subscribed to; empty: every topic.
    pub topic: String,
    /// The data-parallel rank publishing here, when the engine has several: a batch stamped
    /// with another rank is counted and dropped. `None`: one rank, whatever its batches say.
    pub rank: Option<u32>,
}

impl KvEventsSource {
    pub fn new(events: impl Into<String>) -> Self {
        Self {
            events: events.into(),
            replay: None,
            topic: String::new(),
            rank: None,
        }
    }

    /// Where data-parallel rank `rank` of the engine configured at `self` (its rank 0)
    /// publishes: vLLM's `ZmqEventPublisher` binds each rank's PUB and replay sockets at the
    /// configured ports plus the rank, and stamps the rank in every batch.
    #[must_use]
    pub fn for_rank(&self, rank: u32) -> Self {
        Self {
            events: offset_port(&self.events, rank),
            replay: self
                .replay
                .as_deref()
                .map(|replay| offset_port(replay, rank)),
            topic: self.topic.clone(),
            rank: Some(rank),
        }
    }

    #[must_use]
    pub fn with_replay(self, replay: impl Into<String>) -> Self {
        Self {
            replay: Some(replay.into()),
            ..self
        }
    }

    #[must_use]
    pub fn with_topic(self, topic: impl Into<String>) -> Self {
        Self {
            topic: topic.into(),
            ..self
        }
    }
}

/// `tcp://HOST:PORT` with `by` added to its port (the endpoint's configuration has checked
/// that it is such an address and that the sum is a port).
fn offset_port(url: &str, by: u32) -> String {
    match url.rsplit_once(':') {
        Some((host, port)) => match port.parse::<u32>() {
            Ok(port) => format!("{host}:{}", port + by),
            Err(_) => url.to_owned(),
        },
        None => url.to_owned(),
    }
}

/// What every subscriber shares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SubscriberConfig {
    /// How long a replay may take, from dialling the replay socket to its end marker. Engines
    /// serve replays between publishes (vLLM polls every 100 ms).
    pub replay_timeout: Duration,
    /// `kv_events_stale_after`: how long an endpoint that served a request may publish nothing
    /// before its index is stale.
    pub stale_after: Duration,
    /// The top-level `kv_events_dp_size`: how many data-parallel ranks publish for an endpoint
    /// that does not say (a fleet of DP engines sets it once).
    pub dp_size: u32,
}

impl Default for SubscriberConfig {
    fn default() -> Self {
        Self {
            replay_timeout: Duration::from_secs(2),
            stale_after: Duration::from_secs(10),
            dp_size: 1,
        }
    }
}

/// A running subscriber; dropping it stops the task (its endpoint's blocks stay in the index
/// until [`KvIndex::remove_endpoint`]).
pub struct Subscription {
    handle: SubscriberHandle,
    stop: DropGuard,
    task: tokio::task::JoinHandle<()>,
}

impl Subscription {
    pub fn handle(&self) -> &SubscriberHandle {
        &self.handle
    }

    /// Stops the task and waits for it to end.
    pub async fn stop(self) {
        let Self { stop, task, .. } = self;
        drop(stop);
        // A task that panicked has nothing left to stop.
        let _ = task.await;
    }
}

/// Starts `endpoint`'s subscriber on the current runtime.
pub fn spawn(
    endpoint: EndpointId,
    source: KvEventsSource,
    config: SubscriberConfig,
    index: SharedIndex,
) -> Subscription {
    let stop = CancellationToken::new();
    let (handle, resyncs) = SubscriberHandle::new(endpoint, config.stale_after);
    let task = tokio::spawn(
        subscriber::Subscriber::new(endpoint, source, config, index, handle.clone(), resyncs)
            .run(stop.clone()),
    );
    Subscription {
        handle,
        stop: stop.drop_guard(),
        task,
    }
}
