//! Several vipr nodes against one API server (issue 16's lab, `testbed::cluster`): a NodePort on
//! one node reaches a pod on another, an external load balancer sees eTP:Local's health checks
//! where the endpoints are, and with Maglev a flow reaches the same backend through any node,
//! removing one of N backends moves about 1/N of the flows, and a node can go away; direct
//! server return in every forwarding mode, from XDP, hybrid, and path MTU discovery of its
//! replies.
use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, UdpSocket},
    ops::Range,
    time::Duration,
};

use anyhow::{bail, ensure, Context as _, Result};
use serde_json::json;
use testbed::{
    cluster::{
        node_ip, node_ip6, node_port_service, pod_ip, udp_answer, udp_socket_for, ClusterLab, ASK, CLIENT_IP,
        CLIENT_IP6, POD_PORT, TARGET_PORTS, TIMEOUT,
    },
    http, tcp_exchange, wait_for, Check, Frontend, Protocol, TcpSession,
};

#[test]
fn a_node_port_on_one_node_reaches_a_pod_on_another() -> Result<()> {
    let mut lab = ClusterLab::new("cl-np", 3, 1, &[POD_PORT])?;
    lab.apply_service(node_port_service("web", "10.96.0.10", 30080, json!({})), TARGET_PORTS, &[(2, 0)])?;
    lab.start_vipr(&[])?;
    for node in [1, 3] {
        let answer = lab.ask_tcp(ClusterLab::node_address(node, 30080))?;
        assert_eq!(answer.backend, "n2-pod0", "through n{node}");
        // eTP: Cluster: the ingress node masquerades, so that the reply comes back through it.
        assert_eq!(answer.observed_client.ip(), node_ip(node), "through n{node}");
    }
    Ok(())
}

/// The same over IPv6 in a dual-stack lab, TCP and UDP: the ingress node masquerades to its
/// own IPv6 address.
#[test]
fn an_ipv6_node_port_on_one_node_reaches_a_pod_on_another() -> Result<()> {
    let mut lab = ClusterLab::new_dual_stack("cl-np6", 3, 1, &[POD_PORT])?;
    let service = node_port_service("web", "10.96.0.10", 30080, json!({}));
    lab.apply_dual_stack_service(service, "fd00:96::10".parse()?, TARGET_PORTS, &[(2, 0)])?;
    lab.start_vipr(&[])?;
    let result = (|| -> Result<()> {
        for node in [1, 3] {
            let through = ClusterLab::node_address6(node, 30080);
            let tcp = lab.ask_tcp(through)?;
            let udp = lab.ask_udp(through)?;
            for (protocol, answer) in [("TCP", tcp), ("UDP", udp)] {
                ensure!(
                    answer.backend == "n2-pod0" && answer.observed_client.ip() == node_ip6(node),
                    "{protocol} through n{node}: {answer}"
                );
            }
        }
        Ok(())
    })();
    lab.with_logs(result)
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
    let answer = lab.ask_tcp(ClusterLab::node_address(2, 30081))?;
    assert_eq!((answer.backend.as_str(), answer.observed_client.ip()), ("n2-pod0", CLIENT_IP.into()));
    Ok(())
}

/// The backend that answers a datagram from `socket` to `to`.
fn udp_backend(socket: &UdpSocket, to: SocketAddr) -> Result<String> {
    Ok(udp_answer(socket, to)?.backend)
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
        lab.ask_tcp(ClusterLab::node_address(node, NODE_PORT))?;
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

/// The backend each UDP flow from the client's `source_ports` reaches through node `node`, one
/// datagram each (every flow a socket of its own, closed before the next).
fn udp_backends_through(
    lab: &ClusterLab,
    node: usize,
    node_port: u16,
    source_ports: Range<u16>,
) -> Result<BTreeMap<u16, String>> {
    lab.client.run(|| {
        let mut chosen = BTreeMap::new();
        for source_port in source_ports.clone() {
            let socket = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, source_port))?;
            socket.set_read_timeout(Some(ASK))?;
            chosen.insert(source_port, udp_backend(&socket, ClusterLab::node_address(node, node_port))?);
        }
        Ok(chosen)
    })
}

