//! `cargo xtask image`: vipr's container image (deploy/Containerfile), built with podman and no
//! registry. The base is a Debian root file system made by debootstrap from Debian's own
//! packages, cached outside the repository under [`CACHE_DIR`] and keyed by its package list,
//! so that only the first build on a machine downloads anything (~40 s); later builds take
//! seconds. The vipr binary is built on the host (Debian 12, the base's glibc) and copied in.
//!
//! podman runs with [`containers_conf`], never with its defaults: its default network adds
//! chains to the host's iptables and turns on the host's ip_forward, and its default runtime
//! and resource limits do not work on these machines (docs/deploy.md has the details).
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context as _, Result};

use crate::cmd;
use crate::Workspace;

/// The base image's cache and podman's settings for vipr's image; outside the repository, so
/// that every clone on the machine shares them.
pub const CACHE_DIR: &str = "/var/cache/vipr-image";

/// The Debian release of the base: the host's, whose glibc the vipr binary is linked against.
const SUITE: &str = "bookworm";

/// What the image's modes start: iptables (both variants, and update-alternatives for
/// iptables-wrapper), ipset, nft, ip, conntrack and bpftool for inspecting the pins.
const BASE_PACKAGES: &[&str] =
    &["iptables", "ipset", "nftables", "iproute2", "conntrack", "bpftool", "ca-certificates"];

/// Where debootstrap leaves what the image does not need (documentation, package lists).
const TRIMMED_DIRS: &[&str] =
    &["usr/share/man", "usr/share/info", "usr/share/locale", "var/lib/apt/lists", "var/cache/apt"];

#[derive(clap::Args)]
pub struct ImageArgs {
    /// The vipr binary to put in the image [default: `cargo build --release` of vipr].
    #[arg(long, value_name = "PATH")]
    vipr: Option<PathBuf>,
    /// The image's name.
    #[arg(long, default_value = "localhost/vipr:0.1.0")]
    tag: String,
    /// Where to save the image as an OCI archive [default: target/vipr-image.oci.tar].
    #[arg(long, value_name = "PATH", conflicts_with = "no_save")]
    output: Option<PathBuf>,
    /// Only build the image into podman's storage (the tests run it from there).
    #[arg(long)]
    no_save: bool,
}

/// The containers.conf every podman command of vipr's runs with (`CONTAINERS_CONF`), written
/// by [`run`]: the tests read it too.
pub fn containers_conf() -> PathBuf {
    Path::new(CACHE_DIR).join("containers.conf")
}

pub fn run(workspace: &Workspace, args: &ImageArgs) -> Result<()> {
    std::fs::create_dir_all(CACHE_DIR).with_context(|| format!("creating {CACHE_DIR}"))?;
    // One build at a time on the machine: parallel tests and a developer's run share the cache
    // and the image names.
    let lock_path = Path::new(CACHE_DIR).join("lock");
    let lock = File::create(&lock_path).with_context(|| format!("creating {}", lock_path.display()))?;
    lock.lock().with_context(|| format!("locking {}", lock_path.display()))?;

    write_containers_conf()?;
    let binary = match &args.vipr {
        Some(binary) => binary.clone(),
        None => {
            cmd::run(workspace.cargo().args([
                "build",
                "--release",
                "-p",
                "proxy-userspace",
                "--bin",
                "vipr",
            ]))?;
            workspace.target_dir().join("release").join("vipr")
        }
    };
    let base = ensure_base()?;
    let context = prepare_context(workspace, &binary)?;
    let previous = image_id(&args.tag);
    cmd::run(
        podman()
            .args(["build", "--pull=never", "--network=none", "--build-arg"])
            .arg(format!("BASE={base}"))
            .arg("--file")
            .arg(workspace.root.join("deploy").join("Containerfile"))
            .args(["--tag", &args.tag])
            .arg(&context),
    )?;
    // The image the tag named before is garbage now (each test run builds one).
    if let Some(previous) = previous.filter(|previous| Some(previous) != image_id(&args.tag).as_ref()) {
        if let Err(failure) = cmd::probe(podman().args(["rmi", &previous])) {
            eprintln!("note: the previous image {previous} stays ({failure})");
        }
    }
    if !args.no_save {
        let output = args.output.clone().unwrap_or_else(|| workspace.target_dir().join("vipr-image.oci.tar"));
        if output.exists() {
            std::fs::remove_file(&output).with_context(|| format!("removing {}", output.display()))?;
        }
        cmd::run(podman().args(["save", "--format", "oci-archive", "--output"]).arg(&output).arg(&args.tag))?;
        eprintln!("saved {} as {} (`podman load -i` or `ctr image import`)", args.tag, output.display());
    }
    Ok(())
}

