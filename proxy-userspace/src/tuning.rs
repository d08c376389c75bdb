//! The node and process settings kube-proxy applies once at start, applied the same way: the
//! process's OOM score adjustment (`--oom-score-adj`) and, in the modes that rely on the
//! kernel's netfilter conntrack (iptables, ipvs), its sysctls (`--conntrack-*`).
//!
//! Every path is a field of [`HostPaths`], so that the decisions are tested on a scratch
//! directory: nf_conntrack_max and the conntrack hash size are global to the machine, and a
//! test must never write them.
use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::Context as _;
use tracing::{info, warn};

use crate::settings::NetfilterConntrack;

/// Where the settings live.
#[derive(Clone, Debug)]
pub struct HostPaths {
    /// /proc/self/oom_score_adj.
    pub oom_score_adj: PathBuf,
    /// /proc/sys/net/netfilter: the conntrack sysctls (per network namespace, except
    /// nf_conntrack_max, which only the initial namespace may change).
    pub netfilter_sysctls: PathBuf,
    /// /sys/module/nf_conntrack/parameters/hashsize (global; the kernel refuses writes from
    /// other network namespaces).
    pub conntrack_hashsize: PathBuf,
}

impl Default for HostPaths {
    fn default() -> Self {
        Self {
            oom_score_adj: "/proc/self/oom_score_adj".into(),
            netfilter_sysctls: "/proc/sys/net/netfilter".into(),
            conntrack_hashsize: "/sys/module/nf_conntrack/parameters/hashsize".into(),
        }
    }
}

/// Writes the process's OOM score adjustment, as kube-proxy does at start.
pub fn set_oom_score_adj(paths: &HostPaths, value: i32) -> anyhow::Result<()> {
    std::fs::write(&paths.oom_score_adj, value.to_string())
        .with_context(|| format!("cannot write {value} to {}", paths.oom_score_adj.display()))
}

/// One sysctl change made (or due).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SysctlChange {
    pub path: PathBuf,
    pub value: u64,
}

/// Sets the netfilter conntrack sysctls as kube-proxy does: nf_conntrack_max to
/// `maxPerCore` × `cpus` (at least `min`) only when the kernel's is lower, raising the hash
/// size to a quarter of it when that is lower; the timeouts that are not zero, and
/// `tcp_be_liberal` when asked, wherever they differ. Returns what was changed; the first
/// failure stops and is returned (a read-only sysctl, as nf_conntrack_max is in a container's
/// network namespace, is such a failure).
pub fn apply_conntrack(
    paths: &HostPaths,
    settings: &NetfilterConntrack,
    cpus: u32,
) -> anyhow::Result<Vec<SysctlChange>> {
    let mut changes = Vec::new();
    if let Some(max) = settings.max_for(cpus) {
        let sysctl = paths.netfilter_sysctls.join("nf_conntrack_max");
        // Global: never lowered, since another user of the node may have raised it.
        if read_number(&sysctl)? < max {
            write_number(&sysctl, max, &mut changes)?;
            let hashsize = read_number(&paths.conntrack_hashsize)?;
            if hashsize < max / 4 {
                write_number(&paths.conntrack_hashsize, max / 4, &mut changes)?;
            }
        }
    }
    let seconds = |duration: Duration| (!duration.is_zero()).then_some(duration.as_secs());
    let wanted = [
        ("nf_conntrack_tcp_timeout_established", seconds(settings.tcp_established_timeout)),
        ("nf_conntrack_tcp_timeout_close_wait", seconds(settings.tcp_close_wait_timeout)),
        ("nf_conntrack_tcp_be_liberal", settings.tcp_be_liberal.then_some(1)),
        ("nf_conntrack_udp_timeout", seconds(settings.udp_timeout)),
        ("nf_conntrack_udp_timeout_stream", seconds(settings.udp_stream_timeout)),
    ];
    for (name, value) in wanted {
        let Some(value) = value else { continue };
        let sysctl = paths.netfilter_sysctls.join(name);
        if read_number(&sysctl)? != value {
            write_number(&sysctl, value, &mut changes)?;
        }
    }
    Ok(changes)
}

fn read_number(path: &Path) -> anyhow::Result<u64> {
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    text.trim().parse().with_context(|| format!("{}: {text:?} is not a number", path.display()))
}

fn write_number(path: &Path, value: u64, changes: &mut Vec<SysctlChange>) -> anyhow::Result<()> {
    std::fs::write(path, value.to_string())
        .with_context(|| format!("cannot write {value} to {}", path.display()))?;
    changes.push(SysctlChange { path: path.to_owned(), value });
    Ok(())
}

/// The CPUs this process may run on, as Go's `runtime.NumCPU` (kube-proxy's CPU count).
pub fn cpu_count() -> u32 {
    // SAFETY: sched_getaffinity fills the zeroed set it is given, of the size it is told.
    let count = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) == 0 {
            libc::CPU_COUNT(&set)
        } else {
            0
        }
    };
    u32::try_from(count).ok().filter(|count| *count > 0).unwrap_or(1)
}

