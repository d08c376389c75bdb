//! Golden-ish checks of the generated rules: chains present, jumps between them, endpoint
//! probabilities, masquerade marks, filter verdicts. States come from Kubernetes objects
//! through the model, as in the agent. Names of the ns1/svc1 chains are the ones kube-proxy's
//! own tests show.
use std::collections::BTreeSet;

use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
use serde_json::json;

use super::*;
use crate::model::kubernetes::{desired_state, NodeContext, SERVICE_NAME_LABEL};

const SVC1: &str = "KUBE-SVC-XPGD46QRK7WJZT7O";
const SEP1: &str = "KUBE-SEP-SXIVWICOYRO3J4NJ";

fn service(name: &str, spec: serde_json::Value) -> Service {
    service_with_status(name, spec, json!({}))
}

fn service_with_status(name: &str, spec: serde_json::Value, status: serde_json::Value) -> Service {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": "ns1"},
        "spec": spec,
        "status": status,
    }))
    .unwrap()
}

/// A slice of `service` with port `p80` 80/TCP and `endpoints` as (address, node).
fn slice(service: &str, family: &str, endpoints: &[(&str, &str)]) -> EndpointSlice {
    serde_json::from_value(json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": format!("{service}-{family}"), "namespace": "ns1", "labels": {SERVICE_NAME_LABEL: service}},
        "addressType": family,
        "ports": [{"name": "p80", "port": 80, "protocol": "TCP"}],
        "endpoints": endpoints.iter().map(|(address, node)| json!({"addresses": [address], "nodeName": node})).collect::<Vec<_>>(),
    }))
    .unwrap()
}

fn node() -> NodeContext {
    let ip = |text: &str| text.parse::<IpAddr>().unwrap();
    NodeContext {
        name: "node-a".into(),
        cluster_cidrs: vec!["10.0.0.0/8".parse().unwrap()],
        node_ips: [ip("192.168.0.2"), ip("2001:db8::1")].into(),
        primary_ips: vec![ip("192.168.0.2"), ip("2001:db8::1")],
        node_port_ips: [ip("192.168.0.2"), ip("2001:db8::1")].into(),
        ..NodeContext::default()
    }
}

fn rules_for(services: &[Service], slices: &[EndpointSlice], node: &NodeContext, family: Family) -> Ruleset {
    let translation = desired_state(services, slices, node);
    assert!(translation.rejected.is_empty(), "{:?}", translation.rejected);
    let ruleset = generate(
        &translation.state,
        family,
        RuleOptions { conntrack_tcp_liberal: false, random_fully: true, localhost_node_ports: None },
    );
    check_references(&ruleset);
    ruleset
}

fn rules(services: &[Service], slices: &[EndpointSlice]) -> Ruleset {
    rules_for(services, slices, &node(), Family::Ipv4)
}

/// Every jump leads to a chain of the same table or to a built-in target.
fn check_references(ruleset: &Ruleset) {
    const TARGETS: [&str; 7] = ["ACCEPT", "DROP", "REJECT", "RETURN", "DNAT", "MARK", "MASQUERADE"];
    for table in TableName::ALL {
        let chains = &ruleset.table(table).chains;
        for (chain, rules) in chains {
            assert!(chain.len() <= 28, "{chain} is too long for iptables");
            for rule in rules {
                if let Some(target) = restore::rule_target(rule) {
                    assert!(
                        chains.contains_key(&target) || TARGETS.contains(&target.as_str()),
                        "{} {chain}: {rule} jumps to a chain that is not there",
                        table.as_str()
                    );
                }
            }
        }
        for top_level in table.top_level() {
            assert!(chains.contains_key(*top_level), "{top_level} is always declared");
        }
    }
}

use super::super::restore;

fn chain<'a>(table: &'a Table, name: &str) -> &'a [String] {
    table.chains.get(name).unwrap_or_else(|| panic!("no chain {name} in {:?}", table.chains.keys()))
}

/// Chains whose name starts with `prefix`.
fn chains_with(table: &Table, prefix: &str) -> Vec<String> {
    table.chains.keys().filter(|name| name.starts_with(prefix)).cloned().collect()
}

fn svc1(spec: serde_json::Value) -> Service {
    let mut full = json!({"clusterIP": "172.30.0.41", "clusterIPs": ["172.30.0.41"], "ports": [{"name": "p80", "port": 80, "protocol": "TCP"}]});
    full.as_object_mut().unwrap().extend(spec.as_object().unwrap().clone());
    service("svc1", full)
}

