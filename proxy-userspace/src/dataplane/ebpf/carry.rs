//! Entries carried from an earlier agent's maps into this one's, so that neither a new map size
//! (`--bpf-*-max`) nor a new map layout breaks the connections the maps track.
//!
//! **Resized maps.** The loader reuses a pinned map as it is. So before loading, the pin of
//! each map whose size differs is moved aside (pinned again as `<name>_resizing`, then
//! unpinned): the loader then creates the map anew at the asked size and pins it under its
//! name, while the old map lives on, used by the programs still attached.
//!
//! **Retired layouts** ([`proxy_common::legacy`]). A flows map of an earlier layout keeps its
//! own pin name (`vipr_flow4_v3`); the loader creates the current one beside it. Its entries
//! are converted to the current layout as they are copied.
//!
//! Either way the old map stays in use by the earlier programs until the switch
//! ([`super::EbpfDataplane`] defers attaching the new programs until the first complete sync):
//! every entry is copied into the new map after the load, so the new programs never find it
//! empty; right before the switch again, overwriting (the old programs were the ones serving,
//! so their entries are the truth); once the new TC programs serve, what the old ones added
//! in between is copied without overwriting; and once every hook runs the new programs, the
//! old pin is removed, which frees the old map. A new map too small for the old entries takes
//! what fits, connections that cannot be evicted (established ones) before the others; how
//! many were left out is logged.
//!
//! A connection the old programs open after the copy before the switch has no entry in the new
//! map until the copy after it: its next packets reach the new programs meanwhile. A TCP packet
//! past its handshake is therefore held (dropped, and retransmitted by its sender) while the
//! switch runs, instead of being balanced anew to a backend that would reset the connection
//! ([`Carrying::hold_mid_stream`]). (A reply of such a connection in that moment passes
//! without its reverse NAT; the copy after the switch shortens the moment to the attaches'.)
//!
//! The old pin goes last because it marks the switch as unfinished: an agent that dies at any
//! point before finds the aside pin (or the retired one) at its next start and redoes the
//! whole switch. Had the dead agent attached its TC programs already, they served with the new
//! maps since: the redo's overwriting copy then replaces an entry only with a fresher one (a
//! later `last_seen`, or affinity `since`), so a connection those programs opened, even on the
//! address and port of an older one the old map still holds, keeps its backend.
use std::{
    os::fd::{AsFd as _, BorrowedFd},
    path::PathBuf,
    time::Duration,
};

use aya::maps::{Array, Map, MapData, MapType};
use proxy_common::{
    flow_state,
    legacy::{self, Flow4V3, Flow6V3},
    pins, Affinity4, Affinity6, Flow4, Flow6,
};
use tracing::{info, warn};

use super::pin_dir::PinDir;
use crate::bpf_sys::{self, BPF_NOEXIST};

/// The suffix of a map's pin while it is being replaced.
const ASIDE: &str = "_resizing";

/// How long the new programs hold back a TCP packet past its handshake that finds no entry,
/// from the start of the switch ([`Carrying::hold_mid_stream`]): longer than the copies of a
/// full flows map take, short enough that an agent killed mid-switch (which never lifts the
/// hold) delays such packets only by a retransmission or two.
const MID_STREAM_HOLD: Duration = Duration::from_secs(5);

/// The old maps whose entries are carried into new ones.
#[derive(Default)]
pub struct Carrying {
    maps: Vec<OldMap>,
    /// Where the new maps are pinned: they are opened there, since the dataplane takes some
    /// out of the loaded object.
    dir: PathBuf,
    /// The new TC programs serve (see [`Self::copy_added`]).
    switched: bool,
}

struct OldMap {
    /// The new map's name.
    name: &'static str,
    map: MapData,
    /// The old map's pin, removed once its entries are carried.
    aside: PathBuf,
    /// Converts a raw entry of the old layout to the new one; `None` for a resized map (the
    /// same layout).
    convert: Option<Convert>,
}

/// Converts an old entry's raw value to the new layout (the keys of the converted layouts did
/// not change).
type Convert = fn(&[u8]) -> Vec<u8>;

