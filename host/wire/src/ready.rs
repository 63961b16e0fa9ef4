//! The line `switchyard engine` prints on stdout once it accepts requests, which whoever
//! started it (`switchyard up`, the test harness) reads to learn its addresses: one format,
//! written by [`Display`](std::fmt::Display) and read by [`FromStr`](std::str::FromStr).
//!
//! ```
//! use switchyard_wire::ReadyLine;
//!
//! let line: ReadyLine = "switchyard engine ready on http://127.0.0.1:4321 (device rank 2, kv tcp:127.0.0.1:9)"
//!     .parse()
//!     .expect("a ready line");
//! assert_eq!(line.url(), "http://127.0.0.1:4321");
//! assert_eq!(line.device_rank, 2);
//! assert_eq!(line.bootstrap_port, None);
//! assert_eq!(line.to_string().parse::<ReadyLine>(), Ok(line));
//!
//! // An SGLang-mode prefill engine also says where its bootstrap server listens.
//! let prefill: ReadyLine = "switchyard engine ready on http://127.0.0.1:4321 (device rank 0, kv tcp:127.0.0.1:9, bootstrap 8998)"
//!     .parse()
//!     .expect("a ready line");
//! assert_eq!(prefill.bootstrap_port, Some(8998));
//! assert_eq!(prefill.kv_addr, "tcp:127.0.0.1:9");
//!
//! // An engine publishing its prefix cache's KV events says where (`--kv-events`,
//! // `--kv-events-replay`), with the ports it bound.
//! let publishing: ReadyLine = "switchyard engine ready on http://127.0.0.1:4321 (device rank 0, kv tcp:127.0.0.1:9, kv-events tcp://127.0.0.1:5557, kv-events-replay tcp://127.0.0.1:5558)"
//!     .parse()
//!     .expect("a ready line");
//! assert_eq!(publishing.kv_events_url().as_deref(), Some("tcp://127.0.0.1:5557"));
//! assert_eq!(publishing.kv_events_replay_url().as_deref(), Some("tcp://127.0.0.1:5558"));
//! ```
//!
//! Every field after the KV address is optional, written only when the engine has it, so a line
//! without them reads as before; a reader skips fields it does not know.

use std::fmt;
use std::net::SocketAddr;
use std::str::FromStr;

const PREFIX: &str = "switchyard engine ready on http://";
/// Separates the fields in the parentheses; no KV address contains it.
const SEPARATOR: &str = ", ";
/// The optional fields' names, each followed by a space and its value.
const BOOTSTRAP: &str = "bootstrap";
const KV_EVENTS: &str = "kv-events";
const KV_EVENTS_REPLAY: &str = "kv-events-replay";
/// How the KV event sockets' addresses are written (as `--kv-events` and a router's
/// `kv_events` take them).
const TCP: &str = "tcp://";

/// What an engine's ready line says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadyLine {
    pub http_addr: SocketAddr,
    pub device_rank: u32,
    /// The engine's KV transfer address as `--kv-peer` takes it (`tcp:…`, `unix:@…`).
    pub kv_addr: String,
    /// The bound port of the engine's SGLang bootstrap server (`--protocol sglang
    /// --disaggregation-mode prefill`), which a router puts in every leg's `bootstrap_port`;
    /// `None` for every other engine, whose line ends after the KV address as before.
    pub bootstrap_port: Option<u16>,
    /// Where the engine's KV event PUB socket is bound (`--kv-events`), if it publishes.
    pub kv_events: Option<SocketAddr>,
    /// Where its replay socket is bound (`--kv-events-replay`), if it has one.
    pub kv_events_replay: Option<SocketAddr>,
}

impl ReadyLine {
    /// `http://ADDR`.
    pub fn url(&self) -> String {
        format!("http://{}", self.http_addr)
    }

    /// `tcp://ADDR` of the KV event socket, as a router endpoint's `kv_events` takes it.
    pub fn kv_events_url(&self) -> Option<String> {
        self.kv_events.map(|addr| format!("{TCP}{addr}"))
    }

    /// `tcp://ADDR` of the replay socket, as `kv_events_replay` takes it.
    pub fn kv_events_replay_url(&self) -> Option<String> {
        self.kv_events_replay.map(|addr| format!("{TCP}{addr}"))
    }
}

impl fmt::Display for ReadyLine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{PREFIX}{} (device rank {}, kv {}",
            self.http_addr, self.device_rank, self.kv_addr
        )?;
        if let Some(port) = self.bootstrap_port {
            write!(f, "{SEPARATOR}{BOOTSTRAP} {port}")?;
        }
        if let Some(addr) = self.kv_events {
            write!(f, "{SEPARATOR}{KV_EVENTS} {TCP}{addr}")?;
        }
        if let Some(addr) = self.kv_events_replay {
            write!(f, "{SEPARATOR}{KV_EVENTS_REPLAY} {TCP}{addr}")?;
        }
        f.write_str(")")
    }
}

