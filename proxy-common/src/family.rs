//! IPv4 and IPv6 as the maps see them, described once for the kernel programs, the agent and
//! the tests.
//!
//! An address type is its family: [`V4`] is `[u8; 4]`, [`V6`] is `[u8; 16]`, the network-order
//! bytes the maps store. Every map type that holds addresses is one generic struct over the
//! address (`ServiceKey<A>`, `Flow<A>`, ...), with the names `ServiceKey4`/`ServiceKey6` as
//! aliases; [`Family`] says what else differs: the names of the family's maps, its bit count,
//! the padding after an address and a port. `#[repr(C)]` lays a generic struct out as the one it
//! replaced, field by field, so the pinned maps keep their layouts (`layout_tests` below checks
//! every offset).
use core::{fmt::Debug, hash::Hash, net::IpAddr};

use crate::{pins, Backend, BackendMember, ServiceKey};

/// IPv4: an address as the maps store it.
pub type V4 = [u8; 4];
/// IPv6: an address as the maps store it.
pub type V6 = [u8; 16];

/// The names of one family's pinned maps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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
    pub early_drop: &'static str,
}

/// Plain bytes the agent can copy, compare, order and hash: addresses, pads, key data.
pub trait Plain: Copy + Default + Debug + Eq + Ord + Hash + Send + Sync + 'static {}
impl<T: Copy + Default + Debug + Eq + Ord + Hash + Send + Sync + 'static> Plain for T {}

/// What a map key or value must be for the agent to store it: `aya::Pod` with feature `user`,
/// nothing more in the kernel.
#[cfg(feature = "user")]
pub trait Storable: aya::Pod {}
#[cfg(feature = "user")]
impl<T: aya::Pod> Storable for T {}
#[cfg(not(feature = "user"))]
pub trait Storable {}
#[cfg(not(feature = "user"))]
impl<T> Storable for T {}

mod sealed {
    pub trait Sealed {}
    impl Sealed for super::V4 {}
    impl Sealed for super::V6 {}
}

/// An address family, implemented by its address type ([`V4`], [`V6`]) and by nothing else:
/// the map types' `aya::Pod` impls rely on the size checks of exactly these two.
pub trait Family: Plain + Storable + sealed::Sealed {
    /// "IPv4" or "IPv6", for logs and errors.
    const NAME: &'static str;
    /// Bits in an address: the prefix length of a single address in a trie.
    const BITS: u32;
    /// The all-zero address, for the unused fields of flow entries.
    const UNSPECIFIED: Self;
    /// The family's pinned maps.
    const MAPS: MapNames;
    /// Padding after an address and a port that brings a following `u64` to its alignment
    /// (`u16` for IPv4, 6 bytes for IPv6).
    type PortPad: Plain;
    /// The data of a source-ranges trie key as the agent writes it with aya's `lpm_trie::Key`:
    /// the service id (big-endian), then the address ([`crate::SourceRange`] without its
    /// prefix length).
    type RangeData: Plain + Storable;

    /// Never equal to a programmed backend (port 0 is never programmed): marks the slots of an
    /// incomplete set the agent read back from the maps.
    const INCOMPLETE: Backend<Self> = Backend { addr: Self::UNSPECIFIED, port: 0, pad: u16::MAX, counter: 0 };

    /// `ip`'s bytes if it is of this family.
    fn addr(ip: IpAddr) -> Option<Self>;
    /// The service id and address of a source-ranges key's data, and the data of them.
    fn range_data(service_id: u32, addr: &Self) -> Self::RangeData;
    fn range_parts(data: &Self::RangeData) -> (u32, Self);

    fn ip(addr: &Self) -> IpAddr;

    /// A trie key (prefix length, network address) for `net` if it is of this family.
    #[cfg(feature = "user")]
    fn prefix(net: &ipnet::IpNet) -> Option<(u32, Self)> {
        Some((u32::from(net.prefix_len()), Self::addr(net.network())?))
    }

    /// A source-ranges trie key for `range` of `service_id`, if `range` is of this family.
    #[cfg(feature = "user")]
    fn source_range(service_id: u32, range: &ipnet::IpNet) -> Option<(u32, Self::RangeData)> {
        let (bits, addr) = Self::prefix(range)?;
        Some((32 + bits, Self::range_data(service_id, &addr)))
    }

    /// The service id and address of a source-ranges trie key's data.
    fn source_range_parts(data: &Self::RangeData) -> (u32, IpAddr) {
        let (service_id, addr) = Self::range_parts(data);
        (service_id, Self::ip(&addr))
    }

    fn service_key(addr: Self, port: u16, proto: u8, source_class: u8) -> ServiceKey<Self> {
        ServiceKey { addr, port, proto, source_class }
    }

    /// The frontend of a services-map key: address, port, protocol.
    fn frontend(key: &ServiceKey<Self>) -> (IpAddr, u16, u8) {
        (Self::ip(&key.addr), key.port, key.proto)
    }

    /// The source class of a services-map key.
    fn source_class(key: &ServiceKey<Self>) -> u8 {
        key.source_class
    }

