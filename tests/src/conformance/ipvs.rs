//! What is particular to `--mode=ipvs`:
//! - on a machine whose kernel has no IPVS, the runner moves into User-Mode Linux guests
//!   (xtask/src/uml.rs, vipr's build of Debian's 6.1 source with IPVS) and runs the cases there, one
//!   boot per case file, each case on its own lab as usual; the guests' output is forwarded
//!   as it comes and their counts become this run's;
//! - the flows where ipvs mode does what kube-proxy's IPVS mode does rather than what the
//!   case records ([`IPVS_DIFFERENCES`], explained in docs/conformance.md).

use std::{
    collections::BTreeSet,
    ffi::OsString,
    net::SocketAddr,
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{bail, Context, Result};

use super::{
    case::{Case, CaseFile, Flow, Stage, Verdict},
    differences::{listed, Listed},
    flags::Mode,
    model::Outcome,
    run::{Options, Summary},
};

/// IPVS gives a virtual service one set of real servers for every client: kube-proxy's IPVS
/// mode (and vipr's) sends a Local external policy's pods and node to the local endpoints,
/// where the model sends them to every endpoint.
pub const ONE_SET_PER_VIRTUAL_SERVICE: &str = "ipvs: one set of real servers per virtual service; \
     with eTP:Local it is the local endpoints, for pods and the node too (kube-proxy's IPVS mode)";
/// kube-proxy's IPVS mode serves NodePorts on every node address by default, as its iptables
/// mode, so the iptables files' recording holds.
pub const NODE_PORTS_ON_EVERY_ADDRESS: &str = "ipvs: no --nodeport-addresses serves NodePorts on every \
     node address (kube-proxy's IPVS default), as recorded";
/// The load-balancer IP is bound to kube-ipvs0, so a packet arriving with it as source is a
/// martian to the node: the lab's emulation of the node's own LB-sourced connection cannot
/// work (the node's real connections of that kind stay local).
pub const LB_IP_SOURCE_IS_LOCAL: &str = "ipvs binds the load-balancer IP on the node (kube-ipvs0): \
     a packet from outside with it as source is a martian there, so the lab cannot emulate this flow";

/// kube-proxy's IPVS mode has no localhost NodePorts (`--iptables-localhost-nodeports` is its
/// iptables proxier's), so neither has vipr's.
pub const NO_LOCALHOST_NODE_PORTS: &str = "ipvs: NodePorts are not served on 127.0.0.1 \
     (kube-proxy's IPVS mode has no localhost NodePorts)";

/// What ipvs mode does with a flow instead of the recorded outcome.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IpvsOutcome {
    /// As the (iptables) file records it, where the other modes follow nftables.
    AsRecorded,
    /// Not balanced: the packet goes on as if no service were there.
    Pass,
    /// DNAT to these endpoints only.
    Dnat { endpoints: &'static [&'static str], masquerade: bool },
    /// Dropped.
    Drop,
    /// Not reproducible on the lab in ipvs mode: skipped.
    Skip,
}

/// A flow ipvs mode checks against another outcome than the recorded one.
pub type IpvsDifference = Listed<IpvsOutcome>;

const fn ipvs_difference(
    file_id: &'static str,
    case: &'static str,
    flows: &'static [u32],
    recorded: Verdict,
    ipvs: IpvsOutcome,
    why: &'static str,
) -> IpvsDifference {
    listed(file_id, case, flows, recorded, ipvs, why)
}

/// With no local endpoint, an eTP:Local virtual service has no real server: its outside
/// clients are dropped as in every kube-proxy mode, and so are pods and the node, which the
/// other modes short-circuit to the other nodes' endpoints.
pub const NO_SHORT_CIRCUIT_WITHOUT_LOCAL: &str = "ipvs: one set of real servers per virtual service; \
     with eTP:Local and no local endpoint there is none, so pods and the node are dropped as outside \
     clients are (kube-proxy's IPVS mode has no eTP:Local short-circuit)";

const LOCAL_ONLY_2_1: IpvsOutcome = IpvsOutcome::Dnat { endpoints: &["10.180.2.1:80"], masquerade: false };
const LOCAL_ONLY_0_2: IpvsOutcome = IpvsOutcome::Dnat { endpoints: &["10.180.0.2:80"], masquerade: false };

