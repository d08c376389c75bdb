//! The eBPF dataplane: one TC program at ingress of every served device, and the pinned maps
//! it reads.
//!
//! Everything is pinned under `<bpf-root>/vipr/`, so the datapath outlives the agent: an
//! agent that stops leaves traffic flowing, and an agent that starts adopts the pinned maps
//! and links and only writes what differs from its desired state.
use std::path::{Path, PathBuf};

use anyhow::{anyhow, Context as _};
use aya::{
    maps::{HashMap, LpmTrie, MapData},
    programs::SchedClassifier,
    Ebpf, EbpfLoader,
};
use proxy_common::{pins, Backend4, BackendSlot, Service, ServiceKey4};
use tracing::{debug, info, warn};

use self::{
    encode::{encode, ServiceIds},
    mirror::{log_read_error, Mirrored},
    plan::{plan, unused_sets, Programmed, SetIds},
};
use super::{Dataplane, SyncReport};
use crate::model::DesiredState;

mod attach;
mod encode;
mod mirror;
mod pin_dir;
pub mod plan;

pub use attach::Attachment;
pub use pin_dir::PinDir;

#[derive(Clone, Debug)]
pub struct EbpfOptions {
    pub bpf_root: PathBuf,
    pub devices: Vec<String>,
}

pub struct EbpfDataplane {
    /// Holds the loaded program, to attach it to devices that appear later.
    ebpf: Ebpf,
    pin_dir: PinDir,
    devices: Vec<String>,
    services: HashMap<MapData, ServiceKey4, Service>,
    backends: HashMap<MapData, BackendSlot, Backend4>,
    programmed: Programmed,
    set_ids: SetIds,
    service_ids: ServiceIds,
    node_ips: Mirrored<HashMap<MapData, [u8; 4], u8>>,
    pod_cidrs: Mirrored<LpmTrie<MapData, [u8; 4], u8>>,
    unmatched: Mirrored<LpmTrie<MapData, [u8; 4], u8>>,
    source_ranges: Mirrored<LpmTrie<MapData, [u8; 8], u8>>,
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
            let attachment = attach::attach(program, device, &pin_dir.link(device))
                .with_context(|| format!("cannot attach to device {device}"))?;
            info!(device, ?attachment, "attached at ingress");
        }
        attach::detach_stale_links(&pin_dir, &options.devices)?;

        let services: HashMap<MapData, ServiceKey4, Service> = take_map(&mut ebpf, pins::SERVICES4)?;
        let backends: HashMap<MapData, BackendSlot, Backend4> = take_map(&mut ebpf, pins::BACKENDS4)?;
        let programmed = Programmed::from_entries(
            services.iter().filter_map(log_read_error),
            backends.iter().filter_map(log_read_error),
        );
        let mut service_ids = ServiceIds::default();
        for (key, service) in &programmed.services {
            service_ids.adopt(key, service.service_id);
        }
        if !programmed.services.is_empty() {
            info!(entries = programmed.services.len(), "adopted the pinned datapath");
        }
        Ok(Self {
            node_ips: Mirrored::adopt(take_map(&mut ebpf, pins::NODE_IPS4)?),
            pod_cidrs: Mirrored::adopt(take_map(&mut ebpf, pins::POD_CIDRS4)?),
            unmatched: Mirrored::adopt(take_map(&mut ebpf, pins::UNMATCHED4)?),
            source_ranges: Mirrored::adopt(take_map(&mut ebpf, pins::SOURCE_RANGES4)?),
            ebpf,
            pin_dir,
            devices: options.devices.clone(),
            services,
            backends,
            set_ids: SetIds::after(&programmed),
            service_ids,
            programmed,
        })
    }

    /// Removes every program, link and pin vipr installed under `bpf_root`, and clsact filters
    /// it may have attached to `devices` on kernels without TCX.
    pub fn cleanup(bpf_root: &Path, devices: &[String]) -> anyhow::Result<()> {
        for device in devices {
            attach::detach_clsact(device);
        }
        PinDir::new(bpf_root).remove_all()?;
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
    /// is found again as unused when the agent restarts.
    fn clear_set(&mut self, set: u32, slots: u32) {
        for slot in 0..slots {
            if let Err(error) =
                mirror::KeyedMap::delete(&mut self.backends, &BackendSlot { backend_set: set, slot })
            {
                warn!(set, slot, %error, "cannot delete a retired backend slot");
            }
        }
        self.programmed.sets.remove(&set);
    }

    /// Services and backends: fill new sets, switch entries, delete entries, clear sets no
    /// entry uses any more.
    fn sync_services(
        &mut self,
        wanted: &std::collections::BTreeMap<ServiceKey4, plan::WantedService>,
        report: &mut SyncReport,
    ) {
        let plan = plan(&self.programmed, wanted, &mut self.set_ids);
        let mut failed_sets = Vec::new();
        for (set, backends) in &plan.fills {
            match self.fill_set(*set, backends) {
                Ok(()) => {
                    self.programmed.sets.insert(*set, backends.clone());
                }
                Err(error) => {
                    report.failed.push(format!("backend set of {} backends: {error:#}", backends.len()));
                    // Not recorded as programmed: the slots written so far are cleared now.
                    self.clear_set(*set, backends.len() as u32);
                    failed_sets.push(*set);
                }
            }
        }
        for (key, service) in &plan.stores {
            if failed_sets.contains(&service.backend_set) {
                // The entry keeps its old value, which still points to a complete set.
                continue;
            }
            match self.services.insert(key, service, 0) {
                Ok(()) => {
                    self.programmed.services.insert(*key, *service);
                    report.changed += 1;
                }
                Err(error) => report.failed.push(format!("service entry {key:?}: {error}")),
            }
        }
        for key in &plan.deletes {
            match mirror::KeyedMap::delete(&mut self.services, key) {
                Ok(()) => {
                    self.programmed.services.remove(key);
                    report.changed += 1;
                }
                Err(error) => report.failed.push(format!("deleting service entry {key:?}: {error}")),
            }
        }
        for (set, slots) in unused_sets(&self.programmed) {
            self.clear_set(set, slots);
        }
    }
}

