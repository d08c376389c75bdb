//! Several vipr nodes against one API server (issue 16's lab, `testbed::cluster`): a NodePort on
//! one node reaches a pod on another, an external load balancer sees eTP:Local's health checks
//! where the endpoints are, and with Maglev a flow reaches the same backend through any node.
use std::{
    collections::{BTreeMap, BTreeSet},
    net::{Ipv4Addr, SocketAddr, UdpSocket},
    time::Duration,
};

use anyhow::{bail, Context as _, Result};
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
    socket.send_to(b"who are you?", to)?;
    let mut buffer = [0u8; 512];
    loop {
        let (length, from) = socket.recv_from(&mut buffer).with_context(|| format!("no answer from {to}"))?;
        if from == to {
            let answer: Answer = std::str::from_utf8(&buffer[..length])?.trim().parse()?;
            return Ok(answer.backend);
        }
    }
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
