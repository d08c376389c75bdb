//! Incremental translation, as kube-proxy's Service and EndpointSlice change trackers: the
//! [`Translator`] keeps each service's translation (its frontends, cluster IPs and listed
//! endpoints) and, given the next complete snapshot, re-translates only the services whose
//! Service objects or EndpointSlices changed, or everything when the node context changed.
//! The result is always what [`desired_state`](super::desired_state) gives for the same
//! snapshot (a randomized test holds the two together), plus the [`StateChanges`] since the
//! previous snapshot.
//!
//! An object is unchanged when its uid and resourceVersion are (objects from the API server),
//! or when it is equal to the previous one (objects from a file carry no resourceVersion).
use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    net::IpAddr,
};

use k8s_openapi::{
    api::{core::v1::Service, discovery::v1::EndpointSlice},
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};

use serde::Serialize;

use super::{
    content_hash, describe, frontends, service_ports, slice_endpoints, EndpointSpec, NodeContext, Rejection,
    SERVICE_NAME_LABEL,
};
use crate::model::{
    Backend, DesiredState, Frontend, FrontendEntry, ServicePortName, SourceClassifier, StateChanges,
};

/// Namespace and name, as the objects name a service (an absent namespace is "default").
type Key = (String, String);
/// Where a claim on a frontend stands in the full translation's order: ports by name, and
/// within one service (or several objects of one name) in the order they were generated.
type ClaimOrder = (ServicePortName, u32);
/// A slice's endpoints, by the service port they belong to.
type EndpointsByPort = Vec<(ServicePortName, Vec<EndpointSpec>)>;

/// The identity of one version of an object.
#[derive(Clone, Debug, PartialEq)]
enum Version {
    Resource {
        uid: Option<String>,
        version: String,
    },
    /// No resourceVersion: a hash of the object's content ([`content_hash`]). A copy of the
    /// object would do without the (2^-64) risk of a collision, at the price of holding every
    /// object of a large services file twice.
    Content(u64),
}

fn version<T: Serialize>(object: &T, metadata: &ObjectMeta) -> Version {
    match &metadata.resource_version {
        Some(version) => Version::Resource { uid: metadata.uid.clone(), version: version.clone() },
        None => Version::Content(content_hash(object)),
    }
}

fn unchanged<T: Serialize>(
    stored: Option<&Vec<Version>>,
    objects: &[&T],
    metadata: impl Fn(&T) -> &ObjectMeta,
) -> bool {
    let Some(stored) = stored else { return false };
    stored.len() == objects.len()
        && stored.iter().zip(objects).all(|(stored, object)| {
            match (stored, &metadata(object).resource_version) {
                (Version::Resource { uid, version }, Some(current)) => {
                    version == current && *uid == metadata(object).uid
                }
                (Version::Content(hash), None) => *hash == content_hash(*object),
                _ => false,
            }
        })
}

fn key_of(metadata: &ObjectMeta) -> (&str, &str) {
    (metadata.namespace.as_deref().unwrap_or("default"), metadata.name.as_deref().unwrap_or_default())
}

fn owned((namespace, name): (&str, &str)) -> Key {
    (namespace.to_owned(), name.to_owned())
}

/// Objects of one snapshot grouped by name, in their order (a file may repeat a name).
fn group<T>(objects: &[T], metadata: impl Fn(&T) -> &ObjectMeta) -> HashMap<(&str, &str), Vec<&T>> {
    let mut grouped: HashMap<(&str, &str), Vec<&T>> = HashMap::with_capacity(objects.len());
    for object in objects {
        grouped.entry(key_of(metadata(object))).or_default().push(object);
    }
    grouped
}

/// The EndpointSlices of one name and what they say.
#[derive(Debug, Default)]
struct SliceRecord {
    versions: Vec<Version>,
    /// The service each usable slice belongs to, and its endpoints by service port.
    parsed: Vec<(Key, EndpointsByPort)>,
    rejected: Vec<Rejection>,
}

