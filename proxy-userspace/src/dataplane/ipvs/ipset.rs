//! The ipsets of kube-proxy's IPVS mode: which exist, how their entries are written, and
//! `ipset restore` batches that change only what differs. The text is pure and unit-tested;
//! [`IpsetTool`] runs `ipset`.
use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    net::IpAddr,
    process::Command,
};

use anyhow::bail;
use ipnet::IpNet;

pub use crate::model::IpFamily as Family;
use crate::model::Protocol;
use crate::tool;

/// The storage type of a set.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SetType {
    HashIp,
    HashIpPort,
    HashIpPortIp,
    HashIpPortNet,
    BitmapPort,
}

impl SetType {
    pub fn name(self) -> &'static str {
        match self {
            Self::HashIp => "hash:ip",
            Self::HashIpPort => "hash:ip,port",
            Self::HashIpPortIp => "hash:ip,port,ip",
            Self::HashIpPortNet => "hash:ip,port,net",
            Self::BitmapPort => "bitmap:port",
        }
    }
}

/// ipset's longest set name.
const MAX_NAME_LEN: usize = 31;

/// One of kube-proxy's sets, by its IPv4 name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SetSpec {
    pub name: &'static str,
    pub set_type: SetType,
    /// kube-proxy's comment, used on the iptables rules that match the set.
    pub comment: &'static str,
}

const fn set(name: &'static str, set_type: SetType, comment: &'static str) -> SetSpec {
    SetSpec { name, set_type, comment }
}

pub const LOOP_BACK: SetSpec = set(
    "KUBE-LOOP-BACK",
    SetType::HashIpPortIp,
    "Kubernetes endpoints dst ip:port, source ip for solving hairpin purpose",
);
pub const CLUSTER_IP: SetSpec = set(
    "KUBE-CLUSTER-IP",
    SetType::HashIpPort,
    "Kubernetes service cluster ip + port for masquerade purpose",
);
pub const EXTERNAL_IP: SetSpec = set(
    "KUBE-EXTERNAL-IP",
    SetType::HashIpPort,
    "Kubernetes service external ip + port for masquerade and filter purpose",
);
pub const EXTERNAL_IP_LOCAL: SetSpec = set(
    "KUBE-EXTERNAL-IP-LOCAL",
    SetType::HashIpPort,
    "Kubernetes service external ip + port with externalTrafficPolicy=local",
);
pub const LOAD_BALANCER: SetSpec =
    set("KUBE-LOAD-BALANCER", SetType::HashIpPort, "Kubernetes service lb portal");
pub const LOAD_BALANCER_FW: SetSpec = set(
    "KUBE-LOAD-BALANCER-FW",
    SetType::HashIpPort,
    "Kubernetes service load balancer ip + port for load balancer with sourceRange",
);
pub const LOAD_BALANCER_LOCAL: SetSpec = set(
    "KUBE-LOAD-BALANCER-LOCAL",
    SetType::HashIpPort,
    "Kubernetes service load balancer ip + port with externalTrafficPolicy=local",
);
pub const LOAD_BALANCER_SOURCE_CIDR: SetSpec = set(
    "KUBE-LOAD-BALANCER-SOURCE-CIDR",
    SetType::HashIpPortNet,
    "Kubernetes service load balancer ip + port + source cidr for packet filter purpose",
);
pub const NODE_PORT_TCP: SetSpec =
    set("KUBE-NODE-PORT-TCP", SetType::BitmapPort, "Kubernetes nodeport TCP port for masquerade purpose");
pub const NODE_PORT_LOCAL_TCP: SetSpec = set(
    "KUBE-NODE-PORT-LOCAL-TCP",
    SetType::BitmapPort,
    "Kubernetes nodeport TCP port with externalTrafficPolicy=local",
);
pub const NODE_PORT_UDP: SetSpec =
    set("KUBE-NODE-PORT-UDP", SetType::BitmapPort, "Kubernetes nodeport UDP port for masquerade purpose");
pub const NODE_PORT_LOCAL_UDP: SetSpec = set(
    "KUBE-NODE-PORT-LOCAL-UDP",
    SetType::BitmapPort,
    "Kubernetes nodeport UDP port with externalTrafficPolicy=local",
);
pub const NODE_PORT_SCTP: SetSpec = set(
    "KUBE-NODE-PORT-SCTP-HASH",
    SetType::HashIpPort,
    "Kubernetes nodeport SCTP port for masquerade purpose with type 'hash ip:port'",
);
pub const NODE_PORT_LOCAL_SCTP: SetSpec = set(
    "KUBE-NODE-PORT-LOCAL-SCTP-HASH",
    SetType::HashIpPort,
    "Kubernetes nodeport SCTP port with externalTrafficPolicy=local with type 'hash ip:port'",
);
pub const IPVS_IPS: SetSpec =
    set("KUBE-IPVS-IPS", SetType::HashIp, "IPVS service addresses bound to the dummy interface");
