//! kube-proxy's interface detectors of local traffic, `--detect-local-mode=InterfaceNamePrefix`
//! (`--pod-interface-name-prefix`, as flags) and `BridgeInterface` (the KubeProxyConfiguration
//! file's `detectLocalMode` and `detectLocal.bridgeInterface`), end to end in the eBPF and
//! iptables modes. A pod of the node (its host-side veth named like the pods',
//! or a port of the pods' bridge) and an off-cluster client (another interface) reach:
//! - a cluster IP: the pod keeps its address, the off-cluster client is masqueraded;
//! - an `externalTrafficPolicy: Local` external IP and NodePort whose only endpoint is on
//!   another node: the pod is short-circuited to that endpoint, the off-cluster client dropped.
//!
//! No `--cluster-cidr` is given: only the interface tells the pod from the outside client (both
//! are in 10.0.0.0/8). Needs root and a built vipr (or VIPR_BIN).

use std::{
    net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4},
    path::PathBuf,
    time::Duration,
};

use testbed::{
    exchange, locate_vipr, wait_for, write_atomically, BpfFs, Check, EchoServer, Frontend, LeafSpec,
    Protocol, Topology, Vipr, WorkDir,
};

/// A pod of this node.
const POD: Ipv4Addr = Ipv4Addr::new(10, 10, 0, 2);
/// A client outside the cluster.
const OUTSIDE: Ipv4Addr = Ipv4Addr::new(10, 30, 0, 2);
/// The only endpoint, a pod of another node.
const BACKEND: Ipv4Addr = Ipv4Addr::new(10, 20, 1, 2);
/// The node's address toward the backend: what a masqueraded client is seen as.
const NODE_TOWARD_BACKEND: Ipv4Addr = Ipv4Addr::new(10, 20, 1, 1);
const VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const EXTERNAL_IP: Ipv4Addr = Ipv4Addr::new(10, 99, 0, 10);
const NODE_PORT: u16 = 30080;
/// The host-side names of the pods' veths start with it.
const POD_PREFIX: &str = "podveth";
const BRIDGE: &str = "cbr0";
const TIMEOUT: Duration = Duration::from_secs(2);
/// How long vipr may take to start serving.
const SETTLE: Duration = Duration::from_secs(30);

