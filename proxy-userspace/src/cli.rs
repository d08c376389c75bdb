//! Command-line flags. Names, defaults and meaning follow kube-proxy's wherever kube-proxy has
//! the same notion, so that an operator can swap vipr in without relearning them. Every
//! kube-proxy 1.35 flag is accepted: those that mean something to vipr are implemented, the
//! others ([`IGNORED_KUBE_PROXY_FLAGS`]) are accepted, named with the reason in the start-up
//! log line, and change nothing. As with pflag, a flag given twice takes its last value.
//! [`crate::settings::Settings::resolve`] turns the flags, over a `--config` file, into the
//! settings the agent runs with.
use std::{path::PathBuf, time::Duration};

use clap::{Arg, ArgAction, CommandFactory as _, FromArgMatches as _, Parser};
use ipnet::IpNet;

use crate::config::{
    parse_feature_gates, parse_go_duration, BindAddress, CidrPair, DetectLocalMode, FeatureGates,
    LbAlgorithm, LoggingFormat, NodePortAddress, ProxyMode, DEFAULT_HEALTHZ_BIND_ADDRESS,
    DEFAULT_METRICS_BIND_ADDRESS,
};
use crate::dataplane::ebpf::{BpfForwarding, LbMode, XdpMode};

/// Values that say so are kube-proxy's defaults; a flag left out keeps the `--config` file's
/// value, or else that default.
#[derive(Debug, Parser)]
#[command(
    name = "vipr",
    version,
    about = "eBPF Kubernetes service proxy, a drop-in kube-proxy replacement",
    args_override_self = true
)]
pub struct Args {
    /// Which dataplane programs the services; it wins over the --config file's `mode`, in
    /// which "" means iptables as for kube-proxy [default: auto].
    #[arg(long, value_enum)]
    pub proxy_mode: Option<ProxyMode>,

    /// A KubeProxyConfiguration file (kubeproxy.config.k8s.io/v1alpha1, YAML or JSON), as
    /// kube-proxy's, with kube-proxy's defaulting; flags given on the command line override it.
    #[arg(long, value_name = "PATH")]
    pub config: Option<PathBuf>,

    /// Write the effective configuration, as a KubeProxyConfiguration, to this file and exit.
    #[arg(long, value_name = "PATH")]
    pub write_config_to: Option<PathBuf>,

    /// Do the one-time initialisation that needs full root privileges (the OOM score
    /// adjustment, the conntrack sysctls of the iptables and ipvs modes), then exit.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", default_value = "false", action = ArgAction::Set)]
    pub init_only: bool,

    /// Standalone mode: read v1 Services and discovery.k8s.io/v1 EndpointSlices from this
    /// file of manifests (multi-document YAML or JSON) instead of the API server, and re-read
    /// it whenever it changes.
    #[arg(long, value_name = "PATH")]
    pub services_file: Option<PathBuf>,

    /// The kubeconfig file to reach the API server with (without it and without
    /// --services-file: the in-cluster service account).
    #[arg(long, value_name = "PATH")]
    pub kubeconfig: Option<PathBuf>,

    /// The API server's URL, overriding the kubeconfig's (or the in-cluster) server.
    #[arg(long, value_name = "URL")]
    pub master: Option<String>,

    /// Queries per second toward the API server (kube-proxy's client-side rate limit; vipr's
    /// client only watches, and has no such limiter) [default: 5].
    #[arg(long, value_name = "QPS")]
    pub kube_api_qps: Option<f32>,

    /// Burst of queries toward the API server (see --kube-api-qps) [default: 10].
    #[arg(long, value_name = "N")]
    pub kube_api_burst: Option<i32>,

    /// Content type of requests to the API server; vipr's client speaks JSON only
    /// [default: application/vnd.kubernetes.protobuf].
    #[arg(long, value_name = "TYPE")]
    pub kube_api_content_type: Option<String>,

    /// kube-proxy feature gates, `Name=true,Other=false`. Gates that change vipr's behaviour
    /// are honoured; the others are named in the start-up log and change nothing.
    #[arg(long, value_name = "NAME=BOOL[,...]", value_parser = parse_feature_gates)]
    pub feature_gates: Option<FeatureGates>,

    /// This node's primary IP (IPv4 or IPv6), overriding the Node object's; its family picks
    /// the default health and metrics addresses (0.0.0.0 / 127.0.0.1, or [::] / [::1]).
    /// 0.0.0.0 or :: means none [default: 0.0.0.0].
    #[arg(long, value_name = "IP")]
    pub bind_address: Option<std::net::IpAddr>,

    /// The OOM score adjustment vipr gives itself (/proc/self/oom_score_adj), -1000 to 1000
    /// [default: -999].
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    pub oom_score_adj: Option<i32>,

    /// The name of this node, which decides which endpoints are local. Defaults to the host
    /// name.
    #[arg(long, visible_alias = "hostname-override", value_name = "NAME")]
    pub node_name: Option<String>,

    /// Interfaces whose ingress traffic is load balanced (comma-separated). Defaults to every
    /// interface but loopback.
    #[arg(long, value_delimiter = ',', value_name = "IF[,IF...]")]
    pub devices: Vec<String>,

    /// Where the bpffs is mounted; vipr pins its programs and maps under DIR/vipr/ and mounts
    /// a bpffs at DIR when there is none.
    #[arg(long, value_name = "DIR", default_value = "/sys/fs/bpf")]
    pub bpf_root: PathBuf,

