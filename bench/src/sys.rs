//! The benchmarks' own corner of the system: a private mount and network namespace, bpffs
//! mounts and cgroups that vanish with the process, raw `bpf()` calls (an empty TC program
//! and BPF_PROG_TEST_RUN), syscall counters, and what /proc says about the process and the
//! machine.

use std::{
    ffi::CString,
    fs,
    os::{
        fd::{AsFd as _, AsRawFd as _, BorrowedFd, FromRawFd as _, OwnedFd},
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
const GATEWAY_MAC: &str = "02:76:69:70:72:02";
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
    // The gateway's address resolved, as on a node that has been forwarding: the route's
    // neighbour is what a flow entry caches (with `--bpf-forwarding=redirect`), and a
    // neighbour the kernel does not know yet is resolved per packet instead.
    ip(&["link", "set", PEER, "address", GATEWAY_MAC])?;
    ip(&["neigh", "replace", GATEWAY, "lladdr", GATEWAY_MAC, "dev", DEVICE, "nud", "permanent"])?;
    // /proc/sys/net is the namespace of the thread that opens it: ours.
    fs::write("/proc/sys/net/ipv4/ip_forward", "1").context("enabling forwarding")?;
    Ok(())
}

/// The interface index of [`DEVICE`] in this thread's network namespace.
pub fn device_ifindex() -> Result<u32> {
    let name = CString::new(DEVICE)?;
    // SAFETY: a NUL-terminated name that outlives the call.
    let index = unsafe { libc::if_nametoindex(name.as_ptr()) };
    ensure!(index != 0, "no interface {DEVICE}: {}", std::io::Error::last_os_error());
    Ok(index)
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

/// This process, moved into a child cgroup of a [`PrivateCgroup`] that stands in for the
/// kubelet's pod cgroup (vipr's `--pods-cgroup`): its client threads in the labs' pod
/// namespaces are then pods to vipr's socket hooks, as a real pod's processes are. Dropping it
/// moves the process back where it was and removes the cgroup.
pub struct PodCgroup {
    path: PathBuf,
    /// The cgroup.procs of the cgroup the process came from.
    home: PathBuf,
}

impl PodCgroup {
    pub fn enter(parent: &PrivateCgroup) -> Result<Self> {
        let own = fs::read_to_string("/proc/self/cgroup").context("reading /proc/self/cgroup")?;
        let relative = own
            .lines()
            .find_map(|line| line.strip_prefix("0::"))
            .context("this process has no cgroup v2 membership")?;
        let root = parent.path().parent().context("the private cgroup has no parent")?;
        let home = root.join(relative.trim_start_matches('/')).join("cgroup.procs");
        let path = parent.path().join("pods");
        fs::create_dir(&path).with_context(|| format!("creating cgroup {}", path.display()))?;
        let pods = Self { path, home };
        // "0": the writing process, all its threads with it.
        fs::write(pods.path.join("cgroup.procs"), "0")
            .with_context(|| format!("entering {}", pods.path.display()))?;
        Ok(pods)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for PodCgroup {
    fn drop(&mut self) {
        if let Err(error) = fs::write(&self.home, "0") {
            eprintln!("vipr-bench: cannot return to {}: {error}", self.home.display());
        }
        if let Err(error) = fs::remove_dir(&self.path) {
            eprintln!("vipr-bench: cannot remove cgroup {}: {error}", self.path.display());
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Raw bpf(): an empty TC program and BPF_PROG_TEST_RUN.

use vipr::bpf_sys::{self, bpf, cmd, ProgLoadAttr, TestRunAttr};

const BPF_PROG_TYPE_SCHED_CLS: u32 = 3;
const BPF_PROG_TYPE_XDP: u32 = 6;

/// A TC classifier that only returns TC_ACT_UNSPEC: `r0 = -1; exit`. Loaded from two raw
/// instructions, so the baseline needs no BPF object of its own.
pub fn load_empty_tc_program() -> Result<OwnedFd> {
    bpf_sys::load_program(BPF_PROG_TYPE_SCHED_CLS, 0, &bpf_sys::returning(-1), "bench_noop")
        .context("loading the empty TC program")
}

/// An XDP program that only returns XDP_PASS (2): the baseline of XDP measurements, as
/// [`load_empty_tc_program`] is TC's.
pub fn load_empty_xdp_program() -> Result<OwnedFd> {
    bpf_sys::load_program(BPF_PROG_TYPE_XDP, 0, &bpf_sys::returning(2), "bench_xdp_noop")
        .context("loading the empty XDP program")
}

/// The floor: a TC classifier that does only the work no load balancer can avoid for an
/// established connection's packet, and nothing else (no state, no counters, no route
/// lookup): parse Ethernet, IPv4 (no options) and TCP; one hash lookup of the connection's
/// 5-tuple; the destination address and port rewritten with the kernel's checksum helpers,
/// as vipr rewrites them; `bpf_redirect` to the interface the entry names. vipr's paths are
/// stated as multiples of it (issue 16). Assembled from raw instructions like the empty
/// program, so that neither the compiler nor vipr's object shapes it.
///
/// The new-flow floor ([`FloorProgram::load_new_flow`]) is the least a load balancer that
/// keeps its connections on their backends does for a connection's first packet: the floor's
/// work, with its map as the service table, plus a connection table looked up first (a miss)
/// and the connection recorded in it (one insert, no reply entry, no reverse NAT). A
/// connection it already recorded goes on as the floor's established packet.
pub struct FloorProgram {
    // The program holds its own reference to the maps; all close on drop.
    pub program: OwnedFd,
    map: OwnedFd,
    /// The new-flow floor's connection table.
    connections: Option<OwnedFd>,
}

/// The floor map's key: the packet's 5-tuple as it lies in the headers (addresses and ports
/// in network order), the protocol, and padding.
pub type FloorKey = [u8; 16];
/// The floor map's value: the new destination address and port (network order), padding,
/// and the redirect's interface index (host order).
pub type FloorValue = [u8; 12];

impl FloorProgram {
    /// The floor, with room for `max_entries` connections in its map.
    pub fn load(max_entries: u32) -> Result<Self> {
        let map = floor_map(max_entries).context("creating the floor program's map")?;
        let program = load_raw_program(
            BPF_PROG_TYPE_SCHED_CLS,
            "bench_floor",
            &floor_instructions(map.as_raw_fd(), None),
        )?;
        Ok(Self { program, map, connections: None })
    }

    /// The new-flow floor, with room for `max_entries` entries in its service table (filled by
    /// [`FloorProgram::insert`]) and `connections` in its connection table.
    pub fn load_new_flow(max_entries: u32, connections: u32) -> Result<Self> {
        let map = floor_map(max_entries).context("creating the new-flow floor's service table")?;
        let table = floor_map(connections).context("creating the new-flow floor's connection table")?;
        let program = load_raw_program(
            BPF_PROG_TYPE_SCHED_CLS,
            "bench_floor_new",
            &floor_instructions(map.as_raw_fd(), Some(table.as_raw_fd())),
        )?;
        Ok(Self { program, map, connections: Some(table) })
    }

    /// Removes the new-flow floor's connections from `from` to each of `to` (TCP); an error
    /// unless every one of them was there.
    pub fn forget_connections(&self, from: ([u8; 4], u16), to: &[([u8; 4], u16)]) -> Result<()> {
        let table = self.connections.as_ref().context("the floor program has no connection table")?;
        for &to in to {
            // SAFETY: a `FloorKey`, the table's key size.
            let found = unsafe { bpf_sys::delete(table.as_fd(), &floor_key(from, to)) }
                .context("removing a connection of the new-flow floor")?;
            ensure!(found, "the new-flow floor recorded no connection from {from:?} to {to:?}");
        }
        Ok(())
    }

    /// Maps the TCP connection `from` -> `to` to the destination `new_to`, sent out of
    /// interface `ifindex`.
    pub fn insert(
        &self,
        from: ([u8; 4], u16),
        to: ([u8; 4], u16),
        new_to: ([u8; 4], u16),
        ifindex: u32,
    ) -> Result<()> {
        let key = floor_key(from, to);
        let mut value = [0u8; 12];
        value[0..4].copy_from_slice(&new_to.0);
        value[4..6].copy_from_slice(&new_to.1.to_be_bytes());
        value[8..12].copy_from_slice(&ifindex.to_ne_bytes());
        // SAFETY: a `FloorKey` and a `FloorValue`, the sizes the map was created with.
        unsafe { bpf_sys::update(self.map.as_fd(), &key, &value, 0) }
            .context("filling the floor program's map")
    }
}

/// A hash map of [`FloorKey`] to [`FloorValue`] (preallocated, as vipr's flows map).
fn floor_map(max_entries: u32) -> Result<OwnedFd> {
    const BPF_MAP_TYPE_HASH: u32 = 1;
    let mut attr = bpf_sys::MapCreateAttr {
        map_type: BPF_MAP_TYPE_HASH,
        key_size: size_of::<FloorKey>() as u32,
        value_size: size_of::<FloorValue>() as u32,
        max_entries,
        map_flags: 0,
    };
    // SAFETY: a plain attribute struct, read by the kernel during the call.
    Ok(unsafe { bpf(cmd::MAP_CREATE, &mut attr) }.and_then(bpf_sys::owned_fd)?)
}

/// The floor maps' key of the TCP connection `from` -> `to`.
fn floor_key(from: ([u8; 4], u16), to: ([u8; 4], u16)) -> FloorKey {
    let mut key = [0u8; 16];
    key[0..4].copy_from_slice(&from.0);
    key[4..8].copy_from_slice(&to.0);
    key[8..10].copy_from_slice(&from.1.to_be_bytes());
    key[10..12].copy_from_slice(&to.1.to_be_bytes());
    key[12] = 6; // TCP
    key
}

/// Loads a program from raw instructions; the verifier's log is in the error.
fn load_raw_program(prog_type: u32, name: &str, insns: &[u64]) -> Result<OwnedFd> {
    let license = c"GPL";
    let mut prog_name = [0u8; 16];
    let len = name.len().min(15);
    prog_name[..len].copy_from_slice(&name.as_bytes()[..len]);
    let mut log = vec![0u8; 64 * 1024];
    let mut attr = ProgLoadAttr {
        prog_type,
        insn_cnt: insns.len() as u32,
        insns: insns.as_ptr() as u64,
        license: license.as_ptr() as u64,
        log_level: 1,
        log_size: log.len() as u32,
        log_buf: log.as_mut_ptr() as u64,
        prog_name,
        ..ProgLoadAttr::default()
    };
    // SAFETY: the instructions, license, name and log buffer outlive the call.
    unsafe { bpf(cmd::PROG_LOAD, &mut attr) }.and_then(bpf_sys::owned_fd).map_err(|error| {
        let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
        anyhow::anyhow!("loading the {name} program: {error}\n{}", String::from_utf8_lossy(&log[..end]))
    })
}

/// A sink for the e2e suite's frame stream that only counts: an XDP program for a backend's
/// veth that counts the UDP datagrams to one port in a per-CPU array and drops them, and
/// passes everything else. With it at the backends, no socket, skb or receive path of theirs
/// is in the measurement, so what a packet costs is the sender's and the node's work (issue
/// 16: the node's own cost with XDP against TC).
pub struct XdpCountDrop {
    program: OwnedFd,
    map: OwnedFd,
}

impl XdpCountDrop {
    pub fn load(udp_port: u16) -> Result<Self> {
        const BPF_MAP_TYPE_PERCPU_ARRAY: u32 = 6;
        let mut attr = bpf_sys::MapCreateAttr {
            map_type: BPF_MAP_TYPE_PERCPU_ARRAY,
            key_size: 4,
            value_size: 8,
            max_entries: 1,
            map_flags: 0,
        };
        // SAFETY: a plain attribute struct, read by the kernel during the call.
        let map = unsafe { bpf(cmd::MAP_CREATE, &mut attr) }
            .and_then(bpf_sys::owned_fd)
            .context("creating the drop sink's counter")?;
        let insns = count_drop_instructions(map.as_raw_fd(), udp_port);
        let program = load_raw_program(BPF_PROG_TYPE_XDP, "bench_drop", &insns)?;
        Ok(Self { program, map })
    }

    /// Pins the program at `path` (in a bpffs), for `ip link set ... xdpdrv pinned`.
    pub fn pin(&self, path: &Path) -> Result<()> {
        /// `BPF_OBJ_PIN`'s attributes.
        #[repr(C)]
        struct ObjPinAttr {
            pathname: u64,
            bpf_fd: u32,
            file_flags: u32,
        }
        const BPF_OBJ_PIN: libc::c_long = 6;
        let path_c = c_path(path)?;
        let mut attr = ObjPinAttr {
            pathname: path_c.as_ptr() as u64,
            bpf_fd: self.program.as_raw_fd() as u32,
            file_flags: 0,
        };
        // SAFETY: the path outlives the call.
        unsafe { bpf(BPF_OBJ_PIN, &mut attr) }
            .with_context(|| format!("pinning the drop sink at {}", path.display()))?;
        Ok(())
    }

    /// Datagrams counted and dropped so far, all CPUs.
    pub fn count(&self) -> Result<u64> {
        let cpus = aya::util::nr_cpus().map_err(|(what, error)| anyhow::anyhow!("{what}: {error}"))?;
        let mut values = vec![0u8; 8 * cpus];
        // SAFETY: the per-CPU array's u32 index and u64 counter, one per possible CPU.
        unsafe { bpf_sys::lookup(self.map.as_fd(), &0u32.to_ne_bytes(), &mut values) }
            .context("reading the drop sink's counter")?;
        Ok(values.chunks_exact(8).map(|value| u64::from_ne_bytes(value.try_into().expect("8 bytes"))).sum())
    }
}

/// The drop sink's instructions (see [`XdpCountDrop`]): UDP over IPv4 without options or over
/// IPv6 without extension headers.
fn count_drop_instructions(map_fd: i32, udp_port: u16) -> Vec<u64> {
    use op::*;
    const XDP_DROP: i32 = 1;
    const XDP_PASS: i32 = 2;
    let (r0, r1, r2, r3, r4, r5, fp) = (0, 1, 2, 3, 4, 5, 10);
    // The port as it lies in the packet (network order), read as a little-endian half word;
    // IPv6's ethertype the same way.
    let port = i32::from(u16::from_le_bytes(udp_port.to_be_bytes()));
    let ipv6 = i32::from(u16::from_le_bytes(0x86ddu16.to_be_bytes()));
    let mut code = vec![
        insn(LDX_W, r2, r1, 0, 0), // xdp_md.data
        insn(LDX_W, r3, r1, 4, 0), // xdp_md.data_end
        insn(MOV_X, r4, r2, 0, 0),
        insn(ADD_K, r4, 0, 0, 42), // Ethernet, IPv4 without options, UDP
        insn(JGT_X, r4, r3, 0, 0), // 4: short: pass
        insn(LDX_H, r5, r2, 12, 0),
        insn(JEQ_K, r5, 0, 0, ipv6),   // 6: IPv6
        insn(JNE_K, r5, 0, 0, 0x0008), // 7: not IPv4
        insn(LDX_B, r5, r2, 14, 0),
        insn(JNE_K, r5, 0, 0, 0x45), // 9: IPv4 options
        insn(LDX_B, r5, r2, 23, 0),
        insn(JNE_K, r5, 0, 0, 17), // 11: not UDP
        insn(LDX_H, r5, r2, 36, 0),
        insn(JNE_K, r5, 0, 0, port), // 13: another port
        insn(JA, 0, 0, 0, 0),        // 14: count
    ];
    let v6 = code.len();
    code.extend([
        insn(ADD_K, r4, 0, 0, 20), // Ethernet, IPv6, UDP: 20 bytes more
        insn(JGT_X, r4, r3, 0, 0), // 16: short: pass
        insn(LDX_B, r5, r2, 20, 0),
        insn(JNE_K, r5, 0, 0, 17), // 18: not UDP (or an extension header)
        insn(LDX_H, r5, r2, 56, 0),
        insn(JNE_K, r5, 0, 0, port), // 20: another port
    ]);
    let counting = code.len();
    code.extend([
        insn(ST_W, fp, 0, -4, 0),
        insn(LD_IMM64, r1, PSEUDO_MAP_FD, 0, map_fd),
        0,
        insn(MOV_X, r2, fp, 0, 0),
        insn(ADD_K, r2, 0, 0, -4),
        insn(CALL, 0, 0, 0, MAP_LOOKUP_ELEM),
        insn(JEQ_K, r0, 0, 0, 0), // counting + 6
        insn(LDX_DW, r1, r0, 0, 0),
        insn(ADD_K, r1, 0, 0, 1),
        insn(STX_DW, r0, r1, 0, 0),
        insn(MOV_K, r0, 0, 0, XDP_DROP),
        insn(EXIT, 0, 0, 0, 0),
    ]);
    let pass = code.len();
    code.push(insn(MOV_K, r0, 0, 0, XDP_PASS));
    code.push(insn(EXIT, 0, 0, 0, 0));
    jump_to(&mut code, &[6], v6);
    jump_to(&mut code, &[14], counting);
    jump_to(&mut code, &[4, 7, 9, 11, 13, 16, 18, 20, counting + 6], pass);
    code
}

/// Opcodes of the BPF instruction set (loads and stores by size, 64-bit ALU, jumps, calls) and
/// the one helper both raw programs call.
mod op {
    pub const LDX_W: u8 = 0x61;
    pub const LDX_H: u8 = 0x69;
    pub const LDX_B: u8 = 0x71;
    pub const LDX_DW: u8 = 0x79;
    pub const STX_W: u8 = 0x63;
    pub const STX_DW: u8 = 0x7b;
    pub const ST_W: u8 = 0x62;
    pub const MOV_K: u8 = 0xb7;
    pub const MOV_X: u8 = 0xbf;
    pub const ADD_K: u8 = 0x07;
    pub const JGT_X: u8 = 0x2d;
    pub const JNE_K: u8 = 0x55;
    pub const JEQ_K: u8 = 0x15;
    pub const JA: u8 = 0x05;
    pub const CALL: u8 = 0x85;
    pub const EXIT: u8 = 0x95;
    /// Two instruction slots: a 64-bit immediate (with `PSEUDO_MAP_FD`, a map's descriptor).
    pub const LD_IMM64: u8 = 0x18;
    pub const PSEUDO_MAP_FD: u8 = 1;
    pub const MAP_LOOKUP_ELEM: i32 = 1;
    pub const MAP_UPDATE_ELEM: i32 = 2;
}

/// Points the jumps (conditional or not) at indexes `at` to instruction `target` (offsets
/// count from the next instruction).
fn jump_to(code: &mut [u64], at: &[usize], target: usize) {
    for &at in at {
        let off = (target - at - 1) as i16;
        code[at] |= u64::from(off as u16) << 16;
    }
}

/// One instruction: `struct bpf_insn { u8 code; u8 dst:4, src:4; s16 off; s32 imm; }`.
fn insn(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> u64 {
    u64::from(code)
        | (u64::from(dst | (src << 4)) << 8)
        | (u64::from(off as u16) << 16)
        | (u64::from(imm as u32) << 32)
}

/// The floor program's instructions (see [`FloorProgram`]), its map's descriptor built in;
/// with a connection table's, the new-flow floor's.
fn floor_instructions(map_fd: i32, connections: Option<i32>) -> Vec<u64> {
    use op::*;
    // Helpers.
    const SKB_STORE_BYTES: i32 = 9;
    const L3_CSUM_REPLACE: i32 = 10;
    const L4_CSUM_REPLACE: i32 = 11;
    const REDIRECT: i32 = 23;
    const BPF_F_PSEUDO_HDR: i32 = 0x10;
    // `struct __sk_buff`: data and data_end.
    const SKB_DATA: i16 = 76;
    const SKB_DATA_END: i16 = 80;
    // Frame offsets: Ethernet 14, IPv4 without options 20, TCP.
    const ETHERTYPE: i16 = 12;
    const VERSION_IHL: i16 = 14;
    const PROTOCOL: i16 = 23;
    const IP_CSUM: i32 = 24;
    const SADDR: i16 = 26;
    const DADDR: i16 = 30;
    const PORTS: i16 = 34;
    const DPORT: i16 = 36;
    const TCP_CSUM: i32 = 50;
    const HEADERS: i32 = 54;
    let (r0, r1, r2, r3, r4, r5, r6, r7, r8, r9, fp) = (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10);
    let mut code = vec![
        insn(MOV_X, r6, r1, 0, 0),            // r6 = skb
        insn(LDX_W, r2, r6, SKB_DATA, 0),     // r2 = data
        insn(LDX_W, r3, r6, SKB_DATA_END, 0), // r3 = data_end
        insn(MOV_X, r4, r2, 0, 0),
        insn(ADD_K, r4, 0, 0, HEADERS),
        insn(JGT_X, r4, r3, 0, 0), // 5: past the end: pass (offset set below)
        insn(LDX_H, r5, r2, ETHERTYPE, 0),
        insn(JNE_K, r5, 0, 0, 0x0008), // 7: not IPv4 (0x0800 read little-endian)
        insn(LDX_B, r5, r2, VERSION_IHL, 0),
        insn(JNE_K, r5, 0, 0, 0x45), // 9: options: pass
        insn(LDX_B, r5, r2, PROTOCOL, 0),
        insn(JNE_K, r5, 0, 0, 6), // 11: not TCP
        // The key on the stack: addresses, ports, protocol and zero padding.
        insn(LDX_W, r5, r2, SADDR, 0),
        insn(STX_W, fp, r5, -16, 0),
        insn(LDX_W, r7, r2, DADDR, 0), // r7 = old destination address
        insn(STX_W, fp, r7, -12, 0),
        insn(LDX_W, r5, r2, PORTS, 0),
        insn(STX_W, fp, r5, -8, 0),
        insn(ST_W, fp, 0, -4, 6),
        insn(LDX_H, r8, r2, DPORT, 0), // r8 = old destination port
    ];
    // Conditional jumps to `pass`: too short, not IPv4, IPv4 options, not TCP.
    let mut to_pass = vec![5, 7, 9, 11];
    // r1 = the map, r2 = the key on the stack.
    let map_and_key = |map: i32| {
        [insn(LD_IMM64, r1, PSEUDO_MAP_FD, 0, map), 0, insn(MOV_X, r2, fp, 0, 0), insn(ADD_K, r2, 0, 0, -16)]
    };
    let mut to_rewrite = Vec::new();
    if let Some(table) = connections {
        code.extend(map_and_key(table));
        code.push(insn(CALL, 0, 0, 0, MAP_LOOKUP_ELEM));
        // A miss goes on to the service table (past the next two instructions); a connection
        // recorded goes to the rewrite with its entry, as the floor's established packet.
        code.push(insn(JEQ_K, r0, 0, 2, 0));
        code.push(insn(MOV_X, r9, r0, 0, 0));
        to_rewrite.push(code.len());
        code.push(insn(JA, 0, 0, 0, 0));
    }
    code.extend(map_and_key(map_fd));
    code.push(insn(CALL, 0, 0, 0, MAP_LOOKUP_ELEM));
    to_pass.push(code.len());
    code.push(insn(JEQ_K, r0, 0, 0, 0)); // no entry: pass
    code.push(insn(MOV_X, r9, r0, 0, 0)); // r9 = the entry
    if let Some(table) = connections {
        // The new connection recorded with the service's entry (BPF_ANY); a full table passes.
        code.extend(map_and_key(table));
        code.push(insn(MOV_X, r3, r9, 0, 0));
        code.push(insn(MOV_K, r4, 0, 0, 0));
        code.push(insn(CALL, 0, 0, 0, MAP_UPDATE_ELEM));
        to_pass.push(code.len());
        code.push(insn(JNE_K, r0, 0, 0, 0));
    }
    let rewrite = code.len();
    code.extend([
        // The IPv4 header checksum, then the TCP checksum (pseudo header), for the address.
        insn(MOV_X, r1, r6, 0, 0),
        insn(MOV_K, r2, 0, 0, IP_CSUM),
        insn(MOV_X, r3, r7, 0, 0),
        insn(LDX_W, r4, r9, 0, 0),
        insn(MOV_K, r5, 0, 0, 4),
        insn(CALL, 0, 0, 0, L3_CSUM_REPLACE),
        insn(MOV_X, r1, r6, 0, 0),
        insn(MOV_K, r2, 0, 0, TCP_CSUM),
        insn(MOV_X, r3, r7, 0, 0),
        insn(LDX_W, r4, r9, 0, 0),
        insn(MOV_K, r5, 0, 0, BPF_F_PSEUDO_HDR | 4),
        insn(CALL, 0, 0, 0, L4_CSUM_REPLACE),
        // The TCP checksum for the port.
        insn(MOV_X, r1, r6, 0, 0),
        insn(MOV_K, r2, 0, 0, TCP_CSUM),
        insn(MOV_X, r3, r8, 0, 0),
        insn(LDX_H, r4, r9, 4, 0),
        insn(MOV_K, r5, 0, 0, 2),
        insn(CALL, 0, 0, 0, L4_CSUM_REPLACE),
        // The new address and port into the packet.
        insn(MOV_X, r1, r6, 0, 0),
        insn(MOV_K, r2, 0, 0, i32::from(DADDR)),
        insn(MOV_X, r3, r9, 0, 0),
        insn(MOV_K, r4, 0, 0, 4),
        insn(MOV_K, r5, 0, 0, 0),
        insn(CALL, 0, 0, 0, SKB_STORE_BYTES),
        insn(MOV_X, r1, r6, 0, 0),
        insn(MOV_K, r2, 0, 0, i32::from(DPORT)),
        insn(MOV_X, r3, r9, 0, 0),
        insn(ADD_K, r3, 0, 0, 4),
        insn(MOV_K, r4, 0, 0, 2),
        insn(MOV_K, r5, 0, 0, 0),
        insn(CALL, 0, 0, 0, SKB_STORE_BYTES),
        // Out of the entry's interface.
        insn(LDX_W, r1, r9, 8, 0),
        insn(MOV_K, r2, 0, 0, 0),
        insn(CALL, 0, 0, 0, REDIRECT),
        insn(EXIT, 0, 0, 0, 0),
    ]);
    // pass: TC_ACT_OK.
    let pass = code.len();
    code.push(insn(MOV_K, r0, 0, 0, 0));
    code.push(insn(EXIT, 0, 0, 0, 0));
    jump_to(&mut code, &to_pass, pass);
    jump_to(&mut code, &to_rewrite, rewrite);
    code
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
    test_run_in(program, frame, out, repeat, &[])
}

/// [`test_run`] of an XDP program on a frame received on interface `ifindex` (`struct
/// xdp_md`'s `ingress_ifindex`: where `XDP_TX` sends it, and what its FIB lookups start from).
pub fn test_run_xdp(
    program: BorrowedFd<'_>,
    frame: &[u8],
    out: &mut [u8],
    repeat: u32,
    ifindex: u32,
) -> Result<Run> {
    // struct xdp_md: data, data_end (the frame's length), data_meta, ingress_ifindex, ...
    let mut ctx = [0u8; 24];
    ctx[4..8].copy_from_slice(&(frame.len() as u32).to_ne_bytes());
    ctx[12..16].copy_from_slice(&ifindex.to_ne_bytes());
    test_run_in(program, frame, out, repeat, &ctx)
}

/// [`test_run`] with a context (`ctx`, empty for none).
fn test_run_in(
    program: BorrowedFd<'_>,
    frame: &[u8],
    out: &mut [u8],
    repeat: u32,
    ctx: &[u8],
) -> Result<Run> {
    let mut attr = TestRunAttr {
        prog_fd: program.as_raw_fd() as u32,
        data_size_in: frame.len() as u32,
        data_size_out: out.len() as u32,
        data_in: frame.as_ptr() as u64,
        data_out: out.as_mut_ptr() as u64,
        repeat,
        ctx_size_in: ctx.len() as u32,
        ctx_in: if ctx.is_empty() { 0 } else { ctx.as_ptr() as u64 },
        ..TestRunAttr::default()
    };
    // SAFETY: the frame, the output buffer and the context outlive the call, at the sizes given.
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

#[cfg(test)]
mod tests {
    use std::net::{Ipv4Addr, Ipv6Addr};

    use super::*;
    use crate::{frame, load};

    /// The floor does the rewrite it stands for: the frame it returns is, byte for byte, the
    /// one a client would have sent to the new destination (checksums included), and a packet
    /// without an entry passes untouched. Needs root (BPF).
    #[test]
    fn the_floor_program_rewrites_the_destination_and_redirects() {
        let floor = FloorProgram::load(4).expect("loading the floor program");
        let client = (Ipv4Addr::new(10, 1, 0, 1), 40_001);
        let frontend = (Ipv4Addr::new(10, 96, 0, 1), 80);
        let backend = (Ipv4Addr::new(10, 2, 0, 7), 8080);
        floor
            .insert(
                (client.0.octets(), client.1),
                (frontend.0.octets(), frontend.1),
                (backend.0.octets(), backend.1),
                1,
            )
            .unwrap();
        let mut out = vec![0u8; 256];
        let run = test_run(floor.program.as_fd(), &frame::tcp(client, frontend), &mut out, 1).unwrap();
        assert_eq!(run.verdict, 7, "TC_ACT_REDIRECT");
        assert_eq!(out[..run.out_len], frame::tcp(client, backend)[..]);
        let other = frame::tcp(client, (frontend.0, 81));
        let run = test_run(floor.program.as_fd(), &other, &mut out, 1).unwrap();
        assert_eq!(run.verdict, 0, "TC_ACT_OK");
        assert_eq!(out[..run.out_len], other[..]);
    }

    /// The new-flow floor records a connection's first packet and sends its later packets by
    /// that record, even when the service's entry changes.
    #[test]
    fn the_new_flow_floor_records_a_connection_and_keeps_it_on_its_backend() {
        let floor = FloorProgram::load_new_flow(4, 4).expect("loading the new-flow floor");
        let client = (Ipv4Addr::new(10, 1, 0, 1), 40_001);
        let frontend = (Ipv4Addr::new(10, 96, 0, 1), 80);
        let (first, second) = ((Ipv4Addr::new(10, 2, 0, 7), 8080), (Ipv4Addr::new(10, 2, 0, 8), 8080));
        let to = |backend: (Ipv4Addr, u16)| {
            floor.insert(
                (client.0.octets(), client.1),
                (frontend.0.octets(), frontend.1),
                (backend.0.octets(), backend.1),
                1,
            )
        };
        let connection = [(frontend.0.octets(), frontend.1)];
        let mut out = vec![0u8; 256];
        let run =
            |out: &mut [u8]| test_run(floor.program.as_fd(), &frame::tcp(client, frontend), out, 1).unwrap();
        // Nothing recorded before the first packet.
        let forgotten = floor.forget_connections((client.0.octets(), client.1), &connection);
        assert!(forgotten.is_err(), "no connection yet");
        to(first).unwrap();
        let first_run = run(&mut out);
        assert_eq!(first_run.verdict, 7, "TC_ACT_REDIRECT");
        assert_eq!(out[..first_run.out_len], frame::tcp(client, first)[..]);
        // The service moves on; the recorded connection does not.
        to(second).unwrap();
        run(&mut out);
        assert_eq!(out[..first_run.out_len], frame::tcp(client, first)[..]);
        floor
            .forget_connections((client.0.octets(), client.1), &connection)
            .expect("one connection recorded");
        // Forgotten, the next packet is a new connection to the service's backend now.
        run(&mut out);
        assert_eq!(out[..first_run.out_len], frame::tcp(client, second)[..]);
    }

    /// The drop sink drops and counts the stream's datagrams, and passes anything else.
    #[test]
    fn the_drop_sink_counts_and_drops_the_stream_and_passes_the_rest() {
        let sink = XdpCountDrop::load(5454).expect("loading the drop sink");
        let udp = |port| {
            let src = (Ipv4Addr::new(192, 168, 77, 2), 40_000).into();
            let dst = (Ipv4Addr::new(10, 1, 0, 2), port).into();
            load::udp_frame([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2], src, dst).unwrap()
        };
        let udp6 = |port| {
            let src = (Ipv6Addr::new(0xfd77, 0, 0, 0, 0, 0, 0, 2), 40_000).into();
            let dst = (Ipv6Addr::new(0xfd00, 0, 2, 0, 0, 0, 0, 2), port).into();
            load::udp_frame([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2], src, dst).unwrap()
        };
        let mut out = vec![0u8; 256];
        const XDP_DROP: u32 = 1;
        const XDP_PASS: u32 = 2;
        for _ in 0..3 {
            assert_eq!(test_run(sink.program.as_fd(), &udp(5454), &mut out, 1).unwrap().verdict, XDP_DROP);
        }
        for _ in 0..2 {
            assert_eq!(test_run(sink.program.as_fd(), &udp6(5454), &mut out, 1).unwrap().verdict, XDP_DROP);
        }
        assert_eq!(test_run(sink.program.as_fd(), &udp(53), &mut out, 1).unwrap().verdict, XDP_PASS);
        assert_eq!(test_run(sink.program.as_fd(), &udp6(53), &mut out, 1).unwrap().verdict, XDP_PASS);
        // Shorter than its headers.
        assert_eq!(test_run(sink.program.as_fd(), &udp6(5454)[..60], &mut out, 1).unwrap().verdict, XDP_PASS);
        let tcp = frame::tcp((Ipv4Addr::new(10, 1, 0, 1), 5454), (Ipv4Addr::new(10, 1, 0, 2), 5454));
        assert_eq!(test_run(sink.program.as_fd(), &tcp, &mut out, 1).unwrap().verdict, XDP_PASS);
        assert_eq!(sink.count().unwrap(), 5);
        // A frame needs one family; two are refused, not a panic.
        let mixed = (Ipv6Addr::new(0xfd00, 0, 2, 0, 0, 0, 0, 2), 53).into();
        let two_families =
            load::udp_frame([2; 6], [2; 6], (Ipv4Addr::new(192, 168, 77, 2), 40_000).into(), mixed);
        assert!(two_families.is_err(), "{two_families:?}");
    }
}
