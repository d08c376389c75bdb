//! REJECT for services without endpoints: the packet that found no backend is turned, in
//! place, into the ICMP "port unreachable" its sender's kernel expects, and sent back out of
//! the interface it came in on. The client's connect() or recv() then fails with
//! ECONNREFUSED instead of timing out, as with kube-proxy's REJECT rule. The same construction
//! answers a tracked packet too big for its way (route.rs) with "fragmentation needed" (IPv6:
//! "packet too big") naming the MTU, as a router would; both count against one rate.
//!
//! The error is built from the packet itself, so it costs no socket, no route lookup and no
//! copy to userspace:
//!
//! ```text
//!  in:   | Ethernet | IP header (+ options)  | L4 header | payload ... |
//!  cut:  | Ethernet | IP header (+ options)  | L4 quote  |                 bpf_skb_change_tail
//!  room: | Ethernet | 28 (v4) / 48 (v6) bytes | IP header (+ options) | L4 quote |   bpf_skb_adjust_room
//!  out:  | Eth (swapped) | new IP | ICMP | the original IP header | L4 quote |
//! ```
//!
//! **The quote** is the original IP header as it arrived (options and all) followed by the
//! first bytes of its L4 header: 8 for UDP (the whole header), 20 for SCTP (the common header
//! and, of an INIT, the initiate tag its sender matches an error about the INIT by), 20 for TCP
//! (the header without options). RFC 792 asks for at least 8 bytes and RFC 1812 for as much as fits in 576; the
//! receiving kernel matches the error to its socket by the addresses and ports in the quote,
//! and TCP also checks the quoted sequence number, all within the first 8 bytes. TCP quotes 20
//! because `bpf_skb_change_tail` refuses to cut a CHECKSUM_PARTIAL skb before the end of its
//! L4 checksum field (byte 18 of a TCP header), and TCP packets sent over veth by a local
//! client, SYNs included, arrive CHECKSUM_PARTIAL (so do GRO'd TCP segments): with an 8-byte
//! TCP quote every such SYN was dropped. A packet shorter than its quote is grown: the missing
//! bytes are zeros (the kernel zeroes what `bpf_skb_change_tail` adds).
//!
//! **The quoted L4 checksum field** is the one byte pair not copied verbatim. A
//! CHECKSUM_PARTIAL skb stays CHECKSUM_PARTIAL whatever a TC program does to it (no helper
//! clears `ip_summed`), and its checksum start still points at the L4 header, which is now the
//! L4 part of the quote, the last bytes of the frame. A device without checksum offload (or
//! `skb_checksum_help` in software) will therefore compute "the L4 checksum" of those bytes on
//! the way out and store it in the quoted checksum field, after the ICMP checksum was
//! computed. The field is set to the value that computation produces for it: the `f` with
//! `f == !(sum of the other quoted L4 words + f)` in ones' complement arithmetic, i.e.
//! `2f = !S`, `f = rotr1(!S)`. Whether the skb was CHECKSUM_PARTIAL or not, and whether an
//! offload runs or not, the frame on the wire is then the same and its ICMP checksum is valid.
//! No receiver validates a quoted checksum (Linux's tcp_v4_err/udp_err ignore it; conntrack's
//! NAT of ICMP errors at most updates it incrementally). SCTP's CRC32c has no such fixed
//! point: a CHECKSUM_PARTIAL SCTP packet (a local SCTP socket over a device with CRC offload)
//! that meets a device without that offload on its way back gets a CRC written into its quote
//! and an ICMP checksum that no longer matches. Over veth, the path pods use, the offload
//! stays pending and the receiver trusts it.
//!
//! Only unfragmented packets or first fragments may be rejected (the caller's parser passes
//! no fragment at all today): a later fragment carries no ports to quote. Every helper failure,
//! and anything this code cannot quote (not TCP/UDP/SCTP, an IPv4 header whose length disagrees
//! with `l4_offset`, IPv6 extension headers), drops the packet: a drop is the safe fallback,
//! and once the packet has been resized there is nothing else to do with it.
//!
//! `reject_ipv4` and `reject_ipv6` share everything after the IP-specific header writes:
//! [`settle_quoted_l4_checksum`], [`icmp_checksum`] and [`send_back`].
use aya_ebpf::helpers::bpf_ktime_get_ns;
use aya_ebpf::{
    bindings::{__sk_buff, bpf_adj_room_mode::BPF_ADJ_ROOM_MAC},
    helpers::{bpf_csum_diff, bpf_redirect, bpf_skb_adjust_room, bpf_skb_change_tail, bpf_skb_load_bytes},
    programs::TcContext,
};
use proxy_common::{datapath_stat, proto};

