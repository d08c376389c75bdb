//! vipr `--proxy-mode=iptables` end to end on the real kernel: a client namespace reaches a
//! NodePort service (cluster IP and NodePort, TCP and UDP) whose endpoints live in three
//! backend namespaces, through a node namespace where vipr programs iptables. No BPF is
//! involved: there is not even a bpffs. Needs root and a built vipr (or VIPR_BIN).

use std::{
    collections::BTreeSet,
    net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4, UdpSocket},
    path::Path,
    time::Duration,
};

use anyhow::{bail, Context, Result};
use testbed::{
    count_by_backend, exchanges, locate_vipr, udp_exchange, vipr_cleanup, wait_for, write_atomically, Answer,
    Check, EchoServer, Frontend, LeafSpec, Protocol, Topology, Vipr, WorkDir,
};

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

struct IptablesLab {
    // Dropped in this order: the agent, the servers, the namespaces, the scratch directory.
    vipr: Option<Vipr>,
    _servers: Vec<EchoServer>,
    topology: Topology,
    workdir: WorkDir,
}

impl IptablesLab {
    fn start(label: &str) -> Self {
        testbed::require_root().unwrap();
        let workdir = WorkDir::create(label).unwrap();
        let mut leaves = vec![LeafSpec::in_own_slash24("client", CLIENT).unwrap()];
        for name in ENDPOINTS.iter().chain([&DECOY]) {
            leaves.push(LeafSpec::in_own_slash24(name, backend_addr(name)).unwrap());
        }
        let topology = Topology::build(label, leaves).unwrap();
        let servers = ENDPOINTS
            .iter()
            .chain([&DECOY])
            .map(|name| {
                let addr = backend_addr(name);
                let leaf = topology.leaf(name).unwrap();
                EchoServer::start(
                    &leaf.netns,
                    name,
                    &[SocketAddr::from((addr, 8080))],
                    &[SocketAddr::from((addr, 5353))],
                )
                .unwrap()
            })
            .collect();
        write_atomically(&workdir.path().join("services.yaml"), &manifests(&ENDPOINTS)).unwrap();
        let mut lab = Self { vipr: None, _servers: servers, topology, workdir };
        let args = vec![
            "--proxy-mode=iptables".to_owned(),
            format!("--services-file={}", lab.services_file().display()),
            // No bpffs here: a mode switch's eBPF cleanup (agent.rs) must not touch the host's.
            "--bpf-root=/nonexistent-vipr-bpffs".to_owned(),
            "--node-name=node-a".to_owned(),
            "--healthz-bind-address=".to_owned(),
            "--metrics-bind-address=".to_owned(),
            "--min-sync-period=0s".to_owned(),
            "-v".to_owned(),
        ];
        let log = lab.workdir.path().join("vipr.log");
        lab.vipr =
            Some(Vipr::start_with_args(&locate_vipr().unwrap(), lab.topology.node(), &args, &log).unwrap());
        lab.wait_synced(0).unwrap();
        lab
    }

    fn services_file(&self) -> std::path::PathBuf {
        self.workdir.path().join("services.yaml")
    }

    fn log(&self) -> std::path::PathBuf {
        self.workdir.path().join("vipr.log")
    }

    fn synced(&self) -> usize {
        std::fs::read_to_string(self.log())
            .map_or(0, |log| log.lines().filter(|line| line.contains("synced")).count())
    }

    /// Waits until vipr has logged more than `before` syncs; returns the count.
    fn wait_synced(&mut self, before: usize) -> Result<usize> {
        let log = self.log();
        let vipr = self.vipr.as_mut().context("vipr is not running")?;
        wait_for("vipr to sync", Duration::from_secs(20), || {
            vipr.ensure_running()?;
            let count = std::fs::read_to_string(&log)
                .map_or(0, |log| log.lines().filter(|line| line.contains("synced")).count());
            Ok(if count > before { Check::Done(count) } else { Check::NotYet(format!("{count} syncs")) })
        })
    }

    fn set_endpoints(&mut self, endpoints: &[&str]) {
        let before = self.synced();
        write_atomically(&self.services_file(), &manifests(endpoints)).unwrap();
        self.wait_synced(before).unwrap();
    }

