//! Attaching the TC program to devices, and the socket-level load balancer's programs to the
//! cgroup root, so that they stay attached without the agent.
use std::{
    fs::File,
    io,
    os::{fd::AsFd as _, unix::fs::MetadataExt as _},
    path::Path,
};

use anyhow::Context as _;
use aya::{
    programs::{
        links::{FdLink, LinkError, PinnedLink},
        tc::{self, SchedClassifierLink, TcAttachOptions},
        CgroupAttachMode, CgroupSockAddr, LinkOrder, SchedClassifier, TcAttachType,
    },
    sys::SyscallError,
};
use proxy_common::pins;
use tracing::{debug, info, warn};

use super::PinDir;

/// How the program is attached to one device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Attachment {
    /// A TCX link, pinned so it stays attached without the agent.
    Tcx,
    /// A clsact filter (kernels before 6.6); it stays attached until removed by name.
    Clsact,
}

/// Which TC hook of a device a program runs at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hook {
    /// `vipr_tc_ingress`: every served device.
    Ingress,
    /// `vipr_tc_egress`: every served device with `--bpf-forwarding=stack`, for the half of a
    /// forwarded packet's NAT that must come after the stack's routing and filtering.
    Egress,
}

impl Hook {
    pub fn program(self) -> &'static str {
        match self {
            Hook::Ingress => pins::TC_INGRESS_PROGRAM,
            Hook::Egress => pins::TC_EGRESS_PROGRAM,
        }
    }

    fn attach_type(self) -> TcAttachType {
        match self {
            Hook::Ingress => TcAttachType::Ingress,
            Hook::Egress => TcAttachType::Egress,
        }
    }

    /// The name of the device's link pin under `links/`: the device's own name at ingress,
    /// `egress:<device>` at egress (no device name holds a colon, so the two never clash).
    pub fn pin_name(self, device: &str) -> String {
        match self {
            Hook::Ingress => device.to_owned(),
            Hook::Egress => format!("egress:{device}"),
        }
    }
}

/// Attaches `program` at `hook` of `device`. A TCX link pinned by an earlier agent is
/// updated in place (the kernel swaps the program atomically, no packet sees a gap); a stale
/// one (its device is gone) is replaced.
pub fn attach(
    program: &mut SchedClassifier,
    device: &str,
    hook: Hook,
    link_pin: &Path,
) -> anyhow::Result<Attachment> {
    match PinnedLink::from_pin(link_pin) {
        Ok(pinned) => {
            let link = SchedClassifierLink::try_from(FdLink::from(pinned))?;
            match program.attach_to_link(link) {
                Ok(id) => {
                    // Converting to FdLink releases aya's ownership without detaching; the pin
                    // keeps the link alive.
                    let _: FdLink = program.take_link(id)?.try_into()?;
                    return Ok(Attachment::Tcx);
                }
                Err(error) => {
                    warn!(device, %error, "the pinned link cannot be updated; attaching anew");
                    std::fs::remove_file(link_pin)?;
                }
            }
        }
        Err(LinkError::SyscallError(SyscallError { io_error, .. }))
            if io_error.kind() == io::ErrorKind::NotFound => {}
        Err(error) => return Err(error.into()),
    }
    match program.attach_with_options(
        device,
        hook.attach_type(),
        TcAttachOptions::TcxOrder(LinkOrder::default()),
    ) {
        Ok(id) => {
            let link: FdLink = program.take_link(id)?.try_into()?;
            link.pin(link_pin).with_context(|| format!("cannot pin the link at {}", link_pin.display()))?;
            Ok(Attachment::Tcx)
        }
        Err(tcx_error) => {
            debug!(device, %tcx_error, "TCX attach failed; falling back to clsact");
            if let Err(error) = tc::qdisc_add_clsact(device) {
                debug!(device, %error, "clsact qdisc not added (it usually exists already)");
            }
            detach_clsact(device, hook);
            let id = program
                .attach_with_options(device, hook.attach_type(), TcAttachOptions::Netlink(Default::default()))
                .with_context(|| format!("TCX failed ({tcx_error}) and so did clsact"))?;
            // A clsact filter lives until removed; dropping aya's handle would remove it now.
            std::mem::forget(program.take_link(id)?);
            Ok(Attachment::Clsact)
        }
    }
}

