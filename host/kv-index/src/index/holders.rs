//! Which endpoints hold each key, per medium: the one map a lookup probes, so a prompt's walk
//! is one probe per block for up to 64 endpoints whatever their number.
//!
//! Endpoints have slots; slot `s` is bit `s % 64` of word `s / 64`. Word 0 of a key is stored
//! under the key's bits, word `w > 0` under the bits mixed with `w`, so routers of ≤ 64
//! endpoints (the usual case) pay for exactly one entry per key.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use crate::key::BlockKey;
use crate::medium::{Medium, MediumSet};

/// Per medium, the slots of one word holding the key.
type Masks = [u64; Medium::COUNT];

#[derive(Default)]
pub(super) struct Holders {
    map: HashMap<u64, Masks, BuildHasherDefault<KeyBits>>,
}

impl Holders {
    pub(super) fn set(&mut self, key: BlockKey, slot: usize, medium: Medium) {
        let masks = self.map.entry(entry_key(key, slot / 64)).or_default();
        masks[medium.index()] |= 1 << (slot % 64);
    }

    pub(super) fn clear(&mut self, key: BlockKey, slot: usize, medium: Medium) {
        let entry = entry_key(key, slot / 64);
        if let Some(masks) = self.map.get_mut(&entry) {
            masks[medium.index()] &= !(1 << (slot % 64));
            if masks.iter().all(|&mask| mask == 0) {
                self.map.remove(&entry);
            }
        }
    }

    /// The slots of `word` holding `key` on any of `media`.
    pub(super) fn mask(&self, key: BlockKey, word: usize, media: MediumSet) -> u64 {
        self.map.get(&entry_key(key, word)).map_or(0, |masks| {
            Medium::EVERY
                .into_iter()
                .filter(|&medium| media.contains(medium))
                .fold(0, |held, medium| held | masks[medium.index()])
        })
    }

    pub(super) fn len(&self) -> usize {
        self.map.len()
    }

    pub(super) fn heap_bytes(&self) -> usize {
        super::map_heap_bytes(&self.map)
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
