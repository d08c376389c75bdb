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
//! The same thread ends connections that are over, as the kernel's conntrack does with its
//! timeouts (kube-proxy's `--conntrack-*` flags, [`ConntrackTimeouts`]): every
//! [`Timing::interval`] it deletes both entries of each connection idle for longer than its
//! state allows — TCP never answered (SYN sent), TCP answered whose client never completed the
//! handshake (SYN received), TCP established, TCP with a FIN one way (close-wait), TCP with a
//! FIN both ways or an RST (closed), UDP (and SCTP) never answered, answered (stream). The
//! datapath keeps each entry's last packet time (to a second), the FIN/RST it saw and the
//! connection's handshake progress in [`FlowTrack`]. Between two passes an expired connection
//! lives on, so entries last up to one interval past their timeout.
//!
//! The flows map is a plain hash map: besides these deletions only the datapath's early drop
//! removes entries (a new connection that finds the map full replaces one that never
//! completed its handshake). Above the high-water mark ([`crate::dataplane::ebpf::FlowPressure`]) the
//! passes run every second and such connections expire after the short pressure timeout, so
//! a flood of spoofed SYNs or one-datagram UDP flows drains within seconds; established
//! connections keep their timeouts. The same pass logs, at most once a minute, new
//! flow-insert failures of the datapath, and counts every pinned map's entries for
//! `vipr_bpf_map_entries`.
//!
//! Scanning the flows map takes a while at scale, so it runs on its own thread, off the sync
//! path.
use std::{
    collections::{btree_map, BTreeMap, BTreeSet, HashSet},
    hash::Hash,
    net::IpAddr,
    path::{Path, PathBuf},
    sync::{
        mpsc::{self, Receiver, RecvTimeoutError, Sender},
        Arc, Mutex,
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use aya::{
    maps::{HashMap, IterableMap as _, Map, MapData},
    Pod,
};
use proxy_common::{
    datapath_stat, flow_flags, flow_state, proto, Flow4, Flow6, FlowKey4, FlowKey6, FlowTrack,
};
use tracing::{debug, info, warn};

use std::os::fd::AsFd as _;

use super::counters::{FlowMetrics, MapFill, StatsMap, INSERT_FAILURES};
use super::ConntrackTimeouts;
use crate::model::Backend;

/// Where the reaper finds the maps, and how long connections live.
#[derive(Clone, Debug)]
pub struct ReaperOptions {
    /// Where every pinned map is, for their fill levels.
    pub pin_dir: PathBuf,
    pub flows4_pin: PathBuf,
    pub flows6_pin: PathBuf,
    /// The datapath's statistics, for the insert-failure log.
    pub stats_pin: PathBuf,
    pub timeouts: ConntrackTimeouts,
}

/// How often the expiry pass runs: as often as the shortest timeout, so that entries outlive
/// it by at most that much, but no more than every second (each pass walks the whole map) and
/// at least every minute.
fn interval(timeouts: &ConntrackTimeouts) -> Duration {
    [
        timeouts.tcp_established,
        timeouts.tcp_close_wait,
        timeouts.tcp_closed,
        timeouts.tcp_syn_sent,
        timeouts.tcp_syn_recv,
        timeouts.udp,
        timeouts.udp_stream,
    ]
    .into_iter()
    .min()
    .unwrap_or(Duration::from_secs(60))
    .clamp(Duration::from_secs(1), Duration::from_secs(60))
}

/// How often the expiry pass runs while a flows map is above its high-water mark: often enough
/// that half-open entries go soon after the pressure timeout, at most four times a second.
fn pressure_interval(timeouts: &ConntrackTimeouts) -> Duration {
    (timeouts.pressure.timeout / 2)
        .clamp(Duration::from_millis(250), Duration::from_secs(1))
        .min(interval(timeouts))
}

/// How often the fill level of the maps other than the flows maps is counted (a system call
/// per entry).
const FILL_INTERVAL: Duration = Duration::from_secs(10);

/// The insert-failure log's rate limit.
const FAILURE_LOG_INTERVAL: Duration = Duration::from_secs(60);

/// What decides which connections are kept, shared with the scanning thread.
type Listed = Arc<Mutex<Kept>>;

/// What the scans for gone endpoints read. The reaper holds no copy of the listed endpoints
/// (100k endpoints are ~3 MiB): between full syncs it knows only the endpoints that went, and
/// for the scan after a full sync it shares the desired state's set until that scan is done.
#[derive(Debug, Default)]
struct Kept {
    /// After a full sync, until its scan is done: every listed endpoint (the desired state's
    /// set, shared) and the round it was handed over in. Connections to any other endpoint go.
    listed: Option<(Arc<BTreeSet<Backend>>, u64)>,
    /// Endpoints listed again since `listed` was handed over.
    listed_since: BTreeSet<Backend>,
    /// Endpoints no longer listed whose connections are still to be broken off, with the round
    /// they went in: a scan that started in a later round has dealt with them.
    gone: BTreeMap<Backend, u64>,
    /// The scan round, raised when a scan starts.
    round: u64,
    /// The address families that lost endpoints since their flows map was last scanned: a
    /// scan reads only their maps (a flows map of the default capacity is 512k buckets to
    /// walk, even when empty, and an IPv4 endpoint has no connections in the IPv6 map).
    dropped: Families,
}

impl Kept {
    /// Whether connections to `endpoint` are kept.
    fn keeps(&self, endpoint: &Backend) -> bool {
        if self.gone.contains_key(endpoint) {
            return false;
        }
        match &self.listed {
            Some((listed, _)) => listed.contains(endpoint) || self.listed_since.contains(endpoint),
            None => true,
        }
    }

    /// Starts a scan: what was handed over until now is dealt with by it.
    fn start_scan(&mut self) -> (Families, u64) {
        let started = self.round;
        self.round += 1;
        (std::mem::take(&mut self.dropped), started)
    }

    /// Ends the scan that started in round `started`.
    fn end_scan(&mut self, started: u64) {
        self.gone.retain(|_, round| *round > started);
        if self.listed.as_ref().is_some_and(|(_, round)| *round <= started) {
            self.listed = None;
            self.listed_since.clear();
        }
    }
}

/// A flag per address family.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Families {
    v4: bool,
    v6: bool,
}

impl Families {
    const BOTH: Self = Self { v4: true, v6: true };

    /// Sets the flag of `endpoint`'s family.
    fn mark(&mut self, endpoint: &Backend) {
        match endpoint.ip {
            IpAddr::V4(_) => self.v4 = true,
            IpAddr::V6(_) => self.v6 = true,
        }
    }
}

pub struct Reaper {
    listed: Listed,
    scan: Option<Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Reaper {
    /// Starts the scanning thread on the pinned IPv4 and IPv6 flows maps; it counts what it
    /// deletes in `metrics`.
    pub fn start(options: ReaperOptions, metrics: Arc<FlowMetrics>) -> Self {
        let listed = Listed::default();
        let (scan, requests) = mpsc::channel();
        let shared = listed.clone();
        let thread = std::thread::Builder::new()
            .name("flow-reaper".into())
            .spawn(move || run(&options, &shared, &requests, &metrics))
            .map_err(
                |error| warn!(%error, "cannot start the flow reaper; gone endpoints keep their connections"),
            )
            .ok();
        Self { listed, scan: Some(scan), thread }
    }

    /// Call before programming `endpoints`: from now on their connections are kept.
    pub fn keep(&self, endpoints: &BTreeSet<Backend>) {
        let mut kept = lock(&self.listed);
        let kept = &mut *kept;
        for endpoint in endpoints {
            kept.gone.remove(endpoint);
        }
        if kept.listed.is_some() {
            kept.listed_since.extend(endpoints.iter().copied());
        }
    }

    /// Call before a full sync programs `listed`, every listed endpoint: until
    /// [`Self::keep_only`] their connections, and all others, are kept.
    pub fn keep_all(&self, listed: &BTreeSet<Backend>) {
        let mut kept = lock(&self.listed);
        kept.gone.retain(|endpoint, _| !listed.contains(endpoint));
        kept.listed = None;
        kept.listed_since.clear();
    }

    /// Call after a full sync programmed `listed`, every listed endpoint: connections of any
    /// other endpoint are broken off. The set is shared until the scan is done.
    pub fn keep_only(&self, listed: Arc<BTreeSet<Backend>>) {
        if self.scan.is_none() {
            // No thread to scan: the set would be held for ever, and copied on every write.
            return;
        }
        {
            let mut kept = lock(&self.listed);
            kept.listed = Some((listed, kept.round));
            kept.listed_since.clear();
            kept.dropped = Families::BOTH;
        }
        self.wake();
    }

    /// Call after programming: connections of `endpoints`, no longer listed, are broken off
    /// ([`Self::keep_only`] for a full sync).
    pub fn forget(&self, endpoints: &BTreeSet<Backend>) {
        let dropped = {
            let mut kept = lock(&self.listed);
            let kept = &mut *kept;
            let mut dropped = false;
            for endpoint in endpoints {
                if let btree_map::Entry::Vacant(gone) = kept.gone.entry(*endpoint) {
                    gone.insert(kept.round);
                    kept.dropped.mark(endpoint);
                    dropped = true;
                }
            }
            dropped
        };
        if dropped {
            self.wake();
        }
    }

    /// Asks the thread for a scan of the families [`Kept::dropped`] names.
    fn wake(&self) {
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

fn lock(listed: &Listed) -> std::sync::MutexGuard<'_, Kept> {
    listed.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn run(options: &ReaperOptions, listed: &Listed, requests: &Receiver<()>, metrics: &FlowMetrics) {
    let interval = interval(&options.timeouts);
    let mut next_expiry = Instant::now() + interval;
    let mut expiry4 = Expiry::default();
    let mut expiry6 = Expiry::default();
    let mut failures = FailureLog::default();
    // Counted at once, so that /metrics has the fill levels from the start.
    count_fill(&options.pin_dir, metrics, true);
    let mut last_fill = Some(Instant::now());
    let mut snat_exhausted = StatGrowth(datapath_stat::SNAT_PORT_EXHAUSTED, 0);
    let mut gone_scans = ScanPacing::default();
    loop {
        let wake = gone_scans.due().map_or(next_expiry, |due| due.min(next_expiry));
        match requests.recv_timeout(wake.saturating_duration_since(Instant::now())) {
            Ok(()) => {
                // Requests that queued up during a scan are served by the next one.
                while requests.try_recv().is_ok() {}
                gone_scans.request(Instant::now());
            }
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => return,
        }
        if gone_scans.start_if_due(Instant::now()) {
            reap_gone(options, listed, metrics);
        }
        if Instant::now() >= next_expiry {
            {
                let now = monotonic_coarse_ns();
                let ports_short = snat_exhausted.grew(&options.stats_pin);
                expiry4.ports_short = ports_short;
                expiry6.ports_short = ports_short;
                let mut under_pressure = false;
                for (family, expired) in [
                    ("IPv4", expiry4.pass::<Flow4>(&options.flows4_pin, &options.timeouts, now, metrics)),
                    ("IPv6", expiry6.pass::<Flow6>(&options.flows6_pin, &options.timeouts, now, metrics)),
                ] {
                    match expired {
                        Ok(pass) => {
                            if pass.deleted > 0 {
                                debug!(
                                    family,
                                    entries = pass.deleted,
                                    "deleted the entries of expired connections"
                                );
                            }
                            under_pressure |= pass.under_pressure;
                        }
                        Err(error) => warn!(family, "cannot expire flows: {error:#}"),
                    }
                }
                failures.check(&options.stats_pin);
                if last_fill.is_none_or(|last| last.elapsed() >= FILL_INTERVAL) {
                    // The flows maps were just counted by their passes; the others here.
                    count_fill(&options.pin_dir, metrics, false);
                    last_fill = Some(Instant::now());
                }
                next_expiry = Instant::now()
                    + if under_pressure { pressure_interval(&options.timeouts) } else { interval };
            }
        }
    }
}

/// The shortest time between two scans for connections to gone endpoints. A scan reads the
/// whole flows maps, so one per sync would make a sync's cost grow with the flows maps again
/// when endpoints change many times a second; a change waits at most this long for its scan.
const GONE_SCAN_INTERVAL: Duration = Duration::from_millis(200);

/// When the next scan for connections to gone endpoints runs: at once after a request, unless
/// one ran less than [`GONE_SCAN_INTERVAL`] ago, then when that interval is over; the requests
/// meanwhile share that one scan.
#[derive(Debug, Default)]
struct ScanPacing {
    last: Option<Instant>,
    due: Option<Instant>,
}

impl ScanPacing {
    fn request(&mut self, now: Instant) {
        if self.due.is_none() {
            self.due = Some(self.last.map_or(now, |last| (last + GONE_SCAN_INTERVAL).max(now)));
        }
    }

    fn due(&self) -> Option<Instant> {
        self.due
    }

    /// Whether a scan is due at `now`; if so, it counts as started then.
    fn start_if_due(&mut self, now: Instant) -> bool {
        if self.due.is_some_and(|due| due <= now) {
            (self.due, self.last) = (None, Some(now));
            true
        } else {
            false
        }
    }
}

/// Scans the flows maps of the families that lost endpoints since their last scan.
fn reap_gone(options: &ReaperOptions, listed: &Listed, metrics: &FlowMetrics) {
    // Taken before the scan: an endpoint dropped during it asks for the next one.
    let (dropped, started) = lock(listed).start_scan();
    let scans = [
        (dropped.v4, "IPv4", &options.flows4_pin, reap::<Flow4> as fn(&Path, &Listed) -> _),
        (dropped.v6, "IPv6", &options.flows6_pin, reap::<Flow6>),
    ];
    for (_, family, pin, reap) in scans.into_iter().filter(|(dropped, ..)| *dropped) {
        match reap(pin, listed) {
            Ok(0) => debug!(family, "no connection to a gone endpoint"),
            Ok(reaped) => {
                metrics.reaped_gone_endpoint.add(reaped as u64);
                info!(family, entries = reaped, "broke off connections to endpoints that are gone")
            }
            Err(error) => warn!(family, "cannot scan the flows map: {error:#}"),
        }
    }
    lock(listed).end_scan(started);
}

/// CLOCK_MONOTONIC_COARSE, the clock of the datapath's `bpf_ktime_get_coarse_ns`.
pub(crate) fn monotonic_coarse_ns() -> u64 {
    let mut now = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `now` is valid for writes; CLOCK_MONOTONIC_COARSE always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut now) };
    (now.tv_sec as u64).saturating_mul(1_000_000_000).saturating_add(now.tv_nsec as u64)
}

/// A flows-map value of one family, with its key type.
pub(crate) trait TrackedFlow: Pod + Default {
    type Key: Pod + Eq + Hash + Default;

    /// The key's source and destination and the entry's rewrite targets (source,
    /// destination), as socket addresses, for tools that show connections.
    fn wire(key: &Self::Key, flow: &Self) -> [std::net::SocketAddr; 4];
    /// Bits of [`flow_flags`].
    fn flags(&self) -> u32;

    /// The backend a flow entry leads to (forward) or comes from (reply).
    fn backend(key: &Self::Key, flow: &Self) -> Backend;
    /// The key of the other direction's entry of the same connection.
    fn partner(key: &Self::Key, flow: &Self) -> Self::Key;
    fn track(&self) -> FlowTrack;
    fn is_reply(&self) -> bool;
    fn proto(key: &Self::Key) -> u8;
}

macro_rules! tracked_flow {
    ($flow:ty, $key:ty) => {
        impl TrackedFlow for $flow {
            type Key = $key;

            fn wire(key: &$key, flow: &$flow) -> [std::net::SocketAddr; 4] {
                let at = |addr, port| std::net::SocketAddr::new(IpAddr::from(addr), port);
                [
                    at(key.src_addr, key.src_port),
                    at(key.dst_addr, key.dst_port),
                    at(flow.src_addr, flow.src_port),
                    at(flow.dst_addr, flow.dst_port),
                ]
            }

            fn flags(&self) -> u32 {
                self.flags
            }

            fn backend(key: &$key, flow: &$flow) -> Backend {
                let (addr, port) = if flow.flags & flow_flags::REPLY != 0 {
                    (key.src_addr, key.src_port)
                } else {
                    (flow.dst_addr, flow.dst_port)
                };
                Backend { ip: IpAddr::from(addr), port }
            }

            /// A forward entry's packets leave rewritten to `flow`'s destination (and source,
            /// masqueraded): its reply comes back from there to there. A reply entry's packets
            /// leave with `flow`'s source (and destination), which is the forward key's
            /// destination (and source).
            fn partner(key: &$key, flow: &$flow) -> $key {
                // A DSR backend's node stores the entries as the packets travel (the request
                // arrives rewritten): each other's plain reversal.
                if flow.flags & flow_flags::DSR_BACKEND != 0 {
                    return <$key>::from_parts(
                        key.dst_addr,
                        key.src_addr,
                        key.dst_port,
                        key.src_port,
                        key.proto,
                    );
                }
                let rewrites_source = flow.flags & flow_flags::REWRITE_SOURCE != 0;
                let rewrites_destination = flow.flags & flow_flags::REWRITE_DESTINATION != 0;
                let (src, src_port) = if rewrites_source {
                    (flow.src_addr, flow.src_port)
                } else {
                    (key.src_addr, key.src_port)
                };
                let (dst, dst_port) = if rewrites_destination {
                    (flow.dst_addr, flow.dst_port)
                } else {
                    (key.dst_addr, key.dst_port)
                };
                // The other direction travels the rewritten tuple backwards.
                <$key>::from_parts(dst, src, dst_port, src_port, key.proto)
            }

            fn track(&self) -> FlowTrack {
                self.track
            }

            fn is_reply(&self) -> bool {
                self.flags & flow_flags::REPLY != 0
            }

            fn proto(key: &$key) -> u8 {
                key.proto
            }
        }
    };
}

tracked_flow!(Flow4, FlowKey4);
tracked_flow!(Flow6, FlowKey6);

/// Builds a flow key from its fields.
trait FromParts: Sized {
    type Addr;
    fn from_parts(src: Self::Addr, dst: Self::Addr, src_port: u16, dst_port: u16, proto: u8) -> Self;
}

macro_rules! from_parts {
    ($key:ty, $addr:ty) => {
        impl FromParts for $key {
            type Addr = $addr;

            fn from_parts(src_addr: $addr, dst_addr: $addr, src_port: u16, dst_port: u16, proto: u8) -> Self {
                Self { src_addr, dst_addr, src_port, dst_port, proto, pad8: 0, pad16: 0 }
            }
        }
    };
}

from_parts!(FlowKey4, [u8; 4]);
from_parts!(FlowKey6, [u8; 16]);

/// Entries per `BPF_MAP_LOOKUP_BATCH` call of [`walk_flows`].
const FLOW_BATCH: u32 = 1024;

/// Hands every entry of a flows map to `visit`, a batch at a time: read with
/// `BPF_MAP_LOOKUP_BATCH`, one system call per [`FLOW_BATCH`] entries (the kernel walks its
/// buckets itself), or, where the kernel refuses batch lookups, with one `BPF_MAP_GET_NEXT_KEY`
/// and one lookup per entry. Entries deleted or added meanwhile may be missed or seen.
fn walk_flows<F: TrackedFlow>(
    flows: &HashMap<MapData, F::Key, F>,
    mut visit: impl FnMut(&[F::Key], &[F]),
) -> anyhow::Result<()> {
    let mut delivered = false;
    let each = |keys: &[F::Key], values: &[F]| {
        delivered = true;
        visit(keys, values);
        true
    };
    // SAFETY: aya opened the flows map as a HashMap of these key and value types, checking
    // their sizes against the map's.
    let batched = unsafe {
        crate::bpf_sys::lookup_batches::<F::Key, F>(flows.map().fd().as_fd(), FLOW_BATCH, 1, 1, each)
    };
    match batched {
        Some(()) => Ok(()),
        // Part of the map was handed over already: a walk from the start would show it twice.
        None if delivered => Err(anyhow::anyhow!("the batched walk of the flows map failed midway")),
        None => {
            for (key, flow) in flows.iter().filter_map(Result::ok) {
                visit(&[key], &[flow]);
            }
            Ok(())
        }
    }
}

fn reap<F: TrackedFlow>(flows_pin: &Path, listed: &Listed) -> anyhow::Result<usize> {
    let map = MapData::from_pin(flows_pin)?;
    let mut flows: HashMap<MapData, F::Key, F> = HashMap::try_from(Map::HashMap(map))?;
    // Collected first: deleting while walking would disturb the walk.
    let mut gone: Vec<F::Key> = Vec::new();
    walk_flows(&flows, |keys, values| {
        let kept = lock(listed);
        gone.extend(
            keys.iter()
                .zip(values)
                .filter(|(key, flow)| !kept.keeps(&F::backend(key, flow)))
                .map(|(key, _)| *key),
        );
    })?;
    let mut reaped = 0;
    for key in &gone {
        // Re-checked: the sync may have listed the backend again meanwhile.
        let still_gone = flows.get(key, 0).is_ok_and(|flow| !lock(listed).keeps(&F::backend(key, &flow)));
        if still_gone && flows.remove(key).is_ok() {
            reaped += 1;
        }
    }
    Ok(reaped)
}

/// ExpiryReason a connection expires, for `vipr_flow_entries_expired_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ExpiryReason {
    TcpIdle,
    TcpClosed,
    TcpHalfOpen,
    Udp,
    /// A half-open connection or unanswered UDP flow, early because the map is filling up.
    Pressure,
}

/// How long a connection may stay idle, from what both its entries saw, and why it goes after
/// that. `under_pressure`: the flows map is above its high-water mark.
fn timeout(
    protocol: u8,
    forward: Option<FlowTrack>,
    reply: Option<FlowTrack>,
    timeouts: &ConntrackTimeouts,
    under_pressure: bool,
) -> (Duration, ExpiryReason) {
    let state = forward.map_or(0, |track| track.state) | reply.map_or(0, |track| track.state);
    // Entries of an earlier vipr do not track the handshake: a reply means answered, and
    // answered TCP counts as established, as that vipr judged it.
    let tracked = state & flow_state::HANDSHAKE_TRACKED != 0;
    let answered = if tracked {
        state & flow_state::REPLIED != 0
    } else {
        reply.is_some_and(|track| track.last_seen != 0)
    };
    let usual = if protocol == proto::TCP {
        let fin_both_ways = forward.is_some_and(|track| track.state & flow_state::FIN != 0)
            && reply.is_some_and(|track| track.state & flow_state::FIN != 0);
        let established = if tracked { state & flow_state::ESTABLISHED != 0 } else { answered };
        if state & flow_state::RST != 0 || fin_both_ways {
            (timeouts.tcp_closed, ExpiryReason::TcpClosed)
        } else if !established {
            // A FIN before the handshake completed (a spoofed SYN|FIN) does not make it a
            // close-wait connection of an hour.
            let half_open = if answered { timeouts.tcp_syn_recv } else { timeouts.tcp_syn_sent };
            (half_open.min(timeouts.tcp_established), ExpiryReason::TcpHalfOpen)
        } else if state & flow_state::FIN != 0 {
            (timeouts.tcp_close_wait, ExpiryReason::TcpIdle)
        } else {
            (timeouts.tcp_established, ExpiryReason::TcpIdle)
        }
    } else if (tracked && state & flow_state::ESTABLISHED != 0) || (!tracked && answered) {
        // A stream: the client sent again after an answer (an earlier vipr's entry: answered).
        // A single exchange (a DNS query and its answer) keeps the short timeout, as
        // conntrack's UDP entries that are not ASSURED.
        (timeouts.udp_stream, ExpiryReason::Udp)
    } else {
        (timeouts.udp, ExpiryReason::Udp)
    };
    if under_pressure && flow_state::evictable(state) && timeouts.pressure.timeout < usual.0 {
        (timeouts.pressure.timeout, ExpiryReason::Pressure)
    } else {
        usual
    }
}

/// The shortest timeout an entry of `protocol` can have: younger entries are not looked at.
fn shortest(protocol: u8, timeouts: &ConntrackTimeouts, under_pressure: bool) -> Duration {
    let usual = if protocol == proto::TCP {
        timeouts
            .tcp_closed
            .min(timeouts.tcp_close_wait)
            .min(timeouts.tcp_established)
            .min(timeouts.tcp_syn_sent)
            .min(timeouts.tcp_syn_recv)
    } else {
        timeouts.udp.min(timeouts.udp_stream)
    };
    if under_pressure {
        usual.min(timeouts.pressure.timeout)
    } else {
        usual
    }
}

/// What one expiry pass did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Pass {
    /// Entries deleted.
    deleted: usize,
    /// The map was above its high-water mark when the pass began.
    under_pressure: bool,
}

