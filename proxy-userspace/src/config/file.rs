//! kube-proxy's `kubeproxy.config.k8s.io/v1alpha1` KubeProxyConfiguration, the fields vipr
//! reads and how the file names them; resolution over flags and defaults is `crate::settings`'s.
use std::{
    collections::BTreeSet,
    fmt,
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{bail, Context as _};
use clap::ValueEnum as _;
use serde::Deserialize;

use super::{parse_go_duration, ProxyMode, DEFAULT_API_BURST, DEFAULT_API_CONTENT_TYPE, DEFAULT_API_QPS};

/// The only KubeProxyConfiguration version vipr reads.
pub const CONFIG_API_VERSION: &str = "kubeproxy.config.k8s.io/v1alpha1";
pub const CONFIG_KIND: &str = "KubeProxyConfiguration";

/// The settings vipr reads from a KubeProxyConfiguration, as kube-proxy's v1alpha1 spells
/// them. Everything is optional: an absent field keeps kube-proxy's default.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct KubeProxyConfiguration {
    #[serde(default)]
    pub client_connection: ClientConnection,
    pub bind_address: Option<String>,
    pub hostname_override: Option<String>,
    pub oom_score_adj: Option<i32>,
    pub detect_local_mode: Option<String>,
    #[serde(default)]
    pub detect_local: DetectLocal,
    pub feature_gates: Option<std::collections::BTreeMap<String, bool>>,
    pub healthz_bind_address: Option<String>,
    pub metrics_bind_address: Option<String>,
    pub mode: Option<String>,
    #[serde(default)]
    pub iptables: ModeSettings,
    #[serde(default)]
    pub ipvs: IpvsSection,
    #[serde(default)]
    pub nftables: ModeSettings,
    #[serde(rename = "clusterCIDR")]
    pub cluster_cidr: Option<String>,
    pub node_port_addresses: Option<Vec<String>>,
    #[serde(default)]
    pub logging: Logging,
    #[serde(default)]
    pub conntrack: ConntrackSection,
    /// The file it came from, for error messages.
    #[serde(skip)]
    pub path: Option<PathBuf>,
    /// Non-zero settings of the file that vipr does not use, as dotted paths.
    #[serde(skip)]
    pub ignored: Vec<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClientConnection {
    pub kubeconfig: Option<String>,
}

/// The `detectLocal` section: the interface detectors' parameters.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DetectLocal {
    pub bridge_interface: Option<String>,
    pub interface_name_prefix: Option<String>,
}

/// v1alpha1 keeps the sync periods and masquerading under the section of each proxy mode.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ModeSettings {
    pub sync_period: Option<String>,
    pub min_sync_period: Option<String>,
    pub masquerade_all: Option<bool>,
    /// `iptables.localhostNodePorts` (read from the `iptables` section only).
    pub localhost_node_ports: Option<bool>,
}

/// The `ipvs` section: the mode's periods, and kube-proxy's IPVS settings.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct IpvsSection {
    #[serde(flatten)]
    pub mode: ModeSettings,
    pub scheduler: Option<String>,
    #[serde(rename = "excludeCIDRs")]
    pub exclude_cidrs: Option<Vec<String>>,
    #[serde(rename = "strictARP")]
    pub strict_arp: Option<bool>,
    pub tcp_timeout: Option<String>,
    pub tcp_fin_timeout: Option<String>,
    pub udp_timeout: Option<String>,
}

/// The `conntrack` section: the timeouts vipr's connection tracking applies, and the
/// kernel's conntrack settings of the iptables and ipvs modes.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ConntrackSection {
    pub max_per_core: Option<i32>,
    pub min: Option<i32>,
    pub tcp_be_liberal: Option<bool>,
    pub tcp_established_timeout: Option<String>,
    pub tcp_close_wait_timeout: Option<String>,
    pub udp_timeout: Option<String>,
    pub udp_stream_timeout: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
pub struct Logging {
    pub verbosity: Option<u32>,
    pub format: Option<String>,
}

/// A mode section and its field name in the file.
pub(crate) struct ModeSection<'a> {
    pub(crate) name: &'static str,
    pub(crate) sync_period: &'a Option<String>,
    pub(crate) min_sync_period: &'a Option<String>,
    pub(crate) masquerade_all: Option<bool>,
}

