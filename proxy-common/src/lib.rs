//! Types shared by vipr's kernel programs (proxy-ebpf) and its agent (proxy-userspace).
//!
//! Every map key and value is `#[repr(C)]` with explicit padding and a compile-time size
//! check, because the kernel compares keys bytewise: an uninitialised padding byte would make
//! two equal keys different. Addresses are kept as network-order byte arrays and ports in host
//! order, so `bpftool map dump` prints `[10,96,0,10]` and `80` rather than opaque integers.
#![no_std]

pub mod legacy;
pub mod sctp;

/// Names of the pinned maps and where they live. The version suffix is part of the name so a
/// later format can be introduced beside the old one and migrated, never reinterpreted.
pub mod pins {
    /// Directory under the bpffs root (`--bpf-root`) that holds every pin of one vipr.
    pub const DIR: &str = "vipr";
    /// Subdirectory of [`DIR`] holding the pinned TCX links, one per attached device.
    pub const LINKS_DIR: &str = "links";
    /// (Frontend, source class) -> service: [`crate::ServiceKey4`] -> [`crate::Service`].
    /// (`_v1` had no session affinity timeout.)
    pub const SERVICES4: &str = "vipr_svc4_v2";
    /// Backend slots of a backend set: [`crate::BackendSlot`] -> [`crate::Backend4`].
    /// (`_v1` had no counter index.)
    pub const BACKENDS4: &str = "vipr_back4_v2";
    /// Connection tracking and NAT state: [`crate::FlowKey4`] -> [`crate::Flow4`], a plain
    /// hash map whose entries only the agent's expiry deletes: a full map refuses new
    /// connections (counted, logged) and never evicts a live one. (`_v1` had no
    /// [`crate::FlowTrack`]; `_v2` was an LRU hash, whose eviction silently broke live
    /// connections and whose inserts cost ~125 ns against ~47 ns; `_v3` had no
    /// [`crate::NextHop`]. The entries of `_v2` and `_v3` are converted: [`crate::legacy`].)
    pub const FLOWS4: &str = "vipr_flow4_v4";
    /// The node's own addresses: `[u8; 4]` -> `u8` (unused value); sources here are
    /// [`crate::source_class::NODE`].
    pub const NODE_IPS4: &str = "vipr_node4_v1";
    /// The local-traffic detector's CIDRs: LPM [`crate::Prefix4`] -> `u8`; sources inside
    /// are [`crate::source_class::POD`].
    pub const POD_CIDRS4: &str = "vipr_pod4_v1";
    /// What to do with a packet to a service address no frontend matched: LPM
    /// [`crate::Prefix4`] -> one of [`crate::unmatched`].
    pub const UNMATCHED4: &str = "vipr_unm4_v1";
    /// Sources admitted by a service's source ranges: LPM [`crate::SourceRange4`] -> `u8`.
    pub const SOURCE_RANGES4: &str = "vipr_srcr4_v1";
    /// The IPv6 maps, the same as their IPv4 namesakes with the `*6` types.
    pub const SERVICES6: &str = "vipr_svc6_v2";
    pub const BACKENDS6: &str = "vipr_back6_v2";
    pub const FLOWS6: &str = "vipr_flow6_v4";
    pub const NODE_IPS6: &str = "vipr_node6_v1";
    pub const POD_CIDRS6: &str = "vipr_pod6_v1";
    pub const UNMATCHED6: &str = "vipr_unm6_v1";
    pub const SOURCE_RANGES6: &str = "vipr_srcr6_v1";
    /// Packets and bytes per (service port, backend), both directions: per-CPU array
    /// `u32` [`crate::Backend4::counter`] -> [`crate::Counters`], shared by both families.
    pub const BACKEND_COUNTERS: &str = "vipr_bcnt_v1";
    /// Datapath events worth a metric: per-CPU array `u32` one of [`crate::datapath_stat`]
    /// -> `u64`. (`_v1` had 4 slots.)
    pub const DATAPATH_STATS: &str = "vipr_dstat_v2";
    /// Early-drop candidates: array of one [`crate::EarlyDropRing4`], the keys of the latest
    /// new connections, which a new connection that finds the flows map full may replace if
    /// they never completed their handshake.
    pub const EARLY_DROP4: &str = "vipr_edrop4_v1";
    pub const EARLY_DROP6: &str = "vipr_edrop6_v1";
    /// Earlier layouts of the maps above. While any is pinned, the programs of the earlier
    /// vipr keep serving until the new maps hold the agent's first complete sync; then the
    /// links are switched to the new programs and the pins removed. Their content is never
    /// reinterpreted in place: the entries the datapath created (connections) of the layouts
    /// in [`crate::legacy::CONVERTED`] are converted into the new maps, those of the others
    /// are lost (their connections are balanced anew); what the agent writes is written again
    /// by its first sync.
    pub const RETIRED: [&str; 11] = [
        "vipr_dstat_v1",
        "vipr_svc4_v1",
        "vipr_back4_v1",
        "vipr_flow4_v1",
        "vipr_flow4_v2",
        "vipr_flow4_v3",
        "vipr_svc6_v1",
        "vipr_back6_v1",
        "vipr_flow6_v1",
        "vipr_flow6_v2",
        "vipr_flow6_v3",
    ];
    /// ClientIP session affinity: the backend a client's latest new connection to a service
    /// port went to, and when: LRU [`crate::AffinityKey4`] -> [`crate::Affinity4`].
    pub const AFFINITY4: &str = "vipr_aff4_v1";
    pub const AFFINITY6: &str = "vipr_aff6_v1";
    /// Which backends a backend set holds, so that a remembered backend is used only while
    /// the service still has it: [`crate::BackendMember4`] -> `u32`, a slot of it in the set.
    pub const MEMBERS4: &str = "vipr_memb4_v1";
    pub const MEMBERS6: &str = "vipr_memb6_v1";
    /// Ports of IPv4 datagrams split into fragments, from their first fragment, so that the
    /// later ones (which carry no L4 header) find their flow entry: LRU
    /// [`crate::FragmentKey4`] -> [`crate::FragmentPorts`]. IPv4 only: IPv6 fragments are not
    /// balanced.
    pub const FRAGMENTS4: &str = "vipr_frag4_v1";
    /// The one TC program, attached at ingress of every `--devices` interface.
    pub const TC_INGRESS_PROGRAM: &str = "vipr_tc_ingress";
    /// The TC program at egress of every `--devices` interface: the half of a forwarded
    /// packet's NAT that must come after the stack's routing and filtering
    /// ([`crate::forwarding`]).
    pub const TC_EGRESS_PROGRAM: &str = "vipr_tc_egress";
    /// The XDP program, attached to the `--devices` with `--bpf-xdp`.
    pub const XDP_PROGRAM: &str = "vipr_xdp";
    /// The XDP program's device map of redirect targets (the interfaces it is attached to).
    /// Not pinned: each agent fills its own program's.
    pub const XDP_TX_DEVICES: &str = "vipr_xdptx";
}

