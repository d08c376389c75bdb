//! Kubernetes Services and EndpointSlices -> [`DesiredState`], with kube-proxy's semantics.
//!
//! The rules follow kube-proxy's `CategorizeEndpoints` and its nftables proxier (where the
//! iptables and nftables proxiers differ, vipr follows nftables; docs/conformance.md lists
//! the differences):
//! - cluster endpoints are the ready ones, or if there are none the serving-and-terminating
//!   ones; local endpoints likewise among those on this node; not-serving ones never;
//! - `internalTrafficPolicy: Local` sends cluster-IP traffic to local endpoints only;
//!   `externalTrafficPolicy: Local` sends traffic from outside the cluster to NodePorts,
//!   external IPs and load-balancer IPs to local endpoints only and unmasqueraded, while pods
//!   and the node itself are short-circuited to the cluster endpoints (the node masqueraded);
//! - no usable endpoint anywhere rejects; endpoints only elsewhere (Local policies) drop;
//! - cluster-IP traffic is masqueraded unless the local-traffic detector says it comes from a
//!   pod (or always with `--masquerade-all`); other frontends masquerade unless the Local
//!   external policy applies.
//!
//! An object that the API server would not have accepted (bad IP, port out of range, unknown
//! protocol, duplicate ports, ...) is rejected as a whole and reported; every other object is
//! still applied, so one bad manifest cannot take down the services beside it. Objects are
//! otherwise taken as they are, without the API server's defaulting. Special addresses
//! (unspecified, loopback, link-local, multicast, broadcast, IPv4-mapped IPv6) are never
//! service addresses, as the API server's own validation of external IPs says.
//!
//! When several services claim one address:port:protocol, one wins on every node and every
//! sync, and the others are reported ([`ClaimRank`]): a cluster IP beats another service's
//! external or load-balancer IP, so a tenant cannot take cluster DNS with an external IP
//! (CVE-2020-8554); among equals the older object wins. A node address may be an external or
//! load-balancer IP, but not on a port vipr itself serves there (its health and metrics
//! servers, every health-check node port): a tenant's service must not answer the node's own
//! health checks.
use std::{
    collections::{BTreeMap, BTreeSet, HashSet},
    fmt,
    net::IpAddr,
    sync::Arc,
    time::Duration,
};

use ipnet::IpNet;
use k8s_openapi::{
    api::{core::v1::Service, discovery::v1::EndpointSlice, networking::v1::ServiceCIDR},
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};

use self::objects::{Hints, ServiceObject, SliceObject};
use super::{
    Backend, DesiredState, Frontend, FrontendEntry, FrontendKind, HealthCheck, PodInterfaces, Protocol,
    ServiceName, ServicePortName, SourceClassifier, Treatment, WhenEmpty,
};

/// The label that ties an EndpointSlice to its Service.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

/// kube-proxy's default ClientIP affinity timeout (the API's default, 3 hours).
const DEFAULT_AFFINITY_TIMEOUT: Duration = Duration::from_secs(10_800);

/// The node vipr runs on and the proxy settings that shape its semantics.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeContext {
    pub name: String,
    /// The node's `topology.kubernetes.io/zone`, for zone hints.
    pub zone: Option<String>,
    /// The local-traffic detector (`--cluster-cidr`): sources inside are pods. Empty: no
    /// detector (unless it is by interface).
    pub cluster_cidrs: Vec<IpNet>,
    /// The local-traffic detector by interface: packets entering through them are pods'.
    pub pod_interfaces: Option<PodInterfaces>,
    /// `--masquerade-all`: masquerade all cluster-IP traffic.
    pub masquerade_all: bool,
    /// The node's addresses (every family; loopback excluded).
    pub node_ips: BTreeSet<IpAddr>,
    /// The node's primary address per family; a load balancer's source ranges that contain it
    /// also admit the load-balancer IPs as sources.
    pub primary_ips: Vec<IpAddr>,
    /// The addresses on which NodePorts are served (resolved from `--nodeport-addresses`).
    pub node_port_ips: BTreeSet<IpAddr>,
    /// Service IP ranges; addresses inside them that are no cluster IP are dropped.
    pub service_cidrs: Vec<IpNet>,
    /// TCP ports vipr's own servers (health, metrics) listen on at the node's addresses.
    pub own_ports: BTreeSet<u16>,
    /// NodePorts are also served on 127.0.0.1 to the node's own processes, as kube-proxy's
    /// iptables mode does (`--iptables-localhost-nodeports`); IPv6 has no such thing.
    pub localhost_node_ports: bool,
}

