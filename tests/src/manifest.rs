//! The services file vipr reads: ClusterIP Services and their EndpointSlices.
//!
//! [`render`] writes the multi-document YAML that kubectl would show for a
//! [`ClusterIpService`]; [`parse`] reads such a file back with vipr's own parser (the demo
//! takes its topology from one). Only what the testbed needs is modelled: IPv4 ClusterIP
//! services, one target port per service port, endpoints with a readiness condition.

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    net::{Ipv4Addr, SocketAddr, SocketAddrV4},
    path::Path,
};

use anyhow::{bail, ensure, Context, Result};
use vipr::{model::kubernetes::SERVICE_NAME_LABEL, source::file::parse_manifests};

/// The Kubernetes API types of the services file, under names that do not clash with the
/// testbed's own `ServicePort` and `Endpoint`.
mod k8s {
    pub use k8s_openapi::{
        api::{
            core::v1::{ObjectReference, Service, ServicePort, ServiceSpec},
            discovery::v1::{Endpoint, EndpointConditions, EndpointPort, EndpointSlice},
        },
        apimachinery::pkg::{apis::meta::v1::ObjectMeta, util::intstr::IntOrString},
    };
}

/// The model's protocol: the testbed's services are TCP or UDP.
pub use vipr::model::Protocol;

/// The protocol of a Service or EndpointSlice port; Kubernetes reads an absent one as TCP. The
/// testbed's services are TCP or UDP.
fn protocol_of_port(protocol: Option<&str>) -> Result<Protocol> {
    match Protocol::from_kubernetes(protocol) {
        Some(protocol @ (Protocol::Tcp | Protocol::Udp)) => Ok(protocol),
        _ => bail!("protocol {} is not supported", protocol.unwrap_or_default()),
    }
}

/// Where clients reach a service port: VIP, port and protocol.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Frontend {
    pub addr: SocketAddrV4,
    pub protocol: Protocol,
}

impl Frontend {
    pub fn socket_addr(self) -> SocketAddr {
        SocketAddr::V4(self.addr)
    }
}

impl fmt::Display for Frontend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.protocol)
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServicePort {
    pub name: String,
    pub protocol: Protocol,
    pub port: u16,
    /// The port the endpoints listen on (the EndpointSlice port of the same name).
    pub target_port: u16,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoint {
    pub addr: Ipv4Addr,
    pub ready: bool,
    /// The pod behind the address (`targetRef.name`), if the file names one.
    pub pod: Option<String>,
}

impl Endpoint {
    pub fn ready(addr: Ipv4Addr, pod: &str) -> Self {
        Self { addr, ready: true, pod: Some(pod.to_owned()) }
    }
}

/// A ClusterIP Service together with the endpoints of its (single, rendered) EndpointSlice.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterIpService {
    pub namespace: String,
    pub name: String,
    pub cluster_ip: Ipv4Addr,
    pub ports: Vec<ServicePort>,
    pub endpoints: Vec<Endpoint>,
}

impl ClusterIpService {
    /// `default/web` at `cluster_ip`, the service of most end-to-end tests: TCP 80 ("http")
    /// to `target_ports.0` and UDP 53 ("dns") to `target_ports.1`, served by `endpoints`.
    pub fn web(cluster_ip: Ipv4Addr, target_ports: (u16, u16), endpoints: Vec<Endpoint>) -> Self {
        let port = |name: &str, protocol, port, target_port| ServicePort {
            name: name.to_owned(),
            protocol,
            port,
            target_port,
        };
        Self {
            namespace: "default".to_owned(),
            name: "web".to_owned(),
            cluster_ip,
            ports: vec![
                port("http", Protocol::Tcp, 80, target_ports.0),
                port("dns", Protocol::Udp, 53, target_ports.1),
            ],
            endpoints,
        }
    }

