//! Test support shared by the end-to-end suite (`tests/e2e`) and the host crates' own tests:
//! reference engines and routers as child processes on loopback ([`EngineProcess`],
//! [`RouterProcess`]), and the guest components tests load, built from source on first use
//! ([`guest`], [`plugins_dir`]).
//!
//! These helpers panic with a message that says what to do: they run only in tests.

mod guests;
mod process;

use std::path::{Path, PathBuf};

pub use guests::{Guest, guest, guest_bytes, plugins_dir, with_extra_core_instances};
pub use process::{EngineProcess, RouterProcess, UpProcess, free_port, switchyard_bin};

/// The root of this checkout.
pub fn checkout() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ lives in the checkout")
        .to_owned()
}
