//! Katran-style packet fixtures for SCTP through vipr's TC program, for IPv4 and IPv6, run with
//! BPF_PROG_TEST_RUN.
//!
//! SCTP's checksum is a CRC32c over the whole SCTP packet and no pseudo header, so the datapath
//! leaves it alone when only addresses change and updates it incrementally when a port changes
//! (`proxy_common::sctp::header_change`, over the length the IP header gives). Every SCTP frame
//! that comes out rewritten is therefore judged three ways, independently of each other:
//!
//! - its CRC32c is recomputed over the SCTP packet (the IP header's length of it, not the
//!   frame's) with the field zeroed, with `proxy_common::sctp::checksum`, the plain bitwise CRC
//!   that the datapath's incremental update never calls, and which is held to published SCTP
//!   packets below;
//! - its IPv4 header checksum is recomputed;
//! - it is compared byte for byte with the frame built here from scratch for the rewritten
//!   addresses and ports (with a CRC computed afresh).
//!
//! The packets are what SCTP sends (an INIT with the parameters Linux puts in one, INIT-ACK,
//! COOKIE-ECHO/ACK, DATA with padded odd-length user data, SACK, ABORT), and a few it should
//! never send but a NAT meets anyway (a common header alone, a last chunk without its padding,
//! so an SCTP packet of odd length; a frame longer than its IP packet).
//!
//! Each test runs in a network namespace of its own (unshared by its thread), so the program's
//! FIB lookups see no route and a rewritten packet goes on with TC_ACT_OK on every machine; the
//! masquerade test adds the route toward the pods it needs. Needs root (BPF, mount, unshare).

use testbed::fixtures::{frame, frame6, harness, harness6, icmp_error, netns, table};

use std::{
    collections::HashMap,
    fmt,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    ops::Range,
};

use anyhow::{anyhow, bail, ensure, Context as _, Result};
use aya::maps::{HashMap as BpfHashMap, Map, MapData};
use frame::{
    checksum, compare_frames, compare_frames_at, ep, fold, hex, input_and_output, max_ip_options, ones_sum,
    parse_ipv4, Ep, L4Checksum, Packet, ETH_HLEN, ETH_P_IP, ETH_P_IPV6, IPPROTO_ICMP, IPPROTO_SCTP,
    IPPROTO_TCP, IPPROTO_UDP, IP_MF, ROUTER_ALERT,
};
use frame6::{
    compare_frames6, ep6, parse_ipv6, pseudo_header_sum6, Ep6, Packet6, IPPROTO_ICMPV6, IPV6_HLEN,
    NEXTHDR_FRAGMENT,
};
use harness::{
    check_verdict, describe_flows, masqueraded_entries, nat_entries, verdict_name, Harness, TC_ACT_OK,
    TC_ACT_SHOT, TC_ACT_UNSPEC,
};
use harness6::{add_service6, flows6, insert_flow6};
use icmp_error::{
    check_icmp6_unreachable_answer, icmp4_error, icmp6_error, icmp6_unreachable_answer, quote, Quote,
};
use netns::{in_fresh_netns, ip};
use proxy_common::{
    flow_state, pins, sctp, service_flags, snat, source_class, unmatched, Flow4, Flow6, FlowKey4, FlowKey6,
    FlowTrack,
};
use table::{run_table, Outcome};

/// TC_ACT_REDIRECT, as BPF_PROG_TEST_RUN reports the program's return.
const TC_ACT_REDIRECT: u32 = 7;

/// How much of the SCTP packet an ICMP error quotes: the common header, checksum included, and
/// an INIT's chunk header and initiate tag, which the client's kernel matches the error by.
const SCTP_QUOTE: usize = 20;

/// The first `len` bytes of `ip` as the reject cuts or grows the frame to them: bytes after
/// the IP packet (an Ethernet trailer) stay, missing ones are zeros.
fn quoted(ip: &[u8], len: usize) -> Vec<u8> {
    let mut quote = ip[..len.min(ip.len())].to_vec();
    quote.resize(len, 0);
    quote
}

// ---------------------------------------------------------------------------------------------
// Endpoints of either family.

/// An address of either family and a port: the fixtures are written once for both.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct End {
    addr: IpAddr,
    port: u16,
}

const fn end4(a: [u8; 4], port: u16) -> End {
    End { addr: IpAddr::V4(Ipv4Addr::new(a[0], a[1], a[2], a[3])), port }
}

/// `end6([0xfd00, 0x10, 0x96, 0], 0xa, 80)` is `[fd00:10:96::a]:80`.
const fn end6(prefix: [u16; 4], suffix: u16, port: u16) -> End {
    let addr = Ipv6Addr::new(prefix[0], prefix[1], prefix[2], prefix[3], 0, 0, 0, suffix);
    End { addr: IpAddr::V6(addr), port }
}

impl End {
    fn port(self, port: u16) -> Self {
        Self { port, ..self }
    }

    fn v4(self) -> Ep {
        match self.addr {
            IpAddr::V4(addr) => ep(addr.octets(), self.port),
            IpAddr::V6(_) => panic!("{self} is not IPv4"),
        }
    }

    fn v6(self) -> Ep6 {
        match self.addr {
            IpAddr::V6(addr) => ep6(addr.octets(), self.port),
            IpAddr::V4(_) => panic!("{self} is not IPv6"),
        }
    }
}

impl fmt::Display for End {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        SocketAddr::new(self.addr, self.port).fmt(f)
    }
}

// ---------------------------------------------------------------------------------------------
// SCTP chunks (RFC 9260 section 3.3), as an association sends them.

const CHUNK_DATA: u8 = 0;
const CHUNK_INIT: u8 = 1;
const CHUNK_INIT_ACK: u8 = 2;
const CHUNK_SACK: u8 = 3;
const CHUNK_ABORT: u8 = 6;
const CHUNK_COOKIE_ECHO: u8 = 10;
const CHUNK_COOKIE_ACK: u8 = 11;
/// DATA flags: unordered, beginning and end of a message. As TCP flags, the same byte (13 of
/// the packet) would read FIN|SYN|RST.
const DATA_UNORDERED_WHOLE: u8 = 0x07;
const DATA_WHOLE: u8 = 0x03;
/// ABORT's T bit (the verification tag is reflected), FIN's bit in a TCP header.
const ABORT_T: u8 = 0x01;

/// The tag the client asks for in its INIT: every packet to the client carries it.
const CLIENT_TAG: u32 = 0x5e1f_c0de;
/// The tag the backend asks for in its INIT-ACK: every later packet to the backend carries it.
const SERVER_TAG: u32 = 0x0bad_cafe;
const COOKIE: [u8; 28] = *b"vipr-state-cookie-0123456789";

/// A chunk: type, flags, length (without the padding), value, zero padding to 4 bytes.
fn chunk(kind: u8, flags: u8, value: &[u8]) -> Vec<u8> {
    let length = u16::try_from(4 + value.len()).expect("chunk too long");
    let mut chunk = vec![kind, flags];
    chunk.extend_from_slice(&length.to_be_bytes());
    chunk.extend_from_slice(value);
    chunk.resize(chunk.len().next_multiple_of(4), 0);
    chunk
}

/// A parameter of an INIT or INIT-ACK, padded unless it is the chunk's last (whose padding is
/// the chunk's, outside the chunk length).
fn parameter(kind: u16, value: &[u8], last: bool) -> Vec<u8> {
    let length = u16::try_from(4 + value.len()).expect("parameter too long");
    let mut parameter = kind.to_be_bytes().to_vec();
    parameter.extend_from_slice(&length.to_be_bytes());
    parameter.extend_from_slice(value);
    if !last {
        parameter.resize(parameter.len().next_multiple_of(4), 0);
    }
    parameter
}

/// The fixed part of INIT and INIT-ACK: initiate tag, a_rwnd, outbound and inbound streams,
/// initial TSN (Linux's defaults for the rest).
fn init_fixed(initiate_tag: u32, initial_tsn: u32) -> Vec<u8> {
    let mut fixed = initiate_tag.to_be_bytes().to_vec();
    fixed.extend_from_slice(&106_496u32.to_be_bytes());
    fixed.extend_from_slice(&10u16.to_be_bytes());
    fixed.extend_from_slice(&65_535u16.to_be_bytes());
    fixed.extend_from_slice(&initial_tsn.to_be_bytes());
    fixed
}

/// An INIT as Linux sends one: ECN capable, supported extensions (FORWARD-TSN, RE-CONFIG),
/// Forward-TSN supported, and last the supported address types, 6 bytes long, so the chunk
/// length (42) is not a multiple of 4 and the chunk ends in padding.
fn init_chunk() -> Vec<u8> {
    let mut value = init_fixed(CLIENT_TAG, 0x2ba4_1c7f);
    value.extend(parameter(0x8000, &[], false));
    value.extend(parameter(0x8008, &[0xc0, 0x82], false));
    value.extend(parameter(0xc000, &[], false));
    value.extend(parameter(0x000c, &[0x00, 0x05], true));
    chunk(CHUNK_INIT, 0, &value)
}

fn init_ack_chunk() -> Vec<u8> {
    let mut value = init_fixed(SERVER_TAG, 0x7a31_0e55);
    value.extend(parameter(0x0007, &COOKIE, false));
    value.extend(parameter(0x8000, &[], true));
    chunk(CHUNK_INIT_ACK, 0, &value)
}

fn data_chunk(flags: u8, tsn: u32, user_data: &[u8]) -> Vec<u8> {
    let mut value = tsn.to_be_bytes().to_vec();
    value.extend_from_slice(&[0, 0, 0, 0]); // stream 0, stream sequence 0
    value.extend_from_slice(&0u32.to_be_bytes()); // payload protocol
    value.extend_from_slice(user_data);
    chunk(CHUNK_DATA, flags, &value)
}

