//! The core's KV events against the router's index: fed with them, the index predicts every
//! prefix-cache hit the core then reports, through evictions, prompts that continue generated
//! text, and requests computed side by side; and the events fall due with their step.

use rand::rngs::StdRng;
use rand::{Rng as _, SeedableRng as _};
use switchyard_kv_index::{Adapter, KvIndex, MediumSet};
use switchyard_wire::kv_events::Event as KvEvent;

use super::*;

/// `config`'s page size.
const PAGE: usize = 4;

fn core_with_events(num_pages: u32) -> Core {
    // Prefills of a few steps, so pages of requests side by side are stored in turns.
    let cfg = CoreConfig {
        prefix_cache: true,
        prefill_chunk: 8,
        ..config(num_pages)
    };
    Core::new(cfg, Backend::costless()).with_kv_events(0x5eed)
}

/// What an index fed with the core's events says the core will serve of `prompt`: the prefix
/// it holds, short of the prompt's last token, which a generation computes itself.
fn predicted(index: &KvIndex, prompt: &[u32]) -> usize {
    let held = index
        .lookup(prompt, Adapter::Base, MediumSet::GPU)
        .first()
        .map_or(0, |m| m.tokens);
    held.min((prompt.len() - 1) / PAGE * PAGE)
}

/// A core on a fake clock whose events go to an index as they fall due.
struct Driver {
    core: Core,
    index: KvIndex,
    now: Time,
    stored: usize,
    removed: usize,
}

/// How a generation ended, and the ids it generated.
struct Ended {
    usage: Usage,
    finish: FinishReason,
    generated: Vec<u32>,
}

impl Driver {
    fn new(core: Core) -> Self {
        Driver {
            core,
            index: KvIndex::default(),
            now: Time::ZERO,
            stored: 0,
            removed: 0,
        }
    }

    /// Runs the core until every generation of `ids` has ended.
    fn run(&mut self, ids: &[RequestId]) -> HashMap<RequestId, Ended> {
        let mut generated: HashMap<RequestId, Vec<u32>> = HashMap::new();
        let mut ended = HashMap::new();
        for _ in 0..10_000 {
            if ended.len() == ids.len() {
                return ended;
            }
            let step = self.core.step(self.now);
            self.now = step.end;
            for output in self.core.take_due(self.now) {
                match output {
                    Output::KvEvents(events) => self.apply(&events),
                    Output::Event { id, event } => {
                        let ids = generated.entry(id).or_default();
                        ids.extend(&event.token_ids);
                        if let Some((finish, usage)) = event.finish {
                            let generated = std::mem::take(ids);
                            ended.insert(
                                id,
                                Ended {
                                    usage,
                                    finish,
                                    generated,
                                },
                            );
                        }
                    }
                    _ => {}
                }
            }
        }
        panic!(
            "{} of {} generations ended in 10,000 steps",
            ended.len(),
            ids.len()
        );
    }

    fn apply(&mut self, events: &[KvEvent]) {
        for event in events {
            match event {
                KvEvent::BlockStored(s) => self.stored += s.block_hashes.len(),
                KvEvent::BlockRemoved(r) => self.removed += r.block_hashes.len(),
                KvEvent::AllBlocksCleared => {}
            }
            self.index.apply(0, event);
        }
    }
}

/// A prompt from one of a few documents (so prompts share prefixes), or the last prompt
/// continued with what it generated (so pages completed by generated tokens count too).
fn next_prompt(rng: &mut StdRng, documents: &[Vec<u32>], last: Option<Vec<u32>>) -> Vec<u32> {
    let mut prompt = match last {
        Some(last) if rng.random_bool(0.3) && last.len() < 48 => last,
        _ => {
            let document = &documents[rng.random_range(0..documents.len())];
            document[..rng.random_range(3..=document.len())].to_vec()
        }
    };
    let suffix = rng.random_range(0..6);
    prompt.extend((0..suffix).map(|_| rng.random_range(0..200u32)));
    prompt
}

