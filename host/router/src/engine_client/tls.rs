//! TLS to `https://` engines: whom the router trusts (the system's roots, or `ca_file`'s
//! private CA alone), the client certificate it presents when it has one (mTLS), and what a
//! failed handshake means, told apart by rustls' typed errors (never by their text).
//!
//! An endpoint's files are read once, when it joins the list; connections with the same files
//! share one pool per thread ([`super::EngineClient`]). Plain `http://` engines never come
//! here: their connector is the bare TCP one.

use std::error::Error as StdError;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use rustls::pki_types::PrivateKeyDer;
use rustls::pki_types::pem::PemObject;
use rustls::{AlertDescription, ClientConfig, RootCertStore};

use crate::pem::{PemError, certificates};

/// The files an engine's TLS is made of; none given: the system's roots, no client
/// certificate.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct TlsFiles {
    /// PEM certificates of the CA(s) that sign the engines' certificates, trusted instead of
    /// the system's roots.
    pub ca_file: Option<PathBuf>,
    /// PEM certificate chain the router presents when the engine asks for one.
    pub client_cert: Option<PathBuf>,
    /// PEM private key of `client_cert`.
    pub client_key: Option<PathBuf>,
}

impl TlsFiles {
    /// These files, each one given here winning over `defaults`' (an endpoint's own keys over
    /// the top-level ones). A certificate and its key are one setting: an endpoint that names
    /// either takes neither from `defaults`.
    pub fn or(&self, defaults: &TlsFiles) -> TlsFiles {
        let own_identity = self.client_cert.is_some() || self.client_key.is_some();
        let (client_cert, client_key) = match own_identity {
            true => (self.client_cert.clone(), self.client_key.clone()),
            false => (defaults.client_cert.clone(), defaults.client_key.clone()),
        };
        TlsFiles {
            ca_file: self.ca_file.clone().or_else(|| defaults.ca_file.clone()),
            client_cert,
            client_key,
        }
    }

    /// Whether any file is given.
    pub fn is_empty(&self) -> bool {
        *self == TlsFiles::default()
    }

    /// A client certificate comes with its key; the reason otherwise.
    pub fn check(&self) -> Result<(), String> {
        match (&self.client_cert, &self.client_key) {
            (Some(_), None) => Err("client_cert needs client_key (its private key)".into()),
            (None, Some(_)) => Err("client_key needs client_cert (its certificate)".into()),
            _ => Ok(()),
        }
    }
}

/// Why an endpoint's TLS files cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsSetupError {
    #[error(transparent)]
    Pem(#[from] PemError),
    #[error("{}: not a CA certificate rustls accepts: {source}", path.display())]
    BadCa {
        path: PathBuf,
        source: rustls::Error,
    },
    #[error("the system has no root certificates: give ca_file")]
    NoSystemRoots,
    #[error("{}: {reason}", path.display())]
    Identity { path: PathBuf, reason: String },
    #[error("client_cert and client_key must be given together")]
    HalfIdentity,
}

/// What a connection to an engine trusts and presents: its files' [`ClientConfig`], built once
/// and shared by clones (every call's `Upstream` holds one).
#[derive(Debug, Clone)]
pub struct EngineTls(Arc<Loaded>);

#[derive(Debug)]
struct Loaded {
    files: TlsFiles,
    /// Shared by every connection made with these files.
    config: Arc<ClientConfig>,
}

impl EngineTls {
    /// Read `files` into a client configuration (rustls on ring, TLS 1.2 and 1.3).
    pub fn load(files: &TlsFiles) -> Result<EngineTls, TlsSetupError> {
        let roots = match &files.ca_file {
            Some(path) => Arc::new(private_roots(path)?),
            None => system_roots()?,
        };
        let builder =
            ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()
                .expect("ring supports the default protocol versions")
                .with_root_certificates(roots);
        let config = match (&files.client_cert, &files.client_key) {
            (None, None) => builder.with_no_client_auth(),
            (Some(cert), Some(key)) => builder
                .with_client_auth_cert(certificates(cert)?, private_key(key)?)
                .map_err(|e| TlsSetupError::Identity {
                    path: key.clone(),
                    reason: format!("does not go with client_cert: {e}"),
                })?,
            _ => return Err(TlsSetupError::HalfIdentity),
        };
        Ok(EngineTls(Arc::new(Loaded {
            files: files.clone(),
            config: Arc::new(config),
        })))
    }

