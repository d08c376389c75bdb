//! The pinned BTF maps shared with the agent.
//!
//! aya-ebpf's own BTF map types cannot express libbpf's `pinning` attribute, so the
//! definition is written out here: the same `#[repr(C)]` layout of type-carrying pointers,
//! plus `pinning = LIBBPF_PIN_BY_NAME`. That makes the loader reuse a map already pinned under
//! the pin directory (an agent restart keeps every connection) and gives bpftool the BTF to
//! print field names.
use core::ptr::{null, NonNull};

use aya_ebpf::{
    bindings::bpf_map_type::{BPF_MAP_TYPE_HASH, BPF_MAP_TYPE_LRU_HASH},
    helpers::{bpf_map_delete_elem, bpf_map_lookup_elem, bpf_map_update_elem},
};
use proxy_common::{capacity, pins, Backend4, BackendSlot, Flow4, FlowKey4, Service, ServiceKey4};

const LIBBPF_PIN_BY_NAME: usize = 1;
const HASH: usize = BPF_MAP_TYPE_HASH as usize;
const LRU_HASH: usize = BPF_MAP_TYPE_LRU_HASH as usize;

#[repr(C)]
pub struct PinnedMap<K, V, const TYPE: usize, const MAX_ENTRIES: usize> {
    r#type: *const [i32; TYPE],
    key: *const K,
    value: *const V,
    max_entries: *const [i32; MAX_ENTRIES],
    pinning: *const [i32; LIBBPF_PIN_BY_NAME],
}

// SAFETY: the fields are never dereferenced; they only carry types into BTF and are replaced
// by a map reference when the program is loaded.
unsafe impl<K, V, const T: usize, const M: usize> Sync for PinnedMap<K, V, T, M> {}

impl<K, V, const TYPE: usize, const MAX_ENTRIES: usize> PinnedMap<K, V, TYPE, MAX_ENTRIES> {
    pub const fn new() -> Self {
        Self { r#type: null(), key: null(), value: null(), max_entries: null(), pinning: null() }
    }

    #[inline(always)]
    fn as_ptr(&self) -> *mut core::ffi::c_void {
        core::ptr::from_ref(self).cast_mut().cast()
    }

    /// A copy of the value, so no reference into a hash slot outlives a concurrent update.
    #[inline(always)]
    pub fn get(&self, key: &K) -> Option<V>
    where
        V: Copy,
    {
        // SAFETY: the helper returns null or a pointer to a live value of type V.
        let value = unsafe { bpf_map_lookup_elem(self.as_ptr(), core::ptr::from_ref(key).cast()) };
        NonNull::new(value.cast::<V>()).map(|value| unsafe { value.as_ptr().read() })
    }

    #[inline(always)]
    pub fn insert(&self, key: &K, value: &V) -> Result<(), i64> {
        let result = unsafe {
            bpf_map_update_elem(
                self.as_ptr(),
                core::ptr::from_ref(key).cast(),
                core::ptr::from_ref(value).cast(),
                0,
            )
        };
        if result == 0 {
            Ok(())
        } else {
            Err(result)
        }
    }

    #[inline(always)]
    #[allow(dead_code)]
    pub fn remove(&self, key: &K) -> Result<(), i64> {
        let result = unsafe { bpf_map_delete_elem(self.as_ptr(), core::ptr::from_ref(key).cast()) };
        if result == 0 {
            Ok(())
        } else {
            Err(result)
        }
    }
}

const fn same_name(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i < a.len() {
        if a[i] != b[i] {
            return false;
        }
        i += 1;
    }
    true
}

// export_name must be a literal; these asserts keep the literals equal to the shared names.
const _: () = {
    assert!(same_name("vipr_svc4_v1", pins::SERVICES4));
    assert!(same_name("vipr_back4_v1", pins::BACKENDS4));
    assert!(same_name("vipr_flow4_v1", pins::FLOWS4));
};

#[unsafe(link_section = ".maps")]
#[unsafe(export_name = "vipr_svc4_v1")]
pub static SERVICES4: PinnedMap<ServiceKey4, Service, HASH, { capacity::SERVICES as usize }> =
    PinnedMap::new();

#[unsafe(link_section = ".maps")]
#[unsafe(export_name = "vipr_back4_v1")]
pub static BACKENDS4: PinnedMap<BackendSlot, Backend4, HASH, { capacity::BACKENDS as usize }> =
    PinnedMap::new();

#[unsafe(link_section = ".maps")]
#[unsafe(export_name = "vipr_flow4_v1")]
pub static FLOWS4: PinnedMap<FlowKey4, Flow4, LRU_HASH, { capacity::FLOWS as usize }> = PinnedMap::new();
