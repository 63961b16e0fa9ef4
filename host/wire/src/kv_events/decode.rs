//! Payload → [`EventBatch`], whichever engine, version and encoding wrote it.

use rmpv::ValueRef;

use super::{BlockHash, BlockRemoved, BlockStored, Event, EventBatch, Value};

/// A payload that is not a batch at all; nothing in it can be applied.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error("not msgpack: {0}")]
    Msgpack(#[from] rmpv::decode::Error),
    #[error("{0} bytes after the batch")]
    TrailingBytes(usize),
    #[error("the batch {0}")]
    Batch(&'static str),
}

/// Why one event of a batch was skipped.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EventError {
    #[error("not an event: neither an array tagged by name nor a map with a \"type\"")]
    NotAnEvent,
    #[error("unknown event type {0:?}")]
    UnknownType(String),
    #[error("{event}: missing field {field}")]
    Missing {
        event: &'static str,
        field: &'static str,
    },
    #[error("{event}: field {field} {reason}")]
    Invalid {
        event: &'static str,
        field: &'static str,
        reason: &'static str,
    },
}

/// An event [`decode_batch`] left out, and where it stood in its batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SkippedEvent {
    pub position: usize,
    pub reason: EventError,
}

/// A decoded batch and the events of it that could not be read.
#[derive(Debug, Clone, PartialEq)]
pub struct DecodedBatch {
    pub batch: EventBatch,
    pub skipped: Vec<SkippedEvent>,
}

/// Reads one published payload (see the module doc for every shape accepted).
pub fn decode_batch(payload: &[u8]) -> Result<DecodedBatch, DecodeError> {
    let mut rest = payload;
    let value = rmpv::decode::read_value_ref(&mut rest)?;
    if !rest.is_empty() {
        return Err(DecodeError::TrailingBytes(rest.len()));
    }
    let (ts, events, rank) = batch_parts(&value)?;
    let ts = as_f64(ts).ok_or(DecodeError::Batch("ts is not a number"))?;
    let ValueRef::Array(events) = events else {
        return Err(DecodeError::Batch("events is not an array"));
    };
    let data_parallel_rank = match rank {
        None | Some(ValueRef::Nil) => None,
        Some(ValueRef::Integer(n)) => n.as_i64(),
        Some(_) => return Err(DecodeError::Batch("data_parallel_rank is not an integer")),
    };
    let mut batch = EventBatch {
        ts,
        events: Vec::with_capacity(events.len()),
        data_parallel_rank,
    };
    let mut skipped = Vec::new();
    for (position, event) in events.iter().enumerate() {
        match decode_event(event) {
            Ok(event) => batch.events.push(event),
            Err(reason) => skipped.push(SkippedEvent { position, reason }),
        }
    }
    Ok(DecodedBatch { batch, skipped })
}

type BatchParts<'v, 'a> = (&'v ValueRef<'a>, &'v ValueRef<'a>, Option<&'v ValueRef<'a>>);

/// `[ts, events]`, `[ts, events, rank]` (every release checked), or the map one stored vLLM
/// commit would write.
fn batch_parts<'v, 'a>(value: &'v ValueRef<'a>) -> Result<BatchParts<'v, 'a>, DecodeError> {
    match value {
        ValueRef::Array(items) if items.len() >= 2 => Ok((&items[0], &items[1], items.get(2))),
        ValueRef::Array(_) => Err(DecodeError::Batch("array has fewer than 2 elements")),
        ValueRef::Map(pairs) => {
            let field = |name| named(pairs, name);
            let ts = field("ts").ok_or(DecodeError::Batch("map has no ts"))?;
            let events = field("events").ok_or(DecodeError::Batch("map has no events"))?;
            Ok((ts, events, field("data_parallel_rank")))
        }
        _ => Err(DecodeError::Batch("is neither an array nor a map")),
    }
}

fn decode_event(value: &ValueRef<'_>) -> Result<Event, EventError> {
    let (tag, fields) = match value {
        ValueRef::Array(items) => match items.split_first() {
            Some((ValueRef::String(tag), rest)) => (tag.as_str(), Fields::Positional(rest)),
            _ => return Err(EventError::NotAnEvent),
        },
        ValueRef::Map(pairs) => match named(pairs, "type") {
            Some(ValueRef::String(tag)) => (tag.as_str(), Fields::Named(pairs)),
            _ => return Err(EventError::NotAnEvent),
        },
        _ => return Err(EventError::NotAnEvent),
    };
    match tag {
        Some("BlockStored") => block_stored(&fields).map(Event::BlockStored),
        Some("BlockRemoved") => block_removed(&fields).map(Event::BlockRemoved),
        Some("AllBlocksCleared") => Ok(Event::AllBlocksCleared),
        Some(other) => Err(EventError::UnknownType(other.to_owned())),
        None => Err(EventError::NotAnEvent),
    }
}

