//! vipr's netlink client over a raw `AF_NETLINK` socket: message framing, attribute
//! encoding and parsing, request/acknowledge and dump exchanges, batches sent in one
//! datagram with their (extended) acknowledgements, and resolving a generic netlink family by
//! name. Its users: the IPVS dataplane (generic netlink for IPVS, rtnetlink for the dummy
//! interface and its addresses), the nftables dataplane (nf_tables element batches,
//! `dataplane/nftables/netlink.rs`), `host` (links). The encoding is pure and unit-tested.
use std::{
    io,
    mem::size_of,
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    time::Duration,
};

/// `struct nlmsghdr`: length, type, flags, sequence number, port id.
pub const HEADER_LEN: usize = 16;
/// `struct genlmsghdr`: command, version, reserved.
pub const GENL_HEADER_LEN: usize = 4;

pub const NLM_F_REQUEST: u16 = 0x1;
pub const NLM_F_MULTI: u16 = 0x2;
pub const NLM_F_ACK: u16 = 0x4;
pub const NLM_F_EXCL: u16 = 0x200;
pub const NLM_F_CREATE: u16 = 0x400;
pub const NLM_F_DUMP: u16 = 0x300;

pub const NLMSG_ERROR: u16 = 2;
pub const NLMSG_DONE: u16 = 3;

/// Flags of an `NLMSG_ERROR` reply: the request was not echoed back (`NETLINK_CAP_ACK`), and
/// extended-acknowledgement attributes follow it (`NETLINK_EXT_ACK`).
const NLM_F_CAPPED: u16 = 0x100;
const NLM_F_ACK_TLVS: u16 = 0x200;
/// The extended-acknowledgement attributes: the kernel's message and the offset, in the
/// request, of the attribute the error is about.
const NLMSGERR_ATTR_MSG: u16 = 1;
const NLMSGERR_ATTR_OFFS: u16 = 2;
const SOL_NETLINK: libc::c_int = 270;
const NETLINK_CAP_ACK: libc::c_int = 10;
const NETLINK_EXT_ACK: libc::c_int = 11;

/// Set on an attribute whose payload is itself attributes.
pub const NLA_F_NESTED: u16 = 0x8000;

/// The netfilter protocol (nfnetlink), under which conntrack and nf_tables live.
pub const NETLINK_NETFILTER: libc::c_int = 12;
/// `struct nfgenmsg`, the header of every nfnetlink message's payload.
pub const NFGENMSG_LEN: usize = 4;

/// `struct nfgenmsg`: the family, `NFNETLINK_V0`, the resource id (big-endian).
pub fn nfgenmsg(family: u8, resource: u16) -> [u8; NFGENMSG_LEN] {
    let resource = resource.to_be_bytes();
    [family, 0, resource[0], resource[1]]
}

/// An nfnetlink message type: the subsystem in the high byte, its message in the low one.
pub const fn nfnl_type(subsystem: u16, message: u16) -> u16 {
    (subsystem << 8) | message
}
const NLA_TYPE_MASK: u16 = !(NLA_F_NESTED | 0x4000);

/// The generic netlink controller and what this client asks it.
const GENL_ID_CTRL: u16 = 0x10;
const CTRL_CMD_GETFAMILY: u8 = 3;
const CTRL_ATTR_FAMILY_ID: u16 = 1;
const CTRL_ATTR_FAMILY_NAME: u16 = 2;

/// How long a reply may take; the kernel answers at once, so this only guards against hangs.
const REPLY_TIMEOUT: Duration = Duration::from_secs(10);

/// Rounds `len` up to netlink's 4-byte alignment.
pub const fn align(len: usize) -> usize {
    (len + 3) & !3
}

/// Builds a sequence of attributes (the payload of a message or of a nested attribute).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Attributes {
    bytes: Vec<u8>,
}

impl Attributes {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    pub fn into_bytes(self) -> Vec<u8> {
        self.bytes
    }

