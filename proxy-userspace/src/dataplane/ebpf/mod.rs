//! The eBPF dataplane: one TC program at ingress of every served device, and the pinned
//! services/backends/flows maps it reads.
//!
//! Everything is pinned under `<bpf-root>/vipr/`, so the datapath outlives the agent: an
//! agent that stops leaves traffic flowing, and an agent that starts adopts the pinned maps
//! and links and only writes what differs from its desired state.
use std::{
    collections::{BTreeMap, HashMap as StdHashMap},
    io,
    net::IpAddr,
    path::{Path, PathBuf},
};

use anyhow::{anyhow, Context as _};
use aya::{
    maps::{HashMap, MapData},
    programs::{
        links::{FdLink, LinkError, PinnedLink},
        tc::{self, SchedClassifierLink, TcAttachOptions},
        LinkOrder, SchedClassifier, TcAttachType,
    },
    sys::SyscallError,
    Ebpf, EbpfLoader,
};
use proxy_common::{pins, proto, Backend4, BackendSlot, Service, ServiceKey4};
use tracing::{debug, info, warn};

use self::plan::{plan, Change, Programmed, SetIds, WantedFrontend};
use super::{Dataplane, SyncReport};
use crate::model::{DesiredState, Protocol, ServicePortName};

mod pin_dir;
pub mod plan;

pub use pin_dir::PinDir;

#[derive(Clone, Debug)]
pub struct EbpfOptions {
    pub bpf_root: PathBuf,
    pub devices: Vec<String>,
}

/// How the program is attached to one device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Attachment {
    /// A TCX link, pinned so it stays attached without the agent.
    Tcx,
    /// A clsact filter (kernels before 6.6); it stays attached until removed by name.
    Clsact,
}

pub struct EbpfDataplane {
    // Holds the loaded program; dropping it would not detach the pinned links, but keeping
    // it avoids reloading on every sync.
    _ebpf: Ebpf,
    services: HashMap<MapData, ServiceKey4, Service>,
    backends: HashMap<MapData, BackendSlot, Backend4>,
    programmed: Programmed,
    set_ids: SetIds,
    service_ids: ServiceIds,
}

impl EbpfDataplane {
    /// Loads the program, reusing pinned maps, attaches it to every device, and reads back
    /// what the maps already hold.
    pub fn start(options: &EbpfOptions) -> anyhow::Result<Self> {
        let pin_dir = PinDir::new(&options.bpf_root);
        pin_dir.create(&options.bpf_root)?;
        let mut ebpf = EbpfLoader::new()
            .default_map_pin_directory(pin_dir.path())
            .load(crate::EBPF_OBJECT)
            .context("cannot load vipr's eBPF object (is this a kernel with BPF and BTF?)")?;

        let program: &mut SchedClassifier = ebpf
            .program_mut(pins::TC_INGRESS_PROGRAM)
            .ok_or_else(|| anyhow!("program {} is missing from the object", pins::TC_INGRESS_PROGRAM))?
            .try_into()?;
        program.load().context("the kernel refused vipr's TC program")?;
        for device in &options.devices {
            let attachment = attach(program, device, &pin_dir.link(device))
                .with_context(|| format!("cannot attach to device {device}"))?;
            info!(device, ?attachment, "attached at ingress");
        }
        detach_stale_links(&pin_dir, &options.devices)?;

        let services: HashMap<MapData, ServiceKey4, Service> = take_map(&mut ebpf, pins::SERVICES4)?;
        let backends: HashMap<MapData, BackendSlot, Backend4> = take_map(&mut ebpf, pins::BACKENDS4)?;
        let programmed = Programmed::from_entries(
            services.iter().filter_map(log_read_error),
            backends.iter().filter_map(log_read_error),
        );
        if !programmed.frontends.is_empty() {
            info!(frontends = programmed.frontends.len(), "adopted the pinned datapath");
        }
        Ok(Self {
            _ebpf: ebpf,
            services,
            backends,
            set_ids: SetIds::after(&programmed),
            service_ids: ServiceIds::default(),
            programmed,
        })
    }

    /// Removes every program, link and pin vipr installed under `bpf_root`, and clsact filters
    /// it may have attached to `devices` on kernels without TCX.
    pub fn cleanup(bpf_root: &Path, devices: &[String]) -> anyhow::Result<()> {
        for device in devices {
            detach_clsact(device);
        }
        PinDir::new(bpf_root).remove_all()?;
        Ok(())
    }

