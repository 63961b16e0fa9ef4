use switchyard_wire::kv_events::{
    BlockHash, BlockRemoved, BlockStored, Event, EventBatch, decode_batch,
};

use super::*;
use crate::key::prompt_keys;
use std::collections::HashMap;

/// Payloads msgspec wrote from the engines' declarations (host/wire/fixtures/kv_events).
macro_rules! fixture {
    ($name:literal) => {
        include_bytes!(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../wire/fixtures/kv_events/",
            $name
        ))
        .as_slice()
    };
}

fn events_of(payload: &[u8]) -> Vec<Event> {
    decode_batch(payload).expect("decodes").batch.events
}

fn held(index: &KvIndex, endpoint: EndpointId, prompt: &[u32], adapter: Adapter<'_>) -> usize {
    held_on(index, endpoint, prompt, adapter, MediumSet::GPU)
}

fn held_on(
    index: &KvIndex,
    endpoint: EndpointId,
    prompt: &[u32],
    adapter: Adapter<'_>,
    media: MediumSet,
) -> usize {
    index
        .lookup(prompt, adapter, media)
        .into_iter()
        .find(|m| m.endpoint == endpoint)
        .map_or(0, |m| m.tokens)
}

fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32], block_size: u32) -> BlockStored {
    BlockStored::new(
        hashes.iter().copied().map(BlockHash::Int).collect(),
        parent.map(BlockHash::Int),
        tokens.to_vec(),
        block_size,
    )
}

fn store(index: &mut KvIndex, endpoint: EndpointId, event: BlockStored) {
    index.apply(endpoint, &Event::BlockStored(event));
}

fn removed(hashes: &[u64], medium: Option<&str>) -> Event {
    Event::BlockRemoved(BlockRemoved {
        block_hashes: hashes.iter().copied().map(BlockHash::Int).collect(),
        medium: medium.map(str::to_owned),
        group_idx: None,
    })
}

fn range(from: u32, to: u32) -> Vec<u32> {
    (from..to).collect()
}

#[test]
fn the_first_vllm_layout_stores_chains_and_a_removal_cuts_the_prefix() {
    let mut index = KvIndex::default();
    let events = events_of(fixture!("vllm-v0-array.msgpack"));
    let prompt = range(1, 13);
    for event in &events[..2] {
        index.apply(0, event);
    }
    assert_eq!(held(&index, 0, &prompt, Adapter::Base), 12);
    // The middle block evicted: the third is still cached but no prompt reaches it.
    index.apply(0, &events[2]);
    assert_eq!(held(&index, 0, &prompt, Adapter::Base), 4);
    let stats = index.stats(0).expect("known");
    assert_eq!((stats.blocks, stats.stored, stats.removed), (2, 3, 1));
    assert_eq!(stats.block_size, Some(4));
}

#[test]
fn the_v0_26_capture_matches_its_own_tokens_and_nothing_shorter() {
    let mut index = KvIndex::default();
    for event in events_of(fixture!("vllm-v0.26-map.msgpack")) {
        index.apply(5, &event);
    }
    let Event::BlockStored(capture) = &events_of(fixture!("vllm-v0.26-map.msgpack"))[0] else {
        unreachable!("the capture is one BlockStored");
    };
    let mut prompt = capture.token_ids.clone();
    prompt.extend([1, 2, 3]);
    assert_eq!(held(&index, 5, &prompt, Adapter::Base), 16);
    assert_eq!(held(&index, 5, &prompt[..15], Adapter::Base), 0);
    prompt[3] += 1;
    assert_eq!(held(&index, 5, &prompt, Adapter::Base), 0);
}

#[test]
fn a_mixed_batch_keeps_media_groups_and_adapters_apart() {
    let mut index = KvIndex::default();
    let events = events_of(fixture!("vllm-mixed.msgpack"));
    let prompt = range(1, 9);
    // A on GPU, B after it on GPU, A's CPU copy, a sliding-window group's block, a LoRA block.
    for event in &events[..5] {
        index.apply(1, event);
    }
    assert_eq!(held(&index, 1, &prompt, Adapter::Base), 8);
    assert_eq!(held(&index, 1, &prompt, Adapter::Lora("adapter-a")), 4);
    assert_eq!(held(&index, 1, &prompt, Adapter::Lora("adapter-b")), 0);
    assert_eq!(index.stats(1).expect("known").skipped, 1, "group 1");
    // B evicted from the GPU; A's CPU copy dropped, its GPU copy kept.
    index.apply(1, &events[5]);
    index.apply(1, &events[6]);
    assert_eq!(held(&index, 1, &prompt, Adapter::Base), 4);
    assert_eq!(
        held_on(&index, 1, &prompt, Adapter::Base, MediumSet::ALL),
        4
    );
}

