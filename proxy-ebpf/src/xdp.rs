//! vipr's XDP fast path: service traffic from outside the node (NodePorts, load-balancer and
//! external IPs), balanced before the kernel builds an skb.
//!
//! It reads and writes the same pinned maps and flow entries as the TC program (tc.rs), so a
//! connection balanced here continues in TC and the other way round. It only finishes what is
//! simple and safe; everything else is passed on (`XDP_PASS`) untouched, and the TC program
//! then handles it exactly as without XDP:
//!
//! - only IPv4 TCP/UDP, whole packets (no fragments, no ICMP, no SCTP, no IPv6), parsed by
//!   the parser the TC program uses (packet.rs, generic over both contexts);
//! - only sources of class OUTSIDE (not the node, not a pod): a packet generated on the node
//!   or in a pod is CHECKSUM_PARTIAL on veth, and XDP cannot see that (see below);
//! - only the client-to-backend direction (replies from backends pass to TC);
//! - a new connection only when a backend is chosen and no drop or reject is due (TC answers
//!   those), not for a hairpin, and with `MASQUERADE` only when a masquerade port is claimed;
//! - only when the FIB has a complete route *with* its neighbour (MACs), and the egress is the
//!   ingress device (`XDP_TX`) or a device vipr attached XDP to (`XDP_REDIRECT` through the
//!   `vipr_xdptx` device map, whose targets can transmit XDP frames).
//!
//! Checksums are updated by hand (RFC 1624): the IPv4 header checksum and the TCP/UDP checksum
//! with the pseudo header. That is right only for packets whose checksums are complete, which
//! is what a NIC delivers; a locally generated veth packet's L4 checksum field holds only the
//! pseudo-header seed (CHECKSUM_PARTIAL), which XDP cannot tell apart and an incremental update
//! corrupts. Hence the OUTSIDE-only rule, and by default XDP only on hardware-backed devices,
//! whose packets come from the wire (docs/architecture/xdp.md).
use core::mem::MaybeUninit;

use aya_ebpf::{
    bindings::{bpf_fib_lookup, xdp_action, BPF_FIB_LKUP_RET_SUCCESS, BPF_FIB_LOOKUP_SRC},
    helpers::bpf_fib_lookup as fib_lookup,
    macros::{map, xdp},
    maps::DevMapHash,
    programs::XdpContext,
    EbpfContext as _,
};
use proxy_common::{flow_flags, proto, service_flags, source_class};

use crate::{
    conntrack::{observe, track, track_masqueraded, Refusal},
    counters,
    family::{Address, Ipv4, Nat},
    family_maps::Maps,
    lb::{classify, decide, Chosen, Decision, Pick},
    packet::{ethertype, field, Change, IpHeader as _, Packet, ETH_P_IP},
    route::zeroed_fib_params,
    wire::{ETH_HLEN, IPV4_MIN_HLEN, TCP_CSUM_AT, UDP_CSUM_AT},
};

// The attribute below needs a literal; this keeps it the name the agent looks the map up by.
const _: () = assert!(crate::maps::same_name("vipr_xdptx", proxy_common::pins::XDP_TX_DEVICES));

/// The devices XDP may redirect to: those vipr attached its XDP program to (the agent fills
/// it, ifindex -> ifindex). A driver transmits redirected frames only where it is set up for
/// XDP; any other egress is left to TC.
#[map(name = "vipr_xdptx")]
static XDP_TX_DEVICES: DevMapHash = DevMapHash::with_max_entries(1024, 0);

#[xdp]
pub fn vipr_xdp(ctx: XdpContext) -> u32 {
    match fast_path(&ctx) {
        Some(action) => action,
        None => xdp_action::XDP_PASS,
    }
}

