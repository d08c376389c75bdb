use std::time::Duration;

use serde_json::{json, Value};

use super::*;
use crate::model::{
    changes::{ChangeTracker, Kind, Object},
    kubernetes::{incremental::Translator, NodeContext},
    Frontend,
};

fn service(value: Value) -> Service {
    serde_json::from_value(value).unwrap()
}

fn slice(value: Value) -> EndpointSlice {
    serde_json::from_value(value).unwrap()
}

/// A load balancer with every field the translation reads, and many it does not.
fn load_balancer() -> Value {
    json!({
        "metadata": {
            "name": "web", "namespace": "shop", "uid": "u1", "resourceVersion": "7",
            "creationTimestamp": "2026-01-01T00:00:00Z",
            "labels": {"app": "web"},
            "annotations": {"kubectl.kubernetes.io/last-applied-configuration": "{\"a\": \"long copy\"}"},
            "managedFields": [{"manager": "kubectl", "operation": "Apply", "fieldsType": "FieldsV1", "fieldsV1": {}}],
        },
        "spec": {
            "type": "LoadBalancer",
            "clusterIP": "10.96.0.10", "clusterIPs": ["10.96.0.10", "fd00::10"],
            "ipFamilies": ["IPv4", "IPv6"], "ipFamilyPolicy": "PreferDualStack",
            "externalIPs": ["192.0.2.7"],
            "loadBalancerSourceRanges": ["203.0.113.0/24"],
            "externalTrafficPolicy": "Local", "internalTrafficPolicy": "Cluster",
            "healthCheckNodePort": 30999,
            "sessionAffinity": "ClientIP", "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 60}},
            "selector": {"app": "web"},
            "ports": [{"name": "http", "port": 80, "targetPort": 8080, "nodePort": 30080, "protocol": "TCP"}],
        },
        "status": {
            "loadBalancer": {"ingress": [{"ip": "198.51.100.1"}, {"ip": "198.51.100.2", "ipMode": "Proxy"}]},
            "conditions": [{"type": "Ready", "status": "True", "reason": "r", "message": "m",
                            "lastTransitionTime": "2026-01-01T00:00:00Z"}],
        },
    })
}

#[test]
fn a_service_keeps_what_the_translation_reads_and_nothing_else() {
    let decoded = ServiceObject::decode(&service(load_balancer()));
    assert_eq!(decoded.meta.key(), ("shop".into(), "web".into()));
    assert_eq!((decoded.meta.uid(), decoded.meta.resource_version()), (Some("u1"), Some("7")));
    assert_eq!(decoded.health_check_node_port, Some(30999));
    assert_eq!(decoded.invalid(), None);
    let ports = decoded.ports.as_deref().unwrap();
    let [port] = ports else { panic!("{ports:?}") };
    assert_eq!((port.port, port.node_port, &*port.name.port), (80, Some(30080), "http"));
    let spec = &port.service;
    let ips = |list: &[&str]| list.iter().map(|ip| ip.parse().unwrap()).collect::<Vec<IpAddr>>();
    assert_eq!(spec.cluster_ips, ips(&["10.96.0.10", "fd00::10"]));
    assert_eq!(spec.external_ips, ips(&["192.0.2.7"]));
    // ipMode Proxy ingress is left alone, as kube-proxy does.
    assert_eq!(spec.load_balancer_ips, ips(&["198.51.100.1"]));
    assert_eq!(spec.source_ranges, ["203.0.113.0/24".parse().unwrap()]);
    assert_eq!(spec.affinity, Some(Duration::from_secs(60)));
    assert_eq!(spec.seniority.uid.as_deref(), Some("u1"));

    // What it does not read is gone: another selector, labels, annotations, managed fields,
    // status conditions and IP families decode to the same object.
    let mut other = load_balancer();
    other["metadata"]["labels"] = json!({"app": "other"});
    other["metadata"]["annotations"] = json!({});
    other["metadata"]["managedFields"] = json!([]);
    other["spec"]["selector"] = json!({"app": "other"});
    other["spec"]["ipFamilyPolicy"] = json!("RequireDualStack");
    other["spec"]["ports"][0]["targetPort"] = json!(9090);
    other["status"]["conditions"] = json!([]);
    assert_eq!(ServiceObject::decode(&service(other)), decoded);
    // What it reads is not.
    let mut moved = load_balancer();
    moved["spec"]["externalIPs"] = json!(["192.0.2.8"]);
    assert_ne!(ServiceObject::decode(&service(moved)), decoded);
}

fn full_slice() -> Value {
    json!({
        "metadata": {
            "name": "web-abc", "namespace": "shop", "uid": "s1", "resourceVersion": "9",
            "labels": {"kubernetes.io/service-name": "web", "endpointslice.kubernetes.io/managed-by": "c"},
            "annotations": {LAST_CHANGE_TRIGGER_TIME: "2026-01-01T00:00:05Z"},
            "ownerReferences": [{"apiVersion": "v1", "kind": "Service", "name": "web", "uid": "u1"}],
        },
        "addressType": "IPv4",
        "endpoints": [
            {"addresses": ["10.1.0.1"], "conditions": {"ready": false, "serving": true, "terminating": true},
             "nodeName": "node-a", "zone": "z1", "hostname": "web-0",
             "hints": {"forZones": [{"name": "z1"}], "forNodes": [{"name": "node-a"}]},
             "targetRef": {"kind": "Pod", "name": "web-0", "namespace": "shop", "uid": "p1"}},
            {"addresses": ["10.1.0.2"], "nodeName": "node-a"},
            {"addresses": ["10.1.0.3"], "nodeName": "node-b"},
        ],
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP", "appProtocol": "http"}, {"name": "all"}],
    })
}

