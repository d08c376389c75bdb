//! The desired state as one nftables table per IP family (`ip vipr`, `ip6 vipr`), with
//! kube-proxy's nftables structure: the service lookup is one verdict-map lookup
//! (`service-ips`, `service-nodeports`), whatever the number of services. Pure, so the
//! generation and the batches are unit-tested without a kernel.
//!
//! ```text
//! nat-prerouting, nat-output ─► services ─ daddr . proto . port vmap @service-ips ─► goto
//!                                        └ @nodeport-ips: proto . port vmap @service-nodeports
//!     pick-<proto>-<list>-<n> (shared): dnat to from @endpoints-<proto>-<list>, keyed by
//!                           daddr . dport . numgen random mod n; what the verdicts of a
//!                           list with nothing to do first go to, without a chain of its own
//!     service-* / local-*   (an endpoint list with rules of its own) cluster IPs' masquerade
//!                           rules, then goto pick-…; ClientIP affinity: saddr in
//!                           @affinity-* ─► that endpoint, then numgen random mod n 0 ─►
//!                           dnat to endpoint (1/n, 1/(n-1) … 1)
//!     external-*            the source class (node: fib saddr type local, pods, the rest):
//!                           [jump mark-for-masquerade] goto service-* / local-*, or return
//! nat-postrouting ─► masquerading: hairpin (saddr . daddr in @hairpin-endpoints) and marked
//! filter (ct state new) firewall-check (before DNAT): daddr . proto . port vmap @firewall-ips
//!        ─► firewall-*: saddr in a source range ─► return, else drop
//!        service-endpoints-check (after DNAT): what was not DNATed and has no endpoints:
//!        vmap @no-endpoint-services / @no-endpoint-nodeports ─► reject or drop
//!        cluster-ips-check (after DNAT): daddr @cluster-ips ─► reject (a port no frontend
//!        serves); daddr in a service CIDR ─► drop (no service's cluster IP)
//! ```
//!
//! Endpoints are elements of a few shared endpoint maps, picked by a few shared `pick-` chains
//! (a cascade of `numgen` rules in the list chain, as iptables' `statistic` rules, only with
//! ClientIP affinity), not by kube-proxy's per-service anonymous verdict maps: the kernel
//! names each anonymous set by walking all sets of the table, so creating 10,000 of them is
//! quadratic (24 s here for 10k services, against under 1 s without), and a shared named map
//! that many rules reference costs each of its bindings a walk of all its elements
//! (docs/benchmarks.md, "nftables"). A service whose list needs no rule before the pick (no
//! masquerade mark, no affinity) has no chain: its verdicts go to the `pick-` chain, so that
//! 10k such services are 10k fewer chains for `nft -f` and the kernel, and a change of their
//! endpoint count is elements alone. For the same reason hairpin masquerading is one set
//! lookup in `masquerading` rather than a rule in a per-endpoint chain.
use std::{
    collections::{BTreeMap, BTreeSet},
    fmt::Write as _,
    net::IpAddr,
};

use ipnet::IpNet;

use crate::dataplane::iptables::{
    names::service_chain,
    ruleset::{
        class_matches, treat_service, ClassMatch, ClassTreatment, Family, Treatments, Verdict,
        MASQUERADE_MARK, NODE, OUTSIDE, POD,
    },
};
use crate::model::{
    Backend, DesiredState, Frontend, FrontendEntry, FrontendKind, PodInterfaces, ServicePortName,
};

/// The name of vipr's table in each family.
pub const TABLE: &str = "vipr";

pub const SERVICE_IPS: &str = "service-ips";
pub const SERVICE_NODEPORTS: &str = "service-nodeports";
pub const NODEPORT_IPS: &str = "nodeport-ips";
pub const NO_ENDPOINT_SERVICES: &str = "no-endpoint-services";
pub const NO_ENDPOINT_NODEPORTS: &str = "no-endpoint-nodeports";
pub const FIREWALL_IPS: &str = "firewall-ips";
pub const CLUSTER_IPS: &str = "cluster-ips";
pub const HAIRPIN_ENDPOINTS: &str = "hairpin-endpoints";
pub const POD_CIDRS: &str = "pod-cidrs";

const SERVICES: &str = "services";
const MASQUERADING: &str = "masquerading";
const MARK_FOR_MASQUERADE: &str = "mark-for-masquerade";
const REJECT_CHAIN: &str = "reject-chain";
const FIREWALL_CHECK: &str = "firewall-check";
const SERVICE_ENDPOINTS_CHECK: &str = "service-endpoints-check";
const CLUSTER_IPS_CHECK: &str = "cluster-ips-check";

/// Per-service chain prefixes.
pub const SERVICE_PREFIX: &str = "service-";
pub const LOCAL_PREFIX: &str = "local-";
pub const EXTERNAL_PREFIX: &str = "external-";
pub const FIREWALL_PREFIX: &str = "firewall-";
pub const NO_ENDPOINTS_PREFIX: &str = "no-endpoints-";
pub const AFFINITY_PREFIX: &str = "affinity-";
/// Shared chains that pick one of n endpoints from an endpoint map (`pick-tcp-0-3`).
pub const PICK_PREFIX: &str = "pick-";
/// The endpoint maps, one per protocol and list index of a service (`endpoints-tcp-0`: the
/// cluster-wide list, `endpoints-tcp-1`: the local one, ...): frontend . port . slot →
/// endpoint. Per protocol, since nft 1.0.6 cannot read back a rule whose key has
/// `meta l4proto` and `th dport` after a protocol match.
pub const ENDPOINTS_PREFIX: &str = "endpoints-";
/// How many endpoint maps there are: a service's lists beyond are numgen cascades.
const ENDPOINT_MAPS: usize = 3;

/// Elements per `add element` line: long lines cost nft nothing, but error messages quote them.
const ELEMENTS_PER_LINE: usize = 1000;

/// `ip` or `ip6`: the table family, and the address keyword of matches.
pub fn family_name(family: Family) -> &'static str {
    match family {
        Family::Ipv4 => "ip",
        Family::Ipv6 => "ip6",
    }
}

