//! The eBPF dataplane: one TC program at ingress of every served device, and the pinned maps
//! it reads.
//!
//! Everything is pinned under `<bpf-root>/vipr/`, so the datapath outlives the agent: an
//! agent that stops leaves traffic flowing, and an agent that starts adopts the pinned maps
//! and links and only writes what differs from its desired state.
use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
    sync::Arc,
};

use anyhow::{anyhow, Context as _};
use aya::{maps::MapData, programs::SchedClassifier, Ebpf, EbpfLoader};
use proxy_common::{forwarding, pins};
use tracing::{debug, info, warn};

use self::{
    capacity::{Capacity, Refused},
    counters::{CounterIds, CounterMap, DatapathCollector, FlowMetrics, StatsMap},
    encode::{encode_admitted, encode_changes, ServiceIds, Touched, Wanted},
    family::{Family, V4, V6},
    family_maps::FamilyMaps,
};
use super::{Dataplane, Mode, ServesDevices, SyncReport};
use crate::metrics::Collector;
use crate::model::{DesiredState, StateChanges};

mod attach;
pub mod capacity;
mod carry;
pub(crate) mod counters;
mod encode;
mod family;
mod family_maps;
#[cfg(test)]
mod golden;
pub mod maglev;
mod mirror;
mod options;
mod pin_dir;
pub mod plan;
mod pod_interfaces;
pub mod pod_sockets;
pub mod program_load;
pub(crate) mod reaper;
pub mod record;
mod route_generation;
mod snat;
mod xdp_attach;

pub use attach::{Attachment, Hook};
pub use options::{
    Balancing, BpfForwarding, BpfMapSizes, ConntrackTimeouts, FlowPressure, LbMode, Modes, XdpMode,
};
pub use pin_dir::PinDir;

#[derive(Clone, Debug)]
pub struct EbpfOptions {
    pub bpf_root: PathBuf,
    pub devices: Vec<String>,
    pub map_sizes: BpfMapSizes,
    /// When flow entries of idle and closed connections are deleted.
    pub conntrack: ConntrackTimeouts,
    pub balancing: Balancing,
    /// `--xdp`: the XDP fast path for traffic from outside the node.
    pub xdp: XdpMode,
    /// `--bpf-forwarding`: forwarded packets through the stack (netfilter filters them), or
    /// redirected past it.
    pub forwarding: BpfForwarding,
    /// `--lb-mode`: source NAT or direct server return toward backends on other nodes.
    pub lb_mode: LbMode,
    /// `--lb-dsr-accept`: whether this node takes DSR's carried service addresses; `None`:
    /// for the protocols `lb_mode` sends by DSR ([`LbMode::carriers_taken`]).
    pub lb_dsr_accept: Option<bool>,
}

pub struct EbpfDataplane {
    /// Holds the loaded program, to attach it to devices that appear later.
    ebpf: Ebpf,
    pin_dir: PinDir,
    /// The devices served, by name and interface index: a device deleted and created again
    /// under its name has a new index and needs attaching again.
    devices: Vec<(String, u32)>,
    /// The XDP fast path on the devices (`--xdp`).
    xdp: xdp_attach::XdpPath,
    /// The TC hooks every served device gets: ingress, and egress with `--bpf-forwarding=stack`.
    hooks: &'static [Hook],
    reaper: reaper::Reaper,
    /// The encoding of the last state synced, and its generation if that sync was complete
    /// and came with one: only then can the next sync apply just the changes since.
    wanted: Wanted,
    synced: Option<u64>,
    service_ids: ServiceIds,
    /// How the entries are encoded (balancing, `--lb-mode`, the carriers taken).
    modes: Modes,
    /// The maps' capacities, and the Services refused because they do not fit them (see
    /// [`capacity`]); decided again when the state changes.
    capacity: Capacity,
    /// What each Service needs of the maps, counted again only for the Services that change.
    needs: capacity::NeedsTracker,
    refused: Refused,
    /// Services whose entries the kernel refused to store (`namespace/name` → reason): kept as
    /// they were until the state changes, then tried again.
    write_refused: BTreeMap<String, String>,
    /// Each family's services, backends and classification maps.
    v4: FamilyMaps<V4>,
    v6: FamilyMaps<V6>,
    /// The socket-level load balancer's settings; `None` when it is not attached.
    host_traffic: Option<HostTraffic>,
    /// The masquerade port range, kept clear of the node's ephemeral ports.
    snat: snat::SnatRange,
    /// The pod interfaces of a local-traffic detector by interface.
    pod_interfaces: pod_interfaces::PodInterfaceMap,
    /// Counter indices of (service port, backend) pairs, and the map they index.
    counter_ids: CounterIds,
    counter_map: CounterMap,
    /// `/metrics` families of the datapath's counters; `None` if its maps cannot be opened.
    collector: Option<Arc<DatapathCollector>>,
    /// Where the entries the maps should hold are recorded after a sync that changed them,
    /// for `vipr inspect drift`; `None`: not recorded.
    record: Option<record::Recorder>,
    /// The encoding changed since the record was last written.
    record_stale: bool,
    /// An earlier vipr's programs still serve (its maps had other layouts or sizes): the
    /// new programs are attached after the first complete sync ([`Self::switch_after`]).
    switch: Option<PendingSwitch>,
    /// Moves the route generation as the routes change; dropped, it turns the next hops'
    /// cache off. `None`: nothing is cached.
    _route_generation: Option<route_generation::RouteGeneration>,
}