/// Applies `--oom-score-adj` and, when `netfilter` (iptables and ipvs modes), the conntrack
/// sysctls; failures are logged (vipr keeps running, where kube-proxy would exit on a failed
/// nf_conntrack_max).
pub fn apply_at_start(oom_score_adj: i32, conntrack: Option<&NetfilterConntrack>) {
    let paths = HostPaths::default();
    match set_oom_score_adj(&paths, oom_score_adj) {
        Ok(()) => info!(oom_score_adj, "OOM score adjustment set"),
        Err(error) => warn!("{error:#}"),
    }
    if let Some(conntrack) = conntrack {
        match apply_conntrack(&paths, conntrack, cpu_count()) {
            Ok(changes) => {
                for change in changes {
                    info!(sysctl = %change.path.display(), value = change.value, "set");
                }
            }
            Err(error) => warn!("conntrack settings: {error:#}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A scratch directory standing for /proc and /sys, removed on drop.
    struct Scratch(PathBuf);

    impl Scratch {
        fn new(max: u64, hashsize: u64) -> (Self, HostPaths) {
            static COUNTER: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
            let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let root = std::env::temp_dir().join(format!("vipr-tuning-{}-{n}", std::process::id()));
            let sysctls = root.join("netfilter");
            std::fs::create_dir_all(&sysctls).unwrap();
            for (name, value) in [
                ("nf_conntrack_max", max),
                ("nf_conntrack_tcp_timeout_established", 432_000),
                ("nf_conntrack_tcp_timeout_close_wait", 60),
                ("nf_conntrack_tcp_be_liberal", 0),
                ("nf_conntrack_udp_timeout", 30),
                ("nf_conntrack_udp_timeout_stream", 120),
            ] {
                std::fs::write(sysctls.join(name), format!("{value}\n")).unwrap();
            }
            std::fs::write(root.join("hashsize"), format!("{hashsize}\n")).unwrap();
            std::fs::write(root.join("oom_score_adj"), "0\n").unwrap();
            let paths = HostPaths {
                oom_score_adj: root.join("oom_score_adj"),
                netfilter_sysctls: sysctls,
                conntrack_hashsize: root.join("hashsize"),
            };
            (Self(root), paths)
        }

        fn read(&self, name: &str) -> u64 {
            let path =
                if name == "hashsize" { self.0.join(name) } else { self.0.join("netfilter").join(name) };
            read_number(&path).unwrap()
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn conntrack_max_is_per_core_times_cpus_at_least_min_and_zero_leaves_it() {
        let settings = NetfilterConntrack::default();
        assert_eq!(settings.max_for(2), Some(131_072), "32768 × 2 is under the 131072 floor");
        assert_eq!(settings.max_for(8), Some(262_144));
        let kops = NetfilterConntrack { max_per_core: 131_072, ..settings };
        assert_eq!(kops.max_for(2), Some(262_144));
        assert_eq!(NetfilterConntrack { max_per_core: 0, ..settings }.max_for(64), None);
    }

    #[test]
    fn conntrack_max_is_only_ever_raised_with_the_hash_size() {
        let settings = NetfilterConntrack { max_per_core: 131_072, ..NetfilterConntrack::default() };
        let (scratch, paths) = Scratch::new(65_536, 16_384);
        apply_conntrack(&paths, &settings, 4).unwrap();
        assert_eq!(scratch.read("nf_conntrack_max"), 524_288);
        assert_eq!(scratch.read("hashsize"), 131_072);

        let (scratch, paths) = Scratch::new(1_048_576, 262_144);
        let changes = apply_conntrack(&paths, &settings, 4).unwrap();
        assert_eq!(scratch.read("nf_conntrack_max"), 1_048_576, "a higher global limit stays");
        assert!(changes.iter().all(|change| !change.path.ends_with("nf_conntrack_max")), "{changes:?}");

        let (scratch, paths) = Scratch::new(65_536, 500_000);
        apply_conntrack(&paths, &settings, 4).unwrap();
        assert_eq!(scratch.read("hashsize"), 500_000, "a larger hash table stays");
    }

    #[test]
    fn conntrack_timeouts_are_set_unless_zero_and_be_liberal_when_asked() {
        let (scratch, paths) = Scratch::new(1 << 30, 1 << 20);
        let settings = NetfilterConntrack {
            tcp_be_liberal: true,
            udp_timeout: Duration::from_secs(10),
            ..NetfilterConntrack::default()
        };
        let changes = apply_conntrack(&paths, &settings, 2).unwrap();
        assert_eq!(scratch.read("nf_conntrack_tcp_timeout_established"), 86_400);
        assert_eq!(scratch.read("nf_conntrack_tcp_timeout_close_wait"), 3600);
        assert_eq!(scratch.read("nf_conntrack_tcp_be_liberal"), 1);
        assert_eq!(scratch.read("nf_conntrack_udp_timeout"), 10);
        assert_eq!(scratch.read("nf_conntrack_udp_timeout_stream"), 120, "0 leaves the kernel's");
        assert_eq!(changes.len(), 4, "{changes:?}");
        assert!(apply_conntrack(&paths, &settings, 2).unwrap().is_empty(), "nothing to change twice");
    }

    #[test]
    fn a_read_only_sysctl_is_an_error_not_a_panic() {
        let (_scratch, mut paths) = Scratch::new(1, 1);
        paths.netfilter_sysctls = "/nonexistent/netfilter".into();
        assert!(apply_conntrack(&paths, &NetfilterConntrack::default(), 2).is_err());
    }

    #[test]
    fn the_oom_score_adjustment_is_written() {
        let (scratch, paths) = Scratch::new(1, 1);
        set_oom_score_adj(&paths, -998).unwrap();
        assert_eq!(std::fs::read_to_string(scratch.0.join("oom_score_adj")).unwrap(), "-998");
    }
}
