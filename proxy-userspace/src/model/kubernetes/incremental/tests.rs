//! The incremental translator against the full one, over random sequences of events.
use std::time::SystemTime;

use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
use serde_json::{json, Value};

use super::*;
use crate::model::{
    changes::{Kind, Object},
    kubernetes::{desired_state_of, SERVICE_NAME_LABEL},
};

/// xorshift64: reproducible without a dependency.
struct Random(u64);

impl Random {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
}

/// Metadata, with a fresh resourceVersion most of the time (the API server's objects) and
/// none otherwise (a file's).
fn metadata(random: &mut Random, version: &mut u64, name: &str, labels: Value) -> Value {
    *version += 1;
    let mut metadata = json!({"name": name, "namespace": random.pick(&["a", "b"]), "labels": labels});
    if random.chance(80) {
        metadata["resourceVersion"] = json!(version.to_string());
        metadata["uid"] = json!(format!("uid-{name}"));
        // Few distinct times, so that equal ages fall back to the uid.
        metadata["creationTimestamp"] = json!(random.pick(&["2026-01-01T00:00:00Z", "2026-02-01T00:00:00Z"]));
    }
    metadata
}

/// Services that share cluster IPs, external IPs and NodePorts, so that frontends conflict.
fn random_service(random: &mut Random, version: &mut u64) -> Service {
    let name = format!("s{}", random.below(4));
    let cluster_ips: &[&[&str]] =
        &[&["10.96.0.1"], &["10.96.0.2"], &["10.96.0.1", "fd00::1"], &["fd00::2"], &["None"]];
    let ports: Vec<Value> = (0..1 + random.below(2))
        .map(|_| {
            let (name, port, protocol) =
                *random.pick(&[("http", 80, "TCP"), ("", 80, "TCP"), ("dns", 53, "UDP"), ("bad", 81, "XYZ")]);
            json!({"name": name, "port": port, "protocol": protocol,
                   "nodePort": *random.pick(&[0, 30001, 30002])})
        })
        .collect();
    let mut spec = json!({
        "type": random.pick(&["ClusterIP", "NodePort", "LoadBalancer"]),
        "clusterIPs": random.pick(cluster_ips),
        "ports": ports,
        "externalTrafficPolicy": random.pick(&["Cluster", "Local"]),
        "internalTrafficPolicy": random.pick(&["Cluster", "Local"]),
    });
    if random.chance(30) {
        // A cluster IP, elsewhere, or a node address.
        spec["externalIPs"] = json!([random.pick(&["10.96.0.2", "192.0.2.1", "2001:db8::5", "192.168.0.2"])]);
    }
    if random.chance(40) {
        // Port 80 is the external IPs' port: a health-check node port there takes it from
        // every service's node-address claims.
        spec["healthCheckNodePort"] = json!(random.pick(&[80, 30010]));
    }
    if random.chance(30) {
        spec["loadBalancerSourceRanges"] = json!([random.pick(&["192.168.0.0/16", "203.0.113.0/24"])]);
    }
    if random.chance(30) {
        spec["trafficDistribution"] =
            json!(random.pick(&["PreferClose", "PreferSameZone", "PreferSameNode"]));
    }
    if random.chance(20) {
        spec["sessionAffinity"] = json!("ClientIP");
    }
    let labels = json!({});
    serde_json::from_value(json!({
        "metadata": metadata(random, version, &name, labels),
        "spec": spec,
        "status": {"loadBalancer": {"ingress": [{"ip": random.pick(&["1.2.3.4", "192.0.2.1", "192.168.0.2"])}]}},
    }))
    .unwrap()
}

fn random_slice(random: &mut Random, version: &mut u64) -> EndpointSlice {
    let name = format!("e{}", random.below(6));
    let ipv4 = random.chance(70);
    let endpoints: Vec<Value> = (0..random.below(4))
        .map(|_| {
            let address = if ipv4 {
                format!("10.1.0.{}", 1 + random.below(5))
            } else {
                format!("fd00:1::{}", 1 + random.below(5))
            };
            let mut endpoint = json!({
                "addresses": [address],
                "nodeName": random.pick(&["node-a", "node-b"]),
                "conditions": {"ready": random.chance(70), "serving": random.chance(80),
                               "terminating": random.chance(30)},
            });
            if random.chance(20) {
                // Unset: serving, as kube-proxy reads it.
                endpoint["conditions"].as_object_mut().unwrap().remove("serving");
            }
            if random.chance(50) {
                endpoint["hints"] = json!({"forZones": [{"name": random.pick(&["zone-1", "zone-2"])}]});
            }
            if random.chance(40) {
                let hints = endpoint.as_object_mut().unwrap().entry("hints").or_insert_with(|| json!({}));
                hints["forNodes"] = json!([{"name": random.pick(&["node-a", "node-b"])}]);
            }
            endpoint
        })
        .collect();
    let ports: Vec<Value> = (0..1 + random.below(2))
        .map(|_| {
            let (name, port, protocol) =
                *random.pick(&[("http", 8080, "TCP"), ("", 8080, "TCP"), ("dns", 5353, "UDP")]);
            json!({"name": name, "port": port, "protocol": protocol})
        })
        .collect();
    // Now and then a slice the model rejects.
    let address_type = if random.chance(5) {
        "Bogus"
    } else if ipv4 {
        "IPv4"
    } else {
        "IPv6"
    };
    let labels = json!({SERVICE_NAME_LABEL: format!("s{}", random.below(4))});
    serde_json::from_value(json!({
        "metadata": metadata(random, version, &name, labels),
        "addressType": address_type,
        "endpoints": endpoints,
        "ports": ports,
    }))
    .unwrap()
}

