//! Direct server return's wire format: how a connection's service address and port travel
//! from the node a request arrived at to the backend's node (`--lb-mode=dsr`). The ingress node
//! adds them after rewriting the destination to the backend; the backend's node reads them,
//! stores the connection's entries (conntrack.rs) and removes them before the backend sees the
//! packet, so that the backend's replies can leave from there with the service address as
//! source.
//!
//! IPv4: an option of eight bytes right after the fixed 20-byte header: type, length (8), port
//! and address in network order. Its type, 0x9a, has the copied bit set (fragments carry it
//! too), class 0 (control) and number 26, which IANA has not assigned; Cilium's DSR uses the
//! same layout. Linux ignores options it does not know on a received packet, so a router
//! between the nodes forwards it, and a backend whose node runs no vipr would only see it
//! ignored. An IPv4 option, not encapsulation: eight bytes rather than 20 (IPIP) or 50 and more
//! (GENEVE), no tunnel device on either node, and the packet stays routable as it is (its
//! destination is the backend).
//!
//! IPv6: a destination-options extension header of 24 bytes right after the fixed header
//! (wire.rs), for the same reasons: routers do not look into destination options, and a node
//! without vipr skips an option whose type says "skip if unknown". Against IPv6-in-IPv6 (40
//! bytes) or GENEVE, it is the smallest carrier that holds a 16-byte address.
use aya_ebpf::{
    bindings::bpf_adj_room_mode::BPF_ADJ_ROOM_NET,
    helpers::{bpf_check_mtu, bpf_csum_diff, bpf_csum_update, bpf_xdp_adjust_head},
    programs::{TcContext, XdpContext},
    EbpfContext as _,
};
use proxy_common::{datapath_stat, dsr_accept, proto, source_class};

use crate::{
    counters::stat,
    family::{Endpoint, Ipv4, Ipv6},
    family_maps::Maps,
    maps::load_time_setting,
    packet::{
        bytes_at, copy_address, field, parse_ipv6_carrying, Change, Frame, IpHeader, Packet, TCP_ACK, TCP_SYN,
    },
    wire::{
        DSR6_HDR_EXT_LEN, DSR6_HLEN, DSR6_OPTION_DATA_LEN, DSR6_OPTION_TYPE, ETH_HLEN, IPPROTO_DSTOPTS,
        IPV4_CSUM_AT, IPV4_MIN_HLEN, IPV6_HLEN,
    },
};

/// The IPv4 option's type byte: copied, control class, number 26.
pub const OPTION_TYPE: u8 = 0x9a;
/// The IPv4 option's length, type and length bytes included.
pub const OPTION_LEN: usize = 8;
/// `bpf_skb_adjust_room`: keep the skb's checksum state. The option is outside what the L4
/// checksum covers and the header checksum is updated here, so every checksum stays right.
const BPF_F_ADJ_ROOM_NO_CSUM_RESET: u64 = 1 << 5;
/// The largest IPv4 header (IHL 15).
const IPV4_MAX_HLEN: usize = 60;

/// Whether a DSR request carries the service address to the backend's node: a TCP SYN (a
/// retransmitted one too) and every datagram, whose entries there may have expired. A TCP
/// connection's later requests are plain destination rewrites.
#[inline(always)]
pub fn carries<A>(packet: &Packet<A>) -> bool {
    packet.flow.proto != proto::TCP || packet.tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN
}

/// A program context that can make room for the carrier right after the fixed IP header: TC
/// (`bpf_skb_adjust_room`) and XDP (`bpf_xdp_adjust_head`), so one [`Dsr::carry`] serves
/// both. Options or extension headers the packet already has stay behind the room.
pub trait Room: Frame {
    /// Opens `len` bytes right after the frame's first `HEADERS` bytes (Ethernet and the
    /// family's fixed IP header), which keep their content. `Err`: the packet is as it was,
    /// or (XDP, after a failed move, which its bounds make impossible) to be dropped.
    fn open_room<const HEADERS: usize>(&self, len: u32) -> Result<(), i64>;
    /// Keeps the packet's checksum state right after a header word without a header checksum
    /// (IPv6's) changed from `old` to `new` and `added_len` bytes at `added` came in.
    fn header_changed(&self, old: [u8; 4], new: [u8; 4], added: *mut u32, added_len: u32);
}

impl Room for TcContext {
    #[inline(always)]
    fn open_room<const HEADERS: usize>(&self, len: u32) -> Result<(), i64> {
        // BPF_ADJ_ROOM_NET opens the room right after the family's fixed header.
        self.adjust_room(len as i32, BPF_ADJ_ROOM_NET, BPF_F_ADJ_ROOM_NO_CSUM_RESET)
    }

