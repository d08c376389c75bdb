//! Whether each Service's entries fit the maps: a Service that does not fit is refused as a
//! whole (none of its entries are written) instead of failing the sync of every other one.
//!
//! Pure, so the accounting is unit-tested without a kernel. The count is taken from the
//! desired state the way [`super::encode`] turns it into entries, and errs on the side of
//! too many (a backend list shared by two service ports is counted twice): a Service admitted
//! here always fits. Services the maps held before are admitted first, so a new object can
//! never push out one that serves already; the others go in name order.
use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    net::IpAddr,
    sync::Arc,
};

use super::{
    family::{Family, V4, V6},
    options::{has_carried_entry, Balancing, Modes},
};
use crate::model::{
    kubernetes::Rejection, Backend, DesiredState, Frontend, FrontendEntry, FrontendKind, ServicePortName,
};

/// The maps a Service's entries go to, per family.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum MapKind {
    Services,
    Backends,
    Members,
    SourceRanges,
    Unmatched,
}

const KINDS: [MapKind; 5] =
    [MapKind::Services, MapKind::Backends, MapKind::Members, MapKind::SourceRanges, MapKind::Unmatched];

/// Entries per family (IPv4, IPv6) and map.
pub type Entries = [[u64; 5]; 2];

fn family_index(ip: IpAddr) -> usize {
    usize::from(ip.is_ipv6())
}

/// The maps' names and capacities (their `max_entries` as the kernel has them).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Capacity {
    pub names: [[&'static str; 5]; 2],
    pub limits: Entries,
}

impl Capacity {
    pub fn new(limits: Entries) -> Self {
        let names = [V4::MAPS, V6::MAPS]
            .map(|maps| [maps.services, maps.backends, maps.members, maps.source_ranges, maps.unmatched]);
        Self { names, limits }
    }

    /// The name of a map, for a refusal's reason.
    pub fn name(&self, family: usize, kind: MapKind) -> &'static str {
        self.names[family][kind as usize]
    }
}

/// Services refused, by `namespace/name`, with the reason; and the cluster IPs that only
/// refused Services claim (their `unmatched` entries are not written either).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Refused {
    pub services: BTreeMap<String, String>,
    pub cluster_ips: BTreeSet<IpAddr>,
}

impl Refused {
    pub fn contains(&self, service: &ServicePortName) -> bool {
        !self.services.is_empty() && self.services.contains_key(&service_name(service))
    }

    /// The reports, `Service namespace/name: reason`, as the model names rejected objects.
    pub fn reports(&self) -> impl Iterator<Item = Rejection> + '_ {
        self.services.iter().map(|(name, reason)| refusal(name, reason))
    }
}

/// The refusal of the Service `name` (`namespace/name`), as the model words a rejection.
pub fn refusal(name: &str, reason: &str) -> Rejection {
    Rejection { object: format!("Service {name}"), reason: reason.to_owned() }
}

pub fn service_name(service: &ServicePortName) -> String {
    format!("{}/{}", service.namespace, service.name)
}

/// What each Service needs, and what the maps hold whatever the Services (service ranges,
/// cluster IPs of Services without ports).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Needs {
    /// By `namespace/name`, one name shared by the tracker's maps.
    pub services: BTreeMap<Arc<str>, Entries>,
    /// The sum of `services`, kept with it, so that a fit check need not add them up.
    pub services_total: Entries,
    pub fixed: Entries,
    /// The cluster IPs each Service's frontends claim.
    /// (Nearly always one: a set per Service would be a tree node of room for eleven.)
    pub cluster_ips: BTreeMap<Arc<str>, Box<[IpAddr]>>,
}

/// Counts the entries [`super::encode::encode`] would write for each Service of `state`.
pub fn needs(state: &DesiredState, modes: Modes) -> Needs {
    let mut tracker = NeedsTracker::default();
    tracker.rebuild(state, modes);
    tracker.needs
}

