//! A fake Kubernetes API server, for tests with the real kube client.
//!
//! It speaks as much of the API server's list/watch protocol as kube-rs watchers on Services,
//! EndpointSlices, Nodes and ServiceCIDRs use, over plain HTTP/1.1 on std threads, one request
//! per connection (`Connection: close`):
//!
//! - `GET /api/v1/services`, `/apis/discovery.k8s.io/v1/endpointslices`, `/api/v1/nodes`,
//!   `/apis/networking.k8s.io/v1/servicecidrs`: a List of the current objects at the current
//!   `metadata.resourceVersion`, in pages of `limit` objects with a `continue` token (see
//!   [`Page`]), narrowed as the real server
//!   narrows it by a `labelSelector` (`key`, `!key`, `key=value`, `key==value`, `key!=value`,
//!   `key in (a,b)`, `key notin (a,b)`; `!=` and `notin` also match objects without the key)
//!   and a `fieldSelector` (`field=value`, `field==value`, `field!=value` on
//!   `metadata.name`, `metadata.namespace`, and for Services `spec.clusterIP` and
//!   `spec.type`; any other field is refused with 400, as the real server refuses it).
//! - the same with `watch=true&resourceVersion=N`: a chunked stream of newline-delimited watch
//!   events, first every change after N, then changes as they happen, and BOOKMARKs when the
//!   test asks. A watch from a version older than the kept history gets the API server's
//!   410 Gone ERROR event. Without a version (or with "0") the current objects come first as
//!   ADDED events. Under selectors, as the real watch cache: an object that starts to match
//!   comes as ADDED, one that stops matching as DELETED (its last matching content, at the new
//!   resourceVersion), one that matches neither before nor after not at all.
//! - a collection the test marks as not served answers 404, as an older API server does.
//! - `GET /version`.
//! - Events (events.k8s.io/v1), which vipr records: `POST
//!   /apis/events.k8s.io/v1/namespaces/NS/events` creates one (201 with the stored object,
//!   409 AlreadyExists for a name taken, 400 for a body that is not an Event of that
//!   namespace), `PATCH .../events/NAME` with a JSON merge patch changes one (200, 404 when
//!   there is none, 415 for another patch type); both answer 403 when the test forbids
//!   Events, as RBAC would. The test reads them back with [`FakeApiServer::objects`], or lists
//!   and watches them cluster-wide like any collection.
//!
//! Like the real server it keeps objects and a history of changes stamped from one
//! resourceVersion counter. The test changes objects (real k8s-openapi objects, or any JSON, to
//! serve objects that do not decode), expires watches, drops connections, makes a collection
//! fail, and stops and restarts the server on the same port with all of that kept.
use std::{
    collections::{BTreeMap, HashMap, HashSet},
    io::{self, BufRead, BufReader, Write},
    net::{Shutdown, SocketAddr, TcpListener, TcpStream},
    path::Path,
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc, Condvar, Mutex, MutexGuard, PoisonError,
    },
    thread::{self, JoinHandle},
    time::Duration,
};

use anyhow::{anyhow, bail, Context, Result};
use serde::Serialize;
use serde_json::{json, Value};

/// How often the acceptor checks whether it should stop.
const ACCEPT_POLL: Duration = Duration::from_millis(10);
/// A client that does not send its request, or does not read its response, within this is
/// dropped.
const IO_TIMEOUT: Duration = Duration::from_secs(10);
/// Request lines and headers are short; anything longer is not a kube client.
const MAX_HEADER_LINES: usize = 100;

/// The resources the fake serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Collection {
    Services,
    EndpointSlices,
    Nodes,
    ServiceCidrs,
    /// events.k8s.io/v1 Events, which vipr creates rather than watches.
    Events,
}

impl Collection {
    /// The collections vipr watches.
    pub const ALL: [Self; 4] = [Self::Services, Self::EndpointSlices, Self::Nodes, Self::ServiceCidrs];
    /// Every collection the fake serves.
    const SERVED: [Self; 5] =
        [Self::Services, Self::EndpointSlices, Self::Nodes, Self::ServiceCidrs, Self::Events];

    /// The cluster-wide URL path.
    fn path(self) -> &'static str {
        match self {
            Self::Services => "/api/v1/services",
            Self::EndpointSlices => "/apis/discovery.k8s.io/v1/endpointslices",
            Self::Nodes => "/api/v1/nodes",
            Self::ServiceCidrs => "/apis/networking.k8s.io/v1/servicecidrs",
            Self::Events => "/apis/events.k8s.io/v1/events",
        }
    }

    fn api_version(self) -> &'static str {
        match self {
            Self::Services | Self::Nodes => "v1",
            Self::EndpointSlices => "discovery.k8s.io/v1",
            Self::ServiceCidrs => "networking.k8s.io/v1",
            Self::Events => "events.k8s.io/v1",
        }
    }

    fn kind(self) -> &'static str {
        match self {
            Self::Services => "Service",
            Self::EndpointSlices => "EndpointSlice",
            Self::Nodes => "Node",
            Self::ServiceCidrs => "ServiceCIDR",
            Self::Events => "Event",
        }
    }

    /// The fields the real API server lets clients select this collection on, beside
    /// `metadata.name` and `metadata.namespace`.
    fn selectable_fields(self) -> &'static [&'static str] {
        match self {
            Self::Services => &["spec.clusterIP", "spec.type"],
            Self::EndpointSlices | Self::Nodes | Self::ServiceCidrs | Self::Events => &[],
        }
    }

    /// The collection of objects with this apiVersion and kind.
    pub fn of(api_version: &str, kind: &str) -> Option<Self> {
        Self::SERVED
            .into_iter()
            .find(|collection| collection.api_version() == api_version && collection.kind() == kind)
    }

    fn of_resource<K: k8s_openapi::Resource>() -> Result<Self> {
        Self::of(K::API_VERSION, K::KIND)
            .ok_or_else(|| anyhow!("the fake API server does not serve {} {}", K::API_VERSION, K::KIND))
    }
}

/// Where an object is stored: collection, namespace (none for cluster-scoped) and name.
type ObjectKey = (Collection, Option<String>, String);

/// One entry of the change history that watches replay.
enum Change {
    Object {
        resource_version: u64,
        collection: Collection,
        event: &'static str,
        object: Value,
        /// The object before this change (none for ADDED), for watches under a selector.
        previous: Option<Value>,
    },
    Bookmark {
        resource_version: u64,
    },
}

impl Change {
    fn resource_version(&self) -> u64 {
        match self {
            Self::Object { resource_version, .. } | Self::Bookmark { resource_version } => *resource_version,
        }
    }

