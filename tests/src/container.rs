//! vipr's container image (deploy/Containerfile) run with podman inside a lab's namespaces.
//!
//! The image is built by `cargo xtask image` (xtask/src/image.rs), through the xtask binary
//! next to the vipr binary the tests run, and from that vipr binary. podman always runs with
//! the containers.conf xtask writes ([`CONTAINERS_CONF`]), whose default is no network at
//! all, and each container joins a test's namespace by name: podman's default network would
//! change the host's firewall and ip_forward. podman itself runs inside that namespace too
//! (`setns()`, not `ip netns exec`, which would hide the cgroup mounts podman needs).

use std::{
    hash::{Hash as _, Hasher as _},
    path::{Path, PathBuf},
    process::{Command, ExitStatus},
    sync::OnceLock,
};

use anyhow::{anyhow, Context, Result};

use crate::{cmd, left_by_dead_process, locate_vipr, unique_name, Netns, Vipr};

/// Written by `cargo xtask image` (`image::containers_conf`).
pub const CONTAINERS_CONF: &str = "/var/cache/vipr-image/containers.conf";
/// Start of the tests' container and cgroup names.
const PREFIX: &str = "vipr-image";

/// Builds the tests' image once per test process (seconds once xtask's cached base exists;
/// ~40 s more for debootstrap on a machine that has never built one) and returns its name.
pub fn test_image() -> Result<&'static str> {
    static BUILT: OnceLock<Result<String, String>> = OnceLock::new();
    BUILT
        .get_or_init(|| build_test_image().map_err(|error| format!("{error:#}")))
        .as_deref()
        .map_err(|error| anyhow!("cannot build the image: {error}"))
}

fn build_test_image() -> Result<String> {
    let vipr = locate_vipr()?;
    let xtask = vipr.with_file_name("xtask");
    if !xtask.is_file() {
        anyhow::bail!("no xtask binary next to {}: run `cargo build --workspace`", vipr.display());
    }
    // A name of each checkout's own, so that two checkouts testing at once on one machine
    // do not replace each other's image (each build replaces its checkout's previous one).
    let mut checkout = std::hash::DefaultHasher::new();
    vipr.hash(&mut checkout);
    let tag = format!("localhost/vipr:test-{:016x}", checkout.finish());
    let mut build = Command::new(&xtask);
    build.arg("image").arg("--vipr").arg(&vipr).args(["--tag", &tag, "--no-save"]);
    cmd::run(&mut build)?;
    Ok(tag)
}

/// `podman` inside `netns`, with vipr's settings.
pub fn podman(netns: &Netns) -> Result<Command> {
    let mut podman = netns.command("podman")?;
    podman.env("CONTAINERS_CONF", CONTAINERS_CONF);
    Ok(podman)
}

/// What the container may do.
#[derive(Clone, Debug)]
pub enum Privileges {
    /// `--privileged`, as the DaemonSet's `privileged: true`.
    Privileged,
    /// Only these capabilities (`CAP_` left out), as a `capabilities.add` list.
    Capabilities(Vec<String>),
}

/// The container's seccomp filter, as a pod's `seccompProfile`.
#[derive(Clone, Debug)]
pub enum Seccomp {
    /// podman's default profile for an unprivileged container, none for a privileged one.
    RuntimeDefault,
    Unconfined,
    /// A profile file, applied even to a privileged container.
    Profile(PathBuf),
}

/// A seccomp profile that allows everything but `bpf()`, which fails with EPERM: a node whose
/// runtime forbids BPF. Written to `dir`; returns the file.
pub fn deny_bpf_profile(dir: &Path) -> Result<PathBuf> {
    let path = dir.join("seccomp-deny-bpf.json");
    let profile = r#"{"defaultAction": "SCMP_ACT_ALLOW", "syscalls": [{"names": ["bpf"], "action": "SCMP_ACT_ERRNO", "errnoRet": 1}]}"#;
    std::fs::write(&path, profile).with_context(|| format!("cannot write {}", path.display()))?;
    Ok(path)
}

/// One `podman run` of the image in a namespace.
#[derive(Clone, Debug)]
pub struct ContainerSpec {
    pub image: String,
    pub privileges: Privileges,
    pub seccomp: Seccomp,
    /// `(host path, container path and options)`, e.g. `(bpffs, "/sys/fs/bpf:rshared")`.
    pub volumes: Vec<(PathBuf, String)>,
    /// Another program of the image to run instead of vipr.
    pub entrypoint: Option<String>,
    /// vipr's command line, or the entrypoint's.
    pub args: Vec<String>,
}

impl ContainerSpec {
    fn command(&self, netns: &Netns, name: &str) -> Result<Command> {
        let mut command = podman(netns)?;
        command
            .args(["run", "--rm", "--pull=never", "--name", name])
            .arg(format!("--network=ns:{}", netns.path().display()))
            .args(["--env", "NO_COLOR=1"]);
        match &self.privileges {
            Privileges::Privileged => command.arg("--privileged"),
            Privileges::Capabilities(add) => {
                command.arg("--cap-drop=all").arg(format!("--cap-add={}", add.join(",")))
            }
        };
        match &self.seccomp {
            Seccomp::RuntimeDefault => {}
            Seccomp::Unconfined => {
                command.args(["--security-opt", "seccomp=unconfined"]);
            }
            Seccomp::Profile(path) => {
                command.arg("--security-opt").arg(format!("seccomp={}", path.display()));
            }
        }
        for (host, target) in &self.volumes {
            command.arg("--volume").arg(format!("{}:{target}", host.display()));
        }
        if let Some(entrypoint) = &self.entrypoint {
            command.args(["--entrypoint", entrypoint]);
        }
        command.arg(&self.image).args(&self.args);
        Ok(command)
    }
}

