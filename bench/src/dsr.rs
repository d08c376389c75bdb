//! `vipr-bench dsr` (issue 16): a NodePort through one node of the multi-node lab
//! (`testbed::cluster`) to pods on the two other nodes, with `--lb-mode=snat` against
//! `--lb-mode=dsr`, measured in alternating rounds of the same run.
//!
//! What it reports per mode (medians over the rounds):
//! - TCP connections/s (connect, one request and its answer, close) and UDP transactions/s
//!   (one datagram and its answer at a time) from the external client through the ingress
//!   node, one client thread each;
//! - stream throughput: one TCP connection through the ingress node on which the pod sends
//!   as fast as it can (a download, where DSR matters most: the data leaves the pod's node
//!   straight to the client);
//! - what the ingress node carried per transaction (per MB of the stream): packets through its uplink (received and
//!   sent), and its vipr TC program's runs and run time (`BPF_ENABLE_STATS`; each node's vipr
//!   loads programs of its own, so the counts are the ingress node's). With DSR the answers
//!   leave the backends' nodes straight to the client, so the ingress node carries the
//!   requests alone.
//!
//! Every node of the lab shares this machine's CPUs, so the node's CPU is stated as the work
//! only it does (its program's run time and its packets), not as a share of a CPU.
//!
//! `--family ipv6` runs the same through the dual-stack lab to the node's and pods' IPv6
//! addresses, where DSR carries the service address in a destination-options header.

use std::{
    io::{self, Read as _, Write as _},
    net::{IpAddr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, UdpSocket},
    path::Path,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use anyhow::{bail, ensure, Context as _, Result};
use serde::Serialize;
use serde_json::json;
use testbed::{
    cluster::{udp_socket_for, ClusterLab},
    tcp_exchange, wait_for, Check, Netns,
};

use crate::stats::Summary;

const POD_PORT: u16 = 8080;
const NODE_PORT: u16 = 30090;
/// The pods' bulk senders, and the Service's NodePort to them.
const STREAM_POD_PORT: u16 = 8081;
const STREAM_NODE_PORT: u16 = 30091;
const INGRESS: usize = 1;
const ASK: Duration = Duration::from_secs(1);
/// The Service's cluster IPs (inside the lab's service ranges).
const CLUSTER_IP: &str = "10.96.0.90";
const CLUSTER_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x90);

pub struct Settings {
    /// Seconds of each measurement (TCP and UDP each, per round and mode).
    pub seconds: u64,
    pub rounds: usize,
    pub family: Family,
}

/// The address family of the client's traffic.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Family {
    Ipv4,
    Ipv6,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LbMode {
    Snat,
    Dsr,
}

impl LbMode {
    fn flag(self) -> &'static str {
        match self {
            Self::Snat => "--lb-mode=snat",
            Self::Dsr => "--lb-mode=dsr",
        }
    }
}

