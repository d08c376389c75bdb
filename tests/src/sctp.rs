//! SCTP on the wire without the kernel's SCTP stack: a client that sends an INIT and waits for
//! the INIT-ACK, and a server that answers INITs, both over raw IP sockets (protocol 132).
//!
//! A kernel without CONFIG_IP_SCTP (this machine's) cannot open SCTP sockets, but its
//! conntrack, NAT and IPVS handle SCTP, and so must a kube-proxy replacement. The first
//! packet of an association and its answer are all a load balancer decides on: where the
//! INIT is sent shows the choice of backend, the INIT-ACK shows that the reply comes back
//! through the reverse NAT, and its State Cookie carries the server's [`Answer`] (who
//! answered, whom it saw), as the TCP and UDP echo servers send theirs. Both packets are
//! well formed as far as middleboxes look (RFC 9260 §3, §8.5.1): the INIT has verification
//! tag 0 and is alone in its packet, the INIT-ACK carries the INIT's initiate tag, and both
//! have a valid CRC32c, which a NAT that changes the ports must fix.
//!
//! A raw socket gets a copy of every SCTP packet to its bound address, so both sides pick
//! theirs by port and tag and ignore the rest: concurrent attempts from one address do not
//! see each other's answers. While a raw SCTP socket is open in a namespace, the kernel sends
//! no ICMP "protocol unreachable" for the SCTP packets it delivers there; without one it
//! does. A kernel with an SCTP stack would answer these INITs and INIT-ACKs itself with
//! ABORTs, so neither side works there ([`unavailable`] says so).
//!
//! Like the other clients and servers of the testbed, both must be started inside the
//! namespace they work in ([`crate::Netns::run`]).

use std::{
    fmt,
    io::{self, ErrorKind},
    mem::MaybeUninit,
    net::{IpAddr, Ipv4Addr, SocketAddr},
    os::fd::{AsRawFd, RawFd},
    path::Path,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    thread::{self, JoinHandle},
    time::{Duration, Instant},
};

use anyhow::{Context, Result};
use proxy_common::sctp::{checksum, CHECKSUM_OFFSET, HEADER_LEN};
use socket2::{Domain, SockAddr, Socket, Type};

use crate::{client::set_int_option, Answer, Netns};

/// SCTP's IP protocol number.
pub const PROTOCOL: i32 = libc::IPPROTO_SCTP;

const CHUNK_INIT: u8 = 1;
const CHUNK_INIT_ACK: u8 = 2;
const PARAMETER_STATE_COOKIE: u16 = 7;
const CHUNK_HEADER_LEN: usize = 4;
/// Initiate tag, a_rwnd, outbound and inbound streams, initial TSN.
const INIT_FIXED_LEN: usize = 16;
const PARAMETER_HEADER_LEN: usize = 4;
/// Where clients take their source ports from: Linux's default ephemeral range, so that an
/// attempt looks like a new connection from an ordinary client.
const CLIENT_PORTS: std::ops::RangeInclusive<u16> = 32768..=60999;
/// How long a server thread blocks before it looks at its stop flag again.
const STOP_POLL: Duration = Duration::from_millis(50);
/// Larger than any packet of ours and any ICMP quote of one.
const RECEIVE_BUFFER: usize = 2048;

/// Source and destination port of an SCTP packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ports {
    pub source: u16,
    pub dest: u16,
}

/// The fixed part of INIT and INIT-ACK chunks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InitFields {
    /// The verification tag the sender expects on every packet sent back to it; never 0.
    pub initiate_tag: u32,
    pub a_rwnd: u32,
    pub outbound_streams: u16,
    pub inbound_streams: u16,
    pub initial_tsn: u32,
}

impl InitFields {
    /// What Linux's SCTP stack announces by default, with the given tag and TSN.
    pub fn new(initiate_tag: u32, initial_tsn: u32) -> Self {
        Self { initiate_tag, a_rwnd: 106_496, outbound_streams: 10, inbound_streams: 65_535, initial_tsn }
    }

    /// Fresh random tag and TSN, as a new association would have.
    pub fn random() -> Self {
        Self::new(random_nonzero(), random_u32())
    }

    fn write(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.initiate_tag.to_be_bytes());
        out.extend_from_slice(&self.a_rwnd.to_be_bytes());
        out.extend_from_slice(&self.outbound_streams.to_be_bytes());
        out.extend_from_slice(&self.inbound_streams.to_be_bytes());
        out.extend_from_slice(&self.initial_tsn.to_be_bytes());
    }

    fn read(bytes: &[u8]) -> Self {
        Self {
            initiate_tag: be32(&bytes[0..4]),
            a_rwnd: be32(&bytes[4..8]),
            outbound_streams: be16(&bytes[8..10]),
            inbound_streams: be16(&bytes[10..12]),
            initial_tsn: be32(&bytes[12..16]),
        }
    }
}