pub static IPVS_DIFFERENCES: &[IpvsDifference] = &[
    ipvs_difference(
        "iptables.TestNodePorts",
        "ipv4, localhost-nodeports enabled",
        &[4],
        Verdict::DNAT,
        IpvsOutcome::Pass,
        NO_LOCALHOST_NODE_PORTS,
    ),
    ipvs_difference(
        "iptables.TestNodePorts",
        "ipv4, localhost-nodeports enabled",
        &[5],
        Verdict::DNAT,
        IpvsOutcome::AsRecorded,
        NODE_PORTS_ON_EVERY_ADDRESS,
    ),
    ipvs_difference(
        "iptables.TestNodePorts",
        "ipv4, localhost-nodeports disabled",
        &[5],
        Verdict::DNAT,
        IpvsOutcome::AsRecorded,
        NODE_PORTS_ON_EVERY_ADDRESS,
    ),
    ipvs_difference(
        "iptables.TestNodePorts",
        "ipv6, localhost-nodeports enabled",
        &[5],
        Verdict::DNAT,
        IpvsOutcome::AsRecorded,
        NODE_PORTS_ON_EVERY_ADDRESS,
    ),
    ipvs_difference(
        "iptables.TestNodePorts",
        "ipv6, localhost-nodeports disabled",
        &[5],
        Verdict::DNAT,
        IpvsOutcome::AsRecorded,
        NODE_PORTS_ON_EVERY_ADDRESS,
    ),
    ipvs_difference(
        "iptables.TestLoadBalancer",
        "",
        &[12, 13],
        Verdict::DNAT,
        IpvsOutcome::Skip,
        LB_IP_SOURCE_IS_LOCAL,
    ),
    ipvs_difference(
        "nftables.TestLoadBalancer",
        "",
        &[12, 13],
        Verdict::DNAT,
        IpvsOutcome::Skip,
        LB_IP_SOURCE_IS_LOCAL,
    ),
    ipvs_difference(
        "nftables.TestExternalTrafficPolicyLocal",
        "",
        &[2, 4, 6],
        Verdict::DNAT,
        LOCAL_ONLY_2_1,
        ONE_SET_PER_VIRTUAL_SERVICE,
    ),
    ipvs_difference(
        "nftables.TestInternalExternalMasquerade",
        "base",
        &[11, 12, 15],
        Verdict::DNAT,
        LOCAL_ONLY_0_2,
        ONE_SET_PER_VIRTUAL_SERVICE,
    ),
    ipvs_difference(
        "nftables.TestInternalExternalMasquerade",
        "no LocalTrafficDetector",
        &[15],
        Verdict::DNAT,
        LOCAL_ONLY_0_2,
        ONE_SET_PER_VIRTUAL_SERVICE,
    ),
    ipvs_difference(
        "nftables.TestInternalExternalMasquerade",
        "masqueradeAll",
        &[11, 12, 15],
        Verdict::DNAT,
        LOCAL_ONLY_0_2,
        ONE_SET_PER_VIRTUAL_SERVICE,
    ),
    ipvs_difference(
        "nftables.TestInternalExternalMasquerade",
        "masqueradeAll, no LocalTrafficDetector",
        &[15],
        Verdict::DNAT,
        LOCAL_ONLY_0_2,
        ONE_SET_PER_VIRTUAL_SERVICE,
    ),
    IpvsDifference {
        file_id: "vipr.TestIPv6",
        case: "ipv6 services",
        stage: "initial",
        flows: &[13],
        recorded: Verdict::DNAT,
        outcome: IpvsOutcome::Drop,
        why: NO_SHORT_CIRCUIT_WITHOUT_LOCAL,
    },
];

pub fn ipvs_difference_of(
    file: &CaseFile,
    case: &Case,
    stage: &Stage,
    flow: &Flow,
) -> Option<&'static IpvsDifference> {
    Listed::find(IPVS_DIFFERENCES, file, case, stage, flow)
}

impl IpvsDifference {
    /// What ipvs mode must do with `flow` (`None`: skipped).
    pub fn outcome_for(&self, flow: &Flow) -> Result<Option<Outcome>> {
        self.check_recorded(flow, "ipvs differences")?;
        Ok(match self.outcome {
            IpvsOutcome::AsRecorded => Some(Outcome::expected(&flow.expect)),
            IpvsOutcome::Pass => Some(Outcome::of(Verdict::PASS)),
            IpvsOutcome::Skip => None,
            IpvsOutcome::Drop => Some(Outcome::of(Verdict::DROP)),
            IpvsOutcome::Dnat { endpoints, masquerade } => {
                let endpoints: BTreeSet<SocketAddr> = endpoints
                    .iter()
                    .map(|endpoint| endpoint.parse().with_context(|| format!("endpoint {endpoint:?}")))
                    .collect::<Result<_>>()?;
                Some(Outcome { verdict: Verdict::DNAT, endpoints, masquerade })
            }
        })
    }
}

