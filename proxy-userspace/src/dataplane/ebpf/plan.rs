//! What the services and backends maps hold, what they should hold, and the map operations
//! between the two.
//!
//! Pure: no syscalls, so the diff is unit-tested without a kernel. Backend sets are
//! content-addressed: every service entry whose backends are the same list shares one set
//! (a service's cluster-IP, NodePort and load-balancer frontends usually do, for every source
//! class). The order of a [`Plan`] keeps the datapath consistent: sets are filled before any
//! entry points to them, and a set is cleared only once no entry does ([`unused_sets`]).
//!
//! Generic over the address family: each family's services and backends maps are planned on
//! their own, with their own backend set ids.
use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    sync::Arc,
};

use proxy_common::{Backend, BackendSlot, Service, ServiceKey};

use super::family::Family;

/// The content of one family's services and backends maps, as last written (or read back at
/// adoption).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Programmed<F: Family> {
    pub services: BTreeMap<ServiceKey<F>, Service>,
    /// Slot `i` of set `id` holds `sets[id][i]`.
    pub sets: BTreeMap<u32, Vec<Backend<F>>>,
}

impl<F: Family> Default for Programmed<F> {
    fn default() -> Self {
        Self { services: BTreeMap::new(), sets: BTreeMap::new() }
    }
}

impl<F: Family> Programmed<F> {
    /// Rebuilds the view from map entries, e.g. after an agent restart. A set with a missing
    /// slot reads back shorter than its services' `backend_count`, so it matches no wanted
    /// list and its services are moved to a fresh set.
    pub fn from_entries(
        services: impl IntoIterator<Item = (ServiceKey<F>, Service)>,
        slots: impl IntoIterator<Item = (BackendSlot, Backend<F>)>,
    ) -> Self {
        let mut by_set: BTreeMap<u32, BTreeMap<u32, Backend<F>>> = BTreeMap::new();
        for (slot, backend) in slots {
            by_set.entry(slot.backend_set).or_default().insert(slot.slot, backend);
        }
        let services: BTreeMap<ServiceKey<F>, Service> = services.into_iter().collect();
        let sets = by_set
            .into_iter()
            .map(|(id, slots)| {
                let contiguous: Vec<Backend<F>> = (0..).map_while(|slot| slots.get(&slot).copied()).collect();
                let complete = contiguous.len() == slots.len()
                    && services
                        .values()
                        .filter(|service| service.backend_set == id)
                        .all(|service| service.backend_count as usize == slots.len());
                // An incomplete set can only be garbage: keep its extent so it is cleared whole.
                (id, if complete { contiguous } else { incomplete_marker::<F>(&slots) })
            })
            .collect();
        Self { services, sets }
    }

    fn content_index(&self) -> HashMap<&[Backend<F>], u32> {
        self.sets
            .iter()
            .filter(|(_, backends)| backends.iter().all(|b| *b != F::INCOMPLETE))
            .map(|(id, backends)| (backends.as_slice(), *id))
            .collect()
    }
}

/// The set of services without backends: it has no slots, so it is never filled or cleared,
/// and it is the same set after a restart (an empty set leaves nothing in the map to find).
const NO_BACKENDS: u32 = 0;

/// The slots of an incomplete set, as [`Family::INCOMPLETE`] placeholders: no wanted list
/// matches the set.
fn incomplete_marker<F: Family>(slots: &BTreeMap<u32, Backend<F>>) -> Vec<Backend<F>> {
    let len = slots.keys().max().map_or(0, |max| *max as usize + 1);
    vec![F::INCOMPLETE; len]
}

/// What one service entry should hold, without a backend set (that is the planner's
/// choice).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WantedService<F: Family> {
    /// Shared by the entries of a frontend whose source classes use the same backends.
    pub backends: Arc<[Backend<F>]>,
    pub service_id: u32,
    pub flags: u32,
    /// Seconds of ClientIP session affinity; 0 for none.
    pub affinity_timeout: u32,
}

/// Map operations, applied in field order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan<F: Family> {
    /// New sets to write: (set id, its backends).
    pub fills: Vec<(u32, Vec<Backend<F>>)>,
    /// Service entries to add or change.
    pub stores: Vec<(ServiceKey<F>, Service)>,
    /// Service entries to delete.
    pub deletes: Vec<ServiceKey<F>>,
}

impl<F: Family> Default for Plan<F> {
    fn default() -> Self {
        Self { fills: Vec::new(), stores: Vec::new(), deletes: Vec::new() }
    }
}

impl<F: Family> Plan<F> {
    pub fn is_empty(&self) -> bool {
        self.fills.is_empty() && self.stores.is_empty() && self.deletes.is_empty()
    }
}

