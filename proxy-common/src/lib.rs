//! Types shared by vipr's kernel programs (proxy-ebpf) and its agent (proxy-userspace).
//!
//! Every map key and value is `#[repr(C)]` with explicit padding and a compile-time size
//! check, because the kernel compares keys bytewise: an uninitialised padding byte would make
//! two equal keys different. Addresses are kept as network-order byte arrays and ports in host
//! order, so `bpftool map dump` prints `[10,96,0,10]` and `80` rather than opaque integers.
#![no_std]

/// Names of the pinned maps and where they live. The version suffix is part of the name so a
/// later format can be introduced beside the old one and migrated, never reinterpreted.
pub mod pins {
    /// Directory under the bpffs root (`--bpf-root`) that holds every pin of one vipr.
    pub const DIR: &str = "vipr";
    /// Subdirectory of [`DIR`] holding the pinned TCX links, one per attached device.
    pub const LINKS_DIR: &str = "links";
    /// (Frontend, source class) -> service: [`crate::ServiceKey4`] -> [`crate::Service`].
    pub const SERVICES4: &str = "vipr_svc4_v1";
    /// Backend slots of a backend set: [`crate::BackendSlot`] -> [`crate::Backend4`].
    pub const BACKENDS4: &str = "vipr_back4_v1";
    /// Connection tracking and NAT state: [`crate::FlowKey4`] -> [`crate::Flow4`].
    pub const FLOWS4: &str = "vipr_flow4_v1";
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
    pub const SERVICES6: &str = "vipr_svc6_v1";
    pub const BACKENDS6: &str = "vipr_back6_v1";
    pub const FLOWS6: &str = "vipr_flow6_v1";
    pub const NODE_IPS6: &str = "vipr_node6_v1";
    pub const POD_CIDRS6: &str = "vipr_pod6_v1";
    pub const UNMATCHED6: &str = "vipr_unm6_v1";
    pub const SOURCE_RANGES6: &str = "vipr_srcr6_v1";
    /// The one TC program, attached at ingress of every `--devices` interface.
    pub const TC_INGRESS_PROGRAM: &str = "vipr_tc_ingress";
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
    pub pad: [u8; 3],
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

/// Values of the unmatched-destination trie.
pub mod unmatched {
    /// A cluster IP on a port or protocol it does not serve: ICMP port unreachable.
    pub const REJECT: u8 = 1;
    /// Inside a service range but no cluster IP: drop.
    pub const DROP: u8 = 2;
}

const _: () = {
    assert!(core::mem::size_of::<ServiceKey4>() == 8);
    assert!(core::mem::size_of::<Service>() == 16);
    assert!(core::mem::size_of::<BackendSlot>() == 8);
    assert!(core::mem::size_of::<Backend4>() == 8);
    assert!(core::mem::size_of::<FlowKey4>() == 16);
    assert!(core::mem::size_of::<Flow4>() == 16);
    assert!(core::mem::size_of::<Prefix4>() == 8);
    assert!(core::mem::size_of::<SourceRange4>() == 12);
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
    unsafe impl aya::Pod for Prefix4 {}
    unsafe impl aya::Pod for SourceRange4 {}
}

// ---------------------------------------------------------------------------------------------
// Socket-level load balancing of the node's own traffic (proxy-ebpf/src/sock.rs): cgroup
// sock_addr programs rewrite the address a node process connects or sends to, before any packet
// exists. Kept apart from the TC datapath's items above.

/// Names, pins and capacities of the socket-level load balancer.
pub mod sock {
    /// Settings written by the agent: `u32` 0 -> [`crate::SockConfig`] (an array of one).
    pub const CONFIG: &str = "vipr_skcfg_v1";
    /// What each socket was really sent to: [`crate::SockRevKey4`] -> [`crate::SockFrontend4`]
    /// (LRU), so recvmsg and getpeername can show the frontend again.
    pub const REVERSE4: &str = "vipr_skrev4_v1";
    /// Sockets with a live translation; an evicted entry only makes the peer show as the
    /// backend.
    pub const REVERSE4_CAPACITY: u32 = 262_144;

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
    /// Every hook, in the order they are attached (the reverse path first, so that no socket
    /// is translated before its answers can be translated back).
    pub const HOOKS: [Hook; 4] = [RECVMSG4, GETPEERNAME4, SENDMSG4, CONNECT4];
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

const _: () = {
    assert!(core::mem::size_of::<SockConfig>() == 16);
    assert!(core::mem::size_of::<SockRevKey4>() == 16);
    assert!(core::mem::size_of::<SockFrontend4>() == 8);
};

#[cfg(feature = "user")]
mod sock_user {
    use super::*;

    // SAFETY: repr(C), Copy, no implicit padding (size asserts above).
    unsafe impl aya::Pod for SockConfig {}
    unsafe impl aya::Pod for SockRevKey4 {}
    unsafe impl aya::Pod for SockFrontend4 {}
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
    pub pad: [u8; 3],
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
    assert!(core::mem::size_of::<Backend6>() == 20);
    assert!(core::mem::size_of::<FlowKey6>() == 40);
    assert!(core::mem::size_of::<Flow6>() == 40);
    assert!(core::mem::size_of::<Prefix6>() == 20);
    assert!(core::mem::size_of::<SourceRange6>() == 24);
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
}