#[path = "../../../xtask/src/uml.rs"]
#[allow(dead_code, clippy::all)]
mod uml;

/// The longest a whole run may take in the guest.
const GUEST_TIMEOUT: Duration = Duration::from_secs(3600);

/// Whether this kernel has IPVS.
pub fn host_has_ipvs() -> bool {
    Path::new("/proc/net/ip_vs").exists()
}

/// Whether a UML kernel is installed to run IPVS cases in.
pub fn guest_available() -> bool {
    uml::kernel().is_some()
}

/// Whether this run of `mode` must move into a guest: ipvs mode, no IPVS here, a UML kernel
/// to boot, and not in a guest already.
pub fn needs_guest(mode: Mode) -> bool {
    mode == Mode::Ipvs && !host_has_ipvs() && !uml::in_guest() && guest_available()
}

/// This runner's command line for the same run.
fn runner_command(paths: &[PathBuf], options: &Options) -> Result<Vec<OsString>> {
    let mut command: Vec<OsString> = vec![
        std::env::current_exe().context("cannot find the runner's executable")?.into(),
        format!("--mode={}", options.mode.name()).into(),
        "--vipr".into(),
        options.vipr.canonicalize().unwrap_or_else(|_| options.vipr.clone()).into(),
    ];
    if let Some(filter) = &options.filter {
        command.extend(["--filter".into(), filter.into()]);
    }
    if let Some(logs) = &options.logs {
        command.extend(["--logs".into(), logs.into()]);
    }
    command.extend(paths.iter().map(|path| path.clone().into_os_string()));
    Ok(command)
}

/// The counts of the runner's last line (`N passed, N failed, N skipped`).
pub fn parse_summary(output: &str) -> Option<Summary> {
    let line = output.lines().rev().find(|line| line.contains(" passed, ") && line.contains(" skipped"))?;
    let count = |word: &str| -> Option<usize> {
        line.split(',').find_map(|part| part.trim().strip_suffix(word)?.trim().parse().ok())
    };
    Some(Summary { passed: count("passed")?, failed: count("failed")?, skipped: count("skipped")? })
}

/// Runs the same command in guests, one boot per case file, forwarding their output; returns
/// their counts added up. (One boot for everything would do, but the single-CPU guest slows
/// down as the namespaces of earlier cases are torn down behind the later ones, enough for
/// the 1.5 s bound of a connection to fail some in the largest cases.)
pub fn run_in_guest(paths: &[PathBuf], options: &Options) -> Result<Summary> {
    eprintln!("vipr-conformance: this kernel has no IPVS; running the cases in User-Mode Linux guests");
    let mut total = Summary::default();
    for file in super::case::case_files(paths)? {
        if options.interrupted.load(std::sync::atomic::Ordering::Relaxed) {
            break;
        }
        let summary = run_file_in_guest(&file, options)?;
        total.passed += summary.passed;
        total.failed += summary.failed;
        total.skipped += summary.skipped;
    }
    Ok(total)
}

fn run_file_in_guest(file: &Path, options: &Options) -> Result<Summary> {
    let guest = uml::Options {
        timeout: GUEST_TIMEOUT,
        memory_mb: 1536,
        stream: true,
        interrupt: Some(options.interrupted.clone()),
        // This run prints the counts of all files at its end.
        hide_line: Some(|line| parse_summary(line).is_some()),
        ..uml::Options::default()
    };
    let outcome = uml::run(&runner_command(&[file.to_path_buf()], options)?, &guest)
        .with_context(|| format!("the User-Mode Linux guest failed ({})", file.display()))?;
    match (outcome.code, parse_summary(&outcome.stdout)) {
        (0 | 1 | 130, Some(summary)) => Ok(summary),
        (code, _) => bail!("the runner in the guest exited with {code} without counts ({})", file.display()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_guest_s_counts_are_read_from_its_last_line() {
        let output = "a.json \"\" \"\" 1:\"x\" DNAT PASS ok\n3 passed, 1 failed, 2 skipped\n";
        assert_eq!(parse_summary(output), Some(Summary { passed: 3, failed: 1, skipped: 2 }));
        assert_eq!(parse_summary("nothing\n"), None);
    }
}
