//! Direct server return's wire format: the IPv4 option that carries a connection's service
//! address and port from the node a request arrived at to the backend's node
//! (`--lb-mode=dsr`). The ingress node inserts it after rewriting the destination to the
//! backend; the backend's node reads it, stores the connection's entries (conntrack.rs) and
//! removes it before the backend sees the packet, so that the backend's replies can leave
//! from there with the service address as source.
//!
//! The option is eight bytes right after the fixed 20-byte header: type, length (8), port and
//! address in network order. Its type, 0x9a, has the copied bit set (fragments carry it too),
//! class 0 (control) and number 26, which IANA has not assigned; Cilium's DSR uses the same
//! layout. Linux ignores options it does not know on a received packet, so a router between
//! the nodes forwards it, and a backend whose node runs no vipr would only see it ignored.
//! An IPv4 option, not encapsulation: eight bytes rather than 20 (IPIP) or 50 and more
//! (GENEVE), no tunnel device on either node, and the packet stays routable as it is (its
//! destination is the backend). IPv6 (a destination-options header) is not done: IPv6
//! frontends keep their masquerade.
use aya_ebpf::{bindings::bpf_adj_room_mode::BPF_ADJ_ROOM_NET, programs::TcContext};

use crate::{
    family::{Endpoint, Ipv4, Ipv6},
    packet::{field, Change, IpHeader, Packet},
    wire::{ETH_HLEN, IPV4_CSUM_AT, IPV4_MIN_HLEN},
};

/// The option's type byte: copied, control class, number 26.
pub const OPTION_TYPE: u8 = 0x9a;
/// The option's length, type and length bytes included.
pub const OPTION_LEN: usize = 8;
/// `bpf_skb_adjust_room`: keep the skb's checksum state. The option is outside what the L4
/// checksum covers and the header checksum is updated here, so every checksum stays right.
const BPF_F_ADJ_ROOM_NO_CSUM_RESET: u64 = 1 << 5;
/// The largest IPv4 header (IHL 15).
const IPV4_MAX_HLEN: usize = 60;

/// Where a family stands on direct server return.
pub trait Dsr: IpHeader {
    /// Whether the family does direct server return at all: the compiler drops the paths of
    /// a family that does not.
    const DSR: bool;
    /// The service address and port a request carries, if it carries vipr's option.
    fn carried(ctx: &TcContext, packet: &Packet<Self>) -> Option<Endpoint<Self>>;
    /// Inserts the option carrying `frontend`, after the packet's rewrite (it moves the L4
    /// header, and with it every offset of a parsed packet). `Err` leaves the packet as it was.
    fn carry(ctx: &TcContext, frontend: &Endpoint<Self>) -> Result<(), i64>;
    /// Removes the option [`Dsr::carried`] found.
    fn strip(ctx: &TcContext) -> Result<(), i64>;
    /// The IP packet's length (header and payload, as the header says).
    fn ip_len(packet: &Packet<Self>) -> u32;

    /// Whether the packet with the option added still fits `mtu` (the egress device's).
    #[inline(always)]
    fn fits_with_option(packet: &Packet<Self>, mtu: u32) -> bool {
        Self::ip_len(packet) + OPTION_LEN as u32 <= mtu
    }
}

impl Dsr for Ipv4 {
    const DSR: bool = true;

    #[inline(always)]
    fn carried(ctx: &TcContext, packet: &Packet<Self>) -> Option<Endpoint<Self>> {
        if packet.l4_offset < ETH_HLEN + IPV4_MIN_HLEN + OPTION_LEN {
            return None;
        }
        // A helper's copy, not direct access: the compiler folds a bounds check here into the
        // parser's, which the verifier, tracking the variable header length, cannot follow.
        // Only packets with IP options pay for it.
        let option: [u8; OPTION_LEN] = ctx.load(ETH_HLEN + IPV4_MIN_HLEN).ok()?;
        if option[0] != OPTION_TYPE || usize::from(option[1]) != OPTION_LEN {
            return None;
        }
        Some(Endpoint {
            addr: [option[4], option[5], option[6], option[7]],
            port: u16::from_be_bytes([option[2], option[3]]),
        })
    }

