//! One endpoint's blocks: in the order they came in, oldest dropped first at the cap, each
//! with its key and the media it is on; and its engine's hashes → their places in that order
//! (to place children and apply removals); and its holes, the keys a lookup may not bisect
//! across (see [`Holders`]).

use std::collections::VecDeque;

use super::holders::Holders;
use super::table::Table;
use crate::key::BlockKey;
use crate::medium::{Medium, MediumSet};
use crate::stats::EndpointStats;

pub(super) struct EndpointBlocks {
    pub(super) slot: usize,
    /// Taken from the events; `None` until the first one.
    pub(super) block_size: Option<u32>,
    /// Blocks in the order they were first stored. A block removed since stays as a gap (no
    /// media) until it reaches the front or the queue is compacted, so that the blocks
    /// behind it keep their places.
    order: VecDeque<Block>,
    /// The place of `order`'s front: a block's place is this plus its index in `order`.
    front: u64,
    /// By engine hash (not key: removals and parents name engine hashes), the block's place.
    /// A hash names one block at a time: old SGLang hashes a page's tokens alone, so one hash
    /// can be stored again at another place; it then moves there (the index under-reports,
    /// never over).
    places: Table,
    /// Its holes in the holders' table: keys not on the GPU (no bit in the holders' GPU
    /// table) with a child there.
    holes: usize,
    /// Per key, how many of the keys held on the GPU have it as their parent: whether the
    /// key is a hole when it is not held.
    children: Table,
    pub(super) stats: EndpointStats,
}

#[derive(Clone, Copy)]
struct Block {
    hash: u64,
    key: BlockKey,
    /// The key of the block before it, unless it is a prompt's first (`first`): the two
    /// fields of an `Option` without its padding (32 bytes a block, not 40).
    parent: BlockKey,
    first: bool,
    /// Empty for a gap.
    media: MediumSet,
}

impl Block {
    fn parent(&self) -> Option<BlockKey> {
        (!self.first).then_some(self.parent)
    }
}

impl EndpointBlocks {
    pub(super) fn new(slot: usize) -> Self {
        Self {
            slot,
            block_size: None,
            order: VecDeque::new(),
            front: 0,
            places: Table::default(),
            holes: 0,
            children: Table::default(),
            stats: EndpointStats::default(),
        }
    }

    pub(super) fn len(&self) -> usize {
        self.places.len()
    }

    /// Whether it has holes (engines evict a chain's blocks from its end: usually not).
    pub(super) fn has_holes(&self) -> bool {
        self.holes > 0
    }

    pub(super) fn key_of(&self, hash: u64) -> Option<BlockKey> {
        self.place_of(hash).map(|at| self.order[at].key)
    }

    /// Records that the engine holds `key`, the block after `parent` (`None`: a prompt's
    /// first), as `hash` on `medium`, making room under `cap`.
    pub(super) fn store(
        &mut self,
        holders: &mut Holders,
        hash: u64,
        (key, parent): (BlockKey, Option<BlockKey>),
        medium: Medium,
        cap: usize,
    ) {
        self.touch_lines_of_store(holders, hash, (key, parent), medium, cap);
        if let Some(at) = self.place_of(hash) {
            let block = self.order[at];
            if block.key == key {
                // Another copy of a block it has (an offload, or a repeat): nothing moves.
                if !block.media.contains(medium) {
                    self.order[at].media = block.media.with(medium);
                    self.hold(holders, block, medium);
                }
                return;
            }
            self.forget(holders, at);
        }
        while self.len() >= cap.max(1) {
            self.evict_oldest(holders);
        }
        self.places
            .insert(hash, self.front + self.order.len() as u64);
        self.make_room_in_order(cap);
        let block = Block {
            hash,
            key,
            parent: parent.unwrap_or(key),
            first: parent.is_none(),
            media: MediumSet::of(medium),
        };
        self.order.push_back(block);
        self.hold(holders, block, medium);
        self.stats.stored += 1;
    }