/// What the switch from an earlier vipr's programs to this one's still has to do.
struct PendingSwitch {
    /// The earlier maps whose entries are carried over.
    carrying: carry::Carrying,
    /// Where the socket-level load balancer is attached, once the switch is done.
    host: HostTrafficOptions,
    /// The devices to attach to at the switch (the latest listing).
    devices: Vec<String>,
    xdp: XdpMode,
    /// Syncs that were not complete; after [`SWITCH_AFTER_INCOMPLETE_SYNCS`] the switch
    /// happens anyway, so that a Service the kernel refuses cannot hold the upgrade back.
    incomplete_syncs: u32,
}

/// See [`PendingSwitch::incomplete_syncs`].
const SWITCH_AFTER_INCOMPLETE_SYNCS: u32 = 3;

impl EbpfDataplane {
    /// Loads the program, reusing pinned maps, attaches it to every device, and reads back
    /// what the maps already hold.
    pub fn start(options: &EbpfOptions) -> anyhow::Result<Self> {
        Self::start_with(options, &HostTrafficOptions::default())
    }

    /// [`Self::start`], with the socket-level load balancer of the node's own traffic attached
    /// where `host` says.
    pub fn start_with(options: &EbpfOptions, host: &HostTrafficOptions) -> anyhow::Result<Self> {
        let pin_dir = PinDir::new(&options.bpf_root);
        pin_dir.create(&options.bpf_root)?;
        let sizes = options.map_sizes;
        // The sizes apply to both families' maps.
        let wanted_sizes = [V4::MAPS, V6::MAPS].map(|maps| {
            [
                (maps.services, sizes.services),
                (maps.backends, sizes.backends),
                (maps.members, sizes.backends),
                (maps.flows, sizes.flows),
                (maps.affinity, sizes.affinity),
                (maps.source_ranges, sizes.source_ranges),
                (maps.unmatched, sizes.unmatched),
            ]
        });
        let mut wanted_sizes = wanted_sizes.as_flattened().to_vec();
        wanted_sizes.push((pins::BACKEND_COUNTERS, sizes.counters));
        let wanted_sizes = wanted_sizes.as_slice();
        // A pinned map of another size is replaced by one of the size asked for, and the
        // connections of retired flows layouts are converted into the current one: their
        // entries are copied before the new programs are attached, and again once they serve.
        let carrying = carry::Carrying::set_aside(&pin_dir, wanted_sizes);
        // Maps of earlier layouts (or sizes) mean an earlier vipr's programs are attached to
        // them: those keep serving until the new maps hold a complete sync. Without them (no
        // earlier vipr, or one with the same layouts, whose maps this one adopts) the new
        // programs are attached right away.
        let retired: Vec<&str> =
            pins::RETIRED.into_iter().filter(|name| pin_dir.path().join(name).exists()).collect();
        let upgrade = !carrying.is_empty() || !retired.is_empty();
        // A counters map the loader creates now holds zeros only (nothing is carried into it
        // without an upgrade): its indices need no zeroing before their first use.
        let counters_created = !upgrade && !pin_dir.path().join(pins::BACKEND_COUNTERS).exists();
        let mut loader = EbpfLoader::new();
        loader.default_map_pin_directory(pin_dir.path());
        let hooks = hooks(options.forwarding);
        let forwarding_global = match options.forwarding {
            BpfForwarding::Stack => forwarding::STACK,
            BpfForwarding::Redirect => forwarding::REDIRECT,
        };
        loader.override_global(forwarding::GLOBAL, &forwarding_global, true);
        let carriers_taken = options.lb_mode.carriers_taken(options.lb_dsr_accept);
        loader.override_global(proxy_common::dsr_accept::GLOBAL, &carriers_taken, true);
        for &(map, size) in wanted_sizes {
            loader.map_max_entries(map, size);
        }
        let mut ebpf = loader
            .load(crate::EBPF_OBJECT)
            .context("cannot load vipr's eBPF object (is this a kernel with BPF and BTF?)")?;
        carrying.copy_all();
        // Before the programs serve: until then they cache no next hop.
        let route_generation = route_generation::RouteGeneration::start(pin_dir.path());
        // Before the program is attached: until then it would use the default range.
        let snat = snat::SnatRange::start(&mut ebpf)?;
        let pod_interfaces = pod_interfaces::PodInterfaceMap::start(&mut ebpf)?;

        for &hook in hooks {
            let program = tc_program(&mut ebpf, hook)?;
            program_load::load_retrying(|| program.load())
                .with_context(|| format!("the kernel refused vipr's TC program {}", hook.program()))?;
        }
        let mut pending = PendingSwitch {
            carrying,
            host: host.clone(),
            devices: options.devices.clone(),
            xdp: xdp_mode(options),
            incomplete_syncs: 0,
        };
        let (xdp, host_traffic, switch) = if upgrade {
            info!(
                retired = ?retired,
                "the pinned maps of an earlier vipr have other layouts or sizes: its programs keep serving \
                 until this agent's first complete sync has reached the new maps; the new programs are \
                 attached after it"
            );
            (xdp_attach::XdpPath::new(pending.xdp), None, Some(pending))
        } else {
            let (xdp, host_traffic) = attach_all(&mut ebpf, &pin_dir, hooks, &mut pending)?;
            (xdp, host_traffic, None)
        };

        // The pinned map may have kept another size than asked for.
        let counters_capacity = ebpf
            .map(pins::BACKEND_COUNTERS)
            .and_then(|map| MapData::info(map_data(map)?).ok())
            .map_or(sizes.counters, |info| info.max_entries());
        let counter_map = CounterMap::new(take_map(&mut ebpf, pins::BACKEND_COUNTERS)?);
        let mut counter_ids = CounterIds::new(counters_capacity);
        if counters_created {
            counter_ids.map_created_empty();
        }
        let mut service_ids = ServiceIds::default();
        let v4 = FamilyMaps::adopt(&mut ebpf, &mut service_ids, &mut counter_ids)?;
        let v6 = FamilyMaps::adopt(&mut ebpf, &mut service_ids, &mut counter_ids)?;
        counter_ids.adoption_done();
        let capacity = Capacity::new([v4.capacity(), v6.capacity()]);
        let flow_metrics = Arc::new(FlowMetrics::default());
        let counters_pin = pin_dir.path().join(pins::BACKEND_COUNTERS);
        let stats_pin = pin_dir.path().join(pins::DATAPATH_STATS);
        let collector = CounterMap::open(&counters_pin)
            .and_then(|counters| Ok((counters, StatsMap::open(&stats_pin)?)))
            .map(|(counters, stats)| {
                Arc::new(DatapathCollector::new(counter_ids.table(), counters, stats, flow_metrics.clone()))
            })
            .map_err(|error| warn!("datapath counters are not exported: {error:#}"))
            .ok();
        Ok(Self {
            v4,
            v6,
            reaper: reaper::Reaper::start(
                reaper::ReaperOptions {
                    pin_dir: pin_dir.path().to_path_buf(),
                    flows4_pin: pin_dir.path().join(pins::FLOWS4),
                    flows6_pin: pin_dir.path().join(pins::FLOWS6),
                    stats_pin,
                    timeouts: options.conntrack,
                },
                flow_metrics,
            ),
            counter_ids,
            counter_map,
            collector,
            wanted: Wanted::default(),
            synced: None,
            ebpf,
            pin_dir,
            devices: with_indexes(&options.devices),
            xdp,
            hooks,
            service_ids,
            modes: Modes { balancing: options.balancing, lb_mode: options.lb_mode, carriers_taken },
            capacity,
            needs: capacity::NeedsTracker::default(),
            refused: Refused::default(),
            write_refused: BTreeMap::new(),
            host_traffic,
            snat,
            pod_interfaces,
            record: None,
            record_stale: true,
            switch,
            _route_generation: route_generation,
        })
    }

