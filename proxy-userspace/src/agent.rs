//! The agent loop: objects from a source -> desired state -> one dataplane, synced through a
//! bounded-frequency runner ([`runner`]) as kube-proxy's, with kube-proxy's health and metrics
//! servers beside it.
//!
//! The source's events go into one change tracker ([`ChangeTracker`]), which holds the objects
//! and marks the services a change makes stale. Each sync translates those services with the
//! node's current addresses (all of them when the node context changed, so the desired state
//! follows interface and Node changes too), and the dataplane is handed what changed. While
//! the source is unusable, the last good objects stay in force: periodic syncs re-apply them,
//! and nothing is removed.
use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, Ipv4Addr},
    path::PathBuf,
    sync::{
        atomic::{AtomicBool, Ordering},
        mpsc, Arc,
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _};
use ipnet::IpNet;
use k8s_openapi::api::core::v1::Node;
use tracing::{debug, error, info, warn};

use self::runner::{Outcome, SyncRunner};
use crate::{
    dataplane::{self, Dataplane, Mode, SyncReport},
    events::{reasons as event_reasons, ApiEvents, Event, EventSink, LogOnly, ObjectRef, Severity},
    health::{Moment, ProxyHealth, ServiceHealthServer},
    host,
    http::{HttpRuntime, Workload},
    metrics::{kube_proxy::NoLocalEndpoints, ProxyMetrics, Registry},
    model::{
        changes::{ChangeTracker, Changes},
        kubernetes::{
            self as kubernetes_model, incremental::Translator, NodeContext, NodeFacts, ProxySettings,
            Rejection,
        },
        PodInterfaces,
    },
    probe::{self, ProxyModeInfo},
    settings::{LocalDetection, Settings, SourceSettings},
    source::{
        file,
        kubernetes::{self, KubeSourceConfig},
        Ownership, SourceEvent,
    },
    status::{self, StatusPages},
    tuning,
};

mod links;
pub mod node;
pub mod runner;

/// How often the manifest file is checked for changes.
const FILE_POLL_INTERVAL: Duration = Duration::from_millis(200);
/// The longest the loop sleeps, so that it notices signals.
const TICK: Duration = Duration::from_millis(100);
/// How often the node's interfaces are listed (all of them, or those of --devices).
const DEVICE_POLL_INTERVAL: Duration = Duration::from_secs(1);

/// One kind of API object vipr's ServiceAccount needs access to, and how.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ApiAccess {
    /// The API group; "" is the core group.
    pub group: &'static str,
    /// The resource, plural.
    pub resource: &'static str,
    pub verbs: &'static [&'static str],
}

/// What the API-server source watches (the Services and EndpointSlices vipr owns, by label and
/// field selectors as kube-proxy's, this node's Node by a field selector, and ServiceCIDRs).
/// deploy/'s ClusterRole grants exactly this plus [`RECORDED_EVENTS`]; the deployment test
/// holds them together.
pub const WATCHED_RESOURCES: &[ApiAccess] = &[
    ApiAccess { group: "", resource: "services", verbs: &["list", "watch"] },
    ApiAccess { group: "discovery.k8s.io", resource: "endpointslices", verbs: &["list", "watch"] },
    ApiAccess { group: "", resource: "nodes", verbs: &["list", "watch"] },
    ApiAccess { group: "networking.k8s.io", resource: "servicecidrs", verbs: &["list", "watch"] },
];

/// Events vipr may record about the objects it serves (kube-runtime's recorder writes
/// events.k8s.io/v1 Events: create, then patch for repeats).
pub const RECORDED_EVENTS: &[ApiAccess] =
    &[ApiAccess { group: "events.k8s.io", resource: "events", verbs: &["create", "patch"] }];

