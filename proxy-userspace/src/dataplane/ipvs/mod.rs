//! The IPVS dataplane (`--proxy-mode=ipvs`), as kube-proxy's IPVS mode: a virtual service
//! per frontend with its endpoints as masqueraded real servers, programmed over generic
//! netlink ([`client`]); service addresses bound to the dummy interface `kube-ipvs0` so
//! that the node accepts them ([`link`]); ipsets naming the frontends of each kind
//! ([`ipset`], changed with `ipset restore` batches) and a small, mostly fixed set of
//! iptables rules that match them for masquerading and filtering ([`rules`]).
//!
//! Each sync turns the desired state into a [`plan::Plan`] and applies only what differs from
//! what the kernel has: the virtual services and real servers are mirrored in memory (read
//! back from the kernel at start, and again after a failure), the ipsets are diffed against
//! `ipset save`, the rules are restored only when their text changes, the addresses against
//! the interface's. A TCP real server whose endpoint leaves the service but is still listed
//! (terminating) gets weight 0 and stays until IPVS tracks no connection to it any more
//! (graceful termination, checked on every sync); UDP and SCTP ones are deleted at once, as
//! kube-proxy does, and so are endpoints that no slice lists any more (the model breaks their
//! connections off; with `expire_nodest_conn` IPVS ends each at its next packet).
use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    path::Path,
};

use anyhow::{bail, Context as _};
use ipnet::IpNet;
use tracing::{debug, info, warn};

use self::{
    client::{Destination, Ipvs, ServiceKey, ServiceSettings, Timeouts},
    ipset::{Family, IpsetTool, SetContents},
    link::{AddressBinder, DUMMY_INTERFACE},
    plan::{Plan, PlanSettings},
};
use super::{
    iptables::{
        conntrack::{self, UdpFrontends},
        tools::Tools,
    },
    Dataplane, Mode, ServesDevices, SyncReport,
};
use crate::{
    metrics::Collector,
    model::{Backend, DesiredState, Protocol, StateChanges},
};

pub mod client;
pub mod ipset;
pub mod link;
pub mod plan;
pub mod rules;

/// The schedulers `--ipvs-scheduler` accepts: every scheduler Linux's IPVS has (each is a
/// module of its own, `ip_vs_<name>`; one the running kernel lacks fails when the first
/// virtual service is created, as with kube-proxy).
pub const SCHEDULERS: [&str; 14] =
    ["rr", "wrr", "lc", "wlc", "lblc", "lblcr", "dh", "sh", "sed", "nq", "fo", "ovf", "mh", "twos"];
/// kube-proxy's default scheduler.
pub const DEFAULT_SCHEDULER: &str = "rr";

/// The weight of a real server that takes new connections.
const ACTIVE_WEIGHT: u32 = 1;

/// kube-proxy's IPVS settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IpvsOptions {
    pub scheduler: String,
    /// `--ipvs-tcp-timeout`, `--ipvs-tcpfin-timeout`, `--ipvs-udp-timeout` in seconds; 0 keeps
    /// the kernel's value.
    pub timeouts: Timeouts,
    /// `--ipvs-strict-arp`: answer ARP only for addresses of the interface asked on, so the
    /// service addresses on the dummy interface are never announced.
    pub strict_arp: bool,
    /// `--ipvs-exclude-cidrs`: virtual services in these ranges are not vipr's and are never
    /// removed.
    pub exclude_cidrs: Vec<IpNet>,
    pub masquerade_all: bool,
}

impl Default for IpvsOptions {
    fn default() -> Self {
        Self {
            scheduler: DEFAULT_SCHEDULER.to_owned(),
            timeouts: Timeouts::default(),
            strict_arp: false,
            exclude_cidrs: Vec::new(),
            masquerade_all: false,
        }
    }
}

/// A virtual service as the kernel has it.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Programmed {
    settings: ServiceSettings,
    /// Real servers and their weights.
    destinations: BTreeMap<Backend, u32>,
}

pub struct IpvsDataplane {
    options: IpvsOptions,
    ipvs: Ipvs,
    binder: AddressBinder,
    ipset: IpsetTool,
    /// The system's iptables variant, the one iptables mode would use (rules of the other
    /// variant are invisible to kubelet and the CNI).
    iptables: Tools,
    /// The kernel's virtual services (vipr's, and those it would remove); `None` after a
    /// failure: read again before the next sync.
    programmed: Option<BTreeMap<ServiceKey, Programmed>>,
    /// Real servers with weight 0 waiting for their connections to end.
    terminating: BTreeSet<(ServiceKey, Backend)>,
    /// The members of vipr's sets as the kernel has them; `None`: read again.
    sets: Option<SetContents>,
    /// The rules text last restored per family.
    rules_applied: BTreeMap<Family, String>,
    /// Families whose rules could not be applied while no frontend needed them (IPv6 on a
    /// node without ip6tables): logged once.
    rules_unavailable: BTreeSet<Family>,
    /// The UDP virtual services as last programmed, with their real servers: what conntrack
    /// entries may lead to (stale ones are deleted after each sync, as in iptables mode).
    udp_applied: UdpFrontends,
}