    /// The watch event this change is for a watch of `collection` with `selector`, if any.
    fn event_for(&self, collection: Collection, selector: &Selector) -> Option<Value> {
        match self {
            Self::Object { collection: changed, event, object, previous, resource_version } => {
                if *changed != collection {
                    return None;
                }
                let matched_before = previous.as_ref().is_some_and(|previous| selector.matches(previous));
                let matches_now = *event != "DELETED" && selector.matches(object);
                let (event, object) = match (matched_before, matches_now) {
                    (false, false) => return None,
                    (false, true) => ("ADDED", object.clone()),
                    (true, true) => (*event, object.clone()),
                    (true, false) => {
                        // The real watch cache sends what the client last saw, at this version.
                        let mut last = previous.clone().unwrap_or_default();
                        if let Some(metadata) = last.get_mut("metadata").and_then(Value::as_object_mut) {
                            metadata.insert("resourceVersion".into(), resource_version.to_string().into());
                        }
                        ("DELETED", last)
                    }
                };
                Some(json!({"type": event, "object": object}))
            }
            Self::Bookmark { resource_version } => Some(json!({
                "type": "BOOKMARK",
                "object": {
                    "kind": collection.kind(),
                    "apiVersion": collection.api_version(),
                    "metadata": {"resourceVersion": resource_version.to_string()},
                },
            })),
        }
    }
}

#[derive(Default)]
struct State {
    resource_version: u64,
    objects: BTreeMap<ObjectKey, Value>,
    /// Every change after `history_start`, in order.
    history: Vec<Change>,
    /// A watch from an older version gets 410 Gone: the changes since are forgotten.
    history_start: u64,
    /// Bumped to end every open watch with 410 Gone.
    expiries: u64,
    /// Bumped to end every open connection.
    disconnects: u64,
    /// Collections whose requests are answered 500 Internal Server Error.
    failing: HashSet<Collection>,
    /// Collections answered 404 Not Found, as by a server without the API.
    not_served: HashSet<Collection>,
    /// Collections answered 403 Forbidden, as for a ServiceAccount whose ClusterRole lacks them.
    forbidden: HashSet<Collection>,
    lists_served: HashMap<Collection, usize>,
    watches_open: HashMap<Collection, usize>,
}

impl State {
    /// Stamps a new resourceVersion on `object`, records the change (from `previous`) and
    /// returns the version.
    fn record(
        &mut self,
        collection: Collection,
        event: &'static str,
        object: &mut Value,
        previous: Option<Value>,
    ) -> Result<u64> {
        let metadata = object
            .get_mut("metadata")
            .and_then(Value::as_object_mut)
            .ok_or_else(|| anyhow!("metadata is not an object"))?;
        self.resource_version += 1;
        let resource_version = self.resource_version;
        metadata.insert("resourceVersion".into(), resource_version.to_string().into());
        self.history.push(Change::Object {
            resource_version,
            collection,
            event,
            object: object.clone(),
            previous,
        });
        Ok(resource_version)
    }
}

#[derive(Default)]
struct Shared {
    state: Mutex<State>,
    /// Signalled on every change of `state`.
    changed: Condvar,
    accepting: AtomicBool,
    /// Every open connection, to shut down on demand.
    connections: Mutex<HashMap<u64, TcpStream>>,
    next_connection: AtomicU64,
}

impl Shared {
    /// A watch thread that panicked must not take the rest of the server down with it.
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn change(&self, change: impl FnOnce(&mut State) -> Result<u64>) -> Result<u64> {
        let result = change(&mut self.state());
        self.changed.notify_all();
        result
    }

    fn connections(&self) -> MutexGuard<'_, HashMap<u64, TcpStream>> {
        self.connections.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The fake API server; it stops on drop.
pub struct FakeApiServer {
    shared: Arc<Shared>,
    address: SocketAddr,
    acceptor: Option<JoinHandle<()>>,
}

impl FakeApiServer {
    /// Starts serving on a free port of 127.0.0.1, with no objects.
    pub fn start() -> Result<Self> {
        let mut server =
            Self { shared: Arc::default(), address: SocketAddr::from(([127, 0, 0, 1], 0)), acceptor: None };
        server.listen()?;
        Ok(server)
    }

    /// Starts serving on `address` (in the calling thread's network namespace), with no objects.
    pub fn start_on(address: SocketAddr) -> Result<Self> {
        let mut server = Self { shared: Arc::default(), address, acceptor: None };
        server.listen()?;
        Ok(server)
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.address)
    }

    /// Writes a kubeconfig that points at this server (plain HTTP, no credentials).
    pub fn write_kubeconfig(&self, path: &Path) -> Result<()> {
        let kubeconfig = format!(
            "apiVersion: v1\nkind: Config\n\
             clusters:\n- name: fake\n  cluster:\n    server: {}\n\
             users:\n- name: fake\n  user: {{}}\n\
             contexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\n\
             current-context: fake\n",
            self.url()
        );
        std::fs::write(path, kubeconfig).with_context(|| format!("cannot write {}", path.display()))
    }

    /// Adds or replaces an object (ADDED or MODIFIED); returns its new resourceVersion.
    pub fn apply<K: k8s_openapi::Resource + Serialize>(&self, object: &K) -> Result<u64> {
        self.apply_json(serde_json::to_value(object)?)
    }

    /// Adds or replaces an object given as JSON, which need not decode into its kind: only
    /// `apiVersion`, `kind` and `metadata.name` (and `metadata.namespace`) are read.
    pub fn apply_json(&self, mut object: Value) -> Result<u64> {
        let text = |pointer: &str| object.pointer(pointer).and_then(Value::as_str).map(str::to_owned);
        let (api_version, kind) =
            (text("/apiVersion").unwrap_or_default(), text("/kind").unwrap_or_default());
        let collection = Collection::of(&api_version, &kind)
            .ok_or_else(|| anyhow!("the fake API server does not serve {api_version:?} {kind:?}"))?;
        let name = text("/metadata/name").ok_or_else(|| anyhow!("metadata.name is missing: {object}"))?;
        let key = (collection, text("/metadata/namespace"), name);
        self.shared.change(|state| {
            let previous = state.objects.get(&key).cloned();
            let event = if previous.is_some() { "MODIFIED" } else { "ADDED" };
            let resource_version = state.record(collection, event, &mut object, previous)?;
            state.objects.insert(key, object);
            Ok(resource_version)
        })
    }

