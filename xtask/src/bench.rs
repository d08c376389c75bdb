//! `cargo xtask bench <datapath|control-plane|e2e|nftables|all|report> [--quick]`: builds `vipr-bench` (release,
//! so the agent code it times is what ships; for `e2e` the `vipr` binary too) and runs the
//! suites. A full run writes
//! `docs/bench/<suite>.json`, the plots in `docs/bench/` and rewrites `docs/benchmarks.md`; a
//! quick one (a smoke test of the suites) writes to `target/bench-quick/` instead.

use std::{ffi::OsString, path::PathBuf, process::Command, process::ExitCode};

use anyhow::Result;

use crate::{cmd, exit_code_of, setup, Workspace};

#[derive(clap::Args)]
pub struct BenchArgs {
    /// Which suites to run.
    #[arg(value_enum)]
    suite: Suite,
    /// A short smoke run: few cells and repetitions, results to target/bench-quick/.
    #[arg(long)]
    quick: bool,
    /// Where the results (JSON) and plots go [default: docs/bench, or target/bench-quick].
    #[arg(long)]
    out_dir: Option<PathBuf>,
    /// The report to rewrite [default: docs/benchmarks.md, or <out-dir>/benchmarks.md].
    #[arg(long)]
    doc: Option<PathBuf>,
    /// e2e only: these modes (ebpf, ebpf-xdp, iptables-nft, iptables-legacy), comma-separated.
    /// A selection replaces the suite's results in --out-dir: give another --out-dir to keep them.
    #[arg(long)]
    modes: Option<String>,
    /// e2e only: these numbers of services, comma-separated (e.g. 1,1000).
    #[arg(long)]
    services: Option<String>,
    /// datapath only: another build's eBPF object (the same maps), measured beside this build's
    /// in the same rounds; the report gives each path's ratio (see docs/benchmarks.md, Method).
    #[arg(long)]
    baseline_object: Option<PathBuf>,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug)]
enum Suite {
    /// Cost per packet of the TC program by path (BPF_PROG_TEST_RUN).
    Datapath,
    /// Programming time from a desired state, per endpoint change, and agent memory; then
    /// EndpointSlice changes streamed through the real agent's watch path.
    ControlPlane,
    /// Traffic through the vipr binary between namespaces, by proxy mode and services.
    E2e,
    /// The nftables dataplane at scale against issue 17's targets.
    Nftables,
    /// All of them.
    All,
    /// Measures nothing: redraws the plots and rewrites the report from the results already in
    /// --out-dir.
    Report,
}

impl Suite {
    fn name(self) -> &'static str {
        match self {
            Self::Datapath => "datapath",
            Self::ControlPlane => "control-plane",
            Self::E2e => "e2e",
            Self::Nftables => "nftables",
            Self::All => "all",
            Self::Report => "report",
        }
    }
}

pub fn run(workspace: &Workspace, args: &BenchArgs) -> Result<ExitCode> {
    setup::all(setup::Mode::Install)?;
    let mut build = vec!["build", "--release", "-p", "vipr-bench"];
    if matches!(args.suite, Suite::E2e | Suite::ControlPlane | Suite::All) {
        // The agent the e2e suite and the control plane's watch path run: found next to
        // vipr-bench (target/release/vipr).
        // `--bin` applies to every package of the command: name vipr-bench too, or it is not
        // rebuilt and the suites measure a stale build.
        build.extend(["-p", "proxy-userspace", "--bin", "vipr", "--bin", "vipr-bench"]);
    }
    cmd::run(workspace.cargo().args(build))?;
    let (out_dir, doc) = match (args.quick, &args.out_dir) {
        (_, Some(dir)) => (dir.clone(), args.doc.clone().unwrap_or_else(|| dir.join("benchmarks.md"))),
        (true, None) => {
            let dir = workspace.target_dir().join("bench-quick");
            (dir.clone(), args.doc.clone().unwrap_or_else(|| dir.join("benchmarks.md")))
        }
        (false, None) => (
            workspace.root.join("docs").join("bench"),
            args.doc.clone().unwrap_or_else(|| workspace.root.join("docs").join("benchmarks.md")),
        ),
    };
    // The command as the user typed it, for the report.
    let invoked_as = std::iter::once("cargo xtask".to_owned())
        .chain(std::env::args().skip(1))
        .collect::<Vec<_>>()
        .join(" ");
    let mut bench = Command::new(workspace.target_dir().join("release").join("vipr-bench"));
    bench
        .current_dir(&workspace.root)
        .arg(args.suite.name())
        .arg("--out-dir")
        .arg(&out_dir)
        .arg("--doc")
        .arg(&doc);
    if matches!(args.suite, Suite::Report) {
        return Ok(exit_code_of(cmd::status(&mut bench)?));
    }
    bench.arg("--invoked-as").arg(OsString::from(invoked_as));
    if args.quick {
        bench.arg("--quick");
    }
    if let Some(modes) = &args.modes {
        bench.arg("--modes").arg(modes);
    }
    if let Some(services) = &args.services {
        bench.arg("--services").arg(services);
    }
    if let Some(object) = &args.baseline_object {
        bench.arg("--baseline-object").arg(object);
    }
    Ok(exit_code_of(cmd::status(&mut bench)?))
}
