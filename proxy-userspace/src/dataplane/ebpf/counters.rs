//! Per-service and per-backend packet and byte counters, read from the datapath.
//!
//! Each (service port, backend) pair gets an index into the per-CPU array
//! `vipr_bcnt_v1`, chosen here. The index travels in the backend slot's value and is copied into
//! both flow entries of every connection to that backend, so the datapath counts a packet with
//! an array access (inlined by the kernel) instead of a hash lookup. What is counted: every
//! packet of a balanced connection that passes vipr's TC program, both directions, and its IP
//! length (header and payload, no link-layer header) — the first packet when it is balanced,
//! the later ones when their flow entry matches. Connections of the node's own processes are
//! balanced in the socket hooks and have no flow entry, so they are not counted.
//!
//! A service's totals are the sum of its backends' counters plus what backends that left the
//! service had counted ([`CounterTable::retired`]), so they never go down. An index is handed
//! out again only after it is zeroed, least recently released first; connections of a released
//! pair that still pass count into the index until they end, which is why fresh indices are
//! used before released ones.
use std::{
    collections::{BTreeMap, BTreeSet, HashMap, VecDeque},
    mem::size_of,
    net::IpAddr,
    os::fd::{AsFd as _, BorrowedFd},
    path::Path,
    sync::{Arc, Mutex, PoisonError},
};

use aya::maps::{IterableMap as _, Map, MapData, PerCpuArray, PerCpuValues};
use proxy_common::{datapath_stat, Counters};
use tracing::warn;

use crate::{
    bpf_sys::{self, update_batch},
    metrics::{Collector, Counter, MetricFamily, MetricKind, Sample, SampleValue},
    model::{Backend, ServicePortName},
};

/// A counter index: 0 is the slot of pairs that could not get one of their own.
pub const NOT_COUNTED: u32 = 0;

/// What one index counts. There is one per endpoint of every service port (100k at 10k
/// services × 10 endpoints): the name is shared, not copied.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pair {
    pub service: Arc<ServicePortName>,
    /// With `endpoint`, the key [`CounterIds`] handed the index out for.
    pub service_id: u32,
    pub endpoint: Backend,
}

/// The labels of every index in use, and the totals of pairs that left their service; read by
/// the collector when `/metrics` is scraped.
#[derive(Debug, Default)]
pub struct CounterTable {
    /// By index: indices are handed out densely from 1, so a vector is the smallest map.
    pub pairs: Vec<Option<Pair>>,
    pub retired: BTreeMap<Arc<ServicePortName>, Counters>,
}

impl CounterTable {
    fn insert(&mut self, index: u32, pair: Pair) {
        let index = index as usize;
        if self.pairs.len() <= index {
            self.pairs.resize(index + 1, None);
        }
        self.pairs[index] = Some(pair);
    }

    fn remove(&mut self, index: u32) -> Option<Pair> {
        self.pairs.get_mut(index as usize)?.take()
    }

    /// The indices in use and their pairs, by index.
    pub fn iter(&self) -> impl Iterator<Item = (u32, &Pair)> {
        self.pairs.iter().enumerate().filter_map(|(index, pair)| Some((index as u32, pair.as_ref()?)))
    }
}

pub type SharedTable = Arc<Mutex<CounterTable>>;

fn lock(table: &SharedTable) -> std::sync::MutexGuard<'_, CounterTable> {
    table.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Hands out counter indices to (service port, backend) pairs.
#[derive(Debug)]
pub struct CounterIds {
    capacity: u32,
    /// (service id, backend address, backend port) -> index; the table's pairs are the
    /// reverse.
    by_pair: HashMap<(u32, IpAddr, u16), u32>,
    /// How many pairs each service port has: a release of a few indices then costs what they
    /// do.
    pairs_per_service: HashMap<Arc<ServicePortName>, usize>,
    /// Indices found in the backends map at start, consumed on first use.
    adopted: HashMap<(u32, IpAddr, u16), u32>,
    /// Released indices, least recently released first.
    free: VecDeque<u32>,
    /// The lowest index never handed out.
    next: u32,
    /// Indices handed out since [`Self::take_fresh`]: the caller zeroes them before any slot
    /// carries them.
    fresh: Vec<u32>,
    /// The map was created empty for this agent: an index never handed out holds zeros, and
    /// only released ones are zeroed before they are handed out again (a sync from scratch
    /// then zeroes nothing). Otherwise an earlier agent may have counted into any index.
    new_map: bool,
    exhausted_logged: bool,
    table: SharedTable,
}

