//! vipr `--proxy-mode=nftables` end to end on the real kernel: a client namespace reaches a
//! NodePort service (cluster IP and NodePort, TCP and UDP) whose endpoints live in three
//! backend namespaces, through a node namespace where vipr programs its `vipr` nftables
//! tables. Partial syncs rewrite only what changed, `--cleanup` removes the tables, and
//! switching between iptables and nftables modes leaves nothing of the other. Needs root and a
//! built vipr (or VIPR_BIN).

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{Ipv4Addr, SocketAddr, SocketAddrV4},
    time::Duration,
};

use testbed::{count_by_backend, exchanges, netfilter_lab::NetfilterLab, udp_exchange, Frontend, Protocol};

const TIMEOUT: Duration = Duration::from_secs(2);
/// With three endpoints chosen at random, the chance that one gets none of 60 is ~1e-10.
const CONNECTIONS: usize = 60;
const CLIENT: Ipv4Addr = Ipv4Addr::new(10, 10, 0, 2);
/// The node's address on the client's link (the NodePort address given).
const NODE: Ipv4Addr = Ipv4Addr::new(10, 10, 0, 1);
const VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
/// Service `other`'s cluster IP: its endpoints never change.
const OTHER_VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 20);
const ENDPOINTS: [&str; 3] = ["b1", "b2", "b3"];
const HTTP_NODE_PORT: u16 = 30080;
const DNS_NODE_PORT: u16 = 30053;

fn backend_addr(name: &str) -> Ipv4Addr {
    let index = ENDPOINTS.iter().position(|candidate| *candidate == name).unwrap();
    Ipv4Addr::new(10, 20, u8::try_from(index + 1).unwrap(), 2)
}

fn frontend(ip: Ipv4Addr, port: u16, protocol: Protocol) -> Frontend {
    Frontend { addr: SocketAddrV4::new(ip, port), protocol }
}

/// Service `web` (NodePort): http 80/TCP -> 8080 on node port 30080, dns 53/UDP -> 5353 on
/// 30053, served by `endpoints`; service `other` (cluster IP 80/TCP) served by b1 alone.
fn manifests(endpoints: &[&str]) -> String {
    let mut yaml = format!(
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: web\n  namespace: default\nspec:\n  type: NodePort\n  \
         clusterIP: {VIP}\n  clusterIPs: [{VIP}]\n  ports:\n  \
         - {{name: http, protocol: TCP, port: 80, targetPort: 8080, nodePort: {HTTP_NODE_PORT}}}\n  \
         - {{name: dns, protocol: UDP, port: 53, targetPort: 5353, nodePort: {DNS_NODE_PORT}}}\n---\n\
         apiVersion: v1\nkind: Service\nmetadata:\n  name: other\n  namespace: default\nspec:\n  \
         clusterIP: {OTHER_VIP}\n  clusterIPs: [{OTHER_VIP}]\n  ports:\n  \
         - {{name: http, protocol: TCP, port: 80, targetPort: 8080}}\n---\n\
         apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: other-1\n  namespace: default\n  \
         labels:\n    kubernetes.io/service-name: other\naddressType: IPv4\nports:\n\
         - {{name: http, protocol: TCP, port: 8080}}\nendpoints:\n- addresses: [{}]\n  conditions: {{ready: true}}\n---\n\
         apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: web-1\n  namespace: default\n  \
         labels:\n    kubernetes.io/service-name: web\naddressType: IPv4\nports:\n\
         - {{name: http, protocol: TCP, port: 8080}}\n- {{name: dns, protocol: UDP, port: 5353}}\n",
        backend_addr("b1")
    );
    yaml.push_str(if endpoints.is_empty() { "endpoints: []\n" } else { "endpoints:\n" });
    for name in endpoints {
        yaml.push_str(&format!("- addresses: [{}]\n  conditions: {{ready: true}}\n", backend_addr(name)));
    }
    yaml
}

/// The lab with service `web` on every endpoint; no vipr yet.
fn build(label: &str) -> NetfilterLab {
    let backends: Vec<(&str, Ipv4Addr)> = ENDPOINTS.iter().map(|&name| (name, backend_addr(name))).collect();
    NetfilterLab::build(label, CLIENT, &backends, manifests, &ENDPOINTS).unwrap()
}

fn start(label: &str) -> NetfilterLab {
    let mut lab = build(label);
    run_vipr(&mut lab, "nftables");
    lab
}

