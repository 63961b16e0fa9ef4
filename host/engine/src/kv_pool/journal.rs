//! The prefix cache's changes as vLLM's KV-cache events, in the order they happened: stored
//! pages as `BlockStored` (a sequence's consecutive pages in one event), evicted ones as
//! `BlockRemoved`. Keys are the block hashes; every block is in the engine's own pool ("GPU").

use std::ops::Range;

use switchyard_wire::kv_events::{BlockHash, BlockRemoved, BlockStored, Event, MEDIUM_GPU};

#[derive(Debug, Default)]
pub(super) struct Journal {
    events: Vec<Event>,
}

impl Journal {
    /// Pages `pages` of a sequence whose prefix keys are `keys` were stored: their hashes and
    /// tokens, after the key of the page before them (none: the first starts the prompt).
    pub(super) fn stored(
        &mut self,
        keys: &[u64],
        pages: Range<usize>,
        tokens: &[u32],
        page_size: usize,
    ) {
        let parent = pages.start.checked_sub(1).map(|p| BlockHash::Int(keys[p]));
        let hashes = keys[pages.clone()].iter().copied().map(BlockHash::Int);
        let tokens = &tokens[pages.start * page_size..pages.end * page_size];
        self.events.push(Event::BlockStored(BlockStored::new(
            hashes.collect(),
            parent,
            tokens.to_vec(),
            u32::try_from(page_size).unwrap_or(u32::MAX),
        )));
    }

    /// The page cached under `key` was evicted. Evictions in a row share one event.
    pub(super) fn removed(&mut self, key: u64) {
        if let Some(Event::BlockRemoved(last)) = self.events.last_mut() {
            last.block_hashes.push(BlockHash::Int(key));
            return;
        }
        self.events.push(Event::BlockRemoved(BlockRemoved {
            block_hashes: vec![BlockHash::Int(key)],
            medium: Some(MEDIUM_GPU.to_owned()),
            group_idx: None,
        }));
    }

    /// Everything recorded since the last take; `None` if nothing was.
    pub(super) fn take(&mut self) -> Option<Vec<Event>> {
        (!self.events.is_empty()).then(|| std::mem::take(&mut self.events))
    }
}
