//! Where vipr deliberately differs from an iptables-semantics case file.
//!
//! kube-proxy's iptables and nftables backends disagree in a few places (the cases' README,
//! section 9). vipr follows nftables, so the flows below, recorded from iptables tests, are
//! checked against the nftables outcome instead of the recorded one, by the runner and by
//! the model-level test alike. The list is explicit, flow by flow, and each entry also names
//! the recorded verdict: a case file that changes under it is an error, not a silent pass.
//! docs/conformance.md explains each reason.

use anyhow::{ensure, Result};

use super::{
    case::{Case, CaseFile, Flow, Stage, Verdict},
    model::Outcome,
};

/// iptables serves a cluster IP's unserved ports by letting the packet pass; nftables rejects.
pub const UNSERVED_CLUSTER_IP_PORT: &str =
    "cluster IP on a port/protocol it does not serve: iptables lets it pass, nftables and vipr reject it";
/// iptables' default `node_port_addresses` (unset) is every local address; nftables' default
/// is the primary node IPs, and vipr's default is nftables'.
pub const NODE_PORTS_ON_EVERY_ADDRESS: &str =
    "no --nodeport-addresses: iptables serves NodePorts on every local \
     address, nftables and vipr only on the primary node IPs";
/// `--iptables-localhost-nodeports` exists only in iptables mode.
pub const LOCALHOST_NODE_PORTS: &str =
    "iptables serves IPv4 NodePorts on 127.0.0.1 (localhost_node_ports); nftables and vipr never on loopback";

#[derive(Clone, Copy, Debug)]
pub struct KnownDifference {
    /// The case file's `id`.
    pub file_id: &'static str,
    pub case: &'static str,
    pub stage: &'static str,
    pub flow: u32,
    /// What the file says, to notice a file that changed under this list.
    pub recorded: Verdict,
    /// What vipr does instead (never DNAT).
    pub vipr: Verdict,
    pub why: &'static str,
}

const fn difference(
    file_id: &'static str,
    case: &'static str,
    flow: u32,
    recorded: Verdict,
    vipr: Verdict,
    why: &'static str,
) -> KnownDifference {
    KnownDifference { file_id, case, stage: "initial", flow, recorded, vipr, why }
}

pub static KNOWN_DIFFERENCES: &[KnownDifference] = &[
    difference(
        "iptables.TestClusterIPGeneral",
        "",
        8,
        Verdict::PASS,
        Verdict::REJECT,
        UNSERVED_CLUSTER_IP_PORT,
    ),
    difference(
        "iptables.TestClusterIPGeneral",
        "",
        9,
        Verdict::PASS,
        Verdict::REJECT,
        UNSERVED_CLUSTER_IP_PORT,
    ),
    difference(
        "iptables.TestNodePorts",
        "ipv4, localhost-nodeports enabled",
        4,
        Verdict::DNAT,
        Verdict::PASS,
        LOCALHOST_NODE_PORTS,
    ),
    difference(
        "iptables.TestNodePorts",
        "ipv4, localhost-nodeports enabled",
        5,
        Verdict::DNAT,
        Verdict::PASS,
        NODE_PORTS_ON_EVERY_ADDRESS,
    ),
    difference(
        "iptables.TestNodePorts",
        "ipv4, localhost-nodeports disabled",
        5,
        Verdict::DNAT,
        Verdict::PASS,
        NODE_PORTS_ON_EVERY_ADDRESS,
    ),
    difference(
        "iptables.TestNodePorts",
        "ipv6, localhost-nodeports enabled",
        5,
        Verdict::DNAT,
        Verdict::PASS,
        NODE_PORTS_ON_EVERY_ADDRESS,
    ),
    difference(
        "iptables.TestNodePorts",
        "ipv6, localhost-nodeports disabled",
        5,
        Verdict::DNAT,
        Verdict::PASS,
        NODE_PORTS_ON_EVERY_ADDRESS,
    ),
];

pub fn known_difference(
    file: &CaseFile,
    case: &Case,
    stage: &Stage,
    flow: &Flow,
) -> Option<&'static KnownDifference> {
    KNOWN_DIFFERENCES.iter().find(|known| {
        known.file_id == file.id
            && known.case == case.case_name
            && known.stage == stage.label
            && known.flow == flow.id
    })
}

/// What vipr must do with `flow`: the recorded expectation, or the nftables outcome where the
/// file is an iptables file and the list says the two differ.
pub fn expectation(
    file: &CaseFile,
    case: &Case,
    stage: &Stage,
    flow: &Flow,
) -> Result<(Outcome, Option<&'static KnownDifference>)> {
    let Some(known) = known_difference(file, case, stage, flow) else {
        return Ok((Outcome::expected(&flow.expect), None));
    };
    ensure!(
        flow.expect.verdict == known.recorded,
        "{} {:?} {:?} flow {}: the known-differences list expects a recorded {}, the file says {}",
        file.id,
        case.case_name,
        stage.label,
        flow.id,
        known.recorded,
        flow.expect.verdict
    );
    Ok((Outcome::of(known.vipr), Some(known)))
}