    /// Where vipr records the state it last programmed (eBPF mode: the map entries it
    /// wants), for `vipr inspect drift` to compare with the kernel's.
    #[arg(long, value_name = "DIR", default_value = crate::inspect::DEFAULT_STATE_DIR)]
    pub state_dir: PathBuf,

    /// The cgroup v2 directory whose processes' connections to services are balanced at the
    /// socket level (eBPF mode; descendants included) [default: the cgroup2 mount point].
    #[arg(long, value_name = "DIR")]
    pub cgroup_root: Option<PathBuf>,

    /// Balance this node's pods' connections to services at the socket level too (eBPF mode):
    /// a pod's connect() or sendmsg() to a cluster IP goes to the backend once, so its packets
    /// need no NAT. Pods are the processes under --pods-cgroup. `false`: pods' packets are
    /// balanced by TC.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", default_value = "true", action = ArgAction::Set)]
    pub bpf_socket_lb_pods: bool,

    /// The cgroup v2 directory of this node's pods, under the host's cgroup2 mount [default:
    /// the kubelet's `kubepods.slice` or `kubepods` there, if one exists].
    #[arg(long, value_name = "DIR")]
    pub pods_cgroup: Option<PathBuf>,

    /// Capacity of the services map: entries are frontends × 3 source classes; a Service
    /// whose entries do not fit is refused [default: 196608]. A pinned map of another size
    /// is migrated at start (every `--bpf-*-max`).
    #[arg(long, value_name = "ENTRIES")]
    pub bpf_services_max: Option<u32>,

    /// Capacity of the backends map (and the backend-set membership map): the slots of all
    /// distinct backend sets, a Maglev table's size each with --lb-algorithm=maglev; a
    /// Service whose slots do not fit is refused [default: 1048576].
    #[arg(long, value_name = "ENTRIES")]
    pub bpf_backends_max: Option<u32>,

    /// Capacity of the connection-tracking map, two entries per connection; when it is full, a
    /// new connection replaces one that never completed its handshake, or is refused
    /// [default: 524288].
    #[arg(long, value_name = "ENTRIES")]
    pub bpf_flows_max: Option<u32>,

    /// Capacity of each family's source-ranges trie: `loadBalancerSourceRanges` entries, one
    /// per service port and range; a Service whose ranges do not fit is refused
    /// [default: 65536].
    #[arg(long, value_name = "ENTRIES")]
    pub bpf_source_ranges_max: Option<u32>,

    /// Capacity of each family's unmatched-destinations trie: one entry per cluster IP and
    /// service CIDR [default: 65536].
    #[arg(long, value_name = "ENTRIES")]
    pub bpf_unmatched_max: Option<u32>,

    /// Capacity of the per-CPU packet/byte counters map: one entry per (service port,
    /// endpoint) pair, 16 bytes per CPU each; pairs beyond it are not counted
    /// [default: 65536].
    #[arg(long, value_name = "ENTRIES")]
    pub bpf_counters_max: Option<u32>,

    /// Capacity of each family's session-affinity map: clients remembered over all
    /// ClientIP-affinity services; the least recently used are forgotten first
    /// [default: 65536].
    #[arg(long, value_name = "ENTRIES")]
    pub bpf_affinity_max: Option<u32>,

    /// The eBPF datapath's XDP fast path for NodePort, load-balancer and external-IP traffic
    /// from outside the node: `native` on every served device (in the driver, falling back to
    /// `generic` and then to none where the driver refuses), `generic`, or `off`. Only for
    /// interfaces whose packets carry full checksums (NICs): see docs/architecture/xdp.md, "XDP
    /// fast path" [default: native on the devices backed by hardware whose driver supports it,
    /// none on the others].
    #[arg(long, value_enum, value_name = "MODE")]
    pub xdp: Option<XdpMode>,

    /// How the eBPF datapath hands on a service packet the node forwards: `stack` sends it back
    /// into the kernel, which routes and filters it (netfilter FORWARD and POSTROUTING) with
    /// the addresses a NetworkPolicy names, as behind kube-proxy; `redirect` sends it straight
    /// to the next hop (and lets `--xdp` finish packets), which is faster but BYPASSES
    /// netfilter's FORWARD and POSTROUTING chains and with them iptables-enforced
    /// NetworkPolicy (Calico's iptables dataplane, kube-router, ...). Use `redirect` only where
    /// nothing filters forwarded traffic in netfilter. With `stack`, the XDP fast path is off;
    /// masqueraded connections are redirected on both paths (docs/architecture/ebpf-datapath.md, "Forwarding").
    #[arg(long, value_enum, value_name = "PATH", default_value = "stack")]
    pub bpf_forwarding: BpfForwarding,

    /// How the eBPF datapath sends a NodePort, load-balancer or external-IP connection from
    /// outside to a backend on another node (Cilium's `bpf-lb-mode`): `snat` masquerades it,
    /// as kube-proxy, so the replies come back through this node; `dsr` keeps the client's
    /// address and carries the service address to the backend's node in an IPv4 option (an
    /// IPv6 destination-options header), and
    /// the replies leave from there straight to the client (direct server return, TCP and UDP;
    /// every node must run vipr with it, taking carried service addresses: see
    /// --lb-dsr-accept); `hybrid` is DSR for TCP and SNAT for UDP and SCTP.
    #[arg(long, value_enum, value_name = "MODE", default_value = "snat")]
    pub lb_mode: LbMode,

