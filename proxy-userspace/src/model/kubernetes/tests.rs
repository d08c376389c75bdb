use std::net::IpAddr;

use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
use serde_json::json;

use super::*;
use crate::model::{SourceClass, Treatment, WhenEmpty};

fn service(name: &str, spec: serde_json::Value) -> Service {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": "ns"},
        "spec": spec,
    }))
    .unwrap()
}

fn slice(name: &str, service: &str, body: serde_json::Value) -> EndpointSlice {
    let mut object = json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": "ns", "labels": {SERVICE_NAME_LABEL: service}},
        "addressType": "IPv4",
    });
    object.as_object_mut().unwrap().extend(body.as_object().unwrap().clone());
    serde_json::from_value(object).unwrap()
}

fn translate(services: &[Service], slices: &[EndpointSlice]) -> Translation {
    desired_state(services, slices, &NodeContext { name: "node-a".into(), ..NodeContext::default() })
}

fn frontend(ip: &str, port: u16, protocol: Protocol) -> Frontend {
    Frontend { ip: ip.parse().unwrap(), port, protocol }
}

fn backends(entry: &FrontendEntry) -> Vec<String> {
    entry.from_pod.backends.iter().map(ToString::to_string).collect()
}

fn web() -> Service {
    service(
        "web",
        json!({"clusterIP": "10.96.0.10", "ports": [
            {"name": "http", "port": 80, "protocol": "TCP"},
            {"name": "dns", "port": 53, "protocol": "UDP"},
        ]}),
    )
}

#[test]
fn cluster_ip_ports_map_to_ready_endpoints_by_port_name_and_protocol() {
    let slices = [slice(
        "web-1",
        "web",
        json!({
            "endpoints": [
                {"addresses": ["10.1.0.1"], "conditions": {"ready": true}},
                {"addresses": ["10.1.0.2"]},
                {"addresses": ["10.1.0.3"], "conditions": {"ready": false}},
            ],
            "ports": [
                {"name": "http", "port": 8080, "protocol": "TCP"},
                {"name": "dns", "port": 5353, "protocol": "UDP"},
                {"name": "http", "port": 9999, "protocol": "UDP"},
            ],
        }),
    )];
    let translation = translate(&[web()], &slices);
    assert!(translation.rejected.is_empty(), "{:?}", translation.rejected);
    let frontends = &translation.state.frontends;
    assert_eq!(frontends.len(), 2);
    assert_eq!(
        backends(&frontends[&frontend("10.96.0.10", 80, Protocol::Tcp)]),
        ["10.1.0.1:8080", "10.1.0.2:8080"]
    );
    assert_eq!(
        backends(&frontends[&frontend("10.96.0.10", 53, Protocol::Udp)]),
        ["10.1.0.1:5353", "10.1.0.2:5353"]
    );
    assert_eq!(frontends[&frontend("10.96.0.10", 80, Protocol::Tcp)].service.to_string(), "ns/web:http");
}

#[test]
fn slices_of_one_service_are_merged_and_duplicates_count_once() {
    let endpoint_slice = |name, address| {
        slice(
            name,
            "web",
            json!({"endpoints": [{"addresses": [address]}, {"addresses": ["10.1.0.9"]}], "ports": [{"name": "http", "port": 8080}]}),
        )
    };
    let translation =
        translate(&[web()], &[endpoint_slice("web-1", "10.1.0.1"), endpoint_slice("web-2", "10.1.0.2")]);
    let entry = &translation.state.frontends[&frontend("10.96.0.10", 80, Protocol::Tcp)];
    assert_eq!(backends(entry), ["10.1.0.1:8080", "10.1.0.2:8080", "10.1.0.9:8080"]);
}

#[test]
fn a_service_without_endpoints_is_still_a_frontend_with_no_backends() {
    let translation = translate(&[web()], &[]);
    assert!(translation.state.frontends.values().all(|entry| entry.all_backends().is_empty()));
    assert_eq!(translation.state.frontends.len(), 2);
}

#[test]
fn headless_and_external_name_services_have_no_frontends_and_are_not_errors() {
    let headless = service("headless", json!({"clusterIP": "None", "ports": [{"port": 80}]}));
    let external = service("external", json!({"type": "ExternalName", "externalName": "example.com"}));
    let translation = translate(&[headless, external], &[]);
    assert!(translation.state.frontends.is_empty());
    assert!(translation.rejected.is_empty());
}

#[test]
fn dual_stack_cluster_ips_each_get_a_frontend() {
    let dual = service(
        "dual",
        json!({"clusterIP": "10.96.0.11", "clusterIPs": ["10.96.0.11", "fd00::11"], "ports": [{"port": 80}]}),
    );
    let translation = translate(&[dual], &[]);
    let ips: Vec<IpAddr> = translation.state.frontends.keys().map(|f| f.ip).collect();
    assert_eq!(ips, ["10.96.0.11".parse::<IpAddr>().unwrap(), "fd00::11".parse().unwrap()]);
}

