//! The e2e suite's traffic, with no namespace plumbing: small echo servers for the backends,
//! and closed-loop load generators that count transactions and time each one. Sockets are
//! created by the calling thread, so the caller decides the network namespace (see
//! `e2e.rs`, which runs these inside `Netns::run`; threads spawned from there inherit it).
//!
//! - TCP: every transaction is a new connection: connect, a 16-byte request, the reply,
//!   close. The client closes with `SO_LINGER` 0 (an RST), so neither side keeps a TIME_WAIT
//!   socket and the client's ports never run out however many connections a second it opens.
//!   The server closes right after its reply.
//! - UDP: every worker keeps one connected socket (one flow) and sends a datagram, waits for
//!   the reply, sends the next: established-flow packet forwarding, two packets through the
//!   node per transaction.

use std::{
    io::{ErrorKind, Read as _, Write as _},
    net::{Shutdown, SocketAddr, TcpListener, TcpStream, UdpSocket},
    os::fd::AsRawFd as _,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    thread::{self, JoinHandle},
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _, Result};
use socket2::SockRef;

use super::stats;

const REQUEST: &[u8; 16] = b"vipr-bench ping\n";
const REPLY: &[u8; 16] = b"vipr-bench pong\n";
/// How long one transaction may take before it counts as failed.
const TIMEOUT: Duration = Duration::from_millis(500);

/// TCP and UDP echo servers of one backend; stopped on drop. Each listener is served by
/// several threads that accept on it (no thread per connection: that would cost more than
/// the proxy being measured).
pub struct Servers {
    stop: Arc<AtomicBool>,
    /// The TCP listeners, shut down on drop to wake the threads in accept().
    fds: Vec<i32>,
    threads: Vec<JoinHandle<()>>,
    // Kept open until the threads are joined.
    _tcp: Vec<Arc<TcpListener>>,
    _udp: Vec<Arc<UdpSocket>>,
}

impl Servers {
    /// Binds `tcp` and `udp` (in the calling thread's namespace) and serves each with
    /// `threads` threads.
    pub fn start(tcp: &[SocketAddr], udp: &[SocketAddr], threads: usize) -> Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let mut servers = Self {
            stop: stop.clone(),
            fds: Vec::new(),
            threads: Vec::new(),
            _tcp: Vec::new(),
            _udp: Vec::new(),
        };
        for addr in tcp {
            let listener = Arc::new(TcpListener::bind(addr).with_context(|| format!("binding tcp {addr}"))?);
            servers.fds.push(listener.as_raw_fd());
            for _ in 0..threads {
                let (listener, stop) = (listener.clone(), stop.clone());
                servers.threads.push(thread::spawn(move || serve_tcp(&listener, &stop)));
            }
            servers._tcp.push(listener);
        }
        for addr in udp {
            let socket = Arc::new(UdpSocket::bind(addr).with_context(|| format!("binding udp {addr}"))?);
            // The threads see the stop within this. (No shutdown() for UDP: a recv_from woken
            // by it returns no address, which std's recv_from does not expect.)
            socket.set_read_timeout(Some(Duration::from_millis(200)))?;
            for _ in 0..threads {
                let (socket, stop) = (socket.clone(), stop.clone());
                servers.threads.push(thread::spawn(move || serve_udp(&socket, &stop)));
            }
            servers._udp.push(socket);
        }
        Ok(servers)
    }
}

impl Drop for Servers {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for &fd in &self.fds {
            // Wakes every thread blocked in accept() on it.
            // SAFETY: the descriptor is open (its socket is kept until after the joins).
            unsafe { libc::shutdown(fd, libc::SHUT_RDWR) };
        }
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

fn serve_tcp(listener: &TcpListener, stop: &AtomicBool) {
    let mut request = [0u8; 64];
    while !stop.load(Ordering::Relaxed) {
        let Ok((mut stream, _)) = listener.accept() else { continue };
        let _ = stream.set_nodelay(true);
        let _ = stream.set_read_timeout(Some(TIMEOUT));
        if matches!(stream.read(&mut request), Ok(n) if n > 0) {
            let _ = stream.write_all(REPLY);
        }
    }
}

fn serve_udp(socket: &UdpSocket, stop: &AtomicBool) {
    let mut request = [0u8; 64];
    while !stop.load(Ordering::Relaxed) {
        match socket.recv_from(&mut request) {
            Ok((0, _)) => {}
            Ok((_, peer)) => {
                let _ = socket.send_to(REPLY, peer);
            }
            Err(error)
                if matches!(
                    error.kind(),
                    ErrorKind::Interrupted | ErrorKind::WouldBlock | ErrorKind::TimedOut
                ) => {}
            Err(_) => return,
        }
    }
}

/// What the load is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Traffic {
    /// A new TCP connection per transaction.
    TcpConnect,
    /// Request/response datagrams over one flow per worker.
    UdpRequestResponse,
}

/// One run of the load generator.
#[derive(Clone, Copy, Debug)]
pub struct Outcome {
    /// Completed transactions per second.
    pub rate: f64,
    /// Latency of a transaction (TCP: connect to reply; UDP: round trip), in µs.
    pub p50_us: f64,
    pub p99_us: f64,
    pub transactions: u64,
    /// Transactions that failed (timeout, refused, reset before the reply).
    pub errors: u64,
}