    /// Whether this node, as a backend's node, takes the service address that another node's
    /// direct-server-return request carries, and gives the backend's replies that address as
    /// source. The option is not authenticated: whoever can send a pod a request with it
    /// chooses the source address of the pod's replies, so by default a node takes it only for
    /// the protocols its own --lb-mode sends by DSR (none with `snat`, TCP with `hybrid`, TCP
    /// and UDP with `dsr`). `true` takes TCP's and UDP's whatever the mode: for switching a
    /// running cluster to DSR, first on every node, then --lb-mode. `false` takes none
    #[arg(long, value_name = "BOOL", num_args = 0..=1, require_equals = true, default_missing_value = "true", action = ArgAction::Set)]
    pub lb_dsr_accept: Option<bool>,

    /// How the eBPF datapath picks a new connection's backend: `random` (as kube-proxy), or
    /// `maglev` (consistent hashing of the flow: every node picks the same backend for a flow,
    /// and a backend change moves only about 1/N of the flows).
    #[arg(long, value_enum, value_name = "ALGORITHM", default_value = "random")]
    pub lb_algorithm: LbAlgorithm,

    /// Slots of each Maglev table, a prime from 251 to 131071; each Maglev frontend takes this
    /// many backends-map entries per source class. At least 100 × the largest backend count
    /// keeps the spread even [default: 1021].
    #[arg(long, value_name = "PRIME")]
    pub maglev_table_size: Option<u32>,

    /// Netfilter conntrack entries per CPU: nf_conntrack_max is raised to this times the CPU
    /// count (at least --conntrack-min) in iptables and ipvs modes; 0 leaves it as it is
    /// [default: 32768].
    #[arg(long, value_name = "N")]
    pub conntrack_max_per_core: Option<i32>,

    /// The least nf_conntrack_max to set, whatever --conntrack-max-per-core gives
    /// [default: 131072].
    #[arg(long, value_name = "N")]
    pub conntrack_min: Option<i32>,

