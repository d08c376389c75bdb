//! vipr's XDP fast path end to end, with real traffic through the vipr binary: an external
//! client reaches NodePorts whose endpoints live in three backend namespaces, through a node
//! namespace where vipr runs on veths; a pod namespace reaches the same NodePorts.
//!
//! What proves that XDP, not TC, handled the client's packets: veth counts, per receive queue,
//! the frames its native XDP program redirected (`rx_queue_N_xdp_redirect` of `ethtool -S`),
//! and nothing else increments that counter. Every TCP segment and UDP datagram the client's
//! namespace sends (its own SNMP counters) must show up there. TC's path redirects with
//! `bpf_redirect_neigh`, which the counter never sees, so the test fails when TC is the one.
//!
//! The veth set-up XDP needs: the external client sends with tx checksum offload off, as a NIC
//! delivers frames with complete checksums (a veth would otherwise hand XDP CHECKSUM_PARTIAL
//! packets); the backends' ends have GRO on, which gives them the NAPI that frames redirected
//! to their peer need. The pod keeps its offload on: its packets are CHECKSUM_PARTIAL, and
//! must pass XDP untouched.
//!
//! Without `--xdp`, vipr must leave every veth to TC; that test gives vipr a sysfs of the node
//! namespace, which it judges devices by.
//!
//! The same lab with IPv6 addresses on every link and an IPv6 NodePort service shows XDP's
//! IPv6 path end to end: the external client's IPv6 TCP and UDP go through `vipr_xdp`.
//!
//! Needs root and a built vipr (`cargo build -p proxy-userspace`, or VIPR_BIN).

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4},
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{ensure, Context as _, Result};
use serde_json::json;
use testbed::{
    count_by_backend, ethtool, exchanges, locate_vipr, tcp_exchange, udp_exchange, wait_for,
    write_atomically, BpfFs, Check, EchoServer, Exchange, Frontend, LeafSpec, Netns, PinnedMaps, Protocol,
    Topology, Vipr, WorkDir,
};

/// Bound on every connect, request and reply.
const TIMEOUT: Duration = Duration::from_secs(2);
/// How long vipr may take to program the services.
const PROGRAMMING_TIMEOUT: Duration = Duration::from_secs(15);
/// How long the last packets of closed connections may take to be counted.
const SETTLE: Duration = Duration::from_secs(5);
/// New connections per check: with three endpoints chosen at random, the chance that one
/// gets none of 60 is 3 * (2/3)^60, about 1e-10; with two, 2 * (1/2)^60.
const CONNECTIONS: usize = 60;

const NODE_NAME: &str = "xdp-node";
const EXTERNAL: Ipv4Addr = Ipv4Addr::new(192, 168, 77, 2);
/// The node's address on the external client's link: where the NodePorts are served.
const NODE_EXTERNAL: Ipv4Addr = Ipv4Addr::new(192, 168, 77, 1);
const CLUSTER_CIDR: &str = "10.0.0.0/16";
const POD: Ipv4Addr = Ipv4Addr::new(10, 0, 1, 2);
const BACKENDS: [&str; 3] = ["b1", "b2", "b3"];
const TCP_TARGET: u16 = 8080;
const UDP_TARGET: u16 = 5353;
/// `sh -c` with vipr's path, a scratch directory and vipr's arguments: execs vipr with sysfs
/// mounted for the current network namespace where vipr looks up devices (`|| exit`: vipr
/// must not start with a half-replaced view).
const OWN_SYSFS: &str = concat!(
    r#"dir=$1; shift; mount -t sysfs sysfs "$dir" && "#,
    r#"for sub in class/net devices bus; do mount --bind "$dir/$sub" "/sys/$sub" || exit; done && "#,
    r#"exec "$0" "$@""#,
);

fn backend_addr(name: &str) -> Ipv4Addr {
    let index = BACKENDS.iter().position(|backend| *backend == name).expect("a known backend");
    Ipv4Addr::new(10, 0, u8::try_from(index + 2).expect("few backends"), 2)
}

