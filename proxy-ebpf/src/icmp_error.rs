//! Reverse NAT of ICMP errors about tracked connections, as conntrack's NAT does for RELATED
//! packets (`nf_nat_icmp_reply_translation`).
//!
//! A backend (or a router between it and the node) that cannot deliver a packet of a DNATed
//! connection answers with an ICMP error (destination or port unreachable, fragmentation
//! needed / packet too big, time exceeded, parameter problem) that quotes the packet as the
//! backend saw it: from the client (or the node's masquerade address) to the backend. The
//! client's kernel matches an error to its socket by the quoted addresses and ports, which
//! must therefore be the ones its socket used, the frontend's. So:
//!
//! ```text
//!  in:   | IP backend -> client (or node)  | ICMP | quoted IP client (node):port -> backend:port | L4 |
//!  out:  | IP frontend -> client           | ICMP | quoted IP client:port -> frontend:port      | L4 |
//! ```
//!
//! The quoted packet travelled the other way, so the reversed quoted tuple is the flow key of
//! the error's own direction: one lookup finds the same entry the connection's replies use,
//! and its rewrites apply crosswise to the quote (the entry's new source is the quote's new
//! destination, its new destination the quote's new source) and as usual to the outer
//! addresses. The outer source becomes the frontend even when a router sent the error, as in
//! netfilter. The same rule serves an error from the client about a reply (the forward entry
//! then applies), which conntrack handles too.
//!
//! Checksums, all by hand (`Change`): the quoted IPv4 header checksum follows its addresses; the
//! quoted TCP/UDP checksum follows its addresses (pseudo header) and ports when the quote
//! reaches it (UDP: always, unless 0 = none; TCP: only quotes of 18 bytes or more), as
//! nf_nat's `l4proto` manip does; the ICMP checksum follows every quoted byte changed, and for
//! ICMPv6 also the outer addresses (pseudo header); the outer IPv4 header checksum follows its
//! addresses. Every change is balanced by a checksum inside the same bytes, so the sum over the
//! packet is unchanged and a CHECKSUM_COMPLETE skb's `csum` stays right without an update.
//! ICMP errors arriving at TC ingress were built by another host (or namespace) with a full
//! checksum, never CHECKSUM_PARTIAL; so are those the node's own stack sends about a request it
//! forwarded DNATed (`--bpf-forwarding=stack`), which the egress program reverse-NATs the same
//! way (tc.rs `stack_error`).
//!
//! An SCTP quote gets its addresses and ports rewritten and keeps its quoted checksum.
//!
//! Left alone: errors quoting anything but TCP/UDP/SCTP, or a later fragment (no ports), or less
//! than the ports (bytes after the IP packet, Ethernet padding, are not the quote); fragmented
//! errors; IPv6 extension headers in either header (not parsed, as for every IPv6 packet);
//! errors about no tracked flow. IPv4 options in either header are fine. An error is not
//! counted and does not refresh its connection's idle time (conntrack's RELATED packets do not
//! either).
use aya_ebpf::programs::TcContext;
use proxy_common::{flow_flags, proto};

use crate::{
    family::{Address, Ipv4, Ipv6, Nat},
    packet::{bytes_at, copy_address, field, Change, Tuple},
    wire::{
        ETH_HLEN, ICMP_HLEN, IPPROTO_ICMP, IPPROTO_ICMPV6, IPV4_CSUM_AT, IPV4_MIN_HLEN, IPV6_HLEN, IP_MF,
        IP_OFFSET, TCP_CSUM_AT, UDP_CSUM_AT,
    },
};

/// ICMP error types (RFC 792; RFC 4443 for ICMPv6).
const ICMP_DEST_UNREACH: u8 = 3;
const ICMP_TIME_EXCEEDED: u8 = 11;
const ICMP_PARAMETERPROB: u8 = 12;
const ICMPV6_DEST_UNREACH: u8 = 1;
const ICMPV6_PARAMPROB: u8 = 4;

/// An ICMP error about a TCP/UDP packet, as parsed.
pub struct IcmpError<A> {
    /// The quoted tuple reversed: the flow key of the direction the error travels. Its
    /// destination, the quoted packet's source, is where the error goes.
    pub key: Tuple<A>,
    /// Offsets from the start of the frame: the ICMP header, the quoted IP header and the
    /// quoted L4 header.
    icmp: usize,
    inner_ip: usize,
    inner_l4: usize,
    /// The quoted L4 checksum field, when the quote reaches it and it is in use.
    inner_l4_csum: Option<usize>,
}

