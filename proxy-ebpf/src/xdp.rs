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
//!   or in a pod is CHECKSUM_PARTIAL on veth, and XDP cannot see that (see below). A new
//!   connection's source is classified; a tracked one's entry says what it was
//!   (`flow_flags::FROM_OUTSIDE`, set when it was balanced, by TC or here);
//! - only the client-to-backend direction (replies from backends pass to TC);
//! - a new connection only when a backend is chosen and no drop or reject is due (TC answers
//!   those), not for a hairpin, and with `MASQUERADE` only when a masquerade port is claimed;
//! - direct server return's requests on the ingress node (`--lb-mode=dsr|hybrid`): a new
//!   connection to a pod on another node, and a tracked one's later requests, with the
//!   service address carried (dsr.rs) where TC would carry it; the frame grows at its front
//!   for the carrier. When the carrier would not fit the egress MTU the request passes to TC,
//!   which sends it masqueraded or without the carrier and counts that. On the backend's node
//!   the carried requests are TC's (it removes the carrier on the way to the pod);
//! - only when the FIB has a complete route *with* its neighbour (MACs), and the egress is the
//!   ingress device (`XDP_TX`) or a device vipr attached XDP to (`XDP_REDIRECT` through the
//!   `vipr_xdptx` device map, whose targets can transmit XDP frames). A tracked connection's
//!   packets take the hop cached in its flow entry instead, while the route generation it was
//!   cached under holds (route.rs), with the device's MTU checked per packet; a hop whose
//!   route's MTU is below its device's is not cached, and every packet asks the FIB.
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
    helpers::{bpf_check_mtu, bpf_fib_lookup as fib_lookup},
    macros::{map, xdp},
    maps::{DevMapHash, PerCpuArray},
    programs::XdpContext,
    EbpfContext as _,
};
use proxy_common::{datapath_stat, flow_flags, proto, service_flags, source_class, NextHop};

use crate::{
    conntrack::{observe, track, track_dsr, track_masqueraded, Refusal},
    counters::{self, stat},
    dsr::{self, Dsr},
    family::{Address, Ipv4, Ipv6, Nat, Tracked},
    family_maps::Maps,
    lb::{classify, decide, Chosen, Decision, PacketDecision},
    packet::{copy_address, ethertype, field, Change, IpHeader, Packet, ETH_P_IP, ETH_P_IPV6},
    route::{cache_hop, cacheable_mtus, cached_hop, route_generation, zeroed_fib_params},
    wire::{ETH_HLEN, IPV4_CSUM_AT, TCP_CSUM_AT, UDP_CSUM_AT},
};

// The attribute below needs a literal; this keeps it the name the agent looks the map up by.
const _: () = assert!(crate::maps::same_name("vipr_xdptx", proxy_common::pins::XDP_TX_DEVICES));

/// The devices XDP may redirect to: those vipr attached its XDP program to (the agent fills
/// it, ifindex -> ifindex). A driver transmits redirected frames only where it is set up for
/// XDP; any other egress is left to TC.
#[map(name = "vipr_xdptx")]
static XDP_TX_DEVICES: DevMapHash = DevMapHash::with_max_entries(1024, 0);

/// A FIB lookup's parameters and the destination it asked for (the lookup overwrites it with
/// the gateway, if any), one set per CPU: an XDP program runs to its end on one CPU, and
/// [`egress`] fills them anew each time. In [`egress`]'s frame they would push IPv6's
/// new-connection chain of calls past BPF's 512 bytes of stack. Not pinned: nothing outlives
/// a lookup.
#[repr(C)]
struct FibScratch {
    params: bpf_fib_lookup,
    /// The lookup's destination field as it was asked, in the field's own words.
    asked: [u32; 4],
    /// The egress device's MTU, as `bpf_check_mtu` writes it (here, not in [`egress`]'s
    /// frame, for the same reason).
    device_mtu: u32,
}

#[map(name = "vipr_xdpfib")]
static FIB_SCRATCH: PerCpuArray<FibScratch> = PerCpuArray::with_max_entries(1, 0);

#[xdp]
pub fn vipr_xdp(ctx: XdpContext) -> u32 {
    match ethertype(&ctx) {
        Some(ETH_P_IP) => fast_path::<Ipv4>(&ctx),
        Some(ETH_P_IPV6) => fast_path::<Ipv6>(&ctx),
        _ => XDP_PASS,
    }
}

