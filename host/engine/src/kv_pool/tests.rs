use switchyard_wire::kv_events::{BlockHash, BlockRemoved, BlockStored, Event, MEDIUM_GPU};

use super::*;

fn keys_of(pool: &PagePool, tokens: &[u32]) -> Vec<u64> {
    let mut keys = Vec::new();
    pool.extend_keys(&mut keys, tokens);
    keys
}

fn hashes(keys: &[u64]) -> Vec<BlockHash> {
    keys.iter().copied().map(BlockHash::Int).collect()
}

fn removed(keys: &[u64]) -> Event {
    Event::BlockRemoved(BlockRemoved {
        block_hashes: hashes(keys),
        medium: Some(MEDIUM_GPU.to_owned()),
        group_idx: None,
    })
}

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
    let keys = keys_of(&pool, &tokens);
    assert_eq!(keys.len(), 2);

    let pages = pool.alloc(3).unwrap();
    pool.register(&pages, &keys, &tokens, 0);
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
    let other = keys_of(&pool, &[9, 9, 3, 4]);
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
fn page_keys_depend_on_everything_before_and_on_the_root() {
    let pool = PagePool::new(1, 2, true);
    let a = keys_of(&pool, &[1, 2, 3, 4]);
    let b = keys_of(&pool, &[0, 2, 3, 4]);
    assert_ne!(a[1], b[1]);
    let mut c = a[..1].to_vec();
    pool.extend_keys(&mut c, &[1, 2, 3, 4, 5, 6]);
    assert_eq!(&c[..2], a.as_slice());
    assert_eq!(c.len(), 3);

    // Another process (another root) names the same tokens otherwise, at every page.
    let mut seeded = PagePool::new(1, 2, true);
    seeded.record_events(7);
    let d = keys_of(&seeded, &[1, 2, 3, 4]);
    assert!(a.iter().zip(&d).all(|(a, d)| a != d), "{a:?} {d:?}");
    assert_eq!(d, keys_of(&seeded, &[1, 2, 3, 4]));
}

#[test]
fn the_journal_says_what_the_cache_stored_and_evicted() {
    let mut pool = PagePool::new(4, 2, true);
    pool.record_events(42);
    assert_eq!(pool.take_events(), None, "nothing happened yet");
    let tokens = [1, 2, 3, 4, 5, 6, 7];
    let keys = keys_of(&pool, &tokens);
    let pages = pool.alloc(4).unwrap();
    // One step completes the first page, a later one the next two.
    pool.register(&pages, &keys[..1], &tokens, 0);
    pool.register(&pages, &keys, &tokens, 1);
    assert_eq!(
        pool.take_events(),
        Some(vec![
            Event::BlockStored(BlockStored::new(hashes(&keys[..1]), None, vec![1, 2], 2)),
            Event::BlockStored(BlockStored::new(
                hashes(&keys[1..]),
                Some(BlockHash::Int(keys[0])),
                vec![3, 4, 5, 6],
                2
            )),
        ])
    );
    assert_eq!(pool.take_events(), None, "taken once");

    // Released, the three cached pages are evicted oldest first, in one event; the free page
    // goes first and is no event.
    pool.release(&pages);
    let taken = pool.alloc(4).unwrap();
    assert_eq!(taken[0], pages[3]);
    assert_eq!(pool.take_events(), Some(vec![removed(&keys)]));
}

#[test]
fn a_page_is_stored_only_under_a_cached_parent_and_a_new_key() {
    let mut pool = PagePool::new(8, 2, true);
    pool.record_events(1);
    let tokens = [1, 2, 3, 4, 5, 6];
    let keys = keys_of(&pool, &tokens);

    // Two sequences compute the same prompt side by side: the second's copy of a page the
    // first cached is no news.
    let first = pool.alloc(3).unwrap();
    let second = pool.alloc(3).unwrap();
    pool.register(&first, &keys[..1], &tokens, 0);
    pool.register(&second, &keys[..1], &tokens, 0);
    assert_eq!(pool.take_events().map(|e| e.len()), Some(1));

    // The first sequence ends and its page is evicted while the second still runs: the
    // second's next pages chain from a key no longer cached, so neither is stored.
    pool.release(&first);
    let filler = pool.alloc(5).unwrap();
    assert_eq!(pool.take_events(), Some(vec![removed(&keys[..1])]));
    pool.register(&second, &keys, &tokens, 1);
    assert_eq!(pool.take_events(), None);
    assert!(pool.match_prefix(&keys, 3).is_empty());

    // Pages are offered again once their parent is back.
    pool.release(&filler);
    pool.register(&second, &keys[..1], &tokens, 0);
    pool.register(&second, &keys, &tokens, 1);
    let stored = pool.take_events().expect("stored");
    assert_eq!(stored.len(), 2);
    assert_eq!(pool.match_prefix(&keys, 3), second);
}

#[test]
fn without_a_journal_the_cache_records_nothing() {
    let mut pool = PagePool::new(2, 2, true);
    let tokens = [1, 2, 3, 4];
    let keys = keys_of(&pool, &tokens);
    let pages = pool.alloc(2).unwrap();
    pool.register(&pages, &keys, &tokens, 0);
    pool.release(&pages);
    pool.alloc(2).unwrap();
    assert_eq!(pool.take_events(), None);
}

/// `cached_pages` counts the leading pages of a prompt the cache holds, keyed under the pool's
/// own root, as `match_prefix` would find them.
#[test]
fn cached_pages_counts_the_leading_pages_held_under_the_pools_root() {
    let mut pool = PagePool::new(3, 2, true);
    pool.record_events(7);
    let tokens = [1, 2, 3, 4, 5, 6];
    let keys = keys_of(&pool, &tokens);
    let pages = pool.alloc(3).unwrap();
    pool.register(&pages[..2], &keys[..2], &tokens, 0);
    pool.release(&pages);

    assert_eq!(pool.match_prefix(&keys, 8).len(), 2);
    assert_eq!(
        pool.cached_pages(&tokens),
        2,
        "the third page was never stored"
    );
    assert_eq!(pool.cached_pages(&tokens[..3]), 1, "whole pages only");
    assert_eq!(
        pool.cached_pages(&[1, 2, 9, 9]),
        1,
        "the run stops at the first miss"
    );
    assert_eq!(
        pool.cached_pages(&[9, 9, 3, 4]),
        0,
        "a key stands for its whole prefix"
    );

    // The same tokens under another root name no page of this cache.
    let mut other = PagePool::new(3, 2, true);
    let pages = other.alloc(2).unwrap();
    other.register(&pages, &keys[..2], &tokens, 0);
    assert_eq!(other.cached_pages(&tokens), 0);
}