/// A family's ICMP errors about TCP/UDP packets.
pub trait IcmpErrors: Address {
    /// Parses an ICMP error of this family about a TCP/UDP packet.
    fn icmp_error(ctx: &TcContext) -> Option<IcmpError<Self>>;
}

impl IcmpErrors for Ipv4 {
    #[inline(always)]
    fn icmp_error(ctx: &TcContext) -> Option<IcmpError<Self>> {
        parse_ipv4_error(ctx)
    }
}

impl IcmpErrors for Ipv6 {
    #[inline(always)]
    fn icmp_error(ctx: &TcContext) -> Option<IcmpError<Self>> {
        parse_ipv6_error(ctx)
    }
}

/// Parses an IPv4 ICMP error (destination unreachable, time exceeded, parameter problem)
/// quoting a TCP/UDP packet that is whole or a first fragment.
#[inline(always)]
pub fn parse_ipv4_error(ctx: &TcContext) -> Option<IcmpError<Ipv4>> {
    let ip = unsafe { *bytes_at::<IPV4_MIN_HLEN>(ctx, ETH_HLEN)? };
    let ihl = usize::from(ip[0] & 0x0f) * 4;
    if ip[0] >> 4 != 4 || ihl < IPV4_MIN_HLEN || ip[9] != IPPROTO_ICMP {
        return None;
    }
    // A fragmented error may not hold its whole quote; errors are small and never are.
    if u16::from_be_bytes([ip[6], ip[7]]) & (IP_MF | IP_OFFSET) != 0 {
        return None;
    }
    let end = ETH_HLEN + usize::from(u16::from_be_bytes([ip[2], ip[3]]));
    let icmp = ETH_HLEN + ihl;
    let header = unsafe { *bytes_at::<ICMP_HLEN>(ctx, icmp)? };
    if !matches!(header[0], ICMP_DEST_UNREACH | ICMP_TIME_EXCEEDED | ICMP_PARAMETERPROB) {
        return None;
    }
    let inner_ip = icmp + ICMP_HLEN;
    let quoted_header = bytes_at::<IPV4_MIN_HLEN>(ctx, inner_ip)?;
    let quoted = unsafe { *quoted_header };
    let inner_ihl = usize::from(quoted[0] & 0x0f) * 4;
    if quoted[0] >> 4 != 4 || inner_ihl < IPV4_MIN_HLEN {
        return None;
    }
    // A quoted later fragment has no ports to find its flow by.
    if u16::from_be_bytes([quoted[6], quoted[7]]) & IP_OFFSET != 0 {
        return None;
    }
    quoted_transport(ctx, quoted_header.cast(), icmp, inner_ip, inner_ip + inner_ihl, quoted[9], end)
}

/// Parses an ICMPv6 error (destination unreachable, packet too big, time exceeded, parameter
/// problem) quoting a TCP/UDP packet, neither with extension headers.
#[inline(always)]
pub fn parse_ipv6_error(ctx: &TcContext) -> Option<IcmpError<Ipv6>> {
    let ip = bytes_at::<IPV6_HLEN>(ctx, ETH_HLEN)?;
    let (version, payload_len, next_header) =
        unsafe { ((*ip)[0] >> 4, u16::from_be_bytes([(*ip)[4], (*ip)[5]]), (*ip)[6]) };
    if version != 6 || next_header != IPPROTO_ICMPV6 {
        return None;
    }
    let end = ETH_HLEN + IPV6_HLEN + usize::from(payload_len);
    let icmp = ETH_HLEN + IPV6_HLEN;
    let header = unsafe { *bytes_at::<ICMP_HLEN>(ctx, icmp)? };
    // Types 1-4 are the errors (128 and up are informational).
    if !(ICMPV6_DEST_UNREACH..=ICMPV6_PARAMPROB).contains(&header[0]) {
        return None;
    }
    let inner_ip = icmp + ICMP_HLEN;
    let quoted = bytes_at::<IPV6_HLEN>(ctx, inner_ip)?;
    let (version, protocol) = unsafe { ((*quoted)[0] >> 4, (*quoted)[6]) };
    if version != 6 {
        return None;
    }
    quoted_transport(ctx, quoted.cast(), icmp, inner_ip, inner_ip + IPV6_HLEN, protocol, end)
}

