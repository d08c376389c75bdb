//! The desired state in the eBPF maps' terms. Pure, so the encoding is unit-tested without a
//! kernel.
use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    net::{IpAddr, Ipv4Addr},
};

use ipnet::IpNet;
use proxy_common::{proto, service_flags, source_class, unmatched, Backend4, ServiceKey4};

use super::plan::WantedService;
use crate::model::{Backend, DesiredState, Protocol, ServicePortName, SourceClass, Treatment, WhenEmpty};

/// A key of an LPM trie: prefix length in bits and the data it applies to.
pub type LpmKey<const N: usize> = (u32, [u8; N]);

/// Everything the maps should hold.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Wanted {
    pub services: BTreeMap<ServiceKey4, WantedService>,
    pub node_ips: BTreeMap<[u8; 4], u8>,
    pub pod_cidrs: BTreeMap<LpmKey<4>, u8>,
    pub unmatched: BTreeMap<LpmKey<4>, u8>,
    /// Key data: the service id (big-endian) followed by the source address.
    pub source_ranges: BTreeMap<LpmKey<8>, u8>,
    /// Frontends (or parts of them) this dataplane cannot express, with the reason.
    pub unsupported: Vec<String>,
}

const CLASSES: [(SourceClass, u8); 3] = [
    (SourceClass::Outside, source_class::OUTSIDE),
    (SourceClass::Pod, source_class::POD),
    (SourceClass::Node, source_class::NODE),
];

pub fn encode(state: &DesiredState, service_ids: &mut ServiceIds) -> Wanted {
    let mut wanted = Wanted::default();
    for (frontend, entry) in &state.frontends {
        let (IpAddr::V4(address), Some(protocol)) = (frontend.ip, ip_protocol(frontend.protocol)) else {
            wanted
                .unsupported
                .push(format!("{frontend} ({}): only IPv4 TCP and UDP are supported", entry.service));
            continue;
        };
        if entry.affinity.is_some() {
            wanted
                .unsupported
                .push(format!("{frontend} ({}): programmed without session affinity", entry.service));
        }
        let service_id = service_ids.id_for(&entry.service, (address, frontend.port, protocol));
        let mut flags_common = 0;
        if !entry.allowed_sources.is_empty() {
            flags_common |= service_flags::SOURCE_RANGES;
            for range in &entry.allowed_sources {
                if let IpNet::V4(range) = range {
                    let mut data = [0; 8];
                    data[..4].copy_from_slice(&service_id.to_be_bytes());
                    data[4..].copy_from_slice(&range.network().octets());
                    wanted.source_ranges.insert((32 + u32::from(range.prefix_len()), data), 1);
                }
            }
        }
        for (class, class_code) in CLASSES {
            let treatment = entry.treatment(class);
            let key = ServiceKey4 {
                addr: address.octets(),
                port: frontend.port,
                proto: protocol,
                source_class: class_code,
            };
            wanted.services.insert(
                key,
                WantedService {
                    backends: ipv4_backends(treatment),
                    service_id,
                    flags: flags_common | flags(treatment),
                },
            );
        }
    }
    for ip in &state.sources.node_ips {
        if let IpAddr::V4(ip) = ip {
            wanted.node_ips.insert(ip.octets(), 1);
        }
    }
    wanted.pod_cidrs = ipv4_prefixes(&state.sources.pod_cidrs, 1);
    wanted.unmatched = ipv4_prefixes(&state.service_cidrs, unmatched::DROP);
    for ip in &state.cluster_ips {
        if let IpAddr::V4(ip) = ip {
            wanted.unmatched.insert((32, ip.octets()), unmatched::REJECT);
        }
    }
    wanted
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

fn ipv4_backends(treatment: &Treatment) -> Vec<Backend4> {
    treatment
        .backends
        .iter()
        .filter_map(|Backend { ip, port }| match ip {
            IpAddr::V4(ip) => Some(Backend4 { addr: ip.octets(), port: *port, pad: 0 }),
            IpAddr::V6(_) => None,
        })
        .collect()
}

fn ipv4_prefixes(nets: &[IpNet], value: u8) -> BTreeMap<LpmKey<4>, u8> {
    nets.iter()
        .filter_map(|net| match net {
            IpNet::V4(net) => Some((u32::from(net.prefix_len()), net.network().octets())),
            IpNet::V6(_) => None,
        })
        .map(|key| (key, value))
        .collect()
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
    adopted: HashMap<(Ipv4Addr, u16, u8), u32>,
    next: u32,
}

impl ServiceIds {
    pub fn adopt(&mut self, key: &ServiceKey4, id: u32) {
        self.adopted.insert((Ipv4Addr::from(key.addr), key.port, key.proto), id);
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
    pub fn id_for(&mut self, name: &ServicePortName, frontend: (Ipv4Addr, u16, u8)) -> u32 {
        if !self.ids.contains_key(name) {
            if let Some(id) = self.adopted.remove(&frontend).filter(|id| !self.used.contains(id)) {
                self.ids.insert(name.clone(), id);
                self.used.insert(id);
            }
        }
        self.id(name)
    }
}