fn sack_chunk(cumulative_tsn: u32) -> Vec<u8> {
    let mut value = cumulative_tsn.to_be_bytes().to_vec();
    value.extend_from_slice(&106_496u32.to_be_bytes());
    value.extend_from_slice(&[0, 0, 0, 0]); // no gap blocks, no duplicate TSNs
    chunk(CHUNK_SACK, 0, &value)
}

// ---------------------------------------------------------------------------------------------
// SCTP frames of either family.

/// An SCTP packet in an Ethernet frame, described so that a fixture can say "the same packet,
/// from/to elsewhere" and get it rebuilt, CRC and all.
#[derive(Clone, Debug)]
struct Sctp {
    from: End,
    to: End,
    vtag: u32,
    chunks: Vec<u8>,
    /// IPv4 only.
    ip_options: Vec<u8>,
    /// IPv4: the flags + fragment offset field (else DF); IPv6: `Some` adds a fragment header.
    fragment: Option<u16>,
    /// Bytes after the IP packet: Ethernet padding, or a trailer a NIC left.
    trailer: Vec<u8>,
}

impl Sctp {
    fn new(from: End, to: End, vtag: u32, chunks: Vec<u8>) -> Self {
        Self { from, to, vtag, chunks, ip_options: Vec::new(), fragment: None, trailer: Vec::new() }
    }

    fn from(self, from: End) -> Self {
        Self { from, ..self }
    }

    fn to(self, to: End) -> Self {
        Self { to, ..self }
    }

    fn ip_options(self, options: &[u8]) -> Self {
        Self { ip_options: options.to_vec(), ..self }
    }

    fn fragment(self, fragment: u16) -> Self {
        Self { fragment: Some(fragment), ..self }
    }

    fn trailer(self, trailer: &[u8]) -> Self {
        Self { trailer: trailer.to_vec(), ..self }
    }

    /// Zero padding up to the Ethernet minimum of 60 bytes (without FCS).
    fn pad_to_ethernet_minimum(self) -> Self {
        let len = self.clone().trailer(&[]).build().len();
        self.trailer(&vec![0; 60usize.saturating_sub(len)])
    }

    fn build(&self) -> Vec<u8> {
        let mut frame = match (self.from.addr, self.to.addr) {
            (IpAddr::V4(_), IpAddr::V4(_)) => {
                let mut packet = Packet::sctp(self.from.v4(), self.to.v4(), self.vtag, &self.chunks)
                    .ip_options(&self.ip_options);
                if let Some(fragment) = self.fragment {
                    packet = packet.frag(fragment);
                }
                packet.build()
            }
            (IpAddr::V6(_), IpAddr::V6(_)) => {
                assert!(self.ip_options.is_empty(), "IPv6 has no header options");
                let mut packet = Packet6::sctp(self.from.v6(), self.to.v6(), self.vtag, &self.chunks);
                if self.fragment.is_some() {
                    packet = packet.extension(NEXTHDR_FRAGMENT);
                }
                packet.build()
            }
            _ => panic!("{} -> {}: mixed families", self.from, self.to),
        };
        frame.extend_from_slice(&self.trailer);
        frame
    }
}

fn init(from: End, to: End) -> Sctp {
    Sctp::new(from, to, 0, init_chunk())
}

fn init_ack(from: End, to: End) -> Sctp {
    Sctp::new(from, to, CLIENT_TAG, init_ack_chunk())
}

fn cookie_echo(from: End, to: End) -> Sctp {
    Sctp::new(from, to, SERVER_TAG, chunk(CHUNK_COOKIE_ECHO, 0, &COOKIE))
}

fn cookie_ack(from: End, to: End) -> Sctp {
    Sctp::new(from, to, CLIENT_TAG, chunk(CHUNK_COOKIE_ACK, 0, &[]))
}

/// A DATA packet with `len` bytes of user data (a pattern, not zeros: zeros would leave a
/// wrong length unnoticed in fewer places).
fn data(from: End, to: End, flags: u8, len: usize) -> Sctp {
    let user_data: Vec<u8> = (0..len).map(|i| (i * 7 + 3) as u8).collect();
    Sctp::new(from, to, SERVER_TAG, data_chunk(flags, 0x2ba4_1c7f, &user_data))
}

/// A TCP segment or UDP datagram of either family.
fn tcp_or_udp(proto: u8, from: End, to: End) -> Vec<u8> {
    match (proto, from.addr) {
        (IPPROTO_TCP, IpAddr::V4(_)) => Packet::tcp(from.v4(), to.v4()).build(),
        (IPPROTO_UDP, IpAddr::V4(_)) => Packet::udp(from.v4(), to.v4()).build(),
        (IPPROTO_TCP, IpAddr::V6(_)) => Packet6::tcp(from.v6(), to.v6()).build(),
        (IPPROTO_UDP, IpAddr::V6(_)) => Packet6::udp(from.v6(), to.v6()).build(),
        _ => panic!("no builder for protocol {proto}"),
    }
}

// ---------------------------------------------------------------------------------------------
// Reading SCTP frames back.

/// What the recomputed CRC32c said, both values as the field reads little-endian.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Crc {
    Valid,
    Invalid { stored: u32, computed: u32 },
}

#[derive(Clone, Debug)]
struct SctpView {
    src: IpAddr,
    dst: IpAddr,
    sport: u16,
    dport: u16,
    /// The SCTP packet in the frame, as long as the IP header says.
    l4: Range<usize>,
    /// Always true for IPv6, which has no header checksum.
    ip_checksum_valid: bool,
    crc: Crc,
}

impl SctpView {
    fn source(&self) -> End {
        End { addr: self.src, port: self.sport }
    }

    fn destination(&self) -> End {
        End { addr: self.dst, port: self.dport }
    }

    fn crc_field(&self) -> Range<usize> {
        self.l4.start + sctp::CHECKSUM_OFFSET..self.l4.start + sctp::CHECKSUM_OFFSET + 4
    }
}

/// Parses an Ethernet + IPv4/IPv6 (no extension headers) + whole SCTP frame, recomputing the
/// IPv4 header checksum and the CRC32c over the bytes the IP header says are the SCTP packet.
fn parse_sctp(frame: &[u8]) -> Result<SctpView, String> {
    if frame.len() < ETH_HLEN {
        return Err(format!("frame of {} bytes", frame.len()));
    }
    let ip = &frame[ETH_HLEN..];
    let (src, dst, l4, ip_checksum_valid) = match u16::from_be_bytes([frame[12], frame[13]]) {
        ETH_P_IP => {
            if ip.len() < 20 || ip[0] >> 4 != 4 {
                return Err("not a whole IPv4 header".into());
            }
            let ihl = usize::from(ip[0] & 0x0f) * 4;
            let total_len = usize::from(u16::from_be_bytes([ip[2], ip[3]]));
            if ihl < 20 || total_len < ihl || ip.len() < total_len {
                return Err(format!("IHL {ihl}, total length {total_len}, {} bytes present", ip.len()));
            }
            if ip[9] != IPPROTO_SCTP {
                return Err(format!("protocol {} is not SCTP", ip[9]));
            }
            if u16::from_be_bytes([ip[6], ip[7]]) & 0x3fff != 0 {
                return Err("a fragment: its CRC covers the whole datagram".into());
            }
            let src = IpAddr::V4(Ipv4Addr::new(ip[12], ip[13], ip[14], ip[15]));
            let dst = IpAddr::V4(Ipv4Addr::new(ip[16], ip[17], ip[18], ip[19]));
            let valid = fold(ones_sum(0, &ip[..ihl])) == 0xffff;
            (src, dst, ETH_HLEN + ihl..ETH_HLEN + total_len, valid)
        }
        ETH_P_IPV6 => {
            if ip.len() < IPV6_HLEN || ip[0] >> 4 != 6 {
                return Err("not a whole IPv6 header".into());
            }
            let payload_len = usize::from(u16::from_be_bytes([ip[4], ip[5]]));
            if ip.len() < IPV6_HLEN + payload_len {
                return Err(format!("payload length {payload_len}, {} bytes present", ip.len() - IPV6_HLEN));
            }
            if ip[6] != IPPROTO_SCTP {
                return Err(format!("next header {} is not SCTP", ip[6]));
            }
            let src = IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(&ip[8..24]).unwrap()));
            let dst = IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(&ip[24..40]).unwrap()));
            (src, dst, ETH_HLEN + IPV6_HLEN..ETH_HLEN + IPV6_HLEN + payload_len, true)
        }
        other => return Err(format!("ethertype {other:#06x}")),
    };
    if l4.len() < sctp::HEADER_LEN {
        return Err(format!("{} bytes of SCTP, less than the common header", l4.len()));
    }
    let mut packet = frame[l4.clone()].to_vec();
    let field = sctp::CHECKSUM_OFFSET..sctp::CHECKSUM_OFFSET + 4;
    let stored = u32::from_le_bytes(packet[field.clone()].try_into().unwrap());
    packet[field].fill(0);
    let computed = sctp::checksum(&packet);
    Ok(SctpView {
        src,
        dst,
        sport: u16::from_be_bytes([packet[0], packet[1]]),
        dport: u16::from_be_bytes([packet[2], packet[3]]),
        l4,
        ip_checksum_valid,
        crc: if stored == computed { Crc::Valid } else { Crc::Invalid { stored, computed } },
    })
}

fn is_ipv4(frame: &[u8]) -> bool {
    frame[12..14] == ETH_P_IP.to_be_bytes()
}