#[test]
fn invalid_services_are_rejected_alone() {
    let cases = [
        (json!({"clusterIP": "10.96.0.300", "ports": [{"port": 80}]}), "is not an IP address"),
        (json!({"clusterIP": "10.96.0.1", "ports": [{"port": 0}]}), "is not a port"),
        (json!({"clusterIP": "10.96.0.1", "ports": [{"port": 70000}]}), "is not a port"),
        (
            json!({"clusterIP": "10.96.0.1", "ports": [{"port": 80, "protocol": "ICMP"}]}),
            "is not TCP, UDP or SCTP",
        ),
        (
            json!({"clusterIP": "10.96.0.1", "ports": [{"name": "a", "port": 80}, {"name": "b", "port": 80}]}),
            "listed twice",
        ),
        // A port name that would end an iptables-restore line or its quoted comment.
        (
            json!({"clusterIP": "10.96.0.1", "ports": [{"name": "x\n-A INPUT -j ACCEPT", "port": 80}]}),
            "is not a valid name",
        ),
        (json!({"clusterIP": "10.96.0.1", "ports": [{"name": "a\"b", "port": 80}]}), "is not a valid name"),
        (
            json!({"clusterIP": "10.96.0.1", "ports": [{"name": "a.b", "port": 80}]}),
            "is not a valid port name",
        ),
    ];
    for (spec, reason) in cases {
        let translation = translate(&[service("bad", spec.clone()), web()], &[]);
        assert_eq!(translation.rejected.len(), 1, "{spec}");
        assert!(translation.rejected[0].reason.contains(reason), "{spec}: {}", translation.rejected[0]);
        assert_eq!(translation.rejected[0].object, "Service ns/bad");
        assert_eq!(translation.state.frontends.len(), 2, "the valid service must still be applied ({spec})");
    }
}

#[test]
fn names_the_api_server_would_refuse_are_refused() {
    for (namespace, name) in [
        ("ns", "web\n-A INPUT -j ACCEPT"),
        ("ns", "web\"quoted"),
        ("ns", "Web"),
        ("ns", "-web"),
        ("ns\nx", "web2"),
        ("ns", &"w".repeat(64)),
        (&"n".repeat(64), "web2"),
    ] {
        let bad: Service = serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"clusterIP": "10.96.0.30", "ports": [{"port": 80}]},
        }))
        .unwrap();
        let translation = translate(&[web(), bad], &[]);
        assert_eq!(translation.rejected.len(), 1, "{namespace:?}/{name:?}");
        assert!(
            translation.rejected[0].reason.contains("is not a valid name"),
            "{}",
            translation.rejected[0]
        );
        assert_eq!(translation.state.frontends.len(), 2);
    }
    let fine =
        service("web-2.v1", json!({"clusterIP": "10.96.0.30", "ports": [{"name": "http-alt", "port": 80}]}));
    assert!(translate(&[fine], &[]).rejected.is_empty());
}

#[test]
fn invalid_slices_are_rejected_alone() {
    let good = slice(
        "web-good",
        "web",
        json!({"endpoints": [{"addresses": ["10.1.0.1"]}], "ports": [{"name": "http", "port": 8080}]}),
    );
    let cases = [
        slice(
            "web-bad",
            "web",
            json!({"endpoints": [{"addresses": ["10.1.0.999"]}], "ports": [{"name": "http", "port": 8080}]}),
        ),
        slice(
            "web-bad",
            "web",
            json!({"endpoints": [{"addresses": ["fd00::1"]}], "ports": [{"name": "http", "port": 8080}]}),
        ),
        slice(
            "web-bad",
            "web",
            json!({"endpoints": [{"addresses": ["10.1.0.2"]}], "ports": [{"name": "http", "port": 0}]}),
        ),
        slice(
            "web-bad",
            "",
            json!({"endpoints": [{"addresses": ["10.1.0.2"]}], "ports": [{"name": "http", "port": 8080}]}),
        ),
    ];
    for bad in cases {
        let translation = translate(&[web()], &[bad.clone(), good.clone()]);
        assert_eq!(translation.rejected.len(), 1, "{bad:?}");
        assert_eq!(translation.rejected[0].object, "EndpointSlice ns/web-bad");
        let entry = &translation.state.frontends[&frontend("10.96.0.10", 80, Protocol::Tcp)];
        assert_eq!(backends(entry), ["10.1.0.1:8080"]);
    }
}

