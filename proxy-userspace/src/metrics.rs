//! Prometheus metrics, under kube-proxy's names where kube-proxy has the metric, so that its
//! dashboards and alerts keep working, plus vipr's own (`vipr_*`).
//!
//! [`Registry`] encodes every registered [`Collector`] in the Prometheus text format (0.0.4)
//! on `/metrics`. [`ProxyMetrics`] is the agent's own collector; other parts register theirs
//! with [`Registry::register`] — this is where the dataplane's per-service and per-backend
//! packet/byte counters plug in: a collector that reads the datapath's counters when
//! scraped and returns them as [`MetricFamily`]s.
use std::{
    collections::BTreeMap,
    fmt::Write as _,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex, PoisonError, RwLock,
    },
    time::Duration,
};

pub mod kube_proxy;
#[cfg(test)]
mod parity;
pub mod process;
pub mod rest_client;

/// kube-proxy's `ip_family` label values. kube-proxy runs one proxier per family and labels
/// their series apart; vipr programs both families in one sync, so a value it cannot split
/// by family (a sync's duration, its timestamps, Service change counts) is reported under both.
pub const IP_FAMILIES: [&str; 2] = ["IPv4", "IPv6"];

/// The `ip_family` value of an address.
pub fn ip_family(ip: std::net::IpAddr) -> &'static str {
    if ip.is_ipv4() {
        IP_FAMILIES[0]
    } else {
        IP_FAMILIES[1]
    }
}

/// Content type of the Prometheus text exposition format.
pub const TEXT_FORMAT: &str = "text/plain; version=0.0.4; charset=utf-8";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MetricKind {
    Counter,
    Gauge,
    Histogram,
}

impl MetricKind {
    fn name(self) -> &'static str {
        match self {
            Self::Counter => "counter",
            Self::Gauge => "gauge",
            Self::Histogram => "histogram",
        }
    }
}

/// One value of a family, for one set of labels.
#[derive(Clone, Debug, PartialEq)]
pub enum SampleValue {
    Number(f64),
    /// Cumulative counts per upper bound (without `+Inf`, which is `count`).
    Histogram {
        buckets: Vec<(f64, u64)>,
        sum: f64,
        count: u64,
    },
}

#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    pub labels: Vec<(String, String)>,
    pub value: SampleValue,
}

impl Sample {
    /// The same value once for each IP family, labelled `ip_family` after its other labels.
    pub fn per_family(self) -> Vec<Sample> {
        IP_FAMILIES
            .iter()
            .map(|family| {
                let mut labels = self.labels.clone();
                labels.push(("ip_family".to_owned(), (*family).to_owned()));
                Sample { labels, value: self.value.clone() }
            })
            .collect()
    }
}

/// A metric name with its help, type and samples: what a [`Collector`] returns.
#[derive(Clone, Debug, PartialEq)]
pub struct MetricFamily {
    pub name: String,
    pub help: String,
    pub kind: MetricKind,
    pub samples: Vec<Sample>,
}

impl MetricFamily {
    /// A family with one unlabelled counter or gauge value.
    pub fn single(name: &str, help: &str, kind: MetricKind, value: f64) -> Self {
        Self {
            name: name.to_owned(),
            help: help.to_owned(),
            kind,
            samples: vec![Sample { labels: Vec::new(), value: SampleValue::Number(value) }],
        }
    }
}

/// Something that reports metric families when `/metrics` is scraped.
pub trait Collector: Send + Sync {
    fn collect(&self) -> Vec<MetricFamily>;
}

/// Prefix of the per-endpoint families, left out with `--metrics-per-endpoint=false`.
pub const PER_ENDPOINT_PREFIX: &str = "vipr_backend_";

/// A collector without the families whose names start with a prefix.
pub struct WithoutFamilies {
    pub inner: Arc<dyn Collector>,
    pub prefix: &'static str,
}

impl Collector for WithoutFamilies {
    fn collect(&self) -> Vec<MetricFamily> {
        self.inner.collect().into_iter().filter(|family| !family.name.starts_with(self.prefix)).collect()
    }
}

/// Every collector `/metrics` reports.
#[derive(Default)]
pub struct Registry {
    collectors: RwLock<Vec<Arc<dyn Collector>>>,
}

impl Registry {
    pub fn register(&self, collector: Arc<dyn Collector>) {
        self.collectors.write().unwrap_or_else(PoisonError::into_inner).push(collector);
    }