/// Starts vipr in `mode` (stopping a running one first) and waits for its first sync.
fn run_vipr(lab: &mut NetfilterLab, mode: &str) {
    lab.run_vipr(&[format!("--proxy-mode={mode}"), format!("--nodeport-addresses={NODE}/32")]).unwrap();
}

/// `nft list tables` in the node.
fn tables(lab: &NetfilterLab) -> String {
    lab.node_output("nft", &["list", "tables"]).unwrap()
}

/// Each chain of `ip vipr` whose name contains `service` with its rules' handles
/// (`nft -a`): a chain flushed and refilled gets new handles.
fn handles(lab: &NetfilterLab, service: &str) -> BTreeMap<String, Vec<String>> {
    let listing = lab.node_output("nft", &["-a", "list", "table", "ip", "vipr"]).unwrap();
    let mut chains = BTreeMap::new();
    let mut current: Option<String> = None;
    for line in listing.lines().map(str::trim) {
        if let Some(name) = line.strip_prefix("chain ") {
            let name = name.split_whitespace().next().unwrap().to_owned();
            current = name.contains(service).then_some(name);
        } else if let (Some(chain), Some((_, handle))) = (&current, line.rsplit_once("# handle ")) {
            chains.entry(chain.clone()).or_insert_with(Vec::new).push(handle.to_owned());
        }
    }
    chains
}

/// `count` new connections to `frontend`; the backends that answered, each reply checked to
/// come from the frontend.
fn reach(lab: &NetfilterLab, frontend: Frontend, count: usize) -> BTreeSet<String> {
    let answers = lab.client().run(|| exchanges(frontend, count, TIMEOUT)).unwrap();
    for exchange in &answers {
        assert_eq!(exchange.replied_from, frontend.socket_addr(), "{exchange:?}");
    }
    let counts = count_by_backend(&answers);
    eprintln!("{frontend}: {counts:?}");
    counts.into_keys().collect()
}

fn names(names: &[&str]) -> BTreeSet<String> {
    names.iter().map(|name| (*name).to_owned()).collect()
}

#[test]
fn cluster_ip_and_node_port_are_balanced_by_the_nftables_table() {
    let mut lab = start("nft-lab");
    let table = lab.node_output("nft", &["list", "table", "ip", "vipr"]).unwrap();
    assert!(table.contains("map service-ips"), "{table}");
    assert!(table.contains("hook prerouting"), "{table}");

    assert_eq!(reach(&lab, frontend(VIP, 80, Protocol::Tcp), CONNECTIONS), names(&ENDPOINTS));
    assert_eq!(reach(&lab, frontend(VIP, 53, Protocol::Udp), CONNECTIONS), names(&ENDPOINTS));
    assert_eq!(reach(&lab, frontend(NODE, HTTP_NODE_PORT, Protocol::Tcp), CONNECTIONS), names(&ENDPOINTS));
    assert_eq!(reach(&lab, frontend(NODE, DNS_NODE_PORT, Protocol::Udp), CONNECTIONS), names(&ENDPOINTS));
    assert_eq!(reach(&lab, frontend(OTHER_VIP, 80, Protocol::Tcp), 10), names(&["b1"]));
    // `vipr inspect` finds nftables mode and prints the table.
    let inspect = lab.inspect(&["services"]).unwrap();
    assert!(inspect.contains("table ip vipr") && inspect.contains("map service-ips"), "{inspect}");

    // One UDP flow (fixed source port) is pinned by conntrack to its first endpoint. When that
    // endpoint is removed, vipr deletes the entry and the flow's next datagram finds a live one.
    let others = lab
        .udp_flow_leaves_a_removed_endpoint(
            SocketAddr::from((CLIENT, 40053)),
            SocketAddr::from((VIP, 53)),
            &ENDPOINTS,
        )
        .unwrap();
    assert_eq!(reach(&lab, frontend(VIP, 80, Protocol::Tcp), 40), names(&others));

    // No endpoints: the cluster IP and the NodePort reject; a port the cluster IP does not
    // serve is rejected too, an unused address of its range is not answered.
    lab.set_endpoints(&[]).unwrap();
    for refused in [SocketAddr::from((VIP, 80)), SocketAddr::from((VIP, 81))] {
        let result = lab.client().run(|| Ok(testbed::tcp_exchange(refused, TIMEOUT))).unwrap();
        let error = format!("{:#}", result.unwrap_err());
        assert!(error.contains("refused") || error.contains("unreachable"), "{refused}: {error}");
    }
    let refused =
        lab.client().run(|| Ok(udp_exchange(SocketAddr::from((NODE, DNS_NODE_PORT)), TIMEOUT))).unwrap();
    assert!(refused.is_err(), "{refused:?}");
    assert_eq!(reach(&lab, frontend(OTHER_VIP, 80, Protocol::Tcp), 5), names(&["b1"]));

    // vipr stops: the table stays and keeps serving; --cleanup removes it.
    lab.set_endpoints(&ENDPOINTS).unwrap();
    let status = lab.stop_vipr().unwrap();
    assert!(status.success(), "{status}");
    assert_eq!(reach(&lab, frontend(VIP, 80, Protocol::Tcp), 30).len(), 3);
    let output = lab.cleanup_vipr().unwrap();
    eprintln!("cleanup: {output}");
    let tables = tables(&lab);
    assert!(!tables.contains("vipr"), "the tables are gone: {tables}");
    let after_cleanup =
        lab.client().run(|| Ok(testbed::tcp_exchange(SocketAddr::from((VIP, 80)), TIMEOUT))).unwrap();
    assert!(after_cleanup.is_err(), "the VIP is no longer served: {after_cleanup:?}");
}

