//! The `--config` file: TOML, read once; each key's value parsed as its setting's kind and kept
//! with the line it is on. An unknown key, a value of the wrong kind or a line that is not
//! TOML is refused with the file and the line.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::num::NonZeroUsize;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use toml::Spanned;
use toml::de::{DeString, DeTable, DeValue, ValueDeserializer};

use super::discovery::{DiscoveryKeys, DiscoveryKind};
use super::endpoints;
use super::epp::EndpointPickerKeys;
use super::error::{ConfigError, Problem};
use super::flow_control::FlowControlKeys;
use super::model::ModelEntry;
use super::settings::RouterKeys;
use super::source::{FileKey, Source, Sourced};
use crate::cluster::EndpointSpec;

/// What the file says, key by key.
#[derive(Debug, Default)]
pub(super) struct ConfigFile {
    pub(super) router: RouterKeys,
    pub(super) discovery: DiscoveryKeys,
    pub(super) flow_control: FlowControlKeys,
    /// `switchyard epp`'s; `serve` ignores them.
    pub(super) epp: EndpointPickerKeys,
    pub(super) endpoints: Vec<Sourced<EndpointSpec>>,
    /// Model name → policy name.
    pub(super) model_policies: BTreeMap<String, Sourced<String>>,
    /// `[[models]]`, in file order.
    pub(super) models: Vec<Sourced<ModelEntry>>,
}

/// The top-level keys that are tables of their own rather than settings.
const TABLES: [&str; 6] = [
    "endpoints",
    "discovery",
    "flow_control",
    "epp",
    "model_policies",
    "models",
];

impl ConfigFile {
    /// The file `--config` names; none: no keys.
    pub(super) fn named(args: &super::ServeArgs) -> Result<ConfigFile, ConfigError> {
        match &args.config {
            Some(path) => ConfigFile::read(path),
            None => Ok(ConfigFile::default()),
        }
    }

    pub(super) fn read(path: &Path) -> Result<ConfigFile, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::ReadFile {
            path: path.to_owned(),
            source,
        })?;
        let file = FileText {
            path: path.into(),
            text,
        };
        let document = DeTable::parse(&file.text).map_err(|e| ConfigError::Syntax {
            path: path.to_owned(),
            line: file.line(e.span().map_or(file.text.len(), |span| span.start)),
            reason: e.message().to_owned(),
        })?;
        let mut config = ConfigFile::default();
        for (key, value) in in_file_order(document.into_inner()) {
            let name: &str = key.get_ref();
            match name {
                "endpoints" => config.endpoints = endpoints::from_file(&file, &key, value)?,
                "models" => config.models = file.array_of_tables(&key, value)?,
                "discovery" => {
                    for (key, value) in file.table("", &key, value)? {
                        if config.discovery.take(&key, value, &file)?.is_some() {
                            return Err(file.unknown("discovery", &key, DiscoveryKeys::KEYS));
                        }
                    }
                }
                "flow_control" => {
                    for (key, value) in file.table("", &key, value)? {
                        if config.flow_control.take(&key, value, &file)?.is_some() {
                            return Err(file.unknown("flow_control", &key, FlowControlKeys::KEYS));
                        }
                    }
                }
                "epp" => {
                    for (key, value) in file.table("", &key, value)? {
                        if config.epp.take(&key, value, &file)?.is_some() {
                            return Err(file.unknown("epp", &key, EndpointPickerKeys::KEYS));
                        }
                    }
                }
                "model_policies" => {
                    for (model, policy) in file.table("", &key, value)? {
                        let policy =
                            file.value("model_policies", &model, policy, String::from_toml)?;
                        config
                            .model_policies
                            .insert(model.into_inner().into_owned(), policy);
                    }
                }
                _ => {
                    if config.router.take(&key, value, &file)?.is_some() {
                        let expected = [RouterKeys::KEYS, &TABLES].concat();
                        return Err(file.unknown("", &key, &expected));
                    }
                }
            }
        }
        Ok(config)
    }
}

/// A table's keys and values.
type Entries<'i> = Vec<(Spanned<DeString<'i>>, Spanned<DeValue<'i>>)>;