/// [`needs`] kept up to date change by change: a Service is counted again only when one of
/// its frontends changed, so that the fit check of a sync costs what changed, not the whole
/// state (one endpoint change at 10k Services took 28 ms when every Service was counted).
#[derive(Debug, Default)]
pub struct NeedsTracker {
    needs: Needs,
    /// Each Service's frontends (`namespace/name` → frontends, sorted), and the other way
    /// round. A vector: a Service has a few frontends, and a set of them would be a tree node
    /// of room for eleven (~250 bytes a Service).
    frontends: BTreeMap<Arc<str>, Vec<Frontend>>,
    service_of: HashMap<Frontend, Arc<str>>,
    /// How many Services claim each cluster IP (an unclaimed one counts in `fixed`).
    claimed: HashMap<IpAddr, usize>,
    /// By family: the state's cluster IPs, and how many of them are claimed; counted whole
    /// only when the cluster IPs change, so that `fixed` follows a Service's change alone.
    cluster_ips: [u64; 2],
    claimed_cluster_ips: [u64; 2],
}

impl NeedsTracker {
    pub fn needs(&self) -> &Needs {
        &self.needs
    }

    /// Counts every Service of `state`.
    pub fn rebuild(&mut self, state: &DesiredState, modes: Modes) {
        *self = Self::default();
        for (frontend, entry) in &state.frontends {
            self.add_frontend(*frontend, &service_name(&entry.service));
        }
        let names: Vec<Arc<str>> = self.frontends.keys().cloned().collect();
        for name in &names {
            self.recount(state, name, modes);
        }
        self.count_cluster_ips(state);
        self.count_fixed(state);
    }

    /// Counts again the Services whose frontends are among `changed` (added, changed or
    /// removed since the state this tracker last saw); `classifiers`: the state's cluster IPs
    /// or service ranges may have changed too.
    pub fn update(
        &mut self,
        state: &DesiredState,
        changed: &BTreeSet<Frontend>,
        classifiers: bool,
        modes: Modes,
    ) {
        let mut dirty = BTreeSet::new();
        for frontend in changed {
            if let Some(before) = self.service_of.remove(frontend) {
                if let Some(frontends) = self.frontends.get_mut(&before) {
                    frontends.retain(|other| other != frontend);
                }
                dirty.insert(before);
            }
            if let Some(entry) = state.frontends.get(frontend) {
                dirty.insert(self.add_frontend(*frontend, &service_name(&entry.service)));
            }
        }
        for name in &dirty {
            self.recount(state, name, modes);
        }
        if classifiers {
            self.count_cluster_ips(state);
        }
        self.count_fixed(state);
    }

    /// Files `frontend` under the Service `name`; returns the name as the tracker holds it.
    fn add_frontend(&mut self, frontend: Frontend, name: &str) -> Arc<str> {
        let name = match self.frontends.get_key_value(name) {
            Some((held, _)) => held.clone(),
            None => Arc::from(name),
        };
        let frontends = self.frontends.entry(name.clone()).or_default();
        if let Err(position) = frontends.binary_search(&frontend) {
            frontends.insert(position, frontend);
        }
        self.service_of.insert(frontend, name.clone());
        name
    }

    fn recount(&mut self, state: &DesiredState, name: &Arc<str>, modes: Modes) {
        for ip in self.needs.cluster_ips.remove(name).into_iter().flatten() {
            if let Some(count) = self.claimed.get_mut(&ip) {
                *count -= 1;
                if *count == 0 {
                    self.claimed.remove(&ip);
                    // Saturating: when the cluster IPs changed too, they are counted again after.
                    if state.cluster_ips.contains(&ip) {
                        let claimed = &mut self.claimed_cluster_ips[family_index(ip)];
                        *claimed = claimed.saturating_sub(1);
                    }
                }
            }
        }
        if let Some(before) = self.needs.services.remove(name) {
            add_entries(&mut self.needs.services_total, &before, |total, need| total - need);
        }
        let Some(frontends) = self.frontends.get(name).filter(|frontends| !frontends.is_empty()) else {
            self.frontends.remove(name);
            return;
        };
        let (entries, cluster_ips) = service_needs(
            frontends.iter().filter_map(|frontend| state.frontends.get_key_value(frontend)),
            modes,
        );
        add_entries(&mut self.needs.services_total, &entries, |total, need| total + need);
        self.needs.services.insert(name.clone(), entries);
        if !cluster_ips.is_empty() {
            for ip in &cluster_ips {
                let count = self.claimed.entry(*ip).or_default();
                *count += 1;
                if *count == 1 && state.cluster_ips.contains(ip) {
                    self.claimed_cluster_ips[family_index(*ip)] += 1;
                }
            }
            self.needs.cluster_ips.insert(name.clone(), cluster_ips.into_iter().collect());
        }
    }

