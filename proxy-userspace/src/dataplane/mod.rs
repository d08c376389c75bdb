//! Dataplanes: each turns a [`DesiredState`] into kernel state, behind one trait.
use std::{fmt, sync::Arc};

use crate::{
    metrics::Collector,
    model::{kubernetes::Rejection, DesiredState, StateChanges},
};

pub mod ebpf;
pub mod iptables;
pub mod ipvs;
mod lifecycle;
pub mod nftables;

pub use lifecycle::{clean_other_modes, cleanup, start, Cleanup, StartOptions};

/// Whether `interface` is one a dataplane creates to hold service addresses (ipvs mode's dummy
/// interface): its addresses are not the node's.
pub fn holds_service_addresses(interface: &str) -> bool {
    interface == ipvs::link::DUMMY_INTERFACE
}

/// What a sync did. Frontends a dataplane cannot express are skipped and reported, never
/// fatal.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct SyncReport {
    /// Frontends added, changed or removed in the kernel.
    pub changed: usize,
    /// Frontends left as they were because applying them failed; retried on the next sync.
    pub failed: Vec<String>,
    /// Frontends this dataplane does not support, with the reason.
    pub unsupported: Vec<String>,
    /// Objects refused as a whole (a Service that does not fit the eBPF maps), reported as the
    /// model's own rejections are; the rest of the state is applied, so they do not make the
    /// sync incomplete. Retried when the state changes.
    pub refused: Vec<Rejection>,
}

impl SyncReport {
    pub fn is_complete(&self) -> bool {
        self.failed.is_empty()
    }
}

impl fmt::Display for SyncReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} frontends changed", self.changed)?;
        if !self.failed.is_empty() {
            write!(f, ", {} failed", self.failed.len())?;
        }
        if !self.unsupported.is_empty() {
            write!(f, ", {} unsupported", self.unsupported.len())?;
        }
        if !self.refused.is_empty() {
            write!(f, ", {} objects refused", self.refused.len())?;
        }
        Ok(())
    }
}

/// The dataplane an agent runs: `--proxy-mode` once `auto` is decided. A value of a command
/// line too (the conformance runner's `--mode`), named as `--proxy-mode` names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, clap::ValueEnum)]
pub enum Mode {
    /// BPF maps and TC/XDP/socket programs, vipr's own datapath.
    Ebpf,
    /// iptables rules, as kube-proxy's iptables mode.
    Iptables,
    /// IPVS virtual servers, as kube-proxy's ipvs mode.
    Ipvs,
    /// An nftables table of vipr's own, as kube-proxy's nftables mode.
    Nftables,
}

impl Mode {
    pub const ALL: [Mode; 4] = [Mode::Ebpf, Mode::Iptables, Mode::Ipvs, Mode::Nftables];

    /// The `--proxy-mode` value that names this mode.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Ebpf => "ebpf",
            Mode::Iptables => "iptables",
            Mode::Ipvs => "ipvs",
            Mode::Nftables => "nftables",
        }
    }

    /// Whether the mode's connections are tracked by the kernel's netfilter conntrack, so that
    /// kube-proxy's conntrack settings apply (the eBPF datapath tracks its own).
    pub fn uses_netfilter_conntrack(self) -> bool {
        self != Mode::Ebpf
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What every mode does: program the desired state and report on it. Nothing here has a
/// do-nothing default, so a new mode states each of these, and what only some modes do is
/// asked for by type ([`Dataplane::device_server`]), not ignored by a default.
pub trait Dataplane {
    /// The mode this dataplane implements.
    fn mode(&self) -> Mode;

    /// Makes the kernel implement `state`, touching only what differs from what it implements
    /// now. A dataplane that last synced the generation `changes.since` completely may look at
    /// the changes alone; any other compares it all. An error means nothing could be applied;
    /// partial failures are in the report.
    fn sync_changes(&mut self, state: &DesiredState, changes: &StateChanges) -> anyhow::Result<SyncReport>;

    /// [`Self::sync_changes`] with nothing known of what changed: the whole state is compared.
    fn sync(&mut self, state: &DesiredState) -> anyhow::Result<SyncReport> {
        self.sync_changes(state, &StateChanges::default())
    }

    /// What the dataplane reports on `/metrics` besides the agent's own metrics (the eBPF
    /// dataplane's per-service and per-backend counters); empty for a mode that has none.
    fn collectors(&self) -> Vec<Arc<dyn Collector>>;

    /// The part that attaches to the node's network devices, for a mode that does (the eBPF
    /// programs); `None` for one that works in the kernel's stack and needs no devices.
    fn device_server(&mut self) -> Option<&mut dyn ServesDevices>;
}

/// A dataplane that attaches to the node's network devices.
pub trait ServesDevices {
    /// The node's devices changed (a pod's veth came or went): serve exactly `devices` from
    /// now on.
    fn serve_devices(&mut self, devices: &[String]) -> anyhow::Result<()>;
}
