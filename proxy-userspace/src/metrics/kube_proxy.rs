//! Values of kube-proxy's metrics that are read off the desired state.
use std::collections::{BTreeMap, BTreeSet, HashMap};

use super::ip_family;
use crate::model::{
    DesiredState, Frontend, FrontendEntry, FrontendKind, ServicePortName, StateChanges, Treatment, WhenEmpty,
};

/// A `(traffic_policy, ip_family)` series of [`no_local_endpoints`].
type Series = (&'static str, &'static str);

/// `kubeproxy_sync_proxy_rules_no_local_endpoints_total`: service ports whose Local traffic
/// policy leaves a frontend without a backend, by `(traffic_policy, ip_family)`. The model
/// marks exactly those treatments as `Drop` with no backend ("endpoints exist, none this
/// policy allows from here"): `internal` is a cluster IP's treatment of pods
/// (`internalTrafficPolicy: Local`), `external` an external frontend's treatment of outside
/// clients (`externalTrafficPolicy: Local`). A service port with no endpoint at all is
/// rejected rather than dropped and is not counted.
pub fn no_local_endpoints(state: &DesiredState) -> BTreeMap<Series, u64> {
    let mut services: BTreeMap<Series, BTreeSet<&ServicePortName>> = BTreeMap::new();
    for (frontend, entry) in &state.frontends {
        if let Some(series) = no_local_endpoint_series(frontend, entry) {
            services.entry(series).or_default().insert(&entry.service);
        }
    }
    services.into_iter().map(|(key, services)| (key, services.len() as u64)).collect()
}

/// The series a frontend without a local endpoint for its Local policy counts in, if it is one.
fn no_local_endpoint_series(frontend: &Frontend, entry: &FrontendEntry) -> Option<Series> {
    let dropped =
        |treatment: &Treatment| treatment.backends.is_empty() && treatment.when_empty == WhenEmpty::Drop;
    let policy = match entry.kind {
        FrontendKind::ClusterIp if dropped(&entry.from_pod) => "internal",
        FrontendKind::ExternalIp | FrontendKind::LoadBalancer | FrontendKind::NodePort
            if dropped(&entry.from_outside) =>
        {
            "external"
        }
        _ => return None,
    };
    Some((policy, ip_family(frontend.ip)))
}

/// [`no_local_endpoints`] kept up to date from each translation's changes, so that a sync
/// recounts only the frontends it changed rather than every frontend of the state.
#[derive(Debug, Default)]
pub struct NoLocalEndpoints {
    /// The frontends counted, with their series and service port.
    counted: HashMap<Frontend, (Series, ServicePortName)>,
    /// Per series, the service ports counted and how many of their frontends are.
    services: BTreeMap<Series, HashMap<ServicePortName, usize>>,
}

impl NoLocalEndpoints {
    /// Follows `state`, which `changes` led to from the state of the previous call (everything
    /// is counted again when the changes say that anything may have changed).
    pub fn update(&mut self, state: &DesiredState, changes: &StateChanges) {
        if changes.since.is_none() {
            *self = Self::default();
            for (frontend, entry) in &state.frontends {
                self.count(frontend, entry);
            }
            return;
        }
        for frontend in &changes.frontends {
            self.uncount(frontend);
            if let Some(entry) = state.frontends.get(frontend) {
                self.count(frontend, entry);
            }
        }
    }

    /// Service ports by series, as [`no_local_endpoints`] of the state last followed.
    pub fn counts(&self) -> BTreeMap<Series, u64> {
        self.services
            .iter()
            .filter(|(_, services)| !services.is_empty())
            .map(|(series, services)| (*series, services.len() as u64))
            .collect()
    }

    fn count(&mut self, frontend: &Frontend, entry: &FrontendEntry) {
        let Some(series) = no_local_endpoint_series(frontend, entry) else { return };
        *self.services.entry(series).or_default().entry(entry.service.clone()).or_default() += 1;
        self.counted.insert(*frontend, (series, entry.service.clone()));
    }

