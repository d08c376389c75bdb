//! What changed from one snapshot of the source to the next, counted as kube-proxy counts its
//! Service and EndpointSlice events, and the EndpointSlices' change trigger times that the
//! network programming latency is measured from.
use std::{
    collections::{hash_map::DefaultHasher, BTreeMap},
    hash::{Hash as _, Hasher as _},
    time::SystemTime,
};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::Serialize;

use crate::{model::kubernetes::content_hash, source::Objects};

/// The annotation in which the EndpointSlice controller records when the change that
/// triggered this version of the slice happened (a pod became ready, ...).
pub const LAST_CHANGE_TRIGGER_TIME: &str = "endpoints.kubernetes.io/last-change-trigger-time";

/// Added, changed and deleted objects between two snapshots.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Changes {
    pub services: u64,
    pub endpoint_slices: u64,
    /// `endpoint_slices` by the slices' address family (IPv4, IPv6), as kube-proxy's
    /// per-family proxiers each count only their family's slices.
    pub endpoint_slices_by_family: [u64; 2],
}

impl Changes {
    pub fn is_empty(&self) -> bool {
        self.services == 0 && self.endpoint_slices == 0
    }
}

/// Remembers a version of every object of the last snapshot.
#[derive(Debug)]
pub struct ChangeTracker {
    services: BTreeMap<(String, String), u64>,
    slices: BTreeMap<(String, String), u64>,
    /// Each slice's address family (0 IPv4, 1 IPv6), so that a deleted one is counted in its.
    slice_families: BTreeMap<(String, String), usize>,
    /// Trigger times of slice changes no successful sync has programmed yet.
    pending_trigger_times: Vec<SystemTime>,
    /// Trigger times before this are from before the agent ran: the first snapshot lists
    /// every slice as new, and its old trigger times would measure the agent's downtime.
    started: SystemTime,
}

impl ChangeTracker {
    pub fn new(started: SystemTime) -> Self {
        Self {
            services: BTreeMap::new(),
            slices: BTreeMap::new(),
            slice_families: BTreeMap::new(),
            pending_trigger_times: Vec::new(),
            started,
        }
    }

    /// Compares `objects` with the previous snapshot and remembers them.
    pub fn observe(&mut self, objects: &Objects) -> Changes {
        let services = versions(&objects.services, |service| &service.metadata);
        let slices = versions(&objects.slices, |slice| &slice.metadata);
        let slice_families: BTreeMap<(String, String), usize> = objects
            .slices
            .iter()
            .map(|slice| (key(&slice.metadata), usize::from(slice.address_type == "IPv6")))
            .collect();
        let mut endpoint_slices_by_family = [0; 2];
        let changed = slices.iter().filter(|(key, version)| self.slices.get(*key) != Some(version));
        for (key, _) in changed {
            endpoint_slices_by_family[slice_families[key]] += 1;
        }
        for key in self.slices.keys().filter(|key| !slices.contains_key(*key)) {
            endpoint_slices_by_family[self.slice_families.get(key).copied().unwrap_or(0)] += 1;
        }
        let changes = Changes {
            services: count_changes(&self.services, &services),
            endpoint_slices: count_changes(&self.slices, &slices),
            endpoint_slices_by_family,
        };
        for slice in &objects.slices {
            let key = key(&slice.metadata);
            if self.slices.get(&key) == slices.get(&key) {
                continue;
            }
            let trigger_time = slice
                .metadata
                .annotations
                .as_ref()
                .and_then(|annotations| annotations.get(LAST_CHANGE_TRIGGER_TIME))
                .and_then(|text| text.parse::<jiff::Timestamp>().ok())
                .map(SystemTime::from)
                .filter(|time| *time > self.started);
            self.pending_trigger_times.extend(trigger_time);
        }
        self.services = services;
        self.slices = slices;
        self.slice_families = slice_families;
        changes
    }

    /// The trigger times of the changes that the sync which just succeeded programmed.
    pub fn take_trigger_times(&mut self) -> Vec<SystemTime> {
        std::mem::take(&mut self.pending_trigger_times)
    }
}

fn key(metadata: &ObjectMeta) -> (String, String) {
    (metadata.namespace.clone().unwrap_or_default(), metadata.name.clone().unwrap_or_default())
}