/// The node's address on `backend`'s link: the source a masqueraded connection has there.
fn node_addr_toward(backend: &str) -> Ipv4Addr {
    let [a, b, c, _] = backend_addr(backend).octets();
    Ipv4Addr::new(a, b, c, 1)
}

/// The external client's and the node's IPv6 addresses on their link (the IPv6 lab).
const EXTERNAL6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x77, 0, 0, 0, 0, 0, 2);
const NODE_EXTERNAL6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x77, 0, 0, 0, 0, 0, 1);
/// The IPv6 NodePort service's ports (externalTrafficPolicy Cluster, every backend).
const TCP_NODE_PORT6: u16 = 30090;
const UDP_NODE_PORT6: u16 = 30091;

/// `backend`'s IPv6 address in the IPv6 lab: `fd00:<leaf index + 1>::2`.
fn backend_addr6(lab: &XdpLab, backend: &str) -> Result<Ipv6Addr> {
    let index = lab
        .topology
        .leaves()
        .iter()
        .position(|leaf| leaf.spec.name == backend)
        .with_context(|| format!("no leaf {backend}"))?;
    Ok(Ipv6Addr::new(0xfd00, u16::try_from(index + 1)?, 0, 0, 0, 0, 0, 2))
}

/// An IPv6 NodePort service with a TCP and a UDP port, its endpoints every backend.
fn manifests6(lab: &XdpLab) -> Result<String> {
    let service = json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "cluster6", "namespace": "default"},
        "spec": {
            "type": "NodePort", "clusterIP": "fd00:96::10", "clusterIPs": ["fd00:96::10"],
            "ipFamilies": ["IPv6"], "ipFamilyPolicy": "SingleStack",
            "ports": [
                {"name": "tcp", "protocol": "TCP", "port": 80, "targetPort": TCP_TARGET, "nodePort": TCP_NODE_PORT6},
                {"name": "udp", "protocol": "UDP", "port": 53, "targetPort": UDP_TARGET, "nodePort": UDP_NODE_PORT6},
            ],
        }
    });
    let endpoints = BACKENDS
        .iter()
        .map(|backend| {
            Ok(json!({"addresses": [backend_addr6(lab, backend)?.to_string()], "conditions": {"ready": true},
                      "nodeName": NODE_NAME}))
        })
        .collect::<Result<Vec<_>>>()?;
    let slice = json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": "cluster6-1", "namespace": "default",
                     "labels": {"kubernetes.io/service-name": "cluster6"}},
        "addressType": "IPv6",
        "ports": [
            {"name": "tcp", "protocol": "TCP", "port": TCP_TARGET},
            {"name": "udp", "protocol": "UDP", "port": UDP_TARGET},
        ],
        "endpoints": endpoints,
    });
    Ok(format!("{service}\n---\n{slice}\n---\n"))
}

/// The NodePorts of the lab's two services.
#[derive(Clone, Copy, Debug)]
struct NodePort {
    /// `cluster`: externalTrafficPolicy Cluster (masqueraded, every endpoint) or `local`
    /// (client address kept, this node's endpoints b1 and b2 only: b3 is on another node).
    service: &'static str,
    protocol: Protocol,
    node_port: u16,
}

impl NodePort {
    const ALL: [Self; 4] = [
        Self { service: "cluster", protocol: Protocol::Tcp, node_port: 30080 },
        Self { service: "cluster", protocol: Protocol::Udp, node_port: 30053 },
        Self { service: "local", protocol: Protocol::Tcp, node_port: 30081 },
        Self { service: "local", protocol: Protocol::Udp, node_port: 30054 },
    ];

    fn frontend(self) -> Frontend {
        Frontend { addr: SocketAddrV4::new(NODE_EXTERNAL, self.node_port), protocol: self.protocol }
    }

    fn masqueraded(self) -> bool {
        self.service == "cluster"
    }

