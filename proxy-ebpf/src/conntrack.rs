//! vipr's connection tracking: the two flow entries of a connection (its forward rewrite and
//! its reply's reverse NAT), claimed when the service decision chose a backend, their
//! handshake progress and last-seen time kept up by every packet, a masquerade port claimed
//! for connections whose source becomes the node's, and early drop when the flows map is full
//! (as the kernel's conntrack does). TC and XDP both track through here.
use core::ptr::NonNull;

use aya_ebpf::helpers::{bpf_get_prandom_u32, bpf_ktime_get_coarse_ns};
use proxy_common::{
    capacity, datapath_stat, flow_flags, flow_state, proto, snat, source_class, FlowTrack, SnatPorts,
};

use crate::{
    counters::stat,
    family::{Endpoint, Nat, Tracked},
    family_maps::Maps,
    maps::SNAT_PORTS,
    packet::{Packet, Tuple, TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN},
};

/// A flow entry's `last_seen` is rewritten only when it is older than this: idle timeouts are
/// minutes to hours, and an established packet should not write its entry every time (a write
/// dirties a cache line other CPUs serving the connection then miss on).
const LAST_SEEN_GRANULARITY_NS: u64 = 1_000_000_000;

/// Why a new connection could not be tracked.
pub(crate) enum Refusal {
    /// The flows map is full; nothing was stored or counted.
    MapFull,
    /// No masquerade port was free among those tried; nothing stored or counted.
    PortsTaken,
    /// Counted in `datapath_stat`; nothing stored.
    Counted,
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
pub(crate) fn observe<A: Maps>(key: &Tuple<A>, tracked: &Tracked<A>, tcp_flags: u8) {
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
    } else if nat.flags & flow_flags::DSR_INGRESS != 0
        && (key.proto != proto::TCP || tcp_flags & (TCP_SYN | TCP_ACK | TCP_RST) == TCP_ACK)
    {
        // Direct server return: the replies bypass this node, so the client's own packets
        // tell: its ACK after the SYN acknowledges the SYN-ACK, a second datagram makes a
        // stream (as a reply and the next datagram would).
        flow_state::REPLIED | flow_state::ESTABLISHED
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
fn advance<A: Maps>(key: &Tuple<A>, nat: &Nat<A>, track: NonNull<FlowTrack>, progress: u32) {
    // SAFETY: the entry's tracking fields, in place; other writers only set bits too.
    unsafe { (*track.as_ptr()).state |= progress };
    A::mark(&partner(key, nat), progress);
}

/// The key of the other direction's entry of a connection, from one entry's key and rewrites:
/// its packets leave rewritten, and the other direction travels that tuple backwards.
#[inline(always)]
pub(crate) fn partner<A: Maps>(key: &Tuple<A>, nat: &Nat<A>) -> Tuple<A> {
    // On a DSR backend's node the request arrives already rewritten: the entries are each
    // other's reversal, whatever the reply entry rewrites.
    if nat.flags & flow_flags::DSR_BACKEND != 0 {
        return Tuple {
            src: key.dst,
            dst: key.src,
            src_port: key.dst_port,
            dst_port: key.src_port,
            proto: key.proto,
        };
    }
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
pub(crate) fn make_room<A: Maps>() -> bool {
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

/// The flags a new connection's forward entry gets for its client's source `class`.
#[inline(always)]
fn origin(class: u8) -> u32 {
    if class == source_class::OUTSIDE {
        flow_flags::FROM_OUTSIDE
    } else {
        0
    }
}

/// Records both directions of a new connection that keeps its source (or only its address,
/// when its reply tuple is taken); an error when the flows
/// map is full, and the caller drops the packet: a connection whose replies could not be
/// reverse-NATed, or whose next packet could go to another backend, must not start. Unless
/// `last_try`, a full map is [`Refusal::MapFull`], not counted: the caller makes room and
/// tries again. `now` is the clock reading the caller took for the whole decision (affinity,
/// `last_seen`), `class` the client's source class.
#[inline(always)]
pub(crate) fn track<A: Maps>(
    packet: &Packet<A>,
    backend: &Endpoint<A>,
    counter: u32,
    class: u8,
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
        flags: flow_flags::REWRITE_DESTINATION | origin(class),
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
            return track_masqueraded(packet, backend, counter, class, client.src, now, last_try);
        }
    }
    if let Err(error) = A::record(client, &forward) {
        A::forget(&reply_key);
        return Err(refuse(error, last_try, datapath_stat::FLOW_INSERT_FORWARD));
    }
    A::remember_new(client);
    Ok(forward)
}

/// Records a new connection sent to a backend on another node by direct server return: only
/// its forward entry (destination rewritten, source kept), since its replies never come back
/// through this node. Errors as [`track`].
#[inline(always)]
pub(crate) fn track_dsr<A: Maps>(
    packet: &Packet<A>,
    backend: &Endpoint<A>,
    counter: u32,
    class: u8,
    now: u64,
    last_try: bool,
) -> Result<Nat<A>, Refusal> {
    let forward = Nat {
        src: A::UNSPECIFIED,
        src_port: 0,
        dst: backend.addr,
        dst_port: backend.port,
        flags: flow_flags::REWRITE_DESTINATION | flow_flags::DSR_INGRESS | origin(class),
        counter,
        last_seen: now,
        state: initial_state(packet),
    };
    if let Err(error) = A::record(&packet.flow, &forward) {
        return Err(refuse(error, last_try, datapath_stat::FLOW_INSERT_FORWARD));
    }
    A::remember_new(&packet.flow);
    Ok(forward)
}

/// Records, on a backend's node, a DSR connection whose request carried its service address
/// `frontend` (dsr.rs): the reply entry (backend -> client) gives replies that address as
/// source, the forward entry (client -> backend, as the requests arrive) tracks the client's
/// side. Stored whatever was there (a request's option is the newest word on its tuple); not
/// counted per service (counter 0): the ingress node counts the requests. Errors as [`track`].
#[inline(always)]
pub(crate) fn track_dsr_backend<A: Maps>(
    packet: &Packet<A>,
    frontend: &Endpoint<A>,
    last_try: bool,
) -> Result<(), Refusal> {
    let client = &packet.flow;
    let now = unsafe { bpf_ktime_get_coarse_ns() };
    let reply_key = Tuple {
        src: client.dst,
        dst: client.src,
        src_port: client.dst_port,
        dst_port: client.src_port,
        proto: client.proto,
    };
    let reply = Nat {
        src: frontend.addr,
        src_port: frontend.port,
        dst: A::UNSPECIFIED,
        dst_port: 0,
        flags: flow_flags::REPLY | flow_flags::REWRITE_SOURCE | flow_flags::DSR_BACKEND,
        counter: 0,
        last_seen: 0,
        state: initial_state(packet),
    };
    // The backend as destination, unrewritten: the reaper tells the connection's endpoint by it.
    let forward = Nat {
        src: A::UNSPECIFIED,
        src_port: 0,
        dst: client.dst,
        dst_port: client.dst_port,
        flags: flow_flags::DSR_BACKEND,
        counter: 0,
        last_seen: now,
        state: initial_state(packet),
    };
    if let Err(error) = A::record(&reply_key, &reply) {
        return Err(refuse(error, last_try, datapath_stat::FLOW_INSERT_REPLY));
    }
    if let Err(error) = A::record(client, &forward) {
        A::forget(&reply_key);
        return Err(refuse(error, last_try, datapath_stat::FLOW_INSERT_FORWARD));
    }
    A::remember_new(client);
    Ok(())
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
pub(crate) fn track_masqueraded<A: Maps>(
    packet: &Packet<A>,
    backend: &Endpoint<A>,
    counter: u32,
    class: u8,
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
        flags: flow_flags::REWRITE_DESTINATION | flow_flags::REWRITE_SOURCE | origin(class),
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

/// Ports tried before a masqueraded connection is given up (its packet dropped; the client
/// retransmits and tries again).
const SNAT_PORT_ATTEMPTS: u32 = 8;

/// Claims a node port for the replies of a masqueraded connection and stores `reply` under
/// it: the client's own port when it is in the masquerade range and free toward this backend,
/// else a few random ones of the range. An error when every attempt is taken, or the flows
/// map is full.
///
/// The range (`vipr_snat_v1`, written by the agent) is disjoint from the node's ephemeral
/// ports: the kernel picks a local socket's port without knowing vipr's flow entries, so a
/// masquerade port it could also pick would let a node socket connected to the same backend
/// share the reply tuple, and one connection would receive the other's replies. Claiming with
/// `BPF_NOEXIST` only keeps masqueraded connections apart from each other.
#[inline(always)]
fn claim_reply<A: Maps>(
    backend: &Endpoint<A>,
    node_addr: A,
    client: &Tuple<A>,
    reply: &Nat<A>,
) -> Result<u16, Refusal> {
    let range = SNAT_PORTS
        .get(&0)
        .filter(|range| range.count != 0)
        .unwrap_or(SnatPorts { first: snat::DEFAULT_FIRST, count: snat::DEFAULT_COUNT });
    let client_port = u32::from(client.src_port);
    let mut key = Tuple {
        src: backend.addr,
        dst: node_addr,
        src_port: backend.port,
        dst_port: if client_port.wrapping_sub(range.first) < range.count {
            client.src_port
        } else {
            random_port(&range)
        },
        proto: client.proto,
    };
    for _ in 0..SNAT_PORT_ATTEMPTS {
        match A::claim(&key, reply) {
            Ok(()) => return Ok(key.dst_port),
            // The flows map is full, not the port taken: the caller may make room.
            Err(error) if is_full(error) => return Err(Refusal::MapFull),
            Err(_) => {}
        }
        key.dst_port = random_port(&range);
    }
    Err(Refusal::PortsTaken)
}

#[inline(always)]
fn random_port(range: &SnatPorts) -> u16 {
    // `max(1)` spares the division its panic branch (which the verifier would refuse); a count
    // of 0 never gets here (see claim_reply).
    (range.first.wrapping_add(unsafe { bpf_get_prandom_u32() } % range.count.max(1))) as u16
}
