//! Attaching the XDP fast path (`proxy-ebpf/src/xdp.rs`) to devices, as pinned XDP links, so
//! that it stays attached without the agent, like the TCX links.
//!
//! A link is pinned under `links/` as `xdp-native-<device>` or `xdp-generic-<device>`: the
//! name records the mode, which the kernel's link information does not. A restarted agent
//! asking for the same mode swaps its program into the pinned link (`BPF_LINK_UPDATE`, atomic);
//! another mode, or `--xdp=off`, unpins (detaches) the old link first. While a device has no
//! XDP program the TC program handles everything, so a gap costs speed, never packets.
use std::{
    collections::BTreeMap,
    ffi::CString,
    io,
    path::{Path, PathBuf},
};

use anyhow::{anyhow, Context as _};
use aya::{
    maps::{DevMapHash, MapData},
    programs::{
        links::{FdLink, LinkError, PinnedLink},
        xdp::XdpLink,
        Xdp, XdpMode as AttachMode,
    },
    sys::SyscallError,
    Ebpf,
};
use tracing::{info, warn};

use super::PinDir;
use crate::cli::XdpMode;

/// The XDP program's name in the object.
pub const PROGRAM: &str = "vipr_xdp";
/// The device map of redirect targets (xdp.rs `XDP_TX_DEVICES`).
const TX_DEVICES: &str = "vipr_xdptx";
const PIN_PREFIX: &str = "xdp-";

/// The pin of `device`'s link in `mode`.
fn link_pin(pin_dir: &PinDir, device: &str, mode: XdpMode) -> PathBuf {
    pin_dir.link(&format!("{PIN_PREFIX}{}-{device}", label(mode)))
}

fn label(mode: XdpMode) -> &'static str {
    match mode {
        XdpMode::Native => "native",
        XdpMode::Generic => "generic",
        XdpMode::Off => "off",
    }
}

/// Whether a pin under `links/` is one of the XDP links (kept apart from the TC links).
pub fn is_xdp_pin(name: &str) -> bool {
    name.starts_with(PIN_PREFIX)
}

/// The XDP program and the devices it runs on.
pub struct XdpPath {
    requested: XdpMode,
    /// The devices it is attached to, with the mode each got.
    attached: BTreeMap<String, XdpMode>,
    /// The redirect targets; `None` with `--xdp=off`.
    tx_devices: Option<DevMapHash<MapData>>,
}

impl XdpPath {
    /// Loads the program (unless `requested` is off) and attaches it to `devices`; with off,
    /// detaches every XDP link an earlier agent pinned.
    pub fn start(
        ebpf: &mut Ebpf,
        pin_dir: &PinDir,
        requested: XdpMode,
        devices: &[String],
    ) -> anyhow::Result<Self> {
        let mut path = Self { requested, attached: BTreeMap::new(), tx_devices: None };
        if requested != XdpMode::Off {
            let program: &mut Xdp = ebpf
                .program_mut(PROGRAM)
                .ok_or_else(|| anyhow!("program {PROGRAM} is missing from the object"))?
                .try_into()?;
            match program.load() {
                Ok(()) => {
                    let map = ebpf
                        .take_map(TX_DEVICES)
                        .ok_or_else(|| anyhow!("map {TX_DEVICES} is missing from the object"))?;
                    path.tx_devices = Some(DevMapHash::try_from(map)?);
                }
                Err(error) => {
                    warn!(%error, "the kernel refused vipr's XDP program: XDP is off, TC serves alone");
                    path.requested = XdpMode::Off;
                }
            }
        }
        path.serve(ebpf, pin_dir, devices)?;
        Ok(path)
    }

    /// Attaches to devices not served yet, detaches from devices no longer listed.
    pub fn serve(&mut self, ebpf: &mut Ebpf, pin_dir: &PinDir, devices: &[String]) -> anyhow::Result<()> {
        if self.requested != XdpMode::Off {
            let program: &mut Xdp = ebpf
                .program_mut(PROGRAM)
                .ok_or_else(|| anyhow!("program {PROGRAM} is missing"))?
                .try_into()?;
            for device in devices {
                if self.attached.contains_key(device) {
                    continue;
                }
                if let Some(mode) = attach(program, pin_dir, device, self.requested) {
                    info!(device, mode = label(mode), "XDP fast path attached");
                    self.attached.insert(device.clone(), mode);
                    if let Some(map) = &mut self.tx_devices {
                        match if_index(device) {
                            Ok(index) => {
                                if let Err(error) = map.insert(index, index, None, 0) {
                                    warn!(device, %error, "not an XDP redirect target");
                                }
                            }
                            Err(error) => warn!(device, %error, "not an XDP redirect target"),
                        }
                    }
                }
            }
        }
        self.attached.retain(|device, _| devices.contains(device));
        // The device map drops entries of devices that are gone by itself; a device still
        // there but no longer served stays a target only until its link is unpinned below, which
        // the map outlives harmlessly (a redirect to it is a plain transmit).
        detach_stale(pin_dir, &self.attached)
    }
}

