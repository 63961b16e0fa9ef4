//! The paged KV pool's bookkeeping: which page belongs to whom, and the prefix cache.
//!
//! Pages hold `page_size` consecutive positions of one sequence; slot `page * page_size + offset`
//! is where position `offset` of that page lives in the [`switchyard_kv::KvStore`]. A page is
//! reference-counted: sequences sharing a cached prefix share its pages. With the prefix cache on,
//! a full page is registered under a key chained from its parent's key and its own tokens (so it
//! stands for every token up to its end); when its last reference goes it stays cached
//! (evictable, LRU) instead of returning to the free list, so a later request with the same prefix
//! reuses it without recomputing or receiving its KV.
//!
//! Only whole pages are ever shared, and a sequence writes only at positions past its matched
//! prefix, so a shared page is never written while shared.
//!
//! The cache changes in two places only: [`PagePool::register`] stores pages and
//! [`PagePool::alloc`] evicts them. With [`PagePool::record_events`] both write what they did
//! to a journal as vLLM's KV-cache events ([`switchyard_wire::kv_events`]), the keys being the
//! block hashes, which a driver takes with [`PagePool::take_events`]. A page is stored only
//! when its parent's key is cached, so every `BlockStored` names a parent its subscribers know
//! and an index fed from the journal holds exactly the keys the cache holds.

mod journal;

use std::collections::BTreeMap;

use switchyard_wire::kv_events::Event;

use journal::Journal;

/// The key before a sequence's first page when nobody chose one ([`PagePool::record_events`]
/// does): a fixed value, so a core is deterministic.
const DEFAULT_ROOT: u64 = 0x6A09_E667_F3BC_C908;

/// Page bookkeeping for one engine. Owned by the step loop; not thread-safe by design.
#[derive(Debug)]
pub struct PagePool {
    page_size: usize,
    num_pages: u32,
    free: Vec<u32>,
    refcount: Vec<u32>,
    cache: Option<PrefixCache>,
    /// What the first page's key chains from: vLLM's `NONE_HASH`.
    root: u64,
}

/// Full pages by prefix key, and the unreferenced ones in least-recently-used order. What is
/// known per page is a table indexed by page: a prompt of 13k tokens touches 850 pages per
/// step, and hashing each page id (SipHash) was a fifth of a simulated engine's time.
#[derive(Debug)]
struct PrefixCache {
    page_by_key: foldhash::HashMap<u64, u32>,
    /// The key each page is cached under, by page.
    key_by_page: Vec<Option<u64>>,
    evictable: BTreeMap<u64, u32>,
    /// Each idle cached page's place in `evictable`, by page.
    evictable_tick: Vec<Option<u64>>,
    tick: u64,
    /// What the cache did since the driver last took it; `None` while nobody listens, which
    /// costs nothing.
    journal: Option<Journal>,
}

impl PagePool {
    pub fn new(num_pages: u32, page_size: usize, prefix_cache: bool) -> Self {
        PagePool {
            page_size,
            num_pages,
            // Pop from the end: hand out low page ids first, which keeps slot runs readable.
            free: (0..num_pages).rev().collect(),
            refcount: vec![0; num_pages as usize],
            cache: prefix_cache.then(|| PrefixCache::new(num_pages)),
            root: DEFAULT_ROOT,
        }
    }

    /// From now on, journal every page the prefix cache stores or evicts as KV events (a no-op
    /// without a prefix cache), with keys chained from `root`: an engine draws it at random
    /// once per process, as vLLM draws its `NONE_HASH`, so its block hashes name its own blocks
    /// and nothing else's. Call it before the first key is computed: keys from another root
    /// never match again.
    pub fn record_events(&mut self, root: u64) {
        self.root = root;
        if let Some(cache) = self.cache.as_mut() {
            cache.journal = Some(Journal::default());
        }
    }