/// What the agent knows about the node, before [`NodeContext::resolve`] applies the proxy
/// settings to it.
#[derive(Clone, Debug, Default)]
pub struct NodeFacts {
    pub name: String,
    /// The Node object's `topology.kubernetes.io/zone` label.
    pub zone: Option<String>,
    /// The node's interface addresses, in the kernel's order; loopback ones are ignored.
    pub addresses: Vec<IpAddr>,
    /// Primary node IPs if known (`--bind-address`, or the Node object); otherwise the first
    /// usable address of each family.
    pub primary_ips: Vec<IpAddr>,
}

/// The proxy settings that shape the semantics, as kube-proxy's flags.
#[derive(Clone, Debug, Default)]
pub struct ProxySettings {
    pub cluster_cidrs: Vec<IpNet>,
    pub pod_interfaces: Option<PodInterfaces>,
    pub masquerade_all: bool,
    /// `--nodeport-addresses`; empty means the primary node IPs (kube-proxy's nftables
    /// default).
    pub node_port_cidrs: Vec<IpNet>,
    pub service_cidrs: Vec<IpNet>,
    /// TCP ports vipr's own servers (health, metrics) listen on at the node's addresses.
    pub own_ports: BTreeSet<u16>,
    /// Serve NodePorts on 127.0.0.1 to the node's own processes.
    pub localhost_node_ports: bool,
}

impl NodeContext {
    pub fn resolve(facts: &NodeFacts, settings: &ProxySettings) -> Self {
        let node_ips: BTreeSet<IpAddr> = facts
            .addresses
            .iter()
            .copied()
            .filter(|ip| !ip.is_loopback() && !ip.is_unspecified() && !is_ipv6_link_local(ip))
            .collect();
        let primary_ips = if facts.primary_ips.is_empty() {
            // The first usable address of each family, in the order the interfaces list them.
            let first = |v4: bool| {
                facts.addresses.iter().copied().find(|ip| node_ips.contains(ip) && ip.is_ipv4() == v4)
            };
            [first(true), first(false)].into_iter().flatten().collect()
        } else {
            facts.primary_ips.clone()
        };
        let node_port_ips = if settings.node_port_cidrs.is_empty() {
            primary_ips.iter().copied().collect()
        } else {
            node_ips
                .iter()
                .copied()
                .filter(|ip| settings.node_port_cidrs.iter().any(|cidr| cidr.contains(ip)))
                .collect()
        };
        Self {
            name: facts.name.clone(),
            zone: facts.zone.clone(),
            cluster_cidrs: settings.cluster_cidrs.clone(),
            pod_interfaces: settings.pod_interfaces.clone(),
            masquerade_all: settings.masquerade_all,
            node_ips,
            primary_ips,
            node_port_ips,
            service_cidrs: settings.service_cidrs.clone(),
            own_ports: settings.own_ports.clone(),
            localhost_node_ports: settings.localhost_node_ports,
        }
    }
}

impl NodeContext {
    /// How the dataplanes tell sources apart on this node.
    pub fn source_classifier(&self) -> SourceClassifier {
        SourceClassifier {
            pod_cidrs: self.cluster_cidrs.clone(),
            pod_interfaces: self.pod_interfaces.clone(),
            node_ips: self.node_ips.clone(),
        }
    }
}

fn is_ipv6_link_local(ip: &IpAddr) -> bool {
    matches!(ip, IpAddr::V6(v6) if v6.segments()[0] & 0xffc0 == 0xfe80)
}

/// An object left out of the desired state, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rejection {
    /// `Kind namespace/name`.
    pub object: String,
    pub reason: String,
}

/// How a [`Rejection`] says another Service already has the frontend ([`lost_claim`]).
const ALREADY_SERVED: &str = "is already served by";

impl Rejection {
    /// Whether another Service won the frontend this object asked for.
    pub fn is_frontend_conflict(&self) -> bool {
        self.reason.contains(ALREADY_SERVED)
    }
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

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum TrafficPolicy {
    Cluster,
    Local,
}

/// How long a service has existed, for [`ClaimRank`]: its creation time, then its uid, so
/// that two nodes with the same objects always agree.
#[derive(Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Seniority {
    /// Objects without a creation time (a services file's) come after every dated one.
    undated: bool,
    created: Option<jiff::Timestamp>,
    uid: Option<String>,
}

impl Seniority {
    fn of(metadata: &ObjectMeta) -> Self {
        let created = metadata.creation_timestamp.as_ref().map(|time| time.0);
        Self { undated: created.is_none(), created, uid: metadata.uid.clone() }
    }
}

/// Where one service port's claim on a frontend stands among the claims of every service on
/// it; the least wins. A cluster IP comes first, so no other service's external or
/// load-balancer IP can take it; then the older service; the name only breaks ties between
/// objects that carry neither a creation time nor a uid (a services file's); within one
/// service, the order in which its frontends were generated.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct ClaimRank {
    cluster_ip: std::cmp::Reverse<bool>,
    seniority: Arc<Seniority>,
    pub(crate) name: Arc<ServicePortName>,
    sequence: u32,
}

