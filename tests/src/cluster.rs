//! A cluster of vipr nodes in network namespaces: several nodes, each running vipr against one
//! in-suite API server, pods behind each node in a routed pod CIDR of its own (as a host-gateway
//! CNI sets them up), a router between the nodes and an external client.
//!
//! ```text
//!  client 203.0.113.2 ── router (203.0.113.1, bridge 192.168.100.254, API server :6443)
//!                            │ 192.168.100.0/24
//!        ┌───────────────────┼───────────────────┐
//!   node n1 .1          node n2 .2          node n3 .3      (eth0; routes to the other
//!   pods 10.244.1.0/24  pods 10.244.2.0/24  ...              nodes' pod CIDRs via them)
//!     └ pod 10.244.1.10 (veth p0, node side 10.244.1.1) ...
//! ```
//!
//! A dual-stack lab ([`ClusterLab::new_dual_stack`]) gives every link an IPv6 address too,
//! routed the same way (the API server stays on IPv4):
//!
//! ```text
//!  client 2001:db8:113::2 ── router (2001:db8:113::1, bridge fd00:100::fe)
//!                                │ fd00:100::/64
//!        ┌───────────────────────┼───────────────────────┐
//!   node n1 fd00:100::1     node n2 fd00:100::2     node n3 fd00:100::3
//!   pods fd00:244:0:1::/64  pods fd00:244:0:2::/64  ...    (cluster CIDR fd00:244::/48)
//!     └ pod fd00:244:0:1::10 (veth p0, node side fd00:244:0:1::1) ...
//! ```
//!
//! Every namespace, mount and process is the lab's own and goes with it (drop guards), also
//! when a test fails.
use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6, UdpSocket},
    os::fd::{AsRawFd as _, OwnedFd},
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{Context, Result};
use serde_json::{json, Value};

use crate::{
    ethtool, tcp_exchange, unique_name, wait_for, Answer, BpfFs, Check, EchoServer, FakeApiServer, Netns,
    PinnedMaps, Vipr, WorkDir,
};

/// The router's address on the node network, where the API server listens too.
pub const ROUTER_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 100, 254);
/// The external client's address.
pub const CLIENT_IP: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 2);
const CLIENT_GATEWAY: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 1);
const API_PORT: u16 = 6443;
/// Every pod CIDR is inside it (`--cluster-cidr`).
pub const CLUSTER_CIDR: &str = "10.244.0.0/16";

/// The router's IPv6 address on the node network (dual-stack labs).
pub const ROUTER_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x100, 0, 0, 0, 0, 0, 0xfe);
/// The external client's IPv6 address (dual-stack labs).
pub const CLIENT_IP6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x113, 0, 0, 0, 0, 2);
const CLIENT_GATEWAY6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x113, 0, 0, 0, 0, 1);
/// Every IPv6 pod CIDR is inside it; a dual-stack lab's `--cluster-cidr` is
/// `{CLUSTER_CIDR},{CLUSTER_CIDR6}`.
pub const CLUSTER_CIDR6: &str = "fd00:244::/48";

/// The port every pod serves on, TCP and UDP.
pub const POD_PORT: u16 = 8080;
/// The target ports of [`node_port_service`]'s ports, for [`ClusterLab::apply_service`].
pub const TARGET_PORTS: &[(&str, u16, &str)] = &[("tcp", POD_PORT, "TCP"), ("udp", POD_PORT, "UDP")];
/// How long a lab waits for vipr to serve what a test asked for.
pub const TIMEOUT: Duration = Duration::from_secs(30);
/// How long one question waits for its answer.
pub const ASK: Duration = Duration::from_secs(1);

