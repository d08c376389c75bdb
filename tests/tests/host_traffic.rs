//! Traffic from the node itself, end to end on the real kernel: processes in the node
//! namespace reach a ClusterIP service through vipr's socket-level load balancer (cgroup
//! sock_addr programs on the cgroup v2 root), which must leave every other namespace alone.
//! BPF_PROG_TEST_RUN does not run sock_addr programs, so this file is their fixture. IPv6 sockets
//! (and dual-stack ones talking to IPv4-mapped addresses) are checked on the same labs with
//! IPv6 added to the backends' links.
//! Needs root, a cgroup2 mount and a built vipr (`cargo build -p proxy-userspace`, or VIPR_BIN).

use std::{
    collections::{BTreeMap, BTreeSet},
    io::ErrorKind,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket},
    path::Path,
    process::Command,
    time::Duration,
};

use proxy_common::{pins, sock};
use serde_json::Value;
use testbed::{
    container::{cgroup2_mount, Cgroup2Dir},
    exchange, locate_vipr, manifest, tcp_exchange, wait_for, write_atomically, Answer, Check,
    ClusterIpService, EchoServer, Endpoint, Frontend, Lab, LabConfig, LeafSpec, TcpSession,
};

/// Bound on every connect, request and reply.
const TIMEOUT: Duration = Duration::from_secs(2);
/// How long a (re)started agent may take to attach its hooks.
const PROGRAMMING_TIMEOUT: Duration = Duration::from_secs(15);
/// New sockets per check: with three backends chosen at random, the chance that one of them
/// gets none of 60 is 3 * (2/3)^60, about 1e-10.
const CONNECTIONS: usize = 60;

const CLIENT: Ipv4Addr = Ipv4Addr::new(10, 10, 0, 2);
const VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
/// The cluster IP of service `web6`, the IPv6 twin of `web`.
const VIP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x10);

/// The backends of one lab: names, and the second octet of their addresses.
#[derive(Clone, Copy)]
struct Backends {
    endpoints: &'static [&'static str],
    /// Serves like the endpoints but is none: an answer from it is a wrong rewrite.
    decoy: &'static str,
    net: u8,
    /// Target ports of `http` and `dns`.
    ports: (u16, u16),
}

const WEB: Backends =
    Backends { endpoints: &["b1", "b2", "b3"], decoy: "decoy", net: 20, ports: (8080, 5353) };

impl Backends {
    fn addr(self, name: &str) -> Ipv4Addr {
        Ipv4Addr::new(10, self.net, self.index(name), 2)
    }

    /// A backend's IPv6 address, once [`add_ipv6`] gave it one: `fd00:<net>:<index>::2`.
    fn addr6(self, name: &str) -> Ipv6Addr {
        Ipv6Addr::new(0xfd00, self.net.into(), self.index(name).into(), 0, 0, 0, 0, 2)
    }

    /// 1 for the first backend, the decoy last.
    fn index(self, name: &str) -> u8 {
        let index = self
            .endpoints
            .iter()
            .chain([&self.decoy])
            .position(|candidate| *candidate == name)
            .expect("a known backend");
        u8::try_from(index + 1).expect("few backends")
    }

    /// Service `web`: TCP 80 ("http") and UDP 53 ("dns"), served by `endpoints`.
    fn service(self, endpoints: &[&str]) -> ClusterIpService {
        let endpoints = endpoints.iter().map(|name| Endpoint::ready(self.addr(name), name)).collect();
        ClusterIpService::web(VIP, self.ports, endpoints)
    }

    fn all(self) -> BTreeSet<String> {
        self.endpoints.iter().map(|name| (*name).to_owned()).collect()
    }

    /// The node's addresses toward the backends, both families: what a backend sees a node
    /// socket come from.
    fn node_addrs(self) -> BTreeSet<IpAddr> {
        let names = self.endpoints.iter().chain([&self.decoy]);
        names
            .flat_map(|name| [IpAddr::from(gateway(self.addr(name))), gateway6(self.addr6(name)).into()])
            .collect()
    }
}

fn gateway(addr: Ipv4Addr) -> Ipv4Addr {
    let [a, b, c, _] = addr.octets();
    Ipv4Addr::new(a, b, c, 1)
}

