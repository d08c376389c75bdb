//! The one change tracker, in the shape of kube-proxy's ServiceChangeTracker and
//! EndpointsChangeTracker: the sources hand it events (an object applied or deleted, a complete
//! list of one kind), it keeps the last object of every key, counts the changes as kube-proxy
//! counts them, records the EndpointSlices' change trigger times and marks the services whose
//! translation a change makes stale. The translator ([`super::incremental`])
//! consumes that dirty set; nothing else works the delta out again.
//!
//! One identity rule for every object: its namespace (absent: "default"; cluster-scoped
//! objects have "") and its name. An object applied under a key whose stored object has
//! another uid is a delete and a re-create in one; an apply with the stored object's uid and
//! resourceVersion (a relist of an unchanged object), or equal to it where there is no
//! resourceVersion (a file's objects), is no change at all.
//!
//! Each object is held here once, in vipr's own decoded form ([`ServiceObject`],
//! [`SliceObject`]: only what the translation reads), as the source decoded it. The Node and
//! the ServiceCIDRs, one and a few objects, are held as the API source slimmed them.
use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    sync::Arc,
    time::SystemTime,
};

use k8s_openapi::{
    api::{
        core::v1::{Node, Service},
        discovery::v1::EndpointSlice,
        networking::v1::ServiceCIDR,
    },
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};

pub use super::objects::{ServiceObject, SliceObject, LAST_CHANGE_TRIGGER_TIME};
use super::{objects::Meta, Rejection};

/// Namespace and name: the one identity of every object ([`key`]). Shared with the decoded
/// object's own names ([`Meta::key`]), not a second copy of them: the tracker's and the
/// translator's maps hold a key per object.
pub type Key = (Arc<str>, Arc<str>);

/// The key of an object: its namespace ("default" when absent, as the API server defaults it
/// for namespaced kinds) and name.
pub fn key(metadata: &ObjectMeta) -> Key {
    (
        metadata.namespace.as_deref().unwrap_or("default").into(),
        metadata.name.as_deref().unwrap_or_default().into(),
    )
}

/// The key of a cluster-scoped object (a Node, a ServiceCIDR).
pub fn cluster_key(metadata: &ObjectMeta) -> Key {
    ("".into(), metadata.name.as_deref().unwrap_or_default().into())
}

/// The kinds of object a source delivers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    Service,
    EndpointSlice,
    Node,
    ServiceCidr,
}

impl Kind {
    pub const ALL: [Self; 4] = [Self::Service, Self::EndpointSlice, Self::Node, Self::ServiceCidr];

    pub fn name(self) -> &'static str {
        match self {
            Self::Service => "Service",
            Self::EndpointSlice => "EndpointSlice",
            Self::Node => "Node",
            Self::ServiceCidr => "ServiceCIDR",
        }
    }
}

/// One object as a source delivers it: Services and EndpointSlices already decoded
/// ([`Object::from`] an API object). The Node and ServiceCIDRs are boxed: a list of
/// thousands of objects is a vector of this enum, and their API structs are ten times the
/// size of a decoded Service.
#[derive(Clone, Debug, PartialEq)]
pub enum Object {
    Service(ServiceObject),
    EndpointSlice(SliceObject),
    Node(Box<Node>),
    ServiceCidr(Box<ServiceCIDR>),
    /// An object the source could not decode: it takes its key's place (a valid object
    /// stored there is gone) and is reported until it is fixed or deleted.
    Invalid {
        kind: Kind,
        key: Key,
        rejection: Rejection,
    },
}

impl Object {
    pub fn kind(&self) -> Kind {
        match self {
            Self::Service(_) => Kind::Service,
            Self::EndpointSlice(_) => Kind::EndpointSlice,
            Self::Node(_) => Kind::Node,
            Self::ServiceCidr(_) => Kind::ServiceCidr,
            Self::Invalid { kind, .. } => *kind,
        }
    }

    pub fn key(&self) -> Key {
        match self {
            Self::Service(service) => service.meta.key(),
            Self::EndpointSlice(slice) => slice.meta.key(),
            Self::Node(node) => cluster_key(&node.metadata),
            Self::ServiceCidr(cidr) => cluster_key(&cidr.metadata),
            Self::Invalid { key, .. } => key.clone(),
        }
    }
}

/// A Service decoded at the source: the API object is dropped, its decoded form kept.
impl From<Service> for Object {
    fn from(service: Service) -> Self {
        Self::Service(ServiceObject::decode(&service))
    }
}

