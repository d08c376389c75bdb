use std::{sync::Arc, time::Duration};

use super::*;
use crate::model::{fixtures, Protocol, WhenEmpty};

fn service(name: &str) -> ServicePortName {
    fixtures::service_port("ns1", name, "p80", Protocol::Tcp)
}

fn entry(name: &str, kind: FrontendKind, backends: &[&str]) -> FrontendEntry {
    fixtures::entry(service(name), kind, backends)
}

fn frontend(text: &str) -> Frontend {
    fixtures::frontend(text, Protocol::Tcp)
}

fn state(frontends: Vec<(&str, FrontendEntry)>) -> DesiredState {
    let mut state = DesiredState::default();
    for (address, entry) in frontends {
        let frontend = frontend(address);
        if entry.kind == FrontendKind::ClusterIp {
            state.cluster_ips.insert(frontend.ip);
        }
        state.frontends.insert(frontend, entry);
    }
    state.service_cidrs = vec!["172.30.0.0/16".parse().unwrap()];
    state.sources.pod_cidrs = vec!["10.0.0.0/8".parse().unwrap()];
    state
}

fn chain<'a>(ruleset: &'a Ruleset, prefix: &str) -> (&'a String, &'a Chain) {
    ruleset.chains.iter().find(|(name, _)| name.starts_with(prefix)).expect("chain")
}

#[test]
fn a_cluster_ip_is_one_verdict_map_element_and_its_endpoints_elements_of_an_endpoint_map() {
    let state = state(vec![(
        "172.30.0.41:80",
        entry("svc1", FrontendKind::ClusterIp, &["10.180.0.1:8080", "10.180.0.2:8080"]),
    )]);
    let ruleset = generate(&state, Family::Ipv4);
    // Nothing to do before the pick: the element goes to the shared pick chain, and the
    // service has no chain of its own.
    assert!(!ruleset.chains.keys().any(|name| name.contains("svc1")), "{:?}", ruleset.chains.keys());
    assert_eq!(
        ruleset.sets[SERVICE_IPS].elements["172.30.0.41 . tcp . 80"].as_deref(),
        Some("goto pick-tcp-0-2")
    );
    assert_eq!(
        ruleset.chains["pick-tcp-0-2"].rules,
        ["meta l4proto tcp dnat ip addr . port to ip daddr . tcp dport . numgen random mod 2 map @endpoints-tcp-0"]
    );
    let endpoints = &ruleset.sets["endpoints-tcp-0"].elements;
    assert_eq!(endpoints.len(), 2);
    assert_eq!(endpoints["172.30.0.41 . 80 . 0"].as_deref(), Some("10.180.0.1 . 8080"));
    assert_eq!(endpoints["172.30.0.41 . 80 . 1"].as_deref(), Some("10.180.0.2 . 8080"));
    assert!(ruleset.sets[HAIRPIN_ENDPOINTS].elements.contains_key("10.180.0.1 . 10.180.0.1"));
    assert!(ruleset.sets[CLUSTER_IPS].elements.contains_key("172.30.0.41"));
    assert_eq!(ruleset.chains[CLUSTER_IPS_CHECK].rules[1], "ip daddr 172.30.0.0/16 drop");
    assert!(ruleset.sets[NO_ENDPOINT_SERVICES].elements.is_empty());
    // Nothing IPv6 is wanted: the ip6 table has the fixed chains only.
    let v6 = generate(&state, Family::Ipv6);
    assert!(v6.sets[SERVICE_IPS].elements.is_empty());
}