fn gateway6(addr: Ipv6Addr) -> Ipv6Addr {
    let [a, b, c, d, ..] = addr.segments();
    Ipv6Addr::new(a, b, c, d, 0, 0, 0, 1)
}

fn http() -> Frontend {
    WEB.service(&[]).frontend_named("http").unwrap()
}

fn dns() -> Frontend {
    WEB.service(&[]).frontend_named("dns").unwrap()
}

/// A lab with `backends`, serving all its endpoints, vipr started and the service programmed.
fn running_lab(label: &str, backends: Backends) -> Lab {
    let mut lab = new_lab(label, backends);
    lab.start_vipr().unwrap();
    lab.wait_programmed().unwrap();
    lab
}

/// A lab with `backends`, serving all its endpoints, vipr not started.
fn new_lab(label: &str, backends: Backends) -> Lab {
    let leaves = backends
        .endpoints
        .iter()
        .chain([&backends.decoy])
        .map(|name| LeafSpec::in_own_slash24(name, backends.addr(name)).unwrap())
        .collect();
    Lab::new(LabConfig {
        label: label.to_owned(),
        vipr_binary: locate_vipr().unwrap(),
        client: LeafSpec::in_own_slash24("client", CLIENT).unwrap(),
        backends: leaves,
        services: vec![backends.service(backends.endpoints)],
    })
    .unwrap()
}

/// How a node socket met the service.
#[derive(Debug)]
struct NodeExchange {
    answer: Answer,
    /// The socket's own address (for an unconnected UDP socket: unspecified, with its port).
    local: SocketAddr,
    /// Whom the socket sees as peer: getpeername for TCP and connected UDP, the source
    /// recvfrom reports for unconnected UDP.
    peer: SocketAddr,
}

