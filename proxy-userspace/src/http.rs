//! The small HTTP servers of the agent (health, metrics, service health checks), answering
//! from in-memory state: they never touch the dataplane, so a stuck sync cannot stop them from
//! reporting it.
//!
//! They face whoever can reach the node (a health-check node port listens on the node's
//! addresses), so nothing a client does may cost more than a bounded amount of memory, file
//! descriptors or threads, or stop a server:
//! - one async HTTP/1 stack (hyper on tokio) on two threads for every port: one for the
//!   probes (`/healthz`, `/livez`, every health-check node port), one for `/metrics`, which
//!   reads the datapath's counters and may take a while; opening and closing a port is a task
//!   on the probes' thread, never a thread of its own;
//! - at most [`MAX_CONNECTIONS`] connections over all servers and [`MAX_CONNECTIONS_PER_SERVER`]
//!   on one: a new connection over a cap closes the oldest connection of its server (or of the
//!   server holding the most), so a client hoarding connections cannot keep a kubelet or a
//!   load balancer from being answered, and a flood on one port cannot take the others' room;
//! - request headers of at most [`MAX_HEADER_BYTES`] (431 beyond) in at most [`MAX_HEADERS`]
//!   fields; a request body is never read: its connection is closed after the answer;
//! - [`HEADER_READ_TIMEOUT`] to send a complete request head, which is also how long an idle
//!   keep-alive connection stays open, and [`CONNECTION_LIFETIME`] for a whole connection;
//! - accept errors are counted and never stop a listener: out of file descriptors (EMFILE,
//!   ENFILE), the oldest connections of the busiest server are closed to make room; otherwise,
//!   or with none to close, accepting is retried with backoff;
//! - a port that cannot be bound is logged and counted, and nothing here panics.
use std::{
    collections::{BTreeMap, HashMap},
    convert::Infallible,
    io,
    net::SocketAddr,
    sync::{
        atomic::{AtomicU64, Ordering},
        mpsc, Arc, Mutex, PoisonError,
    },
    thread::JoinHandle,
    time::Duration,
};

use bytes::Bytes;
use http_body_util::Full;
use hyper::{
    body::{Body as _, Incoming},
    header::{HeaderName, HeaderValue, CONNECTION, CONTENT_TYPE},
    server::conn::http1,
    service::service_fn,
    Method, Request, Response, StatusCode,
};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::{net::TcpListener, runtime::Handle, sync::oneshot, task::AbortHandle};
use tracing::{debug, error, info, warn};

use crate::metrics::{Collector, Counter, MetricFamily, MetricKind};

/// How long a server waits before binding again an address that was busy (kube-proxy: 5 s).
const BIND_RETRY_INTERVAL: Duration = Duration::from_secs(5);
/// Connections open at once, over all servers.
pub const MAX_CONNECTIONS: usize = 512;
/// Connections open at once on one server (one address and port).
pub const MAX_CONNECTIONS_PER_SERVER: usize = 128;
/// The request line and headers of one request, in bytes.
pub const MAX_HEADER_BYTES: usize = 16 * 1024;
/// Header fields of one request.
pub const MAX_HEADERS: usize = 64;
/// How long a client has to send a complete request head, counted from the connection (or
/// the previous answer on a keep-alive connection): slow senders and idle connections go.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(5);
/// The longest a connection lives, however busy: bounds a client that does not read answers.
pub const CONNECTION_LIFETIME: Duration = Duration::from_secs(60);
/// Backoff after a failed accept, doubling up to the maximum while accepting keeps failing.
const ACCEPT_BACKOFF_MIN: Duration = Duration::from_millis(5);
const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);
/// Pending connections the kernel keeps for a listener while it is busy (the kernel caps it
/// at `net.core.somaxconn`, 4096 by default): a burst of connections waits there rather than
/// having its SYNs dropped, which would make a prober caught in it retry a second later.
const LISTEN_BACKLOG: i32 = 4096;
/// How often a listener that keeps failing to accept says so.
const ACCEPT_WARNING_INTERVAL: Duration = Duration::from_secs(10);
/// Connections closed at once when accepting fails for want of file descriptors: enough for
/// a burst to be taken in few rounds.
const EVICTIONS_PER_EMFILE: usize = 16;
/// How long closing a server waits for its port to be released.
const CLOSE_WAIT: Duration = Duration::from_secs(1);
// hyper's read buffer holds a whole request head; it refuses (panics on) one below 8 KiB.
const _: () = assert!(MAX_HEADER_BYTES >= 8192);

