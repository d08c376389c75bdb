//! Services: the services map (frontend and source class -> service), how sources are
//! classified, and the tries that filter and answer what no frontend matched.
use crate::family::map_types;

/// Classes of packet sources; a frontend may treat each differently (traffic policies,
/// masquerade).
pub mod source_class {
    /// Neither a pod nor the node: outside the cluster.
    pub const OUTSIDE: u8 = 0;
    /// Inside a cluster CIDR of the local-traffic detector.
    pub const POD: u8 = 1;
    /// One of the node's own addresses.
    pub const NODE: u8 = 2;
    /// No packet's class: the entry a backend's node checks a service address carried by
    /// direct server return against (dsr.rs). Its backend set is the set the ingress node chose
    /// from (the OUTSIDE entry's), and a NodePort's is keyed by the unspecified address, since
    /// the address carried is the ingress node's own, which this node's entries do not hold.
    pub const CARRIED: u8 = 3;
}

/// Key of the services map: one frontend of a service, for one source class.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceKey<A> {
    pub addr: A,
    pub port: u16,
    pub proto: u8,
    /// One of [`source_class`].
    pub source_class: u8,
}

pub type ServiceKey4 = ServiceKey<crate::V4>;
pub type ServiceKey6 = ServiceKey<crate::V6>;

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
    /// Direct server return (`--lb-mode=dsr`, or `hybrid` for TCP): a new connection from
    /// outside to a backend on another node is sent there without source NAT, the frontend
    /// carried in an IPv4 option, instead of being masqueraded. Set only on the OUTSIDE
    /// entries of masquerading NodePort, load-balancer and external-IP frontends.
    pub const DSR: u32 = 16;
    /// The entry of a carried service address ([`super::source_class::CARRIED`]): its set
    /// keeps its membership entries, which tell whether a backend is in it.
    pub const CARRIED: u32 = 32;
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

impl Service {
    /// Whether the datapath asks the membership map of this entry's set (`BackendMember`):
    /// session affinity checks a remembered backend against it, a carried service address
    /// the request's backend.
    pub fn keeps_members(&self) -> bool {
        self.affinity_timeout != 0 || self.flags & service_flags::CARRIED != 0
    }
}

/// Key of an LPM trie (pod CIDRs, unmatched destinations): the kernel matches the first
/// `prefix_len` bits of `addr`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Prefix<A> {
    pub prefix_len: u32,
    pub addr: A,
}

pub type Prefix4 = Prefix<crate::V4>;
pub type Prefix6 = Prefix<crate::V6>;

/// Key of the source ranges trie: `service_id` is always matched in full (its 32 bits count
/// in `prefix_len`), then the range's prefix of `addr`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SourceRange<A> {
    pub prefix_len: u32,
    /// Big-endian, so that it forms the leading bits of the key.
    pub service_id: [u8; 4],
    pub addr: A,
}

pub type SourceRange4 = SourceRange<crate::V4>;
pub type SourceRange6 = SourceRange<crate::V6>;

/// Values of the unmatched-destination trie.
pub mod unmatched {
    /// A cluster IP on a port or protocol it does not serve: ICMP port unreachable.
    pub const REJECT: u8 = 1;
    /// Inside a service range but no cluster IP: drop.
    pub const DROP: u8 = 2;
}

map_types! {
    ServiceKey<A>: 8, 20;
    Service: 24;
    Prefix<A>: 8, 20;
    SourceRange<A>: 12, 24;
}