#[test]
fn only_gpu_blocks_count_unless_the_caller_asks_for_offloaded_tiers() {
    let mut index = KvIndex::default();
    let mut offloaded = stored(&[1], None, &range(0, 4), 4);
    offloaded.medium = Some("CPU_TIER1".into());
    store(&mut index, 0, offloaded);
    let prompt = range(0, 4);
    assert_eq!(held(&index, 0, &prompt, Adapter::Base), 0);
    let cpu = MediumSet::GPU.with(Medium::Cpu);
    assert_eq!(held_on(&index, 0, &prompt, Adapter::Base, cpu), 4);
    // A copy on the GPU too; losing the CPU copy keeps the block cached.
    store(&mut index, 0, stored(&[1], None, &range(0, 4), 4));
    index.apply(0, &removed(&[1], Some("CPU_TIER1")));
    assert_eq!(held(&index, 0, &prompt, Adapter::Base), 4);
    assert_eq!(
        held_on(
            &index,
            0,
            &prompt,
            Adapter::Base,
            MediumSet::of(Medium::Cpu)
        ),
        0
    );
    // A medium absent from the event (versions before the field) is the GPU.
    index.apply(0, &removed(&[1], None));
    assert_eq!(
        held_on(&index, 0, &prompt, Adapter::Base, MediumSet::ALL),
        0
    );
    assert_eq!(index.stats(0).expect("known").blocks, 0);
}

#[test]
fn byte_hashes_place_children_and_apply_removals() {
    let mut index = KvIndex::default();
    let events = events_of(fixture!("vllm-bin-hashes.msgpack"));
    let prompt = range(1, 13);
    for event in &events[..2] {
        index.apply(2, event);
    }
    assert_eq!(held(&index, 2, &prompt, Adapter::Base), 12);
    index.apply(2, &events[2]);
    assert_eq!(held(&index, 2, &prompt, Adapter::Base), 4);
}

#[test]
fn a_salted_block_and_its_descendants_match_nothing_and_a_clear_drops_everything() {
    let mut index = KvIndex::default();
    let events = events_of(fixture!("vllm-map-batch.msgpack"));
    let prompt = range(1, 9);
    // Blocks [1..4] (salted) and [5..8] after it.
    index.apply(0, &events[0]);
    assert_eq!(held(&index, 0, &prompt, Adapter::Base), 0);
    assert_eq!(index.stats(0).expect("known").skipped, 2);
    // The same tokens without a salt: the prompt's first block.
    index.apply(0, &events[1]);
    assert_eq!(held(&index, 0, &prompt, Adapter::Base), 4);
    // A child of the salted block cannot be placed.
    store(
        &mut index,
        0,
        stored(&[99], Some(15760518052499183552), &range(5, 9), 4),
    );
    assert_eq!(index.stats(0).expect("known").unplaced, 1);
    index.apply(0, &events[2]);
    assert_eq!(held(&index, 0, &prompt, Adapter::Base), 0);
    let stats = index.stats(0).expect("known");
    assert_eq!((stats.blocks, stats.clears), (0, 1));
}

#[test]
fn sglang_pages_chain_through_signed_hashes_and_a_short_page_never_matches() {
    let mut index = KvIndex::default();
    let events = events_of(fixture!("sglang-pages.msgpack"));
    for event in &events[..3] {
        index.apply(4, event);
    }
    let prompt = range(1, 11);
    assert_eq!(held(&index, 4, &prompt, Adapter::Base), 8);
    let stats = index.stats(4).expect("known");
    assert_eq!((stats.blocks, stats.skipped), (2, 1));
    index.apply(4, &events[3]);
    assert_eq!(held(&index, 4, &prompt, Adapter::Base), 0);
}