#[test]
fn between_undated_objects_a_frontend_goes_to_the_first_service_by_name() {
    // A services file's objects carry no creation time and no uid: the name is all there is.
    let first = service("a-first", json!({"clusterIP": "10.96.0.10", "ports": [{"port": 80}]}));
    let translation = translate(&[web(), first], &[]);
    let owner = &translation.state.frontends[&frontend("10.96.0.10", 80, Protocol::Tcp)].service;
    assert_eq!(owner.name, "a-first");
    assert_eq!(translation.rejected.len(), 1);
    assert!(translation.rejected[0].reason.contains("already served by ns/a-first"));
}

/// A service in `namespace` created at `created` (RFC 3339) with uid `uid`.
fn dated_service(namespace: &str, name: &str, created: &str, uid: &str, spec: serde_json::Value) -> Service {
    serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": namespace, "creationTimestamp": created, "uid": uid},
        "spec": spec,
    }))
    .unwrap()
}

fn owner_of(translation: &Translation, frontend: &Frontend) -> String {
    let owner = &translation.state.frontends[frontend].service;
    format!("{}/{}", owner.namespace, owner.name)
}

#[test]
fn a_cluster_ip_beats_an_older_services_external_ip_on_it() {
    // CVE-2020-8554: a tenant's external IP set to cluster DNS's address, in a namespace that
    // sorts first and from a service older than kube-dns.
    let dns = dated_service(
        "kube-system",
        "kube-dns",
        "2026-03-01T00:00:00Z",
        "uid-dns",
        json!({"clusterIP": "10.96.0.10", "ports": [{"name": "dns", "port": 53, "protocol": "UDP"}]}),
    );
    let tenant = dated_service(
        "aaa",
        "grab",
        "2026-01-01T00:00:00Z",
        "uid-grab",
        json!({"clusterIP": "10.96.5.5", "externalIPs": ["10.96.0.10"],
               "ports": [{"name": "dns", "port": 53, "protocol": "UDP"}]}),
    );
    for services in [[dns.clone(), tenant.clone()], [tenant, dns]] {
        let translation = translate(&services, &[]);
        assert_eq!(
            owner_of(&translation, &frontend("10.96.0.10", 53, Protocol::Udp)),
            "kube-system/kube-dns"
        );
        assert_eq!(translation.rejected.len(), 1, "{:?}", translation.rejected);
        assert_eq!(translation.rejected[0].object, "Service aaa/grab");
        assert!(translation.rejected[0].reason.contains("already served by kube-system/kube-dns:dns"));
    }
}

#[test]
fn among_equal_claims_the_older_service_wins_whatever_its_name() {
    let claim = |name: &str, created: &str, uid: &str| {
        dated_service(
            "ns",
            name,
            created,
            uid,
            json!({"clusterIP": format!("10.96.1.{}", name.len()), "externalIPs": ["203.0.113.7"],
                   "ports": [{"port": 443}]}),
        )
    };
    let vip = frontend("203.0.113.7", 443, Protocol::Tcp);
    let older = claim("zz-older", "2026-01-01T00:00:00Z", "uid-b");
    let newer = claim("a-newer", "2026-06-01T00:00:00Z", "uid-a");
    assert_eq!(owner_of(&translate(&[newer.clone(), older.clone()], &[]), &vip), "ns/zz-older");
    assert_eq!(owner_of(&translate(&[older, newer], &[]), &vip), "ns/zz-older");
    // Created in the same second: the uid decides, not the name.
    let same_a = claim("zz-same", "2026-01-01T00:00:00Z", "uid-1");
    let same_b = claim("a-same", "2026-01-01T00:00:00Z", "uid-2");
    assert_eq!(owner_of(&translate(&[same_b, same_a], &[]), &vip), "ns/zz-same");
}

#[test]
fn special_addresses_are_refused_as_service_addresses() {
    for (field, address, kind) in [
        ("externalIPs", "0.0.0.0", "unspecified"),
        ("externalIPs", "127.0.0.1", "loopback"),
        ("externalIPs", "169.254.169.254", "link-local"),
        ("externalIPs", "224.0.0.1", "multicast"),
        ("externalIPs", "255.255.255.255", "broadcast"),
        ("externalIPs", "::", "unspecified"),
        ("externalIPs", "::1", "loopback"),
        ("externalIPs", "fe80::1", "link-local"),
        ("externalIPs", "ff02::1", "multicast"),
        ("externalIPs", "::ffff:10.96.0.10", "IPv4-mapped IPv6"),
        ("clusterIP", "127.0.0.2", "loopback"),
        ("loadBalancer", "0.0.0.0", "unspecified"),
    ] {
        let mut spec = json!({"type": "LoadBalancer", "clusterIP": "10.96.0.20", "ports": [{"port": 80}]});
        let mut status = json!({});
        match field {
            "externalIPs" => spec["externalIPs"] = json!([address]),
            "clusterIP" => spec["clusterIP"] = json!(address),
            _ => status = json!({"loadBalancer": {"ingress": [{"ip": address}]}}),
        }
        let bad: Service = serde_json::from_value(json!({
            "metadata": {"name": "bad", "namespace": "ns"}, "spec": spec, "status": status,
        }))
        .unwrap();
        let translation = translate(&[web(), bad], &[]);
        assert_eq!(translation.rejected.len(), 1, "{field} {address}: {:?}", translation.rejected);
        assert_eq!(translation.rejected[0].object, "Service ns/bad");
        assert!(translation.rejected[0].reason.contains(kind), "{address}: {}", translation.rejected[0]);
        // Refused as a whole, and the service beside it is untouched.
        assert!(translation.state.frontends.values().all(|entry| entry.service.name == "web"));
        assert_eq!(translation.state.frontends.len(), 2);
    }
}

