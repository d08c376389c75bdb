//! A case's node configuration as vipr flags (named after kube-proxy's).

use std::path::Path;

use super::case::Node;

/// The dataplane under test (`--proxy-mode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    Ebpf,
    Iptables,
    Ipvs,
}

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Self::Ebpf => "ebpf",
            Self::Iptables => "iptables",
            Self::Ipvs => "ipvs",
        }
    }
}

/// vipr's command line for a case:
/// - `--node-name`: the recorded node name (decides endpoint locality);
/// - `--cluster-cidr`: the local-traffic detector's CIDRs; absent when the mode is `None`;
/// - `--masquerade-all` when set;
/// - `--nodeport-addresses`: the recorded list verbatim (other-family entries included, as
///   kube-proxy is given them); absent when `null`, so vipr's default applies;
/// - `--service-cluster-ip-range`: the nftables `service_cidrs`; absent when `null`;
/// - `--devices`: every interface of the node but loopback.
///
/// `localhost_node_ports` has no vipr flag: vipr never serves NodePorts on loopback.
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
    args.push("-v".to_owned());
    args
}
