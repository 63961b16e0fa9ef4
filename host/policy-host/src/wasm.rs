//! All wasmtime configuration lives here ([`WasmEngine`]): one wasmtime `Engine` for every policy, the epoch ticker that
//! bounds each guest call, and the compile cache keyed by the component's sha256.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime};

use parking_lot::Mutex;
use wasmtime::component::Component;
use wasmtime::{Config, Engine};

use super::LoadError;

/// How often the ticker advances the engine's epoch while guest code runs. A deadline is rounded
/// up to whole ticks, so a runaway guest overshoots it by up to a tick plus scheduling delay.
/// Coarse on purpose: every tick wakes a thread, which on a shared VM costs more than the whole
/// policy call it guards, and deadlines are tens of milliseconds.
pub(super) const EPOCH_TICK: Duration = Duration::from_millis(5);

/// Ticks with no guest code running after which the ticker sleeps until the next call.
const IDLE_TICKS: u32 = 20;

/// The wasmtime engine shared by every policy of one `PolicyHost` (not to be confused with an
/// LLM engine: this one compiles and runs policy components).
pub(super) struct WasmEngine {
    engine: Engine,
    cache: CompileCache,
    ticker: Arc<EpochTicker>,
}

impl WasmEngine {
    pub(super) fn new(cache_dir: Option<PathBuf>) -> Result<Self, LoadError> {
        let engine = Engine::new(&config()).map_err(|e| LoadError::Engine {
            reason: format!("{e:#}"),
        })?;
        let ticker = EpochTicker::start(engine.clone())?;
        let cache = CompileCache::new(&engine, cache_dir);
        Ok(WasmEngine {
            engine,
            cache,
            ticker: Arc::new(ticker),
        })
    }

    pub(super) fn engine(&self) -> &Engine {
        &self.engine
    }

    /// A handle that keeps the epoch ticker running. Every policy holds one: a policy may
    /// outlive its `PolicyHost`, and without ticks its deadline would never fire.
    pub(super) fn ticker(&self) -> Arc<EpochTicker> {
        Arc::clone(&self.ticker)
    }

    /// The compiled component for `bytes` (whose sha256 is `sha256`), compiling only when
    /// neither the in-memory nor the on-disk cache holds it.
    pub(super) fn component(
        &self,
        name: &str,
        sha256: &str,
        bytes: &[u8],
    ) -> Result<Component, LoadError> {
        self.cache.get_or_compile(&self.engine, name, sha256, bytes)
    }

    /// How many times this engine really compiled a component (cache misses).
    #[cfg(test)]
    pub(super) fn compiles(&self) -> u64 {
        self.cache.compiles.load(Ordering::Relaxed)
    }
}

/// Epoch interruption (cheap: a counter compared at loop heads and function entries) rather than
/// fuel (which slows every instruction); no fuel. Concurrency support is off: policies are plain
/// synchronous calls and it makes each call several times cheaper.
fn config() -> Config {
    let mut config = Config::new();
    config.wasm_component_model(true);
    config.epoch_interruption(true);
    config.concurrency_support(false);
    config
}

// === impl EpochTicker ===

/// A thread that increments the engine's epoch every [`EPOCH_TICK`] while guest code runs (see
/// [`EpochTicker::running`]) and sleeps once none has for [`IDLE_TICKS`], so an idle router
/// spends nothing on it. Stopped (and joined) on drop of the last handle, so dropping a
/// `PolicyHost` and its policies leaves no thread behind.
pub(super) struct EpochTicker {
    shared: Arc<TickerShared>,
    thread: Option<JoinHandle<()>>,
}

#[derive(Default)]
struct TickerShared {
    stop: AtomicBool,
    /// Guest calls (and instantiations) running now.
    running: AtomicUsize,
    /// The ticker is asleep, or about to be: the next call must wake it.
    asleep: AtomicBool,
}

/// Counts one stretch of guest code as running until dropped.
pub(super) struct Running<'a>(&'a TickerShared);

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.0.running.fetch_sub(1, Ordering::SeqCst);
    }
}

impl EpochTicker {
    fn start(engine: Engine) -> Result<Self, LoadError> {
        let shared = Arc::new(TickerShared::default());
        let ticker = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("policy-epoch".into())
            .spawn(move || ticker.run(&engine))
            .map_err(|e| LoadError::Engine {
                reason: format!("cannot start the epoch ticker thread: {e}"),
            })?;
        Ok(EpochTicker {
            shared,
            thread: Some(thread),
        })
    }

    /// Guest code is about to run under an epoch deadline: keep the epoch advancing until the
    /// returned guard drops, waking the ticker if it sleeps (one atomic swap when it does not).
    pub(super) fn running(&self) -> Running<'_> {
        self.shared.running.fetch_add(1, Ordering::SeqCst);
        if self.shared.asleep.swap(false, Ordering::SeqCst)
            && let Some(thread) = &self.thread
        {
            thread.thread().unpark();
        }
        Running(&self.shared)
    }

    /// Whether the ticker sleeps until the next call.
    #[cfg(test)]
    pub(super) fn is_asleep(&self) -> bool {
        self.shared.asleep.load(Ordering::SeqCst)
    }
}