/// Attaches `program` to `device` in `requested` mode, native falling back to generic; `None`
/// (logged) when no mode attaches.
fn attach(program: &mut Xdp, pin_dir: &PinDir, device: &str, requested: XdpMode) -> Option<XdpMode> {
    let modes: &[XdpMode] = match requested {
        XdpMode::Native => &[XdpMode::Native, XdpMode::Generic],
        XdpMode::Generic => &[XdpMode::Generic],
        XdpMode::Off => &[],
    };
    for &mode in modes {
        match attach_in(program, pin_dir, device, mode) {
            Ok(()) => return Some(mode),
            Err(error) => {
                warn!(device, mode = label(mode), "XDP not attached in this mode: {error:#}")
            }
        }
    }
    warn!(device, "no XDP on this device: the TC program serves its traffic alone");
    None
}

fn attach_in(program: &mut Xdp, pin_dir: &PinDir, device: &str, mode: XdpMode) -> anyhow::Result<()> {
    let pin = link_pin(pin_dir, device, mode);
    match PinnedLink::from_pin(&pin) {
        Ok(pinned) => {
            let link = XdpLink::try_from(FdLink::from(pinned))?;
            match program.attach_to_link(link) {
                Ok(id) => {
                    let _: FdLink = program.take_link(id)?.try_into()?;
                    return Ok(());
                }
                Err(error) => {
                    warn!(device, %error, "the pinned XDP link cannot be updated; attaching anew");
                    remove(&pin)?;
                }
            }
        }
        Err(LinkError::SyscallError(SyscallError { io_error, .. }))
            if io_error.kind() == io::ErrorKind::NotFound => {}
        Err(error) => return Err(error.into()),
    }
    // A device runs one XDP program: the other mode's link goes first.
    for other in [XdpMode::Native, XdpMode::Generic] {
        if other != mode {
            remove(&link_pin(pin_dir, device, other))?;
        }
    }
    let attach_mode = if mode == XdpMode::Native { AttachMode::Driver } else { AttachMode::Skb };
    let id = program.attach(device, attach_mode)?;
    // aya falls back to a netlink attachment where links are refused (before 5.9): such an
    // attachment cannot be pinned, and is detached again when dropped here.
    let link: FdLink =
        program.take_link(id)?.try_into().context("the kernel made no XDP link (before Linux 5.9?)")?;
    link.pin(&pin).with_context(|| format!("cannot pin the link at {}", pin.display()))?;
    Ok(())
}

/// Unpins (detaching) XDP links of devices not in `attached`, or in another mode.
fn detach_stale(pin_dir: &PinDir, attached: &BTreeMap<String, XdpMode>) -> anyhow::Result<()> {
    for entry in std::fs::read_dir(pin_dir.links())? {
        let path = entry?.path();
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        if !is_xdp_pin(&name) {
            continue;
        }
        let keep = attached.iter().any(|(device, &mode)| link_pin(pin_dir, device, mode) == path);
        if !keep {
            remove(&path)?;
            info!(link = name, "detached an XDP link no longer wanted");
        }
    }
    Ok(())
}

/// Unpins a link (its last reference: the program is detached); nothing if absent.
fn remove(pin: &Path) -> anyhow::Result<()> {
    match std::fs::remove_file(pin) {
        Err(error) if error.kind() != io::ErrorKind::NotFound => {
            Err(error).with_context(|| format!("cannot remove {}", pin.display()))
        }
        _ => Ok(()),
    }
}

fn if_index(device: &str) -> io::Result<u32> {
    let name = CString::new(device).map_err(io::Error::other)?;
    // SAFETY: a valid C string.
    match unsafe { libc::if_nametoindex(name.as_ptr()) } {
        0 => Err(io::Error::last_os_error()),
        index => Ok(index),
    }
}