impl NodeExchange {
    /// The peer must be the frontend, and the backend must see this socket itself, from one
    /// of the node's addresses toward the backends. (A dual-stack socket that asked for an
    /// IPv4-mapped frontend shows IPv4-mapped addresses; the backend sees plain IPv4.)
    fn verify(&self, frontend: SocketAddr, backends: Backends) {
        assert_eq!(self.peer, frontend, "{frontend}: the socket's peer is not the frontend: {self:?}");
        let observed = self.answer.observed_client;
        assert_eq!(observed.port(), self.local.port(), "{frontend}: the backend saw another port: {self:?}");
        assert!(
            backends.node_addrs().contains(&observed.ip()),
            "{frontend}: the backend saw {observed}: {self:?}"
        );
        if !self.local.ip().is_unspecified() {
            assert_eq!(
                observed.ip(),
                self.local.ip().to_canonical(),
                "{frontend}: the backend saw another address: {self:?}"
            );
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum NodeSocket {
    Tcp,
    ConnectedUdp,
    UnconnectedUdp,
}

/// The unspecified address of `dst`'s family, port 0: where a client socket binds.
fn any_port(dst: SocketAddr) -> SocketAddr {
    match dst {
        SocketAddr::V4(_) => (Ipv4Addr::UNSPECIFIED, 0).into(),
        SocketAddr::V6(_) => (Ipv6Addr::UNSPECIFIED, 0).into(),
    }
}

/// One exchange from a fresh socket; call it inside the node namespace.
fn node_exchange(kind: NodeSocket, dst: SocketAddr) -> anyhow::Result<NodeExchange> {
    match kind {
        NodeSocket::Tcp => {
            let mut session = TcpSession::connect(dst, TIMEOUT)?;
            let answer = session.ask()?;
            Ok(NodeExchange { answer, local: session.local_addr()?, peer: session.peer_addr()? })
        }
        NodeSocket::ConnectedUdp => {
            let socket = UdpSocket::bind(any_port(dst))?;
            socket.set_read_timeout(Some(TIMEOUT))?;
            socket.connect(dst)?;
            socket.send(b"who are you?")?;
            let mut reply = [0u8; 1500];
            let (len, from) = socket.recv_from(&mut reply)?;
            let answer: Answer = std::str::from_utf8(&reply[..len])?.parse()?;
            let peer = socket.peer_addr()?;
            anyhow::ensure!(from == peer, "recvfrom says {from}, getpeername {peer}");
            Ok(NodeExchange { answer, local: socket.local_addr()?, peer })
        }
        NodeSocket::UnconnectedUdp => {
            let socket = UdpSocket::bind(any_port(dst))?;
            socket.set_read_timeout(Some(TIMEOUT))?;
            socket.send_to(b"who are you?", dst)?;
            let mut reply = [0u8; 1500];
            let (len, peer) = socket.recv_from(&mut reply)?;
            let answer = std::str::from_utf8(&reply[..len])?.parse()?;
            Ok(NodeExchange { answer, local: socket.local_addr()?, peer })
        }
    }
}

/// `count` exchanges of `kind` from the node, each from a new socket and checked; returns how
/// many each backend answered.
fn node_spread(
    lab: &Lab,
    backends: Backends,
    kind: NodeSocket,
    frontend: SocketAddr,
) -> BTreeMap<String, usize> {
    let exchanges = lab
        .node()
        .run(|| (0..CONNECTIONS).map(|_| node_exchange(kind, frontend)).collect::<anyhow::Result<Vec<_>>>())
        .unwrap_or_else(|error| panic!("{kind:?} to {frontend} from the node: {error:#}"));
    let mut counts = BTreeMap::new();
    for exchange in &exchanges {
        exchange.verify(frontend, backends);
        *counts.entry(exchange.answer.backend.clone()).or_insert(0) += 1;
    }
    eprintln!("node {kind:?} {frontend}: {counts:?}");
    counts
}

fn names(counts: &BTreeMap<String, usize>) -> BTreeSet<String> {
    counts.keys().cloned().collect()
}

// bpftool, as an operator would look.

fn bpftool(args: &[&str]) -> Value {
    let output = Command::new("bpftool").arg("-j").args(args).output().expect("bpftool runs");
    assert!(output.status.success(), "bpftool {args:?}: {}", String::from_utf8_lossy(&output.stderr));
    // A listing of nothing is no output at all.
    if output.stdout.trim_ascii().is_empty() {
        return Value::Array(Vec::new());
    }
    serde_json::from_slice(&output.stdout).unwrap_or_else(|error| panic!("bpftool {args:?}: {error}"))
}

fn pinned_map(bpf_root: &Path, name: &str) -> String {
    bpf_root.join(pins::DIR).join(name).display().to_string()
}

fn map_id(bpf_root: &Path, name: &str) -> u64 {
    bpftool(&["map", "show", "pinned", &pinned_map(bpf_root, name)])["id"].as_u64().expect("a map id")
}

fn map_entries(bpf_root: &Path, name: &str) -> Vec<Value> {
    bpftool(&["map", "dump", "pinned", &pinned_map(bpf_root, name)]).as_array().cloned().unwrap_or_default()
}

/// A cgroup link of the kernel: (link id, program id, attach type).
type CgroupLink = (u64, u64, String);

/// The cgroup links whose program uses map `config_map`: this lab's hooks, and no other
/// agent's (their programs have maps of their own).
fn links_using(config_map: u64) -> Vec<CgroupLink> {
    let links = bpftool(&["link", "show"]);
    links
        .as_array()
        .unwrap()
        .iter()
        .filter(|link| link["type"] == "cgroup")
        .filter_map(|link| {
            let program = link["prog_id"].as_u64()?;
            let maps = Command::new("bpftool")
                .args(["-j", "prog", "show", "id", &program.to_string()])
                .output()
                .ok()
                .filter(|output| output.status.success())
                .and_then(|output| serde_json::from_slice::<Value>(&output.stdout).ok())?;
            let uses = maps["map_ids"].as_array()?.iter().any(|id| id.as_u64() == Some(config_map));
            if !uses {
                return None;
            }
            Some((link["id"].as_u64()?, program, link["attach_type"].as_str()?.to_owned()))
        })
        .collect()
}

fn link_ids() -> BTreeSet<u64> {
    bpftool(&["link", "show"]).as_array().unwrap().iter().filter_map(|link| link["id"].as_u64()).collect()
}

/// Program ids attached to the cgroup v2 root (`bpftool cgroup show`), any owner.
fn root_cgroup_programs() -> BTreeSet<u64> {
    let root = cgroup2_mount().unwrap();
    bpftool(&["cgroup", "show", root.to_str().unwrap()])
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|program| program["id"].as_u64())
        .collect()
}

/// The lab's cgroup hooks, as attach type -> (link id, program id).
fn lab_hooks_now(lab: &Lab) -> BTreeMap<String, (u64, u64)> {
    links_using(map_id(lab.bpf_root(), sock::CONFIG))
        .into_iter()
        .map(|(link, program, attach_type)| (attach_type, (link, program)))
        .collect()
}

/// [`lab_hooks_now`], failing unless there are exactly the eight hooks (four per family), one
/// link each.
fn lab_hooks(lab: &Lab) -> BTreeMap<String, (u64, u64)> {
    let links = links_using(map_id(lab.bpf_root(), sock::CONFIG));
    let hooks: BTreeMap<String, (u64, u64)> =
        links.iter().map(|(link, program, attach_type)| (attach_type.clone(), (*link, *program))).collect();
    assert_eq!(links.len(), sock::HOOKS.len(), "not exactly one cgroup link per hook: {links:?}");
    let attach_types: BTreeSet<&str> = hooks.keys().map(String::as_str).collect();
    assert_eq!(
        attach_types,
        BTreeSet::from([
            "cgroup_inet4_connect",
            "cgroup_udp4_sendmsg",
            "cgroup_udp4_recvmsg",
            "cgroup_inet4_getpeername",
            "cgroup_inet6_connect",
            "cgroup_udp6_sendmsg",
            "cgroup_udp6_recvmsg",
            "cgroup_inet6_getpeername",
        ]),
        "{hooks:?}"
    );
    hooks
}

#[test]
fn node_sockets_reach_the_endpoints_and_see_the_frontend() {
    let lab = running_lab("host-spread", WEB);
    for (kind, frontend) in
        [(NodeSocket::Tcp, http()), (NodeSocket::ConnectedUdp, dns()), (NodeSocket::UnconnectedUdp, dns())]
    {
        let frontend = frontend.socket_addr();
        let counts = node_spread(&lab, WEB, kind, frontend);
        assert_eq!(
            names(&counts),
            WEB.all(),
            "{kind:?} to {frontend} must reach every endpoint and nothing else"
        );
    }
    // An unconnected socket's datagrams stay on one backend, as a conntrack entry would keep
    // them, and each reply shows the frontend as its source.
    let answers = lab
        .node()
        .run(|| {
            let socket = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))?;
            socket.set_read_timeout(Some(TIMEOUT))?;
            (0..10)
                .map(|_| {
                    socket.send_to(b"who are you?", dns().socket_addr())?;
                    let mut reply = [0u8; 1500];
                    let (len, from) = socket.recv_from(&mut reply)?;
                    anyhow::ensure!(from == dns().socket_addr(), "a reply from {from}");
                    Ok(std::str::from_utf8(&reply[..len])?.parse::<Answer>()?.backend)
                })
                .collect::<anyhow::Result<BTreeSet<String>>>()
        })
        .unwrap();
    assert_eq!(answers.len(), 1, "one socket's datagrams went to {answers:?}");
    // The node's connections never pass TC: nothing of them is in the flows map.
    let flows = map_entries(lab.bpf_root(), pins::FLOWS4);
    assert!(flows.is_empty(), "node connections were tracked by the TC program: {flows:?}");
    // The tests' cgroup2 mount is the hierarchy's root: no warning that it is not.
    let said = std::fs::read_to_string(lab.vipr().unwrap().log_path()).unwrap();
    assert!(!said.contains(NOT_THE_ROOT), "a warning on the hierarchy's root: {said}");
}