    pub fn frontend(&self, port: &ServicePort) -> Frontend {
        Frontend { addr: SocketAddrV4::new(self.cluster_ip, port.port), protocol: port.protocol }
    }

    /// The frontend of the port named `name`.
    pub fn frontend_named(&self, name: &str) -> Result<Frontend> {
        self.ports
            .iter()
            .find(|port| port.name == name)
            .map(|port| self.frontend(port))
            .with_context(|| format!("service {} has no port named {name}", self.name))
    }

    /// What vipr should program for `port`: every ready endpoint at the target port, sorted.
    pub fn expected_backends(&self, port: &ServicePort) -> Vec<SocketAddrV4> {
        let mut backends: Vec<_> = self
            .endpoints
            .iter()
            .filter(|endpoint| endpoint.ready)
            .map(|endpoint| SocketAddrV4::new(endpoint.addr, port.target_port))
            .collect();
        backends.sort();
        backends
    }

    /// The Service and its EndpointSlice, as kubectl would show them.
    pub fn objects(&self) -> (k8s::Service, k8s::EndpointSlice) {
        let metadata = |name: String, labels| k8s::ObjectMeta {
            name: Some(name),
            namespace: Some(self.namespace.clone()),
            labels,
            ..Default::default()
        };
        let cluster_ip = self.cluster_ip.to_string();
        let service = k8s::Service {
            metadata: metadata(self.name.clone(), None),
            spec: Some(k8s::ServiceSpec {
                type_: Some("ClusterIP".to_owned()),
                cluster_ip: Some(cluster_ip.clone()),
                cluster_ips: Some(vec![cluster_ip]),
                ports: Some(
                    self.ports
                        .iter()
                        .map(|port| k8s::ServicePort {
                            name: Some(port.name.clone()),
                            protocol: Some(port.protocol.to_string()),
                            port: port.port.into(),
                            target_port: Some(k8s::IntOrString::Int(port.target_port.into())),
                            ..Default::default()
                        })
                        .collect(),
                ),
                ..Default::default()
            }),
            status: None,
        };
        let slice = k8s::EndpointSlice {
            metadata: metadata(
                format!("{}-slice", self.name),
                Some(BTreeMap::from([(SERVICE_NAME_LABEL.to_owned(), self.name.clone())])),
            ),
            address_type: "IPv4".to_owned(),
            ports: Some(
                self.ports
                    .iter()
                    .map(|port| k8s::EndpointPort {
                        name: Some(port.name.clone()),
                        protocol: Some(port.protocol.to_string()),
                        port: Some(port.target_port.into()),
                        ..Default::default()
                    })
                    .collect(),
            ),
            endpoints: self
                .endpoints
                .iter()
                .map(|endpoint| k8s::Endpoint {
                    addresses: vec![endpoint.addr.to_string()],
                    conditions: Some(k8s::EndpointConditions {
                        ready: Some(endpoint.ready),
                        ..Default::default()
                    }),
                    target_ref: endpoint.pod.as_ref().map(|pod| k8s::ObjectReference {
                        kind: Some("Pod".to_owned()),
                        name: Some(pod.clone()),
                        namespace: Some(self.namespace.clone()),
                        ..Default::default()
                    }),
                    ..Default::default()
                })
                .collect(),
        };
        (service, slice)
    }
}

/// The services file for `services`: each Service followed by its EndpointSlice.
pub fn render(services: &[ClusterIpService]) -> String {
    let documents: Vec<String> = services
        .iter()
        .flat_map(|service| {
            let (service, slice) = service.objects();
            [serde_yaml::to_string(&service), serde_yaml::to_string(&slice)]
        })
        .collect::<Result<_, _>>()
        .expect("Services and EndpointSlices serialize");
    documents.join("---\n")
}