    /// Attributes already encoded (one read back from the kernel, to send it again).
    pub fn from_bytes(bytes: Vec<u8>) -> Self {
        Self { bytes }
    }

    /// One attribute: a 4-byte header (length without padding, type), the payload, padding.
    pub fn put(&mut self, kind: u16, payload: &[u8]) -> &mut Self {
        let len = 4 + payload.len();
        let len16 = u16::try_from(len).expect("a netlink attribute is shorter than 64 KiB");
        self.bytes.extend_from_slice(&len16.to_ne_bytes());
        self.bytes.extend_from_slice(&kind.to_ne_bytes());
        self.bytes.extend_from_slice(payload);
        self.bytes.resize(self.bytes.len() + align(len) - len, 0);
        self
    }

    pub fn put_u16(&mut self, kind: u16, value: u16) -> &mut Self {
        self.put(kind, &value.to_ne_bytes())
    }

    /// A 16-bit value in network byte order (ports).
    pub fn put_be16(&mut self, kind: u16, value: u16) -> &mut Self {
        self.put(kind, &value.to_be_bytes())
    }

    pub fn put_u32(&mut self, kind: u16, value: u32) -> &mut Self {
        self.put(kind, &value.to_ne_bytes())
    }

    /// A C string: the text and a terminating NUL.
    pub fn put_str(&mut self, kind: u16, value: &str) -> &mut Self {
        let mut payload = Vec::with_capacity(value.len() + 1);
        payload.extend_from_slice(value.as_bytes());
        payload.push(0);
        self.put(kind, &payload)
    }

    /// A nested attribute holding `inner`.
    pub fn put_nested(&mut self, kind: u16, inner: &Attributes) -> &mut Self {
        self.put(kind | NLA_F_NESTED, &inner.bytes)
    }
}

/// One attribute read from a message: its type (flags masked off) and payload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Attribute<'a> {
    pub kind: u16,
    pub payload: &'a [u8],
}

impl<'a> Attribute<'a> {
    pub fn u8(&self) -> Option<u8> {
        self.payload.first().copied()
    }

    pub fn u16(&self) -> Option<u16> {
        Some(u16::from_ne_bytes(self.payload.get(..2)?.try_into().ok()?))
    }

    pub fn be16(&self) -> Option<u16> {
        Some(u16::from_be_bytes(self.payload.get(..2)?.try_into().ok()?))
    }

    pub fn u32(&self) -> Option<u32> {
        Some(u32::from_ne_bytes(self.payload.get(..4)?.try_into().ok()?))
    }

    /// A C string, without its NUL.
    pub fn str(&self) -> Option<&'a str> {
        let end = self.payload.iter().position(|byte| *byte == 0).unwrap_or(self.payload.len());
        std::str::from_utf8(&self.payload[..end]).ok()
    }

    /// The attributes nested in this one.
    pub fn nested(&self) -> AttributeIter<'a> {
        parse_attributes(self.payload)
    }
}

/// Iterates over the attributes in `bytes`; stops at the first malformed one.
pub fn parse_attributes(bytes: &[u8]) -> AttributeIter<'_> {
    AttributeIter { rest: bytes }
}

#[derive(Clone, Debug)]
pub struct AttributeIter<'a> {
    rest: &'a [u8],
}

impl<'a> Iterator for AttributeIter<'a> {
    type Item = Attribute<'a>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.rest.len() < 4 {
            return None;
        }
        let len = usize::from(u16::from_ne_bytes([self.rest[0], self.rest[1]]));
        let kind = u16::from_ne_bytes([self.rest[2], self.rest[3]]) & NLA_TYPE_MASK;
        if len < 4 || len > self.rest.len() {
            self.rest = &[];
            return None;
        }
        let payload = &self.rest[4..len];
        self.rest = self.rest.get(align(len)..).unwrap_or_default();
        Some(Attribute { kind, payload })
    }
}