/// What one service (all Service objects of one name) contributes to the state.
#[derive(Debug, Default)]
struct ServiceRecord {
    versions: Vec<Version>,
    claims: Vec<(Frontend, ClaimOrder)>,
    /// With repetitions, one per port, as the full translation adds them.
    cluster_ips: Vec<IpAddr>,
    listed: Vec<Backend>,
    rejected: Vec<Rejection>,
}

#[derive(Debug)]
struct Claim {
    order: ClaimOrder,
    entry: FrontendEntry,
}

/// The values touched entries had before this translation, to report only real changes.
#[derive(Default)]
struct Before {
    frontends: HashMap<Frontend, Option<FrontendEntry>>,
    listed: HashMap<Backend, bool>,
    cluster_ips: HashMap<IpAddr, bool>,
}

/// Keeps the last translation and updates it by what changed; see the module documentation.
#[derive(Debug, Default)]
pub struct Translator {
    node: Option<NodeContext>,
    services: HashMap<Key, ServiceRecord>,
    slices: HashMap<Key, SliceRecord>,
    /// Which slice names list endpoints of each service.
    slices_of: HashMap<Key, BTreeSet<Key>>,
    /// Every service port that claims each frontend, first in the full translation's order
    /// first: the first one owns it, the others are rejected.
    claims: HashMap<Frontend, Vec<Claim>>,
    contested: BTreeSet<Frontend>,
    cluster_ip_refs: HashMap<IpAddr, usize>,
    listed_refs: HashMap<Backend, usize>,
    state: DesiredState,
    generation: u64,
}

impl Translator {
    pub fn new() -> Self {
        Self::default()
    }

    /// The state of the last [`Self::translate`].
    pub fn state(&self) -> &DesiredState {
        &self.state
    }

    /// The objects the last [`Self::translate`] could not use, as [`super::Translation`]
    /// lists them (in another order).
    pub fn rejected(&self) -> Vec<Rejection> {
        let mut rejected: Vec<Rejection> = self.services.values().flat_map(|s| s.rejected.clone()).collect();
        rejected.extend(self.slices.values().flat_map(|s| s.rejected.iter().cloned()));
        for frontend in &self.contested {
            let Some((owner, others)) = self.claims.get(frontend).and_then(|c| c.split_first()) else {
                continue;
            };
            rejected.extend(others.iter().map(|claim| Rejection {
                object: format!("Service {}/{}", claim.order.0.namespace, claim.order.0.name),
                reason: format!("frontend {frontend} is already served by {}", owner.entry.service),
            }));
        }
        rejected
    }

    /// Brings the state to the translation of this snapshot and says what changed since the
    /// previous one.
    pub fn translate(
        &mut self,
        services: &[Service],
        slices: &[EndpointSlice],
        node: &NodeContext,
    ) -> StateChanges {
        let since = self.generation;
        let generation = since.wrapping_add(1);
        // The node decides which endpoints are local, which addresses serve NodePorts and how
        // every treatment masquerades: a new one changes every service.
        let everything = self.node.as_ref() != Some(node);
        if everything {
            *self = Self {
                node: Some(node.clone()),
                state: DesiredState {
                    service_cidrs: node.service_cidrs.clone(),
                    sources: SourceClassifier {
                        pod_cidrs: node.cluster_cidrs.clone(),
                        node_ips: node.node_ips.clone(),
                    },
                    ..DesiredState::default()
                },
                ..Self::default()
            };
        }
        self.generation = generation;
        let mut dirty: BTreeSet<Key> = BTreeSet::new();

        let slice_groups = group(slices, |slice| &slice.metadata);
        let gone: Vec<Key> = self
            .slices
            .keys()
            .filter(|key| !slice_groups.contains_key(&(&*key.0, &*key.1)))
            .cloned()
            .collect();
        for key in gone {
            if let Some(record) = self.slices.remove(&key) {
                self.forget_slice(&key, &record, &mut dirty);
            }
        }
        for (key, objects) in &slice_groups {
            let key = owned(*key);
            if unchanged(self.slices.get(&key).map(|r| &r.versions), objects, |s| &s.metadata) {
                continue;
            }
            if let Some(record) = self.slices.remove(&key) {
                self.forget_slice(&key, &record, &mut dirty);
            }
            let record = slice_record(objects, node);
            for (service, _) in &record.parsed {
                dirty.insert(service.clone());
                self.slices_of.entry(service.clone()).or_default().insert(key.clone());
            }
            self.slices.insert(key, record);
        }

        let service_groups = group(services, |service| &service.metadata);
        dirty.extend(
            self.services.keys().filter(|key| !service_groups.contains_key(&(&*key.0, &*key.1))).cloned(),
        );
        for (key, objects) in &service_groups {
            let key = owned(*key);
            if !unchanged(self.services.get(&key).map(|r| &r.versions), objects, |s| &s.metadata) {
                dirty.insert(key);
            }
        }

        let mut before = Before::default();
        for key in dirty {
            if let Some(record) = self.services.remove(&key) {
                self.withdraw(&record, &mut before);
            }
            if let Some(objects) = service_groups.get(&(&*key.0, &*key.1)) {
                let (record, entries) = self.service_record(&key, objects, node);
                self.contribute(&record, entries, &mut before);
                self.services.insert(key, record);
            }
        }
        self.changes(since, generation, everything, before)
    }