/// [`established`]'s answer for a packet without a flow entry: a new connection's first. The
/// steps answer in plain `u32`s, `XDP_PASS` for "left to TC": an enum can come back through the
/// caller's stack with the stack pointer left in R0, which the verifier refuses.
const NEW_CONNECTION: u32 = u32::MAX - 1;
const XDP_PASS: u32 = xdp_action::XDP_PASS;

/// A family's path, in steps that are BPF functions of their own: the verifier allows 512
/// bytes of stack along a chain of calls, and IPv6's addresses, the FIB lookup's parameters and
/// the new flow entries inlined into one frame pass that. The new-connection step parses the
/// packet again (bounds checks do not cross a call), as TC's `balance_new` does.
#[inline(always)]
fn fast_path<A: Maps + Dsr>(ctx: &XdpContext) -> u32 {
    match established::<A>(ctx) {
        NEW_CONNECTION => new_connection::<A>(ctx),
        action => action,
    }
}

/// A whole TCP/UDP packet of family `A` (its ethertype checked), parsed by the parser TC uses
/// (packet.rs), and its IP length (header and payload) for the FIB's MTU check. First
/// fragments and SCTP are TC's; the IPv6 parser already refuses extension headers.
#[inline(always)]
fn parse<A: IpHeader>(ctx: &XdpContext) -> Option<(Packet<A>, u32)> {
    let packet = A::parse(ctx)?;
    if packet.first_fragment.is_some() || !matches!(packet.flow.proto, proto::TCP | proto::UDP) {
        return None;
    }
    // The IP header and the payload it says it has.
    let tot_len = (packet.l4_offset - ETH_HLEN) as u32 + packet.l4_len;
    Some((packet, tot_len))
}

/// Where a finished packet goes: its next hop (device and MACs, as a flow entry caches it) and
/// the action that sends it there.
#[derive(Clone, Copy)]
struct Hop {
    action: u32,
    next: NextHop,
}

/// What a FIB lookup says of a destination: the hop, and what a new connection needs besides.
struct Egress<A> {
    hop: Hop,
    /// The route's preferred source, the address a masqueraded connection takes.
    source: A,
    /// Whether the next hop is a gateway rather than the destination itself (non-zero). Not a
    /// `bool`: `Option<Egress>` would keep its discriminant in the bool's spare values, a
    /// layout BTF cannot describe (the kernel then refuses the object's BTF).
    via_gateway: u8,
    /// Whether a flow entry may cache the hop (non-zero): the route's MTU is at least its
    /// device's (asked only by a lookup for a hop to cache). A cached hop is checked against the device's MTU alone, so the packets over a
    /// route with a smaller one (a locked route MTU, or a path MTU the kernel learned from an
    /// ICMP error before the lookup) ask the FIB every time, which checks the route's, as the
    /// kernel's forwarding does.
    cacheable: u8,
}

/// Where `destination` goes: `false` (pass to TC) unless the FIB forwards it with a resolved
/// neighbour out of a device XDP can send on, with room for `tot_len` bytes of IP packet; else
/// `true` with `out` written. An out-parameter, not an `Option`: a returned struct comes back
/// through the caller's stack, and the verifier refuses the stack pointer LLVM then may leave
/// in R0. `CACHING`: the hop is for a flow entry to cache ([`Egress::cacheable`] is asked).
#[inline(never)]
fn egress<A: Address, const CACHING: bool>(
    ctx: &XdpContext,
    destination: A,
    tot_len: u32,
    out: &mut MaybeUninit<Egress<A>>,
) -> bool {
    look_up_egress::<A, CACHING>(ctx, destination, tot_len).map(|found| out.write(found)).is_some()
}