/// An event's fields, by declaration position (array encoding, tag removed) or by name (map
/// encoding). Positions are the engines' declaration order, which only ever grew at the end.
enum Fields<'v, 'a> {
    Positional(&'v [ValueRef<'a>]),
    Named(&'v [(ValueRef<'a>, ValueRef<'a>)]),
}

impl<'v, 'a> Fields<'v, 'a> {
    /// The field, `None` when absent (an older layout, or an omitted default); a present nil
    /// is `Some(Nil)`.
    fn get(&self, field: Field) -> Option<&'v ValueRef<'a>> {
        match self {
            Fields::Positional(values) => values.get(field.position),
            Fields::Named(pairs) => named(pairs, field.name),
        }
    }
}

#[derive(Clone, Copy)]
struct Field {
    position: usize,
    name: &'static str,
}

const fn field(position: usize, name: &'static str) -> Field {
    Field { position, name }
}

mod stored {
    use super::{Field, field};
    pub const BLOCK_HASHES: Field = field(0, "block_hashes");
    pub const PARENT_BLOCK_HASH: Field = field(1, "parent_block_hash");
    pub const TOKEN_IDS: Field = field(2, "token_ids");
    pub const BLOCK_SIZE: Field = field(3, "block_size");
    pub const LORA_ID: Field = field(4, "lora_id");
    pub const MEDIUM: Field = field(5, "medium");
    pub const LORA_NAME: Field = field(6, "lora_name");
    pub const EXTRA_KEYS: Field = field(7, "extra_keys");
    pub const GROUP_IDX: Field = field(8, "group_idx");
    pub const KV_CACHE_SPEC_KIND: Field = field(9, "kv_cache_spec_kind");
    pub const KV_CACHE_SPEC_SLIDING_WINDOW: Field = field(10, "kv_cache_spec_sliding_window");
}

mod removed {
    use super::{Field, field};
    pub const BLOCK_HASHES: Field = field(0, "block_hashes");
    pub const MEDIUM: Field = field(1, "medium");
    pub const GROUP_IDX: Field = field(2, "group_idx");
}

const BLOCK_STORED: &str = "BlockStored";
const BLOCK_REMOVED: &str = "BlockRemoved";

fn block_stored(fields: &Fields<'_, '_>) -> Result<BlockStored, EventError> {
    let reader = Reader {
        event: BLOCK_STORED,
        fields,
    };
    let block_hashes = reader.hashes(stored::BLOCK_HASHES)?;
    // Required even when nil: a missing parent read as "starts the prompt" would place a
    // block at the root and match prompts it does not begin.
    let parent_block_hash =
        match reader.required(stored::PARENT_BLOCK_HASH)? {
            ValueRef::Nil => None,
            value => Some(block_hash(value).ok_or(
                reader.invalid(stored::PARENT_BLOCK_HASH, "is neither an integer nor bytes"),
            )?),
        };
    let token_ids = reader.tokens(stored::TOKEN_IDS)?;
    let block_size = reader.u32(stored::BLOCK_SIZE)?;
    if block_size == 0 {
        return Err(reader.invalid(stored::BLOCK_SIZE, "is 0"));
    }
    if token_ids.len() as u64 != u64::from(block_size) * block_hashes.len() as u64 {
        return Err(reader.invalid(stored::TOKEN_IDS, "is not block_size tokens per block hash"));
    }
    let extra_keys = reader.extra_keys(stored::EXTRA_KEYS)?;
    if extra_keys
        .as_ref()
        .is_some_and(|keys| keys.len() != block_hashes.len())
    {
        return Err(reader.invalid(stored::EXTRA_KEYS, "is not one entry per block"));
    }
    Ok(BlockStored {
        block_hashes,
        parent_block_hash,
        token_ids,
        block_size,
        lora_id: reader.optional_i64(stored::LORA_ID)?,
        medium: reader.optional_string(stored::MEDIUM)?,
        lora_name: reader.optional_string(stored::LORA_NAME)?,
        extra_keys,
        group_idx: reader.optional_u32(stored::GROUP_IDX)?,
        kv_cache_spec_kind: reader.optional_string(stored::KV_CACHE_SPEC_KIND)?,
        kv_cache_spec_sliding_window: reader.optional_u32(stored::KV_CACHE_SPEC_SLIDING_WINDOW)?,
    })
}

fn block_removed(fields: &Fields<'_, '_>) -> Result<BlockRemoved, EventError> {
    let reader = Reader {
        event: BLOCK_REMOVED,
        fields,
    };
    Ok(BlockRemoved {
        block_hashes: reader.hashes(removed::BLOCK_HASHES)?,
        medium: reader.optional_string(removed::MEDIUM)?,
        group_idx: reader.optional_u32(removed::GROUP_IDX)?,
    })
}

