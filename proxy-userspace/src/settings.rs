//! vipr's resolved settings: kube-proxy's defaults, then a KubeProxyConfiguration file
//! (`--config`, read by [`crate::config::file`]), then the command line ([`crate::cli`]).
//!
//! The file is kube-proxy's own `kubeproxy.config.k8s.io/v1alpha1` KubeProxyConfiguration
//! (YAML or JSON), so the ConfigMap a cluster already has for kube-proxy can be reused. It is
//! defaulted as kube-proxy's v1alpha1 defaulting does: kubeadm writes every field, most of them
//! zero (`syncPeriod: 0s`, `healthzBindAddress: ""`, `conntrack.maxPerCore: null`), and a zero
//! or null means kube-proxy's default, never "off". vipr reads the settings that apply to it and
//! names the others it was given (non-zero values) in the start-up log line, instead of failing.
//!
//! Precedence differs from kube-proxy on one point, deliberately: kube-proxy ignores most
//! flags when `--config` is given (only `--hostname-override` and the logging flags win over
//! the file); vipr lets every flag given on the command line override the file, so nothing an
//! operator typed is silently dropped.
//!
//! Layers: `cli` and `config` know nothing of this module; it turns both into [`Settings`],
//! and the dataplanes' options out of those ([`Settings::start_options`]).
use std::{
    net::{IpAddr, Ipv4Addr, SocketAddr},
    path::PathBuf,
    time::Duration,
};

use anyhow::bail;
use clap::ValueEnum as _;
use ipnet::{IpNet, Ipv4Net};

use crate::cli::Args;
use crate::config::{file::ModeSection, *};
use crate::dataplane::{
    ebpf::{
        maglev, pod_sockets::PodSocketOptions, Balancing, BpfForwarding, BpfMapSizes, ConntrackTimeouts,
        EbpfOptions, FlowPressure, HostTrafficOptions, LbMode, XdpMode,
    },
    iptables::IptablesOptions,
    ipvs::{self, IpvsOptions},
    nftables::NftablesOptions,
    Cleanup, Mode, StartOptions,
};

/// Where Services and EndpointSlices come from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SourceSettings {
    /// Standalone: a manifests file (`--services-file`).
    File(PathBuf),
    /// The API server, through `kubeconfig` or, when `None`, the in-cluster service account.
    Kubernetes { kubeconfig: Option<PathBuf> },
}

/// Everything the agent needs, resolved and validated.
#[derive(Clone, Debug, PartialEq)]
pub struct Settings {
    /// `--config`: the KubeProxyConfiguration file these settings were read from, which the
    /// agent watches (a changed file means a restart, as for kube-proxy).
    pub config_file: Option<PathBuf>,
    pub proxy_mode: ProxyMode,
    pub source: SourceSettings,
    /// This node's name: lower-cased `--hostname-override` / `--node-name`, else the host
    /// name.
    pub node_name: String,
    /// Interfaces to serve; empty means every interface but loopback.
    pub devices: Vec<String>,
    pub bpf_root: PathBuf,
    /// `--state-dir`: where the last programmed state is recorded for `vipr inspect drift`.
    pub state_dir: PathBuf,
    /// `--cgroup-root`; `None`: the cgroup2 mount point.
    pub cgroup_root: Option<PathBuf>,
    /// `--bpf-socket-lb-pods`, `--pods-cgroup`.
    pub pod_sockets: PodSocketOptions,
    pub bpf_map_sizes: BpfMapSizes,
    /// `--conntrack-*` timeouts: when the eBPF datapath's flow entries expire.
    pub conntrack: ConntrackTimeouts,
    /// `--lb-algorithm` and `--maglev-table-size`: how the eBPF datapath picks backends.
    pub balancing: Balancing,
    /// `--xdp`: the eBPF datapath's XDP fast path; `Auto` without the flag (the
    /// KubeProxyConfiguration has no such setting).
    pub xdp: XdpMode,
    /// `--bpf-forwarding`: through the stack (netfilter filters it), or redirected past it.
    pub bpf_forwarding: BpfForwarding,
    /// `--lb-mode`: source NAT or direct server return toward backends on other nodes.
    pub lb_mode: LbMode,
    /// `--lb-dsr-accept`: whether carried DSR service addresses are taken; `None`: as
    /// `lb_mode` sends.
    pub lb_dsr_accept: Option<bool>,
    pub cleanup: bool,
    /// `--cleanup-keep-kube-proxy`: `--cleanup` leaves kube-proxy's chains and IPVS state.
    pub cleanup_keep_kube_proxy: bool,
    /// `/healthz` and `/livez`; `None` disables the server (an empty address, as kube-proxy).
    pub healthz_bind_address: Option<SocketAddr>,
    /// `/metrics` and `/proxyMode`; `None` disables the server.
    pub metrics_bind_address: Option<SocketAddr>,
    /// `--metrics-per-endpoint`: whether `/metrics` has the `vipr_backend_*` series.
    pub metrics_per_endpoint: bool,
    /// Syncs happen at most this often, however fast objects change (the requested mode's;
    /// see [`Settings::min_sync_period_in`] for the running mode's).
    pub min_sync_period: Duration,
    /// No flag or file field gave the minimum sync period: it is the running mode's default,
    /// which `--proxy-mode=auto` only knows once it chose.
    pub min_sync_period_defaulted: bool,
    /// Syncs happen at least this often, even without changes; a change not synced within
    /// twice this period makes `/healthz` unhealthy.
    pub sync_period: Duration,
    /// `--cluster-cidr`: the pods' ranges (one, or a dual-stack pair), which tell pod traffic
    /// from other traffic for masquerading. Carried to the model's `NodeContext`.
    pub cluster_cidrs: Vec<IpNet>,
    /// `--service-cluster-ip-range`: addresses inside that are no cluster IP are dropped;
    /// used while the cluster has no ServiceCIDR objects.
    pub service_cidrs: Vec<IpNet>,
    /// `--service-proxy-name`: serve only the Services labelled with this proxy name.
    pub service_proxy_name: Option<String>,
    /// `--masquerade-all`: SNAT all traffic to cluster IPs. Carried to the model's
    /// `NodeContext`.
    pub masquerade_all: bool,
    /// `--nodeport-addresses`: the node addresses NodePorts and health-check node ports are
    /// served on; empty means the node's primary addresses (kube-proxy's nftables default).
    pub node_port_addresses: Vec<NodePortAddress>,
    pub log_level: LogLevel,
    /// kube-proxy's IPVS settings (`--ipvs-*`, the file's `ipvs` section), for
    /// `--proxy-mode=ipvs`.
    pub ipvs: IpvsSettings,
    /// `--iptables-localhost-nodeports` (`iptables.localhostNodePorts`): IPv4 NodePorts on
    /// 127.0.0.1 too, in iptables mode only (default true, as kube-proxy).
    pub iptables_localhost_node_ports: bool,
    /// `--bind-address` (`bindAddress`): this node's primary IP of its family, overriding the
    /// Node object's; `None` for the unspecified address (kube-proxy's default, 0.0.0.0).
    pub bind_address: Option<IpAddr>,
    /// `--detect-local-mode`: which sources are this cluster's pods.
    pub local_detection: LocalDetection,
    /// `--oom-score-adj` (`oomScoreAdj`), written to /proc/self/oom_score_adj at start.
    pub oom_score_adj: i32,
    /// The node's netfilter conntrack sysctls, set in iptables and ipvs modes as kube-proxy
    /// sets them.
    pub netfilter_conntrack: NetfilterConntrack,
    /// `--feature-gates` (`featureGates`).
    pub feature_gates: FeatureGates,
    /// How the API server is reached, beyond the kubeconfig.
    pub api_client: ApiClientSettings,
    /// `--logging-format` (`logging.format`).
    pub logging_format: LoggingFormat,
    /// `--init-only`: do the privileged one-time initialisation and exit.
    pub init_only: bool,
    /// `--write-config-to`: write the effective configuration there and exit.
    pub write_config_to: Option<PathBuf>,
    /// Settings of the `--config` file that vipr does not use, as dotted paths, for the
    /// agent to name once logging is up.
    pub ignored_config: Vec<String>,
    /// kube-proxy flags given that mean nothing to vipr, as `--name (reason)`.
    pub ignored_flags: Vec<String>,
}

/// `--detect-local-mode`, resolved: where the local-traffic detector's CIDRs come from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LocalDetection {
    /// `ClusterCIDR`: [`Settings::cluster_cidrs`] (none: no detector, as kube-proxy).
    ClusterCidr,
    /// `NodeCIDR`: the Node object's `spec.podCIDRs`, followed as the Node changes.
    NodeCidr,
    /// `BridgeInterface`: traffic that enters through this bridge (`--pod-bridge-interface`).
    BridgeInterface(String),
    /// `InterfaceNamePrefix`: traffic that enters through an interface whose name starts with
    /// this (`--pod-interface-name-prefix`).
    InterfaceNamePrefix(String),
}

/// The node's netfilter conntrack settings (`--conntrack-*`, the file's `conntrack`), as
/// kube-proxy's iptables and ipvs modes apply them to the kernel. Zero leaves a value as the
/// kernel has it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NetfilterConntrack {
    pub max_per_core: u32,
    pub min: u32,
    pub tcp_be_liberal: bool,
    pub tcp_established_timeout: Duration,
    pub tcp_close_wait_timeout: Duration,
    pub udp_timeout: Duration,
    pub udp_stream_timeout: Duration,
}

impl Default for NetfilterConntrack {
    fn default() -> Self {
        Self {
            max_per_core: 32 * 1024,
            min: 128 * 1024,
            tcp_be_liberal: false,
            tcp_established_timeout: Duration::from_secs(24 * 3600),
            tcp_close_wait_timeout: Duration::from_secs(3600),
            udp_timeout: Duration::ZERO,
            udp_stream_timeout: Duration::ZERO,
        }
    }
}

/// The API client's settings besides the kubeconfig.
#[derive(Clone, Debug, PartialEq)]
pub struct ApiClientSettings {
    /// `--master`: the API server URL, overriding the kubeconfig's.
    pub master: Option<String>,
    /// `--kube-api-qps`, `--kube-api-burst`, `--kube-api-content-type`: accepted and
    /// reported; vipr's client (kube-rs) has no rate limiter and speaks JSON only.
    pub qps: f32,
    pub burst: i32,
    pub content_type: String,
}

impl Default for ApiClientSettings {
    fn default() -> Self {
        Self {
            master: None,
            qps: DEFAULT_API_QPS,
            burst: DEFAULT_API_BURST,
            content_type: DEFAULT_API_CONTENT_TYPE.to_owned(),
        }
    }
}