pub fn run(settings: &Settings) -> anyhow::Result<()> {
    if let Some(path) = &settings.write_config_to {
        let yaml = serde_yaml::to_string(&settings.to_kube_proxy_configuration())
            .context("cannot encode the configuration")?;
        std::fs::write(path, yaml)
            .with_context(|| format!("--write-config-to: cannot write {}", path.display()))?;
        info!(file = %path.display(), "wrote the configuration");
        return Ok(());
    }
    if settings.cleanup {
        return dataplane::cleanup(&settings.cleanup_options());
    }
    info!(version = env!("CARGO_PKG_VERSION"), "vipr {} starting", env!("CARGO_PKG_VERSION"));
    log_settings(settings);
    let (mode, mode_reason) = running_mode(settings)?;
    // kube-proxy's one-time initialisation; the kernel's conntrack matters to the modes that
    // use it (the eBPF datapath tracks its connections itself).
    tuning::apply_at_start(
        settings.oom_score_adj,
        mode.uses_netfilter_conntrack().then_some(&settings.netfilter_conntrack),
    );
    if settings.init_only {
        info!("--init-only: initialisation done");
        return Ok(());
    }
    let mut dataplane = dataplane::start(mode, &settings.start_options(mode))?;
    dataplane::clean_other_modes(mode, &settings.cleanup_options());

    let metrics = Arc::new(ProxyMetrics::default());
    // Dataplane counters (per service, per backend) join here as further collectors.
    let registry = Arc::new(Registry::default());
    registry.register(metrics.clone());
    for collector in dataplane.collectors() {
        if settings.metrics_per_endpoint {
            registry.register(collector);
        } else {
            let prefix = crate::metrics::PER_ENDPOINT_PREFIX;
            registry.register(Arc::new(crate::metrics::WithoutFamilies { inner: collector, prefix }));
        }
    }
    registry.register(Arc::new(ProxyModeInfo { mode, requested: settings.proxy_mode }));
    registry.register(Arc::new(crate::metrics::process::ProcessMetrics));
    registry.register(Arc::new(crate::metrics::rest_client::RestClientCollector));
    let events = event_sink(settings, &registry);
    record_start(events.as_ref(), settings, mode, &mode_reason);
    let health = Arc::new(ProxyHealth::new(2 * settings.sync_period, metrics.clone()));
    // Every HTTP server of the agent (health, metrics, health-check node ports) on its threads.
    let http = HttpRuntime::start().context("cannot start the HTTP servers")?;
    registry.register(http.collector());
    if let Some(address) = settings.healthz_bind_address {
        http.serve_forever(address, "healthz", Workload::Probes, health.clone().handler());
    }
    if let Some(address) = settings.metrics_bind_address {
        let pages = StatusPages::new(settings, std::env::args());
        let handler = status::metrics_server(registry.clone(), pages, mode.name());
        http.serve_forever(address, "metrics", Workload::Scrapes, handler);
    }
    // As kube-proxy's sync loop: healthy from the start, even if no sync ever succeeds.
    health.updated(Moment::now());

    let terminate = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        signal_hook::flag::register(signal, terminate.clone()).context("cannot install signal handlers")?;
    }
    let (wakeups_tx, wakeups) = mpsc::channel();
    let (stop_source, stop) = mpsc::channel();
    let source = spawn_source(settings, forward_to(wakeups_tx.clone())?, stop)?;
    if let Some(path) = &settings.config_file {
        watch_config_file(path.clone(), wakeups_tx.clone())?;
    }
    // The devices to serve change when links come and go; only a dataplane that attaches to
    // them hears of it.
    let _links = dataplane
        .device_server()
        .is_some()
        .then(|| links::watch(links::sender(wakeups_tx, || Wakeup::Links)))
        .flatten();

    info!(
        node = settings.node_name,
        mode = mode.name(),
        min_sync_period = %crate::config::format_go_duration(settings.min_sync_period_in(mode)),
        "vipr running"
    );
    let mut agent = Agent::new(settings, mode, health, metrics, http, events);
    let mut devices_checked = Instant::now();
    while !terminate.load(Ordering::Relaxed) {
        let wait = agent.runner.time_until_due(Instant::now()).map_or(TICK, |until_due| until_due.min(TICK));
        let mut links_changed = false;
        let mut next = wakeups.recv_timeout(wait);
        // Every wakeup already queued is taken before a sync: a sync then applies all the
        // events that arrived during the previous one, instead of one event each.
        loop {
            match next {
                Ok(Wakeup::Source(event)) => match *event {
                    SourceEvent::Unusable(reason) => error!("{reason}; keeping the running datapath"),
                    event => agent.receive(event),
                },
                Ok(Wakeup::Links) => links_changed = true,
                Ok(Wakeup::ConfigChanged(path)) => {
                    // As kube-proxy: the container restarts and reads the new file; the datapath
                    // serves on meanwhile.
                    bail!(
                        "the configuration file {} changed; exiting to be restarted with it",
                        path.display()
                    )
                }
                Ok(Wakeup::SourceStopped) | Err(mpsc::RecvTimeoutError::Disconnected) => {
                    bail!("the source of services stopped")
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
            }
            next = match wakeups.try_recv() {
                Ok(wakeup) => Ok(wakeup),
                Err(mpsc::TryRecvError::Empty) => break,
                Err(mpsc::TryRecvError::Disconnected) => Err(mpsc::RecvTimeoutError::Disconnected),
            };
        }
        if agent.runner.is_due(Instant::now()) {
            agent.sync(dataplane.as_mut());
        }
        if let Some(device_server) = dataplane.device_server() {
            if links_changed || devices_checked.elapsed() >= DEVICE_POLL_INTERVAL {
                // New pods bring new veths; their traffic must be balanced from their first
                // packet. A listed device can be deleted and created again (a bond or VLAN
                // re-configured), and must then be attached again.
                devices_checked = Instant::now();
                match host::devices(&settings.devices) {
                    Ok(devices) => {
                        if let Err(error) = device_server.serve_devices(&devices) {
                            warn!("cannot follow the node's devices: {error:#}");
                        }
                    }
                    Err(error) => warn!("cannot list network devices: {error}"),
                }
            }
        }
    }
    drop(stop_source);
    let _ = source.join();
    info!("stopping; the datapath stays in place and keeps serving (vipr --cleanup removes it)");
    Ok(())
}

