use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;

use super::*;

fn admission(max_concurrent: u32, max_queued: u32, queue_timeout: Duration) -> Arc<Admission> {
    Arc::new(Admission::new(
        AdmissionConfig {
            max_concurrent,
            max_queued,
            queue_timeout,
            flow: FlowControl::default(),
        },
        AdmissionMetrics::default(),
    ))
}

fn rejected(a: &Admission, reason: &str) -> u64 {
    a.metrics
        .rejected
        .get_or_create(&vec![("reason", reason.to_owned())])
        .get()
}

/// Spawns a request that waits for admission, holds its permit until told to finish, and
/// reports `id` once admitted. Returns once it is queued.
async fn queued_request(
    a: &Arc<Admission>,
    id: u32,
    admitted: mpsc::UnboundedSender<u32>,
) -> mpsc::UnboundedSender<()> {
    let (finish, mut finished) = mpsc::unbounded_channel::<()>();
    let before = a.metrics.queued.get();
    let a2 = Arc::clone(a);
    tokio::spawn(async move {
        let permit = a2.admit(Claim::default()).await.expect("admitted");
        admitted.send(id).expect("test listens");
        let _ = finished.recv().await;
        drop(permit);
    });
    for _ in 0..100 {
        if a.metrics.queued.get() > before {
            return finish;
        }
        tokio::task::yield_now().await;
    }
    panic!("request {id} never queued");
}

#[tokio::test(start_paused = true)]
async fn places_freed_go_to_the_longest_waiter_first() {
    let a = admission(2, 8, Duration::from_secs(60));
    let first = a.admit(Claim::default()).await.expect("a free place");
    let second = a.admit(Claim::default()).await.expect("a free place");
    assert_eq!(a.metrics.in_flight.get(), 2);
    let (tx, mut admitted) = mpsc::unbounded_channel();
    let mut finishers = Vec::new();
    for id in 1..=3 {
        finishers.push(queued_request(&a, id, tx.clone()).await);
    }
    assert_eq!(a.metrics.queued.get(), 3);
    drop(first);
    assert_eq!(admitted.recv().await, Some(1));
    drop(second);
    assert_eq!(admitted.recv().await, Some(2));
    finishers[0].send(()).expect("running");
    assert_eq!(admitted.recv().await, Some(3));
    assert_eq!(a.metrics.queued.get(), 0);
    assert_eq!(a.metrics.admitted.get(), 5);
    assert_eq!(
        rejected(&a, "queue_full") + rejected(&a, "queue_timeout"),
        0
    );
}

#[tokio::test(start_paused = true)]
async fn a_full_queue_refuses_at_once() {
    let a = admission(1, 1, Duration::from_secs(60));
    let _held = a.admit(Claim::default()).await.expect("a free place");
    let (tx, _admitted) = mpsc::unbounded_channel();
    let _waiting = queued_request(&a, 1, tx).await;
    let refused = a
        .admit(Claim::default())
        .await
        .expect_err("no room to wait");
    assert_eq!(
        refused,
        Refusal::QueueFull {
            max_concurrent: 1,
            max_queued: 1
        }
    );
    assert_eq!(rejected(&a, "queue_full"), 1);
    assert_eq!(
        a.metrics.queued.get(),
        1,
        "the refused request never queued"
    );
}

#[tokio::test(start_paused = true)]
async fn no_queue_refuses_whatever_finds_every_place_taken() {
    let a = admission(1, 0, Duration::from_secs(60));
    let held = a.admit(Claim::default()).await.expect("a free place");
    assert!(matches!(
        a.admit(Claim::default()).await,
        Err(Refusal::QueueFull { .. })
    ));
    drop(held);
    assert!(
        a.admit(Claim::default()).await.is_ok(),
        "the freed place is taken again"
    );
}

#[tokio::test(start_paused = true)]
async fn a_request_still_queued_at_the_timeout_is_refused() {
    let a = admission(1, 4, Duration::from_millis(500));
    let _held = a.admit(Claim::default()).await.expect("a free place");
    let started = tokio::time::Instant::now();
    let refused = a
        .admit(Claim::default())
        .await
        .expect_err("no place frees up");
    assert_eq!(
        refused,
        Refusal::QueueTimeout {
            waited: Duration::from_millis(500)
        }
    );
    assert_eq!(started.elapsed(), Duration::from_millis(500));
    assert_eq!(rejected(&a, "queue_timeout"), 1);
    assert_eq!(a.metrics.queued.get(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_client_that_leaves_while_queued_leaves_the_queue() {
    let a = admission(1, 1, Duration::from_secs(60));
    let held = a.admit(Claim::default()).await.expect("a free place");
    let a2 = Arc::clone(&a);
    let waiter = tokio::spawn(async move { a2.admit(Claim::default()).await.map(drop) });
    while a.metrics.queued.get() == 0 {
        tokio::task::yield_now().await;
    }
    waiter.abort();
    let _ = waiter.await;
    assert_eq!(a.metrics.queued.get(), 0);
    drop(held);
    let _next = a
        .admit(Claim::default())
        .await
        .expect("the place is not lost to the client that left");
    assert_eq!(a.metrics.in_flight.get(), 1);
}

#[tokio::test(start_paused = true)]
async fn defaults_admit_32_concurrent_clients_without_waiting() {
    let a = admission(
        AdmissionConfig::default().max_concurrent,
        AdmissionConfig::default().max_queued,
        AdmissionConfig::default().queue_timeout,
    );
    let mut permits = Vec::new();
    for _ in 0..32 {
        permits.push(a.admit(Claim::default()).await.expect("admitted"));
    }
    assert_eq!(a.metrics.queued.get(), 0);
    assert_eq!(a.metrics.in_flight.get(), 32);
    drop(permits);
    assert_eq!(a.metrics.in_flight.get(), 0);
}

#[test]
fn retry_after_is_whole_seconds_and_at_least_one() {
    let after = |ms| admission(1, 1, Duration::from_millis(ms)).retry_after();
    assert_eq!(after(5000), Duration::from_secs(5));
    assert_eq!(after(1500), Duration::from_secs(2));
    assert_eq!(after(10), Duration::from_secs(1));
}

#[tokio::test(start_paused = true)]
async fn a_held_request_counts_in_its_models_queue_until_ready_or_the_timeout() {
    let a = admission(4, 4, Duration::from_secs(5));
    let depth = |a: &Admission| {
        a.metrics
            .queue_depth
            .get_or_create(&vec![("model", "m".to_owned())])
            .get()
    };
    let (ready, readied) = tokio::sync::oneshot::channel::<()>();
    let held = tokio::spawn({
        let a = Arc::clone(&a);
        async move {
            let ready = async {
                let _ = readied.await;
            };
            a.hold("m".into(), Duration::from_secs(60), ready).await
        }
    });
    tokio::time::sleep(Duration::from_secs(20)).await;
    assert_eq!(depth(&a), 1, "held: demand an autoscaler can see");
    ready.send(()).expect("still held");
    let waited = held.await.expect("no panic");
    assert_eq!(
        waited,
        Some(Duration::from_secs(20)),
        "released by the event"
    );
    assert_eq!(depth(&a), 0);

    let never = std::future::pending::<()>();
    let timed_out = a.hold("m".into(), Duration::from_secs(60), never).await;
    assert_eq!(timed_out, None);
    assert_eq!(depth(&a), 0);
}