    /// Deletes an object (DELETED); returns the deletion's resourceVersion.
    pub fn delete<K: k8s_openapi::Resource>(&self, namespace: Option<&str>, name: &str) -> Result<u64> {
        let collection = Collection::of_resource::<K>()?;
        let key = (collection, namespace.map(str::to_owned), name.to_owned());
        self.shared.change(|state| {
            let Some(mut object) = state.objects.remove(&key) else {
                bail!("no {} {namespace:?}/{name} to delete", K::KIND);
            };
            let previous = Some(object.clone());
            state.record(collection, "DELETED", &mut object, previous)
        })
    }

    /// Sends every open watch a BOOKMARK at the current resourceVersion.
    pub fn bookmark(&self) {
        let _ = self.shared.change(|state| {
            state.history.push(Change::Bookmark { resource_version: state.resource_version });
            Ok(state.resource_version)
        });
    }

    /// Forgets the change history, as etcd compaction does: every open watch gets a 410 Gone
    /// ERROR event and ends, and a watch from any earlier version gets 410 Gone, so clients
    /// must relist. Works while the server is stopped too.
    pub fn expire_watches(&self) {
        let _ = self.shared.change(|state| {
            state.history.clear();
            state.history_start = state.resource_version;
            state.expiries += 1;
            Ok(state.resource_version)
        });
    }

    /// Cuts every open connection, as a restarting API server or a load balancer does.
    pub fn drop_connections(&self) {
        let _ = self.shared.change(|state| {
            state.disconnects += 1;
            Ok(state.resource_version)
        });
        for connection in self.shared.connections().values() {
            let _ = connection.shutdown(Shutdown::Both);
        }
    }

    /// Makes requests for `collection` fail with 500 Internal Server Error, or serve again.
    /// (Not 503: kube's client retries 429/503/504 by itself for minutes.)
    pub fn set_failing(&self, collection: Collection, failing: bool) {
        let _ = self.shared.change(|state| {
            if failing {
                state.failing.insert(collection);
            } else {
                state.failing.remove(&collection);
            }
            Ok(state.resource_version)
        });
    }

    /// Makes requests for `collection` answer 404 Not Found, as an API server without that API
    /// (ServiceCIDRs before 1.33), or serve again.
    pub fn set_served(&self, collection: Collection, served: bool) {
        let _ = self.shared.change(|state| {
            if served {
                state.not_served.remove(&collection);
            } else {
                state.not_served.insert(collection);
            }
            Ok(state.resource_version)
        });
    }

    /// Makes requests for `collection` answer 403 Forbidden, as when RBAC does not grant it, or
    /// serve again.
    pub fn set_forbidden(&self, collection: Collection, forbidden: bool) {
        let _ = self.shared.change(|state| {
            if forbidden {
                state.forbidden.insert(collection);
            } else {
                state.forbidden.remove(&collection);
            }
            Ok(state.resource_version)
        });
    }

    /// The objects of `collection` now stored (Events as vipr created and patched them), in
    /// namespace and name order.
    pub fn objects(&self, collection: Collection) -> Vec<Value> {
        let state = self.shared.state();
        state
            .objects
            .iter()
            .filter(|((stored, _, _), _)| *stored == collection)
            .map(|(_, o)| o.clone())
            .collect()
    }

    /// How many lists of `collection` were served: a relist shows as one more.
    pub fn lists_served(&self, collection: Collection) -> usize {
        self.shared.state().lists_served.get(&collection).copied().unwrap_or(0)
    }

    /// How many watches of `collection` are streaming: changes from now on reach them.
    pub fn watches_open(&self, collection: Collection) -> usize {
        self.shared.state().watches_open.get(&collection).copied().unwrap_or(0)
    }

    /// Stops listening and cuts every connection; objects and history are kept.
    pub fn stop(&mut self) {
        self.shared.accepting.store(false, Ordering::SeqCst);
        if let Some(acceptor) = self.acceptor.take() {
            let _ = acceptor.join();
        }
        self.drop_connections();
    }

    /// Serves again on the same port, with the objects and history it had.
    pub fn restart(&mut self) -> Result<()> {
        self.stop();
        self.listen()
    }

    fn listen(&mut self) -> Result<()> {
        let listener =
            TcpListener::bind(self.address).with_context(|| format!("cannot listen on {}", self.address))?;
        listener.set_nonblocking(true)?;
        self.address = listener.local_addr()?;
        self.shared.accepting.store(true, Ordering::SeqCst);
        let shared = self.shared.clone();
        self.acceptor = Some(
            thread::Builder::new().name("fake-apiserver".into()).spawn(move || accept(&listener, &shared))?,
        );
        Ok(())
    }
}

impl Drop for FakeApiServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Accepts connections until the server stops, each served on its own thread.
fn accept(listener: &TcpListener, shared: &Arc<Shared>) {
    while shared.accepting.load(Ordering::SeqCst) {
        let stream = match listener.accept() {
            Ok((stream, _)) => stream,
            Err(_) => {
                // WouldBlock, or a connection that went away before being accepted.
                thread::sleep(ACCEPT_POLL);
                continue;
            }
        };
        let Ok(registered) = stream.try_clone() else { continue };
        let id = shared.next_connection.fetch_add(1, Ordering::Relaxed);
        shared.connections().insert(id, registered);
        let connection_shared = shared.clone();
        let spawned = thread::Builder::new().name("fake-apiserver-conn".into()).spawn(move || {
            // An I/O error means the client went away or was cut off: nothing to answer.
            let _ = serve(stream, &connection_shared);
            connection_shared.connections().remove(&id);
        });
        if spawned.is_err() {
            shared.connections().remove(&id);
        }
    }
}

struct Request {
    method: String,
    path: String,
    query: HashMap<String, String>,
    content_type: String,
    /// `Content-Length` bytes of body (none for a GET).
    body: Vec<u8>,
}

/// The largest request body accepted: an Event is a few kB.
const MAX_BODY: usize = 1 << 20;

