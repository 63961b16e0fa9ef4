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
//! assert_eq!(line.to_string().parse::<ReadyLine>(), Ok(line));
//! ```

use std::fmt;
use std::net::SocketAddr;
use std::str::FromStr;

const PREFIX: &str = "switchyard engine ready on http://";

/// What an engine's ready line says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadyLine {
    pub http_addr: SocketAddr,
    pub device_rank: u32,
    /// The engine's KV transfer address as `--kv-peer` takes it (`tcp:…`, `unix:@…`).
    pub kv_addr: String,
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
            "{PREFIX}{} (device rank {}, kv {})",
            self.http_addr, self.device_rank, self.kv_addr
        )
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
            let kv_addr = rest.strip_suffix(')')?;
            Some(ReadyLine {
                http_addr: addr.parse().ok()?,
                device_rank: rank.parse().ok()?,
                kv_addr: kv_addr.to_owned(),
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
        ] {
            assert!(line.parse::<ReadyLine>().is_err(), "{line}");
        }
    }
}
