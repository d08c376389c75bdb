//! kube-proxy's packet-flow cases against vipr's desired state, without a kernel.
//!
//! For every flow of every case in tests/conformance/kube-proxy-flows: the recorded objects
//! go through the same conversion the conformance runner writes its services file with, are
//! read back by vipr's own manifest parser, and turned into vipr's desired state with the
//! case's node configuration; the outcome the state gives the flow (verdict, endpoint set,
//! masquerade) must be the one the case expects, or, for the listed iptables-only
//! expectations, the nftables one (testbed::conformance::differences, docs/conformance.md).

use std::path::{Path, PathBuf};

use testbed::conformance::{
    case::{case_files, CaseFile, Verdict},
    differences::{expectation, KNOWN_DIFFERENCES},
    model::{self, node_context},
    objects,
};
use vipr::{model::kubernetes::desired_state, source::file::parse_manifests};

fn cases_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("conformance/kube-proxy-flows")
}

fn case_file_paths() -> Vec<PathBuf> {
    let files = case_files(&[cases_dir()]).expect("the case directory is readable");
    assert!(!files.is_empty(), "no case files in {}", cases_dir().display());
    files
}

#[test]
fn every_flow_gets_the_expected_outcome_from_the_desired_state() {
    let mut disagreements = Vec::new();
    let mut flows = 0;
    let mut used_differences = vec![0usize; KNOWN_DIFFERENCES.len()];
    for path in case_file_paths() {
        let file = CaseFile::load(&path).unwrap();
        let file_name = path.file_name().unwrap().to_string_lossy().into_owned();
        for case in &file.cases {
            let node = node_context(&case.node).unwrap();
            for stage in &case.stages {
                let where_ = format!("{file_name} {:?} {:?}", case.case_name, stage.label);
                // What the runner writes, as vipr reads it.
                let manifests = objects::manifests(stage).unwrap();
                let read = parse_manifests(Path::new("services.yaml"), &manifests).unwrap_or_else(|error| {
                    panic!("{where_}: vipr cannot parse the runner's manifests: {error}")
                });
                let (services, slices) = objects::objects(stage);
                assert_eq!(read.services, services, "{where_}: Services changed on the way through the file");
                assert_eq!(
                    read.slices, slices,
                    "{where_}: EndpointSlices changed on the way through the file"
                );
                assert!(read.rejected.is_empty(), "{where_}: vipr's parser rejected {:?}", read.rejected);
                let translation = desired_state(&read.services, &read.slices, &node);
                let rejected: Vec<String> = translation.rejected.iter().map(ToString::to_string).collect();
                for flow in &stage.flows {
                    flows += 1;
                    let (expected, known) = expectation(&file, case, stage, flow).unwrap();
                    if let Some(known) = known {
                        let index = KNOWN_DIFFERENCES.iter().position(|k| std::ptr::eq(k, known)).unwrap();
                        used_differences[index] += 1;
                    }
                    let got = model::outcome(&translation.state, flow);
                    if got != expected {
                        let rejected = if rejected.is_empty() {
                            String::new()
                        } else {
                            format!(" (vipr rejected: {rejected:?})")
                        };
                        disagreements.push(format!(
                            "{where_} flow {} {:?} ({} -> {} {}): expected {expected}{}, model {got}{rejected}",
                            flow.id,
                            flow.name,
                            flow.source_ip,
                            flow.dest(),
                            flow.protocol,
                            known.map(|known| format!(" [nftables semantics: {}]", known.why)).unwrap_or_default(),
                        ));
                    }
                }
            }
        }
    }
    assert!(flows > 0);
    for (known, used) in KNOWN_DIFFERENCES.iter().zip(&used_differences) {
        assert_eq!(
            *used,
            known.flows.len(),
            "known difference {known:?} matched {used} flows, not each of its own once"
        );
    }
    assert!(
        disagreements.is_empty(),
        "{} of {flows} flows disagree with vipr's desired state:\n{}",
        disagreements.len(),
        disagreements.join("\n")
    );
}

#[test]
fn known_differences_are_iptables_only_and_documented() {
    let docs = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/conformance.md"))
        .expect("docs/conformance.md exists");
    for known in KNOWN_DIFFERENCES {
        assert!(known.file_id.starts_with("iptables."), "{known:?}: only iptables files may differ");
        assert_ne!(known.outcome, Verdict::DNAT, "{known:?}: a substituted expectation carries no endpoints");
        for flow in known.flows {
            let row = format!("| `{}` | {:?} | {flow} |", known.file_id, known.case);
            assert!(docs.contains(&row), "docs/conformance.md has no row starting {row}");
        }
    }
    for skip in ["CONFIG_IP_VS", "CONFIG_IP_SCTP"] {
        assert!(docs.contains(skip), "docs/conformance.md does not justify the {skip} skip");
    }
}

#[test]
fn manifests_keep_what_the_api_server_would_have_repaired() {
    // Spot checks of "exactly as recorded": an unset type, unset conditions and a source range
    // with a leading space.
    let load = |name: &str| CaseFile::load(&cases_dir().join(name)).unwrap();
    let general = load("nftables__TestClusterIPGeneral.json");
    let (services, slices) = objects::objects(&general.cases[0].stages[0]);
    assert_eq!(services[0].spec.as_ref().unwrap().type_, None);
    assert_eq!(slices[0].endpoints[0].conditions.as_ref().unwrap().ready, None);
    let balancer = load("nftables__TestLoadBalancer.json");
    let (services, _) = objects::objects(&balancer.cases[0].stages[0]);
    let ranges = services[0].spec.as_ref().unwrap().load_balancer_source_ranges.clone().unwrap();
    assert!(ranges.contains(&" 203.0.113.0/25".to_owned()), "{ranges:?}");
}
