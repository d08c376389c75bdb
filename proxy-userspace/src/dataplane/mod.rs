//! Dataplanes: each turns a [`DesiredState`] into kernel state, behind one trait.
use std::fmt;

use crate::model::{kubernetes::Rejection, DesiredState, StateChanges};

pub mod ebpf;
pub mod iptables;
pub mod ipvs;
pub mod nftables;

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

pub trait Dataplane {
    /// The `--proxy-mode` name of this dataplane.
    fn mode(&self) -> &'static str;

    /// Makes the kernel implement `state`, touching only what differs from what it
    /// implements now. An error means nothing could be applied; partial failures are in the
    /// report.
    fn sync(&mut self, state: &DesiredState) -> anyhow::Result<SyncReport>;

    /// [`Self::sync`] of a state that differs from an earlier one by `changes`. A dataplane
    /// that last synced the generation `changes.since` completely may apply only the changes;
    /// any other, and every dataplane that does not track generations, compares it all.
    fn sync_changes(&mut self, state: &DesiredState, changes: &StateChanges) -> anyhow::Result<SyncReport> {
        let _ = changes;
        self.sync(state)
    }

    /// The node's interfaces changed (a pod's veth came or went): serve exactly `devices`
    /// from now on. Dataplanes that do not attach to devices ignore it.
    fn serve_devices(&mut self, _devices: &[String]) -> anyhow::Result<()> {
        Ok(())
    }

    /// What the dataplane reports on `/metrics` besides the agent's own metrics (the eBPF
    /// dataplane's per-service and per-backend counters).
    fn collectors(&self) -> Vec<std::sync::Arc<dyn crate::metrics::Collector>> {
        Vec::new()
    }
}
