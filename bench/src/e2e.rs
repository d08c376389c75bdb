//! The `e2e` suite: real traffic through the real `vipr` binary, by proxy mode and number of
//! services.
//!
//! Every cell (mode × services) is a lab of its own, built with the testbed: a node namespace
//! where `vipr` runs, a client namespace (a pod: inside the cluster CIDR), an external
//! namespace (outside it: a client of the NodePort), and three backend namespaces with echo
//! servers. The services file holds `services - 1` filler ClusterIP services with one
//! endpoint each, then the target: a NodePort service with a TCP and a UDP port and the three
//! backends as endpoints, inserted last (for kube-proxy's rules, the end of the KUBE-SERVICES
//! list every new connection walks).
//!
//! Modes: `ebpf` (TC programs); `ebpf` with `--xdp=native` (the XDP fast path for traffic
//! from outside, so only the NodePort measurements); `iptables` through the system's iptables
//! (iptables-nft here); and the same ruleset through iptables-legacy. vipr's iptables mode
//! writes kube-proxy's chain structure and has no flag for the variant: it runs the
//! `iptables-restore` it finds on its PATH, so the legacy cell puts wrappers that exec the
//! `iptables-legacy*` programs first on vipr's PATH (checked: vipr logs the variant it uses).
//!
//! Besides the closed-loop transactions, every cell measures a NodePort packet stream: small
//! datagrams from the external client as fast as it can send them, counted where they arrive
//! at the backends (packets/s the node forwards, the measure of issue 6's XDP target). And
//! the same datagrams as a frame stream, injected as Ethernet frames into the external
//! client's veth (see `load::inject`): the node then gets them as from a NIC, without the skb
//! that a veth otherwise hands XDP, which is what XDP saves on real hardware.
//!
//! XDP on veth needs two things a NIC gives for free, set up in every lab (so the TC and XDP
//! cells see the same traffic): full checksums in what the external client sends (tx checksum
//! offload off there: XDP rewrites checksums incrementally, which corrupts a CHECKSUM_PARTIAL
//! packet's seed), and NAPI on the backends' veth ends that XDP redirects into (GRO on; the
//! kernel drops redirected frames otherwise), and on the node's end toward the external
//! client, which the frame stream is redirected into (without XDP there, in TC cells). In ebpf cells the run counts and run times of
//! vipr's programs are recorded with every measurement (`BPF_ENABLE_STATS`), which shows
//! which hook handled the packets: an XDP cell whose XDP program saw nothing, or passed the
//! stream on to TC, fails. The streams into drop sinks, which measure the node's own cost per
//! packet, run with those statistics off (two clock reads per program run, which no node
//! pays in production); their XDP cells are checked by the node's veth counting the
//! delivered datagrams (all but a tenth at most) as redirected by XDP instead.
//!
//! All cells are set up first, one after the other (programming time is one of the results),
//! then measured round robin, one repetition of every cell after the other, so the machine's
//! slow phases fall on all cells alike. The traffic itself is in `load.rs`.

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket},
    os::{fd::AsRawFd as _, unix::fs::PermissionsExt as _},
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{bail, ensure, Context as _, Result};
use serde::{Deserialize, Serialize};
use serde_json::json;
use testbed::{locate_vipr, write_atomically, LeafSpec, Netns, Topology, Vipr, WorkDir};

use super::{
    load::{self, Outcome, Traffic},
    meta::RunMeta,
    stats::Summary,
    sys::{BpfMount, PodCgroup, PrivateCgroup, XdpCountDrop},
};

const LABEL: &str = "vb-e2e";
const CLIENT: Ipv4Addr = Ipv4Addr::new(10, 0, 1, 2);
const EXTERNAL: Ipv4Addr = Ipv4Addr::new(192, 168, 77, 2);
/// The node's address on the external client's link: where the NodePorts are served.
const NODE_EXTERNAL: Ipv4Addr = Ipv4Addr::new(192, 168, 77, 1);
const CLUSTER_CIDR: &str = "10.0.0.0/16";
const BACKENDS: usize = 3;
const TCP_PORT: u16 = 80;
const UDP_PORT: u16 = 53;
const TCP_TARGET_PORT: u16 = 8080;
const UDP_TARGET_PORT: u16 = 5353;
const TCP_NODE_PORT: u16 = 30080;
const UDP_NODE_PORT: u16 = 30053;
/// The packet stream's own port of the target (UDP), so that its datagrams reach sinks that
/// only count them and the echo servers' replies do not share the path.
const STREAM_PORT: u16 = 54;
const STREAM_TARGET_PORT: u16 = 5454;
const STREAM_NODE_PORT: u16 = 30054;
/// The IPv6 frame stream (ebpf cells): the external client's and the node's addresses on their
/// link, the backends' (beside their IPv4 ones), and the IPv6 service the frames go to.
const EXTERNAL6: Ipv6Addr = Ipv6Addr::new(0xfd77, 0, 0, 0, 0, 0, 0, 2);
const NODE_EXTERNAL6: Ipv6Addr = Ipv6Addr::new(0xfd77, 0, 0, 0, 0, 0, 0, 1);
/// Every backend's IPv6 address is inside it (`--cluster-cidr`).
const CLUSTER_CIDR6: &str = "fd00::/32";
const STREAM6_CLUSTER_IP: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x54);
const STREAM6_NODE_PORT: u16 = 30056;
/// The veth end inside every leaf namespace (see `LeafSpec::new`).
const LEAF_INTERFACE: &str = "eth0";
/// Server threads per backend socket.
const SERVER_THREADS: usize = 4;

fn backend_addr(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 0, 2 + u8::try_from(i).expect("few backends"), 2)
}

/// Backend `i`'s IPv6 address: `::2` of its link, where the node is `::1` (its gateway).
fn backend_addr6(i: usize) -> Ipv6Addr {
    Ipv6Addr::new(0xfd00, 0, 2 + u16::try_from(i).expect("few backends"), 0, 0, 0, 0, 2)
}

fn cluster_ip(service: usize) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 96, 0, 10)) + u32::try_from(service).expect("fits"))
}

fn filler_endpoint(service: usize) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 64, 0, 1)) + u32::try_from(service).expect("fits"))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    /// `--proxy-mode=ebpf`: the TC programs.
    Ebpf,
    /// `--proxy-mode=ebpf --xdp=native --bpf-forwarding=redirect`.
    EbpfXdp,
    /// `--proxy-mode=iptables` with the system's iptables, which is iptables-nft here.
    IptablesNft,
    /// `--proxy-mode=iptables` with iptables-legacy's programs on its PATH.
    IptablesLegacy,
}

impl Mode {
    pub const ALL: [Self; 4] = [Self::Ebpf, Self::EbpfXdp, Self::IptablesNft, Self::IptablesLegacy];

    /// Tells the modes apart (plots, lists).
    pub fn label(self) -> &'static str {
        match self {
            Self::Ebpf => "ebpf",
            Self::EbpfXdp => "ebpf + XDP",
            Self::IptablesNft => "iptables (nft)",
            Self::IptablesLegacy => "iptables (legacy)",
        }
    }

    /// The dataplane alone, for tables that have a hook column beside it.
    pub fn proxy_mode(self) -> &'static str {
        match self {
            Self::EbpfXdp => Self::Ebpf.label(),
            mode => mode.label(),
        }
    }

    /// The name `--modes` takes (as in the results' JSON).
    pub fn name(self) -> &'static str {
        match self {
            Self::Ebpf => "ebpf",
            Self::EbpfXdp => "ebpf-xdp",
            Self::IptablesNft => "iptables-nft",
            Self::IptablesLegacy => "iptables-legacy",
        }
    }

    pub fn parse(name: &str) -> Result<Self> {
        Self::ALL.into_iter().find(|mode| mode.name() == name).with_context(|| {
            let names: Vec<_> = Self::ALL.iter().map(|mode| mode.name()).collect();
            format!("no e2e mode {name:?} (modes: {})", names.join(", "))
        })
    }

    fn is_iptables(self) -> bool {
        matches!(self, Self::IptablesNft | Self::IptablesLegacy)
    }

    pub fn is_ebpf(self) -> bool {
        !self.is_iptables()
    }

    pub fn hook(self) -> Hook {
        match self {
            Self::Ebpf => Hook::Tc,
            Self::EbpfXdp => Hook::Xdp,
            Self::IptablesNft | Self::IptablesLegacy => Hook::Netfilter,
        }
    }

    /// XDP handles only traffic from outside the node: from a pod, an XDP cell would measure
    /// the TC cell's path again.
    pub fn measures(self, kind: Kind) -> bool {
        self != Self::EbpfXdp || kind.comes_from_outside()
    }
}

