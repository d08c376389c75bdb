//! The TC programs: `vipr_tc_ingress` balances new connections (through the service decision
//! of lb.rs), rewrites tracked ones (conntrack.rs), reverse-NATs the ICMP errors and later
//! fragments that belong to them, and forwards the result (route.rs); `vipr_tc_egress` gives
//! forwarded replies their frontend as source once the stack has routed them.
use aya_ebpf::{macros::classifier, programs::TcContext};
use proxy_common::{datapath_stat, flow_flags, service_flags, unmatched, NextHop, Service};

use crate::{
    conntrack::{make_room, observe, touch, track, track_dsr, track_dsr_backend, track_masqueraded, Refusal},
    counters::{self, stat},
    dsr::{self, Dsr},
    family::{Endpoint, Ipv4, Ipv6, Nat, Tracked},
    family_maps::{no_hop, Maps},
    fragment::{self, Fragments, LaterFragment},
    icmp_error::{self, IcmpErrors},
    lb::{classify, decide, Chosen, Decision, PacketDecision},
    packet::{ethertype, rewrite, IpHeader, Packet, Side, ETH_P_IP, ETH_P_IPV6, TCP_SYN},
    reject::Reject,
    route::{hop_of, redirect_to_hop, redirecting, route_fitting, route_to, tracked_hop, Onward, Route},
    wire::ETH_HLEN,
};

/// Everything the TC path does per family, from the layers below.
trait Datapath: IpHeader + Maps + Reject + IcmpErrors + Fragments + Dsr {}

impl<A: IpHeader + Maps + Reject + IcmpErrors + Fragments + Dsr> Datapath for A {}

// Verdicts from linux/pkt_cls.h, typed as the program returns them.
/// vipr did not act: the next program (or the default action) decides.
const TC_ACT_UNSPEC: i32 = -1;
/// vipr rewrote the packet; let it continue.
const TC_ACT_OK: i32 = 0;
const TC_ACT_SHOT: i32 = 2;

#[classifier]
pub fn vipr_tc_ingress(ctx: TcContext) -> i32 {
    match ethertype(&ctx) {
        Some(ETH_P_IP) => family::<Ipv4>(&ctx),
        Some(ETH_P_IPV6) => family::<Ipv6>(&ctx),
        _ => TC_ACT_UNSPEC,
    }
}

/// TCP/UDP packets are balanced; ICMP errors and later fragments follow the connection they
/// belong to. Each path is a function of its own (a BPF-to-BPF call) called from here, so that
/// the stack of a call chain is this small frame and one path's, never two paths' together:
/// inlined, they add up past BPF's 512 bytes.
#[inline(always)]
fn family<A: Datapath>(ctx: &TcContext) -> i32 {
    match balance::<A>(ctx) {
        NOT_BALANCED if A::CARRIED_APART => match carried_request::<A>(ctx, false) {
            NOT_BALANCED => {}
            MAP_FULL => {
                make_room::<A>();
                return carried_request::<A>(ctx, true);
            }
            verdict => return verdict,
        },
        NOT_BALANCED => {}
        too_big_for if is_too_big(too_big_for) => return too_big::<A>(ctx, too_big_for),
        NEW_CONNECTION => {
            // A full flows map: early drop, and the decision taken anew (nothing was stored).
            // Here, from the entry, so that the frames of the two never add up.
            let mut verdict = balance_new::<A>(ctx, false);
            if verdict == MAP_FULL {
                make_room::<A>();
                verdict = balance_new::<A>(ctx, true);
            }
            return if is_too_big(verdict) { too_big::<A>(ctx, verdict) } else { verdict };
        }
        verdict => return verdict,
    }
    if let Some(verdict) = reverse_nat_error::<A>(ctx) {
        return verdict;
    }
    later_fragment::<A>(ctx)
}

/// [`balance`]'s answer for a packet that is not TCP/UDP with ports: no TC verdict.
const NOT_BALANCED: i32 = i32::MIN;
/// [`balance`]'s answer for a packet no flow entry matched: [`balance_new`] takes it.
const NEW_CONNECTION: i32 = i32::MIN + 1;
/// [`balance_new`]'s answer when the flows map is full and it may not refuse yet.
const MAP_FULL: i32 = i32::MIN + 2;
/// [`balance`] and [`balance_new`]'s answers from here to `TOO_BIG + 0xffff`: [`too_big_for`].
const TOO_BIG: i32 = i32::MIN + 0x1_0000;

