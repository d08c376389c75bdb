//! vipr's developer and CI tasks: `cargo xtask <task>` (see `cargo xtask --help`).
mod bench;
mod cmd;
mod image;
#[cfg(test)]
mod layers;
mod previous;
// The guard test that setup installs every program the code starts.
#[cfg(test)]
mod programs;
mod setup;
mod steps;
mod uml;
mod uml_kernel;

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use anyhow::{Context as _, Result};
use clap::{Parser, Subcommand};

use steps::{OnFailure, Step};

#[derive(Parser)]
#[command(about = "vipr's developer and CI tasks", bin_name = "cargo xtask")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Install what this machine lacks to build, test and demo vipr (idempotent; needs root).
    Setup,
    /// Build the workspace, including the eBPF object embedded in vipr.
    Build,
    /// Run clippy, denying warnings, on the host crates and on the eBPF crate.
    Lint,
    /// Build the previous version of vipr from git, for the upgrade test (cached under
    /// target/previous-vipr; `cargo xtask test` does this before the tests).
    PreviousVipr,
    /// Everything CI checks: setup, build, lint, the workspace tests, then the conformance cases
    /// in every mode (root: they load BPF and build network namespaces).
    Test,
    /// Build vipr and run the network-namespace demo; exits with the demo's exit code.
    Demo {
        /// Passed on to vipr-demo (e.g. `--pause`).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        demo_args: Vec<OsString>,
    },
    /// Build vipr and check it against kube-proxy's packet-flow cases on this kernel
    /// (`vipr-conformance`, see docs/conformance.md); exits with the runner's exit code.
    Conformance {
        /// The dataplane to test: ebpf, iptables or ipvs.
        #[arg(long, value_parser = ["ebpf", "iptables", "ipvs"])]
        mode: String,
        /// Case files or directories of them, e.g. tests/conformance/kube-proxy-flows.
        #[arg(required = true, value_name = "DIR_OR_FILE")]
        paths: Vec<PathBuf>,
        /// Passed on to vipr-conformance (e.g. `--filter TEXT`, `--logs DIR`).
        #[arg(last = true)]
        runner_args: Vec<OsString>,
    },
    /// Build vipr's container image (deploy/Containerfile) with podman, on a Debian base made by
    /// debootstrap (cached in /var/cache/vipr-image), and save it as an OCI archive.
    Image(image::ImageArgs),
    /// Run benchmark suites (needs root): `datapath`, `control-plane` or `all`. A full run
    /// rewrites docs/benchmarks.md and its plots in docs/bench/; `--quick` is a short smoke run
    /// into target/bench-quick/.
    Bench(bench::BenchArgs),
    /// Run a command as root inside a User-Mode Linux guest (a 6.1 kernel with IPVS, booted as
    /// a process, with this machine's / as its root); exits with the command's exit code.
    Uml {
        /// Guest memory in MiB.
        #[arg(long, default_value_t = 1024)]
        memory: u32,
        /// Kill the guest after this many seconds.
        #[arg(long, default_value_t = 600)]
        timeout: u64,
        /// The command and its arguments, e.g. `cargo xtask uml -- cat /proc/net/ip_vs`.
        #[arg(required = true, last = true)]
        command: Vec<OsString>,
    },
}

/// The steps of `cargo xtask test`, in order. A new suite is one more line here.
const TEST_STEPS: &[Step] = &[
    SETUP,
    BUILD,
    PREVIOUS_VIPR,
    HOST_CLIPPY,
    EBPF_CLIPPY,
    WORKSPACE_TESTS,
    CONFORMANCE_EBPF,
    CONFORMANCE_IPTABLES,
    CONFORMANCE_NFTABLES,
    CONFORMANCE_IPVS,
    CONFORMANCE_AUTO_WITHOUT_BPF,
];

const LINT_STEPS: &[Step] = &[HOST_CLIPPY, EBPF_CLIPPY];

const SETUP: Step =
    Step { name: "setup", run: |_| setup::all(setup::Mode::Install), on_failure: OnFailure::Stop };

/// Before the tests, because they spawn the `vipr` binary, which `cargo test` does not build
/// (it is another package's binary).
const BUILD: Step = Step { name: "build", run: build_workspace, on_failure: OnFailure::Stop };

/// The vipr the upgrade test upgrades from (tests/tests/agent_upgrade.rs); that test fails,
/// naming this step, when it is missing.
const PREVIOUS_VIPR: Step = Step {
    name: "build the previous vipr (upgrade test)",
    run: |workspace| previous::build(workspace).map(drop),
    on_failure: OnFailure::Continue,
};

