use super::*;

/// Runs the model the way an engine does: one slot per token, digests read back from the
/// bytes, greedy or sampled continuation for `n` tokens.
fn generate(model: &Model, prompt: &[u32], n: usize, sampling: &Sampling) -> Vec<u32> {
    let mut tokens = prompt.to_vec();
    let mut slots: Vec<Vec<u8>> = Vec::new();
    let mut h = model.chain_start();
    let mut out = Vec::new();
    while out.len() < n {
        for (i, &t) in tokens.iter().enumerate().skip(slots.len()) {
            h = Model::chain_step(h, t, i);
            let mut slot = vec![0; model.bytes_per_token()];
            model.fill_kv(h, &mut slot);
            slots.push(slot);
        }
        let digests = slots.iter().map(|s| Model::slot_digest(s));
        let next = model.next_token(digests, tokens.len() - 1, sampling).token;
        out.push(next);
        if next == Model::EOS {
            break;
        }
        tokens.push(next);
    }
    out
}

fn digests_of(model: &Model, tokens: &[u32]) -> Vec<u64> {
    model
        .chain(tokens)
        .into_iter()
        .map(|h| model.digest_of(h))
        .collect()
}

#[test]
fn greedy_is_deterministic_and_printable() {
    let model = Model::new(KvShape::SMALL);
    let a = generate(
        &model,
        b"hello world".map(u32::from).as_slice(),
        64,
        &Sampling::GREEDY,
    );
    let b = generate(
        &model,
        b"hello world".map(u32::from).as_slice(),
        64,
        &Sampling::GREEDY,
    );
    assert_eq!(a, b);
    assert!(
        a.iter()
            .all(|&t| t == Model::EOS || (32..=126).contains(&t)),
        "{a:?}"
    );
}

#[test]
fn corrupting_one_slot_changes_the_next_token() {
    let model = Model::new(KvShape::SMALL);
    let prompt: Vec<u32> = (0..40).map(|i| (i * 7 + 3) % 256).collect();
    let good = digests_of(&model, &prompt);
    let expected = model
        .next_token(good.iter().copied(), prompt.len() - 1, &Sampling::GREEDY)
        .token;
    // Any one corrupted slot (here: one flipped byte) must change the prediction for a sizeable
    // share of positions; with 96 outcomes a collision is possible but not for most slots.
    let mut changed = 0;
    for victim in 0..prompt.len() {
        let mut slot = vec![0; model.bytes_per_token()];
        model.fill_kv(model.chain(&prompt)[victim], &mut slot);
        slot[17] ^= 1;
        let mut digests = good.clone();
        digests[victim] = Model::slot_digest(&slot);
        if model
            .next_token(digests.iter().copied(), prompt.len() - 1, &Sampling::GREEDY)
            .token
            != expected
        {
            changed += 1;
        }
    }
    assert!(
        changed >= prompt.len() * 9 / 10,
        "only {changed} of {} corruptions noticed",
        prompt.len()
    );
}

#[test]
fn a_missing_or_swapped_slot_changes_the_fold() {
    let model = Model::new(KvShape::SMALL);
    let prompt: Vec<u32> = b"the quick brown fox"
        .iter()
        .map(|&b| u32::from(b))
        .collect();
    let good = digests_of(&model, &prompt);
    let fold = |d: &[u64]| {
        d.iter()
            .enumerate()
            .fold(0u64, |acc, (i, &x)| mix(acc ^ x, i as u64))
    };
    let mut zeroed = good.clone();
    zeroed[3] = Model::slot_digest(&vec![0; model.bytes_per_token()]);
    let mut swapped = good.clone();
    swapped.swap(2, 5);
    assert_ne!(fold(&good), fold(&zeroed));
    assert_ne!(fold(&good), fold(&swapped));
}

#[test]
fn kv_depends_on_the_whole_prefix() {
    let model = Model::new(KvShape::SMALL);
    let a = model.chain(&[1, 2, 3, 4]);
    let b = model.chain(&[9, 2, 3, 4]);
    assert!(a.iter().zip(&b).all(|(x, y)| x != y));
    assert_eq!(model.chain_at(&[1, 2, 3, 4], 3), a[2]);
    assert_eq!(model.chain_at(&[1, 2, 3, 4], 0), model.chain_start());
}

#[test]
fn continuing_from_generated_text_matches_an_uninterrupted_run() {
    let model = Model::new(KvShape::SMALL);
    let prompt: Vec<u32> = b"continue me".iter().map(|&b| u32::from(b)).collect();
    for sampling in [
        Sampling::GREEDY,
        Sampling {
            temperature: 0.8,
            top_p: 0.9,
            seed: 42,
        },
    ] {
        let full = generate(&model, &prompt, 30, &sampling);
        let half = full.len() / 2;
        let mut resumed_prompt = prompt.clone();
        resumed_prompt.extend(&full[..half]);
        let rest = generate(&model, &resumed_prompt, full.len() - half, &sampling);
        assert_eq!(&full[half..], rest.as_slice(), "sampling {sampling:?}");
    }
}

#[test]
fn sampling_depends_on_seed_and_shape() {
    let prompt: Vec<u32> = b"seeded".iter().map(|&b| u32::from(b)).collect();
    let small = Model::new(KvShape::SMALL);
    let hot = |seed| Sampling {
        temperature: 1.0,
        top_p: 1.0,
        seed,
    };
    let a = generate(&small, &prompt, 40, &hot(1));
    assert_eq!(a, generate(&small, &prompt, 40, &hot(1)));
    assert_ne!(a, generate(&small, &prompt, 40, &hot(2)));
    let tiny = KvShape {
        layers: 1,
        kv_heads: 1,
        head_dim: 4,
        dtype_bytes: 2,
    };
    assert_ne!(
        generate(&small, &prompt, 40, &Sampling::GREEDY),
        generate(&Model::new(tiny), &prompt, 40, &Sampling::GREEDY)
    );
}

#[test]
fn eos_is_reachable_but_rare() {
    let model = Model::new(KvShape::SMALL);
    let greedy_eos = (0..20_000u64)
        .filter(|&s| {
            model
                .next_token([s].into_iter(), 0, &Sampling::GREEDY)
                .token
                == Model::EOS
        })
        .count();
    assert!(
        (10..=120).contains(&greedy_eos),
        "{greedy_eos} EOS in 20000 states"
    );
}

#[test]
fn logprobs_are_the_log_softmax_of_the_logits() {
    let logits = [1.0, 2.0, 3.0];
    let total: f64 = logits.iter().map(|l: &f64| l.exp()).sum();
    for (i, l) in logits.iter().enumerate() {
        let expected = (l.exp() / total).ln() as f32;
        assert!((logprob(&logits, i) - expected).abs() < 1e-6);
    }
    // Stable where a naive exp would overflow.
    assert_eq!(logprob(&[1000.0, 1000.0], 0), -std::f32::consts::LN_2);
}
