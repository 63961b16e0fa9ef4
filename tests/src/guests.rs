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
    /// The built-in KV-cache-aware policy (`plugins/kv-aware.wasm`).
    pub const KV_AWARE: Guest = Guest::new("kv-aware-policy", "kv_aware_policy.wasm");
    /// A policy that misbehaves on request (loops, traps, bloats, bad plans).
    pub const MISBEHAVE: Guest = Guest::new("misbehave-policy", "misbehave_policy.wasm");
    /// A component of another world than `policy`.
    pub const OTHER_WORLD: Guest = Guest::new("other-world", "other-world.wasm");
    /// A policy of the `stateful-policy` world.
    pub const STATEFUL: Guest = Guest::new("stateful-policy", "stateful_policy.wasm");
    /// A policy that routes by a request's priority, tenant and deadline.
    pub const FLOW_ROUTE: Guest = Guest::new("flow-route-policy", "flow_route_policy.wasm");
    /// A policy whose `init` refuses its config.
    pub const INIT_FAILS: Guest = Guest::new("init-fails-policy", "init_fails_policy.wasm");
    /// A policy built against the frozen `switchyard:policy@0.1.0` contract.
    pub const V0_1_0: Guest = Guest::new("policy-v0-1-0", "policy_v0_1_0.wasm");
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
        (Guest::KV_AWARE, "kv-aware.wasm"),
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

/// `component` with `copies` instances of the core module `module_wat` appended at its top
/// level: a well-formed component that exports what `component` exports, and instantiates the
/// extra modules whenever it is instantiated. For the sandbox's limits on what one instance
/// may create (memories, tables, core instances, table elements, memory in all): no toolchain
/// writes such a component, but nothing stops a hand-made one.
pub fn with_extra_core_instances(component: &[u8], module_wat: &str, copies: u32) -> Vec<u8> {
    use wasm_encoder::{ComponentSectionId, InstanceSection, ModuleArg, RawSection};

    let module = wat::parse_str(module_wat)
        .unwrap_or_else(|e| panic!("the extra module is not valid text: {e}"));
    // The new module's index: after every core module the component defines at its top level.
    let index = top_level_core_modules(component);
    let mut extra = wasm_encoder::Component::new();
    extra.section(&RawSection {
        id: ComponentSectionId::CoreModule as u8,
        data: &module,
    });
    let mut instances = InstanceSection::new();
    for _ in 0..copies {
        instances.instantiate(index, std::iter::empty::<(&str, ModuleArg)>());
    }
    extra.section(&instances);
    let extra = extra.finish();
    // Sections may come in any order: appending them (without the header) keeps every index
    // the original sections use.
    const HEADER: usize = 8;
    let mut out = component.to_vec();
    out.extend_from_slice(&extra[HEADER..]);
    out
}

/// Core modules defined at the top level of `component` (not inside nested components).
fn top_level_core_modules(component: &[u8]) -> u32 {
    use wasmparser::{Parser, Payload};

    let mut depth = 0u32;
    let mut modules = 0;
    for payload in Parser::new(0).parse_all(component) {
        match payload.unwrap_or_else(|e| panic!("not a valid component: {e}")) {
            Payload::ModuleSection { .. } => {
                modules += u32::from(depth == 0);
                depth += 1;
            }
            Payload::ComponentSection { .. } => depth += 1,
            Payload::End(_) => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    modules
}
