use aya_ebpf::{helpers::bpf_get_prandom_u32, macros::classifier, programs::TcContext};
use proxy_common::{flow_flags, service_flags, source_class, unmatched, BackendSlot, Service};

use crate::{
    family::{Endpoint, Family, Ipv4, Ipv6, Nat},
    packet::{ethertype, rewrite, Packet, Side, Tuple, ETH_P_IP, ETH_P_IPV6},
    route::{claim_reply, redirect, route_to, Route},
};

// Verdicts from linux/pkt_cls.h, typed as the program returns them.
/// vipr did not act: the next program (or the default action) decides.
const TC_ACT_UNSPEC: i32 = -1;
/// vipr rewrote the packet; let it continue.
const TC_ACT_OK: i32 = 0;
const TC_ACT_SHOT: i32 = 2;

#[classifier]
pub fn vipr_tc_ingress(ctx: TcContext) -> i32 {
    match ethertype(&ctx) {
        Some(ETH_P_IP) => balance::<Ipv4>(&ctx),
        Some(ETH_P_IPV6) => balance::<Ipv6>(&ctx),
        _ => TC_ACT_UNSPEC,
    }
}

/// The whole datapath for one family: IPv4 and IPv6 packets take the same steps, on their own
/// maps.
#[inline(always)]
fn balance<A: Family>(ctx: &TcContext) -> i32 {
    let Some(packet) = A::parse(ctx) else {
        return TC_ACT_UNSPEC;
    };
    if let Some(flow) = A::flow(&packet.flow) {
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
    let slot = BackendSlot {
        backend_set: service.backend_set,
        slot: unsafe { bpf_get_prandom_u32() } % service.backend_count,
    };
    // A miss means the agent retired this set between our two lookups; the client retransmits
    // and meets the new set.
    let Some(backend) = A::backend(&slot) else {
        return TC_ACT_SHOT;
    };
    // A pod reaching itself through its service must see the node as peer, or it would answer
    // itself directly and the reply would never be reverse-NATed.
    let hairpin = backend.addr.is(&packet.flow.src);
    let route = route_to(ctx, backend.addr);
    let forward = if service.flags & service_flags::MASQUERADE != 0 || hairpin {
        // Without a route there is no address to masquerade to.
        let Some(route) = &route else {
            return TC_ACT_SHOT;
        };
        match track_masqueraded(&packet, &backend, route.source) {
            Some(forward) => forward,
            None => return TC_ACT_SHOT,
        }
    } else {
        track(&packet, &backend)
    };
    send(apply(ctx, &packet, &forward), route.as_ref())
}

/// The source class of an address: the node's own, a pod's (by the local-traffic
/// detector), or anything else.
#[inline(always)]
fn classify<A: Family>(source: &A) -> u8 {
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

/// Records both directions of a new connection that keeps its source. A failed insert only
/// costs a fresh balancing decision for the next packet, so it does not drop this one.
#[inline(always)]
fn track<A: Family>(packet: &Packet<A>, backend: &Endpoint<A>) -> Nat<A> {
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
    };
    let forward = Nat {
        src: A::UNSPECIFIED,
        src_port: 0,
        dst: backend.addr,
        dst_port: backend.port,
        flags: flow_flags::REWRITE_DESTINATION,
    };
    let _ = A::record(&reply_key, &reply);
    let _ = A::record(client, &forward);
    forward
}

/// Records a new connection whose source becomes the node's address toward the backend. The
/// reply entry is claimed first, because the (backend, node address, port) tuple is what
/// tells this connection's replies apart from every other one.
#[inline(always)]
fn track_masqueraded<A: Family>(packet: &Packet<A>, backend: &Endpoint<A>, node_addr: A) -> Option<Nat<A>> {
    let client = &packet.flow;
    let reply = Nat {
        src: client.dst,
        src_port: client.dst_port,
        dst: client.src,
        dst_port: client.src_port,
        flags: flow_flags::REPLY | flow_flags::REWRITE_SOURCE | flow_flags::REWRITE_DESTINATION,
    };
    let node_port = claim_reply(backend, node_addr, client, &reply)?;
    let forward = Nat {
        src: node_addr,
        src_port: node_port,
        dst: backend.addr,
        dst_port: backend.port,
        flags: flow_flags::REWRITE_DESTINATION | flow_flags::REWRITE_SOURCE,
    };
    let _ = A::record(client, &forward);
    Some(forward)
}

/// Applies a flow entry's rewrites to the packet.
#[inline(always)]
fn apply<A: Family>(ctx: &TcContext, packet: &Packet<A>, flow: &Nat<A>) -> Result<(), i64> {
    if flow.flags & flow_flags::REWRITE_DESTINATION != 0 {
        rewrite(ctx, packet, Side::Destination, flow.dst, flow.dst_port)?;
    }
    if flow.flags & flow_flags::REWRITE_SOURCE != 0 {
        rewrite(ctx, packet, Side::Source, flow.src, flow.src_port)?;
    }
    Ok(())
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
