//! The standalone source: a file of Kubernetes manifests (multi-document YAML, or JSON),
//! re-read whenever its content changes.
use std::{
    collections::{BTreeMap, HashMap},
    path::{Path, PathBuf},
    sync::mpsc::{Receiver, RecvTimeoutError, Sender},
    time::{Duration, Instant},
};

use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice, networking::v1::ServiceCIDR};
use serde::Deserialize;
use tracing::debug;

use super::{Key, Kind, Object, Objects, Ownership, SourceEvent};
use crate::model::kubernetes::{content_hash, Rejection};

/// A file that is not valid YAML/JSON at all. The whole file is refused, because a syntax
/// error can hide any number of objects and applying the rest would delete them.
#[derive(Debug, thiserror::Error)]
#[error("{path}: document {document}, line {line}, column {column}: {message}")]
pub struct SyntaxError {
    pub path: String,
    pub document: usize,
    pub line: usize,
    pub column: usize,
    pub message: String,
}

/// Parses manifests. Documents of other kinds are ignored; Services, EndpointSlices and
/// ServiceCIDRs that do not deserialize into their API types are rejected one by one. Every
/// object is kept, whoever owns it: [`watch`] applies the [`Ownership`] rules.
pub fn parse_manifests(path: &Path, text: &str) -> Result<Objects, SyntaxError> {
    let mut objects = Objects::default();
    for (index, document) in serde_yaml::Deserializer::from_str(text).enumerate() {
        let value = serde_yaml::Value::deserialize(document).map_err(|error| {
            let location = error.location();
            SyntaxError {
                path: path.display().to_string(),
                document: index + 1,
                line: location.as_ref().map_or(0, |l| l.line()),
                column: location.as_ref().map_or(0, |l| l.column()),
                message: error.to_string(),
            }
        })?;
        add_object(value, index + 1, &mut objects);
    }
    Ok(objects)
}

fn add_object(value: serde_yaml::Value, document: usize, objects: &mut Objects) {
    if value.is_null() {
        return;
    }
    let text_field =
        |field: &str| value.get(field).and_then(serde_yaml::Value::as_str).unwrap_or_default().to_owned();
    let (api_version, kind) = (text_field("apiVersion"), text_field("kind"));
    let describe = |kind: &str| {
        let metadata = value.get("metadata");
        let field = |name: &str| metadata.and_then(|m| m.get(name)).and_then(serde_yaml::Value::as_str);
        format!(
            "{kind} {}/{} (document {document})",
            field("namespace").unwrap_or("default"),
            field("name").unwrap_or("<unnamed>")
        )
    };
    match (api_version.as_str(), kind.as_str()) {
        ("v1", "Service") => match serde_yaml::from_value::<Service>(value.clone()) {
            Ok(service) => objects.services.push(service),
            Err(error) => {
                objects.rejected.push(Rejection { object: describe("Service"), reason: error.to_string() })
            }
        },
        ("discovery.k8s.io/v1", "EndpointSlice") => {
            match serde_yaml::from_value::<EndpointSlice>(value.clone()) {
                Ok(slice) => objects.slices.push(slice),
                Err(error) => objects
                    .rejected
                    .push(Rejection { object: describe("EndpointSlice"), reason: error.to_string() }),
            }
        }
        ("networking.k8s.io/v1", "ServiceCIDR") => match serde_yaml::from_value::<ServiceCIDR>(value.clone())
        {
            Ok(cidr) => objects.service_cidrs.push(cidr),
            Err(error) => objects
                .rejected
                .push(Rejection { object: describe("ServiceCIDR"), reason: error.to_string() }),
        },
        (_, list) if list.ends_with("List") => {
            if let Some(items) = value.get("items").and_then(serde_yaml::Value::as_sequence) {
                for item in items {
                    add_object(item.clone(), document, objects);
                }
            }
        }
        ("", _) | (_, "") => objects.rejected.push(Rejection {
            object: format!("document {document}"),
            reason: "apiVersion or kind is missing".into(),
        }),
        _ => debug!(document, api_version, kind, "ignoring an object vipr does not use"),
    }
}

