//! `vipr inspect`: what this node's datapath holds, as `ipvsadm -Ln` shows IPVS: each frontend
//! with its flags and backends, the tracked connections, every map's fill against its
//! capacity, the devices vipr is attached to, and what differs between the state the agent
//! last programmed and the kernel's (drift). In ebpf mode it reads the pinned maps; in
//! iptables mode the nat table's chains ([`iptables`]); in ipvs mode the virtual services and
//! ipsets ([`ipvs`]); flows come from conntrack in those two. It reads only the kernel (and
//! the agent's record of its desired state), so it works while the agent runs and after it
//! stopped (the datapath keeps serving then).
use std::{
    collections::BTreeMap,
    ffi::OsString,
    fmt::Write as _,
    net::{IpAddr, SocketAddr},
    os::fd::AsFd as _,
    path::{Path, PathBuf},
    process::ExitCode,
};

use anyhow::Context as _;
use aya::maps::{HashMap as BpfHashMap, Map, MapData, MapInfo, MapType};
use clap::{Parser, Subcommand, ValueEnum};
use proxy_common::{flow_flags, pins, proto, Backend4, Backend6, BackendSlot, Service};
use serde::Serialize;

use crate::{
    bpf_sys,
    dataplane::{
        ebpf::{
            counters::CounterMap,
            reaper::TrackedFlow,
            record::{self, flag_names, protocol_name, source_name},
        },
        iptables::conntrack,
    },
};

mod iptables;
mod ipvs;

/// Where the agent records the state it last programmed, unless `--state-dir` says otherwise.
pub const DEFAULT_STATE_DIR: &str = "/run/vipr";

/// Exit status of `vipr inspect drift` when the kernel differs from the agent's desired state
/// (0: it does not; 2: inspect failed).
pub const EXIT_DRIFT: u8 = 1;
const EXIT_ERROR: u8 = 2;

#[derive(Parser, Debug)]
#[command(
    name = "vipr inspect",
    about = "Shows what this node's datapath holds: the pinned maps in ebpf mode, the kernel's \
             rules, IPVS services and conntrack in the iptables and ipvs modes"
)]
pub struct InspectArgs {
    #[command(subcommand)]
    view: View,
    /// Where the bpffs is: vipr's pins are under `<bpf-root>/vipr`.
    #[arg(long, global = true, default_value = "/sys/fs/bpf")]
    bpf_root: PathBuf,
    /// The agent's `--state-dir`, where it records the state it last programmed (for `drift`).
    #[arg(long, global = true, default_value = DEFAULT_STATE_DIR)]
    state_dir: PathBuf,
    /// The datapath to read. `auto`: ebpf when vipr's pins are under --bpf-root, else ipvs when
    /// the interface kube-ipvs0 exists, else iptables when vipr's chains are in the nat table,
    /// else nftables when vipr's nftables table exists.
    #[arg(long, visible_alias = "proxy-mode", global = true, value_enum, default_value_t = Mode::Auto)]
    mode: Mode,
    /// `text` (aligned columns) or `json`.
    #[arg(short = 'o', long = "output", global = true, value_enum, default_value_t = Output::Text)]
    output: Output,
}

#[derive(Subcommand, Debug)]
enum View {
    /// Frontends (address:port/protocol, per source class) with flags, affinity and backends,
    /// each backend with its slots and counters.
    Services {
        /// Only frontends on this address (`10.96.0.10`) or address and port (`10.96.0.10:53`).
        #[arg(long)]
        frontend: Option<String>,
    },
    /// Tracked connections: client, frontend, backend (and the masquerade source), state, idle
    /// time. Filters combine.
    Flows {
        /// Only connections to this frontend address, or address and port.
        #[arg(long)]
        frontend: Option<String>,
        /// Only connections balanced to this backend address, or address and port.
        #[arg(long)]
        backend: Option<String>,
        /// Only connections from this client address, or address and port.
        #[arg(long)]
        client: Option<String>,
        /// Show at most this many (the oldest-idle last); the total is always counted.
        #[arg(long, default_value_t = 1000)]
        limit: usize,
    },
    /// Every pinned map: its type, entries and capacity; in ipvs mode kube-proxy's ipsets, and
    /// in the iptables and ipvs modes the conntrack table.
    Maps,
    /// The devices with a pinned program link (TC ingress, XDP).
    Devices,
    /// What differs between the entries the agent last meant to program (recorded in
    /// --state-dir after each sync) and what the maps hold: entries missing from the kernel,
    /// extra there, or different. Exits 1 when anything differs. ebpf mode.
    Drift,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Mode {
    Auto,
    Ebpf,
    Iptables,
    Ipvs,
    /// vipr's nftables tables: `services` prints them as `nft list table` does.
    Nftables,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Ebpf => "ebpf",
            Self::Iptables => "iptables",
            Self::Ipvs => "ipvs",
            Self::Nftables => "nftables",
        }
    }
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Output {
    Text,
    Json,
}

