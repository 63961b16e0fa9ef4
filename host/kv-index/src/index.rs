//! [`KvIndex`]: every endpoint's cached blocks, written from their events, read per request.

mod endpoint;
mod holders;
mod huge_pages;
mod table;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::collections::hash_map::Entry;

use foldhash::fast::FixedState;
use switchyard_contract::EndpointId;
use switchyard_wire::kv_events::{BlockHash, BlockRemoved, BlockStored, Event, EventBatch, Value};
use xxhash_rust::xxh3::xxh3_64;

use crate::key::{Adapter, BlockKey, KeyChain};
use crate::medium::{Medium, MediumSet};
use crate::stats::EndpointStats;
use endpoint::EndpointBlocks;
use holders::Holders;

/// The default cap on one endpoint's indexed blocks: 100k blocks of 16 tokens is 1.6M tokens,
/// more than the KV pool of any one engine we front.
pub const DEFAULT_BLOCKS_PER_ENDPOINT: usize = 100_000;

/// Blocks whose keys a walk computes before probing them: at first, then at most. Each
/// stretch ends waiting on the last of its probes' misses, so the stretches grow; but a short
/// first one keeps a walk that stops early (a new prompt past its system prompt) short, and
/// a bounded one keeps its lines in the L1 cache until probed. A bisection's first probe is
/// at the first stretch's end too, and its next ones at doubling depths.
const FIRST_STRETCH: usize = 32;
const LONGEST_STRETCH: usize = 256;

/// Which prompt prefixes each endpoint's KV cache holds.
pub struct KvIndex {
    holders: Holders,
    /// Found once per event: foldhash, not SipHash (ids are ours, not an attacker's).
    endpoints: HashMap<EndpointId, EndpointBlocks, FixedState>,
    /// Slot → endpoint; a removed endpoint's slot is reused.
    slots: Vec<Option<EndpointId>>,
    blocks_per_endpoint: usize,
}

/// How far [`KvIndex::apply_batch_step`] got into a batch.
#[derive(Debug, Clone, Copy, Default)]
pub struct BatchProgress {
    /// The next event.
    event: usize,
    /// Its blocks already applied.
    block: usize,
    /// In a stored event cut short, the key of its last block stored: the next one's parent.
    parent: Option<BlockKey>,
}

/// How much of a prompt one endpoint holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefixMatch {
    pub endpoint: EndpointId,
    /// Leading tokens cached, a multiple of the endpoint's block size.
    pub tokens: usize,
}

impl Default for KvIndex {
    fn default() -> Self {
        Self::new(DEFAULT_BLOCKS_PER_ENDPOINT)
    }
}

impl KvIndex {
    /// An empty index keeping at most `blocks_per_endpoint` blocks for each endpoint.
    pub fn new(blocks_per_endpoint: usize) -> Self {
        Self {
            holders: Holders::default(),
            endpoints: HashMap::default(),
            slots: Vec::new(),
            blocks_per_endpoint,
        }
    }

    /// Applies one batch of `endpoint`'s events, in order.
    pub fn apply_batch(&mut self, endpoint: EndpointId, batch: &EventBatch) {
        for event in &batch.events {
            self.apply(endpoint, event);
        }
    }

    /// Applies `batch` from `progress` on, stopping once about `blocks` blocks have been
    /// stored or removed (at least one); whether the batch is done. A caller that locks the
    /// index releases the lock between steps, so that a long batch (a step's prefills) does not
    /// hold lookups back. Between steps the index is as if the engine had published the
    /// batch's events up to there, a long event as several short ones. A clear is one step
    /// whatever the endpoint holds.
    pub fn apply_batch_step(
        &mut self,
        endpoint: EndpointId,
        batch: &EventBatch,
        progress: &mut BatchProgress,
        blocks: usize,
    ) -> bool {
        let mut budget = blocks.max(1);
        while let Some(event) = batch.events.get(progress.event) {
            if budget == 0 {
                return false;
            }
            let left = event_blocks(event).saturating_sub(progress.block).max(1);
            if !self.apply_from(endpoint, event, progress, budget) {
                return false;
            }
            budget = budget.saturating_sub(left);
        }
        true
    }