/// The quoted TCP/UDP part, shared by both families: the flow key, and whether the quote holds
/// a checksum to keep right. `end` is where the outer IP packet ends.
///
/// Addresses are copied from the packet into the key, never held as values: a 16-byte array
/// moved through registers is loaded byte by byte and spilled, 8 stack bytes a byte, which
/// took this path past BPF's 512 bytes of stack.
#[inline(always)]
fn quoted_transport<A: Address>(
    ctx: &TcContext,
    quoted: *const u8,
    icmp: usize,
    inner_ip: usize,
    inner_l4: usize,
    protocol: u8,
    end: usize,
) -> Option<IcmpError<A>> {
    let csum_at = match protocol {
        proto::TCP => Some(inner_l4 + TCP_CSUM_AT),
        proto::UDP => Some(inner_l4 + UDP_CSUM_AT),
        // A quoted SCTP checksum covers the whole original packet, which the quote does not
        // hold; it stays as quoted (nf_nat recomputes it over the truncated quote, which makes
        // it no truer; no receiver checks it).
        proto::SCTP => None,
        _ => return None,
    };
    // The ports must lie inside the message: bytes after it (Ethernet padding) are no part of
    // the ICMP checksum, which the rewrite below would then break.
    if inner_l4 + 4 > end {
        return None;
    }
    let ports = unsafe { *bytes_at::<4>(ctx, inner_l4)? };
    // Beyond the quote, or (UDP) 0: no checksum to follow the changes.
    let inner_l4_csum = match csum_at {
        Some(csum_at) => match bytes_at::<2>(ctx, csum_at) {
            Some(csum) if csum_at + 2 <= end && (protocol == proto::TCP || unsafe { *csum } != [0, 0]) => {
                Some(csum_at)
            }
            _ => None,
        },
        None => None,
    };
    let mut key = Tuple {
        src: A::UNSPECIFIED,
        dst: A::UNSPECIFIED,
        src_port: u16::from_be_bytes([ports[2], ports[3]]),
        dst_port: u16::from_be_bytes([ports[0], ports[1]]),
        proto: protocol,
    };
    // From the quoted header's pointer, whose bounds check covers the addresses: a check of
    // its own would be merged into that one by the compiler, and the verifier, which tracks
    // checked ranges per pointer, would refuse the access.
    unsafe {
        let quoted_src = quoted.add(A::SADDR_OFF - ETH_HLEN).cast::<A>();
        let quoted_dst = quoted.add(A::DADDR_OFF - ETH_HLEN).cast::<A>();
        copy_address(quoted_dst, &mut key.src);
        copy_address(quoted_src, &mut key.dst);
    }
    Some(IcmpError { key, icmp, inner_ip, inner_l4, inner_l4_csum })
}

/// Applies the flow entry `nat` of the error's direction: crosswise to the quote, as usual to
/// the outer addresses (see the module documentation). `Err` leaves a half-rewritten packet,
/// which the caller drops.
#[inline(always)]
pub fn reverse_nat<A: Address>(ctx: &TcContext, error: &IcmpError<A>, nat: &Nat<A>) -> Result<(), i64> {
    // Checked first: a later check of this lower offset would be merged into the checks of the
    // quote's fields (see quoted_transport).
    let icmp_csum = bytes_at::<2>(ctx, error.icmp + 2).ok_or(-1i64)?;
    let inner_saddr = error.inner_ip + (A::SADDR_OFF - ETH_HLEN);
    let inner_daddr = error.inner_ip + (A::DADDR_OFF - ETH_HLEN);
    let mut changed = Changed { addresses: Change::NONE, ports: Change::NONE, outer: Change::NONE };
    // error.key is the quote reversed: key.src is the quoted destination.
    if nat.flags & flow_flags::REWRITE_SOURCE != 0 {
        let side = Side {
            outer: A::SADDR_OFF,
            quoted_address: inner_daddr,
            quoted_port: error.inner_l4 + 2,
            old_port: error.key.src_port,
            new: &nat.src,
            new_port: nat.src_port,
        };
        if !rewrite_side(ctx, &side, &mut changed) {
            return Err(-1);
        }
    }
    if nat.flags & flow_flags::REWRITE_DESTINATION != 0 {
        let side = Side {
            outer: A::DADDR_OFF,
            quoted_address: inner_saddr,
            quoted_port: error.inner_l4,
            old_port: error.key.dst_port,
            new: &nat.dst,
            new_port: nat.dst_port,
        };
        if !rewrite_side(ctx, &side, &mut changed) {
            return Err(-1);
        }
    }
    let Changed { addresses, ports, outer } = changed;
    // Everything changed inside the ICMP message, checksum fields included.
    let mut icmp = addresses.and(ports);
    if A::IP_HEADER_CHECKSUM {
        icmp = icmp.and(update_checksum(ctx, error.inner_ip + IPV4_CSUM_AT, addresses, false)?);
        update_checksum(ctx, ETH_HLEN + IPV4_CSUM_AT, outer, false)?;
    } else {
        icmp = icmp.and(outer);
    }
    if let Some(at) = error.inner_l4_csum {
        let udp = error.key.proto == proto::UDP;
        icmp = icmp.and(update_checksum(ctx, at, addresses.and(ports), udp)?);
    }
    // SAFETY: checked above; no helper call since, so the pointer is still valid.
    unsafe { *icmp_csum = icmp.apply(u16::from_be_bytes(*icmp_csum)).to_be_bytes() };
    Ok(())
}