fn serve(mut stream: TcpStream, shared: &Shared) -> io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(IO_TIMEOUT))?;
    stream.set_write_timeout(Some(IO_TIMEOUT))?;
    let Some(request) = read_request(&stream)? else {
        return write_status(&mut stream, 400, "BadRequest", "malformed request");
    };
    if let Some(namespaced) = request.path.strip_prefix("/apis/events.k8s.io/v1/namespaces/") {
        if request.method != "GET" {
            return write_event(&mut stream, shared, &request, namespaced);
        }
    }
    if request.method != "GET" {
        return write_status(
            &mut stream,
            405,
            "MethodNotAllowed",
            "the fake API server only serves GET, and POST and PATCH of Events",
        );
    }
    if request.path == "/version" {
        let version =
            json!({"major": "1", "minor": "33", "gitVersion": "v1.33.0-fake", "platform": "linux/amd64"});
        return write_json(&mut stream, 200, &version);
    }
    let Some(collection) =
        Collection::SERVED.into_iter().find(|collection| collection.path() == request.path)
    else {
        return write_status(
            &mut stream,
            404,
            "NotFound",
            &format!("the fake API server does not serve {}", request.path),
        );
    };
    if shared.state().not_served.contains(&collection) {
        return write_status(
            &mut stream,
            404,
            "NotFound",
            "the server could not find the requested resource",
        );
    }
    if shared.state().forbidden.contains(&collection) {
        return write_status(
            &mut stream,
            403,
            "Forbidden",
            &format!("the test's ServiceAccount may not list {}", request.path),
        );
    }
    let query = |name: &str| request.query.get(name).map_or("", String::as_str);
    let selector = match Selector::parse(collection, query("labelSelector"), query("fieldSelector")) {
        Ok(selector) => selector,
        Err(message) => return write_status(&mut stream, 400, "BadRequest", &message),
    };
    if shared.state().failing.contains(&collection) {
        return write_status(&mut stream, 500, "InternalError", "the test made this collection fail");
    }
    if matches!(request.query.get("watch").map(String::as_str), Some("true" | "1")) {
        let from =
            request.query.get("resourceVersion").and_then(|version| version.parse().ok()).filter(|v| *v != 0);
        watch(&mut stream, shared, collection, &selector, from)
    } else {
        let page = match Page::parse(collection, query("limit"), query("continue")) {
            Ok(page) => page,
            Err(message) => return write_status(&mut stream, 400, "BadRequest", &message),
        };
        list(&mut stream, shared, collection, &selector, &page)
    }
}

/// The part of a list a request asks for, as the real server pages a list: at most `limit`
/// objects (kube-rs's watcher asks for 500), after the key a `continue` token names, at the
/// first page's resourceVersion. Unlike the real server's, later pages show the objects as
/// they are now rather than a snapshot: what changed meanwhile comes again from the watch that
/// follows, from that version.
#[derive(Debug, Default, PartialEq)]
struct Page {
    limit: Option<usize>,
    /// From the `continue` token: the first page's resourceVersion and the last key it sent.
    after: Option<(u64, ObjectKey)>,
}

impl Page {
    fn parse(collection: Collection, limit: &str, token: &str) -> Result<Self, String> {
        let limit = match limit {
            "" | "0" => None,
            limit => Some(limit.parse().map_err(|_| format!("invalid limit {limit:?}"))?),
        };
        let after = match token {
            "" => None,
            token => {
                let invalid = || format!("invalid continue token {token:?}");
                let mut parts = token.splitn(3, '|');
                let (Some(version), Some(namespace), Some(name)) = (parts.next(), parts.next(), parts.next())
                else {
                    return Err(invalid());
                };
                let version = version.parse().map_err(|_| invalid())?;
                let namespace = (!namespace.is_empty()).then(|| namespace.to_owned());
                Some((version, (collection, namespace, name.to_owned())))
            }
        };
        Ok(Self { limit, after })
    }

    /// The token that continues after `key`, at `version`.
    fn token(version: u64, (_, namespace, name): &ObjectKey) -> String {
        format!("{version}|{}|{name}", namespace.as_deref().unwrap_or_default())
    }
}

/// Reads the request line, headers and `Content-Length` body; `None` if they are not HTTP.
fn read_request(stream: &TcpStream) -> io::Result<Option<Request>> {
    let mut reader = BufReader::new(stream);
    let mut request_line = String::new();
    reader.read_line(&mut request_line)?;
    let (mut content_length, mut content_type) = (0, String::new());
    for _ in 0..MAX_HEADER_LINES {
        let mut header = String::new();
        if reader.read_line(&mut header)? == 0 || header.trim_end().is_empty() {
            break;
        }
        let Some((name, value)) = header.split_once(':') else { continue };
        match name.trim().to_ascii_lowercase().as_str() {
            "content-length" => content_length = value.trim().parse().unwrap_or(usize::MAX),
            "content-type" => content_type = value.trim().to_owned(),
            _ => {}
        }
    }
    if content_length > MAX_BODY {
        return Ok(None);
    }
    let mut body = vec![0; content_length];
    std::io::Read::read_exact(&mut reader, &mut body)?;
    let mut parts = request_line.split_whitespace();
    let (Some(method), Some(target), Some(_version)) = (parts.next(), parts.next(), parts.next()) else {
        return Ok(None);
    };
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let query = query
        .split('&')
        .filter(|pair| !pair.is_empty())
        .map(|pair| {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            (percent_decode(key), percent_decode(value))
        })
        .collect();
    Ok(Some(Request { method: method.to_owned(), path: path.to_owned(), query, content_type, body }))
}

/// `POST /apis/events.k8s.io/v1/namespaces/NS/events` and `PATCH .../NS/events/NAME`, as the
/// real API server answers them; `namespaced` is the path after `namespaces/`.
fn write_event(
    stream: &mut TcpStream,
    shared: &Shared,
    request: &Request,
    namespaced: &str,
) -> io::Result<()> {
    let (namespace, name) = match namespaced.split('/').collect::<Vec<_>>()[..] {
        [namespace, "events"] => (namespace, None),
        [namespace, "events", name] => (namespace, Some(name)),
        _ => return write_status(stream, 404, "NotFound", &format!("no such path {}", request.path)),
    };
    {
        let state = shared.state();
        let refusal = if state.not_served.contains(&Collection::Events) {
            Some((404, "NotFound", "the server could not find the requested resource".to_owned()))
        } else if state.forbidden.contains(&Collection::Events) {
            let verb = if name.is_some() { "patch" } else { "create" };
            let message = format!(
                "events.events.k8s.io is forbidden: the test's ServiceAccount cannot {verb} resource \"events\" \
                 in API group \"events.k8s.io\" in the namespace \"{namespace}\""
            );
            Some((403, "Forbidden", message))
        } else if state.failing.contains(&Collection::Events) {
            Some((500, "InternalError", "the test made this collection fail".to_owned()))
        } else {
            None
        };
        if let Some((code, reason, message)) = refusal {
            drop(state);
            return write_status(stream, code, reason, &message);
        }
    }
    let Ok(body) = serde_json::from_slice::<Value>(&request.body) else {
        return write_status(stream, 400, "BadRequest", "the request body is not JSON");
    };
    match (request.method.as_str(), name) {
        ("POST", None) => create_event(stream, shared, namespace, body),
        ("PATCH", Some(name)) => {
            if request.content_type != "application/merge-patch+json" {
                let message = format!(
                    "the fake API server only takes JSON merge patches, not {:?}",
                    request.content_type
                );
                return write_status(stream, 415, "UnsupportedMediaType", &message);
            }
            patch_event(stream, shared, namespace, name, &body)
        }
        _ => write_status(stream, 405, "MethodNotAllowed", &format!("{} {}", request.method, request.path)),
    }
}

