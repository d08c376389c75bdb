//! kube-proxy's health servers, with its semantics and answers.
//!
//! - [`ProxyHealth`] is kube-proxy's `ProxyHealthServer` (pkg/proxy/healthcheck): `/healthz`
//!   and `/livez` on `--healthz-bind-address`. The proxy is healthy unless a change has been
//!   waiting to be synced for longer than the timeout (twice `--sync-period`): a change marks
//!   an update as queued, a successful sync clears it. `/healthz` is also unhealthy while this
//!   node is being deleted (deletion timestamp, or the cluster autoscaler's
//!   `ToBeDeletedByClusterAutoscaler` taint), so load balancers drain it; `/livez` ignores
//!   the node, so the kubelet does not restart a healthy proxy on a draining node.
//! - [`ServiceHealthServer`] is kube-proxy's service health server: for every LoadBalancer
//!   service with `externalTrafficPolicy: Local` it answers on the service's
//!   `healthCheckNodePort` whether this node has ready local endpoints (200) or not (503),
//!   so that the cloud load balancer only sends traffic to nodes that can serve it locally.
//!   It serves what it is handed: the model computes the checks
//!   ([`DesiredState::health_checks`](crate::model::DesiredState::health_checks)).
use std::{
    collections::BTreeMap,
    net::{IpAddr, SocketAddr},
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc, Mutex, OnceLock, PoisonError,
    },
    time::{Duration, Instant, SystemTime},
};

use k8s_openapi::api::core::v1::Node;
use tracing::{error, info};

use crate::{
    http::{Handler, HttpRuntime, HttpServer, Reply, Workload},
    metrics::ProxyMetrics,
};

/// The taint the cluster autoscaler puts on a node it is about to delete.
pub const TO_BE_DELETED_TAINT: &str = "ToBeDeletedByClusterAutoscaler";

/// A point in time, on the monotonic clock (for timeouts) and the wall clock (for answers).
#[derive(Clone, Copy, Debug)]
pub struct Moment {
    pub instant: Instant,
    pub wall: SystemTime,
}

impl Moment {
    pub fn now() -> Self {
        Self { instant: Instant::now(), wall: SystemTime::now() }
    }

    pub fn after(self, elapsed: Duration) -> Self {
        Self { instant: self.instant + elapsed, wall: self.wall + elapsed }
    }

    /// Seconds since the Unix epoch.
    pub fn unix_seconds(self) -> f64 {
        self.wall.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default().as_secs_f64()
    }
}

/// When the process started, for the monotonic part of Go's time format. Call early.
pub fn process_start() -> Instant {
    static START: OnceLock<Instant> = OnceLock::new();
    *START.get_or_init(Instant::now)
}

/// `moment` as Go's `time.Time.String()` prints a current time, which is what kube-proxy's
/// answers carry: `2006-01-02 15:04:05.999999999 +0000 UTC m=+1.000000001` (UTC; the `m=`
/// part is the monotonic clock since the process started). `None` is Go's zero time.
pub fn go_time(moment: Option<Moment>) -> String {
    let Some(moment) = moment else {
        return "0001-01-01 00:00:00 +0000 UTC".to_owned();
    };
    let since_epoch = moment.wall.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default();
    let seconds = i64::try_from(since_epoch.as_secs()).unwrap_or(i64::MAX);
    let date = jiff::Timestamp::from_second(seconds)
        .map(|timestamp| timestamp.strftime("%Y-%m-%d %H:%M:%S").to_string())
        .unwrap_or_else(|_| "9999-12-31 23:59:59".to_owned());
    let nanos = since_epoch.subsec_nanos();
    let fraction =
        if nanos == 0 { String::new() } else { format!(".{nanos:09}").trim_end_matches('0').to_owned() };
    let monotonic = moment.instant.saturating_duration_since(process_start());
    format!("{date}{fraction} +0000 UTC m=+{}.{:09}", monotonic.as_secs(), monotonic.subsec_nanos())
}

#[derive(Debug)]
struct ProxyHealthState {
    last_updated: Option<Moment>,
    /// The oldest change that no successful sync has covered yet.
    oldest_queued: Option<Moment>,
    node_eligible: bool,
}