    /// Set nf_conntrack_tcp_be_liberal=1 (iptables and ipvs modes) [default: false].
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_name = "BOOL")]
    pub conntrack_tcp_be_liberal: Option<bool>,

    /// Idle timeout of established TCP connections: in the eBPF datapath's connection
    /// tracking, and nf_conntrack_tcp_timeout_established in iptables and ipvs modes
    /// [default: 24h0m0s].
    #[arg(long, value_name = "DURATION", value_parser = parse_go_duration)]
    pub conntrack_tcp_timeout_established: Option<Duration>,

    /// Idle timeout of TCP connections one side has closed (a FIN went one way: CLOSE_WAIT);
    /// nf_conntrack_tcp_timeout_close_wait in iptables and ipvs modes [default: 1h0m0s].
    #[arg(long, value_name = "DURATION", value_parser = parse_go_duration)]
    pub conntrack_tcp_timeout_close_wait: Option<Duration>,

    /// Idle timeout of UDP flows that were never answered, or answered once (0: the kernel's
    /// 30s); nf_conntrack_udp_timeout in iptables and ipvs modes [default: 0s].
    #[arg(long, value_name = "DURATION", value_parser = parse_go_duration)]
    pub conntrack_udp_timeout: Option<Duration>,

    /// Idle timeout of UDP streams, whose client sent again after an answer (0: the kernel's
    /// 120s); nf_conntrack_udp_timeout_stream in iptables and ipvs modes [default: 0s].
    #[arg(long, value_name = "DURATION", value_parser = parse_go_duration)]
    pub conntrack_udp_timeout_stream: Option<Duration>,

    // Flow table under attack (docs/reliability.md): half-open connections and a filling map.
    /// Idle timeout of TCP connections the backend never answered (the kernel's SYN_SENT; 0:
    /// the default) [default: 2m0s].
    #[arg(long, value_name = "DURATION", value_parser = parse_go_duration)]
    pub conntrack_tcp_timeout_syn_sent: Option<Duration>,

    /// Idle timeout of TCP connections the backend answered but whose client never completed
    /// the handshake (the kernel's SYN_RECV; 0: the default) [default: 1m0s].
    #[arg(long, value_name = "DURATION", value_parser = parse_go_duration)]
    pub conntrack_tcp_timeout_syn_recv: Option<Duration>,

    /// Fill level of the flows map, in percent of its capacity, above which connections that
    /// are not established (TCP without the client's ACK after the SYN-ACK, UDP that is no
    /// stream) expire after --conntrack-pressure-timeout and the expiry runs every second
    /// [default: 75].
    #[arg(long, value_name = "PERCENT")]
    pub conntrack_pressure_threshold: Option<u8>,

    /// Idle timeout of connections that are not established while the flows map is above
    /// --conntrack-pressure-threshold [default: 5s].
    #[arg(long, value_name = "DURATION", value_parser = parse_go_duration)]
    pub conntrack_pressure_timeout: Option<Duration>,

    /// Remove everything vipr installed (programs, links, pinned maps under --bpf-root) and
    /// exit.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", default_value = "false", action = ArgAction::Set)]
    pub cleanup: bool,

    /// With --cleanup: leave the iptables chains and IPVS state that kube-proxy's canary chain
    /// (KUBE-PROXY-CANARY) says are a kube-proxy's, as an uninstall does while kube-proxy serves
    /// the node again; vipr's eBPF datapath and vipr's own chains still go.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", default_value = "false", action = ArgAction::Set)]
    pub cleanup_keep_kube_proxy: bool,

    /// The pods' CIDR (or a comma-separated IPv4,IPv6 pair): with --detect-local-mode
    /// ClusterCIDR, traffic from inside it is pod traffic, the rest is masqueraded toward
    /// cluster IPs.
    #[arg(long, alias = "cluster-cidrs", value_name = "CIDR[,CIDR]")]
    pub cluster_cidr: Option<CidrPair>,

    /// How traffic from pods is told from other traffic: ClusterCIDR (--cluster-cidr),
    /// NodeCIDR (the Node object's spec.podCIDRs), BridgeInterface or InterfaceNamePrefix
    /// (not implemented by vipr: refused) [default: ClusterCIDR].
    #[arg(long, value_enum, value_name = "MODE")]
    pub detect_local_mode: Option<DetectLocalMode>,

    /// The pods' bridge, for --detect-local-mode=BridgeInterface.
    #[arg(long, value_name = "IF")]
    pub pod_bridge_interface: Option<String>,

    /// The prefix of the pods' interface names, for --detect-local-mode=InterfaceNamePrefix.
    #[arg(long, value_name = "PREFIX")]
    pub pod_interface_name_prefix: Option<String>,

    /// The service IP range (or a comma-separated IPv4,IPv6 pair): a connection to an address
    /// inside it that is no service's cluster IP is dropped, as kube-proxy's nftables mode
    /// does with the ranges of the cluster's ServiceCIDR objects.
    #[arg(long, value_name = "CIDR[,CIDR]")]
    pub service_cluster_ip_range: Option<CidrPair>,

    /// Serve only the Services labelled `service.kubernetes.io/service-proxy-name=NAME` (and
    /// their EndpointSlices), beside another proxy that serves the unlabelled ones. Without
    /// it, vipr serves the unlabelled Services and leaves every labelled one to its proxy,
    /// as kube-proxy does.
    #[arg(long, value_name = "NAME")]
    pub service_proxy_name: Option<String>,

    /// SNAT all traffic sent to service cluster IPs [default: false].
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_name = "BOOL")]
    pub masquerade_all: Option<bool>,

    /// CIDRs of the node addresses that NodePorts are served on, or the keywords `primary`
    /// (the node's primary addresses), `all`, `localhost`; comma-separated
    /// [default: primary].
    #[arg(long, value_delimiter = ',', value_name = "CIDR|primary[,...]")]
    pub nodeport_addresses: Option<Vec<NodePortAddress>>,

    /// Where /healthz and /livez are served; empty disables them [default: 0.0.0.0:10256].
    #[arg(long, value_name = "IP:PORT", value_parser = BindAddress::parser(DEFAULT_HEALTHZ_BIND_ADDRESS.port()))]
    pub healthz_bind_address: Option<BindAddress>,

    /// Where /metrics and /proxyMode are served; empty disables them
    /// [default: 127.0.0.1:10249].
    #[arg(long, value_name = "IP:PORT", value_parser = BindAddress::parser(DEFAULT_METRICS_BIND_ADDRESS.port()))]
    pub metrics_bind_address: Option<BindAddress>,

    /// Export the per-endpoint series (`vipr_backend_*`, one per service port and endpoint);
    /// false keeps only the per-service sums, for clusters with many endpoints [default: true].
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_name = "BOOL")]
    pub metrics_per_endpoint: Option<bool>,

    /// Deprecated kube-proxy flag: the port of /healthz; 0 disables the server. Without
    /// --config only, as kube-proxy.
    #[arg(long, value_name = "PORT")]
    pub healthz_port: Option<u16>,

    /// Deprecated kube-proxy flag: the port of /metrics; 0 disables the server. Without
    /// --config only, as kube-proxy.
    #[arg(long, value_name = "PORT")]
    pub metrics_port: Option<u16>,

    /// vipr's own flag (kube-proxy has none of this name): the minimum time between two
    /// syncs in every mode, over the per-mode flags and the file (a Go duration: 1s, 500ms,
    /// 1m30s) [default: the running mode's, 1s; ipvs: 0s; ebpf: 20ms].
    #[arg(long, value_name = "DURATION", value_parser = parse_go_duration)]
    pub min_sync_period: Option<Duration>,

    /// vipr's own flag (kube-proxy has none of this name): the maximum time between two syncs
    /// in every mode, changes or not [default: the running mode's, 30s].
    #[arg(long, value_name = "DURATION", value_parser = parse_go_duration)]
    pub sync_period: Option<Duration>,

    /// kube-proxy's sync period, for every mode but ipvs [default: 30s].
    #[arg(long, value_name = "DURATION", value_parser = parse_go_duration)]
    pub iptables_sync_period: Option<Duration>,

    /// kube-proxy's minimum sync period, for every mode but ipvs [default: 1s; ebpf mode,
    /// which kube-proxy does not have: 20ms].
    #[arg(long, value_name = "DURATION", value_parser = parse_go_duration)]
    pub iptables_min_sync_period: Option<Duration>,

    /// kube-proxy's sync period in ipvs mode [default: 30s].
    #[arg(long, value_name = "DURATION", value_parser = parse_go_duration)]
    pub ipvs_sync_period: Option<Duration>,

    /// kube-proxy's minimum sync period in ipvs mode [default: 0s].
    #[arg(long, value_name = "DURATION", value_parser = parse_go_duration)]
    pub ipvs_min_sync_period: Option<Duration>,

    /// The IPVS scheduler of every virtual service (--proxy-mode=ipvs), any the kernel has:
    /// rr (round robin), wrr, lc, wlc, lblc, lblcr, dh, sh (source hashing), sed, nq, fo, ovf,
    /// mh (Maglev hashing), twos [default: rr].
    #[arg(long, value_name = "NAME", value_parser = crate::dataplane::ipvs::SCHEDULERS)]
    pub ipvs_scheduler: Option<String>,

    /// IPVS's timeout of idle TCP connections (a Go duration; 0 keeps the kernel's)
    /// [default: 0s].
    #[arg(long, value_name = "DURATION", value_parser = parse_go_duration)]
    pub ipvs_tcp_timeout: Option<Duration>,

    /// IPVS's timeout of TCP connections after a FIN (0 keeps the kernel's) [default: 0s].
    #[arg(long, value_name = "DURATION", value_parser = parse_go_duration)]
    pub ipvs_tcpfin_timeout: Option<Duration>,

    /// IPVS's timeout of UDP flows (0 keeps the kernel's) [default: 0s].
    #[arg(long, value_name = "DURATION", value_parser = parse_go_duration)]
    pub ipvs_udp_timeout: Option<Duration>,

    /// Answer ARP only for addresses of the interface asked on (arp_ignore=1,
    /// arp_announce=2), so the service addresses on kube-ipvs0 are never announced
    /// [default: false].
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_name = "BOOL")]
    pub ipvs_strict_arp: Option<bool>,

    /// IPVS virtual services inside these CIDRs (comma-separated) are not vipr's: it never
    /// removes them.
    #[arg(long, value_delimiter = ',', value_name = "CIDR[,CIDR...]")]
    pub ipvs_exclude_cidrs: Option<Vec<IpNet>>,

    /// Serve IPv4 NodePorts on 127.0.0.1 too (--proxy-mode=iptables only, as kube-proxy; sets
    /// net.ipv4.conf.all.route_localnet=1, node-wide) [default: true].
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_name = "BOOL")]
    pub iptables_localhost_nodeports: Option<bool>,

    /// kube-proxy's log verbosity (klog): 0-2 info, 3-4 debug, 5 and more trace.
    #[arg(long = "v", value_name = "N")]
    pub klog_verbosity: Option<u32>,

    /// Log lines as text or as JSON objects [default: text].
    #[arg(long, value_enum, value_name = "FORMAT")]
    pub logging_format: Option<LoggingFormat>,

    /// More log output (-v: debug, -vv: trace). RUST_LOG overrides it.
    #[arg(short, action = ArgAction::Count)]
    pub verbose: u8,

    /// The kube-proxy flags given that mean nothing to vipr (filled by
    /// [`Args::try_parse_kube_proxy_style`]).
    #[arg(skip)]
    pub ignored_flags: Vec<IgnoredFlag>,
}

