use super::frames::{
    END_SEQ, FrameError, PubMessage, ReplayReply, ReplyShape, end_frames, parse_replay_request,
    replay_request_frames, reply_frames,
};
use super::*;

/// Payloads msgspec wrote from the engines' declarations (fixtures/kv_events/generate.py).
macro_rules! fixture {
    ($name:literal) => {
        include_bytes!(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/fixtures/kv_events/",
            $name
        ))
        .as_slice()
    };
}

const A: u64 = 15760518052499183552;
const B: u64 = 9223372036854775809;
const C: u64 = 1234567890123456789;

fn decode_clean(payload: &[u8]) -> EventBatch {
    let decoded = decode_batch(payload).expect("decodes");
    assert_eq!(decoded.skipped, vec![], "nothing skipped");
    decoded.batch
}

fn stored(event: &Event) -> &BlockStored {
    match event {
        Event::BlockStored(stored) => stored,
        other => panic!("not a BlockStored: {other:?}"),
    }
}

fn removed(event: &Event) -> &BlockRemoved {
    match event {
        Event::BlockRemoved(removed) => removed,
        other => panic!("not a BlockRemoved: {other:?}"),
    }
}

fn to_bytes(value: &Value) -> Vec<u8> {
    let mut bytes = Vec::new();
    rmpv::encode::write_value(&mut bytes, value).expect("writes");
    bytes
}

#[test]
fn the_v0_26_capture_decodes_field_for_field_and_encodes_back_to_the_same_bytes() {
    let payload = fixture!("vllm-v0.26-map.msgpack");
    let batch = decode_clean(payload);
    assert_eq!(batch.ts, 1789095808.8378847);
    assert_eq!(batch.data_parallel_rank, Some(0));
    let expected = BlockStored {
        block_hashes: vec![BlockHash::Int(A)],
        parent_block_hash: None,
        token_ids: vec![
            151644, 872, 198, 9064, 374, 279, 6722, 315, 5616, 30, 151645, 198, 151644, 77091, 198,
            151667,
        ],
        block_size: 16,
        lora_id: None,
        medium: Some("GPU".into()),
        lora_name: None,
        extra_keys: Some(vec![None]),
        group_idx: Some(0),
        kv_cache_spec_kind: Some("full_attention".into()),
        kv_cache_spec_sliding_window: None,
    };
    assert_eq!(batch.events, vec![Event::BlockStored(expected)]);
    assert_eq!(encode_batch(&batch, Encoding::Map), payload);
}

#[test]
fn the_first_vllm_layout_is_a_two_element_batch_of_short_positional_events() {
    let batch = decode_clean(fixture!("vllm-v0-array.msgpack"));
    assert_eq!(batch.ts, 1745000000.25);
    assert_eq!(batch.data_parallel_rank, None);
    assert_eq!(batch.events.len(), 3);
    let first = stored(&batch.events[0]);
    assert_eq!(first.block_hashes, [BlockHash::Int(A), BlockHash::Int(B)]);
    assert_eq!(first.parent_block_hash, None);
    assert_eq!(first.token_ids, [1, 2, 3, 4, 5, 6, 7, 8]);
    assert_eq!((first.block_size, first.lora_id), (4, None));
    assert_eq!((&first.medium, &first.lora_name), (&None, &None));
    let child = stored(&batch.events[1]);
    assert_eq!(child.parent_block_hash, Some(BlockHash::Int(B)));
    assert_eq!(child.block_hashes, [BlockHash::Int(C)]);
    let evicted = removed(&batch.events[2]);
    assert_eq!(evicted.block_hashes, [BlockHash::Int(B)]);
    assert_eq!((&evicted.medium, evicted.group_idx), (&None, None));
}