/// Watches a manifest file and sends the changes to the objects of it that `ownership` gives
/// this proxy each time its content changes, until the receiving side is dropped or `stop`
/// fires. Polling, rather than inotify, also catches editors and `kubectl`-style tools that
/// replace the file by renaming over it.
///
/// The first content read is sent as a complete list of every kind and [`SourceEvent::Synced`];
/// each later one is compared with the previous once, here, and only the objects added,
/// changed or deleted are sent. Each read's events go as one [`SourceEvent::Batch`]: the file
/// is one desired state, and a sync between two of its changes would program a state it never
/// described (seen in ipvs mode: a stage's Service programmed before its slice). A name repeated in the file is the object of its last document.
///
/// A content is sent only once it has been read unchanged for [`settle_time`]: a file caught
/// while a tool truncates and rewrites it in place (empty, or cut after a complete document)
/// would otherwise be applied as the truth and withdraw every service it seems to lack.
pub fn watch(
    path: PathBuf,
    ownership: &Ownership,
    interval: Duration,
    events: Sender<SourceEvent>,
    stop: Receiver<()>,
) {
    let settle = settle_time(interval);
    let mut last_content: Option<Vec<u8>> = None;
    let mut settling: Option<(Vec<u8>, Instant)> = None;
    let mut last_error: Option<String> = None;
    // What the receiver was last sent: a hash of each object's content, by kind and key.
    let mut sent: Option<HashMap<(Kind, Key), u64>> = None;
    loop {
        match std::fs::read(&path) {
            Ok(content) if last_content.as_ref() == Some(&content) => settling = None,
            Ok(content) => {
                last_error = None;
                let now = Instant::now();
                match &settling {
                    Some((settling_content, since)) if *settling_content == content => {
                        if now.duration_since(*since) >= settle {
                            settling = None;
                            let read = read_objects(&path, &content, ownership);
                            last_content = Some(content);
                            let event = match read {
                                Ok(objects) => SourceEvent::Batch(changes(&mut sent, objects)),
                                Err(reason) => SourceEvent::Unusable(reason),
                            };
                            if events.send(event).is_err() {
                                return;
                            }
                        }
                    }
                    _ => settling = Some((content, now)),
                }
            }
            Err(error) => {
                settling = None;
                let message = format!("{}: cannot read: {error}", path.display());
                if last_error.as_ref() != Some(&message) {
                    if events.send(SourceEvent::Unusable(message.clone())).is_err() {
                        return;
                    }
                    last_error = Some(message);
                }
                // Re-read once the file is back, even if its content is what it was.
                last_content = None;
            }
        }
        match stop.recv_timeout(interval) {
            Err(RecvTimeoutError::Timeout) => {}
            Ok(()) | Err(RecvTimeoutError::Disconnected) => return,
        }
    }
}

/// How long a file's content must stay the same before it is applied: two polls.
pub fn settle_time(interval: Duration) -> Duration {
    interval * 2
}

/// The objects of a file's content that `ownership` gives this proxy, or why it is unusable.
fn read_objects(path: &Path, content: &[u8], ownership: &Ownership) -> Result<Objects, String> {
    let text =
        std::str::from_utf8(content).map_err(|error| format!("{}: not UTF-8: {error}", path.display()))?;
    let mut objects = parse_manifests(path, text).map_err(|error| error.to_string())?;
    ownership.retain_owned(&mut objects);
    Ok(objects)
}

