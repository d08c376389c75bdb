//! Connections: the flows map (a 5-tuple -> how to rewrite that direction, and what was seen
//! of it), and the early-drop ring of new connections.
use crate::{capacity, family::map_types};

/// A 5-tuple as seen on the wire, in either direction of a connection.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FlowKey<A> {
    pub src_addr: A,
    pub dst_addr: A,
    pub src_port: u16,
    pub dst_port: u16,
    pub proto: u8,
    /// Two padding fields rather than a `[u8; 3]`: the kernel programs build a key per packet,
    /// and zeroing a 3-byte array compiles to a call to `memset` (a loop on BPF); a byte and a
    /// half-word are two plain stores.
    pub pad8: u8,
    pub pad16: u16,
}

pub type FlowKey4 = FlowKey<crate::V4>;
pub type FlowKey6 = FlowKey<crate::V6>;

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
    /// The connection's [`crate::Backend::counter`].
    pub counter: u32,
    /// Bits of [`flow_state`].
    pub state: u32,
    /// `bpf_ktime_get_coarse_ns` (CLOCK_MONOTONIC_COARSE) of the latest packet, refreshed at
    /// most about once a second so that an established packet rarely writes; 0 in a reply
    /// entry until the first reply.
    pub last_seen: u64,
}

/// Value of the [`crate::pins::EARLY_DROP4`] array (one element): a queue of the forward keys of the
/// latest new connections, oldest first: `next` counts the keys written (the slot written next
/// is `next % EARLY_DROP_RING`), `head` the keys early drop has looked at (and passed over, or
/// evicted). A writer that laps the head overwrites the oldest keys.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct EarlyDropRing<A> {
    pub next: u32,
    pub head: u32,
    pub keys: [FlowKey<A>; capacity::EARLY_DROP_RING as usize],
}

pub type EarlyDropRing4 = EarlyDropRing<crate::V4>;
pub type EarlyDropRing6 = EarlyDropRing<crate::V6>;

/// Bits of [`Flow::flags`].
pub mod flow_flags {
    /// Rewrite the destination to `dst_addr:dst_port`.
    pub const REWRITE_DESTINATION: u32 = 1;
    /// Rewrite the source to `src_addr:src_port`.
    pub const REWRITE_SOURCE: u32 = 2;
    /// This entry is the reply direction (backend -> client) of a connection.
    pub const REPLY: u32 = 4;
    /// Direct server return, on the node the client's packets arrive at (`--lb-mode=dsr`): the
    /// connection goes to a backend on another node without source NAT, the service address
    /// carried to that node in an IPv4 option (on a TCP SYN, on every UDP datagram), and its
    /// replies leave the backend's node straight to the client. Only this forward entry
    /// exists; the client's packets alone establish it.
    pub const DSR_INGRESS: u32 = 8;
    /// Direct server return, on the backend's node: both entries of a connection whose
    /// service address arrived in the request's option. The forward entry (client ->
    /// backend, which is how the packets arrive) rewrites nothing and names the backend as its
    /// destination; the reply entry gives replies that service address as source. The
    /// entries are each other's plain reversal.
    pub const DSR_BACKEND: u32 = 16;
    /// A forward entry whose client was of source class OUTSIDE when its connection was
    /// balanced (`proxy_common::source_class`): the XDP program finishes the connection's later
    /// packets without classifying their source again (three lookups per packet). Only what
    /// came from the wire has the complete checksums XDP's rewrite needs; an entry without the
    /// flag (a pod's or the node's connection, or one an earlier vipr stored) is TC's.
    pub const FROM_OUTSIDE: u32 = 32;
    /// The bits above hold the low 24 bits of the route generation ([`crate::pins::ROUTE_GENERATION`])
    /// the entry's [`crate::NextHop`] was cached under; the bits below are the flags above.
    pub const ROUTE_GENERATION_SHIFT: u32 = 8;
    /// The flags proper, without the cached route generation.
    pub const MASK: u32 = (1 << ROUTE_GENERATION_SHIFT) - 1;
}

/// Value of the flows map: how to rewrite the packets of one direction of a tracked
/// connection. Both directions get an entry when the first packet is balanced, so every later
/// packet costs one lookup, whichever way it travels. Toward the backend the destination
/// becomes the backend (and the source the node, when masqueraded); back from it the source
/// becomes the frontend again (and the destination the client).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Flow<A> {
    pub src_addr: A,
    pub dst_addr: A,
    pub src_port: u16,
    pub dst_port: u16,
    /// Bits of [`flow_flags`].
    pub flags: u32,
    pub track: FlowTrack,
    pub next_hop: NextHop,
}

pub type Flow4 = Flow<crate::V4>;
pub type Flow6 = Flow<crate::V6>;

/// Where the packets of one direction of a connection leave the node, cached in its flow entry
/// so that an established connection needs no FIB lookup per packet. A cached hop is valid
/// only while the route generation it was cached under (the upper bits of [`Flow::flags`],
/// [`flow_flags::ROUTE_GENERATION_SHIFT`]) is the current one: the agent changes the
/// generation whenever a route or neighbour changes. [`NextHop::default`]: nothing cached.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct NextHop {
    /// The egress interface; 0: nothing cached.
    pub ifindex: u32,
    /// The neighbour's and the egress interface's MAC addresses (`--bpf-forwarding=redirect`;
    /// zero with `stack`, where the hop only says that the packet is forwarded).
    pub dst_mac: [u8; 6],
    pub src_mac: [u8; 6],
}

map_types! {
    FlowKey<A>: 16, 40;
    FlowTrack: 16;
    NextHop: 16;
    Flow<A>: 48, 72;
}

// Not `aya::Pod`: the agent never reads a ring whole.
const _: () = {
    assert!(core::mem::size_of::<EarlyDropRing4>() == 8 + 16 * capacity::EARLY_DROP_RING as usize);
    assert!(core::mem::size_of::<EarlyDropRing6>() == 8 + 40 * capacity::EARLY_DROP_RING as usize);
};
