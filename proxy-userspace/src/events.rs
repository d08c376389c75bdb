//! Kubernetes Events: what vipr tells the cluster besides its log, as kube-proxy records its
//! start on its Node. vipr records its start (version and mode), the mode it runs and why, and
//! each object it refuses (the model's rejections; anything else that refuses an object, such
//! as a full datapath map, calls [`EventSink::refused`] the same way).
//!
//! Events never block or fail a sync: [`EventSink::record`] puts the event in a bounded queue
//! and returns; a thread of its own sends it to the API server (events.k8s.io/v1). A full queue,
//! a refusing or slow API server drops the event, counted in `vipr_events_dropped_total`.
//! Repeats of one event (same object, reason and message) within [`REPEAT_WINDOW`] are not sent
//! again; a later repeat updates the first Event's `series` (count and last time), as
//! client-go's recorder does. Without an API server (`--services-file`) there is no recorder:
//! the log says everything ([`LogOnly`]).
use std::{
    collections::HashMap,
    sync::Arc,
    time::{Duration, Instant},
};

use k8s_openapi::{
    api::{
        core::v1::ObjectReference,
        events::v1::{Event as ApiEvent, EventSeries},
    },
    apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta},
    jiff::Timestamp,
};
use kube::{
    api::{Patch, PatchParams, PostParams},
    Api, Client,
};
use tokio::sync::mpsc;
use tracing::{debug, warn};

use crate::{
    metrics::{Collector, Counter, MetricFamily, MetricKind, Sample, SampleValue},
    model::{
        changes::{ChangeTracker, Kind},
        kubernetes::Rejection,
    },
    source::{kubernetes::KubeSourceConfig, Objects},
};

/// `reportingController` of every Event vipr records.
pub const REPORTING_CONTROLLER: &str = "vipr";
/// Events waiting to be sent; more are dropped (an API server that slow would not keep up
/// anyway, and a sync must never wait for it).
const QUEUE_CAPACITY: usize = 256;
/// The longest one Event's request may take before it is given up (and counted dropped).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// A repeat of an Event sent less than this ago is not sent again.
pub const REPEAT_WINDOW: Duration = Duration::from_secs(10 * 60);
/// Sent Events remembered for aggregation; beyond this the ones outside the window are
/// forgotten.
const REMEMBERED: usize = 4096;

/// The object an Event is about (`regarding`).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ObjectRef {
    pub api_version: String,
    pub kind: String,
    /// `None` for cluster-scoped objects (their Events go to the `default` namespace).
    pub namespace: Option<String>,
    pub name: String,
    pub uid: Option<String>,
}

impl ObjectRef {
    /// This node, as kubelet and kube-proxy name it in their Events: the uid is the node's
    /// name, which is what `kubectl describe node` looks Events up by.
    pub fn node(name: &str) -> Self {
        Self {
            api_version: "v1".to_owned(),
            kind: "Node".to_owned(),
            namespace: None,
            name: name.to_owned(),
            uid: Some(name.to_owned()),
        }
    }

    /// The object a [`Rejection`] names ("Kind namespace/name", or "Kind name" for a
    /// cluster-scoped one), with its uid from `objects` when it is there; `None` when the
    /// rejection cannot name it (an object without a name).
    pub fn of_rejection(rejection: &Rejection, objects: &dyn KnownObjects) -> Option<Self> {
        let (kind, identity) = rejection.object.split_once(' ')?;
        let (namespace, name) = match identity.split_once('/') {
            Some((namespace, name)) => (Some(namespace), name),
            None => (None, identity),
        };
        if name.is_empty() || name.starts_with('<') || name.contains(char::is_whitespace) {
            return None;
        }
        Self::find(kind, namespace, name, objects)
    }

    /// Service `namespace/name`, with its uid when `objects` has it: what a refusal of a
    /// service's frontends (a full map, say) is about.
    pub fn service(namespace: &str, name: &str, objects: &dyn KnownObjects) -> Self {
        Self::find("Service", Some(namespace), name, objects).unwrap_or_else(|| Self {
            api_version: "v1".to_owned(),
            kind: "Service".to_owned(),
            namespace: Some(namespace.to_owned()),
            name: name.to_owned(),
            uid: None,
        })
    }

    /// An object of a kind the source delivers (`None` for another kind), with its uid from
    /// `objects` when it is there.
    fn find(kind: &str, namespace: Option<&str>, name: &str, objects: &dyn KnownObjects) -> Option<Self> {
        let api_version = match kind {
            "Service" => "v1",
            "EndpointSlice" => "discovery.k8s.io/v1",
            "ServiceCIDR" => "networking.k8s.io/v1",
            _ => return None,
        };
        Some(Self {
            api_version: api_version.to_owned(),
            kind: kind.to_owned(),
            namespace: namespace.map(str::to_owned),
            name: name.to_owned(),
            uid: objects.uid(kind, namespace, name),
        })
    }

