//! `vipr inspect services` in iptables mode: the frontends and endpoints read back from the
//! nat table's chains (`iptables-save -c -t nat`, both families), named and shaped as the
//! iptables dataplane writes them (`dataplane::iptables::ruleset`): `KUBE-SERVICES` and
//! `KUBE-NODEPORTS` match a frontend and jump to its service chains, which end in one
//! `KUBE-SEP-*` chain per endpoint with its DNAT.
use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
};

use super::{BackendView, FrontendView};
use crate::dataplane::iptables::{
    names,
    restore::split_words,
    ruleset::{Family, TableName, KUBE_EXTERNAL_SERVICES, KUBE_MARK_MASQ, KUBE_NODEPORTS, KUBE_SERVICES},
    tools::Tools,
};

/// One rule of the saved table: its counters and its words (without `-A CHAIN`).
#[derive(Debug)]
struct Rule {
    packets: u64,
    bytes: u64,
    words: Vec<String>,
}

impl Rule {
    /// The word after `option` (`-d`, `--dport`, `-j`, ...), if the rule has it un-negated.
    fn value(&self, option: &str) -> Option<&str> {
        self.words
            .windows(2)
            .enumerate()
            .find(|(index, pair)| pair[0] == option && (*index == 0 || self.words[index - 1] != "!"))
            .map(|(_, pair)| pair[1].as_str())
    }

    fn target(&self) -> Option<&str> {
        self.value("-j").or_else(|| self.value("-g"))
    }

    fn has(&self, word: &str) -> bool {
        self.words.iter().any(|candidate| candidate == word)
    }
}

/// Chain name → rules in order, from `iptables-save -c` output of one table.
fn parse(text: &str) -> BTreeMap<String, Vec<Rule>> {
    let mut chains: BTreeMap<String, Vec<Rule>> = BTreeMap::new();
    for line in text.lines() {
        let (counters, rest) = match line.strip_prefix('[').and_then(|line| line.split_once("] ")) {
            Some((counters, rest)) => (Some(counters), rest),
            None => (None, line),
        };
        let Some(rule) = rest.strip_prefix("-A ") else { continue };
        let Some((chain, rule)) = rule.split_once(' ') else { continue };
        let (packets, bytes) = counters
            .and_then(|counters| counters.split_once(':'))
            .map_or((0, 0), |(p, b)| (p.parse().unwrap_or(0), b.parse().unwrap_or(0)));
        chains.entry(chain.to_owned()).or_default().push(Rule { packets, bytes, words: split_words(rule) });
    }
    chains
}

/// Every frontend of both families' nat tables, and those the filter table rejects or drops
/// for want of endpoints. A family whose tools fail (no ip6tables, no IPv6 in the kernel) is
/// left out; only both failing is an error.
pub fn services() -> anyhow::Result<Vec<FrontendView>> {
    let tools = Tools::detect(None)?;
    let mut frontends = Vec::new();
    let mut errors = Vec::new();
    for family in Family::ALL {
        let tables = tools
            .save_counted(family, TableName::Nat)
            .and_then(|nat| Ok((nat, tools.save_counted(family, TableName::Filter)?)));
        match tables {
            Ok((nat, filter)) => {
                let mut found = frontends_of(&parse(&nat), family);
                found.extend(without_endpoints(&parse(&filter), &found, family));
                frontends.extend(found);
            }
            Err(error) => errors.push(format!("{error:#}")),
        }
    }
    anyhow::ensure!(errors.len() < Family::ALL.len(), "cannot read the nat table: {}", errors.join("; "));
    Ok(frontends)
}

/// Whether vipr's (or kube-proxy's) iptables-mode chains are in the IPv4 nat table: a service
/// chain or `KUBE-NODEPORTS`, which the IPVS mode does not create.
pub fn present() -> bool {
    let Ok(tools) = Tools::detect(None) else { return false };
    tools.save_counted(Family::Ipv4, TableName::Nat).is_ok_and(|text| {
        text.lines()
            .filter_map(|line| line.strip_prefix(':'))
            .any(|chain| chain.starts_with(KUBE_NODEPORTS) || chain.starts_with(names::SERVICE_PREFIX))
    })
}

