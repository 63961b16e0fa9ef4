use std::net::IpAddr;
use std::path::Path;
use std::time::Duration;

use switchyard_contract::Role;
use switchyard_policy_host::QuarantineRule;

use super::*;
use crate::RetryPolicyError;
use crate::api::FlowControl;

mod golden;

fn plugins_with(name: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join(format!("{name}.wasm")), b"\0asm").expect("write");
    dir
}

fn args(plugins: &Path) -> ServeArgs {
    ServeArgs {
        endpoints: vec!["http://127.0.0.1:1".into(), "http://127.0.0.1:2".into()],
        router: RouterArgs {
            plugins: Some(plugins.to_owned()),
            ..RouterArgs::default()
        },
        ..ServeArgs::default()
    }
}

/// `ServeArgs` naming the config file `file`, which holds `text`.
fn with_file(file: &Path, text: &str) -> ServeArgs {
    std::fs::write(file, text).expect("write");
    ServeArgs {
        config: Some(file.to_owned()),
        ..ServeArgs::default()
    }
}

/// The error's source and problem, when it is about one value.
fn invalid(error: ConfigError) -> (Source, Problem) {
    match error {
        ConfigError::Invalid { at, problem } => (at, problem),
        other => panic!("not an invalid value: {other}"),
    }
}

/// The key and line a file source names.
fn key_and_line(source: &Source) -> (&str, usize) {
    match source {
        Source::File(at) => (&at.key, at.line),
        other => panic!("not a file's key: {other}"),
    }
}

#[test]
fn model_dir_must_hold_a_tokenizer_or_be_a_gguf() {
    let plugins = plugins_with("disagg");
    let with = |path: &Path| {
        let mut a = args(plugins.path());
        a.router.model_dir = Some(path.to_owned());
        Config::from_args(&a)
    };
    let empty = tempfile::tempdir().expect("tempdir");
    let (at, problem) = invalid(with(empty.path()).expect_err("no tokenizer.json"));
    assert_eq!(at, Source::Flag("model-dir"));
    assert_eq!(problem, Problem::NoTokenizer(empty.path().to_owned()));
    let not_gguf = empty.path().join("weights.gguf");
    std::fs::write(&not_gguf, b"GGML but not GGUF").expect("write");
    let (_, problem) = invalid(with(&not_gguf).expect_err("not a GGUF"));
    assert!(matches!(problem, Problem::NotAGguf { .. }), "{problem}");
    // A directory is named after itself, and leaves the context length at the default.
    let model = tempfile::tempdir().expect("tempdir");
    let dir = model.path().join("tiny-llama");
    std::fs::create_dir(&dir).expect("mkdir");
    std::fs::write(dir.join("tokenizer.json"), b"{}").expect("write");
    let config = with(&dir).expect("a model directory");
    assert_eq!(config.model, "tiny-llama");
    assert_eq!(config.limits.context_length, DEFAULT_CONTEXT_LENGTH);
}

#[test]
fn flags_give_a_config_with_defaults() {
    let dir = plugins_with("disagg");
    let config = Config::from_args(&args(dir.path())).expect("valid");
    assert_eq!(config.listen, "127.0.0.1:8000".parse().expect("addr"));
    assert_eq!(config.endpoints.len(), 2);
    assert_eq!(config.policy_path, dir.path().join("disagg.wasm"));
    assert_eq!(config.max_body_bytes, DEFAULT_MAX_BODY_BYTES);
    assert_eq!(config.routing, RouterConfig::default());
    assert_eq!(config.timeouts, Timeouts::default());
    assert_eq!(config.outlier, OutlierConfig::default());
    // The defaults `--help` and the README give.
    assert_eq!(config.max_body_bytes, 4 << 20);
    assert_eq!(config.routing.retry.max_attempts(), 3);
    assert_eq!(
        config.limits,
        RequestLimits {
            context_length: 32768,
            max_prompt_tokens: 32767,
        }
    );
    assert_eq!(
        config.admission,
        AdmissionConfig {
            max_concurrent: 1024,
            max_queued: 1024,
            queue_timeout: Duration::from_secs(5),
            flow: FlowControl::default(),
        }
    );
    assert_eq!(
        config.connections,
        ConnectionLimits {
            header_read_timeout: Duration::from_secs(10),
            body_read_timeout: Duration::from_secs(30),
            keep_alive_timeout: Duration::from_secs(75),
            max_connections: 4096,
        }
    );
    assert_eq!(
        config.drain,
        DrainConfig {
            delay: Duration::from_secs(5),
            grace: Duration::from_secs(30),
        }
    );
}