fn address_type(family: Family) -> &'static str {
    match family {
        Family::Ipv4 => "ipv4_addr",
        Family::Ipv6 => "ipv6_addr",
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chain {
    /// A base chain's `type … hook … priority …;`.
    pub hook: Option<&'static str>,
    pub rules: Vec<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum SetKind {
    Set,
    Map,
}

impl SetKind {
    fn keyword(self) -> &'static str {
        match self {
            Self::Set => "set",
            Self::Map => "map",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Set {
    pub kind: SetKind,
    /// The declaration's body: `type …; flags …;`.
    pub spec: String,
    /// The packet path fills it (`update @set`): its elements are the kernel's, never
    /// flushed or compared.
    pub dynamic: bool,
    /// Key to value (maps) or to `None` (sets).
    pub elements: BTreeMap<String, Option<String>>,
}

impl Set {
    fn new(kind: SetKind, spec: String) -> Self {
        Self { kind, spec, dynamic: false, elements: BTreeMap::new() }
    }
}

/// Everything vipr wants in one family's table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ruleset {
    pub family: Family,
    pub chains: BTreeMap<String, Chain>,
    pub sets: BTreeMap<String, Set>,
    /// How many services lead to each `hairpin-endpoints` element: services share endpoints,
    /// and a partial sync deletes an element only when the last one no longer does.
    pub hairpin_users: BTreeMap<String, usize>,
    /// How many endpoint lists go to each shared `pick-` chain, for the same reason.
    pub pick_users: BTreeMap<String, usize>,
}

impl Ruleset {
    pub fn rules(&self) -> usize {
        self.chains.values().map(|chain| chain.rules.len()).sum()
    }

    pub fn elements(&self) -> usize {
        self.sets.values().map(|set| set.elements.len()).sum()
    }

    fn chain(&mut self, name: &str, hook: Option<&'static str>, rules: Vec<String>) {
        self.chains.insert(name.to_owned(), Chain { hook, rules });
    }

    fn element(&mut self, set: &str, key: String, value: Option<String>) {
        self.sets.get_mut(set).expect("declared set").elements.insert(key, value);
    }
}

/// The readable tail of a per-service name: `ns/name/proto/port`, with anything nft would not
/// read as part of a name replaced (names are the API server's, but a name is one token of
/// the batch, whatever a caller passes).
fn readable(service: &ServicePortName) -> String {
    let text =
        format!("{}/{}/{}/{}", service.namespace, service.name, service.protocol.lower_case(), service.port);
    text.chars()
        .map(|c| if c.is_ascii_alphanumeric() || "/-_.".contains(c) { c } else { '_' })
        .take(180)
        .collect()
}

/// `prefix` + a hash of `key` + the service's readable name: unique and stable.
fn service_name(prefix: &str, service: &ServicePortName, key: &str) -> String {
    let hash = service_chain("", key, service.protocol);
    format!("{prefix}{hash}-{}", readable(service))
}

/// How a source class is matched.
struct Classes {
    /// Pod traffic of this family and its negation, or `None` without a detector.
    pods: Option<(String, String)>,
    node_in_pod_cidr: bool,
}

const LOCAL: &str = "fib saddr type local";
const NOT_LOCAL: &str = "fib saddr type != local";

impl Classes {
    fn new(state: &DesiredState, family: Family) -> (Self, Vec<IpNet>) {
        let addr = family_name(family);
        if let Some(pods) = &state.sources.pod_interfaces {
            let name = match pods {
                PodInterfaces::Bridge(bridge) => bridge.clone(),
                PodInterfaces::NamePrefix(prefix) => format!("{prefix}*"),
            };
            let name: String = name.chars().filter(|c| *c != '"' && *c != '\\').collect();
            return (
                Self {
                    pods: Some((format!("iifname \"{name}\""), format!("iifname != \"{name}\""))),
                    node_in_pod_cidr: false,
                },
                Vec::new(),
            );
        }
        let cidrs: Vec<IpNet> =
            state.sources.pod_cidrs.iter().copied().filter(|cidr| Family::of_net(cidr) == family).collect();
        let node_in_pod_cidr =
            state.sources.node_ips.iter().any(|ip| cidrs.iter().any(|cidr| cidr.contains(ip)));
        let pods = match cidrs.as_slice() {
            [] => None,
            [cidr] => Some((format!("{addr} saddr {cidr}"), format!("{addr} saddr != {cidr}"))),
            _ => Some((format!("{addr} saddr @{POD_CIDRS}"), format!("{addr} saddr != @{POD_CIDRS}"))),
        };
        let set = if cidrs.len() > 1 { cidrs } else { Vec::new() };
        (Self { pods, node_in_pod_cidr }, set)
    }

    /// Matches (each one rule) for the classes whose flag is set, for marks that may be
    /// applied twice.
    fn matching(&self, set: [bool; 3]) -> Vec<String> {
        let [node, pod, outside] = set;
        let pod = if self.pods.is_none() { outside } else { pod };
        if node && pod && outside {
            return vec![String::new()];
        }
        if !node && !pod && !outside {
            return Vec::new();
        }
        let Some((pods, not_pods)) = &self.pods else {
            return vec![if node { LOCAL } else { NOT_LOCAL }.to_owned()];
        };
        class_matches([node, pod, outside], self.node_in_pod_cidr)
            .into_iter()
            .map(|condition| match condition {
                ClassMatch::Pods => pods.clone(),
                ClassMatch::NotPods => not_pods.clone(),
                ClassMatch::Local => LOCAL.to_owned(),
                ClassMatch::NotLocal => NOT_LOCAL.to_owned(),
                ClassMatch::PodsNotLocal => format!("{pods} {NOT_LOCAL}"),
                ClassMatch::NotPodsNotLocal => format!("{not_pods} {NOT_LOCAL}"),
            })
            .collect()
    }
}

fn join(parts: &[&str]) -> String {
    parts.iter().filter(|part| !part.is_empty()).copied().collect::<Vec<_>>().join(" ")
}

fn verdict_value(verdict: Verdict) -> String {
    match verdict {
        Verdict::Reject => format!("goto {REJECT_CHAIN}"),
        Verdict::Drop => "drop".to_owned(),
    }
}

fn verdict_statement(verdict: Verdict) -> &'static str {
    match verdict {
        Verdict::Reject => "reject",
        Verdict::Drop => "drop",
    }
}

fn endpoint_map(protocol: &str, index: usize) -> String {
    format!("{ENDPOINTS_PREFIX}{protocol}-{index}")
}

/// Builds `family`'s table for `state`.
pub fn generate(state: &DesiredState, family: Family) -> Ruleset {
    let addresses = nodeport_addresses(&state.frontends, family);
    let mut ruleset = generate_services(state, &state.frontends, family, None, &addresses);
    for ip in &addresses {
        ruleset.element(NODEPORT_IPS, ip.to_string(), None);
    }
    for ip in state.cluster_ips.iter().filter(|ip| Family::of(**ip) == family) {
        ruleset.element(CLUSTER_IPS, ip.to_string(), None);
    }
    ruleset
}

/// The addresses of `family` that NodePorts are served on (the `nodeport-ips` set).
pub fn nodeport_addresses(frontends: &BTreeMap<Frontend, FrontendEntry>, family: Family) -> BTreeSet<IpAddr> {
    frontends
        .iter()
        .filter(|(frontend, entry)| entry.kind == FrontendKind::NodePort && Family::of(frontend.ip) == family)
        .map(|(frontend, _)| frontend.ip)
        .collect()
}

/// The fixed chains and sets (of `state`'s classifiers), and the chains and elements of the
/// `frontends` of `services` (all with `None`); NodePorts are told apart by
/// `nodeport_addresses`, the addresses of all of them. Without `nodeport-ips` and
/// `cluster-ips` elements: a partial sync compares the services it names alone, as they
/// were (the frontends last programmed) and as they are wanted now.
pub fn generate_services(
    state: &DesiredState,
    frontends: &BTreeMap<Frontend, FrontendEntry>,
    family: Family,
    services: Option<&BTreeSet<ServicePortName>>,
    nodeport_addresses: &BTreeSet<IpAddr>,
) -> Ruleset {
    let addr = family_name(family);
    let addr_type = address_type(family);
    let mut ruleset = Ruleset {
        family,
        chains: BTreeMap::new(),
        sets: BTreeMap::new(),
        hairpin_users: BTreeMap::new(),
        pick_users: BTreeMap::new(),
    };
    let (classes, pod_cidr_set) = Classes::new(state, family);

    let key3 = format!("type {addr_type} . inet_proto . inet_service : verdict ;");
    let key2 = "type inet_proto . inet_service : verdict ;".to_owned();
    for (name, kind, spec) in [
        (SERVICE_IPS, SetKind::Map, key3.clone()),
        (SERVICE_NODEPORTS, SetKind::Map, key2.clone()),
        (NO_ENDPOINT_SERVICES, SetKind::Map, key3.clone()),
        (NO_ENDPOINT_NODEPORTS, SetKind::Map, key2),
        (FIREWALL_IPS, SetKind::Map, key3),
        (NODEPORT_IPS, SetKind::Set, format!("type {addr_type} ;")),
        (CLUSTER_IPS, SetKind::Set, format!("type {addr_type} ;")),
        (HAIRPIN_ENDPOINTS, SetKind::Set, format!("type {addr_type} . {addr_type} ;")),
    ] {
        ruleset.sets.insert(name.to_owned(), Set::new(kind, spec));
    }
    for protocol in ["tcp", "udp", "sctp"] {
        for index in 0..ENDPOINT_MAPS {
            let spec = format!(
                "typeof {addr} daddr . {protocol} dport . numgen random mod 1 : {addr} daddr . {protocol} dport ;"
            );
            ruleset.sets.insert(endpoint_map(protocol, index), Set::new(SetKind::Map, spec));
        }
    }
    if !pod_cidr_set.is_empty() {
        let mut set = Set::new(SetKind::Set, format!("type {addr_type} ; flags interval ;"));
        set.elements = pod_cidr_set.iter().map(|cidr| (cidr.to_string(), None)).collect();
        ruleset.sets.insert(POD_CIDRS.to_owned(), set);
    }

    // The fixed chains: hooks as kube-proxy's (filter at dstnat - 10 before DNAT; the
    // endpoint checks after it, so that what was DNATed is no longer seen as the frontend).
    let new = "ct state new";
    ruleset.chain(
        "filter-prerouting",
        Some("type filter hook prerouting priority -110 ;"),
        vec![format!("{new} jump {FIREWALL_CHECK}")],
    );
    ruleset.chain(
        "filter-input",
        Some("type filter hook input priority -110 ;"),
        vec![format!("{new} jump {SERVICE_ENDPOINTS_CHECK}")],
    );
    ruleset.chain(
        "filter-forward",
        Some("type filter hook forward priority -110 ;"),
        vec![format!("{new} jump {SERVICE_ENDPOINTS_CHECK}"), format!("{new} jump {CLUSTER_IPS_CHECK}")],
    );
    ruleset.chain(
        "filter-output",
        Some("type filter hook output priority -110 ;"),
        vec![format!("{new} jump {FIREWALL_CHECK}")],
    );
    ruleset.chain(
        "filter-output-post-dnat",
        Some("type filter hook output priority -90 ;"),
        vec![format!("{new} jump {SERVICE_ENDPOINTS_CHECK}"), format!("{new} jump {CLUSTER_IPS_CHECK}")],
    );
    ruleset.chain(
        "nat-prerouting",
        Some("type nat hook prerouting priority -100 ;"),
        vec![format!("jump {SERVICES}")],
    );
    ruleset.chain(
        "nat-output",
        Some("type nat hook output priority -100 ;"),
        vec![format!("jump {SERVICES}")],
    );
    ruleset.chain(
        "nat-postrouting",
        Some("type nat hook postrouting priority 100 ;"),
        vec![format!("jump {MASQUERADING}")],
    );
    ruleset.chain(
        SERVICES,
        None,
        vec![
            format!("{addr} daddr . meta l4proto . th dport vmap @{SERVICE_IPS}"),
            format!("{addr} daddr @{NODEPORT_IPS} meta l4proto . th dport vmap @{SERVICE_NODEPORTS}"),
        ],
    );
    ruleset.chain(
        SERVICE_ENDPOINTS_CHECK,
        None,
        vec![
            format!("{addr} daddr . meta l4proto . th dport vmap @{NO_ENDPOINT_SERVICES}"),
            format!("{addr} daddr @{NODEPORT_IPS} meta l4proto . th dport vmap @{NO_ENDPOINT_NODEPORTS}"),
        ],
    );
    ruleset.chain(
        FIREWALL_CHECK,
        None,
        vec![format!("{addr} daddr . meta l4proto . th dport vmap @{FIREWALL_IPS}")],
    );
    let mut cluster_ips_check = vec![format!("{addr} daddr @{CLUSTER_IPS} reject")];
    for cidr in state.service_cidrs.iter().filter(|cidr| Family::of_net(cidr) == family) {
        cluster_ips_check.push(format!("{addr} daddr {cidr} drop"));
    }
    ruleset.chain(CLUSTER_IPS_CHECK, None, cluster_ips_check);
    ruleset.chain(MARK_FOR_MASQUERADE, None, vec![format!("meta mark set meta mark | {MASQUERADE_MARK}")]);
    ruleset.chain(
        MASQUERADING,
        None,
        vec![
            // A pod that reached itself through a service: masqueraded, or it would answer
            // itself directly.
            format!(
                "ct status dnat {addr} saddr . {addr} daddr @{HAIRPIN_ENDPOINTS} masquerade fully-random"
            ),
            format!("meta mark & {MASQUERADE_MARK} == 0 return"),
            // Cleared so that a packet that traverses the stack again is not masqueraded twice.
            format!("meta mark set meta mark ^ {MASQUERADE_MARK}"),
            "masquerade fully-random".to_owned(),
        ],
    );
    ruleset.chain(REJECT_CHAIN, None, vec!["reject".to_owned()]);

    let mut by_service: BTreeMap<&ServicePortName, Vec<(&Frontend, &FrontendEntry)>> = BTreeMap::new();
    for (frontend, entry) in frontends {
        if Family::of(frontend.ip) == family
            && services.is_none_or(|services| services.contains(&entry.service))
        {
            by_service.entry(&entry.service).or_default().push((frontend, entry));
        }
    }
    let mut builder = Builder { addr, addr_type, classes, ruleset, nodeports: BTreeMap::new() };
    for (service, frontends) in &by_service {
        builder.service(service, frontends);
    }
    builder.nodeports(nodeport_addresses);
    builder.ruleset
}

/// The batch that replaces, in the kernel and in `programmed` (what it holds), the chains,
/// sets and elements `old` generated for some services (`generate_services` of the state
/// last programmed) by those `new` generates for them (of the state wanted now). Nothing of
/// any other service is looked at: the cost is that of the services changed.
pub fn replace_services(programmed: &mut Ruleset, old: &Ruleset, new: &Ruleset) -> Batch {
    let mut before = old.clone();
    let mut after = new.clone();
    // Hairpin elements are shared between services: counted, and only the touched ones compared.
    for (key, users) in &old.hairpin_users {
        if let Some(count) = programmed.hairpin_users.get_mut(key) {
            *count = count.saturating_sub(*users);
            if *count == 0 {
                programmed.hairpin_users.remove(key);
            }
        }
    }
    for (key, users) in &new.hairpin_users {
        *programmed.hairpin_users.entry(key.clone()).or_default() += users;
    }
    let touched: BTreeSet<&String> = old.hairpin_users.keys().chain(new.hairpin_users.keys()).collect();
    let held = programmed.sets.get(HAIRPIN_ENDPOINTS).map(|set| &set.elements);
    if let Some(set) = before.sets.get_mut(HAIRPIN_ENDPOINTS) {
        set.elements = touched
            .iter()
            .filter(|key| held.is_some_and(|held| held.contains_key(**key)))
            .map(|key| ((*key).clone(), None))
            .collect();
    }
    if let Some(set) = after.sets.get_mut(HAIRPIN_ENDPOINTS) {
        set.elements = touched
            .iter()
            .filter(|key| programmed.hairpin_users.contains_key(**key))
            .map(|key| ((*key).clone(), None))
            .collect();
    }
    // Pick chains too: the touched ones are in `before` when the kernel has them, in `after`
    // when some list still goes to them.
    for (key, users) in &old.pick_users {
        if let Some(count) = programmed.pick_users.get_mut(key) {
            *count = count.saturating_sub(*users);
            if *count == 0 {
                programmed.pick_users.remove(key);
            }
        }
    }
    for (key, users) in &new.pick_users {
        *programmed.pick_users.entry(key.clone()).or_default() += users;
    }
    let picks: BTreeSet<&String> = old.pick_users.keys().chain(new.pick_users.keys()).collect();
    for pick in &picks {
        let chain = new.chains.get(*pick).or_else(|| old.chains.get(*pick)).cloned();
        before.chains.remove(*pick);
        after.chains.remove(*pick);
        if let (Some(chain), true) = (&chain, programmed.chains.contains_key(*pick)) {
            before.chains.insert((*pick).clone(), chain.clone());
        }
        if let (Some(chain), true) = (chain, programmed.pick_users.contains_key(*pick)) {
            after.chains.insert((*pick).clone(), chain);
        }
    }
    let existing = Existing {
        chains: before.chains.keys().cloned().collect(),
        sets: before.sets.iter().map(|(name, set)| (name.clone(), set.kind)).collect(),
    };
    let batch = plan(&after, Some(&before), &existing);

    for name in before.chains.keys().filter(|name| !after.chains.contains_key(*name)) {
        programmed.chains.remove(name);
    }
    programmed.chains.extend(after.chains.iter().map(|(name, chain)| (name.clone(), chain.clone())));
    for name in old.sets.keys().filter(|name| !new.sets.contains_key(*name)) {
        programmed.sets.remove(name);
    }
    for (name, set) in &after.sets {
        let Some(held) = programmed.sets.get_mut(name) else {
            programmed.sets.insert(name.clone(), set.clone());
            continue;
        };
        if let Some(old_set) = before.sets.get(name) {
            for key in old_set.elements.keys() {
                held.elements.remove(key);
            }
        }
        held.elements.extend(set.elements.iter().map(|(key, value)| (key.clone(), value.clone())));
    }
    batch
}

struct Builder {
    addr: &'static str,
    addr_type: &'static str,
    classes: Classes,
    ruleset: Ruleset,
    /// NodePort frontends by (protocol, port).
    nodeports: BTreeMap<(&'static str, u16), Vec<NodePortFrontend>>,
}

/// A NodePort frontend: its address, the nat verdict and the no-endpoint verdict.
type NodePortFrontend = (IpAddr, Option<String>, Option<String>);

/// One service port's chains while they are being built.
struct ServiceChains<'a> {
    service: &'a ServicePortName,
    affinity: Option<u64>,
    /// Endpoint lists in the order their chains were named; the first is `service-`, the
    /// second `local-`.
    lists: Vec<Vec<Backend>>,
    /// Masquerade rules at the top of each list's chain (cluster IPs, as kube-proxy).
    list_prefix_rules: Vec<Vec<String>>,
    /// The frontends that reach each list: its endpoint map's keys.
    list_frontends: Vec<BTreeSet<(IpAddr, u16)>>,
    /// Chains by content (external-, firewall-, no-endpoints-).
    others: Vec<(String, Vec<String>)>,
    /// `service-ips` elements (key, nat verdict) and NodePort frontends, held until the
    /// lists' targets are known ([`list_reference`]).
    nat_elements: Vec<(String, String)>,
    nodeports: Vec<((&'static str, u16), NodePortFrontend)>,
}

/// Marks a reference to an endpoint list's target in a verdict or rule while a service is
/// built: whether a list needs a chain of its own (masquerade rules before its endpoint pick)
/// or is reached by its shared `pick-` chain directly is known only after all its frontends
/// were seen. Never in a name (`readable` keeps names to `[A-Za-z0-9/_.-]`).
const LIST_MARK: char = '\u{1}';

fn list_reference(index: usize) -> String {
    format!("{LIST_MARK}{index}{LIST_MARK}")
}

/// `text` with every [`list_reference`] replaced by that list's target.
fn resolve_lists(text: String, targets: &[String]) -> String {
    if !text.contains(LIST_MARK) {
        return text;
    }
    text.split(LIST_MARK)
        .enumerate()
        .map(|(i, part)| match i % 2 {
            0 => part,
            _ => part.parse::<usize>().ok().and_then(|index| targets.get(index)).map_or(part, String::as_str),
        })
        .collect()
}

impl ServiceChains<'_> {
    fn list_chain(&self, index: usize) -> String {
        match index {
            0 => service_name(SERVICE_PREFIX, self.service, &self.service.to_string()),
            1 => service_name(LOCAL_PREFIX, self.service, &self.service.to_string()),
            n => service_name(SERVICE_PREFIX, self.service, &format!("{}#{n}", self.service)),
        }
    }

    fn list_index(&mut self, backends: &[Backend]) -> usize {
        match self.lists.iter().position(|list| list == backends) {
            Some(index) => index,
            None => {
                self.lists.push(backends.to_vec());
                self.list_prefix_rules.push(Vec::new());
                self.list_frontends.push(BTreeSet::new());
                self.lists.len() - 1
            }
        }
    }

    /// [`Self::list_index`], for a list that `frontend` reaches.
    fn use_list(&mut self, backends: &[Backend], frontend: &Frontend) -> usize {
        let index = self.list_index(backends);
        self.list_frontends[index].insert((frontend.ip, frontend.port));
        index
    }

    /// The chain of `prefix` with `rules`: the service's own hash for the first content of
    /// that prefix, then disambiguated ones.
    fn named(&mut self, prefix: &str, rules: Vec<String>) -> String {
        if let Some((name, _)) =
            self.others.iter().find(|(name, existing)| name.starts_with(prefix) && *existing == rules)
        {
            return name.clone();
        }
        let n = self.others.iter().filter(|(name, _)| name.starts_with(prefix)).count();
        let key = if n == 0 { self.service.to_string() } else { format!("{}#{n}", self.service) };
        let name = service_name(prefix, self.service, &key);
        self.others.push((name.clone(), rules));
        name
    }

    fn affinity_set(&self, backend: &Backend, seconds: u64) -> String {
        let hash = service_chain("", &format!("{}{backend}{seconds}", self.service), self.service.protocol);
        format!("{AFFINITY_PREFIX}{hash}")
    }
}

impl Builder {
    fn service(&mut self, service: &ServicePortName, frontends: &[(&Frontend, &FrontendEntry)]) {
        let mut chains = ServiceChains {
            service,
            affinity: frontends
                .iter()
                .find_map(|(_, entry)| entry.affinity)
                .map(|timeout| timeout.as_secs().max(1)),
            lists: Vec::new(),
            list_prefix_rules: Vec::new(),
            list_frontends: Vec::new(),
            others: Vec::new(),
            nat_elements: Vec::new(),
            nodeports: Vec::new(),
        };
        let family = self.ruleset.family;
        // The cluster-wide list first, so that it gets the `service-` name.
        let treated = treat_service(frontends, family, |backends| {
            chains.list_index(backends);
        });
        for (frontend, entry, treatments) in &treated {
            self.frontend(&mut chains, frontend, entry, treatments);
        }

        let protocol = service.protocol.lower_case();
        let mut endpoints = BTreeSet::new();
        // What each list's references lead to: its own chain, or its `pick-` chain.
        let mut targets = Vec::with_capacity(chains.lists.len());
        for (index, list) in chains.lists.iter().enumerate() {
            let mut rules = chains.list_prefix_rules[index].clone();
            if let Some(seconds) = chains.affinity {
                for backend in list {
                    let set = chains.affinity_set(backend, seconds);
                    rules.push(format!(
                        "{addr} saddr @{set} update @{set} {{ {addr} saddr }} meta l4proto {protocol} dnat to {backend}",
                        addr = self.addr
                    ));
                }
            }
            if chains.affinity.is_none() && index < ENDPOINT_MAPS {
                // One goto: the endpoint is picked from the endpoint map by a shared chain,
                // so that an endpoint change is a change of map elements alone.
                let map = endpoint_map(protocol, index);
                let pick = format!("{PICK_PREFIX}{protocol}-{index}-{}", list.len());
                self.ruleset.chain(
                    &pick,
                    None,
                    vec![format!(
                        "meta l4proto {protocol} dnat {addr} addr . port to {addr} daddr . {protocol} dport . numgen random mod {n} map @{map}",
                        addr = self.addr,
                        n = list.len()
                    )],
                );
                *self.ruleset.pick_users.entry(pick.clone()).or_default() += 1;
                for (ip, port) in &chains.list_frontends[index] {
                    for (slot, backend) in list.iter().enumerate() {
                        self.ruleset.element(
                            &map,
                            format!("{ip} . {port} . {slot}"),
                            Some(format!("{} . {}", backend.ip, backend.port)),
                        );
                    }
                }
                endpoints.extend(list.iter().copied());
                if rules.is_empty() {
                    // Nothing to do before the pick (no masquerade mark): the verdicts go to
                    // the pick chain itself, and the service has no chain of its own; an
                    // endpoint count change is then a change of elements alone.
                    targets.push(pick);
                } else {
                    rules.push(format!("goto {pick}"));
                    let name = chains.list_chain(index);
                    self.ruleset.chain(&name, None, rules);
                    targets.push(name);
                }
                continue;
            }
            for (i, backend) in list.iter().enumerate() {
                let remaining = list.len() - i;
                let pick =
                    if remaining > 1 { format!("numgen random mod {remaining} 0 ") } else { String::new() };
                let update = match chains.affinity {
                    Some(seconds) => {
                        format!(
                            "update @{} {{ {} saddr }} ",
                            chains.affinity_set(backend, seconds),
                            self.addr
                        )
                    }
                    None => String::new(),
                };
                rules.push(format!("{pick}{update}meta l4proto {protocol} dnat to {backend}"));
                endpoints.insert(*backend);
            }
            let name = chains.list_chain(index);
            self.ruleset.chain(&name, None, rules);
            targets.push(name);
        }
        for backend in endpoints {
            let key = format!("{ip} . {ip}", ip = backend.ip);
            *self.ruleset.hairpin_users.entry(key.clone()).or_default() += 1;
            self.ruleset.element(HAIRPIN_ENDPOINTS, key, None);
            if let Some(seconds) = chains.affinity {
                let spec = format!("type {} ; flags dynamic,timeout ; timeout {seconds}s ;", self.addr_type);
                let mut set = Set::new(SetKind::Set, spec);
                set.dynamic = true;
                self.ruleset.sets.insert(chains.affinity_set(&backend, seconds), set);
            }
        }
        for (name, rules) in chains.others {
            let rules = rules.into_iter().map(|rule| resolve_lists(rule, &targets)).collect();
            self.ruleset.chain(&name, None, rules);
        }
        for (key, nat) in chains.nat_elements {
            self.ruleset.element(SERVICE_IPS, key, Some(resolve_lists(nat, &targets)));
        }
        for (port, (ip, nat, no_endpoints)) in chains.nodeports {
            let nat = nat.map(|nat| resolve_lists(nat, &targets));
            self.nodeports.entry(port).or_default().push((ip, nat, no_endpoints));
        }
    }

    fn frontend(
        &mut self,
        chains: &mut ServiceChains,
        frontend: &Frontend,
        entry: &FrontendEntry,
        treatments: &Treatments,
    ) {
        let addr = self.addr;
        let protocol = frontend.protocol.lower_case();
        let all_empty = treatments.iter().all(|t| t.backends.is_empty());
        let uniform_list = treatments.iter().all(|t| t.backends == treatments[NODE].backends);

        let mut target: Option<String> = None;
        if !all_empty {
            if entry.kind == FrontendKind::ClusterIp && uniform_list {
                let index = chains.use_list(&treatments[NODE].backends, frontend);
                for matches in self.classes.matching(treatments.clone().map(|t| t.masquerade)) {
                    chains.list_prefix_rules[index].push(join(&[
                        &format!("{addr} daddr {} {protocol} dport {}", frontend.ip, frontend.port),
                        &matches,
                        &format!("jump {MARK_FOR_MASQUERADE}"),
                    ]));
                }
                target = Some(list_reference(index));
            } else {
                let rules = self.dispatch(chains, frontend, treatments);
                target = Some(chains.named(EXTERNAL_PREFIX, rules));
            }
        }

        // Source ranges (of this family; a family without any of its own is not filtered).
        let family = self.ruleset.family;
        let ranges: Vec<&IpNet> =
            entry.allowed_sources.iter().filter(|range| Family::of_net(range) == family).collect();
        let key = format!("{} . {protocol} . {}", frontend.ip, frontend.port);
        if !ranges.is_empty() {
            let mut rules: Vec<String> =
                ranges.iter().map(|range| format!("{addr} saddr {range} return")).collect();
            rules.push("drop".to_owned());
            let firewall = chains.named(FIREWALL_PREFIX, rules);
            self.ruleset.element(FIREWALL_IPS, key.clone(), Some(format!("goto {firewall}")));
        }

        let no_endpoints = self.no_endpoints(chains, treatments);
        let nat = target.map(|target| format!("goto {target}"));
        if entry.kind == FrontendKind::NodePort {
            chains.nodeports.push(((protocol, frontend.port), (frontend.ip, nat, no_endpoints)));
        } else {
            if let Some(nat) = nat {
                chains.nat_elements.push((key.clone(), nat));
            }
            if let Some(verdict) = no_endpoints {
                self.ruleset.element(NO_ENDPOINT_SERVICES, key, Some(verdict));
            }
        }
    }

    /// Rules that classify the source and apply its class's treatment, for an entry chain.
    fn dispatch(
        &self,
        chains: &mut ServiceChains,
        frontend: &Frontend,
        treatments: &Treatments,
    ) -> Vec<String> {
        let [node, pod, outside] = [&treatments[NODE], &treatments[POD], &treatments[OUTSIDE]];
        let emit_pod = self.classes.pods.is_some() && pod != outside;
        let emit_node = node != outside || (emit_pod && self.classes.node_in_pod_cidr && node != pod);
        let mut rules = Vec::new();
        let mut class_rules = |matches: &str, treatment: &ClassTreatment, rules: &mut Vec<String>| {
            if treatment.backends.is_empty() {
                rules.push(join(&[matches, "return"]));
                return;
            }
            if treatment.masquerade {
                rules.push(join(&[matches, "jump", MARK_FOR_MASQUERADE]));
            }
            let index = chains.use_list(&treatment.backends, frontend);
            rules.push(join(&[matches, "goto", &list_reference(index)]));
        };
        if emit_node {
            class_rules(LOCAL, node, &mut rules);
        }
        if emit_pod {
            if let Some((pods, _)) = &self.classes.pods {
                class_rules(pods, pod, &mut rules);
            }
        }
        if !outside.backends.is_empty() {
            class_rules("", outside, &mut rules);
        }
        rules
    }

    /// The verdict for what the nat table did not DNAT: one verdict when the classes without
    /// endpoints agree, else a chain that tells them apart (classes with endpoints were
    /// DNATed and never get there). `None`: every class has endpoints.
    fn no_endpoints(&self, chains: &mut ServiceChains, treatments: &Treatments) -> Option<String> {
        let empty: Vec<(usize, Verdict)> = treatments
            .iter()
            .enumerate()
            .filter(|(_, t)| t.backends.is_empty())
            .map(|(class, t)| (class, t.when_empty))
            .collect();
        let (_, first) = *empty.first()?;
        if empty.iter().all(|(_, verdict)| *verdict == first) {
            return Some(verdict_value(first));
        }
        let mut rules = Vec::new();
        let outside = &treatments[OUTSIDE];
        let outside_verdict = outside.backends.is_empty().then_some(outside.when_empty);
        let mut guarded = |matches: &str, treatment: &ClassTreatment| {
            if treatment.backends.is_empty() && Some(treatment.when_empty) != outside_verdict {
                rules.push(format!("{matches} {}", verdict_statement(treatment.when_empty)));
            }
        };
        guarded(LOCAL, &treatments[NODE]);
        if let Some((pods, _)) = &self.classes.pods {
            guarded(pods, &treatments[POD]);
        }
        if let Some(verdict) = outside_verdict {
            rules.push(verdict_statement(verdict).to_owned());
        }
        Some(format!("goto {}", chains.named(NO_ENDPOINTS_PREFIX, rules)))
    }

    /// NodePorts: one `service-nodeports` element when a port is served alike on every
    /// NodePort address, else one `service-ips` element per address.
    fn nodeports(&mut self, addresses: &BTreeSet<IpAddr>) {
        for ((protocol, port), frontends) in std::mem::take(&mut self.nodeports) {
            let everywhere = frontends.iter().map(|(ip, _, _)| *ip).collect::<BTreeSet<_>>() == *addresses
                && frontends.iter().all(|(_, nat, empty)| (nat, empty) == (&frontends[0].1, &frontends[0].2));
            if everywhere {
                let key = format!("{protocol} . {port}");
                let (_, nat, empty) = &frontends[0];
                if let Some(nat) = nat {
                    self.ruleset.element(SERVICE_NODEPORTS, key.clone(), Some(nat.clone()));
                }
                if let Some(empty) = empty {
                    self.ruleset.element(NO_ENDPOINT_NODEPORTS, key, Some(empty.clone()));
                }
                continue;
            }
            for (ip, nat, empty) in frontends {
                let key = format!("{ip} . {protocol} . {port}");
                if let Some(nat) = nat {
                    self.ruleset.element(SERVICE_IPS, key.clone(), Some(nat));
                }
                if let Some(empty) = empty {
                    self.ruleset.element(NO_ENDPOINT_SERVICES, key, Some(empty));
                }
            }
        }
    }
}

/// What a full sync finds in the kernel: the table's chains and sets (`nft -t list chains`, `sets`, `maps`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Existing {
    pub chains: BTreeSet<String>,
    pub sets: BTreeMap<String, SetKind>,
}

impl Existing {
    /// Reads `nft -t list chains|sets|maps FAMILY` output: the chains and sets of vipr's table
    /// (other tables of the family are listed too, and skipped).
    pub fn parse(listing: &str) -> Self {
        let mut existing = Self::default();
        let mut ours = false;
        for line in listing.lines() {
            let mut words = line.split_whitespace();
            let (Some(kind), Some(second)) = (words.next(), words.next()) else {
                continue;
            };
            if kind == "table" {
                ours = words.next() == Some(TABLE);
                continue;
            }
            if !ours || words.next() != Some("{") {
                continue;
            }
            let name = second.to_owned();
            match kind {
                "chain" => {
                    existing.chains.insert(name);
                }
                "set" => {
                    existing.sets.insert(name, SetKind::Set);
                }
                "map" => {
                    existing.sets.insert(name, SetKind::Map);
                }
                _ => {}
            }
        }
        existing
    }
}

/// One `nft -f` batch and what it changes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Batch {
    pub text: String,
    /// Chains created or refilled, and deleted.
    pub chains_written: Vec<String>,
    pub chains_deleted: Vec<String>,
    pub elements_added: usize,
    pub elements_deleted: usize,
    /// Sets and maps flushed and refilled whole (full syncs).
    pub sets_flushed: usize,
    /// Tables, chains or sets created, refilled or deleted: a change `nft` must make. A
    /// partial batch without any is element additions and deletions alone, in `elements`.
    pub structural: bool,
    /// A partial batch's element changes, in the order of the text (empty for full ones).
    pub elements: Vec<ElementChange>,
    /// A table created from empty (`from_empty`): the sets whose elements are not in the
    /// text, to be added after it from the wanted ruleset.
    pub elements_apart: Vec<String>,
}

impl Batch {
    /// Nothing to change (the table line alone).
    pub fn is_empty(&self) -> bool {
        !self.structural
            && self.chains_written.is_empty()
            && self.chains_deleted.is_empty()
            && self.elements_added == 0
            && self.elements_deleted == 0
            && self.sets_flushed == 0
    }
}

/// The batch that makes the kernel go from `previous` (what the last successful batch left)
/// to `wanted`: only the chains whose rules differ (flushed and refilled), the elements
/// added or deleted, the chains and sets no longer wanted deleted.
pub fn partial(previous: &Ruleset, wanted: &Ruleset) -> Batch {
    plan(
        wanted,
        Some(previous),
        &Existing {
            chains: previous.chains.keys().cloned().collect(),
            sets: previous.sets.iter().map(|(name, set)| (name.clone(), set.kind)).collect(),
        },
    )
}

/// The batch that makes the kernel hold `wanted` whatever the table holds now (`existing`):
/// every chain of vipr's flushed and refilled, every set and map flushed and refilled
/// (affinity sets keep their clients), the rest deleted.
pub fn full(existing: &Existing, wanted: &Ruleset) -> Batch {
    plan(wanted, None, existing)
}

/// Elements of one set to add or delete ([`Batch::elements`], in the order `nft -f`
/// would be given them).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ElementChange {
    pub set: String,
    /// The set's declaration, which says how its elements are encoded.
    pub spec: String,
    pub delete: bool,
    /// Keys, and a map's values (`None` when deleting).
    pub elements: Vec<(String, Option<String>)>,
}

