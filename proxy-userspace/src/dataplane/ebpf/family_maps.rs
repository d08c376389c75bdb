//! One address family's maps as the agent writes them: services and backends (planned by
//! [`super::plan`]) and the classification and filtering tries (synced by difference, see
//! [`super::mirror`]). The dataplane holds one of these per family.
use std::{
    collections::{hash_map::Entry, BTreeMap, BTreeSet, HashMap as StdHashMap, HashSet},
    os::fd::AsFd as _,
};

use anyhow::Context as _;
use aya::{
    maps::{HashMap, IterableMap as _, LpmTrie, MapData},
    Ebpf,
};
use proxy_common::{Backend, BackendMember, BackendSlot, Service, ServiceKey};
use tracing::{info, warn};

use super::{
    counters::CounterIds,
    encode::{FamilyWanted, ServiceIds},
    family::Family,
    mirror::{log_read_error, KeyedMap as _, Mirrored},
    plan::{plan, plan_changes, unused_sets, Programmed, SetIds},
    take_map,
};
use crate::{bpf_sys::update_batch, dataplane::SyncReport};

pub struct FamilyMaps<F: Family> {
    services: HashMap<MapData, ServiceKey<F>, Service>,
    backends: HashMap<MapData, BackendSlot, Backend<F>>,
    /// Which backends each set holds. Only session affinity (proxy-ebpf `affinity.rs`) and the
    /// check of a carried service address (`dsr.rs`) read it, so only the sets that such an
    /// entry points to ([`Service::keeps_members`]) get their members: most sets have none,
    /// and a sync from scratch writes a third fewer entries.
    members: HashMap<MapData, BackendMember<F>, u32>,
    /// The sets whose membership entries are all in the map.
    with_members: HashSet<u32>,
    /// How many programmed entries that keep members ([`Service::keeps_members`]) point to
    /// each set.
    member_refs: StdHashMap<u32, usize>,
    programmed: Programmed<F>,
    /// Indexes of `programmed` kept along with it, so that a sync of a few entries costs
    /// what they do: complete sets by their backends, how many entries point to each set,
    /// and how many sets carry each counter index.
    content: StdHashMap<Vec<Backend<F>>, u32>,
    set_refs: StdHashMap<u32, usize>,
    counter_refs: StdHashMap<u32, usize>,
    set_ids: SetIds,
    node_ips: Mirrored<HashMap<MapData, F, u8>>,
    pod_cidrs: Mirrored<LpmTrie<MapData, F, u8>>,
    unmatched: Mirrored<LpmTrie<MapData, F, u8>>,
    source_ranges: Mirrored<LpmTrie<MapData, F::RangeData, u8>>,
}

impl<F: Family> FamilyMaps<F> {
    /// Takes the family's maps out of the loaded object and reads back what they hold; the
    /// service ids found there are handed to `service_ids`, and the counter indices of the
    /// slots to `counters`, so adopted entries keep them.
    pub fn adopt(
        ebpf: &mut Ebpf,
        service_ids: &mut ServiceIds,
        counters: &mut CounterIds,
    ) -> anyhow::Result<Self> {
        let names = F::MAPS;
        let services: HashMap<MapData, ServiceKey<F>, Service> = take_map(ebpf, names.services)?;
        let backends: HashMap<MapData, BackendSlot, Backend<F>> = take_map(ebpf, names.backends)?;
        let programmed = Programmed::<F>::from_entries(
            services.iter().filter_map(log_read_error),
            backends.iter().filter_map(log_read_error),
        );
        for (key, service) in &programmed.services {
            service_ids.adopt::<F>(key, service.service_id);
            for backend in programmed.sets.get(&service.backend_set).into_iter().flatten() {
                let (ip, port, counter) = F::backend_parts(backend);
                counters.adopt(service.service_id, ip, port, counter);
            }
        }
        if !programmed.services.is_empty() {
            info!(family = F::NAME, entries = programmed.services.len(), "adopted the pinned datapath");
        }
        let mut members: HashMap<MapData, BackendMember<F>, u32> = take_map(ebpf, names.members)?;
        let with_members = remove_stale_members(&mut members, &programmed);
        let mut set_refs = StdHashMap::new();
        let mut member_refs = StdHashMap::new();
        for service in programmed.services.values() {
            *set_refs.entry(service.backend_set).or_default() += 1;
            if service.keeps_members() {
                *member_refs.entry(service.backend_set).or_default() += 1;
            }
        }
        let mut maps = Self {
            members,
            with_members,
            member_refs,
            node_ips: Mirrored::adopt(take_map(ebpf, names.node_ips)?),
            pod_cidrs: Mirrored::adopt(take_map(ebpf, names.pod_cidrs)?),
            unmatched: Mirrored::adopt(take_map(ebpf, names.unmatched)?),
            source_ranges: Mirrored::adopt(take_map(ebpf, names.source_ranges)?),
            services,
            backends,
            set_ids: SetIds::after(&programmed),
            programmed: Programmed::default(),
            content: StdHashMap::new(),
            set_refs,
            counter_refs: StdHashMap::new(),
        };
        for (set, backends) in programmed.sets {
            maps.insert_set(set, backends);
        }
        maps.programmed.services = programmed.services;
        Ok(maps)
    }

