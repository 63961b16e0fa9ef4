//! One endpoint's blocks: its engine's hashes → keys (to place children and apply removals),
//! the media each block is on, and the order they came in, oldest dropped first at the cap.

use std::collections::{HashMap, VecDeque};

use foldhash::fast::FixedState;

use super::holders::Holders;
use crate::key::BlockKey;
use crate::medium::{Medium, MediumSet};
use crate::stats::EndpointStats;

pub(super) struct EndpointBlocks {
    pub(super) slot: usize,
    /// Taken from the events; `None` until the first one.
    pub(super) block_size: Option<u32>,
    /// By engine hash (not key: removals and parents name engine hashes). A hash names one
    /// block at a time: old SGLang hashes a page's tokens alone, so one hash can be stored
    /// again at another place; it then moves there (the index under-reports, never over).
    blocks: HashMap<u64, Block, FixedState>,
    /// (engine hash, stamp) in the order blocks were first stored. An entry whose stamp is not
    /// its block's any more is stale (the block went, or went and came back), and is skipped.
    order: VecDeque<(u64, u32)>,
    next_stamp: u32,
    pub(super) stats: EndpointStats,
}

#[derive(Clone, Copy)]
struct Block {
    key: BlockKey,
    /// Wraps after 2³² stores; stale entries never live that long, because `order` is
    /// compacted whenever it grows past twice the live blocks.
    stamp: u32,
    media: MediumSet,
}

impl EndpointBlocks {
    pub(super) fn new(slot: usize) -> Self {
        Self {
            slot,
            block_size: None,
            blocks: HashMap::default(),
            order: VecDeque::new(),
            next_stamp: 0,
            stats: EndpointStats::default(),
        }
    }

    pub(super) fn len(&self) -> usize {
        self.blocks.len()
    }

    pub(super) fn key_of(&self, hash: u64) -> Option<BlockKey> {
        self.blocks.get(&hash).map(|block| block.key)
    }

    /// Records that the engine holds `key` as `hash` on `medium`, making room under `cap`.
    pub(super) fn store(
        &mut self,
        holders: &mut Holders,
        hash: u64,
        key: BlockKey,
        medium: Medium,
        cap: usize,
    ) {
        if let Some(block) = self.blocks.get_mut(&hash) {
            if block.key == key {
                // Another copy of a block it has (an offload, or a repeat): nothing moves.
                if !block.media.contains(medium) {
                    block.media = block.media.with(medium);
                    holders.set(key, self.slot, medium);
                }
                return;
            }
            self.forget(holders, hash);
        }
        while self.blocks.len() >= cap.max(1) {
            self.evict_oldest(holders);
        }
        let stamp = self.next_stamp;
        self.next_stamp = stamp.wrapping_add(1);
        self.blocks.insert(
            hash,
            Block {
                key,
                stamp,
                media: MediumSet::of(medium),
            },
        );
        self.order.push_back((hash, stamp));
        holders.set(key, self.slot, medium);
        self.stats.stored += 1;
    }

    /// The engine evicted its copy of `hash` on `medium`.
    pub(super) fn remove(&mut self, holders: &mut Holders, hash: u64, medium: Medium) {
        let Some(block) = self.blocks.get_mut(&hash) else {
            return;
        };
        if !block.media.contains(medium) {
            return;
        }
        block.media = block.media.without(medium);
        holders.clear(block.key, self.slot, medium);
        if block.media.is_empty() {
            self.blocks.remove(&hash);
            self.compact_order();
        }
        self.stats.removed += 1;
    }

    /// Drops every block (the slot and block size stay).
    pub(super) fn clear(&mut self, holders: &mut Holders) {
        for block in self.blocks.values() {
            clear_holders(holders, block, self.slot);
        }
        self.blocks.clear();
        self.order.clear();
        self.stats.clears += 1;
    }

    pub(super) fn heap_bytes(&self) -> usize {
        super::map_heap_bytes(&self.blocks)
            + self.order.capacity() * std::mem::size_of::<(u64, u32)>()
    }

    fn forget(&mut self, holders: &mut Holders, hash: u64) {
        if let Some(block) = self.blocks.remove(&hash) {
            clear_holders(holders, &block, self.slot);
        }
    }

    fn evict_oldest(&mut self, holders: &mut Holders) {
        while let Some((hash, stamp)) = self.order.pop_front() {
            if self
                .blocks
                .get(&hash)
                .is_some_and(|block| block.stamp == stamp)
            {
                self.forget(holders, hash);
                self.stats.evicted += 1;
                return;
            }
        }
    }

    fn compact_order(&mut self) {
        if self.order.len() > 2 * self.blocks.len() + 64 {
            let blocks = &self.blocks;
            self.order
                .retain(|(hash, stamp)| blocks.get(hash).is_some_and(|b| b.stamp == *stamp));
        }
    }
}

fn clear_holders(holders: &mut Holders, block: &Block, slot: usize) {
    for medium in Medium::EVERY {
        if block.media.contains(medium) {
            holders.clear(block.key, slot, medium);
        }
    }
}
