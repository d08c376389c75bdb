//! The agent loop: objects from a source -> desired state -> one dataplane.
use std::{
    sync::{
        atomic::{AtomicBool, Ordering},
        mpsc, Arc,
    },
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _};
use tracing::{error, info, warn};

use crate::{
    cli::{Args, ProxyMode},
    dataplane::{
        ebpf::{EbpfDataplane, EbpfOptions},
        Dataplane,
    },
    model::{
        kubernetes::{desired_state, NodeContext},
        DesiredState,
    },
    source::{file, SourceEvent},
};

/// How often the manifest file is checked for changes.
const FILE_POLL_INTERVAL: Duration = Duration::from_millis(200);
/// How often the loop wakes to notice signals and retry failed syncs.
const TICK: Duration = Duration::from_millis(100);
const RETRY_MIN: Duration = Duration::from_millis(500);
const RETRY_MAX: Duration = Duration::from_secs(30);

pub fn run(args: &Args) -> anyhow::Result<()> {
    if args.cleanup {
        return EbpfDataplane::cleanup(&args.bpf_root, &args.devices);
    }
    match args.proxy_mode {
        ProxyMode::Ebpf => {}
        ProxyMode::Auto => info!("proxy mode auto: choosing ebpf, the only dataplane in this build"),
        other => bail!("--proxy-mode={other:?} is not implemented yet; use --proxy-mode=ebpf"),
    }
    let Some(services_file) = args.services_file.clone() else {
        bail!(
            "no source of services: pass --services-file=PATH (the API server source is not implemented yet)"
        );
    };
    let devices = args.devices().context("cannot list network devices")?;
    if devices.is_empty() {
        bail!("no device to attach to: pass --devices=IF[,IF...]");
    }
    let node = NodeContext { name: args.node_name() };
    let mut dataplane = EbpfDataplane::start(&EbpfOptions { bpf_root: args.bpf_root.clone(), devices })?;

    let terminate = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        signal_hook::flag::register(signal, terminate.clone()).context("cannot install signal handlers")?;
    }
    let (events_tx, events) = mpsc::channel();
    let (stop_watcher, stop) = mpsc::channel();
    let watcher = std::thread::spawn(move || file::watch(services_file, FILE_POLL_INTERVAL, events_tx, stop));

    info!(node = node.name, mode = dataplane.mode(), "vipr running");
    let mut syncer = Syncer::default();
    while !terminate.load(Ordering::Relaxed) {
        match events.recv_timeout(TICK) {
            Ok(SourceEvent::Objects(objects)) => {
                let translation = desired_state(&objects.services, &objects.slices, &node);
                for rejection in objects.rejected.iter().chain(&translation.rejected) {
                    warn!("skipping {rejection}");
                }
                syncer.want(translation.state);
            }
            Ok(SourceEvent::Unusable(reason)) => error!("{reason}; keeping the running datapath"),
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => bail!("the services file watcher stopped"),
        }
        syncer.sync_if_due(&mut dataplane);
    }
    drop(stop_watcher);
    let _ = watcher.join();
    info!("stopping; the datapath stays in place and keeps serving (vipr --cleanup removes it)");
    Ok(())
}

/// Applies the latest desired state, retrying with backoff while the dataplane reports
/// failures. A newer state replaces an unapplied one: only the latest matters.
#[derive(Default)]
struct Syncer {
    pending: Option<DesiredState>,
    retry_at: Option<Instant>,
    backoff: Duration,
}

impl Syncer {
    fn want(&mut self, state: DesiredState) {
        self.pending = Some(state);
        self.retry_at = None;
    }

    fn sync_if_due(&mut self, dataplane: &mut dyn Dataplane) {
        let Some(state) = &self.pending else { return };
        if self.retry_at.is_some_and(|at| Instant::now() < at) {
            return;
        }
        let started = Instant::now();
        let complete = match dataplane.sync(state) {
            Ok(report) => {
                for frontend in &report.unsupported {
                    warn!("not programmed: {frontend}");
                }
                info!(
                    frontends = state.frontends.len(),
                    backends = state.backend_count(),
                    took_ms = started.elapsed().as_millis() as u64,
                    "synced: {report}"
                );
                report.is_complete()
            }
            Err(error) => {
                error!("sync failed: {error:#}");
                false
            }
        };
        if complete {
            self.pending = None;
            self.retry_at = None;
            self.backoff = Duration::ZERO;
        } else {
            self.backoff = (self.backoff * 2).clamp(RETRY_MIN, RETRY_MAX);
            warn!(retry_in_ms = self.backoff.as_millis() as u64, "sync incomplete; will retry");
            self.retry_at = Some(Instant::now() + self.backoff);
        }
    }
}