fn frontends_of(chains: &BTreeMap<String, Vec<Rule>>, family: Family) -> Vec<FrontendView> {
    let any_address = unspecified(family);
    let entries = |chain: &str| chains.get(chain).into_iter().flatten();
    let mut frontends = Vec::new();
    // KUBE-SERVICES: cluster, external and load-balancer IPs; KUBE-NODEPORTS: node ports, on
    // every node address (shown as the unspecified address), or on loopback.
    let matched = entries(KUBE_SERVICES).map(|rule| (rule, rule.value("-d").and_then(host))).chain(
        entries(KUBE_NODEPORTS)
            .map(|rule| (rule, Some(rule.value("-d").and_then(host).unwrap_or(any_address)))),
    );
    for (rule, address) in matched {
        let (Some(address), Some(target)) = (address, rule.target()) else { continue };
        if !names::is_service_chain(target) {
            continue;
        }
        let (Some(port), Some(protocol)) =
            (rule.value("--dport").and_then(|p| p.parse().ok()), rule.value("-p"))
        else {
            continue;
        };
        let mut walk = Walk::default();
        walk.chain(chains, target, 0);
        let mut flags: Vec<&'static str> = Vec::new();
        if walk.masquerade {
            flags.push("masquerade");
        }
        if walk.backends.is_empty() {
            flags.push("no-endpoints");
        }
        frontends.push(FrontendView {
            protocol: protocol_name(protocol),
            frontend: SocketAddr::new(address, port),
            source: "all",
            service_id: None,
            service: rule.value("--comment").map(|comment| service_of(comment).to_owned()),
            flags,
            affinity_seconds: walk.affinity,
            backends: walk
                .backends
                .into_iter()
                .map(|(address, (packets, bytes))| BackendView {
                    address,
                    slots: 1,
                    packets,
                    bytes,
                    active_connections: None,
                    inactive_connections: None,
                })
                .collect(),
        });
    }
    frontends
}

/// The frontends the filter table rejects or drops because they have no endpoints at all
/// (the nat table has no rule for them), as the dataplane writes them: `"NAME has no
/// endpoints"` (REJECT) or `"NAME has no local endpoints"` (DROP) in `KUBE-SERVICES` (cluster
/// IPs) and `KUBE-EXTERNAL-SERVICES` (the rest).
fn without_endpoints(
    chains: &BTreeMap<String, Vec<Rule>>,
    served: &[FrontendView],
    family: Family,
) -> Vec<FrontendView> {
    let any_address = unspecified(family);
    let mut frontends: Vec<FrontendView> = Vec::new();
    let rules =
        [KUBE_SERVICES, KUBE_EXTERNAL_SERVICES].into_iter().flat_map(|chain| chains.get(chain)).flatten();
    for rule in rules {
        let Some(comment) = rule.value("--comment") else { continue };
        let verdict = match rule.target() {
            Some("REJECT") if comment.ends_with(" has no endpoints") => "rejects",
            Some("DROP") if comment.ends_with(" has no local endpoints") => "drops",
            _ => continue,
        };
        let (Some(port), Some(protocol)) =
            (rule.value("--dport").and_then(|p| p.parse().ok()), rule.value("-p").map(protocol_name))
        else {
            continue;
        };
        let frontend = SocketAddr::new(rule.value("-d").and_then(host).unwrap_or(any_address), port);
        let known = |view: &FrontendView| view.frontend == frontend && view.protocol == protocol;
        if served.iter().any(known) || frontends.iter().any(known) {
            continue;
        }
        frontends.push(FrontendView {
            protocol,
            frontend,
            source: "all",
            service_id: None,
            service: Some(service_of(comment).to_owned()),
            flags: vec![verdict],
            affinity_seconds: None,
            backends: Vec::new(),
        });
    }
    frontends
}

