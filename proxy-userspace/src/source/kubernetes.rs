//! The API-server source: kube-rs watchers with reflector stores on what kube-proxy watches —
//! the Services and EndpointSlices this proxy owns ([`Ownership`]: label and field selectors,
//! applied by the API server), this node's Node and the ServiceCIDRs — delivered as complete
//! snapshots.
//!
//! The contract is the file source's: [`watch`] runs on its own thread until `stop` fires or
//! the receiving side is dropped, sends a complete [`Objects`] snapshot whenever the stores
//! change, and sends [`SourceEvent::Unusable`] when the API server cannot be reached (the agent
//! then keeps its datapath).
//!
//! - No snapshot is sent before every initial list has completed: a partial view would make
//!   the agent delete the services it has not seen yet. An API server that does not serve
//!   ServiceCIDRs (before 1.33), or forbids them to vipr (an older ClusterRole), counts as
//!   having none: vipr then uses `--service-cluster-ip-range`, and keeps retrying.
//! - The kube-rs watcher resumes from its resourceVersion after a disconnect and relists after
//!   410 Gone; the reflector swaps a relisted store in at once. A snapshot is therefore always
//!   one complete view, never an empty one mid-relist, and a relist of unchanged objects gives
//!   the same snapshot as before, so the dataplane diff is empty.
//! - Objects that do not decode are kept out of the snapshot and reported in
//!   [`Objects::rejected`] (see [`decoded`]).
//! - Bursts of changes are coalesced into at most one snapshot per [`MIN_SNAPSHOT_INTERVAL`].
use std::{
    collections::HashSet,
    error::Error as _,
    fmt::{self, Debug},
    path::PathBuf,
    pin::pin,
    sync::mpsc::{Receiver, Sender, TryRecvError},
    time::Duration,
};

use futures::{future, stream, Stream, StreamExt};
use k8s_openapi::{
    api::{
        core::v1::{Node, Service},
        discovery::v1::EndpointSlice,
        networking::v1::ServiceCIDR,
    },
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
    Metadata, Resource,
};
use kube::{
    config::{KubeConfigOptions, Kubeconfig},
    runtime::{
        reflector::{self, Store},
        watcher,
        watcher::DefaultBackoff,
        WatchStreamExt,
    },
    Api, Client,
};
use serde::de::DeserializeOwned;
use tokio::time::Instant;
use tracing::{debug, info, warn};

use self::decoded::{Decoded, Slim};
use super::{Objects, Ownership, SourceEvent, SERVICE_FIELD_SELECTOR};
use crate::{metrics::rest_client::REST_CLIENT, model::kubernetes::Rejection};

mod decoded;

/// At most one snapshot per this interval; the agent batches further.
pub const MIN_SNAPSHOT_INTERVAL: Duration = Duration::from_millis(100);
/// How often the loop checks `stop` and sends a snapshot held back by the interval.
const TICK: Duration = Duration::from_millis(25);

#[derive(Clone, Debug)]
pub struct KubeSourceConfig {
    /// The kubeconfig file to use; `None` means the in-cluster service account.
    pub kubeconfig: Option<PathBuf>,
    /// This node's name: its Node object is watched and delivered in [`Objects::node`].
    pub node_name: String,
    /// `--master`: the API server URL, overriding the kubeconfig's (or the in-cluster) one.
    pub master: Option<String>,
    /// Which Services and EndpointSlices are watched (`--service-proxy-name`).
    pub ownership: Ownership,
}

/// Watches the API server and sends a snapshot each time the watched objects change, until
/// `stop` fires or the receiving side of `events` is dropped.
pub fn watch(config: KubeSourceConfig, events: Sender<SourceEvent>, stop: Receiver<()>) {
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(error) => {
            let _ =
                events.send(SourceEvent::Unusable(format!("cannot start the API client runtime: {error}")));
            return;
        }
    };
    let mut source =
        Source { events, stop, in_outage: false, service_cidrs_unavailable: false, node_unavailable: false };
    runtime.block_on(source.run(config));
}

/// Which watch a report comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Collection {
    Services,
    EndpointSlices,
    Node,
    ServiceCidrs,
}

impl Collection {
    const ALL: [Self; 4] = [Self::Services, Self::EndpointSlices, Self::Node, Self::ServiceCidrs];
}

impl fmt::Display for Collection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Services => "services",
            Self::EndpointSlices => "endpointslices",
            Self::Node => "node",
            Self::ServiceCidrs => "servicecidrs",
        })
    }
}

/// What one watch did to its store.
struct Progress {
    collection: Collection,
    step: Step,
}