#[test]
fn a_slice_keeps_addresses_conditions_nodes_and_hints_only() {
    let decoded = SliceObject::decode(&slice(full_slice()));
    assert_eq!(decoded.meta.key(), ("shop".into(), "web-abc".into()));
    assert_eq!(decoded.service.as_deref(), Some("web"));
    assert!(!decoded.ipv6);
    assert_eq!(decoded.trigger_time, Some("2026-01-01T00:00:05Z".parse::<jiff::Timestamp>().unwrap().into()));
    let content = decoded.content.as_ref().unwrap();
    // The port without a number ("all ports") cannot be programmed and is left out.
    assert_eq!(content.ports[..], [SlicePort { name: "http".into(), protocol: Protocol::Tcp, port: 8080 }]);
    let [first, second, third] = &content.endpoints[..] else { panic!("{content:?}") };
    assert_eq!(first.ip, "10.1.0.1".parse::<IpAddr>().unwrap());
    assert_eq!((first.ready, first.serving, first.terminating), (false, true, true));
    let hints = first.hints.as_deref().unwrap();
    assert_eq!((&hints.nodes[..], &hints.zones[..]), (&["node-a".into()][..], &["z1".into()][..]));
    // Unset conditions read as ready, serving, not terminating; no hints, nothing held.
    assert_eq!(
        (second.ready, second.serving, second.terminating, second.hints.is_none()),
        (true, true, false, true)
    );
    // One node name is held once for the slice.
    assert!(Arc::ptr_eq(first.node_name.as_ref().unwrap(), second.node_name.as_ref().unwrap()));
    assert_eq!(third.node_name.as_deref(), Some("node-b"));

    // The endpoint's own zone, hostname and pod reference, the owner and other labels: gone.
    let mut other = full_slice();
    other["endpoints"][0]["zone"] = json!("z9");
    other["endpoints"][0]["hostname"] = json!("web-9");
    other["endpoints"][0]["targetRef"]["name"] = json!("web-9");
    other["metadata"]["ownerReferences"] = json!([]);
    other["metadata"]["labels"]["endpointslice.kubernetes.io/managed-by"] = json!("d");
    other["ports"][0]["appProtocol"] = json!("h2c");
    assert_eq!(SliceObject::decode(&slice(other)), decoded);
    let mut moved = full_slice();
    moved["endpoints"][2]["nodeName"] = json!("node-a");
    assert_ne!(SliceObject::decode(&slice(moved)), decoded);
}

#[test]
fn malformed_objects_keep_their_identity_and_are_reported_as_before() {
    let mut bad_service = load_balancer();
    bad_service["spec"]["externalIPs"] = json!(["not-an-ip"]);
    let decoded = ServiceObject::decode(&service(bad_service));
    assert_eq!(decoded.invalid(), Some("spec.externalIPs entry \"not-an-ip\" is not an IP address"));
    // Its health-check node port is still vipr's to serve, as before.
    assert_eq!(decoded.health_check_node_port, Some(30999));

    let mut bad_slice = full_slice();
    bad_slice["endpoints"][1]["addresses"] = json!(["fd00::1"]);
    let decoded_slice = SliceObject::decode(&slice(bad_slice));
    assert_eq!(decoded_slice.invalid(), Some("endpoints[1] address fd00::1 is not of addressType IPv4"));
    // Still indexed under its service.
    assert_eq!(decoded_slice.service.as_deref(), Some("web"));

    // Through the tracker and the translator: both reported, a good neighbour served.
    let good = service(json!({"metadata": {"name": "good", "namespace": "shop", "resourceVersion": "1"},
                               "spec": {"clusterIP": "10.96.0.11", "ports": [{"port": 80}]}}));
    let mut tracker = ChangeTracker::new(std::time::SystemTime::UNIX_EPOCH);
    tracker.list(Kind::Service, vec![Object::Service(decoded), Object::from(good)]);
    tracker.list(Kind::EndpointSlice, vec![Object::EndpointSlice(decoded_slice)]);
    let mut translator = Translator::new();
    let node = NodeContext { name: "node-a".into(), ..NodeContext::default() };
    let dirty = tracker.take_dirty();
    translator.translate(&tracker, dirty, &node);
    let mut rejected: Vec<String> = translator.rejected().iter().map(ToString::to_string).collect();
    rejected.sort();
    assert_eq!(
        rejected,
        [
            "EndpointSlice shop/web-abc: endpoints[1] address fd00::1 is not of addressType IPv4",
            "Service shop/web: spec.externalIPs entry \"not-an-ip\" is not an IP address",
        ]
    );
    let served = Frontend { ip: "10.96.0.11".parse().unwrap(), port: 80, protocol: Protocol::Tcp };
    assert!(translator.state().frontends.contains_key(&served));
}

#[test]
fn an_endpoint_is_small() {
    // 100k endpoints at 10k services x 10: each byte here is 100 KB of the agent's memory.
    assert!(std::mem::size_of::<Endpoint>() <= 48, "{}", std::mem::size_of::<Endpoint>());
}

#[test]
fn an_event_is_small() {
    // A list of every Service or slice is a vector of events: each is as big as the largest.
    assert!(std::mem::size_of::<Object>() <= 160, "{}", std::mem::size_of::<Object>());
    // Why the Node is boxed: unboxed, every event of a list of 10k slices would be this big.
    let node = std::mem::size_of::<k8s_openapi::api::core::v1::Node>();
    assert!(node > 160, "{node}");
}