const HOST_CLIPPY: Step = Step {
    name: "clippy: host crates",
    run: |workspace| {
        cmd::run(workspace.cargo().args(["clippy", "--workspace", "--all-targets", "--", "-D", "warnings"]))
    },
    on_failure: OnFailure::Continue,
};

/// On the host the eBPF crate is an empty stub, so its kernel code is only linted when built
/// for the BPF target, which takes nightly.
const EBPF_CLIPPY: Step = Step {
    name: "clippy: eBPF crate (nightly, bpfel-unknown-none)",
    run: |workspace| {
        cmd::run(
            Command::new("cargo")
                .current_dir(workspace.root.join("proxy-ebpf"))
                .arg(format!("+{}", setup::NIGHTLY))
                .args(["clippy", "--release", "--target", "bpfel-unknown-none"])
                .args(["-Z", "build-std=core", "--", "-D", "warnings"]),
        )
    },
    on_failure: OnFailure::Continue,
};

/// As root on the real kernel: the tests create network namespaces and load BPF programs.
const WORKSPACE_TESTS: Step = Step {
    name: "workspace tests",
    // Every test binary runs even after one fails, so one CI run reports every failure.
    run: |workspace| cmd::run_tests(workspace.cargo().args(["test", "--workspace", "--no-fail-fast"])),
    on_failure: OnFailure::Continue,
};

/// The case directories every conformance step runs (relative to the workspace root).
const CONFORMANCE_CASES: [&str; 2] = ["tests/conformance/kube-proxy-flows", "tests/conformance/vipr"];

/// A `cargo xtask test` step that runs the conformance runner in one `--proxy-mode` over
/// [`CONFORMANCE_CASES`] and fails on any failed flow. Another mode is one line:
/// `const CONFORMANCE_EBPF: Step = conformance_step!("ebpf", "conformance: ebpf");`.
macro_rules! conformance_step {
    ($mode:literal, $name:literal) => {
        Step {
            name: $name,
            run: |workspace| conformance_suite(workspace, $mode, &[]),
            on_failure: OnFailure::Continue,
        }
    };
}

/// vipr's own datapath on the host kernel (TC programs and the cgroup socket hooks).
const CONFORMANCE_EBPF: Step = conformance_step!("ebpf", "conformance: ebpf");
/// On the host kernel (iptables-nft here, whatever the system's iptables is elsewhere).
const CONFORMANCE_IPTABLES: Step = conformance_step!("iptables", "conformance: iptables");
/// vipr's nftables table on the host kernel.
const CONFORMANCE_NFTABLES: Step = conformance_step!("nftables", "conformance: nftables");
/// This kernel has no IPVS: the runner moves into User-Mode Linux guests (installed by setup).
const CONFORMANCE_IPVS: Step = conformance_step!("ipvs", "conformance: ipvs (UML guest)");
/// `--proxy-mode=auto` with `bpf()` denied by a seccomp filter, as on a kernel without the BPF
/// features: vipr must fall back (to nftables on this kernel: 5.13 or later, with `nft`) and
/// pass the cases with that mode's semantics.
const CONFORMANCE_AUTO_WITHOUT_BPF: Step = Step {
    name: "conformance: auto mode without BPF (falls back to nftables)",
    run: |workspace| conformance_suite(workspace, "nftables", &["--deny-bpf"]),
    on_failure: OnFailure::Continue,
};

/// The cargo workspace this xtask belongs to.
struct Workspace {
    root: PathBuf,
}

impl Workspace {
    fn locate() -> Result<Self> {
        let xtask_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
        let root =
            xtask_dir.parent().with_context(|| format!("{} has no parent directory", xtask_dir.display()))?;
        Ok(Self { root: root.to_path_buf() })
    }

    /// `cargo` run at the workspace root, whatever directory xtask was started from.
    fn cargo(&self) -> Command {
        let mut cargo = Command::new("cargo");
        cargo.current_dir(&self.root);
        cargo
    }

