//! Clients of the echo backends. They only work when called from inside the client's
//! namespace, i.e. within [`crate::Netns::run`]; a [`TcpSession`] made there can be used
//! from anywhere afterwards.

use std::{
    collections::BTreeMap,
    fmt, io,
    io::{BufRead, BufReader, Read as _, Write},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream, UdpSocket},
    str::FromStr,
    time::Duration,
};

use std::os::fd::RawFd;

use anyhow::{bail, ensure, Context, Result};

use crate::{Frontend, Protocol};

/// What an echo backend says: its name and the client address it observed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Answer {
    pub backend: String,
    pub observed_client: SocketAddr,
}

impl fmt::Display for Answer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.backend, self.observed_client)
    }
}

impl FromStr for Answer {
    type Err = anyhow::Error;

    fn from_str(text: &str) -> Result<Self> {
        let (backend, observed_client) =
            text.trim_end().split_once(' ').with_context(|| format!("malformed answer {text:?}"))?;
        Ok(Self {
            backend: backend.to_owned(),
            observed_client: observed_client
                .parse()
                .with_context(|| format!("malformed address in answer {text:?}"))?,
        })
    }
}

/// One request/response with a service: the answer, and the addresses as the client saw them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Exchange {
    pub answer: Answer,
    /// The client socket's own port.
    pub client_port: u16,
    /// Where the reply came from. For TCP this is the connected peer: the kernel only
    /// completes a handshake whose SYN-ACK comes from the address it connected to. For UDP it
    /// is the source of the reply datagram, taken on an unconnected socket so that a reply
    /// from the wrong address is seen rather than filtered out.
    pub replied_from: SocketAddr,
}

impl Exchange {
    /// Checks that the service was transparent: the reply came from the frontend, and the
    /// backend saw the client's own address and port (no source NAT).
    pub fn verify(&self, frontend: Frontend, client: Ipv4Addr) -> Result<()> {
        ensure!(
            self.replied_from == frontend.socket_addr(),
            "reply from {} instead of {frontend} (answer {})",
            self.replied_from,
            self.answer
        );
        let client = SocketAddr::new(IpAddr::V4(client), self.client_port);
        ensure!(
            self.answer.observed_client == client,
            "{} saw the client as {} instead of {client}",
            self.answer.backend,
            self.answer.observed_client
        );
        Ok(())
    }
}

/// A TCP connection to an echo backend (usually through a frontend) that can be asked
/// again and again: the way to watch one established connection over time.
#[derive(Debug)]
pub struct TcpSession {
    reader: BufReader<TcpStream>,
}

impl TcpSession {
    /// Connects to `dst`; `timeout` bounds the connect and every later [`Self::ask`].
    pub fn connect(dst: SocketAddr, timeout: Duration) -> Result<Self> {
        let stream =
            TcpStream::connect_timeout(&dst, timeout).with_context(|| format!("cannot connect to {dst}"))?;
        stream.set_read_timeout(Some(timeout))?;
        stream.set_write_timeout(Some(timeout))?;
        stream.set_nodelay(true)?;
        Ok(Self { reader: BufReader::new(stream) })
    }

    pub fn ask(&mut self) -> Result<Answer> {
        let peer = self.peer_addr()?;
        self.reader
            .get_mut()
            .write_all(b"who are you?\n")
            .with_context(|| format!("cannot send to {peer}"))?;
        self.answer_line(peer)
    }

    /// Asks for `size` bytes before the answer (the echo protocol's `bytes N`): replies in
    /// segments as large as the path lets them be. Each read waits the session's timeout.
    pub fn ask_bulk(&mut self, size: usize) -> Result<Answer> {
        let peer = self.peer_addr()?;
        let request = format!("bytes {size}\n");
        self.reader
            .get_mut()
            .write_all(request.as_bytes())
            .with_context(|| format!("cannot send to {peer}"))?;
        let mut bulk = vec![0u8; size];
        let mut received = 0;
        while received < size {
            match self.reader.read(&mut bulk[received..]) {
                Ok(0) => bail!("{peer} closed the connection after {received} of {size} bytes"),
                Ok(read) => received += read,
                Err(error) => {
                    return Err(error)
                        .with_context(|| format!("{received} of {size} bytes from {peer}, then none"))
                }
            }
        }
        ensure!(bulk.iter().all(|&byte| byte == b'x'), "{peer} sent other bytes than asked for");
        self.answer_line(peer)
    }

    fn answer_line(&mut self, peer: SocketAddr) -> Result<Answer> {
        let mut line = String::new();
        let read = self.reader.read_line(&mut line).with_context(|| format!("no answer from {peer}"))?;
        if read == 0 {
            bail!("{peer} closed the connection");
        }
        line.parse()
    }