    /// After a sync while an earlier vipr's programs serve: once the new maps hold a complete
    /// sync, switches every hook to the new programs (an atomic link update where the hook is
    /// a pinned link), copies what the earlier programs added meanwhile, and removes the
    /// earlier maps' pins.
    fn switch_after(&mut self, report: &SyncReport) -> anyhow::Result<()> {
        let Some(mut pending) = self.switch.take() else { return Ok(()) };
        if !report.is_complete() {
            pending.incomplete_syncs += 1;
            if pending.incomplete_syncs < SWITCH_AFTER_INCOMPLETE_SYNCS {
                info!(
                    failed = report.failed.len(),
                    "the sync is not complete: the earlier vipr's programs keep serving until one is"
                );
                self.switch = Some(pending);
                return Ok(());
            }
            warn!(
                syncs = pending.incomplete_syncs,
                "no complete sync yet; switching to the new programs with what the maps hold"
            );
        }
        // Before the copy: a connection the earlier programs open from now on is copied only
        // once the new programs serve, and its packets must not be balanced anew meanwhile.
        pending.carrying.hold_mid_stream();
        // The earlier programs' connections up to now, theirs being the current state.
        pending.carrying.refresh_connections();
        match attach_all(&mut self.ebpf, &self.pin_dir, self.hooks, &mut pending) {
            Ok((xdp, host_traffic)) => {
                self.xdp = xdp;
                self.host_traffic = host_traffic;
                self.devices = with_indexes(&pending.devices);
                info!("the first complete sync is in the maps: the new programs serve now");
                Ok(())
            }
            Err(error) => {
                self.switch = Some(pending);
                Err(error.context("cannot switch to the new programs; retried after the next sync"))
            }
        }
    }

    /// Records the entries the maps should hold in the file `path` after every sync that
    /// changes them (see [`record`]).
    pub fn record_desired_state(&mut self, path: PathBuf) {
        self.record = Some(record::Recorder::new(path, self.pin_dir.path()));
        self.record_stale = true;
    }

    /// Records what the sync changed: the entries of the services-map keys it `touched` (and
    /// the classifiers when they changed) appended to the record's journal, or, after a full
    /// sync or when the journal has grown as large as the record, the whole record.
    fn write_record(&mut self, touched: Option<&(Touched<V4>, Touched<V6>)>, classifiers: bool) {
        let Some(recorder) = &mut self.record else { return };
        if !self.record_stale {
            return;
        }
        let appended = match touched {
            Some((v4, v6)) if recorder.has_record() => recorder.append(record::Delta::of(
                &self.wanted,
                &v4.keys,
                &v6.keys,
                classifiers || v4.source_ranges || v6.source_ranges,
            )),
            _ => Ok(false),
        };
        let written = match appended {
            Ok(true) => Ok(()),
            Ok(false) => recorder.write_whole(&record::Entries::wanted(&self.wanted)),
            Err(error) => Err(error),
        };
        match written {
            Ok(()) => self.record_stale = false,
            // `vipr inspect drift` then compares with an older record until the next whole
            // one; the datapath is fine.
            Err(error) => warn!("cannot record the desired state: {error:#}"),
        }
    }

