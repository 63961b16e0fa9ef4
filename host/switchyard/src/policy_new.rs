//! `switchyard policy new --lang rust|python|js NAME`: write a policy project that builds as is,
//! from templates compiled into the binary (`templates/`), so the first policy takes minutes.
//!
//! Each project starts as MLC-LLM's default router and carries its build, test and deploy
//! commands in its README. Python and JavaScript projects get a copy of `wit/policy.wit`; the
//! Rust project depends on the SDK of a switchyard checkout (`--sdk`, by default the one this
//! binary was built from).

use std::fmt;
use std::path::{Path, PathBuf};

/// The contract, copied into projects whose toolchain reads WIT itself.
const POLICY_WIT: &str = include_str!("../../../wit/deps/policy@0.2.0/policy.wit");

/// The SDK of the checkout this binary was built from; used when `--sdk` is not given.
const CHECKOUT_SDK: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../sdk");

/// A language with a project template.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Lang {
    Rust,
    Python,
    #[value(alias = "javascript")]
    Js,
}

/// `switchyard policy new` flags.
#[derive(Debug, Clone, clap::Args)]
pub struct NewArgs {
    /// The policy's name: lower-case letters, digits and `-`, starting with a letter. It names
    /// the project directory and the component (`plugins/NAME.wasm`, `--policy NAME`).
    pub name: String,
    /// The language of the project.
    #[arg(long, value_enum)]
    pub lang: Lang,
    /// Where to create the project directory NAME.
    #[arg(long, default_value = ".")]
    pub dir: PathBuf,
    /// The switchyard SDK (`sdk/` of a switchyard checkout) a Rust project depends on.
    #[arg(long)]
    pub sdk: Option<PathBuf>,
}

/// Why no project was written.
#[derive(Debug, thiserror::Error)]
pub enum NewError {
    #[error("policy name {name:?}: {reason}")]
    Name { name: String, reason: &'static str },
    #[error("{} already exists; choose another name or --dir", path.display())]
    Exists { path: PathBuf },
    #[error(
        "the switchyard SDK is not at {}: pass --sdk PATH (the sdk/ directory of a switchyard checkout)",
        path.display()
    )]
    NoSdk { path: PathBuf },
    #[error("cannot write {}: {source}", path.display())]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// What was written, for the message that tells the author what to do next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewProject {
    pub name: String,
    pub lang: Lang,
    pub dir: PathBuf,
    /// Paths inside `dir`.
    pub files: Vec<PathBuf>,
}

impl fmt::Display for NewProject {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "created {}:", self.dir.display())?;
        for file in &self.files {
            writeln!(f, "  {}", file.display())?;
        }
        let build = match self.lang {
            Lang::Rust => "cargo test && cargo build --target wasm32-wasip2 --profile guest".into(),
            Lang::Python => format!(
                "componentize-py -d wit/policy.wit -w policy componentize -p src app -o {}.wasm",
                self.name
            ),
            Lang::Js => "npm install && node build.mjs".into(),
        };
        write!(
            f,
            "next: cd {} && {build}\nREADME.md there says how to test and deploy it.",
            self.dir.display()
        )
    }
}

/// Write the project for `args` into `args.dir/NAME`, which must not exist yet.
pub fn scaffold(args: &NewArgs) -> Result<NewProject, NewError> {
    check_name(&args.name)?;
    let dir = args.dir.join(&args.name);
    if dir.exists() {
        return Err(NewError::Exists { path: dir });
    }
    let vars = Vars::new(&args.name, args.lang, args.sdk.as_deref())?;
    let files = template(args.lang);
    for (relative, text) in &files {
        write_file(&dir.join(relative), &vars.render(text))?;
    }
    Ok(NewProject {
        name: args.name.clone(),
        lang: args.lang,
        dir,
        files: files.iter().map(|(path, _)| PathBuf::from(path)).collect(),
    })
}

/// A name that is at once a crate name, a file stem the router accepts and a directory name.
fn check_name(name: &str) -> Result<(), NewError> {
    let reason = if !name.starts_with(|c: char| c.is_ascii_lowercase()) {
        Some("must start with a lower-case letter")
    } else if !name
        .chars()
        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
    {
        Some("may hold only lower-case letters, digits and `-`")
    } else if name.ends_with('-') || name.len() > 64 {
        Some("must not end with `-` or be longer than 64 characters")
    } else {
        None
    };
    match reason {
        Some(reason) => Err(NewError::Name {
            name: name.to_owned(),
            reason,
        }),
        None => Ok(()),
    }
}

/// The project's files: (path inside the project, template text).
fn template(lang: Lang) -> Vec<(&'static str, &'static str)> {
    match lang {
        Lang::Rust => vec![
            ("Cargo.toml", include_str!("templates/rust/Cargo.toml")),
            ("src/lib.rs", include_str!("templates/rust/lib.rs")),
            ("README.md", include_str!("templates/rust/README.md")),
            (".gitignore", include_str!("templates/rust/gitignore")),
        ],
        Lang::Python => vec![
            ("src/app.py", include_str!("templates/python/app.py")),
            ("wit/policy.wit", POLICY_WIT),
            ("README.md", include_str!("templates/python/README.md")),
            (".gitignore", include_str!("templates/python/gitignore")),
        ],
        Lang::Js => vec![
            ("package.json", include_str!("templates/js/package.json")),
            // One build script for the example and every new project.
            (
                "build.mjs",
                include_str!("../../../examples/slo-js/build.mjs"),
            ),
            ("src/policy.js", include_str!("templates/js/policy.js")),
            ("wit/policy.wit", POLICY_WIT),
            ("README.md", include_str!("templates/js/README.md")),
            (".gitignore", include_str!("templates/js/gitignore")),
        ],
    }
}

