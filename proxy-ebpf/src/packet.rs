//! Ethernet/IPv4/IPv6/TCP/UDP/SCTP parsing with direct packet access, and address rewriting with
//! the kernel's checksum helpers (and, for SCTP, proxy-common's CRC32c update).
//!
//! Direct access costs a bounds check per header instead of a helper call per field. The
//! rewrite must use `bpf_l3_csum_replace`/`bpf_l4_csum_replace`: on veth, locally generated
//! packets are CHECKSUM_PARTIAL and their L4 checksum field holds only the pseudo-header seed,
//! which the helpers (with BPF_F_PSEUDO_HDR) update correctly and a hand-written RFC 1624
//! update would corrupt.
//!
//! What this parser refuses (the caller then tries icmp_error.rs and fragment.rs, and leaves
//! the rest untouched): other ethertypes and protocols, truncated headers, later IPv4
//! fragments (a first fragment carries the L4 header and is parsed, see [`Packet::first_fragment`]),
//! fragmented SCTP (its checksum covers the whole datagram, which no fragment shows; SCTP
//! avoids fragmentation by its own path MTU discovery), and IPv6 packets whose next header is
//! not TCP, UDP or SCTP. That last rule covers every IPv6 extension header (hop-by-hop, routing,
//! fragment, destination options, AH, ESP): such packets are passed to the stack as they are,
//! so IPv6 fragments are never balanced either. The one exception is vipr's own
//! direct-server-return header (dsr.rs), of one fixed shape, which TC parses past and removes.
//! Kubernetes service traffic does not carry
//! extension headers; walking them would cost a bounded loop per packet for nothing. A UDP/IPv6
//! datagram with checksum 0 is left alone too: IPv6 forbids it (RFC 8200 8.1), the receiving
//! stack drops it, and rewriting it could only keep the invalid 0.
use aya_ebpf::{
    bindings::{BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR},
    helpers::bpf_csum_diff,
    programs::{TcContext, XdpContext},
};
use proxy_common::{proto, sctp};

use crate::{
    family::{Address, Endpoint, Ipv4, Ipv6},
    wire::{
        DSR6_HDR_EXT_LEN, DSR6_HLEN, DSR6_OPTION_DATA_LEN, DSR6_OPTION_TYPE, ETH_HLEN, IPPROTO_DSTOPTS,
        IPV4_CSUM_AT, IPV4_MIN_HLEN, IPV6_DADDR_OFF, IPV6_HLEN, IPV6_SADDR_OFF, IP_MF, IP_OFFSET,
        TCP_CSUM_AT, TCP_FLAGS_AT, UDP_CSUM_AT,
    },
};

pub const ETH_P_IP: u16 = 0x0800;
pub const ETH_P_IPV6: u16 = 0x86dd;
const IPV4_CSUM_OFF: usize = ETH_HLEN + IPV4_CSUM_AT;
pub const TCP_FIN: u8 = 0x01;
pub const TCP_RST: u8 = 0x04;
pub const TCP_SYN: u8 = 0x02;
pub const TCP_ACK: u8 = 0x10;
/// IPv4 total length and IPv6 payload length, from the start of the IP header.
const IPV4_TOTAL_LEN_OFF: usize = 2;
const IPV6_PAYLOAD_LEN_OFF: usize = 4;
/// `bpf_l4_csum_replace`: the checksum belongs to IPv6, so a CHECKSUM_COMPLETE skb's `csum`
/// is not adjusted for a pseudo-header change (IPv6 has no header checksum to balance it).
/// Linux 6.16 and later; older kernels refuse the flag with EINVAL.
const BPF_F_IPV6: u64 = 1 << 7;
const EINVAL: i64 = -22;

/// A connection's addresses, ports and protocol as the packet carries them, for either family.
#[derive(Clone, Copy)]
pub struct Tuple<A> {
    pub src: A,
    pub dst: A,
    pub src_port: u16,
    pub dst_port: u16,
    pub proto: u8,
}

impl<A: Copy> Tuple<A> {
    /// The destination address and port.
    #[inline(always)]
    pub fn destination(&self) -> Endpoint<A> {
        Endpoint { addr: self.dst, port: self.dst_port }
    }
}

/// The fields of a TCP/UDP/SCTP packet that load balancing needs.
pub struct Packet<A> {
    pub flow: Tuple<A>,
    /// Offset of the TCP/UDP/SCTP header from the start of the frame.
    pub l4_offset: usize,
    /// Bytes from the L4 header to the end of the IP packet, as the IP header says (the frame
    /// may carry Ethernet padding after it): what an SCTP checksum covers.
    pub l4_len: u32,
    /// The TCP flags byte (FIN, SYN, RST, ...); 0 for UDP and SCTP.
    pub tcp_flags: u8,
    /// The IP identification of an IPv4 first fragment (offset 0, more fragments), whose
    /// ports the later fragments need (fragment.rs); `None` for a whole packet.
    pub first_fragment: Option<u16>,
}