    /// A backend slot's value; `counter` is the (service port, backend) pair's index in the
    /// counters map.
    fn backend(addr: Self, port: u16, counter: u32) -> Backend<Self> {
        Backend { addr, port, pad: 0, counter }
    }

    /// The address, port and counter index of a backend slot's value.
    fn backend_parts(backend: &Backend<Self>) -> (IpAddr, u16, u32) {
        (Self::ip(&backend.addr), backend.port, backend.counter)
    }

    /// The membership-map key of `backend` in `backend_set`.
    fn member(backend_set: u32, backend: &Backend<Self>) -> BackendMember<Self> {
        BackendMember { backend_set, addr: backend.addr, port: backend.port, pad: 0 }
    }

    /// The backend set of a membership-map key.
    fn member_set(member: &BackendMember<Self>) -> u32 {
        member.backend_set
    }
}

impl Family for V4 {
    const NAME: &'static str = "IPv4";
    const BITS: u32 = 32;
    const UNSPECIFIED: Self = [0; 4];
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
        early_drop: pins::EARLY_DROP4,
    };
    type PortPad = u16;
    type RangeData = [u8; 8];

    fn addr(ip: IpAddr) -> Option<Self> {
        match ip {
            IpAddr::V4(ip) => Some(ip.octets()),
            IpAddr::V6(_) => None,
        }
    }

    fn range_data(service_id: u32, addr: &Self) -> [u8; 8] {
        let [a, b, c, d] = service_id.to_be_bytes();
        let [e, f, g, h] = *addr;
        [a, b, c, d, e, f, g, h]
    }

    fn range_parts(data: &[u8; 8]) -> (u32, Self) {
        let [a, b, c, d, e, f, g, h] = *data;
        (u32::from_be_bytes([a, b, c, d]), [e, f, g, h])
    }

    fn ip(addr: &Self) -> IpAddr {
        IpAddr::from(*addr)
    }
}

impl Family for V6 {
    const NAME: &'static str = "IPv6";
    const BITS: u32 = 128;
    const UNSPECIFIED: Self = [0; 16];
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
        early_drop: pins::EARLY_DROP6,
    };
    type PortPad = [u8; 6];
    type RangeData = [u8; 20];

    fn addr(ip: IpAddr) -> Option<Self> {
        match ip {
            IpAddr::V6(ip) => Some(ip.octets()),
            IpAddr::V4(_) => None,
        }
    }

    fn range_data(service_id: u32, addr: &Self) -> [u8; 20] {
        let mut data = [0; 20];
        let (id, rest) = data.split_at_mut(4);
        id.copy_from_slice(&service_id.to_be_bytes());
        rest.copy_from_slice(addr);
        data
    }

    fn range_parts(data: &[u8; 20]) -> (u32, Self) {
        let (id, rest) = data.split_at(4);
        let mut service_id = [0; 4];
        service_id.copy_from_slice(id);
        let mut addr = [0; 16];
        addr.copy_from_slice(rest);
        (u32::from_be_bytes(service_id), addr)
    }

    fn ip(addr: &Self) -> IpAddr {
        IpAddr::from(*addr)
    }
}

/// Checks the size of each map type (so no implicit padding: the kernel compares keys
/// bytewise, and any byte the kernel hands back must be a valid value) and gives it
/// `aya::Pod` for the agent: `Name: size` for a type of no family, `Name<_>: v4 size, v6 size`
/// for a generic one, each stated once.
macro_rules! map_types {
    ($($name:ident $(<$a:ident>)?: $size:expr $(, $size6:expr)?;)*) => {
        $(map_types!(@one $name $(<$a>)?: $size $(, $size6)?);)*
    };
    (@one $name:ident: $size:expr) => {
        const _: () = assert!(core::mem::size_of::<$name>() == $size);
        // SAFETY: repr(C), Copy, no implicit padding (the size check above).
        #[cfg(feature = "user")]
        unsafe impl aya::Pod for $name {}
    };
    (@one $name:ident<$a:ident>: $size:expr, $size6:expr) => {
        const _: () = assert!(core::mem::size_of::<$name<$crate::V4>>() == $size);
        const _: () = assert!(core::mem::size_of::<$name<$crate::V6>>() == $size6);
        // SAFETY: repr(C), Copy, and no implicit padding for either family, the only two
        // (`Family` is sealed): the size checks above.
        #[cfg(feature = "user")]
        unsafe impl<$a: $crate::Family> aya::Pod for $name<$a> {}
    };
}
pub(crate) use map_types;

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
        let data = V6::range_data(0x0102_0304, &V6::addr(v6).unwrap());
        assert_eq!(data[..6], [1, 2, 3, 4, 0xfd, 0]);
        assert_eq!(V6::source_range_parts(&data), (0x0102_0304, v6));
        assert_eq!(V4::range_data(7, &[10, 0, 0, 0]), [0, 0, 0, 7, 10, 0, 0, 0]);
        assert_eq!(V4::source_range_parts(&[0, 0, 0, 7, 10, 96, 0, 10]), (7, v4));
    }

    #[cfg(feature = "user")]
    #[test]
    fn trie_keys_of_networks() {
        let range: ipnet::IpNet = "2001:db8::/32".parse().unwrap();
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