/// Counts the entries of every map pinned in `pin_dir` into `metrics` (arrays are always
/// full: their capacity); the flows maps only with `with_flows` (the expiry passes count them).
fn count_fill(pin_dir: &Path, metrics: &FlowMetrics, with_flows: bool) {
    let Ok(pins) = std::fs::read_dir(pin_dir) else { return };
    for pin in pins.filter_map(Result::ok) {
        if !pin.file_type().is_ok_and(|kind| kind.is_file()) {
            continue;
        }
        let name = pin.file_name().to_string_lossy().into_owned();
        if !with_flows && [proxy_common::pins::FLOWS4, proxy_common::pins::FLOWS6].contains(&name.as_str()) {
            continue;
        }
        let Ok(map) = MapData::from_pin(pin.path()) else { continue };
        let Ok(info) = map.info() else { continue };
        let capacity = u64::from(info.max_entries());
        let entries = match info.map_type() {
            Ok(aya::maps::MapType::Array | aya::maps::MapType::PerCpuArray) => capacity,
            Ok(
                aya::maps::MapType::Hash
                | aya::maps::MapType::LruHash
                | aya::maps::MapType::PerCpuHash
                | aya::maps::MapType::LruPerCpuHash
                | aya::maps::MapType::LpmTrie,
            ) => match crate::bpf_sys::count_keys(
                map.fd().as_fd(),
                crate::bpf_sys::EntryLayout::of(&info),
                capacity,
            ) {
                Ok(entries) => entries,
                Err(_) => continue,
            },
            _ => continue,
        };
        metrics.set_fill(&name, MapFill { entries, capacity });
    }
}