/// An answer: status, content type, extra headers, body.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reply {
    pub status: u16,
    pub content_type: &'static str,
    pub headers: Vec<(&'static str, String)>,
    pub body: String,
}

impl Reply {
    pub const JSON: &'static str = "application/json";
    pub const TEXT: &'static str = "text/plain; charset=utf-8";

    pub fn new(status: u16, content_type: &'static str, body: impl Into<String>) -> Self {
        Self { status, content_type, headers: Vec::new(), body: body.into() }
    }

    pub fn with_header(mut self, name: &'static str, value: impl Into<String>) -> Self {
        self.headers.push((name, value.into()));
        self
    }

    pub fn not_found() -> Self {
        Self::new(404, Self::TEXT, "404 page not found\n")
    }
}

/// Answers a request for `path` (without the query).
pub type Handler = Arc<dyn Fn(&str) -> Reply + Send + Sync>;

/// Which thread serves a server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Workload {
    /// Answers from memory in microseconds: health, liveness, health-check node ports.
    Probes,
    /// May block its thread for a while (`/metrics` reads the datapath's counters).
    Scrapes,
}

/// The runtime every HTTP server of the agent runs on. Cloning shares it; the last clone
/// stops its threads.
#[derive(Clone)]
pub struct HttpRuntime {
    inner: Arc<RuntimeInner>,
}

struct RuntimeInner {
    probes: Lane,
    scrapes: Lane,
    shared: Arc<Shared>,
}

/// One thread driving a single-threaded tokio runtime.
struct Lane {
    handle: Handle,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Lane {
    fn start(name: &str) -> anyhow::Result<Self> {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_io().enable_time().build()?;
        let handle = runtime.handle().clone();
        let (stop, stopped) = oneshot::channel::<()>();
        let thread = std::thread::Builder::new().name(format!("http-{name}")).spawn(move || {
            // Spawned tasks run while this thread waits here; a dropped sender stops it too.
            let _ = runtime.block_on(stopped);
        })?;
        Ok(Self { handle, stop: Some(stop), thread: Some(thread) })
    }
}

impl Drop for Lane {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl HttpRuntime {
    /// Starts the runtime's threads (the only threads HTTP ever uses).
    pub fn start() -> anyhow::Result<Self> {
        raise_open_files_limit();
        let shared = Arc::new(Shared::default());
        let probes = Lane::start("probes")?;
        let scrapes = Lane::start("scrapes")?;
        Ok(Self { inner: Arc::new(RuntimeInner { probes, scrapes, shared }) })
    }

    /// The servers' connection, eviction and error counts.
    pub fn collector(&self) -> Arc<dyn Collector> {
        self.inner.shared.clone()
    }

    fn lane(&self, workload: Workload) -> &Handle {
        match workload {
            Workload::Probes => &self.inner.probes.handle,
            Workload::Scrapes => &self.inner.scrapes.handle,
        }
    }

    /// Binds `address` now and serves `handler` there until the returned server is dropped.
    /// A bind failure is counted and returned.
    pub fn serve(
        &self,
        address: SocketAddr,
        name: &'static str,
        workload: Workload,
        handler: Handler,
    ) -> anyhow::Result<HttpServer> {
        let shared = self.inner.shared.clone();
        let listener = bind(address).map_err(|bind_error| {
            shared.bind_failures.add(1);
            anyhow::anyhow!("cannot listen on {address}: {bind_error}")
        })?;
        let server = Server { id: shared.new_server_id(), name, address, handler, shared: shared.clone() };
        let id = server.id;
        let (released, stopped) = mpsc::channel::<()>();
        let task = self.lane(workload).spawn(async move {
            // Dropped with the task, when the listener is: tells the closer the port is free.
            let _released = released;
            match TcpListener::from_std(listener) {
                Ok(listener) => server.accept_loop(listener).await,
                Err(error) => error!(%address, "cannot serve {name}: {error}"),
            }
        });
        debug!(%address, server = name, "serving HTTP");
        Ok(HttpServer { listener: task.abort_handle(), stopped, id, shared })
    }