/// The datapath of a tracked connection, for one family: IPv4 and IPv6 packets take the same
/// steps, on their own maps. [`NOT_BALANCED`] for a packet that is not TCP/UDP with ports,
/// [`NEW_CONNECTION`] for one without a flow entry. (Not an `Option`: that can be returned
/// through the caller's stack, with the stack pointer left in R0, which the verifier refuses.)
/// A new connection is a separate call from the entry, so that this frame and
/// [`balance_new`]'s never add up (BPF's 512 bytes over a call chain).
#[inline(never)]
fn balance<A: Datapath>(ctx: &TcContext) -> i32 {
    match A::parse(ctx) {
        Some(packet) => balance_packet(ctx, &packet),
        None => NOT_BALANCED,
    }
}

/// A request that carries its service address in a header the common parser refuses (IPv6's,
/// dsr.rs), on its backend's node: the first one stored as [`balance_new`] stores one that
/// carries it, a later one (a retransmitted SYN, a datagram) handled as [`balance_packet`]
/// handles a DSR request. [`NOT_BALANCED`] for every other packet, [`MAP_FULL`] as
/// [`balance_new`]. Not [`balance_packet`] itself, whose frame with [`dsr_arrived`]'s inlined
/// would pass BPF's 512 bytes: such a packet belongs to a DSR connection or to none.
#[inline(never)]
fn carried_request<A: Datapath>(ctx: &TcContext, last_try: bool) -> i32 {
    let Some(packet) = A::parse_carrying(ctx) else {
        return NOT_BALANCED;
    };
    let Some(frontend) = A::carried(ctx, &packet) else {
        return TC_ACT_UNSPEC;
    };
    let stored = match A::flow(&packet.flow) {
        Some(tracked) => {
            let flags = tracked.nat.flags;
            if flags & flow_flags::DSR_BACKEND == 0 || flags & flow_flags::REPLY != 0 {
                return TC_ACT_UNSPEC;
            }
            seen(ctx, &packet, &tracked);
            true
        }
        None => false,
    };
    arrive(ctx, &packet, &frontend, stored, last_try)
}

#[inline(always)]
fn balance_packet<A: Datapath>(ctx: &TcContext, packet: &Packet<A>) -> i32 {
    if let Some(tracked) = A::flow(&packet.flow) {
        let flow = &tracked.nat;
        seen(ctx, packet, &tracked);
        // A direct-server-return request that carries (or may carry) the service address
        // has its own path; the others (a TCP connection's packets after its SYN) are plain
        // destination rewrites, which go the established way with the flow's cached next hop.
        if flow.flags & (flow_flags::DSR_INGRESS | flow_flags::DSR_BACKEND) != 0
            && flow.flags & flow_flags::REPLY == 0
            && dsr::carries(packet)
        {
            // Inlined for both families: as a call of its own, its frame, this one's and the
            // next-hop lookup's add up past BPF's 512 bytes.
            return dsr_request(ctx, packet, &tracked);
        }
        return match onward(ctx, packet, &tracked, !stack_forwards(packet, flow)) {
            Onward::Hop(hop) => forward(ctx, packet, flow, &hop),
            Onward::TooBig(mtu) => too_big_for(mtu),
        };
    }
    NEW_CONNECTION
}

/// The answer for a packet too big for its way and not to be fragmented:
/// [`TOO_BIG`] plus the MTU it must fit (below 2^16), for [`too_big`] to answer.
#[inline(always)]
fn too_big_for(mtu: u32) -> i32 {
    TOO_BIG + mtu.min(u32::from(u16::MAX)) as i32
}

/// Whether a verdict is [`too_big_for`]'s.
#[inline(always)]
fn is_too_big(verdict: i32) -> bool {
    (TOO_BIG..=TOO_BIG + 0xffff).contains(&verdict)
}

/// A packet too big for its way ([`too_big_for`]), answered ([`Reject::too_big`]),
/// parsed again for where its L4 header starts. Called from the entry: with [`balance`]'s
/// frame, the answer's checksum buffer would pass BPF's 512 bytes.
#[inline(never)]
fn too_big<A: Datapath>(ctx: &TcContext, verdict: i32) -> i32 {
    match A::parse(ctx) {
        Some(packet) => A::too_big(ctx, packet.l4_offset, (verdict - TOO_BIG) as u32),
        None => TC_ACT_SHOT,
    }
}

