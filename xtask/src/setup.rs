//! Making a fresh Debian 12 machine able to build, test and demo vipr.
//!
//! Each requirement checks itself first, so `setup` on a machine that has everything only
//! probes and returns quickly.
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context as _, Result};

use crate::cmd::{self, ProbeFailure};
use crate::uml_kernel;

/// Debian packages the tests and the demo shell out to: network namespaces and links
/// (iproute2), the netfilter baselines vipr is compared with (iptables, ipset, nftables,
/// conntrack), inspecting loaded programs and maps (bpftool), traffic (tcpdump, socat), process
/// and sysctl tools (procps), building the User-Mode Linux kernel with IPVS for the
/// ipvs mode's tests (see uml_kernel.rs), the container image's tools (podman, debootstrap, see
/// image.rs) and the benchmarks' run metadata (git).
/// `programs.rs` lists which program comes from which package; its tests fail when a program
/// the code starts is missing here.
pub const DEBIAN_PACKAGES: &[&str] = &[
    "bpftool",
    "iptables",
    "ipset",
    "nftables",
    "iproute2",
    "conntrack",
    "tcpdump",
    "socat",
    "procps",
    // vipr's User-Mode Linux kernel (uml_kernel.rs): a C toolchain, the kernel build's
    // parser generators and calculator, and xz for the source tarball.
    "build-essential",
    "flex",
    "bison",
    "bc",
    "xz-utils",
    "git",
    // vipr's container image (`cargo xtask image`, tests/tests/image.rs): podman with runc
    // (crun refuses these machines' hybrid cgroup layout), buildah for inspecting builds,
    // debootstrap for the base, and strip for the binary.
    "podman",
    "buildah",
    "runc",
    "debootstrap",
    "binutils",
    // The benchmark plots' font.
    "fonts-dejavu-core",
];

/// The eBPF crate needs nightly for `-Z build-std=core`; this is the toolchain whose libLLVM
/// bpf-linker is built against, so both always agree on the LLVM version.
pub const NIGHTLY: &str = "nightly";

/// Pinned so a new bpf-linker release cannot change the `llvm-<major>` feature names under us.
const BPF_LINKER_VERSION: &str = "0.13.0";

const BPFFS_MOUNT_POINT: &str = "/sys/fs/bpf";

/// Whether a missing requirement is installed or only reported.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Install,
    CheckOnly,
}

/// Everything: toolchain, system packages, bpffs, the UML kernel. Needs root to install.
pub fn all(mode: Mode) -> Result<()> {
    let mut requirements = toolchain_requirements();
    requirements.extend(system_requirements());
    ensure(&requirements, mode)
}

/// What `cargo build` needs (no root): the eBPF toolchain.
pub fn toolchain(mode: Mode) -> Result<()> {
    ensure(&toolchain_requirements(), mode)
}

fn toolchain_requirements() -> Vec<Box<dyn Requirement>> {
    vec![
        Box::new(RustupComponents { toolchain: None, components: &["clippy"] }),
        Box::new(RustupComponents { toolchain: Some(NIGHTLY), components: &["rust-src", "clippy"] }),
        Box::new(BpfLinker),
    ]
}

fn system_requirements() -> Vec<Box<dyn Requirement>> {
    // The kernel is built with the packages, so it comes after them.
    vec![Box::new(DebianPackages), Box::new(Bpffs), Box::new(UmlKernel)]
}

trait Requirement {
    fn name(&self) -> String;
    /// `None` when satisfied, otherwise what is missing (for the log).
    fn missing(&self) -> Result<Option<String>>;
    fn install(&self) -> Result<()>;
}

fn ensure(requirements: &[Box<dyn Requirement>], mode: Mode) -> Result<()> {
    let mut unsatisfied = Vec::new();
    for requirement in requirements {
        let name = requirement.name();
        let Some(missing) = requirement.missing()? else {
            eprintln!("ok: {name}");
            continue;
        };
        if mode == Mode::CheckOnly {
            eprintln!("MISSING: {name}: {missing}");
            unsatisfied.push(name);
            continue;
        }
        eprintln!("installing {name} ({missing})");
        requirement.install().with_context(|| format!("installing {name}"))?;
        if let Some(still_missing) = requirement.missing()? {
            bail!("{name} is still not usable after installing it: {still_missing}");
        }
        eprintln!("ok: {name} (installed)");
    }
    if !unsatisfied.is_empty() {
        bail!("missing {}; run `cargo xtask setup` (as root)", unsatisfied.join(", "));
    }
    Ok(())
}

struct DebianPackages;

impl DebianPackages {
    fn missing_packages() -> Result<Vec<&'static str>> {
        // dpkg-query exits non-zero when any package is unknown to dpkg, yet still prints the
        // known ones, so its stdout is read regardless of the exit code.
        let stdout = cmd::stdout_regardless_of_status(
            Command::new("dpkg-query")
                .args(["--show", "--showformat=${Package} ${Status}\\n"])
                .args(DEBIAN_PACKAGES),
        )?;
        let installed: Vec<&str> = stdout
            .lines()
            .filter(|line| line.ends_with(" install ok installed"))
            .filter_map(|line| line.split_whitespace().next())
            .collect();
        Ok(DEBIAN_PACKAGES.iter().copied().filter(|package| !installed.contains(package)).collect())
    }
}