#[test]
fn a_node_address_is_an_external_ip_except_on_the_ports_vipr_serves_there() {
    let node = NodeContext { own_ports: [10256, 10249].into(), ..node_a() };
    let external = |name: &str, port: u16| {
        service(
            name,
            json!({"clusterIP": "10.96.0.30", "externalIPs": ["192.168.0.2"],
                   "ports": [{"port": port}]}),
        )
    };
    let health_checked = service(
        "lb",
        json!({"type": "LoadBalancer", "clusterIP": "10.96.0.31", "externalTrafficPolicy": "Local",
               "healthCheckNodePort": 31000, "ports": [{"port": 80, "nodePort": 30080}]}),
    );
    let services = [external("livez", 10256), external("hc", 31000), external("fine", 8080), health_checked];
    let translation = desired_state(&services, &[] as &[EndpointSlice], &node);
    let frontends = &translation.state.frontends;
    assert!(frontends.contains_key(&frontend("192.168.0.2", 8080, Protocol::Tcp)));
    assert!(!frontends.contains_key(&frontend("192.168.0.2", 10256, Protocol::Tcp)));
    assert!(!frontends.contains_key(&frontend("192.168.0.2", 31000, Protocol::Tcp)));
    let mut refused: Vec<String> = translation.rejected.iter().map(ToString::to_string).collect();
    refused.sort();
    assert_eq!(refused.len(), 2, "{refused:?}");
    assert!(refused[0].starts_with("Service ns/hc: frontend 192.168.0.2:31000/TCP"), "{refused:?}");
    assert!(refused[0].contains("health-check node port"), "{refused:?}");
    assert!(refused[1].starts_with("Service ns/livez: frontend 192.168.0.2:10256/TCP"), "{refused:?}");
    // Their cluster IPs still serve.
    assert!(frontends.contains_key(&frontend("10.96.0.30", 10256, Protocol::Tcp)));
}

fn node_a() -> NodeContext {
    NodeContext::resolve(
        &NodeFacts {
            name: "node-a".into(),
            zone: None,
            addresses: ["127.0.0.1", "192.168.0.2", "192.168.1.2", "fe80::1", "2001:db8::1"]
                .map(|ip| ip.parse().unwrap())
                .to_vec(),
            primary_ips: Vec::new(),
        },
        &ProxySettings { cluster_cidrs: vec!["10.0.0.0/8".parse().unwrap()], ..ProxySettings::default() },
    )
}

#[test]
fn node_context_defaults_node_ports_to_the_primary_address_of_each_family() {
    let node = node_a();
    let ips = |ips: &[&str]| ips.iter().map(|ip| ip.parse::<IpAddr>().unwrap()).collect::<Vec<_>>();
    assert_eq!(node.primary_ips, ips(&["192.168.0.2", "2001:db8::1"]));
    assert_eq!(node.node_port_ips.iter().copied().collect::<Vec<_>>(), ips(&["192.168.0.2", "2001:db8::1"]));
    assert_eq!(
        node.node_ips.iter().copied().collect::<Vec<_>>(),
        ips(&["192.168.0.2", "192.168.1.2", "2001:db8::1"])
    );
    let restricted = NodeContext::resolve(
        &NodeFacts { addresses: ips(&["192.168.0.2", "192.168.1.2"]), ..NodeFacts::default() },
        &ProxySettings {
            node_port_cidrs: vec!["192.168.1.0/24".parse().unwrap()],
            ..ProxySettings::default()
        },
    );
    assert_eq!(restricted.node_port_ips.iter().copied().collect::<Vec<_>>(), ips(&["192.168.1.2"]));
}

fn policy_service(external: &str, internal: &str) -> Service {
    service(
        "web",
        json!({"type": "LoadBalancer", "clusterIP": "10.96.0.10", "externalTrafficPolicy": external,
               "internalTrafficPolicy": internal,
               "ports": [{"name": "http", "port": 80, "nodePort": 30080}]}),
    )
}

