//! `kv_append_metadata` / `kv_addr_info`: where in D's pool the transferred KV goes.
//!
//! Encoding (spec/microserving.md): `base64(u64_le(len(J)) ++ J)`, standard alphabet with
//! padding, `J` a compact JSON array of ints, per model `[n, begin_1, len_1, …, begin_n, len_n]`,
//! the models' arrays concatenated.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;

use super::KvError;

/// A run of consecutive slot ids in a paged pool (slot = page_id * page_size + offset).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SlotRun {
    pub begin: u32,
    pub len: u32,
}

impl SlotRun {
    /// The slot ids of the run, in order.
    pub fn slots(&self) -> std::ops::Range<u32> {
        self.begin..self.begin.saturating_add(self.len)
    }
}

/// Per model, the slot runs covering prompt positions `[prefix_matched, end)` in order (MLC's
/// `kv_addr_info`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KvAddrInfo {
    pub models: Vec<Vec<SlotRun>>,
}

/// Longest base64 blob we decode: 8-byte prefix + 64 MiB of JSON is far above any real pool.
const MAX_ENCODED_LEN: usize = 96 << 20;

impl KvAddrInfo {
    /// One model whose runs cover `slots` in order, adjacent slots merged into one run.
    pub fn from_slots(slots: impl IntoIterator<Item = u32>) -> Self {
        KvAddrInfo {
            models: vec![super::runs::merge_slots(slots)],
        }
    }

    /// MLC's `kv_append_metadata` encoding.
    pub fn encode(&self) -> String {
        let json = self.to_compact_json();
        let mut framed = Vec::with_capacity(8 + json.len());
        framed.extend_from_slice(&(json.len() as u64).to_le_bytes());
        framed.extend_from_slice(json.as_bytes());
        STANDARD.encode(framed)
    }

    /// `J`: `[n, begin_1, len_1, …]` per model, concatenated, no spaces (as Python's
    /// `json.dumps(..., separators=(",", ":"))` writes it).
    fn to_compact_json(&self) -> String {
        use std::fmt::Write as _;
        let mut ints = Vec::new();
        for runs in &self.models {
            ints.push(runs.len() as u64);
            ints.extend(
                runs.iter()
                    .flat_map(|r| [u64::from(r.begin), u64::from(r.len)]),
            );
        }
        let mut json = String::from("[");
        for (i, n) in ints.iter().enumerate() {
            let sep = if i == 0 { "" } else { "," };
            let _ = write!(json, "{sep}{n}"); // writing to a String cannot fail
        }
        json.push(']');
        json
    }

    /// Parses MLC's encoding; every malformed blob is an error that says what is wrong.
    pub fn decode(s: &str) -> Result<Self, KvError> {
        Self::decode_bounded(s, usize::MAX)
    }

    /// [`KvAddrInfo::decode`] for a window known to hold at most `max_slots` slots: runs are
    /// non-empty, so a valid blob has at most `2 * max_slots + 1` integers, and a longer one is
    /// refused before it is read whole.
    pub fn decode_within(s: &str, max_slots: usize) -> Result<Self, KvError> {
        Self::decode_bounded(s, max_slots.saturating_mul(2).saturating_add(1))
    }

    fn decode_bounded(s: &str, max_ints: usize) -> Result<Self, KvError> {
        if s.len() > MAX_ENCODED_LEN {
            return Err(bad(format!("{} bytes is too long", s.len())));
        }
        let framed = STANDARD
            .decode(s)
            .map_err(|e| bad(format!("bad base64: {e}")))?;
        let json = strip_length_prefix(&framed)?;
        let ints = parse_int_array(json, max_ints)?;
        let models = split_models(&ints)?;
        Ok(KvAddrInfo { models })
    }

    /// Model 0's slots in order (the pool holds one model).
    pub fn slots(&self) -> impl Iterator<Item = u32> + '_ {
        self.models
            .first()
            .into_iter()
            .flatten()
            .flat_map(SlotRun::slots)
    }

    /// How many slots model 0's runs cover: the number of prompt positions they receive.
    pub fn total_len(&self) -> u32 {
        let total: u64 = self
            .models
            .first()
            .into_iter()
            .flatten()
            .map(|r| u64::from(r.len))
            .sum();
        u32::try_from(total).unwrap_or(u32::MAX)
    }
}

fn bad(reason: impl Into<String>) -> KvError {
    KvError::Metadata {
        reason: reason.into(),
    }
}

/// Checks the u64 little-endian length prefix against what follows it.
fn strip_length_prefix(framed: &[u8]) -> Result<&[u8], KvError> {
    let (prefix, json) = framed.split_first_chunk::<8>().ok_or_else(|| {
        bad(format!(
            "{} bytes is shorter than the 8-byte length prefix",
            framed.len()
        ))
    })?;
    let declared = u64::from_le_bytes(*prefix);
    if declared != json.len() as u64 {
        return Err(bad(format!(
            "length prefix says {declared} bytes of JSON but {} follow",
            json.len()
        )));
    }
    Ok(json)
}