/// A kube-proxy flag that vipr accepts and ignores, and why.
#[derive(Clone, Copy, Debug)]
pub struct IgnoredFlag {
    pub name: &'static str,
    pub reason: &'static str,
}

const IPTABLES_MARK: &str =
    "vipr's iptables and ipvs modes mark packets to masquerade with kube-proxy's default bit (0x4000)";
const SERVERS: &str = "removed from kube-proxy; use --healthz-bind-address / --metrics-bind-address";
const LOGGING: &str = "vipr's logging has no such setting (use --v=N, -v, --logging-format, or RUST_LOG)";
const KLOG_REMOVED: &str = "a klog flag removed from kube-proxy in 1.26; vipr logs to stderr";
const USERSPACE: &str = "it configured kube-proxy's userspace mode, removed in 1.26";

/// Every kube-proxy flag (Linux, 1.35, and older ones still found in manifests) that means
/// nothing to vipr. Each is accepted, so that a kube-proxy command line runs unchanged, and
/// named with its reason in the start-up log line, so that nobody believes it took effect.
pub const IGNORED_KUBE_PROXY_FLAGS: &[IgnoredFlag] = &[
    IgnoredFlag { name: "iptables-masquerade-bit", reason: IPTABLES_MARK },
    IgnoredFlag { name: "ipvs-masquerade-bit", reason: IPTABLES_MARK },
    IgnoredFlag {
        name: "config-sync-period",
        reason: "vipr's watches never resync by relisting; --sync-period resyncs the dataplane",
    },
    IgnoredFlag {
        name: "bind-address-hard-fail",
        reason: "vipr always retries a server address that is busy (kube-proxy's default)",
    },
    IgnoredFlag { name: "profiling", reason: "vipr serves no /debug/pprof" },
    IgnoredFlag { name: "show-hidden-metrics-for-version", reason: "vipr has no hidden metrics" },
    IgnoredFlag { name: "node-ip-override", reason: "removed from kube-proxy; use --bind-address" },
    IgnoredFlag { name: "healthz-bind-addresses", reason: SERVERS },
    IgnoredFlag { name: "healthz-bind-port", reason: SERVERS },
    IgnoredFlag { name: "metrics-bind-addresses", reason: SERVERS },
    IgnoredFlag { name: "metrics-bind-port", reason: SERVERS },
    IgnoredFlag { name: "proxy-port-range", reason: USERSPACE },
    IgnoredFlag { name: "udp-timeout", reason: USERSPACE },
    IgnoredFlag { name: "resource-container", reason: "removed from kube-proxy in 1.16" },
    IgnoredFlag { name: "vmodule", reason: LOGGING },
    IgnoredFlag { name: "log-flush-frequency", reason: "vipr writes every log line at once" },
    IgnoredFlag { name: "log-text-split-stream", reason: LOGGING },
    IgnoredFlag { name: "log-text-info-buffer-size", reason: LOGGING },
    IgnoredFlag { name: "log-json-split-stream", reason: LOGGING },
    IgnoredFlag { name: "log-json-info-buffer-size", reason: LOGGING },
    IgnoredFlag { name: "add-dir-header", reason: KLOG_REMOVED },
    IgnoredFlag { name: "alsologtostderr", reason: KLOG_REMOVED },
    IgnoredFlag { name: "log-backtrace-at", reason: KLOG_REMOVED },
    IgnoredFlag { name: "log-dir", reason: KLOG_REMOVED },
    IgnoredFlag { name: "log-file", reason: KLOG_REMOVED },
    IgnoredFlag { name: "log-file-max-size", reason: KLOG_REMOVED },
    IgnoredFlag { name: "logtostderr", reason: KLOG_REMOVED },
    IgnoredFlag { name: "one-output", reason: KLOG_REMOVED },
    IgnoredFlag { name: "skip-headers", reason: KLOG_REMOVED },
    IgnoredFlag { name: "skip-log-headers", reason: KLOG_REMOVED },
    IgnoredFlag { name: "stderrthreshold", reason: KLOG_REMOVED },
];

