//! Checking one flow on the wire, from a socket in the source's namespace (call these from
//! inside [`crate::Netns::run`]).

use std::{
    collections::{BTreeMap, BTreeSet},
    io::{BufRead, BufReader, ErrorKind, Write},
    net::{IpAddr, SocketAddr, TcpStream, UdpSocket},
    os::fd::AsRawFd,
    time::Duration,
};

use socket2::{Domain, Socket, Type};

use super::{
    case::{Protocol, Verdict},
    model::Outcome,
};
use crate::{
    sctp::{self, Reply},
    Answer,
};

/// How long a connection that should work may take.
pub const ANSWER_TIMEOUT: Duration = Duration::from_millis(1500);
/// The bound of the one retry of a connection that ran out of time: long enough for a
/// retransmitted SYN or segment (the kernel's first retransmission comes after 1 s), which a
/// busy single-CPU guest sometimes needs.
pub const RETRY_TIMEOUT: Duration = Duration::from_secs(4);
/// How long a REJECT may take to arrive. Over a second: an IPv6 TCP client that gets the
/// ICMPv6 error while connect() still holds its socket only counts it as a soft error
/// (TcpExtLockDroppedIcmps) and is refused on the SYN retransmission a second later; Linux's
/// own ip6tables REJECT behaves the same.
pub const REJECT_TIMEOUT: Duration = Duration::from_millis(2500);
/// How long a DROP is waited for: no answer in this time is a drop.
pub const DROP_TIMEOUT: Duration = Duration::from_secs(1);
/// New connections per DNAT flow: at least this many...
pub const DNAT_MIN_CONNECTIONS: usize = 12;
/// ...and at most this many while some listed endpoint has not been chosen yet.
pub const DNAT_MAX_CONNECTIONS: usize = 30;
/// Attempts for REJECT and PASS flows (each from a new source port).
const REPEATS: usize = 2;

/// [`attempt`] for a connection that must be answered, tried once more (from a new source
/// port) when it only ran out of time: on a loaded machine (the single-CPU UML guest of ipvs
/// mode, with builds beside it) a handshake or an answer can miss the bound now and then. A
/// wrong answer, a refusal or any other error is never retried, and a dataplane that loses
/// connections fails both tries.
fn answered_attempt(protocol: Protocol, source: IpAddr, dest: SocketAddr) -> Attempt {
    match attempt(protocol, source, dest, ANSWER_TIMEOUT) {
        Attempt::TimedOut | Attempt::Stalled(_) => attempt(protocol, source, dest, RETRY_TIMEOUT),
        other => other,
    }
}

/// What one new connection (TCP), one datagram and its reply (UDP) or one INIT and its
/// INIT-ACK (SCTP) came to.
#[derive(Debug)]
pub enum Attempt {
    Answered {
        answer: Answer,
        client: SocketAddr,
        replied_from: SocketAddr,
    },
    /// TCP reset or ICMP port unreachable.
    Refused,
    TimedOut,
    /// TCP: connected, but no answer came in time.
    Stalled(String),
    /// Anything else: another ICMP error, a connection that broke, a garbled answer.
    Failed(String),
}

impl Attempt {
    fn describe(&self) -> String {
        match self {
            Self::Answered { answer, .. } => format!("answered by {}", answer.backend),
            Self::Refused => "refused".to_owned(),
            Self::TimedOut => "no answer".to_owned(),
            Self::Stalled(error) => format!("connected, then: {error}"),
            Self::Failed(error) => error.clone(),
        }
    }
}

fn classify(error: &std::io::Error) -> Attempt {
    match error.kind() {
        ErrorKind::ConnectionRefused | ErrorKind::ConnectionReset => Attempt::Refused,
        ErrorKind::TimedOut | ErrorKind::WouldBlock => Attempt::TimedOut,
        _ => Attempt::Failed(error.to_string()),
    }
}

/// One new connection from `source` (any port) to `dest`, asking who answers.
pub fn attempt(protocol: Protocol, source: IpAddr, dest: SocketAddr, timeout: Duration) -> Attempt {
    match protocol {
        Protocol::TCP => tcp_attempt(source, dest, timeout),
        Protocol::UDP => udp_attempt(source, dest, timeout),
        Protocol::SCTP => sctp_attempt(source, dest, timeout),
    }
}

