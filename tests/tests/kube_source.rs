//! The API-server source (`vipr::source::kubernetes`) with the real kube client against the
//! in-suite fake API server: what its events bring into the agent's change tracker, and so the
//! desired state, when objects change, the server restarts, watches expire, objects do not
//! decode, and the server is down. A "snapshot" here is the tracker's view after an event that
//! changed it, once the source said it had listed everything. No kernel features or root needed.
use std::{
    collections::BTreeMap,
    path::PathBuf,
    sync::mpsc::{self, Receiver, RecvTimeoutError, Sender},
    thread::{self, JoinHandle},
    time::{Duration, Instant},
};

use anyhow::{bail, Result};
use k8s_openapi::{
    api::{
        core::v1::{Node, Service, ServicePort, ServiceSpec},
        discovery::v1::{Endpoint, EndpointConditions, EndpointPort, EndpointSlice},
        networking::v1::{ServiceCIDR, ServiceCIDRSpec},
    },
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use serde_json::json;
use testbed::{apiserver::Collection, FakeApiServer, WorkDir};
use vipr::{
    model::{
        changes::ChangeTracker,
        kubernetes::{desired_state_of, service_cidrs, NodeContext, Translation, SERVICE_NAME_LABEL},
    },
    source::{
        kubernetes::{self, KubeSourceConfig},
        HeldObjects as Objects, Ownership, SourceEvent, HEADLESS_LABEL, SERVICE_PROXY_NAME_LABEL,
    },
};

const NODE: &str = "node-a";
const NAMESPACE: &str = "shop";
/// Generous: after a few failures kube's backoff waits several seconds before retrying.
const EVENT_TIMEOUT: Duration = Duration::from_secs(40);
/// How long the source may take to stop.
const STOP_TIMEOUT: Duration = Duration::from_secs(5);

/// The source under test, running on its own thread as the agent runs it, and everything it
/// has sent so far.
struct Source {
    events: Receiver<SourceEvent>,
    stop: Sender<()>,
    thread: JoinHandle<()>,
    /// Every event applied, as the agent applies them.
    tracker: ChangeTracker,
    /// Events received, by what they were.
    events_received: usize,
    lists_received: usize,
    snapshots: Vec<Objects>,
    outages: Vec<String>,
    _workdir: WorkDir,
}

impl Source {
    fn start(server: &FakeApiServer) -> Result<Self> {
        Self::start_owning(server, Ownership::default())
    }

    /// Starts the source with `--service-proxy-name` as `ownership` says.
    fn start_owning(server: &FakeApiServer, ownership: Ownership) -> Result<Self> {
        let workdir = WorkDir::create("kube-source")?;
        let kubeconfig = workdir.path().join("kubeconfig");
        server.write_kubeconfig(&kubeconfig)?;
        Ok(Self::start_with_kubeconfig(workdir, kubeconfig, ownership))
    }

    /// Starts the source on `kubeconfig`, which need not exist yet.
    fn start_with_kubeconfig(workdir: WorkDir, kubeconfig: PathBuf, ownership: Ownership) -> Self {
        let config = KubeSourceConfig {
            kubeconfig: Some(kubeconfig),
            node_name: NODE.into(),
            master: None,
            ownership,
        };
        let (events_tx, events) = mpsc::channel();
        let (stop, stop_rx) = mpsc::channel();
        let thread = thread::spawn(move || kubernetes::watch(config, events_tx, stop_rx));
        Self {
            events,
            stop,
            thread,
            tracker: ChangeTracker::new(std::time::SystemTime::UNIX_EPOCH),
            events_received: 0,
            lists_received: 0,
            snapshots: Vec::new(),
            outages: Vec::new(),
            _workdir: workdir,
        }
    }

    /// Receives events until `wanted` picks one (it is given each event and the snapshot it
    /// led to, if any), for at most [`EVENT_TIMEOUT`].
    fn wait_for<T>(
        &mut self,
        what: &str,
        mut wanted: impl FnMut(&SourceEvent, Option<&Objects>) -> Option<T>,
    ) -> Result<T> {
        let deadline = Instant::now() + EVENT_TIMEOUT;
        loop {
            let event = match self.events.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(event) => event,
                Err(RecvTimeoutError::Timeout) => bail!(
                    "timed out after {EVENT_TIMEOUT:?} waiting for {what}; last snapshot: {:?}; outages: {:?}",
                    self.snapshots.last().map(programmed),
                    self.outages
                ),
                Err(RecvTimeoutError::Disconnected) => bail!("the source ended while waiting for {what}"),
            };
            let snapshot = self.record(event.clone());
            if let Some(found) = wanted(&event, snapshot.then(|| self.snapshots.last()).flatten()) {
                return Ok(found);
            }
        }
    }

    fn snapshot_where(&mut self, what: &str, wanted: impl Fn(&Objects) -> bool) -> Result<Objects> {
        self.wait_for(what, |_, snapshot| snapshot.filter(|objects| wanted(objects)).cloned())
    }

    fn outage(&mut self) -> Result<String> {
        self.wait_for("an Unusable event", |event, _| match event {
            SourceEvent::Unusable(reason) => Some(reason.clone()),
            _ => None,
        })
    }

    /// Records whatever arrives within `duration`.
    fn receive_for(&mut self, duration: Duration) {
        let deadline = Instant::now() + duration;
        while let Ok(event) = self.events.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            self.record(event);
        }
    }

    /// Applies `event` as the agent does; true when it led to a new snapshot.
    fn record(&mut self, event: SourceEvent) -> bool {
        self.events_received += 1;
        match event {
            SourceEvent::Unusable(reason) => {
                self.outages.push(reason);
                false
            }
            event => {
                self.lists_received += usize::from(matches!(event, SourceEvent::Listed(..)));
                let changed = event.apply_to(&mut self.tracker);
                if changed && self.tracker.is_synced() {
                    self.snapshots.push(Objects::held_by(&self.tracker));
                }
                changed && self.tracker.is_synced()
            }
        }
    }

    /// The agent would delete every service on an empty snapshot: none may ever be sent while
    /// the server has services.
    fn assert_never_empty(&self) {
        for (index, snapshot) in self.snapshots.iter().enumerate() {
            assert!(!snapshot.services.is_empty(), "snapshot {index} has no services: {snapshot:?}");
        }
    }

    /// Stops the source as the agent does, and checks that it ends promptly.
    fn stop(self) -> Result<()> {
        let _ = self.stop.send(());
        let deadline = Instant::now() + STOP_TIMEOUT;
        while !self.thread.is_finished() {
            if Instant::now() >= deadline {
                bail!("the source did not stop within {STOP_TIMEOUT:?}");
            }
            thread::sleep(Duration::from_millis(20));
        }
        self.thread.join().map_err(|_| anyhow::anyhow!("the source thread panicked"))
    }
}

