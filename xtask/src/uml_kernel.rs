//! Building vipr's User-Mode Linux kernel, the guest `uml.rs` boots for the ipvs mode's tests
//! (this machine kind's kernel has no IPVS).
//!
//! Why not Debian's `user-mode-linux` package: its 6.1 kernel keeps 832 bytes of a guest
//! process's FPU state (2696 in later 6.1 releases) and writes them back with
//! `PTRACE_SETREGSET`, which the host kernel refuses unless it gets its whole XSAVE area. On a
//! CPU with AVX-512 and AMX that area is 11008 bytes, so every guest process dies at its first
//! register write-back (init included: "Attempted to kill init"). Upstream UML sizes the buffer
//! from the host since Linux 6.13; Debian 12 offers only 6.1 sources.
//!
//! So setup builds one from Debian's `linux-source-6.1` with [`SOURCE_EDITS`] (room for the
//! whole area) and `xtask/uml/kernel.config` (everything the tests use built in: IPVS,
//! netfilter, ipset, both iptables backends). It takes about four minutes on two cores, once:
//! [`is_current`] compares the inputs recorded beside the kernel with these.
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, ensure, Context as _, Result};

use crate::{cmd, uml};

/// Debian's package of the kernel source the edits below are written against.
pub const SOURCE_PACKAGE: &str = "linux-source-6.1";

/// The configuration merged over `make tinyconfig`.
const CONFIG: &str = include_str!("../uml/kernel.config");

/// One change to the kernel source: `before` must occur exactly once in `file`.
struct SourceEdit {
    file: &'static str,
    before: &'static str,
    after: &'static str,
}

/// Room for the host's whole XSAVE area, and a clear panic where even that is too small
/// (instead of every process dying without a word).
const SOURCE_EDITS: &[SourceEdit] = &[
    SourceEdit {
        file: "arch/x86/um/user-offsets.c",
        before: "\tDEFINE_LONGS(HOST_FP_SIZE, 2696);\n",
        after: "\t/* vipr: the host's whole XSAVE area (11008 bytes with AMX); the host refuses\n\
                \t * PTRACE_SETREGSET of NT_X86_XSTATE with less. */\n\
                \tDEFINE_LONGS(HOST_FP_SIZE, 16384);\n",
    },
    SourceEdit {
        file: "arch/x86/um/os-Linux/registers.c",
        before: "\tif (ptrace(PTRACE_GETREGSET, pid, NT_X86_XSTATE, &iov) == 0)\n\
                 \t\thave_xstate_support = 1;\n",
        after: "\tif (ptrace(PTRACE_GETREGSET, pid, NT_X86_XSTATE, &iov) == 0) {\n\
                \t\t/* vipr: the host fills at most its XSAVE area; a full buffer may be cut. */\n\
                \t\tif (iov.iov_len >= FP_SIZE * sizeof(unsigned long))\n\
                \t\t\tpanic(\"the host's XSAVE area does not fit in %lu bytes\",\n\
                \t\t\t      FP_SIZE * sizeof(unsigned long));\n\
                \t\thave_xstate_support = 1;\n\
                \t}\n",
    },
];

/// What the kernel is built from, recorded beside it: another text means another kernel.
fn inputs() -> String {
    let mut text = format!("source: {SOURCE_PACKAGE}\n");
    for edit in SOURCE_EDITS {
        text += &format!("edit {}:\n{}=>\n{}", edit.file, edit.before, edit.after);
    }
    text + "config:\n" + CONFIG
}

fn inputs_file(kernel: &Path) -> PathBuf {
    kernel.with_extension("uml.inputs")
}

/// `None` when the kernel at [`uml::DEFAULT_KERNEL`] was built from today's inputs; otherwise
/// what is wrong with it.
pub fn is_current() -> Option<String> {
    let kernel = Path::new(uml::DEFAULT_KERNEL);
    if !kernel.is_file() {
        return Some("not built".to_owned());
    }
    match fs::read_to_string(inputs_file(kernel)) {
        Ok(recorded) if recorded == inputs() => None,
        _ => Some("built from other sources or settings".to_owned()),
    }
}

/// Downloads the source, builds the kernel and installs it at [`uml::DEFAULT_KERNEL`]. The
/// work directory is removed after a success and kept (and named) after a failure.
pub fn build() -> Result<()> {
    let work = PathBuf::from(format!("/var/tmp/vipr-uml-kernel-{}", std::process::id()));
    if work.exists() {
        fs::remove_dir_all(&work).with_context(|| format!("removing {}", work.display()))?;
    }
    fs::create_dir_all(&work).with_context(|| format!("creating {}", work.display()))?;
    eprintln!("building vipr's User-Mode Linux kernel in {} (about 4 minutes on 2 cores)", work.display());
    build_in(&work).with_context(|| format!("the build's files are kept in {}", work.display()))?;
    fs::remove_dir_all(&work).with_context(|| format!("removing {}", work.display()))
}