impl Settings {
    /// Resolves `args` over the `--config` file, if any, over kube-proxy's defaults.
    pub fn resolve(args: &Args) -> anyhow::Result<Self> {
        let file = match &args.config {
            Some(path) => KubeProxyConfiguration::load(path)?,
            None => KubeProxyConfiguration::default(),
        };
        let proxy_mode = match args.proxy_mode {
            Some(mode) => mode,
            None if args.config.is_some() => file.proxy_mode()?,
            // No file and no flag: vipr's own default.
            None => ProxyMode::Auto,
        };
        let mode_section = file.mode_section(proxy_mode);

        let source = match &args.services_file {
            Some(path) => SourceSettings::File(path.clone()),
            None => SourceSettings::Kubernetes {
                kubeconfig: args.kubeconfig.clone().or_else(|| {
                    file.client_connection
                        .kubeconfig
                        .clone()
                        .filter(|path| !path.is_empty())
                        .map(PathBuf::from)
                }),
            },
        };
        let node_name = match args
            .node_name
            .as_deref()
            .or(file.hostname_override.as_deref().filter(|name| !name.is_empty()))
        {
            Some(name) => {
                let name = name.trim().to_lowercase();
                if name.is_empty() {
                    bail!("--hostname-override: an empty node name is invalid");
                }
                name
            }
            None => host_name(),
        };

        // bindAddress: "" is 0.0.0.0; its family picks the servers' default addresses.
        let bind_ip = match (args.bind_address, file.bind_address.as_deref().map(str::trim)) {
            (Some(ip), _) => ip,
            (None, Some(text)) if !text.is_empty() => text
                .parse::<IpAddr>()
                .map_err(|_| file.invalid("bindAddress", format!("{text:?} is not an IP address")))?,
            (None, _) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        };
        let (default_healthz, default_metrics) = if bind_ip.is_ipv6() {
            (DEFAULT_HEALTHZ_BIND_ADDRESS_V6, DEFAULT_METRICS_BIND_ADDRESS_V6)
        } else {
            (DEFAULT_HEALTHZ_BIND_ADDRESS, DEFAULT_METRICS_BIND_ADDRESS)
        };
        // A flag's empty address disables the server; the file's means the default.
        let bind_address = |flag: Option<BindAddress>,
                            in_file: &Option<String>,
                            default: SocketAddr,
                            field| match (flag, in_file.as_deref().map(str::trim))
        {
            (Some(address), _) => Ok(address.0),
            (None, Some(text)) if !text.is_empty() => {
                parse_bind_address(text, default.port()).map_err(|error| file.invalid(field, error))
            }
            (None, _) => Ok(Some(default)),
        };
        let mut healthz_bind_address = bind_address(
            args.healthz_bind_address,
            &file.healthz_bind_address,
            default_healthz,
            "healthzBindAddress",
        )?;
        let mut metrics_bind_address = bind_address(
            args.metrics_bind_address,
            &file.metrics_bind_address,
            default_metrics,
            "metricsBindAddress",
        )?;
        let mut ignored_flags: Vec<String> =
            args.ignored_flags.iter().map(|flag| format!("--{} ({})", flag.name, flag.reason)).collect();
        // The deprecated port flags, as kube-proxy applies them: only without --config, 0
        // disables the server, and any other port is dropped since the address has one.
        for (flag, port, address) in [
            ("healthz-port", args.healthz_port, &mut healthz_bind_address),
            ("metrics-port", args.metrics_port, &mut metrics_bind_address),
        ] {
            match port {
                Some(0) if args.config.is_none() => *address = None,
                Some(_) => ignored_flags.push(format!(
                    "--{flag} (deprecated; only 0 has an effect, and only without --config, as in kube-proxy)"
                )),
                None => {}
            }
        }

        let (sync_period, min_sync_period, min_sync_period_defaulted) =
            sync_periods(args, &file, proxy_mode, &mode_section)?;

        let cluster_cidrs = match &args.cluster_cidr {
            Some(cidrs) => cidrs.0.clone(),
            None => match file.cluster_cidr.as_deref().filter(|text| !text.trim().is_empty()) {
                Some(text) => text.parse::<CidrPair>().map_err(|error| file.invalid("clusterCIDR", error))?.0,
                None => Vec::new(),
            },
        };
        let local_detection = local_detection(args, &file)?;
        let service_cidrs =
            args.service_cluster_ip_range.as_ref().map(|cidrs| cidrs.0.clone()).unwrap_or_default();
        let service_proxy_name = service_proxy_name(args.service_proxy_name.as_deref())?;
        let masquerade_all = args.masquerade_all.or(mode_section.masquerade_all).unwrap_or(false);
        let node_port_addresses = match &args.nodeport_addresses {
            Some(addresses) => addresses.clone(),
            None => file
                .node_port_addresses
                .iter()
                .flatten()
                .map(|text| text.parse())
                .collect::<Result<_, _>>()
                .map_err(|error| file.invalid("nodePortAddresses", error))?,
        };

        let flag_level = [
            (args.verbose > 0).then(|| LogLevel::from_verbose_count(args.verbose)),
            args.klog_verbosity.map(LogLevel::from_klog_verbosity),
        ]
        .into_iter()
        .flatten()
        .max();
        let log_level = flag_level
            .or_else(|| file.logging.verbosity.map(LogLevel::from_klog_verbosity))
            .unwrap_or(LogLevel::Info);
        let logging_format = match args.logging_format {
            Some(format) => format,
            None => match file.logging.format.as_deref().map(str::trim) {
                None | Some("" | "text") => LoggingFormat::Text,
                Some("json") => LoggingFormat::Json,
                Some(other) => {
                    return Err(file.invalid("logging.format", format!("{other:?} is neither text nor json")))
                }
            },
        };

        let oom_score_adj = args.oom_score_adj.or(file.oom_score_adj).unwrap_or(DEFAULT_OOM_SCORE_ADJ);
        if !(-1000..=1000).contains(&oom_score_adj) {
            bail!("--oom-score-adj={oom_score_adj}: must be within -1000 and 1000");
        }

        let mut feature_gates = FeatureGates(file.feature_gates.clone().unwrap_or_default());
        if let Some(flag) = &args.feature_gates {
            feature_gates.0.extend(flag.0.iter().map(|(name, enabled)| (name.clone(), *enabled)));
        }
        ignored_flags.extend(feature_gates.ignored().map(|(name, enabled)| {
            format!("--feature-gates={name}={enabled} (no vipr behaviour depends on this gate)")
        }));

        let api_client = ApiClientSettings {
            master: args.master.clone().filter(|url| !url.trim().is_empty()),
            qps: args.kube_api_qps.unwrap_or(DEFAULT_API_QPS),
            burst: args.kube_api_burst.unwrap_or(DEFAULT_API_BURST),
            content_type: args
                .kube_api_content_type
                .clone()
                .unwrap_or_else(|| DEFAULT_API_CONTENT_TYPE.to_owned()),
        };
        for (flag, given) in [
            ("kube-api-qps", args.kube_api_qps.is_some()),
            ("kube-api-burst", args.kube_api_burst.is_some()),
            ("kube-api-content-type", args.kube_api_content_type.is_some()),
        ] {
            if given {
                ignored_flags.push(format!(
                    "--{flag} (vipr's API client only lists and watches, with no client-side rate limit, in JSON)"
                ));
            }
        }

        let ipvs = IpvsSettings::resolve(args, &file)?;
        let iptables_localhost_node_ports =
            args.iptables_localhost_nodeports.or(file.iptables.localhost_node_ports).unwrap_or(true);

        Ok(Self {
            config_file: args.config.clone(),
            proxy_mode,
            source,
            node_name,
            devices: args.devices.iter().map(|d| d.trim().to_owned()).filter(|d| !d.is_empty()).collect(),
            bpf_root: args.bpf_root.clone(),
            state_dir: args.state_dir.clone(),
            cgroup_root: args.cgroup_root.clone(),
            pod_sockets: PodSocketOptions {
                enabled: args.bpf_socket_lb_pods,
                cgroup: args.pods_cgroup.clone(),
            },
            bpf_map_sizes: BpfMapSizes::resolve(args)?,
            conntrack: ConntrackTimeouts::resolve(args, &file)?,
            balancing: balancing(args)?,
            xdp: args.xdp.unwrap_or(XdpMode::Auto),
            bpf_forwarding: args.bpf_forwarding,
            lb_mode: args.lb_mode,
            lb_dsr_accept: args.lb_dsr_accept,
            cleanup: args.cleanup,
            cleanup_keep_kube_proxy: args.cleanup_keep_kube_proxy,
            healthz_bind_address,
            metrics_bind_address,
            metrics_per_endpoint: args.metrics_per_endpoint.unwrap_or(true),
            min_sync_period,
            min_sync_period_defaulted,
            sync_period,
            cluster_cidrs,
            service_cidrs,
            service_proxy_name,
            masquerade_all,
            node_port_addresses,
            log_level,
            ipvs,
            iptables_localhost_node_ports,
            bind_address: (!bind_ip.is_unspecified()).then_some(bind_ip),
            local_detection,
            oom_score_adj,
            netfilter_conntrack: NetfilterConntrack::resolve(args, &file)?,
            feature_gates,
            api_client,
            logging_format,
            init_only: args.init_only,
            write_config_to: args.write_config_to.clone(),
            ignored_config: file.ignored,
            ignored_flags,
        })
    }
}

