//! `switchyard policy new` writes projects that build as they are: each language's project is
//! scaffolded into a temporary directory, built with its own toolchain into a component (the
//! Rust one also runs its native tests), and that component passes `switchyard policy check`
//! and plans MLC's default flow.
//!
//! Rust reuses the workspace's target directory, so only the new crate compiles. Python and
//! JavaScript need the toolchains `make examples-toolchains` installs (`.venv-guests`,
//! `examples/slo-js/node_modules`; `make test` installs them first): without them those tests
//! fail and say so, since passing would claim a build that never ran.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::{Mutex, MutexGuard, PoisonError};

use serde_json::{Value, json};

/// Held by each test for its whole run. A build saturates both CI cores, and a component
/// instantiated meanwhile (in `policy check`) can overrun the router's 50 ms call deadline:
/// the tests take turns instead.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn take_turn() -> MutexGuard<'static, ()> {
    // A failed test poisons the lock; the next one still runs.
    ONE_AT_A_TIME.lock().unwrap_or_else(PoisonError::into_inner)
}

fn checkout() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .expect("the checkout")
}

fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| checkout().join("target"))
}

/// Fail the test unless `marker`, which `make examples-toolchains` installs, is there.
fn assert_installed(marker: &Path) {
    assert!(
        marker.is_file(),
        "{} is missing: run `make examples-toolchains` first",
        marker.display()
    );
}

/// Run `command`, failing the test with its output when it does not succeed.
fn run(command: &mut Command) -> Output {
    let output = command
        .output()
        .unwrap_or_else(|e| panic!("cannot run {command:?}: {e}"));
    assert!(
        output.status.success(),
        "{command:?} failed ({}):\n{}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

fn switchyard() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_switchyard"));
    // Compiled components are cached under target/ (never the user's cache directory), shared
    // with the example tests: the Python and JavaScript runtimes take seconds to compile.
    command.env("SWITCHYARD_CACHE", target_dir().join("examples/compiled"));
    command
}

/// `switchyard policy new --lang LANG NAME --dir DIR`; returns the project directory.
fn scaffold(lang: &str, name: &str, dir: &Path) -> PathBuf {
    let out = run(switchyard()
        .args(["policy", "new", "--lang", lang, name, "--dir"])
        .arg(dir));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let project = dir.join(name);
    assert!(
        stdout.contains(&format!("created {}", project.display())),
        "{stdout}"
    );
    project
}

/// The built component passes `policy check` and, with three idle-ish endpoints, plans
/// prefill on 0 and decode on the least-loaded other endpoint, 2.
fn assert_checks_and_plans_mlc_default(component: &Path) {
    let out = run(switchyard().args(["policy", "check"]).arg(component));
    let report = String::from_utf8_lossy(&out.stdout);
    assert!(report.contains("valid plans"), "{report}");
    let out = run(switchyard().args(["policy", "plan"]).arg(component).args([
        "--prompt-len",
        "300",
        "--endpoints",
        "3",
        "--roles",
        "any,any,any",
        "--in-flight",
        "0,5,2",
    ]));
    let plan: Value = serde_json::from_slice(&out.stdout).expect("plan JSON");
    let steps = plan["steps"].as_array().expect("steps");
    let shape: Vec<(&str, &Value, &Value)> = steps
        .iter()
        .map(|s| {
            (
                s["step"].as_str().unwrap_or_default(),
                &s["prefill"],
                &s["decode"],
            )
        })
        .collect();
    assert_eq!(
        shape,
        [
            ("prep-recv", &Value::Null, &json!(2)),
            ("remote-send", &json!(0), &json!(2)),
            ("start-generate", &Value::Null, &json!(2)),
        ],
        "{plan}"
    );
}

#[test]
fn a_new_rust_policy_builds_into_a_component_that_passes_policy_check() {
    let _turn = take_turn();
    let dir = tempfile::tempdir().expect("temp dir");
    let project = scaffold("rust", "scaffolded-rust", dir.path());
    let target = target_dir();
    // The project's own native tests first, as its README tells the author to.
    run(Command::new(env!("CARGO"))
        .args(["test", "--offline"])
        .env("CARGO_TARGET_DIR", &target)
        .current_dir(&project));
    run(Command::new(env!("CARGO"))
        .args([
            "build",
            "--offline",
            "--target",
            "wasm32-wasip2",
            "--profile",
            "guest",
        ])
        .env("CARGO_TARGET_DIR", &target)
        .current_dir(&project));
    assert_checks_and_plans_mlc_default(&target.join("wasm32-wasip2/guest/scaffolded_rust.wasm"));
}

#[test]
fn a_new_python_policy_builds_into_a_component_that_passes_policy_check() {
    let _turn = take_turn();
    let componentize_py = checkout().join(".venv-guests/bin/componentize-py");
    assert_installed(&componentize_py);
    let dir = tempfile::tempdir().expect("temp dir");
    let project = scaffold("python", "scaffolded-python", dir.path());
    run(Command::new(componentize_py)
        .args(["-d", "wit/policy.wit", "-w", "policy", "componentize"])
        .args(["-p", "src", "app", "-o", "scaffolded-python.wasm"])
        .current_dir(&project));
    assert_checks_and_plans_mlc_default(&project.join("scaffolded-python.wasm"));
}

#[test]
fn a_new_js_policy_builds_into_a_component_that_passes_policy_check() {
    let _turn = take_turn();
    let node_modules = checkout().join("examples/slo-js/node_modules");
    assert_installed(&node_modules.join(".installed"));
    let dir = tempfile::tempdir().expect("temp dir");
    let project = scaffold("js", "scaffolded-js", dir.path());
    // The example's installed packages stand in for `npm install` (same pinned versions), so
    // the test needs no network.
    std::os::unix::fs::symlink(&node_modules, project.join("node_modules"))
        .expect("link node_modules");
    run(Command::new("node").arg("build.mjs").current_dir(&project));
    assert_checks_and_plans_mlc_default(&project.join("scaffolded-js.wasm"));
}