    /// Records a programmed set in `programmed` and the indexes.
    fn insert_set(&mut self, set: u32, backends: Vec<Backend<F>>) {
        for backend in &backends {
            *self.counter_refs.entry(F::backend_parts(backend).2).or_default() += 1;
        }
        if backends.iter().all(|backend| *backend != F::INCOMPLETE) {
            self.content.insert(backends.clone(), set);
        }
        self.programmed.sets.insert(set, backends);
    }

    /// Forgets a set; the counter indices no set carries any more go to `released`.
    fn remove_set(&mut self, set: u32, released: &mut Vec<u32>) -> Vec<Backend<F>> {
        let backends = self.programmed.sets.remove(&set).unwrap_or_default();
        if self.content.get(&backends) == Some(&set) {
            self.content.remove(&backends);
        }
        for backend in &backends {
            let counter = F::backend_parts(backend).2;
            if let Entry::Occupied(mut refs) = self.counter_refs.entry(counter) {
                *refs.get_mut() -= 1;
                if *refs.get() == 0 {
                    refs.remove();
                    released.push(counter);
                }
            }
        }
        backends
    }

    /// Records a programmed service entry; the set its old value pointed to may be unused now
    /// (`unused`), or used by no entry that keeps members (`without_members`).
    fn store_entry(
        &mut self,
        key: ServiceKey<F>,
        service: Option<Service>,
        unused: &mut BTreeSet<u32>,
        without_members: &mut Vec<u32>,
    ) {
        let old = match service {
            Some(service) => {
                *self.set_refs.entry(service.backend_set).or_default() += 1;
                if service.keeps_members() {
                    *self.member_refs.entry(service.backend_set).or_default() += 1;
                }
                self.programmed.services.insert(key, service)
            }
            None => self.programmed.services.remove(&key),
        };
        if let Some(old) = old {
            if release_ref(&mut self.set_refs, old.backend_set) {
                unused.insert(old.backend_set);
            }
            if old.keeps_members() && release_ref(&mut self.member_refs, old.backend_set) {
                without_members.push(old.backend_set);
            }
        }
    }

    /// Each map's capacity, as [`super::capacity::MapKind`] orders them: the kernel's
    /// `max_entries` (a pinned map may have kept another size than asked for).
    pub fn capacity(&self) -> [u64; 5] {
        let max_entries = |map: &MapData| map.info().map_or(0, |info| u64::from(info.max_entries()));
        [
            max_entries(self.services.map()),
            max_entries(self.backends.map()),
            max_entries(self.members.map()),
            max_entries(self.source_ranges.map.map()),
            max_entries(self.unmatched.map.map()),
        ]
    }