impl KubeProxyConfiguration {
    /// Reads and parses a KubeProxyConfiguration file.
    pub fn load(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("--config: cannot read {}", path.display()))?;
        let mut config = Self::parse(&text).with_context(|| format!("--config: {}", path.display()))?;
        config.path = Some(path.to_owned());
        Ok(config)
    }

    /// Parses a KubeProxyConfiguration document (YAML or JSON).
    pub fn parse(text: &str) -> anyhow::Result<Self> {
        let value: serde_yaml::Value = serde_yaml::from_str(text)?;
        let field = |name: &str| value.get(name).and_then(serde_yaml::Value::as_str).unwrap_or_default();
        if field("apiVersion") != CONFIG_API_VERSION || field("kind") != CONFIG_KIND {
            bail!(
                "not a {CONFIG_KIND} of {CONFIG_API_VERSION} (apiVersion {:?}, kind {:?})",
                field("apiVersion"),
                field("kind")
            );
        }
        let config: Self = serde_yaml::from_value(value.clone())?;
        let mut config = config;
        let used = config.used_fields();
        let mut ignored = Vec::new();
        non_zero_leaves(&value, "", &mut ignored);
        // Feature gates are named with the flags' (`Settings::ignored_flags`), and a field
        // holding kube-proxy's default asks for nothing vipr would have to do.
        ignored.retain(|path| {
            !used.contains(path.as_str())
                && !path.starts_with("featureGates.")
                && !holds_kube_proxy_default(&value, path)
        });
        config.ignored = ignored;
        Ok(config)
    }

    /// An error in the value of `field`, naming the file.
    pub(crate) fn invalid(&self, field: &str, error: impl fmt::Display) -> anyhow::Error {
        match &self.path {
            Some(path) => anyhow::anyhow!("--config {}: {field}: {error}", path.display()),
            None => anyhow::anyhow!("--config: {field}: {error}"),
        }
    }

    /// The file's `mode`, meaning what it means to kube-proxy where vipr has the mode: empty
    /// or absent is kube-proxy's default on Linux, iptables; vipr's own `ebpf` and `auto`
    /// are accepted too (`--proxy-mode` wins over the file, so the DaemonSet's flag decides
    /// when a kube-proxy ConfigMap is reused).
    pub fn proxy_mode(&self) -> anyhow::Result<ProxyMode> {
        match self.mode.as_deref().map(str::trim) {
            None | Some("") => Ok(ProxyMode::Iptables),
            Some(name) => ProxyMode::from_str(name, true).map_err(|_| {
                let known: Vec<_> = ProxyMode::value_variants()
                    .iter()
                    .filter_map(|mode| mode.to_possible_value())
                    .map(|value| value.get_name().to_owned())
                    .collect();
                self.invalid(
                    "mode",
                    format!("{name:?} is not a vipr proxy mode (vipr has {})", known.join(", ")),
                )
            }),
        }
    }

    /// The section whose periods and masquerading apply in `mode`, as kube-proxy's v1alpha1
    /// conversion picks it: ipvs and nftables have their own, every other mode reads
    /// `iptables` (ipvs mode masquerades by `iptables.masqueradeAll` too).
    pub(crate) fn mode_section(&self, mode: ProxyMode) -> ModeSection<'_> {
        match mode {
            ProxyMode::Ipvs => ModeSection {
                name: "ipvs",
                sync_period: &self.ipvs.mode.sync_period,
                min_sync_period: &self.ipvs.mode.min_sync_period,
                masquerade_all: self.iptables.masquerade_all,
            },
            ProxyMode::Nftables => ModeSection {
                name: "nftables",
                sync_period: &self.nftables.sync_period,
                min_sync_period: &self.nftables.min_sync_period,
                masquerade_all: self.nftables.masquerade_all,
            },
            ProxyMode::Auto | ProxyMode::Ebpf | ProxyMode::Iptables => ModeSection {
                name: "iptables",
                sync_period: &self.iptables.sync_period,
                min_sync_period: &self.iptables.min_sync_period,
                masquerade_all: self.iptables.masquerade_all,
            },
        }
    }

    /// The dotted paths of the fields vipr reads, given the file's mode.
    pub(crate) fn used_fields(&self) -> BTreeSet<String> {
        let mut used: BTreeSet<String> = [
            "apiVersion",
            "kind",
            "bindAddress",
            "clientConnection.kubeconfig",
            "hostnameOverride",
            "oomScoreAdj",
            "detectLocalMode",
            "detectLocal.bridgeInterface",
            "detectLocal.interfaceNamePrefix",
            "logging.format",
            "conntrack.maxPerCore",
            "conntrack.min",
            "conntrack.tcpBeLiberal",
            "healthzBindAddress",
            "metricsBindAddress",
            "mode",
            "clusterCIDR",
            "nodePortAddresses",
            "logging.verbosity",
            "conntrack.tcpEstablishedTimeout",
            "conntrack.tcpCloseWaitTimeout",
            "conntrack.udpTimeout",
            "conntrack.udpStreamTimeout",
        ]
        .into_iter()
        .map(str::to_owned)
        .collect();
        let mode = self.proxy_mode().unwrap_or(ProxyMode::Iptables);
        let section = self.mode_section(mode).name;
        used.extend(["syncPeriod", "minSyncPeriod"].map(|field| format!("{section}.{field}")));
        if mode == ProxyMode::Ipvs {
            used.extend(
                ["scheduler", "excludeCIDRs", "strictARP", "tcpTimeout", "tcpFinTimeout", "udpTimeout"]
                    .map(|field| format!("ipvs.{field}")),
            );
        }
        used.insert("iptables.masqueradeAll".to_owned());
        used.insert("iptables.localhostNodePorts".to_owned());
        if mode == ProxyMode::Nftables {
            used.insert("nftables.masqueradeAll".to_owned());
        }
        used
    }
}

