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
    sync::Arc,
};

use proxy_common::{service_flags, source_class, unmatched, Backend as MapBackend, ServiceKey};

use super::{
    capacity::Refused,
    counters::CounterIds,
    family::{Family, V4, V6},
    maglev,
    options::{has_carried_entry, takes_direct_return, Balancing, Modes},
    plan::WantedService,
};
use crate::model::{
    Backend, DesiredState, Frontend, FrontendEntry, FrontendKind, ServicePortName, SourceClass, StateChanges,
    Treatment, WhenEmpty,
};

/// A key of an LPM trie: prefix length in bits and the data it applies to.
pub type LpmKey<D> = (u32, D);

/// Everything the maps should hold.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Wanted {
    pub v4: FamilyWanted<V4>,
    pub v6: FamilyWanted<V6>,
}

/// What one family's maps should hold.
#[derive(Debug, PartialEq, Eq)]
pub struct FamilyWanted<F: Family> {
    pub services: BTreeMap<ServiceKey<F>, WantedService<F>>,
    pub node_ips: BTreeMap<F, u8>,
    pub pod_cidrs: BTreeMap<LpmKey<F>, u8>,
    pub unmatched: BTreeMap<LpmKey<F>, u8>,
    pub source_ranges: BTreeMap<LpmKey<F::RangeData>, u8>,
    /// The node addresses whose NodePort frontends put each NodePort's carried-address entry
    /// (keyed by the unspecified address, see [`FamilyWanted::add_carried`]): the entry goes
    /// when the last of them does.
    nodeport_carriers: BTreeMap<ServiceKey<F>, BTreeSet<F>>,
}

impl<F: Family> Default for FamilyWanted<F> {
    fn default() -> Self {
        Self {
            services: BTreeMap::new(),
            node_ips: BTreeMap::new(),
            pod_cidrs: BTreeMap::new(),
            unmatched: BTreeMap::new(),
            source_ranges: BTreeMap::new(),
            nodeport_carriers: BTreeMap::new(),
        }
    }
}

const CLASSES: [(SourceClass, u8); 3] = [
    (SourceClass::Outside, source_class::OUTSIDE),
    (SourceClass::Pod, source_class::POD),
    (SourceClass::Node, source_class::NODE),
];

/// [`encode_admitted`] with every Service admitted, as a `snat` node.
#[cfg(test)]
pub fn encode(
    state: &DesiredState,
    balancing: Balancing,
    service_ids: &mut ServiceIds,
    counters: &mut CounterIds,
) -> Wanted {
    encode_admitted(state, &Refused::default(), Modes::snat(balancing), service_ids, counters)
}

/// The entries of every Service but the `refused` ones (see [`super::capacity`]).
/// `counters` hands each (service port, backend) pair its counter index.
pub fn encode_admitted(
    state: &DesiredState,
    refused: &Refused,
    modes: Modes,
    service_ids: &mut ServiceIds,
    counters: &mut CounterIds,
) -> Wanted {
    let mut wanted = Wanted::default();
    for (frontend, entry) in state.frontends.iter().filter(|(_, entry)| !refused.contains(&entry.service)) {
        wanted.add_frontend(frontend, entry, modes, service_ids, counters);
    }
    wanted.v4.add_classifiers(state, refused);
    wanted.v6.add_classifiers(state, refused);
    wanted
}

/// The services entries of each family that [`encode_changes`] touched, to plan.
#[derive(Debug)]
pub struct Touched<F: Family> {
    pub keys: BTreeSet<ServiceKey<F>>,
    /// The source ranges were re-encoded.
    pub source_ranges: bool,
}

impl<F: Family> Default for Touched<F> {
    fn default() -> Self {
        Self { keys: BTreeSet::new(), source_ranges: false }
    }
}

