//! vipr `--proxy-mode=iptables` end to end on the real kernel: a client namespace reaches a
//! NodePort service (cluster IP and NodePort, TCP and UDP) whose endpoints live in three
//! backend namespaces, through a node namespace where vipr programs iptables. No BPF is
//! involved: there is not even a bpffs. Needs root and a built vipr (or VIPR_BIN).

use std::{
    collections::BTreeSet,
    net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4},
    time::Duration,
};

use testbed::{count_by_backend, exchanges, netfilter_lab::NetfilterLab, udp_exchange, Frontend, Protocol};

const TIMEOUT: Duration = Duration::from_secs(2);
/// With three endpoints chosen at random, the chance that one gets none of 60 is ~1e-10.
const CONNECTIONS: usize = 60;
const CLIENT: Ipv4Addr = Ipv4Addr::new(10, 10, 0, 2);
/// The node's address on the client's link.
const NODE: Ipv4Addr = Ipv4Addr::new(10, 10, 0, 1);
const VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const ENDPOINTS: [&str; 3] = ["b1", "b2", "b3"];
/// Serves like an endpoint but is none: an answer from it is a wrong DNAT.
const DECOY: &str = "decoy";
const HTTP_NODE_PORT: u16 = 30080;
const DNS_NODE_PORT: u16 = 30053;

fn backend_addr(name: &str) -> Ipv4Addr {
    let index = ENDPOINTS.iter().chain([&DECOY]).position(|candidate| *candidate == name).unwrap();
    Ipv4Addr::new(10, 20, u8::try_from(index + 1).unwrap(), 2)
}

fn frontend(ip: Ipv4Addr, port: u16, protocol: Protocol) -> Frontend {
    Frontend { addr: SocketAddrV4::new(ip, port), protocol }
}

/// Service `web` (NodePort): http 80/TCP -> 8080 on node port 30080, dns 53/UDP -> 5353 on
/// 30053, served by `endpoints`.
fn manifests(endpoints: &[&str]) -> String {
    let mut yaml = format!(
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: web\n  namespace: default\nspec:\n  type: NodePort\n  \
         clusterIP: {VIP}\n  clusterIPs: [{VIP}]\n  ports:\n  \
         - {{name: http, protocol: TCP, port: 80, targetPort: 8080, nodePort: {HTTP_NODE_PORT}}}\n  \
         - {{name: dns, protocol: UDP, port: 53, targetPort: 5353, nodePort: {DNS_NODE_PORT}}}\n---\n\
         apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: web-1\n  namespace: default\n  \
         labels:\n    kubernetes.io/service-name: web\naddressType: IPv4\nports:\n\
         - {{name: http, protocol: TCP, port: 8080}}\n- {{name: dns, protocol: UDP, port: 5353}}\n"
    );
    yaml.push_str(if endpoints.is_empty() { "endpoints: []\n" } else { "endpoints:\n" });
    for name in endpoints {
        yaml.push_str(&format!("- addresses: [{}]\n  conditions: {{ready: true}}\n", backend_addr(name)));
    }
    yaml
}

/// The lab with every backend (the decoy included) serving, and vipr in iptables mode.
fn start(label: &str) -> NetfilterLab {
    let backends: Vec<(&str, Ipv4Addr)> =
        ENDPOINTS.iter().chain([&DECOY]).map(|&name| (name, backend_addr(name))).collect();
    let mut lab = NetfilterLab::build(label, CLIENT, &backends, manifests, &ENDPOINTS).unwrap();
    lab.run_vipr(&["--proxy-mode=iptables".to_owned()]).unwrap();
    lab
}

fn node_save(lab: &NetfilterLab) -> String {
    lab.node_output("iptables-save", &[]).unwrap()
}

/// `count` new connections to `frontend`; the backends that answered, each answer checked
/// (reply from the frontend; the client seen as itself, or as a node address when
/// `masqueraded`).
fn reach(lab: &NetfilterLab, frontend: Frontend, count: usize, masqueraded: bool) -> BTreeSet<String> {
    let answers = lab.client().run(|| exchanges(frontend, count, TIMEOUT)).unwrap();
    for exchange in &answers {
        assert_eq!(exchange.replied_from, frontend.socket_addr(), "{exchange:?}");
        let seen = exchange.answer.observed_client;
        if masqueraded {
            let backend = backend_addr(&exchange.answer.backend).octets();
            let node_side = IpAddr::from([backend[0], backend[1], backend[2], 1]);
            assert_eq!(
                seen.ip(),
                node_side,
                "masqueraded to the node's address toward the backend: {exchange:?}"
            );
        } else {
            assert_eq!(seen, SocketAddr::from((CLIENT, exchange.client_port)), "{exchange:?}");
        }
    }
    let counts = count_by_backend(&answers);
    eprintln!("{frontend}: {counts:?}");
    counts.into_keys().collect()
}