/// `--bpf-forwarding`: how the TC program hands on a packet it rewrote for another host. The
/// agent writes the mode into the program's read-only global [`forwarding::GLOBAL`] when it
/// loads it (so the verifier prunes the other path).
pub mod forwarding {
    /// The name of the `u8` global holding [`STACK`] or [`REDIRECT`].
    pub const GLOBAL: &str = "VIPR_FORWARDING";
    /// The default: back into the stack, which routes and filters the packet (netfilter
    /// FORWARD and POSTROUTING) with the addresses a NetworkPolicy names, client -> backend
    /// and backend -> client; the rest of the NAT happens at TC egress.
    pub const STACK: u8 = 0;
    /// Straight to the next hop with `bpf_redirect_neigh`: faster, but the packet skips
    /// netfilter's FORWARD and POSTROUTING chains, and with them iptables-enforced policy.
    pub const REDIRECT: u8 = 1;
}

/// Default capacities; the agent may override them when it creates the maps.
pub mod capacity {
    /// One entry per frontend and source class.
    pub const SERVICES: u32 = 196_608;
    pub const BACKENDS: u32 = 1_048_576;
    /// Two entries per connection.
    pub const FLOWS: u32 = 524_288;
    pub const NODE_IPS: u32 = 256;
    pub const POD_CIDRS: u32 = 256;
    pub const UNMATCHED: u32 = 65_536;
    pub const SOURCE_RANGES: u32 = 65_536;
    /// Clients remembered for session affinity, over all services, per family.
    pub const AFFINITY: u32 = 65_536;
    /// (Service port, backend) pairs with their own counters; per CPU, 16 bytes each.
    pub const BACKEND_COUNTERS: u32 = 65_536;
    /// Slots of the datapath statistics array: at least [`crate::datapath_stat::COUNT`], with
    /// room for later statistics without a new layout.
    pub const DATAPATH_STATS: u32 = 16;
    /// Recent new connections remembered as early-drop candidates (a queue in a ring): what
    /// the datapath may evict when the flows map is full. Candidates younger than
    /// `EARLY_DROP_MIN_AGE_NS` are spared (a legitimate handshake in flight), so early drop
    /// keeps working up to about `EARLY_DROP_RING / 0.25 s` = 16k new connections a second.
    pub const EARLY_DROP_RING: u32 = 4096;
    /// How long a connection is spared by early drop after its last packet from the client.
    pub const EARLY_DROP_MIN_AGE_NS: u64 = 250_000_000;
    /// Fragmented IPv4 datagrams in flight through the node (between their first and last
    /// fragment), over all connections: an entry is needed only for the microseconds a
    /// datagram's fragments take to pass, and LRU eviction of an old one costs nothing. A
    /// constant (Cilium's default for its `--bpf-fragments-map-max`), not a flag: 8,192
    /// datagrams in flight at once is far beyond what a node fragments.
    pub const FRAGMENTS4: u32 = 8_192;
}