    #[inline(always)]
    fn header_changed(&self, old: [u8; 4], new: [u8; 4], added: *mut u32, added_len: u32) {
        update_complete_sum(self, old, new, added, added_len);
    }
}

impl Room for XdpContext {
    /// The frame grows at its front, into the headroom every XDP frame has, and its headers
    /// move there: the room is left where they were.
    #[inline(always)]
    fn open_room<const HEADERS: usize>(&self, len: u32) -> Result<(), i64> {
        // SAFETY: the kernel checks the headroom and moves only the data pointer.
        let grown = unsafe { bpf_xdp_adjust_head(self.ctx, -(len as i32)) };
        if grown != 0 {
            return Err(grown);
        }
        // Every packet pointer is checked again after the helper.
        let from = field::<[u8; HEADERS]>(self, len as usize).ok_or(-1i64)?;
        let to = field::<[u8; HEADERS]>(self, 0).ok_or(-1i64)?;
        // SAFETY: both bounds-checked above; read whole before written, since they overlap.
        unsafe { core::ptr::write_unaligned(to, core::ptr::read_unaligned(from)) };
        Ok(())
    }

    /// An XDP frame has no checksum state beside its headers.
    #[inline(always)]
    fn header_changed(&self, _old: [u8; 4], _new: [u8; 4], _added: *mut u32, _added_len: u32) {}
}

/// The protocols whose carried service address this node takes (bits of [`dsr_accept`]),
/// written by the agent from `--lb-mode` and `--lb-dsr-accept` at load time. Read-only data:
/// the verifier knows it.
/// The object's own value takes none, as `--lb-mode=snat`.
#[unsafe(no_mangle)]
static VIPR_DSR_ACCEPT: u8 = dsr_accept::NONE;

/// Whether this node takes a service address carried by a request of `protocol`: by default
/// only where its own `--lb-mode` sends such connections by DSR. The option is not authenticated:
/// whoever sends a pod a request with it chooses the source address of the pod's replies.
#[inline(always)]
fn takes_carrier(protocol: u8) -> bool {
    let taken = load_time_setting(&VIPR_DSR_ACCEPT);
    let wanted = match protocol {
        proto::TCP => dsr_accept::TCP,
        proto::UDP => dsr_accept::UDP,
        _ => return false,
    };
    taken & wanted != 0
}

/// Whether `frontend` is a frontend of a service of `packet`'s protocol that its destination,
/// a backend on this node, serves, as the entries for carried addresses (source class
/// CARRIED) say: one keyed by the address (a load-balancer or external IP), else by the
/// unspecified address (a NodePort: the address is the ingress node's, which this node's
/// entries do not hold; the port and the backend are checked). Asked where a carried address is
/// about to be stored (tc.rs `take_carried`): an address that no service of the backend has is
/// forged, or for a backend this node's agent has not learnt yet, and stored it would give the
/// backend's replies a source of the sender's choosing.
#[inline(always)]
pub fn serves<A: Maps>(frontend: &Endpoint<A>, packet: &Packet<A>) -> bool {
    let proto = packet.flow.proto;
    let service = A::service(frontend, proto, source_class::CARRIED).or_else(|| {
        A::service(&Endpoint { addr: A::UNSPECIFIED, port: frontend.port }, proto, source_class::CARRIED)
    });
    service.is_some_and(|service| A::slot_of(service.backend_set, &packet.flow.destination()).is_some())
}

/// Where a family stands on direct server return.
pub trait Dsr: IpHeader + Maps {
    /// How many bytes carrying the service address add to a packet.
    const CARRIER_LEN: u32;
    /// Whether a packet that carries the service address needs a parser of its own
    /// ([`Dsr::parse_carrying`]) rather than [`IpHeader::parse`].
    const CARRIED_APART: bool;
    /// Parses a packet that carries the service address, where [`Dsr::CARRIED_APART`].
    fn parse_carrying(ctx: &TcContext) -> Option<Packet<Self>>;
    /// The service address and port a request carries, if it carries vipr's option and this
    /// node takes it for the request's protocol ([`takes_carrier`]); one it does not take is
    /// counted, and the request goes on as if it carried none. Whether a service has the
    /// address is asked only where it is stored ([`serves`]).
    #[inline(always)]
    fn carried(ctx: &TcContext, packet: &Packet<Self>) -> Option<Endpoint<Self>> {
        let frontend = Self::carrier(ctx, packet)?;
        if !takes_carrier(packet.flow.proto) {
            stat(datapath_stat::DSR_CARRIER_IGNORED);
            return None;
        }
        Some(frontend)
    }
    /// The service address and port in the request's option, if it has vipr's.
    fn carrier(ctx: &TcContext, packet: &Packet<Self>) -> Option<Endpoint<Self>>;
    /// Inserts the option carrying `frontend`, after the packet's rewrite (it moves the L4
    /// header, and with it every offset of a parsed packet). `Err`: drop the packet.
    fn carry(ctx: &impl Room, frontend: &Endpoint<Self>) -> Result<(), i64>;
    /// Removes the option [`Dsr::carried`] found.
    fn strip(ctx: &TcContext) -> Result<(), i64>;

