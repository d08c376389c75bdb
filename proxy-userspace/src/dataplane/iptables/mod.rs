//! The iptables dataplane (`--proxy-mode=iptables`): the desired state as kube-proxy's
//! iptables rules (`ruleset` has the chain structure), for kernels where vipr's eBPF
//! datapath cannot run. It loads no BPF.
//!
//! Every sync is one `iptables-restore --noflush` transaction per IP family (`iptables`,
//! `ip6tables`), so the kernel switches from the old rules to the new at once. The first sync,
//! one after a failure and one every [`IptablesOptions::full_sync_period`] are full: they read
//! `iptables-save`, write all of vipr's chains, delete stale service chains (vipr's or
//! kube-proxy's) and insert the jumps from the built-in chains that are missing. Every other
//! sync is partial, as kube-proxy's: only the chains whose rules differ from what the last
//! successful sync wrote, and the deletion of chains no longer wanted; nothing at all when
//! nothing changed. After the rules, UDP conntrack entries that lead to removed endpoints are
//! deleted over netlink (`conntrack`).
//!
//! The system's iptables variant (legacy x_tables or nf_tables) is detected from
//! `iptables --version` and used, since rules of one variant are invisible to the other.
//!
//! `--iptables-localhost-nodeports` (kube-proxy's, default true) serves IPv4 NodePorts on
//! 127.0.0.1 too: it sets `net.ipv4.conf.all.route_localnet=1` at start (node-wide, left so
//! when vipr stops, as kube-proxy) and ensures kubelet's CVE-2020-8558 guard in
//! `KUBE-FIREWALL` ([`localhost_node_ports`], [`ruleset::LOCALNET_GUARD`]).
use std::{
    collections::{BTreeMap, BTreeSet},
    net::SocketAddr,
    path::Path,
    time::{Duration, Instant},
};

use anyhow::{anyhow, Context as _};
use ipnet::Ipv4Net;
use tracing::{debug, info, warn};

pub use self::{
    ruleset::{Family, RuleOptions, Ruleset, TableName},
    tools::{Tools, Variant},
};
use super::{Dataplane, Mode, ServesDevices, SyncReport};
use crate::metrics::Collector;
use crate::model::{DesiredState, Frontend, FrontendEntry, Protocol, StateChanges};

pub mod conntrack;
pub mod names;
pub mod restore;
pub mod ruleset;
pub mod tools;

/// kube-proxy's `FullSyncPeriod`.
pub const FULL_SYNC_PERIOD: Duration = Duration::from_secs(3600);

#[derive(Clone, Debug)]
pub struct IptablesOptions {
    /// Use this variant's programs (`iptables-legacy-restore`, `iptables-nft-restore`)
    /// rather than the system's `iptables-restore`.
    pub variant: Option<Variant>,
    /// A full sync at least this often, even when partial syncs succeed.
    pub full_sync_period: Duration,
    /// Delete stale UDP conntrack entries after syncs.
    pub conntrack_cleanup: bool,
    /// Also serve IPv4 NodePorts on these loopback addresses ([`localhost_node_ports`]):
    /// `route_localnet=1` is set at start and the CVE-2020-8558 guard ensured. The agent
    /// passes kube-proxy's default (on); `None` here, for embedders and tests, leaves
    /// loopback and the sysctl alone.
    pub localhost_node_ports: Option<Ipv4Net>,
}

impl Default for IptablesOptions {
    fn default() -> Self {
        Self {
            variant: None,
            full_sync_period: FULL_SYNC_PERIOD,
            conntrack_cleanup: true,
            localhost_node_ports: None,
        }
    }
}

/// `sysctl -w net.ipv4.conf.all.route_localnet=1` in the calling thread's network namespace,
/// which localhost NodePorts need (the kernel otherwise drops packets routed with a 127.0.0.0/8
/// address). Returns the previous value. Node-wide; kube-proxy sets it the same way and never
/// sets it back, and neither does vipr.
pub fn enable_route_localnet() -> anyhow::Result<String> {
    let path = "/proc/sys/net/ipv4/conf/all/route_localnet";
    let previous = std::fs::read_to_string(path).with_context(|| format!("cannot read {path}"))?;
    let previous = previous.trim().to_owned();
    if previous != "1" {
        std::fs::write(path, "1").with_context(|| format!("cannot set {path} to 1"))?;
    }
    Ok(previous)
}

