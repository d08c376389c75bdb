//! One address family's maps as the agent writes them: services and backends (planned by
//! [`super::plan`]) and the classification and filtering tries (synced by difference, see
//! [`super::mirror`]). The dataplane holds one of these per family.
use anyhow::Context as _;
use aya::{
    maps::{HashMap, LpmTrie, MapData},
    Ebpf,
};
use proxy_common::{BackendSlot, Service};
use tracing::{info, warn};

use super::{
    encode::{FamilyWanted, ServiceIds},
    family::Family,
    mirror::{log_read_error, KeyedMap as _, Mirrored},
    plan::{plan, unused_sets, Programmed, SetIds},
    take_map,
};
use crate::dataplane::SyncReport;

pub struct FamilyMaps<F: Family> {
    services: HashMap<MapData, F::ServiceKey, Service>,
    backends: HashMap<MapData, BackendSlot, F::Backend>,
    programmed: Programmed<F>,
    set_ids: SetIds,
    node_ips: Mirrored<HashMap<MapData, F::Addr, u8>>,
    pod_cidrs: Mirrored<LpmTrie<MapData, F::Addr, u8>>,
    unmatched: Mirrored<LpmTrie<MapData, F::Addr, u8>>,
    source_ranges: Mirrored<LpmTrie<MapData, F::RangeData, u8>>,
}

impl<F: Family> FamilyMaps<F> {
    /// Takes the family's maps out of the loaded object and reads back what they hold; the
    /// service ids found there are handed to `service_ids`, so adopted entries keep them.
    pub fn adopt(ebpf: &mut Ebpf, service_ids: &mut ServiceIds) -> anyhow::Result<Self> {
        let names = F::MAPS;
        let services: HashMap<MapData, F::ServiceKey, Service> = take_map(ebpf, names.services)?;
        let backends: HashMap<MapData, BackendSlot, F::Backend> = take_map(ebpf, names.backends)?;
        let programmed = Programmed::from_entries(
            services.iter().filter_map(log_read_error),
            backends.iter().filter_map(log_read_error),
        );
        for (key, service) in &programmed.services {
            service_ids.adopt::<F>(key, service.service_id);
        }
        if !programmed.services.is_empty() {
            info!(family = F::NAME, entries = programmed.services.len(), "adopted the pinned datapath");
        }
        Ok(Self {
            node_ips: Mirrored::adopt(take_map(ebpf, names.node_ips)?),
            pod_cidrs: Mirrored::adopt(take_map(ebpf, names.pod_cidrs)?),
            unmatched: Mirrored::adopt(take_map(ebpf, names.unmatched)?),
            source_ranges: Mirrored::adopt(take_map(ebpf, names.source_ranges)?),
            services,
            backends,
            set_ids: SetIds::after(&programmed),
            programmed,
        })
    }

    /// Classification and filtering maps; they go first, so that a new service entry is never
    /// matched with the previous state's source classes or ranges.
    pub fn sync_classifiers(&mut self, wanted: &FamilyWanted<F>, report: &mut SyncReport) {
        for (name, (changed, failures)) in [
            ("node addresses", self.node_ips.sync(&wanted.node_ips)),
            ("pod CIDRs", self.pod_cidrs.sync(&wanted.pod_cidrs)),
            ("source ranges", self.source_ranges.sync(&wanted.source_ranges)),
            ("unmatched destinations", self.unmatched.sync(&wanted.unmatched)),
        ] {
            report.changed += changed;
            report
                .failed
                .extend(failures.into_iter().map(|failure| format!("{} {name}: {failure}", F::NAME)));
        }
    }

    /// Services and backends: fill new sets, switch entries, delete entries, clear sets no
    /// entry uses any more.
    pub fn sync_services(&mut self, wanted: &FamilyWanted<F>, report: &mut SyncReport) {
        let plan = plan(&self.programmed, &wanted.services, &mut self.set_ids);
        let mut failed_sets = Vec::new();
        for (set, backends) in &plan.fills {
            match self.fill_set(*set, backends) {
                Ok(()) => {
                    self.programmed.sets.insert(*set, backends.clone());
                }
                Err(error) => {
                    report.failed.push(format!(
                        "{} backend set of {} backends: {error:#}",
                        F::NAME,
                        backends.len()
                    ));
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
            match self.services.delete(key) {
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

    fn fill_set(&mut self, set: u32, backends: &[F::Backend]) -> anyhow::Result<()> {
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
            if let Err(error) = self.backends.delete(&BackendSlot { backend_set: set, slot }) {
                warn!(family = F::NAME, set, slot, %error, "cannot delete a retired backend slot");
            }
        }
        self.programmed.sets.remove(&set);
    }
}
