//! `--proxy-mode=auto`: what this kernel and node offer, and which dataplane that makes.
//!
//! [`probe`] asks the kernel and the node's tools; [`choose`] turns the answers into a
//! [`Decision`] and is pure, so the order of preference is unit-tested without a kernel:
//!
//! 1. **ebpf** when vipr's BPF essentials work: `bpf()` loads a TC program, creates the map types
//!    the datapath uses, a bpffs exists or can be mounted, and the kernel publishes its BTF
//!    (TCX or clsact, and the cgroup socket hooks, only change how well it serves, not whether);
//! 2. else **nftables** when the kernel is 5.13 or later, `nft` runs and the kernel accepts
//!    (check only, `nft -c`) a throwaway table with every expression the nftables dataplane
//!    uses;
//! 3. else **iptables** when iptables works;
//! 4. else no dataplane: an error listing every reason.
//!
//! ipvs mode (deprecated in kube-proxy) runs only when asked for.
//!
//! Every probe that fails becomes a reason ("bpf(BPF_PROG_LOAD SCHED_CLS): Operation not
//! permitted"); none panics. The tools are only probed when eBPF is not usable.
use std::{
    io,
    os::fd::{AsRawFd as _, OwnedFd},
    path::Path,
    process::Command,
};

use crate::tool;
use crate::{
    config::ProxyMode,
    dataplane::iptables::{
        ruleset::Family,
        tools::{Tools, Variant},
    },
    dataplane::Mode,
    metrics::{Collector, MetricFamily, MetricKind, Sample, SampleValue},
};

/// Where the kernel publishes its own BTF.
const KERNEL_BTF: &str = "/sys/kernel/btf/vmlinux";

/// One probe's answer: usable, or why not.
pub type Probe = Result<(), String>;

/// How the TC program would be attached.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TcAttach {
    /// A TCX link (kernel 6.6 and later).
    Tcx,
    /// A filter on a clsact qdisc (older kernels).
    Clsact,
}

/// What the eBPF dataplane needs from the kernel.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BpfFeatures {
    /// `bpf(BPF_PROG_LOAD)` of a trivial TC (SCHED_CLS) program.
    pub tc_program: Probe,
    /// `bpf(BPF_MAP_CREATE)` of every map type the datapath uses (hash, LRU hash, LPM trie).
    pub maps: Probe,
    /// A bpffs at the pin root, or one the kernel can mount there.
    pub bpffs: Probe,
    /// The kernel's own BTF (`/sys/kernel/btf/vmlinux`): the verifier needs it for vipr's
    /// programs, not for the trivial one above (a kernel without it, such as Debian's
    /// User-Mode Linux, answers "btf_vmlinux is malformed").
    pub kernel_btf: Probe,
    /// TCX or clsact; only known when programs load.
    pub tc_attach: Result<TcAttach, String>,
    /// cgroup v2 sock_addr hooks (the node's own connections): without them the eBPF
    /// dataplane still serves traffic that passes through the node.
    pub socket_hooks: Probe,
}

impl BpfFeatures {
    /// Why the eBPF dataplane cannot run here; empty when it can.
    fn missing(&self) -> Vec<String> {
        [&self.tc_program, &self.maps, &self.bpffs, &self.kernel_btf]
            .into_iter()
            .filter_map(|probe| probe.clone().err())
            .collect()
    }
}

/// What the nftables and iptables dataplanes need.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FallbackFeatures {
    /// `nftables::probe`: kernel version, `nft`, and the expressions accepted.
    pub nftables: Probe,
    /// The system's iptables variant, which answers for the nat table.
    pub iptables: Result<Variant, String>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Features {
    pub bpf: BpfFeatures,
    /// `None` when not probed (eBPF was usable).
    pub fallback: Option<FallbackFeatures>,
}

/// The mode auto picked, and why: every probe that failed, and notes on how the chosen mode
/// will run (such as the cgroup hooks that are missing).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decision {
    pub mode: Mode,
    pub reasons: Vec<String>,
}

impl Decision {
    /// "chose iptables: bpf(...): ...; IPVS: ...", the line auto mode logs.
    pub fn summary(&self) -> String {
        let mut line = format!("chose {}", self.mode);
        if !self.reasons.is_empty() {
            line.push_str(": ");
            line.push_str(&self.reasons.join("; "));
        }
        line
    }
}

/// No dataplane works here.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("proxy mode auto: no dataplane can run on this node: {}", .reasons.join("; "))]
pub struct NoDataplane {
    pub reasons: Vec<String>,
}

