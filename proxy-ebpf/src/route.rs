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
    bindings::{
        bpf_check_mtu_flags::BPF_MTU_CHK_SEGS, bpf_fib_lookup, BPF_FIB_LKUP_RET_FRAG_NEEDED,
        BPF_FIB_LKUP_RET_NO_NEIGH, BPF_FIB_LKUP_RET_SUCCESS, BPF_FIB_LOOKUP_SKIP_NEIGH, BPF_FIB_LOOKUP_SRC,
    },
    helpers::{bpf_check_mtu, bpf_fib_lookup as fib_lookup, bpf_redirect, bpf_redirect_neigh},
    programs::TcContext,
    EbpfContext as _,
};

use proxy_common::{flow_flags, forwarding, NextHop};

use crate::{
    family::{Address, Tracked},
    family_maps::{no_hop, Maps},
    maps::{load_time_setting, ROUTE_GENERATION},
    packet::bytes_at,
};

/// `--bpf-forwarding` ([`forwarding::STACK`] or [`forwarding::REDIRECT`]), written by the agent
/// at load time. Read-only data: the verifier knows its value and drops the other path.
#[unsafe(no_mangle)]
static VIPR_FORWARDING: u8 = forwarding::STACK;

/// Whether forwarded packets are redirected past the stack (`--bpf-forwarding=redirect`).
#[inline(always)]
pub fn redirecting() -> bool {
    load_time_setting(&VIPR_FORWARDING) == forwarding::REDIRECT
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
    /// Whether the packet fits that MTU (a GSO packet's segments do).
    pub fits: bool,
}

/// `None` when the destination is not forwarded: local to the node, or unreachable, or when the
/// packet does not fit its egress device. The stack then handles the packet as it would have
/// (fragments it, or answers "fragmentation needed").
#[inline(always)]
pub fn route_fitting<A: Address>(ctx: &TcContext, destination: A) -> Option<Route<A>> {
    route(ctx, destination, false)
}

/// [`route_fitting`], but a packet too big for its egress device still has its route, without
/// `fits`: the kernel checks the packet's size after a lookup without a length (`tot_len` 0),
/// which is then whole.
#[inline(always)]
pub fn route_to<A: Address>(ctx: &TcContext, destination: A) -> Option<Route<A>> {
    route(ctx, destination, true)
}

/// One lookup for [`route_to`] and [`route_fitting`]: a parameter, not a filter of the answer,
/// since an `Option` filtered after its inlined construction left a register read that the
/// verifier refuses (its `None` carried an undefined payload).
#[inline(always)]
fn route<A: Address>(ctx: &TcContext, destination: A, too_big_too: bool) -> Option<Route<A>> {
    let mut params = MaybeUninit::<bpf_fib_lookup>::uninit();
    let (result, params) =
        fib(ctx, destination, &mut params, BPF_FIB_LOOKUP_SRC | BPF_FIB_LOOKUP_SKIP_NEIGH, 0);
    let fits = result == BPF_FIB_LKUP_RET_SUCCESS as i64;
    if !fits && !(too_big_too && result == BPF_FIB_LKUP_RET_FRAG_NEEDED as i64) {
        return None;
    }
    // The lookup leaves the next hop in the destination's place: the gateway, if the route
    // has one. Without a length to check, it reports the egress device's MTU.
    let via_gateway = !A::fib_next_hop(params).is(&destination);
    // SAFETY: a lookup without `tot_len` that found the route fills `mtu_result`.
    let mtu = u32::from(unsafe { params.__bindgen_anon_1.mtu_result });
    Some(Route { ifindex: params.ifindex, source: A::fib_source(params), via_gateway, mtu, fits })
}

/// One FIB lookup toward `destination` from the packet's interface, with `flags`, for a packet
/// of `tot_len` bytes (0: the skb's, checked against the device's MTU).
#[inline(always)]
fn fib<'p, A: Address>(
    ctx: &TcContext,
    destination: A,
    params: &'p mut MaybeUninit<bpf_fib_lookup>,
    flags: u32,
    tot_len: u32,
) -> (i64, &'p mut bpf_fib_lookup) {
    let params = zeroed_fib_params(params);
    // SAFETY: ctx wraps a valid __sk_buff for the whole program run.
    params.ifindex = unsafe { (*ctx.skb.skb).ifindex };
    // An IP packet's length fits 16 bits; a larger one is checked as the skb (0).
    params.__bindgen_anon_1.tot_len = u16::try_from(tot_len).unwrap_or(0);
    A::fib_destination(params, destination);
    // SAFETY: valid parameters of the size passed, for the helper's whole call.
    let result = unsafe { fib_lookup(ctx.as_ptr(), params, size_of::<bpf_fib_lookup>() as i32, flags) };
    (result, params)
}

/// The route generation's low 24 bits (those a flow entry keeps), 0 when no agent watches the
/// routes: then nothing is cached.
#[inline(always)]
pub fn route_generation() -> u32 {
    ROUTE_GENERATION
        .get(&0)
        .map_or(0, |generation| generation & (u32::MAX >> flow_flags::ROUTE_GENERATION_SHIFT))
}

