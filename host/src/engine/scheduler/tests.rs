//! The core driven through its command channel, as the HTTP layer drives it.

use std::sync::mpsc::Sender;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};

use super::*;
use crate::engine::latency::Profile;
use crate::kv::KvShape;

struct Harness {
    commands: Sender<Command>,
    store: Arc<KvStore>,
    metrics: Metrics,
}

fn config(num_pages: u32) -> CoreConfig {
    CoreConfig {
        page_size: 4,
        num_pages,
        prefix_cache: false,
        prefill_chunk: 64,
        max_batch: 16,
        reservation_ttl: Duration::from_secs(60),
        preempt_every: None,
        latency: Latency {
            profile: Profile::NULL,
            time_scale: 0.0,
        },
    }
}

fn start(cfg: CoreConfig) -> Harness {
    let store =
        Arc::new(KvStore::new(KvShape::SMALL, cfg.num_pages * cfg.page_size as u32).unwrap());
    let metrics = Metrics::default();
    let core = Core::new(cfg, store.clone(), metrics.clone());
    let (commands, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || core.run(rx));
    Harness {
        commands,
        store,
        metrics,
    }
}

fn request(prompt: &[u8], max_tokens: usize) -> GenRequest {
    GenRequest {
        tokens: prompt.iter().map(|&b| u32::from(b)).collect(),
        sampling: Sampling::GREEDY,
        max_tokens,
        stop: Vec::new(),
    }
}

/// Collects events until the finish; bounded by a timeout so a bug cannot hang the suite.
fn finish(rx: &mut mpsc::UnboundedReceiver<Event>) -> (String, FinishReason, Usage) {
    let mut text = String::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        assert!(Instant::now() < deadline, "no finish within 20 s");
        match rx.try_recv() {
            Ok(event) => {
                text.push_str(&event.text);
                if let Some((reason, usage)) = event.finish {
                    return (text, reason, usage);
                }
            }
            Err(mpsc::error::TryRecvError::Empty) => std::thread::sleep(Duration::from_millis(1)),
            Err(mpsc::error::TryRecvError::Disconnected) => panic!("events closed before finish"),
        }
    }
}

fn generate(h: &Harness, req: GenRequest) -> (String, FinishReason, Usage) {
    let (events, mut rx) = mpsc::unbounded_channel();
    h.commands
        .send(Command::Generate {
            request: req,
            events,
        })
        .unwrap();
    finish(&mut rx)
}

fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn prep_recv(
    h: &Harness,
    user: &str,
    req: GenRequest,
    end: usize,
) -> Result<PrepRecvReply, CoreError> {
    let (reply, rx) = oneshot::channel();
    h.commands
        .send(Command::PrepRecv {
            user: user.into(),
            request: req,
            end,
            reply,
        })
        .unwrap();
    rx.blocking_recv().unwrap()
}

#[test]
fn generates_deterministically_with_usage() {
    let h = start(config(64));
    let (a, reason, usage) = generate(&h, request(b"hello there", 20));
    let (b, ..) = generate(&h, request(b"hello there", 20));
    assert_eq!(a, b);
    assert!(matches!(reason, FinishReason::Length | FinishReason::Stop));
    assert_eq!(usage.prompt_tokens, 11);
    assert_eq!(usage.completion_tokens, a.len());
    wait_for("pages freed", || h.metrics.kv_pages_used.get() == 0);
}

#[test]
fn chunked_prefill_and_prefix_cache_do_not_change_tokens() {
    let prompt: Vec<u8> = (0..150).map(|i| b'a' + (i % 26) as u8).collect();
    let plain = generate(&start(config(64)), request(&prompt, 30));
    let chunked = generate(
        &start(CoreConfig {
            prefill_chunk: 7,
            ..config(64)
        }),
        request(&prompt, 30),
    );
    assert_eq!(plain, chunked);
    let cached = start(CoreConfig {
        prefix_cache: true,
        ..config(64)
    });
    assert_eq!(generate(&cached, request(&prompt, 30)), plain);
    assert_eq!(generate(&cached, request(&prompt, 30)), plain);
    assert!(
        cached.metrics.prefix_matched_tokens.get() >= 140,
        "the second run reused the prefix"
    );
}

#[test]
fn stop_strings_end_the_text_before_the_match() {
    let h = start(config(64));
    let (text, ..) = generate(&h, request(b"stop test", 40));
    let stop = text[5..7].to_owned();
    let mut req = request(b"stop test", 40);
    req.stop = vec![stop.clone()];
    let (stopped, reason, _) = generate(&h, req);
    assert_eq!(reason, FinishReason::Stop);
    let cut = text.find(&stop).unwrap();
    assert_eq!(stopped, text[..cut]);
}

