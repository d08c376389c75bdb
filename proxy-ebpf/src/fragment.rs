//! IPv4 fragments, as Cilium balances them.
//!
//! Only the first fragment of a datagram (offset 0, "more fragments") carries the TCP/UDP
//! header; it is parsed and balanced like a whole packet, and once rewritten its ports are
//! remembered under what every fragment of the datagram carries, (source, destination, IP
//! identification, protocol), in the LRU map `vipr_frag4_v1`. A later fragment (offset > 0)
//! finds the ports there, and with them its flow entry, and gets the same address rewrites:
//! it has no L4 header, so only the IPv4 header checksum changes (the L4 checksum, in the first
//! fragment, already covers the whole datagram's new pseudo header).
//!
//! A later fragment whose first fragment was not seen (it arrived later, was evicted, or its
//! datagram is no service traffic at all), or whose flow is gone, cannot be placed: to a
//! service address (the unmatched-destination trie knows cluster IPs and the service range) it
//! is dropped, as every packet there no flow explains, rather than routed on with a service
//! address; anything else is left to the stack. Entries are never deleted: the last fragment
//! may overtake a middle one, and LRU eviction forgets finished datagrams.
//!
//! IPv6 fragments are a fragment extension header, which the IPv6 parser does not walk: they
//! are never balanced (see packet.rs).
use aya_ebpf::programs::TcContext;
use proxy_common::{flow_flags, FragmentKey4, FragmentPorts};

use crate::{
    family::{Address, Ipv4, Ipv6, Nat},
    maps::FRAGMENTS4,
    packet::{bytes_at, field, Change, Tuple},
    wire::{ETH_HLEN, IPV4_CSUM_AT, IPV4_MIN_HLEN, IP_OFFSET},
};

const IPV4_CSUM_OFF: usize = ETH_HLEN + IPV4_CSUM_AT;

/// A fragment without an L4 header.
pub enum LaterFragment<A> {
    /// Its datagram's first fragment was seen: the datagram's tuple.
    Known(Tuple<A>),
    /// Its first fragment was not seen; where it goes.
    Unknown { dst: A },
}

/// A family's fragments: IPv4's are placed by their first fragment; IPv6 fragments are never
/// parsed (see packet.rs), so it has none.
pub trait Fragments: Address {
    /// Parses a fragment without L4 header.
    fn later_fragment(ctx: &TcContext) -> Option<LaterFragment<Self>>;
    /// Remembers the ports of a rewritten first fragment with IP identification `id`.
    fn remember_fragment(flow: &Tuple<Self>, id: u16);
}

impl Fragments for Ipv4 {
    #[inline(always)]
    fn later_fragment(ctx: &TcContext) -> Option<LaterFragment<Self>> {
        parse_later_ipv4(ctx)
    }

    #[inline(always)]
    fn remember_fragment(flow: &Tuple<Self>, id: u16) {
        remember(flow, id);
    }
}

impl Fragments for Ipv6 {
    #[inline(always)]
    fn later_fragment(_: &TcContext) -> Option<LaterFragment<Self>> {
        None
    }

    #[inline(always)]
    fn remember_fragment(_: &Tuple<Self>, _: u16) {}
}

/// Remembers the ports of a first fragment the datagram's later fragments need.
#[inline(always)]
pub fn remember(flow: &Tuple<Ipv4>, id: u16) {
    let ports = FragmentPorts { src_port: flow.src_port, dst_port: flow.dst_port };
    // A failed insert only leaves the later fragments unplaced.
    let _ = FRAGMENTS4.insert(&key(flow.src, flow.dst, id, flow.proto), &ports);
}

#[inline(always)]
fn key(src: Ipv4, dst: Ipv4, id: u16, proto: u8) -> FragmentKey4 {
    FragmentKey4 { src_addr: src, dst_addr: dst, id, proto, pad: 0 }
}

/// Parses a later IPv4 fragment (offset > 0) whose ethertype the caller has checked.
#[inline(always)]
pub fn parse_later_ipv4(ctx: &TcContext) -> Option<LaterFragment<Ipv4>> {
    let ip = unsafe { *bytes_at::<IPV4_MIN_HLEN>(ctx, ETH_HLEN)? };
    if ip[0] >> 4 != 4 || usize::from(ip[0] & 0x0f) * 4 < IPV4_MIN_HLEN {
        return None;
    }
    if u16::from_be_bytes([ip[6], ip[7]]) & IP_OFFSET == 0 {
        return None;
    }
    let src = [ip[12], ip[13], ip[14], ip[15]];
    let dst = [ip[16], ip[17], ip[18], ip[19]];
    let proto = ip[9];
    let id = u16::from_be_bytes([ip[4], ip[5]]);
    Some(match FRAGMENTS4.get(&key(src, dst, id, proto)) {
        Some(ports) => LaterFragment::Known(Tuple {
            src,
            dst,
            src_port: ports.src_port,
            dst_port: ports.dst_port,
            proto,
        }),
        None => LaterFragment::Unknown { dst },
    })
}

/// Applies a flow entry's address rewrites to a later fragment of `flow`: the addresses and,
/// for IPv4, the header checksum (by hand: it is never left partial).
#[inline(always)]
pub fn rewrite_addresses<A: Address>(ctx: &TcContext, flow: &Tuple<A>, nat: &Nat<A>) -> Result<(), i64> {
    let mut change = Change::NONE;
    if nat.flags & flow_flags::REWRITE_DESTINATION != 0 {
        change = change.replace(flow.dst.word_sum(), nat.dst.word_sum());
        let at = field::<A>(ctx, A::DADDR_OFF).ok_or(-1i64)?;
        unsafe { *at = nat.dst };
    }
    if nat.flags & flow_flags::REWRITE_SOURCE != 0 {
        change = change.replace(flow.src.word_sum(), nat.src.word_sum());
        let at = field::<A>(ctx, A::SADDR_OFF).ok_or(-1i64)?;
        unsafe { *at = nat.src };
    }
    if A::IP_HEADER_CHECKSUM {
        let at = bytes_at::<2>(ctx, IPV4_CSUM_OFF).ok_or(-1i64)?;
        unsafe { *at = change.apply(u16::from_be_bytes(*at)).to_be_bytes() };
    }
    Ok(())
}