/// The next hop cached in a tracked connection's flow entry, if it was cached under
/// `generation` (the current one, from [`route_generation`]; 0: nothing is cached).
#[inline(always)]
pub fn cached_hop<A: Maps>(tracked: &Tracked<A>, generation: u32) -> Option<NextHop> {
    let (flags, cached) = A::route_cache(tracked.track);
    // SAFETY: the entry's flags word, in place in the flows map.
    if generation == 0 || unsafe { flags.as_ptr().read() } >> flow_flags::ROUTE_GENERATION_SHIFT != generation
    {
        return None;
    }
    // SAFETY: the entry's next hop, in place.
    let hop = unsafe { cached.as_ptr().read() };
    (hop.ifindex != 0).then_some(hop)
}

/// Caches `hop` in a tracked connection's flow entry under `generation` (non-zero).
///
/// Two CPUs caching at once for one entry write the same hop unless the routes changed between
/// their lookups; a torn mix then lives until the next change of generation.
#[inline(always)]
pub fn cache_hop<A: Maps>(tracked: &Tracked<A>, hop: NextHop, generation: u32) {
    let (flags, cached) = A::route_cache(tracked.track);
    // SAFETY: the entry's fields, in place; the flags below the generation never change after
    // the entry is created.
    unsafe {
        cached.as_ptr().write(hop);
        let flags = flags.as_ptr();
        flags.write((flags.read() & flow_flags::MASK) | generation << flow_flags::ROUTE_GENERATION_SHIFT);
    }
}

/// [`look_up_hop`]'s length for a GSO packet, whose IP length is its segments' sum: the kernel
/// then checks its segments against the device's MTU only.
const SEGMENTS: u32 = u32::MAX;

/// A hop is cached only where its device's MTU, and its route's, are at least this (IPv6's
/// minimum MTU, below every Ethernet, overlay or tunnel device in a cluster), so that a packet
/// of at most this many bytes needs no check on a cached hop: the helper call would cost the
/// established path a tenth of its time. An MTU that changes later moves the route generation
/// (route_generation.rs watches links), which drops the cached hop.
const UNCHECKED_UP_TO: u32 = 1280;

/// Whether a hop whose route has an MTU of `route_mtu` and whose device one of `device_mtu`
/// may be cached, by TC or XDP: the route's limit is not below the device's, which the
/// per-packet check asks, and both trust packets up to [`UNCHECKED_UP_TO`] unchecked.
#[inline(always)]
pub fn cacheable_mtus(route_mtu: u32, device_mtu: u32) -> bool {
    route_mtu >= device_mtu && device_mtu >= UNCHECKED_UP_TO
}

/// Where a tracked connection's packet goes on.
pub enum Onward {
    /// Toward this hop (ifindex 0: not forwarded, the stack's).
    Hop(NextHop),
    /// Too big for its way, whose MTU this is.
    TooBig(u32),
}

/// The next hop of a tracked connection's packet toward `destination`: the one cached in its
/// flow entry while the routes and neighbours are those it was cached under, else looked up
/// and cached. An empty hop ([`no_hop`]) when the destination is not forwarded (not cached: the lookup is
/// repeated, as for an untracked packet). Only `--bpf-forwarding=redirect` needs the
/// neighbour's address: a lookup that finds the route but no resolved neighbour yields a hop
/// the kernel resolves (`bpf_redirect_neigh`), not cached, so that a later packet caches the
/// neighbour once it is known. With `stack` a cached hop only says "forwarded" (XDP, which
/// needs the neighbour, then looks it up and caches it with the neighbour: xdp.rs).
///
/// A packet of `ip_len` bytes (its IP header's length; 0: not checked, the stack checks it) is
/// checked as the kernel's forwarding would: on a cached hop against its device's MTU
/// (`bpf_check_mtu`: the cache holds the device, not its MTU) when larger than
/// [`UNCHECKED_UP_TO`], in a lookup against the route's (a GSO packet's segments against the
/// device's). A hop whose route has a smaller MTU than its device is never cached, so its
/// packets always meet the route's.
#[inline(always)]
pub fn tracked_hop<A: Address + Maps>(
    ctx: &TcContext,
    destination: A,
    tracked: &Tracked<A>,
    ip_len: u32,
) -> Onward {
    let generation = route_generation();
    if let Some(hop) = cached_hop(tracked, generation) {
        // A GSO packet this short has segments shorter still.
        if ip_len <= UNCHECKED_UP_TO {
            return Onward::Hop(hop);
        }
        // 0: the skb's own length, a GSO packet's segments each (BPF_MTU_CHK_SEGS).
        let mut mtu = 0;
        // SAFETY: a plain helper call; `mtu` lives across it and holds the device's MTU after.
        if unsafe { bpf_check_mtu(ctx.as_ptr(), hop.ifindex, &mut mtu, 0, u64::from(BPF_MTU_CHK_SEGS)) } == 0
        {
            return Onward::Hop(hop);
        }
        return Onward::TooBig(mtu);
    }
    // SAFETY: ctx wraps a valid __sk_buff for the whole program run.
    let asked = if ip_len != 0 && unsafe { (*ctx.skb.skb).gso_size } != 0 { SEGMENTS } else { ip_len };
    let mut hop = no_hop();
    match look_up_hop(ctx, &destination, &mut hop, asked) {
        HOP_NONE => Onward::Hop(no_hop()),
        HOP_CACHEABLE => {
            if generation != 0 {
                cache_hop(tracked, hop, generation);
            }
            Onward::Hop(hop)
        }
        too_big_for if too_big_for < 0 => Onward::TooBig(too_big_for.unsigned_abs()),
        _ => Onward::Hop(hop),
    }
}

