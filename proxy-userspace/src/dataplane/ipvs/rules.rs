//! The iptables rules of kube-proxy's IPVS mode: a small, mostly fixed set that matches the
//! ipsets (masquerade marks in nat, filtering in filter), applied with one
//! `iptables-restore --noflush` per family when its text changes. Pure, so it is unit-tested;
//! [`IptablesTool`] runs the commands.
//!
//! nat (PREROUTING and OUTPUT jump to KUBE-SERVICES, POSTROUTING to KUBE-POSTROUTING):
//!
//! ```text
//! KUBE-SERVICES  -s loopback                       RETURN
//!                KUBE-LOAD-BALANCER dst,dst        KUBE-LOAD-BALANCER (LOCAL: RETURN, else mark)
//!                KUBE-CLUSTER-IP dst,dst [! -s pod CIDRs] mark   (the masquerade rule of the detector)
//!                KUBE-EXTERNAL-IP dst,dst          mark, ACCEPT;  KUBE-EXTERNAL-IP-LOCAL  ACCEPT
//!                --dst-type LOCAL                  KUBE-NODE-PORT (LOCAL ports: RETURN, else mark)
//!                KUBE-CLUSTER-IP / KUBE-LOAD-BALANCER dst,dst  ACCEPT
//! KUBE-POSTROUTING  KUBE-LOOP-BACK dst,dst,src MASQUERADE (hairpin); marked: MASQUERADE
//! ```
//!
//! filter: INPUT jumps to KUBE-NODE-PORT, KUBE-PROXY-FIREWALL and KUBE-IPVS-FILTER, FORWARD
//! to KUBE-FORWARD and KUBE-PROXY-FIREWALL, OUTPUT to KUBE-IPVS-OUT-FILTER. Load balancers
//! with source ranges drop other sources (KUBE-SOURCE-RANGES-FIREWALL, and in OUTPUT for the
//! node's own connections, which IPVS has already sent on by then); a service address on a
//! port it does not serve is rejected (KUBE-IPVS-FILTER); frontends whose endpoints are all
//! elsewhere under a Local policy are dropped (vipr's KUBE-IPVS-DROP set).
use std::{collections::BTreeSet, fmt::Write as _, net::IpAddr};

use ipnet::IpNet;

use super::ipset::{self, Family, SetSpec};
use crate::model::Protocol;

/// The bit kube-proxy marks packets to masquerade with (`--iptables-masquerade-bit` 14).
pub const MASQUERADE_MARK: &str = "0x4000";

pub const KUBE_SERVICES: &str = "KUBE-SERVICES";
pub const KUBE_POSTROUTING: &str = "KUBE-POSTROUTING";
pub const KUBE_NODE_PORT: &str = "KUBE-NODE-PORT";
pub const KUBE_LOAD_BALANCER: &str = "KUBE-LOAD-BALANCER";
pub const KUBE_MARK_MASQ: &str = "KUBE-MARK-MASQ";
pub const KUBE_FORWARD: &str = "KUBE-FORWARD";
pub const KUBE_PROXY_FIREWALL: &str = "KUBE-PROXY-FIREWALL";
pub const KUBE_SOURCE_RANGES_FIREWALL: &str = "KUBE-SOURCE-RANGES-FIREWALL";
pub const KUBE_IPVS_FILTER: &str = "KUBE-IPVS-FILTER";
pub const KUBE_IPVS_OUT_FILTER: &str = "KUBE-IPVS-OUT-FILTER";

pub const NAT_CHAINS: [&str; 5] =
    [KUBE_SERVICES, KUBE_POSTROUTING, KUBE_NODE_PORT, KUBE_LOAD_BALANCER, KUBE_MARK_MASQ];
pub const FILTER_CHAINS: [&str; 6] = [
    KUBE_FORWARD,
    KUBE_NODE_PORT,
    KUBE_PROXY_FIREWALL,
    KUBE_SOURCE_RANGES_FIREWALL,
    KUBE_IPVS_FILTER,
    KUBE_IPVS_OUT_FILTER,
];

