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
    claimant, content_hash, describe, frontends, health_check_node_port, lost_claim, reserved_for_vipr,
    service_ports, slice_endpoints, ClaimRank, EndpointSpec, NodeContext, Rejection, SERVICE_NAME_LABEL,
};
use crate::model::{
    Backend, DesiredState, Frontend, FrontendEntry, FrontendKind, ServicePortName, StateChanges,
};

/// Namespace and name, as the objects name a service (an absent namespace is "default").
type Key = (String, String);
/// A slice's endpoints, by the service port they belong to.
type EndpointsByPort = Vec<(ServicePortName, Vec<EndpointSpec>)>;
/// The usable slices of one name: the service each belongs to, and its endpoints.
type ParsedSlices = Vec<(Key, EndpointsByPort)>;
/// The objects of one snapshot by namespace and name.
type Groups<'a, T> = HashMap<(&'a str, &'a str), Vec<&'a T>>;

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
    stored: Option<&[Version]>,
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
fn group<T>(objects: &[T], metadata: impl Fn(&T) -> &ObjectMeta) -> Groups<'_, T> {
    let mut grouped: Groups<'_, T> = HashMap::with_capacity(objects.len());
    for object in objects {
        grouped.entry(key_of(metadata(object))).or_default().push(object);
    }
    grouped
}

/// The EndpointSlices of one name. Their endpoints are not kept: at 10k services they would
/// be a copy of every endpoint of the cluster, and the snapshot holds them anyway. A service
/// re-translated for another reason than its slices parses them again from the snapshot.
#[derive(Debug, Default)]
struct SliceRecord {
    versions: Box<[Version]>,
    /// The service each usable slice belongs to.
    services: Box<[Key]>,
    rejected: Vec<Rejection>,
}

/// What one service (all Service objects of one name) contributes to the state. Boxed slices:
/// a record is built once and kept as it is until its service changes.
#[derive(Debug, Default)]
struct ServiceRecord {
    versions: Box<[Version]>,
    claims: Box<[(Frontend, ClaimRank)]>,
    /// The health-check node ports its objects ask vipr to serve.
    health_check_node_ports: Box<[u16]>,
    /// It has an external or load-balancer IP that is a node address, so a change of the
    /// ports vipr serves there can change what it may claim.
    on_node_addresses: bool,
    /// With repetitions, one per port, as the full translation adds them.
    cluster_ips: Box<[IpAddr]>,
    listed: Box<[Backend]>,
    rejected: Vec<Rejection>,
}

/// One service port's claim on a frontend.
#[derive(Debug)]
struct Claim {
    order: ClaimRank,
    /// The entry the claim would give the frontend; `None` for the owner (the first claim),
    /// whose entry is the state's, so that an entry is held once.
    entry: Option<Box<FrontendEntry>>,
}

/// The values touched entries had before this translation, to report only real changes.
/// Not tracked when everything changes anyway.
#[derive(Default)]
struct Before {
    track: bool,
    frontends: HashMap<Frontend, Option<FrontendEntry>>,
    listed: HashMap<Backend, bool>,
    cluster_ips: HashMap<IpAddr, bool>,
}

impl Before {
    fn frontend(&mut self, frontend: Frontend, state: &DesiredState) {
        if self.track {
            self.frontends.entry(frontend).or_insert_with(|| state.frontends.get(&frontend).cloned());
        }
    }
}

