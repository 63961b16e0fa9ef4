//! The cluster's view of its engines' KV caches: one subscriber per endpoint that publishes
//! KV events (`kv_events`), all writing the one shared index, and what a request reads from
//! it: each endpoint's cached prefix of the request's prompt.
//!
//! An engine with several data-parallel ranks (`kv_events_dp_size`) publishes per rank, each
//! a cache of its own: each rank gets its own subscriber and index (rank 0's is the one index
//! single-rank endpoints share), and the endpoint's cached prefix is the largest over its
//! trusted ranks, the request then pinned to a rank holding it ([`RankPins`], sent as vLLM's
//! `X-data-parallel-rank`). Where no pin can be sent (`switchyard epp` answers with an
//! endpoint only), it is the smallest: what the rank the engine picks holds at least.
//!
//! Zero cost without events: while no endpoint has a subscriber, a snapshot does no lookup
//! and hashes nothing. With events, one lookup per attempt covers every trusted endpoint. An
//! endpoint whose index is stale (it served a prompt of at least a block and published nothing
//! for `kv_events_stale_after`) shows `None` and is left out of the lookup, as is one without
//! events: a policy cannot tell a cold cache from an unknown one, and must not mistake the
//! second for the first.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::{Mutex, RwLock};
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
    /// Single-rank endpoints' blocks, and rank 0's of those with several.
    index: SharedIndex,
    /// Rank r's blocks at r - 1, for endpoints with several DP ranks; grown as they subscribe.
    rank_indexes: RwLock<Vec<SharedIndex>>,
    config: SubscriberConfig,
    /// Endpoints with a running subscriber.
    subscribed: AtomicUsize,
}

impl KvCache {
    pub(super) fn new(config: SubscriberConfig) -> Self {
        KvCache {
            index: shared_index(switchyard_kv_index::DEFAULT_BLOCKS_PER_ENDPOINT),
            rank_indexes: RwLock::new(Vec::new()),
            config,
            subscribed: AtomicUsize::new(0),
        }
    }

    /// Whether any endpoint publishes: the request path skips everything else when none does.
    pub(super) fn is_active(&self) -> bool {
        self.subscribed.load(Ordering::Acquire) > 0
    }

    /// Starts `id`'s subscribers (one per DP rank) when it has a source and none runs yet
    /// (on the current runtime).
    pub(super) fn subscribe(&self, id: EndpointId, endpoint: &EndpointKv) {
        let Some(source) = &endpoint.source else {
            return;
        };
        let mut running = endpoint.subscriptions.lock();
        if running.is_none() {
            let ranks = endpoint.ranks(self.config.dp_size);
            let subscriptions: Vec<Subscription> = (0..ranks)
                .map(|rank| {
                    let source = if ranks == 1 {
                        source.clone()
                    } else {
                        source.for_rank(rank)
                    };
                    spawn(id, source, self.config, self.rank_index(rank))
                })
                .collect();
            *running = Some(Subscriptions::new(subscriptions));
            self.subscribed.fetch_add(1, Ordering::AcqRel);
            tracing::info!(endpoint = id, events = %source.events, ranks, "KV events: subscribed");
        }
    }

    /// Stops `id`'s subscribers and forgets its blocks: the endpoint left.
    pub(super) fn unsubscribe(&self, id: EndpointId, endpoint: &EndpointKv) {
        if let Some(subscriptions) = endpoint.subscriptions.lock().take() {
            self.subscribed.fetch_sub(1, Ordering::AcqRel);
            for rank in 0..subscriptions.handles.len() {
                self.rank_index(rank as u32).write().remove_endpoint(id);
            }
        }
    }

    /// DP rank `rank`'s index (rank 0's is every single-rank endpoint's too), made on first
    /// use.
    fn rank_index(&self, rank: u32) -> SharedIndex {
        let Some(at) = (rank as usize).checked_sub(1) else {
            return self.index.clone();
        };
        if let Some(index) = self.rank_indexes.read().get(at) {
            return index.clone();
        }
        let mut indexes = self.rank_indexes.write();
        while indexes.len() <= at {
            indexes.push(shared_index(
                switchyard_kv_index::DEFAULT_BLOCKS_PER_ENDPOINT,
            ));
        }
        indexes[at].clone()
    }

