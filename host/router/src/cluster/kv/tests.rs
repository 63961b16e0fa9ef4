//! The snapshot's cached prefix: trusted, stale, without events, after removal. The
//! subscribers dial a loopback listener that never answers ZeroMQ's greeting, so the index
//! holds exactly what a test writes into it; time is paused.

use std::time::Duration;

use switchyard_contract::Protocol;
use switchyard_wire::kv_events::{BlockHash, BlockStored, Event};
use tokio::net::TcpListener;

use crate::cluster::{Cluster, EndpointSpec, OutlierConfig, Owner, RankPins};
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
    cluster_of(spec("http://a", Some(events)))
}

/// Endpoint 0 is `publishing`, endpoint 1 does not publish; subscribers started.
fn cluster_of(publishing: EndpointSpec) -> Cluster {
    let cluster = Cluster::new(
        vec![publishing, spec("http://b", None)],
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
    store_two_blocks_on(cluster, id, 0);
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
    cluster.note_served([0, 1], 3, &RankPins::default());
    tokio::time::advance(STALE_AFTER).await;
    assert_eq!(
        cached(&cluster, &prompt),
        [Some(8), None],
        "idle stays trusted"
    );

    cluster.note_served([0], prompt.len(), &RankPins::default());
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
        "kv_events_topic": "kv@", "kv_events_dp_size": 2}"#;
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

/// `n` never-answering listeners on consecutive ports, as a DP engine's ranks publish.
async fn silent_listeners(n: u16) -> Vec<TcpListener> {
    for _ in 0..50 {
        let first = silent_listener().await;
        let base = first.local_addr().expect("bound").port();
        let mut all = vec![first];
        for rank in 1..n {
            let Some(port) = base.checked_add(rank) else {
                break;
            };
            match TcpListener::bind(("127.0.0.1", port)).await {
                Ok(listener) => all.push(listener),
                Err(_) => break,
            }
        }
        if all.len() == usize::from(n) {
            return all;
        }
    }
    panic!("no {n} consecutive free ports");
}

/// Endpoint 0 publishes from one DP rank per listener; endpoint 1 from none.
fn dp_cluster(ranks: &[TcpListener]) -> Cluster {
    let events = format!("tcp://{}", ranks[0].local_addr().expect("bound"));
    cluster_of(EndpointSpec {
        kv_events_dp_size: Some(ranks.len() as u32),
        ..spec("http://a", Some(events))
    })
}

/// Rank `rank` of endpoint `id` cached two blocks of 4 tokens: 1..=8 (rank 0's index is every
/// single-rank endpoint's).
fn store_two_blocks_on(cluster: &Cluster, id: u32, rank: u32) {
    let stored = BlockStored::new(
        vec![BlockHash::Int(0xa), BlockHash::Int(0xb)],
        None,
        (1..=8).collect(),
        4,
    );
    cluster
        .kv
        .rank_index(rank)
        .write()
        .apply(id, &Event::BlockStored(stored));
}

/// The cached prefixes a request the router sends sees, and the rank endpoint 0 is pinned to.
fn pinned(cluster: &Cluster, prompt: &[u32]) -> (Vec<Option<u32>>, Option<u32>) {
    let (snapshot, pins) = cluster.snapshot_pinned("m", prompt);
    (
        snapshot.iter().map(|e| e.cached_prefix).collect(),
        pins.rank(0),
    )
}

const PROMPT: [u32; 9] = [1, 2, 3, 4, 5, 6, 7, 8, 9];

#[tokio::test(start_paused = true)]
async fn a_dp_endpoint_shows_the_most_a_rank_holds_and_pins_the_request_to_a_rank_holding_it() {
    let ranks = silent_listeners(3).await;
    let cluster = dp_cluster(&ranks);
    assert_eq!(
        pinned(&cluster, &PROMPT),
        (vec![Some(0), None], None),
        "every rank holds nothing: the engine picks"
    );
    store_two_blocks_on(&cluster, 0, 2);
    assert_eq!(pinned(&cluster, &PROMPT), (vec![Some(8), None], Some(2)));
    assert_eq!(
        cached(&cluster, &PROMPT),
        [Some(0), None],
        "unpinned (an EPP answer): what any rank holds at least"
    );

    // Two ranks hold it: each is pinned to in turn, drawn evenly.
    store_two_blocks_on(&cluster, 0, 1);
    let mut seen = [false; 3];
    for _ in 0..64 {
        let (prefixes, rank) = pinned(&cluster, &PROMPT);
        assert_eq!(prefixes, [Some(8), None]);
        seen[rank.expect("rank 0 holds less") as usize] = true;
    }
    assert_eq!(seen, [false, true, true]);

    // Every rank holds it: whichever the engine picks, no pin needed.
    store_two_blocks_on(&cluster, 0, 0);
    assert_eq!(pinned(&cluster, &PROMPT), (vec![Some(8), None], None));
    assert_eq!(cached(&cluster, &PROMPT), [Some(8), None]);

    let status = cluster.status();
    let kv = status[0].kv_events.as_ref().expect("publishes");
    let base = ranks[0].local_addr().expect("bound").port();
    let shown: Vec<(Option<u32>, String, usize)> = std::iter::once(kv)
        .chain(&kv.dp_ranks)
        .map(|rank| (rank.dp_rank, rank.events.clone(), rank.blocks))
        .collect();
    let expected: Vec<(Option<u32>, String, usize)> = (0..3)
        .map(|rank| {
            (
                Some(rank),
                format!("tcp://127.0.0.1:{}", base + rank as u16),
                2,
            )
        })
        .collect();
    assert_eq!(shown, expected);

    cluster.remove(0).expect("idle");
    for rank in 0..3 {
        assert!(cluster.kv.rank_index(rank).read().stats(0).is_none());
    }
    assert!(!cluster.kv.is_active());
}

#[tokio::test(start_paused = true)]
async fn a_stale_rank_is_left_out_and_only_a_pinned_rank_must_publish() {
    let ranks = silent_listeners(2).await;
    let cluster = dp_cluster(&ranks);
    store_two_blocks_on(&cluster, 0, 1);
    let (_, pins) = cluster.snapshot_pinned("m", &PROMPT);
    assert_eq!(pins.rank(0), Some(1));

    // Unpinned, the engine picked a rank the router cannot name: none goes stale.
    cluster.note_served([0], PROMPT.len(), &RankPins::default());
    tokio::time::advance(STALE_AFTER).await;
    assert_eq!(pinned(&cluster, &PROMPT), (vec![Some(8), None], Some(1)));

    // Pinned to rank 1, which then publishes nothing: only rank 1 is stale.
    cluster.note_served([0], PROMPT.len(), &pins);
    tokio::time::advance(STALE_AFTER).await;
    assert_eq!(
        pinned(&cluster, &PROMPT),
        (vec![Some(0), None], Some(0)),
        "rank 0 alone is trusted"
    );
    let status = cluster.status();
    let kv = status[0].kv_events.as_ref().expect("publishes");
    assert_eq!((kv.stale, kv.dp_ranks[0].stale), (false, true));
}

/// The router's `kv_events_dp_size` gives the ranks of an endpoint that does not say; an
/// endpoint's own value wins.
#[tokio::test(start_paused = true)]
async fn the_routers_dp_size_is_the_ranks_of_an_endpoint_that_does_not_say() {
    let ranks = silent_listeners(3).await;
    let events = format!("tcp://{}", ranks[0].local_addr().expect("bound"));
    let own = |dp_size| EndpointSpec {
        kv_events_dp_size: dp_size,
        ..spec("http://a", Some(events.clone()))
    };
    let cluster = Cluster::new(vec![own(None), own(Some(1))], OutlierConfig::default())
        .with_kv_events(SubscriberConfig {
            dp_size: 3,
            ..SubscriberConfig::default()
        });
    for id in 0..2 {
        cluster.subscribe_kv_events(id);
    }
    let status = cluster.status();
    let ranks_shown = |id: usize| {
        let kv = status[id].kv_events.as_ref().expect("publishes");
        std::iter::once(kv)
            .chain(&kv.dp_ranks)
            .map(|rank| rank.dp_rank)
            .collect::<Vec<_>>()
    };
    assert_eq!(ranks_shown(0), [Some(0), Some(1), Some(2)]);
    assert_eq!(ranks_shown(1), [None], "its own: one rank");
}

#[test]
fn kv_events_dp_size_is_checked() {
    let dp = |size, events: &str| EndpointSpec {
        kv_events_dp_size: Some(size),
        ..spec_with_events(events)
    };
    assert!(dp(4, "tcp://127.0.0.1:5557").check().is_ok());
    assert!(dp(1, "tcp://127.0.0.1:65535").check().is_ok());
    assert_eq!(
        dp(2, "tcp://127.0.0.1:65535").check(),
        Err("kv_events \"tcp://127.0.0.1:65535\": DP rank 1 would publish past port 65535".into())
    );
    assert!(dp(0, "tcp://127.0.0.1:5557").check().is_err());
    assert!(dp(257, "tcp://127.0.0.1:5557").check().is_err());
    let without_events = EndpointSpec {
        kv_events_dp_size: Some(2),
        ..spec("http://127.0.0.1:9", None)
    };
    assert_eq!(
        without_events.check(),
        Err("kv_events_dp_size needs kv_events (the event socket)".to_owned())
    );
}
