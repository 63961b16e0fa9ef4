//! HTTPS on the router's listeners (`--tls-cert`, `--tls-key`): rustls on ring, TLS 1.2 and
//! 1.3, HTTP/2 or HTTP/1.1 as ALPN settles (hyper-util's automatic server then reads the
//! preface the client sends). The handshake runs on the connection's worker, within the header
//! deadline: a client that opens a connection and never finishes the handshake holds its place
//! no longer than one that never finishes a request's header.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::ServerConfig;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::TcpStream;
use tokio_util::either::Either;

/// A client connection's bytes: plain, or TLS.
pub(super) type ClientIo = Either<TcpStream, tokio_rustls::server::TlsStream<TcpStream>>;

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
    #[error("cannot read {}: {source}", path.display())]
    Read {
        path: PathBuf,
        source: rustls::pki_types::pem::Error,
    },
    #[error("{}: no PEM certificate in it", path.display())]
    NoCertificate { path: PathBuf },
    #[error("{} does not go with {}: {source}", key.display(), cert.display())]
    Mismatch {
        cert: PathBuf,
        key: PathBuf,
        source: rustls::Error,
    },
}

impl TlsAcceptor {
    /// The certificate chain in `cert` and the private key in `key` (PEM both), read now.
    pub fn load(cert: &Path, key: &Path) -> Result<TlsAcceptor, ListenerTlsError> {
        fn read(path: &Path) -> impl Fn(rustls::pki_types::pem::Error) -> ListenerTlsError {
            let path = path.to_owned();
            move |source| ListenerTlsError::Read {
                path: path.clone(),
                source,
            }
        }
        let chain = CertificateDer::pem_file_iter(cert)
            .map_err(read(cert))?
            .collect::<Result<Vec<_>, _>>()
            .map_err(read(cert))?;
        if chain.is_empty() {
            return Err(ListenerTlsError::NoCertificate {
                path: cert.to_owned(),
            });
        }
        let private_key = PrivateKeyDer::from_pem_file(key).map_err(read(key))?;
        let mut config =
            ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()
                .expect("ring supports the default protocol versions")
                .with_no_client_auth()
                .with_single_cert(chain, private_key)
                .map_err(|source| ListenerTlsError::Mismatch {
                    cert: cert.to_owned(),
                    key: key.to_owned(),
                    source,
                })?;
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(TlsAcceptor(tokio_rustls::TlsAcceptor::from(Arc::new(
            config,
        ))))
    }

    /// `stream` with its TLS handshake done.
    pub(super) async fn accept(&self, stream: TcpStream) -> std::io::Result<ClientIo> {
        Ok(Either::Right(self.0.accept(stream).await?))
    }
}
