use aya_ebpf::{helpers::bpf_get_prandom_u32, macros::classifier, programs::TcContext};
use proxy_common::{
    flow_flags, service_flags, source_class, unmatched, Backend4, BackendSlot, Flow4, FlowKey4, Prefix4,
    Service, ServiceKey4, SourceRange4,
};

use crate::{
    maps::{BACKENDS4, FLOWS4, NODE_IPS4, POD_CIDRS4, SERVICES4, SOURCE_RANGES4, UNMATCHED4},
    packet::{parse_ipv4_l4, rewrite, Ipv4L4, Side},
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
    match parse_ipv4_l4(&ctx) {
        Some(packet) => balance(&ctx, &packet),
        None => TC_ACT_UNSPEC,
    }
}

#[inline(always)]
fn balance(ctx: &TcContext, packet: &Ipv4L4) -> i32 {
    if let Some(flow) = FLOWS4.get(&packet.flow) {
        let destination = if flow.flags & flow_flags::REWRITE_DESTINATION != 0 {
            flow.dst_addr
        } else {
            packet.flow.dst_addr
        };
        let route = route_to(ctx, destination);
        return send(apply(ctx, packet, &flow), route.as_ref());
    }
    let frontend = ServiceKey4 {
        addr: packet.flow.dst_addr,
        port: packet.flow.dst_port,
        proto: packet.flow.proto,
        source_class: classify(packet.flow.src_addr),
    };
    let Some(service) = SERVICES4.get(&frontend) else {
        return unmatched_destination(ctx, packet);
    };
    if service.flags & service_flags::SOURCE_RANGES != 0 && !admitted(&service, packet.flow.src_addr) {
        return TC_ACT_SHOT;
    }
    if service.backend_count == 0 {
        return no_backend(ctx, packet, &service);
    }
    let slot = BackendSlot {
        backend_set: service.backend_set,
        slot: unsafe { bpf_get_prandom_u32() } % service.backend_count,
    };
    // A miss means the agent retired this set between our two lookups; the client retransmits
    // and meets the new set.
    let Some(backend) = BACKENDS4.get(&slot) else {
        return TC_ACT_SHOT;
    };
    // A pod reaching itself through its service must see the node as peer, or it would answer
    // itself directly and the reply would never be reverse-NATed.
    let hairpin = backend.addr == packet.flow.src_addr;
    let route = route_to(ctx, backend.addr);
    let forward = if service.flags & service_flags::MASQUERADE != 0 || hairpin {
        // Without a route there is no address to masquerade to.
        let Some(route) = &route else {
            return TC_ACT_SHOT;
        };
        match track_masqueraded(packet, &backend, route.source) {
            Some(forward) => forward,
            None => return TC_ACT_SHOT,
        }
    } else {
        track(packet, &backend)
    };
    send(apply(ctx, packet, &forward), route.as_ref())
}

/// The source class of an address: the node's own, a pod's (by the local-traffic
/// detector), or anything else.
#[inline(always)]
fn classify(source: [u8; 4]) -> u8 {
    if NODE_IPS4.contains(&source) {
        source_class::NODE
    } else if POD_CIDRS4.contains(&Prefix4 { prefix_len: 32, addr: source }) {
        source_class::POD
    } else {
        source_class::OUTSIDE
    }
}

#[inline(always)]
fn admitted(service: &Service, source: [u8; 4]) -> bool {
    SOURCE_RANGES4.contains(&SourceRange4 {
        prefix_len: 64,
        service_id: service.service_id.to_be_bytes(),
        addr: source,
    })
}

/// A service address that no frontend matched: a cluster IP on a port it does not serve is
/// rejected, any other address in a service range dropped, everything else left alone.
#[inline(always)]
fn unmatched_destination(ctx: &TcContext, packet: &Ipv4L4) -> i32 {
    match UNMATCHED4.get(&Prefix4 { prefix_len: 32, addr: packet.flow.dst_addr }) {
        Some(unmatched::REJECT) => reject(ctx, packet),
        Some(unmatched::DROP) => TC_ACT_SHOT,
        _ => TC_ACT_UNSPEC,
    }
}

