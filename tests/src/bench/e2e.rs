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
//! Modes: `ebpf`; `iptables` through the system's iptables (iptables-nft here); and the same
//! ruleset through iptables-legacy. vipr's iptables mode writes kube-proxy's chain structure
//! and has no flag for the variant: it runs the `iptables-restore` it finds on its PATH, so
//! the legacy cell puts wrappers that exec the `iptables-legacy*` programs first on vipr's
//! PATH (checked: vipr logs the variant it uses).
//!
//! All cells are set up first, one after the other (programming time is one of the results),
//! then measured round robin, one repetition of every cell after the other, so the machine's
//! slow phases fall on all cells alike. The traffic itself is in `load.rs`.

use std::{
    net::{Ipv4Addr, SocketAddr},
    os::unix::fs::PermissionsExt as _,
    path::Path,
    time::{Duration, Instant},
};

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};
use serde_json::json;
use testbed::{locate_vipr, write_atomically, LeafSpec, Netns, Topology, Vipr, WorkDir};

use super::{
    load::{self, Outcome, Traffic},
    meta::RunMeta,
    stats::Summary,
    sys::{BpfMount, PrivateCgroup},
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
/// Server threads per backend socket.
const SERVER_THREADS: usize = 4;

fn backend_addr(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 0, 2 + u8::try_from(i).expect("few backends"), 2)
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
    Ebpf,
    /// `--proxy-mode=iptables` with the system's iptables, which is iptables-nft here.
    IptablesNft,
    /// `--proxy-mode=iptables` with iptables-legacy's programs on its PATH.
    IptablesLegacy,
}

impl Mode {
    pub const ALL: [Self; 3] = [Self::Ebpf, Self::IptablesNft, Self::IptablesLegacy];

    pub fn label(self) -> &'static str {
        match self {
            Self::Ebpf => "ebpf",
            Self::IptablesNft => "iptables (nft)",
            Self::IptablesLegacy => "iptables (legacy)",
        }
    }

    fn is_iptables(self) -> bool {
        self != Self::Ebpf
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

    fn comes_from_outside(self) -> bool {
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

/// Where the node handles the packets of a measurement. Traffic from outside is where an XDP
/// program would take over: the NodePort measurements are the ones a `--xdp=native|off`
/// variant will add a row to (today the eBPF datapath has only its TC programs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Hook {
    /// vipr's TC ingress program.
    Tc,
    /// netfilter (iptables nat rules and conntrack).
    Netfilter,
}

impl Hook {
    pub fn label(self) -> &'static str {
        match self {
            Self::Tc => "TC",
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
    let cgroup = PrivateCgroup::new()?;
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
            let context = LabContext { binary: &binary, cgroup: cgroup.path(), legacy_path: &legacy_path };
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
    for lab in &labs {
        for kind in Kind::ALL {
            let _ = lab.measure(kind, &settings, Duration::from_millis(200));
        }
    }
    let mut outcomes: Vec<Vec<Vec<Outcome>>> = vec![vec![Vec::new(); Kind::ALL.len()]; labs.len()];
    let mut notes: Vec<Vec<String>> = vec![Vec::new(); labs.len()];
    for repetition in 0..settings.repetitions {
        eprintln!("e2e: repetition {}/{}", repetition + 1, settings.repetitions);
        for (i, lab) in labs.iter_mut().enumerate() {
            lab.ensure_running()?;
            for (k, kind) in Kind::ALL.into_iter().enumerate() {
                match lab.measure(kind, &settings, settings.duration()) {
                    Ok(outcome) => outcomes[i][k].push(outcome),
                    Err(error) => {
                        notes[i].push(format!("{kind:?}, repetition {}: {error:#}", repetition + 1))
                    }
                }
            }
        }
    }
    let mut cells = Vec::new();
    for ((lab, outcomes), notes) in labs.iter().zip(outcomes).zip(notes) {
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
            notes,
        });
    }
    // Agents, servers and namespaces go before the cgroup their hooks were attached to.
    drop(labs);
    drop(cgroup);
    meta.finish();
    Ok(Results { meta, settings, cells, skipped })
}