/// Typed reads of one event's fields, errors naming the event and field.
struct Reader<'f, 'v, 'a> {
    event: &'static str,
    fields: &'f Fields<'v, 'a>,
}

impl<'v, 'a> Reader<'_, 'v, 'a> {
    fn invalid(&self, field: Field, reason: &'static str) -> EventError {
        EventError::Invalid {
            event: self.event,
            field: field.name,
            reason,
        }
    }

    fn required(&self, field: Field) -> Result<&'v ValueRef<'a>, EventError> {
        self.fields.get(field).ok_or(EventError::Missing {
            event: self.event,
            field: field.name,
        })
    }

    /// The field unless it is absent or nil.
    fn optional(&self, field: Field) -> Option<&'v ValueRef<'a>> {
        self.fields
            .get(field)
            .filter(|value| !matches!(value, ValueRef::Nil))
    }

    fn array(&self, field: Field) -> Result<&'v [ValueRef<'a>], EventError> {
        match self.required(field)? {
            ValueRef::Array(items) => Ok(items),
            _ => Err(self.invalid(field, "is not an array")),
        }
    }

    fn hashes(&self, field: Field) -> Result<Vec<BlockHash>, EventError> {
        self.array(field)?
            .iter()
            .map(|value| {
                block_hash(value).ok_or(self.invalid(field, "holds neither integers nor bytes"))
            })
            .collect()
    }

    fn tokens(&self, field: Field) -> Result<Vec<u32>, EventError> {
        self.array(field)?
            .iter()
            .map(|value| as_u32(value).ok_or(self.invalid(field, "holds a non-token value")))
            .collect()
    }

    fn u32(&self, field: Field) -> Result<u32, EventError> {
        as_u32(self.required(field)?).ok_or(self.invalid(field, "is not a 32-bit unsigned int"))
    }

    fn optional_u32(&self, field: Field) -> Result<Option<u32>, EventError> {
        self.optional(field)
            .map(|value| as_u32(value).ok_or(self.invalid(field, "is not a 32-bit unsigned int")))
            .transpose()
    }

    fn optional_i64(&self, field: Field) -> Result<Option<i64>, EventError> {
        self.optional(field)
            .map(|value| match value {
                ValueRef::Integer(n) => n.as_i64().ok_or(self.invalid(field, "overflows i64")),
                _ => Err(self.invalid(field, "is not an integer")),
            })
            .transpose()
    }

    fn optional_string(&self, field: Field) -> Result<Option<String>, EventError> {
        self.optional(field)
            .map(|value| match value {
                ValueRef::String(s) => s
                    .as_str()
                    .map(str::to_owned)
                    .ok_or(self.invalid(field, "is not UTF-8")),
                _ => Err(self.invalid(field, "is not a string")),
            })
            .transpose()
    }

    fn extra_keys(&self, field: Field) -> Result<Option<Vec<Option<Vec<Value>>>>, EventError> {
        let Some(value) = self.optional(field) else {
            return Ok(None);
        };
        let ValueRef::Array(entries) = value else {
            return Err(self.invalid(field, "is not an array"));
        };
        entries
            .iter()
            .map(|entry| match entry {
                ValueRef::Nil => Ok(None),
                ValueRef::Array(keys) => Ok(Some(keys.iter().map(ValueRef::to_owned).collect())),
                _ => Err(self.invalid(field, "holds an entry that is neither nil nor an array")),
            })
            .collect::<Result<_, _>>()
            .map(Some)
    }
}

fn named<'v, 'a>(
    pairs: &'v [(ValueRef<'a>, ValueRef<'a>)],
    name: &str,
) -> Option<&'v ValueRef<'a>> {
    pairs.iter().find_map(|(key, value)| match key {
        ValueRef::String(key) if key.as_str() == Some(name) => Some(value),
        _ => None,
    })
}

fn block_hash(value: &ValueRef<'_>) -> Option<BlockHash> {
    match value {
        ValueRef::Integer(n) => n
            .as_u64()
            .or_else(|| n.as_i64().map(|signed| signed as u64))
            .map(BlockHash::Int),
        ValueRef::Binary(bytes) => Some(BlockHash::Bytes(bytes.to_vec())),
        _ => None,
    }
}

fn as_u32(value: &ValueRef<'_>) -> Option<u32> {
    match value {
        ValueRef::Integer(n) => n.as_u64().and_then(|n| u32::try_from(n).ok()),
        _ => None,
    }
}

fn as_f64(value: &ValueRef<'_>) -> Option<f64> {
    match value {
        ValueRef::F64(x) => Some(*x),
        ValueRef::F32(x) => Some(f64::from(*x)),
        ValueRef::Integer(n) => n.as_f64(),
        _ => None,
    }
}