impl Requirement for DebianPackages {
    fn name(&self) -> String {
        format!("Debian packages ({})", DEBIAN_PACKAGES.join(" "))
    }

    fn missing(&self) -> Result<Option<String>> {
        let missing = Self::missing_packages()?;
        Ok((!missing.is_empty()).then(|| format!("not installed: {}", missing.join(" "))))
    }

    fn install(&self) -> Result<()> {
        let missing = Self::missing_packages()?;
        // A fresh machine has no package lists yet; refreshing them only when something is
        // missing keeps `setup` fast (and offline-capable) once everything is there.
        cmd::run(Command::new("apt-get").arg("update"))?;
        cmd::run(
            Command::new("apt-get")
                .env("DEBIAN_FRONTEND", "noninteractive")
                .args(["install", "--yes", "--no-install-recommends"])
                .args(&missing),
        )
    }
}

struct RustupComponents {
    /// `None` is the toolchain selected for the workspace (the stable default).
    toolchain: Option<&'static str>,
    components: &'static [&'static str],
}

impl RustupComponents {
    /// `rustup component <subcommand> [--toolchain <toolchain>]`
    fn rustup_component(&self, subcommand: &str) -> Command {
        let mut rustup = Command::new("rustup");
        rustup.args(["component", subcommand]);
        if let Some(toolchain) = self.toolchain {
            rustup.args(["--toolchain", toolchain]);
        }
        rustup
    }

    fn missing_components(&self) -> Result<Vec<&'static str>> {
        let installed = cmd::output(self.rustup_component("list").arg("--installed")).with_context(|| {
            match self.toolchain {
                // Not installed here: today's nightly would bring an LLVM and a rustc that the
                // pinned aya and bpf-linker versions were not verified with.
                Some(toolchain) => format!("is the {toolchain} toolchain installed? (rustup toolchain list)"),
                None => "is rustup working?".to_string(),
            }
        })?;
        // Installed components are listed as `rust-src` or `clippy-x86_64-unknown-linux-gnu`.
        let is_installed = |component: &str| {
            installed.lines().any(|line| {
                line == component || line.strip_prefix(component).is_some_and(|rest| rest.starts_with('-'))
            })
        };
        Ok(self.components.iter().copied().filter(|c| !is_installed(c)).collect())
    }
}

impl Requirement for RustupComponents {
    fn name(&self) -> String {
        let toolchain = self.toolchain.unwrap_or("default");
        format!("rustup components for the {toolchain} toolchain ({})", self.components.join(" "))
    }

    fn missing(&self) -> Result<Option<String>> {
        let missing = self.missing_components()?;
        Ok((!missing.is_empty()).then(|| format!("not installed: {}", missing.join(" "))))
    }

    fn install(&self) -> Result<()> {
        let missing = self.missing_components()?;
        cmd::run(self.rustup_component("add").args(&missing))
    }
}

/// bpf-linker links the eBPF object; it has no prebuilt download and must load the very libLLVM
/// the nightly rustc emits bitcode for.
struct BpfLinker;

impl BpfLinker {
    fn nightly_sysroot() -> Result<PathBuf> {
        let sysroot =
            cmd::output(Command::new("rustc").arg(format!("+{NIGHTLY}")).args(["--print", "sysroot"]))?;
        Ok(PathBuf::from(sysroot.trim()))
    }

    /// The nightly's libLLVM, e.g. `libLLVM.so.22.1-rust-1.97.0-nightly`, and its major version.
    fn nightly_libllvm(sysroot_lib: &Path) -> Result<(PathBuf, String)> {
        let entries =
            std::fs::read_dir(sysroot_lib).with_context(|| format!("reading {}", sysroot_lib.display()))?;
        for entry in entries {
            let file_name = entry?.file_name();
            let file_name = file_name.to_string_lossy();
            let Some(version) = file_name.strip_prefix("libLLVM.so.") else {
                continue;
            };
            if !version.contains("-rust-") {
                continue;
            }
            let major: String = version.chars().take_while(char::is_ascii_digit).collect();
            if major.is_empty() {
                continue;
            }
            return Ok((sysroot_lib.join(&*file_name), major));
        }
        bail!("no libLLVM.so.<version>-rust-* in {}", sysroot_lib.display())
    }

    /// An LLVM "installation" holding only `lib/libLLVM.so`, which is all bpf-linker's build
    /// needs to link against the nightly's libLLVM.
    fn llvm_prefix() -> Result<PathBuf> {
        let cache = match std::env::var_os("XDG_CACHE_HOME") {
            Some(dir) if !dir.is_empty() => PathBuf::from(dir),
            _ => PathBuf::from(std::env::var_os("HOME").context("HOME is not set")?).join(".cache"),
        };
        Ok(cache.join("vipr").join("llvm-prefix"))
    }
}