/// Hands out backend set ids that no entry uses. Ids are never reused while in use, so a
/// packet that read an old service entry can never find another service's backends.
#[derive(Debug)]
pub struct SetIds {
    next: u32,
}

impl SetIds {
    pub fn after<F: Family>(programmed: &Programmed<F>) -> Self {
        let highest = programmed.sets.keys().max().copied().unwrap_or(0);
        Self { next: highest.wrapping_add(1).max(1) }
    }

    fn allocate(&mut self, in_use: impl Fn(u32) -> bool) -> u32 {
        while self.next == 0 || in_use(self.next) {
            self.next = self.next.wrapping_add(1);
        }
        let id = self.next;
        self.next = self.next.wrapping_add(1);
        id
    }
}

/// The operations that turn `programmed` into `wanted`; entries that already match get none.
pub fn plan<F: Family>(
    programmed: &Programmed<F>,
    wanted: &BTreeMap<ServiceKey<F>, WantedService<F>>,
    ids: &mut SetIds,
) -> Plan<F> {
    let existing = programmed.content_index();
    let gone = programmed.services.keys().filter(|key| !wanted.contains_key(key)).map(|key| (key, None));
    let entries = wanted.iter().map(|(key, want)| (key, Some(want))).chain(gone);
    plan_entries(programmed, |backends| existing.get(backends).copied(), entries, ids)
}

/// [`plan`] for the entries under `keys` only, the others being as programmed already;
/// `content` indexes the programmed sets by their backends.
pub fn plan_changes<F: Family>(
    programmed: &Programmed<F>,
    content: &HashMap<Vec<Backend<F>>, u32>,
    wanted: &BTreeMap<ServiceKey<F>, WantedService<F>>,
    keys: &BTreeSet<ServiceKey<F>>,
    ids: &mut SetIds,
) -> Plan<F> {
    let entries = keys.iter().map(|key| (key, wanted.get(key)));
    plan_entries(programmed, |backends| content.get(backends).copied(), entries, ids)
}

/// Plans each entry: its wanted value, or `None` for one that should not exist.
fn plan_entries<'a, F: Family + 'a>(
    programmed: &Programmed<F>,
    existing: impl Fn(&[Backend<F>]) -> Option<u32>,
    entries: impl Iterator<Item = (&'a ServiceKey<F>, Option<&'a WantedService<F>>)>,
    ids: &mut SetIds,
) -> Plan<F> {
    let mut new_sets: HashMap<&[Backend<F>], u32> = HashMap::new();
    let mut new_ids: BTreeSet<u32> = BTreeSet::new();
    let mut plan = Plan::default();
    for (key, want) in entries {
        let Some(want) = want else {
            if programmed.services.contains_key(key) {
                plan.deletes.push(*key);
            }
            continue;
        };
        let backends = &*want.backends;
        let set = match existing(backends).or_else(|| new_sets.get(backends).copied()) {
            _ if backends.is_empty() => NO_BACKENDS,
            Some(set) => set,
            None => {
                let id = ids.allocate(|id| programmed.sets.contains_key(&id) || new_ids.contains(&id));
                new_ids.insert(id);
                new_sets.insert(backends, id);
                plan.fills.push((id, want.backends.to_vec()));
                id
            }
        };
        let service = Service {
            backend_set: set,
            backend_count: backends.len() as u32,
            service_id: want.service_id,
            flags: want.flags,
            affinity_timeout: want.affinity_timeout,
            pad: 0,
        };
        if programmed.services.get(key) != Some(&service) {
            plan.stores.push((*key, service));
        }
    }
    plan
}

/// Sets no service entry points to: (set id, slot count), to clear after the entries that
/// used them were switched or deleted.
pub fn unused_sets<F: Family>(programmed: &Programmed<F>) -> Vec<(u32, u32)> {
    let referenced: BTreeSet<u32> = programmed.services.values().map(|s| s.backend_set).collect();
    programmed
        .sets
        .iter()
        .filter(|(id, _)| !referenced.contains(id))
        .map(|(id, backends)| (*id, backends.len() as u32))
        .collect()
}

#[cfg(test)]
mod tests {
    use proxy_common::{Backend4, ServiceKey4};

    use super::*;
    use crate::dataplane::ebpf::family::{V4, V6};

    type Programmed = super::Programmed<V4>;
    type Plan = super::Plan<V4>;
    type WantedService = super::WantedService<V4>;

    fn key(last: u8, class: u8) -> ServiceKey4 {
        ServiceKey4 {
            addr: [10, 96, 0, last],
            port: 80,
            proto: proxy_common::proto::TCP,
            source_class: class,
        }
    }

    fn backend(last: u8) -> Backend4 {
        Backend4 { addr: [10, 0, 0, last], port: 8080, pad: 0, counter: u32::from(last) }
    }

