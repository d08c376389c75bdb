//! The raw `bpf()` commands vipr needs beyond what aya 0.14 wraps: the kernel probes of auto
//! mode, batched counter reads, the pinned cgroup links, and the benchmarks' test runs. Each
//! attribute is the leading part of `union bpf_attr` that its command reads; the kernel
//! treats the bytes after it as zero.
use std::{
    io,
    os::fd::{AsRawFd as _, BorrowedFd, FromRawFd as _, OwnedFd},
};

/// Command numbers (`enum bpf_cmd`).
pub mod cmd {
    use libc::c_long;

    pub const MAP_CREATE: c_long = 0;
    pub const MAP_LOOKUP_ELEM: c_long = 1;
    pub const MAP_UPDATE_ELEM: c_long = 2;
    pub const MAP_DELETE_ELEM: c_long = 3;
    pub const MAP_GET_NEXT_KEY: c_long = 4;
    pub const PROG_LOAD: c_long = 5;
    pub const OBJ_GET: c_long = 7;
    pub const PROG_TEST_RUN: c_long = 10;
    pub const OBJ_GET_INFO_BY_FD: c_long = 15;
    pub const MAP_LOOKUP_BATCH: c_long = 24;
    pub const MAP_UPDATE_BATCH: c_long = 26;
    pub const LINK_CREATE: c_long = 28;
    pub const LINK_UPDATE: c_long = 29;
}

/// Runs `bpf(command, attr)`: the kernel's non-negative result, or the error it set.
///
/// # Safety
/// `attr` must be the attribute `command` reads, and every pointer in it must stay valid for
/// whatever the kernel reads or writes through it during the call.
pub unsafe fn bpf<T>(command: libc::c_long, attr: &mut T) -> io::Result<libc::c_long> {
    // SAFETY: the caller's promise; the size passed is the attribute's own.
    let result = unsafe {
        libc::syscall(libc::SYS_bpf, command, std::ptr::from_mut(attr).cast::<u8>(), size_of::<T>() as u32)
    };
    if result < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(result)
    }
}