/// Keeps the last translation and updates it by what changed; see the module documentation.
#[derive(Debug, Default)]
pub struct Translator {
    node: Option<NodeContext>,
    services: HashMap<Key, ServiceRecord>,
    slices: HashMap<Key, SliceRecord>,
    /// Which slice names list endpoints of each service (a few each: a small vector).
    slices_of: HashMap<Key, Vec<Key>>,
    /// Every service port that claims each frontend, first in the full translation's order
    /// first: the first one owns it, the others are rejected.
    claims: HashMap<Frontend, Vec<Claim>>,
    contested: BTreeSet<Frontend>,
    /// How many services ask for each health-check node port.
    health_check_node_ports: HashMap<u16, usize>,
    /// The services with a [`ServiceRecord::on_node_addresses`].
    on_node_addresses: BTreeSet<Key>,
    /// Holders of a cluster IP or listed endpoint beyond the first: the state's set holds
    /// it while it has one, and nearly every item has exactly one, so only the others are
    /// counted.
    cluster_ip_extra: HashMap<IpAddr, usize>,
    listed_extra: HashMap<Backend, usize>,
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
            rejected.extend(others.iter().map(|claim| lost_claim(frontend, &claim.order, &owner.order)));
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
                    sources: node.source_classifier(),
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
        // The endpoints of the slices that changed, parsed once for their services' records.
        let mut parsed: HashMap<Key, ParsedSlices> = HashMap::new();
        for (key, objects) in &slice_groups {
            let key = owned(*key);
            if unchanged(self.slices.get(&key).map(|r| &*r.versions), objects, |s| &s.metadata) {
                continue;
            }
            if let Some(record) = self.slices.remove(&key) {
                self.forget_slice(&key, &record, &mut dirty);
            }
            let (record, endpoints) = slice_record(objects, node);
            for service in &record.services {
                dirty.insert(service.clone());
                let names = self.slices_of.entry(service.clone()).or_default();
                if !names.contains(&key) {
                    names.reserve_exact(1);
                    names.push(key.clone());
                }
            }
            parsed.insert(key.clone(), endpoints);
            self.slices.insert(key, record);
        }

        let service_groups = group(services, |service| &service.metadata);
        dirty.extend(
            self.services.keys().filter(|key| !service_groups.contains_key(&(&*key.0, &*key.1))).cloned(),
        );
        for (key, objects) in &service_groups {
            let key = owned(*key);
            if !unchanged(self.services.get(&key).map(|r| &*r.versions), objects, |s| &s.metadata) {
                dirty.insert(key);
            }
        }

        if self.count_health_check_node_ports(&dirty, &service_groups) {
            // Which node-address claims vipr's own servers rule out changed.
            dirty.extend(self.on_node_addresses.iter().cloned());
        }

