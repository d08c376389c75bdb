//! The nftables dataplane (`--proxy-mode=nftables`): the desired state as kube-proxy's
//! nftables ruleset (`ruleset` has the structure) in a table of vipr's own per IP family,
//! `ip vipr` and `ip6 vipr`. Per-family tables, as kube-proxy's: every set and verdict map is
//! keyed by one address type, and deleting one family's table leaves the other serving.
//!
//! Every sync is one transaction per family (packets see the old table or the new): an
//! `nft -f -` text batch, as kube-proxy's knftables, or, for a partial sync that changes set
//! and map elements alone (an endpoint moved, a service added whose chains exist), one
//! nf_tables netlink batch of those elements (`netlink`), with no `nft` process: `nft -f`
//! spends ~65 ms at 10k services on its start and its cache of the table before the ~20 ms
//! commit. Not the `nftables` crate: it drives the same libnftables with nft's JSON, the same
//! cost plus a JSON encoding (docs/benchmarks.md, "nftables"). A refused netlink batch is
//! logged, counted ([`NftablesDataplane::netlink_fallbacks`], `/metrics`'
//! `vipr_nftables_netlink_fallbacks_total`) and followed by a full `nft`
//! sync of its family. The first sync, one after a failure and one every
//! [`NftablesOptions::full_sync_period`] are full: the table's chains and sets are listed
//! (`nft -t list chains|sets|maps`), every chain flushed and refilled, every set and map flushed and
//! refilled, what is not wanted deleted. Every other sync is partial: only the chains whose
//! rules differ, the map and set elements added or deleted, the chains gone deleted; nothing
//! when nothing changed. A partial sync that follows the last one by known [`StateChanges`]
//! generates and compares the services of the changed frontends alone
//! ([`ruleset::replace_services`]); without them it compares the whole table. After the rules, UDP conntrack entries that lead to removed
//! endpoints are deleted over netlink (the iptables dataplane's `conntrack`).
use std::{
    collections::{BTreeMap, BTreeSet},
    process::Command,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use anyhow::{anyhow, bail, Context as _};
use tracing::{debug, info, warn};

pub use self::ruleset::{Batch, Existing, Ruleset};
use super::{
    iptables::{self, Family},
    Dataplane, Mode, ServesDevices, SyncReport,
};
use crate::metrics::{Collector, MetricFamily, MetricKind};
use crate::model::{DesiredState, Frontend, FrontendEntry, FrontendKind, ServicePortName, StateChanges};
use crate::tool;

pub mod netlink;
pub mod ruleset;

/// The program vipr drives.
pub const NFT: &str = "nft";

/// The oldest kernel `auto` picks nftables on (kube-proxy's minimum for its nftables mode).
pub const MINIMUM_KERNEL: (u32, u32) = (5, 13);

#[derive(Clone, Debug)]
pub struct NftablesOptions {
    /// A full sync at least this often, even when partial syncs succeed.
    pub full_sync_period: Duration,
    /// Delete stale UDP conntrack entries after syncs.
    pub conntrack_cleanup: bool,
    /// Write a partial sync that changes set and map elements alone as an nf_tables netlink
    /// batch (`netlink`) rather than with `nft -f` (off: every batch is `nft`'s, for
    /// comparisons).
    pub netlink_elements: bool,
}

impl Default for NftablesOptions {
    fn default() -> Self {
        Self { full_sync_period: iptables::FULL_SYNC_PERIOD, conntrack_cleanup: true, netlink_elements: true }
    }
}

/// What wrote a batch to the kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Writer {
    /// `nft -f -` with the batch's text.
    Nft,
    /// One nf_tables netlink transaction of the batch's element changes (`netlink`).
    Netlink,
    /// A table created from empty: `nft -f` for its chains and sets, then one netlink
    /// transaction of its elements.
    NftThenNetlink,
}

/// What one family's batch did in a sync.
#[derive(Clone, Debug)]
pub struct Applied {
    pub family: Family,
    pub batch: Batch,
    pub took: Duration,
    pub writer: Writer,
    /// The netlink batch's part of `took`.
    pub netlink_took: Duration,
}