/// A NodePort Service `name` with a TCP and a UDP port 80 to the pods' [`POD_PORT`], both on
/// `node_port`; `extra` is merged into its spec (type, policies, addresses).
pub fn node_port_service(name: &str, cluster_ip: &str, node_port: u16, extra: Value) -> Value {
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

/// The answer to a datagram from `socket` to `to`: only one that comes from `to` itself (the
/// service address) counts.
pub fn udp_answer(socket: &UdpSocket, to: SocketAddr) -> Result<Answer> {
    socket.send_to(b"who are you?", to)?;
    let mut buffer = [0u8; 512];
    loop {
        let (length, from) = socket.recv_from(&mut buffer).with_context(|| format!("no answer from {to}"))?;
        if from == to {
            return std::str::from_utf8(&buffer[..length])?.trim().parse();
        }
    }
}

/// Node `index` (from 1)'s address on the node network.
pub fn node_ip(index: usize) -> Ipv4Addr {
    Ipv4Addr::new(192, 168, 100, index as u8)
}

/// The address of pod `pod` (from 0) on node `index` (from 1).
pub fn pod_ip(index: usize, pod: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 244, index as u8, 10 + pod as u8)
}

/// Node `index` (from 1)'s address on its pods' links: their gateway.
pub fn pod_gateway(index: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 244, index as u8, 1)
}

/// Node `index` (from 1)'s IPv6 pod CIDR (dual-stack labs), inside [`CLUSTER_CIDR6`].
pub fn pod_cidr6(index: usize) -> String {
    format!("{}/64", Ipv6Addr::new(0xfd00, 0x244, 0, index as u16, 0, 0, 0, 0))
}

/// Node `index` (from 1)'s IPv6 address on the node network (dual-stack labs).
pub fn node_ip6(index: usize) -> Ipv6Addr {
    Ipv6Addr::new(0xfd00, 0x100, 0, 0, 0, 0, 0, index as u16)
}

/// The IPv6 address of pod `pod` (from 0) on node `index` (from 1) (dual-stack labs).
pub fn pod_ip6(index: usize, pod: usize) -> Ipv6Addr {
    Ipv6Addr::new(0xfd00, 0x244, 0, index as u16, 0, 0, 0, 0x10 + pod as u16)
}

/// Node `index` (from 1)'s IPv6 address on its pods' links: their gateway (dual-stack labs).
pub fn pod_gateway6(index: usize) -> Ipv6Addr {
    Ipv6Addr::new(0xfd00, 0x244, 0, index as u16, 0, 0, 0, 1)
}

/// A UDP socket of `to`'s family, on any address and port, that waits [`ASK`] for an answer.
pub fn udp_socket_for(to: SocketAddr) -> Result<UdpSocket> {
    let any: IpAddr = if to.is_ipv4() { Ipv4Addr::UNSPECIFIED.into() } else { Ipv6Addr::UNSPECIFIED.into() };
    let socket = UdpSocket::bind((any, 0))?;
    socket.set_read_timeout(Some(ASK))?;
    Ok(socket)
}

/// One pod: its namespace and the echo servers answering as `name`.
pub struct Pod {
    // The servers stop before their namespace goes.
    _servers: EchoServer,
    pub name: String,
    pub ip: Ipv4Addr,
    /// Its IPv6 address in a dual-stack lab.
    pub ip6: Option<Ipv6Addr>,
    pub netns: Netns,
}

/// One node: its namespace, pods, bpffs and vipr.
pub struct Node {
    // Dropped in this order: vipr before the pods' namespaces, its bpffs and its namespace.
    vipr: Option<Vipr>,
    pub name: String,
    pub ip: Ipv4Addr,
    /// Its IPv6 address in a dual-stack lab.
    pub ip6: Option<Ipv6Addr>,
    pub pods: Vec<Pod>,
    bpffs: BpfFs,
    pub netns: Netns,
}

impl Node {
    pub fn vipr_mut(&mut self) -> Option<&mut Vipr> {
        self.vipr.as_mut()
    }

    /// The maps this node's vipr pinned.
    pub fn maps(&self) -> PinnedMaps {
        PinnedMaps::new(self.bpffs.path())
    }

    /// This node's vipr's `--bpf-root`.
    pub fn bpf_root(&self) -> &Path {
        self.bpffs.path()
    }
}

pub struct ClusterLab {
    /// The links of [`ClusterLab::prepare_for_xdp`]'s programs (detached when dropped).
    xdp_links: Vec<OwnedFd>,
    pub nodes: Vec<Node>,
    pub client: Netns,
    api: FakeApiServer,
    kubeconfig: PathBuf,
    binary: PathBuf,
    dual_stack: bool,
    // The router goes last: the nodes' uplinks hang off its bridge.
    pub router: Netns,
    workdir: WorkDir,
}

