//! Services and EndpointSlices as vipr holds them: decoded once, at the source, into what the
//! translation reads, and nothing else.
//!
//! A k8s-openapi `Service` or `EndpointSlice` carries every field of the API (labels,
//! annotations, status conditions, a dozen optional spec fields, every address as a string);
//! the change tracker holds one object per Service and slice of the cluster, so the decoded
//! form is what sets the agent's memory. A [`ServiceObject`] keeps the object's identity and
//! version (namespace, name, uid, resourceVersion), its health-check node port and its
//! validated ports with the service-wide settings they share (cluster IPs, external IPs,
//! load-balancer ingress, source ranges, traffic policies, affinity, age); a [`SliceObject`]
//! keeps its identity and version, its service's name, its family, the trigger time of its
//! last change and its validated ports and endpoints (address, conditions, node name, hints).
//! Addresses are `IpAddr`s, names boxed strings; an endpoint's node name is shared with the
//! other endpoints of its slice on the same node.
//!
//! Validation happens here too, with the same messages as before: an object the API server
//! would have refused keeps its identity and the reason it is unusable, so the translation
//! reports it and uses the rest (a Service's health-check node port still counts; a slice's
//! label still ties it to its service).
use std::{net::IpAddr, sync::Arc, time::SystemTime};

use k8s_openapi::{
    api::{core::v1::Service, discovery::v1::EndpointSlice},
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};

use super::NodeContext;
use super::{
    health_check_node_port, kubernetes_name, port_name, port_number, protocol, service_ports, EndpointSpec,
    ServicePortSpec, SERVICE_NAME_LABEL,
};
use crate::model::{Backend, Protocol, ServicePortName};

/// The annotation in which the EndpointSlice controller records when the change that
/// triggered this version of the slice happened (a pod became ready, ...).
pub const LAST_CHANGE_TRIGGER_TIME: &str = "endpoints.kubernetes.io/last-change-trigger-time";

/// What identifies an object and its version.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Meta {
    /// "default" when the object has none, as the API server defaults it.
    pub(crate) namespace: Arc<str>,
    /// Shared with the change tracker's key ([`Self::key`]).
    pub(crate) name: Option<Arc<str>>,
    pub(crate) uid: Option<Box<str>>,
    pub(crate) resource_version: Option<Box<str>>,
}

impl Meta {
    fn of(metadata: &ObjectMeta) -> Self {
        Self {
            namespace: metadata.namespace.as_deref().unwrap_or("default").into(),
            name: metadata.name.as_deref().map(Into::into),
            uid: metadata.uid.as_deref().map(Into::into),
            resource_version: metadata.resource_version.as_deref().map(Into::into),
        }
    }

    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// The name ("" when the object has none).
    pub fn name(&self) -> &str {
        self.name.as_deref().unwrap_or_default()
    }

    pub fn uid(&self) -> Option<&str> {
        self.uid.as_deref()
    }

    pub fn resource_version(&self) -> Option<&str> {
        self.resource_version.as_deref()
    }

    /// The change tracker's key: namespace and name, sharing the names rather than copying them.
    pub fn key(&self) -> (Arc<str>, Arc<str>) {
        (Arc::clone(&self.namespace), self.name.clone().unwrap_or_else(|| "".into()))
    }

    /// A new identity and version (the object deleted and created again), for tests.
    pub fn set_version(&mut self, uid: Option<&str>, resource_version: Option<&str>) {
        self.uid = uid.map(Into::into);
        self.resource_version = resource_version.map(Into::into);
    }

    /// `Kind namespace/name`, as rejections name objects.
    pub(crate) fn describe(&self, kind: &str) -> String {
        format!("{kind} {}/{}", self.namespace, self.name.as_deref().unwrap_or("<unnamed>"))
    }

    /// Namespace and name as the API server would have accepted them.
    pub(crate) fn identity(&self) -> Result<(String, String), String> {
        let name = self.name.as_deref().filter(|name| !name.is_empty()).ok_or("metadata.name is missing")?;
        kubernetes_name(&self.namespace, 63, "metadata.namespace")?;
        Ok((self.namespace.to_string(), name.to_owned()))
    }
}