/// The chunks this module knows; every other type is only named.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Chunk {
    Init(InitFields),
    InitAck { fields: InitFields, cookie: Option<Vec<u8>> },
    Other { kind: u8 },
}

/// A parsed SCTP packet (the part after the IP header).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Packet {
    pub ports: Ports,
    pub verification_tag: u32,
    /// Whether the CRC32c in the header matches the packet.
    pub checksum_valid: bool,
    pub chunks: Vec<Chunk>,
}

/// An INIT alone in its packet, as an association's first packet is: verification tag 0.
pub fn init_packet(ports: Ports, fields: &InitFields) -> Vec<u8> {
    let mut body = Vec::with_capacity(INIT_FIXED_LEN);
    fields.write(&mut body);
    packet(ports, 0, CHUNK_INIT, &body)
}

/// An INIT-ACK alone in its packet, carrying `cookie` as its State Cookie;
/// `verification_tag` is the initiate tag of the INIT it answers.
pub fn init_ack_packet(ports: Ports, verification_tag: u32, fields: &InitFields, cookie: &[u8]) -> Vec<u8> {
    let mut body = Vec::with_capacity(INIT_FIXED_LEN + PARAMETER_HEADER_LEN + cookie.len() + 3);
    fields.write(&mut body);
    let parameter_len = u16::try_from(PARAMETER_HEADER_LEN + cookie.len()).expect("a cookie fits a packet");
    body.extend_from_slice(&PARAMETER_STATE_COOKIE.to_be_bytes());
    body.extend_from_slice(&parameter_len.to_be_bytes());
    body.extend_from_slice(cookie);
    packet(ports, verification_tag, CHUNK_INIT_ACK, &body)
}

/// Common header, one chunk of `kind` with `body` (its length field counts no padding, the
/// packet is padded to 4 bytes), and the checksum.
fn packet(ports: Ports, verification_tag: u32, kind: u8, body: &[u8]) -> Vec<u8> {
    let chunk_len = u16::try_from(CHUNK_HEADER_LEN + body.len()).expect("a chunk fits a packet");
    let mut bytes = Vec::with_capacity(HEADER_LEN + padded(usize::from(chunk_len)));
    bytes.extend_from_slice(&ports.source.to_be_bytes());
    bytes.extend_from_slice(&ports.dest.to_be_bytes());
    bytes.extend_from_slice(&verification_tag.to_be_bytes());
    bytes.extend_from_slice(&[0; 4]);
    bytes.extend_from_slice(&[kind, 0]);
    bytes.extend_from_slice(&chunk_len.to_be_bytes());
    bytes.extend_from_slice(body);
    bytes.resize(HEADER_LEN + padded(usize::from(chunk_len)), 0);
    let sum = checksum(&bytes);
    bytes[CHECKSUM_OFFSET..CHECKSUM_OFFSET + 4].copy_from_slice(&sum.to_le_bytes());
    bytes
}

fn padded(len: usize) -> usize {
    len.next_multiple_of(4)
}

fn be16(bytes: &[u8]) -> u16 {
    u16::from_be_bytes([bytes[0], bytes[1]])
}

fn be32(bytes: &[u8]) -> u32 {
    u32::from_be_bytes([bytes[0], bytes[1], bytes[2], bytes[3]])
}

/// Whether the CRC32c stored in `bytes` (an SCTP packet) is right.
pub fn checksum_valid(bytes: &[u8]) -> bool {
    if bytes.len() < HEADER_LEN {
        return false;
    }
    let stored = u32::from_le_bytes(bytes[CHECKSUM_OFFSET..CHECKSUM_OFFSET + 4].try_into().expect("4 bytes"));
    let mut zeroed = bytes.to_vec();
    zeroed[CHECKSUM_OFFSET..CHECKSUM_OFFSET + 4].fill(0);
    checksum(&zeroed) == stored
}

/// Reads an SCTP packet; `Err` says how it is malformed. A wrong checksum is no error here
/// ([`Packet::checksum_valid`]): the caller decides what a corrupted packet means.
pub fn parse(bytes: &[u8]) -> Result<Packet, String> {
    if bytes.len() < HEADER_LEN {
        return Err(format!("{} bytes, shorter than the common header", bytes.len()));
    }
    let ports = Ports { source: be16(&bytes[0..2]), dest: be16(&bytes[2..4]) };
    let verification_tag = be32(&bytes[4..8]);
    let mut chunks = Vec::new();
    let mut offset = HEADER_LEN;
    while offset < bytes.len() {
        let rest = &bytes[offset..];
        if rest.len() < CHUNK_HEADER_LEN {
            return Err(format!("a chunk header cut short at byte {offset}"));
        }
        let (kind, len) = (rest[0], usize::from(be16(&rest[2..4])));
        if len < CHUNK_HEADER_LEN || len > rest.len() {
            return Err(format!("chunk type {kind} at byte {offset} claims {len} bytes of {}", rest.len()));
        }
        chunks.push(
            parse_chunk(kind, &rest[CHUNK_HEADER_LEN..len])
                .map_err(|error| format!("chunk type {kind} at byte {offset}: {error}"))?,
        );
        offset += padded(len);
    }
    if chunks.is_empty() {
        return Err("no chunk".to_owned());
    }
    Ok(Packet { ports, verification_tag, checksum_valid: checksum_valid(bytes), chunks })
}

