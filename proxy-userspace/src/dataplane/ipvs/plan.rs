//! The desired state as kube-proxy's IPVS mode would program it: one virtual service per
//! frontend with one set of real servers, the addresses to bind to the dummy interface, the
//! members of every ipset, and the inputs of the iptables rules. Pure, so it is unit-tested.
//!
//! IPVS gives a virtual service a single set of real servers for every client, where the
//! model has a treatment per source class. Where the classes differ, kube-proxy's IPVS
//! mode decides, and so does this (docs/conformance.md lists the consequences):
//! - the real servers are the outside clients' (for a Local external policy: the local
//!   endpoints, for pods and the node too: kube-proxy's IPVS mode has no short-circuit);
//! - masquerading is decided per frontend kind by the iptables rules, not per treatment: a
//!   Local external policy masquerades no source, a Cluster one every source; cluster IPs
//!   follow the detector (or `--masquerade-all`);
//! - a frontend with no real server gets no virtual service: its packets are rejected by a
//!   filter rule (kube-proxy keeps a virtual service without real servers, whose own ICMP
//!   answer does not reliably reach IPv6 clients), or dropped when the model drops the
//!   outside clients' traffic (endpoints only on other nodes under a Local policy), as every
//!   kube-proxy mode drops it.
use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use ipnet::IpNet;

use super::{
    client::{ServiceKey, ServiceSettings, SERVICE_PERSISTENT},
    ipset::{self, Entry, Family, SetContents, SetSpec},
    rules::{ClusterIpMasquerade, RestrictedLoadBalancer, RuleInputs},
};
use crate::dataplane::iptables::ruleset::interface_match;
use crate::model::{Backend, DesiredState, FrontendEntry, FrontendKind, Protocol, WhenEmpty};

/// Settings of the IPVS dataplane that shape the plan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlanSettings {
    pub scheduler: String,
    pub masquerade_all: bool,
}

/// One virtual service as it should be.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlannedService {
    pub settings: ServiceSettings,
    pub backends: BTreeSet<Backend>,
    /// The frontend it serves, for reports.
    pub frontend: String,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    pub services: BTreeMap<ServiceKey, PlannedService>,
    /// Addresses for the dummy interface.
    pub bound: BTreeSet<IpAddr>,
    /// Every set of both families (empty ones too).
    pub sets: SetContents,
    pub rules: Vec<RuleInputs>,
    /// Frontends left out, with the reason.
    pub unsupported: Vec<String>,
}

/// The real servers of a frontend of `family`, as kube-proxy's IPVS mode picks them: the
/// outside clients' endpoints (each of its per-family proxiers sees only endpoints of its
/// family). Under a Local external policy these are the local ones, for every client: the
/// other nodes' endpoints, which pods and the node would reach in the other modes, are no
/// real servers.
pub fn real_servers(entry: &FrontendEntry, family: Family) -> BTreeSet<Backend> {
    entry.from_outside.backends.iter().copied().filter(|backend| Family::of(backend.ip) == family).collect()
}

/// Whether the frontend follows a Local external policy (its outside clients keep their
/// address).
fn external_local(entry: &FrontendEntry) -> bool {
    entry.kind != FrontendKind::ClusterIp && !entry.from_outside.masquerade
}

/// Whether the frontend's traffic is dropped for want of a local endpoint (endpoints only on
/// other nodes under a Local policy): the outside clients', and with a single set of real
/// servers everyone's.
fn drops_for_want_of_local_endpoints(entry: &FrontendEntry, family: Family) -> bool {
    real_servers(entry, family).is_empty() && entry.from_outside.when_empty == WhenEmpty::Drop
}

