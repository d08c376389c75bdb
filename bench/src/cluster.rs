//! A synthetic cluster as the API server would describe it: `n` ClusterIP Services with one
//! TCP port each, and their EndpointSlices (at most 100 endpoints a slice, as the
//! EndpointSlice controller cuts them), all endpoints ready and on other nodes. The agent's
//! own translation (`vipr::model::kubernetes::desired_state`) turns it into the desired state.
//!
//! Addresses: cluster IPs from 10.96.0.1 (service range 10.96.0.0/12), endpoints from
//! 10.16.0.0, clients from 10.1.0.0, replacement endpoints from 10.48.0.0, all inside the
//! cluster CIDR 10.0.0.0/10; the node is 172.16.0.1.

use std::{collections::BTreeMap, net::Ipv4Addr};

use k8s_openapi::{
    api::{
        core::v1::{Service, ServicePort, ServiceSpec},
        discovery::v1::{Endpoint, EndpointConditions, EndpointPort, EndpointSlice},
    },
    apimachinery::pkg::{apis::meta::v1::ObjectMeta, util::intstr::IntOrString},
};
use vipr::model::{
    changes::Object,
    kubernetes::{desired_state, NodeContext, NodeFacts, ProxySettings, Translation},
};

use super::sys::NODE_IP;

pub const SERVICE_PORT: u16 = 80;
pub const TARGET_PORT: u16 = 8080;
pub const CLUSTER_CIDR: &str = "10.0.0.0/10";
pub const SERVICE_CIDR: &str = "10.96.0.0/12";
const NAMESPACE: &str = "bench";
const SLICE_CAPACITY: usize = 100;

pub fn cluster_ip(service: usize) -> Ipv4Addr {
    offset(Ipv4Addr::new(10, 96, 0, 1), service)
}

pub fn endpoint_ip(service: usize, endpoint: usize, per_service: usize) -> Ipv4Addr {
    offset(Ipv4Addr::new(10, 16, 0, 0), service * per_service + endpoint)
}

/// A pod that opens connections (inside the cluster CIDR, so never masqueraded).
pub fn client_ip(n: usize) -> Ipv4Addr {
    offset(Ipv4Addr::new(10, 1, 0, 1), n % 60_000)
}

fn offset(base: Ipv4Addr, n: usize) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(base) + u32::try_from(n).expect("address offset fits in 32 bits"))
}

pub struct Cluster {
    pub services: Vec<Service>,
    pub slices: Vec<EndpointSlice>,
    pub node: NodeContext,
    endpoints_per_service: usize,
    replacements: usize,
}

impl Cluster {
    pub fn new(services: usize, endpoints_per_service: usize) -> Self {
        assert!(services > 0 && endpoints_per_service > 0);
        assert!(services < 1 << 20, "cluster IPs must stay inside 10.96.0.0/12");
        assert!(services * endpoints_per_service <= 1 << 21, "endpoints must stay below 10.48.0.0");
        let slices_per_service = endpoints_per_service.div_ceil(SLICE_CAPACITY);
        let mut cluster = Self {
            services: Vec::with_capacity(services),
            slices: Vec::with_capacity(services * slices_per_service),
            node: node_context(),
            endpoints_per_service,
            replacements: 0,
        };
        for i in 0..services {
            cluster.services.push(service(i));
            cluster.slices.extend(slices(i, endpoints_per_service));
        }
        cluster
    }

    /// The cluster as the agent holds it: each Service and EndpointSlice decoded as the source
    /// decodes it, one at a time, so that the API objects are never all held at once. The
    /// returned cluster's `services` and `slices` are empty.
    pub fn decoded(services: usize, endpoints_per_service: usize) -> (Self, Vec<Object>, Vec<Object>) {
        let mut cluster = Self::new(1, endpoints_per_service);
        cluster.services.clear();
        cluster.slices.clear();
        let slices_per_service = endpoints_per_service.div_ceil(SLICE_CAPACITY);
        let mut decoded_services = Vec::with_capacity(services);
        let mut decoded_slices = Vec::with_capacity(services * slices_per_service);
        for i in 0..services {
            decoded_services.push(Object::from(service(i)));
            decoded_slices.extend(slices(i, endpoints_per_service).into_iter().map(Object::from));
        }
        (cluster, decoded_services, decoded_slices)
    }

    /// As [`Self::replaced`], for the first slice of `service` as generated and changed by
    /// earlier replacements (only its first endpoint ever changes).
    pub fn replacement(&mut self, service: usize) -> (EndpointSlice, Ipv4Addr) {
        let first = slices(service, self.endpoints_per_service).swap_remove(0);
        self.replaced(&first)
    }

    /// The agent's translation of the whole cluster, as it does on every sync.
    pub fn translate(&self) -> Translation {
        desired_state(&self.services, &self.slices, &self.node)
    }

    /// The key of the slice [`Self::replaced`] changes for `service`: its first.
    pub fn changed_slice_key(service: usize) -> (String, String) {
        (NAMESPACE.to_owned(), format!("svc-{service}-0"))
    }

