//! How a table of settings is declared: [`settings!`] takes one entry per setting (its doc
//! comment, which is its `--help` text, its flag, its file key, its environment variable where
//! it has one, its default and its check) and writes from it the clap arguments, the file's
//! keys, and the resolution: the flag, else the environment variable, else the file, else the
//! default, each value kept with where it came from and checked there.

use std::time::Duration;

use super::error::{ConfigError, Problem};
use super::source::Sourced;

/// Declares a table of settings. Out of
///
/// ```ignore
/// settings! {
///     /// The args' doc.
///     args RouterArgs, keys RouterKeys, resolved RouterSettings, table "";
///     /// Its --help text.
///     #[arg(value_parser = humantime::parse_duration)]
///     field: Option<Duration> => Duration {
///         flag: "field", key: "field", env: "VAR", default: EXPR, file: FN, check: FN,
///     }
/// }
/// ```
///
/// (`env`, `default`, `file` and `check` optional, in that order) come:
/// - `RouterArgs`, clap's arguments: `field` with the entry's attributes and `long = flag`;
///   its type says how "not given" reads (see [`Given`]);
/// - `RouterKeys`, the file's values for the table's keys (`table` names a TOML table, or is
///   empty for the top level), each read by `file` (default: [`FileValue::from_toml`]);
/// - `RouterArgs::resolve(RouterKeys) -> RouterSettings`: each `field` a [`Sourced`] value
///   (`Option<Sourced<_>>` where there is no default, for the caller to derive one), `check`ed.
macro_rules! settings {
    (
        $(#[$args_meta:meta])*
        args $Args:ident, keys $Keys:ident, resolved $Settings:ident, table $table:literal;
        $(
            $(#[$meta:meta])*
            $field:ident: $flag_ty:ty => $ty:ty {
                flag: $flag:literal,
                key: $key:literal,
                $(env: $env:literal,)?
                $(default: $default:expr,)?
                $(file: $file:expr,)?
                $(check: $check:expr,)?
            }
        )*
    ) => {
        $(#[$args_meta])*
        #[derive(Debug, Clone, Default, clap::Args)]
        pub struct $Args {
            $(
                $(#[$meta])*
                #[arg(long = $flag $(, env = $env)?)]
                pub $field: $flag_ty,
            )*
        }

        /// The file's values for these settings, each with its line.
        #[derive(Debug, Default)]
        pub(super) struct $Keys {
            $($field: Option<$crate::config::source::Sourced<$ty>>,)*
        }

        impl $Keys {
            pub(super) const KEYS: &[&str] = &[$($key),*];

            /// Reads `key`'s value if the key is one of these settings; hands it back if not.
            pub(super) fn take<'i>(
                &mut self,
                key: &toml::Spanned<toml::de::DeString<'i>>,
                value: toml::Spanned<toml::de::DeValue<'i>>,
                file: &$crate::config::file::FileText,
            ) -> Result<Option<toml::Spanned<toml::de::DeValue<'i>>>, $crate::config::ConfigError> {
                let name: &str = key.get_ref();
                match name {
                    $($key => {
                        let read = settings!(@file $ty $(, $file)?);
                        self.$field = Some(file.value($table, key, value, read)?);
                    })*
                    _ => return Ok(Some(value)),
                }
                Ok(None)
            }
        }

        /// Every setting of the table with where its value came from, checked.
        #[derive(Debug)]
        pub(super) struct $Settings {
            $(pub(super) $field: settings!(@resolved $ty $(, $default)?),)*
        }

        impl $Args {
            /// Each setting from its flag, else its variable, else the file, else its default.
            pub(super) fn resolve(
                &self,
                file: $Keys,
            ) -> Result<$Settings, $crate::config::ConfigError> {
                use $crate::config::table::Given as _;
                use $crate::config::source::{Source, Sourced};
                $(
                    let given: Option<$ty> = self.$field.given();
                    let given = given
                        .map(|value| {
                            let source = settings!(@source $flag, value $(, $env)?);
                            Sourced::new(value, source)
                        })
                        .or(file.$field);
                    let $field = settings!(@default given, $flag $(, $default)?);
                    $($crate::config::table::Checked::check(&$field, $check)?;)?
                )*
                Ok($Settings { $($field,)* })
            }
        }
    };
    (@resolved $ty:ty) => { Option<$crate::config::source::Sourced<$ty>> };
    (@resolved $ty:ty, $default:expr) => { $crate::config::source::Sourced<$ty> };
    (@default $given:ident, $flag:literal) => { $given };
    (@default $given:ident, $flag:literal, $default:expr) => {
        $given.unwrap_or_else(|| Sourced::new($default, Source::Default($flag)))
    };
    (@source $flag:literal, $value:ident) => { Source::Flag($flag) };
    (@source $flag:literal, $value:ident, $env:literal) => {
        Source::flag_or_env($flag, $env, &$value)
    };
    (@file $ty:ty) => { <$ty as $crate::config::file::FileValue>::from_toml };
    (@file $ty:ty, $file:expr) => { $file };
}

pub(super) use settings;

/// A flag's value if it was given; clap's field types say "not given" three ways.
pub(super) trait Given<T> {
    fn given(&self) -> Option<T>;
}

impl<T: Clone> Given<T> for Option<T> {
    fn given(&self) -> Option<T> {
        self.clone()
    }
}

/// A repeatable flag given at least once replaces the file's list.
impl<T: Clone> Given<Vec<T>> for Vec<T> {
    fn given(&self) -> Option<Vec<T>> {
        (!self.is_empty()).then(|| self.clone())
    }
}

/// A switch (`--no-policy-header`) is given or not.
impl Given<bool> for bool {
    fn given(&self) -> Option<bool> {
        self.then_some(true)
    }
}

/// A resolved setting, with or without a value, put to its check.
pub(super) trait Checked<T> {
    fn check(&self, check: impl Fn(&T) -> Result<(), Problem>) -> Result<(), ConfigError>;
}

impl<T> Checked<T> for Sourced<T> {
    fn check(&self, check: impl Fn(&T) -> Result<(), Problem>) -> Result<(), ConfigError> {
        check(&self.value).map_err(|problem| ConfigError::Invalid {
            at: self.source.clone(),
            problem,
        })
    }
}

impl<T> Checked<T> for Option<Sourced<T>> {
    fn check(&self, check: impl Fn(&T) -> Result<(), Problem>) -> Result<(), ConfigError> {
        self.as_ref().map_or(Ok(()), |sourced| sourced.check(check))
    }
}

/// Counts and limits of which zero would serve nothing.
pub(super) fn at_least_one<T: Default + PartialEq>(value: &T) -> Result<(), Problem> {
    if *value == T::default() {
        return Err(Problem::AtLeast(1));
    }
    Ok(())
}

/// Deadlines, which zero would make expire at once.
pub(super) fn longer_than_zero(value: &Duration) -> Result<(), Problem> {
    if value.is_zero() {
        return Err(Problem::ZeroDuration);
    }
    Ok(())
}

pub(super) fn not_empty<T: AsRef<str>>(value: &T) -> Result<(), Problem> {
    if value.as_ref().is_empty() {
        return Err(Problem::Empty);
    }
    Ok(())
}

/// Text of which spaces alone say nothing (a label selector).
pub(super) fn not_blank<T: AsRef<str>>(value: &T) -> Result<(), Problem> {
    not_empty(&value.as_ref().trim())
}