/// The expiry passes over one family's flows map.
#[derive(Default)]
struct Expiry<K> {
    /// Entries without any packet time (a reply entry whose forward entry is missing) seen by
    /// the previous pass: deleted when the next pass finds them still alone, since a new
    /// connection's reply entry is stored just before its forward entry.
    unstamped: HashSet<K>,
    /// Treat the map as under pressure whatever its fill level: new masqueraded connections
    /// found no free port since the last pass, and the ports half-open connections hold come
    /// back when they expire.
    ports_short: bool,
}

impl<K: Pod + Eq + Hash> Expiry<K> {
    /// One pass at time `now` (CLOCK_MONOTONIC_COARSE ns).
    fn pass<F: TrackedFlow<Key = K>>(
        &mut self,
        flows_pin: &Path,
        timeouts: &ConntrackTimeouts,
        now: u64,
        metrics: &FlowMetrics,
    ) -> anyhow::Result<Pass> {
        let map = MapData::from_pin(flows_pin)?;
        let capacity = u64::from(map.info()?.max_entries());
        let mut flows: HashMap<MapData, K, F> = HashMap::try_from(Map::HashMap(map))?;
        let age = |track: &FlowTrack| Duration::from_nanos(now.saturating_sub(track.last_seen));
        // Collected first: deleting while iterating would restart the kernel's key walk. Only
        // entries older than the shortest timeout of their protocol (under pressure, if the map
        // turns out to be under pressure) can have expired.
        let mut entries = 0u64;
        let mut old: Vec<(K, Duration)> = Vec::new();
        walk_flows(&flows, |keys, values| {
            entries += keys.len() as u64;
            for (key, flow) in keys.iter().zip(values) {
                let age = age(&flow.track());
                if age > shortest(F::proto(key), timeouts, true) {
                    old.push((*key, age));
                }
            }
        })?;
        let under_pressure =
            self.ports_short || entries * 100 >= capacity * u64::from(timeouts.pressure.threshold_percent);
        let mut unstamped = HashSet::new();
        let mut deleted = 0;
        for (key, age) in old {
            if age <= shortest(F::proto(&key), timeouts, under_pressure) {
                continue;
            }
            // Re-read: the entry may have seen a packet, or gone with its partner, meanwhile.
            let Ok(flow) = flows.get(&key, 0) else { continue };
            let partner_key = F::partner(&key, &flow);
            let partner = flows.get(&partner_key, 0).ok();
            let (forward, reply) = match (flow.is_reply(), partner.map(|partner| partner.track())) {
                (false, partner) => (Some(flow.track()), partner),
                (true, partner) => (partner, Some(flow.track())),
            };
            let last_seen =
                forward.map_or(0, |track| track.last_seen).max(reply.map_or(0, |track| track.last_seen));
            if last_seen == 0 && !self.unstamped.contains(&key) {
                unstamped.insert(key);
                continue;
            }
            let (limit, reason) = timeout(F::proto(&key), forward, reply, timeouts, under_pressure);
            if Duration::from_nanos(now.saturating_sub(last_seen)) <= limit {
                continue;
            }
            let mut removed = usize::from(flows.remove(&key).is_ok());
            if partner.is_some() {
                removed += usize::from(flows.remove(&partner_key).is_ok());
            }
            let counter = match reason {
                ExpiryReason::Pressure => &metrics.evicted_pressure,
                ExpiryReason::Udp => &metrics.expired_udp,
                ExpiryReason::TcpClosed => &metrics.expired_tcp_closed,
                ExpiryReason::TcpHalfOpen => &metrics.expired_tcp_half_open,
                ExpiryReason::TcpIdle => &metrics.expired_tcp_idle,
            };
            counter.add(removed as u64);
            deleted += removed;
        }
        self.unstamped = unstamped;
        // The fill level as the pass leaves the map, not as it found it: after a flood the
        // gauge must show the map draining, not the peak until the next pass.
        if let Some(name) = flows_pin.file_name() {
            let entries = entries.saturating_sub(deleted as u64);
            metrics.set_fill(&name.to_string_lossy(), MapFill { entries, capacity });
        }
        Ok(Pass { deleted, under_pressure })
    }
}

