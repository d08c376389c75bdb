//! vipr end to end with a services file: which Services it takes (kube-proxy's label rules,
//! `--service-proxy-name`) and where unallocated service addresses drop (ServiceCIDR objects
//! over `--service-cluster-ip-range`), read from the pinned maps. Needs root and a built vipr
//! (`cargo build -p proxy-userspace`, or VIPR_BIN).

use std::{collections::BTreeMap, net::Ipv4Addr, time::Duration};

use anyhow::Result;
use testbed::{
    locate_vipr, wait_for, write_atomically, Check, ClusterIpService, Endpoint, Frontend, Lab, LabConfig,
    LeafSpec, Protocol, Vipr, WorkDir,
};

const CLIENT: Ipv4Addr = Ipv4Addr::new(10, 10, 0, 2);
const BACKEND: Ipv4Addr = Ipv4Addr::new(10, 20, 1, 2);
/// The lab's own Service `web`, unlabelled.
const WEB: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
/// A Service labelled for another proxy.
const OTHERS: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 20);
/// A Service labelled for vipr (`--service-proxy-name=vipr`).
const MINE: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 30);
const TIMEOUT: Duration = Duration::from_secs(15);

fn http(ip: Ipv4Addr) -> Frontend {
    Frontend { addr: std::net::SocketAddrV4::new(ip, 80), protocol: Protocol::Tcp }
}

/// A Service with one TCP port 80 -> 8080 served by the lab's backend, and its slice, both
/// with `labels` (the EndpointSlice controller copies a Service's labels to its slices).
fn labelled_service(name: &str, cluster_ip: Ipv4Addr, labels: &str) -> String {
    format!(
        "---\napiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: default, labels: {{{labels}}}}}\n\
         spec: {{clusterIP: {cluster_ip}, ports: [{{name: http, port: 80, protocol: TCP}}]}}\n\
         ---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\n\
         metadata: {{name: {name}-1, namespace: default, labels: {{kubernetes.io/service-name: {name}, {labels}}}}}\n\
         addressType: IPv4\nendpoints: [{{addresses: [{BACKEND}], conditions: {{ready: true}}}}]\n\
         ports: [{{name: http, port: 8080, protocol: TCP}}]\n"
    )
}

const SERVICE_CIDR: &str = "---\napiVersion: networking.k8s.io/v1\nkind: ServiceCIDR\n\
    metadata: {name: kubernetes}\nspec: {cidrs: [10.96.0.0/16]}\n";

/// A lab whose services file holds `web` (unlabelled), another proxy's Service, vipr's
/// Service, a headless one and the ServiceCIDR 10.96.0.0/16.
fn lab(label: &str) -> Lab {
    let web = ClusterIpService::web(WEB, (8080, 5353), vec![Endpoint::ready(BACKEND, "b1")]);
    let lab = Lab::new(LabConfig {
        label: label.to_owned(),
        vipr_binary: locate_vipr().unwrap(),
        client: LeafSpec::in_own_slash24("client", CLIENT).unwrap(),
        backends: vec![LeafSpec::in_own_slash24("b1", BACKEND).unwrap()],
        services: vec![web],
    })
    .unwrap();
    let mut text = std::fs::read_to_string(lab.services_file()).unwrap();
    text.push_str(&labelled_service("others", OTHERS, "service.kubernetes.io/service-proxy-name: cilium"));
    text.push_str(&labelled_service("mine", MINE, "service.kubernetes.io/service-proxy-name: vipr"));
    text.push_str(
        "---\napiVersion: v1\nkind: Service\nmetadata: {name: db, namespace: default}\n\
         spec: {clusterIP: None, ports: [{name: pg, port: 5432}]}\n",
    );
    text.push_str(SERVICE_CIDR);
    write_atomically(lab.services_file(), &text).unwrap();
    lab
}

/// Starts vipr on the lab with `extra` flags.
fn start(lab: &Lab, logs: &WorkDir, extra: &[&str]) -> Vipr {
    let log = logs.path().join(format!("vipr-{}.log", extra.join("_").replace(['/', '='], "-")));
    lab.spawn_vipr(extra, &log).unwrap()
}

/// Waits until `wanted` is programmed, then returns every programmed cluster IP.
fn programmed_once(lab: &Lab, vipr: &mut Vipr, wanted: Ipv4Addr) -> Vec<Ipv4Addr> {
    let maps = lab.maps();
    wait_for(&format!("{wanted} programmed"), TIMEOUT, || {
        vipr.ensure_running()?;
        Ok(match maps.services() {
            Ok(services) if services.contains_key(&http(wanted)) => {
                Check::Done(services.keys().map(|frontend| *frontend.addr.ip()).collect())
            }
            Ok(services) => Check::NotYet(format!("{:?}", services.keys().collect::<Vec<_>>())),
            // Not pinned yet.
            Err(error) => Check::NotYet(format!("{error:#}")),
        })
    })
    .unwrap()
}

#[test]
fn services_of_another_proxy_and_headless_ones_are_left_alone() -> Result<()> {
    let lab = lab("own-default");
    let logs = WorkDir::create("own-default-logs")?;
    let mut vipr = start(&lab, &logs, &["--service-cluster-ip-range=10.100.0.0/16"]);

    let programmed = programmed_once(&lab, &mut vipr, WEB);
    assert!(!programmed.contains(&OTHERS), "another proxy's Service: {programmed:?}");
    assert!(!programmed.contains(&MINE), "labelled: not vipr's without --service-proxy-name: {programmed:?}");

    // The ServiceCIDR object, not the flag, says where unallocated addresses drop.
    let unmatched: BTreeMap<String, u8> = lab.maps().unmatched()?;
    assert_eq!(unmatched.get("10.96.0.0/16"), Some(&proxy_common::unmatched::DROP), "{unmatched:?}");
    assert!(!unmatched.contains_key("10.100.0.0/16"), "the flag is only a fallback: {unmatched:?}");
    vipr.stop()?;
    Ok(())
}

#[test]
fn with_service_proxy_name_only_the_services_labelled_with_it_are_taken() -> Result<()> {
    let lab = lab("own-named");
    let logs = WorkDir::create("own-named-logs")?;
    let mut vipr = start(&lab, &logs, &["--service-proxy-name=vipr"]);

    let programmed = programmed_once(&lab, &mut vipr, MINE);
    assert!(!programmed.contains(&WEB), "unlabelled: kube-proxy's: {programmed:?}");
    assert!(!programmed.contains(&OTHERS), "another proxy's Service: {programmed:?}");
    vipr.stop()?;
    Ok(())
}
