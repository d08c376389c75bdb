//! The ethtool ioctls the tests need (the ethtool program is not part of the test set-up):
//! offload settings and the driver's statistics, of a device in the calling thread's network
//! namespace (call them inside [`crate::Netns::run`]).
use std::{
    collections::BTreeMap,
    io,
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
};

use anyhow::{ensure, Context as _, Result};

/// A setting's get and set commands, and its name.
#[derive(Clone, Copy)]
pub struct Setting(u32, u32, &'static str);

pub const TX_CHECKSUM: Setting = Setting(0x16, 0x17, "tx checksum offload");
pub const GRO: Setting = Setting(0x2b, 0x2c, "GRO");
const GSTRINGS: u32 = 0x1b;
const GSTATS: u32 = 0x1d;
const GSSET_INFO: u32 = 0x37;
const SS_STATS: u32 = 1;
const GSTRING_LEN: usize = 32;

/// SIOCETHTOOL: `command` is the ethtool structure, which the kernel reads and fills in.
fn ioctl(device: &str, command: &mut [u8]) -> io::Result<()> {
    // SAFETY: plain system call; the descriptor is owned right away.
    let socket = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if socket < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor nothing else owns.
    let socket = unsafe { OwnedFd::from_raw_fd(socket) };
    // SAFETY: all-zero is a valid ifreq.
    let mut request: libc::ifreq = unsafe { std::mem::zeroed() };
    for (to, from) in request.ifr_name.iter_mut().zip(device.as_bytes().iter().take(libc::IFNAMSIZ - 1)) {
        *to = *from as libc::c_char;
    }
    request.ifr_ifru.ifru_data = command.as_mut_ptr().cast();
    // SAFETY: `request` and the buffer it points to outlive the call; every command below
    // sizes its buffer for what the kernel writes back.
    if unsafe { libc::ioctl(socket.as_raw_fd(), libc::SIOCETHTOOL as _, &mut request) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn words(words: &[u32], extra: usize) -> Vec<u8> {
    let mut buffer: Vec<u8> = words.iter().flat_map(|word| word.to_ne_bytes()).collect();
    buffer.resize(buffer.len() + extra, 0);
    buffer
}

fn word(buffer: &[u8], offset: usize) -> u32 {
    u32::from_ne_bytes(buffer[offset..offset + 4].try_into().expect("4 bytes"))
}

pub fn get(setting: Setting, device: &str) -> Result<bool> {
    let mut value = words(&[setting.0, 0], 0);
    ioctl(device, &mut value).with_context(|| format!("cannot read {} of {device}", setting.2))?;
    Ok(word(&value, 4) != 0)
}

pub fn set(setting: Setting, device: &str, on: bool) -> Result<()> {
    let name = setting.2;
    let mut value = words(&[setting.1, u32::from(on)], 0);
    ioctl(device, &mut value).with_context(|| format!("cannot turn {name} of {device} {on}"))?;
    ensure!(get(setting, device)? == on, "{name} of {device} did not change");
    Ok(())
}

/// `ethtool -S`: the driver's statistics by name.
pub fn stats(device: &str) -> Result<BTreeMap<String, u64>> {
    // struct ethtool_sset_info: cmd, reserved, a u64 mask of the sets, their counts.
    let mut info = words(&[GSSET_INFO, 0], 12);
    info[8..16].copy_from_slice(&(1u64 << SS_STATS).to_ne_bytes());
    ioctl(device, &mut info).with_context(|| format!("no statistics for {device}"))?;
    let count = word(&info, 16) as usize;
    let mut names = words(&[GSTRINGS, SS_STATS, 0], count * GSTRING_LEN);
    ioctl(device, &mut names).with_context(|| format!("no statistics names for {device}"))?;
    let mut values = words(&[GSTATS, 0], count * 8);
    ioctl(device, &mut values).with_context(|| format!("no statistics of {device}"))?;
    ensure!(
        word(&names, 8) as usize == count && word(&values, 4) as usize == count,
        "{device}: counts changed"
    );
    Ok((0..count)
        .map(|i| {
            let name = &names[12 + i * GSTRING_LEN..12 + (i + 1) * GSTRING_LEN];
            let name = String::from_utf8_lossy(name.split(|byte| *byte == 0).next().unwrap_or_default());
            let value = u64::from_ne_bytes(values[8 + i * 8..16 + i * 8].try_into().expect("8 bytes"));
            (name.into_owned(), value)
        })
        .collect())
}

/// The sum over a device's receive queues of one of its XDP counters (veth's
/// `rx_queue_N_<counter>`: `xdp_redirect`, `xdp_tx`, `xdp_drops`, ...), which the driver keeps
/// whether or not BPF run statistics are on.
pub fn xdp_counter(device: &str, counter: &str) -> Result<u64> {
    let stats = stats(device)?;
    let suffix = format!("_{counter}");
    let queues: Vec<u64> = stats
        .iter()
        .filter(|(name, _)| name.starts_with("rx_queue_") && name.ends_with(&suffix))
        .map(|(_, value)| *value)
        .collect();
    ensure!(!queues.is_empty(), "{device} has no {counter} counters: {stats:?}");
    Ok(queues.iter().sum())
}
