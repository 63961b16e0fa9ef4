//! The index at the size it must serve: 64 endpoints holding 100k blocks of 16 tokens each,
//! prefixes shared the way a multi-turn conversation trace shares them, and a 32k-token prompt
//! looked up on the request path. Criterion times lookups and event application; the summary
//! printed first gives what criterion does not: lookup percentiles (alone, with the prompt's
//! lines cached, and beside a writer holding the lock for each batch), the index's bytes per
//! block and the huge pages backing it, and how long a prefill's batch holds the write lock,
//! whole and in steps.
//!
//! The fleet (deterministic; every engine names blocks with its own hashes):
//! - 8 system prompts of 2,048 tokens (128 blocks), cached by every endpoint;
//! - conversations, each on a system prompt, with a history of 1k to 30k tokens after it; a
//!   conversation's home endpoint holds all of it, the next endpoint (where an earlier turn was
//!   routed) a prefix of random length; the first conversation homed on each endpoint is 30k
//!   tokens long, so a 32k prompt (its next turn) is held whole there;
//! - conversations are added round robin until every endpoint holds 100k blocks.
//!
//! A lookup of such a next turn walks all 2,048 of its blocks (its home endpoint matches to the
//! end); a new conversation's first turn stops after its system prompt's 128.

use std::hint::black_box;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use criterion::{BatchSize, Criterion, criterion_group, criterion_main};
use parking_lot::RwLock;
use switchyard_kv_index::{Adapter, BatchProgress, KvIndex, MediumSet};
use switchyard_wire::kv_events::{BlockHash, BlockRemoved, BlockStored, Event, EventBatch};

const BLOCK: usize = 16;
const ENDPOINTS: u32 = 64;
const BLOCKS_PER_ENDPOINT: usize = 100_000;
const SYSTEM_PROMPTS: u64 = 8;
const SYSTEM_BLOCKS: usize = 128;
const PROMPT_TOKENS: usize = 32 * 1024;
const LONGEST_HISTORY: usize = PROMPT_TOKENS / BLOCK - SYSTEM_BLOCKS - 128;
/// vLLM publishes a prefill's blocks in one event; chunks of this many blocks.
const BLOCKS_PER_EVENT: usize = 128;

/// splitmix64: deterministic, dependency-free.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

fn tokens(stream: u64, count: usize) -> Vec<u32> {
    (0..count as u64)
        .map(|i| (mix(mix(stream) ^ i) % 150_000) as u32)
        .collect()
}

struct Conversation {
    system: u64,
    history: Vec<u32>,
}

struct Fleet {
    system_prompts: Vec<Vec<u32>>,
    /// The first conversation homed on each endpoint: 30k tokens after its system prompt.
    long: Vec<Conversation>,
    index: KvIndex,
    blocks: usize,
}

/// Stores `tokens` (whole blocks) on `endpoint` after `parent`, as the engine's events would,
/// returning the last block's engine hash.
fn store_chain(
    index: &mut KvIndex,
    endpoint: u32,
    stream: u64,
    parent: Option<u64>,
    tokens: &[u32],
) -> Option<u64> {
    let mut parent = parent;
    for (n, chunk) in tokens.chunks(BLOCK * BLOCKS_PER_EVENT).enumerate() {
        let hashes: Vec<u64> = (0..chunk.len() / BLOCK)
            .map(|i| block_hash(endpoint, stream, n * BLOCKS_PER_EVENT + i))
            .collect();
        let event = BlockStored::new(
            hashes.iter().copied().map(BlockHash::Int).collect(),
            parent.map(BlockHash::Int),
            chunk.to_vec(),
            BLOCK as u32,
        );
        index.apply(endpoint, &Event::BlockStored(event));
        parent = hashes.last().copied();
    }
    parent
}

/// `endpoint`'s hash for block `block` of a chain of `stream`.
fn block_hash(endpoint: u32, stream: u64, block: usize) -> u64 {
    // Not `stream ^ mix(block)`: symmetric in the two, conversation c's block j would be
    // conversation j's block c.
    mix(mix(stream) ^ (u64::from(endpoint) << 40 | block as u64))
}