/// The dataplane for `features`, in the order of preference of the module documentation.
pub fn choose(features: &Features) -> Result<Decision, NoDataplane> {
    let bpf = &features.bpf;
    let missing_bpf = bpf.missing();
    if missing_bpf.is_empty() {
        let mut notes = Vec::new();
        if let Err(reason) = &bpf.tc_attach {
            notes.push(format!("TC attachment: {reason}"));
        } else if bpf.tc_attach == Ok(TcAttach::Clsact) {
            notes.push("no TCX: attaching clsact filters".to_owned());
        }
        if let Err(reason) = &bpf.socket_hooks {
            notes.push(format!("the node's own connections to services are not balanced: {reason}"));
        }
        return Ok(Decision { mode: Mode::Ebpf, reasons: notes });
    }
    let mut reasons = missing_bpf;
    let Some(fallback) = &features.fallback else {
        reasons.push("nftables and iptables were not probed".to_owned());
        return Err(NoDataplane { reasons });
    };
    if let Err(reason) = &fallback.nftables {
        reasons.push(reason.clone());
    } else {
        return Ok(Decision { mode: Mode::Nftables, reasons });
    }
    match &fallback.iptables {
        Ok(_) => Ok(Decision { mode: Mode::Iptables, reasons }),
        Err(reason) => {
            reasons.push(reason.clone());
            Err(NoDataplane { reasons })
        }
    }
}

/// Probes this kernel and node; `bpf_root` is where the eBPF dataplane would pin, and
/// `cgroup_root` the `--cgroup-root` if one was given.
pub fn probe(bpf_root: &Path, cgroup_root: Option<&Path>) -> Features {
    let bpf = probe_bpf(bpf_root, cgroup_root);
    let fallback = (!bpf.missing().is_empty()).then(probe_fallbacks);
    Features { bpf, fallback }
}

/// Probes and chooses: what `--proxy-mode=auto` runs.
pub fn decide(bpf_root: &Path, cgroup_root: Option<&Path>) -> Result<Decision, NoDataplane> {
    choose(&probe(bpf_root, cgroup_root))
}

fn probe_bpf(bpf_root: &Path, cgroup_root: Option<&Path>) -> BpfFeatures {
    let tc_program = raw::load_program(raw::PROG_TYPE_SCHED_CLS, 0, raw::RETURN_0);
    let tc_attach = match &tc_program {
        Ok(program) => {
            raw::tcx_supported(program).map(|tcx| if tcx { TcAttach::Tcx } else { TcAttach::Clsact })
        }
        Err(reason) => Err(format!("no TC program: {reason}")),
    };
    BpfFeatures {
        tc_program: tc_program.map(drop),
        maps: probe_maps(),
        bpffs: probe_bpffs(bpf_root),
        kernel_btf: probe_kernel_btf(),
        tc_attach,
        socket_hooks: probe_socket_hooks(cgroup_root),
    }
}

fn probe_maps() -> Probe {
    let maps = [
        ("hash", raw::MAP_TYPE_HASH, 0),
        ("LRU hash", raw::MAP_TYPE_LRU_HASH, 0),
        // The kernel insists that LPM tries are not preallocated.
        ("LPM trie", raw::MAP_TYPE_LPM_TRIE, raw::F_NO_PREALLOC),
    ];
    for (name, map_type, flags) in maps {
        raw::create_map(map_type, flags).map_err(|reason| format!("{name} map: {reason}"))?;
    }
    Ok(())
}

fn probe_bpffs(bpf_root: &Path) -> Probe {
    if raw::is_bpffs(bpf_root) {
        return Ok(());
    }
    // vipr mounts one at the root when there is none; that needs the file system type.
    let filesystems = std::fs::read_to_string("/proc/filesystems")
        .map_err(|error| format!("bpffs: cannot read /proc/filesystems: {error}"))?;
    if filesystems.lines().any(|line| line.split_whitespace().last() == Some("bpf")) {
        Ok(())
    } else {
        Err("bpffs: this kernel has no bpf file system".to_owned())
    }
}

fn probe_kernel_btf() -> Probe {
    std::fs::metadata(KERNEL_BTF).map(drop).map_err(|error| {
        format!("kernel BTF: {KERNEL_BTF}: {} (vipr's programs need it)", raw::describe(&error))
    })
}

