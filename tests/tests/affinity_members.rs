//! Backend-set membership entries, which only ClientIP session affinity reads (proxy-ebpf
//! `affinity.rs`): a set has them while an entry with affinity points to it, and only then, so
//! that a sync from scratch of a cluster with little affinity writes a third fewer entries.
//! A Service that turns affinity on gets them (and its clients stick to one backend), one that
//! turns it off loses them. Needs root and a built vipr (`cargo build --workspace`, or
//! VIPR_BIN).

use std::{
    collections::BTreeSet,
    net::{Ipv4Addr, SocketAddrV4},
    time::Duration,
};

use anyhow::Result;
use testbed::{
    write_atomically, Check, ClusterIpService, Endpoint, Frontend, Lab, LabConfig, PinnedMaps, Protocol,
};

const CLIENT: Ipv4Addr = Ipv4Addr::new(10, 10, 0, 2);
const B1: Ipv4Addr = Ipv4Addr::new(10, 20, 1, 2);
const B2: Ipv4Addr = Ipv4Addr::new(10, 20, 2, 2);
const TARGET_PORT: u16 = 8080;
const STICKY: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 20);
const PLAIN: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 21);

/// `default/<name>` at `cluster_ip`, TCP 80 to both backends, with ClientIP affinity or none.
fn service(name: &str, cluster_ip: Ipv4Addr, affinity: bool) -> String {
    let affinity = if affinity { ", sessionAffinity: ClientIP" } else { "" };
    let endpoints: Vec<String> =
        [B1, B2].iter().map(|ip| format!("{{addresses: [{ip}], conditions: {{ready: true}}}}")).collect();
    format!(
        "---\napiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: default}}\n\
         spec: {{clusterIP: {cluster_ip}, ports: [{{name: http, port: 80, targetPort: {TARGET_PORT}, protocol: TCP}}]{affinity}}}\n\
         ---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\n\
         metadata: {{name: {name}-1, namespace: default, labels: {{kubernetes.io/service-name: {name}}}}}\n\
         addressType: IPv4\nendpoints: [{}]\nports: [{{name: http, port: {TARGET_PORT}, protocol: TCP}}]\n",
        endpoints.join(", ")
    )
}

fn frontend(ip: Ipv4Addr) -> Frontend {
    Frontend { addr: SocketAddrV4::new(ip, 80), protocol: Protocol::Tcp }
}

/// The membership entries of the backend set `ip`'s frontend uses; `None` while it is not
/// programmed.
fn members_of(maps: &PinnedMaps, ip: Ipv4Addr) -> Result<Option<BTreeSet<SocketAddrV4>>> {
    let Some(entry) = maps.services()?.get(&frontend(ip)).copied() else { return Ok(None) };
    let members = maps.members()?;
    Ok(Some(
        members.keys().filter(|(set, _)| *set == entry.backend_set).map(|(_, backend)| *backend).collect(),
    ))
}

/// Waits until the set of `with` has both backends as members and the set of `without` none.
fn wait_members(lab: &mut Lab, with: Ipv4Addr, without: Ipv4Addr) -> Result<()> {
    let both = BTreeSet::from([SocketAddrV4::new(B1, TARGET_PORT), SocketAddrV4::new(B2, TARGET_PORT)]);
    lab.wait_for(&format!("members for {with} only, none for {without}"), |maps| {
        // The maps are not pinned before vipr's start.
        let (with_members, without_members) = match (members_of(maps, with), members_of(maps, without)) {
            (Ok(with_members), Ok(without_members)) => (with_members, without_members),
            (Err(error), _) | (_, Err(error)) => return Ok(Check::NotYet(format!("{error:#}"))),
        };
        Ok(match (&with_members, &without_members) {
            (Some(with_members), Some(without_members))
                if *with_members == both && without_members.is_empty() =>
            {
                Check::Done(())
            }
            _ => Check::NotYet(format!("{with}: {with_members:?}, {without}: {without_members:?}")),
        })
    })
}

#[test]
fn only_sets_with_session_affinity_have_members() -> Result<()> {
    // The web service only makes the backends' echo servers listen on the target port.
    let web = ClusterIpService::web(
        Ipv4Addr::new(10, 96, 0, 10),
        (TARGET_PORT, 5353),
        vec![Endpoint::ready(B1, "b1"), Endpoint::ready(B2, "b2")],
    );
    let mut lab = Lab::new(LabConfig::with_backends("affmemb", CLIENT, &[B1, B2], vec![web])?)?;
    write_atomically(
        lab.services_file(),
        &(service("sticky", STICKY, true) + &service("plain", PLAIN, false)),
    )?;
    lab.start_vipr()?;
    wait_members(&mut lab, STICKY, PLAIN)?;
    let reached = lab.backends_reached(frontend(STICKY), 8, Duration::from_secs(2))?;
    assert_eq!(reached.len(), 1, "a client with affinity sticks to one backend: {reached:?}");

    // Affinity moves from one Service to the other: their sets gain and lose members.
    write_atomically(
        lab.services_file(),
        &(service("sticky", STICKY, false) + &service("plain", PLAIN, true)),
    )?;
    wait_members(&mut lab, PLAIN, STICKY)?;
    let reached = lab.backends_reached(frontend(PLAIN), 8, Duration::from_secs(2))?;
    assert_eq!(reached.len(), 1, "a client with affinity sticks to one backend: {reached:?}");
    lab.stop_vipr()?;
    Ok(())
}
