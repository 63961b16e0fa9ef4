//! The paged KV pool's bookkeeping: which page belongs to whom, and the prefix cache.
//!
//! Pages hold `page_size` consecutive positions of one sequence; slot `page * page_size + offset`
//! is where position `offset` of that page lives in the [`switchyard_kv::KvStore`]. A page is
//! reference-counted: sequences sharing a cached prefix share its pages. With the prefix cache on,
//! a full page is registered under a key that hashes every token up to its end; when its last
//! reference goes it stays cached (evictable, LRU) instead of returning to the free list, so a
//! later request with the same prefix reuses it without recomputing or receiving its KV.
//!
//! Only whole pages are ever shared, and a sequence writes only at positions past its matched
//! prefix, so a shared page is never written while shared.

use std::collections::{BTreeMap, HashMap};

/// Page bookkeeping for one engine. Owned by the step loop; not thread-safe by design.
#[derive(Debug)]
pub struct PagePool {
    page_size: usize,
    num_pages: u32,
    free: Vec<u32>,
    refcount: Vec<u32>,
    cache: Option<PrefixCache>,
}

/// Full pages by prefix key, and the unreferenced ones in least-recently-used order.
#[derive(Debug, Default)]
struct PrefixCache {
    page_by_key: HashMap<u64, u32>,
    key_by_page: HashMap<u32, u64>,
    evictable: BTreeMap<u64, u32>,
    evictable_tick: HashMap<u32, u64>,
    tick: u64,
}

impl PagePool {
    pub fn new(num_pages: u32, page_size: usize, prefix_cache: bool) -> Self {
        PagePool {
            page_size,
            num_pages,
            // Pop from the end: hand out low page ids first, which keeps slot runs readable.
            free: (0..num_pages).rev().collect(),
            refcount: vec![0; num_pages as usize],
            cache: prefix_cache.then(PrefixCache::default),
        }
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
        cache.evictable_tick.remove(&page);
        if let Some(key) = cache.key_by_page.remove(&page) {
            cache.page_by_key.remove(&key);
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
            if let Some(tick) = cache.evictable_tick.remove(&page) {
                cache.evictable.remove(&tick);
            }
            self.refcount[page as usize] += 1;
            pages.push(page);
        }
        pages
    }

    /// How many of `keys` (one per full page, from the start) the prefix cache holds in a
    /// row: a read that takes no reference and leaves the eviction order as it was.
    pub fn cached_pages(&self, keys: &[u64]) -> usize {
        self.cache.as_ref().map_or(0, |cache| {
            keys.iter()
                .take_while(|key| cache.page_by_key.contains_key(key))
                .count()
        })
    }

    /// Records that `page` now holds the full page whose prefix key is `key`. A no-op without a
    /// prefix cache, or when the key or the page is already cached.
    pub fn register(&mut self, page: u32, key: u64) {
        let Some(cache) = self.cache.as_mut() else {
            return;
        };
        if cache.page_by_key.contains_key(&key) || cache.key_by_page.contains_key(&page) {
            return;
        }
        cache.page_by_key.insert(key, page);
        cache.key_by_page.insert(page, key);
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
                Some(cache) if cache.key_by_page.contains_key(&page) => {
                    cache.tick += 1;
                    cache.evictable.insert(cache.tick, page);
                    cache.evictable_tick.insert(page, cache.tick);
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
}

/// Prefix keys of the full pages of `tokens`: key `p` hashes every token of pages `0..=p`.
/// Keys already computed in `keys` are kept; only new full pages are hashed.
pub fn extend_page_keys(keys: &mut Vec<u64>, tokens: &[u32], page_size: usize) {
    let full_pages = tokens.len() / page_size;
    while keys.len() < full_pages {
        let p = keys.len();
        let prev = keys.last().copied().unwrap_or(0x6A09_E667_F3BC_C908);
        let key = tokens[p * page_size..(p + 1) * page_size]
            .iter()
            .fold(prev, |h, &t| {
                (h ^ u64::from(t))
                    .wrapping_mul(0x0000_0100_0000_01B3)
                    .rotate_left(23)
                    ^ (h >> 17)
            });
        keys.push(key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alloc_and_release_without_cache() {
        let mut pool = PagePool::new(4, 16, false);
        let a = pool.alloc(3).unwrap();
        assert_eq!(a, vec![0, 1, 2]);
        assert_eq!(pool.available(), 1);
        assert!(pool.alloc(2).is_none());
        assert_eq!(pool.available(), 1, "a failed alloc takes nothing");
        pool.release(&a);
        assert_eq!(pool.available(), 4);
        assert_eq!(pool.used(), 0);
        assert_eq!(pool.slot(&[2, 0], 17), 1);
        assert_eq!(pool.slot(&[2, 0], 3), 35);
    }

    #[test]
    fn prefix_cache_shares_and_evicts_lru() {
        let mut pool = PagePool::new(3, 2, true);
        let tokens = [1, 2, 3, 4, 5];
        let mut keys = Vec::new();
        extend_page_keys(&mut keys, &tokens, 2);
        assert_eq!(keys.len(), 2);

        let pages = pool.alloc(3).unwrap();
        pool.register(pages[0], keys[0]);
        pool.register(pages[1], keys[1]);
        // A second sequence with the same prefix shares the two full pages.
        let shared = pool.match_prefix(&keys, 8);
        assert_eq!(shared, pages[..2]);
        pool.release(&pages);
        assert_eq!(pool.used(), 2, "the sharer still holds two pages");
        assert_eq!(pool.cached_idle(), 0);
        pool.release(&shared);
        assert_eq!(pool.cached_idle(), 2);
        assert_eq!(pool.available(), 3);

        // The match is capped, and a different prefix does not match.
        assert_eq!(pool.match_prefix(&keys, 1).len(), 1);
        let mut other = Vec::new();
        extend_page_keys(&mut other, &[9, 9, 3, 4], 2);
        assert!(pool.match_prefix(&other, 8).is_empty());

        // Allocation evicts idle cached pages once the free list is empty.
        let all = pool.alloc(2).unwrap();
        assert_eq!(pool.available(), 0);
        pool.release(&all);
        assert_eq!(
            pool.match_prefix(&keys[1..], 8).len(),
            0,
            "evicted keys are gone"
        );
    }

    #[test]
    fn page_keys_depend_on_everything_before() {
        let (mut a, mut b) = (Vec::new(), Vec::new());
        extend_page_keys(&mut a, &[1, 2, 3, 4], 2);
        extend_page_keys(&mut b, &[0, 2, 3, 4], 2);
        assert_ne!(a[1], b[1]);
        let mut c = a[..1].to_vec();
        extend_page_keys(&mut c, &[1, 2, 3, 4, 5, 6], 2);
        assert_eq!(&c[..2], a.as_slice());
        assert_eq!(c.len(), 3);
    }
}
