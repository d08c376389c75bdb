//! The recorded cases: `kube-proxy-packet-flow/v1` files (format in
//! `tests/conformance/kube-proxy-flows/README.md`), read as they are written.
//!
//! Values the format leaves `null` stay `None` here; nothing is defaulted or repaired, so that
//! what reaches vipr (see [`super::objects`]) is exactly what upstream gave the proxier.

use std::{
    fmt,
    net::{IpAddr, SocketAddr},
    path::{Path, PathBuf},
};

use anyhow::{bail, ensure, Context, Result};
use ipnet::IpNet;
use serde::Deserialize;

pub const SCHEMA: &str = "kube-proxy-packet-flow/v1";

/// One file: one upstream test function.
#[derive(Clone, Debug, Deserialize)]
pub struct CaseFile {
    pub schema: String,
    /// `<backend>.<TestFunction>`.
    pub id: String,
    pub source: Source,
    #[serde(default)]
    pub source_facts: Vec<String>,
    pub cases: Vec<Case>,
}

#[derive(Clone, Debug, Deserialize)]
pub struct Source {
    /// `iptables` or `nftables`: whose semantics the expectations follow.
    pub backend: String,
    pub test_function: String,
}

/// One upstream sub-test: a node, and states of it that follow each other.
#[derive(Clone, Debug, Deserialize)]
pub struct Case {
    pub case_name: String,
    pub node: Node,
    pub stages: Vec<Stage>,
}

pub use vipr::model::IpFamily;

/// A node's family as the case files spell it, Kubernetes' `IPv4` / `IPv6`.
fn ip_family<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<IpFamily, D::Error> {
    match String::deserialize(deserializer)?.as_str() {
        "IPv4" => Ok(IpFamily::Ipv4),
        "IPv6" => Ok(IpFamily::Ipv6),
        other => Err(serde::de::Error::custom(format!("unknown IP family {other:?}"))),
    }
}

#[derive(Clone, Debug, Deserialize)]
pub struct Node {
    pub node_name: String,
    #[serde(deserialize_with = "ip_family")]
    pub ip_family: IpFamily,
    pub primary_node_ip: IpAddr,
    pub interfaces: Vec<Interface>,
    pub node_local_addresses: Vec<IpAddr>,
    pub local_traffic_detector: LocalTrafficDetector,
    pub pod_cidr: String,
    pub masquerade_all: bool,
    /// `None`: the backend's default (the flag is not passed).
    pub node_port_addresses: Option<Vec<String>>,
    pub localhost_node_ports: Option<bool>,
    pub service_cidrs: Option<Vec<String>>,
}

impl Node {
    /// The local-traffic detector's CIDRs; empty when the mode is `None`.
    pub fn detector_cidrs(&self) -> Result<Vec<IpNet>> {
        match self.local_traffic_detector.mode.as_str() {
            "ClusterCIDR" => self.local_traffic_detector.cidrs.iter().map(|cidr| parse_cidr(cidr)).collect(),
            "None" => Ok(Vec::new()),
            other => bail!("unknown local_traffic_detector mode {other:?}"),
        }
    }

    pub fn pod_cidr(&self) -> Result<IpNet> {
        parse_cidr(&self.pod_cidr)
    }

    /// Interfaces other than loopback: the node's links to the rest of the network.
    pub fn uplinks(&self) -> impl Iterator<Item = &Interface> {
        self.interfaces.iter().filter(|interface| interface.name != "lo")
    }

    /// The node's primary address of `family`: the recorded primary node IP if it is of that
    /// family, else the first such address on an uplink.
    pub fn primary_ip(&self, family: IpFamily) -> Option<IpAddr> {
        if IpFamily::of(self.primary_node_ip) == family {
            return Some(self.primary_node_ip);
        }
        self.uplinks()
            .flat_map(|interface| interface.addresses.iter())
            .filter_map(|address| parse_cidr(address).ok())
            .map(|net| net.addr())
            .find(|ip| IpFamily::of(*ip) == family)
    }

    pub fn is_local(&self, ip: IpAddr) -> bool {
        self.node_local_addresses.contains(&ip)
    }
}

#[derive(Clone, Debug, Deserialize)]
pub struct Interface {
    pub name: String,
    /// `address/prefix`, the address itself (not the network) first.
    pub addresses: Vec<String>,
}

#[derive(Clone, Debug, Deserialize)]
pub struct LocalTrafficDetector {
    pub mode: String,
    #[serde(default)]
    pub cidrs: Vec<String>,
}

/// The complete desired state at one point of a case, and the flows checked against it.
#[derive(Clone, Debug, Deserialize)]
pub struct Stage {
    pub label: String,
    pub services: Vec<Service>,
    pub endpoint_slices: Vec<EndpointSlice>,
    pub flows: Vec<Flow>,
}

