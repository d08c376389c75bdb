//! client-go's API client request metrics (`rest_client_*`, k8s.io/component-base's
//! restclient metrics), for vipr's kube-rs client: the Kubernetes source counts each request
//! here ([`REST_CLIENT`]) and `/metrics` reports them through [`RestClientCollector`].
use std::{
    collections::BTreeMap,
    sync::{LazyLock, Mutex, PoisonError},
    time::Duration,
};

use super::{Collector, Histogram, MetricFamily, MetricKind, Sample, SampleValue};

/// client-go's buckets of `rest_client_request_duration_seconds`.
const DURATION_BUCKETS: [f64; 12] = [0.005, 0.025, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0];

/// The requests of the process's API client, one per process as client-go's are.
pub static REST_CLIENT: LazyLock<RestClientMetrics> = LazyLock::new(RestClientMetrics::default);

#[derive(Debug, Default)]
pub struct RestClientMetrics {
    /// By `(code, host, method)`.
    results: Mutex<BTreeMap<(String, String, String), u64>>,
    /// By `(verb, host)`.
    durations: Mutex<BTreeMap<(String, String), Histogram>>,
}

impl RestClientMetrics {
    /// One request: `code` is the HTTP status, or `<error>` when no response came (as
    /// client-go); `duration` runs until the response's headers, as client-go measures it
    /// (a watch's long answer is not part of it).
    pub fn record(&self, method: &str, host: &str, code: &str, duration: Duration) {
        *self
            .results
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry((code.to_owned(), host.to_owned(), method.to_owned()))
            .or_default() += 1;
        self.durations
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry((method.to_owned(), host.to_owned()))
            .or_insert_with(|| Histogram::new(DURATION_BUCKETS.to_vec()))
            .observe_duration(duration);
    }

    fn families(&self) -> Vec<MetricFamily> {
        let label = |name: &str, value: &str| (name.to_owned(), value.to_owned());
        let results = self
            .results
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .map(|((code, host, method), count)| Sample {
                labels: vec![label("code", code), label("host", host), label("method", method)],
                value: SampleValue::Number(*count as f64),
            })
            .collect();
        let durations = self
            .durations
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .map(|((verb, host), histogram)| Sample {
                labels: vec![label("verb", verb), label("host", host)],
                ..histogram.sample()
            })
            .collect();
        vec![
            MetricFamily {
                name: "rest_client_requests_total".to_owned(),
                help: "[ALPHA] Number of HTTP requests, partitioned by status code, method, and host."
                    .to_owned(),
                kind: MetricKind::Counter,
                samples: results,
            },
            MetricFamily {
                name: "rest_client_request_duration_seconds".to_owned(),
                help: "[ALPHA] Request latency in seconds. Broken down by verb, and host.".to_owned(),
                kind: MetricKind::Histogram,
                samples: durations,
            },
        ]
    }
}

/// `/metrics`' view of [`REST_CLIENT`].
#[derive(Clone, Copy, Debug, Default)]
pub struct RestClientCollector;

impl Collector for RestClientCollector {
    fn collect(&self) -> Vec<MetricFamily> {
        REST_CLIENT.families()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_counted_by_code_host_and_method() {
        let metrics = RestClientMetrics::default();
        metrics.record("GET", "10.96.0.1:443", "200", Duration::from_millis(20));
        metrics.record("GET", "10.96.0.1:443", "200", Duration::from_secs(3));
        metrics.record("GET", "10.96.0.1:443", "<error>", Duration::from_millis(1));
        let families = metrics.families();
        let results = &families[0].samples;
        assert_eq!(results.len(), 2);
        let ok =
            results.iter().find(|sample| sample.labels[0] == ("code".to_owned(), "200".to_owned())).unwrap();
        assert_eq!(ok.value, SampleValue::Number(2.0));
        let labels: Vec<&str> =
            ok.labels.iter().flat_map(|(name, value)| [name.as_str(), value.as_str()]).collect();
        assert_eq!(labels, ["code", "200", "host", "10.96.0.1:443", "method", "GET"]);
        let SampleValue::Histogram { count, ref buckets, .. } = families[1].samples[0].value else {
            panic!("not a histogram")
        };
        assert_eq!(count, 3);
        // 1ms and 20ms under 25ms; 3s under 4s.
        assert_eq!(buckets[1], (0.025, 2));
        assert_eq!(buckets[7], (4.0, 3));
    }
}