/// Whether one datapath statistic grew since the last call.
struct StatGrowth(u32, u64);

impl StatGrowth {
    fn grew(&mut self, stats_pin: &Path) -> bool {
        let Ok(stats) = StatsMap::open(stats_pin) else { return false };
        let now = stats.read(self.0);
        let grew = now > self.1;
        self.1 = now;
        grew
    }
}

/// Logs new datapath insert failures, at most once per [`FAILURE_LOG_INTERVAL`].
#[derive(Default)]
struct FailureLog {
    logged: [u64; INSERT_FAILURES.len()],
    last: Option<Instant>,
}

impl FailureLog {
    fn check(&mut self, stats_pin: &Path) {
        if self.last.is_some_and(|last| last.elapsed() < FAILURE_LOG_INTERVAL) {
            return;
        }
        let Ok(stats) = StatsMap::open(stats_pin) else { return };
        let now: Vec<u64> = INSERT_FAILURES.iter().map(|(index, _)| stats.read(*index)).collect();
        let new: Vec<String> = INSERT_FAILURES
            .iter()
            .zip(now.iter().zip(&self.logged))
            .filter(|(_, (now, logged))| now > logged)
            .map(|((_, cause), (now, logged))| format!("{cause}: {}", now - logged))
            .collect();
        if !new.is_empty() {
            warn!(
                failures = new.join(", "),
                "the datapath could not track new connections (is the flows map full? see \
                 vipr_datapath_flow_insert_failures_total, --bpf-flows-max)"
            );
            self.last = Some(Instant::now());
        }
        self.logged.copy_from_slice(&now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scans_for_gone_endpoints_run_at_once_then_at_most_once_per_interval() {
        let start = Instant::now();
        let at = |ms: u64| start + Duration::from_millis(ms);
        let mut pacing = ScanPacing::default();
        assert_eq!(pacing.due(), None, "nothing asked");
        pacing.request(at(0));
        assert!(pacing.start_if_due(at(0)), "the first request is served at once");
        assert!(!pacing.start_if_due(at(1)), "one scan per request");
        // Requests within the interval wait for its end and share one scan.
        pacing.request(at(10));
        pacing.request(at(50));
        assert_eq!(pacing.due(), Some(at(0) + GONE_SCAN_INTERVAL));
        assert!(!pacing.start_if_due(at(100)));
        assert!(pacing.start_if_due(at(0) + GONE_SCAN_INTERVAL));
        assert!(!pacing.start_if_due(at(1_000)), "both requests were served");
        // After a quiet interval, a request is served at once again.
        let later = at(0) + GONE_SCAN_INTERVAL * 3;
        pacing.request(later);
        assert!(pacing.start_if_due(later));
    }

    #[test]
    fn both_directions_name_the_backend() {
        let backend = Backend { ip: "10.1.0.2".parse().unwrap(), port: 8080 };
        let forward_key = FlowKey4 {
            src_addr: [10, 0, 0, 9],
            dst_addr: [10, 96, 0, 1],
            src_port: 40000,
            dst_port: 80,
            proto: 6,
            pad8: 0,
            pad16: 0,
        };
        let forward = Flow4 {
            src_addr: [0; 4],
            dst_addr: [10, 1, 0, 2],
            src_port: 0,
            dst_port: 8080,
            flags: flow_flags::REWRITE_DESTINATION,
            track: FlowTrack::default(),
            next_hop: Default::default(),
        };
        let reply_key = FlowKey4 {
            src_addr: [10, 1, 0, 2],
            dst_addr: [10, 0, 0, 9],
            src_port: 8080,
            dst_port: 40000,
            proto: 6,
            pad8: 0,
            pad16: 0,
        };
        let reply = Flow4 {
            src_addr: [10, 96, 0, 1],
            dst_addr: [0; 4],
            src_port: 80,
            dst_port: 0,
            flags: flow_flags::REPLY | flow_flags::REWRITE_SOURCE,
            track: FlowTrack::default(),
            next_hop: Default::default(),
        };
        assert_eq!(Flow4::backend(&forward_key, &forward), backend);
        assert_eq!(Flow4::backend(&reply_key, &reply), backend);
        assert_eq!(Flow4::partner(&forward_key, &forward), reply_key);
        assert_eq!(Flow4::partner(&reply_key, &reply), forward_key);
    }

    /// Both entries of a connection from `client_port` to 10.96.0.1:80 balanced to
    /// 10.1.0.2:8080, with the given state bits and packet times.
    fn connection(
        protocol: u8,
        client_port: u16,
        forward: (u32, u64),
        reply: (u32, u64),
    ) -> [(FlowKey4, Flow4); 2] {
        let key = |src_addr, src_port, dst_addr, dst_port| FlowKey4 {
            src_addr,
            dst_addr,
            src_port,
            dst_port,
            proto: protocol,
            pad8: 0,
            pad16: 0,
        };
        let (client, frontend, backend) = ([10, 0, 0, 9], [10, 96, 0, 1], [10, 1, 0, 2]);
        [
            (
                key(client, client_port, frontend, 80),
                Flow4 {
                    src_addr: [0; 4],
                    dst_addr: backend,
                    src_port: 0,
                    dst_port: 8080,
                    flags: flow_flags::REWRITE_DESTINATION,
                    track: FlowTrack { counter: 1, state: forward.0, last_seen: forward.1 },
                    next_hop: Default::default(),
                },
            ),
            (
                key(backend, 8080, client, client_port),
                Flow4 {
                    src_addr: frontend,
                    dst_addr: [0; 4],
                    src_port: 80,
                    dst_port: 0,
                    flags: flow_flags::REPLY | flow_flags::REWRITE_SOURCE,
                    track: FlowTrack { counter: 1, state: reply.0, last_seen: reply.1 },
                    next_hop: Default::default(),
                },
            ),
        ]
    }

    /// A private bpffs with vipr's maps pinned in it; unmounted and removed on drop.
    struct Maps {
        ebpf: Option<aya::Ebpf>,
        root: PathBuf,
    }

    impl Maps {
        fn new() -> Self {
            static COUNTER: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
            let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let root = std::env::temp_dir().join(format!("vipr-reaper-test-{}-{n}", std::process::id()));
            std::fs::create_dir_all(&root).unwrap();
            let pin_dir = super::super::PinDir::new(&root);
            pin_dir.create(&root).unwrap();
            // A small flows map, so that a few entries can put it above a high-water mark.
            let ebpf = aya::EbpfLoader::new()
                .default_map_pin_directory(pin_dir.path())
                .map_max_entries(proxy_common::pins::FLOWS4, 512)
                .load(crate::EBPF_OBJECT);
            // From here on, Drop unmounts whatever happens.
            let mut maps = Self { ebpf: None, root };
            maps.ebpf = Some(ebpf.unwrap());
            maps
        }

        fn flows4_pin(&self) -> PathBuf {
            self.root.join(proxy_common::pins::DIR).join(proxy_common::pins::FLOWS4)
        }
    }

    impl Drop for Maps {
        fn drop(&mut self) {
            drop(self.ebpf.take());
            let target = std::ffi::CString::new(self.root.as_os_str().as_encoded_bytes()).unwrap();
            // SAFETY: a valid NUL-terminated path.
            unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) };
            let _ = std::fs::remove_dir_all(&self.root);
        }
    }

