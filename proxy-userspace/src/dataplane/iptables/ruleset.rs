//! The desired state as iptables rules for one IP family: kube-proxy's chain structure, built
//! from the model's per-source-class treatments. Pure, so the generation is unit-tested
//! without a kernel.
//!
//! The packet's way (nat table, PREROUTING for forwarded traffic, OUTPUT for the node's own):
//!
//! ```text
//! KUBE-SERVICES ─ cluster IP:port ─────────────────────► KUBE-SVC-* (masquerade rules for
//!               │                                          this cluster IP, then endpoints)
//!               ├ external IP:port ─────────────────────► KUBE-EXT-* ─► KUBE-SVC-* / KUBE-SVL-*
//!               ├ load-balancer IP:port ─ (source ranges ► KUBE-FW-*) ─► KUBE-EXT-*
//!               └ node-port address ─► KUBE-NODEPORTS ─ port ─► KUBE-EXT-*
//! KUBE-SVC-* / KUBE-SVL-* ─ affinity (recent) or statistic random 1/n ─► KUBE-SEP-* (hairpin
//!                                                                  masquerade, DNAT)
//! POSTROUTING ─► KUBE-POSTROUTING: MASQUERADE what KUBE-MARK-MASQ marked (0x4000)
//! ```
//!
//! A `KUBE-EXT-*` chain classifies the source as the model does: the node (`addrtype LOCAL`)
//! first, then pods (`-s` cluster CIDR), then everything else, and applies that class's
//! treatment (masquerade mark, endpoint chain). What the nat table does not DNAT is judged in
//! the filter table: a treatment without endpoints rejects or drops there (`KUBE-SERVICES` for
//! cluster IPs, `KUBE-EXTERNAL-SERVICES` for the rest, as kube-proxy), sources outside a load
//! balancer's ranges are dropped by `KUBE-PROXY-FIREWALL`, and addresses of the service CIDRs
//! that are no cluster IP by `KUBE-SERVICE-CIDRS`. A cluster IP on a port it does not serve is
//! left alone (iptables semantics: the packet passes).
use std::{
    collections::{BTreeMap, BTreeSet},
    fmt::Write as _,
    net::IpAddr,
};

use ipnet::{IpNet, Ipv4Net};

use super::names::{self, endpoint_chain, service_chain};
use crate::model::{
    Backend, DesiredState, Frontend, FrontendEntry, FrontendKind, PodInterfaces, ServicePortName, WhenEmpty,
};

/// The bit kube-proxy marks packets to masquerade with (`--iptables-masquerade-bit` 14).
pub const MASQUERADE_MARK: &str = "0x4000";

pub const KUBE_SERVICES: &str = "KUBE-SERVICES";
pub const KUBE_EXTERNAL_SERVICES: &str = "KUBE-EXTERNAL-SERVICES";
pub const KUBE_NODEPORTS: &str = "KUBE-NODEPORTS";
pub const KUBE_FORWARD: &str = "KUBE-FORWARD";
pub const KUBE_PROXY_FIREWALL: &str = "KUBE-PROXY-FIREWALL";
pub const KUBE_POSTROUTING: &str = "KUBE-POSTROUTING";
pub const KUBE_MARK_MASQ: &str = "KUBE-MARK-MASQ";
/// vipr's own: drops connections to service-CIDR addresses that are no cluster IP (what
/// kube-proxy's nftables mode does; its iptables mode has no such rule).
pub const KUBE_SERVICE_CIDRS: &str = "KUBE-SERVICE-CIDRS";

/// kubelet's chain for the CVE-2020-8558 guard (kube-proxy's iptables mode writes the same
/// rule there when it serves NodePorts on localhost). Shared with kubelet: vipr ensures its
/// rule and the jumps to it, and never flushes or deletes it.
pub const KUBE_FIREWALL: &str = "KUBE-FIREWALL";
/// The guard: a packet to 127.0.0.0/8 that does not come from there and is not part of a
/// DNATed (NodePort) or existing connection is dropped, so that `route_localnet=1` does not
/// expose the node's loopback services to its links.
pub const LOCALNET_GUARD: &str = "-m comment --comment \"block incoming localnet connections\" \
     -d 127.0.0.0/8 ! -s 127.0.0.0/8 -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP";
/// The jumps to [`KUBE_FIREWALL`] (kube-proxy's `iptablesKubeletJumpChains`), ensured on full
/// syncs when the guard is wanted, after (so above) the others.
pub const LOCALNET_GUARD_JUMPS: [Jump; 2] = [
    Jump { table: TableName::Filter, from: "INPUT", to: KUBE_FIREWALL, spec: "" },
    Jump { table: TableName::Filter, from: "OUTPUT", to: KUBE_FIREWALL, spec: "" },
];

/// Chains rewritten as a whole whenever their content changes, and never deleted by a sync.
pub const FILTER_TOP_LEVEL: [&str; 6] = [
    KUBE_SERVICES,
    KUBE_EXTERNAL_SERVICES,
    KUBE_FORWARD,
    KUBE_NODEPORTS,
    KUBE_PROXY_FIREWALL,
    KUBE_SERVICE_CIDRS,
];
pub const NAT_TOP_LEVEL: [&str; 4] = [KUBE_SERVICES, KUBE_NODEPORTS, KUBE_POSTROUTING, KUBE_MARK_MASQ];

