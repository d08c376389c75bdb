//! The route generation ([`pins::ROUTE_GENERATION`]): a tracked connection's flow entry caches
//! its next hop (egress interface, neighbour's and interface's MAC addresses), so that its
//! packets need no FIB lookup, and the datapath trusts a cached hop only while the generation
//! it was cached under is the current one. This watcher changes the generation whenever
//! rtnetlink notifies a change that can move a hop: a route, an address or a link added,
//! changed or removed, a neighbour removed or its link-layer address changed. A neighbour's
//! mere state changes (reachable, stale, probe: every neighbour, every few tens of seconds)
//! keep its address, so they leave the caches alone.
//!
//! Without the watch nothing is cached (generation 0): when the notifications cannot be had,
//! when they stop, and when the agent stops (no one would hear of the next change). A watch
//! that falls behind (the kernel drops notifications from a full socket buffer) moves the
//! generation anyway: something changed.
use std::{
    collections::HashMap,
    io,
    os::fd::{AsRawFd as _, OwnedFd},
    path::Path,
    sync::{Arc, Mutex},
    thread,
};

use aya::maps::{Array, MapData};
use proxy_common::{flow_flags, pins};
use tracing::{debug, info, warn};

use crate::netlink::{self, parse_attributes};

const RTMGRP_LINK: u32 = 0x1;
const RTMGRP_NEIGH: u32 = 0x4;
const RTMGRP_IPV4_IFADDR: u32 = 0x10;
const RTMGRP_IPV4_ROUTE: u32 = 0x40;
const RTMGRP_IPV6_IFADDR: u32 = 0x100;
const RTMGRP_IPV6_ROUTE: u32 = 0x400;
const GROUPS: u32 = RTMGRP_LINK
    | RTMGRP_NEIGH
    | RTMGRP_IPV4_IFADDR
    | RTMGRP_IPV4_ROUTE
    | RTMGRP_IPV6_IFADDR
    | RTMGRP_IPV6_ROUTE;

const RTM_NEWNEIGH: u16 = 28;
const RTM_DELNEIGH: u16 = 29;
/// `struct ndmsg`: family, padding, interface index, state, flags, type.
const NDMSG_LEN: usize = 12;
const NDA_DST: u16 = 1;
const NDA_LLADDR: u16 = 2;

/// The generations a flow entry can hold: the low bits of the flags word's upper part.
const GENERATION_MASK: u32 = u32::MAX >> flow_flags::ROUTE_GENERATION_SHIFT;

/// The watch over the node's routes; dropping it turns the cache off.
pub struct RouteGeneration {
    state: Arc<Mutex<State>>,
}

struct State {
    map: Array<MapData, u32>,
    generation: u32,
    /// Set when the watch ends: no write after it turns the cache on again.
    stopped: bool,
}

impl State {
    /// Moves to the next generation the datapath can tell from the others (never 0, which
    /// means "off"), unless the watch has ended.
    fn advance(&mut self) {
        if self.stopped {
            return;
        }
        self.generation = next(self.generation);
        if let Err(error) = self.map.set(0, self.generation, 0) {
            warn!(%error, "cannot write the route generation; next hops are no longer cached");
            self.stop();
        }
    }

    fn stop(&mut self) {
        self.stopped = true;
        let _ = self.map.set(0, 0, 0);
    }
}

/// The generation after `generation`, skipping those whose kept bits are 0.
fn next(generation: u32) -> u32 {
    let mut next = generation.wrapping_add(1);
    if next & GENERATION_MASK == 0 {
        next = next.wrapping_add(1);
    }
    next
}

impl RouteGeneration {
    /// Subscribes to the route, neighbour, address and link notifications of this network
    /// namespace, then turns the cache on with a generation no earlier agent used (whatever
    /// was cached before now is stale). `None`, logged, when the map or the notifications
    /// cannot be had: nothing is cached then.
    pub fn start(pin_dir: &Path) -> Option<Self> {
        let opened = MapData::from_pin(pin_dir.join(pins::ROUTE_GENERATION))
            .map_err(anyhow::Error::from)
            .and_then(|map| Ok(Array::<MapData, u32>::try_from(aya::maps::Map::Array(map))?));
        let mut map = match opened {
            Ok(map) => map,
            Err(error) => {
                warn!(%error, "cannot open the route generation map; next hops are not cached");
                return None;
            }
        };
        let socket = match netlink::subscribe(GROUPS) {
            Ok(socket) => socket,
            Err(error) => {
                warn!(%error, "cannot subscribe to route notifications; next hops are not cached");
                let _ = map.set(0, 0, 0);
                return None;
            }
        };
        let generation = map.get(&0, 0).unwrap_or(0);
        let state = Arc::new(Mutex::new(State { map, generation, stopped: false }));
        lock(&state).advance();
        let watched = Arc::clone(&state);
        let spawned = thread::Builder::new().name("routes".into()).spawn(move || watch(&socket, &watched));
        if let Err(error) = spawned {
            warn!(%error, "cannot start the route watch; next hops are not cached");
            lock(&state).stop();
            return None;
        }
        info!("next hops are cached in flow entries while the routes and neighbours they came from last");
        Some(Self { state })
    }
}

