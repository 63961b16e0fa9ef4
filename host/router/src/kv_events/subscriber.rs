//! One endpoint's subscriber task: the SUB socket, sequence tracking, replay, and
//! clear-and-rebuild.

use futures::StreamExt;
use parking_lot::RwLockWriteGuard;
use switchyard_contract::EndpointId;
use switchyard_kv_index::BatchProgress;
use switchyard_wire::kv_events::decode_batch;
use switchyard_wire::kv_events::frames::PubMessage;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use zeromq::{Socket, SocketEvent, SocketOptions, SocketRecv, SubSocket, ZmqMessage};

use super::replay::{Replayed, replay};
use super::status::{Counters, ResyncReason, SubscriberHandle};
use super::{KvEventsSource, SharedIndex, SubscriberConfig};

/// Blocks stored or removed under one hold of the index's write lock (about 30 µs at the
/// cap): a batch holding a step's prefills (hundreds of blocks) would hold lookups back for
/// as many times that.
const BLOCKS_PER_WRITE: usize = 64;

pub(super) struct Subscriber {
    source: KvEventsSource,
    resyncs: mpsc::Receiver<ResyncReason>,
    tracker: Tracker,
}

/// Where the endpoint's index stands against the engine's sequence numbers.
struct Tracker {
    endpoint: EndpointId,
    replay: Option<String>,
    /// The DP rank expected in every batch, when the engine has several.
    rank: Option<u32>,
    /// Whether a batch of another rank was logged already (they are all counted).
    rank_mismatch_logged: bool,
    config: SubscriberConfig,
    index: SharedIndex,
    handle: SubscriberHandle,
    /// The last sequence number applied since the last clear.
    last: Option<u64>,
    /// Batches up to here came by replay and may still arrive live: those are skipped.
    replayed_through: Option<u64>,
}

impl Subscriber {
    pub(super) fn new(
        endpoint: EndpointId,
        source: KvEventsSource,
        config: SubscriberConfig,
        index: SharedIndex,
        handle: SubscriberHandle,
        resyncs: mpsc::Receiver<ResyncReason>,
    ) -> Self {
        Self {
            tracker: Tracker {
                endpoint,
                replay: source.replay.clone(),
                rank: source.rank,
                rank_mismatch_logged: false,
                config,
                index,
                handle,
                last: None,
                replayed_through: None,
            },
            source,
            resyncs,
        }
    }

    pub(super) async fn run(mut self, stop: CancellationToken) {
        tokio::select! {
            () = stop.cancelled() => {}
            () = self.subscribe() => {}
        }
    }

    async fn subscribe(&mut self) {
        let endpoint = self.tracker.endpoint;
        let mut options = SocketOptions::default();
        // An engine that is not up yet is dialled until it is (backing off to 30 s).
        options.no_connect_timeout();
        let mut socket = SubSocket::with_options(options);
        let mut monitor = socket.monitor();
        // Remembered and sent on every (re)connection.
        if let Err(error) = socket.subscribe(&self.source.topic).await {
            tracing::warn!(endpoint, %error, "KV events: subscribing failed");
        }
        if let Err(error) = socket.connect(&self.source.events).await {
            // Only an address that can never work ends up here (retryable errors are retried).
            tracing::error!(endpoint, events = %self.source.events, %error, "KV events: cannot connect");
            return;
        }
        loop {
            // Connection changes first: a message of a new connection must not be taken for
            // the old one's.
            tokio::select! {
                biased;
                event = monitor.next() => match event {
                    Some(SocketEvent::Connected(..)) => {
                        self.tracker.resync(ResyncReason::Connected).await;
                    }
                    Some(SocketEvent::Disconnected(_)) => self.tracker.disconnected(),
                    Some(_) => {}
                    // The socket dropped its monitor: it is gone.
                    None => return,
                },
                Some(reason) = self.resyncs.recv() => self.tracker.resync(reason).await,
                message = socket.recv() => match message {
                    Ok(message) => self.tracker.message(message).await,
                    // A lost connection surfaces here and on the monitor, which handles it.
                    Err(error) => tracing::debug!(endpoint, %error, "KV events: receive failed"),
                },
            }
        }
    }
}

impl Tracker {
    fn counters(&self) -> &Counters {
        self.handle.counters()
    }

    async fn message(&mut self, message: ZmqMessage) {
        let frames = message.into_vec();
        let message = match PubMessage::parse(&frames) {
            Ok(message) => message,
            Err(error) => {
                Counters::add(&self.counters().malformed, 1);
                tracing::warn!(endpoint = self.endpoint, %error, "KV events: not a KV event message");
                return;
            }
        };
        self.handle.note_event(Instant::now());
        let (seq, payload) = (message.seq, message.payload);
        match self.last {
            None => self.apply(seq, payload),
            Some(last) if Some(seq) == last.checked_add(1) => self.apply(seq, payload),
            Some(last) if seq <= last => {
                if self.replayed_through.is_some_and(|through| seq <= through) {
                    Counters::add(&self.counters().duplicates, 1);
                    return;
                }
                // A new publisher process counting from 0 again.
                self.resync(ResyncReason::SequenceWentBack).await;
                self.apply_after_catching_up(seq, payload).await;
            }
            Some(last) => {
                Counters::add(&self.counters().gaps, 1);
                self.fill_gap(last + 1).await;
                self.apply_after_catching_up(seq, payload).await;
            }
        }
    }

