//! The API-server source: kube-rs watchers (no reflector stores) on what kube-proxy watches —
//! the Services and EndpointSlices this proxy owns ([`Ownership`]: label and field selectors,
//! applied by the API server), this node's Node and the ServiceCIDRs — delivered as events.
//!
//! The contract is the file source's: [`watch`] runs on its own thread until `stop` fires or
//! the receiving side is dropped, sends a [`SourceEvent`] for every object applied or deleted,
//! and sends [`SourceEvent::Unusable`] when the API server cannot be reached (the agent then
//! keeps its datapath).
//!
//! - A list (the first one, or a relist after 410 Gone) is buffered until it completes and
//!   sent as one [`SourceEvent::Listed`]: a relist never shows an empty or partial view, and
//!   a relist of unchanged objects changes nothing in the agent's tracker.
//!   [`SourceEvent::Synced`] follows once every kind was listed: a partial view would make the
//!   agent delete the services it has not seen yet. An API server that does not serve
//!   ServiceCIDRs (before 1.33), or forbids them to vipr (an older ClusterRole), counts as
//!   having none: vipr then uses `--service-cluster-ip-range`, and keeps retrying.
//! - The kube-rs watcher resumes from its resourceVersion after a disconnect and relists after
//!   410 Gone.
//! - Objects that do not decode are sent as [`Object::Invalid`] under their key (see
//!   [`decoded`]), so a later fix or deletion replaces them.
//! - Nothing is held here: the agent's tracker holds each object once.
use std::{
    collections::HashSet,
    error::Error as _,
    fmt::{self, Debug},
    path::PathBuf,
    pin::pin,
    sync::mpsc::{Receiver, Sender, TryRecvError},
    time::Duration,
};

use futures::{stream, Stream, StreamExt};
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
    runtime::{watcher, watcher::DefaultBackoff, WatchStreamExt},
    Api, Client,
};
use serde::de::DeserializeOwned;
use tokio::time::Instant;
use tracing::{debug, info, warn};

use self::decoded::{Decoded, Slim};
use super::{Kind, Object, Ownership, SourceEvent, SERVICE_FIELD_SELECTOR};
use crate::{
    metrics::rest_client::REST_CLIENT,
    model::{
        changes::{cluster_key, key},
        kubernetes::Rejection,
    },
};

mod decoded;

/// How often the loop checks `stop`.
const TICK: Duration = Duration::from_millis(25);

#[derive(Clone, Debug)]
pub struct KubeSourceConfig {
    /// The kubeconfig file to use; `None` means the in-cluster service account.
    pub kubeconfig: Option<PathBuf>,
    /// This node's name: its Node object is watched and delivered.
    pub node_name: String,
    /// `--master`: the API server URL, overriding the kubeconfig's (or the in-cluster) one.
    pub master: Option<String>,
    /// Which Services and EndpointSlices are watched (`--service-proxy-name`).
    pub ownership: Ownership,
}

/// Watches the API server and sends an event for each change of the watched objects, until
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

    fn kind(self) -> Kind {
        match self {
            Self::Services => Kind::Service,
            Self::EndpointSlices => Kind::EndpointSlice,
            Self::Node => Kind::Node,
            Self::ServiceCidrs => Kind::ServiceCidr,
        }
    }
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

/// What one watch reported.
struct Progress {
    collection: Collection,
    step: Step,
}

enum Step {
    /// A list starts.
    Listing,
    /// An object of a list arrived; the list is sent when it completes.
    Buffered(Object),
    /// An object was added or changed.
    Applied(Object),
    /// An object was deleted.
    Deleted(Object),
    /// The list completed.
    Listed,
    /// The watch failed; the watcher retries it after a backoff.
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
    /// The Node watch answered 403 or 404: logged once, and events go on without it.
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
        let services_progress = watch_kind::<Service>(
            Api::all(client.clone()),
            watcher::Config::default().labels(&owned).fields(SERVICE_FIELD_SELECTOR),
            Collection::Services,
        );
        let slices_progress = watch_kind::<EndpointSlice>(
            Api::all(client.clone()),
            watcher::Config::default().labels(&owned),
            Collection::EndpointSlices,
        );
        let this_node = watcher::Config::default().fields(&format!("metadata.name={}", config.node_name));
        let node_progress = watch_kind::<Node>(Api::all(client.clone()), this_node, Collection::Node);
        let service_cidrs_progress = watch_kind::<ServiceCIDR>(
            Api::all(client),
            watcher::Config::default().labels(&Ownership::service_cidr_label_selector()),
            Collection::ServiceCidrs,
        );
        let mut progress = pin!(stream::select(
            stream::select(services_progress, slices_progress),
            stream::select(node_progress, service_cidrs_progress),
        ));