use crate::{
    counters::stat,
    family::{Address, Ipv4, Ipv6},
    wire::{
        ETH_HLEN, ICMP_HLEN, IPPROTO_ICMP, IPPROTO_ICMPV6, IPV4_MIN_HLEN, IPV6_HLEN, TCP_CSUM_AT, UDP_CSUM_AT,
    },
};

/// A family's ICMP errors to a packet's sender: port unreachable, and "too big" (IPv4's
/// fragmentation needed, IPv6's packet too big).
pub trait Reject: Address {
    /// Answers the TCP/UDP/SCTP packet whose L4 header starts at `l4_offset` with this
    /// family's ICMP port unreachable; the program's verdict.
    fn reject(ctx: &TcContext, l4_offset: usize) -> i32;
    /// Answers it with this family's "too big" error naming `mtu`, as a router on its way
    /// would (path MTU discovery); the program's verdict.
    fn too_big(ctx: &TcContext, l4_offset: usize, mtu: u32) -> i32;
}

impl Reject for Ipv4 {
    #[inline(always)]
    fn reject(ctx: &TcContext, l4_offset: usize) -> i32 {
        reject_ipv4(ctx, l4_offset)
    }

    #[inline(always)]
    fn too_big(ctx: &TcContext, l4_offset: usize, mtu: u32) -> i32 {
        // RFC 1191: the next hop's MTU in the low 16 bits of the header's second word.
        let [high, low] = u16::try_from(mtu).unwrap_or(u16::MAX).to_be_bytes();
        answer_ipv4(ctx, l4_offset, [ICMP_DEST_UNREACH, ICMP_FRAG_NEEDED, 0, 0, 0, 0, high, low])
    }
}

impl Reject for Ipv6 {
    #[inline(always)]
    fn reject(ctx: &TcContext, l4_offset: usize) -> i32 {
        reject_ipv6(ctx, l4_offset)
    }

    #[inline(always)]
    fn too_big(ctx: &TcContext, l4_offset: usize, mtu: u32) -> i32 {
        let [a, b, c, d] = mtu.to_be_bytes();
        answer_ipv6(ctx, l4_offset, [ICMPV6_PKT_TOOBIG, 0, 0, 0, a, b, c, d])
    }
}

const TC_ACT_SHOT: i32 = 2;

const ETH_ALEN: usize = 6;
const ETH_P_IP: [u8; 2] = 0x0800u16.to_be_bytes();
const ETH_P_IPV6: [u8; 2] = 0x86ddu16.to_be_bytes();

const IPV4_MAX_HLEN: usize = 60;
/// RFC 1812 4.3.2.5: precedence 6 (internetwork control) for ICMP errors, the original TOS
/// bits kept, ECN not set.
const IPTOS_PREC_INTERNETCONTROL: u8 = 0xc0;
const IPTOS_TOS_MASK: u8 = 0x1e;
const ICMP_DEST_UNREACH: u8 = 3;
const ICMP_PORT_UNREACH: u8 = 3;
const ICMP_FRAG_NEEDED: u8 = 4;
/// Type, code, checksum (filled in last), unused.
const ICMP_HEADER: [u8; ICMP_HLEN] = [ICMP_DEST_UNREACH, ICMP_PORT_UNREACH, 0, 0, 0, 0, 0, 0];
const TTL: u8 = 64;

const ICMPV6_DEST_UNREACH: u8 = 1;
const ICMPV6_PORT_UNREACH: u8 = 4;
const ICMPV6_HEADER: [u8; ICMP_HLEN] = [ICMPV6_DEST_UNREACH, ICMPV6_PORT_UNREACH, 0, 0, 0, 0, 0, 0];
const ICMPV6_PKT_TOOBIG: u8 = 2;