enum Step {
    /// Objects of a relist arrived; the store keeps its old content until the list completes.
    Buffered,
    /// An object was added, changed or deleted.
    Changed,
    /// A complete list replaced the store.
    Listed,
    /// The watch failed; the watcher retries it after a backoff, and the store is unchanged.
    Failed(watcher::Error),
}

struct Source {
    events: Sender<SourceEvent>,
    stop: Receiver<()>,
    /// The API server could not be reached and no watch has received anything since. An outage
    /// is reported when it starts, not again at every retry of every watch. (A watch that
    /// resumes without news shows nothing; the outage ends with the next event of any watch.)
    in_outage: bool,
    /// The ServiceCIDR list is not served or not allowed (logged once until it works).
    service_cidrs_unavailable: bool,
    /// The Node watch answered 403 or 404: logged once, and snapshots go on without it.
    node_unavailable: bool,
}

impl Source {
    async fn run(&mut self, config: KubeSourceConfig) {
        if let Some(client) = self.connect(&config).await {
            self.watch_stores(client, &config).await;
        }
    }

    /// Builds the API client, retrying with backoff while its configuration cannot be loaded
    /// (a kubeconfig not written yet, a service account token not mounted yet). `None` once
    /// stopped.
    async fn connect(&mut self, config: &KubeSourceConfig) -> Option<Client> {
        let mut backoff = DefaultBackoff::default();
        loop {
            match client(config).await {
                Ok(client) => return Some(client),
                Err(problem) => {
                    if !self.report_outage(problem) {
                        return None;
                    }
                }
            }
            let delay = backoff.next().unwrap_or(Duration::from_secs(30));
            if !self.sleep_unless_stopped(delay).await {
                return None;
            }
        }
    }

    async fn watch_stores(&mut self, client: Client, config: &KubeSourceConfig) {
        let owned = config.ownership.label_selector();
        let (services, services_progress) = reflect(
            Api::all(client.clone()),
            watcher::Config::default().labels(&owned).fields(SERVICE_FIELD_SELECTOR),
            Collection::Services,
        );
        let (slices, slices_progress) = reflect(
            Api::all(client.clone()),
            watcher::Config::default().labels(&owned),
            Collection::EndpointSlices,
        );
        let this_node = watcher::Config::default().fields(&format!("metadata.name={}", config.node_name));
        let (nodes, node_progress) = reflect(Api::all(client.clone()), this_node, Collection::Node);
        let (service_cidrs, service_cidrs_progress) = reflect(
            Api::all(client),
            watcher::Config::default().labels(&Ownership::service_cidr_label_selector()),
            Collection::ServiceCidrs,
        );
        let stores = Stores { services, slices, nodes, service_cidrs, node_name: config.node_name.clone() };
        let mut progress = pin!(stream::select(
            stream::select(services_progress, slices_progress),
            stream::select(node_progress, service_cidrs_progress),
        ));

        let mut listed = HashSet::new();
        let mut changed = false;
        let mut last_snapshot: Option<Instant> = None;
        let mut tick = tokio::time::interval(TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                Some(Progress { collection, step }) = progress.next() => match step {
                    Step::Buffered => self.succeeded(collection),
                    Step::Changed => {
                        self.succeeded(collection);
                        changed = true;
                    }
                    Step::Listed => {
                        self.succeeded(collection);
                        listed.insert(collection);
                        changed = true;
                    }
                    Step::Failed(error) if collection == Collection::ServiceCidrs && unavailable(&error) => {
                        self.note_service_cidrs_unavailable(&error);
                        // None to wait for: the snapshots go on with the store as it is.
                        changed |= listed.insert(collection);
                    }
                    Step::Failed(error) if collection == Collection::Node && unavailable(&error) => {
                        self.note_node_unavailable(&error);
                        // The node's facts refine the services (zone, pod CIDRs, primary IPs);
                        // without them the services are still served, from the interfaces.
                        changed |= listed.insert(collection);
                    }
                    Step::Failed(error) => {
                        if !self.failed(collection, &error) {
                            return;
                        }
                    }
                },
                _ = tick.tick() => {
                    if self.stop_requested() {
                        return;
                    }
                }
            }
            let complete = Collection::ALL.iter().all(|collection| listed.contains(collection));
            let due = last_snapshot.is_none_or(|at| at.elapsed() >= MIN_SNAPSHOT_INTERVAL);
            if changed && complete && due {
                if self.events.send(SourceEvent::Objects(stores.snapshot())).is_err() {
                    return;
                }
                changed = false;
                last_snapshot = Some(Instant::now());
            }
        }
    }

    /// Reports a watch failure as an outage, unless it is a normal expiry; false once nobody
    /// listens any more.
    fn failed(&mut self, collection: Collection, error: &watcher::Error) -> bool {
        if let watcher::Error::WatchError(status) = error {
            if status.code == 410 {
                // The normal end of a watch that fell too far behind: the watcher relists.
                debug!(%collection, "watch expired (410 Gone); relisting");
                return true;
            }
        }
        self.report_outage(format!("API server: {collection} watch: {}", describe_error(error)))
    }

    /// Sends `problem` if it starts an outage; false once nobody listens any more.
    fn report_outage(&mut self, problem: String) -> bool {
        debug!("{problem}");
        if self.in_outage {
            return true;
        }
        self.in_outage = true;
        self.events.send(SourceEvent::Unusable(problem)).is_ok()
    }

    fn note_node_unavailable(&mut self, error: &watcher::Error) {
        if !self.node_unavailable {
            warn!(
                "cannot watch this node's Node object ({}); serving without it (no zone, no pod CIDRs \
                 from it, primary addresses from the interfaces) until it can be read",
                describe_error(error)
            );
            self.node_unavailable = true;
        }
    }

    fn note_service_cidrs_unavailable(&mut self, error: &watcher::Error) {
        if !self.service_cidrs_unavailable {
            warn!(
                "cannot watch ServiceCIDRs ({}); using --service-cluster-ip-range until they can be read",
                describe_error(error)
            );
            self.service_cidrs_unavailable = true;
        }
    }

    fn succeeded(&mut self, collection: Collection) {
        if collection == Collection::Node && self.node_unavailable {
            info!("watching this node's Node object");
            self.node_unavailable = false;
        }
        if collection == Collection::ServiceCidrs && self.service_cidrs_unavailable {
            info!("watching ServiceCIDRs");
            self.service_cidrs_unavailable = false;
        }
        if self.in_outage {
            info!(%collection, "receiving from the API server again");
            self.in_outage = false;
        }
    }

    fn stop_requested(&self) -> bool {
        !matches!(self.stop.try_recv(), Err(TryRecvError::Empty))
    }

    /// Sleeps for `duration`, noticing `stop` within a tick; false when stopped.
    async fn sleep_unless_stopped(&self, duration: Duration) -> bool {
        let deadline = Instant::now() + duration;
        while Instant::now() < deadline {
            if self.stop_requested() {
                return false;
            }
            tokio::time::sleep(TICK.min(deadline - Instant::now())).await;
        }
        !self.stop_requested()
    }
}

