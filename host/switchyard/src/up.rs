//! `switchyard up`: the embedded default (`make run`). Starts `--prefill` + `--decode`
//! reference engines as child processes of this one (device ranks 0..N, KV peers wired over
//! the shm transport), speaking `--protocol` (MLC microserving, vLLM's or SGLang's P/D), runs the router in-process in front of them, prints the URL and a
//! ready-to-paste request once ready, and stops everything on SIGINT/SIGTERM: the router drains
//! first (the engines serve its requests in flight to the end), then each engine gets SIGTERM,
//! SIGKILL if it has not exited within [`ENGINE_STOP_TIMEOUT`], and is waited for.
//!
//! `--model` names what the engines run (`synthetic`, `smollm2` or a GGUF path; see
//! `switchyard engine --model`): with a real model the router gets the GGUF's tokenizer, chat
//! template and name, and the machine's cores are split between the engines (`--threads`).
//!
//! Engines never outlive the router: `up` returns only once every engine has exited, each child
//! is killed when its handle drops (an error path), and the kernel kills it
//! (`PR_SET_PDEATHSIG`) if the router dies without running destructors.

use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use switchyard_router::config::{Config, ConfigError, RouterArgs, ServeArgs};
use switchyard_router::serve::{self, ServeError};
use switchyard_wire::ReadyLine;

/// `switchyard up` flags: the engines to start, and the router's own (as `switchyard serve`).
///
/// `--model` is the router's flag, flattened in with the rest, but here it names what the
/// engines run (the router reads its tokenizer from the same file): [`MODEL_HELP`] says so.
#[derive(Debug, Clone, clap::Args)]
pub struct UpArgs {
    /// Engines with the prefill role (endpoint ids 0..P).
    #[arg(long, default_value_t = 1)]
    pub prefill: u32,
    /// Engines with the decode role (endpoint ids P..P+D). With a real model each engine gets
    /// its share of the cores (`--threads`): `make run` starts 1 + 1 for 2 cores; on a bigger
    /// machine raise `--prefill`/`--decode`, e.g. `--prefill 2 --decode 4` on 12 cores.
    #[arg(long, default_value_t = 2)]
    pub decode: u32,
    /// Start the engines with their prefix cache on.
    #[arg(long)]
    pub prefix_cache: bool,
    /// The name `/v1/models` reports (default: the router's default for the synthetic model,
    /// else the GGUF's file stem). `--model` names what the engines run.
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Threads per engine for a real model (default: the machine's cores split evenly).
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..))]
    pub threads: Option<u16>,
    /// The protocol the engines speak, and the router with them: `mlc` (microserving),
    /// `vllm` (NIXL-style handoff: the decode engine pulls the prefill's leased KV) or `sglang`
    /// (bootstrap rooms: prefill engines run a bootstrap server and push the KV).
    #[arg(long, default_value = "mlc", value_parser = ["mlc", "vllm", "sglang"])]
    pub protocol: String,
    /// An extra flag for every engine, e.g. `--engine-arg=--preempt-every=2` (repeatable).
    #[arg(long = "engine-arg", allow_hyphen_values = true)]
    pub engine_args: Vec<String>,
    #[command(flatten)]
    pub router: RouterArgs,
}

/// `up --model`'s help, replacing the router's (main.rs applies it to the subcommand).
pub const MODEL_HELP: &str = "What the engines run: `synthetic` (no weights), `smollm2` (the GGUF \
    `make model` fetches) or a GGUF file's path [default: synthetic]. `--served-model-name` sets \
    the name `/v1/models` reports";