impl IpvsDataplane {
    /// Opens IPVS (the kernel loads it on demand), sets the sysctls and timeouts kube-proxy
    /// sets, creates the dummy interface and reads back what the kernel already has.
    pub fn start(options: IpvsOptions) -> anyhow::Result<Self> {
        let mut ipvs = Ipvs::open().context("the IPVS dataplane needs IPVS")?;
        set_sysctls(options.strict_arp)?;
        if options.timeouts != Timeouts::default() {
            ipvs.set_timeouts(&options.timeouts)?;
        }
        link::ensure_dummy(DUMMY_INTERFACE)
            .with_context(|| format!("cannot create the dummy interface {DUMMY_INTERFACE}"))?;
        let mut dataplane = Self {
            options,
            ipvs,
            binder: AddressBinder::open().context("cannot open an rtnetlink socket")?,
            ipset: IpsetTool,
            iptables: Tools::detect(None).context("the IPVS dataplane needs iptables")?,
            programmed: None,
            terminating: BTreeSet::new(),
            sets: None,
            rules_applied: BTreeMap::new(),
            rules_unavailable: BTreeSet::new(),
            udp_applied: UdpFrontends::new(),
        };
        let programmed = dataplane.read_programmed()?;
        info!(services = programmed.len(), scheduler = dataplane.options.scheduler, "IPVS dataplane started");
        // A real server left at weight 0 by an earlier vipr was on its way out.
        for (key, service) in &programmed {
            for (backend, weight) in &service.destinations {
                if *weight == 0 {
                    dataplane.terminating.insert((*key, *backend));
                }
            }
        }
        dataplane.programmed = Some(programmed);
        Ok(dataplane)
    }

    /// Removes everything the IPVS dataplane installs: virtual services (but excluded ones),
    /// the dummy interface, the rules, the sets.
    pub fn cleanup(exclude_cidrs: &[IpNet]) -> anyhow::Result<()> {
        let mut errors = Vec::new();
        if let Ok(mut ipvs) = Ipvs::open() {
            match ipvs.services() {
                Ok(services) => {
                    for service in services.iter().filter(|s| !excluded(exclude_cidrs, s.key.ip)) {
                        if let Err(error) = ipvs.delete_service(&service.key) {
                            errors.push(error.to_string());
                        }
                    }
                }
                Err(error) => errors.push(error.to_string()),
            }
        }
        if let Err(error) = link::delete_link(DUMMY_INTERFACE) {
            errors.push(format!("cannot delete {DUMMY_INTERFACE}: {error}"));
        }
        match Tools::detect(None) {
            Ok(tools) => {
                for family in Family::ALL {
                    let result = tools.save(family).and_then(|saved| {
                        let input = rules::cleanup_input(&saved);
                        if !input.is_empty() {
                            tools.restore(family, &input)?;
                        }
                        Ok(())
                    });
                    if let Err(error) = result {
                        errors.push(format!("{error:#}"));
                    }
                }
            }
            Err(error) => errors.push(format!("{error:#}")),
        }
        let names: Vec<String> = ipset::all_sets().into_iter().map(|(name, _, _)| name).collect();
        if let Err(error) = IpsetTool.destroy(&names) {
            errors.push(format!("{error:#}"));
        }
        if !errors.is_empty() {
            bail!("IPVS cleanup incomplete: {}", errors.join("; "));
        }
        Ok(())
    }

    /// Removes what an IPVS-mode vipr left behind, when vipr starts in another mode:
    /// everything [`Self::cleanup`] removes, but only when the dummy interface is there (the
    /// IPVS mode always creates it: without it there is nothing to clean, and no ipset or
    /// IPVS call is made) and kube-proxy's canary chain is not (kube-proxy's IPVS mode uses
    /// the same interface, sets and chains; they are left to it, or to `vipr --cleanup`).
    pub fn cleanup_leftovers(exclude_cidrs: &[IpNet]) -> anyhow::Result<()> {
        if link::index(DUMMY_INTERFACE).is_none() {
            return Ok(());
        }
        let tools = Tools::detect(None).ok();
        let kube_proxy = Family::ALL.into_iter().any(|family| {
            tools.as_ref().and_then(|tools| tools.save(family).ok()).is_some_and(|saved| {
                saved.lines().any(|line| {
                    line.strip_prefix(':').and_then(|line| line.split_whitespace().next())
                        == Some(super::iptables::restore::KUBE_PROXY_CANARY)
                })
            })
        });
        if kube_proxy {
            info!("{DUMMY_INTERFACE} and the IPVS services are kube-proxy's (KUBE-PROXY-CANARY): left alone");
            return Ok(());
        }
        info!("removing what an IPVS-mode vipr left behind");
        Self::cleanup(exclude_cidrs)
    }

