//! Which pods are endpoints, and what each one is: a pure function of the pod object, so every
//! rule is tested without an API server.
//!
//! | pod field | endpoint |
//! |---|---|
//! | `status.podIP` + the container port named `http` (or annotation `switchyard.io/port`; an InferencePool's target port) | URL `http://<podIP>:<port>` |
//! | label `switchyard.io/role` (else `llm-d.ai/role`): `prefill`, `decode`, `any`/`both` | role (default `any`) |
//! | annotation `switchyard.io/protocol`: `mlc` (default), `vllm`, `sglang`, `openai` | protocol |
//! | annotation `sglang.ai/bootstrap-port` (SGLang's router reads it too) | an SGLang prefill's bootstrap port |
//! | that container's `nvidia.com/gpu` limit | GPU count (default 1) |
//! | annotation `switchyard.io/device-rank` | MLC device rank (default: the prefix sum) |
//! | annotation `switchyard.io/kv-events-port` | KV events at `tcp://<podIP>:<port>` (default: none) |
//! | annotation `switchyard.io/kv-events-replay-port` | their replay socket, `tcp://<podIP>:<port>` |
//! | annotation `switchyard.io/kv-events-topic` | the topic prefix subscribed to (default: every topic) |
//!
//! A pod is an endpoint while its `Ready` condition is true and it has no deletion timestamp.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use k8s_openapi::api::core::v1::{Container, Pod};
use switchyard_contract::{Protocol, Role};

use crate::cluster::EndpointSpec;

pub const ROLE_LABEL: &str = "switchyard.io/role";
/// llm-d's role label, read when `switchyard.io/role` is absent.
pub const LLMD_ROLE_LABEL: &str = "llm-d.ai/role";
pub const PORT_ANNOTATION: &str = "switchyard.io/port";
pub const PROTOCOL_ANNOTATION: &str = "switchyard.io/protocol";
pub const DEVICE_RANK_ANNOTATION: &str = "switchyard.io/device-rank";
/// SGLang's own annotation for a prefill pod's bootstrap port (SMG's service discovery).
pub const BOOTSTRAP_PORT_ANNOTATION: &str = "sglang.ai/bootstrap-port";
/// The port of the engine's KV-event PUB socket (`--kv-events-config`'s endpoint).
pub const KV_EVENTS_PORT_ANNOTATION: &str = "switchyard.io/kv-events-port";
/// The port of the engine's KV-event replay socket.
pub const KV_EVENTS_REPLAY_PORT_ANNOTATION: &str = "switchyard.io/kv-events-replay-port";
/// The topic prefix the engine's KV events are published under (`--kv-events-config`'s
/// `topic`), for engines sharing a publisher or publishing several topics.
pub const KV_EVENTS_TOPIC_ANNOTATION: &str = "switchyard.io/kv-events-topic";
/// The engine's data-parallel ranks publishing KV events, rank r at both ports plus r (vLLM's
/// `--data-parallel-size`).
pub const KV_EVENTS_DP_SIZE_ANNOTATION: &str = "switchyard.io/kv-events-dp-size";
/// The container port an engine serves on, by name.
pub const PORT_NAME: &str = "http";
pub const GPU_RESOURCE: &str = "nvidia.com/gpu";

/// Why a pod matching the selector is not an endpoint (now).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Skip {
    #[error("it has no uid")]
    NoUid,
    #[error("it is terminating")]
    Terminating,
    #[error("it is not ready")]
    NotReady,
    #[error("it has no IP yet")]
    NoIp,
    #[error("no container port is named `{PORT_NAME}` and there is no `{PORT_ANNOTATION}`")]
    NoPort,
    #[error("`{PORT_ANNOTATION}` {0:?} is not a port number")]
    BadPort(String),
    #[error("`{label}` {value:?} is not prefill, decode, any or both")]
    BadRole { label: &'static str, value: String },
    #[error("`{PROTOCOL_ANNOTATION}` {0:?} is not mlc, vllm, sglang or openai")]
    BadProtocol(String),
    #[error("`{DEVICE_RANK_ANNOTATION}` {0:?} is not a number")]
    BadDeviceRank(String),
    #[error("the `{GPU_RESOURCE}` limit {0:?} is not a whole number of at least 1")]
    BadGpus(String),
    #[error("`{BOOTSTRAP_PORT_ANNOTATION}` {0:?} is not one port number")]
    BadBootstrapPort(String),
    #[error("`{annotation}` {value:?} is not a port number")]
    BadKvEventsPort {
        annotation: &'static str,
        value: String,
    },
    #[error("`{KV_EVENTS_DP_SIZE_ANNOTATION}` {0:?} is not a number of ranks")]
    BadKvEventsDpSize(String),
    /// The endpoint it describes is unusable (an SGLang prefill without a bootstrap port).
    #[error("{0}")]
    Unusable(String),
}