        let mut listed = HashSet::new();
        let mut synced = false;
        // The objects of each list in progress.
        let mut lists: std::collections::HashMap<Collection, Vec<Object>> = std::collections::HashMap::new();
        let mut tick = tokio::time::interval(TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let event = tokio::select! {
                Some(Progress { collection, step }) = progress.next() => match step {
                    Step::Listing => {
                        self.succeeded(collection);
                        lists.insert(collection, Vec::new());
                        None
                    }
                    Step::Buffered(object) => {
                        self.succeeded(collection);
                        lists.entry(collection).or_default().push(object);
                        None
                    }
                    Step::Applied(object) => {
                        self.succeeded(collection);
                        Some(SourceEvent::Applied(object))
                    }
                    Step::Deleted(object) => {
                        self.succeeded(collection);
                        Some(SourceEvent::Deleted(object.kind(), object.key()))
                    }
                    Step::Listed => {
                        self.succeeded(collection);
                        listed.insert(collection);
                        let objects = lists.remove(&collection).unwrap_or_default();
                        Some(SourceEvent::Listed(collection.kind(), objects))
                    }
                    Step::Failed(error) if collection == Collection::ServiceCidrs && unavailable(&error) => {
                        self.note_service_cidrs_unavailable(&error);
                        // None to wait for: the objects go on as they are.
                        listed.insert(collection);
                        None
                    }
                    Step::Failed(error) if collection == Collection::Node && unavailable(&error) => {
                        self.note_node_unavailable(&error);
                        // The node's facts refine the services (zone, pod CIDRs, primary IPs);
                        // without them the services are still served, from the interfaces.
                        listed.insert(collection);
                        None
                    }
                    Step::Failed(error) => {
                        if !self.failed(collection, &error) {
                            return;
                        }
                        None
                    }
                },
                _ = tick.tick() => {
                    if self.stop_requested() {
                        return;
                    }
                    None
                }
            };
            if let Some(event) = event {
                if self.events.send(event).is_err() {
                    return;
                }
            }
            if !synced && Collection::ALL.iter().all(|collection| listed.contains(collection)) {
                synced = true;
                if self.events.send(SourceEvent::Synced).is_err() {
                    return;
                }
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

/// A kind the source watches; its objects become [`Object`]s (Services and EndpointSlices
/// decoded into vipr's own form right here, and the API object dropped).
trait Watched:
    Resource
    + Metadata<Ty = ObjectMeta>
    + DeserializeOwned
    + Slim
    + Into<Object>
    + Clone
    + Debug
    + Send
    + Sync
    + 'static
{
    const WATCHED: Kind;
}

impl Watched for Service {
    const WATCHED: Kind = Kind::Service;
}

impl Watched for EndpointSlice {
    const WATCHED: Kind = Kind::EndpointSlice;
}

impl Watched for Node {
    const WATCHED: Kind = Kind::Node;
}

impl Watched for ServiceCIDR {
    const WATCHED: Kind = Kind::ServiceCidr;
}

/// An object as the API server sent it, decoded or not ([`Decoded`]).
fn object<K: Watched>(decoded: Decoded<K>) -> Object {
    match decoded {
        Decoded::Valid(object) => object.into(),
        Decoded::Invalid { metadata, reason } => {
            let key = if K::WATCHED == Kind::Service || K::WATCHED == Kind::EndpointSlice {
                key(&metadata)
            } else {
                cluster_key(&metadata)
            };
            Object::Invalid {
                kind: K::WATCHED,
                key,
                rejection: Rejection { object: describe::<K>(&metadata), reason },
            }
        }
    }
}

/// The events of a watcher of `K` that retries with kube's default backoff. Objects are
/// decoded one by one ([`Decoded`]).
fn watch_kind<K: Watched>(
    api: Api<Decoded<K>>,
    config: watcher::Config,
    collection: Collection,
) -> impl Stream<Item = Progress> {
    watcher(api, config).default_backoff().map(move |event| {
        let step = match event {
            Ok(watcher::Event::Init) => Step::Listing,
            Ok(watcher::Event::InitApply(decoded)) => Step::Buffered(object(decoded)),
            Ok(watcher::Event::InitDone) => Step::Listed,
            Ok(watcher::Event::Apply(decoded)) => Step::Applied(object(decoded)),
            Ok(watcher::Event::Delete(decoded)) => Step::Deleted(object(decoded)),
            Err(error) => Step::Failed(error),
        };
        Progress { collection, step }
    })
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