    /// Applies one of `endpoint`'s events.
    pub fn apply(&mut self, endpoint: EndpointId, event: &Event) {
        self.apply_from(endpoint, event, &mut BatchProgress::default(), usize::MAX);
    }

    /// Applies `event` from `progress` on, at most `budget` of its blocks; whether it is done
    /// (`progress` then points at the next event).
    fn apply_from(
        &mut self,
        endpoint: EndpointId,
        event: &Event,
        progress: &mut BatchProgress,
        budget: usize,
    ) -> bool {
        let cap = self.blocks_per_endpoint;
        let blocks = match self.endpoints.entry(endpoint) {
            Entry::Occupied(known) => known.into_mut(),
            Entry::Vacant(new) => {
                new.insert(EndpointBlocks::new(take_slot(&mut self.slots, endpoint)))
            }
        };
        let holders = &mut self.holders;
        let stopped = match event {
            Event::BlockStored(stored) => {
                let resume = progress.parent.map(|parent| (progress.block, parent));
                store(blocks, holders, stored, cap, resume, budget)
                    .map(|(block, parent)| (block, Some(parent)))
            }
            Event::BlockRemoved(removed) => {
                remove(blocks, holders, removed, progress.block, budget).map(|block| (block, None))
            }
            Event::AllBlocksCleared => {
                blocks.clear(holders);
                None
            }
        };
        match stopped {
            Some((block, parent)) => {
                (progress.block, progress.parent) = (block, parent);
                false
            }
            None => {
                *progress = BatchProgress {
                    event: progress.event + 1,
                    ..BatchProgress::default()
                };
                true
            }
        }
    }

    /// Drops `endpoint`'s blocks: its engine may have restarted, or events were lost.
    pub fn clear_endpoint(&mut self, endpoint: EndpointId) {
        if let Some(blocks) = self.endpoints.get_mut(&endpoint) {
            blocks.clear(&mut self.holders);
        }
    }

    /// Forgets `endpoint` (it left the cluster); its slot goes to the next newcomer.
    pub fn remove_endpoint(&mut self, endpoint: EndpointId) {
        if let Some(mut blocks) = self.endpoints.remove(&endpoint) {
            blocks.clear(&mut self.holders);
            self.slots[blocks.slot] = None;
        }
    }

    /// For every endpoint with events, how many leading tokens of `tokens` it holds for
    /// `adapter` on `media` (ordered by endpoint id). Per block size in use (one, in a
    /// uniform fleet), on the GPU: a bisection for where each endpoint stops matching,
    /// chaining the prompt's keys only as far as some endpoint matches; counting other tiers
    /// too, a walk over the prompt's blocks narrowing the endpoints still matching, stopping
    /// when none is.
    pub fn lookup(
        &self,
        tokens: &[u32],
        adapter: Adapter<'_>,
        media: MediumSet,
    ) -> Vec<PrefixMatch> {
        self.lookup_among(tokens, adapter, media, |_| true)
    }