#[derive(Clone, Debug, Deserialize)]
pub struct Service {
    pub namespace: String,
    pub name: String,
    #[serde(rename = "type")]
    pub type_: Option<String>,
    pub cluster_ips: Vec<String>,
    pub ports: Vec<ServicePort>,
    #[serde(default)]
    pub external_ips: Vec<String>,
    #[serde(default)]
    pub load_balancer_ingress: Vec<LoadBalancerIngress>,
    #[serde(default)]
    pub load_balancer_source_ranges: Vec<String>,
    pub external_traffic_policy: Option<String>,
    pub internal_traffic_policy: Option<String>,
    pub session_affinity: Option<SessionAffinity>,
    pub health_check_node_port: Option<i32>,
}

#[derive(Clone, Debug, Deserialize)]
pub struct ServicePort {
    pub name: String,
    pub protocol: Protocol,
    pub port: i32,
    pub target_port: Option<i32>,
    pub node_port: Option<i32>,
}

#[derive(Clone, Debug, Deserialize)]
pub struct LoadBalancerIngress {
    pub ip: String,
    pub ip_mode: Option<String>,
}

#[derive(Clone, Debug, Deserialize)]
pub struct SessionAffinity {
    #[serde(rename = "type")]
    pub type_: String,
    pub timeout_seconds: Option<i32>,
}

#[derive(Clone, Debug, Deserialize)]
pub struct EndpointSlice {
    pub namespace: String,
    pub name: String,
    pub service_name: String,
    pub address_type: String,
    pub endpoints: Vec<Endpoint>,
    pub ports: Vec<SlicePort>,
}

#[derive(Clone, Debug, Deserialize)]
pub struct Endpoint {
    pub addresses: Vec<String>,
    pub node_name: Option<String>,
    pub conditions: Option<Conditions>,
}

#[derive(Clone, Debug, Default, Deserialize)]
pub struct Conditions {
    pub ready: Option<bool>,
    pub serving: Option<bool>,
    pub terminating: Option<bool>,
}

#[derive(Clone, Debug, Deserialize)]
pub struct SlicePort {
    pub name: String,
    pub port: i32,
    pub protocol: Protocol,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Deserialize)]
pub enum Protocol {
    TCP,
    UDP,
    SCTP,
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// The first packet of a new connection, and what must happen to it.
#[derive(Clone, Debug, Deserialize)]
pub struct Flow {
    pub id: u32,
    pub name: String,
    pub source_ip: IpAddr,
    pub protocol: Protocol,
    pub dest_ip: IpAddr,
    pub dest_port: u16,
    pub expect: Expect,
    pub derived: Derived,
}

impl Flow {
    pub fn dest(&self) -> SocketAddr {
        SocketAddr::new(self.dest_ip, self.dest_port)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Deserialize)]
pub enum Verdict {
    DNAT,
    DROP,
    REJECT,
    ACCEPT,
    PASS,
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
pub struct Expect {
    pub verdict: Verdict,
    /// `ip:port` / `[ip]:port`; non-empty iff the verdict is DNAT.
    #[serde(deserialize_with = "socket_addrs")]
    pub endpoints: Vec<SocketAddr>,
    pub masquerade: bool,
}

#[derive(Clone, Debug, Deserialize)]
pub struct Derived {
    pub source_kind: String,
    pub dest_kind: String,
    pub target_service: Option<String>,
}

fn socket_addrs<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<Vec<SocketAddr>, D::Error> {
    let texts = Vec::<String>::deserialize(deserializer)?;
    texts
        .iter()
        .map(|text| text.parse().map_err(|_| serde::de::Error::custom(format!("{text:?} is not ip:port"))))
        .collect()
}

/// Parses `address/prefix`, keeping the address's host bits (`192.168.0.2/24`).
pub fn parse_cidr(text: &str) -> Result<IpNet> {
    let text = text.trim();
    text.parse::<IpNet>()
        .or_else(|_| text.parse::<IpAddr>().map(IpNet::from))
        .with_context(|| format!("{text:?} is not a CIDR"))
}

impl CaseFile {
    pub fn load(path: &Path) -> Result<Self> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
        let file: Self = serde_json::from_str(&text)
            .with_context(|| format!("{} is not a {SCHEMA} file", path.display()))?;
        ensure!(file.schema == SCHEMA, "{}: schema {:?}, expected {SCHEMA}", path.display(), file.schema);
        Ok(file)
    }
}

/// The case files named by `paths`: a file as it is, a directory's `*.json` files in name
/// order.
pub fn case_files(paths: &[PathBuf]) -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for path in paths {
        if path.is_dir() {
            let mut found: Vec<PathBuf> = std::fs::read_dir(path)
                .with_context(|| format!("cannot list {}", path.display()))?
                .map(|entry| entry.map(|entry| entry.path()))
                .collect::<std::io::Result<_>>()?;
            found.retain(|file| file.extension().is_some_and(|ext| ext == "json"));
            found.sort();
            ensure!(!found.is_empty(), "{} has no .json case files", path.display());
            files.extend(found);
        } else if path.is_file() {
            files.push(path.clone());
        } else {
            bail!("{} is neither a case file nor a directory", path.display());
        }
    }
    Ok(files)
}