// ---------------------------------------------------------------------------------------------
// The ICMP/ICMPv6 port unreachable, built from the input alone.

/// The answer vipr's reject makes of an SCTP packet: Ethernet addresses swapped; for IPv4 a
/// header 0x45, TOS 0xc0 | (TOS & 0x1e), ID 0, no flags, TTL 64, ICMP type 3 code 3; for IPv6
/// traffic class and flow label 0, hop limit 64, ICMPv6 type 1 code 4; from the service
/// address to the client; quoting the input's IP header (options and all) and the first 20
/// bytes of SCTP exactly as they came, CRC included (a CRC has no offload fixed point to settle
/// on), zeros where the frame was shorter.
fn expected_unreachable(input: &[u8]) -> Vec<u8> {
    let ip = &input[ETH_HLEN..];
    if !is_ipv4(input) {
        return icmp6_unreachable_answer(input, &quoted(ip, IPV6_HLEN + SCTP_QUOTE));
    }
    let mut frame = Vec::new();
    frame.extend_from_slice(&input[6..12]);
    frame.extend_from_slice(&input[0..6]);
    let ihl = usize::from(ip[0] & 0x0f) * 4;
    let mut icmp = vec![3, 3, 0, 0, 0, 0, 0, 0];
    icmp.extend_from_slice(&quoted(ip, ihl + SCTP_QUOTE));
    let icmp_csum = checksum(ones_sum(0, &icmp));
    icmp[2..4].copy_from_slice(&icmp_csum.to_be_bytes());
    let total_len = u16::try_from(20 + icmp.len()).unwrap();
    let mut header = vec![0x45, 0xc0 | (ip[1] & 0x1e)];
    header.extend_from_slice(&total_len.to_be_bytes());
    header.extend_from_slice(&[0, 0, 0, 0, 64, IPPROTO_ICMP, 0, 0]);
    header.extend_from_slice(&ip[16..20]);
    header.extend_from_slice(&ip[12..16]);
    let ip_csum = checksum(ones_sum(0, &header));
    header[10..12].copy_from_slice(&ip_csum.to_be_bytes());
    frame.extend_from_slice(&ETH_P_IP.to_be_bytes());
    frame.extend_from_slice(&header);
    frame.extend_from_slice(&icmp);
    frame
}

