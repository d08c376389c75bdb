//! The nftables dataplane at scale (issue 17), driven as a library in the benchmark's own
//! network namespace: services × endpoints programmed from empty, one endpoint change among
//! them (the agent's path: the incremental translation, then `sync_changes`), a full resync
//! at the large size, and new connections/s through one service of 1 and of many services.
//! Kube-proxy-style objects: one port per Service, every third a NodePort.

use std::{
    net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4},
    time::{Duration, Instant},
};

use anyhow::{ensure, Context as _, Result};
use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
use serde::{Deserialize, Serialize};
use serde_json::json;
use vipr::{
    dataplane::{
        nftables::{NftablesDataplane, NftablesOptions, Writer},
        Dataplane as _,
    },
    model::{
        changes::{ChangeTracker, Kind, Object},
        kubernetes::{incremental::Translator, NodeContext, SERVICE_NAME_LABEL},
        DesiredState, StateChanges,
    },
};

use testbed::{exchanges, unique_name, EchoServer, Frontend, LeafSpec, Netns, Protocol, Topology};

use super::meta::RunMeta;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Settings {
    /// Services programmed from empty, and the endpoints of each.
    pub services: usize,
    pub endpoints: usize,
    /// Services × 2 endpoints of the full resync.
    pub resync_services: usize,
    /// Services of the connection rate's many-service measurement.
    pub rate_services: usize,
    /// Connections per round, and rounds at each size (interleaved; the medians count).
    pub connections: usize,
    #[serde(default = "default_rounds")]
    pub rounds: usize,
}

fn default_rounds() -> usize {
    3
}

impl Settings {
    pub fn full() -> Self {
        Self {
            services: 10_000,
            endpoints: 10,
            resync_services: 44_000,
            rate_services: 30_000,
            connections: 150,
            rounds: 21,
        }
    }

    pub fn quick() -> Self {
        Self {
            services: 500,
            endpoints: 10,
            resync_services: 1_000,
            rate_services: 1_000,
            connections: 50,
            rounds: 3,
        }
    }
}

/// One measurement against its target.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Figure {
    pub what: String,
    pub measured: String,
    pub target: String,
    pub met: bool,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Results {
    pub meta: RunMeta,
    pub settings: Settings,
    pub from_empty_ms: f64,
    /// The writers alone (`nft -f` for the chains and sets, netlink for the elements).
    pub from_empty_nft_ms: f64,
    /// The netlink batch of the elements alone.
    #[serde(default)]
    pub from_empty_netlink_ms: f64,
    /// The same, every element in the `nft -f` batch (netlink off): the comparison.
    #[serde(default)]
    pub from_empty_by_nft_ms: f64,
    #[serde(default)]
    pub from_empty_by_nft_nft_ms: f64,
    /// The sync of the change (the target's figure, as the control-plane suite's), and the
    /// agent's incremental translation before it.
    pub change_ms: f64,
    /// The writer alone (netlink for an element-only change, else `nft -f`).
    pub change_nft_ms: f64,
    pub change_translate_ms: f64,
    /// What wrote the change (`Netlink` or `Nft`).
    pub change_writer: String,
    /// Another endpoint change of the same size, written by `nft -f` (netlink off): the
    /// comparison, (sync, `nft -f` alone).
    #[serde(default)]
    pub change_by_nft_ms: f64,
    #[serde(default)]
    pub change_by_nft_nft_ms: f64,
    pub resync_ms: f64,
    pub resync_nft_ms: f64,
    /// CPU of the from-empty sync and of the resync, in ms: this process's user and system
    /// time (generation, the netlink batches' kernel work), then `nft`'s (its parse and
    /// evaluation, then the kernel's work in its system calls: the commit).
    #[serde(default)]
    pub from_empty_cpu_ms: Cpu,
    #[serde(default)]
    pub resync_cpu_ms: Cpu,
    pub rate_at_one: f64,
    pub rate_at_many: f64,
    /// The median of the rounds' ratios (many / one, each pair measured back to back), in %.
    #[serde(default)]
    pub rate_ratio: f64,
    pub figures: Vec<Figure>,
}