#[test]
fn kv_pressure_preempts_the_last_running_request() {
    // 14 pages of 4 slots: three requests of 10-token prompts need 3 pages each up front and
    // then grow to 13; they cannot all reach 40 tokens, but the first alone can.
    let h = start(config(14));
    let receivers: Vec<_> = (0..3)
        .map(|i| {
            let (events, rx) = mpsc::unbounded_channel();
            let req = request(format!("prompt #{i}!").as_bytes(), 40);
            h.commands
                .send(Command::Generate {
                    request: req,
                    events,
                })
                .unwrap();
            rx
        })
        .collect();
    let outcomes: Vec<_> = receivers
        .into_iter()
        .map(|mut rx| finish(&mut rx))
        .collect();
    let preempted: Vec<_> = outcomes
        .iter()
        .filter(|o| o.1 == FinishReason::Preempt)
        .collect();
    assert!(!preempted.is_empty(), "{outcomes:?}");
    assert!(preempted.iter().all(|o| o.2 == Usage::default()));
    assert_ne!(
        outcomes[0].1,
        FinishReason::Preempt,
        "the first request is never the victim"
    );
    assert!(h.metrics.preemptions.get() >= 1);
    wait_for("pages freed", || h.metrics.kv_pages_used.get() == 0);
}

#[test]
fn preempt_every_k_cuts_at_half_max_tokens() {
    let h = start(CoreConfig {
        preempt_every: Some(2),
        ..config(64)
    });
    let first = generate(&h, request(b"aaaa", 10));
    let second = generate(&h, request(b"bbbb", 10));
    assert_ne!(first.1, FinishReason::Preempt);
    assert_eq!(second.1, FinishReason::Preempt);
}

#[test]
fn disaggregated_flow_inside_one_pool_matches_plain_generation() {
    let prompt = b"a prompt that is split between prefill and decode";
    let expected = generate(&start(config(64)), request(prompt, 25));
    let h = start(config(64));
    let end = prompt.len() - 10;
    let reply = prep_recv(&h, "cmpl-1", request(prompt, 25), end).unwrap();
    assert_eq!(reply.prefix_matched_length, 0);
    // P (here the same engine) prefills prompt[0:end] and leases its slots.
    let (lease_tx, lease_rx) = oneshot::channel();
    let tokens: Vec<u32> = prompt[..end].iter().map(|&b| u32::from(b)).collect();
    h.commands
        .send(Command::PrefillForSend {
            tokens,
            begin: 0,
            reply: lease_tx,
        })
        .unwrap();
    let lease = lease_rx.blocking_recv().unwrap();
    let dst: Vec<u32> = reply.kv_addr_info.slots().collect();
    assert_eq!(lease.slots.len(), dst.len());
    for (&src, &dst) in lease.slots.iter().zip(&dst) {
        h.store.write_slot(dst, &h.store.read_slot_to_vec(src));
    }
    h.commands
        .send(Command::ReleaseLease { id: lease.id })
        .unwrap();
    let (events, mut rx) = mpsc::unbounded_channel();
    let (reply, ack) = oneshot::channel();
    h.commands
        .send(Command::StartGenerate {
            user: "cmpl-1".into(),
            begin: end,
            events,
            reply,
        })
        .unwrap();
    ack.blocking_recv().unwrap().unwrap();
    assert_eq!(finish(&mut rx), expected);
}

#[test]
fn a_corrupted_transferred_slot_changes_the_output() {
    let prompt = b"corruption must be visible in the generated text";
    let expected = generate(&start(config(64)), request(prompt, 8));
    let h = start(config(64));
    let end = prompt.len() - 1;
    let reply = prep_recv(&h, "u", request(prompt, 8), end).unwrap();
    // Fill the reserved slots as P would, but write position 5's KV into position 6's slot.
    let model = Model::new(KvShape::SMALL);
    let chain = model.chain(&prompt.map(u32::from));
    let slots: Vec<u32> = reply.kv_addr_info.slots().collect();
    for (pos, &slot) in slots.iter().enumerate() {
        let mut bytes = vec![0; KvShape::SMALL.bytes_per_token()];
        model.fill_kv(chain[if pos == 6 { 5 } else { pos }], &mut bytes);
        h.store.write_slot(slot, &bytes);
    }
    let (events, mut rx) = mpsc::unbounded_channel();
    let (ack_tx, ack) = oneshot::channel();
    h.commands
        .send(Command::StartGenerate {
            user: "u".into(),
            begin: end,
            events,
            reply: ack_tx,
        })
        .unwrap();
    ack.blocking_recv().unwrap().unwrap();
    assert_ne!(finish(&mut rx).0, expected.0);
}