    /// The engine evicted its copy of `hash` on `medium`.
    pub(super) fn remove(&mut self, holders: &mut Holders, hash: u64, medium: Medium) {
        let Some(at) = self.place_of(hash) else {
            return;
        };
        let block = self.order[at];
        if !block.media.contains(medium) {
            return;
        }
        self.order[at].media = block.media.without(medium);
        self.release(holders, block, medium);
        if self.order[at].media.is_empty() {
            self.places.remove(hash);
            self.compact_order();
        }
        self.stats.removed += 1;
    }

    /// Drops every block (the slot and block size stay).
    pub(super) fn clear(&mut self, holders: &mut Holders) {
        for at in 0..self.order.len() {
            self.release_every_copy(holders, self.order[at]);
        }
        self.order.clear();
        self.places.clear();
        self.stats.clears += 1;
    }

    pub(super) fn heap_bytes(&self) -> usize {
        self.places.heap_bytes()
            + self.children.heap_bytes()
            + self.order.capacity() * size_of::<Block>()
    }

    /// Sets the endpoint's bit for `block` on `medium`, counting what that changes.
    fn hold(&mut self, holders: &mut Holders, block: Block, medium: Medium) {
        if holders.set(block.key, self.slot, medium) && medium == Medium::Gpu {
            self.count_gpu_change(holders, block, true);
        }
    }

    /// Clears the endpoint's bit for `block` on `medium`, counting what that changes.
    fn release(&mut self, holders: &mut Holders, block: Block, medium: Medium) {
        if holders.clear(block.key, self.slot, medium) && medium == Medium::Gpu {
            self.count_gpu_change(holders, block, false);
        }
    }

    fn release_every_copy(&mut self, holders: &mut Holders, block: Block) {
        for medium in Medium::EVERY {
            if block.media.contains(medium) {
                self.release(holders, block, medium);
            }
        }
    }

    /// Keeps `children` and the holes to their definitions, `block`'s key having just come
    /// onto the GPU (`arrived`) or gone from it: it was a hole or becomes one when it has
    /// children there, and its parent, when not held, is a hole while it has any. O(1): an
    /// evicted middle block is a hole whatever follows it.
    fn count_gpu_change(&mut self, holders: &mut Holders, block: Block, arrived: bool) {
        // Arriving, it can have children only as a hole: with none, no need to look.
        if (!arrived || self.holes > 0) && self.children.get(block.key.bits()).is_some() {
            self.mark_hole(holders, block.key, !arrived);
        }
        let Some(parent) = block.parent() else {
            return;
        };
        let children = self.count_child(parent, arrived);
        // The first child arrived, or the last went, under a parent not held.
        if children == u64::from(arrived) && !holders.holds_on_gpu(parent, self.slot) {
            self.mark_hole(holders, parent, arrived);
        }
    }

    fn mark_hole(&mut self, holders: &mut Holders, key: BlockKey, hole: bool) {
        holders.set_hole(key, self.slot, hole);
        // Saturating: only colliding keys (one key, two parents) could unbalance the count.
        self.holes = match hole {
            true => self.holes + 1,
            false => self.holes.saturating_sub(1),
        };
    }

    /// Counts a child of `parent` in or out; how many it has now.
    fn count_child(&mut self, parent: BlockKey, arrived: bool) -> u64 {
        let bits = parent.bits();
        match self.children.get_mut(bits) {
            Some(count) if arrived => {
                *count += 1;
                *count
            }
            None if arrived => {
                self.children.insert(bits, 1);
                1
            }
            Some(1) | None => {
                self.children.remove(bits);
                0
            }
            Some(count) => {
                *count -= 1;
                *count
            }
        }
    }