/// A whole netlink message: header followed by `payload`.
pub fn message(kind: u16, flags: u16, sequence: u32, payload: &[u8]) -> Vec<u8> {
    let len = u32::try_from(HEADER_LEN + payload.len()).expect("a netlink message is shorter than 4 GiB");
    let mut bytes = Vec::with_capacity(align(HEADER_LEN + payload.len()));
    bytes.extend_from_slice(&len.to_ne_bytes());
    bytes.extend_from_slice(&kind.to_ne_bytes());
    bytes.extend_from_slice(&flags.to_ne_bytes());
    bytes.extend_from_slice(&sequence.to_ne_bytes());
    bytes.extend_from_slice(&0u32.to_ne_bytes());
    bytes.extend_from_slice(payload);
    bytes
}

/// A generic netlink payload: the genl header, then `attributes`.
pub fn genl_payload(command: u8, version: u8, attributes: &Attributes) -> Vec<u8> {
    let mut payload = vec![command, version, 0, 0];
    payload.extend_from_slice(attributes.bytes());
    payload
}

/// One message read from the socket.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Received {
    pub kind: u16,
    pub flags: u16,
    pub sequence: u32,
    pub payload: Vec<u8>,
}

/// Splits a datagram into its messages.
pub fn split_messages(mut bytes: &[u8]) -> io::Result<Vec<Received>> {
    let mut messages = Vec::new();
    while bytes.len() >= HEADER_LEN {
        let len = u32::from_ne_bytes(bytes[0..4].try_into().expect("4 bytes")) as usize;
        if len < HEADER_LEN || len > bytes.len() {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "truncated netlink message"));
        }
        messages.push(Received {
            kind: u16::from_ne_bytes([bytes[4], bytes[5]]),
            flags: u16::from_ne_bytes([bytes[6], bytes[7]]),
            sequence: u32::from_ne_bytes(bytes[8..12].try_into().expect("4 bytes")),
            payload: bytes[HEADER_LEN..len].to_vec(),
        });
        bytes = bytes.get(align(len)..).unwrap_or_default();
    }
    Ok(messages)
}

/// The error code of an `NLMSG_ERROR` payload: 0 is an acknowledgement, otherwise a negated
/// errno.
pub fn error_code(payload: &[u8]) -> io::Result<i32> {
    let code =
        payload.get(..4).ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "short netlink error"))?;
    Ok(i32::from_ne_bytes(code.try_into().expect("4 bytes")))
}

/// An `NLMSG_ERROR` reply read whole: an acknowledgement (`code` 0) or an error, with what
/// the kernel's extended acknowledgement says.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Acknowledgement {
    pub sequence: u32,
    /// 0, or a negated errno.
    pub code: i32,
    /// The kernel's explanation (`NLMSGERR_ATTR_MSG`).
    pub text: Option<String>,
    /// Where in the request (bytes from its netlink header) the attribute at fault starts
    /// (`NLMSGERR_ATTR_OFFS`).
    pub offset: Option<u32>,
}

impl Acknowledgement {
    /// Reads an `NLMSG_ERROR` reply: the code, the request's header (or the whole request
    /// when it was not capped), then the extended-acknowledgement attributes if flagged.
    pub fn parse(reply: &Received) -> io::Result<Self> {
        let code = error_code(&reply.payload)?;
        let mut acknowledgement = Self { sequence: reply.sequence, code, ..Self::default() };
        if reply.flags & NLM_F_ACK_TLVS == 0 {
            return Ok(acknowledgement);
        }
        let echoed = if reply.flags & NLM_F_CAPPED != 0 {
            HEADER_LEN
        } else {
            let header = reply.payload.get(4..8).ok_or_else(|| {
                io::Error::new(io::ErrorKind::InvalidData, "netlink error without the request's header")
            })?;
            align(u32::from_ne_bytes(header.try_into().expect("4 bytes")) as usize)
        };
        for attribute in parse_attributes(reply.payload.get(4 + echoed..).unwrap_or_default()) {
            match attribute.kind {
                NLMSGERR_ATTR_MSG => acknowledgement.text = attribute.str().map(str::to_owned),
                NLMSGERR_ATTR_OFFS => acknowledgement.offset = attribute.u32(),
                _ => {}
            }
        }
        Ok(acknowledgement)
    }
}