    /// The endpoints traffic from outside reaches.
    fn endpoints(self) -> &'static [&'static str] {
        if self.masqueraded() {
            &BACKENDS
        } else {
            &BACKENDS[..2]
        }
    }

    fn target_port(self) -> u16 {
        match self.protocol {
            Protocol::Tcp => TCP_TARGET,
            Protocol::Udp => UDP_TARGET,
            Protocol::Sctp => unreachable!("this test has no SCTP ports"),
        }
    }
}

/// Both services, each with a TCP and a UDP NodePort (one JSON document per object).
fn manifests() -> String {
    let mut documents = Vec::new();
    for (index, service) in ["cluster", "local"].into_iter().enumerate() {
        let ports: Vec<_> = NodePort::ALL.iter().filter(|port| port.service == service).collect();
        let name = |port: &NodePort| port.protocol.to_string().to_lowercase();
        let cluster_ip = format!("10.96.0.{}", 10 + index);
        documents.push(json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": service, "namespace": "default"},
            "spec": {
                "type": "NodePort", "clusterIP": cluster_ip, "clusterIPs": [cluster_ip],
                "externalTrafficPolicy": if service == "cluster" { "Cluster" } else { "Local" },
                "ports": ports.iter().enumerate().map(|(i, port)| json!({
                    "name": name(port), "protocol": port.protocol.to_string(), "port": 80 + i,
                    "targetPort": port.target_port(), "nodePort": port.node_port,
                })).collect::<Vec<_>>(),
            }
        }));
        let endpoints: Vec<_> = BACKENDS
            .iter()
            .map(|backend| {
                let node = if *backend == "b3" && service == "local" { "elsewhere" } else { NODE_NAME };
                json!({"addresses": [backend_addr(backend).to_string()], "conditions": {"ready": true},
                       "nodeName": node})
            })
            .collect();
        documents.push(json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": format!("{service}-1"), "namespace": "default",
                         "labels": {"kubernetes.io/service-name": service}},
            "addressType": "IPv4",
            "ports": ports.iter().map(|port| json!({
                "name": name(port), "protocol": port.protocol.to_string(), "port": port.target_port(),
            })).collect::<Vec<_>>(),
            "endpoints": endpoints,
        }));
    }
    documents.iter().map(|document| format!("{document}\n---\n")).collect()
}

/// The lab; dropping it stops vipr and removes the namespaces, the bpffs and the scratch
/// directory, also when a check fails.
struct XdpLab {
    // Dropped in this order: the agent, the servers (their sockets keep namespaces alive),
    // the namespaces, the bpffs, the scratch directory.
    vipr: Option<Vipr>,
    _servers: Vec<EchoServer>,
    /// The IPv6 lab's servers on the backends' IPv6 addresses (see [`XdpLab::with_ipv6`]).
    servers6: Vec<EchoServer>,
    topology: Topology,
    bpffs: BpfFs,
    workdir: WorkDir,
    log: PathBuf,
}

impl XdpLab {
    fn new(label: &str) -> Result<Self> {
        testbed::require_root()?;
        let workdir = WorkDir::create(label)?;
        let bpffs = BpfFs::mount(label)?;
        let mut leaves =
            vec![LeafSpec::new("ext", EXTERNAL, NODE_EXTERNAL, 24), LeafSpec::in_own_slash24("pod", POD)?];
        for backend in BACKENDS {
            leaves.push(LeafSpec::in_own_slash24(backend, backend_addr(backend))?);
        }
        let topology = Topology::build(label, leaves)?;
        let ext = &topology.leaf("ext")?.netns;
        ext.run(|| ethtool::set(ethtool::TX_CHECKSUM, "eth0", false))?;
        let servers = BACKENDS
            .iter()
            .map(|backend| {
                let netns = &topology.leaf(backend)?.netns;
                netns.run(|| ethtool::set(ethtool::GRO, "eth0", true))?;
                let addr = backend_addr(backend);
                EchoServer::start(netns, backend, &[(addr, TCP_TARGET).into()], &[(addr, UDP_TARGET).into()])
            })
            .collect::<Result<_>>()?;
        let log = workdir.path().join("vipr.log");
        Ok(Self { vipr: None, _servers: servers, servers6: Vec::new(), topology, bpffs, workdir, log })
    }