/// Offsets of the answer's parts from the start of the frame.
const V4_ICMP_OFF: usize = ETH_HLEN + IPV4_MIN_HLEN;
const V4_QUOTE_OFF: usize = V4_ICMP_OFF + ICMP_HLEN;
const V6_ADDRS_OFF: usize = ETH_HLEN + 8;
const V6_ICMP_OFF: usize = ETH_HLEN + IPV6_HLEN;
const V6_QUOTE_OFF: usize = V6_ICMP_OFF + ICMP_HLEN;

/// How much of each L4 header the quote carries, and where its checksum field is.
const TCP_QUOTE: usize = 20;
const UDP_QUOTE: usize = 8;
/// SCTP's common header and the first chunk's header and first word: a client's kernel
/// matches an error about an INIT (verification tag 0) by the INIT's initiate tag, at bytes
/// 16..20 (`sctp_err_lookup`); a shorter quote is ignored and the client waits out its
/// timers. It also covers the checksum field, where a pending CRC offload writes.
const SCTP_QUOTE: usize = 20;
const MAX_L4_QUOTE: usize = TCP_QUOTE;

/// The largest ICMP message (header + quote) each family builds.
const V4_MAX_ICMP: usize = ICMP_HLEN + IPV4_MAX_HLEN + MAX_L4_QUOTE;
const V6_MAX_ICMP: usize = ICMP_HLEN + IPV6_HLEN + MAX_L4_QUOTE;

/// Turns the IPv4 TCP/UDP/SCTP packet in `ctx` (Ethernet + IPv4 of any IHL + L4 at `l4_offset`,
/// parsed by the caller, not a later fragment) into an ICMP port unreachable from its
/// destination to its source, and redirects it to egress of the interface it arrived on.
/// Returns the program's verdict: `TC_ACT_REDIRECT`, or `TC_ACT_SHOT` if any step failed.
///
/// The answer: Ethernet addresses swapped; IPv4 header 0x45, TOS 0xc0 | (TOS & 0x1e), ID 0, no
/// DF, TTL 64, protocol ICMP, source = the original destination (the service address the
/// client's socket is connected to), destination = the original source; ICMP type 3 code 3;
/// then the original IPv4 header with its options and the first 8 (UDP) or 20 (TCP, SCTP)
/// bytes of the L4 header, whose checksum field is settled as the module documentation
/// explains.
/// Rejects the node answers per second once its burst is spent, and the burst: the kernel's
/// limits on the ICMP errors it sends itself (`net.ipv4.icmp_msgs_per_sec`,
/// `net.ipv4.icmp_msgs_burst`), so that a flood toward a service without endpoints cannot make
/// the node a reflector of as many ICMP errors as it receives packets. Beyond the rate a
/// packet is dropped (what the client sees when no reject comes: a timeout), and counted.
const REJECTS_PER_SECOND: u64 = 1000;
const REJECT_BURST: u64 = 50;
const REJECT_INTERVAL_NS: u64 = 1_000_000_000 / REJECTS_PER_SECOND;

/// The node-wide token bucket, as a generic cell rate algorithm: the time at which the bucket
/// would be full again ("theoretical arrival time"). One value for all CPUs, read and written
/// without a lock: CPUs racing may let a few rejects more through, never block one wrongly.
/// Program data (`.bss`), not pinned: a restarted agent starts with a full bucket.
#[unsafe(no_mangle)]
static mut VIPR_REJECT_TAT: u64 = 0;

/// Whether one more reject fits the rate; counts the packet when it does not.
#[inline(always)]
fn within_rate() -> bool {
    let now = unsafe { bpf_ktime_get_ns() };
    let tat = &raw mut VIPR_REJECT_TAT;
    // SAFETY: a global of this object; a torn or raced value only shifts the bucket a little.
    let next = unsafe { tat.read_volatile() }.max(now) + REJECT_INTERVAL_NS;
    if next - now > REJECT_BURST * REJECT_INTERVAL_NS {
        stat(datapath_stat::REJECT_RATE_LIMITED);
        return false;
    }
    unsafe { tat.write_volatile(next) };
    true
}

#[inline(always)]
pub fn reject_ipv4(ctx: &TcContext, l4_offset: usize) -> i32 {
    answer_ipv4(ctx, l4_offset, ICMP_HEADER)
}

/// [`reject_ipv4`] with `header` as the ICMP header (its checksum bytes are filled in).
#[inline(always)]
fn answer_ipv4(ctx: &TcContext, l4_offset: usize, header: [u8; ICMP_HLEN]) -> i32 {
    if !within_rate() {
        return TC_ACT_SHOT;
    }
    match ipv4_error(ctx, l4_offset, header) {
        Some(()) => send_back(ctx),
        None => TC_ACT_SHOT,
    }
}

