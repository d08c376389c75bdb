//! The values of vipr's settings as the command line and the KubeProxyConfiguration file spell
//! them, with kube-proxy's defaults: what both front ends (`cli` and the file, [`file`]) parse
//! into, and what settings resolution (`crate::settings`) combines. Nothing here reads either
//! front end.
use std::{
    fmt,
    net::{IpAddr, Ipv4Addr, SocketAddr},
    str::FromStr,
    time::Duration,
};

use clap::ValueEnum;
use ipnet::IpNet;

use crate::dataplane::Mode;

pub mod file;

pub use file::{KubeProxyConfiguration, CONFIG_API_VERSION, CONFIG_KIND};

/// kube-proxy's `--healthz-bind-address` default.
pub const DEFAULT_HEALTHZ_BIND_ADDRESS: SocketAddr =
    SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 10256);
/// kube-proxy's `--metrics-bind-address` default.
pub const DEFAULT_METRICS_BIND_ADDRESS: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 10249);
/// kube-proxy's health server default when `bindAddress` is IPv6.
pub const DEFAULT_HEALTHZ_BIND_ADDRESS_V6: SocketAddr =
    SocketAddr::new(IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED), 10256);
/// kube-proxy's metrics server default when `bindAddress` is IPv6.
pub const DEFAULT_METRICS_BIND_ADDRESS_V6: SocketAddr =
    SocketAddr::new(IpAddr::V6(std::net::Ipv6Addr::LOCALHOST), 10249);
/// kube-proxy's sync period default, in every mode.
pub const DEFAULT_SYNC_PERIOD: Duration = Duration::from_secs(30);
/// kube-proxy's minimum sync period default in iptables and nftables modes (ipvs mode's is 0).
pub const DEFAULT_MIN_SYNC_PERIOD: Duration = Duration::from_secs(1);
/// vipr's minimum sync period default in ebpf mode, a mode kube-proxy does not have. kube-proxy's
/// 1 s bounds the cost of rewriting whole rulesets; an eBPF sync costs what changed (about a
/// millisecond for an EndpointSlice at 10k services), so a short period keeps the programming
/// latency of a busy cluster in milliseconds and still batches a burst of changes into a
/// few syncs (docs/benchmarks.md, issue 13). An explicit period is honoured as given.
pub const EBPF_DEFAULT_MIN_SYNC_PERIOD: Duration = Duration::from_millis(EBPF_DEFAULT_MIN_SYNC_MS);
const EBPF_DEFAULT_MIN_SYNC_MS: u64 = 20;
/// kube-proxy's `--oom-score-adj` default (the kubelet's `KubeProxyOOMScoreAdj`).
pub const DEFAULT_OOM_SCORE_ADJ: i32 = -999;
/// kube-proxy's `--kube-api-qps`, `--kube-api-burst` and `--kube-api-content-type` defaults.
pub const DEFAULT_API_QPS: f32 = 5.0;
pub const DEFAULT_API_BURST: i32 = 10;
pub const DEFAULT_API_CONTENT_TYPE: &str = "application/vnd.kubernetes.protobuf";

/// `--lb-algorithm`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum LbAlgorithm {
    #[default]
    Random,
    Maglev,
}

/// `--detect-local-mode` (the file's `detectLocalMode`): how traffic from this node's pods is
/// told from other traffic. The names are kube-proxy's.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DetectLocalMode {
    /// Sources inside `--cluster-cidr` are pods (kube-proxy's default).
    #[value(name = "ClusterCIDR")]
    ClusterCidr,
    /// Sources inside the Node object's `spec.podCIDRs` are pods.
    #[value(name = "NodeCIDR")]
    NodeCidr,
    /// Packets arriving from `--pod-bridge-interface` are from pods.
    #[value(name = "BridgeInterface")]
    BridgeInterface,
    /// Packets arriving from interfaces named `--pod-interface-name-prefix`* are from pods.
    #[value(name = "InterfaceNamePrefix")]
    InterfaceNamePrefix,
}

/// `--logging-format` (the file's `logging.format`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum LoggingFormat {
    /// Human-readable lines (kube-proxy's default).
    #[default]
    Text,
    /// One JSON object per line.
    Json,
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
    /// An nftables table of vipr's own, as kube-proxy's nftables mode.
    Nftables,
}

impl ProxyMode {
    /// The `--proxy-mode` spelling (what `/proxyMode` answers for the running mode).
    pub fn name(self) -> &'static str {
        match self.fixed() {
            Some(mode) => mode.name(),
            None => "auto",
        }
    }

    /// The mode asked for; `None` for auto, which is decided at start.
    pub fn fixed(self) -> Option<Mode> {
        match self {
            ProxyMode::Auto => None,
            ProxyMode::Ebpf => Some(Mode::Ebpf),
            ProxyMode::Iptables => Some(Mode::Iptables),
            ProxyMode::Ipvs => Some(Mode::Ipvs),
            ProxyMode::Nftables => Some(Mode::Nftables),
        }
    }
}