fn random_node(random: &mut Random) -> NodeContext {
    let ip = |text: &str| text.parse::<IpAddr>().unwrap();
    NodeContext {
        name: random.pick(&["node-a", "node-b"]).to_string(),
        zone: random.chance(50).then(|| "zone-1".to_owned()),
        cluster_cidrs: if random.chance(70) { vec!["10.0.0.0/8".parse().unwrap()] } else { Vec::new() },
        pod_interfaces: random.chance(20).then(|| crate::model::PodInterfaces::NamePrefix("veth".into())),
        masquerade_all: random.chance(20),
        node_ips: [ip("192.168.0.2"), ip("2001:db8::1")].into(),
        primary_ips: vec![ip("192.168.0.2"), ip("2001:db8::1")],
        node_port_ips: if random.chance(50) { [ip("192.168.0.2")].into() } else { BTreeSet::new() },
        service_cidrs: vec!["10.96.0.0/16".parse().unwrap()],
        own_ports: if random.chance(20) { [53].into() } else { BTreeSet::new() },
        localhost_node_ports: random.chance(50),
    }
}

/// A random object of a random kind.
fn random_object(random: &mut Random, version: &mut u64) -> Object {
    if random.chance(45) {
        Object::from(random_service(random, version))
    } else {
        Object::from(random_slice(random, version))
    }
}

/// The keys the tracker holds of `kind`.
fn held(tracker: &ChangeTracker, kind: Kind) -> Vec<Key> {
    let mut keys: Vec<Key> = match kind {
        Kind::Service => tracker.service_keys().cloned().collect(),
        _ => tracker.slice_keys().cloned().collect(),
    };
    keys.sort();
    keys
}

/// The current objects of `kind` as a relist returns them.
fn listed(tracker: &ChangeTracker, kind: Kind) -> Vec<Object> {
    match kind {
        Kind::Service => tracker.services_sorted().into_iter().map(Object::Service).collect(),
        _ => tracker.slices_sorted().into_iter().map(Object::EndpointSlice).collect(),
    }
}

/// One step of a source: a few applies and deletes in random order (a reordered watch), an
/// object deleted and created again (another uid), a repeated event, or a relist with or
/// without changes.
fn random_events(random: &mut Random, version: &mut u64, tracker: &mut ChangeTracker) {
    let kind = *random.pick(&[Kind::Service, Kind::EndpointSlice]);
    match random.below(10) {
        0..=4 => {
            let mut batch: Vec<Option<Object>> =
                (0..1 + random.below(3)).map(|_| Some(random_object(random, version))).collect();
            // Deletions among them, then the batch in random order.
            for _ in 0..random.below(2) {
                let keys = held(tracker, kind);
                if !keys.is_empty() {
                    let key = random.pick(&keys).clone();
                    tracker.delete(kind, &key);
                }
            }
            while !batch.is_empty() {
                let index = random.below(batch.len());
                if let Some(object) = batch.swap_remove(index) {
                    tracker.apply(object);
                }
            }
        }
        5 => {
            // Deleted and created again under the same name, with a new uid.
            let keys = held(tracker, kind);
            if keys.is_empty() {
                return;
            }
            let key = random.pick(&keys).clone();
            let Some(mut object) = listed(tracker, kind).into_iter().find(|object| object.key() == key)
            else {
                return;
            };
            tracker.delete(kind, &key);
            *version += 1;
            let meta = match &mut object {
                Object::Service(service) => &mut service.meta,
                Object::EndpointSlice(slice) => &mut slice.meta,
                _ => unreachable!(),
            };
            if meta.resource_version().is_some() {
                meta.set_version(Some(&format!("uid-{version}")), Some(&version.to_string()));
            }
            tracker.apply(object);
        }
        6 => {
            // The same event again (a watch resumed from an older resourceVersion).
            if let Some(object) = listed(tracker, kind).into_iter().next() {
                assert!(!tracker.apply(object), "a repeated event changes nothing");
            }
        }
        7 => {
            // A relist of what is there: no change.
            assert!(!tracker.list(kind, listed(tracker, kind)), "an unchanged relist changes nothing");
        }
        _ => {
            // A relist after missed events: one object gone, another new or changed.
            let mut objects = listed(tracker, kind);
            if !objects.is_empty() && random.chance(70) {
                let index = random.below(objects.len());
                objects.remove(index);
            }
            let new = random_object(random, version);
            if new.kind() == kind {
                objects.retain(|object| object.key() != new.key());
                objects.push(new);
            }
            tracker.list(kind, objects);
        }
    }
}