fn create_event(
    stream: &mut TcpStream,
    shared: &Shared,
    namespace: &str,
    mut event: Value,
) -> io::Result<()> {
    let text = |pointer: &str| event.pointer(pointer).and_then(Value::as_str).map(str::to_owned);
    if (text("/apiVersion").as_deref(), text("/kind").as_deref()) != (Some("events.k8s.io/v1"), Some("Event"))
    {
        return write_status(stream, 400, "BadRequest", "the body is not an events.k8s.io/v1 Event");
    }
    if text("/metadata/namespace").is_some_and(|given| given != namespace) {
        let message = "the namespace of the provided object does not match the namespace sent on the request";
        return write_status(stream, 400, "BadRequest", message);
    }
    // The real server validates these (eventTime, reportingController, action and reason are
    // required of events.k8s.io/v1 Events).
    for required in
        ["/metadata/name", "/eventTime", "/reportingController", "/reportingInstance", "/action", "/reason"]
    {
        if event.pointer(required).is_none_or(Value::is_null) {
            let message = format!("Event.events.k8s.io is invalid: {required}: Required value");
            return write_status(stream, 422, "Invalid", &message);
        }
    }
    let name = text("/metadata/name").unwrap_or_default();
    let key = (Collection::Events, Some(namespace.to_owned()), name.clone());
    let created = shared.change(|state| {
        if state.objects.contains_key(&key) {
            bail!("exists");
        }
        let uid = format!("00000000-0000-4000-8000-{:012x}", state.resource_version + 1);
        let metadata =
            event.get_mut("metadata").and_then(Value::as_object_mut).ok_or_else(|| anyhow!("no metadata"))?;
        metadata.insert("namespace".into(), namespace.into());
        metadata.insert("uid".into(), uid.into());
        metadata.insert("creationTimestamp".into(), "2026-01-01T00:00:00Z".into());
        let version = state.record(Collection::Events, "ADDED", &mut event, None)?;
        state.objects.insert(key.clone(), event.clone());
        Ok(version)
    });
    if created.is_err() {
        let mut status =
            status(409, "AlreadyExists", &format!("events.events.k8s.io \"{name}\" already exists"));
        status["details"] = json!({"name": name, "group": "events.k8s.io", "kind": "events"});
        return write_json(stream, 409, &status);
    }
    write_json(stream, 201, &event)
}

fn patch_event(
    stream: &mut TcpStream,
    shared: &Shared,
    namespace: &str,
    name: &str,
    patch: &Value,
) -> io::Result<()> {
    let key = (Collection::Events, Some(namespace.to_owned()), name.to_owned());
    let mut patched = None;
    let _ = shared.change(|state| {
        let Some(previous) = state.objects.get(&key).cloned() else { bail!("not found") };
        let mut object = previous.clone();
        merge_patch(&mut object, patch);
        // Identity is the server's, whatever the patch says.
        for field in ["name", "namespace", "uid", "creationTimestamp"] {
            object["metadata"][field] = previous["metadata"][field].clone();
        }
        let version = state.record(Collection::Events, "MODIFIED", &mut object, Some(previous))?;
        state.objects.insert(key.clone(), object.clone());
        patched = Some(object);
        Ok(version)
    });
    match patched {
        Some(object) => write_json(stream, 200, &object),
        None => write_status(stream, 404, "NotFound", &format!("events.events.k8s.io \"{name}\" not found")),
    }
}

/// RFC 7386 JSON merge patch: objects merge member by member, `null` deletes, anything else
/// replaces.
fn merge_patch(target: &mut Value, patch: &Value) {
    let Value::Object(members) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = json!({});
    }
    let Value::Object(target) = target else { return };
    for (name, value) in members {
        if value.is_null() {
            target.remove(name);
        } else {
            merge_patch(target.entry(name.clone()).or_insert(Value::Null), value);
        }
    }
}

/// Decodes `%XX` escapes and `+` of a URL query component.
fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut decoded = Vec::with_capacity(bytes.len());
    let mut index = 0;
    while index < bytes.len() {
        let escaped = (bytes[index] == b'%')
            .then(|| text.get(index + 1..index + 3))
            .flatten()
            .and_then(|hex| u8::from_str_radix(hex, 16).ok());
        match (escaped, bytes[index]) {
            (Some(byte), _) => {
                decoded.push(byte);
                index += 3;
            }
            (None, b'+') => {
                decoded.push(b' ');
                index += 1;
            }
            (None, byte) => {
                decoded.push(byte);
                index += 1;
            }
        }
    }
    String::from_utf8_lossy(&decoded).into_owned()
}

/// One requirement of a label selector, as the API server's `labels.Parse` reads it.
#[derive(Debug, PartialEq)]
enum LabelRequirement {
    Exists(String),
    DoesNotExist(String),
    In(String, Vec<String>),
    /// Also matches objects without the label, as `!=` does.
    NotIn(String, Vec<String>),
}

impl LabelRequirement {
    fn matches(&self, labels: Option<&serde_json::Map<String, Value>>) -> bool {
        let value = |key: &str| labels.and_then(|labels| labels.get(key)).and_then(Value::as_str);
        match self {
            Self::Exists(key) => value(key).is_some(),
            Self::DoesNotExist(key) => value(key).is_none(),
            Self::In(key, values) => value(key).is_some_and(|value| values.iter().any(|v| v == value)),
            Self::NotIn(key, values) => value(key).is_none_or(|value| values.iter().all(|v| v != value)),
        }
    }
}

/// Splits a label selector at the commas outside `( )`.
fn label_terms(selector: &str) -> Vec<&str> {
    let mut terms = Vec::new();
    let (mut depth, mut start) = (0usize, 0);
    for (index, character) in selector.char_indices() {
        match character {
            '(' => depth += 1,
            ')' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                terms.push(&selector[start..index]);
                start = index + 1;
            }
            _ => {}
        }
    }
    terms.push(&selector[start..]);
    terms.into_iter().map(str::trim).filter(|term| !term.is_empty()).collect()
}