    #[inline(always)]
    fn carry(ctx: &TcContext, frontend: &Endpoint<Self>) -> Result<(), i64> {
        let header = field::<[u8; IPV4_MIN_HLEN]>(ctx, ETH_HLEN).ok_or(-1i64)?;
        // SAFETY: bounds-checked above.
        let (first, total) = unsafe {
            let header = &*header;
            (u16::from_be_bytes([header[0], header[1]]), u16::from_be_bytes([header[2], header[3]]))
        };
        if usize::from(first >> 8 & 0x0f) * 4 + OPTION_LEN > IPV4_MAX_HLEN {
            return Err(-1);
        }
        ctx.adjust_room(OPTION_LEN as i32, BPF_ADJ_ROOM_NET, BPF_F_ADJ_ROOM_NO_CSUM_RESET)?;
        let port = frontend.port.to_be_bytes();
        let addr = frontend.addr;
        let option = [OPTION_TYPE, OPTION_LEN as u8, port[0], port[1], addr[0], addr[1], addr[2], addr[3]];
        // Two more 32-bit words of header, eight more bytes of packet.
        let (new_first, new_total) = (first + (2 << 8), total.wrapping_add(OPTION_LEN as u16));
        let change = Change::NONE
            .replace(first, new_first)
            .and(Change::NONE.replace(total, new_total))
            .and(option_change(&option, true));
        // The room is new: every pointer is checked again.
        let header = field::<[u8; IPV4_MIN_HLEN + OPTION_LEN]>(ctx, ETH_HLEN).ok_or(-1i64)?;
        // SAFETY: bounds-checked above.
        unsafe {
            let header = &mut *header;
            header[0..2].copy_from_slice(&new_first.to_be_bytes());
            header[2..4].copy_from_slice(&new_total.to_be_bytes());
            let csum = u16::from_be_bytes([header[IPV4_CSUM_AT], header[IPV4_CSUM_AT + 1]]);
            header[IPV4_CSUM_AT..IPV4_CSUM_AT + 2].copy_from_slice(&change.apply(csum).to_be_bytes());
            header[IPV4_MIN_HLEN..].copy_from_slice(&option);
        }
        Ok(())
    }

    #[inline(always)]
    fn strip(ctx: &TcContext) -> Result<(), i64> {
        let header = field::<[u8; IPV4_MIN_HLEN + OPTION_LEN]>(ctx, ETH_HLEN).ok_or(-1i64)?;
        // SAFETY: bounds-checked above; the header is rewritten before the option goes, since
        // the removal starts right after the fixed header.
        unsafe {
            let header = &mut *header;
            let first = u16::from_be_bytes([header[0], header[1]]);
            let total = u16::from_be_bytes([header[2], header[3]]);
            let mut option = [0u8; OPTION_LEN];
            option.copy_from_slice(&header[IPV4_MIN_HLEN..]);
            let (new_first, new_total) = (first - (2 << 8), total.wrapping_sub(OPTION_LEN as u16));
            let change = Change::NONE
                .replace(first, new_first)
                .and(Change::NONE.replace(total, new_total))
                .and(option_change(&option, false));
            header[0..2].copy_from_slice(&new_first.to_be_bytes());
            header[2..4].copy_from_slice(&new_total.to_be_bytes());
            let csum = u16::from_be_bytes([header[IPV4_CSUM_AT], header[IPV4_CSUM_AT + 1]]);
            header[IPV4_CSUM_AT..IPV4_CSUM_AT + 2].copy_from_slice(&change.apply(csum).to_be_bytes());
        }
        ctx.adjust_room(-(OPTION_LEN as i32), BPF_ADJ_ROOM_NET, BPF_F_ADJ_ROOM_NO_CSUM_RESET)
    }

    #[inline(always)]
    fn ip_len(packet: &Packet<Self>) -> u32 {
        (packet.l4_offset - ETH_HLEN) as u32 + packet.l4_len
    }
}

/// The header checksum's change when the option's four 16-bit words come into the header
/// (`inserted`: from nothing, as if they had been zero) or leave it.
#[inline(always)]
fn option_change(option: &[u8; OPTION_LEN], inserted: bool) -> Change {
    let mut change = Change::NONE;
    let mut at = 0;
    while at < OPTION_LEN {
        let word = u16::from_be_bytes([option[at], option[at + 1]]);
        change = if inserted { change.replace(0, word) } else { change.replace(word, 0) };
        at += 2;
    }
    change
}

/// Not done for IPv6 (a destination-options extension header): its frontends never get
/// `service_flags::DSR`, and no request carries an option the parser would see.
impl Dsr for Ipv6 {
    const DSR: bool = false;

    #[inline(always)]
    fn carried(_ctx: &TcContext, _packet: &Packet<Self>) -> Option<Endpoint<Self>> {
        None
    }

    #[inline(always)]
    fn carry(_ctx: &TcContext, _frontend: &Endpoint<Self>) -> Result<(), i64> {
        Err(-1)
    }

    #[inline(always)]
    fn strip(_ctx: &TcContext) -> Result<(), i64> {
        Ok(())
    }

    #[inline(always)]
    fn ip_len(packet: &Packet<Self>) -> u32 {
        packet.l4_len + crate::wire::IPV6_HLEN as u32
    }
}