#[test]
fn engines_with_different_hashes_for_the_same_tokens_match_the_same_prompt() {
    let mut index = KvIndex::default();
    store(&mut index, 0, stored(&[10, 11, 12], None, &range(0, 12), 4));
    store(&mut index, 1, stored(&[77, 78], None, &range(0, 8), 4));
    let mut other = range(0, 12);
    other[5] = 1000;
    store(&mut index, 2, stored(&[5, 6, 7], None, &other, 4));
    let mut prompt = range(0, 16);
    prompt.push(3);
    assert_eq!(
        index.lookup(&prompt, Adapter::Base, MediumSet::GPU),
        [
            PrefixMatch {
                endpoint: 0,
                tokens: 12
            },
            PrefixMatch {
                endpoint: 1,
                tokens: 8
            },
            PrefixMatch {
                endpoint: 2,
                tokens: 4
            },
        ]
    );
    // The keys a prompt chains are the keys the events chained.
    assert_eq!(
        prompt_keys(&range(0, 12), 4, Adapter::Base),
        prompt_keys(&prompt, 4, Adapter::Base)[..3]
    );
}

#[test]
fn a_block_whose_parent_is_unknown_is_not_placed() {
    let mut index = KvIndex::default();
    store(&mut index, 0, stored(&[2, 3], Some(1), &range(4, 12), 4));
    let stats = index.stats(0).expect("known");
    assert_eq!((stats.blocks, stats.unplaced), (0, 2));
    assert_eq!(held(&index, 0, &range(4, 12), Adapter::Base), 0);
}

#[test]
fn the_cap_drops_the_oldest_blocks_first() {
    let mut index = KvIndex::new(3);
    for i in 0..5u32 {
        store(
            &mut index,
            0,
            stored(&[u64::from(i)], None, &range(i * 10, i * 10 + 4), 4),
        );
    }
    let holds = |index: &KvIndex, i: u32| held(index, 0, &range(i * 10, i * 10 + 4), Adapter::Base);
    assert_eq!(
        (0..5).map(|i| holds(&index, i)).collect::<Vec<_>>(),
        [0, 0, 4, 4, 4]
    );
    let stats = index.stats(0).expect("known");
    assert_eq!((stats.blocks, stats.evicted), (3, 2));
    // A removal then a store: the stale order entry is skipped, the next oldest goes.
    index.apply(0, &removed(&[3], None));
    store(&mut index, 0, stored(&[5], None, &range(50, 54), 4));
    store(&mut index, 0, stored(&[6], None, &range(60, 64), 4));
    assert_eq!(
        (2..7).map(|i| holds(&index, i)).collect::<Vec<_>>(),
        [0, 0, 4, 4, 4]
    );
    assert_eq!(index.stats(0).expect("known").evicted, 3);
}

#[test]
fn endpoints_of_different_block_sizes_are_walked_each_by_their_own() {
    let mut index = KvIndex::default();
    store(&mut index, 0, stored(&[1, 2, 3], None, &range(0, 12), 4));
    store(&mut index, 1, stored(&[1], None, &range(0, 8), 8));
    let prompt = range(0, 14);
    assert_eq!(held(&index, 0, &prompt, Adapter::Base), 12);
    assert_eq!(held(&index, 1, &prompt, Adapter::Base), 8);
}

#[test]
fn a_first_short_page_gives_way_to_the_engines_block_size() {
    let mut index = KvIndex::default();
    store(&mut index, 0, stored(&[1], None, &range(0, 2), 2));
    store(&mut index, 0, stored(&[2], None, &range(0, 4), 4));
    store(&mut index, 0, stored(&[3], Some(2), &range(4, 8), 4));
    let stats = index.stats(0).expect("known");
    assert_eq!(
        (stats.block_size, stats.blocks, stats.clears),
        (Some(4), 2, 1)
    );
    assert_eq!(held(&index, 0, &range(0, 9), Adapter::Base), 8);
}

