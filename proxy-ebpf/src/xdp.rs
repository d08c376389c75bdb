//! vipr's XDP fast path: service traffic from outside the node (NodePorts, load-balancer and
//! external IPs), balanced before the kernel builds an skb.
//!
//! It reads and writes the same pinned maps and flow entries as the TC program (tc.rs), so a
//! connection balanced here continues in TC and the other way round. It only finishes what is
//! simple and safe; everything else is passed on (`XDP_PASS`) untouched, and the TC program
//! then handles it exactly as without XDP:
//!
//! - only TCP/UDP over IPv4 or IPv6, whole packets (no fragments, no ICMP, no SCTP, no IPv6
//!   extension headers), parsed by the parser the TC program uses (packet.rs, generic over
//!   both contexts and both families);
//! - only sources of class OUTSIDE (not the node, not a pod): a packet generated on the node
//!   or in a pod is CHECKSUM_PARTIAL on veth, and XDP cannot see that (see below);
//! - only the client-to-backend direction (replies from backends pass to TC);
//! - a new connection only when a backend is chosen and no drop or reject is due (TC answers
//!   those), not for a hairpin, and with `MASQUERADE` only when a masquerade port is claimed;
//! - only when the FIB has a complete route *with* its neighbour (MACs), and the egress is the
//!   ingress device (`XDP_TX`) or a device vipr attached XDP to (`XDP_REDIRECT` through the
//!   `vipr_xdptx` device map, whose targets can transmit XDP frames).
//!
//! Both families take the same steps, written once over [`Address`]: the flow entries, the
//! service decision and the FIB lookup are the family's, and only the header rewrite differs
//! (IPv4 has a header checksum, IPv6 none).
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
    family::{Address, Ipv4, Ipv6, Nat},
    family_maps::Maps,
    lb::{classify, decide, Chosen, Decision, Pick},
    packet::{copy_address, ethertype, field, Change, IpHeader, Packet, ETH_P_IP, ETH_P_IPV6},
    route::zeroed_fib_params,
    wire::{ETH_HLEN, IPV4_CSUM_AT, TCP_CSUM_AT, UDP_CSUM_AT},
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
    match ethertype(&ctx) {
        Some(ETH_P_IP) => fast_path::<Ipv4>(&ctx),
        Some(ETH_P_IPV6) => fast_path::<Ipv6>(&ctx),
        _ => xdp_action::XDP_PASS,
    }
}

/// What [`established`] did with a packet.
enum Outcome {
    /// Finished: the XDP action.
    Done(u32),
    /// Left to TC.
    Pass,
    /// No flow entry: a new connection's first packet.
    New,
}

/// A family's path, in steps that are BPF functions of their own: the verifier allows 512
/// bytes of stack along a chain of calls, and IPv6's addresses, the FIB lookup's parameters and
/// the new flow entries inlined into one frame pass that. The new-connection step parses the
/// packet again (bounds checks do not cross a call), as TC's `balance_new` does.
#[inline(always)]
fn fast_path<A: Maps + IpHeader>(ctx: &XdpContext) -> u32 {
    match established::<A>(ctx) {
        Outcome::Done(action) => action,
        Outcome::Pass => xdp_action::XDP_PASS,
        Outcome::New => new_connection::<A>(ctx).unwrap_or(xdp_action::XDP_PASS),
    }
}

/// A whole TCP/UDP packet of family `A` (its ethertype checked), parsed by the parser TC uses
/// (packet.rs), and its IP length (header and payload) for the FIB's MTU check. First
/// fragments and SCTP are TC's; the IPv6 parser already refuses extension headers.
#[inline(always)]
fn parse<A: IpHeader>(ctx: &XdpContext) -> Option<(Packet<A>, u16)> {
    let packet = A::parse(ctx)?;
    if packet.first_fragment.is_some() || !matches!(packet.flow.proto, proto::TCP | proto::UDP) {
        return None;
    }
    // The IP header and the payload it says it has.
    let tot_len = (packet.l4_offset - ETH_HLEN) as u32 + packet.l4_len;
    Some((packet, u16::try_from(tot_len).ok()?))
}

/// Where a finished packet goes: its next hop's MACs and the action that sends it there.
struct Egress<A> {
    action: u32,
    ifindex: u32,
    smac: [u8; 6],
    dmac: [u8; 6],
    /// The route's preferred source, the address a masqueraded connection takes.
    source: A,
}

/// `None` (pass to TC) unless the FIB forwards `destination` with a resolved neighbour out of
/// a device XDP can send on.
#[inline(never)]
fn egress<A: Address>(ctx: &XdpContext, destination: A, tot_len: u16) -> Option<Egress<A>> {
    let mut params = MaybeUninit::<bpf_fib_lookup>::uninit();
    let params = zeroed_fib_params(&mut params);
    let ingress = unsafe { (*ctx.ctx).ingress_ifindex };
    params.ifindex = ingress;
    // With the length the lookup checks the egress MTU: a packet too big passes to the stack.
    params.__bindgen_anon_1.tot_len = tot_len;
    A::fib_destination(params, destination);
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
        source: A::fib_source(params),
    })
}