/// Runs `vipr inspect ARGS` (the words after `inspect`) and prints to stdout.
pub fn main(args: Vec<OsString>) -> ExitCode {
    let args = InspectArgs::parse_from(std::iter::once(OsString::from("vipr inspect")).chain(args));
    match render(&args) {
        Ok(rendered) => {
            print!("{}", rendered.text);
            if rendered.drift {
                ExitCode::from(EXIT_DRIFT)
            } else {
                ExitCode::SUCCESS
            }
        }
        Err(error) => {
            eprintln!("vipr inspect: {error:#}");
            ExitCode::from(EXIT_ERROR)
        }
    }
}

/// A view as it is printed.
pub struct Rendered {
    pub text: String,
    /// The drift view found differences.
    pub drift: bool,
}

impl From<String> for Rendered {
    fn from(text: String) -> Self {
        Self { text, drift: false }
    }
}

/// The mode `args` asks for, or the one whose state is found here.
fn detect(args: &InspectArgs, pin_dir: &Path) -> anyhow::Result<Mode> {
    if args.mode != Mode::Auto {
        return Ok(args.mode);
    }
    if pin_dir.join(pins::SERVICES4).exists() {
        Ok(Mode::Ebpf)
    } else if ipvs::present() {
        Ok(Mode::Ipvs)
    } else if iptables::present() {
        Ok(Mode::Iptables)
    } else if crate::dataplane::nftables::tables().is_ok_and(|tables| !tables.is_empty()) {
        Ok(Mode::Nftables)
    } else {
        anyhow::bail!(
            "no vipr datapath found here: no pins under {}, no interface {}, no service chains in the \
             nat table (pass --mode, or --bpf-root for pins elsewhere)",
            pin_dir.display(),
            crate::dataplane::ipvs::link::DUMMY_INTERFACE
        )
    }
}