    /// Serves `handler` on `address` for the life of the runtime, binding again every few
    /// seconds while the address is busy (as kube-proxy does when its port is still held, for
    /// example by the kube-proxy being replaced).
    pub fn serve_forever(
        &self,
        address: SocketAddr,
        name: &'static str,
        workload: Workload,
        handler: Handler,
    ) {
        let shared = self.inner.shared.clone();
        let server = Server { id: shared.new_server_id(), name, address, handler, shared };
        self.lane(workload).spawn(async move {
            let mut reported = false;
            loop {
                match bind(address).and_then(TcpListener::from_std) {
                    Ok(listener) => {
                        info!(%address, "serving {name}");
                        return server.accept_loop(listener).await;
                    }
                    Err(bind_error) => {
                        server.shared.bind_failures.add(1);
                        if !reported {
                            error!(%address, "cannot serve {name}: {bind_error}; retrying every {BIND_RETRY_INTERVAL:?}");
                            reported = true;
                        }
                        tokio::time::sleep(BIND_RETRY_INTERVAL).await;
                    }
                }
            }
        });
    }
}

/// A listening socket for `address`, with a backlog that absorbs a burst of connections.
/// The unspecified IPv4 address means every address of both families, as it does for
/// kube-proxy (Go listens on both for 0.0.0.0): the IPv6 wildcard with `IPV6_V6ONLY` off
/// accepts IPv4 too; where IPv6 is off, IPv4 alone.
fn bind(address: SocketAddr) -> io::Result<std::net::TcpListener> {
    if address.ip() == std::net::IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED) {
        let both = SocketAddr::new(std::net::IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED), address.port());
        if let Ok(listener) = bind_one(both) {
            return Ok(listener);
        }
    }
    bind_one(address)
}

fn bind_one(address: SocketAddr) -> io::Result<std::net::TcpListener> {
    let socket = socket2::Socket::new(
        socket2::Domain::for_address(address),
        socket2::Type::STREAM,
        Some(socket2::Protocol::TCP),
    )?;
    socket.set_reuse_address(true)?;
    if address.is_ipv6() && address.ip().is_unspecified() {
        socket.set_only_v6(false)?;
    }
    socket.set_nonblocking(true)?;
    socket.bind(&address.into())?;
    socket.listen(LISTEN_BACKLOG)?;
    Ok(socket.into())
}

/// Go raises its soft limit on open files to the hard one at start, so kube-proxy has it: do
/// the same, as hundreds of health-check ports and their connections need descriptors.
fn raise_open_files_limit() {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit and setrlimit only read and write the struct we own.
    let raised = unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) == 0 && {
            limit.rlim_cur = limit.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &limit) == 0
        }
    };
    if !raised {
        debug!("cannot raise the open files limit: {}", io::Error::last_os_error());
    }
}

/// A server answering on one address until dropped. Dropping it closes the port (waiting
/// briefly for the runtime to release it) and every connection it had.
pub struct HttpServer {
    listener: AbortHandle,
    stopped: mpsc::Receiver<()>,
    id: u64,
    shared: Arc<Shared>,
}

impl Drop for HttpServer {
    fn drop(&mut self) {
        self.listener.abort();
        // Disconnected once the task (and its listener) is gone.
        let _ = self.stopped.recv_timeout(CLOSE_WAIT);
        self.shared.close_server(self.id);
    }
}

/// One listening address and what it answers.
struct Server {
    id: u64,
    name: &'static str,
    address: SocketAddr,
    handler: Handler,
    shared: Arc<Shared>,
}

impl Server {
    async fn accept_loop(self, listener: TcpListener) {
        let server = Arc::new(self);
        let mut backoff = ACCEPT_BACKOFF_MIN;
        let mut last_warning: Option<tokio::time::Instant> = None;
        loop {
            match listener.accept().await {
                Ok((stream, _peer)) => {
                    backoff = ACCEPT_BACKOFF_MIN;
                    server.clone().spawn_connection(stream);
                }
                // The client gave up before we took its connection: nothing to wait for.
                Err(error) if error.raw_os_error() == Some(libc::ECONNABORTED) => {}
                Err(error) => {
                    server.shared.accept_errors.add(1);
                    // Under a flood this fails over and over: say so now and then, not each time.
                    if last_warning.is_none_or(|warned| warned.elapsed() >= ACCEPT_WARNING_INTERVAL) {
                        warn!(address = %server.address, "{}: cannot accept connections: {error}", server.name);
                        last_warning = Some(tokio::time::Instant::now());
                    }
                    let out_of_descriptors =
                        matches!(error.raw_os_error(), Some(libc::EMFILE | libc::ENFILE));
                    if out_of_descriptors && server.shared.evict_from_busiest(EVICTIONS_PER_EMFILE) {
                        // The oldest connections give their descriptors to the waiting ones (the
                        // likelier to be probers') once their tasks have run and closed them.
                        tokio::task::yield_now().await;
                        continue;
                    }
                    // Out of descriptors or memory, and nothing of ours to free: wait.
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(ACCEPT_BACKOFF_MAX);
                }
            }
        }
    }