    /// [`Self::lookup`] for the endpoints `among` accepts only: the others are left out of the
    /// search (however much of the prompt they hold, they keep it going no further) and of
    /// the result.
    pub fn lookup_among(
        &self,
        tokens: &[u32],
        adapter: Adapter<'_>,
        media: MediumSet,
        among: impl Fn(EndpointId) -> bool,
    ) -> Vec<PrefixMatch> {
        let endpoints: Vec<(EndpointId, &EndpointBlocks)> = self
            .endpoints
            .iter()
            .filter(|&(&endpoint, _)| among(endpoint))
            .map(|(&endpoint, blocks)| (endpoint, blocks))
            .collect();
        let mut matched_blocks = vec![0usize; self.slots.len()];
        let mut block_sizes: Vec<u32> = endpoints
            .iter()
            .filter_map(|(_, blocks)| blocks.block_size)
            .collect();
        block_sizes.sort_unstable();
        block_sizes.dedup();
        for block_size in block_sizes {
            let mut searched = vec![0u64; self.slots.len().div_ceil(64)];
            let mut holes = false;
            for (_, blocks) in &endpoints {
                if blocks.block_size == Some(block_size) && blocks.len() > 0 {
                    searched[blocks.slot / 64] |= 1 << (blocks.slot % 64);
                    holes |= blocks.has_holes();
                }
            }
            // Holes are kept for the GPU: a lookup counting other tiers too walks.
            let bisecting = media == MediumSet::GPU;
            let holes = (bisecting && holes).then_some(&self.holders);
            let mut keys = PromptKeys::new(
                tokens,
                block_size as usize,
                adapter,
                (holes, searched.len()),
            );
            if !bisecting {
                self.walk(&mut keys, media, searched, &mut matched_blocks);
                continue;
            }
            for (word, slots) in searched.into_iter().enumerate() {
                if slots != 0 {
                    self.bisect(&mut keys, word, slots, &mut matched_blocks);
                }
            }
        }
        let mut matches: Vec<PrefixMatch> = endpoints
            .iter()
            .map(|&(endpoint, blocks)| PrefixMatch {
                endpoint,
                tokens: matched_blocks[blocks.slot]
                    * blocks.block_size.map_or(0, |size| size as usize),
            })
            .collect();
        matches.sort_unstable_by_key(|m| m.endpoint);
        matches
    }

    /// What the index knows about `endpoint`'s blocks and did with its events.
    pub fn stats(&self, endpoint: EndpointId) -> Option<EndpointStats> {
        self.endpoints.get(&endpoint).map(|blocks| EndpointStats {
            blocks: blocks.len(),
            block_size: blocks.block_size,
            ..blocks.stats
        })
    }

    /// Distinct (key, slot word) entries a lookup can probe.
    pub fn distinct_keys(&self) -> usize {
        self.holders.len()
    }

    /// The heap the index holds, from its tables' capacities (not counting allocator
    /// overhead).
    pub fn heap_bytes(&self) -> usize {
        self.holders.heap_bytes()
            + self
                .endpoints
                .values()
                .map(EndpointBlocks::heap_bytes)
                .sum::<usize>()
    }

    /// Walks the prompt's blocks for the slots set in `walking`, writing each slot's matched
    /// block count into `matched_blocks`: one probe a block until none of them matches.
    fn walk(
        &self,
        prompt: &mut PromptKeys<'_>,
        media: MediumSet,
        mut walking: Vec<u64>,
        matched_blocks: &mut [usize],
    ) {
        if walking.iter().all(|&slots| slots == 0) {
            return;
        }
        let blocks = prompt.blocks();
        // A stretch of keys (a chain of hashes, no memory), then their lines read into the
        // cache together, then their probes, then the narrowing: reads that wait on nothing
        // else overlap their cache misses (the map is far larger than any cache).
        let mut held = Vec::with_capacity(LONGEST_STRETCH * walking.len());
        let (mut walked, mut stretch) = (0, FIRST_STRETCH);
        while walked < blocks {
            let end = (walked + stretch).min(blocks);
            prompt.extend_to(end);
            let keys = &prompt.keys[walked..end];
            for (word, &slots) in walking.iter().enumerate() {
                if slots != 0 {
                    self.holders.touch(keys.iter().copied(), word, media);
                }
            }
            held.clear();
            for (word, &slots) in walking.iter().enumerate() {
                held.extend(keys.iter().map(|&key| match slots {
                    0 => 0,
                    _ => self.holders.mask(key, word, media),
                }));
            }
            for i in 0..keys.len() {
                let depth = walked + i;
                let mut any = false;
                for (word, slots) in walking.iter_mut().enumerate() {
                    let held = held[word * keys.len() + i];
                    for_each_slot(*slots & !held, word, |slot| matched_blocks[slot] = depth);
                    *slots &= held;
                    any |= *slots != 0;
                }
                if !any {
                    return;
                }
            }
            walked = end;
            stretch = (stretch * 2).min(LONGEST_STRETCH);
        }
        for (word, slots) in walking.iter().enumerate() {
            for_each_slot(*slots, word, |slot| matched_blocks[slot] = blocks);
        }
    }