/// What the agent says when the cgroup2 mount it finds is not the hierarchy's root.
const NOT_THE_ROOT: &str = "the cgroup2 mount is not the root of the node's cgroup hierarchy";

/// A pod whose cgroup namespace is private (containerd's and CRI-O's default on cgroup v2) and
/// that lacks the host's `/sys/fs/cgroup` finds only its namespace's own cgroup2 mount, rooted
/// at its own cgroup: hooks there would balance nothing but the agent. The agent says so, and
/// its TC datapath serves as ever. (Its counterpart, no such warning on the real root, is
/// checked by [`node_sockets_reach_the_endpoints_and_see_the_frontend`].)
#[test]
fn an_agent_in_a_cgroup_namespace_says_its_hooks_cover_only_that_and_serves_on() {
    let cgroup = Cgroup2Dir::create().unwrap();
    let lab = new_lab("host-cgns", WEB);
    let log = lab.services_file().with_file_name("vipr-cgns.log");
    let procs = cgroup.path().join("cgroup.procs");
    let mount = cgroup2_mount().unwrap();
    // Into the lab's cgroup, then a cgroup namespace rooted there (unshare's is rooted at the
    // caller's cgroup) with a mount namespace of its own, where the tests' cgroup2 mount gives
    // way to a fresh one that shows that namespace's subtree only, as a pod's own
    // /sys/fs/cgroup does. (The kernel refuses the hierarchy mounted over itself.)
    let script = "echo $$ > \"$0\" && exec unshare --cgroup --mount --propagation private \
                  sh -c 'umount -l \"$0\" && mount -t cgroup2 cgroup2 \"$0\" && exec \"$@\"' \"$@\"";
    let wrapper = ["sh", "-c", script, procs.to_str().unwrap(), mount.to_str().unwrap()];
    let mut agent = lab.spawn_vipr_through(&wrapper, &[], &log).unwrap();
    wait_for("the agent to warn of its cgroup namespace", PROGRAMMING_TIMEOUT, || {
        agent.ensure_running()?;
        let said = std::fs::read_to_string(&log)?;
        Ok(match said.lines().find(|line| line.contains(NOT_THE_ROOT)) {
            Some(line) => Check::Done(line.to_owned()),
            None => Check::NotYet(said.lines().last().unwrap_or_default().to_owned()),
        })
    })
    .unwrap();
    let reached = wait_for("the client to reach every endpoint by TC", PROGRAMMING_TIMEOUT, || {
        agent.ensure_running()?;
        Ok(match lab.backends_reached(http(), CONNECTIONS, TIMEOUT) {
            Ok(reached) if reached == WEB.all() => Check::Done(reached),
            Ok(reached) => Check::NotYet(format!("{reached:?}")),
            Err(error) => Check::NotYet(format!("{error:#}")),
        })
    });
    agent.stop().unwrap();
    reached.unwrap();
}