/// vipr's own: frontends whose every source class is dropped when it has no endpoint
/// (Local traffic policies with endpoints only on other nodes). IPVS itself would reject.
pub const DROP_NO_LOCAL: SetSpec = set(
    "KUBE-IPVS-DROP",
    SetType::HashIpPort,
    "vipr: service ip + port whose endpoints are all on other nodes (Local policy): drop",
);

/// vipr's own: frontends without any endpoint, rejected by a filter rule (IPVS would answer
/// them itself from a virtual service without real servers, but its ICMPv6 errors do not
/// reliably reach IPv6 clients).
pub const REJECT_NO_ENDPOINTS: SetSpec =
    set("KUBE-IPVS-REJECT", SetType::HashIpPort, "vipr: service ip + port without any endpoint: reject");

/// Every set of one family, in creation order.
pub const ALL: [SetSpec; 17] = [
    LOOP_BACK,
    CLUSTER_IP,
    EXTERNAL_IP,
    EXTERNAL_IP_LOCAL,
    LOAD_BALANCER,
    LOAD_BALANCER_FW,
    LOAD_BALANCER_LOCAL,
    LOAD_BALANCER_SOURCE_CIDR,
    NODE_PORT_TCP,
    NODE_PORT_LOCAL_TCP,
    NODE_PORT_UDP,
    NODE_PORT_LOCAL_UDP,
    NODE_PORT_SCTP,
    NODE_PORT_LOCAL_SCTP,
    IPVS_IPS,
    DROP_NO_LOCAL,
    REJECT_NO_ENDPOINTS,
];

/// ipset's name of a family.
fn ipset_family(family: Family) -> &'static str {
    match family {
        Family::Ipv4 => "inet",
        Family::Ipv6 => "inet6",
    }
}

impl SetSpec {
    /// The set's name in `family`: kube-proxy names IPv6 sets `KUBE-6-...`, cut to ipset's
    /// 31 characters.
    pub fn name(&self, family: Family) -> String {
        match family {
            Family::Ipv4 => self.name.to_owned(),
            Family::Ipv6 => {
                let mut name = format!("KUBE-6-{}", self.name.trim_start_matches("KUBE-"));
                name.truncate(MAX_NAME_LEN);
                name
            }
        }
    }

    /// The `create` line (idempotent with `-exist`), with kube-proxy's sizes.
    pub fn create_line(&self, family: Family) -> String {
        let name = self.name(family);
        match self.set_type {
            SetType::BitmapPort => format!("create {name} bitmap:port range 0-65535 -exist"),
            other => format!(
                "create {name} {} family {} hashsize 1024 maxelem 65536 -exist",
                other.name(),
                ipset_family(family)
            ),
        }
    }
}

/// One member of a set, typed so that what ipset prints and what vipr wants compare equal.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Entry {
    Ip(IpAddr),
    IpPort(IpAddr, Protocol, u16),
    IpPortIp(IpAddr, Protocol, u16, IpAddr),
    IpPortNet(IpAddr, Protocol, u16, IpNet),
    Port(u16),
}

impl fmt::Display for Entry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Ip(ip) => write!(f, "{ip}"),
            Self::IpPort(ip, protocol, port) => write!(f, "{ip},{}:{port}", Protocol::lower_case(*protocol)),
            Self::IpPortIp(ip, protocol, port, other) => {
                write!(f, "{ip},{}:{port},{other}", Protocol::lower_case(*protocol))
            }
            Self::IpPortNet(ip, protocol, port, net) => {
                write!(f, "{ip},{}:{port},{net}", Protocol::lower_case(*protocol))
            }
            Self::Port(port) => write!(f, "{port}"),
        }
    }
}

impl Entry {
    /// Reads an entry as `ipset save` prints it for a set of `set_type`.
    pub fn parse(set_type: SetType, text: &str) -> Option<Self> {
        let parts: Vec<&str> = text.split(',').collect();
        let ip = |text: &str| text.parse::<IpAddr>().ok();
        let protocol_port = |text: &str| {
            let (protocol, port) = text.split_once(':')?;
            Some((Protocol::from_lower_case(protocol)?, port.parse::<u16>().ok()?))
        };
        match (set_type, parts.as_slice()) {
            (SetType::HashIp, [address]) => Some(Self::Ip(ip(address)?)),
            (SetType::HashIpPort, [address, pp]) => {
                let (protocol, port) = protocol_port(pp)?;
                Some(Self::IpPort(ip(address)?, protocol, port))
            }
            (SetType::HashIpPortIp, [address, pp, other]) => {
                let (protocol, port) = protocol_port(pp)?;
                Some(Self::IpPortIp(ip(address)?, protocol, port, ip(other)?))
            }
            (SetType::HashIpPortNet, [address, pp, net]) => {
                let (protocol, port) = protocol_port(pp)?;
                // ipset prints a host-sized net without its length.
                let net = net.parse::<IpNet>().ok().or_else(|| ip(net).map(IpNet::from))?;
                Some(Self::IpPortNet(ip(address)?, protocol, port, net))
            }
            (SetType::BitmapPort, [port]) => Some(Self::Port(port.parse().ok()?)),
            _ => None,
        }
    }
}

