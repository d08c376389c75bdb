//! The `control-plane` suite: how long the agent takes from a desired state to the datapath,
//! and how much memory it holds.
//!
//! Every repetition of every size runs in a child process of its own (`vipr-bench
//! control-plane-child`), in a fresh network namespace with one veth device, on a fresh bpffs,
//! so neither the kernel state nor the memory of one size reaches the next. The child builds
//! the cluster's Services and EndpointSlices decoded as the agent's source decodes them (so
//! "RSS objects only" is what the agent holds), starts `EbpfDataplane` (load, attach to the
//! device), hands the objects to the agent's change tracker as a source's first lists do
//! (moved: the tracker holds them once, as in the agent), translates them with the agent's
//! incremental translator, and times `EbpfDataplane::sync_changes` of that desired state on
//! the empty maps ("from scratch"). Then it replaces one endpoint of a random service at a
//! time and times, from the event on, what the agent does before the change is in the maps:
//! the tracker takes the new slice and marks its service, the translator re-translates that
//! service, and the dataplane syncs the changes. It counts the `bpf()`
//! and all system calls of each sync with tracepoint perf counters, reads VmRSS / VmHWM from
//! /proc/self/status, and checks in the pinned maps that the last change is there.

use std::{
    net::Ipv4Addr,
    process::{Command, Stdio},
    time::Instant,
};

use anyhow::{bail, ensure, Context as _, Result};
use aya::maps::{HashMap, Map, MapData};
use proxy_common::{pins, source_class, Backend4, BackendSlot, Service, ServiceKey4};
use serde::{Deserialize, Serialize};
use vipr::{
    dataplane::{
        ebpf::{BpfMapSizes, EbpfDataplane, EbpfOptions, HostTrafficOptions, PinDir},
        Dataplane as _,
    },
    model::{
        changes::{ChangeTracker, Kind, Object},
        kubernetes::incremental::Translator,
    },
};

use super::{
    cluster::{cluster_ip, Cluster, SERVICE_PORT, TARGET_PORT},
    meta::RunMeta,
    stats::{self, Summary},
    sys::{self, BpfMount, PrivateCgroup, SyscallCounter},
    watch_path,
};

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Settings {
    /// Child processes (fresh namespace, bpffs and process) per size.
    pub repetitions: usize,
    /// One-endpoint changes per child.
    pub changes: usize,
    /// Numbers of services.
    pub sizes: Vec<usize>,
    pub endpoints_per_service: usize,
    /// The stream of EndpointSlice changes through the real agent's watch path
    /// ([`watch_path`]); `None` in results of runs before it was part of the suite.
    #[serde(default)]
    pub watch: Option<watch_path::Settings>,
}

impl Settings {
    pub fn full() -> Self {
        Self {
            repetitions: 5,
            changes: 100,
            sizes: vec![1_000, 10_000, 50_000],
            endpoints_per_service: 10,
            watch: Some(watch_path::Settings::full()),
        }
    }

    pub fn quick() -> Self {
        Self {
            repetitions: 2,
            changes: 20,
            sizes: vec![100, 1_000],
            endpoints_per_service: 10,
            watch: Some(watch_path::Settings::quick()),
        }
    }
}

/// What one child measured.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ChildReport {
    pub services: usize,
    pub endpoints_per_service: usize,
    pub start_ms: f64,
    pub translate_ms: f64,
    pub sync_ms: f64,
    pub sync_user_ms: f64,
    pub sync_system_ms: f64,
    pub sync_bpf_calls: Option<u64>,
    pub sync_syscalls: Option<u64>,
    /// Entries the scratch sync reported as changed.
    pub sync_changed: usize,
    pub service_entries: usize,
    pub backend_slots: usize,
    pub rss_before_start_kib: u64,
    pub rss_after_sync_kib: u64,
    pub hwm_after_sync_kib: u64,
    pub rss_end_kib: u64,
    pub hwm_end_kib: u64,
    pub changes: Vec<Change>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Change {
    pub translate_ms: f64,
    pub sync_ms: f64,
    pub bpf_calls: Option<u64>,
    pub changed: usize,
}