impl ClaimRank {
    fn new(entry: &FrontendEntry, port: &ServicePortSpec, sequence: u32) -> Self {
        Self {
            cluster_ip: std::cmp::Reverse(entry.kind == FrontendKind::ClusterIp),
            seniority: port.service.seniority.clone(),
            name: port.name.clone(),
            sequence,
        }
    }
}

/// The claims a node address cannot give a service: vipr's own servers listen there.
/// `health_check_node_ports` are every service's.
fn reserved_for_vipr(
    frontend: &Frontend,
    entry: &FrontendEntry,
    node: &NodeContext,
    health_check_node_ports: &dyn Fn(u16) -> bool,
) -> Option<String> {
    let external = matches!(entry.kind, FrontendKind::ExternalIp | FrontendKind::LoadBalancer);
    if !external || frontend.protocol != Protocol::Tcp || !node.node_ips.contains(&frontend.ip) {
        return None;
    }
    if node.own_ports.contains(&frontend.port) {
        Some(format!("frontend {frontend} is a node address and port that vipr itself serves"))
    } else if health_check_node_ports(frontend.port) {
        Some(format!("frontend {frontend} is a node address and a health-check node port that vipr serves"))
    } else {
        None
    }
}

/// The health-check node port vipr serves for `service` (kube-proxy's rule: a load balancer
/// with `externalTrafficPolicy: Local` and a port allocated).
pub fn health_check_node_port(service: &Service) -> Option<u16> {
    let spec = service.spec.as_ref()?;
    let needs_health_check = spec.type_.as_deref() == Some("LoadBalancer")
        && spec.external_traffic_policy.as_deref() == Some("Local");
    let port = u16::try_from(spec.health_check_node_port?).ok().filter(|port| *port != 0)?;
    needs_health_check.then_some(port)
}

/// How many distinct addresses among `endpoints` are ready and on this node: a health
/// check's local endpoints, as kube-proxy's `LocalReadyEndpoints` counts them.
fn local_ready_addresses<'a>(endpoints: impl IntoIterator<Item = &'a EndpointSpec>) -> usize {
    let addresses: HashSet<IpAddr> = endpoints
        .into_iter()
        .filter(|endpoint| endpoint.local && endpoint.ready)
        .map(|endpoint| endpoint.backend.ip)
        .collect();
    addresses.len()
}

/// The service-wide settings every port shares.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct ServiceSpec {
    seniority: Arc<Seniority>,
    cluster_ips: Vec<IpAddr>,
    external_ips: Vec<IpAddr>,
    load_balancer_ips: Vec<IpAddr>,
    source_ranges: Vec<IpNet>,
    /// Already `Cluster` where the service type makes the field meaningless.
    external_policy: TrafficPolicy,
    internal_policy: TrafficPolicy,
    affinity: Option<Duration>,
}

/// One port of a service, validated.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct ServicePortSpec {
    /// Shared by the incremental translator's claims, which name this port once per claim.
    name: Arc<ServicePortName>,
    service: Arc<ServiceSpec>,
    port: u16,
    node_port: Option<u16>,
}

/// One endpoint of a slice for one slice port, validated.
#[derive(Clone, Debug)]
pub(crate) struct EndpointSpec {
    backend: Backend,
    ready: bool,
    serving: bool,
    terminating: bool,
    local: bool,
    hints: Option<Arc<Hints>>,
}

impl EndpointSpec {
    fn serving_and_terminating(&self) -> bool {
        self.serving && self.terminating
    }

    /// The nodes the EndpointSlice controller hints this endpoint for (`forNodes`, set for
    /// `trafficDistribution: PreferSameNode`).
    fn node_hints(&self) -> &[Box<str>] {
        self.hints.as_deref().map(|hints| &*hints.nodes).unwrap_or_default()
    }

    /// The zones the EndpointSlice controller hints this endpoint for (`forZones`).
    fn zone_hints(&self) -> &[Box<str>] {
        self.hints.as_deref().map(|hints| &*hints.zones).unwrap_or_default()
    }
}

/// The translation of every API object at once: [`desired_state_of`] their decoded forms.
pub fn desired_state(services: &[Service], slices: &[EndpointSlice], node: &NodeContext) -> Translation {
    let services: Vec<ServiceObject> = services.iter().map(ServiceObject::decode).collect();
    let slices: Vec<SliceObject> = slices.iter().map(SliceObject::decode).collect();
    desired_state_of(&services, &slices, node)
}