impl CounterIds {
    pub fn new(capacity: u32) -> Self {
        Self {
            capacity,
            by_pair: HashMap::new(),
            pairs_per_service: HashMap::new(),
            adopted: HashMap::new(),
            free: VecDeque::new(),
            next: 1,
            fresh: Vec::new(),
            new_map: false,
            exhausted_logged: false,
            table: SharedTable::default(),
        }
    }

    /// Says that the map was created empty by this agent (see [`Self::new_map`]).
    pub fn map_created_empty(&mut self) {
        self.new_map = true;
    }

    pub fn table(&self) -> SharedTable {
        self.table.clone()
    }

    /// Remembers the index a backend slot carries for the service `service_id`, so that an
    /// agent restart keeps counting where the last one stopped.
    pub fn adopt(&mut self, service_id: u32, ip: IpAddr, port: u16, index: u32) {
        if index != NOT_COUNTED && index < self.capacity {
            self.adopted.insert((service_id, ip, port), index);
            self.next = self.next.max(index + 1);
        }
    }

    /// Call once after every adoption: indices below the highest adopted one that no slot
    /// carries are free.
    pub fn adoption_done(&mut self) {
        let adopted: BTreeSet<u32> = self.adopted.values().copied().collect();
        self.free = (1..self.next).filter(|index| !adopted.contains(index)).collect();
    }

    /// The index of `service`'s (id `service_id`) backend `ip:port`, handing one out if it has
    /// none; [`NOT_COUNTED`] when the map is full.
    pub fn index(&mut self, service: &Arc<ServicePortName>, service_id: u32, ip: IpAddr, port: u16) -> u32 {
        let key = (service_id, ip, port);
        if let Some(index) = self.by_pair.get(&key) {
            return *index;
        }
        let index = match self.adopted.remove(&key) {
            Some(index) => index,
            None => match self.allocate() {
                Some(index) => index,
                None => {
                    if !std::mem::replace(&mut self.exhausted_logged, true) {
                        warn!(
                            capacity = self.capacity,
                            "the counters map is full: further backends are counted together, unlabelled \
                             (raise --bpf-counters-max)"
                        );
                    }
                    return NOT_COUNTED;
                }
            },
        };
        self.by_pair.insert(key, index);
        *self.pairs_per_service.entry(service.clone()).or_default() += 1;
        let pair = Pair { service: service.clone(), service_id, endpoint: Backend { ip, port } };
        lock(&self.table).insert(index, pair);
        index
    }

    /// An index that is not in use, to zero (see [`Self::fresh`]) unless it was never handed
    /// out from a map created empty.
    fn allocate(&mut self) -> Option<u32> {
        let index = if self.next < self.capacity {
            self.next += 1;
            if self.new_map {
                return Some(self.next - 1);
            }
            self.next - 1
        } else {
            self.free.pop_front()?
        };
        self.fresh.push(index);
        Some(index)
    }

    /// Indices handed out since the last call, to zero before they are programmed.
    pub fn take_fresh(&mut self) -> Vec<u32> {
        std::mem::take(&mut self.fresh)
    }

    /// Releases every index no programmed slot carries any more (and adopted ones no service
    /// claimed): what it counted goes to its service's retired totals (`last` reads it), and
    /// the index is free again.
    pub fn release_unused(&mut self, in_use: &BTreeSet<u32>, last: impl Fn(u32) -> Option<Counters>) {
        let released: Vec<u32> =
            self.by_pair.values().filter(|index| !in_use.contains(index)).copied().collect();
        self.release(&released, &last);
        // Adopted indices no service claimed are free once no slot carries them.
        let unclaimed: Vec<_> =
            self.adopted.iter().filter(|(_, index)| !in_use.contains(index)).map(|(key, _)| *key).collect();
        for key in unclaimed {
            if let Some(index) = self.adopted.remove(&key) {
                self.free.push_back(index);
            }
        }
    }

