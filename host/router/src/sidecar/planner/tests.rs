use switchyard_contract::{Failure, Protocol, RequestFlow, Role, validate};

use super::*;
use crate::cluster::{EndpointSpec, OutlierConfig};

const OWN: &str = "127.0.0.1:7000";

/// A sidecar in front of `protocol` engines: the decode engine on :8000, prefill engines on
/// :8001 and :8002, all healthy.
fn sidecar(protocol: Protocol) -> (SidecarPlanner, Vec<EndpointSnapshot>) {
    let spec = |port: u16, role| EndpointSpec {
        protocol,
        role,
        bootstrap_port: (protocol == Protocol::Sglang && role == Role::Prefill).then_some(9000),
        ..EndpointSpec::new(format!("http://127.0.0.1:{port}"))
    };
    let specs = vec![
        spec(8000, Role::Decode),
        spec(8001, Role::Prefill),
        spec(8002, Role::Prefill),
    ];
    let cluster = Arc::new(Cluster::new(specs, OutlierConfig::default()));
    let endpoints = (0..3)
        .map(|id| EndpointSnapshot {
            protocol,
            role: if id == 0 { Role::Decode } else { Role::Prefill },
            ..EndpointSnapshot::synthetic(id)
        })
        .collect();
    let own = OWN.parse().expect("addr");
    (SidecarPlanner::new(cluster, own), endpoints)
}

fn plan(
    planner: &SidecarPlanner,
    headers: &[(&str, &str)],
    endpoints: &[EndpointSnapshot],
    last_failure: Option<Failure>,
) -> Result<Plan, TranslateError> {
    let headers: Vec<(String, String)> = headers
        .iter()
        .map(|(n, v)| ((*n).to_owned(), (*v).to_owned()))
        .collect();
    let req = PolicyRequest {
        id: 1,
        prompt: Some(&[1, 2, 3]),
        max_tokens: 4,
        stream: false,
        model: "m",
        user: None,
        headers: &headers,
        flow: RequestFlow::default(),
        base_model: None,
    };
    let ctx = PolicyContext {
        attempt: 1 + u32::from(last_failure.is_some()),
        last_failure,
        endpoints: endpoints.to_vec(),
    };
    planner.translate(&req, &ctx)
}

fn fallbacks(planner: &SidecarPlanner) -> u64 {
    planner.fallbacks.get()
}

#[test]
fn without_the_header_the_decode_engine_serves_alone() {
    let (planner, endpoints) = sidecar(Protocol::Vllm);
    assert_eq!(plan(&planner, &[], &endpoints, None), Ok(forward()));
    assert_eq!(fallbacks(&planner), 0);
}

#[test]
fn an_allowed_prefill_engine_gets_a_handoff_every_protocol_validates() {
    for protocol in [Protocol::Mlc, Protocol::Vllm, Protocol::Sglang] {
        let (planner, endpoints) = sidecar(protocol);
        let planned =
            plan(&planner, &[(PREFILLER, "127.0.0.1:8002")], &endpoints, None).expect("planned");
        assert_eq!(
            planned.steps,
            [Step::Handoff {
                prefill: 2,
                decode: DECODE
            }],
            "{protocol}"
        );
        let valid = validate(&planned, 3, &endpoints).expect("valid");
        assert_eq!(valid.prefiller(), Some(2), "{protocol}");
        assert_eq!(valid.generator(), DECODE, "{protocol}");
    }
}

#[test]
fn the_allowlist_refuses_before_any_plan() {
    let (planner, endpoints) = sidecar(Protocol::Vllm);
    let refused = |value: &str| match plan(&planner, &[(PREFILLER, value)], &endpoints, None) {
        Err(TranslateError::Rejected { message, .. }) => message,
        other => panic!("{value}: {other:?}"),
    };
    assert!(refused("nonsense").contains("is not HOST:PORT"));
    assert!(refused(OWN).contains("this sidecar itself"));
    assert!(refused("localhost:7000").contains("this sidecar itself"));
    // A loopback engine the operator did not list, and the decode engine itself.
    assert!(refused("127.0.0.1:8003").contains("not an allowed prefill engine"));
    assert!(refused("127.0.0.1:8000").contains("not an allowed prefill engine"));
    // The same engine under another name is not what the operator listed.
    assert!(refused("localhost:8001").contains("not an allowed prefill engine"));
    let twice = [(PREFILLER, "127.0.0.1:8001"), (PREFILLER, "127.0.0.1:8002")];
    assert!(matches!(
        plan(&planner, &twice, &endpoints, None),
        Err(TranslateError::Rejected { .. })
    ));
    assert_eq!(fallbacks(&planner), 0);
}