/// One traffic kind through the ingress node, in one round.
#[derive(Clone, Copy, Debug, Default, Serialize)]
struct Window {
    transactions: u64,
    errors: u64,
    seconds: f64,
    /// The ingress node's uplink: packets received and sent.
    uplink_packets: u64,
    tc_runs: u64,
    tc_run_ns: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct Traffic {
    /// Transactions per second.
    pub rate: Summary,
    pub errors: u64,
    /// Per transaction, on the ingress node.
    pub uplink_packets: Summary,
    pub tc_runs: Summary,
    pub tc_ns: Summary,
}

/// The stream through the ingress node, in one round.
#[derive(Clone, Copy, Debug, Default, Serialize)]
struct StreamWindow {
    bytes: u64,
    seconds: f64,
    uplink_packets: u64,
    tc_runs: u64,
    tc_run_ns: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct Stream {
    /// Megabytes (10^6 bytes) per second the client received.
    pub mbytes_per_s: Summary,
    /// Per megabyte received, on the ingress node.
    pub uplink_packets: Summary,
    pub tc_runs: Summary,
    pub tc_ns: Summary,
}

#[derive(Clone, Debug, Serialize)]
pub struct ModeResult {
    pub mode: LbMode,
    pub tcp: Traffic,
    pub udp: Traffic,
    pub stream: Stream,
}

#[derive(Clone, Debug, Serialize)]
pub struct Results {
    pub seconds: u64,
    pub rounds: usize,
    pub family: Family,
    pub modes: Vec<ModeResult>,
}

pub fn run(settings: &Settings) -> Result<Results> {
    ensure!(settings.rounds > 0 && settings.seconds > 0, "nothing to measure");
    // Run statistics for the programs' run time, released when the suite ends (the
    // kernel.bpf_stats_enabled sysctl is never changed).
    let _stats = aya::sys::enable_stats(aya::sys::Stats::RunTime).context("BPF_ENABLE_STATS")?;
    let modes = [LbMode::Snat, LbMode::Dsr];
    let mut windows: Vec<(Vec<Window>, Vec<Window>, Vec<StreamWindow>)> =
        modes.iter().map(|_| (Vec::new(), Vec::new(), Vec::new())).collect();
    for round in 0..settings.rounds {
        // Which mode goes first alternates, so neither always meets the machine's same phase.
        let order: Vec<usize> = if round % 2 == 0 { vec![0, 1] } else { vec![1, 0] };
        for index in order {
            let mode = modes[index];
            eprintln!("dsr: round {}/{}, {mode:?}", round + 1, settings.rounds);
            let (tcp, udp, stream) = measure_mode(mode, settings)?;
            eprintln!("  tcp {tcp:?}\n  udp {udp:?}\n  stream {stream:?}");
            windows[index].0.push(tcp);
            windows[index].1.push(udp);
            windows[index].2.push(stream);
        }
    }
    let modes = modes
        .iter()
        .zip(windows)
        .map(|(&mode, (tcp, udp, stream))| {
            Ok(ModeResult {
                mode,
                tcp: summarize(&tcp)?,
                udp: summarize(&udp)?,
                stream: summarize_stream(&stream)?,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Results { seconds: settings.seconds, rounds: settings.rounds, family: settings.family, modes })
}

fn summarize(windows: &[Window]) -> Result<Traffic> {
    let per = |f: fn(&Window) -> u64| -> Result<Summary> {
        let values: Vec<f64> = windows.iter().map(|w| f(w) as f64 / (w.transactions.max(1)) as f64).collect();
        Summary::of(&values).context("no rounds")
    };
    Ok(Traffic {
        rate: Summary::of(&windows.iter().map(|w| w.transactions as f64 / w.seconds).collect::<Vec<_>>())
            .context("no rounds")?,
        errors: windows.iter().map(|w| w.errors).sum(),
        uplink_packets: per(|w| w.uplink_packets)?,
        tc_runs: per(|w| w.tc_runs)?,
        tc_ns: per(|w| w.tc_run_ns)?,
    })
}

fn summarize_stream(windows: &[StreamWindow]) -> Result<Stream> {
    let per_mb = |f: fn(&StreamWindow) -> u64| -> Result<Summary> {
        let values: Vec<f64> = windows.iter().map(|w| f(w) as f64 / (w.bytes.max(1) as f64 / 1e6)).collect();
        Summary::of(&values).context("no rounds")
    };
    Ok(Stream {
        mbytes_per_s: Summary::of(
            &windows.iter().map(|w| w.bytes as f64 / 1e6 / w.seconds).collect::<Vec<_>>(),
        )
        .context("no rounds")?,
        uplink_packets: per_mb(|w| w.uplink_packets)?,
        tc_runs: per_mb(|w| w.tc_runs)?,
        tc_ns: per_mb(|w| w.tc_run_ns)?,
    })
}

/// A fresh lab in `mode`: three nodes with a pod each, the NodePort's endpoints on the two
/// nodes that are not the ingress node; dual-stack for IPv6.
fn measure_mode(mode: LbMode, settings: &Settings) -> Result<(Window, Window, StreamWindow)> {
    let ipv6 = settings.family == Family::Ipv6;
    let mut lab = if ipv6 {
        ClusterLab::new_dual_stack("bdsr", 3, 1, &[POD_PORT])?
    } else {
        ClusterLab::new("bdsr", 3, 1, &[POD_PORT])?
    };
    // Stopped (dropped) before the lab: declared after it.
    let _sources = [2, 3]
        .map(|node: usize| {
            let pod = &lab.nodes[node - 1].pods[0];
            let ip: IpAddr = if ipv6 {
                pod.ip6.context("a dual-stack pod has an IPv6 address")?.into()
            } else {
                pod.ip.into()
            };
            StreamSource::start(&pod.netns, SocketAddr::new(ip, STREAM_POD_PORT))
        })
        .into_iter()
        .collect::<Result<Vec<_>>>()?;
    let service = json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "far", "namespace": "default"},
        "spec": {
            "type": "NodePort",
            "clusterIP": CLUSTER_IP,
            "clusterIPs": [CLUSTER_IP],
            "ports": [
                {"name": "tcp", "port": 80, "protocol": "TCP", "targetPort": POD_PORT, "nodePort": NODE_PORT},
                {"name": "udp", "port": 80, "protocol": "UDP", "targetPort": POD_PORT, "nodePort": NODE_PORT},
                {"name": "stream", "port": 81, "protocol": "TCP", "targetPort": STREAM_POD_PORT, "nodePort": STREAM_NODE_PORT},
            ],
        },
    });
    let target_ports =
        [("tcp", POD_PORT, "TCP"), ("udp", POD_PORT, "UDP"), ("stream", STREAM_POD_PORT, "TCP")];
    let endpoints = [(2, 0), (3, 0)];
    if ipv6 {
        lab.apply_dual_stack_service(service, CLUSTER_IP6, &target_ports, &endpoints)?;
    } else {
        lab.apply_service(service, &target_ports, &endpoints)?;
    }
    lab.start_vipr(&[mode.flag()])?;
    let node_address = if ipv6 { ClusterLab::node_address6 } else { ClusterLab::node_address };
    let target = node_address(INGRESS, NODE_PORT);
    wait_for(&format!("{mode:?}: an answer through {target}"), Duration::from_secs(30), || {
        Ok(match lab.client.run(|| tcp_exchange(target, ASK)) {
            Ok(_) => Check::Done(()),
            Err(error) => Check::NotYet(format!("{error:#}")),
        })
    })?;
    let program = tc_program(lab.nodes[INGRESS - 1].bpf_root(), "eth0")?;
    let duration = Duration::from_secs(settings.seconds);
    let tcp = window(&lab, program, duration, |client_ok| {
        client_ok(tcp_exchange(target, ASK).is_ok());
    })?;
    let udp = lab.client.run(|| udp_socket_for(target))?;
    let udp = window(&lab, program, duration, |client_ok| {
        client_ok(udp_ask(&udp, target).is_ok());
    })?;
    let stream = stream_window(&lab, program, duration, node_address(INGRESS, STREAM_NODE_PORT))?;
    Ok((tcp, udp, stream))
}

/// A pod's bulk sender: every connection accepted on its address gets zeros as fast as the
/// connection takes them, until the client closes it or the source stops.
struct StreamSource {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl StreamSource {
    fn start(netns: &Netns, addr: SocketAddr) -> Result<Self> {
        // A socket stays in the namespace it was made in, whichever thread then serves it.
        let listener = netns.run(|| TcpListener::bind(addr).with_context(|| format!("binding {addr}")))?;
        listener.set_nonblocking(true)?;
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut senders = Vec::new();
            while !stopping.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((connection, _)) => {
                        let stopping = stopping.clone();
                        senders.push(std::thread::spawn(move || send_until_closed(connection, &stopping)));
                    }
                    // Polled: the source must notice that it is to stop.
                    Err(error) if error.kind() == io::ErrorKind::WouldBlock => {
                        std::thread::sleep(Duration::from_millis(20))
                    }
                    Err(_) => break,
                }
            }
            for sender in senders {
                let _ = sender.join();
            }
        });
        Ok(Self { stop, thread: Some(thread) })
    }
}