fn parse_chunk(kind: u8, body: &[u8]) -> Result<Chunk, String> {
    if kind != CHUNK_INIT && kind != CHUNK_INIT_ACK {
        return Ok(Chunk::Other { kind });
    }
    if body.len() < INIT_FIXED_LEN {
        return Err(format!("{} bytes, shorter than the fixed part", body.len()));
    }
    let fields = InitFields::read(&body[..INIT_FIXED_LEN]);
    if kind == CHUNK_INIT {
        return Ok(Chunk::Init(fields));
    }
    let mut cookie = None;
    let mut parameters = &body[INIT_FIXED_LEN..];
    while !parameters.is_empty() {
        if parameters.len() < PARAMETER_HEADER_LEN {
            return Err("a parameter header cut short".to_owned());
        }
        let (parameter, len) = (be16(&parameters[0..2]), usize::from(be16(&parameters[2..4])));
        if len < PARAMETER_HEADER_LEN || len > parameters.len() {
            return Err(format!("parameter type {parameter} claims {len} bytes of {}", parameters.len()));
        }
        if parameter == PARAMETER_STATE_COOKIE {
            cookie = Some(parameters[PARAMETER_HEADER_LEN..len].to_vec());
        }
        parameters = &parameters[padded(len).min(parameters.len())..];
    }
    Ok(Chunk::InitAck { fields, cookie })
}

/// The SCTP part of a packet from an IPv4 raw socket, which receives the IP header too, and
/// the addresses in that header.
fn strip_ipv4_header(bytes: &[u8]) -> Option<(Ipv4Addr, Ipv4Addr, &[u8])> {
    let header_len = usize::from(bytes.first()? & 0x0f) * 4;
    if bytes[0] >> 4 != 4 || header_len < 20 || bytes.len() < header_len || i32::from(bytes[9]) != PROTOCOL {
        return None;
    }
    let total_len = usize::from(be16(&bytes[2..4])).min(bytes.len());
    let source = Ipv4Addr::new(bytes[12], bytes[13], bytes[14], bytes[15]);
    let dest = Ipv4Addr::new(bytes[16], bytes[17], bytes[18], bytes[19]);
    Some((source, dest, bytes.get(header_len..total_len)?))
}

/// What an INIT that a server should answer asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AcceptedInit {
    /// The client's port (the INIT's source port).
    pub peer_port: u16,
    /// The client's initiate tag: the verification tag of the answer.
    pub peer_tag: u32,
}

/// Whether `bytes` (an SCTP packet) is an INIT to `port` that a server answers: well formed,
/// a valid checksum, verification tag 0, the INIT alone, a nonzero initiate tag (RFC 9260
/// §3.3.2, §8.5.1; what a middlebox with SCTP conntrack also insists on).
pub fn accepted_init(bytes: &[u8], port: u16) -> Option<AcceptedInit> {
    let packet = parse(bytes).ok()?;
    match packet.chunks.as_slice() {
        [Chunk::Init(fields)]
            if packet.ports.dest == port
                && packet.checksum_valid
                && packet.verification_tag == 0
                && fields.initiate_tag != 0 =>
        {
            Some(AcceptedInit { peer_port: packet.ports.source, peer_tag: fields.initiate_tag })
        }
        _ => None,
    }
}

/// Why the raw SCTP client and server cannot work on this kernel, if they cannot.
pub fn unavailable() -> Option<String> {
    if Path::new("/proc/net/sctp").exists() {
        return Some(
            "this kernel runs an SCTP stack (/proc/net/sctp exists): it would abort the associations \
             that the raw-socket SCTP client and server fake"
                .to_owned(),
        );
    }
    for domain in [Domain::IPV4, Domain::IPV6] {
        if let Err(error) = raw_socket(domain) {
            return Some(format!("cannot open a raw SCTP socket (protocol {PROTOCOL}): {error}"));
        }
    }
    None
}

fn raw_socket(domain: Domain) -> io::Result<Socket> {
    Socket::new(domain, Type::RAW, Some(socket2::Protocol::from(PROTOCOL)))
}

fn domain_of(ip: IpAddr) -> Domain {
    if ip.is_ipv4() {
        Domain::IPV4
    } else {
        Domain::IPV6
    }
}

/// The same error with `what` in front, keeping its kind for callers that classify it.
fn context(error: io::Error, what: impl fmt::Display) -> io::Error {
    io::Error::new(error.kind(), format!("{what}: {error}"))
}