fn endpoints(list: serde_json::Value) -> EndpointSlice {
    slice("web-1", "web", json!({"endpoints": list, "ports": [{"name": "http", "port": 8080}]}))
}

fn addresses(treatment: &Treatment) -> Vec<String> {
    treatment.backends.iter().map(|b| b.ip.to_string()).collect()
}

#[test]
fn terminating_endpoints_serve_only_when_nothing_is_ready() {
    let slices = [endpoints(json!([
        {"addresses": ["10.1.0.1"], "conditions": {"ready": false, "serving": true, "terminating": true}},
        {"addresses": ["10.1.0.2"], "conditions": {"ready": false, "serving": false, "terminating": true}},
        {"addresses": ["10.1.0.3"], "conditions": {"ready": true}},
    ]))];
    let state = desired_state(&[policy_service("Cluster", "Cluster")], &slices, &node_a()).state;
    assert_eq!(
        addresses(&state.frontends[&frontend("10.96.0.10", 80, Protocol::Tcp)].from_pod),
        ["10.1.0.3"]
    );

    let slices = [endpoints(json!([
        {"addresses": ["10.1.0.1"], "conditions": {"ready": false, "serving": true, "terminating": true}},
        {"addresses": ["10.1.0.2"], "conditions": {"ready": false, "serving": false, "terminating": true}},
    ]))];
    let state = desired_state(&[policy_service("Cluster", "Cluster")], &slices, &node_a()).state;
    assert_eq!(
        addresses(&state.frontends[&frontend("10.96.0.10", 80, Protocol::Tcp)].from_pod),
        ["10.1.0.1"]
    );
}

#[test]
fn local_policies_use_local_endpoints_and_drop_when_only_remote_ones_exist() {
    let remote_only = [endpoints(json!([{"addresses": ["10.1.0.1"], "nodeName": "node-b"}]))];
    let state = desired_state(&[policy_service("Local", "Local")], &remote_only, &node_a()).state;
    let cluster_ip = &state.frontends[&frontend("10.96.0.10", 80, Protocol::Tcp)];
    assert!(cluster_ip.from_pod.backends.is_empty());
    assert_eq!(cluster_ip.from_pod.when_empty, WhenEmpty::Drop);
    let node_port = &state.frontends[&frontend("192.168.0.2", 30080, Protocol::Tcp)];
    assert_eq!(node_port.from_outside.when_empty, WhenEmpty::Drop);
    assert!(!node_port.from_outside.masquerade);
    // Pods and the node are short-circuited to every endpoint; the node masqueraded.
    assert_eq!(addresses(&node_port.from_pod), ["10.1.0.1"]);
    assert!(!node_port.from_pod.masquerade);
    assert!(node_port.from_node.masquerade);

    let none = desired_state(&[policy_service("Local", "Local")], &[], &node_a()).state;
    assert_eq!(
        none.frontends[&frontend("192.168.0.2", 30080, Protocol::Tcp)].from_outside.when_empty,
        WhenEmpty::Reject
    );
}

#[test]
fn cluster_ip_traffic_is_masqueraded_unless_it_comes_from_a_pod() {
    let slices = [endpoints(json!([{"addresses": ["10.1.0.1"]}]))];
    let state = desired_state(&[policy_service("Cluster", "Cluster")], &slices, &node_a()).state;
    let cluster_ip = &state.frontends[&frontend("10.96.0.10", 80, Protocol::Tcp)];
    assert!(!cluster_ip.from_pod.masquerade);
    assert!(cluster_ip.from_node.masquerade && cluster_ip.from_outside.masquerade);
    let node_port = &state.frontends[&frontend("192.168.0.2", 30080, Protocol::Tcp)];
    assert!(node_port.from_pod.masquerade && node_port.from_outside.masquerade);
    assert_eq!(state.sources.classify("10.2.3.4".parse().unwrap()), SourceClass::Pod);
    assert_eq!(state.sources.classify("192.168.1.2".parse().unwrap()), SourceClass::Node);
    assert_eq!(state.sources.classify("203.0.113.9".parse().unwrap()), SourceClass::Outside);
}

#[test]
fn each_family_is_judged_on_its_own_endpoints_and_detector() {
    let dual = service(
        "web",
        json!({"clusterIPs": ["10.96.0.10", "fd00::10"], "internalTrafficPolicy": "Local", "ports": [{"name": "http", "port": 80}]}),
    );
    let v4_remote = slice(
        "web-v4",
        "web",
        json!({"endpoints": [{"addresses": ["10.1.0.1"], "nodeName": "node-b"}], "ports": [{"name": "http", "port": 8080}]}),
    );
    // node_a() has an IPv4 detector only.
    let state = desired_state(&[dual], &[v4_remote], &node_a()).state;
    let v4 = &state.frontends[&frontend("10.96.0.10", 80, Protocol::Tcp)];
    let v6 = &state.frontends[&frontend("fd00::10", 80, Protocol::Tcp)];
    assert_eq!(v4.from_pod.when_empty, WhenEmpty::Drop, "IPv4 endpoints exist, only elsewhere");
    assert_eq!(v6.from_pod.when_empty, WhenEmpty::Reject, "no IPv6 endpoint at all");
    assert!(v4.from_outside.masquerade, "IPv4 has a detector");
    assert!(!v6.from_outside.masquerade, "IPv6 has none");
}

