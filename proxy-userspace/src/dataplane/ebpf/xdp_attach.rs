//! Attaching the XDP fast path (`proxy-ebpf/src/xdp.rs`) to devices, as pinned XDP links, so
//! that it stays attached without the agent, like the TCX links.
//!
//! Which devices get it:
//! - without `--xdp` ([`XdpMode::Auto`]): the devices backed by hardware ([`hardware_backing`])
//!   whose driver takes native XDP, and no others. The XDP program's incremental checksum
//!   update is right only for packets with complete checksums; a NIC's receive path only has
//!   frames as they came off the wire (or off a hypervisor that computed them), whereas the
//!   CHECKSUM_PARTIAL packets the node and its pods send arrive on virtual devices (veth,
//!   bridge, tun, ...). No generic fallback: generic XDP runs on the skb the stack has already
//!   built, so it gains little over TC, and it would widen what the default touches.
//! - `--xdp=native`: every served device, native falling back to generic, then to none;
//!   `--xdp=generic`: every served device in generic mode; `--xdp=off`: none.
//!
//! A link is pinned under `links/` as `xdp-native-<device>` or `xdp-generic-<device>`: the
//! name records the mode, which the kernel's link information does not. A restarted agent
//! asking for the same mode swaps its program into the pinned link (`BPF_LINK_UPDATE`, atomic);
//! another mode, or a device that gets no XDP now, unpins (detaches) the old link first. While a
//! device has no XDP program the TC program handles everything, so a gap costs speed, never
//! packets.
use std::{
    collections::BTreeMap,
    ffi::CString,
    io,
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
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
use super::XdpMode;

/// The XDP program's name in the object.
pub const PROGRAM: &str = proxy_common::pins::XDP_PROGRAM;
/// The device map of redirect targets (xdp.rs `XDP_TX_DEVICES`).
const TX_DEVICES: &str = proxy_common::pins::XDP_TX_DEVICES;
const PIN_PREFIX: &str = "xdp-";
/// Where sysfs shows the network devices of the namespace that mounted it: the agent's own
/// when it runs with the host network (the DaemonSet), checked per device by [`LinkIdentity`].
const SYSFS_NET: &str = "/sys/class/net";

/// The pin of `device`'s link in `mode`.
fn link_pin(pin_dir: &PinDir, device: &str, mode: XdpMode) -> PathBuf {
    pin_dir.link(&format!("{PIN_PREFIX}{}-{device}", label(mode)))
}

fn label(mode: XdpMode) -> &'static str {
    match mode {
        XdpMode::Auto => "auto",
        XdpMode::Native => "native",
        XdpMode::Generic => "generic",
        XdpMode::Off => "off",
    }
}