/// Like [`reject_ipv4`], for IPv6 without extension headers (`l4_offset` must be 54): ICMPv6
/// type 1 code 4 from the original destination, hop limit 64, traffic class and flow label 0,
/// quoting the original IPv6 header and the same L4 bytes; the ICMPv6 checksum covers the
/// pseudo header.
#[inline(always)]
pub fn reject_ipv6(ctx: &TcContext, l4_offset: usize) -> i32 {
    answer_ipv6(ctx, l4_offset, ICMPV6_HEADER)
}

/// [`reject_ipv6`] with `header` as the ICMPv6 header (its checksum bytes are filled in).
#[inline(always)]
fn answer_ipv6(ctx: &TcContext, l4_offset: usize, header: [u8; ICMP_HLEN]) -> i32 {
    if !within_rate() {
        return TC_ACT_SHOT;
    }
    match ipv6_error(ctx, l4_offset, header) {
        Some(()) => send_back(ctx),
        None => TC_ACT_SHOT,
    }
}

#[inline(always)]
fn ipv4_error(ctx: &TcContext, l4_offset: usize, header: [u8; ICMP_HLEN]) -> Option<()> {
    // Everything the answer needs from the packet's headers, read before they move.
    let eth = unsafe { *bytes_at::<{ ETH_HLEN }>(ctx, 0)? };
    let ip = unsafe { *bytes_at::<IPV4_MIN_HLEN>(ctx, ETH_HLEN)? };
    // Bounded for the verifier: 0..=60 in steps of 4.
    let ihl = usize::from(ip[0] & 0x0f) * 4;
    if eth[12..14] != ETH_P_IP || ip[0] >> 4 != 4 || ihl < IPV4_MIN_HLEN || ETH_HLEN + ihl != l4_offset {
        return None;
    }
    let protocol = ip[9];
    let l4_quote = quoted_l4(protocol)?;
    let (src, dst) = ([ip[12], ip[13], ip[14], ip[15]], [ip[16], ip[17], ip[18], ip[19]]);
    let tos = IPTOS_PREC_INTERNETCONTROL | (ip[1] & IPTOS_TOS_MASK);

    let quote_len = ihl + l4_quote;
    let icmp_len = ICMP_HLEN + quote_len;
    resize(ctx, ETH_HLEN + quote_len, IPV4_MIN_HLEN + ICMP_HLEN)?;

    // | Ethernet | new IPv4 | ICMP | original IPv4 header | L4 quote |
    let headers = bytes_at::<{ V4_QUOTE_OFF }>(ctx, 0)?;
    let total_len = (IPV4_MIN_HLEN + icmp_len) as u16;
    let mut new_ip = [0u8; IPV4_MIN_HLEN];
    new_ip[0] = 0x45;
    new_ip[1] = tos;
    new_ip[2..4].copy_from_slice(&total_len.to_be_bytes());
    // ID 0 and no DF: 70..=108 bytes never need fragmenting.
    new_ip[8] = TTL;
    new_ip[9] = IPPROTO_ICMP;
    new_ip[12..16].copy_from_slice(&dst);
    new_ip[16..20].copy_from_slice(&src);
    let ip_csum = !fold(sum_words(&new_ip));
    new_ip[10..12].copy_from_slice(&ip_csum.to_be_bytes());
    unsafe {
        let frame = &mut *headers;
        swap_ethernet_addresses(frame, &eth);
        frame[ETH_HLEN..V4_ICMP_OFF].copy_from_slice(&new_ip);
        frame[V4_ICMP_OFF..V4_QUOTE_OFF].copy_from_slice(&header);
    }
    settle_quoted_l4_checksum(ctx, V4_QUOTE_OFF + ihl, protocol)?;
    let icmp_csum = icmp_checksum::<{ V4_MAX_ICMP / 4 }>(ctx, V4_ICMP_OFF, icmp_len, 0)?;
    store_checksum(ctx, V4_ICMP_OFF + 2, icmp_csum)
}