impl From<EndpointSlice> for Object {
    fn from(slice: EndpointSlice) -> Self {
        Self::EndpointSlice(SliceObject::decode(&slice))
    }
}

impl From<Node> for Object {
    fn from(node: Node) -> Self {
        Self::Node(Box::new(node))
    }
}

impl From<ServiceCIDR> for Object {
    fn from(cidr: ServiceCIDR) -> Self {
        Self::ServiceCidr(Box::new(cidr))
    }
}

/// Added, changed and deleted objects, as kube-proxy counts them.
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

    fn add(&mut self, other: Self) {
        self.services += other.services;
        self.endpoint_slices += other.endpoint_slices;
        for (mine, theirs) in self.endpoint_slices_by_family.iter_mut().zip(other.endpoint_slices_by_family) {
            *mine += theirs;
        }
    }
}

/// What the translator must look at again: the services whose Service or EndpointSlices
/// changed, and the slices that changed (for their rejections).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Dirty {
    pub services: BTreeSet<Key>,
    pub slices: BTreeSet<Key>,
}

impl Dirty {
    pub fn is_empty(&self) -> bool {
        self.services.is_empty() && self.slices.is_empty()
    }
}

/// The latest object of every key, and what changed since the translator last looked.
#[derive(Debug)]
pub struct ChangeTracker {
    services: HashMap<Key, ServiceObject>,
    slices: HashMap<Key, SliceObject>,
    /// The slices that name each service (by their `kubernetes.io/service-name` label).
    slices_of: HashMap<Key, Vec<Key>>,
    node: Option<Node>,
    service_cidrs: BTreeMap<Key, ServiceCIDR>,
    /// Objects that did not decode, by kind and key.
    invalid: BTreeMap<(Kind, Key), Rejection>,
    /// Which kinds have been listed completely at least once.
    listed: BTreeSet<Kind>,
    /// The source said its view is complete (every kind listed).
    synced: bool,
    dirty: Dirty,
    /// Changes no successful sync has applied yet (kube-proxy's `..._pending` gauges).
    pending: Changes,
    /// Every change counted, for the `..._total` counters.
    total: Changes,
    /// Trigger times of slice changes no successful sync has programmed yet.
    pending_trigger_times: Vec<SystemTime>,
    /// Trigger times before this are from before the agent ran: the first list holds every
    /// slice as new, and its old trigger times would measure the agent's downtime.
    started: SystemTime,
}

impl ChangeTracker {
    pub fn new(started: SystemTime) -> Self {
        Self {
            services: HashMap::new(),
            slices: HashMap::new(),
            slices_of: HashMap::new(),
            node: None,
            service_cidrs: BTreeMap::new(),
            invalid: BTreeMap::new(),
            listed: BTreeSet::new(),
            synced: false,
            dirty: Dirty::default(),
            pending: Changes::default(),
            total: Changes::default(),
            pending_trigger_times: Vec::new(),
            started,
        }
    }

    /// Applies one object; true when it changed anything.
    pub fn apply(&mut self, object: Object) -> bool {
        let kind = object.kind();
        let key = object.key();
        let was_invalid = match &object {
            Object::Invalid { .. } => false,
            _ => self.invalid.remove(&(kind, key.clone())).is_some(),
        };
        let changed = match object {
            Object::Service(service) => self.apply_service(key, service),
            Object::EndpointSlice(slice) => self.apply_slice(key, slice),
            Object::Node(node) => {
                // The agent's node context follows it; the translator compares that context.
                let changed = self.node.as_ref() != Some(&*node);
                self.node = Some(*node);
                changed
            }
            Object::ServiceCidr(cidr) => {
                let changed = self.service_cidrs.get(&key) != Some(&*cidr);
                self.service_cidrs.insert(key, *cidr);
                changed
            }
            Object::Invalid { kind, key, rejection } => {
                // The valid object it replaces is gone.
                let removed = self.remove(kind, &key);
                let changed = self.invalid.get(&(kind, key.clone())) != Some(&rejection);
                self.invalid.insert((kind, key), rejection);
                removed || changed
            }
        };
        changed || was_invalid
    }

    /// Deletes the object of `kind` under `key`; true when there was one.
    pub fn delete(&mut self, kind: Kind, key: &Key) -> bool {
        let invalid = self.invalid.remove(&(kind, key.clone())).is_some();
        self.remove(kind, key) || invalid
    }

