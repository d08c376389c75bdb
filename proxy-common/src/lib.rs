//! Types shared by vipr's kernel programs (proxy-ebpf) and its agent (proxy-userspace).
//!
//! Every map key and value is `#[repr(C)]` with explicit padding and a compile-time size
//! check, because the kernel compares keys bytewise: an uninitialised padding byte would make
//! two equal keys different. Addresses are kept as network-order byte arrays and ports in host
//! order, so `bpftool map dump` prints `[10,96,0,10]` and `80` rather than opaque integers.
//! A type that holds addresses is written once, generic over the address family ([`family`]).
//!
//! One module a concern: [`pins`] (every map's name), [`capacity`], [`family`], [`service`],
//! [`backend`] (with session affinity), [`flow`] (connection tracking), [`counters`],
//! [`fragment`], [`snat`], [`sock`] (the socket hooks), [`legacy`] (earlier layouts), [`sctp`].
//! Their types are re-exported here.
#![no_std]

pub mod backend;
pub mod capacity;
pub mod counters;
pub mod family;
pub mod flow;
pub mod fragment;
pub mod legacy;
pub mod pins;
pub mod sctp;
pub mod service;
pub mod snat;
pub mod sock;

pub use backend::*;
pub use counters::*;
pub use family::{Family, MapNames, V4, V6};
pub use flow::*;
pub use fragment::*;
pub use service::*;
pub use snat::SnatPorts;
pub use sock::{
    SockConfig, SockFrontend, SockFrontend4, SockFrontend6, SockPods, SockRevKey, SockRevKey4, SockRevKey6,
};

/// `--bpf-forwarding`: how the TC program hands on a packet it rewrote for another host. The
/// agent writes the mode into the program's read-only global [`forwarding::GLOBAL`] when it
/// loads it (so the verifier prunes the other path).
pub mod forwarding {
    /// The name of the `u8` global holding [`STACK`] or [`REDIRECT`].
    pub const GLOBAL: &str = "VIPR_FORWARDING";
    /// The default: back into the stack, which routes and filters the packet (netfilter
    /// FORWARD and POSTROUTING) with the addresses a NetworkPolicy names, client -> backend
    /// and backend -> client; the rest of the NAT happens at TC egress.
    pub const STACK: u8 = 0;
    /// Straight to the next hop with `bpf_redirect_neigh`: faster, but the packet skips
    /// netfilter's FORWARD and POSTROUTING chains, and with them iptables-enforced policy.
    pub const REDIRECT: u8 = 1;
}

/// `--lb-mode` and `--lb-dsr-accept` on a backend's node: the protocols whose requests it takes
/// a carried service address from (direct server return, the other node's option: proxy-ebpf's
/// dsr.rs). The agent writes the bits into the program's read-only global
/// [`dsr_accept::GLOBAL`] when it loads it: by default none with `snat`, TCP with `hybrid`, TCP
/// and UDP with `dsr`; both or none as `--lb-dsr-accept` says. Whoever can send a pod a request
/// with the option chooses the source address of the pod's replies, so a node that sends no
/// DSR connections takes none unless told to.
pub mod dsr_accept {
    /// The name of the `u8` global holding the bits below.
    pub const GLOBAL: &str = "VIPR_DSR_ACCEPT";
    pub const NONE: u8 = 0;
    pub const TCP: u8 = 1;
    pub const UDP: u8 = 2;
}

/// IP protocol numbers as carried in [`ServiceKey::proto`] and [`FlowKey::proto`].
pub mod proto {
    pub const TCP: u8 = 6;
    pub const UDP: u8 = 17;
    pub const SCTP: u8 = 132;
}

// The local-traffic detector by interface (`--detect-local-mode=BridgeInterface` or
// `InterfaceNamePrefix`): packets that enter through a pod interface are
// [`source_class::POD`], whatever their source address. Shared by both families.

/// Names and capacity of the pod interfaces map.
pub mod pod_interfaces {
    /// Interface indexes of the node's pod interfaces: `u32` ifindex -> `u8` (unused value),
    /// written by the agent from the interfaces' names as links come and go. Empty unless the
    /// detector is by interface.
    pub const MAP: &str = "vipr_podif_v1";
    /// Pod interfaces on one node: a pod's veth each (kubelet's default limit is 110 pods),
    /// or a bridge and its ports.
    pub const CAPACITY: u32 = 8192;
}