#[test]
fn masquerading_cluster_ips_mark_non_pod_sources_at_the_top_of_the_service_chain() {
    let mut svc = entry("svc1", FrontendKind::ClusterIp, &["10.180.0.1:8080"]);
    svc.from_outside.masquerade = true;
    svc.from_node.masquerade = true;
    let ruleset = generate(&state(vec![("172.30.0.41:80", svc)]), Family::Ipv4);
    let (name, service) = chain(&ruleset, SERVICE_PREFIX);
    assert_eq!(
        service.rules,
        [
            "ip daddr 172.30.0.41 tcp dport 80 ip saddr != 10.0.0.0/8 jump mark-for-masquerade",
            "goto pick-tcp-0-1"
        ]
    );
    // The mark needs a chain of the service's own before the pick.
    assert_eq!(ruleset.sets[SERVICE_IPS].elements["172.30.0.41 . tcp . 80"], Some(format!("goto {name}")));
}

/// The batch of a service without masquerading or affinity, as `nft -f` is given it: its
/// `service-ips` element goes straight to the shared chain that picks one of its endpoints
/// from the endpoint map; no chain of the service's own.
#[test]
fn a_service_without_rules_of_its_own_is_an_element_that_goes_to_the_pick_chain() {
    let state = state(vec![(
        "172.30.0.41:80",
        entry("svc1", FrontendKind::ClusterIp, &["10.180.0.1:8080", "10.180.0.2:8080"]),
    )]);
    let text = full(&Existing::default(), &generate(&state, Family::Ipv4)).text;
    let lines: Vec<&str> = text
        .lines()
        .filter(|line| {
            line.contains("svc1")
                || line.contains(PICK_PREFIX)
                || line.starts_with("add element ip vipr service-ips")
                || line.starts_with("add element ip vipr endpoints-")
        })
        .collect();
    assert_eq!(
        lines,
        [
            "add chain ip vipr pick-tcp-0-2",
            "add rule ip vipr pick-tcp-0-2 meta l4proto tcp dnat ip addr . port to ip daddr . tcp dport . numgen random mod 2 map @endpoints-tcp-0",
            "add element ip vipr endpoints-tcp-0 { 172.30.0.41 . 80 . 0 : 10.180.0.1 . 8080, 172.30.0.41 . 80 . 1 : 10.180.0.2 . 8080 }",
            "add element ip vipr service-ips { 172.30.0.41 . tcp . 80 : goto pick-tcp-0-2 }",
        ],
        "{text}"
    );

    // One endpoint more where other services already pick one of two and of three: elements
    // alone.
    let others = [
        (
            "172.30.0.42:80",
            entry("svc2", FrontendKind::ClusterIp, &["10.1.0.1:80", "10.1.0.2:80", "10.1.0.3:80"]),
        ),
        ("172.30.0.43:80", entry("svc3", FrontendKind::ClusterIp, &["10.1.0.1:80", "10.1.0.2:80"])),
    ];
    let with_svc1 = |endpoints: &[&str]| {
        let mut frontends = vec![("172.30.0.41:80", entry("svc1", FrontendKind::ClusterIp, endpoints))];
        frontends.extend(others.iter().cloned());
        self::state(frontends)
    };
    let before = with_svc1(&["10.180.0.1:8080", "10.180.0.2:8080"]);
    let after = with_svc1(&["10.180.0.1:8080", "10.180.0.2:8080", "10.180.0.3:8080"]);
    let batch = partial(&generate(&before, Family::Ipv4), &generate(&after, Family::Ipv4));
    assert!(!batch.structural, "{}", batch.text);
    assert!(
        batch.elements.iter().any(|change| change.set == SERVICE_IPS
            && !change.delete
            && change.elements
                == [("172.30.0.41 . tcp . 80".to_owned(), Some("goto pick-tcp-0-3".to_owned()))]),
        "{:?}",
        batch.elements
    );
}