/// Why `up` could not start.
#[derive(Debug, thiserror::Error)]
pub enum UpError {
    #[error("--prefill + --decode must be at least 1")]
    NoEngines,
    #[error("--model {model}: {reason}")]
    Model { model: String, reason: String },
    #[error("cannot find this executable to start engines: {0}")]
    CurrentExe(std::io::Error),
    #[error("cannot start engine {rank}: {source}")]
    Spawn { rank: u32, source: std::io::Error },
    #[error("engine {rank} did not report ready within {after:?} (see its log above)")]
    EngineNotReady { rank: u32, after: Duration },
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Serve(#[from] ServeError),
    #[error("the router did not become ready within {0:?}")]
    RouterNotReady(Duration),
}

const ENGINE_READY_TIMEOUT: Duration = Duration::from_secs(60);
/// How long an engine may take to exit after SIGTERM before it is killed.
const ENGINE_STOP_TIMEOUT: Duration = Duration::from_secs(5);

/// A reference engine child process; killed when dropped.
#[derive(Debug)]
pub struct EngineChild {
    pub rank: u32,
    pub url: String,
    /// An SGLang prefill engine's bootstrap port.
    pub bootstrap_port: Option<u16>,
    /// `kill_on_drop`: the engine dies with this handle.
    child: Child,
}

/// SIGTERM to every engine, then wait for each to exit; SIGKILL those still running after
/// [`ENGINE_STOP_TIMEOUT`]. Returns once every engine has exited.
async fn stop_engines(engines: Vec<EngineChild>) {
    for engine in &engines {
        let pid = engine
            .child
            .id()
            .and_then(|id| rustix::process::Pid::from_raw(id as i32));
        if let Some(pid) = pid {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
        }
    }
    let deadline = tokio::time::Instant::now() + ENGINE_STOP_TIMEOUT;
    for mut engine in engines {
        if tokio::time::timeout_at(deadline, engine.child.wait())
            .await
            .is_err()
        {
            tracing::warn!(
                rank = engine.rank,
                "engine still running after SIGTERM; killing it"
            );
            let _ = engine.child.kill().await;
        }
    }
}

/// Start engines and the router; run until `shutdown` resolves, then drain the router (cut
/// short when `hurry` resolves) and stop the engines.
pub async fn run(
    mut args: UpArgs,
    shutdown: impl std::future::Future<Output = ()>,
    hurry: impl std::future::Future<Output = ()>,
) -> Result<(), UpError> {
    let model = args
        .router
        .model
        .take()
        .unwrap_or_else(|| "synthetic".into());
    let gguf = switchyard_engine::model_path(&model);
    let real = gguf.is_some();
    if let Some(path) = gguf {
        if !path.is_file() {
            return Err(UpError::Model {
                reason: format!(
                    "{} is not a file{}",
                    path.display(),
                    switchyard_engine::fetch_hint(&model)
                ),
                model,
            });
        }
        // The router reads the GGUF's tokenizer, chat template, name and context length itself.
        args.router.model_dir = Some(path);
    }
    args.router.model = args.served_model_name.clone();
    // The router's config is read and checked once, before any process starts (a GGUF's
    // metadata included), with one placeholder endpoint per engine to come; the engines' own
    // URLs take their places once they are up.
    let engine_count = args.prefill + args.decode;
    if engine_count == 0 {
        return Err(UpError::NoEngines);
    }
    let placeholders = (0..engine_count)
        .map(|rank| endpoint_flag(&args, rank, "http://127.0.0.1:1", Some(1)))
        .collect();
    let mut config = Config::from_args(&serve_args(&args, placeholders))?;
    let engines = spawn_engines(&args, &model).await?;
    for (endpoint, engine) in config.endpoints.iter_mut().zip(&engines) {
        endpoint.url.clone_from(&engine.url);
        endpoint.bootstrap_port = engine.bootstrap_port;
    }
    let router = serve::start(&config).await?;
    let ready_within = Duration::from_secs(30);
    if !router.wait_ready(ready_within).await {
        return Err(UpError::RouterNotReady(ready_within));
    }
    print_banner(&router.addr().to_string(), &engines, real);
    shutdown.await;
    let drained = router.shutdown_or_hurry(hurry).await;
    stop_engines(engines).await;
    Ok(drained?)
}

/// Engine `rank`'s `--endpoint` flag: the first `--prefill` ranks prefill, the rest decode.
fn endpoint_flag(args: &UpArgs, rank: u32, url: &str, bootstrap_port: Option<u16>) -> String {
    let prefill = rank < args.prefill;
    let role = if prefill { "prefill" } else { "decode" };
    let mut flag = format!("{}+{url},role={role}", args.protocol);
    if let (true, "sglang", Some(port)) = (prefill, args.protocol.as_str(), bootstrap_port) {
        flag.push_str(&format!(",bootstrap_port={port}"));
    }
    flag
}

fn serve_args(args: &UpArgs, endpoints: Vec<String>) -> ServeArgs {
    ServeArgs {
        endpoint_num_gpus: vec![1; endpoints.len()],
        endpoints,
        router: args.router.clone(),
        ..ServeArgs::default()
    }
}

fn print_banner(addr: &str, engines: &[EngineChild], real: bool) {
    for e in engines {
        println!("engine {} (device rank {}) on {}", e.rank, e.rank, e.url);
    }
    println!("switchyard router ready on http://{addr}");
    if real {
        println!(
            "try:\n  curl -s http://{addr}/v1/chat/completions -H 'content-type: application/json' \\\n    -d '{{\"messages\": [{{\"role\": \"system\", \"content\": \"You are a helpful assistant.\"}}, {{\"role\": \"user\", \"content\": \"What is the capital of France?\"}}], \"max_tokens\": 32}}'"
        );
        return;
    }
    println!(
        "try:\n  curl -s http://{addr}/v1/completions -H 'content-type: application/json' \\\n    -d '{{\"prompt\": \"Disaggregated serving splits prefill from decode\", \"max_tokens\": 32}}'"
    );
}

/// Start every engine, each knowing every other engine's KV address up front.
pub async fn spawn_engines(args: &UpArgs, model: &str) -> Result<Vec<EngineChild>, UpError> {
    let n = args.prefill + args.decode;
    let exe = std::env::current_exe().map_err(UpError::CurrentExe)?;
    let nonce: u32 = rand::random();
    let kv_addr = |rank: u32| {
        format!(
            "unix:@switchyard-up-{}-{nonce:08x}-{rank}",
            std::process::id()
        )
    };
    let mut engines = Vec::with_capacity(n as usize);
    for rank in 0..n {
        let mut cmd = Command::new(&exe);
        cmd.args(["engine", "--port", "0", "--host", "127.0.0.1"])
            .args(["--device-rank", &rank.to_string()])
            .args(["--kv-transport", "shm", "--kv-listen", &kv_addr(rank)]);
        for peer in (0..n).filter(|&p| p != rank) {
            cmd.arg("--kv-peer")
                .arg(format!("{peer}={}", kv_addr(peer)));
        }
        if args.prefix_cache {
            cmd.arg("--prefix-cache");
        }
        cmd.args(["--protocol", &args.protocol]);
        if args.protocol == "sglang" {
            match rank < args.prefill {
                true => cmd.args(["--disaggregation-mode", "prefill", "--bootstrap-port", "0"]),
                false => cmd.args(["--disaggregation-mode", "decode"]),
            };
        }
        if model != "synthetic" {
            cmd.args(["--model", model]);
            let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
            let threads = args
                .threads
                .map_or_else(|| (cores / n as usize).max(1), usize::from);
            cmd.args(["--threads", &threads.to_string()]);
        }
        if let Some(name) = &args.served_model_name {
            cmd.args(["--served-model-name", name]);
        }
        cmd.args(&args.engine_args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true);
        die_with_parent(&mut cmd);
        let child = cmd
            .spawn()
            .map_err(|source| UpError::Spawn { rank, source })?;
        engines.push(child);
    }
    let mut started = Vec::with_capacity(n as usize);
    for (rank, mut child) in (0..n).zip(engines) {
        let ready = tokio::time::timeout(ENGINE_READY_TIMEOUT, ready_line(&mut child))
            .await
            .ok()
            .flatten()
            .ok_or(UpError::EngineNotReady {
                rank,
                after: ENGINE_READY_TIMEOUT,
            })?;
        started.push(EngineChild {
            rank,
            url: ready.url(),
            bootstrap_port: ready.bootstrap_port,
            child,
        });
    }
    Ok(started)
}

/// Read the child's stdout until its ready line; keep draining it afterwards so the engine
/// never blocks on a full pipe.
async fn ready_line(child: &mut Child) -> Option<ReadyLine> {
    let stdout = child.stdout.take()?;
    let mut lines = BufReader::new(stdout).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        if let Ok(ready) = line.parse::<ReadyLine>() {
            tokio::spawn(async move {
                while let Ok(Some(line)) = lines.next_line().await {
                    println!("{line}");
                }
            });
            return Some(ready);
        }
        println!("{line}");
    }
    None
}

/// Have the kernel SIGKILL the child when this process dies, however it dies.
#[expect(
    unsafe_code,
    reason = "pre_exec is unsafe: the closure runs between fork and exec"
)]
fn die_with_parent(cmd: &mut Command) {
    // SAFETY: the closure only calls prctl(2) through rustix, which is async-signal-safe; it
    // allocates nothing and takes no locks, so it is sound between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL))
                .map_err(std::io::Error::from)
        });
    }
}