    /// Whether the packet with the option added still fits `mtu` (the egress device's).
    #[inline(always)]
    fn fits_with_option(packet: &Packet<Self>, mtu: u32) -> bool {
        packet.ip_len() + Self::CARRIER_LEN <= mtu
    }

    /// [`Dsr::fits_with_option`] for the device `ifindex`, asked of the kernel
    /// (`bpf_check_mtu`): for a tracked connection's request, whose next hop may be the one
    /// cached in its flow entry, which holds the device but not its MTU.
    #[inline(always)]
    fn fits_with_option_on(ctx: &TcContext, packet: &Packet<Self>, ifindex: u32) -> bool {
        // The IP length asked for, as the FIB lookup's `tot_len`: the skb's own length would
        // count a GSO packet whole.
        let mut mtu_len = packet.ip_len();
        // SAFETY: a plain helper call; `mtu_len` lives across it.
        unsafe { bpf_check_mtu(ctx.as_ptr(), ifindex, &mut mtu_len, Self::CARRIER_LEN as i32, 0) == 0 }
    }
}

impl Dsr for Ipv4 {
    const CARRIER_LEN: u32 = OPTION_LEN as u32;
    // The parser takes any IPv4 header length, options included.
    const CARRIED_APART: bool = false;

    #[inline(always)]
    fn parse_carrying(_ctx: &TcContext) -> Option<Packet<Self>> {
        None
    }

