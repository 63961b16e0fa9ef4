//! The engine gauges switchyard's router reads from an engine's `GET /metrics` (Prometheus
//! text) to give policies each endpoint's load: requests running and waiting, KV usage. The
//! reference engine exports them under the `switchyard_engine_*` names below; vLLM and SGLang
//! engines under their own. An engine that exports none of them is reported with unknown load.

/// KV pages referenced by a request.
pub const KV_PAGES_USED: &str = "switchyard_engine_kv_pages_used";
/// KV pages an allocation can take (free or idle in the prefix cache).
pub const KV_PAGES_FREE: &str = "switchyard_engine_kv_pages_free";
/// Requests in the reference engine's running batch.
pub const RUNNING_REQUESTS: &str = "switchyard_engine_running_requests";
/// Requests waiting in the reference engine for KV pages.
pub const WAITING_REQUESTS: &str = "switchyard_engine_waiting_requests";

/// vLLM's gauges (`vllm/v1/metrics/loggers.py`; `gpu_cache_usage_perc` before v0.10).
const VLLM_RUNNING: &str = "vllm:num_requests_running";
const VLLM_WAITING: &str = "vllm:num_requests_waiting";
const VLLM_KV_USAGE: [&str; 2] = ["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"];
/// SGLang's gauges (`sglang/srt/metrics/collector.py`).
const SGLANG_RUNNING: &str = "sglang:num_running_reqs";
const SGLANG_WAITING: &str = "sglang:num_queue_reqs";
const SGLANG_KV_USAGE: &str = "sglang:token_usage";

/// The load an engine reports about itself; every figure is optional, as engines export
/// different sets.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EngineLoad {
    pub running: Option<u32>,
    pub waiting: Option<u32>,
    /// The share of its KV cache in use, `0.0..=1.0`.
    pub kv_usage: Option<f32>,
}

impl EngineLoad {
    /// Reads the gauges of the reference engine, vLLM or SGLang from Prometheus text,
    /// whichever are present. A gauge with several label sets (one per model, or per data
    /// parallel rank) counts as their sum for requests and their maximum for KV usage.
    pub fn from_prometheus(text: &str) -> EngineLoad {
        let count = |names: &[&str]| {
            names
                .iter()
                .find_map(|name| sum(text, name))
                .map(|v| v.clamp(0.0, f64::from(u32::MAX)) as u32)
        };
        let kv_usage = reference_kv_usage(text)
            .or_else(|| VLLM_KV_USAGE.iter().find_map(|name| max(text, name)))
            .or_else(|| max(text, SGLANG_KV_USAGE))
            .map(|u| u.clamp(0.0, 1.0) as f32);
        EngineLoad {
            running: count(&[RUNNING_REQUESTS, VLLM_RUNNING, SGLANG_RUNNING]),
            waiting: count(&[WAITING_REQUESTS, VLLM_WAITING, SGLANG_WAITING]),
            kv_usage,
        }
    }
}

/// Prometheus' standard process gauge, which vLLM and SGLang export (the Python client's
/// process collector): a new value is a new engine process.
const PROCESS_START_TIME: &str = "process_start_time_seconds";

/// When the engine's process started (Unix seconds), if its metrics say: a change means the
/// engine restarted, whatever else answered in between.
pub fn process_start_time(text: &str) -> Option<f64> {
    max(text, PROCESS_START_TIME)
}

/// The reference engine reports pages, not a share.
fn reference_kv_usage(text: &str) -> Option<f64> {
    let used = sum(text, KV_PAGES_USED)?;
    let free = sum(text, KV_PAGES_FREE)?;
    let total = used + free;
    (total > 0.0).then(|| used / total)
}

fn sum(text: &str, name: &str) -> Option<f64> {
    samples(text, name).reduce(|a, b| a + b)
}

fn max(text: &str, name: &str) -> Option<f64> {
    samples(text, name).reduce(f64::max)
}

