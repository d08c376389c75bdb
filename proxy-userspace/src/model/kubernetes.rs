//! Kubernetes Services and EndpointSlices -> [`DesiredState`], with kube-proxy's semantics.
//!
//! An object that the API server would not have accepted (bad IP, port out of range, unknown
//! protocol, duplicate ports, ...) is rejected as a whole and reported; every other object is
//! still applied, so one bad manifest cannot take down the services beside it.
use std::{
    collections::{BTreeMap, BTreeSet, HashSet},
    fmt,
    net::IpAddr,
};

use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};

use super::{Backend, DesiredState, Frontend, FrontendEntry, Protocol, ServicePortName};

/// The label that ties an EndpointSlice to its Service.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

/// The node vipr runs on; endpoint locality and traffic policies are decided against it.
#[derive(Clone, Debug, Default)]
pub struct NodeContext {
    pub name: String,
}

/// An object left out of the desired state, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rejection {
    /// `Kind namespace/name`.
    pub object: String,
    pub reason: String,
}

impl fmt::Display for Rejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.object, self.reason)
    }
}

/// The desired state plus every object that could not be used.
#[derive(Clone, Debug, Default)]
pub struct Translation {
    pub state: DesiredState,
    pub rejected: Vec<Rejection>,
}

/// One port of a service, validated.
#[derive(Clone, Debug)]
struct ServicePortSpec {
    name: ServicePortName,
    cluster_ips: Vec<IpAddr>,
    port: u16,
}

/// One endpoint of a slice, validated, for one slice port.
#[derive(Clone, Debug)]
struct EndpointSpec {
    ip: IpAddr,
    port: u16,
    ready: bool,
}

pub fn desired_state(services: &[Service], slices: &[EndpointSlice], _node: &NodeContext) -> Translation {
    let mut rejected = Vec::new();
    let mut ports = Vec::new();
    for service in services {
        match service_ports(service) {
            Ok(service_ports) => ports.extend(service_ports),
            Err(reason) => {
                rejected.push(Rejection { object: describe("Service", &service.metadata), reason })
            }
        }
    }
    let mut endpoints: BTreeMap<ServicePortName, Vec<EndpointSpec>> = BTreeMap::new();
    for slice in slices {
        match slice_endpoints(slice) {
            Ok(by_port) => {
                for (name, found) in by_port {
                    endpoints.entry(name).or_default().extend(found);
                }
            }
            Err(reason) => {
                rejected.push(Rejection { object: describe("EndpointSlice", &slice.metadata), reason })
            }
        }
    }

    let mut state = DesiredState::default();
    // Deterministic order, so that when two services claim one frontend the same one wins on
    // every node and every sync.
    ports.sort_by(|a, b| a.name.cmp(&b.name));
    for port in ports {
        let backends = usable_backends(endpoints.get(&port.name).map(Vec::as_slice).unwrap_or_default());
        for ip in &port.cluster_ips {
            let frontend = Frontend { ip: *ip, port: port.port, protocol: port.name.protocol };
            if let Some(owner) = state.frontends.get(&frontend) {
                rejected.push(Rejection {
                    object: format!("Service {}/{}", port.name.namespace, port.name.name),
                    reason: format!("frontend {frontend} is already served by {}", owner.service),
                });
                continue;
            }
            state
                .frontends
                .insert(frontend, FrontendEntry { service: port.name.clone(), backends: backends.clone() });
        }
    }
    Translation { state, rejected }
}

/// kube-proxy uses ready endpoints; duplicates (one endpoint listed by several slices) count
/// once.
fn usable_backends(endpoints: &[EndpointSpec]) -> Vec<Backend> {
    let set: BTreeSet<Backend> = endpoints
        .iter()
        .filter(|endpoint| endpoint.ready)
        .map(|endpoint| Backend { ip: endpoint.ip, port: endpoint.port })
        .collect();
    set.into_iter().collect()
}

