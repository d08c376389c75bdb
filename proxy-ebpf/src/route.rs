//! Where a rewritten packet goes, and source NAT to the node: which address, which port.
//!
//! Rewritten packets are sent straight to the neighbour of the route toward their new
//! destination (`bpf_redirect_neigh`) instead of back into the stack: a masqueraded packet
//! now carries one of the node's own addresses as source, and a reply from a frontend that is
//! a node address (an external IP) too, and the forwarding path would drop both as martians;
//! reverse path filtering would drop replies whose new source (the frontend) is not routed
//! via the interface they came in on.
use aya_ebpf::{
    bindings::{bpf_fib_lookup, BPF_FIB_LKUP_RET_SUCCESS, BPF_FIB_LOOKUP_SKIP_NEIGH, BPF_FIB_LOOKUP_SRC},
    helpers::{bpf_fib_lookup as fib_lookup, bpf_get_prandom_u32, bpf_redirect_neigh},
    programs::TcContext,
    EbpfContext as _,
};
use proxy_common::{Backend4, Flow4, FlowKey4};

use crate::maps::FLOWS4;

const AF_INET: u8 = 2;
/// Ports tried after the client's own, from the range Linux leaves to outgoing connections.
const SNAT_PORT_FIRST: u32 = 32_768;
const SNAT_PORT_COUNT: u32 = 28_232;
const SNAT_PORT_ATTEMPTS: u32 = 8;

/// The route toward an address, from the node's forwarding table.
pub struct Route {
    pub ifindex: u32,
    /// The route's preferred source: the address MASQUERADE would give the packet.
    pub source: [u8; 4],
}

/// `None` when the destination is not forwarded: local to the node, or unreachable. The stack
/// then handles the packet as it would have.
#[inline(always)]
pub fn route_to(ctx: &TcContext, destination: [u8; 4]) -> Option<Route> {
    // SAFETY: bpf_fib_lookup is plain data; all-zero is a valid initial value.
    let mut params: bpf_fib_lookup = unsafe { core::mem::zeroed() };
    params.family = AF_INET;
    // SAFETY: ctx wraps a valid __sk_buff for the whole program run.
    params.ifindex = unsafe { (*ctx.skb.skb).ifindex };
    params.__bindgen_anon_4.ipv4_dst = u32::from_ne_bytes(destination);
    let result = unsafe {
        fib_lookup(
            ctx.as_ptr(),
            &mut params,
            size_of::<bpf_fib_lookup>() as i32,
            BPF_FIB_LOOKUP_SRC | BPF_FIB_LOOKUP_SKIP_NEIGH,
        )
    };
    if result != BPF_FIB_LKUP_RET_SUCCESS as i64 {
        return None;
    }
    // SAFETY: with BPF_FIB_LOOKUP_SRC a successful lookup fills ipv4_src.
    Some(Route { ifindex: params.ifindex, source: unsafe { params.__bindgen_anon_3.ipv4_src }.to_ne_bytes() })
}

/// Sends the packet out of `route`'s interface; the kernel resolves the next hop's address.
#[inline(always)]
pub fn redirect(route: &Route) -> i32 {
    // SAFETY: no parameters: the kernel looks the neighbour up from the packet's destination.
    unsafe { bpf_redirect_neigh(route.ifindex, core::ptr::null_mut(), 0, 0) as i32 }
}

/// Claims a node port for the replies of a masqueraded connection and stores `reply` under
/// it: the client's own port when it is free toward this backend, else a few random ones.
/// `None` when every attempt is taken.
#[inline(always)]
pub fn claim_reply(backend: &Backend4, node_addr: [u8; 4], client: &FlowKey4, reply: &Flow4) -> Option<u16> {
    let mut key = FlowKey4 {
        src_addr: backend.addr,
        dst_addr: node_addr,
        src_port: backend.port,
        dst_port: client.src_port,
        proto: client.proto,
        pad: [0; 3],
    };
    for _ in 0..SNAT_PORT_ATTEMPTS {
        if FLOWS4.insert_new(&key, reply).is_ok() {
            return Some(key.dst_port);
        }
        key.dst_port = (SNAT_PORT_FIRST + unsafe { bpf_get_prandom_u32() } % SNAT_PORT_COUNT) as u16;
    }
    None
}