    /// Removes every program, link and pin vipr installed under `bpf_root`, and clsact filters
    /// it may have attached to `devices` on kernels without TCX.
    pub fn cleanup(bpf_root: &Path, devices: &[String]) -> anyhow::Result<()> {
        for device in devices {
            attach::detach_clsact(device, Hook::Ingress);
            attach::detach_clsact(device, Hook::Egress);
        }
        PinDir::new(bpf_root).remove_all()?;
        Ok(())
    }

    /// The Services of `state` that do not fit the maps; those with entries in the maps
    /// already keep their room. `changes`: what changed since the state last counted, or
    /// `None` to count everything.
    fn admit(&mut self, state: &DesiredState, changes: Option<&StateChanges>) -> Refused {
        match changes {
            Some(changes) => self.needs.update(state, &changes.frontends, changes.classifiers, self.modes),
            None => self.needs.rebuild(state, self.modes),
        }
        let (v4, v6) = (&self.v4, &self.v6);
        capacity::admit(self.needs.needs(), &self.capacity, || {
            let programmed: BTreeSet<(std::net::IpAddr, u16, u8)> =
                v4.programmed_frontends().chain(v6.programmed_frontends()).collect();
            state
                .frontends
                .iter()
                .filter(|(frontend, _)| {
                    programmed.contains(&(frontend.ip, frontend.port, frontend.protocol.number()))
                })
                .map(|(_, entry)| capacity::service_name(&entry.service))
                .collect()
        })
    }
}

/// Attaches the loaded programs: TC at every device of `pending`, XDP and the socket-level
/// load balancer; a hook an earlier vipr's pinned link holds is switched to the new program in
/// place. Then what `pending` carries is finished and the pins of retired layouts removed.
fn attach_all(
    ebpf: &mut Ebpf,
    pin_dir: &PinDir,
    hooks: &'static [Hook],
    pending: &mut PendingSwitch,
) -> anyhow::Result<(xdp_attach::XdpPath, Option<HostTraffic>)> {
    for &hook in hooks {
        let program = tc_program(ebpf, hook)?;
        for device in &pending.devices {
            let attachment = attach::attach(program, device, hook, &pin_dir.link(&hook.pin_name(device)))
                .with_context(|| format!("cannot attach to device {device} ({hook:?})"))?;
            info!(device, ?attachment, ?hook, "attached");
        }
    }
    // Right after the TC programs (which create the connections) serve, so that a connection
    // the earlier programs opened just before finds its entries in the new map as soon as
    // possible.
    pending.carrying.copy_added();
    attach::detach_stale_links(pin_dir, &link_names(hooks, &pending.devices))?;
    let xdp = xdp_attach::XdpPath::start(ebpf, pin_dir, pending.xdp, &pending.devices)?;
    let host_traffic = HostTraffic::start(ebpf, pin_dir, &pending.host)?;
    // The earlier XDP programs served until just now, and stored connections too.
    pending.carrying.copy_added();
    // Every hook serves with the new layouts now; the earlier maps are unused. Their pins go
    // last: until then, an agent killed half way leaves them for the next one, which redoes
    // the switch.
    std::mem::take(&mut pending.carrying).release();
    remove_pins(pin_dir, &pins::RETIRED);
    Ok((xdp, host_traffic))
}

/// The TC hooks a served device gets.
fn hooks(forwarding: BpfForwarding) -> &'static [Hook] {
    match forwarding {
        BpfForwarding::Stack => &[Hook::Ingress, Hook::Egress],
        BpfForwarding::Redirect => &[Hook::Ingress],
    }
}

/// The pin names of the TC links of `devices`.
fn link_names(hooks: &[Hook], devices: &[String]) -> Vec<String> {
    hooks.iter().flat_map(|hook| devices.iter().map(|device| hook.pin_name(device))).collect()
}

fn tc_program(ebpf: &mut Ebpf, hook: Hook) -> anyhow::Result<&mut SchedClassifier> {
    Ok(ebpf
        .program_mut(hook.program())
        .ok_or_else(|| anyhow!("program {} is missing from the object", hook.program()))?
        .try_into()?)
}

/// `--xdp`, unless forwarded packets go through the stack: XDP transmits the packets it
/// finishes itself, past netfilter, so it runs only with `--bpf-forwarding=redirect`.
fn xdp_mode(options: &EbpfOptions) -> XdpMode {
    match (options.forwarding, options.xdp) {
        (BpfForwarding::Redirect, mode) => mode,
        (BpfForwarding::Stack, XdpMode::Off) => XdpMode::Off,
        (BpfForwarding::Stack, XdpMode::Auto) => {
            info!("no XDP fast path: it would bypass netfilter's FORWARD chain (--bpf-forwarding=stack)");
            XdpMode::Off
        }
        (BpfForwarding::Stack, mode) => {
            warn!(?mode, "--xdp is ignored: the XDP fast path bypasses netfilter's FORWARD chain and runs only with --bpf-forwarding=redirect");
            XdpMode::Off
        }
    }
}

/// `devices` that exist, with their interface indexes.
fn with_indexes(devices: &[String]) -> Vec<(String, u32)> {
    devices.iter().filter_map(|device| Some((device.clone(), interface_index(device)?))).collect()
}