/// What a rewrite changed, for the checksums: the quoted addresses (part of the quoted L4
/// checksum's pseudo header) and ports, and the outer addresses (the IPv4 header checksum's,
/// the ICMPv6 pseudo header's).
#[derive(Clone, Copy)]
struct Changed {
    addresses: Change,
    ports: Change,
    outer: Change,
}

/// One side of the rewrite: the outer address at `outer`, and the quoted address and port at
/// `quoted_address` and `quoted_port` (which held `old_port`) become `new` and `new_port`.
struct Side<'a, A> {
    outer: usize,
    quoted_address: usize,
    quoted_port: usize,
    old_port: u16,
    new: &'a A,
    new_port: u16,
}

/// Rewrites one [`Side`], adding to `changed`; false if the packet is too short. A function of
/// its own (a BPF-to-BPF call): inlined twice, its 16-byte addresses took the stack past BPF's
/// 512 bytes. It returns a plain `bool`: a `Result` would be returned through a stack pointer,
/// which the verifier refuses.
#[inline(never)]
fn rewrite_side<A: Address>(ctx: &TcContext, side: &Side<'_, A>, changed: &mut Changed) -> bool {
    let sum = side.new.word_sum();
    let (Ok(outer_old), Ok(quoted_old), Ok(())) = (
        replace_address(ctx, side.outer, side.new),
        replace_address(ctx, side.quoted_address, side.new),
        put(ctx, side.quoted_port, side.new_port.to_be_bytes()),
    ) else {
        return false;
    };
    changed.addresses = changed.addresses.replace(quoted_old, sum);
    changed.ports = changed.ports.replace(side.old_port, side.new_port);
    changed.outer = changed.outer.replace(outer_old, sum);
    true
}

/// Copies `new` over the address at `offset`; the word sum of the address it replaced.
#[inline(always)]
fn replace_address<A: Address>(ctx: &TcContext, offset: usize, new: &A) -> Result<u16, i64> {
    let at = field::<A>(ctx, offset).ok_or(-1i64)?;
    // SAFETY: inside the packet (checked above); read in place, then overwritten.
    unsafe {
        let old = (*at).word_sum();
        copy_address(new, at);
        Ok(old)
    }
}

/// Writes `value` at `offset`.
#[inline(always)]
fn put<T>(ctx: &TcContext, offset: usize, value: T) -> Result<(), i64> {
    let at = field::<T>(ctx, offset).ok_or(-1i64)?;
    unsafe { *at = value };
    Ok(())
}

/// Applies `change` to the checksum at `offset`; returns the change of the field itself. A UDP
/// checksum that computes to 0 is stored as 0xffff (0 means none).
#[inline(always)]
fn update_checksum(ctx: &TcContext, offset: usize, change: Change, udp: bool) -> Result<Change, i64> {
    let at = bytes_at::<2>(ctx, offset).ok_or(-1i64)?;
    let old = u16::from_be_bytes(unsafe { *at });
    let mut new = change.apply(old);
    if udp && new == 0 {
        new = 0xffff;
    }
    unsafe { *at = new.to_be_bytes() };
    Ok(Change::NONE.replace(old, new))
}
