//! The services file vipr reads: ClusterIP Services and their EndpointSlices.
//!
//! [`render`] writes the multi-document YAML that kubectl would show for a
//! [`ClusterIpService`]; [`parse`] reads such a file back (the demo takes its topology from
//! one). Only what the testbed needs is modelled: IPv4 ClusterIP services, one target port per
//! service port, endpoints with a readiness condition.

use std::{
    collections::BTreeMap,
    fmt::{self, Write as _},
    net::{Ipv4Addr, SocketAddr, SocketAddrV4},
};

use anyhow::{bail, Context, Result};
use serde::Deserialize;

/// The label that ties an EndpointSlice to its Service.
const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Protocol {
    Tcp,
    Udp,
}

impl Protocol {
    /// The IP protocol number, as in vipr's map keys.
    pub fn number(self) -> u8 {
        match self {
            Self::Tcp => proxy_common::proto::TCP,
            Self::Udp => proxy_common::proto::UDP,
        }
    }

    pub fn from_number(number: u8) -> Option<Self> {
        [Self::Tcp, Self::Udp].into_iter().find(|protocol| protocol.number() == number)
    }
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Tcp => "TCP",
            Self::Udp => "UDP",
        })
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

    fn render_into(&self, yaml: &mut String) -> fmt::Result {
        let Self { namespace, name, cluster_ip, .. } = self;
        write!(
            yaml,
            "apiVersion: v1\nkind: Service\nmetadata:\n  name: {name}\n  namespace: {namespace}\n\
             spec:\n  type: ClusterIP\n  clusterIP: {cluster_ip}\n  clusterIPs:\n  - {cluster_ip}\n  ports:\n"
        )?;
        for port in &self.ports {
            let ServicePort { name, protocol, port, target_port } = port;
            write!(
                yaml,
                "  - name: {name}\n    protocol: {protocol}\n    port: {port}\n    targetPort: {target_port}\n"
            )?;
        }
        write!(
            yaml,
            "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}-slice\n  \
             namespace: {namespace}\n  labels:\n    {SERVICE_NAME_LABEL}: {name}\naddressType: IPv4\nports:\n"
        )?;
        for port in &self.ports {
            write!(
                yaml,
                "- name: {}\n  protocol: {}\n  port: {}\n",
                port.name, port.protocol, port.target_port
            )?;
        }
        yaml.push_str(if self.endpoints.is_empty() { "endpoints: []\n" } else { "endpoints:\n" });
        for endpoint in &self.endpoints {
            write!(
                yaml,
                "- addresses:\n  - {}\n  conditions:\n    ready: {}\n",
                endpoint.addr, endpoint.ready
            )?;
            if let Some(pod) = &endpoint.pod {
                write!(yaml, "  targetRef:\n    kind: Pod\n    name: {pod}\n    namespace: {namespace}\n")?;
            }
        }
        Ok(())
    }
}

/// The services file for `services`: each Service followed by its EndpointSlice.
pub fn render(services: &[ClusterIpService]) -> String {
    let mut yaml = String::new();
    for service in services {
        if !yaml.is_empty() {
            yaml.push_str("---\n");
        }
        service.render_into(&mut yaml).expect("writing to a String cannot fail");
    }
    yaml
}

/// Reads a services file: ClusterIP Services, joined with the EndpointSlices labelled with
/// their name; other kinds of document are ignored.
pub fn parse(yaml: &str) -> Result<Vec<ClusterIpService>> {
    let mut services = Vec::new();
    let mut slices = Vec::new();
    for document in serde_yaml::Deserializer::from_str(yaml) {
        let value = serde_yaml::Value::deserialize(document).context("invalid YAML")?;
        match value.get("kind").and_then(|kind| kind.as_str()) {
            Some("Service") => {
                services.push(serde_yaml::from_value::<k8s::Service>(value).context("invalid Service")?)
            }
            Some("EndpointSlice") => slices
                .push(serde_yaml::from_value::<k8s::EndpointSlice>(value).context("invalid EndpointSlice")?),
            _ => {}
        }
    }
    services
        .into_iter()
        // Headless services (clusterIP None) have no VIP to balance.
        .filter(|service| matches!(service.spec.cluster_ip.as_deref(), Some(ip) if ip != "None"))
        .map(|service| join(service, &slices))
        .collect()
}