/// Brings `wanted`, the encoding of an earlier state, to the encoding of `state`, which
/// differs from it by `changes`: in the entries of the changed frontends only (and, with
/// `changes.classifiers`, in its cluster IPs, service ranges and source classes); the same
/// Services are refused.
pub fn encode_changes(
    wanted: &mut Wanted,
    state: &DesiredState,
    refused: &Refused,
    changes: &StateChanges,
    modes: Modes,
    service_ids: &mut ServiceIds,
    counters: &mut CounterIds,
) -> (Touched<V4>, Touched<V6>) {
    let mut touched = (Touched::<V4>::default(), Touched::<V6>::default());
    let mut ranges = false;
    for frontend in &changes.frontends {
        ranges |= match frontend.ip {
            IpAddr::V4(_) => wanted.v4.remove_frontend(frontend, &mut touched.0.keys),
            IpAddr::V6(_) => wanted.v6.remove_frontend(frontend, &mut touched.1.keys),
        };
        if let Some(entry) = state.frontends.get(frontend).filter(|entry| !refused.contains(&entry.service)) {
            ranges |= !entry.allowed_sources.is_empty();
            wanted.add_frontend(frontend, entry, modes, service_ids, counters);
        }
    }
    // Frontends of one service share its source ranges: they are encoded anew from all.
    if ranges {
        wanted.v4.source_ranges.clear();
        wanted.v6.source_ranges.clear();
        for (frontend, entry) in state
            .frontends
            .iter()
            .filter(|(_, entry)| !entry.allowed_sources.is_empty() && !refused.contains(&entry.service))
        {
            let protocol = frontend.protocol.number();
            let service_id = service_ids.id_for(&entry.service, (frontend.ip, frontend.port, protocol));
            wanted.v4.add_source_ranges(service_id, entry);
            wanted.v6.add_source_ranges(service_id, entry);
        }
        touched.0.source_ranges = true;
        touched.1.source_ranges = true;
    }
    if changes.classifiers {
        wanted.v4.add_classifiers(state, refused);
        wanted.v6.add_classifiers(state, refused);
    }
    touched
}

impl Wanted {
    fn add_frontend(
        &mut self,
        frontend: &Frontend,
        entry: &FrontendEntry,
        modes: Modes,
        service_ids: &mut ServiceIds,
        counters: &mut CounterIds,
    ) {
        let protocol = frontend.protocol.number();
        let (service_id, name) =
            service_ids.named_id_for(&entry.service, (frontend.ip, frontend.port, protocol));
        let service = ServiceRef { id: service_id, name: &name };
        match frontend.ip {
            IpAddr::V4(_) => self.v4.add_frontend(frontend, entry, protocol, service, modes, counters),
            IpAddr::V6(_) => self.v6.add_frontend(frontend, entry, protocol, service, modes, counters),
        }
    }
}

impl<F: Family> FamilyWanted<F> {
    /// Takes a frontend's entries out and adds their keys to `keys`; says whether they were
    /// filtered by source ranges.
    fn remove_frontend(&mut self, frontend: &Frontend, keys: &mut BTreeSet<ServiceKey<F>>) -> bool {
        let Some(addr) = F::addr(frontend.ip) else {
            return false;
        };
        let protocol = frontend.protocol.number();
        let mut ranged = false;
        let class_codes = CLASSES.iter().map(|(_, code)| *code).chain([source_class::CARRIED]);
        for class_code in class_codes {
            let key = F::service_key(addr, frontend.port, protocol, class_code);
            if let Some(removed) = self.services.remove(&key) {
                ranged |= removed.flags & service_flags::SOURCE_RANGES != 0;
            }
            keys.insert(key);
        }
        let nodeport = F::service_key(F::UNSPECIFIED, frontend.port, protocol, source_class::CARRIED);
        if let Some(addresses) = self.nodeport_carriers.get_mut(&nodeport) {
            if addresses.remove(&addr) {
                keys.insert(nodeport);
                // Another node address's NodePort frontend keeps the entry; a change of the
                // Service re-adds each, with the new value.
                if addresses.is_empty() {
                    self.nodeport_carriers.remove(&nodeport);
                    self.services.remove(&nodeport);
                }
            }
        }
        ranged
    }

    /// The source-range trie keys of a frontend's entry that are of this family.
    fn add_source_ranges(&mut self, service_id: u32, entry: &FrontendEntry) -> bool {
        let ranges: Vec<_> =
            entry.allowed_sources.iter().filter_map(|range| F::source_range(service_id, range)).collect();
        let any = !ranges.is_empty();
        self.source_ranges.extend(ranges.into_iter().map(|key| (key, 1)));
        any
    }