/// A Service as vipr holds it.
#[derive(Clone, Debug, PartialEq)]
pub struct ServiceObject {
    pub(crate) meta: Meta,
    /// `spec.healthCheckNodePort` when kube-proxy's rule serves it (a load balancer with
    /// `externalTrafficPolicy: Local`), whether or not the rest of the Service is usable.
    pub(crate) health_check_node_port: Option<u16>,
    /// The ports kube-proxy would program (none for a headless or ExternalName Service), or
    /// why the Service is unusable.
    pub(crate) ports: Result<Box<[ServicePortSpec]>, Box<str>>,
}

impl ServiceObject {
    pub fn decode(service: &Service) -> Self {
        Self {
            meta: Meta::of(&service.metadata),
            health_check_node_port: health_check_node_port(service),
            ports: service_ports(service).map(Vec::into_boxed_slice).map_err(String::into_boxed_str),
        }
    }

    pub fn meta(&self) -> &Meta {
        &self.meta
    }

    /// Why the Service is unusable, if it is.
    pub fn invalid(&self) -> Option<&str> {
        self.ports.as_ref().err().map(|reason| &**reason)
    }

    /// The cluster IPs it is served on (none when it is unusable or headless).
    pub fn cluster_ips(&self) -> &[IpAddr] {
        match self.ports.as_deref() {
            Ok([first, ..]) => &first.service.cluster_ips,
            _ => &[],
        }
    }
}

/// An EndpointSlice as vipr holds it.
#[derive(Clone, Debug, PartialEq)]
pub struct SliceObject {
    pub(crate) meta: Meta,
    /// Its `kubernetes.io/service-name` label as written (the change tracker indexes the
    /// slice under it even when the slice is unusable).
    pub(crate) service: Option<Box<str>>,
    /// `addressType: IPv6` (kube-proxy counts each family's changes apart).
    pub(crate) ipv6: bool,
    /// `endpoints.kubernetes.io/last-change-trigger-time`, when it parses.
    pub(crate) trigger_time: Option<SystemTime>,
    /// Its ports and endpoints, or why the slice is unusable.
    pub(crate) content: Result<SliceContent, Box<str>>,
}

/// What a usable slice lists.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SliceContent {
    pub(crate) ports: Box<[SlicePort]>,
    pub(crate) endpoints: Box<[Endpoint]>,
}

/// One port of a slice (ports without a number, "all ports", are left out: kube-proxy cannot
/// program them).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlicePort {
    pub(crate) name: Box<str>,
    pub(crate) protocol: Protocol,
    pub(crate) port: u16,
}

/// One endpoint of a slice: its first address, its conditions (unset ones read as ready,
/// serving and not terminating, as kube-proxy reads them), its node and its topology hints.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoint {
    pub(crate) ip: IpAddr,
    pub(crate) ready: bool,
    pub(crate) serving: bool,
    pub(crate) terminating: bool,
    /// Shared by the slice's endpoints on one node.
    pub(crate) node_name: Option<Arc<str>>,
    /// Rare: most endpoints carry none.
    pub(crate) hints: Option<Arc<Hints>>,
}

/// The nodes and zones the EndpointSlice controller hints an endpoint for (`forNodes`, set
/// for `trafficDistribution: PreferSameNode`; `forZones`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Hints {
    pub(crate) nodes: Box<[Box<str>]>,
    pub(crate) zones: Box<[Box<str>]>,
}

impl SliceObject {
    pub fn decode(slice: &EndpointSlice) -> Self {
        let labels = slice.metadata.labels.as_ref();
        let trigger_time = slice
            .metadata
            .annotations
            .as_ref()
            .and_then(|annotations| annotations.get(LAST_CHANGE_TRIGGER_TIME))
            .and_then(|text| text.parse::<jiff::Timestamp>().ok())
            .map(SystemTime::from);
        let meta = Meta::of(&slice.metadata);
        Self {
            service: labels
                .and_then(|labels| labels.get(SERVICE_NAME_LABEL))
                .map(|name| name.as_str().into()),
            ipv6: slice.address_type == "IPv6",
            trigger_time,
            content: slice_content(&meta, slice).map_err(String::into_boxed_str),
            meta,
        }
    }

    pub fn meta(&self) -> &Meta {
        &self.meta
    }

    /// Why the slice is unusable, if it is.
    pub fn invalid(&self) -> Option<&str> {
        self.content.as_ref().err().map(|reason| &**reason)
    }