/// `podman` with vipr's settings.
fn podman() -> Command {
    let mut podman = Command::new("podman");
    podman.env("CONTAINERS_CONF", containers_conf());
    podman
}

/// The settings that must differ from podman's defaults here:
/// - no network for any container unless one is named (never podman's bridge, which changes
///   the host's firewall and ip_forward);
/// - runc: crun refuses the hybrid cgroup layout of these machines;
/// - cgroupfs and a file for events: there is no systemd;
/// - explicit open-file and process limits this process can grant (podman's defaults ask for
///   more than a sandboxed machine allows).
fn write_containers_conf() -> Result<()> {
    let limits = std::fs::read_to_string("/proc/self/limits").context("reading /proc/self/limits")?;
    let open_files = hard_limit(&limits, "Max open files").unwrap_or(1024);
    let pid_max = std::fs::read_to_string("/proc/sys/kernel/pid_max")
        .ok()
        .and_then(|text| text.trim().parse().ok())
        .unwrap_or(32768);
    let processes = hard_limit(&limits, "Max processes").unwrap_or(pid_max).min(pid_max);
    let conf = format!(
        "# Written by `cargo xtask image` (xtask/src/image.rs); podman reads it through CONTAINERS_CONF.\n\
         [containers]\n\
         default_ulimits = [\"nofile={open_files}:{open_files}\", \"nproc={processes}:{processes}\"]\n\
         netns = \"none\"\n\
         [engine]\n\
         runtime = \"runc\"\n\
         cgroup_manager = \"cgroupfs\"\n\
         events_logger = \"file\"\n"
    );
    let path = containers_conf();
    let temporary = path.with_extension("conf.tmp");
    std::fs::write(&temporary, conf).with_context(|| format!("writing {}", temporary.display()))?;
    std::fs::rename(&temporary, &path).with_context(|| format!("writing {}", path.display()))
}

/// A hard limit of /proc/self/limits (`Max open files  1024  20000  files`); `None` when it is
/// unlimited or not there.
fn hard_limit(limits: &str, name: &str) -> Option<u64> {
    let line = limits.lines().find(|line| line.starts_with(name))?;
    line[name.len()..].split_whitespace().nth(1)?.parse().ok()
}

/// FNV-1a: a stable key for the cache (std's hashers may change between Rust releases).
fn fnv1a(text: &str) -> u64 {
    text.bytes()
        .fold(0xcbf2_9ce4_8422_2325, |hash, byte| (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3))
}

/// The base image's name in podman, importing or making it when podman does not have it.
fn ensure_base() -> Result<String> {
    let key = format!("{:016x}", fnv1a(&format!("{SUITE} minbase {}", BASE_PACKAGES.join(","))));
    let tag = format!("localhost/vipr-base:{SUITE}-{key}");
    if image_id(&tag).is_some() {
        return Ok(tag);
    }
    let archive = Path::new(CACHE_DIR).join(format!("base-{SUITE}-{key}.tar"));
    if !archive.is_file() {
        debootstrap(&archive)?;
    }
    cmd::run(podman().arg("import").arg(&archive).arg(&tag))?;
    Ok(tag)
}

/// The image id `tag` names, if podman has it.
fn image_id(tag: &str) -> Option<String> {
    cmd::probe(podman().args(["image", "inspect", "--format", "{{.Id}}", tag]))
        .ok()
        .map(|id| id.trim().to_owned())
}

/// Makes the base's root file system with debootstrap and archives it as `archive`.
fn debootstrap(archive: &Path) -> Result<()> {
    let rootfs = archive.with_extension("rootfs");
    remove_rootfs(&rootfs)?;
    cmd::run(
        Command::new("debootstrap")
            .args(["--variant=minbase"])
            .arg(format!("--include={}", BASE_PACKAGES.join(",")))
            .arg(SUITE)
            .arg(&rootfs),
    )?;
    trim(&rootfs)?;
    let temporary = archive.with_extension("tar.tmp");
    cmd::run(
        Command::new("tar").args(["--numeric-owner", "-C"]).arg(&rootfs).arg("-cf").arg(&temporary).arg("."),
    )?;
    std::fs::rename(&temporary, archive).with_context(|| format!("renaming {}", temporary.display()))?;
    remove_rootfs(&rootfs)
}