/// What one family's restore did in a sync.
#[derive(Clone, Debug)]
pub struct Restore {
    pub family: Family,
    /// The `iptables-restore --noflush` input.
    pub input: String,
    pub written: Vec<(TableName, String)>,
    pub deleted: Vec<(TableName, String)>,
    pub took: Duration,
}

/// What the last sync did, for tests, benchmarks and debugging.
#[derive(Clone, Debug, Default)]
pub struct SyncStats {
    pub full: bool,
    /// One per family that had something to write.
    pub restores: Vec<Restore>,
    /// UDP conntrack entries deleted.
    pub conntrack_deleted: usize,
}

/// When a netfilter dataplane's sync is full (every chain or set compared and rewritten): the
/// first, the one after a failed sync, one asked for, and one every `period` even when partial
/// syncs succeed, as kube-proxy's periodic full resyncs.
#[derive(Clone, Debug)]
pub(crate) struct FullSyncs {
    period: Duration,
    needed: bool,
    last: Option<Instant>,
}

impl FullSyncs {
    pub(crate) fn new(period: Duration) -> Self {
        Self { period, needed: true, last: None }
    }

    /// Whether the next sync must be full.
    pub(crate) fn due(&self) -> bool {
        self.needed || self.last.is_none_or(|last| last.elapsed() >= self.period)
    }

    /// Makes the next sync full.
    pub(crate) fn request(&mut self) {
        self.needed = true;
    }

    /// A sync ended: `complete` when every family was programmed; `full` when it was full.
    pub(crate) fn record(&mut self, complete: bool, full: bool) {
        self.needed = !complete;
        if complete && full {
            self.last = Some(Instant::now());
        }
    }
}

/// The families a netfilter mode programs on this node: IPv4, and IPv6 unless the node has it
/// disabled (then `without_ipv6` says what it goes without).
pub(crate) fn node_families(without_ipv6: &str) -> Vec<Family> {
    let mut families = vec![Family::Ipv4];
    if Path::new("/proc/thread-self/net/if_inet6").exists() {
        families.push(Family::Ipv6);
    } else {
        info!("IPv6 is disabled on this node: {without_ipv6}");
    }
    families
}

/// Whether `state` wants anything of `family`: a frontend, or a service CIDR to guard.
pub(crate) fn wants_family(state: &DesiredState, family: Family) -> bool {
    state.frontends.keys().any(|frontend| Family::of(frontend.ip) == family)
        || state.service_cidrs.iter().any(|cidr| Family::of_net(cidr) == family)
}

/// The failures of a netfilter sync's families that count. An IPv6 failure while `state`
/// wants nothing of IPv6 is warned about once (`warned_ipv6`; `ipv6_rules` names what was not
/// programmed) and dropped: a node whose IPv6 tooling does not work still serves IPv4.
pub(crate) fn failures_that_count(
    failures: Vec<(Family, anyhow::Error)>,
    state: &DesiredState,
    warned_ipv6: &mut bool,
    ipv6_rules: &str,
) -> Vec<(Family, anyhow::Error)> {
    failures
        .into_iter()
        .filter(|(family, error)| {
            if *family != Family::Ipv6 || wants_family(state, Family::Ipv6) {
                return true;
            }
            if !*warned_ipv6 {
                warn!("{ipv6_rules} not programmed (no IPv6 service needs them): {error:#}");
                *warned_ipv6 = true;
            }
            false
        })
        .collect()
}

/// Names, in `report`, the frontends of `state` whose family this node does not program.
pub(crate) fn report_disabled_families(report: &mut SyncReport, state: &DesiredState, families: &[Family]) {
    for (frontend, entry) in &state.frontends {
        if !families.contains(&Family::of(frontend.ip)) {
            report.unsupported.push(format!("{frontend} ({}): IPv6 is disabled on this node", entry.service));
        }
    }
}

/// The frontends programmed after a sync that wanted `wanted`: those `settled` says were
/// programmed as wanted, the others (of families that failed) with their old value from
/// `applied`, so that their changes are counted (and their conntrack cleaned) when they are
/// finally programmed.
pub(crate) fn now_applied(
    applied: &BTreeMap<Frontend, FrontendEntry>,
    wanted: &BTreeMap<Frontend, FrontendEntry>,
    settled: &dyn Fn(&Frontend) -> bool,
) -> BTreeMap<Frontend, FrontendEntry> {
    let mut now: BTreeMap<Frontend, FrontendEntry> =
        wanted.iter().filter(|(frontend, _)| settled(frontend)).map(|(f, e)| (*f, e.clone())).collect();
    now.extend(applied.iter().filter(|(frontend, _)| !settled(frontend)).map(|(f, e)| (*f, e.clone())));
    now
}

