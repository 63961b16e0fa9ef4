//! The cluster's view of its engines' KV caches: one subscriber per endpoint that publishes
//! KV events (`kv_events`), all writing the one shared index, and what a request reads from
//! it: each endpoint's cached prefix of the request's prompt.
//!
//! Zero cost without events: while no endpoint has a subscriber, a snapshot does no lookup
//! and hashes nothing. With events, one lookup per attempt covers every trusted endpoint. An
//! endpoint whose index is stale (it served a prompt of at least a block and published nothing
//! for `kv_events_stale_after`) shows `None` and is left out of the lookup, as is one without
//! events: a policy cannot tell a cold cache from an unknown one, and must not mistake the
//! second for the first.

use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::Mutex;
use serde::Serialize;
use switchyard_contract::{EndpointId, EndpointSnapshot};
use switchyard_kv_index::{Adapter, EndpointStats, MediumSet};
use tokio::time::Instant;

use crate::kv_events::{
    Counters, KvEventsSource, ResyncReason, SharedIndex, SubscriberConfig, SubscriberHandle,
    Subscription, shared_index, spawn,
};

#[cfg(test)]
mod tests;

/// vLLM's default block size, assumed for an endpoint that has not published a block yet when
/// deciding whether a prompt must have stored one.
const ASSUMED_BLOCK_SIZE: usize = 16;

/// The shared index and what every subscriber shares.
pub(super) struct KvCache {
    index: SharedIndex,
    config: SubscriberConfig,
    /// Endpoints with a running subscriber.
    subscribed: AtomicUsize,
}

impl KvCache {
    pub(super) fn new(config: SubscriberConfig) -> Self {
        KvCache {
            index: shared_index(switchyard_kv_index::DEFAULT_BLOCKS_PER_ENDPOINT),
            config,
            subscribed: AtomicUsize::new(0),
        }
    }

    /// Whether any endpoint publishes: the request path skips everything else when none does.
    pub(super) fn is_active(&self) -> bool {
        self.subscribed.load(Ordering::Acquire) > 0
    }

    /// Starts `id`'s subscriber when it has a source and none runs yet (on the current
    /// runtime).
    pub(super) fn subscribe(&self, id: EndpointId, endpoint: &EndpointKv) {
        let Some(source) = &endpoint.source else {
            return;
        };
        let mut running = endpoint.subscription.lock();
        if running.is_none() {
            *running = Some(spawn(id, source.clone(), self.config, self.index.clone()));
            self.subscribed.fetch_add(1, Ordering::AcqRel);
            tracing::info!(endpoint = id, events = %source.events, "KV events: subscribed");
        }
    }

    /// Stops `id`'s subscriber and forgets its blocks: the endpoint left.
    pub(super) fn unsubscribe(&self, id: EndpointId, endpoint: &EndpointKv) {
        if endpoint.subscription.lock().take().is_some() {
            self.subscribed.fetch_sub(1, Ordering::AcqRel);
            self.index.write().remove_endpoint(id);
        }
    }

    /// Fills each endpoint's `cached_prefix` for `prompt`: what its index holds when it has a
    /// subscriber whose index is trusted now, else `None`.
    pub(super) fn fill(
        &self,
        snapshot: &mut [EndpointSnapshot],
        handles: &[Option<SubscriberHandle>],
        prompt: &[u32],
        now: Instant,
    ) {
        // Untrusted endpoints stay out of the walk: a stale one holding a long prefix would
        // keep it going for nothing.
        let trusted: Vec<EndpointId> = snapshot
            .iter()
            .zip(handles)
            .filter(|(_, handle)| handle.as_ref().is_some_and(|h| !h.is_stale(now)))
            .map(|(endpoint, _)| endpoint.id)
            .collect();
        let matches = self
            .index
            .read()
            .lookup_among(prompt, Adapter::Base, MediumSet::GPU, |id| {
                trusted.contains(&id)
            });
        for endpoint in snapshot.iter_mut() {
            if !trusted.contains(&endpoint.id) {
                continue;
            }
            // Sorted by endpoint; an endpoint without events yet holds nothing.
            let tokens = matches
                .binary_search_by_key(&endpoint.id, |m| m.endpoint)
                .map_or(0, |at| matches[at].tokens);
            endpoint.cached_prefix = Some(u32::try_from(tokens).unwrap_or(u32::MAX));
        }
    }

    /// The endpoint was sent a prompt of `prompt_len` tokens: from a block on, its engine must
    /// publish what it stored, or its index goes stale.
    pub(super) fn note_served(&self, handle: &SubscriberHandle, prompt_len: usize, now: Instant) {
        if prompt_len >= self.block_size(handle.endpoint()) {
            handle.note_served(now);
        }
    }