    /// The frontends (address, port, protocol) the services map holds entries of.
    pub fn programmed_frontends(&self) -> impl Iterator<Item = (std::net::IpAddr, u16, u8)> + '_ {
        self.programmed.services.keys().map(F::frontend)
    }

    /// The counter indices the programmed backend slots carry.
    pub fn counters_in_use(&self) -> impl Iterator<Item = u32> + '_ {
        self.programmed.sets.values().flatten().map(|backend| F::backend_parts(backend).2)
    }

    /// Classification and filtering maps; they go first, so that a new service entry is never
    /// matched with the previous state's source classes or ranges.
    /// Only the tries whose content may have changed are compared: the classifiers with
    /// `classifiers`, the source ranges with `ranges`.
    pub fn sync_classifiers(
        &mut self,
        wanted: &FamilyWanted<F>,
        classifiers: bool,
        ranges: bool,
        report: &mut SyncReport,
    ) {
        let none = || (0, Vec::new());
        for (name, (changed, failures)) in [
            ("node addresses", if classifiers { self.node_ips.sync(&wanted.node_ips) } else { none() }),
            ("pod CIDRs", if classifiers { self.pod_cidrs.sync(&wanted.pod_cidrs) } else { none() }),
            ("source ranges", if ranges { self.source_ranges.sync(&wanted.source_ranges) } else { none() }),
            (
                "unmatched destinations",
                if classifiers { self.unmatched.sync(&wanted.unmatched) } else { none() },
            ),
        ] {
            report.changed += changed;
            report
                .failed
                .extend(failures.into_iter().map(|failure| format!("{} {name}: {failure}", F::NAME)));
        }
    }

    /// Services and backends: fill new sets, switch entries, delete entries, clear sets no
    /// entry uses any more. With `keys`, only those entries are compared with `wanted` (the
    /// others are as programmed already). Returns the counter indices no slot carries now.
    /// Entries the kernel refuses to store (a full map) keep their old value; they go to
    /// `refused` with the service id they were for, for the caller to refuse that service.
    pub fn sync_services(
        &mut self,
        wanted: &FamilyWanted<F>,
        keys: Option<&BTreeSet<ServiceKey<F>>>,
        report: &mut SyncReport,
        refused: &mut Vec<(u32, String)>,
    ) -> Vec<u32> {
        let plan = match keys {
            None => plan(&self.programmed, &wanted.services, &mut self.set_ids),
            Some(keys) => {
                plan_changes(&self.programmed, &self.content, &wanted.services, keys, &mut self.set_ids)
            }
        };
        // The sets that need their members before the entries are stored: those an entry that
        // keeps members (session affinity, a carried address's check) is about to point to,
        // and, in a sync of everything, those of such entries kept as they are (an earlier
        // agent may have left them without).
        let mut need_members: HashSet<u32> = plan
            .stores
            .iter()
            .filter(|(_, service)| service.keeps_members())
            .map(|(_, service)| service.backend_set)
            .collect();
        if keys.is_none() {
            need_members.extend(self.member_refs.keys().copied());
        }
        need_members.retain(|set| *set != NO_BACKENDS && !self.with_members.contains(set));
        let mut failed_sets = HashSet::new();
        let mut released = Vec::new();
        let mut fill_errors = self.fill_sets(&plan.fills, &need_members);
        for (set, backends) in plan.fills {
            match fill_errors.remove(&set) {
                None => {
                    if need_members.remove(&set) {
                        self.with_members.insert(set);
                    }
                    self.insert_set(set, backends);
                }
                Some(error) => {
                    let error = format!(
                        "{} backend set of {} slots cannot be stored: {error:#}",
                        F::NAME,
                        backends.len()
                    );
                    refuse_users(&plan.stores, |service| service.backend_set == set, &error, refused);
                    // Not recorded as programmed: the slots written so far are cleared now.
                    self.clear_set(set, &backends, need_members.remove(&set));
                    failed_sets.insert(set);
                }
            }
        }
        // Sets in the maps already that gain a user that keeps members.
        let mut failed_members = HashSet::new();
        for set in need_members {
            let Some(backends) = self.programmed.sets.get(&set) else { continue };
            if backends.contains(&F::INCOMPLETE) {
                continue;
            }
            let backends = backends.clone();
            match self.write_members(set, &backends) {
                Ok(()) => {
                    self.with_members.insert(set);
                }
                Err(error) => {
                    let error = format!("{} backend set members cannot be stored: {error:#}", F::NAME);
                    let member_user =
                        |service: &Service| service.backend_set == set && service.keeps_members();
                    refuse_users(&plan.stores, member_user, &error, refused);
                    self.clear_members(set, &backends);
                    failed_members.insert(set);
                }
            }
        }
        let mut unused = BTreeSet::new();
        let mut without_members = Vec::new();
        // Deletions first: they make room in a full map for the entries stored next.
        for key in &plan.deletes {
            match self.services.delete(key) {
                Ok(()) => {
                    self.store_entry(*key, None, &mut unused, &mut without_members);
                    report.changed += 1;
                }
                Err(error) => report.failed.push(format!("deleting service entry {key:?}: {error}")),
            }
        }
        // An entry whose set failed keeps its old value, which still points to a complete set
        // (and one that keeps members whose set has none keeps its old value too).
        let (store_keys, store_values): (Vec<ServiceKey<F>>, Vec<Service>) = plan
            .stores
            .iter()
            .filter(|(_, service)| {
                !failed_sets.contains(&service.backend_set)
                    && (!service.keeps_members() || !failed_members.contains(&service.backend_set))
            })
            .copied()
            .unzip();
        // Each entry is one atomic switch whether it is written alone or in a batch.
        // SAFETY (and the other batches of this file): aya opened each map as a HashMap of
        // these key and value types, checking their sizes against the map's.
        if unsafe { update_batch(self.services.map().fd().as_fd(), &store_keys, &store_values) }.is_ok() {
            for (key, service) in store_keys.iter().zip(&store_values) {
                self.store_entry(*key, Some(*service), &mut unused, &mut without_members);
            }
            report.changed += store_keys.len();
        } else {
            for (key, service) in store_keys.iter().zip(&store_values) {
                match self.services.insert(key, service, 0) {
                    Ok(()) => {
                        self.store_entry(*key, Some(*service), &mut unused, &mut without_members);
                        report.changed += 1;
                    }
                    Err(error) => refused.push((
                        service.service_id,
                        format!("{} services entry cannot be stored: {error}", F::NAME),
                    )),
                }
            }
        }
        // Sets still in use that no entry keeping members points to any more lose their members
        // (unused ones lose them with their slots below).
        for set in without_members {
            if !self.member_refs.contains_key(&set)
                && self.set_refs.contains_key(&set)
                && self.with_members.remove(&set)
            {
                if let Some(backends) = self.programmed.sets.get(&set).cloned() {
                    self.clear_members(set, &backends);
                }
            }
        }
        let unused: Vec<u32> = match keys {
            // Sets nothing pointed to before this sync (left by an earlier agent) are found too.
            None => unused_sets(&self.programmed).into_iter().map(|(set, _)| set).collect(),
            Some(_) => unused.into_iter().filter(|set| !self.set_refs.contains_key(set)).collect(),
        };
        for set in unused {
            if set != NO_BACKENDS {
                let backends = self.remove_set(set, &mut released);
                let members = self.with_members.remove(&set);
                self.clear_set(set, &backends, members);
            }
        }
        released
    }

    /// Writes the slots of new sets, and the members of those in `need_members`, in batched
    /// updates of about [`FILL_BATCH`] slots across sets (a sync from scratch writes 10k sets
    /// in a few calls, not two each). The sets of a batch the kernel refuses (a full map, or a
    /// kernel without batches) are written again one by one, which names those that do not
    /// fit: they are returned with their errors.
    fn fill_sets(
        &mut self,
        fills: &[(u32, Vec<Backend<F>>)],
        need_members: &HashSet<u32>,
    ) -> StdHashMap<u32, anyhow::Error> {
        let mut failed = StdHashMap::new();
        let mut rest = fills;
        while !rest.is_empty() {
            let mut slots = 0;
            let count = rest
                .iter()
                .take_while(|(_, backends)| {
                    slots += backends.len();
                    slots <= FILL_BATCH
                })
                .count()
                .max(1);
            let (batch, after) = rest.split_at(count);
            rest = after;
            if self.fill_batch(batch, need_members) {
                continue;
            }
            for (set, backends) in batch {
                if let Err(error) = self.fill_set(*set, backends, need_members.contains(set)) {
                    failed.insert(*set, error);
                }
            }
        }
        failed
    }

    /// One batched update for the slots of `sets` and one for the members of those in
    /// `need_members`; false if the kernel refused either.
    fn fill_batch(&self, sets: &[(u32, Vec<Backend<F>>)], need_members: &HashSet<u32>) -> bool {
        let slots: usize = sets.iter().map(|(_, backends)| backends.len()).sum();
        let (mut keys, mut values) = (Vec::with_capacity(slots), Vec::with_capacity(slots));
        let (mut members, mut first) = (Vec::new(), Vec::new());
        for (set, backends) in sets {
            keys.extend((0..backends.len() as u32).map(|slot| BackendSlot { backend_set: *set, slot }));
            values.extend_from_slice(backends);
            if need_members.contains(set) {
                for (member, slot) in first_slots::<F>(*set, backends) {
                    members.push(member);
                    first.push(slot);
                }
            }
        }
        // SAFETY: as in `sync_services`' batch.
        unsafe { update_batch(self.backends.map().fd().as_fd(), &keys, &values) }.is_ok()
            && unsafe { update_batch(self.members.map().fd().as_fd(), &members, &first) }.is_ok()
    }

    /// The slots of one set, then (with `members`) its members: one batched update each where
    /// the kernel takes them; otherwise (or when a batch fails) one update per entry, which
    /// names the failure.
    fn fill_set(&mut self, set: u32, backends: &[Backend<F>], members: bool) -> anyhow::Result<()> {
        let slots: Vec<BackendSlot> =
            (0..backends.len() as u32).map(|slot| BackendSlot { backend_set: set, slot }).collect();
        // SAFETY: as in `sync_services`' batch.
        if unsafe { update_batch(self.backends.map().fd().as_fd(), &slots, backends) }.is_err() {
            for (slot, backend) in slots.iter().zip(backends) {
                self.backends
                    .insert(slot, backend, 0)
                    .context("cannot store a backend slot (is the backends map full?)")?;
            }
        }
        if members {
            self.write_members(set, backends)?;
        }
        Ok(())
    }

    /// Each distinct backend's first slot in the membership map (a Maglev table holds a
    /// backend many times).
    fn write_members(&mut self, set: u32, backends: &[Backend<F>]) -> anyhow::Result<()> {
        let (members, first): (Vec<BackendMember<F>>, Vec<u32>) =
            first_slots::<F>(set, backends).into_iter().unzip();
        // SAFETY: as in `sync_services`' batch.
        if unsafe { update_batch(self.members.map().fd().as_fd(), &members, &first) }.is_err() {
            for (member, slot) in members.iter().zip(first) {
                self.members
                    .insert(member, slot, 0)
                    .context("cannot store a backend-set member (is the membership map full?)")?;
            }
        }
        Ok(())
    }

    /// Best effort: a slot or member that cannot be deleted is harmless (no service points to
    /// its set) and is found again as unused when the agent restarts. `members`: the set's
    /// membership entries may be in the map.
    fn clear_set(&mut self, set: u32, backends: &[Backend<F>], members: bool) {
        for slot in 0..backends.len() as u32 {
            if let Err(error) = self.backends.delete(&BackendSlot { backend_set: set, slot }) {
                warn!(family = F::NAME, set, slot, %error, "cannot delete a retired backend slot");
            }
        }
        if members {
            self.clear_members(set, backends);
        }
    }

    fn clear_members(&mut self, set: u32, backends: &[Backend<F>]) {
        for (member, _) in first_slots::<F>(set, backends) {
            // A set that failed half-way has members only for the slots written before.
            let _ = self.members.delete(&member);
        }
    }
}