/// Set name -> members.
pub type SetContents = BTreeMap<String, BTreeSet<Entry>>;

/// Every set of both families, named, with its type.
pub fn all_sets() -> Vec<(String, SetSpec, Family)> {
    [Family::Ipv4, Family::Ipv6]
        .into_iter()
        .flat_map(|family| ALL.iter().map(move |spec| (spec.name(family), *spec, family)))
        .collect()
}

/// Reads `ipset save` output: the members of the sets in `wanted` that exist (a set that
/// exists but is empty maps to an empty list).
pub fn parse_save(text: &str, wanted: &[(String, SetSpec, Family)]) -> SetContents {
    let types: BTreeMap<&str, SetType> =
        wanted.iter().map(|(name, spec, _)| (name.as_str(), spec.set_type)).collect();
    let mut contents = SetContents::new();
    for line in text.lines() {
        let mut words = line.split_whitespace();
        match (words.next(), words.next(), words.next()) {
            (Some("create"), Some(name), _) if types.contains_key(name) => {
                contents.entry(name.to_owned()).or_default();
            }
            (Some("add"), Some(name), Some(entry)) => {
                if let Some(set_type) = types.get(name) {
                    if let Some(entry) = Entry::parse(*set_type, entry) {
                        contents.entry(name.to_owned()).or_default().insert(entry);
                    }
                }
            }
            _ => {}
        }
    }
    contents
}

/// The `ipset restore` input that turns `current` into `desired`: creates missing sets (all
/// of `sets` exist afterwards), adds and deletes members. Empty when nothing differs.
pub fn restore_input(
    sets: &[(String, SetSpec, Family)],
    current: &SetContents,
    desired: &SetContents,
) -> String {
    let empty = BTreeSet::new();
    let mut input = String::new();
    for (name, spec, family) in sets {
        if !current.contains_key(name) {
            input.push_str(&spec.create_line(*family));
            input.push('\n');
        }
        let have = current.get(name).unwrap_or(&empty);
        let want = desired.get(name).unwrap_or(&empty);
        for entry in want.difference(have) {
            input.push_str(&format!("add {name} {entry} -exist\n"));
        }
        for entry in have.difference(want) {
            input.push_str(&format!("del {name} {entry} -exist\n"));
        }
    }
    input
}

/// Runs `ipset`.
#[derive(Debug, Default)]
pub struct IpsetTool;

impl IpsetTool {
    pub fn save(&self) -> anyhow::Result<String> {
        tool::run(Command::new("ipset").arg("save"), None, tool::RULESET_TIMEOUT)?
            .stdout_if_success("ipset save")
    }

    pub fn restore(&self, input: &str) -> anyhow::Result<()> {
        tool::run(Command::new("ipset").arg("restore"), Some(input.as_bytes()), tool::RULESET_TIMEOUT)?
            .stdout_if_success("ipset restore")
            .map(drop)
    }

