//! The pinned BTF maps shared with the agent.
//!
//! aya-ebpf's own BTF map types cannot express libbpf's `pinning` attribute, so the
//! definition is written out here: the same `#[repr(C)]` layout of type-carrying pointers,
//! plus `pinning = LIBBPF_PIN_BY_NAME`. That makes the loader reuse a map already pinned under
//! the pin directory (an agent restart keeps every connection) and gives bpftool the BTF to
//! print field names.
use core::ptr::{null, NonNull};

use aya_ebpf::{
    bindings::{
        bpf_map_type::{
            BPF_MAP_TYPE_HASH, BPF_MAP_TYPE_LPM_TRIE, BPF_MAP_TYPE_LRU_HASH, BPF_MAP_TYPE_PERCPU_ARRAY,
        },
        BPF_F_NO_PREALLOC, BPF_NOEXIST,
    },
    helpers::{bpf_map_delete_elem, bpf_map_lookup_elem, bpf_map_update_elem},
};
use proxy_common::{
    capacity, pins, Affinity4, Affinity6, AffinityKey4, AffinityKey6, Backend4, BackendMember4,
    BackendMember6, BackendSlot, Counters, Flow4, FlowKey4, FragmentKey4, FragmentPorts, Prefix4, Service,
    ServiceKey4, SourceRange4,
};

const LIBBPF_PIN_BY_NAME: usize = 1;
const HASH: usize = BPF_MAP_TYPE_HASH as usize;
const LRU_HASH: usize = BPF_MAP_TYPE_LRU_HASH as usize;
const LPM_TRIE: usize = BPF_MAP_TYPE_LPM_TRIE as usize;
/// The kernel inlines lookups in (per-CPU) arrays: a bounds check and an address computation,
/// no helper call, which is what lets every packet be counted.
const PERCPU_ARRAY: usize = BPF_MAP_TYPE_PERCPU_ARRAY as usize;
/// The kernel requires it for LPM tries.
const LPM_FLAGS: usize = BPF_F_NO_PREALLOC as usize;

#[repr(C)]
pub struct PinnedMap<K, V, const TYPE: usize, const MAX_ENTRIES: usize, const FLAGS: usize = 0> {
    r#type: *const [i32; TYPE],
    key: *const K,
    value: *const V,
    max_entries: *const [i32; MAX_ENTRIES],
    map_flags: *const [i32; FLAGS],
    pinning: *const [i32; LIBBPF_PIN_BY_NAME],
}

// SAFETY: the fields are never dereferenced; they only carry types into BTF and are replaced
// by a map reference when the program is loaded.
unsafe impl<K, V, const T: usize, const M: usize, const F: usize> Sync for PinnedMap<K, V, T, M, F> {}

