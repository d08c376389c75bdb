//! The conformance runner: every case on its own lab, every flow checked on the wire.

use std::{
    collections::BTreeSet,
    fmt,
    io::Write as _,
    net::{IpAddr, SocketAddr},
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::Duration,
};

use anyhow::{bail, Context, Result};

use super::{
    case::{case_files, Case, CaseFile, Flow, IpFamily, Node, Protocol, Stage, Verdict},
    differences::{expectation_in, Difference},
    flags::{vipr_args, Mode},
    lab::{CaseLab, LabPlan, LeafPlan, Place, Side},
    model::Outcome,
    objects,
    probe::{self, Attempt, FlowCheck},
};
use crate::{wait_for, write_atomically, Check};

/// How long vipr may take to start and program a services file. A deadline, not a pause: the
/// runner goes on at the first "synced". Loading and verifying the eBPF object alone took over
/// 20 s with builds beside it on 2 CPUs.
const SYNC_TIMEOUT: Duration = Duration::from_secs(60);
/// The port of the node's control socket that the testbed self-test connects to.
const CONTROL_PORTS: std::ops::RangeInclusive<u16> = 60000..=60999;
const CONTROL_NAME: &str = "control";

#[derive(Clone, Debug)]
pub struct Options {
    pub mode: Mode,
    pub vipr: PathBuf,
    /// Only flows whose `file case stage name` line contains this.
    pub filter: Option<String>,
    /// Where to copy each case's vipr log.
    pub logs: Option<PathBuf>,
    /// Set on SIGINT/SIGTERM: stop after the current stage.
    pub interrupted: Arc<AtomicBool>,
    /// Run vipr with `--proxy-mode=auto` and `bpf()` denied (`sandbox`); `mode` is then the
    /// mode it must fall back to, whose outcomes are checked.
    pub deny_bpf: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    Pass,
    Fail,
    Skip,
}

/// The result of one flow: one output line.
#[derive(Clone, Debug)]
pub struct FlowResult {
    pub file: String,
    pub case: String,
    pub stage: String,
    pub flow: u32,
    pub name: String,
    /// The verdict checked (the nftables one for a known difference, marked so).
    pub verdict: String,
    pub status: Status,
    pub reason: String,
}

impl fmt::Display for FlowResult {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let status = match self.status {
            Status::Pass => "PASS",
            Status::Fail => "FAIL",
            Status::Skip => "SKIP",
        };
        write!(
            f,
            "{} {:?} {:?} {}:{:?} {} {status} {}",
            self.file, self.case, self.stage, self.flow, self.name, self.verdict, self.reason
        )
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Summary {
    pub passed: usize,
    pub failed: usize,
    pub skipped: usize,
}

impl Summary {
    fn add(&mut self, result: &FlowResult) {
        match result.status {
            Status::Pass => self.passed += 1,
            Status::Fail => self.failed += 1,
            Status::Skip => self.skipped += 1,
        }
    }
}

impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} passed, {} failed, {} skipped", self.passed, self.failed, self.skipped)
    }
}

/// One flow to check, with what it must come to.
struct Job<'a> {
    stage: usize,
    flow: &'a Flow,
    expect: Outcome,
    /// Where the mode's outcome is not the recorded one (differences::expectation_in).
    known: Option<Difference>,
    skip: Option<String>,
}

impl Job<'_> {
    /// Where the outcome checked is not the recorded one: whose outcome it is (nftables,
    /// iptables, ipvs), what the file records, and why.
    fn difference(&self) -> Option<(&'static str, Verdict, &'static str)> {
        self.known.map(|known| (known.whose, known.recorded, known.why))
    }
}