    fn forget_slice(&mut self, key: &Key, record: &SliceRecord, dirty: &mut BTreeSet<Key>) {
        for (service, _) in &record.parsed {
            dirty.insert(service.clone());
            if let Some(names) = self.slices_of.get_mut(service) {
                names.remove(key);
                if names.is_empty() {
                    self.slices_of.remove(service);
                }
            }
        }
    }

    /// One service's translation, as the full translation makes it, and the entries of its
    /// claims.
    fn service_record(
        &self,
        key: &Key,
        objects: &[&Service],
        node: &NodeContext,
    ) -> (ServiceRecord, Vec<FrontendEntry>) {
        let mut record = ServiceRecord {
            versions: objects.iter().map(|service| version(*service, &service.metadata)).collect(),
            ..ServiceRecord::default()
        };
        let mut ports = Vec::new();
        for service in objects {
            match service_ports(service) {
                Ok(service_ports) => ports.extend(service_ports),
                Err(reason) => {
                    record.rejected.push(Rejection { object: describe("Service", &service.metadata), reason })
                }
            }
        }
        let mut entries = Vec::new();
        if ports.is_empty() {
            return (record, entries);
        }
        let mut endpoints: BTreeMap<&ServicePortName, Vec<&EndpointSpec>> = BTreeMap::new();
        let slices = self.slices_of.get(key).into_iter().flatten().filter_map(|name| self.slices.get(name));
        for (service, by_port) in slices.flat_map(|record| &record.parsed) {
            if service == key {
                for (name, found) in by_port {
                    endpoints.entry(name).or_default().extend(found);
                }
            }
        }
        ports.sort_by(|a, b| a.name.cmp(&b.name));
        let mut sequence = 0;
        for port in ports {
            let endpoints: Vec<EndpointSpec> =
                endpoints.get(&port.name).into_iter().flatten().map(|e| (*e).clone()).collect();
            record.cluster_ips.extend(port.service.cluster_ips.iter().copied());
            record.listed.extend(endpoints.iter().map(|endpoint| endpoint.backend));
            for (frontend, entry) in frontends(&port, &endpoints, node) {
                record.claims.push((frontend, (port.name.clone(), sequence)));
                sequence += 1;
                entries.push(entry);
            }
        }
        (record, entries)
    }

    fn withdraw(&mut self, record: &ServiceRecord, before: &mut Before) {
        for (frontend, order) in &record.claims {
            before.frontends.entry(*frontend).or_insert_with(|| self.state.frontends.get(frontend).cloned());
            let Some(claims) = self.claims.get_mut(frontend) else { continue };
            let Some(position) = claims.iter().position(|claim| claim.order == *order) else { continue };
            claims.remove(position);
            if position == 0 {
                match claims.first() {
                    Some(next) => self.state.frontends.insert(*frontend, next.entry.clone()),
                    None => self.state.frontends.remove(frontend),
                };
            }
            if claims.len() < 2 {
                self.contested.remove(frontend);
            }
            if claims.is_empty() {
                self.claims.remove(frontend);
            }
        }
        for ip in &record.cluster_ips {
            release(&mut self.cluster_ip_refs, &mut self.state.cluster_ips, &mut before.cluster_ips, *ip);
        }
        for backend in &record.listed {
            release(&mut self.listed_refs, &mut self.state.listed_endpoints, &mut before.listed, *backend);
        }
    }