/// kube-proxy's ProxyHealthServer state and its `/healthz` and `/livez` answers.
#[derive(Debug)]
pub struct ProxyHealth {
    timeout: Duration,
    state: Mutex<ProxyHealthState>,
    metrics: Arc<ProxyMetrics>,
}

impl ProxyHealth {
    /// `timeout` is how long a queued change may wait for a sync: kube-proxy uses twice its
    /// sync period.
    pub fn new(timeout: Duration, metrics: Arc<ProxyMetrics>) -> Self {
        Self {
            timeout,
            // Eligible until a Node says otherwise, as kube-proxy.
            state: Mutex::new(ProxyHealthState {
                last_updated: None,
                oldest_queued: None,
                node_eligible: true,
            }),
            metrics,
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, ProxyHealthState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A change arrived that needs a sync.
    pub fn queued_update(&self, now: Moment) {
        self.state().oldest_queued.get_or_insert(now);
    }

    /// The dataplane now implements every change queued so far.
    pub fn updated(&self, now: Moment) {
        let mut state = self.state();
        state.oldest_queued = None;
        state.last_updated = Some(now);
    }

    /// Follows this node's Node object: a node being deleted is not eligible for traffic.
    pub fn sync_node(&self, node: &Node) {
        let deleting = node.metadata.deletion_timestamp.is_some();
        let tainted = node
            .spec
            .as_ref()
            .and_then(|spec| spec.taints.as_ref())
            .is_some_and(|taints| taints.iter().any(|taint| taint.key == TO_BE_DELETED_TAINT));
        self.state().node_eligible = !deleting && !tainted;
    }

    /// Healthy, and the last update; ignores the node, as kube-proxy's `IsHealthy`. Healthy
    /// before any update too (the proxy is starting).
    fn check(&self, now: Moment) -> (bool, Option<Moment>, bool) {
        let state = self.state();
        let late = state
            .oldest_queued
            .is_some_and(|queued| now.instant.saturating_duration_since(queued.instant) >= self.timeout);
        let healthy = state.last_updated.is_none() || !late;
        (healthy, state.last_updated, state.node_eligible)
    }

    pub fn is_healthy(&self, now: Moment) -> bool {
        self.check(now).0
    }

    /// `/healthz`: the proxy's health and this node's eligibility.
    pub fn healthz(&self, now: Moment) -> Reply {
        let (healthy, last_updated, node_eligible) = self.check(now);
        let healthy = healthy && node_eligible;
        let (status, last_updated) = Self::answer(healthy, last_updated, now);
        self.metrics.healthz_answers.inc(&status.to_string());
        let body = format!(
            r#"{{"lastUpdated": {},"currentTime": {}, "nodeEligible": {node_eligible}}}"#,
            quoted(&go_time(last_updated)),
            quoted(&go_time(Some(now)))
        );
        Reply::new(status, Reply::JSON, body)
    }

    /// `/livez`: the proxy's health alone.
    pub fn livez(&self, now: Moment) -> Reply {
        let (healthy, last_updated, _) = self.check(now);
        let (status, last_updated) = Self::answer(healthy, last_updated, now);
        self.metrics.livez_answers.inc(&status.to_string());
        let body = format!(
            r#"{{"lastUpdated": {},"currentTime": {}}}"#,
            quoted(&go_time(last_updated)),
            quoted(&go_time(Some(now)))
        );
        Reply::new(status, Reply::JSON, body)
    }

    /// The status code and the `lastUpdated` to report. A healthy proxy reports the current
    /// time, as kube-proxy does for compatibility with releases where it meant "the sync loop
    /// ran recently"; an unhealthy one reports when it last synced.
    fn answer(healthy: bool, last_updated: Option<Moment>, now: Moment) -> (u16, Option<Moment>) {
        if healthy {
            (200, Some(now))
        } else {
            (503, last_updated)
        }
    }

    /// The health server's routes.
    pub fn handler(self: Arc<Self>) -> Handler {
        Arc::new(move |path| match path {
            "/healthz" => self.healthz(Moment::now()),
            "/livez" => self.livez(Moment::now()),
            _ => Reply::not_found(),
        })
    }
}

fn quoted(text: &str) -> String {
    serde_json::Value::from(text).to_string()
}

pub use crate::model::{HealthCheck as ServiceHealthCheck, ServiceName};

/// The answer on a service's health-check port, as kube-proxy's: 200 when the service has
/// local endpoints and the proxy is healthy, 503 otherwise; the number of local endpoints also
/// goes in `X-Load-Balancing-Endpoint-Weight`, for load balancers that weigh nodes by it.
pub fn service_health_reply(service: &ServiceName, local_endpoints: usize, proxy_healthy: bool) -> Reply {
    let status = if local_endpoints != 0 && proxy_healthy { 200 } else { 503 };
    let body = format!(
        "{{\n\t\"service\": {{\n\t\t\"namespace\": {},\n\t\t\"name\": {}\n\t}},\n\t\"localEndpoints\": {local_endpoints},\n\t\"serviceProxyHealthy\": {proxy_healthy}\n}}",
        quoted(&service.namespace),
        quoted(&service.name)
    );
    Reply::new(status, Reply::JSON, body)
        .with_header("X-Load-Balancing-Endpoint-Weight", local_endpoints.to_string())
}

/// One served health check.
struct HealthCheckServer {
    port: u16,
    local_endpoints: Arc<AtomicUsize>,
    _servers: Vec<HttpServer>,
}

/// Opens, updates and closes the per-service health-check servers, all on the agent's one
/// HTTP runtime: a port is a task there, not a thread.
pub struct ServiceHealthServer {
    /// The node addresses the servers listen on (0.0.0.0 for all).
    listen_ips: Vec<IpAddr>,
    proxy_health: Arc<ProxyHealth>,
    runtime: HttpRuntime,
    servers: BTreeMap<ServiceName, HealthCheckServer>,
    /// A server could not be opened at the last sync: the next one tries again.
    retry: bool,
}

impl ServiceHealthServer {
    pub fn new(proxy_health: Arc<ProxyHealth>, runtime: HttpRuntime) -> Self {
        Self { listen_ips: Vec::new(), proxy_health, runtime, servers: BTreeMap::new(), retry: false }
    }

    /// Whether the last [`Self::sync`] served every check it was given on `listen_ips`: a
    /// sync with the same checks would change nothing, so the agent skips it.
    pub fn is_current(&self, listen_ips: &[IpAddr]) -> bool {
        !self.retry && self.listen_ips == listen_ips
    }

    /// Makes the served health checks exactly `checks`, on `listen_ips`: servers of services
    /// that are gone or changed port close (all of them when the addresses change), new ones
    /// open, and every count is updated. A port that cannot be opened is logged, counted
    /// (`vipr_http_bind_failures_total`) and tried again on the next sync.
    pub fn sync(&mut self, listen_ips: Vec<IpAddr>, checks: &BTreeMap<ServiceName, ServiceHealthCheck>) {
        if listen_ips != self.listen_ips {
            self.servers.clear();
            self.listen_ips = listen_ips;
        }
        self.retry = false;
        self.servers.retain(|name, server| {
            let keep = checks.get(name).is_some_and(|check| check.port == server.port);
            if !keep {
                info!(service = %name, port = server.port, "closing health check");
            }
            keep
        });
        for (name, check) in checks {
            if let Some(server) = self.servers.get(name) {
                server.local_endpoints.store(check.local_endpoints, Ordering::Relaxed);
                continue;
            }
            match self.open(name, check) {
                Ok(server) => {
                    info!(service = %name, port = check.port, "opened health check");
                    self.servers.insert(name.clone(), server);
                }
                Err(open_error) => {
                    self.retry = true;
                    error!(service = %name, port = check.port, "cannot open health check: {open_error:#}")
                }
            }
        }
    }

    fn open(&self, name: &ServiceName, check: &ServiceHealthCheck) -> anyhow::Result<HealthCheckServer> {
        let local_endpoints = Arc::new(AtomicUsize::new(check.local_endpoints));
        let servers = self
            .listen_ips
            .iter()
            .map(|ip| {
                let (service, count, proxy_health) =
                    (name.clone(), local_endpoints.clone(), self.proxy_health.clone());
                let handler: Handler = Arc::new(move |_path| {
                    let healthy = proxy_health.is_healthy(Moment::now());
                    service_health_reply(&service, count.load(Ordering::Relaxed), healthy)
                });
                let address = SocketAddr::new(*ip, check.port);
                self.runtime.serve(address, "service-health", Workload::Probes, handler)
            })
            .collect::<anyhow::Result<_>>()?;
        Ok(HealthCheckServer { port: check.port, local_endpoints, _servers: servers })
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn health() -> (ProxyHealth, Moment) {
        (ProxyHealth::new(Duration::from_secs(60), Arc::default()), Moment::now())
    }

    fn json_body(reply: &Reply) -> serde_json::Value {
        serde_json::from_str(&reply.body).unwrap_or_else(|error| panic!("{error}: {}", reply.body))
    }

    #[test]
    fn healthy_while_starting_and_while_syncs_keep_up() {
        let (health, start) = health();
        assert_eq!(health.healthz(start).status, 200, "starting");
        health.queued_update(start);
        assert_eq!(health.healthz(start.after(Duration::from_secs(600))).status, 200, "never updated yet");
        health.updated(start);
        health.queued_update(start.after(Duration::from_secs(10)));
        assert!(health.is_healthy(start.after(Duration::from_secs(69))));
        health.updated(start.after(Duration::from_secs(69)));
        assert!(health.is_healthy(start.after(Duration::from_secs(1000))), "nothing queued");
    }

    #[test]
    fn a_change_unsynced_for_the_timeout_is_unhealthy_until_synced() {
        let (health, start) = health();
        health.updated(start);
        let queued = start.after(Duration::from_secs(5));
        health.queued_update(queued);
        // Later changes do not reset the clock of the oldest one.
        health.queued_update(start.after(Duration::from_secs(50)));
        let late = queued.after(Duration::from_secs(60));
        let healthz = health.healthz(late);
        assert_eq!((healthz.status, healthz.content_type), (503, Reply::JSON));
        assert_eq!(health.livez(late).status, 503);
        assert_eq!(json_body(&healthz)["lastUpdated"], go_time(Some(start)), "the last sync");
        health.updated(late);
        assert_eq!(health.healthz(late).status, 200);
        assert_eq!(health.livez(late).status, 200);
    }

    #[test]
    fn answers_carry_kube_proxy_s_fields() {
        let (health, start) = health();
        health.updated(start);
        let now = start.after(Duration::from_millis(1500));
        let healthz = health.healthz(now);
        assert_eq!(
            healthz.body,
            format!(
                r#"{{"lastUpdated": "{0}","currentTime": "{0}", "nodeEligible": true}}"#,
                go_time(Some(now))
            )
        );
        let livez = json_body(&health.livez(now));
        assert_eq!(livez.as_object().unwrap().keys().collect::<Vec<_>>(), ["currentTime", "lastUpdated"]);
    }

    #[test]
    fn a_node_being_deleted_fails_healthz_but_not_livez() {
        let (health, now) = health();
        health.updated(now);
        let node: Node = serde_json::from_value(json!({
            "metadata": {"name": "n"},
            "spec": {"taints": [{"key": TO_BE_DELETED_TAINT, "effect": "NoSchedule"}]}
        }))
        .unwrap();
        health.sync_node(&node);
        let healthz = health.healthz(now);
        assert_eq!(healthz.status, 503);
        assert_eq!(json_body(&healthz)["nodeEligible"], false);
        assert_eq!(health.livez(now).status, 200);
        health.sync_node(&serde_json::from_value(json!({"metadata": {"name": "n"}})).unwrap());
        assert_eq!(health.healthz(now).status, 200);
        let deleting = serde_json::from_value(
            json!({"metadata": {"name": "n", "deletionTimestamp": "2026-01-01T00:00:00Z"}}),
        );
        health.sync_node(&deleting.unwrap());
        assert_eq!(health.healthz(now).status, 503);
    }

    #[test]
    fn go_time_format() {
        let start = Moment {
            instant: process_start(),
            wall: SystemTime::UNIX_EPOCH + Duration::new(1_700_000_000, 120_000_000),
        };
        assert_eq!(go_time(Some(start)), "2023-11-14 22:13:20.12 +0000 UTC m=+0.000000000");
        let later = Moment {
            instant: start.instant + Duration::new(3, 5),
            wall: SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000),
        };
        assert_eq!(go_time(Some(later)), "2023-11-14 22:13:20 +0000 UTC m=+3.000000005");
        assert_eq!(go_time(None), "0001-01-01 00:00:00 +0000 UTC");
    }

    #[test]
    fn service_health_answers() {
        let name = ServiceName { namespace: "ns".into(), name: "lb".into() };
        let reply = service_health_reply(&name, 2, true);
        assert_eq!(reply.status, 200);
        assert_eq!(
            json_body(&reply),
            json!({"service": {"namespace": "ns", "name": "lb"}, "localEndpoints": 2, "serviceProxyHealthy": true})
        );
        assert_eq!(reply.headers, [("X-Load-Balancing-Endpoint-Weight", "2".to_owned())]);
        assert_eq!(service_health_reply(&name, 0, true).status, 503);
        assert_eq!(service_health_reply(&name, 2, false).status, 503);
    }

    #[test]
    fn health_check_servers_open_answer_and_close() {
        use std::io::{Read as _, Write as _};

        let proxy_health = Arc::new(ProxyHealth::new(Duration::from_secs(60), Arc::default()));
        let mut server = ServiceHealthServer::new(proxy_health, HttpRuntime::start().unwrap());
        let loopback = || vec![IpAddr::from([127, 0, 0, 1])];
        // Find a free port the way the API server would hand one out: any unused one.
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let name = ServiceName { namespace: "ns".into(), name: "lb".into() };
        let get = || -> Option<String> {
            let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
            stream.write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").ok()?;
            let mut answer = String::new();
            stream.read_to_string(&mut answer).ok()?;
            Some(answer)
        };
        server.sync(
            loopback(),
            &BTreeMap::from([(name.clone(), ServiceHealthCheck { port, local_endpoints: 1 })]),
        );
        let answer = get().expect("the health check answers");
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert!(answer.contains("\"localEndpoints\": 1"), "{answer}");
        server.sync(loopback(), &BTreeMap::from([(name, ServiceHealthCheck { port, local_endpoints: 0 })]));
        assert!(get().expect("still answering").starts_with("HTTP/1.1 503"));
        server.sync(loopback(), &BTreeMap::new());
        assert!(get().is_none(), "closed");
    }

    #[test]
    fn a_busy_health_check_port_is_counted_and_opened_on_a_later_sync() {
        let runtime = HttpRuntime::start().unwrap();
        let bind_failures = || {
            let families = runtime.collector().collect();
            let family = families.iter().find(|family| family.name == "vipr_http_bind_failures_total");
            match family.map(|family| &family.samples[0].value) {
                Some(crate::metrics::SampleValue::Number(value)) => *value,
                other => panic!("{other:?}"),
            }
        };
        let proxy_health = Arc::new(ProxyHealth::new(Duration::from_secs(60), Arc::default()));
        let mut server = ServiceHealthServer::new(proxy_health, runtime.clone());
        let holder = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = holder.local_addr().unwrap().port();
        let checks = BTreeMap::from([(
            ServiceName { namespace: "ns".into(), name: "lb".into() },
            ServiceHealthCheck { port, local_endpoints: 1 },
        )]);
        let loopback = [IpAddr::from([127, 0, 0, 1])];
        server.sync(loopback.to_vec(), &checks);
        assert_eq!(bind_failures(), 1.0);
        assert!(server.servers.is_empty());
        // The agent syncs the health checks again only when they or their addresses changed,
        // or when one did not open.
        assert!(!server.is_current(&loopback), "a failed port is tried again at the next sync");
        drop(holder);
        server.sync(loopback.to_vec(), &checks);
        assert_eq!(server.servers.len(), 1, "opened once the port is free");
        assert!(server.is_current(&loopback));
        assert!(!server.is_current(&[IpAddr::from([127, 0, 0, 2])]), "other addresses");
        assert_eq!(bind_failures(), 1.0);
    }
}