#[test]
fn a_flag_wins_over_the_file_and_the_file_over_the_default() {
    let dir = plugins_with("disagg");
    let file = dir.path().join("router.toml");
    let mut a = with_file(
        &file,
        &format!(
            "plugins = {:?}\nport = 9000\nmax_body_bytes = 1024\nrequest_timeout = \"90s\"\n\
             forward_headers = [\"x-tenant\"]\n[[endpoints]]\nurl = \"http://127.0.0.1:1\"\n",
            dir.path()
        ),
    );
    let config = Config::from_args(&a).expect("valid");
    assert_eq!(config.listen.port(), 9000);
    assert_eq!(config.max_body_bytes, 1024);
    assert_eq!(config.routing.request_timeout, Duration::from_secs(90));
    assert_eq!(config.policies.forward_headers, ["x-tenant"]);
    assert_eq!(config.default_max_tokens, DEFAULT_MAX_TOKENS);

    a.router.port = Some(9100);
    a.router.request_timeout = Some(Duration::from_secs(5));
    a.router.forward_headers = vec!["X-Priority".into()];
    a.endpoints = vec!["http://127.0.0.1:2".into(), "http://127.0.0.1:3".into()];
    let config = Config::from_args(&a).expect("valid");
    assert_eq!(config.listen.port(), 9100);
    assert_eq!(config.routing.request_timeout, Duration::from_secs(5));
    assert_eq!(config.policies.forward_headers, ["x-priority"]);
    // --endpoint flags replace the file's endpoints, which a SIGHUP then does not re-read.
    assert_eq!(config.endpoints.len(), 2);
    assert_eq!(config.endpoints_file, None);
    // What the flags leave alone still comes from the file.
    assert_eq!(config.max_body_bytes, 1024);
}

#[test]
fn an_error_names_the_flag_or_the_file_and_line_its_value_came_from() {
    let dir = plugins_with("disagg");
    let file = dir.path().join("router.toml");
    let mut a = with_file(
        &file,
        &format!(
            "# the router\nplugins = {:?}\n\nmax_body_bytes = 0\n\
             [[endpoints]]\nurl = \"http://127.0.0.1:1\"\n",
            dir.path()
        ),
    );
    let error = Config::from_args(&a).expect_err("zero bytes");
    assert_eq!(
        error.to_string(),
        format!(
            "max_body_bytes in {} line 4: must be at least 1",
            file.display()
        )
    );
    let (at, problem) = invalid(error);
    assert_eq!(key_and_line(&at), ("max_body_bytes", 4));
    assert_eq!(problem, Problem::AtLeast(1));

    a.router.max_body_bytes = Some(0);
    let error = Config::from_args(&a).expect_err("zero bytes");
    assert_eq!(error.to_string(), "--max-body-bytes: must be at least 1");
    a.router.max_body_bytes = Some(1);
    assert!(Config::from_args(&a).is_ok(), "the flag's good value wins");
}

#[test]
fn a_value_equal_to_its_variable_is_reported_as_the_variable() {
    // clap fills an absent flag from its variable without saying so; PATH is set wherever
    // tests run, and read here, never written.
    let path = std::env::var("PATH").expect("PATH is set");
    assert_eq!(
        Source::flag_or_env("admin-token", "PATH", &path),
        Source::Env("PATH")
    );
    assert_eq!(
        Source::flag_or_env("admin-token", "PATH", "another value"),
        Source::Flag("admin-token")
    );
    assert_eq!(Source::Env("PATH").to_string(), "PATH in the environment");
}

#[test]
fn edge_settings_come_from_flags_over_the_file_and_are_checked() {
    let dir = plugins_with("disagg");
    let file = dir.path().join("router.toml");
    let mut a = with_file(
        &file,
        &format!(
            "plugins = {:?}\nmax_concurrent_requests = 8\nmax_queued_requests = 0\n\
             queue_timeout = \"250ms\"\nheader_read_timeout = \"2s\"\n\
             body_read_timeout = \"3s\"\nkeep_alive_timeout = \"4s\"\nmax_connections = 16\n\
             drain_delay = \"0s\"\nshutdown_grace = \"1m\"\n\
             [[endpoints]]\nurl = \"http://127.0.0.1:1\"\n",
            dir.path()
        ),
    );
    let config = Config::from_args(&a).expect("valid");
    assert_eq!(
        config.admission,
        AdmissionConfig {
            max_concurrent: 8,
            max_queued: 0,
            queue_timeout: Duration::from_millis(250),
            flow: FlowControl::default(),
        }
    );
    assert_eq!(
        config.connections,
        ConnectionLimits {
            header_read_timeout: Duration::from_secs(2),
            body_read_timeout: Duration::from_secs(3),
            keep_alive_timeout: Duration::from_secs(4),
            max_connections: 16,
        }
    );
    assert_eq!(
        config.drain,
        DrainConfig {
            delay: Duration::ZERO,
            grace: Duration::from_secs(60),
        }
    );
    a.router.max_concurrent_requests = Some(2);
    a.router.drain_delay = Some(Duration::from_secs(1));
    let config = Config::from_args(&a).expect("valid");
    assert_eq!(config.admission.max_concurrent, 2);
    assert_eq!(config.drain.delay, Duration::from_secs(1));

    a.router.max_concurrent_requests = Some(0);
    assert_eq!(
        invalid(Config::from_args(&a).expect_err("zero")),
        (Source::Flag("max-concurrent-requests"), Problem::AtLeast(1))
    );
    a.router.max_concurrent_requests = None;
    a.router.max_connections = Some(0);
    assert_eq!(
        invalid(Config::from_args(&a).expect_err("zero")),
        (Source::Flag("max-connections"), Problem::AtLeast(1))
    );
    a.router.max_connections = None;
    a.router.header_read_timeout = Some(Duration::ZERO);
    assert_eq!(
        invalid(Config::from_args(&a).expect_err("zero")),
        (Source::Flag("header-read-timeout"), Problem::ZeroDuration)
    );
}