#[test]
fn a_cluster_ip_jumps_to_its_service_chain_which_balances_over_endpoint_chains() {
    let ruleset = rules(
        &[svc1(json!({}))],
        &[slice(
            "svc1",
            "IPv4",
            &[("10.180.0.1", "node-a"), ("10.180.0.2", "node-b"), ("10.180.0.3", "node-b")],
        )],
    );
    let nat = &ruleset.nat;
    assert_eq!(
        chain(nat, KUBE_SERVICES),
        [format!("-m comment --comment \"ns1/svc1:p80 cluster IP\" -p tcp -m tcp -d 172.30.0.41/32 --dport 80 -j {SVC1}")]
    );
    let svc = chain(nat, SVC1);
    // Masquerade what does not come from a pod, then 1/3, 1/2, the rest.
    assert_eq!(
        svc[0],
        "-m comment --comment \"ns1/svc1:p80 cluster IP\" -p tcp -m tcp -d 172.30.0.41/32 --dport 80 ! -s 10.0.0.0/8 -j KUBE-MARK-MASQ"
    );
    assert!(svc[1].contains("--mode random --probability 0.3333333333 -j KUBE-SEP-"), "{}", svc[1]);
    assert!(svc[2].contains("--mode random --probability 0.5000000000 -j KUBE-SEP-"), "{}", svc[2]);
    assert!(!svc[3].contains("statistic"), "{}", svc[3]);
    assert_eq!(svc.len(), 4);
    assert_eq!(chains_with(nat, "KUBE-SEP-").len(), 3);
    assert_eq!(
        chain(nat, SEP1),
        [
            "-m comment --comment \"ns1/svc1:p80\" -s 10.180.0.1/32 -j KUBE-MARK-MASQ",
            "-m comment --comment \"ns1/svc1:p80\" -p tcp -m tcp -j DNAT --to-destination 10.180.0.1:80",
        ]
    );
    // No external destination, no filter verdicts.
    assert!(chains_with(nat, "KUBE-EXT-").is_empty() && chains_with(nat, "KUBE-SVL-").is_empty());
    assert!(chain(&ruleset.filter, KUBE_SERVICES).is_empty());
    assert!(chain(&ruleset.filter, KUBE_EXTERNAL_SERVICES).is_empty());
}

#[test]
fn masquerading_and_forwarding_use_mark_0x4000() {
    let ruleset = rules(&[], &[]);
    assert_eq!(
        chain(&ruleset.nat, KUBE_POSTROUTING),
        [
            "-m mark ! --mark 0x4000/0x4000 -j RETURN",
            "-j MARK --xor-mark 0x4000",
            "-m comment --comment \"kubernetes service traffic requiring SNAT\" -j MASQUERADE --random-fully",
        ]
    );
    assert_eq!(chain(&ruleset.nat, KUBE_MARK_MASQ), ["-j MARK --or-mark 0x4000"]);
    let forward = chain(&ruleset.filter, KUBE_FORWARD);
    assert_eq!(forward[0], "-m conntrack --ctstate INVALID -j DROP");
    assert!(forward[1].ends_with("-m mark --mark 0x4000/0x4000 -j ACCEPT"));
    assert!(forward[2].ends_with("-m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT"));
    // Nothing else exists without services.
    assert_eq!(ruleset.nat.chains.len(), NAT_TOP_LEVEL.len());
    assert_eq!(ruleset.filter.chains.len(), FILTER_TOP_LEVEL.len());
}

#[test]
fn masquerade_all_and_no_detector_change_the_cluster_ip_masquerade_rule() {
    let objects = ([svc1(json!({}))], [slice("svc1", "IPv4", &[("10.180.0.1", "node-a")])]);
    let all = NodeContext { masquerade_all: true, ..node() };
    let ruleset = rules_for(&objects.0, &objects.1, &all, Family::Ipv4);
    assert!(chain(&ruleset.nat, SVC1)[0].ends_with("--dport 80 -j KUBE-MARK-MASQ"));
    let none = NodeContext { cluster_cidrs: Vec::new(), ..node() };
    let ruleset = rules_for(&objects.0, &objects.1, &none, Family::Ipv4);
    assert!(!chain(&ruleset.nat, SVC1).iter().any(|rule| rule.contains("KUBE-MARK-MASQ")));
    // A node address inside the pod CIDR is still the node: masqueraded by its own rule.
    let inside = NodeContext {
        node_ips: ["10.1.2.3".parse().unwrap()].into(),
        node_port_ips: BTreeSet::new(),
        ..node()
    };
    let ruleset = rules_for(&objects.0, &objects.1, &inside, Family::Ipv4);
    let svc = chain(&ruleset.nat, SVC1);
    assert!(svc[0].ends_with("! -s 10.0.0.0/8 -j KUBE-MARK-MASQ"));
    assert!(svc[1].ends_with("-m addrtype --src-type LOCAL -j KUBE-MARK-MASQ"), "{}", svc[1]);
}

