//! The vipr agent as a child process.

use std::{
    fs::File,
    os::unix::process::CommandExt,
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus, Stdio},
    thread,
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};

use crate::{cmd, Netns};

/// Environment variable naming the vipr binary, overriding the search next to our own.
const VIPR_BIN: &str = "VIPR_BIN";
/// How long vipr gets to exit after SIGTERM before it is killed.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);
/// Lines of vipr's log shown when a test fails.
const LOG_TAIL_LINES: usize = 150;

/// The vipr binary: `$VIPR_BIN` if set, else `vipr` in the nearest directory above the
/// running executable (`target/debug/deps/e2e-… -> target/debug/vipr`,
/// `target/debug/vipr-demo -> target/debug/vipr`).
pub fn locate_vipr() -> Result<PathBuf> {
    if let Some(path) = std::env::var_os(VIPR_BIN) {
        let path = PathBuf::from(path);
        if !path.is_file() {
            bail!("{VIPR_BIN}={} is not a file", path.display());
        }
        return Ok(path);
    }
    let executable = std::env::current_exe().context("cannot find our own executable")?;
    executable
        .ancestors()
        .skip(1)
        .map(|dir| dir.join("vipr"))
        .find(|candidate| candidate.is_file())
        .with_context(|| {
            format!(
                "no vipr binary above {}: run `cargo build -p proxy-userspace` or set {VIPR_BIN}",
                executable.display()
            )
        })
}

/// The previous version of vipr, for the upgrade test: `$VIPR_PREVIOUS_BIN` if set, else
/// `previous-vipr/vipr` in the target directory of [`locate_vipr`]'s binary, which
/// `cargo xtask previous-vipr` (a step of `cargo xtask test`) builds from git.
pub fn locate_previous_vipr() -> Result<PathBuf> {
    if let Some(path) = std::env::var_os("VIPR_PREVIOUS_BIN") {
        return Ok(PathBuf::from(path));
    }
    let current = locate_vipr()?;
    let target = current
        .parent()
        .and_then(Path::parent)
        .with_context(|| format!("{} is not in a target directory", current.display()))?;
    let previous = target.join("previous-vipr").join("vipr");
    if !previous.is_file() {
        bail!(
            "no previous vipr at {}: build it with `cargo xtask previous-vipr` (`cargo xtask test` does), \
             or set VIPR_PREVIOUS_BIN",
            previous.display()
        );
    }
    Ok(previous)
}

/// How to run the agent (see vipr's command-line contract).
#[derive(Clone, Debug)]
pub struct ViprConfig {
    pub services_file: PathBuf,
    pub node_name: String,
    pub devices: Vec<String>,
    pub bpf_root: PathBuf,
    pub verbose: bool,
}

impl ViprConfig {
    pub(crate) fn args(&self) -> Vec<String> {
        let mut args = vec![
            "--proxy-mode=ebpf".to_owned(),
            format!("--services-file={}", self.services_file.display()),
            format!("--node-name={}", self.node_name),
            format!("--devices={}", self.devices.join(",")),
            format!("--bpf-root={}", self.bpf_root.display()),
        ];
        if self.verbose {
            args.push("-v".to_owned());
        }
        args
    }
}

/// A running vipr agent. Dropping it stops it (SIGTERM, then SIGKILL); if the thread is
/// panicking, the tail of its log is printed, so a failed test shows what vipr said.
#[derive(Debug)]
pub struct Vipr {
    child: Child,
    log: PathBuf,
}

impl Vipr {
    /// Starts `binary` inside `netns`, its stdout and stderr going to the file `log`.
    ///
    /// vipr gets a process group of its own, so that a Ctrl-C meant for the test or demo does
    /// not kill it under our feet, and it is sent SIGTERM if the thread that started it dies
    /// without stopping it: start it from a thread that lives as long as the guard.
    pub fn start(binary: &Path, netns: &Netns, config: &ViprConfig, log: &Path) -> Result<Self> {
        Self::start_with_args(binary, netns, &config.args(), log)
    }

    /// [`Self::start`] with a command line of the caller's (the conformance runner passes
    /// flags that [`ViprConfig`] does not model).
    pub fn start_with_args(binary: &Path, netns: &Netns, args: &[String], log: &Path) -> Result<Self> {
        let mut command = netns.command(binary)?;
        command.args(args);
        Self::start_command(command, log)
    }

