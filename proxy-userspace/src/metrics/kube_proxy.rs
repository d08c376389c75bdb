//! Values of kube-proxy's metrics that are read off the desired state.
use std::collections::{BTreeMap, BTreeSet};

use super::ip_family;
use crate::model::{DesiredState, FrontendKind, ServicePortName, Treatment, WhenEmpty};

/// `kubeproxy_sync_proxy_rules_no_local_endpoints_total`: service ports whose Local traffic
/// policy leaves a frontend without a backend, by `(traffic_policy, ip_family)`. The model
/// marks exactly those treatments as `Drop` with no backend ("endpoints exist, none this
/// policy allows from here"): `internal` is a cluster IP's treatment of pods
/// (`internalTrafficPolicy: Local`), `external` an external frontend's treatment of outside
/// clients (`externalTrafficPolicy: Local`). A service port with no endpoint at all is
/// rejected rather than dropped and is not counted.
pub fn no_local_endpoints(state: &DesiredState) -> BTreeMap<(&'static str, &'static str), u64> {
    let dropped =
        |treatment: &Treatment| treatment.backends.is_empty() && treatment.when_empty == WhenEmpty::Drop;
    let mut services: BTreeMap<(&'static str, &'static str), BTreeSet<&ServicePortName>> = BTreeMap::new();
    for (frontend, entry) in &state.frontends {
        let policy = match entry.kind {
            FrontendKind::ClusterIp if dropped(&entry.from_pod) => "internal",
            FrontendKind::ExternalIp | FrontendKind::LoadBalancer | FrontendKind::NodePort
                if dropped(&entry.from_outside) =>
            {
                "external"
            }
            _ => continue,
        };
        services.entry((policy, ip_family(frontend.ip))).or_default().insert(&entry.service);
    }
    services.into_iter().map(|(key, services)| (key, services.len() as u64)).collect()
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
}
