//! `vipr-bench control-plane-watch`: the control plane through the real watch path. In a
//! network namespace and bpffs of its own, the in-suite API server holds N services × 10
//! endpoints; the release `vipr` binary (next to vipr-bench) watches it in ebpf mode; once its
//! first sync is done, one EndpointSlice changes every 1/rate s for the given time, each with
//! `endpoints.kubernetes.io/last-change-trigger-time` set to the moment of its write. Reports
//! the agent's `kubeproxy_network_programming_duration_seconds` over the stream (its buckets
//! are kube-proxy's: 0, 0.25 s, 0.5 s, 1 s, ..., so the mean is the finer figure) and the CPU
//! the agent used meanwhile.
use std::{
    io::{Read as _, Write as _},
    net::TcpStream,
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _, Result};
use serde::Serialize;

use super::{
    cluster::Cluster,
    sys::{self, BpfMount, PrivateCgroup},
};
use testbed::{locate_vipr, FakeApiServer, Vipr, WorkDir};

const METRICS: &str = "127.0.0.1:10249";
const HISTOGRAM: &str = "kubeproxy_network_programming_duration_seconds";

#[derive(Debug, Serialize)]
pub struct WatchPathReport {
    pub services: usize,
    pub changes_per_second: u32,
    pub seconds: u64,
    /// The agent's `--min-sync-period` (kube-proxy's default 1 s batches the changes of a
    /// second into one sync; 0 syncs each at once).
    pub min_sync_period: String,
    pub changes_written: usize,
    /// Changes the agent measured (the histogram's count over the stream).
    pub changes_programmed: f64,
    pub mean_ms: f64,
    /// The upper bound of the bucket that holds the 99th percentile.
    pub p99_at_most_s: f64,
    /// The agent's CPU time over the stream, in percent of one core.
    pub agent_cpu_percent: f64,
}

/// The histogram's IPv4 series (the slices are IPv4): buckets (upper bound, cumulative count),
/// sum and count.
fn histogram(metrics: &str) -> (Vec<(f64, f64)>, f64, f64) {
    let mut buckets = Vec::new();
    let (mut sum, mut count) = (0.0, 0.0);
    for line in
        metrics.lines().filter(|line| line.starts_with(HISTOGRAM) && line.contains("ip_family=\"IPv4\""))
    {
        let Some((name, value)) = line.rsplit_once(' ') else { continue };
        let value: f64 = value.parse().unwrap_or(0.0);
        if name.starts_with(&format!("{HISTOGRAM}_bucket")) {
            let Some((_, bound)) = name.split_once("le=\"") else { continue };
            let bound = bound.trim_end_matches("\"}");
            buckets.push((if bound == "+Inf" { f64::INFINITY } else { bound.parse().unwrap_or(0.0) }, value));
        } else if name.starts_with(&format!("{HISTOGRAM}_sum")) {
            sum = value;
        } else if name.starts_with(&format!("{HISTOGRAM}_count")) {
            count = value;
        }
    }
    (buckets, sum, count)
}

fn scrape() -> Result<String> {
    let mut stream = TcpStream::connect(METRICS)?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    stream.write_all(b"GET /metrics HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n")?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer)?;
    Ok(answer)
}

fn metric(metrics: &str, name: &str) -> Option<f64> {
    metrics.lines().find_map(|line| line.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
}

/// The agent's user + system CPU time, in clock ticks.
fn cpu_ticks(pid: u32) -> Result<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let fields: Vec<&str> = stat.rsplit_once(')').context("unreadable stat")?.1.split_whitespace().collect();
    Ok(fields[11].parse::<u64>()? + fields[12].parse::<u64>()?)
}