fn interface_index(device: &str) -> Option<u32> {
    let name = std::ffi::CString::new(device).ok()?;
    // SAFETY: `name` is a valid C string for the duration of the call.
    let index = unsafe { libc::if_nametoindex(name.as_ptr()) };
    (index != 0).then_some(index)
}

impl Dataplane for EbpfDataplane {
    fn mode(&self) -> Mode {
        Mode::Ebpf
    }

    fn device_server(&mut self) -> Option<&mut dyn ServesDevices> {
        Some(self)
    }

    fn sync_changes(&mut self, state: &DesiredState, changes: &StateChanges) -> anyhow::Result<SyncReport> {
        let mut incremental = changes.since.is_some() && changes.since == self.synced;
        let state_changed = !incremental || !changes.frontends.is_empty() || changes.classifiers;
        if state_changed {
            // What fits is decided again only when the state changed, and the Services the
            // kernel refused are tried again then: not on every periodic sync.
            if !std::mem::take(&mut self.write_refused).is_empty() {
                incremental = false;
            }
            let mut refused = self.admit(state, incremental.then_some(changes));
            if !refused.services.keys().eq(self.refused.services.keys())
                || refused.cluster_ips != self.refused.cluster_ips
            {
                // Entries of Services admitted or refused now are not among the changes.
                incremental = false;
            }
            // A Service still refused keeps its reason, so that it is reported once, not
            // again whenever another Service changes what is free.
            for (name, reason) in &mut refused.services {
                if let Some(before) = self.refused.services.get_mut(name) {
                    std::mem::swap(reason, before);
                }
            }
            self.refused = refused;
        }
        // Whatever happens below, the maps are only known to match a generation once it is done.
        self.synced = None;
        let touched = if incremental {
            Some(encode_changes(
                &mut self.wanted,
                state,
                &self.refused,
                changes,
                self.modes,
                &mut self.service_ids,
                &mut self.counter_ids,
            ))
        } else {
            self.wanted = encode_admitted(
                state,
                &self.refused,
                self.modes,
                &mut self.service_ids,
                &mut self.counter_ids,
            );
            None
        };
        self.record_stale |= touched.as_ref().is_none_or(|(v4, v6)| {
            !v4.keys.is_empty() || !v6.keys.is_empty() || v4.source_ranges || changes.classifiers
        });
        let wanted = &self.wanted;
        let mut report = SyncReport::default();
        // Before any slot carries them: a reused index must not show its earlier pair's count.
        self.counter_map.zero_many(&self.counter_ids.take_fresh());
        if let Some(host_traffic) = &mut self.host_traffic {
            host_traffic.refresh();
        }
        self.snat.refresh();
        self.pod_interfaces.follow(state.sources.pod_interfaces.as_ref());
        // Classification and filtering maps first: a new service entry must never be matched
        // with the previous state's source classes or ranges.
        let classifiers = touched.is_none() || changes.classifiers;
        let ranges = touched.as_ref().is_none_or(|(v4, _)| v4.source_ranges);
        self.v4.sync_classifiers(&wanted.v4, classifiers, ranges, &mut report);
        self.v6.sync_classifiers(&wanted.v6, classifiers, ranges, &mut report);
        let counter_map = &self.counter_map;
        let mut write_refused = Vec::new();
        match &touched {
            Some((v4, v6)) => {
                self.reaper.keep(&changes.listed_added);
                let mut released =
                    self.v4.sync_services(&wanted.v4, Some(&v4.keys), &mut report, &mut write_refused);
                released.extend(self.v6.sync_services(
                    &wanted.v6,
                    Some(&v6.keys),
                    &mut report,
                    &mut write_refused,
                ));
                self.reaper.forget(&changes.listed_removed);
                self.counter_ids.release(&released, |index| counter_map.read(index));
            }
            None => {
                self.reaper.keep_all(&state.listed_endpoints);
                self.v4.sync_services(&wanted.v4, None, &mut report, &mut write_refused);
                self.v6.sync_services(&wanted.v6, None, &mut report, &mut write_refused);
                // Also breaks off, after the first sync, the connections of endpoints that went
                // while no agent ran.
                self.reaper.keep_only(state.listed_endpoints.share());
                let in_use: BTreeSet<u32> =
                    self.v4.counters_in_use().chain(self.v6.counters_in_use()).collect();
                self.counter_ids.release_unused(&in_use, |index| counter_map.read(index));
            }
        }
        for (service_id, error) in write_refused {
            match self.service_ids.name_of(service_id) {
                Some(name) => {
                    self.write_refused.entry(capacity::service_name(name)).or_insert_with(|| {
                        format!("{error}; its entries are kept as they were until the state changes")
                    });
                }
                None => report.failed.push(error),
            }
        }
        report.refused = self
            .refused
            .reports()
            .chain(self.write_refused.iter().map(|(name, reason)| capacity::refusal(name, reason)))
            .collect();
        if report.is_complete() {
            self.synced = Some(changes.generation);
        }
        self.write_record(touched.as_ref(), changes.classifiers);
        debug!(%report, incremental, "ebpf sync");
        self.switch_after(&report)?;
        Ok(report)
    }

    fn collectors(&self) -> Vec<Arc<dyn Collector>> {
        self.collector.iter().map(|collector| collector.clone() as Arc<dyn Collector>).collect()
    }
}

