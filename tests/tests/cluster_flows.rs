//! kube-proxy's NodePort and LoadBalancer flow cases (TestNodePorts, TestLoadBalancer,
//! TestExternalTrafficPolicyLocal/Cluster, TestInternalExternalMasquerade in
//! tests/conformance/kube-proxy-flows) played through the multi-node lab in every
//! `--lb-mode`, with the backends on other nodes than the one the traffic enters, which is
//! where the modes differ.
//!
//! kube-proxy's outcomes hold in every mode: which backend answers, what is dropped
//! (loadBalancerSourceRanges, eTP:Local without a local endpoint), and that a pod's traffic
//! to a load-balancer IP is balanced on its own node and masqueraded there (DSR is for
//! traffic from outside only). What the backend sees as the client of external traffic with
//! eTP:Cluster is the one thing the mode decides: with `snat` the ingress node's address (the
//! reply must come back through it), with `dsr` the client's own (the reply goes straight to
//! it), with `hybrid` the client's for TCP and the node's for UDP. A backend on the ingress
//! node itself is masqueraded in every mode, as kube-proxy does.
use std::{
    io,
    net::{Ipv4Addr, SocketAddr, UdpSocket},
};

use anyhow::Result;
use serde_json::json;
use testbed::{
    cluster::{
        node_ip, node_port_service, pod_gateway, udp_answer, ClusterLab, ASK, CLIENT_IP, CLUSTER_CIDR,
        POD_PORT, TARGET_PORTS, TIMEOUT,
    },
    tcp_exchange, wait_for, Answer, Check,
};

/// The load-balancer and external IPs, routed by the router to n1 as an external load balancer
/// or the network would.
const LB_OPEN: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 10);
const LB_CLOSED: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 11);
const EXTERNAL_IP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 20);

#[derive(Clone, Copy, Debug)]
enum LbMode {
    Snat,
    Dsr,
    Hybrid,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Transport {
    Tcp,
    Udp,
}

impl LbMode {
    fn flag(self) -> &'static str {
        match self {
            LbMode::Snat => "--lb-mode=snat",
            LbMode::Dsr => "--lb-mode=dsr",
            LbMode::Hybrid => "--lb-mode=hybrid",
        }
    }

    /// Whom a backend on another node than the ingress node `ingress` sees as the client of
    /// external eTP:Cluster traffic.
    fn seen_from_outside(self, transport: Transport, ingress: usize) -> Ipv4Addr {
        let direct = match self {
            LbMode::Snat => false,
            LbMode::Dsr => true,
            LbMode::Hybrid => transport == Transport::Tcp,
        };
        if direct {
            CLIENT_IP
        } else {
            node_ip(ingress)
        }
    }
}

/// Where a flow starts.
#[derive(Clone, Copy, Debug)]
enum From {
    Client,
    /// Pod 0 of node n1.
    Pod,
}

