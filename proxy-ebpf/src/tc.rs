use core::ptr::NonNull;

use aya_ebpf::{
    helpers::{bpf_get_prandom_u32, bpf_ktime_get_coarse_ns},
    macros::classifier,
    programs::TcContext,
};
use proxy_common::{
    capacity, datapath_stat, flow_flags, flow_state, proto, service_flags, source_class, unmatched,
    BackendSlot, FlowTrack, Service,
};

use crate::{
    affinity,
    family::Tracked,
    family::{Endpoint, Family, Ipv4, Ipv6, Nat},
    fragment::{self, LaterFragment},
    icmp_error,
    maps::{BACKEND_COUNTERS, DATAPATH_STATS, POD_INTERFACES},
    packet::{
        ethertype, rewrite, Packet, Side, Tuple, ETH_P_IP, ETH_P_IPV6, TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN,
    },
    route::{claim_reply, redirect, redirecting, route_to, Route},
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
    match balance::<A>(ctx) {
        NOT_BALANCED => {}
        NEW_CONNECTION => {
            // A full flows map: early drop, and the decision taken anew (nothing was stored).
            // Here, from the entry, so that the frames of the two never add up.
            let verdict = balance_new::<A>(ctx, false);
            if verdict != MAP_FULL {
                return verdict;
            }
            make_room::<A>();
            return balance_new::<A>(ctx, true);
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

/// Why a new connection could not be tracked.
pub(crate) enum Refusal {
    /// The flows map is full; nothing was stored or counted.
    MapFull,
    /// No masquerade port was free among those tried; nothing stored or counted.
    PortsTaken,
    /// Counted in `datapath_stat`; nothing stored.
    Counted,
}

/// The datapath of a tracked connection, for one family: IPv4 and IPv6 packets take the same
/// steps, on their own maps. [`NOT_BALANCED`] for a packet that is not TCP/UDP with ports,
/// [`NEW_CONNECTION`] for one without a flow entry. (Not an `Option`: that can be returned
/// through the caller's stack, with the stack pointer left in R0, which the verifier refuses.)
/// A new connection is a separate call from the entry, so that this frame and
/// [`balance_new`]'s never add up (BPF's 512 bytes over a call chain).
#[inline(never)]
fn balance<A: Family>(ctx: &TcContext) -> i32 {
    match A::parse(ctx) {
        Some(packet) => balance_packet(ctx, packet),
        None => NOT_BALANCED,
    }
}

#[inline(always)]
fn balance_packet<A: Family>(ctx: &TcContext, packet: Packet<A>) -> i32 {
    if let Some(tracked) = A::flow(&packet.flow) {
        let flow = tracked.nat;
        count(ctx, flow.counter);
        observe(&packet.flow, &tracked, packet.tcp_flags);
        let destination =
            if flow.flags & flow_flags::REWRITE_DESTINATION != 0 { flow.dst } else { packet.flow.dst };
        let route = route_to(ctx, destination);
        return forward(ctx, &packet, &flow, route.as_ref());
    }
    NEW_CONNECTION
}

/// The first packet of a connection: choose its backend, track it, rewrite it. The packet is
/// parsed again (what [`balance`] parsed is in its frame, gone by now): a few instructions,
/// only for new connections. [`MAP_FULL`] when the flows map is full, unless `last_try`: then
/// the connection is refused (counted, its packet dropped).
#[inline(never)]
fn balance_new<A: Family>(ctx: &TcContext, last_try: bool) -> i32 {
    let Some(packet) = A::parse(ctx) else {
        return TC_ACT_UNSPEC;
    };
    let packet = &packet;
    // At TC ingress the packet's device is the one it entered through.
    let entered_through = unsafe { (*ctx.skb.skb).ifindex };
    let Some(service) = A::service(&packet.flow, classify(&packet.flow.src, entered_through)) else {
        return unmatched_destination(ctx, packet);
    };
    if service.flags & service_flags::SOURCE_RANGES != 0
        && !A::in_source_ranges(service.service_id, &packet.flow.src)
    {
        return TC_ACT_SHOT;
    }
    if service.backend_count == 0 {
        return no_backend(ctx, packet, &service);
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
        track_masqueraded(packet, &backend, counter, route.source, now, last_try)
    } else {
        track(packet, &backend, counter, now, last_try)
    };
    let forward = match forward {
        Ok(forward) => forward,
        Err(Refusal::MapFull) => return MAP_FULL,
        Err(_) => return TC_ACT_SHOT,
    };
    count(ctx, counter);
    self::forward(ctx, packet, &forward, route.as_ref())
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

/// [`touch`], and the connection's progress through its handshake (`flow_state`), in both of
/// its entries: the first reply (a SYN-ACK for TCP) marks it answered; the client's next
/// packet after that (for TCP an ACK) marks it established. Each happens once per connection, so the lookup
/// of the other entry is paid once, not per packet. Entries of an earlier vipr, which do not
/// track the handshake, are left as they are.
#[inline(always)]
pub(crate) fn observe<A: Family>(key: &Tuple<A>, tracked: &Tracked<A>, tcp_flags: u8) {
    touch(tracked.track, tcp_flags);
    let nat = &tracked.nat;
    let state = nat.state;
    if state & flow_state::HANDSHAKE_TRACKED == 0 {
        return;
    }
    let progress = if nat.flags & flow_flags::REPLY != 0 {
        if tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN | TCP_ACK {
            flow_state::REPLIED | flow_state::SYN_ACK
        } else {
            flow_state::REPLIED
        }
    } else if state & flow_state::REPLIED != 0
        && (key.proto != proto::TCP || tcp_flags & (TCP_SYN | TCP_ACK | TCP_RST) == TCP_ACK)
    {
        flow_state::ESTABLISHED
    } else {
        0
    };
    if progress & !state != 0 {
        advance(key, nat, tracked.track, progress);
    }
}

/// Sets `progress` in an entry and in its partner. A function of its own (a BPF-to-BPF call):
/// the partner's key inlined into the packet path's frame took it past BPF's 512 bytes.
#[inline(never)]
fn advance<A: Family>(key: &Tuple<A>, nat: &Nat<A>, track: NonNull<FlowTrack>, progress: u32) {
    // SAFETY: the entry's tracking fields, in place; other writers only set bits too.
    unsafe { (*track.as_ptr()).state |= progress };
    A::mark(&partner(key, nat), progress);
}

/// The key of the other direction's entry of a connection, from one entry's key and rewrites:
/// its packets leave rewritten, and the other direction travels that tuple backwards.
#[inline(always)]
pub(crate) fn partner<A: Family>(key: &Tuple<A>, nat: &Nat<A>) -> Tuple<A> {
    let (src, src_port) = if nat.flags & flow_flags::REWRITE_SOURCE != 0 {
        (nat.src, nat.src_port)
    } else {
        (key.src, key.src_port)
    };
    let (dst, dst_port) = if nat.flags & flow_flags::REWRITE_DESTINATION != 0 {
        (nat.dst, nat.dst_port)
    } else {
        (key.dst, key.dst_port)
    };
    Tuple { src: dst, dst: src, src_port: dst_port, dst_port: src_port, proto: key.proto }
}

/// `flow_state` of both entries of a new connection: tracked from its first packet, a SYN
/// (a handshake) or not (picked up mid-stream).
#[inline(always)]
fn initial_state<A>(packet: &Packet<A>) -> u32 {
    if packet.tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN {
        flow_state::HANDSHAKE_TRACKED | flow_state::SYN
    } else {
        flow_state::HANDSHAKE_TRACKED
    }
}

/// Whether a map update failed because the map is full.
#[inline(always)]
pub(crate) fn is_full(error: i64) -> bool {
    error == -E2BIG || error == -ENOMEM
}

const E2BIG: i64 = 7;
const ENOMEM: i64 = 12;

/// Early drop, as conntrack's when its table is full: takes the oldest connections off the
/// queue of recent new connections (`vipr_edrop4_v1`) and deletes both entries of the first
/// one that may be evicted (`flow_state::evictable`: never an established connection or a UDP
/// stream), passing over those that are gone or established. A candidate whose client sent
/// its last packet less than `EARLY_DROP_MIN_AGE_NS` ago is spared, and with it every younger
/// one (a handshake in flight): `false`, and the new connection is refused. At most
/// [`EARLY_DROP_CANDIDATES`] are looked at, so the cost is bounded. (Between the check and the
/// deletion the client's ACK may establish the candidate on another CPU: a window of a few
/// instructions, which conntrack closes with a lock.)
#[inline(never)]
pub(crate) fn make_room<A: Family>() -> bool {
    let now = unsafe { bpf_ktime_get_coarse_ns() };
    let mut looked = 0;
    while looked < EARLY_DROP_CANDIDATES {
        looked += 1;
        let Some(key) = A::early_drop_head() else {
            return false;
        };
        let Some(tracked) = A::flow(&key) else {
            A::early_drop_pop();
            continue;
        };
        // SAFETY: the entry's tracking fields: their values as of now, not of the lookup.
        let (state, last_seen) =
            unsafe { ((*tracked.track.as_ptr()).state, (*tracked.track.as_ptr()).last_seen) };
        if !flow_state::evictable(state) || tracked.nat.flags & flow_flags::REPLY != 0 {
            A::early_drop_pop();
            continue;
        }
        if now.wrapping_sub(last_seen) < capacity::EARLY_DROP_MIN_AGE_NS {
            return false;
        }
        A::early_drop_pop();
        A::forget(&partner(&key, &tracked.nat));
        A::forget(&key);
        stat(datapath_stat::EARLY_DROP);
        return true;
    }
    false
}

/// Queue entries [`make_room`] looks at, at most.
const EARLY_DROP_CANDIDATES: u32 = 8;

/// The source class of a packet from `source` that entered through interface
/// `entered_through`: the node's own, a pod's (by the local-traffic detector: its CIDRs, or
/// the pod interfaces, whichever the agent filled), or anything else.
#[inline(always)]
pub(crate) fn classify<A: Family>(source: &A, entered_through: u32) -> u8 {
    if A::is_node(source) {
        source_class::NODE
    } else if A::in_pod_cidr(source) || POD_INTERFACES.contains(&entered_through) {
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

/// Records both directions of a new connection that keeps its source (or only its address,
/// when its reply tuple is taken); an error when the flows
/// map is full, and the caller drops the packet: a connection whose replies could not be
/// reverse-NATed, or whose next packet could go to another backend, must not start. Unless
/// `last_try`, a full map is [`Refusal::MapFull`], not counted: the caller makes room and
/// tries again. `now` is the clock reading the caller took for the whole decision (affinity,
/// `last_seen`).
#[inline(always)]
pub(crate) fn track<A: Family>(
    packet: &Packet<A>,
    backend: &Endpoint<A>,
    counter: u32,
    now: u64,
    last_try: bool,
) -> Result<Nat<A>, Refusal> {
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
        state: initial_state(packet),
    };
    let forward = Nat {
        src: A::UNSPECIFIED,
        src_port: 0,
        dst: backend.addr,
        dst_port: backend.port,
        flags: flow_flags::REWRITE_DESTINATION,
        counter,
        last_seen: now,
        state: initial_state(packet),
    };
    match A::claim(&reply_key, &reply) {
        Ok(()) => {}
        Err(error) if is_full(error) => {
            return Err(refuse(error, last_try, datapath_stat::FLOW_INSERT_REPLY))
        }
        // Another connection's replies already come back on this tuple: the same client port
        // reached the same backend through another frontend (or this one, while the old
        // connection's entries live on). Overwriting its reply entry would hand its replies to
        // this connection, and deleting it later would strand them. As the kernel's NAT does
        // on such a clash, the new connection gets another source port (its address kept).
        Err(_) => {
            stat(datapath_stat::REPLY_CLASH_REMAPPED);
            return track_masqueraded(packet, backend, counter, client.src, now, last_try);
        }
    }
    if let Err(error) = A::record(client, &forward) {
        A::forget(&reply_key);
        return Err(refuse(error, last_try, datapath_stat::FLOW_INSERT_FORWARD));
    }
    A::remember_new(client);
    Ok(forward)
}

/// A failed insert: [`Refusal::MapFull`] for a full map unless `last_try`, else counted as
/// `stat`.
#[inline(always)]
fn refuse(error: i64, last_try: bool, stat_index: u32) -> Refusal {
    if is_full(error) && !last_try {
        return Refusal::MapFull;
    }
    stat(stat_index);
    Refusal::Counted
}

/// Records a new connection whose source becomes the node's address toward the backend. The
/// reply entry is claimed first, because the (backend, node address, port) tuple is what
/// tells this connection's replies apart from every other one. An error when no port could be
/// claimed (counted) or the flows map is full (as [`track`]): the caller drops the packet.
#[inline(always)]
pub(crate) fn track_masqueraded<A: Family>(
    packet: &Packet<A>,
    backend: &Endpoint<A>,
    counter: u32,
    node_addr: A,
    now: u64,
    last_try: bool,
) -> Result<Nat<A>, Refusal> {
    let client = &packet.flow;
    let reply = Nat {
        src: client.dst,
        src_port: client.dst_port,
        dst: client.src,
        dst_port: client.src_port,
        flags: flow_flags::REPLY | flow_flags::REWRITE_SOURCE | flow_flags::REWRITE_DESTINATION,
        counter,
        last_seen: 0,
        state: initial_state(packet),
    };
    let node_port = match claim_reply(backend, node_addr, client, &reply) {
        Ok(port) => port,
        Err(Refusal::MapFull) if !last_try => return Err(Refusal::MapFull),
        Err(_) => {
            stat(datapath_stat::SNAT_PORT_EXHAUSTED);
            return Err(Refusal::Counted);
        }
    };
    let forward = Nat {
        src: node_addr,
        src_port: node_port,
        dst: backend.addr,
        dst_port: backend.port,
        flags: flow_flags::REWRITE_DESTINATION | flow_flags::REWRITE_SOURCE,
        counter,
        last_seen: now,
        state: initial_state(packet),
    };
    if let Err(error) = A::record(client, &forward) {
        A::forget(&Tuple {
            src: backend.addr,
            dst: node_addr,
            src_port: backend.port,
            dst_port: node_port,
            proto: client.proto,
        });
        return Err(refuse(error, last_try, datapath_stat::FLOW_INSERT_FORWARD));
    }
    A::remember_new(client);
    Ok(forward)
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

/// Hands a balanced packet on: one the node forwards (a `route`) through the stack with only
/// its destination rewritten (`--bpf-forwarding=stack`, the default; route.rs explains why),
/// else rewritten whole and [`send`]. Masqueraded connections and fragments are rewritten whole
/// and redirected on both paths (see route.rs).
#[inline(always)]
fn forward<A: Family>(ctx: &TcContext, packet: &Packet<A>, flow: &Nat<A>, route: Option<&Route<A>>) -> i32 {
    let masqueraded = flow.flags & (flow_flags::REWRITE_SOURCE | flow_flags::REWRITE_DESTINATION)
        == flow_flags::REWRITE_SOURCE | flow_flags::REWRITE_DESTINATION;
    if route.is_some() && !redirecting() && !masqueraded && packet.first_fragment.is_none() {
        return through_stack(ctx, packet, flow);
    }
    send(apply(ctx, packet, flow), route)
}

/// The ingress half of a forwarded packet's NAT: toward the backend its destination, so that
/// routing and netfilter see client -> backend; a reply is left as it is (backend -> client)
/// and gets the frontend as source at egress ([`vipr_tc_egress`]).
#[inline(always)]
fn through_stack<A: Family>(ctx: &TcContext, packet: &Packet<A>, flow: &Nat<A>) -> i32 {
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
/// Everything else leaves untouched.
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
fn egress<A: Family>(ctx: &TcContext) -> i32 {
    let Some(packet) = A::parse(ctx) else {
        return TC_ACT_UNSPEC;
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
