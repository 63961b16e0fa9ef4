//! Reference engines and routers as child processes on loopback.
//!
//! ```no_run
//! use switchyard_tests::EngineProcess;
//! let d = EngineProcess::spawn(&["--device-rank", "1", "--kv-transport", "shm"]);
//! let p = EngineProcess::spawn(&["--kv-transport", "shm", "--kv-peer", &format!("1={}", d.kv_addr)]);
//! println!("P at {}, D at {}", p.url, d.url);
//! ```
//!
//! These helpers panic with a message that says what to do: they run only in tests.

use std::io::{BufRead as _, BufReader, Read as _, Write as _};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use switchyard_wire::ReadyLine;

use crate::plugins_dir;

/// How long an engine may take to print its ready line and answer `GET /v1/models`.
const STARTUP_TIMEOUT: Duration = Duration::from_secs(30);

/// The `switchyard` binary next to the running test executable (`target/<profile>/switchyard`,
/// tests live in `target/<profile>/deps/`), or `$SWITCHYARD_BIN` if set.
pub fn switchyard_bin() -> PathBuf {
    if let Some(path) = std::env::var_os("SWITCHYARD_BIN") {
        return PathBuf::from(path);
    }
    let exe = std::env::current_exe().expect("the test executable has a path");
    let profile_dir = exe
        .parent()
        .and_then(|deps| {
            if deps.ends_with("deps") {
                deps.parent()
            } else {
                Some(deps)
            }
        })
        .expect("the test executable lives in target/<profile>/deps");
    let bin = profile_dir.join(format!("switchyard{}", std::env::consts::EXE_SUFFIX));
    assert!(
        bin.is_file(),
        "{} does not exist: build it first: cargo build -p switchyard",
        bin.display()
    );
    bin
}

/// A loopback port that was free a moment ago.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("can bind a loopback port")
}

/// A `switchyard engine` child process, killed when dropped.
pub struct EngineProcess {
    child: Child,
    /// `http://127.0.0.1:PORT`
    pub url: String,
    pub http_addr: SocketAddr,
    /// The engine's KV transfer address as printed (`tcp:…` or `unix:@…`), for `--kv-peer`.
    pub kv_addr: String,
    pub device_rank: u32,
    /// `tcp://ADDR` of its KV event socket and replay socket (`--kv-events`,
    /// `--kv-events-replay`) as first started, for a router endpoint's `kv_events`.
    pub kv_events: Option<String>,
    pub kv_events_replay: Option<String>,
    /// The flags it was started with, for [`EngineProcess::restart`].
    args: Vec<String>,
}

impl EngineProcess {
    /// Starts `switchyard engine --port 0 ARGS…`, learns its port from the ready line, and waits
    /// until `GET /v1/models` answers 200.
    pub fn spawn(args: &[&str]) -> EngineProcess {
        Self::spawn_on(0, args)
    }

    /// [`EngineProcess::spawn`] on HTTP port `port`.
    pub fn spawn_on(port: u16, args: &[&str]) -> EngineProcess {
        let args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
        let (child, ready) = start_engine(&["--port", &port.to_string()], &args);
        let engine = EngineProcess {
            child,
            url: ready.url(),
            http_addr: ready.http_addr,
            kv_events: ready.kv_events_url(),
            kv_events_replay: ready.kv_events_replay_url(),
            kv_addr: ready.kv_addr,
            device_rank: ready.device_rank,
            args,
        };
        engine.wait_until_ready();
        engine
    }

    /// SIGKILL, and wait until the process is gone: no clean-up runs, as in a crash.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGSTOP: the process stays, its sockets keep accepting, nothing answers.
    pub fn freeze(&self) {
        self.signal(rustix::process::Signal::STOP);
    }

    /// SIGCONT after [`EngineProcess::freeze`].
    pub fn thaw(&self) {
        self.signal(rustix::process::Signal::CONT);
    }

    fn signal(&self, signal: rustix::process::Signal) {
        let pid = rustix::process::Pid::from_raw(self.child.id() as i32).expect("a child's pid");
        rustix::process::kill_process(pid, signal).expect("the engine process exists");
    }