impl Dataplane for EbpfDataplane {
    fn mode(&self) -> &'static str {
        "ebpf"
    }

    fn serve_devices(&mut self, devices: &[String]) -> anyhow::Result<()> {
        if devices == self.devices {
            return Ok(());
        }
        let program: &mut SchedClassifier = self
            .ebpf
            .program_mut(pins::TC_INGRESS_PROGRAM)
            .ok_or_else(|| anyhow!("program {} is missing", pins::TC_INGRESS_PROGRAM))?
            .try_into()?;
        let mut served = Vec::with_capacity(devices.len());
        for device in devices {
            if self.devices.contains(device) {
                served.push(device.clone());
                continue;
            }
            // A device can vanish again before we get to it; a failed one is retried with the
            // next listing.
            match attach::attach(program, device, &self.pin_dir.link(device)) {
                Ok(attachment) => {
                    info!(device, ?attachment, "attached at ingress of a new device");
                    served.push(device.clone());
                }
                Err(error) => warn!(device, "cannot attach to a new device: {error:#}"),
            }
        }
        attach::detach_stale_links(&self.pin_dir, &served)?;
        self.devices = served;
        Ok(())
    }

    fn sync(&mut self, state: &DesiredState) -> anyhow::Result<SyncReport> {
        let wanted = encode(state, &mut self.service_ids);
        let mut report = SyncReport { unsupported: wanted.unsupported.clone(), ..SyncReport::default() };
        // Classification and filtering maps first: a new service entry must never be matched
        // with the previous state's source classes or ranges.
        for (name, (changed, failures)) in [
            ("node addresses", self.node_ips.sync(&wanted.node_ips)),
            ("pod CIDRs", self.pod_cidrs.sync(&wanted.pod_cidrs)),
            ("source ranges", self.source_ranges.sync(&wanted.source_ranges)),
            ("unmatched destinations", self.unmatched.sync(&wanted.unmatched)),
        ] {
            report.changed += changed;
            report.failed.extend(failures.into_iter().map(|failure| format!("{name}: {failure}")));
        }
        self.sync_services(&wanted.services, &mut report);
        debug!(%report, "ebpf sync");
        Ok(report)
    }
}

fn take_map<M: TryFrom<aya::maps::Map, Error = aya::maps::MapError>>(
    ebpf: &mut Ebpf,
    name: &str,
) -> anyhow::Result<M> {
    let map = ebpf.take_map(name).ok_or_else(|| anyhow!("map {name} is missing from the object"))?;
    M::try_from(map).with_context(|| format!("map {name} does not have the expected layout"))
}