    /// The state's cluster IPs by family, and how many of them Services claim.
    fn count_cluster_ips(&mut self, state: &DesiredState) {
        (self.cluster_ips, self.claimed_cluster_ips) = ([0; 2], [0; 2]);
        for ip in &state.cluster_ips {
            self.cluster_ips[family_index(*ip)] += 1;
            if self.claimed.contains_key(ip) {
                self.claimed_cluster_ips[family_index(*ip)] += 1;
            }
        }
    }

    /// What the maps hold whatever the Services: service ranges, unclaimed cluster IPs.
    fn count_fixed(&mut self, state: &DesiredState) {
        let mut fixed = Entries::default();
        for net in &state.service_cidrs {
            fixed[family_index(net.addr())][MapKind::Unmatched as usize] += 1;
        }
        for ((family, listed), claimed) in
            fixed.iter_mut().zip(self.cluster_ips).zip(self.claimed_cluster_ips)
        {
            family[MapKind::Unmatched as usize] += listed.saturating_sub(claimed);
        }
        self.needs.fixed = fixed;
    }
}

/// `total` with each of `entries` folded in by `fold`.
fn add_entries(total: &mut Entries, entries: &Entries, fold: impl Fn(u64, u64) -> u64) {
    for (total, entry) in total.as_flattened_mut().iter_mut().zip(entries.as_flattened()) {
        *total = fold(*total, *entry);
    }
}

/// The entries one Service's `frontends` need, and the cluster IPs they claim.
fn service_needs<'a>(
    frontends: impl Iterator<Item = (&'a Frontend, &'a FrontendEntry)>,
    modes: Modes,
) -> (Entries, BTreeSet<IpAddr>) {
    let mut needs = Entries::default();
    let mut cluster_ips = BTreeSet::new();
    // Encoded once per service port and family: the source classes' and frontends' lists.
    let mut lists: BTreeSet<(&ServicePortName, usize, &[Backend])> = BTreeSet::new();
    let mut ranges: BTreeSet<(&ServicePortName, usize, &ipnet::IpNet)> = BTreeSet::new();
    // A NodePort's carried-address entry is one for all its node addresses (see encode).
    let mut node_ports_carried: BTreeSet<(usize, u16, u8)> = BTreeSet::new();
    for (frontend, entry) in frontends {
        let family = family_index(frontend.ip);
        let entries = &mut needs[family];
        // A loopback frontend has the node's class only (see encode).
        entries[MapKind::Services as usize] += if frontend.ip.is_loopback() { 1 } else { 3 };
        if has_carried_entry(frontend, entry, modes.carriers_taken)
            && (entry.kind != FrontendKind::NodePort
                || node_ports_carried.insert((family, frontend.port, frontend.protocol.number())))
        {
            entries[MapKind::Services as usize] += 1;
        }
        for treatment in [&entry.from_outside, &entry.from_pod, &entry.from_node] {
            if !lists.insert((&entry.service, family, &treatment.backends)) {
                continue;
            }
            let count =
                treatment.backends.iter().filter(|backend| family_index(backend.ip) == family).count() as u64;
            if count == 0 {
                continue;
            }
            entries[MapKind::Backends as usize] += match modes.balancing {
                Balancing::Maglev { table_size } => u64::from(table_size),
                Balancing::Random => count,
            };
            entries[MapKind::Members as usize] += count;
        }
        for range in &entry.allowed_sources {
            if family_index(range.addr()) == family && ranges.insert((&entry.service, family, range)) {
                entries[MapKind::SourceRanges as usize] += 1;
            }
        }
        if entry.kind == FrontendKind::ClusterIp && cluster_ips.insert(frontend.ip) {
            entries[MapKind::Unmatched as usize] += 1;
        }
    }
    (needs, cluster_ips)
}