fn build_in(work: &Path) -> Result<()> {
    cmd::run(Command::new("apt-get").args(["download", SOURCE_PACKAGE]).current_dir(work))?;
    let package = only_entry(work, |name| name.starts_with(SOURCE_PACKAGE) && name.ends_with(".deb"))?;
    cmd::run(Command::new("dpkg-deb").arg("--extract").arg(&package).arg("package").current_dir(work))?;
    let tarball = only_entry(&work.join("package/usr/src"), |name| name.ends_with(".tar.xz"))?;
    cmd::run(Command::new("tar").arg("--extract").arg("--file").arg(&tarball).current_dir(work))?;
    let source = only_entry(work, |name| name.starts_with("linux-source-") && !name.ends_with(".deb"))?;
    for edit in SOURCE_EDITS {
        apply(&source, edit)?;
    }

    let out = work.join("out");
    let make = |target: &str| {
        let mut make = Command::new("make");
        // Quiet: the log gets the commands and any warning or error, not every file compiled.
        make.current_dir(&source).args(["-s", "ARCH=um"]).arg(format!("O={}", out.display())).arg(target);
        make
    };
    cmd::run(&mut make("tinyconfig"))?;
    // Later lines win in a .config: the fragment goes after tinyconfig's, and olddefconfig
    // settles what depends on it.
    let config_path = out.join(".config");
    let tiny = fs::read_to_string(&config_path).context("reading tinyconfig's .config")?;
    fs::write(&config_path, tiny + CONFIG).context("writing the merged .config")?;
    cmd::run(&mut make("olddefconfig"))?;
    let config = fs::read_to_string(&config_path).context("reading the final .config")?;
    let lost = options_not_kept(CONFIG, &config);
    ensure!(lost.is_empty(), "the kernel's configuration does not keep {}", lost.join(", "));

    let jobs = std::thread::available_parallelism().map_or(2, usize::from);
    cmd::run(make("linux").arg(format!("-j{jobs}")))?;

    let kernel = Path::new(uml::DEFAULT_KERNEL);
    let directory = kernel.parent().context("the kernel's path has no directory")?;
    fs::create_dir_all(directory).with_context(|| format!("creating {}", directory.display()))?;
    // Installed under a temporary name and renamed, so a kernel is never half written.
    let partial = kernel.with_extension("uml.partial");
    cmd::run(Command::new("strip").arg("-o").arg(&partial).arg(out.join("linux")))?;
    fs::rename(&partial, kernel).with_context(|| format!("installing {}", kernel.display()))?;
    fs::write(inputs_file(kernel), inputs()).context("recording the kernel's inputs")
}

/// The one entry of `directory` whose name matches.
fn only_entry(directory: &Path, matches: impl Fn(&str) -> bool) -> Result<PathBuf> {
    let mut found = Vec::new();
    for entry in fs::read_dir(directory).with_context(|| format!("reading {}", directory.display()))? {
        let entry = entry?;
        if entry.file_name().to_str().is_some_and(&matches) {
            found.push(entry.path());
        }
    }
    match found.as_slice() {
        [one] => Ok(one.clone()),
        _ => bail!("expected one matching entry in {}, found {found:?}", directory.display()),
    }
}

fn apply(source: &Path, edit: &SourceEdit) -> Result<()> {
    let path = source.join(edit.file);
    let text = fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    ensure!(
        text.matches(edit.before).count() == 1,
        "{} no longer has the text vipr's edit replaces (Debian's {SOURCE_PACKAGE} changed): update \
         xtask/src/uml_kernel.rs\n{}",
        path.display(),
        edit.before
    );
    fs::write(&path, text.replacen(edit.before, edit.after, 1))
        .with_context(|| format!("writing {}", path.display()))
}

/// The fragment's settings the final `.config` does not have: `CONFIG_X=n` must not be set,
/// any other value must be there as written.
fn options_not_kept(fragment: &str, config: &str) -> Vec<String> {
    let final_lines: Vec<&str> = config.lines().collect();
    fragment
        .lines()
        .map(str::trim)
        .filter(|line| line.starts_with("CONFIG_"))
        .filter(|line| match line.strip_suffix("=n") {
            Some(name) => final_lines.iter().any(|kept| kept.starts_with(&format!("{name}="))),
            None => !final_lines.contains(line),
        })
        .map(str::to_owned)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_setting_the_final_config_lost_is_named() {
        let fragment = "# comment\nCONFIG_A=y\nCONFIG_B=n\nCONFIG_C=\"null\"\nCONFIG_D=4\n";
        let config = "CONFIG_A=y\n# CONFIG_B is not set\nCONFIG_C=\"null\"\nCONFIG_D=2\n";
        assert_eq!(options_not_kept(fragment, config), ["CONFIG_D=4"]);
        let config = "CONFIG_B=y\nCONFIG_C=\"null\"\nCONFIG_D=4\n";
        assert_eq!(options_not_kept(fragment, config), ["CONFIG_A=y", "CONFIG_B=n"]);
    }

    #[test]
    fn an_edit_applies_once_and_a_changed_source_is_named() {
        let source = std::env::temp_dir().join(format!("vipr-uml-edit-{}", std::process::id()));
        let edit = SourceEdit { file: "a/b.c", before: "int x = 1;\n", after: "int x = 2;\n" };
        fs::create_dir_all(source.join("a")).unwrap();
        fs::write(source.join("a/b.c"), "/* x */\nint x = 1;\nint y;\n").unwrap();
        apply(&source, &edit).unwrap();
        let edited = fs::read_to_string(source.join("a/b.c")).unwrap();
        // Applied again, the text it replaces is gone: the error names the file.
        let again = apply(&source, &edit).unwrap_err().to_string();
        fs::remove_dir_all(&source).unwrap();
        assert_eq!(edited, "/* x */\nint x = 2;\nint y;\n");
        assert!(again.contains("a/b.c no longer has the text"), "{again}");
    }

    #[test]
    fn the_recorded_inputs_hold_the_edits_and_the_configuration() {
        assert!(inputs().contains(CONFIG));
        assert!(SOURCE_EDITS.iter().all(|edit| inputs().contains(edit.after)));
    }
}
