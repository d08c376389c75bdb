//! The small HTTP servers of the agent (health, metrics, service health checks): one thread
//! each, on tiny_http, answering from in-memory state. They never touch the dataplane, so a
//! stuck sync cannot stop them from reporting it.
use std::{net::SocketAddr, sync::Arc, thread::JoinHandle, time::Duration};

use tracing::{debug, error, info};

/// How long a server waits before binding again an address that was busy (kube-proxy: 5 s).
const BIND_RETRY_INTERVAL: Duration = Duration::from_secs(5);

/// An answer: status, content type, body.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reply {
    pub status: u16,
    pub content_type: &'static str,
    pub body: String,
}

impl Reply {
    pub const JSON: &'static str = "application/json";
    pub const TEXT: &'static str = "text/plain; charset=utf-8";

    pub fn new(status: u16, content_type: &'static str, body: impl Into<String>) -> Self {
        Self { status, content_type, body: body.into() }
    }

    pub fn not_found() -> Self {
        Self::new(404, Self::TEXT, "404 page not found\n")
    }
}

/// Answers a request for `path` (without the query).
pub type Handler = Arc<dyn Fn(&str) -> Reply + Send + Sync>;

/// A server answering on one address until dropped.
pub struct HttpServer {
    server: Arc<tiny_http::Server>,
    thread: Option<JoinHandle<()>>,
}

impl HttpServer {
    /// Binds `address` and serves `handler` on a thread of its own.
    pub fn start(address: SocketAddr, name: &str, handler: Handler) -> anyhow::Result<Self> {
        let server = Arc::new(
            tiny_http::Server::http(address)
                .map_err(|error| anyhow::anyhow!("cannot listen on {address}: {error}"))?,
        );
        let serving = server.clone();
        let thread = std::thread::Builder::new()
            .name(format!("http-{name}"))
            .spawn(move || serve(&serving, &handler))?;
        debug!(%address, server = name, "serving HTTP");
        Ok(Self { server, thread: Some(thread) })
    }
}

impl Drop for HttpServer {
    fn drop(&mut self) {
        self.server.unblock();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Serves `handler` on `address` for the rest of the process, binding again every few
/// seconds while the address is busy (as kube-proxy does when its port is still held, for
/// example by the kube-proxy being replaced).
pub fn serve_forever(address: SocketAddr, name: &'static str, handler: Handler) {
    let spawned = std::thread::Builder::new().name(format!("http-{name}")).spawn(move || {
        let mut reported = false;
        loop {
            match listen(address) {
                Ok(server) => {
                    info!(%address, "serving {name}");
                    serve(&server, &handler);
                    return;
                }
                Err(bind_error) => {
                    if !reported {
                        error!(%address, "cannot serve {name}: {bind_error}; retrying every {BIND_RETRY_INTERVAL:?}");
                        reported = true;
                    }
                    std::thread::sleep(BIND_RETRY_INTERVAL);
                }
            }
        }
    });
    if let Err(spawn_error) = spawned {
        error!("cannot start the {name} server thread: {spawn_error}");
    }
}

/// Listens on `address`. The unspecified IPv4 address means every address of both families,
/// as it does for kube-proxy (Go listens on both for 0.0.0.0): the IPv6 wildcard accepts IPv4
/// too (`net.ipv6.bindv6only=0`, Linux's default); where IPv6 is off, IPv4 alone.
fn listen(address: SocketAddr) -> Result<tiny_http::Server, Box<dyn std::error::Error + Send + Sync>> {
    if address.ip() == std::net::IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED) {
        let both = SocketAddr::new(std::net::IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED), address.port());
        if let Ok(server) = tiny_http::Server::http(both) {
            return Ok(server);
        }
    }
    tiny_http::Server::http(address)
}

fn serve(server: &tiny_http::Server, handler: &Handler) {
    for request in server.incoming_requests() {
        let path = request.url().split(['?', '#']).next().unwrap_or_default().to_owned();
        let reply = match request.method() {
            tiny_http::Method::Get | tiny_http::Method::Head => handler(&path),
            _ => Reply::new(405, Reply::TEXT, "405 method not allowed\n"),
        };
        let mut response = tiny_http::Response::from_string(reply.body).with_status_code(reply.status);
        for (field, value) in [("Content-Type", reply.content_type), ("X-Content-Type-Options", "nosniff")] {
            if let Ok(header) = tiny_http::Header::from_bytes(field, value) {
                response.add_header(header);
            }
        }
        // A client that goes away mid-answer is its own problem.
        if let Err(error) = request.respond(response) {
            debug!("an HTTP client went away before its answer: {error}");
        }
    }
}