/// Admits Services while they fit, those in `programmed` first, and refuses the others.
/// `programmed` is asked for only when not everything fits.
pub fn admit(needs: &Needs, capacity: &Capacity, programmed: impl FnOnce() -> BTreeSet<String>) -> Refused {
    let mut total = needs.fixed;
    add_entries(&mut total, &needs.services_total, |total, need| total + need);
    let limits = capacity.limits.as_flattened();
    if total.as_flattened().iter().zip(limits).all(|(total, limit)| total <= limit) {
        return Refused::default();
    }
    let programmed = &programmed();
    let mut used = needs.fixed;
    let mut refused = Refused::default();
    let first = needs.services.iter().filter(|(name, _)| programmed.contains(&***name));
    let then = needs.services.iter().filter(|(name, _)| !programmed.contains(&***name));
    for (name, need) in first.chain(then) {
        match overflow(&used, need, capacity) {
            None => {
                for (used, need) in used.as_flattened_mut().iter_mut().zip(need.as_flattened()) {
                    *used += need;
                }
            }
            Some(reason) => {
                refused.services.insert(name.to_string(), reason);
            }
        }
    }
    // A cluster IP shared with an admitted Service (a duplicate the model let through) stays.
    let admitted: BTreeSet<&IpAddr> = needs
        .cluster_ips
        .iter()
        .filter(|(name, _)| !refused.services.contains_key(&***name))
        .flat_map(|(_, ips)| ips)
        .collect();
    refused.cluster_ips = refused
        .services
        .keys()
        .filter_map(|name| needs.cluster_ips.get(name.as_str()))
        .flatten()
        .filter(|ip| !admitted.contains(ip))
        .copied()
        .collect();
    refused
}