    pub fn files(&self) -> &TlsFiles {
        &self.0.files
    }

    pub(super) fn config(&self) -> &Arc<ClientConfig> {
        &self.0.config
    }

    /// Whether it has a client certificate to present.
    pub(super) fn presents_certificate(&self) -> bool {
        self.0.files.client_cert.is_some()
    }
}

fn private_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsSetupError> {
    PrivateKeyDer::from_pem_file(path).map_err(|e| TlsSetupError::Identity {
        path: path.to_owned(),
        reason: format!("no usable PEM private key: {e}"),
    })
}

/// `ca_file`'s certificates, trusted alone.
fn private_roots(path: &Path) -> Result<RootCertStore, TlsSetupError> {
    let mut roots = RootCertStore::empty();
    for cert in certificates(path)? {
        roots.add(cert).map_err(|source| TlsSetupError::BadCa {
            path: path.to_owned(),
            source,
        })?;
    }
    Ok(roots)
}

/// The operating system's roots (rustls-native-certs: the files OpenSSL would read, or
/// `SSL_CERT_FILE`), read once per process. Certificates the store cannot parse are skipped,
/// as browsers do.
fn system_roots() -> Result<Arc<RootCertStore>, TlsSetupError> {
    static ROOTS: OnceLock<Arc<RootCertStore>> = OnceLock::new();
    let roots = ROOTS.get_or_init(|| {
        let mut roots = RootCertStore::empty();
        let found = rustls_native_certs::load_native_certs();
        for error in &found.errors {
            tracing::warn!(%error, "reading the system's root certificates");
        }
        roots.add_parsable_certificates(found.certs);
        Arc::new(roots)
    });
    match roots.is_empty() {
        true => Err(TlsSetupError::NoSystemRoots),
        false => Ok(Arc::clone(roots)),
    }
}

/// Why a TLS connection to an engine failed, as `/admin/endpoints` and the log name it.
#[derive(Debug, Clone, thiserror::Error)]
pub enum TlsError {
    /// The engine's certificate does not verify against the trusted roots, or names another
    /// host, or has expired.
    #[error("TLS: the engine's certificate does not verify ({0}); check ca_file")]
    UntrustedCertificate(rustls::Error),
    /// The engine asked for a client certificate and the router has none.
    #[error(
        "TLS: the engine demands a client certificate and the router has none \
         (set client_cert and client_key)"
    )]
    ClientCertificateRequired,
    /// The engine refused the client certificate the router presented.
    #[error("TLS: the engine refused the router's client certificate ({0})")]
    ClientCertificateRefused(rustls::Error),
    #[error("TLS handshake failed: {0}")]
    Handshake(rustls::Error),
    /// The endpoint's TLS files could not be used: no call leaves.
    #[error("TLS is not set up: {0}")]
    Setup(Arc<TlsSetupError>),
}

impl TlsError {
    /// A short name for the failure, as `/admin/endpoints` shows it.
    pub fn kind(&self) -> &'static str {
        match self {
            TlsError::UntrustedCertificate(_) => "tls_certificate_not_trusted",
            TlsError::ClientCertificateRequired => "tls_client_certificate_required",
            TlsError::ClientCertificateRefused(_) => "tls_client_certificate_refused",
            TlsError::Handshake(_) => "tls_handshake",
            TlsError::Setup(_) => "tls_setup",
        }
    }

    /// The TLS failure under a connection error, if it is one: rustls' error, found in the
    /// error's chain, read for which side gave up and why (`presented`: whether the router
    /// had a client certificate to present).
    pub(super) fn find(error: &(dyn StdError + 'static), presented: bool) -> Option<TlsError> {
        let cause = rustls_cause(error)?.clone();
        Some(match &cause {
            rustls::Error::InvalidCertificate(_) => TlsError::UntrustedCertificate(cause),
            rustls::Error::AlertReceived(alert) => match (alert, presented) {
                (AlertDescription::CertificateRequired, false) => {
                    TlsError::ClientCertificateRequired
                }
                (
                    AlertDescription::CertificateRequired
                    | AlertDescription::BadCertificate
                    | AlertDescription::UnknownCA
                    | AlertDescription::CertificateUnknown
                    | AlertDescription::CertificateExpired
                    | AlertDescription::CertificateRevoked
                    | AlertDescription::UnsupportedCertificate
                    | AlertDescription::AccessDenied,
                    true,
                ) => TlsError::ClientCertificateRefused(cause),
                _ => TlsError::Handshake(cause),
            },
            _ => TlsError::Handshake(cause),
        })
    }
}