pub fn detach_clsact(device: &str, hook: Hook) {
    match tc::qdisc_detach_program(device, hook.attach_type(), hook.program()) {
        Ok(()) => info!(device, ?hook, "detached a clsact filter"),
        Err(error) => debug!(device, %error, "no clsact filter detached"),
    }
}

/// Links pinned for devices that are no longer served are detached, so that dropping a device
/// from `--devices` really stops vipr there; so are egress links with
/// `--bpf-forwarding=redirect`. `keep` holds the pin names of the links in use.
pub fn detach_stale_links(pin_dir: &PinDir, keep: &[String]) -> anyhow::Result<()> {
    for entry in std::fs::read_dir(pin_dir.links())? {
        let path = entry?.path();
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        // The cgroup hooks' links live here too; their own code keeps them (see below).
        // So do the XDP links (xdp_attach.rs).
        if keep.contains(&name) || super::xdp_attach::is_xdp_pin(&name) || is_cgroup_link(&path) {
            continue;
        }
        match PinnedLink::from_pin(&path) {
            Ok(pinned) => drop(pinned.unpin()?),
            Err(_) => std::fs::remove_file(&path)?,
        }
        info!(link = name, "detached a TC link no longer in use (device not served, or egress not needed)");
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// cgroup hooks of the socket-level load balancer (node traffic). Each program is attached to
// the cgroup v2 root through a BPF link (links on a cgroup always allow several programs, so
// other tools' programs and other vipr instances' stay), pinned as
// `<bpf-root>/vipr/links/cgroup-<hook>`, and adopted and updated across restarts like the TCX
// links.

/// How a cgroup hook was attached.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CgroupAttachment {
    /// The link an earlier agent pinned now runs this program (swapped atomically).
    Updated,
    /// A new link, pinned.
    Attached,
}

/// Attaches `program` to the cgroup at `cgroup` through a link pinned at `link_pin`. A link
/// pinned by an earlier agent on the same cgroup is updated in place (`BPF_LINK_UPDATE`: no
/// system call sees the hook missing); one on another cgroup (`--cgroup-root` changed) or whose
/// cgroup is gone is replaced.
pub fn attach_cgroup(
    program: &mut CgroupSockAddr,
    cgroup: &Path,
    link_pin: &Path,
) -> anyhow::Result<CgroupAttachment> {
    let cgroup_dir =
        File::open(cgroup).with_context(|| format!("cannot open cgroup {}", cgroup.display()))?;
    // A cgroup v2 directory's inode number is the cgroup id the kernel reports for links.
    let cgroup_id = cgroup_dir.metadata()?.ino();
    match bpf_sys::open_pinned(link_pin) {
        Ok(link) => {
            match bpf_sys::cgroup_link_target(link.as_fd()) {
                Ok(Some(target)) if target == cgroup_id => {
                    match bpf_sys::link_update(link.as_fd(), program.fd()?.as_fd()) {
                        Ok(()) => return Ok(CgroupAttachment::Updated),
                        Err(error) => {
                            warn!(pin = %link_pin.display(), %error, "the pinned link cannot be updated; attaching anew")
                        }
                    }
                }
                Ok(target) => {
                    info!(pin = %link_pin.display(), ?target, cgroup_id, "the pinned link is on another cgroup; replacing it")
                }
                Err(error) => warn!(pin = %link_pin.display(), %error, "not a readable link; replacing it"),
            }
            drop(link);
            std::fs::remove_file(link_pin)
                .with_context(|| format!("cannot remove {}", link_pin.display()))?;
        }
        Err(error) if error.kind() == io::ErrorKind::NotFound => {}
        Err(error) => return Err(error).with_context(|| format!("cannot open {}", link_pin.display())),
    }
    // Mode Single means no flags: the kernel refuses any on a link, and a link never excludes
    // other programs.
    let id = program
        .attach(&cgroup_dir, CgroupAttachMode::Single)
        .with_context(|| format!("cannot attach to cgroup {}", cgroup.display()))?;
    let link: FdLink = program.take_link(id)?.try_into()?;
    link.pin(link_pin).with_context(|| format!("cannot pin the link at {}", link_pin.display()))?;
    Ok(CgroupAttachment::Attached)
}

/// Detaches cgroup links pinned under `links/` other than `keep` (hooks of an earlier version,
/// or all of them when host traffic is not balanced any more).
pub fn detach_stale_cgroup_links(pin_dir: &PinDir, keep: &[&str]) -> anyhow::Result<()> {
    for entry in std::fs::read_dir(pin_dir.links())? {
        let path = entry?.path();
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        if keep.contains(&name.as_str()) || !is_cgroup_link(&path) {
            continue;
        }
        std::fs::remove_file(&path).with_context(|| format!("cannot remove {}", path.display()))?;
        info!(link = name, "detached a cgroup hook that is no longer used");
    }
    Ok(())
}

/// Whether `pin` is a pinned link on a cgroup.
fn is_cgroup_link(pin: &Path) -> bool {
    bpf_sys::open_pinned(pin)
        .and_then(|link| bpf_sys::cgroup_link_target(link.as_fd()))
        .is_ok_and(|target| target.is_some())
}

/// The few bpf(2) commands aya 0.14 does not offer for cgroup links: opening a pin as a plain
/// descriptor, reading a link's cgroup, and swapping a link's program.
mod bpf_sys {
    use std::{
        ffi::CString,
        io,
        os::{
            fd::{AsRawFd as _, BorrowedFd, OwnedFd},
            unix::ffi::OsStrExt as _,
        },
        path::Path,
    };

    use crate::bpf_sys::{self, bpf, cmd};

    const BPF_LINK_TYPE_CGROUP: u32 = 3;

    #[repr(C)]
    #[derive(Default)]
    struct ObjGet {
        pathname: u64,
        bpf_fd: u32,
        file_flags: u32,
        path_fd: i32,
        pad: u32,
    }

    /// A descriptor of the object pinned at `path`.
    pub fn open_pinned(path: &Path) -> io::Result<OwnedFd> {
        let path = CString::new(path.as_os_str().as_bytes()).map_err(io::Error::other)?;
        let mut attr = ObjGet { pathname: path.as_ptr() as u64, ..ObjGet::default() };
        // SAFETY: the attribute's path outlives the call.
        unsafe { bpf(cmd::OBJ_GET, &mut attr) }.and_then(bpf_sys::owned_fd)
    }

    #[repr(C)]
    #[derive(Default)]
    struct InfoByFd {
        bpf_fd: u32,
        info_len: u32,
        info: u64,
    }

    /// The start of `struct bpf_link_info` with its `cgroup` member.
    #[repr(C)]
    #[derive(Default)]
    struct LinkInfo {
        link_type: u32,
        id: u32,
        prog_id: u32,
        pad: u32,
        cgroup_id: u64,
        attach_type: u32,
        rest: [u32; 9],
    }

    /// `Some(cgroup id)` (0 if its cgroup is gone) for a cgroup link, `None` for another link;
    /// an error for a descriptor that is no link.
    pub fn cgroup_link_target(link: BorrowedFd<'_>) -> io::Result<Option<u64>> {
        let mut info = LinkInfo::default();
        let mut attr = InfoByFd {
            bpf_fd: link.as_raw_fd() as u32,
            info_len: std::mem::size_of::<LinkInfo>() as u32,
            info: std::ptr::from_mut(&mut info) as u64,
        };
        // SAFETY: `info` outlives the call and is as long as `info_len` says.
        unsafe { bpf(cmd::OBJ_GET_INFO_BY_FD, &mut attr) }?;
        Ok((info.link_type == BPF_LINK_TYPE_CGROUP).then_some(info.cgroup_id))
    }

    #[repr(C)]
    struct LinkUpdate {
        link_fd: u32,
        new_prog_fd: u32,
        flags: u32,
        old_prog_fd: u32,
    }

    /// Makes `link` run `program` instead of its current one, atomically.
    pub fn link_update(link: BorrowedFd<'_>, program: BorrowedFd<'_>) -> io::Result<()> {
        let mut attr = LinkUpdate {
            link_fd: link.as_raw_fd() as u32,
            new_prog_fd: program.as_raw_fd() as u32,
            flags: 0,
            old_prog_fd: 0,
        };
        // SAFETY: the attribute holds descriptors only.
        unsafe { bpf(cmd::LINK_UPDATE, &mut attr) }.map(drop)
    }
}