/// A config file naming `plugins`, one endpoint, and the top-level `line`.
fn one_endpoint_with(plugins: &Path, line: &str) -> String {
    format!("plugins = {plugins:?}\n{line}\n[[endpoints]]\nurl = \"http://127.0.0.1:1\"\n")
}

#[test]
fn workers_come_from_the_flag_over_the_file_over_the_cores() {
    let dir = plugins_with("disagg");
    let file = dir.path().join("router.toml");
    let text = |workers: &str| one_endpoint_with(dir.path(), workers);
    let mut a = with_file(&file, &text(""));
    let cores = std::thread::available_parallelism().expect("a core count");
    assert_eq!(Config::from_args(&a).expect("valid").workers, cores);
    with_file(&file, &text("workers = 3"));
    assert_eq!(Config::from_args(&a).expect("valid").workers.get(), 3);
    a.router.workers = NonZeroUsize::new(5);
    assert_eq!(Config::from_args(&a).expect("valid").workers.get(), 5);
    a.router.workers = None;
    with_file(&file, &text("workers = 0"));
    let (at, problem) = invalid(Config::from_args(&a).expect_err("zero workers"));
    assert_eq!(key_and_line(&at), ("workers", 2));
    assert!(matches!(problem, Problem::Value(_)), "{problem}");
}

/// A worker's spin before it sleeps: 20 µs unless the file or the flag says, zero turns it off,
/// and one long enough to keep a core busy for nothing is refused.
#[test]
fn the_workers_spin_comes_from_flag_over_file_and_is_brief() {
    let dir = plugins_with("disagg");
    let file = dir.path().join("router.toml");
    let text = |spin: &str| one_endpoint_with(dir.path(), spin);
    let mut a = with_file(&file, &text(""));
    let spin = |a: &ServeArgs| Config::from_args(a).expect("valid").worker_spin;
    assert_eq!(spin(&a), Duration::from_micros(20));
    with_file(&file, &text("worker_spin = \"0s\""));
    assert_eq!(spin(&a), Duration::ZERO);
    a.router.worker_spin = Some(Duration::from_micros(50));
    assert_eq!(spin(&a), Duration::from_micros(50), "the flag wins");
    a.router.worker_spin = None;
    with_file(&file, &text("worker_spin = \"2ms\""));
    let (at, problem) = invalid(Config::from_args(&a).expect_err("a 2 ms spin"));
    assert_eq!(key_and_line(&at), ("worker_spin", 2));
    assert!(matches!(problem, Problem::SpinTooLong(_)), "{problem}");
}

#[test]
fn fault_settings_come_from_flags_over_the_file_and_are_checked() {
    let dir = plugins_with("disagg");
    let file = dir.path().join("router.toml");
    let mut a = with_file(
        &file,
        &format!(
            "plugins = {:?}\nrequest_timeout = \"90s\"\noutlier_failures = 5\n\
             outlier_base_ejection = \"250ms\"\noutlier_max_ejection = \"1m\"\n\
             retry_budget_ratio = 0.5\nretry_budget_min_per_sec = 2\n\
             [[endpoints]]\nurl = \"http://127.0.0.1:1\"\n",
            dir.path()
        ),
    );
    let config = Config::from_args(&a).expect("valid");
    assert_eq!(config.routing.request_timeout, Duration::from_secs(90));
    assert_eq!(
        config.outlier,
        OutlierConfig {
            consecutive_failures: 5,
            base_ejection: Duration::from_millis(250),
            max_ejection: Duration::from_secs(60),
        }
    );
    assert_eq!(
        config.routing.retry_budget,
        RetryBudgetConfig {
            ratio: 0.5,
            min_per_sec: 2
        }
    );
    a.router.request_timeout = Some(Duration::from_secs(5));
    a.router.outlier_failures = Some(0);
    let config = Config::from_args(&a).expect("valid");
    assert_eq!(config.routing.request_timeout, Duration::from_secs(5));
    assert_eq!(config.outlier.consecutive_failures, 0);

    a.router.outlier_base_ejection = Some(Duration::from_secs(120));
    match Config::from_args(&a).expect_err("base above max") {
        ConfigError::Ejection { base, max } => {
            assert_eq!(base.source, Source::Flag("outlier-base-ejection"));
            assert_eq!(key_and_line(&max.source), ("outlier_max_ejection", 5));
        }
        other => panic!("{other}"),
    }
    a.router.outlier_base_ejection = None;
    a.router.retry_budget_ratio = Some(-1.0);
    assert_eq!(
        invalid(Config::from_args(&a).expect_err("negative")),
        (
            Source::Flag("retry-budget-ratio"),
            Problem::NotAPercentage(-1.0)
        )
    );
    a.router.retry_budget_ratio = None;
    a.router.request_timeout = Some(Duration::ZERO);
    assert_eq!(
        invalid(Config::from_args(&a).expect_err("zero")),
        (Source::Flag("request-timeout"), Problem::ZeroDuration)
    );
    a.router.request_timeout = None;
    a.router.stream_idle_timeout = Some(Duration::from_millis(1500));
    let config = Config::from_args(&a).expect("valid");
    assert_eq!(config.timeouts.stream_idle, Duration::from_millis(1500));
    assert_eq!(config.timeouts.call, Timeouts::default().call);
}