/// The view `args` asks for, as it is printed.
pub fn render(args: &InspectArgs) -> anyhow::Result<Rendered> {
    let dir = args.bpf_root.join(pins::DIR);
    let mode = detect(args, &dir)?;
    if mode == Mode::Ebpf {
        anyhow::ensure!(
            dir.is_dir(),
            "{} does not exist: vipr's eBPF datapath is not installed here",
            dir.display()
        );
    }
    let unsupported =
        |view: &str| anyhow::anyhow!("`vipr inspect {view}` has nothing to show in {} mode", mode.name());
    Ok(match &args.view {
        View::Services { .. } if mode == Mode::Nftables => match args.output {
            // The table as nft prints it: chains, verdict maps and sets are the state.
            Output::Text => Rendered::from(crate::dataplane::nftables::list_tables()?),
            Output::Json => return Err(unsupported("services -o json")),
        },
        View::Flows { .. } if mode == Mode::Nftables => return Err(unsupported("flows")),
        View::Services { frontend } => {
            let mut frontends = match mode {
                Mode::Iptables => iptables::services()?,
                Mode::Ipvs => ipvs::services()?,
                _ => services(&dir)?,
            };
            sort_frontends(&mut frontends);
            if let Some(filter) = frontend {
                frontends.retain(|frontend| matches_frontend(frontend, filter));
            }
            Rendered::from(match args.output {
                Output::Json => json(&frontends)?,
                Output::Text => services_text(&frontends, mode),
            })
        }
        View::Flows { frontend, backend, client, limit } => {
            let filter = FlowFilter {
                frontend: frontend.as_deref().map(Endpoint::parse).transpose()?,
                backend: backend.as_deref().map(Endpoint::parse).transpose()?,
                client: client.as_deref().map(Endpoint::parse).transpose()?,
            };
            let flows = match mode {
                Mode::Iptables => conntrack_flows(&iptables::services()?, &filter, *limit)?,
                Mode::Ipvs => conntrack_flows(&ipvs::services()?, &filter, *limit)?,
                _ => flows(&dir, &filter, *limit)?,
            };
            Rendered::from(match args.output {
                Output::Json => json(&flows)?,
                Output::Text => flows_text(&flows),
            })
        }
        View::Maps => {
            let maps = match mode {
                // Without nf_conntrack loaded there is no table to fill.
                Mode::Ipvs => {
                    let mut maps = ipvs::maps()?;
                    maps.extend(conntrack_table().ok());
                    maps
                }
                Mode::Iptables | Mode::Nftables => conntrack_table().into_iter().collect(),
                _ => maps(&dir)?,
            };
            Rendered::from(match args.output {
                Output::Json => json(&maps)?,
                Output::Text => maps_text(&maps),
            })
        }
        View::Devices => {
            if mode != Mode::Ebpf {
                return Err(unsupported("devices"));
            }
            let devices = devices(&dir)?;
            Rendered::from(match args.output {
                Output::Json => json(&devices)?,
                Output::Text => devices_text(&devices),
            })
        }
        View::Drift => {
            if mode != Mode::Ebpf {
                return Err(unsupported("drift"));
            }
            let drift = drift(&dir, &record::path(&args.state_dir, &args.bpf_root))?;
            let text = match args.output {
                Output::Json => json(&drift)?,
                Output::Text => drift_text(&drift),
            };
            Rendered { text, drift: !drift.differences.is_empty() }
        }
    })
}

fn json<T: Serialize>(value: &T) -> anyhow::Result<String> {
    Ok(serde_json::to_string_pretty(value)? + "\n")
}

/// One services-map entry: a frontend as one source class sees it.
#[derive(Debug, Serialize)]
pub struct FrontendView {
    pub protocol: &'static str,
    pub frontend: SocketAddr,
    /// `outside`, `pod` or `node`: whose packets this entry decides for.
    /// `all` in the iptables and ipvs modes, which are read per frontend only.
    pub source: &'static str,
    /// The services map's id of the service port (ebpf mode).
    pub service_id: Option<u32>,
    /// The service port, where the kernel's state names it (iptables mode's comments).
    pub service: Option<String>,
    /// The entry's flags; in ipvs mode the scheduler (`rr`, ...).
    pub flags: Vec<&'static str>,
    /// ClientIP affinity's timeout; none without affinity.
    pub affinity_seconds: Option<u32>,
    pub backends: Vec<BackendView>,
}

#[derive(Debug, Serialize)]
pub struct BackendView {
    pub address: SocketAddr,
    /// How many of the frontend's slots hold it: 1 each with random choice, its share of
    /// the table with Maglev; in ipvs mode the real server's weight.
    pub slots: u32,
    /// Since the agent programmed this (frontend, backend) pair, both directions. In
    /// iptables mode the counters of the endpoint's DNAT rule, which sees the first packet
    /// of each connection only; none in ipvs mode.
    pub packets: u64,
    pub bytes: u64,
    /// ipvs mode: the connections IPVS tracks to the real server.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub active_connections: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub inactive_connections: Option<u32>,
}

fn open_hash<K: aya::Pod, V: aya::Pod>(dir: &Path, name: &str) -> anyhow::Result<BpfHashMap<MapData, K, V>> {
    let pin = dir.join(name);
    let data = MapData::from_pin(&pin).with_context(|| format!("cannot open {}", pin.display()))?;
    Ok(BpfHashMap::try_from(Map::HashMap(data))?)
}