fn describe(kind: &str, metadata: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> String {
    format!(
        "{kind} {}/{}",
        metadata.namespace.as_deref().unwrap_or("default"),
        metadata.name.as_deref().unwrap_or("<unnamed>")
    )
}

fn identity(
    metadata: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
) -> Result<(String, String), String> {
    let name = metadata.name.clone().filter(|name| !name.is_empty()).ok_or("metadata.name is missing")?;
    Ok((metadata.namespace.clone().unwrap_or_else(|| "default".into()), name))
}

fn port_number(port: i32, field: &str) -> Result<u16, String> {
    u16::try_from(port)
        .ok()
        .filter(|port| *port != 0)
        .ok_or_else(|| format!("{field} {port} is not a port (1-65535)"))
}

fn protocol(name: Option<&str>, field: &str) -> Result<Protocol, String> {
    Protocol::from_kubernetes(name)
        .ok_or_else(|| format!("{field} {:?} is not TCP, UDP or SCTP", name.unwrap_or_default()))
}

/// The ports of a service that kube-proxy would program, or why the service is unusable.
/// Services without a cluster IP (headless, ExternalName) have none and are not an error.
fn service_ports(service: &Service) -> Result<Vec<ServicePortSpec>, String> {
    let (namespace, name) = identity(&service.metadata)?;
    let spec = service.spec.as_ref().ok_or("spec is missing")?;
    if spec.type_.as_deref() == Some("ExternalName") {
        return Ok(Vec::new());
    }
    let addresses = match &spec.cluster_ips {
        Some(ips) if !ips.is_empty() => ips.clone(),
        _ => spec.cluster_ip.iter().cloned().collect(),
    };
    if addresses.iter().all(|address| address.is_empty() || address == "None") {
        return Ok(Vec::new());
    }
    let cluster_ips = addresses
        .iter()
        .map(|address| {
            address.parse::<IpAddr>().map_err(|_| format!("cluster IP {address:?} is not an IP address"))
        })
        .collect::<Result<Vec<_>, _>>()?;

    let mut seen = HashSet::new();
    let mut ports = Vec::new();
    for (index, port) in spec.ports.iter().flatten().enumerate() {
        let field = format!("spec.ports[{index}]");
        let number = port_number(port.port, &format!("{field}.port"))?;
        let protocol = protocol(port.protocol.as_deref(), &format!("{field}.protocol"))?;
        let port_name = port.name.clone().unwrap_or_default();
        if !seen.insert((number, protocol)) {
            return Err(format!("{field}: port {number}/{protocol} is listed twice"));
        }
        ports.push(ServicePortSpec {
            name: ServicePortName {
                namespace: namespace.clone(),
                name: name.clone(),
                port: port_name,
                protocol,
            },
            cluster_ips: cluster_ips.clone(),
            port: number,
        });
    }
    let mut names = HashSet::new();
    if let Some(duplicate) = ports.iter().find(|port| !names.insert(&port.name)) {
        return Err(format!(
            "port name {:?} is used twice for {}",
            duplicate.name.port, duplicate.name.protocol
        ));
    }
    Ok(ports)
}

/// The endpoints of a slice grouped by the service port they belong to.
fn slice_endpoints(slice: &EndpointSlice) -> Result<Vec<(ServicePortName, Vec<EndpointSpec>)>, String> {
    let (namespace, _) = identity(&slice.metadata)?;
    let service = slice
        .metadata
        .labels
        .as_ref()
        .and_then(|labels| labels.get(SERVICE_NAME_LABEL))
        .filter(|name| !name.is_empty())
        .ok_or_else(|| format!("label {SERVICE_NAME_LABEL} is missing"))?
        .clone();
    match slice.address_type.as_str() {
        "IPv4" | "IPv6" => {}
        // kube-proxy ignores FQDN slices: they have no addresses to balance to.
        "FQDN" => return Ok(Vec::new()),
        other => return Err(format!("addressType {other:?} is not IPv4, IPv6 or FQDN")),
    }

    let mut addresses = Vec::new();
    for (index, endpoint) in slice.endpoints.iter().enumerate() {
        let address =
            endpoint.addresses.first().ok_or_else(|| format!("endpoints[{index}] has no address"))?;
        let ip: IpAddr = address
            .parse()
            .map_err(|_| format!("endpoints[{index}].addresses[0] {address:?} is not an IP address"))?;
        if ip.is_ipv4() != (slice.address_type == "IPv4") {
            return Err(format!(
                "endpoints[{index}] address {ip} is not of addressType {}",
                slice.address_type
            ));
        }
        // Unset conditions mean ready, as the API documents.
        let ready = endpoint.conditions.as_ref().and_then(|conditions| conditions.ready).unwrap_or(true);
        addresses.push((ip, ready));
    }

    let mut by_port = Vec::new();
    for (index, port) in slice.ports.iter().flatten().enumerate() {
        let field = format!("ports[{index}]");
        let Some(number) = port.port else {
            // A port without a number is "all ports", which kube-proxy cannot program.
            continue;
        };
        let number = port_number(number, &format!("{field}.port"))?;
        let protocol = protocol(port.protocol.as_deref(), &format!("{field}.protocol"))?;
        let name = ServicePortName {
            namespace: namespace.clone(),
            name: service.clone(),
            port: port.name.clone().unwrap_or_default(),
            protocol,
        };
        let endpoints = addresses
            .iter()
            .map(|(ip, ready)| EndpointSpec { ip: *ip, port: number, ready: *ready })
            .collect();
        by_port.push((name, endpoints));
    }
    Ok(by_port)
}

#[cfg(test)]
mod tests;