    /// One pod replaced by a new one with a new address (a rollout's single step): a new
    /// version of `slice` (the one [`Self::changed_slice_key`] names, as the agent holds it)
    /// with its first endpoint's address changed, and that address: the object the watch
    /// delivers next.
    pub fn replaced(&mut self, slice: &EndpointSlice) -> (EndpointSlice, Ipv4Addr) {
        let address = offset(Ipv4Addr::new(10, 48, 0, 0), self.replacements);
        self.replacements += 1;
        let mut slice = slice.clone();
        slice.endpoints[0].addresses = vec![address.to_string()];
        slice.metadata.resource_version = Some(format!("r{}", self.replacements));
        (slice, address)
    }
}

/// The resourceVersion of every generated object; [`Cluster::replaced`] gives the changed
/// slice a new one.
const INITIAL_VERSION: &str = "r0";

fn node_context() -> NodeContext {
    let facts = NodeFacts {
        name: "bench-node".into(),
        zone: None,
        addresses: vec![Ipv4Addr::from(NODE_IP).into()],
        primary_ips: Vec::new(),
    };
    let settings = ProxySettings {
        cluster_cidrs: vec![CLUSTER_CIDR.parse().expect("valid CIDR")],
        pod_interfaces: None,
        masquerade_all: false,
        node_port_cidrs: Vec::new(),
        service_cidrs: vec![SERVICE_CIDR.parse().expect("valid CIDR")],
        own_ports: [10256, 10249].into(),
        localhost_node_ports: false,
    };
    NodeContext::resolve(&facts, &settings)
}

fn service(i: usize) -> Service {
    let ip = cluster_ip(i).to_string();
    Service {
        metadata: ObjectMeta {
            name: Some(format!("svc-{i}")),
            namespace: Some(NAMESPACE.into()),
            // Objects from the API server always carry one; the agent's change tracking uses it.
            resource_version: Some(INITIAL_VERSION.into()),
            ..ObjectMeta::default()
        },
        spec: Some(ServiceSpec {
            type_: Some("ClusterIP".into()),
            cluster_ip: Some(ip.clone()),
            cluster_ips: Some(vec![ip]),
            ports: Some(vec![ServicePort {
                name: Some("http".into()),
                port: i32::from(SERVICE_PORT),
                protocol: Some("TCP".into()),
                target_port: Some(IntOrString::Int(i32::from(TARGET_PORT))),
                ..ServicePort::default()
            }]),
            ..ServiceSpec::default()
        }),
        ..Service::default()
    }
}

/// The slices of service `i`.
fn slices(i: usize, endpoints_per_service: usize) -> Vec<EndpointSlice> {
    let addresses: Vec<Ipv4Addr> =
        (0..endpoints_per_service).map(|j| endpoint_ip(i, j, endpoints_per_service)).collect();
    addresses.chunks(SLICE_CAPACITY).enumerate().map(|(k, chunk)| slice(i, k, chunk)).collect()
}

fn slice(service: usize, k: usize, addresses: &[Ipv4Addr]) -> EndpointSlice {
    EndpointSlice {
        metadata: ObjectMeta {
            name: Some(format!("svc-{service}-{k}")),
            namespace: Some(NAMESPACE.into()),
            labels: Some(BTreeMap::from([(
                vipr::model::kubernetes::SERVICE_NAME_LABEL.to_owned(),
                format!("svc-{service}"),
            )])),
            resource_version: Some(INITIAL_VERSION.into()),
            ..ObjectMeta::default()
        },
        address_type: "IPv4".into(),
        endpoints: addresses
            .iter()
            .map(|address| Endpoint {
                addresses: vec![address.to_string()],
                conditions: Some(EndpointConditions {
                    ready: Some(true),
                    serving: Some(true),
                    terminating: Some(false),
                }),
                node_name: Some("other-node".into()),
                ..Endpoint::default()
            })
            .collect(),
        ports: Some(vec![EndpointPort {
            name: Some("http".into()),
            port: Some(i32::from(TARGET_PORT)),
            protocol: Some("TCP".into()),
            ..EndpointPort::default()
        }]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_service_gets_its_own_backends() {
        let mut cluster = Cluster::new(3, 150);
        let translation = cluster.translate();
        assert!(translation.rejected.is_empty(), "{:?}", translation.rejected);
        assert_eq!(translation.state.frontends.len(), 3);
        for entry in translation.state.frontends.values() {
            assert_eq!(entry.from_pod.backends.len(), 150);
            assert!(!entry.from_pod.masquerade, "pods are not masqueraded");
            assert!(entry.from_outside.masquerade, "outside sources are");
        }
        let (key, first) = (Cluster::changed_slice_key(2), cluster.slices[2 * 2].clone());
        assert_eq!(first.metadata.name.as_deref(), Some(key.1.as_str()));
        let (replaced, new) = cluster.replaced(&first);
        assert_eq!(replaced.endpoints[0].addresses, [new.to_string()]);
        assert_eq!(replaced.endpoints.len(), first.endpoints.len());
        assert_ne!(replaced.metadata.resource_version, first.metadata.resource_version);
    }
}
