//! Desired state: what every frontend of every service does with a new connection.
//!
//! This is the only thing a dataplane sees. It is computed from Kubernetes objects by
//! [`kubernetes::desired_state`] with kube-proxy's semantics already applied (traffic
//! policies, terminating endpoints, masquerade rules), and knows nothing of maps, rules or
//! kernels; each dataplane turns it into its own representation.
//!
//! A dataplane classifies the source of a new connection ([`SourceClass`], from
//! [`DesiredState::sources`]) and applies the frontend's [`Treatment`] for that class. One
//! rule holds for every frontend and is left to the dataplane: a connection whose chosen
//! backend is its own source (a pod reaching itself through its service, "hairpin") is
//! masqueraded, or the pod would answer itself directly.
use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    net::IpAddr,
    sync::Arc,
    time::Duration,
};

use ipnet::IpNet;

/// The change tracker lives with the Kubernetes objects it holds; `model::changes` is its
/// short name.
pub use kubernetes::changes;
#[cfg(test)]
pub mod fixtures;
pub mod kubernetes;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Protocol {
    Tcp,
    Udp,
    Sctp,
}

impl Protocol {
    pub const ALL: [Self; 3] = [Self::Tcp, Self::Udp, Self::Sctp];

    /// The IP protocol number (IANA's, as in the IP header and `IPPROTO_*`).
    pub fn number(self) -> u8 {
        match self {
            Self::Tcp => 6,
            Self::Udp => 17,
            Self::Sctp => 132,
        }
    }

    /// The protocol of an IP protocol number, if it is one a Service can use.
    pub fn from_number(number: u8) -> Option<Self> {
        Self::ALL.into_iter().find(|protocol| protocol.number() == number)
    }

    /// The lower-case name the kernel's tools use (iptables `-p`, ipset, nft).
    pub fn lower_case(self) -> &'static str {
        match self {
            Self::Tcp => "tcp",
            Self::Udp => "udp",
            Self::Sctp => "sctp",
        }
    }

    /// The protocol of a lower-case name ([`Self::lower_case`]).
    pub fn from_lower_case(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|protocol| protocol.lower_case() == name)
    }

    /// The name Kubernetes gives it (`TCP`, `UDP`, `SCTP`).
    pub fn kubernetes_name(self) -> &'static str {
        match self {
            Self::Tcp => "TCP",
            Self::Udp => "UDP",
            Self::Sctp => "SCTP",
        }
    }

    /// Parses a Kubernetes protocol name; an absent protocol means TCP, as in the API.
    pub fn from_kubernetes(name: Option<&str>) -> Option<Self> {
        match name {
            None | Some("TCP") => Some(Self::Tcp),
            Some("UDP") => Some(Self::Udp),
            Some("SCTP") => Some(Self::Sctp),
            Some(_) => None,
        }
    }
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.kubernetes_name())
    }
}

/// An address, port and protocol on which a service is reached.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Frontend {
    pub ip: IpAddr,
    pub port: u16,
    pub protocol: Protocol,
}

impl fmt::Display for Frontend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", std::net::SocketAddr::new(self.ip, self.port), self.protocol)
    }
}

/// An endpoint address and port a frontend's connections are sent to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Backend {
    pub ip: IpAddr,
    pub port: u16,
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        std::net::SocketAddr::new(self.ip, self.port).fmt(f)
    }
}

/// Identity of one port of one service, as kube-proxy's `ServicePortName`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServicePortName {
    pub namespace: String,
    pub name: String,
    pub port: String,
    pub protocol: Protocol,
}

impl fmt::Display for ServicePortName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)?;
        if !self.port.is_empty() {
            write!(f, ":{}", self.port)?;
        }
        Ok(())
    }
}

/// How a frontend is reached; it decides which traffic policy applies.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FrontendKind {
    ClusterIp,
    ExternalIp,
    LoadBalancer,
    NodePort,
}

/// Who opened a connection, as far as service semantics care.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SourceClass {
    /// From a pod of this node, as the local-traffic detector tells: a source inside its
    /// CIDRs (`--cluster-cidr`, the Node's pod CIDRs), or a packet that entered through a pod
    /// interface ([`PodInterfaces`]).
    Pod,
    /// One of the node's own addresses.
    Node,
    /// Anything else.
    Outside,
}