fn names(names: &[&str]) -> BTreeSet<String> {
    names.iter().map(|name| (*name).to_owned()).collect()
}

#[test]
fn cluster_ip_and_node_port_are_balanced_by_iptables_rules() {
    let mut lab = start("ipt-lab");
    let save = node_save(&lab);
    assert!(
        save.contains("-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES"),
        "{save}"
    );
    assert!(save.contains(":KUBE-SVC-"), "{save}");
    assert!(
        std::fs::read_to_string(lab.log()).unwrap().contains("variant of iptables"),
        "the variant is logged"
    );

    // Cluster IP, no local-traffic detector: never masqueraded.
    assert_eq!(reach(&lab, frontend(VIP, 80, Protocol::Tcp), CONNECTIONS, false), names(&ENDPOINTS));
    assert_eq!(reach(&lab, frontend(VIP, 53, Protocol::Udp), CONNECTIONS, false), names(&ENDPOINTS));
    // NodePort (on every node address in iptables mode), masqueraded (externalTrafficPolicy Cluster).
    assert_eq!(
        reach(&lab, frontend(NODE, HTTP_NODE_PORT, Protocol::Tcp), CONNECTIONS, true),
        names(&ENDPOINTS)
    );
    assert_eq!(
        reach(&lab, frontend(NODE, DNS_NODE_PORT, Protocol::Udp), CONNECTIONS, true),
        names(&ENDPOINTS)
    );
    let other_node_address = Ipv4Addr::new(10, 20, 1, 1);
    assert_eq!(reach(&lab, frontend(other_node_address, HTTP_NODE_PORT, Protocol::Tcp), 30, true).len(), 3);

    // One UDP flow (fixed source port) is pinned by conntrack to its first endpoint. When that
    // endpoint is removed, vipr deletes the entry and the flow's next datagram finds a live one.
    let others = lab
        .udp_flow_leaves_a_removed_endpoint(
            SocketAddr::from((CLIENT, 40053)),
            SocketAddr::from((VIP, 53)),
            &ENDPOINTS,
        )
        .unwrap();
    assert!(std::fs::read_to_string(lab.log()).unwrap().contains("deleted stale UDP conntrack entries"));
    // The TCP service follows the change too.
    assert_eq!(reach(&lab, frontend(VIP, 80, Protocol::Tcp), 40, false), names(&others));

    // No endpoints: the cluster IP and the NodePort reject.
    lab.set_endpoints(&[]).unwrap();
    let refused =
        lab.client().run(|| Ok(testbed::tcp_exchange(SocketAddr::from((VIP, 80)), TIMEOUT))).unwrap();
    let error = format!("{:#}", refused.unwrap_err());
    assert!(error.contains("refused") || error.contains("unreachable"), "{error}");
    let refused =
        lab.client().run(|| Ok(udp_exchange(SocketAddr::from((NODE, DNS_NODE_PORT)), TIMEOUT))).unwrap();
    assert!(refused.is_err(), "{refused:?}");

    // vipr stops: the rules stay and keep serving; --cleanup removes them.
    lab.set_endpoints(&ENDPOINTS).unwrap();
    let status = lab.stop_vipr().unwrap();
    assert!(status.success(), "{status}");
    assert_eq!(reach(&lab, frontend(VIP, 80, Protocol::Tcp), 30, false).len(), 3);
    let output = lab.cleanup_vipr().unwrap();
    eprintln!("cleanup: {output}");
    let save = node_save(&lab);
    // Only the CVE-2020-8558 guard that localhost NodePorts (on by default) ensured stays:
    // kubelet's chain, kept with route_localnet=1, as kube-proxy leaves it.
    let left: Vec<&str> = save.lines().filter(|line| line.contains("KUBE-")).collect();
    assert!(left.iter().all(|line| line.contains("KUBE-FIREWALL")), "{save}");
    let after_cleanup =
        lab.client().run(|| Ok(testbed::tcp_exchange(SocketAddr::from((VIP, 80)), TIMEOUT))).unwrap();
    assert!(after_cleanup.is_err(), "the VIP is no longer served: {after_cleanup:?}");
}