#[inline(always)]
fn ipv6_error(ctx: &TcContext, l4_offset: usize, header: [u8; ICMP_HLEN]) -> Option<()> {
    if l4_offset != ETH_HLEN + IPV6_HLEN {
        return None;
    }
    let eth = unsafe { *bytes_at::<{ ETH_HLEN }>(ctx, 0)? };
    let ip = unsafe { *bytes_at::<IPV6_HLEN>(ctx, ETH_HLEN)? };
    if eth[12..14] != ETH_P_IPV6 || ip[0] >> 4 != 6 {
        return None;
    }
    let protocol = ip[6];
    let l4_quote = quoted_l4(protocol)?;
    let mut src = [0u8; 16];
    let mut dst = [0u8; 16];
    src.copy_from_slice(&ip[8..24]);
    dst.copy_from_slice(&ip[24..40]);

    let quote_len = IPV6_HLEN + l4_quote;
    let icmp_len = ICMP_HLEN + quote_len;
    resize(ctx, ETH_HLEN + quote_len, IPV6_HLEN + ICMP_HLEN)?;

    // | Ethernet | new IPv6 | ICMPv6 | original IPv6 header | L4 quote |
    let headers = bytes_at::<{ V6_QUOTE_OFF }>(ctx, 0)?;
    unsafe {
        let frame = &mut *headers;
        swap_ethernet_addresses(frame, &eth);
        let new_ip = &mut frame[ETH_HLEN..V6_ICMP_OFF];
        new_ip[..4].copy_from_slice(&[0x60, 0, 0, 0]);
        new_ip[4..6].copy_from_slice(&(icmp_len as u16).to_be_bytes());
        new_ip[6] = IPPROTO_ICMPV6;
        new_ip[7] = TTL;
        new_ip[8..24].copy_from_slice(&dst);
        new_ip[24..40].copy_from_slice(&src);
        frame[V6_ICMP_OFF..V6_QUOTE_OFF].copy_from_slice(&header);
    }
    settle_quoted_l4_checksum(ctx, V6_QUOTE_OFF + IPV6_HLEN, protocol)?;
    // The addresses lie right before the ICMPv6 message: one sum covers both. The rest of the
    // pseudo header is the upper-layer length and the next header.
    let pseudo_rest = icmp_len as u32 + u32::from(IPPROTO_ICMPV6);
    let icmp_csum =
        icmp_checksum::<{ (32 + V6_MAX_ICMP) / 4 }>(ctx, V6_ADDRS_OFF, 32 + icmp_len, pseudo_rest)?;
    store_checksum(ctx, V6_ICMP_OFF + 2, icmp_csum)
}

/// How many L4 bytes the quote carries, for the protocols this code can answer.
#[inline(always)]
fn quoted_l4(protocol: u8) -> Option<usize> {
    match protocol {
        proto::TCP => Some(TCP_QUOTE),
        proto::UDP => Some(UDP_QUOTE),
        proto::SCTP => Some(SCTP_QUOTE),
        _ => None,
    }
}

/// Cuts the packet after the quote (or grows it to the quote with zeros), then opens `room`
/// bytes for the new IP and ICMP headers between the Ethernet header and the original IP
/// header. Every packet pointer is stale afterwards.
#[inline(always)]
fn resize(ctx: &TcContext, quote_end: usize, room: usize) -> Option<()> {
    let skb = ctx.skb.skb;
    if unsafe { bpf_skb_change_tail(skb, quote_end as u32, 0) } != 0 {
        return None;
    }
    if unsafe { bpf_skb_adjust_room(skb, room as i32, BPF_ADJ_ROOM_MAC, 0) } != 0 {
        return None;
    }
    // The frame must now be exactly the answer: the L4 checksum settling and the ICMP
    // checksum both end at the end of the frame.
    if ctx.len() as usize != quote_end + room {
        return None;
    }
    Some(())
}

#[inline(always)]
fn swap_ethernet_addresses(frame: &mut [u8], original: &[u8; ETH_HLEN]) {
    frame[..ETH_ALEN].copy_from_slice(&original[ETH_ALEN..2 * ETH_ALEN]);
    frame[ETH_ALEN..2 * ETH_ALEN].copy_from_slice(&original[..ETH_ALEN]);
}

