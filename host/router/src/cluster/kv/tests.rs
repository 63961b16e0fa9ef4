//! The snapshot's cached prefix: trusted, stale, without events, after removal. The
//! subscribers dial a loopback listener that never answers ZeroMQ's greeting, so the index
//! holds exactly what a test writes into it; time is paused.

use std::time::Duration;

use switchyard_contract::Protocol;
use switchyard_wire::kv_events::{BlockHash, BlockStored, Event};
use tokio::net::TcpListener;

use crate::cluster::{Cluster, EndpointSpec, OutlierConfig, Owner};
use crate::kv_events::SubscriberConfig;

const STALE_AFTER: Duration = Duration::from_secs(10);

fn spec(url: &str, kv_events: Option<String>) -> EndpointSpec {
    EndpointSpec {
        protocol: Protocol::Vllm,
        kv_events,
        ..EndpointSpec::new(url)
    }
}

/// Endpoint 0 publishes (to `silent`), endpoint 1 does not; subscribers started.
fn cluster(silent: &TcpListener) -> Cluster {
    let events = format!("tcp://{}", silent.local_addr().expect("bound"));
    let cluster = Cluster::new(
        vec![spec("http://a", Some(events)), spec("http://b", None)],
        OutlierConfig::default(),
    )
    .with_kv_events(SubscriberConfig {
        stale_after: STALE_AFTER,
        ..SubscriberConfig::default()
    });
    for id in 0..2 {
        cluster.subscribe_kv_events(id);
    }
    cluster
}

async fn silent_listener() -> TcpListener {
    TcpListener::bind("127.0.0.1:0").await.expect("binds")
}

/// Endpoint `id` cached two blocks of 4 tokens: 1..=8.
fn store_two_blocks(cluster: &Cluster, id: u32) {
    let stored = BlockStored::new(
        vec![BlockHash::Int(0xa), BlockHash::Int(0xb)],
        None,
        (1..=8).collect(),
        4,
    );
    cluster
        .kv
        .index
        .write()
        .apply(id, &Event::BlockStored(stored));
}

fn cached(cluster: &Cluster, prompt: &[u32]) -> Vec<Option<u32>> {
    cluster
        .snapshot_for("m", prompt)
        .iter()
        .map(|e| e.cached_prefix)
        .collect()
}

#[test]
fn without_events_no_endpoint_has_a_cached_prefix_and_nothing_is_looked_up() {
    let cluster = Cluster::new(
        vec![spec("http://a", None), spec("http://b", None)],
        OutlierConfig::default(),
    );
    cluster.subscribe_kv_events(0);
    assert!(!cluster.kv.is_active());
    assert_eq!(cached(&cluster, &[1, 2, 3, 4, 5]), [None, None]);
    assert!(cluster.status().iter().all(|e| e.kv_events.is_none()));
}

#[tokio::test(start_paused = true)]
async fn a_trusted_index_gives_the_prompts_cached_prefix_and_zero_for_a_miss() {
    let silent = silent_listener().await;
    let cluster = cluster(&silent);
    assert_eq!(
        cached(&cluster, &[1, 2, 3, 4]),
        [Some(0), None],
        "nothing yet"
    );
    store_two_blocks(&cluster, 0);
    assert_eq!(
        cached(&cluster, &[1, 2, 3, 4, 5, 6, 7, 8, 9]),
        [Some(8), None]
    );
    assert_eq!(cached(&cluster, &[1, 2, 3, 4, 5, 0, 7, 8]), [Some(4), None]);
    assert_eq!(cached(&cluster, &[9, 2, 3, 4]), [Some(0), None]);
    let status = cluster.status();
    let kv = status[0].kv_events.as_ref().expect("endpoint 0 publishes");
    assert_eq!((kv.blocks, kv.block_size, kv.stale), (2, Some(4), false));
    assert!(status[1].kv_events.is_none());
}