/// A rule in a built-in chain that leads to one of ours: (table, built-in chain, comment,
/// target), as kube-proxy's `iptablesJumpChain`.
pub const JUMPS: [(&str, &str, &str, &str); 9] = [
    ("nat", "OUTPUT", "kubernetes service portals", KUBE_SERVICES),
    ("nat", "PREROUTING", "kubernetes service portals", KUBE_SERVICES),
    ("nat", "POSTROUTING", "kubernetes postrouting rules", KUBE_POSTROUTING),
    ("filter", "FORWARD", "kubernetes forwarding rules", KUBE_FORWARD),
    ("filter", "INPUT", "kubernetes health check rules", KUBE_NODE_PORT),
    ("filter", "INPUT", "kube-proxy firewall rules", KUBE_PROXY_FIREWALL),
    ("filter", "FORWARD", "kube-proxy firewall rules", KUBE_PROXY_FIREWALL),
    ("filter", "INPUT", "kubernetes ipvs access filter", KUBE_IPVS_FILTER),
    ("filter", "OUTPUT", "kubernetes ipvs access filter", KUBE_IPVS_OUT_FILTER),
];

/// The jump rule as `iptables-save` prints it (without `-A CHAIN`).
pub fn jump_rule(comment: &str, target: &str) -> String {
    format!("-m comment --comment \"{comment}\" -j {target}")
}

/// How cluster-IP traffic is masqueraded, as kube-proxy decides it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ClusterIpMasquerade {
    /// `--masquerade-all`.
    All,
    /// Everything not from these (the local-traffic detector's) CIDRs.
    NotFrom(Vec<IpNet>),
    /// Everything that did not enter through the pod interfaces (an interface detector):
    /// their `-i` match, `cbr0` or `veth+`.
    NotVia(String),
    /// No detector: only connections whose source is a service address itself (the node
    /// reaching a service address picks it as source, as it is local).
    FromServiceAddress,
}

/// A load balancer frontend with source ranges, as the node's own connections see it.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct RestrictedLoadBalancer {
    pub ip: IpAddr,
    pub port: u16,
    pub protocol: Protocol,
    /// The ranges admitted (of this family); empty admits nothing.
    pub allowed: Vec<IpNet>,
}

/// What the rules of one family depend on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RuleInputs {
    pub family: Family,
    pub cluster_ip_masquerade: ClusterIpMasquerade,
    pub restricted_load_balancers: BTreeSet<RestrictedLoadBalancer>,
    /// Service IP ranges of this family: an address inside them that is no service address
    /// is dropped (what kube-proxy's nftables mode does with ServiceCIDRs).
    pub service_cidrs: Vec<IpNet>,
}

fn loopback(family: Family) -> &'static str {
    match family {
        Family::Ipv4 => "127.0.0.0/8",
        Family::Ipv6 => "::1/128",
    }
}

/// `-m comment --comment "..." -m set --match-set NAME FLAGS`.
fn match_set(spec: &SetSpec, family: Family, flags: &str) -> String {
    format!("-m comment --comment \"{}\" -m set --match-set {} {flags}", spec.comment, spec.name(family))
}