/// Deletes the conntrack entries of UDP flows whose endpoint went away between `before` and
/// `after` (among the frontends `settled` says were programmed); how many, 0 on an error,
/// which is logged: the next change tries again.
pub(crate) fn delete_stale_udp_conntrack(
    before: &BTreeMap<Frontend, FrontendEntry>,
    after: &BTreeMap<Frontend, FrontendEntry>,
    settled: &dyn Fn(&Frontend) -> bool,
) -> usize {
    let keep = stale_udp(before, after, settled);
    if keep.is_empty() {
        return 0;
    }
    match conntrack::delete_stale_udp(&keep) {
        Ok(deleted) => {
            if deleted > 0 {
                debug!(deleted, "deleted stale UDP conntrack entries");
            }
            deleted
        }
        Err(error) => {
            warn!("cannot delete stale UDP conntrack entries: {error}");
            0
        }
    }
}

pub struct IptablesDataplane {
    tools: Tools,
    options: IptablesOptions,
    rule_options: RuleOptions,
    families: Vec<Family>,
    /// What the last successful restore of each family made the kernel hold.
    programmed: BTreeMap<Family, Ruleset>,
    full_syncs: FullSyncs,
    /// The frontends of the last complete sync, to count changes and find stale conntrack.
    applied: BTreeMap<Frontend, FrontendEntry>,
    /// IPv6 failures already warned about when there is nothing IPv6 to program.
    warned_ipv6: bool,
    last: SyncStats,
}

impl IptablesDataplane {
    /// Finds the iptables programs and the system facts the rules depend on. Nothing is
    /// written until the first sync.
    pub fn start(options: &IptablesOptions) -> anyhow::Result<Self> {
        let tools = Tools::detect(options.variant)?;
        let (major, minor, patch) = tools.version;
        info!(
            variant = tools.variant.name(),
            version = format!("{major}.{minor}.{patch}"),
            "iptables dataplane: using the {} variant of iptables{}",
            tools.variant,
            if options.variant.is_some() { " (as asked)" } else { " (the system's)" }
        );
        if options.localhost_node_ports.is_some() {
            let previous = enable_route_localnet().context(
                "--iptables-localhost-nodeports needs net.ipv4.conf.all.route_localnet=1 (or pass \
                 --iptables-localhost-nodeports=false)",
            )?;
            if previous == "1" {
                info!("net.ipv4.conf.all.route_localnet is 1 already: NodePorts are served on localhost");
            } else {
                info!(
                    previous,
                    "set net.ipv4.conf.all.route_localnet=1 (node-wide, and left so when vipr stops, as \
                     kube-proxy) to serve NodePorts on localhost; KUBE-FIREWALL drops other traffic to \
                     127.0.0.0/8 from outside (CVE-2020-8558). --iptables-localhost-nodeports=false or \
                     --nodeport-addresses without 127.0.0.1 turn this off"
                );
            }
        }
        let conntrack_tcp_liberal =
            std::fs::read_to_string("/proc/sys/net/netfilter/nf_conntrack_tcp_be_liberal")
                .is_ok_and(|value| value.trim() != "0");
        let families = node_families("no ip6tables rules");
        Ok(Self {
            rule_options: RuleOptions {
                conntrack_tcp_liberal,
                random_fully: tools.has_random_fully(),
                localhost_node_ports: options.localhost_node_ports,
            },
            tools,
            options: options.clone(),
            families,
            programmed: BTreeMap::new(),
            full_syncs: FullSyncs::new(options.full_sync_period),
            applied: BTreeMap::new(),
            warned_ipv6: false,
            last: SyncStats::default(),
        })
    }

    pub fn variant(&self) -> Variant {
        self.tools.variant
    }

    pub fn tools(&self) -> &Tools {
        &self.tools
    }

    /// What the last call of [`Dataplane::sync`] did.
    pub fn last_sync(&self) -> &SyncStats {
        &self.last
    }

    /// Forces the next sync to be full.
    pub fn request_full_sync(&mut self) {
        self.full_syncs.request();
    }

    /// Removes vipr's and kube-proxy's iptables chains, and the jumps to them, from both
    /// families, in the system's variant and in the other one if it holds rules. Rules and
    /// chains of anyone else stay.
    pub fn cleanup() -> anyhow::Result<()> {
        Self::cleanup_where(&|_| true)
    }