pub fn run(mut meta: RunMeta, settings: Settings) -> Result<Results> {
    let programming = Netns::create(&unique_name("bench-nft"))?;
    let (
        (from_empty, from_empty_netlink, from_empty_by_nft, from_empty_cpu),
        (change, translate, writer, by_nft),
        (resync, resync_cpu),
    ) = programming.run(|| programming_times(&settings))?;
    drop(programming);
    let (rate_at_one, rate_at_many, rate) = connection_rates(&settings)?;
    meta.finish();
    let ms = |(total, _): (f64, f64)| total * 1e3;
    let scale = |n: usize| if n >= 1000 { format!("{}k", n / 1000) } else { n.to_string() };
    let figures = vec![
        Figure {
            what: format!(
                "{} services × {} endpoints programmed from empty",
                scale(settings.services),
                settings.endpoints
            ),
            measured: format!(
                "{:.0} ms (writers {:.0} ms, of which netlink {:.0} ms; {}); by nft -f alone {:.0} ms (nft -f {:.0} ms)",
                ms(from_empty),
                from_empty.1 * 1e3,
                from_empty_netlink * 1e3,
                cpu_text(from_empty_cpu),
                ms(from_empty_by_nft),
                from_empty_by_nft.1 * 1e3
            ),
            target: "< 2 s".into(),
            met: ms(from_empty) < 2000.0,
        },
        Figure {
            what: format!("one endpoint change at {} services", scale(settings.services)),
            measured: format!(
                "{:.1} ms ({writer:?} {:.1} ms); with the agent's re-translation {:.1} ms; by nft -f {:.1} ms (nft -f {:.1} ms)",
                ms(change),
                change.1 * 1e3,
                ms(change) + translate * 1e3,
                ms(by_nft),
                by_nft.1 * 1e3,
            ),
            target: "< 50 ms".into(),
            met: ms(change) < 50.0,
        },
        Figure {
            what: format!("{} services × 2 endpoints, full resync", scale(settings.resync_services)),
            measured: format!("{:.0} ms (nft -f {:.0} ms; {})", ms(resync), resync.1 * 1e3, cpu_text(resync_cpu)),
            target: "< 10 s".into(),
            met: ms(resync) < 10_000.0,
        },
        Figure {
            what: format!("new connections/s at {} services vs 1", scale(settings.rate_services)),
            measured: format!(
                "{rate:.1}% (median of {} rounds' ratios, each round {} connections at each size back to back; median rates {rate_at_many:.0} vs {rate_at_one:.0}/s)",
                settings.rounds, settings.connections
            ),
            target: "within 10%".into(),
            met: rate >= 90.0,
        },
    ];
    println!("nftables mode ({}):", if meta.quick { "quick" } else { "full" });
    for figure in &figures {
        println!(
            "  {}: {} (target {}: {})",
            figure.what,
            figure.measured,
            figure.target,
            if figure.met { "met" } else { "MISSED" }
        );
    }
    Ok(Results {
        meta,
        settings,
        from_empty_ms: ms(from_empty),
        from_empty_nft_ms: from_empty.1 * 1e3,
        from_empty_netlink_ms: from_empty_netlink * 1e3,
        from_empty_by_nft_ms: ms(from_empty_by_nft),
        from_empty_by_nft_nft_ms: from_empty_by_nft.1 * 1e3,
        change_ms: ms(change),
        change_nft_ms: change.1 * 1e3,
        change_translate_ms: translate * 1e3,
        change_writer: format!("{writer:?}"),
        change_by_nft_ms: ms(by_nft),
        change_by_nft_nft_ms: by_nft.1 * 1e3,
        resync_ms: ms(resync),
        resync_nft_ms: resync.1 * 1e3,
        from_empty_cpu_ms: from_empty_cpu,
        resync_cpu_ms: resync_cpu,
        rate_at_one,
        rate_at_many,
        rate_ratio: rate,
        figures,
    })
}

