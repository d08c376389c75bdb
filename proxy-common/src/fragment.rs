//! IPv4 fragments: the ports of a fragmented datagram's first fragment, for its later ones.
use crate::family::map_types;

/// Key of the [`crate::pins::FRAGMENTS4`] map: what every fragment of one IPv4 datagram carries in
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

/// Value of the [`crate::pins::FRAGMENTS4`] map: the ports of the datagram's first fragment, as it
/// arrived (before any rewrite), which with the key make its flow key.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FragmentPorts {
    pub src_port: u16,
    pub dst_port: u16,
}

map_types! {
    FragmentKey4: 12;
    FragmentPorts: 4;
}