/// What the client's kernel relies on, without the expected bytes: headers, checksums, and a
/// quote that is the input's own IP header and SCTP common header.
fn check_unreachable_alone(input: &[u8], out: &[u8]) -> Result<()> {
    ensure!(out.len() >= ETH_HLEN + 20, "answer of {} bytes", out.len());
    ensure!(out[0..6] == input[6..12] && out[6..12] == input[0..6], "Ethernet addresses not swapped");
    ensure!(out[12..14] == input[12..14], "ethertype {:02x?} differs from the input's", &out[12..14]);
    let (ip, original) = (&out[ETH_HLEN..], &input[ETH_HLEN..]);
    let (icmp, quote_len) = if is_ipv4(input) {
        let ihl = usize::from(original[0] & 0x0f) * 4;
        ensure!(ip[0] == 0x45, "new IPv4 header starts with {:#04x}", ip[0]);
        ensure!(ip[1] == 0xc0 | (original[1] & 0x1e), "TOS {:#04x}", ip[1]);
        ensure!(fold(ones_sum(0, &ip[..20])) == 0xffff, "IPv4 header checksum invalid");
        ensure!(usize::from(u16::from_be_bytes([ip[2], ip[3]])) == ip.len(), "IPv4 total length");
        ensure!(ip[4..8] == [0; 4], "ID, flags and offset {:02x?}", &ip[4..8]);
        ensure!((ip[8], ip[9]) == (64, IPPROTO_ICMP), "TTL/protocol {}/{}", ip[8], ip[9]);
        ensure!(ip[12..16] == original[16..20] && ip[16..20] == original[12..16], "addresses not swapped");
        let icmp = &ip[20..];
        ensure!((icmp[0], icmp[1]) == (3, 3), "ICMP type/code {}/{}", icmp[0], icmp[1]);
        ensure!(fold(ones_sum(0, icmp)) == 0xffff, "ICMP checksum invalid");
        (icmp, ihl + SCTP_QUOTE)
    } else {
        (check_icmp6_unreachable_answer(input, out)?, IPV6_HLEN + SCTP_QUOTE)
    };
    ensure!(icmp[4..8] == [0; 4], "unused word {:02x?}", &icmp[4..8]);
    let quote = &icmp[8..];
    ensure!(quote.len() == quote_len, "quote of {} bytes, not {quote_len}", quote.len());
    ensure!(
        quote == quoted(original, quote_len).as_slice(),
        "the quote is not the input's IP header and SCTP common header (CRC included){}",
        hex(quote)
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Judging one run.

enum Expect {
    /// The program must not touch the frame.
    Unchanged,
    /// The program must turn the frame into this one, with a valid CRC.
    Frame(Vec<u8>),
    /// As `Frame`, and the CRC field must be the input's, byte for byte: only addresses
    /// changed, which SCTP's checksum does not cover.
    FrameKeepingCrc(Vec<u8>),
    /// The ICMP/ICMPv6 port unreachable for the input.
    Unreachable,
}

fn run(h: &Harness, input: &[u8], verdict: u32, expect: &Expect) -> Result<Vec<u8>> {
    let (got, out) = h.run(input)?;
    judge(input, verdict, expect, got, &out)?;
    Ok(out)
}

/// Judges what the program made of `input` (verdict `got`, frame `out`), on its own so that
/// the checks can be shown to fail.
fn judge(input: &[u8], verdict: u32, expect: &Expect, got: u32, out: &[u8]) -> Result<()> {
    // Whatever parses as a whole SCTP frame must be valid on the way in: fixture mistakes.
    if let Ok(view) = parse_sctp(input) {
        ensure!(
            view.ip_checksum_valid && view.crc == Crc::Valid,
            "fixture bug: input checksums are not valid: {view:?}"
        );
    }
    let observed = || input_and_output(input, out);
    check_verdict(input, got, out, verdict, matches!(expect, Expect::Unchanged))?;
    match expect {
        Expect::Unchanged => {}
        Expect::Frame(expected) | Expect::FrameKeepingCrc(expected) => {
            let want = parse_sctp(expected).map_err(|e| anyhow!("fixture bug: expected frame: {e}"))?;
            ensure!(
                want.ip_checksum_valid && want.crc == Crc::Valid,
                "fixture bug: expected frame has bad checksums: {want:?}"
            );
            let view =
                parse_sctp(out).map_err(|e| anyhow!("output is not an SCTP frame: {e}\n  {}", observed()))?;
            ensure!(view.ip_checksum_valid, "output IPv4 header checksum is wrong\n  {}", observed());
            if let Crc::Invalid { stored, computed } = view.crc {
                bail!(
                    "output SCTP CRC32c is wrong: the field holds {stored:#010x}, the packet's is \
                     {computed:#010x} ({} -> {}, {} bytes of SCTP)\n  {}",
                    view.source(),
                    view.destination(),
                    view.l4.len(),
                    observed()
                );
            }
            if matches!(expect, Expect::FrameKeepingCrc(_)) {
                let before = parse_sctp(input).map_err(|e| anyhow!("fixture bug: input: {e}"))?;
                ensure!(
                    out[view.crc_field()] == input[before.crc_field()],
                    "the CRC field changed ({:02x?} -> {:02x?}) though no port did\n  {}",
                    &input[before.crc_field()],
                    &out[view.crc_field()],
                    observed()
                );
            }
            let ip_checksum = if is_ipv4(expected) { vec![ETH_HLEN + 10] } else { vec![] };
            compare_frames_at(expected, out, &ip_checksum).map_err(|e| anyhow!("output frame: {e}"))?;
        }
        Expect::Unreachable => {
            let expected = expected_unreachable(input);
            ensure!(
                out == expected,
                "answer differs from the expected ICMP error\n  expected:{}\n  {}",
                hex(&expected),
                observed()
            );
            check_unreachable_alone(input, out).with_context(observed)?;
        }
    }
    Ok(())
}

/// Judges a rewritten TCP/UDP frame of either family: checksums recomputed, bytes compared.
fn judge_tcp_udp(expected: &[u8], out: &[u8]) -> Result<()> {
    if is_ipv4(expected) {
        let view = parse_ipv4(out).map_err(|e| anyhow!("{e}{}", hex(out)))?;
        ensure!(view.ip_checksum_valid && view.l4_checksum == L4Checksum::Valid, "{view:?}{}", hex(out));
        compare_frames(expected, out).map_err(|e| anyhow!("{e}"))
    } else {
        let view = parse_ipv6(out).map_err(|e| anyhow!("{e}{}", hex(out)))?;
        ensure!(view.l4_checksum == L4Checksum::Valid, "{view:?}{}", hex(out));
        compare_frames6(expected, out).map_err(|e| anyhow!("{e}"))
    }
}

// ---------------------------------------------------------------------------------------------
// Maps of either family.

/// Both families' flows maps, as they should be.
#[derive(Clone, Default)]
struct Flows {
    v4: Vec<(FlowKey4, Flow4)>,
    v6: Vec<(FlowKey6, Flow6)>,
}

impl Flows {
    fn and(mut self, other: Self) -> Self {
        self.v4.extend(other.v4);
        self.v6.extend(other.v6);
        self
    }
}

/// The two entries of `client -> frontend` balanced to `backend` without masquerading.
fn nat_flows(client: End, frontend: End, backend: End, proto: u8) -> Flows {
    match client.addr {
        IpAddr::V4(_) => {
            Flows { v4: nat_entries(client.v4(), frontend.v4(), backend.v4(), proto), ..Flows::default() }
        }
        IpAddr::V6(_) => {
            Flows { v6: nat_entries(client.v6(), frontend.v6(), backend.v6(), proto), ..Flows::default() }
        }
    }
}

/// The two entries of `client -> frontend` masqueraded to `node` toward `backend`.
fn masqueraded_flows(client: End, frontend: End, backend: End, node: End, proto: u8) -> Flows {
    match client.addr {
        IpAddr::V4(_) => Flows {
            v4: masqueraded_entries(client.v4(), frontend.v4(), backend.v4(), node.v4(), proto),
            ..Flows::default()
        },
        IpAddr::V6(_) => Flows {
            v6: masqueraded_entries(client.v6(), frontend.v6(), backend.v6(), node.v6(), proto),
            ..Flows::default()
        },
    }
}

fn insert_flows(h: &mut Harness, flows: &Flows) -> Result<()> {
    for (key, flow) in &flows.v4 {
        h.insert_flow(*key, *flow)?;
    }
    for (key, flow) in &flows.v6 {
        insert_flow6(h, *key, *flow)?;
    }
    Ok(())
}

/// Checks that both flows maps (`last_seen` aside) are exactly `expected`.
fn expect_flows(h: &Harness, expected: &Flows) -> Result<()> {
    let want4: HashMap<FlowKey4, Flow4> = expected.v4.iter().copied().collect();
    let got4 = h.flows()?;
    ensure!(
        got4 == want4,
        "IPv4 flows map:\n  expected:\n{}\n  actual:\n{}",
        describe_flows(&want4),
        describe_flows(&got4)
    );
    let want6: HashMap<FlowKey6, Flow6> = expected.v6.iter().copied().collect();
    let got6 = flows6(h)?;
    ensure!(
        got6 == want6,
        "IPv6 flows map:\n  expected:\n{}\n  actual:\n{}",
        describe_flows(&want6),
        describe_flows(&got6)
    );
    Ok(())
}

/// Every flow entry's protocol and tracking state as the program left them (`last_seen`
/// included), both families.
fn flow_tracks(h: &Harness) -> Result<Vec<(u8, FlowTrack)>> {
    let mut tracks: Vec<(u8, FlowTrack)> = h.raw_flows()?.iter().map(|(k, v)| (k.proto, v.track)).collect();
    let path = h.bpffs().join(pins::FLOWS6);
    let data = MapData::from_pin(&path).with_context(|| format!("opening {}", path.display()))?;
    let flows: BpfHashMap<MapData, FlowKey6, Flow6> = Map::from_map_data(data)?.try_into()?;
    for entry in flows.iter() {
        let (key, flow) = entry?;
        tracks.push((key.proto, flow.track));
    }
    Ok(tracks)
}

/// A frontend (for sources outside the cluster) whose backend set `backend_set` holds exactly
/// `backends`, with `flags`; the service id is `backend_set + 1000`.
fn add_service(
    h: &mut Harness,
    frontend: End,
    proto: u8,
    backend_set: u32,
    backends: &[End],
    flags: u32,
) -> Result<()> {
    match frontend.addr {
        IpAddr::V4(_) => {
            let backends: Vec<Ep> = backends.iter().map(|b| b.v4()).collect();
            h.add_service_with_flags(frontend.v4(), proto, backend_set, &backends, flags)
        }
        IpAddr::V6(_) => {
            let backends: Vec<Ep6> = backends.iter().map(|b| b.v6()).collect();
            add_service6(h, frontend.v6(), proto, source_class::OUTSIDE, backend_set, &backends, flags)
        }
    }
}

fn set_unmatched(h: &mut Harness, addr: IpAddr, action: u8) -> Result<()> {
    match addr {
        IpAddr::V4(addr) => h.set_unmatched(32, addr.octets(), action),
        IpAddr::V6(addr) => harness6::set_unmatched6(h, 128, addr.octets(), action),
    }
}

// ---------------------------------------------------------------------------------------------
// The world, once per family.

const FRONT_PORT: u16 = 80;
/// An SCTP frontend whose backend listens on the same port (Diameter's).
const SAME_PORT: u16 = 3868;
/// A port of the cluster IP served for TCP only.
const TCP_ONLY_PORT: u16 = 443;
/// A port of the cluster IP served for nothing.
const UNSERVED_PORT: u16 = 9999;
const SCTP_SET: u32 = 1;
const TCP_SET: u32 = 2;
const UDP_SET: u32 = 3;
const SAME_PORT_SET: u32 = 4;
const EMPTY_SET: u32 = 5;
const MASQUERADE_SET: u32 = 6;
const TCP_ONLY_SET: u32 = 7;

struct World {
    family: &'static str,
    client: End,
    /// A cluster IP with an SCTP, a TCP and a UDP frontend on port 80, each with its own
    /// backend, an SCTP frontend on SAME_PORT and a TCP one on TCP_ONLY_PORT.
    vip: IpAddr,
    /// SCTP's backend for port 80, on another port (8080).
    backend: End,
    tcp_backend: End,
    udp_backend: End,
    same_port_backend: End,
    /// A backend in no backend set: only a flow entry can send a packet there.
    other_backend: End,
    /// A cluster IP whose SCTP frontends have no endpoints: port 80 asks for REJECT, 81 not.
    empty_vip: IpAddr,
    /// A service address with a MASQUERADE SCTP frontend on port 80 (masquerade test only).
    masquerade_vip: IpAddr,
    /// The node's address toward the pods, once [`route_to_pods`] has run.
    node: IpAddr,
    /// Outside every service address.
    elsewhere: End,
}

impl World {
    fn front(&self) -> End {
        End { addr: self.vip, port: FRONT_PORT }
    }

    fn same_port_front(&self) -> End {
        End { addr: self.vip, port: SAME_PORT }
    }

    fn empty_front(&self) -> End {
        End { addr: self.empty_vip, port: 80 }
    }

    fn silent_front(&self) -> End {
        End { addr: self.empty_vip, port: 81 }
    }

    fn masquerade_front(&self) -> End {
        End { addr: self.masquerade_vip, port: FRONT_PORT }
    }

    fn name(&self, name: &str) -> String {
        format!("{}_{name}", self.family)
    }
}

static V4: World = World {
    family: "v4",
    client: end4([192, 168, 1, 100], 40000),
    vip: end4([10, 96, 0, 10], 0).addr,
    backend: end4([10, 244, 1, 5], 8080),
    tcp_backend: end4([10, 244, 2, 6], 8081),
    udp_backend: end4([10, 244, 3, 7], 8082),
    same_port_backend: end4([10, 244, 1, 6], SAME_PORT),
    other_backend: end4([10, 244, 9, 9], 9090),
    empty_vip: end4([10, 96, 0, 20], 0).addr,
    masquerade_vip: end4([10, 96, 0, 30], 0).addr,
    node: end4([10, 244, 0, 1], 0).addr,
    elsewhere: end4([172, 16, 5, 5], 80),
};

static V6: World = World {
    family: "v6",
    client: end6([0x2001, 0xdb8, 1, 0], 0x100, 40000),
    vip: end6([0xfd00, 0x10, 0x96, 0], 0xa, 0).addr,
    backend: end6([0xfd00, 0x10, 0x244, 1], 5, 8080),
    tcp_backend: end6([0xfd00, 0x10, 0x244, 2], 6, 8081),
    udp_backend: end6([0xfd00, 0x10, 0x244, 3], 7, 8082),
    same_port_backend: end6([0xfd00, 0x10, 0x244, 1], 6, SAME_PORT),
    other_backend: end6([0xfd00, 0x10, 0x244, 9], 9, 9090),
    empty_vip: end6([0xfd00, 0x10, 0x96, 0], 0x14, 0).addr,
    masquerade_vip: end6([0xfd00, 0x10, 0x96, 0], 0x1e, 0).addr,
    node: end6([0xfd00, 0x10, 0x244, 0], 1, 0).addr,
    elsewhere: end6([0x2001, 0xdb8, 0x55, 0], 5, 80),
};

fn standard_world(w: &World, h: &mut Harness) -> Result<()> {
    add_service(h, w.front(), IPPROTO_SCTP, SCTP_SET, &[w.backend], 0)?;
    add_service(h, w.front(), IPPROTO_TCP, TCP_SET, &[w.tcp_backend], 0)?;
    add_service(h, w.front(), IPPROTO_UDP, UDP_SET, &[w.udp_backend], 0)?;
    add_service(h, w.same_port_front(), IPPROTO_SCTP, SAME_PORT_SET, &[w.same_port_backend], 0)?;
    let tcp_only = End { addr: w.vip, port: TCP_ONLY_PORT };
    add_service(h, tcp_only, IPPROTO_TCP, TCP_ONLY_SET, &[w.tcp_backend], 0)?;
    add_service(h, w.empty_front(), IPPROTO_SCTP, EMPTY_SET, &[], service_flags::REJECT_WHEN_EMPTY)?;
    add_service(h, w.silent_front(), IPPROTO_SCTP, EMPTY_SET, &[], 0)?;
    set_unmatched(h, w.vip, unmatched::REJECT)?;
    set_unmatched(h, w.empty_vip, unmatched::REJECT)
}

/// In the current (fresh) namespace: a forwarding node with both worlds' node addresses on an
/// interface whose connected routes cover the backends, so the program finds a route and a
/// source toward them.
fn route_to_pods() -> Result<()> {
    ip(&["link", "set", "lo", "up"])?;
    // A veth pair: dummy devices are not in every kernel.
    ip(&["link", "add", "vd0", "type", "veth", "peer", "name", "vd1"])?;
    ip(&["link", "set", "vd1", "up"])?;
    ip(&["link", "set", "vd0", "up"])?;
    ip(&["addr", "add", &format!("{}/16", V4.node), "dev", "vd0"])?;
    ip(&["-6", "addr", "add", &format!("{}/48", V6.node), "dev", "vd0", "nodad"])?;
    std::fs::write("/proc/sys/net/ipv4/ip_forward", "1").context("enabling IPv4 forwarding")?;
    std::fs::write("/proc/sys/net/ipv6/conf/all/forwarding", "1").context("enabling IPv6 forwarding")
}

// ---------------------------------------------------------------------------------------------
// The table.

type Setup = Box<dyn Fn(&mut Harness) -> Result<()> + Send + Sync>;

struct Fixture {
    name: String,
    /// Map state before the packet; the harness starts with empty maps.
    setup: Setup,
    input: Vec<u8>,
    verdict: u32,
    expect: Expect,
    /// Both flows maps, exactly, after the packet.
    flows: Flows,
}

fn world_setup(w: &'static World) -> Setup {
    Box::new(move |h| standard_world(w, h))
}

/// The standard world with `flows` already tracked.
fn tracked_setup(w: &'static World, flows: Flows) -> Setup {
    Box::new(move |h| {
        standard_world(w, h)?;
        insert_flows(h, &flows)
    })
}

/// A new association to `input.to` balanced to `backend`: destination rewritten, both
/// directions recorded with protocol 132.
fn balanced(w: &'static World, name: &str, input: Sctp, backend: End) -> Fixture {
    let flows = nat_flows(input.from, input.to, backend, IPPROTO_SCTP);
    let output = input.clone().to(backend).build();
    let expect =
        if input.to.port == backend.port { Expect::FrameKeepingCrc(output) } else { Expect::Frame(output) };
    Fixture {
        name: w.name(name),
        setup: world_setup(w),
        input: input.build(),
        verdict: TC_ACT_OK,
        expect,
        flows,
    }
}

/// A packet of a tracked association (`flows`) that becomes `output`.
fn tracked(w: &'static World, name: &str, flows: Flows, input: Sctp, output: Sctp) -> Fixture {
    let ports_kept = (input.from.port, input.to.port) == (output.from.port, output.to.port);
    let output = output.build();
    Fixture {
        name: w.name(name),
        setup: tracked_setup(w, flows.clone()),
        input: input.build(),
        verdict: TC_ACT_OK,
        expect: if ports_kept { Expect::FrameKeepingCrc(output) } else { Expect::Frame(output) },
        flows,
    }
}

/// A frame the program must not touch (TC_ACT_UNSPEC); `flows` are tracked before and stay.
fn untouched(w: &'static World, name: &str, flows: Flows, input: Vec<u8>) -> Fixture {
    Fixture {
        name: w.name(name),
        setup: tracked_setup(w, flows.clone()),
        input,
        verdict: TC_ACT_UNSPEC,
        expect: Expect::Unchanged,
        flows,
    }
}

fn dropped(w: &'static World, name: &str, input: Vec<u8>) -> Fixture {
    Fixture {
        name: w.name(name),
        setup: world_setup(w),
        input,
        verdict: TC_ACT_SHOT,
        expect: Expect::Unchanged,
        flows: Flows::default(),
    }
}

fn rejected(w: &'static World, name: &str, input: Sctp) -> Fixture {
    Fixture {
        name: w.name(name),
        setup: world_setup(w),
        input: input.build(),
        verdict: TC_ACT_REDIRECT,
        expect: Expect::Unreachable,
        flows: Flows::default(),
    }
}

fn truncated(packet: &Sctp, sctp_bytes: usize) -> Vec<u8> {
    let mut frame = packet.build();
    let l4 = parse_sctp(&frame).expect("whole packet").l4;
    frame.truncate(l4.start + sctp_bytes);
    frame
}

fn fixtures(w: &'static World) -> Vec<Fixture> {
    let (client, front, backend) = (w.client, w.front(), w.backend);
    let association = nat_flows(client, front, backend, IPPROTO_SCTP);
    let odd_unpadded = {
        let mut packet = data(client, front, DATA_WHOLE, 5);
        packet.chunks.truncate(16 + 5);
        packet
    };
    let mut table = vec![
        // --- new associations, to a backend on another port: the CRC follows the port
        balanced(w, "init_to_another_port", init(client, front), backend),
        balanced(w, "data_with_padded_odd_chunk", data(client, front, DATA_WHOLE, 5), backend),
        // 33 bytes of SCTP: the last chunk lacks its padding.
        balanced(w, "odd_length_without_chunk_padding", odd_unpadded, backend),
        balanced(w, "common_header_only", Sctp::new(client, front, SERVER_TAG, vec![]), backend),
        balanced(w, "large_data", data(client, front, DATA_WHOLE, 1400), backend),
        // More than 2 KiB of SCTP: the length's upper byte is 11.
        balanced(w, "jumbo_data", data(client, front, DATA_WHOLE, 3000), backend),
        // The frame is longer than its IP packet: the CRC covers what the IP header says.
        balanced(w, "init_with_zero_ethernet_trailer", init(client, front).trailer(&[0; 10]), backend),
        balanced(
            w,
            "init_with_garbage_ethernet_trailer",
            init(client, front).trailer(b"\xde\xad\xbe\xef\x5a\xa5\x01\x02\x03\x04\x05"),
            backend,
        ),
        balanced(
            w,
            "cookie_ack_with_ethernet_padding",
            cookie_ack(client, front).pad_to_ethernet_minimum(),
            backend,
        ),
        // --- replies of a tracked association: the source goes back to the frontend
        tracked(
            w,
            "init_ack_reply_is_reverse_nated",
            association.clone(),
            init_ack(backend, client),
            init_ack(front, client),
        ),
        tracked(
            w,
            "cookie_ack_reply_with_ethernet_padding",
            association.clone(),
            cookie_ack(backend, client).pad_to_ethernet_minimum(),
            cookie_ack(front, client).pad_to_ethernet_minimum(),
        ),
        tracked(
            w,
            "sack_reply_with_garbage_trailer",
            association.clone(),
            Sctp::new(backend, client, CLIENT_TAG, sack_chunk(7)).trailer(&[0xff; 7]),
            Sctp::new(front, client, CLIENT_TAG, sack_chunk(7)).trailer(&[0xff; 7]),
        ),
        // The flow entry names a backend in no backend set: only the entry explains it.
        tracked(
            w,
            "tracked_data_follows_its_flow_entry",
            nat_flows(client, front, w.other_backend, IPPROTO_SCTP),
            data(client, front, DATA_UNORDERED_WHOLE, 64),
            data(client, w.other_backend, DATA_UNORDERED_WHOLE, 64),
        ),
        // --- targetPort == port: addresses only, the CRC stays as it was
        balanced(w, "same_port_init_keeps_crc", init(client, w.same_port_front()), w.same_port_backend),
        tracked(
            w,
            "same_port_reply_keeps_crc",
            nat_flows(client, w.same_port_front(), w.same_port_backend, IPPROTO_SCTP),
            init_ack(w.same_port_backend, client),
            init_ack(w.same_port_front(), client),
        ),
        // --- no endpoints, or no such frontend: ICMP port unreachable quoting 12 bytes
        rejected(w, "init_without_endpoints_is_rejected", init(client, w.empty_front())),
        rejected(
            w,
            "large_data_without_endpoints_is_rejected",
            data(client, w.empty_front(), DATA_WHOLE, 1400),
        ),
        rejected(
            w,
            "common_header_only_without_endpoints_is_rejected",
            Sctp::new(client, w.empty_front(), SERVER_TAG, vec![]),
        ),
        rejected(
            w,
            "padded_frame_without_endpoints_is_rejected",
            cookie_ack(client, w.empty_front()).pad_to_ethernet_minimum(),
        ),
        rejected(w, "unserved_port_of_cluster_ip_is_rejected", init(client, front.port(UNSERVED_PORT))),
        // Protocol is part of the frontend: port 443 is served for TCP only.
        rejected(w, "port_served_only_for_tcp_is_rejected", init(client, front.port(TCP_ONLY_PORT))),
        dropped(w, "without_endpoints_without_reject_is_dropped", init(client, w.silent_front()).build()),
        // --- flows of one protocol do not serve another
        untouched(
            w,
            "tcp_from_sctp_backend_matches_no_sctp_flow",
            association.clone(),
            tcp_or_udp(IPPROTO_TCP, backend, client),
        ),
        untouched(
            w,
            "udp_from_sctp_backend_matches_no_sctp_flow",
            association.clone(),
            tcp_or_udp(IPPROTO_UDP, backend, client),
        ),
        untouched(
            w,
            "sctp_from_tcp_backend_matches_no_tcp_flow",
            nat_flows(client, front, w.tcp_backend, IPPROTO_TCP),
            init_ack(w.tcp_backend, client).build(),
        ),
        // --- not vipr's, or not parseable
        untouched(w, "to_no_service_address", Flows::default(), init(client, w.elsewhere).build()),
        untouched(w, "reply_without_flow", Flows::default(), init_ack(backend, client).build()),
        untouched(
            w,
            "truncated_before_the_checksum",
            Flows::default(),
            truncated(&init(client, front), sctp::HEADER_LEN - 1),
        ),
    ];
    if w.family == "v4" {
        table.extend([
            balanced(w, "init_ihl6_router_alert", init(client, front).ip_options(&ROUTER_ALERT), backend),
            balanced(w, "init_ihl15", init(client, front).ip_options(&max_ip_options()), backend),
            balanced(w, "init_without_df", init(client, front).fragment(0), backend),
            rejected(
                w,
                "init_ihl6_without_endpoints_is_rejected",
                init(client, w.empty_front()).ip_options(&ROUTER_ALERT),
            ),
            // A fragment's CRC covers the whole datagram, which no fragment shows: the first
            // one is left to the stack, tracked association or not.
            untouched(
                w,
                "first_fragment_untouched",
                Flows::default(),
                init(client, front).fragment(IP_MF).build(),
            ),
            untouched(
                w,
                "first_fragment_of_tracked_association_untouched",
                association.clone(),
                data(client, front, DATA_WHOLE, 1400).fragment(IP_MF).build(),
            ),
            untouched(
                w,
                "later_fragment_elsewhere_untouched",
                Flows::default(),
                data(client, w.elsewhere, DATA_WHOLE, 64).fragment(185).build(),
            ),
            // No first fragment was ever remembered for SCTP: unplaceable, and to a service
            // address such a fragment is dropped (fragment.rs).
            dropped(
                w,
                "later_fragment_to_cluster_ip_dropped",
                data(client, front, DATA_WHOLE, 64).fragment(185).build(),
            ),
        ]);
    } else {
        table.push(untouched(
            w,
            "behind_fragment_header_untouched",
            Flows::default(),
            init(client, front).fragment(0).build(),
        ));
    }
    table
}

fn run_fixture(fixture: &Fixture) -> Result<()> {
    let mut h = Harness::new()?;
    (fixture.setup)(&mut h).context("setup")?;
    run(&h, &fixture.input, fixture.verdict, &fixture.expect)?;
    expect_flows(&h, &fixture.flows)
}

#[test]
fn fixture_table() {
    let fixtures: Vec<Fixture> = fixtures(&V4).into_iter().chain(fixtures(&V6)).collect();
    // A failing table panics on the namespace's thread, after printing every failure.
    in_fresh_netns(|| {
        run_table(
            &fixtures,
            |fixture| fixture.name.as_str(),
            |fixture| run_fixture(fixture).map(|()| Outcome::Passed),
        );
        Ok(())
    })
    .unwrap_or_else(|err| panic!("{err:#}"));
}

// ---------------------------------------------------------------------------------------------
// Whole associations, masquerade, protocols side by side.

/// An association's packets in both directions, against one harness: each is rewritten with a
/// valid CRC, the flows map holds the two entries with protocol 132 all along, and SCTP
/// chunk flags (byte 13, where TCP keeps its flags) never mark the connection closing: SCTP
/// expires by idle time, as UDP does.
fn association(w: &'static World) -> Result<()> {
    let (client, front, backend) = (w.client, w.front(), w.backend);
    let mut h = Harness::new()?;
    standard_world(w, &mut h)?;
    let flows = nat_flows(client, front, backend, IPPROTO_SCTP);
    let steps = [
        ("INIT", init(client, front), init(client, backend)),
        ("INIT-ACK", init_ack(backend, client), init_ack(front, client)),
        ("COOKIE-ECHO", cookie_echo(client, front), cookie_echo(client, backend)),
        ("COOKIE-ACK", cookie_ack(backend, client), cookie_ack(front, client)),
        (
            "DATA with flags 0x07",
            data(client, front, DATA_UNORDERED_WHOLE, 300),
            data(client, backend, DATA_UNORDERED_WHOLE, 300),
        ),
        (
            "SACK",
            Sctp::new(backend, client, CLIENT_TAG, sack_chunk(0x2ba4_1c7f)),
            Sctp::new(front, client, CLIENT_TAG, sack_chunk(0x2ba4_1c7f)),
        ),
        (
            "ABORT with the T bit",
            Sctp::new(client, front, CLIENT_TAG, chunk(CHUNK_ABORT, ABORT_T, &[])),
            Sctp::new(client, backend, CLIENT_TAG, chunk(CHUNK_ABORT, ABORT_T, &[])),
        ),
    ];
    for (what, input, output) in steps {
        run(&h, &input.build(), TC_ACT_OK, &Expect::Frame(output.build())).context(what)?;
        expect_flows(&h, &flows).with_context(|| format!("after {what}"))?;
    }
    let tracks = flow_tracks(&h)?;
    ensure!(tracks.len() == 2, "{} flow entries", tracks.len());
    for (proto, track) in tracks {
        ensure!(proto == IPPROTO_SCTP, "an entry of protocol {proto}");
        ensure!(
            track.state & (flow_state::FIN | flow_state::RST | flow_state::SYN | flow_state::SYN_ACK) == 0,
            "SCTP chunk flags were taken for TCP's: {track:?}"
        );
        ensure!(track.last_seen != 0, "both directions passed, but: {track:?}");
    }
    Ok(())
}

#[test]
fn association_in_both_directions() {
    in_fresh_netns(|| {
        association(&V4).context("IPv4")?;
        association(&V6).context("IPv6")
    })
    .unwrap_or_else(|err| panic!("{err:#}"));
}

/// Runs a new masqueraded association's INIT from `client`; the node side it got.
fn masqueraded(w: &World, h: &Harness, client: End) -> Result<End> {
    let input = init(client, w.masquerade_front());
    let (verdict, out) = h.run(&input.build())?;
    let view = parse_sctp(&out).map_err(|e| anyhow!("{client}: {e}{}", hex(&out)))?;
    let node_side = view.source();
    ensure!(node_side.addr == w.node, "{client}: source {node_side} is not the node's address");
    let expected = input.clone().from(node_side).to(w.backend);
    judge(&input.build(), TC_ACT_REDIRECT, &Expect::Frame(expected.build()), verdict, &out)
        .with_context(|| format!("{client}"))?;
    Ok(node_side)
}

/// A MASQUERADE frontend: the source becomes the node's address and a port of the masquerade
/// range, the destination the backend, so both ports of the SCTP header change in both
/// directions (the client's port, outside the range, is not kept), and the CRC must follow
/// both. A client port inside the range is kept, so only the destination port changes.
fn masquerade(w: &'static World) -> Result<()> {
    let mut h = Harness::new()?;
    standard_world(w, &mut h)?;
    let front = w.masquerade_front();
    add_service(&mut h, front, IPPROTO_SCTP, MASQUERADE_SET, &[w.backend], service_flags::MASQUERADE)?;
    let range = snat::DEFAULT_FIRST..snat::DEFAULT_FIRST + snat::DEFAULT_COUNT;

    let node_side = masqueraded(w, &h, w.client).context("client outside the range")?;
    ensure!(
        range.contains(&node_side.port.into()) && node_side.port != w.client.port,
        "node port {} for client port {}",
        node_side.port,
        w.client.port
    );
    let in_range = w.client.port(20000);
    let kept = masqueraded(w, &h, in_range).context("client inside the range")?;
    ensure!(kept.port == in_range.port, "the client's port in the range was not kept: {kept}");
    let flows = masqueraded_flows(w.client, front, w.backend, node_side, IPPROTO_SCTP)
        .and(masqueraded_flows(in_range, front, w.backend, kept, IPPROTO_SCTP));
    expect_flows(&h, &flows)?;

    // No route toward the clients here: the stack gets the replies.
    for (client, node) in [(w.client, node_side), (in_range, kept)] {
        let reply = init_ack(w.backend, node);
        let expected = init_ack(front, client);
        run(&h, &reply.build(), TC_ACT_OK, &Expect::Frame(expected.build()))
            .with_context(|| format!("reply to {client}"))?;
        let data_reply = Sctp { vtag: CLIENT_TAG, ..data(w.backend, node, DATA_WHOLE, 999) };
        let expected = Sctp { vtag: CLIENT_TAG, ..data(front, client, DATA_WHOLE, 999) };
        run(&h, &data_reply.build(), TC_ACT_OK, &Expect::Frame(expected.build()))
            .with_context(|| format!("odd-sized DATA reply to {client}"))?;
    }
    expect_flows(&h, &flows)
}

#[test]
fn masquerade_changes_both_ports_with_a_valid_crc() {
    in_fresh_netns(|| {
        route_to_pods()?;
        masquerade(&V4).context("IPv4")?;
        masquerade(&V6).context("IPv6")
    })
    .unwrap_or_else(|err| panic!("{err:#}"));
}

/// An SCTP, a TCP and a UDP frontend on the same address and port, each with its own backend:
/// each protocol's packets go to its own backend, each is tracked under its own protocol, and
/// each backend's replies are reverse-NATed only in their own protocol.
fn protocols_side_by_side(w: &'static World) -> Result<()> {
    let (client, front) = (w.client, w.front());
    let mut h = Harness::new()?;
    standard_world(w, &mut h)?;

    run(&h, &init(client, front).build(), TC_ACT_OK, &Expect::Frame(init(client, w.backend).build()))
        .context("SCTP")?;
    let mut flows = nat_flows(client, front, w.backend, IPPROTO_SCTP);
    for (proto, backend) in [(IPPROTO_TCP, w.tcp_backend), (IPPROTO_UDP, w.udp_backend)] {
        let (verdict, out) = h.run(&tcp_or_udp(proto, client, front))?;
        ensure!(verdict == TC_ACT_OK, "protocol {proto}: verdict {}", verdict_name(verdict));
        judge_tcp_udp(&tcp_or_udp(proto, client, backend), &out)
            .with_context(|| format!("protocol {proto} to {front}"))?;
        flows = flows.and(nat_flows(client, front, backend, proto));
    }
    expect_flows(&h, &flows)?;

    run(&h, &init_ack(w.backend, client).build(), TC_ACT_OK, &Expect::Frame(init_ack(front, client).build()))
        .context("SCTP reply")?;
    for (proto, backend) in [(IPPROTO_TCP, w.tcp_backend), (IPPROTO_UDP, w.udp_backend)] {
        let (verdict, out) = h.run(&tcp_or_udp(proto, backend, client))?;
        ensure!(verdict == TC_ACT_OK, "protocol {proto} reply: verdict {}", verdict_name(verdict));
        judge_tcp_udp(&tcp_or_udp(proto, front, client), &out)
            .with_context(|| format!("protocol {proto} reply"))?;
        // The SCTP backend's address and port, in another protocol, is nobody's reply.
        let stray = tcp_or_udp(proto, w.backend, client);
        let (verdict, out) = h.run(&stray)?;
        ensure!(
            verdict == TC_ACT_UNSPEC && out == stray,
            "protocol {proto} from the SCTP backend: verdict {}{}",
            verdict_name(verdict),
            hex(&out)
        );
    }
    expect_flows(&h, &flows)
}

#[test]
fn protocol_is_part_of_the_frontend() {
    in_fresh_netns(|| {
        protocols_side_by_side(&V4).context("IPv4")?;
        protocols_side_by_side(&V6).context("IPv6")
    })
    .unwrap_or_else(|err| panic!("{err:#}"));
}

/// A packet that arrives with a wrong CRC leaves with a wrong CRC, wrong by the same bits: the
/// update adds the port change to whatever the field holds, so the backend still discards a
/// packet damaged on the way (no NAT may make a damaged packet look whole).
#[test]
fn a_wrong_crc_stays_wrong() {
    in_fresh_netns(|| {
        for w in [&V4, &V6] {
            let mut h = Harness::new()?;
            standard_world(w, &mut h)?;
            let damage = [0x00, 0x10, 0x00, 0x80];
            let mut input = init(w.client, w.front()).build();
            let mut expected = init(w.client, w.backend).build();
            for frame in [&mut input, &mut expected] {
                let field = parse_sctp(frame).map_err(|e| anyhow!("{e}"))?.crc_field();
                frame[field].iter_mut().zip(damage).for_each(|(byte, bit)| *byte ^= bit);
            }
            let (verdict, out) = h.run(&input)?;
            ensure!(verdict == TC_ACT_OK, "{}: verdict {}", w.family, verdict_name(verdict));
            let view = parse_sctp(&out).map_err(|e| anyhow!("{e}"))?;
            ensure!(view.crc != Crc::Valid, "{}: the NAT made a damaged packet look whole", w.family);
            let ip_checksum = if w.family == "v4" { vec![ETH_HLEN + 10] } else { vec![] };
            compare_frames_at(&expected, &out, &ip_checksum).map_err(|e| anyhow!("{}: {e}", w.family))?;
        }
        Ok(())
    })
    .unwrap_or_else(|err| panic!("{err:#}"));
}

/// A checksum field of 0 is what a pod's SCTP socket sends over veth (CHECKSUM_PARTIAL, the
/// CRC left to an offload, which computes it over the packet with the field as it is): the
/// port rewrite must leave it 0, or the CRC computed later would be wrong.
#[test]
fn a_pending_crc_stays_zero() {
    in_fresh_netns(|| {
        for w in [&V4, &V6] {
            let mut h = Harness::new()?;
            standard_world(w, &mut h)?;
            let mut input = init(w.client, w.front()).build();
            let mut expected = init(w.client, w.backend).build();
            for frame in [&mut input, &mut expected] {
                let field = parse_sctp(frame).map_err(|e| anyhow!("{e}"))?.crc_field();
                frame[field].fill(0);
            }
            let (verdict, out) = h.run(&input)?;
            ensure!(verdict == TC_ACT_OK, "{}: verdict {}", w.family, verdict_name(verdict));
            let ip_checksum = if w.family == "v4" { vec![ETH_HLEN + 10] } else { vec![] };
            compare_frames_at(&expected, &out, &ip_checksum).map_err(|e| anyhow!("{}: {e}", w.family))?;
        }
        Ok(())
    })
    .unwrap_or_else(|err| panic!("{err:#}"));
}

/// An ICMP "fragmentation needed" (IPv4, MTU 1400) or "packet too big" (IPv6, MTU 1280) from
/// `sender` to `receiver` about the SCTP packet `quoted`, cut as `how`; the quoted CRC field,
/// when the quote reaches it, holds `crc` if given.
fn too_big(sender: IpAddr, receiver: IpAddr, quoted: &Sctp, how: Quote, crc: Option<[u8; 4]>) -> Vec<u8> {
    let mut quoted = quote(&quoted.build(), how);
    let header_len = if quoted[0] >> 4 == 4 { usize::from(quoted[0] & 0x0f) * 4 } else { IPV6_HLEN };
    let field = header_len + sctp::CHECKSUM_OFFSET..header_len + sctp::CHECKSUM_OFFSET + 4;
    if let (Some(crc), true) = (crc, quoted.len() >= field.end) {
        quoted[field].copy_from_slice(&crc);
    }
    match (sender, receiver) {
        (IpAddr::V4(from), IpAddr::V4(to)) => {
            icmp4_error(from.octets(), to.octets(), (3, 4), [0, 0, 0x05, 0x78], &quoted).build()
        }
        (IpAddr::V6(from), IpAddr::V6(to)) => {
            icmp6_error(from.octets(), to.octets(), (2, 0), [0, 0, 0x05, 0x00], &quoted)
        }
        _ => panic!("{sender} -> {receiver}: mixed families"),
    }
}

/// The checksums of an ICMP error frame: the outer IPv4 header's, the ICMP message's (ICMPv6:
/// with the pseudo header), the quoted IPv4 header's. Their offsets, for a comparison that
/// lets 0x0000 stand for 0xffff.
fn error_checksums(frame: &[u8]) -> Result<Vec<usize>> {
    let ip = &frame[ETH_HLEN..];
    if is_ipv4(frame) {
        let total = usize::from(u16::from_be_bytes([ip[2], ip[3]]));
        ensure!(fold(ones_sum(0, &ip[..20])) == 0xffff, "outer IPv4 header checksum invalid");
        ensure!(fold(ones_sum(0, &ip[20..total])) == 0xffff, "ICMP checksum invalid");
        let quoted_ihl = usize::from(ip[28] & 0x0f) * 4;
        ensure!(fold(ones_sum(0, &ip[28..28 + quoted_ihl])) == 0xffff, "quoted IPv4 header checksum invalid");
        Ok(vec![ETH_HLEN + 10, ETH_HLEN + 22, ETH_HLEN + 38])
    } else {
        let len = usize::from(u16::from_be_bytes([ip[4], ip[5]]));
        let (src, dst) = (ip[8..24].try_into().unwrap(), ip[24..40].try_into().unwrap());
        let icmp = &ip[IPV6_HLEN..IPV6_HLEN + len];
        let sum = pseudo_header_sum6(src, dst, IPPROTO_ICMPV6, icmp.len());
        ensure!(fold(ones_sum(sum, icmp)) == 0xffff, "ICMPv6 checksum invalid");
        Ok(vec![ETH_HLEN + IPV6_HLEN + 2])
    }
}

/// An ICMP error about a packet of a tracked association, from the backend or a router on its
/// way, reaches the client as from the frontend and quoting the packet the client sent: quoted
/// destination back to the frontend's address and port, quoted CRC as it was (it covers a
/// packet the quote does not hold, and no receiver checks it). SCTP finds its path MTU by
/// these errors.
fn errors_about_an_association(w: &'static World) -> Result<()> {
    let (client, front, backend) = (w.client, w.front(), w.backend);
    let mut h = Harness::new()?;
    standard_world(w, &mut h)?;
    let flows = nat_flows(client, front, backend, IPPROTO_SCTP);
    insert_flows(&mut h, &flows)?;
    let router = match w.node {
        IpAddr::V4(_) => end4([10, 244, 9, 1], 0).addr,
        IpAddr::V6(_) => end6([0xfd00, 0x10, 0x244, 9], 1, 0).addr,
    };
    let cases = [
        ("INIT quoted whole, from the backend", init(client, backend), Quote::Whole, backend.addr),
        ("DATA quoted whole, from a router", data(client, backend, DATA_WHOLE, 300), Quote::Whole, router),
        ("DATA quoted to its CRC", data(client, backend, DATA_WHOLE, 1400), Quote::L4Bytes(12), router),
        ("DATA quoted to its tag", data(client, backend, DATA_WHOLE, 1400), Quote::L4Bytes(8), router),
    ];
    for (what, quoted, how, sender) in cases {
        let sent = quoted.build();
        let l4 = parse_sctp(&sent).map_err(|e| anyhow!("{e}"))?.l4;
        let crc: [u8; 4] = sent[l4.start + sctp::CHECKSUM_OFFSET..][..4].try_into()?;
        let input = too_big(sender, client.addr, &quoted, how, None);
        let expected = too_big(front.addr, client.addr, &quoted.clone().to(front), how, Some(crc));
        error_checksums(&input).with_context(|| format!("fixture bug: {what}: input"))?;
        let fields = error_checksums(&expected).with_context(|| format!("fixture bug: {what}: expected"))?;
        let (verdict, out) = h.run(&input)?;
        let observed = || format!("{what}\n  {}", input_and_output(&input, &out));
        ensure!(verdict == TC_ACT_OK, "verdict {}: {}", verdict_name(verdict), observed());
        error_checksums(&out).with_context(observed)?;
        compare_frames_at(&expected, &out, &fields).map_err(|e| anyhow!("{what}: {e}"))?;
    }
    expect_flows(&h, &flows)
}

#[test]
fn icmp_errors_about_an_association_are_reverse_nated() {
    in_fresh_netns(|| {
        errors_about_an_association(&V4).context("IPv4")?;
        errors_about_an_association(&V6).context("IPv6")
    })
    .unwrap_or_else(|err| panic!("{err:#}"));
}

// ---------------------------------------------------------------------------------------------
// The checks themselves.

/// The CRC32c these fixtures trust, on SCTP packets whose checksums someone else computed:
/// scapy's regression tests (secdev/scapy, test/scapy/layers/sctp.uts) build an INIT and a
/// SACK with IP()/SCTP() and state the checksum field (0x402c0b5f and 0x3b01d404, the bytes in
/// the order they lie in the packet). And against a table-driven CRC32c written here, over
/// lengths and contents the vectors do not reach.
#[test]
fn checksum_matches_published_sctp_packets() {
    let init = [
        0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x40, 0x2c, 0x0b, 0x5f, 0x01, 0x00, 0x00, 0x1c, 0x00,
        0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x05,
        0x00, 0x08, 0x7f, 0x00, 0x00, 0x01,
    ];
    let sack = [
        0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x3b, 0x01, 0xd4, 0x04, 0x03, 0x00, 0x00, 0x14, 0x00,
        0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x01, 0x00, 0x00, 0x00, 0x07, 0x00, 0x1c,
    ];
    for (name, packet) in [("INIT", &init[..]), ("SACK", &sack[..])] {
        let mut zeroed = packet.to_vec();
        zeroed[8..12].fill(0);
        assert_eq!(sctp::checksum(&zeroed).to_le_bytes(), packet[8..12], "scapy's {name}");
        // The frame parser reads the field the same way.
        let mut frame = frame::ethernet_header(ETH_P_IP);
        frame.extend_from_slice(&[0x45, 0, 0, 20 + packet.len() as u8, 0, 1, 0, 0, 64, IPPROTO_SCTP, 0, 0]);
        frame.extend_from_slice(&[127, 0, 0, 1, 127, 0, 0, 1]);
        let ip_csum = checksum(ones_sum(0, &frame[ETH_HLEN..]));
        frame[ETH_HLEN + 10..ETH_HLEN + 12].copy_from_slice(&ip_csum.to_be_bytes());
        frame.extend_from_slice(packet);
        let view = parse_sctp(&frame).expect("scapy's packet parses");
        assert!(view.ip_checksum_valid && view.crc == Crc::Valid, "scapy's {name}: {view:?}");
    }

    // Sarwate's byte-at-a-time table, reflected polynomial 0x82f63b78.
    let table: Vec<u32> = (0..256u32)
        .map(|n| (0..8).fold(n, |c, _| if c & 1 != 0 { (c >> 1) ^ 0x82f6_3b78 } else { c >> 1 }))
        .collect();
    let by_table = |data: &[u8]| {
        !data
            .iter()
            .fold(u32::MAX, |crc, &byte| (crc >> 8) ^ table[((crc ^ u32::from(byte)) & 0xff) as usize])
    };
    assert_eq!(by_table(b"123456789"), 0xe306_9283, "the table itself");
    let mut state = 0x2545_f491_u32;
    for len in (0..64).chain([255, 256, 257, 1500, 3001]) {
        let data: Vec<u8> = (0..len)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 17;
                state ^= state << 5;
                state as u8
            })
            .collect();
        assert_eq!(sctp::checksum(&data), by_table(&data), "{len} bytes");
    }
}

