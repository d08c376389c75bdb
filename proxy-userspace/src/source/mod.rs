//! Where Kubernetes objects come from. A source delivers events (an object applied or deleted,
//! a complete list of one kind, "synced" once every kind was listed), never snapshots; the
//! agent's [`ChangeTracker`](crate::model::changes::ChangeTracker) keeps the objects. A source
//! never sees the dataplane or its errors.
use std::collections::BTreeMap;

use k8s_openapi::api::{
    core::v1::{Node, Service},
    discovery::v1::EndpointSlice,
    networking::v1::ServiceCIDR,
};

pub use crate::model::changes::{Key, Kind, Object};
use crate::model::{
    changes::{ChangeTracker, ServiceObject, SliceObject},
    kubernetes::Rejection,
};

pub mod file;
pub mod kubernetes;

/// Every Service and EndpointSlice this proxy owns ([`Ownership`]) that the source currently
/// knows, this node's Node when the source has one (the file source does not), the cluster's
/// ServiceCIDRs, plus the objects it could not even decode. As a file holds them (API
/// objects), or as the change tracker does ([`HeldObjects`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Objects<S = Service, E = EndpointSlice> {
    pub services: Vec<S>,
    pub slices: Vec<E>,
    pub node: Option<Node>,
    pub service_cidrs: Vec<ServiceCIDR>,
    pub rejected: Vec<Rejection>,
}

/// The objects a change tracker holds, in vipr's decoded form.
pub type HeldObjects = Objects<ServiceObject, SliceObject>;

impl<S, E> Default for Objects<S, E> {
    fn default() -> Self {
        Self {
            services: Vec::new(),
            slices: Vec::new(),
            node: None,
            service_cidrs: Vec::new(),
            rejected: Vec::new(),
        }
    }
}

/// The label by which a Service (and, copied by the EndpointSlice controller, its slices)
/// names the proxy that serves it instead of the default one.
pub const SERVICE_PROXY_NAME_LABEL: &str = "service.kubernetes.io/service-proxy-name";
/// The label the EndpointSlice controller puts on the slices of headless Services.
pub const HEADLESS_LABEL: &str = "service.kubernetes.io/headless";
/// The field selector kube-proxy watches Services with: headless ones have nothing to proxy.
pub const SERVICE_FIELD_SELECTOR: &str = "spec.clusterIP!=None";

/// Which objects are this proxy's, as kube-proxy's informers select them: Services and
/// EndpointSlices without [`SERVICE_PROXY_NAME_LABEL`] (with `--service-proxy-name=NAME`,
/// exactly those labelled NAME) and without [`HEADLESS_LABEL`]; Services whose clusterIP is
/// not `None`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Ownership {
    /// `--service-proxy-name`.
    pub service_proxy_name: Option<String>,
}

impl Ownership {
    /// The label selector for Services and EndpointSlices.
    pub fn label_selector(&self) -> String {
        let proxy = match &self.service_proxy_name {
            None => format!("!{SERVICE_PROXY_NAME_LABEL}"),
            Some(name) => format!("{SERVICE_PROXY_NAME_LABEL}={name}"),
        };
        format!("{proxy},!{HEADLESS_LABEL}")
    }

    /// kube-proxy's own label selector, for ServiceCIDRs: the cluster's service ranges are
    /// the same whichever proxy serves which Service.
    pub fn service_cidr_label_selector() -> String {
        Self::default().label_selector()
    }

    fn owns_labels(&self, labels: Option<&BTreeMap<String, String>>) -> bool {
        let label = |key: &str| labels.and_then(|labels| labels.get(key));
        label(SERVICE_PROXY_NAME_LABEL) == self.service_proxy_name.as_ref() && label(HEADLESS_LABEL).is_none()
    }

    pub fn owns_service(&self, service: &Service) -> bool {
        let cluster_ip = service.spec.as_ref().and_then(|spec| spec.cluster_ip.as_deref());
        self.owns_labels(service.metadata.labels.as_ref()) && cluster_ip != Some("None")
    }

