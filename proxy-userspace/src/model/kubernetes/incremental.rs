//! Incremental translation, as kube-proxy's proxiers consume their change trackers: the
//! [`Translator`] keeps each service's translation (its frontends, cluster IPs, listed
//! endpoints and health check) and re-translates only the services the
//! [`ChangeTracker`](super::changes::ChangeTracker) marked dirty, or every service when
//! the node context changed. The result is always what [`desired_state`](super::desired_state)
//! gives for the objects the tracker holds (a randomized test over event sequences holds the
//! two together), plus the [`StateChanges`] since the previous translation.
use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    net::IpAddr,
};

use super::{
    changes::{ChangeTracker, Dirty, Key},
    claimant, frontends, local_ready_addresses, lost_claim,
    objects::ServiceObject,
    reserved_for_vipr, ClaimRank, EndpointSpec, NodeContext, Rejection,
};
use crate::model::{
    Backend, DesiredState, Frontend, FrontendEntry, FrontendKind, HealthCheck, ServiceName, ServicePortName,
    StateChanges,
};

/// What one service contributes to the state. Boxed slices: a record is built once and kept
/// as it is until its service changes.
#[derive(Debug, Default)]
struct ServiceRecord {
    claims: Box<[(Frontend, ClaimRank)]>,
    /// The health check vipr serves for it, if any.
    health_check: Option<HealthCheck>,
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
    health_checks: HashMap<ServiceName, Option<HealthCheck>>,
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
    /// The rejections of each slice that the model refuses.
    slice_rejections: HashMap<Key, Vec<Rejection>>,
    /// Every service port that claims each frontend, first in the full translation's order
    /// first: the first one owns it, the others are rejected.
    claims: HashMap<Frontend, Vec<Claim>>,
    contested: BTreeSet<Frontend>,
    /// How many services ask for each health-check node port.
    health_check_node_ports: HashMap<u16, usize>,
    /// The services with a [`ServiceRecord::on_node_addresses`].
    on_node_addresses: BTreeSet<Key>,
    /// The services whose record has rejections: [`Self::rejected`] lists them after every
    /// sync, and walking every record for the few that have some made each sync O(services).
    with_rejections: BTreeSet<Key>,
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
        let mut rejected: Vec<Rejection> = self
            .with_rejections
            .iter()
            .filter_map(|key| self.services.get(key))
            .flat_map(|record| record.rejected.iter().cloned())
            .collect();
        rejected.extend(self.slice_rejections.values().flatten().cloned());
        for frontend in &self.contested {
            let Some((owner, others)) = self.claims.get(frontend).and_then(|c| c.split_first()) else {
                continue;
            };
            rejected.extend(others.iter().map(|claim| lost_claim(frontend, &claim.order, &owner.order)));
        }
        rejected
    }

    /// Brings the state to the translation of the objects `tracker` holds, re-translating the
    /// `dirty` services (every service when `node` is not the previous translation's), and says
    /// what changed since the previous translation.
    pub fn translate(&mut self, tracker: &ChangeTracker, dirty: Dirty, node: &NodeContext) -> StateChanges {
        let since = self.generation;
        let generation = since.wrapping_add(1);
        // The node decides which endpoints are local, which addresses serve NodePorts and how
        // every treatment masquerades: a new one changes every service.
        let everything = self.node.as_ref() != Some(node);
        let Dirty { services: mut dirty, slices: dirty_slices } = dirty;
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
            dirty = tracker.service_keys().cloned().collect();
            for key in tracker.slice_keys() {
                self.judge_slice(tracker, key);
            }
        } else {
            for key in &dirty_slices {
                self.judge_slice(tracker, key);
            }
        }
        self.generation = generation;

        if self.count_health_check_node_ports(&dirty, tracker) {
            // Which node-address claims vipr's own servers rule out changed.
            dirty.extend(self.on_node_addresses.iter().cloned());
        }

        let mut before = Before { track: !everything, ..Before::default() };
        for key in dirty {
            if let Some(record) = self.services.remove(&key) {
                self.withdraw(&key, &record, &mut before);
            }
            self.on_node_addresses.remove(&key);
            self.with_rejections.remove(&key);
            if let Some(service) = tracker.service(&key) {
                let (record, entries) = self.service_record(&key, service, tracker, node);
                self.contribute(&key, &record, entries, &mut before);
                if record.on_node_addresses {
                    self.on_node_addresses.insert(key.clone());
                }
                if !record.rejected.is_empty() {
                    self.with_rejections.insert(key.clone());
                }
                self.services.insert(key, record);
            }
        }
        self.changes(since, generation, everything, before)
    }

    /// Records whether the model refuses the slice `key` (gone: nothing to refuse).
    fn judge_slice(&mut self, tracker: &ChangeTracker, key: &Key) {
        let rejection = tracker.slice(key).and_then(|slice| {
            slice.invalid().map(|reason| Rejection {
                object: slice.meta.describe("EndpointSlice"),
                reason: reason.to_owned(),
            })
        });
        match rejection {
            Some(rejection) => self.slice_rejections.insert(key.clone(), vec![rejection]),
            None => self.slice_rejections.remove(key),
        };
    }

    /// Counts the health-check node ports of the `dirty` services anew; true when the set of
    /// ports changed.
    fn count_health_check_node_ports(&mut self, dirty: &BTreeSet<Key>, tracker: &ChangeTracker) -> bool {
        let mut changed = false;
        for key in dirty {
            let old = self.services.get(key).and_then(|record| record.health_check).map(|check| check.port);
            let new = tracker.service(key).and_then(|service| service.health_check_node_port);
            if old == new {
                continue;
            }
            if let Some(port) = old {
                if let Some(count) = self.health_check_node_ports.get_mut(&port) {
                    *count -= 1;
                    if *count == 0 {
                        self.health_check_node_ports.remove(&port);
                        changed = true;
                    }
                }
            }
            if let Some(port) = new {
                let count = self.health_check_node_ports.entry(port).or_default();
                changed |= *count == 0;
                *count += 1;
            }
        }
        changed
    }

    /// One service's translation, as the full translation makes it, and the entries of its
    /// claims.
    fn service_record(
        &self,
        key: &Key,
        service: &ServiceObject,
        tracker: &ChangeTracker,
        node: &NodeContext,
    ) -> (ServiceRecord, Vec<FrontendEntry>) {
        let mut rejected = Vec::new();
        let ports = match &service.ports {
            Ok(ports) => ports.to_vec(),
            Err(reason) => {
                rejected
                    .push(Rejection { object: service.meta.describe("Service"), reason: reason.to_string() });
                Vec::new()
            }
        };
        let mut entries = Vec::new();
        // Its slices' endpoints by port; slices the model refuses add none.
        let mut endpoints: BTreeMap<ServicePortName, Vec<EndpointSpec>> = BTreeMap::new();
        for name in tracker.slices_of(key) {
            let Some(slice) = tracker.slice(name) else { continue };
            if let Ok(by_port) = slice.endpoints(node) {
                for (port, found) in by_port {
                    endpoints.entry(port).or_default().extend(found);
                }
            }
        }
        let health_check =
            service.health_check_node_port.filter(|_| service.meta.identity().is_ok()).map(|port| {
                HealthCheck { port, local_endpoints: local_ready_addresses(endpoints.values().flatten()) }
            });
        if ports.is_empty() {
            return (ServiceRecord { health_check, rejected, ..ServiceRecord::default() }, entries);
        }
        let mut ports = ports;
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
            health_check,
            on_node_addresses,
            claims: claims.into_boxed_slice(),
            cluster_ips: cluster_ips.into_boxed_slice(),
            listed: listed.into_boxed_slice(),
            rejected,
        };
        (record, entries)
    }

    fn withdraw(&mut self, key: &Key, record: &ServiceRecord, before: &mut Before) {
        let name = service_name(key);
        let old = self.state.health_checks.remove(&name);
        if before.track {
            before.health_checks.entry(name).or_insert(old);
        }
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

    fn contribute(
        &mut self,
        key: &Key,
        record: &ServiceRecord,
        entries: Vec<FrontendEntry>,
        before: &mut Before,
    ) {
        let name = service_name(key);
        if before.track {
            before.health_checks.entry(name.clone()).or_insert(None);
        }
        if let Some(check) = record.health_check {
            self.state.health_checks.insert(name, check);
        }
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
        changes.health_checks =
            before.health_checks.iter().any(|(name, was)| was.as_ref() != self.state.health_checks.get(name));
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

fn service_name((namespace, name): &Key) -> ServiceName {
    ServiceName { namespace: namespace.to_string(), name: name.to_string() }
}

#[cfg(test)]
mod tests;
