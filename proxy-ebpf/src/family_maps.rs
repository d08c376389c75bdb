//! Each family's pinned maps (maps.rs) in the datapath's terms: flow entries, the early-drop
//! ring, services, backends, the classification tries, session affinity. The map types are
//! proxy-common's, generic over the family; one macro implements [`Maps`] for both families,
//! which differ only in which map statics (maps.rs) they use.
use core::ptr::NonNull;

use proxy_common::{
    flow_flags, Affinity4, Affinity6, AffinityKey4, AffinityKey6, BackendMember4, BackendMember6,
    BackendSlot, Family, Flow, Flow4, Flow6, FlowKey, FlowTrack, NextHop, Prefix4, Prefix6, Service,
    ServiceKey4, ServiceKey6, SourceRange4, SourceRange6,
};

use crate::{
    family::{Address, Endpoint, Ipv4, Ipv6, Nat, Tracked},
    maps::{
        AFFINITY4, AFFINITY6, BACKENDS4, BACKENDS6, EARLY_DROP4, EARLY_DROP6, FLOWS4, FLOWS6, MEMBERS4,
        MEMBERS6, NODE_IPS4, NODE_IPS6, POD_CIDRS4, POD_CIDRS6, SERVICES4, SERVICES6, SOURCE_RANGES4,
        SOURCE_RANGES6, UNMATCHED4, UNMATCHED6,
    },
    packet::Tuple,
};

/// Indexes the early-drop ring (its size is a power of two).
const EARLY_DROP_MASK: u32 = proxy_common::capacity::EARLY_DROP_RING - 1;
const _: () = assert!(proxy_common::capacity::EARLY_DROP_RING.is_power_of_two());

/// The maps of one family (`vipr_*4_v1` or `vipr_*6_v1`), in the datapath's terms.
pub trait Maps: Address {
    fn flow(key: &Tuple<Self>) -> Option<Tracked<Self>>;
    /// The flags word (whose upper bits hold the route generation) and the cached next hop
    /// of the flow entry whose tracking fields are `track`, in place.
    fn route_cache(track: NonNull<FlowTrack>) -> (NonNull<u32>, NonNull<NextHop>);
    /// Stores a flow entry; a failure only costs a fresh balancing decision later.
    fn record(key: &Tuple<Self>, nat: &Nat<Self>) -> Result<(), i64>;
    /// Stores a flow entry only if `key` is absent: claims it against concurrent flows.
    fn claim(key: &Tuple<Self>, nat: &Nat<Self>) -> Result<(), i64>;
    /// Deletes a flow entry this packet stored, when its partner could not be stored, or one
    /// evicted to make room.
    fn forget(key: &Tuple<Self>);
    /// Sets `bits` of `flow_state` in the entry of `key`, if there is one.
    fn mark(key: &Tuple<Self>, bits: u32);
    /// Remembers a new connection's forward key on the early-drop ring.
    fn remember_new(key: &Tuple<Self>);
    /// The oldest key on the early-drop queue not looked at yet, if any.
    fn early_drop_head() -> Option<Tuple<Self>>;
    /// Takes the oldest key off the early-drop queue.
    fn early_drop_pop();
    /// The services entry of a frontend of `proto`, for one source class.
    fn service(frontend: &Endpoint<Self>, proto: u8, source_class: u8) -> Option<Service>;
    /// The backend in a slot, with its (service port, backend) counter index.
    fn counted_backend(slot: &BackendSlot) -> Option<(Endpoint<Self>, u32)>;
    fn is_node(addr: &Self) -> bool;
    fn in_pod_cidr(addr: &Self) -> bool;
    /// What the unmatched-destination trie says of `addr` (`proxy_common::unmatched`).
    fn unmatched(addr: &Self) -> Option<u8>;
    fn in_source_ranges(service_id: u32, source: &Self) -> bool;
    /// The backend `client`'s latest new connection to service `service_id` went to, and when
    /// (`bpf_ktime_get_coarse_ns`).
    fn affinity(service_id: u32, client: &Self) -> Option<(Endpoint<Self>, u64)>;
    /// Remembers `backend` for `client`'s next connections to `service_id`; a failure only
    /// costs the next connection a fresh choice.
    fn remember(service_id: u32, client: &Self, backend: &Endpoint<Self>, now: u64);
    /// A slot of `backend_set` that holds `backend`, if the set has it.
    fn slot_of(backend_set: u32, backend: &Endpoint<Self>) -> Option<u32>;
}

impl<A: Family> From<&Tuple<A>> for FlowKey<A> {
    #[inline(always)]
    fn from(key: &Tuple<A>) -> Self {
        Self {
            src_addr: key.src,
            dst_addr: key.dst,
            src_port: key.src_port,
            dst_port: key.dst_port,
            proto: key.proto,
            pad8: 0,
            pad16: 0,
        }
    }
}

