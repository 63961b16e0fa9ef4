//! SGLang's P/D handoff (`docs/src/engines/sglang.md`): the body both legs get.
//!
//! The router sends the same body to the prefill (P) and decode (D) engines at once: the
//! client's, plus P's bootstrap address and a room, which D uses to register with P's
//! bootstrap server and P to find D's destination before it pushes the KV.

use serde_json::{Map, Value, json};

/// Rooms are integers in `[0, 2^63 - 1]`: SGLang reads them as signed 64-bit.
pub const MAX_ROOM: u64 = i64::MAX as u64;

/// A room from 64 random bits: the top one cleared, as SMG's `generate_room_id` does.
pub fn room(random: u64) -> u64 {
    random & MAX_ROOM
}

/// Both legs' body: the client's, plus `bootstrap_host` (P's host, as D reaches it),
/// `bootstrap_port` (P's bootstrap server) and `bootstrap_room`, all scalars (one prompt per
/// pair: the router never sends batches or `n > 1`).
pub fn paired_body(
    client: &Map<String, Value>,
    host: &str,
    port: u16,
    room: u64,
) -> Map<String, Value> {
    let mut body = client.clone();
    body.insert("bootstrap_host".into(), json!(host));
    body.insert("bootstrap_port".into(), json!(port));
    body.insert("bootstrap_room".into(), json!(room));
    body
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_paired_body_is_the_specs_chat_example() {
        let Value::Object(client) = json!({"model":"m","messages":[{"role":"user",
            "content":"Hi"}],"max_tokens":64,"stream":true})
        else {
            unreachable!()
        };
        assert_eq!(
            Value::Object(paired_body(&client, "10.0.0.5", 8998, 5975098084415727586)),
            json!({"model":"m","messages":[{"role":"user","content":"Hi"}],"max_tokens":64,
                "stream":true,"bootstrap_host":"10.0.0.5","bootstrap_port":8998,
                "bootstrap_room":5975098084415727586_u64})
        );
    }

    #[test]
    fn rooms_fit_in_a_signed_64_bit_integer() {
        assert_eq!(room(u64::MAX), MAX_ROOM);
        assert_eq!(room(5), 5);
    }
}