#[test]
fn protocol_violations_are_errors_not_crashes() {
    let h = start(config(64));
    prep_recv(&h, "dup", request(b"abcdef", 4), 3).unwrap();
    assert_eq!(
        prep_recv(&h, "dup", request(b"abcdef", 4), 3),
        Err(CoreError::DuplicateUser { user: "dup".into() })
    );
    let start_generate = |user: &str, begin| {
        let (events, _rx) = mpsc::unbounded_channel();
        let (reply, ack) = oneshot::channel();
        h.commands
            .send(Command::StartGenerate {
                user: user.into(),
                begin,
                events,
                reply,
            })
            .unwrap();
        ack.blocking_recv().unwrap()
    };
    assert_eq!(
        start_generate("nobody", 0),
        Err(CoreError::NoReservation {
            user: "nobody".into()
        })
    );
    assert_eq!(
        start_generate("dup", 5),
        Err(CoreError::BeginPastWindow { begin: 5, end: 3 })
    );
    // The engine still works.
    assert_eq!(
        generate(&h, request(b"still alive", 3)).1,
        FinishReason::Length
    );
}

#[test]
fn reservations_expire_and_free_their_pages() {
    let h = start(CoreConfig {
        reservation_ttl: Duration::from_millis(50),
        ..config(16)
    });
    prep_recv(&h, "leak", request(&[b'x'; 30], 4), 29).unwrap();
    // 29 positions in pages of 4: 8 pages, held until the TTL passes.
    assert!(h.metrics.kv_pages_used.get() == 8 || h.metrics.reservations_expired.get() == 1);
    wait_for("expiry", || h.metrics.reservations_expired.get() == 1);
    wait_for("pages freed", || h.metrics.kv_pages_used.get() == 0);
    // The id is free again.
    prep_recv(&h, "leak", request(&[b'x'; 30], 4), 29).unwrap();
}

#[test]
fn prep_recv_blocks_until_pages_are_free() {
    let h = start(config(8));
    // 8 pages of 4: the first reservation takes 7 pages, the second needs 7 more.
    prep_recv(&h, "a", request(&[b'a'; 29], 2), 28).unwrap();
    let (reply, mut rx) = oneshot::channel();
    let cmd = Command::PrepRecv {
        user: "b".into(),
        request: request(&[b'b'; 29], 2),
        end: 28,
        reply,
    };
    h.commands.send(cmd).unwrap();
    wait_for("b to be waiting", || h.metrics.waiting.get() == 1);
    assert!(rx.try_recv().is_err(), "b must wait for a's pages");
    let (events, mut a_rx) = mpsc::unbounded_channel();
    let (ack_tx, ack) = oneshot::channel();
    // a recomputes everything itself (begin 0), finishes, and frees its pages.
    h.commands
        .send(Command::StartGenerate {
            user: "a".into(),
            begin: 0,
            events,
            reply: ack_tx,
        })
        .unwrap();
    ack.blocking_recv().unwrap().unwrap();
    finish(&mut a_rx);
    let deadline = Instant::now() + Duration::from_secs(20);
    let reply = loop {
        match rx.try_recv() {
            Ok(r) => break r,
            Err(_) => {
                assert!(Instant::now() < deadline, "b never got its pages");
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    };
    assert_eq!(reply.unwrap().kv_addr_info.total_len(), 28);
}

#[test]
fn a_gone_client_frees_its_pages() {
    // Slow steps (the realistic profile) so the request is still running when the client goes.
    let slow = Latency {
        profile: Profile::LLAMA3_8B_H100,
        time_scale: 1.0,
    };
    let h = start(CoreConfig {
        latency: slow,
        ..config(64)
    });
    let (events, rx) = mpsc::unbounded_channel();
    h.commands
        .send(Command::Generate {
            request: request(b"bye", 100_000),
            events,
        })
        .unwrap();
    wait_for("running", || h.metrics.running.get() == 1);
    drop(rx);
    wait_for("abort", || h.metrics.requests_aborted.get() == 1);
    wait_for("pages freed", || h.metrics.kv_pages_used.get() == 0);
}
