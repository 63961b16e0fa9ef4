//! Subscribers against a real publisher on loopback. Every wait is on the subscriber's
//! applied-sequence watch, bounded by a timeout.

mod publisher;

use std::time::Duration;

use switchyard_kv_index::{Adapter, MediumSet};
use switchyard_wire::kv_events::frames::ReplyShape;
use switchyard_wire::kv_events::{BlockHash, BlockStored, Event, EventBatch};
use tokio::time::Instant;

use super::*;
use publisher::Publisher;

const ENDPOINT: EndpointId = 7;
/// A bound on every wait; reconnection backs off from 100 ms.
const WAIT: Duration = Duration::from_secs(10);

fn batch(events: Vec<Event>) -> EventBatch {
    EventBatch {
        ts: 1.0,
        events,
        data_parallel_rank: Some(0),
    }
}

/// One block of 4 tokens starting at `first`, after `parent`.
fn block(hash: u64, parent: Option<u64>, first: u32) -> EventBatch {
    batch(vec![Event::BlockStored(BlockStored::new(
        vec![BlockHash::Int(hash)],
        parent.map(BlockHash::Int),
        (first..first + 4).collect(),
        4,
    ))])
}

fn held(index: &SharedIndex, prompt: &[u32]) -> usize {
    index
        .read()
        .lookup(prompt, Adapter::Base, MediumSet::GPU)
        .into_iter()
        .find(|m| m.endpoint == ENDPOINT)
        .map_or(0, |m| m.tokens)
}

fn tokens(from: u32, to: u32) -> Vec<u32> {
    (from..to).collect()
}

fn count(counter: &std::sync::atomic::AtomicU64) -> u64 {
    Counters::get(counter)
}

async fn applied(handle: &SubscriberHandle, seq: Option<u64>) {
    tokio::time::timeout(WAIT, handle.applied().wait_for(|applied| *applied == seq))
        .await
        .unwrap_or_else(|_| panic!("applied never reached {seq:?}"))
        .expect("the subscriber is running");
}

struct Setup {
    publisher: Publisher,
    index: SharedIndex,
    subscription: Subscription,
    /// The DP rank subscribed as, stamped on the batches that bring the subscriber up.
    rank: Option<u32>,
}

impl Setup {
    async fn start(replay: Option<ReplyShape>) -> Self {
        Self::start_as(replay, None).await
    }

    /// Subscribed as DP rank `rank` of an engine with several, when given.
    async fn start_as(replay: Option<ReplyShape>, rank: Option<u32>) -> Self {
        let publisher = Publisher::bind(replay).await;
        let mut source = KvEventsSource::new(publisher.events_url());
        if let Some(url) = publisher.replay_url() {
            source = source.with_replay(url);
        }
        source.rank = rank;
        let index = shared_index(1000);
        let subscription = spawn(ENDPOINT, source, SubscriberConfig::default(), index.clone());
        let mut setup = Self {
            publisher,
            index,
            subscription,
            rank,
        };
        setup.until_live().await;
        setup
    }

    fn handle(&self) -> &SubscriberHandle {
        self.subscription.handle()
    }

    /// Publishes empty batches until one is applied: the subscription has reached the PUB
    /// socket (a PUB drops what it sends before), whatever the replay socket recovered.
    async fn until_live(&mut self) {
        let mut empty = batch(vec![]);
        empty.data_parallel_rank = Some(i64::from(self.rank.unwrap_or(0)));
        for _ in 0..100 {
            let seq = self.publisher.publish(&empty).await;
            let mut applied = self.handle().applied();
            let reached = applied.wait_for(|applied| applied.is_some_and(|a| a >= seq));
            if tokio::time::timeout(Duration::from_millis(100), reached)
                .await
                .is_ok()
            {
                return;
            }
        }
        panic!("the subscriber never applied a live batch");
    }

    async fn publish(&mut self, batch: &EventBatch) -> u64 {
        let seq = self.publisher.publish(batch).await;
        applied(self.handle(), Some(seq)).await;
        seq
    }
}

#[tokio::test]
async fn live_batches_are_applied_in_order() {
    let mut setup = Setup::start(Some(ReplyShape::WithTopic)).await;
    setup.publish(&block(1, None, 0)).await;
    setup.publish(&block(2, Some(1), 4)).await;
    assert_eq!(held(&setup.index, &tokens(0, 9)), 8);
    let counters = setup.handle().counters();
    assert_eq!(count(&counters.gaps), 0);
    assert!(count(&counters.events) >= 2);
    setup.subscription.stop().await;
}