/// Waits until node `node` (from 1) has programmed the UDP cluster IP `cluster_ip`:80 with
/// backends, none of them `gone`.
fn wait_until_programmed_without(
    lab: &ClusterLab,
    node: usize,
    cluster_ip: Ipv4Addr,
    gone: Ipv4Addr,
) -> Result<()> {
    let frontend = Frontend { addr: SocketAddrV4::new(cluster_ip, 80), protocol: Protocol::Udp };
    let gone = SocketAddrV4::new(gone, POD_PORT);
    wait_for(&format!("n{node} to program {cluster_ip} without {gone}"), TIMEOUT, || {
        // Read while the agent writes: a half-written set is "not yet".
        Ok(match lab.nodes[node - 1].maps().frontend_backends(frontend) {
            Ok(Some(backends)) if !backends.is_empty() && !backends.contains(&gone) => Check::Done(()),
            other => Check::NotYet(format!("{other:?}")),
        })
    })
}

/// Maglev's table changes little when a backend leaves: the flows of the removed backend move,
/// and hardly any other. Measured on a node that never saw the flows (no flow entry pins them),
/// against the backends they reached through another node before the change.
#[test]
fn with_maglev_removing_one_of_n_backends_moves_about_one_nth_of_the_flows() -> Result<()> {
    const NODE_PORT: u16 = 30083;
    const FLOWS: Range<u16> = 41_000..41_120;
    let mut lab = ClusterLab::new("cl-mr", 3, 2, &[POD_PORT])?;
    let all: Vec<(usize, usize)> = (1..=3).flat_map(|node| [(node, 0), (node, 1)]).collect();
    let service = node_port_service("ring", "10.96.0.40", NODE_PORT, json!({}));
    lab.apply_service(service.clone(), TARGET_PORTS, &all)?;
    lab.start_vipr(&["--lb-algorithm=maglev"])?;
    for node in 1..=3 {
        lab.ask_tcp(ClusterLab::node_address(node, NODE_PORT))?;
    }
    let before = udp_backends_through(&lab, 1, NODE_PORT, FLOWS)?;
    let remaining: Vec<(usize, usize)> = all.iter().copied().filter(|&endpoint| endpoint != (3, 1)).collect();
    lab.apply_service(service, TARGET_PORTS, &remaining)?;
    wait_until_programmed_without(&lab, 2, Ipv4Addr::new(10, 96, 0, 40), pod_ip(3, 1))?;
    let after = udp_backends_through(&lab, 2, NODE_PORT, FLOWS)?;

    let flows = before.len();
    let on_removed: Vec<u16> =
        before.iter().filter(|(_, backend)| *backend == "n3-pod1").map(|(port, _)| *port).collect();
    let moved_others: Vec<u16> = before
        .iter()
        .filter(|(port, backend)| *backend != "n3-pod1" && after.get(port) != Some(*backend))
        .map(|(port, _)| *port)
        .collect();
    assert!(
        after.values().all(|backend| backend != "n3-pod1"),
        "a flow still reached the removed backend: {after:?}"
    );
    eprintln!(
        "{} of {flows} flows were on the removed backend; {} others moved",
        on_removed.len(),
        moved_others.len()
    );
    // About 1/6 of 120 flows sat on the removed backend (a binomial spread around 20).
    assert!((5..=40).contains(&on_removed.len()), "{} of {flows} flows were on n3-pod1", on_removed.len());
    // Maglev's minimal disruption: beyond those, at most a few percent of the flows move
    // (random choice would move about 5/6 of them).
    assert!(
        moved_others.len() * 100 <= flows * 8,
        "{} of {flows} flows on surviving backends moved: {moved_others:?}",
        moved_others.len()
    );
    Ok(())
}

