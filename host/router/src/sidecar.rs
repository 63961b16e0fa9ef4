//! `switchyard sidecar`: the router in a decode pod, in front of its one decode engine, running
//! the disaggregated handoff a gateway's Endpoint Picker asked for.
//!
//! In the Gateway API Inference Extension's model the gateway sends a request to one pod; for
//! P/D, the EPP picks the decode pod and names the prefill engine in `x-prefiller-host-port`
//! (switchyard's EPP and llm-d's alike). The sidecar reads that header and runs the handoff
//! through the router's own plan executor and retry loop: the same legs as `serve` (MLC's
//! `prep_recv` → `remote_send` → `start_generate`, vLLM's prefill-then-decode, SGLang's
//! bootstrap rooms), the same continuation after a preemption or a broken stream, and the same
//! guarantee that no KV is left reserved, leased or paired when an attempt ends. What differs
//! from `serve` is only who plans: not a policy, but [`SidecarPlanner`], which plans the
//! handoff the header names, a forward to the decode engine without one, and a forward (the
//! decode engine prefilling itself) when the named prefill engine fails.
//!
//! The header crosses the gateway, so it may not name just any host: the prefill engines the
//! sidecar may call are its `--prefill-allow` list and the pods discovery finds. Any other
//! value (malformed, the sidecar itself, an engine not listed) is a 400 before any call.
//!
//! Endpoint 0 is the decode engine (`--decode`, role decode, MLC's `--device-rank`); the
//! allowed prefill engines follow (role prefill, the same protocol, SGLang's with `--bootstrap-port`). Everything else
//! is `serve`'s: its flags and config file, probes, outlier ejection, admission control,
//! `/metrics` (with `switchyard_sidecar_prefill_fallbacks_total`) and draining.

mod planner;
mod target;

use std::future::Future;
use std::sync::Arc;

use switchyard_contract::Protocol;

use crate::api::BuiltinPlanner;
use crate::config::{Config, ConfigError, ServeArgs};
use crate::epp::wire::PREFILLER;
use crate::serve::{RunningRouter, ServeError, bind, load_builtin, serve_openai};

pub use planner::{DECODE, SidecarPlanner};
pub use target::{Target, TargetError};

/// `switchyard sidecar` flags: the decode engine, the prefill engines it may call, and
/// `serve`'s (but its engines and policies: the sidecar has one engine and plans itself; a
/// config file's `[[endpoints]]` are replaced by these, as `--endpoint` flags replace them).
#[derive(Debug, Clone, clap::Args)]
pub struct SidecarArgs {
    /// The decode engine's base URL, e.g. `http://127.0.0.1:8200`.
    #[arg(long, value_name = "URL")]
    pub decode: String,
    /// The engines' protocol: mlc, vllm or sglang.
    #[arg(long, value_parser = parse_protocol)]
    pub protocol: Protocol,
    /// SGLang: the prefill engines' bootstrap port (`--disaggregation-bootstrap-port`), the
    /// same for every `--prefill-allow` engine (discovered pods may give theirs in the
    /// `sglang.ai/bootstrap-port` annotation).
    #[arg(long)]
    pub bootstrap_port: Option<u16>,
    /// MLC: the decode engine's device rank in the KV-transfer world (its `--device-rank`),
    /// which prefill engines send its KV to [default: 0].
    #[arg(long)]
    pub device_rank: Option<u32>,
    /// A prefill engine requests may name in `x-prefiller-host-port` (repeat for each). Any
    /// other value is refused with 400 and no call; with none (and no discovery) the sidecar
    /// only forwards to the decode engine.
    #[arg(long = "prefill-allow", value_name = "HOST:PORT")]
    pub prefill_allow: Vec<String>,
    #[command(flatten)]
    pub serve: ServeArgs,
}

fn parse_protocol(value: &str) -> Result<Protocol, String> {
    match value.parse()? {
        Protocol::Openai => {
            Err("openai endpoints have no KV handoff: expected mlc, vllm or sglang".into())
        }
        protocol => Ok(protocol),
    }
}

