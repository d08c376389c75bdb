//! Golden tests: Kubernetes manifests in, the text of what the eBPF maps must hold out.
//!
//! Each `golden/<name>.yaml` (Services and EndpointSlices, as `--services-file` reads them) is
//! translated for one fixed node and encoded as the eBPF dataplane encodes it; the entries, as
//! `vipr inspect drift` names them, must equal `golden/<name>.maps`. A change that alters what
//! reaches the maps shows up as a diff of that text in review. `VIPR_BLESS=1 cargo test -p
//! proxy-userspace golden` rewrites the files after a deliberate change.
use std::{fmt::Write as _, path::PathBuf};

use super::{
    counters::CounterIds,
    encode::{encode, ServiceIds},
    record::Entries,
    Balancing,
};
use crate::{
    model::kubernetes::{desired_state, NodeContext, NodeFacts, ProxySettings},
    source::file::parse_manifests,
};

fn golden_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("golden")
}

/// The node of every case: one IPv4 and one IPv6 address, pods in 10.0.0.0/8 and fd00::/48
/// (`--cluster-cidr`), services in 10.96.0.0/12 and fd00:96::/108.
fn node() -> NodeContext {
    NodeContext::resolve(
        &NodeFacts {
            name: "node-a".into(),
            zone: None,
            addresses: ["192.168.0.2", "2001:db8::2"].map(|ip| ip.parse().unwrap()).to_vec(),
            primary_ips: Vec::new(),
        },
        &ProxySettings {
            cluster_cidrs: ["10.0.0.0/8", "fd00::/48"].map(|cidr| cidr.parse().unwrap()).to_vec(),
            service_cidrs: ["10.96.0.0/12", "fd00:96::/108"].map(|cidr| cidr.parse().unwrap()).to_vec(),
            ..ProxySettings::default()
        },
    )
}

/// The maps' entries for the manifests `text`, one per line, in a stable order.
fn maps_text(name: &str, text: &str) -> String {
    let objects = parse_manifests(name.as_ref(), text).unwrap_or_else(|error| panic!("{name}: {error:?}"));
    assert!(objects.rejected.is_empty(), "{name}: {:?}", objects.rejected);
    let translation = desired_state(&objects.services, &objects.slices, &node());
    let mut out = String::new();
    for rejection in &translation.rejected {
        let _ = writeln!(out, "rejected {rejection}");
    }
    let wanted =
        encode(&translation.state, Balancing::Random, &mut ServiceIds::default(), &mut CounterIds::new(1024));
    let entries = Entries::wanted(&wanted);
    for (key, entry) in &entries.services {
        let _ = writeln!(out, "{key} => {entry}");
    }
    for (map, classified) in &entries.classifiers {
        for (key, value) in classified {
            let _ = writeln!(out, "{map} {key} => {value}");
        }
    }
    out
}

#[test]
fn manifests_become_the_golden_map_entries() {
    let bless = std::env::var_os("VIPR_BLESS").is_some();
    let mut cases: Vec<PathBuf> = std::fs::read_dir(golden_dir())
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.extension().is_some_and(|extension| extension == "yaml"))
        .collect();
    cases.sort();
    assert!(cases.len() >= 3, "the golden cases are missing: {cases:?}");
    let mut differ = Vec::new();
    for case in cases {
        let name = case.file_name().unwrap().to_string_lossy().into_owned();
        let got = maps_text(&name, &std::fs::read_to_string(&case).unwrap());
        let golden = case.with_extension("maps");
        if bless {
            std::fs::write(&golden, &got).unwrap();
            continue;
        }
        let want = std::fs::read_to_string(&golden).unwrap_or_default();
        if got != want {
            differ.push(format!("{}:\n--- want\n{want}--- got\n{got}", golden.display()));
        }
    }
    assert!(differ.is_empty(), "(VIPR_BLESS=1 rewrites them)\n{}", differ.join("\n"));
}