    /// With short timeouts: unanswered UDP idle past `udp`, TCP closed (FIN both ways, or an
    /// RST) idle past `tcp_closed`, unanswered TCP idle past `tcp_unanswered`, and TCP idle
    /// past `tcp_established` lose both entries;
    /// answered UDP, half-closed TCP and recently active connections keep theirs. A lone reply
    /// entry without a time goes at the second pass.
    #[test]
    fn idle_and_closed_connections_expire_while_active_ones_stay() {
        const S: u64 = 1_000_000_000;
        let timeouts = ConntrackTimeouts {
            tcp_established: Duration::from_secs(100),
            tcp_close_wait: Duration::from_secs(50),
            tcp_closed: Duration::from_secs(2),
            tcp_syn_sent: Duration::from_secs(10),
            tcp_syn_recv: Duration::from_secs(10),
            udp: Duration::from_secs(3),
            udp_stream: Duration::from_secs(20),
            pressure: crate::dataplane::ebpf::FlowPressure {
                threshold_percent: 100,
                timeout: Duration::from_secs(1),
            },
        };
        let now = 1_000 * S;
        let (fin, rst) = (flow_state::FIN, flow_state::RST);
        let expire = [
            connection(proto::UDP, 1, (0, now - 5 * S), (0, 0)),
            connection(proto::TCP, 2, (fin, now - 3 * S), (fin, now - 3 * S)),
            connection(proto::TCP, 3, (0, now - 4 * S), (rst, now - 3 * S)),
            connection(proto::TCP, 4, (0, now - 150 * S), (0, now - 150 * S)),
            connection(proto::TCP, 5, (0, now - 12 * S), (0, 0)),
        ];
        let stay = [
            connection(proto::UDP, 11, (0, now - S), (0, 0)),
            connection(proto::UDP, 12, (0, now - 5 * S), (0, now - 5 * S)),
            connection(proto::TCP, 13, (fin, now - 3 * S), (0, now - 3 * S)),
            connection(proto::TCP, 14, (0, now - 3 * S), (0, now - 90 * S)),
            // Closed, but its last packet is recent.
            connection(proto::TCP, 15, (fin, now - S), (fin, now - S)),
            // Not answered yet, but its SYN is recent.
            connection(proto::TCP, 16, (0, now - 5 * S), (0, 0)),
        ];
        let [_, orphan] = connection(proto::UDP, 21, (0, 0), (0, 0));

        let maps = Maps::new();
        let pin = maps.flows4_pin();
        let mut flows: HashMap<MapData, FlowKey4, Flow4> =
            HashMap::try_from(Map::HashMap(MapData::from_pin(&pin).unwrap())).unwrap();
        for (key, flow) in expire.iter().chain(&stay).flatten().chain([&orphan]) {
            flows.insert(key, flow, 0).unwrap();
        }
        let keys = |flows: &HashMap<MapData, FlowKey4, Flow4>| -> BTreeSet<(u16, u16)> {
            flows.keys().map(|key| key.unwrap()).map(|key| (key.src_port, key.dst_port)).collect()
        };
        let staying: BTreeSet<(u16, u16)> =
            stay.iter().flatten().map(|(key, _)| (key.src_port, key.dst_port)).collect();

        let metrics = FlowMetrics::default();
        let mut expiry = Expiry::default();
        assert_eq!(expiry.pass::<Flow4>(&pin, &timeouts, now, &metrics).unwrap().deleted, 10);
        let mut after_first = staying.clone();
        after_first.insert((orphan.0.src_port, orphan.0.dst_port));
        assert_eq!(keys(&flows), after_first);
        assert_eq!(metrics.expired_udp.get(), 2);
        assert_eq!(metrics.expired_tcp_closed.get(), 4);
        assert_eq!(metrics.expired_tcp_idle.get(), 2);
        assert_eq!(metrics.expired_tcp_half_open.get(), 2);

        assert_eq!(expiry.pass::<Flow4>(&pin, &timeouts, now, &metrics).unwrap().deleted, 1);
        assert_eq!(keys(&flows), staying);
        assert_eq!(metrics.expired_udp.get(), 3);
    }

