//! The prefill engine a request's `x-prefiller-host-port` names, and why the sidecar may refuse
//! it. The header crosses the gateway: whatever a client puts there must not become a call to
//! a host the operator did not allow.

use std::net::{IpAddr, SocketAddr};

/// `host:port` as the header names it (host lower-cased; an IPv6 host in brackets).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    host: String,
    port: u16,
}

/// Why a named prefill engine is refused: the request's fault (400), and no call is made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TargetError {
    #[error("x-prefiller-host-port {value:?} is not HOST:PORT")]
    Malformed { value: String },
    #[error("x-prefiller-host-port names more than one prefill engine")]
    Several,
    #[error("x-prefiller-host-port {target} names this sidecar itself")]
    Itself { target: String },
    #[error(
        "x-prefiller-host-port {target} is not an allowed prefill engine (--prefill-allow, or the pods discovery found)"
    )]
    NotAllowed { target: String },
    #[error(
        "x-prefiller-host-port {target} names an engine whose role cannot prefill on {protocol}"
    )]
    CannotPrefill {
        target: String,
        protocol: &'static str,
    },
}

impl Target {
    /// Parse a header value: a host (name, IPv4, or bracketed IPv6) and a port, nothing else.
    pub fn parse(value: &str) -> Result<Target, TargetError> {
        let malformed = || TargetError::Malformed {
            value: value.to_owned(),
        };
        let authority: http::uri::Authority = value.parse().map_err(|_| malformed())?;
        if authority.as_str().contains('@') || authority.host().is_empty() {
            return Err(malformed());
        }
        let port = authority
            .port_u16()
            .filter(|&p| p != 0)
            .ok_or_else(malformed)?;
        Ok(Target {
            host: authority.host().to_ascii_lowercase(),
            port,
        })
    }

    /// `host:port`, as [`crate::cluster::Cluster::address`] spells an endpoint's.
    pub fn address(&self) -> String {
        format!("{}:{}", self.host, self.port)
    }

    /// Whether this names the sidecar listening on `own`: its port, and its IP; when it listens
    /// on every interface, any address of this host (its pod's IP, which discovery may list);
    /// a loopback name when it listens on loopback.
    pub fn is(&self, own: SocketAddr) -> bool {
        if self.port != own.port() {
            return false;
        }
        let everywhere = own.ip().is_unspecified();
        let local = own.ip().is_loopback() || everywhere;
        match self.host.trim_matches(['[', ']']).parse::<IpAddr>() {
            Ok(ip) => {
                ip == own.ip() || (ip.is_loopback() && local) || (everywhere && is_this_host(ip))
            }
            Err(_) => self.host == "localhost" && local,
        }
    }
}

/// Whether `ip` is one of this host's addresses: only those can be bound.
fn is_this_host(ip: IpAddr) -> bool {
    std::net::UdpSocket::bind(SocketAddr::new(ip, 0)).is_ok()
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.host, self.port)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_target_is_a_host_and_a_port() {
        let t = Target::parse("10.0.0.5:8000").expect("valid");
        assert_eq!(t.address(), "10.0.0.5:8000");
        assert_eq!(
            Target::parse("Prefill-0.NS:80").expect("valid").address(),
            "prefill-0.ns:80"
        );
        assert_eq!(
            Target::parse("[::1]:9000").expect("valid").address(),
            "[::1]:9000"
        );
    }

    #[test]
    fn anything_else_is_malformed() {
        for value in [
            "",
            "10.0.0.5",
            "10.0.0.5:",
            ":8000",
            "10.0.0.5:0",
            "10.0.0.5:99999",
            "user@10.0.0.5:8000",
            "http://10.0.0.5:8000",
            "10.0.0.5:8000/v1",
            "10.0.0.5 :8000",
        ] {
            assert_eq!(
                Target::parse(value),
                Err(TargetError::Malformed {
                    value: value.to_owned()
                }),
                "{value:?}"
            );
        }
    }

    #[test]
    fn the_sidecar_knows_its_own_address() {
        let loopback: SocketAddr = "127.0.0.1:8000".parse().expect("addr");
        let any: SocketAddr = "0.0.0.0:8000".parse().expect("addr");
        let pod: SocketAddr = "10.0.0.7:8000".parse().expect("addr");
        let is = |value: &str, own| Target::parse(value).expect("valid").is(own);
        assert!(is("127.0.0.1:8000", loopback));
        assert!(is("localhost:8000", loopback));
        assert!(is("127.0.0.2:8000", any));
        assert!(is("[::1]:8000", any));
        assert!(is("10.0.0.7:8000", pod));
        assert!(!is("127.0.0.1:8000", pod));
        assert!(!is("127.0.0.1:8001", loopback));
        assert!(!is("10.0.0.8:8000", pod));
        // Listening everywhere: an address of this host is its own, another host's is not.
        assert!(is("127.0.0.3:8000", any));
        assert!(!is("192.0.2.1:8000", any), "TEST-NET-1 is no host's here");
    }
}
