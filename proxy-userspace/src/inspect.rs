//! `vipr inspect`: what this node's eBPF datapath holds, read from its pinned maps, as
//! `ipvsadm -Ln` shows IPVS: each frontend with its flags and backends, every map's fill
//! against its capacity, the devices vipr is attached to. It reads the pins only, so it works
//! while the agent runs and after it stopped (the datapath keeps serving then).
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
use proxy_common::{
    flow_flags, pins, proto, service_flags, source_class, Backend4, Backend6, BackendSlot, Service,
};
use serde::Serialize;

use crate::{
    bpf_sys,
    dataplane::ebpf::{counters::CounterMap, reaper::TrackedFlow},
};

#[derive(Parser, Debug)]
#[command(
    name = "vipr inspect",
    about = "Shows what this node's eBPF datapath holds (read from its pinned maps)"
)]
pub struct InspectArgs {
    #[command(subcommand)]
    view: View,
    /// Where the bpffs is: vipr's pins are under `<bpf-root>/vipr`.
    #[arg(long, global = true, default_value = "/sys/fs/bpf")]
    bpf_root: PathBuf,
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
    /// Every pinned map: its type, entries and capacity.
    Maps,
    /// The devices with a pinned program link (TC ingress, XDP).
    Devices,
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
        Ok(text) => {
            print!("{text}");
            ExitCode::SUCCESS
        }
        Err(error) => {
            eprintln!("vipr inspect: {error:#}");
            ExitCode::FAILURE
        }
    }
}

/// The view `args` asks for, as it is printed.
pub fn render(args: &InspectArgs) -> anyhow::Result<String> {
    let dir = args.bpf_root.join(pins::DIR);
    anyhow::ensure!(
        dir.is_dir(),
        "{} does not exist: vipr's eBPF datapath is not installed here",
        dir.display()
    );
    match &args.view {
        View::Services { frontend } => {
            let mut frontends = services(&dir)?;
            if let Some(filter) = frontend {
                frontends.retain(|frontend| matches_frontend(frontend, filter));
            }
            Ok(match args.output {
                Output::Json => json(&frontends)?,
                Output::Text => services_text(&frontends),
            })
        }
        View::Flows { frontend, backend, client, limit } => {
            let filter = FlowFilter {
                frontend: frontend.as_deref().map(Endpoint::parse).transpose()?,
                backend: backend.as_deref().map(Endpoint::parse).transpose()?,
                client: client.as_deref().map(Endpoint::parse).transpose()?,
            };
            let flows = flows(&dir, &filter, *limit)?;
            Ok(match args.output {
                Output::Json => json(&flows)?,
                Output::Text => flows_text(&flows),
            })
        }
        View::Maps => {
            let maps = maps(&dir)?;
            Ok(match args.output {
                Output::Json => json(&maps)?,
                Output::Text => maps_text(&maps),
            })
        }
        View::Devices => {
            let devices = devices(&dir)?;
            Ok(match args.output {
                Output::Json => json(&devices)?,
                Output::Text => devices_text(&devices),
            })
        }
    }
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
    pub source: &'static str,
    pub service_id: u32,
    pub flags: Vec<&'static str>,
    /// ClientIP affinity's timeout; none without affinity.
    pub affinity_seconds: Option<u32>,
    pub backends: Vec<BackendView>,
}

#[derive(Debug, Serialize)]
pub struct BackendView {
    pub address: SocketAddr,
    /// How many of the frontend's slots hold it: 1 each with random choice, its share of
    /// the table with Maglev.
    pub slots: u32,
    /// Since the agent programmed this (frontend, backend) pair, both directions.
    pub packets: u64,
    pub bytes: u64,
}

fn protocol_name(number: u8) -> &'static str {
    match number {
        proto::TCP => "TCP",
        proto::UDP => "UDP",
        proto::SCTP => "SCTP",
        _ => "?",
    }
}

fn source_name(class: u8) -> &'static str {
    match class {
        source_class::OUTSIDE => "outside",
        source_class::POD => "pod",
        source_class::NODE => "node",
        _ => "?",
    }
}

fn flag_names(service: &Service) -> Vec<&'static str> {
    let mut names = Vec::new();
    for (bit, name) in [
        (service_flags::MASQUERADE, "masquerade"),
        (service_flags::REJECT_WHEN_EMPTY, "reject-when-empty"),
        (service_flags::SOURCE_RANGES, "source-ranges"),
        (service_flags::MAGLEV, "maglev"),
    ] {
        if service.flags & bit != 0 {
            names.push(name);
        }
    }
    if service.backend_count == 0 {
        names.push(if service.flags & service_flags::REJECT_WHEN_EMPTY != 0 { "rejects" } else { "drops" });
    }
    names
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
    frontends.sort_by(|a, b| {
        (a.frontend.ip(), a.frontend.port(), a.protocol, a.source).cmp(&(
            b.frontend.ip(),
            b.frontend.port(),
            b.protocol,
            b.source,
        ))
    });
    Ok(frontends)
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
            BackendView { address, slots, packets, bytes }
        })
        .collect();
    FrontendView {
        protocol: protocol_name(protocol),
        frontend,
        source: source_name(source),
        service_id: service.service_id,
        flags: flag_names(service),
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

fn services_text(frontends: &[FrontendView]) -> String {
    let mut text = String::new();
    let _ = writeln!(text, "{:<5} {:<42} {:<18} {:<6} Flags", "Prot", "Frontend", "From", "Id");
    let _ = writeln!(text, "  -> {:<38} {:>6} {:>12} {:>14}", "Backend", "Slots", "Packets", "Bytes");
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
        let _ = writeln!(
            text,
            "{:<5} {:<42} {:<18} {:<6} {}",
            frontend.protocol,
            frontend.frontend.to_string(),
            sources.join(","),
            frontend.service_id,
            flags
        );
        for backend in &frontend.backends {
            let _ = writeln!(
                text,
                "  -> {:<38} {:>6} {:>12} {:>14}",
                backend.address.to_string(),
                backend.slots,
                backend.packets,
                backend.bytes
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
    /// `reset`, or `tracked` (an entry of an earlier vipr without handshake tracking).
    pub state: &'static str,
    /// Seconds since the client's latest packet (to about a second).
    pub idle_seconds: u64,
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
            idle_seconds: now.saturating_sub(track.last_seen) / 1_000_000_000,
        };
        if filter.admits(&view) {
            flows.push(view);
        }
    }
    Ok(flows)
}

fn flows_text(flows: &FlowsView) -> String {
    let mut text = format!(
        "{:<5} {:<30} {:<30} {:<30} {:<12} {:>5}  Masquerade\n",
        "Prot", "Client", "Frontend", "Backend", "State", "Idle"
    );
    for flow in &flows.shown {
        let _ = writeln!(
            text,
            "{:<5} {:<30} {:<30} {:<30} {:<12} {:>4}s  {}",
            flow.protocol,
            flow.client.to_string(),
            flow.frontend.to_string(),
            flow.backend.to_string(),
            flow.state,
            flow.idle_seconds,
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
            bpf_sys::count_keys(fd.as_fd(), info.key_size(), u64::from(info.max_entries()))
                .with_context(|| format!("cannot count {name}"))?
        } else {
            u64::from(info.max_entries())
        };
        maps.push(MapView { name, kind, entries, capacity: info.max_entries(), fills });
    }
    maps.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(maps)
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