/// [`egress`]'s lookup, inlined into it.
#[inline(always)]
fn look_up_egress<A: Address, const CACHING: bool>(
    ctx: &XdpContext,
    destination: A,
    tot_len: u32,
) -> Option<Egress<A>> {
    // SAFETY: this CPU's element, which nothing else uses while this program runs.
    let scratch = unsafe { &mut *FIB_SCRATCH.get_ptr_mut(0)? };
    // SAFETY: a `MaybeUninit` of the same layout, zeroed here before every lookup.
    let params = zeroed_fib_params(unsafe {
        &mut *core::ptr::from_mut(&mut scratch.params).cast::<MaybeUninit<bpf_fib_lookup>>()
    });
    let ingress = unsafe { (*ctx.ctx).ingress_ifindex };
    params.ifindex = ingress;
    // With the length the lookup checks the egress MTU: a packet too big passes to the stack.
    params.__bindgen_anon_1.tot_len = u16::try_from(tot_len).ok()?;
    A::fib_destination(params, destination);
    // SAFETY: all 16 bytes of the field, as set (or zeroed) above.
    scratch.asked = unsafe { params.__bindgen_anon_4.ipv6_dst };
    let result =
        unsafe { fib_lookup(ctx.as_ptr(), params, size_of::<bpf_fib_lookup>() as i32, BPF_FIB_LOOKUP_SRC) };
    if result != BPF_FIB_LKUP_RET_SUCCESS as i64 {
        return None;
    }
    let action = sending_action(ingress, params.ifindex)?;
    // Only a hop to cache needs the device's MTU beside the route's (a new connection's is
    // not cached: no cost there).
    let cacheable = CACHING && {
        // SAFETY: an XDP lookup always checks the MTU, and a successful one reports the route's.
        let route_mtu = u32::from(unsafe { params.__bindgen_anon_1.mtu_result });
        // Any non-zero length: only the device's MTU, written back, is wanted.
        scratch.device_mtu = 1;
        // SAFETY: a plain helper call; the field lives across it.
        let known =
            unsafe { bpf_check_mtu(ctx.as_ptr(), params.ifindex, &mut scratch.device_mtu, 0, 0) } >= 0;
        known && cacheable_mtus(route_mtu, scratch.device_mtu)
    };
    Some(Egress {
        hop: Hop {
            action,
            next: NextHop { ifindex: params.ifindex, dst_mac: params.dmac, src_mac: params.smac },
        },
        source: A::fib_source(params),
        // The field changes (to the gateway, of either family) only for a route via one.
        via_gateway: u8::from(unsafe { params.__bindgen_anon_4.ipv6_dst } != scratch.asked),
        cacheable: u8::from(cacheable),
    })
}

/// The action that sends a frame received on `ingress` out of `egress`: `XDP_TX` back out of
/// the same device, `XDP_REDIRECT` to a device vipr attached XDP to; `None` for any other.
#[inline(always)]
fn sending_action(ingress: u32, egress: u32) -> Option<u32> {
    if egress == ingress {
        Some(xdp_action::XDP_TX)
    } else if XDP_TX_DEVICES.get_ifindex(egress).is_some() {
        Some(xdp_action::XDP_REDIRECT)
    } else {
        None
    }
}

/// The hop cached in a tracked connection's flow entry (route.rs), if it was cached under the
/// current route `generation` with its neighbour's MAC (TC with `--bpf-forwarding=stack`
/// caches the interface alone), XDP can send out of its device, and `tot_len` bytes of IP
/// packet fit that device's MTU, checked on every packet (`bpf_check_mtu`, cheap beside a FIB
/// lookup): a change of the device's MTU applies at once. A hop whose route has a smaller MTU
/// than its device is never cached ([`Egress::cacheable`]).
#[inline(always)]
fn cached_egress<A: Maps>(
    ctx: &XdpContext,
    tracked: &Tracked<A>,
    generation: u32,
    tot_len: u32,
    out: &mut MaybeUninit<Hop>,
) -> bool {
    let Some(cached) = cached_hop(tracked, generation) else {
        return false;
    };
    if cached.dst_mac == [0; 6] {
        return false;
    }
    let Some(action) = sending_action(ctx.ingress_ifindex() as u32, cached.ifindex) else {
        return false;
    };
    let mut mtu_len = tot_len;
    // SAFETY: a plain helper call; `mtu_len` lives across it.
    if unsafe { bpf_check_mtu(ctx.as_ptr(), cached.ifindex, &mut mtu_len, 0, 0) } != 0 {
        return false;
    }
    out.write(Hop { action, next: cached });
    true
}