/// Runs every case of `paths`, printing one line per flow as results come; returns the
/// counts. Cases run one after the other, each on a fresh lab.
pub fn run(paths: &[PathBuf], options: &Options) -> Result<Summary> {
    crate::require_root()?;
    if options.deny_bpf {
        deny_bpf_to_this_runner(options.mode)?;
    }
    if super::ipvs::needs_guest(options.mode) {
        return super::ipvs::run_in_guest(paths, options);
    }
    let mut summary = Summary::default();
    let mut report = |result: FlowResult| {
        summary.add(&result);
        // A closed stdout (`| head`) must not abort the run half-way: lines are best effort.
        let mut stdout = std::io::stdout().lock();
        let _ = writeln!(stdout, "{result}").and_then(|()| stdout.flush());
    };
    for path in case_files(paths)? {
        let file = CaseFile::load(&path)?;
        let file_name =
            path.file_name().map_or_else(|| path.display().to_string(), |n| n.to_string_lossy().into());
        for (index, case) in file.cases.iter().enumerate() {
            if options.interrupted.load(Ordering::Relaxed) {
                return Ok(summary);
            }
            run_case(&file_name, &file, index, case, options, &mut report)
                .with_context(|| format!("{file_name} case {:?}", case.case_name))?;
        }
    }
    Ok(summary)
}

fn machine_skip(mode: Mode, flow: &Flow) -> Option<String> {
    if mode == Mode::Ipvs && !super::ipvs::host_has_ipvs() {
        return Some(
            "this kernel has no IPVS (CONFIG_IP_VS is not set), and no User-Mode Linux kernel is installed \
             to run the cases in (`cargo xtask setup` installs one)"
                .to_owned(),
        );
    }
    if flow.protocol == Protocol::SCTP {
        return crate::sctp::unavailable();
    }
    None
}

fn run_case(
    file_name: &str,
    file: &CaseFile,
    case_index: usize,
    case: &Case,
    options: &Options,
    report: &mut impl FnMut(FlowResult),
) -> Result<()> {
    let mut jobs = Vec::new();
    for (stage_index, stage) in case.stages.iter().enumerate() {
        for flow in &stage.flows {
            let line = format!("{file_name} {} {} {}", case.case_name, stage.label, flow.name);
            if options.filter.as_ref().is_some_and(|filter| !line.contains(filter.as_str())) {
                continue;
            }
            let expected = expectation_in(options.mode, file, case, stage, flow)?;
            let skip = machine_skip(options.mode, flow).or_else(|| expected.skip.map(str::to_owned));
            jobs.push(Job {
                stage: stage_index,
                flow,
                expect: expected.outcome,
                known: expected.difference,
                skip,
            });
        }
    }
    if jobs.is_empty() {
        return Ok(());
    }
    let result = |job: &Job, status, reason: String| {
        let verdict = match job.difference() {
            Some((whose, recorded, _)) => format!("{}({whose};file:{recorded})", job.expect.verdict),
            None => job.expect.verdict.to_string(),
        };
        FlowResult {
            file: file_name.to_owned(),
            case: case.case_name.clone(),
            stage: case.stages[job.stage].label.clone(),
            flow: job.flow.id,
            name: job.flow.name.clone(),
            verdict,
            status,
            reason,
        }
    };
    let skip_reason = |job: &Job| {
        let skip = job.skip.clone().unwrap_or_default();
        match job.difference() {
            Some((_, _, why)) => format!("{skip} [{why}]"),
            None => skip,
        }
    };
    if jobs.iter().all(|job| job.skip.is_some()) {
        for job in &jobs {
            report(result(job, Status::Skip, skip_reason(job)));
        }
        return Ok(());
    }

    let prepared = prepare(case, &jobs);
    let (mut lab, drop_controls) = match prepared {
        Ok(prepared) => prepared,
        Err(error) => {
            for job in &jobs {
                match &job.skip {
                    Some(_) => report(result(job, Status::Skip, skip_reason(job))),
                    None => report(result(job, Status::Fail, format!("testbed: {error:#}"))),
                }
            }
            return Ok(());
        }
    };

    let mut synced = 0;
    let mut vipr_failure: Option<String> = None;
    for (stage_index, stage) in case.stages.iter().enumerate() {
        let stage_jobs: Vec<(usize, &Job)> =
            jobs.iter().enumerate().filter(|(_, job)| job.stage == stage_index).collect();
        if stage_jobs.is_empty() && vipr_failure.is_some() {
            continue;
        }
        if options.interrupted.load(Ordering::Relaxed) {
            break;
        }
        if vipr_failure.is_none() {
            match apply_stage(&mut lab, case, stage_index, stage, options, synced) {
                Ok(count) => synced = count,
                Err(error) => vipr_failure = Some(format!("{error:#}")),
            }
        }
        let outcomes: Vec<(Status, String)> = match &vipr_failure {
            Some(failure) => stage_jobs
                .iter()
                .map(|(_, job)| match &job.skip {
                    Some(_) => (Status::Skip, skip_reason(job)),
                    None => (Status::Fail, failure.clone()),
                })
                .collect(),
            None => check_stage(&lab, case, stage, &stage_jobs, &drop_controls, &skip_reason),
        };
        for ((_, job), (status, reason)) in stage_jobs.iter().zip(outcomes) {
            report(result(job, status, reason));
        }
    }
    if let Some(dir) = &options.logs {
        let stem = file_name.trim_end_matches(".json");
        let target = dir.join(format!("{stem}.{case_index}.log"));
        if let Err(error) = std::fs::create_dir_all(dir).and_then(|()| std::fs::copy(lab.log_path(), &target))
        {
            eprintln!("vipr-conformance: cannot copy the vipr log to {}: {error}", target.display());
        }
    }
    Ok(())
}