/// IP protocol numbers as carried in [`ServiceKey4::proto`] and [`FlowKey4::proto`].
pub mod proto {
    pub const TCP: u8 = 6;
    pub const UDP: u8 = 17;
    pub const SCTP: u8 = 132;
}

/// Classes of packet sources; a frontend may treat each differently (traffic policies,
/// masquerade).
pub mod source_class {
    /// Neither a pod nor the node: outside the cluster.
    pub const OUTSIDE: u8 = 0;
    /// Inside a cluster CIDR of the local-traffic detector.
    pub const POD: u8 = 1;
    /// One of the node's own addresses.
    pub const NODE: u8 = 2;
}

/// Key of the services map: one frontend of a service, for one source class.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceKey4 {
    pub addr: [u8; 4],
    pub port: u16,
    pub proto: u8,
    /// One of [`source_class`].
    pub source_class: u8,
}

/// Bits of [`Service::flags`].
pub mod service_flags {
    /// Source NAT new connections to the node's address toward the backend.
    pub const MASQUERADE: u32 = 1;
    /// With no backend, answer ICMP port unreachable rather than dropping silently.
    pub const REJECT_WHEN_EMPTY: u32 = 2;
    /// Admit only sources in the source ranges map under this `service_id`.
    pub const SOURCE_RANGES: u32 = 4;
    /// The slots of `backend_set` are a Maglev table: a new connection takes the slot its
    /// flow hash names rather than a random one, so every node picks the same backend for it.
    pub const MAGLEV: u32 = 8;
}

/// Value of the services map. `backend_set` names the slots in the backends map that hold
/// this frontend's backends; the agent fills a fresh set and then switches this value in one
/// map update, so a packet sees either the old set or the new one, never a mixture.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Service {
    pub backend_set: u32,
    /// Number of slots `0..backend_count` in `backend_set`; 0 means no usable endpoint.
    pub backend_count: u32,
    /// Stable identity of the Kubernetes service port, for statistics and source ranges.
    pub service_id: u32,
    /// Bits of [`service_flags`].
    pub flags: u32,
    /// ClientIP session affinity: a client's new connections go to the backend of its
    /// previous one while that started less than this many seconds ago. 0: no affinity.
    pub affinity_timeout: u32,
    pub pad: u32,
}

/// Key of the backends map: one slot of one backend set.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BackendSlot {
    pub backend_set: u32,
    pub slot: u32,
}

/// Value of the backends map: where a connection is sent.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Backend4 {
    pub addr: [u8; 4],
    pub port: u16,
    pub pad: u16,
    /// Index of this (service port, backend) pair in [`pins::BACKEND_COUNTERS`], chosen by the
    /// agent and copied into both flow entries of each connection, so that counting a packet
    /// is an array access rather than a hash lookup. 0 is the shared "not counted" slot.
    pub counter: u32,
}

/// A 5-tuple as seen on the wire, in either direction of a connection.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FlowKey4 {
    pub src_addr: [u8; 4],
    pub dst_addr: [u8; 4],
    pub src_port: u16,
    pub dst_port: u16,
    pub proto: u8,
    /// Two padding fields rather than a `[u8; 3]`: the kernel programs build a key per packet,
    /// and zeroing a 3-byte array compiles to a call to `memset` (a loop on BPF); a byte and a
    /// half-word are two plain stores.
    pub pad8: u8,
    pub pad16: u16,
}