/// Both families' frontends, sorted by address, port, protocol and source class.
fn services(dir: &Path) -> anyhow::Result<Vec<FrontendView>> {
    let counters = CounterMap::open(&dir.join(pins::BACKEND_COUNTERS)).ok();
    let counted = |counter: u32| {
        let sums = counters.as_ref().filter(|_| counter != 0).and_then(|map| map.read(counter));
        sums.map_or((0, 0), |sums| (sums.packets, sums.bytes))
    };
    let mut frontends = Vec::new();
    let services4 = open_hash::<proxy_common::ServiceKey4, Service>(dir, pins::SERVICES4)?;
    let backends4 = open_hash::<BackendSlot, Backend4>(dir, pins::BACKENDS4)?;
    for entry in services4.iter() {
        let (key, service) = entry?;
        let address = SocketAddr::new(IpAddr::from(key.addr), key.port);
        let slots = (0..service.backend_count).filter_map(|slot| {
            let backend = backends4.get(&BackendSlot { backend_set: service.backend_set, slot }, 0).ok()?;
            Some((SocketAddr::new(IpAddr::from(backend.addr), backend.port), backend.counter))
        });
        frontends.push(frontend_view(address, key.proto, key.source_class, &service, slots, &counted));
    }
    let services6 = open_hash::<proxy_common::ServiceKey6, Service>(dir, pins::SERVICES6)?;
    let backends6 = open_hash::<BackendSlot, Backend6>(dir, pins::BACKENDS6)?;
    for entry in services6.iter() {
        let (key, service) = entry?;
        let address = SocketAddr::new(IpAddr::from(key.addr), key.port);
        let slots = (0..service.backend_count).filter_map(|slot| {
            let backend = backends6.get(&BackendSlot { backend_set: service.backend_set, slot }, 0).ok()?;
            Some((SocketAddr::new(IpAddr::from(backend.addr), backend.port), backend.counter))
        });
        frontends.push(frontend_view(address, key.proto, key.source_class, &service, slots, &counted));
    }
    Ok(frontends)
}

/// By address, port, protocol and source class.
fn sort_frontends(frontends: &mut [FrontendView]) {
    frontends.sort_by(|a, b| {
        (a.frontend.ip(), a.frontend.port(), a.protocol, a.source).cmp(&(
            b.frontend.ip(),
            b.frontend.port(),
            b.protocol,
            b.source,
        ))
    });
}

fn frontend_view(
    frontend: SocketAddr,
    protocol: u8,
    source: u8,
    service: &Service,
    slots: impl Iterator<Item = (SocketAddr, u32)>,
    counted: &dyn Fn(u32) -> (u64, u64),
) -> FrontendView {
    let mut by_backend: BTreeMap<SocketAddr, (u32, u32)> = BTreeMap::new();
    for (address, counter) in slots {
        by_backend.entry(address).or_insert((0, counter)).0 += 1;
    }
    let backends = by_backend
        .into_iter()
        .map(|(address, (slots, counter))| {
            let (packets, bytes) = counted(counter);
            BackendView {
                address,
                slots,
                packets,
                bytes,
                active_connections: None,
                inactive_connections: None,
            }
        })
        .collect();
    FrontendView {
        protocol: protocol_name(protocol),
        frontend,
        source: source_name(source),
        service_id: Some(service.service_id),
        service: None,
        flags: flag_names(service.flags, service.backend_count != 0),
        affinity_seconds: (service.affinity_timeout != 0).then_some(service.affinity_timeout),
        backends,
    }
}

/// `10.96.0.10` matches every port of that address; `10.96.0.10:53` and `[fd00::10]:53` one.
fn matches_frontend(frontend: &FrontendView, filter: &str) -> bool {
    match (filter.parse::<SocketAddr>(), filter.trim_matches(['[', ']']).parse::<IpAddr>()) {
        (Ok(address), _) => frontend.frontend == address,
        (_, Ok(ip)) => frontend.frontend.ip() == ip,
        _ => false,
    }
}

fn same_backends(a: &[BackendView], b: &[BackendView]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(a, b)| (a.address, a.slots) == (b.address, b.slots))
}