    /// Removes what an iptables-mode vipr left behind, when vipr starts in another mode: the
    /// same chains as [`Self::cleanup`], but only in the tables of a family that has
    /// iptables-mode chains (a service chain, `KUBE-NODEPORTS`, `KUBE-EXTERNAL-SERVICES`:
    /// the IPVS mode shares the other top-level names and must keep them across its own
    /// restarts) and no `KUBE-PROXY-CANARY`: that chain is kube-proxy's (vipr never creates
    /// it), so its chains are left to kube-proxy (or to `vipr --cleanup`).
    pub fn cleanup_leftovers() -> anyhow::Result<()> {
        Self::cleanup_where(&|saved| {
            let chains = || saved.values().flat_map(|table| table.user_chains());
            if chains().any(|chain| chain == restore::KUBE_PROXY_CANARY) {
                info!("kube-proxy's iptables chains (KUBE-PROXY-CANARY) are left alone");
                return false;
            }
            chains().any(|chain| {
                names::is_service_chain(chain)
                    || [ruleset::KUBE_NODEPORTS, ruleset::KUBE_EXTERNAL_SERVICES].contains(&chain)
            })
        })
    }

    /// Cleans the families (per variant) whose saved tables `wanted` accepts.
    fn cleanup_where(wanted: &dyn Fn(&BTreeMap<String, restore::SavedTable>) -> bool) -> anyhow::Result<()> {
        let mut variants = Vec::new();
        match Tools::detect(None) {
            Ok(tools) => variants.push(tools),
            Err(error) => {
                info!("no iptables cleanup: {error:#}");
                return Ok(());
            }
        }
        let system = variants[0].variant;
        let other = match system {
            Variant::Legacy => Variant::Nft,
            Variant::Nft => Variant::Legacy,
        };
        // Legacy tables exist only once something loaded them; don't make them appear. (The
        // calling thread's namespace: /proc/net would be the process's.)
        let other_in_use = other == Variant::Nft
            || ["/proc/thread-self/net/ip_tables_names", "/proc/thread-self/net/ip6_tables_names"]
                .iter()
                .any(|path| std::fs::read_to_string(path).is_ok_and(|names| !names.trim().is_empty()));
        if other_in_use {
            if let Ok(tools) = Tools::detect(Some(other)) {
                variants.push(tools);
            }
        }
        let mut errors = Vec::new();
        for tools in &variants {
            for family in Family::ALL {
                if family == Family::Ipv6 && !Path::new("/proc/thread-self/net/if_inet6").exists() {
                    continue;
                }
                if let Err(error) = cleanup_family(tools, family, wanted) {
                    errors.push(format!("{} ({}): {error:#}", tools::command(family), tools.variant));
                }
            }
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(anyhow!("iptables cleanup incomplete: {}", errors.join("; ")))
        }
    }

    /// One family: generate, plan, restore. Returns what was restored (None: nothing to do).
    fn sync_family(
        &mut self,
        state: &DesiredState,
        family: Family,
        full: bool,
    ) -> anyhow::Result<Option<Restore>> {
        // Service (`ns/name`) to its health-check node port, accepted in the filter table.
        let health_check_node_ports: BTreeMap<String, u16> =
            state.health_checks.iter().map(|(service, check)| (service.to_string(), check.port)).collect();
        let wanted =
            ruleset::generate_with_health_checks(state, family, self.rule_options, &health_check_node_ports);
        let plan = match self.programmed.get(&family) {
            Some(previous) if !full => restore::partial(previous, &wanted),
            _ => {
                let saved = self.tools.save(family)?;
                restore::full(&restore::parse_save(&saved), &wanted)
            }
        };
        if plan.is_empty() {
            return Ok(None);
        }
        let input = plan.render();
        let written = plan.written().into_iter().map(|(table, chain)| (table, chain.to_owned())).collect();
        let deleted = plan.deleted().into_iter().map(|(table, chain)| (table, chain.to_owned())).collect();
        // Not programmed any more until the restore succeeds: a failed one leaves the kernel
        // in an unknown state as far as the next partial sync is concerned.
        self.programmed.remove(&family);
        let took = self.tools.restore(family, &input)?;
        self.programmed.insert(family, wanted);
        Ok(Some(Restore { family, input, written, deleted, took }))
    }
}

