//! Backend servers that tell each client who answered and whom they saw.
//!
//! Protocol: every request (a line over TCP, a datagram over UDP) is answered with an
//! [`Answer`] (plus a newline over TCP): the server's name and the client address as the
//! backend observed it. A TCP line `bytes N` is answered with N bytes `x` before the answer:
//! replies larger than a path's MTU, for path MTU discovery through the load balancer.

use std::{
    io::{BufRead, BufReader, ErrorKind, Write},
    net::{SocketAddr, TcpListener, TcpStream, UdpSocket},
    os::fd::AsRawFd,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    thread::{self, JoinHandle},
    time::Duration,
};

use anyhow::{Context, Result};

use crate::{Answer, Netns};

/// How long a server thread blocks before it looks at the stop flag again.
const STOP_POLL: Duration = Duration::from_millis(50);

/// TCP and UDP echo servers of one backend, bound inside its namespace; stopped (all sockets
/// closed, all threads joined) on drop.
#[derive(Debug)]
pub struct EchoServer {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl EchoServer {
    /// Binds `tcp` and `udp` inside `netns` and serves them as `name`.
    pub fn start(netns: &Netns, name: &str, tcp: &[SocketAddr], udp: &[SocketAddr]) -> Result<Self> {
        let (listeners, sockets) = netns.run(|| {
            let listeners = tcp
                .iter()
                .map(|addr| TcpListener::bind(addr).with_context(|| format!("cannot bind tcp {addr}")))
                .collect::<Result<Vec<_>>>()?;
            let sockets = udp
                .iter()
                .map(|addr| UdpSocket::bind(addr).with_context(|| format!("cannot bind udp {addr}")))
                .collect::<Result<Vec<_>>>()?;
            Ok((listeners, sockets))
        })?;
        let stop = Arc::new(AtomicBool::new(false));
        let name: Arc<str> = name.into();
        let mut threads = Vec::new();
        for listener in listeners {
            let (name, stop) = (name.clone(), stop.clone());
            threads.push(thread::spawn(move || serve_tcp(&listener, &name, &stop)));
        }
        for socket in sockets {
            socket.set_read_timeout(Some(STOP_POLL))?;
            let (name, stop) = (name.clone(), stop.clone());
            threads.push(thread::spawn(move || serve_udp(&socket, &name, &stop)));
        }
        Ok(Self { stop, threads })
    }
}

impl Drop for EchoServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

fn answer(name: &str, peer: SocketAddr) -> String {
    Answer { backend: name.to_owned(), observed_client: peer }.to_string()
}

fn serve_tcp(listener: &TcpListener, name: &Arc<str>, stop: &Arc<AtomicBool>) {
    let mut connections: Vec<JoinHandle<()>> = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        match wait_readable(listener, STOP_POLL) {
            Ok(true) => {}
            Ok(false) => continue,
            Err(error) => {
                eprintln!("testbed: {name}: poll on listener failed: {error}");
                break;
            }
        }
        match listener.accept() {
            Ok((stream, peer)) => {
                let (name, stop) = (name.clone(), stop.clone());
                connections.retain(|connection| !connection.is_finished());
                connections.push(thread::spawn(move || serve_connection(stream, peer, &name, &stop)));
            }
            Err(error) => eprintln!("testbed: {name}: accept failed: {error}"),
        }
    }
    for connection in connections {
        let _ = connection.join();
    }
}

/// Answers each line of one connection until the client closes it or the server stops.
fn serve_connection(stream: TcpStream, peer: SocketAddr, name: &str, stop: &AtomicBool) {
    let reply = format!("{}\n", answer(name, peer));
    let Ok(mut writer) = stream.try_clone() else {
        return;
    };
    if stream.set_read_timeout(Some(STOP_POLL)).is_err() {
        return;
    }
    let mut reader = BufReader::new(stream);
    // A timed-out read keeps the part of a line it got in `line`; the next read appends.
    let mut line = String::new();
    while !stop.load(Ordering::Relaxed) {
        match reader.read_line(&mut line) {
            Ok(0) => return,
            Ok(_) if line.ends_with('\n') => {
                if let Some(bulk) = bulk_size(&line) {
                    if writer.write_all(&vec![b'x'; bulk]).is_err() {
                        return;
                    }
                }
                if writer.write_all(reply.as_bytes()).is_err() {
                    return;
                }
                line.clear();
            }
            Ok(_) => {}
            Err(error)
                if matches!(
                    error.kind(),
                    ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted
                ) => {}
            Err(_) => return,
        }
    }
}

/// The largest `bytes N` request served.
const MAX_BULK: usize = 16 << 20;

/// N of a `bytes N` request line, up to [`MAX_BULK`].
fn bulk_size(line: &str) -> Option<usize> {
    line.trim_end().strip_prefix("bytes ")?.parse().ok().filter(|&size| size <= MAX_BULK)
}

fn serve_udp(socket: &UdpSocket, name: &str, stop: &AtomicBool) {
    let mut request = [0u8; 1500];
    while !stop.load(Ordering::Relaxed) {
        match socket.recv_from(&mut request) {
            Ok((_, peer)) => {
                if let Err(error) = socket.send_to(answer(name, peer).as_bytes(), peer) {
                    eprintln!("testbed: {name}: cannot answer {peer}: {error}");
                }
            }
            Err(error)
                if matches!(
                    error.kind(),
                    ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted
                ) => {}
            Err(error) => {
                eprintln!("testbed: {name}: udp receive failed: {error}");
                return;
            }
        }
    }
}

/// Waits up to `timeout` for `socket` to become readable (for a listener: to have a
/// connection to accept; for a socket with IP_RECVERR, also when an error is queued).
pub(crate) fn wait_readable(socket: &impl AsRawFd, timeout: Duration) -> std::io::Result<bool> {
    let mut poll = libc::pollfd { fd: socket.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    // At least 1 ms: a timeout that rounds to 0 would make poll return at once.
    let timeout_ms = libc::c_int::try_from(timeout.as_millis().max(1)).unwrap_or(libc::c_int::MAX);
    // SAFETY: `poll` points to one valid pollfd for the duration of the call.
    match unsafe { libc::poll(&mut poll, 1, timeout_ms) } {
        -1 => {
            let error = std::io::Error::last_os_error();
            if error.kind() == ErrorKind::Interrupted {
                Ok(false)
            } else {
                Err(error)
            }
        }
        0 => Ok(false),
        _ => Ok(true),
    }
}