fn fleet() -> Fleet {
    let mut index = KvIndex::new(BLOCKS_PER_ENDPOINT);
    let system_prompts: Vec<Vec<u32>> = (0..SYSTEM_PROMPTS)
        .map(|s| tokens(0x5157 ^ s, SYSTEM_BLOCKS * BLOCK))
        .collect();
    let mut held = vec![0usize; ENDPOINTS as usize];
    let mut system_tail = vec![Vec::new(); ENDPOINTS as usize];
    for endpoint in 0..ENDPOINTS {
        for (s, prompt) in system_prompts.iter().enumerate() {
            let tail = store_chain(&mut index, endpoint, 0xa11 ^ s as u64, None, prompt);
            system_tail[endpoint as usize].push(tail);
        }
        held[endpoint as usize] = SYSTEM_PROMPTS as usize * SYSTEM_BLOCKS;
    }
    let mut long = Vec::new();
    let mut c = 0u64;
    while held.iter().any(|&h| h < BLOCKS_PER_ENDPOINT) {
        let home = (c % u64::from(ENDPOINTS)) as u32;
        let replica = (home + 1) % ENDPOINTS;
        let system = mix(c ^ 0x5) % SYSTEM_PROMPTS;
        let blocks = if c < u64::from(ENDPOINTS) {
            LONGEST_HISTORY
        } else {
            64 + (mix(c ^ 0xd) % (LONGEST_HISTORY as u64 - 64)) as usize
        };
        let history = tokens(0xc0 ^ mix(c), blocks * BLOCK);
        for (endpoint, depth) in [
            (home, blocks),
            (replica, (mix(c ^ 0xe) % (blocks as u64 + 1)) as usize),
        ] {
            let room = BLOCKS_PER_ENDPOINT - held[endpoint as usize].min(BLOCKS_PER_ENDPOINT);
            let depth = depth.min(room);
            let parent = system_tail[endpoint as usize][system as usize];
            store_chain(
                &mut index,
                endpoint,
                mix(c),
                parent,
                &history[..depth * BLOCK],
            );
            held[endpoint as usize] += depth;
        }
        if c < u64::from(ENDPOINTS) {
            long.push(Conversation { system, history });
        }
        c += 1;
    }
    Fleet {
        system_prompts,
        long,
        index,
        blocks: held.iter().sum(),
    }
}

impl Fleet {
    /// The next turn of the long conversation homed on `endpoint`: 32k tokens, all cached there.
    fn next_turn(&self, endpoint: usize) -> Vec<u32> {
        let conversation = &self.long[endpoint];
        let mut prompt = self.system_prompts[conversation.system as usize].clone();
        prompt.extend_from_slice(&conversation.history);
        prompt.extend(tokens(0x7e ^ endpoint as u64, PROMPT_TOKENS - prompt.len()));
        prompt
    }

    /// A new conversation's first 32k-token turn on a system prompt.
    fn first_turn(&self, n: usize) -> Vec<u32> {
        let mut prompt = self.system_prompts[n % SYSTEM_PROMPTS as usize].clone();
        prompt.extend(tokens(0xf1 ^ n as u64, PROMPT_TOKENS - prompt.len()));
        prompt
    }
}

fn percentiles(mut samples: Vec<Duration>) -> (Duration, Duration) {
    samples.sort_unstable();
    let at = |q: f64| samples[((samples.len() - 1) as f64 * q) as usize];
    (at(0.50), at(0.99))
}

/// Per lookup: wall time, and the thread's CPU time (what the lookup costs when it is not
/// preempted: this machine's other tenants lengthen the wall-clock tail, not the work).
struct Samples {
    wall: Vec<Duration>,
    cpu: Vec<Duration>,
}

fn thread_cpu_time() -> Duration {
    let now = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    Duration::new(
        u64::try_from(now.tv_sec).unwrap_or(0),
        u32::try_from(now.tv_nsec).unwrap_or(0),
    )
}

fn time_lookups(index: &RwLock<KvIndex>, prompts: &[Vec<u32>], rounds: usize) -> Samples {
    let mut samples = Samples {
        wall: Vec::with_capacity(rounds * prompts.len()),
        cpu: Vec::with_capacity(rounds * prompts.len()),
    };
    for _ in 0..rounds {
        for prompt in prompts {
            let (start, cpu_start) = (Instant::now(), thread_cpu_time());
            black_box(index.read().lookup(prompt, Adapter::Base, MediumSet::GPU));
            samples.cpu.push(thread_cpu_time() - cpu_start);
            samples.wall.push(start.elapsed());
        }
    }
    samples
}