#[test]
fn another_namespace_is_left_to_the_tc_datapath() {
    let lab = running_lab("host-other-ns", WEB);
    // Node sockets first, so that the reverse map has entries of its own.
    node_spread(&lab, WEB, NodeSocket::Tcp, http().socket_addr());
    let translations = map_entries(lab.bpf_root(), sock::REVERSE4).len();
    assert!(
        translations >= CONNECTIONS,
        "only {translations} reverse translations for {CONNECTIONS} connections"
    );

    let mut seen = BTreeSet::new();
    for frontend in [http(), dns()] {
        for _ in 0..CONNECTIONS {
            let exchange = lab.client().run(|| exchange(frontend, TIMEOUT)).unwrap();
            // The TC program's semantics: transparent, the client's own address preserved.
            exchange.verify(frontend, CLIENT).unwrap();
            seen.insert((frontend.protocol, exchange.client_port, exchange.answer.backend));
        }
    }
    let backends: BTreeSet<&String> = seen.iter().map(|(_, _, backend)| backend).collect();
    assert_eq!(backends.len(), WEB.endpoints.len(), "client connections reached {backends:?}");
    // Every client connection was balanced by the TC program (it tracked it)...
    let flows = map_entries(lab.bpf_root(), pins::FLOWS4);
    let tracked: BTreeSet<(u8, u64)> = flows
        .iter()
        .filter_map(|flow| {
            let key = &flow["formatted"]["key"];
            let src: Vec<u64> = key["src_addr"].as_array()?.iter().filter_map(Value::as_u64).collect();
            let dst: Vec<u64> = key["dst_addr"].as_array()?.iter().filter_map(Value::as_u64).collect();
            (src == [10, 10, 0, 2] && dst == [10, 96, 0, 10])
                .then(|| Some((u8::try_from(key["proto"].as_u64()?).ok()?, key["src_port"].as_u64()?)))?
        })
        .collect();
    for (protocol, port, backend) in &seen {
        assert!(
            tracked.contains(&(protocol.number(), u64::from(*port))),
            "{protocol} from port {port} (to {backend}) was not tracked by TC"
        );
    }
    // ...and the node's hooks left its sockets alone: no translation was recorded for them.
    assert_eq!(
        map_entries(lab.bpf_root(), sock::REVERSE4).len(),
        translations,
        "client sockets were translated"
    );
}