    fn uncount(&mut self, frontend: &Frontend) {
        let Some((series, service)) = self.counted.remove(frontend) else { return };
        let Some(services) = self.services.get_mut(&series) else { return };
        if let Some(frontends) = services.get_mut(&service) {
            *frontends -= 1;
            if *frontends == 0 {
                services.remove(&service);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::{net::IpAddr, sync::Arc};

    use super::*;
    use crate::model::{Backend, Frontend, FrontendEntry, Protocol};

    fn treatment(backends: &[Backend], when_empty: WhenEmpty) -> Treatment {
        Treatment { backends: Arc::from(backends), when_empty, masquerade: false }
    }

    /// A frontend of service `name` whose pods and outside clients are treated as given.
    fn frontend(
        state: &mut DesiredState,
        name: &str,
        ip: &str,
        kind: FrontendKind,
        pods: Treatment,
        outside: Treatment,
    ) {
        let service = ServicePortName {
            namespace: "default".into(),
            name: name.into(),
            port: "http".into(),
            protocol: Protocol::Tcp,
        };
        let entry = FrontendEntry {
            service,
            kind,
            from_pod: pods,
            from_node: outside.clone(),
            from_outside: outside,
            allowed_sources: Vec::new(),
            affinity: None,
        };
        let ip: IpAddr = ip.parse().unwrap();
        state.frontends.insert(Frontend { ip, port: 80, protocol: Protocol::Tcp }, entry);
    }

    #[test]
    fn local_policies_without_a_local_endpoint_are_counted_per_family() {
        let backend = Backend { ip: "10.1.0.5".parse().unwrap(), port: 8080 };
        let some = || treatment(&[backend], WhenEmpty::Reject);
        let dropped = || treatment(&[], WhenEmpty::Drop);
        let rejected = || treatment(&[], WhenEmpty::Reject);
        let mut state = DesiredState::default();
        // internalTrafficPolicy: Local, no local endpoint: counted once per family.
        frontend(&mut state, "itp", "10.96.0.1", FrontendKind::ClusterIp, dropped(), some());
        frontend(&mut state, "itp", "fd00::1", FrontendKind::ClusterIp, dropped(), some());
        // externalTrafficPolicy: Local, no local endpoint: its NodePort and load balancer
        // frontends are one service port.
        frontend(&mut state, "etp", "192.168.1.10", FrontendKind::NodePort, some(), dropped());
        frontend(&mut state, "etp", "203.0.113.7", FrontendKind::LoadBalancer, some(), dropped());
        // Served, or without any endpoint: not counted.
        frontend(&mut state, "ok", "10.96.0.2", FrontendKind::ClusterIp, some(), some());
        frontend(&mut state, "none", "10.96.0.3", FrontendKind::ClusterIp, rejected(), rejected());
        frontend(&mut state, "none", "192.168.1.10", FrontendKind::NodePort, rejected(), rejected());
        let counts = no_local_endpoints(&state);
        assert_eq!(
            counts,
            BTreeMap::from([(("external", "IPv4"), 1), (("internal", "IPv4"), 1), (("internal", "IPv6"), 1)])
        );
    }

    /// The changes from `before` to `after`: every frontend whose entry differs.
    fn changes(before: &DesiredState, after: &DesiredState, since: u64) -> StateChanges {
        let frontends = before
            .frontends
            .keys()
            .chain(after.frontends.keys())
            .filter(|frontend| before.frontends.get(frontend) != after.frontends.get(frontend))
            .copied()
            .collect();
        StateChanges { since: Some(since), generation: since + 1, frontends, ..StateChanges::default() }
    }

    #[test]
    fn the_counts_follow_the_changed_frontends_alone() {
        let backend = Backend { ip: "10.1.0.5".parse().unwrap(), port: 8080 };
        let some = || treatment(&[backend], WhenEmpty::Reject);
        let dropped = || treatment(&[], WhenEmpty::Drop);
        let mut state = DesiredState::default();
        frontend(&mut state, "itp", "10.96.0.1", FrontendKind::ClusterIp, dropped(), some());
        frontend(&mut state, "etp", "192.168.1.10", FrontendKind::NodePort, some(), dropped());
        frontend(&mut state, "etp", "203.0.113.7", FrontendKind::LoadBalancer, some(), dropped());
        frontend(&mut state, "ok", "10.96.0.2", FrontendKind::ClusterIp, some(), some());
        let mut counter = NoLocalEndpoints::default();
        counter.update(&state, &StateChanges::everything(1));
        assert_eq!(counter.counts(), no_local_endpoints(&state));

        type Step<'a> = Box<dyn Fn(&mut DesiredState) + 'a>;
        let mut steps: Vec<Step<'_>> = Vec::new();
        // The internal-policy service gets a local endpoint: no longer counted.
        steps.push(Box::new(move |state| {
            frontend(state, "itp", "10.96.0.1", FrontendKind::ClusterIp, some(), some())
        }));
        // One of the two frontends of the external-policy service is served: the service
        // port still counts once, through the other.
        steps.push(Box::new(move |state| {
            frontend(state, "etp", "203.0.113.7", FrontendKind::LoadBalancer, some(), some())
        }));
        // Its other frontend goes away: the service port is no longer counted.
        steps.push(Box::new(|state| {
            let ip: IpAddr = "192.168.1.10".parse().unwrap();
            state.frontends.remove(&Frontend { ip, port: 80, protocol: Protocol::Tcp });
        }));
        // A served service loses its local endpoint, and an IPv6 one appears without one.
        steps.push(Box::new(move |state| {
            frontend(state, "ok", "10.96.0.2", FrontendKind::ClusterIp, dropped(), some());
            frontend(state, "v6", "fd00::2", FrontendKind::ClusterIp, dropped(), dropped());
        }));
        for (generation, step) in (1..).zip(steps) {
            let before = state.clone();
            step(&mut state);
            counter.update(&state, &changes(&before, &state, generation));
            assert_eq!(counter.counts(), no_local_endpoints(&state), "after step {generation}");
        }
        assert_eq!(counter.counts(), BTreeMap::from([(("internal", "IPv4"), 1), (("internal", "IPv6"), 1)]));
        // Anything may have changed: everything is counted again.
        let mut emptied = DesiredState::default();
        frontend(&mut emptied, "etp", "203.0.113.8", FrontendKind::LoadBalancer, some(), dropped());
        counter.update(&emptied, &StateChanges::everything(9));
        assert_eq!(counter.counts(), BTreeMap::from([(("external", "IPv4"), 1)]));
    }
}