/// Sets the checksum field of the quoted L4 header at `l4` to the fixed point of the checksum
/// a CHECKSUM_PARTIAL offload would compute over the quoted L4 bytes, so that such an offload
/// changes nothing (see the module documentation).
#[inline(always)]
fn settle_quoted_l4_checksum(ctx: &TcContext, l4: usize, protocol: u8) -> Option<()> {
    // One fixed-size branch per protocol, each writing through the pointer its own bounds
    // check covers: a separate check for the write could be merged into this one by the
    // compiler and leave the verifier a pointer without a known range.
    // SCTP's checksum is no ones' complement sum; there is no fixed point to settle on.
    if protocol == proto::TCP {
        settle::<TCP_QUOTE, TCP_CSUM_AT>(bytes_at::<TCP_QUOTE>(ctx, l4)?);
    } else if protocol == proto::UDP {
        settle::<UDP_QUOTE, UDP_CSUM_AT>(bytes_at::<UDP_QUOTE>(ctx, l4)?);
    }
    Some(())
}

#[inline(always)]
fn settle<const N: usize, const CSUM_AT: usize>(quote: *mut [u8; N]) {
    let quote = unsafe { &mut *quote };
    quote[CSUM_AT] = 0;
    quote[CSUM_AT + 1] = 0;
    let settled = offload_fixed_point(sum_words(quote));
    quote[CSUM_AT..CSUM_AT + 2].copy_from_slice(&settled.to_be_bytes());
}

/// The 16-bit `f` with `f == !fold(others + f)`, the value `skb_checksum_help` stores (0 is
/// stored as 0xffff) when the field already holds `f`. Doubling is a 1-bit left rotation in
/// ones' complement arithmetic, so `2f == !others` gives `f = rotr1(!others)`.
#[inline(always)]
fn offload_fixed_point(others: u32) -> u16 {
    match (!fold(others)).rotate_right(1) {
        0 => 0xffff,
        f => f,
    }
}

/// The checksum of the `len` bytes at `offset` (at most `4 * WORDS`) plus `seed`, through a
/// zeroed stack buffer: `bpf_csum_diff` needs a size the verifier can bound, and the zero
/// padding adds nothing to the sum.
#[inline(always)]
fn icmp_checksum<const WORDS: usize>(ctx: &TcContext, offset: usize, len: usize, seed: u32) -> Option<u16> {
    let mut buf = [0u32; WORDS];
    if len == 0 || len > WORDS * 4 {
        return None;
    }
    let loaded = unsafe {
        bpf_skb_load_bytes(ctx.skb.skb as *const _, offset as u32, buf.as_mut_ptr().cast(), len as u32)
    };
    if loaded != 0 {
        return None;
    }
    let sum = unsafe { bpf_csum_diff(core::ptr::null_mut(), 0, buf.as_mut_ptr(), (WORDS * 4) as u32, 0) };
    if sum < 0 {
        return None;
    }
    // The helper's 32-bit sum, in the host order of the loaded words.
    let folded = u16::from_be(fold(sum as u32));
    Some(!fold(u32::from(folded) + seed))
}

/// Writes a checksum field (big-endian) at `offset`.
#[inline(always)]
fn store_checksum(ctx: &TcContext, offset: usize, value: u16) -> Option<()> {
    let field = bytes_at::<2>(ctx, offset)?;
    unsafe { *field = value.to_be_bytes() };
    Some(())
}

/// Egress of the device the packet arrived on.
#[inline(always)]
fn send_back(ctx: &TcContext) -> i32 {
    let skb: *mut __sk_buff = ctx.skb.skb;
    let ifindex = unsafe { (*skb).ifindex };
    unsafe { bpf_redirect(ifindex, 0) as i32 }
}

#[inline(always)]
fn bytes_at<const N: usize>(ctx: &TcContext, offset: usize) -> Option<*mut [u8; N]> {
    let start = ctx.data();
    if start + offset + N > ctx.data_end() {
        return None;
    }
    Some((start + offset) as *mut [u8; N])
}

/// Ones' complement sum of big-endian 16-bit words (N even), unfolded.
#[inline(always)]
fn sum_words<const N: usize>(bytes: &[u8; N]) -> u32 {
    let mut sum = 0u32;
    let mut i = 0;
    while i + 1 < N {
        sum += u32::from(u16::from_be_bytes([bytes[i], bytes[i + 1]]));
        i += 2;
    }
    sum
}

#[inline(always)]
fn fold(mut sum: u32) -> u16 {
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    sum as u16
}