#[derive(Debug)]
enum Outcome {
    /// Answered by `backend`, which saw `seen` as the client.
    Served { backend: &'static str, seen: Ipv4Addr },
    /// Silence: no answer and no refusal.
    Dropped,
}

struct Flow {
    what: &'static str,
    from: From,
    to: SocketAddr,
    transport: Transport,
    outcome: Outcome,
}

/// The lab's Services, kube-proxy's cases in small:
/// - `np` (NodePort 30090, eTP:Cluster), its endpoint on n2;
/// - `np-local` (NodePort 30091, eTP:Local), its endpoint on n2;
/// - `lb-open` (LoadBalancer [`LB_OPEN`], NodePort 30092, source ranges with the client and
///   the pods in them: the ranges apply to pods' traffic too) and `lb-closed` ([`LB_CLOSED`], NodePort 30093, source ranges without it), their
///   endpoints on n3;
/// - `ext` (ClusterIP with the external IP [`EXTERNAL_IP`]), its endpoint on n2.
fn apply_services(lab: &ClusterLab) -> Result<()> {
    lab.apply_service(node_port_service("np", "10.96.1.10", 30090, json!({})), TARGET_PORTS, &[(2, 0)])?;
    lab.apply_service(
        node_port_service("np-local", "10.96.1.11", 30091, json!({"externalTrafficPolicy": "Local"})),
        TARGET_PORTS,
        &[(2, 0)],
    )?;
    for (name, cluster_ip, node_port, ingress, ranges) in [
        ("lb-open", "10.96.1.12", 30092, LB_OPEN, &["203.0.113.0/25", CLUSTER_CIDR][..]),
        ("lb-closed", "10.96.1.13", 30093, LB_CLOSED, &["198.18.0.0/15"][..]),
    ] {
        let mut service = node_port_service(
            name,
            cluster_ip,
            node_port,
            json!({"type": "LoadBalancer", "loadBalancerSourceRanges": ranges}),
        );
        service["status"] = json!({"loadBalancer": {"ingress": [{"ip": ingress.to_string()}]}});
        lab.apply_service(service, TARGET_PORTS, &[(3, 0)])?;
    }
    let mut external =
        node_port_service("ext", "10.96.1.14", 30094, json!({"externalIPs": [EXTERNAL_IP.to_string()]}));
    external["spec"]["type"] = json!("ClusterIP");
    for port in external["spec"]["ports"].as_array_mut().into_iter().flatten() {
        port.as_object_mut().map(|port| port.remove("nodePort"));
    }
    lab.apply_service(external, TARGET_PORTS, &[(2, 0)])?;
    lab.router.ip(&["route", "add", "198.51.100.0/24", "via", &node_ip(1).to_string()])?;
    Ok(())
}

fn flows(mode: LbMode) -> Vec<Flow> {
    use Transport::{Tcp, Udp};
    let node = |index, port| ClusterLab::node_address(index, port);
    let at = |ip: Ipv4Addr| SocketAddr::from((ip, 80));
    let mut flows = Vec::new();
    for transport in [Tcp, Udp] {
        let from_outside = mode.seen_from_outside(transport, 1);
        flows.extend([
            Flow {
                what: "NodePort, eTP:Cluster, backend on another node",
                from: From::Client,
                to: node(1, 30090),
                transport,
                outcome: Outcome::Served { backend: "n2-pod0", seen: from_outside },
            },
            Flow {
                what: "NodePort, eTP:Cluster, backend on the ingress node (masqueraded)",
                from: From::Client,
                to: node(2, 30090),
                transport,
                // MASQUERADE's address: the node's on the pod's link.
                outcome: Outcome::Served { backend: "n2-pod0", seen: pod_gateway(2) },
            },
            Flow {
                what: "NodePort, eTP:Local, on the node with the endpoint (the client kept)",
                from: From::Client,
                to: node(2, 30091),
                transport,
                outcome: Outcome::Served { backend: "n2-pod0", seen: CLIENT_IP },
            },
            Flow {
                what: "load-balancer IP, client inside the source ranges",
                from: From::Client,
                to: at(LB_OPEN),
                transport,
                outcome: Outcome::Served { backend: "n3-pod0", seen: from_outside },
            },
            Flow {
                what: "external IP",
                from: From::Client,
                to: at(EXTERNAL_IP),
                transport,
                outcome: Outcome::Served { backend: "n2-pod0", seen: from_outside },
            },
            Flow {
                what: "the source ranges do not guard the NodePort",
                from: From::Client,
                to: node(1, 30093),
                transport,
                outcome: Outcome::Served { backend: "n3-pod0", seen: from_outside },
            },
            Flow {
                what: "load-balancer IP from a pod (short-circuited, masqueraded as eTP:Cluster's are)",
                from: From::Pod,
                to: at(LB_OPEN),
                transport,
                outcome: Outcome::Served { backend: "n3-pod0", seen: node_ip(1) },
            },
        ]);
    }
    // Drops last: every Service was in vipr's first sync, so once the flows above are served
    // the drops are vipr's, not a datapath still empty.
    flows.extend([
        Flow {
            what: "NodePort, eTP:Local, on a node without a local endpoint",
            from: From::Client,
            to: node(1, 30091),
            transport: Tcp,
            outcome: Outcome::Dropped,
        },
        Flow {
            what: "load-balancer IP, client outside the source ranges",
            from: From::Client,
            to: at(LB_CLOSED),
            transport: Tcp,
            outcome: Outcome::Dropped,
        },
    ]);
    flows
}

/// One question along `flow`.
fn ask(lab: &ClusterLab, flow: &Flow) -> Result<Answer> {
    let netns = match flow.from {
        From::Client => &lab.client,
        From::Pod => &lab.nodes[0].pods[0].netns,
    };
    netns.run(|| match flow.transport {
        Transport::Tcp => Ok(tcp_exchange(flow.to, ASK)?.answer),
        Transport::Udp => {
            let socket = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))?;
            socket.set_read_timeout(Some(ASK))?;
            udp_answer(&socket, flow.to)
        }
    })
}

