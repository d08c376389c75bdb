//! `vipr-bench control-plane-watch`, and the watch-path part of the `control-plane` suite: the
//! control plane through the real watch path. In a network namespace and bpffs of its own, the
//! in-suite API server holds N services × 10 endpoints; the release `vipr` binary (next to
//! vipr-bench) watches it in ebpf mode; once its first sync is done, one EndpointSlice changes
//! every 1/rate s for the given time, each with `endpoints.kubernetes.io/last-change-trigger-time`
//! set to the moment of its write. Reports the latency from that write to the sync that
//! programmed it, as the agent measured it: p50 and p99 from its
//! `vipr_network_programming_duration_seconds` (fine buckets, interpolated within a bucket as
//! Prometheus' `histogram_quantile`), and the mean and the p99 bucket of kube-proxy's
//! `kubeproxy_network_programming_duration_seconds` (buckets 0, 0.25 s, 0.5 s, 1 s, ...); and the
//! CPU the agent used meanwhile.
use std::{
    io::{Read as _, Write as _},
    net::TcpStream,
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _, Result};
use serde::{Deserialize, Serialize};

use super::{
    cluster::Cluster,
    sys::{self, BpfMount, PrivateCgroup},
};
use testbed::{locate_vipr, FakeApiServer, Vipr, WorkDir};

const METRICS: &str = "127.0.0.1:10249";
const KUBE_PROXY_HISTOGRAM: &str = "kubeproxy_network_programming_duration_seconds";
const FINE_HISTOGRAM: &str = "vipr_network_programming_duration_seconds";
const SYNC_HISTOGRAM: &str = "kubeproxy_sync_proxy_rules_duration_seconds";
/// How long the agent may take to program the stream's last changes once it ended.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

/// One run's shape.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Settings {
    pub services: usize,
    /// EndpointSlice changes per second.
    pub rate: u32,
    pub seconds: u64,
    /// The agent's `--min-sync-period`; `None` runs it with its default (ebpf mode's).
    pub min_sync_period: Option<String>,
}

impl Settings {
    /// Issue 13's scenario: 100 changes/s at 10k services for 60 s.
    pub fn full() -> Self {
        Self { services: 10_000, rate: 100, seconds: 60, min_sync_period: None }
    }

