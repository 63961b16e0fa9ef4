use super::*;

fn llama() -> &'static Llama {
    &crate::load::test_smollm2().0.llama
}

fn tokenizer() -> &'static tokenizers::Tokenizer {
    &crate::load::test_smollm2().1
}

fn encode(text: &str) -> Vec<u32> {
    tokenizer().encode(text, false).unwrap().get_ids().to_vec()
}

/// Runs `tokens` from an empty KV in chunks of the given sizes (the last chunk takes the
/// rest); returns the last position's logits and the KV.
fn run_chunked(tokens: &[u32], sizes: &[usize]) -> (Vec<f32>, Vec<f32>) {
    let llama = llama();
    let mut kv = Vec::new();
    let mut start = 0;
    let mut logits = None;
    let mut sizes = sizes.iter().copied();
    while start < tokens.len() {
        let n = sizes
            .next()
            .unwrap_or(tokens.len())
            .min(tokens.len() - start);
        let mut chunk = [SeqChunk {
            tokens: &tokens[start..start + n],
            start,
            kv: &mut kv,
            logits: start + n == tokens.len(),
        }];
        logits = llama.forward(&mut chunk).unwrap().pop().unwrap();
        start += n;
    }
    (logits.unwrap(), kv)
}

fn argmax(logits: &[f32]) -> u32 {
    logits
        .iter()
        .enumerate()
        .fold(
            (0, f32::NEG_INFINITY),
            |b, (i, &l)| if l > b.1 { (i, l) } else { b },
        )
        .0 as u32
}

#[test]
fn knows_the_capital_of_france() {
    let (logits, _) = run_chunked(&encode("The capital of France is"), &[]);
    assert_eq!(
        tokenizer().decode(&[argmax(&logits)], false).unwrap(),
        " Paris"
    );
}

/// The property a disaggregated run rests on: a position's logits (and every K/V) are the same
/// bits however the prompt was split into forward passes, whatever else shared the batch, and
/// when the earlier K/V went through a pool's bytes (what a transfer moves) in between.
#[test]
fn logits_are_bit_identical_across_batching_chunking_and_kv_export() {
    let tokens = encode(
        "In 1889 the Eiffel Tower was finished; 330 metres tall, it was the tallest structure \
         in the world until 1930, when the Chrysler Building passed it.",
    );
    assert!(
        tokens.len() > 33,
        "the prompt spans more than two 16-row tiles"
    );
    let (whole, whole_kv) = run_chunked(&tokens, &[]);
    let one_by_one = run_chunked(&tokens, &vec![1; tokens.len()]);
    let uneven = run_chunked(&tokens, &[5, 17, 1, 9]);
    for (name, (logits, kv)) in [("one by one", one_by_one), ("5,17,1,9", uneven)] {
        assert!(logits == whole, "{name}: logits differ");
        assert!(kv == whole_kv, "{name}: KV differs");
    }

    // Beside another sequence in the same pass, and after the first part's KV went through a
    // KV pool (bytes in, bytes out), as a transfer between engines does.
    let llama = llama();
    let cfg = *llama.config();
    let split = 13;
    let (_, head_kv) = run_chunked(&tokens[..split], &[]);
    let store = switchyard_kv::KvStore::new(cfg.kv_shape(), split as u32).unwrap();
    for (pos, slot) in head_kv.chunks_exact(cfg.slot_floats()).enumerate() {
        store.write_slot(pos as u32, bytemuck::cast_slice(slot));
    }
    let mut imported = vec![0.0f32; split * cfg.slot_floats()];
    for (pos, slot) in imported.chunks_exact_mut(cfg.slot_floats()).enumerate() {
        store.read_slot(pos as u32, bytemuck::cast_slice_mut(slot));
    }
    let other = encode("Hello there, how are you?");
    let mut other_kv = Vec::new();
    let mut batch = [
        SeqChunk {
            tokens: &other,
            start: 0,
            kv: &mut other_kv,
            logits: true,
        },
        SeqChunk {
            tokens: &tokens[split..],
            start: split,
            kv: &mut imported,
            logits: true,
        },
    ];
    let out = llama.forward(&mut batch).unwrap();
    assert!(
        out[1].as_deref() == Some(whole.as_slice()),
        "batched after import: logits differ"
    );
    assert!(imported == whole_kv, "batched after import: KV differs");
    let (alone, _) = run_chunked(&other, &[]);
    assert!(
        out[0].as_deref() == Some(alone.as_slice()),
        "the batch neighbour's logits differ"
    );
}

/// The forward pass alone, for the README: decode and prefill rates in this process, no engine
/// around it. Set `CANDLE_NUM_THREADS` for the matmul threads.
#[test]
#[ignore = "a measurement: cargo test -p switchyard-engine --lib forward_speed -- --ignored --nocapture"]
fn forward_speed() {
    let llama = llama();
    for context in [32, 256] {
        let prompt: Vec<u32> = (0..context).map(|i| 1000 + i).collect();
        let mut kv = Vec::new();
        let started = std::time::Instant::now();
        let mut chunk = [SeqChunk {
            tokens: &prompt,
            start: 0,
            kv: &mut kv,
            logits: true,
        }];
        let mut next = argmax(llama.forward(&mut chunk).unwrap()[0].as_ref().unwrap());
        let prefill = prompt.len() as f64 / started.elapsed().as_secs_f64();
        let started = std::time::Instant::now();
        for pos in prompt.len()..prompt.len() + 64 {
            let token = [next];
            let mut chunk = [SeqChunk {
                tokens: &token,
                start: pos,
                kv: &mut kv,
                logits: true,
            }];
            next = argmax(llama.forward(&mut chunk).unwrap()[0].as_ref().unwrap());
        }
        let decode = 64.0 / started.elapsed().as_secs_f64();
        eprintln!(
            "prefill {prefill:.0} tok/s ({context} tokens), decode {decode:.1} tok/s (at {context}..{})",
            context + 64
        );
    }
    // Batch 8: eight 32-token sequences decoding together, one token each per step.
    let mut kvs: Vec<Vec<_>> = (0..8).map(|_| Vec::new()).collect();
    let mut next: Vec<u32> = Vec::new();
    for (s, kv) in kvs.iter_mut().enumerate() {
        let prompt: Vec<u32> = (0..32).map(|i| 2000 + 50 * s as u32 + i).collect();
        let mut chunk = [SeqChunk {
            tokens: &prompt,
            start: 0,
            kv,
            logits: true,
        }];
        next.push(argmax(
            llama.forward(&mut chunk).unwrap()[0].as_ref().unwrap(),
        ));
    }
    let started = std::time::Instant::now();
    for pos in 32..32 + 32 {
        let tokens: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
        let mut chunks: Vec<SeqChunk<'_>> = tokens
            .iter()
            .zip(kvs.iter_mut())
            .map(|(token, kv)| SeqChunk {
                tokens: token,
                start: pos,
                kv,
                logits: true,
            })
            .collect();
        let logits = llama.forward(&mut chunks).unwrap();
        next = logits.iter().map(|l| argmax(l.as_ref().unwrap())).collect();
    }
    let aggregate = 8.0 * 32.0 / started.elapsed().as_secs_f64();
    eprintln!("batch 8: decode {aggregate:.1} tok/s aggregate (at 32..64)");
}