/// A packet from outside of a connection with a flow entry is finished here, toward the next
/// hop cached in the entry, else the FIB's (then cached for the next packets).
#[inline(never)]
fn established<A: Maps + Dsr>(ctx: &XdpContext) -> u32 {
    let Some((packet, tot_len)) = parse::<A>(ctx) else {
        return XDP_PASS;
    };
    // Only traffic from outside carries complete checksums (see the module's documentation).
    let Some(tracked) = A::flow(&packet.flow) else {
        // The interface index fits in 32 bits (the kernel's own type for it).
        if classify(&packet.flow.src, ctx.ingress_ifindex() as u32) != source_class::OUTSIDE {
            return XDP_PASS;
        }
        return NEW_CONNECTION;
    };
    let flow = tracked.nat;
    // A tracked connection's source was classified when it was balanced: an entry of a client
    // from outside says so, and its packets need no classifying again. Replies, and the
    // requests that reach a DSR backend's node (the carrier is removed there), pass to TC, and
    // so does everything a pod or the node sent.
    let ours = flow_flags::REPLY | flow_flags::DSR_BACKEND | flow_flags::FROM_OUTSIDE;
    if flow.flags & ours != flow_flags::FROM_OUTSIDE {
        return XDP_PASS;
    }
    // A DSR request carries the service address again where the backend's node may need it.
    let carrying = flow.flags & flow_flags::DSR_INGRESS != 0 && dsr::carries(&packet);
    let tot_len = tot_len + if carrying { A::CARRIER_LEN } else { 0 };
    let generation = route_generation();
    let mut hop = MaybeUninit::uninit();
    if !cached_egress(ctx, &tracked, generation, tot_len, &mut hop) {
        let mut out = MaybeUninit::uninit();
        if !egress::<A, true>(ctx, flow.destination(packet.flow.dst), tot_len, &mut out) {
            return XDP_PASS;
        }
        // SAFETY: written by `egress`, which said so.
        let found = unsafe { out.assume_init_ref() };
        if generation != 0 && found.cacheable != 0 {
            cache_hop(&tracked, found.hop.next, generation);
        }
        hop.write(found.hop);
    }
    // SAFETY: written by `cached_egress` or above.
    let hop = unsafe { hop.assume_init_ref() };
    observe(&packet.flow, &tracked, packet.tcp_flags);
    count(ctx, flow.counter);
    if carrying {
        finish_carrying(ctx, &packet, &flow, hop)
    } else {
        finish(ctx, &packet, &flow, hop)
    }
}

/// The first packet of a connection from outside (its source class checked by
/// [`established`]): the service decision, the flow entries and the rewrite.
#[inline(never)]
fn new_connection<A: Maps + Dsr>(ctx: &XdpContext) -> u32 {
    let Some((packet, tot_len)) = parse::<A>(ctx) else {
        return XDP_PASS;
    };
    let PacketDecision::Decided(Decision::Backend(chosen)) =
        decide(&packet.flow, packet.tcp_flags, source_class::OUTSIDE)
    else {
        // Unmatched destinations, source-range drops and empty services are TC's (it answers
        // with ICMP errors), and so is a set retired meanwhile, and a packet held while an
        // upgrade switches maps (TC counts it).
        return XDP_PASS;
    };
    // A hairpin is TC's.
    if chosen.backend.addr.is(&packet.flow.src) {
        return XDP_PASS;
    }
    // A DSR frontend's route is asked for room for the carrier too: a request without it passes
    // to TC, which masquerades it (counted). Its backends on this node's link (no carrier) pass
    // too when fewer than the carrier's bytes short of the MTU: TC serves them the same way.
    let dsr = chosen.service.flags & service_flags::DSR != 0;
    let mut out = MaybeUninit::uninit();
    if !egress::<A, false>(ctx, chosen.backend.addr, tot_len + if dsr { A::CARRIER_LEN } else { 0 }, &mut out)
    {
        return XDP_PASS;
    }
    // SAFETY: written by `egress`, which said so.
    let out = unsafe { out.assume_init_ref() };
    if dsr && out.via_gateway != 0 {
        let action = dsr_connection(ctx, &packet, &chosen, out);
        if action != NOT_DSR {
            return action;
        }
    }
    connection(ctx, &packet, &chosen, out)
}

/// A new connection tracked (its two entries, masqueraded as its service says) and its first
/// packet sent. Inlined, as [`dsr_connection`] is.
#[inline(always)]
fn connection<A: Maps + Dsr>(
    ctx: &XdpContext,
    packet: &Packet<A>,
    chosen: &Chosen<A>,
    out: &Egress<A>,
) -> u32 {
    let Chosen { service, backend, counter, now } = chosen;
    let forward = if service.flags & service_flags::MASQUERADE != 0 {
        track_masqueraded(packet, backend, *counter, source_class::OUTSIDE, out.source, *now, false)
    } else {
        track(packet, backend, *counter, source_class::OUTSIDE, *now, false)
    };
    let forward = match forward {
        Ok(forward) => forward,
        Err(refusal) => return refused(refusal),
    };
    count(ctx, *counter);
    finish(ctx, packet, &forward, &out.hop)
}