fn label_requirement(term: &str) -> Result<LabelRequirement, String> {
    let invalid = || format!("unable to parse requirement: {term:?}");
    let key = |key: &str| {
        let key = key.trim();
        let valid = !key.is_empty()
            && key.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/'));
        valid.then(|| key.to_owned()).ok_or_else(invalid)
    };
    let value = |value: &str| {
        let value = value.trim();
        let valid = value.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
        valid.then(|| value.to_owned()).ok_or_else(invalid)
    };
    if let Some(name) = term.strip_prefix('!') {
        return Ok(LabelRequirement::DoesNotExist(key(name)?));
    }
    if let Some((name, wanted)) = term.split_once("!=") {
        return Ok(LabelRequirement::NotIn(key(name)?, vec![value(wanted)?]));
    }
    if let Some((name, wanted)) = term.split_once("==").or_else(|| term.split_once('=')) {
        return Ok(LabelRequirement::In(key(name)?, vec![value(wanted)?]));
    }
    for (operator, negated) in [(" notin ", true), (" in ", false)] {
        if let Some((name, set)) = term.split_once(operator) {
            let set =
                set.trim().strip_prefix('(').and_then(|set| set.strip_suffix(')')).ok_or_else(invalid)?;
            let values = set.split(',').map(value).collect::<Result<Vec<_>, _>>()?;
            return Ok(if negated {
                LabelRequirement::NotIn(key(name)?, values)
            } else {
                LabelRequirement::In(key(name)?, values)
            });
        }
    }
    Ok(LabelRequirement::Exists(key(term)?))
}

/// One term of a field selector: the field's JSON pointer, the value, and whether it must
/// equal (`=`, `==`) or differ (`!=`).
#[derive(Debug, PartialEq)]
struct FieldRequirement {
    pointer: String,
    value: String,
    equal: bool,
}

fn field_requirement(collection: Collection, term: &str) -> Result<FieldRequirement, String> {
    let (field, value, equal) = if let Some((field, value)) = term.split_once("!=") {
        (field, value, false)
    } else if let Some((field, value)) = term.split_once("==").or_else(|| term.split_once('=')) {
        (field, value, true)
    } else {
        return Err(format!("invalid selector: '{term}'; can't understand '{term}'"));
    };
    let field = field.trim();
    if !["metadata.name", "metadata.namespace"].contains(&field)
        && !collection.selectable_fields().contains(&field)
    {
        return Err(format!("field label not supported: {field}"));
    }
    Ok(FieldRequirement {
        pointer: format!("/{}", field.replace('.', "/")),
        value: value.trim().to_owned(),
        equal,
    })
}

/// A list or watch's label and field selectors: every requirement must hold.
#[derive(Debug, Default)]
struct Selector {
    labels: Vec<LabelRequirement>,
    fields: Vec<FieldRequirement>,
}

impl Selector {
    fn parse(collection: Collection, labels: &str, fields: &str) -> Result<Self, String> {
        let labels = label_terms(labels).into_iter().map(label_requirement).collect::<Result<_, _>>()?;
        let fields = fields
            .split(',')
            .map(str::trim)
            .filter(|term| !term.is_empty())
            .map(|term| field_requirement(collection, term))
            .collect::<Result<_, _>>()?;
        Ok(Self { labels, fields })
    }

    fn matches(&self, object: &Value) -> bool {
        let labels = object.pointer("/metadata/labels").and_then(Value::as_object);
        self.labels.iter().all(|requirement| requirement.matches(labels))
            && self.fields.iter().all(|requirement| {
                // An absent field selects as the empty string, as the API server's field sets.
                let value = object.pointer(&requirement.pointer).and_then(Value::as_str).unwrap_or_default();
                (value == requirement.value) == requirement.equal
            })
    }
}

fn list(
    stream: &mut TcpStream,
    shared: &Shared,
    collection: Collection,
    selector: &Selector,
    page: &Page,
) -> io::Result<()> {
    use std::ops::Bound;
    let body = {
        let mut state = shared.state();
        if page.after.is_none() {
            *state.lists_served.entry(collection).or_default() += 1;
        }
        let (version, start) = match &page.after {
            Some((version, key)) => (*version, Bound::Excluded(key.clone())),
            None => (state.resource_version, Bound::Included((collection, None, String::new()))),
        };
        let limit = page.limit.unwrap_or(usize::MAX);
        let mut matching = state
            .objects
            .range((start, Bound::Unbounded))
            .take_while(|((stored, _, _), _)| *stored == collection)
            .filter(|(_, object)| selector.matches(object));
        let items: Vec<(&ObjectKey, &Value)> = matching.by_ref().take(limit).collect();
        let mut metadata = json!({"resourceVersion": version.to_string()});
        if let (Some((last, _)), Some(_)) = (items.last(), matching.next()) {
            metadata["continue"] = Page::token(version, last).into();
        }
        let items: Vec<&Value> = items.into_iter().map(|(_, object)| object).collect();
        json!({
            "kind": format!("{}List", collection.kind()),
            "apiVersion": collection.api_version(),
            "metadata": metadata,
            "items": items,
        })
    };
    write_json(stream, 200, &body)
}

/// Streams the changes after `from` (or the current objects, then changes from now, when
/// `from` is `None`) until the watch is expired, the connection dropped or the client gone.
fn watch(
    stream: &mut TcpStream,
    shared: &Shared,
    collection: Collection,
    selector: &Selector,
    from: Option<u64>,
) -> io::Result<()> {
    write!(
        stream,
        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    )?;
    let mut state = shared.state();
    let (mut position, initial): (usize, Vec<Value>) = match from {
        Some(version) if version < state.history_start => {
            let message = format!("too old resource version: {version} ({})", state.history_start);
            drop(state);
            return end_with_gone(stream, &message);
        }
        Some(version) => {
            (state.history.partition_point(|change| change.resource_version() <= version), Vec::new())
        }
        None => (
            state.history.len(),
            state
                .objects
                .iter()
                .filter(|((stored, _, _), object)| *stored == collection && selector.matches(object))
                .map(|(_, object)| json!({"type": "ADDED", "object": object}))
                .collect(),
        ),
    };
    let (expiries, disconnects) = (state.expiries, state.disconnects);
    *state.watches_open.entry(collection).or_default() += 1;
    drop(state);
    let _open = OpenWatch { shared, collection };
    write_events(stream, &initial)?;
    loop {
        let events: Vec<Value> = {
            let mut state = shared.state();
            loop {
                if state.disconnects != disconnects {
                    return Ok(());
                }
                if state.expiries != expiries {
                    drop(state);
                    return end_with_gone(stream, "the test expired every watch");
                }
                if position < state.history.len() {
                    break;
                }
                state = shared.changed.wait(state).unwrap_or_else(PoisonError::into_inner);
            }
            let events = state.history[position..]
                .iter()
                .filter_map(|change| change.event_for(collection, selector))
                .collect();
            position = state.history.len();
            events
        };
        write_events(stream, &events)?;
    }
}

