//! The benchmarks' own corner of the system: a private mount and network namespace, bpffs
//! mounts and cgroups that vanish with the process, raw `bpf()` calls (an empty TC program
//! and BPF_PROG_TEST_RUN), syscall counters, and what /proc says about the process and the
//! machine.

use std::{
    ffi::CString,
    fs,
    os::{
        fd::{AsRawFd as _, BorrowedFd, FromRawFd as _, OwnedFd},
        unix::ffi::OsStrExt as _,
    },
    path::{Path, PathBuf},
    process::Command,
    sync::atomic::{AtomicU32, Ordering},
};

use anyhow::{bail, ensure, Context as _, Result};

/// The node's address in the benchmark namespace, and the gateway of its default route.
pub const NODE_IP: [u8; 4] = [172, 16, 0, 1];
const NODE_CIDR: &str = "172.16.0.1/24";
const GATEWAY: &str = "172.16.0.2";
/// The veth pair the node has; vipr serves the first.
pub const DEVICE: &str = "vb0";
const PEER: &str = "vb1";

/// Moves this process into a mount namespace and a network namespace of its own, so every
/// bpffs it mounts and every device it creates disappear with it, however it ends. Must run
/// while the process has one thread (first thing in `main`).
pub fn isolate() -> Result<()> {
    // SAFETY: plain system calls on no memory of ours but NUL-terminated literals.
    unsafe {
        if libc::unshare(libc::CLONE_NEWNS | libc::CLONE_NEWNET) != 0 {
            return Err(std::io::Error::last_os_error())
                .context("unshare(CLONE_NEWNS | CLONE_NEWNET) (the benchmarks need root)");
        }
        if libc::mount(
            std::ptr::null(),
            c"/".as_ptr(),
            std::ptr::null(),
            libc::MS_REC | libc::MS_PRIVATE,
            std::ptr::null(),
        ) != 0
        {
            return Err(std::io::Error::last_os_error()).context("making / a private mount");
        }
    }
    Ok(())
}

/// The node's network in the (fresh) namespace: loopback, one veth pair with the node's
/// address, a default route through it and forwarding on, so that the TC program's route
/// lookup succeeds as on a node that forwards pod traffic.
pub fn set_up_network() -> Result<()> {
    ip(&["link", "set", "lo", "up"])?;
    ip(&["link", "add", DEVICE, "type", "veth", "peer", "name", PEER])?;
    ip(&["addr", "add", NODE_CIDR, "dev", DEVICE])?;
    ip(&["link", "set", DEVICE, "up"])?;
    ip(&["link", "set", PEER, "up"])?;
    ip(&["route", "add", "default", "via", GATEWAY, "dev", DEVICE])?;
    // /proc/sys/net is the namespace of the thread that opens it: ours.
    fs::write("/proc/sys/net/ipv4/ip_forward", "1").context("enabling forwarding")?;
    Ok(())
}

fn ip(args: &[&str]) -> Result<()> {
    let output = Command::new("ip").args(args).output().context("running ip (iproute2)")?;
    ensure!(
        output.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&output.stderr).trim()
    );
    Ok(())
}

fn unique(prefix: &str) -> String {
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    format!("{prefix}-{}-{}", std::process::id(), COUNTER.fetch_add(1, Ordering::Relaxed))
}

/// Leftovers `<prefix>-<pid>-<n>` in `dir` of processes that no longer exist.
fn leftovers(dir: &Path, prefix: &str) -> Vec<PathBuf> {
    let Ok(entries) = fs::read_dir(dir) else { return Vec::new() };
    entries
        .filter_map(|entry| entry.ok().map(|entry| entry.path()))
        .filter(|path| {
            let name = path.file_name().and_then(|name| name.to_str()).unwrap_or_default();
            let Some(rest) = name.strip_prefix(prefix).and_then(|rest| rest.strip_prefix('-')) else {
                return false;
            };
            let pid = rest.split('-').next().unwrap_or_default();
            pid.parse::<u32>().is_ok_and(|pid| !Path::new(&format!("/proc/{pid}")).exists())
        })
        .collect()
}

fn c_path(path: &Path) -> Result<CString> {
    CString::new(path.as_os_str().as_bytes()).context("path contains a NUL byte")
}

/// A fresh bpffs on a new directory under the temp dir. The mount lives in this process's
/// private mount namespace; dropping it unmounts it (releasing every pin) and removes the
/// directory.
pub struct BpfMount {
    path: PathBuf,
}

const BPFFS_PREFIX: &str = "vipr-bench-bpffs";