    pub fn quick() -> Self {
        Self { services: 1_000, rate: 100, seconds: 5, min_sync_period: None }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct WatchPathReport {
    pub services: usize,
    pub changes_per_second: u32,
    pub seconds: u64,
    /// The agent's `--min-sync-period` ("default": not given, the mode's default).
    pub min_sync_period: String,
    pub changes_written: usize,
    /// Changes the agent measured (the histogram's count over the stream).
    pub changes_programmed: f64,
    /// From `vipr_network_programming_duration_seconds`, interpolated within its buckets.
    pub p50_ms: f64,
    pub p99_ms: f64,
    /// `kubeproxy_network_programming_duration_seconds`' sum / count.
    pub mean_ms: f64,
    /// The upper bound of the kube-proxy histogram's bucket that holds the 99th percentile.
    pub p99_at_most_s: f64,
    /// Syncs the agent ran over the stream, and their mean duration.
    pub syncs: f64,
    pub sync_mean_ms: f64,
    /// The agent's CPU time over the stream and its drain, in percent of one core.
    pub agent_cpu_percent: f64,
}

/// A histogram's buckets (upper bound, cumulative count), sum and count, from the series of
/// `name` whose labels contain `labels` ("" for any).
#[derive(Clone, Debug, Default, PartialEq)]
struct Histogram {
    buckets: Vec<(f64, f64)>,
    sum: f64,
    count: f64,
}

impl Histogram {
    fn parse(metrics: &str, name: &str, labels: &str) -> Self {
        let mut histogram = Self::default();
        for line in metrics.lines().filter(|line| line.starts_with(name) && line.contains(labels)) {
            let Some((series, value)) = line.rsplit_once(' ') else { continue };
            let value: f64 = value.parse().unwrap_or(0.0);
            let Some(suffix) = series.strip_prefix(name) else { continue };
            if suffix.starts_with("_bucket") {
                let Some((_, bound)) = series.split_once("le=\"") else { continue };
                let bound = &bound[..bound.find('"').unwrap_or(bound.len())];
                let bound = if bound == "+Inf" { f64::INFINITY } else { bound.parse().unwrap_or(0.0) };
                histogram.buckets.push((bound, value));
            } else if suffix.starts_with("_sum") {
                histogram.sum = value;
            } else if suffix.starts_with("_count") {
                histogram.count = value;
            }
        }
        histogram
    }

    /// What was observed between `before` and `self`.
    fn since(&self, before: &Self) -> Self {
        let buckets = self
            .buckets
            .iter()
            .map(|(bound, count)| {
                let then = before.buckets.iter().find(|(b, _)| b == bound).map_or(0.0, |(_, c)| *c);
                (*bound, count - then)
            })
            .collect();
        Self { buckets, sum: self.sum - before.sum, count: self.count - before.count }
    }

    /// The `q` quantile (0..1) as Prometheus' `histogram_quantile` estimates it: linear within
    /// the bucket that holds it; the highest finite bound if it is in the +Inf bucket.
    fn quantile(&self, q: f64) -> Option<f64> {
        let total = self.buckets.last()?.1;
        if total <= 0.0 {
            return None;
        }
        let rank = q * total;
        let (mut lower, mut below) = (0.0, 0.0);
        for &(bound, cumulative) in &self.buckets {
            if cumulative >= rank {
                if bound.is_infinite() {
                    return Some(lower);
                }
                let in_bucket = cumulative - below;
                let fraction = if in_bucket > 0.0 { (rank - below) / in_bucket } else { 1.0 };
                return Some(lower + (bound - lower) * fraction);
            }
            (lower, below) = (bound, cumulative);
        }
        Some(lower)
    }

    /// The upper bound of the bucket that holds the `q` quantile.
    fn bucket_of(&self, q: f64) -> f64 {
        let total = self.buckets.last().map_or(0.0, |(_, count)| *count);
        self.buckets
            .iter()
            .find(|(_, cumulative)| *cumulative >= q * total)
            .map_or(f64::INFINITY, |(b, _)| *b)
    }
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

pub fn run(settings: &Settings) -> Result<WatchPathReport> {
    let Settings { services, rate, seconds, .. } = *settings;
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
    let mut args = vec![
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
    ];
    if let Some(period) = &settings.min_sync_period {
        args.push(format!("--min-sync-period={period}"));
    }
    let mut command = std::process::Command::new(locate_vipr()?);
    command.args(&args);
    let log = workdir.path().join("vipr.log");
    let mut agent = Vipr::start_command(command, &log)?;
    let log_tail = |lines: usize| {
        let log = std::fs::read_to_string(&log).unwrap_or_default();
        let tail: Vec<&str> = log.lines().rev().take(lines).collect();
        tail.into_iter().rev().collect::<Vec<_>>().join("\n")
    };

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
            bail!("the agent did not finish its first sync; its log ends:\n{}", log_tail(20));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let histograms = |metrics: &str| {
        (
            Histogram::parse(metrics, FINE_HISTOGRAM, ""),
            Histogram::parse(metrics, KUBE_PROXY_HISTOGRAM, "ip_family=\"IPv4\""),
            Histogram::parse(metrics, SYNC_HISTOGRAM, "ip_family=\"IPv4\""),
        )
    };
    let (fine_before, kube_before, syncs_before) = histograms(&scrape()?);
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
    // The stream's last changes: until the agent measured every change written, or stopped
    // measuring new ones for a while.
    // An agent without the fine histogram (an earlier build, through VIPR_BIN) is measured by
    // kube-proxy's alone.
    let measured = |metrics: &str| {
        let fine = Histogram::parse(metrics, FINE_HISTOGRAM, "");
        if fine.buckets.is_empty() {
            Histogram::parse(metrics, KUBE_PROXY_HISTOGRAM, "ip_family=\"IPv4\"").since(&kube_before).count
        } else {
            fine.since(&fine_before).count
        }
    };
    let drain_deadline = Instant::now() + DRAIN_TIMEOUT;
    let mut metrics = scrape()?;
    while Instant::now() < drain_deadline && measured(&metrics) < written as f64 {
        std::thread::sleep(Duration::from_millis(20));
        metrics = scrape()?;
    }
    let elapsed = started.elapsed();
    let cpu_after = cpu_ticks(agent.pid())?;
    let (fine_after, kube_after, syncs_after) = histograms(&metrics);
    agent.ensure_running()?;
    let (fine, kube, syncs) =
        (fine_after.since(&fine_before), kube_after.since(&kube_before), syncs_after.since(&syncs_before));
    if kube.count <= 0.0 {
        let lines: Vec<&str> =
            metrics.lines().filter(|line| line.contains("programming") || line.contains("changes")).collect();
        bail!("the agent measured no change:\n{}\nlog:\n{}", lines.join("\n"), log_tail(15));
    }
    // SAFETY: no preconditions.
    let ticks_per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let cpu_seconds = (cpu_after - cpu_before) as f64 / ticks_per_second;
    let report = WatchPathReport {
        services,
        changes_per_second: rate,
        seconds,
        min_sync_period: settings.min_sync_period.clone().unwrap_or_else(|| "default".to_owned()),
        changes_written: written,
        changes_programmed: kube.count,
        p50_ms: fine.quantile(0.5).unwrap_or(f64::NAN) * 1e3,
        p99_ms: fine.quantile(0.99).unwrap_or(f64::NAN) * 1e3,
        mean_ms: kube.sum / kube.count.max(1.0) * 1e3,
        p99_at_most_s: kube.bucket_of(0.99),
        syncs: syncs.count,
        sync_mean_ms: syncs.sum / syncs.count.max(1.0) * 1e3,
        agent_cpu_percent: cpu_seconds / elapsed.as_secs_f64() * 100.0,
    };
    agent.stop()?;
    // What the agent said about its syncs, for the reader of a surprising result.
    let log = std::fs::read_to_string(&log).unwrap_or_default();
    for line in log.lines().filter(|line| !line.contains(" INFO ")).take(10) {
        eprintln!("vipr: {line}");
    }
    let synced: Vec<&str> = log.lines().filter(|line| line.contains("synced")).collect();
    eprintln!("vipr: {} syncs logged; last: {:?}", synced.len(), synced.last());
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_are_interpolated_within_their_bucket() {
        let metrics = "\
x_bucket{le=\"0.001\"} 10
x_bucket{le=\"0.002\"} 60
x_bucket{le=\"0.01\"} 100
x_bucket{le=\"+Inf\"} 100
x_sum 0.3
x_count 100
y_count 7
";
        let histogram = Histogram::parse(metrics, "x", "");
        assert_eq!(histogram.count, 100.0);
        assert_eq!(histogram.buckets.len(), 4);
        // The 50th of 100 is the 40th of the 50 in (1 ms, 2 ms].
        assert!((histogram.quantile(0.5).unwrap() - 0.0018).abs() < 1e-9);
        // The 99th is the 39th of the 40 in (2 ms, 10 ms].
        assert!((histogram.quantile(0.99).unwrap() - 0.0098).abs() < 1e-9);
        assert_eq!(histogram.bucket_of(0.99), 0.01);
        let before = Histogram::parse(metrics.replace(" 100\n", " 60\n").as_str(), "x", "");
        let since = histogram.since(&before);
        assert_eq!(since.buckets[3], (f64::INFINITY, 40.0));
        assert!((since.quantile(0.5).unwrap() - 0.006).abs() < 1e-9, "{since:?}");
    }
}