fn probe_socket_hooks(cgroup_root: Option<&Path>) -> Probe {
    let has_cgroup2 = match cgroup_root {
        Some(_) => true,
        None => std::fs::read_to_string("/proc/self/mounts")
            .is_ok_and(|mounts| mounts.lines().any(|line| line.split_whitespace().nth(2) == Some("cgroup2"))),
    };
    if !has_cgroup2 {
        return Err("no cgroup2 file system is mounted".to_owned());
    }
    raw::load_program(raw::PROG_TYPE_CGROUP_SOCK_ADDR, raw::ATTACH_CGROUP_INET4_CONNECT, raw::RETURN_1)
        .map(drop)
        .map_err(|reason| format!("cgroup sock_addr program: {reason}"))
}

fn probe_fallbacks() -> FallbackFeatures {
    FallbackFeatures { nftables: crate::dataplane::nftables::probe(), iptables: probe_iptables() }
}

fn probe_iptables() -> Result<Variant, String> {
    let tools = Tools::detect(None).map_err(|error| format!("iptables: {error:#}"))?;
    // `--version` does not reach the kernel: listing a nat chain does (and would fail for
    // iptables-nft on a kernel without nf_tables).
    let program = tools.program(Family::Ipv4, None);
    let output = tool::run(
        Command::new(&program).args(["-w", "5", "-t", "nat", "-S", "POSTROUTING"]),
        None,
        tool::QUERY_TIMEOUT,
    )
    .map_err(|error| format!("iptables: {error:#}"))?;
    if output.status.success() {
        Ok(tools.variant)
    } else {
        Err(format!("iptables ({}): {}", tools.variant, first_line(&output.stderr)))
    }
}

fn first_line(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    text.lines().find(|line| !line.trim().is_empty()).unwrap_or("failed without a message").trim().to_owned()
}

/// `vipr_proxy_mode_info{mode, requested} 1`: the running dataplane and the `--proxy-mode` asked
/// for (`/proxyMode` answers only the former, as kube-proxy's does).
#[derive(Clone, Copy, Debug)]
pub struct ProxyModeInfo {
    pub mode: Mode,
    pub requested: ProxyMode,
}

impl Collector for ProxyModeInfo {
    fn collect(&self) -> Vec<MetricFamily> {
        vec![MetricFamily {
            name: "vipr_proxy_mode_info".to_owned(),
            help: "The running dataplane (mode) and the --proxy-mode asked for (requested); always 1"
                .to_owned(),
            kind: MetricKind::Gauge,
            samples: vec![Sample {
                labels: vec![
                    ("mode".to_owned(), self.mode.name().to_owned()),
                    ("requested".to_owned(), self.requested.name().to_owned()),
                ],
                value: SampleValue::Number(1.0),
            }],
        }]
    }
}

/// The raw `bpf()` calls of the probes: a handful of attributes, not worth a loader.
mod raw {
    use super::*;
    use crate::bpf_sys::{self, cmd, LinkCreateAttr, MapCreateAttr};

    pub const PROG_TYPE_SCHED_CLS: u32 = 3;
    pub const PROG_TYPE_CGROUP_SOCK_ADDR: u32 = 18;
    pub const ATTACH_CGROUP_INET4_CONNECT: u32 = 10;
    const ATTACH_TCX_INGRESS: u32 = 46;

    pub const MAP_TYPE_HASH: u32 = 1;
    pub const MAP_TYPE_LRU_HASH: u32 = 9;
    pub const MAP_TYPE_LPM_TRIE: u32 = 11;
    pub const F_NO_PREALLOC: u32 = 1;

    const BPF_FS_MAGIC: i64 = 0xcafe_4a11;

    /// `r0 = 0; exit`: TC_ACT_OK, leaves every packet alone.
    pub const RETURN_0: [u64; 2] = bpf_sys::returning(0);
    /// `r0 = 1; exit`: a sock_addr program that lets every call through.
    pub const RETURN_1: [u64; 2] = bpf_sys::returning(1);

    /// `bpf(command, attr)` for a command that returns a new descriptor.
    fn bpf_fd<T>(command: libc::c_long, attr: &mut T) -> io::Result<OwnedFd> {
        // SAFETY: every caller passes its command's attribute, whose pointers outlive the call.
        unsafe { bpf_sys::bpf(command, attr) }.and_then(bpf_sys::owned_fd)
    }

    pub fn load_program(
        prog_type: u32,
        expected_attach_type: u32,
        code: [u64; 2],
    ) -> Result<OwnedFd, String> {
        let name = match prog_type {
            PROG_TYPE_SCHED_CLS => "SCHED_CLS",
            _ => "CGROUP_SOCK_ADDR",
        };
        bpf_sys::load_program(prog_type, expected_attach_type, &code, "")
            .map_err(|error| format!("bpf(BPF_PROG_LOAD {name}): {}", describe(&error)))
    }

