use std::time::Duration;

use serde_json::json;

use super::*;
use crate::model::kubernetes::SERVICE_NAME_LABEL;

fn service(name: &str, version: Option<&str>, uid: &str, port: i32) -> Object {
    let mut metadata = json!({"name": name, "namespace": "ns", "uid": uid});
    if let Some(version) = version {
        metadata["resourceVersion"] = json!(version);
    }
    Object::from(
        serde_json::from_value::<Service>(
            json!({"metadata": metadata, "spec": {"clusterIP": "10.96.0.1", "ports": [{"port": port}]}}),
        )
        .unwrap(),
    )
}

fn slice(name: &str, service: &str, version: &str, family: &str, trigger: Option<&str>) -> Object {
    let mut metadata = json!({"name": name, "namespace": "ns", "resourceVersion": version, "uid": name,
                              "labels": {SERVICE_NAME_LABEL: service}});
    if let Some(trigger) = trigger {
        metadata["annotations"] = json!({LAST_CHANGE_TRIGGER_TIME: trigger});
    }
    Object::from(
        serde_json::from_value::<EndpointSlice>(
            json!({"metadata": metadata, "addressType": family, "endpoints": []}),
        )
        .unwrap(),
    )
}

fn key(name: &str) -> Key {
    ("ns".into(), name.into())
}

#[test]
fn counts_adds_changes_and_deletes_once_each() {
    let mut tracker = ChangeTracker::new(SystemTime::UNIX_EPOCH);
    assert!(tracker.apply(service("a", Some("1"), "ua", 80)));
    assert!(tracker.apply(slice("a-1", "a", "1", "IPv4", None)));
    assert!(tracker.apply(slice("a-6", "a", "1", "IPv6", None)));
    // The same version again (a relist, a repeated event) is no change.
    assert!(!tracker.apply(service("a", Some("1"), "ua", 80)));
    assert!(!tracker.apply(slice("a-1", "a", "1", "IPv4", None)));
    assert_eq!(
        tracker.pending(),
        Changes { services: 1, endpoint_slices: 2, endpoint_slices_by_family: [1, 1] }
    );
    assert!(tracker.delete(Kind::EndpointSlice, &key("a-6")));
    assert!(!tracker.delete(Kind::EndpointSlice, &key("a-6")));
    assert_eq!(tracker.pending().endpoint_slices_by_family, [1, 2]);
    let dirty = tracker.take_dirty();
    assert_eq!(dirty.services, [key("a")].into());
    assert_eq!(dirty.slices, [key("a-1"), key("a-6")].into());
    assert!(tracker.take_dirty().is_empty());
    assert_eq!(tracker.slices_of(&key("a")), [key("a-1")]);
    tracker.synced_successfully();
    assert!(tracker.pending().is_empty());
    assert_eq!(tracker.total().endpoint_slices, 3);
}

#[test]
fn one_identity_rule_namespace_defaults_and_uid_marks_a_recreate() {
    let mut tracker = ChangeTracker::new(SystemTime::UNIX_EPOCH);
    let unnamespaced: Service =
        serde_json::from_value(json!({"metadata": {"name": "web", "resourceVersion": "1", "uid": "u1"}}))
            .unwrap();
    tracker.apply(Object::from(unnamespaced));
    assert!(tracker.service(&("default".into(), "web".into())).is_some());
    tracker.apply(service("a", Some("1"), "u1", 80));
    tracker.take_dirty();
    // Deleted and created again with the same resourceVersion text but a new uid: a change.
    assert!(tracker.apply(service("a", Some("1"), "u2", 80)));
    assert_eq!(tracker.take_dirty().services, [key("a")].into());
    // Objects without a resourceVersion (a file's) compare by content.
    assert!(tracker.apply(service("f", None, "", 80)));
    assert!(!tracker.apply(service("f", None, "", 80)));
    assert!(tracker.apply(service("f", None, "", 81)));
}