/// kube-proxy leaves comments out of endpoint rules above this many endpoints: they make the
/// restore input much larger.
const LARGE_CLUSTER_ENDPOINTS: usize = 1000;

pub use crate::model::IpFamily as Family;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum TableName {
    Filter,
    Nat,
}

impl TableName {
    pub const ALL: [Self; 2] = [Self::Filter, Self::Nat];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Filter => "filter",
            Self::Nat => "nat",
        }
    }

    /// The chains of this table that are always present and rewritten whole.
    pub fn top_level(self) -> &'static [&'static str] {
        match self {
            Self::Filter => &FILTER_TOP_LEVEL,
            Self::Nat => &NAT_TOP_LEVEL,
        }
    }
}

/// Chains of one table: name -> rules in order, each rule without its `-A CHAIN` prefix.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Table {
    pub chains: BTreeMap<String, Vec<String>>,
}

impl Table {
    fn with_chains(names: &[&str]) -> Self {
        Self { chains: names.iter().map(|name| ((*name).to_owned(), Vec::new())).collect() }
    }

    fn push(&mut self, chain: &str, rule: String) {
        self.chains.entry(chain.to_owned()).or_default().push(rule);
    }

    pub fn rules(&self) -> usize {
        self.chains.values().map(Vec::len).sum()
    }
}

/// Everything vipr wants in one family's filter and nat tables.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ruleset {
    pub filter: Table,
    pub nat: Table,
    /// Ensure [`LOCALNET_GUARD`] in the filter table's [`KUBE_FIREWALL`] and the jumps to it
    /// (IPv4 with localhost NodePorts). Not a chain of the tables above: kubelet shares it.
    pub localnet_guard: bool,
}

impl Ruleset {
    pub fn table(&self, table: TableName) -> &Table {
        match table {
            TableName::Filter => &self.filter,
            TableName::Nat => &self.nat,
        }
    }
}

/// Facts about the system that shape the rules but are no part of the desired state.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RuleOptions {
    /// `nf_conntrack_tcp_be_liberal` is set: no DROP of INVALID packets in KUBE-FORWARD (as
    /// kube-proxy).
    pub conntrack_tcp_liberal: bool,
    /// iptables supports `MASQUERADE --random-fully` (1.6.2 and later).
    pub random_fully: bool,
    /// kube-proxy's `--iptables-localhost-nodeports` as it applies: IPv4 NodePorts are also
    /// served on these loopback addresses (127.0.0.0/8 when NodePorts are served on every
    /// address, as kube-proxy's `--dst-type LOCAL`; else 127.0.0.1), and the CVE-2020-8558
    /// guard is ensured. `None`: never on loopback (no rule sends 127.0.0.0/8 to
    /// KUBE-NODEPORTS, kube-proxy's `! -d 127.0.0.0/8`).
    pub localhost_node_ports: Option<Ipv4Net>,
}

/// A jump from a built-in chain to one of ours, ensured on every full sync (kube-proxy's
/// `iptablesJumpChains`, in its order: each missing one is inserted at the top).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Jump {
    pub table: TableName,
    pub from: &'static str,
    pub to: &'static str,
    /// Matches and the comment, without `-j`.
    pub spec: &'static str,
}

impl Jump {
    pub fn rule(&self) -> String {
        if self.spec.is_empty() {
            format!("-j {}", self.to)
        } else {
            format!("{} -j {}", self.spec, self.to)
        }
    }
}

pub const JUMPS: [Jump; 12] = [
    Jump {
        table: TableName::Filter,
        from: "INPUT",
        to: KUBE_EXTERNAL_SERVICES,
        spec: r#"-m conntrack --ctstate NEW -m comment --comment "kubernetes externally-visible service portals""#,
    },
    Jump {
        table: TableName::Filter,
        from: "FORWARD",
        to: KUBE_EXTERNAL_SERVICES,
        spec: r#"-m conntrack --ctstate NEW -m comment --comment "kubernetes externally-visible service portals""#,
    },
    Jump {
        table: TableName::Filter,
        from: "INPUT",
        to: KUBE_NODEPORTS,
        spec: r#"-m comment --comment "kubernetes health check service ports""#,
    },
    Jump {
        table: TableName::Filter,
        from: "FORWARD",
        to: KUBE_SERVICES,
        spec: r#"-m conntrack --ctstate NEW -m comment --comment "kubernetes service portals""#,
    },
    Jump {
        table: TableName::Filter,
        from: "OUTPUT",
        to: KUBE_SERVICES,
        spec: r#"-m conntrack --ctstate NEW -m comment --comment "kubernetes service portals""#,
    },
    Jump {
        table: TableName::Filter,
        from: "FORWARD",
        to: KUBE_FORWARD,
        spec: r#"-m comment --comment "kubernetes forwarding rules""#,
    },
    Jump {
        table: TableName::Filter,
        from: "INPUT",
        to: KUBE_PROXY_FIREWALL,
        spec: r#"-m conntrack --ctstate NEW -m comment --comment "kubernetes load balancer firewall""#,
    },
    Jump {
        table: TableName::Filter,
        from: "OUTPUT",
        to: KUBE_PROXY_FIREWALL,
        spec: r#"-m conntrack --ctstate NEW -m comment --comment "kubernetes load balancer firewall""#,
    },
    Jump {
        table: TableName::Filter,
        from: "FORWARD",
        to: KUBE_PROXY_FIREWALL,
        spec: r#"-m conntrack --ctstate NEW -m comment --comment "kubernetes load balancer firewall""#,
    },
    Jump {
        table: TableName::Nat,
        from: "OUTPUT",
        to: KUBE_SERVICES,
        spec: r#"-m comment --comment "kubernetes service portals""#,
    },
    Jump {
        table: TableName::Nat,
        from: "PREROUTING",
        to: KUBE_SERVICES,
        spec: r#"-m comment --comment "kubernetes service portals""#,
    },
    Jump {
        table: TableName::Nat,
        from: "POSTROUTING",
        to: KUBE_POSTROUTING,
        spec: r#"-m comment --comment "kubernetes postrouting rules""#,
    },
];