fn translate(objects: &Objects) -> Translation {
    desired_state_of(
        &objects.services,
        &objects.slices,
        &NodeContext { name: NODE.into(), ..NodeContext::default() },
    )
}

/// What the agent would program for a snapshot: each frontend and its backends, as text.
fn programmed(objects: &Objects) -> BTreeMap<String, Vec<String>> {
    translate(objects)
        .state
        .frontends
        .iter()
        .map(|(frontend, entry)| {
            (frontend.to_string(), entry.all_backends().iter().map(ToString::to_string).collect())
        })
        .collect()
}

/// `programmed` in the shape tests write it.
fn frontends(expected: &[(&str, &[&str])]) -> BTreeMap<String, Vec<String>> {
    expected
        .iter()
        .map(|(frontend, backends)| {
            (frontend.to_string(), backends.iter().map(ToString::to_string).collect())
        })
        .collect()
}

fn metadata(name: &str) -> ObjectMeta {
    ObjectMeta { name: Some(name.into()), namespace: Some(NAMESPACE.into()), ..ObjectMeta::default() }
}

/// A ClusterIP service with one TCP port named `http`.
fn service(name: &str, cluster_ip: &str, port: i32) -> Service {
    Service {
        metadata: metadata(name),
        spec: Some(ServiceSpec {
            cluster_ip: Some(cluster_ip.into()),
            cluster_ips: Some(vec![cluster_ip.into()]),
            ports: Some(vec![ServicePort {
                name: Some("http".into()),
                port,
                protocol: Some("TCP".into()),
                ..ServicePort::default()
            }]),
            ..ServiceSpec::default()
        }),
        ..Service::default()
    }
}

