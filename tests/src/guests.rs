//! Guest components built from source when a test first needs them, so a bare
//! `cargo test -p <crate>` works without a make target first (as wasmtime builds its test
//! programs). Builds go to a target directory of their own, `target/guest-build` (the one
//! `make plugins guests` uses too), so the nested cargo never waits on the lock of the build
//! that is running the tests, and a lock file serialises test processes building at once.
//! Python and JavaScript examples need their toolchains: for those, `make examples`.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

use crate::checkout;

const WASM_TARGET: &str = "wasm32-wasip2";

/// A guest crate of this workspace, and the component file its build writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Guest {
    /// The cargo package (`-p`).
    pub package: &'static str,
    /// The component's file name under `target/guest-build/wasm32-wasip2/guest/`.
    pub artifact: &'static str,
}

impl Guest {
    /// The built-in disaggregation policy (`plugins/disagg.wasm`).
    pub const DISAGG: Guest = Guest::new("disagg-policy", "disagg_policy.wasm");
    /// The built-in round-robin policy (`plugins/round-robin.wasm`).
    pub const ROUND_ROBIN: Guest = Guest::new("round-robin-policy", "round_robin_policy.wasm");
    /// A policy that misbehaves on request (loops, traps, bloats, bad plans).
    pub const MISBEHAVE: Guest = Guest::new("misbehave-policy", "misbehave_policy.wasm");
    /// A component of another world than `policy`.
    pub const OTHER_WORLD: Guest = Guest::new("other-world", "other-world.wasm");
    /// A policy of the `stateful-policy` world.
    pub const STATEFUL: Guest = Guest::new("stateful-policy", "stateful_policy.wasm");
    /// A policy whose `init` refuses its config.
    pub const INIT_FAILS: Guest = Guest::new("init-fails-policy", "init_fails_policy.wasm");
    /// The Rust example policy.
    pub const PRIORITY_RUST: Guest =
        Guest::new("priority-rust-policy", "priority_rust_policy.wasm");

    const fn new(package: &'static str, artifact: &'static str) -> Self {
        Guest { package, artifact }
    }
}

/// Packages built by this process already (cargo is not asked twice).
static BUILT: Mutex<Option<HashSet<&'static str>>> = Mutex::new(None);

/// The path of `guest`'s component, built from source first if this process has not yet.
pub fn guest(guest: Guest) -> PathBuf {
    let target_dir = checkout().join("target/guest-build");
    let path = target_dir
        .join(WASM_TARGET)
        .join("guest")
        .join(guest.artifact);
    let mut built = BUILT.lock().unwrap_or_else(|e| e.into_inner());
    if built.get_or_insert_with(HashSet::new).insert(guest.package) {
        build(guest.package, &target_dir);
    }
    assert!(
        path.is_file(),
        "building {} did not write {}",
        guest.package,
        path.display()
    );
    path
}

/// The bytes of `guest`'s component; see [`guest`].
pub fn guest_bytes(guest: Guest) -> Vec<u8> {
    let path = self::guest(guest);
    std::fs::read(&path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}

/// `plugins/` of this checkout with the built-in policies in it, built from source and
/// installed (by rename, and only when their bytes changed, as `make plugins` does: a running
/// router watching the directory never reads half a file).
pub fn plugins_dir() -> PathBuf {
    // One installer at a time in this process (the temporary names are per process).
    static INSTALLING: Mutex<()> = Mutex::new(());
    let _turn = INSTALLING.lock().unwrap_or_else(|e| e.into_inner());
    let dir = checkout().join("plugins");
    for (built, name) in [
        (Guest::DISAGG, "disagg.wasm"),
        (Guest::ROUND_ROBIN, "round-robin.wasm"),
    ] {
        install(&guest(built), &dir.join(name));
    }
    dir
}

fn install(from: &Path, to: &Path) {
    let bytes = std::fs::read(from).unwrap_or_else(|e| panic!("read {}: {e}", from.display()));
    if std::fs::read(to).is_ok_and(|old| old == bytes) {
        return;
    }
    let tmp = to.with_file_name(format!(
        ".{}.{}.tmp",
        to.file_name().and_then(|n| n.to_str()).unwrap_or("guest"),
        std::process::id()
    ));
    std::fs::write(&tmp, &bytes).unwrap_or_else(|e| panic!("write {}: {e}", tmp.display()));
    std::fs::rename(&tmp, to).unwrap_or_else(|e| panic!("install {}: {e}", to.display()));
}

/// `cargo build --target wasm32-wasip2 --profile guest -p PACKAGE`, holding a lock file so two
/// test processes never build at once.
fn build(package: &str, target_dir: &Path) {
    std::fs::create_dir_all(target_dir)
        .unwrap_or_else(|e| panic!("create {}: {e}", target_dir.display()));
    let lock_path = target_dir.join(".switchyard-tests.lock");
    let lock = std::fs::File::create(&lock_path)
        .unwrap_or_else(|e| panic!("create {}: {e}", lock_path.display()));
    lock.lock()
        .unwrap_or_else(|e| panic!("lock {}: {e}", lock_path.display()));
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let output = Command::new(cargo)
        .current_dir(checkout())
        .args([
            "build",
            "--quiet",
            "--target",
            WASM_TARGET,
            "--profile",
            "guest",
            "-p",
            package,
        ])
        .arg("--target-dir")
        .arg(target_dir)
        // The outer build's settings are for the host, not for guests.
        .env_remove("CARGO_TARGET_DIR")
        .env_remove("CARGO_BUILD_TARGET")
        .env_remove("RUSTFLAGS")
        .env_remove("CARGO_ENCODED_RUSTFLAGS")
        .output()
        .unwrap_or_else(|e| panic!("cannot run cargo to build {package}: {e}"));
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        if stderr.contains("target may not be installed") {
            panic!(
                "the {WASM_TARGET} Rust target is not installed, so guest {package} cannot be \
                 built: run `make setup` (it runs `rustup target add {WASM_TARGET}`)"
            );
        }
        panic!("building guest {package} failed:\n{stderr}");
    }
}