/// Where the agent's Kubernetes Events go: the API server vipr reads from, or nowhere with a
/// services file (the log says it all).
fn event_sink(settings: &Settings, registry: &Registry) -> Arc<dyn EventSink> {
    let SourceSettings::Kubernetes { kubeconfig } = &settings.source else {
        return Arc::new(LogOnly);
    };
    let config = KubeSourceConfig {
        kubeconfig: kubeconfig.clone(),
        node_name: settings.node_name.clone(),
        master: settings.api_client.master.clone(),
        ownership: ownership(settings),
    };
    match ApiEvents::start(config, settings.node_name.clone()) {
        Ok(events) => {
            registry.register(events.metrics());
            Arc::new(events)
        }
        Err(error) => {
            warn!("cannot start recording Kubernetes Events; logging only: {error:#}");
            Arc::new(LogOnly)
        }
    }
}

/// kube-proxy's "Starting" Event on this node, with vipr's version and mode, and the mode's
/// reason (`--proxy-mode=auto`'s probes) in an Event of its own.
fn record_start(events: &dyn EventSink, settings: &Settings, mode: Mode, mode_reason: &str) {
    let version = env!("CARGO_PKG_VERSION");
    let node = ObjectRef::node(&settings.node_name);
    events.record(Event {
        regarding: node.clone(),
        severity: Severity::Normal,
        reason: event_reasons::STARTING,
        action: "Start",
        note: format!("Starting vipr {version} in {mode} mode"),
    });
    events.record(Event {
        regarding: node,
        severity: Severity::Normal,
        reason: event_reasons::PROXY_MODE,
        action: "ChooseProxyMode",
        note: format!("--proxy-mode={}: {mode_reason}", settings.proxy_mode.name()),
    });
}