/// The source classes in the order rules test them (the model's: the node before pods).
pub(crate) const NODE: usize = 0;
pub(crate) const POD: usize = 1;
pub(crate) const OUTSIDE: usize = 2;

/// One class's treatment, reduced to this family and to what the rules depend on.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct ClassTreatment {
    pub(crate) backends: Vec<Backend>,
    /// Only meaningful with backends.
    pub(crate) masquerade: bool,
    /// Only meaningful without backends.
    pub(crate) when_empty: Verdict,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum Verdict {
    Reject,
    Drop,
}

impl Verdict {
    fn target(self) -> &'static str {
        match self {
            Self::Reject => "REJECT",
            Self::Drop => "DROP",
        }
    }
}

/// One rule's source condition, in terms both netfilter dataplanes spell their own way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ClassMatch {
    Pods,
    NotPods,
    /// A node address (`fib saddr type local`, `-m addrtype --src-type LOCAL`).
    Local,
    NotLocal,
    PodsNotLocal,
    NotPodsNotLocal,
}

/// The rules (each one condition) that together match the classes whose flag is set
/// (node, pod, outside), for marks that may be applied twice; a pod detector is known.
/// Called with some but not all classes set.
pub(crate) fn class_matches([node, pod, outside]: [bool; 3], node_in_pod_cidr: bool) -> Vec<ClassMatch> {
    use ClassMatch::*;
    match (node, pod, outside) {
        (true, false, true) if node_in_pod_cidr => vec![NotPods, Local],
        (true, false, true) => vec![NotPods],
        (true, false, false) => vec![Local],
        (false, true, false) if node_in_pod_cidr => vec![PodsNotLocal],
        (false, true, false) => vec![Pods],
        (false, false, true) => vec![NotPodsNotLocal],
        (true, true, false) => vec![Pods, Local],
        (false, true, true) => vec![NotLocal],
        (true, true, true) | (false, false, false) => Vec::new(),
    }
}

/// A frontend's three treatments (node, pod, outside).
pub(crate) type Treatments = [ClassTreatment; 3];

/// A service port's class treatments in the order their endpoint lists are named (iptables'
/// `KUBE-SVC-` / `KUBE-SVL-`, nftables' `service-` / `local-`): the cluster-wide list first,
/// what the node's connections to external destinations use, else what cluster IPs use; then
/// every other list.
fn lists_in_naming_order<'a>(
    treated: &'a [(&Frontend, &FrontendEntry, Treatments)],
) -> impl Iterator<Item = &'a ClassTreatment> {
    let external = |entry: &FrontendEntry| entry.kind != FrontendKind::ClusterIp;
    treated
        .iter()
        .filter(move |(_, entry, _)| external(entry))
        .map(|(_, _, t)| &t[NODE])
        .chain(
            treated.iter().filter(move |(_, entry, _)| !external(entry)).flat_map(|(_, _, t)| t.iter().rev()),
        )
        .chain(treated.iter().flat_map(|(_, _, t)| t.iter()))
}

/// A service port's frontends with their [`treatments`] in `family`; `name_list` is called with
/// each endpoint list that has endpoints, in the order the lists are named
/// ([`lists_in_naming_order`]). (Shared with the nftables dataplane, whose rules apply the same
/// per-class treatments.)
pub(crate) fn treat_service<'a>(
    frontends: &[(&'a Frontend, &'a FrontendEntry)],
    family: Family,
    mut name_list: impl FnMut(&[Backend]),
) -> Vec<(&'a Frontend, &'a FrontendEntry, Treatments)> {
    let treated: Vec<_> =
        frontends.iter().map(|(frontend, entry)| (*frontend, *entry, treatments(entry, family))).collect();
    for treatment in lists_in_naming_order(&treated) {
        if !treatment.backends.is_empty() {
            name_list(&treatment.backends);
        }
    }
    treated
}

fn treatments(entry: &FrontendEntry, family: Family) -> Treatments {
    let model = [&entry.from_node, &entry.from_pod, &entry.from_outside];
    let here = model.map(|treatment| -> Vec<Backend> {
        treatment.backends.iter().copied().filter(|backend| Family::of(backend.ip) == family).collect()
    });
    let any_here = here.iter().any(|backends| !backends.is_empty());
    let mut classes = model.into_iter().zip(here);
    [(); 3].map(|()| {
        let (treatment, backends) = classes.next().expect("three classes");
        let when_empty = if !backends.is_empty() {
            Verdict::Reject
        } else if !treatment.backends.is_empty() {
            // Endpoints of the other family only. As kube-proxy's per-family proxier sees it:
            // endpoints elsewhere (for other sources) drop, none at all reject.
            if any_here {
                Verdict::Drop
            } else {
                Verdict::Reject
            }
        } else {
            match treatment.when_empty {
                WhenEmpty::Reject => Verdict::Reject,
                WhenEmpty::Drop => Verdict::Drop,
            }
        };
        ClassTreatment { masquerade: !backends.is_empty() && treatment.masquerade, when_empty, backends }
    })
}

