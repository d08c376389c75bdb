//! The `datapath` suite: what `vipr_tc_ingress` costs per packet, by path, measured with
//! BPF_PROG_TEST_RUN on maps that the agent itself programmed.
//!
//! For every cell of the grid (services × backends per service) the agent's own code fills a
//! fresh bpffs (`EbpfDataplane::sync` of the translated cluster), and a second copy of the
//! object, loaded with the same pin directory, runs frames through the program on those
//! maps. The kernel reuses one buffer for all `repeat` runs of a BPF_PROG_TEST_RUN, so a
//! rewriting program sees its own output from the second run on; three methods deal with it,
//! each with a baseline of an empty TC program measured the same way and subtracted:
//!
//! - **repeat** (warm): `repeat` = N for paths whose output equals their input: the miss,
//!   and flow entries that map a packet to itself (established, reply; the checksum helpers
//!   do the same work whatever the new value).
//! - **chain** (warm new flows): `repeat` = N over N extra frontends written next to the
//!   cell's services, frontend k's backend being frontend k+1: the packet each run leaves
//!   behind is the next run's new flow (flow miss, service hit, backend, two flow inserts,
//!   rewrite). The output must be addressed to frontend N and the flows map must hold
//!   exactly 2N entries afterwards, or the chain broke somewhere.
//! - **single** (cold): `repeat` = 1, one call per packet, each packet a new flow from its own
//!   client address and port to the cell's own services. The kernel's measurement then
//!   includes its timer's reading, which the empty program's run, interleaved packet by
//!   packet, measures; and the program runs with the caches and branch predictors the
//!   system call left it, which makes these numbers an upper bound.
//!
//! The flows map is emptied before every new-flow measurement, so it never fills.
//! Every run's verdict and output frame are checked, so a path measures what it claims.

use std::{
    net::Ipv4Addr,
    os::fd::{AsFd as _, BorrowedFd, OwnedFd},
    path::{Path, PathBuf},
    time::Instant,
};

use anyhow::{bail, ensure, Context as _, Result};
use aya::{
    maps::HashMap,
    programs::{SchedClassifier, Xdp},
    Ebpf, EbpfLoader,
};
use proxy_common::{
    flow_flags, pins, service_flags, source_class, Backend4, BackendSlot, Flow4, FlowKey4, Service,
    ServiceKey4,
};
use serde::{Deserialize, Serialize};
use vipr::dataplane::{
    ebpf::{BpfMapSizes, EbpfDataplane, EbpfOptions, HostTrafficOptions, PinDir},
    Dataplane as _,
};

use super::{
    cluster::{client_ip, cluster_ip, endpoint_ip, Cluster, SERVICE_PORT, TARGET_PORT},
    frame,
    meta::RunMeta,
    stats::{self, Summary},
    sys::{self, BpfMount, PrivateCgroup, NODE_IP},
};

/// TC verdicts as BPF_PROG_TEST_RUN returns them.
const TC_ACT_UNSPEC: u32 = -1i32 as u32;
const TC_ACT_REDIRECT: u32 = 7;
const XDP_TX: u32 = 3;
const PROTO_TCP: u8 = 6;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Settings {
    /// Repetitions of every measurement (medians and spreads are over these).
    pub repetitions: usize,
    /// `repeat` of the repeat method.
    pub repeat: u32,
    /// Packets per repetition of the single method.
    pub samples: usize,
    /// Frontends in the chain method's chain (its `repeat`).
    pub chain: usize,
    /// The services axis (with `default_backends` each).
    pub services_axis: Vec<usize>,
    pub default_backends: usize,
    /// The backends-per-service axis (with `backends_axis_services` services).
    pub backends_axis: Vec<usize>,
    pub backends_axis_services: usize,
    /// Another build of vipr's eBPF object (with the same maps) measured beside this build's
    /// on the same maps, path by path in the same rounds: a refactoring's cost, free of the
    /// machine's drift between two runs.
    #[serde(default)]
    pub baseline_object: Option<PathBuf>,
}

impl Settings {
    pub fn full() -> Self {
        Self {
            repetitions: 15,
            repeat: 100_000,
            samples: 2_000,
            chain: 200,
            services_axis: vec![1, 1_000, 10_000, 100_000],
            default_backends: 10,
            backends_axis: vec![1, 10, 100, 1_000],
            backends_axis_services: 1_000,
            baseline_object: None,
        }
    }

    pub fn quick() -> Self {
        Self {
            repetitions: 3,
            repeat: 10_000,
            samples: 200,
            chain: 200,
            services_axis: vec![1, 1_000],
            default_backends: 10,
            backends_axis: vec![1, 10],
            backends_axis_services: 1_000,
            baseline_object: None,
        }
    }