    /// Destroys the named sets that exist; a set still referenced by a rule stays (and is
    /// reported).
    pub fn destroy(&self, names: &[String]) -> anyhow::Result<()> {
        let existing = parse_save(&self.save()?, &all_sets());
        let mut failed = Vec::new();
        for name in names.iter().filter(|name| existing.contains_key(*name)) {
            let output = tool::run(Command::new("ipset").args(["destroy", name]), None, tool::QUERY_TIMEOUT)?;
            if let Err(error) = output.stdout_if_success(&format!("ipset destroy {name}")) {
                failed.push(format!("{error:#}"));
            }
        }
        if !failed.is_empty() {
            bail!("cannot destroy ipsets: {}", failed.join("; "));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_kube_proxy_per_family() {
        assert_eq!(CLUSTER_IP.name(Family::Ipv4), "KUBE-CLUSTER-IP");
        assert_eq!(CLUSTER_IP.name(Family::Ipv6), "KUBE-6-CLUSTER-IP");
        assert_eq!(
            CLUSTER_IP.create_line(Family::Ipv6),
            "create KUBE-6-CLUSTER-IP hash:ip,port family inet6 hashsize 1024 maxelem 65536 -exist"
        );
        assert_eq!(
            NODE_PORT_TCP.create_line(Family::Ipv4),
            "create KUBE-NODE-PORT-TCP bitmap:port range 0-65535 -exist"
        );
        assert_eq!(LOAD_BALANCER_SOURCE_CIDR.name(Family::Ipv6), "KUBE-6-LOAD-BALANCER-SOURCE-CID");
        let names: BTreeSet<String> = all_sets().into_iter().map(|(name, _, _)| name).collect();
        assert_eq!(names.len(), 2 * ALL.len(), "unique");
        assert!(names.iter().all(|name| name.len() <= MAX_NAME_LEN));
    }

    #[test]
    fn entries_print_and_parse_as_ipset_does() {
        let cases = [
            (
                SetType::HashIpPort,
                Entry::IpPort("10.96.0.10".parse().unwrap(), Protocol::Tcp, 80),
                "10.96.0.10,tcp:80",
            ),
            (
                SetType::HashIpPort,
                Entry::IpPort("fd00::a".parse().unwrap(), Protocol::Udp, 53),
                "fd00::a,udp:53",
            ),
            (
                SetType::HashIpPortIp,
                Entry::IpPortIp(
                    "10.1.0.2".parse().unwrap(),
                    Protocol::Sctp,
                    8080,
                    "10.1.0.2".parse().unwrap(),
                ),
                "10.1.0.2,sctp:8080,10.1.0.2",
            ),
            (
                SetType::HashIpPortNet,
                Entry::IpPortNet(
                    "1.2.3.4".parse().unwrap(),
                    Protocol::Tcp,
                    80,
                    "203.0.113.0/25".parse().unwrap(),
                ),
                "1.2.3.4,tcp:80,203.0.113.0/25",
            ),
            (SetType::BitmapPort, Entry::Port(30080), "30080"),
            (SetType::HashIp, Entry::Ip("10.96.0.10".parse().unwrap()), "10.96.0.10"),
        ];
        for (set_type, entry, text) in cases {
            assert_eq!(entry.to_string(), text);
            assert_eq!(Entry::parse(set_type, text), Some(entry), "{text}");
        }
        // A /32 net comes back from ipset without its length.
        assert_eq!(
            Entry::parse(SetType::HashIpPortNet, "1.2.3.4,tcp:80,5.6.7.8"),
            Some(Entry::IpPortNet(
                "1.2.3.4".parse().unwrap(),
                Protocol::Tcp,
                80,
                "5.6.7.8/32".parse().unwrap()
            ))
        );
        assert_eq!(Entry::parse(SetType::HashIpPort, "10.0.0.1,icmp:8"), None);
    }

    #[test]
    fn restore_changes_only_what_differs() {
        let sets = vec![
            (CLUSTER_IP.name(Family::Ipv4), CLUSTER_IP, Family::Ipv4),
            (NODE_PORT_TCP.name(Family::Ipv4), NODE_PORT_TCP, Family::Ipv4),
        ];
        let saved = "create KUBE-CLUSTER-IP hash:ip,port family inet hashsize 1024 maxelem 65536 bucketsize 12 initval 0x1\n\
                     add KUBE-CLUSTER-IP 10.96.0.10,tcp:80\n\
                     add KUBE-CLUSTER-IP 10.96.0.11,udp:53\n\
                     create OTHER hash:ip family inet\n\
                     add OTHER 1.1.1.1\n";
        let current = parse_save(saved, &sets);
        assert_eq!(current.len(), 1, "only our sets; KUBE-NODE-PORT-TCP does not exist yet");
        let mut desired = SetContents::new();
        desired.entry(sets[0].0.clone()).or_default().extend([
            Entry::IpPort("10.96.0.10".parse().unwrap(), Protocol::Tcp, 80),
            Entry::IpPort("10.96.0.12".parse().unwrap(), Protocol::Tcp, 443),
        ]);
        desired.entry(sets[1].0.clone()).or_default().insert(Entry::Port(30080));
        assert_eq!(
            restore_input(&sets, &current, &desired),
            "add KUBE-CLUSTER-IP 10.96.0.12,tcp:443 -exist\n\
             del KUBE-CLUSTER-IP 10.96.0.11,udp:53 -exist\n\
             create KUBE-NODE-PORT-TCP bitmap:port range 0-65535 -exist\n\
             add KUBE-NODE-PORT-TCP 30080 -exist\n"
        );
        let mut after = current.clone();
        after.insert(sets[0].0.clone(), desired[&sets[0].0].clone());
        after.insert(sets[1].0.clone(), desired[&sets[1].0].clone());
        assert_eq!(restore_input(&sets, &after, &desired), "", "nothing left to do");
    }
}