    fn wanted(entries: &[(ServiceKey4, u32, &[u8])]) -> BTreeMap<ServiceKey4, WantedService> {
        entries
            .iter()
            .map(|(key, id, backends)| {
                let backends = backends.iter().map(|b| backend(*b)).collect();
                (*key, WantedService { service_id: *id, flags: 0, affinity_timeout: 0, backends })
            })
            .collect()
    }

    /// Applies a plan to an in-memory copy of the maps the way the dataplane does, including
    /// clearing unused sets afterwards; returns the maps read back as after a restart.
    fn apply(programmed: &Programmed, plan: &Plan) -> Programmed {
        let mut services = programmed.services.clone();
        let mut sets = programmed.sets.clone();
        for (id, backends) in &plan.fills {
            sets.insert(*id, backends.clone());
        }
        for (key, service) in &plan.stores {
            assert!(
                service.backend_set == NO_BACKENDS || sets.contains_key(&service.backend_set),
                "entry stored before its set was filled"
            );
            services.insert(*key, *service);
        }
        for key in &plan.deletes {
            services.remove(key);
        }
        let mut applied = Programmed { services, sets };
        for (id, _) in unused_sets(&applied) {
            applied.sets.remove(&id);
        }
        let slots = applied.sets.iter().flat_map(|(id, backends)| {
            backends.iter().enumerate().map(|(i, b)| (BackendSlot { backend_set: *id, slot: i as u32 }, *b))
        });
        Programmed::from_entries(applied.services.clone(), slots.collect::<Vec<_>>())
    }

    fn converge(
        programmed: &Programmed,
        want: &BTreeMap<ServiceKey4, WantedService>,
        ids: &mut SetIds,
    ) -> Programmed {
        apply(programmed, &plan(programmed, want, ids))
    }

    #[test]
    fn identical_backend_lists_share_one_set() {
        let programmed = Programmed::default();
        let mut ids = SetIds::after(&programmed);
        let want = wanted(&[(key(1, 0), 7, &[1, 2]), (key(1, 1), 7, &[1, 2]), (key(2, 0), 8, &[2, 1])]);
        let plan = plan(&programmed, &want, &mut ids);
        assert_eq!(plan.fills, vec![(1, vec![backend(1), backend(2)]), (2, vec![backend(2), backend(1)])]);
        assert_eq!(plan.stores.len(), 3);
        assert_eq!(plan.stores[0].1.backend_set, plan.stores[1].1.backend_set);
    }

    #[test]
    fn unchanged_state_plans_nothing() {
        let want = wanted(&[(key(1, 0), 7, &[1, 2]), (key(2, 0), 8, &[])]);
        let mut ids = SetIds::after(&Programmed::default());
        let programmed = converge(&Programmed::default(), &want, &mut ids);
        assert!(plan(&programmed, &want, &mut ids).is_empty());
    }

    #[test]
    fn backend_change_switches_to_a_fresh_set_and_the_old_one_becomes_unused() {
        let mut ids = SetIds::after(&Programmed::default());
        let before = converge(&Programmed::default(), &wanted(&[(key(1, 0), 7, &[1, 2, 3])]), &mut ids);
        let old_set = before.services[&key(1, 0)].backend_set;
        let plan = plan(&before, &wanted(&[(key(1, 0), 7, &[1, 3])]), &mut ids);
        let [(new_set, fill)] = plan.fills.as_slice() else { panic!("unexpected plan {plan:?}") };
        assert_ne!(*new_set, old_set, "the live set must never be rewritten in place");
        assert_eq!(fill, &vec![backend(1), backend(3)]);
        let after = apply(&before, &plan);
        assert_eq!(after.sets.keys().copied().collect::<Vec<_>>(), vec![*new_set]);
    }

    #[test]
    fn a_set_still_used_by_another_entry_is_kept() {
        let mut ids = SetIds::after(&Programmed::default());
        let before = converge(
            &Programmed::default(),
            &wanted(&[(key(1, 0), 7, &[1]), (key(2, 0), 8, &[1])]),
            &mut ids,
        );
        let after = converge(&before, &wanted(&[(key(1, 0), 7, &[2]), (key(2, 0), 8, &[1])]), &mut ids);
        assert_eq!(after.sets.len(), 2);
        assert_eq!(after.sets[&after.services[&key(2, 0)].backend_set], vec![backend(1)]);
    }

    #[test]
    fn identity_change_keeps_the_backend_set() {
        let mut ids = SetIds::after(&Programmed::default());
        let before = converge(&Programmed::default(), &wanted(&[(key(1, 0), 7, &[1])]), &mut ids);
        let plan = plan(&before, &wanted(&[(key(1, 0), 9, &[1])]), &mut ids);
        assert!(plan.fills.is_empty());
        assert_eq!(plan.stores[0].1.backend_set, before.services[&key(1, 0)].backend_set);
    }

