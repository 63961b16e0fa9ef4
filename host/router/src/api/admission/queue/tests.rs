use std::collections::VecDeque;

use proptest::prelude::*;
use tokio::sync::mpsc;

use super::*;

fn queue(max_concurrent: u32, max_queued: u32) -> Queue {
    queue_with(max_concurrent, max_queued, Fairness::RoundRobin, &[])
}

fn queue_with(
    max_concurrent: u32,
    max_queued: u32,
    fairness: Fairness,
    weights: &[(&str, f64)],
) -> Queue {
    Queue::new(QueueConfig {
        max_concurrent,
        max_queued,
        queue_timeout: Duration::from_secs(60),
        fairness,
        tenant_weights: weights.iter().map(|&(t, w)| (t.to_owned(), w)).collect(),
    })
}

/// Requests waiting now.
fn waiting(queue: &Queue) -> u32 {
    queue.shared.state.lock().waiting
}

/// A place now or after waiting.
async fn admit(queue: &Queue, ticket: Ticket) -> Result<Place, Refused> {
    match queue.enter(ticket) {
        Entry::Now(place) => Ok(place),
        Entry::Queued(waiter) => waiter.wait().await,
        Entry::Refused(refused) => Err(refused),
    }
}

fn ticket(priority: i32, tenant: &str) -> Ticket {
    Ticket {
        priority,
        tenant: tenant.into(),
        deadline: None,
        cost: 1,
    }
}

fn due_in(mut ticket: Ticket, ms: u64) -> Ticket {
    ticket.deadline = Some(Duration::from_millis(ms));
    ticket
}

fn now(queue: &Queue, ticket: Ticket) -> Place {
    match queue.enter(ticket) {
        Entry::Now(place) => place,
        other => panic!("expected a place at once, got {other:?}"),
    }
}

fn queued(queue: &Queue, ticket: Ticket) -> Waiter {
    match queue.enter(ticket) {
        Entry::Queued(waiter) => waiter,
        other => panic!("expected to queue, got {other:?}"),
    }
}