/// A node goes away (its vipr killed, its link down, its Node deleted), then its endpoints leave
/// the EndpointSlice: the other nodes stop sending to it, and a flow that was pinned to its pod
/// is balanced again instead of being black-holed.
#[test]
fn when_a_node_goes_away_the_others_balance_its_flows_to_the_remaining_pods() -> Result<()> {
    const NODE_PORT: u16 = 30084;
    let mut lab = ClusterLab::new("cl-gone", 3, 1, &[POD_PORT])?;
    let service = node_port_service("away", "10.96.0.50", NODE_PORT, json!({}));
    lab.apply_service(service.clone(), TARGET_PORTS, &[(1, 0), (2, 0), (3, 0)])?;
    lab.start_vipr(&["--lb-algorithm=maglev"])?;
    for node in 1..=2 {
        lab.ask_tcp(ClusterLab::node_address(node, NODE_PORT))?;
    }
    // A UDP flow through n1 that Maglev pins to n3's pod; its socket stays open.
    let through_n1 = ClusterLab::node_address(1, NODE_PORT);
    let pinned = lab.client.run(|| {
        for source_port in 42_000..42_100u16 {
            let socket = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, source_port))?;
            socket.set_read_timeout(Some(ASK))?;
            if udp_backend(&socket, through_n1)? == "n3-pod0" {
                return Ok(socket);
            }
        }
        bail!("no flow of 100 reached n3-pod0")
    })?;

    lab.remove_node(3)?;
    lab.apply_service(service, TARGET_PORTS, &[(1, 0), (2, 0)])?;
    for node in 1..=2 {
        wait_until_programmed_without(&lab, node, Ipv4Addr::new(10, 96, 0, 50), pod_ip(3, 0))?;
    }
    let rebalanced = wait_for("the pinned flow to reach a remaining pod", TIMEOUT, || {
        Ok(match lab.client.run(|| udp_backend(&pinned, through_n1)) {
            Ok(backend) if backend != "n3-pod0" => Check::Done(backend),
            Ok(backend) => Check::NotYet(format!("still {backend}")),
            Err(error) => Check::NotYet(format!("{error:#}")),
        })
    })?;
    assert!(["n1-pod0", "n2-pod0"].contains(&rebalanced.as_str()), "{rebalanced}");
    // New connections through either remaining node all reach the remaining pods.
    for node in 1..=2 {
        for _ in 0..6 {
            let answer = lab.client.run(|| tcp_exchange(ClusterLab::node_address(node, NODE_PORT), ASK))?;
            assert!(answer.answer.backend != "n3-pod0", "through n{node}: {}", answer.answer.backend);
        }
    }
    Ok(())
}

const DSR_NODE_PORT: u16 = 30084;
const DSR_CLUSTER_IP: &str = "10.96.0.40";
const DSR_CLUSTER_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x40);

/// A NodePort with its one endpoint on n2, vipr on every node with `args` (the LB mode); a
/// dual-stack lab and Service with `dual_stack`.
fn dsr_lab(label: &str, args: &[&str], dual_stack: bool) -> Result<ClusterLab> {
    let service = node_port_service("direct", DSR_CLUSTER_IP, DSR_NODE_PORT, json!({}));
    let mut lab = if dual_stack {
        let lab = ClusterLab::new_dual_stack(label, 3, 1, &[POD_PORT])?;
        lab.apply_dual_stack_service(service, DSR_CLUSTER_IP6, TARGET_PORTS, &[(2, 0)])?;
        lab
    } else {
        let lab = ClusterLab::new(label, 3, 1, &[POD_PORT])?;
        lab.apply_service(service, TARGET_PORTS, &[(2, 0)])?;
        lab
    };
    lab.start_vipr(args)?;
    Ok(lab)
}

#[test]
fn with_dsr_a_remote_backend_sees_the_client_and_replies_straight_to_it() -> Result<()> {
    dsr_through_n1("cl-dsr", &["--lb-mode=dsr"], false)
}