/// Where a tracked connection's packet goes on, toward its flow's destination ([`tracked_hop`]):
/// its size checked there when vipr sends it on itself (`redirected`), as the kernel's
/// forwarding would check it; through the stack, the stack checks it.
#[inline(always)]
fn onward<A: Datapath>(
    ctx: &TcContext,
    packet: &Packet<A>,
    tracked: &Tracked<A>,
    redirected: bool,
) -> Onward {
    let flow = &tracked.nat;
    let destination = flow.destination(packet.flow.dst);
    let ip_len = if redirected { packet.ip_len() } else { 0 };
    match tracked_hop(ctx, destination, tracked, ip_len) {
        Onward::TooBig(_) if stack_fragments::<A>(ctx, masqueraded(flow)) => Onward::Hop(no_hop()),
        onward => onward,
    }
}

/// Whether a packet too big for its way goes rewritten into the stack, which fragments it, as a
/// router fragments a packet without DF. A masqueraded packet cannot: its source is now one of
/// the node's own addresses, which the stack drops arriving from outside (a martian). It is
/// answered "fragmentation needed" even without DF (as a packet with DF is): a Linux client
/// learns the way's MTU from it, whatever its socket's `IP_MTU_DISCOVER`, and fragments its
/// later datagrams itself; the alternative was to lose every one.
#[inline(always)]
fn stack_fragments<A: Datapath>(ctx: &TcContext, masqueraded: bool) -> bool {
    !masqueraded && A::may_fragment(ctx)
}

/// [`Dsr::carried`] for a packet the common parser took: a family whose carrier that parser
/// refuses carries nothing there ([`carried_request`] has those packets).
#[inline(always)]
fn carried_in_common_parse<A: Datapath>(ctx: &TcContext, packet: &Packet<A>) -> Option<Endpoint<A>> {
    // A constant: the other family's parse is not even emitted.
    if A::CARRIED_APART {
        None
    } else {
        A::carried(ctx, packet)
    }
}

/// Stores a DSR connection's entries on its backend's node ([`track_dsr_backend`]) where its
/// carried `frontend` is one a service of the request's backend has ([`dsr::serves`]); another
/// is refused, counted. Checked here, where an address is stored, and only here: a tracked
/// connection's later requests (a datagram) lose their carrier and store nothing.
#[inline(always)]
fn take_carried<A: Datapath>(
    packet: &Packet<A>,
    frontend: &Endpoint<A>,
    last_try: bool,
) -> Result<(), Refusal> {
    if !dsr::serves(frontend, packet) {
        stat(datapath_stat::DSR_CARRIER_REFUSED);
        return Err(Refusal::Counted);
    }
    track_dsr_backend(packet, frontend, last_try)
}

/// A request of a direct-server-return connection with a flow entry that carries (or may
/// carry) the service address ([`dsr::carries`]). On the ingress node: the destination
/// rewritten, the option carried again where the backend's node may need it (a retransmitted
/// SYN, every UDP datagram: its entries there may have expired or never been stored). On the
/// backend's node: the option, if any, removed (a retransmitted SYN renews the entries first).
/// Toward the next hop cached in its flow entry, as every tracked packet: the option's room is
/// checked against that device's MTU on every request (`bpf_check_mtu`), since the cache holds
/// the device but not its MTU.
#[inline(always)]
fn dsr_request<A: Datapath>(ctx: &TcContext, packet: &Packet<A>, tracked: &Tracked<A>) -> i32 {
    let flow = &tracked.nat;
    // Such a request is redirected only with `--bpf-forwarding=redirect` ([`deliver`]).
    let hop = match onward(ctx, packet, tracked, redirecting()) {
        Onward::Hop(hop) => hop,
        Onward::TooBig(mtu) => return too_big_for(mtu),
    };
    if flow.flags & flow_flags::DSR_BACKEND != 0 {
        let Some(frontend) = carried_in_common_parse(ctx, packet) else {
            return forward(ctx, packet, flow, &hop);
        };
        if packet.tcp_flags & TCP_SYN != 0 {
            let _ = take_carried(packet, &frontend, true);
        }
        if A::strip(ctx).is_err() {
            // A packet half rewritten must not escape.
            return TC_ACT_SHOT;
        }
        return deliver(ctx, &hop);
    }
    // A first fragment leaves without the option (fragment.rs places the rest of its
    // datagram); a packet not forwarded (ifindex 0) is the stack's.
    if hop.ifindex == 0 || packet.first_fragment.is_some() {
        return forward(ctx, packet, flow, &hop);
    }
    send_dsr(ctx, packet, flow, &hop)
}