/// Why the sidecar's flags cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum SidecarConfigError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("--prefill-allow {value:?}: {reason}")]
    PrefillAllow { value: String, reason: TargetError },
    #[error(
        "--protocol sglang with --prefill-allow needs --bootstrap-port (the prefill engines' bootstrap server)"
    )]
    NoBootstrapPort,
    #[error("--bootstrap-port is for --protocol sglang only")]
    BootstrapPortNotSglang,
    #[error("--device-rank is for --protocol mlc only")]
    DeviceRankNotMlc,
    #[error("the sidecar's engines are --decode and --prefill-allow: it takes no --endpoint")]
    Endpoints,
}

/// The validated configuration of `switchyard sidecar`: `serve`'s, its endpoints the decode
/// engine then the allowed prefill engines.
#[derive(Debug, Clone)]
pub struct SidecarConfig {
    pub router: Config,
}

impl SidecarConfig {
    pub fn from_args(args: &SidecarArgs) -> Result<SidecarConfig, SidecarConfigError> {
        let sglang = args.protocol == Protocol::Sglang;
        if args.bootstrap_port.is_some() && !sglang {
            return Err(SidecarConfigError::BootstrapPortNotSglang);
        }
        if args.device_rank.is_some() && args.protocol != Protocol::Mlc {
            return Err(SidecarConfigError::DeviceRankNotMlc);
        }
        if sglang && args.bootstrap_port.is_none() && !args.prefill_allow.is_empty() {
            return Err(SidecarConfigError::NoBootstrapPort);
        }
        if !args.serve.endpoints.is_empty() {
            return Err(SidecarConfigError::Endpoints);
        }
        let protocol = args.protocol;
        let mut serve = args.serve.clone();
        serve
            .endpoints
            .push(format!("{protocol}+{},role=decode", args.decode));
        for value in &args.prefill_allow {
            let target =
                Target::parse(value).map_err(|reason| SidecarConfigError::PrefillAllow {
                    value: value.clone(),
                    reason,
                })?;
            let bootstrap = args
                .bootstrap_port
                .map(|port| format!(",bootstrap_port={port}"))
                .unwrap_or_default();
            serve.endpoints.push(format!(
                "{protocol}+http://{target},role=prefill{bootstrap}"
            ));
        }
        let mut router = Config::with_builtin_planner(&serve)?;
        router.endpoints[0].device_rank = args.device_rank;
        router.policies.forward_headers.push(PREFILLER.to_owned());
        Ok(SidecarConfig { router })
    }
}

/// Load everything, bind, and start serving in the background.
pub async fn start(config: &SidecarConfig) -> Result<RunningRouter, ServeError> {
    let config = &config.router;
    // Bound first: the planner refuses a header naming the sidecar's own address.
    let (listener, addr) = bind(config.listen).await?;
    let loaded = load_builtin(config, |executor| {
        Arc::new(SidecarPlanner::new(Arc::clone(executor.cluster()), addr))
            as Arc<dyn BuiltinPlanner>
    })
    .await?;
    tracing::info!(decode = %config.endpoints[0].url, prefill_allowed = config.endpoints.len() - 1, "sidecar");
    serve_openai(config, loaded, listener, addr).await
}