/// Service `web`: cluster IP, external IP and NodePort, `externalTrafficPolicy: Local`, its
/// one endpoint on node-b.
fn manifests() -> String {
    format!(
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: web\n  namespace: default\nspec:\n  type: NodePort\n  \
         externalTrafficPolicy: Local\n  clusterIP: {VIP}\n  clusterIPs: [{VIP}]\n  externalIPs: [{EXTERNAL_IP}]\n  \
         ports:\n  - {{name: http, protocol: TCP, port: 80, targetPort: 8080, nodePort: {NODE_PORT}}}\n---\n\
         apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: web-1\n  namespace: default\n  \
         labels:\n    kubernetes.io/service-name: web\naddressType: IPv4\nports:\n\
         - {{name: http, protocol: TCP, port: 8080}}\nendpoints:\n\
         - addresses: [{BACKEND}]\n  nodeName: node-b\n  conditions: {{ready: true}}\n"
    )
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Ebpf,
    Iptables,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Detector {
    /// `--detect-local-mode=InterfaceNamePrefix --pod-interface-name-prefix=podveth`.
    NamePrefix,
    /// `detectLocalMode: BridgeInterface` and `detectLocal.bridgeInterface: cbr0` in a
    /// KubeProxyConfiguration file, the pod's veth a port of the bridge, which holds the node's
    /// address on the pods' link.
    Bridge,
}

struct DetectorLab {
    // Dropped in this order: the agent, the server, the namespaces, the bpffs, the scratch
    // directory.
    vipr: Option<Vipr>,
    _server: EchoServer,
    topology: Topology,
    _bpffs: Option<BpfFs>,
    workdir: WorkDir,
}

impl DetectorLab {
    fn start(label: &str, mode: Mode, detector: Detector) -> Self {
        testbed::require_root().unwrap();
        let workdir = WorkDir::create(label).unwrap();
        let mut pod = LeafSpec::in_own_slash24("pod", POD).unwrap();
        pod.node_interface = format!("{POD_PREFIX}0");
        let leaves = vec![
            pod.clone(),
            LeafSpec::in_own_slash24("outside", OUTSIDE).unwrap(),
            LeafSpec::in_own_slash24("b1", BACKEND).unwrap(),
        ];
        let topology = Topology::build(label, leaves).unwrap();
        let node = topology.node();
        let mut devices = topology.node_interfaces();
        if detector == Detector::Bridge {
            // The node's address on the pods' link moves from the veth to the bridge.
            let gateway = format!("{}/{}", pod.gateway, pod.prefix_len);
            node.ip(&["link", "add", BRIDGE, "type", "bridge"]).unwrap();
            node.ip(&["addr", "del", &gateway, "dev", &pod.node_interface]).unwrap();
            node.ip(&["link", "set", &pod.node_interface, "master", BRIDGE]).unwrap();
            node.ip(&["addr", "add", &gateway, "dev", BRIDGE]).unwrap();
            node.ip(&["link", "set", BRIDGE, "up"]).unwrap();
            devices.push(BRIDGE.to_owned());
        }
        let server = EchoServer::start(
            &topology.leaf("b1").unwrap().netns,
            "b1",
            &[SocketAddr::from((BACKEND, 8080))],
            &[],
        )
        .unwrap();
        let services = workdir.path().join("services.yaml");
        write_atomically(&services, &manifests()).unwrap();
        let mut args = vec![
            format!("--services-file={}", services.display()),
            "--hostname-override=node-a".to_owned(),
            // Every node address serves NodePorts, the pods' too.
            "--nodeport-addresses=10.0.0.0/8".to_owned(),
            "--healthz-bind-address=".to_owned(),
            "--metrics-bind-address=".to_owned(),
            "-v".to_owned(),
        ];
        args.extend(match detector {
            Detector::NamePrefix => vec![
                "--detect-local-mode=InterfaceNamePrefix".to_owned(),
                format!("--pod-interface-name-prefix={POD_PREFIX}"),
            ],
            Detector::Bridge => {
                let config = workdir.path().join("kube-proxy.yaml");
                write_atomically(
                    &config,
                    &format!(
                        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n\
                         detectLocalMode: BridgeInterface\ndetectLocal:\n  bridgeInterface: {BRIDGE}\n  \
                         interfaceNamePrefix: \"\"\n"
                    ),
                )
                .unwrap();
                vec![format!("--config={}", config.display())]
            }
        });
        let bpffs = match mode {
            Mode::Ebpf => {
                let bpffs = BpfFs::mount(label).unwrap();
                args.extend([
                    "--proxy-mode=ebpf".to_owned(),
                    format!("--devices={}", devices.join(",")),
                    format!("--bpf-root={}", bpffs.path().display()),
                ]);
                Some(bpffs)
            }
            Mode::Iptables => {
                args.extend([
                    "--proxy-mode=iptables".to_owned(),
                    // No bpffs here: a mode switch's eBPF cleanup must not touch the host's.
                    "--bpf-root=/nonexistent-vipr-bpffs".to_owned(),
                ]);
                None
            }
        };
        let log = workdir.path().join("vipr.log");
        let vipr = Vipr::start_with_args(&locate_vipr().unwrap(), node, &args, &log).unwrap();
        Self { vipr: Some(vipr), _server: server, topology, _bpffs: bpffs, workdir }
    }

    fn log(&self) -> PathBuf {
        self.workdir.path().join("vipr.log")
    }

    /// One connection from leaf `from` to `frontend`, answered by the endpoint: the client
    /// address it saw.
    fn seen_as(&self, from: &str, frontend: Frontend) -> anyhow::Result<IpAddr> {
        seen_as(&self.topology, from, frontend)
    }

    /// Waits until a connection from `from` to `frontend` reaches the endpoint, which sees the
    /// client as `expected`.
    fn wait_reached(&mut self, from: &str, frontend: Frontend, expected: Ipv4Addr) {
        let log = self.log();
        let vipr = self.vipr.as_mut().expect("vipr runs");
        let topology = &self.topology;
        wait_for(&format!("{from} to reach {frontend} seen as {expected}"), SETTLE, || {
            vipr.ensure_running()?;
            Ok(match seen_as(topology, from, frontend) {
                Ok(seen) if seen == IpAddr::V4(expected) => Check::Done(()),
                Ok(seen) => Check::NotYet(format!("seen as {seen}")),
                Err(error) => Check::NotYet(format!("{error:#}")),
            })
        })
        .unwrap_or_else(|error| panic!("{error:#}\n{}", std::fs::read_to_string(log).unwrap_or_default()));
    }
}

fn seen_as(topology: &Topology, from: &str, frontend: Frontend) -> anyhow::Result<IpAddr> {
    let client = &topology.leaf(from)?.netns;
    let done = client.run(|| exchange(frontend, TIMEOUT))?;
    anyhow::ensure!(done.replied_from == frontend.socket_addr(), "answered from {}", done.replied_from);
    Ok(done.answer.observed_client.ip())
}

fn tcp(ip: Ipv4Addr, port: u16) -> Frontend {
    Frontend { addr: SocketAddrV4::new(ip, port), protocol: Protocol::Tcp }
}

fn check(label: &str, mode: Mode, detector: Detector) {
    let mut lab = DetectorLab::start(label, mode, detector);
    // Cluster IP: the pod keeps its address, the off-cluster client is masqueraded.
    lab.wait_reached("pod", tcp(VIP, 80), POD);
    lab.wait_reached("outside", tcp(VIP, 80), NODE_TOWARD_BACKEND);
    // externalTrafficPolicy: Local without a local endpoint: the pod is short-circuited to the
    // cluster's endpoint, unmasqueraded.
    let pod_gateway = Ipv4Addr::new(10, 10, 0, 1);
    let outside_gateway = Ipv4Addr::new(10, 30, 0, 1);
    lab.wait_reached("pod", tcp(EXTERNAL_IP, 80), POD);
    lab.wait_reached("pod", tcp(pod_gateway, NODE_PORT), POD);
    // ... while the off-cluster client finds no local endpoint: dropped. The pod's connections
    // show the service is programmed.
    for frontend in [tcp(EXTERNAL_IP, 80), tcp(outside_gateway, NODE_PORT)] {
        let outcome = lab.seen_as("outside", frontend);
        assert!(outcome.is_err(), "{mode:?} {detector:?}: outside client reached {frontend}: {outcome:?}");
    }
    lab.vipr.as_mut().unwrap().ensure_running().unwrap();
}

#[test]
fn ebpf_interface_name_prefix_tells_pods_by_their_veth() {
    check("dl-ebpf-prefix", Mode::Ebpf, Detector::NamePrefix);
}

#[test]
fn ebpf_bridge_interface_tells_pods_by_their_bridge() {
    check("dl-ebpf-bridge", Mode::Ebpf, Detector::Bridge);
}

#[test]
fn iptables_interface_name_prefix_tells_pods_by_their_veth() {
    check("dl-ipt-prefix", Mode::Iptables, Detector::NamePrefix);
}

#[test]
fn iptables_bridge_interface_tells_pods_by_their_bridge() {
    check("dl-ipt-bridge", Mode::Iptables, Detector::Bridge);
}