/// Builds the lab of a case, starts its servers, runs the self-test and the drop controls.
/// Returns the lab and, per job, why its DROP cannot be observed (if so).
fn prepare(case: &Case, jobs: &[Job]) -> Result<(CaseLab, Vec<Option<String>>)> {
    let node = &case.node;
    let plan = plan(node, case)?;
    let mut lab = CaseLab::build(node, &plan)?;
    let used_ports: BTreeSet<u16> = case
        .stages
        .iter()
        .flat_map(|stage| {
            stage.flows.iter().map(|flow| flow.dest_port).chain(
                stage
                    .endpoint_slices
                    .iter()
                    .flat_map(|slice| slice.ports.iter().filter_map(|p| u16::try_from(p.port).ok())),
            )
        })
        .collect();
    let control_port =
        CONTROL_PORTS.clone().find(|port| !used_ports.contains(port)).context("no free control port")?;

    // Endpoints answer with their address and port, on every port their slices list (SCTP
    // ones only where SCTP flows are checked: its servers need raw sockets).
    let serve_sctp = crate::sctp::unavailable().is_none();
    for stage in &case.stages {
        for slice in &stage.endpoint_slices {
            for endpoint in &slice.endpoints {
                for address in &endpoint.addresses {
                    let Ok(ip) = address.parse::<IpAddr>() else { continue };
                    let place = lab.owner(ip).with_context(|| format!("no namespace owns endpoint {ip}"))?;
                    for port in &slice.ports {
                        let (Ok(number), true) =
                            (u16::try_from(port.port), port.protocol != Protocol::SCTP || serve_sctp)
                        else {
                            continue;
                        };
                        let socket = SocketAddr::new(ip, number);
                        lab.listen(place, socket, port.protocol, &socket.to_string())?;
                    }
                }
            }
        }
    }
    // The control socket of the self-test.
    for family in [IpFamily::Ipv4, IpFamily::Ipv6] {
        if let Some(ip) = node.primary_ip(family).filter(|ip| IpFamily::of(*ip) == family) {
            lab.listen(Place::Node, SocketAddr::new(ip, control_port), Protocol::TCP, CONTROL_NAME)?;
        }
    }
    // Whoever owns a destination listens on it, so that a packet vipr leaves alone is seen
    // arriving there (and a DNAT that did not happen is told from a refusal). Destinations
    // nobody owns but that must pass are routed to the router, which listens.
    for job in jobs.iter().filter(|job| job.skip.is_none()) {
        let dest = job.flow.dest();
        let place = match lab.owner(dest.ip()) {
            Some(place) => place,
            None if matches!(job.expect.verdict, Verdict::PASS | Verdict::ACCEPT) => {
                lab.add_router_address(dest.ip())?
            }
            None => continue,
        };
        let role = match place {
            Place::Node => "node",
            Place::Leaf(_) => "leaf",
            Place::Router => "upstream",
        };
        lab.listen(place, dest, job.flow.protocol, &format!("{role}@{dest}"))?;
    }

    self_test(&lab, node, jobs, control_port).context("testbed self-test (before vipr started)")?;
    let controls = drop_controls(&lab, case, jobs);
    Ok((lab, controls))
}