impl ServesDevices for EbpfDataplane {
    fn serve_devices(&mut self, devices: &[String]) -> anyhow::Result<()> {
        // Before a new pod's veth gets the program: its first packet must count as a pod's.
        self.pod_interfaces.refresh();
        if let Some(pending) = &mut self.switch {
            // The earlier programs serve the devices they are attached to; the switch attaches
            // to the devices of the latest listing.
            pending.devices = devices.to_vec();
            return Ok(());
        }
        let devices = with_indexes(devices);
        if devices == self.devices {
            return Ok(());
        }
        let mut served = Vec::with_capacity(devices.len());
        for (device, index) in devices {
            if self.devices.contains(&(device.clone(), index)) {
                served.push((device, index));
                continue;
            }
            // A device can vanish again before we get to it; a failed one is retried with the
            // next listing. A device created again under a served name has lost its program
            // with its old self: the pinned link is defunct and `attach` replaces it.
            let attached = self.hooks.iter().try_for_each(|&hook| {
                let program = tc_program(&mut self.ebpf, hook)?;
                let attachment =
                    attach::attach(program, &device, hook, &self.pin_dir.link(&hook.pin_name(&device)))?;
                info!(device, index, ?attachment, ?hook, "attached to a new device");
                anyhow::Ok(())
            });
            match attached {
                Ok(()) => served.push((device, index)),
                Err(error) => warn!(device, "cannot attach to a new device: {error:#}"),
            }
        }
        let names: Vec<String> = served.iter().map(|(name, _)| name.clone()).collect();
        attach::detach_stale_links(&self.pin_dir, &link_names(self.hooks, &names))?;
        self.xdp.serve(&mut self.ebpf, &self.pin_dir, &names)?;
        self.devices = served;
        Ok(())
    }
}

/// Unpins maps of earlier layouts; a map no program uses any more is then freed.
fn remove_pins(pin_dir: &PinDir, names: &[&str]) {
    for name in names {
        let pin = pin_dir.path().join(name);
        match std::fs::remove_file(&pin) {
            Ok(()) => info!(pin = %pin.display(), "removed the pin of a retired map layout"),
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
            Err(error) => warn!(pin = %pin.display(), %error, "cannot remove a retired map's pin"),
        }
    }
}

fn take_map<M: TryFrom<aya::maps::Map, Error = aya::maps::MapError>>(
    ebpf: &mut Ebpf,
    name: &str,
) -> anyhow::Result<M> {
    let map = ebpf.take_map(name).ok_or_else(|| anyhow!("map {name} is missing from the object"))?;
    M::try_from(map).with_context(|| format!("map {name} does not have the expected layout"))
}

fn map_data(map: &aya::maps::Map) -> Option<&MapData> {
    match map {
        aya::maps::Map::HashMap(data)
        | aya::maps::Map::LruHashMap(data)
        | aya::maps::Map::PerCpuArray(data)
        | aya::maps::Map::LpmTrie(data) => Some(data),
        _ => None,
    }
}

// ---------------------------------------------------------------------------------------------
// Socket-level load balancing of the node's own traffic (proxy-ebpf/src/sock.rs): cgroup
// sock_addr programs on the cgroup v2 root, acting only on sockets of this agent's network
// namespace. See docs/architecture/host-traffic.md.

/// Where the socket-level load balancer attaches (vipr's `--cgroup-root`), and whether it
/// balances pods' sockets too.
#[derive(Clone, Debug, Default)]
pub struct HostTrafficOptions {
    /// The cgroup v2 directory whose processes' sockets are balanced (its descendants'
    /// included). `None`: the root of the cgroup2 mount in /proc/self/mounts.
    pub cgroup_root: Option<PathBuf>,
    /// `--bpf-socket-lb-pods`, `--pods-cgroup`.
    pub pods: pod_sockets::PodSocketOptions,
}

/// The attached hooks' settings map, kept to follow the node's default source address.
struct HostTraffic {
    config_map: aya::maps::Array<MapData, proxy_common::SockConfig>,
    config: proxy_common::SockConfig,
}