    #[test]
    fn removed_entries_are_deleted_and_their_sets_cleared() {
        let mut ids = SetIds::after(&Programmed::default());
        let want = wanted(&[(key(1, 0), 7, &[1]), (key(2, 0), 8, &[2, 3])]);
        let before = converge(&Programmed::default(), &want, &mut ids);
        let after = converge(&before, &wanted(&[(key(1, 0), 7, &[1])]), &mut ids);
        assert_eq!(after.services.keys().collect::<Vec<_>>(), vec![&key(1, 0)]);
        assert_eq!(after.sets.len(), 1);
    }

    #[test]
    fn adoption_reads_back_the_maps_and_finds_orphans() {
        let services = [(
            key(1, 0),
            Service { backend_set: 5, backend_count: 2, service_id: 1, flags: 0, ..Service::default() },
        )];
        let slots = [
            (BackendSlot { backend_set: 5, slot: 0 }, backend(1)),
            (BackendSlot { backend_set: 5, slot: 1 }, backend(2)),
            (BackendSlot { backend_set: 9, slot: 0 }, backend(3)),
        ];
        let adopted = Programmed::from_entries(services, slots);
        assert_eq!(adopted.sets[&5], vec![backend(1), backend(2)]);
        assert_eq!(unused_sets(&adopted), vec![(9, 1)]);
        let mut ids = SetIds::after(&adopted);
        assert!(plan(&adopted, &wanted(&[(key(1, 0), 1, &[1, 2])]), &mut ids).is_empty());
        assert!(ids.allocate(|_| false) > 9, "new sets never collide with adopted ones");
    }

    #[test]
    fn an_incomplete_adopted_set_is_replaced_and_cleared_whole() {
        let services = [(
            key(1, 0),
            Service { backend_set: 5, backend_count: 3, service_id: 1, flags: 0, ..Service::default() },
        )];
        let slots = [(BackendSlot { backend_set: 5, slot: 2 }, backend(2))];
        let adopted = Programmed::from_entries(services, slots);
        let mut ids = SetIds::after(&adopted);
        let plan = plan(&adopted, &wanted(&[(key(1, 0), 1, &[1, 2, 3])]), &mut ids);
        assert_eq!(plan.fills.len(), 1, "{plan:?}");
        let mut switched = adopted.clone();
        switched.services.insert(plan.stores[0].0, plan.stores[0].1);
        switched.sets.insert(plan.fills[0].0, plan.fills[0].1.clone());
        assert_eq!(unused_sets(&switched), vec![(5, 3)]);
    }

    #[test]
    fn set_ids_skip_ids_in_use_and_zero_on_wraparound() {
        let mut ids = SetIds { next: u32::MAX };
        let in_use = BTreeSet::from([1]);
        assert_eq!(ids.allocate(|id| in_use.contains(&id)), u32::MAX);
        assert_eq!(ids.allocate(|id| in_use.contains(&id)), 2);
    }

    /// The same planner on IPv6 keys and backends: an incomplete adopted set is marked with
    /// the IPv6 placeholder and replaced by one fresh set that both source classes share.
    #[test]
    fn ipv6_maps_are_planned_alike() {
        use proxy_common::{Backend6, ServiceKey6};

        use crate::dataplane::ebpf::family::Family as _;

        let key = |class| ServiceKey6 {
            addr: [0xfd, 0, 0, 0x10, 0, 0x96, 0, 0, 0, 0, 0, 0, 0, 0, 0, 10],
            port: 80,
            proto: proxy_common::proto::TCP,
            source_class: class,
        };
        let backend = |last| Backend6 {
            addr: [0xfd, 0, 0, 0x10, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, last],
            port: 8080,
            pad: 0,
            counter: 0,
        };
        let services = [(
            key(0),
            Service { backend_set: 5, backend_count: 2, service_id: 1, flags: 0, ..Service::default() },
        )];
        let adopted = super::Programmed::<V6>::from_entries(
            services,
            [(BackendSlot { backend_set: 5, slot: 1 }, backend(2))],
        );
        assert_eq!(adopted.sets[&5], vec![V6::INCOMPLETE; 2]);
        let mut ids = SetIds::after(&adopted);
        let wanted_service = super::WantedService::<V6> {
            backends: vec![backend(1), backend(2)].into(),
            service_id: 1,
            flags: 0,
            affinity_timeout: 0,
        };
        let want = BTreeMap::from([(key(0), wanted_service.clone()), (key(1), wanted_service)]);
        let plan = plan(&adopted, &want, &mut ids);
        assert_eq!(plan.fills, vec![(6, vec![backend(1), backend(2)])]);
        assert!(plan.stores.iter().all(|(_, service)| service.backend_set == 6), "{plan:?}");
        assert_eq!(plan.stores.len(), 2);
    }
}