    /// Handshake tracking: a connection the backend answered (SYN-ACK) but whose client never
    /// acknowledged is half-open, whatever else it saw (a spoofed SYN|FIN must not buy the hour
    /// of close-wait); only the client's ACK makes it established. Entries of an earlier vipr,
    /// without the handshake bits, keep that vipr's rule (answered = established).
    #[test]
    fn half_open_connections_get_the_handshake_timeouts() {
        let timeouts = ConntrackTimeouts::default();
        let tracked = flow_state::HANDSHAKE_TRACKED;
        let track = |state, last_seen| Some(FlowTrack { counter: 0, state, last_seen });
        let syn = tracked | flow_state::SYN;
        let syn_recv = syn | flow_state::SYN_ACK | flow_state::REPLIED;
        let tcp = |forward, reply| timeout(proto::TCP, forward, reply, &timeouts, false);
        assert_eq!(tcp(track(syn, 1), track(syn, 0)).0, timeouts.tcp_syn_sent);
        assert_eq!(tcp(track(syn_recv, 1), track(syn_recv, 1)).0, timeouts.tcp_syn_recv);
        assert_eq!(
            tcp(track(syn_recv | flow_state::FIN, 1), track(syn_recv, 1)).0,
            timeouts.tcp_syn_recv,
            "a FIN before the handshake completed"
        );
        let established = syn_recv | flow_state::ESTABLISHED;
        assert_eq!(tcp(track(established, 1), track(established, 1)).0, timeouts.tcp_established);
        assert_eq!(
            tcp(track(established | flow_state::FIN, 1), track(established, 1)).0,
            timeouts.tcp_close_wait
        );
        assert_eq!(tcp(track(0, 1), track(0, 1)).0, timeouts.tcp_established, "an earlier vipr's entry");
        assert_eq!(tcp(track(0, 1), track(0, 0)).0, timeouts.tcp_syn_sent);
        let udp = |forward, reply| timeout(proto::UDP, forward, reply, &timeouts, false).0;
        assert_eq!(udp(track(tracked, 1), track(tracked, 0)), Duration::from_secs(30));
        let answered = tracked | flow_state::REPLIED;
        assert_eq!(udp(track(answered, 1), track(answered, 1)), timeouts.udp, "one exchange");
        let replied = answered | flow_state::ESTABLISHED;
        assert_eq!(udp(track(replied, 1), track(replied, 1)), timeouts.udp_stream, "a stream");

        // Under pressure, half-open and unanswered go after the pressure timeout; established
        // connections and answered UDP keep theirs.
        let pressed = |protocol, state| timeout(protocol, track(state, 1), track(state, 1), &timeouts, true);
        assert_eq!(pressed(proto::TCP, syn_recv), (timeouts.pressure.timeout, ExpiryReason::Pressure));
        assert_eq!(pressed(proto::UDP, tracked), (timeouts.pressure.timeout, ExpiryReason::Pressure));
        assert_eq!(pressed(proto::UDP, answered), (timeouts.pressure.timeout, ExpiryReason::Pressure));
        assert_eq!(pressed(proto::TCP, established).0, timeouts.tcp_established);
        assert_eq!(pressed(proto::UDP, replied).0, timeouts.udp_stream);
        assert_eq!(pressed(proto::TCP, 0).0, timeouts.tcp_established, "an earlier vipr's entry");
    }