impl<K, V, const TYPE: usize, const MAX_ENTRIES: usize, const FLAGS: usize>
    PinnedMap<K, V, TYPE, MAX_ENTRIES, FLAGS>
{
    pub const fn new() -> Self {
        Self {
            r#type: null(),
            key: null(),
            value: null(),
            max_entries: null(),
            map_flags: null(),
            pinning: null(),
        }
    }

    #[inline(always)]
    pub fn contains(&self, key: &K) -> bool {
        // SAFETY: only the null-ness of the returned pointer is used.
        !unsafe { bpf_map_lookup_elem(self.as_ptr(), core::ptr::from_ref(key).cast()) }.is_null()
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

    /// The value in place, for fields the datapath updates as packets pass. Writes through it
    /// race with other CPUs updating the same entry; only use it for fields where a lost
    /// update is harmless (per-CPU values, timestamps, bits set again by the next packet).
    #[inline(always)]
    pub fn get_ptr(&self, key: &K) -> Option<NonNull<V>> {
        // SAFETY: the helper returns null or a pointer to a live value of type V.
        let value = unsafe { bpf_map_lookup_elem(self.as_ptr(), core::ptr::from_ref(key).cast()) };
        NonNull::new(value.cast::<V>())
    }

    #[inline(always)]
    pub fn insert(&self, key: &K, value: &V) -> Result<(), i64> {
        self.update(key, value, 0)
    }

    /// Inserts only if `key` is absent: claims the key against concurrent flows.
    #[inline(always)]
    pub fn insert_new(&self, key: &K, value: &V) -> Result<(), i64> {
        self.update(key, value, BPF_NOEXIST as u64)
    }

    #[inline(always)]
    fn update(&self, key: &K, value: &V, flags: u64) -> Result<(), i64> {
        let result = unsafe {
            bpf_map_update_elem(
                self.as_ptr(),
                core::ptr::from_ref(key).cast(),
                core::ptr::from_ref(value).cast(),
                flags,
            )
        };
        if result == 0 {
            Ok(())
        } else {
            Err(result)
        }
    }

    #[inline(always)]
    pub fn remove(&self, key: &K) -> Result<(), i64> {
        let result = unsafe { bpf_map_delete_elem(self.as_ptr(), core::ptr::from_ref(key).cast()) };
        if result == 0 {
            Ok(())
        } else {
            Err(result)
        }
    }
}

/// Declares a pinned map. `export_name` (the name the map is pinned under) must be a literal;
/// the macro checks it at compile time against the name the agent uses (`proxy_common::pins`
/// and the like), so each name is written once here.
macro_rules! pinned {
    ($vis:vis static $ident:ident = $name:literal as $shared:path: $ty:ty;) => {
        const _: () = assert!(same_name($name, $shared));
        #[unsafe(link_section = ".maps")]
        #[unsafe(export_name = $name)]
        $vis static $ident: $ty = PinnedMap::new();
    };
}

pub(crate) const fn same_name(a: &str, b: &str) -> bool {
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

pinned! {
    pub static SERVICES4 = "vipr_svc4_v2" as pins::SERVICES4:
        PinnedMap<ServiceKey4, Service, HASH, { capacity::SERVICES as usize }>;
}

pinned! {
    pub static BACKENDS4 = "vipr_back4_v2" as pins::BACKENDS4:
        PinnedMap<BackendSlot, Backend4, HASH, { capacity::BACKENDS as usize }>;
}

pinned! {
    pub static FLOWS4 = "vipr_flow4_v4" as pins::FLOWS4:
        PinnedMap<FlowKey4, Flow4, HASH, { capacity::FLOWS as usize }>;
}

pinned! {
    pub static NODE_IPS4 = "vipr_node4_v1" as pins::NODE_IPS4:
        PinnedMap<[u8; 4], u8, HASH, { capacity::NODE_IPS as usize }>;
}

pinned! {
    pub static POD_CIDRS4 = "vipr_pod4_v1" as pins::POD_CIDRS4:
        PinnedMap<Prefix4, u8, LPM_TRIE, { capacity::POD_CIDRS as usize }, LPM_FLAGS>;
}

pinned! {
    pub static UNMATCHED4 = "vipr_unm4_v1" as pins::UNMATCHED4:
        PinnedMap<Prefix4, u8, LPM_TRIE, { capacity::UNMATCHED as usize }, LPM_FLAGS>;
}

pinned! {
    pub static SOURCE_RANGES4 = "vipr_srcr4_v1" as pins::SOURCE_RANGES4:
        PinnedMap<SourceRange4, u8, LPM_TRIE, { capacity::SOURCE_RANGES as usize }, LPM_FLAGS>;
}

// ---------------------------------------------------------------------------------------------
// Session affinity and backend-set membership. The membership maps are written only by the
// agent (with the sets), so they need no preallocation; the affinity maps are LRU, so a full
// one forgets its oldest clients rather than refusing new ones.

pinned! {
    pub static AFFINITY4 = "vipr_aff4_v1" as pins::AFFINITY4:
        PinnedMap<AffinityKey4, Affinity4, LRU_HASH, { capacity::AFFINITY as usize }>;
}

pinned! {
    pub static AFFINITY6 = "vipr_aff6_v1" as pins::AFFINITY6:
        PinnedMap<AffinityKey6, Affinity6, LRU_HASH, { capacity::AFFINITY as usize }>;
}

pinned! {
    pub static MEMBERS4 = "vipr_memb4_v1" as pins::MEMBERS4:
        PinnedMap<BackendMember4, u32, HASH, { capacity::BACKENDS as usize }, NO_PREALLOC>;
}

pinned! {
    pub static MEMBERS6 = "vipr_memb6_v1" as pins::MEMBERS6:
        PinnedMap<BackendMember6, u32, HASH, { capacity::BACKENDS as usize }, NO_PREALLOC>;
}

// ---------------------------------------------------------------------------------------------
// IPv4 fragments (fragment.rs): the ports of each fragmented datagram's first fragment, for the
// later ones. LRU, so a datagram whose last fragment never came is forgotten in time.

pinned! {
    pub static FRAGMENTS4 = "vipr_frag4_v1" as pins::FRAGMENTS4:
        PinnedMap<FragmentKey4, FragmentPorts, LRU_HASH, { capacity::FRAGMENTS4 as usize }>;
}

// ---------------------------------------------------------------------------------------------
// Counters, shared by both families: per CPU, so a packet adds without atomics or contention;
// the agent sums the CPUs when /metrics is scraped.

pinned! {
    pub static BACKEND_COUNTERS = "vipr_bcnt_v1" as pins::BACKEND_COUNTERS:
        PinnedMap<u32, Counters, PERCPU_ARRAY, { capacity::BACKEND_COUNTERS as usize }>;
}

pinned! {
    pub static DATAPATH_STATS = "vipr_dstat_v2" as pins::DATAPATH_STATS:
        PinnedMap<u32, u64, PERCPU_ARRAY, { capacity::DATAPATH_STATS as usize }>;
}

// ---------------------------------------------------------------------------------------------
// Early-drop candidates (tc.rs `make_room`): the keys of the latest new connections, so that a new
// connection finding the flows map full has an entry to look at for eviction without walking the
// map. One ring for all CPUs (a per-CPU ring left a CPU that sees no flood with only its own
// established connections to offer); CPUs writing at once may lose a key or tear one, which
// costs an eviction candidate, never a wrong eviction: a candidate is checked in the flows map.

pinned! {
    pub static EARLY_DROP4 = "vipr_edrop4_v1" as pins::EARLY_DROP4:
        PinnedMap<u32, proxy_common::EarlyDropRing4, EARLY_DROP_ARRAY, 1>;
}

pinned! {
    pub static EARLY_DROP6 = "vipr_edrop6_v1" as pins::EARLY_DROP6:
        PinnedMap<u32, proxy_common::EarlyDropRing6, EARLY_DROP_ARRAY, 1>;
}

const EARLY_DROP_ARRAY: usize = aya_ebpf::bindings::bpf_map_type::BPF_MAP_TYPE_ARRAY as usize;

// ---------------------------------------------------------------------------------------------
// An upgrade's switch to new maps (lb.rs): until when a connection's entry may still be on its
// way from the earlier programs' map.

pinned! {
    pub static SWITCH_DEADLINE = "vipr_switch_v1" as pins::SWITCH_DEADLINE:
        PinnedMap<u32, u64, EARLY_DROP_ARRAY, 1>;
}

// ---------------------------------------------------------------------------------------------
// The route generation (route.rs): next hops cached in flow entries hold while it does.

pinned! {
    pub static ROUTE_GENERATION = "vipr_rtgen_v1" as pins::ROUTE_GENERATION:
        PinnedMap<u32, u32, ARRAY, 1>;
}

// ---------------------------------------------------------------------------------------------
// Socket-level load balancing (sock.rs): the agent's settings and the reverse translation.

const ARRAY: usize = aya_ebpf::bindings::bpf_map_type::BPF_MAP_TYPE_ARRAY as usize;

pinned! {
    pub static SOCK_CONFIG = "vipr_skcfg_v2" as proxy_common::sock::CONFIG:
        PinnedMap<u32, proxy_common::SockConfig, ARRAY, 1>;
}

pinned! {
    pub static SOCK_PODS = "vipr_skpods_v1" as proxy_common::sock::PODS:
        PinnedMap<u32, proxy_common::SockPods, ARRAY, 1>;
}

pinned! {
    pub static SOCK_REVERSE4 = "vipr_skrev4_v1" as proxy_common::sock::REVERSE4:
        PinnedMap<
            proxy_common::SockRevKey4,
            proxy_common::SockFrontend4,
            LRU_HASH,
            { proxy_common::sock::REVERSE4_CAPACITY as usize },
        >;
}

pinned! {
    pub static SOCK_REVERSE6 = "vipr_skrev6_v1" as proxy_common::sock::REVERSE6:
        PinnedMap<
            proxy_common::SockRevKey6,
            proxy_common::SockFrontend6,
            LRU_HASH,
            { proxy_common::sock::REVERSE6_CAPACITY as usize },
        >;
}

// Masquerade source ports (route.rs): the range the agent keeps clear of the node's ephemeral
// ports.

pinned! {
    pub static SNAT_PORTS = "vipr_snat_v1" as proxy_common::snat::PORTS:
        PinnedMap<u32, proxy_common::SnatPorts, ARRAY, 1>;
}

// The local-traffic detector by interface (tc.rs `classify`): interface indexes the agent keeps
// from the pod interfaces' names. Only the agent writes it.

pinned! {
    pub static POD_INTERFACES = "vipr_podif_v1" as proxy_common::pod_interfaces::MAP:
        PinnedMap<u32, u8, HASH, { proxy_common::pod_interfaces::CAPACITY as usize }, NO_PREALLOC>;
}

// ---------------------------------------------------------------------------------------------
// IPv6: the same maps as the IPv4 ones above, with the `*6` key and value types. The services
// and backends maps are not preallocated: only the agent writes them, so an allocation never
// happens on the packet path, and a node without IPv6 services does not set aside the ~120 MiB
// their capacities would take. The flows map cannot do the same: programs insert into it, and
// an insert must not allocate on the packet path.

/// Only for maps that programs never write.
const NO_PREALLOC: usize = BPF_F_NO_PREALLOC as usize;

pinned! {
    pub static SERVICES6 = "vipr_svc6_v2" as pins::SERVICES6:
        PinnedMap<proxy_common::ServiceKey6, Service, HASH, { capacity::SERVICES as usize }, NO_PREALLOC>;
}

pinned! {
    pub static BACKENDS6 = "vipr_back6_v2" as pins::BACKENDS6:
        PinnedMap<BackendSlot, proxy_common::Backend6, HASH, { capacity::BACKENDS as usize }, NO_PREALLOC>;
}

pinned! {
    pub static FLOWS6 = "vipr_flow6_v4" as pins::FLOWS6:
        PinnedMap<proxy_common::FlowKey6, proxy_common::Flow6, HASH, { capacity::FLOWS as usize }>;
}

pinned! {
    pub static NODE_IPS6 = "vipr_node6_v1" as pins::NODE_IPS6:
        PinnedMap<[u8; 16], u8, HASH, { capacity::NODE_IPS as usize }>;
}

pinned! {
    pub static POD_CIDRS6 = "vipr_pod6_v1" as pins::POD_CIDRS6:
        PinnedMap<proxy_common::Prefix6, u8, LPM_TRIE, { capacity::POD_CIDRS as usize }, LPM_FLAGS>;
}

pinned! {
    pub static UNMATCHED6 = "vipr_unm6_v1" as pins::UNMATCHED6:
        PinnedMap<proxy_common::Prefix6, u8, LPM_TRIE, { capacity::UNMATCHED as usize }, LPM_FLAGS>;
}

pinned! {
    pub static SOURCE_RANGES6 = "vipr_srcr6_v1" as pins::SOURCE_RANGES6:
        PinnedMap<proxy_common::SourceRange6, u8, LPM_TRIE, { capacity::SOURCE_RANGES as usize }, LPM_FLAGS>;
}

/// The value of a read-only global the agent writes when it loads the object
/// (`override_global`): read volatile, so that the compiler does not fold the object's own
/// default in. The verifier knows the value and drops the branches it rules out.
#[inline(always)]
pub fn load_time_setting(global: &u8) -> u8 {
    // SAFETY: a plain read of a valid reference.
    unsafe { core::ptr::read_volatile(global) }
}
