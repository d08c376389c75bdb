//! IPv4 and IPv6 behind one trait, so that the datapath is written once: the bottom layer of
//! the kernel crate, above only the wire constants (wire.rs).
//!
//! An address type is its family: [`Ipv4`] is `[u8; 4]`, [`Ipv6`] is `[u8; 16]`, the network
//! order bytes the maps store, and `proxy_common::Family` describes it for the kernel, the
//! agent and the tests alike (its maps' names and types). [`Address`] adds what only the
//! datapath needs of an address (its offsets in the IP header, its checksum words, how a FIB
//! lookup carries it). What each layer above does
//! differently per family is a trait of that layer, implemented there for both: parsing and
//! the checksum side of a rewrite ([`crate::packet::IpHeader`]), the family's maps
//! ([`crate::family_maps::Maps`]), ICMP errors built ([`crate::reject::Reject`]) and
//! reverse-NATed ([`crate::icmp_error::IcmpErrors`]), fragments
//! ([`crate::fragment::Fragments`], IPv4 only). So every module imports downward only.
use core::ptr::NonNull;

use aya_ebpf::bindings::bpf_fib_lookup;
use proxy_common::{Family, FlowTrack, V4, V6};

use crate::wire::{IPV4_DADDR_OFF, IPV4_SADDR_OFF, IPV6_DADDR_OFF, IPV6_SADDR_OFF};

pub type Ipv4 = V4;
pub type Ipv6 = V6;

const AF_INET: u8 = 2;
const AF_INET6: u8 = 10;

/// How to rewrite one direction of a tracked connection: proxy-common's `Flow4`/`Flow6`.
#[derive(Clone, Copy)]
pub struct Nat<A> {
    pub src: A,
    pub src_port: u16,
    pub dst: A,
    pub dst_port: u16,
    /// Bits of `proxy_common::flow_flags`.
    pub flags: u32,
    /// The connection's counter index (`proxy_common::Backend4::counter`).
    pub counter: u32,
    /// `FlowTrack::last_seen` of a new entry: now for the direction just seen, 0 for the
    /// reply direction (no reply yet).
    pub last_seen: u64,
    /// `FlowTrack::state`: the bits of a new entry, or those a found entry held when it was
    /// looked up.
    pub state: u32,
}

impl<A: Copy> Nat<A> {
    /// Where a packet of this direction goes once rewritten: the rewritten destination, else the
    /// one it was sent to (`asked`).
    #[inline(always)]
    pub fn destination(&self, asked: A) -> A {
        if self.flags & proxy_common::flow_flags::REWRITE_DESTINATION != 0 {
            self.dst
        } else {
            asked
        }
    }
}

/// An address and a port: where a backend listens.
#[derive(Clone, Copy)]
pub struct Endpoint<A> {
    pub addr: A,
    pub port: u16,
}

/// A flow entry found for a packet: its rewrites, and its tracking fields in place in the map.
pub struct Tracked<A> {
    /// The entry's rewrites; `flags` without the cached route generation.
    pub nat: Nat<A>,
    /// The entry's tracking fields, in place; [`crate::family_maps::Maps::route_cache`] finds
    /// its other fields from them (rather than more pointers here: this struct lives in the
    /// packet path's frame).
    pub track: NonNull<FlowTrack>,
}

/// What the datapath needs of an address beyond [`Family`].
pub trait Address: Family {
    /// Offsets of the source and destination address from the start of the frame.
    const SADDR_OFF: usize;
    const DADDR_OFF: usize;
    /// IPv4 has a header checksum; IPv6 has none, its ICMPv6 checksum covers the addresses.
    const IP_HEADER_CHECKSUM: bool;

    /// Equality without the `bcmp` call `==` may become for arrays, which BPF cannot make.
    fn is(&self, other: &Self) -> bool;
    /// The address folded into 32 bits, for flow hashing.
    fn fold(&self) -> u32;
    /// The ones' complement sum of the address's 16-bit words, for checksum updates.
    fn word_sum(&self) -> u16;
    /// Sets the family and destination of a FIB lookup.
    fn fib_destination(params: &mut bpf_fib_lookup, destination: Self);
    /// The source address a successful `BPF_FIB_LOOKUP_SRC` lookup chose.
    fn fib_source(params: &bpf_fib_lookup) -> Self;
    /// The next hop a successful lookup found: the route's gateway, or the destination itself.
    fn fib_next_hop(params: &bpf_fib_lookup) -> Self;
}