    fn client(&self) -> &testbed::Netns {
        &self.topology.leaf("client").unwrap().netns
    }

    fn node_save(&self) -> String {
        let output = self.topology.node().command("iptables-save").unwrap().output().unwrap();
        String::from_utf8(output.stdout).unwrap()
    }

    /// `count` new connections to `frontend`; the backends that answered, each answer checked
    /// (reply from the frontend; the client seen as itself, or as a node address when
    /// `masqueraded`).
    fn reach(&self, frontend: Frontend, count: usize, masqueraded: bool) -> BTreeSet<String> {
        let answers = self.client().run(|| exchanges(frontend, count, TIMEOUT)).unwrap();
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
}

fn names(names: &[&str]) -> BTreeSet<String> {
    names.iter().map(|name| (*name).to_owned()).collect()
}

/// One datagram from `socket` (a fixed source port: one conntrack entry) and its answer.
fn ask(socket: &UdpSocket, to: SocketAddr) -> Result<Answer> {
    socket.send_to(b"who are you?", to)?;
    let mut reply = [0u8; 1500];
    let (len, from) = socket.recv_from(&mut reply).with_context(|| format!("no answer from {to}"))?;
    if from != to {
        bail!("answer from {from}, not {to}");
    }
    std::str::from_utf8(&reply[..len])?.parse()
}

#[test]
fn cluster_ip_and_node_port_are_balanced_by_iptables_rules() {
    let mut lab = IptablesLab::start("ipt-lab");
    let save = lab.node_save();
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
    assert_eq!(lab.reach(frontend(VIP, 80, Protocol::Tcp), CONNECTIONS, false), names(&ENDPOINTS));
    assert_eq!(lab.reach(frontend(VIP, 53, Protocol::Udp), CONNECTIONS, false), names(&ENDPOINTS));
    // NodePort (on every node address in iptables mode), masqueraded (externalTrafficPolicy Cluster).
    assert_eq!(
        lab.reach(frontend(NODE, HTTP_NODE_PORT, Protocol::Tcp), CONNECTIONS, true),
        names(&ENDPOINTS)
    );
    assert_eq!(lab.reach(frontend(NODE, DNS_NODE_PORT, Protocol::Udp), CONNECTIONS, true), names(&ENDPOINTS));
    let other_node_address = Ipv4Addr::new(10, 20, 1, 1);
    assert_eq!(lab.reach(frontend(other_node_address, HTTP_NODE_PORT, Protocol::Tcp), 30, true).len(), 3);

    // One UDP flow (fixed source port) is pinned by conntrack to its first endpoint. When that
    // endpoint is removed, vipr deletes the entry and the flow's next datagram finds a live one.
    let socket = lab
        .client()
        .run(|| {
            let socket = UdpSocket::bind((CLIENT, 40053))?;
            socket.set_read_timeout(Some(TIMEOUT))?;
            Ok(socket)
        })
        .unwrap();
    let dns = SocketAddr::from((VIP, 53));
    let first = ask(&socket, dns).unwrap().backend;
    assert_eq!(ask(&socket, dns).unwrap().backend, first, "one flow, one endpoint");
    let others: Vec<&str> = ENDPOINTS.iter().copied().filter(|name| *name != first).collect();
    lab.set_endpoints(&others);
    let after = ask(&socket, dns).unwrap().backend;
    assert!(
        others.contains(&after.as_str()),
        "the flow moved from {first} to a listed endpoint, not {after}"
    );
    assert!(std::fs::read_to_string(lab.log()).unwrap().contains("deleted stale UDP conntrack entries"));
    // The TCP service follows the change too.
    assert_eq!(lab.reach(frontend(VIP, 80, Protocol::Tcp), 40, false), names(&others));

    // No endpoints: the cluster IP and the NodePort reject.
    lab.set_endpoints(&[]);
    let refused =
        lab.client().run(|| Ok(testbed::tcp_exchange(SocketAddr::from((VIP, 80)), TIMEOUT))).unwrap();
    let error = format!("{:#}", refused.unwrap_err());
    assert!(error.contains("refused") || error.contains("unreachable"), "{error}");
    let refused =
        lab.client().run(|| Ok(udp_exchange(SocketAddr::from((NODE, DNS_NODE_PORT)), TIMEOUT))).unwrap();
    assert!(refused.is_err(), "{refused:?}");

    // vipr stops: the rules stay and keep serving; --cleanup removes them.
    lab.set_endpoints(&ENDPOINTS);
    let status = lab.vipr.take().unwrap().stop().unwrap();
    assert!(status.success(), "{status}");
    assert_eq!(lab.reach(frontend(VIP, 80, Protocol::Tcp), 30, false).len(), 3);
    let output =
        vipr_cleanup(&locate_vipr().unwrap(), lab.topology.node(), Path::new("/nonexistent-vipr-bpffs"))
            .unwrap();
    eprintln!("cleanup: {output}");
    let save = lab.node_save();
    // Only the CVE-2020-8558 guard that localhost NodePorts (on by default) ensured stays:
    // kubelet's chain, kept with route_localnet=1, as kube-proxy leaves it.
    let left: Vec<&str> = save.lines().filter(|line| line.contains("KUBE-")).collect();
    assert!(left.iter().all(|line| line.contains("KUBE-FIREWALL")), "{save}");
    let after_cleanup =
        lab.client().run(|| Ok(testbed::tcp_exchange(SocketAddr::from((VIP, 80)), TIMEOUT))).unwrap();
    assert!(after_cleanup.is_err(), "the VIP is no longer served: {after_cleanup:?}");
}

/// `vipr inspect ARGS` in the lab's node namespace (mode detected: no pins, no kube-ipvs0):
/// its stdout, which must come with success.
fn inspect(lab: &IptablesLab, args: &[&str]) -> String {
    let output = lab
        .topology
        .node()
        .command(locate_vipr().unwrap())
        .unwrap()
        .arg("inspect")
        .args(args)
        .arg("--bpf-root=/nonexistent-vipr-bpffs")
        .output()
        .unwrap();
    assert!(output.status.success(), "vipr inspect {args:?}: {}", String::from_utf8_lossy(&output.stderr));
    String::from_utf8(output.stdout).unwrap()
}

#[test]
fn inspect_reads_services_and_flows_from_the_kernel_in_iptables_mode() {
    let mut lab = IptablesLab::start("ipt-inspect");
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
            serde_json::from_str(&inspect(&lab, &["services", "-o", "json"])).unwrap();
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
        let text = inspect(&lab, &["services", "--mode=iptables", "--frontend", "10.96.0.10:80"]);
        assert!(text.lines().any(|line| line.starts_with("TCP") && line.contains("10.96.0.10:80")), "{text}");
        for endpoint in endpoints(8080) {
            assert!(text.contains(&format!("  -> {endpoint}")), "{endpoint} missing:\n{text}");
        }

        // Where the client's connection landed, from conntrack.
        let flows: serde_json::Value =
            serde_json::from_str(&inspect(&lab, &["flows", "-o", "json", "--client", &client])).unwrap();
        let shown = flows["shown"].as_array().unwrap();
        assert_eq!(shown.len(), 1, "{flows:#}");
        assert_eq!(shown[0]["frontend"], "10.96.0.10:80");
        assert_eq!(shown[0]["backend"], SocketAddr::from((backend_addr(&landed), 8080)).to_string().as_str());

        // The conntrack table holds the session, within its capacity.
        let maps: serde_json::Value = serde_json::from_str(&inspect(&lab, &["maps", "-o", "json"])).unwrap();
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
            lab.set_endpoints(&[]);
            let services: serde_json::Value = serde_json::from_str(&inspect(
                &lab,
                &["services", "-o", "json", "--frontend", "10.96.0.10:80"],
            ))
            .unwrap();
            assert_eq!(services.as_array().unwrap().len(), 1, "{services:#}");
            assert_eq!(services[0]["flags"], serde_json::json!(["rejects"]), "{services:#}");
            assert_eq!(services[0]["backends"], serde_json::json!([]), "{services:#}");
            lab.set_endpoints(&ENDPOINTS);
            // The rules outlive the agent: inspect reads them all the same.
            let status = lab.vipr.take().unwrap().stop().unwrap();
            assert!(status.success(), "{status}");
        }
    }
    assert_eq!(session.ask().unwrap().backend, landed);
}