/// A line that is not an engine's ready line.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not a switchyard engine ready line: {0:?}")]
pub struct ReadyLineError(pub String);

impl FromStr for ReadyLine {
    type Err = ReadyLineError;

    fn from_str(line: &str) -> Result<Self, Self::Err> {
        let parse = || {
            let rest = line.strip_prefix(PREFIX)?;
            let (addr, rest) = rest.split_once(" (device rank ")?;
            let (rank, rest) = rest.split_once(", kv ")?;
            let rest = rest.strip_suffix(')')?;
            let mut fields = rest.split(SEPARATOR);
            let kv_addr = fields.next()?;
            let mut line = ReadyLine {
                http_addr: addr.parse().ok()?,
                device_rank: rank.parse().ok()?,
                kv_addr: kv_addr.to_owned(),
                bootstrap_port: None,
                kv_events: None,
                kv_events_replay: None,
            };
            for field in fields {
                match field.split_once(' ') {
                    Some((BOOTSTRAP, port)) => line.bootstrap_port = Some(port.parse().ok()?),
                    Some((KV_EVENTS, addr)) => line.kv_events = Some(tcp_addr(addr)?),
                    Some((KV_EVENTS_REPLAY, addr)) => line.kv_events_replay = Some(tcp_addr(addr)?),
                    // A newer engine's field: skipped, so its line still reads.
                    _ => {}
                }
            }
            Some(line)
        };
        parse().ok_or_else(|| ReadyLineError(line.to_owned()))
    }
}

/// `tcp://ADDR`, as the line writes a KV event socket.
fn tcp_addr(field: &str) -> Option<SocketAddr> {
    field.strip_prefix(TCP)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn other_lines_are_not_ready_lines() {
        for line in [
            "loading",
            "switchyard engine ready on http://127.0.0.1:1",
            "switchyard engine ready on http://nohost (device rank 0, kv tcp:1)",
            "switchyard engine ready on http://127.0.0.1:1 (device rank x, kv tcp:1)",
            "switchyard engine ready on http://127.0.0.1:1 (device rank 0, kv tcp:1, bootstrap 70000)",
            "switchyard engine ready on http://127.0.0.1:1 (device rank 0, kv tcp:1, kv-events 127.0.0.1:2)",
            "switchyard engine ready on http://127.0.0.1:1 (device rank 0, kv tcp:1, kv-events-replay tcp://x)",
        ] {
            assert!(line.parse::<ReadyLine>().is_err(), "{line}");
        }
    }

    #[test]
    fn the_bootstrap_port_is_optional_both_ways() {
        for port in [None, Some(0), Some(8998)] {
            let line = ReadyLine {
                http_addr: "127.0.0.1:4321".parse().unwrap(),
                device_rank: 3,
                kv_addr: "unix:@kv-3".into(),
                bootstrap_port: port,
                kv_events: None,
                kv_events_replay: None,
            };
            assert_eq!(line.to_string().parse::<ReadyLine>(), Ok(line));
        }
        let old =
            "switchyard engine ready on http://127.0.0.1:1 (device rank 0, kv tcp:127.0.0.1:2)";
        let parsed: ReadyLine = old
            .parse()
            .expect("the line without the field still parses");
        assert_eq!(parsed.bootstrap_port, None);
        assert_eq!(parsed.to_string(), old);
    }

    #[test]
    fn the_kv_event_sockets_are_optional_and_unknown_fields_are_skipped() {
        let events = Some("127.0.0.1:5557".parse().unwrap());
        let replay = Some("127.0.0.1:5558".parse().unwrap());
        for (kv_events, kv_events_replay, bootstrap_port) in [
            (events, None, None),
            (events, replay, None),
            (events, replay, Some(8998)),
        ] {
            let line = ReadyLine {
                http_addr: "127.0.0.1:4321".parse().unwrap(),
                device_rank: 1,
                kv_addr: "tcp:127.0.0.1:9".into(),
                bootstrap_port,
                kv_events,
                kv_events_replay,
            };
            assert_eq!(line.to_string().parse::<ReadyLine>(), Ok(line));
        }
        let newer = "switchyard engine ready on http://127.0.0.1:1 (device rank 0, kv tcp:127.0.0.1:2, \
                     kv-events tcp://127.0.0.1:3, gpu-direct yes)";
        let parsed: ReadyLine = newer.parse().expect("an unknown field is skipped");
        assert_eq!(parsed.kv_events_url().as_deref(), Some("tcp://127.0.0.1:3"));
        assert_eq!(parsed.kv_events_replay, None);
    }
}