#[test]
fn a_service_without_endpoints_is_rejected_in_the_filter_table_and_absent_from_nat() {
    let ruleset = rules(
        &[svc1(
            json!({"type": "NodePort", "ports": [{"name": "p80", "port": 80, "protocol": "TCP", "nodePort": 3001}]}),
        )],
        &[],
    );
    assert_eq!(
        chain(&ruleset.filter, KUBE_SERVICES),
        ["-m comment --comment \"ns1/svc1:p80 has no endpoints\" -p tcp -m tcp -d 172.30.0.41/32 --dport 80 -j REJECT"]
    );
    assert_eq!(
        chain(&ruleset.filter, KUBE_EXTERNAL_SERVICES),
        ["-m comment --comment \"ns1/svc1:p80 has no endpoints\" -p tcp -m tcp -d 192.168.0.2/32 --dport 3001 -j REJECT"]
    );
    assert!(chain(&ruleset.nat, KUBE_SERVICES).iter().all(|rule| rule.ends_with("-j KUBE-NODEPORTS")));
    assert!(chain(&ruleset.nat, KUBE_NODEPORTS).is_empty());
    assert_eq!(ruleset.nat.chains.len(), NAT_TOP_LEVEL.len());
}

#[test]
fn a_node_port_with_cluster_policy_masquerades_everything_in_its_ext_chain() {
    let ruleset = rules(
        &[svc1(
            json!({"type": "NodePort", "ports": [{"name": "p80", "port": 80, "protocol": "TCP", "nodePort": 3001}]}),
        )],
        &[slice("svc1", "IPv4", &[("10.180.0.1", "node-a"), ("10.180.2.1", "node-b")])],
    );
    let nat = &ruleset.nat;
    let ext = chains_with(nat, "KUBE-EXT-");
    assert_eq!(ext, ["KUBE-EXT-XPGD46QRK7WJZT7O"]);
    assert_eq!(
        chain(nat, &ext[0]),
        [
            "-m comment --comment \"masquerade traffic for ns1/svc1:p80 external destinations\" -j KUBE-MARK-MASQ".to_owned(),
            format!("-j {SVC1}"),
        ]
    );
    assert_eq!(
        chain(nat, KUBE_NODEPORTS),
        [format!("-m comment --comment \"ns1/svc1:p80\" -p tcp -m tcp --dport 3001 -j {}", ext[0])]
    );
    let services = chain(nat, KUBE_SERVICES);
    assert_eq!(
        services.last().unwrap(),
        "-m comment --comment \"kubernetes service nodeports; NOTE: this must be the last rule in this chain\" -d 192.168.0.2/32 -j KUBE-NODEPORTS"
    );
}

