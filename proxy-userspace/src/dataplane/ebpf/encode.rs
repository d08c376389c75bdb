//! The desired state in the eBPF maps' terms. Pure, so the encoding is unit-tested without a
//! kernel.
//!
//! Every family has its own maps, and each frontend goes to the maps of its address with the
//! backends of its family only: a dual-stack service has a frontend of each family, and each
//! balances over the endpoints of its own family (as kube-proxy's per-family proxiers do).
//! Source ranges are filtered by family the same way; a frontend none of whose ranges is of
//! its family admits every source, as in kube-proxy.
use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    net::IpAddr,
};

use proxy_common::{proto, service_flags, source_class, unmatched};

use super::{
    family::{Family, V4, V6},
    plan::WantedService,
};
use crate::model::{
    DesiredState, Frontend, FrontendEntry, Protocol, ServicePortName, SourceClass, Treatment, WhenEmpty,
};

/// A key of an LPM trie: prefix length in bits and the data it applies to.
pub type LpmKey<D> = (u32, D);

/// Everything the maps should hold.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Wanted {
    pub v4: FamilyWanted<V4>,
    pub v6: FamilyWanted<V6>,
    /// Frontends (or parts of them) this dataplane cannot express, with the reason.
    pub unsupported: Vec<String>,
}

/// What one family's maps should hold.
#[derive(Debug, PartialEq, Eq)]
pub struct FamilyWanted<F: Family> {
    pub services: BTreeMap<F::ServiceKey, WantedService<F>>,
    pub node_ips: BTreeMap<F::Addr, u8>,
    pub pod_cidrs: BTreeMap<LpmKey<F::Addr>, u8>,
    pub unmatched: BTreeMap<LpmKey<F::Addr>, u8>,
    pub source_ranges: BTreeMap<LpmKey<F::RangeData>, u8>,
}

impl<F: Family> Default for FamilyWanted<F> {
    fn default() -> Self {
        Self {
            services: BTreeMap::new(),
            node_ips: BTreeMap::new(),
            pod_cidrs: BTreeMap::new(),
            unmatched: BTreeMap::new(),
            source_ranges: BTreeMap::new(),
        }
    }
}

const CLASSES: [(SourceClass, u8); 3] = [
    (SourceClass::Outside, source_class::OUTSIDE),
    (SourceClass::Pod, source_class::POD),
    (SourceClass::Node, source_class::NODE),
];

pub fn encode(state: &DesiredState, service_ids: &mut ServiceIds) -> Wanted {
    let mut wanted = Wanted::default();
    for (frontend, entry) in &state.frontends {
        let Some(protocol) = ip_protocol(frontend.protocol) else {
            wanted
                .unsupported
                .push(format!("{frontend} ({}): only TCP and UDP are supported", entry.service));
            continue;
        };
        if entry.affinity.is_some() {
            wanted
                .unsupported
                .push(format!("{frontend} ({}): programmed without session affinity", entry.service));
        }
        let service_id = service_ids.id_for(&entry.service, (frontend.ip, frontend.port, protocol));
        match frontend.ip {
            IpAddr::V4(_) => wanted.v4.add_frontend(frontend, entry, protocol, service_id),
            IpAddr::V6(_) => wanted.v6.add_frontend(frontend, entry, protocol, service_id),
        }
    }
    wanted.v4.add_classifiers(state);
    wanted.v6.add_classifiers(state);
    wanted
}

impl<F: Family> FamilyWanted<F> {
    /// One services entry per source class for a frontend of this family.
    fn add_frontend(&mut self, frontend: &Frontend, entry: &FrontendEntry, protocol: u8, service_id: u32) {
        let Some(addr) = F::addr(frontend.ip) else { return };
        let mut flags_common = 0;
        let ranges: Vec<_> =
            entry.allowed_sources.iter().filter_map(|range| F::source_range(service_id, range)).collect();
        if !ranges.is_empty() {
            flags_common |= service_flags::SOURCE_RANGES;
            self.source_ranges.extend(ranges.into_iter().map(|key| (key, 1)));
        }
        for (class, class_code) in CLASSES {
            let treatment = entry.treatment(class);
            let backends = treatment
                .backends
                .iter()
                .filter_map(|backend| Some(F::backend(F::addr(backend.ip)?, backend.port)))
                .collect();
            self.services.insert(
                F::service_key(addr, frontend.port, protocol, class_code),
                WantedService { backends, service_id, flags: flags_common | flags(treatment) },
            );
        }
    }