#[test]
fn a_removed_engine_is_no_longer_allowed() {
    let (planner, mut endpoints) = sidecar(Protocol::Mlc);
    endpoints[1].health = Health::Removed;
    assert!(matches!(
        plan(&planner, &[(PREFILLER, "127.0.0.1:8001")], &endpoints, None),
        Err(TranslateError::Rejected { .. })
    ));
}

#[test]
fn a_failed_or_unhealthy_prefill_engine_falls_back_to_the_decode_engine() {
    let (planner, mut endpoints) = sidecar(Protocol::Vllm);
    let header = [(PREFILLER, "127.0.0.1:8001")];
    let failed = Failure {
        kind: FailureKind::EndpointError,
        endpoint: 1,
    };
    assert_eq!(
        plan(&planner, &header, &endpoints, Some(failed)),
        Ok(forward())
    );
    assert_eq!(fallbacks(&planner), 1);
    // A failure elsewhere, or a preemption, plans the handoff again.
    let elsewhere = Failure {
        endpoint: DECODE,
        ..failed
    };
    assert!(matches!(
        plan(&planner, &header, &endpoints, Some(elsewhere))
            .expect("planned")
            .steps[..],
        [Step::Handoff { prefill: 1, .. }]
    ));
    endpoints[1].health = Health::NotReady;
    assert_eq!(plan(&planner, &header, &endpoints, None), Ok(forward()));
    assert_eq!(fallbacks(&planner), 2);
    let valid = validate(&forward(), 3, &endpoints).expect("the decode engine serves alone");
    assert_eq!(valid.generator(), DECODE);
}

#[test]
fn an_sglang_handoff_goes_once_to_another_healthy_prefill_engine() {
    let (planner, mut endpoints) = sidecar(Protocol::Sglang);
    let header = [(PREFILLER, "127.0.0.1:8001")];
    let failed_on = |endpoint| {
        Some(Failure {
            kind: FailureKind::EndpointError,
            endpoint,
        })
    };
    let handoff_from = |prefill| Ok(handoff(prefill));
    // The named engine failed, or its probe says it is down: the other takes the handoff.
    assert_eq!(
        plan(&planner, &header, &endpoints, failed_on(1)),
        handoff_from(2)
    );
    endpoints[1].health = Health::Ejected;
    assert_eq!(plan(&planner, &header, &endpoints, None), handoff_from(2));
    assert_eq!(planner.reroutes.get(), 2);
    // Once: when the other fails too, the request is refused.
    assert!(matches!(
        plan(&planner, &header, &endpoints, failed_on(2)),
        Err(TranslateError::Unavailable { .. })
    ));
    // Healthy ones only.
    endpoints[1].health = Health::Healthy;
    endpoints[2].health = Health::NotReady;
    assert!(matches!(
        plan(&planner, &header, &endpoints, failed_on(1)),
        Err(TranslateError::Unavailable { .. })
    ));
    assert_eq!(planner.reroutes.get(), 2);
    assert_eq!(
        fallbacks(&planner),
        0,
        "an SGLang decode engine never prefills"
    );
}

#[test]
fn the_other_prefill_engine_is_the_least_busy_healthy_one() {
    let mut endpoints: Vec<EndpointSnapshot> = (0..4)
        .map(|id| EndpointSnapshot {
            protocol: Protocol::Sglang,
            role: if id == 0 { Role::Decode } else { Role::Prefill },
            ..EndpointSnapshot::synthetic(id)
        })
        .collect();
    endpoints[2].in_flight = 3;
    endpoints[3].in_flight = 1;
    assert_eq!(another_prefill(1, &endpoints), Some(3));
    endpoints[3].health = Health::Ejected;
    assert_eq!(another_prefill(1, &endpoints), Some(2));
    assert_eq!(another_prefill(2, &endpoints), Some(1));
    endpoints[2].health = Health::Removed;
    assert_eq!(another_prefill(1, &endpoints), None);
}