/// Slots per batched update of [`FamilyMaps::fill_sets`].
const FILL_BATCH: usize = 16_384;

/// The set of service entries without backends (see [`super::plan`]): no slots, no members.
const NO_BACKENDS: u32 = 0;

/// One reference fewer to `set` in `refs`; true when that was the last.
fn release_ref(refs: &mut StdHashMap<u32, usize>, set: u32) -> bool {
    if let Entry::Occupied(mut count) = refs.entry(set) {
        *count.get_mut() -= 1;
        if *count.get() == 0 {
            count.remove();
            return true;
        }
    }
    false
}

/// Refuses, with `error`, the services of the planned `stores` that `uses` says depend on
/// what failed.
fn refuse_users<F: Family>(
    stores: &[(ServiceKey<F>, Service)],
    uses: impl Fn(&Service) -> bool,
    error: &str,
    refused: &mut Vec<(u32, String)>,
) {
    let users: BTreeSet<u32> =
        stores.iter().filter(|(_, service)| uses(service)).map(|(_, service)| service.service_id).collect();
    refused.extend(users.into_iter().map(|id| (id, error.to_owned())));
}

/// Each distinct backend of a set with the first slot that holds it.
fn first_slots<F: Family>(set: u32, backends: &[Backend<F>]) -> BTreeMap<BackendMember<F>, u32> {
    let mut first = BTreeMap::new();
    for (slot, backend) in backends.iter().enumerate().rev() {
        first.insert(F::member(set, backend), slot as u32);
    }
    first
}