impl BpfMount {
    pub fn new() -> Result<Self> {
        // Directories of killed runs (their mounts died with their namespaces).
        for stale in leftovers(&std::env::temp_dir(), BPFFS_PREFIX) {
            let _ = fs::remove_dir(stale);
        }
        let path = std::env::temp_dir().join(unique(BPFFS_PREFIX));
        fs::create_dir(&path).with_context(|| format!("creating {}", path.display()))?;
        let target = c_path(&path)?;
        // SAFETY: NUL-terminated strings; bpffs takes no data.
        let rc =
            unsafe { libc::mount(c"bpf".as_ptr(), target.as_ptr(), c"bpf".as_ptr(), 0, std::ptr::null()) };
        if rc != 0 {
            let error = std::io::Error::last_os_error();
            let _ = fs::remove_dir(&path);
            return Err(error).with_context(|| format!("mount -t bpf bpf {}", path.display()));
        }
        Ok(Self { path })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for BpfMount {
    fn drop(&mut self) {
        if let Ok(target) = c_path(&self.path) {
            // SAFETY: NUL-terminated path. Lazy, so open pins cannot make it fail.
            unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) };
        }
        let _ = fs::remove_dir(&self.path);
    }
}

/// An empty cgroup v2 directory for vipr's socket-level hooks, so the benchmarks never attach
/// anything to the machine's root cgroup. Removed on drop.
pub struct PrivateCgroup {
    path: PathBuf,
}

const CGROUP_PREFIX: &str = "vipr-bench";