fn unspecified(family: Family) -> IpAddr {
    match family {
        Family::Ipv4 => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        Family::Ipv6 => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
    }
}

/// What a frontend's service chains lead to.
#[derive(Default)]
struct Walk {
    /// Each endpoint with its DNAT rule's counters (the nat table sees a connection's first
    /// packet only: these count connections).
    backends: BTreeMap<SocketAddr, (u64, u64)>,
    masquerade: bool,
    affinity: Option<u32>,
    visited: BTreeSet<String>,
}

impl Walk {
    fn chain(&mut self, chains: &BTreeMap<String, Vec<Rule>>, chain: &str, depth: usize) {
        // Service chains lead at most FW → EXT → SVC/SVL → SEP.
        if depth > 4 || !self.visited.insert(chain.to_owned()) {
            return;
        }
        let endpoint = chain.starts_with(names::ENDPOINT_PREFIX);
        for rule in chains.get(chain).into_iter().flatten() {
            if rule.has("--rcheck") {
                self.affinity = rule.value("--seconds").and_then(|seconds| seconds.parse().ok());
            }
            match rule.target() {
                Some("DNAT") => {
                    if let Some(to) = rule.value("--to-destination").and_then(|to| to.parse().ok()) {
                        let counted = self.backends.entry(to).or_default();
                        counted.0 += rule.packets;
                        counted.1 += rule.bytes;
                    }
                }
                // In an endpoint chain it is the hairpin case, not the service's treatment.
                Some(KUBE_MARK_MASQ) if !endpoint => self.masquerade = true,
                Some(target) if names::is_service_chain(target) => self.chain(chains, target, depth + 1),
                _ => {}
            }
        }
    }
}

/// `10.96.0.10/32` → the address.
fn host(text: &str) -> Option<IpAddr> {
    text.split('/').next()?.parse().ok()
}

fn protocol_name(protocol: &str) -> &'static str {
    match protocol {
        "tcp" => "TCP",
        "udp" => "UDP",
        "sctp" => "SCTP",
        _ => "?",
    }
}