impl Skip {
    /// The pod says something this router cannot use (as opposed to a pod still starting or
    /// going away): worth a warning.
    pub fn is_misconfigured(&self) -> bool {
        !matches!(self, Skip::Terminating | Skip::NotReady | Skip::NoIp)
    }
}

/// The uid of `pod` and the endpoint it is, or why it is none. `target_port`, an
/// InferencePool's, is the port whatever the pod says.
pub fn endpoint(pod: &Pod, target_port: Option<u16>) -> Result<(Arc<str>, EndpointSpec), Skip> {
    let meta = &pod.metadata;
    let uid = meta.uid.as_deref().ok_or(Skip::NoUid)?;
    if meta.deletion_timestamp.is_some() {
        return Err(Skip::Terminating);
    }
    if !is_ready(pod) {
        return Err(Skip::NotReady);
    }
    let ip: IpAddr = pod
        .status
        .as_ref()
        .and_then(|s| s.pod_ip.as_deref())
        .and_then(|ip| ip.parse().ok())
        .ok_or(Skip::NoIp)?;
    let container = serving_container(pod);
    let port = match target_port {
        Some(port) => port,
        None => port(pod, container)?,
    };
    let kv_events = |annotation| {
        Ok::<_, Skip>(
            kv_events_port(pod, annotation)?
                .map(|port| format!("tcp://{}", SocketAddr::new(ip, port))),
        )
    };
    let spec = EndpointSpec {
        url: format!("http://{}", SocketAddr::new(ip, port)),
        role: role(pod)?,
        num_gpus: gpus(container)?,
        device_rank: device_rank(pod)?,
        api_key: None,
        protocol: protocol(pod)?,
        models: None,
        bootstrap_port: bootstrap_port(pod)?,
        kv_events: kv_events(KV_EVENTS_PORT_ANNOTATION)?,
        kv_events_replay: kv_events(KV_EVENTS_REPLAY_PORT_ANNOTATION)?,
        kv_events_topic: annotation(pod, KV_EVENTS_TOPIC_ANNOTATION).map(str::to_owned),
        kv_events_dp_size: kv_events_dp_size(pod)?,
        ca_file: None,
        client_cert: None,
        client_key: None,
    };
    spec.check().map_err(Skip::Unusable)?;
    Ok((uid.into(), spec))
}

fn is_ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|conditions| {
            conditions
                .iter()
                .any(|c| c.type_ == "Ready" && c.status == "True")
        })
}

fn annotation<'a>(pod: &'a Pod, key: &str) -> Option<&'a str> {
    pod.metadata
        .annotations
        .as_ref()?
        .get(key)
        .map(String::as_str)
}

fn label<'a>(pod: &'a Pod, key: &str) -> Option<&'a str> {
    pod.metadata.labels.as_ref()?.get(key).map(String::as_str)
}

fn protocol(pod: &Pod) -> Result<Protocol, Skip> {
    match annotation(pod, PROTOCOL_ANNOTATION) {
        None => Ok(Protocol::Mlc),
        Some(p) => p.parse().map_err(|_| Skip::BadProtocol(p.to_owned())),
    }
}

/// One port: SGLang's router also takes a comma list matching a pod's worker ports, but a pod
/// is one endpoint here (its `http` port).
fn bootstrap_port(pod: &Pod) -> Result<Option<u16>, Skip> {
    let Some(value) = annotation(pod, BOOTSTRAP_PORT_ANNOTATION) else {
        return Ok(None);
    };
    match value.trim().parse::<u16>() {
        Ok(port) if port > 0 => Ok(Some(port)),
        _ => Err(Skip::BadBootstrapPort(value.to_owned())),
    }
}

/// A KV-event socket's port from `annotation`, if given.
fn kv_events_port(pod: &Pod, annotation: &'static str) -> Result<Option<u16>, Skip> {
    let Some(value) = self::annotation(pod, annotation) else {
        return Ok(None);
    };
    match value.trim().parse::<u16>() {
        Ok(port) if port > 0 => Ok(Some(port)),
        _ => Err(Skip::BadKvEventsPort {
            annotation,
            value: value.to_owned(),
        }),
    }
}

