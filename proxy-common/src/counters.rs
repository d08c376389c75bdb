//! Counters: packets and bytes per (service port, backend), and the datapath's own events.
use crate::family::map_types;

/// Packets and bytes (IP packet length: IP header and payload, no link-layer header) of one
/// (service port, backend) pair on one CPU, both directions together.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Counters {
    pub packets: u64,
    pub bytes: u64,
}

/// Slots of the [`crate::pins::DATAPATH_STATS`] array.
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

map_types! {
    Counters: 16;
}
