//! Socket-level load balancing of the node's own traffic (proxy-ebpf/src/sock.rs): cgroup
//! sock_addr programs rewrite the address a node process connects or sends to, before any
//! packet exists. Names, pins, capacities and map types, kept apart from the TC datapath's.
use crate::{family::map_types, Family};

/// Settings written by the agent: `u32` 0 -> [`SockConfig`] (an array of one).
pub const CONFIG: &str = "vipr_skcfg_v2";
/// Names of earlier layouts of these maps, which the agent unpins: `vipr_skcfg_v1` had no
/// IPv6 default source.
pub const RETIRED: [&str; 1] = ["vipr_skcfg_v1"];
/// Pods' sockets (`--bpf-socket-lb-pods`): `u32` 0 -> [`SockPods`] (an array of one).
pub const PODS: &str = "vipr_skpods_v1";
/// What each socket was really sent to: [`SockRevKey4`] -> [`SockFrontend4`]
/// (LRU), so recvmsg and getpeername can show the frontend again.
pub const REVERSE4: &str = "vipr_skrev4_v1";
/// The same for IPv6 sockets: [`SockRevKey6`] -> [`SockFrontend6`] (LRU).
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

/// Value of the [`CONFIG`] map. cgroup hooks run for the sockets of every network
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

/// Value of the [`PODS`] map: which sockets are pods', balanced at the socket level as a
/// pod's packets would be by the TC path (source class POD). A node's pods are the processes
/// of one cgroup subtree (the kubelet's `kubepods`); the hooks, attached at the cgroup root,
/// ask whether the calling task lives under it (`bpf_get_current_ancestor_cgroup_id` at the
/// subtree's `level`), whatever its network namespace. `cgroup_id` 0: no pod is balanced at
/// the socket level (their packets are, by TC).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SockPods {
    /// The pods' cgroup's id (its directory's inode number in cgroup v2).
    pub cgroup_id: u64,
    /// Its depth below the cgroup v2 root (the root is level 0).
    pub level: u32,
    pub pad: u32,
}

/// Key of the [`REVERSE4`] and [`REVERSE6`] maps: one socket (its cookie) and the backend it
/// was sent to.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SockRevKey<A: Family> {
    pub cookie: u64,
    pub addr: A,
    pub port: u16,
    pub pad: A::PortPad,
}

pub type SockRevKey4 = SockRevKey<crate::V4>;
pub type SockRevKey6 = SockRevKey<crate::V6>;

/// Value of the [`REVERSE4`] and [`REVERSE6`] maps: the frontend the socket asked for.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SockFrontend<A> {
    pub addr: A,
    pub port: u16,
    pub pad: u16,
}

pub type SockFrontend4 = SockFrontend<crate::V4>;
pub type SockFrontend6 = SockFrontend<crate::V6>;

map_types! {
    SockConfig: 32;
    SockPods: 16;
    SockRevKey<A>: 16, 32;
    SockFrontend<A>: 8, 20;
}