    fn apply(&mut self, change: &Change) -> anyhow::Result<()> {
        match change {
            Change::Upsert { key, fill, service, retire } => {
                if let Some(backends) = fill {
                    if let Err(error) = self.fill_set(service.backend_set, backends) {
                        // The service still points to its old set; only the new slots go.
                        self.clear_set(service.backend_set, backends.len() as u32);
                        return Err(error);
                    }
                }
                self.services.insert(key, service, 0).context("cannot store the service entry")?;
                if let Some((set, slots)) = retire {
                    self.clear_set(*set, *slots);
                }
            }
            Change::Remove { key, retire: (set, slots) } => {
                remove_entry(&mut self.services, key).context("cannot delete the service entry")?;
                self.clear_set(*set, *slots);
            }
            Change::ClearOrphanSet { set, slots } => self.clear_set(*set, *slots),
        }
        Ok(())
    }

    fn fill_set(&mut self, set: u32, backends: &[Backend4]) -> anyhow::Result<()> {
        for (slot, backend) in backends.iter().enumerate() {
            let slot = BackendSlot { backend_set: set, slot: slot as u32 };
            self.backends
                .insert(slot, backend, 0)
                .context("cannot store a backend slot (is the backends map full?)")?;
        }
        Ok(())
    }

    /// Best effort: a slot that cannot be deleted is harmless (no service points to it) and
    /// is found again as an orphan when the agent restarts.
    fn clear_set(&mut self, set: u32, slots: u32) {
        for slot in 0..slots {
            if let Err(error) = remove_entry(&mut self.backends, &BackendSlot { backend_set: set, slot }) {
                warn!(set, slot, %error, "cannot delete a retired backend slot");
            }
        }
    }

    /// The desired state in this dataplane's terms: IPv4 TCP/UDP frontends.
    fn wanted(
        &mut self,
        state: &DesiredState,
        report: &mut SyncReport,
    ) -> BTreeMap<ServiceKey4, WantedFrontend> {
        let mut wanted = BTreeMap::new();
        for (frontend, entry) in &state.frontends {
            let (IpAddr::V4(address), Some(protocol)) = (frontend.ip, ip_protocol(frontend.protocol)) else {
                report
                    .unsupported
                    .push(format!("{frontend} ({}): only IPv4 TCP and UDP are supported", entry.service));
                continue;
            };
            let backends: Vec<Backend4> = entry
                .backends
                .iter()
                .filter_map(|backend| match backend.ip {
                    IpAddr::V4(ip) => Some(Backend4 { addr: ip.octets(), port: backend.port, pad: 0 }),
                    IpAddr::V6(_) => None,
                })
                .collect();
            let key = ServiceKey4 { addr: address.octets(), port: frontend.port, proto: protocol, pad: 0 };
            let adopted_id = self.programmed.frontends.get(&key).map(|f| f.service.service_id);
            let service_id = self.service_ids.id(&entry.service, adopted_id);
            wanted.insert(key, WantedFrontend { service_id, flags: 0, backends });
        }
        wanted
    }
}

impl Dataplane for EbpfDataplane {
    fn mode(&self) -> &'static str {
        "ebpf"
    }

    fn sync(&mut self, state: &DesiredState) -> anyhow::Result<SyncReport> {
        let mut report = SyncReport::default();
        let wanted = self.wanted(state, &mut report);
        let changes = plan(&self.programmed, &wanted, &mut self.set_ids);
        for change in &changes {
            match self.apply(change) {
                Ok(()) => {
                    record(&mut self.programmed, change);
                    if !matches!(change, Change::ClearOrphanSet { .. }) {
                        report.changed += 1;
                    }
                }
                Err(error) => {
                    warn!(?change, "{error:#}");
                    report.failed.push(format!("{change:?}: {error:#}"));
                }
            }
        }
        debug!(changes = changes.len(), %report, "ebpf sync");
        Ok(report)
    }
}

/// Updates the view of the maps after a change was applied to them.
fn record(programmed: &mut Programmed, change: &Change) {
    match change {
        Change::Upsert { key, fill, service, .. } => {
            let backends = match (fill, programmed.frontends.get(key)) {
                (Some(backends), _) => backends.clone(),
                (None, Some(current)) => current.backends.clone(),
                (None, None) => Vec::new(),
            };
            programmed.frontends.insert(*key, plan::FrontendMaps { service: *service, backends });
        }
        Change::Remove { key, .. } => {
            programmed.frontends.remove(key);
        }
        Change::ClearOrphanSet { set, .. } => {
            programmed.orphan_sets.remove(set);
        }
    }
}

/// Stable small integers for service ports, reused from the maps after a restart so that
/// adopted entries are not rewritten just to renumber them.
#[derive(Default)]
struct ServiceIds {
    ids: StdHashMap<ServicePortName, u32>,
    next: u32,
}