/// The translation of every object at once, as the change tracker holds them; the agent's
/// [`incremental::Translator`] gives the same result by what changed.
pub fn desired_state_of(
    services: &[ServiceObject],
    slices: &[SliceObject],
    node: &NodeContext,
) -> Translation {
    let mut rejected = Vec::new();
    let mut ports = Vec::new();
    for service in services {
        match &service.ports {
            Ok(service_ports) => ports.extend(service_ports.iter().cloned()),
            Err(reason) => rejected
                .push(Rejection { object: service.meta.describe("Service"), reason: reason.to_string() }),
        }
    }
    let mut endpoints: BTreeMap<ServicePortName, Vec<EndpointSpec>> = BTreeMap::new();
    // Every endpoint of each service's slices, whatever the port, for its health check.
    let mut by_service: BTreeMap<(String, String), Vec<EndpointSpec>> = BTreeMap::new();
    for slice in slices {
        match slice.endpoints(node) {
            Ok(by_port) => {
                for (name, found) in by_port {
                    let service = (name.namespace.clone(), name.name.clone());
                    by_service.entry(service).or_default().extend(found.iter().cloned());
                    endpoints.entry(name).or_default().extend(found);
                }
            }
            Err(reason) => rejected
                .push(Rejection { object: slice.meta.describe("EndpointSlice"), reason: reason.to_owned() }),
        }
    }

    let mut state = DesiredState {
        service_cidrs: node.service_cidrs.clone(),
        sources: node.source_classifier(),
        ..DesiredState::default()
    };
    let health_check_node_ports: HashSet<u16> =
        services.iter().filter_map(|service| service.health_check_node_port).collect();
    for service in services {
        let Some(port) = service.health_check_node_port else { continue };
        let Ok((namespace, name)) = service.meta.identity() else { continue };
        let local = by_service.get(&(namespace.clone(), name.clone())).map(Vec::as_slice).unwrap_or_default();
        state.health_checks.insert(
            ServiceName { namespace, name },
            HealthCheck { port, local_endpoints: local_ready_addresses(local) },
        );
    }
    // The ports of one service together and in a fixed order, as the incremental translator
    // numbers them.
    ports.sort_by(|a, b| a.name.cmp(&b.name));
    let mut claims: BTreeMap<Frontend, Vec<(ClaimRank, FrontendEntry)>> = BTreeMap::new();
    let mut sequence = 0;
    let mut previous: Option<(String, String)> = None;
    for port in ports {
        let key = (port.name.namespace.clone(), port.name.name.clone());
        if previous.as_ref() != Some(&key) {
            sequence = 0;
            previous = Some(key);
        }
        let endpoints = endpoints.get(&*port.name).map(Vec::as_slice).unwrap_or_default();
        state.cluster_ips.extend(port.service.cluster_ips.iter().copied());
        state.listed_endpoints.extend(endpoints.iter().map(|endpoint| endpoint.backend));
        for (frontend, entry) in frontends(&port, endpoints, node) {
            let rank = ClaimRank::new(&entry, &port, sequence);
            sequence += 1;
            if let Some(reason) =
                reserved_for_vipr(&frontend, &entry, node, &|port| health_check_node_ports.contains(&port))
            {
                rejected.push(Rejection { object: claimant(&rank), reason });
                continue;
            }
            claims.entry(frontend).or_default().push((rank, entry));
        }
    }
    for (frontend, mut claims) in claims {
        claims.sort_by(|a, b| a.0.cmp(&b.0));
        let mut claims = claims.into_iter();
        let Some((owner, entry)) = claims.next() else { continue };
        rejected.extend(claims.map(|(loser, _)| lost_claim(&frontend, &loser, &owner)));
        state.frontends.insert(frontend, entry);
    }
    Translation { state, rejected }
}

/// The Service a claim belongs to, as a rejection names it.
fn claimant(rank: &ClaimRank) -> String {
    format!("Service {}/{}", rank.name.namespace, rank.name.name)
}

/// The report of a claim that another service's claim beat.
fn lost_claim(frontend: &Frontend, loser: &ClaimRank, owner: &ClaimRank) -> Rejection {
    Rejection {
        object: claimant(loser),
        reason: format!("frontend {frontend} {ALREADY_SERVED} {}", owner.name),
    }
}

/// Endpoint sets as kube-proxy's `CategorizeEndpoints` computes them.
struct Categorized {
    cluster: Arc<[Backend]>,
    local: Arc<[Backend]>,
    /// Some endpoint anywhere is ready, or serving and terminating.
    any_usable: bool,
}