/// Bits of [`FlowTrack::state`]: what the datapath saw of a connection. FIN and RST are per
/// direction (each flow entry records the packets that matched it); the handshake bits are
/// kept in both entries of a connection, so that either one tells whether the connection may
/// be evicted (early drop) without the other.
pub mod flow_state {
    /// A FIN went this way.
    pub const FIN: u32 = 1;
    /// An RST went this way.
    pub const RST: u32 = 2;
    /// The connection's first packet was a TCP SYN (a handshake, not a pickup mid-stream).
    pub const SYN: u32 = 4;
    /// The backend answered the SYN with a SYN-ACK.
    pub const SYN_ACK: u32 = 8;
    /// A packet came back from the backend.
    pub const REPLIED: u32 = 16;
    /// The client sent again after a reply: for TCP its ACK after the SYN-ACK (the handshake
    /// completed, conntrack's ESTABLISHED), for UDP and SCTP a second packet after an answer (a
    /// stream, conntrack's ASSURED). Only such connections are kept when the map is full; a
    /// SYN-ACK alone does not establish, so a spoofed SYN flood, whose SYN-ACKs go nowhere,
    /// never does, nor does a flood of one-datagram UDP flows, answered or not.
    pub const ESTABLISHED: u32 = 32;
    /// The entry was created by a datapath that tracks the handshake bits above. Entries
    /// without it come from an earlier vipr (the same `_v3` layout): the agent judges them as
    /// that vipr did (answered = established) and the datapath never evicts them.
    pub const HANDSHAKE_TRACKED: u32 = 64;

    /// Whether a connection whose entry holds `state` may be replaced by a new connection
    /// when the flows map is full, or expired early when it fills up: one not
    /// [`ESTABLISHED`] (and not from an earlier vipr).
    #[inline(always)]
    pub const fn evictable(state: u32) -> bool {
        state & HANDSHAKE_TRACKED != 0 && state & ESTABLISHED == 0
    }
}

/// The part of a flow entry the datapath updates as packets pass, for counters and for the
/// agent's expiry of idle and closed connections.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FlowTrack {
    /// The connection's [`Backend4::counter`].
    pub counter: u32,
    /// Bits of [`flow_state`].
    pub state: u32,
    /// `bpf_ktime_get_coarse_ns` (CLOCK_MONOTONIC_COARSE) of the latest packet, refreshed at
    /// most about once a second so that an established packet rarely writes; 0 in a reply
    /// entry until the first reply.
    pub last_seen: u64,
}

/// Packets and bytes (IP packet length: IP header and payload, no link-layer header) of one
/// (service port, backend) pair on one CPU, both directions together.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Counters {
    pub packets: u64,
    pub bytes: u64,
}

/// Slots of the [`pins::DATAPATH_STATS`] array.
pub mod datapath_stat {
    /// The forward flow entry of a new connection could not be stored: its next packet is
    /// balanced again (possibly to another backend).
    pub const FLOW_INSERT_FORWARD: u32 = 0;
    /// The reply flow entry of a new unmasqueraded connection could not be stored: its replies
    /// are not reverse-NATed.
    pub const FLOW_INSERT_REPLY: u32 = 1;
    /// No free node port for a masqueraded connection: its packet is dropped (the map is full,
    /// or every port tried is taken toward that backend).
    pub const SNAT_PORT_EXHAUSTED: u32 = 2;
    /// The flows map was full and a connection that never completed its handshake (or a UDP
    /// flow never answered) was deleted to make room for a new one (early drop).
    pub const EARLY_DROP: u32 = 3;
    /// A new unmasqueraded connection's reply tuple was another connection's (the same
    /// client port to the same backend through another frontend): it was given another
    /// source port, its address kept, as the kernel's NAT resolves such a clash.
    pub const REPLY_CLASH_REMAPPED: u32 = 4;
    /// A packet that would have been answered with an ICMP/ICMPv6 port unreachable (a service
    /// without endpoints, a cluster IP's unserved port) was dropped instead: the node's rejects
    /// were over their rate (reject.rs).
    pub const REJECT_RATE_LIMITED: u32 = 5;
    pub const COUNT: u32 = 6;
}

/// Value of the [`pins::EARLY_DROP4`] array (one element): a queue of the forward keys of the
/// latest new connections, oldest first: `next` counts the keys written (the slot written next
/// is `next % EARLY_DROP_RING`), `head` the keys early drop has looked at (and passed over, or
/// evicted). A writer that laps the head overwrites the oldest keys.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct EarlyDropRing4 {
    pub next: u32,
    pub head: u32,
    pub keys: [FlowKey4; capacity::EARLY_DROP_RING as usize],
}