    fn to_api(&self) -> ObjectReference {
        ObjectReference {
            api_version: Some(self.api_version.clone()),
            kind: Some(self.kind.clone()),
            namespace: self.namespace.clone(),
            name: Some(self.name.clone()),
            uid: self.uid.clone(),
            ..ObjectReference::default()
        }
    }
}

/// An Event's `type`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Severity {
    Normal,
    Warning,
}

/// One Event to record.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Event {
    pub regarding: ObjectRef,
    pub severity: Severity,
    /// Why, in UpperCamelCase (`Starting`, `RejectedObject`, ...).
    pub reason: &'static str,
    /// What vipr did (`Start`, `Skip`, ...).
    pub action: &'static str,
    /// For people: at most 1 kB is kept.
    pub note: String,
}

/// Reasons of the Events vipr records.
pub mod reasons {
    /// vipr started (its version and mode).
    pub const STARTING: &str = "Starting";
    /// The dataplane vipr runs, and why (`--proxy-mode=auto`'s probes).
    pub const PROXY_MODE: &str = "ProxyMode";
    /// An object vipr leaves out because it is invalid or asks for what vipr refuses.
    pub const REJECTED_OBJECT: &str = "RejectedObject";
    /// A Service frontend another Service already has.
    pub const FRONTEND_CONFLICT: &str = "FrontendConflict";
    /// An object the datapath has no room for (a full map).
    pub const CAPACITY_EXCEEDED: &str = "CapacityExceeded";
}

/// Where the agent's Events go. Implementations never block.
pub trait EventSink: Send + Sync {
    fn record(&self, event: Event);

    /// An object vipr does not serve (or not wholly), and why: a Warning.
    fn refused(&self, regarding: ObjectRef, reason: &'static str, message: String) {
        self.record(Event { regarding, severity: Severity::Warning, reason, action: "Skip", note: message });
    }
}

/// Without an API server: the log has said it all.
#[derive(Clone, Copy, Debug, Default)]
pub struct LogOnly;

impl EventSink for LogOnly {
    fn record(&self, _event: Event) {}
}

/// The Event reason for a rejection.
pub fn rejection_reason(rejection: &Rejection) -> &'static str {
    if rejection.is_frontend_conflict() {
        reasons::FRONTEND_CONFLICT
    } else {
        reasons::REJECTED_OBJECT
    }
}

/// Sends Events to the API server from a thread of its own.
pub struct ApiEvents {
    queue: mpsc::Sender<Event>,
    metrics: Arc<EventMetrics>,
}

impl ApiEvents {
    /// Starts the sending thread with an API client configured as the source's;
    /// `reporting_instance` is this node's name.
    pub fn start(config: KubeSourceConfig, reporting_instance: String) -> anyhow::Result<Self> {
        let (queue, received) = mpsc::channel(QUEUE_CAPACITY);
        let metrics = Arc::new(EventMetrics::default());
        let sender = Sender {
            config,
            reporting_instance,
            client: None,
            sent: HashMap::new(),
            metrics: metrics.clone(),
            failing: false,
        };
        std::thread::Builder::new().name("events".to_owned()).spawn(move || {
            match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                Ok(runtime) => runtime.block_on(sender.run(received)),
                Err(error) => warn!("cannot start the Events runtime; no Events will be recorded: {error}"),
            }
        })?;
        Ok(Self { queue, metrics })
    }

    pub fn metrics(&self) -> Arc<EventMetrics> {
        self.metrics.clone()
    }
}

impl EventSink for ApiEvents {
    fn record(&self, event: Event) {
        if let Err(error) = self.queue.try_send(event) {
            let why = match error {
                mpsc::error::TrySendError::Full(_) => Dropped::QueueFull,
                mpsc::error::TrySendError::Closed(_) => Dropped::Stopped,
            };
            self.metrics.count_dropped(why);
        }
    }
}

/// Why an Event was not recorded: the `reason` label of `vipr_events_dropped_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Dropped {
    /// The queue was full: the API server does not keep up.
    QueueFull,
    /// The API server refused the Event, failed, or did not answer in time.
    ApiError,
    /// No API client could be configured.
    NoClient,
    /// The sending thread is gone.
    Stopped,
}

impl Dropped {
    const ALL: [Self; 4] = [Self::QueueFull, Self::ApiError, Self::NoClient, Self::Stopped];

    fn label(self) -> &'static str {
        match self {
            Self::QueueFull => "queue_full",
            Self::ApiError => "api_error",
            Self::NoClient => "no_client",
            Self::Stopped => "stopped",
        }
    }
}