    /// What the prefix cache did since the last call, in order; `None` when nothing happened
    /// (or nobody records).
    pub fn take_events(&mut self) -> Option<Vec<Event>> {
        self.cache.as_mut()?.journal.as_mut()?.take()
    }

    pub fn page_size(&self) -> usize {
        self.page_size
    }

    pub fn num_pages(&self) -> u32 {
        self.num_pages
    }

    /// Pages needed to hold `positions` positions.
    pub fn pages_for(&self, positions: usize) -> usize {
        positions.div_ceil(self.page_size)
    }

    /// Pages that an allocation can take now: free ones plus unreferenced cached ones.
    pub fn available(&self) -> usize {
        self.free.len() + self.cache.as_ref().map_or(0, |c| c.evictable.len())
    }

    /// Pages referenced by at least one sequence.
    pub fn used(&self) -> usize {
        self.num_pages as usize - self.available()
    }

    /// Unreferenced pages kept for the prefix cache.
    pub fn cached_idle(&self) -> usize {
        self.cache.as_ref().map_or(0, |c| c.evictable.len())
    }

    /// Takes `n` pages (refcount 1 each), evicting idle cached pages oldest first if the free
    /// list runs short; `None` (and nothing taken) if fewer than `n` are available.
    pub fn alloc(&mut self, n: usize) -> Option<Vec<u32>> {
        if self.available() < n {
            return None;
        }
        let mut pages = Vec::with_capacity(n);
        while pages.len() < n {
            let page = match self.free.pop() {
                Some(page) => page,
                None => self.evict_oldest()?,
            };
            self.refcount[page as usize] = 1;
            pages.push(page);
        }
        Some(pages)
    }

    fn evict_oldest(&mut self) -> Option<u32> {
        let cache = self.cache.as_mut()?;
        let (_, page) = cache.evictable.pop_first()?;
        cache.evictable_tick[page as usize] = None;
        if let Some(key) = cache.key_by_page[page as usize].take() {
            cache.page_by_key.remove(&key);
            if let Some(journal) = cache.journal.as_mut() {
                journal.removed(key);
            }
        }
        Some(page)
    }

    /// The cached pages for the longest run of `keys` (one key per full page, from the start),
    /// at most `max_pages` of them, each with a new reference.
    pub fn match_prefix(&mut self, keys: &[u64], max_pages: usize) -> Vec<u32> {
        let Some(cache) = self.cache.as_mut() else {
            return Vec::new();
        };
        let mut pages = Vec::new();
        for key in keys.iter().take(max_pages) {
            let Some(&page) = cache.page_by_key.get(key) else {
                break;
            };
            if let Some(tick) = cache.evictable_tick[page as usize].take() {
                cache.evictable.remove(&tick);
            }
            self.refcount[page as usize] += 1;
            pages.push(page);
        }
        pages
    }

    /// How many leading full pages of `tokens` the prefix cache holds in a row: a read that
    /// takes no reference and leaves the eviction order as it was. Keys are chained as
    /// [`extend_keys`](Self::extend_keys) chains them, and none past the first page missing.
    pub fn cached_pages(&self, tokens: &[u32]) -> usize {
        let Some(cache) = self.cache.as_ref() else {
            return 0;
        };
        let mut key = self.root;
        tokens
            .chunks_exact(self.page_size)
            .take_while(|page| {
                key = chain(key, page);
                cache.page_by_key.contains_key(&key)
            })
            .count()
    }