#[test]
fn an_interface_detector_is_a_detector_of_both_families() {
    let dual = service(
        "web",
        json!({"type": "NodePort", "clusterIPs": ["10.96.0.10", "fd00::10"], "externalTrafficPolicy": "Local",
               "ports": [{"name": "http", "port": 80, "nodePort": 30080}]}),
    );
    let remote = [
        slice(
            "web-4",
            "web",
            json!({"endpoints": [{"addresses": ["10.1.0.1"], "nodeName": "node-b"}], "ports": [{"name": "http", "port": 8080}]}),
        ),
        slice(
            "web-6",
            "web",
            json!({"addressType": "IPv6", "endpoints": [{"addresses": ["fd00:1::1"], "nodeName": "node-b"}],
                   "ports": [{"name": "http", "port": 8080}]}),
        ),
    ];
    for pods in [PodInterfaces::NamePrefix("veth".into()), PodInterfaces::Bridge("cbr0".into())] {
        let node = NodeContext::resolve(
            &NodeFacts {
                name: "node-a".into(),
                addresses: ["192.168.0.2", "2001:db8::1"].map(|ip| ip.parse().unwrap()).to_vec(),
                ..NodeFacts::default()
            },
            &ProxySettings { pod_interfaces: Some(pods.clone()), ..ProxySettings::default() },
        );
        let translation = desired_state(std::slice::from_ref(&dual), &remote, &node);
        assert!(translation.rejected.is_empty(), "{:?}", translation.rejected);
        let state = translation.state;
        assert_eq!(state.sources.pod_interfaces, Some(pods.clone()));
        assert!(state.sources.pod_cidrs.is_empty());
        for (cluster_ip, node_ip, endpoint) in
            [("10.96.0.10", "192.168.0.2", "10.1.0.1"), ("fd00::10", "2001:db8::1", "fd00:1::1")]
        {
            let cluster = &state.frontends[&frontend(cluster_ip, 80, Protocol::Tcp)];
            assert!(!cluster.from_pod.masquerade, "{pods:?} {cluster_ip}");
            assert!(
                cluster.from_outside.masquerade,
                "{pods:?} {cluster_ip}: off-cluster traffic masqueraded"
            );
            // eTP:Local with the only endpoint elsewhere: pods are short-circuited to it,
            // outside clients dropped.
            let node_port = &state.frontends[&frontend(node_ip, 30080, Protocol::Tcp)];
            assert_eq!(addresses(&node_port.from_pod), [endpoint], "{pods:?}");
            assert!(node_port.from_outside.backends.is_empty());
            assert_eq!(node_port.from_outside.when_empty, WhenEmpty::Drop);
        }
    }
    assert!(PodInterfaces::Bridge("cbr0".into()).admits("cbr0", None));
    assert!(PodInterfaces::Bridge("cbr0".into()).admits("veth1", Some("cbr0")));
    assert!(!PodInterfaces::Bridge("cbr0".into()).admits("eth0", None));
    assert!(PodInterfaces::NamePrefix("veth".into()).admits("veth1234", None));
    assert!(!PodInterfaces::NamePrefix("veth".into()).admits("eth0", Some("veth")));
}

/// Service `web` (10.96.0.10:80) with `trafficDistribution`, if any.
fn distributed_web(distribution: Option<&str>) -> Service {
    let mut spec = json!({"clusterIP": "10.96.0.10", "ports": [{"name": "http", "port": 80}]});
    if let Some(distribution) = distribution {
        spec["trafficDistribution"] = json!(distribution);
    }
    service("web", spec)
}

/// A ready endpoint with the given node and zone hints (none: no hints of that kind).
fn hinted(address: &str, nodes: &[&str], zones: &[&str]) -> serde_json::Value {
    let names = |names: &[&str]| names.iter().map(|name| json!({"name": name})).collect::<Vec<_>>();
    let mut hints = json!({});
    if !nodes.is_empty() {
        hints["forNodes"] = json!(names(nodes));
    }
    if !zones.is_empty() {
        hints["forZones"] = json!(names(zones));
    }
    json!({"addresses": [address], "conditions": {"ready": true}, "hints": hints})
}