/// What the last sync did, for tests, benchmarks and debugging.
#[derive(Clone, Debug, Default)]
pub struct SyncStats {
    pub full: bool,
    /// A partial sync given the changes since the generation last synced (`sync_changes`):
    /// it generates and compares the services of the changed frontends alone (unless the
    /// NodePort addresses changed).
    pub from_changes: bool,
    /// One per family that had something to change.
    pub batches: Vec<Applied>,
    pub conntrack_deleted: usize,
    /// Element batches the kernel refused over netlink, each followed by a full `nft` sync
    /// of its family.
    pub netlink_fallbacks: usize,
}

pub struct NftablesDataplane {
    options: NftablesOptions,
    families: Vec<Family>,
    /// What the last successful batch of each family made the kernel hold.
    programmed: BTreeMap<Family, Ruleset>,
    full_syncs: iptables::FullSyncs,
    /// The generation of the state the last complete sync programmed, when it was given one
    /// (`sync_changes`): changes since then may be applied alone.
    synced: Option<u64>,
    /// The frontends of the last complete sync, to count changes and find stale conntrack.
    applied: BTreeMap<Frontend, FrontendEntry>,
    warned_ipv6: bool,
    last: SyncStats,
    /// Netlink element batches refused since the start (each fell back to a full sync);
    /// shared with the collector `/metrics` reads.
    netlink_fallbacks: Arc<NetlinkFallbacks>,
}

/// `vipr_nftables_netlink_fallbacks_total`: netlink element batches the kernel refused.
#[derive(Debug, Default)]
pub struct NetlinkFallbacks(AtomicU64);

/// The metric family of [`NetlinkFallbacks`].
pub const NETLINK_FALLBACKS_METRIC: &str = "vipr_nftables_netlink_fallbacks_total";

impl Collector for NetlinkFallbacks {
    fn collect(&self) -> Vec<MetricFamily> {
        vec![MetricFamily::single(
            NETLINK_FALLBACKS_METRIC,
            "nf_tables element batches the kernel refused over netlink, each followed by a full nft sync of its table.",
            MetricKind::Counter,
            self.0.load(Ordering::Relaxed) as f64,
        )]
    }
}

/// `nft -f -` with `batch` (one transaction); returns how long it took.
pub fn apply(batch: &str) -> anyhow::Result<Duration> {
    let started = Instant::now();
    let output =
        tool::run(Command::new(NFT).args(["-f", "-"]), Some(batch.as_bytes()), tool::RULESET_TIMEOUT)?;
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        // nft quotes the offending line itself; keep the first few lines of it.
        let quoted: Vec<&str> = stderr.lines().take(6).collect();
        bail!("nft -f failed ({}): {}", output.status, quoted.join(" | "));
    }
    Ok(started.elapsed())
}

/// The chains and sets of `FAMILY vipr` (empty when there is none: asked over netlink, no
/// `nft`). Listed by kind (`nft -t list chains|sets|maps FAMILY`) rather than `nft list
/// table`: names alone, not the rules of tens of thousands of chains, which nft takes seconds
/// to fetch and print.
pub fn list_table(family: Family) -> anyhow::Result<Existing> {
    match netlink::families_with_table(ruleset::TABLE) {
        Ok(families) if !families.contains(&family) => return Ok(Existing::default()),
        Ok(_) => {}
        Err(error) => debug!("cannot list the nf_tables tables over netlink, asking nft: {error}"),
    }
    let mut listing = String::new();
    for kind in ["chains", "sets", "maps"] {
        let output = tool::run(
            Command::new(NFT).args(["-t", "list", kind, ruleset::family_name(family)]),
            None,
            tool::QUERY_TIMEOUT,
        )?;
        if !output.status.success() {
            bail!(
                "nft list {kind} failed ({}): {}",
                output.status,
                String::from_utf8_lossy(&output.stderr).trim()
            );
        }
        listing.push_str(&String::from_utf8_lossy(&output.stdout));
    }
    Ok(Existing::parse(&listing))
}

/// The families that have a `vipr` table: one netlink dump of the tables, not `nft list
/// tables`, which fetches the whole ruleset first (seconds with a big table).
pub fn tables() -> anyhow::Result<Vec<Family>> {
    netlink::families_with_table(ruleset::TABLE).context("cannot list the nf_tables tables")
}