impl Samples {
    fn report(self, what: &str, blocks: usize) {
        let (p50, p99) = percentiles(self.wall);
        let (cpu50, cpu99) = percentiles(self.cpu);
        println!(
            "{what} ({blocks} blocks walked): wall p50 {p50:?} p99 {p99:?}; thread CPU p50 {cpu50:?} p99 {cpu99:?} ({:.1} ns/block at CPU p50)",
            cpu50.as_nanos() as f64 / blocks as f64
        );
    }
}

/// Resident set size in bytes, from /proc (Linux).
fn rss_bytes() -> Option<usize> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: usize = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * 4096)
}

/// Memory backed by transparent huge pages, in bytes, from /proc (Linux).
fn huge_page_bytes() -> Option<usize> {
    let rollup = std::fs::read_to_string("/proc/self/smaps_rollup").ok()?;
    let line = rollup.lines().find(|l| l.starts_with("AnonHugePages:"))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib << 10)
}

/// `count` decode steps' events, round robin over the endpoints: each a new block, never
/// stored before (`round` tells rounds apart), so at the cap each one evicts the oldest.
fn decode_step_events(round: u64, count: usize) -> Vec<(u32, Event)> {
    (0..count)
        .map(|i| {
            let endpoint = (i % ENDPOINTS as usize) as u32;
            let stream = mix(0x5ee ^ (round << 32) ^ i as u64);
            let event = BlockStored::new(
                vec![BlockHash::Int(mix(stream))],
                None,
                tokens(stream, BLOCK),
                BLOCK as u32,
            );
            (endpoint, Event::BlockStored(event))
        })
        .collect()
}

fn summary(fleet: Fleet) -> Fleet {
    let hits: Vec<Vec<u32>> = (0..ENDPOINTS as usize)
        .map(|e| fleet.next_turn(e))
        .collect();
    let misses: Vec<Vec<u32>> = (0..ENDPOINTS as usize)
        .map(|n| fleet.first_turn(n))
        .collect();
    let index = RwLock::new(fleet.index);
    let matched = index.read().lookup(&hits[0], Adapter::Base, MediumSet::GPU);
    assert_eq!(
        matched[0].tokens,
        PROMPT_TOKENS - 128 * BLOCK,
        "the home holds the history"
    );
    assert_eq!(
        matched[2].tokens,
        SYSTEM_BLOCKS * BLOCK,
        "others hold the system prompt"
    );

    let walked = PROMPT_TOKENS / BLOCK - 128;
    if std::env::var_os("LOOKUP_LOOP").is_some() {
        eprintln!("LOOPING");
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(20) {
            time_lookups(&index, &hits, 1);
        }
        std::process::exit(0);
    }
    time_lookups(&index, &hits, 30).report("lookup, 32k-token next turn", walked);
    time_lookups(&index, &misses, 30).report("lookup, 32k-token first turn", SYSTEM_BLOCKS + 1);
    // The same prompt again and again: its lines stay in the caches, leaving the hashing and
    // the walk (what the lookups above spend beyond this is waiting on memory).
    time_lookups(&index, &hits[..1], 1_000)
        .report("lookup, 32k-token next turn, lines cached", walked);
    broken_chain(&index, &hits, walked);

    // The runtime layout: subscriber tasks take the write lock per batch while requests look up.
    let index = Arc::new(index);
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (index, stop) = (index.clone(), stop.clone());
        let fleet_events = {
            (0..4096u64)
                .map(|i| {
                    let endpoint = (i % u64::from(ENDPOINTS)) as u32;
                    let hash = mix(0xbad ^ i);
                    let stored = BlockStored::new(
                        vec![BlockHash::Int(hash)],
                        None,
                        tokens(hash, BLOCK),
                        BLOCK as u32,
                    );
                    (endpoint, hash, Event::BlockStored(stored))
                })
                .collect::<Vec<_>>()
        };
        std::thread::spawn(move || {
            let mut batches = 0u64;
            while !stop.load(Ordering::Relaxed) {
                // A batch of 16 stores then their removals, one lock each: the index's size
                // stays put.
                for chunk in fleet_events.chunks(16) {
                    let mut guard = index.write();
                    for (endpoint, _, event) in chunk {
                        guard.apply(*endpoint, event);
                    }
                    drop(guard);
                    let mut guard = index.write();
                    for (endpoint, hash, _) in chunk {
                        let removed = Event::BlockRemoved(BlockRemoved {
                            block_hashes: vec![BlockHash::Int(*hash)],
                            medium: None,
                            group_idx: None,
                        });
                        guard.apply(*endpoint, &removed);
                    }
                    batches += 2;
                }
            }
            batches
        })
    };
    let started = Instant::now();
    let samples = time_lookups(&index, &hits, 30);
    let elapsed = started.elapsed();
    stop.store(true, Ordering::Relaxed);
    let batches = writer.join().expect("writer");
    samples.report(
        &format!(
            "lookup beside a writer ({:.0} write-locked batches of 16 events/s), next turn",
            batches as f64 / elapsed.as_secs_f64()
        ),
        walked,
    );
    let index = Arc::into_inner(index).expect("writer joined").into_inner();
    Fleet { index, ..fleet }
}