/// How a class is matched, and how it is named in comments.
struct Classes {
    /// The matches of pod traffic of this family (the local-traffic detector): `-s CIDR` for
    /// each pod CIDR, or `-i IF` for the pod interfaces, as kube-proxy's detectors.
    pods: Vec<String>,
    /// Some node address lies inside a pod CIDR: then "not a pod" does not imply "not the
    /// node", and rules must test the node first.
    node_in_pod_cidr: bool,
}

const LOCAL: &str = "-m addrtype --src-type LOCAL";
const NOT_LOCAL: &str = "-m addrtype ! --src-type LOCAL";

/// The `-i` argument that matches the pod interfaces: the bridge, or the prefix with
/// iptables' wildcard (`veth+`). (Shared with the IPVS mode's rules.)
pub(crate) fn interface_match(pods: &PodInterfaces) -> String {
    match pods {
        PodInterfaces::Bridge(bridge) => bridge.clone(),
        PodInterfaces::NamePrefix(prefix) => format!("{prefix}+"),
    }
}

impl Classes {
    fn new(state: &DesiredState, family: Family) -> Self {
        // A node's own packets enter through no interface (OUTPUT has none, and `-i` never
        // matches there), so with an interface detector the node is never a pod.
        if let Some(pods) = &state.sources.pod_interfaces {
            return Self { pods: vec![format!("-i {}", interface_match(pods))], node_in_pod_cidr: false };
        }
        let pod_cidrs: Vec<IpNet> =
            state.sources.pod_cidrs.iter().copied().filter(|cidr| Family::of_net(cidr) == family).collect();
        let node_in_pod_cidr =
            state.sources.node_ips.iter().any(|ip| pod_cidrs.iter().any(|cidr| cidr.contains(ip)));
        Self { pods: pod_cidrs.iter().map(|cidr| format!("-s {cidr}")).collect(), node_in_pod_cidr }
    }

    /// Matches for the classes whose flag is set, as non-exclusive rules (for marks, which
    /// may be applied twice): `None` when one rule per match cannot express it (several pod
    /// CIDRs of one family, which kube-proxy does not support either).
    fn matching(&self, set: [bool; 3]) -> Option<Vec<String>> {
        let [node, pod, outside] = set;
        // Without a detector no source is a pod.
        let pod = if self.pods.is_empty() { outside } else { pod };
        if node && pod && outside {
            return Some(vec![String::new()]);
        }
        if !node && !pod && !outside {
            return Some(Vec::new());
        }
        let pods = match self.pods.as_slice() {
            [] => {
                return Some(vec![if node { LOCAL } else { NOT_LOCAL }.to_owned()]);
            }
            [pods] => pods,
            _ => return None,
        };
        let rules = class_matches([node, pod, outside], self.node_in_pod_cidr)
            .into_iter()
            .map(|condition| match condition {
                ClassMatch::Pods => pods.clone(),
                ClassMatch::NotPods => format!("! {pods}"),
                ClassMatch::Local => LOCAL.to_owned(),
                ClassMatch::NotLocal => NOT_LOCAL.to_owned(),
                ClassMatch::PodsNotLocal => format!("{pods} {NOT_LOCAL}"),
                ClassMatch::NotPodsNotLocal => format!("! {pods} {NOT_LOCAL}"),
            })
            .collect();
        Some(rules)
    }
}

/// A rule's `-p proto -m proto -d ip --dport port` for a frontend.
fn destination(frontend: &Frontend) -> String {
    let protocol = frontend.protocol.lower_case();
    format!("-p {protocol} -m {protocol} -d {} --dport {}", host(frontend.ip), frontend.port)
}

/// An address as a single-host CIDR, as iptables-save prints it.
fn host(ip: IpAddr) -> String {
    match ip {
        IpAddr::V4(ip) => format!("{ip}/32"),
        IpAddr::V6(ip) => format!("{ip}/128"),
    }
}

/// The `comment` match's longest text (XT_MAX_COMMENT_LEN less its terminating zero).
const MAX_COMMENT_LEN: usize = 255;

fn comment(text: &str) -> String {
    // The model refuses names that are not the API server's, but a comment is one token of
    // an iptables-restore line: nothing in it may end the quoted word, the line or the
    // transaction, whatever a caller passes.
    let safe: String = text
        .chars()
        .map(|c| if c.is_ascii_graphic() && c != '"' && c != '\\' || c == ' ' { c } else { '_' })
        .take(MAX_COMMENT_LEN)
        .collect();
    format!("-m comment --comment \"{safe}\"")
}

/// Builds the rules of `family` for `state`, without health-check node ports.
pub fn generate(state: &DesiredState, family: Family, options: RuleOptions) -> Ruleset {
    generate_with_health_checks(state, family, options, &BTreeMap::new())
}

