use core::ptr::NonNull;

use aya_ebpf::{
    helpers::{bpf_get_prandom_u32, bpf_ktime_get_coarse_ns},
    macros::classifier,
    programs::TcContext,
};
use proxy_common::{
    datapath_stat, flow_flags, flow_state, service_flags, source_class, unmatched, BackendSlot, FlowTrack,
    Service,
};

use crate::{
    affinity,
    family::{Endpoint, Family, Ipv4, Ipv6, Nat},
    fragment::{self, LaterFragment},
    icmp_error,
    maps::{BACKEND_COUNTERS, DATAPATH_STATS},
    packet::{ethertype, rewrite, Packet, Side, Tuple, ETH_P_IP, ETH_P_IPV6, TCP_FIN, TCP_RST},
    route::{claim_reply, redirect, route_to, Route},
    wire::ETH_HLEN,
};

// Verdicts from linux/pkt_cls.h, typed as the program returns them.
/// vipr did not act: the next program (or the default action) decides.
const TC_ACT_UNSPEC: i32 = -1;
/// vipr rewrote the packet; let it continue.
const TC_ACT_OK: i32 = 0;
const TC_ACT_SHOT: i32 = 2;
/// A flow entry's `last_seen` is rewritten only when it is older than this: idle timeouts are
/// minutes to hours, and an established packet should not write its entry every time (a write
/// dirties a cache line other CPUs serving the connection then miss on).
const LAST_SEEN_GRANULARITY_NS: u64 = 1_000_000_000;
/// Part of the flow hash: changing it moves every Maglev flow to another backend.
const FLOW_HASH_SEED: u32 = 0x7669_7072; // "vipr"

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
fn family<A: Family>(ctx: &TcContext) -> i32 {
    if let Some(verdict) = balance::<A>(ctx) {
        return verdict;
    }
    if let Some(verdict) = reverse_nat_error::<A>(ctx) {
        return verdict;
    }
    later_fragment::<A>(ctx)
}

/// The whole datapath for one family: IPv4 and IPv6 packets take the same steps, on their own
/// maps. `None` for a packet that is not TCP/UDP with ports.
#[inline(never)]
fn balance<A: Family>(ctx: &TcContext) -> Option<i32> {
    let packet = A::parse(ctx)?;
    Some(balance_packet(ctx, packet))
}

#[inline(always)]
fn balance_packet<A: Family>(ctx: &TcContext, packet: Packet<A>) -> i32 {
    if let Some(tracked) = A::flow(&packet.flow) {
        let flow = tracked.nat;
        count(ctx, flow.counter);
        touch(tracked.track, packet.tcp_flags);
        let destination =
            if flow.flags & flow_flags::REWRITE_DESTINATION != 0 { flow.dst } else { packet.flow.dst };
        let route = route_to(ctx, destination);
        return send(apply(ctx, &packet, &flow), route.as_ref());
    }
    let Some(service) = A::service(&packet.flow, classify(&packet.flow.src)) else {
        return unmatched_destination(ctx, &packet);
    };
    if service.flags & service_flags::SOURCE_RANGES != 0
        && !A::in_source_ranges(service.service_id, &packet.flow.src)
    {
        return TC_ACT_SHOT;
    }
    if service.backend_count == 0 {
        return no_backend(ctx, &packet, &service);
    }
    let now = unsafe { bpf_ktime_get_coarse_ns() };
    let slot =
        BackendSlot { backend_set: service.backend_set, slot: choose_slot(&packet.flow, &service, now) };
    // A miss means the agent retired this set between our two lookups; the client retransmits
    // and meets the new set.
    let Some((backend, counter)) = A::counted_backend(&slot) else {
        return TC_ACT_SHOT;
    };
    affinity::remember(&service, &packet.flow.src, &backend, now);
    // A pod reaching itself through its service must see the node as peer, or it would answer
    // itself directly and the reply would never be reverse-NATed.
    let hairpin = backend.addr.is(&packet.flow.src);
    let route = route_to(ctx, backend.addr);
    let forward = if service.flags & service_flags::MASQUERADE != 0 || hairpin {
        // Without a route there is no address to masquerade to.
        let Some(route) = &route else {
            return TC_ACT_SHOT;
        };
        track_masqueraded(&packet, &backend, counter, route.source, now)
    } else {
        track(&packet, &backend, counter, now)
    };
    let Some(forward) = forward else {
        return TC_ACT_SHOT;
    };
    count(ctx, counter);
    send(apply(ctx, &packet, &forward), route.as_ref())
}

/// The slot of a new connection's backend: the backend of the client's previous connection
/// while session affinity holds and the set still has it; else the slot the flow hash names
/// in a Maglev table; else a random one.
#[inline(always)]
pub(crate) fn choose_slot<A: Family>(flow: &Tuple<A>, service: &Service, now: u64) -> u32 {
    if let Some(slot) = affinity::remembered_slot(service, &flow.src, now) {
        return slot;
    }
    if service.flags & service_flags::MAGLEV != 0 {
        flow_hash(flow) % service.backend_count
    } else {
        (unsafe { bpf_get_prandom_u32() }) % service.backend_count
    }
}