    /// Releases `indices`, which no programmed slot carries any more; as
    /// [`Self::release_unused`] for those only.
    pub fn release(&mut self, indices: &[u32], last: impl Fn(u32) -> Option<Counters>) {
        let mut table = lock(&self.table);
        for index in indices {
            let Some(pair) = table.remove(*index) else { continue };
            self.by_pair.remove(&(pair.service_id, pair.endpoint.ip, pair.endpoint.port));
            if let Some(counted) = last(*index) {
                let retired = table.retired.entry(pair.service.clone()).or_default();
                retired.packets += counted.packets;
                retired.bytes += counted.bytes;
            }
            // A service that is gone takes its retired totals with it.
            if let Some(count) = self.pairs_per_service.get_mut(&pair.service) {
                *count -= 1;
                if *count == 0 {
                    self.pairs_per_service.remove(&pair.service);
                    table.retired.remove(&pair.service);
                }
            }
            self.free.push_back(*index);
        }
    }
}

/// The counters map as the agent reads and zeroes it.
pub struct CounterMap {
    map: PerCpuArray<MapData, Counters>,
}

impl CounterMap {
    pub fn new(map: PerCpuArray<MapData, Counters>) -> Self {
        Self { map }
    }

    pub fn open(pin: &Path) -> anyhow::Result<Self> {
        let data = MapData::from_pin(pin)?;
        Ok(Self { map: PerCpuArray::try_from(Map::PerCpuArray(data))? })
    }

    /// The map for the batched system calls aya does not offer.
    fn fd(&self) -> BorrowedFd<'_> {
        self.map.map().fd().as_fd()
    }

    /// The CPU sums of every index in `indices`. A scrape at 10k services × 10 endpoints reads
    /// 100k indices: in batches of [`BATCH`] per system call where the kernel allows
    /// (`BPF_MAP_LOOKUP_BATCH`, Linux 5.6), one call per index otherwise.
    pub fn read_many(&self, indices: &BTreeSet<u32>) -> BTreeMap<u32, Counters> {
        let Some(&highest) = indices.last() else { return BTreeMap::new() };
        if let Some(all) = read_batched(self.fd(), highest) {
            return indices.iter().filter_map(|index| Some((*index, *all.get(*index as usize)?))).collect();
        }
        indices.iter().filter_map(|index| Some((*index, self.read(*index)?))).collect()
    }

    /// The sum over every CPU.
    pub fn read(&self, index: u32) -> Option<Counters> {
        let values = self.map.get(&index, 0).ok()?;
        Some(values.iter().fold(Counters::default(), |sum, cpu| Counters {
            packets: sum.packets + cpu.packets,
            bytes: sum.bytes + cpu.bytes,
        }))
    }

    pub fn zero(&mut self, index: u32) -> anyhow::Result<()> {
        let cpus = aya::util::nr_cpus().map_err(|(what, error)| anyhow::anyhow!("{what}: {error}"))?;
        let zeros = PerCpuValues::try_from(vec![Counters::default(); cpus])?;
        self.map.set(index, zeros, 0)?;
        Ok(())
    }

    /// Zeroes every index in `indices`: in one batched update where the kernel takes it (a
    /// first sync hands out every index at once), else one update each. Errors are logged.
    pub fn zero_many(&mut self, indices: &[u32]) {
        let Ok(cpus) = aya::util::nr_cpus() else { return };
        for chunk in indices.chunks(BATCH as usize) {
            let zeros = vec![Counters::default(); chunk.len() * cpus];
            // SAFETY: the counters array's u32 index and per-CPU `Counters` (aya checked the
            // value size when it opened it), one per possible CPU for each index.
            if unsafe { update_batch(self.fd(), chunk, &zeros) }.is_ok() {
                continue;
            }
            for &index in chunk {
                if let Err(error) = self.zero(index) {
                    warn!(index, "cannot zero a counter: {error:#}");
                }
            }
        }
    }
}