impl<A: Family> From<&Nat<A>> for Flow<A> {
    #[inline(always)]
    fn from(nat: &Nat<A>) -> Self {
        Self {
            src_addr: nat.src,
            dst_addr: nat.dst,
            src_port: nat.src_port,
            dst_port: nat.dst_port,
            flags: nat.flags,
            track: FlowTrack { counter: nat.counter, state: nat.state, last_seen: nat.last_seen },
            // Not cached: the packets of the flow are routed by the stack or a FIB lookup.
            next_hop: no_hop(),
        }
    }
}

/// A [`NextHop`] with nothing cached, read as four 32-bit words. Written as constant zeros, its
/// byte-aligned MAC arrays merge with the entry's other zeros into a `memset` of byte alignment,
/// which BPF calls as a function that stores a byte an iteration, for each of a new
/// connection's two entries; loaded words are no constant to merge.
#[inline(always)]
pub fn no_hop() -> NextHop {
    static NO_HOP: [u32; 4] = [0; 4];
    // SAFETY: a static's words; the same size as `NextHop` (checked by `transmute`), and zero
    // is a valid value of every field.
    unsafe { core::mem::transmute::<[u32; 4], NextHop>(core::ptr::read_volatile(&NO_HOP)) }
}

/// Implements [`Maps`] for one family: its address type and bit count, and its maps and their
/// key and value types, which have the same fields in both families.
macro_rules! family_maps {
    (
        $addr:ty, $bits:literal,
        flows: $flows:ident($flow:ident),
        early_drop: $early_drop:ident,
        services: $services:ident($service_key:ident),
        backends: $backends:ident,
        node_ips: $node_ips:ident,
        pod_cidrs: $pod_cidrs:ident($prefix:ident),
        unmatched: $unmatched:ident,
        source_ranges: $source_ranges:ident($source_range:ident),
        affinity: $affinity:ident($affinity_key:ident -> $affinity_value:ident),
        members: $members:ident($member:ident),
    ) => {
        impl Maps for $addr {
            #[inline(always)]
            fn flow(key: &Tuple<Self>) -> Option<Tracked<Self>> {
                let entry = $flows.get_ptr(&key.into())?;
                // SAFETY: a live entry of the flows map; the rewrite fields are written only
                // when the entry is created, so the copy is consistent.
                let flow: &$flow = unsafe { entry.as_ref() };
                Some(Tracked {
                    nat: Nat {
                        src: flow.src_addr,
                        src_port: flow.src_port,
                        dst: flow.dst_addr,
                        dst_port: flow.dst_port,
                        flags: flow.flags & flow_flags::MASK,
                        counter: flow.track.counter,
                        last_seen: 0,
                        state: flow.track.state,
                    },
                    // SAFETY: a field of the entry above.
                    track: unsafe {
                        NonNull::new_unchecked(core::ptr::addr_of_mut!((*entry.as_ptr()).track))
                    },
                })
            }

            #[inline(always)]
            fn route_cache(track: NonNull<FlowTrack>) -> (NonNull<u32>, NonNull<NextHop>) {
                // SAFETY: `track` is the tracking field of a live flows map entry (from
                // [`Self::flow`]); the entry starts at its offset before it.
                unsafe {
                    let entry = track.as_ptr().byte_sub(core::mem::offset_of!($flow, track)).cast::<$flow>();
                    (
                        NonNull::new_unchecked(core::ptr::addr_of_mut!((*entry).flags)),
                        NonNull::new_unchecked(core::ptr::addr_of_mut!((*entry).next_hop)),
                    )
                }
            }

            #[inline(always)]
            fn record(key: &Tuple<Self>, nat: &Nat<Self>) -> Result<(), i64> {
                $flows.insert(&key.into(), &nat.into())
            }

            #[inline(always)]
            fn claim(key: &Tuple<Self>, nat: &Nat<Self>) -> Result<(), i64> {
                $flows.insert_new(&key.into(), &nat.into())
            }

            #[inline(always)]
            fn forget(key: &Tuple<Self>) {
                let _ = $flows.remove(&key.into());
            }

            #[inline(always)]
            fn mark(key: &Tuple<Self>, bits: u32) {
                if let Some(entry) = $flows.get_ptr(&key.into()) {
                    // SAFETY: a live entry; a racing writer only sets bits too.
                    unsafe { (*entry.as_ptr()).track.state |= bits };
                }
            }

            #[inline(always)]
            fn remember_new(key: &Tuple<Self>) {
                if let Some(ring) = $early_drop.get_ptr(&0) {
                    let ring = ring.as_ptr();
                    // SAFETY: the one element; another CPU writing at once can lose or tear a
                    // key, which only costs a candidate (see maps.rs). The mask keeps the index
                    // inside the ring.
                    unsafe {
                        let next = (*ring).next;
                        (*ring).keys[(next & EARLY_DROP_MASK) as usize] = key.into();
                        (*ring).next = next.wrapping_add(1);
                    }
                }
            }

            #[inline(always)]
            fn early_drop_head() -> Option<Tuple<Self>> {
                let ring = $early_drop.get_ptr(&0)?.as_ptr();
                // SAFETY: as in remember_new.
                unsafe {
                    let next = (*ring).next;
                    // A writer that lapped the head overwrote the oldest keys.
                    if next.wrapping_sub((*ring).head) > EARLY_DROP_MASK + 1 {
                        (*ring).head = next.wrapping_sub(EARLY_DROP_MASK + 1);
                    }
                    let head = (*ring).head;
                    if head == next {
                        return None;
                    }
                    let key = (*ring).keys[(head & EARLY_DROP_MASK) as usize];
                    Some(Tuple {
                        src: key.src_addr,
                        dst: key.dst_addr,
                        src_port: key.src_port,
                        dst_port: key.dst_port,
                        proto: key.proto,
                    })
                }
            }

            #[inline(always)]
            fn early_drop_pop() {
                if let Some(ring) = $early_drop.get_ptr(&0) {
                    // SAFETY: as in remember_new.
                    unsafe { (*ring.as_ptr()).head = (*ring.as_ptr()).head.wrapping_add(1) };
                }
            }

            #[inline(always)]
            fn service(frontend: &Endpoint<Self>, proto: u8, source_class: u8) -> Option<Service> {
                $services.get(&$service_key { addr: frontend.addr, port: frontend.port, proto, source_class })
            }

            #[inline(always)]
            fn counted_backend(slot: &BackendSlot) -> Option<(Endpoint<Self>, u32)> {
                $backends
                    .get(slot)
                    .map(|backend| (Endpoint { addr: backend.addr, port: backend.port }, backend.counter))
            }

            #[inline(always)]
            fn is_node(addr: &Self) -> bool {
                $node_ips.contains(addr)
            }

            #[inline(always)]
            fn in_pod_cidr(addr: &Self) -> bool {
                $pod_cidrs.contains(&$prefix { prefix_len: $bits, addr: *addr })
            }

            #[inline(always)]
            fn unmatched(addr: &Self) -> Option<u8> {
                $unmatched.get(&$prefix { prefix_len: $bits, addr: *addr })
            }

            #[inline(always)]
            fn in_source_ranges(service_id: u32, source: &Self) -> bool {
                $source_ranges.contains(&$source_range {
                    prefix_len: 32 + $bits,
                    service_id: service_id.to_be_bytes(),
                    addr: *source,
                })
            }

            #[inline(always)]
            fn affinity(service_id: u32, client: &Self) -> Option<(Endpoint<Self>, u64)> {
                $affinity
                    .get(&$affinity_key { service_id, client: *client })
                    .map(|value| (Endpoint { addr: value.addr, port: value.port }, value.since))
            }

            #[inline(always)]
            fn remember(service_id: u32, client: &Self, backend: &Endpoint<Self>, now: u64) {
                let value = $affinity_value {
                    addr: backend.addr,
                    port: backend.port,
                    pad: Default::default(),
                    since: now,
                };
                let _ = $affinity.insert(&$affinity_key { service_id, client: *client }, &value);
            }

            #[inline(always)]
            fn slot_of(backend_set: u32, backend: &Endpoint<Self>) -> Option<u32> {
                $members.get(&$member { backend_set, addr: backend.addr, port: backend.port, pad: 0 })
            }
        }
    };
}

family_maps!(
    Ipv4, 32,
    flows: FLOWS4(Flow4),
    early_drop: EARLY_DROP4,
    services: SERVICES4(ServiceKey4),
    backends: BACKENDS4,
    node_ips: NODE_IPS4,
    pod_cidrs: POD_CIDRS4(Prefix4),
    unmatched: UNMATCHED4,
    source_ranges: SOURCE_RANGES4(SourceRange4),
    affinity: AFFINITY4(AffinityKey4 -> Affinity4),
    members: MEMBERS4(BackendMember4),
);

family_maps!(
    Ipv6, 128,
    flows: FLOWS6(Flow6),
    early_drop: EARLY_DROP6,
    services: SERVICES6(ServiceKey6),
    backends: BACKENDS6,
    node_ips: NODE_IPS6,
    pod_cidrs: POD_CIDRS6(Prefix6),
    unmatched: UNMATCHED6,
    source_ranges: SOURCE_RANGES6(SourceRange6),
    affinity: AFFINITY6(AffinityKey6 -> Affinity6),
    members: MEMBERS6(BackendMember6),
);