#[test]
fn a_service_without_endpoints_rejects_and_a_local_policy_drops() {
    let mut local = entry("svc2", FrontendKind::LoadBalancer, &[]);
    local.from_outside.when_empty = WhenEmpty::Drop;
    local.from_node.backends = Arc::from(vec![Backend { ip: "10.180.0.3".parse().unwrap(), port: 80 }]);
    local.from_pod.backends = local.from_node.backends.clone();
    let state =
        state(vec![("172.30.0.42:80", entry("svc1", FrontendKind::ClusterIp, &[])), ("1.2.3.4:80", local)]);
    let ruleset = generate(&state, Family::Ipv4);
    let empty = &ruleset.sets[NO_ENDPOINT_SERVICES].elements;
    assert_eq!(empty["172.30.0.42 . tcp . 80"], Some("goto reject-chain".to_owned()));
    assert_eq!(empty["1.2.3.4 . tcp . 80"], Some("drop".to_owned()));
    // The load balancer's node and pod traffic is DNATed by its external chain, the rest
    // returns to meet the drop.
    let (_, external) = chain(&ruleset, EXTERNAL_PREFIX);
    assert_eq!(external.rules.len(), 2, "{:?}", external.rules);
    assert_eq!(
        external.rules,
        ["fib saddr type local goto pick-tcp-0-1", "ip saddr 10.0.0.0/8 goto pick-tcp-0-1"],
    );
    assert!(!ruleset.sets[SERVICE_IPS].elements.contains_key("172.30.0.42 . tcp . 80"));
}

#[test]
fn source_ranges_are_a_firewall_chain_behind_the_firewall_map() {
    let mut lb = entry("svc1", FrontendKind::LoadBalancer, &["10.180.0.1:80"]);
    lb.allowed_sources = vec!["203.0.113.0/25".parse().unwrap(), "2001:db8::/64".parse().unwrap()];
    let ruleset = generate(&state(vec![("1.2.3.4:80", lb)]), Family::Ipv4);
    let (name, firewall) = chain(&ruleset, FIREWALL_PREFIX);
    assert_eq!(firewall.rules, ["ip saddr 203.0.113.0/25 return", "drop"]);
    assert_eq!(ruleset.sets[FIREWALL_IPS].elements["1.2.3.4 . tcp . 80"], Some(format!("goto {name}")));
}

#[test]
fn node_ports_on_every_address_are_one_service_nodeports_element() {
    let state = state(vec![
        ("192.168.0.2:30080", entry("svc1", FrontendKind::NodePort, &["10.180.0.1:80"])),
        ("192.168.1.2:30080", entry("svc1", FrontendKind::NodePort, &["10.180.0.1:80"])),
    ]);
    let ruleset = generate(&state, Family::Ipv4);
    assert_eq!(ruleset.sets[SERVICE_NODEPORTS].elements.len(), 1);
    assert!(ruleset.sets[SERVICE_NODEPORTS].elements.contains_key("tcp . 30080"));
    assert_eq!(ruleset.sets[NODEPORT_IPS].elements.len(), 2);
}

#[test]
fn session_affinity_uses_a_dynamic_set_per_endpoint() {
    let mut svc = entry("svc1", FrontendKind::ClusterIp, &["10.180.0.1:80", "10.180.0.2:80"]);
    svc.affinity = Some(Duration::from_secs(10800));
    let ruleset = generate(&state(vec![("172.30.0.41:80", svc)]), Family::Ipv4);
    let affinity: Vec<&Set> = ruleset
        .sets
        .iter()
        .filter(|(name, _)| name.starts_with(AFFINITY_PREFIX))
        .map(|(_, set)| set)
        .collect();
    assert_eq!(affinity.len(), 2);
    assert!(affinity.iter().all(|set| set.dynamic && set.spec.contains("timeout 10800s")));
    let (_, service) = chain(&ruleset, SERVICE_PREFIX);
    assert!(service.rules[0].starts_with("ip saddr @affinity-"), "{}", service.rules[0]);
    assert!(service.rules[2].contains("update @affinity-"), "{}", service.rules[2]);
}