/// The `{{…}}` placeholders of the templates.
struct Vars {
    /// The policy name as given: `my-policy`.
    name: String,
    /// The Rust library name, which names the built `.wasm`: `my_policy`.
    lib_name: String,
    /// The Rust type implementing `Policy`: `MyPolicy`.
    type_name: String,
    /// The SDK path as a TOML string (quoted and escaped); only Rust projects need it.
    sdk: String,
}

impl Vars {
    fn new(name: &str, lang: Lang, sdk: Option<&Path>) -> Result<Vars, NewError> {
        let sdk = match lang {
            Lang::Rust => toml_string(&sdk_dir(sdk)?),
            Lang::Python | Lang::Js => String::new(),
        };
        Ok(Vars {
            name: name.to_owned(),
            lib_name: name.replace('-', "_"),
            type_name: name
                .split('-')
                .map(|word| {
                    let mut chars = word.chars();
                    chars
                        .next()
                        .map(|first| first.to_ascii_uppercase().to_string() + chars.as_str())
                        .unwrap_or_default()
                })
                .collect(),
            sdk,
        })
    }

    fn render(&self, template: &str) -> String {
        template
            .replace("{{name}}", &self.name)
            .replace("{{lib_name}}", &self.lib_name)
            .replace("{{type_name}}", &self.type_name)
            .replace("{{sdk}}", &self.sdk)
    }
}

/// The SDK directory, absolute, so the project builds from wherever it is moved to.
fn sdk_dir(given: Option<&Path>) -> Result<PathBuf, NewError> {
    let path = given.unwrap_or(Path::new(CHECKOUT_SDK));
    if !path.join("Cargo.toml").is_file() {
        return Err(NewError::NoSdk {
            path: path.to_owned(),
        });
    }
    path.canonicalize().map_err(|_| NewError::NoSdk {
        path: path.to_owned(),
    })
}

fn toml_string(path: &Path) -> String {
    toml::Value::String(path.display().to_string()).to_string()
}

fn write_file(path: &Path, text: &str) -> Result<(), NewError> {
    let write = || {
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)?;
        }
        std::fs::write(path, text)
    };
    write().map_err(|source| NewError::Write {
        path: path.to_owned(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(name: &str, lang: Lang, dir: &Path) -> NewArgs {
        NewArgs {
            name: name.to_owned(),
            lang,
            dir: dir.to_owned(),
            sdk: None,
        }
    }

    #[test]
    fn names_must_be_crate_names_and_file_stems() {
        for good in ["p", "my-policy", "slo2"] {
            assert!(check_name(good).is_ok(), "{good}");
        }
        for bad in ["", "My", "2fast", "a_b", "a.b", "../x", "a-", "a/b"] {
            assert!(
                matches!(check_name(bad), Err(NewError::Name { .. })),
                "{bad}"
            );
        }
    }

    #[test]
    fn placeholders_are_derived_from_the_name() {
        let vars = Vars::new("my-cool-policy", Lang::Js, None).expect("no sdk needed");
        assert_eq!(
            vars.render("{{name}} {{lib_name}} {{type_name}}"),
            "my-cool-policy my_cool_policy MyCoolPolicy"
        );
    }

    #[test]
    fn every_placeholder_in_every_template_is_filled() {
        let dir = tempfile::tempdir().expect("temp dir");
        for lang in [Lang::Rust, Lang::Python, Lang::Js] {
            let project = scaffold(&args("p", lang, &dir.path().join(format!("{lang:?}"))))
                .expect("scaffold");
            for file in &project.files {
                let text = std::fs::read_to_string(project.dir.join(file)).expect("written");
                assert!(!text.contains("{{"), "{lang:?} {}", file.display());
            }
        }
    }

    #[test]
    fn an_existing_directory_is_never_overwritten() {
        let dir = tempfile::tempdir().expect("temp dir");
        std::fs::create_dir(dir.path().join("taken")).expect("mkdir");
        let result = scaffold(&args("taken", Lang::Python, dir.path()));
        assert!(matches!(result, Err(NewError::Exists { .. })), "{result:?}");
        assert_eq!(
            std::fs::read_dir(dir.path().join("taken"))
                .expect("still there")
                .count(),
            0
        );
    }

    #[test]
    fn a_rust_project_without_an_sdk_is_refused() {
        let dir = tempfile::tempdir().expect("temp dir");
        let mut a = args("p", Lang::Rust, dir.path());
        a.sdk = Some(dir.path().join("nowhere"));
        assert!(matches!(scaffold(&a), Err(NewError::NoSdk { .. })));
        assert!(!dir.path().join("p").exists(), "nothing written");
    }
}