/// rustls' error in `error`'s chain. An `io::Error`'s `source` skips the error it wraps
/// (tokio-rustls carries rustls' error inside one), so
/// each is stepped into instead.
fn rustls_cause<'e>(mut error: &'e (dyn StdError + 'static)) -> Option<&'e rustls::Error> {
    loop {
        if let Some(tls) = error.downcast_ref::<rustls::Error>() {
            return Some(tls);
        }
        let next = match error.downcast_ref::<std::io::Error>() {
            Some(io) => io.get_ref().map(|inner| inner as &(dyn StdError + 'static)),
            None => error.source(),
        };
        error = next?;
    }
}

#[cfg(test)]
mod tests {
    use std::io;

    use rustls::{AlertDescription, CertificateError};

    use super::{TlsError, TlsFiles};

    /// rustls' error inside tokio-rustls' `io::Error`, inside another: the search steps into
    /// each.
    fn wrapped(error: rustls::Error) -> io::Error {
        io::Error::other(io::Error::new(io::ErrorKind::InvalidData, error))
    }

    fn alert(alert: AlertDescription) -> io::Error {
        wrapped(rustls::Error::AlertReceived(alert))
    }

    #[test]
    fn each_side_of_a_failed_handshake_is_told_apart() {
        let untrusted = wrapped(rustls::Error::InvalidCertificate(
            CertificateError::UnknownIssuer,
        ));
        let cases = [
            (&untrusted, false, Some("tls_certificate_not_trusted")),
            (&untrusted, true, Some("tls_certificate_not_trusted")),
            (
                &alert(AlertDescription::CertificateRequired),
                false,
                Some("tls_client_certificate_required"),
            ),
            (
                &alert(AlertDescription::CertificateRequired),
                true,
                Some("tls_client_certificate_refused"),
            ),
            (
                &alert(AlertDescription::UnknownCA),
                true,
                Some("tls_client_certificate_refused"),
            ),
            (
                &alert(AlertDescription::UnknownCA),
                false,
                Some("tls_handshake"),
            ),
            (
                &alert(AlertDescription::ProtocolVersion),
                true,
                Some("tls_handshake"),
            ),
            (
                &io::Error::from(io::ErrorKind::ConnectionRefused),
                false,
                None,
            ),
        ];
        for (error, presented, kind) in cases {
            let found = TlsError::find(error, presented);
            assert_eq!(
                found.as_ref().map(TlsError::kind),
                kind,
                "{error} (client certificate: {presented})"
            );
        }
    }

    #[test]
    fn an_endpoints_own_files_win_and_a_certificate_comes_with_its_key() {
        let path = |p: &str| Some(p.into());
        let defaults = TlsFiles {
            ca_file: path("/all/ca.pem"),
            client_cert: path("/all/router.crt"),
            client_key: path("/all/router.key"),
        };
        assert_eq!(TlsFiles::default().or(&defaults), defaults);
        let own_ca = TlsFiles {
            ca_file: path("/one/ca.pem"),
            ..TlsFiles::default()
        };
        assert_eq!(
            own_ca.or(&defaults),
            TlsFiles {
                ca_file: path("/one/ca.pem"),
                ..defaults.clone()
            }
        );
        // A half identity takes nothing from the defaults: it is refused as it is.
        let half = TlsFiles {
            client_cert: path("/one/router.crt"),
            ..TlsFiles::default()
        };
        let merged = half.or(&defaults);
        assert_eq!(merged.client_key, None);
        assert!(merged.check().is_err());
        assert!(defaults.check().is_ok());
    }
}