    /// The grid: the services axis, then the backends axis (without the cell they share).
    pub fn cells(&self) -> Vec<(usize, usize)> {
        let mut cells: Vec<(usize, usize)> =
            self.services_axis.iter().map(|&services| (services, self.default_backends)).collect();
        for &backends in &self.backends_axis {
            let cell = (self.backends_axis_services, backends);
            if !cells.contains(&cell) {
                cells.push(cell);
            }
        }
        cells
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PathKind {
    /// A pod's first packet to a service (chain method): flow miss, source class, service hit,
    /// backend slot, two flow inserts, destination rewrite, route lookup, redirect.
    NewFlow,
    /// A packet of a tracked connection toward the service: flow hit, destination rewrite,
    /// route lookup, redirect.
    Established,
    /// A backend's reply: flow hit, source rewrite back to the frontend, route, redirect.
    Reply,
    /// A packet to no service (pod to pod through the node): flow miss, source class, service
    /// miss, unmatched-destination lookup, left to the stack.
    Miss,
    /// A pod's first packet to the last-inserted service, one packet per call.
    NewFlowCold,
    /// The same from outside the cluster CIDR: masqueraded, so the reply entry is claimed with
    /// BPF_NOEXIST and the source is rewritten too.
    NewFlowMasqueradeCold,
    /// A pod's first packet to a random service each time (a big table's cache misses).
    NewFlowSpreadCold,
    /// The established packet, one per call: how much the cold method adds.
    EstablishedCold,
}

impl PathKind {
    pub const ALL: [Self; 8] = [
        Self::NewFlow,
        Self::Established,
        Self::Reply,
        Self::Miss,
        Self::NewFlowCold,
        Self::NewFlowMasqueradeCold,
        Self::NewFlowSpreadCold,
        Self::EstablishedCold,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Self::NewFlow => "new flow",
            Self::Established => "established",
            Self::Reply => "reply",
            Self::Miss => "miss (no service)",
            Self::NewFlowCold => "new flow, cold",
            Self::NewFlowMasqueradeCold => "new flow from outside (masqueraded), cold",
            Self::NewFlowSpreadCold => "new flow to a random service, cold",
            Self::EstablishedCold => "established, cold",
        }
    }

    fn is_new_flow(self) -> bool {
        matches!(
            self,
            Self::NewFlow | Self::NewFlowCold | Self::NewFlowMasqueradeCold | Self::NewFlowSpreadCold
        )
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Method {
    Repeat,
    Chain,
    Single,
}

impl Method {
    pub fn label(self) -> &'static str {
        match self {
            Self::Repeat => "repeat",
            Self::Chain => "chain",
            Self::Single => "one per call",
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PathResult {
    pub path: PathKind,
    pub method: Method,
    /// ns per packet as the kernel measured it, over repetitions (single method: each
    /// repetition's median packet).
    pub measured: Summary,
    /// ns per packet of the program itself: `measured` less the empty program measured the
    /// same way.
    pub program: Summary,
    /// Single method: the 10th and 90th percentile over every packet (program cost).
    pub p10: Option<f64>,
    pub p90: Option<f64>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Cell {
    pub services: usize,
    pub backends_per_service: usize,
    /// Entries the agent wrote: services map (one per frontend and source class) and
    /// backend slots (the chain method's frontends come on top).
    pub service_entries: usize,
    pub backend_slots: usize,
    /// Seconds to translate and program the cell (not measured per packet; informative).
    pub setup_seconds: f64,
    /// What the agent could not program in this cell.
    #[serde(default)]
    pub notes: Vec<String>,
    pub paths: Vec<PathResult>,
    /// The same paths run by `Settings::baseline_object`, when one was given.
    #[serde(default)]
    pub baseline_paths: Vec<PathResult>,
    /// The floor program (`sys::FloorProgram`) on the established path's packet, repeat
    /// method, ns per packet less the empty program: what no load balancer can avoid.
    #[serde(default)]
    pub floor: Option<Summary>,
    /// The new-flow floor (`sys::FloorProgram::load_new_flow`: the floor plus a connection
    /// table's miss and insert) on the chain method's packets, ns per packet less the empty
    /// program: what no load balancer that keeps its connections on their backends can avoid
    /// for a connection's first packet.
    #[serde(default)]
    pub new_flow_floor: Option<Summary>,
    /// The XDP program (`vipr_xdp`) on the established path's packet received on the uplink,
    /// repeat method, ns per packet less an empty XDP program.
    #[serde(default)]
    pub xdp_established: Option<Summary>,
}

impl Cell {
    pub fn path(&self, kind: PathKind) -> Option<&PathResult> {
        self.paths.iter().find(|path| path.path == kind)
    }

    pub fn baseline_path(&self, kind: PathKind) -> Option<&PathResult> {
        self.baseline_paths.iter().find(|path| path.path == kind)
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Results {
    pub meta: RunMeta,
    pub settings: Settings,
    /// The empty TC program, ns per packet: repeat method, and single method (which includes
    /// the kernel timer's overhead).
    pub empty_repeat: Summary,
    pub empty_single: Summary,
    pub cells: Vec<Cell>,
}

impl Results {
    pub fn cell(&self, services: usize, backends: usize) -> Option<&Cell> {
        self.cells.iter().find(|cell| cell.services == services && cell.backends_per_service == backends)
    }
}

pub fn run(meta: RunMeta, settings: Settings) -> Result<Results> {
    sys::set_up_network()?;
    let cgroup = PrivateCgroup::new()?;
    let empty = sys::load_empty_tc_program()?;
    let baseline_object = match &settings.baseline_object {
        Some(path) => Some(std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?),
        None => None,
    };
    let mut baselines = Baselines::default();
    let mut cells = Vec::new();
    for (services, backends) in settings.cells() {
        eprintln!("datapath: programming {services} services x {backends} backends");
        let cell = CellBench::set_up(
            &settings,
            empty.as_fd(),
            &cgroup,
            services,
            backends,
            baseline_object.as_deref(),
        )
        .with_context(|| format!("{services} services x {backends} backends per service"))?;
        cells.push(cell);
    }
    // Round robin over the cells, so that the machine's slow and fast phases (other work, the
    // hypervisor) fall on every cell alike and the cells stay comparable.
    for repetition in 0..settings.repetitions {
        eprintln!("datapath: repetition {}/{}", repetition + 1, settings.repetitions);
        for cell in &mut cells {
            cell.measure_all(&mut baselines, repetition).with_context(|| {
                format!("{} services x {} backends per service", cell.services, cell.backends)
            })?;
        }
    }
    let cells = cells.into_iter().map(CellBench::finish).collect::<Result<Vec<_>>>()?;
    for cell in &cells {
        eprintln!("{} services x {} backends:", cell.services, cell.backends_per_service);
        for path in &cell.paths {
            eprintln!(
                "  {:<42} {:>8.1} ns/packet ({:.1}..{:.1}; measured {:.1})",
                path.path.label(),
                path.program.median,
                path.program.min,
                path.program.max,
                path.measured.median
            );
            if let Some(baseline) = cell.baseline_path(path.path) {
                eprintln!(
                    "  {:<42} {:>8.1} ns/packet ({:.1}..{:.1}): this build {:.3}x",
                    "  baseline object",
                    baseline.program.median,
                    baseline.program.min,
                    baseline.program.max,
                    path.program.median / baseline.program.median
                );
            }
        }
    }
    for cell in &cells {
        if let Some(floor) = &cell.floor {
            eprintln!(
                "{} services x {} backends: floor {:.1} ns/packet ({:.1}..{:.1}); established {:.2}x, new flow {:.2}x",
                cell.services,
                cell.backends_per_service,
                floor.median,
                floor.min,
                floor.max,
                cell.path(PathKind::Established).map_or(f64::NAN, |path| path.program.median / floor.median),
                cell.path(PathKind::NewFlow).map_or(f64::NAN, |path| path.program.median / floor.median),
            );
            if let Some(new_flow_floor) = &cell.new_flow_floor {
                eprintln!(
                    "  new-flow floor {:.1} ns/packet ({:.2}x the floor); vipr's new flow {:.2}x it",
                    new_flow_floor.median,
                    new_flow_floor.median / floor.median,
                    cell.path(PathKind::NewFlow)
                        .map_or(f64::NAN, |path| path.program.median / new_flow_floor.median),
                );
            }
        }
        if let Some(xdp) = &cell.xdp_established {
            eprintln!(
                "  established through XDP {:.1} ns/packet ({:.1}..{:.1}); {:.2}x TC's",
                xdp.median,
                xdp.min,
                xdp.max,
                cell.path(PathKind::Established).map_or(f64::NAN, |path| xdp.median / path.program.median),
            );
        }
    }
    let mut meta = meta;
    meta.finish();
    Ok(Results {
        meta,
        empty_repeat: Summary::of(&baselines.repeat).context("no baseline")?,
        empty_single: Summary::of(&baselines.single).context("no baseline")?,
        settings,
        cells,
    })
}

#[derive(Default)]
struct Baselines {
    repeat: Vec<f64>,
    single: Vec<f64>,
}

/// What one path measured so far.
struct Measurements {
    kind: PathKind,
    method: Method,
    measured: Vec<f64>,
    program: Vec<f64>,
    /// Single method: every packet's program cost.
    pooled: Vec<f64>,
}

impl Measurements {
    fn push(&mut self, (measured, program, pooled): (f64, f64, Vec<f64>)) {
        self.measured.push(measured);
        self.program.push(program);
        self.pooled.extend(pooled);
    }

    fn finish(self) -> Result<PathResult> {
        let pooled = stats::sorted(&self.pooled);
        Ok(PathResult {
            path: self.kind,
            method: self.method,
            measured: Summary::of(&self.measured).context("no repetitions")?,
            program: Summary::of(&self.program).context("no repetitions")?,
            p10: stats::percentile(&pooled, 10.0),
            p90: stats::percentile(&pooled, 90.0),
        })
    }
}

/// One cell of the grid, programmed and ready to measure.
struct CellBench<'a> {
    // Field order is drop order: the objects' descriptors before the bpffs they are pinned in.
    bench: Bench<'a>,
    /// `Settings::baseline_object` loaded on the same maps, and what it measured.
    baseline: Option<(Bench<'a>, Vec<Measurements>)>,
    _bpffs: BpfMount,
    services: usize,
    backends: usize,
    setup_seconds: f64,
    service_entries: usize,
    backend_slots: usize,
    notes: Vec<String>,
    /// The last-inserted service's address.
    vip: Ipv4Addr,
    established: Vec<u8>,
    reply: Vec<u8>,
    miss: Vec<u8>,
    /// Packets sent so far by the single method (every one from its own client).
    sent: usize,
    random: XorShift,
    paths: Vec<Measurements>,
    /// The floor program, its map holding one connection to each of the cell's services, and
    /// what it measured (program ns per repetition).
    floor: sys::FloorProgram,
    floor_ns: Vec<f64>,
    /// The new-flow floor, its service table holding the chain (frontend k to frontend k + 1),
    /// and what it measured.
    new_flow_floor: sys::FloorProgram,
    new_flow_floor_ns: Vec<f64>,
    /// The empty XDP program, the interface the established packet is received on, and what
    /// `vipr_xdp` measured on that packet (program ns per repetition).
    xdp_empty: OwnedFd,
    ifindex: u32,
    xdp_established_ns: Vec<f64>,
}

impl<'a> CellBench<'a> {
    fn set_up(
        settings: &'a Settings,
        empty: BorrowedFd<'a>,
        cgroup: &PrivateCgroup,
        services: usize,
        backends: usize,
        baseline_object: Option<&[u8]>,
    ) -> Result<Self> {
        let started = Instant::now();
        let notes = Vec::new();
        let bpffs = BpfMount::new()?;
        let defaults = BpfMapSizes::default();
        let sizes = BpfMapSizes {
            services: defaults.services.max(u32::try_from(3 * (services + settings.chain) + 1024)?),
            backends: defaults.backends.max(u32::try_from(services * backends + settings.chain + 1024)?),
            flows: defaults.flows,
            counters: defaults.counters.max(u32::try_from(services * backends + 1)?),
            // A cluster IP whose unmatched-destination entry does not fit is refused whole
            // (capacity::admit), as `--bpf-unmatched-max` documents.
            unmatched: defaults.unmatched.max(u32::try_from(services + 1024)?),
            ..defaults
        };
        {
            let cluster = Cluster::new(services, backends);
            let translation = cluster.translate();
            ensure!(
                translation.rejected.is_empty(),
                "the model rejected objects: {:?}",
                translation.rejected
            );
            let options = EbpfOptions {
                bpf_root: bpffs.path().to_owned(),
                devices: Vec::new(),
                map_sizes: sizes,
                conntrack: Default::default(),
                balancing: Default::default(),
                xdp: Default::default(),
                forwarding: Default::default(),
                lb_mode: Default::default(),
                lb_dsr_accept: None,
            };
            let host =
                HostTrafficOptions { cgroup_root: Some(cgroup.path().to_owned()), ..Default::default() };
            let mut dataplane =
                EbpfDataplane::start_with(&options, &host).context("starting the dataplane")?;
            let report = dataplane.sync(&translation.state).context("programming the cell")?;
            // The maps are sized for the cell: everything must have been programmed.
            ensure!(
                report.failed.is_empty() && report.refused.is_empty(),
                "the sync did not program everything: {} failed (e.g. {:?}), {} refused (e.g. {:?})",
                report.failed.len(),
                report.failed.first(),
                report.refused.len(),
                report.refused.first()
            );
        }
        let setup_seconds = started.elapsed().as_secs_f64();

        let mut bench = Bench::load(vipr::EBPF_OBJECT, bpffs.path(), sizes, empty, settings)?;
        bench.load_xdp()?;
        let service_entries = bench.count(pins::SERVICES4)?;
        let backend_slots = bench.count(pins::BACKENDS4)?;
        ensure!(service_entries == 3 * services, "{service_entries} service entries for {services} services");
        ensure!(backend_slots == services * backends, "{backend_slots} backend slots");
        bench.write_chain(settings.chain)?;

        let last = services - 1;
        let vip = cluster_ip(last);
        // Established: a tracked connection whose entry maps the packet to itself.
        let client_end = (client_ip(0), 40_001);
        bench.insert_flow(
            (client_end, (vip, SERVICE_PORT)),
            Flow4 {
                src_addr: [0; 4],
                src_port: 0,
                dst_addr: vip.octets(),
                dst_port: SERVICE_PORT,
                // Balanced from outside, as XDP's established packets are (TC ignores it).
                flags: flow_flags::REWRITE_DESTINATION | flow_flags::FROM_OUTSIDE,
                track: Default::default(),
                next_hop: Default::default(),
            },
        )?;
        // Reply: from the connection's backend back to the client, mapped to itself.
        let backend_end = (endpoint_ip(last, 0, backends), TARGET_PORT);
        bench.insert_flow(
            (backend_end, client_end),
            Flow4 {
                src_addr: backend_end.0.octets(),
                src_port: backend_end.1,
                dst_addr: [0; 4],
                dst_port: 0,
                flags: flow_flags::REPLY | flow_flags::REWRITE_SOURCE,
                track: Default::default(),
                next_hop: Default::default(),
            },
        )?;
        let measurements = || -> Vec<Measurements> {
            let method = |kind| match kind {
                PathKind::NewFlow => Method::Chain,
                PathKind::Established | PathKind::Reply | PathKind::Miss => Method::Repeat,
                _ => Method::Single,
            };
            PathKind::ALL
                .iter()
                .map(|&kind| Measurements {
                    kind,
                    method: method(kind),
                    measured: Vec::new(),
                    program: Vec::new(),
                    pooled: Vec::new(),
                })
                .collect()
        };
        // The floor's map holds one connection to each service, the established packet's last.
        let floor = sys::FloorProgram::load(u32::try_from(services + 16)?)?;
        for service in 0..services {
            let to = (cluster_ip(service).octets(), SERVICE_PORT);
            floor.insert((client_end.0.octets(), client_end.1), to, to, 1)?;
        }
        let links = u32::try_from(settings.chain)?;
        let new_flow_floor = sys::FloorProgram::load_new_flow(links + 16, links + 16)?;
        let client = chain_client();
        for link in 0..settings.chain {
            let (this, next) = (chain_frontend(link), chain_frontend(link + 1));
            new_flow_floor.insert(
                (client.0.octets(), client.1),
                (this.octets(), SERVICE_PORT),
                (next.octets(), SERVICE_PORT),
                1,
            )?;
        }
        let baseline = match baseline_object {
            Some(object) => Some((
                Bench::load(object, bpffs.path(), sizes, empty, settings)
                    .context("loading the baseline object")?,
                measurements(),
            )),
            None => None,
        };
        Ok(Self {
            bench,
            baseline,
            _bpffs: bpffs,
            services,
            backends,
            setup_seconds,
            service_entries,
            backend_slots,
            notes,
            vip,
            established: frame::tcp(client_end, (vip, SERVICE_PORT)),
            reply: frame::tcp(backend_end, client_end),
            // Pod to pod through the node.
            miss: frame::tcp((client_ip(0), 40_000), (Ipv4Addr::new(10, 2, 0, 9), TARGET_PORT)),
            sent: 0,
            random: XorShift(0x9e37_79b9_7f4a_7c15),
            paths: measurements(),
            floor,
            floor_ns: Vec::new(),
            new_flow_floor,
            new_flow_floor_ns: Vec::new(),
            xdp_empty: sys::load_empty_xdp_program()?,
            ifindex: sys::device_ifindex()?,
            xdp_established_ns: Vec::new(),
        })
    }

    /// One repetition of every path, by this build's object and the baseline's (which goes
    /// first alternates between repetitions, so that neither always runs on the other's
    /// caches).
    fn measure_all(&mut self, baselines: &mut Baselines, repetition: usize) -> Result<()> {
        for i in 0..self.paths.len() {
            let kind = self.paths[i].kind;
            let baseline_first = repetition % 2 == 1;
            if baseline_first {
                self.measure_baseline(i, kind)?;
            }
            let measured = self.measure_path(kind, false, baselines)?;
            self.paths[i].push(measured);
            if !baseline_first {
                self.measure_baseline(i, kind)?;
            }
        }
        self.measure_floor()?;
        self.measure_new_flow_floor()?;
        self.measure_xdp_established()
    }

    /// One repetition of `vipr_xdp` on the established packet, received on the uplink (repeat
    /// method, as TC's established path): flow hit, the hop cached in the entry, the rewrite,
    /// `XDP_TX` back out of the uplink, where the route to the service address leads.
    fn measure_xdp_established(&mut self) -> Result<()> {
        let (repeat, ifindex) = (self.bench.settings.repeat, self.ifindex);
        let mut out = std::mem::take(&mut self.bench.out);
        let empty = sys::test_run_xdp(self.xdp_empty.as_fd(), &self.established, &mut out, repeat, ifindex);
        let run = self
            .bench
            .xdp_program()
            .and_then(|program| sys::test_run_xdp(program, &self.established, &mut out, repeat, ifindex));
        self.bench.out = out;
        let (empty, run) = (empty?, run?);
        ensure!(run.verdict == XDP_TX, "vipr_xdp returned {} on the established packet", run.verdict);
        // Past the Ethernet addresses, which XDP writes toward the cached neighbour.
        ensure!(
            self.bench.out[12..run.out_len] == self.established[12..],
            "vipr_xdp changed the established packet (its entry maps it to itself)"
        );
        self.xdp_established_ns.push(f64::from(run.ns) - f64::from(empty.ns));
        Ok(())
    }

    /// One repetition of the floor program on the established packet (repeat method: its
    /// entry maps the packet to itself, so every run does the whole rewrite).
    fn measure_floor(&mut self) -> Result<()> {
        let repeat = self.bench.settings.repeat;
        let out = &mut self.bench.out;
        let empty = sys::test_run(self.bench.empty, &self.established, out, repeat)?;
        let run = sys::test_run(self.floor.program.as_fd(), &self.established, out, repeat)?;
        ensure!(run.verdict == TC_ACT_REDIRECT, "the floor program returned {}", run.verdict);
        ensure!(
            out[..run.out_len] == self.established[..],
            "the floor program changed the established packet (its entry maps it to itself)"
        );
        self.floor_ns.push(f64::from(run.ns) - f64::from(empty.ns));
        Ok(())
    }

    /// One repetition of the new-flow floor by the chain method, as vipr's warm new flow: a
    /// first uncounted run brings the chain into the caches, then one counted. After each,
    /// the packet must be addressed to the chain's end and the connection table must have
    /// recorded every link, which is then emptied for the next run.
    fn measure_new_flow_floor(&mut self) -> Result<()> {
        let links = self.bench.settings.chain;
        let client = chain_client();
        let recorded: Vec<([u8; 4], u16)> =
            (0..links).map(|link| (chain_frontend(link).octets(), SERVICE_PORT)).collect();
        for counted in [false, true] {
            let program = self.new_flow_floor.program.as_fd();
            let (empty, run) =
                run_chain(self.bench.empty, program, &mut self.bench.out, links, "the new-flow floor")?;
            self.new_flow_floor.forget_connections((client.0.octets(), client.1), &recorded)?;
            if counted {
                self.new_flow_floor_ns.push(f64::from(run.ns) - f64::from(empty.ns));
            }
        }
        Ok(())
    }

    fn measure_baseline(&mut self, index: usize, kind: PathKind) -> Result<()> {
        if self.baseline.is_some() {
            // The empty program's figures come from this build's rounds alone.
            let measured = self.measure_path(kind, true, &mut Baselines::default())?;
            if let Some((_, paths)) = &mut self.baseline {
                paths[index].push(measured);
            }
        }
        Ok(())
    }

    /// One repetition of one path by this build's object, or the baseline's: ns measured,
    /// ns of the program, and (single method) every packet's program cost.
    fn measure_path(
        &mut self,
        kind: PathKind,
        by_baseline: bool,
        baselines: &mut Baselines,
    ) -> Result<(f64, f64, Vec<f64>)> {
        let packets: Vec<(Vec<u8>, Rewrite)> = match kind {
            PathKind::NewFlowCold
            | PathKind::NewFlowMasqueradeCold
            | PathKind::NewFlowSpreadCold
            | PathKind::EstablishedCold => {
                (0..self.bench.settings.samples).map(|_| self.packet(kind)).collect()
            }
            _ => Vec::new(),
        };
        let bench = match &mut self.baseline {
            Some((baseline, _)) if by_baseline => baseline,
            _ => &mut self.bench,
        };
        Ok(match kind {
            PathKind::NewFlow => {
                // A first run brings the chain's entries into the caches (the other cells'
                // measurements pushed them out) and is not counted: warm means warm.
                bench.chain_once(kind, &mut Baselines::default())?;
                let (measured, program) = bench.chain_once(kind, baselines)?;
                (measured, program, Vec::new())
            }
            PathKind::Established => {
                let (m, p) = bench.repeat_once(kind, &self.established, TC_ACT_REDIRECT, baselines)?;
                (m, p, Vec::new())
            }
            PathKind::Reply => {
                let (m, p) = bench.repeat_once(kind, &self.reply, TC_ACT_REDIRECT, baselines)?;
                (m, p, Vec::new())
            }
            PathKind::Miss => {
                let (m, p) = bench.repeat_once(kind, &self.miss, TC_ACT_UNSPEC, baselines)?;
                (m, p, Vec::new())
            }
            PathKind::NewFlowCold
            | PathKind::NewFlowMasqueradeCold
            | PathKind::NewFlowSpreadCold
            | PathKind::EstablishedCold => bench.single_once(kind, &packets, baselines)?,
        })
    }

    /// The next packet of a single-method path, and what the program must do to it.
    fn packet(&mut self, kind: PathKind) -> (Vec<u8>, Rewrite) {
        let n = self.sent;
        self.sent += 1;
        // Every packet from its own client address and port.
        let port = 10_000 + (n % 50_000) as u16;
        let pod = (client_ip(n / 50_000), port);
        match kind {
            PathKind::NewFlowMasqueradeCold => {
                let outside = (Ipv4Addr::new(192, 168, 100 + (n / 50_000 % 100) as u8, 7), port);
                (frame::tcp(outside, (self.vip, SERVICE_PORT)), Rewrite::Masquerade(self.vip))
            }
            PathKind::NewFlowSpreadCold => {
                let target = cluster_ip(self.random.below(self.services));
                (frame::tcp(pod, (target, SERVICE_PORT)), Rewrite::Destination(target))
            }
            PathKind::EstablishedCold => (self.established.clone(), Rewrite::None),
            _ => (frame::tcp(pod, (self.vip, SERVICE_PORT)), Rewrite::Destination(self.vip)),
        }
    }

    fn finish(self) -> Result<Cell> {
        ensure!(
            self.bench.count(pins::FLOWS4)? == 2,
            "the flows map does not hold just the established and reply entries: a path created or lost some"
        );
        Ok(Cell {
            services: self.services,
            backends_per_service: self.backends,
            service_entries: self.service_entries,
            backend_slots: self.backend_slots,
            setup_seconds: self.setup_seconds,
            notes: self.notes,
            paths: self.paths.into_iter().map(Measurements::finish).collect::<Result<_>>()?,
            baseline_paths: match self.baseline {
                Some((_, paths)) => paths.into_iter().map(Measurements::finish).collect::<Result<_>>()?,
                None => Vec::new(),
            },
            floor: Summary::of(&self.floor_ns),
            new_flow_floor: Summary::of(&self.new_flow_floor_ns),
            xdp_established: Summary::of(&self.xdp_established_ns),
        })
    }
}

/// What a run must have done to the frame.
#[derive(Clone, Copy)]
enum Rewrite {
    /// Left it as it was (miss, or an entry that maps the packet to itself).
    None,
    /// Sent it to a backend instead of this frontend address.
    Destination(Ipv4Addr),
    /// That, and the source became the node.
    Masquerade(Ipv4Addr),
}

struct Bench<'a> {
    ebpf: Ebpf,
    empty: BorrowedFd<'a>,
    settings: &'a Settings,
    out: Vec<u8>,
}

impl<'a> Bench<'a> {
    /// A second copy of vipr's object (or another build's, `object`) on the maps the agent
    /// pinned under `bpf_root`.
    fn load(
        object: &[u8],
        bpf_root: &Path,
        sizes: BpfMapSizes,
        empty: BorrowedFd<'a>,
        settings: &'a Settings,
    ) -> Result<Self> {
        let mut loader = EbpfLoader::new();
        loader.default_map_pin_directory(PinDir::new(bpf_root).path());
        // The whole rewrite at ingress and `bpf_redirect_neigh` (`--bpf-forwarding=redirect`):
        // the program's full work for a forwarded packet. With the default, `stack`, the
        // kernel's forwarding path does the rest, which BPF_PROG_TEST_RUN cannot time.
        loader.override_global(proxy_common::forwarding::GLOBAL, &proxy_common::forwarding::REDIRECT, true);
        loader.map_max_entries(pins::SERVICES4, sizes.services);
        loader.map_max_entries(pins::BACKENDS4, sizes.backends);
        loader.map_max_entries(pins::FLOWS4, sizes.flows);
        let mut ebpf = loader.load(object).context("loading vipr's eBPF object")?;
        let program: &mut SchedClassifier = ebpf
            .program_mut(pins::TC_INGRESS_PROGRAM)
            .with_context(|| format!("no program {}", pins::TC_INGRESS_PROGRAM))?
            .try_into()?;
        program.load().context("loading the TC program")?;
        // Next hops cached, as under an agent that watches the routes (the cell's dataplane,
        // dropped by now, turned the cache off as it went).
        let mut generation: aya::maps::Array<_, u32> = aya::maps::Array::try_from(
            ebpf.map_mut(pins::ROUTE_GENERATION).context("route generation map missing")?,
        )?;
        generation.set(0, 1, 0)?;
        Ok(Self { ebpf, empty, settings, out: vec![0; 512] })
    }

    /// Loads the object's XDP program beside its TC program (on the same maps).
    fn load_xdp(&mut self) -> Result<()> {
        let program: &mut Xdp = self
            .ebpf
            .program_mut(pins::XDP_PROGRAM)
            .with_context(|| format!("no program {}", pins::XDP_PROGRAM))?
            .try_into()?;
        program.load().context("loading the XDP program")
    }

    fn xdp_program(&self) -> Result<BorrowedFd<'_>> {
        let program: &Xdp =
            self.ebpf.program(pins::XDP_PROGRAM).context("XDP program missing")?.try_into()?;
        Ok(program.fd()?.as_fd())
    }

    fn program(&self) -> Result<BorrowedFd<'_>> {
        let program: &SchedClassifier =
            self.ebpf.program(pins::TC_INGRESS_PROGRAM).context("program missing")?.try_into()?;
        Ok(program.fd()?.as_fd())
    }

    /// Runs vipr's program; the output frame is left in `self.out`.
    fn run_program(&mut self, input: &[u8], repeat: u32) -> Result<sys::Run> {
        let mut out = std::mem::take(&mut self.out);
        let run = self.program().and_then(|program| sys::test_run(program, input, &mut out, repeat));
        self.out = out;
        run
    }

    fn flows(&mut self) -> Result<HashMap<&mut aya::maps::MapData, FlowKey4, Flow4>> {
        let map = self.ebpf.map_mut(pins::FLOWS4).context("flows map missing")?;
        Ok(HashMap::try_from(map)?)
    }

    fn insert_flow(&mut self, (src, dst): ((Ipv4Addr, u16), (Ipv4Addr, u16)), flow: Flow4) -> Result<()> {
        self.flows()?.insert(flow_key(src, dst), flow, 0)?;
        Ok(())
    }

    /// Removes flow entries that new flows created; each must be there (so every packet of
    /// the measurement did create its two entries). Targeted, unlike iterating the map, which
    /// would scan all its buckets and flush the caches.
    fn remove_flows(&mut self, keys: &[FlowKey4]) -> Result<()> {
        let mut flows = self.flows()?;
        for key in keys {
            flows.remove(key).with_context(|| format!("flow entry {key:?} was not created"))?;
        }
        Ok(())
    }

    /// Entries in one of the object's hash maps, read as `K` -> `V`.
    fn count_as<K: aya::Pod, V: aya::Pod>(&self, name: &str) -> Result<usize> {
        let map = self.ebpf.map(name).with_context(|| format!("no map {name}"))?;
        let map = HashMap::<_, K, V>::try_from(map)?;
        let mut count = 0;
        for key in map.keys() {
            key?;
            count += 1;
        }
        Ok(count)
    }

    fn count(&self, name: &str) -> Result<usize> {
        match name {
            pins::SERVICES4 => self.count_as::<ServiceKey4, Service>(name),
            pins::BACKENDS4 => self.count_as::<BackendSlot, Backend4>(name),
            pins::FLOWS4 => self.count_as::<FlowKey4, Flow4>(name),
            _ => bail!("no key type known for {name}"),
        }
    }

    fn check(
        &self,
        kind: PathKind,
        run: sys::Run,
        input: &[u8],
        verdict: u32,
        rewrite: Rewrite,
    ) -> Result<()> {
        let out = &self.out[..run.out_len.min(self.out.len())];
        ensure!(
            run.verdict == verdict,
            "{}: verdict {} ({}), expected {verdict}",
            kind.label(),
            run.verdict,
            run.verdict as i32
        );
        let (src, dst) = (frame::addr(out, frame::SRC_ADDR), frame::addr(out, frame::DST_ADDR));
        match rewrite {
            // Past the Ethernet addresses, which a redirect to a resolved neighbour writes.
            Rewrite::None => ensure!(
                out.len() == input.len() && out.get(12..) == input.get(12..),
                "{}: the program changed the frame",
                kind.label()
            ),
            Rewrite::Destination(vip) => ensure!(
                dst.is_some_and(|dst| dst != vip) && src == frame::addr(input, frame::SRC_ADDR),
                "{}: the destination was not rewritten to a backend ({dst:?})",
                kind.label()
            ),
            Rewrite::Masquerade(vip) => ensure!(
                dst.is_some_and(|dst| dst != vip) && src == Some(Ipv4Addr::from(NODE_IP)),
                "{}: not masqueraded to the node ({src:?} -> {dst:?})",
                kind.label()
            ),
        }
        Ok(())
    }

    /// The chain method's frontends: `links` of them beside the cell's services (their own
    /// address range and backend sets), each with the flags the agent gives a cluster IP per
    /// source class and one backend: the next frontend.
    fn write_chain(&mut self, links: usize) -> Result<()> {
        let mut backends: HashMap<_, BackendSlot, Backend4> =
            HashMap::try_from(self.ebpf.map_mut(pins::BACKENDS4).context("backends map missing")?)?;
        for link in 0..links {
            let next = chain_frontend(link + 1);
            let slot = BackendSlot { backend_set: CHAIN_SETS + link as u32, slot: 0 };
            backends.insert(
                slot,
                Backend4 { addr: next.octets(), port: SERVICE_PORT, pad: 0, counter: 0 },
                0,
            )?;
        }
        let mut services: HashMap<_, ServiceKey4, Service> =
            HashMap::try_from(self.ebpf.map_mut(pins::SERVICES4).context("services map missing")?)?;
        for link in 0..links {
            for class in [source_class::OUTSIDE, source_class::POD, source_class::NODE] {
                let key = ServiceKey4 {
                    addr: chain_frontend(link).octets(),
                    port: SERVICE_PORT,
                    proto: PROTO_TCP,
                    source_class: class,
                };
                let masquerade = if class == source_class::POD { 0 } else { service_flags::MASQUERADE };
                let service = Service {
                    backend_set: CHAIN_SETS + link as u32,
                    backend_count: 1,
                    service_id: CHAIN_SETS + link as u32,
                    flags: masquerade | service_flags::REJECT_WHEN_EMPTY,
                    ..Service::default()
                };
                services.insert(key, service, 0)?;
            }
        }
        Ok(())
    }

    /// One repetition of the chain method: one run of `chain` packets, each a new flow from a
    /// pod to the next frontend of the chain. Returns ns per packet, measured and the
    /// program's own.
    fn chain_once(&mut self, kind: PathKind, baselines: &mut Baselines) -> Result<(f64, f64)> {
        let links = self.settings.chain;
        let client = chain_client();
        let mut out = std::mem::take(&mut self.out);
        let runs =
            self.program().and_then(|program| run_chain(self.empty, program, &mut out, links, kind.label()));
        self.out = out;
        let (empty, run) = runs?;
        let created: Vec<FlowKey4> = (0..links)
            .flat_map(|link| {
                let (this, next) =
                    ((chain_frontend(link), SERVICE_PORT), (chain_frontend(link + 1), SERVICE_PORT));
                [flow_key(client, this), flow_key(next, client)]
            })
            .collect();
        self.remove_flows(&created)?;
        baselines.repeat.push(f64::from(empty.ns));
        Ok((f64::from(run.ns), f64::from(run.ns) - f64::from(empty.ns)))
    }

    /// One repetition of the repeat method, for paths whose output is their input.
    fn repeat_once(
        &mut self,
        kind: PathKind,
        input: &[u8],
        verdict: u32,
        baselines: &mut Baselines,
    ) -> Result<(f64, f64)> {
        let repeat = self.settings.repeat;
        let empty = sys::test_run(self.empty, input, &mut self.out, repeat)?;
        let run = self.run_program(input, repeat)?;
        self.check(kind, run, input, verdict, Rewrite::None)?;
        baselines.repeat.push(f64::from(empty.ns));
        Ok((f64::from(run.ns), f64::from(run.ns) - f64::from(empty.ns)))
    }

    /// One repetition of the single method: every packet in its own call, each right after
    /// the empty program's run on it. Returns the median packet, measured and the program's
    /// own, and every packet's own cost. New flows' entries are removed afterwards.
    fn single_once(
        &mut self,
        kind: PathKind,
        packets: &[(Vec<u8>, Rewrite)],
        baselines: &mut Baselines,
    ) -> Result<(f64, f64, Vec<f64>)> {
        let mut created = Vec::new();
        let (mut empty_ns, mut prog_ns) =
            (Vec::with_capacity(packets.len()), Vec::with_capacity(packets.len()));
        for (input, rewrite) in packets {
            empty_ns.push(f64::from(sys::test_run(self.empty, input, &mut self.out, 1)?.ns));
            let run = self.run_program(input, 1)?;
            self.check(kind, run, input, TC_ACT_REDIRECT, *rewrite)?;
            prog_ns.push(f64::from(run.ns));
            if kind.is_new_flow() {
                // The forward entry is the packet as it came; the reply entry the packet as it
                // left, turned around.
                created.push(frame_key(input, false)?);
                created.push(frame_key(&self.out[..run.out_len], true)?);
            }
        }
        self.remove_flows(&created)?;
        let empty = stats::median(&empty_ns).context("no packets")?;
        let median = stats::median(&prog_ns).context("no packets")?;
        baselines.single.push(empty);
        Ok((median, median - empty, prog_ns.iter().map(|ns| ns - empty).collect()))
    }
}

fn flow_key(src: (Ipv4Addr, u16), dst: (Ipv4Addr, u16)) -> FlowKey4 {
    FlowKey4 {
        src_addr: src.0.octets(),
        dst_addr: dst.0.octets(),
        src_port: src.1,
        dst_port: dst.1,
        proto: PROTO_TCP,
        pad8: 0,
        pad16: 0,
    }
}

/// The flow key of a frame, or of its reverse direction.
fn frame_key(frame: &[u8], reverse: bool) -> Result<FlowKey4> {
    let (src, dst) = frame::endpoints(frame).context("not a TCP/IPv4 frame")?;
    Ok(if reverse { flow_key(dst, src) } else { flow_key(src, dst) })
}

/// Backend sets and service ids of the chain, far above the agent's.
const CHAIN_SETS: u32 = 0xc000_0000;

/// One run of the chain method through `program` (the empty program's run on the same packet
/// first): `links` packets, each a new flow from the chain's pod to the next frontend. Both
/// runs, once the program is seen to have redirected the last packet from the pod to the
/// chain's end; `out` holds that packet.
fn run_chain(
    empty: BorrowedFd<'_>,
    program: BorrowedFd<'_>,
    out: &mut [u8],
    links: usize,
    what: &str,
) -> Result<(sys::Run, sys::Run)> {
    let repeat = u32::try_from(links)?;
    let client = chain_client();
    let input = frame::tcp(client, (chain_frontend(0), SERVICE_PORT));
    let empty = sys::test_run(empty, &input, out, repeat)?;
    let run = sys::test_run(program, &input, out, repeat)?;
    ensure!(run.verdict == TC_ACT_REDIRECT, "{what}: verdict {}", run.verdict as i32);
    let last = &out[..run.out_len.min(out.len())];
    let (src, dst) = (frame::addr(last, frame::SRC_ADDR), frame::addr(last, frame::DST_ADDR));
    ensure!(
        src == Some(client.0) && dst == Some(chain_frontend(links)),
        "{what}: after {links} runs the packet goes {src:?} -> {dst:?}, not to the end of the chain"
    );
    Ok((empty, run))
}

/// The pod the chain method's packets come from.
fn chain_client() -> (Ipv4Addr, u16) {
    (client_ip(7), 33_333)
}

/// Frontend `link` of the chain: 10.112.0.0/12, outside the service CIDR and the cluster's.
fn chain_frontend(link: usize) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 112, 0, 1)) + link as u32)
}

/// A small deterministic generator, so runs pick the same services.
struct XorShift(u64);

impl XorShift {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }
}