#[tokio::test]
async fn a_batch_of_another_dp_rank_is_counted_and_dropped_its_sequence_kept() {
    let mut setup = Setup::start_as(Some(ReplyShape::WithTopic), Some(1)).await;
    let stamped = |mut batch: EventBatch, rank| {
        batch.data_parallel_rank = rank;
        batch
    };
    setup.publish(&stamped(block(1, None, 0), Some(0))).await;
    assert_eq!(held(&setup.index, &tokens(0, 9)), 0, "rank 0's block");
    let mismatches = |setup: &Setup| count(&setup.handle().counters().rank_mismatches);
    assert_eq!(mismatches(&setup), 1);
    setup.publish(&stamped(block(1, None, 0), Some(1))).await;
    // The first layouts stamp no rank: taken as this socket's.
    setup.publish(&stamped(block(2, Some(1), 4), None)).await;
    assert_eq!(held(&setup.index, &tokens(0, 9)), 8);
    assert_eq!(mismatches(&setup), 1);
    assert_eq!(
        count(&setup.handle().counters().gaps),
        0,
        "a dropped batch still counts in sequence"
    );
    setup.subscription.stop().await;
}

#[tokio::test]
async fn a_single_rank_subscription_takes_any_rank() {
    let mut setup = Setup::start(Some(ReplyShape::WithTopic)).await;
    let mut other = block(1, None, 0);
    other.data_parallel_rank = Some(3);
    setup.publish(&other).await;
    assert_eq!(held(&setup.index, &tokens(0, 5)), 4);
    assert_eq!(count(&setup.handle().counters().rank_mismatches), 0);
    setup.subscription.stop().await;
}

#[test]
fn each_dp_rank_publishes_at_the_configured_ports_plus_its_rank() {
    let source = KvEventsSource::new("tcp://10.0.0.7:5557")
        .with_replay("tcp://[fd00::7]:5600")
        .with_topic("kv@");
    let rank = source.for_rank(3);
    assert_eq!(
        (
            rank.events.as_str(),
            rank.replay.as_deref(),
            rank.topic.as_str(),
            rank.rank
        ),
        (
            "tcp://10.0.0.7:5560",
            Some("tcp://[fd00::7]:5603"),
            "kv@",
            Some(3)
        )
    );
    assert_eq!(source.for_rank(0).events, source.events);
    assert_eq!(source.for_rank(0).rank, Some(0));
}

async fn a_dropped_batch_is_replayed(shape: ReplyShape) {
    let mut setup = Setup::start(Some(shape)).await;
    setup.publish(&block(1, None, 0)).await;
    let replays = count(&setup.handle().counters().replays);
    setup.publisher.publish_dropped(&block(2, Some(1), 4));
    setup.publish(&block(3, Some(2), 8)).await;
    assert_eq!(held(&setup.index, &tokens(0, 13)), 12);
    let counters = setup.handle().counters();
    assert_eq!(count(&counters.gaps), 1);
    assert_eq!(count(&counters.replays), replays + 1);
    assert_eq!(count(&counters.replay_failures), 0);
    // The live batch that showed the gap came in the replay too, and counted once.
    assert_eq!(count(&counters.duplicates), 1);
    assert_eq!(count(&counters.clears), 0);
    setup.subscription.stop().await;
}

#[tokio::test]
async fn a_dropped_batch_is_replayed_from_a_legacy_replay_socket() {
    a_dropped_batch_is_replayed(ReplyShape::Legacy).await;
}

#[tokio::test]
async fn a_dropped_batch_is_replayed_from_a_topic_framed_replay_socket() {
    a_dropped_batch_is_replayed(ReplyShape::WithTopic).await;
}

#[tokio::test]
async fn a_gap_the_engine_no_longer_buffers_clears_and_rebuilds() {
    let mut setup = Setup::start(Some(ReplyShape::Legacy)).await;
    setup.publish(&block(1, None, 0)).await;
    // Lost live, then out of the engine's window (it could have been a removal of block 1).
    setup.publisher.publish_dropped(&block(2, None, 100));
    let next = setup.publisher.publish_dropped(&block(3, None, 200));
    setup.publisher.forget_before(next);
    setup.publish(&block(4, None, 300)).await;
    assert_eq!(held(&setup.index, &tokens(0, 4)), 0, "cleared");
    assert_eq!(held(&setup.index, &tokens(100, 104)), 0, "lost for good");
    // What the engine still had, and the live batch.
    assert_eq!(held(&setup.index, &tokens(200, 204)), 4);
    assert_eq!(held(&setup.index, &tokens(300, 304)), 4);
    let counters = setup.handle().counters();
    assert_eq!(count(&counters.replay_failures), 1);
    assert_eq!(count(&counters.clears), 1);
    setup.subscription.stop().await;
}