#[test]
fn a_partial_batch_sends_only_the_changed_chain_and_elements() {
    let before = state(vec![
        ("172.30.0.41:80", entry("svc1", FrontendKind::ClusterIp, &["10.180.0.1:80"])),
        ("172.30.0.42:80", entry("svc2", FrontendKind::ClusterIp, &["10.180.0.2:80"])),
    ]);
    let mut after = before.clone();
    after.frontends.insert(
        frontend("172.30.0.41:80"),
        entry("svc1", FrontendKind::ClusterIp, &["10.180.0.1:80", "10.180.0.3:80"]),
    );
    let (old, new) = (generate(&before, Family::Ipv4), generate(&after, Family::Ipv4));
    let batch = partial(&old, &new);
    // svc1 goes to the shared chain that picks one of two, created now.
    assert_eq!(batch.chains_written, ["pick-tcp-0-2"], "{}", batch.text);
    assert!(batch.chains_deleted.is_empty());
    // The new endpoint's map element and hairpin element, and svc1's element replaced.
    assert_eq!((batch.elements_added, batch.elements_deleted), (3, 1), "{}", batch.text);
    assert!(!batch.text.contains("172.30.0.42"), "{}", batch.text);
    assert!(!batch.text.contains("flush chain"), "{}", batch.text);
    assert!(partial(&new, &new).is_empty());

    // A service gone: its element deleted, then its chain.
    let mut gone = after.clone();
    gone.frontends.remove(&frontend("172.30.0.42:80"));
    let batch = partial(&new, &generate(&gone, Family::Ipv4));
    // The pick chain no other service goes to.
    assert_eq!(batch.chains_deleted, ["pick-tcp-0-1"], "{}", batch.text);
    let element = batch.text.find("delete element ip vipr service-ips").unwrap();
    let chain = batch.text.find("delete chain ip vipr pick-").unwrap();
    assert!(element < chain, "{}", batch.text);
}

#[test]
fn a_full_batch_refills_everything_and_deletes_what_is_not_wanted() {
    let state = state(vec![("172.30.0.41:80", entry("svc1", FrontendKind::ClusterIp, &["10.180.0.1:80"]))]);
    let wanted = generate(&state, Family::Ipv4);
    let existing = Existing::parse(
        "table ip nat {\n\tchain POSTROUTING {\n\t}\n}\ntable ip vipr {\n\tchain services {\n\t}\n\
         \tchain service-OLD-ns1/old/tcp/p80 {\n\t}\n}\ntable ip vipr {\n\tmap service-ips {\n\t\t\
         type ipv4_addr . inet_proto . inet_service : verdict\n\t}\n}\n",
    );
    assert!(existing.chains.contains("service-OLD-ns1/old/tcp/p80"));
    assert!(!existing.chains.contains("POSTROUTING"), "another table's chain");
    assert_eq!(existing.sets.get(SERVICE_IPS), Some(&SetKind::Map));
    let batch = full(&existing, &wanted);
    assert_eq!(batch.chains_deleted, ["service-OLD-ns1/old/tcp/p80"]);
    assert!(batch.text.contains("flush map ip vipr service-ips"));
    assert!(batch.text.contains("flush chain ip vipr service-OLD-ns1/old/tcp/p80"));
    assert_eq!(batch.chains_written.len(), wanted.chains.len());
}

/// What a partial sync from changes does: the services of the changed frontends generated
/// as they were and as they are, and replaced.
fn replaced(
    programmed: &mut Ruleset,
    before: &DesiredState,
    after: &DesiredState,
    services: &[&str],
) -> Batch {
    let services: BTreeSet<ServicePortName> = services.iter().map(|name| service(name)).collect();
    let addresses = nodeport_addresses(&after.frontends, Family::Ipv4);
    let old = generate_services(after, &before.frontends, Family::Ipv4, Some(&services), &addresses);
    let new = generate_services(after, &after.frontends, Family::Ipv4, Some(&services), &addresses);
    replace_services(programmed, &old, &new)
}