/// The same with `--bpf-forwarding=redirect`: the request redirected to node 2 with the option,
/// node 2 redirecting it to the pod without, and the reverse-NATed reply to the router.
#[test]
fn with_dsr_and_redirected_forwarding_a_remote_backend_replies_straight_to_the_client() -> Result<()> {
    dsr_through_n1("cl-dsrr", &["--lb-mode=dsr", "--bpf-forwarding=redirect"], false)
}

/// The same over IPv6, in a dual-stack lab.
#[test]
fn with_dsr_an_ipv6_remote_backend_sees_the_client_and_replies_straight_to_it() -> Result<()> {
    dsr_through_n1("cl-dsr6", &["--lb-mode=dsr"], true)
}

/// IPv6 with `--bpf-forwarding=redirect`.
#[test]
fn with_dsr_and_redirected_forwarding_an_ipv6_remote_backend_replies_straight_to_the_client() -> Result<()> {
    dsr_through_n1("cl-dsrr6", &["--lb-mode=dsr", "--bpf-forwarding=redirect"], true)
}

/// Direct server return sent from n1's XDP program (`--xdp=native`, with the redirected
/// forwarding XDP needs, on veths set up as NICs deliver frames): the same, and every request
/// of the client's exchanges left n1 by `XDP_TX`, the carrier added there.
#[test]
fn with_dsr_from_xdp_a_remote_backend_replies_straight_to_the_client() -> Result<()> {
    dsr_through_n1("cl-dsrx", &["--lb-mode=dsr", "--bpf-forwarding=redirect", XDP], false)
}

/// IPv6 from XDP, in a dual-stack lab.
#[test]
fn with_dsr_from_xdp_an_ipv6_remote_backend_replies_straight_to_the_client() -> Result<()> {
    dsr_through_n1("cl-dsrx6", &["--lb-mode=dsr", "--bpf-forwarding=redirect", XDP], true)
}

const XDP: &str = "--xdp=native";

/// [`dsr_replies_straight`] through n1 in a [`dsr_lab`] with `args` (a dual-stack one, through
/// n1's IPv6 address, with `ipv6`); with [`XDP`] among `args` from n1's XDP program
/// ([`dsr_from_xdp`]).
fn dsr_through_n1(label: &str, args: &[&str], ipv6: bool) -> Result<()> {
    let mut lab = dsr_lab(label, args, ipv6)?;
    let (through, client): (SocketAddr, IpAddr) = if ipv6 {
        (ClusterLab::node_address6(1, DSR_NODE_PORT), CLIENT_IP6.into())
    } else {
        (ClusterLab::node_address(1, DSR_NODE_PORT), CLIENT_IP.into())
    };
    let result = if args.contains(&XDP) {
        dsr_from_xdp(&mut lab, through, client)
    } else {
        dsr_replies_straight(&lab, through, client, true)
    };
    lab.with_logs(result)
}

fn dsr_from_xdp(lab: &mut ClusterLab, through: SocketAddr, client: IpAddr) -> Result<()> {
    lab.prepare_for_xdp()?;
    let before = lab.uplink_xdp_tx(1)?;
    // XDP looks the route up a packet; only TC caches next hops in flow entries.
    dsr_replies_straight(lab, through, client, false)?;
    let sent = lab.uplink_xdp_tx(1)? - before;
    ensure!(
        sent >= DSR_EXCHANGES,
        "n1's XDP sent {sent} frames for {DSR_EXCHANGES} UDP exchanges and more: TC sent them"
    );
    Ok(())
}

/// The UDP exchanges of [`dsr_replies_straight`]'s count of packets n1 receives.
const DSR_EXCHANGES: u64 = 40;