#[tokio::test]
async fn a_gap_without_a_replay_socket_clears_and_rebuilds_from_the_live_stream() {
    let mut setup = Setup::start(None).await;
    setup.publish(&block(1, None, 0)).await;
    setup.publisher.publish_dropped(&block(2, None, 100));
    setup.publish(&block(3, None, 200)).await;
    assert_eq!(held(&setup.index, &tokens(0, 4)), 0);
    assert_eq!(held(&setup.index, &tokens(200, 204)), 4);
    let counters = setup.handle().counters();
    assert_eq!((count(&counters.gaps), count(&counters.clears)), (1, 1));
    assert_eq!(count(&counters.replays), 0);
    setup.subscription.stop().await;
}

#[tokio::test]
async fn a_sequence_going_back_clears_and_replays_the_new_process() {
    let mut setup = Setup::start(Some(ReplyShape::WithTopic)).await;
    setup.publish(&block(1, None, 0)).await;
    // What a new process behind the same connection would send: numbers from 0 again.
    setup.publisher.renumber_from_zero();
    setup.publish(&block(9, None, 50)).await;
    assert_eq!(
        held(&setup.index, &tokens(0, 4)),
        0,
        "the old process's block"
    );
    assert_eq!(held(&setup.index, &tokens(50, 54)), 4);
    let counters = setup.handle().counters();
    assert_eq!(count(&counters.clears), 1);
    // Replayed, then received live.
    assert_eq!(count(&counters.duplicates), 1);
    setup.subscription.stop().await;
}

#[tokio::test]
async fn a_restarted_publisher_is_redialled_and_the_endpoint_rebuilt() {
    let mut setup = Setup::start(Some(ReplyShape::WithTopic)).await;
    setup.publish(&block(1, None, 0)).await;
    let mut lost = setup.handle().applied();
    setup.publisher = setup.publisher.restart(Some(ReplyShape::WithTopic)).await;
    // Cleared as soon as the connection drops.
    tokio::time::timeout(WAIT, lost.wait_for(Option::is_none))
        .await
        .expect("cleared on disconnect")
        .expect("running");
    assert_eq!(held(&setup.index, &tokens(0, 4)), 0);
    // The new process's first batch arrives live or by the replay after reconnecting.
    let seq = setup.publisher.publish(&block(9, None, 50)).await;
    assert_eq!(seq, 0);
    applied(setup.handle(), Some(0)).await;
    assert_eq!(held(&setup.index, &tokens(50, 54)), 4);
    assert_eq!(count(&setup.handle().counters().disconnects), 1);
    setup.subscription.stop().await;
}

#[tokio::test]
async fn a_resync_signal_rebuilds_from_the_engines_buffer() {
    let mut setup = Setup::start(Some(ReplyShape::Legacy)).await;
    let seq = setup.publish(&block(1, None, 0)).await;
    let clears = count(&setup.handle().counters().clears);
    setup.handle().resync(ResyncReason::EngineRestarted);
    tokio::time::timeout(WAIT, async {
        while count(&setup.handle().counters().clears) == clears {
            setup.handle().applied().changed().await.expect("running");
        }
    })
    .await
    .expect("cleared");
    applied(setup.handle(), Some(seq)).await;
    assert_eq!(
        held(&setup.index, &tokens(0, 4)),
        4,
        "rebuilt from the replay"
    );
    setup.subscription.stop().await;
}

#[tokio::test]
async fn messages_that_are_not_batches_are_counted_and_skipped() {
    let mut setup = Setup::start(Some(ReplyShape::Legacy)).await;
    setup
        .publisher
        .send_frames(vec![b"topic".to_vec(), vec![1, 2]])
        .await;
    setup.publish(&block(1, None, 0)).await;
    assert_eq!(count(&setup.handle().counters().malformed), 1);
    assert_eq!(count(&setup.handle().counters().gaps), 0);
    assert_eq!(held(&setup.index, &tokens(0, 4)), 4);
    setup.subscription.stop().await;
}

#[test]
fn an_endpoint_is_stale_only_after_serving_and_then_publishing_nothing() {
    let (handle, _resyncs) = SubscriberHandle::new(ENDPOINT, Duration::from_secs(10));
    let start = Instant::now();
    let at = |secs| start + Duration::from_secs(secs);
    // Idle: trusted however long nothing comes.
    assert!(!handle.is_stale(at(3600)));
    handle.note_served(at(0));
    handle.note_served(at(5));
    assert!(!handle.is_stale(at(9)));
    assert!(
        handle.is_stale(at(10)),
        "10 s after the first request served"
    );
    handle.note_event(at(11));
    assert!(!handle.is_stale(at(100)));
    assert_eq!(handle.last_event_at(), Some(at(11)));
    handle.note_served(at(200));
    assert!(!handle.is_stale(at(209)));
    assert!(handle.is_stale(at(210)));
}