/// One size, over its children.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SizeResult {
    pub services: usize,
    pub endpoints_per_service: usize,
    pub repetitions: usize,
    pub start_ms: Summary,
    pub translate_ms: Summary,
    pub sync_ms: Summary,
    pub sync_user_ms: Summary,
    pub sync_system_ms: Summary,
    pub sync_bpf_calls: Option<f64>,
    pub sync_syscalls: Option<f64>,
    pub service_entries: usize,
    pub backend_slots: usize,
    /// Over every change of every child.
    pub change_translate_ms: Summary,
    pub change_sync_ms: Summary,
    pub change_sync_p90_ms: f64,
    /// `None` in results of runs before the p99s were reported.
    #[serde(default)]
    pub change_sync_p99_ms: Option<f64>,
    /// Translation and sync of one change, added per change: from the event to the maps.
    pub change_total_ms: Summary,
    #[serde(default)]
    pub change_total_p99_ms: Option<f64>,
    pub change_bpf_calls: Option<f64>,
    pub rss_before_start_mib: Summary,
    pub rss_after_sync_mib: Summary,
    pub hwm_mib: Summary,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Results {
    pub meta: RunMeta,
    pub settings: Settings,
    pub sizes: Vec<SizeResult>,
    /// The changes streamed through the real agent's watch path.
    #[serde(default)]
    pub watch: Option<watch_path::WatchPathReport>,
}

impl Results {
    pub fn size(&self, services: usize) -> Option<&SizeResult> {
        self.sizes.iter().find(|size| size.services == services)
    }
}

pub fn run(meta: RunMeta, settings: Settings) -> Result<Results> {
    let exe = std::env::current_exe().context("locating vipr-bench")?;
    let mut sizes = Vec::new();
    for &services in &settings.sizes {
        let mut children = Vec::new();
        for repetition in 0..settings.repetitions {
            eprintln!(
                "control-plane: {services} services x {} endpoints, repetition {}/{}",
                settings.endpoints_per_service,
                repetition + 1,
                settings.repetitions
            );
            let output = Command::new(&exe)
                .arg("control-plane-child")
                .args(["--services", &services.to_string()])
                .args(["--endpoints", &settings.endpoints_per_service.to_string()])
                .args(["--changes", &settings.changes.to_string()])
                .args(["--seed", &repetition.to_string()])
                .stdin(Stdio::null())
                .stderr(Stdio::inherit())
                .output()
                .context("running vipr-bench control-plane-child")?;
            ensure!(output.status.success(), "the control-plane child failed ({})", output.status);
            let stdout = String::from_utf8_lossy(&output.stdout);
            let line = stdout.lines().last().context("the child printed no result")?;
            let child: ChildReport =
                serde_json::from_str(line).with_context(|| format!("unreadable child result: {line}"))?;
            eprintln!(
                "  start {:.1} ms, translate {:.1} ms, sync {:.1} ms, change sync median {:.3} ms, RSS {:.1} MiB",
                child.start_ms,
                child.translate_ms,
                child.sync_ms,
                stats::median(&child.changes.iter().map(|c| c.sync_ms).collect::<Vec<_>>()).unwrap_or(f64::NAN),
                child.rss_after_sync_kib as f64 / 1024.0
            );
            children.push(child);
        }
        sizes.push(summarize(services, settings.endpoints_per_service, &children)?);
    }
    let watch = settings.watch.as_ref().map(|watch| run_watch(&exe, watch)).transpose()?;
    let mut meta = meta;
    meta.finish();
    Ok(Results { meta, settings, sizes, watch })
}