#[test]
fn adapters_are_kept_apart() {
    let mut index = KvIndex::default();
    let mut lora = stored(&[1], None, &range(0, 4), 4);
    lora.lora_name = Some("sql".into());
    lora.extra_keys = Some(vec![Some(vec![Value::from("sql")])]);
    store(&mut index, 0, lora);
    let mut by_id = stored(&[2], None, &range(0, 4), 4);
    by_id.lora_id = Some(3);
    store(&mut index, 1, by_id);
    let prompt = range(0, 4);
    assert_eq!(held(&index, 0, &prompt, Adapter::Lora("sql")), 4);
    assert_eq!(held(&index, 0, &prompt, Adapter::Base), 0);
    assert_eq!(held(&index, 1, &prompt, Adapter::Base), 0);
    assert_eq!(held(&index, 1, &prompt, Adapter::LoraId(3)), 4);
}

#[test]
fn a_hash_stored_again_elsewhere_moves_there() {
    let mut index = KvIndex::default();
    // Old SGLang hashes a page's tokens alone: the same page after another is the same hash.
    store(&mut index, 0, stored(&[9], None, &range(0, 4), 4));
    store(&mut index, 0, stored(&[8], None, &range(10, 14), 4));
    store(&mut index, 0, stored(&[9], Some(8), &range(0, 4), 4));
    assert_eq!(held(&index, 0, &range(0, 4), Adapter::Base), 0);
    let mut moved = range(10, 14);
    moved.extend(range(0, 4));
    assert_eq!(held(&index, 0, &moved, Adapter::Base), 8);
}

#[test]
fn a_removed_endpoints_slot_is_reused_without_its_blocks() {
    let mut index = KvIndex::default();
    store(&mut index, 0, stored(&[1], None, &range(0, 4), 4));
    store(&mut index, 1, stored(&[1], None, &range(0, 4), 4));
    index.remove_endpoint(0);
    assert_eq!(index.stats(0), None);
    store(&mut index, 2, stored(&[5], None, &range(100, 104), 4));
    let prompt = range(0, 4);
    assert_eq!(
        index.lookup(&prompt, Adapter::Base, MediumSet::GPU),
        [
            PrefixMatch {
                endpoint: 1,
                tokens: 4
            },
            PrefixMatch {
                endpoint: 2,
                tokens: 0
            },
        ]
    );
    index.clear_endpoint(1);
    assert_eq!(held(&index, 1, &prompt, Adapter::Base), 0);
    assert_eq!(index.distinct_keys(), 1, "only endpoint 2's block");
}

#[test]
fn more_than_64_endpoints_each_drop_out_at_their_own_depth() {
    let mut index = KvIndex::default();
    let prompt = range(0, 4 * 10);
    for endpoint in 0..150u32 {
        let depth = endpoint % 11;
        let hashes: Vec<u64> = (0..u64::from(depth)).collect();
        if depth > 0 {
            store(
                &mut index,
                endpoint,
                stored(&hashes, None, &prompt[..4 * depth as usize], 4),
            );
        } else {
            // Known, with a block elsewhere.
            store(
                &mut index,
                endpoint,
                stored(&[0], None, &range(900, 904), 4),
            );
        }
    }
    let matches = index.lookup(&prompt, Adapter::Base, MediumSet::GPU);
    assert_eq!(matches.len(), 150);
    for m in matches {
        assert_eq!(m.tokens, 4 * (m.endpoint % 11) as usize, "{m:?}");
    }
}

/// A lookup walks a long prompt in stretches of keys (32 blocks, then 64, 128, 256): each
/// endpoint's depth must carry across their bounds, whether it drops out just before, at or
/// after one, holds the whole prompt, or the walk stops early once no endpoint matches.
#[test]
fn a_long_prompts_depths_carry_across_the_walks_stretches() {
    const BLOCKS: u32 = 500;
    let depths = [
        1, 31, 32, 33, 95, 96, 97, 223, 224, 225, 479, 480, 481, 499, BLOCKS,
    ];
    let mut prompt = range(0, 4 * BLOCKS);
    let mut index = KvIndex::default();
    for (endpoint, &depth) in (0u32..).zip(&depths) {
        let hashes: Vec<u64> = (0..u64::from(depth)).collect();
        store(
            &mut index,
            endpoint,
            stored(&hashes, None, &prompt[..4 * depth as usize], 4),
        );
    }
    // A partial last block: never cached, never matched.
    prompt.extend([7, 7]);
    let walked = |prompt: &[u32]| {
        index
            .lookup(prompt, Adapter::Base, MediumSet::GPU)
            .into_iter()
            .map(|m| m.tokens / 4)
            .collect::<Vec<_>>()
    };
    assert_eq!(walked(&prompt), depths.map(|depth| depth as usize));
    // Past block 300 no endpoint matches: the walk ends inside its fourth stretch.
    prompt[4 * 300] = 1_000_000;
    assert_eq!(walked(&prompt), depths.map(|depth| depth.min(300) as usize));
}