#[test]
fn two_agents_each_balance_only_their_own_node() {
    // The same service address in both; backends that the other node cannot even route to.
    const OTHER: Backends =
        Backends { endpoints: &["x1", "x2"], decoy: "xdecoy", net: 30, ports: (9090, 9053) };
    let lab = running_lab("host-two-a", WEB);
    let other = running_lab("host-two-b", OTHER);
    for _ in 0..2 {
        for (lab, backends) in [(&lab, WEB), (&other, OTHER)] {
            for (kind, frontend) in [(NodeSocket::Tcp, http()), (NodeSocket::UnconnectedUdp, dns())] {
                let counts = node_spread(lab, backends, kind, frontend.socket_addr());
                assert_eq!(names(&counts), backends.all(), "{kind:?} from a node with its own agent");
            }
        }
    }
}

/// How a TCP connect to `tcp`, a UDP connect to `udp` and a datagram sent to `udp` from the
/// node fail (`None`: they did not fail).
fn node_errors(lab: &Lab, tcp: SocketAddr, udp: SocketAddr) -> [Option<ErrorKind>; 3] {
    lab.node()
        .run(|| {
            let tcp = TcpSession::connect(tcp, TIMEOUT).map(drop);
            let connected = UdpSocket::bind(any_port(udp))?.connect(udp);
            let unconnected = UdpSocket::bind(any_port(udp))?.send_to(b"who are you?", udp).map(drop);
            let kind = |result: std::io::Result<()>| result.err().map(|error| error.kind());
            Ok([
                tcp.err().and_then(|error| error.downcast_ref::<std::io::Error>().map(std::io::Error::kind)),
                kind(connected),
                kind(unconnected),
            ])
        })
        .unwrap()
}

#[test]
fn an_empty_service_refuses_node_connections() {
    let mut lab = running_lab("host-empty", WEB);
    lab.set_services(vec![WEB.service(&[])]).unwrap();
    lab.wait_programmed().unwrap();
    // kube-proxy rejects with ICMP port unreachable, which a TCP or connected UDP socket
    // reports as ECONNREFUSED; the hooks refuse the call itself with that error.
    assert_eq!(
        node_errors(&lab, http().socket_addr(), dns().socket_addr()),
        [Some(ErrorKind::ConnectionRefused); 3],
        "TCP, connected UDP, unconnected UDP"
    );
    // A client elsewhere still meets the TC program's reject.
    let error = lab.client().run(|| tcp_exchange(http().socket_addr(), TIMEOUT)).unwrap_err();
    let refused = error.chain().any(|cause| {
        cause
            .downcast_ref::<std::io::Error>()
            .is_some_and(|error| error.kind() == ErrorKind::ConnectionRefused)
    });
    assert!(refused, "the client was not refused: {error:#}");

    // Endpoints again: served again.
    lab.set_services(vec![WEB.service(WEB.endpoints)]).unwrap();
    lab.wait_programmed().unwrap();
    assert_eq!(names(&node_spread(&lab, WEB, NodeSocket::Tcp, http().socket_addr())), WEB.all());
}