/// In-cluster configuration by default, as kube-proxy; the given kubeconfig otherwise. A
/// `--master` URL replaces the kubeconfig's server; given alone, it is the whole configuration
/// (no credentials), as with kube-proxy's `clientcmd.BuildConfigFromFlags`.
pub(crate) async fn client(config: &KubeSourceConfig) -> Result<Client, String> {
    let master = match config.master.as_deref() {
        Some(url) => Some(url.parse::<::http::Uri>().map_err(|error| format!("--master {url:?}: {error}"))?),
        None => None,
    };
    let mut client_config = match (&config.kubeconfig, &master) {
        (None, Some(url)) => kube::Config::new(url.clone()),
        (None, None) => {
            kube::Config::incluster().map_err(|error| format!("in-cluster API configuration: {error}"))?
        }
        (Some(path), _) => {
            let problem = |error: &dyn std::error::Error| format!("kubeconfig {}: {error}", path.display());
            let kubeconfig = Kubeconfig::read_from(path).map_err(|error| problem(&error))?;
            kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
                .await
                .map_err(|error| problem(&error))?
        }
    };
    if let Some(url) = master {
        client_config.cluster_url = url;
    }
    let host = client_config.cluster_url.authority().map(ToString::to_string).unwrap_or_default();
    let builder = kube::client::ClientBuilder::try_from(client_config)
        .map_err(|error| format!("cannot create the API client: {error}"))?;
    Ok(builder
        .with_layer(&tower::layer::layer_fn(|inner| CountedRequests { inner, host: host.clone() }))
        .build())
}

/// The API client's stack with each request counted in `rest_client_*`, as client-go counts
/// kube-proxy's.
struct CountedRequests<S> {
    inner: S,
    /// The API server's `host:port`, client-go's `host` label.
    host: String,
}

impl<S, B, R> tower::Service<::http::Request<B>> for CountedRequests<S>
where
    S: tower::Service<::http::Request<B>, Response = ::http::Response<R>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = std::pin::Pin<Box<dyn std::future::Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: ::http::Request<B>) -> Self::Future {
        let method = request.method().to_string();
        let host = self.host.clone();
        let started = std::time::Instant::now();
        let response = self.inner.call(request);
        Box::pin(async move {
            let result = response.await;
            let code = match &result {
                Ok(response) => response.status().as_u16().to_string(),
                Err(_) => "<error>".to_owned(),
            };
            REST_CLIENT.record(&method, &host, &code, started.elapsed());
            result
        })
    }
}