/// The `iptables-restore --noflush` input for one family: declaring a chain flushes it, so
/// the input replaces every rule of vipr's chains at once and leaves other chains alone.
/// The jumps from built-in chains are added separately ([`missing_jumps`]), once.
pub fn restore_input(inputs: &RuleInputs) -> String {
    use ipset::*;
    let family = inputs.family;
    let mut nat = String::from("*nat\n");
    for chain in NAT_CHAINS {
        let _ = writeln!(nat, ":{chain} - [0:0]");
    }
    let mut rule = |chain: &str, text: String| {
        let _ = writeln!(nat, "-A {chain} {text}");
    };
    rule(KUBE_SERVICES, format!("-s {} -j RETURN", loopback(family)));
    rule(KUBE_POSTROUTING, format!("{} -j MASQUERADE", match_set(&LOOP_BACK, family, "dst,dst,src")));
    rule(KUBE_SERVICES, format!("{} -j {KUBE_LOAD_BALANCER}", match_set(&LOAD_BALANCER, family, "dst,dst")));
    rule(KUBE_LOAD_BALANCER, format!("{} -j RETURN", match_set(&LOAD_BALANCER_LOCAL, family, "dst,dst")));
    for (protocol, local, all) in
        [("tcp", NODE_PORT_LOCAL_TCP, NODE_PORT_TCP), ("udp", NODE_PORT_LOCAL_UDP, NODE_PORT_UDP)]
    {
        rule(KUBE_NODE_PORT, format!("-p {protocol} {} -j RETURN", match_set(&local, family, "dst")));
        rule(KUBE_NODE_PORT, format!("-p {protocol} {} -j {KUBE_MARK_MASQ}", match_set(&all, family, "dst")));
    }
    rule(
        KUBE_NODE_PORT,
        format!("-p sctp {} -j RETURN", match_set(&NODE_PORT_LOCAL_SCTP, family, "dst,dst")),
    );
    rule(
        KUBE_NODE_PORT,
        format!("-p sctp {} -j {KUBE_MARK_MASQ}", match_set(&NODE_PORT_SCTP, family, "dst,dst")),
    );
    match &inputs.cluster_ip_masquerade {
        ClusterIpMasquerade::All => {
            rule(KUBE_SERVICES, format!("{} -j {KUBE_MARK_MASQ}", match_set(&CLUSTER_IP, family, "dst,dst")));
        }
        ClusterIpMasquerade::NotFrom(cidrs) => {
            let cidrs: Vec<String> = cidrs
                .iter()
                .filter(|cidr| Family::of(cidr.addr()) == family)
                .map(ToString::to_string)
                .collect();
            if cidrs.is_empty() {
                // A detector of the other family only: every source of this one is not a pod.
                rule(
                    KUBE_SERVICES,
                    format!("{} -j {KUBE_MARK_MASQ}", match_set(&CLUSTER_IP, family, "dst,dst")),
                );
            } else {
                rule(
                    KUBE_SERVICES,
                    format!(
                        "{} ! -s {} -j {KUBE_MARK_MASQ}",
                        match_set(&CLUSTER_IP, family, "dst,dst"),
                        cidrs.join(",")
                    ),
                );
            }
        }
        ClusterIpMasquerade::NotVia(interface) => {
            rule(
                KUBE_SERVICES,
                format!("{} ! -i {interface} -j {KUBE_MARK_MASQ}", match_set(&CLUSTER_IP, family, "dst,dst")),
            );
        }
        ClusterIpMasquerade::FromServiceAddress => {
            rule(KUBE_SERVICES, format!("{} -j {KUBE_MARK_MASQ}", match_set(&CLUSTER_IP, family, "src,dst")));
        }
    }
    rule(KUBE_SERVICES, format!("{} -j {KUBE_MARK_MASQ}", match_set(&EXTERNAL_IP, family, "dst,dst")));
    rule(KUBE_SERVICES, format!("{} -j ACCEPT", match_set(&EXTERNAL_IP, family, "dst,dst")));
    rule(KUBE_SERVICES, format!("{} -j ACCEPT", match_set(&EXTERNAL_IP_LOCAL, family, "dst,dst")));
    rule(KUBE_SERVICES, format!("-m addrtype --dst-type LOCAL -j {KUBE_NODE_PORT}"));
    rule(KUBE_LOAD_BALANCER, format!("-j {KUBE_MARK_MASQ}"));
    rule(KUBE_SERVICES, format!("-m set --match-set {} dst,dst -j ACCEPT", CLUSTER_IP.name(family)));
    rule(KUBE_SERVICES, format!("-m set --match-set {} dst,dst -j ACCEPT", LOAD_BALANCER.name(family)));
    rule(KUBE_POSTROUTING, format!("-m mark ! --mark {MASQUERADE_MARK}/{MASQUERADE_MARK} -j RETURN"));
    rule(KUBE_POSTROUTING, format!("-j MARK --xor-mark {MASQUERADE_MARK}"));
    rule(
        KUBE_POSTROUTING,
        "-m comment --comment \"kubernetes service traffic requiring SNAT\" -j MASQUERADE --random-fully"
            .to_owned(),
    );
    rule(KUBE_MARK_MASQ, format!("-j MARK --or-mark {MASQUERADE_MARK}"));
    nat.push_str("COMMIT\n");

    let mut filter = String::from("*filter\n");
    for chain in FILTER_CHAINS {
        let _ = writeln!(filter, ":{chain} - [0:0]");
    }
    let mut rule = |chain: &str, text: String| {
        let _ = writeln!(filter, "-A {chain} {text}");
    };
    rule(
        KUBE_PROXY_FIREWALL,
        format!("{} -j {KUBE_SOURCE_RANGES_FIREWALL}", match_set(&LOAD_BALANCER_FW, family, "dst,dst")),
    );
    rule(
        KUBE_SOURCE_RANGES_FIREWALL,
        format!("{} -j RETURN", match_set(&LOAD_BALANCER_SOURCE_CIDR, family, "dst,dst,src")),
    );
    rule(KUBE_SOURCE_RANGES_FIREWALL, "-j DROP".to_owned());
    for cidr in &inputs.service_cidrs {
        let unallocated = format!(
            "-d {cidr} -m comment --comment \"vipr: unallocated service IP\" -m set ! --match-set {} dst -j DROP",
            IPVS_IPS.name(family)
        );
        rule(KUBE_PROXY_FIREWALL, unallocated.clone());
        rule(KUBE_IPVS_OUT_FILTER, unallocated);
    }
    // The node's own connections to a load balancer: IPVS has sent them to a real server
    // before OUTPUT filters, so they are told by the virtual address they were for.
    for balancer in &inputs.restricted_load_balancers {
        let host = if balancer.ip.is_ipv4() { 32 } else { 128 };
        let virtual_match = format!(
            "-m ipvs --vdir ORIGINAL --vaddr {}/{host} --vproto {} --vport {}",
            balancer.ip,
            balancer.protocol.lower_case(),
            balancer.port
        );
        for range in &balancer.allowed {
            rule(KUBE_IPVS_OUT_FILTER, format!("-s {range} {virtual_match} -j RETURN"));
        }
        rule(KUBE_IPVS_OUT_FILTER, format!("{virtual_match} -j DROP"));
    }
    rule(
        KUBE_FORWARD,
        format!(
            "-m comment --comment \"kubernetes forwarding rules\" -m mark --mark {MASQUERADE_MARK}/{MASQUERADE_MARK} -j ACCEPT"
        ),
    );
    rule(
        KUBE_FORWARD,
        "-m comment --comment \"kubernetes forwarding conntrack rule\" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT"
            .to_owned(),
    );
    rule(KUBE_IPVS_FILTER, format!("{} -j DROP", match_set(&DROP_NO_LOCAL, family, "dst,dst")));
    rule(KUBE_IPVS_FILTER, format!("{} -j REJECT", match_set(&REJECT_NO_ENDPOINTS, family, "dst,dst")));
    for set in [LOAD_BALANCER, CLUSTER_IP, EXTERNAL_IP, EXTERNAL_IP_LOCAL] {
        rule(KUBE_IPVS_FILTER, format!("-m set --match-set {} dst,dst -j RETURN", set.name(family)));
    }
    rule(
        KUBE_IPVS_FILTER,
        format!("-m conntrack --ctstate NEW -m set --match-set {} dst -j REJECT", IPVS_IPS.name(family)),
    );
    filter.push_str("COMMIT\n");
    nat + &filter
}