/// A running container of the image, its vipr's output in a log file; stopped and removed on
/// drop (with the cgroups podman leaves behind).
#[derive(Debug)]
pub struct Container {
    name: String,
    /// `podman run` in the foreground: SIGTERM to it reaches vipr, and its exit code is vipr's.
    process: Option<Vipr>,
}

impl Container {
    pub fn start(netns: &Netns, spec: &ContainerSpec, log: &Path) -> Result<Self> {
        remove_leftover_containers(netns);
        let name = unique_name(PREFIX);
        let process = Vipr::start_command(spec.command(netns, &name)?, log)?;
        Ok(Self { name, process: Some(process) })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Fails, quoting the log, if the container has exited.
    pub fn ensure_running(&mut self) -> Result<()> {
        self.process.as_mut().context("the container was stopped")?.ensure_running()
    }

    pub fn log_path(&self) -> Option<&Path> {
        self.process.as_ref().map(Vipr::log_path)
    }

    /// Stops vipr with SIGTERM (through podman) and returns how it exited.
    pub fn stop(mut self) -> Result<ExitStatus> {
        self.process.take().context("the container was stopped")?.stop()
    }
}

impl Drop for Container {
    fn drop(&mut self) {
        // The process first: its SIGTERM lets vipr stop as it would in a pod. `rm` then removes
        // the container should podman have died before it could.
        drop(self.process.take());
        let mut remove = Command::new("podman");
        remove.env("CONTAINERS_CONF", CONTAINERS_CONF).args(["rm", "--force", "--ignore", &self.name]);
        if let Err(error) = cmd::run(&mut remove) {
            eprintln!("testbed: cannot remove container {}: {error:#}", self.name);
        }
        remove_libpod_cgroups();
    }
}

/// Runs the image to completion in `netns` (e.g. `--cleanup`) and returns its output; a
/// non-zero exit is an error carrying it.
pub fn run_to_completion(netns: &Netns, spec: &ContainerSpec) -> Result<String> {
    remove_leftover_containers(netns);
    let name = unique_name(PREFIX);
    let outcome = cmd::run(&mut spec.command(netns, &name)?);
    remove_libpod_cgroups();
    outcome
}

/// Containers of earlier test runs that were killed before they could remove them.
fn remove_leftover_containers(netns: &Netns) {
    let Ok(mut list) = podman(netns) else { return };
    let Ok(names) = cmd::run(list.args(["ps", "--all", "--format", "{{.Names}}"])) else { return };
    for name in names.lines().filter(|name| left_by_dead_process(name, PREFIX)) {
        eprintln!("testbed: removing container {name}, left over by a killed run");
        if let Ok(mut remove) = podman(netns) {
            let _ = cmd::run(remove.args(["rm", "--force", "--ignore", name]));
        }
    }
}

/// podman's cgroupfs manager leaves an empty `libpod_parent` cgroup in every hierarchy; the
/// kernel refuses to remove one that still has processes, so a running container keeps its own.
fn remove_libpod_cgroups() {
    let Ok(hierarchies) = std::fs::read_dir("/sys/fs/cgroup") else { return };
    for hierarchy in hierarchies.flatten() {
        remove_empty_cgroups(&hierarchy.path().join("libpod_parent"));
    }
}

/// Removes `dir` and the cgroups below it, deepest first, where they are empty.
fn remove_empty_cgroups(dir: &Path) {
    let Ok(children) = std::fs::read_dir(dir) else { return };
    for child in children.flatten() {
        if child.file_type().is_ok_and(|kind| kind.is_dir()) {
            remove_empty_cgroups(&child.path());
        }
    }
    let _ = std::fs::remove_dir(dir);
}

/// A cgroup v2 directory of its own for vipr's socket hooks (`--cgroup-root`), so that they
/// see no process of the host; removed on drop.
#[derive(Debug)]
pub struct Cgroup2Dir {
    path: PathBuf,
}

impl Cgroup2Dir {
    pub fn create() -> Result<Self> {
        let root = cgroup2_mount()?;
        let prefix = format!("{PREFIX}-cg");
        if let Ok(entries) = std::fs::read_dir(&root) {
            for entry in entries.flatten() {
                if entry.file_name().to_str().is_some_and(|name| left_by_dead_process(name, &prefix)) {
                    let _ = std::fs::remove_dir(entry.path());
                }
            }
        }
        let path = root.join(unique_name(&prefix));
        std::fs::create_dir(&path).with_context(|| format!("cannot create cgroup {}", path.display()))?;
        Ok(Self { path })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for Cgroup2Dir {
    fn drop(&mut self) {
        if let Err(error) = std::fs::remove_dir(&self.path) {
            eprintln!("testbed: cannot remove cgroup {}: {error}", self.path.display());
        }
    }
}

/// Where cgroup v2 is mounted (/sys/fs/cgroup/unified on these hybrid machines): the first
/// cgroup2 mount, as vipr finds it.
pub fn cgroup2_mount() -> Result<PathBuf> {
    let mounts = std::fs::read_to_string("/proc/self/mounts").context("cannot read /proc/self/mounts")?;
    mounts
        .lines()
        .map(|line| line.split_whitespace().collect::<Vec<_>>())
        .find(|fields| fields.get(2) == Some(&"cgroup2"))
        .and_then(|fields| fields.get(1).map(PathBuf::from))
        .context("no cgroup2 mount")
}