impl<A> Packet<A> {
    /// The IP packet's length (header and payload, as the header says).
    #[inline(always)]
    pub fn ip_len(&self) -> u32 {
        (self.l4_offset - ETH_HLEN) as u32 + self.l4_len
    }
}

/// A program context with direct packet access, TC's (`__sk_buff`) or XDP's (`xdp_md`): what
/// the parser needs of it, so one parser serves both.
pub trait Frame {
    /// Where the packet's bytes start and end.
    fn data(&self) -> usize;
    fn data_end(&self) -> usize;
}

impl Frame for TcContext {
    #[inline(always)]
    fn data(&self) -> usize {
        TcContext::data(self)
    }

    #[inline(always)]
    fn data_end(&self) -> usize {
        TcContext::data_end(self)
    }
}

impl Frame for XdpContext {
    #[inline(always)]
    fn data(&self) -> usize {
        XdpContext::data(self)
    }

    #[inline(always)]
    fn data_end(&self) -> usize {
        XdpContext::data_end(self)
    }
}

/// A pointer to a `T` at `offset` in the packet, if the packet is long enough.
#[inline(always)]
pub fn field<T>(ctx: &impl Frame, offset: usize) -> Option<*mut T> {
    let start = ctx.data();
    if start + offset + size_of::<T>() > ctx.data_end() {
        return None;
    }
    Some((start + offset) as *mut T)
}

#[inline(always)]
pub fn bytes_at<const N: usize>(ctx: &impl Frame, offset: usize) -> Option<*mut [u8; N]> {
    field::<[u8; N]>(ctx, offset)
}

#[inline(always)]
pub fn ethertype(ctx: &impl Frame) -> Option<u16> {
    Some(u16::from_be_bytes(unsafe { *bytes_at::<2>(ctx, 12)? }))
}

/// A family's IP header: how a TCP/UDP/SCTP packet of it is parsed, and the checksum side of
/// rewriting one of its addresses.
pub trait IpHeader: Address {
    /// Parses a TCP/UDP/SCTP packet of this family (the ethertype already checked), at TC or
    /// at XDP.
    fn parse(ctx: &impl Frame) -> Option<Packet<Self>>;
    /// Whether a router may fragment the packet: an IPv4 packet without DF; never IPv6's.
    fn may_fragment(ctx: &impl Frame) -> bool;
    /// The checksum side of an address change `old` -> `new` (the implementations say how
    /// each family does it).
    fn address_checksums(
        ctx: &TcContext,
        l4_csum: Option<usize>,
        old: Self,
        new: Self,
        mangled: u64,
    ) -> Result<(), i64>;
}

impl IpHeader for Ipv4 {
    /// Parses an IPv4 TCP or UDP packet, whole or the first fragment of a datagram, whose
    /// ethertype the caller has checked.
    #[inline(always)]
    fn parse(ctx: &impl Frame) -> Option<Packet<Self>> {
        let ip = unsafe { *bytes_at::<IPV4_MIN_HLEN>(ctx, ETH_HLEN)? };
        if ip[0] >> 4 != 4 {
            return None;
        }
        let header_len = usize::from(ip[0] & 0x0f) * 4;
        if header_len < IPV4_MIN_HLEN {
            return None;
        }
        // Later fragments carry no ports (fragment.rs finds them from the first one).
        let fragment = u16::from_be_bytes([ip[6], ip[7]]);
        if fragment & IP_OFFSET != 0 {
            return None;
        }
        let src = [ip[12], ip[13], ip[14], ip[15]];
        let dst = [ip[16], ip[17], ip[18], ip[19]];
        // Saturating: a BIG TCP packet over 64 KiB says 0; only SCTP, which has none, reads it.
        let total_len = u16::from_be_bytes([ip[IPV4_TOTAL_LEN_OFF], ip[IPV4_TOTAL_LEN_OFF + 1]]);
        let l4_len = u32::from(total_len).saturating_sub(header_len as u32);
        let mut packet = transport(ctx, ETH_HLEN + header_len, l4_len, ip[9], src, dst)?;
        if fragment & IP_MF != 0 {
            if packet.flow.proto == proto::SCTP {
                return None;
            }
            packet.first_fragment = Some(u16::from_be_bytes([ip[4], ip[5]]));
        }
        Some(packet)
    }