/// A table's entries as the file orders them (the parser sorts them by name), so that the
/// first error reported is the first in the file.
fn in_file_order(table: DeTable<'_>) -> Entries<'_> {
    let mut entries: Vec<_> = table.into_iter().collect();
    entries.sort_by_key(|(key, _)| key.span().start);
    entries
}

/// The file's text, to turn a parser's byte offsets into lines.
#[derive(Debug)]
pub(super) struct FileText {
    path: Arc<Path>,
    text: String,
}

impl FileText {
    fn line(&self, offset: usize) -> usize {
        let before = &self.text.as_bytes()[..offset.min(self.text.len())];
        1 + before.iter().filter(|&&b| b == b'\n').count()
    }

    /// Where the text at `span` is, named as `key` of `table` (`""`: the top level).
    pub(super) fn source(&self, table: &str, key: &str, span: Range<usize>) -> Source {
        Source::File(Box::new(FileKey {
            path: self.path.clone(),
            line: self.line(span.start),
            key: if table.is_empty() {
                key.to_owned()
            } else {
                format!("{table}.{key}")
            },
        }))
    }

    /// `key`'s value, read by `read`.
    pub(super) fn value<'i, T>(
        &self,
        table: &str,
        key: &Spanned<DeString<'i>>,
        value: Spanned<DeValue<'i>>,
        read: impl FnOnce(ValueDeserializer<'i>) -> Result<T, String>,
    ) -> Result<Sourced<T>, ConfigError> {
        let at = self.source(table, key.get_ref(), key.span());
        match read(ValueDeserializer::from(value)) {
            Ok(value) => Ok(Sourced::new(value, at)),
            Err(reason) => Err(ConfigError::Invalid {
                at,
                problem: Problem::Value(reason),
            }),
        }
    }

    /// The tables of `key`'s value, which must be an array of them (`[[key]]`), each read as
    /// a `T` and sourced at its own line.
    pub(super) fn array_of_tables<'i, T: serde::Deserialize<'i>>(
        &self,
        key: &Spanned<DeString<'i>>,
        value: Spanned<DeValue<'i>>,
    ) -> Result<Vec<Sourced<T>>, ConfigError> {
        let name: &str = key.get_ref();
        let span = value.span();
        let DeValue::Array(entries) = value.into_inner() else {
            return Err(ConfigError::Invalid {
                at: self.source("", name, span),
                problem: Problem::Value(format!("expected [[{name}]] tables")),
            });
        };
        entries
            .into_iter()
            .map(|entry| {
                let at = self.source("", name, entry.span());
                match deserialize(ValueDeserializer::from(entry)) {
                    Ok(value) => Ok(Sourced::new(value, at)),
                    Err(reason) => Err(ConfigError::Invalid {
                        at,
                        problem: Problem::Value(reason),
                    }),
                }
            })
            .collect()
    }

    /// The entries of `key`'s value, which must be a table.
    pub(super) fn table<'i>(
        &self,
        table: &str,
        key: &Spanned<DeString<'i>>,
        value: Spanned<DeValue<'i>>,
    ) -> Result<Entries<'i>, ConfigError> {
        let span = value.span();
        match value.into_inner() {
            DeValue::Table(entries) => Ok(in_file_order(entries)),
            other => Err(ConfigError::Invalid {
                at: self.source(table, key.get_ref(), span),
                problem: Problem::Value(format!("expected a table, found {}", other.type_str())),
            }),
        }
    }

    pub(super) fn unknown(
        &self,
        table: &str,
        key: &Spanned<DeString<'_>>,
        expected: &[&'static str],
    ) -> ConfigError {
        ConfigError::UnknownKey {
            at: self.source(table, key.get_ref(), key.span()),
            expected: expected.to_vec(),
        }
    }
}

/// How a setting's value is written in the file.
pub(super) trait FileValue: Sized {
    /// The value, or the parser's words for why it is not one.
    fn from_toml(value: ValueDeserializer<'_>) -> Result<Self, String>;
}

/// Written as serde reads them.
macro_rules! as_serde_reads_them {
    ($($ty:ty),*) => {
        $(impl FileValue for $ty {
            fn from_toml(value: ValueDeserializer<'_>) -> Result<Self, String> {
                deserialize(value)
            }
        })*
    };
}

as_serde_reads_them!(
    bool,
    u16,
    u32,
    u64,
    usize,
    f64,
    NonZeroUsize,
    String,
    Vec<String>,
    PathBuf,
    IpAddr,
    DiscoveryKind
);

/// `value` as serde reads a `T`, or the parser's words.
pub(super) fn deserialize<'de, T: serde::Deserialize<'de>>(
    value: ValueDeserializer<'de>,
) -> Result<T, String> {
    T::deserialize(value).map_err(|e| e.message().to_owned())
}

/// A duration is written as the flags take it: `"500ms"`, `"30s"`, `"10m"`.
impl FileValue for Duration {
    fn from_toml(value: ValueDeserializer<'_>) -> Result<Self, String> {
        let text = String::from_toml(value)?;
        humantime::parse_duration(&text).map_err(|e| format!("{text:?} is not a duration: {e}"))
    }
}

/// `policy_config`: a table, or JSON text, as JSON text.
pub(super) fn json_text(value: ValueDeserializer<'_>) -> Result<String, String> {
    match deserialize(value)? {
        toml::Value::String(json) => Ok(json),
        table => serde_json::to_string(&table).map_err(|e| e.to_string()),
    }
}