impl Drop for RouteGeneration {
    fn drop(&mut self) {
        lock(&self.state).stop();
    }
}

fn lock(state: &Mutex<State>) -> std::sync::MutexGuard<'_, State> {
    state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Reads notifications until the socket fails; every datagram that may move a hop advances
/// the generation once.
fn watch(socket: &OwnedFd, state: &Mutex<State>) {
    let mut buffer = vec![0u8; 64 * 1024];
    let mut neighbours = Neighbours::default();
    loop {
        // SAFETY: `buffer` is valid for writes of its length.
        let received = unsafe { libc::recv(socket.as_raw_fd(), buffer.as_mut_ptr().cast(), buffer.len(), 0) };
        let moved = if received < 0 {
            let error = io::Error::last_os_error();
            match error.raw_os_error() {
                Some(libc::EINTR) => continue,
                // Notifications were lost: something changed.
                Some(libc::ENOBUFS) => true,
                _ => {
                    warn!(%error, "route notifications stopped; next hops are no longer cached");
                    lock(state).stop();
                    return;
                }
            }
        } else {
            match netlink::split_messages(&buffer[..received as usize]) {
                Ok(messages) => {
                    // Every message, even after one that moves hops: each neighbour's address
                    // is recorded.
                    let mut moved = false;
                    for message in &messages {
                        moved |= neighbours.moves_hops(message.kind, &message.payload);
                    }
                    moved
                }
                Err(_) => true,
            }
        };
        if moved {
            let mut state = lock(state);
            if state.stopped {
                return;
            }
            state.advance();
            debug!(generation = state.generation, "the routes changed: cached next hops are stale");
        }
    }
}

/// The link-layer address each neighbour was last notified with, to tell an address change
/// from a state change.
#[derive(Default)]
struct Neighbours {
    known: HashMap<(i32, Vec<u8>), Option<Vec<u8>>>,
}

impl Neighbours {
    /// Whether a notification may move a cached hop: any but a neighbour's that keeps its
    /// link-layer address.
    fn moves_hops(&mut self, kind: u16, payload: &[u8]) -> bool {
        if kind != RTM_NEWNEIGH && kind != RTM_DELNEIGH {
            return true;
        }
        let Some(header) = payload.get(..NDMSG_LEN) else { return true };
        let ifindex = i32::from_ne_bytes([header[4], header[5], header[6], header[7]]);
        let (mut destination, mut lladdr) = (None, None);
        for attribute in parse_attributes(&payload[NDMSG_LEN..]) {
            match attribute.kind {
                NDA_DST => destination = Some(attribute.payload.to_vec()),
                NDA_LLADDR => lladdr = Some(attribute.payload.to_vec()),
                _ => {}
            }
        }
        let Some(destination) = destination else { return true };
        let key = (ifindex, destination);
        if kind == RTM_DELNEIGH {
            self.known.remove(&key);
            return true;
        }
        self.known.insert(key, lladdr.clone()) != Some(lladdr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn neighbour(ifindex: i32, destination: [u8; 4], lladdr: Option<[u8; 6]>) -> Vec<u8> {
        let mut payload = vec![libc::AF_INET as u8, 0, 0, 0];
        payload.extend_from_slice(&ifindex.to_ne_bytes());
        payload.extend_from_slice(&[2, 0, 0, 0]);
        let mut attributes = netlink::Attributes::new();
        attributes.put(NDA_DST, &destination);
        if let Some(lladdr) = lladdr {
            attributes.put(NDA_LLADDR, &lladdr);
        }
        payload.extend_from_slice(attributes.bytes());
        payload
    }

    #[test]
    fn only_a_neighbours_new_address_or_removal_moves_hops() {
        let mut neighbours = Neighbours::default();
        let mac = Some([2, 0, 0, 0, 0, 1]);
        let gateway = neighbour(3, [10, 0, 0, 1], mac);
        assert!(neighbours.moves_hops(RTM_NEWNEIGH, &gateway), "first heard of");
        assert!(!neighbours.moves_hops(RTM_NEWNEIGH, &gateway), "a state change, same address");
        assert!(neighbours.moves_hops(RTM_NEWNEIGH, &neighbour(3, [10, 0, 0, 1], Some([2, 0, 0, 0, 0, 2]))));
        assert!(neighbours.moves_hops(RTM_NEWNEIGH, &neighbour(3, [10, 0, 0, 1], None)), "failed");
        assert!(neighbours.moves_hops(RTM_DELNEIGH, &gateway));
        assert!(neighbours.moves_hops(RTM_NEWNEIGH, &neighbour(4, [10, 0, 0, 1], mac)), "another link");
        assert!(neighbours.moves_hops(24, &[0; 12]), "a route");
        assert!(neighbours.moves_hops(RTM_NEWNEIGH, &[0; 4]), "unreadable");
    }

    #[test]
    fn generations_skip_the_values_a_flow_entry_reads_as_off() {
        assert_eq!(next(0), 1);
        assert_eq!(next(GENERATION_MASK - 1), GENERATION_MASK);
        assert_eq!(next(GENERATION_MASK) & GENERATION_MASK, 1);
        assert_eq!(next(u32::MAX), 1);
    }
}