    fn read_programmed(&mut self) -> anyhow::Result<BTreeMap<ServiceKey, Programmed>> {
        let mut programmed = BTreeMap::new();
        for service in self.ipvs.services()? {
            let destinations = self
                .ipvs
                .destinations(&service.key)?
                .into_iter()
                .map(|destination| {
                    (Backend { ip: destination.ip, port: destination.port }, destination.weight)
                })
                .collect();
            programmed.insert(service.key, Programmed { settings: service.settings, destinations });
        }
        Ok(programmed)
    }

    fn sync_sets(&mut self, plan: &Plan) -> anyhow::Result<bool> {
        let sets = ipset::all_sets();
        let current = match self.sets.take() {
            Some(current) => current,
            None => ipset::parse_save(&self.ipset.save()?, &sets),
        };
        let input = ipset::restore_input(&sets, &current, &plan.sets);
        if input.is_empty() {
            self.sets = Some(current);
            return Ok(false);
        }
        debug!(lines = input.lines().count(), "ipset restore");
        self.ipset.restore(&input)?;
        self.sets = Some(plan.sets.clone());
        Ok(true)
    }

    fn sync_rules(&mut self, plan: &Plan, state: &DesiredState) -> anyhow::Result<()> {
        for inputs in &plan.rules {
            let family = inputs.family;
            let text = rules::restore_input(inputs);
            if self.rules_applied.get(&family) == Some(&text) {
                continue;
            }
            let tools = &self.iptables;
            let applied = tools.save(family).and_then(|saved| {
                let jumps = rules::missing_jumps(&saved);
                // Chains first (the jumps need them), then the jumps.
                tools.restore(family, &text)?;
                if !jumps.is_empty() {
                    tools.restore(family, &jumps)?;
                }
                Ok(())
            });
            match applied {
                Ok(()) => {
                    self.rules_applied.insert(family, text);
                    self.rules_unavailable.remove(&family);
                }
                Err(error) => {
                    let needed = state.frontends.keys().any(|frontend| Family::of(frontend.ip) == family);
                    if needed {
                        return Err(error);
                    }
                    if self.rules_unavailable.insert(family) {
                        warn!("no {family:?} rules (no {family:?} frontend needs them yet): {error:#}");
                    }
                }
            }
        }
        Ok(())
    }

    /// Deletes the UDP conntrack entries that lead to real servers the virtual services no
    /// longer have (or that bypassed a service that had none), as the iptables dataplane
    /// does: IPVS forwards through conntrack (`vs/conntrack`), and a UDP client that keeps
    /// sending would otherwise stay on the removed endpoint. Services whose programming
    /// failed keep their previous state, to be cleaned once they are programmed.
    fn delete_stale_conntrack(&mut self, plan: &Plan, failed: &BTreeSet<ServiceKey>) {
        let address = |key: &ServiceKey| std::net::SocketAddr::new(key.ip, key.port);
        let failed: BTreeSet<std::net::SocketAddr> = failed.iter().map(address).collect();
        let mut after: UdpFrontends = plan
            .services
            .iter()
            .filter(|(key, _)| key.protocol == Protocol::Udp && !failed.contains(&address(key)))
            .map(|(key, service)| {
                let endpoints =
                    service.backends.iter().map(|b| std::net::SocketAddr::new(b.ip, b.port)).collect();
                (address(key), endpoints)
            })
            .collect();
        let before = std::mem::take(&mut self.udp_applied);
        after.extend(
            before.iter().filter(|(frontend, _)| failed.contains(*frontend)).map(|(f, e)| (*f, e.clone())),
        );
        let keep = conntrack::stale_udp(&before, &after);
        self.udp_applied = after;
        if keep.is_empty() {
            return;
        }
        match conntrack::delete_stale_udp(&keep) {
            Ok(deleted) if deleted > 0 => debug!(deleted, "deleted stale UDP conntrack entries"),
            Ok(_) => {}
            Err(error) => warn!("cannot delete stale UDP conntrack entries: {error}"),
        }
    }