    pub fn create_map(map_type: u32, map_flags: u32) -> Result<(), String> {
        // An LPM key is a 4-byte prefix length and the data; 4 more bytes suit every type.
        let mut attr = MapCreateAttr { map_type, key_size: 8, value_size: 4, max_entries: 1, map_flags };
        bpf_fd(cmd::MAP_CREATE, &mut attr)
            .map(drop)
            .map_err(|error| format!("bpf(BPF_MAP_CREATE): {}", describe(&error)))
    }

    /// Whether the kernel knows TCX links: asked to attach to interface 0, a kernel with TCX
    /// looks for that interface and answers ENODEV; one without rejects the attach type
    /// (EINVAL). Nothing is attached either way.
    pub fn tcx_supported(program: &OwnedFd) -> Result<bool, String> {
        let mut attr = LinkCreateAttr {
            prog_fd: program.as_raw_fd() as u32,
            attach_type: ATTACH_TCX_INGRESS,
            ..LinkCreateAttr::default()
        };
        match bpf_fd(cmd::LINK_CREATE, &mut attr) {
            Err(error) if error.raw_os_error() == Some(libc::ENODEV) => Ok(true),
            Err(error) if error.raw_os_error() == Some(libc::EINVAL) => Ok(false),
            Err(error) => Err(format!("bpf(BPF_LINK_CREATE TCX): {}", describe(&error))),
            // Interface 0 does not exist; a link would be a kernel surprise, closed at once.
            Ok(_link) => Ok(true),
        }
    }

    pub fn is_bpffs(path: &Path) -> bool {
        use std::os::unix::ffi::OsStrExt as _;
        let Ok(c_path) = std::ffi::CString::new(path.as_os_str().as_bytes()) else { return false };
        // SAFETY: an all-zero statfs is valid; c_path is NUL-terminated.
        let mut stat: libc::statfs = unsafe { std::mem::zeroed() };
        // SAFETY: as above; stat is a valid out-pointer.
        unsafe { libc::statfs(c_path.as_ptr(), &mut stat) == 0 && stat.f_type as i64 == BPF_FS_MAGIC }
    }