/// Runs `workers` closed-loop clients against `target` for `duration`. Sockets are made by
/// the workers, which are spawned from the calling thread and so share its network
/// namespace.
pub fn run(traffic: Traffic, target: SocketAddr, workers: usize, duration: Duration) -> Result<Outcome> {
    let start = Instant::now();
    let deadline = start + duration;
    let per_worker: Vec<Result<(Vec<u32>, u64)>> = thread::scope(|scope| {
        let handles: Vec<_> = (0..workers)
            .map(|_| {
                scope.spawn(move || match traffic {
                    Traffic::TcpConnect => tcp_worker(target, deadline),
                    Traffic::UdpRequestResponse => udp_worker(target, deadline),
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|handle| handle.join().unwrap_or_else(|_| bail!("a load worker panicked")))
            .collect()
    });
    let elapsed = start.elapsed().as_secs_f64();
    let mut latencies: Vec<f64> = Vec::new();
    let mut errors = 0;
    for result in per_worker {
        let (worker_latencies, worker_errors) = result?;
        latencies.extend(worker_latencies.iter().map(|&ns| f64::from(ns) / 1e3));
        errors += worker_errors;
    }
    let transactions = latencies.len() as u64;
    if transactions == 0 {
        bail!("no transaction with {target} completed in {duration:?} ({errors} failed)");
    }
    latencies.sort_by(f64::total_cmp);
    Ok(Outcome {
        rate: transactions as f64 / elapsed,
        p50_us: stats::percentile(&latencies, 50.0).unwrap_or(f64::NAN),
        p99_us: stats::percentile(&latencies, 99.0).unwrap_or(f64::NAN),
        transactions,
        errors,
    })
}

/// Latencies in ns of the transactions that completed, and how many failed.
fn tcp_worker(target: SocketAddr, deadline: Instant) -> Result<(Vec<u32>, u64)> {
    let mut latencies = Vec::with_capacity(1 << 16);
    let mut errors = 0u64;
    let mut reply = [0u8; 64];
    while Instant::now() < deadline {
        let started = Instant::now();
        match tcp_transaction(target, &mut reply) {
            Ok(()) => latencies.push(elapsed_ns(started)),
            Err(_) => errors += 1,
        }
    }
    Ok((latencies, errors))
}

fn tcp_transaction(target: SocketAddr, reply: &mut [u8]) -> std::io::Result<()> {
    let mut stream = TcpStream::connect_timeout(&target, TIMEOUT)?;
    let socket = SockRef::from(&stream);
    // Close with an RST: no TIME_WAIT, so the port can be used again at once.
    socket.set_linger(Some(Duration::ZERO))?;
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(TIMEOUT))?;
    stream.write_all(REQUEST)?;
    let mut got = 0;
    while got < REPLY.len() {
        match stream.read(&mut reply[got..])? {
            0 => return Err(ErrorKind::UnexpectedEof.into()),
            n => got += n,
        }
    }
    drop(stream);
    Ok(())
}

fn udp_worker(target: SocketAddr, deadline: Instant) -> Result<(Vec<u32>, u64)> {
    let socket = UdpSocket::bind(("0.0.0.0", 0)).context("binding a udp client")?;
    socket.connect(target)?;
    socket.set_read_timeout(Some(TIMEOUT))?;
    let mut latencies = Vec::with_capacity(1 << 16);
    let mut errors = 0u64;
    let mut reply = [0u8; 64];
    while Instant::now() < deadline {
        let started = Instant::now();
        let ok = socket.send(REQUEST).is_ok() && matches!(socket.recv(&mut reply), Ok(n) if n == REPLY.len());
        if ok {
            latencies.push(elapsed_ns(started));
        } else {
            // A lost datagram; a late reply to it would be taken for the next one's, so
            // drain what arrives within a moment.
            errors += 1;
            let _ = socket.set_read_timeout(Some(Duration::from_millis(20)));
            while socket.recv(&mut reply).is_ok() {}
            socket.set_read_timeout(Some(TIMEOUT))?;
        }
    }
    let _ = SockRef::from(&socket).shutdown(Shutdown::Both);
    Ok((latencies, errors))
}

fn elapsed_ns(since: Instant) -> u32 {
    u32::try_from(since.elapsed().as_nanos()).unwrap_or(u32::MAX)
}

/// One transaction of `traffic` with `target`: the check that a path works before it is
/// measured.
pub fn probe(traffic: Traffic, target: SocketAddr) -> Result<()> {
    let mut reply = [0u8; 64];
    match traffic {
        Traffic::TcpConnect => {
            tcp_transaction(target, &mut reply).with_context(|| format!("tcp transaction with {target}"))
        }
        Traffic::UdpRequestResponse => {
            let socket = UdpSocket::bind(("0.0.0.0", 0))?;
            socket.connect(target)?;
            socket.set_read_timeout(Some(TIMEOUT))?;
            socket.send(REQUEST)?;
            let n = socket.recv(&mut reply).with_context(|| format!("no udp reply from {target}"))?;
            if &reply[..n] != REPLY {
                bail!("unexpected udp reply from {target}");
            }
            Ok(())
        }
    }
}