/// A slice of `service` with ready endpoints on port `http` 8080.
fn slice(name: &str, service: &str, addresses: &[&str]) -> EndpointSlice {
    EndpointSlice {
        metadata: ObjectMeta {
            labels: Some(BTreeMap::from([(SERVICE_NAME_LABEL.to_owned(), service.to_owned())])),
            ..metadata(name)
        },
        address_type: "IPv4".into(),
        endpoints: addresses
            .iter()
            .map(|address| Endpoint {
                addresses: vec![address.to_string()],
                conditions: Some(EndpointConditions { ready: Some(true), ..EndpointConditions::default() }),
                ..Endpoint::default()
            })
            .collect(),
        ports: Some(vec![EndpointPort {
            name: Some("http".into()),
            port: Some(8080),
            protocol: Some("TCP".into()),
            ..EndpointPort::default()
        }]),
    }
}

fn node(name: &str) -> Node {
    Node { metadata: ObjectMeta { name: Some(name.into()), ..ObjectMeta::default() }, ..Node::default() }
}

/// Waits until the source watches every collection, so that what the server does next reaches
/// open watches.
fn wait_until_watching(server: &FakeApiServer) -> Result<()> {
    testbed::wait_for("a watch of every collection", EVENT_TIMEOUT, || {
        let open = Collection::ALL.map(|collection| server.watches_open(collection));
        Ok(if open.iter().all(|open| *open > 0) {
            testbed::Check::Done(())
        } else {
            testbed::Check::NotYet(format!("open watches {open:?}"))
        })
    })
}

/// A server with service `web` (10.96.0.10:80, one endpoint) and two nodes.
fn server_with_web() -> Result<FakeApiServer> {
    let server = FakeApiServer::start()?;
    server.apply(&service("web", "10.96.0.10", 80))?;
    server.apply(&slice("web-1", "web", &["10.1.0.2"]))?;
    server.apply(&node(NODE))?;
    server.apply(&node("node-b"))?;
    Ok(server)
}

#[test]
fn adds_changes_and_deletes_reach_the_snapshot() -> Result<()> {
    let server = server_with_web()?;
    let mut source = Source::start(&server)?;

    let first = source.snapshot_where("the initial snapshot", |_| true)?;
    assert_eq!(programmed(&first), frontends(&[("10.96.0.10:80/TCP", &["10.1.0.2:8080"])]));
    assert_eq!(
        first.node.as_ref().and_then(|node| node.metadata.name.as_deref()),
        Some(NODE),
        "only this node"
    );
    assert!(first.rejected.is_empty(), "{:?}", first.rejected);

    server.apply(&slice("web-2", "web", &["10.1.0.3"]))?;
    source.snapshot_where("a second slice merged in", |objects| {
        programmed(objects) == frontends(&[("10.96.0.10:80/TCP", &["10.1.0.2:8080", "10.1.0.3:8080"])])
    })?;

    server.apply(&slice("web-1", "web", &["10.1.0.4"]))?;
    source.snapshot_where("a changed slice", |objects| {
        programmed(objects) == frontends(&[("10.96.0.10:80/TCP", &["10.1.0.3:8080", "10.1.0.4:8080"])])
    })?;

    server.apply(&service("web", "10.96.0.10", 81))?;
    server.apply(&service("api", "10.96.0.11", 80))?;
    source.snapshot_where("a changed and an added service", |objects| {
        programmed(objects)
            == frontends(&[
                ("10.96.0.10:81/TCP", &["10.1.0.3:8080", "10.1.0.4:8080"]),
                ("10.96.0.11:80/TCP", &[]),
            ])
    })?;

    server.delete::<EndpointSlice>(Some(NAMESPACE), "web-2")?;
    server.delete::<Service>(Some(NAMESPACE), "api")?;
    source.snapshot_where("a deleted slice and service", |objects| {
        programmed(objects) == frontends(&[("10.96.0.10:81/TCP", &["10.1.0.4:8080"])])
    })?;

    source.assert_never_empty();
    assert!(source.snapshots.iter().all(|snapshot| snapshot.node.is_some()), "the node is in every snapshot");
    assert!(source.outages.is_empty(), "{:?}", source.outages);
    source.stop()
}