pub fn plan(state: &DesiredState, settings: &PlanSettings) -> Plan {
    let mut plan = Plan {
        services: BTreeMap::new(),
        bound: BTreeSet::new(),
        sets: ipset::all_sets().into_iter().map(|(name, _, _)| (name, BTreeSet::new())).collect(),
        rules: Vec::new(),
        unsupported: Vec::new(),
    };
    let node_ips = &state.sources.node_ips;
    let mut restricted: BTreeMap<Family, BTreeSet<RestrictedLoadBalancer>> = BTreeMap::new();
    let mut add = |spec: &SetSpec, family: Family, entry: Entry| {
        plan.sets.entry(spec.name(family)).or_default().insert(entry);
    };

    for (frontend, entry) in &state.frontends {
        let family = Family::of(frontend.ip);
        let (ip, port, protocol) = (frontend.ip, frontend.port, frontend.protocol);
        let ip_port = Entry::IpPort(ip, protocol, port);
        let local = external_local(entry);
        match entry.kind {
            FrontendKind::ClusterIp => {
                add(&ipset::CLUSTER_IP, family, ip_port);
                plan.bound.insert(ip);
            }
            FrontendKind::ExternalIp => {
                add(if local { &ipset::EXTERNAL_IP_LOCAL } else { &ipset::EXTERNAL_IP }, family, ip_port);
                if !node_ips.contains(&ip) {
                    plan.bound.insert(ip);
                }
            }
            FrontendKind::LoadBalancer => {
                add(&ipset::LOAD_BALANCER, family, ip_port);
                if local {
                    add(&ipset::LOAD_BALANCER_LOCAL, family, ip_port);
                }
                if !entry.allowed_sources.is_empty() {
                    let allowed: Vec<IpNet> = entry
                        .allowed_sources
                        .iter()
                        .copied()
                        .filter(|range| Family::of(range.addr()) == family)
                        .map(|range| range.trunc())
                        .collect();
                    // ipset's net types cannot hold a /0: such a range admits everyone.
                    if !allowed.iter().any(|range| range.prefix_len() == 0) {
                        add(&ipset::LOAD_BALANCER_FW, family, ip_port);
                        for range in &allowed {
                            add(
                                &ipset::LOAD_BALANCER_SOURCE_CIDR,
                                family,
                                Entry::IpPortNet(ip, protocol, port, *range),
                            );
                        }
                        restricted.entry(family).or_default().insert(RestrictedLoadBalancer {
                            ip,
                            port,
                            protocol,
                            allowed,
                        });
                    }
                }
                if !node_ips.contains(&ip) {
                    plan.bound.insert(ip);
                }
            }
            FrontendKind::NodePort => match protocol {
                Protocol::Tcp | Protocol::Udp => {
                    let (all, local_set) = if protocol == Protocol::Tcp {
                        (&ipset::NODE_PORT_TCP, &ipset::NODE_PORT_LOCAL_TCP)
                    } else {
                        (&ipset::NODE_PORT_UDP, &ipset::NODE_PORT_LOCAL_UDP)
                    };
                    add(all, family, Entry::Port(port));
                    if local {
                        add(local_set, family, Entry::Port(port));
                    }
                }
                Protocol::Sctp => {
                    add(&ipset::NODE_PORT_SCTP, family, ip_port);
                    if local {
                        add(&ipset::NODE_PORT_LOCAL_SCTP, family, ip_port);
                    }
                }
            },
        }

        if drops_for_want_of_local_endpoints(entry, family) {
            add(&ipset::DROP_NO_LOCAL, family, ip_port);
            continue;
        }
        let backends = real_servers(entry, family);
        if backends.is_empty() {
            add(&ipset::REJECT_NO_ENDPOINTS, family, ip_port);
            continue;
        }
        // Hairpin: an endpoint reaching its own service is masqueraded, wherever it runs.
        for backend in entry.all_backends().into_iter().filter(|backend| Family::of(backend.ip) == family) {
            add(&ipset::LOOP_BACK, family, Entry::IpPortIp(backend.ip, protocol, backend.port, backend.ip));
        }
        let (flags, timeout) = match entry.affinity {
            Some(timeout) => {
                (SERVICE_PERSISTENT, u32::try_from(timeout.as_secs()).unwrap_or(u32::MAX).max(1))
            }
            None => (0, 0),
        };
        plan.services.insert(
            ServiceKey { ip, port, protocol },
            PlannedService {
                settings: ServiceSettings { scheduler: settings.scheduler.clone(), flags, timeout },
                backends,
                frontend: frontend.to_string(),
            },
        );
    }
    for (family, set) in [(Family::Ipv4, &ipset::IPVS_IPS), (Family::Ipv6, &ipset::IPVS_IPS)] {
        let members: Vec<Entry> =
            plan.bound.iter().copied().filter(|ip| Family::of(*ip) == family).map(Entry::Ip).collect();
        plan.sets.entry(set.name(family)).or_default().extend(members);
    }
    let cluster_ip_masquerade = if settings.masquerade_all {
        ClusterIpMasquerade::All
    } else if let Some(pods) = &state.sources.pod_interfaces {
        ClusterIpMasquerade::NotVia(interface_match(pods))
    } else if !state.sources.pod_cidrs.is_empty() {
        ClusterIpMasquerade::NotFrom(state.sources.pod_cidrs.clone())
    } else {
        ClusterIpMasquerade::FromServiceAddress
    };
    plan.rules = [Family::Ipv4, Family::Ipv6]
        .into_iter()
        .map(|family| RuleInputs {
            family,
            cluster_ip_masquerade: cluster_ip_masquerade.clone(),
            restricted_load_balancers: restricted.remove(&family).unwrap_or_default(),
            service_cidrs: state
                .service_cidrs
                .iter()
                .copied()
                .filter(|cidr| Family::of(cidr.addr()) == family)
                .collect(),
        })
        .collect();
    plan
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::model::{Frontend, PodInterfaces, ServicePortName, SourceClassifier, Treatment};

    fn backend(text: &str, port: u16) -> Backend {
        Backend { ip: text.parse().unwrap(), port }
    }

    fn treatment(backends: &[Backend], masquerade: bool, when_empty: WhenEmpty) -> Treatment {
        Treatment { backends: backends.to_vec().into(), when_empty, masquerade }
    }

    fn entry(kind: FrontendKind, pod: Treatment, node: Treatment, outside: Treatment) -> FrontendEntry {
        FrontendEntry {
            service: ServicePortName {
                namespace: "ns".into(),
                name: "svc".into(),
                port: "p".into(),
                protocol: Protocol::Tcp,
            },
            kind,
            from_pod: pod,
            from_node: node,
            from_outside: outside,
            allowed_sources: Vec::new(),
            affinity: None,
        }
    }

    fn frontend(ip: &str, port: u16, protocol: Protocol) -> Frontend {
        Frontend { ip: ip.parse().unwrap(), port, protocol }
    }

    fn settings() -> PlanSettings {
        PlanSettings { scheduler: "rr".into(), masquerade_all: false }
    }

    fn state(frontends: Vec<(Frontend, FrontendEntry)>) -> DesiredState {
        DesiredState {
            frontends: frontends.into_iter().collect(),
            sources: SourceClassifier {
                pod_cidrs: vec!["10.0.0.0/8".parse().unwrap()],
                node_ips: ["192.168.0.2".parse().unwrap()].into(),
                ..SourceClassifier::default()
            },
            ..DesiredState::default()
        }
    }

    #[test]
    fn a_cluster_ip_is_a_bound_virtual_service_with_its_endpoints() {
        let all = [backend("10.1.0.2", 8080), backend("10.1.0.3", 8080)];
        let same = treatment(&all, true, WhenEmpty::Reject);
        let mut cluster =
            entry(FrontendKind::ClusterIp, treatment(&all, false, WhenEmpty::Reject), same.clone(), same);
        cluster.affinity = Some(Duration::from_secs(10800));
        let plan = plan(&state(vec![(frontend("172.30.0.41", 80, Protocol::Tcp), cluster)]), &settings());
        let key = ServiceKey { ip: "172.30.0.41".parse().unwrap(), port: 80, protocol: Protocol::Tcp };
        let service = &plan.services[&key];
        assert_eq!(service.backends, all.into_iter().collect());
        assert_eq!(
            service.settings,
            ServiceSettings { scheduler: "rr".into(), flags: SERVICE_PERSISTENT, timeout: 10800 }
        );
        assert_eq!(plan.bound, ["172.30.0.41".parse::<IpAddr>().unwrap()].into());
        assert!(plan.sets["KUBE-CLUSTER-IP"].contains(&Entry::IpPort(key.ip, Protocol::Tcp, 80)));
        assert!(plan.sets["KUBE-IPVS-IPS"].contains(&Entry::Ip(key.ip)));
        assert!(plan.sets["KUBE-LOOP-BACK"].contains(&Entry::IpPortIp(
            all[0].ip,
            Protocol::Tcp,
            8080,
            all[0].ip
        )));
        assert_eq!(plan.sets["KUBE-6-CLUSTER-IP"].len(), 0);
        assert_eq!(
            plan.rules[0].cluster_ip_masquerade,
            ClusterIpMasquerade::NotFrom(vec!["10.0.0.0/8".parse().unwrap()])
        );
    }

    #[test]
    fn a_local_external_policy_uses_local_endpoints_and_drops_without_them() {
        let (local, remote) = (backend("10.180.0.1", 80), backend("10.180.1.1", 80));
        let with_local = entry(
            FrontendKind::NodePort,
            treatment(&[local, remote], false, WhenEmpty::Reject),
            treatment(&[local, remote], true, WhenEmpty::Reject),
            treatment(&[local], false, WhenEmpty::Reject),
        );
        let without_local = entry(
            FrontendKind::LoadBalancer,
            treatment(&[remote], false, WhenEmpty::Reject),
            treatment(&[remote], true, WhenEmpty::Reject),
            treatment(&[], false, WhenEmpty::Drop),
        );
        let plan = plan(
            &state(vec![
                (frontend("192.168.0.2", 3001, Protocol::Tcp), with_local),
                (frontend("5.6.7.8", 80, Protocol::Udp), without_local),
            ]),
            &settings(),
        );
        let node_port =
            ServiceKey { ip: "192.168.0.2".parse().unwrap(), port: 3001, protocol: Protocol::Tcp };
        assert_eq!(plan.services[&node_port].backends, [local].into());
        let balancer = ServiceKey { ip: "5.6.7.8".parse().unwrap(), port: 80, protocol: Protocol::Udp };
        assert!(!plan.services.contains_key(&balancer), "no local endpoint: no remote real servers either");
        assert_eq!(plan.sets["KUBE-IPVS-DROP"], [Entry::IpPort(balancer.ip, Protocol::Udp, 80)].into());
        assert_eq!(plan.sets["KUBE-NODE-PORT-TCP"], [Entry::Port(3001)].into());
        assert_eq!(plan.sets["KUBE-NODE-PORT-LOCAL-TCP"], [Entry::Port(3001)].into());
        assert!(plan.sets["KUBE-LOAD-BALANCER-LOCAL"].contains(&Entry::IpPort(
            balancer.ip,
            Protocol::Udp,
            80
        )));
        assert!(!plan.bound.contains(&node_port.ip), "node addresses are not bound");
        assert!(plan.bound.contains(&balancer.ip));
    }

    #[test]
    fn no_endpoint_anywhere_rejects_and_only_elsewhere_drops() {
        let reject = treatment(&[], false, WhenEmpty::Reject);
        let drop = treatment(&[], false, WhenEmpty::Drop);
        let plan = plan(
            &state(vec![
                (
                    frontend("172.30.0.1", 80, Protocol::Tcp),
                    entry(FrontendKind::ClusterIp, reject.clone(), reject.clone(), reject),
                ),
                (
                    frontend("172.30.0.2", 80, Protocol::Tcp),
                    entry(FrontendKind::ClusterIp, drop.clone(), drop.clone(), drop),
                ),
            ]),
            &settings(),
        );
        assert!(plan.services.is_empty(), "{:?}", plan.services);
        assert_eq!(
            plan.sets["KUBE-IPVS-REJECT"],
            [Entry::IpPort("172.30.0.1".parse().unwrap(), Protocol::Tcp, 80)].into()
        );
        assert_eq!(
            plan.sets["KUBE-IPVS-DROP"],
            [Entry::IpPort("172.30.0.2".parse().unwrap(), Protocol::Tcp, 80)].into()
        );
        assert!(plan.bound.contains(&"172.30.0.2".parse().unwrap()), "still bound: it is a cluster IP");
    }

    #[test]
    fn source_ranges_fill_the_firewall_sets() {
        let all = [backend("10.180.0.1", 80)];
        let masqueraded = treatment(&all, true, WhenEmpty::Reject);
        let mut balancer =
            entry(FrontendKind::LoadBalancer, masqueraded.clone(), masqueraded.clone(), masqueraded);
        balancer.allowed_sources = vec![
            "203.0.113.0/25".parse().unwrap(),
            "1.2.3.4/32".parse().unwrap(),
            "fd00::/64".parse().unwrap(),
        ];
        let plan = plan(&state(vec![(frontend("1.2.3.4", 80, Protocol::Tcp), balancer)]), &settings());
        let lb: IpAddr = "1.2.3.4".parse().unwrap();
        assert_eq!(plan.sets["KUBE-LOAD-BALANCER-FW"], [Entry::IpPort(lb, Protocol::Tcp, 80)].into());
        assert_eq!(
            plan.sets["KUBE-LOAD-BALANCER-SOURCE-CIDR"],
            [
                Entry::IpPortNet(lb, Protocol::Tcp, 80, "203.0.113.0/25".parse().unwrap()),
                Entry::IpPortNet(lb, Protocol::Tcp, 80, "1.2.3.4/32".parse().unwrap()),
            ]
            .into()
        );
        let restricted: Vec<_> = plan.rules[0].restricted_load_balancers.iter().collect();
        assert_eq!(restricted.len(), 1);
        assert_eq!(restricted[0].allowed.len(), 2, "only this family's ranges");
        assert!(plan.rules[1].restricted_load_balancers.is_empty());
    }

    #[test]
    fn each_family_s_frontends_get_that_family_s_endpoints() {
        let (v4, v6) = (backend("10.180.0.5", 80), backend("fd00:10:180::5", 80));
        let both = treatment(&[v4, v6], true, WhenEmpty::Reject);
        let plan = plan(
            &state(vec![
                (
                    frontend("172.30.0.50", 80, Protocol::Tcp),
                    entry(FrontendKind::ClusterIp, both.clone(), both.clone(), both.clone()),
                ),
                (
                    frontend("fd00:172:30::50", 80, Protocol::Tcp),
                    entry(FrontendKind::ClusterIp, both.clone(), both.clone(), both),
                ),
            ]),
            &settings(),
        );
        let backends: Vec<_> = plan.services.values().map(|service| service.backends.clone()).collect();
        assert_eq!(backends, [BTreeSet::from([v4]), BTreeSet::from([v6])]);
        assert_eq!(plan.sets["KUBE-LOOP-BACK"], [Entry::IpPortIp(v4.ip, Protocol::Tcp, 80, v4.ip)].into());
        assert_eq!(plan.sets["KUBE-6-LOOP-BACK"], [Entry::IpPortIp(v6.ip, Protocol::Tcp, 80, v6.ip)].into());
        assert!(plan.unsupported.is_empty());
    }

    #[test]
    fn masquerade_rules_follow_the_settings() {
        let mut no_detector = state(vec![]);
        no_detector.sources.pod_cidrs.clear();
        assert_eq!(
            plan(&no_detector, &settings()).rules[0].cluster_ip_masquerade,
            ClusterIpMasquerade::FromServiceAddress
        );
        let all = PlanSettings { masquerade_all: true, ..settings() };
        assert_eq!(plan(&no_detector, &all).rules[1].cluster_ip_masquerade, ClusterIpMasquerade::All);

        let mut by_interface = no_detector.clone();
        by_interface.sources.pod_interfaces = Some(PodInterfaces::NamePrefix("veth".into()));
        for family in 0..2 {
            assert_eq!(
                plan(&by_interface, &settings()).rules[family].cluster_ip_masquerade,
                ClusterIpMasquerade::NotVia("veth+".into())
            );
        }
        by_interface.sources.pod_interfaces = Some(PodInterfaces::Bridge("cbr0".into()));
        assert_eq!(
            plan(&by_interface, &settings()).rules[0].cluster_ip_masquerade,
            ClusterIpMasquerade::NotVia("cbr0".into())
        );
        assert_eq!(plan(&by_interface, &all).rules[0].cluster_ip_masquerade, ClusterIpMasquerade::All);
    }
}
