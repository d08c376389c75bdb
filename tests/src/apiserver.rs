//! A fake Kubernetes API server, for tests with the real kube client.
//!
//! It speaks as much of the API server's list/watch protocol as kube-rs watchers on Services,
//! EndpointSlices and Nodes use, over plain HTTP/1.1 on std threads, one request per
//! connection (`Connection: close`):
//!
//! - `GET /api/v1/services`, `/apis/discovery.k8s.io/v1/endpointslices`, `/api/v1/nodes`,
//!   optionally with `fieldSelector=metadata.name=...,metadata.namespace=...`: a List of the
//!   current objects at the current `metadata.resourceVersion` (`limit` is ignored: one page).
//! - the same with `watch=true&resourceVersion=N`: a chunked stream of newline-delimited watch
//!   events, first every change after N, then changes as they happen, and BOOKMARKs when the
//!   test asks. A watch from a version older than the kept history gets the API server's
//!   410 Gone ERROR event. Without a version (or with "0") the current objects come first as
//!   ADDED events.
//! - `GET /version`.
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
}

impl Collection {
    pub const ALL: [Self; 3] = [Self::Services, Self::EndpointSlices, Self::Nodes];

    /// The cluster-wide URL path.
    fn path(self) -> &'static str {
        match self {
            Self::Services => "/api/v1/services",
            Self::EndpointSlices => "/apis/discovery.k8s.io/v1/endpointslices",
            Self::Nodes => "/api/v1/nodes",
        }
    }

    fn api_version(self) -> &'static str {
        match self {
            Self::Services | Self::Nodes => "v1",
            Self::EndpointSlices => "discovery.k8s.io/v1",
        }
    }

    fn kind(self) -> &'static str {
        match self {
            Self::Services => "Service",
            Self::EndpointSlices => "EndpointSlice",
            Self::Nodes => "Node",
        }
    }

    /// The collection of objects with this apiVersion and kind.
    pub fn of(api_version: &str, kind: &str) -> Option<Self> {
        Self::ALL
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
    Object { resource_version: u64, collection: Collection, event: &'static str, object: Value },
    Bookmark { resource_version: u64 },
}

impl Change {
    fn resource_version(&self) -> u64 {
        match self {
            Self::Object { resource_version, .. } | Self::Bookmark { resource_version } => *resource_version,
        }
    }

    /// The watch event this change is for a watch of `collection` with `selector`, if any.
    fn event_for(&self, collection: Collection, selector: &FieldSelector) -> Option<Value> {
        match self {
            Self::Object { collection: changed, event, object, .. } => (*changed == collection
                && selector.matches(object))
            .then(|| json!({"type": event, "object": object})),
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
    lists_served: HashMap<Collection, usize>,
    watches_open: HashMap<Collection, usize>,
}

impl State {
    /// Stamps a new resourceVersion on `object`, records the change and returns the version.
    fn record(&mut self, collection: Collection, event: &'static str, object: &mut Value) -> Result<u64> {
        let metadata = object
            .get_mut("metadata")
            .and_then(Value::as_object_mut)
            .ok_or_else(|| anyhow!("metadata is not an object"))?;
        self.resource_version += 1;
        let resource_version = self.resource_version;
        metadata.insert("resourceVersion".into(), resource_version.to_string().into());
        self.history.push(Change::Object { resource_version, collection, event, object: object.clone() });
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
            let event = if state.objects.contains_key(&key) { "MODIFIED" } else { "ADDED" };
            let resource_version = state.record(collection, event, &mut object)?;
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
            state.record(collection, "DELETED", &mut object)
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
}

fn serve(mut stream: TcpStream, shared: &Shared) -> io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(IO_TIMEOUT))?;
    stream.set_write_timeout(Some(IO_TIMEOUT))?;
    let Some(request) = read_request(&stream)? else {
        return write_status(&mut stream, 400, "BadRequest", "malformed request");
    };
    if request.method != "GET" {
        return write_status(&mut stream, 405, "MethodNotAllowed", "the fake API server only serves GET");
    }
    if request.path == "/version" {
        let version =
            json!({"major": "1", "minor": "33", "gitVersion": "v1.33.0-fake", "platform": "linux/amd64"});
        return write_json(&mut stream, 200, &version);
    }
    let Some(collection) = Collection::ALL.into_iter().find(|collection| collection.path() == request.path)
    else {
        return write_status(
            &mut stream,
            404,
            "NotFound",
            &format!("the fake API server does not serve {}", request.path),
        );
    };
    let selector = match FieldSelector::parse(request.query.get("fieldSelector").map_or("", String::as_str)) {
        Ok(selector) => selector,
        Err(message) => return write_status(&mut stream, 400, "BadRequest", &message),
    };
    if request.query.get("labelSelector").is_some_and(|selector| !selector.is_empty()) {
        return write_status(
            &mut stream,
            400,
            "BadRequest",
            "the fake API server does not support labelSelector",
        );
    }
    if shared.state().failing.contains(&collection) {
        return write_status(&mut stream, 500, "InternalError", "the test made this collection fail");
    }
    if matches!(request.query.get("watch").map(String::as_str), Some("true" | "1")) {
        let from =
            request.query.get("resourceVersion").and_then(|version| version.parse().ok()).filter(|v| *v != 0);
        watch(&mut stream, shared, collection, &selector, from)
    } else {
        list(&mut stream, shared, collection, &selector)
    }
}

/// Reads the request line and headers of a GET; `None` if they are not HTTP.
fn read_request(stream: &TcpStream) -> io::Result<Option<Request>> {
    let mut reader = BufReader::new(stream);
    let mut request_line = String::new();
    reader.read_line(&mut request_line)?;
    for _ in 0..MAX_HEADER_LINES {
        let mut header = String::new();
        if reader.read_line(&mut header)? == 0 || header.trim_end().is_empty() {
            break;
        }
    }
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
    Ok(Some(Request { method: method.to_owned(), path: path.to_owned(), query }))
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

/// The `metadata.name` / `metadata.namespace` equality terms of a field selector.
struct FieldSelector {
    terms: Vec<(&'static str, String)>,
}

impl FieldSelector {
    fn parse(selector: &str) -> Result<Self, String> {
        let mut terms = Vec::new();
        for term in selector.split(',').filter(|term| !term.is_empty()) {
            let (field, value) = term
                .split_once("==")
                .or_else(|| term.split_once('='))
                .ok_or_else(|| format!("field selector term {term:?} is not FIELD=VALUE"))?;
            let pointer = match field {
                "metadata.name" => "/metadata/name",
                "metadata.namespace" => "/metadata/namespace",
                other => return Err(format!("the fake API server cannot select on field {other:?}")),
            };
            terms.push((pointer, value.to_owned()));
        }
        Ok(Self { terms })
    }

    fn matches(&self, object: &Value) -> bool {
        self.terms.iter().all(|(pointer, value)| {
            object.pointer(pointer).and_then(Value::as_str).unwrap_or_default() == value
        })
    }
}

fn list(
    stream: &mut TcpStream,
    shared: &Shared,
    collection: Collection,
    selector: &FieldSelector,
) -> io::Result<()> {
    let body = {
        let mut state = shared.state();
        *state.lists_served.entry(collection).or_default() += 1;
        let items: Vec<&Value> = state
            .objects
            .iter()
            .filter(|((stored, _, _), object)| *stored == collection && selector.matches(object))
            .map(|(_, object)| object)
            .collect();
        json!({
            "kind": format!("{}List", collection.kind()),
            "apiVersion": collection.api_version(),
            "metadata": {"resourceVersion": state.resource_version.to_string()},
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
    selector: &FieldSelector,
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
        let line = format!("{event}\n");
        write!(stream, "{:x}\r\n{line}\r\n", line.len())?;
    }
    stream.flush()
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
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        410 => "Gone",
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

    #[test]
    fn query_components_are_percent_decoded() {
        assert_eq!(percent_decode("metadata.name%3Dnode-a"), "metadata.name=node-a");
        assert_eq!(percent_decode("a+b%2"), "a b%2");
    }

    #[test]
    fn field_selector_matches_name_and_namespace() {
        let selector = FieldSelector::parse("metadata.name=web,metadata.namespace==shop").unwrap();
        assert!(selector.matches(&json!({"metadata": {"name": "web", "namespace": "shop"}})));
        assert!(!selector.matches(&json!({"metadata": {"name": "web", "namespace": "other"}})));
        assert!(FieldSelector::parse("spec.nodeName=a").is_err());
    }
}