impl TickerShared {
    fn run(&self, engine: &Engine) {
        let mut idle = 0;
        while !self.stop.load(Ordering::SeqCst) {
            std::thread::park_timeout(EPOCH_TICK);
            engine.increment_epoch();
            if self.running.load(Ordering::SeqCst) > 0 {
                idle = 0;
                continue;
            }
            idle += 1;
            if idle < IDLE_TICKS {
                continue;
            }
            // Announce the sleep before the last look: a call that starts after the look sees
            // `asleep` and unparks (a park after an unpark returns at once), so none is missed.
            self.asleep.store(true, Ordering::SeqCst);
            if self.running.load(Ordering::SeqCst) == 0 && !self.stop.load(Ordering::SeqCst) {
                std::thread::park();
            }
            self.asleep.store(false, Ordering::SeqCst);
            idle = 0;
        }
    }
}

impl Drop for EpochTicker {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        if let Some(thread) = self.thread.take() {
            thread.thread().unpark();
            // A panic in the ticker cannot happen (it only sleeps and increments); ignore it.
            let _ = thread.join();
        }
    }
}

// === impl CompileCache ===

/// Compiled components by sha256 of their bytes: in memory for reloads within the process, on
/// disk (`<sha256>-<engine compat hash>.cwasm`) so a restart does not recompile. The compat hash
/// changes with the wasmtime version and engine settings, so stale artifacts are never read;
/// they, and those of policies no longer deployed, are removed once unused for
/// [`UNUSED_ARTIFACT_TTL`] (see [`evict_unused`]).
struct CompileCache {
    memory: Mutex<HashMap<String, Component>>,
    dir: Option<PathBuf>,
    compat: String,
    compiles: AtomicU64,
}

impl CompileCache {
    fn new(engine: &Engine, dir: Option<PathBuf>) -> Self {
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        engine.precompile_compatibility_hash().hash(&mut hasher);
        if let Some(dir) = &dir {
            evict_unused(dir, UNUSED_ARTIFACT_TTL, SystemTime::now());
        }
        CompileCache {
            memory: Mutex::new(HashMap::new()),
            dir,
            compat: format!("{:016x}", hasher.finish()),
            compiles: AtomicU64::new(0),
        }
    }

    fn get_or_compile(
        &self,
        engine: &Engine,
        name: &str,
        sha256: &str,
        bytes: &[u8],
    ) -> Result<Component, LoadError> {
        if let Some(component) = self.memory.lock().get(sha256) {
            return Ok(component.clone());
        }
        let file = self
            .dir
            .as_ref()
            .map(|dir| dir.join(format!("{sha256}-{}.cwasm", self.compat)));
        let cached = file
            .as_deref()
            .and_then(|path| read_artifact(engine, name, path));
        let component = match cached {
            Some(component) => component,
            None => {
                let component = self.compile(engine, name, bytes)?;
                if let Some(path) = &file {
                    write_artifact(name, &component, path);
                }
                component
            }
        };
        self.memory
            .lock()
            .insert(sha256.to_owned(), component.clone());
        Ok(component)
    }

    fn compile(&self, engine: &Engine, name: &str, bytes: &[u8]) -> Result<Component, LoadError> {
        self.compiles.fetch_add(1, Ordering::Relaxed);
        let started = std::time::Instant::now();
        let component = Component::new(engine, bytes).map_err(|e| LoadError::Compile {
            policy: name.to_owned(),
            reason: format!("{e:#}"),
        })?;
        tracing::debug!(policy = name, elapsed = ?started.elapsed(), "compiled policy component");
        Ok(component)
    }
}

/// A cached artifact, or `None` (and a warning when it existed but was unusable: the caller
/// then recompiles and overwrites it).
fn read_artifact(engine: &Engine, name: &str, path: &Path) -> Option<Component> {
    if !path.is_file() {
        return None;
    }
    match deserialize(engine, path) {
        Ok(component) => {
            tracing::debug!(policy = name, path = %path.display(), "loaded compiled policy from cache");
            // Best effort: a read-only cache keeps its write time.
            let _ = set_last_used(path, SystemTime::now());
            Some(component)
        }
        Err(e) => {
            tracing::warn!(policy = name, path = %path.display(), error = %format!("{e:#}"),
                "ignoring unusable compile cache entry");
            None
        }
    }
}

#[expect(
    unsafe_code,
    reason = "wasmtime can only load precompiled code through an unsafe constructor"
)]
fn deserialize(engine: &Engine, path: &Path) -> wasmtime::Result<Component> {
    // SAFETY: `deserialize_file` trusts the file to be wasmtime's own output. The cache only
    // holds files this module wrote (`write_artifact`: serialized by this wasmtime, renamed into
    // place only once complete), named by the content hash and the engine's compatibility hash,
    // and wasmtime checks the artifact's header and engine settings before using it. The file
    // is mapped read-only and we never modify cache files after the rename.
    unsafe { Component::deserialize_file(engine, path) }
}

