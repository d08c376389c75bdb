//! Several vipr nodes against one API server (issue 16's lab, `testbed::cluster`): a NodePort on
//! one node reaches a pod on another, an external load balancer sees eTP:Local's health checks
//! where the endpoints are, and with Maglev a flow reaches the same backend through any node.
use std::{
    collections::{BTreeMap, BTreeSet},
    net::{Ipv4Addr, SocketAddr, UdpSocket},
    time::Duration,
};

use anyhow::{bail, ensure, Context as _, Result};
use serde_json::json;
use testbed::{
    cluster::{ClusterLab, CLIENT_IP},
    http, tcp_exchange, wait_for, Answer, Check,
};

const TIMEOUT: Duration = Duration::from_secs(30);
const ASK: Duration = Duration::from_secs(1);
const POD_PORT: u16 = 8080;

fn node_port_service(
    name: &str,
    cluster_ip: &str,
    node_port: u16,
    extra: serde_json::Value,
) -> serde_json::Value {
    let mut service = json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "type": "NodePort",
            "clusterIP": cluster_ip,
            "clusterIPs": [cluster_ip],
            "ports": [
                {"name": "tcp", "port": 80, "protocol": "TCP", "targetPort": POD_PORT, "nodePort": node_port},
                {"name": "udp", "port": 80, "protocol": "UDP", "targetPort": POD_PORT, "nodePort": node_port},
            ],
        },
    });
    if let (Some(spec), Some(extra)) = (service["spec"].as_object_mut(), extra.as_object()) {
        spec.extend(extra.clone());
    }
    service
}

const TARGET_PORTS: &[(&str, u16, &str)] = &[("tcp", POD_PORT, "TCP"), ("udp", POD_PORT, "UDP")];

/// One TCP question from the external client to `to`, once vipr answers there.
fn ask_until_served(lab: &ClusterLab, to: SocketAddr) -> Result<Answer> {
    wait_for(&format!("an answer through {to}"), TIMEOUT, || {
        Ok(match lab.client.run(|| tcp_exchange(to, ASK)) {
            Ok(exchange) => Check::Done(exchange.answer),
            Err(error) => Check::NotYet(format!("{error:#}")),
        })
    })
}

#[test]
fn a_node_port_on_one_node_reaches_a_pod_on_another() -> Result<()> {
    let mut lab = ClusterLab::new("cl-np", 3, 1, &[POD_PORT])?;
    lab.apply_service(node_port_service("web", "10.96.0.10", 30080, json!({})), TARGET_PORTS, &[(2, 0)])?;
    lab.start_vipr(&[])?;
    for node in [1, 3] {
        let answer = ask_until_served(&lab, ClusterLab::node_address(node, 30080))?;
        assert_eq!(answer.backend, "n2-pod0", "through n{node}");
        // eTP: Cluster: the ingress node masquerades, so that the reply comes back through it.
        assert_eq!(answer.observed_client.ip(), testbed::cluster::node_ip(node), "through n{node}");
    }
    Ok(())
}

#[test]
fn an_external_load_balancer_sees_local_endpoints_through_the_health_check_node_port() -> Result<()> {
    const HEALTH_CHECK_PORT: u16 = 32000;
    let mut lab = ClusterLab::new("cl-hc", 3, 1, &[POD_PORT])?;
    let local = json!({"type": "LoadBalancer", "externalTrafficPolicy": "Local", "healthCheckNodePort": HEALTH_CHECK_PORT});
    lab.apply_service(node_port_service("shop", "10.96.0.20", 30081, local), TARGET_PORTS, &[(2, 0)])?;
    lab.start_vipr(&[])?;
    for node in 1..=3 {
        let address = ClusterLab::node_address(node, HEALTH_CHECK_PORT);
        let want = if node == 2 { 200 } else { 503 };
        let answer = wait_for(&format!("the health check of n{node}"), TIMEOUT, || {
            Ok(match http::get(&lab.client, address, "/healthz") {
                Ok(answer) if answer.status == want => Check::Done(answer),
                Ok(answer) => Check::NotYet(format!("{} {}", answer.status, answer.body)),
                Err(error) => Check::NotYet(format!("{error:#}")),
            })
        })?;
        if node == 2 {
            assert!(answer.body.contains("\"localEndpoints\": 1"), "{}", answer.body);
        }
    }
    // The node with the endpoint serves the NodePort and keeps the client's address.
    let answer = ask_until_served(&lab, ClusterLab::node_address(2, 30081))?;
    assert_eq!((answer.backend.as_str(), answer.observed_client.ip()), ("n2-pod0", CLIENT_IP.into()));
    Ok(())
}