/// What one copy did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Copied {
    copied: u64,
    /// Entries the new map had no room for.
    dropped: u64,
    /// Entries an overwriting copy left alone: the new map's were fresher.
    kept_fresher: u64,
}

impl Carrying {
    /// Before the object is loaded: moves aside the pin of every map of `wanted` whose
    /// `max_entries` differs from the size asked for, so that the loader creates it anew (a
    /// pin that cannot be moved keeps its map and size, logged), and opens the pinned maps of
    /// retired layouts whose entries are converted.
    pub fn set_aside(pin_dir: &PinDir, wanted: &[(&'static str, u32)]) -> Self {
        let mut maps = Vec::new();
        for legacy::Converted { retired, current } in legacy::CONVERTED {
            let pin = pin_dir.path().join(retired);
            match MapData::from_pin(&pin) {
                Ok(map) => {
                    info!(from = retired, to = current, "carrying the entries of a retired map layout over");
                    maps.push(OldMap { name: current, map, aside: pin, convert: Some(converter(retired)) });
                }
                Err(error) if pin.exists() => {
                    warn!(pin = %pin.display(), %error, "cannot open a retired map; its entries are lost")
                }
                Err(_) => {}
            }
        }
        for &(name, size) in wanted {
            let pin = pin_dir.path().join(name);
            let aside = pin_dir.path().join(format!("{name}{ASIDE}"));
            if aside.exists() {
                // An earlier agent stopped half way: the old map is still there to copy from.
                match MapData::from_pin(&aside) {
                    Ok(map) => {
                        info!(map = name, "resuming the migration of a resized map");
                        maps.push(OldMap { name, map, aside, convert: None });
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
                    maps.push(OldMap { name, map, aside, convert: None });
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
        Self { maps, dir: pin_dir.path().to_path_buf(), switched: false }
    }

    /// The new map `name`, as pinned by the loader.
    fn new_map(&self, name: &str) -> Option<MapData> {
        MapData::from_pin(self.dir.join(name))
            .map_err(|error| warn!(map = name, %error, "cannot open the new map"))
            .ok()
    }

    /// Whether there is anything to carry: the earlier programs must then serve until the
    /// new maps are complete.
    pub fn is_empty(&self) -> bool {
        self.maps.is_empty()
    }

    /// After the load, before the agent adopts the maps: copies every old map's entries into
    /// the new one.
    pub fn copy_all(&self) {
        for old in &self.maps {
            self.copy(old, false);
        }
    }

    /// Right before the switch: copies the entries the old programs created (connections,
    /// affinity) again, replacing those copied before: the old programs served until now, so
    /// theirs are the current ones, unless the new map's entry is fresher (an agent killed
    /// mid-switch left its TC programs serving with the new maps; see the module's doc). The maps the agent writes are left to its sync, which has
    /// written them by now (copying them again would bring back what it deleted).
    /// Skipped once [`Self::copy_added`] ran (a switch retried after a hook failed): the new
    /// programs serve then, and their entries are the current ones.
    pub fn refresh_connections(&self) {
        if self.switched {
            return;
        }
        for old in self.maps.iter().filter(|old| written_by_datapath(old.name)) {
            self.copy(old, true);
        }
    }

    /// Right before the switch: until the connections the old programs add meanwhile are
    /// copied ([`Self::copy_added`]), a TCP packet past its handshake that finds no entry in the
    /// new map is dropped by the new programs, not balanced anew (see
    /// [`pins::SWITCH_DEADLINE`]); lifted by [`Self::release`], or by itself after
    /// [`MID_STREAM_HOLD`].
    pub fn hold_mid_stream(&self) {
        if !self.maps.is_empty() {
            let deadline = super::reaper::monotonic_coarse_ns() + MID_STREAM_HOLD.as_nanos() as u64;
            self.set_switch_deadline(deadline);
        }
    }

    fn set_switch_deadline(&self, deadline: u64) {
        let written = self
            .new_map(pins::SWITCH_DEADLINE)
            .ok_or_else(|| anyhow::anyhow!("not pinned"))
            .and_then(|map| Ok(Array::<MapData, u64>::try_from(Map::Array(map))?))
            .and_then(|mut array| Ok(array.set(0, deadline, 0)?));
        if let Err(error) = written {
            warn!(map = pins::SWITCH_DEADLINE, %error, "cannot write the switch's deadline");
        }
    }

    fn copy(&self, old: &OldMap, overwrite: bool) {
        let Some(new) = self.new_map(old.name) else { return };
        match copy_entries(old, &new, overwrite) {
            Ok(Copied { copied, dropped: 0, kept_fresher }) => {
                info!(map = old.name, from = %old.aside.display(), copied, kept_fresher, "copied into the new map")
            }
            Ok(Copied { copied, dropped, .. }) => warn!(
                map = old.name,
                copied,
                dropped,
                "the new map is too small for every entry; those that did not fit are dropped"
            ),
            Err(error) => warn!(map = old.name, %error, "cannot copy into the new map"),
        }
    }

    /// Once the new TC programs serve: copies the connections the old programs added since
    /// [`Self::refresh_connections`] (never over the new programs' entries, which are the
    /// newer from now on).
    pub fn copy_added(&mut self) {
        self.switched = true;
        for old in &self.maps {
            if let Some(new) = self.new_map(old.name).filter(|_| written_by_datapath(old.name)) {
                match copy_entries(old, &new, false) {
                    Ok(Copied { dropped: 0, .. }) => {}
                    Ok(Copied { dropped, .. }) => {
                        warn!(map = old.name, dropped, "entries added during the switch did not fit");
                    }
                    Err(error) => warn!(map = old.name, %error, "cannot copy into the new map"),
                }
            }
        }
    }

    /// The last step of the switch, once every hook runs the new programs: lifts the hold of
    /// [`Self::hold_mid_stream`] and removes the old pins, which frees the old maps. Last,
    /// because an old pin is what tells the next agent that the switch is unfinished: one
    /// killed before this step is redone whole by the next.
    pub fn release(self) {
        if !self.maps.is_empty() {
            self.set_switch_deadline(0);
        }
        for old in &self.maps {
            match std::fs::remove_file(&old.aside) {
                Ok(()) => {
                    info!(map = old.name, old = %old.aside.display(), "carried over; the old map is unpinned")
                }
                Err(error) => warn!(pin = %old.aside.display(), %error, "cannot remove the old map's pin"),
            }
        }
    }
}

/// Copies `old`'s entries into `new`, converted to its layout, replacing an entry `new` has
/// only with `overwrite` (otherwise the new programs' entries are the newer), and then only
/// with one at least as fresh where the entries say when they were used. Array entries
/// beyond `new`'s size, and hash entries `new` has no room for, are dropped; into a smaller
/// flows map, connections that cannot be evicted go first.
fn copy_entries(from_map: &OldMap, new: &MapData, overwrite: bool) -> anyhow::Result<Copied> {
    let (name, old) = (from_map.name, &from_map.map);
    let info = old.info()?;
    let new_info = new.info()?;
    let new_size = new_info.max_entries();
    let (from, to): (BorrowedFd<'_>, BorrowedFd<'_>) = (old.fd().as_fd(), new.fd().as_fd());
    let map_type = info.map_type()?;
    let per_cpu = matches!(map_type, MapType::PerCpuArray | MapType::PerCpuHash | MapType::LruPerCpuHash);
    let array = matches!(map_type, MapType::Array | MapType::PerCpuArray);
    let cpus = if per_cpu { aya::util::nr_cpus().map_err(|(_, error)| error)? } else { 1 };
    // The bytes the kernel reads and writes for one value: a per-CPU map's, one 8-byte aligned
    // copy per possible CPU.
    let value_bytes = |value_size: u32| {
        if per_cpu {
            (value_size as usize).next_multiple_of(8) * cpus
        } else {
            value_size as usize
        }
    };
    let (value_len, new_value_len) = (value_bytes(info.value_size()), value_bytes(new_info.value_size()));
    let key_len = info.key_size() as usize;
    // Versioned pin names keep a layout's keys, and its values unless converted; a pin of
    // another layout under the name (by hand, or a bug) is refused, not read past its end.
    if new_info.key_size() != info.key_size() {
        anyhow::bail!("the new map's keys are {} bytes, the old one's {}", new_info.key_size(), key_len);
    }

    // Read everything first: the walk of a map the old programs still write may restart, so
    // it stops after twice the old capacity.
    let mut entries: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
    let mut key: Option<Vec<u8>> = None;
    let mut next = vec![0u8; key_len];
    for _ in 0..u64::from(info.max_entries()) * 2 {
        // SAFETY (the old map's calls): the buffers are sized from the map's own description
        // (`info`), per-CPU values one per possible CPU.
        if !unsafe { bpf_sys::next_key(from, key.as_deref(), &mut next) }? {
            break;
        }
        let mut value = vec![0u8; value_len];
        if unsafe { bpf_sys::lookup(from, &next, &mut value) }? {
            let value = match from_map.convert {
                Some(convert) => convert(&value),
                None => value,
            };
            entries.push((next.clone(), value));
        }
        key = Some(next.clone());
    }
    if let Some(evictable) = flow_evictable(name) {
        entries.sort_by_key(|(_, value)| evictable(value));
    }
    // Only hash maps the programs write have a freshness (not per-CPU): the new map's value,
    // of the new layout, is read whole (the kernel writes its value size).
    let fresher = if overwrite { freshness(name) } else { None };
    let mut current = vec![0u8; new_value_len];
    let mut copied = Copied::default();
    for (key, value) in &entries {
        if value.len() != new_value_len {
            anyhow::bail!("an entry of {} bytes for the new map's values of {new_value_len}", value.len());
        }
        if let Some(used_at) = fresher {
            // SAFETY: `current` has the new map's value size, and the keys are of both maps'
            // key size (checked above).
            if unsafe { bpf_sys::lookup(to, key, &mut current) }? && used_at(&current) > used_at(value) {
                copied.kept_fresher += 1;
                continue;
            }
        }
        if array {
            let index = u32::from_ne_bytes(key[..4].try_into()?);
            if index >= new_size {
                copied.dropped += u64::from(value.iter().any(|byte| *byte != 0));
                continue;
            }
        }
        // Arrays have every index already: only a plain update writes them.
        let flags = if array || overwrite { 0 } else { BPF_NOEXIST };
        // SAFETY: as for the lookup above; the value has the new map's size (checked above).
        match unsafe { bpf_sys::update(to, key, value, flags) } {
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

/// Whether the programs create the entries of the map `name` as packets pass (flows, session
/// affinity): those change while the old programs serve, the others only by the agent.
fn written_by_datapath(name: &str) -> bool {
    [pins::FLOWS4, pins::FLOWS6, pins::AFFINITY4, pins::AFFINITY6].contains(&name)
}

/// A raw map value as the plain `#[repr(C)]` value `T`, if it is long enough.
fn read_value<T: Copy>(value: &[u8]) -> Option<T> {
    // SAFETY: `value` holds at least a `T`, valid for any bytes; the read is unaligned.
    (value.len() >= size_of::<T>()).then(|| unsafe { std::ptr::read_unaligned(value.as_ptr().cast()) })
}

/// For a flows map, whether a raw value is a connection that may be evicted (copied last).
fn flow_evictable(name: &str) -> Option<fn(&[u8]) -> bool> {
    match name {
        pins::FLOWS4 => Some(|value| {
            read_value::<Flow4>(value).is_none_or(|flow| flow_state::evictable(flow.track.state))
        }),
        pins::FLOWS6 => Some(|value| {
            read_value::<Flow6>(value).is_none_or(|flow| flow_state::evictable(flow.track.state))
        }),
        _ => None,
    }
}

/// For a map the programs write, when a raw value was last used (`bpf_ktime_get_coarse_ns`):
/// a connection's latest packet, an affinity's latest new connection.
fn freshness(name: &str) -> Option<fn(&[u8]) -> u64> {
    match name {
        pins::FLOWS4 => Some(|value| read_value::<Flow4>(value).map_or(0, |flow| flow.track.last_seen)),
        pins::FLOWS6 => Some(|value| read_value::<Flow6>(value).map_or(0, |flow| flow.track.last_seen)),
        pins::AFFINITY4 => Some(|value| read_value::<Affinity4>(value).map_or(0, |affinity| affinity.since)),
        pins::AFFINITY6 => Some(|value| read_value::<Affinity6>(value).map_or(0, |affinity| affinity.since)),
        _ => None,
    }
}

/// The conversion of a retired layout's raw values.
fn converter(retired: &str) -> Convert {
    /// Reads an old value and writes the new one's bytes.
    fn convert<Old: Copy, New: From<Old>>(value: &[u8]) -> Vec<u8> {
        let mut old = std::mem::MaybeUninit::<Old>::zeroed();
        let len = value.len().min(size_of::<Old>());
        // SAFETY: at most `size_of::<Old>()` bytes are written into a zeroed `Old`, a plain
        // `#[repr(C)]` map value valid for any bytes.
        let old = unsafe {
            std::ptr::copy_nonoverlapping(value.as_ptr(), old.as_mut_ptr().cast::<u8>(), len);
            old.assume_init()
        };
        let new = New::from(old);
        // SAFETY: `New` is a plain `#[repr(C)]` map value without implicit padding.
        unsafe { std::slice::from_raw_parts(std::ptr::from_ref(&new).cast::<u8>(), size_of::<New>()) }
            .to_vec()
    }
    match retired {
        legacy::FLOWS6_V2 | legacy::FLOWS6_V3 => convert::<Flow6V3, Flow6>,
        _ => convert::<Flow4V3, Flow4>,
    }
}

#[cfg(test)]
mod tests {
    use proxy_common::{flow_flags, FlowTrack, NextHop};

    use super::*;

    fn bytes<T>(value: &T) -> Vec<u8> {
        // SAFETY: plain `#[repr(C)]` map values without implicit padding.
        unsafe { std::slice::from_raw_parts(std::ptr::from_ref(value).cast::<u8>(), size_of::<T>()) }.to_vec()
    }

    /// The overwriting copy right before a switch takes the old map's entries, except where the
    /// new map's are fresher: those an agent killed mid-switch left its programs writing. The
    /// old map has the retired layout, whose values are smaller than the new map's.
    #[test]
    fn an_overwriting_copy_keeps_the_new_map_s_fresher_entries() {
        const BPF_MAP_TYPE_HASH: u32 = 1;
        let old_flow = |backend: u8, last_seen: u64| Flow4V3 {
            src_addr: [10, 10, 0, 2],
            dst_addr: [10, 20, backend, 2],
            src_port: 40000,
            dst_port: 8080,
            flags: flow_flags::REWRITE_DESTINATION,
            track: FlowTrack { counter: 1, state: flow_state::ESTABLISHED, last_seen },
        };
        // The same connection in the new layout, as the conversion writes it.
        let flow = |backend: u8, last_seen: u64| Flow4::from(old_flow(backend, last_seen));
        let map = |value_size: usize| {
            let fd = bpf_sys::test_map(BPF_MAP_TYPE_HASH, 4, value_size as u32, 16, 0);
            MapData::from_fd(fd).expect("a map from its descriptor")
        };
        let value_of = |map: &MapData, key: u32| {
            let mut value = vec![0u8; size_of::<Flow4>()];
            // SAFETY: a u32 key and a value of the map's size.
            let found = unsafe { bpf_sys::lookup(map.fd().as_fd(), &key.to_ne_bytes(), &mut value) };
            assert!(found.unwrap(), "key {key}");
            value
        };
        let (old, new) = (map(size_of::<Flow4V3>()), map(size_of::<Flow4>()));
        // Key 1: the old entry is fresher; 2: the new one is (a connection the new programs
        // opened on an old one's address and port); 3: equally fresh; 4: only in the old map.
        for (key, old_flow, new_flow) in [
            (1, old_flow(1, 200), Some(flow(2, 100))),
            (2, old_flow(1, 100), Some(flow(2, 300))),
            (3, old_flow(1, 100), Some(flow(2, 100))),
            (4, old_flow(1, 100), None),
        ] {
            // SAFETY: u32 keys and values of each map's size.
            unsafe { bpf_sys::update(old.fd().as_fd(), &u32::to_ne_bytes(key), &bytes(&old_flow), 0) }
                .unwrap();
            if let Some(new_flow) = new_flow {
                unsafe { bpf_sys::update(new.fd().as_fd(), &u32::to_ne_bytes(key), &bytes(&new_flow), 0) }
                    .unwrap();
            }
        }
        let convert = Some(converter(legacy::FLOWS4_V3));
        let old = OldMap { name: pins::FLOWS4, map: old, aside: PathBuf::new(), convert };

        let added = copy_entries(&old, &new, false).unwrap();
        assert_eq!(
            added,
            Copied { copied: 1, dropped: 0, kept_fresher: 0 },
            "without overwriting, only key 4"
        );
        let refreshed = copy_entries(&old, &new, true).unwrap();
        assert_eq!(refreshed, Copied { copied: 3, dropped: 0, kept_fresher: 1 });
        assert_eq!(value_of(&new, 1), bytes(&flow(1, 200)));
        assert_eq!(value_of(&new, 2), bytes(&flow(2, 300)), "the fresher connection keeps its backend");
        assert_eq!(value_of(&new, 3), bytes(&flow(1, 100)), "as fresh: the old programs' entry is taken");
        assert_eq!(value_of(&new, 4), bytes(&flow(1, 100)));
    }

    /// A pin of another layout under a map's name (by hand, or a bug) is refused: the copy reads
    /// and writes each map's own sizes, never past the end of a buffer sized for the other.
    #[test]
    fn a_map_of_another_layout_under_the_name_is_refused() {
        const BPF_MAP_TYPE_HASH: u32 = 1;
        let map = |key_size: u32, value_size: u32| {
            let fd = bpf_sys::test_map(BPF_MAP_TYPE_HASH, key_size, value_size, 16, 0);
            MapData::from_fd(fd).expect("a map from its descriptor")
        };
        let old = map(4, 8);
        // SAFETY: a u32 key and an 8-byte value, the map's sizes.
        unsafe { bpf_sys::update(old.fd().as_fd(), &1u32.to_ne_bytes(), &[7; 8], 0) }.unwrap();
        let old = OldMap { name: pins::FLOWS4, map: old, aside: PathBuf::new(), convert: None };
        let wider_keys = copy_entries(&old, &map(16, 8), false);
        assert!(wider_keys.is_err(), "keys of 4 bytes copied into a map of 16-byte keys: {wider_keys:?}");
        let wider_values = copy_entries(&old, &map(4, 64), false);
        assert!(
            wider_values.is_err(),
            "values of 8 bytes copied into a map of 64-byte values: {wider_values:?}"
        );
    }

    #[test]
    fn converts_raw_flows_of_the_retired_layouts() {
        let track = FlowTrack { counter: 3, state: flow_state::ESTABLISHED, last_seen: 99 };
        let old = Flow4V3 {
            src_addr: [10, 10, 0, 2],
            dst_addr: [10, 20, 1, 2],
            src_port: 40000,
            dst_port: 8080,
            flags: flow_flags::REWRITE_DESTINATION,
            track,
        };
        let want = Flow4 {
            src_addr: old.src_addr,
            dst_addr: old.dst_addr,
            src_port: old.src_port,
            dst_port: old.dst_port,
            flags: old.flags,
            track,
            next_hop: NextHop::default(),
        };
        for retired in [legacy::FLOWS4_V2, legacy::FLOWS4_V3] {
            assert_eq!(converter(retired)(&bytes(&old)), bytes(&want), "{retired}");
        }
        let old6 =
            Flow6V3 { src_addr: [1; 16], dst_addr: [2; 16], src_port: 1, dst_port: 2, flags: 4, track };
        let new6 = Flow6::from(old6);
        for retired in [legacy::FLOWS6_V2, legacy::FLOWS6_V3] {
            let converted = converter(retired)(&bytes(&old6));
            assert_eq!(converted.len(), size_of::<Flow6>());
            assert_eq!(converted, bytes(&new6), "{retired}");
        }
        // The evictability of a converted entry is read from the new layout.
        assert!(!flow_evictable(pins::FLOWS4).unwrap()(&bytes(&want)));
    }
}