    /// Kill it if it still runs, then start it again with the same flags on the same HTTP and
    /// KV addresses (its KV pool starts empty), and wait until it is ready.
    pub fn restart(&mut self) {
        self.kill();
        let port = self.http_addr.port().to_string();
        let (child, ready) =
            start_engine(&["--port", &port, "--kv-listen", &self.kv_addr], &self.args);
        assert_eq!(
            (ready.http_addr, &ready.kv_addr),
            (self.http_addr, &self.kv_addr),
            "restarted on the same addresses"
        );
        self.child = child;
        self.wait_until_ready();
    }

    /// Polls `GET /v1/models` until 200, within the startup timeout.
    fn wait_until_ready(&self) {
        wait_for_200(self.http_addr, "/v1/models", "engine", &self.url);
    }

    /// `url` + `path`.
    pub fn endpoint(&self, path: &str) -> String {
        format!("{}{path}", self.url)
    }
}

impl Drop for EngineProcess {
    fn drop(&mut self) {
        // SIGKILL ends a frozen process too.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `switchyard engine PLACE… ARGS…` and waits for its ready line.
fn start_engine(place: &[&str], args: &[String]) -> (Child, ReadyLine) {
    let argv: Vec<String> = std::iter::once("engine")
        .chain(place.iter().copied())
        .map(str::to_owned)
        .chain(args.iter().cloned())
        .collect();
    let (child, line) = spawn_switchyard(&argv, &[], Stdio::inherit(), STARTUP_TIMEOUT, |line| {
        line.parse::<ReadyLine>().is_ok().then(|| line.to_owned())
    });
    let ready: ReadyLine = line
        .parse()
        .unwrap_or_else(|e| panic!("switchyard {argv:?}: {e}"));
    (child, ready)
}

/// Starts `switchyard ARGS…` with `env` (and the caller's `RUST_LOG`, else `warn`), and waits
/// up to `within` for the first stdout line `ready` accepts, returning what it made of it.
/// Stdout is read for the child's whole life, so it never blocks on a full pipe.
fn spawn_switchyard(
    args: &[String],
    env: &[(&str, &Path)],
    stderr: Stdio,
    within: Duration,
    ready: impl Fn(&str) -> Option<String> + Send + 'static,
) -> (Child, String) {
    let mut child = Command::new(switchyard_bin())
        .args(args)
        .envs(env.iter().copied())
        .env(
            "RUST_LOG",
            std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into()),
        )
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(stderr)
        .spawn()
        .expect("can spawn the switchyard binary");
    let stdout = child.stdout.take().expect("stdout is piped");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut lines = BufReader::new(stdout).lines();
        for line in lines.by_ref().map_while(Result::ok) {
            if let Some(found) = ready(&line) {
                let _ = tx.send(found);
                break;
            }
        }
        for _ in lines {}
    });
    match rx.recv_timeout(within) {
        Ok(found) => (child, found),
        Err(_) => {
            let _ = child.kill();
            let status = child.wait().map(|s| s.to_string()).unwrap_or_default();
            panic!("switchyard {args:?} printed no ready line within {within:?} ({status})");
        }
    }
}

/// Polls `GET path` on a freshly started process until it answers 200, within the startup
/// timeout (readiness has no event to wait on from outside the process).
pub(crate) fn wait_for_200(addr: SocketAddr, path: &str, what: &str, url: &str) {
    wait_for(addr, path, what, url, |_| true);
}