#[test]
fn a_relabelled_slice_dirties_both_services_and_a_relist_deletes_what_it_lacks() {
    let mut tracker = ChangeTracker::new(SystemTime::UNIX_EPOCH);
    tracker.list(Kind::Service, vec![service("a", Some("1"), "ua", 80), service("b", Some("1"), "ub", 80)]);
    tracker.list(Kind::EndpointSlice, vec![slice("x", "a", "1", "IPv4", None)]);
    tracker.take_dirty();
    assert!(tracker.apply(slice("x", "b", "2", "IPv4", None)));
    assert_eq!(tracker.take_dirty().services, [key("a"), key("b")].into());
    assert_eq!((tracker.slices_of(&key("a")), tracker.slices_of(&key("b"))), (&[][..], &[key("x")][..]));
    // A relist with nothing changed changes nothing; one without "a" deletes it.
    assert!(!tracker
        .list(Kind::Service, vec![service("a", Some("1"), "ua", 80), service("b", Some("1"), "ub", 80)]));
    assert!(tracker.take_dirty().is_empty());
    assert!(tracker.list(Kind::Service, vec![service("b", Some("1"), "ub", 80)]));
    assert_eq!(tracker.take_dirty().services, [key("a")].into());
}

#[test]
fn an_invalid_object_replaces_its_key_until_fixed() {
    let mut tracker = ChangeTracker::new(SystemTime::UNIX_EPOCH);
    tracker.apply(service("a", Some("1"), "ua", 80));
    tracker.take_dirty();
    let rejection = Rejection { object: "Service ns/a".into(), reason: "bad".into() };
    assert!(tracker.apply(Object::Invalid {
        kind: Kind::Service,
        key: key("a"),
        rejection: rejection.clone()
    }));
    assert!(tracker.service(&key("a")).is_none());
    assert_eq!(tracker.invalid().collect::<Vec<_>>(), [&rejection]);
    assert_eq!(tracker.take_dirty().services, [key("a")].into());
    assert!(tracker.apply(service("a", Some("3"), "ua", 80)));
    assert_eq!(tracker.invalid().count(), 0);
}

#[test]
fn trigger_times_of_changed_slices_after_the_start_are_kept_until_a_sync() {
    let started: SystemTime = "2026-01-01T00:00:00Z".parse::<jiff::Timestamp>().unwrap().into();
    let mut tracker = ChangeTracker::new(started);
    tracker.apply(slice("old", "a", "1", "IPv4", Some("2025-12-31T23:00:00Z")));
    tracker.apply(slice("new", "a", "1", "IPv4", Some("2026-01-01T00:00:05Z")));
    assert_eq!(tracker.synced_successfully(), [started + Duration::from_secs(5)]);
    assert!(tracker.synced_successfully().is_empty());
    // An unchanged slice does not count again; a changed one does.
    tracker.apply(slice("old", "a", "1", "IPv4", Some("2025-12-31T23:00:00Z")));
    tracker.apply(slice("new", "a", "2", "IPv4", Some("2026-01-01T00:00:09.5Z")));
    assert_eq!(tracker.synced_successfully(), [started + Duration::from_millis(9500)]);
}

/// Each object's names are held once: the tracker's keys, a Service's slices' index and the
/// dirty set share the decoded objects' own names instead of copying them.
#[test]
fn keys_share_the_objects_names() {
    let mut tracker = ChangeTracker::new(SystemTime::UNIX_EPOCH);
    tracker.apply(service("web", Some("1"), "u1", 80));
    tracker.apply(service("web", Some("2"), "u1", 81));
    tracker.apply(slice("web-a", "web", "1", "IPv4", None));
    let (held, object) = tracker.services.get_key_value(&key("web")).unwrap();
    assert!(Arc::ptr_eq(&held.1, object.meta.name.as_ref().unwrap()), "the key is the object's name");
    assert!(Arc::ptr_eq(&held.0, &object.meta.namespace));
    let (slice_key, slice) = tracker.slices.get_key_value(&key("web-a")).unwrap();
    assert!(Arc::ptr_eq(&slice_key.1, slice.meta.name.as_ref().unwrap()));
    let (indexed_service, indexed_slices) = tracker.slices_of.get_key_value(&key("web")).unwrap();
    assert!(Arc::ptr_eq(&indexed_service.1, &held.1), "the index names the Service by its own key");
    assert!(Arc::ptr_eq(&indexed_slices[0].1, &slice_key.1));
}
