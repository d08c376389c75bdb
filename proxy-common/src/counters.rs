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
    /// A new connection was sent to a backend on another node by direct server return (the
    /// ingress node's count).
    pub const DSR_SENT: u32 = 6;
    /// A DSR request's option told this node a connection's service address: its entries
    /// were stored (the backend node's count).
    pub const DSR_RECEIVED: u32 = 7;
    /// A new connection that would have been sent by DSR was masqueraded instead: its first
    /// packet with the option would have exceeded the egress device's MTU.
    pub const DSR_MTU_SNAT: u32 = 8;
    /// A packet of a DSR connection (a retransmitted SYN, a UDP datagram) left without the
    /// option: with it the packet would have exceeded the egress device's MTU. The backend's
    /// node keeps the entries the connection's first packet stored.
    pub const DSR_MTU_NO_OPTION: u32 = 9;
    /// A request carried a service address this node does not take (`--lb-mode=snat`, or a UDP
    /// request with `hybrid`, unless `--lb-dsr-accept`): it went on as if it carried none, and
    /// its replies keep the backend's address (the backend node's count).
    pub const DSR_CARRIER_IGNORED: u32 = 10;
    /// A request carried a service address that no service with the request's destination as
    /// backend has (a forged option, or a backend this node's agent has not learnt yet): a new
    /// connection's was dropped, a tracked one's retransmitted SYN renewed nothing (the backend
    /// node's count).
    pub const DSR_CARRIER_REFUSED: u32 = 11;
    /// A TCP packet past its handshake found no flow entry while an upgrade switched to new
    /// maps ([`crate::pins::SWITCH_DEADLINE`]): dropped, for its retransmission to find the
    /// entries being copied, rather than sent to another backend.
    pub const SWITCH_HELD: u32 = 12;
    pub const COUNT: u32 = 13;
}

map_types! {
    Counters: 16;
}
