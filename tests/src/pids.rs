//! A pids cgroup that caps how many tasks (processes and threads) a process may have, as a
//! container runtime's `pids.max` does, for tests that must show vipr living within one.
//!
//! Root ignores RLIMIT_NPROC (CAP_SYS_RESOURCE), so the cgroup is the only limit a test run as
//! root can rely on. The cgroup v1 pids hierarchy is used where it is mounted, else the cgroup
//! v2 root when its `cgroup.subtree_control` already delegates `pids` (nothing on the host's
//! configuration is changed to get one).
use std::path::{Path, PathBuf};

use anyhow::{bail, Context as _, Result};

use crate::{left_by_dead_process, unique_name};

const PREFIX: &str = "vipr-pids";

/// A child cgroup with a `pids.max`, removed on drop (its processes go back to the parent).
#[derive(Debug)]
pub struct PidsLimit {
    path: PathBuf,
}

impl PidsLimit {
    pub fn create(max: u32) -> Result<Self> {
        let parent = pids_hierarchy()?;
        remove_leftovers(&parent);
        let path = parent.join(unique_name(PREFIX));
        std::fs::create_dir(&path).with_context(|| format!("cannot create {}", path.display()))?;
        let limit = Self { path };
        limit.write("pids.max", &max.to_string())?;
        Ok(limit)
    }

    /// Moves `pid` (with all its threads) into the cgroup.
    pub fn add(&self, pid: u32) -> Result<()> {
        self.write("cgroup.procs", &pid.to_string())
    }

    /// Tasks in the cgroup now.
    pub fn current(&self) -> Result<u32> {
        let path = self.path.join("pids.current");
        let text =
            std::fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
        text.trim().parse().with_context(|| format!("{}: {text:?}", path.display()))
    }

    /// How often a fork or thread creation was refused because of the limit.
    pub fn refused(&self) -> Result<u64> {
        let path = self.path.join("pids.events");
        let text =
            std::fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
        Ok(text.lines().find_map(|line| line.strip_prefix("max ")?.trim().parse().ok()).unwrap_or(0))
    }

    fn write(&self, file: &str, value: &str) -> Result<()> {
        let path = self.path.join(file);
        std::fs::write(&path, value).with_context(|| format!("cannot write {value} to {}", path.display()))
    }
}

impl Drop for PidsLimit {
    fn drop(&mut self) {
        if let Err(error) = remove(&self.path) {
            eprintln!("testbed: {error:#}");
        }
    }
}

/// The directory to create pids cgroups in.
fn pids_hierarchy() -> Result<PathBuf> {
    let v1 = Path::new("/sys/fs/cgroup/pids");
    if v1.join("pids.max").exists() || v1.join("cgroup.procs").exists() {
        return Ok(v1.to_owned());
    }
    for v2 in ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"] {
        let subtree =
            std::fs::read_to_string(Path::new(v2).join("cgroup.subtree_control")).unwrap_or_default();
        if subtree.split_whitespace().any(|controller| controller == "pids") {
            return Ok(PathBuf::from(v2));
        }
    }
    bail!("no pids cgroup controller available (neither a v1 pids hierarchy nor a v2 root delegating pids)")
}

/// Moves what is left in `path` to its parent and removes it.
fn remove(path: &Path) -> Result<()> {
    let parent_procs = path.parent().context("a cgroup without parent")?.join("cgroup.procs");
    let procs = std::fs::read_to_string(path.join("cgroup.procs")).unwrap_or_default();
    for pid in procs.lines() {
        // A process that exited meanwhile cannot be moved, and need not be.
        let _ = std::fs::write(&parent_procs, pid);
    }
    std::fs::remove_dir(path).with_context(|| format!("cannot remove cgroup {}", path.display()))
}

fn remove_leftovers(parent: &Path) {
    let Ok(entries) = std::fs::read_dir(parent) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name();
        if name.to_str().is_some_and(|name| left_by_dead_process(name, PREFIX)) {
            let _ = remove(&entry.path());
        }
    }
}
