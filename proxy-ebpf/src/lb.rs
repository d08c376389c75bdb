//! The service decision for a new connection, taken the same way by every hook (TC, XDP and
//! the socket hooks, as Cilium's lb.h serves its programs): the services entry of the
//! destination for the source's class, the service's source ranges, an empty backend set, the
//! slot (session affinity, else Maglev's flow hash or a random or given pick), the backend and
//! its counter, and the client's affinity remembered. What a hook does with the outcome is its
//! own: TC rejects or drops and tracks, XDP leaves what it does not handle to TC, a socket hook
//! fails the system call or rewrites its address.
use aya_ebpf::helpers::{bpf_get_prandom_u32, bpf_ktime_get_coarse_ns};
use proxy_common::{proto, service_flags, source_class, BackendSlot, Service};

use crate::{
    affinity,
    family::Endpoint,
    family_maps::Maps,
    maps::{POD_INTERFACES, SWITCH_DEADLINE},
    packet::{Tuple, TCP_SYN},
};

/// What the service decision found for a new connection.
pub(crate) enum Decision<A> {
    /// The service has source ranges and the client is outside them: dropped.
    SourceDenied,
    /// The service has no backend: rejected or dropped, as its flags say.
    NoBackend(Service),
    /// The agent retired the backend set between the service's lookup and the slot's: the
    /// next attempt meets the new set.
    Retired,
    /// The connection's backend.
    Backend(Chosen<A>),
}

/// What [`decide`] found for a packet without a flow entry.
pub(crate) enum PacketDecision<A> {
    /// No services entry for the destination and the source's class: the hook asks the
    /// unmatched-destination trie.
    Unmatched,
    /// A TCP packet past its handshake while an upgrade switches maps
    /// ([`awaits_carried_entry`]): dropped, with nothing chosen or remembered for it.
    Held,
    /// The service's decision.
    Decided(Decision<A>),
}

/// A new connection's backend and what the hook needs to track and count it.
pub(crate) struct Chosen<A> {
    pub service: Service,
    pub backend: Endpoint<A>,
    /// The (service port, backend) counter index.
    pub counter: u32,
    /// The clock reading (`bpf_ktime_get_coarse_ns`) of the decision, for the flow entries'
    /// `last_seen`: read only once a backend is to be chosen, so that the paths that stop
    /// before (a miss above all) pay no helper call.
    pub now: u64,
}

/// How the slot is picked when session affinity does not decide.
pub(crate) enum Pick<'a, A> {
    /// By the packet's flow: Maglev's flow hash for a Maglev service, else at random.
    Flow(&'a Tuple<A>),
    /// A number the hook chose (a socket hook's per-socket spread); taken modulo the set's size.
    Given(u32),
}

/// The service decision for a packet that found no flow entry: `flow` is the packet's,
/// `tcp_flags` its TCP flags, `class` its source's class (`proxy_common::source_class`); source
/// ranges and session affinity see its source, and the slot is picked by the flow.
#[inline(always)]
pub(crate) fn decide<A: Maps>(flow: &Tuple<A>, tcp_flags: u8, class: u8) -> PacketDecision<A> {
    let Some(service) = A::service(&flow.destination(), flow.proto, class) else {
        return PacketDecision::Unmatched;
    };
    // Before the choice: a held packet must leave nothing behind (an affinity entry above all,
    // which the carried one would then not overwrite).
    if awaits_carried_entry(flow, tcp_flags) {
        return PacketDecision::Held;
    }
    PacketDecision::Decided(decide_for(service, &flow.src, Pick::Flow(flow)))
}

/// [`decide`] past the services entry, for a hook that looked it up already (a socket hook
/// asks it whether a pod's socket is translated at all).
#[inline(always)]
pub(crate) fn decide_for<A: Maps>(service: Service, client: &A, pick: Pick<'_, A>) -> Decision<A> {
    if service.flags & service_flags::SOURCE_RANGES != 0 && !A::in_source_ranges(service.service_id, client) {
        return Decision::SourceDenied;
    }
    if service.backend_count == 0 {
        return Decision::NoBackend(service);
    }
    let now = unsafe { bpf_ktime_get_coarse_ns() };
    let slot = match affinity::remembered_slot(&service, client, now) {
        Some(slot) => slot,
        None => match pick {
            Pick::Flow(flow) => choose_slot(flow, &service),
            Pick::Given(number) => number % service.backend_count,
        },
    };
    let Some((backend, counter)) =
        A::counted_backend(&BackendSlot { backend_set: service.backend_set, slot })
    else {
        return Decision::Retired;
    };
    affinity::remember(&service, client, &backend, now);
    Decision::Backend(Chosen { service, backend, counter, now })
}

/// Part of the flow hash: changing it moves every Maglev flow to another backend.
const FLOW_HASH_SEED: u32 = 0x7669_7072; // "vipr"

/// The source class of a packet from `source` that entered through interface
/// `entered_through`: the node's own, a pod's (by the local-traffic detector: its CIDRs, or
/// the pod interfaces, whichever the agent filled), or anything else.
#[inline(always)]
pub(crate) fn classify<A: Maps>(source: &A, entered_through: u32) -> u8 {
    if A::is_node(source) {
        source_class::NODE
    } else if A::in_pod_cidr(source) || POD_INTERFACES.contains(&entered_through) {
        source_class::POD
    } else {
        source_class::OUTSIDE
    }
}

/// The slot of a new connection's backend without session affinity: the one the flow hash
/// names in a Maglev table, else a random one.
#[inline(always)]
fn choose_slot<A: Maps>(flow: &Tuple<A>, service: &Service) -> u32 {
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
fn flow_hash<A: Maps>(flow: &Tuple<A>) -> u32 {
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

/// Whether a packet to a service that found no flow entry must wait instead of being balanced:
/// a TCP packet past its handshake (no SYN) while an upgrade switches to new maps
/// ([`SWITCH_DEADLINE`]). Its connection was opened by the earlier programs just before the
/// switch, and its entries are still being copied into the new map: balanced anew it could go
/// to another backend, which would reset it; dropped, it is retransmitted and finds them. (A
/// SYN, a datagram or an SCTP chunk is balanced: it may open a connection.) The clock is read
/// only while a deadline is set.
#[inline(always)]
fn awaits_carried_entry<A>(flow: &Tuple<A>, tcp_flags: u8) -> bool {
    flow.proto == proto::TCP
        && tcp_flags & TCP_SYN == 0
        && SWITCH_DEADLINE
            .get(&0)
            .is_some_and(|deadline| deadline != 0 && unsafe { bpf_ktime_get_coarse_ns() } < deadline)
}
