//! `vipr inspect` in ipvs mode: the virtual services and real servers, read over generic
//! netlink with the IPVS dataplane's own client (what `ipvsadm -Ln` shows), and kube-proxy's
//! ipsets with their entry counts.
use std::net::SocketAddr;

use anyhow::Context as _;

use super::{BackendView, FrontendView, MapView};
use crate::dataplane::ipvs::{
    client::{Ipvs, SERVICE_PERSISTENT},
    ipset::{self, IpsetTool},
    link::{self, DUMMY_INTERFACE},
};

/// Whether the IPVS mode's dummy interface exists here.
pub fn present() -> bool {
    link::index(DUMMY_INTERFACE).is_some()
}

pub fn services() -> anyhow::Result<Vec<FrontendView>> {
    let mut ipvs = Ipvs::open().context("cannot reach IPVS (does this kernel have it?)")?;
    let mut frontends = Vec::new();
    for server in ipvs.services().context("cannot list the IPVS virtual services")? {
        let key = server.key;
        let destinations =
            ipvs.destinations(&key).with_context(|| format!("cannot list the real servers of {key}"))?;
        let mut flags = vec![scheduler_name(&server.settings.scheduler)];
        if destinations.is_empty() {
            flags.push("no-endpoints");
        }
        let persistent = server.settings.flags & SERVICE_PERSISTENT != 0;
        let mut backends: Vec<BackendView> = destinations
            .into_iter()
            .map(|destination| BackendView {
                address: SocketAddr::new(destination.ip, destination.port),
                slots: destination.weight,
                packets: 0,
                bytes: 0,
                active_connections: Some(destination.active_connections),
                inactive_connections: Some(destination.inactive_connections),
            })
            .collect();
        backends.sort_by_key(|backend| backend.address);
        frontends.push(FrontendView {
            protocol: protocol_name(key.protocol),
            frontend: SocketAddr::new(key.ip, key.port),
            source: "all",
            service_id: None,
            service: None,
            flags,
            affinity_seconds: persistent.then_some(server.settings.timeout),
            backends,
        });
    }
    Ok(frontends)
}

fn protocol_name(protocol: crate::model::Protocol) -> &'static str {
    match protocol {
        crate::model::Protocol::Tcp => "TCP",
        crate::model::Protocol::Udp => "UDP",
        crate::model::Protocol::Sctp => "SCTP",
    }
}

/// The scheduler as a flag (`rr`, `wrr`, ...), as a static name where it is one of IPVS's.
fn scheduler_name(scheduler: &str) -> &'static str {
    crate::dataplane::ipvs::SCHEDULERS
        .iter()
        .find(|known| **known == scheduler)
        .copied()
        .unwrap_or("scheduler?")
}

/// kube-proxy's ipsets (those of the IPVS mode that exist), with their entries and `maxelem`.
pub fn maps() -> anyhow::Result<Vec<MapView>> {
    let saved = IpsetTool.save()?;
    let sets = ipset::all_sets();
    let contents = ipset::parse_save(&saved, &sets);
    let mut maps = Vec::new();
    for line in saved.lines() {
        let Some(create) = line.strip_prefix("create ") else { continue };
        let words: Vec<&str> = create.split_whitespace().collect();
        let Some(name) = words.first() else { continue };
        if !sets.iter().any(|(known, _, _)| known == name) {
            continue;
        }
        let capacity = words
            .windows(2)
            .find(|pair| pair[0] == "maxelem")
            .and_then(|pair| pair[1].parse().ok())
            .unwrap_or(65_536);
        let entries = contents.get(*name).map_or(0, |entries| entries.len() as u64);
        maps.push(MapView {
            name: (*name).to_owned(),
            kind: words.get(1).copied().unwrap_or("?").to_owned(),
            entries,
            capacity,
            fills: true,
        });
    }
    maps.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(maps)
}