/// What wakes the agent's loop besides its timers.
enum Wakeup {
    /// Boxed: an event carries an object (a list, all of its kind), the other wakeups are words.
    Source(Box<SourceEvent>),
    /// The source thread ended: there will be no more objects.
    SourceStopped,
    /// A network interface appeared, changed or went away.
    Links,
    /// The `--config` file's content is not what vipr started with.
    ConfigChanged(PathBuf),
}

/// How often the `--config` file is read again.
const CONFIG_POLL_INTERVAL: Duration = Duration::from_secs(2);

/// Reads `path` every [`CONFIG_POLL_INTERVAL`] and sends [`Wakeup::ConfigChanged`] once its
/// content differs from what it was now. Content rather than a modification time: a ConfigMap
/// update replaces the mounted file by a symlink swap, which an mtime of the old link target
/// would not show. A file that cannot be read is no change (a swap in progress); one that reads
/// again with the same content is none either.
fn watch_config_file(path: PathBuf, wakeups: mpsc::Sender<Wakeup>) -> anyhow::Result<()> {
    let started_with = std::fs::read(&path).with_context(|| format!("cannot read {}", path.display()))?;
    std::thread::Builder::new()
        .name("config-file".to_owned())
        .spawn(move || loop {
            std::thread::sleep(CONFIG_POLL_INTERVAL);
            match std::fs::read(&path) {
                Ok(content) if content != started_with => {
                    let _ = wakeups.send(Wakeup::ConfigChanged(path));
                    return;
                }
                _ => {}
            }
        })
        .context("cannot start the config file watcher")?;
    Ok(())
}

/// A channel for the source's events, whose events are passed on to `wakeups` (and its end as
/// [`Wakeup::SourceStopped`]), so that the loop waits on one channel for everything.
fn forward_to(wakeups: mpsc::Sender<Wakeup>) -> anyhow::Result<mpsc::Sender<SourceEvent>> {
    let (events, received) = mpsc::channel();
    std::thread::Builder::new()
        .name("source-events".to_owned())
        .spawn(move || {
            for event in received {
                if wakeups.send(Wakeup::Source(Box::new(event))).is_err() {
                    return;
                }
            }
            let _ = wakeups.send(Wakeup::SourceStopped);
        })
        .context("cannot start the source events thread")?;
    Ok(events)
}

/// Starts the source thread: the manifests file when there is one, else the API server.
fn spawn_source(
    settings: &Settings,
    events: mpsc::Sender<SourceEvent>,
    stop: mpsc::Receiver<()>,
) -> anyhow::Result<JoinHandle<()>> {
    let thread = std::thread::Builder::new().name("source".to_owned());
    let spawned = match &settings.source {
        SourceSettings::File(path) => {
            let path = path.clone();
            let ownership = ownership(settings);
            thread.spawn(move || file::watch(path, &ownership, FILE_POLL_INTERVAL, events, stop))
        }
        SourceSettings::Kubernetes { kubeconfig } => {
            let config = KubeSourceConfig {
                kubeconfig: kubeconfig.clone(),
                node_name: settings.node_name.clone(),
                master: settings.api_client.master.clone(),
                ownership: ownership(settings),
            };
            thread.spawn(move || kubernetes::watch(config, events, stop))
        }
    };
    spawned.context("cannot start the source thread")
}

/// Which Services are vipr's: `--service-proxy-name`.
fn ownership(settings: &Settings) -> Ownership {
    Ownership { service_proxy_name: settings.service_proxy_name.clone() }
}