#[test]
fn a_mixed_batch_keeps_both_encodings_and_skips_only_the_unknown_event() {
    let decoded = decode_batch(fixture!("vllm-mixed.msgpack")).expect("decodes");
    assert_eq!(
        decoded.skipped,
        vec![SkippedEvent {
            position: 4,
            reason: EventError::UnknownType("BlockPinned".into()),
        }]
    );
    let events = decoded.batch.events;
    assert_eq!(events.len(), 7);
    // A map event with a key this decoder does not know (`locality`).
    let gpu = stored(&events[0]);
    assert_eq!(gpu.medium.as_deref(), Some("GPU"));
    assert_eq!(gpu.kv_cache_spec_kind.as_deref(), Some("full_attention"));
    // A positional event beside it, every position written.
    let child = stored(&events[1]);
    assert_eq!(child.parent_block_hash, Some(BlockHash::Int(A)));
    assert_eq!(child.token_ids, [5, 6, 7, 8]);
    assert_eq!(stored(&events[2]).medium.as_deref(), Some("CPU"));
    let window = stored(&events[3]);
    assert_eq!(window.group_idx, Some(1));
    assert_eq!(window.kv_cache_spec_sliding_window, Some(4096));
    let lora = stored(&events[4]);
    assert_eq!(lora.lora_name.as_deref(), Some("adapter-a"));
    assert_eq!(
        lora.extra_keys,
        Some(vec![Some(vec![Value::from("adapter-a")])])
    );
    assert_eq!(removed(&events[5]).medium.as_deref(), Some("GPU"));
    assert_eq!(removed(&events[6]).medium.as_deref(), Some("CPU"));
}

#[test]
fn byte_hashes_decode_and_the_array_encoding_writes_msgspecs_bytes() {
    let payload = fixture!("vllm-bin-hashes.msgpack");
    let batch = decode_clean(payload);
    let first = stored(&batch.events[0]);
    assert_eq!(
        first.block_hashes,
        [
            BlockHash::Bytes((0..32).collect()),
            BlockHash::Bytes((32..64).collect())
        ]
    );
    assert_eq!(
        stored(&batch.events[1]).parent_block_hash,
        Some(BlockHash::Bytes((32..64).collect()))
    );
    assert_eq!(encode_batch(&batch, Encoding::Array), payload);
}

#[test]
fn a_map_batch_with_per_block_extra_keys_and_a_clear() {
    let batch = decode_clean(fixture!("vllm-map-batch.msgpack"));
    assert_eq!(batch.ts, 1789095902.0);
    assert_eq!(batch.data_parallel_rank, Some(2));
    assert_eq!(
        stored(&batch.events[0]).extra_keys,
        Some(vec![Some(vec![Value::from("salt-1")]), None])
    );
    assert_eq!(stored(&batch.events[1]).extra_keys, None);
    assert_eq!(batch.events[2], Event::AllBlocksCleared);
}

#[test]
fn sglang_pages_keep_signed_hashes_as_their_bits_and_a_short_last_page() {
    let batch = decode_clean(fixture!("sglang-pages.msgpack"));
    assert_eq!(batch.data_parallel_rank, Some(1));
    let first = stored(&batch.events[0]);
    assert_eq!(first.block_hashes, [BlockHash::Int(-4242_i64 as u64)]);
    let second = stored(&batch.events[1]);
    assert_eq!(
        second.parent_block_hash,
        Some(BlockHash::Int(-4242_i64 as u64))
    );
    assert_eq!(
        second.block_hashes,
        [BlockHash::Int(-9000000000_i64 as u64)]
    );
    let short = stored(&batch.events[2]);
    assert_eq!(
        (short.block_size, short.token_ids.as_slice()),
        (2, &[9, 10][..])
    );
    assert_eq!(batch.events[3], Event::AllBlocksCleared);
}