fn services_text(frontends: &[FrontendView], mode: Mode) -> String {
    let mut text = String::new();
    let (service, columns) = match mode {
        Mode::Iptables => ("Service", ["Weight", "Conns", "Bytes"]),
        Mode::Ipvs => ("Id", ["Weight", "ActiveConn", "InActConn"]),
        _ => ("Id", ["Slots", "Packets", "Bytes"]),
    };
    let _ = writeln!(text, "{:<5} {:<42} {:<18} {:<6} Flags", "Prot", "Frontend", "From", service);
    let _ = writeln!(text, "  -> {:<38} {:>6} {:>12} {:>14}", "Backend", columns[0], columns[1], columns[2]);
    // Source classes that a frontend treats alike share one block: the counters belong to the
    // (frontend, backend) pair, not to a class.
    let mut index = 0;
    while index < frontends.len() {
        let frontend = &frontends[index];
        let alike = frontends[index..]
            .iter()
            .take_while(|other| {
                (other.frontend, other.protocol, &other.flags, other.affinity_seconds)
                    == (frontend.frontend, frontend.protocol, &frontend.flags, frontend.affinity_seconds)
                    && same_backends(&other.backends, &frontend.backends)
            })
            .count();
        let sources: Vec<&str> = frontends[index..index + alike].iter().map(|other| other.source).collect();
        index += alike;
        let mut flags = frontend.flags.join(",");
        if let Some(seconds) = frontend.affinity_seconds {
            flags.push_str(&format!("{}affinity {seconds}s", if flags.is_empty() { "" } else { "," }));
        }
        let service = match (&frontend.service, frontend.service_id) {
            (Some(name), _) => name.clone(),
            (None, Some(id)) => id.to_string(),
            (None, None) => "-".to_owned(),
        };
        let _ = writeln!(
            text,
            "{:<5} {:<42} {:<18} {:<6} {}",
            frontend.protocol,
            frontend.frontend.to_string(),
            sources.join(","),
            service,
            flags
        );
        for backend in &frontend.backends {
            let counts = match (backend.active_connections, backend.inactive_connections) {
                (Some(active), Some(inactive)) => (u64::from(active), u64::from(inactive)),
                _ => (backend.packets, backend.bytes),
            };
            let _ = writeln!(
                text,
                "  -> {:<38} {:>6} {:>12} {:>14}",
                backend.address.to_string(),
                backend.slots,
                counts.0,
                counts.1
            );
        }
    }
    text
}

/// An address, or an address and port, to filter by.
#[derive(Clone, Copy, Debug)]
enum Endpoint {
    Address(IpAddr),
    Socket(SocketAddr),
}

impl Endpoint {
    fn parse(text: &str) -> anyhow::Result<Self> {
        if let Ok(socket) = text.parse::<SocketAddr>() {
            return Ok(Self::Socket(socket));
        }
        text.trim_matches(['[', ']'])
            .parse::<IpAddr>()
            .map(Self::Address)
            .map_err(|_| anyhow::anyhow!("{text:?} is not an address or address:port"))
    }

    fn matches(self, address: SocketAddr) -> bool {
        match self {
            Self::Address(ip) => address.ip() == ip,
            Self::Socket(socket) => address == socket,
        }
    }
}

struct FlowFilter {
    frontend: Option<Endpoint>,
    backend: Option<Endpoint>,
    client: Option<Endpoint>,
}

impl FlowFilter {
    fn admits(&self, flow: &FlowView) -> bool {
        let matches =
            |filter: Option<Endpoint>, address: SocketAddr| filter.is_none_or(|f| f.matches(address));
        matches(self.frontend, flow.frontend)
            && matches(self.backend, flow.backend)
            && matches(self.client, flow.client)
    }
}

/// One tracked connection, from its forward entry (client to frontend).
#[derive(Debug, Serialize)]
pub struct FlowView {
    pub protocol: &'static str,
    pub client: SocketAddr,
    pub frontend: SocketAddr,
    pub backend: SocketAddr,
    /// The node's address and port the backend sees when the connection is masqueraded.
    pub masquerade: Option<SocketAddr>,
    /// `new`, `syn-sent`, `syn-recv`, `replied`, `established`, `closing` (a FIN seen),
    /// `reset`, or `tracked` (an entry of an earlier vipr without handshake tracking, or a
    /// conntrack entry in the iptables and ipvs modes).
    pub state: &'static str,
    /// Seconds since the client's latest packet (to about a second); none from conntrack.
    pub idle_seconds: Option<u64>,
}

/// The connections matching `filter`, the most recently active first, at most `limit`; the
/// total of matches is returned too.
#[derive(Debug, Serialize)]
pub struct FlowsView {
    pub matching: usize,
    pub shown: Vec<FlowView>,
}