    pub fn owns_slice(&self, slice: &EndpointSlice) -> bool {
        self.owns_labels(slice.metadata.labels.as_ref())
    }

    /// Keeps only what the selectors would have delivered (for sources that cannot select
    /// server-side, the services file).
    pub fn retain_owned(&self, objects: &mut Objects) {
        objects.services.retain(|service| self.owns_service(service));
        objects.slices.retain(|slice| self.owns_slice(slice));
        let default = Self::default();
        objects.service_cidrs.retain(|cidr| default.owns_labels(cidr.metadata.labels.as_ref()));
    }
}

impl Objects {
    /// Every object, decoded, as a source delivers them one by one.
    pub fn into_objects(self) -> Vec<Object> {
        let Self { services, slices, node, service_cidrs, rejected } = self;
        let invalid = rejected.into_iter().map(|rejection| {
            let kind = Kind::ALL
                .into_iter()
                .find(|kind| rejection.object.split(' ').next() == Some(kind.name()))
                .unwrap_or(Kind::Service);
            // A file's rejections are named by their document, which keeps them apart.
            Object::Invalid { kind, key: ("".into(), rejection.object.as_str().into()), rejection }
        });
        services
            .into_iter()
            .map(Object::from)
            .chain(slices.into_iter().map(Object::from))
            .chain(node.map(Object::from))
            .chain(service_cidrs.into_iter().map(Object::from))
            .chain(invalid)
            .collect()
    }
}

impl HeldObjects {
    /// The objects `tracker` holds, in key order.
    pub fn held_by(tracker: &ChangeTracker) -> Self {
        Self {
            services: tracker.services_sorted(),
            slices: tracker.slices_sorted(),
            node: tracker.node().cloned(),
            service_cidrs: tracker.service_cidrs().cloned().collect(),
            rejected: tracker.invalid().cloned().collect(),
        }
    }
}

#[allow(
    clippy::large_enum_variant,
    reason = "a few events a second, each moved once through a channel: boxing would buy nothing"
)]
#[derive(Clone, Debug)]
pub enum SourceEvent {
    /// An object was added or changed (a valid one, or one that does not decode).
    Applied(Object),
    /// The object of this kind and key is gone.
    Deleted(Kind, Key),
    /// A complete list of one kind (the first list, or a relist after the watch expired):
    /// every object of the kind the source now knows; any other is gone.
    Listed(Kind, Vec<Object>),
    /// Every kind has been listed: the view is complete and may be applied. Sent once.
    Synced,
    /// The source cannot be read right now; the datapath keeps what it has.
    Unusable(String),
    /// Events that belong together, applied together so that no sync sees a part of them:
    /// one re-read of the services file, which is one desired state (a Service's new port and
    /// its slices' new endpoints, or every object of a conformance stage).
    Batch(Vec<SourceEvent>),
}

impl SourceEvent {
    /// Applies the event to `tracker`; true when it changed anything there.
    pub fn apply_to(self, tracker: &mut ChangeTracker) -> bool {
        match self {
            Self::Applied(object) => tracker.apply(object),
            Self::Deleted(kind, key) => tracker.delete(kind, &key),
            Self::Listed(kind, objects) => tracker.list(kind, objects),
            Self::Synced => {
                let first = !tracker.is_synced();
                tracker.set_synced();
                first
            }
            Self::Unusable(_) => false,
            Self::Batch(events) => {
                events.into_iter().fold(false, |changed, event| event.apply_to(tracker) | changed)
            }
        }
    }

    /// Whether this is [`SourceEvent::Synced`] or a batch that holds it.
    pub fn completes_the_view(&self) -> bool {
        match self {
            Self::Synced => true,
            Self::Batch(events) => events.iter().any(Self::completes_the_view),
            _ => false,
        }
    }
}