/// [`look_up_hop`]'s answers: no forwarded route; a hop to cache; a hop whose neighbour the
/// kernel resolves, or whose route's MTU is below its device's, not to cache. A negative
/// answer: the packet is too big for the route, whose MTU is its magnitude.
const HOP_NONE: i32 = 0;
const HOP_CACHEABLE: i32 = 1;
const HOP_UNCACHED: i32 = 2;

/// The FIB lookup of [`tracked_hop`], into `hop`, checking `tot_len` bytes of IP packet
/// against the route's MTU (0: unchecked; [`SEGMENTS`]: a GSO packet). A function of its own (a
/// BPF-to-BPF call), so that its parameters never add up with the packet path's frame (BPF's
/// 512 bytes over a call chain); an `i32` answer, since a returned struct would travel through
/// the caller's stack.
#[inline(never)]
fn look_up_hop<A: Address>(ctx: &TcContext, destination: &A, hop: &mut NextHop, tot_len: u32) -> i32 {
    let mut params = MaybeUninit::<bpf_fib_lookup>::uninit();
    let redirect = redirecting();
    let flags = if redirect { 0 } else { BPF_FIB_LOOKUP_SKIP_NEIGH };
    let asked = if tot_len == SEGMENTS { 0 } else { tot_len };
    let (result, params) = fib(ctx, *destination, &mut params, flags, asked);
    hop.ifindex = params.ifindex;
    // SAFETY: a lookup reports an MTU here: the route's when given a length (also when the
    // packet exceeds it), else the device's.
    let mtu = u32::from(unsafe { params.__bindgen_anon_1.mtu_result });
    if result == BPF_FIB_LKUP_RET_FRAG_NEEDED as i64 {
        return -(mtu.min(i32::MAX as u32) as i32).max(1);
    }
    if result == BPF_FIB_LKUP_RET_NO_NEIGH as i64 && redirect {
        return HOP_UNCACHED;
    }
    if result != BPF_FIB_LKUP_RET_SUCCESS as i64 {
        return HOP_NONE;
    }
    if redirect {
        hop.dst_mac = params.dmac;
        hop.src_mac = params.smac;
    }
    // A GSO packet's lookup does not know the route's MTU: not cached (the connection's next
    // packet of another kind caches it). Unchecked (0), `mtu` is the device's: the hop must
    // still suit a packet checked later (a first fragment's, XDP's), whose check trusts the
    // rule below.
    if tot_len == SEGMENTS {
        return HOP_UNCACHED;
    }
    // Any non-zero length: only the device's MTU, written back, is wanted.
    let mut device_mtu = 1;
    // SAFETY: a plain helper call; `device_mtu` lives across it.
    let known = unsafe { bpf_check_mtu(ctx.as_ptr(), params.ifindex, &mut device_mtu, 0, 0) } >= 0;
    if known && cacheable_mtus(mtu, device_mtu) {
        HOP_CACHEABLE
    } else {
        HOP_UNCACHED
    }
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

/// The hop of an untracked packet's `route` (ifindex 0: not forwarded), without its neighbour:
/// the kernel resolves that ([`redirect_to_hop`]).
#[inline(always)]
pub fn hop_of<A>(route: Option<&Route<A>>) -> NextHop {
    let mut hop = no_hop();
    if let Some(route) = route {
        hop.ifindex = route.ifindex;
    }
    hop
}

/// Sends the packet out of `hop`'s interface: to its neighbour's address when the hop has it
/// (cached), else resolved by the kernel.
#[inline(always)]
pub fn redirect_to_hop(ctx: &TcContext, hop: &NextHop) -> i32 {
    if hop.dst_mac == [0; 6] {
        // SAFETY: no parameters: the kernel looks the neighbour up from the packet's destination.
        return unsafe { bpf_redirect_neigh(hop.ifindex, core::ptr::null_mut(), 0, 0) as i32 };
    }
    // The Ethernet header's destination and source, as the neighbour's output would write them
    // (every packet that gets here was parsed past them).
    let (Some(dst), Some(src)) = (bytes_at::<6>(ctx, 0), bytes_at::<6>(ctx, 6)) else {
        return TC_ACT_SHOT;
    };
    // SAFETY: inside the frame, checked above.
    unsafe {
        *dst = hop.dst_mac;
        *src = hop.src_mac;
    }
    // SAFETY: a plain helper call.
    unsafe { bpf_redirect(hop.ifindex, 0) as i32 }
}

const TC_ACT_SHOT: i32 = 2;