/// The jump rules that `iptables-save` output lacks, as restore lines (`-I`, so they come
/// first, as kube-proxy's prepended jumps). Checked only when the rules are (re)applied.
pub fn missing_jumps(saved: &str) -> String {
    let mut table = "";
    let mut present = BTreeSet::new();
    for line in saved.lines() {
        if let Some(name) = line.strip_prefix('*') {
            table = name;
        } else if let Some(rule) = line.strip_prefix("-A ") {
            present.insert((table.to_owned(), rule.trim_end().to_owned()));
        }
    }
    let mut by_table = String::new();
    for wanted_table in ["nat", "filter"] {
        let lines: Vec<String> = JUMPS
            .iter()
            .filter(|(table, ..)| *table == wanted_table)
            .filter(|(table, chain, comment, target)| {
                !present.contains(&((*table).to_owned(), format!("{chain} {}", jump_rule(comment, target))))
            })
            .map(|(_, chain, comment, target)| format!("-I {chain} 1 {}", jump_rule(comment, target)))
            .collect();
        if !lines.is_empty() {
            let _ = writeln!(by_table, "*{wanted_table}\n{}\nCOMMIT", lines.join("\n"));
        }
    }
    by_table
}

/// Removing vipr's IPVS-mode rules: the jumps, then the chains (flushed, then deleted).
pub fn cleanup_input(saved: &str) -> String {
    let mut out = String::new();
    let mut table = "";
    let mut chains = BTreeSet::new();
    let mut jumps: Vec<(String, String)> = Vec::new();
    for line in saved.lines() {
        if let Some(name) = line.strip_prefix('*') {
            table = name;
        } else if let Some(declaration) = line.strip_prefix(':') {
            if let Some(name) = declaration.split_whitespace().next() {
                chains.insert((table.to_owned(), name.to_owned()));
            }
        } else if let Some(rule) = line.strip_prefix("-A ") {
            let is_ours = JUMPS.iter().any(|(jump_table, chain, comment, target)| {
                *jump_table == table && rule.trim_end() == format!("{chain} {}", jump_rule(comment, target))
            });
            if is_ours {
                jumps.push((table.to_owned(), rule.trim_end().to_owned()));
            }
        }
    }
    for (table_name, ours) in [("nat", &NAT_CHAINS[..]), ("filter", &FILTER_CHAINS[..])] {
        let present: Vec<&str> = ours
            .iter()
            .copied()
            .filter(|chain| chains.contains(&(table_name.to_owned(), (*chain).to_owned())))
            .collect();
        let table_jumps: Vec<&String> =
            jumps.iter().filter(|(t, _)| t == table_name).map(|(_, rule)| rule).collect();
        if present.is_empty() && table_jumps.is_empty() {
            continue;
        }
        let _ = writeln!(out, "*{table_name}");
        for rule in table_jumps {
            let _ = writeln!(out, "-D {rule}");
        }
        for chain in &present {
            let _ = writeln!(out, ":{chain} - [0:0]");
        }
        for chain in &present {
            let _ = writeln!(out, "-X {chain}");
        }
        let _ = writeln!(out, "COMMIT");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inputs(masquerade: ClusterIpMasquerade) -> RuleInputs {
        RuleInputs {
            family: Family::Ipv4,
            cluster_ip_masquerade: masquerade,
            restricted_load_balancers: BTreeSet::new(),
            service_cidrs: Vec::new(),
        }
    }

    #[test]
    fn the_cluster_ip_masquerade_rule_follows_the_detector() {
        let detector = restore_input(&inputs(ClusterIpMasquerade::NotFrom(vec![
            "10.0.0.0/8".parse().unwrap(),
            "fd00::/48".parse().unwrap(),
        ])));
        assert!(
            detector.contains("-m set --match-set KUBE-CLUSTER-IP dst,dst ! -s 10.0.0.0/8 -j KUBE-MARK-MASQ"),
            "{detector}"
        );
        let all = restore_input(&inputs(ClusterIpMasquerade::All));
        assert!(all.contains("-m set --match-set KUBE-CLUSTER-IP dst,dst -j KUBE-MARK-MASQ"), "{all}");
        let bridge = restore_input(&inputs(ClusterIpMasquerade::NotVia("cbr0".into())));
        assert!(
            bridge.contains("-m set --match-set KUBE-CLUSTER-IP dst,dst ! -i cbr0 -j KUBE-MARK-MASQ"),
            "{bridge}"
        );
        let mut v6 = inputs(ClusterIpMasquerade::NotVia("veth+".into()));
        v6.family = Family::Ipv6;
        let prefix = restore_input(&v6);
        assert!(
            prefix.contains("-m set --match-set KUBE-6-CLUSTER-IP dst,dst ! -i veth+ -j KUBE-MARK-MASQ"),
            "{prefix}"
        );
        let none = restore_input(&inputs(ClusterIpMasquerade::FromServiceAddress));
        assert!(none.contains("-m set --match-set KUBE-CLUSTER-IP src,dst -j KUBE-MARK-MASQ"), "{none}");
    }

    #[test]
    fn both_tables_declare_their_chains_and_commit() {
        let mut v6 = inputs(ClusterIpMasquerade::All);
        v6.family = Family::Ipv6;
        let text = restore_input(&v6);
        assert!(text.starts_with("*nat\n:KUBE-SERVICES - [0:0]\n"), "{text}");
        assert_eq!(text.matches("COMMIT\n").count(), 2);
        assert!(text.contains("-A KUBE-SERVICES -s ::1/128 -j RETURN"));
        assert!(text.contains("--match-set KUBE-6-LOOP-BACK dst,dst,src -j MASQUERADE"));
        assert!(text.contains(
            "-A KUBE-IPVS-FILTER -m conntrack --ctstate NEW -m set --match-set KUBE-6-IPVS-IPS dst -j REJECT"
        ));
        // Every rule targets a chain the input declares, or a built-in target.
        for line in text.lines().filter(|line| line.starts_with("-A ")) {
            let chain = line.split_whitespace().nth(1).unwrap();
            assert!(NAT_CHAINS.contains(&chain) || FILTER_CHAINS.contains(&chain), "{line}");
        }
    }

    #[test]
    fn load_balancer_ranges_filter_the_node_s_own_connections_by_virtual_address() {
        let mut restricted = inputs(ClusterIpMasquerade::All);
        restricted.restricted_load_balancers.insert(RestrictedLoadBalancer {
            ip: "1.2.3.4".parse().unwrap(),
            port: 80,
            protocol: Protocol::Tcp,
            allowed: vec!["203.0.113.0/25".parse().unwrap()],
        });
        let text = restore_input(&restricted);
        let virtual_match = "-m ipvs --vdir ORIGINAL --vaddr 1.2.3.4/32 --vproto tcp --vport 80";
        assert!(
            text.contains(&format!("-A KUBE-IPVS-OUT-FILTER -s 203.0.113.0/25 {virtual_match} -j RETURN"))
        );
        assert!(text.contains(&format!("-A KUBE-IPVS-OUT-FILTER {virtual_match} -j DROP")));
    }

    #[test]
    fn unallocated_service_addresses_are_dropped() {
        let mut with_range = inputs(ClusterIpMasquerade::All);
        with_range.service_cidrs = vec!["172.30.0.0/16".parse().unwrap()];
        let text = restore_input(&with_range);
        let rule = "-d 172.30.0.0/16 -m comment --comment \"vipr: unallocated service IP\" \
                    -m set ! --match-set KUBE-IPVS-IPS dst -j DROP";
        assert!(text.contains(&format!("-A KUBE-PROXY-FIREWALL {rule}")), "{text}");
        assert!(text.contains(&format!("-A KUBE-IPVS-OUT-FILTER {rule}")), "{text}");
    }

    #[test]
    fn jumps_are_added_once() {
        let saved = "*nat\n:PREROUTING ACCEPT [0:0]\n\
                     -A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\nCOMMIT\n\
                     *filter\n:INPUT ACCEPT [0:0]\nCOMMIT\n";
        let missing = missing_jumps(saved);
        assert!(!missing.contains("-I PREROUTING"), "{missing}");
        assert!(missing.contains(
            "*nat\n-I OUTPUT 1 -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n"
        ));
        assert!(missing.contains(
            "-I INPUT 1 -m comment --comment \"kubernetes ipvs access filter\" -j KUBE-IPVS-FILTER"
        ));
        assert_eq!(missing.matches("COMMIT").count(), 2);
        let all_present: String = std::iter::once("*nat\n".to_owned())
            .chain(
                JUMPS
                    .iter()
                    .filter(|j| j.0 == "nat")
                    .map(|(_, c, m, t)| format!("-A {c} {}\n", jump_rule(m, t))),
            )
            .chain(std::iter::once("COMMIT\n*filter\n".to_owned()))
            .chain(
                JUMPS
                    .iter()
                    .filter(|j| j.0 == "filter")
                    .map(|(_, c, m, t)| format!("-A {c} {}\n", jump_rule(m, t))),
            )
            .chain(std::iter::once("COMMIT\n".to_owned()))
            .collect();
        assert_eq!(missing_jumps(&all_present), "");
    }

    #[test]
    fn cleanup_removes_only_ours() {
        let saved = "*nat\n:PREROUTING ACCEPT [0:0]\n:KUBE-SERVICES - [0:0]\n:OTHER - [0:0]\n\
                     -A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n\
                     -A PREROUTING -j OTHER\nCOMMIT\n";
        assert_eq!(
            cleanup_input(saved),
            "*nat\n-D PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n\
             :KUBE-SERVICES - [0:0]\n-X KUBE-SERVICES\nCOMMIT\n"
        );
    }
}