/// A raw SCTP socket bound to `ip`: it gets every SCTP packet to that address.
fn bound_socket(ip: IpAddr) -> io::Result<Socket> {
    let socket =
        raw_socket(domain_of(ip)).map_err(|error| context(error, "cannot open a raw SCTP socket"))?;
    // The port of a raw socket's address is unused.
    socket
        .bind(&SocketAddr::new(ip, 0).into())
        .map_err(|error| context(error, format!("cannot bind {ip}")))?;
    socket.set_nonblocking(true)?;
    Ok(socket)
}

/// One packet from a bound raw socket: its SCTP part and the address it came from. `None`
/// for a packet that is not SCTP to `local`.
fn receive<'a>(
    socket: &Socket,
    local: IpAddr,
    buffer: &'a mut [u8],
) -> io::Result<Option<(IpAddr, &'a [u8])>> {
    // SAFETY: initialized bytes are valid `MaybeUninit<u8>`s, and recv_from writes only
    // initialized bytes into the buffer.
    let uninit = unsafe { &mut *(std::ptr::from_mut::<[u8]>(buffer) as *mut [MaybeUninit<u8>]) };
    let (len, from) = socket.recv_from(uninit)?;
    let bytes = &buffer[..len];
    if local.is_ipv4() {
        Ok(strip_ipv4_header(bytes)
            .filter(|(_, dest, _)| IpAddr::V4(*dest) == local)
            .map(|(source, _, sctp)| (IpAddr::V4(source), sctp)))
    } else {
        // IPv6 raw sockets get the payload only; the bound address is the destination.
        Ok(from.as_socket().map(|from| (from.ip(), bytes)))
    }
}

fn random_u32() -> u32 {
    let mut bytes = [0u8; 4];
    // SAFETY: the buffer is valid for writes of its length.
    let got = unsafe { libc::getrandom(bytes.as_mut_ptr().cast(), bytes.len(), 0) };
    if got == 4 {
        return u32::from_ne_bytes(bytes);
    }
    // getrandom(2) does not fail for 4 bytes once the pool is initialized; this only keeps
    // the tags varying if it ever did.
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    now.subsec_nanos() ^ (std::process::id() << 16) ^ now.as_secs() as u32
}

fn random_nonzero() -> u32 {
    loop {
        let value = random_u32();
        if value != 0 {
            return value;
        }
    }
}

fn random_client_port() -> u16 {
    let span = u32::from(CLIENT_PORTS.end() - CLIENT_PORTS.start()) + 1;
    CLIENT_PORTS.start() + u16::try_from(random_u32() % span).expect("within the range")
}

/// An ICMP error about a packet we sent, as the kernel queued it on the socket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IcmpError {
    pub ipv6: bool,
    pub icmp_type: u8,
    pub code: u8,
    /// Who sent the error.
    pub from: Option<IpAddr>,
}

impl IcmpError {
    /// Port unreachable (ICMP 3/3, ICMPv6 1/4): what a REJECT sends.
    pub fn port_unreachable(&self) -> bool {
        if self.ipv6 {
            (self.icmp_type, self.code) == (1, 4)
        } else {
            (self.icmp_type, self.code) == (3, 3)
        }
    }
}

impl fmt::Display for IcmpError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let known = match (self.ipv6, self.icmp_type, self.code) {
            (false, 3, 0) | (true, 1, 0) => " (no route)",
            (false, 3, 1) | (true, 1, 3) => " (host unreachable)",
            (false, 3, 2) => " (protocol unreachable: nobody takes SCTP there)",
            (true, 4, 1) => " (unrecognized next header: nobody takes SCTP there)",
            (false, 3, 3) | (true, 1, 4) => " (port unreachable)",
            (false, 3, 13) | (true, 1, 1) => " (administratively prohibited)",
            _ => "",
        };
        let version = if self.ipv6 { "ICMPv6" } else { "ICMP" };
        write!(f, "{version} type {} code {}{known}", self.icmp_type, self.code)?;
        if let Some(from) = self.from {
            write!(f, " from {from}")?;
        }
        Ok(())
    }
}

/// What came back for an INIT.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reply {
    /// The INIT-ACK of our association: to our port, with our initiate tag as verification
    /// tag and a valid checksum; its State Cookie, if any.
    InitAck { from: SocketAddr, cookie: Option<Vec<u8>> },
    /// An ICMP error quoting our INIT.
    Icmp(IcmpError),
    /// A packet to our port with our tag (so it looks like ours) whose checksum is wrong: a
    /// NAT that rewrote ports and did not fix it, or a corruption. `kind` is its first
    /// chunk's type.
    BadChecksum { from: SocketAddr, kind: Option<u8> },
    /// Something else for our association (an ABORT, several chunks, a malformed packet).
    Unexpected { from: SocketAddr, what: String },
    /// Nothing within the time given.
    Silence,
}

/// One INIT and what came of it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InitExchange {
    /// The client's address and the source port of its INIT.
    pub client: SocketAddr,
    pub reply: Reply,
}