    /// Fills each endpoint's `cached_prefix` for `prompt`: what its index holds when it has a
    /// subscriber whose index is trusted now, else `None`. For an endpoint with several DP
    /// ranks, the largest over its trusted ranks when `pinning` (the rank to pin the request
    /// to is then in the pins; none where every rank is trusted and holds it), else the
    /// smallest.
    pub(super) fn fill(
        &self,
        snapshot: &mut [EndpointSnapshot],
        handles: &[Option<RankHandles>],
        prompt: &[u32],
        now: Instant,
        pinning: bool,
    ) -> RankPins {
        let ranks = handles.iter().flatten().map(|h| h.len()).max().unwrap_or(0);
        let mut found: Vec<Option<RankPrefixes>> = vec![None; snapshot.len()];
        for rank in 0..ranks {
            // Untrusted endpoints stay out of the walk: a stale one holding a long prefix
            // would keep it going for nothing.
            let trusted: Vec<EndpointId> = snapshot
                .iter()
                .zip(handles)
                .filter(|(_, handles)| {
                    handles
                        .as_ref()
                        .and_then(|h| h.get(rank))
                        .is_some_and(|h| !h.is_stale(now))
                })
                .map(|(endpoint, _)| endpoint.id)
                .collect();
            if trusted.is_empty() {
                continue;
            }
            let matches = self.rank_index(rank as u32).read().lookup_among(
                prompt,
                Adapter::Base,
                MediumSet::GPU,
                |id| trusted.contains(&id),
            );
            for (endpoint, found) in snapshot.iter().zip(&mut found) {
                if !trusted.contains(&endpoint.id) {
                    continue;
                }
                // Sorted by endpoint; an endpoint without events yet holds nothing.
                let tokens = matches
                    .binary_search_by_key(&endpoint.id, |m| m.endpoint)
                    .map_or(0, |at| matches[at].tokens);
                let tokens = u32::try_from(tokens).unwrap_or(u32::MAX);
                RankPrefixes::add(found, rank as u32, tokens);
            }
        }
        let mut pins = RankPins::default();
        for ((endpoint, found), handles) in snapshot.iter_mut().zip(found).zip(handles) {
            let Some(found) = found else { continue };
            let ranks = handles.as_ref().map_or(1, |h| h.len()) as u32;
            endpoint.cached_prefix = Some(if pinning || ranks == 1 {
                found.most
            } else {
                found.least
            });
            if pinning && ranks > 1 && found.holding_most < ranks {
                pins.0.push((endpoint.id, found.rank));
            }
        }
        pins
    }