#[test]
fn an_index_fed_the_events_predicts_every_hit_the_core_reports() {
    let mut rng = StdRng::seed_from_u64(28);
    let documents: Vec<Vec<u32>> = (0..4)
        .map(|_| (0..40).map(|_| rng.random_range(0..200u32)).collect())
        .collect();
    // 32 pages of 4: far fewer than the documents' prefixes take, so pages are evicted.
    let mut driver = Driver::new(core_with_events(32));
    let (mut checked, mut hit_tokens, mut last) = (0, 0, None);
    for _ in 0..200 {
        // Up to four requests at once; the first is admitted before the others touch the
        // cache, so the index predicts it exactly.
        let prompts: Vec<Vec<u32>> = (0..rng.random_range(1..=4))
            .map(|_| next_prompt(&mut rng, &documents, last.clone()))
            .collect();
        let expected = predicted(&driver.index, &prompts[0]);
        let ids: Vec<RequestId> = prompts
            .iter()
            .map(|tokens| {
                driver.core.generate(GenRequest {
                    tokens: tokens.clone(),
                    max_tokens: rng.random_range(1..16),
                    ..request(b"", 0)
                })
            })
            .collect();
        let mut ended = driver.run(&ids);
        let first = ended.remove(&ids[0]).expect("ran");
        if first.finish == FinishReason::Preempt {
            continue;
        }
        assert_eq!(
            first.usage.cached_tokens, expected,
            "prompt {:?} after {checked} checked",
            prompts[0]
        );
        checked += 1;
        hit_tokens += expected;
        last = Some([&prompts[0][..], &first.generated].concat());
    }
    let stats = driver.index.stats(0).expect("events came");
    assert_eq!(stats.unplaced, 0, "every stored block named a known parent");
    assert!(checked > 150, "{checked} predictions checked");
    assert!(
        hit_tokens > 1000,
        "{hit_tokens} tokens served from the cache"
    );
    assert!(
        driver.removed > 100 && driver.stored > driver.removed,
        "stored {} blocks, evicted {}",
        driver.stored,
        driver.removed
    );
}

#[test]
fn a_steps_events_fall_due_when_it_ends_before_its_answers() {
    let timing: Arc<dyn TimingModel> = Arc::new(Latency {
        profile: Profile::LLAMA3_8B_H100,
        time_scale: 1.0,
    });
    let cfg = CoreConfig {
        prefix_cache: true,
        timing,
        ..config(64)
    };
    let prompt: Vec<u32> = (0..40).collect();
    let mut core = Core::new(cfg.clone(), Backend::costless()).with_kv_events(1);
    let id = core.generate(GenRequest {
        tokens: prompt.clone(),
        ..request(b"", 2)
    });
    let step = core.step(Time::ZERO);
    assert!(
        core.take_due(Time::ZERO).is_empty(),
        "the step has only begun"
    );
    let due = core.take_due(step.end);
    let [Output::KvEvents(events), Output::Event { id: answered, .. }] = &due[..] else {
        panic!("{due:?}");
    };
    assert_eq!(*answered, id);
    // The prompt's ten pages, computed in this step, in one event that starts the prompt.
    let [KvEvent::BlockStored(stored)] = &events[..] else {
        panic!("{events:?}");
    };
    assert_eq!(
        (
            stored.block_hashes.len(),
            stored.block_size,
            stored.parent_block_hash.as_ref()
        ),
        (10, PAGE as u32, None)
    );
    assert_eq!(stored.token_ids, prompt);
    assert_eq!(stored.medium.as_deref(), Some("GPU"));

    // A core nobody listens to reports nothing.
    let mut quiet = Core::new(cfg, Backend::costless());
    quiet.generate(GenRequest {
        tokens: prompt,
        ..request(b"", 2)
    });
    let step = quiet.step(Time::ZERO);
    let due = quiet.take_due(step.end);
    assert!(
        !due.iter().any(|o| matches!(o, Output::KvEvents(_))),
        "{due:?}"
    );
}