    fn bound_addresses() -> anyhow::Result<BTreeSet<IpAddr>> {
        Ok(crate::host::interface_addresses()
            .context("cannot list interface addresses")?
            .into_iter()
            .filter(|address| address.interface == DUMMY_INTERFACE)
            .map(|address| address.ip)
            .collect())
    }

    /// Programs one virtual service and its real servers; returns whether anything changed.
    fn sync_service(
        &mut self,
        key: &ServiceKey,
        settings: &ServiceSettings,
        backends: &BTreeSet<Backend>,
        listed: &BTreeSet<Backend>,
        programmed: &mut BTreeMap<ServiceKey, Programmed>,
    ) -> anyhow::Result<bool> {
        let mut changed = false;
        let server = client::VirtualServer { key: *key, settings: settings.clone() };
        match programmed.get_mut(key) {
            None => {
                self.ipvs.add_service(&server)?;
                programmed
                    .insert(*key, Programmed { settings: settings.clone(), destinations: BTreeMap::new() });
                changed = true;
            }
            Some(current) if current.settings != *settings => {
                self.ipvs.update_service(&server)?;
                current.settings = settings.clone();
                changed = true;
            }
            Some(_) => {}
        }
        let current = programmed.get_mut(key).expect("just ensured");
        for backend in backends {
            let destination = Destination::new(backend.ip, backend.port, ACTIVE_WEIGHT);
            match current.destinations.get(backend) {
                None => {
                    self.ipvs.add_destination(key, &destination)?;
                    changed = true;
                }
                Some(weight) if *weight != ACTIVE_WEIGHT => {
                    // Back from termination (or left at weight 0 by an earlier run).
                    self.ipvs.update_destination(key, &destination)?;
                    changed = true;
                }
                Some(_) => {}
            }
            current.destinations.insert(*backend, ACTIVE_WEIGHT);
            self.terminating.remove(&(*key, *backend));
        }
        let leaving: Vec<(Backend, u32)> = current
            .destinations
            .iter()
            .filter(|(backend, _)| !backends.contains(backend))
            .map(|(backend, weight)| (*backend, *weight))
            .collect();
        for (backend, weight) in leaving {
            let destination = Destination::new(backend.ip, backend.port, 0);
            if key.protocol == Protocol::Tcp && listed.contains(&backend) {
                // Graceful termination of an endpoint still listed (terminating): no new
                // connections, the running ones go on.
                if weight != 0 {
                    self.ipvs.update_destination(key, &destination)?;
                    current.destinations.insert(backend, 0);
                    changed = true;
                }
                self.terminating.insert((*key, backend));
            } else {
                // Connectionless, or an endpoint no slice lists any more: nothing to drain
                // (expire_nodest_conn ends its connections at their next packet).
                self.ipvs.delete_destination(key, &destination)?;
                current.destinations.remove(&backend);
                self.terminating.remove(&(*key, backend));
                changed = true;
            }
        }
        Ok(changed)
    }

    /// Deletes terminating real servers that IPVS tracks no connection to any more.
    fn reap_terminating(&mut self, programmed: &mut BTreeMap<ServiceKey, Programmed>) -> anyhow::Result<()> {
        let services: BTreeSet<ServiceKey> = self.terminating.iter().map(|(key, _)| *key).collect();
        for key in services {
            let Some(current) = programmed.get_mut(&key) else {
                self.terminating.retain(|(terminating, _)| *terminating != key);
                continue;
            };
            let destinations = self.ipvs.destinations(&key)?;
            let waiting: Vec<Backend> =
                self.terminating.iter().filter(|(k, _)| *k == key).map(|(_, backend)| *backend).collect();
            for backend in waiting {
                let found = destinations.iter().find(|d| d.ip == backend.ip && d.port == backend.port);
                match found {
                    Some(destination)
                        if destination.active_connections + destination.inactive_connections > 0 => {}
                    Some(destination) => {
                        debug!(service = %key, real_server = %backend, "removing drained real server");
                        self.ipvs.delete_destination(&key, destination)?;
                        current.destinations.remove(&backend);
                        self.terminating.remove(&(key, backend));
                    }
                    None => {
                        current.destinations.remove(&backend);
                        self.terminating.remove(&(key, backend));
                    }
                }
            }
        }
        Ok(())
    }

    fn excluded(&self, ip: IpAddr) -> bool {
        excluded(&self.options.exclude_cidrs, ip)
    }
}

fn excluded(exclude_cidrs: &[IpNet], ip: IpAddr) -> bool {
    exclude_cidrs.iter().any(|cidr| cidr.contains(&ip))
}