/// Which endpoints topology leaves to the cluster traffic policy on this node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Topology<'a> {
    /// Every endpoint (no usable hints).
    Anywhere,
    /// Those hinted for this node (`forNodes`).
    SameNode(&'a str),
    /// Those hinted for this node's zone (`forZones`).
    SameZone(&'a str),
}

impl Topology<'_> {
    fn admits(self, endpoint: &EndpointSpec) -> bool {
        match self {
            Self::Anywhere => true,
            Self::SameNode(node) => endpoint.node_hints().iter().any(|hint| &**hint == node),
            Self::SameZone(zone) => endpoint.zone_hints().iter().any(|hint| &**hint == zone),
        }
    }
}

/// kube-proxy's `topologyModeFromHints`: the Service's `trafficDistribution` is the
/// EndpointSlice controller's business, and the hints it writes are the answer. Node hints
/// first, then zone hints; a kind of hint is used only when every ready endpoint carries it
/// and some ready endpoint is hinted for this node (or zone), so that hints never leave this
/// node without a ready endpoint.
fn topology<'a>(endpoints: &[EndpointSpec], node: &'a NodeContext) -> Topology<'a> {
    let ready: Vec<&EndpointSpec> = endpoints.iter().filter(|e| e.ready).collect();
    let usable = |hints: fn(&EndpointSpec) -> &[Box<str>], wanted: &str| {
        ready.iter().all(|e| !hints(e).is_empty())
            && ready.iter().any(|e| hints(e).iter().any(|hint| &**hint == wanted))
    };
    if !node.name.is_empty() && usable(EndpointSpec::node_hints, &node.name) {
        return Topology::SameNode(&node.name);
    }
    match node.zone.as_deref().filter(|zone| !zone.is_empty()) {
        Some(zone) if usable(EndpointSpec::zone_hints, zone) => Topology::SameZone(zone),
        _ => Topology::Anywhere,
    }
}

fn categorize(endpoints: &[EndpointSpec], topology: Topology<'_>) -> Categorized {
    let pick = |keep: &dyn Fn(&EndpointSpec) -> bool| -> Arc<[Backend]> {
        let set: BTreeSet<Backend> = endpoints.iter().filter(|e| keep(e)).map(|e| e.backend).collect();
        set.into_iter().collect()
    };
    let ready_first = |keep: &dyn Fn(&EndpointSpec) -> bool| {
        let ready = pick(&|e| keep(e) && e.ready);
        if ready.is_empty() {
            pick(&|e| keep(e) && e.serving_and_terminating())
        } else {
            ready
        }
    };
    let cluster_ready = pick(&|e| e.ready && topology.admits(e));
    Categorized {
        // Topology filters only the ready endpoints; the terminating fallback ignores it.
        cluster: if cluster_ready.is_empty() { ready_first(&|_| true) } else { cluster_ready },
        local: ready_first(&|e| e.local),
        any_usable: endpoints.iter().any(|e| e.ready || e.serving_and_terminating()),
    }
}

/// A dual-stack service is two services to kube-proxy, one per family (each family has its
/// own proxier): endpoints, the local-traffic detector, source ranges and the DROP/REJECT
/// choice are all judged within the frontend's family.
fn frontends(
    port: &ServicePortSpec,
    endpoints: &[EndpointSpec],
    node: &NodeContext,
) -> Vec<(Frontend, FrontendEntry)> {
    [true, false].into_iter().flat_map(|ipv4| family_frontends(port, endpoints, node, ipv4)).collect()
}