/// A lookup among some endpoints gives theirs as a lookup of all does, and leaves the others
/// out, whether they hold more of the prompt or are alone with their block size.
#[test]
fn a_lookup_among_some_endpoints_leaves_the_others_out() {
    let mut index = KvIndex::default();
    let prompt = range(0, 64);
    let hashes: Vec<u64> = (1..=16).collect();
    store(&mut index, 0, stored(&hashes, None, &prompt, 4));
    store(&mut index, 1, stored(&hashes[..2], None, &prompt[..8], 4));
    store(&mut index, 2, stored(&hashes[..1], None, &prompt[..8], 8));
    let among = |keep: &[EndpointId]| {
        index
            .lookup_among(&prompt, Adapter::Base, MediumSet::GPU, |e| {
                keep.contains(&e)
            })
            .into_iter()
            .map(|m| (m.endpoint, m.tokens))
            .collect::<Vec<_>>()
    };
    assert_eq!(among(&[0, 1, 2]), [(0, 64), (1, 8), (2, 8)]);
    assert_eq!(
        index
            .lookup(&prompt, Adapter::Base, MediumSet::GPU)
            .into_iter()
            .map(|m| (m.endpoint, m.tokens))
            .collect::<Vec<_>>(),
        among(&[0, 1, 2])
    );
    assert_eq!(among(&[1]), [(1, 8)]);
    assert_eq!(among(&[0, 2]), [(0, 64), (2, 8)]);
    assert_eq!(among(&[]), []);
}

/// A batch applied in steps of any size leaves the index as the batch applied whole: long
/// stored events cut anywhere chain on from where they stopped, removals go on where they
/// stopped, and what is skipped, unplaced or cleared counts the same.
#[test]
fn a_batch_applied_in_steps_leaves_what_it_leaves_applied_whole() {
    let prompt = range(0, 64);
    let mut extra_keyed = stored(&[30, 31, 32], Some(4), &range(100, 112), 4);
    extra_keyed.extra_keys = Some(vec![None, Some(vec![Value::from("salt")]), None]);
    let events = vec![
        Event::BlockStored(stored(
            &(1..=10).collect::<Vec<_>>(),
            None,
            &prompt[..40],
            4,
        )),
        Event::BlockStored(stored(&[11, 12, 13, 14, 15], Some(10), &prompt[40..60], 4)),
        removed(&[13, 2, 99, 14], None),
        Event::BlockStored(extra_keyed),
        Event::BlockStored(stored(&[40, 41], Some(77), &range(200, 208), 4)),
        Event::BlockStored(stored(&[50, 51, 52], None, &range(300, 312), 4)),
        Event::AllBlocksCleared,
        Event::BlockStored(stored(&[1, 2, 3], None, &prompt[..12], 4)),
        Event::BlockStored(stored(&[60, 61, 62, 63], Some(3), &prompt[12..28], 4)),
    ];
    let state = |index: &KvIndex| {
        let held: Vec<usize> = [&prompt[..], &range(300, 312), &range(100, 112)]
            .iter()
            .map(|p| held(index, 0, p, Adapter::Base))
            .collect();
        (held, index.stats(0), index.distinct_keys())
    };
    // Up to the clear, and all of it: the first leaves the long events' blocks to check.
    for (events, held) in [(&events[..6], [4, 12, 0]), (&events[..], [28, 0, 0])] {
        let batch = EventBatch {
            ts: 0.0,
            events: events.to_vec(),
            data_parallel_rank: None,
        };
        let mut whole = KvIndex::default();
        whole.apply_batch(0, &batch);
        assert_eq!(state(&whole).0, held, "the batch is worth checking");
        for step in [1, 2, 3, 4, 7, 100] {
            let mut index = KvIndex::default();
            let mut progress = BatchProgress::default();
            let mut steps = 1;
            while !index.apply_batch_step(0, &batch, &mut progress, step) {
                steps += 1;
                assert!(steps <= 40, "steps of {step} blocks end");
            }
            assert_eq!(state(&index), state(&whole), "steps of {step} blocks");
            if step == 1 {
                assert!(steps >= 20, "one block a step: {steps} steps");
            }
        }
    }
}