impl Args {
    /// Parses the command line, exiting with a usage error as clap does.
    pub fn parse_kube_proxy_style() -> Self {
        Self::try_parse_kube_proxy_style(std::env::args_os()).unwrap_or_else(|error| error.exit())
    }

    /// Parses `argv` (program name first) as kube-proxy would: klog's `-v=N` / `-v N` mean
    /// `--v=N`, and the kube-proxy flags that mean nothing to vipr are accepted and recorded
    /// in [`Args::ignored_flags`].
    pub fn try_parse_kube_proxy_style<I, T>(argv: I) -> Result<Self, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString>,
    {
        let mut command = Self::command().args(IGNORED_KUBE_PROXY_FLAGS.iter().map(|flag| {
            // Hidden, and taking an optional value, so that `--flag`, `--flag=x` and
            // `--flag x` all parse.
            Arg::new(flag.name).long(flag.name).hide(true).num_args(0..=1).action(ArgAction::Append)
        }));
        let matches = command.try_get_matches_from_mut(klog_verbosity_as_long_flag(argv))?;
        let mut args = Self::from_arg_matches(&matches).map_err(|error| error.format(&mut command))?;
        args.ignored_flags =
            IGNORED_KUBE_PROXY_FLAGS.iter().filter(|flag| matches.contains_id(flag.name)).copied().collect();
        Ok(args)
    }
}