    fn spawn_connection(self: Arc<Self>, stream: tokio::net::TcpStream) {
        let (close, closed) = oneshot::channel::<()>();
        let registration =
            Registration { id: self.shared.admit(self.id, close), shared: self.shared.clone() };
        tokio::spawn(async move {
            let _registration = registration;
            let handler = self.handler.clone();
            let service = service_fn(move |request: Request<Incoming>| {
                let response = respond(&handler, &request);
                async move { Ok::<_, Infallible>(response) }
            });
            let mut builder = http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_READ_TIMEOUT)
                .max_buf_size(MAX_HEADER_BYTES)
                .max_header_size(MAX_HEADER_BYTES)
                .max_headers(MAX_HEADERS);
            let connection = builder.serve_connection(TokioIo::new(stream), service);
            tokio::select! {
                served = connection => {
                    if let Err(error) = served {
                        // Too large a head, a timeout, a client gone mid-answer: its problem.
                        self.shared.connection_errors.add(1);
                        debug!(server = self.name, "HTTP connection ended: {error}");
                    }
                }
                // Evicted to make room, or the server closed.
                _ = closed => {}
                () = tokio::time::sleep(CONNECTION_LIFETIME) => {}
            }
        });
    }
}

/// The answer to one request.
fn respond(handler: &Handler, request: &Request<Incoming>) -> Response<Full<Bytes>> {
    let reply = match *request.method() {
        Method::GET | Method::HEAD => handler(request.uri().path()),
        _ => Reply::new(405, Reply::TEXT, "405 method not allowed\n"),
    };
    let mut response = Response::new(Full::new(Bytes::from(reply.body)));
    *response.status_mut() = StatusCode::from_u16(reply.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static(reply.content_type));
    headers.insert(HeaderName::from_static("x-content-type-options"), HeaderValue::from_static("nosniff"));
    for (name, value) in reply.headers {
        if let (Ok(name), Ok(value)) = (HeaderName::try_from(name), HeaderValue::try_from(value)) {
            headers.insert(name, value);
        }
    }
    // The body is never read: closing is cheaper than draining whatever the client sends.
    if !request.body().is_end_stream() {
        headers.insert(CONNECTION, HeaderValue::from_static("close"));
    }
    response
}

/// The connections of every server, their caps and the servers' counts.
#[derive(Default)]
struct Shared {
    connections: Mutex<Connections>,
    next_server_id: AtomicU64,
    evictions: Counter,
    accept_errors: Counter,
    bind_failures: Counter,
    connection_errors: Counter,
}

#[derive(Default)]
struct Connections {
    /// By connection id, which grows: the first is the oldest.
    open: BTreeMap<u64, OpenConnection>,
    per_server: HashMap<u64, usize>,
    next_id: u64,
}

struct OpenConnection {
    server: u64,
    /// Dropping it closes the connection.
    _close: oneshot::Sender<()>,
}

impl Connections {
    /// Closes the oldest connection of `server`.
    fn evict_oldest(&mut self, server: u64) -> bool {
        let oldest = self.open.iter().find(|(_, open)| open.server == server).map(|(id, _)| *id);
        oldest.is_some_and(|id| self.remove(id))
    }

    fn evict_from_busiest(&mut self) -> bool {
        let busiest = self.per_server.iter().max_by_key(|(_, count)| **count).map(|(server, _)| *server);
        busiest.is_some_and(|server| self.evict_oldest(server))
    }

    fn remove(&mut self, id: u64) -> bool {
        let Some(open) = self.open.remove(&id) else { return false };
        if let Some(count) = self.per_server.get_mut(&open.server) {
            *count -= 1;
            if *count == 0 {
                self.per_server.remove(&open.server);
            }
        }
        true
    }
}

