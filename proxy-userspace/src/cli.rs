//! Command-line flags. Names, defaults and meaning follow kube-proxy's wherever kube-proxy has
//! the same notion, so that an operator can swap vipr in without relearning them; kube-proxy
//! flags that vipr knowingly does not implement are refused by name, with the reason (see
//! [`UNSUPPORTED_KUBE_PROXY_FLAGS`]). [`crate::config::Settings::resolve`] turns the flags,
//! over a `--config` file, into the settings the agent runs with.
use std::{path::PathBuf, time::Duration};

use clap::{error::ErrorKind, Arg, ArgAction, CommandFactory as _, FromArgMatches as _, Parser, ValueEnum};
use ipnet::IpNet;

use crate::config::{
    parse_go_duration, BindAddress, CidrPair, NodePortAddress, DEFAULT_HEALTHZ_BIND_ADDRESS,
    DEFAULT_METRICS_BIND_ADDRESS,
};

/// `--lb-algorithm`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum LbAlgorithm {
    #[default]
    Random,
    Maglev,
}

/// `--xdp`: where the XDP fast path for traffic from outside the node runs.
///
/// `Default` is `Off`, for the library's embedders (benchmarks and tests that start the
/// dataplane themselves): they opt in. The agent without `--xdp` runs `Auto`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum XdpMode {
    /// No `--xdp` given: native, on the devices backed by hardware whose driver supports it;
    /// none elsewhere, and no generic fallback. Not a value of the flag: it names no mode of
    /// its own, and leaving the flag out says it.
    #[value(skip)]
    Auto,
    /// On every served device, in the driver; falls back to generic, then off, where the
    /// driver refuses.
    Native,
    /// On every served device, in the kernel's generic (skb) XDP path.
    Generic,
    /// No XDP: the TC program does everything.
    #[default]
    Off,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ProxyMode {
    /// Pick the best dataplane the kernel supports.
    Auto,
    /// BPF maps and TC programs (vipr's own datapath).
    Ebpf,
    /// iptables rules, as kube-proxy's iptables mode.
    Iptables,
    /// IPVS virtual servers, as kube-proxy's ipvs mode.
    Ipvs,
}

/// Values that say so are kube-proxy's defaults; a flag left out keeps the `--config` file's
/// value, or else that default.
#[derive(Debug, Parser)]
#[command(name = "vipr", version, about = "eBPF Kubernetes service proxy, a drop-in kube-proxy replacement")]
pub struct Args {
    /// Which dataplane programs the services [default: auto].
    #[arg(long, value_enum)]
    pub proxy_mode: Option<ProxyMode>,

    /// A KubeProxyConfiguration file (kubeproxy.config.k8s.io/v1alpha1, YAML or JSON), as
    /// kube-proxy's; flags given on the command line override it.
    #[arg(long, value_name = "PATH")]
    pub config: Option<PathBuf>,

    /// Standalone mode: read v1 Services and discovery.k8s.io/v1 EndpointSlices from this
    /// file of manifests (multi-document YAML or JSON) instead of the API server, and re-read
    /// it whenever it changes.
    #[arg(long, value_name = "PATH")]
    pub services_file: Option<PathBuf>,

    /// The kubeconfig file to reach the API server with (without it and without
    /// --services-file: the in-cluster service account).
    #[arg(long, value_name = "PATH")]
    pub kubeconfig: Option<PathBuf>,

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

    /// The cgroup v2 directory whose processes' connections to services are balanced at the
    /// socket level (eBPF mode; descendants included) [default: the cgroup2 mount point].
    #[arg(long, value_name = "DIR")]
    pub cgroup_root: Option<PathBuf>,

    /// Capacity of the services map: entries are frontends × 3 source classes
    /// [default: 196608]. A pinned map keeps its size until `--cleanup`.
    #[arg(long, value_name = "ENTRIES")]
    pub bpf_services_max: Option<u32>,

    /// Capacity of the backends map: the slots of all distinct backend sets
    /// [default: 1048576].
    #[arg(long, value_name = "ENTRIES")]
    pub bpf_backends_max: Option<u32>,