/// Reads a services file with vipr's own parser: ClusterIP Services, joined with the
/// EndpointSlices labelled with their name; other kinds of object are ignored. Objects vipr
/// would reject, and what the testbed cannot represent (IPv6, protocols other than TCP and
/// UDP, slice ports without a number), are errors.
pub fn parse(yaml: &str) -> Result<Vec<ClusterIpService>> {
    let objects = parse_manifests(Path::new("services file"), yaml)?;
    if !objects.rejected.is_empty() {
        let rejected: Vec<String> = objects.rejected.iter().map(ToString::to_string).collect();
        bail!("{}", rejected.join("; "));
    }
    objects
        .services
        .iter()
        .filter_map(|service| {
            // Headless services (clusterIP None) have no VIP to balance.
            let cluster_ip = service.spec.as_ref()?.cluster_ip.as_deref().filter(|&ip| ip != "None")?;
            Some(join(service, cluster_ip, &objects.slices))
        })
        .collect()
}

fn namespace_of(metadata: &k8s::ObjectMeta) -> &str {
    metadata.namespace.as_deref().unwrap_or("default")
}

fn port_number(port: i32) -> Result<u16> {
    u16::try_from(port).with_context(|| format!("port {port} is out of range"))
}

fn join(service: &k8s::Service, cluster_ip: &str, slices: &[k8s::EndpointSlice]) -> Result<ClusterIpService> {
    let name = service.metadata.name.clone().context("a Service has no name")?;
    let namespace = namespace_of(&service.metadata).to_owned();
    let cluster_ip: Ipv4Addr =
        cluster_ip.parse().with_context(|| format!("service {name}: clusterIP {cluster_ip} is not IPv4"))?;
    let slices: Vec<_> = slices
        .iter()
        .filter(|slice| {
            namespace_of(&slice.metadata) == namespace
                && slice.metadata.labels.as_ref().and_then(|labels| labels.get(SERVICE_NAME_LABEL))
                    == Some(&name)
        })
        .collect();
    let ports = service
        .spec
        .iter()
        .flat_map(|spec| spec.ports.iter().flatten())
        .map(|port| {
            let port_name = port.name.clone().unwrap_or_default();
            let protocol = protocol_of_port(port.protocol.as_deref())?;
            let mut target_ports = BTreeSet::new();
            for slice_port in slices.iter().flat_map(|slice| slice.ports.iter().flatten()) {
                if slice_port.name.as_deref().unwrap_or_default() == port_name
                    && protocol_of_port(slice_port.protocol.as_deref()).ok() == Some(protocol)
                {
                    let number = slice_port.port.with_context(|| {
                        format!("service {name}: EndpointSlice port {port_name:?} has no number")
                    })?;
                    target_ports.insert(port_number(number)?);
                }
            }
            ensure!(target_ports.len() <= 1, "service {name}: EndpointSlices disagree on port {port_name:?}");
            let target_port = target_ports.pop_first().with_context(|| {
                format!("service {name}: no EndpointSlice port matches port {port_name:?}")
            })?;
            Ok(ServicePort { name: port_name, protocol, port: port_number(port.port)?, target_port })
        })
        .collect::<Result<_>>()?;
    let endpoints = slices
        .iter()
        .flat_map(|slice| &slice.endpoints)
        .flat_map(|endpoint| {
            // Kubernetes reads an absent readiness as ready.
            let ready = endpoint.conditions.as_ref().and_then(|conditions| conditions.ready).unwrap_or(true);
            endpoint.addresses.iter().map(move |addr| {
                Ok(Endpoint {
                    addr: addr.parse().with_context(|| format!("endpoint address {addr} is not IPv4"))?,
                    ready,
                    pod: endpoint.target_ref.as_ref().and_then(|target| target.name.clone()),
                })
            })
        })
        .collect::<Result<_>>()?;
    Ok(ClusterIpService { namespace, name, cluster_ip, ports, endpoints })
}