impl Requirement for BpfLinker {
    fn name(&self) -> String {
        "bpf-linker (runnable without LD_LIBRARY_PATH)".to_string()
    }

    fn missing(&self) -> Result<Option<String>> {
        // Without LD_LIBRARY_PATH, as from a plain shell or from rustc under aya-build: a
        // bpf-linker that only runs with help from the environment counts as broken.
        let mut version = Command::new("bpf-linker");
        version.arg("--version").env_remove("LD_LIBRARY_PATH");
        Ok(match cmd::probe(&mut version) {
            Ok(_) => None,
            Err(ProbeFailure::NotFound) => Some("not installed".to_string()),
            Err(ProbeFailure::Failed(reason)) => Some(format!("installed but does not run: {reason}")),
        })
    }

    fn install(&self) -> Result<()> {
        let sysroot_lib = Self::nightly_sysroot()?.join("lib");
        let (libllvm, llvm_major) = Self::nightly_libllvm(&sysroot_lib)?;
        let prefix = Self::llvm_prefix()?;
        let prefix_lib = prefix.join("lib");
        std::fs::create_dir_all(&prefix_lib).with_context(|| format!("creating {}", prefix_lib.display()))?;
        let link = prefix_lib.join("libLLVM.so");
        // Replaced every time: after a nightly update the old link points at a deleted file.
        if link.symlink_metadata().is_ok() {
            std::fs::remove_file(&link).with_context(|| format!("removing {}", link.display()))?;
        }
        eprintln!("+ ln -s {} {}", libllvm.display(), link.display());
        std::os::unix::fs::symlink(&libllvm, &link)
            .with_context(|| format!("linking {} to {}", link.display(), libllvm.display()))?;

        cmd::run(
            Command::new("cargo")
                .arg(format!("+{NIGHTLY}"))
                .args(["install", "bpf-linker", "--locked", "--force"])
                .args(["--version", BPF_LINKER_VERSION])
                .args(["--no-default-features", "--features", &format!("llvm-{llvm_major}")])
                .env("LLVM_PREFIX", &prefix)
                // The rpath makes the installed binary find libLLVM on its own. It replaces
                // any RUSTFLAGS from the environment, which were meant for vipr, not for this.
                .env("RUSTFLAGS", format!("-C link-arg=-Wl,-rpath,{}", sysroot_lib.display()))
                .env_remove("CARGO_ENCODED_RUSTFLAGS")
                .env_remove("CARGO_TARGET_DIR"),
        )
    }
}

/// Maps and links are pinned under bpffs; the kernel does not mount it at boot here.
struct Bpffs;

impl Requirement for Bpffs {
    fn name(&self) -> String {
        format!("bpffs mounted at {BPFFS_MOUNT_POINT}")
    }

    fn missing(&self) -> Result<Option<String>> {
        let mounts = std::fs::read_to_string("/proc/mounts").context("reading /proc/mounts")?;
        let mounted = mounts.lines().any(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            matches!(fields.as_slice(), [_, mount_point, "bpf", ..] if *mount_point == BPFFS_MOUNT_POINT)
        });
        Ok((!mounted).then(|| "not mounted".to_string()))
    }

    fn install(&self) -> Result<()> {
        std::fs::create_dir_all(BPFFS_MOUNT_POINT)
            .with_context(|| format!("creating {BPFFS_MOUNT_POINT}"))?;
        cmd::run(Command::new("mount").args(["-t", "bpf", "bpf", BPFFS_MOUNT_POINT]))
    }
}

/// The guest kernel of the ipvs mode's tests: built here because Debian's package does not
/// run on every CPU (uml_kernel.rs says why).
struct UmlKernel;

impl Requirement for UmlKernel {
    fn name(&self) -> String {
        format!("vipr's User-Mode Linux kernel at {}", crate::uml::DEFAULT_KERNEL)
    }

    fn missing(&self) -> Result<Option<String>> {
        Ok(uml_kernel::is_current())
    }

    fn install(&self) -> Result<()> {
        uml_kernel::build()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_nightly_libllvm_and_its_major_version() {
        let dir = std::env::temp_dir().join(format!("vipr-xtask-sysroot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // The real sysroot holds both names; only the versioned one is what rustc loads.
        for name in ["libLLVM-22-rust-1.97.0-nightly.so", "libLLVM.so.22.1-rust-1.97.0-nightly"] {
            std::fs::write(dir.join(name), b"").unwrap();
        }
        let found = BpfLinker::nightly_libllvm(&dir);
        std::fs::remove_dir_all(&dir).unwrap();
        let (libllvm, major) = found.unwrap();
        assert_eq!(libllvm, dir.join("libLLVM.so.22.1-rust-1.97.0-nightly"));
        assert_eq!(major, "22");
    }
}
