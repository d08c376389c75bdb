//! `vipr-bench`: vipr's benchmark suites (`cargo xtask bench`, issue 6; docs/benchmarks.md): the datapath's cost per packet with
//! BPF_PROG_TEST_RUN, the control plane's programming time and memory, and end-to-end traffic
//! through the real agent by proxy mode (`e2e`). Results go to
//! `<out-dir>/<suite>.json`, plots to `<out-dir>/*.png`, and the report (docs/benchmarks.md)
//! is rewritten from all results there.

mod cluster;
mod control_plane;
mod datapath;
mod dsr;
mod e2e;
mod frame;
mod load;
mod meta;
mod nftables;
mod plot;
mod report;
mod stats;
mod sys;
mod watch_path;

use std::{path::PathBuf, process::ExitCode};

use anyhow::{bail, Context as _, Result};
use clap::{Args, Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "vipr-bench",
    about = "vipr's benchmark suites; results to <out-dir>/<suite>.json and a report (needs root)"
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Cost per packet of vipr_tc_ingress by path (BPF_PROG_TEST_RUN).
    Datapath(RunArgs),
    /// Desired state to datapath: sync time from scratch and per endpoint change, agent memory.
    ControlPlane(RunArgs),
    /// Traffic through the vipr binary between namespaces: connections/s, latency and UDP
    /// rates by proxy mode (ebpf, iptables-nft, iptables-legacy) and number of services.
    E2e(RunArgs),
    /// The nftables dataplane at scale (issue 17): programming from empty, one endpoint
    /// change, a full resync, new connections/s at many services against one.
    Nftables(RunArgs),
    /// All suites.
    All(RunArgs),
    /// Redraw the plots and rewrite the report from the results in --out-dir, measuring nothing.
    Report(Output),
    /// The control plane through the real watch path: the in-suite API server streams
    /// EndpointSlice changes to the release `vipr` binary (prints its report as JSON).
    ControlPlaneWatch {
        #[arg(long, default_value_t = 10_000)]
        services: usize,
        #[arg(long, default_value_t = 100)]
        rate: u32,
        #[arg(long, default_value_t = 60)]
        seconds: u64,
        /// The agent's --min-sync-period [default: the agent's own default in ebpf mode].
        #[arg(long)]
        min_sync_period: Option<String>,
    },
    /// Direct server return against SNAT in the multi-node lab (issue 16): a NodePort through
    /// one node to pods on the others, `--lb-mode=snat` and `dsr` in alternating rounds
    /// (prints a table for docs/benchmarks.md and the results as JSON).
    Dsr {
        #[arg(long, default_value_t = 10)]
        seconds: u64,
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        /// The client's traffic: IPv4, or IPv6 through the dual-stack lab.
        #[arg(long, value_enum, default_value_t = dsr::Family::Ipv4)]
        family: dsr::Family,
    },
    /// One repetition of one control-plane size (run by `control-plane`, one process each).
    #[command(hide = true)]
    ControlPlaneChild {
        #[arg(long)]
        services: usize,
        #[arg(long)]
        endpoints: usize,
        #[arg(long)]
        changes: usize,
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
}

#[derive(Args)]
struct RunArgs {
    /// A short smoke run (few cells, few repetitions): checks that the suites work, nothing more.
    #[arg(long)]
    quick: bool,
    #[command(flatten)]
    output: Output,
    /// The command to record in the report (default: this process's command line).
    #[arg(long)]
    invoked_as: Option<String>,
    /// e2e: only these modes (ebpf, ebpf-xdp, iptables-nft, iptables-legacy), comma-separated.
    #[arg(long, value_delimiter = ',')]
    modes: Vec<String>,
    /// e2e: only these numbers of services, comma-separated.
    #[arg(long, value_delimiter = ',')]
    services: Vec<usize>,
    /// datapath: another build's eBPF object (same maps) measured beside this build's, path by
    /// path in the same rounds (e.g. the `proxy-ebpf` object of the commit before a change).
    #[arg(long)]
    baseline_object: Option<PathBuf>,
}

#[derive(Args)]
struct Output {
    /// Where the results (JSON) and plots (PNG) go.
    #[arg(long)]
    out_dir: PathBuf,
    /// The report to rewrite [default: <out-dir>/benchmarks.md].
    #[arg(long)]
    doc: Option<PathBuf>,
}

impl Output {
    fn doc(&self) -> PathBuf {
        self.doc.clone().unwrap_or_else(|| self.out_dir.join("benchmarks.md"))
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli.command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("vipr-bench: {error:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(command: Cmd) -> Result<()> {
    let (suites, args) = match command {
        Cmd::Report(output) => return report::write(&output.out_dir, &output.doc()),
        Cmd::ControlPlaneWatch { services, rate, seconds, min_sync_period } => {
            prepare()?;
            let result = watch_path::run(&watch_path::Settings { services, rate, seconds, min_sync_period })?;
            println!("{}", serde_json::to_string(&result)?);
            return Ok(());
        }
        Cmd::Dsr { seconds, rounds, family } => {
            prepare()?;
            let results = dsr::run(&dsr::Settings { seconds, rounds, family })?;
            println!("{}", dsr::table(&results));
            println!("{}", serde_json::to_string(&results)?);
            return Ok(());
        }
        Cmd::ControlPlaneChild { services, endpoints, changes, seed } => {
            prepare()?;
            let result = control_plane::child(services, endpoints, changes, seed)?;
            println!("{}", serde_json::to_string(&result)?);
            return Ok(());
        }
        Cmd::Nftables(args) => {
            prepare()?;
            let command =
                args.invoked_as.clone().unwrap_or_else(|| std::env::args().collect::<Vec<_>>().join(" "));
            return run_nftables(command, &args);
        }
        Cmd::Datapath(args) => ((true, false, false), args),
        Cmd::ControlPlane(args) => ((false, true, false), args),
        Cmd::E2e(args) => ((false, false, true), args),
        Cmd::All(args) => ((true, true, true), args),
    };
    prepare()?;
    let command = args.invoked_as.clone().unwrap_or_else(|| std::env::args().collect::<Vec<_>>().join(" "));
    let dir = &args.output.out_dir;
    if suites.0 {
        let mut settings = if args.quick { datapath::Settings::quick() } else { datapath::Settings::full() };
        settings.baseline_object = args.baseline_object.clone();
        let results = datapath::run(meta::RunMeta::start(command.clone(), args.quick), settings)?;
        report::save(dir, report::DATAPATH_JSON, &results)?;
    }
    if suites.1 {
        let settings =
            if args.quick { control_plane::Settings::quick() } else { control_plane::Settings::full() };
        let results = control_plane::run(meta::RunMeta::start(command.clone(), args.quick), settings)?;
        report::save(dir, report::CONTROL_PLANE_JSON, &results)?;
    }
    if suites.2 {
        let mut settings = if args.quick { e2e::Settings::quick() } else { e2e::Settings::full() };
        if !args.modes.is_empty() {
            settings.modes = args.modes.iter().map(|name| e2e::Mode::parse(name)).collect::<Result<_>>()?;
        }
        if !args.services.is_empty() {
            settings.services_axis = args.services.clone();
        }
        let meta = meta::RunMeta::start(command, args.quick).with_iptables(e2e::iptables_versions());
        let results = e2e::run(meta, settings)?;
        report::save(dir, report::E2E_JSON, &results)?;
    }
    if suites == (true, true, true) {
        let command =
            args.invoked_as.clone().unwrap_or_else(|| std::env::args().collect::<Vec<_>>().join(" "));
        run_nftables(command, &args)?;
    }
    report::write(dir, &args.output.doc())
}

/// The nftables suite: its figures printed and saved (its section of the report is in the
/// notes, written by hand).
fn run_nftables(command: String, args: &RunArgs) -> Result<()> {
    let settings = if args.quick { nftables::Settings::quick() } else { nftables::Settings::full() };
    let results = nftables::run(meta::RunMeta::start(command, args.quick), settings)?;
    report::save(&args.output.out_dir, report::NFTABLES_JSON, &results)
}

/// Root, then a namespace of our own. Runs while the process has a single thread.
fn prepare() -> Result<()> {
    // SAFETY: no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("the benchmarks load BPF programs and create namespaces: run them as root");
    }
    sys::isolate().context("isolating the benchmark")
}