/// Parses a JSON array of at most `max` non-negative integers that fit in u32, converting each
/// element as it is read (4 bytes kept per element, not a `serde_json::Value` each).
fn parse_int_array(json: &[u8], max: usize) -> Result<Vec<u32>, KvError> {
    use serde::de::DeserializeSeed as _;
    let mut de = serde_json::Deserializer::from_slice(json);
    let ints = IntArray { max }
        .deserialize(&mut de)
        .and_then(|ints| de.end().map(|()| ints))
        .map_err(|e| match e.classify() {
            // Our own messages, and serde's "expected a JSON array of integers".
            serde_json::error::Category::Data => bad(e.to_string()),
            _ => bad(format!("not a JSON array of integers: {e}")),
        })?;
    Ok(ints)
}

/// Deserializes `[int, …]` straight into `Vec<u32>`, refusing more than `max` elements.
struct IntArray {
    max: usize,
}

impl<'de> serde::de::DeserializeSeed<'de> for IntArray {
    type Value = Vec<u32>;

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Vec<u32>, D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> serde::de::Visitor<'de> for IntArray {
    type Value = Vec<u32>;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON array of integers")
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<u32>, A::Error> {
        use serde::de::Error as _;
        let mut ints = Vec::new();
        // One element at a time: a transient `Value` gives every bad element a precise message.
        while let Some(value) = seq.next_element::<serde_json::Value>()? {
            if ints.len() == self.max {
                return Err(A::Error::custom(format!(
                    "more than {} integers, more than the window can hold",
                    self.max
                )));
            }
            ints.push(element_u32(ints.len(), &value).map_err(A::Error::custom)?);
        }
        Ok(ints)
    }
}

fn element_u32(i: usize, value: &serde_json::Value) -> Result<u32, String> {
    match value {
        serde_json::Value::Number(n) => match (n.as_u64(), n.as_i64()) {
            (Some(u), _) => {
                u32::try_from(u).map_err(|_| format!("element {i} ({u}) does not fit in 32 bits"))
            }
            (None, Some(neg)) => Err(format!("element {i} is negative ({neg})")),
            (None, None) => Err(format!("element {i} ({n}) is not an integer")),
        },
        other => Err(format!("element {i} is not an integer: {other}")),
    }
}

/// Splits `[n, b1, l1, …, n', …]` into per-model runs, checking each count and run.
fn split_models(ints: &[u32]) -> Result<Vec<Vec<SlotRun>>, KvError> {
    if ints.is_empty() {
        return Err(bad("empty array: expected at least one model's run count"));
    }
    let mut models = Vec::new();
    let mut rest = ints;
    while let Some((&n, tail)) = rest.split_first() {
        let model = models.len();
        let needed = n as usize * 2;
        if tail.len() < needed {
            return Err(bad(format!(
                "model {model} declares {n} runs but only {} integers follow",
                tail.len()
            )));
        }
        let (pairs, next) = tail.split_at(needed);
        let runs = pairs
            .chunks_exact(2)
            .enumerate()
            .map(|(i, pair)| checked_run(model, i, pair[0], pair[1]))
            .collect::<Result<Vec<_>, _>>()?;
        check_total_fits(model, &runs)?;
        models.push(runs);
        rest = next;
    }
    Ok(models)
}

fn checked_run(model: usize, i: usize, begin: u32, len: u32) -> Result<SlotRun, KvError> {
    if len == 0 {
        return Err(bad(format!(
            "model {model} run {i} at slot {begin} has length 0"
        )));
    }
    if begin.checked_add(len).is_none() {
        return Err(bad(format!(
            "model {model} run {i}: slot {begin} + length {len} overflows 32 bits"
        )));
    }
    Ok(SlotRun { begin, len })
}