    /// Whether `predicted`, `id`'s cached prefix of an attempt's `prompt_len`-token prompt, is
    /// what its engine then reported having cached, in whole blocks of `id`'s size
    /// ([`switchyard_kv_index::prediction_hit`]).
    pub(super) fn prediction_hit(
        &self,
        id: EndpointId,
        predicted: u32,
        cached: u32,
        prompt_len: u32,
    ) -> bool {
        switchyard_kv_index::prediction_hit(
            predicted as usize,
            cached as usize,
            prompt_len as usize,
            self.block_size(id),
        )
    }

    /// `id`'s block size as its events say, or vLLM's default before it published a block.
    fn block_size(&self, id: EndpointId) -> usize {
        self.index
            .read()
            .stats(id)
            .and_then(|stats| stats.block_size)
            .map_or(ASSUMED_BLOCK_SIZE, |size| size as usize)
    }

    /// What `/admin/endpoints` and `/metrics` show of `id`'s subscriber.
    pub(super) fn status(
        &self,
        source: &KvEventsSource,
        handle: &SubscriberHandle,
        now: Instant,
    ) -> KvEventsStatus {
        let index = self
            .index
            .read()
            .stats(handle.endpoint())
            .unwrap_or_default();
        let counters = handle.counters();
        let count = Counters::get;
        KvEventsStatus {
            events: source.events.clone(),
            replay: source.replay.clone(),
            topic: source.topic.clone(),
            applied_seq: *handle.applied().borrow(),
            stale: handle.is_stale(now),
            blocks: index.blocks,
            block_size: index.block_size,
            batches: count(&counters.batches),
            events_applied: count(&counters.events),
            skipped_events: count(&counters.skipped_events),
            malformed: count(&counters.malformed),
            gaps: count(&counters.gaps),
            replays: count(&counters.replays),
            replay_failures: count(&counters.replay_failures),
            clears: count(&counters.clears),
            disconnects: count(&counters.disconnects),
            index: IndexCounts::from(index),
        }
    }

    /// The heap the whole index holds.
    pub(super) fn heap_bytes(&self) -> usize {
        self.index.read().heap_bytes()
    }
}

impl std::fmt::Debug for KvCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvCache")
            .field("config", &self.config)
            .field("subscribed", &self.subscribed)
            .finish_non_exhaustive()
    }
}

/// One endpoint's part: where it publishes, and its running subscriber.
pub(super) struct EndpointKv {
    pub(super) source: Option<KvEventsSource>,
    subscription: Mutex<Option<Subscription>>,
}

impl EndpointKv {
    pub(super) fn new(source: Option<KvEventsSource>) -> Self {
        EndpointKv {
            source,
            subscription: Mutex::new(None),
        }
    }

    /// The running subscriber's handle.
    pub(super) fn handle(&self) -> Option<SubscriberHandle> {
        self.subscription
            .lock()
            .as_ref()
            .map(|s| s.handle().clone())
    }

    /// The engine may have restarted: its index is cleared and rebuilt.
    pub(super) fn resync(&self, reason: ResyncReason) {
        if let Some(handle) = self.handle() {
            handle.resync(reason);
        }
    }
}

impl std::fmt::Debug for EndpointKv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EndpointKv")
            .field("source", &self.source)
            .field("subscribed", &self.subscription.lock().is_some())
            .finish()
    }
}

/// An endpoint's KV event state, as `/admin/endpoints` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct KvEventsStatus {
    pub events: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replay: Option<String>,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub topic: String,
    /// The sequence number of the last batch applied; `None` after a clear until the next.
    pub applied_seq: Option<u64>,
    /// Served prompts and then published nothing for `kv_events_stale_after`: not trusted.
    pub stale: bool,
    /// Blocks indexed now.
    pub blocks: usize,
    pub block_size: Option<u32>,
    /// Batches applied, live or replayed.
    pub batches: u64,
    pub events_applied: u64,
    pub skipped_events: u64,
    pub malformed: u64,
    pub gaps: u64,
    pub replays: u64,
    pub replay_failures: u64,
    /// Times the endpoint's blocks were dropped to be rebuilt.
    pub clears: u64,
    pub disconnects: u64,
    /// What the index did with the events.
    pub index: IndexCounts,
}

/// [`EndpointStats`]' counters, since the endpoint was first seen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct IndexCounts {
    pub stored: u64,
    pub removed: u64,
    pub evicted: u64,
    pub unplaced: u64,
    pub skipped: u64,
}

impl From<EndpointStats> for IndexCounts {
    fn from(stats: EndpointStats) -> Self {
        IndexCounts {
            stored: stats.stored,
            removed: stats.removed,
            evicted: stats.evicted,
            unplaced: stats.unplaced,
            skipped: stats.skipped,
        }
    }
}