/// What became of Events: `vipr_events_sent_total`, `vipr_events_dropped_total{reason}`.
#[derive(Default)]
pub struct EventMetrics {
    sent: Counter,
    dropped: [Counter; Dropped::ALL.len()],
}

impl EventMetrics {
    fn count_dropped(&self, why: Dropped) {
        self.dropped[why as usize].add(1);
    }
}

impl Collector for EventMetrics {
    fn collect(&self) -> Vec<MetricFamily> {
        vec![
            MetricFamily::single(
                "vipr_events_sent_total",
                "Kubernetes Events vipr created or updated",
                MetricKind::Counter,
                self.sent.get() as f64,
            ),
            MetricFamily {
                name: "vipr_events_dropped_total".to_owned(),
                help: "Kubernetes Events not recorded, by reason: the queue was full, the API server \
                       refused, failed or was too slow, no API client, the sender stopped"
                    .to_owned(),
                kind: MetricKind::Counter,
                samples: Dropped::ALL
                    .iter()
                    .map(|why| Sample {
                        labels: vec![("reason".to_owned(), why.label().to_owned())],
                        value: SampleValue::Number(self.dropped[*why as usize].get() as f64),
                    })
                    .collect(),
            },
        ]
    }
}

/// An Event sent, for aggregating its repeats.
struct Sent {
    name: String,
    count: i32,
    at: Instant,
}

/// The sending side: one request at a time, each bounded by [`REQUEST_TIMEOUT`].
struct Sender {
    config: KubeSourceConfig,
    reporting_instance: String,
    client: Option<Client>,
    sent: HashMap<Event, Sent>,
    metrics: Arc<EventMetrics>,
    /// The last request failed: the next failure is logged at debug level only.
    failing: bool,
}

impl Sender {
    async fn run(mut self, mut received: mpsc::Receiver<Event>) {
        while let Some(event) = received.recv().await {
            self.send(event).await;
        }
    }

    async fn send(&mut self, event: Event) {
        if let Some(sent) = self.sent.get_mut(&event) {
            sent.count += 1;
            if sent.at.elapsed() < REPEAT_WINDOW {
                return;
            }
        }
        let client = match &self.client {
            Some(client) => client.clone(),
            None => match crate::source::kubernetes::client(&self.config).await {
                Ok(client) => self.client.insert(client).clone(),
                Err(problem) => {
                    self.failed(&event, &problem, Dropped::NoClient);
                    return;
                }
            },
        };
        let namespace = event.regarding.namespace.clone().unwrap_or_else(|| "default".to_owned());
        let api: Api<ApiEvent> = Api::namespaced(client, &namespace);
        let now = Timestamp::now();
        let result = match self.sent.get(&event) {
            Some(sent) => {
                let series = serde_json::json!({
                    "series": EventSeries { count: sent.count, last_observed_time: MicroTime(now) }
                });
                let (params, patch) = (PatchParams::default(), Patch::Merge(&series));
                let patched = api.patch(&sent.name, &params, &patch);
                tokio::time::timeout(REQUEST_TIMEOUT, patched).await.map(|result| result.map(drop))
            }
            None => {
                let object = self.api_event(&event, &namespace, now);
                let params = PostParams::default();
                let created = api.create(&params, &object);
                tokio::time::timeout(REQUEST_TIMEOUT, created).await.map(|result| {
                    result.map(|created| {
                        let name = created.metadata.name.or(object.metadata.name).unwrap_or_default();
                        self.remember(event.clone(), Sent { name, count: 1, at: Instant::now() });
                    })
                })
            }
        };
        match result {
            Ok(Ok(())) => {
                self.metrics.sent.add(1);
                self.failing = false;
                if let Some(sent) = self.sent.get_mut(&event) {
                    sent.at = Instant::now();
                }
            }
            Ok(Err(error)) => self.failed(&event, &error.to_string(), Dropped::ApiError),
            Err(_elapsed) => self.failed(&event, "the API server did not answer in time", Dropped::ApiError),
        }
    }

    fn api_event(&self, event: &Event, namespace: &str, now: Timestamp) -> ApiEvent {
        ApiEvent {
            metadata: ObjectMeta {
                // As client-go names them: the object's name and the time, unique enough.
                name: Some(format!("{}.{:x}", event.regarding.name, now.as_nanosecond())),
                namespace: Some(namespace.to_owned()),
                ..ObjectMeta::default()
            },
            event_time: Some(MicroTime(now)),
            action: Some(event.action.to_owned()),
            reason: Some(event.reason.to_owned()),
            note: Some(truncate(&event.note, 1024)),
            regarding: Some(event.regarding.to_api()),
            reporting_controller: Some(REPORTING_CONTROLLER.to_owned()),
            reporting_instance: Some(self.reporting_instance.clone()),
            type_: Some(match event.severity {
                Severity::Normal => "Normal".to_owned(),
                Severity::Warning => "Warning".to_owned(),
            }),
            ..ApiEvent::default()
        }
    }