/// The sync periods of the mode that runs, as kube-proxy picks them: vipr's own
/// `--sync-period` / `--min-sync-period` first, then kube-proxy's per-mode flags (the
/// `--iptables-*` ones in every mode but ipvs, as kube-proxy), then the file's section of the
/// mode, where zero means the default. Also whether the minimum period is a default.
fn sync_periods(
    args: &Args,
    file: &KubeProxyConfiguration,
    mode: ProxyMode,
    section: &ModeSection<'_>,
) -> anyhow::Result<(Duration, Duration, bool)> {
    let (mode_sync, mode_min, default_min) = match mode {
        ProxyMode::Ipvs => (
            ("ipvs-sync-period", args.ipvs_sync_period),
            ("ipvs-min-sync-period", args.ipvs_min_sync_period),
            Duration::ZERO,
        ),
        _ => (
            ("iptables-sync-period", args.iptables_sync_period),
            ("iptables-min-sync-period", args.iptables_min_sync_period),
            if mode == ProxyMode::Ebpf { EBPF_DEFAULT_MIN_SYNC_PERIOD } else { DEFAULT_MIN_SYNC_PERIOD },
        ),
    };
    let file_duration = |field: &str, value: &Option<String>| -> anyhow::Result<Option<Duration>> {
        let parsed = value
            .as_deref()
            .map(|text| parse_go_duration(text).map_err(|error| file.invalid(field, error)))
            .transpose()?;
        // kube-proxy's v1alpha1 defaulting: a zero period is the default.
        Ok(parsed.filter(|period| !period.is_zero()))
    };
    let pick = |vipr_flag: (&'static str, Option<Duration>),
                mode_flag: (&'static str, Option<Duration>),
                field: &str,
                in_file: &Option<String>,
                default: Duration|
     -> anyhow::Result<(String, Duration)> {
        Ok(match (vipr_flag, mode_flag) {
            ((flag, Some(period)), _) | (_, (flag, Some(period))) => (format!("--{flag}"), period),
            _ => {
                let field = format!("{}.{field}", section.name);
                match file_duration(&field, in_file)? {
                    Some(period) => (field, period),
                    None => ("the default".to_owned(), default),
                }
            }
        })
    };
    let (sync_from, sync) = pick(
        ("sync-period", args.sync_period),
        mode_sync,
        "syncPeriod",
        section.sync_period,
        DEFAULT_SYNC_PERIOD,
    )?;
    let (min_from, min) = pick(
        ("min-sync-period", args.min_sync_period),
        mode_min,
        "minSyncPeriod",
        section.min_sync_period,
        default_min,
    )?;
    if sync.is_zero() {
        bail!("{sync_from}: the sync period must be greater than 0");
    }
    let defaulted = min_from == "the default";
    // A default never stands in the way of a short sync period given.
    let min = if defaulted { min.min(sync) } else { min };
    if min > sync {
        bail!(
            "{min_from}: the minimum sync period ({}) must not be greater than the sync period ({}, {sync_from})",
            format_go_duration(min),
            format_go_duration(sync)
        );
    }
    Ok((sync, min, defaulted))
}

/// `--detect-local-mode` over the file's `detectLocalMode`; "" is kube-proxy's default,
/// ClusterCIDR. The interface modes need their interface (`--pod-bridge-interface`,
/// `--pod-interface-name-prefix`, or the file's `detectLocal`), as kube-proxy refuses them
/// without.
fn local_detection(args: &Args, file: &KubeProxyConfiguration) -> anyhow::Result<LocalDetection> {
    let mode = match args.detect_local_mode {
        Some(mode) => mode,
        None => match file.detect_local_mode.as_deref().map(str::trim) {
            None | Some("") => DetectLocalMode::ClusterCidr,
            Some(name) => DetectLocalMode::from_str(name, false).map_err(|_| {
                file.invalid(
                    "detectLocalMode",
                    format!(
                        "{name:?} is not one of ClusterCIDR, NodeCIDR, BridgeInterface, InterfaceNamePrefix"
                    ),
                )
            })?,
        },
    };
    let bridge = args.pod_bridge_interface.clone().or_else(|| file.detect_local.bridge_interface.clone());
    let prefix =
        args.pod_interface_name_prefix.clone().or_else(|| file.detect_local.interface_name_prefix.clone());
    let interface = |name: &str, what: &str, value: Option<String>| {
        let value = value.map(|value| value.trim().to_owned()).filter(|value| !value.is_empty());
        let value = value.ok_or_else(|| anyhow::anyhow!("--detect-local-mode={name} needs {what}"))?;
        // An interface name: at most IFNAMSIZ - 1 bytes, no '/', ':' or white space (what the
        // kernel accepts), and no '+', which iptables would read as a wildcard.
        let valid = value.len() < 16
            && value.chars().all(|c| c.is_ascii_graphic() && !matches!(c, '/' | ':' | '+' | '!'));
        if !valid {
            bail!("{what}: {value:?} is not an interface name");
        }
        Ok(value)
    };
    match mode {
        DetectLocalMode::ClusterCidr => Ok(LocalDetection::ClusterCidr),
        DetectLocalMode::NodeCidr => Ok(LocalDetection::NodeCidr),
        DetectLocalMode::BridgeInterface => Ok(LocalDetection::BridgeInterface(interface(
            "BridgeInterface",
            "--pod-bridge-interface (detectLocal.bridgeInterface)",
            bridge,
        )?)),
        DetectLocalMode::InterfaceNamePrefix => Ok(LocalDetection::InterfaceNamePrefix(interface(
            "InterfaceNamePrefix",
            "--pod-interface-name-prefix (detectLocal.interfaceNamePrefix)",
            prefix,
        )?)),
    }
}

/// `--service-proxy-name`: a label value, since it goes into a label selector (one the API
/// server would refuse would leave vipr without any Service); empty means none.
fn service_proxy_name(name: Option<&str>) -> anyhow::Result<Option<String>> {
    let Some(name) = name.map(str::trim).filter(|name| !name.is_empty()) else { return Ok(None) };
    let alphanumeric_ends = name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && name.ends_with(|c: char| c.is_ascii_alphanumeric());
    let allowed = name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if name.len() > 63 || !alphanumeric_ends || !allowed {
        bail!(
            "--service-proxy-name={name:?}: not a label value (at most 63 letters, digits, '-', '_' \
             or '.', beginning and ending with a letter or digit)"
        );
    }
    Ok(Some(name.to_owned()))
}

fn balancing(args: &Args) -> anyhow::Result<Balancing> {
    let table_size = args.maglev_table_size.unwrap_or(maglev::DEFAULT_TABLE_SIZE);
    if !maglev::TABLE_SIZES.contains(&table_size) {
        bail!(
            "--maglev-table-size={table_size}: must be one of the primes {}",
            maglev::TABLE_SIZES.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
        );
    }
    Ok(match args.lb_algorithm {
        LbAlgorithm::Random if args.maglev_table_size.is_some() => {
            bail!("--maglev-table-size needs --lb-algorithm=maglev")
        }
        LbAlgorithm::Random => Balancing::Random,
        LbAlgorithm::Maglev => Balancing::Maglev { table_size },
    })
}

impl BpfMapSizes {
    fn resolve(args: &Args) -> anyhow::Result<Self> {
        let defaults = Self::default();
        let size = |flag: &str, value: Option<u32>, default: u32| match value {
            Some(0) => bail!("--{flag} must be greater than 0"),
            Some(value) => Ok(value),
            None => Ok(default),
        };
        Ok(Self {
            services: size("bpf-services-max", args.bpf_services_max, defaults.services)?,
            backends: size("bpf-backends-max", args.bpf_backends_max, defaults.backends)?,
            flows: size("bpf-flows-max", args.bpf_flows_max, defaults.flows)?,
            counters: size("bpf-counters-max", args.bpf_counters_max, defaults.counters)?,
            affinity: size("bpf-affinity-max", args.bpf_affinity_max, defaults.affinity)?,
            source_ranges: size("bpf-source-ranges-max", args.bpf_source_ranges_max, defaults.source_ranges)?,
            unmatched: size("bpf-unmatched-max", args.bpf_unmatched_max, defaults.unmatched)?,
        })
    }
}

impl ConntrackTimeouts {
    fn resolve(args: &Args, file: &KubeProxyConfiguration) -> anyhow::Result<Self> {
        let defaults = Self::default();
        let section = &file.conntrack;
        // Zero keeps the default, as kube-proxy's 0 leaves the kernel's value.
        let timeout = |flag: Option<Duration>, field: &str, value: &Option<String>, default: Duration| {
            let chosen = match (flag, value.as_deref()) {
                (Some(timeout), _) => timeout,
                (None, Some(text)) => parse_go_duration(text).map_err(|error| file.invalid(field, error))?,
                (None, None) => Duration::ZERO,
            };
            anyhow::Ok(if chosen.is_zero() { default } else { chosen })
        };
        Ok(Self {
            tcp_established: timeout(
                args.conntrack_tcp_timeout_established,
                "conntrack.tcpEstablishedTimeout",
                &section.tcp_established_timeout,
                defaults.tcp_established,
            )?,
            tcp_close_wait: timeout(
                args.conntrack_tcp_timeout_close_wait,
                "conntrack.tcpCloseWaitTimeout",
                &section.tcp_close_wait_timeout,
                defaults.tcp_close_wait,
            )?,
            tcp_closed: defaults.tcp_closed,
            tcp_syn_sent: args
                .conntrack_tcp_timeout_syn_sent
                .filter(|t| !t.is_zero())
                .unwrap_or(defaults.tcp_syn_sent),
            tcp_syn_recv: args
                .conntrack_tcp_timeout_syn_recv
                .filter(|t| !t.is_zero())
                .unwrap_or(defaults.tcp_syn_recv),
            udp: timeout(
                args.conntrack_udp_timeout,
                "conntrack.udpTimeout",
                &section.udp_timeout,
                defaults.udp,
            )?,
            udp_stream: timeout(
                args.conntrack_udp_timeout_stream,
                "conntrack.udpStreamTimeout",
                &section.udp_stream_timeout,
                defaults.udp_stream,
            )?,
            pressure: FlowPressure {
                threshold_percent: match args.conntrack_pressure_threshold {
                    None => defaults.pressure.threshold_percent,
                    Some(percent @ 1..=100) => percent,
                    Some(_) => bail!("--conntrack-pressure-threshold must be a percentage from 1 to 100"),
                },
                timeout: match args.conntrack_pressure_timeout {
                    None => defaults.pressure.timeout,
                    Some(timeout) if timeout.is_zero() => {
                        bail!("--conntrack-pressure-timeout must be greater than 0")
                    }
                    Some(timeout) => timeout,
                },
            },
        })
    }
}

impl NetfilterConntrack {
    /// Flags over the file's `conntrack` section over kube-proxy's v1alpha1 defaults: a null
    /// `maxPerCore`, `min`, `tcpEstablishedTimeout` or `tcpCloseWaitTimeout` is the default,
    /// an explicit 0 leaves the kernel's value.
    fn resolve(args: &Args, file: &KubeProxyConfiguration) -> anyhow::Result<Self> {
        let defaults = Self::default();
        let section = &file.conntrack;
        let count =
            |flag: &str, value: Option<i32>, field: &str, in_file: Option<i32>, default: u32| match value
                .map(|value| (format!("--{flag}"), value))
                .or(in_file.map(|value| (field.to_owned(), value)))
            {
                Some((name, value)) => {
                    u32::try_from(value).map_err(|_| anyhow::anyhow!("{name}={value}: must be 0 or more"))
                }
                None => Ok(default),
            };
        let timeout = |flag: Option<Duration>, field: &str, value: &Option<String>, default: Duration| {
            Ok::<_, anyhow::Error>(match (flag, value.as_deref()) {
                (Some(timeout), _) => timeout,
                (None, Some(text)) => parse_go_duration(text).map_err(|error| file.invalid(field, error))?,
                (None, None) => default,
            })
        };
        Ok(Self {
            max_per_core: count(
                "conntrack-max-per-core",
                args.conntrack_max_per_core,
                "conntrack.maxPerCore",
                section.max_per_core,
                defaults.max_per_core,
            )?,
            min: count("conntrack-min", args.conntrack_min, "conntrack.min", section.min, defaults.min)?,
            tcp_be_liberal: args.conntrack_tcp_be_liberal.or(section.tcp_be_liberal).unwrap_or(false),
            tcp_established_timeout: timeout(
                args.conntrack_tcp_timeout_established,
                "conntrack.tcpEstablishedTimeout",
                &section.tcp_established_timeout,
                defaults.tcp_established_timeout,
            )?,
            tcp_close_wait_timeout: timeout(
                args.conntrack_tcp_timeout_close_wait,
                "conntrack.tcpCloseWaitTimeout",
                &section.tcp_close_wait_timeout,
                defaults.tcp_close_wait_timeout,
            )?,
            udp_timeout: timeout(
                args.conntrack_udp_timeout,
                "conntrack.udpTimeout",
                &section.udp_timeout,
                Duration::ZERO,
            )?,
            udp_stream_timeout: timeout(
                args.conntrack_udp_timeout_stream,
                "conntrack.udpStreamTimeout",
                &section.udp_stream_timeout,
                Duration::ZERO,
            )?,
        })
    }

    /// kube-proxy's nf_conntrack_max for `cpus` CPUs: `maxPerCore` × CPUs, at least `min`;
    /// `None` (leave the kernel's) when `maxPerCore` is 0.
    pub fn max_for(&self, cpus: u32) -> Option<u64> {
        (self.max_per_core > 0)
            .then(|| (u64::from(self.max_per_core) * u64::from(cpus)).max(u64::from(self.min)))
    }
}

/// kube-proxy's IPVS settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IpvsSettings {
    /// One of `crate::dataplane::ipvs::SCHEDULERS`.
    pub scheduler: String,
    /// IPVS connection timeouts; zero keeps the kernel's.
    pub tcp_timeout: Duration,
    pub tcp_fin_timeout: Duration,
    pub udp_timeout: Duration,
    pub strict_arp: bool,
    /// Virtual services inside these ranges are left alone.
    pub exclude_cidrs: Vec<IpNet>,
}

impl IpvsSettings {
    fn resolve(args: &Args, file: &KubeProxyConfiguration) -> anyhow::Result<Self> {
        use crate::dataplane::ipvs::{DEFAULT_SCHEDULER, SCHEDULERS};
        let section = &file.ipvs;
        let scheduler = match &args.ipvs_scheduler {
            Some(scheduler) => scheduler.clone(),
            None => match section.scheduler.as_deref().map(str::trim).filter(|name| !name.is_empty()) {
                Some(name) if SCHEDULERS.contains(&name) => name.to_owned(),
                Some(name) => {
                    return Err(file.invalid(
                        "ipvs.scheduler",
                        format!("{name:?} is not one of {}", SCHEDULERS.join(", ")),
                    ))
                }
                None => DEFAULT_SCHEDULER.to_owned(),
            },
        };
        let timeout =
            |flag: Option<Duration>, field: &str, value: &Option<String>| -> anyhow::Result<Duration> {
                match (flag, value.as_deref()) {
                    (Some(timeout), _) => Ok(timeout),
                    (None, Some(text)) => parse_go_duration(text).map_err(|error| file.invalid(field, error)),
                    (None, None) => Ok(Duration::ZERO),
                }
            };
        let exclude_cidrs = match &args.ipvs_exclude_cidrs {
            Some(cidrs) => cidrs.clone(),
            None => section
                .exclude_cidrs
                .iter()
                .flatten()
                .map(|text| {
                    text.trim()
                        .parse::<IpNet>()
                        .map_err(|_| file.invalid("ipvs.excludeCIDRs", format!("{text:?} is not a CIDR")))
                })
                .collect::<anyhow::Result<_>>()?,
        };
        Ok(Self {
            scheduler,
            tcp_timeout: timeout(args.ipvs_tcp_timeout, "ipvs.tcpTimeout", &section.tcp_timeout)?,
            tcp_fin_timeout: timeout(
                args.ipvs_tcpfin_timeout,
                "ipvs.tcpFinTimeout",
                &section.tcp_fin_timeout,
            )?,
            udp_timeout: timeout(args.ipvs_udp_timeout, "ipvs.udpTimeout", &section.udp_timeout)?,
            strict_arp: args.ipvs_strict_arp.or(section.strict_arp).unwrap_or(false),
            exclude_cidrs,
        })
    }
}

/// The host name, lower-cased, as kube-proxy's default node name.
fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|name| name.trim().to_lowercase())
        .unwrap_or_default()
}