/// The loop's state between events and syncs.
struct Agent<'a> {
    settings: &'a Settings,
    /// The dataplane running (auto resolved).
    mode: Mode,
    health: Arc<ProxyHealth>,
    metrics: Arc<ProxyMetrics>,
    runner: SyncRunner,
    /// The latest objects, held once, and what changed since the last translation.
    tracker: ChangeTracker,
    /// The tracker's change counts already added to the `..._total` counters.
    counted: Changes,
    /// Their translation, redone for what changed on each sync.
    translator: Translator,
    /// `kubeproxy_sync_proxy_rules_no_local_endpoints_total`, recounted for the changed
    /// frontends only.
    no_local_endpoints: NoLocalEndpoints,
    service_health: ServiceHealthServer,
    /// The translation's health checks changed since `service_health` last followed them.
    health_checks_changed: bool,
    /// Each newly logged rejection is also an Event about the object.
    events: Arc<dyn EventSink>,
    /// Rejections and unsupported frontends already logged, so that periodic syncs do not
    /// repeat them; one that goes away and comes back is logged again.
    logged_rejections: BTreeSet<String>,
    logged_unsupported: BTreeSet<String>,
    /// The objects the dataplane refused at its last sync (among `logged_rejections`).
    refused: Vec<Rejection>,
    /// The node's addresses as last listed: a listing that fails keeps them, so a passing
    /// netlink error cannot make every node address look foreign to the datapath.
    node_addresses: Vec<IpAddr>,
    /// Whether the Node had no pod CIDRs at the last sync (`--detect-local-mode=NodeCIDR`),
    /// so that the change is logged once; `None` before the first sync.
    no_node_pod_cidrs: std::cell::Cell<Option<bool>>,
}

impl<'a> Agent<'a> {
    fn new(
        settings: &'a Settings,
        mode: Mode,
        health: Arc<ProxyHealth>,
        metrics: Arc<ProxyMetrics>,
        http: HttpRuntime,
        events: Arc<dyn EventSink>,
    ) -> Self {
        Self {
            settings,
            mode,
            runner: SyncRunner::new(settings.min_sync_period_in(mode), settings.sync_period),
            tracker: ChangeTracker::new(Moment::now().wall),
            counted: Changes::default(),
            translator: Translator::new(),
            no_local_endpoints: NoLocalEndpoints::default(),
            service_health: ServiceHealthServer::new(health.clone(), http),
            health_checks_changed: false,
            events,
            health,
            metrics,
            logged_rejections: BTreeSet::new(),
            logged_unsupported: BTreeSet::new(),
            refused: Vec::new(),
            node_addresses: Vec::new(),
            no_node_pod_cidrs: std::cell::Cell::new(None),
        }
    }

    /// Takes an event from the source; a change queues a sync once the source's view is
    /// complete.
    fn receive(&mut self, event: SourceEvent) {
        let changed = event.apply_to(&mut self.tracker);
        self.count_changes();
        if changed {
            if let Some(node) = self.tracker.node() {
                self.health.sync_node(node);
            }
        }
        if changed && self.tracker.is_synced() {
            let now = Moment::now();
            self.health.queued_update(now);
            self.metrics.last_queued_timestamp.set(now.unix_seconds());
            self.runner.request();
        }
    }

    /// Brings kube-proxy's change counters and pending gauges to the tracker's counts.
    fn count_changes(&mut self) {
        let total = self.tracker.total();
        self.metrics.service_changes.add(total.services - self.counted.services);
        for ((counter, now), before) in self
            .metrics
            .endpoint_changes
            .iter()
            .zip(total.endpoint_slices_by_family)
            .zip(self.counted.endpoint_slices_by_family)
        {
            counter.add(now - before);
        }
        self.counted = total;
        let pending = self.tracker.pending();
        self.metrics.service_changes_pending.set(pending.services as f64);
        for (gauge, pending) in
            self.metrics.endpoint_changes_pending.iter().zip(pending.endpoint_slices_by_family)
        {
            gauge.set(pending as f64);
        }
    }