    /// Gives every link of the lab IPv6 addresses too (`fd00:77::1/64` toward the external
    /// client, `fd00:<i>::1/64` toward the others, the leaf at `::2`), with the leaves' default
    /// routes through the node, and starts echo servers on the backends' IPv6 addresses. vipr
    /// then also serves [`manifests6`] on the node's external IPv6 address.
    fn with_ipv6(mut self) -> Result<Self> {
        self.node().set_sysctl("net.ipv6.conf.all.forwarding", "1")?;
        for (index, leaf) in self.topology.leaves().iter().enumerate() {
            let (node, own) = if leaf.spec.name == "ext" {
                (NODE_EXTERNAL6.to_string(), EXTERNAL6.to_string())
            } else {
                (format!("fd00:{}::1", index + 1), format!("fd00:{}::2", index + 1))
            };
            let node_interface = leaf.spec.node_interface.as_str();
            // No duplicate address detection: the addresses are usable at once.
            self.node().ip(&["-6", "addr", "add", &format!("{node}/64"), "dev", node_interface, "nodad"])?;
            leaf.netns.ip(&["-6", "addr", "add", &format!("{own}/64"), "dev", "eth0", "nodad"])?;
            leaf.netns.ip(&["-6", "route", "add", "default", "via", &node])?;
        }
        for backend in BACKENDS {
            let netns = &self.topology.leaf(backend)?.netns;
            let addr = IpAddr::V6(backend_addr6(&self, backend)?);
            let server = EchoServer::start(
                netns,
                backend,
                &[(addr, TCP_TARGET).into()],
                &[(addr, UDP_TARGET).into()],
            )?;
            self.servers6.push(server);
        }
        Ok(self)
    }

    fn has_ipv6(&self) -> bool {
        !self.servers6.is_empty()
    }

    fn node(&self) -> &Netns {
        self.topology.node()
    }

    fn leaf(&self, name: &str) -> &Netns {
        &self.topology.leaf(name).expect("a leaf of the lab").netns
    }

