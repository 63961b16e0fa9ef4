//! A small reader for a policy's JSON config: one object, typed getters, and errors
//! written for the operator who typed the config.

use std::fmt;

use serde_json::{Map, Value};

/// A policy's parsed JSON config (an object; an empty string counts as `{}`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Config {
    fields: Map<String, Value>,
}

/// Why a config was refused. Converts into the `String` that `init` returns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError(String);

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ConfigError {}

impl From<ConfigError> for String {
    fn from(e: ConfigError) -> String {
        e.0
    }
}

impl Config {
    /// Parse `json`, which must be an object.
    pub fn parse(json: &str) -> Result<Config, ConfigError> {
        if json.trim().is_empty() {
            return Ok(Config::default());
        }
        match serde_json::from_str::<Value>(json) {
            Ok(Value::Object(fields)) => Ok(Config { fields }),
            Ok(other) => Err(ConfigError(format!(
                "config must be a JSON object, got {}",
                kind(&other)
            ))),
            Err(e) => Err(ConfigError(format!("config is not valid JSON: {e}"))),
        }
    }

    /// Refuse keys outside `known`, so a typo is an error instead of a silent default.
    pub fn deny_unknown(&self, known: &[&str]) -> Result<&Config, ConfigError> {
        match self.fields.keys().find(|k| !known.contains(&k.as_str())) {
            None => Ok(self),
            Some(key) if known.is_empty() => Err(ConfigError(format!(
                "unknown config key {key:?}: this policy takes no options"
            ))),
            Some(key) => Err(ConfigError(format!(
                "unknown config key {key:?} (known keys: {})",
                known.join(", ")
            ))),
        }
    }

    /// The number at `key`, if present.
    pub fn f64(&self, key: &str) -> Result<Option<f64>, ConfigError> {
        self.typed(key, "a number", Value::as_f64)
    }

    /// The non-negative integer at `key` that fits a `u32`, if present.
    pub fn u32(&self, key: &str) -> Result<Option<u32>, ConfigError> {
        self.typed(key, "an integer in 0..=4294967295", |v| {
            v.as_u64().and_then(|n| u32::try_from(n).ok())
        })
    }

    /// The boolean at `key`, if present.
    pub fn bool(&self, key: &str) -> Result<Option<bool>, ConfigError> {
        self.typed(key, "true or false", Value::as_bool)
    }

    /// The string at `key`, if present.
    pub fn str(&self, key: &str) -> Result<Option<&str>, ConfigError> {
        self.typed(key, "a string", Value::as_str)
    }

    /// The object at `key` (e.g. a map of names to settings), if present.
    pub fn object(&self, key: &str) -> Result<Option<&Map<String, Value>>, ConfigError> {
        self.typed(key, "an object", Value::as_object)
    }

    fn typed<'a, T>(
        &'a self,
        key: &str,
        expected: &str,
        read: impl FnOnce(&'a Value) -> Option<T>,
    ) -> Result<Option<T>, ConfigError> {
        let Some(value) = self.fields.get(key) else {
            return Ok(None);
        };
        read(value).map(Some).ok_or_else(|| {
            ConfigError(format!(
                "config key {key:?} must be {expected}, got {value}"
            ))
        })
    }
}

fn kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_config_is_an_empty_object() {
        assert_eq!(Config::parse("").unwrap(), Config::parse("{}").unwrap());
        assert_eq!(Config::parse(" {} ").unwrap().f64("x"), Ok(None));
    }

    #[test]
    fn typed_getters_read_and_reject() {
        let c = Config::parse(r#"{"f": 0.5, "n": 3, "b": true, "s": "hi"}"#).unwrap();
        assert_eq!(c.f64("f"), Ok(Some(0.5)));
        assert_eq!(c.f64("n"), Ok(Some(3.0)));
        assert_eq!(c.u32("n"), Ok(Some(3)));
        assert_eq!(c.bool("b"), Ok(Some(true)));
        assert_eq!(c.str("s"), Ok(Some("hi")));
        let err = c.f64("s").unwrap_err().to_string();
        assert_eq!(err, r#"config key "s" must be a number, got "hi""#);
        assert!(c.u32("f").is_err());
    }

    #[test]
    fn non_objects_and_bad_json_are_refused() {
        assert_eq!(
            Config::parse("[1]").unwrap_err().to_string(),
            "config must be a JSON object, got an array"
        );
        assert!(
            Config::parse("{")
                .unwrap_err()
                .to_string()
                .starts_with("config is not valid JSON")
        );
    }

    #[test]
    fn unknown_keys_are_named() {
        let c = Config::parse(r#"{"pd_balance": 0.1}"#).unwrap();
        assert_eq!(
            c.deny_unknown(&["pd_balance_factor"])
                .unwrap_err()
                .to_string(),
            r#"unknown config key "pd_balance" (known keys: pd_balance_factor)"#
        );
        assert!(c.deny_unknown(&["pd_balance"]).is_ok());
        assert!(
            c.deny_unknown(&[])
                .unwrap_err()
                .to_string()
                .contains("takes no options")
        );
    }
}