#[test]
fn mlc_and_vllm_prefill_on_the_decode_engine_rather_than_another_prefill_engine() {
    for protocol in [Protocol::Mlc, Protocol::Vllm] {
        let (planner, endpoints) = sidecar(protocol);
        let failed = Failure {
            kind: FailureKind::EndpointError,
            endpoint: 1,
        };
        let header = [(PREFILLER, "127.0.0.1:8001")];
        assert_eq!(
            plan(&planner, &header, &endpoints, Some(failed)),
            Ok(forward()),
            "{protocol}"
        );
        assert_eq!(planner.reroutes.get(), 0, "{protocol}");
        assert_eq!(fallbacks(&planner), 1, "{protocol}");
    }
}

/// What llm-d's EPP writes: its `prefill-header-handler` sets `x-prefiller-host-port` to
/// `net.JoinHostPort(pod.Address, pod.Port)`, and clears a value a client sent to `""` when
/// it does not disaggregate (llm-d-inference-scheduler, pkg/plugins/pre-request/pd_prerequest.go;
/// the name is pkg/common's `PrefillPodHeader`).
#[test]
fn the_sidecar_takes_what_llm_d_s_epp_sends() {
    let protocol = Protocol::Vllm;
    let spec = |url: &str, role| EndpointSpec {
        protocol,
        role,
        ..EndpointSpec::new(url.to_owned())
    };
    let specs = vec![
        spec("http://127.0.0.1:8000", Role::Decode),
        spec("http://10.0.3.7:8000", Role::Prefill),
        spec("http://[fd00::7]:8000", Role::Prefill),
    ];
    let cluster = Arc::new(Cluster::new(specs, OutlierConfig::default()));
    let endpoints: Vec<EndpointSnapshot> = (0..3)
        .map(|id| EndpointSnapshot {
            protocol,
            role: if id == 0 { Role::Decode } else { Role::Prefill },
            ..EndpointSnapshot::synthetic(id)
        })
        .collect();
    let planner = SidecarPlanner::new(cluster, OWN.parse().expect("addr"));
    // Go's net.JoinHostPort: host:port, an IPv6 host in brackets.
    for (value, prefill) in [("10.0.3.7:8000", 1), ("[fd00::7]:8000", 2)] {
        assert_eq!(
            plan(&planner, &[(PREFILLER, value)], &endpoints, None),
            Ok(handoff(prefill)),
            "{value}"
        );
    }
    // Cleared: no disaggregation, as without the header.
    for cleared in ["", " "] {
        assert_eq!(
            plan(&planner, &[(PREFILLER, cleared)], &endpoints, None),
            Ok(forward()),
            "{cleared:?}"
        );
    }
}

#[test]
fn a_decode_engine_that_is_not_serving_makes_every_request_unavailable() {
    for health in [Health::NotReady, Health::Ejected, Health::Draining] {
        let (planner, mut endpoints) = sidecar(Protocol::Vllm);
        endpoints[0].health = health;
        for headers in [&[][..], &[(PREFILLER, "127.0.0.1:8001")][..]] {
            assert!(
                matches!(
                    plan(&planner, headers, &endpoints, None),
                    Err(TranslateError::Unavailable { .. })
                ),
                "{health:?} {headers:?}"
            );
        }
        // The allowlist still answers first: a client's mistake is a 400 whatever the engines.
        assert!(matches!(
            plan(&planner, &[(PREFILLER, "127.0.0.1:8003")], &endpoints, None),
            Err(TranslateError::Rejected { .. })
        ));
        assert_eq!(fallbacks(&planner), 0);
    }
}

#[test]
fn the_fallbacks_are_on_metrics() {
    let (planner, endpoints) = sidecar(Protocol::Mlc);
    let failed = Failure {
        kind: FailureKind::EndpointError,
        endpoint: 1,
    };
    plan(
        &planner,
        &[(PREFILLER, "127.0.0.1:8001")],
        &endpoints,
        Some(failed),
    )
    .expect("planned");
    let mut text = String::from("# EOF\n");
    planner.append_metrics(&mut text);
    assert!(
        text.contains("switchyard_sidecar_prefill_fallbacks_total 1\n"),
        "{text}"
    );
    assert!(
        text.contains("switchyard_sidecar_prefill_reroutes_total 0\n"),
        "{text}"
    );
    assert!(
        text.ends_with("# EOF\n") && text.matches("# EOF").count() == 1,
        "{text}"
    );
}
