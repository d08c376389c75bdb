//! What the maps hold, what they should hold, and the map operations between the two.
//!
//! Pure: no syscalls, so the diff is unit-tested without a kernel. The order of operations
//! inside one [`Change`] is what keeps the datapath consistent: a new backend set is filled
//! before the service entry switches to it, and the old set is cleared only after.
use std::collections::{BTreeMap, BTreeSet};

use proxy_common::{Backend4, BackendSlot, Service, ServiceKey4};

/// One frontend as the maps hold it (or should hold it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FrontendMaps {
    pub service: Service,
    /// Slot `i` of `service.backend_set` holds `backends[i]`.
    pub backends: Vec<Backend4>,
}

/// The content of the services and backends maps, as last written (or read back at
/// adoption).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Programmed {
    pub frontends: BTreeMap<ServiceKey4, FrontendMaps>,
    /// Backend sets present in the map that no service points to (left by an interrupted
    /// sync); the next plan clears them.
    pub orphan_sets: BTreeMap<u32, u32>,
}

impl Programmed {
    /// Rebuilds the view from map entries, e.g. after an agent restart.
    pub fn from_entries(
        services: impl IntoIterator<Item = (ServiceKey4, Service)>,
        slots: impl IntoIterator<Item = (BackendSlot, Backend4)>,
    ) -> Self {
        let mut sets: BTreeMap<u32, BTreeMap<u32, Backend4>> = BTreeMap::new();
        for (slot, backend) in slots {
            sets.entry(slot.backend_set).or_default().insert(slot.slot, backend);
        }
        let mut frontends = BTreeMap::new();
        for (key, service) in services {
            let set = sets.get(&service.backend_set);
            // A set with a missing slot reads back shorter than backend_count, so it differs
            // from any desired set and gets rewritten.
            let backends = (0..service.backend_count)
                .map_while(|slot| set.and_then(|set| set.get(&slot)).copied())
                .collect();
            frontends.insert(key, FrontendMaps { service, backends });
        }
        let referenced: BTreeSet<u32> = frontends.values().map(|f| f.service.backend_set).collect();
        let orphan_sets = sets
            .into_iter()
            .filter(|(set, _)| !referenced.contains(set))
            .map(|(set, slots)| (set, slots.keys().max().map_or(0, |max| max + 1)))
            .collect();
        Self { frontends, orphan_sets }
    }

    fn sets_in_use(&self) -> BTreeSet<u32> {
        self.frontends
            .values()
            .map(|f| f.service.backend_set)
            .chain(self.orphan_sets.keys().copied())
            .collect()
    }
}

/// What one frontend should look like: the service identity and its backends, without a
/// backend set (that is the planner's choice).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WantedFrontend {
    pub service_id: u32,
    pub flags: u32,
    pub backends: Vec<Backend4>,
}

/// Map operations for one frontend, applied in this order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Change {
    Upsert {
        key: ServiceKey4,
        /// Slots to write before `service` is stored; `None` when the current set is kept.
        fill: Option<Vec<Backend4>>,
        service: Service,
        /// The set `service` replaces, to clear afterwards: (set, slot count).
        retire: Option<(u32, u32)>,
    },
    Remove {
        key: ServiceKey4,
        retire: (u32, u32),
    },
    ClearOrphanSet {
        set: u32,
        slots: u32,
    },
}

/// Hands out backend set ids that no entry uses. Ids are never reused while in use, so a
/// packet that read an old service entry can never find another service's backends.
#[derive(Debug)]
pub struct SetIds {
    next: u32,
}

impl SetIds {
    pub fn after(programmed: &Programmed) -> Self {
        let highest = programmed.sets_in_use().into_iter().max().unwrap_or(0);
        Self { next: highest.wrapping_add(1).max(1) }
    }

    fn allocate(&mut self, in_use: &BTreeSet<u32>) -> u32 {
        while self.next == 0 || in_use.contains(&self.next) {
            self.next = self.next.wrapping_add(1);
        }
        let id = self.next;
        self.next = self.next.wrapping_add(1);
        id
    }
}