/// The Maglev flow hash: the same on every node and every vipr build, so the nodes agree on a
/// flow's backend. It leaves out the destination address, which for a NodePort is each node's
/// own (the service is already chosen by then).
#[inline(always)]
fn flow_hash<A: Family>(flow: &Tuple<A>) -> u32 {
    let ports = (u32::from(flow.src_port) << 16) | u32::from(flow.dst_port);
    mix32(mix32(flow.src.fold() ^ FLOW_HASH_SEED) ^ ports ^ (u32::from(flow.proto) << 8))
}

/// MurmurHash3's finalizer: every input bit flips each output bit with probability ~1/2.
#[inline(always)]
fn mix32(mut h: u32) -> u32 {
    h ^= h >> 16;
    h = h.wrapping_mul(0x85eb_ca6b);
    h ^= h >> 13;
    h = h.wrapping_mul(0xc2b2_ae35);
    h ^ (h >> 16)
}

/// Adds the packet to its (service port, backend) counters: an inlined per-CPU array access,
/// no hash lookup and no atomic operation.
#[inline(always)]
fn count(ctx: &TcContext, counter: u32) {
    if let Some(counters) = BACKEND_COUNTERS.get_ptr(&counter) {
        let counters = counters.as_ptr();
        // SAFETY: this CPU's value of a live array element; nothing else writes it meanwhile.
        unsafe {
            (*counters).packets += 1;
            // The byte counters count IP packets, without the Ethernet header.
            (*counters).bytes += u64::from(ctx.len().saturating_sub(ETH_HLEN as u32));
        }
    }
}

/// Counts one of `proxy_common::datapath_stat`.
#[inline(always)]
pub(crate) fn stat(index: u32) {
    if let Some(value) = DATAPATH_STATS.get_ptr(&index) {
        // SAFETY: this CPU's value of a live array element.
        unsafe { *value.as_ptr() += 1 };
    }
}

/// Records what the agent needs to expire the connection: when its last packet passed (at a
/// one-second grain) and whether this direction sent a FIN or an RST. Writes only when either
/// changes, so most established packets only read their entry.
#[inline(always)]
pub(crate) fn touch(track: NonNull<FlowTrack>, tcp_flags: u8) {
    let track = track.as_ptr();
    // TCP FIN (0x01) and RST (0x04) become flow_state::FIN (1) and RST (2).
    let seen = u32::from(tcp_flags & TCP_FIN) | u32::from((tcp_flags & TCP_RST) >> 1);
    const _: () = assert!(flow_state::FIN == TCP_FIN as u32 && flow_state::RST == (TCP_RST >> 1) as u32);
    // SAFETY: the entry's tracking fields, in place; a racing writer on another CPU can only
    // store an equally recent time or the same bits.
    unsafe {
        let now = bpf_ktime_get_coarse_ns();
        if now.wrapping_sub((*track).last_seen) >= LAST_SEEN_GRANULARITY_NS {
            (*track).last_seen = now;
        }
        if seen & !(*track).state != 0 {
            (*track).state |= seen;
        }
    }
}

/// The source class of an address: the node's own, a pod's (by the local-traffic
/// detector), or anything else.
#[inline(always)]
pub(crate) fn classify<A: Family>(source: &A) -> u8 {
    if A::is_node(source) {
        source_class::NODE
    } else if A::in_pod_cidr(source) {
        source_class::POD
    } else {
        source_class::OUTSIDE
    }
}

/// A service address that no frontend matched: a cluster IP on a port it does not serve is
/// rejected, any other address in a service range dropped, everything else left alone.
#[inline(always)]
fn unmatched_destination<A: Family>(ctx: &TcContext, packet: &Packet<A>) -> i32 {
    match A::unmatched(&packet.flow.dst) {
        Some(unmatched::REJECT) => A::reject(ctx, packet),
        Some(unmatched::DROP) => TC_ACT_SHOT,
        _ => TC_ACT_UNSPEC,
    }
}

#[inline(always)]
fn no_backend<A: Family>(ctx: &TcContext, packet: &Packet<A>, service: &Service) -> i32 {
    if service.flags & service_flags::REJECT_WHEN_EMPTY != 0 {
        A::reject(ctx, packet)
    } else {
        TC_ACT_SHOT
    }
}