    /// One services entry per source class for a frontend of this family.
    fn add_frontend(
        &mut self,
        frontend: &Frontend,
        entry: &FrontendEntry,
        protocol: u8,
        service: ServiceRef<'_>,
        modes: Modes,
        counters: &mut CounterIds,
    ) {
        let Modes { balancing, lb_mode, carriers_taken } = modes;
        let Some(addr) = F::addr(frontend.ip) else { return };
        // Direct server return replaces the masquerade of connections from outside to a
        // NodePort, load-balancer or external IP (the datapath keeps it for local backends).
        let direct_return = lb_mode.direct_return(frontend.protocol) && takes_direct_return(entry.kind);
        let service_id = service.id;
        let mut flags_common = 0;
        // The API bounds the timeout to 1-86400 s; saturate rather than wrap whatever comes.
        let affinity_timeout =
            entry.affinity.map_or(0, |timeout| u32::try_from(timeout.as_secs()).unwrap_or(u32::MAX).max(1));
        if self.add_source_ranges(service_id, entry) {
            flags_common |= service_flags::SOURCE_RANGES;
        }
        // The source classes' treatments nearly always share their backends: encoded once, and
        // the entries share the encoding.
        let mut encoded: Vec<Encoded<'_, F>> = Vec::with_capacity(1);
        let balancing_flag = match balancing {
            Balancing::Maglev { .. } => service_flags::MAGLEV,
            Balancing::Random => 0,
        };
        for (class, class_code) in CLASSES {
            // A loopback frontend (a localhost NodePort) is the node's own processes' alone:
            // a packet from elsewhere to 127.0.0.1 must never be balanced (CVE-2020-8558).
            if frontend.ip.is_loopback() && class != SourceClass::Node {
                continue;
            }
            let treatment = entry.treatment(class);
            let backends = match encoded.iter().find(|(source, _)| **source == treatment.backends) {
                Some((_, backends)) => backends.clone(),
                None => {
                    let backends = encode_backends::<F>(&treatment.backends, service, balancing, counters);
                    encoded.push((&treatment.backends, backends.clone()));
                    backends
                }
            };
            let balancing_flag = if backends.is_empty() { 0 } else { balancing_flag };
            let dsr_flag = if direct_return && class == SourceClass::Outside && treatment.masquerade {
                service_flags::DSR
            } else {
                0
            };
            self.services.insert(
                F::service_key(addr, frontend.port, protocol, class_code),
                WantedService {
                    backends,
                    service_id,
                    flags: flags_common | balancing_flag | dsr_flag | flags(treatment),
                    affinity_timeout,
                },
            );
        }
        if has_carried_entry(frontend, entry, carriers_taken) {
            let outside = &entry.from_outside.backends;
            if let Some((_, backends)) = encoded.iter().find(|(source, _)| *source == outside) {
                self.add_carried(frontend, entry, addr, protocol, (service_id, backends.clone()));
            }
        }
    }

    /// The entry a backend's node checks a service address carried by direct server return
    /// against (proxy-ebpf `dsr.rs`), where [`has_carried_entry`]: the backends an ingress node
    /// chooses from. A NodePort's carried address is the ingress node's, which no entry of
    /// this node holds: its entry is keyed by the unspecified address, so the check there holds
    /// the port and the backend, not the address. None without backends: no request can name
    /// one.
    fn add_carried(
        &mut self,
        frontend: &Frontend,
        entry: &FrontendEntry,
        addr: F,
        protocol: u8,
        (service_id, backends): (u32, Arc<[MapBackend<F>]>),
    ) {
        if backends.is_empty() {
            return;
        }
        let key = if entry.kind == FrontendKind::NodePort {
            let key = F::service_key(F::UNSPECIFIED, frontend.port, protocol, source_class::CARRIED);
            self.nodeport_carriers.entry(key).or_default().insert(addr);
            key
        } else {
            F::service_key(addr, frontend.port, protocol, source_class::CARRIED)
        };
        let carried =
            WantedService { backends, service_id, flags: service_flags::CARRIED, affinity_timeout: 0 };
        self.services.insert(key, carried);
    }

    /// Node addresses, pod CIDRs and service ranges of this family; cluster IPs but those of
    /// refused Services.
    fn add_classifiers(&mut self, state: &DesiredState, refused: &Refused) {
        self.node_ips = state.sources.node_ips.iter().filter_map(|ip| Some((F::addr(*ip)?, 1))).collect();
        self.pod_cidrs =
            state.sources.pod_cidrs.iter().filter_map(|net| Some((F::prefix(net)?, 1))).collect();
        self.unmatched =
            state.service_cidrs.iter().filter_map(|net| Some((F::prefix(net)?, unmatched::DROP))).collect();
        for ip in state.cluster_ips.iter().filter(|ip| !refused.cluster_ips.contains(ip)) {
            if let Some(addr) = F::addr(*ip) {
                self.unmatched.insert((F::BITS, addr), unmatched::REJECT);
            }
        }
    }
}

