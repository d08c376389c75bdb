//! Command-line flags. Names and defaults follow kube-proxy's wherever kube-proxy has the
//! same notion, so that an operator can swap vipr in without relearning them.
use std::path::PathBuf;

use clap::{Parser, ValueEnum};

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

#[derive(Debug, Parser)]
#[command(name = "vipr", version, about = "eBPF Kubernetes service proxy, a drop-in kube-proxy replacement")]
pub struct Args {
    /// Which dataplane programs the services.
    #[arg(long, value_enum, default_value = "auto")]
    pub proxy_mode: ProxyMode,

    /// Standalone mode: read v1 Services and discovery.k8s.io/v1 EndpointSlices from this
    /// file of manifests (multi-document YAML or JSON) instead of the API server, and re-read
    /// it whenever it changes.
    #[arg(long, value_name = "PATH")]
    pub services_file: Option<PathBuf>,

    /// The name of this node, which decides which endpoints are local. Defaults to the host
    /// name.
    #[arg(long, alias = "hostname-override", value_name = "NAME")]
    pub node_name: Option<String>,

    /// Interfaces whose ingress traffic is load balanced (comma-separated). Defaults to every
    /// interface but loopback.
    #[arg(long, value_delimiter = ',', value_name = "IF[,IF...]")]
    pub devices: Vec<String>,

    /// Where the bpffs is mounted; vipr pins its programs and maps under DIR/vipr/ and mounts
    /// a bpffs at DIR when there is none.
    #[arg(long, value_name = "DIR", default_value = "/sys/fs/bpf")]
    pub bpf_root: PathBuf,

    /// Remove everything vipr installed (programs, links, pinned maps under --bpf-root) and
    /// exit.
    #[arg(long)]
    pub cleanup: bool,

    /// More log output (-v: debug, -vv: trace). RUST_LOG overrides it.
    #[arg(short, action = clap::ArgAction::Count)]
    pub verbose: u8,
}

impl Args {
    pub fn node_name(&self) -> String {
        self.node_name.clone().unwrap_or_else(|| {
            std::fs::read_to_string("/proc/sys/kernel/hostname")
                .map(|name| name.trim().to_lowercase())
                .unwrap_or_default()
        })
    }

    /// The devices to serve: the listed ones, or every interface of this network namespace
    /// but loopback.
    pub fn devices(&self) -> std::io::Result<Vec<String>> {
        if !self.devices.is_empty() {
            return Ok(self.devices.iter().map(|d| d.trim().to_owned()).filter(|d| !d.is_empty()).collect());
        }
        // if_nameindex asks the kernel about the current namespace; /sys/class/net would show
        // the namespace sysfs was mounted in, which differs after setns().
        let list = unsafe { libc::if_nameindex() };
        if list.is_null() {
            return Err(std::io::Error::last_os_error());
        }
        let mut devices = Vec::new();
        let mut entry = list;
        // SAFETY: the list ends with an entry whose index is 0 and every name is a C string.
        unsafe {
            while (*entry).if_index != 0 {
                let name = std::ffi::CStr::from_ptr((*entry).if_name).to_string_lossy().into_owned();
                if name != "lo" {
                    devices.push(name);
                }
                entry = entry.add(1);
            }
            libc::if_freenameindex(list);
        }
        devices.sort();
        Ok(devices)
    }
}
