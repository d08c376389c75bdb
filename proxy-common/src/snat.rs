//! Which node ports the TC program gives masqueraded connections. The node's own sockets take
//! their ports from its ephemeral range (`net.ipv4.ip_local_port_range`) without knowing of
//! vipr's flow entries, so a masquerade port inside that range could be picked again by a
//! local socket talking to the same backend, and the two connections' replies would be
//! confused. The agent therefore writes a range disjoint from the ephemeral one.
//!
//! Masquerade itself: proxy-ebpf/src/route.rs and conntrack.rs.
use crate::family::map_types;

/// `u32` 0 -> [`crate::SnatPorts`] (an array of one), written by the agent.
pub const PORTS: &str = "vipr_snat_v1";
/// The range used while [`PORTS`] holds no range yet (count 0): below Linux's default
/// ephemeral range, 32768-60999.
pub const DEFAULT_FIRST: u32 = 1024;
pub const DEFAULT_COUNT: u32 = 32768 - 1024;

/// Value of the [`PORTS`] map: ports `first..first + count`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SnatPorts {
    pub first: u32,
    /// 0: not written yet, see [`DEFAULT_FIRST`].
    pub count: u32,
}

map_types! {
    SnatPorts: 8;
}