    #[inline(always)]
    fn may_fragment(ctx: &impl Frame) -> bool {
        // The flags byte: DF is 0x40. A packet too short to have it was not parsed.
        bytes_at::<1>(ctx, ETH_HLEN + 6).is_some_and(|flags| unsafe { *flags }[0] & 0x40 == 0)
    }

    /// The checksum side of an IPv4 address change `old` -> `new`: the header checksum, and the L4
    /// checksum at `l4_csum` (the address is part of the pseudo header; SCTP's checksum has none,
    /// `None`). `mangled` is `BPF_F_MARK_MANGLED_0` for UDP, else 0.
    #[inline(always)]
    fn address_checksums(
        ctx: &TcContext,
        l4_csum: Option<usize>,
        old: [u8; 4],
        new: [u8; 4],
        mangled: u64,
    ) -> Result<(), i64> {
        // Checksum helpers take the changed words exactly as they lie in the packet.
        let (old, new) = (u32::from_ne_bytes(old) as u64, u32::from_ne_bytes(new) as u64);
        ctx.l3_csum_replace(IPV4_CSUM_OFF, old, new, 4)?;
        match l4_csum {
            Some(l4_csum) => ctx.l4_csum_replace(l4_csum, old, new, BPF_F_PSEUDO_HDR as u64 | mangled | 4),
            None => Ok(()),
        }
    }
}

impl IpHeader for Ipv6 {
    /// Parses an IPv6 packet whose next header is TCP, UDP or SCTP, the ethertype checked by the caller.
    #[inline(always)]
    fn parse(ctx: &impl Frame) -> Option<Packet<Self>> {
        parse_ipv6::<false>(ctx)
    }

    #[inline(always)]
    fn may_fragment(_ctx: &impl Frame) -> bool {
        false
    }

    /// The checksum side of an IPv6 address change: IPv6 has no header checksum, and the 16-byte
    /// change reaches the L4 checksum as one ones' complement difference from `bpf_csum_diff`,
    /// applied by `bpf_l4_csum_replace` in its by-difference form (size 0), which updates a
    /// CHECKSUM_PARTIAL seed as the 4-byte form does for IPv4.
    #[inline(always)]
    fn address_checksums(
        ctx: &TcContext,
        l4_csum: Option<usize>,
        old: [u8; 16],
        new: [u8; 16],
        mangled: u64,
    ) -> Result<(), i64> {
        let Some(l4_csum) = l4_csum else {
            return Ok(());
        };
        let mut old: [u32; 4] = unsafe { core::mem::transmute(old) };
        let mut new: [u32; 4] = unsafe { core::mem::transmute(new) };
        let diff = unsafe { bpf_csum_diff(old.as_mut_ptr(), 16, new.as_mut_ptr(), 16, 0) };
        if diff < 0 {
            return Err(diff);
        }
        // The helper's sum is 32 bits wide.
        let diff = diff as u32 as u64;
        let flags = BPF_F_PSEUDO_HDR as u64 | mangled;
        match ctx.l4_csum_replace(l4_csum, 0, diff, flags | BPF_F_IPV6) {
            Err(EINVAL) => ctx.l4_csum_replace(l4_csum, 0, diff, flags),
            done => done,
        }
    }
}

/// Parses an IPv6 TCP/UDP/SCTP packet behind vipr's direct-server-return header (dsr.rs), and
/// only such a packet. Apart from [`IpHeader::parse`], which refuses every extension header:
/// the verifier follows each path once per L4 offset it may see, and one parser that took both
/// would have it follow every IPv6 path twice.
#[inline(always)]
pub fn parse_ipv6_carrying(ctx: &TcContext) -> Option<Packet<Ipv6>> {
    parse_ipv6::<true>(ctx)
}

/// [`IpHeader::parse`] for IPv6, or with `DSR_HEADER` [`parse_ipv6_carrying`].
#[inline(always)]
fn parse_ipv6<const DSR_HEADER: bool>(ctx: &impl Frame) -> Option<Packet<Ipv6>> {
    let ip = bytes_at::<IPV6_HLEN>(ctx, ETH_HLEN)?;
    let (version, next_header, payload_len) = unsafe {
        let ip = &*ip;
        (ip[0] >> 4, ip[6], u16::from_be_bytes([ip[IPV6_PAYLOAD_LEN_OFF], ip[IPV6_PAYLOAD_LEN_OFF + 1]]))
    };
    if version != 6 {
        return None;
    }
    let src = unsafe { *bytes_at::<16>(ctx, IPV6_SADDR_OFF)? };
    let dst = unsafe { *bytes_at::<16>(ctx, IPV6_DADDR_OFF)? };
    let (l4_offset, l4_len, protocol) = if DSR_HEADER {
        if next_header != IPPROTO_DSTOPTS {
            return None;
        }
        dsr_header(ctx, payload_len)?
    } else {
        (ETH_HLEN + IPV6_HLEN, u32::from(payload_len), next_header)
    };
    let packet = transport(ctx, l4_offset, l4_len, protocol, src, dst)?;
    if packet.flow.proto == proto::UDP {
        let csum = unsafe { *bytes_at::<2>(ctx, l4_csum_offset(packet.l4_offset, proto::UDP))? };
        if csum == [0, 0] {
            return None;
        }
    }
    Some(packet)
}

