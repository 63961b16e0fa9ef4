//! Logging through the router: the host import `log` inside a component, stderr natively
//! (wit-bindgen's import stubs panic outside wasm, and native tests should still print).

use crate::types::Level;

/// Write `message` to the router's log at `level`, tagged with the policy's name.
pub fn log(level: Level, message: &str) {
    #[cfg(target_arch = "wasm32")]
    crate::bindings::log(level, message);
    #[cfg(not(target_arch = "wasm32"))]
    eprintln!("[policy {}] {message}", level_name(level));
}

#[cfg(not(target_arch = "wasm32"))]
fn level_name(level: Level) -> &'static str {
    match level {
        Level::Trace => "trace",
        Level::Debug => "debug",
        Level::Info => "info",
        Level::Warn => "warn",
        Level::Error => "error",
    }
}

/// [`log`] at `debug`.
pub fn log_debug(message: &str) {
    log(Level::Debug, message);
}

/// [`log`] at `info`.
pub fn log_info(message: &str) {
    log(Level::Info, message);
}

/// [`log`] at `warn`.
pub fn log_warn(message: &str) {
    log(Level::Warn, message);
}

/// [`log`] at `error`.
pub fn log_error(message: &str) {
    log(Level::Error, message);
}