    /// Node addresses, pod CIDRs and service ranges of this family.
    fn add_classifiers(&mut self, state: &DesiredState) {
        self.node_ips = state.sources.node_ips.iter().filter_map(|ip| Some((F::addr(*ip)?, 1))).collect();
        self.pod_cidrs =
            state.sources.pod_cidrs.iter().filter_map(|net| Some((F::prefix(net)?, 1))).collect();
        self.unmatched =
            state.service_cidrs.iter().filter_map(|net| Some((F::prefix(net)?, unmatched::DROP))).collect();
        for ip in &state.cluster_ips {
            if let Some(addr) = F::addr(*ip) {
                self.unmatched.insert((F::BITS, addr), unmatched::REJECT);
            }
        }
    }
}

fn flags(treatment: &Treatment) -> u32 {
    let mut flags = 0;
    if treatment.masquerade {
        flags |= service_flags::MASQUERADE;
    }
    if treatment.when_empty == WhenEmpty::Reject {
        flags |= service_flags::REJECT_WHEN_EMPTY;
    }
    flags
}

fn ip_protocol(protocol: Protocol) -> Option<u8> {
    match protocol {
        Protocol::Tcp => Some(proto::TCP),
        Protocol::Udp => Some(proto::UDP),
        Protocol::Sctp => None,
    }
}

/// Stable small integers for service ports. After a restart the ids found in the maps are
/// kept ([`ServiceIds::adopt`]), so adopted entries are not rewritten just to renumber them.
#[derive(Debug, Default)]
pub struct ServiceIds {
    ids: HashMap<ServicePortName, u32>,
    used: BTreeSet<u32>,
    /// Ids found in the maps, by frontend address, port and protocol; consumed on first use.
    adopted: HashMap<(IpAddr, u16, u8), u32>,
    next: u32,
}

impl ServiceIds {
    /// Remembers the id a services entry of either family carries.
    pub fn adopt<F: Family>(&mut self, key: &F::ServiceKey, id: u32) {
        self.adopted.insert(F::frontend(key), id);
    }

    fn id(&mut self, name: &ServicePortName) -> u32 {
        if let Some(id) = self.ids.get(name) {
            return *id;
        }
        let id = loop {
            self.next = self.next.wrapping_add(1);
            if self.next != 0
                && !self.used.contains(&self.next)
                && !self.adopted.values().any(|id| *id == self.next)
            {
                break self.next;
            }
        };
        self.ids.insert(name.clone(), id);
        self.used.insert(id);
        id
    }

    /// The id a frontend had in the maps, if its service has none yet this run.
    pub fn id_for(&mut self, name: &ServicePortName, frontend: (IpAddr, u16, u8)) -> u32 {
        if !self.ids.contains_key(name) {
            if let Some(id) = self.adopted.remove(&frontend).filter(|id| !self.used.contains(id)) {
                self.ids.insert(name.clone(), id);
                self.used.insert(id);
            }
        }
        self.id(name)
    }
}

#[cfg(test)]
mod tests {
    use std::net::IpAddr;

    use ipnet::IpNet;
    use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
    use proxy_common::{Backend4, Backend6, ServiceKey4, ServiceKey6};
    use serde_json::json;

    use super::*;
    use crate::model::kubernetes::{desired_state, NodeContext, SERVICE_NAME_LABEL};

    fn octets6(ip: &str) -> [u8; 16] {
        ip.parse::<std::net::Ipv6Addr>().unwrap().octets()
    }

