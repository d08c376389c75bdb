//! What vipr has programmed, read from its pinned maps the way an operator would: with
//! `bpftool -j map dump`, whose "formatted" field names come from the maps' BTF.

use std::{
    collections::BTreeMap,
    net::{Ipv4Addr, SocketAddrV4},
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result};
use proxy_common::pins;
use serde::{de::DeserializeOwned, Deserialize};

use crate::{cmd, Frontend, Protocol};

/// The maps vipr pinned under `<bpf root>/vipr`.
#[derive(Clone, Debug)]
pub struct PinnedMaps {
    dir: PathBuf,
}

/// A services-map value: which backend set a frontend uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
pub struct ServiceEntry {
    pub backend_set: u32,
    pub backend_count: u32,
    pub service_id: u32,
    pub flags: u32,
}

impl PinnedMaps {
    pub fn new(bpf_root: &Path) -> Self {
        Self { dir: bpf_root.join(pins::DIR) }
    }

    /// `<bpf root>/vipr`, which `vipr --cleanup` removes.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn path(&self, map: &str) -> PathBuf {
        self.dir.join(map)
    }

    /// The services map as it applies to clients outside the cluster (the labs' clients are):
    /// frontend -> backend set.
    pub fn services(&self) -> Result<BTreeMap<Frontend, ServiceEntry>> {
        self.dump::<ServiceKey, ServiceEntry>(pins::SERVICES4)?
            .into_iter()
            .filter(|(key, _)| key.source_class == proxy_common::source_class::OUTSIDE)
            .map(|(key, service)| {
                let protocol = Protocol::from_number(key.proto)
                    .with_context(|| format!("unexpected protocol {} in {key:?}", key.proto))?;
                let addr = SocketAddrV4::new(Ipv4Addr::from(key.addr), key.port);
                Ok((Frontend { addr, protocol }, service))
            })
            .collect()
    }

    /// The backends map: (backend set, slot) -> backend.
    pub fn backends(&self) -> Result<BTreeMap<(u32, u32), SocketAddrV4>> {
        Ok(self
            .dump::<BackendSlot, Backend>(pins::BACKENDS4)?
            .into_iter()
            .map(|(slot, backend)| {
                ((slot.backend_set, slot.slot), SocketAddrV4::new(Ipv4Addr::from(backend.addr), backend.port))
            })
            .collect())
    }

    /// The backends a new connection to `frontend` can reach now, sorted; `None` if the
    /// frontend is not programmed. A slot the agent has not filled (yet) is an error.
    pub fn frontend_backends(&self, frontend: Frontend) -> Result<Option<Vec<SocketAddrV4>>> {
        let Some(service) = self.services()?.get(&frontend).copied() else {
            return Ok(None);
        };
        let slots = self.backends()?;
        let mut backends = (0..service.backend_count)
            .map(|slot| {
                slots
                    .get(&(service.backend_set, slot))
                    .copied()
                    .with_context(|| format!("{frontend} uses {service:?} but its slot {slot} is empty"))
            })
            .collect::<Result<Vec<_>>>()?;
        backends.sort();
        Ok(Some(backends))
    }

    /// The unmatched-address trie: `address/prefix` -> what becomes of a packet to an address
    /// inside that no frontend matched (`proxy_common::unmatched::*`).
    pub fn unmatched(&self) -> Result<BTreeMap<String, u8>> {
        Ok(self
            .dump::<Prefix4, u8>(pins::UNMATCHED4)?
            .into_iter()
            .map(|(prefix, action)| {
                (format!("{}/{}", Ipv4Addr::from(prefix.addr), prefix.prefix_len), action)
            })
            .collect())
    }

    /// The backend-set membership map, which session affinity reads: (backend set, backend)
    /// -> the first slot that holds it.
    pub fn members(&self) -> Result<BTreeMap<(u32, SocketAddrV4), u32>> {
        Ok(self
            .dump::<BackendMember, u32>(pins::MEMBERS4)?
            .into_iter()
            .map(|(member, slot)| {
                ((member.backend_set, SocketAddrV4::new(Ipv4Addr::from(member.addr), member.port)), slot)
            })
            .collect())
    }

    /// The IPv4 flows map: each tracked direction's tuple (source, destination) and what its
    /// entry holds of the next hop cached for it.
    pub fn flows(&self) -> Result<Vec<FlowEntry>> {
        Ok(self
            .dump::<FlowKey, FlowValue>(pins::FLOWS4)?
            .into_iter()
            .map(|(key, flow)| FlowEntry {
                source: SocketAddrV4::new(Ipv4Addr::from(key.src_addr), key.src_port),
                destination: SocketAddrV4::new(Ipv4Addr::from(key.dst_addr), key.dst_port),
                route_generation: flow.flags >> proxy_common::flow_flags::ROUTE_GENERATION_SHIFT,
                next_hop_ifindex: flow.next_hop.ifindex,
                next_hop_mac: flow.next_hop.dst_mac,
            })
            .collect())
    }

    /// The route generation next hops are cached under; 0: the cache is off.
    pub fn route_generation(&self) -> Result<u32> {
        let entries = self.dump::<u32, u32>(pins::ROUTE_GENERATION)?;
        Ok(entries.first().map_or(0, |(_, generation)| *generation))
    }

    fn dump<K: DeserializeOwned, V: DeserializeOwned>(&self, map: &str) -> Result<Vec<(K, V)>> {
        let path = self.path(map);
        let json = cmd::run(Command::new("bpftool").arg("-j").args(["map", "dump", "pinned"]).arg(&path))?;
        let entries: Vec<Entry<K, V>> = serde_json::from_str(&json).with_context(|| {
            format!("unexpected `bpftool -j map dump` output for {}: {json}", path.display())
        })?;
        Ok(entries.into_iter().map(|entry| (entry.formatted.key, entry.formatted.value)).collect())
    }
}

/// One element of `bpftool -j map dump`; "key" and "value" (hex bytes) are ignored.
#[derive(Deserialize)]
struct Entry<K, V> {
    formatted: Formatted<K, V>,
}

#[derive(Deserialize)]
struct Formatted<K, V> {
    key: K,
    value: V,
}

// Mirrors of proxy_common's map types as bpftool prints them (padding omitted).

#[derive(Debug, Deserialize)]
struct ServiceKey {
    addr: [u8; 4],
    port: u16,
    proto: u8,
    source_class: u8,
}

/// One entry of the flows map, as [`PinnedMaps::flows`] reads it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlowEntry {
    pub source: SocketAddrV4,
    pub destination: SocketAddrV4,
    /// The route generation its next hop was cached under (0: never cached).
    pub route_generation: u32,
    /// The cached egress interface (0: none) and neighbour's address.
    pub next_hop_ifindex: u32,
    pub next_hop_mac: [u8; 6],
}

#[derive(Deserialize)]
struct FlowKey {
    src_addr: [u8; 4],
    dst_addr: [u8; 4],
    src_port: u16,
    dst_port: u16,
}

#[derive(Deserialize)]
struct FlowValue {
    flags: u32,
    next_hop: NextHop,
}

#[derive(Deserialize)]
struct NextHop {
    ifindex: u32,
    dst_mac: [u8; 6],
}

#[derive(Deserialize)]
struct Prefix4 {
    prefix_len: u32,
    addr: [u8; 4],
}

#[derive(Deserialize)]
struct BackendSlot {
    backend_set: u32,
    slot: u32,
}

#[derive(Deserialize)]
struct Backend {
    addr: [u8; 4],
    port: u16,
}

#[derive(Deserialize)]
struct BackendMember {
    backend_set: u32,
    addr: [u8; 4],
    port: u16,
}
