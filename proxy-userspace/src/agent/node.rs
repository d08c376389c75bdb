//! This node as the agent's settings and its Node object describe it: the facts the model
//! resolves into a `NodeContext`.
use std::net::IpAddr;

use ipnet::IpNet;
use k8s_openapi::api::core::v1::Node;

use crate::{
    config::NodePortAddress,
    model::kubernetes::{NodeContext, NodeFacts, ProxySettings},
};

/// The node's primary addresses from its Node object, as kube-proxy's `GetNodeHostIPs`: the
/// first InternalIP (else ExternalIP), and the first of the other family. Empty without a
/// Node (the model then takes the first interface address of each family).
pub fn primary_ips(node: Option<&Node>) -> Vec<IpAddr> {
    let addresses = node.and_then(|node| node.status.as_ref()).and_then(|status| status.addresses.as_ref());
    let of_type = |kind: &'static str| {
        addresses
            .into_iter()
            .flatten()
            .filter(move |address| address.type_ == kind)
            .filter_map(|address| address.address.parse::<IpAddr>().ok())
    };
    let mut candidates = of_type("InternalIP").chain(of_type("ExternalIP"));
    let Some(first) = candidates.next() else {
        return Vec::new();
    };
    let other_family = candidates.find(|ip| ip.is_ipv4() != first.is_ipv4());
    std::iter::once(first).chain(other_family).collect()
}

/// [`primary_ips`] with `--bind-address` (when not unspecified) as the primary IP of its
/// family, as kube-proxy's node IP override; the Node's stays for the other family.
pub fn primary_ips_with_override(node: Option<&Node>, bind_address: Option<IpAddr>) -> Vec<IpAddr> {
    let from_node = primary_ips(node);
    let Some(bind) = bind_address else { return from_node };
    std::iter::once(bind).chain(from_node.into_iter().filter(|ip| ip.is_ipv4() != bind.is_ipv4())).collect()
}

/// The Node's `spec.podCIDRs` (or the older single `spec.podCIDR`): the local-traffic
/// detector's CIDRs with `--detect-local-mode=NodeCIDR`. Unparsable entries are skipped; none
/// (no Node yet, or none allocated) means no detector until the Node has them.
pub fn pod_cidrs(node: Option<&Node>) -> Vec<ipnet::IpNet> {
    let Some(spec) = node.and_then(|node| node.spec.as_ref()) else { return Vec::new() };
    let listed = spec.pod_cidrs.iter().flatten().chain(spec.pod_cidr.iter());
    let mut cidrs: Vec<ipnet::IpNet> = Vec::new();
    for cidr in listed.filter_map(|text| text.trim().parse::<ipnet::IpNet>().ok()) {
        if !cidrs.contains(&cidr) {
            cidrs.push(cidr);
        }
    }
    cidrs
}

/// Whether `--nodeport-addresses` admits every address (`all`, or a /0), in which case
/// kube-proxy's health-check servers listen on the unspecified address.
pub fn matches_all(addresses: &[NodePortAddress]) -> bool {
    addresses.iter().any(|address| match address {
        NodePortAddress::All => true,
        NodePortAddress::Cidr(cidr) => cidr.prefix_len() == 0,
        NodePortAddress::Primary | NodePortAddress::Localhost => false,
    })
}

