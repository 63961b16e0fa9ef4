//! Golden tests, in the manner of Spin's manifest `tests/ui`: each
//! `host/router/tests/ui/config/<case>.toml` is a config file the router must refuse, and
//! `<case>.err` the exact error it gives, naming the key and line. The cases run with
//! `--config tests/ui/config/<case>.toml` (paths relative to the crate, as a user's would be)
//! and `--plugins` a fresh directory holding `disagg.wasm` and `round-robin.wasm`, written
//! `<plugins>` in the `.err` files. After an intended change, `SWITCHYARD_BLESS=1` rewrites the
//! `.err` files that differ and still fails, naming each one: review them with `git diff`, then
//! run again without it. A blessing run never passes, and never runs in CI (`CI` set).

use std::path::{Path, PathBuf};

use super::*;

const CASES: &str = "tests/ui/config";

/// Every `.toml` case, in name order.
fn cases() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join(CASES);
    let mut cases: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| entry.expect("readable dir entry").path())
        .filter(|path| path.extension().is_some_and(|e| e == "toml"))
        .map(|path| Path::new(CASES).join(path.file_name().expect("a file name")))
        .collect();
    cases.sort();
    cases
}

/// What the router says about `case`: its error, or that it accepted it (a failure).
fn refusal(case: &Path, plugins: &Path) -> Result<String, String> {
    let args = ServeArgs {
        config: Some(case.to_owned()),
        router: RouterArgs {
            plugins: Some(plugins.to_owned()),
            ..RouterArgs::default()
        },
        ..ServeArgs::default()
    };
    match Config::from_args(&args) {
        Ok(_) => Err(format!(
            "{}: accepted, but it is meant to be refused",
            case.display()
        )),
        Err(e) => Ok(format!("{e}\n").replace(&plugins.display().to_string(), "<plugins>")),
    }
}

#[test]
fn golden_config_errors() {
    let bless = std::env::var_os("SWITCHYARD_BLESS").is_some();
    assert!(
        !(bless && std::env::var_os("CI").is_some()),
        "SWITCHYARD_BLESS is set in CI: goldens are blessed by a person, never by CI"
    );
    // Relative case paths, as a user gives them, resolve from the crate (cargo runs tests
    // there); checked rather than assumed.
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    assert_eq!(
        std::env::current_dir()
            .expect("a working directory")
            .canonicalize()
            .ok(),
        crate_dir.canonicalize().ok(),
        "the golden test runs from the crate directory"
    );
    let plugins = plugins_with("disagg");
    std::fs::write(plugins.path().join("round-robin.wasm"), b"\0asm").expect("write");
    let cases = cases();
    assert!(
        cases.len() >= 30,
        "expected the full golden set, found {}",
        cases.len()
    );
    let mut failures = Vec::new();
    for case in &cases {
        let actual = match refusal(case, plugins.path()) {
            Ok(error) => error,
            Err(accepted) => {
                failures.push(accepted);
                continue;
            }
        };
        let expected_path = case.with_extension("err");
        let expected = std::fs::read_to_string(&expected_path).unwrap_or_default();
        if expected == actual {
            continue;
        }
        if bless {
            std::fs::write(&expected_path, &actual).expect("writable");
        }
        failures.push(format!(
            "{}:\n  expected: {expected}  actual:   {actual}",
            case.display()
        ));
    }
    let verdict = if bless {
        "rewritten (SWITCHYARD_BLESS): review them with `git diff`, then run again without it"
    } else {
        "differ from their .err files (after an intended change: SWITCHYARD_BLESS=1, then review the diff)"
    };
    assert!(
        failures.is_empty(),
        "{} golden config errors {verdict}:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