/// Removes a root file system debootstrap made, first unmounting what a failed run may have
/// left mounted in it (its /proc and /sys), so that nothing outside it is touched.
fn remove_rootfs(rootfs: &Path) -> Result<()> {
    if !rootfs.exists() {
        return Ok(());
    }
    let mounts = std::fs::read_to_string("/proc/self/mounts").context("reading /proc/self/mounts")?;
    let mut inside: Vec<&str> = mounts
        .lines()
        .filter_map(|line| line.split_whitespace().nth(1))
        .filter(|mount_point| Path::new(mount_point).starts_with(rootfs))
        .collect();
    // Deepest first.
    inside.sort_by_key(|mount_point| std::cmp::Reverse(mount_point.len()));
    for mount_point in inside {
        cmd::run(Command::new("umount").args(["--lazy", mount_point]))?;
    }
    std::fs::remove_dir_all(rootfs).with_context(|| format!("removing {}", rootfs.display()))
}

/// Drops what the image does not need, and the host's name and resolver, which debootstrap
/// copies in (a container gets its own).
fn trim(rootfs: &Path) -> Result<()> {
    for dir in TRIMMED_DIRS {
        let dir = rootfs.join(dir);
        if dir.is_dir() {
            std::fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
            std::fs::create_dir(&dir).with_context(|| format!("creating {}", dir.display()))?;
        }
    }
    // Packages' documentation, but their copyright notices.
    let doc = rootfs.join("usr/share/doc");
    for package in std::fs::read_dir(&doc).with_context(|| format!("reading {}", doc.display()))? {
        let package = package?.path();
        if !package.is_dir() {
            continue;
        }
        for file in std::fs::read_dir(&package)? {
            let file = file?.path();
            if file.file_name().is_some_and(|name| name == "copyright") {
                continue;
            }
            if file.is_dir() {
                std::fs::remove_dir_all(&file)?;
            } else {
                std::fs::remove_file(&file)?;
            }
        }
    }
    for file in ["etc/resolv.conf", "etc/hostname"] {
        let path = rootfs.join(file);
        std::fs::write(&path, "").with_context(|| format!("blanking {}", path.display()))?;
    }
    Ok(())
}

/// The build context: the stripped vipr binary and the iptables wrapper, in a directory of
/// their own (the repository with its target/ would be gigabytes to send).
fn prepare_context(workspace: &Workspace, binary: &Path) -> Result<PathBuf> {
    if !binary.is_file() {
        bail!("{} is not a file: build vipr first (`cargo build -p proxy-userspace`)", binary.display());
    }
    let context = workspace.target_dir().join("image-context");
    if context.exists() {
        std::fs::remove_dir_all(&context).with_context(|| format!("removing {}", context.display()))?;
    }
    std::fs::create_dir_all(&context).with_context(|| format!("creating {}", context.display()))?;
    // A debug build is ~100 MB of debug information.
    cmd::run(Command::new("strip").arg("-o").arg(context.join("vipr")).arg(binary))?;
    let wrapper = workspace.root.join("deploy").join("iptables-wrapper");
    std::fs::copy(&wrapper, context.join("iptables-wrapper"))
        .with_context(|| format!("copying {}", wrapper.display()))?;
    Ok(context)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hard_limits_are_read_from_proc_limits() {
        let limits = "Limit                     Soft Limit           Hard Limit           Units     \n\
                      Max processes             96365                96365                processes \n\
                      Max open files            1024                 20000                files     \n\
                      Max locked memory         unlimited            unlimited            bytes     \n";
        assert_eq!(hard_limit(limits, "Max open files"), Some(20000));
        assert_eq!(hard_limit(limits, "Max processes"), Some(96365));
        assert_eq!(hard_limit(limits, "Max locked memory"), None);
    }

    #[test]
    fn the_cache_key_is_stable() {
        // The FNV-1a test vector: a changed function would orphan every machine's cache.
        assert_eq!(fnv1a("a"), 0xaf63_dc4c_8601_ec8c);
    }
}