#[test]
fn restarts_update_the_hooks_in_place_and_cleanup_removes_them() {
    let mut lab = running_lab("host-restart", WEB);
    let hooks = lab_hooks(&lab);
    assert!(root_cgroup_programs().is_superset(&hooks.values().map(|(_, program)| *program).collect()));
    let mut session = lab.node().run(|| TcpSession::connect(http().socket_addr(), TIMEOUT)).unwrap();
    let backend = session.ask().unwrap().backend;
    assert_eq!(session.peer_addr().unwrap(), http().socket_addr());

    // Stopped: the hooks stay attached and keep balancing.
    let status = lab.stop_vipr().unwrap();
    assert!(status.success(), "vipr exited with {status} on SIGTERM");
    assert_eq!(lab_hooks(&lab), hooks, "SIGTERM changed the hooks");
    assert_eq!(
        names(&node_spread(&lab, WEB, NodeSocket::Tcp, http().socket_addr())),
        WEB.all(),
        "while vipr is stopped"
    );
    assert_eq!(session.ask().unwrap().backend, backend);

    // Restarted: the same links, now running the new agent's programs; no second set.
    lab.start_vipr().unwrap();
    // The maps already hold the service, so wait for the hooks themselves.
    let old_programs: BTreeSet<u64> = hooks.values().map(|(_, program)| *program).collect();
    let restarted = wait_for("the restarted agent's programs on the links", PROGRAMMING_TIMEOUT, || {
        let now = lab_hooks_now(&lab);
        Ok(
            if now.len() == sock::HOOKS.len()
                && now.values().all(|(_, program)| !old_programs.contains(program))
            {
                Check::Done(now)
            } else {
                Check::NotYet(format!("{now:?}"))
            },
        )
    })
    .unwrap();
    assert_eq!(
        restarted.iter().map(|(attach_type, (link, _))| (attach_type, link)).collect::<Vec<_>>(),
        hooks.iter().map(|(attach_type, (link, _))| (attach_type, link)).collect::<Vec<_>>(),
        "new links instead of updated ones"
    );
    lab_hooks(&lab);
    // TCP only from here on: an echo server's UDP thread ends on a spurious EINTR (testbed
    // echo.rs), which stopping an agent here provokes now and then.
    assert_eq!(
        names(&node_spread(&lab, WEB, NodeSocket::Tcp, http().socket_addr())),
        WEB.all(),
        "after the restart"
    );
    assert_eq!(session.ask().unwrap().backend, backend, "an open connection moved");
    assert_eq!(session.peer_addr().unwrap(), http().socket_addr(), "the reverse translation was lost");

    // Cleanup: every hook detached, the node's traffic is no longer balanced.
    lab.stop_vipr().unwrap();
    lab.cleanup_vipr().unwrap();
    let remaining = link_ids();
    let attached = root_cgroup_programs();
    for (attach_type, (link, program)) in &restarted {
        assert!(!remaining.contains(link), "{attach_type}: link {link} survived vipr --cleanup");
        assert!(!attached.contains(program), "{attach_type}: program {program} is still on the cgroup root");
    }
    drop(session);
    let after = lab.node().run(|| Ok(node_exchange(NodeSocket::Tcp, http().socket_addr()))).unwrap();
    assert!(after.is_err(), "the cluster IP is still balanced after vipr --cleanup: {after:?}");
}

// ---------------------------------------------------------------------------------------------
// IPv6: `AF_INET6` sockets of the node reach an IPv6 service through the `*6` hooks; a dual-stack
// socket naming the IPv4 service by its IPv4-mapped address goes through them too, and is
// balanced with the IPv4 maps (its packets are IPv4).

fn http6() -> SocketAddr {
    (VIP6, 80).into()
}

fn dns6() -> SocketAddr {
    (VIP6, 53).into()
}

/// `addr` as a dual-stack socket names it: IPv4-mapped.
fn mapped(addr: SocketAddr) -> SocketAddr {
    match addr {
        SocketAddr::V4(v4) => (v4.ip().to_ipv6_mapped(), v4.port()).into(),
        v6 @ SocketAddr::V6(_) => v6,
    }
}

/// Gives every backend of the lab an IPv6 address on its link (the node takes `::1` of each
/// /64) and IPv6 echo servers on the target ports; the servers stop when dropped.
fn add_ipv6(lab: &Lab, backends: Backends) -> Vec<EchoServer> {
    let names = backends.endpoints.iter().chain([&backends.decoy]);
    names
        .map(|name| {
            let leaf = lab.topology().leaf(name).unwrap();
            let addr = backends.addr6(name);
            // nodad: usable at once, not after duplicate address detection.
            let add = |netns: &testbed::Netns, addr: Ipv6Addr, device: &str| {
                netns.ip(&["-6", "addr", "add", &format!("{addr}/64"), "dev", device, "nodad"]).unwrap()
            };
            add(&leaf.netns, addr, &leaf.spec.leaf_interface);
            add(lab.node(), gateway6(addr), &leaf.spec.node_interface);
            let (tcp, udp) = ([(addr, backends.ports.0).into()], [(addr, backends.ports.1).into()]);
            EchoServer::start(&leaf.netns, name, &tcp, &udp).unwrap()
        })
        .collect()
}