fn family_frontends(
    port: &ServicePortSpec,
    endpoints: &[EndpointSpec],
    node: &NodeContext,
    ipv4: bool,
) -> Vec<(Frontend, FrontendEntry)> {
    let in_family = |ip: &IpAddr| ip.is_ipv4() == ipv4;
    let service = &port.service;
    let endpoints: Vec<EndpointSpec> =
        endpoints.iter().filter(|e| in_family(&e.backend.ip)).cloned().collect();
    let endpoints = categorize(&endpoints, topology(&endpoints, node));
    // An interface detector serves both families.
    let has_detector =
        node.pod_interfaces.is_some() || node.cluster_cidrs.iter().any(|cidr| in_family(&cidr.addr()));
    // No usable endpoint anywhere is the client's business; none allowed from here is not.
    let when_policy_empty = if endpoints.any_usable { WhenEmpty::Drop } else { WhenEmpty::Reject };
    let treatment = |backends: &Arc<[Backend]>, masquerade: bool| Treatment {
        backends: backends.clone(),
        when_empty: if backends.is_empty() { when_policy_empty } else { WhenEmpty::Reject },
        masquerade,
    };
    let entry = |kind, from_pod, from_node, from_outside| FrontendEntry {
        service: ServicePortName::clone(&port.name),
        kind,
        from_pod,
        from_node,
        from_outside,
        allowed_sources: Vec::new(),
        affinity: service.affinity,
    };
    let frontend =
        |ip: IpAddr, port_number: u16| Frontend { ip, port: port_number, protocol: port.name.protocol };

    let internal_backends =
        if service.internal_policy == TrafficPolicy::Local { &endpoints.local } else { &endpoints.cluster };
    // Without a detector no source is known to be a pod, so none is masqueraded for being
    // outside the pod network.
    let masquerade_non_pods = node.masquerade_all || has_detector;
    let cluster_ip_entry = entry(
        FrontendKind::ClusterIp,
        treatment(internal_backends, node.masquerade_all),
        treatment(internal_backends, masquerade_non_pods),
        treatment(internal_backends, masquerade_non_pods),
    );

    let external_entry = |kind| match service.external_policy {
        TrafficPolicy::Cluster => {
            let masqueraded = treatment(&endpoints.cluster, true);
            entry(kind, masqueraded.clone(), masqueraded.clone(), masqueraded)
        }
        TrafficPolicy::Local => entry(
            kind,
            // Pods keep their address and use every endpoint: they are inside the cluster.
            if !has_detector {
                treatment(&endpoints.local, false)
            } else {
                treatment(&endpoints.cluster, false)
            },
            // The node's own connections would otherwise leave with a node address that the
            // endpoint could not route back through this node.
            treatment(&endpoints.cluster, true),
            treatment(&endpoints.local, false),
        ),
    };

    let mut frontends: Vec<(Frontend, FrontendEntry)> = service
        .cluster_ips
        .iter()
        .filter(|ip| in_family(ip))
        .map(|ip| (frontend(*ip, port.port), cluster_ip_entry.clone()))
        .collect();
    for ip in service.external_ips.iter().filter(|ip| in_family(ip)) {
        frontends.push((frontend(*ip, port.port), external_entry(FrontendKind::ExternalIp)));
    }
    let allowed_sources = allowed_load_balancer_sources(service, node, ipv4);
    for ip in service.load_balancer_ips.iter().filter(|ip| in_family(ip)) {
        let mut entry = external_entry(FrontendKind::LoadBalancer);
        entry.allowed_sources = allowed_sources.clone();
        frontends.push((frontend(*ip, port.port), entry));
    }
    if let Some(node_port) = port.node_port {
        for ip in node.node_port_ips.iter().filter(|ip| in_family(ip)) {
            frontends.push((frontend(*ip, node_port), external_entry(FrontendKind::NodePort)));
        }
        if node.localhost_node_ports && ipv4 {
            // Only the node's own processes reach it; they are treated as from the node.
            let localhost = IpAddr::V4(std::net::Ipv4Addr::LOCALHOST);
            frontends.push((frontend(localhost, node_port), external_entry(FrontendKind::NodePort)));
        }
    }
    frontends
}

/// The source ranges, plus the load-balancer IPs themselves when a range admits the node: a
/// node that reaches its own load-balancer IP (routed back locally) arrives with that IP as
/// source.
fn allowed_load_balancer_sources(service: &ServiceSpec, node: &NodeContext, ipv4: bool) -> Vec<IpNet> {
    let mut allowed: Vec<IpNet> =
        service.source_ranges.iter().filter(|range| range.addr().is_ipv4() == ipv4).copied().collect();
    if allowed.iter().any(|range| node.primary_ips.iter().any(|ip| range.contains(ip))) {
        allowed.extend(
            service.load_balancer_ips.iter().filter(|ip| ip.is_ipv4() == ipv4).map(|ip| IpNet::from(*ip)),
        );
    }
    allowed
}

/// The service IP ranges, as kube-proxy takes them: every range of every ServiceCIDR object
/// (networking.k8s.io/v1); `fallback` (`--service-cluster-ip-range`) while there is none.
/// A range that is not a CIDR is reported and left out.
pub fn service_cidrs(objects: &[ServiceCIDR], fallback: &[IpNet]) -> (Vec<IpNet>, Vec<Rejection>) {
    let mut ranges = BTreeSet::new();
    let mut rejected = Vec::new();
    for object in objects {
        let cidrs = object.spec.iter().flat_map(|spec| spec.cidrs.iter().flatten());
        for (index, cidr) in cidrs.enumerate() {
            match cidr.trim().parse::<IpNet>() {
                Ok(range) => {
                    ranges.insert(range.trunc());
                }
                Err(_) => rejected.push(Rejection {
                    object: format!("ServiceCIDR {}", object.metadata.name.as_deref().unwrap_or("<unnamed>")),
                    reason: format!("spec.cidrs[{index}] {cidr:?} is not a CIDR"),
                }),
            }
        }
    }
    if objects.is_empty() {
        return (fallback.to_vec(), rejected);
    }
    (ranges.into_iter().collect(), rejected)
}