    /// All families in the Prometheus text format.
    pub fn encode(&self) -> String {
        let collectors = self.collectors.read().unwrap_or_else(PoisonError::into_inner).clone();
        let mut text = String::new();
        for family in collectors.iter().flat_map(|collector| collector.collect()) {
            encode_family(&family, &mut text);
        }
        text
    }
}

/// Writes one family in the text format straight into `out`: a scrape renders every
/// (service port, endpoint) pair's counters, 145k series at 10k services × 10 endpoints, so
/// nothing is allocated per label.
fn encode_family(family: &MetricFamily, out: &mut String) {
    let help = family.help.replace('\\', r"\\").replace('\n', r"\n");
    let _ = writeln!(out, "# HELP {} {help}", family.name);
    let _ = writeln!(out, "# TYPE {} {}", family.name, family.kind.name());
    let name = family.name.as_str();
    for sample in &family.samples {
        match &sample.value {
            SampleValue::Number(value) => {
                series(out, name, "", &sample.labels, None);
                let _ = writeln!(out, " {}", number(*value));
            }
            SampleValue::Histogram { buckets, sum, count } => {
                for (bound, cumulative) in buckets {
                    series(out, name, "_bucket", &sample.labels, Some(&number(*bound)));
                    let _ = writeln!(out, " {cumulative}");
                }
                series(out, name, "_bucket", &sample.labels, Some("+Inf"));
                let _ = writeln!(out, " {count}");
                series(out, name, "_sum", &sample.labels, None);
                let _ = writeln!(out, " {}", number(*sum));
                series(out, name, "_count", &sample.labels, None);
                let _ = writeln!(out, " {count}");
            }
        }
    }
}

/// A series' name with its `suffix` and labels (and `le`, for a histogram's bucket).
fn series(out: &mut String, name: &str, suffix: &str, labels: &[(String, String)], le: Option<&str>) {
    out.push_str(name);
    out.push_str(suffix);
    let mut pairs =
        labels.iter().map(|(name, value)| (name.as_str(), value.as_str())).chain(le.map(|le| ("le", le)));
    let Some((first_name, first_value)) = pairs.next() else { return };
    out.push('{');
    label(out, first_name, first_value);
    for (name, value) in pairs {
        out.push(',');
        label(out, name, value);
    }
    out.push('}');
}