/// A `NETLINK_ROUTE` socket subscribed to the multicast `groups` (`RTMGRP_*` bits) of this
/// network namespace: every notification of those groups arrives on it.
pub fn subscribe(groups: u32) -> io::Result<OwnedFd> {
    // SAFETY: plain socket(2); the descriptor is owned right away.
    let fd = unsafe {
        let raw = libc::socket(libc::AF_NETLINK, libc::SOCK_RAW | libc::SOCK_CLOEXEC, libc::NETLINK_ROUTE);
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        OwnedFd::from_raw_fd(raw)
    };
    // SAFETY: an all-zero sockaddr_nl is valid; the fields that matter are set below.
    let mut address: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
    address.nl_family = libc::AF_NETLINK as libc::sa_family_t;
    address.nl_groups = groups;
    // SAFETY: `address` is a sockaddr_nl of the size passed.
    let bound = unsafe {
        libc::bind(
            fd.as_raw_fd(),
            std::ptr::addr_of!(address).cast(),
            size_of::<libc::sockaddr_nl>() as libc::socklen_t,
        )
    };
    if bound < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

/// A netlink socket of one protocol (`NETLINK_GENERIC`, `NETLINK_ROUTE`), in the network
/// namespace of the thread that opened it.
#[derive(Debug)]
pub struct Socket {
    fd: OwnedFd,
    sequence: u32,
    buffer: Vec<u8>,
}

impl Socket {
    pub fn open(protocol: i32) -> io::Result<Self> {
        // SAFETY: plain system calls; the descriptor is owned right away.
        let fd = unsafe {
            let raw = libc::socket(libc::AF_NETLINK, libc::SOCK_RAW | libc::SOCK_CLOEXEC, protocol);
            if raw < 0 {
                return Err(io::Error::last_os_error());
            }
            OwnedFd::from_raw_fd(raw)
        };
        // SAFETY: a zeroed sockaddr_nl is valid; the kernel picks the port id.
        unsafe {
            let mut address: libc::sockaddr_nl = std::mem::zeroed();
            address.nl_family = libc::AF_NETLINK as libc::sa_family_t;
            if libc::bind(
                fd.as_raw_fd(),
                std::ptr::addr_of!(address).cast(),
                size_of::<libc::sockaddr_nl>() as libc::socklen_t,
            ) < 0
            {
                return Err(io::Error::last_os_error());
            }
            let timeout = libc::timeval { tv_sec: REPLY_TIMEOUT.as_secs() as libc::time_t, tv_usec: 0 };
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                std::ptr::addr_of!(timeout).cast(),
                size_of::<libc::timeval>() as libc::socklen_t,
            );
        }
        Ok(Self { fd, sequence: 0, buffer: vec![0; 64 * 1024] })
    }

    /// The next sequence number, for messages framed by the caller ([`Self::send_batch`]).
    pub fn next_sequence(&mut self) -> u32 {
        self.sequence = self.sequence.wrapping_add(1);
        self.sequence
    }

    /// Asks for extended acknowledgements (the kernel's message and the offset of the
    /// attribute at fault) without the request echoed back in an error.
    pub fn extended_acknowledgements(&self) -> io::Result<()> {
        for option in [NETLINK_EXT_ACK, NETLINK_CAP_ACK] {
            self.set_option(SOL_NETLINK, option, 1)?;
        }
        Ok(())
    }

    fn set_option(&self, level: libc::c_int, option: libc::c_int, value: libc::c_int) -> io::Result<()> {
        // SAFETY: an int option, passed by pointer with its size.
        let result = unsafe {
            libc::setsockopt(
                self.fd.as_raw_fd(),
                level,
                option,
                std::ptr::addr_of!(value).cast(),
                size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if result < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Sends `messages` (framed by the caller, e.g. an nfnetlink batch, which the kernel
    /// takes as one transaction only in one datagram) in one datagram, and returns every
    /// `NLMSG_ERROR` reply: the kernel handles a netlink send before `sendto` returns, so
    /// its answers are all queued by then and are read without waiting.
    pub fn send_batch(&mut self, messages: &[u8]) -> io::Result<Vec<Acknowledgement>> {
        // A datagram larger than the send buffer is refused: grow it (as root the limit
        // does not apply; otherwise up to the system's maximum).
        let needed = libc::c_int::try_from(messages.len() + 4096).unwrap_or(libc::c_int::MAX);
        if needed > 200 * 1024 && self.set_option(libc::SOL_SOCKET, libc::SO_SNDBUFFORCE, needed).is_err() {
            self.set_option(libc::SOL_SOCKET, libc::SO_SNDBUF, needed)?;
        }
        // SAFETY: the buffer is valid for its length; the kernel address is all zeros.
        let sent = unsafe {
            let mut kernel: libc::sockaddr_nl = std::mem::zeroed();
            kernel.nl_family = libc::AF_NETLINK as libc::sa_family_t;
            libc::sendto(
                self.fd.as_raw_fd(),
                messages.as_ptr().cast(),
                messages.len(),
                0,
                std::ptr::addr_of!(kernel).cast(),
                size_of::<libc::sockaddr_nl>() as libc::socklen_t,
            )
        };
        if sent < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut acknowledgements = Vec::new();
        loop {
            // SAFETY: the buffer is valid for its length.
            let received = unsafe {
                libc::recv(
                    self.fd.as_raw_fd(),
                    self.buffer.as_mut_ptr().cast(),
                    self.buffer.len(),
                    libc::MSG_DONTWAIT,
                )
            };
            if received < 0 {
                let error = io::Error::last_os_error();
                match error.kind() {
                    io::ErrorKind::Interrupted => continue,
                    io::ErrorKind::WouldBlock => return Ok(acknowledgements),
                    _ => return Err(error),
                }
            }
            for reply in split_messages(&self.buffer[..received as usize])? {
                if reply.kind == NLMSG_ERROR {
                    acknowledgements.push(Acknowledgement::parse(&reply)?);
                }
            }
        }
    }

    /// Sends one request and waits for its acknowledgement (the kernel's answer to
    /// `NLM_F_ACK`). Replies other than the acknowledgement are returned.
    pub fn request(&mut self, kind: u16, flags: u16, payload: &[u8]) -> io::Result<Vec<Received>> {
        self.exchange(kind, flags | NLM_F_REQUEST | NLM_F_ACK, payload, false)
    }

    /// Sends a dump request and collects every message until `NLMSG_DONE`.
    pub fn dump(&mut self, kind: u16, payload: &[u8]) -> io::Result<Vec<Received>> {
        self.exchange(kind, NLM_F_REQUEST | NLM_F_DUMP, payload, true)
    }

    fn exchange(&mut self, kind: u16, flags: u16, payload: &[u8], dump: bool) -> io::Result<Vec<Received>> {
        self.sequence = self.sequence.wrapping_add(1);
        let sequence = self.sequence;
        let request = message(kind, flags, sequence, payload);
        // SAFETY: the buffer is valid for its length; the kernel address is all zeros.
        let sent = unsafe {
            let mut kernel: libc::sockaddr_nl = std::mem::zeroed();
            kernel.nl_family = libc::AF_NETLINK as libc::sa_family_t;
            libc::sendto(
                self.fd.as_raw_fd(),
                request.as_ptr().cast(),
                request.len(),
                0,
                std::ptr::addr_of!(kernel).cast(),
                size_of::<libc::sockaddr_nl>() as libc::socklen_t,
            )
        };
        if sent < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut replies = Vec::new();
        loop {
            // SAFETY: the buffer is valid for its length.
            let received = unsafe {
                libc::recv(self.fd.as_raw_fd(), self.buffer.as_mut_ptr().cast(), self.buffer.len(), 0)
            };
            if received < 0 {
                let error = io::Error::last_os_error();
                if error.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(error);
            }
            for reply in split_messages(&self.buffer[..received as usize])? {
                if reply.sequence != sequence {
                    // An answer to an earlier request that timed out.
                    continue;
                }
                match reply.kind {
                    NLMSG_ERROR => {
                        let code = error_code(&reply.payload)?;
                        if code != 0 {
                            return Err(io::Error::from_raw_os_error(-code));
                        }
                        return Ok(replies);
                    }
                    NLMSG_DONE if dump => return Ok(replies),
                    // Answers; a request's acknowledgement (or a dump's end) follows them.
                    _ => replies.push(reply),
                }
            }
        }
    }
}

/// A generic netlink family: its socket and the id the kernel gave it.
#[derive(Debug)]
pub struct GenericFamily {
    pub socket: Socket,
    pub id: u16,
    pub version: u8,
}

impl GenericFamily {
    /// Resolves `name` (loading its module on demand, where the kernel can). `ENOENT` means
    /// the kernel has no such family.
    pub fn resolve(name: &str, version: u8) -> io::Result<Self> {
        let mut socket = Socket::open(libc::NETLINK_GENERIC)?;
        let mut attributes = Attributes::new();
        attributes.put_str(CTRL_ATTR_FAMILY_NAME, name);
        let replies = socket.request(GENL_ID_CTRL, 0, &genl_payload(CTRL_CMD_GETFAMILY, 1, &attributes))?;
        let id = replies
            .iter()
            .filter(|reply| reply.kind == GENL_ID_CTRL)
            .filter_map(|reply| reply.payload.get(GENL_HEADER_LEN..))
            .flat_map(parse_attributes)
            .find(|attribute| attribute.kind == CTRL_ATTR_FAMILY_ID)
            .and_then(|attribute| attribute.u16())
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "the controller named no family id"))?;
        Ok(Self { socket, id, version })
    }

    /// A command that changes something, acknowledged.
    pub fn command(&mut self, command: u8, attributes: &Attributes) -> io::Result<()> {
        self.socket.request(self.id, 0, &genl_payload(command, self.version, attributes)).map(drop)
    }

    /// A dump: the attributes of every answer (genl header stripped).
    pub fn dump(&mut self, command: u8, attributes: &Attributes) -> io::Result<Vec<Vec<u8>>> {
        let replies = self.socket.dump(self.id, &genl_payload(command, self.version, attributes))?;
        Ok(replies
            .into_iter()
            .filter(|reply| reply.kind == self.id)
            .map(|reply| reply.payload.get(GENL_HEADER_LEN..).unwrap_or_default().to_vec())
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attributes_are_padded_to_four_bytes() {
        let mut attributes = Attributes::new();
        attributes.put_u16(1, 2).put_str(6, "rr").put_u32(4, 0x0102_0304);
        #[rustfmt::skip]
        let expected: Vec<u8> = [
            &[6, 0, 1, 0][..], &2u16.to_ne_bytes(), &[0, 0],   // len 6 (no padding counted), u16
            &[7, 0, 6, 0], b"rr\0", &[0],                      // "rr\0" padded to 4
            &[8, 0, 4, 0], &0x0102_0304u32.to_ne_bytes(),
        ].concat();
        assert_eq!(attributes.bytes(), expected);
    }

    #[test]
    fn nested_attributes_carry_the_nested_flag_and_parse_back() {
        let mut inner = Attributes::new();
        inner.put_be16(4, 80).put(3, &[10, 96, 0, 10]);
        let mut outer = Attributes::new();
        outer.put_nested(1, &inner).put_u32(4, 7);
        let bytes = outer.bytes();
        assert_eq!(u16::from_ne_bytes([bytes[2], bytes[3]]), 1 | NLA_F_NESTED);

        let parsed: Vec<_> = parse_attributes(bytes).collect();
        assert_eq!(parsed.len(), 2);
        assert_eq!(parsed[0].kind, 1, "the nested flag is masked off");
        let nested: Vec<_> = parsed[0].nested().collect();
        assert_eq!(nested[0].be16(), Some(80));
        assert_eq!(nested[0].payload, [0, 80], "ports are big-endian");
        assert_eq!(nested[1].payload, [10, 96, 0, 10]);
        assert_eq!(parsed[1].u32(), Some(7));
    }

    #[test]
    fn malformed_attributes_end_the_iteration() {
        assert_eq!(parse_attributes(&[200, 0, 1, 0, 1, 2]).count(), 0, "length past the end");
        assert_eq!(parse_attributes(&[2, 0, 1, 0]).count(), 0, "length below the header");
        assert_eq!(parse_attributes(&[5, 0, 1, 0, 9]).next().unwrap().u8(), Some(9), "unpadded last one");
    }

    #[test]
    fn messages_frame_and_split() {
        let payload = genl_payload(4, 1, Attributes::new().put_u16(1, 2));
        let mut bytes = message(0x20, NLM_F_REQUEST | NLM_F_DUMP, 7, &payload);
        assert_eq!(u32::from_ne_bytes(bytes[0..4].try_into().unwrap()) as usize, bytes.len());
        assert_eq!(&bytes[16..20], &[4, 1, 0, 0], "genl header: command, version");
        let second = message(NLMSG_DONE, NLM_F_MULTI, 7, &0i32.to_ne_bytes());
        bytes.extend_from_slice(&second);
        let split = split_messages(&bytes).unwrap();
        assert_eq!(split.len(), 2);
        assert_eq!((split[0].kind, split[0].sequence), (0x20, 7));
        assert_eq!(split[0].payload, payload);
        assert_eq!(split[1].kind, NLMSG_DONE);
        assert!(split_messages(&bytes[..bytes.len() - 1]).is_err(), "truncated");
    }

    #[test]
    fn errors_are_negated_errnos() {
        assert_eq!(error_code(&(-libc::ENOENT).to_ne_bytes()).unwrap(), -libc::ENOENT);
        assert!(error_code(&[0, 0]).is_err());
    }

    #[test]
    fn extended_acknowledgements_give_the_offset_and_the_text() {
        // An error reply to a capped request: code, the request's header, then the attributes.
        let mut payload = (-libc::EEXIST).to_ne_bytes().to_vec();
        payload.extend_from_slice(&message(0x0a0c, NLM_F_REQUEST, 9, &[])[..HEADER_LEN]);
        let mut attributes = Attributes::new();
        attributes.put_str(NLMSGERR_ATTR_MSG, "exists").put_u32(NLMSGERR_ATTR_OFFS, 44);
        payload.extend_from_slice(attributes.bytes());
        let reply =
            Received { kind: NLMSG_ERROR, flags: NLM_F_CAPPED | NLM_F_ACK_TLVS, sequence: 9, payload };
        assert_eq!(
            Acknowledgement::parse(&reply).unwrap(),
            Acknowledgement {
                sequence: 9,
                code: -libc::EEXIST,
                text: Some("exists".into()),
                offset: Some(44)
            }
        );
        let plain =
            Received { kind: NLMSG_ERROR, flags: 0, sequence: 3, payload: 0i32.to_ne_bytes().to_vec() };
        assert_eq!(
            Acknowledgement::parse(&plain).unwrap(),
            Acknowledgement { sequence: 3, ..Default::default() }
        );
    }

    #[test]
    fn an_unknown_generic_family_is_enoent() {
        // Any kernel answers this; no family has this name.
        let error = GenericFamily::resolve("VIPR-NO-SUCH", 1).unwrap_err();
        assert_eq!(error.raw_os_error(), Some(libc::ENOENT), "{error}");
    }
}
