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
//! ```

use std::fmt;
use std::net::SocketAddr;
use std::str::FromStr;

const PREFIX: &str = "switchyard engine ready on http://";
/// Comes after the KV address when the engine runs a bootstrap server.
const BOOTSTRAP: &str = ", bootstrap ";

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
}

impl ReadyLine {
    /// `http://ADDR`.
    pub fn url(&self) -> String {
        format!("http://{}", self.http_addr)
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
            write!(f, "{BOOTSTRAP}{port}")?;
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
            // A KV address never ends in `, bootstrap <port>`: the tail is the optional field.
            let (kv_addr, bootstrap_port) = match rest.rsplit_once(BOOTSTRAP) {
                Some((kv, port))
                    if !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit()) =>
                {
                    (kv, Some(port.parse().ok()?))
                }
                _ => (rest, None),
            };
            Some(ReadyLine {
                http_addr: addr.parse().ok()?,
                device_rank: rank.parse().ok()?,
                kv_addr: kv_addr.to_owned(),
                bootstrap_port,
            })
        };
        parse().ok_or_else(|| ReadyLineError(line.to_owned()))
    }
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
}