/// Lookups while one endpoint's chain is broken: block 1,000 of the history of the long
/// conversation homed on endpoint 0 evicted, the blocks after it kept (a hole). Every key a
/// lookup chains is then also looked up among the holes (a table of one entry here), and
/// endpoint 0's bisection stops at its hole; storing the block again mends the chain.
fn broken_chain(index: &RwLock<KvIndex>, hits: &[Vec<u32>], walked: usize) {
    const BROKEN_AT: usize = 1_000;
    let whole = index.read().lookup(&hits[0], Adapter::Base, MediumSet::GPU);
    let hash = |block| BlockHash::Int(block_hash(0, mix(0), block));
    let removed = Event::BlockRemoved(BlockRemoved {
        block_hashes: vec![hash(BROKEN_AT)],
        medium: None,
        group_idx: None,
    });
    index.write().apply(0, &removed);
    let matched = index.read().lookup(&hits[0], Adapter::Base, MediumSet::GPU);
    assert_eq!(matched[0].tokens, (SYSTEM_BLOCKS + BROKEN_AT) * BLOCK);
    time_lookups(index, hits, 30).report(
        "lookup, 32k-token next turn, endpoint 0's chain broken",
        walked,
    );
    let start = (SYSTEM_BLOCKS + BROKEN_AT) * BLOCK;
    let mended = BlockStored::new(
        vec![hash(BROKEN_AT)],
        Some(hash(BROKEN_AT - 1)),
        hits[0][start..start + BLOCK].to_vec(),
        BLOCK as u32,
    );
    index.write().apply(0, &Event::BlockStored(mended));
    assert_eq!(
        index.read().lookup(&hits[0], Adapter::Base, MediumSet::GPU),
        whole,
        "mended"
    );
}

/// How long a subscriber holds the write lock for a batch holding one 512-block prefill (an
/// engine step's worth) at the cap: all of it at once, or in steps of `blocks` blocks with the
/// lock released between them. A lookup arriving meanwhile waits up to one such section.
fn write_sections(index: &mut KvIndex, blocks: usize) {
    const PREFILL_BLOCKS: usize = 512;
    let mut sections = Vec::new();
    for round in 0..32u64 {
        let endpoint = (round % u64::from(ENDPOINTS)) as u32;
        let stream = mix(0x5ec7 ^ u64::from(blocks as u32) << 32 ^ round);
        let hashes = (0..PREFILL_BLOCKS as u64)
            .map(|i| BlockHash::Int(mix(stream ^ i)))
            .collect();
        let stored = BlockStored::new(
            hashes,
            None,
            tokens(stream, PREFILL_BLOCKS * BLOCK),
            BLOCK as u32,
        );
        let batch = EventBatch {
            ts: 0.0,
            events: vec![Event::BlockStored(stored)],
            data_parallel_rank: None,
        };
        let mut progress = BatchProgress::default();
        loop {
            let started = thread_cpu_time();
            let done = index.apply_batch_step(endpoint, &batch, &mut progress, blocks);
            sections.push(thread_cpu_time() - started);
            if done {
                break;
            }
        }
    }
    let (p50, p99) = percentiles(sections.clone());
    let longest = sections.iter().max().copied().unwrap_or_default();
    let steps = match blocks {
        usize::MAX => "whole".to_owned(),
        blocks => format!("in steps of {blocks} blocks"),
    };
    println!(
        "write sections, 512-block prefill events at the cap, {steps}: p50 {p50:?} p99 {p99:?} longest {longest:?} (thread CPU)"
    );
}

fn total_evicted(index: &KvIndex) -> u64 {
    (0..ENDPOINTS)
        .filter_map(|endpoint| index.stats(endpoint))
        .map(|stats| stats.evicted)
        .sum()
}