impl Shared {
    fn connections(&self) -> std::sync::MutexGuard<'_, Connections> {
        self.connections.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn new_server_id(&self) -> u64 {
        self.next_server_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Registers a new connection of `server`, closing an older one if a cap is reached:
    /// the server's own oldest when it is at its cap, else, when all servers together are, the
    /// oldest of the server holding the most.
    fn admit(&self, server: u64, close: oneshot::Sender<()>) -> u64 {
        let mut connections = self.connections();
        let own = connections.per_server.get(&server).copied().unwrap_or(0);
        let evicted = if own >= MAX_CONNECTIONS_PER_SERVER {
            connections.evict_oldest(server)
        } else if connections.open.len() >= MAX_CONNECTIONS {
            connections.evict_from_busiest()
        } else {
            false
        };
        if evicted {
            self.evictions.add(1);
        }
        let id = connections.next_id;
        connections.next_id += 1;
        connections.open.insert(id, OpenConnection { server, _close: close });
        *connections.per_server.entry(server).or_default() += 1;
        id
    }

    /// Closes the oldest connections, up to `count`, of the servers holding the most; whether
    /// there was any.
    fn evict_from_busiest(&self, count: usize) -> bool {
        let mut connections = self.connections();
        let evicted = (0..count).take_while(|_| connections.evict_from_busiest()).count();
        self.evictions.add(evicted as u64);
        evicted > 0
    }

    fn close_server(&self, server: u64) {
        let mut connections = self.connections();
        connections.open.retain(|_, open| open.server != server);
        connections.per_server.remove(&server);
    }
}

/// A connection's place in [`Connections`], given back when its task ends (or is dropped).
struct Registration {
    id: u64,
    shared: Arc<Shared>,
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.shared.connections().remove(self.id);
    }
}

impl Collector for Shared {
    fn collect(&self) -> Vec<MetricFamily> {
        use MetricKind::{Counter, Gauge};
        let open = self.connections().open.len();
        vec![
            MetricFamily::single(
                "vipr_http_connections",
                "Connections open on the health, metrics and health-check node port servers",
                Gauge,
                open as f64,
            ),
            MetricFamily::single(
                "vipr_http_connections_evicted_total",
                "Connections closed to make room for a newer one over the connection caps",
                Counter,
                self.evictions.get() as f64,
            ),
            MetricFamily::single(
                "vipr_http_connection_errors_total",
                "Connections ended by an error: request head too large or too slow, client gone",
                Counter,
                self.connection_errors.get() as f64,
            ),
            MetricFamily::single(
                "vipr_http_accept_errors_total",
                "Failed accepts (such as out of file descriptors), each retried after a backoff",
                Counter,
                self.accept_errors.get() as f64,
            ),
            MetricFamily::single(
                "vipr_http_bind_failures_total",
                "Failed attempts to listen on a health, metrics or health-check node port address",
                Counter,
                self.bind_failures.get() as f64,
            ),
        ]
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read as _, Write as _};

    use super::*;

    fn ask(address: SocketAddr, request: &[u8]) -> String {
        let mut stream = std::net::TcpStream::connect(address).unwrap();
        stream.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        stream.write_all(request).unwrap();
        let mut answer = Vec::new();
        let _ = stream.read_to_end(&mut answer);
        String::from_utf8_lossy(&answer).into_owned()
    }

    fn loopback_server(runtime: &HttpRuntime) -> (HttpServer, SocketAddr) {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let address = SocketAddr::from(([127, 0, 0, 1], port));
        let handler: Handler = Arc::new(|path| match path {
            "/ok" => Reply::new(200, Reply::JSON, "{}").with_header("X-Load-Balancing-Endpoint-Weight", "2"),
            _ => Reply::not_found(),
        });
        (runtime.serve(address, "test", Workload::Probes, handler).unwrap(), address)
    }