/// The watch-path stream, in a child process of its own (`vipr-bench control-plane-watch`).
fn run_watch(exe: &std::path::Path, settings: &watch_path::Settings) -> Result<watch_path::WatchPathReport> {
    eprintln!(
        "control-plane: watch path, {} services, {} changes/s for {} s",
        settings.services, settings.rate, settings.seconds
    );
    let mut command = Command::new(exe);
    command
        .arg("control-plane-watch")
        .args(["--services", &settings.services.to_string()])
        .args(["--rate", &settings.rate.to_string()])
        .args(["--seconds", &settings.seconds.to_string()]);
    if let Some(period) = &settings.min_sync_period {
        command.args(["--min-sync-period", period]);
    }
    let output = command
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .context("running vipr-bench control-plane-watch")?;
    ensure!(output.status.success(), "the watch-path run failed ({})", output.status);
    let stdout = String::from_utf8_lossy(&output.stdout);
    let line = stdout.lines().last().context("the watch-path run printed no result")?;
    let report: watch_path::WatchPathReport =
        serde_json::from_str(line).with_context(|| format!("unreadable watch-path result: {line}"))?;
    eprintln!(
        "  {} of {} changes programmed, p50 {:.2} ms, p99 {:.2} ms, agent CPU {:.1}% of a core",
        report.changes_programmed,
        report.changes_written,
        report.p50_ms,
        report.p99_ms,
        report.agent_cpu_percent
    );
    Ok(report)
}

fn summarize(services: usize, endpoints: usize, children: &[ChildReport]) -> Result<SizeResult> {
    let of = |f: &dyn Fn(&ChildReport) -> f64| -> Result<Summary> {
        Summary::of(&children.iter().map(f).collect::<Vec<_>>()).context("no children")
    };
    let optional_median = |values: Vec<Option<f64>>| -> Option<f64> {
        let values: Option<Vec<f64>> = values.into_iter().collect();
        stats::median(&values?)
    };
    let changes: Vec<&Change> = children.iter().flat_map(|child| &child.changes).collect();
    let change = |f: &dyn Fn(&Change) -> f64| -> Result<Summary> {
        Summary::of(&changes.iter().map(|c| f(c)).collect::<Vec<_>>()).context("no changes")
    };
    let mib = |kib: u64| kib as f64 / 1024.0;
    let first = children.first().context("no children")?;
    Ok(SizeResult {
        services,
        endpoints_per_service: endpoints,
        repetitions: children.len(),
        start_ms: of(&|c| c.start_ms)?,
        translate_ms: of(&|c| c.translate_ms)?,
        sync_ms: of(&|c| c.sync_ms)?,
        sync_user_ms: of(&|c| c.sync_user_ms)?,
        sync_system_ms: of(&|c| c.sync_system_ms)?,
        sync_bpf_calls: optional_median(
            children.iter().map(|c| c.sync_bpf_calls.map(|n| n as f64)).collect(),
        ),
        sync_syscalls: optional_median(children.iter().map(|c| c.sync_syscalls.map(|n| n as f64)).collect()),
        service_entries: first.service_entries,
        backend_slots: first.backend_slots,
        change_translate_ms: change(&|c| c.translate_ms)?,
        change_sync_ms: change(&|c| c.sync_ms)?,
        change_sync_p90_ms: stats::percentile(
            &stats::sorted(&changes.iter().map(|c| c.sync_ms).collect::<Vec<_>>()),
            90.0,
        )
        .context("no changes")?,
        change_sync_p99_ms: stats::percentile(
            &stats::sorted(&changes.iter().map(|c| c.sync_ms).collect::<Vec<_>>()),
            99.0,
        ),
        change_total_ms: change(&|c| c.translate_ms + c.sync_ms)?,
        change_total_p99_ms: stats::percentile(
            &stats::sorted(&changes.iter().map(|c| c.translate_ms + c.sync_ms).collect::<Vec<_>>()),
            99.0,
        ),
        change_bpf_calls: optional_median(changes.iter().map(|c| c.bpf_calls.map(|n| n as f64)).collect()),
        rss_before_start_mib: of(&|c| mib(c.rss_before_start_kib))?,
        rss_after_sync_mib: of(&|c| mib(c.rss_after_sync_kib))?,
        hwm_mib: of(&|c| mib(c.hwm_end_kib))?,
    })
}

/// Counts of the calling thread's `bpf()` calls and of all its system calls, where the
/// kernel has the tracepoints.
struct Counters {
    bpf: Option<SyscallCounter>,
    all: Option<SyscallCounter>,
}

