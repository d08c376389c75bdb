//! Running a command inside a User-Mode Linux guest: another real Linux kernel (vipr's own
//! build of Debian's 6.1 source, `uml_kernel.rs`, with IPVS, netfilter and ipset built in)
//! booted as an ordinary process, with the host's `/` as its root filesystem, so host-built
//! binaries run in it unchanged. Used where the host kernel lacks something vipr needs to be
//! tested with (IPVS); a boot takes about two seconds.
//!
//! The guest runs vipr's own init script ([`INIT_SCRIPT`]): it mounts the kernel file
//! systems (with private `/run` and `/dev/shm`, and a private `TMPDIR`), runs the command in
//! the caller's directory with the caller's `CARGO_*`, `RUST_*` and `VIPR_*` environment,
//! and powers off. The command's exit code, stdout and stderr come back
//! through files in a run directory on the host; output is forwarded while the guest runs.
//!
//! Self-contained (std and anyhow only), so that the test crate compiles this same file
//! (`#[path]`) for the tests and the conformance runner that boot guests themselves.
#![allow(dead_code)]

use std::{
    ffi::{OsStr, OsString},
    fs,
    io::{Read as _, Seek as _, SeekFrom, Write as _},
    os::unix::{ffi::OsStrExt as _, fs::PermissionsExt as _, process::CommandExt as _},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _, Result};

/// vipr's UML kernel, built by `cargo xtask setup` (`uml_kernel.rs`); `VIPR_UML_KERNEL`
/// names another.
pub const DEFAULT_KERNEL: &str = "/usr/local/lib/vipr/linux.uml";
pub const KERNEL_ENV: &str = "VIPR_UML_KERNEL";
/// Set to `1` in the guest's environment: a program can tell it runs inside.
pub const GUEST_ENV: &str = "VIPR_UML_GUEST";
/// Keep the run directory (console log, output) after the guest exits.
pub const KEEP_ENV: &str = "VIPR_UML_KEEP";

/// vipr's PID 1 in the guest. `VIPR_UML_DIR` (from the kernel command line) is the run
/// directory: `cmd`, `cwd` and `env` in, `stdout`, `stderr` and `rc` out.
pub const INIT_SCRIPT: &str = r#"#!/bin/sh
# vipr's init for a User-Mode Linux guest whose root is the host's / (written by xtask/src/uml.rs).
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root
D=$VIPR_UML_DIR
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mountpoint -q /dev || mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts
# Private scratch space: the host's /run and /dev/shm belong to the host's processes. /tmp
# stays the host's, because the workspace and its binaries may live there (CI clones into it);
# the guest's own temporary files go to a private TMPDIR instead.
mount -t tmpfs tmpfs /dev/shm
mount -t tmpfs tmpfs /run
mkdir -p /run/netns /run/tmp
export TMPDIR=/run/tmp
mount -t bpf bpf /sys/fs/bpf 2>/dev/null
mount -t cgroup2 cgroup2 /sys/fs/cgroup 2>/dev/null
ip link set lo up
# The kernel-wide budget of ICMP errors (1000/s, bursts of 50, shared by every namespace) would
# silently drop some REJECTs of a busy test run.
echo 1000000 > /proc/sys/net/ipv4/icmp_msgs_per_sec
echo 100000 > /proc/sys/net/ipv4/icmp_msgs_burst
# Output reaches the host's files within a second, so it can be followed while the guest runs.
echo 100 > /proc/sys/vm/dirty_expire_centisecs
echo 100 > /proc/sys/vm/dirty_writeback_centisecs
. $D/env
cd "$(cat $D/cwd)"
sh $D/cmd > $D/stdout 2> $D/stderr
echo $? > $D/rc
sync
echo o > /proc/sysrq-trigger
sleep 10
"#;

/// How to run a guest.
#[derive(Clone, Debug)]
pub struct Options {
    pub memory_mb: u32,
    /// The guest is killed after this long.
    pub timeout: Duration,
    /// Variables set in the guest besides the forwarded ones.
    pub env: Vec<(String, String)>,
    /// Forward the guest's stdout and stderr while it runs (`print!`/`eprint!`, so a test
    /// harness captures them); otherwise they are only returned.
    pub stream: bool,
    /// Where run directories go: on the host's file system (the guest writes there through
    /// its root), not under /run or /dev/shm (private in the guest). Default: `uml/`
    /// next to the running executable.
    pub run_base: Option<PathBuf>,
    /// Set (by a signal handler): the guest is killed and the run ends with code 130.
    pub interrupt: Option<Arc<AtomicBool>>,
    /// Lines of the guest's stdout not to forward while streaming (they are still returned).
    pub hide_line: Option<fn(&str) -> bool>,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            memory_mb: 1024,
            timeout: Duration::from_secs(600),
            env: Vec::new(),
            stream: true,
            run_base: None,
            interrupt: None,
            hide_line: None,
        }
    }
}