#[test]
fn every_field_survives_both_encodings() {
    let batch = EventBatch {
        ts: 12.25,
        events: vec![
            Event::BlockStored(BlockStored {
                block_hashes: vec![BlockHash::Int(u64::MAX - 1), BlockHash::Bytes(vec![9; 32])],
                parent_block_hash: Some(BlockHash::Int(3)),
                token_ids: vec![1, 200, 70000, u32::MAX, 5, 6],
                block_size: 3,
                lora_id: Some(-2),
                medium: Some("CPU_TIER1".into()),
                lora_name: Some("adapter".into()),
                extra_keys: Some(vec![
                    Some(vec![Value::from("adapter"), Value::Binary(vec![1, 2])]),
                    None,
                ]),
                group_idx: Some(1),
                kv_cache_spec_kind: Some("sliding_window".into()),
                kv_cache_spec_sliding_window: Some(128),
            }),
            Event::BlockRemoved(BlockRemoved {
                block_hashes: vec![BlockHash::Int(0)],
                medium: None,
                group_idx: Some(2),
            }),
            Event::AllBlocksCleared,
        ],
        data_parallel_rank: None,
    };
    for encoding in [Encoding::Map, Encoding::Array] {
        assert_eq!(decode_clean(&encode_batch(&batch, encoding)), batch);
    }
}

fn batch_of(events: Vec<Value>) -> Vec<u8> {
    to_bytes(&Value::Array(vec![
        Value::F64(1.0),
        Value::Array(events),
        Value::from(0),
    ]))
}

fn map_event(fields: &[(&str, Value)]) -> Value {
    Value::Map(
        fields
            .iter()
            .map(|(name, value)| (Value::from(*name), value.clone()))
            .collect(),
    )
}

fn stored_fields(tokens: Vec<Value>, block_size: u64) -> Vec<(&'static str, Value)> {
    vec![
        ("type", Value::from("BlockStored")),
        ("block_hashes", Value::Array(vec![Value::from(1)])),
        ("parent_block_hash", Value::Nil),
        ("token_ids", Value::Array(tokens)),
        ("block_size", Value::from(block_size)),
    ]
}

fn skip_reason(event: Value) -> EventError {
    let decoded = decode_batch(&batch_of(vec![event])).expect("the batch decodes");
    assert_eq!(decoded.batch.events, vec![]);
    assert_eq!(decoded.skipped.len(), 1);
    decoded.skipped[0].reason.clone()
}

fn tokens(n: u64) -> Vec<Value> {
    (0..n).map(Value::from).collect()
}

#[test]
fn length_guards_skip_the_event_and_name_the_field() {
    let invalid = |field, reason| EventError::Invalid {
        event: "BlockStored",
        field,
        reason,
    };
    assert_eq!(
        skip_reason(map_event(&stored_fields(tokens(3), 4))),
        invalid("token_ids", "is not block_size tokens per block hash")
    );
    assert_eq!(
        skip_reason(map_event(&stored_fields(vec![], 0))),
        invalid("block_size", "is 0")
    );
    assert_eq!(
        skip_reason(map_event(&stored_fields(
            vec![Value::from(u64::from(u32::MAX) + 1)],
            1
        ))),
        invalid("token_ids", "holds a non-token value")
    );
    let mut two_extra = stored_fields(tokens(4), 4);
    two_extra.push(("extra_keys", Value::Array(vec![Value::Nil, Value::Nil])));
    assert_eq!(
        skip_reason(map_event(&two_extra)),
        invalid("extra_keys", "is not one entry per block")
    );
    let mut no_parent = stored_fields(tokens(4), 4);
    no_parent.remove(2);
    assert_eq!(
        skip_reason(map_event(&no_parent)),
        EventError::Missing {
            event: "BlockStored",
            field: "parent_block_hash"
        }
    );
    // Positional, cut short before token_ids.
    assert_eq!(
        skip_reason(Value::Array(vec![
            Value::from("BlockStored"),
            Value::Array(vec![]),
            Value::Nil,
        ])),
        EventError::Missing {
            event: "BlockStored",
            field: "token_ids"
        }
    );
    assert_eq!(skip_reason(Value::from(3)), EventError::NotAnEvent);
    assert_eq!(
        skip_reason(map_event(&[("block_hashes", Value::Array(vec![]))])),
        EventError::NotAnEvent
    );
}