    /// Starts vipr on every node interface with `xdp` (`None`: no `--xdp` flag), and waits
    /// until the services are programmed and the node has resolved every backend's address.
    ///
    /// With `own_sysfs` vipr runs in a mount namespace of its own whose sysfs shows the node
    /// namespace's devices, as `ip netns exec` would give it (the testbed enters namespaces
    /// with `setns()` only, which leaves the host's sysfs in view). Only the parts that
    /// describe devices are replaced (`class/net` links into `devices`, which links into
    /// `bus`), not all of /sys, which would hide the cgroup2 mount vipr attaches to.
    fn start_vipr(&mut self, xdp: Option<&str>, own_sysfs: bool) -> Result<()> {
        let services = self.workdir.path().join("services.yaml");
        let mut manifests = manifests();
        if self.has_ipv6() {
            manifests.push_str(&manifests6(self)?);
        }
        write_atomically(&services, &manifests)?;
        let node_port_addresses = if self.has_ipv6() {
            format!("--nodeport-addresses={NODE_EXTERNAL}/32,{NODE_EXTERNAL6}/128")
        } else {
            format!("--nodeport-addresses={NODE_EXTERNAL}/32")
        };
        let mut args = vec![
            "--proxy-mode=ebpf".to_owned(),
            format!("--services-file={}", services.display()),
            format!("--node-name={NODE_NAME}"),
            format!("--devices={}", self.topology.node_interfaces().join(",")),
            format!("--bpf-root={}", self.bpffs.path().display()),
            format!("--cluster-cidr={CLUSTER_CIDR}"),
            node_port_addresses,
            "--healthz-bind-address=".to_owned(),
            "--metrics-bind-address=".to_owned(),
            "-v".to_owned(),
            // XDP transmits what it finishes itself, past netfilter: it only runs on the
            // redirect path (with the default, `stack`, vipr attaches no XDP).
            "--bpf-forwarding=redirect".to_owned(),
        ];
        args.extend(xdp.map(|mode| format!("--xdp={mode}")));
        let binary = locate_vipr()?;
        let vipr = if own_sysfs {
            let sysfs = self.workdir.path().join("sysfs");
            std::fs::create_dir(&sysfs)?;
            let mut wrapped = vec![
                "--mount".to_owned(),
                "--propagation=private".to_owned(),
                "sh".to_owned(),
                "-c".to_owned(),
                OWN_SYSFS.to_owned(),
                binary.display().to_string(),
                sysfs.display().to_string(),
            ];
            wrapped.extend(args);
            Vipr::start_with_args(Path::new("unshare"), self.node(), &wrapped, &self.log)?
        } else {
            Vipr::start_with_args(&binary, self.node(), &args, &self.log)?
        };
        let vipr = self.vipr.insert(vipr);

        let maps = PinnedMaps::new(self.bpffs.path());
        wait_for("vipr to program the NodePorts", PROGRAMMING_TIMEOUT, || {
            vipr.ensure_running()?;
            for port in NodePort::ALL {
                let mut want: Vec<_> = port
                    .endpoints()
                    .iter()
                    .map(|backend| SocketAddrV4::new(backend_addr(backend), port.target_port()))
                    .collect();
                want.sort();
                match maps.frontend_backends(port.frontend()) {
                    Ok(Some(programmed)) if programmed == want => {}
                    seen => return Ok(Check::NotYet(format!("{}: {seen:?}", port.frontend()))),
                }
            }
            Ok(Check::Done(()))
        })?;
        // XDP forwards only to a resolved neighbour (it passes the first packets to TC
        // otherwise), so the exact counts below need every backend resolved beforehand.
        for backend in BACKENDS {
            let backend = SocketAddr::from((backend_addr(backend), UDP_TARGET));
            self.node().run(|| udp_exchange(backend, TIMEOUT))?;
        }
        if self.has_ipv6() {
            for backend in BACKENDS {
                let backend = SocketAddr::from((backend_addr6(self, backend)?, UDP_TARGET));
                wait_for(&format!("{backend} to answer the node"), PROGRAMMING_TIMEOUT, || {
                    Ok(match self.node().run(|| udp_exchange(backend, TIMEOUT)) {
                        Ok(_) => Check::Done(()),
                        Err(error) => Check::NotYet(format!("{error:#}")),
                    })
                })?;
            }
        }
        Ok(())
    }

    fn stop_vipr(&mut self) -> Result<()> {
        let status = self.vipr.take().context("vipr is not running")?.stop()?;
        ensure!(status.success(), "vipr exited with {status} on SIGTERM");
        Ok(())
    }

    fn vipr_log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The XDP links vipr pinned, by file name.
    fn xdp_pins(&self) -> Result<BTreeSet<String>> {
        let links = PinnedMaps::new(self.bpffs.path()).dir().join("links");
        let mut pins = BTreeSet::new();
        for entry in std::fs::read_dir(&links).with_context(|| format!("cannot list {}", links.display()))? {
            let name = entry?.file_name().to_string_lossy().into_owned();
            if name.starts_with("xdp-") {
                pins.insert(name);
            }
        }
        Ok(pins)
    }

