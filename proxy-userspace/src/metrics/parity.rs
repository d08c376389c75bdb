//! vipr's `/metrics` against kube-proxy 1.35's families (testdata/metrics/kube-proxy-1.35.txt).
use std::{
    collections::{BTreeMap, BTreeSet},
    sync::Arc,
};

use super::{
    exponential_buckets, linear_buckets,
    process::ProcessMetrics,
    rest_client::{RestClientCollector, REST_CLIENT},
    ProxyMetrics, Registry,
};

/// One line of the fixture.
struct Expected {
    name: String,
    kind: String,
    labels: BTreeSet<String>,
    buckets: Option<Vec<f64>>,
    /// `None` when implemented; else why not.
    missing: Option<String>,
}

fn fixture() -> Vec<Expected> {
    include_str!("../../testdata/metrics/kube-proxy-1.35.txt")
        .lines()
        .filter(|line| !line.trim().is_empty() && !line.starts_with('#'))
        .map(|line| {
            let fields: Vec<&str> = line.split(" | ").map(str::trim).collect();
            let [name, kind, labels, buckets, status] = fields[..] else {
                panic!("bad fixture line {line:?}")
            };
            let missing = match status {
                "implemented" => None,
                other => {
                    Some(other.strip_prefix("missing: ").expect("implemented or missing: reason").to_owned())
                }
            };
            Expected {
                name: name.to_owned(),
                kind: kind.to_owned(),
                labels: labels.split(',').filter(|label| *label != "-").map(str::to_owned).collect(),
                buckets: (buckets != "-").then(|| bucket_expression(buckets)),
                missing,
            }
        })
        .collect()
}

/// Buckets written as in kube-proxy's source: `ExponentialBuckets(a,b,n)`,
/// `LinearBuckets(a,b,n)`, `MergeBuckets(...)` (which puts a 0 first) or a plain list.
fn bucket_expression(text: &str) -> Vec<f64> {
    let arguments = |inner: &str| -> (f64, f64, usize) {
        let parts: Vec<&str> = inner.trim_end_matches(')').split(',').collect();
        (parts[0].parse().unwrap(), parts[1].parse().unwrap(), parts[2].parse().unwrap())
    };
    if let Some(inner) = text.strip_prefix("ExponentialBuckets(") {
        let (start, factor, count) = arguments(inner);
        exponential_buckets(start, factor, count)
    } else if let Some(inner) = text.strip_prefix("MergeBuckets(") {
        let mut merged = vec![0.0];
        for part in inner.trim_end_matches(')').split("),") {
            let (start, width, count) = arguments(part.strip_prefix("LinearBuckets(").unwrap());
            merged.extend(linear_buckets(start, width, count));
        }
        merged
    } else {
        text.split(',').map(|bound| bound.parse().unwrap()).collect()
    }
}

/// What a scrape shows of one family: its type, label names (without `le`) and bucket bounds.
#[derive(Debug, Default)]
struct Scraped {
    kind: String,
    labels: BTreeSet<String>,
    buckets: Vec<f64>,
}

/// Reads the text format back: `# TYPE` lines and every sample's label names.
fn scrape(text: &str) -> BTreeMap<String, Scraped> {
    let mut families: BTreeMap<String, Scraped> = BTreeMap::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap();
            families.entry(name.to_owned()).or_default().kind = kind.to_owned();
            continue;
        }
        if line.starts_with('#') {
            continue;
        }
        let series = line.rsplit_once(' ').unwrap().0;
        let (metric, labels) = series.split_once('{').unwrap_or((series, "}"));
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .filter_map(|suffix| metric.strip_suffix(suffix))
            .find(|base| families.get(*base).is_some_and(|family| family.kind == "histogram"))
            .unwrap_or(metric);
        let scraped = families.get_mut(family).unwrap_or_else(|| panic!("{line} before its # TYPE"));
        for pair in labels.trim_end_matches('}').split("\",").filter(|pair| !pair.is_empty()) {
            let (name, value) = pair.split_once("=\"").unwrap();
            if name == "le" {
                let value = value.trim_end_matches('"');
                if value != "+Inf" {
                    let bound: f64 = value.parse().unwrap();
                    if !scraped.buckets.contains(&bound) {
                        scraped.buckets.push(bound);
                    }
                }
            } else {
                scraped.labels.insert(name.to_owned());
            }
        }
    }
    families
}

/// Every kube-proxy family that vipr claims in the fixture is on `/metrics` with kube-proxy's
/// type, label names and buckets; the others give a reason.
#[test]
fn kube_proxy_parity() {
    let registry = Arc::new(Registry::default());
    let metrics = Arc::new(ProxyMetrics::default());
    // Families whose series exist only once something was counted.
    metrics.healthz_answers.inc("200");
    metrics.livez_answers.inc("200");
    registry.register(metrics);
    registry.register(Arc::new(ProcessMetrics));
    REST_CLIENT.record("GET", "10.96.0.1:443", "200", std::time::Duration::from_millis(5));
    registry.register(Arc::new(RestClientCollector));
    let text = registry.encode();
    let scraped = scrape(&text);

    let expected = fixture();
    assert!(expected.iter().any(|family| family.missing.is_none()));
    let mut problems = Vec::new();
    for family in &expected {
        if let Some(reason) = &family.missing {
            assert!(!reason.trim().is_empty(), "{} is missing without a reason", family.name);
            continue;
        }
        let Some(found) = scraped.get(&family.name) else {
            problems.push(format!("{}: not exported", family.name));
            continue;
        };
        if found.kind != family.kind {
            problems.push(format!("{}: type {} instead of {}", family.name, found.kind, family.kind));
        }
        if found.labels != family.labels {
            problems
                .push(format!("{}: labels {:?} instead of {:?}", family.name, found.labels, family.labels));
        }
        if let Some(buckets) = &family.buckets {
            if &found.buckets != buckets {
                problems
                    .push(format!("{}: buckets {:?} instead of {:?}", family.name, found.buckets, buckets));
            }
        }
    }
    assert!(problems.is_empty(), "{}\n\n{}", problems.join("\n"), text);
}

#[test]
fn the_kube_proxy_differences_doc_names_every_missing_family() {
    let doc = include_str!("../../../docs/kube-proxy-differences.md");
    for family in fixture().iter().filter(|family| family.missing.is_some()) {
        assert!(doc.contains(&family.name), "docs/kube-proxy-differences.md does not name {}", family.name);
    }
}
