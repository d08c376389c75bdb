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
//! - The packet stream: open loop, no replies. A sender pushes small datagrams over a few
//!   flows with `sendmmsg` as fast as the kernel takes them; [`Sink`]s at the backends count
//!   what arrives with `recvmmsg`. Closed-loop transactions measure latency more than the
//!   node's forwarding; this measures how many packets per second the node forwards.
//! - The frame stream: the same datagrams as ready-made Ethernet frames, injected into the
//!   external client's veth by an XDP generator (BPF_PROG_TEST_RUN in live-frame mode), so
//!   the node receives them as it would from a NIC's driver: a page, no skb, and no sending
//!   socket's cost on the CPU both share.

use std::{
    io::{ErrorKind, Read as _, Write as _},
    net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream, UdpSocket},
    os::fd::AsRawFd as _,
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
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

// ---------------------------------------------------------------------------------------------
// The packet stream.

/// Datagrams per `sendmmsg` / `recvmmsg` call: enough that the system call's own cost is
/// small beside the packets' (what is measured is the path, not the syscall).
const BATCH: usize = 64;

/// Counts the datagrams that arrive on one UDP socket, with one thread; stopped on drop.
pub struct Sink {
    stop: Arc<AtomicBool>,
    received: Arc<AtomicU64>,
    /// The thread's id, for its CPU time.
    tid: Arc<AtomicU64>,
    thread: Option<JoinHandle<()>>,
}

impl Sink {
    /// Binds `addr` in the calling thread's namespace.
    pub fn start(addr: SocketAddr) -> Result<Self> {
        let socket = UdpSocket::bind(addr).with_context(|| format!("binding udp {addr}"))?;
        // A burst the thread has not drained yet waits in the buffer instead of being dropped:
        // the count should say what the node delivered, not how often this thread was
        // scheduled. FORCE: rmem_max would cap a plain SO_RCVBUF (root may exceed it).
        let size: libc::c_int = 16 << 20;
        // SAFETY: the option value is a c_int of the size given.
        let set = unsafe {
            libc::setsockopt(
                socket.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVBUFFORCE,
                (&size as *const libc::c_int).cast(),
                size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if set != 0 {
            return Err(std::io::Error::last_os_error()).context("SO_RCVBUFFORCE on a sink");
        }
        // The thread sees the stop within this.
        socket.set_read_timeout(Some(Duration::from_millis(200)))?;
        let stop = Arc::new(AtomicBool::new(false));
        let received = Arc::new(AtomicU64::new(0));
        let tid = Arc::new(AtomicU64::new(0));
        let thread = {
            let (stop, received, tid) = (stop.clone(), received.clone(), tid.clone());
            thread::spawn(move || {
                // SAFETY: no preconditions.
                tid.store(unsafe { libc::gettid() } as u64, Ordering::Relaxed);
                drain(&socket, &stop, &received)
            })
        };
        Ok(Self { stop, received, tid, thread: Some(thread) })
    }

    /// Datagrams received since the start.
    pub fn received(&self) -> u64 {
        self.received.load(Ordering::Relaxed)
    }

    /// CPU time of the sink's thread so far, in ns (0 before it has started).
    pub fn cpu_ns(&self) -> u64 {
        match self.tid.load(Ordering::Relaxed) {
            0 => 0,
            tid => task_cpu_ns(&format!("/proc/self/task/{tid}/schedstat")).unwrap_or(0),
        }
    }
}

/// The first field of a schedstat file: time on a CPU, in ns.
pub fn task_cpu_ns(path: &str) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.split_whitespace().next()?.parse().ok()
}

/// CPU time of the calling thread, in ns. Softirq work the kernel does at the end of this
/// thread's system calls (a veth's receive processing, when the sender's CPU raised it)
/// counts here too.
fn thread_cpu_ns() -> u64 {
    let mut now = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid timespec to write into.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut now) };
    now.tv_sec as u64 * 1_000_000_000 + now.tv_nsec as u64
}