    /// The live message that made the subscriber catch up: the replay may have brought it
    /// already, or left the stream right before it; anything else is a gap nothing can fill.
    async fn apply_after_catching_up(&mut self, seq: u64, payload: &[u8]) {
        match self.last {
            Some(last) if seq <= last => Counters::add(&self.counters().duplicates, 1),
            Some(last) if seq - last > 1 => {
                self.clear(ResyncReason::ReplayImpossible);
                self.apply(seq, payload);
            }
            _ => self.apply(seq, payload),
        }
    }

    /// Replays the missing batches from `from`; if the engine no longer has them all, the
    /// endpoint is cleared and rebuilt from what it does have.
    async fn fill_gap(&mut self, from: u64) {
        let Some(batches) = self.replay_from(from).await else {
            self.clear(ResyncReason::ReplayImpossible);
            return;
        };
        if batches.first().is_none_or(|first| first.seq != from) {
            Counters::add(&self.counters().replay_failures, 1);
            tracing::info!(
                endpoint = self.endpoint,
                from,
                first = batches.first().map(|b| b.seq),
                "KV events: the engine no longer buffers the lost batches"
            );
            self.clear(ResyncReason::ReplayImpossible);
        }
        self.apply_replayed(&batches);
    }

    /// Drops the endpoint's blocks and rebuilds them from everything the engine still
    /// buffers; live batches take over from there.
    async fn resync(&mut self, reason: ResyncReason) {
        self.clear(reason);
        if let Some(batches) = self.replay_from(0).await {
            self.apply_replayed(&batches);
        }
    }

    fn disconnected(&mut self) {
        Counters::add(&self.counters().disconnects, 1);
        // The engine may be restarting: its cache is not what the index says any more.
        self.clear(ResyncReason::ConnectionLost);
    }

    fn clear(&mut self, reason: ResyncReason) {
        if self.last.is_some() {
            Counters::add(&self.counters().clears, 1);
            tracing::info!(
                endpoint = self.endpoint,
                ?reason,
                "KV events: clearing the endpoint's index"
            );
        }
        self.index.write().clear_endpoint(self.endpoint);
        self.last = None;
        self.replayed_through = None;
        self.handle.set_applied(None);
    }

    /// The engine's buffered batches from `start`, or `None` (counted) when there is no
    /// replay socket or it failed.
    async fn replay_from(&self, start: u64) -> Option<Vec<Replayed>> {
        let endpoint = self.replay.as_deref()?;
        Counters::add(&self.counters().replays, 1);
        match replay(endpoint, start, self.config.replay_timeout).await {
            Ok(batches) => Some(batches),
            Err(error) => {
                Counters::add(&self.counters().replay_failures, 1);
                tracing::warn!(endpoint = self.endpoint, %error, "KV events: replay failed");
                None
            }
        }
    }

    fn apply_replayed(&mut self, batches: &[Replayed]) {
        for batch in batches {
            if self.last.is_some_and(|last| batch.seq <= last) {
                continue;
            }
            self.apply(batch.seq, &batch.payload);
        }
        self.replayed_through = self.last;
    }

    fn apply(&mut self, seq: u64, payload: &[u8]) {
        match decode_batch(payload) {
            Ok(decoded) if !self.is_own_rank(decoded.batch.data_parallel_rank) => {
                Counters::add(&self.counters().rank_mismatches, 1);
                if !std::mem::replace(&mut self.rank_mismatch_logged, true) {
                    tracing::warn!(
                        endpoint = self.endpoint,
                        expected = self.rank,
                        published = decoded.batch.data_parallel_rank,
                        "KV events: a batch of another data-parallel rank on this rank's socket \
                         (dropped, as every later one; is kv_events_dp_size right?)"
                    );
                }
            }
            Ok(decoded) => {
                let counters = self.counters();
                Counters::add(&counters.batches, 1);
                Counters::add(&counters.events, decoded.batch.events.len() as u64);
                Counters::add(&counters.skipped_events, decoded.skipped.len() as u64);
                let mut progress = BatchProgress::default();
                let mut index = self.index.write();
                while !index.apply_batch_step(
                    self.endpoint,
                    &decoded.batch,
                    &mut progress,
                    BLOCKS_PER_WRITE,
                ) {
                    // A lookup waiting for the lock goes first, if there is one.
                    RwLockWriteGuard::bump(&mut index);
                }
            }
            // Its sequence number still counts, or every later batch would look like a gap.
            Err(error) => {
                Counters::add(&self.counters().malformed, 1);
                tracing::warn!(endpoint = self.endpoint, seq, %error, "KV events: undecodable batch");
            }
        }
        self.last = Some(seq);
        if self.replayed_through.is_some_and(|through| seq > through) {
            self.replayed_through = None;
        }
        self.handle.set_applied(Some(seq));
    }

    /// Whether a batch stamped `published` belongs to this subscription: any, with one rank;
    /// the expected one (or none stamped: the first layouts) with several.
    fn is_own_rank(&self, published: Option<i64>) -> bool {
        match (self.rank, published) {
            (Some(expected), Some(published)) => i64::from(expected) == published,
            _ => true,
        }
    }
}