/// `expected` (`input` with other ports) with the CRC field `input`'s updated as the datapath
/// does, but for an SCTP packet of `len` bytes: what a NAT with a wrong idea of the length
/// would send.
fn updated_with_length(input: &[u8], expected: &[u8], l4: usize, len: usize) -> Vec<u8> {
    let word = |frame: &[u8], at: usize| u32::from_le_bytes(frame[l4 + at..l4 + at + 4].try_into().unwrap());
    let change = sctp::header_change(word(input, 0) ^ word(expected, 0), len as u32);
    let mut out = expected.to_vec();
    let field = l4 + sctp::CHECKSUM_OFFSET..l4 + sctp::CHECKSUM_OFFSET + 4;
    out[field].copy_from_slice(&(word(input, sctp::CHECKSUM_OFFSET) ^ change).to_le_bytes());
    out
}

/// The judge notices a wrong CRC wherever it comes from: any flipped bit of a built SCTP
/// packet, a damaged CRC field in the program's real output, a damaged expectation, and the
/// output of a NAT that rewrote the ports but forgot the CRC, or updated it for the wrong
/// length. And the reject checks notice a damaged answer.
#[test]
fn crc_checks_can_fail() {
    in_fresh_netns(|| {
        for w in [&V4, &V6] {
            let (client, front, backend) = (w.client, w.front(), w.backend);
            let frame = init(client, front).build();
            let view = parse_sctp(&frame).map_err(|e| anyhow!("{e}"))?;
            ensure!(view.crc == Crc::Valid && view.ip_checksum_valid, "{view:?}");
            for i in view.l4.clone() {
                for bit in 0..8 {
                    let mut damaged = frame.clone();
                    damaged[i] ^= 1 << bit;
                    let crc = parse_sctp(&damaged).map_err(|e| anyhow!("{e}"))?.crc;
                    ensure!(crc != Crc::Valid, "{}: flipping bit {bit} of byte {i} went unnoticed", w.family);
                }
            }

            let mut h = Harness::new()?;
            standard_world(w, &mut h)?;
            let input = init(client, front).build();
            let expected = init(client, backend).build();
            let (verdict, out) = h.run(&input)?;
            judge(&input, TC_ACT_OK, &Expect::Frame(expected.clone()), verdict, &out)
                .context("the real output")?;

            let crc_at = parse_sctp(&out).map_err(|e| anyhow!("{e}"))?.crc_field().start;
            let mut damaged_out = out.clone();
            damaged_out[crc_at] ^= 0x01;
            let err = judge(&input, TC_ACT_OK, &Expect::Frame(expected.clone()), verdict, &damaged_out)
                .err()
                .context("a damaged CRC in the output went unnoticed")?;
            ensure!(format!("{err:#}").contains("CRC32c is wrong"), "{}: {err:#}", w.family);

            let mut damaged_expectation = expected.clone();
            damaged_expectation[crc_at] ^= 0x80;
            ensure!(
                judge(&input, TC_ACT_OK, &Expect::Frame(damaged_expectation), verdict, &out).is_err(),
                "{}: a damaged expected CRC went unnoticed",
                w.family
            );

            // What a NAT without the CRC update sends: the new ports and addresses, the old CRC.
            let mut forgetful = expected.clone();
            forgetful[crc_at..crc_at + 4].copy_from_slice(&input[crc_at..crc_at + 4]);
            let err = judge(&input, TC_ACT_OK, &Expect::Frame(expected.clone()), verdict, &forgetful)
                .err()
                .context("a stale CRC went unnoticed")?;
            ensure!(format!("{err:#}").contains("CRC32c is wrong"), "{}: {err:#}", w.family);
            // The same port: a CRC that changed is noticed although it could not be valid anyway.
            let same = init(client, w.same_port_front()).build();
            let same_out = init(client, w.same_port_backend).build();
            let mut changed = same_out.clone();
            changed[crc_at] ^= 0x01;
            ensure!(
                judge(&same, TC_ACT_OK, &Expect::FrameKeepingCrc(same_out), TC_ACT_OK, &changed).is_err(),
                "{}: a changed CRC went unnoticed with the same ports",
                w.family
            );

            // What a NAT that takes the wrong length for the CRC update sends: the frame's
            // instead of the IP header's (the trailer fixtures), the IPv4 total length less 20
            // instead of less the IHL (the options fixtures). Right with the right length.
            let trailer = init(client, front).trailer(b"\xde\xad\xbe\xef");
            let (input, expected) = (trailer.build(), trailer.clone().to(backend).build());
            let l4 = parse_sctp(&input).map_err(|e| anyhow!("{e}"))?.l4;
            let with_length = |len: usize| updated_with_length(&input, &expected, l4.start, len);
            ensure!(with_length(l4.len()) == expected, "{}: the simulated update is wrong", w.family);
            let frame_len = input.len() - l4.start;
            let err = judge(
                &input,
                TC_ACT_OK,
                &Expect::Frame(expected.clone()),
                TC_ACT_OK,
                &with_length(frame_len),
            )
            .err()
            .context("a CRC updated for the frame's length went unnoticed")?;
            ensure!(format!("{err:#}").contains("CRC32c is wrong"), "{}: {err:#}", w.family);
            if w.family == "v4" {
                let options = init(client, front).ip_options(&ROUTER_ALERT);
                let (input, expected) = (options.build(), options.clone().to(backend).build());
                let l4 = parse_sctp(&input).map_err(|e| anyhow!("{e}"))?.l4;
                let ignoring_ihl =
                    updated_with_length(&input, &expected, l4.start, l4.len() + ROUTER_ALERT.len());
                ensure!(
                    judge(&input, TC_ACT_OK, &Expect::Frame(expected), TC_ACT_OK, &ignoring_ihl).is_err(),
                    "a CRC updated for a length without the IPv4 options went unnoticed"
                );
            }

            // The reject answer: every flipped bit shows.
            let input = init(client, w.empty_front()).build();
            let answer = expected_unreachable(&input);
            check_unreachable_alone(&input, &answer).context("the expected answer")?;
            for i in 0..answer.len() {
                let mut damaged = answer.clone();
                damaged[i] ^= 0x01;
                ensure!(
                    check_unreachable_alone(&input, &damaged).is_err(),
                    "{}: flipping a bit of answer byte {i} went unnoticed",
                    w.family
                );
            }
        }
        Ok(())
    })
    .unwrap_or_else(|err| panic!("{err:#}"));
}