/// Sends an INIT from `source` (a fresh random port and initiate tag) to `dest` and waits up
/// to `timeout` for its INIT-ACK or an ICMP error about it. `Err` only when the INIT could
/// not be sent (the error keeps its kind: a routing failure reads as unreachable).
pub fn send_init(source: IpAddr, dest: SocketAddr, timeout: Duration) -> io::Result<InitExchange> {
    let socket = bound_socket(source)?;
    let (level, option) = if source.is_ipv4() {
        (libc::IPPROTO_IP, libc::IP_RECVERR)
    } else {
        (libc::IPPROTO_IPV6, libc::IPV6_RECVERR)
    };
    set_int_option(socket.as_raw_fd(), level, option, 1)
        .map_err(|error| context(error, "cannot set RECVERR"))?;
    let ports = Ports { source: random_client_port(), dest: dest.port() };
    let fields = InitFields::random();
    let client = SocketAddr::new(source, ports.source);
    // The port of a raw socket's destination must be 0: IPv6 raw sockets refuse any other.
    socket.send_to(&init_packet(ports, &fields), &SockAddr::from(SocketAddr::new(dest.ip(), 0)))?;
    let reply = await_reply(&socket, source, ports, fields.initiate_tag, timeout)?;
    Ok(InitExchange { client, reply })
}

fn await_reply(
    socket: &Socket,
    source: IpAddr,
    ports: Ports,
    tag: u32,
    timeout: Duration,
) -> io::Result<Reply> {
    let deadline = Instant::now() + timeout;
    let mut buffer = [0u8; RECEIVE_BUFFER];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() || !crate::echo::wait_readable(socket, left)? {
            if Instant::now() >= deadline {
                return Ok(Reply::Silence);
            }
            continue;
        }
        if let Some(error) = queued_icmp_error(socket.as_raw_fd(), ports)? {
            return Ok(Reply::Icmp(error));
        }
        loop {
            let (from, bytes) = match receive(socket, source, &mut buffer) {
                Ok(Some(packet)) => packet,
                Ok(None) => continue,
                Err(error) if error.kind() == ErrorKind::WouldBlock => break,
                // An ICMP error also sets the socket's pending error, which the next receive
                // returns once; the error queue above says what it was about.
                Err(error) if error.raw_os_error().is_some_and(is_icmp_errno) => break,
                Err(error) => return Err(error),
            };
            if let Some(reply) = reply_for(bytes, from, ports, tag) {
                return Ok(reply);
            }
        }
    }
}

/// The errors an ICMP error leaves pending on a socket (icmp_err_convert, icmpv6_err_convert).
fn is_icmp_errno(errno: i32) -> bool {
    [
        libc::ECONNREFUSED,
        libc::EHOSTUNREACH,
        libc::ENETUNREACH,
        libc::EHOSTDOWN,
        libc::ENONET,
        libc::ENOPROTOOPT,
        libc::EPROTO,
        libc::EACCES,
        libc::EMSGSIZE,
        libc::EOPNOTSUPP,
    ]
    .contains(&errno)
}

/// Whether `bytes`, an SCTP packet from `from_ip`, answers our INIT (sent with `ports` and
/// initiate tag `tag`), and how; `None` for packets of other associations.
fn reply_for(bytes: &[u8], from_ip: IpAddr, ports: Ports, tag: u32) -> Option<Reply> {
    if bytes.len() < HEADER_LEN {
        return None;
    }
    let (source_port, dest_port, verification_tag) =
        (be16(&bytes[0..2]), be16(&bytes[2..4]), be32(&bytes[4..8]));
    if dest_port != ports.source || verification_tag != tag {
        return None;
    }
    let from = SocketAddr::new(from_ip, source_port);
    let packet = match parse(bytes) {
        Ok(packet) => packet,
        Err(_) if !checksum_valid(bytes) => {
            return Some(Reply::BadChecksum { from, kind: bytes.get(HEADER_LEN).copied() })
        }
        Err(error) => return Some(Reply::Unexpected { from, what: format!("a malformed packet: {error}") }),
    };
    let first_kind = match packet.chunks.first() {
        Some(Chunk::Init(_)) => CHUNK_INIT,
        Some(Chunk::InitAck { .. }) => CHUNK_INIT_ACK,
        Some(Chunk::Other { kind }) => *kind,
        None => return None,
    };
    if !packet.checksum_valid {
        return Some(Reply::BadChecksum { from, kind: Some(first_kind) });
    }
    match packet.chunks.as_slice() {
        [Chunk::InitAck { cookie, .. }] => Some(Reply::InitAck { from, cookie: cookie.clone() }),
        [Chunk::Other { kind: 6 }] => Some(Reply::Unexpected { from, what: "an ABORT".to_owned() }),
        chunks => Some(Reply::Unexpected {
            from,
            what: format!(
                "{} chunk(s), the first of type {first_kind}, instead of an INIT-ACK alone",
                chunks.len()
            ),
        }),
    }
}