impl ClusterLab {
    /// `nodes` nodes with `pods` pods each, the router, the client and the API server (with a
    /// Node object per node); no vipr yet ([`Self::start_vipr`]). Each pod serves the echo
    /// protocol as `<node>-pod<k>` on TCP and UDP `ports`.
    pub fn new(label: &str, nodes: usize, pods: usize, ports: &[u16]) -> Result<Self> {
        Self::build(label, nodes, pods, ports, false)
    }

    /// The same lab with IPv6 beside IPv4 on every link (the module doc's second diagram): the
    /// Node objects have both families' pod CIDRs and InternalIPs, vipr gets both cluster
    /// CIDRs, and the pods serve on both their addresses.
    pub fn new_dual_stack(label: &str, nodes: usize, pods: usize, ports: &[u16]) -> Result<Self> {
        Self::build(label, nodes, pods, ports, true)
    }

    fn build(label: &str, nodes: usize, pods: usize, ports: &[u16], dual_stack: bool) -> Result<Self> {
        crate::require_root()?;
        let workdir = WorkDir::create(label)?;
        let name = |suffix: &str| unique_name(&format!("{label}-{suffix}"));
        let create = |suffix: &str| -> Result<Netns> {
            let netns = Netns::create(&name(suffix))?;
            if dual_stack {
                // Link-local addresses skip duplicate address detection too: while one is
                // tentative, the kernel sends no neighbour solicitation for a packet it
                // forwards out of that interface, and the first packets through a fresh lab
                // would wait a second or two for the retry.
                netns.set_sysctl("net.ipv6.conf.default.accept_dad", "0")?;
            }
            Ok(netns)
        };
        // IPv6 addresses skip duplicate address detection: usable at once, as IPv4 ones are.
        let add6 = |netns: &Netns, address: String, device: &str| -> Result<()> {
            netns.ip(&["-6", "addr", "add", &address, "dev", device, "nodad"])?;
            Ok(())
        };
        let router = create("r")?;
        router.set_sysctl("net.ipv4.ip_forward", "1")?;
        if dual_stack {
            router.set_sysctl("net.ipv6.conf.all.forwarding", "1")?;
        }
        router.ip(&["link", "add", "br0", "type", "bridge"])?;
        router.ip(&["addr", "add", &format!("{ROUTER_IP}/24"), "dev", "br0"])?;
        if dual_stack {
            add6(&router, format!("{ROUTER_IP6}/64"), "br0")?;
        }
        router.ip(&["link", "set", "br0", "up"])?;

        let client = create("c")?;
        link(&router, "ext", &client)?;
        router.ip(&["addr", "add", &format!("{CLIENT_GATEWAY}/24"), "dev", "ext"])?;
        router.ip(&["link", "set", "ext", "up"])?;
        client.ip(&["addr", "add", &format!("{CLIENT_IP}/24"), "dev", "eth0"])?;
        client.ip(&["link", "set", "eth0", "up"])?;
        client.ip(&["route", "add", "default", "via", &CLIENT_GATEWAY.to_string()])?;
        if dual_stack {
            add6(&router, format!("{CLIENT_GATEWAY6}/64"), "ext")?;
            add6(&client, format!("{CLIENT_IP6}/64"), "eth0")?;
            client.ip(&["-6", "route", "add", "default", "via", &CLIENT_GATEWAY6.to_string()])?;
        }

        let api = router.run(|| FakeApiServer::start_on(SocketAddr::from((ROUTER_IP, API_PORT))))?;
        let kubeconfig = workdir.path().join("kubeconfig");
        api.write_kubeconfig(&kubeconfig)?;

        let mut built = Vec::new();
        for index in 1..=nodes {
            let node_name = format!("n{index}");
            let netns = create(&node_name)?;
            let uplink = format!("up{index}");
            link(&router, &uplink, &netns)?;
            router.ip(&["link", "set", &uplink, "master", "br0", "up"])?;
            netns.set_sysctl("net.ipv4.ip_forward", "1")?;
            netns.ip(&["addr", "add", &format!("{}/24", node_ip(index)), "dev", "eth0"])?;
            if dual_stack {
                netns.set_sysctl("net.ipv6.conf.all.forwarding", "1")?;
                add6(&netns, format!("{}/64", node_ip6(index)), "eth0")?;
            }
            netns.ip(&["link", "set", "eth0", "up"])?;
            netns.ip(&["route", "add", "default", "via", &ROUTER_IP.to_string()])?;
            if dual_stack {
                netns.ip(&["-6", "route", "add", "default", "via", &ROUTER_IP6.to_string()])?;
            }
            // Host-gateway routing: every other node's pods through that node.
            for other in (1..=nodes).filter(|&other| other != index) {
                netns.ip(&[
                    "route",
                    "add",
                    &format!("10.244.{other}.0/24"),
                    "via",
                    &node_ip(other).to_string(),
                ])?;
                if dual_stack {
                    netns.ip(&[
                        "-6",
                        "route",
                        "add",
                        &pod_cidr6(other),
                        "via",
                        &node_ip6(other).to_string(),
                    ])?;
                }
            }
            router.ip(&[
                "route",
                "add",
                &format!("10.244.{index}.0/24"),
                "via",
                &node_ip(index).to_string(),
            ])?;
            if dual_stack {
                router.ip(&["-6", "route", "add", &pod_cidr6(index), "via", &node_ip6(index).to_string()])?;
            }
            let mut node_pods = Vec::new();
            for pod in 0..pods {
                let pod_name = format!("{node_name}-pod{pod}");
                let pod_netns = create(&pod_name)?;
                let ip6 = dual_stack.then(|| pod_ip6(index, pod));
                let device = format!("p{pod}");
                link(&netns, &device, &pod_netns)?;
                netns.ip(&["addr", "add", &format!("{}/32", pod_gateway(index)), "dev", &device])?;
                if dual_stack {
                    add6(&netns, format!("{}/128", pod_gateway6(index)), &device)?;
                }
                netns.ip(&["link", "set", &device, "up"])?;
                netns.ip(&["route", "add", &format!("{}/32", pod_ip(index, pod)), "dev", &device])?;
                pod_netns.ip(&["addr", "add", &format!("{}/24", pod_ip(index, pod)), "dev", "eth0"])?;
                if let Some(ip6) = ip6 {
                    netns.ip(&["-6", "route", "add", &format!("{ip6}/128"), "dev", &device])?;
                    add6(&pod_netns, format!("{ip6}/64"), "eth0")?;
                }
                pod_netns.ip(&["link", "set", "eth0", "up"])?;
                pod_netns.ip(&["route", "add", "default", "via", &pod_gateway(index).to_string()])?;
                if dual_stack {
                    let gateway6 = pod_gateway6(index).to_string();
                    pod_netns.ip(&["-6", "route", "add", "default", "via", &gateway6])?;
                }
                let listen: Vec<SocketAddr> = ports
                    .iter()
                    .flat_map(|&port| {
                        let v4 = SocketAddr::from((pod_ip(index, pod), port));
                        [Some(v4), ip6.map(|ip6| SocketAddr::from((ip6, port)))]
                    })
                    .flatten()
                    .collect();
                let servers = EchoServer::start(&pod_netns, &pod_name, &listen, &listen)?;
                node_pods.push(Pod {
                    _servers: servers,
                    name: pod_name,
                    ip: pod_ip(index, pod),
                    ip6,
                    netns: pod_netns,
                });
            }
            let (pod_cidrs, addresses) = if dual_stack {
                (
                    json!([format!("10.244.{index}.0/24"), pod_cidr6(index)]),
                    json!([
                        {"type": "InternalIP", "address": node_ip(index).to_string()},
                        {"type": "InternalIP", "address": node_ip6(index).to_string()},
                    ]),
                )
            } else {
                (
                    json!([format!("10.244.{index}.0/24")]),
                    json!([{"type": "InternalIP", "address": node_ip(index).to_string()}]),
                )
            };
            api.apply_json(json!({
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {"name": node_name},
                "spec": {"podCIDR": format!("10.244.{index}.0/24"), "podCIDRs": pod_cidrs},
                "status": {"addresses": addresses},
            }))?;
            let bpffs = BpfFs::mount(&format!("{label}-{node_name}"))?;
            built.push(Node {
                name: node_name,
                ip: node_ip(index),
                ip6: dual_stack.then(|| node_ip6(index)),
                pods: node_pods,
                vipr: None,
                bpffs,
                netns,
            });
        }
        Ok(Self {
            xdp_links: Vec::new(),
            nodes: built,
            client,
            api,
            kubeconfig,
            binary: crate::locate_vipr()?,
            dual_stack,
            router,
            workdir,
        })
    }