    /// Reads the lines a store is about to search, all four at once: the block's place and
    /// holders, and those of the block it evicts at the cap. Each search branches on what it
    /// finds, which holds back the next; read together first, their misses overlap.
    fn touch_lines_of_store(
        &self,
        holders: &Holders,
        hash: u64,
        (key, parent): (BlockKey, Option<BlockKey>),
        medium: Medium,
        cap: usize,
    ) {
        let evicted = self.order.front().filter(|_| self.len() >= cap.max(1));
        self.places
            .touch_for_update([hash].into_iter().chain(evicted.map(|block| block.hash)));
        holders.touch_for_update(
            [key].into_iter().chain(evicted.map(|block| block.key)),
            self.slot / 64,
            medium,
        );
        if medium == Medium::Gpu {
            // The children counts the store and the eviction change, and the parents' holders.
            let arriving = Some(key).filter(|_| self.holes > 0);
            let evicted_parent = evicted.and_then(|block| block.parent());
            let counted = [
                arriving,
                parent,
                evicted.map(|block| block.key),
                evicted_parent,
            ];
            self.children
                .touch_for_update(counted.into_iter().flatten().map(BlockKey::bits));
            holders.touch(
                parent.into_iter().chain(evicted_parent),
                self.slot / 64,
                MediumSet::GPU,
            );
        }
    }

    /// Where `hash`'s block is in `order`.
    fn place_of(&self, hash: u64) -> Option<usize> {
        self.places
            .get(hash)
            .map(|place| (place - self.front) as usize)
    }

    /// Drops the block at `at` in `order`, leaving a gap.
    fn forget(&mut self, holders: &mut Holders, at: usize) {
        let block = self.order[at];
        self.release_every_copy(holders, block);
        self.order[at].media = MediumSet::NONE;
        self.places.remove(block.hash);
        self.compact_order();
    }

    /// Drops the oldest block. Its removals from the hash table and from the holders go to
    /// different lines of memory, and neither waits on the other.
    fn evict_oldest(&mut self, holders: &mut Holders) {
        while let Some(block) = self.order.pop_front() {
            self.front += 1;
            if !block.media.is_empty() {
                self.places.remove(block.hash);
                self.release_every_copy(holders, block);
                self.stats.evicted += 1;
                return;
            }
        }
    }

    /// Grows `order` when it is full by doubling, as `VecDeque` does, but not past `cap`: an
    /// endpoint at its cap holds `cap` blocks (gaps aside), and the doubling past it would
    /// leave the rest unused (a quarter of the queue at 100k blocks, which doubles to 131,072).
    fn make_room_in_order(&mut self, cap: usize) {
        let len = self.order.len();
        if len < self.order.capacity() {
            return;
        }
        let more = if len < cap {
            len.max(4).min(cap - len)
        } else {
            len
        };
        self.order.reserve_exact(more);
    }

    /// Closes the gaps once they outnumber the blocks, renumbering the blocks' places: a
    /// cost of one table update per block, paid once per as many removals.
    fn compact_order(&mut self) {
        if self.order.len() <= 2 * self.len() + 64 {
            return;
        }
        self.order.retain(|block| !block.media.is_empty());
        for (at, block) in self.order.iter().enumerate() {
            self.places.insert(block.hash, self.front + at as u64);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(i: u64) -> BlockKey {
        crate::key::prompt_keys(&[i as u32], 1, crate::key::Adapter::Base)[0]
    }

    /// The order queue grows to the cap and no further while the endpoint stays at it, and
    /// past it (doubling) only for gaps.
    #[test]
    fn the_order_queue_grows_to_the_cap_and_no_further() {
        const CAP: usize = 1_000;
        let (mut blocks, mut holders) = (EndpointBlocks::new(0), Holders::default());
        for i in 0..3 * CAP as u64 {
            blocks.store(&mut holders, i, (key(i), None), Medium::Gpu, CAP);
            assert!(blocks.order.capacity() <= CAP, "{i}");
        }
        assert_eq!(
            (blocks.len(), blocks.order.capacity(), blocks.stats.evicted),
            (CAP, CAP, 2 * CAP as u64)
        );
        // Removals leave gaps, which the queue holds until compacted: it grows past the cap.
        for i in 2 * CAP as u64..2 * CAP as u64 + 100 {
            blocks.remove(&mut holders, i, Medium::Gpu);
        }
        for i in 3 * CAP as u64..3 * CAP as u64 + 100 {
            blocks.store(&mut holders, i, (key(i), None), Medium::Gpu, CAP);
        }
        assert_eq!((blocks.len(), blocks.order.len()), (CAP, CAP + 100));
        assert!(blocks.order.capacity() >= 2 * CAP);
    }
}