/// The first map `need` does not fit in beside `used`, as a refusal's reason.
fn overflow(used: &Entries, need: &Entries, capacity: &Capacity) -> Option<String> {
    for family in 0..2 {
        for kind in KINDS {
            let (used, need, limit) = (
                used[family][kind as usize],
                need[family][kind as usize],
                capacity.limits[family][kind as usize],
            );
            if used + need > limit {
                return Some(format!(
                    "does not fit the eBPF maps: needs {need} entries of {}, {} free (capacity {limit}); \
                     not programmed until it fits",
                    capacity.name(family, kind),
                    limit.saturating_sub(used),
                ));
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::model::{Frontend, FrontendEntry, Protocol, Treatment, WhenEmpty};

    fn treatment(backends: &[Backend]) -> Treatment {
        Treatment { backends: backends.into(), when_empty: WhenEmpty::Reject, masquerade: false }
    }

    fn backend(last: u8) -> Backend {
        Backend { ip: IpAddr::from([10, 1, 0, last]), port: 8080 }
    }

    /// A Service `ns/name` with `ports` ports on `ips`, the same backends for every class.
    fn add(state: &mut DesiredState, name: &str, ips: &[IpAddr], ports: u16, backends: &[Backend]) {
        for port in 1..=ports {
            for (i, ip) in ips.iter().enumerate() {
                let entry = FrontendEntry {
                    service: ServicePortName {
                        namespace: "ns".into(),
                        name: name.into(),
                        port: format!("p{port}"),
                        protocol: Protocol::Tcp,
                    },
                    kind: if i == 0 { FrontendKind::ClusterIp } else { FrontendKind::ExternalIp },
                    from_pod: treatment(backends),
                    from_node: treatment(backends),
                    from_outside: treatment(backends),
                    allowed_sources: Vec::new(),
                    affinity: None::<Duration>,
                };
                state.frontends.insert(Frontend { ip: *ip, port, protocol: Protocol::Tcp }, entry);
            }
        }
        state.cluster_ips.insert(ips[0]);
    }

    fn capacity(services: u64, backends: u64, ranges: u64) -> Capacity {
        let family = [services, backends, backends, ranges, 100];
        Capacity::new([family, family])
    }

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([10, 96, 0, last])
    }

    /// The tracker, told only what changed, counts what a count of the whole state counts:
    /// Services added, resized, moved between frontends and removed, and a cluster IP that
    /// stays claimed by another Service after one lets it go.
    #[test]
    fn the_tracker_updated_change_by_change_counts_as_a_recount() {
        let mut state = DesiredState::default();
        add(&mut state, "web", &[ip(1), ip(2)], 2, &[backend(1), backend(2)]);
        add(&mut state, "api", &[ip(3)], 1, &[backend(3)]);
        let mut tracker = NeedsTracker::default();
        tracker.rebuild(&state, Modes::snat(Balancing::Random));
        assert_eq!(tracker.needs(), &needs(&state, Modes::snat(Balancing::Random)));

        let steps: [&dyn Fn(&mut DesiredState); 7] = [
            // More backends for web, a new Service dns.
            &|state| {
                add(state, "web", &[ip(1), ip(2)], 2, &[backend(1), backend(2), backend(4)]);
                add(state, "dns", &[ip(5)], 3, &[backend(5)]);
            },
            // api's frontend goes to dns (the same address, another Service).
            &|state| {
                state.frontends.retain(|_, entry| entry.service.name != "api");
                add(state, "dns", &[ip(3)], 1, &[backend(6)]);
            },
            // web loses its second port.
            &|state| {
                state
                    .frontends
                    .retain(|frontend, entry| !(entry.service.name == "web" && frontend.port == 2));
            },
            // Everything of dns goes.
            &|state| {
                state.frontends.retain(|_, entry| entry.service.name != "dns");
                state.cluster_ips.remove(&ip(5));
            },
            // A cluster IP no frontend claims (a Service without ports), then one claimed
            // and given up again while the cluster IPs stay as they are.
            &|state| {
                state.cluster_ips.insert(ip(7));
            },
            &|state| add(state, "late", &[ip(7)], 1, &[backend(7)]),
            &|state| state.frontends.retain(|_, entry| entry.service.name != "late"),
        ];
        for (index, step) in steps.iter().enumerate() {
            let (before, cluster_ips_before) = (state.frontends.clone(), state.cluster_ips.clone());
            step(&mut state);
            let changed: BTreeSet<Frontend> = before
                .keys()
                .chain(state.frontends.keys())
                .filter(|frontend| before.get(*frontend) != state.frontends.get(*frontend))
                .copied()
                .collect();
            let classifiers = state.cluster_ips != cluster_ips_before;
            tracker.update(&state, &changed, classifiers, Modes::snat(Balancing::Random));
            assert_eq!(tracker.needs(), &needs(&state, Modes::snat(Balancing::Random)), "after step {index}");
        }
    }

    #[test]
    fn everything_fits_without_asking_which_services_are_programmed() {
        let mut state = DesiredState::default();
        add(&mut state, "web", &[ip(1)], 1, &[backend(1)]);
        let refused = admit(&needs(&state, Modes::snat(Balancing::Random)), &capacity(100, 100, 100), || {
            panic!("asked for the programmed Services although everything fits")
        });
        assert_eq!(refused, Refused::default());
    }

    #[test]
    fn counts_entries_as_the_encoding_writes_them() {
        let mut state = DesiredState::default();
        add(&mut state, "web", &[ip(1), ip(2)], 2, &[backend(1), backend(2)]);
        let needs = needs(&state, Modes::snat(Balancing::Random));
        // 2 ports × 2 addresses × 3 classes; one list per port; one cluster IP.
        assert_eq!(needs.services["ns/web"][0], [12, 4, 4, 0, 1]);
        let maglev = super::needs(&state, Modes::snat(Balancing::Maglev { table_size: 251 }));
        assert_eq!(maglev.services["ns/web"][0][MapKind::Backends as usize], 2 * 251);
    }

    #[test]
    fn a_service_that_does_not_fit_is_refused_alone() {
        let mut state = DesiredState::default();
        add(&mut state, "canary", &[ip(1)], 1, &[backend(1)]);
        // 100 ports × 7 addresses: 2,100 services entries.
        let external: Vec<IpAddr> = (2..9).map(ip).collect();
        add(&mut state, "aaa-huge", &external, 100, &[backend(2)]);
        add(&mut state, "zzz-small", &[ip(20)], 2, &[backend(3)]);
        let refused =
            admit(&needs(&state, Modes::snat(Balancing::Random)), &capacity(1000, 1000, 100), BTreeSet::new);
        assert_eq!(refused.services.keys().collect::<Vec<_>>(), ["ns/aaa-huge"]);
        let reason = &refused.services["ns/aaa-huge"];
        assert!(reason.contains("needs 2100 entries of vipr_svc4_v2, 1000 free (capacity 1000)"), "{reason}");
        assert_eq!(refused.cluster_ips, BTreeSet::from([ip(2)]));
        assert_eq!(
            refused.reports().map(|refusal| refusal.to_string()).collect::<Vec<_>>(),
            [format!("Service ns/aaa-huge: {reason}")],
            "named as the model names rejected objects"
        );
    }

    #[test]
    fn services_programmed_before_keep_their_room() {
        let mut state = DesiredState::default();
        add(&mut state, "old", &[ip(1)], 1, &[backend(1), backend(2)]);
        add(&mut state, "aaa-new", &[ip(2)], 1, &[backend(3), backend(4)]);
        let needs = needs(&state, Modes::snat(Balancing::Random));
        let tight = capacity(100, 3, 100);
        assert_eq!(admit(&needs, &tight, BTreeSet::new).services.keys().collect::<Vec<_>>(), ["ns/old"]);
        let programmed = BTreeSet::from(["ns/old".to_string()]);
        assert_eq!(
            admit(&needs, &tight, || programmed.clone()).services.keys().collect::<Vec<_>>(),
            ["ns/aaa-new"]
        );
    }

    #[test]
    fn source_ranges_and_maglev_tables_are_counted() {
        let mut state = DesiredState::default();
        add(&mut state, "ranged", &[ip(1), ip(2)], 1, &[backend(1)]);
        let ranges: Vec<ipnet::IpNet> =
            (0..1000u32).map(|i| format!("192.{}.{}.0/24", i / 256, i % 256).parse().unwrap()).collect();
        for entry in state.frontends.values_mut() {
            entry.allowed_sources = ranges.clone();
        }
        let needs = needs(&state, Modes::snat(Balancing::Random));
        assert_eq!(needs.services["ns/ranged"][0][MapKind::SourceRanges as usize], 1000, "once per port");
        let refused = admit(&needs, &capacity(100, 100, 512), BTreeSet::new);
        assert!(refused.services["ns/ranged"].contains("of vipr_srcr4_v1"), "{refused:?}");

        let mut state = DesiredState::default();
        add(&mut state, "maglev", &[ip(1)], 10, &[backend(1)]);
        let needs = super::needs(&state, Modes::snat(Balancing::Maglev { table_size: 251 }));
        let refused = admit(&needs, &capacity(100, 2000, 100), BTreeSet::new);
        assert!(refused.services["ns/maglev"].contains("needs 2510 entries of vipr_back4_v2"), "{refused:?}");
        assert!(admit(&needs, &capacity(100, 2510, 100), BTreeSet::new).services.is_empty());
    }
}
