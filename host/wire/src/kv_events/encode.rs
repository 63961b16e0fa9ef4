//! [`EventBatch`] → payload, byte for byte what msgspec writes for vLLM's newest declaration:
//! the batch positional `[ts, events, data_parallel_rank]`, floats as float64, integers in
//! their smallest form, the tag first.

use rmpv::Value;

use super::{BlockHash, BlockRemoved, BlockStored, Event, EventBatch};

/// How events are written; batches are positional either way (every release checked).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Encoding {
    /// `{"type": "BlockStored", field: value, ...}`, fields with an unset default omitted
    /// (vLLM ≥ 0.26, SGLang after PR #37482).
    #[default]
    Map,
    /// `["BlockStored", value, ...]` in declaration order, every position written (msgspec's
    /// `array_like` omits nothing); what vLLM < 0.26 and older SGLang send.
    Array,
}

/// The payload of one PUB message.
pub fn encode_batch(batch: &EventBatch, encoding: Encoding) -> Vec<u8> {
    let events = batch
        .events
        .iter()
        .map(|event| event_value(event, encoding))
        .collect();
    let value = Value::Array(vec![
        Value::F64(batch.ts),
        Value::Array(events),
        batch.data_parallel_rank.map_or(Value::Nil, Value::from),
    ]);
    let mut payload = Vec::new();
    rmpv::encode::write_value(&mut payload, &value).expect("writing to a Vec cannot fail");
    payload
}

fn event_value(event: &Event, encoding: Encoding) -> Value {
    let (tag, fields) = match event {
        Event::BlockStored(stored) => ("BlockStored", stored_fields(stored)),
        Event::BlockRemoved(removed) => ("BlockRemoved", removed_fields(removed)),
        Event::AllBlocksCleared => ("AllBlocksCleared", Vec::new()),
    };
    match encoding {
        Encoding::Map => Value::Map(
            std::iter::once(("type", Some(Value::from(tag))))
                .chain(fields)
                .filter_map(|(name, value)| value.map(|value| (Value::from(name), value)))
                .collect(),
        ),
        Encoding::Array => Value::Array(
            std::iter::once(Value::from(tag))
                .chain(
                    fields
                        .into_iter()
                        .map(|(_, value)| value.unwrap_or(Value::Nil)),
                )
                .collect(),
        ),
    }
}

/// A field's value; `None`: unset with a default, which the map encoding omits.
type FieldValue = (&'static str, Option<Value>);

/// Declared without a default: written even when nil.
fn always(value: Option<Value>) -> Option<Value> {
    Some(value.unwrap_or(Value::Nil))
}

fn stored_fields(stored: &BlockStored) -> Vec<FieldValue> {
    vec![
        ("block_hashes", Some(hashes_value(&stored.block_hashes))),
        (
            "parent_block_hash",
            always(stored.parent_block_hash.as_ref().map(hash_value)),
        ),
        (
            "token_ids",
            Some(Value::Array(
                stored.token_ids.iter().copied().map(Value::from).collect(),
            )),
        ),
        ("block_size", Some(Value::from(stored.block_size))),
        ("lora_id", always(stored.lora_id.map(Value::from))),
        ("medium", always(stored.medium.as_deref().map(Value::from))),
        (
            "lora_name",
            always(stored.lora_name.as_deref().map(Value::from)),
        ),
        (
            "extra_keys",
            stored.extra_keys.as_ref().map(|entries| {
                Value::Array(
                    entries
                        .iter()
                        .map(|entry| entry.clone().map_or(Value::Nil, Value::Array))
                        .collect(),
                )
            }),
        ),
        ("group_idx", stored.group_idx.map(Value::from)),
        (
            "kv_cache_spec_kind",
            stored.kv_cache_spec_kind.as_deref().map(Value::from),
        ),
        (
            "kv_cache_spec_sliding_window",
            stored.kv_cache_spec_sliding_window.map(Value::from),
        ),
    ]
}

fn removed_fields(removed: &BlockRemoved) -> Vec<FieldValue> {
    vec![
        ("block_hashes", Some(hashes_value(&removed.block_hashes))),
        ("medium", always(removed.medium.as_deref().map(Value::from))),
        ("group_idx", removed.group_idx.map(Value::from)),
    ]
}

fn hashes_value(hashes: &[BlockHash]) -> Value {
    Value::Array(hashes.iter().map(hash_value).collect())
}

fn hash_value(hash: &BlockHash) -> Value {
    match hash {
        BlockHash::Int(bits) => Value::from(*bits),
        BlockHash::Bytes(bytes) => Value::Binary(bytes.clone()),
    }
}