/// The source's lists and watches are counted as client-go counts kube-proxy's:
/// `rest_client_requests_total{code, host, method}` and the request durations by verb and host.
#[test]
fn api_requests_are_counted_in_rest_client_metrics() -> Result<()> {
    use vipr::metrics::{rest_client::RestClientCollector, Collector, SampleValue};
    let server = server_with_web()?;
    let mut source = Source::start(&server)?;
    source.snapshot_where("the initial snapshot", |_| true)?;
    let host = server.url().trim_start_matches("http://").trim_start_matches("https://").to_owned();
    let label = |name: &str, value: &str| (name.to_owned(), value.to_owned());
    let families = RestClientCollector.collect();
    let requests = families.iter().find(|family| family.name == "rest_client_requests_total").unwrap();
    let listed = requests
        .samples
        .iter()
        .find(|sample| sample.labels == [label("code", "200"), label("host", &host), label("method", "GET")]);
    // Services, slices, the node and service CIDRs are listed at least.
    assert!(
        matches!(listed, Some(sample) if matches!(sample.value, SampleValue::Number(n) if n >= 4.0)),
        "{requests:?}"
    );
    let durations =
        families.iter().find(|family| family.name == "rest_client_request_duration_seconds").unwrap();
    assert!(
        durations.samples.iter().any(|sample| sample.labels == [label("verb", "GET"), label("host", &host)]),
        "{durations:?}"
    );
    source.stop()
}

#[test]
fn no_snapshot_before_every_initial_list_completed() -> Result<()> {
    let server = server_with_web()?;
    server.set_failing(Collection::Nodes, true);
    let mut source = Source::start(&server)?;

    let outage = source.outage()?;
    assert!(outage.contains("node"), "{outage}");
    source.receive_for(Duration::from_secs(2));
    assert!(source.snapshots.is_empty(), "a snapshot was sent before the node list: {:?}", source.snapshots);

    server.set_failing(Collection::Nodes, false);
    let first = source.snapshot_where("the first snapshot", |_| true)?;
    assert_eq!(programmed(&first), frontends(&[("10.96.0.10:80/TCP", &["10.1.0.2:8080"])]));
    assert!(first.node.is_some());
    source.stop()
}

#[test]
fn a_restart_of_the_server_loses_no_change() -> Result<()> {
    let mut server = server_with_web()?;
    let mut source = Source::start(&server)?;
    source.snapshot_where("the initial snapshot", |_| true)?;

    // The server comes back with its history: the watch resumes and replays what it missed.
    server.stop();
    source.outage()?;
    server.apply(&slice("web-1", "web", &["10.1.0.2", "10.1.0.5"]))?;
    server.apply(&service("api", "10.96.0.11", 80))?;
    server.restart()?;
    source.snapshot_where("the changes made while the server was down", |objects| {
        programmed(objects)
            == frontends(&[
                ("10.96.0.10:80/TCP", &["10.1.0.2:8080", "10.1.0.5:8080"]),
                ("10.96.0.11:80/TCP", &[]),
            ])
    })?;

    // The server comes back without the history (compacted meanwhile): the watcher relists.
    let lists_before = server.lists_served(Collection::Services);
    server.stop();
    source.outage()?;
    server.delete::<Service>(Some(NAMESPACE), "api")?;
    server.apply(&slice("web-2", "web", &["10.1.0.6"]))?;
    server.expire_watches();
    server.restart()?;
    source.snapshot_where("the changes made while the server was down, after a relist", |objects| {
        programmed(objects)
            == frontends(&[("10.96.0.10:80/TCP", &["10.1.0.2:8080", "10.1.0.5:8080", "10.1.0.6:8080"])])
    })?;
    assert!(server.lists_served(Collection::Services) > lists_before, "the services were listed again");

    source.assert_never_empty();
    source.stop()
}

#[test]
fn an_expired_watch_relists_to_an_equal_snapshot() -> Result<()> {
    let server = server_with_web()?;
    server.apply(&service("api", "10.96.0.11", 80))?;
    server.apply(&slice("api-1", "api", &["10.1.1.2"]))?;
    let mut source = Source::start(&server)?;
    let before = source.snapshot_where("the initial snapshot", |_| true)?;
    let snapshots_before = source.snapshots.len();
    let lists_before = Collection::ALL.map(|collection| server.lists_served(collection));
    let lists_received_before = source.lists_received;
    source.tracker.take_dirty();

    wait_until_watching(&server)?;
    server.expire_watches();
    testbed::wait_for("every collection to be listed again", EVENT_TIMEOUT, || {
        let lists = Collection::ALL.map(|collection| server.lists_served(collection));
        Ok(if lists.iter().zip(&lists_before).all(|(now, before)| now > before) {
            testbed::Check::Done(())
        } else {
            testbed::Check::NotYet(format!("lists served {lists:?}, before {lists_before:?}"))
        })
    })?;
    // Every relist reaches the source's receiver as one complete list of its kind.
    let deadline = Instant::now() + EVENT_TIMEOUT;
    while source.lists_received < lists_received_before + lists_before.len() {
        if Instant::now() >= deadline {
            bail!(
                "{} relists received, {} expected",
                source.lists_received - lists_received_before,
                lists_before.len()
            );
        }
        source.receive_for(Duration::from_millis(50));
    }
    let relisted = &source.snapshots[snapshots_before..];
    assert!(relisted.is_empty(), "a relist of unchanged objects changed the tracker: {relisted:?}");
    assert!(source.tracker.take_dirty().is_empty(), "a relist of unchanged objects dirtied a service");
    assert_eq!(Objects::held_by(&source.tracker), before);
    assert_eq!(translate(&Objects::held_by(&source.tracker)).state, translate(&before).state);
    assert!(source.outages.is_empty(), "410 Gone is no outage: {:?}", source.outages);

    server.apply(&slice("api-1", "api", &["10.1.1.3"]))?;
    source.snapshot_where("a change after the relist", |objects| {
        programmed(objects).get("10.96.0.11:80/TCP") == Some(&vec!["10.1.1.3:8080".to_owned()])
    })?;
    source.stop()
}