/// Sends a tracked DSR request that carries the service address ([`dsr::carries`]) to its
/// backend's node by `hop`: rewritten and carrying the service address ([`carrying`]), unless
/// the option would exceed the MTU of the hop's device (counted: the packet leaves without
/// it). Through the stack or redirected to `hop`, as `--bpf-forwarding` says: with the source
/// kept, netfilter sees client -> backend either way.
#[inline(always)]
fn send_dsr<A: Datapath>(ctx: &TcContext, packet: &Packet<A>, flow: &Nat<A>, hop: &NextHop) -> i32 {
    let carry = A::fits_with_option_on(ctx, packet, hop.ifindex);
    if !carry {
        stat(datapath_stat::DSR_MTU_NO_OPTION);
    }
    match carrying(ctx, packet, flow, carry) {
        Ok(()) => deliver(ctx, hop),
        Err(_) => TC_ACT_SHOT,
    }
}

/// A DSR request's destination rewritten, the source kept, and (when `carry`) the option with
/// the frontend (the packet's destination before the rewrite) added. `Err`: drop the packet.
#[inline(always)]
fn carrying<A: Datapath>(ctx: &TcContext, packet: &Packet<A>, flow: &Nat<A>, carry: bool) -> Result<(), i64> {
    rewrite(ctx, packet, Side::Destination, flow.dst, flow.dst_port)?;
    if carry {
        A::carry(ctx, &packet.flow.destination())?;
    }
    Ok(())
}

/// Hands on a packet rewritten in place toward `hop` (ifindex 0: not forwarded): redirected to
/// it with `--bpf-forwarding=redirect`, else into the stack.
#[inline(always)]
fn deliver(ctx: &TcContext, hop: &NextHop) -> i32 {
    if hop.ifindex != 0 && redirecting() {
        redirect_to_hop(ctx, hop)
    } else {
        TC_ACT_OK
    }
}

/// A DSR request on its backend's node: the option removed (a packet half rewritten must not
/// escape), then on to the backend.
#[inline(always)]
fn strip_and_deliver<A: Datapath>(ctx: &TcContext, route: Option<&Route<A>>) -> i32 {
    if A::strip(ctx).is_err() {
        return TC_ACT_SHOT;
    }
    deliver(ctx, &hop_of(route))
}