    /// Starts `command`, a vipr command line (or one that runs vipr and passes its signals on,
    /// as `podman run` does), like [`Self::start`].
    pub fn start_command(mut command: Command, log: &Path) -> Result<Self> {
        let log_file = File::create(log).with_context(|| format!("cannot create {}", log.display()))?;
        command
            // The log is a file, read by people: no colour escapes.
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(log_file.try_clone()?)
            .stderr(log_file)
            .process_group(0);
        // SAFETY: prctl is async-signal-safe and touches no memory of ours.
        unsafe {
            command.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = command
            .spawn()
            .with_context(|| format!("cannot start {}", command.get_program().to_string_lossy()))?;
        Ok(Self { child, log: log.to_owned() })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// Fails, quoting the log, if vipr has exited.
    pub fn ensure_running(&mut self) -> Result<()> {
        if let Some(status) = self.child.try_wait()? {
            bail!("vipr exited unexpectedly ({status}); {}", log_tail(&self.log));
        }
        Ok(())
    }

    /// Stops vipr with SIGTERM and returns how it exited; kills it if it takes longer than
    /// ten seconds, which is an error.
    pub fn stop(mut self) -> Result<ExitStatus> {
        self.terminate()
    }

    /// Kills vipr with SIGKILL, as the OOM killer or a node's crash would: it gets no chance
    /// to finish a sync or tidy anything.
    pub fn kill(mut self) -> Result<ExitStatus> {
        if let Some(status) = self.child.try_wait()? {
            bail!("vipr had exited already ({status}); {}", log_tail(&self.log));
        }
        signal(&self.child, libc::SIGKILL)?;
        Ok(self.child.wait()?)
    }

    fn terminate(&mut self) -> Result<ExitStatus> {
        if let Some(status) = self.child.try_wait()? {
            return Ok(status);
        }
        signal(&self.child, libc::SIGTERM)?;
        let deadline = Instant::now() + STOP_TIMEOUT;
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait()? {
                return Ok(status);
            }
            thread::sleep(Duration::from_millis(20));
        }
        self.child.kill()?;
        let status = self.child.wait()?;
        bail!("vipr ignored SIGTERM for {STOP_TIMEOUT:?} and was killed ({status})");
    }
}

impl Drop for Vipr {
    fn drop(&mut self) {
        if let Err(error) = self.terminate() {
            eprintln!("testbed: {error:#}");
        }
        if thread::panicking() {
            eprintln!("testbed: vipr (pid {}) {}", self.pid(), log_tail(&self.log));
        }
    }
}

fn signal(child: &Child, signal: libc::c_int) -> Result<()> {
    let pid = libc::pid_t::try_from(child.id())?;
    // SAFETY: plain system call; `child` has not been reaped, so the pid is still ours.
    if unsafe { libc::kill(pid, signal) } != 0 {
        return Err(std::io::Error::last_os_error()).context("cannot signal vipr");
    }
    Ok(())
}

/// The last lines of a log file, introduced by its path.
pub(crate) fn log_tail(log: &Path) -> String {
    match std::fs::read_to_string(log) {
        Ok(text) => {
            let lines: Vec<&str> = text.lines().collect();
            let tail = &lines[lines.len().saturating_sub(LOG_TAIL_LINES)..];
            format!("log {} (last {} lines):\n{}", log.display(), tail.len(), tail.join("\n"))
        }
        Err(error) => format!("log {} unreadable: {error}", log.display()),
    }
}

/// Runs the command of the uninstall DaemonSet's cleanup container ([`uninstall_args`]:
/// `vipr --cleanup`) inside `netns` (the node's network namespace, as the container's host
/// network), with `--bpf-root=<bpf_root>` standing for its mount of the host's /sys/fs/bpf,
/// and returns its output.
pub fn vipr_cleanup(binary: &Path, netns: &Netns, bpf_root: &Path) -> Result<String> {
    let mut command = netns.command(binary)?;
    command.args(uninstall_args()?).arg(format!("--bpf-root={}", bpf_root.display()));
    cmd::run(&mut command).context("vipr --cleanup failed")
}

/// Waits until the vipr log at `log` shows its first sync, for at most `timeout`; fails at once
/// when `ensure_running` says the vipr writing it (a process, a container) has exited. Returns
/// the log.
pub fn wait_for_first_sync(
    log: &Path,
    timeout: Duration,
    mut ensure_running: impl FnMut() -> Result<()>,
) -> Result<String> {
    crate::wait_for("vipr to sync", timeout, || {
        ensure_running()?;
        let text = std::fs::read_to_string(log).unwrap_or_default();
        Ok(if text.contains("synced") {
            crate::Check::Done(text)
        } else {
            crate::Check::NotYet("no sync logged".to_owned())
        })
    })
}

/// The arguments of the cleanup container of the DaemonSet that `deploy/render.sh
/// --uninstall` prints (the image's entrypoint is vipr).
pub fn uninstall_args() -> Result<Vec<String>> {
    let render = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/render.sh");
    let output = std::process::Command::new("sh").arg(&render).arg("--uninstall").output()?;
    if !output.status.success() {
        bail!("{} --uninstall: {}", render.display(), String::from_utf8_lossy(&output.stderr));
    }
    let daemon_set: serde_yaml::Value = serde_yaml::from_slice(&output.stdout)?;
    let containers = &daemon_set["spec"]["template"]["spec"]["initContainers"];
    let args = containers
        .as_sequence()
        .and_then(|containers| containers.iter().find(|container| container["name"] == "cleanup"))
        .map(|container| &container["args"])
        .context("the uninstall DaemonSet has no cleanup init container")?;
    Ok(serde_yaml::from_value(args.clone())?)
}