fn sorted(rejected: Vec<Rejection>) -> Vec<String> {
    let mut rejected: Vec<String> = rejected.iter().map(ToString::to_string).collect();
    rejected.sort();
    rejected
}

#[test]
fn incremental_translation_equals_the_full_one_over_event_sequences() {
    for seed in 1..=80u64 {
        let mut random = Random(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let mut version = 0;
        let mut tracker = ChangeTracker::new(SystemTime::UNIX_EPOCH);
        let mut node = random_node(&mut random);
        let mut translator = Translator::new();
        let mut previous = DesiredState::default();
        let mut generation = None;
        for step in 0..60 {
            if random.chance(8) {
                // A Node change: a new node context.
                node = random_node(&mut random);
            } else {
                for _ in 0..1 + random.below(2) {
                    random_events(&mut random, &mut version, &mut tracker);
                }
            }
            let dirty = tracker.take_dirty();
            let changes = translator.translate(&tracker, dirty, &node);
            let full = desired_state_of(&tracker.services_sorted(), &tracker.slices_sorted(), &node);
            let context = format!("seed {seed}, step {step}");
            assert_eq!(translator.state(), &full.state, "{context}");
            assert_eq!(sorted(translator.rejected()), sorted(full.rejected), "{context}");

            // The changes lead from the previous state to this one.
            assert_eq!(changes.generation, generation.map_or(1, |g: u64| g + 1), "{context}");
            if changes.since.is_some() {
                assert_eq!(changes.since, generation, "{context}");
                for frontend in &changes.frontends {
                    match full.state.frontends.get(frontend) {
                        Some(entry) => previous.frontends.insert(*frontend, entry.clone()),
                        None => previous.frontends.remove(frontend),
                    };
                }
                previous.listed_endpoints.extend(&changes.listed_added);
                previous.listed_endpoints.retain(|backend| !changes.listed_removed.contains(backend));
                if changes.classifiers {
                    previous.cluster_ips = full.state.cluster_ips.clone();
                }
                if changes.health_checks {
                    previous.health_checks = full.state.health_checks.clone();
                }
                assert_eq!(previous, full.state, "{context}: {changes:?}");
            }
            previous = full.state;
            generation = Some(changes.generation);
        }
    }
}

#[test]
fn nothing_dirty_changes_nothing_and_one_slice_changes_its_service_only() {
    let mut random = Random(7);
    let mut version = 0;
    let node = random_node(&mut random);
    let mut tracker = ChangeTracker::new(SystemTime::UNIX_EPOCH);
    let services: Vec<Object> = (0..4)
        .map(|i| {
            let mut service = random_service(&mut random, &mut version);
            service.metadata.name = Some(format!("s{i}"));
            service.metadata.namespace = Some("a".into());
            service.spec.as_mut().unwrap().cluster_ips = Some(vec![format!("10.96.1.{i}")]);
            Object::from(service)
        })
        .collect();
    tracker.list(Kind::Service, services.clone());
    let mut translator = Translator::new();
    let dirty = tracker.take_dirty();
    assert_eq!(translator.translate(&tracker, dirty, &node).since, None);
    // A relist of the same objects marks nothing.
    assert!(!tracker.list(Kind::Service, services));
    let dirty = tracker.take_dirty();
    let unchanged = translator.translate(&tracker, dirty, &node);
    assert_eq!(unchanged.since, Some(1));
    assert!(unchanged.frontends.is_empty() && !unchanged.classifiers, "{unchanged:?}");

    let slice: EndpointSlice = serde_json::from_value(json!({
        "metadata": {"name": "e", "namespace": "a", "resourceVersion": "1",
                     "labels": {SERVICE_NAME_LABEL: "s2"}},
        "addressType": "IPv4",
        "endpoints": [{"addresses": ["10.1.0.9"]}],
        "ports": [{"name": "http", "port": 8080}, {"name": "", "port": 8080}, {"name": "dns", "port": 5353, "protocol": "UDP"}],
    }))
    .unwrap();
    tracker.apply(Object::from(slice));
    let dirty = tracker.take_dirty();
    assert_eq!(dirty.services, BTreeSet::from([("a".into(), "s2".into())]));
    let changes = translator.translate(&tracker, dirty, &node);
    assert!(!changes.frontends.is_empty(), "{changes:?}");
    assert!(changes.frontends.iter().all(|f| translator.state().frontends[f].service.name == "s2"));
    assert!(!changes.classifiers);
}
