//! PEM certificate files, read the same way by both sides of the router's TLS: the listeners'
//! chain (`--tls-cert`) and the engines' CA and client certificate (`ca_file`, `client_cert`).

use std::path::{Path, PathBuf};

use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::{self, PemObject};

/// Why a PEM file gives no certificate (or, read by the listeners, no key).
#[derive(Debug, thiserror::Error)]
pub enum PemError {
    #[error("cannot read {}: {source}", path.display())]
    Read { path: PathBuf, source: pem::Error },
    #[error("{}: no PEM certificate in it", path.display())]
    NoCertificate { path: PathBuf },
}

/// The certificates in `path` (PEM), at least one.
pub(crate) fn certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, PemError> {
    let read = |source| PemError::Read {
        path: path.to_owned(),
        source,
    };
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(read)?
        .collect::<Result<Vec<_>, _>>()
        .map_err(read)?;
    if certs.is_empty() {
        return Err(PemError::NoCertificate {
            path: path.to_owned(),
        });
    }
    Ok(certs)
}