#[test]
fn replacing_the_changed_services_alone_leads_to_the_whole_generation() {
    let before = state(vec![
        ("172.30.0.1:80", entry("svc1", FrontendKind::ClusterIp, &["10.180.0.1:8080", "10.180.0.2:8080"])),
        ("172.30.0.2:80", entry("svc2", FrontendKind::ClusterIp, &["10.180.0.2:8080"])),
        ("192.168.0.2:30001", entry("svc3", FrontendKind::NodePort, &["10.180.0.3:8080"])),
        ("172.30.0.4:80", entry("svc4", FrontendKind::ClusterIp, &["10.180.0.4:8080"])),
    ]);
    let mut programmed = generate(&before, Family::Ipv4);
    // svc1 loses 10.180.0.2, which svc2 still has; svc3's NodePort gets another endpoint;
    // svc4 goes, svc5 comes.
    let after = state(vec![
        ("172.30.0.1:80", entry("svc1", FrontendKind::ClusterIp, &["10.180.0.1:8080", "10.180.0.9:8080"])),
        ("172.30.0.2:80", entry("svc2", FrontendKind::ClusterIp, &["10.180.0.2:8080"])),
        ("192.168.0.2:30001", entry("svc3", FrontendKind::NodePort, &["10.180.0.3:8080", "10.180.0.5:8080"])),
        ("172.30.0.5:80", entry("svc5", FrontendKind::ClusterIp, &["10.180.0.4:8080"])),
    ]);
    let mut after_without_cluster_ips = after.clone();
    after_without_cluster_ips.cluster_ips = before.cluster_ips.clone();
    let batch = replaced(&mut programmed, &before, &after, &["svc1", "svc3", "svc4", "svc5"]);
    // Cluster IPs are classifiers, compared by full generations only.
    assert_eq!(programmed, generate(&after_without_cluster_ips, Family::Ipv4));
    assert!(!batch.text.contains("172.30.0.2 ."), "{}", batch.text);
    assert!(!batch.text.contains("10.180.0.2 . 10.180.0.2"), "svc2 still needs it: {}", batch.text);
    assert!(
        batch.text.lines().any(|line| line.starts_with("add element ip vipr hairpin-endpoints")
            && line.contains("10.180.0.9 . 10.180.0.9")),
        "{}",
        batch.text
    );
    assert!(
        batch.text.contains("delete element ip vipr service-ips { 172.30.0.4 . tcp . 80 }"),
        "{}",
        batch.text
    );
    // svc1's endpoint replaced is a change of map elements alone; svc3 now picks one of two
    // (its external chain goes to the pick chain svc1 goes to); svc5 is elements alone.
    assert_eq!(batch.chains_written.len(), 1, "svc3: {:?}", batch.chains_written);
    assert!(batch.chains_written[0].contains("/svc3/"), "{batch:?}");
    assert!(batch.text.contains("10.180.0.9 . 8080"), "{}", batch.text);
    // svc2 still goes to the pick chain svc3 and svc4 went to.
    assert!(!batch.chains_deleted.iter().any(|name| name.starts_with(PICK_PREFIX)), "{batch:?}");

    // svc2 and svc5 gone too: the pick chain they went to with them.
    let mut without_svc2 = after.clone();
    without_svc2.frontends.remove(&frontend("172.30.0.2:80"));
    without_svc2.frontends.remove(&frontend("172.30.0.5:80"));
    let batch = replaced(&mut programmed, &after, &without_svc2, &["svc2", "svc5"]);
    assert!(batch.chains_deleted.contains(&"pick-tcp-0-1".to_owned()), "{batch:?}");
    let mut expected = generate(&without_svc2, Family::Ipv4);
    expected.sets.insert(CLUSTER_IPS.to_owned(), programmed.sets[CLUSTER_IPS].clone());
    assert_eq!(programmed, expected);

    // Nothing changed: nothing to send.
    let again = replaced(&mut programmed, &without_svc2, &without_svc2, &["svc1", "svc3"]);
    assert!(again.is_empty(), "{}", again.text);
}
