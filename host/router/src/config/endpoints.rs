//! The static endpoints: `--endpoint` flags (with `--endpoint-num-gpus`), or the file's
//! `[[endpoints]]`, each checked and reported by where it was given.

use std::path::Path;

use switchyard_contract::{Protocol, Role};
use toml::Spanned;
use toml::de::{DeString, DeValue, ValueDeserializer};

use super::error::{ConfigError, Problem};
use super::file::{ConfigFile, FileText};
use super::settings::ServeArgs;
use super::source::{Source, Sourced};
use crate::cluster::EndpointSpec;

/// The static endpoints; none is an error unless `discovered` ones will come. `--endpoint`
/// flags replace the file's.
pub(super) fn resolve(
    args: &ServeArgs,
    from_file: Vec<Sourced<EndpointSpec>>,
    discovered: bool,
) -> Result<Vec<EndpointSpec>, ConfigError> {
    let specs = if args.endpoints.is_empty() {
        if !args.endpoint_num_gpus.is_empty() {
            return Err(ConfigError::NumGpusCount {
                given: args.endpoint_num_gpus.len(),
                endpoints: 0,
            });
        }
        from_file
    } else {
        from_flags(&args.endpoints, &args.endpoint_num_gpus)?
    };
    if specs.is_empty() && !discovered {
        return Err(ConfigError::NoEndpoints);
    }
    specs
        .into_iter()
        .enumerate()
        .map(|(index, spec)| match spec.value.check() {
            Ok(()) => Ok(spec.value),
            Err(reason) => Err(ConfigError::BadEndpoint {
                at: spec.source,
                index,
                url: Some(spec.value.url),
                reason,
            }),
        })
        .collect()
}

/// The `[[endpoints]]` of the config file at `path`, checked as at startup: what a SIGHUP
/// reconciles the live list with.
pub fn endpoints_in_file(path: &Path) -> Result<Vec<EndpointSpec>, ConfigError> {
    let file = ConfigFile::read(path)?;
    let discovered = file.discovery.kind_given();
    resolve(&ServeArgs::default(), file.endpoints, discovered)
}

/// The file's `endpoints`: an array of tables, each an [`EndpointSpec`].
pub(super) fn from_file(
    file: &FileText,
    key: &Spanned<DeString<'_>>,
    value: Spanned<DeValue<'_>>,
) -> Result<Vec<Sourced<EndpointSpec>>, ConfigError> {
    let span = value.span();
    let DeValue::Array(entries) = value.into_inner() else {
        return Err(ConfigError::Invalid {
            at: file.source("", key.get_ref(), span),
            problem: Problem::Value("expected [[endpoints]] tables".into()),
        });
    };
    entries
        .into_iter()
        .enumerate()
        .map(|(index, entry)| {
            let at = file.source("", key.get_ref(), entry.span());
            serde::Deserialize::deserialize(ValueDeserializer::from(entry))
                .map(|spec| Sourced::new(spec, at.clone()))
                .map_err(|e: toml::de::Error| ConfigError::BadEndpoint {
                    // The line of what is wrong inside the entry, where the parser says.
                    at: e
                        .span()
                        .map_or(at, |span| file.source("", key.get_ref(), span)),
                    index,
                    url: None,
                    reason: e.message().to_owned(),
                })
        })
        .collect()
}

/// `--endpoint` flags, with `--endpoint-num-gpus` (one per flag, or none: one GPU each).
fn from_flags(
    flags: &[String],
    num_gpus: &[u32],
) -> Result<Vec<Sourced<EndpointSpec>>, ConfigError> {
    let gpus = match num_gpus.len() {
        0 => vec![1; flags.len()],
        given if given == flags.len() => num_gpus.to_vec(),
        given => {
            return Err(ConfigError::NumGpusCount {
                given,
                endpoints: flags.len(),
            });
        }
    };
    flags
        .iter()
        .zip(gpus)
        .enumerate()
        .map(|(index, (flag, num_gpus))| {
            let mut spec = endpoint_flag(flag).map_err(|reason| ConfigError::BadEndpoint {
                at: Source::Flag("endpoint"),
                index,
                url: Some(flag.clone()),
                reason,
            })?;
            spec.num_gpus = num_gpus;
            Ok(Sourced::new(spec, Source::Flag("endpoint")))
        })
        .collect()
}

/// One `--endpoint` flag:
/// `[PROTOCOL+]URL[,role=ROLE][,bootstrap_port=N][,kv_events=tcp://…[,kv_events_replay=tcp://…][,kv_events_dp_size=N]]`.
fn endpoint_flag(flag: &str) -> Result<EndpointSpec, String> {
    let mut parts = flag.split(',');
    let url = parts.next().unwrap_or_default();
    let (protocol, url) = match url.split_once('+') {
        Some((protocol, url)) => (protocol.parse::<Protocol>()?, url),
        None => (Protocol::Mlc, url),
    };
    let mut spec = EndpointSpec {
        protocol,
        ..EndpointSpec::new(url)
    };
    for option in parts {
        match option.split_once('=') {
            Some(("role", role)) => {
                spec.role = match role {
                    "any" => Role::Any,
                    "prefill" => Role::Prefill,
                    "decode" => Role::Decode,
                    other => {
                        return Err(format!(
                            "unknown role {other:?}: expected any, prefill or decode"
                        ));
                    }
                };
            }
            Some(("bootstrap_port", port)) => {
                spec.bootstrap_port = Some(
                    port.parse()
                        .map_err(|_| format!("bootstrap_port {port:?} is not a port number"))?,
                );
            }
            Some(("kv_events", events)) => spec.kv_events = Some(events.to_owned()),
            Some(("kv_events_replay", replay)) => spec.kv_events_replay = Some(replay.to_owned()),
            Some(("kv_events_dp_size", size)) => {
                spec.kv_events_dp_size =
                    Some(size.parse().map_err(|_| {
                        format!("kv_events_dp_size {size:?} is not a number of ranks")
                    })?);
            }
            _ => {
                return Err(format!(
                    "unknown option {option:?}: expected role=ROLE, bootstrap_port=N, \
                     kv_events=tcp://HOST:PORT, kv_events_replay=tcp://HOST:PORT or \
                     kv_events_dp_size=N"
                ));
            }
        }
    }
    Ok(spec)
}