#[test]
fn malformed_objects_are_skipped_and_reported() -> Result<()> {
    let server = server_with_web()?;
    let broken_service = json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "broken", "namespace": NAMESPACE},
        "spec": {"clusterIP": "10.96.0.12", "ports": [{"name": "http", "port": "eighty"}]},
    });
    server.apply_json(broken_service)?;
    server.apply_json(json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": "broken-1", "namespace": NAMESPACE, "labels": {SERVICE_NAME_LABEL: "web"}},
        "addressType": "IPv4", "endpoints": "none",
    }))?;
    let mut source = Source::start(&server)?;

    let first = source.snapshot_where("the initial snapshot", |_| true)?;
    assert_eq!(programmed(&first), frontends(&[("10.96.0.10:80/TCP", &["10.1.0.2:8080"])]));
    let rejected: Vec<&str> = first.rejected.iter().map(|rejection| rejection.object.as_str()).collect();
    assert_eq!(rejected, ["Service shop/broken", "EndpointSlice shop/broken-1"]);
    assert!(first.rejected[0].reason.contains("spec.ports[0].port"), "{:?}", first.rejected[0]);

    // A watch event with an object that does not decode replaces the object, and the watch
    // goes on.
    let mut broken_web = serde_json::to_value(service("web", "10.96.0.10", 80))?;
    broken_web["spec"]["ports"][0]["port"] = json!("eighty");
    server.apply_json(broken_web)?;
    server.apply(&service("api", "10.96.0.11", 80))?;
    source.snapshot_where("web rejected, api added", |objects| {
        programmed(objects) == frontends(&[("10.96.0.11:80/TCP", &[])])
            && objects.rejected.iter().any(|rejection| rejection.object == "Service shop/web")
    })?;

    server.apply(&service("web", "10.96.0.10", 80))?;
    server.delete::<Service>(Some(NAMESPACE), "broken")?;
    let fixed = source.snapshot_where("web fixed, broken deleted", |objects| {
        programmed(objects).contains_key("10.96.0.10:80/TCP")
            && !objects.rejected.iter().any(|rejection| rejection.object.starts_with("Service"))
    })?;
    assert_eq!(fixed.rejected.len(), 1, "{:?}", fixed.rejected);
    assert!(source.outages.is_empty(), "{:?}", source.outages);
    source.stop()
}

#[test]
fn while_the_server_is_down_the_source_is_unusable_and_never_empty() -> Result<()> {
    let mut server = server_with_web()?;
    server.stop();
    let mut source = Source::start(&server)?;

    let outage = source.outage()?;
    assert!(outage.contains("API server"), "{outage}");
    source.receive_for(Duration::from_secs(1));
    assert!(source.snapshots.is_empty(), "a snapshot without the API server: {:?}", source.snapshots);

    server.restart()?;
    let first = source.snapshot_where("the initial snapshot", |_| true)?;
    assert_eq!(programmed(&first), frontends(&[("10.96.0.10:80/TCP", &["10.1.0.2:8080"])]));

    let outages_before = source.outages.len();
    server.stop();
    source.outage()?;
    source.receive_for(Duration::from_secs(2));
    assert!(source.snapshots.iter().skip(1).all(|snapshot| snapshot == &first), "{:?}", source.snapshots);
    assert_eq!(source.outages.len(), outages_before + 1, "an outage is reported once: {:?}", source.outages);
    source.assert_never_empty();
    source.stop()
}