/// Whether `error` is a question that went unanswered, neither refused nor unreachable.
fn unanswered(error: &anyhow::Error) -> bool {
    error
        .chain()
        .filter_map(|cause| cause.downcast_ref::<io::Error>())
        .any(|error| matches!(error.kind(), io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock))
}

/// `flow`'s outcome, once it is the expected one, or what it was at the deadline.
fn check(lab: &ClusterLab, flow: &Flow) -> Result<()> {
    let label = format!("{:?} {} ({:?} -> {})", flow.transport, flow.what, flow.from, flow.to);
    wait_for(&label, TIMEOUT, || {
        let outcome = ask(lab, flow);
        Ok(match (&flow.outcome, outcome) {
            (Outcome::Served { backend, seen }, Ok(answer))
                if answer.backend == *backend && answer.observed_client.ip() == *seen =>
            {
                Check::Done(())
            }
            (Outcome::Dropped, Err(error)) if unanswered(&error) => Check::Done(()),
            (_, Ok(answer)) => Check::NotYet(format!("answered: {answer}")),
            (_, Err(error)) => Check::NotYet(format!("{error:#}")),
        })
    })
}

fn flow_cases(label: &str, mode: LbMode, extra_args: &[&str]) -> Result<()> {
    let mut lab = ClusterLab::new(label, 3, 1, &[POD_PORT])?;
    apply_services(&lab)?;
    lab.start_vipr(&[&[mode.flag()], extra_args].concat())?;
    let failures: Vec<String> = flows(mode)
        .iter()
        .filter_map(|flow| check(&lab, flow).err())
        .map(|error| format!("{error:#}"))
        .collect();
    let result = if failures.is_empty() {
        Ok(())
    } else {
        Err(anyhow::anyhow!("{mode:?}: {} flows failed:\n{}", failures.len(), failures.join("\n")))
    };
    lab.with_logs(result)
}

#[test]
fn kube_proxy_node_port_and_load_balancer_flows_hold_with_snat() -> Result<()> {
    flow_cases("cf-snat", LbMode::Snat, &[])
}

#[test]
fn kube_proxy_node_port_and_load_balancer_flows_hold_with_dsr() -> Result<()> {
    flow_cases("cf-dsr", LbMode::Dsr, &[])
}

#[test]
fn kube_proxy_node_port_and_load_balancer_flows_hold_with_hybrid_dsr() -> Result<()> {
    flow_cases("cf-hyb", LbMode::Hybrid, &[])
}

/// The same with the forwarded packets redirected past the stack (`bpf_redirect_neigh`), where
/// the datapath routes them itself.
#[test]
fn kube_proxy_node_port_and_load_balancer_flows_hold_with_dsr_and_redirected_forwarding() -> Result<()> {
    flow_cases("cf-dsrr", LbMode::Dsr, &["--bpf-forwarding=redirect"])
}