#[test]
fn external_policy_local_short_circuits_the_node_and_pods_to_all_endpoints() {
    let spec = json!({"type": "LoadBalancer", "externalTrafficPolicy": "Local",
        "ports": [{"name": "p80", "port": 80, "protocol": "TCP", "nodePort": 3001}]});
    let status = json!({"loadBalancer": {"ingress": [{"ip": "1.2.3.4"}]}});
    let service = service_with_status(
        "svc1",
        {
            let mut full = svc1(spec).spec.map(|spec| serde_json::to_value(spec).unwrap()).unwrap();
            full["clusterIP"] = json!("172.30.0.41");
            full
        },
        status,
    );
    let ruleset = rules(
        std::slice::from_ref(&service),
        &[slice("svc1", "IPv4", &[("10.180.0.1", "node-a"), ("10.180.2.1", "node-b")])],
    );
    let nat = &ruleset.nat;
    let svl = chains_with(nat, "KUBE-SVL-");
    assert_eq!(svl.len(), 1);
    assert_eq!(chain(nat, &svl[0]).len(), 1, "only the local endpoint: {:?}", chain(nat, &svl[0]));
    assert_eq!(chain(nat, SVC1).len(), 3, "masquerade + two endpoints");
    let ext = chains_with(nat, "KUBE-EXT-");
    assert_eq!(ext.len(), 1, "the LB IP and the NodePort share one EXT chain");
    assert_eq!(
        chain(nat, &ext[0]),
        [
            "-m comment --comment \"masquerade LOCAL traffic for ns1/svc1:p80 external destinations\" -m addrtype --src-type LOCAL -j KUBE-MARK-MASQ".to_owned(),
            format!("-m comment --comment \"route LOCAL traffic for ns1/svc1:p80 external destinations\" -m addrtype --src-type LOCAL -j {SVC1}"),
            format!("-m comment --comment \"route pod traffic for ns1/svc1:p80 external destinations\" -s 10.0.0.0/8 -j {SVC1}"),
            format!("-j {}", svl[0]),
        ]
    );
    assert!(chain(nat, KUBE_SERVICES)
        .iter()
        .any(|rule| rule.contains("-d 1.2.3.4/32 --dport 80") && rule.ends_with(&ext[0])));

    // No local endpoint: outside sources fall out of the EXT chain and are dropped by filter.
    let ruleset = rules(&[service], &[slice("svc1", "IPv4", &[("10.180.2.1", "node-b")])]);
    let ext = chains_with(&ruleset.nat, "KUBE-EXT-");
    assert_eq!(chain(&ruleset.nat, &ext[0]).len(), 3, "no final jump: {:?}", chain(&ruleset.nat, &ext[0]));
    let external = chain(&ruleset.filter, KUBE_EXTERNAL_SERVICES);
    assert_eq!(external.len(), 2);
    assert!(external.iter().all(|rule| rule.contains("has no local endpoints") && rule.ends_with("-j DROP")));
}

#[test]
fn source_ranges_go_through_a_firewall_chain_and_the_rest_is_dropped_in_filter() {
    let spec = json!({"type": "LoadBalancer", "loadBalancerSourceRanges": ["203.0.113.0/25", " 2001:db8:ffff::/64"],
        "ports": [{"name": "p80", "port": 80, "protocol": "TCP", "nodePort": 3001}]});
    let service = service_with_status(
        "svc1",
        {
            let mut full = serde_json::to_value(svc1(spec).spec.unwrap()).unwrap();
            full["clusterIP"] = json!("172.30.0.41");
            full
        },
        json!({"loadBalancer": {"ingress": [{"ip": "1.2.3.4"}]}}),
    );
    let ruleset = rules(&[service], &[slice("svc1", "IPv4", &[("10.180.0.1", "node-a")])]);
    let nat = &ruleset.nat;
    let fw = chains_with(nat, "KUBE-FW-");
    assert_eq!(fw, ["KUBE-FW-XPGD46QRK7WJZT7O"]);
    let ext = chains_with(nat, "KUBE-EXT-");
    assert_eq!(
        chain(nat, &fw[0]),
        [
            format!("-m comment --comment \"ns1/svc1:p80 loadbalancer IP\" -s 203.0.113.0/25 -j {}", ext[0]),
            "-m comment --comment \"other traffic to ns1/svc1:p80 will be dropped by KUBE-PROXY-FIREWALL\""
                .to_owned(),
        ],
        "the IPv6 range belongs to ip6tables"
    );
    assert!(chain(nat, KUBE_SERVICES)
        .iter()
        .any(|rule| rule.contains("-d 1.2.3.4/32") && rule.ends_with(&fw[0])));
    // The NodePort ignores the ranges.
    assert!(chain(nat, KUBE_NODEPORTS)[0].ends_with(&ext[0]));
    assert_eq!(
        chain(&ruleset.filter, KUBE_PROXY_FIREWALL),
        ["-m comment --comment \"ns1/svc1:p80 traffic not accepted by KUBE-FW-XPGD46QRK7WJZT7O\" -p tcp -m tcp -d 1.2.3.4/32 --dport 80 -j DROP"]
    );
}