#[inline(always)]
fn no_backend(ctx: &TcContext, packet: &Ipv4L4, service: &Service) -> i32 {
    if service.flags & service_flags::REJECT_WHEN_EMPTY != 0 {
        reject(ctx, packet)
    } else {
        TC_ACT_SHOT
    }
}

#[inline(always)]
fn reject(ctx: &TcContext, packet: &Ipv4L4) -> i32 {
    crate::reject::reject_ipv4(ctx, packet.l4_offset)
}

/// Records both directions of a new connection that keeps its source. A failed insert only
/// costs a fresh balancing decision for the next packet, so it does not drop this one.
#[inline(always)]
fn track(packet: &Ipv4L4, backend: &Backend4) -> Flow4 {
    let client = &packet.flow;
    let reply_key = FlowKey4 {
        src_addr: backend.addr,
        dst_addr: client.src_addr,
        src_port: backend.port,
        dst_port: client.src_port,
        proto: client.proto,
        pad: [0; 3],
    };
    let reply = Flow4 {
        src_addr: client.dst_addr,
        src_port: client.dst_port,
        dst_addr: [0; 4],
        dst_port: 0,
        flags: flow_flags::REPLY | flow_flags::REWRITE_SOURCE,
    };
    let forward = Flow4 {
        src_addr: [0; 4],
        src_port: 0,
        dst_addr: backend.addr,
        dst_port: backend.port,
        flags: flow_flags::REWRITE_DESTINATION,
    };
    let _ = FLOWS4.insert(&reply_key, &reply);
    let _ = FLOWS4.insert(client, &forward);
    forward
}

/// Records a new connection whose source becomes the node's address toward the backend. The
/// reply entry is claimed first, because the (backend, node address, port) tuple is what
/// tells this connection's replies apart from every other one.
#[inline(always)]
fn track_masqueraded(packet: &Ipv4L4, backend: &Backend4, node_addr: [u8; 4]) -> Option<Flow4> {
    let client = &packet.flow;
    let reply = Flow4 {
        src_addr: client.dst_addr,
        src_port: client.dst_port,
        dst_addr: client.src_addr,
        dst_port: client.src_port,
        flags: flow_flags::REPLY | flow_flags::REWRITE_SOURCE | flow_flags::REWRITE_DESTINATION,
    };
    let node_port = claim_reply(backend, node_addr, client, &reply)?;
    let forward = Flow4 {
        src_addr: node_addr,
        src_port: node_port,
        dst_addr: backend.addr,
        dst_port: backend.port,
        flags: flow_flags::REWRITE_DESTINATION | flow_flags::REWRITE_SOURCE,
    };
    let _ = FLOWS4.insert(client, &forward);
    Some(forward)
}

/// Applies a flow entry's rewrites to the packet.
#[inline(always)]
fn apply(ctx: &TcContext, packet: &Ipv4L4, flow: &Flow4) -> Result<(), i64> {
    if flow.flags & flow_flags::REWRITE_DESTINATION != 0 {
        rewrite(ctx, packet, Side::Destination, flow.dst_addr, flow.dst_port)?;
    }
    if flow.flags & flow_flags::REWRITE_SOURCE != 0 {
        rewrite(ctx, packet, Side::Source, flow.src_addr, flow.src_port)?;
    }
    Ok(())
}

/// Sends a rewritten packet on its way: straight to the next hop when the node forwards it,
/// else into the stack.
#[inline(always)]
fn send(rewritten: Result<(), i64>, route: Option<&Route>) -> i32 {
    match (rewritten, route) {
        (Ok(()), Some(route)) => redirect(route),
        (Ok(()), None) => TC_ACT_OK,
        // Half-rewritten packets must not escape.
        (Err(_), _) => TC_ACT_SHOT,
    }
}
