//! The core driven by the engine's step loop: through its command channel on its own thread, as
//! the HTTP layer drives it, and by hand (commands straight into `handle`, one `turn` at a time
//! on a clock the test chooses) where timing matters; and the core alone, on a fake clock.

use std::sync::mpsc::Sender;
use std::time::{Duration, Instant};

use switchyard_kv::{KvShape, KvStore};
use tokio::sync::{mpsc, oneshot};

use super::*;
use crate::latency::{Latency, Profile};
use crate::metrics::Metrics;
use crate::model::{Model, Sampling};
use crate::step_loop::{Command, StepLoop};

/// Bound on every wait for the core thread, so a bug fails the test instead of hanging it.
const PATIENCE: Duration = Duration::from_secs(20);

struct Harness {
    commands: Sender<Command>,
    store: Arc<KvStore>,
    metrics: Metrics,
}

/// Steps that cost nothing.
fn free() -> Arc<dyn TimingModel> {
    Arc::new(Latency {
        profile: Profile::NULL,
        time_scale: 0.0,
    })
}

fn config(num_pages: u32) -> CoreConfig {
    CoreConfig {
        page_size: 4,
        num_pages,
        prefix_cache: false,
        prefill_chunk: 64,
        max_batch: 16,
        reservation_ttl: Duration::from_secs(60),
        expiry_quarantine: Duration::ZERO,
        preempt_every: None,
        timing: free(),
    }
}

/// A guarded pool sized for `cfg`, as the engine builds it: the synthetic model writes the
/// small shape, a real model its own.
fn pool_for(cfg: &CoreConfig, model: &ModelSpec) -> Arc<KvStore> {
    let slots = cfg.num_pages * cfg.page_size as u32;
    let shape = match model {
        ModelSpec::Synthetic => KvShape::SMALL,
        ModelSpec::Llama(m) => m.llama.config().kv_shape(),
    };
    Arc::new(KvStore::new(shape, slots).unwrap().with_guarded_slots())
}

fn start(cfg: CoreConfig) -> Harness {
    start_with(cfg, ModelSpec::Synthetic)
}

/// A step loop on its own thread, as the engine runs it.
fn start_with(cfg: CoreConfig, model: ModelSpec) -> Harness {
    let store = pool_for(&cfg, &model);
    let metrics = Metrics::default();
    let core = Core::new(cfg, Backend::new(&model, store.clone()));
    let step_loop = StepLoop::new(core, metrics.clone());
    let (commands, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || step_loop.run(rx));
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
        logprobs: false,
    }
}

/// Waits for `next` from the core thread, at most [`PATIENCE`].
fn within<T>(next: impl std::future::Future<Output = T>) -> T {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap()
        .block_on(async { tokio::time::timeout(PATIENCE, next).await })
        .expect("the core answered in time")
}