/// Which namespaces to build: one per address that sends or serves and is not the node's.
pub fn plan(node: &Node, case: &Case) -> Result<LabPlan> {
    let pod_cidr = node.pod_cidr()?;
    let parse = |text: &String| text.trim().parse::<IpAddr>().ok();
    let endpoints: BTreeSet<IpAddr> = case
        .stages
        .iter()
        .flat_map(|stage| &stage.endpoint_slices)
        .flat_map(|slice| &slice.endpoints)
        .flat_map(|endpoint| endpoint.addresses.iter().filter_map(parse))
        .collect();
    let services = || case.stages.iter().flat_map(|stage| &stage.services);
    let load_balancer_ips: BTreeSet<IpAddr> = services()
        .flat_map(|service| service.load_balancer_ingress.iter().filter_map(|i| parse(&i.ip)))
        .collect();
    let flows = || case.stages.iter().flat_map(|stage| &stage.flows);
    let sources: BTreeSet<IpAddr> = flows().map(|flow| flow.source_ip).collect();
    let mut leaves = Vec::new();
    for &addr in endpoints.union(&sources) {
        if node.is_local(addr) || addr.is_loopback() {
            continue;
        }
        let side =
            if endpoints.contains(&addr) || pod_cidr.contains(&addr) || load_balancer_ips.contains(&addr) {
                Side::Node
            } else {
                Side::Router
            };
        let self_addressed = flows().any(|flow| flow.source_ip == addr && flow.dest_ip == addr);
        leaves.push(LeafPlan { addr, side, self_addressed });
    }
    let mut case_addresses: BTreeSet<IpAddr> = endpoints.union(&sources).copied().collect();
    case_addresses.extend(flows().map(|flow| flow.dest_ip));
    case_addresses.extend(node.node_local_addresses.iter().copied());
    case_addresses.extend(load_balancer_ips);
    for service in services() {
        case_addresses.extend(service.cluster_ips.iter().chain(&service.external_ips).filter_map(parse));
    }
    Ok(LabPlan { leaves, case_addresses })
}

/// Before vipr: every leaf that sends reaches the node's control socket with its own
/// address, and the node reaches every endpoint socket.
fn self_test(lab: &CaseLab, node: &Node, jobs: &[Job], control_port: u16) -> Result<()> {
    let sources: BTreeSet<IpAddr> =
        jobs.iter().filter(|job| job.skip.is_none()).map(|job| job.flow.source_ip).collect();
    for source in sources {
        let place = lab.owner(source).with_context(|| format!("no namespace owns source {source}"))?;
        let Some(control) =
            node.primary_ip(IpFamily::of(source)).filter(|ip| IpFamily::of(*ip) == IpFamily::of(source))
        else {
            bail!("the node has no address of {source}'s family");
        };
        let control = SocketAddr::new(control, control_port);
        let attempt = lab
            .netns(place)
            .run(|| Ok(probe::attempt(Protocol::TCP, source, control, probe::ANSWER_TIMEOUT)))?;
        match attempt {
            Attempt::Answered { answer, client, .. }
                if answer.backend == CONTROL_NAME && answer.observed_client == client => {}
            other => bail!("{source} -> node control socket {control}: {other:?}"),
        }
    }
    Ok(())
}