    fn slice(name: &str, family: &str, address: &str) -> EndpointSlice {
        serde_json::from_value(json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": name, "namespace": "ns", "labels": {SERVICE_NAME_LABEL: "web"}},
            "addressType": family,
            "endpoints": [{"addresses": [address]}],
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
        }))
        .unwrap()
    }

    /// A dual-stack LoadBalancer service with one endpoint per family, on a dual-stack node.
    fn dual_stack(source_ranges: &[&str]) -> DesiredState {
        let service: Service = serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": "web", "namespace": "ns"},
            "spec": {
                "type": "LoadBalancer",
                "clusterIPs": ["10.96.0.10", "fd00:10:96::a"],
                "ports": [{"name": "http", "port": 80, "protocol": "TCP"}],
                "loadBalancerSourceRanges": source_ranges,
            },
            "status": {"loadBalancer": {"ingress": [{"ip": "1.2.3.4"}, {"ip": "2001:db8:ff::10"}]}},
        }))
        .unwrap();
        let slices = [slice("web-4", "IPv4", "10.1.0.1"), slice("web-6", "IPv6", "fd00:10:244::1")];
        let ips = |list: &[&str]| list.iter().map(|ip| ip.parse::<IpAddr>().unwrap()).collect::<Vec<_>>();
        let nets = |list: &[&str]| list.iter().map(|net| net.parse::<IpNet>().unwrap()).collect::<Vec<_>>();
        let node = NodeContext {
            name: "node-a".into(),
            cluster_cidrs: nets(&["10.0.0.0/8", "fd00:10:244::/48"]),
            node_ips: ips(&["192.168.0.2", "2001:db8::1"]).into_iter().collect(),
            primary_ips: ips(&["192.168.0.2", "2001:db8::1"]),
            node_port_ips: Default::default(),
            service_cidrs: nets(&["10.96.0.0/16", "fd00:10:96::/112"]),
            ..NodeContext::default()
        };
        let translation = desired_state(&[service], &slices, &node);
        assert!(translation.rejected.is_empty(), "{:?}", translation.rejected);
        translation.state
    }

    #[test]
    fn a_dual_stack_service_programs_each_family_with_its_own_endpoints() {
        let wanted = encode(&dual_stack(&[]), &mut ServiceIds::default());
        assert!(wanted.unsupported.is_empty(), "{:?}", wanted.unsupported);
        let v4_backend = Backend4 { addr: [10, 1, 0, 1], port: 8080, pad: 0 };
        let v6_backend = Backend6 { addr: octets6("fd00:10:244::1"), port: 8080, pad: 0 };
        // Cluster IP and load-balancer IP, three source classes each.
        assert_eq!(wanted.v4.services.len(), 6);
        assert_eq!(wanted.v6.services.len(), 6);
        assert!(wanted.v4.services.values().all(|service| service.backends == [v4_backend]));
        assert!(wanted.v6.services.values().all(|service| service.backends == [v6_backend]));

        // The two families' entries of one frontend kind and source class are the same but for
        // the address: one service port, one id.
        for class in [source_class::OUTSIDE, source_class::POD, source_class::NODE] {
            let v4 = &wanted.v4.services
                [&ServiceKey4 { addr: [10, 96, 0, 10], port: 80, proto: proto::TCP, source_class: class }];
            let v6 = &wanted.v6.services[&ServiceKey6 {
                addr: octets6("fd00:10:96::a"),
                port: 80,
                proto: proto::TCP,
                source_class: class,
            }];
            assert_eq!((v4.service_id, v4.flags), (v6.service_id, v6.flags), "class {class}");
        }
        let lb6 =
            ServiceKey6 { addr: octets6("2001:db8:ff::10"), port: 80, proto: proto::TCP, source_class: 0 };
        assert_eq!(wanted.v6.services[&lb6].flags & service_flags::SOURCE_RANGES, 0);
    }

    #[test]
    fn classifiers_and_unmatched_destinations_go_to_their_family() {
        let wanted = encode(&dual_stack(&[]), &mut ServiceIds::default());
        assert_eq!(wanted.v4.node_ips, BTreeMap::from([([192, 168, 0, 2], 1)]));
        assert_eq!(wanted.v6.node_ips, BTreeMap::from([(octets6("2001:db8::1"), 1)]));
        assert_eq!(wanted.v4.pod_cidrs, BTreeMap::from([((8, [10, 0, 0, 0]), 1)]));
        assert_eq!(wanted.v6.pod_cidrs, BTreeMap::from([((48, octets6("fd00:10:244::")), 1)]));
        assert_eq!(
            wanted.v4.unmatched,
            BTreeMap::from([
                ((16, [10, 96, 0, 0]), unmatched::DROP),
                ((32, [10, 96, 0, 10]), unmatched::REJECT)
            ])
        );
        assert_eq!(
            wanted.v6.unmatched,
            BTreeMap::from([
                ((112, octets6("fd00:10:96::")), unmatched::DROP),
                ((128, octets6("fd00:10:96::a")), unmatched::REJECT),
            ])
        );
    }

    /// Each family's load-balancer frontend is filtered by the ranges of its family only; a
    /// family without ranges is not filtered at all, as kube-proxy's per-family proxiers do.
    #[test]
    fn source_ranges_are_kept_per_family() {
        let lb4 =
            |class| ServiceKey4 { addr: [1, 2, 3, 4], port: 80, proto: proto::TCP, source_class: class };
        let lb6 = |class| ServiceKey6 {
            addr: octets6("2001:db8:ff::10"),
            port: 80,
            proto: proto::TCP,
            source_class: class,
        };

        let wanted =
            encode(&dual_stack(&["203.0.113.0/25", " 2001:db8:1::/64 "]), &mut ServiceIds::default());
        let id = wanted.v6.services[&lb6(0)].service_id;
        assert_eq!(wanted.v4.services[&lb4(0)].service_id, id);
        for class in [source_class::OUTSIDE, source_class::POD, source_class::NODE] {
            assert_ne!(wanted.v4.services[&lb4(class)].flags & service_flags::SOURCE_RANGES, 0);
            assert_ne!(wanted.v6.services[&lb6(class)].flags & service_flags::SOURCE_RANGES, 0);
        }
        let mut range4 = [0u8; 8];
        range4[..4].copy_from_slice(&id.to_be_bytes());
        range4[4..].copy_from_slice(&[203, 0, 113, 0]);
        assert_eq!(wanted.v4.source_ranges, BTreeMap::from([((32 + 25, range4), 1)]));
        let mut range6 = [0u8; 20];
        range6[..4].copy_from_slice(&id.to_be_bytes());
        range6[4..].copy_from_slice(&octets6("2001:db8:1::"));
        assert_eq!(wanted.v6.source_ranges, BTreeMap::from([((32 + 64, range6), 1)]));

        let wanted = encode(&dual_stack(&["203.0.113.0/25"]), &mut ServiceIds::default());
        assert_ne!(wanted.v4.services[&lb4(0)].flags & service_flags::SOURCE_RANGES, 0);
        assert_eq!(wanted.v6.services[&lb6(0)].flags & service_flags::SOURCE_RANGES, 0);
        assert!(wanted.v6.source_ranges.is_empty());
    }

    #[test]
    fn ids_adopted_from_either_family_are_kept() {
        let name = ServicePortName {
            namespace: "ns".into(),
            name: "web".into(),
            port: "http".into(),
            protocol: Protocol::Tcp,
        };
        let vip6: IpAddr = "fd00:10:96::a".parse().unwrap();
        let mut ids = ServiceIds::default();
        let key =
            ServiceKey6 { addr: octets6("fd00:10:96::a"), port: 80, proto: proto::TCP, source_class: 0 };
        ids.adopt::<V6>(&key, 42);
        assert_eq!(ids.id_for(&name, (vip6, 80, proto::TCP)), 42);
        // The service's IPv4 frontend gets the same id.
        assert_eq!(ids.id_for(&name, ("10.96.0.10".parse().unwrap(), 80, proto::TCP)), 42);
    }
}