/// Writes the services file: the lab's services, and `web6` (`web`'s ports on VIP6, IPv6 only)
/// served by `endpoints`' IPv6 addresses.
fn write_services_with_web6(lab: &Lab, backends: Backends, endpoints: &[&str]) {
    let endpoints: String = endpoints
        .iter()
        .map(|name| format!("\n- addresses: [\"{}\"]\n  conditions: {{ready: true}}", backends.addr6(name)))
        .collect();
    let endpoints = if endpoints.is_empty() { " []".to_owned() } else { endpoints };
    let (http, dns) = backends.ports;
    let web6 = format!(
        r#"apiVersion: v1
kind: Service
metadata: {{name: web6, namespace: default}}
spec:
  type: ClusterIP
  clusterIP: "{VIP6}"
  clusterIPs: ["{VIP6}"]
  ipFamilies: [IPv6]
  ports:
  - {{name: http, protocol: TCP, port: 80, targetPort: {http}}}
  - {{name: dns, protocol: UDP, port: 53, targetPort: {dns}}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web6-slice
  namespace: default
  labels: {{kubernetes.io/service-name: web6}}
addressType: IPv6
ports:
- {{name: http, protocol: TCP, port: {http}}}
- {{name: dns, protocol: UDP, port: {dns}}}
endpoints:{endpoints}
"#
    );
    let services = format!("{}---\n{web6}", manifest::render(lab.services()));
    write_atomically(lab.services_file(), &services).unwrap();
}

/// Waits until node sockets meet `web6` as `expected` says: answered, or failing with that
/// error for TCP, connected UDP and unconnected UDP alike.
fn wait_for_web6(lab: &Lab, expected: Option<ErrorKind>) {
    wait_for("vipr to program web6", PROGRAMMING_TIMEOUT, || {
        let errors = node_errors(lab, http6(), dns6());
        Ok(if errors == [expected; 3] { Check::Done(()) } else { Check::NotYet(format!("{errors:?}")) })
    })
    .unwrap();
}

#[test]
fn ipv6_node_sockets_reach_the_endpoints_and_see_the_frontend() {
    let lab = running_lab("host-v6", WEB);
    let _servers6 = add_ipv6(&lab, WEB);
    write_services_with_web6(&lab, WEB, WEB.endpoints);
    wait_for_web6(&lab, None);
    let cases = [
        (NodeSocket::Tcp, http6()),
        (NodeSocket::ConnectedUdp, dns6()),
        (NodeSocket::UnconnectedUdp, dns6()),
        // A dual-stack socket naming the IPv4 service.
        (NodeSocket::Tcp, mapped(http().socket_addr())),
        (NodeSocket::ConnectedUdp, mapped(dns().socket_addr())),
        (NodeSocket::UnconnectedUdp, mapped(dns().socket_addr())),
    ];
    for (kind, frontend) in cases {
        let counts = node_spread(&lab, WEB, kind, frontend);
        assert_eq!(
            names(&counts),
            WEB.all(),
            "{kind:?} to {frontend} must reach every endpoint and nothing else"
        );
    }
    // Each family's translations went to its own reverse map (the mapped ones to IPv4's), and
    // no node connection passed the TC program.
    for (reverse, at_least) in [(sock::REVERSE6, 2 * CONNECTIONS), (sock::REVERSE4, 2 * CONNECTIONS)] {
        let translations = map_entries(lab.bpf_root(), reverse).len();
        assert!(translations >= at_least, "{reverse}: {translations} translations, want {at_least}");
    }
    for flows in [pins::FLOWS4, pins::FLOWS6] {
        let tracked = map_entries(lab.bpf_root(), flows);
        assert!(tracked.is_empty(), "node connections were tracked by the TC program: {tracked:?}");
    }

    // No endpoint: refused as the IPv4 hooks refuse.
    write_services_with_web6(&lab, WEB, &[]);
    wait_for_web6(&lab, Some(ErrorKind::ConnectionRefused));
    // Endpoints again: served again.
    write_services_with_web6(&lab, WEB, &WEB.endpoints[..1]);
    wait_for_web6(&lab, None);
    let counts = node_spread(&lab, WEB, NodeSocket::Tcp, http6());
    assert_eq!(names(&counts), BTreeSet::from([WEB.endpoints[0].to_owned()]));
}