/// What a frontend does when a treatment has no backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WhenEmpty {
    /// The service has no usable endpoint at all: tell the client (ICMP port unreachable,
    /// "connection refused").
    Reject,
    /// Endpoints exist, but none that this traffic policy allows from here: drop silently.
    Drop,
}

/// What happens to a new connection of one source class.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Treatment {
    /// Chosen uniformly for each new connection; sorted, without duplicates. Shared between
    /// treatments and frontends that use the same set.
    pub backends: Arc<[Backend]>,
    /// Used only when `backends` is empty.
    pub when_empty: WhenEmpty,
    /// Source NAT to the node's address toward the backend.
    pub masquerade: bool,
}

/// What one frontend does.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FrontendEntry {
    pub service: ServicePortName,
    pub kind: FrontendKind,
    pub from_pod: Treatment,
    pub from_node: Treatment,
    pub from_outside: Treatment,
    /// When not empty, connections from any other source are dropped
    /// (`loadBalancerSourceRanges`).
    pub allowed_sources: Vec<IpNet>,
    /// ClientIP session affinity: a client's new connections go to the backend of its
    /// previous one until it has been idle this long.
    pub affinity: Option<Duration>,
}

impl FrontendEntry {
    pub fn treatment(&self, class: SourceClass) -> &Treatment {
        match class {
            SourceClass::Pod => &self.from_pod,
            SourceClass::Node => &self.from_node,
            SourceClass::Outside => &self.from_outside,
        }
    }

    /// Every backend some source may reach, each once.
    pub fn all_backends(&self) -> BTreeSet<Backend> {
        [&self.from_pod, &self.from_node, &self.from_outside]
            .into_iter()
            .flat_map(|treatment| treatment.backends.iter().copied())
            .collect()
    }
}

/// The local-traffic detector by interface (kube-proxy's `--detect-local-mode`
/// `BridgeInterface` and `InterfaceNamePrefix`): pod traffic is what enters the node through
/// these interfaces, whatever its source address (both families).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PodInterfaces {
    /// `--pod-bridge-interface`: the bridge the node's pods are attached to. A packet that
    /// enters through one of its ports enters through the bridge.
    Bridge(String),
    /// `--pod-interface-name-prefix`: every interface whose name starts with it (the pods'
    /// host-side veths).
    NamePrefix(String),
}

impl PodInterfaces {
    /// Whether a packet that enters the node through interface `name`, a port of `master`
    /// (its bridge, if any), comes from a pod.
    pub fn admits(&self, name: &str, master: Option<&str>) -> bool {
        match self {
            Self::Bridge(bridge) => name == bridge || master == Some(bridge.as_str()),
            Self::NamePrefix(prefix) => name.starts_with(prefix.as_str()),
        }
    }
}

/// How a dataplane tells the [`SourceClass`] of a packet: its source address, and with an
/// interface detector the interface it entered through.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SourceClassifier {
    /// The local-traffic detector's CIDRs; empty when there is none (or it is by interface).
    pub pod_cidrs: Vec<IpNet>,
    /// The local-traffic detector's interfaces, when it tells pods by interface.
    pub pod_interfaces: Option<PodInterfaces>,
    /// The node's own addresses.
    pub node_ips: BTreeSet<IpAddr>,
}