#[test]
fn bad_values_name_what_is_wrong() {
    let dir = plugins_with("disagg");
    let mut a = args(dir.path());
    a.endpoints.clear();
    assert!(matches!(
        Config::from_args(&a),
        Err(ConfigError::NoEndpoints)
    ));
    let mut a = args(dir.path());
    a.endpoints.push("ftp://x".into());
    assert!(matches!(
        Config::from_args(&a),
        Err(ConfigError::BadEndpoint {
            at: Source::Flag("endpoint"),
            index: 2,
            ..
        })
    ));
    let mut a = args(dir.path());
    a.endpoint_num_gpus = vec![1];
    assert!(matches!(
        Config::from_args(&a),
        Err(ConfigError::NumGpusCount {
            given: 1,
            endpoints: 2
        })
    ));
    let mut a = args(dir.path());
    a.router.policy = Some("missing".into());
    let (at, problem) = invalid(Config::from_args(&a).expect_err("no such policy"));
    assert_eq!(at, Source::Flag("policy"));
    assert!(matches!(problem, Problem::NoPolicy { .. }), "{problem}");
    let mut a = args(dir.path());
    a.router.policy_config = Some("{oops".into());
    let (at, problem) = invalid(Config::from_args(&a).expect_err("not JSON"));
    assert_eq!(at, Source::Flag("policy-config"));
    assert!(matches!(problem, Problem::Json(_)), "{problem}");
    let mut a = args(dir.path());
    a.router.max_attempts = Some(0);
    assert_eq!(
        invalid(Config::from_args(&a).expect_err("no attempts")),
        (
            Source::Flag("max-attempts"),
            Problem::Retry(RetryPolicyError::ZeroAttempts)
        )
    );
    let mut a = args(dir.path());
    a.router.context_length = Some(100);
    a.router.max_prompt_tokens = Some(100);
    match Config::from_args(&a).expect_err("no room to generate") {
        ConfigError::PromptNotBelowContext {
            max_prompt_tokens,
            context_length,
        } => {
            assert_eq!(max_prompt_tokens.source, Source::Flag("max-prompt-tokens"));
            assert_eq!(context_length.source, Source::Flag("context-length"));
        }
        other => panic!("{other}"),
    }
    a.router.context_length = None;
    a.router.max_prompt_tokens = Some(DEFAULT_CONTEXT_LENGTH);
    let error = Config::from_args(&a).expect_err("no room to generate");
    assert_eq!(
        error.to_string(),
        "--max-prompt-tokens (32768) must be below the context length, 32768 \
         (the default --context-length)"
    );
}

#[test]
fn policy_and_admin_settings_have_defaults_and_are_checked() {
    let dir = plugins_with("disagg");
    let config = Config::from_args(&args(dir.path())).expect("valid");
    assert_eq!(config.plugins, dir.path());
    assert_eq!(
        config.policies.fallback.as_deref(),
        Some(DEFAULT_FALLBACK_POLICY)
    );
    assert!(config.policies.header);
    assert_eq!(config.policies.forward_headers, ["x-priority"]);
    assert_eq!(config.policies.quarantine, QuarantineRule::default());
    assert_eq!(config.admin, AdminSettings::default());

    let mut a = args(dir.path());
    a.router.fallback_policy = Some(NO_FALLBACK.into());
    a.router.no_policy_header = true;
    a.router.admin_token = Some("s3cret".into());
    a.router.admin_port = Some(9001);
    a.router.forward_headers = vec!["X-Tenant".into(), "x-priority".into()];
    let config = Config::from_args(&a).expect("valid");
    assert_eq!(config.policies.forward_headers, ["x-tenant", "x-priority"]);
    assert_eq!(config.policies.fallback, None);
    assert!(!config.policies.header);
    assert_eq!(config.admin.token.as_deref(), Some("s3cret"));
    assert_eq!(
        config.admin.listen,
        Some("127.0.0.1:9001".parse().expect("addr"))
    );

    let refused = |edit: &dyn Fn(&mut ServeArgs)| {
        let mut a = args(dir.path());
        edit(&mut a);
        Config::from_args(&a).expect_err("refused")
    };
    let (at, problem) = invalid(refused(&|a| {
        a.router.fallback_policy = Some("missing".into())
    }));
    assert_eq!(at, Source::Flag("fallback-policy"));
    assert!(matches!(problem, Problem::NoPolicy { .. }), "{problem}");
    let (_, problem) = invalid(refused(&|a| a.router.admin_token = Some(String::new())));
    assert_eq!(problem, Problem::Empty);
    match refused(&|a| a.router.admin_port = Some(DEFAULT_PORT)) {
        ConfigError::AdminPort { admin_port, port } => {
            assert_eq!(admin_port.value, DEFAULT_PORT);
            assert_eq!(port, Source::Default("port"));
        }
        other => panic!("{other}"),
    }
    assert_eq!(
        invalid(refused(&|a| a.router.quarantine_faults = Some(0))),
        (Source::Flag("quarantine-faults"), Problem::AtLeast(1))
    );
    assert_eq!(
        invalid(refused(&|a| {
            a.router.forward_headers = vec!["bad header".into()]
        })),
        (
            Source::Flag("forward-header"),
            Problem::HeaderName("bad header".into())
        )
    );
}

