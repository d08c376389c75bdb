//! Pinned maps whose capacity differs from the one asked for (`--bpf-*-max`) are migrated
//! at start, so that a new size applies without `vipr --cleanup` and without breaking the
//! connections the maps track.
//!
//! The loader reuses a pinned map as it is. So before loading, the pin of each map whose size
//! differs is moved aside (pinned again as `<name>_resizing`, then unpinned): the loader then
//! creates the map anew at the
//! asked size and pins it under its name, while the old map lives on, used by the programs
//! still attached. Before the new programs are attached, every entry is copied into the new
//! map, so they never find it empty; once they serve, what the old programs added meanwhile
//! (connections opened during the switch) is copied too, and the old pin removed, which
//! frees the old map. A new map too small for the old entries takes what fits, connections
//! that cannot be evicted (established ones) before the others; how many were left out is
//! logged. An agent that dies half way finds the aside pin at its next start and copies
//! from it then.
use std::{
    os::fd::{AsFd as _, BorrowedFd},
    path::PathBuf,
};

use aya::{
    maps::{MapData, MapType},
    Ebpf,
};
use proxy_common::{flow_state, pins, Flow4, Flow6};
use tracing::{info, warn};

use super::{map_data, pin_dir::PinDir};
use crate::bpf_sys::{self, BPF_NOEXIST};

/// The suffix of a map's pin while it is being replaced.
const ASIDE: &str = "_resizing";

/// The old maps being replaced.
#[derive(Default)]
pub struct Resizing {
    maps: Vec<OldMap>,
}

struct OldMap {
    name: &'static str,
    map: MapData,
    aside: PathBuf,
}

/// What one copy did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Copied {
    copied: u64,
    /// Entries the new map had no room for.
    dropped: u64,
}