impl Settings {
    /// The minimum sync period when `mode` runs: the one given, else that mode's default
    /// (ebpf's is [`EBPF_DEFAULT_MIN_SYNC_PERIOD`]; `--proxy-mode=auto` resolves its mode at
    /// start).
    pub fn min_sync_period_in(&self, mode: Mode) -> Duration {
        if self.min_sync_period_defaulted && mode == Mode::Ebpf {
            EBPF_DEFAULT_MIN_SYNC_PERIOD.min(self.sync_period)
        } else {
            self.min_sync_period
        }
    }

    /// `--nodeport-addresses` as the running `mode` reads it: empty means the primary node IPs
    /// (kube-proxy's nftables default), except in iptables and ipvs modes, where it means every
    /// node address as in kube-proxy's iptables and ipvs modes (the iptables conformance cases
    /// expect NodePorts on secondary addresses). The running mode, not the requested one: auto
    /// that falls back to iptables serves as iptables mode does.
    pub fn node_port_addresses_in(&self, mode: Mode) -> Vec<NodePortAddress> {
        let every_address_by_default = matches!(mode, Mode::Iptables | Mode::Ipvs);
        if every_address_by_default && self.node_port_addresses.is_empty() {
            vec![NodePortAddress::All]
        } else {
            self.node_port_addresses.clone()
        }
    }

    /// `--iptables-localhost-nodeports` as it applies in `mode`: the loopback addresses IPv4
    /// NodePorts are also served on, or `None`.
    pub fn localhost_node_ports_in(&self, mode: Mode) -> Option<ipnet::Ipv4Net> {
        localhost_node_ports(self.iptables_localhost_node_ports, &self.node_port_addresses_in(mode))
    }

    /// The dataplanes' options for a start in `mode`.
    pub fn start_options(&self, mode: Mode) -> StartOptions {
        let seconds = |duration: Duration| u32::try_from(duration.as_secs()).unwrap_or(u32::MAX);
        StartOptions {
            ebpf: EbpfOptions {
                bpf_root: self.bpf_root.clone(),
                devices: self.devices.clone(),
                map_sizes: self.bpf_map_sizes,
                conntrack: self.conntrack,
                balancing: self.balancing,
                xdp: self.xdp,
                forwarding: self.bpf_forwarding,
                lb_mode: self.lb_mode,
                lb_dsr_accept: self.lb_dsr_accept,
            },
            host_traffic: HostTrafficOptions {
                cgroup_root: self.cgroup_root.clone(),
                pods: self.pod_sockets.clone(),
            },
            state_dir: self.state_dir.clone(),
            iptables: IptablesOptions {
                localhost_node_ports: self.localhost_node_ports_in(mode),
                ..IptablesOptions::default()
            },
            ipvs: IpvsOptions {
                scheduler: self.ipvs.scheduler.clone(),
                timeouts: ipvs::client::Timeouts {
                    tcp: seconds(self.ipvs.tcp_timeout),
                    tcp_fin: seconds(self.ipvs.tcp_fin_timeout),
                    udp: seconds(self.ipvs.udp_timeout),
                },
                strict_arp: self.ipvs.strict_arp,
                exclude_cidrs: self.ipvs.exclude_cidrs.clone(),
                masquerade_all: self.masquerade_all,
            },
            nftables: NftablesOptions::default(),
        }
    }

    /// What `--cleanup` and a mode switch remove.
    pub fn cleanup_options(&self) -> Cleanup {
        Cleanup {
            bpf_root: self.bpf_root.clone(),
            devices: self.devices.clone(),
            state_dir: self.state_dir.clone(),
            ipvs_exclude_cidrs: self.ipvs.exclude_cidrs.clone(),
            keep_kube_proxy: self.cleanup_keep_kube_proxy,
        }
    }

    /// The effective configuration as a kube-proxy v1alpha1 KubeProxyConfiguration
    /// (`--write-config-to`): what vipr runs with, defaults filled in, in kube-proxy's field
    /// names, so that `--config` of the written file gives the same settings. `mode` is
    /// vipr's (`auto` and `ebpf` are not kube-proxy's), and vipr's own settings (devices,
    /// BPF maps, XDP, ...) have no place in the format.
    pub fn to_kube_proxy_configuration(&self) -> serde_json::Value {
        use serde_json::json;
        let duration = |duration: Duration| format_go_duration(duration);
        let address = |address: Option<SocketAddr>| address.map(|a| a.to_string()).unwrap_or_default();
        // With auto, the default minimum period depends on the mode chosen at start: zero,
        // which reads back as the default.
        let min_sync_period = if self.proxy_mode == ProxyMode::Auto && self.min_sync_period_defaulted {
            Duration::ZERO
        } else {
            self.min_sync_period
        };
        let periods = json!({
            "syncPeriod": duration(self.sync_period),
            "minSyncPeriod": duration(min_sync_period),
        });
        let mode_name = self.proxy_mode.name();
        let mut sections = serde_json::Map::new();
        let section = match self.proxy_mode {
            ProxyMode::Ipvs => "ipvs",
            ProxyMode::Nftables => "nftables",
            _ => "iptables",
        };
        let mut iptables = json!({
            "masqueradeAll": self.masquerade_all,
            "masqueradeBit": 14,
            "localhostNodePorts": self.iptables_localhost_node_ports,
        });
        let mut ipvs = json!({
            // kube-proxy's default is empty, which its ipvs mode reads as rr.
            "scheduler": if self.ipvs.scheduler == "rr" { "" } else { self.ipvs.scheduler.as_str() },
            "excludeCIDRs": self.ipvs.exclude_cidrs.iter().map(ToString::to_string).collect::<Vec<_>>(),
            "strictARP": self.ipvs.strict_arp,
            "tcpTimeout": duration(self.ipvs.tcp_timeout),
            "tcpFinTimeout": duration(self.ipvs.tcp_fin_timeout),
            "udpTimeout": duration(self.ipvs.udp_timeout),
        });
        // kube-proxy's nftables section: its periods and masquerading.
        let mut nftables = json!({ "masqueradeAll": self.masquerade_all, "masqueradeBit": 14 });
        let target = match section {
            "ipvs" => &mut ipvs,
            "nftables" => &mut nftables,
            _ => &mut iptables,
        };
        if let (Some(target), Some(periods)) = (target.as_object_mut(), periods.as_object()) {
            target.extend(periods.clone());
        }
        sections.insert("iptables".to_owned(), iptables);
        sections.insert("ipvs".to_owned(), ipvs);
        if section == "nftables" {
            sections.insert("nftables".to_owned(), nftables);
        }
        let mut config = json!({
            "apiVersion": CONFIG_API_VERSION,
            "kind": CONFIG_KIND,
            "bindAddress": self.bind_address.unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED)).to_string(),
            "clientConnection": {
                "kubeconfig": match &self.source {
                    SourceSettings::Kubernetes { kubeconfig: Some(path) } => path.display().to_string(),
                    _ => String::new(),
                },
                "qps": self.api_client.qps,
                "burst": self.api_client.burst,
                "contentType": self.api_client.content_type,
                "acceptContentTypes": "",
            },
            "clusterCIDR": self.cluster_cidrs.iter().map(ToString::to_string).collect::<Vec<_>>().join(","),
            "conntrack": {
                "maxPerCore": self.netfilter_conntrack.max_per_core,
                "min": self.netfilter_conntrack.min,
                "tcpBeLiberal": self.netfilter_conntrack.tcp_be_liberal,
                "tcpEstablishedTimeout": duration(self.netfilter_conntrack.tcp_established_timeout),
                "tcpCloseWaitTimeout": duration(self.netfilter_conntrack.tcp_close_wait_timeout),
                "udpTimeout": duration(self.netfilter_conntrack.udp_timeout),
                "udpStreamTimeout": duration(self.netfilter_conntrack.udp_stream_timeout),
            },
            "detectLocalMode": match self.local_detection {
                LocalDetection::ClusterCidr => "ClusterCIDR",
                LocalDetection::NodeCidr => "NodeCIDR",
                LocalDetection::BridgeInterface(_) => "BridgeInterface",
                LocalDetection::InterfaceNamePrefix(_) => "InterfaceNamePrefix",
            },
            "detectLocal": {
                "bridgeInterface": match &self.local_detection {
                    LocalDetection::BridgeInterface(bridge) => bridge.as_str(),
                    _ => "",
                },
                "interfaceNamePrefix": match &self.local_detection {
                    LocalDetection::InterfaceNamePrefix(prefix) => prefix.as_str(),
                    _ => "",
                },
            },
            "featureGates": self.feature_gates.0,
            "healthzBindAddress": address(self.healthz_bind_address),
            "hostnameOverride": self.node_name,
            "logging": {
                "format": match self.logging_format { LoggingFormat::Text => "text", LoggingFormat::Json => "json" },
                "verbosity": match self.log_level { LogLevel::Info => 0, LogLevel::Debug => 4, LogLevel::Trace => 5 },
            },
            "metricsBindAddress": address(self.metrics_bind_address),
            "mode": mode_name,
            "nodePortAddresses": self.node_port_addresses.iter().map(ToString::to_string).collect::<Vec<_>>(),
            "oomScoreAdj": self.oom_score_adj,
        });
        if let Some(config) = config.as_object_mut() {
            config.extend(sections);
        }
        config
    }
}