#[tokio::test(start_paused = true)]
async fn a_prediction_hits_when_it_is_the_engines_cached_tokens_in_whole_blocks() {
    let silent = silent_listener().await;
    let cluster = cluster(&silent);
    // No block published yet: vLLM's 16-token blocks are assumed.
    assert!(cluster.kv_prediction_hit(0, 0, 15, 40));
    assert!(!cluster.kv_prediction_hit(0, 0, 16, 40));
    store_two_blocks(&cluster, 0);
    // 4-token blocks now: an engine may count a partial block no event announced, and never
    // counts the block holding the prompt's last token.
    for (predicted, cached, prompt_len, hit) in [
        (8, 8, 10, true),
        (8, 11, 12, true),
        (8, 12, 13, false),
        (8, 7, 10, false),
        (0, 3, 10, true),
        (4, 0, 10, false),
        (8, 4, 8, true),
        (8, 8, 8, false),
        (8, 0, 8, false),
        (0, 0, 1, true),
    ] {
        assert_eq!(
            cluster.kv_prediction_hit(0, predicted, cached, prompt_len),
            hit,
            "predicted {predicted} of {prompt_len}, engine cached {cached}"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn an_endpoint_silent_after_serving_a_block_is_stale_until_it_publishes() {
    let silent = silent_listener().await;
    let cluster = cluster(&silent);
    store_two_blocks(&cluster, 0);
    let prompt = [1, 2, 3, 4, 5, 6, 7, 8];
    // Shorter than a block: the engine need not publish, so silence says nothing.
    cluster.note_served([0, 1], 3);
    tokio::time::advance(STALE_AFTER).await;
    assert_eq!(
        cached(&cluster, &prompt),
        [Some(8), None],
        "idle stays trusted"
    );

    cluster.note_served([0], prompt.len());
    tokio::time::advance(STALE_AFTER - Duration::from_millis(1)).await;
    assert_eq!(cached(&cluster, &prompt), [Some(8), None], "not yet");
    tokio::time::advance(Duration::from_millis(1)).await;
    assert_eq!(cached(&cluster, &prompt), [None, None], "stale");
    assert!(
        cluster.status()[0]
            .kv_events
            .as_ref()
            .expect("publishes")
            .stale
    );
}

#[tokio::test(start_paused = true)]
async fn a_removed_endpoint_leaves_the_index_and_its_subscriber_stops() {
    let silent = silent_listener().await;
    let cluster = cluster(&silent);
    store_two_blocks(&cluster, 0);
    cluster.remove(0).expect("idle");
    assert!(cluster.kv.index.read().stats(0).is_none());
    assert!(!cluster.kv.is_active(), "its subscriber is gone");
    assert_eq!(cached(&cluster, &[1, 2, 3, 4]), [None, None]);
    assert!(
        cluster.status()[0].kv_events.is_none(),
        "a tombstone shows no event state"
    );
    // A new endpoint publishing at the same address starts from nothing.
    let events = format!("tcp://{}", silent.local_addr().expect("bound"));
    let id = cluster
        .add(&spec("http://a", Some(events)), Owner::Admin)
        .expect("added");
    cluster.subscribe_kv_events(id);
    assert_eq!(cached(&cluster, &[1, 2, 3, 4]), [None, None, Some(0)]);
}

#[test]
fn an_admin_body_names_kv_event_sockets_checked_as_the_config_file_is() {
    let body = r#"{"url": "http://127.0.0.1:9", "protocol": "vllm",
        "kv_events": "tcp://127.0.0.1:5557", "kv_events_replay": "tcp://127.0.0.1:5558",
        "kv_events_topic": "kv@"}"#;
    let spec: EndpointSpec = serde_json::from_str(body).expect("parses");
    spec.check().expect("valid");
    let source = spec.kv_events_source().expect("publishes");
    assert_eq!(
        (
            source.events.as_str(),
            source.replay.as_deref(),
            source.topic.as_str()
        ),
        ("tcp://127.0.0.1:5557", Some("tcp://127.0.0.1:5558"), "kv@")
    );
    let topic_alone: EndpointSpec =
        serde_json::from_str(r#"{"url": "http://127.0.0.1:9", "kv_events_topic": "kv@"}"#)
            .expect("parses");
    assert_eq!(
        topic_alone.check(),
        Err("kv_events_topic needs kv_events (the event socket)".to_owned())
    );
    let zero_port = spec_with_events("tcp://127.0.0.1:0");
    assert!(zero_port.check().is_err());
    assert!(spec_with_events("tcp://:5557").check().is_err());
    assert!(spec_with_events("tcp://[fd00::7]:5557").check().is_ok());
}

fn spec_with_events(events: &str) -> EndpointSpec {
    spec("http://127.0.0.1:9", Some(events.into()))
}