pub fn run(services: usize, rate: u32, seconds: u64, min_sync_period: &str) -> Result<WatchPathReport> {
    sys::set_up_network()?;
    let cgroup = PrivateCgroup::new()?;
    let bpffs = BpfMount::new()?;
    let workdir = WorkDir::create("watch-path")?;
    let api = FakeApiServer::start()?;
    let mut cluster = Cluster::new(services, 10);
    for service in &cluster.services {
        api.apply(service)?;
    }
    for slice in &cluster.slices {
        api.apply(slice)?;
    }
    let kubeconfig = workdir.path().join("kubeconfig");
    api.write_kubeconfig(&kubeconfig)?;
    let args = [
        "--proxy-mode=ebpf".to_owned(),
        format!("--kubeconfig={}", kubeconfig.display()),
        "--hostname-override=bench-node".to_owned(),
        format!("--devices={}", sys::DEVICE),
        format!("--bpf-root={}", bpffs.path().display()),
        format!("--cgroup-root={}", cgroup.path().display()),
        format!("--state-dir={}", workdir.path().display()),
        format!("--metrics-bind-address={METRICS}"),
        "--healthz-bind-address=127.0.0.1:10256".to_owned(),
        "--cluster-cidr=10.0.0.0/8".to_owned(),
        format!("--min-sync-period={min_sync_period}"),
    ];
    let mut command = std::process::Command::new(locate_vipr()?);
    command.args(&args);
    let log = workdir.path().join("vipr.log");
    let mut agent = Vipr::start_command(command, &log)?;

    // The first sync: every slice counted, none pending, a sync done.
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        agent.ensure_running()?;
        if let Ok(metrics) = scrape() {
            let synced =
                metric(&metrics, "kubeproxy_sync_proxy_rules_last_timestamp_seconds{ip_family=\"IPv4\"}")
                    .unwrap_or(0.0)
                    > 0.0;
            let counted =
                metric(&metrics, "kubeproxy_sync_proxy_rules_endpoint_changes_total{ip_family=\"IPv4\"}");
            if synced && counted.unwrap_or(0.0) >= services as f64 {
                break;
            }
        }
        if Instant::now() >= deadline {
            let log = std::fs::read_to_string(&log).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(20).collect();
            bail!("the agent did not finish its first sync; its log ends:\n{}", tail.join("\n"));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let (before, before_sum, before_count) = histogram(&scrape()?);
    let cpu_before = cpu_ticks(agent.pid())?;
    let started = Instant::now();
    let total = usize::try_from(u64::from(rate) * seconds)?;
    let interval = Duration::from_secs(1) / rate;
    let mut written = 0;
    for index in 0..total {
        let due = started + interval * u32::try_from(index)?;
        if let Some(wait) = due.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
        let service = (index * 7919) % services;
        let current = cluster.slices[service].clone();
        let (mut slice, _) = cluster.replaced(&current);
        slice.metadata.annotations.get_or_insert_default().insert(
            "endpoints.kubernetes.io/last-change-trigger-time".to_owned(),
            jiff::Timestamp::now().to_string(),
        );
        api.apply(&slice)?;
        cluster.slices[service] = slice;
        written += 1;
    }
    let elapsed = started.elapsed();
    // The last changes' syncs (--min-sync-period is 1 s by default).
    std::thread::sleep(Duration::from_secs(3));
    let cpu_after = cpu_ticks(agent.pid())?;
    let metrics = scrape()?;
    let (after, after_sum, after_count) = histogram(&metrics);
    agent.ensure_running()?;
    let count = after_count - before_count;
    if count <= 0.0 {
        let log = std::fs::read_to_string(&log).unwrap_or_default();
        let tail: Vec<&str> = log.lines().rev().take(15).collect();
        let lines: Vec<&str> =
            metrics.lines().filter(|line| line.contains("programming") || line.contains("changes")).collect();
        bail!("the agent measured no change:\n{}\nlog:\n{}", lines.join("\n"), tail.join("\n"));
    }
    let p99 = after
        .iter()
        .zip(&before)
        .find(|((_, now), (_, then))| now - then >= 0.99 * count)
        .map_or(f64::INFINITY, |((bound, _), _)| *bound);
    // SAFETY: no preconditions.
    let ticks_per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let cpu_seconds = (cpu_after - cpu_before) as f64 / ticks_per_second;
    let report = WatchPathReport {
        services,
        changes_per_second: rate,
        seconds,
        min_sync_period: min_sync_period.to_owned(),
        changes_written: written,
        changes_programmed: count,
        mean_ms: (after_sum - before_sum) / count * 1e3,
        p99_at_most_s: p99,
        agent_cpu_percent: cpu_seconds / (elapsed.as_secs_f64() + 3.0) * 100.0,
    };
    agent.stop()?;
    // What the agent said about its syncs, for the reader of a surprising result.
    let log = std::fs::read_to_string(&log).unwrap_or_default();
    for line in log.lines().filter(|line| !line.contains(" INFO ")).take(10) {
        eprintln!("vipr: {line}");
    }
    let syncs: Vec<&str> = log.lines().filter(|line| line.contains("synced")).collect();
    eprintln!("vipr: {} syncs logged; last: {:?}", syncs.len(), syncs.last());
    Ok(report)
}