#[test]
fn a_payload_that_is_not_a_batch_is_refused_whole() {
    let refused = |payload: &[u8]| decode_batch(payload).expect_err("refused");
    assert!(matches!(refused(&[0x92, 0xcb]), DecodeError::Msgpack(_)));
    assert!(matches!(refused(&[]), DecodeError::Msgpack(_)));
    let mut trailing = batch_of(vec![]);
    trailing.push(0xc0);
    assert!(matches!(refused(&trailing), DecodeError::TrailingBytes(1)));
    let one = to_bytes(&Value::Array(vec![Value::F64(1.0)]));
    assert!(matches!(refused(&one), DecodeError::Batch(_)));
    let not_events = to_bytes(&Value::Array(vec![Value::F64(1.0), Value::from(2)]));
    assert!(matches!(refused(&not_events), DecodeError::Batch(_)));
    let no_ts = to_bytes(&map_event(&[("events", Value::Array(vec![]))]));
    assert!(matches!(refused(&no_ts), DecodeError::Batch(_)));
    assert!(matches!(
        refused(&to_bytes(&Value::Nil)),
        DecodeError::Batch(_)
    ));
}

#[test]
fn pub_messages_parse_and_lay_out_three_frames() {
    let message = PubMessage {
        topic: b"kv@10.0.0.1@m",
        seq: 258,
        payload: b"x",
    };
    let frames = message.frames();
    assert_eq!(frames[1], [0, 0, 0, 0, 0, 0, 1, 2]);
    assert_eq!(PubMessage::parse(&frames), Ok(message));
    assert_eq!(
        PubMessage::parse(&[&b""[..], &[1, 2][..], &b""[..]]),
        Err(FrameError::SeqLength(2))
    );
    assert!(matches!(
        PubMessage::parse(&[&b""[..]]),
        Err(FrameError::FrameCount { got: 1, .. })
    ));
}

#[test]
fn replay_requests_are_a_delimiter_and_a_start_and_nothing_else() {
    let frames = replay_request_frames(41);
    assert_eq!(frames, [vec![], vec![0, 0, 0, 0, 0, 0, 0, 41]]);
    assert_eq!(parse_replay_request(&frames), Ok(41));
    assert_eq!(
        parse_replay_request(&[&b"x"[..], &[0; 8][..]]),
        Err(FrameError::NoDelimiter)
    );
    // What a REQ would look like to the ROUTER without its delimiter, or a longer message.
    assert!(parse_replay_request(&[&[0; 8][..]]).is_err());
    assert!(parse_replay_request(&[&b""[..], &[0; 8][..], &b""[..]]).is_err());
}

#[test]
fn replay_replies_in_both_shapes_and_their_end_markers() {
    let legacy = reply_frames(ReplyShape::Legacy, b"ignored", 5, b"p");
    assert_eq!(legacy.len(), 3);
    assert_eq!(
        ReplayReply::parse(&legacy),
        Ok(ReplayReply::Batch {
            topic: None,
            seq: 5,
            payload: b"p"
        })
    );
    let with_topic = reply_frames(ReplyShape::WithTopic, b"kv", 6, b"q");
    assert_eq!(
        ReplayReply::parse(&with_topic),
        Ok(ReplayReply::Batch {
            topic: Some(b"kv"),
            seq: 6,
            payload: b"q"
        })
    );
    let legacy_end = end_frames(ReplyShape::Legacy);
    assert_eq!(legacy_end, [vec![], vec![0xff; 8], vec![]]);
    assert_eq!(ReplayReply::parse(&legacy_end), Ok(ReplayReply::End));
    let topic_end = end_frames(ReplyShape::WithTopic);
    assert_eq!(topic_end, [vec![], vec![], vec![0xff; 8], vec![]]);
    assert_eq!(ReplayReply::parse(&topic_end), Ok(ReplayReply::End));
    assert_eq!(END_SEQ.to_be_bytes(), [0xff; 8]);
    assert_eq!(
        ReplayReply::parse(&[&b"id"[..], &[0; 8][..], &b""[..]]),
        Err(FrameError::NoDelimiter)
    );
    assert!(matches!(
        ReplayReply::parse(&[&b""[..], &[0; 8][..]]),
        Err(FrameError::FrameCount { got: 2, .. })
    ));
}