/// `default/web:http cluster IP` → `default/web:http`.
fn service_of(comment: &str) -> &str {
    comment.split_whitespace().next().unwrap_or(comment)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `iptables-save -c -t nat` prints for a cluster IP with two endpoints and a
    /// NodePort (chain names shortened).
    const SAVED: &str = r#"# Generated by iptables-save
*nat
:PREROUTING ACCEPT [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-NODEPORTS - [0:0]
:KUBE-SVC-A - [0:0]
:KUBE-EXT-A - [0:0]
:KUBE-SEP-1 - [0:0]
:KUBE-SEP-2 - [0:0]
[3:180] -A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
[0:0] -A KUBE-SERVICES -d 10.96.0.10/32 -p tcp -m comment --comment "default/web:http cluster IP" -m tcp --dport 80 -j KUBE-SVC-A
[0:0] -A KUBE-SERVICES -m comment --comment "kubernetes service nodeports; NOTE: this must be the last rule in this chain" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS
[0:0] -A KUBE-NODEPORTS -p tcp -m comment --comment "default/web:http" -m tcp --dport 30080 -j KUBE-EXT-A
[0:0] -A KUBE-EXT-A -m comment --comment "masquerade traffic for default/web:http external destinations" -j KUBE-MARK-MASQ
[0:0] -A KUBE-EXT-A -j KUBE-SVC-A
[0:0] -A KUBE-SVC-A ! -s 10.0.0.0/8 -d 10.96.0.10/32 -p tcp -m comment --comment "default/web:http cluster IP" -m tcp --dport 80 -j KUBE-MARK-MASQ
[0:0] -A KUBE-SVC-A -m comment --comment "default/web:http -> 10.20.1.2:8080" -m recent --rcheck --seconds 10800 --reap --name KUBE-SEP-1 --mask 255.255.255.255 --rsource -j KUBE-SEP-1
[0:0] -A KUBE-SVC-A -m comment --comment "default/web:http -> 10.20.1.2:8080" -m statistic --mode random --probability 0.50000000000 -j KUBE-SEP-1
[0:0] -A KUBE-SVC-A -m comment --comment "default/web:http -> 10.20.2.2:8080" -j KUBE-SEP-2
[0:0] -A KUBE-SEP-1 -s 10.20.1.2/32 -m comment --comment "default/web:http" -j KUBE-MARK-MASQ
[2:120] -A KUBE-SEP-1 -p tcp -m comment --comment "default/web:http" -m recent --set --name KUBE-SEP-1 --mask 255.255.255.255 --rsource -m tcp -j DNAT --to-destination 10.20.1.2:8080
[1:60] -A KUBE-SEP-2 -p tcp -m comment --comment "default/web:http" -m tcp -j DNAT --to-destination 10.20.2.2:8080
COMMIT
"#;

    #[test]
    fn reads_frontends_and_endpoints_from_the_chains() {
        let frontends = frontends_of(&parse(SAVED), Family::Ipv4);
        assert_eq!(frontends.len(), 2, "{frontends:#?}");
        let cluster_ip = &frontends[0];
        assert_eq!(cluster_ip.frontend, "10.96.0.10:80".parse().unwrap());
        assert_eq!(cluster_ip.protocol, "TCP");
        assert_eq!(cluster_ip.service.as_deref(), Some("default/web:http"));
        assert_eq!(cluster_ip.affinity_seconds, Some(10800));
        assert_eq!(cluster_ip.flags, ["masquerade"]);
        let backends: Vec<(String, u64)> =
            cluster_ip.backends.iter().map(|b| (b.address.to_string(), b.packets)).collect();
        assert_eq!(backends, [("10.20.1.2:8080".to_owned(), 2), ("10.20.2.2:8080".to_owned(), 1)]);
        let node_port = &frontends[1];
        assert_eq!(node_port.frontend, "0.0.0.0:30080".parse().unwrap());
        assert_eq!(node_port.backends.len(), 2);
    }

    #[test]
    fn the_filter_table_names_frontends_without_any_endpoint() {
        let filter = "*filter\n\
            [0:0] -A KUBE-SERVICES -d 10.96.0.12/32 -p tcp -m comment --comment \"a/b:http has no endpoints\" \
            -m tcp --dport 80 -j REJECT --reject-with icmp-port-unreachable\n\
            [0:0] -A KUBE-EXTERNAL-SERVICES -p tcp -m comment --comment \"a/c:http has no local endpoints\" \
            -m addrtype --dst-type LOCAL -m tcp --dport 30081 -j DROP\n\
            [0:0] -A KUBE-SERVICES -d 10.96.0.10/32 -p tcp -m comment --comment \"default/web:http has no endpoints\" \
            -m addrtype --src-type LOCAL -m tcp --dport 80 -j REJECT\nCOMMIT\n";
        let served = frontends_of(&parse(SAVED), Family::Ipv4);
        let empty = without_endpoints(&parse(filter), &served, Family::Ipv4);
        let found: Vec<(String, &str, Option<&str>)> = empty
            .iter()
            .map(|view| (view.frontend.to_string(), view.flags[0], view.service.as_deref()))
            .collect();
        // 10.96.0.10:80 has endpoints for other source classes: it is listed from the nat table.
        assert_eq!(
            found,
            [
                ("10.96.0.12:80".to_owned(), "rejects", Some("a/b:http")),
                ("0.0.0.0:30081".to_owned(), "drops", Some("a/c:http"))
            ]
        );
    }

    #[test]
    fn a_frontend_without_endpoints_says_so() {
        let saved = "*nat\n[0:0] -A KUBE-SERVICES -d 10.96.0.11/32 -p udp -m comment --comment \"a/b:dns cluster IP\" \
                     -m udp --dport 53 -j KUBE-SVC-B\nCOMMIT\n";
        let frontends = frontends_of(&parse(saved), Family::Ipv4);
        assert_eq!(frontends[0].flags, ["no-endpoints"]);
        assert!(frontends[0].backends.is_empty());
    }
}