#[test]
fn a_kubeconfig_written_late_is_picked_up() -> Result<()> {
    let server = server_with_web()?;
    let workdir = WorkDir::create("kube-source")?;
    let kubeconfig = workdir.path().join("kubeconfig");
    let mut source = Source::start_with_kubeconfig(workdir, kubeconfig.clone(), Ownership::default());

    let outage = source.outage()?;
    assert!(outage.contains("kubeconfig"), "{outage}");
    server.write_kubeconfig(&kubeconfig)?;
    let first = source.snapshot_where("the initial snapshot", |_| true)?;
    assert_eq!(programmed(&first), frontends(&[("10.96.0.10:80/TCP", &["10.1.0.2:8080"])]));
    source.stop()
}

#[test]
fn dropped_connections_and_bookmarks_lose_nothing() -> Result<()> {
    let server = server_with_web()?;
    let mut source = Source::start(&server)?;
    source.snapshot_where("the initial snapshot", |_| true)?;

    server.drop_connections();
    server.apply(&slice("web-1", "web", &["10.1.0.7"]))?;
    source.snapshot_where("a change after the connections were dropped", |objects| {
        programmed(objects) == frontends(&[("10.96.0.10:80/TCP", &["10.1.0.7:8080"])])
    })?;

    server.bookmark();
    server.apply(&slice("web-1", "web", &["10.1.0.8"]))?;
    source.snapshot_where("a change after a bookmark", |objects| {
        programmed(objects) == frontends(&[("10.96.0.10:80/TCP", &["10.1.0.8:8080"])])
    })?;
    source.assert_never_empty();
    source.stop()
}

#[test]
fn a_burst_arrives_as_one_event_per_change() -> Result<()> {
    const CHANGES: usize = 200;
    let server = server_with_web()?;
    let mut source = Source::start(&server)?;
    source.snapshot_where("the initial snapshot", |_| true)?;
    let events_before = source.events_received;
    let changes_before = source.tracker.total();

    for index in 0..CHANGES {
        server.apply(&slice("web-1", "web", &[&format!("10.1.{}.{}", index / 200, index % 200 + 1)]))?;
    }
    let last = format!("10.1.{}.{}:8080", (CHANGES - 1) / 200, (CHANGES - 1) % 200 + 1);
    source.snapshot_where("the last change of the burst", |objects| {
        programmed(objects).get("10.96.0.10:80/TCP") == Some(&vec![last.clone()])
    })?;
    // One event (one object) per change, not a copy of everything per change; each counted
    // once, as kube-proxy counts them (the agent's sync runner batches the syncs).
    let events = source.events_received - events_before;
    let counted = source.tracker.total().endpoint_slices - changes_before.endpoint_slices;
    assert!(events <= CHANGES, "{CHANGES} changes gave {events} events");
    assert_eq!(counted as usize, events, "every slice event is a change");
    source.stop()
}

/// `object` with `labels` added to its metadata.
fn with_labels<T>(mut object: T, metadata: impl Fn(&mut T) -> &mut ObjectMeta, labels: &[(&str, &str)]) -> T {
    let all = metadata(&mut object).labels.get_or_insert_with(BTreeMap::new);
    all.extend(labels.iter().map(|(key, value)| (key.to_string(), value.to_string())));
    object
}

/// Service `name` at `cluster_ip` and its slice with one endpoint, both with `labels` (the
/// EndpointSlice controller copies a Service's labels to its slices).
fn apply_labelled(
    server: &FakeApiServer,
    name: &str,
    cluster_ip: &str,
    endpoint: &str,
    labels: &[(&str, &str)],
) -> Result<()> {
    server.apply(&with_labels(service(name, cluster_ip, 80), |s| &mut s.metadata, labels))?;
    server.apply(&with_labels(
        slice(&format!("{name}-1"), name, &[endpoint]),
        |s| &mut s.metadata,
        labels,
    ))?;
    Ok(())
}

fn names<T>(objects: &[T], name: impl Fn(&T) -> &str) -> Vec<String> {
    objects.iter().map(|object| name(object).to_owned()).collect()
}