    /// Finds where each of `word`'s `slots` stops matching the prompt on the GPU. Up to its
    /// first hole on the prompt, a slot holding a block of it holds every block before it (its
    /// parent is held, or is a hole), so the slots holding the first `depth` blocks, less those
    /// with a hole before, shrink as `depth` grows; and between two depths where the same
    /// slots hold, no slot stops. Probes at depths 32, 64, 128, ...
    /// find a depth no slot reaches (a prompt is hashed little further than it is held), and
    /// bisecting between probes that differ finds each stop: about log2(blocks) probes per
    /// distinct depth where slots stop, instead of one per block up to the deepest.
    fn bisect(
        &self,
        prompt: &mut PromptKeys<'_>,
        word: usize,
        slots: u64,
        matched_blocks: &mut [usize],
    ) {
        let blocks = prompt.blocks();
        // Every slot holds the first 0 blocks.
        let mut known = (0, slots);
        let mut depth = FIRST_STRETCH.min(blocks);
        while known.0 < blocks {
            prompt.extend_to(depth);
            let holding = self.holding(prompt, word, depth, known.1, 0);
            self.narrow(prompt, word, known, (depth, holding), matched_blocks);
            if holding == 0 {
                return;
            }
            known = (depth, holding);
            depth = (depth * 2).min(blocks);
        }
        for_each_slot(known.1, word, |slot| matched_blocks[slot] = blocks);
    }

    /// Between `lo` blocks, which the slots of `lo_holding` hold, and `hi`, which those of
    /// `hi_holding` (a subset) hold, sets the matched blocks of each slot that stops there.
    fn narrow(
        &self,
        prompt: &PromptKeys<'_>,
        word: usize,
        (lo, lo_holding): (usize, u64),
        (hi, hi_holding): (usize, u64),
        matched_blocks: &mut [usize],
    ) {
        if lo_holding == hi_holding {
            return;
        }
        if hi - lo == 1 {
            for_each_slot(lo_holding & !hi_holding, word, |slot| {
                matched_blocks[slot] = lo
            });
            return;
        }
        let mid = lo + (hi - lo) / 2;
        let mid_holding = self.holding(prompt, word, mid, lo_holding, hi_holding);
        self.narrow(
            prompt,
            word,
            (lo, lo_holding),
            (mid, mid_holding),
            matched_blocks,
        );
        self.narrow(
            prompt,
            word,
            (mid, mid_holding),
            (hi, hi_holding),
            matched_blocks,
        );
    }

    /// Which slots of `word` hold the prompt's first `depth` blocks (at least one, chained
    /// already): those holding the last of them with no hole before it, given that they are
    /// among `at_most` and include `at_least`. The bounds are the order a prompt's depths
    /// have; clamped to them, colliding keys (which could break it) still leave each slot one
    /// depth.
    fn holding(
        &self,
        prompt: &PromptKeys<'_>,
        word: usize,
        depth: usize,
        at_most: u64,
        at_least: u64,
    ) -> u64 {
        let held = self
            .holders
            .mask(prompt.keys[depth - 1], word, MediumSet::GPU);
        (held & !prompt.holed(depth, word) & at_most) | at_least
    }
}

/// A prompt's block keys for one block size, chained as far as a lookup has needed them;
/// and where the lookup bisects endpoints with holes, the slots with one so far.
struct PromptKeys<'p> {
    blocks: std::slice::ChunksExact<'p, u32>,
    chain: KeyChain,
    keys: Vec<BlockKey>,
    count: usize,
    /// Where to look each key up as a hole; `None` when no endpoint searched has any.
    holes: Option<&'p Holders>,
    words: usize,
    /// Per key, `words` words: the slots with a hole at or before it.
    holed: Vec<u64>,
}