#[test]
fn client_ip_affinity_uses_recent_lists_named_after_endpoint_chains() {
    let ruleset = rules(
        &[svc1(
            json!({"sessionAffinity": "ClientIP", "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 300}}}),
        )],
        &[slice("svc1", "IPv4", &[("10.180.0.1", "node-a"), ("10.180.0.2", "node-a")])],
    );
    let svc = chain(&ruleset.nat, SVC1);
    assert!(
        svc[1].ends_with(&format!("-m recent --name {SEP1} --rcheck --seconds 300 --reap -j {SEP1}")),
        "{}",
        svc[1]
    );
    assert!(svc[2].contains("--rcheck --seconds 300 --reap"));
    assert!(svc[3].contains("statistic"));
    assert!(chain(&ruleset.nat, SEP1)[1].contains(&format!("-m recent --name {SEP1} --set -p tcp")));
}

#[test]
fn unserved_ports_of_a_cluster_ip_pass_and_service_cidrs_drop_unallocated_addresses() {
    let node = NodeContext { service_cidrs: vec!["172.30.0.0/16".parse().unwrap()], ..node() };
    let ruleset = rules_for(
        &[svc1(json!({}))],
        &[slice("svc1", "IPv4", &[("10.180.0.1", "node-a")])],
        &node,
        Family::Ipv4,
    );
    // Only port 80 is mentioned: 172.30.0.41 on any other port or protocol passes.
    let mentions: Vec<&String> = ruleset
        .nat
        .chains
        .values()
        .chain(ruleset.filter.chains.values())
        .flatten()
        .filter(|rule| rule.contains("172.30.0.41"))
        .collect();
    assert!(
        mentions.iter().all(|rule| rule.contains("--dport 80") || rule.ends_with("-j RETURN")),
        "{mentions:?}"
    );
    assert_eq!(
        chain(&ruleset.filter, KUBE_SERVICE_CIDRS),
        [
            "-d 172.30.0.41/32 -j RETURN",
            "-m comment --comment \"service CIDR address that is no service's cluster IP\" -j DROP"
        ]
    );
    assert_eq!(
        chain(&ruleset.filter, KUBE_SERVICES),
        ["-m comment --comment \"unallocated service IPs\" -d 172.30.0.0/16 -j KUBE-SERVICE-CIDRS"]
    );
}

#[test]
fn each_family_gets_its_own_frontends_and_endpoints() {
    let dual = service(
        "svc1",
        json!({"clusterIP": "172.30.0.41", "clusterIPs": ["172.30.0.41", "fd00:172:30::41"], "ipFamilies": ["IPv4", "IPv6"],
            "ports": [{"name": "p80", "port": 80, "protocol": "TCP"}]}),
    );
    let slices = [
        slice("svc1", "IPv4", &[("10.180.0.1", "node-a")]),
        slice("svc1", "IPv6", &[("fd00:10:180::1", "node-a")]),
    ];
    let v4 = rules(std::slice::from_ref(&dual), &slices);
    let v6 = rules_for(
        &[dual],
        &slices,
        &NodeContext { cluster_cidrs: vec!["fd00:10::/64".parse().unwrap()], ..node() },
        Family::Ipv6,
    );
    let text4 = render_all(&v4);
    let text6 = render_all(&v6);
    assert!(text4.contains("-d 172.30.0.41/32") && !text4.contains("fd00"), "{text4}");
    assert!(text6.contains("-d fd00:172:30::41/128") && !text6.contains("172.30.0.41"), "{text6}");
    assert!(text6.contains("-j DNAT --to-destination [fd00:10:180::1]:80"), "{text6}");
    assert!(text6.contains("! -s fd00:10::/64 -j KUBE-MARK-MASQ"), "{text6}");
    // The same service port: the same chain name in both families.
    assert!(text4.contains(SVC1) && text6.contains(SVC1));
}

#[test]
fn an_interface_detector_matches_the_pod_interfaces_instead_of_a_cidr_in_both_families() {
    let spec = json!({"clusterIP": "172.30.0.41", "clusterIPs": ["172.30.0.41", "fd00:172:30::41"],
        "ipFamilies": ["IPv4", "IPv6"], "type": "NodePort", "externalTrafficPolicy": "Local",
        "ports": [{"name": "p80", "port": 80, "protocol": "TCP", "nodePort": 3001}]});
    // Endpoints on another node only: pods are short-circuited to them, outside clients dropped.
    let slices = [
        slice("svc1", "IPv4", &[("10.180.2.1", "node-b")]),
        slice("svc1", "IPv6", &[("fd00:10:180::1", "node-b")]),
    ];
    for (pods, matched) in [
        (PodInterfaces::NamePrefix("veth".into()), "-i veth+"),
        (PodInterfaces::Bridge("cbr0".into()), "-i cbr0"),
    ] {
        let node = NodeContext { cluster_cidrs: Vec::new(), pod_interfaces: Some(pods), ..node() };
        for (family, cluster_ip) in [(Family::Ipv4, "172.30.0.41/32"), (Family::Ipv6, "fd00:172:30::41/128")]
        {
            let ruleset = rules_for(&[service("svc1", spec.clone())], &slices, &node, family);
            let nat = &ruleset.nat;
            let text = render_all(&ruleset);
            assert!(!text.contains("-s 10.0.0.0/8"), "no CIDR detector: {text}");
            // Cluster IP: what did not enter through a pod interface is masqueraded.
            assert_eq!(
                chain(nat, SVC1)[0],
                format!(
                    "-m comment --comment \"ns1/svc1:p80 cluster IP\" -p tcp -m tcp -d {cluster_ip} --dport 80 ! {matched} -j KUBE-MARK-MASQ"
                )
            );
            // The NodePort: pods through to every endpoint, the node masqueraded, nothing else.
            let ext = chains_with(nat, "KUBE-EXT-");
            assert_eq!(
                chain(nat, &ext[0]),
                [
                    "-m comment --comment \"masquerade LOCAL traffic for ns1/svc1:p80 external destinations\" -m addrtype --src-type LOCAL -j KUBE-MARK-MASQ".to_owned(),
                    format!("-m comment --comment \"route LOCAL traffic for ns1/svc1:p80 external destinations\" -m addrtype --src-type LOCAL -j {SVC1}"),
                    format!("-m comment --comment \"route pod traffic for ns1/svc1:p80 external destinations\" {matched} -j {SVC1}"),
                ],
                "{family:?}"
            );
            let external = chain(&ruleset.filter, KUBE_EXTERNAL_SERVICES);
            assert!(
                external
                    .iter()
                    .all(|rule| rule.contains("has no local endpoints") && rule.ends_with("-j DROP")),
                "{external:?}"
            );
        }
    }
}

#[test]
fn internal_policy_local_without_local_endpoints_drops_cluster_ip_traffic() {
    let ruleset = rules(
        &[svc1(json!({"internalTrafficPolicy": "Local"}))],
        &[slice("svc1", "IPv4", &[("10.180.2.1", "node-b")])],
    );
    assert_eq!(
        chain(&ruleset.filter, KUBE_SERVICES),
        ["-m comment --comment \"ns1/svc1:p80 has no local endpoints\" -p tcp -m tcp -d 172.30.0.41/32 --dport 80 -j DROP"]
    );
    assert!(chain(&ruleset.nat, KUBE_SERVICES).is_empty());
}

#[test]
fn endpoint_comments_are_left_out_in_large_clusters() {
    let endpoints: Vec<(String, &str)> =
        (0..1001).map(|i| (format!("10.{}.{}.1", 180 + i / 250, i % 250), "node-a")).collect();
    let endpoints: Vec<(&str, &str)> = endpoints.iter().map(|(ip, node)| (ip.as_str(), *node)).collect();
    let ruleset = rules(&[svc1(json!({}))], &[slice("svc1", "IPv4", &endpoints)]);
    assert!(chain(&ruleset.nat, SEP1)[1].starts_with("-p tcp"), "{}", chain(&ruleset.nat, SEP1)[1]);
    assert!(chain(&ruleset.nat, SVC1)[1].starts_with("-m statistic"));
    assert_eq!(chains_with(&ruleset.nat, "KUBE-SEP-").len(), 1001);
}

/// kube-proxy's rule for a health-check node port, in the filter table's KUBE-NODEPORTS, only
/// in the families the service has frontends in, and only for services that exist.
#[test]
fn health_check_node_ports_are_accepted_in_the_filter_table() {
    let services = [service(
        "svc1",
        json!({"type": "ClusterIP", "clusterIP": "172.30.0.41", "ports": [{"name": "p80", "port": 80}]}),
    )];
    let slices = [slice("svc1", "IPv4", &[("10.180.0.1", "node-a")])];
    let state = desired_state(&services, &slices, &node()).state;
    let options =
        RuleOptions { conntrack_tcp_liberal: false, random_fully: true, localhost_node_ports: None };
    let checks: BTreeMap<String, u16> =
        [("ns1/svc1".to_owned(), 30100), ("ns1/gone".to_owned(), 30101)].into();
    let v4 = generate_with_health_checks(&state, Family::Ipv4, options, &checks);
    assert_eq!(
        v4.table(TableName::Filter).chains[KUBE_NODEPORTS],
        ["-m comment --comment \"ns1/svc1 health check node port\" -m tcp -p tcp --dport 30100 -j ACCEPT"]
    );
    let v6 = generate_with_health_checks(&state, Family::Ipv6, options, &checks);
    assert!(v6.table(TableName::Filter).chains[KUBE_NODEPORTS].is_empty());
    // Without health checks, as before.
    assert_eq!(
        generate(&state, Family::Ipv4, options),
        generate_with_health_checks(&state, Family::Ipv4, options, &BTreeMap::new())
    );
}

fn localhost_options(localhost: Option<&str>) -> RuleOptions {
    RuleOptions {
        conntrack_tcp_liberal: false,
        random_fully: true,
        localhost_node_ports: localhost.map(|net| net.parse().unwrap()),
    }
}

const NODEPORTS_JUMP: &str =
    "-m comment --comment \"kubernetes service nodeports; NOTE: this must be the last rule in this chain\"";

/// `--iptables-localhost-nodeports` on (kube-proxy's default): NodePorts are also reached on
/// loopback, through the same KUBE-EXT chain (whose node class, `--src-type LOCAL`, 127.0.0.1
/// is, masquerades), and the CVE-2020-8558 guard is wanted; IPv4 only.
#[test]
fn localhost_node_ports_send_loopback_to_kube_nodeports_and_want_the_guard() {
    let services = [svc1(
        json!({"type": "NodePort", "ports": [{"name": "p80", "port": 80, "protocol": "TCP", "nodePort": 3001}]}),
    )];
    let slices = [
        slice("svc1", "IPv4", &[("10.180.0.1", "node-a"), ("10.180.2.1", "node-b")]),
        slice("svc1", "IPv6", &[("fd00:10:180::1", "node-a")]),
    ];
    let mut node = node();
    node.node_port_ips.insert("192.168.1.2".parse().unwrap());
    node.node_ips.insert("192.168.1.2".parse().unwrap());
    let state = desired_state(&services, &slices, &node).state;
    let ruleset = generate(&state, Family::Ipv4, localhost_options(Some("127.0.0.0/8")));
    check_references(&ruleset);
    assert!(ruleset.localnet_guard);
    let nat = &ruleset.nat;
    let services = chain(nat, KUBE_SERVICES);
    assert_eq!(
        services[services.len() - 3..],
        [
            format!("{NODEPORTS_JUMP} -d 192.168.0.2/32 -j KUBE-NODEPORTS"),
            format!("{NODEPORTS_JUMP} -d 192.168.1.2/32 -j KUBE-NODEPORTS"),
            format!("{NODEPORTS_JUMP} -d 127.0.0.0/8 -j KUBE-NODEPORTS"),
        ]
    );
    // One rule without a destination serves every address, loopback included.
    let ext = "KUBE-EXT-XPGD46QRK7WJZT7O";
    assert_eq!(
        chain(nat, KUBE_NODEPORTS),
        [format!("-m comment --comment \"ns1/svc1:p80\" -p tcp -m tcp --dport 3001 -j {ext}")]
    );
    assert!(chain(nat, ext)[0].ends_with("-j KUBE-MARK-MASQ"), "{:?}", chain(nat, ext));
    // Everything else is as without the flag.
    let without = generate(&state, Family::Ipv4, localhost_options(None));
    let mut with_nat = nat.clone();
    with_nat.chains.get_mut(KUBE_SERVICES).unwrap().pop();
    assert_eq!(with_nat, without.nat);
    assert_eq!(ruleset.filter, without.filter);

    // IPv6 never serves NodePorts on ::1 (kube-proxy's IPv6 proxier never has the flag).
    let v6 = generate(&state, Family::Ipv6, localhost_options(Some("127.0.0.0/8")));
    assert!(!v6.localnet_guard);
    assert_eq!(v6, generate(&state, Family::Ipv6, localhost_options(None)));
}

/// Off (or NodePort addresses without loopback): no rule sends 127.0.0.0/8 to KUBE-NODEPORTS
/// (kube-proxy's `! -d 127.0.0.0/8`; vipr's jumps name the node's addresses), and no guard.
#[test]
fn without_localhost_node_ports_loopback_never_reaches_kube_nodeports() {
    let services = [svc1(
        json!({"type": "NodePort", "ports": [{"name": "p80", "port": 80, "protocol": "TCP", "nodePort": 3001}]}),
    )];
    let slices = [slice("svc1", "IPv4", &[("10.180.0.1", "node-a")])];
    let state = desired_state(&services, &slices, &node()).state;
    let ruleset = generate(&state, Family::Ipv4, localhost_options(None));
    assert!(!ruleset.localnet_guard);
    let jumps: Vec<&String> = chain(&ruleset.nat, KUBE_SERVICES)
        .iter()
        .filter(|rule| rule.ends_with("-j KUBE-NODEPORTS"))
        .collect();
    assert_eq!(jumps, [&format!("{NODEPORTS_JUMP} -d 192.168.0.2/32 -j KUBE-NODEPORTS")]);
    assert!(!render_all(&ruleset).contains("127.0.0."));
}

/// A NodePort served on some addresses only gets its own loopback rule (127.0.0.1, as with
/// `--nodeport-addresses` that contains it), and one without endpoints is rejected on loopback
/// as on the node's addresses.
#[test]
fn localhost_node_ports_follow_the_first_frontend_when_addresses_differ() {
    let services = [
        svc1(
            json!({"type": "NodePort", "ports": [{"name": "p80", "port": 80, "protocol": "TCP", "nodePort": 3001}]}),
        ),
        service(
            "svc2",
            json!({"type": "NodePort", "clusterIP": "172.30.0.42", "ports": [{"name": "p80", "port": 80, "protocol": "TCP", "nodePort": 3002}]}),
        ),
    ];
    let slices = [slice("svc1", "IPv4", &[("10.180.0.1", "node-a")])];
    let mut node = node();
    node.node_port_ips.insert("192.168.1.2".parse().unwrap());
    node.node_ips.insert("192.168.1.2".parse().unwrap());
    let mut state = desired_state(&services, &slices, &node).state;
    // svc1's NodePort on 192.168.0.2 only.
    state
        .frontends
        .retain(|frontend, _| !(frontend.port == 3001 && frontend.ip.to_string() == "192.168.1.2"));
    let ruleset = generate(&state, Family::Ipv4, localhost_options(Some("127.0.0.1/32")));
    check_references(&ruleset);
    let ext = "KUBE-EXT-XPGD46QRK7WJZT7O";
    assert_eq!(
        chain(&ruleset.nat, KUBE_NODEPORTS),
        [
            format!(
                "-m comment --comment \"ns1/svc1:p80\" -p tcp -m tcp -d 192.168.0.2/32 --dport 3001 -j {ext}"
            ),
            format!(
                "-m comment --comment \"ns1/svc1:p80\" -p tcp -m tcp -d 127.0.0.1/32 --dport 3001 -j {ext}"
            ),
        ]
    );
    assert!(chain(&ruleset.nat, KUBE_SERVICES)
        .contains(&format!("{NODEPORTS_JUMP} -d 127.0.0.1/32 -j KUBE-NODEPORTS")));
    let external = chain(&ruleset.filter, KUBE_EXTERNAL_SERVICES);
    assert!(
        external.contains(
            &"-m comment --comment \"ns1/svc2:p80 has no endpoints\" -p tcp -m tcp -d 127.0.0.1/32 --dport 3002 -j REJECT"
                .to_owned()
        ),
        "{external:?}"
    );
}

#[test]
fn a_comment_cannot_end_its_word_its_line_or_its_length() {
    let hostile = format!("ns/web\"\n-A INPUT -j ACCEPT\\{}", "x".repeat(400));
    let rendered = comment(&hostile);
    assert!(!rendered.contains('\n'));
    assert!(rendered.starts_with("-m comment --comment \"ns/web_"));
    assert_eq!(rendered.matches('"').count(), 2, "{rendered}");
    let text = rendered.trim_start_matches("-m comment --comment \"").trim_end_matches('"');
    assert_eq!(text.len(), MAX_COMMENT_LEN);
    assert_eq!(
        comment("ns/web:http health check node port"),
        "-m comment --comment \"ns/web:http health check node port\""
    );
}
