//! The local-traffic detector by interface (`--detect-local-mode=BridgeInterface` or
//! `InterfaceNamePrefix`) in the eBPF datapath: the indexes of the node's pod interfaces in
//! `vipr_podif_v1`, which the TC and XDP programs look up when they classify a new
//! connection's source (proxy-ebpf/src/tc.rs `classify`), for both families.
//!
//! The model names the interfaces (a bridge, or a name prefix); their indexes are the kernel's
//! and change when an interface is created again, so they are resolved here from the node's
//! links, at every sync and whenever links come and go, before a new device gets the program:
//! a new pod's first packet already counts as a pod's. A bridge's ports count as the bridge:
//! the program sees a pod's packet first at ingress of its veth, before the bridge.
use std::collections::BTreeMap;

use aya::{
    maps::{HashMap, MapData},
    Ebpf,
};
use proxy_common::pod_interfaces::MAP;
use tracing::{info, warn};

use super::mirror::Mirrored;
use crate::{
    host::{self, Link},
    model::PodInterfaces,
};

pub struct PodInterfaceMap {
    map: Mirrored<HashMap<MapData, u32, u8>>,
    /// The detector of the latest state synced; `None` keeps the map empty.
    detector: Option<PodInterfaces>,
    /// The interfaces last written, by name, for the log.
    names: Vec<String>,
    /// The failure last logged, so that a lasting one (a full map) is logged once.
    last_failure: Option<String>,
}

impl PodInterfaceMap {
    /// Adopts the pinned map as an earlier agent left it (its entries stay until the first
    /// sync says which detector applies).
    pub fn start(ebpf: &mut Ebpf) -> anyhow::Result<Self> {
        Ok(Self {
            map: Mirrored::adopt(super::take_map(ebpf, MAP)?),
            detector: None,
            names: Vec::new(),
            last_failure: None,
        })
    }

    /// Follows the detector of the state being synced, and the node's links now.
    pub fn follow(&mut self, detector: Option<&PodInterfaces>) {
        self.detector = detector.cloned();
        self.refresh();
    }

    /// Writes the indexes of the pod interfaces that exist now. A failed listing keeps the map
    /// as it is (retried at the next sync or link change); entries the map has no room for are
    /// logged and retried likewise.
    pub fn refresh(&mut self) {
        let links = match &self.detector {
            None => Vec::new(),
            Some(_) => match host::links() {
                Ok(links) => links,
                Err(error) => {
                    self.report(format!("cannot list the node's interfaces: {error}"));
                    return;
                }
            },
        };
        let pods = self.detector.as_ref().map(|detector| pod_links(detector, &links)).unwrap_or_default();
        let wanted: BTreeMap<u32, u8> = pods.iter().map(|link| (link.index, 1)).collect();
        let (changed, failures) = self.map.sync(&wanted);
        if !failures.is_empty() {
            self.report(format!(
                "cannot write {} of the {} pod interfaces into {MAP} (capacity {}): {}; their traffic \
                 counts as from outside the node until it can be written",
                failures.len(),
                wanted.len(),
                proxy_common::pod_interfaces::CAPACITY,
                failures[0]
            ));
        } else {
            self.last_failure = None;
        }
        let names: Vec<String> = pods.iter().map(|link| link.name.clone()).collect();
        if changed > 0 && names != self.names {
            info!(interfaces = ?names, "pod interfaces of the local-traffic detector");
            self.names = names;
        }
    }

    fn report(&mut self, failure: String) {
        if self.last_failure.as_ref() != Some(&failure) {
            warn!("{failure}");
            self.last_failure = Some(failure);
        }
    }
}

/// The links through which pod traffic enters, as `detector` names them.
fn pod_links<'a>(detector: &PodInterfaces, links: &'a [Link]) -> Vec<&'a Link> {
    links.iter().filter(|link| detector.admits(&link.name, link.master_name(links))).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn link(index: u32, name: &str, master: Option<u32>) -> Link {
        Link { index, name: name.into(), master }
    }

    #[test]
    fn a_bridge_brings_its_ports_and_a_prefix_its_namesakes() {
        let links = [
            link(1, "lo", None),
            link(2, "eth0", None),
            link(3, "cbr0", None),
            link(4, "veth1", Some(3)),
            link(5, "veth2", Some(3)),
            link(6, "vethx", None),
            link(7, "eth1", Some(8)),
            link(8, "bond0", None),
        ];
        let indexes = |detector: PodInterfaces| -> Vec<u32> {
            pod_links(&detector, &links).iter().map(|link| link.index).collect()
        };
        assert_eq!(indexes(PodInterfaces::Bridge("cbr0".into())), [3, 4, 5]);
        assert_eq!(indexes(PodInterfaces::NamePrefix("veth".into())), [4, 5, 6]);
        assert_eq!(indexes(PodInterfaces::Bridge("br-missing".into())), Vec::<u32>::new());
    }
}