/// The events that lead from what was `sent` to `objects`, and `sent` updated: the first time
/// a complete list of every kind and [`SourceEvent::Synced`], then the objects that differ.
fn changes(sent: &mut Option<HashMap<(Kind, Key), u64>>, objects: Objects) -> Vec<SourceEvent> {
    // The last object of a key wins, as later documents of a file override earlier ones.
    // Each is hashed as the file wrote it, then decoded.
    let mut current: HashMap<(Kind, Key), Object> = HashMap::new();
    let mut hashes: HashMap<(Kind, Key), u64> = HashMap::new();
    let Objects { services, slices, node, service_cidrs, rejected } = objects;
    let hashed = services
        .into_iter()
        .map(|service| (content_hash(&service), Object::from(service)))
        .chain(slices.into_iter().map(|slice| (content_hash(&slice), Object::from(slice))))
        .chain(node.map(|node| (content_hash(&node), Object::from(node))))
        .chain(service_cidrs.into_iter().map(|cidr| (content_hash(&cidr), Object::from(cidr))))
        .chain(
            Objects { rejected, ..Objects::default() }
                .into_objects()
                .into_iter()
                .map(|invalid| (invalid_hash(&invalid), invalid)),
        );
    for (hash, object) in hashed {
        let id = (object.kind(), object.key());
        hashes.insert(id.clone(), hash);
        current.insert(id, object);
    }
    let Some(previous) = sent.replace(hashes.clone()) else {
        let mut lists: BTreeMap<Kind, Vec<Object>> =
            Kind::ALL.into_iter().map(|kind| (kind, Vec::new())).collect();
        let mut sorted: Vec<((Kind, Key), Object)> = current.into_iter().collect();
        sorted.sort_by(|a, b| a.0.cmp(&b.0));
        for ((kind, _), object) in sorted {
            lists.entry(kind).or_default().push(object);
        }
        let mut events: Vec<SourceEvent> =
            lists.into_iter().map(|(kind, objects)| SourceEvent::Listed(kind, objects)).collect();
        events.push(SourceEvent::Synced);
        return events;
    };
    let mut deleted: Vec<&(Kind, Key)> = previous.keys().filter(|id| !hashes.contains_key(*id)).collect();
    deleted.sort();
    let mut events: Vec<SourceEvent> =
        deleted.into_iter().map(|(kind, key)| SourceEvent::Deleted(*kind, key.clone())).collect();
    let mut applied: Vec<((Kind, Key), Object)> =
        current.into_iter().filter(|(id, _)| previous.get(id) != hashes.get(id)).collect();
    applied.sort_by(|a, b| a.0.cmp(&b.0));
    events.extend(applied.into_iter().map(|(_, object)| SourceEvent::Applied(object)));
    events
}