    pub fn api(&self) -> &FakeApiServer {
        &self.api
    }

    pub fn workdir(&self) -> &Path {
        self.workdir.path()
    }

    /// Sets the lab's veths up as XDP needs them (docs/architecture/xdp.md): the client sends
    /// with tx checksum offload off, as frames from a NIC carry complete checksums (a veth
    /// would otherwise hand XDP checksums it must not update), and the router's ends of the
    /// nodes' uplinks get an XDP program that passes everything: a veth delivers the frames its
    /// peer's XDP program sends back (`XDP_TX`) only to an end with an XDP program of its own.
    pub fn prepare_for_xdp(&mut self) -> Result<()> {
        self.client.run(|| ethtool::set(ethtool::TX_CHECKSUM, "eth0", false))?;
        for index in 1..=self.nodes.len() {
            let link = self.router.run(|| xdp_pass_link(&format!("up{index}")))?;
            self.xdp_links.push(link);
        }
        Ok(())
    }

    /// Frames node `index`'s (from 1) XDP program sent back out of its uplink (`XDP_TX`),
    /// by the veth driver's statistics: nothing else counts there.
    pub fn uplink_xdp_tx(&self, index: usize) -> Result<u64> {
        let stats = self.nodes[index - 1].netns.run(|| ethtool::stats("eth0"))?;
        Ok(stats
            .iter()
            .filter(|(name, _)| name.starts_with("rx_queue_") && name.ends_with("_xdp_tx"))
            .map(|(_, count)| count)
            .sum())
    }