/// [`dsr_connection`]'s answer for a backend that takes no direct server return.
const NOT_DSR: u32 = u32::MAX;

/// A new connection of a DSR frontend whose backend is reached through a gateway: to a pod
/// (the cluster CIDRs), that is behind another node, as TC's `remote` decides, its forward
/// entry only (the replies never come back here), and its first packet sent with the service
/// address carried; to any other address [`NOT_DSR`] (masqueraded as without DSR). Inlined into
/// [`new_connection`], where the compiler shares one stack area between this and
/// [`connection`]: as calls of their own, either frame added to [`new_connection`]'s passes
/// BPF's 512 bytes along the chain of calls.
#[inline(always)]
fn dsr_connection<A: Maps + Dsr>(
    ctx: &XdpContext,
    packet: &Packet<A>,
    chosen: &Chosen<A>,
    out: &Egress<A>,
) -> u32 {
    let Chosen { backend, counter, now, .. } = chosen;
    if !A::in_pod_cidr(&backend.addr) {
        return NOT_DSR;
    }
    let forward = match track_dsr(packet, backend, *counter, source_class::OUTSIDE, *now, false) {
        Ok(forward) => forward,
        Err(refusal) => return refused(refusal),
    };
    stat(datapath_stat::DSR_SENT);
    count(ctx, *counter);
    finish_carrying(ctx, packet, &forward, &out.hop)
}

/// XDP's verdict for a new connection whose entries were not stored: a full flows map is left
/// to TC, which makes room (early drop) or refuses; another refusal, counted by the tracking,
/// is dropped as TC would drop it.
#[inline(always)]
fn refused(refusal: Refusal) -> u32 {
    match refusal {
        Refusal::MapFull => XDP_PASS,
        _ => xdp_action::XDP_DROP,
    }
}

/// [`finish`] for a DSR request that carries its service address (the packet's destination
/// before the rewrite) to the backend's node: rewritten, the carrier added, sent.
#[inline(never)]
fn finish_carrying<A: Dsr>(ctx: &XdpContext, packet: &Packet<A>, flow: &Nat<A>, out: &Hop) -> u32 {
    if rewrite_in_place(ctx, packet, flow, out).is_none() {
        return XDP_PASS;
    }
    let frontend = packet.flow.destination();
    if A::carry(ctx, &frontend).is_err() {
        // Rewritten already: a half-made request must not escape.
        return xdp_action::XDP_DROP;
    }
    transmit(out)
}

/// Rewrites the packet as `flow` says, with its new MACs, and sends it (`XDP_PASS`, untouched,
/// when the packet is shorter than its parse said).
#[inline(never)]
fn finish<A: Address>(ctx: &XdpContext, packet: &Packet<A>, flow: &Nat<A>, out: &Hop) -> u32 {
    match rewrite_in_place(ctx, packet, flow, out) {
        Some(()) => transmit(out),
        None => XDP_PASS,
    }
}

/// Rewrites the packet as `flow` says, with its new MACs; `None` (nothing changed) when the
/// packet is shorter than its parse said.
#[inline(always)]
fn rewrite_in_place<A: Address>(
    ctx: &XdpContext,
    packet: &Packet<A>,
    flow: &Nat<A>,
    out: &Hop,
) -> Option<()> {
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
        eth[..6].copy_from_slice(&out.next.dst_mac);
        eth[6..].copy_from_slice(&out.next.src_mac);
    }
    Some(())
}

/// The action that sends a finished packet out of its egress device.
#[inline(always)]
fn transmit(out: &Hop) -> u32 {
    if out.action == xdp_action::XDP_TX {
        return xdp_action::XDP_TX;
    }
    // `XDP_PASS` if the device left the map meanwhile: the rewritten packet then goes through
    // the stack's forwarding like any routed packet.
    match XDP_TX_DEVICES.redirect(out.next.ifindex, u64::from(XDP_PASS)) {
        Ok(action) | Err(action) => action,
    }
}

/// Counts the packet for its connection, by its IP length, as TC counts.
#[inline(always)]
fn count(ctx: &XdpContext, counter: u32) {
    counters::count(counter, (ctx.data_end() - ctx.data()).saturating_sub(ETH_HLEN) as u64);
}