/// Whether nftables mode can run here, for `--proxy-mode=auto`: the kernel is at least
/// [`MINIMUM_KERNEL`], `nft` runs, and the kernel accepts (check only, `nft -c`) a throwaway
/// table with every expression the dataplane uses. `Err` says what is missing.
pub fn probe() -> Result<(), String> {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    match kernel_version(&release) {
        Some(version) if version >= MINIMUM_KERNEL => {}
        Some((major, minor)) => {
            return Err(format!(
                "nftables: kernel {major}.{minor} is older than {}.{}",
                MINIMUM_KERNEL.0, MINIMUM_KERNEL.1
            ))
        }
        None => return Err(format!("nftables: cannot read the kernel version {:?}", release.trim())),
    }
    let state = DesiredState::default();
    let mut probe = ruleset::generate(&state, Family::Ipv4);
    // The expressions the service chains add: numgen, dnat (to an address or from an
    // endpoint map), a dynamic set with timeouts.
    probe.sets.insert(
        "affinity-probe".to_owned(),
        ruleset::Set {
            kind: ruleset::SetKind::Set,
            spec: "type ipv4_addr ; flags dynamic,timeout ; timeout 10s ;".to_owned(),
            dynamic: true,
            elements: BTreeMap::new(),
        },
    );
    probe.chains.insert(
        "service-probe".to_owned(),
        ruleset::Chain {
            hook: None,
            rules: vec![
                "ip saddr @affinity-probe update @affinity-probe { ip saddr } meta l4proto tcp dnat to 10.0.0.1:80"
                    .to_owned(),
                "numgen random mod 2 0 meta l4proto tcp dnat to 10.0.0.2:80".to_owned(),
                "meta l4proto tcp dnat ip addr . port to ip daddr . tcp dport . numgen random mod 2 map @endpoints-tcp-0".to_owned(),
                "fib saddr type local jump mark-for-masquerade".to_owned(),
            ],
        },
    );
    let batch = ruleset::full(&Existing::default(), &probe)
        .text
        .replace(&format!("ip {}", ruleset::TABLE), "ip vipr-probe");
    let output =
        tool::run(Command::new(NFT).args(["-c", "-f", "-"]), Some(batch.as_bytes()), tool::QUERY_TIMEOUT)
            .map_err(|error| format!("nftables: {error:#}"))?;
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        return Err(format!(
            "nftables: the kernel refuses the table (nft -c): {}",
            stderr.lines().next().unwrap_or_default().trim()
        ));
    }
    Ok(())
}

/// `6.18.44-fc` → (6, 18).
fn kernel_version(release: &str) -> Option<(u32, u32)> {
    let mut parts = release.trim().split(|c: char| !c.is_ascii_digit());
    Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
}

impl NftablesDataplane {
    /// Checks that `nft` runs. Nothing is written until the first sync.
    pub fn start(options: &NftablesOptions) -> anyhow::Result<Self> {
        let version = tool::run(Command::new(NFT).arg("--version"), None, tool::QUERY_TIMEOUT)
            .context("is nftables (nft) installed?")?
            .stdout_if_success("nft --version")?;
        info!(version = version.trim(), "nftables dataplane: table {} of each family", ruleset::TABLE);
        let families = iptables::node_families("no ip6 table");
        Ok(Self {
            options: options.clone(),
            families,
            programmed: BTreeMap::new(),
            full_syncs: iptables::FullSyncs::new(options.full_sync_period),
            synced: None,
            applied: BTreeMap::new(),
            warned_ipv6: false,
            last: SyncStats::default(),
            netlink_fallbacks: Arc::default(),
        })
    }

    /// What the last call of [`Dataplane::sync`] did.
    pub fn last_sync(&self) -> &SyncStats {
        &self.last
    }

    /// How many netlink element batches the kernel refused since the start (each one logged
    /// and followed by a full `nft` sync of its family).
    pub fn netlink_fallbacks(&self) -> u64 {
        self.netlink_fallbacks.0.load(Ordering::Relaxed)
    }

    /// Turns the netlink element writer on or off ([`NftablesOptions::netlink_elements`]),
    /// for comparisons.
    pub fn set_netlink_elements(&mut self, on: bool) {
        self.options.netlink_elements = on;
    }

    /// Forces the next sync to be full.
    pub fn request_full_sync(&mut self) {
        self.full_syncs.request();
    }

