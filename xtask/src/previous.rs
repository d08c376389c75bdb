//! The previous version of vipr, built from git for the upgrade test
//! (tests/tests/agent_upgrade.rs): a vipr whose map layouts are the ones the current vipr
//! retires, so that the test upgrades from programs that really serve the previous layout.
//!
//! The source of [`COMMIT`] is taken out of git (`git archive`) into
//! `target/previous-vipr/src`, built there into its own target directory
//! (`target/previous-vipr/target`: cargo names a workspace crate's artifacts by its path
//! relative to the workspace, the same for both checkouts, so in a shared target directory the
//! previous proxy-common would overwrite the current one — tried, it does),
//! and the binary copied to `target/previous-vipr/vipr`, with the commit beside it in
//! `vipr.commit`. A second run with the same commit does nothing.
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context as _, Result};

use crate::{cmd, Workspace};

/// The commit before the latest change of a map layout (`vipr_flow4_v3` -> `_v4`, the cached
/// next hop): its vipr serves the layouts the current one converts. Move it forward to the
/// commit before the next layout change, together with proxy-common's `legacy` module.
pub const COMMIT: &str = "72b163f79e77deca8d18e68830e8f27aec643f34";

/// Builds (or finds cached) the previous vipr; returns its path.
pub fn build(workspace: &Workspace) -> Result<PathBuf> {
    let dir = workspace.target_dir().join("previous-vipr");
    let binary = dir.join("vipr");
    let stamp = dir.join("vipr.commit");
    if binary.is_file() && std::fs::read_to_string(&stamp).is_ok_and(|built| built.trim() == COMMIT) {
        eprintln!("previous vipr ({COMMIT}): cached at {}", binary.display());
        return Ok(binary);
    }
    let present = Command::new("git")
        .current_dir(&workspace.root)
        .args(["cat-file", "-e", &format!("{COMMIT}^{{commit}}")])
        .status()
        .context("cannot run git")?;
    if !present.success() {
        bail!(
            "the previous version's commit {COMMIT} is not in this clone's history (a shallow clone?): \
             fetch it (`git fetch --unshallow` or `git fetch origin {COMMIT}`) so that the upgrade test \
             can build the previous vipr"
        );
    }
    let src = dir.join("src");
    if src.exists()
        && std::fs::read_to_string(dir.join("src.commit")).map(|c| c.trim() != COMMIT).unwrap_or(true)
    {
        std::fs::remove_dir_all(&src).with_context(|| format!("cannot remove {}", src.display()))?;
    }
    if !src.exists() {
        std::fs::create_dir_all(&src).with_context(|| format!("cannot create {}", src.display()))?;
        let archive = dir.join("src.tar");
        cmd::run(
            Command::new("git")
                .current_dir(&workspace.root)
                .args(["archive", "--format=tar", "-o"])
                .arg(&archive)
                .arg(COMMIT),
        )?;
        cmd::run(Command::new("tar").arg("-xf").arg(&archive).arg("-C").arg(&src))?;
        std::fs::remove_file(&archive)?;
        std::fs::write(dir.join("src.commit"), COMMIT)?;
    }
    cmd::run(Command::new("cargo").current_dir(&src).env("CARGO_TARGET_DIR", dir.join("target")).args([
        "build",
        "-p",
        "proxy-userspace",
        "--bin",
        "vipr",
    ]))?;
    install(&dir.join("target/debug/vipr"), &binary)?;
    std::fs::write(&stamp, COMMIT)?;
    eprintln!("previous vipr ({COMMIT}): built at {}", binary.display());
    Ok(binary)
}

/// Copies `built` to `binary` through a temporary file, so a cut-short copy is never taken for
/// a build.
fn install(built: &Path, binary: &Path) -> Result<()> {
    let partial = binary.with_extension("partial");
    std::fs::copy(built, &partial).with_context(|| format!("cannot copy {}", built.display()))?;
    std::fs::rename(&partial, binary).with_context(|| format!("cannot install {}", binary.display()))?;
    Ok(())
}