/// Counts a watch in `watches_open` until it ends.
struct OpenWatch<'a> {
    shared: &'a Shared,
    collection: Collection,
}

impl Drop for OpenWatch<'_> {
    fn drop(&mut self) {
        if let Some(open) = self.shared.state().watches_open.get_mut(&self.collection) {
            *open -= 1;
        }
    }
}

fn write_events(stream: &mut TcpStream, events: &[Value]) -> io::Result<()> {
    for event in events {
        let line = event_line(event);
        write!(stream, "{:x}\r\n{line}\r\n", line.len())?;
    }
    stream.flush()
}

/// A watch event on one line, `type` before `object` as the API server writes it (Go's field
/// order; `json!`'s map would sort `object` first). A client that decodes the event in one
/// pass then reads the object straight into its type; with `object` first, serde must buffer
/// the whole object before it knows which variant it is, a cost the real API server does not
/// cause.
fn event_line(event: &Value) -> String {
    match (event.get("type"), event.get("object")) {
        (Some(kind), Some(object)) if event.as_object().is_some_and(|fields| fields.len() == 2) => {
            format!("{{\"type\":{kind},\"object\":{object}}}\n")
        }
        _ => format!("{event}\n"),
    }
}

/// Sends the API server's 410 Gone ERROR event and ends the stream.
fn end_with_gone(stream: &mut TcpStream, message: &str) -> io::Result<()> {
    write_events(stream, &[json!({"type": "ERROR", "object": status(410, "Expired", message)})])?;
    stream.write_all(b"0\r\n\r\n")?;
    stream.flush()
}

/// A `meta/v1` Status, the body of every API error.
fn status(code: u16, reason: &str, message: &str) -> Value {
    json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    })
}

fn write_status(stream: &mut TcpStream, code: u16, reason: &str, message: &str) -> io::Result<()> {
    write_json(stream, code, &status(code, reason, message))
}

