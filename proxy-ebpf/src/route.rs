//! Where a rewritten packet goes, and the node's address a masqueraded one leaves from (the
//! port is conntrack.rs's).
//!
//! A rewritten packet that the node forwards to another host takes one of two paths, chosen by
//! the agent with `--bpf-forwarding` (the read-only global [`VIPR_FORWARDING`]):
//!
//! - **stack** (the default): the packet goes back into the stack (`TC_ACT_OK`), which routes it
//!   and runs netfilter's FORWARD and POSTROUTING chains on it, so iptables-enforced policy
//!   (Calico's iptables dataplane, kube-router, a plain `iptables -A FORWARD ... -j DROP`)
//!   applies to service traffic as it does behind kube-proxy. As with kube-proxy, the packet
//!   the stack forwards carries the addresses a policy names: client -> backend (TC ingress
//!   only DNATs it), and backend -> client for the reply (TC ingress leaves it alone; the TC
//!   egress program of the outgoing device gives it the frontend as source, once routing,
//!   reverse-path filtering and FORWARD are behind it: a frontend address arriving from a
//!   backend is what strict rp_filter drops, and a node address as a forwarded packet's source
//!   is a martian).
//! - **redirect**: the packet is rewritten whole at ingress and sent straight to the neighbour
//!   of the route toward its new destination (`bpf_redirect_neigh`), which is faster and
//!   bypasses netfilter's FORWARD and POSTROUTING chains, and with them any policy enforced
//!   there.
//!
//! On both paths, packets delivered to the node itself are rewritten whole at ingress (nothing
//! forwards them), and so are, and redirected, three kinds of packets whose egress half would
//! need state the packet at egress does not carry: masqueraded connections (the masquerade
//! port: a connection's packet after DNAT names neither it nor the frontend), IPv4 fragments
//! (a later fragment has no ports) and ICMP errors about tracked connections.
//!
//! Both families take the same path: the lookup is `bpf_fib_lookup` with `AF_INET` or
//! `AF_INET6` (the family fills its address fields, see [`Address::fib_destination`]), and
//! `bpf_redirect_neigh` resolves an IPv4 or IPv6 neighbour by the packet's own protocol.
use core::mem::MaybeUninit;

use aya_ebpf::{
    bindings::{bpf_fib_lookup, BPF_FIB_LKUP_RET_SUCCESS, BPF_FIB_LOOKUP_SKIP_NEIGH, BPF_FIB_LOOKUP_SRC},
    helpers::{bpf_fib_lookup as fib_lookup, bpf_redirect_neigh},
    programs::TcContext,
    EbpfContext as _,
};

use proxy_common::forwarding;

use crate::family::Address;

/// `--bpf-forwarding` ([`forwarding::STACK`] or [`forwarding::REDIRECT`]), written by the agent
/// at load time. Read-only data: the verifier knows its value and drops the other path.
#[unsafe(no_mangle)]
static VIPR_FORWARDING: u8 = forwarding::STACK;

/// Whether forwarded packets are redirected past the stack (`--bpf-forwarding=redirect`).
#[inline(always)]
pub fn redirecting() -> bool {
    // SAFETY: a plain read of a global; volatile so that the compiler does not fold the
    // object's default in (the agent sets the value when it loads the object).
    unsafe { core::ptr::read_volatile(&VIPR_FORWARDING) == forwarding::REDIRECT }
}

/// The route toward an address, from the node's forwarding table.
pub struct Route<A> {
    pub ifindex: u32,
    /// The route's preferred source: the address MASQUERADE would give the packet.
    pub source: A,
    /// The route goes through a gateway (another node, for a pod CIDR routed as CNIs route
    /// them), not straight to the destination on a link: what tells a backend on another
    /// node from one of this node's pods for direct server return.
    pub via_gateway: bool,
    /// The egress device's MTU.
    pub mtu: u32,
}

/// `None` when the destination is not forwarded: local to the node, or unreachable. The stack
/// then handles the packet as it would have.
#[inline(always)]
pub fn route_to<A: Address>(ctx: &TcContext, destination: A) -> Option<Route<A>> {
    let mut params = MaybeUninit::<bpf_fib_lookup>::uninit();
    let params = zeroed_fib_params(&mut params);
    // SAFETY: ctx wraps a valid __sk_buff for the whole program run.
    params.ifindex = unsafe { (*ctx.skb.skb).ifindex };
    A::fib_destination(params, destination);
    let result = unsafe {
        fib_lookup(
            ctx.as_ptr(),
            params,
            size_of::<bpf_fib_lookup>() as i32,
            BPF_FIB_LOOKUP_SRC | BPF_FIB_LOOKUP_SKIP_NEIGH,
        )
    };
    if result != BPF_FIB_LKUP_RET_SUCCESS as i64 {
        return None;
    }
    // The lookup leaves the next hop in the destination's place: the gateway, if the route
    // has one. Without a length to check, it reports the egress device's MTU.
    let via_gateway = !A::fib_next_hop(params).is(&destination);
    // SAFETY: a successful lookup without `tot_len` fills `mtu_result`.
    let mtu = u32::from(unsafe { params.__bindgen_anon_1.mtu_result });
    Some(Route { ifindex: params.ifindex, source: A::fib_source(params), via_gateway, mtu })
}

/// Zeroes FIB lookup parameters in place, one 32-bit store at a time. Any zeroing the compiler
/// can see whole (`mem::zeroed()`, a transmuted `[0u64; 8]`, a struct literal) becomes a call
/// to `memset`, which on BPF stores one byte per loop iteration: ~45 ns on every rewritten
/// packet (docs/benchmarks.md). Volatile stores cannot be merged back into that call.
#[inline(always)]
pub fn zeroed_fib_params(params: &mut MaybeUninit<bpf_fib_lookup>) -> &mut bpf_fib_lookup {
    const WORDS: usize = size_of::<bpf_fib_lookup>() / 4;
    const _: () = assert!(size_of::<bpf_fib_lookup>().is_multiple_of(4) && align_of::<bpf_fib_lookup>() >= 4);
    let words = params.as_mut_ptr().cast::<u32>();
    let mut i = 0;
    while i < WORDS {
        // SAFETY: inside the parameters, 4-aligned (asserted above).
        unsafe { words.add(i).write_volatile(0) };
        i += 1;
    }
    // SAFETY: every byte was written; all-zero is a valid bpf_fib_lookup.
    unsafe { params.assume_init_mut() }
}

/// Sends the packet out of `route`'s interface; the kernel resolves the next hop's address.
#[inline(always)]
pub fn redirect<A>(route: &Route<A>) -> i32 {
    // SAFETY: no parameters: the kernel looks the neighbour up from the packet's destination.
    unsafe { bpf_redirect_neigh(route.ifindex, core::ptr::null_mut(), 0, 0) as i32 }
}