fn drop_controls(lab: &CaseLab, case: &Case, jobs: &[Job]) -> Vec<Option<String>> {
    std::thread::scope(|scope| {
        let handles: Vec<_> = jobs
            .iter()
            .map(|job| {
                (job.skip.is_none() && job.expect.verdict == Verdict::DROP).then(|| {
                    let check = flow_check(lab, case, &case.stages[job.stage], job);
                    scope.spawn(move || {
                        let place = lab.owner(check.source)?;
                        lab.netns(place).run(|| Ok(probe::drop_control(&check).err())).ok().flatten()
                    })
                })
            })
            .collect();
        handles.into_iter().map(|handle| handle.and_then(|handle| handle.join().ok().flatten())).collect()
    })
}

fn flow_check(lab: &CaseLab, _case: &Case, stage: &Stage, job: &Job) -> FlowCheck {
    let flow = job.flow;
    let affinity = flow.derived.target_service.as_ref().is_some_and(|target| {
        stage.services.iter().any(|service| {
            format!("{}/{}", service.namespace, service.name) == *target
                && service.session_affinity.as_ref().is_some_and(|affinity| affinity.type_ == "ClientIP")
        })
    });
    FlowCheck {
        protocol: flow.protocol,
        source: flow.source_ip,
        dest: flow.dest(),
        expect: job.expect.clone(),
        affinity,
        node_addresses: lab.node_addresses().clone(),
        listener_at_dest: lab.listener(flow.dest(), flow.protocol).map(str::to_owned),
    }
}

/// Writes the stage's services file and waits for vipr (started with the first stage) to
/// have synced it; returns how many syncs vipr has logged.
fn apply_stage(
    lab: &mut CaseLab,
    case: &Case,
    stage_index: usize,
    stage: &Stage,
    options: &Options,
    synced_before: usize,
) -> Result<usize> {
    write_atomically(&lab.services_file(), &objects::manifests(stage)?)?;
    if stage_index == 0 {
        let mut args =
            vipr_args(&case.node, options.mode, &lab.services_file(), lab.bpf_root(), lab.devices());
        if options.deny_bpf {
            for arg in args.iter_mut().filter(|arg| arg.starts_with("--proxy-mode=")) {
                *arg = "--proxy-mode=auto".to_owned();
            }
        }
        lab.start_vipr(&options.vipr, &args)?;
    }
    let log = lab.log_path();
    let vipr = lab.vipr().context("vipr is not running")?;
    let synced = wait_for(
        "vipr to sync the services file (a \"synced:\" log line of a sync that changed something)",
        SYNC_TIMEOUT,
        || {
            if let Err(error) = vipr.ensure_running() {
                bail!("vipr exited: {}", exit_reason(&log).unwrap_or_else(|| format!("{error:#}")));
            }
            let count = synced_lines(&log, stage_index > 0);
            Ok(if count > synced_before {
                Check::Done(count)
            } else {
                Check::NotYet(format!("{count} syncs logged"))
            })
        },
    )?;
    if options.deny_bpf && stage_index == 0 {
        ensure_auto_chose(&log, options.mode)?;
    }
    Ok(synced)
}

