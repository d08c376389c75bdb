//! Ethernet + IPv4 + TCP frames with valid checksums, as a node receives them.

use std::net::Ipv4Addr;

pub const ETH_HLEN: usize = 14;
const IPPROTO_TCP: u8 = 6;
/// Offsets of the IPv4 addresses in the frame.
pub const SRC_ADDR: std::ops::Range<usize> = ETH_HLEN + 12..ETH_HLEN + 16;
pub const DST_ADDR: std::ops::Range<usize> = ETH_HLEN + 16..ETH_HLEN + 20;

/// A TCP segment (ACK|PSH, 18 bytes of payload: 72 bytes on the wire without FCS).
pub fn tcp(src: (Ipv4Addr, u16), dst: (Ipv4Addr, u16)) -> Vec<u8> {
    let payload = b"GET / HTTP/1.1\r\n\r\n";
    let mut tcp = Vec::with_capacity(20 + payload.len());
    tcp.extend_from_slice(&src.1.to_be_bytes());
    tcp.extend_from_slice(&dst.1.to_be_bytes());
    tcp.extend_from_slice(&0x0102_0304u32.to_be_bytes()); // seq
    tcp.extend_from_slice(&0xa0b0_c0d0u32.to_be_bytes()); // ack
    tcp.extend_from_slice(&[5 << 4, 0x18]); // 20-byte header, ACK|PSH
    tcp.extend_from_slice(&502u16.to_be_bytes()); // window
    tcp.extend_from_slice(&[0, 0, 0, 0]); // checksum, urgent pointer
    tcp.extend_from_slice(payload);
    let mut pseudo = ones_sum(0, &src.0.octets());
    pseudo = ones_sum(pseudo, &dst.0.octets());
    pseudo = ones_sum(pseudo, &[0, IPPROTO_TCP]);
    pseudo = ones_sum(pseudo, &(tcp.len() as u16).to_be_bytes());
    let csum = !fold(ones_sum(pseudo, &tcp));
    tcp[16..18].copy_from_slice(&csum.to_be_bytes());

    let mut ip = Vec::with_capacity(20);
    ip.extend_from_slice(&[0x45, 0]);
    ip.extend_from_slice(&((20 + tcp.len()) as u16).to_be_bytes());
    ip.extend_from_slice(&[0x1c, 0x46, 0x40, 0x00, 63, IPPROTO_TCP, 0, 0]); // id, DF, ttl
    ip.extend_from_slice(&src.0.octets());
    ip.extend_from_slice(&dst.0.octets());
    let csum = !fold(ones_sum(0, &ip));
    ip[10..12].copy_from_slice(&csum.to_be_bytes());

    let mut frame = Vec::with_capacity(ETH_HLEN + ip.len() + tcp.len());
    frame.extend_from_slice(&[0x02, 0, 0, 0, 0, 0x02, 0x02, 0, 0, 0, 0, 0x01, 0x08, 0x00]);
    frame.extend_from_slice(&ip);
    frame.extend_from_slice(&tcp);
    frame
}

fn ones_sum(mut sum: u32, data: &[u8]) -> u32 {
    for word in data.chunks(2) {
        let high = u32::from(word[0]) << 8;
        sum += high | word.get(1).map_or(0, |low| u32::from(*low));
        sum = (sum & 0xffff) + (sum >> 16);
    }
    sum
}

fn fold(mut sum: u32) -> u16 {
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    sum as u16
}

/// The IPv4 source or destination address of a frame.
pub fn addr(frame: &[u8], field: std::ops::Range<usize>) -> Option<Ipv4Addr> {
    let bytes: [u8; 4] = frame.get(field)?.try_into().ok()?;
    Some(Ipv4Addr::from(bytes))
}

/// Source and destination address and port of a TCP/IPv4 frame without IP options.
pub fn endpoints(frame: &[u8]) -> Option<((Ipv4Addr, u16), (Ipv4Addr, u16))> {
    let port = |at: usize| Some(u16::from_be_bytes(frame.get(at..at + 2)?.try_into().ok()?));
    let l4 = ETH_HLEN + 20;
    Some(((addr(frame, SRC_ADDR)?, port(l4)?), (addr(frame, DST_ADDR)?, port(l4 + 2)?)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checksums_verify() {
        let frame = tcp((Ipv4Addr::new(10, 1, 0, 1), 40000), (Ipv4Addr::new(10, 96, 0, 1), 80));
        assert_eq!(frame.len(), 72);
        assert_eq!(fold(ones_sum(0, &frame[ETH_HLEN..ETH_HLEN + 20])), 0xffff);
        let l4 = &frame[ETH_HLEN + 20..];
        let mut sum = ones_sum(0, &frame[SRC_ADDR]);
        sum = ones_sum(sum, &frame[DST_ADDR]);
        sum = ones_sum(sum, &[0, IPPROTO_TCP]);
        sum = ones_sum(sum, &(l4.len() as u16).to_be_bytes());
        assert_eq!(fold(ones_sum(sum, l4)), 0xffff);
        assert_eq!(addr(&frame, DST_ADDR), Some(Ipv4Addr::new(10, 96, 0, 1)));
        assert_eq!(
            endpoints(&frame),
            Some(((Ipv4Addr::new(10, 1, 0, 1), 40000), (Ipv4Addr::new(10, 96, 0, 1), 80)))
        );
    }
}