/// The batch that creates `wanted` where vipr has no table: the table, sets and chains as
/// text, and the elements of every set the element writer can write (`writable`) apart
/// (`Batch::elements`), to be added after it as one netlink batch. Nothing was served before, so the two transactions
/// need not be one; nft parses ~200k elements (10k services × 10 endpoints) for most of a
/// second, the kernel's netlink parse is a fraction of that.
pub fn from_empty(wanted: &Ruleset, writable: impl Fn(&Set) -> bool) -> Batch {
    let apart: BTreeSet<&String> = wanted
        .sets
        .iter()
        .filter(|(_, set)| !set.dynamic && !set.elements.is_empty() && writable(set))
        .map(|(name, _)| name)
        .collect();
    let mut batch = plan_leaving_out(wanted, None, &Existing::default(), &apart);
    batch.elements_added += apart.iter().map(|name| wanted.sets[*name].elements.len()).sum::<usize>();
    batch.elements_apart = apart.into_iter().cloned().collect();
    batch
}

fn plan(wanted: &Ruleset, previous: Option<&Ruleset>, existing: &Existing) -> Batch {
    plan_leaving_out(wanted, previous, existing, &BTreeSet::new())
}

/// [`plan`], with the elements of the sets `apart` left out of the text.
fn plan_leaving_out(
    wanted: &Ruleset,
    previous: Option<&Ruleset>,
    existing: &Existing,
    apart: &BTreeSet<&String>,
) -> Batch {
    let family = family_name(wanted.family);
    let prefix = format!("{family} {TABLE}");
    let mut batch = Batch::default();
    let mut text = format!("add table {prefix}\n");
    let full = previous.is_none();
    batch.structural = full;

    for (name, set) in &wanted.sets {
        if full || !existing.sets.contains_key(name) {
            let _ = writeln!(text, "add {} {prefix} {name} {{ {} }}", set.kind.keyword(), set.spec);
            batch.structural = true;
        }
    }
    let changed =
        |name: &str, chain: &Chain| previous.is_none_or(|previous| previous.chains.get(name) != Some(chain));
    for (name, chain) in &wanted.chains {
        if full || !existing.chains.contains(name) {
            batch.structural = true;
            match chain.hook {
                Some(hook) => {
                    let _ = writeln!(text, "add chain {prefix} {name} {{ {hook} }}");
                }
                None => {
                    let _ = writeln!(text, "add chain {prefix} {name}");
                }
            }
        }
    }
    let stale_chains: Vec<&String> =
        existing.chains.iter().filter(|name| !wanted.chains.contains_key(*name)).collect();
    for name in &existing.chains {
        let refill = wanted.chains.get(name).is_some_and(|chain| changed(name, chain));
        if refill || !wanted.chains.contains_key(name) {
            let _ = writeln!(text, "flush chain {prefix} {name}");
            batch.structural = true;
        }
    }
    for (name, chain) in &wanted.chains {
        if changed(name, chain) {
            for rule in &chain.rules {
                let _ = writeln!(text, "add rule {prefix} {name} {rule}");
            }
            batch.chains_written.push(name.clone());
            batch.structural = true;
        }
    }

    let render = |key: &String, value: &Option<String>| match value {
        Some(value) => format!("{key} : {value}"),
        None => key.clone(),
    };
    let lines = |text: &mut String, verb: &str, name: &str, items: Vec<String>| {
        for chunk in items.chunks(ELEMENTS_PER_LINE) {
            let _ = writeln!(text, "{verb} element {prefix} {name} {{ {} }}", chunk.join(", "));
        }
    };
    for (name, set) in &wanted.sets {
        if set.dynamic || apart.contains(name) {
            continue;
        }
        let (deleted, added): (Vec<String>, Vec<String>) = match previous {
            None => {
                if existing.sets.contains_key(name) {
                    let _ = writeln!(text, "flush {} {prefix} {name}", set.kind.keyword());
                    batch.sets_flushed += 1;
                }
                (Vec::new(), set.elements.iter().map(|(key, value)| render(key, value)).collect())
            }
            Some(previous) => {
                let empty = BTreeMap::new();
                let before = previous.sets.get(name).map_or(&empty, |set| &set.elements);
                let deleted: Vec<String> = before
                    .iter()
                    .filter(|(key, value)| set.elements.get(*key) != Some(value))
                    .map(|(key, _)| key.clone())
                    .collect();
                let added: Vec<(String, Option<String>)> = set
                    .elements
                    .iter()
                    .filter(|(key, value)| before.get(*key) != Some(value))
                    .map(|(key, value)| (key.clone(), value.clone()))
                    .collect();
                for (delete, elements) in [
                    (true, deleted.iter().map(|key| (key.clone(), None)).collect::<Vec<_>>()),
                    (false, added.clone()),
                ] {
                    if !elements.is_empty() {
                        batch.elements.push(ElementChange {
                            set: name.clone(),
                            spec: set.spec.clone(),
                            delete,
                            elements,
                        });
                    }
                }
                (deleted, added.iter().map(|(key, value)| render(key, value)).collect())
            }
        };
        batch.elements_deleted += deleted.len();
        batch.elements_added += added.len();
        lines(&mut text, "delete", name, deleted);
        lines(&mut text, "add", name, added);
    }
    for name in stale_chains {
        let _ = writeln!(text, "delete chain {prefix} {name}");
        batch.chains_deleted.push(name.clone());
        batch.structural = true;
    }
    for (name, kind) in &existing.sets {
        if !wanted.sets.contains_key(name) {
            let _ = writeln!(text, "delete {} {prefix} {name}", kind.keyword());
            batch.structural = true;
        }
    }
    batch.text = text;
    batch
}

/// The batch that removes vipr's table of `family` (`--cleanup`, mode switches).
pub fn delete_table(family: Family) -> String {
    format!("delete table {} {TABLE}\n", family_name(family))
}

#[cfg(test)]
mod tests;