    /// A complete list of one kind (a first list or a relist): what it lacks is deleted, what
    /// it holds applied; objects it holds unchanged change nothing. True when anything changed.
    pub fn list(&mut self, kind: Kind, objects: Vec<Object>) -> bool {
        self.listed.insert(kind);
        let keep: BTreeSet<Key> = objects.iter().map(Object::key).collect();
        let gone: Vec<Key> = match kind {
            Kind::Service => self.services.keys().filter(|key| !keep.contains(*key)).cloned().collect(),
            Kind::EndpointSlice => self.slices.keys().filter(|key| !keep.contains(*key)).cloned().collect(),
            Kind::Node => self
                .node
                .iter()
                .map(|node| cluster_key(&node.metadata))
                .filter(|key| !keep.contains(key))
                .collect(),
            Kind::ServiceCidr => {
                self.service_cidrs.keys().filter(|key| !keep.contains(*key)).cloned().collect()
            }
        };
        let invalid_gone: Vec<Key> = self
            .invalid
            .keys()
            .filter(|(invalid_kind, key)| *invalid_kind == kind && !keep.contains(key))
            .map(|(_, key)| key.clone())
            .collect();
        let mut changed = false;
        for key in gone.iter().chain(&invalid_gone) {
            changed |= self.delete(kind, key);
        }
        for object in objects {
            changed |= self.apply(object);
        }
        changed
    }

    /// The source's view is complete: every kind was listed (or cannot be).
    pub fn set_synced(&mut self) {
        self.synced = true;
    }

    /// Whether the source has delivered a complete view yet; until then nothing is synced, as
    /// a partial view would withdraw the services not seen yet.
    pub fn is_synced(&self) -> bool {
        self.synced
    }

    fn remove(&mut self, kind: Kind, key: &Key) -> bool {
        match kind {
            Kind::Service => match self.services.remove(key) {
                Some(_) => {
                    self.count_service();
                    self.dirty.services.insert(key.clone());
                    true
                }
                None => false,
            },
            Kind::EndpointSlice => match self.slices.remove(key) {
                Some(old) => {
                    self.count_slice(&old);
                    self.unindex(key, &old);
                    self.dirty.slices.insert(key.clone());
                    true
                }
                None => false,
            },
            Kind::Node => self.node.take_if(|node| cluster_key(&node.metadata) == *key).is_some(),
            Kind::ServiceCidr => self.service_cidrs.remove(key).is_some(),
        }
    }

    fn apply_service(&mut self, key: Key, service: ServiceObject) -> bool {
        if self
            .services
            .get(&key)
            .is_some_and(|old| same_version(&old.meta, &service.meta, || *old == service))
        {
            return false;
        }
        self.count_service();
        self.dirty.services.insert(key.clone());
        // Removed first: `insert` would keep the old key, whose names are the old object's,
        // a second copy beside the new object's.
        self.services.remove(&key);
        self.services.insert(key, service);
        true
    }

    fn apply_slice(&mut self, key: Key, slice: SliceObject) -> bool {
        if let Some(old) = self.slices.get(&key) {
            if same_version(&old.meta, &slice.meta, || *old == slice) {
                return false;
            }
        }
        if let Some(old) = self.slices.remove(&key) {
            self.unindex(&key, &old);
        }
        self.count_slice(&slice);
        self.record_trigger_time(&slice);
        self.dirty.slices.insert(key.clone());
        if let Some(service) = service_of(&key, &slice) {
            // The Service's own key when it is there: its names held once.
            let service = self.services.get_key_value(&service).map_or(service, |(held, _)| held.clone());
            self.dirty.services.insert(service.clone());
            let names = self.slices_of.entry(service).or_default();
            if !names.contains(&key) {
                names.reserve_exact(1);
                names.push(key.clone());
            }
        }
        self.slices.insert(key, slice);
        true
    }

    /// Forgets that `old` (stored under `key`) lists endpoints of its service, and marks that
    /// service dirty.
    fn unindex(&mut self, key: &Key, old: &SliceObject) {
        let Some(service) = service_of(key, old) else { return };
        if let Some(names) = self.slices_of.get_mut(&service) {
            names.retain(|name| name != key);
            if names.is_empty() {
                self.slices_of.remove(&service);
            }
        }
        self.dirty.services.insert(service);
    }

    fn count_service(&mut self) {
        let change = Changes { services: 1, ..Changes::default() };
        self.pending.add(change);
        self.total.add(change);
    }