/// Elements per `BPF_MAP_LOOKUP_BATCH` call.
const BATCH: u32 = 4096;

/// Indices `0..=highest` of a per-CPU [`Counters`] array, summed over the CPUs; `None` when the
/// kernel refuses batched lookups.
fn read_batched(fd: BorrowedFd<'_>, highest: u32) -> Option<Vec<Counters>> {
    let cpus = aya::util::nr_cpus().ok()?;
    // The kernel lays out a per-CPU value as one 8-byte-aligned copy per possible CPU.
    const _: () = assert!(size_of::<Counters>().is_multiple_of(8));
    let mut sums = Vec::with_capacity(highest as usize + 1);
    let mut in_order = true;
    let each = |keys: &[u32], values: &[Counters]| {
        for (key, per_cpu) in keys.iter().zip(values.chunks(cpus)) {
            if *key as usize != sums.len() {
                in_order = false;
                return false;
            }
            sums.push(per_cpu.iter().fold(Counters::default(), |sum, cpu| Counters {
                packets: sum.packets + cpu.packets,
                bytes: sum.bytes + cpu.bytes,
            }));
        }
        sums.len() <= highest as usize
    };
    // SAFETY: the counters array's u32 index and per-CPU `Counters` (asserted 8-byte sized
    // above; aya checked the value size when it opened the map), one per possible CPU.
    unsafe { bpf_sys::lookup_batches::<u32, Counters>(fd, BATCH, 1, cpus, each) }?;
    if !in_order {
        return None;
    }
    sums.truncate(highest as usize + 1);
    Some(sums)
}

/// The datapath statistics array (`proxy_common::datapath_stat`).
pub struct StatsMap {
    map: PerCpuArray<MapData, u64>,
}

impl StatsMap {
    pub fn open(pin: &Path) -> anyhow::Result<Self> {
        let data = MapData::from_pin(pin)?;
        Ok(Self { map: PerCpuArray::try_from(Map::PerCpuArray(data))? })
    }

    /// The sum over every CPU of one statistic.
    pub fn read(&self, index: u32) -> u64 {
        self.map.get(&index, 0).map(|values| values.iter().sum()).unwrap_or(0)
    }
}

/// Counts the agent keeps about the flows map (its reaper's work), and the fill level of every
/// pinned map (which the reaper thread refreshes).
#[derive(Debug, Default)]
pub struct FlowMetrics {
    /// Entries deleted because their connection was idle or closed, by protocol and reason.
    pub expired_tcp_idle: Counter,
    pub expired_tcp_closed: Counter,
    /// TCP connections that never completed their handshake (SYN_SENT, SYN_RECV), idle past
    /// their timeout.
    pub expired_tcp_half_open: Counter,
    pub expired_udp: Counter,
    /// Entries of connections that never completed their handshake (UDP: never answered)
    /// expired early because the flows map was above its high-water mark.
    pub evicted_pressure: Counter,
    /// Entries deleted because their endpoint left the EndpointSlices.
    pub reaped_gone_endpoint: Counter,
    /// Pinned map name -> (entries, capacity), as last counted.
    pub map_fill: Mutex<BTreeMap<String, MapFill>>,
}

/// How full one map is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MapFill {
    pub entries: u64,
    pub capacity: u64,
}

impl FlowMetrics {
    pub fn set_fill(&self, map: &str, fill: MapFill) {
        self.map_fill.lock().unwrap_or_else(PoisonError::into_inner).insert(map.to_owned(), fill);
    }

    pub fn fill(&self) -> BTreeMap<String, MapFill> {
        self.map_fill.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }
}

/// `/metrics` families of the datapath's counters.
pub struct DatapathCollector {
    table: SharedTable,
    counters: Mutex<CounterMap>,
    stats: Mutex<StatsMap>,
    flows: Arc<FlowMetrics>,
}

impl DatapathCollector {
    pub fn new(table: SharedTable, counters: CounterMap, stats: StatsMap, flows: Arc<FlowMetrics>) -> Self {
        Self { table, counters: Mutex::new(counters), stats: Mutex::new(stats), flows }
    }
}

