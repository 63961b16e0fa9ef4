//! Where a KV peer listens, and which transport reaches it.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::str::FromStr;

use super::KvError;

/// Which transport moves the bytes (`--kv-transport shm|tcp|cuda`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, clap::ValueEnum)]
pub enum TransportKind {
    /// Same host: map the peer's pool and copy (fd passed over a Unix socket).
    Shm,
    /// Any host: stream the bytes over TCP.
    Tcp,
    /// Same node, GPU pools: device copies into the peer's pool opened with CUDA IPC (the
    /// handle is passed over a Unix socket, like shm's memfd).
    Cuda,
}

impl TransportKind {
    /// Whether this transport listens on and dials `addr` (cuda handshakes over Unix sockets).
    pub fn accepts(self, addr: &PeerAddr) -> bool {
        let wanted = match self {
            TransportKind::Cuda => TransportKind::Shm,
            kind => kind,
        };
        addr.kind() == wanted
    }
}

impl std::fmt::Display for TransportKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TransportKind::Shm => "shm",
            TransportKind::Tcp => "tcp",
            TransportKind::Cuda => "cuda",
        })
    }
}

/// A KV peer's transfer address: `unix:/path/to/sock`, `unix:@abstract-name` (Linux abstract
/// namespace) or `tcp:IP:PORT` (an IP literal; port 0 when listening picks a free one).
#[derive(Debug, Clone, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum PeerAddr {
    Unix(PathBuf),
    UnixAbstract(String),
    Tcp(SocketAddr),
}

impl PeerAddr {
    /// The transport this address is for (a Unix socket says shm; cuda uses them too, see
    /// [`TransportKind::accepts`]).
    pub fn kind(&self) -> TransportKind {
        match self {
            PeerAddr::Unix(_) | PeerAddr::UnixAbstract(_) => TransportKind::Shm,
            PeerAddr::Tcp(_) => TransportKind::Tcp,
        }
    }

    /// A listen address that needs no configuration: a loopback port picked by the kernel for
    /// tcp, a process-unique abstract socket name for shm.
    pub fn ephemeral(kind: TransportKind) -> PeerAddr {
        match kind {
            TransportKind::Tcp => PeerAddr::Tcp(SocketAddr::from(([127, 0, 0, 1], 0))),
            TransportKind::Shm | TransportKind::Cuda => {
                static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
                let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let nonce: u32 = rand::random();
                PeerAddr::UnixAbstract(format!(
                    "switchyard-kv-{}-{n}-{nonce:08x}",
                    std::process::id()
                ))
            }
        }
    }
}

impl std::fmt::Display for PeerAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PeerAddr::Unix(path) => write!(f, "unix:{}", path.display()),
            PeerAddr::UnixAbstract(name) => write!(f, "unix:@{name}"),
            PeerAddr::Tcp(addr) => write!(f, "tcp:{addr}"),
        }
    }
}

impl FromStr for PeerAddr {
    type Err = KvError;

    fn from_str(s: &str) -> Result<Self, KvError> {
        let bad = |reason: &str| KvError::BadPeerAddr {
            addr: s.to_owned(),
            reason: reason.to_owned(),
        };
        if let Some(rest) = s.strip_prefix("unix:") {
            return match rest.strip_prefix('@') {
                Some("") => Err(bad("empty abstract socket name")),
                Some(name) if name.len() > 100 => Err(bad("abstract socket name over 100 bytes")),
                Some(name) => Ok(PeerAddr::UnixAbstract(name.to_owned())),
                None if rest.is_empty() => Err(bad("empty socket path")),
                None if rest.len() > 100 => Err(bad("socket path over 100 bytes")),
                None => Ok(PeerAddr::Unix(PathBuf::from(rest))),
            };
        }
        if let Some(rest) = s.strip_prefix("tcp:") {
            return rest
                .parse()
                .map(PeerAddr::Tcp)
                .map_err(|_| bad("expected tcp:IP:PORT, e.g. tcp:127.0.0.1:7001"));
        }
        Err(bad("expected unix:/path, unix:@name or tcp:IP:PORT"))
    }
}

impl TryFrom<String> for PeerAddr {
    type Error = KvError;

    fn try_from(s: String) -> Result<Self, KvError> {
        s.parse()
    }
}

impl From<PeerAddr> for String {
    fn from(addr: PeerAddr) -> String {
        addr.to_string()
    }
}

/// Parses an engine flag `RANK=ADDR` (`--kv-peer 1=tcp:127.0.0.1:7001`).
pub fn parse_rank_addr(s: &str) -> Result<(u32, PeerAddr), KvError> {
    let bad = |reason: &str| KvError::BadPeerAddr {
        addr: s.to_owned(),
        reason: reason.to_owned(),
    };
    let (rank, addr) = s.split_once('=').ok_or_else(|| bad("expected RANK=ADDR"))?;
    let rank = rank
        .trim()
        .parse()
        .map_err(|_| bad("rank must be a non-negative integer"))?;
    Ok((rank, addr.trim().parse()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_displays_round_trip() {
        for s in [
            "unix:/tmp/kv.sock",
            "unix:@kv-1",
            "tcp:127.0.0.1:7001",
            "tcp:[::1]:80",
        ] {
            let addr: PeerAddr = s.parse().unwrap();
            assert_eq!(addr.to_string(), s);
        }
        assert_eq!(
            "unix:@x".parse::<PeerAddr>().unwrap().kind(),
            TransportKind::Shm
        );
        assert_eq!(
            "tcp:127.0.0.1:1".parse::<PeerAddr>().unwrap().kind(),
            TransportKind::Tcp
        );
    }

    #[test]
    fn rejects_bad_addresses() {
        for s in [
            "",
            "unix:",
            "unix:@",
            "tcp:localhost:80",
            "tcp:1.2.3.4",
            "http://x",
            "/tmp/s",
        ] {
            assert!(
                matches!(s.parse::<PeerAddr>(), Err(KvError::BadPeerAddr { .. })),
                "{s}"
            );
        }
    }

    #[test]
    fn parses_rank_flags() {
        let (rank, addr) = parse_rank_addr("3=tcp:127.0.0.1:9").unwrap();
        assert_eq!((rank, addr.to_string().as_str()), (3, "tcp:127.0.0.1:9"));
        assert!(parse_rank_addr("x=tcp:127.0.0.1:9").is_err());
        assert!(parse_rank_addr("tcp:127.0.0.1:9").is_err());
        assert!(parse_rank_addr("-1=unix:@a").is_err());
    }

    #[test]
    fn serde_uses_the_string_form() {
        let addr: PeerAddr = serde_json::from_str("\"unix:@kv\"").unwrap();
        assert_eq!(addr, PeerAddr::UnixAbstract("kv".into()));
        assert_eq!(serde_json::to_string(&addr).unwrap(), "\"unix:@kv\"");
        assert!(serde_json::from_str::<PeerAddr>("\"nope\"").is_err());
    }

    #[test]
    fn transport_names_parse_as_flags_and_display_the_same() {
        use clap::ValueEnum as _;
        for kind in TransportKind::value_variants() {
            let name = kind.to_string();
            assert_eq!(TransportKind::from_str(&name, false), Ok(*kind));
        }
        assert!(TransportKind::from_str("udp", false).is_err());
    }

    #[test]
    fn ephemeral_shm_names_are_unique() {
        assert_ne!(
            PeerAddr::ephemeral(TransportKind::Shm),
            PeerAddr::ephemeral(TransportKind::Shm)
        );
    }
}