    /// [`CONNECTIONS`] new connections (UDP: datagrams from new sockets) from the namespace
    /// `from` to `port`, each answered by one of `port`'s endpoints with the reply from the
    /// NodePort, the client seen as `port` says (the node's address on the backend's link when
    /// masqueraded, else the client's own); returns how many each endpoint answered.
    fn exchanges(&self, from: &str, client: Ipv4Addr, port: NodePort) -> Result<BTreeMap<String, usize>> {
        let frontend = port.frontend();
        let done = self.leaf(from).run(|| exchanges(frontend, CONNECTIONS, TIMEOUT))?;
        for Exchange { answer, client_port, replied_from } in &done {
            ensure!(
                *replied_from == frontend.socket_addr(),
                "{frontend}: reply from {replied_from} ({answer})"
            );
            ensure!(port.endpoints().contains(&answer.backend.as_str()), "{frontend}: answered by {answer}");
            if port.masqueraded() {
                let node = IpAddr::V4(node_addr_toward(&answer.backend));
                ensure!(
                    answer.observed_client.ip() == node,
                    "{frontend}: not masqueraded to {node}: {answer}"
                );
            } else {
                let own = SocketAddr::from((client, *client_port));
                ensure!(answer.observed_client == own, "{frontend}: client seen as {answer}, not {own}");
            }
        }
        let counts = count_by_backend(&done);
        eprintln!("{from} -> {frontend}: {counts:?}");
        ensure!(
            counts.keys().map(String::as_str).eq(port.endpoints().iter().copied()),
            "{frontend} from {from} must reach each of {:?}: {counts:?}",
            port.endpoints()
        );
        Ok(counts)
    }
}

/// How many UDP datagrams over IPv6 the namespace has sent (`Udp6OutDatagrams`; TCP's
/// counters in /proc/net/snmp count both families' segments).
fn sent_udp6(netns: &Netns) -> Result<u64> {
    let snmp6 = netns.run(|| Ok(std::fs::read_to_string("/proc/thread-self/net/snmp6")?))?;
    snmp6
        .lines()
        .find_map(|line| line.strip_prefix("Udp6OutDatagrams"))
        .context("no Udp6OutDatagrams in snmp6")?
        .trim()
        .parse()
        .context("a counter")
}

/// How many segments or datagrams of `protocol` the namespace has sent.
fn sent(netns: &Netns, protocol: Protocol) -> Result<u64> {
    let (section, field) = match protocol {
        Protocol::Tcp => ("Tcp", "OutSegs"),
        Protocol::Udp => ("Udp", "OutDatagrams"),
        Protocol::Sctp => anyhow::bail!("/proc/net/snmp has no SCTP counters"),
    };
    // /proc/thread-self, not /proc/net (the process's main thread): the calling thread is the
    // one in the namespace.
    let snmp = netns.run(|| Ok(std::fs::read_to_string("/proc/thread-self/net/snmp")?))?;
    let mut lines = snmp.lines().filter(|line| line.starts_with(&format!("{section}:")));
    let (names, values) = (lines.next().context("no header")?, lines.next().context("no values")?);
    names
        .split_whitespace()
        .zip(values.split_whitespace())
        .find(|(name, _)| *name == field)
        .with_context(|| format!("no {section} {field} in snmp"))?
        .1
        .parse()
        .context("a counter")
}

/// [`ethtool::xdp_counter`] of `device` in `netns`.
fn xdp_counter(netns: &Netns, device: &str, counter: &str) -> Result<u64> {
    netns.run(|| ethtool::xdp_counter(device, counter))
}

/// Runs `traffic` from the external client and checks that the node's XDP program redirected
/// every segment or datagram the client sent meanwhile: none went through TC. Both protocols
/// are counted whatever `traffic`'s is: a late segment of the connections before (a FIN the
/// client retransmitted on a loaded machine) is sent, and redirected, while it runs.
fn all_redirected_by_xdp(
    lab: &XdpLab,
    protocol: Protocol,
    traffic: impl FnOnce() -> Result<()>,
) -> Result<()> {
    let sent_either = |ext: &Netns| Ok(sent(ext, Protocol::Tcp)? + sent(ext, Protocol::Udp)?);
    all_counted_redirected_by_xdp(lab, protocol, sent_either, traffic)
}