/// What a measurement sends where.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Kind {
    /// A new TCP connection per transaction from a pod to the target's cluster IP.
    TcpClusterIp,
    /// UDP request/response from a pod to the cluster IP, one flow per worker.
    UdpClusterIp,
    /// A new TCP connection per transaction from outside to the node address's NodePort.
    TcpNodePort,
    /// UDP request/response from outside to the NodePort.
    UdpNodePort,
}

impl Kind {
    pub const ALL: [Self; 4] = [Self::TcpClusterIp, Self::UdpClusterIp, Self::TcpNodePort, Self::UdpNodePort];

    pub fn label(self) -> &'static str {
        match self {
            Self::TcpClusterIp => "TCP connect + request/response to a cluster IP (from a pod)",
            Self::UdpClusterIp => "UDP request/response to a cluster IP (from a pod)",
            Self::TcpNodePort => "TCP connect + request/response to a NodePort (from outside)",
            Self::UdpNodePort => "UDP request/response to a NodePort (from outside)",
        }
    }

    pub fn unit(self) -> &'static str {
        match self {
            Self::TcpClusterIp | Self::TcpNodePort => "connections/s",
            Self::UdpClusterIp | Self::UdpNodePort => "transactions/s",
        }
    }

    fn traffic(self) -> Traffic {
        match self {
            Self::TcpClusterIp | Self::TcpNodePort => Traffic::TcpConnect,
            Self::UdpClusterIp | Self::UdpNodePort => Traffic::UdpRequestResponse,
        }
    }

    pub fn comes_from_outside(self) -> bool {
        matches!(self, Self::TcpNodePort | Self::UdpNodePort)
    }

    fn target(self, services: usize) -> SocketAddr {
        let vip = cluster_ip(services - 1);
        match self {
            Self::TcpClusterIp => (vip, TCP_PORT).into(),
            Self::UdpClusterIp => (vip, UDP_PORT).into(),
            Self::TcpNodePort => (NODE_EXTERNAL, TCP_NODE_PORT).into(),
            Self::UdpNodePort => (NODE_EXTERNAL, UDP_NODE_PORT).into(),
        }
    }
}

/// Where the node handles the packets of a measurement.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Hook {
    /// vipr's TC ingress program.
    Tc,
    /// vipr's XDP program for the packets from outside (their replies: TC).
    Xdp,
    /// netfilter (iptables nat rules and conntrack).
    Netfilter,
}