    /// Above the high-water mark a pass expires half-open connections idle past the pressure
    /// timeout, and keeps established ones and recent half-open ones; below it, the same
    /// connections stay.
    #[test]
    fn above_the_high_water_mark_half_open_connections_go_first() {
        const S: u64 = 1_000_000_000;
        let maps = Maps::new();
        let pin = maps.flows4_pin();
        let now = 1_000 * S;
        let syn_recv =
            flow_state::HANDSHAKE_TRACKED | flow_state::SYN | flow_state::SYN_ACK | flow_state::REPLIED;
        let established = syn_recv | flow_state::ESTABLISHED;
        let half_open = connection(proto::TCP, 1, (syn_recv, now - 3 * S), (syn_recv, now - 3 * S));
        let fresh = connection(proto::TCP, 2, (syn_recv, now), (syn_recv, now));
        let live = connection(proto::TCP, 3, (established, now - 3 * S), (established, now - 3 * S));
        let mut flows: HashMap<MapData, FlowKey4, Flow4> =
            HashMap::try_from(Map::HashMap(MapData::from_pin(&pin).unwrap())).unwrap();
        for (key, flow) in half_open.iter().chain(&fresh).chain(&live) {
            flows.insert(key, flow, 0).unwrap();
        }
        let mut timeouts = ConntrackTimeouts::default();
        timeouts.pressure.timeout = Duration::from_secs(2);
        let metrics = FlowMetrics::default();
        let mut expiry = Expiry::default();
        // Six entries of 512: below a mark of 100%, above one of 1%.
        timeouts.pressure.threshold_percent = 100;
        let pass = expiry.pass::<Flow4>(&pin, &timeouts, now, &metrics).unwrap();
        assert_eq!(pass, Pass { deleted: 0, under_pressure: false });
        assert_eq!(flows.keys().count(), 6);
        timeouts.pressure.threshold_percent = 1;
        let pass = expiry.pass::<Flow4>(&pin, &timeouts, now, &metrics).unwrap();
        assert_eq!(pass, Pass { deleted: 2, under_pressure: true });
        assert_eq!(metrics.evicted_pressure.get(), 2);
        let left: BTreeSet<u16> =
            flows.keys().map(|key| key.unwrap().src_port).filter(|port| *port < 100).collect();
        assert_eq!(left, BTreeSet::from([2, 3]));
        // The fill level as the pass left the map: six found, two deleted.
        assert_eq!(metrics.fill()[proxy_common::pins::FLOWS4], MapFill { entries: 4, capacity: 512 });

        // Below the mark, but masquerade ports ran short: the same early expiry.
        let stale = connection(proto::TCP, 4, (syn_recv, now - 3 * S), (syn_recv, now - 3 * S));
        for (key, flow) in &stale {
            flows.insert(key, flow, 0).unwrap();
        }
        timeouts.pressure.threshold_percent = 100;
        expiry.ports_short = true;
        let pass = expiry.pass::<Flow4>(&pin, &timeouts, now, &metrics).unwrap();
        assert_eq!(pass, Pass { deleted: 2, under_pressure: true });
        assert_eq!(flows.keys().count(), 4);
    }