    fn count_slice(&mut self, slice: &SliceObject) {
        let mut change = Changes { endpoint_slices: 1, ..Changes::default() };
        change.endpoint_slices_by_family[usize::from(slice.ipv6)] = 1;
        self.pending.add(change);
        self.total.add(change);
    }

    fn record_trigger_time(&mut self, slice: &SliceObject) {
        let trigger_time = slice.trigger_time.filter(|time| *time > self.started);
        self.pending_trigger_times.extend(trigger_time);
    }

    /// The services and slices changed since the last call, for the translator.
    pub fn take_dirty(&mut self) -> Dirty {
        std::mem::take(&mut self.dirty)
    }

    /// Changes counted since the tracker started.
    pub fn total(&self) -> Changes {
        self.total
    }

    /// Changes no successful sync has applied yet.
    pub fn pending(&self) -> Changes {
        self.pending
    }

    /// A sync succeeded: the pending changes are applied. Returns the trigger times of the
    /// slice changes it programmed.
    pub fn synced_successfully(&mut self) -> Vec<SystemTime> {
        self.pending = Changes::default();
        std::mem::take(&mut self.pending_trigger_times)
    }

    pub fn service(&self, key: &Key) -> Option<&ServiceObject> {
        self.services.get(key)
    }

    pub fn slice(&self, key: &Key) -> Option<&SliceObject> {
        self.slices.get(key)
    }

    /// The keys of the slices that name the service `key`.
    pub fn slices_of(&self, key: &Key) -> &[Key] {
        self.slices_of.get(key).map(Vec::as_slice).unwrap_or_default()
    }

    pub fn service_keys(&self) -> impl Iterator<Item = &Key> {
        self.services.keys()
    }

    pub fn slice_keys(&self) -> impl Iterator<Item = &Key> {
        self.slices.keys()
    }

    pub fn node(&self) -> Option<&Node> {
        self.node.as_ref()
    }

    pub fn service_cidrs(&self) -> impl Iterator<Item = &ServiceCIDR> {
        self.service_cidrs.values()
    }

    /// The objects that did not decode.
    pub fn invalid(&self) -> impl Iterator<Item = &Rejection> {
        self.invalid.values()
    }

    /// The uid of an object, for Events about it.
    pub fn uid(&self, kind: Kind, namespace: Option<&str>, name: &str) -> Option<String> {
        let key = |namespace: Option<&str>| -> Key { (namespace.unwrap_or("default").into(), name.into()) };
        let uid = match kind {
            Kind::Service => self.services.get(&key(namespace)).and_then(|s| s.meta.uid()),
            Kind::EndpointSlice => self.slices.get(&key(namespace)).and_then(|s| s.meta.uid()),
            Kind::Node => self
                .node
                .as_ref()
                .map(|n| &n.metadata)
                .filter(|m| m.name.as_deref() == Some(name))
                .and_then(|m| m.uid.as_deref()),
            Kind::ServiceCidr => {
                self.service_cidrs.get(&("".into(), name.into())).and_then(|c| c.metadata.uid.as_deref())
            }
        };
        uid.map(str::to_owned)
    }

    /// Copies of every object held, in key order (for tests and the full translation).
    pub fn services_sorted(&self) -> Vec<ServiceObject> {
        let sorted: BTreeMap<&Key, &ServiceObject> = self.services.iter().collect();
        sorted.into_values().cloned().collect()
    }

    pub fn slices_sorted(&self) -> Vec<SliceObject> {
        let sorted: BTreeMap<&Key, &SliceObject> = self.slices.iter().collect();
        sorted.into_values().cloned().collect()
    }
}

/// Whether `new` is the version of the object `old` already is: the same uid and
/// resourceVersion, or without a resourceVersion (a file's objects) `equal` content.
fn same_version(old: &Meta, new: &Meta, equal: impl FnOnce() -> bool) -> bool {
    match (&old.resource_version, &new.resource_version) {
        (Some(old_version), Some(new_version)) => old_version == new_version && old.uid == new.uid,
        (None, None) => equal(),
        _ => false,
    }
}

/// The service a slice lists endpoints of: its label, in its namespace.
fn service_of(key: &Key, slice: &SliceObject) -> Option<Key> {
    let name = slice.service.as_deref()?;
    Some((key.0.clone(), name.into()))
}

#[cfg(test)]
mod tests;