/// Backends of `services` grouped by endpoint address, for building one namespace per
/// address: address -> pod name (the first one the file gives, if any).
pub fn endpoint_addresses(services: &[ClusterIpService]) -> BTreeMap<Ipv4Addr, Option<String>> {
    let mut addresses = BTreeMap::new();
    for endpoint in services.iter().flat_map(|service| &service.endpoints) {
        let pod = addresses.entry(endpoint.addr).or_insert(None);
        if pod.is_none() {
            pod.clone_from(&endpoint.pod);
        }
    }
    addresses
}

#[cfg(test)]
mod tests {
    use super::*;

    fn web() -> ClusterIpService {
        ClusterIpService {
            namespace: "shop".to_owned(),
            name: "web".to_owned(),
            cluster_ip: Ipv4Addr::new(10, 96, 0, 10),
            ports: vec![
                ServicePort { name: "http".to_owned(), protocol: Protocol::Tcp, port: 80, target_port: 8080 },
                ServicePort { name: "dns".to_owned(), protocol: Protocol::Udp, port: 53, target_port: 5353 },
            ],
            endpoints: vec![
                Endpoint::ready(Ipv4Addr::new(10, 1, 0, 2), "web-0"),
                Endpoint { addr: Ipv4Addr::new(10, 1, 0, 3), ready: false, pod: None },
            ],
        }
    }

    #[test]
    fn parse_reads_back_what_render_writes() {
        let mut empty = web();
        empty.name = "empty".to_owned();
        empty.cluster_ip = Ipv4Addr::new(10, 96, 0, 11);
        empty.endpoints.clear();
        // Names that YAML reads as null, a boolean and a number unless they are quoted.
        let mut plain_words = web();
        plain_words.namespace = "null".to_owned();
        plain_words.name = "true".to_owned();
        plain_words.cluster_ip = Ipv4Addr::new(10, 96, 0, 12);
        plain_words.endpoints = vec![Endpoint::ready(Ipv4Addr::new(10, 1, 0, 4), "123")];
        let services = vec![web(), empty, plain_words];
        assert_eq!(parse(&render(&services)).unwrap(), services);
    }

    #[test]
    fn parse_refuses_what_it_cannot_represent() {
        let yaml = render(&[web()]);
        for (from, to, error) in [
            ("clusterIP: 10.96.0.10", "clusterIP: fd00::10", "clusterIP fd00::10 is not IPv4"),
            ("- 10.1.0.2", "- fd00::2", "endpoint address fd00::2 is not IPv4"),
            ("protocol: UDP", "protocol: SCTP", "protocol SCTP is not supported"),
            ("- name: dns\n  port: 5353", "- name: domain\n  port: 5353", "no EndpointSlice port matches"),
            // What vipr's parser rejects.
            ("port: 53\n", "port: fifty-three\n", "Service shop/web"),
        ] {
            assert!(yaml.contains(from), "{from:?} is not in\n{yaml}");
            let message = format!("{:#}", parse(&yaml.replace(from, to)).unwrap_err());
            assert!(message.contains(error), "{from:?} -> {to:?}: {message}");
        }
        // Headless services have no VIP: they are left out, not refused.
        assert_eq!(parse(&yaml.replace("10.96.0.10", "None")).unwrap(), vec![]);
    }

    #[test]
    fn expected_backends_are_the_ready_endpoints_at_the_target_port() {
        let service = web();
        assert_eq!(service.expected_backends(&service.ports[1]), vec!["10.1.0.2:5353".parse().unwrap()]);
    }

    #[test]
    fn the_demo_manifest_is_a_service_with_endpoints() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/demo-services.yaml");
        let services = parse(&std::fs::read_to_string(path).unwrap()).unwrap();
        assert!(!services.is_empty(), "{path} defines no ClusterIP service");
        for service in &services {
            assert!(!service.ports.is_empty(), "{} has no ports", service.name);
            assert!(!service.endpoints.is_empty(), "{} has no endpoints", service.name);
        }
    }
}