    fn contribute(&mut self, record: &ServiceRecord, entries: Vec<FrontendEntry>, before: &mut Before) {
        for ((frontend, order), entry) in record.claims.iter().zip(entries) {
            before.frontends.entry(*frontend).or_insert_with(|| self.state.frontends.get(frontend).cloned());
            let claims = self.claims.entry(*frontend).or_default();
            let position = claims.partition_point(|claim| claim.order < *order);
            claims.insert(position, Claim { order: order.clone(), entry });
            if position == 0 {
                self.state.frontends.insert(*frontend, claims[0].entry.clone());
            }
            if claims.len() > 1 {
                self.contested.insert(*frontend);
            }
        }
        for ip in &record.cluster_ips {
            hold(&mut self.cluster_ip_refs, &mut self.state.cluster_ips, &mut before.cluster_ips, *ip);
        }
        for backend in &record.listed {
            hold(&mut self.listed_refs, &mut self.state.listed_endpoints, &mut before.listed, *backend);
        }
    }

    fn changes(&mut self, since: u64, generation: u64, everything: bool, before: Before) -> StateChanges {
        if everything {
            return StateChanges::everything(generation);
        }
        let mut changes = StateChanges { since: Some(since), generation, ..StateChanges::default() };
        for (frontend, entry) in before.frontends {
            if self.state.frontends.get(&frontend) != entry.as_ref() {
                changes.frontends.insert(frontend);
            }
        }
        for (backend, was) in before.listed {
            match (was, self.state.listed_endpoints.contains(&backend)) {
                (false, true) => changes.listed_added.insert(backend),
                (true, false) => changes.listed_removed.insert(backend),
                _ => false,
            };
        }
        changes.classifiers =
            before.cluster_ips.iter().any(|(ip, was)| *was != self.state.cluster_ips.contains(ip));
        changes
    }
}

/// One more holder of `item` in the reference-counted `set`.
fn hold<T: Ord + std::hash::Hash + Copy>(
    refs: &mut HashMap<T, usize>,
    set: &mut BTreeSet<T>,
    before: &mut HashMap<T, bool>,
    item: T,
) {
    before.entry(item).or_insert_with(|| set.contains(&item));
    let count = refs.entry(item).or_default();
    *count += 1;
    if *count == 1 {
        set.insert(item);
    }
}

/// One holder fewer of `item`; it leaves `set` with its last.
fn release<T: Ord + std::hash::Hash + Copy>(
    refs: &mut HashMap<T, usize>,
    set: &mut BTreeSet<T>,
    before: &mut HashMap<T, bool>,
    item: T,
) {
    before.entry(item).or_insert_with(|| set.contains(&item));
    if let Some(count) = refs.get_mut(&item) {
        *count -= 1;
        if *count == 0 {
            refs.remove(&item);
            set.remove(&item);
        }
    }
}

/// Parses the slices of one name; `node` decides which endpoints are local.
fn slice_record(objects: &[&EndpointSlice], node: &NodeContext) -> SliceRecord {
    let mut record = SliceRecord {
        versions: objects.iter().map(|slice| version(*slice, &slice.metadata)).collect(),
        ..SliceRecord::default()
    };
    for slice in objects {
        match slice_endpoints(slice, node) {
            Ok(by_port) => {
                // A usable slice has the label; its namespace is the services'.
                let service = slice.metadata.labels.as_ref().and_then(|l| l.get(SERVICE_NAME_LABEL));
                if let Some(service) = service {
                    record.parsed.push(((key_of(&slice.metadata).0.to_owned(), service.clone()), by_port));
                }
            }
            Err(reason) => {
                record.rejected.push(Rejection { object: describe("EndpointSlice", &slice.metadata), reason })
            }
        }
    }
    record
}

#[cfg(test)]
mod tests;