/// How the command ended in the guest.
#[derive(Clone, Debug)]
pub struct Outcome {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

/// The UML kernel to boot, if installed.
pub fn kernel() -> Option<PathBuf> {
    let path = std::env::var_os(KERNEL_ENV).map_or_else(|| PathBuf::from(DEFAULT_KERNEL), PathBuf::from);
    path.is_file().then_some(path)
}

/// Whether this process runs inside a guest booted by [`run`].
pub fn in_guest() -> bool {
    std::env::var_os(GUEST_ENV).is_some_and(|value| value == "1")
}

/// Quotes `arg` for `sh`.
pub fn shell_quote(arg: &OsStr) -> String {
    let text = String::from_utf8_lossy(arg.as_bytes());
    if !text.is_empty() && text.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_./=:,+@%".contains(&b)) {
        return text.into_owned();
    }
    format!("'{}'", text.replace('\'', r"'\''"))
}

/// The `export` lines of the guest's environment: the caller's `CARGO_*`, `RUST_*` and
/// `VIPR_*` variables, then `extra`, and [`GUEST_ENV`].
pub fn env_script(extra: &[(String, String)]) -> String {
    let mut script = String::new();
    let forwarded = std::env::vars_os().filter_map(|(name, value)| {
        let name = name.into_string().ok()?;
        let forward = ["CARGO_", "RUST_", "VIPR_"].iter().any(|prefix| name.starts_with(prefix))
            && name != GUEST_ENV
            && name != KERNEL_ENV;
        forward.then(|| (name, value.to_string_lossy().into_owned()))
    });
    for (name, value) in forwarded.chain(extra.iter().cloned()) {
        if name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
            script.push_str(&format!("export {name}={}\n", shell_quote(OsStr::new(&value))));
        }
    }
    script.push_str(&format!("export {GUEST_ENV}=1\n"));
    script
}

fn default_run_base() -> Result<PathBuf> {
    let executable = std::env::current_exe().context("cannot find our own executable")?;
    Ok(executable.parent().context("our executable has no directory")?.join("uml"))
}

/// A fresh run directory under `base`.
fn run_directory(base: &Path) -> Result<PathBuf> {
    fs::create_dir_all(base).with_context(|| format!("cannot create {}", base.display()))?;
    for attempt in 0..1000u32 {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .subsec_nanos();
        let dir = base.join(format!("run-{}-{nanos:x}-{attempt}", std::process::id()));
        match fs::create_dir(&dir) {
            Ok(()) => return Ok(dir),
            Err(error) if error.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(error) => return Err(error).with_context(|| format!("cannot create {}", dir.display())),
        }
    }
    bail!("no free run directory name under {}", base.display())
}

/// Appends what `file` gained since `offset` to `out`; returns it.
fn follow(file: &Path, offset: &mut u64) -> Vec<u8> {
    let Ok(mut handle) = fs::File::open(file) else { return Vec::new() };
    let mut new = Vec::new();
    if handle.seek(SeekFrom::Start(*offset)).is_ok() && handle.read_to_end(&mut new).is_ok() {
        *offset += new.len() as u64;
    }
    new
}