/// Whether the field at the dotted `path` of `value` holds kube-proxy's v1alpha1 default,
/// for the fields vipr does not use whose default is not a zero value (kube-proxy's own
/// `--write-config-to` writes them so).
fn holds_kube_proxy_default(value: &serde_yaml::Value, path: &str) -> bool {
    let leaf = path.split('.').try_fold(value, |value, key| value.get(key));
    let Some(leaf) = leaf else { return false };
    let number = leaf.as_f64();
    let text = leaf.as_str();
    match path {
        "clientConnection.qps" => number == Some(f64::from(DEFAULT_API_QPS)),
        "clientConnection.burst" => number == Some(f64::from(DEFAULT_API_BURST)),
        "clientConnection.contentType" => text == Some(DEFAULT_API_CONTENT_TYPE),
        "iptables.masqueradeBit" | "nftables.masqueradeBit" => number == Some(14.0),
        "configSyncPeriod" => {
            text.and_then(|text| parse_go_duration(text).ok()) == Some(Duration::from_secs(900))
        }
        _ => false,
    }
}

/// Collects the dotted paths of the leaves of `value` that are not zero values (null, false,
/// 0, "", "0s", empty lists and maps): the settings a file actually sets.
fn non_zero_leaves(value: &serde_yaml::Value, path: &str, out: &mut Vec<String>) {
    use serde_yaml::Value;
    match value {
        Value::Mapping(mapping) => {
            for (key, child) in mapping {
                let key = key.as_str().map(str::to_owned).unwrap_or_else(|| format!("{key:?}"));
                let child_path = if path.is_empty() { key } else { format!("{path}.{key}") };
                non_zero_leaves(child, &child_path, out);
            }
        }
        Value::Null => {}
        Value::Bool(set) => {
            if *set {
                out.push(path.to_owned());
            }
        }
        Value::Number(number) => {
            if number.as_f64() != Some(0.0) {
                out.push(path.to_owned());
            }
        }
        Value::String(text) => {
            if !text.is_empty() && parse_go_duration(text) != Ok(Duration::ZERO) {
                out.push(path.to_owned());
            }
        }
        Value::Sequence(items) => {
            if !items.is_empty() {
                out.push(path.to_owned());
            }
        }
        Value::Tagged(tagged) => non_zero_leaves(&tagged.value, path, out),
    }
}