/// A whole IPv4 TCP/UDP packet, parsed by the parser TC uses (packet.rs), and its IPv4 total
/// length for the FIB's MTU check. First fragments and SCTP are TC's.
#[inline(always)]
fn parse(ctx: &XdpContext) -> Option<(Packet<Ipv4>, u16)> {
    if ethertype(ctx)? != ETH_P_IP {
        return None;
    }
    let packet = Ipv4::parse(ctx)?;
    if packet.first_fragment.is_some() || !matches!(packet.flow.proto, proto::TCP | proto::UDP) {
        return None;
    }
    // The IP header and the payload it says it has.
    let tot_len = (packet.l4_offset - ETH_HLEN) as u32 + packet.l4_len;
    Some((packet, tot_len as u16))
}

/// Where a finished packet goes: its next hop's MACs and the action that sends it there.
struct Egress {
    action: u32,
    ifindex: u32,
    smac: [u8; 6],
    dmac: [u8; 6],
    /// The route's preferred source, the address a masqueraded connection takes.
    source: Ipv4,
}

/// `None` (pass to TC) unless the FIB forwards `destination` with a resolved neighbour out of
/// a device XDP can send on.
#[inline(always)]
fn egress(ctx: &XdpContext, destination: Ipv4, tot_len: u16) -> Option<Egress> {
    let mut params = MaybeUninit::<bpf_fib_lookup>::uninit();
    let params = zeroed_fib_params(&mut params);
    let ingress = unsafe { (*ctx.ctx).ingress_ifindex };
    params.ifindex = ingress;
    // With the length the lookup checks the egress MTU: a packet too big passes to the stack.
    params.__bindgen_anon_1.tot_len = tot_len;
    Ipv4::fib_destination(params, destination);
    let result =
        unsafe { fib_lookup(ctx.as_ptr(), params, size_of::<bpf_fib_lookup>() as i32, BPF_FIB_LOOKUP_SRC) };
    if result != BPF_FIB_LKUP_RET_SUCCESS as i64 {
        return None;
    }
    let action = if params.ifindex == ingress {
        xdp_action::XDP_TX
    } else if XDP_TX_DEVICES.get_ifindex(params.ifindex).is_some() {
        xdp_action::XDP_REDIRECT
    } else {
        return None;
    };
    Some(Egress {
        action,
        ifindex: params.ifindex,
        smac: params.smac,
        dmac: params.dmac,
        source: Ipv4::fib_source(params),
    })
}

#[inline(always)]
fn fast_path(ctx: &XdpContext) -> Option<u32> {
    let (packet, tot_len) = parse(ctx)?;
    // Only traffic from outside carries complete checksums (see the module's documentation).
    // The interface index fits in 32 bits (the kernel's own type for it).
    if classify(&packet.flow.src, ctx.ingress_ifindex() as u32) != source_class::OUTSIDE {
        return None;
    }
    if let Some(tracked) = Ipv4::flow(&packet.flow) {
        let flow = tracked.nat;
        // Replies, and direct server return's requests (their option is TC's), pass to TC.
        if flow.flags & (flow_flags::REPLY | flow_flags::DSR_INGRESS | flow_flags::DSR_BACKEND) != 0 {
            return None;
        }
        let destination =
            if flow.flags & flow_flags::REWRITE_DESTINATION != 0 { flow.dst } else { packet.flow.dst };
        let out = egress(ctx, destination, tot_len)?;
        observe(&packet.flow, &tracked, packet.tcp_flags);
        count(ctx, flow.counter);
        return finish(ctx, &packet, &flow, &out);
    }
    let Decision::Backend(Chosen { service, backend, counter, now }) =
        decide(&packet.flow, source_class::OUTSIDE, &packet.flow.src, Pick::Flow(&packet.flow))
    else {
        // Unmatched destinations, source-range drops and empty services are TC's (it answers
        // with ICMP errors), and so is a set retired meanwhile.
        return None;
    };
    // A hairpin, and a DSR frontend's connections (TC carries the option), are TC's.
    if backend.addr.is(&packet.flow.src) || service.flags & service_flags::DSR != 0 {
        return None;
    }
    let out = egress(ctx, backend.addr, tot_len)?;
    let forward = if service.flags & service_flags::MASQUERADE != 0 {
        track_masqueraded(&packet, &backend, counter, out.source, now, false)
    } else {
        track(&packet, &backend, counter, now, false)
    };
    let forward = match forward {
        Ok(forward) => forward,
        // A full flows map: TC makes room (early drop) or refuses.
        Err(Refusal::MapFull) => return None,
        // Counted by the tracking; TC would drop it the same way.
        Err(_) => return Some(xdp_action::XDP_DROP),
    };
    count(ctx, counter);
    finish(ctx, &packet, &forward, &out)
}

