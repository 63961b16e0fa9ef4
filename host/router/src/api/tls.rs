//! HTTPS on the router's listeners (`--tls-cert`, `--tls-key`): rustls on ring, TLS 1.2 and
//! 1.3, HTTP/2 or HTTP/1.1 as ALPN settles (hyper-util's automatic server then reads the
//! preface the client sends). The handshake runs on the connection's worker, within the header
//! deadline: a client that opens a connection and never finishes the handshake holds its place
//! no longer than one that never finishes a request's header.
//!
//! A certificate rotated in place (cert-manager rewriting a mounted secret) is picked up
//! without a restart: at a handshake, at most once per [`RELOAD_CHECK`], the files' times are
//! compared with those last read, and changed files are read again. Files that do not make a
//! certificate (half written, a key that does not match) leave the last good one serving, and
//! say so in the log.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use parking_lot::Mutex;
use rustls::ServerConfig;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::PrivateKeyDer;
use rustls::pki_types::pem::PemObject;
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use tokio::net::TcpStream;
use tokio_util::either::Either;

use crate::pem::{self, PemError};

/// A client connection's bytes: plain, or TLS. The TLS side is boxed: inline, rustls' state
/// was room in every connection's task, plain ones included (with the handshake's, also boxed:
/// 0.6 KiB of each open stream, heaptrack at 1,024).
pub(super) type ClientIo = Either<TcpStream, Box<tokio_rustls::server::TlsStream<TcpStream>>>;

/// The longest a changed certificate file goes unnoticed while clients connect.
const RELOAD_CHECK: Duration = Duration::from_secs(1);

/// Makes the TLS side of accepted connections; clones share the configuration.
#[derive(Clone)]
pub struct TlsAcceptor(tokio_rustls::TlsAcceptor);

impl std::fmt::Debug for TlsAcceptor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TlsAcceptor")
    }
}

/// Why the listeners' certificate or key cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ListenerTlsError {
    #[error(transparent)]
    Pem(#[from] PemError),
    #[error("{} does not go with {}: {source}", key.display(), cert.display())]
    Mismatch {
        cert: PathBuf,
        key: PathBuf,
        source: rustls::Error,
    },
}

impl TlsAcceptor {
    /// The certificate chain in `cert` and the private key in `key` (PEM both), read now and
    /// again when they change.
    pub fn load(cert: &Path, key: &Path) -> Result<TlsAcceptor, ListenerTlsError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let resolver = ReloadingCert::load(cert, key, Arc::clone(&provider), RELOAD_CHECK)?;
        let mut config = ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("ring supports the default protocol versions")
            .with_no_client_auth()
            .with_cert_resolver(Arc::new(resolver));
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(TlsAcceptor(tokio_rustls::TlsAcceptor::from(Arc::new(
            config,
        ))))
    }

    /// `stream` with its TLS handshake done.
    pub(super) async fn accept(&self, stream: TcpStream) -> std::io::Result<ClientIo> {
        Ok(Either::Right(Box::new(self.0.accept(stream).await?)))
    }

    /// Whether the handshake on `stream` settled on HTTP/1.1 (ALPN).
    pub(super) fn settled_http1(stream: &tokio_rustls::server::TlsStream<TcpStream>) -> bool {
        stream.get_ref().1.alpn_protocol() == Some(b"http/1.1")
    }
}

/// The listeners' certificate and key, read again when their files change.
#[derive(Debug)]
struct ReloadingCert {
    cert: PathBuf,
    key: PathBuf,
    provider: Arc<CryptoProvider>,
    every: Duration,
    current: Mutex<Current>,
}

#[derive(Debug)]
struct Current {
    certified: Arc<CertifiedKey>,
    /// The files' modification times when last read.
    modified: [Option<SystemTime>; 2],
    checked: Instant,
}