/// The changes that turn `programmed` into `wanted`; frontends that already match get none.
pub fn plan(
    programmed: &Programmed,
    wanted: &BTreeMap<ServiceKey4, WantedFrontend>,
    ids: &mut SetIds,
) -> Vec<Change> {
    let mut in_use = programmed.sets_in_use();
    let mut changes: Vec<Change> =
        programmed.orphan_sets.iter().map(|(&set, &slots)| Change::ClearOrphanSet { set, slots }).collect();
    for (key, want) in wanted {
        let current = programmed.frontends.get(key);
        let same_backends = current.is_some_and(|c| c.backends == want.backends);
        if same_backends
            && current
                .is_some_and(|c| c.service.service_id == want.service_id && c.service.flags == want.flags)
        {
            continue;
        }
        let backend_set = match current {
            Some(current) if same_backends => current.service.backend_set,
            _ => {
                let id = ids.allocate(&in_use);
                in_use.insert(id);
                id
            }
        };
        changes.push(Change::Upsert {
            key: *key,
            fill: (!same_backends).then(|| want.backends.clone()),
            service: Service {
                backend_set,
                backend_count: want.backends.len() as u32,
                service_id: want.service_id,
                flags: want.flags,
            },
            retire: current
                .filter(|_| !same_backends)
                .map(|c| (c.service.backend_set, c.service.backend_count)),
        });
    }
    for (key, current) in &programmed.frontends {
        if !wanted.contains_key(key) {
            changes.push(Change::Remove {
                key: *key,
                retire: (current.service.backend_set, current.service.backend_count),
            });
        }
    }
    changes
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(last: u8, port: u16) -> ServiceKey4 {
        ServiceKey4 { addr: [10, 96, 0, last], port, proto: proxy_common::proto::TCP, pad: 0 }
    }

    fn backend(last: u8) -> Backend4 {
        Backend4 { addr: [10, 0, 0, last], port: 8080, pad: 0 }
    }

    fn wanted(entries: &[(ServiceKey4, u32, &[u8])]) -> BTreeMap<ServiceKey4, WantedFrontend> {
        entries
            .iter()
            .map(|(key, id, backends)| {
                (
                    *key,
                    WantedFrontend {
                        service_id: *id,
                        flags: 0,
                        backends: backends.iter().map(|b| backend(*b)).collect(),
                    },
                )
            })
            .collect()
    }

    /// Applies changes to an in-memory copy of the maps, the way the real dataplane does.
    fn apply(programmed: &Programmed, changes: &[Change]) -> Programmed {
        let mut services: BTreeMap<ServiceKey4, Service> =
            programmed.frontends.iter().map(|(k, f)| (*k, f.service)).collect();
        let mut slots: BTreeMap<BackendSlot, Backend4> = BTreeMap::new();
        for f in programmed.frontends.values() {
            for (i, b) in f.backends.iter().enumerate() {
                slots.insert(BackendSlot { backend_set: f.service.backend_set, slot: i as u32 }, *b);
            }
        }
        let clear = |slots: &mut BTreeMap<BackendSlot, Backend4>, set: u32, count: u32| {
            for slot in 0..count {
                slots.remove(&BackendSlot { backend_set: set, slot });
            }
        };
        for change in changes {
            match change {
                Change::Upsert { key, fill, service, retire } => {
                    for (i, b) in fill.iter().flatten().enumerate() {
                        slots.insert(BackendSlot { backend_set: service.backend_set, slot: i as u32 }, *b);
                    }
                    services.insert(*key, *service);
                    if let Some((set, count)) = retire {
                        clear(&mut slots, *set, *count);
                    }
                }
                Change::Remove { key, retire: (set, count) } => {
                    services.remove(key);
                    clear(&mut slots, *set, *count);
                }
                Change::ClearOrphanSet { set, slots: count } => clear(&mut slots, *set, *count),
            }
        }
        Programmed::from_entries(services, slots)
    }

    #[test]
    fn new_frontend_fills_a_set_then_stores_the_service() {
        let programmed = Programmed::default();
        let mut ids = SetIds::after(&programmed);
        let changes = plan(&programmed, &wanted(&[(key(1, 80), 7, &[1, 2])]), &mut ids);
        assert_eq!(
            changes,
            vec![Change::Upsert {
                key: key(1, 80),
                fill: Some(vec![backend(1), backend(2)]),
                service: Service { backend_set: 1, backend_count: 2, service_id: 7, flags: 0 },
                retire: None,
            }]
        );
    }

    #[test]
    fn unchanged_state_plans_nothing() {
        let want = wanted(&[(key(1, 80), 7, &[1, 2]), (key(2, 53), 8, &[])]);
        let mut ids = SetIds::after(&Programmed::default());
        let programmed = apply(&Programmed::default(), &plan(&Programmed::default(), &want, &mut ids));
        assert!(plan(&programmed, &want, &mut ids).is_empty());
    }

    #[test]
    fn backend_change_switches_to_a_fresh_set_and_retires_the_old_one() {
        let mut ids = SetIds::after(&Programmed::default());
        let before = apply(
            &Programmed::default(),
            &plan(&Programmed::default(), &wanted(&[(key(1, 80), 7, &[1, 2, 3])]), &mut ids),
        );
        let changes = plan(&before, &wanted(&[(key(1, 80), 7, &[1, 3])]), &mut ids);
        let [Change::Upsert { fill: Some(fill), service, retire: Some((old_set, 3)), .. }] =
            changes.as_slice()
        else {
            panic!("unexpected plan {changes:?}");
        };
        assert_eq!(fill, &vec![backend(1), backend(3)]);
        assert_ne!(service.backend_set, *old_set, "the live set must never be rewritten in place");
        let after = apply(&before, &changes);
        assert_eq!(after.frontends[&key(1, 80)].backends, vec![backend(1), backend(3)]);
        assert!(after.orphan_sets.is_empty(), "old slots left behind: {:?}", after.orphan_sets);
    }

    #[test]
    fn identity_change_keeps_the_backend_set() {
        let mut ids = SetIds::after(&Programmed::default());
        let before = apply(
            &Programmed::default(),
            &plan(&Programmed::default(), &wanted(&[(key(1, 80), 7, &[1])]), &mut ids),
        );
        let changes = plan(&before, &wanted(&[(key(1, 80), 9, &[1])]), &mut ids);
        assert!(matches!(changes.as_slice(), [Change::Upsert { fill: None, retire: None, service, .. }]
            if service.service_id == 9 && service.backend_set == before.frontends[&key(1, 80)].service.backend_set));
    }

    #[test]
    fn removed_frontend_is_deleted_with_its_slots() {
        let mut ids = SetIds::after(&Programmed::default());
        let want = wanted(&[(key(1, 80), 7, &[1]), (key(2, 80), 8, &[2, 3])]);
        let before = apply(&Programmed::default(), &plan(&Programmed::default(), &want, &mut ids));
        let changes = plan(&before, &wanted(&[(key(1, 80), 7, &[1])]), &mut ids);
        assert_eq!(changes.len(), 1);
        let after = apply(&before, &changes);
        assert_eq!(after.frontends.keys().collect::<Vec<_>>(), vec![&key(1, 80)]);
        assert!(after.orphan_sets.is_empty());
    }

    #[test]
    fn adoption_reads_back_the_maps_and_clears_orphans() {
        let services = [(key(1, 80), Service { backend_set: 5, backend_count: 2, service_id: 1, flags: 0 })];
        let slots = [
            (BackendSlot { backend_set: 5, slot: 0 }, backend(1)),
            (BackendSlot { backend_set: 5, slot: 1 }, backend(2)),
            (BackendSlot { backend_set: 9, slot: 0 }, backend(3)),
        ];
        let adopted = Programmed::from_entries(services, slots);
        assert_eq!(adopted.frontends[&key(1, 80)].backends, vec![backend(1), backend(2)]);
        assert_eq!(adopted.orphan_sets, BTreeMap::from([(9, 1)]));
        let mut ids = SetIds::after(&adopted);
        let changes = plan(&adopted, &wanted(&[(key(1, 80), 1, &[1, 2])]), &mut ids);
        assert_eq!(changes, vec![Change::ClearOrphanSet { set: 9, slots: 1 }]);
        // New sets never collide with adopted ones.
        assert!(ids.allocate(&BTreeSet::new()) > 9);
    }

    #[test]
    fn incomplete_adopted_set_is_rewritten() {
        let services = [(key(1, 80), Service { backend_set: 5, backend_count: 2, service_id: 1, flags: 0 })];
        let slots = [(BackendSlot { backend_set: 5, slot: 1 }, backend(2))];
        let adopted = Programmed::from_entries(services, slots);
        let mut ids = SetIds::after(&adopted);
        let changes = plan(&adopted, &wanted(&[(key(1, 80), 1, &[1, 2])]), &mut ids);
        assert!(matches!(changes.as_slice(), [Change::Upsert { fill: Some(_), .. }]), "{changes:?}");
    }

    #[test]
    fn set_ids_skip_ids_in_use_and_zero_on_wraparound() {
        let mut ids = SetIds { next: u32::MAX };
        let in_use = BTreeSet::from([1]);
        assert_eq!(ids.allocate(&in_use), u32::MAX);
        assert_eq!(ids.allocate(&in_use), 2);
    }
}