fn check_total_fits(model: usize, runs: &[SlotRun]) -> Result<(), KvError> {
    let total: u64 = runs.iter().map(|r| u64::from(r.len)).sum();
    if total > u64::from(u32::MAX) {
        return Err(bad(format!(
            "model {model}'s runs cover {total} slots, more than 32 bits"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn raw(json: &str) -> String {
        let mut framed = (json.len() as u64).to_le_bytes().to_vec();
        framed.extend_from_slice(json.as_bytes());
        STANDARD.encode(framed)
    }

    fn reason(blob: &str) -> String {
        match KvAddrInfo::decode(blob) {
            Err(KvError::Metadata { reason }) => reason,
            other => panic!("expected a metadata error for {blob:?}, got {other:?}"),
        }
    }

    #[test]
    fn spec_examples_round_trip() {
        let empty = KvAddrInfo {
            models: vec![vec![]],
        };
        assert_eq!(empty.encode(), "AwAAAAAAAABbMF0=");
        assert_eq!(KvAddrInfo::decode("AwAAAAAAAABbMF0=").unwrap(), empty);

        let one = KvAddrInfo {
            models: vec![vec![SlotRun {
                begin: 4096,
                len: 63,
            }]],
        };
        assert_eq!(one.encode(), "CwAAAAAAAABbMSw0MDk2LDYzXQ==");
        assert_eq!(
            KvAddrInfo::decode("CwAAAAAAAABbMSw0MDk2LDYzXQ==").unwrap(),
            one
        );
        assert_eq!(one.total_len(), 63);
        assert_eq!(
            one.slots().collect::<Vec<_>>(),
            (4096..4159).collect::<Vec<_>>()
        );
    }

    #[test]
    fn several_models_concatenate() {
        let info = KvAddrInfo {
            models: vec![
                vec![SlotRun { begin: 0, len: 2 }, SlotRun { begin: 10, len: 1 }],
                vec![SlotRun { begin: 5, len: 3 }],
            ],
        };
        assert_eq!(info.encode(), raw("[2,0,2,10,1,1,5,3]"));
        assert_eq!(KvAddrInfo::decode(&info.encode()).unwrap(), info);
        assert_eq!(info.slots().collect::<Vec<_>>(), vec![0, 1, 10]);
        assert_eq!(info.total_len(), 3);
    }

    #[test]
    fn from_slots_merges_adjacent() {
        let info = KvAddrInfo::from_slots([4, 5, 6, 9, 10, 2]);
        assert_eq!(
            info.models,
            vec![vec![
                SlotRun { begin: 4, len: 3 },
                SlotRun { begin: 9, len: 2 },
                SlotRun { begin: 2, len: 1 }
            ]]
        );
    }

    #[test]
    fn accepts_whitespace_in_json() {
        let info = KvAddrInfo::decode(&raw("[1, 7, 2]")).unwrap();
        assert_eq!(info.models, vec![vec![SlotRun { begin: 7, len: 2 }]]);
    }

    #[test]
    fn rejects_bad_base64() {
        assert!(reason("not base64!").contains("base64"));
        assert!(
            reason("AwAAAAAAAABbMF0").contains("base64"),
            "missing padding"
        );
    }

    #[test]
    fn rejects_length_prefix_mismatch() {
        let mut framed = 4u64.to_le_bytes().to_vec();
        framed.extend_from_slice(b"[0]");
        assert!(reason(&STANDARD.encode(framed)).contains("length prefix"));
        assert!(reason(&STANDARD.encode([1u8, 2, 3])).contains("shorter"));
        assert!(reason("").contains("shorter"));
    }

    #[test]
    fn rejects_non_json_and_non_integers() {
        assert!(reason(&raw("[1,2")).contains("JSON"));
        assert!(reason(&raw("{\"a\":1}")).contains("JSON"));
        assert!(reason(&raw("[1,\"4\",2]")).contains("not an integer"));
        assert!(reason(&raw("[1,4.5,2]")).contains("not an integer"));
    }

    #[test]
    fn rejects_negative_numbers() {
        assert!(reason(&raw("[1,-4,2]")).contains("negative"));
        assert!(reason(&raw("[-1]")).contains("negative"));
    }

    #[test]
    fn rejects_count_not_matching_array() {
        assert!(reason(&raw("[2,4,1]")).contains("declares 2 runs"));
        assert!(reason(&raw("[1,4]")).contains("declares 1 runs"));
        assert!(reason(&raw("[]")).contains("empty"));
    }

    #[test]
    fn a_window_bounds_the_integers_read() {
        let two_runs = raw("[2,4,1,9,1]");
        assert_eq!(
            KvAddrInfo::decode_within(&two_runs, 2).unwrap().total_len(),
            2
        );
        assert!(
            matches!(KvAddrInfo::decode_within(&two_runs, 1), Err(KvError::Metadata { reason }) if reason.contains("more than 3 integers")),
        );
    }

    #[test]
    fn rejects_zero_length_runs() {
        assert!(reason(&raw("[1,4,0]")).contains("length 0"));
    }

    #[test]
    fn rejects_overflow() {
        assert!(reason(&raw("[1,4294967296,1]")).contains("32 bits"));
        assert!(reason(&raw("[1,4294967295,1]")).contains("overflows"));
        assert!(reason(&raw("[1,99999999999999999999999,1]")).contains("element 1"));
        assert!(reason(&raw("[2,0,4294967295,1,4294967294]")).contains("more than 32 bits"));
    }

    fn arb_info() -> impl Strategy<Value = KvAddrInfo> {
        let run = (0u32..1 << 31, 1u32..1 << 20).prop_map(|(begin, len)| SlotRun { begin, len });
        prop::collection::vec(prop::collection::vec(run, 0..8), 1..4)
            .prop_map(|models| KvAddrInfo { models })
    }

    proptest! {
        #[test]
        fn encode_decode_round_trips(info in arb_info()) {
            prop_assert_eq!(KvAddrInfo::decode(&info.encode()).unwrap(), info);
        }

        #[test]
        fn decode_never_panics(s in "[A-Za-z0-9+/=]{0,64}") {
            let _ = KvAddrInfo::decode(&s);
        }
    }
}