type Seconds = (f64, f64);

/// CPU time in ms: (own user, own system, `nft` user, `nft` system).
pub type Cpu = (f64, f64, f64, f64);

fn cpu_now() -> Cpu {
    let (user, system) = super::sys::cpu_ms();
    let (nft_user, nft_system) = super::sys::children_cpu_ms();
    (user, system, nft_user, nft_system)
}

/// The CPU `body` took.
fn cpu_of<T>(body: impl FnOnce() -> T) -> (T, Cpu) {
    let before = cpu_now();
    let value = body();
    let after = cpu_now();
    (value, (after.0 - before.0, after.1 - before.1, after.2 - before.2, after.3 - before.3))
}

fn cpu_text(cpu: Cpu) -> String {
    format!("CPU: vipr user {:.0} / sys {:.0} ms, nft user {:.0} / sys {:.0} ms", cpu.0, cpu.1, cpu.2, cpu.3)
}

/// The agent's change tracker and translator, given whole lists (as a source's relist) or one
/// changed EndpointSlice.
struct Model {
    tracker: ChangeTracker,
    translator: Translator,
    node: NodeContext,
}

impl Model {
    fn new(node: NodeContext) -> Self {
        Self {
            tracker: ChangeTracker::new(std::time::SystemTime::now()),
            translator: Translator::new(),
            node,
        }
    }

    fn list(&mut self, services: &[Service], slices: &[EndpointSlice]) -> StateChanges {
        self.tracker.list(Kind::Service, services.iter().cloned().map(Object::from).collect());
        self.tracker.list(Kind::EndpointSlice, slices.iter().cloned().map(Object::from).collect());
        self.tracker.set_synced();
        self.translate()
    }

    fn apply(&mut self, slice: EndpointSlice) -> StateChanges {
        self.tracker.apply(Object::from(slice));
        self.translate()
    }

    fn translate(&mut self) -> StateChanges {
        let dirty = self.tracker.take_dirty();
        self.translator.translate(&self.tracker, dirty, &self.node)
    }

    fn state(&self) -> &DesiredState {
        self.translator.state()
    }
}

/// From empty: the sync, its netlink batch alone, the same by `nft -f` alone, its CPU.
type FromEmpty = (Seconds, f64, Seconds, Cpu);

/// One endpoint change: the sync, its translation, what wrote it, and the same kind of
/// change written by `nft -f`.
type Change = (Seconds, f64, Writer, Seconds);

/// ((from empty, its netlink batch alone, the same by `nft -f` alone), one endpoint change,
/// full resync at the large size), each (the whole sync, the writer alone) in seconds.
fn programming_times(settings: &Settings) -> Result<(FromEmpty, Change, (Seconds, Cpu))> {
    let options = NftablesOptions { conntrack_cleanup: false, ..NftablesOptions::default() };
    let mut dataplane = NftablesDataplane::start(&options)?;
    let mut model = Model::new(node());
    let (services, slices) = objects(settings.services, settings.endpoints, None);
    let changes = model.list(&services, &slices);
    // From empty by nft alone first (then removed), for the comparison.
    let mut by_nft =
        NftablesDataplane::start(&NftablesOptions { netlink_elements: false, ..options.clone() })?;
    let from_empty_by_nft = timed(&mut by_nft, |dataplane| dataplane.sync(model.state()))?;
    NftablesDataplane::cleanup()?;
    let (from_empty, from_empty_cpu) =
        cpu_of(|| timed(&mut dataplane, |dataplane| dataplane.sync_changes(model.state(), &changes)));
    let from_empty = from_empty?;
    ensure!(
        dataplane.last_sync().batches.iter().any(|applied| applied.writer == Writer::NftThenNetlink),
        "the table was not created with its elements over netlink"
    );
    let netlink: f64 =
        dataplane.last_sync().batches.iter().map(|applied| applied.netlink_took.as_secs_f64()).sum();
    let from_empty = (from_empty, netlink, from_empty_by_nft, from_empty_cpu);

    let started = Instant::now();
    let changes = model.apply(slice(settings.services / 2, settings.endpoints, 1, None));
    let translated = started.elapsed().as_secs_f64();
    let (sync, nft) = timed(&mut dataplane, |dataplane| dataplane.sync_changes(model.state(), &changes))?;
    ensure!(dataplane.last_sync().from_changes, "the endpoint change was not applied from the changes");
    let writer = dataplane.last_sync().batches.first().map_or(Writer::Nft, |applied| applied.writer);
    dataplane.set_netlink_elements(false);
    let changes = model.apply(slice(settings.services / 2 + 1, settings.endpoints, 1, None));
    let by_nft = timed(&mut dataplane, |dataplane| dataplane.sync_changes(model.state(), &changes))?;
    dataplane.set_netlink_elements(true);
    let change = ((sync, nft), translated, writer, by_nft);

    let (services, slices) = objects(settings.resync_services, 2, None);
    let changes = model.list(&services, &slices);
    dataplane.sync_changes(model.state(), &changes)?;
    dataplane.request_full_sync();
    let (resync, resync_cpu) = cpu_of(|| timed(&mut dataplane, |dataplane| dataplane.sync(model.state())));
    let resync = resync?;
    ensure!(dataplane.last_sync().full, "the resync was not full");
    Ok((from_empty, change, (resync, resync_cpu)))
}