#[test]
fn inspect_reads_services_and_flows_from_the_kernel_in_iptables_mode() {
    let mut lab = start("ipt-inspect");
    let endpoints = |port| -> BTreeSet<String> {
        ENDPOINTS.iter().map(|name| SocketAddr::from((backend_addr(name), port)).to_string()).collect()
    };
    // A connection held open, to be found among the flows.
    let mut session =
        lab.client().run(|| testbed::TcpSession::connect(SocketAddr::from((VIP, 80)), TIMEOUT)).unwrap();
    let landed = session.ask().unwrap().backend;
    let client = session.local_addr().unwrap().to_string();

    for running in [true, false] {
        let services: serde_json::Value =
            serde_json::from_str(&lab.inspect(&["services", "-o", "json"]).unwrap()).unwrap();
        for (frontend, protocol, port) in
            [("10.96.0.10:80", "TCP", 8080), ("10.96.0.10:53", "UDP", 5353), ("0.0.0.0:30080", "TCP", 8080)]
        {
            let entry = services
                .as_array()
                .unwrap()
                .iter()
                .find(|entry| entry["frontend"] == frontend && entry["protocol"] == protocol)
                .unwrap_or_else(|| panic!("no {protocol} {frontend} in {services:#}"));
            let listed: BTreeSet<String> = entry["backends"]
                .as_array()
                .unwrap()
                .iter()
                .map(|backend| backend["address"].as_str().unwrap().to_owned())
                .collect();
            assert_eq!(listed, endpoints(port), "{entry:#}");
            assert_eq!(
                entry["service"],
                if protocol == "TCP" { "default/web:http" } else { "default/web:dns" }
            );
        }
        let text = lab.inspect(&["services", "--mode=iptables", "--frontend", "10.96.0.10:80"]).unwrap();
        assert!(text.lines().any(|line| line.starts_with("TCP") && line.contains("10.96.0.10:80")), "{text}");
        for endpoint in endpoints(8080) {
            assert!(text.contains(&format!("  -> {endpoint}")), "{endpoint} missing:\n{text}");
        }

        // Where the client's connection landed, from conntrack.
        let flows: serde_json::Value =
            serde_json::from_str(&lab.inspect(&["flows", "-o", "json", "--client", &client]).unwrap())
                .unwrap();
        let shown = flows["shown"].as_array().unwrap();
        assert_eq!(shown.len(), 1, "{flows:#}");
        assert_eq!(shown[0]["frontend"], "10.96.0.10:80");
        assert_eq!(shown[0]["backend"], SocketAddr::from((backend_addr(&landed), 8080)).to_string().as_str());

        // The conntrack table holds the session, within its capacity.
        let maps: serde_json::Value =
            serde_json::from_str(&lab.inspect(&["maps", "-o", "json"]).unwrap()).unwrap();
        let conntrack = maps
            .as_array()
            .unwrap()
            .iter()
            .find(|map| map["name"] == "conntrack")
            .unwrap_or_else(|| panic!("no conntrack table in {maps:#}"));
        let entries = conntrack["entries"].as_u64().unwrap();
        assert!(entries >= 1 && entries <= conntrack["capacity"].as_u64().unwrap(), "{conntrack:#}");

        if running {
            // Without endpoints the filter table rejects: so says inspect.
            lab.set_endpoints(&[]).unwrap();
            let services: serde_json::Value = serde_json::from_str(
                &lab.inspect(&["services", "-o", "json", "--frontend", "10.96.0.10:80"]).unwrap(),
            )
            .unwrap();
            assert_eq!(services.as_array().unwrap().len(), 1, "{services:#}");
            assert_eq!(services[0]["flags"], serde_json::json!(["rejects"]), "{services:#}");
            assert_eq!(services[0]["backends"], serde_json::json!([]), "{services:#}");
            lab.set_endpoints(&ENDPOINTS).unwrap();
            // The rules outlive the agent: inspect reads them all the same.
            let status = lab.stop_vipr().unwrap();
            assert!(status.success(), "{status}");
        }
    }
    assert_eq!(session.ask().unwrap().backend, landed);
}
