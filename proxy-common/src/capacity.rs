//! Default capacities; the agent may override them when it creates the maps.

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