fn timed(
    dataplane: &mut NftablesDataplane,
    sync: impl FnOnce(&mut NftablesDataplane) -> Result<vipr::dataplane::SyncReport>,
) -> Result<Seconds> {
    let started = Instant::now();
    let report = sync(dataplane)?;
    let total = started.elapsed().as_secs_f64();
    ensure!(report.is_complete(), "the sync was incomplete: {report:?}");
    let nft = dataplane.last_sync().batches.iter().map(|applied| applied.took.as_secs_f64()).sum();
    Ok((total, nft))
}

const CLIENT: Ipv4Addr = Ipv4Addr::new(10, 10, 0, 2);
const BACKEND: Ipv4Addr = Ipv4Addr::new(10, 20, 1, 2);

/// One node with a client and a backend, its table programmed with `services` services
/// (service 0's one endpoint the backend).
struct RateLab {
    topology: Topology,
    _server: EchoServer,
    _dataplane: NftablesDataplane,
}

impl RateLab {
    fn build(label: &str, services: usize) -> Result<Self> {
        let leaves =
            vec![LeafSpec::in_own_slash24("client", CLIENT)?, LeafSpec::in_own_slash24("backend", BACKEND)?];
        let topology = Topology::build(label, leaves)?;
        let backend = &topology.leaf("backend").context("backend leaf")?.netns;
        let server = EchoServer::start(backend, "backend", &[SocketAddr::from((BACKEND, 8080))], &[])?;
        let (objects, slices) = objects(services, 2, Some(BACKEND));
        let dataplane = topology.node().run(|| {
            let options = NftablesOptions { conntrack_cleanup: false, ..NftablesOptions::default() };
            let mut dataplane = NftablesDataplane::start(&options)?;
            let mut model = Model::new(node());
            model.list(&objects, &slices);
            ensure!(dataplane.sync(model.state())?.is_complete(), "{services} services not programmed");
            Ok(dataplane)
        })?;
        Ok(Self { topology, _server: server, _dataplane: dataplane })
    }
}

