//! What is particular to `--mode=nftables`: the flows where the outcome checked is not the one
//! ebpf mode is checked against ([`NFTABLES_DIFFERENCES`], explained in docs/conformance.md).
//!
//! nftables mode follows kube-proxy's nftables backend, so it is checked as ebpf mode is (the
//! recorded outcome, the nftables one for the known differences), except where vipr's eBPF
//! mode serves something kube-proxy's nftables backend does not.

use super::{
    case::{Case, CaseFile, Flow, Stage, Verdict},
    differences::{listed, Listed},
};

/// `--iptables-localhost-nodeports` is iptables mode's: kube-proxy's nftables backend never
/// serves NodePorts on 127.0.0.1 (nor does vipr's nftables mode), so the packet reaches
/// whatever listens on the node's loopback.
pub const NO_LOCALHOST_NODE_PORTS: &str =
    "nftables: NodePorts are not served on localhost (--iptables-localhost-nodeports is iptables mode's)";

/// A flow nftables mode checks against this verdict rather than the recorded one.
pub type NftablesDifference = Listed<Verdict>;

pub static NFTABLES_DIFFERENCES: &[NftablesDifference] = &[listed(
    "iptables.TestNodePorts",
    "ipv4, localhost-nodeports enabled",
    &[4],
    Verdict::DNAT,
    Verdict::PASS,
    NO_LOCALHOST_NODE_PORTS,
)];

pub fn nftables_difference_of(
    file: &CaseFile,
    case: &Case,
    stage: &Stage,
    flow: &Flow,
) -> Option<&'static NftablesDifference> {
    Listed::find(NFTABLES_DIFFERENCES, file, case, stage, flow)
}
