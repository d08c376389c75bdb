//! Earlier layouts of maps whose entries the datapath creates (connections), kept so that an
//! upgrade carries them into the current layout rather than losing them: established
//! connections keep their backend and their reverse NAT across a vipr whose map layouts
//! changed. Each retired layout here has its type as it was and a conversion to the current
//! one; the agent copies the entries across (`proxy-userspace/src/dataplane/ebpf/carry.rs`).
//!
//! A layout whose maps only the agent writes (services, backends) needs no conversion: the
//! agent's first sync writes the new maps from the desired state.

use crate::{family::map_types, Flow, FlowTrack, NextHop};

/// Retired flows layouts whose entries are converted, with the current map they go to.
pub const CONVERTED: [Converted; 4] = [
    Converted { retired: FLOWS4_V2, current: crate::pins::FLOWS4 },
    Converted { retired: FLOWS4_V3, current: crate::pins::FLOWS4 },
    Converted { retired: FLOWS6_V2, current: crate::pins::FLOWS6 },
    Converted { retired: FLOWS6_V3, current: crate::pins::FLOWS6 },
];

/// One retired map whose entries are converted into a current one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Converted {
    /// The retired map's pin name (one of [`crate::pins::RETIRED`]).
    pub retired: &'static str,
    /// The current map's pin name.
    pub current: &'static str,
}

/// The flows map as an LRU hash: [`crate::FlowKey4`] -> [`Flow4V3`].
pub const FLOWS4_V2: &str = "vipr_flow4_v2";
/// The flows map before [`NextHop`]: [`crate::FlowKey4`] -> [`Flow4V3`].
pub const FLOWS4_V3: &str = "vipr_flow4_v3";
pub const FLOWS6_V2: &str = "vipr_flow6_v2";
pub const FLOWS6_V3: &str = "vipr_flow6_v3";

/// The value of `vipr_flow4_v2`, `vipr_flow4_v3` and their IPv6 namesakes: [`Flow`] without
/// the cached next hop. (The keys, [`crate::FlowKey`], did not change.)
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FlowV3<A> {
    pub src_addr: A,
    pub dst_addr: A,
    pub src_port: u16,
    pub dst_port: u16,
    pub flags: u32,
    pub track: FlowTrack,
}

pub type Flow4V3 = FlowV3<crate::V4>;
pub type Flow6V3 = FlowV3<crate::V6>;

map_types! {
    FlowV3<A>: 32, 56;
}

/// The same rewrites and tracking state; no next hop cached (the datapath routes the packet as
/// any uncached one). An `_v2` entry lacks [`crate::flow_state::HANDSHAKE_TRACKED`] as it did
/// under `_v3`, and is judged the same way.
impl<A> From<FlowV3<A>> for Flow<A> {
    fn from(old: FlowV3<A>) -> Self {
        let FlowV3 { src_addr, dst_addr, src_port, dst_port, flags, track } = old;
        Self { src_addr, dst_addr, src_port, dst_port, flags, track, next_hop: NextHop::default() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{flow_flags, flow_state, pins, Flow4, Flow6};

    #[test]
    fn a_v3_flow_keeps_its_rewrites_and_state_and_caches_no_next_hop() {
        let track = FlowTrack {
            counter: 7,
            state: flow_state::SYN | flow_state::REPLIED | flow_state::ESTABLISHED,
            last_seen: 123_456_789,
        };
        let old = Flow4V3 {
            src_addr: [10, 0, 0, 1],
            dst_addr: [10, 1, 0, 2],
            src_port: 4242,
            dst_port: 8080,
            flags: flow_flags::REWRITE_DESTINATION | flow_flags::REWRITE_SOURCE,
            track,
        };
        let new = Flow4::from(old);
        assert_eq!(
            (new.src_addr, new.dst_addr, new.src_port, new.dst_port, new.flags, new.track),
            (old.src_addr, old.dst_addr, old.src_port, old.dst_port, old.flags, old.track)
        );
        assert_eq!(new.next_hop, NextHop::default());
        assert_eq!(new.next_hop.ifindex, 0, "0 is 'not cached'");

        let old6 = Flow6V3 {
            src_addr: [0xfd; 16],
            dst_addr: [0xfe; 16],
            src_port: 1,
            dst_port: 2,
            flags: flow_flags::REPLY | flow_flags::REWRITE_SOURCE,
            track,
        };
        let new6 = Flow6::from(old6);
        assert_eq!(
            (new6.src_addr, new6.dst_addr, new6.src_port, new6.dst_port, new6.flags, new6.track),
            (old6.src_addr, old6.dst_addr, old6.src_port, old6.dst_port, old6.flags, old6.track)
        );
        assert_eq!(new6.next_hop, NextHop::default());
    }

    #[test]
    fn every_converted_layout_is_retired_and_goes_to_a_current_flows_map() {
        for converted in CONVERTED {
            assert!(pins::RETIRED.contains(&converted.retired), "{converted:?}");
            assert!([pins::FLOWS4, pins::FLOWS6].contains(&converted.current), "{converted:?}");
            assert_ne!(converted.retired, converted.current);
        }
        // The old value's fields are the new one's prefix: the layouts differ only by the
        // appended next hop.
        assert_eq!(core::mem::size_of::<Flow4>(), core::mem::size_of::<Flow4V3>() + 16);
        assert_eq!(core::mem::size_of::<Flow6>(), core::mem::size_of::<Flow6V3>() + 16);
    }
}