/// The backend that answers a datagram from `socket` to `to`.
fn udp_backend(socket: &UdpSocket, to: SocketAddr) -> Result<String> {
    Ok(udp_answer(socket, to)?.backend)
}

/// The answer to a datagram from `socket` to `to`: only one that comes from `to` itself (the
/// service address) counts.
fn udp_answer(socket: &UdpSocket, to: SocketAddr) -> Result<Answer> {
    socket.send_to(b"who are you?", to)?;
    let mut buffer = [0u8; 512];
    loop {
        let (length, from) = socket.recv_from(&mut buffer).with_context(|| format!("no answer from {to}"))?;
        if from == to {
            return std::str::from_utf8(&buffer[..length])?.trim().parse();
        }
    }
}

/// One UDP question from the external client to `to`, once vipr answers there.
fn ask_udp_until_served(lab: &ClusterLab, to: SocketAddr) -> Result<Answer> {
    wait_for(&format!("a UDP answer through {to}"), TIMEOUT, || {
        let answer = lab.client.run(|| {
            let socket = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))?;
            socket.set_read_timeout(Some(ASK))?;
            udp_answer(&socket, to)
        });
        Ok(match answer {
            Ok(answer) => Check::Done(answer),
            Err(error) => Check::NotYet(format!("{error:#}")),
        })
    })
}

/// A sample of node `index`'s (from 1) `/metrics`, once it is at least `at_least` (the metrics
/// server may start after the datapath serves).
fn node_metric(lab: &ClusterLab, index: usize, sample: &str, at_least: f64) -> Result<f64> {
    wait_for(&format!("{sample} >= {at_least} on n{index}"), TIMEOUT, || {
        Ok(match http::get(&lab.nodes[index - 1].netns, "127.0.0.1:10249".parse()?, "/metrics") {
            Ok(metrics) => match metrics.metric(sample) {
                Some(value) if value >= at_least => Check::Done(value),
                value => Check::NotYet(format!("{value:?}")),
            },
            Err(error) => Check::NotYet(format!("{error:#}")),
        })
    })
}

/// Packets node `index`'s (from 1) uplink received.
fn uplink_rx_packets(lab: &ClusterLab, index: usize) -> Result<u64> {
    let shown: serde_json::Value =
        serde_json::from_str(&lab.nodes[index - 1].netns.ip(&["-s", "-j", "link", "show", "eth0"])?)?;
    shown[0]["stats64"]["rx"]["packets"].as_u64().context("no rx packet count for eth0")
}

#[test]
fn with_maglev_a_flow_reaches_the_same_backend_through_any_node() -> Result<()> {
    const NODE_PORT: u16 = 30082;
    let mut lab = ClusterLab::new("cl-mg", 3, 2, &[POD_PORT])?;
    let endpoints: Vec<(usize, usize)> = (1..=3).flat_map(|node| [(node, 0), (node, 1)]).collect();
    lab.apply_service(
        node_port_service("spread", "10.96.0.30", NODE_PORT, json!({})),
        TARGET_PORTS,
        &endpoints,
    )?;
    lab.start_vipr(&["--lb-algorithm=maglev"])?;
    for node in 1..=3 {
        ask_until_served(&lab, ClusterLab::node_address(node, NODE_PORT))?;
    }
    let chosen: BTreeMap<u16, Vec<String>> = lab.client.run(|| {
        let mut chosen = BTreeMap::new();
        for flow in 0..24u16 {
            let source_port = 40000 + flow;
            let socket = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, source_port))?;
            socket.set_read_timeout(Some(ASK))?;
            let backends = (1..=3)
                .map(|node| udp_backend(&socket, ClusterLab::node_address(node, NODE_PORT)))
                .collect::<Result<Vec<_>>>()?;
            chosen.insert(source_port, backends);
        }
        Ok(chosen)
    })?;
    for (source_port, backends) in &chosen {
        if backends.iter().collect::<BTreeSet<_>>().len() != 1 {
            bail!("the flow from port {source_port} reached {backends:?} through n1, n2, n3");
        }
    }
    let spread: BTreeSet<&String> = chosen.values().map(|backends| &backends[0]).collect();
    assert!(spread.len() >= 3, "24 flows reached only {spread:?}");
    Ok(())
}