impl Counters {
    fn new() -> Self {
        let open = |event: &str| match SyscallCounter::new(event) {
            Ok(counter) => Some(counter),
            Err(error) => {
                eprintln!("vipr-bench: not counting {event}: {error:#}");
                None
            }
        };
        Self { bpf: open("syscalls/sys_enter_bpf"), all: open("raw_syscalls/sys_enter") }
    }

    fn read(&self) -> (Option<u64>, Option<u64>) {
        let read = |counter: &Option<SyscallCounter>| counter.as_ref().and_then(|c| c.read().ok());
        (read(&self.bpf), read(&self.all))
    }
}

fn delta(before: Option<u64>, after: Option<u64>) -> Option<u64> {
    Some(after? - before?)
}

fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1e3
}

/// One repetition of one size, in this (isolated) process.
pub fn child(services: usize, endpoints: usize, changes: usize, seed: u64) -> Result<ChildReport> {
    sys::set_up_network()?;
    let cgroup = PrivateCgroup::new()?;
    let bpffs = BpfMount::new()?;
    let (mut cluster, services_listed, slices_listed) = Cluster::decoded(services, endpoints);
    let counters = Counters::new();
    let rss_before_start_kib = sys::status_kib("VmRSS")?;

    let options = EbpfOptions {
        bpf_root: bpffs.path().to_owned(),
        devices: vec![sys::DEVICE.to_owned()],
        map_sizes: BpfMapSizes::default(),
        conntrack: Default::default(),
        balancing: Default::default(),
        xdp: Default::default(),
        forwarding: Default::default(),
        lb_mode: Default::default(),
        lb_dsr_accept: None,
    };
    let host = HostTrafficOptions { cgroup_root: Some(cgroup.path().to_owned()), ..Default::default() };
    let started = Instant::now();
    let mut dataplane = EbpfDataplane::start_with(&options, &host).context("starting the dataplane")?;
    let start_ms = ms(started);

    let mut translator = Translator::new();
    let mut tracker = ChangeTracker::new(std::time::SystemTime::now());
    let started = Instant::now();
    tracker.list(Kind::Service, services_listed);
    tracker.list(Kind::EndpointSlice, slices_listed);
    tracker.set_synced();
    let dirty = tracker.take_dirty();
    let scratch = translator.translate(&tracker, dirty, &cluster.node);
    let translate_ms = ms(started);
    let rejected = translator.rejected();
    ensure!(rejected.is_empty(), "the model rejected objects: {rejected:?}");

    let (bpf_before, all_before) = counters.read();
    let (user_before, system_before) = sys::cpu_ms();
    let started = Instant::now();
    let report = dataplane.sync_changes(translator.state(), &scratch).context("sync from scratch")?;
    let sync_ms = ms(started);
    let (user_after, system_after) = sys::cpu_ms();
    let (bpf_after, all_after) = counters.read();
    ensure!(
        report.failed.is_empty(),
        "the sync failed for {} entries, e.g. {:?}",
        report.failed.len(),
        &report.failed[..report.failed.len().min(3)]
    );
    let rss_after_sync_kib = sys::status_kib("VmRSS")?;
    let hwm_after_sync_kib = sys::status_kib("VmHWM")?;

    let mut random = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut measured = Vec::with_capacity(changes);
    let mut last_change = None;
    for _ in 0..changes {
        random ^= random << 13;
        random ^= random >> 7;
        random ^= random << 17;
        let service = (random % services as u64) as usize;
        // The event as the source delivers it: decoded.
        let (slice, address) = cluster.replacement(service);
        let slice = Object::from(slice);
        let started = Instant::now();
        tracker.apply(slice);
        let dirty = tracker.take_dirty();
        let changed = translator.translate(&tracker, dirty, &cluster.node);
        let translate_ms = ms(started);
        let (bpf_before, _) = counters.read();
        let started = Instant::now();
        let report = dataplane.sync_changes(translator.state(), &changed).context("sync of a change")?;
        let sync_ms = ms(started);
        let (bpf_after, _) = counters.read();
        ensure!(
            report.failed.is_empty() && report.changed > 0,
            "the change was not applied: {} changed, {} failed, e.g. {:?}",
            report.changed,
            report.failed.len(),
            report.failed.first()
        );
        measured.push(Change {
            translate_ms,
            sync_ms,
            bpf_calls: delta(bpf_before, bpf_after),
            changed: report.changed,
        });
        last_change = Some((service, address));
    }

    let maps = Pinned::open(&PinDir::new(bpffs.path()))?;
    if let Some((service, address)) = last_change {
        let backends = maps.backends_of(cluster_ip(service))?;
        ensure!(
            backends.contains(&(address, TARGET_PORT)),
            "the last change is not in the maps: service {service} has {backends:?}, not {address}"
        );
        let service_key = (Cluster::changed_slice_key(service).0.into(), format!("svc-{service}").into());
        let expected: Vec<(Ipv4Addr, u16)> = tracker
            .slices_of(&service_key)
            .iter()
            .filter_map(|key| tracker.slice(key))
            .flat_map(|slice| slice.addresses())
            .filter_map(|ip| match ip {
                std::net::IpAddr::V4(ip) => Some(ip),
                std::net::IpAddr::V6(_) => None,
            })
            .map(|ip| (ip, TARGET_PORT))
            .collect();
        ensure!(backends.len() == expected.len(), "service {service}: {backends:?}, expected {expected:?}");
    }
    let (service_entries, backend_slots) = (maps.service_entries()?, maps.backend_slots()?);

    Ok(ChildReport {
        services,
        endpoints_per_service: endpoints,
        start_ms,
        translate_ms,
        sync_ms,
        sync_user_ms: user_after - user_before,
        sync_system_ms: system_after - system_before,
        sync_bpf_calls: delta(bpf_before, bpf_after),
        sync_syscalls: delta(all_before, all_after),
        sync_changed: report.changed,
        service_entries,
        backend_slots,
        rss_before_start_kib,
        rss_after_sync_kib,
        hwm_after_sync_kib,
        rss_end_kib: sys::status_kib("VmRSS")?,
        hwm_end_kib: sys::status_kib("VmHWM")?,
        changes: measured,
    })
}