/// A server with `web` (unlabelled), `cilium` (another proxy's), `mine` (labelled vipr) and a
/// headless `db`, each with a slice.
fn server_with_labelled_services() -> Result<FakeApiServer> {
    let server = FakeApiServer::start()?;
    server.apply(&node(NODE))?;
    apply_labelled(&server, "web", "10.96.0.10", "10.1.0.2", &[])?;
    apply_labelled(&server, "cilium", "10.96.0.20", "10.1.0.3", &[(SERVICE_PROXY_NAME_LABEL, "cilium")])?;
    apply_labelled(&server, "mine", "10.96.0.30", "10.1.0.4", &[(SERVICE_PROXY_NAME_LABEL, "vipr")])?;
    let mut headless = service("db", "None", 5432);
    headless.spec.as_mut().unwrap().cluster_ips = Some(vec!["None".into()]);
    server.apply(&headless)?;
    server.apply(&with_labels(
        slice("db-1", "db", &["10.1.0.5"]),
        |s| &mut s.metadata,
        &[(HEADLESS_LABEL, "")],
    ))?;
    Ok(server)
}

#[test]
fn services_labelled_for_another_proxy_and_headless_ones_are_not_watched() -> Result<()> {
    let server = server_with_labelled_services()?;
    let mut source = Source::start(&server)?;

    let first = source.snapshot_where("the initial snapshot", |_| true)?;
    assert_eq!(
        names(&first.services, |s| s.meta().name()),
        ["web"],
        "the unlabelled, non-headless Service only"
    );
    assert_eq!(names(&first.slices, |s| s.meta().name()), ["web-1"], "no labelled or headless slice");
    assert_eq!(programmed(&first), frontends(&[("10.96.0.10:80/TCP", &["10.1.0.2:8080"])]));

    // Labelled for another proxy later: it leaves, as the API server's watch reports it.
    wait_until_watching(&server)?;
    apply_labelled(&server, "web", "10.96.0.10", "10.1.0.2", &[(SERVICE_PROXY_NAME_LABEL, "cilium")])?;
    apply_labelled(&server, "api", "10.96.0.11", "10.1.0.6", &[])?;
    source.snapshot_where("web handed to another proxy", |objects| {
        programmed(objects) == frontends(&[("10.96.0.11:80/TCP", &["10.1.0.6:8080"])])
    })?;
    // And back, unlabelled.
    apply_labelled(&server, "cilium", "10.96.0.20", "10.1.0.3", &[])?;
    server.apply(&service("cilium", "10.96.0.20", 80))?;
    server.apply(&slice("cilium-1", "cilium", &["10.1.0.3"]))?;
    source.snapshot_where("cilium's Service handed to vipr", |objects| {
        programmed(objects)
            == frontends(&[
                ("10.96.0.11:80/TCP", &["10.1.0.6:8080"]),
                ("10.96.0.20:80/TCP", &["10.1.0.3:8080"]),
            ])
    })?;
    assert!(source.outages.is_empty(), "{:?}", source.outages);
    source.stop()
}

#[test]
fn with_a_service_proxy_name_only_the_services_labelled_with_it_are_watched() -> Result<()> {
    let server = server_with_labelled_services()?;
    let mut source = Source::start_owning(&server, Ownership { service_proxy_name: Some("vipr".into()) })?;

    let first = source.snapshot_where("the initial snapshot", |_| true)?;
    assert_eq!(names(&first.services, |s| s.meta().name()), ["mine"]);
    assert_eq!(names(&first.slices, |s| s.meta().name()), ["mine-1"]);
    assert_eq!(programmed(&first), frontends(&[("10.96.0.30:80/TCP", &["10.1.0.4:8080"])]));

    // Migration one Service at a time: web is labelled for vipr and moves over.
    wait_until_watching(&server)?;
    apply_labelled(&server, "web", "10.96.0.10", "10.1.0.2", &[(SERVICE_PROXY_NAME_LABEL, "vipr")])?;
    source.snapshot_where("web labelled for vipr", |objects| {
        programmed(objects)
            == frontends(&[
                ("10.96.0.10:80/TCP", &["10.1.0.2:8080"]),
                ("10.96.0.30:80/TCP", &["10.1.0.4:8080"]),
            ])
    })?;
    assert!(source.outages.is_empty(), "{:?}", source.outages);
    source.stop()
}

fn service_cidr(name: &str, cidrs: &[&str]) -> ServiceCIDR {
    ServiceCIDR {
        metadata: ObjectMeta { name: Some(name.into()), ..ObjectMeta::default() },
        spec: Some(ServiceCIDRSpec { cidrs: Some(cidrs.iter().map(ToString::to_string).collect()) }),
        status: None,
    }
}