/// Collects events until the finish.
fn finish(rx: &mut mpsc::UnboundedReceiver<Event>) -> (String, FinishReason, Usage) {
    let mut text = String::new();
    loop {
        let event = within(rx.recv()).expect("events closed before finish");
        text.push_str(&event.text);
        if let Some((reason, usage)) = event.finish {
            return (text, reason, usage);
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

/// Polls a gauge the core thread publishes after its step (no event says it changed), with a
/// bounded deadline.
fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + PATIENCE;
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
    assert_eq!(plain.2.cached_tokens, 0);
    let cached = start(CoreConfig {
        prefix_cache: true,
        ..config(64)
    });
    assert_eq!(generate(&cached, request(&prompt, 30)), plain);
    let again = generate(&cached, request(&prompt, 30));
    assert_eq!((&again.0, again.1), (&plain.0, plain.1));
    // Every whole page before the last prompt token, which the generation computes itself.
    let reused = 149 / 4 * 4;
    assert_eq!(
        again.2,
        Usage {
            cached_tokens: reused,
            ..plain.2
        }
    );
    assert_eq!(
        cached.metrics.prefix_matched_tokens.get(),
        reused as u64,
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
    drop(lease);
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

// === driven by hand ===

/// A step loop driven by hand on a clock the test chooses: commands in, one turn at a time.
struct Manual {
    step_loop: StepLoop,
    store: Arc<KvStore>,
    metrics: Metrics,
    cfg: CoreConfig,
}

impl Manual {
    fn handle(&mut self, command: Command) {
        self.step_loop.handle(command, Time::ZERO);
    }

    /// One step at `now`, its outputs delivered when due.
    fn turn(&mut self, now: Time) {
        let end = self.step_loop.turn(now);
        self.step_loop.deliver(end);
    }
}

fn manual(cfg: CoreConfig) -> Manual {
    let store = pool_for(&cfg, &ModelSpec::Synthetic);
    let metrics = Metrics::default();
    let core = Core::new(
        cfg.clone(),
        Backend::new(&ModelSpec::Synthetic, store.clone()),
    );
    Manual {
        step_loop: StepLoop::new(core, metrics.clone()),
        store,
        metrics,
        cfg,
    }
}

/// prep_recv on a hand-driven core: the command, then one turn at `now` to answer it.
fn manual_prep(
    core: &mut Manual,
    now: Time,
    user: &str,
    req: GenRequest,
    end: usize,
) -> PrepRecvReply {
    let (reply, mut rx) = oneshot::channel();
    core.handle(Command::PrepRecv {
        user: user.into(),
        request: req,
        end,
        reply,
    });
    core.turn(now);
    rx.try_recv()
        .expect("answered in one turn")
        .expect("reserved")
}

/// start_generate on a hand-driven core; the events, when accepted.
fn manual_start(
    core: &mut Manual,
    user: &str,
    begin: usize,
) -> Result<mpsc::UnboundedReceiver<Event>, CoreError> {
    let (events, rx) = mpsc::unbounded_channel();
    let (reply, mut ack) = oneshot::channel();
    core.handle(Command::StartGenerate {
        user: user.into(),
        begin,
        events,
        reply,
    });
    ack.try_recv().expect("answered at once").map(|()| rx)
}

const MS: Duration = Duration::from_millis(1);

#[test]
fn reservations_expire_exactly_at_their_ttl_and_free_their_pages() {
    let ttl = Duration::from_secs(30);
    let mut core = manual(CoreConfig {
        reservation_ttl: ttl,
        ..config(16)
    });
    let t0 = Time::ZERO;
    manual_prep(&mut core, t0, "leak", request(&[b'x'; 30], 4), 29);
    // 29 positions in pages of 4: 8 pages, held until the TTL passes.
    assert_eq!(core.metrics.kv_pages_used.get(), 8);
    core.turn(t0 + (ttl - MS));
    assert_eq!(core.metrics.kv_pages_used.get(), 8, "held until the TTL");
    assert_eq!(core.metrics.reservations_expired.get(), 0);
    core.turn(t0 + ttl);
    assert_eq!(core.metrics.reservations_expired.get(), 1);
    assert_eq!(core.metrics.kv_pages_used.get(), 0);
    // The id is free again, and its old window is closed to receivers.
    let again = manual_prep(&mut core, t0 + ttl, "leak", request(&[b'x'; 30], 4), 29);
    assert_eq!(again.kv_addr_info.total_len(), 29);
}

#[test]
fn an_expired_window_is_closed_to_late_pushes() {
    let mut core = manual(config(16));
    let t0 = Time::ZERO;
    let reply = manual_prep(&mut core, t0, "late", request(&[b'x'; 30], 4), 29);
    let runs = reply.kv_addr_info.models[0].clone();
    assert!(
        core.store.gate().claim(&runs).is_ok(),
        "open while reserved"
    );
    core.turn(t0 + core.cfg.reservation_ttl);
    assert_eq!(core.metrics.reservations_expired.get(), 1);
    assert!(matches!(
        core.store.gate().claim(&runs),
        Err(switchyard_kv::GateError::NotOpen { .. })
    ));
}

#[test]
fn one_sided_transports_quarantine_expired_pages() {
    let (ttl, quarantine) = (Duration::from_secs(5), Duration::from_secs(120));
    let mut core = manual(CoreConfig {
        reservation_ttl: ttl,
        expiry_quarantine: quarantine,
        ..config(16)
    });
    let t0 = Time::ZERO;
    manual_prep(&mut core, t0, "q", request(&[b'x'; 30], 4), 29);
    core.turn(t0 + ttl);
    assert_eq!(core.metrics.reservations_expired.get(), 1);
    assert_eq!(
        core.metrics.kv_pages_used.get(),
        8,
        "a late one-sided push may still land there"
    );
    core.turn(t0 + ttl + (quarantine - MS));
    assert_eq!(core.metrics.kv_pages_used.get(), 8);
    core.turn(t0 + ttl + quarantine);
    assert_eq!(core.metrics.kv_pages_used.get(), 0);
}

#[test]
fn pages_a_receiver_is_writing_are_not_reused_or_read() {
    let mut core = manual(config(16));
    let t0 = Time::ZERO;
    let reply = manual_prep(&mut core, t0, "w", request(&[b'x'; 30], 4), 29);
    let runs = reply.kv_addr_info.models[0].clone();
    let store = core.store.clone();
    let claim = store.gate().claim(&runs).expect("open");
    // start_generate would read the slots while they are written: refused, reservation kept.
    assert_eq!(
        manual_start(&mut core, "w", 29).err(),
        Some(CoreError::TransferInProgress { user: "w".into() })
    );
    // Expiry closes the window but keeps the pages while the write goes on.
    core.turn(t0 + core.cfg.reservation_ttl);
    assert_eq!(core.metrics.reservations_expired.get(), 1);
    assert_eq!(core.metrics.kv_pages_used.get(), 8);
    drop(claim);
    core.turn(t0 + core.cfg.reservation_ttl);
    assert_eq!(core.metrics.kv_pages_used.get(), 0);
}

#[test]
fn start_generate_before_the_matched_prefix_is_refused() {
    let mut core = manual(CoreConfig {
        prefix_cache: true,
        ..config(64)
    });
    let t0 = Time::ZERO;
    let prompt = [b'p'; 30];
    // A first request fills the prefix cache with the prompt's whole pages.
    let first = manual_prep(&mut core, t0, "a", request(&prompt, 2), 29);
    assert_eq!(first.prefix_matched_length, 0);
    let mut events = manual_start(&mut core, "a", 0).expect("recomputes everything itself");
    for _ in 0..100 {
        if core.metrics.kv_pages_used.get() == 0 {
            break;
        }
        core.turn(t0);
    }
    let last = std::iter::from_fn(|| events.try_recv().ok()).last();
    assert!(last.is_some_and(|e| e.finish.is_some()), "a finished");
    let second = manual_prep(&mut core, t0, "b", request(&prompt, 2), 29);
    let matched = second.prefix_matched_length;
    assert!(matched > 0, "the prefix is cached");
    assert_eq!(
        manual_start(&mut core, "b", matched - 1).err(),
        Some(CoreError::BeginBeforeMatched {
            begin: matched - 1,
            matched
        })
    );
    assert!(manual_start(&mut core, "b", matched).is_ok());
}

#[test]
fn a_lease_nobody_received_still_comes_back() {
    let mut core = manual(config(16));
    let (reply, lease_rx) = oneshot::channel();
    core.handle(Command::PrefillForSend {
        tokens: vec![7; 20],
        begin: 0,
        reply,
    });
    core.turn(Time::ZERO);
    assert_eq!(core.metrics.kv_pages_used.get(), 5, "prefilled and leased");
    // The handler was cancelled after the lease was sent but before it was received.
    drop(lease_rx);
    core.turn(Time::ZERO);
    assert_eq!(core.metrics.kv_pages_used.get(), 0);
}

#[test]
fn a_dropped_lease_releases_its_pages() {
    let mut core = manual(config(16));
    let (reply, mut lease_rx) = oneshot::channel();
    core.handle(Command::PrefillForSend {
        tokens: vec![7; 20],
        begin: 4,
        reply,
    });
    core.turn(Time::ZERO);
    let lease = lease_rx.try_recv().expect("leased in one turn");
    assert_eq!(lease.slots.len(), 16);
    core.turn(Time::ZERO);
    assert_eq!(
        core.metrics.kv_pages_used.get(),
        5,
        "held while the lease lives"
    );
    drop(lease);
    core.turn(Time::ZERO);
    assert_eq!(core.metrics.kv_pages_used.get(), 0);
}

#[test]
fn injected_preemption_sends_no_held_back_text() {
    // The plain text's 5th character starts a stop string the model can never complete
    // (tokens are bytes; U+2603 is not one), so it is held back when the preemption hits at
    // max_tokens / 2 = 5 tokens, and must not be flushed into the stream.
    let (plain, ..) = generate(&start(config(64)), request(b"held back", 10));
    let chars: Vec<char> = plain.chars().collect();
    assert!(chars.len() >= 5, "{plain:?}");
    let h = start(CoreConfig {
        preempt_every: Some(1),
        ..config(64)
    });
    let mut req = request(b"held back", 10);
    req.stop = vec![format!("{}\u{2603}", chars[4])];
    let (text, reason, _) = generate(&h, req);
    assert_eq!(reason, FinishReason::Preempt);
    assert_eq!(text, chars[..4].iter().collect::<String>());
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
    let reply = within(rx).expect("b got its pages");
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
        timing: Arc::new(slow),
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

// === the real model ===

/// A core running SmolLM2 (`make model`).
fn start_smollm2(cfg: CoreConfig) -> Harness {
    start_with(cfg, ModelSpec::Llama(crate::load::test_smollm2().0.clone()))
}

fn smollm2_request(text: &str, max_tokens: usize, sampling: Sampling) -> GenRequest {
    let ids = crate::load::test_smollm2().1.encode(text, false).unwrap();
    GenRequest {
        tokens: ids.get_ids().to_vec(),
        sampling,
        max_tokens,
        stop: Vec::new(),
        logprobs: false,
    }
}

/// Continuous batching, chunked prefill and the prefix cache change nothing about what the
/// real model writes: requests run together give the text each gives alone.
#[test]
fn real_model_requests_batched_together_match_each_alone() {
    let seeded = Sampling {
        temperature: 0.8,
        top_p: 0.9,
        seed: 7,
    };
    let requests = [
        smollm2_request("The capital of France is", 6, Sampling::GREEDY),
        smollm2_request("Once upon a time, there was a", 8, seeded),
        GenRequest {
            stop: vec![".".into()],
            ..smollm2_request("The capital of France is", 12, Sampling::GREEDY)
        },
    ];
    let alone = start_smollm2(config(64));
    let expected: Vec<_> = requests
        .iter()
        .map(|r| generate(&alone, r.clone()))
        .collect();
    assert!(expected[0].0.starts_with(" Paris"), "{:?}", expected[0]);
    assert_eq!(expected[2].1, FinishReason::Stop, "{:?}", expected[2]);
    assert!(!expected[2].0.contains('.'), "{:?}", expected[2]);

    let together = start_smollm2(CoreConfig {
        prefix_cache: true,
        prefill_chunk: 3,
        ..config(64)
    });
    let mut streams: Vec<_> = requests
        .iter()
        .map(|r| {
            let (events, rx) = mpsc::unbounded_channel();
            together
                .commands
                .send(Command::Generate {
                    request: r.clone(),
                    events,
                })
                .unwrap();
            rx
        })
        .collect();
    let got: Vec<_> = streams.iter_mut().map(finish).collect();
    assert_eq!(got, expected);
}

#[test]
fn a_released_reservation_leaves_no_unchecked_page_in_the_prefix_cache() {
    let mut core = manual(CoreConfig {
        prefix_cache: true,
        ..config(32)
    });
    let t0 = Time::ZERO;
    let prompt = [b'p'; 30];
    manual_prep(&mut core, t0, "a", request(&prompt, 4), 29);
    // No remote_send came: the reserved slots hold nothing. A router frees them by starting
    // the generation and hanging up at once.
    drop(manual_start(&mut core, "a", 29).expect("accepted"));
    core.turn(t0);
    assert_eq!(core.metrics.requests_aborted.get(), 1);
    assert_eq!(core.metrics.kv_pages_used.get(), 0);
    let again = manual_prep(&mut core, t0, "b", request(&prompt, 4), 29);
    assert_eq!(
        again.prefix_matched_length, 0,
        "nothing unchecked was cached"
    );

    // The same flow run to its finish does cache its pages (7 full pages inside [0, 29)).
    let mut events = manual_start(&mut core, "b", 29).expect("accepted");
    let mut finished = false;
    for _ in 0..100 {
        core.turn(t0);
        while let Ok(event) = events.try_recv() {
            finished |= event.finish.is_some();
        }
        if finished {
            break;
        }
    }
    assert!(finished, "the generation finished within 100 turns");
    let third = manual_prep(&mut core, t0, "c", request(&prompt, 4), 29);
    assert_eq!(third.prefix_matched_length, 28);
}

// === the core alone, on a fake clock ===

#[test]
fn a_steps_outputs_are_due_only_once_its_cost_has_elapsed() {
    let timing = Latency {
        profile: Profile::LLAMA3_8B_H100,
        time_scale: 1.0,
    };
    let mut core = Core::new(
        CoreConfig {
            timing: Arc::new(timing),
            ..config(64)
        },
        Backend::costless(),
    );
    let id = core.generate(request(&[b'x'; 40], 2));
    let t0 = Time::from_micros(1_000);
    let prefill = core.step(t0);
    let work = StepWork {
        prefill_tokens: 40,
        ..StepWork::default()
    };
    assert_eq!(prefill.work, work);
    assert_eq!(prefill.cost, timing.step(&work));
    assert_eq!(prefill.end, t0 + timing.step(&work));
    assert!(core.take_due(t0).is_empty(), "the step has only begun");
    let just_before = Time::from_micros(prefill.end.as_micros() - 1);
    assert!(core.take_due(just_before).is_empty(), "a microsecond early");
    let first = events(core.take_due(prefill.end));
    assert_eq!(first.len(), 1, "{first:?}");
    assert_eq!(first[0].0, id);
    assert_eq!(
        first[0].1.token_ids.len(),
        1,
        "the prompt's pass samples one token"
    );
    // The decode step starts when the prefill ended; its token is due a decode's cost later.
    let decode = core.step(prefill.end);
    assert_eq!(decode.work.decode_seqs, 1);
    assert_eq!(decode.end, prefill.end + timing.step(&decode.work));
    assert!(core.take_due(prefill.end).is_empty());
    let last = events(core.take_due(decode.end));
    assert_eq!(last.len(), 1, "{last:?}");
    assert_eq!(last[0].1.finish.map(|f| f.0), Some(FinishReason::Length));
}

/// The generation events among `outputs`.
fn events(outputs: Vec<Output>) -> Vec<(RequestId, Event)> {
    outputs
        .into_iter()
        .filter_map(|output| match output {
            Output::Event { id, event } => Some((id, event)),
            _ => None,
        })
        .collect()
}

#[test]
fn an_idle_core_wants_a_step_only_for_a_call_or_a_deadline() {
    let ttl = Duration::from_secs(30);
    let mut core = Core::new(
        CoreConfig {
            reservation_ttl: ttl,
            ..config(16)
        },
        Backend::costless(),
    );
    let t0 = Time::from_micros(5);
    assert_eq!(core.next_turn(t0), None, "nothing to do");
    core.prep_recv("r".into(), request(&[b'r'; 9], 2), 8)
        .expect("a new id");
    core.step(t0);
    assert!(matches!(&core.take_due(t0)[..], [Output::Reserved { .. }]));
    assert_eq!(
        core.next_turn(t0),
        Some(t0 + ttl),
        "the reservation's expiry"
    );
    core.generate(request(b"go", 2));
    core.step(t0);
    assert_eq!(core.next_turn(t0), Some(t0), "a batch to run");
}

/// What a run did: each step's work and the gauges after it, what each request's events came
/// to (the token count of each, the finish), and the counters at the end.
#[derive(Debug, PartialEq)]
struct Record {
    steps: Vec<(StepWork, Gauges)>,
    ends: Vec<(Vec<usize>, Option<FinishReason>)>,
    counters: Counters,
}

/// Runs `requests` on `core` to their ends, a step at a time, on a fake clock.
fn schedule(mut core: Core, requests: &[GenRequest]) -> Record {
    let ids: Vec<RequestId> = requests.iter().map(|r| core.generate(r.clone())).collect();
    let mut events: HashMap<RequestId, (Vec<usize>, Option<FinishReason>)> = HashMap::new();
    let mut steps = Vec::new();
    let mut now = Time::ZERO;
    for _ in 0..1_000 {
        let Some(at) = core.next_turn(now) else {
            break;
        };
        let step = core.step(at.max(now));
        for output in core.take_due(step.end) {
            if let Output::Event { id, event } = output {
                let seen = events.entry(id).or_default();
                seen.0.push(event.token_ids.len());
                seen.1 = event.finish.map(|f| f.0);
            }
        }
        steps.push((step.work, core.gauges()));
        now = step.end;
    }
    Record {
        steps,
        ends: ids
            .iter()
            .map(|id| events.remove(id).unwrap_or_default())
            .collect(),
        counters: core.counters(),
    }
}

/// What the policy lab relies on: the costless model runs exactly the schedule the synthetic
/// model does (chunked prefill, prefix-cache hits, preemption under KV pressure, the same
/// steps costed the same), without writing or reading a byte of KV.
#[test]
fn the_costless_model_runs_the_synthetic_models_schedule() {
    // Two at a time in 20 pages of 4: the second is preempted as both grow, and the third
    // waits for room, by when the first's prompt pages are in the prefix cache.
    let cfg = || CoreConfig {
        prefix_cache: true,
        prefill_chunk: 16,
        max_batch: 2,
        ..config(20)
    };
    let shared: Vec<u8> = (0..24).map(|i| b'a' + i % 26).collect();
    let requests: Vec<GenRequest> = [&shared[..], b"another prompt", &shared[..], b"fourth!"]
        .iter()
        .map(|prompt| request(prompt, 24))
        .collect();
    let synthetic = Core::new(
        cfg(),
        Backend::new(
            &ModelSpec::Synthetic,
            pool_for(&cfg(), &ModelSpec::Synthetic),
        ),
    );
    let record = schedule(synthetic, &requests);
    assert!(
        record
            .ends
            .iter()
            .all(|e| matches!(e.1, Some(FinishReason::Length | FinishReason::Preempt))),
        "no EOS ends a synthetic generation early here: {record:?}"
    );
    assert!(record.counters.preemptions >= 1, "{record:?}");
    assert!(record.counters.prefix_matched_tokens >= 20, "{record:?}");
    assert_eq!(
        schedule(Core::new(cfg(), Backend::costless()), &requests),
        record
    );
}

/// What a request found in the prefix cache is reported with it: on a generation's finish
/// (`Usage::cached_tokens`, a reservation's match after start_generate) and on a lease.
#[test]
fn each_request_reports_the_prompt_tokens_its_cache_served() {
    let cfg = CoreConfig {
        prefix_cache: true,
        ..config(64)
    };
    let mut core = Core::new(cfg, Backend::costless());
    let prompt: Vec<u8> = (0..30).map(|i| b'a' + i % 26).collect();
    let mut now = Time::ZERO;
    let mut run = |core: &mut Core, until: &dyn Fn(&Output) -> bool| {
        for _ in 0..200 {
            let step = core.step(now);
            now = step.end;
            if let Some(found) = core.take_due(now).into_iter().find(|o| until(o)) {
                return found;
            }
        }
        panic!("no such output within 200 steps");
    };
    let finished = |o: &Output| matches!(o, Output::Event { event, .. } if event.finish.is_some());
    let usage = |o: Output| match o {
        Output::Event { event, .. } => event.finish.expect("a finish").1,
        other => panic!("not an event: {other:?}"),
    };
    core.generate(request(&prompt, 2));
    assert_eq!(
        usage(run(&mut core, &finished)).cached_tokens,
        0,
        "a cold cache"
    );
    // The same prompt again: every whole page but the one holding the last token.
    core.generate(request(&prompt, 2));
    assert_eq!(usage(run(&mut core, &finished)).cached_tokens, 28);
    // A prefill for sending may be served whole.
    core.prefill_for_send(request(&prompt[..28], 1).tokens, 4);
    match run(&mut core, &|o| matches!(o, Output::Leased(_))) {
        Output::Leased(lease) => {
            assert_eq!((lease.cached_tokens, lease.slots.len()), (28, 24));
            core.release_lease(lease.id);
        }
        other => panic!("{other:?}"),
    }
    // A reservation's match is what its generation reports.
    core.prep_recv("u".into(), request(&prompt, 2), 29)
        .expect("reserves");
    let matched = match run(&mut core, &|o| matches!(o, Output::Reserved { .. })) {
        Output::Reserved { reply, .. } => reply.prefix_matched_length,
        other => panic!("{other:?}"),
    };
    assert_eq!(matched, 28);
    core.start_generate("u".into(), 29).expect("starts");
    assert_eq!(usage(run(&mut core, &finished)).cached_tokens, 28);
}

mod kv_events;