/// The first packet of a connection: choose its backend, track it, rewrite it. The packet is
/// parsed again (what [`balance`] parsed is in its frame, gone by now): a few instructions,
/// only for new connections. [`MAP_FULL`] when the flows map is full, unless `last_try`: then
/// the connection is refused (counted, its packet dropped).
#[inline(never)]
fn balance_new<A: Datapath>(ctx: &TcContext, last_try: bool) -> i32 {
    let Some(packet) = A::parse(ctx) else {
        return TC_ACT_UNSPEC;
    };
    let packet = &packet;
    // A request whose service address another node's vipr carried here: this node is the
    // backend's (direct server return).
    if let Some(frontend) = carried_in_common_parse(ctx, packet) {
        return dsr_arrived(ctx, packet, &frontend, last_try);
    }
    // At TC ingress the packet's device is the one it entered through.
    let entered_through = unsafe { (*ctx.skb.skb).ifindex };
    let class = classify(&packet.flow.src, entered_through);
    // Two matches: with one over the nested patterns LLVM read a register that the `Retired`
    // path leaves unset, which the verifier refuses.
    let decision = match decide(&packet.flow, packet.tcp_flags, class) {
        PacketDecision::Decided(decision) => decision,
        PacketDecision::Unmatched => return unmatched_destination(ctx, packet),
        // Retransmitted, it finds the entry copied meanwhile.
        PacketDecision::Held => {
            stat(datapath_stat::SWITCH_HELD);
            return TC_ACT_SHOT;
        }
    };
    let Chosen { service, backend, counter, now } = match decision {
        Decision::Backend(chosen) => chosen,
        Decision::SourceDenied => return TC_ACT_SHOT,
        Decision::NoBackend(service) => return no_backend(ctx, packet, &service),
        // The client retransmits and meets the new set.
        Decision::Retired => return TC_ACT_SHOT,
    };
    // A pod reaching itself through its service must see the node as peer, or it would answer
    // itself directly and the reply would never be reverse-NATed.
    let hairpin = backend.addr.is(&packet.flow.src);
    // The route is what direct server return and a masquerade are chosen by, and what a
    // redirected packet (`--bpf-forwarding=redirect`, a first fragment) is sent along. A packet
    // that is only DNATed and goes back into the stack (`stack`, the default) needs none: the
    // stack routes it, and it is rewritten the same whether it is forwarded or delivered here.
    // So its FIB lookup, a tenth of a new connection's cost, is left out. (A connection
    // remapped for a reply clash, [`track`], then passes the stack too, not redirected: its
    // later packets are, as before.)
    let needs_route = hairpin
        || service.flags & (service_flags::DSR | service_flags::MASQUERADE) != 0
        || redirected_whatever_its_flow(packet);
    let route = if needs_route { route_to(ctx, backend.addr) } else { None };
    // A packet too big for the way even without the option is no DSR fallback: it is answered
    // (or fragmented) below, as a masqueraded one is.
    if service.flags & service_flags::DSR != 0 && !hairpin {
        if let Some(route) = route.as_ref().filter(|route| route.fits && remote(packet, &backend, route)) {
            let chosen = Chosen { service, backend, counter, now };
            let verdict = balance_dsr(ctx, packet, &chosen, class, route, last_try);
            if verdict != NOT_DSR {
                return verdict;
            }
        }
    }
    let masquerading = service.flags & service_flags::MASQUERADE != 0 || hairpin;
    // A packet that vipr sends on itself (masqueraded, or redirected) and that does not fit its
    // way is treated as a tracked one is ([`onward`]): answered "fragmentation needed" before
    // anything is stored (the client sends it again smaller, as a new connection), or, if a
    // router may fragment it and the stack can forward it rewritten, handed to the stack.
    // (A flag, not the hop itself: 16 more bytes of frame here pass BPF's 512 over the chain.)
    let mut into_stack = false;
    if let Some(route) = route.as_ref().filter(|route| !route.fits) {
        if masquerading || redirected_whatever_its_flow(packet) {
            if !stack_fragments::<A>(ctx, masquerading) {
                return too_big_for(route.mtu);
            }
            into_stack = true;
        }
    }
    let forward = if masquerading {
        // Without a route there is no address to masquerade to.
        let Some(route) = &route else {
            return TC_ACT_SHOT;
        };
        track_masqueraded(packet, &backend, counter, class, route.source, now, last_try)
    } else {
        track(packet, &backend, counter, class, now, last_try)
    };
    let forward = match forward {
        Ok(forward) => forward,
        Err(refusal) => return refused(refusal),
    };
    count(ctx, counter);
    let hop = if into_stack { no_hop() } else { hop_of(route.as_ref()) };
    self::forward(ctx, packet, &forward, &hop)
}

/// The verdict for a new connection whose entries were not stored: [`MAP_FULL`] for a full
/// flows map (the entry makes room and tries again), else dropped (the tracking counted why).
#[inline(always)]
fn refused(refusal: Refusal) -> i32 {
    match refusal {
        Refusal::MapFull => MAP_FULL,
        _ => TC_ACT_SHOT,
    }
}

/// [`balance_dsr`]'s answer for a connection that is masqueraded after all.
const NOT_DSR: i32 = i32::MIN + 3;

/// A new connection of a DSR frontend to a remote backend: tracked (forward entry only) and
/// sent with the option, unless its packet with the option would exceed the egress device's
/// MTU: then [`NOT_DSR`] (counted), and it is masqueraded as without DSR. Inlined: as a call
/// of its own its frame and [`balance_new`]'s add up past BPF's 512 bytes.
#[inline(always)]
fn balance_dsr<A: Datapath>(
    ctx: &TcContext,
    packet: &Packet<A>,
    chosen: &Chosen<A>,
    class: u8,
    route: &Route<A>,
    last_try: bool,
) -> i32 {
    if !A::fits_with_option(packet, route.mtu) {
        stat(datapath_stat::DSR_MTU_SNAT);
        return NOT_DSR;
    }
    match track_dsr(packet, &chosen.backend, chosen.counter, class, chosen.now, last_try) {
        Ok(forward) => {
            stat(datapath_stat::DSR_SENT);
            count(ctx, chosen.counter);
            match carrying(ctx, packet, &forward, true) {
                Ok(()) => deliver(ctx, &hop_of(Some(route))),
                Err(_) => TC_ACT_SHOT,
            }
        }
        Err(refusal) => refused(refusal),
    }
}