/// Builds the rules of `family` for `state`. `health_check_node_ports` (service `ns/name` to
/// its `healthCheckNodePort`) are accepted in the filter table's KUBE-NODEPORTS, as kube-proxy
/// does, so that a node whose INPUT policy drops still answers the load balancer's health
/// checks; only for services that have a frontend of this family.
pub fn generate_with_health_checks(
    state: &DesiredState,
    family: Family,
    options: RuleOptions,
    health_check_node_ports: &BTreeMap<String, u16>,
) -> Ruleset {
    let localhost = options.localhost_node_ports.filter(|_| family == Family::Ipv4).map(IpNet::V4);
    let mut builder = Builder {
        family,
        filter: Table::with_chains(&FILTER_TOP_LEVEL),
        nat: Table::with_chains(&NAT_TOP_LEVEL),
        classes: Classes::new(state, family),
        large: false,
        nodeports: BTreeMap::new(),
        localhost,
        localhost_nodeports: BTreeMap::new(),
    };
    builder.static_rules(options);

    let mut services: BTreeMap<&ServicePortName, Vec<(&Frontend, &FrontendEntry)>> = BTreeMap::new();
    for (frontend, entry) in &state.frontends {
        if Family::of(frontend.ip) == family {
            services.entry(&entry.service).or_default().push((frontend, entry));
        }
    }
    let endpoints: usize = services
        .values()
        .map(|frontends| {
            frontends.iter().flat_map(|(_, entry)| entry.all_backends()).collect::<BTreeSet<_>>().len()
        })
        .sum();
    builder.large = endpoints > LARGE_CLUSTER_ENDPOINTS;
    for (service, frontends) in &services {
        builder.service(service, frontends);
    }
    builder.nodeports();
    builder.service_cidrs(state);
    let in_family: BTreeSet<String> =
        services.keys().map(|service| format!("{}/{}", service.namespace, service.name)).collect();
    for (service, port) in health_check_node_ports.iter().filter(|(service, _)| in_family.contains(*service))
    {
        builder.filter.push(
            KUBE_NODEPORTS,
            format!(
                "{} -m tcp -p tcp --dport {port} -j ACCEPT",
                comment(&format!("{service} health check node port"))
            ),
        );
    }
    Ruleset { filter: builder.filter, nat: builder.nat, localnet_guard: localhost.is_some() }
}

