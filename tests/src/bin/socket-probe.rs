//! One exchange with the echo protocol, as a process of its own: the tests start it where a
//! thread of the test process cannot be, inside a cgroup (the pods' one, for vipr's
//! socket-level balancing of pods) and a network namespace.
//!
//! `socket-probe tcp ADDR:PORT` connects and prints `peer <getpeername>` and the answer line;
//! `socket-probe udp ADDR:PORT` sends one datagram from an unconnected socket and prints
//! `peer <the reply's source as recvfrom reports it>` and the answer.
use std::{
    io::{BufRead as _, BufReader, Write as _},
    net::{Ipv4Addr, SocketAddr, TcpStream, UdpSocket},
    time::Duration,
};

use anyhow::{bail, Context as _, Result};

const TIMEOUT: Duration = Duration::from_secs(2);

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let (Some(transport), Some(target)) = (args.next(), args.next()) else {
        bail!("usage: socket-probe tcp|udp ADDR:PORT");
    };
    let target: SocketAddr = target.parse().context("ADDR:PORT")?;
    let (peer, answer) = match transport.as_str() {
        "tcp" => tcp(target)?,
        "udp" => udp(target)?,
        other => bail!("unknown transport {other}"),
    };
    println!("peer {peer}\n{}", answer.trim_end());
    Ok(())
}

fn tcp(target: SocketAddr) -> Result<(SocketAddr, String)> {
    let stream =
        TcpStream::connect_timeout(&target, TIMEOUT).with_context(|| format!("connecting to {target}"))?;
    stream.set_read_timeout(Some(TIMEOUT))?;
    let peer = stream.peer_addr()?;
    (&stream).write_all(b"who are you?\n")?;
    let mut answer = String::new();
    BufReader::new(&stream).read_line(&mut answer).context("reading the answer")?;
    Ok((peer, answer))
}

fn udp(target: SocketAddr) -> Result<(SocketAddr, String)> {
    let socket = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))?;
    socket.set_read_timeout(Some(TIMEOUT))?;
    socket.send_to(b"who are you?", target).with_context(|| format!("sending to {target}"))?;
    let mut buffer = [0u8; 512];
    let (length, from) = socket.recv_from(&mut buffer).with_context(|| format!("no answer from {target}"))?;
    Ok((from, String::from_utf8_lossy(&buffer[..length]).into_owned()))
}