/// What the index must answer, kept the plainest way: per endpoint, its engine's live blocks
/// (hash → key and media) and their order of arrival, for the cap.
#[derive(Default)]
struct Model {
    blocks: HashMap<u64, (BlockKey, MediumSet)>,
    order: std::collections::VecDeque<u64>,
}

impl Model {
    fn drop_block(&mut self, hash: u64) {
        self.blocks.remove(&hash);
        self.order.retain(|&held| held != hash);
    }

    /// Leading blocks of `keys` held on any of `media`: a walk, with no shortcut.
    fn held(&self, keys: &[BlockKey], media: MediumSet) -> usize {
        let holds = |key: BlockKey| {
            self.blocks.values().any(|&(held, on)| {
                held == key
                    && Medium::EVERY
                        .iter()
                        .any(|&m| on.contains(m) && media.contains(m))
            })
        };
        keys.iter().take_while(|&&key| holds(key)).count()
    }

    /// Keys not held on the GPU with a child there.
    fn gpu_holes(&self, parents: &HashMap<BlockKey, Option<BlockKey>>) -> usize {
        let on_gpu: std::collections::HashSet<BlockKey> = self
            .blocks
            .values()
            .filter(|(_, on)| on.contains(Medium::Gpu))
            .map(|&(key, _)| key)
            .collect();
        let holes: std::collections::HashSet<BlockKey> = on_gpu
            .iter()
            .filter_map(|key| parents[key])
            .filter(|parent| !on_gpu.contains(parent))
            .collect();
        holes.len()
    }
}

/// Lookups agree with a brute-force walk over the model after every step of random stores
/// (from the root or after a block, on the GPU or the CPU), removals (of any block: leaves,
/// middles, roots), clears and the cap's evictions, on 4 endpoints whose prompts share
/// prefixes (3 tokens, blocks of 2), on the GPU (bisected) and on every tier (walked):
/// whether an endpoint has holes is checked against the model's, and endpoints with holes
/// and without, and deep answers, all occur.
#[test]
fn lookups_agree_with_a_brute_force_model_over_random_events() {
    agree_with_the_model(0, 6_000);
}

/// The same with the 4 endpoints in the second word of slots, behind 64 that hold a block no
/// prompt has.
#[test]
fn lookups_agree_with_the_model_past_the_first_64_endpoints() {
    agree_with_the_model(64, 2_000);
}