impl<'p> PromptKeys<'p> {
    fn new(
        tokens: &'p [u32],
        block_size: usize,
        adapter: Adapter<'_>,
        (holes, words): (Option<&'p Holders>, usize),
    ) -> Self {
        let blocks = tokens.chunks_exact(block_size);
        Self {
            count: blocks.len(),
            blocks,
            chain: KeyChain::from(BlockKey::root(adapter)),
            keys: Vec::new(),
            holes,
            words,
            holed: Vec::new(),
        }
    }

    /// The prompt's full blocks.
    fn blocks(&self) -> usize {
        self.count
    }

    /// Chains the keys of the first `end` blocks (at most all of them).
    fn extend_to(&mut self, end: usize) {
        while self.keys.len() < end {
            let Some(block) = self.blocks.next() else {
                return;
            };
            let key = self.chain.next(block);
            self.keys.push(key);
            if let Some(holders) = self.holes {
                let before = self.holed.len().checked_sub(self.words);
                for word in 0..self.words {
                    let earlier = before.map_or(0, |at| self.holed[at + word]);
                    self.holed.push(earlier | holders.holes(key, word));
                }
            }
        }
    }

    /// The slots of `word` with a hole among the first `depth` blocks (chained already).
    fn holed(&self, depth: usize, word: usize) -> u64 {
        match self.holes {
            Some(_) => self.holed[(depth - 1) * self.words + word],
            None => 0,
        }
    }
}

/// The first free slot, now `endpoint`'s.
fn take_slot(slots: &mut Vec<Option<EndpointId>>, endpoint: EndpointId) -> usize {
    let slot = slots.iter().position(Option::is_none).unwrap_or_else(|| {
        slots.push(None);
        slots.len() - 1
    });
    slots[slot] = Some(endpoint);
    slot
}

fn for_each_slot(mut bits: u64, word: usize, mut f: impl FnMut(usize)) {
    while bits != 0 {
        f(word * 64 + bits.trailing_zeros() as usize);
        bits &= bits - 1;
    }
}

/// Stores `event`'s blocks, at most `budget` of them, from the start or, resuming, from block
/// `from` after `parent` (the key of the block before); where it stopped (the next block and
/// the key before it), or `None` when the event is done.
fn store(
    blocks: &mut EndpointBlocks,
    holders: &mut Holders,
    event: &BlockStored,
    cap: usize,
    resume: Option<(usize, BlockKey)>,
    budget: usize,
) -> Option<(usize, BlockKey)> {
    let count = event.block_hashes.len() as u64;
    let adapter = adapter_of(event);
    let (from, parent) = match resume {
        Some(resume) => resume,
        None => (0, placed_parent(blocks, holders, event, adapter)?),
    };
    let medium = Medium::of(event.medium.as_deref());
    let mut chain = KeyChain::from(parent);
    // The key before the next block, `None` before a prompt's first.
    let mut before = (parent != BlockKey::root(adapter)).then_some(parent);
    let tokens = event.token_ids.chunks_exact(event.block_size as usize);
    for (i, (hash, tokens)) in event.block_hashes.iter().zip(tokens).enumerate().skip(from) {
        if let Some(last) = before
            && i - from == budget
        {
            return Some((i, last));
        }
        // This block and every later one in the event chain from keys a prompt cannot
        // reproduce; later events naming them as parents find them unplaced.
        if has_foreign_extra_keys(event, i, adapter) {
            blocks.stats.skipped += count - i as u64;
            return None;
        }
        let key = chain.next(tokens);
        blocks.store(holders, hash_bits(hash), (key, before), medium, cap);
        before = Some(key);
    }
    None
}

/// The key `event`'s first block chains from, once its group and block size are checked;
/// `None` (counted) when the event's blocks take no part or cannot be placed.
fn placed_parent(
    blocks: &mut EndpointBlocks,
    holders: &mut Holders,
    event: &BlockStored,
    adapter: Adapter<'_>,
) -> Option<BlockKey> {
    let count = event.block_hashes.len() as u64;
    // Hybrid models publish each KV group; prefix matching is about full attention, group 0.
    if event.group_idx.unwrap_or(0) != 0 {
        blocks.stats.skipped += count;
        return None;
    }
    match blocks.block_size {
        None => blocks.block_size = Some(event.block_size),
        Some(size) if size == event.block_size => {}
        // SGLang publishes a page that is not full with its short length: it never matches.
        Some(size) if event.block_size < size => {
            blocks.stats.skipped += count;
            return None;
        }
        // The first events were such short pages: the engine's blocks are these. What was
        // indexed under the shorter size can never match a lookup chunked by this one.
        Some(_) => {
            blocks.clear(holders);
            blocks.block_size = Some(event.block_size);
        }
    }
    match &event.parent_block_hash {
        None => Some(BlockKey::root(adapter)),
        Some(hash) => {
            let key = blocks.key_of(hash_bits(hash));
            if key.is_none() {
                blocks.stats.unplaced += count;
            }
            key
        }
    }
}

/// Removes `event`'s blocks from block `from` on, at most `budget` of them; where it stopped,
/// or `None` when the event is done.
fn remove(
    blocks: &mut EndpointBlocks,
    holders: &mut Holders,
    event: &BlockRemoved,
    from: usize,
    budget: usize,
) -> Option<usize> {
    if event.group_idx.unwrap_or(0) != 0 {
        return None;
    }
    let medium = Medium::of(event.medium.as_deref());
    for (i, hash) in event.block_hashes.iter().enumerate().skip(from) {
        if i - from == budget {
            return Some(i);
        }
        blocks.remove(holders, hash_bits(hash), medium);
    }
    None
}

/// The blocks an event stores or removes.
fn event_blocks(event: &Event) -> usize {
    match event {
        Event::BlockStored(stored) => stored.block_hashes.len(),
        Event::BlockRemoved(removed) => removed.block_hashes.len(),
        Event::AllBlocksCleared => 0,
    }
}

/// `lora_name` when the engine publishes it, else the deprecated `lora_id`.
fn adapter_of(event: &BlockStored) -> Adapter<'_> {
    match (&event.lora_name, event.lora_id) {
        (Some(name), _) => Adapter::Lora(name),
        (None, Some(id)) => Adapter::LoraId(id),
        (None, None) => Adapter::Base,
    }
}