/// Where the L4 header of an IPv6 packet with a destination-options header starts, its length
/// and protocol, if the header is vipr's direct-server-return header (wire.rs): a fixed shape,
/// so no loop over options.
#[inline(always)]
fn dsr_header(ctx: &impl Frame, payload_len: u16) -> Option<(usize, u32, u8)> {
    let header = unsafe { *bytes_at::<4>(ctx, ETH_HLEN + IPV6_HLEN)? };
    if header[1] != DSR6_HDR_EXT_LEN || header[2] != DSR6_OPTION_TYPE || header[3] != DSR6_OPTION_DATA_LEN {
        return None;
    }
    let l4_len = u32::from(payload_len).checked_sub(DSR6_HLEN as u32)?;
    Some((ETH_HLEN + IPV6_HLEN + DSR6_HLEN, l4_len, header[0]))
}

/// The L4 part of parsing, shared by both families: the ports, and the checksum field
/// present too, or the rewrite could not fix it.
#[inline(always)]
fn transport<A>(
    ctx: &impl Frame,
    l4_offset: usize,
    l4_len: u32,
    protocol: u8,
    src: A,
    dst: A,
) -> Option<Packet<A>> {
    let csum_end = match protocol {
        proto::TCP => l4_offset + TCP_CSUM_AT + 2,
        proto::UDP => l4_offset + UDP_CSUM_AT + 2,
        // The checksum update needs the packet's own length, which must cover the header.
        proto::SCTP if l4_len >= sctp::HEADER_LEN as u32 => l4_offset + sctp::HEADER_LEN,
        _ => return None,
    };
    let ports = unsafe { *bytes_at::<4>(ctx, l4_offset)? };
    if ctx.data() + csum_end > ctx.data_end() {
        return None;
    }
    // Inside the bytes just checked (the TCP checksum lies after the flags).
    let tcp_flags = if protocol == proto::TCP {
        let flags = unsafe { *bytes_at::<1>(ctx, l4_offset + TCP_FLAGS_AT)? };
        flags[0]
    } else {
        0
    };
    Some(Packet {
        flow: Tuple {
            src,
            dst,
            src_port: u16::from_be_bytes([ports[0], ports[1]]),
            dst_port: u16::from_be_bytes([ports[2], ports[3]]),
            proto: protocol,
        },
        l4_offset,
        l4_len,
        tcp_flags,
        first_fragment: None,
    })
}

#[inline(always)]
fn l4_csum_offset(l4_offset: usize, protocol: u8) -> usize {
    l4_offset + if protocol == proto::TCP { TCP_CSUM_AT } else { UDP_CSUM_AT }
}

/// Which end of the packet to rewrite.
#[derive(Clone, Copy)]
pub enum Side {
    Source,
    Destination,
}

/// Rewrites the source or destination address and port of a parsed packet, keeping the IP and
/// TCP/UDP/SCTP checksums right.
#[inline(always)]
pub fn rewrite<A: IpHeader>(
    ctx: &TcContext,
    packet: &Packet<A>,
    side: Side,
    addr: A,
    port: u16,
) -> Result<(), i64> {
    let (addr_offset, port_offset, old_addr, old_port) = match side {
        Side::Source => (A::SADDR_OFF, packet.l4_offset, packet.flow.src, packet.flow.src_port),
        Side::Destination => (A::DADDR_OFF, packet.l4_offset + 2, packet.flow.dst, packet.flow.dst_port),
    };
    let addr_field = field::<A>(ctx, addr_offset).ok_or(-1i64)?;
    let port_field = bytes_at::<2>(ctx, port_offset).ok_or(-1i64)?;
    unsafe {
        *addr_field = addr;
        *port_field = port.to_be_bytes();
    }
    if packet.flow.proto == proto::SCTP {
        A::address_checksums(ctx, None, old_addr, addr, 0)?;
        return sctp_port_checksum(ctx, packet, side, port);
    }
    let (old_port, new_port) =
        (u16::from_ne_bytes(old_port.to_be_bytes()) as u64, u16::from_ne_bytes(port.to_be_bytes()) as u64);
    // A UDP checksum of 0 means "none" (IPv4) and must stay 0; a computed 0 is sent as 0xffff.
    let mangled = if packet.flow.proto == proto::UDP { BPF_F_MARK_MANGLED_0 as u64 } else { 0 };
    let l4_csum = l4_csum_offset(packet.l4_offset, packet.flow.proto);
    A::address_checksums(ctx, Some(l4_csum), old_addr, addr, mangled)?;
    ctx.l4_csum_replace(l4_csum, old_port, new_port, mangled | 2)?;
    Ok(())
}

