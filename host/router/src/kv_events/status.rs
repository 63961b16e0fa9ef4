//! What a subscriber shows the rest of the router: progress, counters, staleness, and the way
//! in for "the engine may have restarted".

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use switchyard_contract::EndpointId;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

/// Why a subscriber dropped its endpoint's blocks and rebuilt them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResyncReason {
    /// The connection to the engine's PUB socket came up (first time, or again after a loss).
    Connected,
    /// The connection to the engine's PUB socket was lost (the blocks are dropped at once;
    /// the rebuild follows the reconnection).
    ConnectionLost,
    /// A sequence number at or below the last applied: a new publisher process.
    SequenceWentBack,
    /// A gap the replay socket could not fill.
    ReplayImpossible,
    /// The router has other evidence of a restart (a failed health probe, a changed
    /// `process_start_time_seconds`).
    EngineRestarted,
}

/// Cumulative counts, for metrics.
#[derive(Debug, Default)]
pub struct Counters {
    /// Batches applied to the index, live or replayed.
    pub batches: AtomicU64,
    /// Events applied.
    pub events: AtomicU64,
    /// Events the decoder skipped (unknown types, broken fields).
    pub skipped_events: AtomicU64,
    /// Messages that were not a batch at all (frames or payload).
    pub malformed: AtomicU64,
    /// Sequence gaps seen on the live stream.
    pub gaps: AtomicU64,
    /// Replays asked for (gaps and resyncs).
    pub replays: AtomicU64,
    /// Replays that failed or could not reach back far enough.
    pub replay_failures: AtomicU64,
    /// Batches received twice (live after a replay that had them) and applied once.
    pub duplicates: AtomicU64,
    /// Times the endpoint's blocks were dropped to be rebuilt.
    pub clears: AtomicU64,
    /// Connections to the PUB socket lost.
    pub disconnects: AtomicU64,
    /// Batches stamped with another data-parallel rank than the subscription's, dropped.
    pub rank_mismatches: AtomicU64,
}

impl Counters {
    pub(super) fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    /// A counter's value now.
    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }
}

/// A cloneable view of one endpoint's subscriber.
#[derive(Clone)]
pub struct SubscriberHandle {
    shared: Arc<Shared>,
}

struct Shared {
    endpoint: EndpointId,
    counters: Counters,
    applied: watch::Sender<Option<u64>>,
    resyncs: mpsc::Sender<ResyncReason>,
    freshness: Mutex<Freshness>,
    stale_after: Duration,
}

/// Events in, requests out, and what one says about the other.
#[derive(Default)]
struct Freshness {
    last_event: Option<Instant>,
    /// The first request served since the last event: from then on the engine must publish
    /// (a prompt's full blocks become cached), unless it is stale.
    waiting_since: Option<Instant>,
}

impl SubscriberHandle {
    pub(super) fn new(
        endpoint: EndpointId,
        stale_after: Duration,
    ) -> (Self, mpsc::Receiver<ResyncReason>) {
        // One pending resync is all a burst of signals needs: they all ask for the same thing.
        let (resyncs, receiver) = mpsc::channel(1);
        let handle = Self {
            shared: Arc::new(Shared {
                endpoint,
                counters: Counters::default(),
                applied: watch::Sender::new(None),
                resyncs,
                freshness: Mutex::default(),
                stale_after,
            }),
        };
        (handle, receiver)
    }

    pub fn endpoint(&self) -> EndpointId {
        self.shared.endpoint
    }

    pub fn counters(&self) -> &Counters {
        &self.shared.counters
    }

    /// The sequence number of the last batch applied; `None` after a clear, until the next.
    pub fn applied(&self) -> watch::Receiver<Option<u64>> {
        self.shared.applied.subscribe()
    }

    /// Asks the subscriber to clear its endpoint and rebuild (the engine may have restarted).
    pub fn resync(&self, reason: ResyncReason) {
        // Full: a resync is already pending, which does the same.
        let _ = self.shared.resyncs.try_send(reason);
    }

    /// The router sent the endpoint a request whose prompt fills at least one block.
    pub fn note_served(&self, now: Instant) {
        self.shared
            .freshness
            .lock()
            .waiting_since
            .get_or_insert(now);
    }

    /// When the engine last published (any message, even one already applied).
    pub fn last_event_at(&self) -> Option<Instant> {
        self.shared.freshness.lock().last_event
    }

    /// Whether the endpoint served requests and then published nothing for `stale_after`:
    /// its events are not reaching the router, whatever its index says.
    pub fn is_stale(&self, now: Instant) -> bool {
        self.shared
            .freshness
            .lock()
            .waiting_since
            .is_some_and(|since| now.saturating_duration_since(since) >= self.shared.stale_after)
    }

    pub(super) fn note_event(&self, now: Instant) {
        let mut freshness = self.shared.freshness.lock();
        freshness.last_event = Some(now);
        freshness.waiting_since = None;
    }

    pub(super) fn set_applied(&self, seq: Option<u64>) {
        self.shared.applied.send_replace(seq);
    }
}