    #[test]
    fn answers_with_status_headers_and_body() {
        let runtime = HttpRuntime::start().unwrap();
        let (_server, address) = loopback_server(&runtime);
        let answer = ask(address, b"GET /ok?x=1 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        assert!(answer.starts_with("HTTP/1.1 200 OK\r\n"), "{answer}");
        let lower = answer.to_ascii_lowercase();
        for header in [
            "content-type: application/json\r\n",
            "x-content-type-options: nosniff\r\n",
            "x-load-balancing-endpoint-weight: 2\r\n",
            "content-length: 2\r\n",
        ] {
            assert!(lower.contains(header), "no {header:?} in {answer}");
        }
        assert!(answer.ends_with("\r\n\r\n{}"), "{answer}");
        assert!(ask(address, b"GET /nope HTTP/1.0\r\n\r\n").contains(" 404 "));
        assert!(ask(address, b"POST /ok HTTP/1.0\r\n\r\n").contains(" 405 "));
        let head = ask(address, b"HEAD /ok HTTP/1.0\r\n\r\n");
        assert!(head.contains(" 200 ") && head.ends_with("\r\n\r\n"), "{head}");
    }

    #[test]
    fn an_oversized_head_is_refused() {
        let runtime = HttpRuntime::start().unwrap();
        let (_server, address) = loopback_server(&runtime);
        let mut request = b"GET /ok HTTP/1.1\r\nX-Long: ".to_vec();
        request.resize(request.len() + MAX_HEADER_BYTES, b'a');
        request.extend_from_slice(b"\r\n\r\n");
        let mut stream = std::net::TcpStream::connect(address).unwrap();
        stream.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        // The server may close before taking it all.
        let _ = stream.write_all(&request);
        let mut answer = Vec::new();
        let _ = stream.read_to_end(&mut answer);
        assert!(String::from_utf8_lossy(&answer).starts_with("HTTP/1.1 431"), "{answer:?}");
    }

    #[test]
    fn a_connection_that_sends_no_request_is_closed_after_the_header_read_timeout() {
        let runtime = HttpRuntime::start().unwrap();
        let (_server, address) = loopback_server(&runtime);
        let mut stream = std::net::TcpStream::connect(address).unwrap();
        // Half a request head, then nothing, as a slow sender.
        stream.write_all(b"GET /ok HTTP/1.1\r\nHost").unwrap();
        let opened = std::time::Instant::now();
        stream.set_read_timeout(Some(HEADER_READ_TIMEOUT * 3)).unwrap();
        let mut answer = Vec::new();
        // A read that times out (the connection left open) takes three timeouts: too long.
        let closed = stream.read_to_end(&mut answer);
        let open_for = opened.elapsed();
        assert!(
            (HEADER_READ_TIMEOUT - Duration::from_millis(100)..HEADER_READ_TIMEOUT * 2).contains(&open_for),
            "closed after {open_for:?}: {closed:?}"
        );
    }

    #[test]
    fn a_request_with_a_body_is_answered_and_its_connection_closed() {
        let runtime = HttpRuntime::start().unwrap();
        let (_server, address) = loopback_server(&runtime);
        let answer = ask(address, b"GET /ok HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\nabc");
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert!(answer.to_ascii_lowercase().contains("connection: close\r\n"), "{answer}");
    }

    #[test]
    fn connections_over_the_cap_close_the_oldest_of_the_busiest_server() {
        let shared = Shared::default();
        let mut closed = Vec::new();
        let mut admit = |server| {
            let (close, closed_rx) = oneshot::channel();
            closed.push(closed_rx);
            shared.admit(server, close)
        };
        for _ in 0..MAX_CONNECTIONS_PER_SERVER {
            admit(1);
        }
        admit(1);
        assert_eq!(shared.evictions.get(), 1, "the server's own cap");
        for n in 0..MAX_CONNECTIONS - MAX_CONNECTIONS_PER_SERVER {
            admit(2 + n as u64 % 7);
        }
        assert_eq!(shared.evictions.get(), 1);
        admit(100);
        assert_eq!(shared.evictions.get(), 2, "the global cap");
        let connections = shared.connections();
        assert_eq!(connections.open.len(), MAX_CONNECTIONS);
        assert_eq!(connections.per_server[&1], MAX_CONNECTIONS_PER_SERVER - 1, "server 1 held the most");
        drop(connections);
        // The first connection of server 1 went first, then its second.
        let gone: Vec<bool> = closed
            .iter_mut()
            .take(3)
            .map(|rx| matches!(rx.try_recv(), Err(oneshot::error::TryRecvError::Closed)))
            .collect();
        assert_eq!(gone, [true, true, false]);
    }

    #[test]
    fn closing_a_server_frees_its_port_at_once() {
        let runtime = HttpRuntime::start().unwrap();
        let (server, address) = loopback_server(&runtime);
        assert!(ask(address, b"GET /ok HTTP/1.0\r\n\r\n").contains(" 200 "));
        drop(server);
        assert!(std::net::TcpStream::connect(address).is_err(), "still listening");
        let again = runtime.serve(address, "again", Workload::Probes, Arc::new(|_| Reply::not_found()));
        assert!(again.is_ok(), "the port cannot be bound again");
    }
}