/// Whether a DSR frontend's new connection goes to a backend on another node: a pod address
/// (the local-traffic detector's cluster CIDRs) routed through a gateway (the node that has
/// the pod's CIDR), not one of this node's pods (a route on a link) nor an address outside the
/// cluster (no vipr there to restore the frontend). A first fragment is masqueraded: its
/// datagram's later fragments could not carry the option.
#[inline(always)]
fn remote<A: Datapath>(packet: &Packet<A>, backend: &Endpoint<A>, route: &Route<A>) -> bool {
    route.via_gateway && packet.first_fragment.is_none() && A::in_pod_cidr(&backend.addr)
}

/// The first request of a DSR connection on its backend's node, which carries its service
/// address: see [`arrive`].
#[inline(never)]
fn dsr_arrived<A: Datapath>(
    ctx: &TcContext,
    packet: &Packet<A>,
    frontend: &Endpoint<A>,
    last_try: bool,
) -> i32 {
    arrive(ctx, packet, frontend, false, last_try)
}

/// A request of a DSR connection on its backend's node that carries its service address: the
/// first one's entries stored (the reply entry gives replies the carried frontend as source),
/// or with `stored` (they were found) renewed by a SYN, which the client retransmitted; then the
/// carrier removed and the request delivered. A connection whose entries could not be stored is
/// refused as [`balance_new`] refuses: its replies would leave with the backend's address.
/// Inlined into [`carried_request`], whose frame and a call's would pass BPF's 512 bytes.
#[inline(always)]
fn arrive<A: Datapath>(
    ctx: &TcContext,
    packet: &Packet<A>,
    frontend: &Endpoint<A>,
    stored: bool,
    last_try: bool,
) -> i32 {
    if !stored {
        match take_carried(packet, frontend, last_try) {
            Ok(()) => stat(datapath_stat::DSR_RECEIVED),
            Err(refusal) => return refused(refusal),
        }
    } else if packet.tcp_flags & TCP_SYN != 0 {
        let _ = take_carried(packet, frontend, true);
    }
    // Only a redirect is sent along a route; into the stack (`stack`) the request needs none.
    let route = if redirecting() { route_fitting(ctx, packet.flow.dst) } else { None };
    strip_and_deliver::<A>(ctx, route.as_ref())
}

/// A tracked connection's packet counted and its tracking advanced (handshake, last seen).
#[inline(always)]
fn seen<A: Datapath>(ctx: &TcContext, packet: &Packet<A>, tracked: &Tracked<A>) {
    count(ctx, tracked.nat.counter);
    observe(&packet.flow, tracked, packet.tcp_flags);
}

/// Counts the packet for its connection, by its IP length (without the Ethernet header).
#[inline(always)]
fn count(ctx: &TcContext, counter: u32) {
    counters::count(counter, u64::from(ctx.len().saturating_sub(ETH_HLEN as u32)));
}

/// A service address that no frontend matched: a cluster IP on a port it does not serve is
/// rejected, any other address in a service range dropped, everything else left alone.
#[inline(always)]
fn unmatched_destination<A: Datapath>(ctx: &TcContext, packet: &Packet<A>) -> i32 {
    match A::unmatched(&packet.flow.dst) {
        Some(unmatched::REJECT) => A::reject(ctx, packet.l4_offset),
        Some(unmatched::DROP) => TC_ACT_SHOT,
        _ => TC_ACT_UNSPEC,
    }
}

#[inline(always)]
fn no_backend<A: Datapath>(ctx: &TcContext, packet: &Packet<A>, service: &Service) -> i32 {
    if service.flags & service_flags::REJECT_WHEN_EMPTY != 0 {
        A::reject(ctx, packet.l4_offset)
    } else {
        TC_ACT_SHOT
    }
}

/// Applies a flow entry's rewrites to the packet; a first fragment's ports are remembered for
/// the rest of its datagram.
#[inline(always)]
fn apply<A: Datapath>(ctx: &TcContext, packet: &Packet<A>, flow: &Nat<A>) -> Result<(), i64> {
    if flow.flags & flow_flags::REWRITE_DESTINATION != 0 {
        rewrite(ctx, packet, Side::Destination, flow.dst, flow.dst_port)?;
    }
    if flow.flags & flow_flags::REWRITE_SOURCE != 0 {
        rewrite(ctx, packet, Side::Source, flow.src, flow.src_port)?;
    }
    if let Some(id) = packet.first_fragment {
        A::remember_fragment(&packet.flow, id);
    }
    Ok(())
}