impl Hook {
    pub fn label(self) -> &'static str {
        match self {
            Self::Tc => "TC",
            Self::Xdp => "XDP",
            Self::Netfilter => "netfilter",
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Settings {
    pub repetitions: usize,
    /// Length of one measurement.
    pub seconds: f64,
    pub services_axis: Vec<usize>,
    pub modes: Vec<Mode>,
    /// iptables-nft cells above this many services are not run (see `nft_cap_reason`).
    pub nft_max_services: usize,
    /// How long a cell may take from vipr's start to its first complete sync.
    pub program_timeout_seconds: u64,
    pub tcp_workers: usize,
    pub udp_workers: usize,
    /// The packet stream: connected sockets (flows) of the sender.
    #[serde(default = "default_stream_flows")]
    pub stream_flows: usize,
    /// The packet stream: sending threads.
    #[serde(default = "default_stream_senders")]
    pub stream_senders: usize,
}

fn default_stream_flows() -> usize {
    16
}

fn default_stream_senders() -> usize {
    1
}

impl Settings {
    pub fn full() -> Self {
        Self {
            repetitions: 5,
            seconds: 1.5,
            services_axis: vec![1, 1_000, 10_000, 30_000],
            modes: Mode::ALL.to_vec(),
            nft_max_services: 10_000,
            program_timeout_seconds: 420,
            tcp_workers: 4,
            udp_workers: 4,
            stream_flows: default_stream_flows(),
            // One: on veth the node's forwarding and the backends' receive processing run in
            // the softirq the sender's own transmit raises, on the sender's CPU; the sinks need
            // the other one. A second sender would compete with them for it, and the stream
            // would measure the scheduler rather than the path.
            stream_senders: default_stream_senders(),
        }
    }

    pub fn quick() -> Self {
        Self {
            repetitions: 2,
            seconds: 0.3,
            services_axis: vec![1, 1_000],
            nft_max_services: 1_000,
            program_timeout_seconds: 60,
            ..Self::full()
        }
    }

    pub fn duration(&self) -> Duration {
        Duration::from_secs_f64(self.seconds)
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Measurement {
    pub kind: Kind,
    pub hook: Hook,
    /// Transactions (TCP: connections) per second.
    pub rate: Summary,
    pub p50_us: Summary,
    pub p99_us: Summary,
    /// Over all repetitions.
    pub transactions: u64,
    pub errors: u64,
    /// ebpf cells: what vipr's programs did during the counted repetitions.
    #[serde(default)]
    pub bpf: Option<BpfRuns>,
}

/// Runs and run time of vipr's BPF programs in a lab (the kernel's `run_cnt` and
/// `run_time_ns`), summed over a measurement's repetitions. One program of each kind serves
/// all the node's devices, so these count the packets of both directions.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BpfRuns {
    pub tc_runs: u64,
    pub tc_run_ns: u64,
    /// `None` where vipr runs without XDP.
    pub xdp_runs: Option<u64>,
    pub xdp_run_ns: Option<u64>,
}

impl BpfRuns {
    fn since(self, earlier: Self) -> Self {
        let minus = |a: Option<u64>, b: Option<u64>| Some(a?.saturating_sub(b.unwrap_or(0)));
        Self {
            tc_runs: self.tc_runs.saturating_sub(earlier.tc_runs),
            tc_run_ns: self.tc_run_ns.saturating_sub(earlier.tc_run_ns),
            xdp_runs: minus(self.xdp_runs, earlier.xdp_runs),
            xdp_run_ns: minus(self.xdp_run_ns, earlier.xdp_run_ns),
        }
    }

    fn plus(self, other: Self) -> Self {
        let plus = |a: Option<u64>, b: Option<u64>| match (a, b) {
            (None, None) => None,
            (a, b) => Some(a.unwrap_or(0) + b.unwrap_or(0)),
        };
        Self {
            tc_runs: self.tc_runs + other.tc_runs,
            tc_run_ns: self.tc_run_ns + other.tc_run_ns,
            xdp_runs: plus(self.xdp_runs, other.xdp_runs),
            xdp_run_ns: plus(self.xdp_run_ns, other.xdp_run_ns),
        }
    }

    pub fn tc_ns_per_run(&self) -> Option<f64> {
        (self.tc_runs > 0).then(|| self.tc_run_ns as f64 / self.tc_runs as f64)
    }

    pub fn xdp_ns_per_run(&self) -> Option<f64> {
        let runs = self.xdp_runs.filter(|&runs| runs > 0)?;
        Some(self.xdp_run_ns? as f64 / runs as f64)
    }
}

/// The NodePort packet stream of one cell, over its repetitions.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Stream {
    pub hook: Hook,
    /// Datagrams per second that reached the backends' sockets.
    pub delivered: Summary,
    /// The same, per repetition in order: cells measured in the same round pair up.
    pub delivered_per_repetition: Vec<f64>,
    /// Datagrams per second the sender's `sendmmsg` calls took.
    pub sent: Summary,
    /// Over all repetitions.
    pub delivered_total: u64,
    pub sent_total: u64,
    /// Datagrams the backends' namespaces dropped for a full socket buffer (UDP
    /// RcvbufErrors), over all repetitions: what the sinks, not the node, lost.
    pub rcvbuf_drops: u64,
    /// Share of the machine's CPU time (all CPUs) that was busy, and that was softirq (where
    /// the forwarding runs), while the sender sent.
    pub cpu_busy: Summary,
    pub cpu_softirq: Summary,
    /// CPU time per delivered datagram, in ns, of: the sending thread(s), which run the
    /// node's and the backends' receive processing inline (softirq at the end of their
    /// system calls); the sinks' threads; the machine's ksoftirqd threads (where softirq work
    /// goes when there is too much of it, anyone's). Their sum is what a packet costs, which
    /// other work on the machine does not change the way it changes packets/s.
    #[serde(default)]
    pub sender_ns_per_packet: Option<Summary>,
    #[serde(default)]
    pub sink_ns_per_packet: Option<Summary>,
    #[serde(default)]
    pub ksoftirqd_ns_per_packet: Option<Summary>,
    #[serde(default)]
    pub cpu_ns_per_packet: Option<Summary>,
    pub bpf: Option<BpfRuns>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Cell {
    pub mode: Mode,
    pub services: usize,
    /// From vipr's start to its log saying the first sync is done, in seconds.
    pub programming_seconds: f64,
    /// What vipr logged as that sync's own duration.
    pub sync_ms: Option<f64>,
    pub measurements: Vec<Measurement>,
    #[serde(default)]
    pub stream: Option<Stream>,
    /// The frame stream (the packet stream's datagrams injected as frames).
    #[serde(default)]
    pub frames: Option<Stream>,
    /// The frame stream again, counted and dropped by XDP programs on the backends' veths
    /// instead of delivered to sockets: the node's own cost (issue 16).
    #[serde(default)]
    pub dropped_frames: Option<Stream>,
    /// The same for IPv6: frames from the external client's IPv6 address to the IPv6 stream
    /// service's NodePort (ebpf cells).
    #[serde(default)]
    pub dropped_frames6: Option<Stream>,
    /// XDP cells: the XDP mode vipr attached in ("native", or "generic" after a fallback).
    #[serde(default)]
    pub xdp_attached: Option<String>,
    pub notes: Vec<String>,
}

impl Cell {
    pub fn measurement(&self, kind: Kind) -> Option<&Measurement> {
        self.measurements.iter().find(|m| m.kind == kind)
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Skipped {
    pub mode: Mode,
    pub services: usize,
    pub reason: String,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Results {
    pub meta: RunMeta,
    pub settings: Settings,
    pub cells: Vec<Cell>,
    pub skipped: Vec<Skipped>,
}

impl Results {
    pub fn cell(&self, mode: Mode, services: usize) -> Option<&Cell> {
        self.cells.iter().find(|cell| cell.mode == mode && cell.services == services)
    }
}

fn nft_cap_reason(max: usize) -> String {
    format!(
        "not run: iptables-nft-restore of kube-proxy's ruleset takes minutes past {max} services (platform \
         facts: 0.65 s / 37 s / 136 s at 1k / 5k / 10k services, growing faster than linearly), which would \
         take this suite past its time budget"
    )
}

pub fn run(mut meta: RunMeta, settings: Settings) -> Result<Results> {
    let binary = locate_vipr()?;
    let mut bpf_stats = RunStatistics::new(settings.modes.iter().any(|mode| mode.is_ebpf()))?;
    let cgroup = PrivateCgroup::new()?;
    // The clients are pods: in ebpf mode their connections to cluster IPs are balanced at the
    // socket level (vipr's default on a node with a pod cgroup).
    let pods = PodCgroup::enter(&cgroup)?;
    let scratch = WorkDir::create(LABEL)?;
    let legacy_path = legacy_wrappers(scratch.path())?;
    let mut labs = Vec::new();
    let mut skipped = Vec::new();
    for &services in &settings.services_axis {
        for &mode in &settings.modes {
            if mode == Mode::IptablesNft && services > settings.nft_max_services {
                skipped.push(Skipped { mode, services, reason: nft_cap_reason(settings.nft_max_services) });
                continue;
            }
            eprintln!("e2e: {} with {services} services: programming", mode.label());
            let context = LabContext {
                binary: &binary,
                cgroup: cgroup.path(),
                pods_cgroup: pods.path(),
                legacy_path: &legacy_path,
            };
            match Lab::start(&context, mode, services, &settings) {
                Ok(lab) => {
                    eprintln!("e2e:   programmed in {:.2} s", lab.programming_seconds);
                    labs.push(lab);
                }
                Err(error) => {
                    eprintln!("e2e:   skipped: {error:#}");
                    skipped.push(Skipped { mode, services, reason: format!("{error:#}") });
                }
            }
        }
    }
    // One short uncounted round: caches, ARP, the first flow entries.
    let warm_up = Duration::from_millis(200);
    for lab in &labs {
        for kind in Kind::ALL.into_iter().filter(|&kind| lab.mode.measures(kind)) {
            let _ = lab.measure(kind, &settings, warm_up);
        }
        for source in Source::ALL.into_iter().filter(|&source| lab.streams(source)) {
            let _ = bpf_stats.unless_costing(source, || lab.measure_stream(&settings, source, warm_up))?;
        }
    }
    let mut outcomes: Vec<Vec<Vec<Measured>>> = vec![vec![Vec::new(); Kind::ALL.len()]; labs.len()];
    let mut streams: Vec<Vec<Vec<StreamOutcome>>> = vec![vec![Vec::new(); Source::ALL.len()]; labs.len()];
    let mut notes: Vec<Vec<String>> = vec![Vec::new(); labs.len()];
    for repetition in 0..settings.repetitions {
        eprintln!("e2e: repetition {}/{}", repetition + 1, settings.repetitions);
        for (i, lab) in labs.iter_mut().enumerate() {
            lab.ensure_running()?;
            for (k, kind) in Kind::ALL.into_iter().enumerate() {
                if !lab.mode.measures(kind) {
                    continue;
                }
                match lab.measure(kind, &settings, settings.duration()) {
                    Ok(outcome) => outcomes[i][k].push(outcome),
                    Err(error) => {
                        notes[i].push(format!("{kind:?}, repetition {}: {error:#}", repetition + 1))
                    }
                }
            }
            for (s, source) in Source::ALL.into_iter().enumerate() {
                if !lab.streams(source) {
                    continue;
                }
                let measured = bpf_stats
                    .unless_costing(source, || lab.measure_stream(&settings, source, settings.duration()))?;
                match measured {
                    Ok(outcome) => {
                        eprintln!(
                            "e2e:   {} at {}: {} {:.0}/s delivered",
                            lab.mode.label(),
                            lab.services,
                            source.label(),
                            outcome.delivered as f64 / outcome.seconds
                        );
                        streams[i][s].push(outcome);
                    }
                    Err(error) => {
                        notes[i].push(format!("{}, repetition {}: {error:#}", source.label(), repetition + 1))
                    }
                }
            }
        }
    }
    let mut cells = Vec::new();
    for (((lab, outcomes), streams), notes) in labs.iter().zip(outcomes).zip(streams).zip(notes) {
        let measurements = Kind::ALL
            .into_iter()
            .zip(outcomes)
            .filter_map(|(kind, outcomes)| summarize(lab.mode, kind, &outcomes))
            .collect();
        cells.push(Cell {
            mode: lab.mode,
            services: lab.services,
            programming_seconds: lab.programming_seconds,
            sync_ms: lab.sync_ms,
            measurements,
            stream: summarize_stream(lab.mode, &streams[0]),
            frames: summarize_stream(lab.mode, &streams[1]),
            dropped_frames: summarize_stream(lab.mode, &streams[2]),
            dropped_frames6: summarize_stream(lab.mode, &streams[3]),
            xdp_attached: lab.programs.as_ref().and_then(|programs| programs.xdp_mode.clone()),
            notes,
        });
    }
    // Agents, servers and namespaces go before the cgroup their hooks were attached to.
    drop(labs);
    drop(pods);
    drop(cgroup);
    meta.finish();
    Ok(Results { meta, settings, cells, skipped })
}

/// One counted repetition of a request/response measurement.
#[derive(Clone, Copy, Debug)]
struct Measured {
    outcome: Outcome,
    bpf: Option<BpfRuns>,
}

fn summarize(mode: Mode, kind: Kind, measured: &[Measured]) -> Option<Measurement> {
    let values = |f: fn(&Outcome) -> f64| measured.iter().map(|m| f(&m.outcome)).collect::<Vec<_>>();
    Some(Measurement {
        kind,
        hook: mode.hook(),
        rate: Summary::of(&values(|o| o.rate))?,
        p50_us: Summary::of(&values(|o| o.p50_us))?,
        p99_us: Summary::of(&values(|o| o.p99_us))?,
        transactions: measured.iter().map(|m| m.outcome.transactions).sum(),
        errors: measured.iter().map(|m| m.outcome.errors).sum(),
        bpf: sum_bpf(measured.iter().map(|m| m.bpf)),
    })
}

fn sum_bpf(runs: impl Iterator<Item = Option<BpfRuns>>) -> Option<BpfRuns> {
    runs.flatten().reduce(BpfRuns::plus)
}

/// What a stream measurement sends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Source {
    /// Datagrams from the external client's sockets.
    Sockets,
    /// The same as Ethernet frames injected into its veth.
    Frames,
    /// Those frames, counted and dropped at the backends' veths by an XDP program.
    DroppedFrames,
    /// The same over IPv6 (ebpf cells).
    DroppedFrames6,
}

impl Source {
    /// In the order of `Cell::stream`, `Cell::frames`, `Cell::dropped_frames`,
    /// `Cell::dropped_frames6`.
    const ALL: [Self; 4] = [Self::Sockets, Self::Frames, Self::DroppedFrames, Self::DroppedFrames6];

    /// Whether the stream measures the node's own cost per packet (into the drop sinks), which
    /// BPF run statistics would add to.
    fn measures_node_cost(self) -> bool {
        matches!(self, Self::DroppedFrames | Self::DroppedFrames6)
    }

    fn label(self) -> &'static str {
        match self {
            Self::Sockets => "packet stream",
            Self::Frames => "frame stream",
            Self::DroppedFrames => "frame stream into drop sinks",
            Self::DroppedFrames6 => "IPv6 frame stream into drop sinks",
        }
    }
}

/// One counted repetition of the packet stream.
#[derive(Clone, Copy, Debug)]
struct StreamOutcome {
    sent: u64,
    delivered: u64,
    seconds: f64,
    rcvbuf_drops: u64,
    cpu: CpuShare,
    sender_cpu_ns: u64,
    sink_cpu_ns: u64,
    ksoftirqd_cpu_ns: u64,
    bpf: Option<BpfRuns>,
}

fn summarize_stream(mode: Mode, outcomes: &[StreamOutcome]) -> Option<Stream> {
    let per_second = |f: fn(&StreamOutcome) -> u64| -> Vec<f64> {
        outcomes.iter().map(|o| f(o) as f64 / o.seconds).collect()
    };
    let delivered = per_second(|o| o.delivered);
    let per_packet = |f: fn(&StreamOutcome) -> u64| -> Option<Summary> {
        Summary::of(&outcomes.iter().map(|o| f(o) as f64 / o.delivered.max(1) as f64).collect::<Vec<_>>())
    };
    Some(Stream {
        hook: mode.hook(),
        delivered: Summary::of(&delivered)?,
        delivered_per_repetition: delivered,
        sent: Summary::of(&per_second(|o| o.sent))?,
        delivered_total: outcomes.iter().map(|o| o.delivered).sum(),
        sent_total: outcomes.iter().map(|o| o.sent).sum(),
        rcvbuf_drops: outcomes.iter().map(|o| o.rcvbuf_drops).sum(),
        cpu_busy: Summary::of(&outcomes.iter().map(|o| o.cpu.busy).collect::<Vec<_>>())?,
        cpu_softirq: Summary::of(&outcomes.iter().map(|o| o.cpu.softirq).collect::<Vec<_>>())?,
        sender_ns_per_packet: per_packet(|o| o.sender_cpu_ns),
        sink_ns_per_packet: per_packet(|o| o.sink_cpu_ns),
        ksoftirqd_ns_per_packet: per_packet(|o| o.ksoftirqd_cpu_ns),
        cpu_ns_per_packet: per_packet(|o| o.sender_cpu_ns + o.sink_cpu_ns + o.ksoftirqd_cpu_ns),
        bpf: sum_bpf(outcomes.iter().map(|o| o.bpf)),
    })
}

// ---------------------------------------------------------------------------------------------
// The labs: namespaces, servers, services file, agent.

/// A directory of `iptables*` / `ip6tables*` wrappers that run the legacy programs; returns
/// the PATH that puts it first.
fn legacy_wrappers(scratch: &Path) -> Result<String> {
    let dir = scratch.join("iptables-legacy-bin");
    std::fs::create_dir_all(&dir)?;
    for family in ["iptables", "ip6tables"] {
        for tool in ["", "-save", "-restore"] {
            let path = dir.join(format!("{family}{tool}"));
            std::fs::write(&path, format!("#!/bin/sh\nexec {family}-legacy{tool} \"$@\"\n"))?;
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))?;
        }
    }
    let system = std::env::var("PATH").unwrap_or_else(|_| "/usr/sbin:/usr/bin:/sbin:/bin".into());
    Ok(format!("{}:{system}", dir.display()))
}

struct LabContext<'a> {
    binary: &'a Path,
    cgroup: &'a Path,
    /// Where this process (the pods' clients) lives: vipr's `--pods-cgroup`.
    pods_cgroup: &'a Path,
    legacy_path: &'a str,
}

/// One cell's namespaces and processes; dropping it stops vipr and removes everything.
struct Lab {
    // Dropped in this order: the agent, the servers and sinks (their sockets keep namespaces
    // alive), the namespaces, the bpffs, the scratch directory.
    vipr: Vipr,
    _servers: Vec<load::Servers>,
    sinks: Vec<load::Sink>,
    topology: Topology,
    _bpffs: Option<BpfMount>,
    _workdir: WorkDir,
    mode: Mode,
    services: usize,
    programming_seconds: f64,
    sync_ms: Option<f64>,
    /// ebpf cells: vipr's programs, whose run counts each measurement records.
    programs: Option<Programs>,
    frames: FrameSource,
    /// ebpf cells: the IPv6 frame stream's frames.
    frames6: Option<FrameSource>,
    drop_sink: DropSink,
}

/// The XDP count-and-drop program for the backends' veths, pinned where `ip link` can attach
/// it for one measurement at a time.
struct DropSink {
    sink: XdpCountDrop,
    pin: PathBuf,
    // Unmounted (the pin gone) after the program's descriptor above.
    _bpffs: BpfMount,
}

impl DropSink {
    fn new() -> Result<Self> {
        let sink = XdpCountDrop::load(STREAM_TARGET_PORT)?;
        let bpffs = BpfMount::new()?;
        let pin = bpffs.path().join("drop");
        sink.pin(&pin)?;
        Ok(Self { sink, pin, _bpffs: bpffs })
    }
}

/// The frame stream's frames (one per flow) and the external client's device they go out of.
struct FrameSource {
    frames: Vec<Vec<u8>>,
    ifindex: u32,
}

/// Frames from the external client's address `from` to the NodePort `to`, `flows` source
/// ports, with the MAC addresses of the external client's veth pair.
fn frame_source(topology: &Topology, flows: usize, from: IpAddr, to: SocketAddr) -> Result<FrameSource> {
    let ext = topology.leaf("ext")?;
    let (ifindex, ext_mac) = link(&ext.netns, LEAF_INTERFACE)?;
    let (_, node_mac) = link(topology.node(), &ext.spec.node_interface)?;
    let frames = (0..flows)
        .map(|i| {
            let port = 40_000 + u16::try_from(i).expect("few flows");
            load::udp_frame(ext_mac, node_mac, SocketAddr::new(from, port), to)
        })
        .collect::<Result<_>>()?;
    Ok(FrameSource { frames, ifindex })
}

/// IPv6 beside IPv4 in an ebpf cell's lab, for the IPv6 frame stream: addresses on the
/// external client's and the backends' links (no duplicate address detection: usable at
/// once), their default routes through the node, and forwarding on the node (its namespace's
/// own setting).
fn add_ipv6(topology: &Topology) -> Result<()> {
    let node = topology.node();
    node.set_sysctl("net.ipv6.conf.all.forwarding", "1")?;
    let mut links = vec![("ext".to_owned(), EXTERNAL6, NODE_EXTERNAL6)];
    for i in 0..BACKENDS {
        let addr = backend_addr6(i);
        links.push((format!("b{i}"), addr, Ipv6Addr::from(u128::from(addr) - 1)));
    }
    for (name, addr, gateway) in links {
        let leaf = topology.leaf(&name)?;
        node.ip(&["-6", "addr", "add", &format!("{gateway}/64"), "dev", &leaf.spec.node_interface, "nodad"])?;
        leaf.netns.ip(&["-6", "addr", "add", &format!("{addr}/64"), "dev", LEAF_INTERFACE, "nodad"])?;
        leaf.netns.ip(&["-6", "route", "add", "default", "via", &gateway.to_string()])?;
    }
    Ok(())
}

/// A device's index and MAC address, from `ip -o link show`.
fn link(netns: &Netns, device: &str) -> Result<(u32, [u8; 6])> {
    let line = netns.ip(&["-o", "link", "show", "dev", device])?;
    let ifindex = line.split(':').next().unwrap_or_default().trim().parse().context("ifindex")?;
    let mac = line
        .split("link/ether ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .with_context(|| format!("no MAC address in: {line}"))?;
    let bytes = mac.split(':').map(|byte| u8::from_str_radix(byte, 16)).collect::<Result<Vec<_>, _>>()?;
    Ok((ifindex, bytes.try_into().map_err(|_| anyhow::anyhow!("bad MAC address {mac}"))?))
}

impl Lab {
    fn start(context: &LabContext<'_>, mode: Mode, services: usize, settings: &Settings) -> Result<Self> {
        let workdir = WorkDir::create(LABEL)?;
        let mut leaves = vec![
            LeafSpec::in_own_slash24("client", CLIENT)?,
            LeafSpec::new("ext", EXTERNAL, NODE_EXTERNAL, 24),
        ];
        for i in 0..BACKENDS {
            leaves.push(LeafSpec::in_own_slash24(&format!("b{i}"), backend_addr(i))?);
        }
        let topology = Topology::build(LABEL, leaves)?;
        for name in ["client", "ext"] {
            topology.leaf(name)?.netns.set_sysctl("net.ipv4.ip_local_port_range", "1024 65535")?;
        }
        // What XDP on veth needs (see the module's documentation), in every mode's lab alike.
        let ext = &topology.leaf("ext")?.netns;
        ext.run(|| set_offload(LEAF_INTERFACE, Offload::TxChecksum, false))
            .context("turning tx checksum offload off for the external client")?;
        for i in 0..BACKENDS {
            topology
                .leaf(&format!("b{i}"))?
                .netns
                .run(|| set_offload(LEAF_INTERFACE, Offload::Gro, true))
                .with_context(|| format!("turning GRO on in backend b{i}"))?;
        }
        let servers = (0..BACKENDS)
            .map(|i| {
                let addr = backend_addr(i);
                topology.leaf(&format!("b{i}"))?.netns.run(|| {
                    load::Servers::start(
                        &[(addr, TCP_TARGET_PORT).into()],
                        &[(addr, UDP_TARGET_PORT).into()],
                        SERVER_THREADS,
                    )
                })
            })
            .collect::<Result<Vec<_>>>()?;
        // NAPI on the node's end of the external client's veth: the frame stream arrives there as
        // frames transmitted by XDP, which a veth without NAPI drops (in XDP cells vipr's XDP
        // program gives it NAPI anyway; GRO on in every cell keeps the traffic the same).
        let ext_device = topology.leaf("ext")?.spec.node_interface.clone();
        topology
            .node()
            .run(|| set_offload(&ext_device, Offload::Gro, true))
            .with_context(|| format!("turning GRO on for {ext_device}"))?;
        let frames = frame_source(
            &topology,
            settings.stream_flows,
            EXTERNAL.into(),
            (NODE_EXTERNAL, STREAM_NODE_PORT).into(),
        )?;
        let frames6 = if mode.is_ebpf() {
            add_ipv6(&topology)?;
            Some(frame_source(
                &topology,
                settings.stream_flows,
                EXTERNAL6.into(),
                (NODE_EXTERNAL6, STREAM6_NODE_PORT).into(),
            )?)
        } else {
            None
        };
        let sinks = (0..BACKENDS)
            .map(|i| {
                let addr = backend_addr(i);
                topology
                    .leaf(&format!("b{i}"))?
                    .netns
                    .run(|| load::Sink::start((addr, STREAM_TARGET_PORT).into()))
            })
            .collect::<Result<Vec<_>>>()?;
        let services_file = workdir.path().join("services.yaml");
        let ipv6 = frames6.is_some();
        write_atomically(&services_file, &manifests(services, ipv6))?;

        let mut args = vec![
            format!("--services-file={}", services_file.display()),
            "--node-name=bench-node".to_owned(),
            if ipv6 {
                format!("--cluster-cidr={CLUSTER_CIDR},{CLUSTER_CIDR6}")
            } else {
                format!("--cluster-cidr={CLUSTER_CIDR}")
            },
            if ipv6 {
                format!("--nodeport-addresses={NODE_EXTERNAL}/32,{NODE_EXTERNAL6}/128")
            } else {
                format!("--nodeport-addresses={NODE_EXTERNAL}/32")
            },
            "--healthz-bind-address=".to_owned(),
            "--metrics-bind-address=".to_owned(),
            // No periodic resync in the middle of a measurement.
            "--sync-period=1h".to_owned(),
        ];
        let bpffs = if mode.is_ebpf() {
            let bpffs = BpfMount::new()?;
            args.extend([
                "--proxy-mode=ebpf".to_owned(),
                // XDP on every device too: a device XDP redirects to must have it (vipr's
                // `vipr_xdptx` map holds only devices it attached XDP to).
                format!("--devices={}", topology.node_interfaces().join(",")),
                format!("--bpf-root={}", bpffs.path().display()),
                format!("--cgroup-root={}", context.cgroup.display()),
                format!("--pods-cgroup={}", context.pods_cgroup.display()),
            ]);
            if mode == Mode::EbpfXdp {
                // XDP runs only on the redirect path (it transmits past netfilter).
                args.extend(["--xdp=native".to_owned(), "--bpf-forwarding=redirect".to_owned()]);
            }
            Some(bpffs)
        } else {
            args.push("--proxy-mode=iptables".to_owned());
            None
        };
        let log = workdir.path().join("vipr.log");
        let started = Instant::now();
        let mut vipr = if mode == Mode::IptablesLegacy {
            start_vipr_with_path(context.binary, topology.node(), &args, &log, context.legacy_path)?
        } else {
            Vipr::start_with_args(context.binary, topology.node(), &args, &log)?
        };
        let timeout = Duration::from_secs(settings.program_timeout_seconds);
        let sync_ms = loop {
            vipr.ensure_running()?;
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            if let Some(line) = text.lines().find(|line| line.contains("synced")) {
                break took_ms(line);
            }
            if started.elapsed() > timeout {
                bail!("not programmed within {timeout:?}: vipr had not logged its first sync");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let programming_seconds = started.elapsed().as_secs_f64();
        if mode.is_iptables() {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            let want = if mode == Mode::IptablesLegacy { "legacy variant" } else { "nft variant" };
            if !text.contains(want) {
                bail!("vipr did not use the {want} of iptables; its log:\n{text}");
            }
        }
        let programs = match &bpffs {
            Some(bpffs) => Some(
                Programs::find(bpffs.path(), &topology.leaf("ext")?.spec.node_interface, mode)
                    .with_context(|| format!("vipr's programs; its log: {}", log.display()))?,
            ),
            None => None,
        };
        let lab = Self {
            vipr,
            _servers: servers,
            sinks,
            topology,
            _bpffs: bpffs,
            _workdir: workdir,
            mode,
            services,
            programming_seconds,
            sync_ms,
            programs,
            frames,
            frames6,
            drop_sink: DropSink::new()?,
        };
        if lab.frames6.is_some() {
            // Until the node has the backends' IPv6 neighbours, XDP passes the frames to TC.
            testbed::wait_for(
                "the IPv6 frame stream to reach the backends",
                Duration::from_secs(10),
                || {
                    Ok(
                        match lab.measure_stream(settings, Source::DroppedFrames6, Duration::from_millis(20))
                        {
                            Ok(_) => testbed::Check::Done(()),
                            Err(error) => testbed::Check::NotYet(format!("{error:#}")),
                        },
                    )
                },
            )?;
        }
        for kind in Kind::ALL.into_iter().filter(|&kind| mode.measures(kind)) {
            let netns = lab.source(kind)?;
            let target = kind.target(services);
            testbed::wait_for(&format!("{target} to answer"), Duration::from_secs(10), || {
                Ok(match netns.run(|| load::probe(kind.traffic(), target)) {
                    Ok(()) => testbed::Check::Done(()),
                    Err(error) => testbed::Check::NotYet(format!("{error:#}")),
                })
            })?;
        }
        Ok(lab)
    }

    /// Whether this cell measures `source`: the IPv6 stream only where the lab has IPv6.
    fn streams(&self, source: Source) -> bool {
        source != Source::DroppedFrames6 || self.frames6.is_some()
    }

    fn source(&self, kind: Kind) -> Result<&Netns> {
        Ok(&self.topology.leaf(if kind.comes_from_outside() { "ext" } else { "client" })?.netns)
    }

    fn ensure_running(&mut self) -> Result<()> {
        self.vipr.ensure_running()
    }

    fn measure(&self, kind: Kind, settings: &Settings, duration: Duration) -> Result<Measured> {
        let workers = match kind.traffic() {
            Traffic::TcpConnect => settings.tcp_workers,
            Traffic::UdpRequestResponse => settings.udp_workers,
        };
        let target = kind.target(self.services);
        let before = self.bpf_runs()?;
        let outcome = self.source(kind)?.run(|| load::run(kind.traffic(), target, workers, duration))?;
        let bpf = self.bpf_runs()?.zip(before).map(|(after, before)| after.since(before));
        if let Some(BpfRuns { xdp_runs: Some(0), .. }) = bpf {
            bail!("vipr_xdp did not run: XDP saw none of these packets");
        }
        Ok(Measured { outcome, bpf })
    }

    /// The packet or frame stream from the external client to the stream's NodePort, counted
    /// at the backends. In XDP cells it fails unless XDP took the packets: vipr_xdp ran for
    /// each of them and TC (which runs on what XDP passes) for almost none.
    fn measure_stream(
        &self,
        settings: &Settings,
        source: Source,
        duration: Duration,
    ) -> Result<StreamOutcome> {
        let target: SocketAddr = (NODE_EXTERNAL, STREAM_NODE_PORT).into();
        let ext = &self.topology.leaf("ext")?.netns;
        let delivered_before = self.delivered();
        let drops_before = self.rcvbuf_errors()?;
        let bpf_before = self.bpf_runs()?;
        let cpu_before = CpuTimes::read()?;
        let sinks_before = self.sink_cpu_ns();
        let ksoftirqd_before = ksoftirqd_cpu_ns();
        let dropping = source.measures_node_cost();
        // Without run counts (the drop sinks' streams), the veth's counters say which hook ran.
        let redirected_before = if dropping { self.xdp_redirected()? } else { None };
        if dropping {
            self.attach_drop_sinks(true)?;
        }
        let dropped_before = self.drop_sink.sink.count()?;
        let sent = ext.run(|| match source {
            Source::Sockets => load::stream(target, settings.stream_flows, settings.stream_senders, duration),
            Source::Frames | Source::DroppedFrames => {
                load::inject(&self.frames.frames, self.frames.ifindex, duration)
            }
            Source::DroppedFrames6 => {
                let frames = self.frames6.as_ref().context("this lab has no IPv6")?;
                load::inject(&frames.frames, frames.ifindex, duration)
            }
        });
        if dropping {
            self.attach_drop_sinks(false)?;
        }
        let sent = sent?;
        let cpu = CpuTimes::read()?.share_since(&cpu_before);
        let ksoftirqd_cpu_ns = ksoftirqd_cpu_ns().saturating_sub(ksoftirqd_before);
        // The last batches are still on their way through the node and the sinks' queues.
        std::thread::sleep(Duration::from_millis(50));
        let sink_cpu_ns = self.sink_cpu_ns().saturating_sub(sinks_before);
        let delivered = if dropping {
            self.drop_sink.sink.count()?.saturating_sub(dropped_before)
        } else {
            self.delivered() - delivered_before
        };
        // The drop sinks' streams run without BPF run statistics (`RunStatistics`): no counts.
        let bpf = if dropping {
            None
        } else {
            self.bpf_runs()?.zip(bpf_before).map(|(after, before)| after.since(before))
        };
        let rcvbuf_drops = self.rcvbuf_errors()?.saturating_sub(drops_before);
        if delivered == 0 {
            bail!("none of the {} datagrams sent reached a backend", sent.datagrams);
        }
        // As the run counts below: a few frames may pass to TC (a neighbour being confirmed, a
        // route generation moving on), not a tenth of them.
        if let Some(before) = redirected_before {
            let redirected = self.xdp_redirected()?.unwrap_or_default().saturating_sub(before);
            ensure!(
                redirected >= delivered - delivered / 10,
                "XDP redirected {redirected} frames for {delivered} datagrams delivered: the rest went through TC"
            );
        }
        if let Some(BpfRuns { xdp_runs: Some(xdp), tc_runs, .. }) = bpf {
            ensure!(xdp >= delivered, "vipr_xdp ran {xdp} times for {delivered} datagrams delivered");
            ensure!(
                tc_runs <= delivered / 10,
                "XDP passed the stream to TC: vipr_tc_ingress ran {tc_runs} times for {delivered} datagrams"
            );
        }
        Ok(StreamOutcome {
            sent: sent.datagrams,
            delivered,
            seconds: sent.seconds,
            rcvbuf_drops,
            cpu,
            sender_cpu_ns: sent.cpu_ns,
            sink_cpu_ns,
            ksoftirqd_cpu_ns,
            bpf,
        })
    }

    fn delivered(&self) -> u64 {
        self.sinks.iter().map(load::Sink::received).sum()
    }

    /// XDP cells: the frames vipr's XDP program redirected so far, by the counters of the
    /// node's veth toward the external client (kept by the driver, BPF statistics or not).
    fn xdp_redirected(&self) -> Result<Option<u64>> {
        if self.mode != Mode::EbpfXdp {
            return Ok(None);
        }
        let device = &self.topology.leaf("ext")?.spec.node_interface;
        let redirected = self.topology.node().run(|| testbed::ethtool::xdp_counter(device, "xdp_redirect"));
        Ok(Some(redirected.with_context(|| format!("the XDP counters of {device}"))?))
    }

    /// Puts the drop sink on every backend's veth (native XDP), or takes it off.
    fn attach_drop_sinks(&self, on: bool) -> Result<()> {
        let pin = self.drop_sink.pin.to_string_lossy().into_owned();
        for i in 0..BACKENDS {
            let netns = &self.topology.leaf(&format!("b{i}"))?.netns;
            let args: Vec<&str> = if on {
                vec!["link", "set", "dev", LEAF_INTERFACE, "xdpdrv", "pinned", &pin]
            } else {
                vec!["link", "set", "dev", LEAF_INTERFACE, "xdpdrv", "off"]
            };
            netns.ip(&args).with_context(|| format!("the drop sink on backend b{i}"))?;
        }
        Ok(())
    }

    fn sink_cpu_ns(&self) -> u64 {
        self.sinks.iter().map(load::Sink::cpu_ns).sum()
    }

    /// UDP RcvbufErrors of all backend namespaces.
    fn rcvbuf_errors(&self) -> Result<u64> {
        (0..BACKENDS).map(|i| self.topology.leaf(&format!("b{i}"))?.netns.run(udp_rcvbuf_errors)).sum()
    }

    fn bpf_runs(&self) -> Result<Option<BpfRuns>> {
        self.programs.as_ref().map(Programs::runs).transpose()
    }
}

// ---------------------------------------------------------------------------------------------
// What the node and its programs did.

/// BPF run statistics (`BPF_ENABLE_STATS`): run counts and times of every program while the
/// descriptor is held, restored to the kernel.bpf_stats_enabled sysctl's setting however the
/// suite ends. They cost two clock reads per program run (`sched_clock`, a paravirtual clock
/// read on a VM: in a profile of an XDP cell as many samples as vipr's XDP program itself), a
/// cost the TC and XDP cells pay alike but no node pays in production.
struct RunStatistics {
    wanted: bool,
    held: Option<std::os::fd::OwnedFd>,
}

impl RunStatistics {
    /// On (if `wanted`: the run has ebpf cells) until dropped.
    fn new(wanted: bool) -> Result<Self> {
        let mut stats = Self { wanted, held: None };
        stats.resume()?;
        Ok(stats)
    }

    fn resume(&mut self) -> Result<()> {
        if self.wanted && self.held.is_none() {
            self.held = Some(aya::sys::enable_stats(aya::sys::Stats::RunTime).context("BPF_ENABLE_STATS")?);
        }
        Ok(())
    }

    /// Runs `measure`, with the statistics off if `source` measures the node's own cost per
    /// packet (unless the sysctl keeps them on), and on again after.
    fn unless_costing<T>(&mut self, source: Source, measure: impl FnOnce() -> T) -> Result<T> {
        if !source.measures_node_cost() {
            return Ok(measure());
        }
        self.held = None;
        let measured = measure();
        self.resume()?;
        Ok(measured)
    }
}

/// vipr's programs in an ebpf lab, found through the links vipr pinned for the external
/// client's device (each vipr loads its own programs, so the counts are this lab's).
struct Programs {
    tc: u32,
    xdp: Option<u32>,
    /// "native" or "generic": the mode vipr attached XDP in.
    xdp_mode: Option<String>,
}

impl Programs {
    fn find(bpf_root: &Path, device: &str, mode: Mode) -> Result<Self> {
        let links = bpf_root.join(proxy_common::pins::DIR).join(proxy_common::pins::LINKS_DIR);
        let program_of = |pin: &Path| -> Result<u32> {
            let link = aya::programs::links::FdLink::from(
                aya::programs::links::PinnedLink::from_pin(pin)
                    .with_context(|| format!("opening the link pinned at {}", pin.display()))?,
            );
            Ok(link.info().with_context(|| format!("the link pinned at {}", pin.display()))?.program_id())
        };
        let tc = program_of(&links.join(device))?;
        if mode != Mode::EbpfXdp {
            return Ok(Self { tc, xdp: None, xdp_mode: None });
        }
        // vipr falls back from native to generic where the driver refuses; veth does not.
        for xdp_mode in ["native", "generic"] {
            let pin: PathBuf = links.join(format!("xdp-{xdp_mode}-{device}"));
            if pin.exists() {
                return Ok(Self { tc, xdp: Some(program_of(&pin)?), xdp_mode: Some(xdp_mode.to_owned()) });
            }
        }
        bail!(
            "vipr attached no XDP program to {device} (no xdp-native-{device} link under {})",
            links.display()
        )
    }

    fn runs(&self) -> Result<BpfRuns> {
        let mut found: Vec<(u32, u64, u64)> = Vec::new();
        for info in aya::programs::loaded_programs() {
            // A program unloaded while the list is read is some other test's: skip it.
            let Ok(info) = info else { continue };
            if info.id() == self.tc || Some(info.id()) == self.xdp {
                found.push((info.id(), info.run_count(), info.run_time().as_nanos() as u64));
            }
        }
        let of = |id: u32| -> Result<(u64, u64)> {
            found
                .iter()
                .find(|(found, _, _)| *found == id)
                .map(|&(_, runs, ns)| (runs, ns))
                .with_context(|| format!("BPF program {id} is gone"))
        };
        let (tc_runs, tc_run_ns) = of(self.tc)?;
        let xdp = self.xdp.map(of).transpose()?;
        Ok(BpfRuns { tc_runs, tc_run_ns, xdp_runs: xdp.map(|x| x.0), xdp_run_ns: xdp.map(|x| x.1) })
    }
}

/// CPU time of the machine's ksoftirqd threads, in ns.
fn ksoftirqd_cpu_ns() -> u64 {
    let Ok(entries) = std::fs::read_dir("/proc") else { return 0 };
    entries
        .flatten()
        .filter(|entry| {
            entry.file_name().to_str().is_some_and(|name| name.bytes().all(|b| b.is_ascii_digit()))
        })
        .filter(|entry| {
            std::fs::read_to_string(entry.path().join("comm"))
                .is_ok_and(|comm| comm.starts_with("ksoftirqd/"))
        })
        .filter_map(|entry| load::task_cpu_ns(&entry.path().join("schedstat").to_string_lossy()))
        .sum()
}

/// `RcvbufErrors` of the `Udp:` lines of the calling thread's namespace.
fn udp_rcvbuf_errors() -> Result<u64> {
    // thread-self: /proc/net is the namespace of the process's main thread, not ours.
    let text = std::fs::read_to_string("/proc/thread-self/net/snmp")?;
    let mut udp = text.lines().filter(|line| line.starts_with("Udp: "));
    let (names, values) = (udp.next(), udp.next());
    let (Some(names), Some(values)) = (names, values) else { bail!("no Udp lines in /proc/net/snmp") };
    let column = names.split_whitespace().position(|name| name == "RcvbufErrors");
    let value = column.and_then(|column| values.split_whitespace().nth(column));
    value.context("no Udp RcvbufErrors in /proc/net/snmp")?.parse().context("Udp RcvbufErrors")
}

/// Shares of the machine's CPU time over an interval.
#[derive(Clone, Copy, Debug)]
struct CpuShare {
    busy: f64,
    softirq: f64,
}

/// The `cpu` line of /proc/stat: jiffies by state, all CPUs together.
struct CpuTimes(Vec<u64>);

impl CpuTimes {
    fn read() -> Result<Self> {
        let text = std::fs::read_to_string("/proc/stat")?;
        let line = text.lines().find(|line| line.starts_with("cpu ")).context("no cpu line in /proc/stat")?;
        let fields = line.split_whitespace().skip(1).map(str::parse).collect::<Result<Vec<u64>, _>>()?;
        ensure!(fields.len() >= 7, "short cpu line in /proc/stat: {line}");
        Ok(Self(fields))
    }

    /// Fields: user nice system idle iowait irq softirq steal guest guest_nice; guest time is
    /// in user already.
    fn share_since(&self, earlier: &Self) -> CpuShare {
        let delta: Vec<u64> =
            self.0.iter().zip(&earlier.0).take(8).map(|(now, then)| now.saturating_sub(*then)).collect();
        let total: u64 = delta.iter().sum();
        if total == 0 {
            return CpuShare { busy: f64::NAN, softirq: f64::NAN };
        }
        let idle = delta[3] + delta[4];
        CpuShare { busy: (total - idle) as f64 / total as f64, softirq: delta[6] as f64 / total as f64 }
    }
}

/// The offloads the labs set, as the legacy ethtool ioctl commands (set, get) name them.
#[derive(Clone, Copy, Debug)]
enum Offload {
    /// `ethtool -K <if> tx`.
    TxChecksum,
    /// `ethtool -K <if> gro`.
    Gro,
}

/// `ethtool -K <interface> tx|gro on|off` in the calling thread's namespace, through the
/// SIOCETHTOOL ioctl (the ethtool program is not among the packages the suites install).
/// Reads the setting back: a driver may refuse silently.
fn set_offload(interface: &str, offload: Offload, on: bool) -> Result<()> {
    // linux/ethtool.h.
    const ETHTOOL_GTXCSUM: u32 = 0x16;
    const ETHTOOL_STXCSUM: u32 = 0x17;
    const ETHTOOL_GGRO: u32 = 0x2b;
    const ETHTOOL_SGRO: u32 = 0x2c;
    /// struct ethtool_value.
    #[repr(C)]
    struct EthtoolValue {
        cmd: u32,
        data: u32,
    }
    let (set, get) = match offload {
        Offload::TxChecksum => (ETHTOOL_STXCSUM, ETHTOOL_GTXCSUM),
        Offload::Gro => (ETHTOOL_SGRO, ETHTOOL_GGRO),
    };
    let socket = UdpSocket::bind(("0.0.0.0", 0)).context("a socket for SIOCETHTOOL")?;
    let call = |cmd: u32, data: u32| -> Result<u32> {
        let mut value = EthtoolValue { cmd, data };
        // SAFETY: all-zero is a valid ifreq.
        let mut request: libc::ifreq = unsafe { std::mem::zeroed() };
        ensure!(interface.len() < request.ifr_name.len(), "interface name {interface} too long");
        for (to, from) in request.ifr_name.iter_mut().zip(interface.bytes()) {
            *to = from as libc::c_char;
        }
        request.ifr_ifru.ifru_data = (&mut value as *mut EthtoolValue).cast();
        // SAFETY: the request names the interface and points at a live ethtool_value.
        if unsafe { libc::ioctl(socket.as_raw_fd(), libc::SIOCETHTOOL, &mut request) } != 0 {
            return Err(std::io::Error::last_os_error())
                .with_context(|| format!("ethtool command {cmd:#x} on {interface}"));
        }
        Ok(value.data)
    };
    call(set, u32::from(on))?;
    let now = call(get, 0)? != 0;
    ensure!(now == on, "{interface}: {offload:?} stays {} after setting it {}", onoff(now), onoff(on));
    Ok(())
}

fn onoff(on: bool) -> &'static str {
    if on {
        "on"
    } else {
        "off"
    }
}

/// [`Vipr::start_with_args`] with `PATH` set for the agent alone (it is how vipr finds the
/// iptables programs): `env PATH=… vipr …`, which execs vipr in its own place.
fn start_vipr_with_path(
    binary: &Path,
    netns: &Netns,
    args: &[String],
    log: &Path,
    path: &str,
) -> Result<Vipr> {
    let mut env_args = vec![format!("PATH={path}"), binary.display().to_string()];
    env_args.extend(args.iter().cloned());
    Vipr::start_with_args(Path::new("/usr/bin/env"), netns, &env_args, log)
}

/// `took_ms=<n>` of vipr's "synced" log line.
fn took_ms(line: &str) -> Option<f64> {
    let rest = &line[line.find("took_ms=")? + "took_ms=".len()..];
    rest.split(|c: char| !c.is_ascii_digit()).next()?.parse().ok()
}

/// The services file: `services - 1` fillers (ClusterIP, one TCP port, one endpoint that is
/// never reached), then the target (NodePort, TCP, UDP and the stream's UDP port, the backends
/// as endpoints). One
/// JSON document per object: JSON is YAML, and much faster to write and read at 30k.
/// The services file: `services - 1` fillers, then (with `ipv6`) the IPv6 frame stream's
/// service, then the target.
fn manifests(services: usize, ipv6: bool) -> String {
    let mut out = String::with_capacity(services * 900);
    let mut push = |value: serde_json::Value| {
        out.push_str(&value.to_string());
        out.push_str("\n---\n");
    };
    for i in 0..services - 1 {
        let name = format!("svc-{i}");
        let ip = cluster_ip(i).to_string();
        push(json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "namespace": "bench"},
            "spec": {"type": "ClusterIP", "clusterIP": ip, "clusterIPs": [ip],
                     "ports": [{"name": "http", "protocol": "TCP", "port": TCP_PORT, "targetPort": TCP_TARGET_PORT}]}
        }));
        let ports = json!([{"name": "http", "protocol": "TCP", "port": TCP_TARGET_PORT}]);
        push(endpoint_slice(&name, "IPv4", ports, [IpAddr::V4(filler_endpoint(i))]));
    }
    if ipv6 {
        let ip = STREAM6_CLUSTER_IP.to_string();
        push(json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": "stream6", "namespace": "bench"},
            "spec": {"type": "NodePort", "clusterIP": ip, "clusterIPs": [ip],
                     "ipFamilies": ["IPv6"], "ipFamilyPolicy": "SingleStack",
                     "ports": [{"name": "stream", "protocol": "UDP", "port": STREAM_PORT,
                                "targetPort": STREAM_TARGET_PORT, "nodePort": STREAM6_NODE_PORT}]}
        }));
        let ports = json!([{"name": "stream", "protocol": "UDP", "port": STREAM_TARGET_PORT}]);
        push(endpoint_slice("stream6", "IPv6", ports, (0..BACKENDS).map(|i| IpAddr::V6(backend_addr6(i)))));
    }
    let ip = cluster_ip(services - 1).to_string();
    push(json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "target", "namespace": "bench"},
        "spec": {"type": "NodePort", "clusterIP": ip, "clusterIPs": [ip],
                 "ports": [
                     {"name": "tcp", "protocol": "TCP", "port": TCP_PORT, "targetPort": TCP_TARGET_PORT,
                      "nodePort": TCP_NODE_PORT},
                     {"name": "udp", "protocol": "UDP", "port": UDP_PORT, "targetPort": UDP_TARGET_PORT,
                      "nodePort": UDP_NODE_PORT},
                     {"name": "stream", "protocol": "UDP", "port": STREAM_PORT,
                      "targetPort": STREAM_TARGET_PORT, "nodePort": STREAM_NODE_PORT}]}
    }));
    let ports = json!([{"name": "tcp", "protocol": "TCP", "port": TCP_TARGET_PORT},
                       {"name": "udp", "protocol": "UDP", "port": UDP_TARGET_PORT},
                       {"name": "stream", "protocol": "UDP", "port": STREAM_TARGET_PORT}]);
    push(endpoint_slice("target", "IPv4", ports, (0..BACKENDS).map(|i| IpAddr::V4(backend_addr(i)))));
    out
}