/// An INIT from a raw socket (`crate::sctp`): the INIT-ACK's State Cookie holds the answer,
/// an ICMP port unreachable is a refusal, silence a timeout. A reply with a wrong checksum
/// (a NAT that rewrote the ports and left the CRC32c) is a failure, not an answer.
fn sctp_attempt(source: IpAddr, dest: SocketAddr, timeout: Duration) -> Attempt {
    let exchange = match sctp::send_init(source, dest, timeout) {
        Ok(exchange) => exchange,
        Err(error) => return classify(&error),
    };
    match exchange.reply {
        Reply::InitAck { from, cookie: Some(cookie) } => match std::str::from_utf8(&cookie)
            .map_err(|e| e.to_string())
            .and_then(|text| text.parse::<Answer>().map_err(|e| format!("{e:#}")))
        {
            Ok(answer) => Attempt::Answered { answer, client: exchange.client, replied_from: from },
            Err(error) => {
                Attempt::Failed(format!("garbled State Cookie in the INIT-ACK from {from}: {error}"))
            }
        },
        Reply::InitAck { from, cookie: None } => {
            Attempt::Failed(format!("the INIT-ACK from {from} has no State Cookie"))
        }
        Reply::Icmp(icmp) if icmp.port_unreachable() => Attempt::Refused,
        Reply::Icmp(icmp) => Attempt::Failed(icmp.to_string()),
        Reply::BadChecksum { from, kind } => Attempt::Failed(format!(
            "bad SCTP checksum (CRC32c) on the answer from {from} (chunk type {}): ports rewritten without \
             fixing it?",
            kind.map_or_else(|| "none".to_owned(), |kind| kind.to_string())
        )),
        Reply::Unexpected { from, what } => Attempt::Failed(format!("{from} answered the INIT with {what}")),
        Reply::Silence => Attempt::TimedOut,
    }
}

/// Where a probe's socket binds to send from `source`. A loopback source is a local process
/// that connects to localhost without binding: the kernel picks the source (127.0.0.1 toward
/// loopback) after any socket-level balancer chose the destination, so binding 127.0.0.1
/// would pin the socket to loopback where no such process is.
fn bind_address(source: IpAddr) -> SocketAddr {
    match source {
        IpAddr::V4(ip) if ip.is_loopback() => SocketAddr::from((std::net::Ipv4Addr::UNSPECIFIED, 0)),
        IpAddr::V6(ip) if ip.is_loopback() => SocketAddr::from((std::net::Ipv6Addr::UNSPECIFIED, 0)),
        _ => SocketAddr::new(source, 0),
    }
}

fn tcp_attempt(source: IpAddr, dest: SocketAddr, timeout: Duration) -> Attempt {
    let socket = match Socket::new(Domain::for_address(dest), Type::STREAM, Some(socket2::Protocol::TCP)) {
        Ok(socket) => socket,
        Err(error) => return Attempt::Failed(format!("cannot open a socket: {error}")),
    };
    if let Err(error) = socket.bind(&bind_address(source).into()) {
        return Attempt::Failed(format!("cannot bind {source}: {error}"));
    }
    if let Err(error) = socket.connect_timeout(&dest.into(), timeout) {
        return classify(&error);
    }
    let stream: TcpStream = socket.into();
    let exchange = || -> std::io::Result<(Answer, SocketAddr, SocketAddr)> {
        stream.set_read_timeout(Some(timeout))?;
        stream.set_write_timeout(Some(timeout))?;
        stream.set_nodelay(true)?;
        let (client, peer) = (stream.local_addr()?, stream.peer_addr()?);
        (&stream).write_all(b"who are you?\n")?;
        let mut line = String::new();
        if BufReader::new(&stream).read_line(&mut line)? == 0 {
            return Err(std::io::Error::new(ErrorKind::UnexpectedEof, "closed without an answer"));
        }
        let answer = line
            .parse()
            .map_err(|error| std::io::Error::new(ErrorKind::InvalidData, format!("{error:#}")))?;
        Ok((answer, client, peer))
    };
    match exchange() {
        Ok((answer, client, replied_from)) => Attempt::Answered { answer, client, replied_from },
        Err(error) if matches!(error.kind(), ErrorKind::TimedOut | ErrorKind::WouldBlock) => {
            Attempt::Stalled(error.to_string())
        }
        Err(error) => Attempt::Failed(format!("connected, then: {error}")),
    }
}