/// Updates an SCTP packet's CRC32c for one of its ports becoming `port`. Only the XOR of old
/// and new port bytes matters (the CRC is linear), so the other side's port may already have
/// been rewritten. A field of 0 is left alone: that is a CHECKSUM_PARTIAL packet (a pod's
/// SCTP socket over veth, which offers CRC offload), whose checksum the kernel computes later
/// over the packet *including* the field, so it must stay 0. A real CRC of 0 (one packet in
/// 2^32) then keeps its old, wrong value, and its receiver drops it as a loss.
#[inline(always)]
fn sctp_port_checksum<A>(ctx: &TcContext, packet: &Packet<A>, side: Side, port: u16) -> Result<(), i64> {
    let (old_port, shift) = match side {
        Side::Source => (packet.flow.src_port, 0),
        Side::Destination => (packet.flow.dst_port, 16),
    };
    // The port's big-endian bytes within the first four bytes read little-endian.
    let difference = u32::from((old_port ^ port).swap_bytes()) << shift;
    if difference == 0 {
        return Ok(());
    }
    let change = sctp_checksum_change(difference, packet.l4_len);
    let csum = bytes_at::<4>(ctx, packet.l4_offset + sctp::CHECKSUM_OFFSET).ok_or(-1i64)?;
    let stored = u32::from_le_bytes(unsafe { *csum });
    if stored != 0 {
        unsafe { *csum = (stored ^ change).to_le_bytes() };
    }
    Ok(())
}

/// [`sctp::header_change`] as a BPF function of its own: its loops stay out of every caller.
#[inline(never)]
fn sctp_checksum_change(difference: u32, length: u32) -> u32 {
    sctp::header_change(difference, length)
}

/// A change to checksummed data, kept as the ones' complement sum of `!old + new` over the
/// changed 16-bit words (RFC 1624), to apply to a checksum by hand. For the checksums no
/// offload ever leaves partial (IPv4 headers, ICMP messages): the helpers are needed only for
/// TCP/UDP checksums, and each call would invalidate every packet pointer.
#[derive(Clone, Copy)]
pub struct Change(u32);

impl Change {
    pub const NONE: Self = Self(0);

    #[inline(always)]
    fn add(self, sum: u32) -> Self {
        let sum = self.0 + sum;
        Self((sum & 0xffff) + (sum >> 16))
    }

    /// One word (or the folded sum of several) changed from `old` to `new`.
    #[inline(always)]
    pub fn replace(self, old: u16, new: u16) -> Self {
        self.add(u32::from(!old)).add(u32::from(new))
    }

    #[inline(always)]
    pub fn and(self, other: Self) -> Self {
        self.add(other.0)
    }

    /// The checksum `csum` (as stored, big-endian) after the change: `!(!csum + change)`.
    #[inline(always)]
    pub fn apply(self, csum: u16) -> u16 {
        let sum = Self(u32::from(!csum)).add(self.0);
        !(((sum.0 & 0xffff) + (sum.0 >> 16)) as u16)
    }
}

/// Copies an address (4 or 16 bytes) as 32-bit words. A plain copy of a byte array is
/// lowered to all its byte loads before all its stores, and a 16-byte one spills to 128 bytes
/// of stack; word copies need one register. Packet data is word-aligned from the IP header
/// on (NET_IP_ALIGN), and the verifier allows unaligned packet access where the CPU does.
#[inline(always)]
pub unsafe fn copy_address<T>(src: *const T, dst: *mut T) {
    const { assert!(size_of::<T>().is_multiple_of(4)) };
    let (src, dst) = (src.cast::<u32>(), dst.cast::<u32>());
    let mut i = 0;
    while i < size_of::<T>() / 4 {
        // SAFETY: the caller's pointers cover the whole address.
        unsafe { *dst.add(i) = *src.add(i) };
        i += 1;
    }
}