    #[inline(always)]
    fn carrier(ctx: &TcContext, packet: &Packet<Self>) -> Option<Endpoint<Self>> {
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
    fn carry(ctx: &impl Room, frontend: &Endpoint<Self>) -> Result<(), i64> {
        let header = field::<[u8; IPV4_MIN_HLEN]>(ctx, ETH_HLEN).ok_or(-1i64)?;
        // SAFETY: bounds-checked above.
        let (first, total) = unsafe {
            let header = &*header;
            (u16::from_be_bytes([header[0], header[1]]), u16::from_be_bytes([header[2], header[3]]))
        };
        if usize::from(first >> 8 & 0x0f) * 4 + OPTION_LEN > IPV4_MAX_HLEN {
            return Err(-1);
        }
        ctx.open_room::<{ ETH_HLEN + IPV4_MIN_HLEN }>(OPTION_LEN as u32)?;
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

/// IPv6 carries the service address in a destination-options extension header of its own
/// (wire.rs: 24 bytes, one experimental option with the address and port), inserted right after
/// the fixed header. IPv6 has no header checksum, and the L4 checksum's pseudo header holds the
/// upper-layer length and protocol, which the extension header leaves as they are: only the
/// payload length and the next header change.
impl Dsr for Ipv6 {
    const CARRIER_LEN: u32 = DSR6_HLEN as u32;
    // The parser refuses extension headers, and a second offset in it would cost the verifier
    // every IPv6 path twice.
    const CARRIED_APART: bool = true;

    #[inline(always)]
    fn parse_carrying(ctx: &TcContext) -> Option<Packet<Self>> {
        parse_ipv6_carrying(ctx)
    }

    #[inline(always)]
    fn carrier(ctx: &TcContext, packet: &Packet<Self>) -> Option<Endpoint<Self>> {
        // The parser went past a destination-options header only if it was vipr's.
        if packet.l4_offset != ETH_HLEN + IPV6_HLEN + DSR6_HLEN {
            return None;
        }
        // As 32-bit words (the address is word-aligned, 44 bytes into the IP header): a byte
        // array's copy would spill to the stack byte by byte.
        let words = unsafe { *field::<[u32; 4]>(ctx, DSR6_DATA_OFF)? };
        let port = unsafe { *bytes_at::<2>(ctx, DSR6_DATA_OFF + 16)? };
        // SAFETY: four words are sixteen bytes, in the packet's order.
        let addr = unsafe { core::mem::transmute::<[u32; 4], Ipv6>(words) };
        Some(Endpoint { addr, port: u16::from_be_bytes(port) })
    }

    #[inline(always)]
    fn carry(ctx: &impl Room, frontend: &Endpoint<Self>) -> Result<(), i64> {
        let old = unsafe { *bytes_at::<4>(ctx, ETH_HLEN + IPV6_LENGTH_AT).ok_or(-1i64)? };
        let payload_len =
            u16::from_be_bytes([old[0], old[1]]).checked_add(DSR6_HLEN as u16).ok_or(-1i64)?.to_be_bytes();
        let new = [payload_len[0], payload_len[1], IPPROTO_DSTOPTS, old[3]];
        ctx.open_room::<{ ETH_HLEN + IPV6_HLEN }>(DSR6_HLEN as u32)?;
        // The room is new: every pointer is checked again.
        let header = field::<[u8; IPV6_HLEN + DSR6_HLEN]>(ctx, ETH_HLEN).ok_or(-1i64)?;
        let port = frontend.port.to_be_bytes();
        // SAFETY: bounds-checked above.
        unsafe {
            let header = &mut *header;
            header[IPV6_LENGTH_AT..IPV6_LENGTH_AT + 4].copy_from_slice(&new);
            let carrier = &mut header[IPV6_HLEN..];
            carrier[..4].copy_from_slice(&[old[2], DSR6_HDR_EXT_LEN, DSR6_OPTION_TYPE, DSR6_OPTION_DATA_LEN]);
            copy_address(&frontend.addr, carrier[4..20].as_mut_ptr().cast::<Ipv6>());
            carrier[20..].copy_from_slice(&[port[0], port[1], PAD1, PAD1]);
        }
        let carrier = field::<[u8; DSR6_HLEN]>(ctx, ETH_HLEN + IPV6_HLEN).ok_or(-1i64)?;
        ctx.header_changed(old, new, carrier.cast::<u32>(), DSR6_HLEN as u32);
        Ok(())
    }

    #[inline(always)]
    fn strip(ctx: &TcContext) -> Result<(), i64> {
        let header = field::<[u8; IPV6_HLEN + DSR6_HLEN]>(ctx, ETH_HLEN).ok_or(-1i64)?;
        // SAFETY: bounds-checked above. The header is rewritten before the carrier goes, since
        // the removal starts right after the fixed header.
        let (old, new) = unsafe {
            let header = &mut *header;
            let mut old = [0u8; 4];
            old.copy_from_slice(&header[IPV6_LENGTH_AT..IPV6_LENGTH_AT + 4]);
            // The parser saw a payload at least as long as the carrier.
            let payload_len =
                u16::from_be_bytes([old[0], old[1]]).wrapping_sub(DSR6_HLEN as u16).to_be_bytes();
            let new = [payload_len[0], payload_len[1], header[IPV6_HLEN], old[3]];
            header[IPV6_LENGTH_AT..IPV6_LENGTH_AT + 4].copy_from_slice(&new);
            (old, new)
        };
        // The kernel takes the removed bytes out of a complete sum itself.
        update_complete_sum(ctx, old, new, core::ptr::null_mut(), 0);
        ctx.adjust_room(-(DSR6_HLEN as i32), BPF_ADJ_ROOM_NET, BPF_F_ADJ_ROOM_NO_CSUM_RESET)
    }
}

/// Pad1: one byte of padding in an options header.
const PAD1: u8 = 0;
/// Where the payload length, next header and hop limit lie in the IPv6 header: the word the
/// carrier changes.
const IPV6_LENGTH_AT: usize = 4;
/// Where the carrier's option data (address, port) starts in the frame.
const DSR6_DATA_OFF: usize = ETH_HLEN + IPV6_HLEN + 4;

/// Keeps the sum of a CHECKSUM_COMPLETE skb (a NIC's checksum of the whole packet, which the
/// stack checks the L4 checksum against) right after the IPv6 header's word `old` became `new`
/// and `added_len` bytes at `added` came in: IPv6 has no header checksum whose update would
/// balance the change, as IPv4's does for its option. For skbs in any other checksum state
/// the helper does nothing and says so, which is fine.
#[inline(always)]
fn update_complete_sum(ctx: &TcContext, old: [u8; 4], new: [u8; 4], added: *mut u32, added_len: u32) {
    let (mut old, mut new) = (u32::from_ne_bytes(old), u32::from_ne_bytes(new));
    // SAFETY: four bytes each on the stack, and `added_len` bytes of packet at `added`.
    unsafe {
        let mut diff = bpf_csum_diff(&mut old, 4, &mut new, 4, 0);
        if added_len != 0 && diff >= 0 {
            diff = bpf_csum_diff(core::ptr::null_mut(), 0, added, added_len, diff as u32);
        }
        if diff >= 0 {
            bpf_csum_update(ctx.skb.skb, diff as u32);
        }
    }
}