    fn target_dir(&self) -> PathBuf {
        match std::env::var_os("CARGO_TARGET_DIR") {
            Some(dir) if !dir.is_empty() => self.root.join(dir),
            _ => self.root.join("target"),
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli.task) {
        Ok(exit_code) => exit_code,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(task: Task) -> Result<ExitCode> {
    let workspace = Workspace::locate()?;
    match task {
        Task::Setup => setup::all(setup::Mode::Install)?,
        Task::Build => build(&workspace)?,
        Task::Lint => steps::run_all(&workspace, LINT_STEPS)?,
        Task::PreviousVipr => drop(previous::build(&workspace)?),
        Task::Test => steps::run_all(&workspace, TEST_STEPS)?,
        Task::Demo { demo_args } => return demo(&workspace, &demo_args),
        Task::Conformance { mode, paths, runner_args } => {
            return conformance(&workspace, &mode, &paths, &runner_args)
        }
        Task::Image(args) => image::run(&workspace, &args)?,
        Task::Bench(args) => return bench::run(&workspace, &args),
        Task::Uml { memory, timeout, command } => return run_in_uml(&workspace, memory, timeout, &command),
    }
    Ok(ExitCode::SUCCESS)
}

fn build(workspace: &Workspace) -> Result<()> {
    // Only checked, not installed: installing needs root and network, which a build should
    // not quietly reach for. A missing piece names `cargo xtask setup`.
    setup::toolchain(setup::Mode::CheckOnly)?;
    build_workspace(workspace)
}

fn build_workspace(workspace: &Workspace) -> Result<()> {
    cmd::run(workspace.cargo().args(["build", "--workspace"]))
}

fn demo(workspace: &Workspace, demo_args: &[OsString]) -> Result<ExitCode> {
    setup::all(setup::Mode::Install)?;
    cmd::run(workspace.cargo().args(["build", "-p", "proxy-userspace", "-p", "vipr-tests"]))?;
    let binaries = workspace.target_dir().join("debug");
    let status = cmd::status(
        Command::new(binaries.join("vipr-demo"))
            .current_dir(&workspace.root)
            .arg("--vipr")
            .arg(binaries.join("vipr"))
            .args(demo_args),
    )?;
    Ok(exit_code_of(status))
}

fn conformance(
    workspace: &Workspace,
    mode: &str,
    paths: &[PathBuf],
    runner_args: &[OsString],
) -> Result<ExitCode> {
    setup::all(setup::Mode::Install)?;
    cmd::run(workspace.cargo().args(["build", "-p", "proxy-userspace", "-p", "vipr-tests"]))?;
    let binaries = workspace.target_dir().join("debug");
    // Paths are taken as given from the caller's directory, as a shell user expects.
    let status = cmd::status(
        Command::new(binaries.join("vipr-conformance"))
            .arg(format!("--mode={mode}"))
            .arg("--vipr")
            .arg(binaries.join("vipr"))
            .args(runner_args)
            .args(paths),
    )?;
    Ok(exit_code_of(status))
}

/// One conformance step: the binaries of the build step, every case directory, the runner's
/// own output (a line per flow and the counts) in the log.
fn conformance_suite(workspace: &Workspace, mode: &str, runner_args: &[&str]) -> Result<()> {
    // Without IPVS here and without a guest kernel the runner would skip every flow, which
    // must not read as a pass in CI.
    if mode == "ipvs" && !Path::new("/proc/net/ip_vs").exists() && uml::kernel().is_none() {
        anyhow::bail!(
            "this kernel has no IPVS and no User-Mode Linux kernel is installed (`cargo xtask setup`)"
        );
    }
    let binaries = workspace.target_dir().join("debug");
    // Exit code 1: a flow failed (the lines above say which); 2: the runner could not run.
    cmd::run_checker(
        Command::new(binaries.join("vipr-conformance"))
            .current_dir(&workspace.root)
            .arg(format!("--mode={mode}"))
            .arg("--vipr")
            .arg(binaries.join("vipr"))
            .args(runner_args)
            .args(CONFORMANCE_CASES),
    )
}

fn run_in_uml(workspace: &Workspace, memory_mb: u32, timeout: u64, command: &[OsString]) -> Result<ExitCode> {
    setup::all(setup::Mode::Install)?;
    let options = uml::Options {
        memory_mb,
        timeout: std::time::Duration::from_secs(timeout),
        run_base: Some(workspace.target_dir().join("uml")),
        ..uml::Options::default()
    };
    let outcome = uml::run(command, &options)?;
    Ok(ExitCode::from(u8::try_from(outcome.code).unwrap_or(1)))
}

/// The exit code a shell would report for `status`, so callers see the demo's own result.
fn exit_code_of(status: std::process::ExitStatus) -> ExitCode {
    use std::os::unix::process::ExitStatusExt;
    let code = match (status.code(), status.signal()) {
        (Some(code), _) => code,
        (None, Some(signal)) => 128 + signal,
        (None, None) => 1,
    };
    ExitCode::from(u8::try_from(code).unwrap_or(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_codes_pass_through_as_a_shell_reports_them() {
        let exit_with = |script: &str| {
            let status = Command::new("sh").args(["-c", script]).status().unwrap();
            exit_code_of(status)
        };
        assert_eq!(exit_with("exit 0"), ExitCode::from(0));
        assert_eq!(exit_with("exit 7"), ExitCode::from(7));
        assert_eq!(exit_with("kill -TERM $$"), ExitCode::from(128 + 15));
    }
}