    /// Capacity of the connection-tracking map, two entries per connection; the least
    /// recently used connections are forgotten first when it is full [default: 524288].
    #[arg(long, value_name = "ENTRIES")]
    pub bpf_flows_max: Option<u32>,

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
    /// interfaces whose packets carry full checksums (NICs): see docs/ARCHITECTURE.md, "XDP
    /// fast path" [default: native on the devices backed by hardware whose driver supports it,
    /// none on the others].
    #[arg(long, value_enum, value_name = "MODE")]
    pub xdp: Option<XdpMode>,

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

    /// Idle timeout of established TCP connections in the eBPF datapath's connection tracking
    /// [default: 24h0m0s].
    #[arg(long, value_name = "DURATION", value_parser = parse_go_duration)]
    pub conntrack_tcp_timeout_established: Option<Duration>,

    /// Idle timeout of TCP connections one side has closed (a FIN went one way: CLOSE_WAIT)
    /// [default: 1h0m0s].
    #[arg(long, value_name = "DURATION", value_parser = parse_go_duration)]
    pub conntrack_tcp_timeout_close_wait: Option<Duration>,

    /// Idle timeout of UDP flows that were never answered (0: the kernel's 30s)
    /// [default: 0s].
    #[arg(long, value_name = "DURATION", value_parser = parse_go_duration)]
    pub conntrack_udp_timeout: Option<Duration>,

    /// Idle timeout of UDP flows that were answered (0: the kernel's 120s) [default: 0s].
    #[arg(long, value_name = "DURATION", value_parser = parse_go_duration)]
    pub conntrack_udp_timeout_stream: Option<Duration>,

    /// Remove everything vipr installed (programs, links, pinned maps under --bpf-root) and
    /// exit.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", default_value = "false", action = ArgAction::Set)]
    pub cleanup: bool,

    /// The pods' CIDR (or a comma-separated IPv4,IPv6 pair): traffic from inside it is pod
    /// traffic, the rest is masqueraded toward cluster IPs.
    #[arg(long, alias = "cluster-cidrs", value_name = "CIDR[,CIDR]")]
    pub cluster_cidr: Option<CidrPair>,

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

    /// The minimum time between two syncs of the dataplane, however fast services change (a
    /// Go duration: 1s, 500ms, 1m30s) [default: 1s].
    #[arg(long, value_name = "DURATION", value_parser = parse_go_duration)]
    pub min_sync_period: Option<Duration>,

    /// The maximum time between two syncs of the dataplane, changes or not [default: 30s].
    #[arg(long, value_name = "DURATION", value_parser = parse_go_duration)]
    pub sync_period: Option<Duration>,

    /// The IPVS scheduler of every virtual service (--proxy-mode=ipvs): rr (round robin), wrr,
    /// lc, wlc, sh (source hashing), sed, nq [default: rr].
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

    /// More log output (-v: debug, -vv: trace). RUST_LOG overrides it.
    #[arg(short, action = ArgAction::Count)]
    pub verbose: u8,
}

/// A kube-proxy flag that vipr recognises and refuses, and why.
#[derive(Clone, Copy, Debug)]
pub struct UnsupportedFlag {
    pub name: &'static str,
    pub reason: &'static str,
}

const IPTABLES_IPVS_MODES: &str = "it tunes kube-proxy's iptables/ipvs modes, which vipr does not implement";
const SYNC_PERIODS: &str = "it is a deprecated per-mode period; use --sync-period / --min-sync-period";
const CONNTRACK: &str =
    "vipr does not tune the kernel's netfilter conntrack; its datapath tracks connections in its own BPF map";
const LOCAL_DETECTION: &str = "vipr tells pod traffic only by --cluster-cidr";
const API_CLIENT: &str =
    "vipr's API client is configured only by --kubeconfig (or the in-cluster service account)";
const NODE_IPS: &str = "vipr takes the node's addresses from its interfaces and its Node object";
const SERVERS: &str = "use --healthz-bind-address / --metrics-bind-address";
const LOGGING: &str = "vipr logs to stderr; use --v=N, -v, or RUST_LOG";