/// An unconnected socket, so that a reply from an unexpected address is seen rather than
/// filtered, with IP_RECVERR, so that ICMP errors are reported all the same.
fn udp_attempt(source: IpAddr, dest: SocketAddr, timeout: Duration) -> Attempt {
    let socket = match UdpSocket::bind(bind_address(source)) {
        Ok(socket) => socket,
        Err(error) => return Attempt::Failed(format!("cannot bind {source}: {error}")),
    };
    let (level, option) = if dest.is_ipv4() {
        (libc::IPPROTO_IP, libc::IP_RECVERR)
    } else {
        (libc::IPPROTO_IPV6, libc::IPV6_RECVERR)
    };
    let on: libc::c_int = 1;
    // SAFETY: `on` is a valid c_int for the duration of the call and its size is passed.
    let set = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            level,
            option,
            (&raw const on).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if set != 0 {
        return Attempt::Failed(format!("cannot set RECVERR: {}", std::io::Error::last_os_error()));
    }
    if let Err(error) = socket.set_read_timeout(Some(timeout)) {
        return Attempt::Failed(error.to_string());
    }
    let client = match socket.local_addr() {
        Ok(client) => client,
        Err(error) => return Attempt::Failed(error.to_string()),
    };
    if let Err(error) = socket.send_to(b"who are you?", dest) {
        return classify(&error);
    }
    let mut reply = [0u8; 1500];
    match socket.recv_from(&mut reply) {
        Ok((len, replied_from)) => match std::str::from_utf8(&reply[..len])
            .map_err(|e| e.to_string())
            .and_then(|text| text.parse::<Answer>().map_err(|e| format!("{e:#}")))
        {
            Ok(answer) => Attempt::Answered { answer, client, replied_from },
            Err(error) => Attempt::Failed(format!("garbled answer from {replied_from}: {error}")),
        },
        Err(error) => classify(&error),
    }
}

/// Everything a flow check needs besides the sockets.
#[derive(Clone, Debug)]
pub struct FlowCheck {
    pub protocol: Protocol,
    pub source: IpAddr,
    pub dest: SocketAddr,
    pub expect: Outcome,
    /// The target service has ClientIP session affinity: every connection goes to one
    /// endpoint, so not every endpoint can be hit from one client.
    pub affinity: bool,
    /// The node's addresses: what a masqueraded connection may come from.
    pub node_addresses: BTreeSet<IpAddr>,
    /// Who answers at the destination when nothing intercepts the packet.
    pub listener_at_dest: Option<String>,
}

/// Checks one flow; `Err` says why it failed.
pub fn check(flow: &FlowCheck) -> Result<String, String> {
    match flow.expect.verdict {
        Verdict::DNAT => check_dnat(flow),
        Verdict::REJECT => check_reject(flow),
        Verdict::DROP => check_drop(flow),
        Verdict::PASS | Verdict::ACCEPT => check_pass(flow),
    }
}

/// Whether the source `backend` saw for a connection from `client` is what the flow expects:
/// a node's address when `masquerade` is `Some(true)`, the client's own address when
/// `Some(false)`, either when `None`.
///
/// Only the address is compared: a connection whose reply tuple clashes with one still in the
/// conntrack table (an earlier case's connection from the same ephemeral port to the same
/// backend) is given a new source port by the kernel's NAT null binding, with no masquerade
/// rule involved. A node's own connections would otherwise fail now and then, in every mode.
fn check_source(
    masquerade: Option<bool>,
    node_addresses: &BTreeSet<IpAddr>,
    backend: SocketAddr,
    observed: SocketAddr,
    client: SocketAddr,
) -> Result<(), String> {
    match masquerade {
        Some(true) if !node_addresses.contains(&observed.ip()) => {
            Err(format!("not masqueraded: {backend} saw the client as {observed}"))
        }
        Some(false) if observed.ip() != client.ip() => {
            let how = if node_addresses.contains(&observed.ip()) { "masqueraded: " } else { "" };
            Err(format!("{how}{backend} saw the client as {observed}, not {client}"))
        }
        _ => Ok(()),
    }
}

fn endpoint_list(endpoints: &BTreeSet<SocketAddr>) -> String {
    endpoints.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
}