struct Builder {
    family: Family,
    filter: Table,
    nat: Table,
    classes: Classes,
    large: bool,
    /// NodePort frontends by (port, protocol).
    nodeports: BTreeMap<(u16, &'static str), Vec<NodePortFrontend>>,
    /// The loopback addresses NodePorts are also served on (IPv4 only).
    localhost: Option<IpNet>,
    /// Per (port, protocol), where the nat table sends a NodePort's connections to
    /// [`Self::localhost`]: as the first of its frontends (all of a service's NodePort
    /// frontends are treated alike).
    localhost_nodeports: BTreeMap<(u16, &'static str), Option<String>>,
}

/// A NodePort frontend: its address, where the nat table sends it (nowhere without
/// endpoints), and its service (`ns/name:port`).
type NodePortFrontend = (IpAddr, Option<String>, String);

/// One service port's chains while they are being built.
struct ServiceChains {
    /// `ns/name:port`.
    name: String,
    frontend_protocol: crate::model::Protocol,
    affinity: Option<u64>,
    /// Endpoint lists in the order their chains were named; the first is `KUBE-SVC-`, the
    /// second `KUBE-SVL-`.
    lists: Vec<Vec<Backend>>,
    /// Masquerade rules at the top of each list's chain (cluster IPs, as kube-proxy).
    list_prefix_rules: Vec<Vec<String>>,
    /// Entry chains (`KUBE-EXT-`) by content.
    entries: Vec<(String, Vec<String>)>,
    /// Firewall chains (`KUBE-FW-`) by content.
    firewalls: Vec<(String, Vec<String>)>,
}

impl ServiceChains {
    fn list_chain(&self, index: usize) -> String {
        match index {
            0 => service_chain(names::SERVICE_PREFIX, &self.name, self.frontend_protocol),
            1 => service_chain(names::LOCAL_PREFIX, &self.name, self.frontend_protocol),
            n => service_chain(names::SERVICE_PREFIX, &format!("{}#{n}", self.name), self.frontend_protocol),
        }
    }

    fn list_index(&mut self, backends: &[Backend]) -> usize {
        match self.lists.iter().position(|list| list == backends) {
            Some(index) => index,
            None => {
                self.lists.push(backends.to_vec());
                self.list_prefix_rules.push(Vec::new());
                self.lists.len() - 1
            }
        }
    }

    /// The name of the chain with `rules` among `chains` of `prefix`: the service's own hash
    /// for the first content, then disambiguated ones.
    fn named(
        chains: &mut Vec<(String, Vec<String>)>,
        prefix: &str,
        base: &str,
        protocol: crate::model::Protocol,
        rules: Vec<String>,
    ) -> String {
        if let Some((name, _)) = chains.iter().find(|(_, existing)| *existing == rules) {
            return name.clone();
        }
        let name = match chains.len() {
            0 => service_chain(prefix, base, protocol),
            n => service_chain(prefix, &format!("{base}#{n}"), protocol),
        };
        chains.push((name.clone(), rules));
        name
    }
}

impl Builder {
    fn static_rules(&mut self, options: RuleOptions) {
        let mark = format!("{MASQUERADE_MARK}/{MASQUERADE_MARK}");
        self.nat.push(KUBE_POSTROUTING, format!("-m mark ! --mark {mark} -j RETURN"));
        // Cleared so that a packet that traverses the stack again is not masqueraded twice.
        self.nat.push(KUBE_POSTROUTING, format!("-j MARK --xor-mark {MASQUERADE_MARK}"));
        let mut masquerade =
            format!("{} -j MASQUERADE", comment("kubernetes service traffic requiring SNAT"));
        if options.random_fully {
            masquerade.push_str(" --random-fully");
        }
        self.nat.push(KUBE_POSTROUTING, masquerade);
        self.nat.push(KUBE_MARK_MASQ, format!("-j MARK --or-mark {MASQUERADE_MARK}"));

        if !options.conntrack_tcp_liberal {
            self.filter.push(KUBE_FORWARD, "-m conntrack --ctstate INVALID -j DROP".to_owned());
        }
        self.filter.push(
            KUBE_FORWARD,
            format!("{} -m mark --mark {mark} -j ACCEPT", comment("kubernetes forwarding rules")),
        );
        self.filter.push(
            KUBE_FORWARD,
            format!(
                "{} -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT",
                comment("kubernetes forwarding conntrack rule")
            ),
        );
    }

    fn service(&mut self, service: &ServicePortName, frontends: &[(&Frontend, &FrontendEntry)]) {
        let name = names::service_port_string(service);
        let protocol = service.protocol;
        let mut chains = ServiceChains {
            name: name.clone(),
            frontend_protocol: protocol,
            affinity: frontends.iter().find_map(|(_, entry)| entry.affinity).map(|timeout| timeout.as_secs()),
            lists: Vec::new(),
            list_prefix_rules: Vec::new(),
            entries: Vec::new(),
            firewalls: Vec::new(),
        };
        // Name the endpoint lists: the cluster-wide list first (what the node's connections to
        // external destinations use, else what cluster IPs use), so that it gets KUBE-SVC-.
        let treated = treat_service(frontends, self.family, |backends| {
            chains.list_index(backends);
        });

        for (frontend, entry, treatments) in &treated {
            self.frontend(&mut chains, frontend, entry, treatments);
        }

        // Endpoint chains and endpoint-list chains.
        let service_comment = comment(&name);
        let endpoint_comment = if self.large { String::new() } else { format!("{service_comment} ") };
        let mut endpoints = BTreeSet::new();
        for (index, list) in chains.lists.iter().enumerate() {
            let chain = chains.list_chain(index);
            let mut rules = chains.list_prefix_rules[index].clone();
            if let Some(seconds) = chains.affinity {
                for backend in list {
                    let sep = endpoint_chain(&name, protocol, backend);
                    rules.push(format!(
                        "{endpoint_comment}-m recent --name {sep} --rcheck --seconds {seconds} --reap -j {sep}"
                    ));
                }
            }
            for (i, backend) in list.iter().enumerate() {
                let sep = endpoint_chain(&name, protocol, backend);
                let comment =
                    if self.large { String::new() } else { comment(&format!("{name} -> {backend}")) + " " };
                let remaining = list.len() - i;
                if remaining > 1 {
                    rules.push(format!(
                        "{comment}-m statistic --mode random --probability {} -j {sep}",
                        probability(remaining)
                    ));
                } else {
                    rules.push(format!("{comment}-j {sep}"));
                }
                endpoints.insert(*backend);
            }
            self.nat.chains.insert(chain, rules);
        }
        let protocol_text = protocol.lower_case();
        for backend in endpoints {
            let sep = endpoint_chain(&name, protocol, &backend);
            let recent = if chains.affinity.is_some() {
                format!("-m recent --name {sep} --set ")
            } else {
                String::new()
            };
            let rules = vec![
                format!("{endpoint_comment}-s {} -j {KUBE_MARK_MASQ}", host(backend.ip)),
                format!(
                    "{endpoint_comment}{recent}-p {protocol_text} -m {protocol_text} -j DNAT --to-destination {backend}"
                ),
            ];
            self.nat.chains.insert(sep, rules);
        }
        for (chain, rules) in chains.entries.into_iter().chain(chains.firewalls) {
            self.nat.chains.insert(chain, rules);
        }
    }

    fn frontend(
        &mut self,
        chains: &mut ServiceChains,
        frontend: &Frontend,
        entry: &FrontendEntry,
        treatments: &Treatments,
    ) {
        let name = chains.name.clone();
        let all_empty = treatments.iter().all(|t| t.backends.is_empty());
        let uniform_list = treatments.iter().all(|t| t.backends == treatments[NODE].backends);
        let dest = destination(frontend);
        let kind_text = match entry.kind {
            FrontendKind::ClusterIp => "cluster IP",
            FrontendKind::ExternalIp => "external IP",
            FrontendKind::LoadBalancer => "loadbalancer IP",
            FrontendKind::NodePort => "node port",
        };

        // Where the nat table sends the frontend's connections (None: nowhere, all judged by
        // the filter table).
        let mut target: Option<String> = None;
        if !all_empty {
            let inline = (entry.kind == FrontendKind::ClusterIp && uniform_list)
                .then(|| self.classes.matching(treatments.clone().map(|t| t.masquerade)))
                .flatten();
            match inline {
                Some(masquerade_matches) => {
                    // kube-proxy's cluster IP: masquerade rules for this destination at the top of
                    // the endpoint chain.
                    let index = chains.list_index(&treatments[NODE].backends);
                    for matches in masquerade_matches {
                        let matches = if matches.is_empty() { String::new() } else { format!(" {matches}") };
                        chains.list_prefix_rules[index].push(format!(
                            "{} {dest}{matches} -j {KUBE_MARK_MASQ}",
                            comment(&format!("{name} {kind_text}"))
                        ));
                    }
                    target = Some(chains.list_chain(index));
                }
                None => {
                    let external = entry.kind != FrontendKind::ClusterIp;
                    let rules = self.dispatch(chains, treatments, external);
                    let base = if external { name.clone() } else { format!("{name} cluster IP") };
                    target = Some(ServiceChains::named(
                        &mut chains.entries,
                        names::EXTERNAL_PREFIX,
                        &base,
                        chains.frontend_protocol,
                        rules,
                    ));
                }
            }
        }

        // Source ranges.
        let allowed: Vec<&IpNet> =
            entry.allowed_sources.iter().filter(|range| Family::of_net(range) == self.family).collect();
        let mut nat_target = target.clone();
        if !entry.allowed_sources.is_empty() {
            match &target {
                Some(target) => {
                    let mut rules: Vec<String> = allowed
                        .iter()
                        .map(|range| {
                            format!("{} -s {range} -j {target}", comment(&format!("{name} {kind_text}")))
                        })
                        .collect();
                    rules.push(comment(&format!(
                        "other traffic to {name} will be dropped by {KUBE_PROXY_FIREWALL}"
                    )));
                    let firewall = ServiceChains::named(
                        &mut chains.firewalls,
                        names::FIREWALL_PREFIX,
                        &name,
                        chains.frontend_protocol,
                        rules,
                    );
                    self.filter.push(
                        KUBE_PROXY_FIREWALL,
                        format!(
                            "{} {dest} -j DROP",
                            comment(&format!("{name} traffic not accepted by {firewall}"))
                        ),
                    );
                    nat_target = Some(firewall);
                }
                None => {
                    // Nothing is DNATed: let the allowed sources on to the reject below.
                    for range in &allowed {
                        self.filter.push(
                            KUBE_PROXY_FIREWALL,
                            format!(
                                "{} {dest} -s {range} -j RETURN",
                                comment(&format!("{name} {kind_text}"))
                            ),
                        );
                    }
                    self.filter.push(
                        KUBE_PROXY_FIREWALL,
                        format!(
                            "{} {dest} -j DROP",
                            comment(&format!("{name} traffic not in its source ranges"))
                        ),
                    );
                }
            }
        }

        // The nat table's entry point.
        match entry.kind {
            FrontendKind::NodePort => {
                let key = (frontend.port, frontend.protocol.lower_case());
                if let (Some(localhost), false) =
                    (self.localhost, self.localhost_nodeports.contains_key(&key))
                {
                    self.localhost_nodeports.insert(key, nat_target.clone());
                    // What the nat table does not DNAT is judged as on the node's addresses.
                    let protocol = key.1;
                    let dest =
                        format!("-p {protocol} -m {protocol} -d {localhost} --dport {}", frontend.port);
                    for rule in self.empty_rules(&name, treatments, &dest) {
                        self.filter.push(KUBE_EXTERNAL_SERVICES, rule);
                    }
                }
                self.nodeports.entry(key).or_default().push((frontend.ip, nat_target, name.clone()));
            }
            _ => {
                if let Some(target) = nat_target {
                    self.nat.push(
                        KUBE_SERVICES,
                        format!("{} {dest} -j {target}", comment(&format!("{name} {kind_text}"))),
                    );
                }
            }
        }

        // The filter table judges what was not DNATed.
        let chain =
            if entry.kind == FrontendKind::ClusterIp { KUBE_SERVICES } else { KUBE_EXTERNAL_SERVICES };
        for rule in self.empty_rules(&name, treatments, &dest) {
            self.filter.push(chain, rule);
        }
    }

    /// Rules that classify the source and apply its class's treatment, for an entry chain.
    fn dispatch(&self, chains: &mut ServiceChains, treatments: &Treatments, external: bool) -> Vec<String> {
        let name = chains.name.clone();
        let what =
            if external { format!("{name} external destinations") } else { format!("{name} cluster IP") };
        let [node, pod, outside] = [&treatments[NODE], &treatments[POD], &treatments[OUTSIDE]];
        let has_pods = !self.classes.pods.is_empty();
        let emit_pod = has_pods && pod != outside;
        let emit_node = node != outside || (emit_pod && self.classes.node_in_pod_cidr && node != pod);
        let mut rules = Vec::new();
        let mut class_rules =
            |matches: &str, treatment: &ClassTreatment, label: &str, rules: &mut Vec<String>| {
                if treatment.backends.is_empty() {
                    let note = comment(&format!("{label}traffic for {what}: no endpoints"));
                    rules.push(join(&[&note, matches, "-j RETURN"]));
                    return;
                }
                if treatment.masquerade {
                    let note = comment(&format!("masquerade {label}traffic for {what}"));
                    rules.push(join(&[&note, matches, "-j", KUBE_MARK_MASQ]));
                }
                let index = chains.list_index(&treatment.backends);
                let target = chains.list_chain(index);
                let note = if label.is_empty() {
                    String::new()
                } else {
                    comment(&format!("route {label}traffic for {what}"))
                };
                rules.push(join(&[&note, matches, "-j", &target]));
            };
        if emit_node {
            class_rules(LOCAL, node, "LOCAL ", &mut rules);
        }
        if emit_pod {
            for pods in &self.classes.pods {
                class_rules(pods, pod, "pod ", &mut rules);
            }
        }
        if !outside.backends.is_empty() {
            class_rules("", outside, "", &mut rules);
        }
        rules
    }

    /// Filter rules for the classes without endpoints: REJECT or DROP whatever the nat table
    /// did not DNAT. Classes with endpoints were DNATed, so one rule without a source match
    /// serves all empty classes when they agree.
    fn empty_rules(&self, name: &str, treatments: &Treatments, dest: &str) -> Vec<String> {
        let text = |verdict: Verdict| match verdict {
            Verdict::Reject => format!("{name} has no endpoints"),
            Verdict::Drop => format!("{name} has no local endpoints"),
        };
        let outside = &treatments[OUTSIDE];
        let outside_verdict = outside.backends.is_empty().then_some(outside.when_empty);
        let mut rules = Vec::new();
        let mut guarded = |matches: &str, treatment: &ClassTreatment| {
            if treatment.backends.is_empty() && Some(treatment.when_empty) != outside_verdict {
                rules.push(format!(
                    "{} {dest} {matches} -j {}",
                    comment(&text(treatment.when_empty)),
                    treatment.when_empty.target()
                ));
            }
        };
        guarded(LOCAL, &treatments[NODE]);
        for pods in &self.classes.pods {
            guarded(pods, &treatments[POD]);
        }
        if let Some(verdict) = outside_verdict {
            rules.push(format!("{} {dest} -j {}", comment(&text(verdict)), verdict.target()));
        }
        rules
    }

    /// KUBE-NODEPORTS, and the jumps to it at the end of KUBE-SERVICES.
    fn nodeports(&mut self) {
        let addresses: BTreeSet<IpAddr> = self.nodeports.values().flatten().map(|(ip, _, _)| *ip).collect();
        for ((port, protocol), frontends) in std::mem::take(&mut self.nodeports) {
            let everywhere = frontends.iter().map(|(ip, _, _)| *ip).collect::<BTreeSet<_>>() == addresses
                && frontends.iter().all(|(_, target, _)| *target == frontends[0].1);
            for (ip, target, service) in &frontends {
                let Some(target) = target else { continue };
                let mut rule = format!("{} -p {protocol} -m {protocol}", comment(service));
                if !everywhere {
                    let _ = write!(rule, " -d {}", host(*ip));
                }
                let _ = write!(rule, " --dport {port} -j {target}");
                self.nat.push(KUBE_NODEPORTS, rule);
                if everywhere {
                    break;
                }
            }
            // Localhost: the rule above without a destination serves it too; else its own.
            if let (Some(localhost), false) = (self.localhost, everywhere) {
                if let Some(Some(target)) = self.localhost_nodeports.get(&(port, protocol)) {
                    let service = &frontends[0].2;
                    self.nat.push(
                        KUBE_NODEPORTS,
                        format!(
                            "{} -p {protocol} -m {protocol} -d {localhost} --dport {port} -j {target}",
                            comment(service)
                        ),
                    );
                }
            }
        }
        let destinations = addresses.into_iter().map(host).chain(
            self.localhost.filter(|_| !self.localhost_nodeports.is_empty()).map(|net| net.to_string()),
        );
        for destination in destinations {
            self.nat.push(
                KUBE_SERVICES,
                format!(
                    "{} -d {destination} -j {KUBE_NODEPORTS}",
                    comment("kubernetes service nodeports; NOTE: this must be the last rule in this chain"),
                ),
            );
        }
    }

    /// Connections to addresses of the service CIDRs that are no cluster IP are dropped.
    fn service_cidrs(&mut self, state: &DesiredState) {
        let cidrs: Vec<&IpNet> =
            state.service_cidrs.iter().filter(|cidr| Family::of_net(cidr) == self.family).collect();
        if cidrs.is_empty() {
            return;
        }
        for ip in &state.cluster_ips {
            if cidrs.iter().any(|cidr| cidr.contains(ip)) {
                self.filter.push(KUBE_SERVICE_CIDRS, format!("-d {} -j RETURN", host(*ip)));
            }
        }
        self.filter.push(
            KUBE_SERVICE_CIDRS,
            format!("{} -j DROP", comment("service CIDR address that is no service's cluster IP")),
        );
        for cidr in cidrs {
            self.filter.push(
                KUBE_SERVICES,
                format!("{} -d {cidr} -j {KUBE_SERVICE_CIDRS}", comment("unallocated service IPs")),
            );
        }
    }
}

/// The non-empty parts, separated by spaces.
fn join(parts: &[&str]) -> String {
    parts.iter().filter(|part| !part.is_empty()).copied().collect::<Vec<_>>().join(" ")
}

/// kube-proxy's `1/n` with ten decimals.
fn probability(n: usize) -> String {
    format!("{:.10}", 1.0 / n as f64)
}

/// The restore-format text of a whole ruleset (for tests and debugging).
pub fn render_all(ruleset: &Ruleset) -> String {
    let mut text = String::new();
    for table in TableName::ALL {
        let _ = writeln!(text, "*{}", table.as_str());
        for chain in ruleset.table(table).chains.keys() {
            let _ = writeln!(text, ":{chain} - [0:0]");
        }
        for (chain, rules) in &ruleset.table(table).chains {
            for rule in rules {
                let _ = writeln!(text, "-A {chain} {rule}");
            }
        }
        text.push_str("COMMIT\n");
    }
    text
}

#[cfg(test)]
mod tests;