const DSR_NODE_PORT: u16 = 30084;

/// A NodePort with its one endpoint on n2, vipr on every node with `lb_mode`.
fn dsr_lab(label: &str, lb_mode: &str) -> Result<ClusterLab> {
    let mut lab = ClusterLab::new(label, 3, 1, &[POD_PORT])?;
    lab.apply_service(
        node_port_service("direct", "10.96.0.40", DSR_NODE_PORT, json!({})),
        TARGET_PORTS,
        &[(2, 0)],
    )?;
    lab.start_vipr(&[lb_mode])?;
    Ok(lab)
}

#[test]
fn with_dsr_a_remote_backend_sees_the_client_and_replies_straight_to_it() -> Result<()> {
    let lab = dsr_lab("cl-dsr", "--lb-mode=dsr")?;
    with_vipr_logs(&lab, dsr_replies_straight(&lab))
}

/// `result`, with the end of every node's vipr log printed when it is an error.
fn with_vipr_logs<T>(lab: &ClusterLab, result: Result<T>) -> Result<T> {
    if result.is_err() {
        for node in &lab.nodes {
            let log = std::fs::read_to_string(lab.workdir().join(format!("vipr-{}.log", node.name)))
                .unwrap_or_default();
            let lines: Vec<&str> = log.lines().collect();
            eprintln!("--- vipr on {}:\n{}", node.name, lines[lines.len().saturating_sub(30)..].join("\n"));
        }
    }
    result
}

fn dsr_replies_straight(lab: &ClusterLab) -> Result<()> {
    let through = ClusterLab::node_address(1, DSR_NODE_PORT);
    // TCP: the connection to n1's address works only if the replies come from it.
    let answer = ask_until_served(lab, through)?;
    ensure!(answer.backend == "n2-pod0" && answer.observed_client.ip() == CLIENT_IP, "TCP: {answer}");
    // UDP: the answer counts only if it comes from n1's address and port.
    let answer = ask_udp_until_served(lab, through)?;
    ensure!(answer.backend == "n2-pod0" && answer.observed_client.ip() == CLIENT_IP, "UDP: {answer}");
    // n1 sent both connections by DSR, and n2 got their service address in the requests.
    node_metric(lab, 1, "vipr_datapath_dsr_total{event=\"connection_sent\"}", 2.0)?;
    node_metric(lab, 2, "vipr_datapath_dsr_total{event=\"connection_received\"}", 2.0)?;

    // The replies do not come back through n1: its uplink receives the requests only (with
    // SNAT it would receive each answer from n2 too). A little slack for the API server's
    // traffic to n1's vipr.
    const EXCHANGES: u64 = 40;
    let before = uplink_rx_packets(lab, 1)?;
    lab.client.run(|| {
        let socket = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))?;
        socket.set_read_timeout(Some(ASK))?;
        for _ in 0..EXCHANGES {
            udp_answer(&socket, through)?;
        }
        Ok(())
    })?;
    let received_by_n1 = uplink_rx_packets(lab, 1)? - before;
    ensure!(
        received_by_n1 < EXCHANGES + EXCHANGES / 2,
        "n1's uplink received {received_by_n1} packets for {EXCHANGES} exchanges: the replies came back through it"
    );
    Ok(())
}

#[test]
fn hybrid_dsr_is_direct_for_tcp_and_masqueraded_for_udp() -> Result<()> {
    let lab = dsr_lab("cl-hyb", "--lb-mode=hybrid")?;
    with_vipr_logs(&lab, hybrid_dsr(&lab))
}

fn hybrid_dsr(lab: &ClusterLab) -> Result<()> {
    let through = ClusterLab::node_address(1, DSR_NODE_PORT);
    let answer = ask_until_served(lab, through)?;
    ensure!(answer.backend == "n2-pod0" && answer.observed_client.ip() == CLIENT_IP, "TCP: {answer}");
    let answer = ask_udp_until_served(lab, through)?;
    ensure!(
        answer.backend == "n2-pod0" && answer.observed_client.ip() == testbed::cluster::node_ip(1),
        "UDP is masqueraded: {answer}"
    );
    node_metric(lab, 1, "vipr_datapath_dsr_total{event=\"connection_sent\"}", 1.0)?;
    Ok(())
}