/// A reflector store of `K` fed by a watcher that retries with kube's default backoff, and
/// the stream of what it does. Objects are decoded one by one ([`Decoded`]).
fn reflect<K>(
    api: Api<Decoded<K>>,
    config: watcher::Config,
    collection: Collection,
) -> (Store<Decoded<K>>, impl Stream<Item = Progress>)
where
    K: Resource + Metadata<Ty = ObjectMeta> + DeserializeOwned + Slim + Clone + Debug + Send + Sync + 'static,
{
    let (store, writer) = reflector::store();
    let progress = watcher(api, config).default_backoff().reflect(writer).filter_map(move |event| {
        future::ready(
            match event {
                // A relist starts; nothing was received yet.
                Ok(watcher::Event::Init) => None,
                Ok(watcher::Event::InitApply(_)) => Some(Step::Buffered),
                Ok(watcher::Event::InitDone) => Some(Step::Listed),
                Ok(watcher::Event::Apply(_) | watcher::Event::Delete(_)) => Some(Step::Changed),
                Err(error) => Some(Step::Failed(error)),
            }
            .map(|step| Progress { collection, step }),
        )
    });
    (store, progress)
}

/// A list or watch refused because the API server does not serve the resource (404) or
/// vipr may not read it (403): retrying will not help soon.
fn unavailable(error: &watcher::Error) -> bool {
    match error {
        watcher::Error::InitialListFailed(kube::Error::Api(status))
        | watcher::Error::WatchStartFailed(kube::Error::Api(status))
        | watcher::Error::WatchFailed(kube::Error::Api(status)) => matches!(status.code, 403 | 404),
        watcher::Error::WatchError(status) => matches!(status.code, 403 | 404),
        _ => false,
    }
}

struct Stores {
    services: Store<Decoded<Service>>,
    slices: Store<Decoded<EndpointSlice>>,
    nodes: Store<Decoded<Node>>,
    service_cidrs: Store<Decoded<ServiceCIDR>>,
    node_name: String,
}

impl Stores {
    fn snapshot(&self) -> Objects {
        let mut rejected = Vec::new();
        let services = usable(&self.services, &mut rejected);
        let slices = usable(&self.slices, &mut rejected);
        let node = usable(&self.nodes, &mut rejected)
            .into_iter()
            .find(|node| node.metadata.name.as_ref() == Some(&self.node_name));
        let service_cidrs = usable(&self.service_cidrs, &mut rejected);
        Objects { services, slices, node, service_cidrs, rejected }
    }
}

/// The objects of `store` that decoded, in namespace/name order so that equal stores give equal
/// snapshots; the others are added to `rejected`.
fn usable<K>(store: &Store<Decoded<K>>, rejected: &mut Vec<Rejection>) -> Vec<K>
where
    K: Resource + Metadata<Ty = ObjectMeta> + Clone + 'static,
{
    let mut objects = store.state();
    objects.sort_by(|a, b| {
        let key = |object: &Decoded<K>| (object.metadata().namespace.clone(), object.metadata().name.clone());
        key(a).cmp(&key(b))
    });
    let mut usable = Vec::with_capacity(objects.len());
    for object in objects {
        match object.as_ref() {
            Decoded::Valid(object) => usable.push(object.clone()),
            Decoded::Invalid { metadata, reason } => {
                rejected.push(Rejection { object: describe::<K>(metadata), reason: reason.clone() })
            }
        }
    }
    usable
}

/// `Kind namespace/name`, or `Kind name` for cluster-scoped objects.
fn describe<K: Resource>(metadata: &ObjectMeta) -> String {
    let name = metadata.name.as_deref().filter(|name| !name.is_empty()).unwrap_or("<unnamed>");
    match &metadata.namespace {
        Some(namespace) => format!("{} {namespace}/{name}", K::KIND),
        None => format!("{} {name}", K::KIND),
    }
}

/// The error and its causes, which kube's errors often leave out of their own message (the
/// "connection refused" under "client error (Connect)").
fn describe_error(error: &watcher::Error) -> String {
    let mut text = error.to_string();
    let mut cause = error.source();
    while let Some(error) = cause {
        let message = error.to_string();
        if !text.contains(&message) {
            text = format!("{text}: {message}");
        }
        cause = error.source();
    }
    text
}
