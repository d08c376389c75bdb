//! What vipr's desired state says about a flow, without a kernel: the model-level half of the
//! conformance suite (tests/tests/conformance_model.rs).

use std::{
    collections::{BTreeSet, HashSet},
    fmt,
    net::{IpAddr, SocketAddr},
};

use anyhow::Result;
use vipr::model::{
    kubernetes::{desired_state, NodeContext, Translation},
    DesiredState, Frontend, Protocol as ModelProtocol, WhenEmpty,
};

use super::{
    case::{self, parse_cidr, Flow, IpFamily, Node, Stage, Verdict},
    objects,
};

/// An outcome in the terms of a case's `expect`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Outcome {
    pub verdict: Verdict,
    /// The endpoints a DNAT may choose; empty for other verdicts.
    pub endpoints: BTreeSet<SocketAddr>,
    /// Only meaningful for DNAT; false otherwise.
    pub masquerade: bool,
}

impl Outcome {
    pub fn of(verdict: Verdict) -> Self {
        Self { verdict, endpoints: BTreeSet::new(), masquerade: false }
    }

    pub fn expected(expect: &case::Expect) -> Self {
        Self {
            verdict: expect.verdict,
            endpoints: expect.endpoints.iter().copied().collect(),
            masquerade: expect.verdict == Verdict::DNAT && expect.masquerade,
        }
    }
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.verdict)?;
        if self.verdict == Verdict::DNAT {
            let endpoints: Vec<String> = self.endpoints.iter().map(ToString::to_string).collect();
            write!(f, " [{}]", endpoints.join(", "))?;
            if self.masquerade {
                f.write_str(" masqueraded")?;
            }
        }
        Ok(())
    }
}

/// The node vipr would see when run by the conformance runner with this case's flags on its
/// topology (see `flags::vipr_args`):
/// - node IPs: the recorded node-local addresses but loopback;
/// - primary IPs: the primary node IP of each family (the recorded one for its family, else
///   the first address of that family on the node's uplink);
/// - NodePort addresses: with `--nodeport-addresses`, the node IPs inside a listed CIDR;
///   without it, vipr's default, kube-proxy nftables' default: the primary node IPs. Never
///   loopback (nftables semantics);
/// - the local-traffic detector only in mode ClusterCIDR.
pub fn node_context(node: &Node) -> Result<NodeContext> {
    let node_ips: BTreeSet<IpAddr> =
        node.node_local_addresses.iter().copied().filter(|ip| !ip.is_loopback()).collect();
    let primary_ips: Vec<IpAddr> =
        [IpFamily::Ipv4, IpFamily::Ipv6].into_iter().filter_map(|family| node.primary_ip(family)).collect();
    let node_port_ips = match &node.node_port_addresses {
        None => primary_ips.iter().copied().collect(),
        Some(cidrs) => {
            let cidrs = cidrs.iter().map(|cidr| parse_cidr(cidr)).collect::<Result<Vec<_>>>()?;
            node_ips.iter().copied().filter(|ip| cidrs.iter().any(|cidr| cidr.contains(ip))).collect()
        }
    };
    let service_cidrs =
        node.service_cidrs.iter().flatten().map(|cidr| parse_cidr(cidr)).collect::<Result<_>>()?;
    Ok(NodeContext {
        name: node.node_name.clone(),
        zone: None,
        cluster_cidrs: node.detector_cidrs()?,
        pod_interfaces: None,
        masquerade_all: node.masquerade_all,
        node_ips,
        primary_ips,
        node_port_ips,
        service_cidrs,
        // The cases' node runs no health or metrics server of vipr's on its addresses.
        own_ports: Default::default(),
        localhost_node_ports: localhost_node_ports(node),
    })
}

/// Whether vipr (ebpf mode) serves the case's NodePorts on 127.0.0.1, as kube-proxy's
/// iptables mode decides it: `--iptables-localhost-nodeports` (default true) and
/// `--nodeport-addresses` unset or covering 127.0.0.1.
fn localhost_node_ports(node: &Node) -> bool {
    let covers_loopback = |cidr: &String| {
        cidr.parse::<ipnet::IpNet>().is_ok_and(|net| net.contains(&IpAddr::V4(std::net::Ipv4Addr::LOCALHOST)))
    };
    node.localhost_node_ports.unwrap_or(true)
        && node.node_port_addresses.as_ref().is_none_or(|cidrs| cidrs.iter().any(covers_loopback))
}

/// vipr's desired state for one stage, from the very objects the runner writes.
pub fn translate(node: &Node, stage: &Stage) -> Result<Translation> {
    let (services, slices) = objects::objects(stage);
    Ok(desired_state(&services, &slices, &node_context(node)?))
}

fn model_protocol(protocol: case::Protocol) -> ModelProtocol {
    match protocol {
        case::Protocol::TCP => ModelProtocol::Tcp,
        case::Protocol::UDP => ModelProtocol::Udp,
        case::Protocol::SCTP => ModelProtocol::Sctp,
    }
}

/// What the desired state does with the first packet of `flow`:
/// - a frontend (destination, port, protocol) exists: a source outside its
///   `allowed_sources` is dropped; else the source's class picks the treatment: DNAT to its
///   backends, masqueraded if the treatment says so or if the source is itself one of the
///   backends (hairpin: masquerade is per backend, so the set is masqueraded if any branch
///   is, as upstream's tracer reports it); no backends: REJECT or DROP as the treatment says;
/// - no frontend: a cluster IP (other port or protocol) is REJECTed, an address in a
///   service CIDR is DROPped, anything else PASSes.
pub fn outcome(state: &DesiredState, flow: &Flow) -> Outcome {
    let source = flow.source_ip;
    let frontend =
        Frontend { ip: flow.dest_ip, port: flow.dest_port, protocol: model_protocol(flow.protocol) };
    let Some(entry) = state.frontends.get(&frontend) else {
        return Outcome::of(if state.cluster_ips.contains(&flow.dest_ip) {
            Verdict::REJECT
        } else if state.service_cidrs.iter().any(|cidr| cidr.contains(&flow.dest_ip)) {
            Verdict::DROP
        } else {
            Verdict::PASS
        });
    };
    if !entry.allowed_sources.is_empty() && !entry.allowed_sources.iter().any(|range| range.contains(&source))
    {
        return Outcome::of(Verdict::DROP);
    }
    let treatment = entry.treatment(state.sources.classify(source));
    if treatment.backends.is_empty() {
        return Outcome::of(match treatment.when_empty {
            WhenEmpty::Reject => Verdict::REJECT,
            WhenEmpty::Drop => Verdict::DROP,
        });
    }
    let backends: HashSet<IpAddr> = treatment.backends.iter().map(|backend| backend.ip).collect();
    Outcome {
        verdict: Verdict::DNAT,
        endpoints: treatment
            .backends
            .iter()
            .map(|backend| SocketAddr::new(backend.ip, backend.port))
            .collect(),
        masquerade: treatment.masquerade || backends.contains(&source),
    }
}
