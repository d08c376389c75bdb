//! The iptables dataplane on the real kernel, driven as a library inside a fresh network
//! namespace (needs root): what a full and a partial sync write (the `iptables-restore`
//! input), that the kernel then holds exactly the wanted rules, and both iptables variants.
//! `restore_time_for_1k_services` (ignored; run with `--ignored --nocapture`) measures
//! legacy against nft.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    time::{Duration, Instant},
};

use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
use serde_json::json;
use testbed::{unique_name, Netns};
use vipr::{
    dataplane::{
        iptables::{
            restore::parse_save, ruleset, Family, IptablesDataplane, IptablesOptions, TableName, Tools,
            Variant,
        },
        Dataplane,
    },
    model::{
        kubernetes::{desired_state, NodeContext, SERVICE_NAME_LABEL},
        DesiredState,
    },
};

fn service(index: usize, node_port: bool) -> Service {
    let mut port = json!({"name": "http", "port": 80, "protocol": "TCP"});
    if node_port {
        port["nodePort"] = json!(30000 + index);
    }
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": format!("svc{index}"), "namespace": "bench"},
        "spec": {
            "type": if node_port { "NodePort" } else { "ClusterIP" },
            "clusterIP": cluster_ip(index).to_string(),
            "ports": [port],
        },
    }))
    .unwrap()
}

fn cluster_ip(index: usize) -> IpAddr {
    IpAddr::from([172, 30, (index / 250) as u8, (index % 250 + 1) as u8])
}

/// `endpoints` endpoints of service `index`, the first `local` of them on this node.
fn slice(index: usize, endpoints: usize, generation: usize) -> EndpointSlice {
    serde_json::from_value(json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": format!("svc{index}-1"), "namespace": "bench", "labels": {SERVICE_NAME_LABEL: format!("svc{index}")}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
        "endpoints": (0..endpoints).map(|e| json!({
            "addresses": [format!("10.{}.{}.{}", 100 + index / 250, index % 250, e + 1 + generation)],
            "nodeName": if e == 0 { "node-a" } else { "node-b" },
        })).collect::<Vec<_>>(),
    }))
    .unwrap()
}

fn node() -> NodeContext {
    let node_ip: IpAddr = "192.168.0.2".parse().unwrap();
    NodeContext {
        name: "node-a".into(),
        cluster_cidrs: vec!["10.0.0.0/8".parse().unwrap()],
        node_ips: [node_ip].into(),
        primary_ips: vec![node_ip],
        node_port_ips: [node_ip].into(),
        ..NodeContext::default()
    }
}

/// `services` services, every third a NodePort, with `endpoints` endpoints each; service 0's
/// endpoints moved by `generation`.
fn state(services: usize, endpoints: usize, generation: usize) -> DesiredState {
    let objects: Vec<Service> = (0..services).map(|i| service(i, i % 3 == 0)).collect();
    let slices: Vec<EndpointSlice> =
        (0..services).map(|i| slice(i, endpoints, if i == 0 { generation } else { 0 })).collect();
    let translation = desired_state(&objects, &slices, &node());
    assert!(translation.rejected.is_empty(), "{:?}", translation.rejected);
    translation.state
}

fn options(variant: Variant) -> IptablesOptions {
    IptablesOptions { variant: Some(variant), ..IptablesOptions::default() }
}

/// Our chains in the kernel: table -> chain -> rule count (iptables-save of the namespace).
fn kernel_chains(tools: &Tools) -> BTreeMap<(String, String), usize> {
    let saved = parse_save(&tools.save(Family::Ipv4).unwrap());
    let mut chains = BTreeMap::new();
    for (table, contents) in saved {
        for (chain, builtin) in &contents.chains {
            if !builtin && chain.starts_with("KUBE-") {
                let rules = contents.rules.iter().filter(|(name, _)| name == chain).count();
                chains.insert((table.clone(), chain.clone()), rules);
            }
        }
    }
    chains
}

fn wanted_chains(state: &DesiredState, tools: &Tools) -> BTreeMap<(String, String), usize> {
    let options =
        ruleset::RuleOptions { conntrack_tcp_liberal: false, random_fully: tools.has_random_fully() };
    let wanted = ruleset::generate(state, Family::Ipv4, options);
    let mut chains = BTreeMap::new();
    for table in TableName::ALL {
        for (chain, rules) in &wanted.table(table).chains {
            chains.insert((table.as_str().to_owned(), chain.clone()), rules.len());
        }
    }
    chains
}

fn chains_in(input: &str) -> BTreeSet<String> {
    input
        .lines()
        .filter_map(|line| line.strip_prefix(':'))
        .map(|line| line.split(' ').next().unwrap().to_owned())
        .collect()
}