    fn remember(&mut self, event: Event, sent: Sent) {
        if self.sent.len() >= REMEMBERED {
            self.sent.retain(|_, sent| sent.at.elapsed() < REPEAT_WINDOW);
        }
        if self.sent.len() < REMEMBERED {
            self.sent.insert(event, sent);
        }
    }

    /// Counts a dropped Event; the first failure after a success is a warning.
    fn failed(&mut self, event: &Event, problem: &str, why: Dropped) {
        self.metrics.count_dropped(why);
        if self.failing {
            debug!(reason = event.reason, "cannot record an Event: {problem}");
        } else {
            warn!(
                reason = event.reason,
                "cannot record an Event (dropped, counted in vipr_events_dropped_total): {problem}"
            );
        }
        self.failing = true;
    }
}

/// `text` cut to at most `limit` bytes, on a character boundary.
fn truncate(text: &str, limit: usize) -> String {
    let mut end = text.len().min(limit);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].to_owned()
}

/// Where an Event finds the uid of the object it is about.
pub trait KnownObjects {
    /// The uid of the object of `kind` (`Service`, `EndpointSlice`, `ServiceCIDR`) named so.
    fn uid(&self, kind: &str, namespace: Option<&str>, name: &str) -> Option<String>;
}

impl KnownObjects for Objects {
    fn uid(&self, kind: &str, namespace: Option<&str>, name: &str) -> Option<String> {
        let same = |metadata: &&ObjectMeta| {
            metadata.name.as_deref() == Some(name)
                && namespace
                    .is_none_or(|namespace| metadata.namespace.as_deref().unwrap_or("default") == namespace)
        };
        let metadata = match kind {
            "Service" => self.services.iter().map(|s| &s.metadata).find(same),
            "EndpointSlice" => self.slices.iter().map(|s| &s.metadata).find(same),
            "ServiceCIDR" => self.service_cidrs.iter().map(|s| &s.metadata).find(same),
            _ => None,
        };
        metadata.and_then(|metadata| metadata.uid.clone())
    }
}

impl KnownObjects for ChangeTracker {
    fn uid(&self, kind: &str, namespace: Option<&str>, name: &str) -> Option<String> {
        let kind = Kind::ALL.into_iter().find(|known| known.name() == kind)?;
        ChangeTracker::uid(self, kind, namespace, name)
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::Service;

    use super::*;

    fn rejection(object: &str) -> Rejection {
        Rejection { object: object.to_owned(), reason: "because".to_owned() }
    }

    #[test]
    fn a_rejection_names_its_object_with_the_uid_known() {
        let service = Service {
            metadata: ObjectMeta {
                name: Some("web".into()),
                namespace: Some("shop".into()),
                uid: Some("u-1".into()),
                ..ObjectMeta::default()
            },
            ..Service::default()
        };
        let objects = Objects { services: vec![service], ..Objects::default() };
        let named = ObjectRef::of_rejection(&rejection("Service shop/web"), &objects).unwrap();
        assert_eq!(
            named,
            ObjectRef {
                api_version: "v1".into(),
                kind: "Service".into(),
                namespace: Some("shop".into()),
                name: "web".into(),
                uid: Some("u-1".into()),
            }
        );
        let slice = ObjectRef::of_rejection(&rejection("EndpointSlice shop/web-x"), &objects).unwrap();
        assert_eq!((slice.api_version.as_str(), slice.uid), ("discovery.k8s.io/v1", None));
        let cidr = ObjectRef::of_rejection(&rejection("ServiceCIDR kubernetes"), &objects).unwrap();
        assert_eq!(cidr.namespace, None);
        assert_eq!(ObjectRef::of_rejection(&rejection("Service shop/<unnamed>"), &objects), None);
        assert_eq!(ObjectRef::of_rejection(&rejection("Gadget shop/web"), &objects), None);
    }

    #[test]
    fn notes_are_cut_on_a_character_boundary() {
        assert_eq!(truncate("héllo", 2), "h");
        assert_eq!(truncate("hello", 10), "hello");
    }

    /// A sink that keeps what it is given, for the agent's tests.
    #[derive(Default)]
    struct Kept(std::sync::Mutex<Vec<Event>>);

    impl EventSink for Kept {
        fn record(&self, event: Event) {
            self.0.lock().unwrap().push(event);
        }
    }

    #[test]
    fn refused_is_a_warning_about_the_object() {
        let kept = Kept::default();
        kept.refused(ObjectRef::node("n"), reasons::REJECTED_OBJECT, "no".into());
        let events = kept.0.lock().unwrap();
        assert_eq!(events[0].severity, Severity::Warning);
        assert_eq!(events[0].reason, "RejectedObject");
    }
}
