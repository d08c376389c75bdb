//! `testbed`: real-kernel network-namespace labs for vipr's end-to-end tests and demo.
//!
//! Everything here is an RAII guard that undoes itself on drop, including while a test
//! panics: namespaces ([`Netns`]), a star of veth links around a node namespace
//! ([`Topology`]), a private bpffs mount ([`BpfFs`]), the agent process ([`Vipr`]), backend
//! servers ([`EchoServer`]) and scratch directories ([`WorkDir`]). [`Lab`] puts them together
//! as client -> node (vipr) -> backends.
//!
//! Namespaces are entered with `setns()` in-process, never with `ip netns exec`, which
//! remounts /sys and would hide the bpffs that vipr pins into. Code that must run inside a
//! namespace goes through [`Netns::run`]; sockets it creates stay in that namespace and can be
//! used from any thread afterwards.
//!
//! A run that is killed (SIGKILL, a CI timeout) cannot run its guards: vipr still gets SIGTERM
//! as its parent dies, and the namespaces, mounts and directories it left are removed by the
//! next run that uses the same label. All of it needs root.

pub mod apiserver;
mod bpffs;
mod client;
pub mod cluster;
mod cmd;
pub mod conformance;
pub mod container;
mod echo;
pub mod ethtool;
mod exclusive;
pub mod fixtures;
pub mod http;
mod lab;
pub mod load;
pub mod manifest;
mod maps;
pub mod netfilter_lab;
mod netns;
mod pids;
pub mod sandbox;
pub mod sctp;
mod topology;
mod vipr;
mod workdir;

use std::{
    sync::atomic::{AtomicU32, Ordering},
    thread,
    time::{Duration, Instant},
};

use anyhow::{anyhow, bail, Context, Result};

pub use apiserver::FakeApiServer;
pub use bpffs::BpfFs;
pub use client::{
    count_by_backend, exchange, exchanges, int_option, set_int_option, tcp_exchange, udp_ask, udp_exchange,
    Answer, Exchange, TcpSession,
};
pub use echo::EchoServer;
pub use exclusive::{exclusive, Exclusive};
pub use lab::{Lab, LabConfig};
pub use manifest::{ClusterIpService, Endpoint, Frontend, Protocol, ServicePort};
pub use maps::{FlowEntry, PinnedMaps, ServiceEntry};
pub use netns::Netns;
pub use pids::PidsLimit;
pub use topology::{create_veth, Leaf, LeafSpec, Topology, VethEnd};
pub use vipr::{
    locate_previous_vipr, locate_vipr, uninstall_args, vipr_cleanup, wait_for_first_sync, Vipr, ViprConfig,
};
pub use workdir::{write_atomically, WorkDir};

/// A name no other lab in this or any concurrently running process uses: `prefix`, our pid
/// and a per-process counter. Used for namespaces, mount points and scratch directories, so
/// tests can run in parallel.
pub fn unique_name(prefix: &str) -> String {
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    format!("{prefix}-{}-{n}", std::process::id())
}

/// Whether `name` came from [`unique_name`] with `prefix` in a process that no longer exists:
/// the leftovers of a run that was killed before its guards could clean up.
fn left_by_dead_process(name: &str, prefix: &str) -> bool {
    let Some(rest) = name.strip_prefix(prefix).and_then(|rest| rest.strip_prefix('-')) else {
        return false;
    };
    let Some((pid, _)) = rest.split_once('-') else {
        return false;
    };
    pid.parse::<u32>().is_ok_and(|pid| !std::path::Path::new(&format!("/proc/{pid}")).exists())
}

/// Entries of the temp dir that [`left_by_dead_process`] with `prefix`.
fn temp_dir_leftovers(prefix: &str) -> Result<Vec<std::path::PathBuf>> {
    let temp = std::env::temp_dir();
    let mut leftovers = Vec::new();
    for entry in std::fs::read_dir(&temp).with_context(|| format!("cannot list {}", temp.display()))? {
        let path = entry?.path();
        if path
            .file_name()
            .and_then(|name| name.to_str())
            .is_some_and(|name| left_by_dead_process(name, prefix))
        {
            leftovers.push(path);
        }
    }
    Ok(leftovers)
}

/// Fails early with a readable message instead of a string of EPERMs.
pub fn require_root() -> Result<()> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        bail!("the vipr testbed creates namespaces, veths and bpffs mounts: run it as root");
    }
    Ok(())
}

/// Raises this process's soft limit on open files to at least `wanted` (and the hard limit
/// with it if needed, which root may), for tests that hold thousands of sockets.
pub fn raise_open_files_limit(wanted: u64) -> Result<()> {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes the struct we own.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return Err(std::io::Error::last_os_error()).context("getrlimit(RLIMIT_NOFILE)");
    }
    if limit.rlim_cur >= wanted {
        return Ok(());
    }
    limit.rlim_cur = wanted;
    limit.rlim_max = limit.rlim_max.max(wanted);
    // SAFETY: setrlimit reads the struct we own.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) } != 0 {
        return Err(std::io::Error::last_os_error())
            .context(format!("cannot raise RLIMIT_NOFILE to {wanted}"));
    }
    Ok(())
}

/// One look at a condition that [`wait_for`] polls.
pub enum Check<T> {
    Done(T),
    /// Not there yet; the text says what was seen, and ends up in the timeout error.
    NotYet(String),
}

/// Polls `probe` until it reports [`Check::Done`], for at most `timeout`. An `Err` from the
/// probe aborts at once (for conditions that can no longer come true, such as the agent
/// having exited).
pub fn wait_for<T>(what: &str, timeout: Duration, mut probe: impl FnMut() -> Result<Check<T>>) -> Result<T> {
    const POLL_INTERVAL: Duration = Duration::from_millis(50);
    let deadline = Instant::now() + timeout;
    loop {
        match probe()? {
            Check::Done(value) => return Ok(value),
            Check::NotYet(seen) if Instant::now() >= deadline => {
                return Err(anyhow!("timed out after {timeout:?} waiting for {what}; last seen: {seen}"));
            }
            Check::NotYet(_) => thread::sleep(POLL_INTERVAL),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_names_of_dead_processes_with_our_prefix_are_left_over() {
        let ours = unique_name("e2e");
        assert!(!left_by_dead_process(&ours, "e2e"), "we are alive");
        // Pids are below 2^22 on Linux.
        assert!(left_by_dead_process("e2e-99999999-0-node", "e2e"));
        assert!(!left_by_dead_process("e2e-spread-99999999-0-node", "e2e"));
        assert!(!left_by_dead_process("other-99999999-0-node", "e2e"));
    }
}