/// The descriptor a successful `bpf()` returned, owned from now on.
pub fn owned_fd(result: libc::c_long) -> io::Result<OwnedFd> {
    let fd = i32::try_from(result).map_err(|_| io::Error::other(format!("bpf() returned {result}")))?;
    // SAFETY: the kernel just returned this descriptor and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `BPF_PROG_LOAD`.
#[repr(C)]
#[derive(Debug, Default)]
pub struct ProgLoadAttr {
    pub prog_type: u32,
    pub insn_cnt: u32,
    pub insns: u64,
    pub license: u64,
    pub log_level: u32,
    pub log_size: u32,
    pub log_buf: u64,
    pub kern_version: u32,
    pub prog_flags: u32,
    pub prog_name: [u8; 16],
    pub prog_ifindex: u32,
    pub expected_attach_type: u32,
}

/// One `struct bpf_insn` without registers but r0 and without offset, as the kernel reads it:
/// enough for the programs probes, benchmarks and tests load (`r0 = value; exit`).
pub const fn instruction(code: u8, imm: i32) -> u64 {
    u64::from_le_bytes([code, 0, 0, 0, 0, 0, 0, 0]) | ((imm as u32 as u64) << 32)
}

/// `r0 = value; exit`: a program that answers `value` to everything.
pub const fn returning(value: i32) -> [u64; 2] {
    [instruction(0xb7, value), instruction(0x95, 0)]
}

/// `BPF_PROG_LOAD` of `insns` under the GPL, named `name` (up to 15 bytes are kept).
pub fn load_program(
    prog_type: u32,
    expected_attach_type: u32,
    insns: &[u64],
    name: &str,
) -> io::Result<OwnedFd> {
    let license = c"GPL";
    let mut prog_name = [0u8; 16];
    let kept = name.len().min(15);
    prog_name[..kept].copy_from_slice(&name.as_bytes()[..kept]);
    let mut attr = ProgLoadAttr {
        prog_type,
        insn_cnt: insns.len() as u32,
        insns: insns.as_ptr() as u64,
        license: license.as_ptr() as u64,
        prog_name,
        expected_attach_type,
        ..ProgLoadAttr::default()
    };
    // SAFETY: the instructions, license and name outlive the call.
    unsafe { bpf(cmd::PROG_LOAD, &mut attr) }.and_then(owned_fd)
}

/// `BPF_LINK_CREATE`, the fields vipr uses.
#[repr(C)]
#[derive(Debug, Default)]
pub struct LinkCreateAttr {
    pub prog_fd: u32,
    /// The interface, or the cgroup's descriptor.
    pub target: u32,
    pub attach_type: u32,
    pub flags: u32,
    pub relative_fd: u32,
    pub expected_revision: u64,
}

/// `BPF_MAP_CREATE`.
#[repr(C)]
#[derive(Debug, Default)]
pub struct MapCreateAttr {
    pub map_type: u32,
    pub key_size: u32,
    pub value_size: u32,
    pub max_entries: u32,
    pub map_flags: u32,
}

/// `BPF_MAP_LOOKUP_BATCH` and the other batch commands.
#[repr(C)]
#[derive(Debug, Default)]
pub struct MapBatchAttr {
    pub in_batch: u64,
    pub out_batch: u64,
    pub keys: u64,
    pub values: u64,
    pub count: u32,
    pub map_fd: u32,
    pub elem_flags: u64,
    pub flags: u64,
}

/// `BPF_MAP_GET_NEXT_KEY`.
#[repr(C)]
#[derive(Debug, Default)]
struct MapNextKeyAttr {
    map_fd: u32,
    pad: u32,
    key: u64,
    next_key: u64,
}

/// `BPF_MAP_LOOKUP_ELEM`, `BPF_MAP_UPDATE_ELEM` and `BPF_MAP_DELETE_ELEM`.
#[repr(C)]
#[derive(Debug, Default)]
struct MapElemAttr {
    map_fd: u32,
    pad: u32,
    key: u64,
    value: u64,
    flags: u64,
}

/// `BPF_NOEXIST`: an update that never replaces an existing entry.
pub const BPF_NOEXIST: u64 = 1;

/// The key after `key` (the first key with `None`) into `next`; `false` after the last key.
///
/// # Safety
/// `key` and `next` must each hold at least the map's key size: the kernel reads and writes
/// that many bytes, whatever the slices' lengths.
pub unsafe fn next_key(map: BorrowedFd<'_>, key: Option<&[u8]>, next: &mut [u8]) -> io::Result<bool> {
    let mut attr = MapNextKeyAttr {
        map_fd: map.as_raw_fd() as u32,
        pad: 0,
        key: key.map_or(0, |key| key.as_ptr() as u64),
        next_key: next.as_mut_ptr() as u64,
    };
    // SAFETY: the caller's promise: both buffers hold the map's key size; they outlive the call.
    match unsafe { bpf(cmd::MAP_GET_NEXT_KEY, &mut attr) } {
        Ok(_) => Ok(true),
        Err(error) if error.raw_os_error() == Some(libc::ENOENT) => Ok(false),
        Err(error) => Err(error),
    }
}

/// The value of `key` into `value`; `false` if there is no such key.
///
/// # Safety
/// `key` must hold at least the map's key size, and `value` its value size (for a per-CPU map
/// one 8-byte aligned value per possible CPU, [`EntryLayout`]): the kernel reads and writes
/// that many bytes, whatever the slices' lengths.
pub unsafe fn lookup(map: BorrowedFd<'_>, key: &[u8], value: &mut [u8]) -> io::Result<bool> {
    let mut attr = MapElemAttr {
        map_fd: map.as_raw_fd() as u32,
        key: key.as_ptr() as u64,
        value: value.as_mut_ptr() as u64,
        ..MapElemAttr::default()
    };
    // SAFETY: the caller's promise: the buffers hold the map's key and value; they outlive the
    // call.
    match unsafe { bpf(cmd::MAP_LOOKUP_ELEM, &mut attr) } {
        Ok(_) => Ok(true),
        Err(error) if error.raw_os_error() == Some(libc::ENOENT) => Ok(false),
        Err(error) => Err(error),
    }
}

/// Stores `key` → `value` with the update `flags`.
///
/// # Safety
/// As [`lookup`]'s: the kernel reads the map's key and value size from the buffers.
pub unsafe fn update(map: BorrowedFd<'_>, key: &[u8], value: &[u8], flags: u64) -> io::Result<()> {
    let mut attr = MapElemAttr {
        map_fd: map.as_raw_fd() as u32,
        pad: 0,
        key: key.as_ptr() as u64,
        value: value.as_ptr() as u64,
        flags,
    };
    // SAFETY: the caller's promise: the buffers hold the map's key and value; the kernel only
    // reads them during the call.
    unsafe { bpf(cmd::MAP_UPDATE_ELEM, &mut attr) }.map(drop)
}

/// Removes `key`; `false` if there was no such key.
///
/// # Safety
/// `key` must hold at least the map's key size: the kernel reads that many bytes.
pub unsafe fn delete(map: BorrowedFd<'_>, key: &[u8]) -> io::Result<bool> {
    let mut attr =
        MapElemAttr { map_fd: map.as_raw_fd() as u32, key: key.as_ptr() as u64, ..MapElemAttr::default() };
    // SAFETY: the caller's promise: the buffer holds the map's key; it outlives the call.
    match unsafe { bpf(cmd::MAP_DELETE_ELEM, &mut attr) } {
        Ok(_) => Ok(true),
        Err(error) if error.raw_os_error() == Some(libc::ENOENT) => Ok(false),
        Err(error) => Err(error),
    }
}

/// How a map's entries are laid out, for [`count_keys`]: taken from the kernel's description
/// of the map ([`EntryLayout::of`]) and nowhere else, since the kernel writes that many bytes.
#[derive(Clone, Copy, Debug)]
pub struct EntryLayout {
    key_size: u32,
    /// The value's size; for a per-CPU map, the kernel's copy for every possible CPU.
    value_bytes: usize,
}

impl EntryLayout {
    /// The layout of the map `info` describes.
    pub fn of(info: &aya::maps::MapInfo) -> Self {
        use aya::maps::MapType;
        let value_size = info.value_size() as usize;
        let per_cpu = matches!(
            info.map_type(),
            Ok(MapType::PerCpuHash | MapType::LruPerCpuHash | MapType::PerCpuArray)
        );
        let value_bytes = if per_cpu {
            // One 8-byte-aligned copy per possible CPU.
            value_size.next_multiple_of(8) * aya::util::nr_cpus().map_or(1, |cpus| cpus.max(1))
        } else {
            value_size
        };
        Self { key_size: info.key_size(), value_bytes }
    }
}

/// Keys (and values) per `BPF_MAP_LOOKUP_BATCH` call of [`count_keys`].
const COUNT_BATCH: u32 = 1024;

/// The number of keys of a hash-like map (hash, LRU hash, LPM trie), at most `limit`. Maps
/// are read in batches (`BPF_MAP_LOOKUP_BATCH`, Linux 5.6: one system call per 1,024 entries;
/// the agent counts its maps' fill every few seconds, and one call per key was 230k calls at
/// 10k services); where the kernel has no batch lookup for the map they are walked with `BPF_MAP_GET_NEXT_KEY`,
/// one call per key. A walk racing with deletions may restart from the first key; it stops
/// after `limit` keys.
pub fn count_keys(map: BorrowedFd<'_>, layout: EntryLayout, limit: u64) -> io::Result<u64> {
    match count_batched(map, layout, limit) {
        Some(count) => Ok(count),
        None => count_walking(map, layout.key_size, limit),
    }
}

/// [`count_keys`] by batches; `None` where the kernel has no batch lookup for the map.
fn count_batched(map: BorrowedFd<'_>, layout: EntryLayout, limit: u64) -> Option<u64> {
    let mut count = 0;
    let each = |keys: &[u8], _: &[u8]| {
        count += keys.len() as u64 / u64::from(layout.key_size.max(1));
        count < limit
    };
    // SAFETY: the layout is the map's own (`EntryLayout::of`).
    unsafe {
        lookup_batches::<u8, u8>(map, COUNT_BATCH, layout.key_size as usize, layout.value_bytes, each)
    }?;
    Some(count.min(limit))
}

/// Reads a whole map with `BPF_MAP_LOOKUP_BATCH` (Linux 5.6), `batch` entries per call, handing
/// each batch's keys and values to `each` (a key is `key_units` `K`s, a value `value_units`
/// `V`s: a per-CPU value is one per possible CPU) until it returns false or the map ends.
/// `None` when the kernel refuses a batch: no batch lookups for this map type, or the map
/// changed under the walk (a hash bucket grew past the batch).
///
/// # Safety
/// `key_units` `K`s must be the map's key size and `value_units` `V`s its value size (per-CPU:
/// [`EntryLayout`]): the kernel writes `batch` entries of those sizes into buffers sized so.
pub unsafe fn lookup_batches<K: Copy + Default, V: Copy + Default>(
    map: BorrowedFd<'_>,
    batch: u32,
    key_units: usize,
    value_units: usize,
    mut each: impl FnMut(&[K], &[V]) -> bool,
) -> Option<()> {
    let mut keys = vec![K::default(); key_units * batch as usize];
    let mut values = vec![V::default(); value_units * batch as usize];
    // The position between batches: a bucket index (4 bytes) for hash maps, a key for the
    // others (the generic batch walk of arrays and LPM tries), so room for either.
    let token = (key_units * size_of::<K>()).max(size_of::<u64>());
    let (mut cursor, mut next) = (vec![0u8; token], vec![0u8; token]);
    let mut first = true;
    loop {
        let mut attr = MapBatchAttr {
            in_batch: if first { 0 } else { cursor.as_ptr() as u64 },
            out_batch: next.as_mut_ptr() as u64,
            keys: keys.as_mut_ptr() as u64,
            values: values.as_mut_ptr() as u64,
            count: batch,
            map_fd: map.as_raw_fd() as u32,
            ..MapBatchAttr::default()
        };
        // SAFETY: the buffers hold `batch` keys and values of the sizes the caller gives, and
        // outlive the call.
        let last = match unsafe { bpf(cmd::MAP_LOOKUP_BATCH, &mut attr) } {
            Ok(_) => false,
            // The last batch; what it holds is valid.
            Err(error) if error.raw_os_error() == Some(libc::ENOENT) => true,
            Err(_) => return None,
        };
        let got = attr.count as usize;
        if !each(&keys[..got * key_units], &values[..got * value_units]) || last {
            return Some(());
        }
        std::mem::swap(&mut cursor, &mut next);
        first = false;
    }
}

/// [`count_keys`] with one `BPF_MAP_GET_NEXT_KEY` per key (no values read).
fn count_walking(map: BorrowedFd<'_>, key_size: u32, limit: u64) -> io::Result<u64> {
    let mut keys = [vec![0u8; key_size as usize], vec![0u8; key_size as usize]];
    let mut count = 0;
    let mut first = true;
    while count < limit {
        let [current, next] = &mut keys;
        let mut attr = MapNextKeyAttr {
            map_fd: map.as_raw_fd() as u32,
            pad: 0,
            // A null key asks for the first key.
            key: if first { 0 } else { current.as_ptr() as u64 },
            next_key: next.as_mut_ptr() as u64,
        };
        // SAFETY: both buffers hold a key of the map's key size and outlive the call.
        match unsafe { bpf(cmd::MAP_GET_NEXT_KEY, &mut attr) } {
            Ok(_) => {}
            Err(error) if error.raw_os_error() == Some(libc::ENOENT) => break,
            Err(error) => return Err(error),
        }
        count += 1;
        first = false;
        keys.swap(0, 1);
    }
    Ok(count)
}

/// `BPF_PROG_TEST_RUN`, for the benchmarks.
#[repr(C)]
#[derive(Debug, Default)]
pub struct TestRunAttr {
    pub prog_fd: u32,
    pub retval: u32,
    pub data_size_in: u32,
    pub data_size_out: u32,
    pub data_in: u64,
    pub data_out: u64,
    pub repeat: u32,
    pub duration: u32,
    pub ctx_size_in: u32,
    pub ctx_size_out: u32,
    pub ctx_in: u64,
    pub ctx_out: u64,
    pub flags: u32,
    pub cpu: u32,
    pub batch_size: u32,
    pub pad: u32,
}

/// Writes `keys[i]` → the i-th value of `values` into `map` with one `BPF_MAP_UPDATE_BATCH`
/// (Linux 5.6), instead of a system call per entry. For a per-CPU map, `values` holds one value
/// per possible CPU for each key, CPU after CPU. On an error the kernel may have written a
/// prefix of the entries; callers fall back to single updates, which name the failing entry.
///
/// # Safety
/// `K` must be the map's key and `V` its value (for a per-CPU map, one value per possible CPU
/// in `values` for each key): the kernel reads `keys.len()` entries of the map's sizes. (Fewer
/// values than keys are refused here.)
pub unsafe fn update_batch<K: Copy, V: Copy>(
    map: BorrowedFd<'_>,
    keys: &[K],
    values: &[V],
) -> io::Result<()> {
    if keys.is_empty() {
        return Ok(());
    }
    // The kernel reads a value for every key: fewer would have it read past `values`.
    if values.len() < keys.len() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} values for {} keys", values.len(), keys.len()),
        ));
    }
    let count = u32::try_from(keys.len()).map_err(io::Error::other)?;
    let mut attr = MapBatchAttr {
        keys: keys.as_ptr() as u64,
        values: values.as_ptr() as u64,
        count,
        map_fd: map.as_raw_fd() as u32,
        ..MapBatchAttr::default()
    };
    // SAFETY: `keys` holds `count` keys and `values` their values (the caller's layout), both
    // outliving the call; the kernel only reads them.
    unsafe { bpf(cmd::MAP_UPDATE_BATCH, &mut attr) }?;
    if attr.count == count {
        Ok(())
    } else {
        Err(io::Error::other(format!("wrote {} of {count} entries", attr.count)))
    }
}