fn refused(queue: &Queue, ticket: Ticket) -> Refused {
    match queue.enter(ticket) {
        Entry::Refused(refused) => refused,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

/// The answer a waiter has been sent, if any, taken.
fn answer(waiter: &mut Waiter) -> Option<Result<Place, Refused>> {
    waiter.answered.try_recv().ok()
}

/// Frees `held` and each place granted after it in turn (one place in all): the order in
/// which the waiters were served.
fn served_order(held: Place, mut waiters: Vec<(&'static str, Waiter)>) -> Vec<&'static str> {
    let mut order = Vec::new();
    let mut place = held;
    while !waiters.is_empty() {
        drop(place);
        let granted = waiters
            .iter_mut()
            .enumerate()
            .find_map(|(i, (name, waiter))| answer(waiter).map(|a| (i, *name, a)));
        let (i, name, granted) = granted.expect("a freed place goes to a waiter");
        place = granted.expect("served, not refused");
        order.push(name);
        waiters.remove(i);
    }
    order
}

#[tokio::test(start_paused = true)]
async fn a_higher_band_is_served_first_whenever_it_arrived() {
    let q = queue(1, 8);
    let held = now(&q, ticket(0, "a"));
    let waiters = vec![
        ("low", queued(&q, ticket(-1, "a"))),
        ("mid", queued(&q, ticket(0, "a"))),
        ("high", queued(&q, ticket(5, "a"))),
        ("mid2", queued(&q, ticket(0, "a"))),
        ("high2", queued(&q, ticket(5, "a"))),
    ];
    assert_eq!(
        served_order(held, waiters),
        ["high", "high2", "mid", "mid2", "low"]
    );
}

#[tokio::test(start_paused = true)]
async fn tenants_of_a_band_take_turns_by_weight() {
    let q = queue_with(1, 16, Fairness::RoundRobin, &[("gold", 2.0)]);
    let held = now(&q, ticket(0, "x"));
    let mut waiters = Vec::new();
    // The burst arrives first, in full; the others trickle in after it.
    for _ in 0..6 {
        waiters.push(("burst", queued(&q, ticket(0, "burst"))));
    }
    for _ in 0..4 {
        waiters.push(("gold", queued(&q, ticket(0, "gold"))));
    }
    for _ in 0..2 {
        waiters.push(("other", queued(&q, ticket(0, "other"))));
    }
    let order = served_order(held, waiters);
    // In the first 8 turns, gold (weight 2) is served twice as often as each weight-1 tenant.
    let first = &order[..8];
    let count = |t| first.iter().filter(|&&n| n == t).count();
    assert_eq!((count("gold"), count("burst"), count("other")), (4, 2, 2));
    assert_eq!(order.len(), 12);
}

#[tokio::test(start_paused = true)]
async fn least_service_serves_the_tenant_with_the_fewest_tokens_first() {
    let q = queue_with(1, 16, Fairness::LeastService, &[]);
    let held = now(&q, ticket(0, "x"));
    let costly = |tenant| Ticket {
        cost: 1000,
        ..ticket(0, tenant)
    };
    let cheap = |tenant| Ticket {
        cost: 10,
        ..ticket(0, tenant)
    };
    let waiters = vec![
        ("big", queued(&q, costly("big"))),
        ("big", queued(&q, costly("big"))),
        ("small", queued(&q, cheap("small"))),
        ("small", queued(&q, cheap("small"))),
        ("small", queued(&q, cheap("small"))),
    ];
    // Both start even; after one 1000-token request, big waits until small's 30 tokens are
    // served (round-robin would alternate).
    assert_eq!(
        served_order(held, waiters),
        ["big", "small", "small", "small", "big"]
    );
}

#[tokio::test(start_paused = true)]
async fn within_a_tenant_the_earliest_deadline_goes_first() {
    let q = queue(1, 8);
    let held = now(&q, ticket(0, "a"));
    let waiters = vec![
        ("none", queued(&q, ticket(0, "a"))), // counts as arrival + 60 s
        ("in 30s", queued(&q, due_in(ticket(0, "a"), 30_000))),
        ("in 2s", queued(&q, due_in(ticket(0, "a"), 2_000))),
        ("in 90s", queued(&q, due_in(ticket(0, "a"), 90_000))),
    ];
    assert_eq!(
        served_order(held, waiters),
        ["in 2s", "in 30s", "none", "in 90s"]
    );
}

#[tokio::test(start_paused = true)]
async fn a_full_queue_displaces_the_newest_of_the_lowest_band() {
    let q = queue(1, 3);
    let _held = now(&q, ticket(0, "a"));
    let mut low_old = queued(&q, ticket(-1, "a"));
    let mut low_new = queued(&q, ticket(-1, "b"));
    let mut mid = queued(&q, ticket(0, "a"));
    let _high = queued(&q, ticket(3, "c"));
    assert!(matches!(
        answer(&mut low_new),
        Some(Err(Refused::Displaced))
    ));
    assert!(answer(&mut low_old).is_none() && answer(&mut mid).is_none());
    let _high2 = queued(&q, ticket(3, "c"));
    assert!(matches!(
        answer(&mut low_old),
        Some(Err(Refused::Displaced))
    ));
    assert_eq!(waiting(&q), 3);
}

#[tokio::test(start_paused = true)]
async fn sheddable_requests_never_displace() {
    let q = queue(1, 1);
    let _held = now(&q, ticket(0, "a"));
    let mut sheddable = queued(&q, ticket(-5, "a"));
    assert_eq!(refused(&q, ticket(-1, "b")), Refused::Full);
    assert!(
        answer(&mut sheddable).is_none(),
        "a higher sheddable band does not displace"
    );
}

#[tokio::test(start_paused = true)]
async fn a_full_band_sheds_the_tenant_furthest_beyond_its_share() {
    let q = queue(1, 4);
    let _held = now(&q, ticket(0, "x"));
    let mut burst: Vec<_> = (0..3).map(|_| queued(&q, ticket(0, "burst"))).collect();
    let _quiet = queued(&q, ticket(0, "quiet"));
    // quiet's second request displaces burst's newest: burst holds 3 of 5 against a share of 2.5.
    let _quiet2 = queued(&q, ticket(0, "quiet"));
    assert!(matches!(
        answer(&mut burst[2]),
        Some(Err(Refused::Displaced))
    ));
    assert!(answer(&mut burst[0]).is_none() && answer(&mut burst[1]).is_none());
    // Now even (2 and 2): neither tenant can push the other out, the arrival is refused.
    assert_eq!(refused(&q, ticket(0, "burst")), Refused::Full);
    assert_eq!(refused(&q, ticket(0, "quiet")), Refused::Full);
    // A new tenant is under its share: it displaces one of the two, the newest.
    let _third = queued(&q, ticket(0, "third"));
    assert_eq!(waiting(&q), 4);
}

#[tokio::test(start_paused = true)]
async fn weights_set_the_share_a_tenant_may_hold() {
    let q = queue_with(1, 4, Fairness::RoundRobin, &[("gold", 3.0)]);
    let _held = now(&q, ticket(0, "x"));
    let _gold: Vec<_> = (0..3).map(|_| queued(&q, ticket(0, "gold"))).collect();
    let _plain = queued(&q, ticket(0, "plain"));
    // gold holds 3 of 5 (4 + the arrival) against a share of 3.75: it is not beyond it.
    assert_eq!(refused(&q, ticket(0, "plain")), Refused::Full);
}

#[tokio::test(start_paused = true)]
async fn a_waiter_leaves_with_expired_the_moment_its_deadline_passes() {
    let q = queue(1, 4);
    let _held = now(&q, ticket(0, "a"));
    let started = Instant::now();
    let waiter = queued(&q, due_in(ticket(0, "a"), 1_500));
    assert_eq!(waiter.wait().await.unwrap_err(), Refused::Expired);
    assert_eq!(started.elapsed(), Duration::from_millis(1_500));
    assert_eq!(waiting(&q), 0);
}

#[tokio::test(start_paused = true)]
async fn a_waiter_without_a_deadline_times_out_at_the_queue_timeout() {
    let q = queue(1, 4);
    let _held = now(&q, ticket(0, "a"));
    let started = Instant::now();
    // A deadline beyond the queue timeout: the queue timeout applies.
    let late = queued(&q, due_in(ticket(0, "b"), 120_000));
    let plain = queued(&q, ticket(0, "a"));
    let (late, plain) = tokio::join!(late.wait(), plain.wait());
    assert_eq!(late.unwrap_err(), Refused::TimedOut);
    assert_eq!(plain.unwrap_err(), Refused::TimedOut);
    assert_eq!(started.elapsed(), Duration::from_secs(60));
}

#[tokio::test(start_paused = true)]
async fn a_request_that_cannot_start_in_time_is_refused_on_arrival() {
    let q = queue(2, 8);
    assert_eq!(refused(&q, due_in(ticket(0, "a"), 0)), Refused::Late);
    let first = now(&q, ticket(0, "a"));
    let _second = now(&q, ticket(0, "a"));
    // No place has been released yet: no estimate, so any deadline may wait.
    drop(queued(&q, due_in(ticket(0, "a"), 1)));
    tokio::time::advance(Duration::from_secs(4)).await;
    drop(first); // held 4 s: two places serve about one request every 2 s
    let _third = now(&q, ticket(0, "b"));
    // No one ahead: about (0 + 1) × 4 s / 2 = 2 s.
    assert_eq!(refused(&q, due_in(ticket(0, "b"), 1_500)), Refused::Late);
    let _fits = queued(&q, due_in(ticket(0, "b"), 2_500));
    // One ahead: 4 s.
    assert_eq!(refused(&q, due_in(ticket(0, "b"), 3_000)), Refused::Late);
    let _fits_too = queued(&q, due_in(ticket(0, "b"), 5_000));
    // A higher band has no one ahead of it: 2 s again.
    assert_eq!(refused(&q, due_in(ticket(1, "b"), 1_500)), Refused::Late);
    let _fits_high = queued(&q, due_in(ticket(1, "b"), 2_500));
}

#[tokio::test(start_paused = true)]
async fn a_waiter_whose_client_left_leaves_at_once_and_loses_no_place() {
    let q = queue(1, 1);
    let held = now(&q, ticket(0, "a"));
    drop(queued(&q, ticket(0, "a")));
    assert_eq!(waiting(&q), 0);
    let mut next = queued(&q, ticket(0, "b"));
    drop(held);
    assert!(matches!(answer(&mut next), Some(Ok(_))));
}

#[tokio::test(start_paused = true)]
async fn a_place_granted_to_a_waiter_that_leaves_unread_goes_on() {
    let q = queue(1, 4);
    let held = now(&q, ticket(0, "a"));
    let first = queued(&q, ticket(0, "a"));
    let mut second = queued(&q, ticket(0, "a"));
    drop(held); // sent to `first`, which never reads it
    drop(first);
    assert!(matches!(answer(&mut second), Some(Ok(_))));
    assert_eq!(waiting(&q), 0);
}

#[tokio::test(start_paused = true)]
async fn a_waiter_served_as_its_timer_fires_keeps_the_place() {
    let q = queue(1, 4);
    let held = now(&q, ticket(0, "a"));
    let waiter = queued(&q, due_in(ticket(0, "a"), 1_000));
    let q2 = q.clone();
    let release = async move {
        tokio::time::sleep(Duration::from_millis(1_000)).await;
        drop(held);
        drop(q2);
    };
    let (served, ()) = tokio::join!(waiter.wait(), release);
    // Either answer is right at that instant; whichever it is, no place is lost.
    drop(served);
    let _again = now(&q, ticket(0, "a"));
}

/// What the property test does, step by step.
#[derive(Debug, Clone)]
enum Op {
    Arrive {
        priority: i32,
        tenant: u8,
        deadline_ms: Option<u64>,
    },
    /// The oldest running request ends.
    Finish,
    /// The client of the `n`th request still pending leaves.
    Leave(usize),
    Advance(u64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (-2i32..3, 0u8..3, proptest::option::of(0u64..3_000)).prop_map(
            |(priority, tenant, deadline_ms)| Op::Arrive { priority, tenant, deadline_ms }
        ),
        2 => Just(Op::Finish),
        1 => (0usize..8).prop_map(Op::Leave),
        2 => (1u64..1_500).prop_map(Op::Advance),
    ]
}

/// Lets every woken task run.
async fn settle() {
    for _ in 0..16 {
        tokio::task::yield_now().await;
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Whatever arrives, leaves, finishes or expires: every request is answered exactly once
    /// (or left before its answer), no more run than there are places, no more wait than the
    /// queue holds, and every place comes back.
    #[test]
    fn every_request_is_answered_exactly_once_and_no_place_is_lost(
        ops in proptest::collection::vec(op(), 1..80),
        fairness in prop_oneof![Just(Fairness::RoundRobin), Just(Fairness::LeastService)],
    ) {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .expect("runtime");
        runtime.block_on(async {
            let (max_concurrent, max_queued) = (2, 4);
            let q = Queue::new(QueueConfig {
                max_concurrent,
                max_queued,
                queue_timeout: Duration::from_secs(2),
                fairness,
                tenant_weights: [("t0".to_owned(), 2.0)].into(),
            });
            let (tx, mut answers) = mpsc::unbounded_channel();
            let mut pending = Vec::new();
            let mut running = VecDeque::new();
            let mut answered = HashMap::new();
            let mut left = 0;
            let mut arrivals = 0usize;
            for op in ops {
                match op {
                    Op::Arrive { priority, tenant, deadline_ms } => {
                        let ticket = Ticket {
                            priority,
                            tenant: format!("t{tenant}").into(),
                            deadline: deadline_ms.map(Duration::from_millis),
                            cost: 1 + u64::from(tenant) * 100,
                        };
                        let (q, tx, id) = (q.clone(), tx.clone(), arrivals);
                        arrivals += 1;
                        pending.push(tokio::spawn(async move {
                            let _ = tx.send((id, admit(&q, ticket).await));
                        }));
                    }
                    Op::Finish => drop(running.pop_front()),
                    Op::Leave(n) => {
                        if !pending.is_empty() {
                            let task = pending.remove(n % pending.len());
                            task.abort();
                            if task.await.is_err() {
                                left += 1;
                            }
                        }
                    }
                    Op::Advance(ms) => tokio::time::advance(Duration::from_millis(ms)).await,
                }
                settle().await;
                while let Ok((id, answer)) = answers.try_recv() {
                    prop_assert!(!answered.contains_key(&id), "{} answered twice", id);
                    answered.insert(id, answer.is_ok());
                    if let Ok(place) = answer {
                        prop_assert!(place.waited() <= Duration::from_secs(2));
                        running.push_back(place);
                    }
                }
                prop_assert!(running.len() <= max_concurrent as usize);
                prop_assert!(waiting(&q) <= max_queued);
                let free = q.shared.state.lock().free as usize;
                prop_assert_eq!(free + running.len(), max_concurrent as usize);
            }
            running.clear();
            tokio::time::advance(Duration::from_secs(3)).await;
            settle().await;
            while let Ok((id, answer)) = answers.try_recv() {
                prop_assert!(answered.insert(id, answer.is_ok()).is_none(), "{} answered twice", id);
            }
            for task in pending {
                if task.await.is_err() {
                    left += 1;
                }
            }
            while let Ok((id, answer)) = answers.try_recv() {
                prop_assert!(answered.insert(id, answer.is_ok()).is_none(), "{} answered twice", id);
            }
            prop_assert_eq!(answered.len() + left, arrivals);
            prop_assert_eq!(waiting(&q), 0);
            prop_assert_eq!(q.shared.state.lock().free, max_concurrent);
            Ok(())
        })?;
    }
}