impl Resizing {
    /// Before the object is loaded: moves aside the pin of every map of `wanted` whose
    /// `max_entries` differs from the size asked for, so that the loader creates it anew. A
    /// pin that cannot be moved keeps its map and size (logged).
    pub fn set_aside(pin_dir: &PinDir, wanted: &[(&'static str, u32)]) -> Self {
        let mut maps = Vec::new();
        for &(name, size) in wanted {
            let pin = pin_dir.path().join(name);
            let aside = pin_dir.path().join(format!("{name}{ASIDE}"));
            if aside.exists() {
                // An earlier agent stopped half way: the old map is still there to copy from.
                match MapData::from_pin(&aside) {
                    Ok(map) => {
                        info!(map = name, "resuming the migration of a resized map");
                        maps.push(OldMap { name, map, aside });
                        continue;
                    }
                    Err(error) => {
                        warn!(pin = %aside.display(), %error, "removing an unreadable pin of a resized map");
                        let _ = std::fs::remove_file(&aside);
                    }
                }
            }
            let Ok(map) = MapData::from_pin(&pin) else { continue };
            let Ok(info) = map.info() else { continue };
            if info.max_entries() == size {
                continue;
            }
            // Pinned a second time, then unpinned: at no moment is the map without a pin.
            let moved = map
                .pin(&aside)
                .map_err(|error| std::io::Error::other(error.to_string()))
                .and_then(|()| std::fs::remove_file(&pin));
            match moved {
                Ok(()) => {
                    info!(map = name, from = info.max_entries(), to = size, "resizing a pinned map");
                    maps.push(OldMap { name, map, aside });
                }
                Err(error) => {
                    let _ = std::fs::remove_file(&aside);
                    warn!(
                    map = name,
                    kept = info.max_entries(),
                    requested = size,
                    %error,
                    "cannot move the pinned map aside; it keeps its size"
                    );
                }
            }
        }
        Self { maps }
    }

    /// After the load, before the new programs are attached: copies every old map's entries
    /// into the new one.
    pub fn copy(&self, ebpf: &Ebpf) {
        for old in &self.maps {
            let Some(new) = ebpf.map(old.name).and_then(map_data) else {
                warn!(map = old.name, "the resized map is missing from the object");
                continue;
            };
            match copy_entries(old.name, &old.map, new) {
                Ok(Copied { copied, dropped: 0 }) => {
                    info!(map = old.name, copied, "copied into the resized map")
                }
                Ok(Copied { copied, dropped }) => warn!(
                    map = old.name,
                    copied,
                    dropped,
                    "the resized map is too small for every entry; those that did not fit are dropped"
                ),
                Err(error) => warn!(map = old.name, %error, "cannot copy into the resized map"),
            }
        }
    }

    /// Once the new programs serve: copies what the old ones added since [`Self::copy`] and
    /// removes the old pins, which frees the old maps.
    pub fn finish(self, ebpf: &Ebpf) {
        for old in self.maps {
            if let Some(new) = ebpf.map(old.name).and_then(map_data) {
                match copy_entries(old.name, &old.map, new) {
                    Ok(Copied { dropped: 0, .. }) => {}
                    Ok(Copied { dropped, .. }) => {
                        warn!(map = old.name, dropped, "entries added during the switch did not fit");
                    }
                    Err(error) => warn!(map = old.name, %error, "cannot copy into the resized map"),
                }
            }
            match std::fs::remove_file(&old.aside) {
                Ok(()) => info!(map = old.name, "resized; the old map is unpinned"),
                Err(error) => warn!(pin = %old.aside.display(), %error, "cannot remove the old map's pin"),
            }
        }
    }
}

/// Copies `from`'s entries into `to`, never replacing an entry `to` has (the new programs'
/// entries are the newer). Array entries beyond `to`'s size, and hash entries `to` has no room
/// for, are dropped; into a smaller flows map, connections that cannot be evicted go first.
fn copy_entries(name: &str, old: &MapData, new: &MapData) -> anyhow::Result<Copied> {
    let info = old.info()?;
    let new_size = new.info()?.max_entries();
    let (from, to): (BorrowedFd<'_>, BorrowedFd<'_>) = (old.fd().as_fd(), new.fd().as_fd());
    let map_type = info.map_type()?;
    let per_cpu = matches!(map_type, MapType::PerCpuArray | MapType::PerCpuHash | MapType::LruPerCpuHash);
    let array = matches!(map_type, MapType::Array | MapType::PerCpuArray);
    let cpus = if per_cpu { aya::util::nr_cpus().map_err(|(_, error)| error)? } else { 1 };
    let value_len = if per_cpu {
        (info.value_size() as usize).next_multiple_of(8) * cpus
    } else {
        info.value_size() as usize
    };
    let key_len = info.key_size() as usize;

    // Read everything first: the walk of a map the old programs still write may restart, so
    // it stops after twice the old capacity.
    let mut entries: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
    let mut key: Option<Vec<u8>> = None;
    let mut next = vec![0u8; key_len];
    for _ in 0..u64::from(info.max_entries()) * 2 {
        if !bpf_sys::next_key(from, key.as_deref(), &mut next)? {
            break;
        }
        let mut value = vec![0u8; value_len];
        if bpf_sys::lookup(from, &next, &mut value)? {
            entries.push((next.clone(), value));
        }
        key = Some(next.clone());
    }
    if let Some(evictable) = flow_evictable(name) {
        entries.sort_by_key(|(_, value)| evictable(value));
    }
    let mut copied = Copied::default();
    for (key, value) in &entries {
        if array {
            let index = u32::from_ne_bytes(key[..4].try_into()?);
            if index >= new_size {
                copied.dropped += u64::from(value.iter().any(|byte| *byte != 0));
                continue;
            }
        }
        // Arrays have every index already: only a plain update writes them.
        let flags = if array { 0 } else { BPF_NOEXIST };
        match bpf_sys::update(to, key, value, flags) {
            Ok(()) => copied.copied += 1,
            Err(error) if error.raw_os_error() == Some(libc::EEXIST) => {}
            Err(error) if matches!(error.raw_os_error(), Some(libc::E2BIG | libc::ENOSPC | libc::ENOMEM)) => {
                copied.dropped += 1;
            }
            Err(error) => return Err(error.into()),
        }
    }
    Ok(copied)
}

/// For a flows map, whether a raw value is a connection that may be evicted (copied last).
fn flow_evictable(name: &str) -> Option<fn(&[u8]) -> bool> {
    fn state<T: Copy>(value: &[u8], track: impl Fn(&T) -> u32) -> bool {
        if value.len() < size_of::<T>() {
            return true;
        }
        // SAFETY: `value` holds at least a `T`, a plain `#[repr(C)]` map value; unaligned read.
        let flow: T = unsafe { std::ptr::read_unaligned(value.as_ptr().cast()) };
        flow_state::evictable(track(&flow))
    }
    match name {
        pins::FLOWS4 => Some(|value| state::<Flow4>(value, |flow| flow.track.state)),
        pins::FLOWS6 => Some(|value| state::<Flow6>(value, |flow| flow.track.state)),
        _ => None,
    }
}