    /// A reaper without its thread, to watch its bookkeeping; the receiver stands for the
    /// thread's end of the requests.
    fn idle_reaper() -> (Reaper, Receiver<()>) {
        let (scan, requests) = mpsc::channel();
        (Reaper { listed: Listed::default(), scan: Some(scan), thread: None }, requests)
    }

    /// A scan for gone endpoints reads only the flows maps of the families that lost some: an
    /// IPv4 endpoint has no connection in the IPv6 map, whose walk (512k buckets by default,
    /// even empty) would be wasted.
    #[test]
    fn scans_read_only_the_families_that_lost_endpoints() {
        let v4 = Backend { ip: "10.1.0.2".parse().unwrap(), port: 8080 };
        let v6 = Backend { ip: "fd00::2".parse().unwrap(), port: 8080 };
        let (reaper, _requests) = idle_reaper();
        let dropped = |reaper: &Reaper| std::mem::take(&mut lock(&reaper.listed).dropped);
        reaper.keep(&BTreeSet::from([v4, v6]));
        assert_eq!(dropped(&reaper), Families::default(), "nothing dropped yet");
        reaper.forget(&BTreeSet::from([v4]));
        assert_eq!(dropped(&reaper), Families { v4: true, v6: false });
        reaper.forget(&BTreeSet::from([v4]));
        assert_eq!(dropped(&reaper), Families::default(), "already gone");
        reaper.keep(&BTreeSet::from([v4]));
        reaper.keep_only(Arc::new(BTreeSet::from([v4])));
        assert_eq!(dropped(&reaper), Families::BOTH, "after a full sync, both are read");
    }

    /// The reaper keeps no copy of the listed endpoints: between full syncs it knows the
    /// endpoints that went until their scan, and it shares a full sync's set until the scan
    /// after it, which breaks off the connections of every endpoint not in it.
    #[test]
    fn the_listed_endpoints_are_shared_until_their_scan() {
        let backend = |last: u8| Backend { ip: IpAddr::from([10, 1, 0, last]), port: 8080 };
        let (reaper, _requests) = idle_reaper();
        let keeps = |endpoint: Backend| lock(&reaper.listed).keeps(&endpoint);
        let listed = Arc::new(BTreeSet::from([backend(1), backend(2)]));
        reaper.keep_all(&listed);
        assert!(keeps(backend(3)), "until the full sync is programmed, all are kept");
        reaper.keep_only(Arc::clone(&listed));
        assert_eq!(Arc::strong_count(&listed), 2, "shared, not copied");
        assert!(keeps(backend(1)) && !keeps(backend(3)));
        reaper.keep(&BTreeSet::from([backend(3)]));
        reaper.forget(&BTreeSet::from([backend(1)]));
        assert!(keeps(backend(3)) && !keeps(backend(1)));
        let (_, started) = lock(&reaper.listed).start_scan();
        // Gone during the scan: the next one deals with it.
        reaper.forget(&BTreeSet::from([backend(2)]));
        lock(&reaper.listed).end_scan(started);
        assert_eq!(Arc::strong_count(&listed), 1, "released after its scan");
        let kept = lock(&reaper.listed);
        assert_eq!(kept.gone.keys().collect::<Vec<_>>(), [&backend(2)]);
        assert!(kept.listed_since.is_empty());
        assert!(kept.keeps(&backend(1)) && kept.keeps(&backend(4)), "between full syncs, only the gone go");
    }

    /// The scan deletes both entries of connections to endpoints no longer kept, read in
    /// batches, and leaves the others.
    #[test]
    fn connections_to_gone_endpoints_are_reaped() {
        let maps = Maps::new();
        let pin = maps.flows4_pin();
        let mut flows: HashMap<MapData, FlowKey4, Flow4> =
            HashMap::try_from(Map::HashMap(MapData::from_pin(&pin).unwrap())).unwrap();
        let live = Backend { ip: "10.1.0.2".parse().unwrap(), port: 8080 };
        let gone = Backend { ip: "10.1.0.3".parse().unwrap(), port: 8080 };
        // 200 connections, every other one to the endpoint that goes.
        for client_port in 1..=200u16 {
            for (key, mut flow) in connection(proto::TCP, client_port, (0, 1), (0, 1)) {
                let mut key = key;
                if client_port % 2 == 0 {
                    if flow.is_reply() {
                        key.src_addr = [10, 1, 0, 3];
                    } else {
                        flow.dst_addr = [10, 1, 0, 3];
                    }
                }
                flows.insert(key, flow, 0).unwrap();
            }
        }
        let mut walked = 0;
        walk_flows(&flows, |keys, values| {
            assert_eq!(keys.len(), values.len());
            walked += keys.len();
        })
        .unwrap();
        assert_eq!(walked, 400);
        let (reaper, _requests) = idle_reaper();
        reaper.keep(&BTreeSet::from([live, gone]));
        reaper.forget(&BTreeSet::from([gone]));
        assert_eq!(reap::<Flow4>(&pin, &reaper.listed).unwrap(), 200);
        let left: Vec<(FlowKey4, Flow4)> = flows.iter().map(Result::unwrap).collect();
        assert_eq!(left.len(), 200);
        assert!(left.iter().all(|(key, flow)| Flow4::backend(key, flow) == live));
        assert_eq!(reap::<Flow4>(&pin, &reaper.listed).unwrap(), 0);
        // After a full sync that no longer lists `live`, its connections go too.
        reaper.keep_only(Arc::new(BTreeSet::from([gone])));
        assert_eq!(reap::<Flow4>(&pin, &reaper.listed).unwrap(), 200);
        assert_eq!(flows.keys().count(), 0);
    }
}