/// Polls `GET path` until it answers 200 with a body `accept` takes, within the startup
/// timeout.
fn wait_for(addr: SocketAddr, path: &str, what: &str, url: &str, accept: impl Fn(&str) -> bool) {
    let deadline = Instant::now() + STARTUP_TIMEOUT;
    while Instant::now() < deadline {
        if http_get(addr, path).is_some_and(|(status, body)| status == 200 && accept(&body)) {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("{what} at {url} did not answer GET {path} as expected within {STARTUP_TIMEOUT:?}");
}

/// A minimal blocking HTTP/1.1 GET that asks the server to close after answering (HTTP/1.0
/// would do, but Envoy's admin interface refuses it), so readiness checks need no async
/// runtime: the status and the body.
fn http_get(addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(1)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    let status = response.get(9..12)?.parse().ok()?;
    let body = response.split_once("\r\n\r\n")?.1.to_owned();
    Some((status, body))
}

// === router processes (the router engineer's part) ===

/// A `switchyard serve`, `up` or `sidecar` child process, killed when dropped.
pub struct RouterProcess {
    child: Child,
    /// `http://127.0.0.1:PORT` (`https://` with `--tls-cert`)
    pub url: String,
    pub addr: SocketAddr,
}

/// `switchyard up …` is a router too; the alias says which command started it (`sidecar` is
/// one as well).
pub type UpProcess = RouterProcess;

impl RouterProcess {
    /// `switchyard serve --port 0 --plugins <checkout>/plugins --endpoint URL… ARGS…` (ARGS may
    /// name other `--plugins`); waits until `/health` answers 200.
    pub fn serve(endpoints: &[&str], args: &[&str]) -> RouterProcess {
        let router = Self::serve_ready(endpoints, args);
        router.wait_until_healthy();
        router
    }

    /// [`RouterProcess::serve`], but returns as soon as the router is ready (`/health` 200:
    /// enough endpoints healthy), whether or not every endpoint is.
    pub fn serve_ready(endpoints: &[&str], args: &[&str]) -> RouterProcess {
        Self::serve_to(endpoints, args, Stdio::inherit())
    }

    /// [`RouterProcess::serve`] with the router's log (stderr) written to `log`.
    pub fn serve_logging_to(endpoints: &[&str], args: &[&str], log: &Path) -> RouterProcess {
        let file = std::fs::File::create(log).expect("can create the log file");
        let router = Self::serve_to(endpoints, args, Stdio::from(file));
        router.wait_until_healthy();
        router
    }

    /// [`RouterProcess::serve`] with `env` set (e.g. `OTEL_EXPORTER_OTLP_ENDPOINT`).
    pub fn serve_with_env(
        endpoints: &[&str],
        args: &[&str],
        env: &[(&str, &Path)],
    ) -> RouterProcess {
        let full = Self::serve_argv(endpoints, args);
        let router = Self::spawn(
            full,
            env,
            Stdio::inherit(),
            "switchyard router listening on ",
        );
        router.wait_until_healthy();
        router
    }

    /// `switchyard serve …` with `env` set (e.g. `KUBECONFIG`), returned as soon as it listens,
    /// ready or not: discovery tests watch it become ready.
    pub fn serve_listening(
        endpoints: &[&str],
        args: &[&str],
        env: &[(&str, &Path)],
    ) -> RouterProcess {
        let full = Self::serve_argv(endpoints, args);
        Self::spawn_listening(
            full,
            env,
            Stdio::inherit(),
            "switchyard router listening on ",
        )
    }

    /// `switchyard serve …` with its log (stderr) written to `log`, returned as soon as it
    /// listens (over HTTP or, with `--tls-cert`, HTTPS), ready or not.
    pub fn serve_listening_logging_to(
        endpoints: &[&str],
        args: &[&str],
        log: &Path,
    ) -> RouterProcess {
        let file = std::fs::File::create(log).expect("can create the log file");
        let full = Self::serve_argv(endpoints, args);
        Self::spawn_listening(
            full,
            &[],
            Stdio::from(file),
            "switchyard router listening on ",
        )
    }

    fn serve_to(endpoints: &[&str], args: &[&str], stderr: Stdio) -> RouterProcess {
        let full = Self::serve_argv(endpoints, args);
        Self::spawn(full, &[], stderr, "switchyard router listening on ")
    }

    fn serve_argv(endpoints: &[&str], args: &[&str]) -> Vec<String> {
        let mut full: Vec<String> = vec!["serve".into(), "--port".into(), "0".into()];
        // The checkout's plugins, unless the test brings a directory of its own.
        if !args.contains(&"--plugins") {
            full.push("--plugins".into());
            full.push(plugins_dir().display().to_string());
        }
        for e in endpoints {
            full.push("--endpoint".into());
            full.push((*e).to_owned());
        }
        full.extend(args.iter().map(|a| (*a).to_owned()));
        full
    }

    /// `switchyard sidecar --port 0 ARGS…` with `env` set (e.g. `KUBECONFIG`); waits until
    /// `/health` answers 200 with every endpoint (the decode engine, the allowed prefill
    /// engines) healthy.
    pub fn sidecar(args: &[&str], env: &[(&str, &Path)]) -> RouterProcess {
        let mut full: Vec<String> = vec!["sidecar".into(), "--port".into(), "0".into()];
        full.extend(args.iter().map(|a| (*a).to_owned()));
        let sidecar = Self::spawn(
            full,
            env,
            Stdio::inherit(),
            "switchyard sidecar listening on ",
        );
        sidecar.wait_until_healthy();
        sidecar
    }

    /// `switchyard up --port 0 --plugins <checkout>/plugins ARGS…`; waits until `/health`
    /// answers 200.
    pub fn up(args: &[&str]) -> UpProcess {
        Self::spawn_up(&plugins_dir(), &[], args)
    }

    /// `switchyard up --port 0 --plugins PLUGINS ARGS…` with compiled policies cached in
    /// `cache_dir` (`SWITCHYARD_CACHE`), so components that take seconds to compile (Python,
    /// JavaScript) are compiled once per content rather than once per test, and never into the
    /// user's cache directory.
    pub fn up_with_plugins(plugins: &Path, cache_dir: &Path, args: &[&str]) -> UpProcess {
        Self::spawn_up(plugins, &[("SWITCHYARD_CACHE", cache_dir)], args)
    }

    fn spawn_up(plugins: &Path, env: &[(&str, &Path)], args: &[&str]) -> UpProcess {
        let mut full: Vec<String> = vec!["up".into(), "--port".into(), "0".into()];
        full.push("--plugins".into());
        full.push(plugins.display().to_string());
        full.extend(args.iter().map(|a| (*a).to_owned()));
        let router = Self::spawn(full, env, Stdio::inherit(), "switchyard router ready on ");
        router.wait_until_healthy();
        router
    }

    fn spawn(
        args: Vec<String>,
        env: &[(&str, &Path)],
        stderr: Stdio,
        ready_prefix: &'static str,
    ) -> RouterProcess {
        let router = Self::spawn_listening(args, env, stderr, ready_prefix);
        wait_for_200(router.addr, "/health", "router", &router.url);
        router
    }

    fn spawn_listening(
        args: Vec<String>,
        env: &[(&str, &Path)],
        stderr: Stdio,
        ready_prefix: &'static str,
    ) -> RouterProcess {
        let (child, url) = spawn_switchyard(&args, env, stderr, STARTUP_TIMEOUT * 2, move |line| {
            line.strip_prefix(ready_prefix)
                .map(|url| url.trim().to_owned())
        });
        let addr: SocketAddr = url
            .strip_prefix("http://")
            .or_else(|| url.strip_prefix("https://"))
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| panic!("unexpected router URL {url:?}"));
        RouterProcess { child, url, addr }
    }

    /// Ready, and every endpoint healthy: tests start from the whole cluster.
    fn wait_until_healthy(&self) {
        wait_for(self.addr, "/health", "router", &self.url, |body| {
            body.contains(r#""down":[]"#)
        });
    }

    /// `url` + `path`.
    pub fn endpoint(&self, path: &str) -> String {
        format!("{}{path}", self.url)
    }

    /// The process id (for `/proc/<pid>/…` and its children).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Send `signal` (e.g. SIGTERM, to watch what the router does while it drains).
    pub fn signal(&self, signal: rustix::process::Signal) {
        signal_child(&self.child, signal);
    }

    /// Wait (bounded by `within`) for the process to exit; returns its exit status.
    pub fn wait_exit(mut self, within: Duration) -> Option<std::process::ExitStatus> {
        wait_child(&mut self.child, within)
    }

    /// Send SIGTERM and wait (bounded) for a clean exit; returns the exit status.
    pub fn terminate(self) -> Option<std::process::ExitStatus> {
        self.signal(rustix::process::Signal::TERM);
        self.wait_exit(STARTUP_TIMEOUT)
    }
}

impl Drop for RouterProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A `switchyard epp` child process (the Endpoint Picker), killed when dropped.
pub struct EppProcess {
    child: Child,
    /// The ext_proc gRPC service.
    pub grpc: SocketAddr,
    /// The gRPC health services.
    pub grpc_health: SocketAddr,
    /// `http://127.0.0.1:PORT` of `/metrics`, `/health` and `/livez`.
    pub metrics_url: String,
    pub metrics: SocketAddr,
    /// Its flags but the ports, and its environment, for [`EppProcess::restart`].
    rest: Vec<String>,
    env: Vec<(String, PathBuf)>,
}

impl EppProcess {
    /// `switchyard epp` on free ports, `--plugins <checkout>/plugins` (unless ARGS name other
    /// `--plugins`), `--endpoint URL…` and ARGS; waits until every endpoint is healthy.
    pub fn start(endpoints: &[&str], args: &[&str]) -> EppProcess {
        Self::start_with_env(endpoints, args, &[])
    }

    /// [`EppProcess::start`] with `env` set (e.g. `KUBECONFIG`), also when restarted.
    pub fn start_with_env(endpoints: &[&str], args: &[&str], env: &[(&str, &Path)]) -> EppProcess {
        let rest: Vec<String> = RouterProcess::serve_argv(endpoints, args)
            .into_iter()
            .skip(3)
            .collect();
        let env = env
            .iter()
            .map(|(name, value)| ((*name).to_owned(), value.to_path_buf()))
            .collect();
        Self::spawn(["0", "0", "0"].map(str::to_owned), rest, env)
    }

    /// Kill it if it still runs, then start it again with the same flags on the same ports,
    /// and wait until every endpoint is healthy.
    pub fn restart(&mut self) {
        self.kill();
        let ports = [self.grpc, self.grpc_health, self.metrics].map(|a| a.port().to_string());
        let again = Self::spawn(
            ports,
            std::mem::take(&mut self.rest),
            std::mem::take(&mut self.env),
        );
        *self = again;
    }

    /// `switchyard epp` on `ports` (ext_proc, gRPC health, metrics; 0 picks a free one) with
    /// `rest` of its flags.
    fn spawn(
        [grpc, health, metrics]: [String; 3],
        rest: Vec<String>,
        env: Vec<(String, PathBuf)>,
    ) -> EppProcess {
        let mut full: Vec<String> = vec!["epp".into(), "--grpc-port".into(), grpc];
        full.extend(["--grpc-health-port".into(), health]);
        full.extend(["--metrics-port".into(), metrics]);
        full.extend(rest.iter().cloned());
        let env_refs: Vec<(&str, &Path)> = env
            .iter()
            .map(|(name, value)| (name.as_str(), value.as_path()))
            .collect();
        let (child, line) = spawn_switchyard(
            &full,
            &env_refs,
            Stdio::inherit(),
            STARTUP_TIMEOUT * 2,
            |line| {
                line.strip_prefix("switchyard epp listening on ")
                    .map(str::to_owned)
            },
        );
        // `grpc://A (health grpc://B, metrics http://C)`
        let addrs: Vec<SocketAddr> = line
            .split(['(', ')', ',', ' '])
            .filter_map(|word| word.split_once("://")?.1.parse().ok())
            .collect();
        let [grpc, grpc_health, metrics] = addrs[..] else {
            panic!("unexpected epp ready line {line:?}");
        };
        let epp = EppProcess {
            child,
            grpc,
            grpc_health,
            metrics_url: format!("http://{metrics}"),
            metrics,
            rest,
            env,
        };
        wait_for(metrics, "/health", "epp", &epp.metrics_url, |body| {
            body.contains(r#""down":[]"#)
        });
        epp
    }

    /// SIGKILL, and wait until the process is gone.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Send `signal` (e.g. SIGTERM, to watch the EPP drain).
    pub fn signal(&self, signal: rustix::process::Signal) {
        signal_child(&self.child, signal);
    }

    /// Wait (bounded by `within`) for the process to exit by itself; returns its exit status.
    pub fn wait_exit(&mut self, within: Duration) -> Option<std::process::ExitStatus> {
        wait_child(&mut self.child, within)
    }
}

/// Send `signal` to a child process that is still running.
fn signal_child(child: &Child, signal: rustix::process::Signal) {
    let pid = rustix::process::Pid::from_raw(child.id() as i32).expect("a child's pid");
    rustix::process::kill_process(pid, signal).expect("the process exists");
}

/// Wait (bounded by `within`) for `child` to exit; its exit status, `None` if it still runs.
fn wait_child(child: &mut Child, within: Duration) -> Option<std::process::ExitStatus> {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if let Ok(Some(status)) = child.try_wait() {
            return Some(status);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

impl Drop for EppProcess {
    fn drop(&mut self) {
        self.kill();
    }
}