/// Boots a guest, runs `command` (program and arguments) in it as root in the current
/// directory, and returns how it ended. An error means the guest itself failed (no kernel, it
/// crashed or timed out): the tail of its console is in the message.
pub fn run(command: &[OsString], options: &Options) -> Result<Outcome> {
    let Some(kernel) = kernel() else {
        bail!(
            "no User-Mode Linux kernel at {DEFAULT_KERNEL} (or ${KERNEL_ENV}): `cargo xtask setup` builds it"
        );
    };
    if command.is_empty() {
        bail!("no command to run in the guest");
    }
    let base = match &options.run_base {
        Some(base) => base.clone(),
        None => default_run_base()?,
    };
    let dir = run_directory(&base)?;
    let dir = dir.canonicalize().unwrap_or(dir);
    let write = |name: &str, text: &str| -> Result<()> {
        fs::write(dir.join(name), text).with_context(|| format!("cannot write {}", dir.join(name).display()))
    };
    let line: Vec<String> = command.iter().map(|arg| shell_quote(arg)).collect();
    write("cmd", &format!("exec {}\n", line.join(" ")))?;
    let cwd = std::env::current_dir().context("no current directory")?;
    write("cwd", &format!("{}\n", cwd.display()))?;
    write("env", &env_script(&options.env))?;
    write("init", INIT_SCRIPT)?;
    fs::set_permissions(dir.join("init"), fs::Permissions::from_mode(0o755))?;
    fs::create_dir_all(dir.join("umldir"))?;
    let console = fs::File::create(dir.join("console.log"))?;

    let mut guest = Command::new(&kernel);
    guest
        .arg(format!("mem={}M", options.memory_mb))
        .args(["root=/dev/root", "rootfstype=hostfs", "rootflags=/", "rw"])
        .arg(format!("init={}", dir.join("init").display()))
        .arg(format!("VIPR_UML_DIR={}", dir.display()))
        .arg(format!("uml_dir={}", dir.join("umldir").display()))
        .args(["con=null", "con0=null,fd:2", "quiet", "loglevel=3"])
        .stdin(Stdio::null())
        .stdout(console.try_clone()?)
        .stderr(console)
        // Its own process group: a timeout kills every host process of the guest.
        .process_group(0);
    let mut child = guest.spawn().with_context(|| format!("cannot start {}", kernel.display()))?;
    let started = Instant::now();
    let (mut out_offset, mut err_offset) = (0u64, 0u64);
    // Stdout goes on in whole lines, so that `hide_line` sees each line whole.
    let mut partial = String::new();
    let mut forward = |final_pass: bool| {
        if !options.stream {
            return;
        }
        partial.push_str(&String::from_utf8_lossy(&follow(&dir.join("stdout"), &mut out_offset)));
        let complete = if final_pass { partial.len() } else { partial.rfind('\n').map_or(0, |end| end + 1) };
        for line in partial[..complete].split_inclusive('\n') {
            if !options.hide_line.is_some_and(|hide| hide(line.trim_end())) {
                print!("{line}");
            }
        }
        partial.drain(..complete);
        eprint!("{}", String::from_utf8_lossy(&follow(&dir.join("stderr"), &mut err_offset)));
        let _ = std::io::stdout().flush();
    };
    let mut interrupted = false;
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break Some(status);
        }
        interrupted = options.interrupt.as_ref().is_some_and(|flag| flag.load(Ordering::Relaxed));
        if interrupted || started.elapsed() > options.timeout {
            // SAFETY: signalling the process group we created.
            unsafe { libc_kill_group(child.id()) };
            let _ = child.wait();
            break None;
        }
        forward(false);
        std::thread::sleep(Duration::from_millis(200));
    };
    forward(true);
    let read = |name: &str| fs::read_to_string(dir.join(name)).unwrap_or_default();
    let outcome = match (status, read("rc").trim().parse::<i32>()) {
        (_, Ok(code)) => Ok(Outcome { code, stdout: read("stdout"), stderr: read("stderr") }),
        _ if interrupted => Ok(Outcome { code: 130, stdout: read("stdout"), stderr: read("stderr") }),
        (status, Err(_)) => {
            let console = read("console.log");
            let tail: Vec<&str> =
                console.lines().rev().take(40).collect::<Vec<_>>().into_iter().rev().collect();
            let how = match status {
                Some(status) => format!("the guest ended ({status}) without the command's exit code"),
                None => format!("the guest was killed after {:?}", options.timeout),
            };
            Err(anyhow::anyhow!(
                "{how}; run directory {}; stderr:\n{}\nconsole:\n{}",
                dir.display(),
                read("stderr"),
                tail.join("\n")
            ))
        }
    };
    if std::env::var_os(KEEP_ENV).is_none() && outcome.is_ok() {
        let _ = fs::remove_dir_all(&dir);
    }
    outcome
}

/// Kills the process group `pid` leads.
unsafe fn libc_kill_group(pid: u32) {
    extern "C" {
        fn kill(pid: i32, signal: i32) -> i32;
    }
    const SIGKILL: i32 = 9;
    if let Ok(pid) = i32::try_from(pid) {
        // SAFETY: the caller names a process group it created.
        unsafe { kill(-pid, SIGKILL) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arguments_are_quoted_for_sh() {
        assert_eq!(shell_quote(OsStr::new("--mode=ipvs")), "--mode=ipvs");
        assert_eq!(shell_quote(OsStr::new("a b")), "'a b'");
        assert_eq!(shell_quote(OsStr::new("it's")), r"'it'\''s'");
        assert_eq!(shell_quote(OsStr::new("")), "''");
        assert_eq!(shell_quote(OsStr::new("$HOME")), "'$HOME'");
    }

    #[test]
    fn the_guest_knows_it_is_one() {
        let script = env_script(&[("EXTRA".into(), "x y".into())]);
        assert!(script.contains("export EXTRA='x y'\n"));
        assert!(script.ends_with(&format!("export {GUEST_ENV}=1\n")));
    }

    #[test]
    fn the_init_script_reports_through_the_run_directory() {
        for needle in ["$D/stdout", "$D/stderr", "echo $? > $D/rc", "export TMPDIR=/run/tmp"] {
            assert!(INIT_SCRIPT.contains(needle), "{needle}");
        }
    }
}