/// The sysctls kube-proxy's IPVS mode sets (in this network namespace).
fn set_sysctls(strict_arp: bool) -> anyhow::Result<()> {
    let set = |key: &str, value: &str| -> anyhow::Result<()> {
        let path = Path::new("/proc/sys").join(key);
        let current =
            std::fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
        if current.trim() != value {
            std::fs::write(&path, value)
                .with_context(|| format!("cannot set {} to {value}", path.display()))?;
            info!("set {} to {value}", key.replace('/', "."));
        }
        Ok(())
    };
    // Connections IPVS forwards go through conntrack, so that MASQUERADE applies to them.
    set("net/ipv4/vs/conntrack", "1")?;
    // A connection to a deleted real server ends at its next packet instead of hanging.
    set("net/ipv4/vs/expire_nodest_conn", "1")?;
    set("net/ipv4/vs/expire_quiescent_template", "1")?;
    set("net/ipv4/ip_forward", "1")?;
    if strict_arp {
        set("net/ipv4/conf/all/arp_ignore", "1")?;
        set("net/ipv4/conf/all/arp_announce", "2")?;
    }
    Ok(())
}

impl Dataplane for IpvsDataplane {
    fn mode(&self) -> Mode {
        Mode::Ipvs
    }

    fn collectors(&self) -> Vec<std::sync::Arc<dyn Collector>> {
        Vec::new()
    }

    fn device_server(&mut self) -> Option<&mut dyn ServesDevices> {
        None
    }

    /// Compares the whole state each time: the plan diffs it against the kernel's virtual
    /// servers, which it lists anyway.
    fn sync_changes(&mut self, state: &DesiredState, _changes: &StateChanges) -> anyhow::Result<SyncReport> {
        let plan = plan::plan(
            state,
            &PlanSettings {
                scheduler: self.options.scheduler.clone(),
                masquerade_all: self.options.masquerade_all,
            },
        );
        let mut report = SyncReport { unsupported: plan.unsupported.clone(), ..SyncReport::default() };
        let dummy = link::ensure_dummy(DUMMY_INTERFACE)
            .with_context(|| format!("cannot create the dummy interface {DUMMY_INTERFACE}"))?;

        // Sets before the rules that match them, addresses before the services they carry.
        if let Err(error) = self.sync_sets(&plan) {
            self.sets = None;
            return Err(error.context("cannot program the ipsets"));
        }
        let bound = Self::bound_addresses()?;
        for ip in plan.bound.difference(&bound) {
            self.binder.add(dummy, *ip).with_context(|| format!("cannot bind {ip} to {DUMMY_INTERFACE}"))?;
        }

        let mut programmed = match self.programmed.take() {
            Some(programmed) => programmed,
            None => self.read_programmed()?,
        };
        let mut failed = false;
        let mut failed_keys = BTreeSet::new();
        for (key, service) in &plan.services {
            match self.sync_service(
                key,
                &service.settings,
                &service.backends,
                &state.listed_endpoints,
                &mut programmed,
            ) {
                Ok(true) => report.changed += 1,
                Ok(false) => {}
                Err(error) => {
                    warn!("{error:#}");
                    report.failed.push(service.frontend.clone());
                    failed_keys.insert(*key);
                    failed = true;
                }
            }
        }
        let stale: Vec<ServiceKey> = programmed
            .keys()
            .filter(|key| !plan.services.contains_key(key) && !self.excluded(key.ip))
            .copied()
            .collect();
        for key in stale {
            match self.ipvs.delete_service(&key) {
                Ok(()) => {
                    programmed.remove(&key);
                    self.terminating.retain(|(terminating, _)| *terminating != key);
                    report.changed += 1;
                }
                Err(error) if error.errno() == Some(libc::ESRCH) => {
                    programmed.remove(&key);
                }
                Err(error) => {
                    warn!("{error:#}");
                    report.failed.push(key.to_string());
                    failed_keys.insert(key);
                    failed = true;
                }
            }
        }
        self.delete_stale_conntrack(&plan, &failed_keys);
        if let Err(error) = self.reap_terminating(&mut programmed) {
            warn!("graceful termination: {error:#}");
            failed = true;
        }
        // After a failure the mirror may be wrong: read the kernel again next time.
        self.programmed = (!failed).then_some(programmed);

        if let Err(error) = self.sync_rules(&plan, state) {
            return Err(error.context("cannot program the iptables rules"));
        }
        for ip in bound.difference(&plan.bound) {
            self.binder
                .remove(dummy, *ip)
                .with_context(|| format!("cannot unbind {ip} from {DUMMY_INTERFACE}"))?;
        }
        Ok(report)
    }
}
