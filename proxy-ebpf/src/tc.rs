use aya_ebpf::{helpers::bpf_get_prandom_u32, macros::classifier, programs::TcContext};
use proxy_common::{flow_kind, Backend4, BackendSlot, Flow4, FlowKey4, ServiceKey4};

use crate::{
    maps::{BACKENDS4, FLOWS4, SERVICES4},
    packet::{parse_ipv4_l4, rewrite, Ipv4L4, Side},
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
        let side = if flow.kind == flow_kind::FROM_BACKEND { Side::Source } else { Side::Destination };
        return verdict(rewrite(ctx, packet, side, flow.nat_addr, flow.nat_port));
    }
    let frontend = ServiceKey4 {
        addr: packet.flow.dst_addr,
        port: packet.flow.dst_port,
        proto: packet.flow.proto,
        pad: 0,
    };
    let Some(service) = SERVICES4.get(&frontend) else {
        return TC_ACT_UNSPEC;
    };
    if service.backend_count == 0 {
        return TC_ACT_SHOT;
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
    track(packet, &backend);
    verdict(rewrite(ctx, packet, Side::Destination, backend.addr, backend.port))
}

/// Records both directions of a new connection. A failed insert only costs a fresh
/// balancing decision for the next packet, so it does not drop this one.
#[inline(always)]
fn track(packet: &Ipv4L4, backend: &Backend4) {
    let to_backend =
        Flow4 { nat_addr: backend.addr, nat_port: backend.port, kind: flow_kind::TO_BACKEND, pad: 0 };
    let reply = FlowKey4 {
        src_addr: backend.addr,
        dst_addr: packet.flow.src_addr,
        src_port: backend.port,
        dst_port: packet.flow.src_port,
        proto: packet.flow.proto,
        pad: [0; 3],
    };
    let from_backend = Flow4 {
        nat_addr: packet.flow.dst_addr,
        nat_port: packet.flow.dst_port,
        kind: flow_kind::FROM_BACKEND,
        pad: 0,
    };
    let _ = FLOWS4.insert(&reply, &from_backend);
    let _ = FLOWS4.insert(&packet.flow, &to_backend);
}

#[inline(always)]
fn verdict(result: Result<(), i64>) -> i32 {
    match result {
        Ok(()) => TC_ACT_OK,
        // Half-rewritten packets must not escape.
        Err(_) => TC_ACT_SHOT,
    }
}
