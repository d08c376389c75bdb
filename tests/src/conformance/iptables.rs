//! What is particular to `--mode=iptables`: the flows where the outcome checked is not the
//! recorded one ([`IPTABLES_DIFFERENCES`], explained in docs/conformance.md).
//!
//! In iptables mode vipr does what kube-proxy's iptables backend does, so the iptables files
//! are checked as recorded (the nftables list, [`super::differences::KNOWN_DIFFERENCES`], does
//! not apply), and the flows of nftables-semantics files (kube-proxy's nftables files and
//! vipr's own) where the two backends disagree are checked against what kube-proxy's iptables
//! backend does. A few entries keep an outcome where vipr deliberately does not follow
//! kube-proxy's iptables backend; each says why.

use anyhow::Result;

use super::{
    case::{Case, CaseFile, Flow, Stage, Verdict},
    differences::{listed, Listed},
    model::Outcome,
};

/// A cluster IP hit on a port or protocol it does not serve: kube-proxy's iptables rules do
/// not match it and the packet is routed on (vipr's iptables mode leaves it alone likewise).
pub const UNSERVED_CLUSTER_IP_PORT_PASSES: &str =
    "iptables: a cluster IP on a port/protocol it does not serve is left alone and routed on (nftables rejects)";
/// `--service-cluster-ip-range` makes vipr's iptables mode drop addresses of the service
/// CIDRs that are no cluster IP (`KUBE-SERVICE-CIDRS`), as kube-proxy's nftables mode does;
/// kube-proxy's iptables mode has no such rule and routes them on.
pub const UNALLOCATED_SERVICE_IP_DROPPED: &str =
    "vipr's iptables mode drops unallocated service-CIDR addresses (KUBE-SERVICE-CIDRS) as nftables \
     does; kube-proxy's iptables mode would route them on";

/// What iptables mode is checked against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IptablesOutcome {
    /// This verdict (never DNAT), where kube-proxy's iptables backend (or vipr) differs from
    /// the recorded one.
    Verdict(Verdict),
    /// The recorded (nftables-semantics) outcome although kube-proxy's iptables backend would
    /// do otherwise: vipr keeps it on purpose.
    KeptAsRecorded,
}

/// A flow iptables mode checks against another outcome than the recorded one.
pub type IptablesDifference = Listed<IptablesOutcome>;

const fn iptables_difference(
    file_id: &'static str,
    case: &'static str,
    flows: &'static [u32],
    recorded: Verdict,
    iptables: IptablesOutcome,
    why: &'static str,
) -> IptablesDifference {
    listed(file_id, case, flows, recorded, iptables, why)
}

const PASS: IptablesOutcome = IptablesOutcome::Verdict(Verdict::PASS);

pub static IPTABLES_DIFFERENCES: &[IptablesDifference] = &[
    iptables_difference(
        "nftables.TestClusterIPGeneral",
        "",
        &[8, 9],
        Verdict::REJECT,
        PASS,
        UNSERVED_CLUSTER_IP_PORT_PASSES,
    ),
    iptables_difference(
        "nftables.TestClusterIPGeneral",
        "",
        &[10],
        Verdict::DROP,
        IptablesOutcome::KeptAsRecorded,
        UNALLOCATED_SERVICE_IP_DROPPED,
    ),
    iptables_difference(
        "vipr.TestIPv6",
        "ipv6 services",
        &[9, 10],
        Verdict::REJECT,
        PASS,
        UNSERVED_CLUSTER_IP_PORT_PASSES,
    ),
];

pub fn iptables_difference_of(
    file: &CaseFile,
    case: &Case,
    stage: &Stage,
    flow: &Flow,
) -> Option<&'static IptablesDifference> {
    Listed::find(IPTABLES_DIFFERENCES, file, case, stage, flow)
}

impl IptablesDifference {
    /// What iptables mode must do with `flow`.
    pub fn outcome_for(&self, flow: &Flow) -> Result<Outcome> {
        self.check_recorded(flow, "iptables differences")?;
        Ok(match self.outcome {
            IptablesOutcome::Verdict(verdict) => Outcome::of(verdict),
            IptablesOutcome::KeptAsRecorded => Outcome::expected(&flow.expect),
        })
    }
}
