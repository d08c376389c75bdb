//! Types shared by vipr's kernel programs (proxy-ebpf) and its agent (proxy-userspace).
//!
//! Every map key and value is `#[repr(C)]` with explicit padding and a compile-time size
//! check, because the kernel compares keys bytewise: an uninitialised padding byte would make
//! two equal keys different. Addresses are kept as network-order byte arrays and ports in host
//! order, so `bpftool map dump` prints `[10,96,0,10]` and `80` rather than opaque integers.
#![no_std]

/// Names of the pinned maps and where they live. The version suffix is part of the name so a
/// later format can be introduced beside the old one and migrated, never reinterpreted.
pub mod pins {
    /// Directory under the bpffs root (`--bpf-root`) that holds every pin of one vipr.
    pub const DIR: &str = "vipr";
    /// Subdirectory of [`DIR`] holding the pinned TCX links, one per attached device.
    pub const LINKS_DIR: &str = "links";
    /// Frontend (VIP, port, protocol) -> service: [`crate::ServiceKey4`] -> [`crate::Service`].
    pub const SERVICES4: &str = "vipr_svc4_v1";
    /// Backend slots of a backend set: [`crate::BackendSlot`] -> [`crate::Backend4`].
    pub const BACKENDS4: &str = "vipr_back4_v1";
    /// Connection tracking and NAT state: [`crate::FlowKey4`] -> [`crate::Flow4`].
    pub const FLOWS4: &str = "vipr_flow4_v1";
    /// The one TC program, attached at ingress of every `--devices` interface.
    pub const TC_INGRESS_PROGRAM: &str = "vipr_tc_ingress";
}

/// Default capacities; the agent may override them when it creates the maps.
pub mod capacity {
    pub const SERVICES: u32 = 65_536;
    pub const BACKENDS: u32 = 1_048_576;
    pub const FLOWS: u32 = 262_144;
}

/// IP protocol numbers as carried in [`ServiceKey4::proto`] and [`FlowKey4::proto`].
pub mod proto {
    pub const TCP: u8 = 6;
    pub const UDP: u8 = 17;
    pub const SCTP: u8 = 132;
}

/// Key of the services map: one frontend of a service.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceKey4 {
    pub addr: [u8; 4],
    pub port: u16,
    pub proto: u8,
    pub pad: u8,
}

/// Value of the services map. `backend_set` names the slots in the backends map that hold
/// this frontend's backends; the agent fills a fresh set and then switches this value in one
/// map update, so a packet sees either the old set or the new one, never a mixture.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Service {
    pub backend_set: u32,
    /// Number of slots `0..backend_count` in `backend_set`; 0 means no usable endpoint.
    pub backend_count: u32,
    /// Stable identity of the Kubernetes service port, for statistics and reverse lookups.
    pub service_id: u32,
    pub flags: u32,
}

/// Key of the backends map: one slot of one backend set.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BackendSlot {
    pub backend_set: u32,
    pub slot: u32,
}

/// Value of the backends map: where a connection is sent.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Backend4 {
    pub addr: [u8; 4],
    pub port: u16,
    pub pad: u16,
}

/// A 5-tuple as seen on the wire, in either direction of a connection.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FlowKey4 {
    pub src_addr: [u8; 4],
    pub dst_addr: [u8; 4],
    pub src_port: u16,
    pub dst_port: u16,
    pub proto: u8,
    pub pad: [u8; 3],
}

/// What to do with the packets of a tracked flow.
pub mod flow_kind {
    /// Client -> VIP direction: rewrite the destination to `nat_addr:nat_port` (the backend).
    pub const TO_BACKEND: u8 = 1;
    /// Backend -> client direction: rewrite the source to `nat_addr:nat_port` (the VIP).
    pub const FROM_BACKEND: u8 = 2;
}

/// Value of the flows map. Both directions of a connection get an entry when its first
/// packet is balanced, so every later packet costs one lookup, whichever way it travels.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Flow4 {
    pub nat_addr: [u8; 4],
    pub nat_port: u16,
    /// One of [`flow_kind`].
    pub kind: u8,
    pub pad: u8,
}

const _: () = {
    assert!(core::mem::size_of::<ServiceKey4>() == 8);
    assert!(core::mem::size_of::<Service>() == 16);
    assert!(core::mem::size_of::<BackendSlot>() == 8);
    assert!(core::mem::size_of::<Backend4>() == 8);
    assert!(core::mem::size_of::<FlowKey4>() == 16);
    assert!(core::mem::size_of::<Flow4>() == 8);
};

#[cfg(feature = "user")]
mod user {
    use super::*;

    // SAFETY: all of these are repr(C), Copy, and have no implicit padding (see the size
    // asserts above), so any byte pattern the kernel hands back is a valid value.
    unsafe impl aya::Pod for ServiceKey4 {}
    unsafe impl aya::Pod for Service {}
    unsafe impl aya::Pod for BackendSlot {}
    unsafe impl aya::Pod for Backend4 {}
    unsafe impl aya::Pod for FlowKey4 {}
    unsafe impl aya::Pod for Flow4 {}
}