/// An endpoint change rewrites that service's chains and elements only: every other chain
/// keeps its rules (same handles), and the batch is partial. (Services without rules of their
/// own, as `other` here, have no chain: their elements go to the shared `pick-` chains.)
#[test]
fn an_endpoint_change_rewrites_only_that_services_chain() {
    let mut lab = start("nft-partial");
    let web_http = |lab: &NetfilterLab| -> Vec<String> {
        let chains = handles(lab, "default/web/tcp/http");
        chains
            .into_iter()
            .find(|(name, _)| name.starts_with("external-"))
            .map(|(_, handles)| handles)
            .unwrap()
    };
    let web = web_http(&lab);
    let before = handles(&lab, "");

    lab.set_endpoints(&["b1", "b2"]).unwrap();
    let after = handles(&lab, "");
    for (chain, handles) in &before {
        if !chain.contains("default/web/") && !chain.starts_with("pick-") {
            assert_eq!(after.get(chain), Some(handles), "{chain} was rewritten");
        }
    }
    let log = std::fs::read_to_string(lab.log()).unwrap();
    assert!(log.contains("from_changes=true"), "the change was applied from the changes alone:\n{log}");
    assert_ne!(web_http(&lab), web, "the changed service's chain was rewritten");
    assert_eq!(reach(&lab, frontend(VIP, 80, Protocol::Tcp), 40), names(&["b1", "b2"]));
    assert_eq!(reach(&lab, frontend(OTHER_VIP, 80, Protocol::Tcp), 5), names(&["b1"]));
    let _ = lab.cleanup_vipr();
}

/// iptables mode, then nftables mode: the iptables chains are gone; then iptables mode again:
/// the nftables table is gone. Each mode serves alone.
#[test]
fn switching_between_iptables_and_nftables_leaves_nothing_of_the_other() {
    let mut lab = build("nft-switch");
    run_vipr(&mut lab, "iptables");
    assert!(lab.node_output("iptables-save", &[]).unwrap().contains(":KUBE-SVC-"));
    assert_eq!(reach(&lab, frontend(VIP, 80, Protocol::Tcp), 30), names(&ENDPOINTS));

    run_vipr(&mut lab, "nftables");
    let save = lab.node_output("iptables-save", &[]).unwrap();
    assert!(
        !save.contains("KUBE-SVC-") && !save.contains("KUBE-SERVICES"),
        "iptables mode's chains stay:\n{save}"
    );
    assert!(tables(&lab).contains("table ip vipr"), "{}", tables(&lab));
    assert_eq!(reach(&lab, frontend(VIP, 80, Protocol::Tcp), 30), names(&ENDPOINTS));

    run_vipr(&mut lab, "iptables");
    assert!(!tables(&lab).contains("vipr"), "nftables mode's table stays: {}", tables(&lab));
    assert!(lab.node_output("iptables-save", &[]).unwrap().contains(":KUBE-SVC-"));
    assert_eq!(reach(&lab, frontend(VIP, 80, Protocol::Tcp), 30), names(&ENDPOINTS));
    let _ = lab.cleanup_vipr();
}