/// The one EndpointSlice (`<service>-1`) of Service `service` in the bench namespace: `ports`,
/// and a ready endpoint at each of `addresses` (of `address_type`'s family).
fn endpoint_slice(
    service: &str,
    address_type: &str,
    ports: serde_json::Value,
    addresses: impl IntoIterator<Item = IpAddr>,
) -> serde_json::Value {
    let endpoints: Vec<_> = addresses
        .into_iter()
        .map(|address| json!({"addresses": [address.to_string()], "conditions": {"ready": true}}))
        .collect();
    json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": format!("{service}-1"), "namespace": "bench",
                     "labels": {"kubernetes.io/service-name": service}},
        "addressType": address_type,
        "ports": ports,
        "endpoints": endpoints
    })
}

/// Which iptables programs this machine has, for the report: the system's `iptables` and the
/// two variants.
pub fn iptables_versions() -> String {
    let version = |program: &str| {
        std::process::Command::new(program)
            .arg("--version")
            .output()
            .ok()
            .filter(|output| output.status.success())
            .map(|output| String::from_utf8_lossy(&output.stdout).trim().to_owned())
            .unwrap_or_else(|| "not installed".into())
    };
    format!(
        "system `iptables`: {}; `iptables-legacy`: {}; `iptables-nft`: {}",
        version("iptables"),
        version("iptables-legacy"),
        version("iptables-nft")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_manifests_parse_and_the_target_comes_last() {
        let objects = vipr::source::file::parse_manifests(Path::new("x"), &manifests(3, false)).unwrap();
        assert!(objects.rejected.is_empty());
        assert_eq!(objects.services.len(), 3);
        assert_eq!(objects.slices.len(), 3);
        assert_eq!(objects.services[2].metadata.name.as_deref(), Some("target"));
        let objects = vipr::source::file::parse_manifests(Path::new("x"), &manifests(3, true)).unwrap();
        assert!(objects.rejected.is_empty());
        assert_eq!(objects.services.len(), 4);
        assert_eq!(objects.slices.len(), 4);
        assert_eq!(objects.services[2].metadata.name.as_deref(), Some("stream6"));
        assert_eq!(objects.services[3].metadata.name.as_deref(), Some("target"));
        assert_eq!(took_ms("INFO synced: frontends=4 took_ms=12 x"), Some(12.0));
    }
}