/// Every kube-proxy flag (Linux, v1.2x-v1.3x, including removed klog flags still found in
/// manifests) that vipr does not accept. Giving one is an error that names it: a flag that
/// was silently ignored would leave the operator believing it took effect.
pub const UNSUPPORTED_KUBE_PROXY_FLAGS: &[UnsupportedFlag] = &[
    UnsupportedFlag { name: "iptables-sync-period", reason: SYNC_PERIODS },
    UnsupportedFlag { name: "iptables-min-sync-period", reason: SYNC_PERIODS },
    UnsupportedFlag { name: "ipvs-sync-period", reason: SYNC_PERIODS },
    UnsupportedFlag { name: "ipvs-min-sync-period", reason: SYNC_PERIODS },
    UnsupportedFlag { name: "iptables-masquerade-bit", reason: IPTABLES_IPVS_MODES },
    UnsupportedFlag {
        name: "ipvs-masquerade-bit",
        reason: "vipr's ipvs mode marks packets to masquerade with kube-proxy's default bit (0x4000)",
    },
    UnsupportedFlag { name: "conntrack-max-per-core", reason: CONNTRACK },
    UnsupportedFlag { name: "conntrack-min", reason: CONNTRACK },
    UnsupportedFlag { name: "conntrack-tcp-be-liberal", reason: CONNTRACK },
    UnsupportedFlag { name: "detect-local-mode", reason: LOCAL_DETECTION },
    UnsupportedFlag { name: "pod-bridge-interface", reason: LOCAL_DETECTION },
    UnsupportedFlag { name: "pod-interface-name-prefix", reason: LOCAL_DETECTION },
    UnsupportedFlag { name: "master", reason: API_CLIENT },
    UnsupportedFlag { name: "kube-api-content-type", reason: API_CLIENT },
    UnsupportedFlag { name: "kube-api-qps", reason: API_CLIENT },
    UnsupportedFlag { name: "kube-api-burst", reason: API_CLIENT },
    UnsupportedFlag {
        name: "config-sync-period",
        reason: "vipr's watches do not resync periodically; --sync-period resyncs the dataplane",
    },
    UnsupportedFlag { name: "bind-address", reason: NODE_IPS },
    UnsupportedFlag { name: "node-ip-override", reason: NODE_IPS },
    UnsupportedFlag { name: "healthz-port", reason: SERVERS },
    UnsupportedFlag { name: "metrics-port", reason: SERVERS },
    UnsupportedFlag { name: "healthz-bind-addresses", reason: SERVERS },
    UnsupportedFlag { name: "healthz-bind-port", reason: SERVERS },
    UnsupportedFlag { name: "metrics-bind-addresses", reason: SERVERS },
    UnsupportedFlag { name: "metrics-bind-port", reason: SERVERS },
    UnsupportedFlag {
        name: "bind-address-hard-fail",
        reason: "vipr always retries a server address that is busy, as kube-proxy's default",
    },
    UnsupportedFlag { name: "profiling", reason: "vipr serves no /debug/pprof" },
    UnsupportedFlag { name: "show-hidden-metrics-for-version", reason: "vipr has no hidden metrics" },
    UnsupportedFlag { name: "feature-gates", reason: "vipr has no kube-proxy feature gates" },
    UnsupportedFlag {
        name: "oom-score-adj",
        reason: "set the OOM score adjustment in the pod spec (priority class, resources)",
    },
    UnsupportedFlag { name: "init-only", reason: "vipr has no separate privileged initialisation step" },
    UnsupportedFlag { name: "write-config-to", reason: "vipr does not write configuration files" },
    UnsupportedFlag { name: "proxy-port-range", reason: "it configured kube-proxy's removed userspace mode" },
    UnsupportedFlag { name: "udp-timeout", reason: "it configured kube-proxy's removed userspace mode" },
    UnsupportedFlag { name: "resource-container", reason: "it was removed from kube-proxy" },
    UnsupportedFlag { name: "vmodule", reason: LOGGING },
    UnsupportedFlag { name: "log-flush-frequency", reason: LOGGING },
    UnsupportedFlag { name: "logging-format", reason: LOGGING },
    UnsupportedFlag { name: "log-text-split-stream", reason: LOGGING },
    UnsupportedFlag { name: "log-text-info-buffer-size", reason: LOGGING },
    UnsupportedFlag { name: "log-json-split-stream", reason: LOGGING },
    UnsupportedFlag { name: "log-json-info-buffer-size", reason: LOGGING },
    UnsupportedFlag { name: "add-dir-header", reason: LOGGING },
    UnsupportedFlag { name: "alsologtostderr", reason: LOGGING },
    UnsupportedFlag { name: "log-backtrace-at", reason: LOGGING },
    UnsupportedFlag { name: "log-dir", reason: LOGGING },
    UnsupportedFlag { name: "log-file", reason: LOGGING },
    UnsupportedFlag { name: "log-file-max-size", reason: LOGGING },
    UnsupportedFlag { name: "logtostderr", reason: LOGGING },
    UnsupportedFlag { name: "one-output", reason: LOGGING },
    UnsupportedFlag { name: "skip-headers", reason: LOGGING },
    UnsupportedFlag { name: "skip-log-headers", reason: LOGGING },
    UnsupportedFlag { name: "stderrthreshold", reason: LOGGING },
];