fn write_json(stream: &mut TcpStream, code: u16, body: &Value) -> io::Result<()> {
    let phrase = match code {
        200 => "OK",
        201 => "Created",
        400 => "Bad Request",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        409 => "Conflict",
        410 => "Gone",
        415 => "Unsupported Media Type",
        422 => "Unprocessable Entity",
        500 => "Internal Server Error",
        _ => "Error",
    };
    let body = body.to_string();
    write!(
        stream,
        "HTTP/1.1 {code} {phrase}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    stream.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Watch events are written as the API server writes them, `type` first.
    #[test]
    fn watch_events_name_their_type_first() {
        let event = json!({"type": "ADDED", "object": {"kind": "Service", "metadata": {"name": "web"}}});
        let line = event_line(&event);
        assert!(line.starts_with(r#"{"type":"ADDED","object":{"#), "{line}");
        assert_eq!(serde_json::from_str::<Value>(&line).unwrap(), event);
        let other = json!({"kind": "Status"});
        assert_eq!(event_line(&other), format!("{other}\n"));
    }

    /// One request to `server`: the status code and the JSON body.
    fn request(
        server: &FakeApiServer,
        method: &str,
        path: &str,
        content_type: &str,
        body: &Value,
    ) -> (u16, Value) {
        use std::io::Read as _;
        let mut stream = TcpStream::connect(server.address).unwrap();
        let body = body.to_string();
        write!(
            stream,
            "{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut response = String::new();
        stream.read_to_string(&mut response).unwrap();
        let code = response.split_whitespace().nth(1).unwrap().parse().unwrap();
        let (_, body) = response.split_once("\r\n\r\n").unwrap();
        (code, serde_json::from_str(body).unwrap())
    }

    /// A list is paged as the real server pages it: `limit` objects a page, a `continue`
    /// token while more follow, every page at the first one's resourceVersion.
    #[test]
    fn lists_are_paged_with_continue_tokens() {
        let server = FakeApiServer::start().unwrap();
        for name in ["a", "b", "c"] {
            server
                .apply_json(json!({
                    "apiVersion": "v1", "kind": "Service",
                    "metadata": {"name": name, "namespace": "default"},
                    "spec": {"clusterIP": "10.96.0.1", "ports": [{"port": 80}]},
                }))
                .unwrap();
        }
        let json = "application/json";
        let names = |list: &Value| -> Vec<String> {
            list["items"]
                .as_array()
                .unwrap()
                .iter()
                .map(|item| item["metadata"]["name"].to_string())
                .collect()
        };
        let (code, first) = request(&server, "GET", "/api/v1/services?limit=2", json, &Value::Null);
        assert_eq!(code, 200, "{first}");
        assert_eq!(names(&first), [r#""a""#, r#""b""#]);
        let token = first["metadata"]["continue"].as_str().unwrap().to_owned();
        let version = first["metadata"]["resourceVersion"].clone();
        server
            .apply_json(json!({
                "apiVersion": "v1", "kind": "Service",
                "metadata": {"name": "d", "namespace": "default"},
                "spec": {"clusterIP": "10.96.0.2", "ports": [{"port": 80}]},
            }))
            .unwrap();
        let next = format!("/api/v1/services?limit=2&continue={}", token.replace('|', "%7C"));
        let (code, second) = request(&server, "GET", &next, json, &Value::Null);
        assert_eq!(code, 200, "{second}");
        assert_eq!(names(&second), [r#""c""#, r#""d""#]);
        assert_eq!(second["metadata"]["resourceVersion"], version, "the first page's version");
        assert!(second["metadata"].get("continue").is_none(), "{second}");
        let (_, whole) = request(&server, "GET", "/api/v1/services", json, &Value::Null);
        assert_eq!(names(&whole).len(), 4);
        assert!(whole["metadata"].get("continue").is_none());
        assert_eq!(server.lists_served(Collection::Services), 2, "pages after the first are one list");
        let bad = request(&server, "GET", "/api/v1/services?continue=x", json, &Value::Null);
        assert_eq!(bad.0, 400);
    }

    #[test]
    fn events_are_created_once_patched_and_refused_as_the_api_server_does() {
        let server = FakeApiServer::start().unwrap();
        let events = "/apis/events.k8s.io/v1/namespaces/default/events";
        let event = json!({
            "apiVersion": "events.k8s.io/v1", "kind": "Event",
            "metadata": {"name": "node-a.1"},
            "eventTime": "2026-01-01T00:00:00.000000Z", "reportingController": "vipr",
            "reportingInstance": "node-a", "action": "Start", "reason": "Starting",
            "regarding": {"kind": "Node", "name": "node-a"},
        });
        let json = "application/json";
        let (code, created) = request(&server, "POST", events, json, &event);
        assert_eq!(code, 201, "{created}");
        assert_eq!(created["metadata"]["namespace"], "default");
        assert!(created["metadata"]["uid"].is_string() && created["metadata"]["resourceVersion"].is_string());
        let (code, conflict) = request(&server, "POST", events, json, &event);
        assert_eq!((code, &conflict["reason"]), (409, &json!("AlreadyExists")), "{conflict}");
        let mut missing_reason = event.clone();
        missing_reason["metadata"]["name"] = "node-a.2".into();
        missing_reason.as_object_mut().unwrap().remove("reason");
        assert_eq!(request(&server, "POST", events, json, &missing_reason).0, 422);
        let other_namespace = "/apis/events.k8s.io/v1/namespaces/shop/events";
        let mut in_default = event.clone();
        in_default["metadata"]["namespace"] = "default".into();
        assert_eq!(request(&server, "POST", other_namespace, json, &in_default).0, 400);

        let series = json!({"series": {"count": 2, "lastObservedTime": "2026-01-01T00:10:00.000000Z"}});
        let merge = "application/merge-patch+json";
        let (code, patched) = request(&server, "PATCH", &format!("{events}/node-a.1"), merge, &series);
        assert_eq!(code, 200, "{patched}");
        assert_eq!(patched["series"]["count"], 2);
        assert_eq!(patched["reason"], "Starting", "a merge patch keeps the rest");
        assert_eq!(request(&server, "PATCH", &format!("{events}/node-a.1"), json, &series).0, 415);
        assert_eq!(request(&server, "PATCH", &format!("{events}/nothing"), merge, &series).0, 404);
        assert_eq!(server.objects(Collection::Events), [patched]);

        server.set_forbidden(Collection::Events, true);
        let mut another = event.clone();
        another["metadata"]["name"] = "node-a.3".into();
        assert_eq!(request(&server, "POST", events, json, &another).0, 403);
        assert_eq!(server.objects(Collection::Events).len(), 1);
    }

    #[test]
    fn merge_patch_follows_rfc_7386() {
        let mut target = json!({"a": "b", "c": {"d": "e", "f": "g"}, "series": null});
        merge_patch(&mut target, &json!({"a": "z", "c": {"f": null}, "series": {"count": 2}}));
        assert_eq!(target, json!({"a": "z", "c": {"d": "e"}, "series": {"count": 2}}));
    }

    #[test]
    fn query_components_are_percent_decoded() {
        assert_eq!(percent_decode("metadata.name%3Dnode-a"), "metadata.name=node-a");
        assert_eq!(percent_decode("a+b%2"), "a b%2");
    }

    #[test]
    fn field_selector_matches_name_and_namespace() {
        let selector =
            Selector::parse(Collection::Nodes, "", "metadata.name=web,metadata.namespace==shop").unwrap();
        assert!(selector.matches(&json!({"metadata": {"name": "web", "namespace": "shop"}})));
        assert!(!selector.matches(&json!({"metadata": {"name": "web", "namespace": "other"}})));
        assert!(Selector::parse(Collection::Nodes, "", "spec.nodeName=a").is_err());
        assert!(Selector::parse(Collection::Nodes, "", "spec.clusterIP!=None").is_err(), "not a Node field");
    }

    #[test]
    fn field_selector_inequality_on_service_cluster_ip() {
        let selector = Selector::parse(Collection::Services, "", "spec.clusterIP!=None").unwrap();
        assert!(selector.matches(&json!({"metadata": {"name": "a"}, "spec": {"clusterIP": "10.96.0.1"}})));
        assert!(!selector.matches(&json!({"metadata": {"name": "a"}, "spec": {"clusterIP": "None"}})));
        assert!(selector.matches(&json!({"metadata": {"name": "a"}, "spec": {}})), "absent is \"\"");
    }

    #[test]
    fn label_selectors_have_the_api_servers_meaning() {
        let object = |labels: Value| json!({"metadata": {"name": "a", "labels": labels}});
        let matches = |selector: &str, labels: Value| {
            Selector::parse(Collection::Services, selector, "").unwrap().matches(&object(labels))
        };
        let kube_proxy = "!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless";
        assert!(matches(kube_proxy, json!({"app": "web"})));
        assert!(!matches(kube_proxy, json!({"service.kubernetes.io/service-proxy-name": "other"})));
        assert!(!matches(kube_proxy, json!({"service.kubernetes.io/headless": ""})));
        assert!(matches("proxy=vipr", json!({"proxy": "vipr"})));
        assert!(matches("proxy==vipr", json!({"proxy": "vipr"})));
        assert!(!matches("proxy=vipr", json!({})));
        assert!(matches("proxy!=vipr", json!({})), "!= matches an absent label");
        assert!(!matches("proxy!=vipr", json!({"proxy": "vipr"})));
        assert!(matches("proxy", json!({"proxy": ""})));
        assert!(matches("tier in (a, b),x notin (c)", json!({"tier": "b"})));
        assert!(!matches("tier in (a,b)", json!({"tier": "c"})));
        assert!(Selector::parse(Collection::Services, "a b", "").is_err());
    }

    #[test]
    fn a_watch_under_a_selector_sees_objects_enter_and_leave_it() {
        let selector = Selector::parse(Collection::Services, "!proxy", "").unwrap();
        let object =
            |labels: Value| json!({"metadata": {"name": "a", "resourceVersion": "1", "labels": labels}});
        let change = |event, object: Value, previous: Option<Value>| Change::Object {
            resource_version: 7,
            collection: Collection::Services,
            event,
            object,
            previous,
        };
        let event = |change: Change| change.event_for(Collection::Services, &selector);
        let unlabelled = object(json!({}));
        let labelled = object(json!({"proxy": "x"}));
        let leaves = event(change("MODIFIED", labelled.clone(), Some(unlabelled.clone()))).unwrap();
        assert_eq!(leaves["type"], "DELETED");
        assert_eq!(leaves["object"]["metadata"]["labels"], json!({}), "the content the watch last saw");
        assert_eq!(leaves["object"]["metadata"]["resourceVersion"], "7");
        let enters = event(change("MODIFIED", unlabelled.clone(), Some(labelled.clone()))).unwrap();
        assert_eq!(enters["type"], "ADDED");
        assert!(event(change("MODIFIED", labelled.clone(), Some(labelled.clone()))).is_none());
        assert!(event(change("DELETED", labelled.clone(), Some(labelled))).is_none());
        assert_eq!(
            event(change("DELETED", unlabelled.clone(), Some(unlabelled))).unwrap()["type"],
            "DELETED"
        );
    }
}