    /// Starts vipr in ebpf mode on every node, against the API server, with `extra_args`.
    pub fn start_vipr(&mut self, extra_args: &[&str]) -> Result<()> {
        self.start_vipr_each(|_| extra_args.to_vec())
    }

    /// [`Self::start_vipr`] with each node's own `extra_args` (by node index, from 1), as in a
    /// cluster halfway through a change of flags.
    pub fn start_vipr_each<'a>(&mut self, extra_args: impl Fn(usize) -> Vec<&'a str>) -> Result<()> {
        for (index, node) in self.nodes.iter_mut().enumerate() {
            let log = self.workdir.path().join(format!("vipr-{}.log", node.name));
            let mut args = vec![
                "--proxy-mode=ebpf".to_owned(),
                format!("--kubeconfig={}", self.kubeconfig.display()),
                format!("--node-name={}", node.name),
                format!("--bpf-root={}", node.bpffs.path().display()),
                if self.dual_stack {
                    format!("--cluster-cidr={CLUSTER_CIDR},{CLUSTER_CIDR6}")
                } else {
                    format!("--cluster-cidr={CLUSTER_CIDR}")
                },
                "--min-sync-period=0s".to_owned(),
                "-v".to_owned(),
            ];
            args.extend(extra_args(index + 1).into_iter().map(str::to_owned));
            let vipr = Vipr::start_with_args(&self.binary, &node.netns, &args, &log)
                .with_context(|| format!("cannot start vipr on {}", node.name))?;
            node.vipr = Some(vipr);
        }
        Ok(())
    }

    /// Stores a Service and its EndpointSlice (one, IPv4) in the API server. `endpoints` are
    /// (node index from 1, pod index from 0), all ready.
    pub fn apply_service(
        &self,
        service: Value,
        target_ports: &[(&str, u16, &str)],
        endpoints: &[(usize, usize)],
    ) -> Result<()> {
        let (name, namespace) = service_identity(&service)?;
        self.api.apply_json(service)?;
        self.apply_slice(&name, &namespace, false, target_ports, endpoints)
    }

    /// Stores `service` made dual-stack, as the API server holds a `RequireDualStack` Service
    /// (`ipFamilies` IPv4 and IPv6, `clusterIPs` its `clusterIP` and `cluster_ip6`), and its two
    /// EndpointSlices, as the EndpointSlice controller writes them: one per address family, each
    /// with the `endpoints`' addresses of its family. The lab must be dual-stack.
    pub fn apply_dual_stack_service(
        &self,
        mut service: Value,
        cluster_ip6: Ipv6Addr,
        target_ports: &[(&str, u16, &str)],
        endpoints: &[(usize, usize)],
    ) -> Result<()> {
        anyhow::ensure!(self.dual_stack, "a dual-stack Service needs a dual-stack lab");
        let (name, namespace) = service_identity(&service)?;
        let spec = service["spec"].as_object_mut().context("the Service has no spec")?;
        let cluster_ip =
            spec.get("clusterIP").and_then(Value::as_str).context("the Service has no clusterIP")?;
        let cluster_ips = json!([cluster_ip, cluster_ip6.to_string()]);
        spec.insert("clusterIPs".to_owned(), cluster_ips);
        spec.insert("ipFamilyPolicy".to_owned(), json!("RequireDualStack"));
        spec.insert("ipFamilies".to_owned(), json!(["IPv4", "IPv6"]));
        self.api.apply_json(service)?;
        self.apply_slice(&name, &namespace, false, target_ports, endpoints)?;
        self.apply_slice(&name, &namespace, true, target_ports, endpoints)
    }

    /// Stores the EndpointSlice of Service `namespace/name` of one family.
    fn apply_slice(
        &self,
        name: &str,
        namespace: &str,
        ipv6: bool,
        target_ports: &[(&str, u16, &str)],
        endpoints: &[(usize, usize)],
    ) -> Result<()> {
        let ports: Vec<Value> = target_ports
            .iter()
            .map(|(port_name, port, protocol)| json!({"name": port_name, "port": port, "protocol": protocol}))
            .collect();
        let endpoints: Vec<Value> = endpoints
            .iter()
            .map(|&(node, pod)| {
                let address =
                    if ipv6 { pod_ip6(node, pod).to_string() } else { pod_ip(node, pod).to_string() };
                json!({
                    "addresses": [address],
                    "conditions": {"ready": true, "serving": true, "terminating": false},
                    "nodeName": format!("n{node}"),
                })
            })
            .collect();
        let (slice, address_type) =
            if ipv6 { (format!("{name}-2"), "IPv6") } else { (format!("{name}-1"), "IPv4") };
        self.api.apply_json(json!({
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": slice,
                "namespace": namespace,
                "labels": {"kubernetes.io/service-name": name},
            },
            "addressType": address_type,
            "ports": ports,
            "endpoints": endpoints,
        }))?;
        Ok(())
    }

    /// Node `index` (from 1) goes away as a crashed or powered-off machine does: its vipr is
    /// killed, its link to the router goes down (its pods with it) and its Node object leaves
    /// the API server. Its pods' endpoints stay in their EndpointSlices until the test removes
    /// them, as the endpoint controller does once it notices.
    pub fn remove_node(&mut self, index: usize) -> Result<()> {
        let node = self.nodes.get_mut(index - 1).with_context(|| format!("no node n{index}"))?;
        if let Some(vipr) = node.vipr.take() {
            vipr.kill()?;
        }
        self.router.ip(&["link", "set", &format!("up{index}"), "down"])?;
        self.api.delete::<k8s_openapi::api::core::v1::Node>(None, &node.name)?;
        Ok(())
    }

    /// One TCP question from the external client to `to`, once vipr answers there.
    pub fn ask_tcp(&self, to: SocketAddr) -> Result<Answer> {
        wait_for(&format!("an answer through {to}"), TIMEOUT, || {
            Ok(match self.client.run(|| tcp_exchange(to, ASK)) {
                Ok(exchange) => Check::Done(exchange.answer),
                Err(error) => Check::NotYet(format!("{error:#}")),
            })
        })
    }

    /// One UDP question from the external client to `to`, once vipr answers there.
    pub fn ask_udp(&self, to: SocketAddr) -> Result<Answer> {
        wait_for(&format!("a UDP answer through {to}"), TIMEOUT, || {
            let answer = self.client.run(|| udp_answer(&udp_socket_for(to)?, to));
            Ok(match answer {
                Ok(answer) => Check::Done(answer),
                Err(error) => Check::NotYet(format!("{error:#}")),
            })
        })
    }

    /// A sample of node `index`'s (from 1) `/metrics`, once it is at least `at_least` (the
    /// metrics server may start after the datapath serves).
    pub fn node_metric(&self, index: usize, sample: &str, at_least: f64) -> Result<f64> {
        wait_for(&format!("{sample} >= {at_least} on n{index}"), TIMEOUT, || {
            Ok(match self.node_metric_now(index, sample) {
                Ok(Some(value)) if value >= at_least => Check::Done(value),
                Ok(value) => Check::NotYet(format!("{value:?}")),
                Err(error) => Check::NotYet(format!("{error:#}")),
            })
        })
    }

    /// A sample of node `index`'s (from 1) `/metrics` as it is now (`None`: not there).
    pub fn node_metric_now(&self, index: usize, sample: &str) -> Result<Option<f64>> {
        let metrics = crate::http::get(&self.nodes[index - 1].netns, "127.0.0.1:10249".parse()?, "/metrics")?;
        Ok(metrics.metric(sample))
    }

    /// `result`, with the end of every node's vipr log printed when it is an error.
    pub fn with_logs<T>(&self, result: Result<T>) -> Result<T> {
        if result.is_err() {
            for node in &self.nodes {
                let log = std::fs::read_to_string(self.workdir().join(format!("vipr-{}.log", node.name)))
                    .unwrap_or_default();
                let lines: Vec<&str> = log.lines().collect();
                eprintln!(
                    "--- vipr on {}:\n{}",
                    node.name,
                    lines[lines.len().saturating_sub(30)..].join("\n")
                );
            }
        }
        result
    }

    /// `node`'s (from 1) address and `port`.
    pub fn node_address(index: usize, port: u16) -> SocketAddr {
        SocketAddr::V4(SocketAddrV4::new(node_ip(index), port))
    }

    /// `node`'s (from 1) IPv6 address and `port` (dual-stack labs).
    pub fn node_address6(index: usize, port: u16) -> SocketAddr {
        SocketAddr::V6(SocketAddrV6::new(node_ip6(index), port, 0, 0))
    }
}