/// Whether a pin under `links/` is one of the XDP links (kept apart from the TC links).
pub fn is_xdp_pin(name: &str) -> bool {
    name.starts_with(PIN_PREFIX)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ProgramState {
    /// Not loaded until a device wants it: by default a node whose devices are all virtual
    /// never pays for the verifier.
    NotLoaded,
    Loaded,
    Refused,
}

/// The XDP program and the devices it runs on.
pub struct XdpPath {
    requested: XdpMode,
    program: ProgramState,
    /// Every served device, judged once, with the mode it got (`Off`: none), so that neither the
    /// judgement nor its log line repeats with every device listing.
    devices: BTreeMap<String, XdpMode>,
    /// The redirect targets, once the program is loaded.
    tx_devices: Option<DevMapHash<MapData>>,
}

impl XdpPath {
    /// Attaches to `devices` as `requested` says; with off, detaches every XDP link an earlier
    /// agent pinned.
    pub fn start(
        ebpf: &mut Ebpf,
        pin_dir: &PinDir,
        requested: XdpMode,
        devices: &[String],
    ) -> anyhow::Result<Self> {
        let mut path = Self::new(requested);
        if requested == XdpMode::Off {
            info!("XDP off (--xdp=off): the TC program serves every device alone");
        }
        path.serve(ebpf, pin_dir, devices)?;
        Ok(path)
    }

    /// The path as `requested`, attached nowhere yet, and touching no link an earlier agent
    /// pinned (until [`Self::start`]).
    pub fn new(requested: XdpMode) -> Self {
        Self { requested, program: ProgramState::NotLoaded, devices: BTreeMap::new(), tx_devices: None }
    }

    /// Judges and attaches devices not served yet, detaches from devices no longer listed.
    pub fn serve(&mut self, ebpf: &mut Ebpf, pin_dir: &PinDir, devices: &[String]) -> anyhow::Result<()> {
        self.devices.retain(|device, _| devices.contains(device));
        for device in devices {
            if !self.devices.contains_key(device) {
                let mode = self.attach(ebpf, pin_dir, device)?;
                self.devices.insert(device.clone(), mode);
            }
        }
        // The device map drops entries of devices that are gone by itself; a device still
        // there but no longer served stays a target only until its link is unpinned below, which
        // the map outlives harmlessly (a redirect to it is a plain transmit).
        detach_stale(pin_dir, &self.devices)
    }

    /// Attaches the program to `device` in the first mode that `requested` allows and the
    /// driver takes, and logs what it chose and why; `Off` when none.
    fn attach(&mut self, ebpf: &mut Ebpf, pin_dir: &PinDir, device: &str) -> anyhow::Result<XdpMode> {
        let (modes, why): (&[XdpMode], String) = match self.requested {
            XdpMode::Off => return Ok(XdpMode::Off),
            XdpMode::Native => (&[XdpMode::Native, XdpMode::Generic], "--xdp=native".to_owned()),
            XdpMode::Generic => (&[XdpMode::Generic], "--xdp=generic".to_owned()),
            XdpMode::Auto => match LinkIdentity::of(device)
                .map_err(|error| format!("cannot identify it ({error})"))
                .and_then(|identity| hardware_backing(Path::new(SYSFS_NET), device, &identity))
            {
                Ok(backing) => (&[XdpMode::Native], format!("default: backed by {backing}")),
                Err(reason) => {
                    info!(
                        device,
                        "no XDP by default: {reason}; the TC program serves it (--xdp=native forces XDP)"
                    );
                    return Ok(XdpMode::Off);
                }
            },
        };
        let Some(program) = self.loaded(ebpf)? else {
            return Ok(XdpMode::Off);
        };
        for &mode in modes {
            match attach_in(program, pin_dir, device, mode) {
                Ok(()) => {
                    info!(device, mode = label(mode), "XDP fast path attached ({why})");
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
                    return Ok(mode);
                }
                // A hardware device whose driver has no native XDP (USB, Wi-Fi, ...) is common
                // and harmless: TC serves it as it would without XDP.
                Err(error) if self.requested == XdpMode::Auto => {
                    info!(
                        device,
                        "no XDP: the driver refuses native XDP ({error:#}); the TC program serves it"
                    );
                    return Ok(XdpMode::Off);
                }
                Err(error) => warn!(device, mode = label(mode), "XDP not attached in this mode: {error:#}"),
            }
        }
        warn!(device, "no XDP on this device: the TC program serves its traffic alone");
        Ok(XdpMode::Off)
    }

    /// The program, loaded on first use; `None` if the kernel refused it (logged once).
    fn loaded<'e>(&mut self, ebpf: &'e mut Ebpf) -> anyhow::Result<Option<&'e mut Xdp>> {
        if self.program == ProgramState::NotLoaded {
            let program: &mut Xdp = ebpf
                .program_mut(PROGRAM)
                .ok_or_else(|| anyhow!("program {PROGRAM} is missing from the object"))?
                .try_into()?;
            match super::program_load::load_retrying(|| program.load()) {
                Ok(()) => {
                    let map = ebpf
                        .take_map(TX_DEVICES)
                        .ok_or_else(|| anyhow!("map {TX_DEVICES} is missing from the object"))?;
                    self.tx_devices = Some(DevMapHash::try_from(map)?);
                    self.program = ProgramState::Loaded;
                }
                Err(error) => {
                    warn!(%error, "the kernel refused vipr's XDP program: XDP is off, TC serves alone");
                    self.program = ProgramState::Refused;
                }
            }
        }
        if self.program != ProgramState::Loaded {
            return Ok(None);
        }
        Ok(Some(
            ebpf.program_mut(PROGRAM).ok_or_else(|| anyhow!("program {PROGRAM} is missing"))?.try_into()?,
        ))
    }
}

/// What a device is in the agent's network namespace, to make sure sysfs describes that device
/// and not a namesake: a process that entered the namespace with `setns()` still sees the sysfs
/// mounted for another one, whose device of the same name may well be a NIC.
#[derive(Clone, Debug, PartialEq, Eq)]
struct LinkIdentity {
    ifindex: u32,
    /// `SIOCGIFHWADDR`'s bytes: the hardware address, cut or zero-padded to 14 bytes.
    address: [u8; 14],
}

impl LinkIdentity {
    fn of(device: &str) -> io::Result<Self> {
        Ok(Self { ifindex: if_index(device)?, address: hardware_address(device)? })
    }

    /// Whether sysfs's `ifindex` and `address` (`aa:bb:...`, empty for a device without one)
    /// are this device's.
    fn matches(&self, ifindex: &str, address: &str) -> bool {
        let Some(address) = address
            .trim()
            .split(':')
            .filter(|byte| !byte.is_empty())
            .map(|byte| u8::from_str_radix(byte, 16).ok())
            .collect::<Option<Vec<u8>>>()
        else {
            return false;
        };
        let shown = address.len().min(self.address.len());
        ifindex.trim().parse() == Ok(self.ifindex)
            && address[..shown] == self.address[..shown]
            && self.address[shown..].iter().all(|byte| *byte == 0)
    }
}