/// Whether block `i`'s cache identity depends on more than its tokens and adapter. vLLM's
/// extra keys start with the adapter (its name, or its id in older versions), which the key's
/// root already holds; anything after it (multimodal hashes, `cache_salt`, prompt-embedding
/// digests) a request's tokens cannot reproduce, so such a block must match no request.
fn has_foreign_extra_keys(event: &BlockStored, i: usize, adapter: Adapter<'_>) -> bool {
    let Some(Some(keys)) = event.extra_keys.as_ref().and_then(|entries| entries.get(i)) else {
        return false;
    };
    let names_adapter = |value: &Value| match (adapter, value) {
        (Adapter::Lora(name), Value::String(s)) => s.as_str() == Some(name),
        (Adapter::LoraId(id), Value::Integer(n)) => n.as_i64() == Some(id),
        _ => false,
    };
    match keys.split_first() {
        None => false,
        Some((first, rest)) => !(names_adapter(first) && rest.is_empty()),
    }
}

/// An engine hash as the index stores it: the integer's bits, or a digest folded to 64 bits.
fn hash_bits(hash: &BlockHash) -> u64 {
    match hash {
        BlockHash::Int(bits) => *bits,
        BlockHash::Bytes(bytes) => xxh3_64(bytes),
    }
}

/// The bytes of a hashbrown table with `map`'s capacity: buckets (a power of two, at most
/// 7/8 full) of one entry and one control byte each, and a group of trailing control bytes.
fn map_heap_bytes<K, V, S>(map: &HashMap<K, V, S>) -> usize {
    if map.capacity() == 0 {
        return 0;
    }
    let buckets = (map.capacity() * 8 / 7).next_power_of_two();
    buckets * (std::mem::size_of::<(K, V)>() + 1) + 16
}
