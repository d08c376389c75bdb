//! Starting a mode's dataplane and removing what any mode left behind: the one place that knows
//! all four dataplanes, so that the agent holds a `dyn Dataplane` and names none of them.
use std::path::PathBuf;

use anyhow::{bail, Context as _};
use ipnet::IpNet;
use tracing::warn;

use super::{
    ebpf::{record as ebpf_record, EbpfDataplane, EbpfOptions, HostTrafficOptions},
    iptables::{IptablesDataplane, IptablesOptions},
    ipvs::{IpvsDataplane, IpvsOptions},
    nftables::{NftablesDataplane, NftablesOptions},
    Dataplane, Mode,
};
use crate::host;

/// Every mode's options; [`start`] takes those of the mode it starts.
#[derive(Clone, Debug)]
pub struct StartOptions {
    /// The eBPF dataplane's; its `devices` are `--devices` as given (empty: every device of
    /// the node but loopback, listed at start).
    pub ebpf: EbpfOptions,
    pub host_traffic: HostTrafficOptions,
    /// The state directory, where the eBPF dataplane records what its maps should hold
    /// (`vipr inspect drift`).
    pub state_dir: PathBuf,
    pub iptables: IptablesOptions,
    pub ipvs: IpvsOptions,
    pub nftables: NftablesOptions,
}

/// Starts `mode`'s dataplane.
pub fn start(mode: Mode, options: &StartOptions) -> anyhow::Result<Box<dyn Dataplane>> {
    Ok(match mode {
        Mode::Ebpf => {
            let devices = host::devices(&options.ebpf.devices).context("cannot list network devices")?;
            if devices.is_empty() {
                bail!("no device to attach to: pass --devices=IF[,IF...]");
            }
            let mut ebpf = EbpfDataplane::start_with(
                &EbpfOptions { devices, ..options.ebpf.clone() },
                &options.host_traffic,
            )?;
            ebpf.record_desired_state(ebpf_record::path(&options.state_dir, &options.ebpf.bpf_root));
            Box::new(ebpf)
        }
        Mode::Iptables => Box::new(IptablesDataplane::start(&options.iptables)?),
        Mode::Ipvs => Box::new(IpvsDataplane::start(options.ipvs.clone())?),
        Mode::Nftables => Box::new(NftablesDataplane::start(&options.nftables)?),
    })
}

/// What removing the modes' state needs to know.
#[derive(Clone, Debug)]
pub struct Cleanup {
    pub bpf_root: PathBuf,
    /// `--devices` as given; empty: every device, where a clsact filter may be.
    pub devices: Vec<String>,
    pub state_dir: PathBuf,
    /// `--ipvs-exclude-cidrs`: IPVS services there are not vipr's (nor kube-proxy's).
    pub ipvs_exclude_cidrs: Vec<IpNet>,
    /// Leave kube-proxy's own chains, sets and IPVS services (an uninstall while kube-proxy is
    /// back and serving).
    pub keep_kube_proxy: bool,
}

/// `--cleanup`: removes every mode's state, so that switching modes (or from kube-proxy) leaves
/// nothing behind. Each mode is tried; the errors are reported together.
pub fn cleanup(what: &Cleanup) -> anyhow::Result<()> {
    // Without --devices, every interface: the uninstall DaemonSet passes none.
    let devices = host::devices(&what.devices).unwrap_or_else(|_| what.devices.clone());
    let ebpf = EbpfDataplane::cleanup(&what.bpf_root, &devices);
    // The record of what the removed maps should hold (`vipr inspect drift`).
    let _ = std::fs::remove_file(ebpf_record::path(&what.state_dir, &what.bpf_root));
    let (iptables, ipvs) = if what.keep_kube_proxy {
        (IptablesDataplane::cleanup_leftovers(), IpvsDataplane::cleanup_leftovers(&what.ipvs_exclude_cidrs))
    } else {
        (IptablesDataplane::cleanup(), IpvsDataplane::cleanup(&what.ipvs_exclude_cidrs))
    };
    let errors: Vec<String> = [ebpf, iptables, ipvs, NftablesDataplane::cleanup()]
        .into_iter()
        .filter_map(Result::err)
        .map(|error| format!("{error:#}"))
        .collect();
    if errors.is_empty() {
        Ok(())
    } else {
        Err(anyhow::anyhow!(errors.join("; ")))
    }
}

/// Removes what vipr left behind in another mode (a mode switch), before the first sync: the
/// old mode would otherwise keep intercepting beside the new one (eBPF programs run before
/// netfilter, IPVS services and iptables chains keep matching). Each mode's leftovers are
/// recognised as vipr's own: kube-proxy's chains, sets and IPVS services stay (only
/// `--cleanup` removes those). Failures are logged, not fatal: the new mode still runs.
pub fn clean_other_modes(active: Mode, what: &Cleanup) {
    for mode in Mode::ALL.into_iter().filter(|&mode| mode != active) {
        let result = match mode {
            Mode::Ebpf if !what.bpf_root.exists() => continue,
            Mode::Ebpf => EbpfDataplane::cleanup(&what.bpf_root, &what.devices),
            Mode::Iptables => IptablesDataplane::cleanup_leftovers(),
            Mode::Ipvs => IpvsDataplane::cleanup_leftovers(&what.ipvs_exclude_cidrs),
            Mode::Nftables => NftablesDataplane::cleanup(),
        };
        if let Err(error) = result {
            warn!("cannot remove what {mode} mode left behind: {error:#}");
        }
    }
}