/// Records both directions of a new connection that keeps its source; `None` (counted) when
/// the flows map is full, and the caller drops the packet: a connection whose replies could
/// not be reverse-NATed, or whose next packet could go to another backend, must not start.
/// `now` is the clock reading the caller took for the whole decision (affinity, `last_seen`).
#[inline(always)]
pub(crate) fn track<A: Family>(
    packet: &Packet<A>,
    backend: &Endpoint<A>,
    counter: u32,
    now: u64,
) -> Option<Nat<A>> {
    let client = &packet.flow;
    let reply_key = Tuple {
        src: backend.addr,
        dst: client.src,
        src_port: backend.port,
        dst_port: client.src_port,
        proto: client.proto,
    };
    let reply = Nat {
        src: client.dst,
        src_port: client.dst_port,
        dst: A::UNSPECIFIED,
        dst_port: 0,
        flags: flow_flags::REPLY | flow_flags::REWRITE_SOURCE,
        counter,
        last_seen: 0,
    };
    let forward = Nat {
        src: A::UNSPECIFIED,
        src_port: 0,
        dst: backend.addr,
        dst_port: backend.port,
        flags: flow_flags::REWRITE_DESTINATION,
        counter,
        last_seen: now,
    };
    if A::record(&reply_key, &reply).is_err() {
        stat(datapath_stat::FLOW_INSERT_REPLY);
        return None;
    }
    if A::record(client, &forward).is_err() {
        stat(datapath_stat::FLOW_INSERT_FORWARD);
        A::forget(&reply_key);
        return None;
    }
    Some(forward)
}

/// Records a new connection whose source becomes the node's address toward the backend. The
/// reply entry is claimed first, because the (backend, node address, port) tuple is what
/// tells this connection's replies apart from every other one. `None` (counted) when no port
/// could be claimed or the flows map is full: the caller drops the packet.
#[inline(always)]
pub(crate) fn track_masqueraded<A: Family>(
    packet: &Packet<A>,
    backend: &Endpoint<A>,
    counter: u32,
    node_addr: A,
    now: u64,
) -> Option<Nat<A>> {
    let client = &packet.flow;
    let reply = Nat {
        src: client.dst,
        src_port: client.dst_port,
        dst: client.src,
        dst_port: client.src_port,
        flags: flow_flags::REPLY | flow_flags::REWRITE_SOURCE | flow_flags::REWRITE_DESTINATION,
        counter,
        last_seen: 0,
    };
    let Some(node_port) = claim_reply(backend, node_addr, client, &reply) else {
        stat(datapath_stat::SNAT_PORT_EXHAUSTED);
        return None;
    };
    let forward = Nat {
        src: node_addr,
        src_port: node_port,
        dst: backend.addr,
        dst_port: backend.port,
        flags: flow_flags::REWRITE_DESTINATION | flow_flags::REWRITE_SOURCE,
        counter,
        last_seen: now,
    };
    if A::record(client, &forward).is_err() {
        stat(datapath_stat::FLOW_INSERT_FORWARD);
        A::forget(&Tuple {
            src: backend.addr,
            dst: node_addr,
            src_port: backend.port,
            dst_port: node_port,
            proto: client.proto,
        });
        return None;
    }
    Some(forward)
}

/// Applies a flow entry's rewrites to the packet; a first fragment's ports are remembered for
/// the rest of its datagram.
#[inline(always)]
fn apply<A: Family>(ctx: &TcContext, packet: &Packet<A>, flow: &Nat<A>) -> Result<(), i64> {
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
fn reverse_nat_error<A: Family>(ctx: &TcContext) -> Option<i32> {
    let error = A::icmp_error(ctx)?;
    let Some(tracked) = A::flow(&error.key) else {
        return Some(TC_ACT_UNSPEC);
    };
    let flow = &tracked.nat;
    let destination =
        if flow.flags & flow_flags::REWRITE_DESTINATION != 0 { flow.dst } else { error.key.dst };
    let route = route_to(ctx, destination);
    Some(send(icmp_error::reverse_nat(ctx, &error, flow), route.as_ref()))
}

/// A later IPv4 fragment (fragment.rs) takes its datagram's rewrites. Everything else the
/// parsers refused is left alone.
#[inline(never)]
fn later_fragment<A: Family>(ctx: &TcContext) -> i32 {
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
    let destination = if flow.flags & flow_flags::REWRITE_DESTINATION != 0 { flow.dst } else { tuple.dst };
    let route = route_to(ctx, destination);
    send(fragment::rewrite_addresses(ctx, &tuple, &flow), route.as_ref())
}

/// A later fragment no flow explains: dropped when it goes to a service address (it cannot
/// reach the right backend, and must not be routed on with a service address), else none of
/// vipr's business.
#[inline(always)]
fn unplaced_fragment<A: Family>(dst: &A) -> i32 {
    if A::unmatched(dst).is_some() {
        TC_ACT_SHOT
    } else {
        TC_ACT_UNSPEC
    }
}

/// Sends a rewritten packet on its way: straight to the next hop when the node forwards it,
/// else into the stack.
#[inline(always)]
fn send<A>(rewritten: Result<(), i64>, route: Option<&Route<A>>) -> i32 {
    match (rewritten, route) {
        (Ok(()), Some(route)) => redirect(route),
        (Ok(()), None) => TC_ACT_OK,
        // Half-rewritten packets must not escape.
        (Err(_), _) => TC_ACT_SHOT,
    }
}