/// The next ICMP error on the socket's error queue that quotes our INIT (its source and
/// destination port, verification tag 0); errors about other attempts' packets are dropped.
fn queued_icmp_error(socket: RawFd, ports: Ports) -> io::Result<Option<IcmpError>> {
    loop {
        let mut quote = [0u8; RECEIVE_BUFFER];
        // u64s: a control buffer must be aligned for cmsghdr.
        let mut control = [0u64; 64];
        let mut iov = libc::iovec { iov_base: quote.as_mut_ptr().cast(), iov_len: quote.len() };
        // SAFETY: an all-zero msghdr is a valid empty one.
        let mut message: libc::msghdr = unsafe { std::mem::zeroed() };
        message.msg_iov = &raw mut iov;
        message.msg_iovlen = 1;
        message.msg_control = control.as_mut_ptr().cast();
        message.msg_controllen = std::mem::size_of_val(&control);
        // SAFETY: every pointer in `message` refers to a live buffer of the length given.
        let len = unsafe { libc::recvmsg(socket, &mut message, libc::MSG_ERRQUEUE | libc::MSG_DONTWAIT) };
        if len < 0 {
            let error = io::Error::last_os_error();
            return if error.kind() == ErrorKind::WouldBlock { Ok(None) } else { Err(error) };
        }
        // The queued data is the quoted packet from its SCTP header on.
        let quoted = &quote[..usize::try_from(len).unwrap_or(0)];
        let ours = quoted.len() >= 8
            && be16(&quoted[0..2]) == ports.source
            && be16(&quoted[2..4]) == ports.dest
            && be32(&quoted[4..8]) == 0;
        if let Some(error) = icmp_error_of(&message).filter(|_| ours) {
            return Ok(Some(error));
        }
    }
}

fn icmp_error_of(message: &libc::msghdr) -> Option<IcmpError> {
    // SAFETY: `message` was filled by recvmsg; the CMSG macros stay within its control buffer.
    let mut header = unsafe { libc::CMSG_FIRSTHDR(message) };
    while !header.is_null() {
        // SAFETY: CMSG_FIRSTHDR/CMSG_NXTHDR return null or a header inside the buffer.
        let (level, kind) = unsafe { ((*header).cmsg_level, (*header).cmsg_type) };
        let ipv6 = match (level, kind) {
            (libc::IPPROTO_IP, libc::IP_RECVERR) => false,
            (libc::IPPROTO_IPV6, libc::IPV6_RECVERR) => true,
            _ => {
                // SAFETY: as above.
                header = unsafe { libc::CMSG_NXTHDR(message, header) };
                continue;
            }
        };
        // SAFETY: the kernel puts a sock_extended_err and then the offender's address in a
        // RECVERR message; read_unaligned makes no assumption on alignment.
        let (extended, offender) = unsafe {
            let data = libc::CMSG_DATA(header);
            let extended: libc::sock_extended_err = std::ptr::read_unaligned(data.cast());
            let offender = data.add(std::mem::size_of::<libc::sock_extended_err>());
            (extended, offender)
        };
        let expected_origin = if ipv6 { libc::SO_EE_ORIGIN_ICMP6 } else { libc::SO_EE_ORIGIN_ICMP };
        if extended.ee_origin != expected_origin {
            return None;
        }
        // SAFETY: the offender address follows the extended error in the same message; its
        // family says how much of it to read.
        let from = unsafe { offender_address(offender) };
        return Some(IcmpError { ipv6, icmp_type: extended.ee_type, code: extended.ee_code, from });
    }
    None
}

/// # Safety
/// `address` must point to a sockaddr_in or sockaddr_in6 (as the family field says).
unsafe fn offender_address(address: *const u8) -> Option<IpAddr> {
    let family: libc::sa_family_t = std::ptr::read_unaligned(address.cast());
    match i32::from(family) {
        libc::AF_INET => {
            let v4: libc::sockaddr_in = std::ptr::read_unaligned(address.cast());
            Some(IpAddr::V4(Ipv4Addr::from(u32::from_be(v4.sin_addr.s_addr))))
        }
        libc::AF_INET6 => {
            let v6: libc::sockaddr_in6 = std::ptr::read_unaligned(address.cast());
            Some(IpAddr::V6(v6.sin6_addr.s6_addr.into()))
        }
        _ => None,
    }
}

/// What a server puts in the State Cookie for a client it saw as `peer`.
type CookieFor = dyn Fn(SocketAddr) -> Vec<u8> + Send + Sync;