impl ServiceIds {
    fn id(&mut self, name: &ServicePortName, adopted: Option<u32>) -> u32 {
        if let Some(id) = self.ids.get(name) {
            return *id;
        }
        let id = match adopted.filter(|id| !self.ids.values().any(|used| used == id)) {
            Some(id) => id,
            None => loop {
                self.next = self.next.wrapping_add(1);
                if self.next != 0 && !self.ids.values().any(|used| *used == self.next) {
                    break self.next;
                }
            },
        };
        self.ids.insert(name.clone(), id);
        id
    }
}

fn ip_protocol(protocol: Protocol) -> Option<u8> {
    match protocol {
        Protocol::Tcp => Some(proto::TCP),
        Protocol::Udp => Some(proto::UDP),
        Protocol::Sctp => None,
    }
}

fn take_map<K: aya::Pod, V: aya::Pod>(ebpf: &mut Ebpf, name: &str) -> anyhow::Result<HashMap<MapData, K, V>> {
    let map = ebpf.take_map(name).ok_or_else(|| anyhow!("map {name} is missing from the object"))?;
    HashMap::try_from(map).with_context(|| format!("map {name} does not have the expected layout"))
}

fn remove_entry<K: aya::Pod, V: aya::Pod>(
    map: &mut HashMap<MapData, K, V>,
    key: &K,
) -> Result<(), aya::maps::MapError> {
    match map.remove(key) {
        Err(aya::maps::MapError::KeyNotFound) => Ok(()),
        other => other,
    }
}

fn log_read_error<T>(entry: Result<T, aya::maps::MapError>) -> Option<T> {
    entry.map_err(|error| warn!(%error, "cannot read a pinned map entry")).ok()
}

/// Attaches `program` at ingress of `device`. A TCX link pinned by an earlier agent is
/// updated in place (the kernel swaps the program atomically, no packet sees a gap); a stale
/// one (its device is gone) is replaced.
fn attach(program: &mut SchedClassifier, device: &str, link_pin: &Path) -> anyhow::Result<Attachment> {
    match PinnedLink::from_pin(link_pin) {
        Ok(pinned) => {
            let link = SchedClassifierLink::try_from(FdLink::from(pinned))?;
            match program.attach_to_link(link) {
                Ok(id) => {
                    // Converting to FdLink releases aya's ownership without detaching; the pin
                    // keeps the link alive.
                    let _: FdLink = program.take_link(id)?.try_into()?;
                    return Ok(Attachment::Tcx);
                }
                Err(error) => {
                    warn!(device, %error, "the pinned link cannot be updated; attaching anew");
                    std::fs::remove_file(link_pin)?;
                }
            }
        }
        Err(LinkError::SyscallError(SyscallError { io_error, .. }))
            if io_error.kind() == io::ErrorKind::NotFound => {}
        Err(error) => return Err(error.into()),
    }
    match program.attach_with_options(
        device,
        TcAttachType::Ingress,
        TcAttachOptions::TcxOrder(LinkOrder::default()),
    ) {
        Ok(id) => {
            let link: FdLink = program.take_link(id)?.try_into()?;
            link.pin(link_pin).with_context(|| format!("cannot pin the link at {}", link_pin.display()))?;
            Ok(Attachment::Tcx)
        }
        Err(tcx_error) => {
            debug!(device, %tcx_error, "TCX attach failed; falling back to clsact");
            if let Err(error) = tc::qdisc_add_clsact(device) {
                debug!(device, %error, "clsact qdisc not added (it usually exists already)");
            }
            detach_clsact(device);
            let id = program
                .attach_with_options(
                    device,
                    TcAttachType::Ingress,
                    TcAttachOptions::Netlink(Default::default()),
                )
                .with_context(|| format!("TCX failed ({tcx_error}) and so did clsact"))?;
            // A clsact filter lives until removed; dropping aya's handle would remove it now.
            std::mem::forget(program.take_link(id)?);
            Ok(Attachment::Clsact)
        }
    }
}

fn detach_clsact(device: &str) {
    match tc::qdisc_detach_program(device, TcAttachType::Ingress, pins::TC_INGRESS_PROGRAM) {
        Ok(()) => info!(device, "detached a clsact filter"),
        Err(error) => debug!(device, %error, "no clsact filter detached"),
    }
}

/// Links pinned for devices that are no longer served are detached, so that dropping a device
/// from `--devices` really stops vipr there.
fn detach_stale_links(pin_dir: &PinDir, devices: &[String]) -> anyhow::Result<()> {
    for entry in std::fs::read_dir(pin_dir.links())? {
        let path = entry?.path();
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        if devices.contains(&name) {
            continue;
        }
        match PinnedLink::from_pin(&path) {
            Ok(pinned) => drop(pinned.unpin()?),
            Err(_) => std::fs::remove_file(&path)?,
        }
        info!(device = name, "detached from a device no longer in --devices");
    }
    Ok(())
}