/// Bits of [`Flow4::flags`].
pub mod flow_flags {
    /// Rewrite the destination to `dst_addr:dst_port`.
    pub const REWRITE_DESTINATION: u32 = 1;
    /// Rewrite the source to `src_addr:src_port`.
    pub const REWRITE_SOURCE: u32 = 2;
    /// This entry is the reply direction (backend -> client) of a connection.
    pub const REPLY: u32 = 4;
}

/// Value of the flows map: how to rewrite the packets of one direction of a tracked
/// connection. Both directions get an entry when the first packet is balanced, so every later
/// packet costs one lookup, whichever way it travels. Toward the backend the destination
/// becomes the backend (and the source the node, when masqueraded); back from it the source
/// becomes the frontend again (and the destination the client).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Flow4 {
    pub src_addr: [u8; 4],
    pub dst_addr: [u8; 4],
    pub src_port: u16,
    pub dst_port: u16,
    /// Bits of [`flow_flags`].
    pub flags: u32,
    pub track: FlowTrack,
    pub next_hop: NextHop,
}

/// Where the packets of one direction of a connection leave the node, cached in its flow entry
/// so that an established connection needs no FIB lookup per packet (room for it was made in
/// the `_v4` flows layout; until the datapath fills it, every entry holds
/// [`NextHop::default`], "not cached", and packets are routed as before). A cached hop is only
/// valid while the routes and neighbours it came from are unchanged.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct NextHop {
    /// The egress interface; 0: nothing cached.
    pub ifindex: u32,
    /// The neighbour's and the egress interface's MAC addresses.
    pub dst_mac: [u8; 6],
    pub src_mac: [u8; 6],
}

/// Key of the [`pins::AFFINITY4`] map: a client of a service port (its `service_id`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct AffinityKey4 {
    pub service_id: u32,
    pub client: [u8; 4],
}

/// Value of the [`pins::AFFINITY4`] map: the backend of the client's latest new connection.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Affinity4 {
    pub addr: [u8; 4],
    pub port: u16,
    pub pad: u16,
    /// `bpf_ktime_get_coarse_ns` when that connection started.
    pub since: u64,
}

/// Key of the [`pins::MEMBERS4`] map: a backend in a backend set.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BackendMember4 {
    pub backend_set: u32,
    pub addr: [u8; 4],
    pub port: u16,
    pub pad: u16,
}

/// Key of an IPv4 LPM trie: the kernel matches the first `prefix_len` bits of `addr`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Prefix4 {
    pub prefix_len: u32,
    pub addr: [u8; 4],
}

/// Key of the source ranges trie: `service_id` is always matched in full (its 32 bits count
/// in `prefix_len`), then the range's prefix of `addr`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SourceRange4 {
    pub prefix_len: u32,
    /// Big-endian, so that it forms the leading bits of the key.
    pub service_id: [u8; 4],
    pub addr: [u8; 4],
}

/// Key of the [`pins::FRAGMENTS4`] map: what every fragment of one IPv4 datagram carries in
/// its IP header (RFC 791 reassembly matches the same four fields).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FragmentKey4 {
    pub src_addr: [u8; 4],
    pub dst_addr: [u8; 4],
    /// The IP identification field, in host order.
    pub id: u16,
    pub proto: u8,
    pub pad: u8,
}

/// Value of the [`pins::FRAGMENTS4`] map: the ports of the datagram's first fragment, as it
/// arrived (before any rewrite), which with the key make its flow key.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FragmentPorts {
    pub src_port: u16,
    pub dst_port: u16,
}

/// Values of the unmatched-destination trie.
pub mod unmatched {
    /// A cluster IP on a port or protocol it does not serve: ICMP port unreachable.
    pub const REJECT: u8 = 1;
    /// Inside a service range but no cluster IP: drop.
    pub const DROP: u8 = 2;
}

const _: () = {
    assert!(core::mem::size_of::<ServiceKey4>() == 8);
    assert!(core::mem::size_of::<Service>() == 24);
    assert!(core::mem::size_of::<BackendSlot>() == 8);
    assert!(core::mem::size_of::<Backend4>() == 12);
    assert!(core::mem::size_of::<FlowKey4>() == 16);
    assert!(core::mem::size_of::<FlowTrack>() == 16);
    assert!(core::mem::size_of::<Counters>() == 16);
    assert!(core::mem::size_of::<NextHop>() == 16);
    assert!(core::mem::size_of::<Flow4>() == 48);
    assert!(core::mem::size_of::<EarlyDropRing4>() == 8 + 16 * capacity::EARLY_DROP_RING as usize);
    assert!(core::mem::size_of::<Prefix4>() == 8);
    assert!(core::mem::size_of::<SourceRange4>() == 12);
    assert!(core::mem::size_of::<AffinityKey4>() == 8);
    assert!(core::mem::size_of::<Affinity4>() == 16);
    assert!(core::mem::size_of::<BackendMember4>() == 12);
    assert!(core::mem::size_of::<FragmentKey4>() == 12);
    assert!(core::mem::size_of::<FragmentPorts>() == 4);
};