/// [`all_redirected_by_xdp`] with the client's packets counted by `sent`.
fn all_counted_redirected_by_xdp(
    lab: &XdpLab,
    protocol: Protocol,
    sent: impl Fn(&Netns) -> Result<u64>,
    traffic: impl FnOnce() -> Result<()>,
) -> Result<()> {
    let ext = lab.leaf("ext");
    // The counts start from a quiet moment: on a loaded machine a segment of the traffic before
    // (a last ACK) can be counted by the client before the window and redirected inside it.
    let counts =
        || -> Result<(u64, u64)> { Ok((sent(ext)?, xdp_counter(lab.node(), "to-ext", "xdp_redirect")?)) };
    let mut last = counts()?;
    let (sent_before, redirected_before) =
        wait_for("the client's counters and XDP's to settle", SETTLE, || {
            std::thread::sleep(Duration::from_millis(50));
            let now = counts()?;
            let quiet = now == last;
            last = now;
            Ok(if quiet { Check::Done(now) } else { Check::NotYet(format!("{now:?}")) })
        })?;
    traffic()?;
    // The last ACKs of a closed connection may still be on their way.
    wait_for(&format!("every {protocol} packet of the client to be redirected by XDP"), SETTLE, || {
        let sent = sent(ext)? - sent_before;
        let redirected = xdp_counter(lab.node(), "to-ext", "xdp_redirect")? - redirected_before;
        eprintln!("{protocol}: the client sent {sent}, XDP redirected {redirected}");
        Ok(if sent > 0 && redirected == sent {
            Check::Done(())
        } else {
            Check::NotYet(format!("the client sent {sent} {protocol} packets, XDP redirected {redirected}"))
        })
    })
}

#[test]
fn nodeport_traffic_from_outside_is_balanced_by_xdp_and_pods_still_go_through_tc() {
    // Checks return errors and panic here, with the lab still up: its guards then print vipr's
    // log and keep the scratch directory.
    let mut lab = XdpLab::new("xdp-e2e").unwrap();
    native_xdp_handles_outside_traffic(&mut lab).unwrap();
}

fn native_xdp_handles_outside_traffic(lab: &mut XdpLab) -> Result<()> {
    lab.start_vipr(Some("native"), false)?;

    for port in NodePort::ALL {
        all_redirected_by_xdp(lab, port.protocol, || lab.exchanges("ext", EXTERNAL, port).map(drop))
            .with_context(|| format!("{} from outside", port.frontend()))?;
    }

    // A pod's packets are CHECKSUM_PARTIAL (its veth offloads the checksum): XDP sees them on
    // the node's end of that veth and must pass them on untouched, for TC to balance.
    let pod = lab.leaf("pod");
    ensure!(
        pod.run(|| ethtool::get(ethtool::TX_CHECKSUM, "eth0"))?,
        "the pod must send with tx checksum offload"
    );
    let (seen_before, redirected_before) = (
        xdp_counter(lab.node(), "to-pod", "xdp_packets")?,
        xdp_counter(lab.node(), "to-pod", "xdp_redirect")?,
    );
    for port in NodePort::ALL.into_iter().filter(|port| port.masqueraded()) {
        lab.exchanges("pod", POD, port).with_context(|| format!("{} from a pod", port.frontend()))?;
    }
    let seen = xdp_counter(lab.node(), "to-pod", "xdp_packets")? - seen_before;
    let redirected = xdp_counter(lab.node(), "to-pod", "xdp_redirect")? - redirected_before;
    ensure!(seen >= 2 * CONNECTIONS as u64, "XDP on to-pod saw only {seen} packets");
    ensure!(redirected == 0, "XDP redirected {redirected} packets of the pod");

    let want: BTreeSet<String> =
        lab.topology.node_interfaces().iter().map(|device| format!("xdp-native-{device}")).collect();
    ensure!(lab.xdp_pins()? == want, "XDP links {:?}, want {want:?}", lab.xdp_pins()?);
    let log = lab.vipr_log();
    for device in lab.topology.node_interfaces() {
        ensure!(
            log.lines().any(|line| line.contains("XDP fast path attached (--xdp=native)")
                && line.contains(&format!("device=\"{device}\""))
                && line.contains("mode=\"native\"")),
            "vipr did not log native XDP on {device}"
        );
    }
    lab.stop_vipr()
}

