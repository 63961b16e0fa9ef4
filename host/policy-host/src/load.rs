//! Loading a policy, one checked step at a time: bytes → is it a component → compile (cached) →
//! type-check against the `policy` world of each contract version → instantiate → `init(config)`
//! → `describe` → an executor serving with that instance. Each step has its own `LoadError`
//! variant, so the message says where a bad file failed.

use std::path::PathBuf;
use std::sync::Arc;

use sha2::{Digest, Sha256};
use wasmtime::component::Component;

use super::bindings::{Contract, GuestPre};
use super::executor::Executor;
use super::instance::{BuildError, Factory};
use super::{HostInner, LoadError, Policy, PolicyInfo};

/// The first 8 bytes of a component: `\0asm`, version 0x0d, layer 1.
const WASM_MAGIC: [u8; 4] = *b"\0asm";
const COMPONENT_VERSION: [u8; 4] = [0x0d, 0x00, 0x01, 0x00];
const CORE_MODULE_VERSION: [u8; 4] = [0x01, 0x00, 0x00, 0x00];

pub(super) fn load(
    host: &HostInner,
    name: &str,
    bytes: &[u8],
    config_json: Option<&str>,
    source: Option<PathBuf>,
) -> Result<Policy, LoadError> {
    check_is_component(name, bytes)?;
    let config = check_config(name, config_json)?;
    let sha256 = sha256_hex(bytes);
    let component = host.engine.component(name, &sha256, bytes)?;
    let pre = type_check(host, name, &component)?;
    let contract = pre.contract();
    let factory = Factory::new(
        Arc::from(name),
        host.engine.engine().clone(),
        host.engine.ticker(),
        pre,
        config,
        host.limits.clone(),
        host.environment.clone(),
    );
    let start_error = |reason: String| LoadError::Instantiate {
        policy: name.to_owned(),
        reason,
    };
    let mut first = factory.build().map_err(|error| match error {
        BuildError::Init(message) => LoadError::Init {
            policy: name.to_owned(),
            message,
        },
        BuildError::Fault(fault) => start_error(fault.to_string()),
    })?;
    let described = factory
        .describe(&mut first)
        .map_err(|fault| start_error(fault.to_string()))?;
    let info = PolicyInfo {
        name: name.to_owned(),
        sha256,
        language: described.language,
        prompt_tokens: described.prompt_tokens,
        source,
        contract,
        stateless: described.stateless,
        reads: described.reads,
    };
    tracing::info!(policy = %info.name, language = %info.language, sha256 = %info.sha256,
        prompt_tokens = info.prompt_tokens, %contract, stateless = info.stateless,
        reads = ?crate::reads_names(info.reads), "policy loaded");
    let pool_size = host.limits.pool_size;
    let executor = Executor::start(factory, first, info.stateless, pool_size);
    Ok(Policy::new(info, executor))
}

/// The lower-case hex sha256 a policy version is known by.
pub(super) fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// Read the header ourselves: wasmtime's error for a core module or a random file is correct
/// but does not tell an operator what to do about it.
fn check_is_component(name: &str, bytes: &[u8]) -> Result<(), LoadError> {
    let not = |reason: String| LoadError::NotAComponent {
        policy: name.to_owned(),
        reason,
    };
    let (Some(magic), Some(version)) = (bytes.get(0..4), bytes.get(4..8)) else {
        return Err(not(format!(
            "the file is {} bytes long, too short to be WebAssembly",
            bytes.len()
        )));
    };
    if magic != WASM_MAGIC {
        return Err(not(
            "the file is not WebAssembly (it does not start with `\\0asm`)".to_owned(),
        ));
    }
    if version == CORE_MODULE_VERSION {
        return Err(not(
            "the file is a core WebAssembly module, not a component; build the \
             policy for `wasm32-wasip2` or wrap it with `wasm-tools component new`"
                .to_owned(),
        ));
    }
    if version != COMPONENT_VERSION {
        return Err(not(format!(
            "unsupported WebAssembly version/layer bytes {version:02x?} (a component has {COMPONENT_VERSION:02x?})"
        )));
    }
    Ok(())
}

/// The config is handed to the guest as a string, but a typo in it should fail here, naming the
/// policy, rather than inside whatever JSON parser the guest carries.
fn check_config(name: &str, config_json: Option<&str>) -> Result<String, LoadError> {
    let config = config_json.unwrap_or("{}");
    serde_json::from_str::<serde_json::Value>(config).map_err(|e| LoadError::Config {
        policy: name.to_owned(),
        reason: e.to_string(),
    })?;
    Ok(config.to_owned())
}

/// Check the component against what the host provides (imports) and what the `policy` world of
/// each contract version requires (exports), newest version first, once, so every later
/// instantiation is cheap.
fn type_check(host: &HostInner, name: &str, component: &Component) -> Result<GuestPre, LoadError> {
    let wrong_world = |reason: String| LoadError::WrongWorld {
        policy: name.to_owned(),
        reason,
    };
    let mut import_errors = Vec::new();
    let mut export_errors = Vec::new();
    for contract in Contract::ALL {
        let pre = match host.linkers.get(contract).instantiate_pre(component) {
            Ok(pre) => pre,
            Err(e) => {
                import_errors.push(format!("{contract}: {e:#}"));
                continue;
            }
        };
        match GuestPre::new(contract, pre) {
            Ok(pre) => return Ok(pre),
            Err(e) => export_errors.push(format!("{contract}: {e:#}")),
        }
    }
    if export_errors.is_empty() {
        return Err(wrong_world(format!(
            "it imports something the policy host does not provide (only `log` and WASI p2 are \
             available): {}",
            import_errors.join("; ")
        )));
    }
    Err(wrong_world(format!(
        "it does not export the `policy` world of any contract version this host loads: {}",
        export_errors.join("; ")
    )))
}