fn state_name(protocol: u8, state: u32) -> &'static str {
    use proxy_common::flow_state::*;
    if state & RST != 0 {
        "reset"
    } else if state & FIN != 0 {
        "closing"
    } else if state & HANDSHAKE_TRACKED == 0 {
        "tracked"
    } else if state & ESTABLISHED != 0 {
        "established"
    } else if protocol == proto::TCP && state & SYN_ACK != 0 {
        "syn-recv"
    } else if state & REPLIED != 0 {
        "replied"
    } else if state & SYN != 0 {
        "syn-sent"
    } else {
        "new"
    }
}

fn flows(dir: &Path, filter: &FlowFilter, limit: usize) -> anyhow::Result<FlowsView> {
    let now = crate::dataplane::ebpf::reaper::monotonic_coarse_ns();
    let mut matching = forward_flows::<proxy_common::Flow4>(dir, pins::FLOWS4, now, filter)?;
    matching.extend(forward_flows::<proxy_common::Flow6>(dir, pins::FLOWS6, now, filter)?);
    let total = matching.len();
    matching.sort_by_key(|flow| (flow.idle_seconds, flow.frontend, flow.client));
    matching.truncate(limit);
    Ok(FlowsView { matching: total, shown: matching })
}

/// The connections of one family's flows map that `filter` admits, from their forward entries
/// (client to frontend; the reply entries say the same backwards).
fn forward_flows<F: TrackedFlow>(
    dir: &Path,
    pin: &str,
    now: u64,
    filter: &FlowFilter,
) -> anyhow::Result<Vec<FlowView>> {
    let mut flows = Vec::new();
    for entry in open_hash::<F::Key, F>(dir, pin)?.iter() {
        let (key, flow) = entry?;
        if flow.is_reply() {
            continue;
        }
        let [client, frontend, nat_source, nat_destination] = F::wire(&key, &flow);
        let rewrites = |bit: u32| flow.flags() & bit != 0;
        let protocol = F::proto(&key);
        let track = flow.track();
        let view = FlowView {
            protocol: protocol_name(protocol),
            client,
            frontend,
            backend: if rewrites(flow_flags::REWRITE_DESTINATION) { nat_destination } else { frontend },
            masquerade: rewrites(flow_flags::REWRITE_SOURCE).then_some(nat_source),
            state: state_name(protocol, track.state),
            idle_seconds: Some(now.saturating_sub(track.last_seen) / 1_000_000_000),
        };
        if filter.admits(&view) {
            flows.push(view);
        }
    }
    Ok(flows)
}

/// The conntrack entries to `frontends` (iptables and ipvs modes): a connection whose reply
/// comes from another address than the client asked for was sent to that backend; one whose
/// reply goes to another address than the client's was masqueraded. Node ports (listed on
/// the unspecified address) match on any address.
fn conntrack_flows(
    frontends: &[FrontendView],
    filter: &FlowFilter,
    limit: usize,
) -> anyhow::Result<FlowsView> {
    let served: std::collections::BTreeSet<(SocketAddr, &str)> =
        frontends.iter().map(|frontend| (frontend.frontend, frontend.protocol)).collect();
    let entries = conntrack::entries().context("cannot read the conntrack table")?;
    let mut matching: Vec<FlowView> = entries
        .into_iter()
        .filter_map(|entry| {
            let protocol = protocol_name(entry.original.protocol);
            let frontend = entry.original.dst;
            let any = SocketAddr::new(
                if frontend.is_ipv4() {
                    std::net::Ipv4Addr::UNSPECIFIED.into()
                } else {
                    std::net::Ipv6Addr::UNSPECIFIED.into()
                },
                frontend.port(),
            );
            if !served.contains(&(frontend, protocol)) && !served.contains(&(any, protocol)) {
                return None;
            }
            let client = entry.original.src;
            Some(FlowView {
                protocol,
                client,
                frontend,
                backend: entry.reply.src,
                masquerade: (entry.reply.dst != client).then_some(entry.reply.dst),
                state: "tracked",
                idle_seconds: None,
            })
        })
        .filter(|flow| filter.admits(flow))
        .collect();
    let total = matching.len();
    matching.sort_by_key(|flow| (flow.frontend, flow.client));
    matching.truncate(limit);
    Ok(FlowsView { matching: total, shown: matching })
}