#[cfg(feature = "user")]
mod user {
    use super::*;

    // SAFETY: all of these are repr(C), Copy, and have no implicit padding (see the size
    // asserts above), so any byte pattern the kernel hands back is a valid value.
    unsafe impl aya::Pod for ServiceKey4 {}
    unsafe impl aya::Pod for Service {}
    unsafe impl aya::Pod for BackendSlot {}
    unsafe impl aya::Pod for Backend4 {}
    unsafe impl aya::Pod for FlowKey4 {}
    unsafe impl aya::Pod for Flow4 {}
    unsafe impl aya::Pod for FlowTrack {}
    unsafe impl aya::Pod for NextHop {}
    unsafe impl aya::Pod for Counters {}
    unsafe impl aya::Pod for Prefix4 {}
    unsafe impl aya::Pod for SourceRange4 {}
    unsafe impl aya::Pod for AffinityKey4 {}
    unsafe impl aya::Pod for Affinity4 {}
    unsafe impl aya::Pod for BackendMember4 {}
    unsafe impl aya::Pod for FragmentKey4 {}
    unsafe impl aya::Pod for FragmentPorts {}
}

// ---------------------------------------------------------------------------------------------
// Socket-level load balancing of the node's own traffic (proxy-ebpf/src/sock.rs): cgroup
// sock_addr programs rewrite the address a node process connects or sends to, before any packet
// exists. Kept apart from the TC datapath's items above.

/// Names, pins and capacities of the socket-level load balancer.
pub mod sock {
    /// Settings written by the agent: `u32` 0 -> [`crate::SockConfig`] (an array of one).
    pub const CONFIG: &str = "vipr_skcfg_v2";
    /// Names of earlier layouts of these maps, which the agent unpins: `vipr_skcfg_v1` had no
    /// IPv6 default source.
    pub const RETIRED: [&str; 1] = ["vipr_skcfg_v1"];
    /// What each socket was really sent to: [`crate::SockRevKey4`] -> [`crate::SockFrontend4`]
    /// (LRU), so recvmsg and getpeername can show the frontend again.
    pub const REVERSE4: &str = "vipr_skrev4_v1";
    /// The same for IPv6 sockets: [`crate::SockRevKey6`] -> [`crate::SockFrontend6`] (LRU).
    /// (An IPv6 socket talking to an IPv4-mapped address uses [`REVERSE4`].)
    pub const REVERSE6: &str = "vipr_skrev6_v1";
    /// Sockets with a live translation, per family; an evicted entry only makes the peer show
    /// as the backend.
    pub const REVERSE4_CAPACITY: u32 = 262_144;
    pub const REVERSE6_CAPACITY: u32 = 262_144;

    /// One cgroup hook: the program's name in the object, and the name of its pinned link
    /// under [`crate::pins::LINKS_DIR`].
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct Hook {
        pub program: &'static str,
        pub link: &'static str,
    }

    /// TCP connect and connected UDP: the frontend becomes a backend.
    pub const CONNECT4: Hook = Hook { program: "vipr_connect4", link: "cgroup-connect4" };
    /// Unconnected UDP: each datagram's destination.
    pub const SENDMSG4: Hook = Hook { program: "vipr_sendmsg4", link: "cgroup-sendmsg4" };
    /// UDP receive: the backend as source becomes the frontend again.
    pub const RECVMSG4: Hook = Hook { program: "vipr_recvmsg4", link: "cgroup-recvmsg4" };
    /// getpeername: the backend as peer becomes the frontend again.
    pub const GETPEERNAME4: Hook = Hook { program: "vipr_getpeer4", link: "cgroup-getpeer4" };
    /// The same four for `AF_INET6` sockets (IPv4-mapped destinations included).
    pub const CONNECT6: Hook = Hook { program: "vipr_connect6", link: "cgroup-connect6" };
    pub const SENDMSG6: Hook = Hook { program: "vipr_sendmsg6", link: "cgroup-sendmsg6" };
    pub const RECVMSG6: Hook = Hook { program: "vipr_recvmsg6", link: "cgroup-recvmsg6" };
    pub const GETPEERNAME6: Hook = Hook { program: "vipr_getpeer6", link: "cgroup-getpeer6" };
    /// Every hook, in the order they are attached (the reverse path first, so that no socket
    /// is translated before its answers can be translated back).
    pub const HOOKS: [Hook; 8] =
        [RECVMSG4, GETPEERNAME4, RECVMSG6, GETPEERNAME6, SENDMSG4, CONNECT4, SENDMSG6, CONNECT6];
}