impl Drop for Sink {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// `BATCH` message headers, each with its own buffer of `size` bytes (the kernel fills
/// `msg_len` in, and for receiving writes into the buffers). The raw pointers point into
/// `buffers` and `iovecs`, which are heap allocations kept alive (and never moved) with them.
struct Batch {
    headers: Vec<libc::mmsghdr>,
    _iovecs: Vec<libc::iovec>,
    _buffers: Vec<Vec<u8>>,
}

impl Batch {
    fn new(fill: &[u8], size: usize) -> Self {
        let mut buffers: Vec<Vec<u8>> = (0..BATCH)
            .map(|_| {
                let mut buffer = fill.to_vec();
                buffer.resize(size.max(fill.len()), 0);
                buffer
            })
            .collect();
        let mut iovecs: Vec<libc::iovec> = buffers
            .iter_mut()
            .map(|buffer| libc::iovec { iov_base: buffer.as_mut_ptr().cast(), iov_len: buffer.len() })
            .collect();
        let headers = iovecs
            .iter_mut()
            .map(|iovec| {
                // SAFETY: all-zero is a valid msghdr (no name, no control data).
                let mut header: libc::mmsghdr = unsafe { std::mem::zeroed() };
                header.msg_hdr.msg_iov = iovec;
                header.msg_hdr.msg_iovlen = 1;
                header
            })
            .collect();
        Self { headers, _iovecs: iovecs, _buffers: buffers }
    }
}

fn drain(socket: &UdpSocket, stop: &AtomicBool, received: &AtomicU64) {
    let mut batch = Batch::new(&[], 64);
    while !stop.load(Ordering::Relaxed) {
        // MSG_WAITFORONE: block (up to the read timeout) for the first datagram only, then
        // take whatever else is queued.
        // SAFETY: the headers point at live buffers of the lengths they say.
        let n = unsafe {
            libc::recvmmsg(
                socket.as_raw_fd(),
                batch.headers.as_mut_ptr(),
                BATCH as libc::c_uint,
                libc::MSG_WAITFORONE,
                std::ptr::null_mut(),
            )
        };
        if n > 0 {
            received.fetch_add(n as u64, Ordering::Relaxed);
        } else if n < 0 {
            let error = std::io::Error::last_os_error();
            if !matches!(error.kind(), ErrorKind::Interrupted | ErrorKind::WouldBlock | ErrorKind::TimedOut) {
                return;
            }
        }
    }
}

/// What one run of the stream sender did.
#[derive(Clone, Copy, Debug)]
pub struct Sent {
    /// Datagrams the kernel accepted (`sendmmsg`'s count): what reached the sender's device.
    pub datagrams: u64,
    pub seconds: f64,
    /// CPU time of the sending threads, in ns.
    pub cpu_ns: u64,
}

/// Sends 16-byte datagrams to `target` for `duration` from `senders` threads over `flows`
/// connected sockets (flows are spread over the backends by the proxy), in batches of
/// `BATCH` per `sendmmsg`, without waiting for anything.
pub fn stream(target: SocketAddr, flows: usize, senders: usize, duration: Duration) -> Result<Sent> {
    let sockets = (0..flows.max(senders))
        .map(|_| {
            let socket = UdpSocket::bind(("0.0.0.0", 0)).context("binding a stream socket")?;
            socket.connect(target)?;
            Ok(socket)
        })
        .collect::<Result<Vec<_>>>()?;
    let start = Instant::now();
    let deadline = start + duration;
    let (sent, cpu_ns) = thread::scope(|scope| {
        let handles: Vec<_> = sockets
            .chunks(sockets.len().div_ceil(senders.max(1)))
            .map(|mine| {
                scope.spawn(move || {
                    let cpu = thread_cpu_ns();
                    let sent = send_until(mine, deadline);
                    (sent, thread_cpu_ns() - cpu)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|handle| handle.join().unwrap_or((0, 0)))
            .fold((0, 0), |(sent, cpu), (s, c)| (sent + s, cpu + c))
    });
    let seconds = start.elapsed().as_secs_f64();
    if sent == 0 {
        bail!("the stream sender could send nothing to {target}");
    }
    Ok(Sent { datagrams: sent, seconds, cpu_ns })
}

fn send_until(sockets: &[UdpSocket], deadline: Instant) -> u64 {
    let mut batch = Batch::new(REQUEST, REQUEST.len());
    let mut sent = 0u64;
    // Round robin over this thread's flows, one batch each.
    for socket in sockets.iter().cycle() {
        if Instant::now() >= deadline {
            break;
        }
        // SAFETY: the headers point at live buffers of the lengths they say; the sockets are
        // connected, so no names.
        let n = unsafe {
            libc::sendmmsg(socket.as_raw_fd(), batch.headers.as_mut_ptr(), BATCH as libc::c_uint, 0)
        };
        // Errors (ENOBUFS when a queue is full, ECONNREFUSED after an ICMP error) are the
        // path's losses, not the sender's: keep sending.
        if n > 0 {
            sent += n as u64;
        }
    }
    sent
}

// ---------------------------------------------------------------------------------------------
// Frames injected as a NIC hands them over.

/// An Ethernet frame carrying a 16-byte UDP datagram from `src` to `dst`, with complete IPv4
/// and UDP checksums, or IPv6's UDP checksum (what a NIC receives off the wire); an error for
/// addresses of two families.
pub fn udp_frame(src_mac: [u8; 6], dst_mac: [u8; 6], src: SocketAddr, dst: SocketAddr) -> Result<Vec<u8>> {
    let payload = REQUEST;
    let udp_len = 8 + payload.len();
    let mut udp = [0u8; 8];
    udp[0..2].copy_from_slice(&src.port().to_be_bytes());
    udp[2..4].copy_from_slice(&dst.port().to_be_bytes());
    udp[4..6].copy_from_slice(&(udp_len as u16).to_be_bytes());
    // The network header, and the pseudo header the UDP checksum covers.
    let (ethertype, ip, pseudo): (u16, Vec<u8>, Vec<u8>) = match (src.ip(), dst.ip()) {
        (IpAddr::V4(src), IpAddr::V4(dst)) => {
            let mut ip = [0u8; 20];
            ip[0] = 0x45;
            ip[2..4].copy_from_slice(&((20 + udp_len) as u16).to_be_bytes());
            ip[6] = 0x40; // DF
            ip[8] = 64;
            ip[9] = 17;
            ip[12..16].copy_from_slice(&src.octets());
            ip[16..20].copy_from_slice(&dst.octets());
            let ip_csum = checksum(&[&ip]);
            ip[10..12].copy_from_slice(&ip_csum.to_be_bytes());
            let mut pseudo = [0u8; 12];
            pseudo[0..4].copy_from_slice(&src.octets());
            pseudo[4..8].copy_from_slice(&dst.octets());
            pseudo[9] = 17;
            pseudo[10..12].copy_from_slice(&(udp_len as u16).to_be_bytes());
            (0x0800, ip.to_vec(), pseudo.to_vec())
        }
        (IpAddr::V6(src), IpAddr::V6(dst)) => {
            let mut ip = [0u8; 40];
            ip[0] = 0x60;
            ip[4..6].copy_from_slice(&(udp_len as u16).to_be_bytes());
            ip[6] = 17; // next header: UDP
            ip[7] = 64; // hop limit
            ip[8..24].copy_from_slice(&src.octets());
            ip[24..40].copy_from_slice(&dst.octets());
            let mut pseudo = [0u8; 40];
            pseudo[0..16].copy_from_slice(&src.octets());
            pseudo[16..32].copy_from_slice(&dst.octets());
            pseudo[34..36].copy_from_slice(&(udp_len as u16).to_be_bytes());
            pseudo[39] = 17;
            (0x86dd, ip.to_vec(), pseudo.to_vec())
        }
        _ => bail!("no frame from {src} to {dst}: the addresses are of two families"),
    };
    let udp_csum = match checksum(&[&pseudo, &udp, payload]) {
        0 => 0xffff,
        sum => sum,
    };
    udp[6..8].copy_from_slice(&udp_csum.to_be_bytes());
    let mut frame = Vec::with_capacity(14 + ip.len() + udp_len);
    frame.extend_from_slice(&dst_mac);
    frame.extend_from_slice(&src_mac);
    frame.extend_from_slice(&ethertype.to_be_bytes());
    frame.extend_from_slice(&ip);
    frame.extend_from_slice(&udp);
    frame.extend_from_slice(payload);
    Ok(frame)
}

/// The Internet checksum of the concatenated parts (each of even length but the last).
fn checksum(parts: &[&[u8]]) -> u16 {
    let mut sum = 0u32;
    for part in parts {
        for pair in part.chunks(2) {
            sum += u32::from(u16::from_be_bytes([pair[0], *pair.get(1).unwrap_or(&0)]));
        }
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

const BPF_PROG_TYPE_XDP: u32 = 6;
const BPF_F_TEST_XDP_LIVE_FRAMES: u32 = 1 << 1;
/// Frames per BPF_PROG_TEST_RUN (~0.1 s): every call sets up and tears down a page pool and
/// an XDP memory model, which sleeps (RCU grace periods): with a few thousand frames per call
/// the generator spent most of its time asleep, not generating.
const FRAMES_PER_RUN: u32 = 1 << 16;
/// Frames per batch in live-frame mode, the kernel's most (TEST_XDP_MAX_BATCH). The
/// generator's page pool holds one batch: frames still on their way through the node and in
/// the sinks' queues when it wants more are new pages, initialised anew.
const LIVE_BATCH: u32 = 256;

/// An XDP program that writes `frame`'s headers into the packet and redirects it out of
/// `ifindex` (raw instructions, so the suite needs no BPF object of its own). Writing the
/// headers every time is needed: in live-frame mode the kernel recycles the frame's page
/// without restoring its data, and the node's NAT rewrote them on the way.
fn load_generator(frame: &[u8], ifindex: u32) -> Result<std::os::fd::OwnedFd> {
    // Ethernet, then IPv4 without options or IPv6 without extension headers, then UDP.
    let headers = match frame.get(12..14) {
        Some([0x86, 0xdd]) => 14 + 40 + 8,
        _ => 14 + 20 + 8,
    };
    anyhow::ensure!(frame.len() >= headers, "a frame of {} bytes has no UDP header", frame.len());
    let insn = |code: u8, dst: u8, src: u8, off: i16, imm: i32| -> u64 {
        u64::from(code)
            | (u64::from(dst & 0xf) << 8)
            | (u64::from(src & 0xf) << 12)
            | (u64::from(off as u16) << 16)
            | (u64::from(imm as u32) << 32)
    };
    let mut insns = vec![
        insn(0x61, 2, 1, 0, 0),              // r2 = ctx->data
        insn(0x61, 3, 1, 4, 0),              // r3 = ctx->data_end
        insn(0xbf, 4, 2, 0, 0),              // r4 = r2
        insn(0x07, 4, 0, 0, headers as i32), // r4 += headers
        0,                                   // if r4 > r3 goto drop (offset filled in below)
    ];
    let check = insns.len() - 1;
    // The headers in 8-byte stores, then what is left in 4- and 2-byte ones (both lengths
    // are even).
    let whole = headers / 8 * 8;
    for (i, chunk) in frame[..whole].chunks(8).enumerate() {
        let value = u64::from_le_bytes(chunk.try_into().expect("8 bytes"));
        insns.push(insn(0x18, 5, 0, 0, value as u32 as i32)); // r5 = value (ld_imm64, low half)
        insns.push(insn(0, 0, 0, 0, (value >> 32) as u32 as i32)); // (high half)
        insns.push(insn(0x7b, 2, 5, (i * 8) as i16, 0)); // *(u64 *)(r2 + 8i) = r5
    }
    let mut at = whole;
    if headers - at >= 4 {
        let value = i32::from_le_bytes(frame[at..at + 4].try_into().expect("4 bytes"));
        insns.push(insn(0x62, 2, 0, at as i16, value)); // *(u32 *)(r2 + at) = value
        at += 4;
    }
    if headers - at == 2 {
        let value = i32::from(u16::from_le_bytes([frame[at], frame[at + 1]]));
        insns.push(insn(0x6a, 2, 0, at as i16, value)); // *(u16 *)(r2 + at) = value
    }
    insns.push(insn(0xb7, 1, 0, 0, ifindex as i32)); // r1 = ifindex
    insns.push(insn(0xb7, 2, 0, 0, 0)); // r2 = 0
    insns.push(insn(0x85, 0, 0, 0, 23)); // call bpf_redirect
    insns.push(insn(0x95, 0, 0, 0, 0)); // exit
    let drop = insns.len();
    insns.push(insn(0xb7, 0, 0, 0, 1)); // drop: r0 = XDP_DROP
    insns.push(insn(0x95, 0, 0, 0, 0)); // exit
    insns[check] = insn(0x2d, 4, 3, (drop - check - 1) as i16, 0);
    let license = c"GPL";
    let mut name = [0u8; 16];
    name[..13].copy_from_slice(b"bench_xdp_gen");
    let mut attr = vipr::bpf_sys::ProgLoadAttr {
        prog_type: BPF_PROG_TYPE_XDP,
        insn_cnt: insns.len() as u32,
        insns: insns.as_ptr() as u64,
        license: license.as_ptr() as u64,
        prog_name: name,
        ..Default::default()
    };
    // SAFETY: the instructions, license and name outlive the call.
    let fd = unsafe { vipr::bpf_sys::bpf(vipr::bpf_sys::cmd::PROG_LOAD, &mut attr) }
        .and_then(vipr::bpf_sys::owned_fd);
    fd.context("loading the frame generator (XDP)")
}

/// Injects `frames` (one per flow, taking turns) for `duration` out of the device `ifindex`
/// of the calling thread's namespace, as its peer receives frames from a NIC's driver: no skb
/// until someone builds one. BPF_PROG_TEST_RUN in live-frame mode (Linux 5.18) runs a
/// generator program over batches of page-pool frames and transmits what it redirects.
pub fn inject(frames: &[Vec<u8>], ifindex: u32, duration: Duration) -> Result<Sent> {
    let generators = frames
        .iter()
        .map(|frame| Ok((load_generator(frame, ifindex)?, frame)))
        .collect::<Result<Vec<_>>>()?;
    let start = Instant::now();
    let cpu = thread_cpu_ns();
    let deadline = start + duration;
    let mut sent = 0u64;
    for (program, frame) in generators.iter().cycle() {
        if Instant::now() >= deadline {
            break;
        }
        let mut attr = vipr::bpf_sys::TestRunAttr {
            prog_fd: program.as_raw_fd() as u32,
            data_size_in: frame.len() as u32,
            data_in: frame.as_ptr() as u64,
            repeat: FRAMES_PER_RUN,
            flags: BPF_F_TEST_XDP_LIVE_FRAMES,
            batch_size: LIVE_BATCH,
            ..vipr::bpf_sys::TestRunAttr::default()
        };
        // SAFETY: the frame outlives the call; live mode takes no output buffers.
        unsafe { vipr::bpf_sys::bpf(vipr::bpf_sys::cmd::PROG_TEST_RUN, &mut attr) }
            .context("BPF_PROG_TEST_RUN in live-frame mode")?;
        sent += u64::from(FRAMES_PER_RUN);
    }
    Ok(Sent { datagrams: sent, seconds: start.elapsed().as_secs_f64(), cpu_ns: thread_cpu_ns() - cpu })
}