/// A map created directly, for tests (needs root).
#[cfg(test)]
pub fn test_map(map_type: u32, key_size: u32, value_size: u32, max_entries: u32, map_flags: u32) -> OwnedFd {
    let mut attr = MapCreateAttr { map_type, key_size, value_size, max_entries, map_flags };
    // SAFETY: the attribute holds no pointers.
    unsafe { bpf(cmd::MAP_CREATE, &mut attr) }.and_then(owned_fd).expect("BPF_MAP_CREATE")
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsFd as _;

    use super::*;

    use test_map as map;

    #[test]
    fn maps_are_counted_in_batches_and_key_by_key_alike() {
        const BPF_MAP_TYPE_HASH: u32 = 1;
        const BPF_MAP_TYPE_LPM_TRIE: u32 = 11;
        const BPF_F_NO_PREALLOC: u32 = 1;
        // Over several batches, with a partial last one.
        let hash = map(BPF_MAP_TYPE_HASH, 4, 8, 5_000, 0);
        let keys: Vec<u32> = (0..3 * COUNT_BATCH + 17).collect();
        let values: Vec<u64> = keys.iter().map(|key| u64::from(*key) * 3).collect();
        // SAFETY (the updates below too): keys and values of the maps' sizes, as created.
        unsafe { update_batch(hash.as_fd(), &keys, &values) }.expect("update batch");
        let short = unsafe { update_batch(hash.as_fd(), &keys[..2], &values[..1]) };
        assert_eq!(
            short.map_err(|error| error.kind()),
            Err(io::ErrorKind::InvalidInput),
            "fewer values than keys"
        );
        let layout = EntryLayout { key_size: 4, value_bytes: 8 };
        assert_eq!(count_batched(hash.as_fd(), layout, 5_000), Some(u64::from(3 * COUNT_BATCH + 17)));
        assert_eq!(count_keys(hash.as_fd(), layout, 5_000).unwrap(), u64::from(3 * COUNT_BATCH + 17));
        assert_eq!(count_keys(hash.as_fd(), layout, 100).unwrap(), 100, "at most the limit");
        let empty = map(BPF_MAP_TYPE_HASH, 4, 8, 16, 0);
        assert_eq!(count_keys(empty.as_fd(), layout, 16).unwrap(), 0);

        // LPM tries (batched on newer kernels, else walked key by key), and the walk itself.
        let trie = map(BPF_MAP_TYPE_LPM_TRIE, 8, 1, 64, BPF_F_NO_PREALLOC);
        for last in 0..10u8 {
            let key = [32, 0, 0, 0, 10, 0, 0, last];
            unsafe { update(trie.as_fd(), &key, &[1], 0) }.expect("trie insert");
        }
        let layout = EntryLayout { key_size: 8, value_bytes: 1 };
        assert_eq!(count_keys(trie.as_fd(), layout, 64).unwrap(), 10);
        assert_eq!(count_walking(trie.as_fd(), 8, 64).unwrap(), 10);
        assert_eq!(count_walking(hash.as_fd(), 4, 5_000).unwrap(), u64::from(3 * COUNT_BATCH + 17));

        // An IPv6 trie: the batch position is a whole 20-byte key, more than a bucket index.
        let trie6 = map(BPF_MAP_TYPE_LPM_TRIE, 20, 1, 64, BPF_F_NO_PREALLOC);
        for last in 0..3u8 {
            let mut key = [0u8; 20];
            key[0] = 128;
            key[4] = 0xfd;
            key[19] = last;
            unsafe { update(trie6.as_fd(), &key, &[1], 0) }.expect("trie insert");
        }
        let layout = EntryLayout { key_size: 20, value_bytes: 1 };
        assert_eq!(count_keys(trie6.as_fd(), layout, 64).unwrap(), 3);
    }

    #[test]
    fn a_deleted_key_is_gone_and_deleting_it_again_says_so() {
        const BPF_MAP_TYPE_HASH: u32 = 1;
        let hash = map(BPF_MAP_TYPE_HASH, 4, 8, 16, 0);
        let key = 7u32.to_ne_bytes();
        let mut value = [0u8; 8];
        // SAFETY (all four calls): a 4-byte key and an 8-byte value, as the map was created.
        unsafe { update(hash.as_fd(), &key, &9u64.to_ne_bytes(), 0) }.expect("insert");
        assert!(unsafe { delete(hash.as_fd(), &key) }.expect("delete"), "the key was there");
        assert!(!unsafe { lookup(hash.as_fd(), &key, &mut value) }.expect("lookup"), "the key is gone");
        assert!(!unsafe { delete(hash.as_fd(), &key) }.expect("delete again"), "nothing left to delete");
    }
}