impl SourceClassifier {
    /// The class of a packet from `source` that did not enter through a pod interface (with
    /// an interface detector an address alone never makes a pod).
    pub fn classify(&self, source: IpAddr) -> SourceClass {
        if self.node_ips.contains(&source) || source.is_loopback() {
            SourceClass::Node
        } else if self.pod_cidrs.iter().any(|cidr| cidr.contains(&source)) {
            SourceClass::Pod
        } else {
            SourceClass::Outside
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DesiredState {
    pub frontends: BTreeMap<Frontend, FrontendEntry>,
    /// Addresses that are service cluster IPs: a connection to one of them on a port and
    /// protocol no frontend serves is rejected, as kube-proxy's nftables mode does.
    pub cluster_ips: BTreeSet<IpAddr>,
    /// Service IP ranges: a connection to an address inside them that is no cluster IP is
    /// dropped, as kube-proxy's nftables mode does.
    pub service_cidrs: Vec<IpNet>,
    /// Every endpoint the EndpointSlices still list, whatever its conditions. Connections to
    /// a terminating endpoint run on until they close (graceful termination); connections to
    /// an endpoint that is no longer listed at all are to be broken off actively, so their
    /// clients learn of it at once instead of timing out.
    pub listed_endpoints: ListedEndpoints,
    pub sources: SourceClassifier,
    /// The health checks this node serves: every load balancer with
    /// `externalTrafficPolicy: Local` and a `healthCheckNodePort`, with its local ready
    /// endpoints. The agent's health servers answer them; a dataplane with a filter lets
    /// their ports through.
    pub health_checks: BTreeMap<ServiceName, HealthCheck>,
}

/// The endpoints the EndpointSlices list ([`DesiredState::listed_endpoints`]), shared rather than
/// copied with whoever must know them between syncs (the eBPF dataplane's flow reaper, on its
/// own thread): 100k endpoints are ~3 MiB, held once. Writing through it copies the set only while
/// another holder still has it (copy on write), which the holders keep short.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ListedEndpoints(Arc<BTreeSet<Backend>>);

impl ListedEndpoints {
    /// The set itself, for a holder on another thread.
    pub fn share(&self) -> Arc<BTreeSet<Backend>> {
        Arc::clone(&self.0)
    }
}

impl std::ops::Deref for ListedEndpoints {
    type Target = BTreeSet<Backend>;

    fn deref(&self) -> &BTreeSet<Backend> {
        &self.0
    }
}

impl std::ops::DerefMut for ListedEndpoints {
    fn deref_mut(&mut self) -> &mut BTreeSet<Backend> {
        Arc::make_mut(&mut self.0)
    }
}

impl FromIterator<Backend> for ListedEndpoints {
    fn from_iter<I: IntoIterator<Item = Backend>>(iter: I) -> Self {
        Self(Arc::new(iter.into_iter().collect()))
    }
}

/// A service's namespace and name.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ServiceName {
    pub namespace: String,
    pub name: String,
}

impl fmt::Display for ServiceName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// A service's health-check node port and how many ready endpoints it has on this node
/// (distinct addresses, so that an endpoint serving several ports counts once, as in
/// kube-proxy's `LocalReadyEndpoints`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HealthCheck {
    pub port: u16,
    pub local_endpoints: usize,
}

/// What differs between two generations of a [`DesiredState`], so that a dataplane can apply
/// only that. It names no dataplane concept: frontends, endpoints and whether the rest of the
/// state (cluster IPs, service ranges, source classes) changed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StateChanges {
    /// The generation these changes lead from; `None` when everything may have changed (the
    /// first translation, a new node context), and the dataplane must compare it all.
    pub since: Option<u64>,
    /// The generation they lead to.
    pub generation: u64,
    /// Frontends added, changed or removed.
    pub frontends: BTreeSet<Frontend>,
    /// `cluster_ips`, `service_cidrs` or `sources` changed.
    pub classifiers: bool,
    /// Endpoints that `listed_endpoints` gained or lost.
    pub listed_added: BTreeSet<Backend>,
    pub listed_removed: BTreeSet<Backend>,
    /// `health_checks` changed (a port, or a count of local endpoints).
    pub health_checks: bool,
}

impl StateChanges {
    /// Changes that make a dataplane compare everything.
    pub fn everything(generation: u64) -> Self {
        Self { since: None, generation, classifiers: true, health_checks: true, ..Self::default() }
    }
}

/// An IP family. Each dataplane spells it its own way (`iptables`/`ip6tables`, ipset's
/// `inet`/`inet6`, the eBPF maps of each family); this is the one the model and the
/// dataplanes share.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum IpFamily {
    Ipv4,
    Ipv6,
}

impl IpFamily {
    pub const ALL: [Self; 2] = [Self::Ipv4, Self::Ipv6];

    pub fn of(ip: IpAddr) -> Self {
        if ip.is_ipv4() {
            Self::Ipv4
        } else {
            Self::Ipv6
        }
    }

    pub fn of_net(net: &IpNet) -> Self {
        Self::of(net.addr())
    }
}