impl ReloadingCert {
    fn load(
        cert: &Path,
        key: &Path,
        provider: Arc<CryptoProvider>,
        every: Duration,
    ) -> Result<ReloadingCert, ListenerTlsError> {
        let modified = modified([cert, key]);
        let certified = Arc::new(certified_key(cert, key, &provider)?);
        Ok(ReloadingCert {
            cert: cert.to_owned(),
            key: key.to_owned(),
            provider,
            every,
            current: Mutex::new(Current {
                certified,
                modified,
                checked: Instant::now(),
            }),
        })
    }

    /// The certificate to serve now: the files' again if they changed since they were read.
    fn certified(&self) -> Arc<CertifiedKey> {
        let mut current = self.current.lock();
        if current.checked.elapsed() >= self.every {
            current.checked = Instant::now();
            let modified = modified([&self.cert, &self.key]);
            if modified != current.modified {
                // Not read again until they change again, good or not.
                current.modified = modified;
                match certified_key(&self.cert, &self.key, &self.provider) {
                    Ok(certified) => {
                        current.certified = Arc::new(certified);
                        tracing::info!(cert = %self.cert.display(), "listener certificate reloaded");
                    }
                    Err(error) => tracing::warn!(
                        %error,
                        "listener certificate files changed but make no certificate: still serving the previous one"
                    ),
                }
            }
        }
        Arc::clone(&current.certified)
    }
}

impl ResolvesServerCert for ReloadingCert {
    fn resolve(&self, _: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.certified())
    }
}

fn modified(paths: [&Path; 2]) -> [Option<SystemTime>; 2] {
    paths.map(|path| std::fs::metadata(path).and_then(|m| m.modified()).ok())
}

/// The chain in `cert` with the key in `key`, checked to match.
fn certified_key(
    cert: &Path,
    key: &Path,
    provider: &CryptoProvider,
) -> Result<CertifiedKey, ListenerTlsError> {
    let chain = pem::certificates(cert)?;
    let private_key = PrivateKeyDer::from_pem_file(key).map_err(|source| PemError::Read {
        path: key.to_owned(),
        source,
    })?;
    CertifiedKey::from_der(chain, private_key, provider).map_err(|source| {
        ListenerTlsError::Mismatch {
            cert: cert.to_owned(),
            key: key.to_owned(),
            source,
        }
    })
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, SystemTime};

    use super::ReloadingCert;

    /// A self-signed certificate for `name` and its key, written over `dir`'s `tls.crt` and
    /// `tls.key`, stamped `at` (so a change is seen whatever the file system's clock grain).
    fn write_certificate(dir: &std::path::Path, name: &str, at: SystemTime) -> Vec<u8> {
        let rcgen::CertifiedKey { cert, signing_key } =
            rcgen::generate_simple_self_signed(vec![name.to_owned()]).expect("certificate");
        for (file, pem) in [
            ("tls.crt", cert.pem()),
            ("tls.key", signing_key.serialize_pem()),
        ] {
            stamp(&dir.join(file), pem.as_bytes(), at);
        }
        cert.der().to_vec()
    }

    fn stamp(path: &std::path::Path, bytes: &[u8], at: SystemTime) {
        std::fs::write(path, bytes).expect("write");
        let file = std::fs::File::options()
            .write(true)
            .open(path)
            .expect("open");
        file.set_modified(at).expect("set the modification time");
    }

    #[test]
    fn a_rotated_certificate_is_served_and_a_broken_one_is_not() {
        let dir = tempfile::tempdir().expect("tempdir");
        let start = SystemTime::now();
        let first = write_certificate(dir.path(), "first.test", start);
        let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
        let (cert, key) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
        let reloading = ReloadingCert::load(&cert, &key, provider, Duration::ZERO).expect("loads");
        let served = || reloading.certified().cert[0].to_vec();
        assert_eq!(served(), first);
        assert_eq!(served(), first, "unchanged files are not read again");

        let second = write_certificate(dir.path(), "second.test", start + Duration::from_secs(10));
        assert_eq!(served(), second, "the rotated certificate");

        stamp(&cert, b"half written", start + Duration::from_secs(20));
        assert_eq!(
            served(),
            second,
            "broken files leave the last good certificate"
        );
    }
}