/// A packet from outside of a connection with a flow entry is finished here.
#[inline(never)]
fn established<A: Maps + IpHeader>(ctx: &XdpContext) -> Outcome {
    let Some((packet, tot_len)) = parse::<A>(ctx) else {
        return Outcome::Pass;
    };
    // Only traffic from outside carries complete checksums (see the module's documentation).
    // The interface index fits in 32 bits (the kernel's own type for it).
    if classify(&packet.flow.src, ctx.ingress_ifindex() as u32) != source_class::OUTSIDE {
        return Outcome::Pass;
    }
    let Some(tracked) = A::flow(&packet.flow) else {
        return Outcome::New;
    };
    let flow = tracked.nat;
    // Replies, and direct server return's requests (their option is TC's), pass to TC.
    if flow.flags & (flow_flags::REPLY | flow_flags::DSR_INGRESS | flow_flags::DSR_BACKEND) != 0 {
        return Outcome::Pass;
    }
    let destination =
        if flow.flags & flow_flags::REWRITE_DESTINATION != 0 { flow.dst } else { packet.flow.dst };
    let Some(out) = egress(ctx, destination, tot_len) else {
        return Outcome::Pass;
    };
    observe(&packet.flow, &tracked, packet.tcp_flags);
    count(ctx, flow.counter);
    match finish(ctx, &packet, &flow, &out) {
        Some(action) => Outcome::Done(action),
        None => Outcome::Pass,
    }
}

/// The first packet of a connection from outside (its source class checked by
/// [`established`]): the service decision, the flow entries and the rewrite.
#[inline(never)]
fn new_connection<A: Maps + IpHeader>(ctx: &XdpContext) -> Option<u32> {
    let (packet, tot_len) = parse::<A>(ctx)?;
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
#[inline(never)]
fn finish<A: Address>(ctx: &XdpContext, packet: &Packet<A>, flow: &Nat<A>, out: &Egress<A>) -> Option<u32> {
    let l4 = packet.l4_offset;
    let old = &packet.flow;
    let rewrite_source = flow.flags & flow_flags::REWRITE_SOURCE != 0;
    let rewrite_destination = flow.flags & flow_flags::REWRITE_DESTINATION != 0;
    // The new addresses are read where they lie (the flow entry): IPv6's 16-byte copies on
    // this function's stack would count against the verifier's 512 bytes of call chain.
    let (mut addresses, mut ports) = (Change::NONE, Change::NONE);
    if rewrite_source {
        addresses = addresses.and(Change::NONE.replace(old.src.word_sum(), flow.src.word_sum()));
        ports = ports.and(Change::NONE.replace(old.src_port, flow.src_port));
    }
    if rewrite_destination {
        addresses = addresses.and(Change::NONE.replace(old.dst.word_sum(), flow.dst.word_sum()));
        ports = ports.and(Change::NONE.replace(old.dst_port, flow.dst_port));
    }
    let header_csum = field::<[u8; 2]>(ctx, ETH_HLEN + IPV4_CSUM_AT)?;
    let saddr = field::<A>(ctx, A::SADDR_OFF)?;
    let daddr = field::<A>(ctx, A::DADDR_OFF)?;
    let csum_off = l4 + if old.proto == proto::TCP { TCP_CSUM_AT } else { UDP_CSUM_AT };
    let l4_csum = field::<[u8; 2]>(ctx, csum_off)?;
    let l4_ports = field::<[[u8; 2]; 2]>(ctx, l4)?;
    let eth = field::<[u8; 12]>(ctx, 0)?;
    // SAFETY: every pointer was bounds-checked against the packet above.
    unsafe {
        // Only IPv4's header has a checksum; the same bytes of an IPv6 header are its payload
        // length, which stays.
        if A::IP_HEADER_CHECKSUM {
            *header_csum = addresses.apply(u16::from_be_bytes(*header_csum)).to_be_bytes();
        }
        if rewrite_source {
            copy_address(&flow.src, saddr);
            (*l4_ports)[0] = flow.src_port.to_be_bytes();
        }
        if rewrite_destination {
            copy_address(&flow.dst, daddr);
            (*l4_ports)[1] = flow.dst_port.to_be_bytes();
        }
        let csum = u16::from_be_bytes(*l4_csum);
        // A UDP checksum of 0 means none (IPv4 only: the IPv6 parser refuses it) and stays 0;
        // a computed 0 is sent as 0xffff.
        if old.proto == proto::TCP || csum != 0 {
            let mut updated = addresses.and(ports).apply(csum);
            if old.proto == proto::UDP && updated == 0 {
                updated = 0xffff;
            }
            *l4_csum = updated.to_be_bytes();
        }
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
