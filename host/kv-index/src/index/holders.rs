//! Which endpoints hold each key, per medium: the map a lookup probes, so a prompt's walk is
//! one probe per block for up to 64 endpoints whatever their number.
//!
//! Endpoints have slots; slot `s` is bit `s % 64` of word `s / 64`. Word 0 of a key is stored
//! under the key's bits, word `w > 0` under the bits mixed with `w`, so routers of ≤ 64
//! endpoints (the usual case) pay for exactly one entry per key.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use super::table::Table;
use crate::key::BlockKey;
use crate::medium::{Medium, MediumSet};

type Map<V> = HashMap<u64, V, BuildHasherDefault<KeyBits>>;

#[derive(Default)]
pub(super) struct Holders {
    /// The slots of one word holding the key in their GPU cache: all a default lookup probes,
    /// so one cache line a probe.
    gpu: Table,
    /// The same for the offloaded tiers ([`Medium::Cpu`], [`Medium::Storage`]), which only
    /// offloading connectors fill.
    offloaded: Map<[u64; 2]>,
    /// The slots of one word for which the key is a hole: not on the GPU, with a child there
    /// (a middle block evicted, the cap's oldest dropped). Along a prompt, a slot holds a
    /// block only after every block before it, up to the first of its holes; engines evict
    /// a chain from its end, so there are few, and this table stays in the caches.
    holes: Table,
}

impl Holders {
    /// Sets `slot`'s bit for `key` on `medium`; whether it was clear.
    pub(super) fn set(&mut self, key: BlockKey, slot: usize, medium: Medium) -> bool {
        let (entry, bit) = (entry_key(key, slot / 64), 1 << (slot % 64));
        let mask = match offloaded_index(medium) {
            None => match self.gpu.get_mut(entry) {
                Some(mask) => mask,
                None => {
                    self.gpu.insert(entry, bit);
                    return true;
                }
            },
            Some(tier) => &mut self.offloaded.entry(entry).or_default()[tier],
        };
        let was_clear = *mask & bit == 0;
        *mask |= bit;
        was_clear
    }

    /// Clears `slot`'s bit for `key` on `medium`; whether it was set.
    pub(super) fn clear(&mut self, key: BlockKey, slot: usize, medium: Medium) -> bool {
        let (entry, bit) = (entry_key(key, slot / 64), 1u64 << (slot % 64));
        match offloaded_index(medium) {
            None => {
                let Some(mask) = self.gpu.get_mut(entry) else {
                    return false;
                };
                let was_set = *mask & bit != 0;
                *mask &= !bit;
                if *mask == 0 {
                    self.gpu.remove(entry);
                }
                was_set
            }
            Some(tier) => {
                let Some(masks) = self.offloaded.get_mut(&entry) else {
                    return false;
                };
                let was_set = masks[tier] & bit != 0;
                masks[tier] &= !bit;
                if masks.iter().all(|&mask| mask == 0) {
                    self.offloaded.remove(&entry);
                }
                was_set
            }
        }
    }

    /// Marks `key` a hole of `slot`'s, or no longer one.
    pub(super) fn set_hole(&mut self, key: BlockKey, slot: usize, hole: bool) {
        let (entry, bit) = (entry_key(key, slot / 64), 1u64 << (slot % 64));
        match (self.holes.get_mut(entry), hole) {
            (Some(mask), true) => *mask |= bit,
            (None, true) => {
                self.holes.insert(entry, bit);
            }
            (Some(mask), false) => {
                *mask &= !bit;
                if *mask == 0 {
                    self.holes.remove(entry);
                }
            }
            (None, false) => {}
        }
    }

    /// The slots of `word` for which `key` is a hole.
    pub(super) fn holes(&self, key: BlockKey, word: usize) -> u64 {
        self.holes.get(entry_key(key, word)).unwrap_or(0)
    }

    /// Whether `slot` holds `key` in its GPU cache.
    pub(super) fn holds_on_gpu(&self, key: BlockKey, slot: usize) -> bool {
        self.mask(key, slot / 64, MediumSet::GPU) & 1 << (slot % 64) != 0
    }

    /// Brings the entries [`Self::mask`] will read for `keys` into the cache, together.
    pub(super) fn touch(
        &self,
        keys: impl IntoIterator<Item = BlockKey>,
        word: usize,
        media: MediumSet,
    ) {
        if media.contains(Medium::Gpu) {
            self.gpu
                .touch(keys.into_iter().map(|key| entry_key(key, word)));
        }
    }

    /// Brings the entries [`Self::set`] and [`Self::clear`] will change for `keys` into the
    /// cache, together.
    pub(super) fn touch_for_update(
        &self,
        keys: impl IntoIterator<Item = BlockKey>,
        word: usize,
        medium: Medium,
    ) {
        if medium == Medium::Gpu {
            self.gpu
                .touch_for_update(keys.into_iter().map(|key| entry_key(key, word)));
        }
    }

    /// The slots of `word` holding `key` on any of `media`.
    pub(super) fn mask(&self, key: BlockKey, word: usize, media: MediumSet) -> u64 {
        let entry = entry_key(key, word);
        let mut held = 0;
        if media.contains(Medium::Gpu) {
            held |= self.gpu.get(entry).unwrap_or(0);
        }
        if !self.offloaded.is_empty()
            && let Some(masks) = self.offloaded.get(&entry)
        {
            for medium in [Medium::Cpu, Medium::Storage] {
                if media.contains(medium) {
                    held |= masks[offloaded_index(medium).expect("offloaded")];
                }
            }
        }
        held
    }

    /// Entries: (key, word) pairs held on the GPU, plus those held offloaded.
    pub(super) fn len(&self) -> usize {
        self.gpu.len() + self.offloaded.len()
    }

    pub(super) fn heap_bytes(&self) -> usize {
        self.gpu.heap_bytes() + self.holes.heap_bytes() + super::map_heap_bytes(&self.offloaded)
    }
}

fn offloaded_index(medium: Medium) -> Option<usize> {
    match medium {
        Medium::Gpu => None,
        Medium::Cpu => Some(0),
        Medium::Storage => Some(1),
    }
}

fn entry_key(key: BlockKey, word: usize) -> u64 {
    const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;
    key.bits() ^ (word as u64).wrapping_mul(GOLDEN)
}

/// Keys are XXH3 outputs already: hashing them again would only cost time.
#[derive(Default)]
struct KeyBits(u64);

impl Hasher for KeyBits {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write_u64(&mut self, bits: u64) {
        self.0 = bits;
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only `u64` keys are hashed; fold anything else rather than lose it.
        for &byte in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(byte);
        }
    }
}
