//! IPv4 and IPv6 as the maps see them: each family has its own set of maps (`vipr_*4_v*`,
//! `vipr_*6_v*`) with the same meaning, so encoding, planning and syncing are written once,
//! generic over [`Family`], and run for both.
use std::{fmt::Debug, hash::Hash, net::IpAddr};

use aya::Pod;
use ipnet::IpNet;
use proxy_common::{pins, Backend4, Backend6, BackendMember4, BackendMember6, ServiceKey4, ServiceKey6};

/// The names of one family's pinned maps.
#[derive(Clone, Copy, Debug)]
pub struct MapNames {
    pub services: &'static str,
    pub backends: &'static str,
    pub flows: &'static str,
    pub node_ips: &'static str,
    pub pod_cidrs: &'static str,
    pub unmatched: &'static str,
    pub source_ranges: &'static str,
    pub members: &'static str,
    pub affinity: &'static str,
}

pub trait Family: Debug + Default + Clone + Copy + PartialEq + Eq + 'static {
    /// An address as the maps store it (network order bytes).
    type Addr: Pod + Ord + Debug;
    /// The data of a source-ranges trie key: the service id (big-endian), then the address.
    type RangeData: Pod + Ord + Debug;
    type ServiceKey: Pod + Ord + Debug;
    type Backend: Pod + Ord + Hash + Debug;
    /// Key of the membership map: a backend (address and port) in a backend set.
    type Member: Pod + Ord + Debug;

    const NAME: &'static str;
    /// Bits in an address: the prefix length of a single address in a trie.
    const BITS: u32;
    const MAPS: MapNames;
    /// Never equal to a programmed backend (port 0 is never programmed): marks the slots of
    /// an incomplete set read back from the maps.
    const INCOMPLETE: Self::Backend;

    /// `ip`'s bytes if it is of this family.
    fn addr(ip: IpAddr) -> Option<Self::Addr>;
    fn ip(addr: &Self::Addr) -> IpAddr;
    /// A trie key for `net` if it is of this family.
    fn prefix(net: &IpNet) -> Option<(u32, Self::Addr)>;
    /// A source-ranges trie key for `range` of `service_id`, if `range` is of this family.
    fn source_range(service_id: u32, range: &IpNet) -> Option<(u32, Self::RangeData)>;
    fn service_key(addr: Self::Addr, port: u16, proto: u8, source_class: u8) -> Self::ServiceKey;
    /// The frontend of a services-map key: address, port, protocol.
    fn frontend(key: &Self::ServiceKey) -> (IpAddr, u16, u8);
    /// The source class of a services-map key.
    fn source_class(key: &Self::ServiceKey) -> u8;
    /// The service id and address of a source-ranges trie key's data.
    fn source_range_parts(data: &Self::RangeData) -> (u32, IpAddr);
    /// A backend slot's value; `counter` is the (service port, backend) pair's index in the
    /// counters map.
    fn backend(addr: Self::Addr, port: u16, counter: u32) -> Self::Backend;
    /// The address, port and counter index of a backend slot's value.
    fn backend_parts(backend: &Self::Backend) -> (IpAddr, u16, u32);
    /// The membership-map key of `backend` in `backend_set`.
    fn member(backend_set: u32, backend: &Self::Backend) -> Self::Member;
    /// The backend set of a membership-map key.
    fn member_set(member: &Self::Member) -> u32;
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct V4;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct V6;

/// The parts of [`Family`] that are the same code for both families up to the types.
macro_rules! same_shape {
    ($backend:ident, $service_key:ident, $member:ident) => {
        const INCOMPLETE: $backend = $backend { addr: [0; _], port: 0, pad: u16::MAX, counter: 0 };

        fn service_key(addr: Self::Addr, port: u16, proto: u8, source_class: u8) -> $service_key {
            $service_key { addr, port, proto, source_class }
        }

        fn frontend(key: &$service_key) -> (IpAddr, u16, u8) {
            (IpAddr::from(key.addr), key.port, key.proto)
        }

        fn source_class(key: &$service_key) -> u8 {
            key.source_class
        }

        fn source_range_parts(data: &Self::RangeData) -> (u32, IpAddr) {
            let (id, addr) = data.split_at(4);
            let mut service_id = [0; 4];
            service_id.copy_from_slice(id);
            let mut bytes: Self::Addr = [0; _];
            bytes.copy_from_slice(addr);
            (u32::from_be_bytes(service_id), IpAddr::from(bytes))
        }

        fn backend(addr: Self::Addr, port: u16, counter: u32) -> $backend {
            $backend { addr, port, pad: 0, counter }
        }

        fn backend_parts(backend: &$backend) -> (IpAddr, u16, u32) {
            (IpAddr::from(backend.addr), backend.port, backend.counter)
        }

        fn member(backend_set: u32, backend: &$backend) -> $member {
            $member { backend_set, addr: backend.addr, port: backend.port, pad: 0 }
        }

        fn member_set(member: &$member) -> u32 {
            member.backend_set
        }

        fn ip(addr: &Self::Addr) -> IpAddr {
            IpAddr::from(*addr)
        }

        fn source_range(service_id: u32, range: &IpNet) -> Option<(u32, Self::RangeData)> {
            let (bits, addr) = Self::prefix(range)?;
            let mut data = [0; _];
            data[..4].copy_from_slice(&service_id.to_be_bytes());
            data[4..].copy_from_slice(&addr);
            Some((32 + bits, data))
        }
    };
}