/// The ranges in which unallocated service IPs are dropped, for a snapshot and the
/// `--service-cluster-ip-range` given.
fn dropped_ranges(objects: &Objects, flag: &[&str]) -> Vec<String> {
    let flag: Vec<_> = flag.iter().map(|cidr| cidr.parse().unwrap()).collect();
    let (ranges, rejected) = service_cidrs(&objects.service_cidrs, &flag);
    assert!(rejected.is_empty(), "{rejected:?}");
    let node = NodeContext { name: NODE.into(), service_cidrs: ranges, ..NodeContext::default() };
    let state = desired_state_of(&objects.services, &objects.slices, &node).state;
    state.service_cidrs.iter().map(ToString::to_string).collect()
}

#[test]
fn service_cidr_objects_decide_which_unallocated_service_ips_drop() -> Result<()> {
    let server = server_with_web()?;
    let mut source = Source::start(&server)?;
    let flag = ["10.96.0.0/12"];

    let first = source.snapshot_where("the initial snapshot", |_| true)?;
    assert!(first.service_cidrs.is_empty());
    assert_eq!(dropped_ranges(&first, &flag), ["10.96.0.0/12"], "no ServiceCIDR: the flag's range");

    wait_until_watching(&server)?;
    server.apply(&service_cidr("kubernetes", &["10.96.0.0/16", "fd00:10:96::/112"]))?;
    let added =
        source.snapshot_where("the default ServiceCIDR", |objects| !objects.service_cidrs.is_empty())?;
    assert_eq!(
        dropped_ranges(&added, &flag),
        ["10.96.0.0/16", "fd00:10:96::/112"],
        "the objects replace the flag"
    );

    server.apply(&service_cidr("extra", &["10.100.0.0/24"]))?;
    let extended =
        source.snapshot_where("a second ServiceCIDR", |objects| objects.service_cidrs.len() == 2)?;
    assert_eq!(dropped_ranges(&extended, &flag), ["10.96.0.0/16", "10.100.0.0/24", "fd00:10:96::/112"]);

    server.delete::<ServiceCIDR>(None, "kubernetes")?;
    server.delete::<ServiceCIDR>(None, "extra")?;
    let gone = source.snapshot_where("no ServiceCIDR left", |objects| objects.service_cidrs.is_empty())?;
    assert_eq!(dropped_ranges(&gone, &flag), ["10.96.0.0/12"], "the flag again");
    assert!(source.outages.is_empty(), "{:?}", source.outages);
    source.stop()
}

#[test]
fn a_server_without_service_cidrs_still_delivers_snapshots() -> Result<()> {
    // As an API server before 1.33 (or a ClusterRole from before vipr read ServiceCIDRs).
    let server = server_with_web()?;
    server.set_served(Collection::ServiceCidrs, false);
    let mut source = Source::start(&server)?;

    let first = source.snapshot_where("the initial snapshot", |_| true)?;
    assert_eq!(programmed(&first), frontends(&[("10.96.0.10:80/TCP", &["10.1.0.2:8080"])]));
    assert!(first.service_cidrs.is_empty());
    assert!(source.outages.is_empty(), "a missing ServiceCIDR API is no outage: {:?}", source.outages);

    // Once the server serves them, they are watched.
    server.apply(&service_cidr("kubernetes", &["10.96.0.0/16"]))?;
    server.set_served(Collection::ServiceCidrs, true);
    source.snapshot_where("the ServiceCIDR, once served", |objects| objects.service_cidrs.len() == 1)?;
    source.stop()
}

#[test]
fn a_forbidden_node_watch_does_not_keep_services_from_being_served() -> Result<()> {
    // A ClusterRole without nodes (or a Node API that refuses this ServiceAccount): the
    // services must still be programmed.
    let server = server_with_web()?;
    server.set_forbidden(Collection::Nodes, true);
    let mut source = Source::start(&server)?;
    let first = source.snapshot_where("a snapshot without the Node", |_| true)?;
    assert_eq!(programmed(&first), frontends(&[("10.96.0.10:80/TCP", &["10.1.0.2:8080"])]));
    assert!(first.node.is_none());
    assert!(source.outages.is_empty(), "a forbidden Node is no outage: {:?}", source.outages);

    // Once it may be read, it is.
    server.set_forbidden(Collection::Nodes, false);
    source.snapshot_where("the Node, once allowed", |objects| objects.node.is_some())?;
    source.stop()
}