impl Args {
    /// Parses the command line, exiting with a usage error as clap does.
    pub fn parse_kube_proxy_style() -> Self {
        Self::try_parse_kube_proxy_style(std::env::args_os()).unwrap_or_else(|error| error.exit())
    }

    /// Parses `argv` (program name first) as kube-proxy would: klog's `-v=N` / `-v N` mean
    /// `--v=N`, and kube-proxy flags vipr does not support are refused by name.
    pub fn try_parse_kube_proxy_style<I, T>(argv: I) -> Result<Self, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString>,
    {
        let mut command = Self::command().args(UNSUPPORTED_KUBE_PROXY_FLAGS.iter().map(|flag| {
            // Hidden, and taking an optional value, so that `--flag`, `--flag=x` and
            // `--flag x` all parse and can be reported by name.
            Arg::new(flag.name).long(flag.name).hide(true).num_args(0..=1).action(ArgAction::Append)
        }));
        let matches = command.try_get_matches_from_mut(klog_verbosity_as_long_flag(argv))?;
        let refused: Vec<String> = UNSUPPORTED_KUBE_PROXY_FLAGS
            .iter()
            .filter(|flag| matches.contains_id(flag.name))
            .map(|flag| format!("--{}: {}", flag.name, flag.reason))
            .collect();
        if !refused.is_empty() {
            return Err(command.error(
                ErrorKind::UnknownArgument,
                format!("vipr does not support these kube-proxy flags:\n  {}", refused.join("\n  ")),
            ));
        }
        Self::from_arg_matches(&matches).map_err(|error| error.format(&mut command))
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
        let error = parse(&["--ipvs-scheduler=mh"]).unwrap_err().to_string();
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

    #[test]
    fn unsupported_kube_proxy_flags_are_refused_by_name() {
        for argv in [
            &["--iptables-sync-period=30s"][..],
            &["--conntrack-max-per-core", "0"],
            &["--bind-address-hard-fail"],
            &["--feature-gates=A=true,B=false"],
            &["--detect-local-mode=ClusterCIDR"],
            &["--proxy-port-range=30000-32767"],
            &["--oom-score-adj=-999"],
        ] {
            let error = parse(argv).unwrap_err();
            assert_eq!(error.kind(), ErrorKind::UnknownArgument);
            let message = error.to_string();
            let flag = argv[0].split('=').next().unwrap();
            assert!(message.contains(&format!("{flag}:")), "{message}");
            assert!(message.contains("vipr does not support"), "{message}");
            assert!(!message.contains("unexpected argument"), "{message}");
        }
        let message = parse(&["--conntrack-min=1", "--ipvs-masquerade-bit", "14"]).unwrap_err().to_string();
        assert!(
            message.contains("--conntrack-min") && message.contains("--ipvs-masquerade-bit"),
            "{message}"
        );
    }

    #[test]
    fn unsupported_flags_are_unique_and_none_is_a_supported_one() {
        let command = Args::command();
        let mut names = std::collections::BTreeSet::new();
        for flag in UNSUPPORTED_KUBE_PROXY_FLAGS {
            assert!(names.insert(flag.name), "{} listed twice", flag.name);
            assert!(
                command.get_arguments().all(|arg| {
                    arg.get_long() != Some(flag.name)
                        && arg.get_all_aliases().is_none_or(|aliases| !aliases.contains(&flag.name))
                }),
                "{} is supported",
                flag.name
            );
        }
    }

    #[test]
    fn truly_unknown_flags_still_get_clap_s_error() {
        let error = parse(&["--no-such-flag"]).unwrap_err();
        assert_eq!(error.kind(), ErrorKind::UnknownArgument);
    }
}
