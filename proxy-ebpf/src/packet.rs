//! Ethernet/IPv4/TCP/UDP parsing with direct packet access, and address rewriting with the
//! kernel's checksum helpers.
//!
//! Direct access costs a bounds check per header instead of a helper call per field. The
//! rewrite must use `bpf_l3_csum_replace`/`bpf_l4_csum_replace`: on veth, locally generated
//! packets are CHECKSUM_PARTIAL and their L4 checksum field holds only the pseudo-header seed,
//! which the helpers (with BPF_F_PSEUDO_HDR) update correctly and a hand-written RFC 1624
//! update would corrupt.
use aya_ebpf::{
    bindings::{BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR},
    programs::TcContext,
};
use proxy_common::{proto, FlowKey4};

const ETH_HLEN: usize = 14;
const ETH_P_IP: u16 = 0x0800;
const IPV4_MIN_HLEN: usize = 20;
const IPV4_CSUM_OFF: usize = ETH_HLEN + 10;
const IPV4_SADDR_OFF: usize = ETH_HLEN + 12;
const IPV4_DADDR_OFF: usize = ETH_HLEN + 16;
const IP_MF_AND_OFFSET: u16 = 0x3fff;
const TCP_CSUM_OFF: usize = 16;
const UDP_CSUM_OFF: usize = 6;

/// The fields of an IPv4 TCP/UDP packet that load balancing needs.
pub struct Ipv4L4 {
    pub flow: FlowKey4,
    /// Offset of the TCP/UDP header from the start of the frame.
    pub l4_offset: usize,
}

#[inline(always)]
fn bytes_at<const N: usize>(ctx: &TcContext, offset: usize) -> Option<*mut [u8; N]> {
    let start = ctx.data();
    if start + offset + N > ctx.data_end() {
        return None;
    }
    Some((start + offset) as *mut [u8; N])
}

/// Parses an unfragmented IPv4 TCP or UDP packet; anything else (other ethertypes and
/// protocols, fragments, truncated headers) is `None` and left untouched by the caller.
#[inline(always)]
pub fn parse_ipv4_l4(ctx: &TcContext) -> Option<Ipv4L4> {
    let ethertype = unsafe { *bytes_at::<2>(ctx, 12)? };
    if u16::from_be_bytes(ethertype) != ETH_P_IP {
        return None;
    }
    let ip = unsafe { *bytes_at::<IPV4_MIN_HLEN>(ctx, ETH_HLEN)? };
    if ip[0] >> 4 != 4 {
        return None;
    }
    let header_len = usize::from(ip[0] & 0x0f) * 4;
    if header_len < IPV4_MIN_HLEN {
        return None;
    }
    // Non-first fragments carry no ports; first fragments cannot be matched with the rest.
    if u16::from_be_bytes([ip[6], ip[7]]) & IP_MF_AND_OFFSET != 0 {
        return None;
    }
    let protocol = ip[9];
    if protocol != proto::TCP && protocol != proto::UDP {
        return None;
    }
    let l4_offset = ETH_HLEN + header_len;
    let ports = unsafe { *bytes_at::<4>(ctx, l4_offset)? };
    // The checksum field must be inside the packet too, or the rewrite could not fix it.
    let csum_end = l4_csum_offset(l4_offset, protocol) + 2;
    if ctx.data() + csum_end > ctx.data_end() {
        return None;
    }
    Some(Ipv4L4 {
        flow: FlowKey4 {
            src_addr: [ip[12], ip[13], ip[14], ip[15]],
            dst_addr: [ip[16], ip[17], ip[18], ip[19]],
            src_port: u16::from_be_bytes([ports[0], ports[1]]),
            dst_port: u16::from_be_bytes([ports[2], ports[3]]),
            proto: protocol,
            pad: [0; 3],
        },
        l4_offset,
    })
}

#[inline(always)]
fn l4_csum_offset(l4_offset: usize, protocol: u8) -> usize {
    l4_offset + if protocol == proto::TCP { TCP_CSUM_OFF } else { UDP_CSUM_OFF }
}

/// Which end of the packet to rewrite.
#[derive(Clone, Copy)]
pub enum Side {
    Source,
    Destination,
}

/// Rewrites the source or destination address and port of a packet parsed by
/// [`parse_ipv4_l4`], keeping the IPv4 and TCP/UDP checksums right.
#[inline(always)]
pub fn rewrite(ctx: &TcContext, packet: &Ipv4L4, side: Side, addr: [u8; 4], port: u16) -> Result<(), i64> {
    let (addr_offset, port_offset, old_addr, old_port) = match side {
        Side::Source => (IPV4_SADDR_OFF, packet.l4_offset, packet.flow.src_addr, packet.flow.src_port),
        Side::Destination => {
            (IPV4_DADDR_OFF, packet.l4_offset + 2, packet.flow.dst_addr, packet.flow.dst_port)
        }
    };
    let addr_field = bytes_at::<4>(ctx, addr_offset).ok_or(-1i64)?;
    let port_field = bytes_at::<2>(ctx, port_offset).ok_or(-1i64)?;
    unsafe {
        *addr_field = addr;
        *port_field = port.to_be_bytes();
    }
    // Checksum helpers take the changed words exactly as they lie in the packet.
    let (old_addr, new_addr) = (u32::from_ne_bytes(old_addr) as u64, u32::from_ne_bytes(addr) as u64);
    let (old_port, new_port) =
        (u16::from_ne_bytes(old_port.to_be_bytes()) as u64, u16::from_ne_bytes(port.to_be_bytes()) as u64);
    // A UDP checksum of 0 means "none" and must stay 0.
    let mangled = if packet.flow.proto == proto::UDP { BPF_F_MARK_MANGLED_0 as u64 } else { 0 };
    let l4_csum = l4_csum_offset(packet.l4_offset, packet.flow.proto);
    ctx.l3_csum_replace(IPV4_CSUM_OFF, old_addr, new_addr, 4)?;
    ctx.l4_csum_replace(l4_csum, old_addr, new_addr, BPF_F_PSEUDO_HDR as u64 | mangled | 4)?;
    ctx.l4_csum_replace(l4_csum, old_port, new_port, mangled | 2)?;
    Ok(())
}