/// Whether `device` is backed by hardware that hands XDP complete checksums, as the sysfs
/// directory `sysfs_net` (`/sys/class/net`) shows it: `Ok` names the parent device, `Err` says
/// why not.
///
/// The rule is the parent device. A NIC driver registers its device under the one it drives
/// (PCI, USB, platform, virtio, vmbus, ...), which sysfs links as `device`; the devices the
/// kernel makes up itself (veth, bridge, bond, VLAN, macvlan, tunnels, dummy, tun/tap, ...)
/// have none and live under `/sys/devices/virtual/net`, and those are the ones that carry what
/// the node and its pods send. One paravirtual NIC is excluded all the same: Xen's netfront,
/// whose backend passes other guests' frames on with the checksum left blank
/// (`NETRXF_csum_blank`) and which runs XDP on them as they are. virtio-net, the other common
/// one, turns its receive checksum offload off when XDP is attached, or refuses XDP.
fn hardware_backing(sysfs_net: &Path, device: &str, identity: &LinkIdentity) -> Result<String, String> {
    let dir = sysfs_net.join(device);
    let read = |name: &str| std::fs::read_to_string(dir.join(name));
    let (Ok(ifindex), Ok(address)) = (read("ifindex"), read("address")) else {
        return Err(format!("{} does not show it (a sysfs of another network namespace?)", dir.display()));
    };
    if !identity.matches(&ifindex, &address) {
        return Err(format!(
            "{} is another device of that name (a sysfs of another network namespace)",
            dir.display()
        ));
    }
    let parent = dir.join("device");
    let Ok(parent_path) = std::fs::canonicalize(&parent) else {
        return Err("a virtual device (no parent device in sysfs)".to_owned());
    };
    let name = |path: &Path| path.file_name().map(|name| name.to_string_lossy().into_owned());
    let parent_name = name(&parent_path).unwrap_or_default();
    let bus = std::fs::canonicalize(parent.join("subsystem"))
        .ok()
        .and_then(|path| name(&path))
        .unwrap_or_else(|| "an unknown bus's".to_owned());
    if bus == "xen" {
        return Err(format!("a Xen netfront ({parent_name}), which hands XDP frames with blank checksums"));
    }
    Ok(format!("{bus} device {parent_name}"))
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

/// Unpins (detaching) XDP links of devices that are not served, get no XDP, or another mode.
fn detach_stale(pin_dir: &PinDir, devices: &BTreeMap<String, XdpMode>) -> anyhow::Result<()> {
    for entry in std::fs::read_dir(pin_dir.links())? {
        let path = entry?.path();
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        if !is_xdp_pin(&name) {
            continue;
        }
        let keep = devices
            .iter()
            .any(|(device, &mode)| mode != XdpMode::Off && link_pin(pin_dir, device, mode) == path);
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

/// `SIOCGIFHWADDR`: the device's hardware address in this network namespace.
fn hardware_address(device: &str) -> io::Result<[u8; 14]> {
    // SAFETY: plain system call; the descriptor is owned right away.
    let socket = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if socket < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor that nothing else owns.
    let socket = unsafe { OwnedFd::from_raw_fd(socket) };
    // SAFETY: all-zero is a valid ifreq; the kernel copies back as many address bytes as the
    // device has and leaves the rest zero.
    let mut request: libc::ifreq = unsafe { std::mem::zeroed() };
    let name = device.as_bytes();
    if name.len() >= request.ifr_name.len() {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "interface name too long"));
    }
    for (to, from) in request.ifr_name.iter_mut().zip(name) {
        *to = *from as libc::c_char;
    }
    // SAFETY: `request` is a valid ifreq that outlives the call.
    if unsafe { libc::ioctl(socket.as_raw_fd(), libc::SIOCGIFHWADDR as _, &mut request) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: SIOCGIFHWADDR filled the hardware-address member.
    let data = unsafe { request.ifr_ifru.ifru_hwaddr.sa_data };
    Ok(data.map(|byte| byte as u8))
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::symlink;

    use super::*;

    const MAC: &str = "02:aa:00:00:00:01";

    fn identity(ifindex: u32) -> LinkIdentity {
        let mut address = [0; 14];
        address[..6].copy_from_slice(&[0x02, 0xaa, 0, 0, 0, 1]);
        LinkIdentity { ifindex, address }
    }

    /// A sysfs tree in the temp dir, shaped like the kernel's: `class/net/<device>` with
    /// `ifindex`, `address` and, for a NIC, `device` linking to its parent under `devices/`,
    /// whose `subsystem` links to its bus under `bus/`.
    struct FakeSysfs(PathBuf);

    impl FakeSysfs {
        fn new() -> Self {
            static COUNTER: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
            let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let root = std::env::temp_dir().join(format!("vipr-fake-sysfs-{}-{n}", std::process::id()));
            std::fs::create_dir_all(root.join("class/net")).unwrap();
            Self(root)
        }

        fn net(&self) -> PathBuf {
            self.0.join("class/net")
        }

        /// `parent`: the parent device's path under `devices/` and its bus.
        fn device(&self, name: &str, ifindex: u32, address: &str, parent: Option<(&str, &str)>) {
            let dir = self.net().join(name);
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("ifindex"), format!("{ifindex}\n")).unwrap();
            std::fs::write(dir.join("address"), format!("{address}\n")).unwrap();
            if let Some((path, bus)) = parent {
                let parent = self.0.join("devices").join(path);
                let bus = self.0.join("bus").join(bus);
                std::fs::create_dir_all(&parent).unwrap();
                std::fs::create_dir_all(&bus).unwrap();
                symlink(&bus, parent.join("subsystem")).unwrap();
                symlink(&parent, dir.join("device")).unwrap();
            }
        }
    }

    impl Drop for FakeSysfs {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn nics_are_backed_by_hardware_and_made_up_devices_are_not() {
        let sysfs = FakeSysfs::new();
        sysfs.device("eth0", 2, MAC, Some(("pci0000:00/0000:00:03.0", "pci")));
        sysfs.device("ens4", 3, MAC, Some(("pci0000:00/0000:00:04.0/virtio2", "virtio")));
        sysfs.device("eth1", 4, MAC, Some(("vif-0", "xen")));
        for virtual_device in ["veth1a2b", "cni0", "vxlan.calico", "tunl0", "bond0"] {
            sysfs.device(virtual_device, 5, MAC, None);
        }
        let judge = |device: &str, ifindex| hardware_backing(&sysfs.net(), device, &identity(ifindex));

        assert_eq!(judge("eth0", 2), Ok("pci device 0000:00:03.0".to_owned()));
        assert_eq!(judge("ens4", 3), Ok("virtio device virtio2".to_owned()));
        let xen = judge("eth1", 4).unwrap_err();
        assert!(xen.contains("Xen netfront"), "{xen}");
        for virtual_device in ["veth1a2b", "cni0", "vxlan.calico", "tunl0", "bond0"] {
            let reason = judge(virtual_device, 5).unwrap_err();
            assert!(reason.contains("virtual device"), "{virtual_device}: {reason}");
        }
    }

    /// An agent that entered the node's network namespace without mounting its sysfs sees
    /// another namespace's devices: a NIC there must not make a veth of the same name look
    /// like hardware.
    #[test]
    fn a_sysfs_of_another_namespace_is_not_believed() {
        let sysfs = FakeSysfs::new();
        sysfs.device("eth0", 2, MAC, Some(("pci0000:00/0000:00:03.0", "pci")));
        let judge = |device: &str, identity: &LinkIdentity| hardware_backing(&sysfs.net(), device, identity);

        assert!(judge("eth0", &identity(2)).is_ok());
        let absent = judge("eth9", &identity(2)).unwrap_err();
        assert!(absent.contains("does not show it"), "{absent}");
        let other_index = judge("eth0", &identity(7)).unwrap_err();
        assert!(other_index.contains("another device of that name"), "{other_index}");
        let mut other_address = identity(2);
        other_address.address[5] = 2;
        let other_address = judge("eth0", &other_address).unwrap_err();
        assert!(other_address.contains("another device of that name"), "{other_address}");
    }

    #[test]
    fn addresses_compare_as_sysfs_prints_them() {
        assert!(identity(2).matches("2\n", "02:aa:00:00:00:01\n"));
        assert!(!identity(2).matches("2", "02:aa:00:00:00:02"));
        assert!(!identity(2).matches("2", "02:aa:00:00:00"), "a shorter address is another");
        assert!(!identity(2).matches("x", MAC));
        assert!(!identity(2).matches("2", "not:an:address"));
        // Devices without an address (tun, WireGuard) print an empty line.
        let none = LinkIdentity { ifindex: 9, address: [0; 14] };
        assert!(none.matches("9", "\n"));
        // InfiniBand's 20-byte addresses do not fit SIOCGIFHWADDR's 14.
        let long = LinkIdentity { ifindex: 9, address: [0xab; 14] };
        assert!(long.matches("9", &["ab"; 20].join(":")));
    }

    #[test]
    fn loopback_in_the_real_sysfs_is_virtual() {
        let identity = LinkIdentity::of("lo").unwrap();
        let reason = hardware_backing(Path::new(SYSFS_NET), "lo", &identity).unwrap_err();
        assert!(reason.contains("virtual device"), "{reason}");
    }
}