/// kube-proxy's `--iptables-localhost-nodeports` as it applies to the NodePort addresses
/// (`--nodeport-addresses` as the running mode reads it; empty is taken as every address):
/// the loopback addresses IPv4 NodePorts are also served on, or `None`. As kube-proxy, only
/// when `enabled` and the IPv4 NodePort addresses cover loopback: every address (kube-proxy's
/// `--dst-type LOCAL`, which all of 127.0.0.0/8 is) gives 127.0.0.0/8; a CIDR or the
/// `localhost` keyword that contains 127.0.0.1 gives loopback's address, 127.0.0.1.
pub fn localhost_node_ports(enabled: bool, addresses: &[NodePortAddress]) -> Option<Ipv4Net> {
    if !enabled {
        return None;
    }
    let every = Ipv4Net::new(Ipv4Addr::new(127, 0, 0, 0), 8).expect("a valid prefix");
    let lo = Ipv4Net::from(Ipv4Addr::LOCALHOST);
    if addresses.is_empty() {
        return Some(every);
    }
    let mut found = None;
    for address in addresses {
        match address {
            NodePortAddress::All => return Some(every),
            NodePortAddress::Cidr(ipnet::IpNet::V4(cidr)) if cidr.prefix_len() == 0 => return Some(every),
            NodePortAddress::Cidr(ipnet::IpNet::V4(cidr)) if cidr.contains(&Ipv4Addr::LOCALHOST) => {
                found = Some(lo)
            }
            NodePortAddress::Localhost => found = Some(lo),
            NodePortAddress::Cidr(_) | NodePortAddress::Primary => {}
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;

    use super::*;

    /// kube-proxy's `ContainsIPv4Loopback`: on when the IPv4 NodePort addresses cover
    /// loopback; every address means all of 127.0.0.0/8 (`--dst-type LOCAL`).
    #[test]
    fn localhost_node_ports_apply_where_the_node_port_addresses_cover_loopback() {
        let cidr = |text: &str| NodePortAddress::Cidr(text.parse().unwrap());
        let every = Some("127.0.0.0/8".parse().unwrap());
        let lo = Some("127.0.0.1/32".parse().unwrap());
        assert_eq!(localhost_node_ports(true, &[]), every);
        assert_eq!(localhost_node_ports(true, &[NodePortAddress::All]), every);
        assert_eq!(localhost_node_ports(true, &[cidr("0.0.0.0/0")]), every);
        assert_eq!(localhost_node_ports(true, &[cidr("192.168.0.0/24"), cidr("127.0.0.1/32")]), lo);
        assert_eq!(localhost_node_ports(true, &[NodePortAddress::Localhost]), lo);
        assert_eq!(localhost_node_ports(true, &[cidr("192.168.0.0/24"), cidr("::/0")]), None);
        assert_eq!(localhost_node_ports(true, &[NodePortAddress::Primary]), None);
        assert_eq!(localhost_node_ports(false, &[]), None);
        assert_eq!(localhost_node_ports(false, &[cidr("127.0.0.1/32")]), None);
    }

    #[test]
    fn bpf_map_sizes_default_to_the_compiled_capacities_and_refuse_zero() {
        let resolve = |flags: &[&str]| {
            let args =
                Args::try_parse_from([&["vipr", "--services-file=/dev/null"], flags].concat()).unwrap();
            Settings::resolve(&args).map(|settings| settings.bpf_map_sizes)
        };
        assert_eq!(resolve(&[]).unwrap(), BpfMapSizes::default());
        let sizes = resolve(&["--bpf-services-max=1024", "--bpf-flows-max=4096"]).unwrap();
        assert_eq!(
            (sizes.services, sizes.backends, sizes.flows),
            (1024, BpfMapSizes::default().backends, 4096)
        );
        let error = resolve(&["--bpf-backends-max=0"]).unwrap_err().to_string();
        assert!(error.contains("--bpf-backends-max"), "{error}");
        assert_eq!(resolve(&["--bpf-counters-max=100"]).unwrap().counters, 100);
        let sizes = resolve(&["--bpf-source-ranges-max=100", "--bpf-unmatched-max=200"]).unwrap();
        assert_eq!((sizes.source_ranges, sizes.unmatched), (100, 200));
    }

    #[test]
    fn conntrack_timeouts_are_kube_proxys() {
        let resolve = |flags: &[&str]| {
            let args =
                Args::try_parse_from([&["vipr", "--services-file=/dev/null"], flags].concat()).unwrap();
            Settings::resolve(&args).map(|settings| settings.conntrack)
        };
        let defaults = resolve(&[]).unwrap();
        assert_eq!(defaults, ConntrackTimeouts::default());
        assert_eq!(
            (defaults.tcp_established, defaults.tcp_close_wait, defaults.udp, defaults.udp_stream),
            (
                Duration::from_secs(86_400),
                Duration::from_secs(3600),
                Duration::from_secs(30),
                Duration::from_secs(120)
            )
        );
        let set = resolve(&[
            "--conntrack-tcp-timeout-established=2h",
            "--conntrack-tcp-timeout-close-wait=5m",
            "--conntrack-udp-timeout=3s",
            "--conntrack-udp-timeout-stream=0s",
        ])
        .unwrap();
        assert_eq!(
            (set.tcp_established, set.tcp_close_wait, set.udp, set.udp_stream),
            (
                Duration::from_secs(7200),
                Duration::from_secs(300),
                Duration::from_secs(3),
                Duration::from_secs(120)
            ),
            "0 keeps the default, as kube-proxy's 0 keeps the kernel's"
        );
        let file = ConfigFile::new(
            "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n\
             conntrack:\n  tcpEstablishedTimeout: 1h\n  udpStreamTimeout: 1m\n",
        );
        let from_file = resolve(&[&file.arg(), "--conntrack-udp-timeout-stream=2m"]).unwrap();
        assert_eq!(from_file.tcp_established, Duration::from_secs(3600));
        assert_eq!(from_file.udp_stream, Duration::from_secs(120), "the flag wins");
    }

    #[test]
    fn half_open_and_pressure_flags() {
        let resolve = |flags: &[&str]| {
            let args =
                Args::try_parse_from([&["vipr", "--services-file=/dev/null"], flags].concat()).unwrap();
            Settings::resolve(&args).map(|settings| settings.conntrack)
        };
        let defaults = resolve(&[]).unwrap();
        assert_eq!(
            (defaults.tcp_syn_sent, defaults.tcp_syn_recv, defaults.pressure),
            (
                Duration::from_secs(120),
                Duration::from_secs(60),
                FlowPressure { threshold_percent: 75, timeout: Duration::from_secs(5) }
            ),
            "the kernel's SYN_SENT and SYN_RECV"
        );
        let set = resolve(&[
            "--conntrack-tcp-timeout-syn-sent=3s",
            "--conntrack-tcp-timeout-syn-recv=2s",
            "--conntrack-pressure-threshold=50",
            "--conntrack-pressure-timeout=1s",
        ])
        .unwrap();
        assert_eq!(
            (set.tcp_syn_sent, set.tcp_syn_recv, set.pressure),
            (
                Duration::from_secs(3),
                Duration::from_secs(2),
                FlowPressure { threshold_percent: 50, timeout: Duration::from_secs(1) }
            )
        );
        for bad in [
            "--conntrack-pressure-threshold=0",
            "--conntrack-pressure-threshold=101",
            "--conntrack-pressure-timeout=0s",
        ] {
            let error = resolve(&[bad]).unwrap_err().to_string();
            assert!(error.contains(bad.split('=').next().unwrap()), "{bad}: {error}");
        }
    }

    #[test]
    fn go_durations() {
        let ms = Duration::from_millis;
        for (text, expected) in [
            ("0", Duration::ZERO),
            ("0s", Duration::ZERO),
            ("1s", ms(1000)),
            ("30s", ms(30_000)),
            ("1m30s", ms(90_000)),
            ("1.5h", ms(5_400_000)),
            ("2h45m", ms(9_900_000)),
            ("300ms", ms(300)),
            ("+5s", ms(5000)),
            (".5s", ms(500)),
            ("1.s", ms(1000)),
            ("10us", Duration::from_micros(10)),
            ("10µs", Duration::from_micros(10)),
            ("7ns", Duration::from_nanos(7)),
        ] {
            assert_eq!(parse_go_duration(text), Ok(expected), "{text}");
        }
        for bad in ["", "1", "s", "1x", "-1s", "1.2.3s", "1s-", ".s", "ms1"] {
            assert!(parse_go_duration(bad).is_err(), "{bad:?} parsed");
        }
        assert!(parse_go_duration("1x").unwrap_err().to_string().contains("\"1x\""));
    }

    #[test]
    fn cluster_cidrs_are_one_or_a_dual_stack_pair() {
        assert_eq!("10.244.0.0/16".parse::<CidrPair>().unwrap().0.len(), 1);
        assert_eq!("10.244.0.0/16, fd00::/48".parse::<CidrPair>().unwrap().0.len(), 2);
        assert!("10.244.0.0/16,10.245.0.0/16".parse::<CidrPair>().is_err());
        assert!("10.244.0.0".parse::<CidrPair>().is_err());
    }

    #[test]
    fn node_port_addresses() {
        assert_eq!("primary".parse(), Ok(NodePortAddress::Primary));
        assert_eq!("10.0.0.0/8".parse(), Ok(NodePortAddress::Cidr("10.0.0.0/8".parse().unwrap())));
        assert!("eth0".parse::<NodePortAddress>().is_err());
    }

    #[test]
    fn bind_addresses() {
        assert_eq!(parse_bind_address("0.0.0.0:10256", 1), Ok(Some("0.0.0.0:10256".parse().unwrap())));
        assert_eq!(parse_bind_address("[::]:9", 1), Ok(Some("[::]:9".parse().unwrap())));
        assert_eq!(parse_bind_address("127.0.0.1", 10249), Ok(Some("127.0.0.1:10249".parse().unwrap())));
        assert_eq!(parse_bind_address("[::1]", 7), Ok(Some("[::1]:7".parse().unwrap())));
        assert_eq!(parse_bind_address("", 7), Ok(None));
        assert!(parse_bind_address("localhost:80", 7).is_err());
    }

    fn settings(argv: &[&str]) -> anyhow::Result<Settings> {
        let args = Args::try_parse_kube_proxy_style(std::iter::once("vipr").chain(argv.iter().copied()))?;
        Settings::resolve(&args)
    }

    /// A KubeProxyConfiguration file in the temp dir, removed on drop.
    struct ConfigFile(PathBuf);

    impl ConfigFile {
        fn new(text: &str) -> Self {
            static COUNTER: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
            let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let path = std::env::temp_dir().join(format!("vipr-config-test-{}-{n}.yaml", std::process::id()));
            std::fs::write(&path, text).unwrap();
            Self(path)
        }

        fn arg(&self) -> String {
            format!("--config={}", self.0.display())
        }
    }

    impl Drop for ConfigFile {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    #[test]
    fn defaults_are_kube_proxys() {
        let settings = settings(&["--services-file=s.yaml", "--node-name=Node-A"]).unwrap();
        assert_eq!(settings.proxy_mode, ProxyMode::Auto);
        assert_eq!(settings.source, SourceSettings::File("s.yaml".into()));
        assert_eq!(settings.node_name, "node-a");
        assert_eq!(settings.healthz_bind_address, Some("0.0.0.0:10256".parse().unwrap()));
        assert_eq!(settings.metrics_bind_address, Some("127.0.0.1:10249".parse().unwrap()));
        assert_eq!(settings.sync_period, Duration::from_secs(30));
        assert_eq!(settings.min_sync_period, Duration::from_secs(1));
        assert!(settings.cluster_cidrs.is_empty() && !settings.masquerade_all);
        assert!(settings.node_port_addresses.is_empty());
        assert_eq!(settings.log_level, LogLevel::Info);
        assert_eq!(settings.bpf_root, PathBuf::from("/sys/fs/bpf"));
    }

    #[test]
    fn without_services_file_the_source_is_the_api_server() {
        let with_kubeconfig = settings(&["--kubeconfig=/etc/kube.conf"]).unwrap();
        assert_eq!(
            with_kubeconfig.source,
            SourceSettings::Kubernetes { kubeconfig: Some("/etc/kube.conf".into()) }
        );
        assert_eq!(settings(&[]).unwrap().source, SourceSettings::Kubernetes { kubeconfig: None });
    }

    const CONFIG: &str = r#"
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection:
  kubeconfig: /var/lib/kube-proxy/kubeconfig.conf
  qps: 0
hostnameOverride: From-File
healthzBindAddress: 0.0.0.0:20256
metricsBindAddress: 0.0.0.0:20249
mode: ebpf
clusterCIDR: 10.244.0.0/16
nodePortAddresses: [10.0.0.0/8]
iptables:
  masqueradeAll: true
  masqueradeBit: 13
  syncPeriod: 1m
  minSyncPeriod: 2s
ipvs:
  syncPeriod: 5m
conntrack:
  maxPerCore: 32768
  min: null
oomScoreAdj: -999
logging:
  verbosity: 4
"#;

    #[test]
    fn the_config_file_sets_what_no_flag_sets() {
        let file = ConfigFile::new(CONFIG);
        let settings = settings(&[&file.arg()]).unwrap();
        assert_eq!(settings.proxy_mode, ProxyMode::Ebpf);
        assert_eq!(
            settings.source,
            SourceSettings::Kubernetes { kubeconfig: Some("/var/lib/kube-proxy/kubeconfig.conf".into()) }
        );
        assert_eq!(settings.node_name, "from-file");
        assert_eq!(settings.healthz_bind_address, Some("0.0.0.0:20256".parse().unwrap()));
        assert_eq!(settings.metrics_bind_address, Some("0.0.0.0:20249".parse().unwrap()));
        assert_eq!(settings.sync_period, Duration::from_secs(60));
        assert_eq!(settings.min_sync_period, Duration::from_secs(2));
        assert_eq!(settings.cluster_cidrs, vec!["10.244.0.0/16".parse::<IpNet>().unwrap()]);
        assert!(settings.masquerade_all);
        assert_eq!(settings.node_port_addresses, vec![NodePortAddress::Cidr("10.0.0.0/8".parse().unwrap())]);
        assert_eq!(settings.log_level, LogLevel::Debug);
        // The ipvs section does not apply in ebpf mode; zero values are not worth a warning.
        assert_eq!(settings.ignored_config, ["iptables.masqueradeBit", "ipvs.syncPeriod"]);
        assert_eq!(settings.netfilter_conntrack.max_per_core, 32768);
        assert_eq!(settings.oom_score_adj, -999);
    }

    #[test]
    fn flags_override_the_config_file() {
        let file = ConfigFile::new(CONFIG);
        let settings = settings(&[
            &file.arg(),
            "--proxy-mode=ebpf",
            "--services-file=/s.yaml",
            "--hostname-override=from-flag",
            "--healthz-bind-address=127.0.0.1:1",
            "--metrics-bind-address=",
            "--sync-period=10s",
            "--min-sync-period=0s",
            "--cluster-cidr=10.1.0.0/16,fd00::/64",
            "--masquerade-all=false",
            "--nodeport-addresses=primary",
            "--v=0",
        ])
        .unwrap();
        assert_eq!(settings.source, SourceSettings::File("/s.yaml".into()));
        assert_eq!(settings.node_name, "from-flag");
        assert_eq!(settings.healthz_bind_address, Some("127.0.0.1:1".parse().unwrap()));
        assert_eq!(settings.metrics_bind_address, None);
        assert_eq!(settings.sync_period, Duration::from_secs(10));
        assert_eq!(settings.min_sync_period, Duration::ZERO);
        assert_eq!(settings.cluster_cidrs.len(), 2);
        assert!(!settings.masquerade_all);
        assert_eq!(settings.node_port_addresses, vec![NodePortAddress::Primary]);
        assert_eq!(settings.log_level, LogLevel::Info);

        let settings = self::settings(&[&file.arg(), "--kubeconfig=/other", "--masquerade-all"]).unwrap();
        assert_eq!(settings.source, SourceSettings::Kubernetes { kubeconfig: Some("/other".into()) });
        assert!(settings.masquerade_all);
    }

    #[test]
    fn iptables_localhost_nodeports_defaults_to_true_and_the_flag_overrides_the_file() {
        assert!(settings(&[]).unwrap().iptables_localhost_node_ports);
        assert!(!settings(&["--iptables-localhost-nodeports=false"]).unwrap().iptables_localhost_node_ports);
        let file = ConfigFile::new(
            "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nmode: iptables\n\
             iptables:\n  localhostNodePorts: false\n",
        );
        let from_file = settings(&[&file.arg()]).unwrap();
        assert!(!from_file.iptables_localhost_node_ports);
        assert!(from_file.ignored_config.is_empty(), "{:?}", from_file.ignored_config);
        let flag = settings(&[&file.arg(), "--iptables-localhost-nodeports"]).unwrap();
        assert!(flag.iptables_localhost_node_ports);
    }

    #[test]
    fn ipvs_settings_come_from_flags_over_the_file() {
        let file = ConfigFile::new(
            "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nmode: ipvs\n\
             ipvs:\n  syncPeriod: 20s\n  scheduler: sh\n  strictARP: true\n  tcpTimeout: 15m\n  \
             excludeCIDRs: [10.0.0.0/8]\n",
        );
        let settings = settings(&[&file.arg()]).unwrap();
        assert_eq!(settings.proxy_mode, ProxyMode::Ipvs);
        assert_eq!(settings.sync_period, Duration::from_secs(20));
        assert!(settings.ignored_config.is_empty(), "{:?}", settings.ignored_config);
        assert_eq!(
            settings.ipvs,
            IpvsSettings {
                scheduler: "sh".into(),
                tcp_timeout: Duration::from_secs(900),
                tcp_fin_timeout: Duration::ZERO,
                udp_timeout: Duration::ZERO,
                strict_arp: true,
                exclude_cidrs: vec!["10.0.0.0/8".parse().unwrap()],
            }
        );
        let flags = self::settings(&[
            &file.arg(),
            "--ipvs-scheduler=rr",
            "--ipvs-strict-arp=false",
            "--ipvs-exclude-cidrs=fd00::/64",
        ])
        .unwrap();
        assert_eq!((flags.ipvs.scheduler.as_str(), flags.ipvs.strict_arp), ("rr", false));
        assert_eq!(flags.ipvs.exclude_cidrs, vec!["fd00::/64".parse::<IpNet>().unwrap()]);
        let defaults = self::settings(&[]).unwrap().ipvs;
        assert_eq!((defaults.scheduler.as_str(), defaults.tcp_timeout), ("rr", Duration::ZERO));
        let bad = ConfigFile::new("apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nipvs: {scheduler: fancy}\n");
        assert!(format!("{:#}", self::settings(&[&bad.arg()]).unwrap_err()).contains("ipvs.scheduler"));
    }

    #[test]
    fn json_config_files_parse_too() {
        let file = ConfigFile::new(
            r#"{"apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration",
                "mode": "", "iptables": {"syncPeriod": "45s"}}"#,
        );
        let settings = settings(&[&file.arg()]).unwrap();
        assert_eq!(settings.proxy_mode, ProxyMode::Iptables, "\"\" is kube-proxy's default mode");
        assert_eq!(settings.sync_period, Duration::from_secs(45));
        assert!(settings.ignored_config.is_empty(), "{:?}", settings.ignored_config);
    }

    #[test]
    fn bad_config_files_are_refused_with_the_field() {
        let refused = |text: &str| {
            let file = ConfigFile::new(text);
            format!("{:#}", settings(&[&file.arg()]).unwrap_err())
        };
        let header = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n";
        assert!(refused("kind: KubeletConfiguration\n").contains("not a KubeProxyConfiguration"));
        assert!(refused(&format!("{header}iptables: {{syncPeriod: 5x}}\n")).contains("iptables.syncPeriod"));
        assert!(refused(&format!("{header}clusterCIDR: 10.0.0.0\n")).contains("clusterCIDR"));
        assert!(refused(&format!("{header}mode: userspace\n")).contains("not a vipr proxy mode"));
        assert!(refused(&format!("{header}healthzBindAddress: nowhere\n")).contains("healthzBindAddress"));
        assert!(refused(&format!("{header}hostnameOverride: [a\n")).contains("--config"));
        let missing = format!("{:#}", settings(&["--config=/nonexistent/vipr.yaml"]).unwrap_err());
        assert!(missing.contains("cannot read /nonexistent/vipr.yaml"), "{missing}");
    }

    #[test]
    fn klog_verbosity_maps_to_log_levels() {
        let level = |argv: &[&str]| settings(argv).unwrap().log_level;
        assert_eq!(level(&["--v=2"]), LogLevel::Info);
        assert_eq!(level(&["--v=4"]), LogLevel::Debug);
        assert_eq!(level(&["--v=6"]), LogLevel::Trace);
        assert_eq!(level(&["-v"]), LogLevel::Debug);
        assert_eq!(level(&["-vv"]), LogLevel::Trace);
        assert_eq!(level(&["-v", "--v=9"]), LogLevel::Trace);
    }

    #[test]
    fn sync_period_must_be_positive_and_hostname_not_empty() {
        assert!(settings(&["--sync-period=0s"]).is_err());
        assert!(settings(&["--hostname-override= "]).is_err());
    }

    #[test]
    fn lb_dsr_accept_follows_the_lb_mode_unless_given() {
        let accept = |args: &[&str]| settings(args).unwrap().start_options(Mode::Ebpf).ebpf.lb_dsr_accept;
        assert_eq!(accept(&[]), None);
        assert_eq!(accept(&["--lb-dsr-accept"]), Some(true));
        assert_eq!(accept(&["--lb-dsr-accept=true"]), Some(true));
        assert_eq!(accept(&["--lb-mode=dsr", "--lb-dsr-accept=false"]), Some(false));
        assert!(settings(&["--lb-dsr-accept=maybe"]).is_err());
    }

    #[test]
    fn forwarding_goes_through_the_stack_unless_redirect_is_asked_for() {
        assert_eq!(settings(&[]).unwrap().bpf_forwarding, BpfForwarding::Stack);
        assert_eq!(settings(&["--bpf-forwarding=redirect"]).unwrap().bpf_forwarding, BpfForwarding::Redirect);
        assert_eq!(settings(&["--bpf-forwarding=stack"]).unwrap().bpf_forwarding, BpfForwarding::Stack);
        assert_eq!(settings(&[]).unwrap().lb_mode, LbMode::Snat);
        assert_eq!(settings(&["--lb-mode=dsr"]).unwrap().lb_mode, LbMode::Dsr);
        assert_eq!(settings(&["--lb-mode=hybrid"]).unwrap().lb_mode, LbMode::Hybrid);
        let unknown = settings(&["--lb-mode=tunnel"]).unwrap_err().to_string();
        assert!(unknown.contains("invalid value 'tunnel' for '--lb-mode <MODE>'"), "{unknown}");
        assert!(
            unknown.contains("snat") && unknown.contains("dsr") && unknown.contains("hybrid"),
            "{unknown}"
        );
        assert!(settings(&["--bpf-forwarding=bypass"]).is_err());
    }

    #[test]
    fn xdp_without_the_flag_is_auto_and_the_flag_names_three_modes() {
        assert_eq!(settings(&[]).unwrap().xdp, XdpMode::Auto);
        for (flag, mode) in
            [("native", XdpMode::Native), ("generic", XdpMode::Generic), ("off", XdpMode::Off)]
        {
            assert_eq!(settings(&[&format!("--xdp={flag}")]).unwrap().xdp, mode);
        }
        assert!(settings(&["--xdp=auto"]).is_err(), "auto is what no flag means, not a value of it");
        // The library's embedders start without XDP unless they ask.
        assert_eq!(XdpMode::default(), XdpMode::Off);
    }

    #[test]
    fn service_proxy_name_is_a_label_value() {
        let name = |argv: &[&str]| settings(argv).map(|settings| settings.service_proxy_name);
        assert_eq!(name(&[]).unwrap(), None, "no flag: the unlabelled Services");
        assert_eq!(name(&["--service-proxy-name=vipr"]).unwrap(), Some("vipr".into()));
        assert_eq!(name(&["--service-proxy-name="]).unwrap(), None);
        for bad in ["-vipr", "vipr!", "a,b", "x=y", &"v".repeat(64)] {
            let error = name(&[&format!("--service-proxy-name={bad}")]).unwrap_err();
            assert!(error.to_string().contains("not a label value"), "{bad}: {error}");
        }
    }
}

/// kube-proxy's own configurations, as kubeadm and kops hand them over
/// (testdata/kube-proxy/), resolved with kube-proxy's defaulting.
#[cfg(test)]
mod kube_proxy_fixtures {
    use std::{net::IpAddr, path::PathBuf, time::Duration};

    use super::*;

    fn fixture(name: &str) -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("testdata/kube-proxy").join(name)
    }

    fn kops_flags() -> Vec<String> {
        std::fs::read_to_string(fixture("kops-flags.txt"))
            .unwrap()
            .lines()
            .map(str::trim)
            .filter(|line| !line.is_empty())
            .map(str::to_owned)
            .collect()
    }

    fn settings(argv: &[&str]) -> anyhow::Result<Settings> {
        let args = Args::try_parse_kube_proxy_style(std::iter::once("vipr").chain(argv.iter().copied()))?;
        Settings::resolve(&args)
    }

    fn config_arg(name: &str) -> String {
        format!("--config={}", fixture(name).display())
    }

    /// A KubeProxyConfiguration of the test's own, removed on drop.
    struct Written(PathBuf);

    impl Written {
        fn new(text: &str) -> Self {
            static COUNTER: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
            let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let path = std::env::temp_dir().join(format!("vipr-kp-fixture-{}-{n}.yaml", std::process::id()));
            std::fs::write(&path, format!("apiVersion: {CONFIG_API_VERSION}\nkind: {CONFIG_KIND}\n{text}"))
                .unwrap();
            Self(path)
        }

        fn arg(&self) -> String {
            format!("--config={}", self.0.display())
        }
    }

    impl Drop for Written {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    #[test]
    fn kubeadm_files_mean_kube_proxys_defaults() {
        for (file, cluster_cidr) in [
            ("kubeadm-1.33.yaml", "192.168.0.0/16"),
            ("kubeadm-1.35.yaml", "10.244.0.0/16"),
            ("kubeadm-1.37.yaml", "10.244.0.0/16"),
        ] {
            let settings = settings(&[&config_arg(file)]).unwrap_or_else(|error| panic!("{file}: {error:#}"));
            assert_eq!(settings.proxy_mode, ProxyMode::Iptables, "{file}: \"\" and iptables mean iptables");
            assert_eq!(settings.sync_period, Duration::from_secs(30), "{file}");
            assert_eq!(settings.min_sync_period, Duration::from_secs(1), "{file}");
            assert_eq!(settings.healthz_bind_address, Some("0.0.0.0:10256".parse().unwrap()), "{file}");
            assert_eq!(settings.metrics_bind_address, Some("127.0.0.1:10249".parse().unwrap()), "{file}");
            assert_eq!(settings.cluster_cidrs, vec![cluster_cidr.parse::<IpNet>().unwrap()], "{file}");
            assert_eq!(settings.local_detection, LocalDetection::ClusterCidr, "{file}");
            assert_eq!(settings.netfilter_conntrack, NetfilterConntrack::default(), "{file}");
            assert_eq!(settings.conntrack, ConntrackTimeouts::default(), "{file}");
            assert_eq!(settings.oom_score_adj, -999, "{file}");
            assert_eq!(settings.bind_address, None, "{file}: 0.0.0.0 overrides no node IP");
            assert!(settings.iptables_localhost_node_ports && !settings.masquerade_all, "{file}");
            assert_eq!(settings.ipvs.scheduler, "rr", "{file}");
            assert_eq!(settings.api_client, ApiClientSettings::default(), "{file}");
            assert_eq!(settings.logging_format, LoggingFormat::Text, "{file}");
            assert_eq!(
                settings.source,
                SourceSettings::Kubernetes { kubeconfig: Some("/var/lib/kube-proxy/kubeconfig.conf".into()) }
            );
            assert!(settings.ignored_config.is_empty(), "{file}: {:?}", settings.ignored_config);
            assert!(settings.ignored_flags.is_empty(), "{file}: {:?}", settings.ignored_flags);

            // The DaemonSet's --proxy-mode wins over the file's mode.
            let with_flag = self::settings(&[&config_arg(file), "--proxy-mode=ebpf"]).unwrap();
            assert_eq!(with_flag.proxy_mode, ProxyMode::Ebpf, "{file}");
            assert_eq!(with_flag.sync_period, Duration::from_secs(30), "{file}");
        }
    }

    #[test]
    fn kops_flags_are_implemented() {
        let flags = kops_flags();
        let settings = settings(&flags.iter().map(String::as_str).collect::<Vec<_>>()).unwrap();
        assert_eq!(settings.proxy_mode, ProxyMode::Iptables);
        assert_eq!(settings.cluster_cidrs, vec!["100.96.0.0/11".parse::<IpNet>().unwrap()]);
        assert_eq!(settings.netfilter_conntrack.max_per_core, 131_072);
        assert_eq!(settings.netfilter_conntrack.max_for(2), Some(262_144));
        assert_eq!(settings.node_name, "i-0123456789abcdef0");
        assert_eq!(settings.api_client.master.as_deref(), Some("https://127.0.0.1"));
        assert_eq!(settings.oom_score_adj, -998);
        assert_eq!(settings.log_level, LogLevel::Info);
        assert_eq!(settings.logging_format, LoggingFormat::Text);
        assert_eq!(
            settings.source,
            SourceSettings::Kubernetes { kubeconfig: Some("/var/lib/kube-proxy/kubeconfig".into()) }
        );
        assert!(settings.ignored_flags.is_empty(), "{:?}", settings.ignored_flags);

        // Over kubeadm's file: the flags win, the file fills the rest.
        let mut argv = vec![config_arg("kubeadm-1.35.yaml")];
        argv.extend(flags);
        let both = self::settings(&argv.iter().map(String::as_str).collect::<Vec<_>>()).unwrap();
        assert_eq!(both.cluster_cidrs, settings.cluster_cidrs);
        assert_eq!((both.oom_score_adj, both.sync_period), (-998, Duration::from_secs(30)));
        assert_eq!(both.healthz_bind_address, Some("0.0.0.0:10256".parse().unwrap()));
    }

    #[test]
    fn zero_durations_empty_addresses_and_nulls_are_kube_proxys_defaults() {
        let file = Written::new(
            "iptables: {syncPeriod: 0s, minSyncPeriod: 0s}\nhealthzBindAddress: \"\"\n\
             metricsBindAddress: \"\"\nconntrack: {maxPerCore: null, min: null, tcpEstablishedTimeout: null}\n\
             oomScoreAdj: null\nmode: \"\"\n",
        );
        let defaulted = settings(&[&file.arg()]).unwrap();
        assert_eq!(
            (defaulted.sync_period, defaulted.min_sync_period),
            (Duration::from_secs(30), Duration::from_secs(1))
        );
        assert_eq!(defaulted.healthz_bind_address, Some(DEFAULT_HEALTHZ_BIND_ADDRESS));
        assert_eq!(defaulted.metrics_bind_address, Some(DEFAULT_METRICS_BIND_ADDRESS));
        assert_eq!(defaulted.netfilter_conntrack, NetfilterConntrack::default());
        // An empty address on the command line still turns the server off.
        let off = settings(&[&file.arg(), "--metrics-bind-address="]).unwrap();
        assert_eq!(off.metrics_bind_address, None);
        // An explicit 0 leaves the kernel's value (kube-proxy: "0 to leave as-is").
        let zero = Written::new("conntrack: {maxPerCore: 0, tcpEstablishedTimeout: 0s}\n");
        let zero = settings(&[&zero.arg()]).unwrap().netfilter_conntrack;
        assert_eq!((zero.max_for(8), zero.tcp_established_timeout), (None, Duration::ZERO));
        // A bare address gets the default port.
        let bare = Written::new("healthzBindAddress: 10.0.0.1\nmetricsBindAddress: 0.0.0.0\n");
        let bare = settings(&[&bare.arg()]).unwrap();
        assert_eq!(bare.healthz_bind_address, Some("10.0.0.1:10256".parse().unwrap()));
        assert_eq!(bare.metrics_bind_address, Some("0.0.0.0:10249".parse().unwrap()));
    }

    #[test]
    fn an_ipv6_bind_address_picks_ipv6_defaults_and_is_the_node_ip() {
        let file = Written::new("bindAddress: \"::\"\nhealthzBindAddress: \"\"\nmetricsBindAddress: \"\"\n");
        let settings = settings(&[&file.arg()]).unwrap();
        assert_eq!(settings.healthz_bind_address, Some("[::]:10256".parse().unwrap()));
        assert_eq!(settings.metrics_bind_address, Some("[::1]:10249".parse().unwrap()));
        assert_eq!(settings.bind_address, None);
        let flag = self::settings(&["--bind-address=fd00::5"]).unwrap();
        assert_eq!(flag.bind_address, Some("fd00::5".parse::<IpAddr>().unwrap()));
        assert_eq!(flag.metrics_bind_address, Some("[::1]:10249".parse().unwrap()));
        let v4 = self::settings(&["--bind-address=10.0.0.5"]).unwrap();
        assert_eq!(v4.bind_address, Some("10.0.0.5".parse::<IpAddr>().unwrap()));
        assert_eq!(v4.healthz_bind_address, Some("0.0.0.0:10256".parse().unwrap()));
    }

    #[test]
    fn ebpf_mode_defaults_to_a_short_minimum_sync_period_and_honours_a_given_one() {
        let running = |argv: &[&str], mode: Mode| settings(argv).unwrap().min_sync_period_in(mode);
        let kube_proxy_default = Duration::from_secs(1);
        // Nothing given: ebpf's own default; kube-proxy's in the netfilter modes, also when
        // auto falls back to one of them.
        assert_eq!(running(&["--proxy-mode=ebpf"], Mode::Ebpf), EBPF_DEFAULT_MIN_SYNC_PERIOD);
        assert_eq!(running(&["--proxy-mode=auto"], Mode::Ebpf), EBPF_DEFAULT_MIN_SYNC_PERIOD);
        assert_eq!(running(&["--proxy-mode=auto"], Mode::Nftables), kube_proxy_default);
        assert_eq!(running(&["--proxy-mode=iptables"], Mode::Iptables), kube_proxy_default);
        assert_eq!(running(&["--proxy-mode=nftables"], Mode::Nftables), kube_proxy_default);
        assert_eq!(running(&["--proxy-mode=ipvs"], Mode::Ipvs), Duration::ZERO);
        // Anything given is honoured in ebpf mode too: each flag, the file's field, and 0.
        for given in ["--min-sync-period=1s", "--iptables-min-sync-period=1s"] {
            for mode in ["--proxy-mode=ebpf", "--proxy-mode=auto"] {
                assert_eq!(running(&[mode, given], Mode::Ebpf), kube_proxy_default, "{mode} {given}");
            }
        }
        assert_eq!(running(&["--proxy-mode=ebpf", "--min-sync-period=0s"], Mode::Ebpf), Duration::ZERO);
        let file = Written::new("mode: ebpf\niptables: {minSyncPeriod: 2s}\n");
        assert_eq!(running(&[&file.arg()], Mode::Ebpf), Duration::from_secs(2));
        // A zero in the file is kube-proxy's "the default".
        let file = Written::new("iptables: {minSyncPeriod: 0s}\n");
        assert_eq!(running(&[&file.arg(), "--proxy-mode=ebpf"], Mode::Ebpf), EBPF_DEFAULT_MIN_SYNC_PERIOD);
        // A short sync period given is not refused because of the default minimum.
        assert_eq!(
            running(&["--proxy-mode=ebpf", "--sync-period=10ms"], Mode::Ebpf),
            Duration::from_millis(10)
        );
        // The written configuration keeps the default a default: ebpf's value, or zero for auto.
        let written = |argv: &[&str]| {
            settings(argv).unwrap().to_kube_proxy_configuration()["iptables"]["minSyncPeriod"].clone()
        };
        assert_eq!(written(&["--proxy-mode=ebpf"]), "20ms");
        assert_eq!(written(&["--proxy-mode=auto"]), "0s");
        assert_eq!(written(&["--proxy-mode=auto", "--min-sync-period=1s"]), "1s");
    }

    #[test]
    fn per_mode_sync_flags_apply_to_the_mode_that_runs() {
        let period = |argv: &[&str]| {
            let settings = settings(argv).unwrap();
            (settings.sync_period.as_secs(), settings.min_sync_period.as_secs())
        };
        let flags = [
            "--iptables-sync-period=20s",
            "--iptables-min-sync-period=2s",
            "--ipvs-sync-period=40s",
            "--ipvs-min-sync-period=4s",
        ];
        for mode in ["--proxy-mode=iptables", "--proxy-mode=ebpf", "--proxy-mode=auto"] {
            assert_eq!(period(&[&[mode][..], &flags].concat()), (20, 2), "{mode}");
        }
        assert_eq!(period(&[&["--proxy-mode=ipvs"][..], &flags].concat()), (40, 4));
        // ipvs mode's own defaults: no minimum.
        assert_eq!(period(&["--proxy-mode=ipvs", "--iptables-sync-period=20s"]), (30, 0));
        // vipr's own flags win in every mode.
        assert_eq!(
            period(
                &[&["--proxy-mode=ipvs", "--sync-period=7s", "--min-sync-period=3s"][..], &flags].concat()
            ),
            (7, 3)
        );
        // The flags over the file's section of the mode.
        let file = Written::new("iptables: {syncPeriod: 1m, minSyncPeriod: 5s}\nipvs: {syncPeriod: 2m}\n");
        assert_eq!(period(&[&file.arg()]), (60, 5));
        assert_eq!(period(&[&file.arg(), "--iptables-min-sync-period=3s"]), (60, 3));
        assert_eq!(period(&[&file.arg(), "--proxy-mode=ipvs"]), (120, 0));
    }

    #[test]
    fn sync_periods_are_validated_as_kube_proxy_does() {
        let error = |argv: &[&str]| format!("{:#}", settings(argv).unwrap_err());
        assert!(error(&["--iptables-sync-period=0s"]).contains("--iptables-sync-period"));
        assert!(error(&["--sync-period=0s"]).contains("greater than 0"));
        let message = error(&["--iptables-sync-period=5s", "--iptables-min-sync-period=10s"]);
        assert!(message.contains("--iptables-min-sync-period") && message.contains("10s"), "{message}");
    }

    #[test]
    fn detect_local_mode_is_honoured_with_its_interface() {
        assert_eq!(settings(&[]).unwrap().local_detection, LocalDetection::ClusterCidr);
        assert_eq!(
            settings(&["--detect-local-mode=NodeCIDR"]).unwrap().local_detection,
            LocalDetection::NodeCidr
        );
        let file = Written::new("detectLocalMode: NodeCIDR\n");
        let from_file = settings(&[&file.arg()]).unwrap();
        assert_eq!(from_file.local_detection, LocalDetection::NodeCidr);
        assert!(from_file.ignored_config.is_empty(), "{:?}", from_file.ignored_config);
        assert_eq!(
            settings(&[&file.arg(), "--detect-local-mode=ClusterCIDR"]).unwrap().local_detection,
            LocalDetection::ClusterCidr
        );

        assert_eq!(
            settings(&["--detect-local-mode=BridgeInterface", "--pod-bridge-interface=cbr0"])
                .unwrap()
                .local_detection,
            LocalDetection::BridgeInterface("cbr0".into())
        );
        assert_eq!(
            settings(&["--detect-local-mode=InterfaceNamePrefix", "--pod-interface-name-prefix=veth"])
                .unwrap()
                .local_detection,
            LocalDetection::InterfaceNamePrefix("veth".into())
        );
        let file = Written::new(
            "detectLocalMode: InterfaceNamePrefix\ndetectLocal: {interfaceNamePrefix: cali, bridgeInterface: cbr0}\n",
        );
        let from_file = settings(&[&file.arg()]).unwrap();
        assert_eq!(from_file.local_detection, LocalDetection::InterfaceNamePrefix("cali".into()));
        assert!(from_file.ignored_config.is_empty(), "{:?}", from_file.ignored_config);
        assert_eq!(
            settings(&[&file.arg(), "--detect-local-mode=BridgeInterface"]).unwrap().local_detection,
            LocalDetection::BridgeInterface("cbr0".into())
        );
        assert_eq!(
            settings(&[&file.arg(), "--pod-interface-name-prefix=veth"]).unwrap().local_detection,
            LocalDetection::InterfaceNamePrefix("veth".into())
        );

        let refused = |argv: &[&str]| format!("{:#}", settings(argv).unwrap_err());
        let message = refused(&["--detect-local-mode=BridgeInterface"]);
        assert!(message.contains("needs --pod-bridge-interface"), "{message}");
        let message = refused(&["--detect-local-mode=InterfaceNamePrefix", "--pod-interface-name-prefix= "]);
        assert!(message.contains("needs --pod-interface-name-prefix"), "{message}");
        let message = refused(&["--detect-local-mode=BridgeInterface", "--pod-bridge-interface=a/b"]);
        assert!(message.contains("not an interface name"), "{message}");
        let bad = Written::new("detectLocalMode: Cluster\n");
        assert!(refused(&[&bad.arg()]).contains("detectLocalMode"));
    }

    #[test]
    fn nftables_in_the_file_runs_nftables_mode_unless_the_flag_picks_another() {
        let file = Written::new("mode: nftables\nnftables: {syncPeriod: 10s}\n");
        let from_file = settings(&[&file.arg()]).unwrap();
        assert_eq!(from_file.proxy_mode, ProxyMode::Nftables);
        assert_eq!(from_file.sync_period, Duration::from_secs(10), "the nftables section applies");
        let settings = settings(&[&file.arg(), "--proxy-mode=ebpf"]).unwrap();
        assert_eq!(settings.proxy_mode, ProxyMode::Ebpf);
    }

    #[test]
    fn oom_score_adj_flag_file_default_and_range() {
        assert_eq!(settings(&[]).unwrap().oom_score_adj, -999);
        let file = Written::new("oomScoreAdj: -500\n");
        assert_eq!(settings(&[&file.arg()]).unwrap().oom_score_adj, -500);
        assert_eq!(settings(&[&file.arg(), "--oom-score-adj=-998"]).unwrap().oom_score_adj, -998);
        assert!(settings(&["--oom-score-adj=-1001"]).is_err());
    }

    #[test]
    fn conntrack_settings_come_from_flags_over_the_file() {
        let file =
            Written::new("conntrack: {maxPerCore: 65536, min: 1000, tcpBeLiberal: true, udpTimeout: 10s}\n");
        let from_file = settings(&[&file.arg()]).unwrap().netfilter_conntrack;
        assert_eq!((from_file.max_per_core, from_file.min, from_file.tcp_be_liberal), (65536, 1000, true));
        assert_eq!(from_file.udp_timeout, Duration::from_secs(10));
        let flags =
            settings(&[&file.arg(), "--conntrack-max-per-core=0", "--conntrack-tcp-be-liberal=false"])
                .unwrap()
                .netfilter_conntrack;
        assert_eq!((flags.max_per_core, flags.tcp_be_liberal), (0, false));
        assert!(settings(&["--conntrack-min=-1"]).is_err());
    }

    #[test]
    fn feature_gates_api_client_flags_and_deprecated_ports() {
        let settings = settings(&[
            "--feature-gates=SomeGate=true",
            "--kube-api-qps=50",
            "--kube-api-content-type=application/json",
            "--healthz-port=0",
            "--metrics-port=12345",
            "--logging-format=json",
        ])
        .unwrap();
        assert_eq!(settings.feature_gates.0.get("SomeGate"), Some(&true));
        assert_eq!(settings.healthz_bind_address, None, "--healthz-port=0 turns the server off");
        assert_eq!(settings.metrics_bind_address, Some(DEFAULT_METRICS_BIND_ADDRESS));
        assert_eq!(settings.logging_format, LoggingFormat::Json);
        let ignored = settings.ignored_flags.join("\n");
        for name in
            ["--feature-gates=SomeGate=true", "--kube-api-qps", "--kube-api-content-type", "--metrics-port"]
        {
            assert!(ignored.contains(name), "{name} not named in {ignored}");
        }
        let file = Written::new("featureGates: {Other: false}\nlogging: {format: json}\n");
        let from_file = self::settings(&[&file.arg()]).unwrap();
        assert_eq!(from_file.feature_gates.0.get("Other"), Some(&false));
        assert_eq!(from_file.logging_format, LoggingFormat::Json);
        assert!(from_file.ignored_flags.iter().any(|flag| flag.contains("Other=false")));
    }

    #[test]
    fn the_written_configuration_reads_back_as_the_same_settings() {
        let argv = [
            "--proxy-mode=ipvs",
            "--kubeconfig=/k.conf",
            "--hostname-override=node-w",
            "--cluster-cidr=10.244.0.0/16,fd00:10::/56",
            "--ipvs-sync-period=45s",
            "--ipvs-min-sync-period=500ms",
            "--ipvs-scheduler=mh",
            "--oom-score-adj=-100",
            "--conntrack-max-per-core=0",
            "--conntrack-udp-timeout=15s",
            "--nodeport-addresses=primary,10.0.0.0/8",
            "--metrics-bind-address=0.0.0.0:9999",
            "--detect-local-mode=NodeCIDR",
            "--bind-address=10.1.2.3",
            "--feature-gates=A=true",
        ];
        let original = settings(&argv).unwrap();
        let written = serde_yaml::to_string(&original.to_kube_proxy_configuration()).unwrap();
        let file = std::env::temp_dir().join(format!("vipr-written-{}.yaml", std::process::id()));
        std::fs::write(&file, &written).unwrap();
        let read = settings(&[&format!("--config={}", file.display())]);
        let _ = std::fs::remove_file(&file);
        let mut read = read.unwrap_or_else(|error| panic!("{error:#}\n{written}"));
        assert!(read.ignored_config.is_empty(), "{:?}\n{written}", read.ignored_config);
        // Reported anew from the file: the same gates.
        read.ignored_flags = original.ignored_flags.clone();
        // Read from a file this time, which the agent would watch.
        assert_eq!(read.config_file.take(), Some(file));
        assert_eq!(read, original, "{written}");

        // nftables mode: its periods go to (and come back from) the file's nftables section.
        let original =
            settings(&["--proxy-mode=nftables", "--iptables-sync-period=45s", "--masquerade-all"]).unwrap();
        let written = serde_yaml::to_string(&original.to_kube_proxy_configuration()).unwrap();
        let file = std::env::temp_dir().join(format!("vipr-written-nftables-{}.yaml", std::process::id()));
        std::fs::write(&file, &written).unwrap();
        let read = settings(&[&format!("--config={}", file.display())]);
        let _ = std::fs::remove_file(&file);
        let read = read.unwrap_or_else(|error| panic!("{error:#}\n{written}"));
        assert!(read.ignored_config.is_empty(), "{:?}\n{written}", read.ignored_config);
        assert_eq!(
            (read.proxy_mode, read.sync_period, read.masquerade_all),
            (ProxyMode::Nftables, Duration::from_secs(45), true),
            "{written}"
        );

        for detection in [
            ["--detect-local-mode=BridgeInterface", "--pod-bridge-interface=cbr0"],
            ["--detect-local-mode=InterfaceNamePrefix", "--pod-interface-name-prefix=veth"],
        ] {
            let original = settings(&detection).unwrap();
            let written = serde_yaml::to_string(&original.to_kube_proxy_configuration()).unwrap();
            let file =
                std::env::temp_dir().join(format!("vipr-written-detector-{}.yaml", std::process::id()));
            std::fs::write(&file, &written).unwrap();
            let read = settings(&[&format!("--config={}", file.display())]);
            let _ = std::fs::remove_file(&file);
            let read = read.unwrap_or_else(|error| panic!("{error:#}\n{written}"));
            assert_eq!(read.local_detection, original.local_detection, "{written}");
            // Not ipvs mode: the ipvs section holds kube-proxy's defaults, nothing to ignore.
            assert!(read.ignored_config.is_empty(), "{:?}\n{written}", read.ignored_config);
        }
    }

    #[test]
    fn go_durations_format_as_go_prints_them() {
        for (duration, text) in [
            (Duration::ZERO, "0s"),
            (Duration::from_secs(30), "30s"),
            (Duration::from_secs(90), "1m30s"),
            (Duration::from_secs(86_400), "24h0m0s"),
            (Duration::from_secs(3600), "1h0m0s"),
            (Duration::from_millis(500), "500ms"),
            (Duration::from_millis(1500), "1.5s"),
            (Duration::from_micros(10), "10µs"),
            (Duration::from_nanos(7), "7ns"),
        ] {
            assert_eq!(format_go_duration(duration), text);
            assert_eq!(parse_go_duration(text), Ok(duration), "{text}");
        }
    }
}