/// Value of the [`sock::CONFIG`] map. cgroup hooks run for the sockets of every network
/// namespace, so the programs act only on sockets whose namespace cookie is `netns_cookie`,
/// the agent's own; 0 (not yet written) means no socket.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SockConfig {
    pub netns_cookie: u64,
    /// The source the node uses toward its default route: what source ranges are checked
    /// against for a socket that is not bound to an address. `[0; 4]` if unknown.
    pub default_source4: [u8; 4],
    pub pad: u32,
    /// The same for IPv6 sockets; `[0; 16]` if unknown.
    pub default_source6: [u8; 16],
}

/// Key of the [`sock::REVERSE4`] map: one socket (its cookie) and the backend it was sent to.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SockRevKey4 {
    pub cookie: u64,
    pub addr: [u8; 4],
    pub port: u16,
    pub pad: u16,
}

/// Value of the [`sock::REVERSE4`] map: the frontend the socket asked for.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SockFrontend4 {
    pub addr: [u8; 4],
    pub port: u16,
    pub pad: u16,
}

/// [`SockRevKey4`] for an IPv6 backend.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SockRevKey6 {
    pub cookie: u64,
    pub addr: [u8; 16],
    pub port: u16,
    pub pad: [u8; 6],
}

/// [`SockFrontend4`] for an IPv6 frontend.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SockFrontend6 {
    pub addr: [u8; 16],
    pub port: u16,
    pub pad: u16,
}

const _: () = {
    assert!(core::mem::size_of::<SockConfig>() == 32);
    assert!(core::mem::size_of::<SockRevKey4>() == 16);
    assert!(core::mem::size_of::<SockFrontend4>() == 8);
    assert!(core::mem::size_of::<SockRevKey6>() == 32);
    assert!(core::mem::size_of::<SockFrontend6>() == 20);
};

#[cfg(feature = "user")]
mod sock_user {
    use super::*;

    // SAFETY: repr(C), Copy, no implicit padding (size asserts above).
    unsafe impl aya::Pod for SockConfig {}
    unsafe impl aya::Pod for SockRevKey4 {}
    unsafe impl aya::Pod for SockFrontend4 {}
    unsafe impl aya::Pod for SockRevKey6 {}
    unsafe impl aya::Pod for SockFrontend6 {}
}

// ---------------------------------------------------------------------------------------------
// IPv6: the same maps with 16-byte addresses. Field names and meanings are those of the IPv4
// types above, so the kernel code is written once for both families (proxy-ebpf/src/family.rs).
// `Service`, `BackendSlot`, the flags and the source classes are shared.

/// [`ServiceKey4`] for an IPv6 frontend.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceKey6 {
    pub addr: [u8; 16],
    pub port: u16,
    pub proto: u8,
    pub source_class: u8,
}

/// [`Backend4`] for an IPv6 backend.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Backend6 {
    pub addr: [u8; 16],
    pub port: u16,
    pub pad: u16,
    pub counter: u32,
}

/// [`FlowKey4`] for an IPv6 connection.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FlowKey6 {
    pub src_addr: [u8; 16],
    pub dst_addr: [u8; 16],
    pub src_port: u16,
    pub dst_port: u16,
    pub proto: u8,
    /// See [`FlowKey4::pad8`].
    pub pad8: u8,
    pub pad16: u16,
}

/// [`Flow4`] for an IPv6 connection.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Flow6 {
    pub src_addr: [u8; 16],
    pub dst_addr: [u8; 16],
    pub src_port: u16,
    pub dst_port: u16,
    /// Bits of [`flow_flags`].
    pub flags: u32,
    pub track: FlowTrack,
    pub next_hop: NextHop,
}

/// [`EarlyDropRing4`] for IPv6 connections.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct EarlyDropRing6 {
    pub next: u32,
    pub head: u32,
    pub keys: [FlowKey6; capacity::EARLY_DROP_RING as usize],
}

/// [`AffinityKey4`] for an IPv6 client.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct AffinityKey6 {
    pub service_id: u32,
    pub client: [u8; 16],
}