/// Without `--xdp`, only devices backed by hardware get XDP: none of the lab's veths.
#[test]
fn by_default_veths_get_no_xdp_and_tc_serves_them() {
    let mut lab = XdpLab::new("xdp-e2e-default").unwrap();
    default_leaves_veths_to_tc(&mut lab).unwrap();
}

fn default_leaves_veths_to_tc(lab: &mut XdpLab) -> Result<()> {
    lab.start_vipr(None, true)?;
    let seen_before = xdp_counter(lab.node(), "to-ext", "xdp_packets")?;
    for port in NodePort::ALL {
        lab.exchanges("ext", EXTERNAL, port).with_context(|| format!("{} from outside", port.frontend()))?;
    }
    let seen = xdp_counter(lab.node(), "to-ext", "xdp_packets")? - seen_before;
    ensure!(seen == 0, "XDP ran on {seen} packets of to-ext");
    ensure!(lab.xdp_pins()?.is_empty(), "XDP links {:?}", lab.xdp_pins()?);
    let log = lab.vipr_log();
    for device in lab.topology.node_interfaces() {
        // "a virtual device", not "does not show it": vipr judged the node's own sysfs.
        ensure!(
            log.lines().any(|line| line.contains("no XDP by default: a virtual device")
                && line.contains(&format!("device=\"{device}\""))),
            "vipr did not log why {device} got no XDP"
        );
    }
    lab.stop_vipr()
}

/// XDP's IPv6 path in the real agent: the external client's TCP and UDP over IPv6 to an IPv6
/// NodePort are balanced across the backends and every packet of theirs is redirected by
/// `vipr_xdp`, none passed to TC.
#[test]
fn ipv6_nodeport_traffic_from_outside_is_balanced_by_xdp() {
    let mut lab = XdpLab::new("xdp-e2e6").unwrap().with_ipv6().unwrap();
    native_xdp_handles_outside_ipv6_traffic(&mut lab).unwrap();
}

fn native_xdp_handles_outside_ipv6_traffic(lab: &mut XdpLab) -> Result<()> {
    lab.start_vipr(Some("native"), false)?;
    for (protocol, node_port) in [(Protocol::Tcp, TCP_NODE_PORT6), (Protocol::Udp, UDP_NODE_PORT6)] {
        let frontend = SocketAddr::from((NODE_EXTERNAL6, node_port));
        let exchange = |timeout| match protocol {
            Protocol::Udp => udp_exchange(frontend, timeout),
            _ => tcp_exchange(frontend, timeout),
        };
        // The agent programs the IPv6 service with the IPv4 ones; the first answer shows it.
        wait_for(&format!("{frontend} to answer"), PROGRAMMING_TIMEOUT, || {
            Ok(match lab.leaf("ext").run(|| exchange(TIMEOUT)) {
                Ok(_) => Check::Done(()),
                Err(error) => Check::NotYet(format!("{error:#}")),
            })
        })?;
        let sent = |ext: &Netns| match protocol {
            Protocol::Udp => sent_udp6(ext),
            _ => sent(ext, Protocol::Tcp),
        };
        let mut done = Vec::new();
        all_counted_redirected_by_xdp(lab, protocol, sent, || {
            done = lab
                .leaf("ext")
                .run(|| (0..CONNECTIONS).map(|_| exchange(TIMEOUT)).collect::<Result<Vec<_>>>())?;
            Ok(())
        })
        .with_context(|| format!("{frontend} from outside"))?;
        for Exchange { answer, replied_from, .. } in &done {
            ensure!(*replied_from == frontend, "{frontend}: reply from {replied_from} ({answer})");
        }
        let counts = count_by_backend(&done);
        eprintln!("ext -> {frontend}: {counts:?}");
        ensure!(
            counts.keys().map(String::as_str).eq(BACKENDS),
            "{frontend} must reach each backend: {counts:?}"
        );
    }
    lab.stop_vipr()
}