        let mut before = Before { track: !everything, ..Before::default() };
        let mut endpoints = SliceEndpoints { parsed, groups: &slice_groups, node };
        for key in dirty {
            if let Some(record) = self.services.remove(&key) {
                self.withdraw(&record, &mut before);
            }
            self.on_node_addresses.remove(&key);
            if let Some(objects) = service_groups.get(&(&*key.0, &*key.1)) {
                let (record, entries) = self.service_record(&key, objects, &mut endpoints, node);
                self.contribute(&record, entries, &mut before);
                if record.on_node_addresses {
                    self.on_node_addresses.insert(key.clone());
                }
                self.services.insert(key, record);
            }
        }
        self.changes(since, generation, everything, before)
    }

    /// Counts the health-check node ports of the `dirty` services anew; true when the set of
    /// ports changed.
    fn count_health_check_node_ports(
        &mut self,
        dirty: &BTreeSet<Key>,
        services: &Groups<'_, Service>,
    ) -> bool {
        let mut changed = false;
        for key in dirty {
            let old =
                self.services.get(key).map(|record| &*record.health_check_node_ports).unwrap_or_default();
            let new: Vec<u16> = services
                .get(&(&*key.0, &*key.1))
                .into_iter()
                .flatten()
                .filter_map(|service| health_check_node_port(service))
                .collect();
            if *old == *new {
                continue;
            }
            for port in old {
                if let Some(count) = self.health_check_node_ports.get_mut(port) {
                    *count -= 1;
                    if *count == 0 {
                        self.health_check_node_ports.remove(port);
                        changed = true;
                    }
                }
            }
            for port in new {
                let count = self.health_check_node_ports.entry(port).or_default();
                changed |= *count == 0;
                *count += 1;
            }
        }
        changed
    }

    fn forget_slice(&mut self, key: &Key, record: &SliceRecord, dirty: &mut BTreeSet<Key>) {
        for service in &record.services {
            dirty.insert(service.clone());
            if let Some(names) = self.slices_of.get_mut(service) {
                names.retain(|name| name != key);
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
        slices: &mut SliceEndpoints<'_>,
        node: &NodeContext,
    ) -> (ServiceRecord, Vec<FrontendEntry>) {
        let versions = objects.iter().map(|service| version(*service, &service.metadata)).collect();
        let health_check_node_ports =
            objects.iter().filter_map(|service| health_check_node_port(service)).collect();
        let mut rejected = Vec::new();
        let mut ports = Vec::new();
        for service in objects {
            match service_ports(service) {
                Ok(service_ports) => ports.extend(service_ports),
                Err(reason) => {
                    rejected.push(Rejection { object: describe("Service", &service.metadata), reason })
                }
            }
        }
        let mut entries = Vec::new();
        if ports.is_empty() {
            return (
                ServiceRecord { versions, health_check_node_ports, rejected, ..ServiceRecord::default() },
                entries,
            );
        }
        let mut endpoints: BTreeMap<ServicePortName, Vec<EndpointSpec>> = BTreeMap::new();
        for name in self.slices_of.get(key).into_iter().flatten() {
            for (service, by_port) in slices.take(name) {
                if service == *key {
                    for (port, found) in by_port {
                        endpoints.entry(port).or_default().extend(found);
                    }
                }
            }
        }
        ports.sort_by(|a, b| a.name.cmp(&b.name));
        let (mut claims, mut cluster_ips, mut listed) = (Vec::new(), Vec::new(), Vec::new());
        let mut on_node_addresses = false;
        let mut sequence = 0;
        for port in ports {
            let endpoints = endpoints.get(&*port.name).map(Vec::as_slice).unwrap_or_default();
            cluster_ips.extend(port.service.cluster_ips.iter().copied());
            listed.extend(endpoints.iter().map(|endpoint| endpoint.backend));
            for (frontend, entry) in frontends(&port, endpoints, node) {
                let rank = ClaimRank::new(&entry, &port, sequence);
                sequence += 1;
                on_node_addresses |=
                    matches!(entry.kind, FrontendKind::ExternalIp | FrontendKind::LoadBalancer)
                        && node.node_ips.contains(&frontend.ip);
                let reserved = |port| self.health_check_node_ports.contains_key(&port);
                if let Some(reason) = reserved_for_vipr(&frontend, &entry, node, &reserved) {
                    rejected.push(Rejection { object: claimant(&rank), reason });
                    continue;
                }
                claims.push((frontend, rank));
                entries.push(entry);
            }
        }
        let record = ServiceRecord {
            versions,
            health_check_node_ports,
            on_node_addresses,
            claims: claims.into_boxed_slice(),
            cluster_ips: cluster_ips.into_boxed_slice(),
            listed: listed.into_boxed_slice(),
            rejected,
        };
        (record, entries)
    }

    fn withdraw(&mut self, record: &ServiceRecord, before: &mut Before) {
        for (frontend, order) in &record.claims {
            before.frontend(*frontend, &self.state);
            let Some(claims) = self.claims.get_mut(frontend) else { continue };
            let Some(position) = claims.iter().position(|claim| claim.order == *order) else { continue };
            claims.remove(position);
            if position == 0 {
                // The next claim, if any, becomes the owner and its entry the state's.
                match claims.first_mut().and_then(|next| next.entry.take()) {
                    Some(entry) => self.state.frontends.insert(*frontend, *entry),
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
        let track = before.track;
        for ip in &record.cluster_ips {
            let before = track.then_some(&mut before.cluster_ips);
            release(&mut self.cluster_ip_extra, &mut self.state.cluster_ips, before, *ip);
        }
        for backend in &record.listed {
            let before = track.then_some(&mut before.listed);
            release(&mut self.listed_extra, &mut self.state.listed_endpoints, before, *backend);
        }
    }

    fn contribute(&mut self, record: &ServiceRecord, entries: Vec<FrontendEntry>, before: &mut Before) {
        for ((frontend, order), entry) in record.claims.iter().zip(entries) {
            before.frontend(*frontend, &self.state);
            // Nearly every frontend has one claim: room for exactly one.
            let claims = self.claims.entry(*frontend).or_insert_with(|| Vec::with_capacity(1));
            let position = claims.partition_point(|claim| claim.order < *order);
            let entry = if position == 0 {
                // The new owner's entry goes to the state; the old owner keeps its own.
                let previous = self.state.frontends.insert(*frontend, entry);
                if let Some(owner) = claims.first_mut() {
                    owner.entry = previous.map(Box::new);
                }
                None
            } else {
                Some(Box::new(entry))
            };
            claims.insert(position, Claim { order: order.clone(), entry });
            if claims.len() > 1 {
                self.contested.insert(*frontend);
            }
        }
        let track = before.track;
        for ip in &record.cluster_ips {
            let before = track.then_some(&mut before.cluster_ips);
            hold(&mut self.cluster_ip_extra, &mut self.state.cluster_ips, before, *ip);
        }
        for backend in &record.listed {
            let before = track.then_some(&mut before.listed);
            hold(&mut self.listed_extra, &mut self.state.listed_endpoints, before, *backend);
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

/// One more holder of `item` in `set`; `before` (when tracked) learns whether it was there.
fn hold<T: Ord + std::hash::Hash + Copy>(
    extra: &mut HashMap<T, usize>,
    set: &mut BTreeSet<T>,
    before: Option<&mut HashMap<T, bool>>,
    item: T,
) {
    let added = set.insert(item);
    if let Some(before) = before {
        before.entry(item).or_insert(!added);
    }
    if !added {
        *extra.entry(item).or_default() += 1;
    }
}

/// One holder fewer of `item`; it leaves `set` with its last.
fn release<T: Ord + std::hash::Hash + Copy>(
    extra: &mut HashMap<T, usize>,
    set: &mut BTreeSet<T>,
    before: Option<&mut HashMap<T, bool>>,
    item: T,
) {
    if let Some(before) = before {
        before.entry(item).or_insert_with(|| set.contains(&item));
    }
    match extra.get_mut(&item) {
        Some(count) => {
            *count -= 1;
            if *count == 0 {
                extra.remove(&item);
            }
        }
        None => {
            set.remove(&item);
        }
    }
}

/// Where a service's record finds the endpoints of its slices: parsed in this translation
/// if they changed, else parsed again from the snapshot.
struct SliceEndpoints<'a> {
    parsed: HashMap<Key, ParsedSlices>,
    groups: &'a Groups<'a, EndpointSlice>,
    node: &'a NodeContext,
}

impl SliceEndpoints<'_> {
    /// The slices of one name. Taken: a name's slices nearly always belong to one service,
    /// and another service that needs them parses them again.
    fn take(&mut self, name: &Key) -> ParsedSlices {
        self.parsed.remove(name).unwrap_or_else(|| {
            let objects = self.groups.get(&(&*name.0, &*name.1)).map(Vec::as_slice).unwrap_or_default();
            parse_slices(objects, self.node).0
        })
    }
}

/// The record of the slices of one name, and their endpoints.
fn slice_record(objects: &[&EndpointSlice], node: &NodeContext) -> (SliceRecord, ParsedSlices) {
    let (parsed, rejected) = parse_slices(objects, node);
    let record = SliceRecord {
        versions: objects.iter().map(|slice| version(*slice, &slice.metadata)).collect(),
        services: parsed.iter().map(|(service, _)| service.clone()).collect(),
        rejected,
    };
    (record, parsed)
}

/// Parses the slices of one name; `node` decides which endpoints are local.
fn parse_slices(objects: &[&EndpointSlice], node: &NodeContext) -> (ParsedSlices, Vec<Rejection>) {
    let mut parsed = Vec::new();
    let mut rejected = Vec::new();
    for slice in objects {
        match slice_endpoints(slice, node) {
            Ok(by_port) => {
                // A usable slice has the label; its namespace is the services'.
                let service = slice.metadata.labels.as_ref().and_then(|l| l.get(SERVICE_NAME_LABEL));
                if let Some(service) = service {
                    parsed.push(((key_of(&slice.metadata).0.to_owned(), service.clone()), by_port));
                }
            }
            Err(reason) => {
                rejected.push(Rejection { object: describe("EndpointSlice", &slice.metadata), reason })
            }
        }
    }
    (parsed, rejected)
}

#[cfg(test)]
mod tests;