/// `--nodeport-addresses` as the model's CIDRs: keywords become the ranges they stand for
/// (`primary`: the primary addresses the model resolves for `facts`). Empty stays empty, which
/// the model takes as the primary addresses (kube-proxy's nftables default).
pub fn node_port_cidrs(addresses: &[NodePortAddress], facts: &NodeFacts) -> Vec<IpNet> {
    let any = |text: &str| text.parse::<IpNet>().ok();
    addresses
        .iter()
        .flat_map(|address| match address {
            NodePortAddress::Cidr(cidr) => vec![*cidr],
            NodePortAddress::All => [any("0.0.0.0/0"), any("::/0")].into_iter().flatten().collect(),
            NodePortAddress::Localhost => {
                [any("127.0.0.0/8"), any("::1/128")].into_iter().flatten().collect()
            }
            NodePortAddress::Primary => NodeContext::resolve(facts, &ProxySettings::default())
                .primary_ips
                .into_iter()
                .map(IpNet::from)
                .collect(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    #[test]
    fn bind_address_overrides_the_primary_ip_of_its_family_only() {
        let node: Node = serde_json::from_value(json!({
            "metadata": {"name": "n"},
            "status": {"addresses": [
                {"type": "InternalIP", "address": "10.0.0.7"},
                {"type": "InternalIP", "address": "fd00::7"},
            ]}
        }))
        .unwrap();
        assert_eq!(primary_ips_with_override(Some(&node), None), [ip("10.0.0.7"), ip("fd00::7")]);
        assert_eq!(
            primary_ips_with_override(Some(&node), Some(ip("10.9.9.9"))),
            [ip("10.9.9.9"), ip("fd00::7")]
        );
        assert_eq!(
            primary_ips_with_override(Some(&node), Some(ip("fd00::9"))),
            [ip("fd00::9"), ip("10.0.0.7")]
        );
        assert_eq!(primary_ips_with_override(None, Some(ip("10.9.9.9"))), [ip("10.9.9.9")]);
    }

    #[test]
    fn node_cidr_detection_reads_the_nodes_pod_cidrs() {
        let node: Node = serde_json::from_value(json!({
            "metadata": {"name": "n"},
            "spec": {"podCIDR": "10.244.1.0/24", "podCIDRs": ["10.244.1.0/24", "fd00:10:244:1::/64", "junk"]}
        }))
        .unwrap();
        let cidrs: Vec<String> = pod_cidrs(Some(&node)).iter().map(ToString::to_string).collect();
        assert_eq!(cidrs, ["10.244.1.0/24", "fd00:10:244:1::/64"]);
        let old: Node =
            serde_json::from_value(json!({"metadata": {"name": "n"}, "spec": {"podCIDR": "10.244.2.0/24"}}))
                .unwrap();
        assert_eq!(pod_cidrs(Some(&old)).len(), 1);
        assert!(pod_cidrs(None).is_empty());
    }

    #[test]
    fn primary_ips_prefer_internal_and_take_one_per_family() {
        let node: Node = serde_json::from_value(json!({
            "metadata": {"name": "n"},
            "status": {"addresses": [
                {"type": "Hostname", "address": "n"},
                {"type": "ExternalIP", "address": "203.0.113.7"},
                {"type": "InternalIP", "address": "10.0.0.7"},
                {"type": "InternalIP", "address": "10.0.0.8"},
                {"type": "InternalIP", "address": "fd00::7"},
            ]}
        }))
        .unwrap();
        assert_eq!(primary_ips(Some(&node)), [ip("10.0.0.7"), ip("fd00::7")]);
        assert!(primary_ips(None).is_empty());
    }

    #[test]
    fn node_port_keywords_become_cidrs() {
        let facts = NodeFacts { addresses: vec![ip("10.0.0.7"), ip("192.168.1.7")], ..NodeFacts::default() };
        let cidr = |text: &str| text.parse::<IpNet>().unwrap();
        assert!(node_port_cidrs(&[], &facts).is_empty());
        assert_eq!(node_port_cidrs(&[NodePortAddress::All], &facts), [cidr("0.0.0.0/0"), cidr("::/0")]);
        assert_eq!(
            node_port_cidrs(
                &[NodePortAddress::Primary, NodePortAddress::Cidr(cidr("192.168.0.0/16"))],
                &facts
            ),
            [cidr("10.0.0.7/32"), cidr("192.168.0.0/16")]
        );
        assert!(matches_all(&[NodePortAddress::Cidr(cidr("0.0.0.0/0"))]));
        assert!(!matches_all(&[]), "empty means the primary addresses");
        assert!(!matches_all(&[NodePortAddress::Cidr(cidr("10.0.0.0/8"))]));
    }
}