fn join(service: k8s::Service, slices: &[k8s::EndpointSlice]) -> Result<ClusterIpService> {
    let k8s::Metadata { name, namespace, .. } = service.metadata;
    let slices: Vec<_> = slices
        .iter()
        .filter(|slice| {
            slice.metadata.namespace == namespace
                && slice.metadata.labels.get(SERVICE_NAME_LABEL) == Some(&name)
        })
        .collect();
    let cluster_ip = service.spec.cluster_ip.unwrap_or_default();
    let cluster_ip: Ipv4Addr =
        cluster_ip.parse().with_context(|| format!("service {name}: clusterIP {cluster_ip} is not IPv4"))?;
    let ports = service
        .spec
        .ports
        .into_iter()
        .map(|port| {
            let target_ports: Vec<u16> = slices
                .iter()
                .flat_map(|slice| &slice.ports)
                .filter(|slice_port| slice_port.name == port.name && slice_port.protocol == port.protocol)
                .map(|slice_port| slice_port.port)
                .collect();
            let Some(&target_port) = target_ports.first() else {
                bail!("service {name}: no EndpointSlice port matches port {:?}", port.name);
            };
            if target_ports.iter().any(|&other| other != target_port) {
                bail!("service {name}: EndpointSlices disagree on port {:?}", port.name);
            }
            Ok(ServicePort { name: port.name, protocol: port.protocol, port: port.port, target_port })
        })
        .collect::<Result<_>>()?;
    let endpoints = slices
        .iter()
        .flat_map(|slice| &slice.endpoints)
        .flat_map(|endpoint| {
            endpoint.addresses.iter().map(move |addr| {
                Ok(Endpoint {
                    addr: addr.parse().with_context(|| format!("endpoint address {addr} is not IPv4"))?,
                    // Kubernetes reads an absent readiness as ready.
                    ready: endpoint.conditions.ready.unwrap_or(true),
                    pod: endpoint.target_ref.as_ref().map(|target| target.name.clone()),
                })
            })
        })
        .collect::<Result<_>>()?;
    Ok(ClusterIpService { namespace, name, cluster_ip, ports, endpoints })
}

/// The parts of the Kubernetes objects that [`parse`] reads.
mod k8s {
    use std::collections::BTreeMap;

    use serde::Deserialize;

    use super::Protocol;

    #[derive(Deserialize)]
    pub struct Metadata {
        pub name: String,
        #[serde(default = "default_namespace")]
        pub namespace: String,
        #[serde(default)]
        pub labels: BTreeMap<String, String>,
    }

    fn default_namespace() -> String {
        "default".to_owned()
    }

    fn tcp() -> Protocol {
        Protocol::Tcp
    }

    #[derive(Deserialize)]
    pub struct Service {
        pub metadata: Metadata,
        pub spec: ServiceSpec,
    }

    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    pub struct ServiceSpec {
        #[serde(rename = "clusterIP")]
        pub cluster_ip: Option<String>,
        #[serde(default)]
        pub ports: Vec<ServicePort>,
    }

    #[derive(Deserialize)]
    pub struct ServicePort {
        #[serde(default)]
        pub name: String,
        #[serde(default = "tcp")]
        pub protocol: Protocol,
        pub port: u16,
    }

    #[derive(Deserialize)]
    pub struct EndpointSlice {
        pub metadata: Metadata,
        #[serde(default)]
        pub ports: Vec<SlicePort>,
        #[serde(default)]
        pub endpoints: Vec<Endpoint>,
    }

    #[derive(Deserialize)]
    pub struct SlicePort {
        #[serde(default)]
        pub name: String,
        #[serde(default = "tcp")]
        pub protocol: Protocol,
        pub port: u16,
    }

    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    pub struct Endpoint {
        pub addresses: Vec<String>,
        #[serde(default)]
        pub conditions: Conditions,
        pub target_ref: Option<TargetRef>,
    }

    #[derive(Default, Deserialize)]
    pub struct Conditions {
        pub ready: Option<bool>,
    }

    #[derive(Deserialize)]
    pub struct TargetRef {
        pub name: String,
    }
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
        let mut other = web();
        other.name = "empty".to_owned();
        other.cluster_ip = Ipv4Addr::new(10, 96, 0, 11);
        other.endpoints.clear();
        let services = vec![web(), other];
        assert_eq!(parse(&render(&services)).unwrap(), services);
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