/// Where pods on `node` reach `web`'s cluster IP, for `web` with `distribution` and `list`.
fn pods_reach(distribution: Option<&str>, list: serde_json::Value, node: &NodeContext) -> Vec<String> {
    let state = desired_state(&[distributed_web(distribution)], &[endpoints(list)], node).state;
    addresses(&state.frontends[&frontend("10.96.0.10", 80, Protocol::Tcp)].from_pod)
}

/// node-a in zone `a`.
fn node_a_in_zone_a() -> NodeContext {
    NodeContext { zone: Some("a".into()), ..node_a() }
}

#[test]
fn zone_hints_are_used_whenever_every_ready_endpoint_has_one() {
    let node = node_a_in_zone_a();
    let zoned = || json!([hinted("10.1.0.1", &[], &["a"]), hinted("10.1.0.2", &[], &["b"])]);
    // kube-proxy reads the hints, not the Service: whatever asked the controller for them.
    for distribution in [Some("PreferClose"), Some("PreferSameZone"), None] {
        assert_eq!(pods_reach(distribution, zoned(), &node), ["10.1.0.1"], "{distribution:?}");
    }
    // A ready endpoint without hints makes zone hints unusable.
    let partly = json!([hinted("10.1.0.1", &[], &["a"]), {"addresses": ["10.1.0.2"]}]);
    assert_eq!(pods_reach(Some("PreferClose"), partly, &node), ["10.1.0.1", "10.1.0.2"]);
    // An endpoint that is not ready does not count, hints or not.
    let unready_unhinted = json!([
        hinted("10.1.0.1", &[], &["a"]), hinted("10.1.0.2", &[], &["b"]),
        {"addresses": ["10.1.0.3"], "conditions": {"ready": false}},
    ]);
    assert_eq!(pods_reach(None, unready_unhinted, &node), ["10.1.0.1"]);
    // No endpoint for this zone, or a node without a zone: every endpoint.
    let elsewhere = NodeContext { zone: Some("c".into()), ..node_a() };
    assert_eq!(pods_reach(Some("PreferClose"), zoned(), &elsewhere), ["10.1.0.1", "10.1.0.2"]);
    assert_eq!(pods_reach(Some("PreferClose"), zoned(), &node_a()), ["10.1.0.1", "10.1.0.2"]);
}

#[test]
fn node_hints_come_first_and_fall_back_to_zone_hints() {
    let node = node_a_in_zone_a();
    // As the EndpointSlice controller writes them for PreferSameNode: both kinds of hint.
    let same_node = || {
        json!([
            hinted("10.1.0.1", &["node-a"], &["a"]),
            hinted("10.1.0.2", &["node-b"], &["a"]),
            hinted("10.1.0.3", &["node-c"], &["b"]),
        ])
    };
    assert_eq!(pods_reach(Some("PreferSameNode"), same_node(), &node), ["10.1.0.1"]);
    assert_eq!(pods_reach(None, same_node(), &node), ["10.1.0.1"], "hints, not the Service, decide");
    // Node hints alone.
    let nodes_only = json!([hinted("10.1.0.1", &["node-a"], &[]), hinted("10.1.0.2", &["node-b"], &[])]);
    assert_eq!(pods_reach(Some("PreferSameNode"), nodes_only, &node), ["10.1.0.1"]);
    // No endpoint hinted for this node: the zone hints decide.
    let other = NodeContext { name: "node-z".into(), ..node.clone() };
    assert_eq!(pods_reach(Some("PreferSameNode"), same_node(), &other), ["10.1.0.1", "10.1.0.2"]);
    // A ready endpoint without a node hint: the zone hints decide.
    let partly = json!([
        hinted("10.1.0.1", &["node-a"], &["a"]),
        hinted("10.1.0.2", &[], &["a"]),
        hinted("10.1.0.3", &[], &["b"])
    ]);
    assert_eq!(pods_reach(Some("PreferSameNode"), partly, &node), ["10.1.0.1", "10.1.0.2"]);
    // Neither kind usable: every endpoint.
    let nothing_here = json!([hinted("10.1.0.1", &["node-b"], &["b"]), hinted("10.1.0.2", &["node-c"], &[])]);
    assert_eq!(pods_reach(Some("PreferSameNode"), nothing_here, &node), ["10.1.0.1", "10.1.0.2"]);
}

#[test]
fn topology_narrows_cluster_endpoints_only() {
    // externalTrafficPolicy: Local still uses every local endpoint, whatever the hints.
    let node = node_a_in_zone_a();
    let mut local = hinted("10.1.0.1", &["node-b"], &["b"]);
    local["nodeName"] = json!("node-a");
    let list = json!([local, hinted("10.1.0.2", &["node-a"], &["a"])]);
    let state = desired_state(&[policy_service("Local", "Cluster")], &[endpoints(list)], &node).state;
    let cluster_ip = &state.frontends[&frontend("10.96.0.10", 80, Protocol::Tcp)];
    assert_eq!(addresses(&cluster_ip.from_pod), ["10.1.0.2"], "the cluster policy follows the node hint");
    let node_port = &state.frontends[&frontend("192.168.0.2", 30080, Protocol::Tcp)];
    assert_eq!(addresses(&node_port.from_outside), ["10.1.0.1"], "the local policy ignores hints");
}

