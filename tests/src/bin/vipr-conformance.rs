//! vipr-conformance: kube-proxy's packet-flow cases, checked on the wire against vipr.
//!
//! For each case: a node namespace with the recorded addresses running vipr with the case's
//! node configuration, namespaces for its pods, endpoints and external clients, the recorded
//! Services and EndpointSlices as vipr's services file, stage after stage; every flow is
//! tried for real. Prints one line per flow and a last line `N passed, N failed, N skipped`;
//! exits 1 if any flow failed. Needs root. `cargo xtask conformance` builds and runs it; see
//! docs/conformance.md.

use std::{
    io::Write as _,
    path::PathBuf,
    process::ExitCode,
    sync::{atomic::AtomicBool, Arc},
};

use anyhow::Result;
use clap::Parser;
use testbed::{
    conformance::{
        flags::Mode,
        run::{run, Options},
    },
    locate_vipr,
};

#[derive(Parser)]
#[command(about = "Check vipr against kube-proxy's packet-flow conformance cases, on this kernel")]
struct Args {
    /// The dataplane to test (vipr's --proxy-mode)
    #[arg(long, value_enum)]
    mode: Mode,
    /// The vipr binary [default: $VIPR_BIN, else `vipr` next to this program]
    #[arg(long)]
    vipr: Option<PathBuf>,
    /// Run only the flows whose "file case stage flow-name" contains this text
    #[arg(long)]
    filter: Option<String>,
    /// Copy each case's vipr log into this directory (as <file>.<case index>.log)
    #[arg(long, value_name = "DIR")]
    logs: Option<PathBuf>,
    /// Run vipr with --proxy-mode=auto and bpf() denied (a seccomp filter), as on a node without
    /// BPF; --mode is then the mode it must fall back to and whose outcomes are checked
    #[arg(long)]
    deny_bpf: bool,
    /// Case files, or directories of them (*.json)
    #[arg(required = true, value_name = "DIR_OR_FILE")]
    paths: Vec<PathBuf>,
}

fn main() -> ExitCode {
    match main_result() {
        Ok(code) => code,
        Err(error) => {
            eprintln!("vipr-conformance: {error:#}");
            ExitCode::from(2)
        }
    }
}

fn main_result() -> Result<ExitCode> {
    let args = Args::parse();
    let interrupted = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM, signal_hook::consts::SIGHUP] {
        // A second signal ends the process at once (the next run removes what it left).
        signal_hook::flag::register_conditional_shutdown(signal, 130, interrupted.clone())?;
        signal_hook::flag::register(signal, interrupted.clone())?;
    }
    let vipr = match args.vipr {
        Some(vipr) => vipr,
        None => locate_vipr()?,
    };
    let options = Options {
        mode: args.mode,
        vipr,
        filter: args.filter,
        logs: args.logs,
        interrupted: interrupted.clone(),
        deny_bpf: args.deny_bpf,
    };
    let summary = run(&args.paths, &options)?;
    // Best effort, as every line: the exit code carries the result.
    let _ = writeln!(std::io::stdout(), "{summary}");
    if interrupted.load(std::sync::atomic::Ordering::Relaxed) {
        eprintln!("vipr-conformance: interrupted; the remaining cases did not run");
        return Ok(ExitCode::from(130));
    }
    Ok(if summary.failed > 0 { ExitCode::FAILURE } else { ExitCode::SUCCESS })
}