/// [`Affinity4`] for an IPv6 backend.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Affinity6 {
    pub addr: [u8; 16],
    pub port: u16,
    pub pad: [u8; 6],
    pub since: u64,
}

/// [`BackendMember4`] for an IPv6 backend.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BackendMember6 {
    pub backend_set: u32,
    pub addr: [u8; 16],
    pub port: u16,
    pub pad: u16,
}

/// [`Prefix4`] for IPv6 tries.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Prefix6 {
    pub prefix_len: u32,
    pub addr: [u8; 16],
}

/// [`SourceRange4`] for IPv6 sources: `prefix_len` counts the 32 bits of `service_id`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SourceRange6 {
    pub prefix_len: u32,
    pub service_id: [u8; 4],
    pub addr: [u8; 16],
}

const _: () = {
    assert!(core::mem::size_of::<ServiceKey6>() == 20);
    assert!(core::mem::size_of::<Backend6>() == 24);
    assert!(core::mem::size_of::<FlowKey6>() == 40);
    assert!(core::mem::size_of::<Flow6>() == 72);
    assert!(core::mem::size_of::<EarlyDropRing6>() == 8 + 40 * capacity::EARLY_DROP_RING as usize);
    assert!(core::mem::size_of::<Prefix6>() == 20);
    assert!(core::mem::size_of::<SourceRange6>() == 24);
    assert!(core::mem::size_of::<AffinityKey6>() == 20);
    assert!(core::mem::size_of::<Affinity6>() == 32);
    assert!(core::mem::size_of::<BackendMember6>() == 24);
};

#[cfg(feature = "user")]
mod user6 {
    use super::*;

    // SAFETY: repr(C), Copy, no implicit padding (size asserts above).
    unsafe impl aya::Pod for ServiceKey6 {}
    unsafe impl aya::Pod for Backend6 {}
    unsafe impl aya::Pod for FlowKey6 {}
    unsafe impl aya::Pod for Flow6 {}
    unsafe impl aya::Pod for Prefix6 {}
    unsafe impl aya::Pod for SourceRange6 {}
    unsafe impl aya::Pod for AffinityKey6 {}
    unsafe impl aya::Pod for Affinity6 {}
    unsafe impl aya::Pod for BackendMember6 {}
}

// ---------------------------------------------------------------------------------------------
// Source ports of masqueraded connections (proxy-ebpf/src/route.rs).

/// Which node ports the TC program gives masqueraded connections. The node's own sockets take
/// their ports from its ephemeral range (`net.ipv4.ip_local_port_range`) without knowing of
/// vipr's flow entries, so a masquerade port inside that range could be picked again by a
/// local socket talking to the same backend, and the two connections' replies would be
/// confused. The agent therefore writes a range disjoint from the ephemeral one.
pub mod snat {
    /// `u32` 0 -> [`crate::SnatPorts`] (an array of one), written by the agent.
    pub const PORTS: &str = "vipr_snat_v1";
    /// The range used while [`PORTS`] holds no range yet (count 0): below Linux's default
    /// ephemeral range, 32768-60999.
    pub const DEFAULT_FIRST: u32 = 1024;
    pub const DEFAULT_COUNT: u32 = 32768 - 1024;
}

/// Value of the [`snat::PORTS`] map: ports `first..first + count`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SnatPorts {
    pub first: u32,
    /// 0: not written yet, see [`snat::DEFAULT_FIRST`].
    pub count: u32,
}

const _: () = assert!(core::mem::size_of::<SnatPorts>() == 8);

// SAFETY: repr(C), Copy, no implicit padding (size assert above).
#[cfg(feature = "user")]
unsafe impl aya::Pod for SnatPorts {}

// ---------------------------------------------------------------------------------------------
// The local-traffic detector by interface (`--detect-local-mode=BridgeInterface` or
// `InterfaceNamePrefix`): packets that enter through a pod interface are
// [`source_class::POD`], whatever their source address. Shared by both families.

/// Names and capacity of the pod interfaces map.
pub mod pod_interfaces {
    /// Interface indexes of the node's pod interfaces: `u32` ifindex -> `u8` (unused value),
    /// written by the agent from the interfaces' names as links come and go. Empty unless the
    /// detector is by interface.
    pub const MAP: &str = "vipr_podif_v1";
    /// Pod interfaces on one node: a pod's veth each (kubelet's default limit is 110 pods),
    /// or a bridge and its ports.
    pub const CAPACITY: u32 = 8192;
}