fn invalid_hash(object: &Object) -> u64 {
    match object {
        Object::Invalid { rejection, .. } => content_hash(&rejection.reason),
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::changes::ChangeTracker;

    fn parse(text: &str) -> Result<Objects, SyntaxError> {
        parse_manifests(Path::new("test.yaml"), text)
    }

    fn service_named(name: &str) -> String {
        format!(
            "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: ns}}\n\
             spec: {{clusterIP: 10.96.0.10, ports: [{{port: 80}}]}}\n---\n"
        )
    }

    /// Receives the events of one read of the file (the first: up to Synced; a later one:
    /// what arrives within a poll) into `tracker`, and names the services it then holds.
    fn services_after_read(
        received: &std::sync::mpsc::Receiver<SourceEvent>,
        tracker: &mut ChangeTracker,
        timeout: Duration,
    ) -> Vec<String> {
        let first = received.recv_timeout(timeout).unwrap();
        let mut synced = first.completes_the_view();
        first.apply_to(tracker);
        while let Ok(event) = received.recv_timeout(if synced { Duration::from_millis(50) } else { timeout })
        {
            synced |= event.completes_the_view();
            event.apply_to(tracker);
        }
        Objects::held_by(tracker).services.iter().map(|s| s.meta().name().to_owned()).collect()
    }

    /// A services file under a fresh directory with `content`, watched every `interval`
    /// until dropped (which stops the watcher and removes the directory, also on failure).
    struct Watched {
        dir: PathBuf,
        path: PathBuf,
        received: std::sync::mpsc::Receiver<SourceEvent>,
        stop: Option<std::sync::mpsc::Sender<()>>,
        watcher: Option<std::thread::JoinHandle<()>>,
    }

    impl Watched {
        fn new(test: &str, content: &str, interval: Duration) -> Self {
            let dir = std::env::temp_dir().join(format!("vipr-file-{test}-{}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            let path = dir.join("services.yaml");
            std::fs::write(&path, content).unwrap();
            let (events, received) = std::sync::mpsc::channel();
            let (stop, stopped) = std::sync::mpsc::channel();
            let watcher = {
                let path = path.clone();
                std::thread::spawn(move || watch(path, &Ownership::default(), interval, events, stopped))
            };
            Self { dir, path, received, stop: Some(stop), watcher: Some(watcher) }
        }
    }

    impl Drop for Watched {
        fn drop(&mut self) {
            drop(self.stop.take());
            if let Some(watcher) = self.watcher.take() {
                let _ = watcher.join();
            }
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    #[test]
    fn a_file_caught_while_it_is_rewritten_in_place_withdraws_nothing() {
        const INTERVAL: Duration = Duration::from_millis(100);
        let watched = Watched::new("settle", &(service_named("a") + &service_named("b")), INTERVAL);
        let (path, received) = (&watched.path, &watched.received);
        let deadline = Duration::from_secs(10);
        let mut tracker = ChangeTracker::new(std::time::SystemTime::UNIX_EPOCH);
        assert_eq!(services_after_read(received, &mut tracker, deadline), ["a", "b"]);
        tracker.take_dirty();

        // A slow writer, as `>` in a shell gives: truncated, then written in two steps with a
        // complete first document in between. Each state lasts longer than a poll, so the
        // watcher reads it, and less than the settle time, so it must not be applied.
        for partial in ["", service_named("a").as_str()] {
            std::fs::write(path, partial).unwrap();
            std::thread::sleep(INTERVAL * 13 / 10);
        }
        std::fs::write(path, service_named("c")).unwrap();
        // The first change sent after the rewrites is to the last, settled content, and
        // only what differs is sent: a and b deleted, c added.
        assert_eq!(services_after_read(received, &mut tracker, deadline), ["c"]);
        assert_eq!(tracker.take_dirty().services.len(), 3);
        assert_eq!(tracker.total().services, 5);
    }

    /// A re-read that changes several objects is one event: the agent cannot sync between
    /// them (a sync between a Service's change and its slice's is a state the file never held).
    #[test]
    fn one_read_of_the_file_is_one_event() {
        const INTERVAL: Duration = Duration::from_millis(50);
        let watched = Watched::new("batch", &(service_named("a") + &service_named("b")), INTERVAL);
        let (path, received) = (&watched.path, &watched.received);
        let deadline = Duration::from_secs(10);
        let first = received.recv_timeout(deadline).unwrap();
        assert!(first.completes_the_view(), "the first read is complete in one event: {first:?}");

        std::fs::write(path, service_named("b") + &service_named("c")).unwrap();
        let second = received.recv_timeout(deadline).unwrap();
        let SourceEvent::Batch(changes) = &second else { panic!("one read, one batch: {second:?}") };
        let deleted = changes.iter().filter(|event| matches!(event, SourceEvent::Deleted(..))).count();
        let applied = changes.iter().filter(|event| matches!(event, SourceEvent::Applied(..))).count();
        assert_eq!((deleted, applied), (1, 1), "a deleted, c added, b unchanged: {changes:?}");
        let mut tracker = ChangeTracker::new(std::time::SystemTime::UNIX_EPOCH);
        first.apply_to(&mut tracker);
        assert!(second.apply_to(&mut tracker));
        assert_eq!(tracker.services_sorted().len(), 2);
        assert!(received.recv_timeout(INTERVAL * 4).is_err(), "nothing more was sent");
    }

    #[test]
    fn reads_services_and_slices_from_multi_document_yaml() {
        let objects = parse(
            "apiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: shop}\nspec: {clusterIP: 10.96.0.1, ports: [{port: 80}]}\n---\n\
             apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: web-1, namespace: shop, labels: {kubernetes.io/service-name: web}}\naddressType: IPv4\nendpoints: [{addresses: [10.0.0.1]}]\nports: [{port: 8080}]\n---\n\
             apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: web}\n",
        )
        .unwrap();
        assert_eq!(objects.services.len(), 1);
        assert_eq!(objects.slices.len(), 1);
        assert!(objects.rejected.is_empty(), "{:?}", objects.rejected);
    }

    #[test]
    fn reads_json_and_lists() {
        let objects = parse(
            r#"{"apiVersion": "v1", "kind": "List", "items": [
                {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "a"}, "spec": {"clusterIP": "10.96.0.2"}},
                {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "b"}, "spec": {"clusterIP": "10.96.0.3"}}
            ]}"#,
        )
        .unwrap();
        assert_eq!(objects.services.len(), 2);
    }

    /// A Service and its slice, with extra labels on both (as the EndpointSlice controller
    /// copies a Service's labels to its slices).
    fn labelled(name: &str, cluster_ip: &str, labels: &str) -> String {
        format!(
            "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, labels: {{{labels}}}}}\nspec: {{clusterIP: {cluster_ip}}}\n---\n\
             apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: {name}-1, labels: {{kubernetes.io/service-name: {name}, {labels}}}}}\naddressType: IPv4\nendpoints: []\n---\n"
        )
    }

    fn owned_names(ownership: &Ownership, text: &str) -> (Vec<String>, Vec<String>) {
        let mut objects = parse(text).unwrap();
        ownership.retain_owned(&mut objects);
        let name = |metadata: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta| {
            metadata.name.clone().unwrap_or_default()
        };
        (
            objects.services.iter().map(|service| name(&service.metadata)).collect(),
            objects.slices.iter().map(|slice| name(&slice.metadata)).collect(),
        )
    }

    #[test]
    fn services_of_another_proxy_and_headless_ones_are_not_ours() {
        let text = [
            labelled("plain", "10.96.0.1", ""),
            labelled("other-proxy", "10.96.0.2", "service.kubernetes.io/service-proxy-name: other"),
            labelled("vipr-proxy", "10.96.0.3", "service.kubernetes.io/service-proxy-name: vipr"),
            labelled("headless", "None", "service.kubernetes.io/headless: ''"),
        ]
        .concat();
        let default = Ownership::default();
        assert_eq!(
            owned_names(&default, &text),
            (vec!["plain".into()], vec!["plain-1".into()]),
            "labelled for another proxy, or headless: left alone"
        );
        let named = Ownership { service_proxy_name: Some("vipr".into()) };
        assert_eq!(
            owned_names(&named, &text),
            (vec!["vipr-proxy".into()], vec!["vipr-proxy-1".into()]),
            "--service-proxy-name=vipr: only what is labelled vipr"
        );
    }

    #[test]
    fn the_watched_file_delivers_only_what_this_proxy_owns() {
        let path = std::env::temp_dir().join(format!("vipr-file-source-test-{}.yaml", std::process::id()));
        let text = [
            labelled("plain", "10.96.0.1", ""),
            labelled("other-proxy", "10.96.0.2", "service.kubernetes.io/service-proxy-name: other"),
        ]
        .concat();
        std::fs::write(&path, text).unwrap();
        let (events_tx, events) = std::sync::mpsc::channel();
        let (stop, stop_rx) = std::sync::mpsc::channel();
        let watched = path.clone();
        let thread = std::thread::spawn(move || {
            watch(watched, &Ownership::default(), Duration::from_millis(10), events_tx, stop_rx)
        });
        let mut tracker = ChangeTracker::new(std::time::SystemTime::UNIX_EPOCH);
        services_after_read(&events, &mut tracker, Duration::from_secs(10));
        let _ = stop.send(());
        thread.join().unwrap();
        let _ = std::fs::remove_file(&path);
        let objects = Objects::held_by(&tracker);
        let names: Vec<_> = objects.services.iter().map(|service| service.meta().name().to_owned()).collect();
        assert_eq!(names, ["plain"]);
        assert_eq!(objects.slices.len(), 1);
    }

    #[test]
    fn service_cidrs_are_read() {
        let objects = parse(
            "apiVersion: networking.k8s.io/v1\nkind: ServiceCIDR\nmetadata: {name: kubernetes}\nspec: {cidrs: [10.96.0.0/16, 'fd00:10:96::/112']}\n",
        )
        .unwrap();
        assert_eq!(objects.service_cidrs.len(), 1);
        assert_eq!(
            objects.service_cidrs[0].spec.as_ref().and_then(|spec| spec.cidrs.clone()).unwrap().len(),
            2
        );
    }

    #[test]
    fn syntax_error_names_document_and_line() {
        let error = parse("apiVersion: v1\nkind: Service\n---\nmetadata: {name: [unclosed\n").unwrap_err();
        assert_eq!(error.document, 2);
        assert!(error.line >= 4, "{error}");
        assert!(error.to_string().starts_with("test.yaml: document 2, line"), "{error}");
    }

    #[test]
    fn object_of_the_wrong_shape_is_rejected_alone() {
        let objects = parse(
            "apiVersion: v1\nkind: Service\nmetadata: {name: bad}\nspec: {ports: [{port: eighty}]}\n---\n\
             apiVersion: v1\nkind: Service\nmetadata: {name: good}\nspec: {clusterIP: 10.96.0.1}\n---\nfoo: bar\n",
        )
        .unwrap();
        assert_eq!(objects.services.len(), 1);
        assert_eq!(objects.rejected.len(), 2, "{:?}", objects.rejected);
        assert!(objects.rejected[0].object.starts_with("Service default/bad"));
    }
}