fn flows_text(flows: &FlowsView) -> String {
    let mut text = format!(
        "{:<5} {:<30} {:<30} {:<30} {:<12} {:>5}  Masquerade\n",
        "Prot", "Client", "Frontend", "Backend", "State", "Idle"
    );
    for flow in &flows.shown {
        let _ = writeln!(
            text,
            "{:<5} {:<30} {:<30} {:<30} {:<12} {:>5}  {}",
            flow.protocol,
            flow.client.to_string(),
            flow.frontend.to_string(),
            flow.backend.to_string(),
            flow.state,
            flow.idle_seconds.map_or_else(|| "-".to_owned(), |seconds| format!("{seconds}s")),
            flow.masquerade.map_or_else(|| "-".to_owned(), |address| address.to_string())
        );
    }
    let _ = writeln!(text, "{} of {} matching connections shown", flows.shown.len(), flows.matching);
    text
}

/// One pinned map.
#[derive(Debug, Serialize)]
pub struct MapView {
    pub name: String,
    pub kind: String,
    /// For an array, its size: every index exists from the start.
    pub entries: u64,
    pub capacity: u32,
    /// A hash map or trie, which fills up; an array does not.
    pub fills: bool,
}

fn maps(dir: &Path) -> anyhow::Result<Vec<MapView>> {
    let mut maps = Vec::new();
    for entry in std::fs::read_dir(dir).with_context(|| format!("cannot list {}", dir.display()))? {
        let path = entry?.path();
        if path.is_dir() {
            continue;
        }
        let name = path.file_name().map(|name| name.to_string_lossy().into_owned()).unwrap_or_default();
        // Program pins and anything else that is no map are not listed.
        let Ok(info) = MapInfo::from_pin(&path) else { continue };
        let kind = info.map_type().map_or_else(|_| "unknown".to_owned(), |kind| format!("{kind:?}"));
        // Arrays hold every index from their creation on.
        let fills = !matches!(
            info.map_type(),
            Ok(MapType::Array | MapType::PerCpuArray | MapType::ProgramArray | MapType::DevMap)
        );
        let entries = if fills {
            let fd = info.fd().with_context(|| format!("cannot open {name}"))?;
            bpf_sys::count_keys(fd.as_fd(), bpf_sys::EntryLayout::of(&info), u64::from(info.max_entries()))
                .with_context(|| format!("cannot count {name}"))?
        } else {
            u64::from(info.max_entries())
        };
        maps.push(MapView { name, kind, entries, capacity: info.max_entries(), fills });
    }
    maps.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(maps)
}

/// The kernel's conntrack table as a map (iptables and ipvs modes): its entries in this
/// network namespace against `nf_conntrack_max`. A full table drops new connections.
fn conntrack_table() -> anyhow::Result<MapView> {
    let read = |name: &str| -> anyhow::Result<u64> {
        let path = Path::new("/proc/sys/net/netfilter").join(name);
        let text =
            std::fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
        text.trim().parse().with_context(|| format!("{} holds {text:?}", path.display()))
    };
    Ok(MapView {
        name: "conntrack".to_owned(),
        kind: "netfilter".to_owned(),
        entries: read("nf_conntrack_count")?,
        capacity: u32::try_from(read("nf_conntrack_max")?).unwrap_or(u32::MAX),
        fills: true,
    })
}

fn maps_text(maps: &[MapView]) -> String {
    let mut text =
        format!("{:<20} {:<14} {:>10} {:>10} {:>6}\n", "Map", "Type", "Entries", "Capacity", "Full");
    for map in maps {
        let full = match map.capacity {
            _ if !map.fills => "-".to_owned(),
            0 => "0.0%".to_owned(),
            capacity => format!("{:.1}%", 100.0 * map.entries as f64 / f64::from(capacity)),
        };
        let _ = writeln!(
            text,
            "{:<20} {:<14} {:>10} {:>10} {:>6}",
            map.name, map.kind, map.entries, map.capacity, full
        );
    }
    text
}

/// One program link pinned for a device.
#[derive(Debug, Serialize)]
pub struct DeviceView {
    pub device: String,
    /// `tc-ingress`, `xdp-native` or `xdp-generic`.
    pub program: String,
    /// The device exists now (a link to a device that is gone no longer does anything).
    pub present: bool,
}