    /// Offers full pages `from..keys.len()` of one sequence to the prefix cache: page `p` is
    /// `pages[p]`, holds `tokens[p * page_size..][..page_size]` and has the prefix key
    /// `keys[p]`. A page is skipped when its key or the page is cached already, or when its
    /// parent's key is not cached (it went while the sequence ran): a key whose parent is
    /// missing is one no prefix reaches, and its event would name a parent nobody knows.
    /// A no-op without a prefix cache.
    pub fn register(&mut self, pages: &[u32], keys: &[u64], tokens: &[u32], from: usize) {
        let page_size = self.page_size;
        let Some(cache) = self.cache.as_mut() else {
            return;
        };
        // Consecutive pages stored are one event, as vLLM publishes a request's new blocks.
        let mut run = None;
        for p in from..keys.len() {
            let parent = p.checked_sub(1).map(|q| keys[q]);
            if cache.store(pages[p], keys[p], parent) {
                run.get_or_insert(p);
            } else if let Some(start) = run.take() {
                cache.journal_stored(keys, start..p, tokens, page_size);
            }
        }
        if let Some(start) = run {
            cache.journal_stored(keys, start..keys.len(), tokens, page_size);
        }
    }

    /// Drops one reference to each page; a page nobody references becomes idle-cached if it is
    /// registered, free otherwise.
    pub fn release(&mut self, pages: &[u32]) {
        for &page in pages {
            let count = &mut self.refcount[page as usize];
            debug_assert!(*count > 0, "page {page} released more often than taken");
            *count = count.saturating_sub(1);
            if *count > 0 {
                continue;
            }
            match self.cache.as_mut() {
                Some(cache) if cache.key_by_page[page as usize].is_some() => {
                    cache.tick += 1;
                    cache.evictable.insert(cache.tick, page);
                    cache.evictable_tick[page as usize] = Some(cache.tick);
                }
                _ => self.free.push(page),
            }
        }
    }

    /// The slot of `position` in a sequence holding `pages`.
    pub fn slot(&self, pages: &[u32], position: usize) -> u32 {
        pages[position / self.page_size] * self.page_size as u32
            + (position % self.page_size) as u32
    }

    /// Prefix keys of the full pages of `tokens`: key `p` chains key `p - 1` (the root for the
    /// first page) with the tokens of page `p`, so it stands for every token up to its end.
    /// Keys already computed in `keys` are kept; only new full pages are hashed.
    pub fn extend_keys(&self, keys: &mut Vec<u64>, tokens: &[u32]) {
        let page_size = self.page_size;
        let full_pages = tokens.len() / page_size;
        while keys.len() < full_pages {
            let p = keys.len();
            let parent = keys.last().copied().unwrap_or(self.root);
            keys.push(chain(parent, &tokens[p * page_size..(p + 1) * page_size]));
        }
    }
}

// === impl PrefixCache ===

impl PrefixCache {
    fn new(num_pages: u32) -> Self {
        PrefixCache {
            page_by_key: foldhash::HashMap::default(),
            key_by_page: vec![None; num_pages as usize],
            evictable: BTreeMap::new(),
            evictable_tick: vec![None; num_pages as usize],
            tick: 0,
            journal: None,
        }
    }

    /// Caches `page` under `key` if neither is cached and its parent is; whether it did.
    fn store(&mut self, page: u32, key: u64, parent: Option<u64>) -> bool {
        if self.page_by_key.contains_key(&key)
            || self.key_by_page[page as usize].is_some()
            || parent.is_some_and(|parent| !self.page_by_key.contains_key(&parent))
        {
            return false;
        }
        self.page_by_key.insert(key, page);
        self.key_by_page[page as usize] = Some(key);
        true
    }

    fn journal_stored(
        &mut self,
        keys: &[u64],
        pages: std::ops::Range<usize>,
        tokens: &[u32],
        page_size: usize,
    ) {
        if let Some(journal) = self.journal.as_mut() {
            journal.stored(keys, pages, tokens, page_size);
        }
    }
}

/// One page's key: its parent's key mixed with each of its tokens.
fn chain(parent: u64, tokens: &[u32]) -> u64 {
    tokens.iter().fold(parent, |h, &t| {
        (h ^ u64::from(t))
            .wrapping_mul(0x0000_0100_0000_01B3)
            .rotate_left(23)
            ^ (h >> 17)
    })
}

#[cfg(test)]
mod tests;