/// The insert failures of `datapath_stat`, with their `cause` label.
pub const INSERT_FAILURES: [(u32, &str); 3] = [
    (datapath_stat::FLOW_INSERT_FORWARD, "forward_entry"),
    (datapath_stat::FLOW_INSERT_REPLY, "reply_entry"),
    (datapath_stat::SNAT_PORT_EXHAUSTED, "snat_port_exhausted"),
];

/// The direct-server-return events of `datapath_stat`, with their `event` label.
pub const DSR_EVENTS: [(u32, &str); 6] = [
    (datapath_stat::DSR_SENT, "connection_sent"),
    (datapath_stat::DSR_RECEIVED, "connection_received"),
    (datapath_stat::DSR_MTU_SNAT, "mtu_snat_fallback"),
    (datapath_stat::DSR_MTU_NO_OPTION, "mtu_option_skipped"),
    (datapath_stat::DSR_CARRIER_IGNORED, "carrier_ignored"),
    (datapath_stat::DSR_CARRIER_REFUSED, "carrier_refused"),
];

/// Label names stay clear of the target labels Prometheus-Operator puts on every series
/// (`namespace`, `service`, `pod`, `endpoint`, ...), which would rename them `exported_*`.
fn service_labels(service: &ServicePortName) -> Vec<(String, String)> {
    vec![
        ("service_namespace".to_owned(), service.namespace.clone()),
        ("service_name".to_owned(), service.name.clone()),
        ("service_port".to_owned(), service.port.clone()),
        ("protocol".to_owned(), service.protocol.to_string()),
    ]
}

fn family(name: &str, help: &str, samples: Vec<Sample>) -> MetricFamily {
    MetricFamily { name: name.to_owned(), help: help.to_owned(), kind: MetricKind::Counter, samples }
}

fn gauge(name: &str, help: &str, samples: Vec<Sample>) -> MetricFamily {
    MetricFamily { name: name.to_owned(), help: help.to_owned(), kind: MetricKind::Gauge, samples }
}

fn reason(reason: &str, value: u64) -> Sample {
    sample(vec![("reason".to_owned(), reason.to_owned())], value)
}

fn sample(labels: Vec<(String, String)>, value: u64) -> Sample {
    Sample { labels, value: SampleValue::Number(value as f64) }
}