    /// "Operation not permitted" rather than "Operation not permitted (os error 1)".
    pub fn describe(error: &io::Error) -> String {
        let text = error.to_string();
        match text.find(" (os error") {
            Some(end) => text[..end].to_owned(),
            None => text,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bpf_ok() -> BpfFeatures {
        BpfFeatures {
            tc_program: Ok(()),
            maps: Ok(()),
            bpffs: Ok(()),
            kernel_btf: Ok(()),
            tc_attach: Ok(TcAttach::Tcx),
            socket_hooks: Ok(()),
        }
    }

    fn bpf_denied() -> BpfFeatures {
        let denied = "bpf(BPF_PROG_LOAD SCHED_CLS): Operation not permitted".to_owned();
        BpfFeatures {
            tc_program: Err(denied.clone()),
            maps: Err("hash map: bpf(BPF_MAP_CREATE): Operation not permitted".to_owned()),
            bpffs: Ok(()),
            kernel_btf: Ok(()),
            tc_attach: Err(format!("no TC program: {denied}")),
            socket_hooks: Err("cgroup sock_addr program: denied".to_owned()),
        }
    }

    fn fallbacks_ok() -> FallbackFeatures {
        FallbackFeatures { nftables: Ok(()), iptables: Ok(Variant::Legacy) }
    }

    const NO_NFTABLES: &str = "nftables: kernel 5.10 is older than 5.13";

    #[test]
    fn ebpf_when_its_essentials_work_even_without_tcx_or_socket_hooks() {
        let features = Features { bpf: bpf_ok(), fallback: None };
        assert_eq!(choose(&features), Ok(Decision { mode: Mode::Ebpf, reasons: vec![] }));

        let bpf = BpfFeatures {
            tc_attach: Ok(TcAttach::Clsact),
            socket_hooks: Err("no cgroup2 file system is mounted".to_owned()),
            ..bpf_ok()
        };
        let decision = choose(&Features { bpf, fallback: None }).unwrap();
        assert_eq!(decision.mode, Mode::Ebpf);
        assert_eq!(
            decision.reasons,
            [
                "no TCX: attaching clsact filters",
                "the node's own connections to services are not balanced: no cgroup2 file system is mounted"
            ]
        );
    }

    #[test]
    fn each_missing_bpf_essential_rules_ebpf_out() {
        let breakers: [fn(&mut BpfFeatures); 4] = [
            |bpf| bpf.tc_program = Err("bpf(BPF_PROG_LOAD SCHED_CLS): Function not implemented".into()),
            |bpf| bpf.maps = Err("LPM trie: bpf(BPF_MAP_CREATE): Invalid argument".into()),
            |bpf| bpf.bpffs = Err("bpffs: this kernel has no bpf file system".into()),
            |bpf| bpf.kernel_btf = Err("kernel BTF: /sys/kernel/btf/vmlinux: No such file".into()),
        ];
        for breaker in breakers {
            let mut bpf = bpf_ok();
            breaker(&mut bpf);
            let features = Features { bpf: bpf.clone(), fallback: Some(fallbacks_ok()) };
            let decision = choose(&features).unwrap();
            assert_eq!(decision.mode, Mode::Nftables, "{bpf:?}");
            assert_eq!(decision.reasons, bpf.missing());
            assert_eq!(decision.reasons.len(), 1);
        }
    }

    #[test]
    fn nftables_before_iptables_and_ipvs_only_when_asked() {
        let without_nftables = FallbackFeatures { nftables: Err(NO_NFTABLES.to_owned()), ..fallbacks_ok() };
        let decision = choose(&Features { bpf: bpf_denied(), fallback: Some(without_nftables) }).unwrap();
        assert_eq!(decision.mode, Mode::Iptables);
        assert_eq!(
            decision.summary(),
            "chose iptables: bpf(BPF_PROG_LOAD SCHED_CLS): Operation not permitted; \
             hash map: bpf(BPF_MAP_CREATE): Operation not permitted; \
             nftables: kernel 5.10 is older than 5.13"
        );
        let decision = choose(&Features { bpf: bpf_denied(), fallback: Some(fallbacks_ok()) }).unwrap();
        assert_eq!(decision.mode, Mode::Nftables);
        assert!(decision.summary().starts_with("chose nftables: bpf("), "{decision:?}");
    }

    #[test]
    fn nothing_usable_is_an_error_with_every_reason_once() {
        let broken = FallbackFeatures {
            nftables: Err(NO_NFTABLES.to_owned()),
            iptables: Err("iptables: cannot run iptables (is iptables installed?)".to_owned()),
        };
        let error = choose(&Features { bpf: bpf_denied(), fallback: Some(broken) }).unwrap_err();
        assert_eq!(error.reasons.len(), 4, "{error:?}");
        assert_eq!(error.reasons.iter().filter(|reason| reason.starts_with("iptables:")).count(), 1);
        assert!(error.to_string().starts_with("proxy mode auto: no dataplane can run on this node: bpf("));

        let unprobed = choose(&Features { bpf: bpf_denied(), fallback: None }).unwrap_err();
        assert!(unprobed.reasons.last().unwrap().contains("not probed"), "{unprobed:?}");
    }

    #[test]
    fn the_mode_metric_names_both_modes() {
        let info = ProxyModeInfo { mode: Mode::Iptables, requested: ProxyMode::Auto };
        let registry = std::sync::Arc::new(crate::metrics::Registry::default());
        registry.register(std::sync::Arc::new(info));
        let text = registry.encode();
        assert!(
            text.lines().any(|line| line == "vipr_proxy_mode_info{mode=\"iptables\",requested=\"auto\"} 1"),
            "{text}"
        );
    }

    #[test]
    fn instructions_encode_as_the_kernel_reads_them() {
        // BPF_ALU64 | BPF_MOV | BPF_K to r0, imm 1; then BPF_JMP | BPF_EXIT.
        assert_eq!(raw::RETURN_1[0].to_le_bytes(), [0xb7, 0, 0, 0, 1, 0, 0, 0]);
        assert_eq!(raw::RETURN_0[1].to_le_bytes(), [0x95, 0, 0, 0, 0, 0, 0, 0]);
    }

    /// On the real kernel (root): whatever it offers, probing neither panics nor leaves a
    /// reason empty.
    #[test]
    fn probing_this_kernel_gives_reasons_not_panics() {
        let features = probe(Path::new("/sys/fs/bpf"), None);
        eprintln!("{features:#?}");
        let all_reasons = [
            &features.bpf.tc_program,
            &features.bpf.maps,
            &features.bpf.bpffs,
            &features.bpf.kernel_btf,
            &features.bpf.socket_hooks,
        ];
        for reason in all_reasons.into_iter().filter_map(|probe| probe.as_ref().err()) {
            assert!(!reason.trim().is_empty());
        }
        match choose(&features) {
            Ok(decision) => assert!(decision.reasons.iter().all(|reason| !reason.is_empty())),
            Err(error) => assert!(!error.reasons.is_empty()),
        }
    }
}
