//! Where vipr deliberately differs from an iptables-semantics case file.
//!
//! kube-proxy's iptables and nftables backends disagree in a few places (the cases' README,
//! section 9). vipr follows nftables, so the flows below, recorded from iptables tests, are
//! checked against the nftables outcome instead of the recorded one, by the runner and by
//! the model-level test alike. The list is explicit, flow by flow, and each entry also names
//! the recorded verdict: a case file that changes under it is an error, not a silent pass.
//! docs/conformance.md explains each reason. Other modes have their own lists;
//! [`expectation_in`] gives any mode's expectation.

use anyhow::{ensure, Result};

use super::{
    case::{Case, CaseFile, Flow, Stage, Verdict},
    flags::Mode,
    iptables::iptables_difference_of,
    ipvs::ipvs_difference_of,
    model::Outcome,
    nftables::nftables_difference_of,
};

/// iptables serves a cluster IP's unserved ports by letting the packet pass; nftables rejects.
pub const UNSERVED_CLUSTER_IP_PORT: &str =
    "cluster IP on a port/protocol it does not serve: iptables lets it pass, nftables and vipr reject it";
/// iptables' default `node_port_addresses` (unset) is every local address; nftables' default
/// is the primary node IPs, and vipr's default is nftables'.
pub const NODE_PORTS_ON_EVERY_ADDRESS: &str =
    "no --nodeport-addresses: iptables serves NodePorts on every local \
     address, nftables and vipr only on the primary node IPs";

/// Flows of a case file that a mode checks against another outcome than the recorded one, all
/// for the same reason:
/// an entry of [`KNOWN_DIFFERENCES`], [`super::iptables::IPTABLES_DIFFERENCES`] or
/// [`super::ipvs::IPVS_DIFFERENCES`], whose `outcome` type is the list's own.
#[derive(Clone, Copy, Debug)]
pub struct Listed<O> {
    /// The case file's `id`.
    pub file_id: &'static str,
    pub case: &'static str,
    pub stage: &'static str,
    /// The flows' `id`s in that stage.
    pub flows: &'static [u32],
    /// What the file says, to notice a file that changed under the list.
    pub recorded: Verdict,
    pub outcome: O,
    pub why: &'static str,
}

/// An entry for flows of the stage "initial".
pub const fn listed<O>(
    file_id: &'static str,
    case: &'static str,
    flows: &'static [u32],
    recorded: Verdict,
    outcome: O,
    why: &'static str,
) -> Listed<O> {
    Listed { file_id, case, stage: "initial", flows, recorded, outcome, why }
}

impl<O> Listed<O> {
    /// The entry of `list` for `flow`, if any.
    pub fn find<'a>(
        list: &'a [Listed<O>],
        file: &CaseFile,
        case: &Case,
        stage: &Stage,
        flow: &Flow,
    ) -> Option<&'a Listed<O>> {
        list.iter().find(|known| {
            known.file_id == file.id
                && known.case == case.case_name
                && known.stage == stage.label
                && known.flows.contains(&flow.id)
        })
    }

    /// An error when the file no longer records what the list (named `list`) expects.
    pub fn check_recorded(&self, flow: &Flow, list: &str) -> Result<()> {
        ensure!(
            flow.expect.verdict == self.recorded,
            "{} {:?} {:?} flow {}: the {list} list expects a recorded {}, the file says {}",
            self.file_id,
            self.case,
            self.stage,
            flow.id,
            self.recorded,
            flow.expect.verdict
        );
        Ok(())
    }
}

/// Where vipr follows nftables against an iptables file: the verdict it gives instead (never
/// DNAT).
pub type KnownDifference = Listed<Verdict>;

const fn difference(
    file_id: &'static str,
    case: &'static str,
    flows: &'static [u32],
    recorded: Verdict,
    vipr: Verdict,
    why: &'static str,
) -> KnownDifference {
    listed(file_id, case, flows, recorded, vipr, why)
}

