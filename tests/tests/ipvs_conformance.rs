//! The list of flows where `--mode=ipvs` is checked against kube-proxy's IPVS behaviour
//! instead of the recorded outcome (testbed::conformance::ipvs::IPVS_DIFFERENCES) stays true
//! to the case files and to docs/conformance.md. The flows themselves are checked on the wire
//! by `cargo xtask conformance --mode=ipvs` (in a User-Mode Linux guest on this machine).

use std::{
    collections::BTreeSet,
    net::SocketAddr,
    path::{Path, PathBuf},
};

use testbed::conformance::{
    case::{case_files, CaseFile, Verdict},
    ipvs::{ipvs_difference_of, IpvsOutcome, IPVS_DIFFERENCES},
};

fn case_dirs() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("conformance");
    vec![root.join("kube-proxy-flows"), root.join("vipr")]
}

#[test]
fn every_ipvs_difference_names_one_recorded_flow() {
    let mut used = vec![0usize; IPVS_DIFFERENCES.len()];
    for path in case_files(&case_dirs()).unwrap() {
        let file = CaseFile::load(&path).unwrap();
        for case in &file.cases {
            for stage in &case.stages {
                for flow in &stage.flows {
                    let Some(difference) = ipvs_difference_of(&file, case, stage, flow) else { continue };
                    let index = IPVS_DIFFERENCES.iter().position(|d| std::ptr::eq(d, difference)).unwrap();
                    used[index] += 1;
                    let outcome = difference.outcome_for(flow).unwrap_or_else(|error| panic!("{error:#}"));
                    if let (IpvsOutcome::Dnat { .. }, Verdict::DNAT) =
                        (difference.outcome, difference.recorded)
                    {
                        // IPVS picks among fewer endpoints, never others.
                        let outcome = outcome.unwrap();
                        let recorded: BTreeSet<SocketAddr> = flow.expect.endpoints.iter().copied().collect();
                        assert!(
                            !outcome.endpoints.is_empty() && outcome.endpoints.is_subset(&recorded),
                            "{difference:?}"
                        );
                    }
                }
            }
        }
    }
    for (difference, used) in IPVS_DIFFERENCES.iter().zip(used) {
        assert_eq!(
            used,
            difference.flows.len(),
            "{difference:?} matched {used} flows, not each of its own once"
        );
    }
}

#[test]
fn ipvs_differences_are_documented() {
    let docs = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/conformance.md"))
        .expect("docs/conformance.md exists");
    for difference in IPVS_DIFFERENCES {
        for flow in difference.flows {
            let row = format!("| `{}` | {:?} | {flow} |", difference.file_id, difference.case);
            assert!(docs.contains(&row), "docs/conformance.md has no row starting {row}");
        }
        if difference.outcome == IpvsOutcome::AsRecorded {
            assert!(
                difference.file_id.starts_with("iptables."),
                "{difference:?}: only iptables files are followed"
            );
            assert_eq!(difference.recorded, Verdict::DNAT);
        }
    }
}