/// One entry of `--nodeport-addresses`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodePortAddress {
    /// Node addresses inside this range.
    Cidr(IpNet),
    /// `primary`: the Node object's primary address of each family.
    Primary,
    /// `localhost`: 127.0.0.0/8 and ::1.
    Localhost,
    /// `all`: every node address.
    All,
}

impl FromStr for NodePortAddress {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text.trim() {
            "primary" => Ok(Self::Primary),
            "localhost" => Ok(Self::Localhost),
            "all" => Ok(Self::All),
            cidr => cidr.parse().map(Self::Cidr).map_err(|_| {
                format!("{cidr:?} is neither a CIDR (such as 10.0.0.0/8) nor one of primary, localhost, all")
            }),
        }
    }
}

/// How much vipr logs. kube-proxy's klog verbosity (`--v=N`) and vipr's `-v`/`-vv` map onto
/// it; `RUST_LOG` overrides it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum LogLevel {
    Info,
    Debug,
    Trace,
}

impl LogLevel {
    /// klog levels 0-2 are what kube-proxy logs in steady state (vipr's info), 3-4 its
    /// per-change detail (debug), 5 and more its per-object detail (trace).
    pub fn from_klog_verbosity(verbosity: u32) -> Self {
        match verbosity {
            0..=2 => Self::Info,
            3..=4 => Self::Debug,
            _ => Self::Trace,
        }
    }

    /// vipr's own `-v` count.
    pub fn from_verbose_count(count: u8) -> Self {
        match count {
            0 => Self::Info,
            1 => Self::Debug,
            _ => Self::Trace,
        }
    }

    /// The `tracing` filter directive.
    pub fn directive(self) -> &'static str {
        match self {
            Self::Info => "info",
            Self::Debug => "debug",
            Self::Trace => "trace",
        }
    }
}

impl fmt::Display for NodePortAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Cidr(cidr) => write!(f, "{cidr}"),
            Self::Primary => f.write_str("primary"),
            Self::Localhost => f.write_str("localhost"),
            Self::All => f.write_str("all"),
        }
    }
}

/// `--feature-gates` / `featureGates`: gate name → enabled.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FeatureGates(pub std::collections::BTreeMap<String, bool>);

/// kube-proxy feature gates whose setting changes what vipr does. None yet: vipr behaves as
/// kube-proxy 1.35 with its default gates, and no gate switches that behaviour.
pub const HONOURED_FEATURE_GATES: &[&str] = &[];

impl FeatureGates {
    /// The gates given that vipr does not follow.
    pub fn ignored(&self) -> impl Iterator<Item = (&str, bool)> {
        self.0
            .iter()
            .filter(|(name, _)| !HONOURED_FEATURE_GATES.contains(&name.as_str()))
            .map(|(name, enabled)| (name.as_str(), *enabled))
    }
}

/// Parses `--feature-gates`: comma-separated `Name=true|false` pairs, as kube-proxy's.
pub fn parse_feature_gates(text: &str) -> Result<FeatureGates, String> {
    let mut gates = std::collections::BTreeMap::new();
    for pair in text.split(',').map(str::trim).filter(|pair| !pair.is_empty()) {
        let (name, value) =
            pair.split_once('=').ok_or_else(|| format!("missing bool value for {pair:?} (use Name=true)"))?;
        let enabled = parse_go_bool(value.trim())
            .ok_or_else(|| format!("invalid value of {}: {value:?}, it must be a bool", name.trim()))?;
        gates.insert(name.trim().to_owned(), enabled);
    }
    Ok(FeatureGates(gates))
}

/// Go's `strconv.ParseBool`.
fn parse_go_bool(text: &str) -> Option<bool> {
    match text {
        "1" | "t" | "T" | "true" | "TRUE" | "True" => Some(true),
        "0" | "f" | "F" | "false" | "FALSE" | "False" => Some(false),
        _ => None,
    }
}

/// `--cluster-cidr`, `--service-cluster-ip-range`: one CIDR, or a comma-separated dual-stack
/// pair.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CidrPair(pub Vec<IpNet>);

impl FromStr for CidrPair {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let cidrs = text
            .split(',')
            .map(str::trim)
            .filter(|cidr| !cidr.is_empty())
            .map(|cidr| {
                cidr.parse::<IpNet>().map_err(|_| format!("{cidr:?} is not a CIDR (such as 10.244.0.0/16)"))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let dual_stack_pair = |a: &IpNet, b: &IpNet| {
            matches!((a, b), (IpNet::V4(_), IpNet::V6(_)) | (IpNet::V6(_), IpNet::V4(_)))
        };
        match cidrs.as_slice() {
            [] | [_] => Ok(Self(cidrs)),
            [a, b] if dual_stack_pair(a, b) => Ok(Self(cidrs)),
            _ => Err("only one CIDR, or one IPv4 and one IPv6 CIDR, is allowed".to_owned()),
        }
    }
}

/// `--healthz-bind-address` / `--metrics-bind-address`: `IP:port`, a bare IP (default port),
/// or empty to disable the server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BindAddress(pub Option<SocketAddr>);

impl BindAddress {
    pub fn parser(
        default_port: u16,
    ) -> impl Fn(&str) -> Result<Self, String> + Clone + Send + Sync + 'static {
        move |text| parse_bind_address(text, default_port).map(Self)
    }
}