    /// The endpoints' addresses (none when the slice is unusable).
    pub fn addresses(&self) -> impl Iterator<Item = IpAddr> + '_ {
        self.content.iter().flat_map(|content| content.endpoints.iter().map(|endpoint| endpoint.ip))
    }

    /// The endpoints grouped by the service port they belong to, as this node sees them, or
    /// why the slice is unusable.
    pub(crate) fn endpoints(
        &self,
        node: &NodeContext,
    ) -> Result<Vec<(ServicePortName, Vec<EndpointSpec>)>, &str> {
        let content = self.content.as_ref().map_err(|reason| &**reason)?;
        let endpoints: Vec<EndpointSpec> = content
            .endpoints
            .iter()
            .map(|endpoint| EndpointSpec {
                backend: Backend { ip: endpoint.ip, port: 0 },
                ready: endpoint.ready,
                serving: endpoint.serving,
                terminating: endpoint.terminating,
                local: endpoint.node_name.as_deref() == Some(node.name.as_str()),
                hints: endpoint.hints.clone(),
            })
            .collect();
        Ok(content
            .ports
            .iter()
            .map(|port| {
                let name = ServicePortName {
                    namespace: self.meta.namespace.to_string(),
                    // A usable slice has the label.
                    name: self.service.as_deref().unwrap_or_default().to_owned(),
                    port: port.name.to_string(),
                    protocol: port.protocol,
                };
                let with_port = endpoints
                    .iter()
                    .map(|endpoint| EndpointSpec {
                        backend: Backend { port: port.port, ..endpoint.backend },
                        ..endpoint.clone()
                    })
                    .collect();
                (name, with_port)
            })
            .collect())
    }
}

/// A slice's ports and endpoints, validated as the API server validates them.
fn slice_content(meta: &Meta, slice: &EndpointSlice) -> Result<SliceContent, String> {
    meta.identity()?;
    slice
        .metadata
        .labels
        .as_ref()
        .and_then(|labels| labels.get(SERVICE_NAME_LABEL))
        .filter(|name| !name.is_empty())
        .ok_or_else(|| format!("label {SERVICE_NAME_LABEL} is missing"))?;
    match slice.address_type.as_str() {
        "IPv4" | "IPv6" => {}
        // kube-proxy ignores FQDN slices: they have no addresses to balance to.
        "FQDN" => return Ok(SliceContent::default()),
        other => return Err(format!("addressType {other:?} is not IPv4, IPv6 or FQDN")),
    }

    // The slice's node names, each held once.
    let mut nodes: Vec<Arc<str>> = Vec::new();
    let mut endpoints = Vec::with_capacity(slice.endpoints.len());
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
        let node_name =
            endpoint.node_name.as_deref().map(|name| match nodes.iter().find(|known| &***known == name) {
                Some(known) => known.clone(),
                None => {
                    let new: Arc<str> = name.into();
                    nodes.push(new.clone());
                    new
                }
            });
        let hints = endpoint.hints.as_ref().and_then(|hints| {
            let nodes: Box<[Box<str>]> =
                hints.for_nodes.iter().flatten().map(|node| node.name.as_str().into()).collect();
            let zones: Box<[Box<str>]> =
                hints.for_zones.iter().flatten().map(|zone| zone.name.as_str().into()).collect();
            (!nodes.is_empty() || !zones.is_empty()).then(|| Arc::new(Hints { nodes, zones }))
        });
        let conditions = endpoint.conditions.as_ref();
        endpoints.push(Endpoint {
            ip,
            ready: conditions.and_then(|c| c.ready).unwrap_or(true),
            serving: conditions.and_then(|c| c.serving).unwrap_or(true),
            terminating: conditions.and_then(|c| c.terminating).unwrap_or(false),
            node_name,
            hints,
        });
    }

    let mut ports = Vec::new();
    for (index, port) in slice.ports.iter().flatten().enumerate() {
        let field = format!("ports[{index}]");
        let Some(number) = port.port else {
            // A port without a number is "all ports", which kube-proxy cannot program.
            continue;
        };
        ports.push(SlicePort {
            port: port_number(number, &format!("{field}.port"))?,
            protocol: protocol(port.protocol.as_deref(), &format!("{field}.protocol"))?,
            name: port_name(port.name.as_deref(), &format!("{field}.name"))?.into_boxed_str(),
        });
    }
    Ok(SliceContent { ports: ports.into_boxed_slice(), endpoints: endpoints.into_boxed_slice() })
}

#[cfg(test)]
mod tests;