    /// Removes vipr's nftables tables (`--cleanup`, and a start in another mode). Only
    /// vipr's own tables: kube-proxy's `kube-proxy` tables and everyone else's stay.
    pub fn cleanup() -> anyhow::Result<()> {
        let families = match tables() {
            Ok(families) => families,
            Err(error) => {
                info!("no nftables cleanup: {error:#}");
                return Ok(());
            }
        };
        for family in families {
            apply(&ruleset::delete_table(family)).with_context(|| {
                format!("cannot delete table {} {}", ruleset::family_name(family), ruleset::TABLE)
            })?;
            info!(family = ruleset::family_name(family), "removed vipr's nftables table");
        }
        Ok(())
    }

    /// Writes a batch: its element changes over netlink when that is all it holds (and
    /// allowed), else its text with `nft -f` (and then, for a table created from empty, the
    /// elements of `wanted`'s sets it left out, over netlink). `Ok(None)`: the netlink batch
    /// was refused (logged and counted), nothing of it applied; the caller syncs the family
    /// in full.
    fn write(
        &mut self,
        family: Family,
        batch: Batch,
        wanted: Option<&Ruleset>,
        stats: &mut SyncStats,
    ) -> anyhow::Result<Option<Applied>> {
        let started = Instant::now();
        let elements_only = self.options.netlink_elements && !batch.structural && !batch.elements.is_empty();
        let apart = match wanted {
            Some(wanted) if !batch.elements_apart.is_empty() => batch
                .elements_apart
                .iter()
                .filter_map(|name| Some((name, wanted.sets.get(name)?)))
                .map(|(name, set)| netlink::Elements {
                    set: name,
                    spec: &set.spec,
                    delete: false,
                    elements: set
                        .elements
                        .iter()
                        .map(|(key, value)| (key.as_str(), value.as_deref()))
                        .collect(),
                })
                .collect(),
            _ => Vec::new(),
        };
        if !elements_only && apart.is_empty() {
            let took = apply(&batch.text)?;
            return Ok(Some(Applied {
                family,
                batch,
                took,
                writer: Writer::Nft,
                netlink_took: Duration::ZERO,
            }));
        }
        let (writer, elements) = if apart.is_empty() {
            (Writer::Netlink, batch.elements.iter().map(ruleset::ElementChange::view).collect())
        } else {
            apply(&batch.text)?;
            (Writer::NftThenNetlink, apart)
        };
        let netlink_started = Instant::now();
        let result = netlink::apply(family, elements);
        let netlink_took = netlink_started.elapsed();
        match result {
            Ok(()) => Ok(Some(Applied { family, batch, took: started.elapsed(), writer, netlink_took })),
            Err(error) => {
                let fallbacks = self.netlink_fallbacks.0.fetch_add(1, Ordering::Relaxed) + 1;
                stats.netlink_fallbacks += 1;
                warn!(
                    family = ruleset::family_name(family),
                    fallbacks,
                    "nftables element batch over netlink failed, syncing the table in full with nft: {error}"
                );
                Ok(None)
            }
        }
    }

    fn sync_family(
        &mut self,
        state: &DesiredState,
        family: Family,
        full: bool,
        changes: Option<&StateChanges>,
        stats: &mut SyncStats,
    ) -> anyhow::Result<Option<Applied>> {
        let programmed = if full || changes.is_none() { None } else { self.programmed.remove(&family) };
        if let (Some(changes), Some(mut programmed)) = (changes, programmed) {
            if let Some(services) = affected_services(&self.applied, state, changes, family) {
                let addresses = ruleset::nodeport_addresses(&state.frontends, family);
                let old =
                    ruleset::generate_services(state, &self.applied, family, Some(&services), &addresses);
                let new =
                    ruleset::generate_services(state, &state.frontends, family, Some(&services), &addresses);
                let batch = ruleset::replace_services(&mut programmed, &old, &new);
                if batch.is_empty() {
                    self.programmed.insert(family, programmed);
                    return Ok(None);
                }
                if let Some(applied) = self.write(family, batch, None, stats)? {
                    self.programmed.insert(family, programmed);
                    return Ok(Some(applied));
                }
                return self.sync_family_in_full(state, family).map(Some);
            }
            self.programmed.insert(family, programmed);
        }
        let wanted = ruleset::generate(state, family);
        let batch = match self.programmed.get(&family) {
            Some(previous) if !full => ruleset::partial(previous, &wanted),
            _ => {
                let existing = list_table(family)?;
                if self.options.netlink_elements && existing == Existing::default() {
                    ruleset::from_empty(&wanted, |set| netlink::Layout::of_spec(&set.spec).is_some())
                } else {
                    ruleset::full(&existing, &wanted)
                }
            }
        };
        if batch.is_empty() {
            return Ok(None);
        }
        self.programmed.remove(&family);
        match self.write(family, batch, Some(&wanted), stats)? {
            Some(applied) => {
                self.programmed.insert(family, wanted);
                Ok(Some(applied))
            }
            None => self.sync_family_in_full(state, family).map(Some),
        }
    }