    /// The endpoint was sent a prompt of `prompt_len` tokens (pinned to DP rank `pinned`, if
    /// it was): from a block on, the rank that got it must publish what it stored, or its index
    /// goes stale. Unpinned on an endpoint with several ranks, the engine picked one the router
    /// cannot name: none is held to publishing.
    pub(super) fn note_served(
        &self,
        handles: &RankHandles,
        pinned: Option<u32>,
        prompt_len: usize,
        now: Instant,
    ) {
        let handle = match (handles.len(), pinned) {
            (1, _) => handles.first(),
            (_, Some(rank)) => handles.get(rank as usize),
            (_, None) => None,
        };
        if let Some(handle) = handle
            && prompt_len >= self.block_size(handle.endpoint())
        {
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

    /// `id`'s block size as its events say (any of its DP ranks': they run one model), or
    /// vLLM's default before it published a block.
    fn block_size(&self, id: EndpointId) -> usize {
        let known = |index: &SharedIndex| index.read().stats(id).and_then(|s| s.block_size);
        known(&self.index)
            .or_else(|| self.rank_indexes.read().iter().find_map(known))
            .map_or(ASSUMED_BLOCK_SIZE, |size| size as usize)
    }

    /// What `/admin/endpoints` and `/metrics` show of an endpoint's subscribers: rank 0's
    /// (the only one's), with every other rank's in `dp_ranks`.
    pub(super) fn status(
        &self,
        source: &KvEventsSource,
        handles: &RankHandles,
        now: Instant,
    ) -> Option<KvEventsStatus> {
        let (first, others) = handles.split_first()?;
        let first_source = if others.is_empty() {
            source.clone()
        } else {
            source.for_rank(0)
        };
        let mut status = self.rank_status(&first_source, first, 0, now);
        status.dp_ranks = others
            .iter()
            .zip(1..)
            .map(|(handle, rank)| self.rank_status(&source.for_rank(rank), handle, rank, now))
            .collect();
        Some(status)
    }

    fn rank_status(
        &self,
        source: &KvEventsSource,
        handle: &SubscriberHandle,
        rank: u32,
        now: Instant,
    ) -> KvEventsStatus {
        let index = self
            .rank_index(rank)
            .read()
            .stats(handle.endpoint())
            .unwrap_or_default();
        let counters = handle.counters();
        let count = Counters::get;
        KvEventsStatus {
            events: source.events.clone(),
            replay: source.replay.clone(),
            topic: source.topic.clone(),
            dp_rank: source.rank,
            applied_seq: *handle.applied().borrow(),
            stale: handle.is_stale(now),
            blocks: index.blocks,
            block_size: index.block_size,
            batches: count(&counters.batches),
            events_applied: count(&counters.events),
            skipped_events: count(&counters.skipped_events),
            malformed: count(&counters.malformed),
            rank_mismatches: count(&counters.rank_mismatches),
            gaps: count(&counters.gaps),
            replays: count(&counters.replays),
            replay_failures: count(&counters.replay_failures),
            clears: count(&counters.clears),
            disconnects: count(&counters.disconnects),
            index: IndexCounts::from(index),
            dp_ranks: Vec::new(),
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

/// One endpoint's part: where it publishes, and its running subscribers.
pub(super) struct EndpointKv {
    /// Where rank 0 publishes (every rank's sockets follow from it).
    pub(super) source: Option<KvEventsSource>,
    /// `kv_events_dp_size`, as configured.
    pub(super) dp_size: Option<u32>,
    subscriptions: Mutex<Option<Subscriptions>>,
}

/// An endpoint's subscribers, one per DP rank, and their handles as the request path takes
/// them (one `Arc` clone).
struct Subscriptions {
    _running: Vec<Subscription>,
    handles: RankHandles,
}

impl Subscriptions {
    fn new(running: Vec<Subscription>) -> Self {
        let handles = running.iter().map(|s| s.handle().clone()).collect();
        Subscriptions {
            _running: running,
            handles,
        }
    }
}

/// An endpoint's subscriber handles, by DP rank (one for a single-rank endpoint).
pub(super) type RankHandles = Arc<[SubscriberHandle]>;

/// Which DP rank each endpoint with several holds a request's prompt on, where the request
/// must be pinned to it (`X-data-parallel-rank`) for its cached prefix to hold.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RankPins(Vec<(EndpointId, u32)>);

impl FromIterator<(EndpointId, u32)> for RankPins {
    fn from_iter<I: IntoIterator<Item = (EndpointId, u32)>>(pins: I) -> Self {
        RankPins(pins.into_iter().collect())
    }
}

impl RankPins {
    /// The rank a request sent to `endpoint` must be pinned to, if any.
    pub fn rank(&self, endpoint: EndpointId) -> Option<u32> {
        self.0
            .iter()
            .find_map(|&(id, rank)| (id == endpoint).then_some(rank))
    }
}

/// One endpoint's cached prefix over its trusted ranks: the most, a rank holding it (drawn
/// evenly among those that do, so that a prefix every rank holds spreads its requests), how
/// many do, and the least.
#[derive(Debug, Clone, Copy)]
struct RankPrefixes {
    most: u32,
    rank: u32,
    holding_most: u32,
    least: u32,
}

impl RankPrefixes {
    fn add(found: &mut Option<RankPrefixes>, rank: u32, tokens: u32) {
        let Some(found) = found else {
            *found = Some(RankPrefixes {
                most: tokens,
                rank,
                holding_most: 1,
                least: tokens,
            });
            return;
        };
        found.least = found.least.min(tokens);
        if tokens > found.most {
            (found.most, found.rank, found.holding_most) = (tokens, rank, 1);
        } else if tokens == found.most {
            found.holding_most += 1;
            // Reservoir sampling: each rank holding the most is kept with equal chance.
            if rand::random_range(0..found.holding_most) == 0 {
                found.rank = rank;
            }
        }
    }
}

impl EndpointKv {
    pub(super) fn new(source: Option<KvEventsSource>, dp_size: Option<u32>) -> Self {
        EndpointKv {
            source,
            dp_size,
            subscriptions: Mutex::new(None),
        }
    }

    /// How many DP ranks publish: as configured, else the router's `default`.
    fn ranks(&self, default: u32) -> u32 {
        self.dp_size.unwrap_or(default).max(1)
    }

    /// The running subscribers' handles, by rank.
    pub(super) fn handles(&self) -> Option<RankHandles> {
        self.subscriptions
            .lock()
            .as_ref()
            .map(|s| s.handles.clone())
    }

    /// The engine may have restarted: every rank's index is cleared and rebuilt.
    pub(super) fn resync(&self, reason: ResyncReason) {
        for handle in self.handles().iter().flat_map(|h| h.iter()) {
            handle.resync(reason);
        }
    }
}

impl std::fmt::Debug for EndpointKv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EndpointKv")
            .field("source", &self.source)
            .field("dp_size", &self.dp_size)
            .field("subscribed", &self.subscriptions.lock().is_some())
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
    /// The DP rank publishing here, for an endpoint with several.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dp_rank: Option<u32>,
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
    /// Batches stamped with another DP rank than this socket's, dropped.
    #[serde(skip_serializing_if = "is_zero")]
    pub rank_mismatches: u64,
    pub gaps: u64,
    pub replays: u64,
    pub replay_failures: u64,
    /// Times the endpoint's blocks were dropped to be rebuilt.
    pub clears: u64,
    pub disconnects: u64,
    /// What the index did with the events.
    pub index: IndexCounts,
    /// Ranks 1 and up of an endpoint with several, each as its own subscriber.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub dp_ranks: Vec<KvEventsStatus>,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
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