pub(crate) fn parse_bind_address(text: &str, default_port: u16) -> Result<Option<SocketAddr>, String> {
    let text = text.trim();
    if text.is_empty() {
        return Ok(None);
    }
    if let Ok(address) = text.parse::<SocketAddr>() {
        return Ok(Some(address));
    }
    let bare = text.strip_prefix('[').and_then(|rest| rest.strip_suffix(']')).unwrap_or(text);
    bare.parse::<IpAddr>()
        .map(|ip| Some(SocketAddr::new(ip, default_port)))
        .map_err(|_| format!("{text:?} is not IP:port (such as 0.0.0.0:{default_port}), an IP, or empty"))
}

/// An error in a Go duration string, worded as Go's `time.ParseDuration`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DurationError(String);

impl fmt::Display for DurationError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid duration {:?} (use a Go duration such as 1s, 500ms, 1m30s or 2h)", self.0)
    }
}

impl std::error::Error for DurationError {}

/// Parses a Go duration string (`time.ParseDuration`): a sequence of decimal numbers with
/// units ns, us (µs), ms, s, m, h, such as "300ms", "1.5h" or "2h45m"; "0" alone needs no
/// unit. Negative durations are refused: no period vipr takes can be negative.
pub fn parse_go_duration(text: &str) -> Result<Duration, DurationError> {
    let error = || DurationError(text.to_owned());
    let mut rest = text.strip_prefix('+').unwrap_or(text);
    if rest == "0" {
        return Ok(Duration::ZERO);
    }
    if rest.is_empty() {
        return Err(error());
    }
    let mut nanos: u128 = 0;
    while !rest.is_empty() {
        let number_len = rest.find(|c: char| !(c.is_ascii_digit() || c == '.')).ok_or_else(error)?;
        let (number, after) = rest.split_at(number_len);
        let unit_len = after.find(|c: char| c.is_ascii_digit() || c == '.').unwrap_or(after.len());
        let (unit, after) = after.split_at(unit_len);
        let unit_nanos: u128 = match unit {
            "ns" => 1,
            "us" | "µs" | "μs" => 1_000,
            "ms" => 1_000_000,
            "s" => 1_000_000_000,
            "m" => 60_000_000_000,
            "h" => 3_600_000_000_000,
            _ => return Err(error()),
        };
        let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
        if whole.is_empty() && fraction.is_empty() {
            return Err(error());
        }
        let whole: u128 = if whole.is_empty() { 0 } else { whole.parse().map_err(|_| error())? };
        let mut value = whole.checked_mul(unit_nanos).ok_or_else(error)?;
        // Digits beyond nanosecond precision cannot matter; Go drops them too.
        let mut scale = unit_nanos;
        for digit in fraction.chars().take(30) {
            scale /= 10;
            value += u128::from(digit.to_digit(10).ok_or_else(error)?) * scale;
        }
        nanos = nanos.checked_add(value).ok_or_else(error)?;
        rest = after;
    }
    let nanos = u64::try_from(nanos).map_err(|_| error())?;
    Ok(Duration::from_nanos(nanos))
}

/// Formats a duration as Go's `time.Duration.String()` does ("30s", "1m30s", "24h0m0s",
/// "500ms", "0s"), the way kube-proxy writes durations in a KubeProxyConfiguration.
pub fn format_go_duration(duration: Duration) -> String {
    let nanos = duration.as_nanos();
    let decimal = |value: u128, unit: u128| {
        let whole = value / unit;
        let fraction = value % unit;
        if fraction == 0 {
            whole.to_string()
        } else {
            let digits = unit.ilog10() as usize;
            let fraction = format!("{fraction:0digits$}");
            format!("{whole}.{}", fraction.trim_end_matches('0'))
        }
    };
    const SECOND: u128 = 1_000_000_000;
    match nanos {
        0 => "0s".to_owned(),
        1..1_000 => format!("{nanos}ns"),
        1_000..1_000_000 => format!("{}µs", decimal(nanos, 1_000)),
        1_000_000..SECOND => format!("{}ms", decimal(nanos, 1_000_000)),
        _ => {
            let hours = nanos / (3600 * SECOND);
            let minutes = nanos % (3600 * SECOND) / (60 * SECOND);
            let seconds = decimal(nanos % (60 * SECOND), SECOND);
            match (hours, minutes) {
                (0, 0) => format!("{seconds}s"),
                (0, _) => format!("{minutes}m{seconds}s"),
                _ => format!("{hours}h{minutes}m{seconds}s"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_fixed_proxy_mode_is_one_running_mode_of_the_same_name() {
        let mut running = Vec::new();
        for requested in ProxyMode::value_variants() {
            let value = requested.to_possible_value().unwrap();
            assert_eq!(requested.name(), value.get_name());
            match requested.fixed() {
                Some(mode) => {
                    assert_eq!(mode.name(), value.get_name());
                    running.push(mode);
                }
                None => assert_eq!(*requested, ProxyMode::Auto),
            }
        }
        running.sort();
        assert_eq!(running, Mode::ALL, "every running mode can be asked for by name");
    }
}