impl Address for Ipv4 {
    const SADDR_OFF: usize = IPV4_SADDR_OFF;
    const DADDR_OFF: usize = IPV4_DADDR_OFF;
    const IP_HEADER_CHECKSUM: bool = true;

    #[inline(always)]
    fn is(&self, other: &Self) -> bool {
        u32::from_ne_bytes(*self) == u32::from_ne_bytes(*other)
    }

    #[inline(always)]
    fn fold(&self) -> u32 {
        u32::from_be_bytes(*self)
    }

    #[inline(always)]
    fn word_sum(&self) -> u16 {
        word_sum(self)
    }

    #[inline(always)]
    fn fib_destination(params: &mut bpf_fib_lookup, destination: Self) {
        params.family = AF_INET;
        params.__bindgen_anon_4.ipv4_dst = u32::from_ne_bytes(destination);
    }

    #[inline(always)]
    fn fib_source(params: &bpf_fib_lookup) -> Self {
        // SAFETY: with BPF_FIB_LOOKUP_SRC a successful lookup fills ipv4_src.
        unsafe { params.__bindgen_anon_3.ipv4_src }.to_ne_bytes()
    }

    #[inline(always)]
    fn fib_next_hop(params: &bpf_fib_lookup) -> Self {
        // SAFETY: an IPv4 lookup's destination field.
        unsafe { params.__bindgen_anon_4.ipv4_dst }.to_ne_bytes()
    }
}

impl Address for Ipv6 {
    const SADDR_OFF: usize = IPV6_SADDR_OFF;
    const DADDR_OFF: usize = IPV6_DADDR_OFF;
    const IP_HEADER_CHECKSUM: bool = false;

    #[inline(always)]
    fn is(&self, other: &Self) -> bool {
        u128::from_ne_bytes(*self) == u128::from_ne_bytes(*other)
    }

    #[inline(always)]
    fn fold(&self) -> u32 {
        let words = u128::from_be_bytes(*self);
        (words >> 96) as u32 ^ (words >> 64) as u32 ^ (words >> 32) as u32 ^ words as u32
    }

    #[inline(always)]
    fn word_sum(&self) -> u16 {
        word_sum(self)
    }

    #[inline(always)]
    fn fib_destination(params: &mut bpf_fib_lookup, destination: Self) {
        params.family = AF_INET6;
        // SAFETY: [u8; 16] and [u32; 4] have the same size; the words keep the byte order.
        params.__bindgen_anon_4.ipv6_dst = unsafe { core::mem::transmute::<Self, [u32; 4]>(destination) };
    }

    #[inline(always)]
    fn fib_source(params: &bpf_fib_lookup) -> Self {
        // SAFETY: with BPF_FIB_LOOKUP_SRC a successful lookup fills ipv6_src.
        unsafe { core::mem::transmute::<[u32; 4], Self>(params.__bindgen_anon_3.ipv6_src) }
    }

    #[inline(always)]
    fn fib_next_hop(params: &bpf_fib_lookup) -> Self {
        // SAFETY: an IPv6 lookup's destination field (an IPv4 gateway of an IPv6 route is
        // left in the IPv4 field, and this then differs from the destination too).
        unsafe { core::mem::transmute::<[u32; 4], Self>(params.__bindgen_anon_4.ipv6_dst) }
    }
}

/// The folded ones' complement sum of an address's big-endian 16-bit words, read as 32-bit
/// words for the reason [`crate::packet::copy_address`] gives. The ones' complement sum does not depend on
/// byte order (RFC 1071), so the sum of the native halves is the big-endian sum swapped.
#[inline(always)]
fn word_sum<T>(address: &T) -> u16 {
    const { assert!(size_of::<T>().is_multiple_of(4)) };
    let words = core::ptr::from_ref(address).cast::<u32>();
    let mut sum = 0u64;
    let mut i = 0;
    while i < size_of::<T>() / 4 {
        // SAFETY: inside the address.
        let word = unsafe { *words.add(i) };
        sum += u64::from(word & 0xffff) + u64::from(word >> 16);
        i += 1;
    }
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    u16::from_be(sum as u16)
}
