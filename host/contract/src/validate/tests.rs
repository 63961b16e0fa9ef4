//! Golden tests: each `host/contract/tests/ui/plans/<case>.json` holds a prompt length, an endpoint
//! snapshot and a plan; `<case>.out` holds what `validate` says about it — the resolved plan or
//! the error text a policy author will read. After an intended change, `SWITCHYARD_BLESS=1` rewrites
//! the `.out` files that differ and still fails, naming each one: review them with `git diff`, then
//! run again without it. A blessing run never passes, and never runs in CI (`CI` set).

use super::*;
use crate::endpoint::{EndpointSnapshot, Health, Protocol, Role};
use std::path::{Path, PathBuf};

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Case {
    prompt_len: u32,
    endpoints: u32,
    #[serde(default)]
    unhealthy: Vec<u32>,
    /// Each endpoint's protocol, by id (missing: mlc).
    #[serde(default)]
    protocols: Vec<Protocol>,
    /// Each endpoint's role, by id (missing: any).
    #[serde(default)]
    roles: Vec<Role>,
    plan: Vec<Step>,
}

fn snapshot(case: &Case) -> Vec<EndpointSnapshot> {
    let (count, unhealthy) = (case.endpoints, &case.unhealthy);
    (0..count)
        .map(|id| EndpointSnapshot {
            protocol: case.protocols.get(id as usize).copied().unwrap_or_default(),
            role: case.roles.get(id as usize).copied().unwrap_or_default(),
            health: if unhealthy.contains(&id) {
                Health::NotReady
            } else {
                Health::Healthy
            },
            ..EndpointSnapshot::synthetic(id)
        })
        .collect()
}

fn render(result: Result<ValidPlan, PlanError>) -> String {
    match result {
        Ok(plan) => format!(
            "ok: {}\n",
            serde_json::to_string(&plan).expect("serializable")
        ),
        Err(e) => format!("error: {e}\n"),
    }
}

fn cases_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/ui/plans")
}

#[test]
fn golden_plans() {
    let bless = std::env::var_os("SWITCHYARD_BLESS").is_some();
    assert!(
        !(bless && std::env::var_os("CI").is_some()),
        "SWITCHYARD_BLESS is set in CI: goldens are blessed by a person, never by CI"
    );
    let mut cases: Vec<PathBuf> = std::fs::read_dir(cases_dir())
        .expect("tests/ui/plans exists")
        .map(|e| e.expect("readable dir entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    cases.sort();
    assert!(
        cases.len() >= 20,
        "expected the full golden set, found {}",
        cases.len()
    );
    let mut failures = Vec::new();
    for path in &cases {
        let case: Case = serde_json::from_str(&std::fs::read_to_string(path).expect("readable"))
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let endpoints = snapshot(&case);
        let plan = Plan { steps: case.plan };
        let actual = render(validate(&plan, case.prompt_len, &endpoints));
        let out = path.with_extension("out");
        let expected = std::fs::read_to_string(&out).unwrap_or_default();
        if expected == actual {
            continue;
        }
        if bless {
            std::fs::write(&out, &actual).expect("writable");
        }
        failures.push(format!(
            "{}:\n  expected: {expected}  actual:   {actual}",
            path.display()
        ));
    }
    let verdict = if bless {
        "rewritten (SWITCHYARD_BLESS): review them with `git diff`, then run again without it"
    } else {
        "differ from their .out files (after an intended change: SWITCHYARD_BLESS=1, then review the diff)"
    };
    assert!(
        failures.is_empty(),
        "{} golden plans {verdict}:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn resolves_python_style_positions() {
    assert_eq!(resolve(-1, 10), Ok(9));
    assert_eq!(resolve(0, 10), Ok(0));
    assert_eq!(resolve(9, 10), Ok(9));
    assert!(resolve(10, 10).is_err());
    assert!(resolve(-11, 10).is_err());
    assert_eq!(
        resolve(-1, 1),
        Ok(0),
        "a 1-token prompt has an empty window"
    );
    assert!(resolve(i32::MIN, u32::MAX).is_ok());
}