impl PrivateCgroup {
    pub fn new() -> Result<Self> {
        let mounts = fs::read_to_string("/proc/self/mounts").context("reading /proc/self/mounts")?;
        let root = mounts
            .lines()
            .find_map(|line| {
                let fields: Vec<&str> = line.split_whitespace().collect();
                (fields.get(2) == Some(&"cgroup2")).then(|| PathBuf::from(fields[1]))
            })
            .context("no cgroup2 file system is mounted")?;
        for stale in leftovers(&root, CGROUP_PREFIX) {
            let _ = fs::remove_dir(stale);
        }
        let path = root.join(unique(CGROUP_PREFIX));
        fs::create_dir(&path).with_context(|| format!("creating cgroup {}", path.display()))?;
        Ok(Self { path })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for PrivateCgroup {
    fn drop(&mut self) {
        if let Err(error) = fs::remove_dir(&self.path) {
            eprintln!("vipr-bench: cannot remove cgroup {}: {error}", self.path.display());
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Raw bpf(): an empty TC program and BPF_PROG_TEST_RUN.

use vipr::bpf_sys::{self, bpf, cmd, ProgLoadAttr, TestRunAttr};

const BPF_PROG_TYPE_SCHED_CLS: u32 = 3;

/// A TC classifier that only returns TC_ACT_UNSPEC: `r0 = -1; exit`. Loaded from two raw
/// instructions, so the baseline needs no BPF object of its own.
pub fn load_empty_tc_program() -> Result<OwnedFd> {
    // struct bpf_insn { u8 code; u8 dst:4, src:4; s16 off; s32 imm; } little-endian.
    let insn = |code: u8, imm: i32| -> u64 { u64::from(code) | (u64::from(imm as u32) << 32) };
    let insns = [insn(0xb7, -1), insn(0x95, 0)]; // BPF_ALU64|BPF_MOV|BPF_K r0; BPF_JMP|BPF_EXIT
    let license = c"GPL";
    let mut name = [0u8; 16];
    name[..10].copy_from_slice(b"bench_noop");
    let mut attr = ProgLoadAttr {
        prog_type: BPF_PROG_TYPE_SCHED_CLS,
        insn_cnt: insns.len() as u32,
        insns: insns.as_ptr() as u64,
        license: license.as_ptr() as u64,
        prog_name: name,
        ..ProgLoadAttr::default()
    };
    // SAFETY: the instructions, license and name outlive the call.
    let fd = unsafe { bpf(cmd::PROG_LOAD, &mut attr) }.and_then(bpf_sys::owned_fd);
    fd.context("loading the empty TC program")
}

/// One BPF_PROG_TEST_RUN.
#[derive(Clone, Copy, Debug)]
pub struct Run {
    pub verdict: u32,
    /// The kernel's measurement: ns per run, averaged over `repeat` runs.
    pub ns: u32,
    pub out_len: usize,
}

/// Runs `program` on `frame` `repeat` times in the kernel (one buffer for all of them, so a
/// rewriting program sees its own output from the second run on) and leaves the last output
/// in `out`.
pub fn test_run(program: BorrowedFd<'_>, frame: &[u8], out: &mut [u8], repeat: u32) -> Result<Run> {
    let mut attr = TestRunAttr {
        prog_fd: program.as_raw_fd() as u32,
        data_size_in: frame.len() as u32,
        data_size_out: out.len() as u32,
        data_in: frame.as_ptr() as u64,
        data_out: out.as_mut_ptr() as u64,
        repeat,
        ..TestRunAttr::default()
    };
    // SAFETY: the frame and the output buffer outlive the call, at the sizes given.
    unsafe { bpf(cmd::PROG_TEST_RUN, &mut attr) }.context("BPF_PROG_TEST_RUN")?;
    Ok(Run { verdict: attr.retval, ns: attr.duration, out_len: attr.data_size_out as usize })
}

// ---------------------------------------------------------------------------------------------
// Counting this thread's system calls with a tracepoint perf counter.

/// The first 64 bytes of `struct perf_event_attr` (PERF_ATTR_SIZE_VER0).
#[repr(C)]
#[derive(Default)]
struct PerfEventAttr {
    type_: u32,
    size: u32,
    config: u64,
    sample_period: u64,
    sample_type: u64,
    read_format: u64,
    flags: u64,
    wakeup_events: u32,
    bp_type: u32,
    config1: u64,
}

const PERF_TYPE_TRACEPOINT: u32 = 2;

/// Counts the calling thread's entries into a syscall tracepoint.
pub struct SyscallCounter {
    fd: OwnedFd,
}

impl SyscallCounter {
    /// `event` is a tracefs event such as `syscalls/sys_enter_bpf` or `raw_syscalls/sys_enter`.
    /// Needs tracefs, which is mounted in this process's private mount namespace if it is not.
    pub fn new(event: &str) -> Result<Self> {
        let tracefs = tracefs()?;
        let id_path = tracefs.join("events").join(event).join("id");
        let id: u64 = fs::read_to_string(&id_path)
            .with_context(|| format!("reading {}", id_path.display()))?
            .trim()
            .parse()
            .context("tracepoint id")?;
        let mut attr = PerfEventAttr {
            type_: PERF_TYPE_TRACEPOINT,
            size: size_of::<PerfEventAttr>() as u32,
            config: id,
            ..PerfEventAttr::default()
        };
        // SAFETY: valid attr; pid 0 and cpu -1: this thread on any CPU; no group; no flags.
        let fd =
            unsafe { libc::syscall(libc::SYS_perf_event_open, std::ptr::from_mut(&mut attr), 0, -1, -1, 0) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error()).with_context(|| format!("perf_event_open({event})"));
        }
        // SAFETY: a new descriptor nothing else owns.
        Ok(Self { fd: unsafe { OwnedFd::from_raw_fd(fd as i32) } })
    }

    pub fn read(&self) -> Result<u64> {
        let mut value = 0u64;
        // SAFETY: reads 8 bytes into `value`.
        let n = unsafe { libc::read(self.fd.as_raw_fd(), std::ptr::from_mut(&mut value).cast(), 8) };
        if n != 8 {
            bail!("reading a perf counter: {}", std::io::Error::last_os_error());
        }
        Ok(value)
    }
}

fn tracefs() -> Result<PathBuf> {
    for candidate in ["/sys/kernel/tracing", "/sys/kernel/debug/tracing"] {
        if Path::new(candidate).join("events").is_dir() {
            return Ok(candidate.into());
        }
    }
    let path = PathBuf::from("/sys/kernel/tracing");
    let target = c_path(&path)?;
    // SAFETY: NUL-terminated strings. The mount is private to this process's namespace.
    let rc =
        unsafe { libc::mount(c"nodev".as_ptr(), target.as_ptr(), c"tracefs".as_ptr(), 0, std::ptr::null()) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error()).context("mounting tracefs");
    }
    Ok(path)
}

// ---------------------------------------------------------------------------------------------
// The process and the machine.

/// A `kB` field of /proc/self/status (`VmRSS`, `VmHWM`), in KiB.
pub fn status_kib(field: &str) -> Result<u64> {
    let status = fs::read_to_string("/proc/self/status").context("reading /proc/self/status")?;
    status
        .lines()
        .find_map(|line| line.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|value| value.trim().trim_end_matches("kB").trim().parse().ok())
        .with_context(|| format!("no {field} in /proc/self/status"))
}

/// User and system CPU time of this process so far, in milliseconds.
pub fn cpu_ms() -> (f64, f64) {
    rusage_ms(libc::RUSAGE_SELF)
}

/// User and system CPU time of this process's waited-for children so far (the `nft`
/// processes a dataplane ran), in milliseconds.
pub fn children_cpu_ms() -> (f64, f64) {
    rusage_ms(libc::RUSAGE_CHILDREN)
}

/// `getrusage(who)`'s user and system time, in milliseconds.
fn rusage_ms(who: libc::c_int) -> (f64, f64) {
    // SAFETY: getrusage fills the struct it is given.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        libc::getrusage(who, &mut usage);
        usage
    };
    let ms = |tv: libc::timeval| tv.tv_sec as f64 * 1e3 + tv.tv_usec as f64 / 1e3;
    (ms(usage.ru_utime), ms(usage.ru_stime))
}

pub fn kernel_release() -> String {
    fs::read_to_string("/proc/sys/kernel/osrelease").map(|s| s.trim().to_owned()).unwrap_or_default()
}

pub fn cpu_model() -> String {
    fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|info| {
            info.lines().find_map(|line| {
                line.strip_prefix("model name")?.split_once(':').map(|(_, v)| v.trim().to_owned())
            })
        })
        .unwrap_or_else(|| "unknown".into())
}

pub fn memory_total_mib() -> u64 {
    fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|info| {
            info.lines().find_map(|line| {
                line.strip_prefix("MemTotal:")?.trim().trim_end_matches("kB").trim().parse::<u64>().ok()
            })
        })
        .map_or(0, |kib| kib / 1024)
}

/// The 1-minute load average.
pub fn load_average() -> Option<f64> {
    fs::read_to_string("/proc/loadavg").ok()?.split_whitespace().next()?.parse().ok()
}