fn devices(dir: &Path) -> anyhow::Result<Vec<DeviceView>> {
    let links = dir.join(pins::LINKS_DIR);
    let mut devices = Vec::new();
    let Ok(entries) = std::fs::read_dir(&links) else { return Ok(devices) };
    for entry in entries {
        let name = entry?.file_name().to_string_lossy().into_owned();
        if name.starts_with("cgroup-") {
            continue;
        }
        let (program, device) = ["xdp-native-", "xdp-generic-"]
            .iter()
            .find_map(|prefix| Some((prefix.trim_end_matches('-').to_owned(), name.strip_prefix(prefix)?)))
            .unwrap_or(("tc-ingress".to_owned(), &name));
        let present = std::ffi::CString::new(device)
            // SAFETY: a valid C string for the duration of the call.
            .is_ok_and(|device| unsafe { libc::if_nametoindex(device.as_ptr()) } != 0);
        devices.push(DeviceView { device: device.to_owned(), program, present });
    }
    devices.sort_by(|a, b| (&a.device, &a.program).cmp(&(&b.device, &b.program)));
    Ok(devices)
}

fn devices_text(devices: &[DeviceView]) -> String {
    let mut text = format!("{:<16} {:<12} {}\n", "Device", "Program", "State");
    for device in devices {
        let state = if device.present { "attached" } else { "device gone" };
        let _ = writeln!(text, "{:<16} {:<12} {state}", device.device, device.program);
    }
    text
}

/// The agent's record against the pins.
#[derive(Debug, Serialize)]
pub struct DriftView {
    /// The record compared with, and when the agent wrote it.
    pub record: PathBuf,
    pub recorded_unix_seconds: u64,
    /// Entries compared (services entries and classifier entries the agent wants).
    pub wanted_entries: usize,
    pub differences: Vec<record::Difference>,
}

fn drift(pin_dir: &Path, record_path: &Path) -> anyhow::Result<DriftView> {
    let recorded = record::read(record_path)?;
    let same_dir = |a: &Path, b: &Path| {
        a == b || a.canonicalize().ok().is_some_and(|a| b.canonicalize().ok() == Some(a))
    };
    anyhow::ensure!(
        same_dir(&recorded.pin_dir, pin_dir),
        "{} records the datapath pinned at {}, not {} (pass the agent's --bpf-root and --state-dir)",
        record_path.display(),
        recorded.pin_dir.display(),
        pin_dir.display()
    );
    let kernel = record::Entries::pinned(pin_dir)?;
    let wanted = &recorded.entries;
    Ok(DriftView {
        record: record_path.to_owned(),
        recorded_unix_seconds: recorded.written_unix_seconds,
        wanted_entries: wanted.services.len() + wanted.classifiers.values().map(BTreeMap::len).sum::<usize>(),
        differences: record::compare(wanted, &kernel),
    })
}

fn drift_text(drift: &DriftView) -> String {
    let age = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |now| now.as_secs())
        .saturating_sub(drift.recorded_unix_seconds);
    let mut text = format!(
        "Desired state: {} ({} entries, recorded {age}s ago)\n",
        drift.record.display(),
        drift.wanted_entries
    );
    if drift.differences.is_empty() {
        text.push_str("No drift: the kernel holds what the agent wants.\n");
        return text;
    }
    let _ = writeln!(text, "{:<10} {:<16} {:<40} Content", "Drift", "Map", "Entry");
    for difference in &drift.differences {
        // One line per side that has the entry: `wanted:` (missing, different), `kernel:`
        // (extra, different).
        let sides = [("wanted", &difference.wanted), ("kernel", &difference.kernel)];
        let mut first = true;
        for (side, content) in sides {
            let Some(content) = content else { continue };
            let (kind, map, key) = if first {
                (difference.kind, difference.map.as_str(), difference.key.as_str())
            } else {
                ("", "", "")
            };
            let _ = writeln!(text, "{kind:<10} {map:<16} {key:<40} {side}: {content}");
            first = false;
        }
    }
    let _ = writeln!(
        text,
        "{} entries differ (a sync in progress can show briefly: run again to confirm)",
        drift.differences.len()
    );
    text
}