impl Dataplane for IptablesDataplane {
    fn mode(&self) -> Mode {
        Mode::Iptables
    }

    fn collectors(&self) -> Vec<std::sync::Arc<dyn Collector>> {
        Vec::new()
    }

    fn device_server(&mut self) -> Option<&mut dyn ServesDevices> {
        None
    }

    /// Compares the whole state each time: iptables-restore rewrites whole chains, and the
    /// chains of a service that did not change are left out by comparing their text.
    fn sync_changes(&mut self, state: &DesiredState, _changes: &StateChanges) -> anyhow::Result<SyncReport> {
        let started = Instant::now();
        let full = self.full_syncs.due();
        let mut stats = SyncStats { full, ..SyncStats::default() };
        let mut report = SyncReport::default();
        let mut failures = Vec::new();
        for family in self.families.clone() {
            match self.sync_family(state, family, full) {
                Ok(Some(restore)) => stats.restores.push(restore),
                Ok(None) => {}
                Err(error) => failures.push((family, error)),
            }
        }
        let mut errors = failures_that_count(failures, state, &mut self.warned_ipv6, "ip6tables rules");
        let complete = errors.is_empty();
        self.full_syncs.record(complete, full);
        if errors.len() == self.families.len() {
            let (_, error) = errors.swap_remove(0);
            self.last = stats;
            return Err(error.context("cannot program the iptables rules"));
        }
        for (family, error) in &errors {
            report.failed.push(format!("{} rules: {error:#}", tools::command(*family)));
        }
        report_disabled_families(&mut report, state, &self.families);

        let failed_families: BTreeSet<Family> = errors.iter().map(|(family, _)| *family).collect();
        let settled = |frontend: &Frontend| !failed_families.contains(&Family::of(frontend.ip));
        report.changed = changed_frontends(&self.applied, &state.frontends, &settled);
        if self.options.conntrack_cleanup {
            stats.conntrack_deleted = delete_stale_udp_conntrack(&self.applied, &state.frontends, &settled);
        }
        self.applied = now_applied(&self.applied, &state.frontends, &settled);

        let written: usize = stats.restores.iter().map(|restore| restore.written.len()).sum();
        let deleted: usize = stats.restores.iter().map(|restore| restore.deleted.len()).sum();
        let restore_ms: Vec<u128> = stats.restores.iter().map(|restore| restore.took.as_millis()).collect();
        debug!(
            full,
            chains_written = written,
            chains_deleted = deleted,
            ?restore_ms,
            took_ms = started.elapsed().as_millis() as u64,
            "iptables sync"
        );
        self.last = stats;
        Ok(report)
    }
}

/// Frontends added, removed, or whose entry changed (among those `settled` says were
/// programmed).
pub(crate) fn changed_frontends(
    before: &BTreeMap<Frontend, FrontendEntry>,
    after: &BTreeMap<Frontend, FrontendEntry>,
    settled: &dyn Fn(&Frontend) -> bool,
) -> usize {
    let keys: BTreeSet<&Frontend> = before.keys().chain(after.keys()).collect();
    keys.into_iter()
        .filter(|frontend| settled(frontend) && before.get(*frontend) != after.get(*frontend))
        .count()
}

/// The UDP frontends whose conntrack entries may be stale (`conntrack::stale_udp`), among
/// those `settled` says were programmed.
pub(crate) fn stale_udp(
    before: &BTreeMap<Frontend, FrontendEntry>,
    after: &BTreeMap<Frontend, FrontendEntry>,
    settled: &dyn Fn(&Frontend) -> bool,
) -> conntrack::Keep {
    let udp_frontends = |frontends: &BTreeMap<Frontend, FrontendEntry>| -> conntrack::UdpFrontends {
        frontends
            .iter()
            .filter(|(frontend, _)| frontend.protocol == Protocol::Udp && settled(frontend))
            .map(|(frontend, entry)| {
                let endpoints = entry
                    .all_backends()
                    .into_iter()
                    .map(|backend| SocketAddr::new(backend.ip, backend.port))
                    .collect();
                (SocketAddr::new(frontend.ip, frontend.port), endpoints)
            })
            .collect()
    };
    conntrack::stale_udp(&udp_frontends(before), &udp_frontends(after))
}