pub static KNOWN_DIFFERENCES: &[KnownDifference] = &[
    difference(
        "iptables.TestClusterIPGeneral",
        "",
        &[8, 9],
        Verdict::PASS,
        Verdict::REJECT,
        UNSERVED_CLUSTER_IP_PORT,
    ),
    difference(
        "iptables.TestNodePorts",
        "ipv4, localhost-nodeports enabled",
        &[5],
        Verdict::DNAT,
        Verdict::PASS,
        NODE_PORTS_ON_EVERY_ADDRESS,
    ),
    difference(
        "iptables.TestNodePorts",
        "ipv4, localhost-nodeports disabled",
        &[5],
        Verdict::DNAT,
        Verdict::PASS,
        NODE_PORTS_ON_EVERY_ADDRESS,
    ),
    difference(
        "iptables.TestNodePorts",
        "ipv6, localhost-nodeports enabled",
        &[5],
        Verdict::DNAT,
        Verdict::PASS,
        NODE_PORTS_ON_EVERY_ADDRESS,
    ),
    difference(
        "iptables.TestNodePorts",
        "ipv6, localhost-nodeports disabled",
        &[5],
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
    Listed::find(KNOWN_DIFFERENCES, file, case, stage, flow)
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
    known.check_recorded(flow, "known-differences")?;
    Ok((Outcome::of(known.outcome), Some(known)))
}

/// Where a mode's checked outcome is not the recorded one: whose behaviour it is (`nftables`,
/// `iptables`, `ipvs`), what the file records, and why.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Difference {
    pub whose: &'static str,
    pub recorded: Verdict,
    pub why: &'static str,
}

/// What a flow is checked against in one mode.
#[derive(Clone, Debug)]
pub struct ModeExpectation {
    pub outcome: Outcome,
    /// Set when the outcome is not the recorded one.
    pub difference: Option<Difference>,
    /// Why the flow cannot be reproduced on the lab in this mode (it is skipped).
    pub skip: Option<&'static str>,
}

/// What vipr must do with `flow` when it runs in `mode`, the dataplane actually serving (a
/// run that let vipr choose its mode passes the one vipr chose):
/// - `ebpf`: the recorded outcome, or the nftables one for [`KNOWN_DIFFERENCES`];
/// - `iptables`: the recorded outcome (the iptables files are authoritative), or kube-proxy's
///   iptables behaviour for the nftables-semantics flows where the backends disagree
///   ([`super::iptables::IPTABLES_DIFFERENCES`]);
/// - `nftables`: as ebpf (kube-proxy's nftables semantics), but for
///   [`super::nftables::NFTABLES_DIFFERENCES`];
/// - `ipvs`: kube-proxy's IPVS behaviour for [`super::ipvs::IPVS_DIFFERENCES`], else as ebpf.
pub fn expectation_in(
    mode: Mode,
    file: &CaseFile,
    case: &Case,
    stage: &Stage,
    flow: &Flow,
) -> Result<ModeExpectation> {
    let recorded =
        || ModeExpectation { outcome: Outcome::expected(&flow.expect), difference: None, skip: None };
    match mode {
        Mode::Iptables => Ok(match iptables_difference_of(file, case, stage, flow) {
            Some(known) => ModeExpectation {
                outcome: known.outcome_for(flow)?,
                difference: Some(Difference { whose: "iptables", recorded: known.recorded, why: known.why }),
                skip: None,
            },
            None => recorded(),
        }),
        Mode::Ebpf | Mode::Ipvs | Mode::Nftables => {
            let (outcome, known) = expectation(file, case, stage, flow)?;
            let mut expect = ModeExpectation {
                outcome,
                difference: known.map(|known| Difference {
                    whose: "nftables",
                    recorded: known.recorded,
                    why: known.why,
                }),
                skip: None,
            };
            if mode == Mode::Nftables {
                if let Some(nftables) = nftables_difference_of(file, case, stage, flow) {
                    nftables.check_recorded(flow, "nftables differences")?;
                    expect.difference = Some(Difference {
                        whose: "nftables",
                        recorded: nftables.recorded,
                        why: nftables.why,
                    });
                    expect.outcome = Outcome::of(nftables.outcome);
                }
            }
            if mode == Mode::Ipvs {
                if let Some(ipvs) = ipvs_difference_of(file, case, stage, flow) {
                    expect.difference =
                        Some(Difference { whose: "ipvs", recorded: ipvs.recorded, why: ipvs.why });
                    match ipvs.outcome_for(flow)? {
                        Some(outcome) => expect.outcome = outcome,
                        None => expect.skip = Some("not reproducible on this lab in ipvs mode"),
                    }
                }
            }
            Ok(expect)
        }
    }
}