/// Deletes membership entries that no complete programmed set accounts for (sets left
/// incomplete by an earlier agent): a set id is reused later, and a stale member must never
/// send a client with session affinity into another service's set. Returns the sets whose
/// members are all there.
fn remove_stale_members<F: Family>(
    members: &mut HashMap<MapData, BackendMember<F>, u32>,
    programmed: &Programmed<F>,
) -> HashSet<u32> {
    let wanted: BTreeMap<BackendMember<F>, u32> =
        programmed.sets.iter().flat_map(|(set, backends)| first_slots::<F>(*set, backends)).collect();
    let mut present: StdHashMap<u32, usize> = StdHashMap::new();
    let mut stale = Vec::new();
    for (member, slot) in members.iter().filter_map(log_read_error) {
        if wanted.get(&member) == Some(&slot) {
            *present.entry(F::member_set(&member)).or_default() += 1;
        } else {
            stale.push(member);
        }
    }
    for member in stale {
        if let Err(error) = members.delete(&member) {
            warn!(family = F::NAME, set = F::member_set(&member), %error, "cannot delete a stale set member");
        }
    }
    programmed
        .sets
        .iter()
        .filter(|(set, backends)| {
            !backends.contains(&F::INCOMPLETE)
                && present.get(set).copied().unwrap_or(0) == first_slots::<F>(**set, backends).len()
        })
        .map(|(set, _)| *set)
        .collect()
}