impl Family for V4 {
    type Addr = [u8; 4];
    type RangeData = [u8; 8];
    type ServiceKey = ServiceKey4;
    type Backend = Backend4;
    type Member = BackendMember4;

    const NAME: &'static str = "IPv4";
    const BITS: u32 = 32;
    const MAPS: MapNames = MapNames {
        services: pins::SERVICES4,
        backends: pins::BACKENDS4,
        flows: pins::FLOWS4,
        node_ips: pins::NODE_IPS4,
        pod_cidrs: pins::POD_CIDRS4,
        unmatched: pins::UNMATCHED4,
        source_ranges: pins::SOURCE_RANGES4,
        members: pins::MEMBERS4,
        affinity: pins::AFFINITY4,
    };

    same_shape!(Backend4, ServiceKey4, BackendMember4);

    fn addr(ip: IpAddr) -> Option<[u8; 4]> {
        match ip {
            IpAddr::V4(ip) => Some(ip.octets()),
            IpAddr::V6(_) => None,
        }
    }

    fn prefix(net: &IpNet) -> Option<(u32, [u8; 4])> {
        match net {
            IpNet::V4(net) => Some((u32::from(net.prefix_len()), net.network().octets())),
            IpNet::V6(_) => None,
        }
    }
}

impl Family for V6 {
    type Addr = [u8; 16];
    type RangeData = [u8; 20];
    type ServiceKey = ServiceKey6;
    type Backend = Backend6;
    type Member = BackendMember6;

    const NAME: &'static str = "IPv6";
    const BITS: u32 = 128;
    const MAPS: MapNames = MapNames {
        services: pins::SERVICES6,
        backends: pins::BACKENDS6,
        flows: pins::FLOWS6,
        node_ips: pins::NODE_IPS6,
        pod_cidrs: pins::POD_CIDRS6,
        unmatched: pins::UNMATCHED6,
        source_ranges: pins::SOURCE_RANGES6,
        members: pins::MEMBERS6,
        affinity: pins::AFFINITY6,
    };

    same_shape!(Backend6, ServiceKey6, BackendMember6);

    fn addr(ip: IpAddr) -> Option<[u8; 16]> {
        match ip {
            IpAddr::V6(ip) => Some(ip.octets()),
            IpAddr::V4(_) => None,
        }
    }

    fn prefix(net: &IpNet) -> Option<(u32, [u8; 16])> {
        match net {
            IpNet::V6(net) => Some((u32::from(net.prefix_len()), net.network().octets())),
            IpNet::V4(_) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_of_each_family() {
        let v4: IpAddr = "10.96.0.10".parse().unwrap();
        let v6: IpAddr = "fd00:10:96::a".parse().unwrap();
        assert_eq!(V4::addr(v4), Some([10, 96, 0, 10]));
        assert_eq!(V4::addr(v6), None);
        assert_eq!(V6::addr(v4), None);
        assert_eq!(V6::ip(&V6::addr(v6).unwrap()), v6);
        assert_eq!(V6::frontend(&V6::service_key(V6::addr(v6).unwrap(), 80, 6, 1)), (v6, 80, 6));

        let range: IpNet = "2001:db8::/32".parse().unwrap();
        let (bits, data) = V6::source_range(0x0102_0304, &range).unwrap();
        assert_eq!(bits, 64);
        assert_eq!(data[..6], [1, 2, 3, 4, 0x20, 0x01]);
        assert_eq!(V4::source_range(7, &range), None);
        assert_eq!(
            V4::source_range(7, &"10.0.0.0/8".parse().unwrap()),
            Some((40, [0, 0, 0, 7, 10, 0, 0, 0]))
        );
        assert_eq!(V6::prefix(&"fd00:10::/64".parse().unwrap()).map(|(bits, _)| bits), Some(64));
    }
}