/// A treatment's backends and their encoding.
type Encoded<'a, F> = (&'a Arc<[Backend]>, Arc<[MapBackend<F>]>);

/// A service port as the encoding names it: its id in the maps and its name for the counters.
#[derive(Clone, Copy)]
struct ServiceRef<'a> {
    id: u32,
    name: &'a Arc<ServicePortName>,
}

/// The backends of this family with their counter indices, as a Maglev table with
/// `--lb-algorithm=maglev`.
fn encode_backends<F: Family>(
    backends: &[Backend],
    service: ServiceRef<'_>,
    balancing: Balancing,
    counters: &mut CounterIds,
) -> Arc<[MapBackend<F>]> {
    let backends: Vec<MapBackend<F>> = backends
        .iter()
        .filter_map(|backend| {
            let addr = F::addr(backend.ip)?;
            let counter = counters.index(service.name, service.id, backend.ip, backend.port);
            Some(F::backend(addr, backend.port, counter))
        })
        .collect();
    match balancing {
        Balancing::Maglev { table_size } if !backends.is_empty() => {
            maglev_table::<F>(&backends, table_size).into()
        }
        _ => backends.into(),
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

/// The backends as a Maglev table: slot `i` holds the backend the table gives it. A backend's
/// identity for the table is its address and port, never its counter index, which is this
/// node's own.
fn maglev_table<F: Family>(backends: &[MapBackend<F>], size: u32) -> Vec<MapBackend<F>> {
    let identities: Vec<Vec<u8>> = backends
        .iter()
        .map(|backend| {
            let (ip, port, _) = F::backend_parts(backend);
            let mut identity = match ip {
                IpAddr::V4(ip) => ip.octets().to_vec(),
                IpAddr::V6(ip) => ip.octets().to_vec(),
            };
            identity.extend_from_slice(&port.to_be_bytes());
            identity
        })
        .collect();
    maglev::table(&identities, size).into_iter().map(|owner| backends[owner]).collect()
}

/// Stable small integers for service ports. After a restart the ids found in the maps are
/// kept ([`ServiceIds::adopt`]), so adopted entries are not rewritten just to renumber them.
#[derive(Debug, Default)]
pub struct ServiceIds {
    /// Also the one copy of each name that the counters' labels share.
    ids: HashMap<Arc<ServicePortName>, u32>,
    used: BTreeSet<u32>,
    /// Ids found in the maps, by frontend address, port and protocol; consumed on first use.
    adopted: HashMap<(IpAddr, u16, u8), u32>,
    next: u32,
}

impl ServiceIds {
    /// Remembers the id a services entry of either family carries.
    pub fn adopt<F: Family>(&mut self, key: &ServiceKey<F>, id: u32) {
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
        self.ids.insert(Arc::new(name.clone()), id);
        self.used.insert(id);
        id
    }

    /// The id a frontend had in the maps, if its service has none yet this run.
    pub fn id_for(&mut self, name: &ServicePortName, frontend: (IpAddr, u16, u8)) -> u32 {
        if !self.ids.contains_key(name) {
            if let Some(id) = self.adopted.remove(&frontend).filter(|id| !self.used.contains(id)) {
                self.ids.insert(Arc::new(name.clone()), id);
                self.used.insert(id);
            }
        }
        self.id(name)
    }

    /// The service port an id was handed to this run.
    pub fn name_of(&self, id: u32) -> Option<&ServicePortName> {
        self.ids.iter().find(|(_, known)| **known == id).map(|(name, _)| &**name)
    }

    /// [`Self::id_for`], with the shared copy of the name.
    fn named_id_for(
        &mut self,
        name: &ServicePortName,
        frontend: (IpAddr, u16, u8),
    ) -> (u32, Arc<ServicePortName>) {
        let id = self.id_for(name, frontend);
        let shared =
            self.ids.get_key_value(name).map_or_else(|| Arc::new(name.clone()), |(name, _)| name.clone());
        (id, shared)
    }
}

#[cfg(test)]
mod tests {
    use std::net::IpAddr;

    use ipnet::IpNet;
    use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
    use proxy_common::{dsr_accept, proto, Backend4, Backend6, ServiceKey4, ServiceKey6};
    use serde_json::json;

    use super::{super::options::LbMode, *};
    use crate::model::Protocol;

    /// The maps key services by the IP protocol number the kernel programs compare with the
    /// packet's: the model's numbers must be proxy-common's.
    #[test]
    fn the_models_protocol_numbers_are_the_datapaths() {
        let datapath =
            [(Protocol::Tcp, proto::TCP), (Protocol::Udp, proto::UDP), (Protocol::Sctp, proto::SCTP)];
        for (protocol, number) in datapath {
            assert_eq!(protocol.number(), number, "{protocol}");
            assert_eq!(Protocol::from_number(number), Some(protocol));
            assert_eq!(Protocol::from_lower_case(protocol.lower_case()), Some(protocol));
        }
        assert_eq!(Protocol::from_number(1), None);
    }
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

    /// `--lb-mode=dsr` and `hybrid` mark the masqueraded OUTSIDE entries of a load balancer's
    /// addresses, IPv4 and IPv6, for TCP; cluster IPs and the other source classes stay as
    /// with snat.
    #[test]
    fn direct_server_return_marks_only_external_frontends_from_outside() {
        let state = dual_stack(&[]);
        let dsr_keys = |lb_mode| {
            let modes = Modes { balancing: Balancing::Random, lb_mode, carriers_taken: dsr_accept::NONE };
            let wanted = encode_admitted(
                &state,
                &Refused::default(),
                modes,
                &mut ServiceIds::default(),
                &mut CounterIds::new(16),
            );
            let v6: Vec<_> = wanted
                .v6
                .services
                .iter()
                .filter(|(_, service)| service.flags & service_flags::DSR != 0)
                .map(|(key, _)| (key.addr, key.port, key.proto, key.source_class))
                .collect();
            let load_balancer6 = (octets6("2001:db8:ff::10"), 80, proto::TCP, source_class::OUTSIDE);
            assert_eq!(v6, if lb_mode == LbMode::Snat { vec![] } else { vec![load_balancer6] });
            wanted
                .v4
                .services
                .iter()
                .filter(|(_, service)| service.flags & service_flags::DSR != 0)
                .map(|(key, _)| (key.addr, key.port, key.proto, key.source_class))
                .collect::<Vec<_>>()
        };
        assert_eq!(dsr_keys(LbMode::Snat), []);
        let load_balancer = ([1, 2, 3, 4], 80, proto::TCP, source_class::OUTSIDE);
        assert_eq!(dsr_keys(LbMode::Dsr), [load_balancer]);
        assert_eq!(dsr_keys(LbMode::Hybrid), [load_balancer]);
        use crate::model::Protocol;
        assert!(LbMode::Dsr.direct_return(Protocol::Udp) && !LbMode::Hybrid.direct_return(Protocol::Udp));
        assert!(!LbMode::Dsr.direct_return(Protocol::Sctp) && !LbMode::Snat.direct_return(Protocol::Tcp));
    }

    #[test]
    fn a_dual_stack_service_programs_each_family_with_its_own_endpoints() {
        let wanted =
            encode(&dual_stack(&[]), Balancing::Random, &mut ServiceIds::default(), &mut CounterIds::new(16));
        // One service port, one endpoint per family: a counter each.
        let v4_backend = Backend4 { addr: [10, 1, 0, 1], port: 8080, pad: 0, counter: 1 };
        let v6_backend = Backend6 { addr: octets6("fd00:10:244::1"), port: 8080, pad: 0, counter: 2 };
        // Cluster IP and load-balancer IP, three source classes each.
        assert_eq!(wanted.v4.services.len(), 6);
        assert_eq!(wanted.v6.services.len(), 6);
        assert!(wanted.v4.services.values().all(|service| *service.backends == [v4_backend]));
        assert!(wanted.v6.services.values().all(|service| *service.backends == [v6_backend]));

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

    /// A refused Service leaves nothing in the maps: no services entries, no source ranges,
    /// no unmatched entry of its cluster IPs; the capacity count matches what is encoded.
    #[test]
    fn a_refused_service_is_not_encoded_and_its_needs_are_what_the_encoding_writes() {
        use super::super::capacity::{self, MapKind};

        let state = dual_stack(&["10.0.0.0/8", "192.168.0.0/16", "2001:db8::/32"]);
        let needs = capacity::needs(&state, Modes::snat(Balancing::Random));
        let admitted =
            encode(&state, Balancing::Random, &mut ServiceIds::default(), &mut CounterIds::new(16));
        let need = needs.services["ns/web"];
        let counted = |family: usize, kind: MapKind| need[family][kind as usize] as usize;
        assert_eq!(counted(0, MapKind::Services), admitted.v4.services.len());
        assert_eq!(counted(1, MapKind::Services), admitted.v6.services.len());
        assert_eq!(counted(0, MapKind::SourceRanges), admitted.v4.source_ranges.len());
        assert_eq!(counted(1, MapKind::SourceRanges), admitted.v6.source_ranges.len());
        assert_eq!(counted(0, MapKind::Backends), 1);
        // The service ranges, then the cluster IP.
        assert_eq!(needs.fixed[0][MapKind::Unmatched as usize] + 1, admitted.v4.unmatched.len() as u64);

        let tight = capacity::Capacity::new([[100, 100, 100, 1, 100], [100, 100, 100, 100, 100]]);
        let refused = capacity::admit(&needs, &tight, BTreeSet::new);
        assert!(refused.services["ns/web"].contains("entries of vipr_srcr4_v1"), "{refused:?}");
        let wanted = encode_admitted(
            &state,
            &refused,
            Modes::snat(Balancing::Random),
            &mut ServiceIds::default(),
            &mut CounterIds::new(16),
        );
        assert!(wanted.v4.services.is_empty() && wanted.v6.services.is_empty());
        assert!(wanted.v4.source_ranges.is_empty() && wanted.v6.source_ranges.is_empty());
        assert_eq!(wanted.v4.unmatched.len(), 1, "only the service range: {:?}", wanted.v4.unmatched);
        assert_eq!(wanted.v6.unmatched.len(), 1, "only the service range: {:?}", wanted.v6.unmatched);
    }

    /// A Service sent by DSR from outside (a LoadBalancer with a NodePort and an external IP,
    /// eTP Cluster) and one that is not (eTP Local), on a node whose NodePorts listen on
    /// `node_port_ips`.
    fn sent_by_dsr(node_port_ips: &[&str]) -> DesiredState {
        let service = |name: &str, policy: &str, port: u16, addresses: [&str; 2]| -> Service {
            serde_json::from_value(json!({
                "metadata": {"name": name, "namespace": "ns"},
                "spec": {"type": "LoadBalancer", "clusterIPs": [addresses[0]],
                         "externalTrafficPolicy": policy, "externalIPs": [addresses[1]],
                         "ports": [{"name": "http", "port": port, "nodePort": port + 30000}]},
                "status": {"loadBalancer": {"ingress": [{"ip": "1.2.3.4"}]}},
            }))
            .unwrap()
        };
        let services = [
            service("web", "Cluster", 80, ["10.96.0.10", "5.6.7.8"]),
            service("local", "Local", 81, ["10.96.0.11", "5.6.7.9"]),
        ];
        let mut slices = [slice("web-4", "IPv4", "10.1.0.1"), slice("local-4", "IPv4", "10.1.0.2")];
        if let Some(labels) = slices[1].metadata.labels.as_mut() {
            labels.insert(SERVICE_NAME_LABEL.into(), "local".into());
        }
        let node = NodeContext {
            name: "node-a".into(),
            node_port_ips: node_port_ips.iter().map(|ip| ip.parse().unwrap()).collect(),
            ..NodeContext::default()
        };
        desired_state(&services, &slices, &node).state
    }

    /// The CARRIED entries of `wanted`'s IPv4 services: frontend, and whether each holds the
    /// OUTSIDE entry's backends and service id of `outside` (the frontend of the same service
    /// and port an ingress node balances).
    fn carried_entries(wanted: &Wanted) -> Vec<([u8; 4], u16)> {
        let outside = &wanted.v4.services[&ServiceKey4 {
            addr: [1, 2, 3, 4],
            port: 80,
            proto: proto::TCP,
            source_class: source_class::OUTSIDE,
        }];
        wanted
            .v4
            .services
            .iter()
            .filter(|(key, _)| key.source_class == source_class::CARRIED)
            .map(|(key, service)| {
                assert_eq!(service.flags, service_flags::CARRIED, "{key:?}");
                assert_eq!((&service.backends, service.service_id), (&outside.backends, outside.service_id));
                (key.addr, key.port)
            })
            .collect()
    }

    /// A node that takes TCP's carriers has an entry for each TCP frontend an ingress node
    /// sends by DSR: the load balancer's and the external IP by address, the NodePort once by
    /// port (keyed 0.0.0.0) whatever its node addresses; nothing for a cluster IP or an eTP
    /// Local Service, nothing where it takes no carriers or only UDP's, whatever its own
    /// `--lb-mode`.
    #[test]
    fn a_node_that_takes_carriers_has_an_entry_for_each_frontend_sent_by_dsr() {
        let state = sent_by_dsr(&["192.168.0.2", "192.168.0.3"]);
        let encoded = |lb_mode: LbMode, carriers_taken| {
            let modes = Modes { balancing: Balancing::Random, lb_mode, carriers_taken };
            encode_admitted(
                &state,
                &Refused::default(),
                modes,
                &mut ServiceIds::default(),
                &mut CounterIds::new(16),
            )
        };
        let expected = vec![([0, 0, 0, 0], 30080), ([1, 2, 3, 4], 80), ([5, 6, 7, 8], 80)];
        assert_eq!(carried_entries(&encoded(LbMode::Snat, dsr_accept::TCP)), expected);
        assert_eq!(carried_entries(&encoded(LbMode::Dsr, dsr_accept::TCP | dsr_accept::UDP)), expected);
        assert_eq!(carried_entries(&encoded(LbMode::Dsr, dsr_accept::NONE)), []);
        assert_eq!(carried_entries(&encoded(LbMode::Snat, dsr_accept::UDP)), []);

        use super::super::capacity::{self, MapKind};
        let modes =
            Modes { balancing: Balancing::Random, lb_mode: LbMode::Snat, carriers_taken: dsr_accept::TCP };
        let needs = capacity::needs(&state, modes);
        let counted: u64 = needs.services.values().map(|need| need[0][MapKind::Services as usize]).sum();
        assert_eq!(counted as usize, encoded(LbMode::Snat, dsr_accept::TCP).v4.services.len());
    }

    /// The NodePort's one entry stays while any of the node's addresses has the NodePort, and
    /// goes with the last, when only the changed frontends are encoded again.
    #[test]
    fn a_node_ports_carried_entry_goes_with_its_last_node_address() {
        let modes =
            Modes { balancing: Balancing::Random, lb_mode: LbMode::Dsr, carriers_taken: dsr_accept::TCP };
        let (mut ids, mut counters) = (ServiceIds::default(), CounterIds::new(16));
        let two = sent_by_dsr(&["192.168.0.2", "192.168.0.3"]);
        let mut wanted = encode_admitted(&two, &Refused::default(), modes, &mut ids, &mut counters);
        let node_port =
            ServiceKey4 { addr: [0; 4], port: 30080, proto: proto::TCP, source_class: source_class::CARRIED };
        let changed = |state: &DesiredState, before: &DesiredState| StateChanges {
            frontends: before
                .frontends
                .keys()
                .chain(state.frontends.keys())
                .filter(|frontend| state.frontends.get(*frontend) != before.frontends.get(*frontend))
                .copied()
                .collect(),
            ..StateChanges::default()
        };

        let one = sent_by_dsr(&["192.168.0.2"]);
        let changes = changed(&one, &two);
        assert_eq!(changes.frontends.len(), 2, "{changes:?}");
        let (touched, _) =
            encode_changes(&mut wanted, &one, &Refused::default(), &changes, modes, &mut ids, &mut counters);
        assert!(wanted.v4.services.contains_key(&node_port), "the other address's NodePort lost it");
        assert!(touched.keys.contains(&node_port));
        assert_eq!(carried_entries(&wanted).len(), 3);

        let none = sent_by_dsr(&[]);
        let changes = changed(&none, &one);
        encode_changes(&mut wanted, &none, &Refused::default(), &changes, modes, &mut ids, &mut counters);
        assert!(!wanted.v4.services.contains_key(&node_port), "no NodePort left, but its entry");
        assert_eq!(carried_entries(&wanted), vec![([1, 2, 3, 4], 80), ([5, 6, 7, 8], 80)]);
        assert_eq!(wanted, encode_admitted(&none, &Refused::default(), modes, &mut ids, &mut counters));
    }

    #[test]
    fn a_localhost_node_port_is_the_node_classs_alone() {
        let service: Service = serde_json::from_value(json!({
            "metadata": {"name": "web", "namespace": "ns"},
            "spec": {"type": "NodePort", "clusterIPs": ["10.96.0.10", "fd00:10:96::a"],
                     "ports": [{"name": "http", "port": 80, "nodePort": 30080}]},
        }))
        .unwrap();
        let slices = [slice("web-4", "IPv4", "10.1.0.1"), slice("web-6", "IPv6", "fd00:10:244::1")];
        let node =
            NodeContext { name: "node-a".into(), localhost_node_ports: true, ..NodeContext::default() };
        let state = desired_state(&[service], &slices, &node).state;
        let wanted = encode(&state, Balancing::Random, &mut ServiceIds::default(), &mut CounterIds::new(16));
        let localhost =
            |class| ServiceKey4 { addr: [127, 0, 0, 1], port: 30080, proto: proto::TCP, source_class: class };
        assert!(wanted.v4.services.contains_key(&localhost(source_class::NODE)));
        // A packet from elsewhere to 127.0.0.1 is never balanced (CVE-2020-8558).
        assert!(!wanted.v4.services.contains_key(&localhost(source_class::OUTSIDE)));
        assert!(!wanted.v4.services.contains_key(&localhost(source_class::POD)));
        // kube-proxy has no IPv6 localhost NodePorts.
        assert!(wanted.v6.services.keys().all(|key| key.addr != octets6("::1")));

        let without = NodeContext { localhost_node_ports: false, ..node };
        let state = desired_state(&[], &[], &without).state;
        assert!(state.frontends.keys().all(|frontend| !frontend.ip.is_loopback()));
    }

    #[test]
    fn classifiers_and_unmatched_destinations_go_to_their_family() {
        let wanted =
            encode(&dual_stack(&[]), Balancing::Random, &mut ServiceIds::default(), &mut CounterIds::new(16));
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

        let wanted = encode(
            &dual_stack(&["203.0.113.0/25", " 2001:db8:1::/64 "]),
            Balancing::Random,
            &mut ServiceIds::default(),
            &mut CounterIds::new(16),
        );
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

        let wanted = encode(
            &dual_stack(&["203.0.113.0/25"]),
            Balancing::Random,
            &mut ServiceIds::default(),
            &mut CounterIds::new(16),
        );
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

    /// The affinity timeouts of both families' entries.
    fn affinity_timeouts(wanted: &Wanted) -> BTreeSet<u32> {
        let v4 = wanted.v4.services.values().map(|service| service.affinity_timeout);
        v4.chain(wanted.v6.services.values().map(|service| service.affinity_timeout)).collect()
    }

    #[test]
    fn session_affinity_becomes_the_entries_timeout() {
        let mut state = dual_stack(&[]);
        for entry in state.frontends.values_mut() {
            entry.affinity = Some(std::time::Duration::from_secs(600));
        }
        let wanted = encode(&state, Balancing::Random, &mut ServiceIds::default(), &mut CounterIds::new(16));
        assert_eq!(affinity_timeouts(&wanted), BTreeSet::from([600]));

        let plain =
            encode(&dual_stack(&[]), Balancing::Random, &mut ServiceIds::default(), &mut CounterIds::new(16));
        assert_eq!(affinity_timeouts(&plain), BTreeSet::from([0]));
    }

    #[test]
    fn maglev_fills_the_set_with_a_table_that_ignores_counter_indices() {
        let table_size = 251;
        let wanted = encode(
            &dual_stack(&[]),
            Balancing::Maglev { table_size },
            &mut ServiceIds::default(),
            &mut CounterIds::new(16),
        );
        for service in wanted.v4.services.values() {
            assert_eq!(service.backends.len(), table_size as usize);
            assert_ne!(service.flags & service_flags::MAGLEV, 0);
        }
        // Two nodes hand out different counter indices; their tables still agree.
        let a = [V4::backend([10, 1, 0, 1], 80, 1), V4::backend([10, 1, 0, 2], 80, 2)];
        let b = [V4::backend([10, 1, 0, 2], 80, 7), V4::backend([10, 1, 0, 1], 80, 9)];
        let owners = |table: Vec<Backend4>| table.iter().map(|backend| backend.addr).collect::<Vec<_>>();
        assert_eq!(owners(maglev_table::<V4>(&a, table_size)), owners(maglev_table::<V4>(&b, table_size)));
    }
}