/// Rewrites the packet as `flow` says, with its new MACs, and sends it.
#[inline(always)]
fn finish(ctx: &XdpContext, packet: &Packet<Ipv4>, flow: &Nat<Ipv4>, out: &Egress) -> Option<u32> {
    let l4 = packet.l4_offset;
    let old = &packet.flow;
    let (mut src, mut src_port, mut dst, mut dst_port) = (old.src, old.src_port, old.dst, old.dst_port);
    if flow.flags & flow_flags::REWRITE_DESTINATION != 0 {
        (dst, dst_port) = (flow.dst, flow.dst_port);
    }
    if flow.flags & flow_flags::REWRITE_SOURCE != 0 {
        (src, src_port) = (flow.src, flow.src_port);
    }
    let addresses = Change::NONE
        .replace(old.src.word_sum(), src.word_sum())
        .and(Change::NONE.replace(old.dst.word_sum(), dst.word_sum()));
    let ports =
        Change::NONE.replace(old.src_port, src_port).and(Change::NONE.replace(old.dst_port, dst_port));
    let ip = field::<[u8; IPV4_MIN_HLEN]>(ctx, ETH_HLEN)?;
    let csum_off = l4 + if old.proto == proto::TCP { TCP_CSUM_AT } else { UDP_CSUM_AT };
    let l4_csum = field::<[u8; 2]>(ctx, csum_off)?;
    let l4_ports = field::<[u8; 4]>(ctx, l4)?;
    let eth = field::<[u8; 12]>(ctx, 0)?;
    // SAFETY: every pointer was bounds-checked against the packet above.
    unsafe {
        let ip = &mut *ip;
        let ip_csum = u16::from_be_bytes([ip[10], ip[11]]);
        ip[10..12].copy_from_slice(&addresses.apply(ip_csum).to_be_bytes());
        ip[12..16].copy_from_slice(&src);
        ip[16..20].copy_from_slice(&dst);
        let csum = u16::from_be_bytes(*l4_csum);
        // A UDP checksum of 0 means none and stays 0; a computed 0 is sent as 0xffff.
        if old.proto == proto::TCP || csum != 0 {
            let mut updated = addresses.and(ports).apply(csum);
            if old.proto == proto::UDP && updated == 0 {
                updated = 0xffff;
            }
            *l4_csum = updated.to_be_bytes();
        }
        let mut new_ports = [0u8; 4];
        new_ports[..2].copy_from_slice(&src_port.to_be_bytes());
        new_ports[2..].copy_from_slice(&dst_port.to_be_bytes());
        *l4_ports = new_ports;
        let eth = &mut *eth;
        eth[..6].copy_from_slice(&out.dmac);
        eth[6..].copy_from_slice(&out.smac);
    }
    if out.action == xdp_action::XDP_TX {
        return Some(xdp_action::XDP_TX);
    }
    // `XDP_PASS` if the device left the map meanwhile: the rewritten packet then goes through
    // the stack's forwarding like any routed packet.
    Some(match XDP_TX_DEVICES.redirect(out.ifindex, u64::from(xdp_action::XDP_PASS)) {
        Ok(action) | Err(action) => action,
    })
}

/// Counts the packet for its connection, by its IP length, as TC counts.
#[inline(always)]
fn count(ctx: &XdpContext, counter: u32) {
    counters::count(counter, (ctx.data_end() - ctx.data()).saturating_sub(ETH_HLEN) as u64);
}