    /// A full `nft` sync of one family (after a refused netlink batch: what the kernel holds
    /// is not assumed).
    fn sync_family_in_full(&mut self, state: &DesiredState, family: Family) -> anyhow::Result<Applied> {
        self.programmed.remove(&family);
        let wanted = ruleset::generate(state, family);
        let batch = ruleset::full(&list_table(family)?, &wanted);
        let took = apply(&batch.text)?;
        self.programmed.insert(family, wanted);
        Ok(Applied { family, batch, took, writer: Writer::Nft, netlink_took: Duration::ZERO })
    }
}

impl Dataplane for NftablesDataplane {
    fn mode(&self) -> Mode {
        Mode::Nftables
    }

    fn sync_changes(&mut self, state: &DesiredState, changes: &StateChanges) -> anyhow::Result<SyncReport> {
        self.sync_with(state, Some(changes))
    }

    /// A sync that records no generation, so that the next sync given changes compares all.
    fn sync(&mut self, state: &DesiredState) -> anyhow::Result<SyncReport> {
        self.sync_with(state, None)
    }

    fn collectors(&self) -> Vec<Arc<dyn Collector>> {
        vec![self.netlink_fallbacks.clone()]
    }

    fn device_server(&mut self) -> Option<&mut dyn ServesDevices> {
        None
    }
}

impl NftablesDataplane {
    /// A sync; with `changes` (since the generation of the last complete sync, and with the
    /// classifiers unchanged) a partial one looks at the changed frontends alone.
    fn sync_with(
        &mut self,
        state: &DesiredState,
        changes: Option<&StateChanges>,
    ) -> anyhow::Result<SyncReport> {
        let started = Instant::now();
        let full = self.full_syncs.due();
        let generation = changes.map(|changes| changes.generation);
        let changes = changes.filter(|changes| {
            changes.since.is_some() && changes.since == self.synced && !changes.classifiers
        });
        self.synced = None;
        let mut stats = SyncStats { full, from_changes: !full && changes.is_some(), ..SyncStats::default() };
        let mut report = SyncReport::default();
        let mut failures = Vec::new();
        for family in self.families.clone() {
            match self.sync_family(state, family, full, changes, &mut stats) {
                Ok(Some(applied)) => stats.batches.push(applied),
                Ok(None) => {}
                Err(error) => failures.push((family, error)),
            }
        }
        let mut errors = iptables::failures_that_count(
            failures,
            state,
            &mut self.warned_ipv6,
            "the ip6 nftables table's rules",
        );
        self.full_syncs.record(errors.is_empty(), full);
        if errors.is_empty() {
            self.synced = generation;
        }
        if errors.len() == self.families.len() {
            let (_, error) = errors.swap_remove(0);
            self.last = stats;
            return Err(error.context("cannot program the nftables table"));
        }
        for (family, error) in &errors {
            report.failed.push(format!(
                "{} {} table: {error:#}",
                ruleset::family_name(*family),
                ruleset::TABLE
            ));
        }
        iptables::report_disabled_families(&mut report, state, &self.families);
        let failed: BTreeSet<Family> = errors.iter().map(|(family, _)| *family).collect();
        let settled = |frontend: &Frontend| !failed.contains(&Family::of(frontend.ip));
        // With changes, the frontends they name are all that can differ: compared alone.
        let (before, after) = match changes {
            Some(changes) => {
                let pick =
                    |frontends: &BTreeMap<Frontend, FrontendEntry>| -> BTreeMap<Frontend, FrontendEntry> {
                        changes
                            .frontends
                            .iter()
                            .filter_map(|frontend| {
                                frontends.get(frontend).map(|entry| (*frontend, entry.clone()))
                            })
                            .collect()
                    };
                (
                    std::borrow::Cow::Owned(pick(&self.applied)),
                    std::borrow::Cow::Owned(pick(&state.frontends)),
                )
            }
            None => (std::borrow::Cow::Borrowed(&self.applied), std::borrow::Cow::Borrowed(&state.frontends)),
        };
        report.changed = iptables::changed_frontends(&before, &after, &settled);
        if self.options.conntrack_cleanup {
            stats.conntrack_deleted = iptables::delete_stale_udp_conntrack(&before, &after, &settled);
        }
        match changes {
            Some(changes) if errors.is_empty() => {
                for frontend in &changes.frontends {
                    match state.frontends.get(frontend) {
                        Some(entry) => self.applied.insert(*frontend, entry.clone()),
                        None => self.applied.remove(frontend),
                    };
                }
            }
            _ => self.applied = iptables::now_applied(&self.applied, &state.frontends, &settled),
        }
        debug!(
            full,
            from_changes = stats.from_changes,
            chains_written = stats.batches.iter().map(|a| a.batch.chains_written.len()).sum::<usize>(),
            elements_added = stats.batches.iter().map(|a| a.batch.elements_added).sum::<usize>(),
            elements_deleted = stats.batches.iter().map(|a| a.batch.elements_deleted).sum::<usize>(),
            nft_ms = ?stats.batches.iter().map(|a| a.took.as_millis()).collect::<Vec<_>>(),
            took_ms = started.elapsed().as_millis() as u64,
            "nftables sync"
        );
        self.last = stats;
        Ok(report)
    }
}