/// `name="value"`, the value escaped as the text format requires.
fn label(out: &mut String, name: &str, value: &str) {
    out.push_str(name);
    out.push_str("=\"");
    for character in value.chars() {
        match character {
            '\\' => out.push_str(r"\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str(r"\n"),
            character => out.push(character),
        }
    }
    out.push('"');
}

fn number(value: f64) -> String {
    if value.is_nan() {
        "NaN".to_owned()
    } else if value.is_infinite() {
        if value > 0.0 { "+Inf" } else { "-Inf" }.to_owned()
    } else {
        value.to_string()
    }
}

/// A monotonically increasing count.
#[derive(Debug, Default)]
pub struct Counter(AtomicU64);

impl Counter {
    pub fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }

    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// A value that goes up and down.
#[derive(Debug, Default)]
pub struct Gauge(AtomicU64);

impl Gauge {
    pub fn set(&self, value: f64) {
        self.0.store(value.to_bits(), Ordering::Relaxed);
    }

    pub fn get(&self) -> f64 {
        f64::from_bits(self.0.load(Ordering::Relaxed))
    }
}

/// Counters told apart by one label (such as the HTTP status `code`).
#[derive(Debug)]
pub struct LabeledCounter {
    label: &'static str,
    values: Mutex<BTreeMap<String, u64>>,
}

impl LabeledCounter {
    pub fn new(label: &'static str) -> Self {
        Self { label, values: Mutex::default() }
    }

    pub fn inc(&self, value: &str) {
        *self.values.lock().unwrap_or_else(PoisonError::into_inner).entry(value.to_owned()).or_default() += 1;
    }

    fn samples(&self) -> Vec<Sample> {
        self.values
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .map(|(value, count)| Sample {
                labels: vec![(self.label.to_owned(), value.clone())],
                value: SampleValue::Number(*count as f64),
            })
            .collect()
    }
}

/// A distribution of observations over fixed buckets.
#[derive(Debug)]
pub struct Histogram {
    upper_bounds: Vec<f64>,
    state: Mutex<HistogramState>,
}

#[derive(Debug, Default)]
struct HistogramState {
    /// Observations per bucket (not cumulative), one more than bounds for `+Inf`.
    counts: Vec<u64>,
    sum: f64,
}

impl Histogram {
    pub fn new(upper_bounds: Vec<f64>) -> Self {
        let counts = vec![0; upper_bounds.len() + 1];
        Self { upper_bounds, state: Mutex::new(HistogramState { counts, sum: 0.0 }) }
    }

    pub fn observe(&self, value: f64) {
        let bucket =
            self.upper_bounds.iter().position(|bound| value <= *bound).unwrap_or(self.upper_bounds.len());
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        state.counts[bucket] += 1;
        state.sum += value;
    }

    pub fn observe_duration(&self, duration: Duration) {
        self.observe(duration.as_secs_f64());
    }

    fn sample(&self) -> Sample {
        let state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let mut cumulative = 0;
        let buckets = self
            .upper_bounds
            .iter()
            .zip(&state.counts)
            .map(|(bound, count)| {
                cumulative += count;
                (*bound, cumulative)
            })
            .collect();
        let count = state.counts.iter().sum();
        Sample { labels: Vec::new(), value: SampleValue::Histogram { buckets, sum: state.sum, count } }
    }
}

/// Prometheus' `ExponentialBuckets(start, factor, count)`.
pub fn exponential_buckets(start: f64, factor: f64, count: usize) -> Vec<f64> {
    std::iter::successors(Some(start), |bound| Some(bound * factor)).take(count).collect()
}

/// Prometheus' `LinearBuckets(start, width, count)`.
pub fn linear_buckets(start: f64, width: f64, count: usize) -> Vec<f64> {
    (0..count).map(|i| start + width * i as f64).collect()
}

/// `vipr_network_programming_duration_seconds`' buckets: kube-proxy's histogram starts at
/// 250 ms, where the eBPF dataplane programs a change in about a millisecond.
pub const FINE_PROGRAMMING_BUCKETS: [f64; 26] = [
    0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.06, 0.075, 0.1,
    0.15, 0.2, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0,
];

/// The agent's metrics. Fields are updated by the agent and the health servers; everything
/// under a kube-proxy name has kube-proxy's meaning and buckets.
#[derive(Debug)]
pub struct ProxyMetrics {
    /// Duration of every sync of the dataplane, successful or not.
    pub sync_duration: Histogram,
    /// Duration of the syncs that compared the whole state (the first one, a new node
    /// context) and of those that applied only what changed since the last one, as
    /// kube-proxy's iptables mode tells its full and partial syncs apart.
    pub sync_full_duration: Histogram,
    pub sync_partial_duration: Histogram,
    /// From the change of an EndpointSlice (its `endpoints.kubernetes.io/last-change-trigger-time`)
    /// to the sync that programmed it.
    pub network_programming_duration: Histogram,
    /// The same latencies in buckets fine enough for a sync of milliseconds
    /// ([`FINE_PROGRAMMING_BUCKETS`]); kube-proxy's histogram keeps its own buckets.
    pub network_programming_duration_fine: Histogram,
    /// When the dataplane last synced successfully.
    pub last_sync_timestamp: Gauge,
    /// When a sync was last asked for by a change.
    pub last_queued_timestamp: Gauge,
    pub service_changes: Counter,
    /// By IP family, as [`IP_FAMILIES`].
    pub endpoint_changes: [Counter; 2],
    pub service_changes_pending: Gauge,
    /// By IP family, as [`IP_FAMILIES`].
    pub endpoint_changes_pending: [Gauge; 2],
    /// Service ports with a Local traffic policy and no usable local endpoint, by
    /// `(traffic_policy, ip_family)`, as of the last sync.
    pub no_local_endpoints: Mutex<BTreeMap<(&'static str, &'static str), u64>>,
    /// `/healthz` answers by status code.
    pub healthz_answers: LabeledCounter,
    /// `/livez` answers by status code.
    pub livez_answers: LabeledCounter,
    /// Objects currently left out because they are invalid.
    pub rejected_objects: Gauge,
    /// Frontends the dataplane cannot program (such as IPv6 ones in the eBPF dataplane).
    pub unsupported_frontends: Gauge,
    /// Syncs that did not apply the whole desired state (they are retried with backoff).
    pub failed_syncs: Counter,
    /// Frontends whose programming failed, over all syncs.
    pub frontend_sync_errors: Counter,
}

impl Default for ProxyMetrics {
    fn default() -> Self {
        // kube-proxy's buckets, including the leading 0 its MergeBuckets puts first.
        let mut programming_buckets = vec![0.0];
        programming_buckets.extend(linear_buckets(0.25, 0.25, 2));
        programming_buckets.extend(linear_buckets(1.0, 1.0, 59));
        programming_buckets.extend(linear_buckets(60.0, 5.0, 12));
        programming_buckets.extend(linear_buckets(120.0, 30.0, 7));
        Self {
            sync_duration: Histogram::new(exponential_buckets(0.001, 2.0, 15)),
            sync_full_duration: Histogram::new(exponential_buckets(0.001, 2.0, 15)),
            sync_partial_duration: Histogram::new(exponential_buckets(0.001, 2.0, 15)),
            network_programming_duration: Histogram::new(programming_buckets),
            network_programming_duration_fine: Histogram::new(FINE_PROGRAMMING_BUCKETS.to_vec()),
            last_sync_timestamp: Gauge::default(),
            last_queued_timestamp: Gauge::default(),
            service_changes: Counter::default(),
            endpoint_changes: Default::default(),
            service_changes_pending: Gauge::default(),
            endpoint_changes_pending: Default::default(),
            no_local_endpoints: Mutex::default(),
            healthz_answers: LabeledCounter::new("code"),
            livez_answers: LabeledCounter::new("code"),
            rejected_objects: Gauge::default(),
            unsupported_frontends: Gauge::default(),
            failed_syncs: Counter::default(),
            frontend_sync_errors: Counter::default(),
        }
    }
}

impl ProxyMetrics {
    /// Records one sync's duration; `full` when it compared the whole state.
    pub fn observe_sync(&self, duration: Duration, full: bool) {
        self.sync_duration.observe_duration(duration);
        if full { &self.sync_full_duration } else { &self.sync_partial_duration }.observe_duration(duration);
    }

    pub fn set_no_local_endpoints(&self, counts: BTreeMap<(&'static str, &'static str), u64>) {
        *self.no_local_endpoints.lock().unwrap_or_else(PoisonError::into_inner) = counts;
    }

    fn no_local_endpoints_samples(&self) -> Vec<Sample> {
        let counts = self.no_local_endpoints.lock().unwrap_or_else(PoisonError::into_inner);
        // kube-proxy sets both policies on every sync, so both are there even at zero.
        ["internal", "external"]
            .into_iter()
            .flat_map(|policy| IP_FAMILIES.map(|family| (policy, family)))
            .map(|key| Sample {
                labels: vec![
                    ("traffic_policy".to_owned(), key.0.to_owned()),
                    ("ip_family".to_owned(), key.1.to_owned()),
                ],
                value: SampleValue::Number(counts.get(&key).copied().unwrap_or(0) as f64),
            })
            .collect()
    }
}

impl Collector for ProxyMetrics {
    fn collect(&self) -> Vec<MetricFamily> {
        use MetricKind::{Counter, Gauge, Histogram};
        // Under kube-proxy's names, with its `ip_family` label (kube-proxy 1.33+); see
        // [`IP_FAMILIES`] for why vipr reports one value under both families.
        let family = |name: &str, help: &str, kind: MetricKind, sample: Sample| MetricFamily {
            name: name.to_owned(),
            help: help.to_owned(),
            kind,
            samples: sample.per_family(),
        };
        let number = |value: f64| Sample { labels: Vec::new(), value: SampleValue::Number(value) };
        // A value vipr has for each family apart (EndpointSlices have one family each).
        let by_family = |name: &str, help: &str, kind: MetricKind, values: [f64; 2]| MetricFamily {
            name: name.to_owned(),
            help: help.to_owned(),
            kind,
            samples: IP_FAMILIES
                .iter()
                .zip(values)
                .map(|(family, value)| Sample {
                    labels: vec![("ip_family".to_owned(), (*family).to_owned())],
                    value: SampleValue::Number(value),
                })
                .collect(),
        };
        let labeled = |name: &str, help: &str, counter: &LabeledCounter| MetricFamily {
            name: name.to_owned(),
            help: help.to_owned(),
            kind: Counter,
            samples: counter.samples(),
        };
        vec![
            family(
                "kubeproxy_sync_proxy_rules_duration_seconds",
                "[ALPHA] SyncProxyRules latency in seconds",
                Histogram,
                self.sync_duration.sample(),
            ),
            family(
                "kubeproxy_sync_full_proxy_rules_duration_seconds",
                "[ALPHA] SyncProxyRules latency in seconds for full resyncs",
                Histogram,
                self.sync_full_duration.sample(),
            ),
            family(
                "kubeproxy_sync_partial_proxy_rules_duration_seconds",
                "[ALPHA] SyncProxyRules latency in seconds for partial resyncs",
                Histogram,
                self.sync_partial_duration.sample(),
            ),
            family(
                "kubeproxy_network_programming_duration_seconds",
                "[ALPHA] In Cluster Network Programming Latency in seconds",
                Histogram,
                self.network_programming_duration.sample(),
            ),
            MetricFamily {
                name: "vipr_network_programming_duration_seconds".to_owned(),
                help: "From an EndpointSlice's last-change-trigger-time to the sync that programmed it, \
                       in finer buckets than kubeproxy_network_programming_duration_seconds"
                    .to_owned(),
                kind: Histogram,
                samples: vec![self.network_programming_duration_fine.sample()],
            },
            family(
                "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
                "[ALPHA] The last time proxy rules were successfully synced",
                Gauge,
                number(self.last_sync_timestamp.get()),
            ),
            family(
                "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
                "[ALPHA] The last time a sync of proxy rules was queued",
                Gauge,
                number(self.last_queued_timestamp.get()),
            ),
            family(
                "kubeproxy_sync_proxy_rules_service_changes_total",
                "[ALPHA] Cumulative proxy rules Service changes",
                Counter,
                number(self.service_changes.get() as f64),
            ),
            by_family(
                "kubeproxy_sync_proxy_rules_endpoint_changes_total",
                "[ALPHA] Cumulative proxy rules Endpoint changes",
                Counter,
                self.endpoint_changes.each_ref().map(|counter| counter.get() as f64),
            ),
            family(
                "kubeproxy_sync_proxy_rules_service_changes_pending",
                "[ALPHA] Pending proxy rules Service changes",
                Gauge,
                number(self.service_changes_pending.get()),
            ),
            by_family(
                "kubeproxy_sync_proxy_rules_endpoint_changes_pending",
                "[ALPHA] Pending proxy rules Endpoint changes",
                Gauge,
                self.endpoint_changes_pending.each_ref().map(|gauge| gauge.get()),
            ),
            MetricFamily {
                name: "kubeproxy_sync_proxy_rules_no_local_endpoints_total".to_owned(),
                help: "[ALPHA] Number of services with a Local traffic policy and no endpoints".to_owned(),
                kind: Gauge,
                samples: self.no_local_endpoints_samples(),
            },
            labeled(
                "kubeproxy_proxy_healthz_total",
                "[ALPHA] Cumulative proxy healthz HTTP status",
                &self.healthz_answers,
            ),
            labeled(
                "kubeproxy_proxy_livez_total",
                "[ALPHA] Cumulative proxy livez HTTP status",
                &self.livez_answers,
            ),
            MetricFamily::single(
                "vipr_rejected_objects",
                "Services and EndpointSlices currently left out because they are invalid",
                Gauge,
                self.rejected_objects.get(),
            ),
            MetricFamily::single(
                "vipr_unsupported_frontends",
                "Service frontends the running dataplane cannot program",
                Gauge,
                self.unsupported_frontends.get(),
            ),
            MetricFamily::single(
                "vipr_sync_failures_total",
                "Syncs that did not apply the whole desired state; each is retried with backoff",
                Counter,
                self.failed_syncs.get() as f64,
            ),
            MetricFamily::single(
                "vipr_sync_frontend_errors_total",
                "Frontends whose programming failed, counted per sync",
                Counter,
                self.frontend_sync_errors.get() as f64,
            ),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kube_proxy_buckets() {
        let sync = exponential_buckets(0.001, 2.0, 15);
        assert_eq!(sync.first(), Some(&0.001));
        assert_eq!(number(sync[14]), "16.384");
        let metrics = ProxyMetrics::default();
        let SampleValue::Histogram { buckets, .. } = metrics.network_programming_duration.sample().value
        else {
            panic!("not a histogram")
        };
        let bounds: Vec<f64> = buckets.iter().map(|(bound, _)| *bound).collect();
        assert_eq!(&bounds[..5], [0.0, 0.25, 0.5, 1.0, 2.0]);
        assert_eq!(bounds.len(), 1 + 2 + 59 + 12 + 7);
        assert_eq!(bounds.last(), Some(&300.0));
    }

    #[test]
    fn syncs_are_told_apart_as_full_and_partial() {
        let metrics = ProxyMetrics::default();
        metrics.observe_sync(Duration::from_millis(30), true);
        metrics.observe_sync(Duration::from_millis(2), false);
        metrics.observe_sync(Duration::from_millis(3), false);
        let count = |histogram: &Histogram| match histogram.sample().value {
            SampleValue::Histogram { count, .. } => count,
            SampleValue::Number(_) => unreachable!(),
        };
        assert_eq!(
            (
                count(&metrics.sync_duration),
                count(&metrics.sync_full_duration),
                count(&metrics.sync_partial_duration)
            ),
            (3, 1, 2)
        );
        let mut counts = BTreeMap::new();
        counts.insert(("external", "IPv6"), 2);
        metrics.set_no_local_endpoints(counts);
        let text = {
            let registry = Registry::default();
            registry.register(Arc::new(metrics));
            registry.encode()
        };
        for line in [
            "kubeproxy_sync_full_proxy_rules_duration_seconds_count{ip_family=\"IPv4\"} 1",
            "kubeproxy_sync_partial_proxy_rules_duration_seconds_count{ip_family=\"IPv6\"} 2",
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total{traffic_policy=\"external\",ip_family=\"IPv6\"} 2",
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total{traffic_policy=\"internal\",ip_family=\"IPv4\"} 0",
        ] {
            assert!(text.lines().any(|l| l == line), "no {line:?} in\n{text}");
        }
    }

    #[test]
    fn per_endpoint_families_can_be_left_out() {
        let collector = WithoutFamilies { inner: Arc::new(Extra), prefix: PER_ENDPOINT_PREFIX };
        assert!(collector.collect().is_empty());
    }

    #[test]
    fn histograms_encode_cumulative_buckets() {
        let histogram = Histogram::new(vec![0.1, 1.0]);
        for value in [0.05, 0.5, 0.7, 3.0] {
            histogram.observe(value);
        }
        let family = MetricFamily {
            name: "h".into(),
            help: "a \"help\"\nline".into(),
            kind: MetricKind::Histogram,
            samples: vec![histogram.sample()],
        };
        let mut text = String::new();
        encode_family(&family, &mut text);
        assert_eq!(
            text,
            "# HELP h a \"help\"\\nline\n# TYPE h histogram\nh_bucket{le=\"0.1\"} 1\nh_bucket{le=\"1\"} 3\n\
             h_bucket{le=\"+Inf\"} 4\nh_sum 4.25\nh_count 4\n"
        );
    }

    #[test]
    fn labels_are_escaped() {
        let counter = LabeledCounter::new("code");
        counter.inc("200");
        counter.inc("200");
        counter.inc("a\"b");
        let family = MetricFamily {
            name: "c".into(),
            help: "h".into(),
            kind: MetricKind::Counter,
            samples: counter.samples(),
        };
        let mut text = String::new();
        encode_family(&family, &mut text);
        assert!(text.contains("c{code=\"200\"} 2\n"), "{text}");
        assert!(text.contains("c{code=\"a\\\"b\"} 1\n"), "{text}");
    }

    struct Extra;

    impl Collector for Extra {
        fn collect(&self) -> Vec<MetricFamily> {
            vec![MetricFamily::single("vipr_backend_packets_total", "Packets", MetricKind::Counter, 7.0)]
        }
    }

    #[test]
    fn registered_collectors_are_all_exported() {
        let registry = Arc::new(Registry::default());
        let metrics = Arc::new(ProxyMetrics::default());
        metrics.service_changes.add(3);
        metrics.last_sync_timestamp.set(1_700_000_000.5);
        registry.register(metrics);
        registry.register(Arc::new(Extra));
        let text = registry.encode();
        for line in [
            "# TYPE kubeproxy_sync_proxy_rules_duration_seconds histogram",
            "kubeproxy_sync_proxy_rules_duration_seconds_bucket{ip_family=\"IPv4\",le=\"0.001\"} 0",
            "kubeproxy_sync_proxy_rules_service_changes_total{ip_family=\"IPv6\"} 3",
            "kubeproxy_sync_proxy_rules_last_timestamp_seconds{ip_family=\"IPv4\"} 1700000000.5",
            "vipr_backend_packets_total 7",
        ] {
            assert!(text.lines().any(|l| l == line), "no {line:?} in\n{text}");
        }
    }
}