impl HostTraffic {
    /// Writes the settings (this namespace's cookie first: until then the programs act on no
    /// socket), loads the four programs and attaches them to the cgroup root, adopting the
    /// links an earlier agent pinned. Without a cgroup v2 hierarchy, or on a kernel that refuses
    /// the programs (they need 5.18: `bpf_set_retval`), the node's own traffic is not balanced:
    /// that is logged, any earlier hooks are detached, and the TC datapath serves on. Only a
    /// `--cgroup-root` given explicitly that cannot be used is an error.
    fn start(
        ebpf: &mut Ebpf,
        pin_dir: &PinDir,
        options: &HostTrafficOptions,
    ) -> anyhow::Result<Option<Self>> {
        use proxy_common::sock;

        let cgroup_root = match &options.cgroup_root {
            Some(root) => root.clone(),
            None => match cgroup2_mount().context("cannot read /proc/self/mounts")? {
                Some(root) => {
                    warn_unless_hierarchy_root(&root);
                    root
                }
                None => {
                    warn!(
                        "no cgroup2 file system is mounted: connections from the node itself to services are \
                         not balanced (mount one, or pass --cgroup-root)"
                    );
                    attach::detach_stale_cgroup_links(pin_dir, &[])?;
                    return Ok(None);
                }
            },
        };
        let mut config_map: aya::maps::Array<MapData, proxy_common::SockConfig> =
            take_map(ebpf, sock::CONFIG)?;
        let attached = netns_cookie()
            .context("cannot read this network namespace's cookie (SO_NETNS_COOKIE)")
            .and_then(|netns_cookie| {
                let config = proxy_common::SockConfig {
                    netns_cookie,
                    default_source4: default_source4(),
                    pad: 0,
                    default_source6: default_source6(),
                };
                config_map.set(0, config, 0).with_context(|| format!("cannot write {}", sock::CONFIG))?;
                Self::balance_pods(ebpf, &options.pods)?;
                Self::attach(ebpf, pin_dir, &cgroup_root)?;
                Ok(config)
            });
        let config = match attached {
            Ok(config) => config,
            Err(error) if options.cgroup_root.is_none() => {
                tracing::error!("connections from the node itself to services are not balanced: {error:#}");
                // The hooks go on or off together: reverse translations without forward ones,
                // or the other way round, would break connections.
                attach::detach_stale_cgroup_links(pin_dir, &[])?;
                return Ok(None);
            }
            Err(error) => return Err(error),
        };
        attach::detach_stale_cgroup_links(pin_dir, &sock::HOOKS.map(|hook| hook.link))?;
        remove_pins(pin_dir, &sock::RETIRED);
        info!(
            netns_cookie = config.netns_cookie,
            default_source4 = %std::net::Ipv4Addr::from(config.default_source4),
            default_source6 = %std::net::Ipv6Addr::from(config.default_source6),
            "balancing the node's own connections at the socket level"
        );
        Ok(Some(Self { config_map, config }))
    }

    /// Writes which sockets are pods' (`pod_sockets`), before the hooks attach. A pod cgroup
    /// that cannot be used leaves pods to the TC path, logged; the node's sockets are balanced
    /// either way.
    fn balance_pods(ebpf: &mut Ebpf, options: &pod_sockets::PodSocketOptions) -> anyhow::Result<()> {
        use proxy_common::sock::PODS;
        // Borrowed, not taken: the programs loaded next need the map's descriptor.
        let map = ebpf.map_mut(PODS).ok_or_else(|| anyhow!("map {PODS} is missing from the object"))?;
        let mut pods_map: aya::maps::Array<&mut MapData, proxy_common::SockPods> =
            aya::maps::Array::try_from(map)
                .with_context(|| format!("map {PODS} does not have the expected layout"))?;
        let resolved = cgroup2_mount()
            .context("cannot read /proc/self/mounts")
            .and_then(|mount| mount.context("no cgroup2 file system is mounted"))
            .and_then(|mount| pod_sockets::resolve(options, &mount));
        let pods = match resolved {
            Ok((pods, Some(cgroup))) => {
                info!(cgroup = %cgroup.display(), level = pods.level, "balancing pods' connections at the socket level");
                pods
            }
            Ok((pods, None)) => {
                info!(
                    enabled = options.enabled,
                    "pods' connections are balanced per packet by TC (no pods' cgroup: --pods-cgroup names it)"
                );
                pods
            }
            Err(error) => {
                tracing::error!("pods' connections are balanced per packet by TC: {error:#}");
                proxy_common::SockPods::default()
            }
        };
        pods_map.set(0, pods, 0).with_context(|| format!("cannot write {PODS}"))?;
        Ok(())
    }

    /// Loads every hook's program and attaches it to `cgroup_root`, the reverse path first.
    fn attach(ebpf: &mut Ebpf, pin_dir: &PinDir, cgroup_root: &Path) -> anyhow::Result<()> {
        for hook in proxy_common::sock::HOOKS {
            let program: &mut aya::programs::CgroupSockAddr = ebpf
                .program_mut(hook.program)
                .ok_or_else(|| anyhow!("program {} is missing from the object", hook.program))?
                .try_into()?;
            program_load::load_retrying(|| program.load())
                .with_context(|| format!("the kernel refused vipr's program {}", hook.program))?;
            let attachment = attach::attach_cgroup(program, cgroup_root, &pin_dir.link(hook.link))
                .with_context(|| {
                    format!("cannot attach {} to cgroup {}", hook.program, cgroup_root.display())
                })?;
            info!(hook = hook.link, cgroup = %cgroup_root.display(), ?attachment, "attached");
        }
        Ok(())
    }

    /// Follows the node's default source addresses (for source ranges of unbound sockets).
    fn refresh(&mut self) {
        let config = proxy_common::SockConfig {
            default_source4: default_source4(),
            default_source6: default_source6(),
            ..self.config
        };
        if config == self.config {
            return;
        }
        match self.config_map.set(0, config, 0) {
            Ok(()) => {
                info!(
                    default_source4 = %std::net::Ipv4Addr::from(config.default_source4),
                    default_source6 = %std::net::Ipv6Addr::from(config.default_source6),
                    "the node's default source changed"
                );
                self.config = config;
            }
            Err(error) => warn!(%error, "cannot update the socket load balancer's settings"),
        }
    }
}

/// The cgroup id of a cgroup v2 hierarchy's root (a cgroup's id is its directory's inode
/// number).
const CGROUP2_ROOT_ID: u64 = 1;