/// An ICMP error about a tracked connection's packet (icmp_error.rs) is reverse-NATed; `None`
/// for a packet that is no ICMP error about TCP/UDP.
#[inline(never)]
fn reverse_nat_error<A: Datapath>(ctx: &TcContext) -> Option<i32> {
    let error = A::icmp_error(ctx)?;
    let Some(tracked) = A::flow(&error.key) else {
        return Some(TC_ACT_UNSPEC);
    };
    let flow = &tracked.nat;
    let route = route_fitting(ctx, flow.destination(error.key.dst));
    Some(send(ctx, icmp_error::reverse_nat(ctx, &error, flow), &hop_of(route.as_ref())))
}

/// A later IPv4 fragment (fragment.rs) takes its datagram's rewrites. Everything else the
/// parsers refused is left alone.
#[inline(never)]
fn later_fragment<A: Datapath>(ctx: &TcContext) -> i32 {
    let tuple = match A::later_fragment(ctx) {
        Some(LaterFragment::Known(tuple)) => tuple,
        Some(LaterFragment::Unknown { dst }) => return unplaced_fragment(&dst),
        None => return TC_ACT_UNSPEC,
    };
    let Some(tracked) = A::flow(&tuple) else {
        return unplaced_fragment(&tuple.dst);
    };
    let flow = tracked.nat;
    count(ctx, flow.counter);
    touch(tracked.track, 0);
    let route = route_fitting(ctx, flow.destination(tuple.dst));
    send(ctx, fragment::rewrite_addresses(ctx, &tuple, &flow), &hop_of(route.as_ref()))
}

/// A later fragment no flow explains: dropped when it goes to a service address (it cannot
/// reach the right backend, and must not be routed on with a service address), else none of
/// vipr's business.
#[inline(always)]
fn unplaced_fragment<A: Datapath>(dst: &A) -> i32 {
    if A::unmatched(dst).is_some() {
        TC_ACT_SHOT
    } else {
        TC_ACT_UNSPEC
    }
}

/// Hands a balanced packet on toward `hop` (ifindex 0: not forwarded; a tracked connection's
/// may be the one cached in its flow entry, route.rs [`tracked_hop`]): one the node forwards
/// through the stack with only its destination rewritten (`--bpf-forwarding=stack`, the
/// default; route.rs explains why), else rewritten whole and [`send`]. Masqueraded connections
/// and fragments are rewritten whole and redirected on both paths (see route.rs).
#[inline(always)]
fn forward<A: Datapath>(ctx: &TcContext, packet: &Packet<A>, flow: &Nat<A>, hop: &NextHop) -> i32 {
    if hop.ifindex != 0 && stack_forwards(packet, flow) {
        return through_stack(ctx, packet, flow);
    }
    send(ctx, apply(ctx, packet, flow), hop)
}

/// Whether a forwarded packet goes through the stack with only its destination rewritten:
/// with `--bpf-forwarding=stack`, unless it is masqueraded or a first fragment (see
/// [`forward`]).
#[inline(always)]
fn stack_forwards<A>(packet: &Packet<A>, flow: &Nat<A>) -> bool {
    !redirected_whatever_its_flow(packet) && !masqueraded(flow)
}

/// Whether a flow's packets are rewritten on both sides: a masqueraded connection's.
#[inline(always)]
fn masqueraded<A>(flow: &Nat<A>) -> bool {
    flow.flags & (flow_flags::REWRITE_SOURCE | flow_flags::REWRITE_DESTINATION)
        == flow_flags::REWRITE_SOURCE | flow_flags::REWRITE_DESTINATION
}

/// Whether a forwarded packet is redirected past the stack whatever its flow entry says:
/// with `--bpf-forwarding=redirect`, or as a first fragment (see [`forward`]).
#[inline(always)]
fn redirected_whatever_its_flow<A>(packet: &Packet<A>) -> bool {
    redirecting() || packet.first_fragment.is_some()
}

/// The ingress half of a forwarded packet's NAT: toward the backend its destination, so that
/// routing and netfilter see client -> backend; a reply is left as it is (backend -> client)
/// and gets the frontend as source at egress ([`vipr_tc_egress`]).
#[inline(always)]
fn through_stack<A: Datapath>(ctx: &TcContext, packet: &Packet<A>, flow: &Nat<A>) -> i32 {
    if flow.flags & flow_flags::REWRITE_DESTINATION == 0 {
        return TC_ACT_UNSPEC;
    }
    match rewrite(ctx, packet, Side::Destination, flow.dst, flow.dst_port) {
        Ok(()) => TC_ACT_OK,
        Err(_) => TC_ACT_SHOT,
    }
}

