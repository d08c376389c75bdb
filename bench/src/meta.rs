//! What a result was measured with: command, date, machine, kernel, commit, load.

use std::process::Command;

use serde::{Deserialize, Serialize};

use super::sys;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RunMeta {
    /// The command the run was started with.
    pub command: String,
    /// UTC, RFC 3339.
    pub date: String,
    pub kernel: String,
    pub cpus: usize,
    pub cpu_model: String,
    pub memory_mib: u64,
    /// `git describe --always --dirty` of the working tree the run was started from.
    pub commit: String,
    /// 1-minute load average when the run started and ended (other work on the machine).
    pub load_start: Option<f64>,
    pub load_end: Option<f64>,
    pub quick: bool,
    /// Whether the benchmark binary (and the agent code it drives) was an optimized build.
    pub optimized: bool,
    /// The iptables programs and their variants, for suites that use them (None: not used).
    #[serde(default)]
    pub iptables: Option<String>,
}

impl RunMeta {
    pub fn start(command: String, quick: bool) -> Self {
        Self {
            command,
            date: jiff::Timestamp::now().round(jiff::Unit::Second).map(|t| t.to_string()).unwrap_or_default(),
            kernel: sys::kernel_release(),
            cpus: std::thread::available_parallelism().map_or(0, usize::from),
            cpu_model: sys::cpu_model(),
            memory_mib: sys::memory_total_mib(),
            commit: commit(),
            load_start: sys::load_average(),
            load_end: None,
            quick,
            optimized: !cfg!(debug_assertions),
            iptables: None,
        }
    }

    /// Records which iptables programs (and variants) the suite used.
    pub fn with_iptables(mut self, versions: String) -> Self {
        self.iptables = Some(versions);
        self
    }

    pub fn finish(&mut self) {
        self.load_end = sys::load_average();
    }
}

fn commit() -> String {
    Command::new("git")
        .args(["describe", "--always", "--dirty", "--abbrev=10"])
        .output()
        .ok()
        .filter(|output| output.status.success())
        .map(|output| String::from_utf8_lossy(&output.stdout).trim().to_owned())
        .filter(|commit| !commit.is_empty())
        .unwrap_or_else(|| "unknown".into())
}