/// Warns when the cgroup2 mount the hooks would attach to by default is not the root of the
/// node's hierarchy. A pod whose cgroup namespace is private (containerd's and CRI-O's default on
/// cgroup v2) and that lacks the host's `/sys/fs/cgroup` sees only its namespace's subtree,
/// rooted at its own cgroup: hooks attached there balance the agent's own sockets and nothing
/// else, and nothing else would say so. They are attached all the same (an explicit
/// `--cgroup-root` below the root is a choice, and not checked).
fn warn_unless_hierarchy_root(mount: &Path) {
    match std::fs::metadata(mount).map(|metadata| std::os::unix::fs::MetadataExt::ino(&metadata)) {
        Ok(CGROUP2_ROOT_ID) => {}
        Ok(cgroup_id) => warn!(
            mount = %mount.display(),
            cgroup_id,
            "the cgroup2 mount is not the root of the node's cgroup hierarchy (a cgroup namespace's \
             own mount, or a subtree's): only sockets of processes below it are balanced at the socket \
             level; the node's other processes' connections to services are not balanced, and pods' \
             are balanced per packet by TC. Mount the host's cgroup2 hierarchy (deploy/daemonset.yaml \
             mounts the host's /sys/fs/cgroup) or pass --cgroup-root"
        ),
        Err(error) => warn!(mount = %mount.display(), %error, "cannot read the cgroup2 mount's cgroup id"),
    }
}

/// The first cgroup2 mount point in /proc/self/mounts.
fn cgroup2_mount() -> std::io::Result<Option<PathBuf>> {
    let mounts = std::fs::read_to_string("/proc/self/mounts")?;
    Ok(cgroup2_mount_in(&mounts))
}

fn cgroup2_mount_in(mounts: &str) -> Option<PathBuf> {
    mounts.lines().find_map(|line| {
        let mut fields = line.split_whitespace();
        let (_source, target, fstype) = (fields.next()?, fields.next()?, fields.next()?);
        (fstype == "cgroup2").then(|| PathBuf::from(unescape_mount_path(target)))
    })
}

/// /proc/mounts writes space, tab, newline and backslash in paths as octal escapes.
fn unescape_mount_path(path: &str) -> String {
    let bytes = path.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes.get(i + 1..i + 4).filter(|digits| digits.iter().all(|d| (b'0'..=b'7').contains(d)));
        match (bytes[i], octal) {
            (b'\\', Some(digits)) => {
                out.push(digits.iter().fold(0u8, |value, digit| value.wrapping_mul(8) + (digit - b'0')));
                i += 4;
            }
            (byte, _) => {
                out.push(byte);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The cookie of the agent's network namespace: what the programs compare each socket's
/// namespace with.
fn netns_cookie() -> std::io::Result<u64> {
    use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};

    // SAFETY: plain system call; the descriptor is owned right away.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is a new descriptor nothing else owns.
    let socket = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut cookie: u64 = 0;
    let mut len = std::mem::size_of::<u64>() as libc::socklen_t;
    // SAFETY: `cookie` and `len` are valid for writes of the sizes given.
    let result = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_NETNS_COOKIE,
            std::ptr::from_mut(&mut cookie).cast(),
            &mut len,
        )
    };
    if result != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(cookie)
}

/// The source address the kernel picks toward the IPv4 default route, or 0.0.0.0 without one.
fn default_source4() -> [u8; 4] {
    match default_source(std::net::Ipv4Addr::new(8, 8, 8, 8).into()) {
        Some(std::net::IpAddr::V4(source)) => source.octets(),
        _ => [0; 4],
    }
}

/// The same toward the IPv6 default route, or :: without one.
fn default_source6() -> [u8; 16] {
    match default_source(std::net::Ipv6Addr::new(0x2001, 0x4860, 0x4860, 0, 0, 0, 0, 0x8888).into()) {
        Some(std::net::IpAddr::V6(source)) => source.octets(),
        _ => [0; 16],
    }
}

/// The source the kernel picks toward `destination` (a UDP connect routes but sends nothing).
fn default_source(destination: std::net::IpAddr) -> Option<std::net::IpAddr> {
    let unspecified: std::net::IpAddr = match destination {
        std::net::IpAddr::V4(_) => std::net::Ipv4Addr::UNSPECIFIED.into(),
        std::net::IpAddr::V6(_) => std::net::Ipv6Addr::UNSPECIFIED.into(),
    };
    let source = std::net::UdpSocket::bind((unspecified, 0)).and_then(|socket| {
        socket.connect((destination, 53))?;
        socket.local_addr()
    });
    match source {
        Ok(source) => Some(source.ip()),
        Err(error) => {
            debug!(%error, %destination, "no default route: unbound sockets meet source ranges as unspecified");
            None
        }
    }
}

#[cfg(test)]
mod host_traffic_tests {
    use super::*;

    #[test]
    fn finds_the_cgroup2_mount() {
        let mounts = "tmpfs /sys/fs/cgroup tmpfs rw 0 0\n\
                      cgroup /sys/fs/cgroup/cpu cgroup rw,cpu 0 0\n\
                      cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0\n";
        assert_eq!(cgroup2_mount_in(mounts), Some(PathBuf::from("/sys/fs/cgroup/unified")));
        assert_eq!(cgroup2_mount_in("cgroup2 /a\\040b cgroup2 rw 0 0"), Some(PathBuf::from("/a b")));
        assert_eq!(cgroup2_mount_in("proc /proc proc rw 0 0"), None);
    }

    #[test]
    fn reads_this_namespace_cookie() {
        let cookie = netns_cookie().unwrap();
        assert_ne!(cookie, 0);
        assert_eq!(netns_cookie().unwrap(), cookie);
    }
}