/// A version of each object: its resourceVersion when it has one (objects from the API
/// server), else a hash of its content (objects from a file).
fn versions<T: Serialize>(
    objects: &[T],
    metadata: impl Fn(&T) -> &ObjectMeta,
) -> BTreeMap<(String, String), u64> {
    objects
        .iter()
        .map(|object| {
            let meta = metadata(object);
            let version = match &meta.resource_version {
                Some(version) => {
                    let mut hasher = DefaultHasher::new();
                    version.hash(&mut hasher);
                    hasher.finish()
                }
                None => content_hash(object),
            };
            (key(meta), version)
        })
        .collect()
}

fn count_changes(before: &BTreeMap<(String, String), u64>, after: &BTreeMap<(String, String), u64>) -> u64 {
    let changed_or_added = after.iter().filter(|(key, version)| before.get(*key) != Some(version)).count();
    let deleted = before.keys().filter(|key| !after.contains_key(*key)).count();
    (changed_or_added + deleted) as u64
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
    use serde_json::json;

    use super::*;

    fn service(name: &str, port: i32) -> Service {
        serde_json::from_value(
            json!({"metadata": {"name": name, "namespace": "ns"}, "spec": {"ports": [{"port": port}]}}),
        )
        .unwrap()
    }

    fn slice(name: &str, version: &str, trigger: Option<&str>) -> EndpointSlice {
        let mut metadata = json!({"name": name, "namespace": "ns", "resourceVersion": version});
        if let Some(trigger) = trigger {
            metadata["annotations"] = json!({LAST_CHANGE_TRIGGER_TIME: trigger});
        }
        serde_json::from_value(json!({"metadata": metadata, "addressType": "IPv4", "endpoints": []})).unwrap()
    }

    fn objects(services: Vec<Service>, slices: Vec<EndpointSlice>) -> Objects {
        Objects { services, slices, ..Objects::default() }
    }

    #[test]
    fn counts_adds_changes_and_deletes() {
        let mut tracker = ChangeTracker::new(SystemTime::UNIX_EPOCH);
        let first = tracker
            .observe(&objects(vec![service("a", 80), service("b", 80)], vec![slice("a-1", "1", None)]));
        assert_eq!(first, Changes { services: 2, endpoint_slices: 1, endpoint_slices_by_family: [1, 0] });
        let same = tracker
            .observe(&objects(vec![service("a", 80), service("b", 80)], vec![slice("a-1", "1", None)]));
        assert!(same.is_empty());
        let changed = tracker.observe(&objects(
            vec![service("a", 81)],
            vec![slice("a-1", "2", None), slice("a-2", "1", None)],
        ));
        assert_eq!(changed, Changes { services: 2, endpoint_slices: 2, endpoint_slices_by_family: [2, 0] });
    }

    #[test]
    fn slice_changes_are_counted_in_their_address_family() {
        let ipv6 = |name: &str, version: &str| {
            let mut slice = slice(name, version, None);
            slice.address_type = "IPv6".to_owned();
            slice
        };
        let mut tracker = ChangeTracker::new(SystemTime::UNIX_EPOCH);
        let first = tracker.observe(&objects(vec![], vec![slice("a-v4", "1", None), ipv6("a-v6", "1")]));
        assert_eq!(first.endpoint_slices_by_family, [1, 1]);
        let changed = tracker.observe(&objects(vec![], vec![slice("a-v4", "1", None), ipv6("a-v6", "2")]));
        assert_eq!(changed.endpoint_slices_by_family, [0, 1]);
        // A deleted slice counts in the family it had.
        let deleted = tracker.observe(&objects(vec![], vec![slice("a-v4", "1", None)]));
        assert_eq!(deleted.endpoint_slices_by_family, [0, 1]);
    }

    #[test]
    fn trigger_times_of_changed_slices_after_the_start_are_kept_until_taken() {
        let started: SystemTime = "2026-01-01T00:00:00Z".parse::<jiff::Timestamp>().unwrap().into();
        let mut tracker = ChangeTracker::new(started);
        tracker.observe(&objects(
            vec![],
            vec![
                slice("old", "1", Some("2025-12-31T23:00:00Z")),
                slice("new", "1", Some("2026-01-01T00:00:05Z")),
            ],
        ));
        assert_eq!(tracker.take_trigger_times(), [started + Duration::from_secs(5)]);
        assert!(tracker.take_trigger_times().is_empty());
        // An unchanged slice does not count again; a changed one does.
        tracker.observe(&objects(
            vec![],
            vec![
                slice("old", "1", Some("2025-12-31T23:00:00Z")),
                slice("new", "2", Some("2026-01-01T00:00:09.5Z")),
            ],
        ));
        assert_eq!(tracker.take_trigger_times(), [started + Duration::from_millis(9500)]);
    }
}