fn syncs_write_everything_then_only_what_changed(variant: Variant) {
    testbed::require_root().unwrap();
    let netns = Netns::create(&unique_name("ipt-restore")).unwrap();
    netns
        .run(|| {
            let mut dataplane = IptablesDataplane::start(&options(variant))?;
            assert_eq!(dataplane.variant(), variant);
            let tools = dataplane.tools().clone();
            // Someone else's rules, which vipr must leave alone.
            tools.restore(
                Family::Ipv4,
                "*filter\n:CNI-OTHER - [0:0]\n-A CNI-OTHER -j ACCEPT\n-A FORWARD -j CNI-OTHER\nCOMMIT\n",
            )?;

            // First sync: full, every chain, and the jumps from the built-in chains.
            let first = state(30, 3, 0);
            let report = dataplane.sync(&first)?;
            assert!(report.is_complete() && report.changed > 0, "{report:?}");
            let stats = dataplane.last_sync().clone();
            assert!(stats.full);
            let restore = &stats.restores[0];
            assert_eq!(restore.family, Family::Ipv4);
            assert!(restore.input.contains(
                "-I PREROUTING 1 -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES"
            ));
            assert_eq!(
                kernel_chains(&tools),
                wanted_chains(&first, &tools),
                "the kernel holds what was wanted"
            );

            // Nothing changed: nothing written.
            dataplane.sync(&first)?;
            assert!(dataplane.last_sync().restores.is_empty(), "{:?}", dataplane.last_sync());

            // Service 1's endpoints move: only its endpoint-list chain and endpoint chains are
            // written, the old endpoint chains deleted; no other service's chain, and not
            // KUBE-SERVICES (its rules did not change).
            let moved = state(30, 3, 5);
            dataplane.sync(&moved)?;
            let stats = dataplane.last_sync().clone();
            assert!(!stats.full);
            let restore = &stats.restores[0];
            let written: BTreeSet<&str> = restore.written.iter().map(|(_, chain)| chain.as_str()).collect();
            let deleted: BTreeSet<&str> = restore.deleted.iter().map(|(_, chain)| chain.as_str()).collect();
            assert!(written.iter().any(|chain| chain.starts_with("KUBE-SVC-")), "{written:?}");
            assert_eq!(
                written.iter().filter(|chain| chain.starts_with("KUBE-SEP-")).count(),
                3,
                "{written:?}"
            );
            assert_eq!(deleted.len(), 3, "the three old endpoint chains: {deleted:?}");
            assert!(!written.contains("KUBE-SERVICES") && !written.contains("KUBE-NODEPORTS"), "{written:?}");
            // Service 0 is a NodePort: its KUBE-EXT chain jumps to the same KUBE-SVC chain, unchanged.
            assert!(!written.iter().any(|chain| chain.starts_with("KUBE-EXT-")), "{written:?}");
            assert_eq!(written.len(), 4, "{written:?}");
            // The input declares exactly those chains, and nothing about other services.
            let declared = chains_in(&restore.input);
            assert_eq!(declared, written.union(&deleted).map(|chain| (*chain).to_owned()).collect());
            assert!(!restore.input.contains("svc7"), "{}", restore.input);
            assert_eq!(kernel_chains(&tools), wanted_chains(&moved, &tools));

            // Services removed: their chains go, KUBE-SERVICES and KUBE-NODEPORTS are rewritten.
            let fewer = state(20, 3, 5);
            dataplane.sync(&fewer)?;
            let restore = &dataplane.last_sync().restores[0];
            assert!(restore
                .written
                .iter()
                .any(|(table, chain)| *table == TableName::Nat && chain == "KUBE-SERVICES"));
            assert_eq!(
                restore.deleted.len(),
                10 * (1 + 3) + 3,
                "10 × (SVC + 3 SEP) + 3 EXT: {:?}",
                restore.deleted
            );
            assert_eq!(kernel_chains(&tools), wanted_chains(&fewer, &tools));

            // A full resync after the chains were tampered with puts them back.
            tools.restore(Family::Ipv4, "*nat\n:KUBE-SERVICES - [0:0]\nCOMMIT\n")?;
            dataplane.request_full_sync();
            dataplane.sync(&fewer)?;
            assert!(dataplane.last_sync().full);
            assert_eq!(kernel_chains(&tools), wanted_chains(&fewer, &tools));

            // --cleanup removes all of it, and only it.
            IptablesDataplane::cleanup()?;
            let saved = tools.save(Family::Ipv4)?;
            assert!(!saved.contains("KUBE-"), "{saved}");
            assert!(saved.contains("-A FORWARD -j CNI-OTHER"), "{saved}");
            Ok(())
        })
        .unwrap();
}

#[test]
fn nft_syncs_write_everything_then_only_what_changed() {
    syncs_write_everything_then_only_what_changed(Variant::Nft);
}

#[test]
fn legacy_syncs_write_everything_then_only_what_changed() {
    syncs_write_everything_then_only_what_changed(Variant::Legacy);
}

/// One full sync of 1000 services (3 endpoints each, every third a NodePort) into an empty
/// namespace, then a partial sync that changes one service's endpoints, per variant.
#[test]
#[ignore = "a measurement, not a check: run with --ignored --nocapture"]
fn restore_time_for_1k_services() {
    testbed::require_root().unwrap();
    let big = state(1000, 3, 0);
    let changed = state(1000, 3, 7);
    for variant in [Variant::Legacy, Variant::Nft] {
        let netns = Netns::create(&unique_name("ipt-bench")).unwrap();
        let timings: Vec<(&str, Duration, Duration, usize)> = netns
            .run(|| {
                let mut dataplane = IptablesDataplane::start(&options(variant))?;
                let mut timings = Vec::new();
                let mut measure =
                    |what, dataplane: &mut IptablesDataplane, state: &DesiredState| -> anyhow::Result<()> {
                        let started = Instant::now();
                        dataplane.sync(state)?;
                        let total = started.elapsed();
                        let restore = &dataplane.last_sync().restores[0];
                        let rules = restore.input.lines().filter(|line| line.starts_with("-A")).count();
                        timings.push((what, total, restore.took, rules));
                        Ok(())
                    };
                measure("first full sync", &mut dataplane, &big)?;
                measure("partial sync, one service's endpoints changed", &mut dataplane, &changed)?;
                dataplane.request_full_sync();
                measure("full resync over the existing rules", &mut dataplane, &big)?;
                Ok(timings)
            })
            .unwrap();
        for (what, total, restore, rules) in timings {
            println!(
                "iptables-{variant}-restore, 1000 services: {what}: restore {restore:?} ({rules} rules written), whole sync {total:?}"
            );
        }
    }
}