impl Collector for DatapathCollector {
    fn collect(&self) -> Vec<MetricFamily> {
        // Copied out, so a scrape never holds up a sync while it reads the map.
        let (pairs, retired) = {
            let table = lock(&self.table);
            let pairs: Vec<(u32, Pair)> = table.iter().map(|(index, pair)| (index, pair.clone())).collect();
            (pairs, table.retired.clone())
        };
        let mut by_service: BTreeMap<Arc<ServicePortName>, Counters> = retired;
        let (mut backend_packets, mut backend_bytes) = (Vec::new(), Vec::new());
        {
            let indices: BTreeSet<u32> = pairs.iter().map(|(index, _)| *index).collect();
            let counted_by_index =
                self.counters.lock().unwrap_or_else(PoisonError::into_inner).read_many(&indices);
            for (index, pair) in &pairs {
                let counted = counted_by_index.get(index).copied().unwrap_or_default();
                let total = by_service.entry(pair.service.clone()).or_default();
                total.packets += counted.packets;
                total.bytes += counted.bytes;
                let mut labels = service_labels(&pair.service);
                labels.push(("backend".to_owned(), pair.endpoint.to_string()));
                backend_packets.push(sample(labels.clone(), counted.packets));
                backend_bytes.push(sample(labels, counted.bytes));
            }
        }
        let (mut service_packets, mut service_bytes) = (Vec::new(), Vec::new());
        for (service, total) in &by_service {
            service_packets.push(sample(service_labels(service), total.packets));
            service_bytes.push(sample(service_labels(service), total.bytes));
        }
        let (failures, evictions, refusals, remapped) = {
            let stats = self.stats.lock().unwrap_or_else(PoisonError::into_inner);
            let failures = INSERT_FAILURES
                .iter()
                .map(|(index, cause)| {
                    sample(vec![("cause".to_owned(), (*cause).to_owned())], stats.read(*index))
                })
                .collect();
            let evictions = vec![
                reason("early_drop", stats.read(datapath_stat::EARLY_DROP)),
                reason("pressure", self.flows.evicted_pressure.get()),
            ];
            let refusals = vec![
                reason(
                    "map_full",
                    stats.read(datapath_stat::FLOW_INSERT_FORWARD)
                        + stats.read(datapath_stat::FLOW_INSERT_REPLY),
                ),
                reason("snat_port_exhausted", stats.read(datapath_stat::SNAT_PORT_EXHAUSTED)),
                reason("upgrade_switch", stats.read(datapath_stat::SWITCH_HELD)),
            ];
            (failures, evictions, refusals, stats.read(datapath_stat::REPLY_CLASH_REMAPPED))
        };
        let (rejects_limited, direct_return) = {
            let stats = self.stats.lock().unwrap_or_else(PoisonError::into_inner);
            let direct_return = DSR_EVENTS
                .iter()
                .map(|(index, event)| {
                    sample(vec![("event".to_owned(), (*event).to_owned())], stats.read(*index))
                })
                .collect();
            (stats.read(datapath_stat::REJECT_RATE_LIMITED), direct_return)
        };
        let (mut entries, mut capacities) = (Vec::new(), Vec::new());
        for (map, fill) in self.flows.fill() {
            entries.push(sample(vec![("map".to_owned(), map.clone())], fill.entries));
            capacities.push(sample(vec![("map".to_owned(), map)], fill.capacity));
        }
        let expired = [
            ("TCP", "idle", &self.flows.expired_tcp_idle),
            ("TCP", "closed", &self.flows.expired_tcp_closed),
            ("TCP", "half_open", &self.flows.expired_tcp_half_open),
            ("UDP", "idle", &self.flows.expired_udp),
        ]
        .into_iter()
        .map(|(protocol, reason, counter)| {
            sample(
                vec![("protocol".to_owned(), protocol.to_owned()), ("reason".to_owned(), reason.to_owned())],
                counter.get(),
            )
        })
        .collect();
        vec![
            family(
                "vipr_service_packets_total",
                "Packets of the service port's balanced connections through the eBPF datapath, both directions",
                service_packets,
            ),
            family(
                "vipr_service_bytes_total",
                "Bytes (IP length) of the service port's balanced connections through the eBPF datapath, both \
                 directions",
                service_bytes,
            ),
            family(
                "vipr_backend_packets_total",
                "Packets of the connections the eBPF datapath balanced to this endpoint of the service port, both \
                 directions",
                backend_packets,
            ),
            family(
                "vipr_backend_bytes_total",
                "Bytes (IP length) of the connections the eBPF datapath balanced to this endpoint of the service \
                 port, both directions",
                backend_bytes,
            ),
            family(
                "vipr_datapath_flow_insert_failures_total",
                "New connections whose flow entry the datapath could not store, by cause (snat_port_exhausted \
                 drops the packet)",
                failures,
            ),
            family(
                "vipr_flow_entries_expired_total",
                "Flow entries the agent deleted because their connection was idle, closed or never completed its \
                 handshake (half_open), past its timeout",
                expired,
            ),
            family(
                "vipr_flow_evictions_total",
                "Flow entries deleted before their timeout to make room, by reason: early_drop (the flows map was \
                 full: a connection that never completed its handshake gave way to a new one), pressure (expired early \
                 above the flows map's high-water mark or while masquerade ports ran out); established connections \
                 are never evicted",
                evictions,
            ),
            family(
                "vipr_flow_refusals_total",
                "New connections the datapath refused (their packet dropped), by reason: map_full (no entry could be \
                 stored nor evicted), snat_port_exhausted (no masquerade port free or reclaimable), upgrade_switch (a \
                 TCP packet past its handshake without an entry while an upgrade switched maps: its entry was being \
                 copied; the sender retransmits it)",
                refusals,
            ),
            family(
                "vipr_flow_source_ports_remapped_total",
                "New connections given another source port (their address kept) because their reply tuple was \
                 another connection's: the same client port reaching the same backend through another frontend",
                vec![sample(Vec::new(), remapped)],
            ),
            family(
                "vipr_datapath_rejects_rate_limited_total",
                "Packets to a service without endpoints (or a cluster IP's unserved port) dropped instead of \
                 rejected because the node's rejects were over their rate (1000/s, burst 50)",
                vec![sample(Vec::new(), rejects_limited)],
            ),
            family(
                "vipr_datapath_dsr_total",
                "Direct server return (--lb-mode=dsr|hybrid), by event: connection_sent (this node sent a new \
                 connection to a backend on another node without source NAT), connection_received (a request \
                 carried its service address here: this node's backend replies straight to the client), \
                 mtu_snat_fallback (a new connection masqueraded instead: the option would have exceeded the MTU), \
                 mtu_option_skipped (a DSR connection's packet sent without the option for the same reason), \
                 carrier_ignored (a request carried a service address this node does not take: \
                 --lb-mode=snat, or UDP with hybrid, unless --lb-dsr-accept), carrier_refused (a request \
                 carried a service address that no service of its backend has: a new connection dropped, a \
                 retransmitted SYN's renewal skipped)",
                direct_return,
            ),
            gauge(
                "vipr_bpf_map_entries",
                "Entries in each pinned BPF map as last counted (arrays: their capacity)",
                entries,
            ),
            gauge("vipr_bpf_map_capacity", "Capacity (max_entries) of each pinned BPF map", capacities),
            family(
                "vipr_flow_entries_reaped_total",
                "Flow entries the agent deleted because their endpoint left the EndpointSlices",
                vec![sample(Vec::new(), self.flows.reaped_gone_endpoint.get())],
            ),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        bpf_sys::{bpf, cmd, MapCreateAttr},
        model::Protocol,
    };

    fn service(name: &str) -> Arc<ServicePortName> {
        Arc::new(ServicePortName {
            namespace: "ns".into(),
            name: name.into(),
            port: "http".into(),
            protocol: Protocol::Tcp,
        })
    }

    #[test]
    fn indices_are_per_pair_and_reused_only_after_release() {
        let ip: IpAddr = "10.1.0.1".parse().unwrap();
        let other: IpAddr = "10.1.0.2".parse().unwrap();
        let mut ids = CounterIds::new(4);
        let (web, api) = (service("web"), service("api"));
        let a = ids.index(&web, 1, ip, 8080);
        assert_eq!(ids.index(&web, 1, ip, 8080), a, "stable while in use");
        let b = ids.index(&api, 2, ip, 8080);
        let c = ids.index(&web, 1, other, 8080);
        assert_eq!([a, b, c], [1, 2, 3]);
        assert_eq!(ids.take_fresh(), [1, 2, 3]);
        // Full (index 0 is never handed out).
        assert_eq!(ids.index(&web, 1, other, 9090), NOT_COUNTED);

        // `b` leaves: its count goes to api's retired total and its index is free again.
        ids.release_unused(&BTreeSet::from([a, c]), |index| {
            Some(Counters { packets: u64::from(index) * 10, bytes: 100 })
        });
        assert_eq!(lock(&ids.table).retired.get(&api), None, "api has no backend left: it is gone");
        assert_eq!(ids.index(&web, 1, other, 9090), b);
        assert_eq!(ids.take_fresh(), [b], "a reused index is zeroed too");

        // web's backend `c` leaves while web stays: its count is kept in web's total.
        ids.release_unused(&BTreeSet::from([a, b]), |_| Some(Counters { packets: 7, bytes: 700 }));
        assert_eq!(lock(&ids.table).retired[&web], Counters { packets: 7, bytes: 700 });
        assert_eq!(lock(&ids.table).iter().map(|(index, _)| index).collect::<Vec<_>>(), [a, b]);
        assert_eq!(ids.by_pair.len(), 2);
    }

    /// A map created empty holds zeros at every index never handed out: those are not zeroed
    /// again (a sync from scratch zeroes nothing), a released one handed out again is.
    #[test]
    fn a_new_map_zeroes_only_reused_indices() {
        let ip: IpAddr = "10.1.0.1".parse().unwrap();
        let mut ids = CounterIds::new(3);
        ids.map_created_empty();
        let web = service("web");
        let (a, b) = (ids.index(&web, 1, ip, 1), ids.index(&web, 1, ip, 2));
        assert!(ids.take_fresh().is_empty(), "never handed out: zero already");
        ids.release_unused(&BTreeSet::from([b]), |_| None);
        assert_eq!(ids.index(&web, 1, ip, 3), a);
        assert_eq!(ids.take_fresh(), [a], "a reused index may hold its earlier pair's count");
    }

    #[test]
    fn adopted_indices_are_kept_and_the_rest_is_free() {
        let ip: IpAddr = "10.1.0.1".parse().unwrap();
        let mut ids = CounterIds::new(100);
        ids.adopt(5, ip, 8080, 7);
        ids.adoption_done();
        assert_eq!(ids.index(&service("web"), 5, ip, 8080), 7);
        assert!(ids.take_fresh().is_empty(), "an adopted index keeps its count");
        // Fresh indices first (8...), then the gaps below the adopted one.
        assert_eq!(ids.index(&service("web"), 5, ip, 1), 8);
        assert_eq!(ids.free.iter().copied().collect::<Vec<_>>(), [1, 2, 3, 4, 5, 6]);
    }

    /// A per-CPU array like `vipr_bcnt_v1`, created directly (needs root).
    fn counters_array(entries: u32) -> CounterMap {
        const BPF_MAP_TYPE_PERCPU_ARRAY: u32 = 6;
        let mut attr = MapCreateAttr {
            map_type: BPF_MAP_TYPE_PERCPU_ARRAY,
            key_size: 4,
            value_size: size_of::<Counters>() as u32,
            max_entries: entries,
            map_flags: 0,
        };
        // SAFETY: the attribute holds no pointers.
        let fd = unsafe { bpf(cmd::MAP_CREATE, &mut attr) }.and_then(crate::bpf_sys::owned_fd);
        let fd = fd.expect("BPF_MAP_CREATE");
        let data = MapData::from_fd(fd).expect("map from fd");
        CounterMap::new(PerCpuArray::try_from(Map::PerCpuArray(data)).expect("per-CPU array"))
    }

    #[test]
    fn batched_reads_agree_with_single_reads() {
        // Over two batches, with a gap of untouched indices.
        let mut counters = counters_array(2 * BATCH + 100);
        let cpus = aya::util::nr_cpus().expect("cpus");
        for index in [1, 2, BATCH - 1, BATCH, BATCH + 1, 2 * BATCH + 7] {
            let per_cpu: Vec<Counters> = (0..cpus as u64)
                .map(|cpu| Counters { packets: u64::from(index) + cpu, bytes: 1000 * u64::from(index) + cpu })
                .collect();
            counters.map.set(index, PerCpuValues::try_from(per_cpu).expect("values"), 0).expect("set");
        }
        let wanted: BTreeSet<u32> = [0, 1, 2, 3, BATCH - 1, BATCH, BATCH + 1, 2 * BATCH + 7].into();
        let batched = read_batched(counters.fd(), 2 * BATCH + 7).expect("this kernel has batched lookups");
        assert_eq!(batched.len(), 2 * BATCH as usize + 8);
        let many = counters.read_many(&wanted);
        for index in wanted {
            let single = counters.read(index).expect("single read");
            assert_eq!(many[&index], single, "index {index}");
            assert_eq!(batched[index as usize], single, "index {index}");
        }
        assert_eq!(many[&1].packets, (0..cpus as u64).map(|cpu| 1 + cpu).sum::<u64>());

        // Zeroing in batches, across the batch boundary; other indices keep their counts.
        counters.zero_many(&[1, BATCH - 1, BATCH, 2 * BATCH + 7]);
        for index in [1, BATCH - 1, BATCH, 2 * BATCH + 7] {
            assert_eq!(counters.read(index), Some(Counters::default()), "index {index}");
        }
        assert_ne!(counters.read(2), Some(Counters::default()));
        assert_ne!(counters.read(BATCH + 1), Some(Counters::default()));
    }
}