/// `--deny-bpf`: vipr, started from this thread, inherits a seccomp filter that denies
/// `bpf()`. The runner itself needs no `bpf()` in the modes that can be checked so.
fn deny_bpf_to_this_runner(mode: Mode) -> Result<()> {
    if mode == Mode::Ebpf {
        bail!(
            "--deny-bpf with --mode=ebpf: without bpf() vipr cannot run ebpf; give the mode it must fall \
             back to (iptables here, ipvs on a kernel with IPVS)"
        );
    }
    if super::ipvs::needs_guest(mode) {
        bail!("--deny-bpf is not carried into the User-Mode Linux guest that ipvs mode needs on this kernel");
    }
    crate::sandbox::deny_bpf_to_this_thread().context("cannot install the seccomp filter that denies bpf()")
}

/// Fails unless vipr's log says auto mode chose `mode` (quoting what it chose instead).
fn ensure_auto_chose(log: &Path, mode: Mode) -> Result<()> {
    let text = std::fs::read_to_string(log).with_context(|| format!("cannot read {}", log.display()))?;
    let choice = text.lines().find(|line| line.contains("proxy mode auto:"));
    match choice {
        Some(line) if line.contains(&format!("proxy mode auto: chose {}", mode.name())) => Ok(()),
        Some(line) => {
            bail!("vipr in auto mode without bpf() did not choose {}: {}", mode.name(), line.trim())
        }
        None => bail!("vipr logged no auto-mode choice (is it a vipr with --proxy-mode=auto probing?)"),
    }
}

/// How many syncs vipr has logged; with `changed_only`, only those that changed the
/// dataplane. After the first stage a sync that changed nothing ("synced: nothing to change",
/// logged at debug level) must not count: a periodic one that ran before vipr read the
/// stage's file would let the flows be checked against the previous stage's rules. vipr's
/// first sync counts whatever it changed: the file was there before vipr started (and in ipvs
/// mode, services without endpoints are only ipset members, which its report does not count).
fn synced_lines(log: &Path, changed_only: bool) -> usize {
    std::fs::read_to_string(log).map_or(0, |text| {
        text.lines()
            .filter(|line| line.contains("synced:"))
            .filter(|line| !changed_only || !line.contains("nothing to change"))
            .count()
    })
}

/// The last error line of vipr's log, else its last line.
fn exit_reason(log: &Path) -> Option<String> {
    let text = std::fs::read_to_string(log).ok()?;
    let lines: Vec<&str> = text.lines().map(str::trim).filter(|line| !line.is_empty()).collect();
    let error = lines.iter().rev().find(|line| line.to_lowercase().contains("error"));
    error.or(lines.last()).map(|line| (*line).to_owned())
}

fn check_stage(
    lab: &CaseLab,
    case: &Case,
    stage: &Stage,
    stage_jobs: &[(usize, &Job)],
    drop_controls: &[Option<String>],
    skip_reason: &(dyn Fn(&Job) -> String + Sync),
) -> Vec<(Status, String)> {
    std::thread::scope(|scope| {
        let handles: Vec<_> = stage_jobs
            .iter()
            .map(|&(index, job)| {
                let check = flow_check(lab, case, stage, job);
                let control = drop_controls.get(index).cloned().flatten();
                scope.spawn(move || -> (Status, String) {
                    if job.skip.is_some() {
                        return (Status::Skip, skip_reason(job));
                    }
                    let Some(place) = lab.owner(check.source) else {
                        return (Status::Fail, format!("testbed: no namespace owns {}", check.source));
                    };
                    let outcome = lab.netns(place).run(|| Ok(probe::check(&check)));
                    let mut reported = match outcome {
                        Ok(Ok(detail)) => match control {
                            Some(control) => (Status::Fail, control),
                            None => (Status::Pass, detail),
                        },
                        Ok(Err(reason)) => (Status::Fail, reason),
                        Err(error) => (Status::Fail, format!("testbed: {error:#}")),
                    };
                    if let Some((_, _, why)) = job.difference() {
                        reported.1 = format!("{} [{why}]", reported.1);
                    }
                    reported
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|handle| handle.join().unwrap_or_else(|_| (Status::Fail, "the check panicked".to_owned())))
            .collect()
    })
}
