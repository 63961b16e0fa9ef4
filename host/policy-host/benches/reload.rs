//! Hot-swap latency: from the `rename(2)` that puts a new policy file in place to the new
//! version serving, through the real plugins watcher and registry (debounce, read, compile or
//! compile-cache hit, instantiate, `init`, the synthetic check plans, state carry-over, swap).
//!
//! `make plugins examples && cargo bench -p switchyard-policy-host --bench reload` prints one row per
//! component: the built-in Rust policy, and the Rust, Python and JavaScript examples from
//! `target/examples/` when they are built. "miss": a registry whose compile cache never saw the
//! bytes (in memory only, so every round is a real compile); "hit": swapping back and forth
//! between two versions the cache holds. Two numbers each: as observed by polling the registry
//! from just before the rename, and as the registry itself logs it (`last_reload_ms`, from the
//! file event's timestamp).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use switchyard_policy_host::{
    DEFAULT_DEBOUNCE, PolicyHost, PolicyLimits, PolicyRegistry, QuarantineRule, RegistryConfig,
    watch,
};

const MISS_ROUNDS: usize = 5;
const HIT_ROUNDS: usize = 20;
const DEADLINE: Duration = Duration::from_secs(120);

struct Row {
    name: String,
    size_bytes: usize,
    miss: Vec<(Duration, f64)>,
    hit: Vec<(Duration, f64)>,
}

fn main() {
    let runtime = tokio::runtime::Runtime::new().expect("a tokio runtime");
    let root = switchyard_tests::checkout();
    let mut components = vec![(
        "disagg (built-in)".to_owned(),
        switchyard_tests::guest(switchyard_tests::Guest::DISAGG),
    )];
    for example in ["priority-rust", "prefix-aware-python", "slo-js"] {
        let path = root.join(format!("target/examples/{example}.wasm"));
        if path.is_file() {
            components.push((example.to_owned(), path));
        } else {
            eprintln!("{} is missing (make examples); skipped", path.display());
        }
    }
    let base = std::fs::read(root.join("plugins/round-robin.wasm"))
        .expect("plugins/round-robin.wasm: run `make plugins` first");
    let rows: Vec<Row> = components
        .into_iter()
        .map(|(name, path)| {
            let bytes = std::fs::read(&path).expect("read the component");
            runtime.block_on(measure(name, &base, &bytes))
        })
        .collect();
    print_table(&rows);
}

async fn measure(name: String, base: &[u8], candidate: &[u8]) -> Row {
    let mut miss = Vec::new();
    for _ in 0..MISS_ROUNDS {
        // A fresh host (empty in-memory cache, no disk cache) per round: a real compile.
        let bench = Bench::start(base).await;
        miss.push(bench.swap_to(candidate).await);
    }
    let bench = Bench::start(base).await;
    bench.swap_to(candidate).await;
    let mut hit = Vec::new();
    for _ in 0..HIT_ROUNDS {
        hit.push(bench.swap_to(base).await);
        hit.push(bench.swap_to(candidate).await);
    }
    Row {
        name,
        size_bytes: candidate.len(),
        miss,
        hit,
    }
}

/// A registry over a temporary plugins directory holding one policy, `p`, and its watcher.
struct Bench {
    dir: tempfile::TempDir,
    registry: Arc<PolicyRegistry>,
    _watcher: switchyard_policy_host::PluginWatcher,
}

impl Bench {
    async fn start(base: &[u8]) -> Bench {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("p.wasm"), base).expect("write the base policy");
        let host = PolicyHost::new(PolicyLimits {
            cache_dir: None,
            ..PolicyLimits::default()
        })
        .expect("policy host");
        let config = RegistryConfig {
            plugins: dir.path().to_owned(),
            default: "p".into(),
            default_config: None,
            fallback: None,
            models: Default::default(),
            header: true,
            quarantine: QuarantineRule::default(),
        };
        let registry = PolicyRegistry::open(host, config)
            .await
            .expect("the registry opens");
        let watcher = watch(Arc::clone(&registry), DEFAULT_DEBOUNCE).expect("watching");
        Bench {
            dir,
            registry,
            _watcher: watcher,
        }
    }

    /// The serving version builds its spare after it swapped in: let that finish, so that it
    /// does not compete with the next swap being timed.
    async fn wait_for_spare(&self) {
        let started = Instant::now();
        while !self
            .registry
            .view_one("p")
            .and_then(|view| view.executor)
            .is_some_and(|executor| executor.spare_ready)
        {
            assert!(started.elapsed() < DEADLINE, "no spare within {DEADLINE:?}");
            tokio::time::sleep(Duration::from_micros(200)).await;
        }
    }

    /// Rename `bytes` over `p.wasm`; (observed rename → serving, the registry's own figure).
    async fn swap_to(&self, bytes: &[u8]) -> (Duration, f64) {
        let want = sha256(bytes);
        let tmp: PathBuf = self.dir.path().join(".p.wasm.tmp");
        std::fs::write(&tmp, bytes).expect("write the temporary file");
        let started = Instant::now();
        std::fs::rename(&tmp, self.dir.path().join("p.wasm")).expect("rename");
        loop {
            let view = self.registry.view_one("p").expect("policy p");
            if view.sha256.as_deref() == Some(want.as_str()) {
                let observed = started.elapsed();
                self.wait_for_spare().await;
                return (observed, view.last_reload_ms.unwrap_or(f64::NAN));
            }
            if let Some(error) = view.last_error {
                panic!("the candidate was refused: {error}");
            }
            assert!(started.elapsed() < DEADLINE, "no swap within {DEADLINE:?}");
            tokio::time::sleep(Duration::from_micros(200)).await;
        }
    }
}

/// The sha256 the registry reports for a version loaded from `bytes`.
fn sha256(bytes: &[u8]) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(bytes))
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// (p50, max) of the observed and of the logged latencies, in ms.
fn summary(samples: &[(Duration, f64)]) -> String {
    let mut observed: Vec<f64> = samples.iter().map(|(d, _)| ms(*d)).collect();
    let mut logged: Vec<f64> = samples.iter().map(|(_, l)| *l).collect();
    observed.sort_by(f64::total_cmp);
    logged.sort_by(f64::total_cmp);
    let p50 = |v: &[f64]| v[v.len() / 2];
    let max = |v: &[f64]| v[v.len() - 1];
    format!(
        "{:>7.1} {:>7.1} {:>7.1} {:>7.1}",
        p50(&observed),
        max(&observed),
        p50(&logged),
        max(&logged)
    )
}

fn print_table(rows: &[Row]) {
    println!(
        "rename -> serving, ms (debounce {} ms); obs = observed by polling, log = last_reload_ms",
        DEFAULT_DEBOUNCE.as_millis()
    );
    println!(
        "{:<22} {:>9} | {:^31} | {:^31}",
        "component", "bytes", "cache miss", "cache hit"
    );
    println!(
        "{:<22} {:>9} | {:>7} {:>7} {:>7} {:>7} | {:>7} {:>7} {:>7} {:>7}",
        "",
        "",
        "obs p50",
        "obs max",
        "log p50",
        "log max",
        "obs p50",
        "obs max",
        "log p50",
        "log max"
    );
    for row in rows {
        println!(
            "{:<22} {:>9} | {} | {}",
            row.name,
            row.size_bytes,
            summary(&row.miss),
            summary(&row.hit)
        );
    }
}