#[test]
fn the_file_heeds_the_policy_header_unless_it_or_the_flag_says_not() {
    let dir = plugins_with("disagg");
    let file = dir.path().join("router.toml");
    let text = |line: &str| {
        format!(
            "plugins = {:?}\n{line}\n[[endpoints]]\nurl = \"http://127.0.0.1:1\"\n",
            dir.path()
        )
    };
    let mut a = with_file(&file, &text(""));
    assert!(Config::from_args(&a).expect("valid").policies.header);
    with_file(&file, &text("policy_header = false"));
    assert!(!Config::from_args(&a).expect("valid").policies.header);
    with_file(&file, &text("policy_header = true"));
    assert!(Config::from_args(&a).expect("valid").policies.header);
    a.router.no_policy_header = true;
    assert!(!Config::from_args(&a).expect("valid").policies.header);
}

#[test]
fn the_file_maps_models_to_policies_that_exist() {
    let dir = plugins_with("disagg");
    std::fs::write(dir.path().join("round-robin.wasm"), b"\0asm").expect("write");
    let file = dir.path().join("router.toml");
    let text = |mapping: &str| {
        format!(
            "plugins = {:?}\nquarantine_faults = 2\n[model_policies]\n{mapping}\n",
            dir.path()
        )
    };
    let mut a = with_file(&file, &text(r#"small = "round-robin""#));
    a.endpoints = vec!["http://127.0.0.1:1".into()];
    let config = Config::from_args(&a).expect("valid");
    assert_eq!(
        config.policies.models.get("small").map(String::as_str),
        Some("round-robin")
    );
    assert_eq!(config.policies.quarantine.faults, 2);
    with_file(&file, &text(r#"small = "missing""#));
    let (at, problem) = invalid(Config::from_args(&a).expect_err("no such policy"));
    assert_eq!(key_and_line(&at), ("model_policies.small", 4));
    assert!(matches!(problem, Problem::NoPolicy { .. }), "{problem}");
}

/// The two places a model given twice was given: the first, then the second.
fn given_twice(error: ConfigError) -> (String, Source, Source) {
    match error {
        ConfigError::ModelTwice { name, first, again } => (name, first, again),
        other => panic!("not a model given twice: {other}"),
    }
}

#[test]
fn models_entries_give_each_model_its_tokenizer_and_policy_the_first_the_default() {
    let dir = plugins_with("disagg");
    std::fs::write(dir.path().join("round-robin.wasm"), b"\0asm").expect("write");
    let qwen = dir.path().join("qwen");
    std::fs::create_dir(&qwen).expect("mkdir");
    std::fs::write(qwen.join("tokenizer.json"), b"{}").expect("write");
    let file = dir.path().join("router.toml");
    let text = |top: &str, tables: &str| {
        format!(
            "plugins = {:?}\n{top}\n[[endpoints]]\nurl = \"http://127.0.0.1:1\"\n\
             models = [\"llama\"]\n{tables}",
            dir.path()
        )
    };
    let entries = format!(
        "[[models]]\nname = \"llama\"\npolicy = \"round-robin\"\n\
         [[models]]\nname = \"qwen\"\nmodel_dir = {qwen:?}\n"
    );
    let config = Config::from_args(&with_file(&file, &text("", &entries))).expect("valid");
    assert_eq!(config.model, "llama", "the first entry is the default");
    assert!(
        config.model_source.is_none(),
        "byte-level where none is given"
    );
    assert_eq!(
        config.endpoints[0].models.as_deref(),
        Some(&["llama".to_owned()][..])
    );
    let [qwen_model] = &config.models[..] else {
        panic!("one other model: {:?}", config.models)
    };
    assert_eq!(qwen_model.name, "qwen");
    assert!(matches!(&qwen_model.source, Some(ModelSource::Dir(d)) if *d == qwen));
    assert_eq!(
        config.policies.models.get("llama").map(String::as_str),
        Some("round-robin")
    );
    // The shorthand is one more entry, first.
    let config = Config::from_args(&with_file(&file, &text("model = \"mistral\"", &entries)))
        .expect("valid");
    assert_eq!(config.model, "mistral");
    let others: Vec<_> = config.models.iter().map(|m| m.name.as_str()).collect();
    assert_eq!(others, ["llama", "qwen"]);
    // An entry's tokenizer must exist, named by the entry's line.
    let missing = "[[models]]\nname = \"x\"\nmodel_dir = \"/nonexistent\"\n";
    let (at, problem) = invalid(
        Config::from_args(&with_file(&file, &text("", missing))).expect_err("no tokenizer"),
    );
    assert_eq!(key_and_line(&at), ("models", 6));
    assert!(matches!(problem, Problem::NoTokenizer(_)), "{problem}");
}

#[test]
fn a_model_given_in_both_forms_or_twice_is_refused_with_both_places() {
    let dir = plugins_with("disagg");
    std::fs::write(dir.path().join("round-robin.wasm"), b"\0asm").expect("write");
    let file = dir.path().join("router.toml");
    let refused = |body: &str| {
        let text = format!(
            "plugins = {:?}\n{body}\n[[endpoints]]\nurl = \"http://127.0.0.1:1\"\n",
            dir.path()
        );
        let (name, first, again) =
            given_twice(Config::from_args(&with_file(&file, &text)).expect_err("given twice"));
        (
            name,
            key_and_line(&first).0.to_owned(),
            key_and_line(&again).0.to_owned(),
        )
    };
    let entry = "[[models]]\nname = \"llama\"";
    let twice = |first: &str, second: &str| (String::from("llama"), first.into(), second.into());
    assert_eq!(
        refused(&format!("model = \"llama\"\n{entry}")),
        twice("model", "models")
    );
    assert_eq!(
        refused(&format!("{entry}\n{entry}")),
        twice("models", "models")
    );
    assert_eq!(
        refused(&format!(
            "[model_policies]\nllama = \"round-robin\"\n{entry}"
        )),
        twice("model_policies.llama", "models")
    );
}

#[test]
fn discovery_comes_from_flags_over_the_file_and_needs_a_selector() {
    let dir = plugins_with("disagg");
    let file = dir.path().join("router.toml");
    let from_file = with_file(
        &file,
        &format!(
            "plugins = {:?}\n[discovery]\nkind = \"k8s\"\n\
             k8s_selector = \"app=engine,tier=serve\"\nk8s_resync = \"5s\"\n",
            dir.path()
        ),
    );
    let flags = ServeArgs {
        discovery: DiscoveryArgs {
            discovery: Some(DiscoveryKind::K8s),
            k8s_selector: Some("app=engine".into()),
            k8s_inference_pool: None,
            k8s_namespace: Some("serving".into()),
            k8s_resync: None,
        },
        endpoints: Vec::new(),
        ..args(dir.path())
    };
    if !cfg!(feature = "k8s") {
        match Config::from_args(&from_file).expect_err("not built") {
            ConfigError::DiscoveryNotBuilt(at) => {
                assert_eq!(key_and_line(&at), ("discovery.kind", 3));
            }
            other => panic!("{other}"),
        }
        return;
    }
    // No static endpoint is needed, and any number may be wanted healthy.
    let config = Config::from_args(&from_file).expect("valid");
    assert!(config.endpoints.is_empty());
    assert_eq!(
        config.discovery,
        Some(K8sDiscovery {
            pods: PodSelection::Selector("app=engine,tier=serve".into()),
            namespace: None,
            resync: Duration::from_secs(5),
        })
    );
    let config = Config::from_args(&flags).expect("valid");
    assert_eq!(
        config.discovery,
        Some(K8sDiscovery {
            pods: PodSelection::Selector("app=engine".into()),
            namespace: Some("serving".into()),
            resync: DEFAULT_K8S_RESYNC,
        })
    );
    let with = |edit: &dyn Fn(&mut DiscoveryArgs)| {
        let mut a = flags.clone();
        edit(&mut a.discovery);
        Config::from_args(&a).expect_err("refused")
    };
    assert!(matches!(
        with(&|d| d.k8s_selector = None),
        ConfigError::NoSelector {
            kind: Source::Flag("discovery")
        }
    ));
    assert_eq!(
        invalid(with(&|d| d.k8s_selector = Some(" ".into()))),
        (Source::Flag("k8s-selector"), Problem::Empty)
    );
    assert!(matches!(
        with(&|d| d.k8s_inference_pool = Some("llama".into())),
        ConfigError::SelectorAndPool { .. }
    ));
    let mut pool = flags.clone();
    pool.discovery.k8s_selector = None;
    pool.discovery.k8s_inference_pool = Some("llama".into());
    assert_eq!(
        Config::from_args(&pool)
            .expect("valid")
            .discovery
            .map(|d| d.pods),
        Some(PodSelection::InferencePool("llama".into()))
    );
    assert_eq!(
        invalid(with(&|d| d.k8s_resync = Some(Duration::ZERO))),
        (Source::Flag("k8s-resync"), Problem::ZeroDuration)
    );
    assert!(matches!(
        with(&|d| d.discovery = None),
        ConfigError::K8sWithoutDiscovery(Source::Flag("k8s-selector"))
    ));
}

#[test]
fn a_toml_file_gives_endpoints_roles_and_policy_config() {
    let dir = plugins_with("disagg");
    let file = dir.path().join("router.toml");
    let a = with_file(
        &file,
        &format!(
            "port = 9000\nhost = \"0.0.0.0\"\nplugins = {:?}\n\
             policy_config = {{ pd_balance_factor = 0.1 }}\n\
             [[endpoints]]\nurl = \"http://127.0.0.1:1\"\nrole = \"prefill\"\nnum_gpus = 4\n\
             [[endpoints]]\nurl = \"http://127.0.0.1:2\"\nrole = \"decode\"\n",
            dir.path()
        ),
    );
    let config = Config::from_args(&a).expect("valid");
    assert_eq!(config.listen.port(), 9000);
    assert_eq!(config.listen.ip(), IpAddr::from([0, 0, 0, 0]));
    assert_eq!(config.endpoints[0].role, Role::Prefill);
    assert_eq!(config.endpoints[0].num_gpus, 4);
    assert_eq!(config.endpoints[1].num_gpus, 1);
    assert_eq!(config.endpoints_file.as_deref(), Some(file.as_path()));
    assert_eq!(
        config.policy_config.as_deref(),
        Some(r#"{"pd_balance_factor":0.1}"#)
    );
    // The same config as a JSON string, spaced out: made compact.
    let a = with_file(
        &file,
        &format!(
            "plugins = {:?}\npolicy_config = '{{ \"pd_balance_factor\": 0.1 }}'\n\
             [[endpoints]]\nurl = \"http://127.0.0.1:1\"\n",
            dir.path()
        ),
    );
    assert_eq!(
        Config::from_args(&a)
            .expect("valid")
            .policy_config
            .as_deref(),
        Some(r#"{"pd_balance_factor":0.1}"#)
    );
}

#[test]
fn a_sighup_reads_the_files_endpoints_checked() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("router.toml");
    with_file(
        &file,
        "port = 9000\n[[endpoints]]\nurl = \"http://127.0.0.1:1\"\n\
         [[endpoints]]\nurl = \"vllm+http://127.0.0.1:2\"\n",
    );
    match endpoints_in_file(&file).expect_err("a bad URL") {
        ConfigError::BadEndpoint { at, index, .. } => {
            assert_eq!(key_and_line(&at), ("endpoints", 4));
            assert_eq!(index, 1);
        }
        other => panic!("{other}"),
    }
    with_file(&file, "[[endpoints]]\nurl = \"http://127.0.0.1:1\"\n");
    let endpoints = endpoints_in_file(&file).expect("valid");
    assert_eq!(endpoints.len(), 1);
}

#[test]
fn endpoint_flags_take_kv_event_sockets_and_check_them() {
    let dir = plugins_with("disagg");
    let mut a = args(dir.path());
    a.endpoints = vec![
        "vllm+http://127.0.0.1:1,kv_events=tcp://127.0.0.1:5557,kv_events_replay=tcp://127.0.0.1:5558"
            .into(),
        "http://127.0.0.1:2".into(),
        "vllm+http://127.0.0.1:3,kv_events=tcp://127.0.0.1:6000,kv_events_dp_size=4".into(),
    ];
    a.router.kv_events_stale_after = Some(Duration::from_secs(3));
    let config = Config::from_args(&a).expect("valid");
    let events = &config.endpoints[0];
    assert_eq!(events.kv_events.as_deref(), Some("tcp://127.0.0.1:5557"));
    assert_eq!(
        events.kv_events_replay.as_deref(),
        Some("tcp://127.0.0.1:5558")
    );
    assert_eq!(config.endpoints[1].kv_events, None);
    assert_eq!(events.kv_events_dp_size, None);
    assert_eq!(config.endpoints[2].kv_events_dp_size, Some(4));
    assert_eq!(config.kv_events.stale_after, Duration::from_secs(3));

    for (flag, reason) in [
        (
            "http://127.0.0.1:1,kv_events=http://127.0.0.1:5557",
            "kv_events \"http://127.0.0.1:5557\" is not a tcp://HOST:PORT address",
        ),
        (
            "http://127.0.0.1:1,kv_events=tcp://127.0.0.1",
            "kv_events \"tcp://127.0.0.1\" is not a tcp://HOST:PORT address",
        ),
        (
            "http://127.0.0.1:1,kv_events_replay=tcp://127.0.0.1:5558",
            "kv_events_replay needs kv_events (the event socket)",
        ),
        (
            "http://127.0.0.1:1,kv_events=tcp://127.0.0.1:5557,kv_events_dp_size=two",
            "kv_events_dp_size \"two\" is not a number of ranks",
        ),
    ] {
        let mut a = args(dir.path());
        a.endpoints = vec![flag.into()];
        match Config::from_args(&a).expect_err(flag) {
            ConfigError::BadEndpoint {
                at: Source::Flag("endpoint"),
                reason: got,
                ..
            } => assert_eq!(got, reason, "{flag}"),
            other => panic!("{flag}: {other}"),
        }
    }
    let mut a = args(dir.path());
    a.router.kv_events_stale_after = Some(Duration::ZERO);
    let (at, _) = invalid(Config::from_args(&a).expect_err("zero"));
    assert_eq!(at, Source::Flag("kv-events-stale-after"));
}

/// The top-level `kv_events_dp_size`, for endpoints that do not give their own: 1 unless set,
/// the flag over the file, and a number of ranks the endpoints' own key would take.
#[test]
fn the_routers_kv_events_dp_size_comes_from_the_file_or_the_flag() {
    let dir = plugins_with("disagg");
    let file = dir.path().join("router.toml");
    let toml = |dp_size: &str| {
        format!(
            "plugins = {:?}\n{dp_size}[[endpoints]]\nurl = \"http://127.0.0.1:1\"\n",
            dir.path()
        )
    };
    let config = |a: &ServeArgs| Config::from_args(a).map(|c| c.kv_events.dp_size);
    assert_eq!(config(&with_file(&file, &toml(""))).expect("valid"), 1);
    let mut a = with_file(&file, &toml("kv_events_dp_size = 4\n"));
    assert_eq!(config(&a).expect("valid"), 4);
    a.router.kv_events_dp_size = Some(2);
    assert_eq!(config(&a).expect("valid"), 2);
    for size in [0, 257] {
        a.router.kv_events_dp_size = Some(size);
        let (at, _) = invalid(Config::from_args(&a).expect_err("out of range"));
        assert_eq!(at, Source::Flag("kv-events-dp-size"), "{size}");
    }
    let (at, _) = invalid(
        Config::from_args(&with_file(&file, &toml("kv_events_dp_size = 0\n"))).expect_err("0"),
    );
    assert!(matches!(at, Source::File(_)), "{at:?}");
}

#[test]
fn saturation_and_scale_from_zero_come_from_flags_over_the_flow_control_table() {
    let dir = plugins_with("disagg");
    let file = dir.path().join("router.toml");
    let mut a = with_file(
        &file,
        &format!(
            "plugins = {:?}\n[[endpoints]]\nurl = \"http://127.0.0.1:1\"\n[flow_control]\n\
             saturation_waiting = 12\nsaturation_kv_usage = 0.9\nscale_from_zero_timeout_ms = 90000\n",
            dir.path()
        ),
    );
    let config = Config::from_args(&a).expect("valid");
    assert_eq!(
        config.saturation,
        Some(SaturationConfig {
            waiting: 12,
            kv_usage: 0.9,
            ..SaturationConfig::default()
        })
    );
    assert_eq!(
        config.admission.flow.scale_from_zero,
        Some(Duration::from_secs(90))
    );

    a.flow_control.saturation_in_flight = Some(32);
    a.flow_control.target_saturation = Some(0.5);
    let saturation = Config::from_args(&a).expect("valid").saturation;
    assert_eq!(
        saturation.map(|s| (s.waiting, s.in_flight, s.target)),
        Some((12, Some(32), 0.5))
    );

    a.flow_control.no_flow_control = true;
    let config = Config::from_args(&a).expect("valid");
    assert_eq!(
        config.saturation, None,
        "flow control off: nothing is judged"
    );

    a.flow_control.no_flow_control = false;
    a.flow_control.saturation_kv_usage = Some(1.5);
    let (at, problem) = invalid(Config::from_args(&a).expect_err("KV usage above 1"));
    assert_eq!(at, Source::Flag("saturation-kv-usage"));
    assert_eq!(problem, Problem::NotAShare(1.5));
}

#[test]
fn the_epps_settings_come_from_its_flags_else_the_files_epp_table_which_serve_ignores() {
    let plugins = plugins_with("disagg");
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("router.toml");
    let plugins = plugins.path().display();
    let mut a = with_file(
        &file,
        &format!(
            "plugins = \"{plugins}\"\n[[endpoints]]\nurl = \"http://127.0.0.1:1\"\n\
             [epp]\ngrpc_port = 7002\ndestination_fallbacks = 2\n"
        ),
    );
    Config::from_args(&a).expect("serve reads the same file");
    let (_, picker) =
        Config::for_epp(&a, &EndpointPickerArgs::default()).expect("the file's [epp] table");
    assert_eq!(
        picker,
        EndpointPicker {
            grpc_port: 7002,
            grpc_health_port: DEFAULT_GRPC_HEALTH_PORT,
            metrics_port: DEFAULT_METRICS_PORT,
            destination_fallbacks: 2,
        }
    );
    let flags = EndpointPickerArgs {
        destination_fallbacks: Some(0),
        ..EndpointPickerArgs::default()
    };
    let (_, picker) = Config::for_epp(&a, &flags).expect("valid");
    assert_eq!(
        (picker.grpc_port, picker.destination_fallbacks),
        (7002, 0),
        "a flag wins over the file"
    );

    a = with_file(&file, "[epp]\nfallbacks = 2\n");
    match Config::for_epp(&a, &EndpointPickerArgs::default()).expect_err("an unknown key") {
        ConfigError::UnknownKey { .. } => {}
        other => panic!("{other}"),
    }
}

#[test]
fn tls_settings_come_in_pairs_and_unusable_engine_files_stop_the_start() {
    let plugins = plugins_with("disagg");
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("router.toml");
    // The listener's and the engines' files, from the file; none is read unless used.
    let a = with_file(
        &file,
        &format!(
            "plugins = {:?}\ntls_cert = \"/etc/tls.crt\"\ntls_key = \"/etc/tls.key\"\n\
             engine_ca_file = \"/etc/ca.pem\"\n\
             [[endpoints]]\nurl = \"http://127.0.0.1:1\"\n",
            plugins.path()
        ),
    );
    let config = Config::from_args(&a).expect("valid");
    assert_eq!(
        config.tls,
        Some(ListenerTls {
            cert: "/etc/tls.crt".into(),
            key: "/etc/tls.key".into(),
        })
    );
    assert_eq!(
        config.engine_tls.ca_file.as_deref(),
        Some(Path::new("/etc/ca.pem"))
    );
    // A certificate without its key, on either side, names the flag still missing.
    let mut half = args(plugins.path());
    half.router.tls_cert = Some("/etc/tls.crt".into());
    assert!(matches!(
        Config::from_args(&half),
        Err(ConfigError::TlsPair {
            needs: "tls-key",
            ..
        })
    ));
    let mut half = args(plugins.path());
    half.router.engine_client_key = Some("/etc/router.key".into());
    assert!(matches!(
        Config::from_args(&half),
        Err(ConfigError::TlsPair {
            needs: "engine-client-cert",
            ..
        })
    ));
    // An https endpoint whose CA file is missing is refused before anything starts.
    let mut https = args(plugins.path());
    https.endpoints = vec!["https://127.0.0.1:1".into()];
    https.router.engine_ca_file = Some(dir.path().join("missing.pem"));
    assert!(matches!(
        Config::from_args(&https),
        Err(ConfigError::EngineTls { index: 0, .. })
    ));
}