/// A hash of an object's content (its JSON form), for objects without a resourceVersion
/// (those of a services file): two versions that hash alike are taken as the same.
pub(crate) fn content_hash<T: serde::Serialize>(object: &T) -> u64 {
    use std::hash::{DefaultHasher, Hash as _, Hasher as _};
    let mut hasher = DefaultHasher::new();
    serde_json::to_string(object).unwrap_or_default().hash(&mut hasher);
    hasher.finish()
}

fn identity(metadata: &ObjectMeta) -> Result<(String, String), String> {
    let name = metadata.name.clone().filter(|name| !name.is_empty()).ok_or("metadata.name is missing")?;
    let namespace = metadata.namespace.clone().unwrap_or_else(|| "default".into());
    kubernetes_name(&namespace, 63, "metadata.namespace")?;
    Ok((namespace, name))
}

/// Names as the API server accepts them (DNS labels and subdomains: lower-case letters,
/// digits, `-` and `.`). Objects from a file are not validated by an API server, and names
/// travel into iptables-restore input, logs and metrics labels, where a quote or a newline
/// would break out of its place.
fn kubernetes_name(name: &str, max_len: usize, field: &str) -> Result<(), String> {
    let allowed = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.';
    let edges_alphanumeric = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric());
    if name.len() <= max_len
        && name.chars().all(allowed)
        && edges_alphanumeric(name.chars().next())
        && edges_alphanumeric(name.chars().last())
    {
        Ok(())
    } else {
        Err(format!(
            "{field} {:?} is not a valid name (lower-case letters, digits, '-' and '.', at most {max_len})",
            name.escape_debug().to_string()
        ))
    }
}

/// Port names: empty (the only port), or a DNS label of at most 63 characters.
fn port_name(name: Option<&str>, field: &str) -> Result<String, String> {
    let name = name.unwrap_or_default();
    if !name.is_empty() {
        kubernetes_name(name, 63, field)?;
        if name.contains('.') {
            return Err(format!("{field} {name:?} is not a valid port name (no '.')"));
        }
    }
    Ok(name.to_owned())
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

/// Service addresses: IP addresses that are not [`special_address`]es.
fn ip_list<'a>(addresses: impl IntoIterator<Item = &'a String>, field: &str) -> Result<Vec<IpAddr>, String> {
    addresses
        .into_iter()
        .map(|address| {
            let ip: IpAddr =
                address.trim().parse().map_err(|_| format!("{field} {address:?} is not an IP address"))?;
            match special_address(ip) {
                Some(kind) => Err(format!("{field} {ip} is a {kind} address, not a service address")),
                None => Ok(ip),
            }
        })
        .collect()
}

/// What kind of address `ip` is when it can be no service's: a packet to it is the host's own
/// business (unspecified, loopback, link-local), reaches many hosts (multicast, broadcast),
/// or is another family's address in disguise (IPv4-mapped IPv6).
fn special_address(ip: IpAddr) -> Option<&'static str> {
    match ip {
        IpAddr::V4(v4) if v4.is_unspecified() => Some("unspecified"),
        IpAddr::V4(v4) if v4.is_loopback() => Some("loopback"),
        IpAddr::V4(v4) if v4.is_link_local() => Some("link-local"),
        IpAddr::V4(v4) if v4.is_multicast() => Some("multicast"),
        IpAddr::V4(v4) if v4.is_broadcast() => Some("broadcast"),
        IpAddr::V6(v6) if v6.is_unspecified() => Some("unspecified"),
        IpAddr::V6(v6) if v6.is_loopback() => Some("loopback"),
        IpAddr::V6(v6) if v6.is_unicast_link_local() => Some("link-local"),
        IpAddr::V6(v6) if v6.is_multicast() => Some("multicast"),
        IpAddr::V6(v6) if v6.to_ipv4_mapped().is_some() => Some("IPv4-mapped IPv6"),
        _ => None,
    }
}

fn policy(value: Option<&str>, field: &str) -> Result<TrafficPolicy, String> {
    match value {
        None | Some("Cluster") => Ok(TrafficPolicy::Cluster),
        Some("Local") => Ok(TrafficPolicy::Local),
        Some(other) => Err(format!("{field} {other:?} is not Cluster or Local")),
    }
}