/// New connections/s through service 0 of a node with 1 service and of one with
/// `rate_services`: both nodes programmed first, then `rounds` rounds of each, interleaved
/// (the order swapped every round) after one uncounted round of each, so that the machine's
/// slow and fast phases fall on both alike: the medians of the rates, and the median of the
/// rounds' ratios (many / one, in %), which cancels the drift between rounds too.
fn connection_rates(settings: &Settings) -> Result<(f64, f64, f64)> {
    let one = RateLab::build("bench-nft-cps1", 1)?;
    let many = RateLab::build("bench-nft-cpsn", settings.rate_services)?;
    let (mut at_one, mut at_many) = (Vec::new(), Vec::new());
    for round in 0..=settings.rounds {
        let labs =
            if round % 2 == 0 { [(&one, true), (&many, false)] } else { [(&many, false), (&one, true)] };
        for (lab, is_one) in labs {
            let rate = rate(&lab.topology, settings.connections)?;
            if round > 0 {
                if is_one {
                    at_one.push(rate)
                } else {
                    at_many.push(rate)
                }
            }
        }
    }
    let mut ratios: Vec<f64> = at_many.iter().zip(&at_one).map(|(many, one)| 100.0 * many / one).collect();
    Ok((median(&mut at_one), median(&mut at_many), median(&mut ratios)))
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    match values.len() {
        0 => 0.0,
        n if n % 2 == 1 => values[n / 2],
        n => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

/// Connections/s (connect, one request and its answer, close) from the client to service 0,
/// in one round of `connections`.
fn rate(topology: &Topology, connections: usize) -> Result<f64> {
    let client = &topology.leaf("client").context("client leaf")?.netns;
    let frontend = Frontend { addr: SocketAddrV4::new(cluster_ip(0), 80), protocol: Protocol::Tcp };
    let started = Instant::now();
    let answers = client.run(|| exchanges(frontend, connections, Duration::from_secs(2)))?;
    ensure!(answers.len() == connections, "{} of {connections} answered", answers.len());
    Ok(connections as f64 / started.elapsed().as_secs_f64())
}

fn node() -> NodeContext {
    let node_ip: IpAddr = "192.168.0.2".parse().expect("valid address");
    NodeContext {
        name: "node-a".into(),
        cluster_cidrs: vec!["10.0.0.0/8".parse().expect("valid CIDR")],
        node_ips: [node_ip].into(),
        primary_ips: vec![node_ip],
        node_port_ips: [node_ip].into(),
        ..NodeContext::default()
    }
}

fn cluster_ip(index: usize) -> Ipv4Addr {
    Ipv4Addr::new(172, 30 + (index / 62_500) as u8, (index / 250 % 250) as u8, (index % 250 + 1) as u8)
}

/// `services` Services (every third a NodePort) and their slices of `endpoints` each;
/// service 0's one endpoint is `backend` when given.
fn objects(
    services: usize,
    endpoints: usize,
    backend: Option<Ipv4Addr>,
) -> (Vec<Service>, Vec<EndpointSlice>) {
    let objects = (0..services).map(service).collect();
    let slices =
        (0..services).map(|index| slice(index, endpoints, 0, backend.filter(|_| index == 0))).collect();
    (objects, slices)
}

fn service(index: usize) -> Service {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": format!("svc{index}"), "namespace": "bench", "resourceVersion": "r0"},
        "spec": {
            "type": if index.is_multiple_of(3) { "NodePort" } else { "ClusterIP" },
            "clusterIP": cluster_ip(index).to_string(),
            "ports": [{"name": "http", "port": 80, "protocol": "TCP"}],
        },
    }))
    .expect("a valid Service")
}

/// `endpoints` endpoints of service `index`, moved by `generation` (a new resourceVersion
/// each, as the API server writes them).
fn slice(index: usize, endpoints: usize, generation: usize, backend: Option<Ipv4Addr>) -> EndpointSlice {
    let addresses: Vec<String> = match backend {
        Some(backend) => vec![backend.to_string()],
        None => (0..endpoints)
            .map(|e| format!("10.{}.{}.{}", 100 + index / 250 % 150, index % 250, e + 1 + generation))
            .collect(),
    };
    serde_json::from_value(json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {
            "name": format!("svc{index}-1"), "namespace": "bench", "resourceVersion": format!("r{generation}"),
            "labels": {SERVICE_NAME_LABEL: format!("svc{index}")},
        },
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
        "endpoints": addresses.iter().map(|address| json!({"addresses": [address], "nodeName": "node-b"})).collect::<Vec<_>>(),
    }))
    .expect("a valid EndpointSlice")
}