fn benches(c: &mut Criterion) {
    let rss_before = rss_bytes();
    let started = Instant::now();
    let fleet = fleet();
    let built = started.elapsed();
    let rss_after = rss_bytes();
    let heap = fleet.index.heap_bytes();
    println!(
        "built {} blocks ({} distinct keys) on {ENDPOINTS} endpoints in {built:?}: {:.0} blocks/s applied",
        fleet.blocks,
        fleet.index.distinct_keys(),
        fleet.blocks as f64 / built.as_secs_f64()
    );
    println!(
        "memory: {:.1} B/block from table capacities ({} MiB){}",
        heap as f64 / fleet.blocks as f64,
        heap >> 20,
        match (rss_before, rss_after) {
            (Some(before), Some(after)) => format!(
                ", {:.1} B/block resident ({} MiB, with the events' garbage)",
                (after - before) as f64 / fleet.blocks as f64,
                (after - before) >> 20
            ),
            _ => String::new(),
        }
    );
    // The holders' table asks for them (with `transparent_hugepage` in mode madvise or
    // always): without, nearly every probe of a lookup also misses the TLB.
    if let Some(huge) = huge_page_bytes() {
        println!("huge pages: {} MiB of the process", huge >> 20);
    }
    let fleet = summary(fleet);

    let hit = fleet.next_turn(7);
    let miss = fleet.first_turn(3);
    let mut group = c.benchmark_group("lookup");
    group
        .sample_size(50)
        .measurement_time(Duration::from_secs(5));
    group.bench_function("32k_next_turn_64x100k", |b| {
        b.iter(|| {
            fleet
                .index
                .lookup(black_box(&hit), Adapter::Base, MediumSet::GPU)
        })
    });
    group.bench_function("32k_first_turn_64x100k", |b| {
        b.iter(|| {
            fleet
                .index
                .lookup(black_box(&miss), Adapter::Base, MediumSet::GPU)
        })
    });
    group.finish();

    let mut index = fleet.index;
    write_sections(&mut index, usize::MAX);
    write_sections(&mut index, 64);

    // Steady state: every endpoint at its cap, so each store also evicts the oldest block.
    // Every iteration stores blocks no endpoint holds (storing a held block again is a no-op).
    const DECODE_STEPS: usize = 64 * 1024;
    let evicted_before = total_evicted(&index);
    let mut round = 0;
    let (mut stores, mut cpu) = (0, Duration::ZERO);
    let mut group = c.benchmark_group("apply");
    group
        .sample_size(20)
        .measurement_time(Duration::from_secs(5));
    group.throughput(criterion::Throughput::Elements(DECODE_STEPS as u64));
    group.bench_function("one_block_stores_at_cap_64x100k", |b| {
        b.iter_batched(
            || {
                round += 1;
                decode_step_events(round, DECODE_STEPS)
            },
            |events| {
                let started = thread_cpu_time();
                for (endpoint, event) in &events {
                    index.apply(*endpoint, event);
                }
                cpu += thread_cpu_time() - started;
                stores += events.len();
                events
            },
            BatchSize::LargeInput,
        )
    });
    group.finish();
    println!(
        "stores at the cap: {stores} stored, {} evicted; {:.0} events/s of thread CPU",
        total_evicted(&index) - evicted_before,
        stores as f64 / cpu.as_secs_f64()
    );
    let mut group = c.benchmark_group("apply_blocks");
    group
        .sample_size(10)
        .measurement_time(Duration::from_secs(5));
    group.throughput(criterion::Throughput::Elements(
        u64::from(ENDPOINTS) * 4 * BLOCKS_PER_EVENT as u64,
    ));
    let (mut stored, mut cpu) = (0, Duration::ZERO);
    group.bench_function("128_block_prefill_events_into_empty_index", |b| {
        b.iter_batched(
            || KvIndex::new(BLOCKS_PER_ENDPOINT),
            |mut index| {
                let started = thread_cpu_time();
                for endpoint in 0..ENDPOINTS {
                    store_chain(
                        &mut index,
                        endpoint,
                        1,
                        None,
                        &hit[..BLOCK * BLOCKS_PER_EVENT * 4],
                    );
                }
                cpu += thread_cpu_time() - started;
                stored += ENDPOINTS as usize * 4 * BLOCKS_PER_EVENT;
                index
            },
            BatchSize::LargeInput,
        )
    });
    group.finish();
    println!(
        "128-block prefill events into an empty index: {:.0} blocks/s of thread CPU, making the events included",
        stored as f64 / cpu.as_secs_f64()
    );
}

criterion_group!(index, benches);
criterion_main!(index);