fn check_dnat(flow: &FlowCheck) -> Result<String, String> {
    let expected = &flow.expect.endpoints;
    let mut hits: BTreeMap<SocketAddr, usize> = BTreeMap::new();
    // A pod reaching its own service with other endpoints besides itself: upstream reports
    // masquerade for the flow because of the branch to itself; the other branches are not
    // determined by the expectation.
    let hairpin_flow = expected.iter().any(|endpoint| endpoint.ip() == flow.source);
    let mut connections = 0;
    while connections < DNAT_MAX_CONNECTIONS {
        let attempt = answered_attempt(flow.protocol, flow.source, flow.dest);
        let Attempt::Answered { answer, client, replied_from } = attempt else {
            return Err(format!("connection {}: {}", connections + 1, attempt.describe()));
        };
        connections += 1;
        let Ok(backend) = answer.backend.parse::<SocketAddr>() else {
            return Err(format!("not DNATed: answered by {}", answer.backend));
        };
        if !expected.contains(&backend) {
            return Err(format!("DNATed to {backend}, not one of [{}]", endpoint_list(expected)));
        }
        if replied_from != flow.dest {
            return Err(format!("the reply from {backend} came from {replied_from}, not {}", flow.dest));
        }
        let to_itself = backend.ip() == flow.source;
        let masquerade = if to_itself || (flow.expect.masquerade && !hairpin_flow) {
            Some(true)
        } else if flow.expect.masquerade {
            None
        } else {
            Some(false)
        };
        check_source(masquerade, &flow.node_addresses, backend, answer.observed_client, client)?;
        *hits.entry(backend).or_default() += 1;
        let covered = flow.affinity || hits.len() == expected.len();
        if connections >= DNAT_MIN_CONNECTIONS && covered {
            break;
        }
    }
    let spread =
        hits.iter().map(|(backend, count)| format!("{backend}×{count}")).collect::<Vec<_>>().join(" ");
    if flow.affinity {
        if hits.len() != 1 {
            return Err(format!("session affinity broken: {spread}"));
        }
    } else if hits.len() != expected.len() {
        let missed: BTreeSet<_> = expected.iter().filter(|endpoint| !hits.contains_key(endpoint)).collect();
        let missed = missed.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ");
        return Err(format!("{missed} never chosen in {connections} connections ({spread})"));
    }
    Ok(format!("{connections} connections: {spread}"))
}

fn check_reject(flow: &FlowCheck) -> Result<String, String> {
    for _ in 0..REPEATS {
        match attempt(flow.protocol, flow.source, flow.dest, REJECT_TIMEOUT) {
            Attempt::Refused => {}
            Attempt::TimedOut => {
                return Err(format!("no answer within {REJECT_TIMEOUT:?}: dropped, not rejected"))
            }
            other => return Err(format!("not rejected: {}", other.describe())),
        }
    }
    Ok("refused".to_owned())
}

fn check_drop(flow: &FlowCheck) -> Result<String, String> {
    match attempt(flow.protocol, flow.source, flow.dest, DROP_TIMEOUT) {
        Attempt::TimedOut => Ok(format!("no answer within {DROP_TIMEOUT:?}")),
        other => Err(format!("not dropped: {}", other.describe())),
    }
}

fn check_pass(flow: &FlowCheck) -> Result<String, String> {
    let Some(listener) = &flow.listener_at_dest else {
        return Err(format!("testbed: no socket listens on {}", flow.dest));
    };
    for _ in 0..REPEATS {
        match answered_attempt(flow.protocol, flow.source, flow.dest) {
            Attempt::Answered { answer, client, replied_from } => {
                if answer.backend != *listener {
                    return Err(format!("intercepted: answered by {} instead of {listener}", answer.backend));
                }
                if answer.observed_client != client || replied_from != flow.dest {
                    return Err(format!(
                        "rewritten: {listener} saw {} (client {client}), reply from {replied_from}",
                        answer.observed_client
                    ));
                }
            }
            other => return Err(format!("did not reach {listener}: {}", other.describe())),
        }
    }
    Ok(format!("reached {listener} unchanged"))
}

/// Before vipr runs: what ordinary routing does with a flow that must be DROPped. If that is
/// silence too, a drop cannot be observed.
pub fn drop_control(flow: &FlowCheck) -> Result<(), String> {
    match attempt(flow.protocol, flow.source, flow.dest, DROP_TIMEOUT) {
        Attempt::TimedOut => {
            Err("testbed: even without vipr this packet gets no answer, so a drop cannot be seen".into())
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node() -> BTreeSet<IpAddr> {
        BTreeSet::from(["192.168.0.2".parse().unwrap()])
    }

    fn addr(text: &str) -> SocketAddr {
        text.parse().unwrap()
    }

    #[test]
    fn a_node_client_given_a_new_source_port_by_conntrack_is_not_masqueraded() {
        let backend = addr("10.180.0.2:80");
        let client = addr("192.168.0.2:56901");
        assert_eq!(check_source(Some(false), &node(), backend, addr("192.168.0.2:50709"), client), Ok(()));
    }

    #[test]
    fn a_changed_source_address_is_what_fails() {
        let backend = addr("10.180.0.2:80");
        let pod = addr("10.180.0.9:40000");
        let masqueraded = check_source(Some(false), &node(), backend, addr("192.168.0.2:40000"), pod);
        assert_eq!(
            masqueraded,
            Err(format!("masqueraded: {backend} saw the client as 192.168.0.2:40000, not {pod}"))
        );
        assert!(check_source(Some(true), &node(), backend, pod, pod).is_err());
        assert_eq!(check_source(Some(true), &node(), backend, addr("192.168.0.2:1"), pod), Ok(()));
        assert_eq!(check_source(None, &node(), backend, pod, pod), Ok(()));
    }
}
