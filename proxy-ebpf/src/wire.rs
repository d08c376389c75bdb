//! Where the fields vipr reads and writes lie in the headers on the wire: one set of numbers
//! for every path (balancing, XDP, reject, ICMP errors, fragments).

pub const ETH_HLEN: usize = 14;
pub const IPV4_MIN_HLEN: usize = 20;
pub const IPV6_HLEN: usize = 40;

/// The source and destination addresses, from the start of the frame.
pub const IPV4_SADDR_OFF: usize = ETH_HLEN + 12;
pub const IPV4_DADDR_OFF: usize = ETH_HLEN + 16;
pub const IPV6_SADDR_OFF: usize = ETH_HLEN + 8;
pub const IPV6_DADDR_OFF: usize = ETH_HLEN + 24;
pub const ICMP_HLEN: usize = 8;
pub const IPPROTO_ICMP: u8 = 1;
pub const IPPROTO_ICMPV6: u8 = 58;

/// Inside the IPv4 header.
pub const IPV4_CSUM_AT: usize = 10;
/// Of the IPv4 flags + fragment offset field: the offset, and "more fragments".
pub const IP_OFFSET: u16 = 0x1fff;
pub const IP_MF: u16 = 0x2000;

/// Inside the TCP and UDP headers.
pub const TCP_FLAGS_AT: usize = 13;
pub const TCP_CSUM_AT: usize = 16;
pub const UDP_CSUM_AT: usize = 6;

/// IPv6's destination-options extension header, the carrier of direct server return's
/// service address for IPv6 (dsr.rs): vipr's is [`DSR6_HLEN`] bytes right after the fixed
/// header: next header, length (2: 24 bytes), then one option of type [`DSR6_OPTION_TYPE`]
/// with [`DSR6_OPTION_DATA_LEN`] bytes of data (the address, then the port), then two Pad1.
pub const IPPROTO_DSTOPTS: u8 = 60;
pub const DSR6_HLEN: usize = 24;
/// The header's length field: its length in 8-byte units, not counting the first.
pub const DSR6_HDR_EXT_LEN: u8 = (DSR6_HLEN / 8 - 1) as u8;
/// One of RFC 4727's experimental option types: its top bits say "skip if unknown" and
/// "does not change en route", so a router or a node without vipr passes it on untouched.
pub const DSR6_OPTION_TYPE: u8 = 0x1e;
pub const DSR6_OPTION_DATA_LEN: u8 = 18;
