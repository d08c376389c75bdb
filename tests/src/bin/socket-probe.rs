//! One TCP exchange with the echo protocol, as a process of its own: the tests start it where
//! a thread of the test process cannot be, inside a cgroup (the pods' one, for vipr's
//! socket-level balancing of pods) and a network namespace.
//!
//! `socket-probe ADDR:PORT` prints `peer <getpeername>` and the answer line.
use std::{
    io::{BufRead as _, BufReader, Write as _},
    net::{SocketAddr, TcpStream},
    time::Duration,
};

use anyhow::{Context as _, Result};

fn main() -> Result<()> {
    let target: SocketAddr =
        std::env::args().nth(1).context("usage: socket-probe ADDR:PORT")?.parse().context("ADDR:PORT")?;
    let timeout = Duration::from_secs(2);
    let stream =
        TcpStream::connect_timeout(&target, timeout).with_context(|| format!("connecting to {target}"))?;
    stream.set_read_timeout(Some(timeout))?;
    let peer = stream.peer_addr()?;
    (&stream).write_all(b"who are you?\n")?;
    let mut answer = String::new();
    BufReader::new(&stream).read_line(&mut answer).context("reading the answer")?;
    println!("peer {peer}\n{}", answer.trim_end());
    Ok(())
}