/// Run the sidecar until `shutdown` resolves, then drain it, skipping what is left of the
/// drain when `hurry` resolves.
pub async fn run(
    config: SidecarConfig,
    shutdown: impl Future<Output = ()>,
    hurry: impl Future<Output = ()>,
) -> Result<(), ServeError> {
    let sidecar = start(&config).await?;
    println!("switchyard sidecar listening on http://{}", sidecar.addr());
    shutdown.await;
    sidecar.shutdown_or_hurry(hurry).await
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Debug, clap::Parser)]
    struct Cli {
        #[command(flatten)]
        sidecar: SidecarArgs,
    }

    fn config(args: &[&str]) -> Result<SidecarConfig, SidecarConfigError> {
        let cli = Cli::try_parse_from(std::iter::once("sidecar").chain(args.iter().copied()))
            .expect("parsed");
        SidecarConfig::from_args(&cli.sidecar)
    }

    #[test]
    fn the_decode_engine_is_endpoint_0_and_the_allowed_prefill_engines_follow() {
        let config = config(&[
            "--decode",
            "http://127.0.0.1:8200",
            "--protocol",
            "sglang",
            "--bootstrap-port",
            "8998",
            "--prefill-allow",
            "10.0.0.5:8000",
            "--prefill-allow",
            "[fd00::7]:8000",
        ])
        .expect("valid");
        let endpoints = &config.router.endpoints;
        let urls: Vec<&str> = endpoints.iter().map(|e| e.url.as_str()).collect();
        assert_eq!(
            urls,
            [
                "http://127.0.0.1:8200",
                "http://10.0.0.5:8000",
                "http://[fd00::7]:8000"
            ]
        );
        assert!(endpoints.iter().all(|e| e.protocol == Protocol::Sglang));
        assert_eq!(endpoints[0].bootstrap_port, None);
        assert!(
            endpoints[1..]
                .iter()
                .all(|e| e.bootstrap_port == Some(8998))
        );
        assert!(
            config
                .router
                .policies
                .forward_headers
                .iter()
                .any(|h| h == PREFILLER)
        );
    }

    #[test]
    fn flags_that_do_not_fit_are_refused() {
        let refused = |args: &[&str]| config(args).expect_err("refused");
        let with =
            |rest: &[&'static str]| [&["--decode", "http://127.0.0.1:8200"][..], rest].concat();
        assert!(matches!(
            refused(&with(&[
                "--protocol",
                "vllm",
                "--prefill-allow",
                "10.0.0.5"
            ])),
            SidecarConfigError::PrefillAllow { .. }
        ));
        assert!(matches!(
            refused(&with(&[
                "--protocol",
                "sglang",
                "--prefill-allow",
                "10.0.0.5:8000"
            ])),
            SidecarConfigError::NoBootstrapPort
        ));
        assert!(matches!(
            refused(&with(&["--protocol", "vllm", "--bootstrap-port", "8998"])),
            SidecarConfigError::BootstrapPortNotSglang
        ));
        assert!(matches!(
            refused(&with(&["--protocol", "vllm", "--device-rank", "1"])),
            SidecarConfigError::DeviceRankNotMlc
        ));
        assert!(matches!(
            refused(&with(&[
                "--protocol",
                "mlc",
                "--endpoint",
                "http://127.0.0.1:1"
            ])),
            SidecarConfigError::Endpoints
        ));
        let openai =
            Cli::try_parse_from(["sidecar", "--decode", "http://x:1", "--protocol", "openai"]);
        assert!(openai.is_err(), "openai engines have no handoff");
        // No policy file is needed: the plugins directory may not exist.
        config(&with(&["--protocol", "mlc", "--plugins", "/nonexistent"])).expect("valid");
    }

    /// What llm-d's routing sidecar reads (llm-d-inference-scheduler, pkg/common's
    /// `PrefillPodHeader`, split with Go's `net.SplitHostPort`): the header's name, and
    /// `host:port` with an IPv6 host in brackets, as switchyard's EPP writes the prefill
    /// endpoint's address (`Cluster::address`).
    #[test]
    fn the_epp_names_the_prefill_engine_as_llm_d_s_sidecar_reads_it() {
        use crate::cluster::{Cluster, EndpointSpec, OutlierConfig};
        assert_eq!(PREFILLER, "x-prefiller-host-port");
        let urls = [
            ("http://10.0.3.7:8000", "10.0.3.7:8000"),
            ("http://[fd00::7]:8000", "[fd00::7]:8000"),
            ("http://prefill-0.llama:8000", "prefill-0.llama:8000"),
            ("http://10.0.3.8", "10.0.3.8:80"),
        ];
        let specs = urls
            .iter()
            .map(|(url, _)| EndpointSpec::new((*url).to_owned()));
        let cluster = Cluster::new(specs.collect(), OutlierConfig::default());
        for (id, (url, host_port)) in urls.iter().enumerate() {
            let address = cluster.address(id as u32).expect("an address");
            assert_eq!(address, *host_port, "{url}");
            // And the sidecar reads back what it names.
            let target = Target::parse(&address).expect("valid");
            assert_eq!(target.address(), address, "{url}");
        }
    }
}