/// Artifacts not read or written for this long are removed when a host starts.
const UNUSED_ARTIFACT_TTL: Duration = Duration::from_secs(7 * 24 * 60 * 60);

/// Remove the artifacts in `dir` last used (read or written: their modification time) more
/// than `ttl` before `now`: those of policies no longer deployed and those of other wasmtime
/// versions or engine settings, which are never read again and would otherwise pile up
/// forever. Only files named as this cache names them are looked at, since the directory
/// also holds fetched models. Another process sharing the directory may still have one of them
/// mapped: removing the name leaves its mapping intact. Best effort, as the cache is; returns
/// how many were removed.
fn evict_unused(dir: &Path, ttl: Duration, now: SystemTime) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    let removed = entries
        .flatten()
        .filter(|entry| entry.file_name().to_str().is_some_and(is_artifact_name))
        .filter(|entry| {
            let used = entry.metadata().and_then(|m| m.modified());
            used.is_ok_and(|used| now.duration_since(used).is_ok_and(|age| age > ttl))
        })
        .filter(|entry| std::fs::remove_file(entry.path()).is_ok())
        .count();
    if removed > 0 {
        tracing::info!(dir = %dir.display(), removed, "removed compiled policies unused for a week");
    }
    removed
}

/// `<sha256: 64 hex digits>-<compat hash: 16 hex digits>.cwasm`.
fn is_artifact_name(name: &str) -> bool {
    let hex = |s: &str, len: usize| s.len() == len && s.bytes().all(|b| b.is_ascii_hexdigit());
    name.strip_suffix(".cwasm")
        .and_then(|stem| stem.split_once('-'))
        .is_some_and(|(sha, compat)| hex(sha, 64) && hex(compat, 16))
}

/// Record that an artifact was used `at` (its modification time, which [`evict_unused`]
/// reads).
pub(super) fn set_last_used(path: &Path, at: SystemTime) -> std::io::Result<()> {
    std::fs::File::options()
        .write(true)
        .open(path)?
        .set_modified(at)
}

/// Best effort: a cache that cannot be written only costs a recompile on the next start.
fn write_artifact(name: &str, component: &Component, path: &Path) {
    let result = (|| -> Result<(), String> {
        let bytes = component.serialize().map_err(|e| format!("{e:#}"))?;
        let dir = path.parent().ok_or("cache path has no directory")?;
        std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
        // Write then rename, so a reader never maps a half-written artifact.
        let mut tmp = tempfile::NamedTempFile::new_in(dir).map_err(|e| e.to_string())?;
        std::io::Write::write_all(&mut tmp, &bytes).map_err(|e| e.to_string())?;
        tmp.persist(path).map_err(|e| e.to_string())?;
        Ok(())
    })();
    if let Err(reason) = result {
        tracing::warn!(policy = name, path = %path.display(), %reason, "cannot write compile cache entry");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DAY: Duration = Duration::from_secs(24 * 60 * 60);

    /// A file in `dir` last modified `age` ago.
    fn file_aged(dir: &Path, name: &str, age: Duration) -> PathBuf {
        let path = dir.join(name);
        std::fs::write(&path, b"x").expect("writes");
        set_last_used(&path, SystemTime::now() - age).expect("sets its time");
        path
    }

    /// Only files named as the cache names its artifacts are removed, and only once unused for
    /// longer than the TTL, whatever their compat hash.
    #[test]
    fn only_artifacts_unused_for_longer_than_the_ttl_are_removed() {
        let dir = tempfile::tempdir().expect("temp dir");
        let artifact = |sha: char, compat: char| {
            format!(
                "{}-{}.cwasm",
                sha.to_string().repeat(64),
                compat.to_string().repeat(16)
            )
        };
        let other_compat = file_aged(dir.path(), &artifact('a', '0'), 8 * DAY);
        let unused = file_aged(dir.path(), &artifact('b', '1'), 30 * DAY);
        let recent = file_aged(dir.path(), &artifact('c', '1'), 6 * DAY);
        let model = file_aged(dir.path(), "SmolLM2-135M-Instruct.Q4_1.gguf", 30 * DAY);
        let look_alike = file_aged(dir.path(), "notes-0123456789abcdef.cwasm", 30 * DAY);

        assert_eq!(evict_unused(dir.path(), 7 * DAY, SystemTime::now()), 2);
        assert!(!other_compat.exists() && !unused.exists());
        assert!(recent.exists() && model.exists() && look_alike.exists());
        assert_eq!(
            evict_unused(&dir.path().join("missing"), 7 * DAY, SystemTime::now()),
            0,
            "a cache directory not made yet is no error"
        );
    }
}