/// The TC program at egress of every served device, for `--bpf-forwarding=stack`: a reply of a
/// connection that kept its client's address, which crossed the stack as backend -> client,
/// gets the frontend as source. Its flow key is the packet's own tuple: one lookup per packet.
/// An ICMP error the node itself sends about such a connection is reverse-NATed
/// ([`stack_error`]). Everything else leaves untouched.
#[classifier]
pub fn vipr_tc_egress(ctx: TcContext) -> i32 {
    if redirecting() {
        return TC_ACT_UNSPEC;
    }
    match ethertype(&ctx) {
        Some(ETH_P_IP) => egress::<Ipv4>(&ctx),
        Some(ETH_P_IPV6) => egress::<Ipv6>(&ctx),
        _ => TC_ACT_UNSPEC,
    }
}

#[inline(always)]
fn egress<A: Datapath>(ctx: &TcContext) -> i32 {
    let Some(packet) = A::parse(ctx) else {
        return stack_error::<A>(ctx);
    };
    if packet.first_fragment.is_some() {
        return TC_ACT_UNSPEC;
    }
    let Some(tracked) = A::flow(&packet.flow) else {
        return TC_ACT_UNSPEC;
    };
    let nat = tracked.nat;
    // Only a reply whose single rewrite is its source: a masqueraded reply was rewritten whole
    // at ingress, and a forward entry's key has the frontend as destination.
    let wanted = flow_flags::REPLY | flow_flags::REWRITE_SOURCE;
    if nat.flags & (wanted | flow_flags::REWRITE_DESTINATION) != wanted {
        return TC_ACT_UNSPEC;
    }
    match rewrite(ctx, &packet, Side::Source, nat.src, nat.src_port) {
        Ok(()) => TC_ACT_OK,
        Err(_) => TC_ACT_SHOT,
    }
}

/// An ICMP error the node's stack sends about a packet it forwarded for a tracked connection
/// (with `stack`, a request goes through it DNATed): "fragmentation needed" for a request too
/// big for the backend's link, "host unreachable" for a backend gone, a DSR request on its
/// backend's node. The stack quotes the packet as it forwarded it, to the backend, which the
/// client cannot match to its socket; kube-proxy's conntrack un-NATs the quote of such a
/// locally sent error, and so does this, with the same rule as for an error arriving
/// ([`reverse_nat_error`]). `TC_ACT_UNSPEC` for anything else, which leaves untouched (an
/// error a backend sent was reverse-NATed at ingress already: its reversed quote is no flow
/// key any more).
#[inline(never)]
fn stack_error<A: Datapath>(ctx: &TcContext) -> i32 {
    // Direct reads see only an skb's linear part: the headers up to the quoted checksum (an
    // IPv4 header with options, ICMP's, a quoted one with options, TCP's to its checksum) are
    // pulled into it, should the quote lie in a page fragment. The stack's own errors are
    // linear (a no-op then); only packets no parser took get here, never TCP/UDP.
    const ERROR_HEADERS: u32 = (ETH_HLEN + 60 + 8 + 60 + 18) as u32;
    let _ = ctx.pull_data(ctx.len().min(ERROR_HEADERS));
    let Some(error) = A::icmp_error(ctx) else {
        return TC_ACT_UNSPEC;
    };
    let Some(tracked) = A::flow(&error.key) else {
        return TC_ACT_UNSPEC;
    };
    match icmp_error::reverse_nat(ctx, &error, &tracked.nat) {
        Ok(()) => TC_ACT_OK,
        Err(_) => TC_ACT_SHOT,
    }
}

/// Sends a rewritten packet on its way: straight to `hop` when the node forwards it (ifindex
/// not 0), else into the stack.
#[inline(always)]
fn send(ctx: &TcContext, rewritten: Result<(), i64>, hop: &NextHop) -> i32 {
    match rewritten {
        Ok(()) if hop.ifindex != 0 => redirect_to_hop(ctx, hop),
        Ok(()) => TC_ACT_OK,
        // Half-rewritten packets must not escape.
        Err(_) => TC_ACT_SHOT,
    }
}