fn summarize(mode: Mode, kind: Kind, outcomes: &[Outcome]) -> Option<Measurement> {
    let values = |f: fn(&Outcome) -> f64| outcomes.iter().map(f).collect::<Vec<_>>();
    Some(Measurement {
        kind,
        hook: if mode.is_iptables() { Hook::Netfilter } else { Hook::Tc },
        rate: Summary::of(&values(|o| o.rate))?,
        p50_us: Summary::of(&values(|o| o.p50_us))?,
        p99_us: Summary::of(&values(|o| o.p99_us))?,
        transactions: outcomes.iter().map(|o| o.transactions).sum(),
        errors: outcomes.iter().map(|o| o.errors).sum(),
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
    legacy_path: &'a str,
}

/// One cell's namespaces and processes; dropping it stops vipr and removes everything.
struct Lab {
    // Dropped in this order: the agent, the servers (their sockets keep namespaces alive),
    // the namespaces, the bpffs, the scratch directory.
    vipr: Vipr,
    _servers: Vec<load::Servers>,
    topology: Topology,
    _bpffs: Option<BpfMount>,
    _workdir: WorkDir,
    mode: Mode,
    services: usize,
    programming_seconds: f64,
    sync_ms: Option<f64>,
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
        let services_file = workdir.path().join("services.yaml");
        write_atomically(&services_file, &manifests(services))?;

        let mut args = vec![
            format!("--services-file={}", services_file.display()),
            "--node-name=bench-node".to_owned(),
            format!("--cluster-cidr={CLUSTER_CIDR}"),
            format!("--nodeport-addresses={NODE_EXTERNAL}/32"),
            "--healthz-bind-address=".to_owned(),
            "--metrics-bind-address=".to_owned(),
            // No periodic resync in the middle of a measurement.
            "--sync-period=1h".to_owned(),
        ];
        let bpffs = if mode == Mode::Ebpf {
            let bpffs = BpfMount::new()?;
            args.extend([
                "--proxy-mode=ebpf".to_owned(),
                format!("--devices={}", topology.node_interfaces().join(",")),
                format!("--bpf-root={}", bpffs.path().display()),
                format!("--cgroup-root={}", context.cgroup.display()),
            ]);
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
        let lab = Self {
            vipr,
            _servers: servers,
            topology,
            _bpffs: bpffs,
            _workdir: workdir,
            mode,
            services,
            programming_seconds,
            sync_ms,
        };
        for kind in Kind::ALL {
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

    fn source(&self, kind: Kind) -> Result<&Netns> {
        Ok(&self.topology.leaf(if kind.comes_from_outside() { "ext" } else { "client" })?.netns)
    }

    fn ensure_running(&mut self) -> Result<()> {
        self.vipr.ensure_running()
    }

    fn measure(&self, kind: Kind, settings: &Settings, duration: Duration) -> Result<Outcome> {
        let workers = match kind.traffic() {
            Traffic::TcpConnect => settings.tcp_workers,
            Traffic::UdpRequestResponse => settings.udp_workers,
        };
        let target = kind.target(self.services);
        self.source(kind)?.run(|| load::run(kind.traffic(), target, workers, duration))
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
/// never reached), then the target (NodePort, TCP and UDP, the backends as endpoints). One
/// JSON document per object: JSON is YAML, and much faster to write and read at 30k.
fn manifests(services: usize) -> String {
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
        push(json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": format!("{name}-1"), "namespace": "bench",
                         "labels": {"kubernetes.io/service-name": name}},
            "addressType": "IPv4",
            "ports": [{"name": "http", "protocol": "TCP", "port": TCP_TARGET_PORT}],
            "endpoints": [{"addresses": [filler_endpoint(i).to_string()], "conditions": {"ready": true}}]
        }));
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
                      "nodePort": UDP_NODE_PORT}]}
    }));
    let endpoints: Vec<_> = (0..BACKENDS)
        .map(|i| json!({"addresses": [backend_addr(i).to_string()], "conditions": {"ready": true}}))
        .collect();
    push(json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": "target-1", "namespace": "bench",
                     "labels": {"kubernetes.io/service-name": "target"}},
        "addressType": "IPv4",
        "ports": [{"name": "tcp", "protocol": "TCP", "port": TCP_TARGET_PORT},
                  {"name": "udp", "protocol": "UDP", "port": UDP_TARGET_PORT}],
        "endpoints": endpoints
    }));
    out
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
        let objects = vipr::source::file::parse_manifests(Path::new("x"), &manifests(3)).unwrap();
        assert!(objects.rejected.is_empty());
        assert_eq!(objects.services.len(), 3);
        assert_eq!(objects.slices.len(), 3);
        assert_eq!(objects.services[2].metadata.name.as_deref(), Some("target"));
        assert_eq!(took_ms("INFO synced: frontends=4 took_ms=12 x"), Some(12.0));
    }
}