/// The services whose chains and elements `changes` may change in `family`'s table: those
/// of the changed frontends before and after, and every service with a NodePort on a
/// protocol and port they use (their elements are shared). `None` when the NodePort
/// addresses changed, which changes every NodePort's elements: the whole table is compared.
fn affected_services(
    applied: &BTreeMap<Frontend, FrontendEntry>,
    state: &DesiredState,
    changes: &StateChanges,
    family: Family,
) -> Option<BTreeSet<ServicePortName>> {
    let mut services = BTreeSet::new();
    let mut nodeports = BTreeSet::new();
    for frontend in changes.frontends.iter().filter(|frontend| Family::of(frontend.ip) == family) {
        for entry in [applied.get(frontend), state.frontends.get(frontend)].into_iter().flatten() {
            services.insert(entry.service.clone());
            if entry.kind == FrontendKind::NodePort {
                nodeports.insert((frontend.protocol, frontend.port));
            }
        }
    }
    if !nodeports.is_empty() {
        if ruleset::nodeport_addresses(applied, family)
            != ruleset::nodeport_addresses(&state.frontends, family)
        {
            return None;
        }
        for (frontend, entry) in applied.iter().chain(&state.frontends) {
            if entry.kind == FrontendKind::NodePort
                && Family::of(frontend.ip) == family
                && nodeports.contains(&(frontend.protocol, frontend.port))
            {
                services.insert(entry.service.clone());
            }
        }
    }
    Some(services)
}

/// `nft list table` of each family vipr has a table in (`vipr inspect` in nftables mode).
pub fn list_tables() -> anyhow::Result<String> {
    let mut text = String::new();
    for family in tables()? {
        let listing = tool::run(
            Command::new(NFT).args(["list", "table", ruleset::family_name(family), ruleset::TABLE]),
            None,
            tool::QUERY_TIMEOUT,
        )?
        .stdout_if_success("nft list table")?;
        text.push_str(&listing);
    }
    if text.is_empty() {
        return Err(anyhow!("no nftables table {} (is vipr running in nftables mode?)", ruleset::TABLE));
    }
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_versions_are_read_from_the_release() {
        assert_eq!(kernel_version("6.18.44-fc-v595\n"), Some((6, 18)));
        assert_eq!(kernel_version("5.10.0-28-amd64"), Some((5, 10)));
        assert_eq!(kernel_version("garbage"), None);
        assert!(kernel_version("5.10.0").unwrap() < MINIMUM_KERNEL);
        assert!(kernel_version("5.13.1").unwrap() >= MINIMUM_KERNEL);
    }
}