/// The engine's DP ranks from their annotation, if given (checked with the endpoint).
fn kv_events_dp_size(pod: &Pod) -> Result<Option<u32>, Skip> {
    annotation(pod, KV_EVENTS_DP_SIZE_ANNOTATION)
        .map(|value| {
            value
                .trim()
                .parse()
                .map_err(|_| Skip::BadKvEventsDpSize(value.to_owned()))
        })
        .transpose()
}

/// The container with the port named `http`, else the first.
fn serving_container(pod: &Pod) -> Option<&Container> {
    let containers = &pod.spec.as_ref()?.containers;
    containers
        .iter()
        .find(|c| named_port(c).is_some())
        .or_else(|| containers.first())
}

fn named_port(container: &Container) -> Option<i32> {
    container
        .ports
        .as_ref()?
        .iter()
        .find(|p| p.name.as_deref() == Some(PORT_NAME))
        .map(|p| p.container_port)
}

fn port(pod: &Pod, container: Option<&Container>) -> Result<u16, Skip> {
    if let Some(text) = annotation(pod, PORT_ANNOTATION) {
        return match text.trim().parse::<u16>() {
            Ok(port) if port > 0 => Ok(port),
            _ => Err(Skip::BadPort(text.to_owned())),
        };
    }
    let port = container.and_then(named_port).ok_or(Skip::NoPort)?;
    u16::try_from(port)
        .ok()
        .filter(|p| *p > 0)
        .ok_or_else(|| Skip::BadPort(port.to_string()))
}

fn role(pod: &Pod) -> Result<Role, Skip> {
    let (label_key, value) = match label(pod, ROLE_LABEL) {
        Some(value) => (ROLE_LABEL, value),
        None => match label(pod, LLMD_ROLE_LABEL) {
            Some(value) => (LLMD_ROLE_LABEL, value),
            None => return Ok(Role::Any),
        },
    };
    match value {
        "prefill" => Ok(Role::Prefill),
        "decode" => Ok(Role::Decode),
        "any" | "both" => Ok(Role::Any),
        other => Err(Skip::BadRole {
            label: label_key,
            value: other.to_owned(),
        }),
    }
}

fn gpus(container: Option<&Container>) -> Result<u32, Skip> {
    let limit = container
        .and_then(|c| c.resources.as_ref())
        .and_then(|r| r.limits.as_ref())
        .and_then(|limits| limits.get(GPU_RESOURCE));
    match limit {
        None => Ok(1),
        Some(quantity) => quantity
            .0
            .trim()
            .parse::<u32>()
            .ok()
            .filter(|n| *n > 0)
            .ok_or_else(|| Skip::BadGpus(quantity.0.clone())),
    }
}

