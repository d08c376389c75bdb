//! A case's node configuration as vipr flags (named after kube-proxy's).

use std::path::Path;

use super::case::Node;

/// The dataplane under test (`--proxy-mode`): one of vipr's running modes.
pub use vipr::dataplane::Mode;

/// vipr's command line for a case:
/// - `--node-name`: the recorded node name (decides endpoint locality);
/// - `--cluster-cidr`: the local-traffic detector's CIDRs; absent when the mode is `None`;
/// - `--masquerade-all` when set;
/// - `--nodeport-addresses`: the recorded list verbatim (other-family entries included, as
///   kube-proxy is given them); absent when `null`, so vipr's default applies;
/// - `--service-cluster-ip-range`: the nftables `service_cidrs`; absent when `null`;
/// - `--iptables-localhost-nodeports`: `localhost_node_ports`; absent when `null`, so vipr's
///   default (true, as kube-proxy's) applies. Given in every mode: only iptables mode uses it;
/// - `--devices`: every interface of the node but loopback.
pub fn vipr_args(
    node: &Node,
    mode: Mode,
    services_file: &Path,
    bpf_root: &Path,
    devices: &[String],
) -> Vec<String> {
    let mut args = vec![
        format!("--proxy-mode={}", mode.name()),
        format!("--services-file={}", services_file.display()),
        format!("--node-name={}", node.node_name),
        format!("--devices={}", devices.join(",")),
        format!("--bpf-root={}", bpf_root.display()),
    ];
    if node.local_traffic_detector.mode == "ClusterCIDR" {
        args.push(format!("--cluster-cidr={}", node.local_traffic_detector.cidrs.join(",")));
    }
    if node.masquerade_all {
        args.push("--masquerade-all".to_owned());
    }
    if let Some(addresses) = &node.node_port_addresses {
        args.push(format!("--nodeport-addresses={}", addresses.join(",")));
    }
    if let Some(cidrs) = &node.service_cidrs {
        args.push(format!("--service-cluster-ip-range={}", cidrs.join(",")));
    }
    if let Some(enabled) = node.localhost_node_ports {
        args.push(format!("--iptables-localhost-nodeports={enabled}"));
    }
    args.push("-v".to_owned());
    args
}