/// The services and backends maps as the agent pinned them, read as the datapath sees them.
struct Pinned {
    services: HashMap<MapData, ServiceKey4, Service>,
    backends: HashMap<MapData, BackendSlot, Backend4>,
}

impl Pinned {
    fn open(pin_dir: &PinDir) -> Result<Self> {
        let open = |name: &str| -> Result<Map> {
            let data = MapData::from_pin(pin_dir.path().join(name))
                .with_context(|| format!("opening pinned {name}"))?;
            Ok(Map::HashMap(data))
        };
        Ok(Self {
            services: HashMap::try_from(open(pins::SERVICES4)?)?,
            backends: HashMap::try_from(open(pins::BACKENDS4)?)?,
        })
    }

    /// What a new connection from a pod to `vip`:80 can reach.
    fn backends_of(&self, vip: Ipv4Addr) -> Result<Vec<(Ipv4Addr, u16)>> {
        let key =
            ServiceKey4 { addr: vip.octets(), port: SERVICE_PORT, proto: 6, source_class: source_class::POD };
        let service = self.services.get(&key, 0).with_context(|| format!("no services entry for {vip}"))?;
        (0..service.backend_count)
            .map(|slot| {
                let backend = self
                    .backends
                    .get(&BackendSlot { backend_set: service.backend_set, slot }, 0)
                    .with_context(|| {
                    format!("{vip}: slot {slot} of set {} is empty", service.backend_set)
                })?;
                Ok((Ipv4Addr::from(backend.addr), backend.port))
            })
            .collect()
    }

    fn service_entries(&self) -> Result<usize> {
        count(self.services.keys())
    }

    fn backend_slots(&self) -> Result<usize> {
        count(self.backends.keys())
    }
}

fn count<K>(keys: impl Iterator<Item = Result<K, aya::maps::MapError>>) -> Result<usize> {
    let mut n = 0;
    for key in keys {
        if let Err(error) = key {
            bail!("reading map keys: {error}");
        }
        n += 1;
    }
    Ok(n)
}
