//! The TLS settings: the listeners' certificate and key (`tls_cert`, `tls_key`), and the files
//! `https://` engines are called with when an endpoint names none of its own
//! (`engine_ca_file`, `engine_client_cert`, `engine_client_key`). Files are read here, before
//! any port is bound, so a missing or unusable one stops the start with its setting's name.

use std::path::PathBuf;

use super::error::ConfigError;
use super::settings::RouterSettings;
use super::source::Sourced;
use crate::cluster::EndpointSpec;
use crate::engine_client::{EngineTls, TlsFiles};

/// The certificate chain and private key the listeners serve HTTPS with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListenerTls {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// `tls_cert` and `tls_key`, both or neither.
pub(super) fn listener(s: &RouterSettings) -> Result<Option<ListenerTls>, ConfigError> {
    Ok(pair(&s.tls_cert, "tls-key", &s.tls_key, "tls-cert")?
        .map(|(cert, key)| ListenerTls { cert, key }))
}

/// The engines' default TLS files; a client certificate and its key come together.
pub(super) fn engines(s: &RouterSettings) -> Result<TlsFiles, ConfigError> {
    let identity = pair(
        &s.engine_client_cert,
        "engine-client-key",
        &s.engine_client_key,
        "engine-client-cert",
    )?;
    let (client_cert, client_key) = identity.unzip();
    Ok(TlsFiles {
        ca_file: s.engine_ca_file.as_ref().map(|ca| ca.value.clone()),
        client_cert,
        client_key,
    })
}

/// Both values, or neither; one without the other names the other's flag.
fn pair(
    first: &Option<Sourced<PathBuf>>,
    first_needs: &'static str,
    second: &Option<Sourced<PathBuf>>,
    second_needs: &'static str,
) -> Result<Option<(PathBuf, PathBuf)>, ConfigError> {
    match (first, second) {
        (Some(first), Some(second)) => Ok(Some((first.value.clone(), second.value.clone()))),
        (None, None) => Ok(None),
        (Some(given), None) => Err(ConfigError::TlsPair {
            given: given.source.clone(),
            needs: first_needs,
        }),
        (None, Some(given)) => Err(ConfigError::TlsPair {
            given: given.source.clone(),
            needs: second_needs,
        }),
    }
}

/// Each `https://` endpoint's TLS files (its own, else `defaults`) read as its calls will
/// read them, so an unusable one is refused at the start rather than failing every call.
pub(super) fn check_engines(
    endpoints: &[EndpointSpec],
    defaults: &TlsFiles,
) -> Result<(), ConfigError> {
    for (index, spec) in endpoints.iter().enumerate() {
        if !spec.url.starts_with("https://") {
            continue;
        }
        if let Err(e) = EngineTls::load(&spec.tls_files().or(defaults)) {
            return Err(ConfigError::EngineTls {
                index,
                url: spec.url.clone(),
                reason: e.to_string(),
            });
        }
    }
    Ok(())
}
