//! Names of the pinned maps and where they live. The version suffix is part of the name so a
//! later format can be introduced beside the old one and migrated, never reinterpreted.

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
/// The generation of the node's routes and neighbours: array of one `u32`, which the agent
/// changes whenever a route, neighbour, address or link of the node changes. A next hop
/// cached in a flow entry ([`crate::NextHop`]) holds while the generation it was cached
/// under does; 0 turns the cache off (no agent watches the routes).
pub const ROUTE_GENERATION: &str = "vipr_rtgen_v1";
/// While an upgrade switches to new maps: array of one `u64`, a CLOCK_MONOTONIC_COARSE
/// deadline (ns) until which a TCP packet past its handshake that finds no flow entry is
/// dropped, not balanced anew: its connection's entries are being copied from the earlier
/// programs' map, and another backend would reset it. 0 (or a past deadline) otherwise; a
/// deadline, not a flag, so that an agent killed mid-switch leaves nothing held for long.
pub const SWITCH_DEADLINE: &str = "vipr_switch_v1";
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
