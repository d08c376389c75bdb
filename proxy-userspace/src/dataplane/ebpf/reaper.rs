//! Breaking off the connections of endpoints that are gone.
//!
//! A connection keeps its backend through its flow entries, independently of the service
//! entries, so a terminating endpoint that still serves keeps its connections until they close
//! (graceful termination, as kube-proxy). When an endpoint disappears from the EndpointSlices
//! altogether, its flow entries are deleted: the next packet of such a connection is balanced
//! anew, so a TCP client gets a reset from a live backend instead of retransmitting into the
//! void, and a UDP "connection" moves to a live backend at once (kube-proxy clears stale UDP
//! conntrack entries for the same reason).
//!
//! Scanning the flows map takes a while at scale, so it runs on its own thread, off the sync
//! path.
use std::{
    collections::BTreeSet,
    net::IpAddr,
    path::{Path, PathBuf},
    sync::{
        mpsc::{self, Receiver, Sender},
        Arc, Mutex,
    },
    thread::JoinHandle,
};

use aya::{
    maps::{HashMap, Map, MapData},
    Pod,
};
use proxy_common::{flow_flags, Flow4, Flow6, FlowKey4, FlowKey6};
use tracing::{debug, info, warn};

use crate::model::Backend;

/// Endpoints whose connections must be kept. The sync widens it before it programs new
/// backends and narrows it afterwards, so a scan never sees a connection to a backend that
/// is not in it yet.
pub type Listed = Arc<Mutex<BTreeSet<Backend>>>;

pub struct Reaper {
    listed: Listed,
    scan: Option<Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Reaper {
    /// Starts the scanning thread on the pinned IPv4 and IPv6 flows maps.
    pub fn start(flows4_pin: PathBuf, flows6_pin: PathBuf) -> Self {
        let listed = Listed::default();
        let (scan, requests) = mpsc::channel();
        let shared = listed.clone();
        let thread = std::thread::Builder::new()
            .name("flow-reaper".into())
            .spawn(move || scan_on_request(&flows4_pin, &flows6_pin, &shared, &requests))
            .map_err(
                |error| warn!(%error, "cannot start the flow reaper; gone endpoints keep their connections"),
            )
            .ok();
        Self { listed, scan: Some(scan), thread }
    }

    /// Call before programming `endpoints`: from now on their connections are kept.
    pub fn keep(&self, endpoints: &BTreeSet<Backend>) {
        lock(&self.listed).extend(endpoints.iter().copied());
    }

    /// Call after programming: connections of endpoints not in `endpoints` are broken off.
    pub fn keep_only(&self, endpoints: &BTreeSet<Backend>) {
        let dropped = {
            let mut listed = lock(&self.listed);
            let before = listed.len();
            listed.retain(|endpoint| endpoints.contains(endpoint));
            before != listed.len()
        };
        if dropped {
            self.request_scan();
        }
    }

    /// Scans once whatever changed, e.g. after adopting maps whose connections may lead to
    /// endpoints that went away while the agent was down.
    pub fn request_scan(&self) {
        if let Some(scan) = &self.scan {
            let _ = scan.send(());
        }
    }
}

impl Drop for Reaper {
    fn drop(&mut self) {
        drop(self.scan.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn lock(listed: &Listed) -> std::sync::MutexGuard<'_, BTreeSet<Backend>> {
    listed.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn scan_on_request(flows4_pin: &Path, flows6_pin: &Path, listed: &Listed, requests: &Receiver<()>) {
    while requests.recv().is_ok() {
        // Requests that queued up during a scan are served by the next one.
        while requests.try_recv().is_ok() {}
        for (family, reaped) in
            [("IPv4", reap::<Flow4>(flows4_pin, listed)), ("IPv6", reap::<Flow6>(flows6_pin, listed))]
        {
            match reaped {
                Ok(0) => debug!(family, "no connection to a gone endpoint"),
                Ok(reaped) => {
                    info!(family, entries = reaped, "broke off connections to endpoints that are gone")
                }
                Err(error) => warn!(family, "cannot scan the flows map: {error:#}"),
            }
        }
    }
}

/// A flows-map value of one family, with its key type.
trait TrackedFlow: Pod {
    type Key: Pod;

    /// The backend a flow entry leads to (forward) or comes from (reply).
    fn backend(key: &Self::Key, flow: &Self) -> Backend;
}

macro_rules! tracked_flow {
    ($flow:ty, $key:ty) => {
        impl TrackedFlow for $flow {
            type Key = $key;

            fn backend(key: &$key, flow: &$flow) -> Backend {
                let (addr, port) = if flow.flags & flow_flags::REPLY != 0 {
                    (key.src_addr, key.src_port)
                } else {
                    (flow.dst_addr, flow.dst_port)
                };
                Backend { ip: IpAddr::from(addr), port }
            }
        }
    };
}

tracked_flow!(Flow4, FlowKey4);
tracked_flow!(Flow6, FlowKey6);

fn reap<F: TrackedFlow>(flows_pin: &Path, listed: &Listed) -> anyhow::Result<usize> {
    let map = MapData::from_pin(flows_pin)?;
    let mut flows: HashMap<MapData, F::Key, F> = HashMap::try_from(Map::LruHashMap(map))?;
    let is_gone = |key: &F::Key, flow: &F| !lock(listed).contains(&F::backend(key, flow));
    // Collected first: deleting while iterating would restart the kernel's key walk.
    let gone: Vec<F::Key> = flows
        .iter()
        .filter_map(Result::ok)
        .filter(|(key, flow)| is_gone(key, flow))
        .map(|(key, _)| key)
        .collect();
    let mut reaped = 0;
    for key in &gone {
        // Re-checked: the sync may have listed the backend again meanwhile.
        let still_gone = flows.get(key, 0).is_ok_and(|flow| is_gone(key, &flow));
        if still_gone && flows.remove(key).is_ok() {
            reaped += 1;
        }
    }
    Ok(reaped)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_directions_name_the_backend() {
        let backend = Backend { ip: "10.1.0.2".parse().unwrap(), port: 8080 };
        let forward_key = FlowKey4 {
            src_addr: [10, 0, 0, 9],
            dst_addr: [10, 96, 0, 1],
            src_port: 40000,
            dst_port: 80,
            proto: 6,
            pad: [0; 3],
        };
        let forward = Flow4 {
            src_addr: [0; 4],
            dst_addr: [10, 1, 0, 2],
            src_port: 0,
            dst_port: 8080,
            flags: flow_flags::REWRITE_DESTINATION,
        };
        let reply_key = FlowKey4 {
            src_addr: [10, 1, 0, 2],
            dst_addr: [10, 0, 0, 9],
            src_port: 8080,
            dst_port: 40000,
            proto: 6,
            pad: [0; 3],
        };
        let reply = Flow4 {
            src_addr: [10, 96, 0, 1],
            dst_addr: [0; 4],
            src_port: 80,
            dst_port: 0,
            flags: flow_flags::REPLY | flow_flags::REWRITE_SOURCE,
        };
        assert_eq!(Flow4::backend(&forward_key, &forward), backend);
        assert_eq!(Flow4::backend(&reply_key, &reply), backend);
    }
}
