//! The list of flows where `--mode=iptables` is checked against kube-proxy's iptables backend
//! (or vipr's deliberate choice) instead of the recorded outcome
//! (testbed::conformance::iptables::IPTABLES_DIFFERENCES) stays true to the case files and to
//! docs/conformance.md, and each mode reads its own list. The flows themselves are checked on
//! the wire by `cargo xtask conformance --mode=iptables`.

use std::path::{Path, PathBuf};

use testbed::conformance::{
    case::{case_files, CaseFile, Verdict},
    differences::{expectation_in, known_difference, KNOWN_DIFFERENCES},
    flags::Mode,
    iptables::{iptables_difference_of, IptablesOutcome, IPTABLES_DIFFERENCES},
};

fn case_dirs() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("conformance");
    vec![root.join("kube-proxy-flows"), root.join("vipr")]
}

fn files() -> Vec<CaseFile> {
    case_files(&case_dirs()).unwrap().iter().map(|path| CaseFile::load(path).unwrap()).collect()
}

#[test]
fn every_iptables_difference_names_one_recorded_flow() {
    let mut used = vec![0usize; IPTABLES_DIFFERENCES.len()];
    for file in files() {
        for case in &file.cases {
            for stage in &case.stages {
                for flow in &stage.flows {
                    let Some(difference) = iptables_difference_of(&file, case, stage, flow) else { continue };
                    let index =
                        IPTABLES_DIFFERENCES.iter().position(|d| std::ptr::eq(d, difference)).unwrap();
                    used[index] += 1;
                    let outcome = difference.outcome_for(flow).unwrap_or_else(|error| panic!("{error:#}"));
                    match difference.outcome {
                        // A different verdict, never a DNAT (which would need its endpoints).
                        IptablesOutcome::Verdict(verdict) => {
                            assert_ne!(verdict, Verdict::DNAT, "{difference:?}");
                            assert_ne!(verdict, difference.recorded, "{difference:?}: no difference");
                            assert_eq!(outcome.verdict, verdict);
                        }
                        // Kept: only where the file follows nftables semantics.
                        IptablesOutcome::KeptAsRecorded => {
                            assert!(!difference.file_id.starts_with("iptables."), "{difference:?}");
                            assert_eq!(outcome.verdict, difference.recorded);
                        }
                    }
                }
            }
        }
    }
    for (difference, used) in IPTABLES_DIFFERENCES.iter().zip(used) {
        assert_eq!(
            used,
            difference.flows.len(),
            "{difference:?} matched {used} flows, not each of its own once"
        );
    }
}

/// In iptables mode the iptables files are authoritative: every flow of them is checked as
/// recorded but where vipr deliberately differs (listed), and the nftables list is not used.
#[test]
fn iptables_mode_checks_the_iptables_files_as_recorded() {
    let mut nftables_differences_seen = 0;
    for file in files() {
        for case in &file.cases {
            for stage in &case.stages {
                for flow in &stage.flows {
                    let expected = expectation_in(Mode::Iptables, &file, case, stage, flow).unwrap();
                    assert!(expected.skip.is_none());
                    let listed = iptables_difference_of(&file, case, stage, flow);
                    match (listed, expected.difference) {
                        (None, None) => {
                            assert_eq!(expected.outcome.verdict, flow.expect.verdict);
                            assert_eq!(
                                expected.outcome.endpoints,
                                flow.expect.endpoints.iter().copied().collect()
                            );
                        }
                        (Some(listed), Some(difference)) => {
                            assert_eq!(difference.whose, "iptables");
                            assert_eq!(difference.why, listed.why);
                        }
                        (listed, difference) => panic!("{listed:?} but {difference:?}"),
                    }
                    if known_difference(&file, case, stage, flow).is_some() {
                        nftables_differences_seen += 1;
                        // The other modes follow nftables there.
                        let ebpf = expectation_in(Mode::Ebpf, &file, case, stage, flow).unwrap();
                        assert_eq!(ebpf.difference.map(|d| d.whose), Some("nftables"));
                    }
                }
            }
        }
    }
    assert_eq!(
        nftables_differences_seen,
        KNOWN_DIFFERENCES.iter().map(|known| known.flows.len()).sum::<usize>()
    );
}

#[test]
fn iptables_differences_are_documented() {
    let docs = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/conformance.md"))
        .expect("docs/conformance.md exists");
    let section = docs
        .split("### Flows checked against kube-proxy's iptables behaviour")
        .nth(1)
        .expect("docs/conformance.md has the iptables section");
    for difference in IPTABLES_DIFFERENCES {
        for flow in difference.flows {
            let row = format!(
                "| `{}` | {:?} | {:?} | {flow} | {} |",
                difference.file_id, difference.case, difference.stage, difference.recorded
            );
            assert!(
                section.contains(&row),
                "docs/conformance.md's iptables section has no row starting {row}"
            );
        }
    }
}