    /// Applies the latest objects to the dataplane and records how it went.
    fn sync(&mut self, dataplane: &mut dyn Dataplane) {
        if !self.tracker.is_synced() {
            return;
        }
        self.refresh_node_addresses();
        let started = Moment::now();
        let cidr_objects: Vec<_> = self.tracker.service_cidrs().cloned().collect();
        let (service_cidrs, cidr_rejections) =
            kubernetes_model::service_cidrs(&cidr_objects, &self.settings.service_cidrs);
        let node = self.node_context(self.tracker.node(), service_cidrs);
        let dirty = self.tracker.take_dirty();
        let changes = self.translator.translate(&self.tracker, dirty, &node);
        let model_rejections: Vec<Rejection> = self
            .tracker
            .invalid()
            .chain(&cidr_rejections)
            .cloned()
            .chain(self.translator.rejected())
            .collect();
        // A translation's health-check changes are served by the next sync that reaches the
        // dataplane, which may not be this one.
        self.health_checks_changed |= changes.health_checks;
        let objects = &self.tracker;
        let state = self.translator.state();
        let result = dataplane.sync_changes(state, &changes);
        // Objects the dataplane refused (a Service that does not fit its maps) are reported
        // as the model's rejections are; a failed sync keeps the last ones it refused.
        if let Ok(report) = &result {
            self.refused.clone_from(&report.refused);
        }
        let reported = model_rejections
            .iter()
            .map(|rejection| (rejection, crate::events::rejection_reason(rejection)))
            .chain(self.refused.iter().map(|rejection| (rejection, event_reasons::CAPACITY_EXCEEDED)));
        let mut rejections = BTreeSet::new();
        // One Event per object and reason: a Service losing several frontends is one Event.
        let mut refusals: BTreeMap<(ObjectRef, &'static str), Vec<String>> = BTreeMap::new();
        for (rejection, reason) in reported {
            let described = rejection.to_string();
            if !self.logged_rejections.contains(&described) && !rejections.contains(&described) {
                warn!("skipping {described}");
                if let Some(regarding) = ObjectRef::of_rejection(rejection, objects) {
                    refusals.entry((regarding, reason)).or_default().push(rejection.reason.clone());
                }
            }
            rejections.insert(described);
        }
        for ((regarding, reason), messages) in refusals {
            self.events.refused(regarding, reason, messages.join("; "));
        }
        self.metrics.rejected_objects.set(rejections.len() as f64);
        self.logged_rejections = rejections;
        // A sync without a previous generation compares everything: kube-proxy's full sync.
        self.metrics.observe_sync(started.instant.elapsed(), changes.since.is_none());
        self.no_local_endpoints.update(state, &changes);
        self.metrics.set_no_local_endpoints(self.no_local_endpoints.counts());
        let size = (state.frontends.len(), state.listed_endpoints.len());
        let outcome = match result {
            Ok(report) => {
                self.log_report(&report, size, started);
                let listen_ips = health_check_listen_ips(&node, self.settings, self.mode);
                if std::mem::take(&mut self.health_checks_changed)
                    || !self.service_health.is_current(&listen_ips)
                {
                    self.service_health.sync(listen_ips, &self.translator.state().health_checks);
                }
                if report.is_complete() {
                    Outcome::Succeeded
                } else {
                    Outcome::Failed
                }
            }
            Err(sync_error) => {
                error!("sync failed: {sync_error:#}");
                Outcome::Failed
            }
        };
        self.runner.ran(started.instant, outcome);
        match outcome {
            Outcome::Succeeded => {
                let done = Moment::now();
                self.health.updated(done);
                self.metrics.last_sync_timestamp.set(done.unix_seconds());
                for trigger_time in self.tracker.synced_successfully() {
                    let latency = done.wall.duration_since(trigger_time).unwrap_or_default();
                    self.metrics.network_programming_duration.observe_duration(latency);
                    self.metrics.network_programming_duration_fine.observe_duration(latency);
                }
                self.count_changes();
            }
            Outcome::Failed => {
                self.metrics.failed_syncs.add(1);
                let retry = self.runner.retry_delay().unwrap_or_default();
                warn!(retry_in_ms = retry.as_millis() as u64, "sync incomplete; will retry");
            }
        }
    }

    /// `size`: the state's frontends and listed endpoints.
    fn log_report(&mut self, report: &SyncReport, size: (usize, usize), started: Moment) {
        let unsupported: BTreeSet<String> = report.unsupported.iter().cloned().collect();
        for frontend in unsupported.difference(&self.logged_unsupported) {
            warn!("not programmed: {frontend}");
        }
        self.metrics.unsupported_frontends.set(unsupported.len() as f64);
        self.logged_unsupported = unsupported;
        for frontend in &report.failed {
            warn!("failed to program {frontend}");
        }
        self.metrics.frontend_sync_errors.add(report.failed.len() as u64);
        let took_ms = started.instant.elapsed().as_millis() as u64;
        let (frontends, endpoints) = size;
        if report.changed > 0 || !report.failed.is_empty() {
            info!(frontends, endpoints, took_ms, "synced: {report}");
        } else {
            debug!(frontends, endpoints, took_ms, "synced: nothing to change");
        }
    }

    /// Lists the node's addresses anew; a failed listing keeps the last known ones.
    fn refresh_node_addresses(&mut self) {
        // Service addresses that a dataplane binds to an interface of its own (ipvs mode's
        // dummy interface) are not the node's (kube-proxy leaves them out too).
        match host::interface_addresses() {
            Ok(addresses) => {
                self.node_addresses = addresses
                    .into_iter()
                    .filter(|address| !dataplane::holds_service_addresses(&address.interface))
                    .map(|address| address.ip)
                    .collect();
            }
            Err(list_error) => {
                warn!("cannot list this node's addresses, keeping the last known ones: {list_error}")
            }
        }
    }

    /// The node as the model sees it now: its name, its current addresses, the service IP
    /// ranges and the settings that shape service semantics.
    fn node_context(&self, node: Option<&Node>, service_cidrs: Vec<IpNet>) -> NodeContext {
        let addresses = self.node_addresses.clone();
        let facts = NodeFacts {
            name: self.settings.node_name.clone(),
            zone: node
                .and_then(|node| node.metadata.labels.as_ref())
                .and_then(|labels| labels.get("topology.kubernetes.io/zone"))
                .cloned(),
            addresses,
            primary_ips: node::primary_ips_with_override(node, self.settings.bind_address),
        };
        let local_cidrs = match self.settings.local_detection {
            LocalDetection::ClusterCidr => self.settings.cluster_cidrs.clone(),
            LocalDetection::BridgeInterface(_) | LocalDetection::InterfaceNamePrefix(_) => Vec::new(),
            LocalDetection::NodeCidr => {
                let cidrs = node::pod_cidrs(node);
                // kube-proxy waits for them; vipr serves meanwhile, without pod detection.
                if Some(cidrs.is_empty()) != self.no_node_pod_cidrs.replace(Some(cidrs.is_empty())) {
                    if cidrs.is_empty() {
                        warn!("--detect-local-mode=NodeCIDR: the Node has no spec.podCIDRs yet; no traffic counts as from pods until it has");
                    } else {
                        info!(cidrs = ?cidrs, "--detect-local-mode=NodeCIDR: the Node's pod CIDRs");
                    }
                }
                cidrs
            }
        };
        let proxy_settings = ProxySettings {
            cluster_cidrs: local_cidrs,
            pod_interfaces: pod_interfaces(&self.settings.local_detection),
            masquerade_all: self.settings.masquerade_all,
            node_port_cidrs: node::node_port_cidrs(&self.settings.node_port_addresses_in(self.mode), &facts),
            service_cidrs,
            // kube-proxy's iptables mode serves them; vipr's ebpf mode through its socket hooks.
            // The iptables dataplane programs its own loopback rules, ipvs has none.
            localhost_node_ports: self.mode == Mode::Ebpf
                && self.settings.localhost_node_ports_in(self.mode).is_some(),
            own_ports: [self.settings.healthz_bind_address, self.settings.metrics_bind_address]
                .into_iter()
                .flatten()
                .map(|address| address.port())
                .collect(),
        };
        NodeContext::resolve(&facts, &proxy_settings)
    }
}

/// The local-traffic detector by interface, as the model takes it.
fn pod_interfaces(detection: &LocalDetection) -> Option<PodInterfaces> {
    match detection {
        LocalDetection::BridgeInterface(bridge) => Some(PodInterfaces::Bridge(bridge.clone())),
        LocalDetection::InterfaceNamePrefix(prefix) => Some(PodInterfaces::NamePrefix(prefix.clone())),
        LocalDetection::ClusterCidr | LocalDetection::NodeCidr => None,
    }
}

/// The one start-up line that says which settings vipr runs with and which of those it was
/// given mean nothing to it (kube-proxy flags and `--config` fields), so that nobody believes
/// an ignored setting took effect.
fn log_settings(settings: &Settings) {
    let address = |address: Option<std::net::SocketAddr>| address.map_or("off".to_owned(), |a| a.to_string());
    let detection = match &settings.local_detection {
        LocalDetection::ClusterCidr if settings.cluster_cidrs.is_empty() => {
            "ClusterCIDR (none given: no pod traffic detection)".to_owned()
        }
        LocalDetection::ClusterCidr => format!(
            "ClusterCIDR {}",
            settings.cluster_cidrs.iter().map(ToString::to_string).collect::<Vec<_>>().join(",")
        ),
        LocalDetection::NodeCidr => "NodeCIDR (the Node's spec.podCIDRs)".to_owned(),
        LocalDetection::BridgeInterface(bridge) => format!("BridgeInterface {bridge}"),
        LocalDetection::InterfaceNamePrefix(prefix) => format!("InterfaceNamePrefix {prefix}"),
    };
    let used = format!(
        "mode={} node={} sync-period={} min-sync-period={} healthz={} metrics={} detect-local={} \
         masquerade-all={} oom-score-adj={} bind-address={}",
        settings.proxy_mode.name(),
        settings.node_name,
        crate::config::format_go_duration(settings.sync_period),
        if settings.min_sync_period_defaulted && settings.proxy_mode.fixed().is_none() {
            "the running mode's default".to_owned()
        } else {
            crate::config::format_go_duration(settings.min_sync_period)
        },
        address(settings.healthz_bind_address),
        address(settings.metrics_bind_address),
        detection,
        settings.masquerade_all,
        settings.oom_score_adj,
        settings.bind_address.map_or("none".to_owned(), |ip| ip.to_string()),
    );
    let ignored: Vec<String> = settings
        .ignored_flags
        .iter()
        .cloned()
        .chain(settings.ignored_config.iter().map(|field| format!("--config {field}")))
        .collect();
    if ignored.is_empty() {
        info!("settings: {used}; nothing given is ignored");
    } else {
        warn!("settings: {used}; meaning nothing to vipr, ignored: {}", ignored.join(", "));
    }
}

/// Where service health checks listen, as kube-proxy: on every address when NodePorts are
/// served on every address, else on the NodePort addresses.
fn health_check_listen_ips(node: &NodeContext, settings: &Settings, mode: Mode) -> Vec<IpAddr> {
    if node::matches_all(&settings.node_port_addresses_in(mode)) {
        vec![IpAddr::V4(Ipv4Addr::UNSPECIFIED)]
    } else {
        node.node_port_ips.iter().copied().collect()
    }
}

/// The dataplane to start: the requested one, or for auto what [`probe::decide`] finds this
/// kernel and node offer (logged with every reason that ruled a better mode out); and why, in
/// words.
fn running_mode(settings: &Settings) -> anyhow::Result<(Mode, String)> {
    if let Some(mode) = settings.proxy_mode.fixed() {
        info!("proxy mode {mode} (requested)");
        return Ok((mode, "requested".to_owned()));
    }
    let decision = probe::decide(&settings.bpf_root, settings.cgroup_root.as_deref())?;
    info!("proxy mode auto: {}", decision.summary());
    Ok((decision.mode, decision.summary()))
}