/// The layouts the pinned maps were created with, field by field: a generic type must lay out
/// exactly as the `*4`/`*6` pair it replaced (an agent upgrade reuses the pinned maps).
#[cfg(test)]
mod layout_tests {
    use core::mem::{offset_of, size_of};

    use super::*;

    macro_rules! layout {
        ($ty:ty, $size:expr, [$($field:ident @ $offset:expr),*]) => {
            assert_eq!(size_of::<$ty>(), $size, stringify!($ty));
            $(assert_eq!(offset_of!($ty, $field), $offset, concat!(stringify!($ty), ".", stringify!($field)));)*
        };
    }

    #[test]
    fn every_map_type_keeps_its_layout() {
        layout!(ServiceKey4, 8, [addr @ 0, port @ 4, proto @ 6, source_class @ 7]);
        layout!(ServiceKey6, 20, [addr @ 0, port @ 16, proto @ 18, source_class @ 19]);
        layout!(Backend4, 12, [addr @ 0, port @ 4, pad @ 6, counter @ 8]);
        layout!(Backend6, 24, [addr @ 0, port @ 16, pad @ 18, counter @ 20]);
        layout!(BackendMember4, 12, [backend_set @ 0, addr @ 4, port @ 8, pad @ 10]);
        layout!(BackendMember6, 24, [backend_set @ 0, addr @ 4, port @ 20, pad @ 22]);
        layout!(AffinityKey4, 8, [service_id @ 0, client @ 4]);
        layout!(AffinityKey6, 20, [service_id @ 0, client @ 4]);
        layout!(Affinity4, 16, [addr @ 0, port @ 4, pad @ 6, since @ 8]);
        layout!(Affinity6, 32, [addr @ 0, port @ 16, pad @ 18, since @ 24]);
        layout!(
            FlowKey4,
            16,
            [src_addr @ 0, dst_addr @ 4, src_port @ 8, dst_port @ 10, proto @ 12, pad8 @ 13, pad16 @ 14]
        );
        layout!(
            FlowKey6,
            40,
            [src_addr @ 0, dst_addr @ 16, src_port @ 32, dst_port @ 34, proto @ 36, pad8 @ 37, pad16 @ 38]
        );
        layout!(
            Flow4,
            48,
            [src_addr @ 0, dst_addr @ 4, src_port @ 8, dst_port @ 10, flags @ 12, track @ 16, next_hop @ 32]
        );
        layout!(
            Flow6,
            72,
            [src_addr @ 0, dst_addr @ 16, src_port @ 32, dst_port @ 34, flags @ 36, track @ 40, next_hop @ 56]
        );
        layout!(
            legacy::Flow4V3,
            32,
            [src_addr @ 0, dst_addr @ 4, src_port @ 8, dst_port @ 10, flags @ 12, track @ 16]
        );
        layout!(
            legacy::Flow6V3,
            56,
            [src_addr @ 0, dst_addr @ 16, src_port @ 32, dst_port @ 34, flags @ 36, track @ 40]
        );
        layout!(EarlyDropRing4, 8 + 16 * 4096, [next @ 0, head @ 4, keys @ 8]);
        layout!(EarlyDropRing6, 8 + 40 * 4096, [next @ 0, head @ 4, keys @ 8]);
        layout!(Prefix4, 8, [prefix_len @ 0, addr @ 4]);
        layout!(Prefix6, 20, [prefix_len @ 0, addr @ 4]);
        layout!(SourceRange4, 12, [prefix_len @ 0, service_id @ 4, addr @ 8]);
        layout!(SourceRange6, 24, [prefix_len @ 0, service_id @ 4, addr @ 8]);
        layout!(SockRevKey4, 16, [cookie @ 0, addr @ 8, port @ 12, pad @ 14]);
        layout!(SockRevKey6, 32, [cookie @ 0, addr @ 8, port @ 24, pad @ 26]);
        layout!(SockFrontend4, 8, [addr @ 0, port @ 4, pad @ 6]);
        layout!(SockFrontend6, 20, [addr @ 0, port @ 16, pad @ 18]);
        // The IPv6 pads are 6 bytes, as they were.
        assert_eq!(size_of::<<V6 as Family>::PortPad>(), 6);
        assert_eq!(size_of::<<V4 as Family>::PortPad>(), 2);
    }
}