fn agree_with_the_model(behind: u32, steps: usize) {
    const ENDPOINTS: u32 = 4;
    const CAP: usize = 24;
    let mut index = KvIndex::new(CAP);
    let bystanders: Vec<EndpointId> = (1_000..1_000 + behind).collect();
    for &endpoint in &bystanders {
        store(&mut index, endpoint, stored(&[1], None, &[7, 7], 2));
    }
    let mut state = 0x0dd5_eed5_u64;
    let mut next = move |below: usize| {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (state >> 33) as usize % below
    };
    let mut models: Vec<Model> = (0..ENDPOINTS).map(|_| Model::default()).collect();
    let mut parents: HashMap<BlockKey, Option<BlockKey>> = HashMap::new();
    // An engine's hash for a block: its own, seeded per process, the same for the same key.
    let hash_of = |endpoint: u32, key: BlockKey| key.bits() ^ u64::from(endpoint + 1) << 56;
    let (mut whole, mut broken, mut deepest) = (0, 0, 0);
    let mut recent: Vec<Vec<u32>> = Vec::new();
    for step in 0..steps {
        let endpoint = next(ENDPOINTS as usize) as u32;
        let model = &mut models[endpoint as usize];
        match next(20) {
            0..=11 => {
                let prompt: Vec<u32> = (0..2 * (1 + next(8))).map(|_| next(3) as u32).collect();
                let keys = prompt_keys(&prompt, 2, Adapter::Base);
                recent.push(prompt.clone());
                for (i, &key) in keys.iter().enumerate() {
                    parents.insert(key, i.checked_sub(1).map(|i| keys[i]));
                }
                let from = next(keys.len()).min(next(keys.len()));
                let medium = if next(5) == 0 { "CPU" } else { "GPU" };
                let parent = from.checked_sub(1).map(|i| hash_of(endpoint, keys[i]));
                let hashes: Vec<u64> = keys[from..].iter().map(|&k| hash_of(endpoint, k)).collect();
                let mut event = stored(&hashes, parent, &prompt[2 * from..], 2);
                event.medium = Some(medium.into());
                store(&mut index, endpoint, event);
                if parent.is_none_or(|parent| model.blocks.contains_key(&parent)) {
                    for (&hash, &key) in hashes.iter().zip(&keys[from..]) {
                        let on = MediumSet::of(Medium::of(Some(medium)));
                        if let Some((_, media)) = model.blocks.get_mut(&hash) {
                            *media = media.with(Medium::of(Some(medium)));
                            continue;
                        }
                        while model.blocks.len() >= CAP {
                            let oldest = model.order[0];
                            model.drop_block(oldest);
                        }
                        model.blocks.insert(hash, (key, on));
                        model.order.push_back(hash);
                    }
                }
            }
            12..=18 => {
                let live: Vec<u64> = model.blocks.keys().copied().collect();
                let hashes: Vec<u64> = (0..1 + next(3))
                    .filter_map(|_| live.get(next(live.len().max(1))).copied())
                    .collect();
                let medium = if next(4) == 0 { "CPU" } else { "GPU" };
                index.apply(endpoint, &removed(&hashes, Some(medium)));
                for hash in hashes {
                    if let Some((_, media)) = model.blocks.get_mut(&hash) {
                        *media = media.without(Medium::of(Some(medium)));
                        if media.is_empty() {
                            model.drop_block(hash);
                        }
                    }
                }
            }
            _ => {
                index.apply(endpoint, &Event::AllBlocksCleared);
                *model = Model::default();
            }
        }
        for (endpoint, model) in (0..).zip(&models) {
            if let Some(blocks) = index.endpoints.get(&endpoint) {
                assert_eq!(
                    blocks.slot / 64,
                    behind as usize / 64,
                    "the word of slots meant"
                );
                let holes = model.gpu_holes(&parents);
                assert_eq!(blocks.has_holes(), holes > 0, "step {step}");
                whole += usize::from(holes == 0 && !model.blocks.is_empty());
                broken += usize::from(holes > 0);
                assert_eq!(blocks.len(), model.blocks.len(), "step {step}");
            }
        }
        for _ in 0..4 {
            // Most random prompts miss at once: half are stored ones, lengthened.
            let mut prompt = match recent.len() {
                0 => Vec::new(),
                stored => recent[next(stored)].clone(),
            };
            if next(2) == 0 {
                prompt.clear();
            }
            prompt.extend((0..2 * next(4) + next(2)).map(|_| next(3) as u32));
            let media = if next(3) == 0 {
                MediumSet::ALL
            } else {
                MediumSet::GPU
            };
            let keys = prompt_keys(&prompt, 2, Adapter::Base);
            let expected: Vec<PrefixMatch> = (0..)
                .zip(&models)
                .filter(|(endpoint, _)| index.endpoints.contains_key(endpoint))
                .map(|(endpoint, model)| PrefixMatch {
                    endpoint,
                    tokens: 2 * model.held(&keys, media),
                })
                .chain(bystanders.iter().map(|&endpoint| PrefixMatch {
                    endpoint,
                    tokens: 0,
                }))
                .collect();
            deepest = deepest.max(expected.iter().map(|m| m.tokens).max().unwrap_or(0));
            assert_eq!(
                index.lookup(&prompt, Adapter::Base, media),
                expected,
                "step {step}: {prompt:?}"
            );
        }
    }
    assert!(
        whole > steps / 6 && broken > steps / 6,
        "{whole} whole, {broken} broken"
    );
    assert!(deepest >= 12, "deepest match {deepest} tokens");
}
