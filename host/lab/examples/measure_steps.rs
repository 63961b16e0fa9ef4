//! Measures the reference engine's own steps and prints them as a timing table for
//! `switchyard lab --timing-table` (CSV `kind,tokens,batch,context,ms`).
//!
//! It drives the engine's scheduler core with the engine's GGUF backend (SmolLM2-135M from the
//! cache `make model` fills, or the GGUF given) on this machine's CPU, and times each
//! [`Core::step`] with the wall clock: one prefill of each length from an empty context, and
//! decode steps of each batch at each context (the batch shares its prompt, so one prefill
//! and the prefix cache put every sequence at that context). A figure is the median of a few
//! steps.
//!
//! ```sh
//! cargo run --release -p switchyard-lab --example measure_steps > examples/timing/smollm2-cpu.csv
//! ```

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use switchyard_engine::latency::{Latency, Profile, StepWork, TimingModel};
use switchyard_engine::llama::Llama;
use switchyard_engine::model::Sampling;
use switchyard_engine::scheduler::{
    Backend, Core, CoreConfig, GenRequest, LlamaModel, ModelSpec, Time,
};
use switchyard_kv::KvStore;
use switchyard_wire::gguf::GgufMetadata;

const PREFILL_TOKENS: [usize; 6] = [16, 64, 256, 512, 1024, 2048];
const DECODE_BATCHES: [usize; 3] = [1, 4, 16];
const DECODE_CONTEXTS: [usize; 3] = [128, 512, 1024];
/// Steps timed per figure; the median is reported.
const REPEATS: usize = 3;
const PAGE_SIZE: usize = 16;
const PAGES: u32 = 512;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = match std::env::args().nth(1) {
        Some(path) => PathBuf::from(path),
        None => switchyard_wire::gguf::smollm2_path().ok_or("no model cache: give a GGUF")?,
    };
    let meta = GgufMetadata::read(&path)?;
    let vocabulary = meta.vocabulary()?;
    let model = ModelSpec::Llama(Arc::new(LlamaModel {
        llama: Llama::load(&path, &meta)?,
        token_bytes: vocabulary.token_bytes,
        // No id ends a generation: every sequence decodes for its max_tokens.
        eos: Vec::new(),
    }));
    println!("# the reference engine's steps, measured by host/lab/examples/measure_steps.rs");
    println!("# model {}, CPU, median of {REPEATS} steps", path.display());
    println!("kind,tokens,batch,context,ms");
    for tokens in PREFILL_TOKENS {
        let ms = median((0..REPEATS).map(|_| prefill_ms(&model, tokens)).collect());
        println!("prefill,{tokens},,,{ms:.3}");
    }
    for batch in DECODE_BATCHES {
        for context in DECODE_CONTEXTS {
            let ms = decode_ms(&model, batch, context);
            println!("decode,,{batch},{context},{ms:.3}");
        }
    }
    Ok(())
}

/// A core with the model's backend, its steps costing nothing (the wall clock measures them).
fn core(model: &ModelSpec) -> Result<Core, Box<dyn std::error::Error>> {
    let shape = match model {
        ModelSpec::Llama(m) => m.llama.config().kv_shape(),
        ModelSpec::Synthetic => return Err("a GGUF model".into()),
    };
    let store = Arc::new(KvStore::new(shape, PAGES * PAGE_SIZE as u32)?.with_guarded_slots());
    let free: Arc<dyn TimingModel> = Arc::new(Latency {
        profile: Profile::NULL,
        time_scale: 0.0,
    });
    let config = CoreConfig {
        page_size: PAGE_SIZE,
        num_pages: PAGES,
        prefix_cache: true,
        prefill_chunk: *PREFILL_TOKENS.iter().max().unwrap_or(&2048),
        max_batch: 64,
        reservation_ttl: Duration::from_secs(30),
        expiry_quarantine: Duration::ZERO,
        preempt_every: None,
        timing: free,
    };
    Ok(Core::new(config, Backend::new(model, store)))
}

fn request(tokens: Vec<u32>, max_tokens: usize) -> GenRequest {
    GenRequest {
        tokens,
        sampling: Sampling::GREEDY,
        max_tokens,
        stop: Vec::new(),
        logprobs: false,
    }
}

/// A prompt of `len` token ids, `salt` making it differ from other prompts from its start.
fn prompt(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| 100 + (i * 7 + salt) % 20_000)
        .collect()
}

/// One step, timed; what it did.
fn timed_step(core: &mut Core) -> (StepWork, f64) {
    let started = Instant::now();
    let step = core.step(Time::ZERO);
    let ms = started.elapsed().as_secs_f64() * 1e3;
    core.take_due(Time::ZERO);
    (step.work, ms)
}

/// A prefill of `tokens` from an empty context, in one step.
fn prefill_ms(model: &ModelSpec, tokens: usize) -> f64 {
    let mut core = core(model).expect("a core");
    core.generate(request(prompt(tokens, 1), 1));
    let (work, ms) = timed_step(&mut core);
    assert_eq!(work.prefill_tokens, tokens, "one step prefills the prompt");
    ms
}

/// A decode step of `batch` sequences at `context` tokens each: the median of `REPEATS`.
fn decode_ms(model: &ModelSpec, batch: usize, context: usize) -> f64 {
    let mut core = core(model).expect("a core");
    let shared = prompt(context - 1, 2);
    // The first sequence's prefill fills the prefix cache, the others' prompts (the same but
    // for their last token) then prefill less than a page each.
    core.generate(request([shared.clone(), vec![1]].concat(), 64));
    timed_step(&mut core);
    for b in 1..batch {
        core.generate(request([shared.clone(), vec![1 + b as u32]].concat(), 64));
    }
    let mut samples = Vec::new();
    for _ in 0..64 {
        let (work, ms) = timed_step(&mut core);
        if work.prefill_tokens == 0 && work.decode_seqs == batch {
            samples.push(ms);
            if samples.len() == REPEATS {
                break;
            }
        }
    }
    assert_eq!(samples.len(), REPEATS, "the batch decodes together");
    median(samples)
}

fn median(mut samples: Vec<f64>) -> f64 {
    samples.sort_by(f64::total_cmp);
    samples[samples.len() / 2]
}