/// The values of every sample of `name` (`NAME VALUE` or `NAME{labels} VALUE`, an optional
/// timestamp after), skipping comments and values that are not finite numbers.
fn samples<'t>(text: &'t str, name: &'t str) -> impl Iterator<Item = f64> + 't {
    text.lines().filter_map(move |line| {
        let rest = line.strip_prefix(name)?;
        let rest = match rest.strip_prefix('{') {
            Some(labelled) => &labelled[labelled.find('}')? + 1..],
            None => rest,
        };
        let value = rest.strip_prefix(' ')?.split_whitespace().next()?;
        value.parse::<f64>().ok().filter(|v| v.is_finite())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_process_start_time_when_exported() {
        let text = "# TYPE process_start_time_seconds gauge\n\
            process_start_time_seconds 1.76e9\n\
            process_start_time_seconds_total 3\n";
        assert_eq!(process_start_time(text), Some(1.76e9));
        assert_eq!(process_start_time("vllm:num_requests_running 1\n"), None);
    }

    #[test]
    fn reads_the_reference_engine_gauges() {
        let text = format!(
            "# TYPE {KV_PAGES_USED} gauge\n{KV_PAGES_USED} 3\n# TYPE {KV_PAGES_FREE} gauge\n\
             {KV_PAGES_FREE} 9\nswitchyard_engine_kv_pages_cached 5\n{RUNNING_REQUESTS} 2\n\
             {WAITING_REQUESTS} 1\n"
        );
        let load = EngineLoad::from_prometheus(&text);
        assert_eq!(
            load,
            EngineLoad {
                running: Some(2),
                waiting: Some(1),
                kv_usage: Some(0.25)
            }
        );
    }

    #[test]
    fn reads_vllm_gauges_summing_label_sets() {
        // As vLLM v0.11 renders them, two data-parallel engines behind one server.
        let text = "# HELP vllm:num_requests_running Number of requests in model execution batches.\n\
            # TYPE vllm:num_requests_running gauge\n\
            vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 3.0\n\
            vllm:num_requests_running{engine=\"1\",model_name=\"m\"} 4.0\n\
            vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 1.0\n\
            vllm:num_requests_waiting{engine=\"1\",model_name=\"m\"} 0.0\n\
            vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.5\n\
            vllm:kv_cache_usage_perc{engine=\"1\",model_name=\"m\"} 0.75\n";
        let load = EngineLoad::from_prometheus(text);
        assert_eq!(load.running, Some(7));
        assert_eq!(load.waiting, Some(1));
        assert_eq!(load.kv_usage, Some(0.75));
        let older = "vllm:gpu_cache_usage_perc{model_name=\"m\"} 0.125\n";
        assert_eq!(EngineLoad::from_prometheus(older).kv_usage, Some(0.125));
    }

    #[test]
    fn reads_sglang_gauges() {
        let text = "sglang:num_running_reqs{model_name=\"m\"} 5.0\n\
            sglang:num_queue_reqs{model_name=\"m\"} 2.0\n\
            sglang:token_usage{model_name=\"m\"} 0.28\n";
        let load = EngineLoad::from_prometheus(text);
        assert_eq!(load.running, Some(5));
        assert_eq!(load.waiting, Some(2));
        assert_eq!(load.kv_usage, Some(0.28));
    }

    #[test]
    fn unknown_without_the_gauges() {
        assert_eq!(EngineLoad::from_prometheus(""), EngineLoad::default());
        // One of the two page gauges, an empty pool, a name that only starts the same,
        // garbage values: all unknown.
        let text = format!(
            "{KV_PAGES_USED} 3\n{RUNNING_REQUESTS}_total 4\n{WAITING_REQUESTS} NaN\n\
             vllm:num_requests_running{{model_name=\"m\" 1\n"
        );
        assert_eq!(EngineLoad::from_prometheus(&text), EngineLoad::default());
        let empty = format!("{KV_PAGES_USED} 0\n{KV_PAGES_FREE} 0\n");
        assert_eq!(EngineLoad::from_prometheus(&empty).kv_usage, None);
    }
}