fn cleanup_family(
    tools: &Tools,
    family: Family,
    wanted: &dyn Fn(&BTreeMap<String, restore::SavedTable>) -> bool,
) -> anyhow::Result<()> {
    let saved = restore::parse_save(&tools.save(family)?);
    if !wanted(&saved) {
        return Ok(());
    }
    let plans = restore::cleanup(&saved);
    if plans.is_empty() {
        return Ok(());
    }
    let chains: usize = plans.values().map(|plan| plan.delete.len()).sum();
    tools
        .restore(family, &restore::render_cleanup(&plans))
        .with_context(|| format!("cannot remove {chains} chains"))?;
    info!(
        family = tools::command(family),
        variant = tools.variant.name(),
        chains,
        "removed the iptables chains of vipr and kube-proxy"
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{
        fixtures::{self, frontend},
        FrontendKind,
    };

    fn entry(backends: &[&str]) -> FrontendEntry {
        fixtures::entry(
            fixtures::service_port("ns", "dns", "dns", Protocol::Udp),
            FrontendKind::ClusterIp,
            backends,
        )
    }

    #[test]
    fn stale_udp_frontends_are_those_that_lost_or_gained_their_first_endpoints_or_went_away() {
        let dns = frontend("172.30.0.10:53", Protocol::Udp);
        let gone = frontend("172.30.0.11:53", Protocol::Udp);
        let tcp = frontend("172.30.0.12:80", Protocol::Tcp);
        let all = |_: &Frontend| true;
        let state = |entries: Vec<(Frontend, FrontendEntry)>| entries.into_iter().collect::<BTreeMap<_, _>>();

        let before = state(vec![
            (dns, entry(&["10.1.0.1:53", "10.1.0.2:53"])),
            (gone, entry(&["10.1.0.3:53"])),
            (tcp, entry(&[])),
        ]);
        // An endpoint added: nothing is stale, but the vanished frontend is.
        let after = state(vec![
            (dns, entry(&["10.1.0.1:53", "10.1.0.2:53", "10.1.0.4:53"])),
            (tcp, entry(&["10.1.0.5:80"])),
        ]);
        let keep = stale_udp(&before, &after, &all);
        assert_eq!(keep.len(), 1);
        assert!(keep[&"172.30.0.11:53".parse().unwrap()].is_empty());

        // An endpoint removed: entries to the frontend may keep only the others.
        let after = state(vec![(dns, entry(&["10.1.0.1:53"]))]);
        let keep = stale_udp(&before, &after, &all);
        assert_eq!(keep[&"172.30.0.10:53".parse().unwrap()], ["10.1.0.1:53".parse().unwrap()].into());

        // From no endpoints to some, and a new frontend: their earlier packets bypassed DNAT.
        let before = state(vec![(dns, entry(&[]))]);
        let after = state(vec![(dns, entry(&["10.1.0.1:53"])), (gone, entry(&["10.1.0.3:53"]))]);
        assert_eq!(stale_udp(&before, &after, &all).len(), 2);
        // Unchanged: nothing to do (no conntrack dump on every periodic sync).
        assert!(stale_udp(&after, &after, &all).is_empty());
        // A family that failed to program is left for later.
        assert!(stale_udp(&before, &after, &|_| false).is_empty());
    }

    #[test]
    fn a_sync_is_full_at_first_after_a_failure_when_asked_and_every_period() {
        let mut syncs = FullSyncs::new(Duration::from_secs(3600));
        assert!(syncs.due(), "the first sync is full");
        syncs.record(true, true);
        assert!(!syncs.due(), "partial syncs follow a complete full one");
        syncs.record(false, false);
        assert!(syncs.due(), "a failed sync makes the next one full");
        syncs.record(true, true);
        syncs.request();
        assert!(syncs.due(), "asked for");
        syncs.record(true, true);
        assert!(!syncs.due(), "the full sync asked for is done");
        let mut every_time = FullSyncs::new(Duration::ZERO);
        every_time.record(true, true);
        assert!(every_time.due(), "the period has passed");
    }

    #[test]
    fn changes_are_counted_per_frontend() {
        let a = frontend("172.30.0.10:53", Protocol::Udp);
        let b = frontend("172.30.0.11:53", Protocol::Udp);
        let before: BTreeMap<_, _> = [(a, entry(&["10.1.0.1:53"]))].into_iter().collect();
        let after: BTreeMap<_, _> = [(a, entry(&["10.1.0.2:53"])), (b, entry(&[]))].into_iter().collect();
        assert_eq!(changed_frontends(&before, &after, &|_| true), 2);
        assert_eq!(changed_frontends(&after, &after, &|_| true), 0);
    }
}