/// The name and namespace of `service`.
fn service_identity(service: &Value) -> Result<(String, String)> {
    let name = service["metadata"]["name"].as_str().context("the Service has no name")?.to_owned();
    let namespace = service["metadata"]["namespace"].as_str().unwrap_or("default").to_owned();
    Ok((name, namespace))
}

/// A veth pair: `name` in `a`, `eth0`-or-`peer` in `b` (named `eth0`).
fn link(a: &Netns, name: &str, b: &Netns) -> Result<()> {
    a.ip(&["link", "add", name, "type", "veth", "peer", "name", "eth0", "netns", b.name()])?;
    Ok(())
}

/// Attaches `r0 = XDP_PASS; exit` to `device` of the calling thread's network namespace, by a
/// BPF link that lasts as long as the descriptor returned.
fn xdp_pass_link(device: &str) -> Result<OwnedFd> {
    use vipr::bpf_sys::{bpf, cmd, load_program, owned_fd, returning, LinkCreateAttr};
    const PROG_TYPE_XDP: u32 = 6;
    const ATTACH_XDP: u32 = 37;
    const XDP_PASS: i32 = 2;
    let program = load_program(PROG_TYPE_XDP, ATTACH_XDP, &returning(XDP_PASS), "lab_xdp_pass")
        .context("loading an XDP pass program")?;
    let name = std::ffi::CString::new(device)?;
    // SAFETY: a NUL-terminated name.
    let ifindex = unsafe { libc::if_nametoindex(name.as_ptr()) };
    anyhow::ensure!(ifindex != 0, "no device {device}");
    let mut link = LinkCreateAttr {
        prog_fd: program.as_raw_fd() as u32,
        target: ifindex,
        attach_type: ATTACH_XDP,
        ..LinkCreateAttr::default()
    };
    // SAFETY: BPF_LINK_CREATE's attribute, without pointers.
    unsafe { bpf(cmd::LINK_CREATE, &mut link) }
        .and_then(owned_fd)
        .with_context(|| format!("attaching XDP to {device}"))
}