    pub fn local_addr(&self) -> Result<SocketAddr> {
        Ok(self.reader.get_ref().local_addr()?)
    }

    pub fn peer_addr(&self) -> Result<SocketAddr> {
        Ok(self.reader.get_ref().peer_addr()?)
    }
}

/// A fresh TCP connection to `dst`, one question, closed again.
pub fn tcp_exchange(dst: SocketAddr, timeout: Duration) -> Result<Exchange> {
    let mut session = TcpSession::connect(dst, timeout)?;
    Ok(Exchange {
        answer: session.ask()?,
        client_port: session.local_addr()?.port(),
        replied_from: session.peer_addr()?,
    })
}

/// One datagram to `dst` from a fresh socket, and its reply.
pub fn udp_exchange(dst: SocketAddr, timeout: Duration) -> Result<Exchange> {
    // The unspecified address of the destination's family.
    let any: IpAddr = if dst.is_ipv4() { Ipv4Addr::UNSPECIFIED.into() } else { Ipv6Addr::UNSPECIFIED.into() };
    let socket = UdpSocket::bind((any, 0))?;
    socket.set_read_timeout(Some(timeout))?;
    socket.send_to(b"who are you?", dst).with_context(|| format!("cannot send to {dst}"))?;
    let mut reply = [0u8; 1500];
    let (len, replied_from) =
        socket.recv_from(&mut reply).with_context(|| format!("no answer from {dst} within {timeout:?}"))?;
    Ok(Exchange {
        answer: std::str::from_utf8(&reply[..len]).context("answer is not UTF-8")?.parse()?,
        client_port: socket.local_addr()?.port(),
        replied_from,
    })
}

/// One datagram from `socket`, whose source port stays the same from one call to the next
/// (so the calls are one flow for conntrack and the load balancer), and the answer, which
/// must come from `to`.
pub fn udp_ask(socket: &UdpSocket, to: SocketAddr) -> Result<Answer> {
    socket.send_to(b"who are you?", to).with_context(|| format!("cannot send to {to}"))?;
    let mut reply = [0u8; 1500];
    let (len, from) = socket.recv_from(&mut reply).with_context(|| format!("no answer from {to}"))?;
    if from != to {
        bail!("answer from {from}, not {to}");
    }
    std::str::from_utf8(&reply[..len]).context("answer is not UTF-8")?.parse()
}

pub fn exchange(frontend: Frontend, timeout: Duration) -> Result<Exchange> {
    match frontend.protocol {
        Protocol::Tcp => tcp_exchange(frontend.socket_addr(), timeout),
        Protocol::Udp => udp_exchange(frontend.socket_addr(), timeout),
        // The SCTP tests have a client of their own (`sctp.rs`).
        Protocol::Sctp => anyhow::bail!("no echo exchange over SCTP ({frontend})"),
    }
}

/// `count` exchanges with `frontend` one after the other, each from a new socket (so each
/// is a new connection for the load balancer). Stops at the first failure.
pub fn exchanges(frontend: Frontend, count: usize, timeout: Duration) -> Result<Vec<Exchange>> {
    (0..count)
        .map(|i| exchange(frontend, timeout).with_context(|| format!("exchange {i} with {frontend}")))
        .collect()
}

/// How many of `exchanges` each backend answered.
pub fn count_by_backend<'a>(exchanges: impl IntoIterator<Item = &'a Exchange>) -> BTreeMap<String, usize> {
    let mut counts = BTreeMap::new();
    for exchange in exchanges {
        *counts.entry(exchange.answer.backend.clone()).or_default() += 1;
    }
    counts
}

/// Sets an int-valued socket option (`setsockopt`).
pub fn set_int_option(
    socket: RawFd,
    level: libc::c_int,
    option: libc::c_int,
    value: libc::c_int,
) -> io::Result<()> {
    // SAFETY: `value` is a valid c_int for the duration of the call and its size is passed.
    let set = unsafe {
        libc::setsockopt(
            socket,
            level,
            option,
            (&raw const value).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if set == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Reads an int-valued socket option (`getsockopt`).
pub fn int_option(socket: RawFd, level: libc::c_int, option: libc::c_int) -> io::Result<libc::c_int> {
    let mut value: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `value` and `len` are valid for the duration of the call; `len` holds its size.
    let got = unsafe { libc::getsockopt(socket, level, option, (&raw mut value).cast(), &mut len) };
    if got == 0 {
        Ok(value)
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_read_back_as_written() {
        let answer = Answer { backend: "b1".to_owned(), observed_client: "10.0.0.2:43210".parse().unwrap() };
        assert_eq!(format!("{answer}\n").parse::<Answer>().unwrap(), answer);
        assert!("b1".parse::<Answer>().is_err());
    }
}