#[test]
fn an_endpoint_without_a_serving_condition_counts_as_serving() {
    // Terminating and not ready, serving unset: the fallback when nothing is ready.
    let list = json!([
        {"addresses": ["10.1.0.1"], "conditions": {"ready": false, "terminating": true}},
        {"addresses": ["10.1.0.2"], "conditions": {"ready": false, "serving": false, "terminating": true}},
    ]);
    assert_eq!(pods_reach(None, list, &node_a()), ["10.1.0.1"]);
}

#[test]
fn service_cidr_objects_replace_the_flags_range() {
    let cidr = |name: &str, cidrs: serde_json::Value| -> ServiceCIDR {
        serde_json::from_value(json!({"metadata": {"name": name}, "spec": {"cidrs": cidrs}})).unwrap()
    };
    let flag: Vec<IpNet> = vec!["10.96.0.0/12".parse().unwrap()];
    let text = |ranges: Vec<IpNet>| ranges.iter().map(ToString::to_string).collect::<Vec<_>>();
    assert_eq!(text(service_cidrs(&[], &flag).0), ["10.96.0.0/12"], "none: the flag");
    let objects = [
        cidr("kubernetes", json!(["10.96.0.0/16", "fd00:10:96::/112"])),
        cidr("extra", json!(["10.100.0.0/24", "10.96.0.0/16"])),
    ];
    assert_eq!(text(service_cidrs(&objects, &flag).0), ["10.96.0.0/16", "10.100.0.0/24", "fd00:10:96::/112"]);
    let (ranges, rejected) = service_cidrs(&[cidr("bad", json!(["10.96.0.0/16", "ten"]))], &flag);
    assert_eq!(text(ranges), ["10.96.0.0/16"], "the good range of it stays");
    assert_eq!(rejected.len(), 1);
    assert!(rejected[0].to_string().starts_with("ServiceCIDR bad: spec.cidrs[1]"), "{}", rejected[0]);
}

/// The health checks are part of the desired state: eTP:Local load balancers with a
/// healthCheckNodePort, each with its distinct ready endpoints on this node, by the model's
/// own reading of the conditions (an unset `ready` is ready).
#[test]
fn health_checks_count_distinct_ready_local_endpoints() {
    let local_lb = |port: u16| {
        json!({"type": "LoadBalancer", "externalTrafficPolicy": "Local", "healthCheckNodePort": port,
               "clusterIP": "10.96.0.50", "ports": [{"port": 80, "nodePort": port + 100}]})
    };
    let services = [
        service("lb", local_lb(32000)),
        service("empty", local_lb(32001)),
        service(
            "cluster",
            json!({"type": "LoadBalancer", "externalTrafficPolicy": "Cluster", "healthCheckNodePort": 32002}),
        ),
        service(
            "nodeport",
            json!({"type": "NodePort", "externalTrafficPolicy": "Local", "healthCheckNodePort": 32003}),
        ),
        service("noport", json!({"type": "LoadBalancer", "externalTrafficPolicy": "Local"})),
    ];
    let endpoints = |list: serde_json::Value| json!({"endpoints": list, "ports": [{"port": 80}]});
    let slices = [
        slice(
            "lb-a",
            "lb",
            endpoints(json!([
                {"addresses": ["10.0.0.1"], "nodeName": "node-a"},
                {"addresses": ["10.0.0.2"], "nodeName": "node-a", "conditions": {"ready": true}},
                {"addresses": ["10.0.0.3"], "nodeName": "node-a", "conditions": {"ready": false}},
                {"addresses": ["10.0.0.4"], "nodeName": "other"},
            ])),
        ),
        // The same endpoint in a second slice (another port) counts once.
        slice(
            "lb-b",
            "lb",
            json!({"endpoints": [{"addresses": ["10.0.0.1"], "nodeName": "node-a"}], "ports": [{"port": 81}]}),
        ),
        slice("empty-a", "empty", endpoints(json!([{"addresses": ["10.0.0.5"], "nodeName": "other"}]))),
    ];
    let checks = translate(&services, &slices).state.health_checks;
    let name = |name: &str| ServiceName { namespace: "ns".into(), name: name.into() };
    assert_eq!(
        checks,
        BTreeMap::from([
            (name("empty"), HealthCheck { port: 32001, local_endpoints: 0 }),
            (name("lb"), HealthCheck { port: 32000, local_endpoints: 2 }),
        ])
    );
}