fn service_spec(service: &Service) -> Result<Option<ServiceSpec>, String> {
    let spec = service.spec.as_ref().ok_or("spec is missing")?;
    let service_type = spec.type_.as_deref();
    if service_type == Some("ExternalName") {
        return Ok(None);
    }
    let addresses = match &spec.cluster_ips {
        Some(ips) if !ips.is_empty() => ips.clone(),
        _ => spec.cluster_ip.iter().cloned().collect(),
    };
    // Headless services have no virtual IP to proxy.
    if addresses.iter().all(|address| address.is_empty() || address == "None") {
        return Ok(None);
    }
    let cluster_ips = ip_list(&addresses, "cluster IP")?;
    let external_ips = ip_list(spec.external_ips.iter().flatten(), "spec.externalIPs entry")?;
    // kube-proxy leaves ipMode Proxy load balancers alone: they deliver to the node with the
    // node as destination, not to the load-balancer IP.
    let load_balancer_ips = ip_list(
        service
            .status
            .iter()
            .filter_map(|status| status.load_balancer.as_ref())
            .flat_map(|lb| lb.ingress.iter().flatten())
            .filter(|ingress| ingress.ip_mode.as_deref() != Some("Proxy"))
            .filter_map(|ingress| ingress.ip.as_ref()),
        "status.loadBalancer.ingress ip",
    )?;
    let source_ranges = spec
        .load_balancer_source_ranges
        .iter()
        .flatten()
        .map(|range| {
            range
                .trim()
                .parse::<IpNet>()
                .map_err(|_| format!("spec.loadBalancerSourceRanges entry {range:?} is not a CIDR"))
        })
        .collect::<Result<Vec<_>, _>>()?;
    // As kube-proxy's ExternalPolicyLocal: the field means something only for services that
    // are reachable from outside by their type.
    let externally_typed = matches!(service_type, Some("NodePort" | "LoadBalancer"))
        || (service_type == Some("ClusterIP") && !external_ips.is_empty());
    let external_policy = match policy(spec.external_traffic_policy.as_deref(), "spec.externalTrafficPolicy")?
    {
        TrafficPolicy::Local if externally_typed => TrafficPolicy::Local,
        _ => TrafficPolicy::Cluster,
    };
    let internal_policy = policy(spec.internal_traffic_policy.as_deref(), "spec.internalTrafficPolicy")?;
    let affinity = match spec.session_affinity.as_deref() {
        None | Some("None") => None,
        Some("ClientIP") => {
            let seconds = spec
                .session_affinity_config
                .as_ref()
                .and_then(|config| config.client_ip.as_ref())
                .and_then(|client_ip| client_ip.timeout_seconds);
            Some(match seconds {
                None => DEFAULT_AFFINITY_TIMEOUT,
                Some(seconds) if (1..=86_400).contains(&seconds) => Duration::from_secs(seconds as u64),
                Some(seconds) => return Err(format!("session affinity timeout {seconds}s is not 1-86400")),
            })
        }
        Some(other) => return Err(format!("spec.sessionAffinity {other:?} is not None or ClientIP")),
    };
    Ok(Some(ServiceSpec {
        seniority: Arc::new(Seniority::of(&service.metadata)),
        cluster_ips,
        external_ips,
        load_balancer_ips,
        source_ranges,
        external_policy,
        internal_policy,
        affinity,
    }))
}

/// The ports of a service that kube-proxy would program, or why the service is unusable.
/// Services without a cluster IP (headless, ExternalName) have none and are not an error.
fn service_ports(service: &Service) -> Result<Vec<ServicePortSpec>, String> {
    let (namespace, name) = identity(&service.metadata)?;
    // A slice's own name goes nowhere; a service's names every rule and counter.
    kubernetes_name(&name, 63, "metadata.name")?;
    let Some(spec) = service_spec(service)? else {
        return Ok(Vec::new());
    };
    let spec = Arc::new(spec);
    let mut seen = HashSet::new();
    let mut names = HashSet::new();
    let mut ports = Vec::new();
    for (index, port) in service.spec.iter().flat_map(|spec| spec.ports.iter().flatten()).enumerate() {
        let field = format!("spec.ports[{index}]");
        let number = port_number(port.port, &format!("{field}.port"))?;
        let protocol = protocol(port.protocol.as_deref(), &format!("{field}.protocol"))?;
        let node_port =
            port.node_port.filter(|port| *port != 0).map(|p| port_number(p, &format!("{field}.nodePort")));
        let port_name = port_name(port.name.as_deref(), &format!("{field}.name"))?;
        if !seen.insert((number, protocol)) {
            return Err(format!("{field}: port {number}/{protocol} is listed twice"));
        }
        if !names.insert((port_name.clone(), protocol)) {
            return Err(format!("{field}: port name {port_name:?} is used twice for {protocol}"));
        }
        ports.push(ServicePortSpec {
            name: Arc::new(ServicePortName {
                namespace: namespace.clone(),
                name: name.clone(),
                port: port_name,
                protocol,
            }),
            service: spec.clone(),
            port: number,
            node_port: node_port.transpose()?,
        });
    }
    Ok(ports)
}

#[cfg(test)]
mod tests;

pub mod changes;
pub mod incremental;
pub mod objects;
