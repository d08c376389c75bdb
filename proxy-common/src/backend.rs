//! Backends: the slots of a backend set, which backends a set holds, and session affinity.
use crate::{family::map_types, Family};

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
pub struct Backend<A> {
    pub addr: A,
    pub port: u16,
    pub pad: u16,
    /// Index of this (service port, backend) pair in [`crate::pins::BACKEND_COUNTERS`], chosen
    /// by the agent and copied into both flow entries of each connection, so that counting a
    /// packet is an array access rather than a hash lookup. 0 is the shared "not counted" slot.
    pub counter: u32,
}

pub type Backend4 = Backend<crate::V4>;
pub type Backend6 = Backend<crate::V6>;

/// Key of the [`crate::pins::MEMBERS4`] map: a backend in a backend set.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BackendMember<A> {
    pub backend_set: u32,
    pub addr: A,
    pub port: u16,
    pub pad: u16,
}

pub type BackendMember4 = BackendMember<crate::V4>;
pub type BackendMember6 = BackendMember<crate::V6>;

/// Key of the [`crate::pins::AFFINITY4`] map: a client of a service port (its `service_id`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct AffinityKey<A> {
    pub service_id: u32,
    pub client: A,
}

pub type AffinityKey4 = AffinityKey<crate::V4>;
pub type AffinityKey6 = AffinityKey<crate::V6>;

/// Value of the [`crate::pins::AFFINITY4`] map: the backend of the client's latest new
/// connection.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Affinity<A: Family> {
    pub addr: A,
    pub port: u16,
    pub pad: A::PortPad,
    /// `bpf_ktime_get_coarse_ns` when that connection started.
    pub since: u64,
}

pub type Affinity4 = Affinity<crate::V4>;
pub type Affinity6 = Affinity<crate::V6>;

map_types! {
    BackendSlot: 8;
    Backend<A>: 12, 24;
    BackendMember<A>: 12, 24;
    AffinityKey<A>: 8, 20;
    Affinity<A>: 16, 32;
}