/// An SCTP server on `local` (address and port) that answers every INIT it accepts
/// ([`accepted_init`]) with an INIT-ACK from `local` carrying a cookie; stopped on drop.
#[derive(Debug)]
pub struct Server {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Server {
    /// Starts serving `local` inside `netns`; `cookie` says what to put in the State Cookie
    /// for a client observed as the given address.
    pub fn start(
        netns: &Netns,
        local: SocketAddr,
        cookie: impl Fn(SocketAddr) -> Vec<u8> + Send + Sync + 'static,
    ) -> Result<Self> {
        let socket = netns
            .run(|| bound_socket(local.ip()).map_err(anyhow::Error::from))
            .with_context(|| format!("cannot serve SCTP on {local}"))?;
        let stop = Arc::new(AtomicBool::new(false));
        let cookie: Box<CookieFor> = Box::new(cookie);
        let thread = {
            let stop = stop.clone();
            thread::spawn(move || serve(&socket, local, &*cookie, &stop))
        };
        Ok(Self { stop, thread: Some(thread) })
    }

    /// A server that answers as the TCP and UDP echo servers do: the cookie is the [`Answer`]
    /// text, `name` and the client as observed.
    pub fn echo(netns: &Netns, name: &str, local: SocketAddr) -> Result<Self> {
        let name = name.to_owned();
        Self::start(netns, local, move |peer| {
            Answer { backend: name.clone(), observed_client: peer }.to_string().into_bytes()
        })
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn serve(socket: &Socket, local: SocketAddr, cookie: &CookieFor, stop: &AtomicBool) {
    let mut buffer = [0u8; RECEIVE_BUFFER];
    while !stop.load(Ordering::Relaxed) {
        match crate::echo::wait_readable(socket, STOP_POLL) {
            Ok(true) => {}
            Ok(false) => continue,
            Err(error) => {
                eprintln!("testbed: SCTP server {local}: poll failed: {error}");
                return;
            }
        }
        loop {
            let (peer_ip, bytes) = match receive(socket, local.ip(), &mut buffer) {
                Ok(Some(packet)) => packet,
                Ok(None) => continue,
                Err(error) if matches!(error.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => break,
                // A pending error from an earlier answer's ICMP error; nothing to do about it.
                Err(error) if error.raw_os_error().is_some_and(is_icmp_errno) => continue,
                Err(error) => {
                    eprintln!("testbed: SCTP server {local}: receive failed: {error}");
                    return;
                }
            };
            let Some(init) = accepted_init(bytes, local.port()) else { continue };
            let peer = SocketAddr::new(peer_ip, init.peer_port);
            let ports = Ports { source: local.port(), dest: init.peer_port };
            let answer = init_ack_packet(ports, init.peer_tag, &InitFields::random(), &cookie(peer));
            if let Err(error) = socket.send_to(&answer, &SockAddr::from(SocketAddr::new(peer_ip, 0))) {
                eprintln!("testbed: SCTP server {local}: cannot answer {peer}: {error}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PORTS: Ports = Ports { source: 40000, dest: 53 };

    #[test]
    fn an_init_reads_back_as_built() {
        let fields = InitFields::new(0x1234_5678, 99);
        let bytes = init_packet(PORTS, &fields);
        assert_eq!(bytes.len(), HEADER_LEN + CHUNK_HEADER_LEN + INIT_FIXED_LEN);
        let packet = parse(&bytes).unwrap();
        assert_eq!(
            packet,
            Packet {
                ports: PORTS,
                verification_tag: 0,
                checksum_valid: true,
                chunks: vec![Chunk::Init(fields)]
            }
        );
        assert_eq!(accepted_init(&bytes, 53), Some(AcceptedInit { peer_port: 40000, peer_tag: 0x1234_5678 }));
    }

    #[test]
    fn the_checksum_is_crc32c_stored_little_endian() {
        let bytes = init_packet(PORTS, &InitFields::new(1, 2));
        let mut zeroed = bytes.clone();
        zeroed[8..12].fill(0);
        assert_eq!(bytes[8..12], checksum(&zeroed).to_le_bytes());
    }

    #[test]
    fn an_init_ack_carries_its_cookie_whatever_its_length() {
        for cookie in ["", "a", "10.180.0.1:53 10.180.0.2:40000", "abcd"] {
            let fields = InitFields::new(7, 8);
            let bytes = init_ack_packet(PORTS, 0xdead_beef, &fields, cookie.as_bytes());
            assert_eq!(bytes.len() % 4, 0, "padded");
            let chunk_len = usize::from(be16(&bytes[14..16]));
            assert_eq!(chunk_len, CHUNK_HEADER_LEN + INIT_FIXED_LEN + PARAMETER_HEADER_LEN + cookie.len());
            let packet = parse(&bytes).unwrap();
            assert!(packet.checksum_valid);
            assert_eq!(packet.verification_tag, 0xdead_beef);
            assert_eq!(
                packet.chunks,
                vec![Chunk::InitAck { fields, cookie: Some(cookie.as_bytes().to_vec()) }]
            );
        }
    }

    #[test]
    fn a_flipped_bit_anywhere_breaks_the_checksum() {
        let bytes = init_ack_packet(PORTS, 5, &InitFields::new(7, 8), b"cookie");
        for index in 0..bytes.len() {
            let mut corrupted = bytes.clone();
            corrupted[index] ^= 0x10;
            assert!(!checksum_valid(&corrupted), "byte {index}");
        }
    }

    #[test]
    fn servers_answer_only_well_formed_inits_to_their_port() {
        let good = init_packet(PORTS, &InitFields::new(9, 1));
        assert!(accepted_init(&good, 53).is_some());
        assert_eq!(accepted_init(&good, 54), None, "another port");
        let mut bad_crc = good.clone();
        bad_crc[8] ^= 1;
        assert_eq!(accepted_init(&bad_crc, 53), None, "bad checksum");
        assert_eq!(accepted_init(&packet(PORTS, 3, CHUNK_INIT, &good[16..]), 53), None, "nonzero tag");
        assert_eq!(accepted_init(&init_packet(PORTS, &InitFields::new(0, 1)), 53), None, "zero initiate tag");
        let ack = init_ack_packet(PORTS, 0, &InitFields::new(9, 1), b"x");
        assert_eq!(accepted_init(&ack, 53), None, "not an INIT");
        let mut bundled = good.clone();
        bundled.extend_from_slice(&[0, 0, 0, 8, 0, 0, 0, 0]);
        bundled[8..12].fill(0);
        let sum = checksum(&bundled);
        bundled[8..12].copy_from_slice(&sum.to_le_bytes());
        assert!(parse(&bundled).unwrap().checksum_valid);
        assert_eq!(accepted_init(&bundled, 53), None, "INIT bundled with DATA");
    }

    #[test]
    fn malformed_packets_are_errors() {
        let good = init_packet(PORTS, &InitFields::new(9, 1));
        assert!(parse(&good[..11]).is_err(), "no common header");
        assert!(parse(&good[..12]).is_err(), "no chunk");
        assert!(parse(&good[..20]).is_err(), "chunk cut short");
        let mut zero_len = good.clone();
        zero_len[14..16].fill(0);
        assert!(parse(&zero_len).is_err(), "zero chunk length");
    }

    #[test]
    fn the_client_takes_only_its_own_association() {
        let tag = 0xabcd_0001;
        let from: IpAddr = "10.180.0.1".parse().unwrap();
        let ports = Ports { source: 40000, dest: 53 };
        let back = Ports { source: 53, dest: 40000 };
        let answer = init_ack_packet(back, tag, &InitFields::new(5, 6), b"b 10.0.0.1:40000");
        assert_eq!(
            reply_for(&answer, from, ports, tag),
            Some(Reply::InitAck {
                from: SocketAddr::new(from, 53),
                cookie: Some(b"b 10.0.0.1:40000".to_vec())
            })
        );
        assert_eq!(reply_for(&answer, from, ports, tag + 1), None, "another attempt's tag");
        assert_eq!(reply_for(&answer, from, Ports { source: 40001, dest: 53 }, tag), None, "another port");
        let mut corrupted = answer.clone();
        corrupted[0] ^= 0x01;
        assert_eq!(
            reply_for(&corrupted, from, ports, tag),
            Some(Reply::BadChecksum { from: SocketAddr::new(from, 53 ^ 0x100), kind: Some(CHUNK_INIT_ACK) })
        );
        let abort = packet(back, tag, 6, &[]);
        assert!(matches!(reply_for(&abort, from, ports, tag), Some(Reply::Unexpected { .. })));
    }

    #[test]
    fn ipv4_headers_are_stripped_only_from_sctp() {
        let sctp = init_packet(PORTS, &InitFields::new(9, 1));
        let mut ip = vec![0x45, 0, 0, 0, 0, 0, 0x40, 0, 64, 132, 0, 0, 10, 0, 0, 1, 10, 0, 0, 2];
        let total = u16::try_from(ip.len() + sctp.len()).unwrap();
        ip[2..4].copy_from_slice(&total.to_be_bytes());
        ip.extend_from_slice(&sctp);
        let (source, dest, payload) = strip_ipv4_header(&ip).unwrap();
        assert_eq!(
            (source, dest, payload),
            (Ipv4Addr::new(10, 0, 0, 1), Ipv4Addr::new(10, 0, 0, 2), &sctp[..])
        );
        ip[9] = 17;
        assert_eq!(strip_ipv4_header(&ip), None);
    }

    #[test]
    fn port_unreachable_is_told_from_other_icmp_errors() {
        let error = |ipv6, icmp_type, code| IcmpError { ipv6, icmp_type, code, from: None };
        assert!(error(false, 3, 3).port_unreachable());
        assert!(error(true, 1, 4).port_unreachable());
        assert!(!error(false, 3, 2).port_unreachable());
        assert!(!error(true, 1, 3).port_unreachable());
        assert!(error(false, 3, 2).to_string().contains("protocol unreachable"));
    }
}