/// Rewrites klog's `-v=N`, `-vN` and `-v N` to `--v=N`, leaving vipr's own `-v` / `-vv`
/// counts alone. vipr takes no positional arguments, so a number after `-v` can only be its
/// level.
fn klog_verbosity_as_long_flag<I, T>(argv: I) -> Vec<std::ffi::OsString>
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString>,
{
    let is_level = |text: &str| !text.is_empty() && text.bytes().all(|byte| byte.is_ascii_digit());
    let mut rewritten: Vec<std::ffi::OsString> = Vec::new();
    for arg in argv.into_iter().map(Into::into) {
        let text = arg.to_str().unwrap_or_default();
        let level = text.strip_prefix("-v").map(|rest| rest.strip_prefix('=').unwrap_or(rest));
        if let Some(level) = level.filter(|level| is_level(level)) {
            rewritten.push(format!("--v={level}").into());
        } else if is_level(text) && rewritten.last().is_some_and(|previous| previous == "-v") {
            rewritten.pop();
            rewritten.push(format!("--v={text}").into());
        } else {
            rewritten.push(arg);
        }
    }
    rewritten
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(argv: &[&str]) -> Result<Args, clap::Error> {
        Args::try_parse_kube_proxy_style(std::iter::once("vipr").chain(argv.iter().copied()))
    }

    #[test]
    fn the_original_flags_keep_working() {
        let args = parse(&[
            "--proxy-mode=ebpf",
            "--services-file=s.yaml",
            "--node-name=n1",
            "--devices=eth0,eth1",
            "--bpf-root=/tmp/bpf",
            "-vv",
        ])
        .unwrap();
        assert_eq!(args.proxy_mode, Some(ProxyMode::Ebpf));
        assert_eq!(args.node_name.as_deref(), Some("n1"));
        assert_eq!(args.devices, ["eth0", "eth1"]);
        assert_eq!(args.verbose, 2);
        assert!(!args.cleanup);
        assert!(parse(&["--cleanup"]).unwrap().cleanup);
        assert!(parse(&["--cleanup=true"]).unwrap().cleanup);
        assert!(!parse(&["--cleanup=false"]).unwrap().cleanup);
        assert!(!args.cleanup_keep_kube_proxy);
        assert!(parse(&["--cleanup", "--cleanup-keep-kube-proxy"]).unwrap().cleanup_keep_kube_proxy);
    }

    #[test]
    fn kube_proxy_flags_parse() {
        let args = parse(&[
            "--kubeconfig=/k",
            "--hostname-override=node-b",
            "--cluster-cidr=10.244.0.0/16",
            "--masquerade-all",
            "--nodeport-addresses=10.0.0.0/8,192.168.0.0/16",
            "--healthz-bind-address=0.0.0.0:10256",
            "--metrics-bind-address=0.0.0.0:10249",
            "--min-sync-period=500ms",
            "--sync-period=1m30s",
            "--config=/etc/kube-proxy/config.conf",
            "--v=2",
        ])
        .unwrap();
        assert_eq!(args.node_name.as_deref(), Some("node-b"));
        assert_eq!(args.masquerade_all, Some(true));
        assert_eq!(args.nodeport_addresses.map(|a| a.len()), Some(2));
        assert_eq!(args.min_sync_period, Some(Duration::from_millis(500)));
        assert_eq!(args.sync_period, Some(Duration::from_secs(90)));
        assert_eq!(args.klog_verbosity, Some(2));
        assert_eq!(parse(&["--masquerade-all=false"]).unwrap().masquerade_all, Some(false));
    }

    #[test]
    fn kube_proxy_ipvs_flags_parse() {
        let args = parse(&[
            "--proxy-mode=ipvs",
            "--ipvs-scheduler=wlc",
            "--ipvs-tcp-timeout=15m",
            "--ipvs-tcpfin-timeout=2m",
            "--ipvs-udp-timeout=5m",
            "--ipvs-strict-arp",
            "--ipvs-exclude-cidrs=10.0.0.0/8,fd00::/64",
        ])
        .unwrap();
        assert_eq!(args.proxy_mode, Some(ProxyMode::Ipvs));
        assert_eq!(args.ipvs_scheduler.as_deref(), Some("wlc"));
        assert_eq!(args.ipvs_tcp_timeout, Some(Duration::from_secs(900)));
        assert_eq!(args.ipvs_tcpfin_timeout, Some(Duration::from_secs(120)));
        assert_eq!(args.ipvs_udp_timeout, Some(Duration::from_secs(300)));
        assert_eq!(args.ipvs_strict_arp, Some(true));
        assert_eq!(args.ipvs_exclude_cidrs.map(|cidrs| cidrs.len()), Some(2));
        assert_eq!(parse(&["--ipvs-scheduler=mh"]).unwrap().ipvs_scheduler.as_deref(), Some("mh"));
        let error = parse(&["--ipvs-scheduler=fancy"]).unwrap_err().to_string();
        assert!(error.contains("--ipvs-scheduler") && error.contains("rr"), "{error}");
        assert!(parse(&["--ipvs-exclude-cidrs=10.0.0.1"]).is_err());
    }

    #[test]
    fn klog_short_verbosity_forms() {
        for argv in [&["-v=3"][..], &["-v3"], &["-v", "3"], &["--v", "3"]] {
            let args = parse(argv).unwrap();
            assert_eq!((args.klog_verbosity, args.verbose), (Some(3), 0), "{argv:?}");
        }
        assert_eq!(parse(&["-v", "-v"]).unwrap().verbose, 2);
    }

    #[test]
    fn bad_values_name_the_flag() {
        let error = parse(&["--sync-period=30"]).unwrap_err().to_string();
        assert!(error.contains("--sync-period") && error.contains("invalid duration"), "{error}");
        let error = parse(&["--cluster-cidr=10.0.0.0"]).unwrap_err().to_string();
        assert!(error.contains("--cluster-cidr"), "{error}");
        let error = parse(&["--nodeport-addresses=eth0"]).unwrap_err().to_string();
        assert!(error.contains("--nodeport-addresses"), "{error}");
    }

    /// Every flag of kube-proxy 1.35's `kube-proxy --help` on Linux.
    const KUBE_PROXY_1_35_FLAGS: &[&str] = &[
        "bind-address=10.0.0.1",
        "bind-address-hard-fail",
        "cleanup",
        "cluster-cidr=10.244.0.0/16",
        "config=/c",
        "config-sync-period=15m",
        "conntrack-max-per-core=32768",
        "conntrack-min=131072",
        "conntrack-tcp-be-liberal",
        "conntrack-tcp-timeout-close-wait=1h",
        "conntrack-tcp-timeout-established=24h",
        "conntrack-udp-timeout=30s",
        "conntrack-udp-timeout-stream=2m",
        "detect-local-mode=ClusterCIDR",
        "feature-gates=A=true,B=false",
        "healthz-bind-address=0.0.0.0:10256",
        "healthz-port=10256",
        "hostname-override=n",
        "init-only",
        "iptables-localhost-nodeports=false",
        "iptables-masquerade-bit=14",
        "iptables-min-sync-period=1s",
        "iptables-sync-period=30s",
        "ipvs-exclude-cidrs=10.0.0.0/8",
        "ipvs-min-sync-period=0s",
        "ipvs-scheduler=mh",
        "ipvs-strict-arp",
        "ipvs-sync-period=30s",
        "ipvs-tcp-timeout=0s",
        "ipvs-tcpfin-timeout=0s",
        "ipvs-udp-timeout=0s",
        "kube-api-burst=10",
        "kube-api-content-type=application/json",
        "kube-api-qps=5",
        "kubeconfig=/k",
        "log-flush-frequency=5s",
        "log-json-info-buffer-size=0",
        "log-json-split-stream",
        "log-text-info-buffer-size=0",
        "log-text-split-stream",
        "logging-format=json",
        "masquerade-all",
        "master=https://127.0.0.1",
        "metrics-bind-address=127.0.0.1:10249",
        "metrics-port=10249",
        "nodeport-addresses=primary",
        "oom-score-adj=-999",
        "pod-bridge-interface=cbr0",
        "pod-interface-name-prefix=veth",
        "profiling",
        "proxy-mode=iptables",
        "show-hidden-metrics-for-version=1.34",
        "v=2",
        "vmodule=proxier=4",
        "write-config-to=/w",
    ];

    #[test]
    fn every_kube_proxy_1_35_flag_is_accepted() {
        for flag in KUBE_PROXY_1_35_FLAGS {
            let argv = format!("--{flag}");
            parse(&[&argv]).unwrap_or_else(|error| panic!("{argv}: {error}"));
        }
        let all: Vec<String> = KUBE_PROXY_1_35_FLAGS.iter().map(|flag| format!("--{flag}")).collect();
        let args = parse(&all.iter().map(String::as_str).collect::<Vec<_>>()).unwrap();
        let ignored: Vec<&str> = args.ignored_flags.iter().map(|flag| flag.name).collect();
        assert_eq!(
            ignored,
            [
                "iptables-masquerade-bit",
                "config-sync-period",
                "bind-address-hard-fail",
                "profiling",
                "show-hidden-metrics-for-version",
                "vmodule",
                "log-flush-frequency",
                "log-text-split-stream",
                "log-text-info-buffer-size",
                "log-json-split-stream",
                "log-json-info-buffer-size",
            ]
        );
        // Space-separated values, and flags without a value, parse too.
        let args = parse(&["--profiling", "--config-sync-period", "15m", "--oom-score-adj", "-998"]).unwrap();
        assert_eq!(args.oom_score_adj, Some(-998));
        assert_eq!(args.ignored_flags.len(), 2);
    }

    #[test]
    fn implemented_kube_proxy_flags_parse_into_their_fields() {
        let args = parse(&[
            "--iptables-sync-period=20s",
            "--iptables-min-sync-period=2s",
            "--ipvs-sync-period=40s",
            "--ipvs-min-sync-period=3s",
            "--oom-score-adj=-998",
            "--detect-local-mode=NodeCIDR",
            "--bind-address=fd00::7",
            "--conntrack-max-per-core=131072",
            "--conntrack-min=0",
            "--conntrack-tcp-be-liberal",
            "--logging-format=json",
            "--master=https://127.0.0.1",
            "--feature-gates=A=true,B=false",
            "--init-only",
            "--write-config-to=/tmp/out.yaml",
        ])
        .unwrap();
        assert_eq!(args.iptables_sync_period, Some(Duration::from_secs(20)));
        assert_eq!(args.ipvs_min_sync_period, Some(Duration::from_secs(3)));
        assert_eq!(args.detect_local_mode, Some(DetectLocalMode::NodeCidr));
        assert_eq!(args.bind_address, Some("fd00::7".parse().unwrap()));
        assert_eq!((args.conntrack_max_per_core, args.conntrack_min), (Some(131_072), Some(0)));
        assert_eq!(args.conntrack_tcp_be_liberal, Some(true));
        assert_eq!(args.logging_format, Some(LoggingFormat::Json));
        assert_eq!(args.master.as_deref(), Some("https://127.0.0.1"));
        let gates = args.feature_gates.unwrap().0;
        assert_eq!(gates.into_iter().collect::<Vec<_>>(), [("A".into(), true), ("B".into(), false)]);
        assert!(args.init_only);
        assert!(args.ignored_flags.is_empty());
        assert!(parse(&["--feature-gates=A"]).unwrap_err().to_string().contains("--feature-gates"));
        assert!(parse(&["--feature-gates=A=maybe"]).is_err());
        assert!(parse(&["--detect-local-mode=Nope"]).is_err());
        assert!(parse(&["--logging-format=xml"]).is_err());
    }

    #[test]
    fn a_flag_given_twice_takes_its_last_value_as_pflag() {
        let args = parse(&["--proxy-mode=iptables", "--v=2", "--proxy-mode=ebpf"]).unwrap();
        assert_eq!(args.proxy_mode, Some(ProxyMode::Ebpf));
        // List flags accumulate, as pflag's string slices do.
        let args = parse(&[
            "--devices=a",
            "--devices=b,c",
            "--nodeport-addresses=primary",
            "--nodeport-addresses=all",
        ])
        .unwrap();
        assert_eq!(args.devices, ["a", "b", "c"]);
        assert_eq!(args.nodeport_addresses.map(|addresses| addresses.len()), Some(2));
    }

    #[test]
    fn ignored_flags_are_unique_and_none_is_an_implemented_one() {
        let command = Args::command();
        let mut names = std::collections::BTreeSet::new();
        for flag in IGNORED_KUBE_PROXY_FLAGS {
            assert!(names.insert(flag.name), "{} listed twice", flag.name);
            assert!(
                command.get_arguments().all(|arg| {
                    arg.get_long() != Some(flag.name)
                        && arg.get_all_aliases().is_none_or(|aliases| !aliases.contains(&flag.name))
                }),
                "{} is implemented",
                flag.name
            );
        }
    }

    #[test]
    fn truly_unknown_flags_still_get_clap_s_error() {
        use clap::error::ErrorKind;
        let error = parse(&["--no-such-flag"]).unwrap_err();
        assert_eq!(error.kind(), ErrorKind::UnknownArgument);
    }
}