fn send_until_closed(mut connection: TcpStream, stopping: &AtomicBool) {
    let chunk = vec![0u8; 64 * 1024];
    if connection.set_write_timeout(Some(Duration::from_millis(200))).is_err() {
        return;
    }
    while !stopping.load(Ordering::Relaxed) {
        match connection.write(&chunk) {
            Ok(0) => return,
            Ok(_) => {}
            Err(error) if matches!(error.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {}
            Err(_) => return,
        }
    }
}

impl Drop for StreamSource {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// One TCP connection from the client to `to`, read for `duration`, with the ingress node's
/// counters read before and after.
fn stream_window(lab: &ClusterLab, program: u32, duration: Duration, to: SocketAddr) -> Result<StreamWindow> {
    let node = &lab.nodes[INGRESS - 1].netns;
    let (packets_before, (runs_before, ns_before)) = (uplink_packets(node)?, program_runs(program)?);
    let (bytes, seconds) = lab.client.run(|| {
        let mut connection =
            TcpStream::connect_timeout(&to, ASK).with_context(|| format!("cannot connect to {to}"))?;
        connection.set_read_timeout(Some(ASK))?;
        let mut buffer = vec![0u8; 256 * 1024];
        let started = Instant::now();
        let mut bytes = 0u64;
        while started.elapsed() < duration {
            let read =
                connection.read(&mut buffer).with_context(|| format!("reading the stream from {to}"))?;
            ensure!(read > 0, "{to} closed the stream");
            bytes += read as u64;
        }
        Ok((bytes, started.elapsed().as_secs_f64()))
    })?;
    let (packets_after, (runs_after, ns_after)) = (uplink_packets(node)?, program_runs(program)?);
    Ok(StreamWindow {
        bytes,
        seconds,
        uplink_packets: packets_after.saturating_sub(packets_before),
        tc_runs: runs_after.saturating_sub(runs_before),
        tc_run_ns: ns_after.saturating_sub(ns_before),
    })
}

/// One datagram and its answer from `to`.
fn udp_ask(socket: &UdpSocket, to: SocketAddr) -> Result<()> {
    socket.send_to(b"who are you?", to)?;
    let mut buffer = [0u8; 512];
    loop {
        let (_, from) = socket.recv_from(&mut buffer)?;
        if from == to {
            return Ok(());
        }
    }
}

/// Runs `transaction` back to back in the client's namespace for `duration`, with the ingress
/// node's counters read before and after.
fn window(
    lab: &ClusterLab,
    program: u32,
    duration: Duration,
    transaction: impl Fn(&mut dyn FnMut(bool)) + Send + Sync,
) -> Result<Window> {
    let node = &lab.nodes[INGRESS - 1].netns;
    let (packets_before, (runs_before, ns_before)) = (uplink_packets(node)?, program_runs(program)?);
    let started = Instant::now();
    let (transactions, errors) = lab.client.run(|| {
        let (mut ok, mut failed) = (0u64, 0u64);
        while started.elapsed() < duration {
            transaction(&mut |succeeded| if succeeded { ok += 1 } else { failed += 1 });
        }
        Ok((ok, failed))
    })?;
    let seconds = started.elapsed().as_secs_f64();
    let (packets_after, (runs_after, ns_after)) = (uplink_packets(node)?, program_runs(program)?);
    Ok(Window {
        transactions,
        errors,
        seconds,
        uplink_packets: packets_after.saturating_sub(packets_before),
        tc_runs: runs_after.saturating_sub(runs_before),
        tc_run_ns: ns_after.saturating_sub(ns_before),
    })
}

/// Packets received and sent by `eth0`, the node's uplink to the router.
fn uplink_packets(node: &Netns) -> Result<u64> {
    let text = node.ip(&["-s", "-j", "link", "show", "eth0"])?;
    let links: serde_json::Value = serde_json::from_str(&text).context("ip -j link")?;
    let stats = &links[0]["stats64"];
    let count = |direction: &str| stats[direction]["packets"].as_u64();
    match (count("rx"), count("tx")) {
        (Some(rx), Some(tx)) => Ok(rx + tx),
        _ => bail!("no packet counts in {text}"),
    }
}

/// The id of vipr's TC program on `device`, through the link vipr pinned for it.
fn tc_program(bpf_root: &Path, device: &str) -> Result<u32> {
    let pin = bpf_root.join(proxy_common::pins::DIR).join(proxy_common::pins::LINKS_DIR).join(device);
    let link = aya::programs::links::FdLink::from(
        aya::programs::links::PinnedLink::from_pin(&pin)
            .with_context(|| format!("opening the link pinned at {}", pin.display()))?,
    );
    Ok(link.info().with_context(|| format!("the link pinned at {}", pin.display()))?.program_id())
}

/// `run_cnt` and `run_time_ns` of program `id`.
fn program_runs(id: u32) -> Result<(u64, u64)> {
    for info in aya::programs::loaded_programs() {
        let Ok(info) = info else { continue };
        if info.id() == id {
            return Ok((info.run_count(), info.run_time().as_nanos() as u64));
        }
    }
    bail!("BPF program {id} is gone")
}

/// The results as a table for docs/benchmarks.md.
pub fn table(results: &Results) -> String {
    let mut out = String::from(
        "| | TCP conn/s | UDP trans/s | stream MB/s | ingress node per TCP conn: uplink packets, TC runs, TC ns | \
         per UDP transaction: the same | per stream MB: the same |\n|---|---|---|---|---|---|---|\n",
    );
    for mode in &results.modes {
        let cell = |t: &Traffic| {
            format!("{:.1}, {:.1}, {:.0}", t.uplink_packets.median, t.tc_runs.median, t.tc_ns.median)
        };
        let stream = &mode.stream;
        out.push_str(&format!(
            "| {:?} | {:.0} ({:.0}–{:.0}) | {:.0} ({:.0}–{:.0}) | {:.0} ({:.0}–{:.0}) | {} | {} | {:.1}, {:.1}, {:.0} |\n",
            mode.mode,
            mode.tcp.rate.median,
            mode.tcp.rate.min,
            mode.tcp.rate.max,
            mode.udp.rate.median,
            mode.udp.rate.min,
            mode.udp.rate.max,
            stream.mbytes_per_s.median,
            stream.mbytes_per_s.min,
            stream.mbytes_per_s.max,
            cell(&mode.tcp),
            cell(&mode.udp),
            stream.uplink_packets.median,
            stream.tc_runs.median,
            stream.tc_ns.median,
        ));
    }
    out
}