/// Through n1's address `through` (either family), from the client's address `client` of that
/// family: the backend on n2 sees the client, and its replies do not come back through n1. With
/// `tc_caches_hop` n1's TC program serves the connection and caches its next hop.
fn dsr_replies_straight(
    lab: &ClusterLab,
    through: SocketAddr,
    client: IpAddr,
    tc_caches_hop: bool,
) -> Result<()> {
    // TCP: the connection to n1's address works only if the replies come from it.
    let answer = lab.ask_tcp(through)?;
    ensure!(answer.backend == "n2-pod0" && answer.observed_client.ip() == client, "TCP: {answer}");
    if let (SocketAddr::V4(through), true) = (through, tc_caches_hop) {
        // After its SYN a DSR connection's requests are plain destination rewrites: they go
        // the established way, with the next hop cached in n1's flow entry (no FIB lookup a
        // packet). The testbed reads IPv4 flow entries only.
        let flows = lab.nodes[0].maps().flows()?;
        let cached = flows.iter().filter(|entry| entry.destination == through && entry.next_hop_ifindex != 0);
        ensure!(cached.count() == 1, "n1 cached no next hop for the DSR connection: {flows:?}");
    }
    // UDP: the answer counts only if it comes from n1's address and port.
    let answer = lab.ask_udp(through)?;
    ensure!(answer.backend == "n2-pod0" && answer.observed_client.ip() == client, "UDP: {answer}");
    // n1 sent both connections by DSR, and n2 got their service address in the requests.
    lab.node_metric(1, "vipr_datapath_dsr_total{event=\"connection_sent\"}", 2.0)?;
    lab.node_metric(2, "vipr_datapath_dsr_total{event=\"connection_received\"}", 2.0)?;

    // The replies do not come back through n1: its uplink receives the requests only (with
    // SNAT it would receive each answer from n2 too). A little slack for the API server's
    // traffic to n1's vipr (and, over IPv6, neighbour discovery).
    const EXCHANGES: u64 = DSR_EXCHANGES;
    let before = uplink_rx_packets(lab, 1)?;
    lab.client.run(|| {
        let socket = udp_socket_for(through)?;
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

/// Path MTU discovery of a DSR connection's replies: the router's link to the client is
/// narrower than the cluster's links, so the router answers the backend's full-sized reply
/// segments with an ICMP fragmentation needed, addressed to the address they left with: the
/// service's, n1's. n1 holds only the connection's forward entry; it must pass the error on to
/// the backend, quoting the segment as the backend sent it, or the backend never learns the
/// path's MTU and the bulk answer never arrives.
#[test]
fn with_dsr_a_router_s_fragmentation_needed_about_a_reply_reaches_the_backend() -> Result<()> {
    dsr_path_mtu("cl-dsrm", &["--lb-mode=dsr"], false)
}

/// The same over IPv6 (packet too big), with redirected forwarding.
#[test]
fn with_dsr_an_ipv6_router_s_packet_too_big_about_a_reply_reaches_the_backend() -> Result<()> {
    dsr_path_mtu("cl-dsrm6", &["--lb-mode=dsr", "--bpf-forwarding=redirect"], true)
}

/// [`with_dsr_a_router_s_fragmentation_needed_about_a_reply_reaches_the_backend`] in a
/// [`dsr_lab`] with `args`, over IPv6 with `ipv6`.
fn dsr_path_mtu(label: &str, args: &[&str], ipv6: bool) -> Result<()> {
    /// Many segments of the cluster's MTU (1500), each too large for the client's link.
    const BULK: usize = 64 << 10;
    /// The client's link: IPv6's minimum MTU.
    const NARROW_MTU: &str = "1280";
    /// How long each read of the answer waits: the backend retransmits a lost segment of the
    /// same size after 200 ms and more, so a path that never learns the MTU runs out of it.
    const READ_WAIT: Duration = Duration::from_secs(5);
    let lab = dsr_lab(label, args, ipv6)?;
    let through = if ipv6 {
        ClusterLab::node_address6(1, DSR_NODE_PORT)
    } else {
        ClusterLab::node_address(1, DSR_NODE_PORT)
    };
    let result = (|| {
        lab.ask_tcp(through)?;
        lab.router.ip(&["link", "set", "ext", "mtu", NARROW_MTU])?;
        let answer = lab.client.run(|| TcpSession::connect(through, READ_WAIT)?.ask_bulk(BULK))?;
        ensure!(answer.backend == "n2-pod0", "the bulk answer came from {answer}");
        lab.node_metric(1, "vipr_datapath_dsr_total{event=\"connection_sent\"}", 2.0)
    })();
    lab.with_logs(result.map(|_| ()))
}

/// A cluster halfway through its switch to DSR (docs/deploy.md): n1 already sends by DSR, n2 and
/// n3 still run `snat`. n2 was given `--lb-dsr-accept`: it takes the service address that n1's
/// requests carry, and its backend replies straight to the client as in a DSR cluster. n3 was
/// not: since the option is not authenticated, a node takes it only where its own mode sends by
/// DSR, so n3 ignores it (counted) and stores nothing (its pod answers with its own address,
/// which the client does not take).
#[test]
fn a_snat_node_takes_a_carried_service_address_only_with_lb_dsr_accept() -> Result<()> {
    const IGNORED_NODE_PORT: u16 = 30085;
    let mut lab = ClusterLab::new("cl-dsra", 3, 1, &[POD_PORT])?;
    let service = node_port_service("direct", DSR_CLUSTER_IP, DSR_NODE_PORT, json!({}));
    lab.apply_service(service, TARGET_PORTS, &[(2, 0)])?;
    let service = node_port_service("ignored", "10.96.0.60", IGNORED_NODE_PORT, json!({}));
    lab.apply_service(service, TARGET_PORTS, &[(3, 0)])?;
    lab.start_vipr_each(|node| match node {
        1 => vec!["--lb-mode=dsr"],
        2 => vec!["--lb-dsr-accept"],
        _ => vec![],
    })?;
    let result = (|| {
        dsr_replies_straight(&lab, ClusterLab::node_address(1, DSR_NODE_PORT), CLIENT_IP.into(), true)?;
        let through = ClusterLab::node_address(1, IGNORED_NODE_PORT);
        let ignored = "vipr_datapath_dsr_total{event=\"carrier_ignored\"}";
        // A datagram at a time (each may precede n1's sync of the Service) until n3 counts one.
        wait_for("n3 to ignore a carried service address", TIMEOUT, || {
            lab.client.run(|| Ok(UdpSocket::bind("0.0.0.0:0")?.send_to(b"who", through)?))?;
            Ok(match lab.node_metric_now(3, ignored) {
                Ok(Some(count)) if count >= 1.0 => Check::Done(()),
                count => Check::NotYet(format!("{count:?}")),
            })
        })?;
        lab.node_metric(1, "vipr_datapath_dsr_total{event=\"connection_sent\"}", 3.0)?;
        ensure!(
            lab.nodes[2].maps().flows()?.is_empty(),
            "n3 stored entries for a carried address it ignored"
        );
        ensure!(
            lab.node_metric_now(3, "vipr_datapath_dsr_total{event=\"connection_received\"}")? == Some(0.0),
            "n3 took a carried service address"
        );
        Ok(())
    })();
    lab.with_logs(result)
}

#[test]
fn hybrid_dsr_is_direct_for_tcp_and_masqueraded_for_udp() -> Result<()> {
    let lab = dsr_lab("cl-hyb", &["--lb-mode=hybrid"], false)?;
    lab.with_logs(hybrid_dsr(&lab))
}

fn hybrid_dsr(lab: &ClusterLab) -> Result<()> {
    let through = ClusterLab::node_address(1, DSR_NODE_PORT);
    let answer = lab.ask_tcp(through)?;
    ensure!(answer.backend == "n2-pod0" && answer.observed_client.ip() == CLIENT_IP, "TCP: {answer}");
    let answer = lab.ask_udp(through)?;
    ensure!(
        answer.backend == "n2-pod0" && answer.observed_client.ip() == node_ip(1),
        "UDP is masqueraded: {answer}"
    );
    lab.node_metric(1, "vipr_datapath_dsr_total{event=\"connection_sent\"}", 1.0)?;
    Ok(())
}