fn device_rank(pod: &Pod) -> Result<Option<u32>, Skip> {
    annotation(pod, DEVICE_RANK_ANNOTATION)
        .map(|text| {
            text.trim()
                .parse()
                .map_err(|_| Skip::BadDeviceRank(text.to_owned()))
        })
        .transpose()
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    /// A ready pod with an `http` port, as the API server would send it, changed by `edit`.
    fn pod(edit: impl FnOnce(&mut serde_json::Value)) -> Pod {
        let mut pod = json!({
            "metadata": {"name": "engine-0", "uid": "u-1", "labels": {}, "annotations": {}},
            "spec": {"containers": [
                {"name": "sidecar"},
                {"name": "engine", "ports": [{"name": "metrics", "containerPort": 9000},
                                              {"name": "http", "containerPort": 8080}],
                 "resources": {"limits": {"nvidia.com/gpu": "2"}}}
            ]},
            "status": {"podIP": "10.1.2.3", "conditions": [
                {"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": "True"}
            ]}
        });
        edit(&mut pod);
        serde_json::from_value(pod).expect("a pod")
    }

    fn spec_of(pod: &Pod) -> EndpointSpec {
        endpoint(pod, None).expect("an endpoint").1
    }

    #[test]
    fn a_ready_pod_is_an_endpoint_at_its_http_port() {
        let (uid, spec) = endpoint(&pod(|_| {}), None).expect("an endpoint");
        assert_eq!(&*uid, "u-1");
        assert_eq!(
            spec,
            EndpointSpec {
                num_gpus: 2,
                ..EndpointSpec::new("http://10.1.2.3:8080")
            }
        );
        let v6 = pod(|p| p["status"]["podIP"] = json!("fd00::7"));
        assert_eq!(spec_of(&v6).url, "http://[fd00::7]:8080");
        // An InferencePool's target port is the port, whatever the pod names.
        let pooled = endpoint(&pod(|_| {}), Some(8000)).expect("an endpoint").1;
        assert_eq!(pooled.url, "http://10.1.2.3:8000");
    }

    #[test]
    fn unready_terminating_and_unplaced_pods_are_not_endpoints() {
        let unready = pod(|p| p["status"]["conditions"][1]["status"] = json!("False"));
        assert_eq!(endpoint(&unready, None), Err(Skip::NotReady));
        let no_conditions = pod(|p| p["status"]["conditions"] = json!([]));
        assert_eq!(endpoint(&no_conditions, None), Err(Skip::NotReady));
        let terminating =
            pod(|p| p["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:00:00Z"));
        assert_eq!(endpoint(&terminating, None), Err(Skip::Terminating));
        let no_ip = pod(|p| p["status"]["podIP"] = json!(null));
        assert_eq!(endpoint(&no_ip, None), Err(Skip::NoIp));
        assert!(!Skip::NotReady.is_misconfigured());
    }

    #[test]
    fn annotations_set_the_port_protocol_and_device_rank() {
        let annotated = pod(|p| {
            p["metadata"]["annotations"] = json!({
                "switchyard.io/port": "9100",
                "switchyard.io/protocol": "mlc",
                "switchyard.io/device-rank": "4",
            })
        });
        let spec = spec_of(&annotated);
        assert_eq!(spec.url, "http://10.1.2.3:9100");
        assert_eq!(spec.device_rank, Some(4));

        let no_port = pod(|p| p["spec"]["containers"][1]["ports"] = json!([]));
        assert_eq!(endpoint(&no_port, None), Err(Skip::NoPort));
        let bad_port = pod(|p| p["metadata"]["annotations"]["switchyard.io/port"] = json!("0"));
        assert_eq!(endpoint(&bad_port, None), Err(Skip::BadPort("0".into())));
        let bad_rank =
            pod(|p| p["metadata"]["annotations"]["switchyard.io/device-rank"] = json!("x"));
        assert_eq!(
            endpoint(&bad_rank, None),
            Err(Skip::BadDeviceRank("x".into()))
        );
    }

    #[test]
    fn the_protocol_and_bootstrap_port_come_from_annotations() {
        let with = |annotations: serde_json::Value, role: &str| {
            let role = role.to_owned();
            pod(move |p| {
                p["metadata"]["annotations"] = annotations;
                p["metadata"]["labels"] = json!({"switchyard.io/role": role});
            })
        };
        assert_eq!(spec_of(&with(json!({}), "any")).protocol, Protocol::Mlc);
        for protocol in Protocol::ALL {
            let annotations = json!({"switchyard.io/protocol": protocol.name()});
            assert_eq!(spec_of(&with(annotations, "decode")).protocol, protocol);
        }
        let sglang_prefill = with(
            json!({"switchyard.io/protocol": "sglang", "sglang.ai/bootstrap-port": "8998"}),
            "prefill",
        );
        assert_eq!(spec_of(&sglang_prefill).bootstrap_port, Some(8998));
        let without_port = with(json!({"switchyard.io/protocol": "sglang"}), "prefill");
        let skip = endpoint(&without_port, None).expect_err("needs a bootstrap port");
        assert!(
            matches!(skip, Skip::Unusable(_)) && skip.is_misconfigured(),
            "{skip}"
        );
        let two_ports = with(
            json!({"switchyard.io/protocol": "sglang", "sglang.ai/bootstrap-port": "8998,8999"}),
            "prefill",
        );
        assert_eq!(
            endpoint(&two_ports, None),
            Err(Skip::BadBootstrapPort("8998,8999".into()))
        );
        assert_eq!(
            endpoint(
                &with(json!({"switchyard.io/protocol": "grpc"}), "any"),
                None
            ),
            Err(Skip::BadProtocol("grpc".into()))
        );
    }

    #[test]
    fn kv_event_sockets_come_from_port_annotations_at_the_pod_ip() {
        let annotated = |annotations: serde_json::Value| {
            pod(move |p| p["metadata"]["annotations"] = annotations)
        };
        let plain = spec_of(&annotated(json!({})));
        assert_eq!((plain.kv_events, plain.kv_events_replay), (None, None));
        let both = spec_of(&annotated(json!({
            "switchyard.io/kv-events-port": "5557",
            "switchyard.io/kv-events-replay-port": "5558",
        })));
        assert_eq!(both.kv_events.as_deref(), Some("tcp://10.1.2.3:5557"));
        assert_eq!(
            both.kv_events_replay.as_deref(),
            Some("tcp://10.1.2.3:5558")
        );
        let v6 = pod(|p| {
            p["status"]["podIP"] = json!("fd00::7");
            p["metadata"]["annotations"] = json!({"switchyard.io/kv-events-port": "5557"});
        });
        assert_eq!(
            spec_of(&v6).kv_events.as_deref(),
            Some("tcp://[fd00::7]:5557")
        );
        assert_eq!(
            endpoint(
                &annotated(json!({"switchyard.io/kv-events-port": "zmq"})),
                None
            ),
            Err(Skip::BadKvEventsPort {
                annotation: KV_EVENTS_PORT_ANNOTATION,
                value: "zmq".into()
            })
        );
        let replay_alone = annotated(json!({"switchyard.io/kv-events-replay-port": "5558"}));
        let skip =
            endpoint(&replay_alone, None).expect_err("a replay socket needs the event socket");
        assert!(
            matches!(skip, Skip::Unusable(_)) && skip.is_misconfigured(),
            "{skip}"
        );
    }

    #[test]
    fn kv_event_dp_ranks_come_from_their_annotation() {
        let annotated = |annotations: serde_json::Value| {
            pod(move |p| p["metadata"]["annotations"] = annotations)
        };
        let ranks = spec_of(&annotated(json!({
            "switchyard.io/kv-events-port": "5557",
            "switchyard.io/kv-events-dp-size": "4",
        })));
        assert_eq!(ranks.kv_events_dp_size, Some(4));
        assert_eq!(
            endpoint(
                &annotated(json!({
                    "switchyard.io/kv-events-port": "5557",
                    "switchyard.io/kv-events-dp-size": "four",
                })),
                None
            ),
            Err(Skip::BadKvEventsDpSize("four".into()))
        );
        let ranks_alone = annotated(json!({"switchyard.io/kv-events-dp-size": "2"}));
        let skip = endpoint(&ranks_alone, None).expect_err("ranks need the event socket");
        assert!(matches!(skip, Skip::Unusable(_)), "{skip}");
    }

    #[test]
    fn the_kv_event_topic_comes_from_its_annotation() {
        let annotated = |annotations: serde_json::Value| {
            pod(move |p| p["metadata"]["annotations"] = annotations)
        };
        assert_eq!(
            spec_of(&annotated(json!({"switchyard.io/kv-events-port": "5557"}))).kv_events_topic,
            None,
            "every topic"
        );
        let topic = spec_of(&annotated(json!({
            "switchyard.io/kv-events-port": "5557",
            "switchyard.io/kv-events-topic": "kv@decode-0",
        })));
        assert_eq!(topic.kv_events_topic.as_deref(), Some("kv@decode-0"));
        let topic_alone = annotated(json!({"switchyard.io/kv-events-topic": "kv"}));
        let skip = endpoint(&topic_alone, None).expect_err("a topic needs the event socket");
        assert!(
            matches!(skip, Skip::Unusable(_)) && skip.is_misconfigured(),
            "{skip}"
        );
    }

    #[test]
    fn the_role_comes_from_switchyards_label_or_llm_ds() {
        let labelled = |labels: serde_json::Value| pod(move |p| p["metadata"]["labels"] = labels);
        let role = |labels| spec_of(&labelled(labels)).role;
        assert_eq!(
            role(json!({"switchyard.io/role": "prefill"})),
            Role::Prefill
        );
        assert_eq!(role(json!({"llm-d.ai/role": "decode"})), Role::Decode);
        assert_eq!(role(json!({"llm-d.ai/role": "both"})), Role::Any);
        assert_eq!(
            role(json!({"switchyard.io/role": "decode", "llm-d.ai/role": "prefill"})),
            Role::Decode,
            "switchyard's label wins"
        );
        assert_eq!(
            endpoint(&labelled(json!({"switchyard.io/role": "leader"})), None),
            Err(Skip::BadRole {
                label: ROLE_LABEL,
                value: "leader".into()
            })
        );
    }

    #[test]
    fn gpus_come_from_the_serving_containers_limit() {
        let no_limit = pod(|p| p["spec"]["containers"][1]["resources"] = json!({}));
        assert_eq!(spec_of(&no_limit).num_gpus, 1);
        let zero = pod(|p| {
            p["spec"]["containers"][1]["resources"]["limits"]["nvidia.com/gpu"] = json!("0")
        });
        assert_eq!(endpoint(&zero, None), Err(Skip::BadGpus("0".into())));
    }
}
