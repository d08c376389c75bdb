//! The hostile-object corpus (issue "Hostile traffic and hostile objects"): objects that are
//! invalid, that claim what is not theirs, or that do not fit the eBPF maps, applied one by
//! one beside a canary Service in use. Throughout, the canary answers every connection, the
//! agent runs on, `/livez` answers 200, and each bad object is named once in the log (not
//! once per sync); a good Service applied beside a bad one is programmed. The maps are small
//! (`--bpf-*-max`) so that "does not fit" is cheap, but some objects are large as the issue
//! has them (1,000 source ranges, 1,000 ports). Needs root and a built vipr
//! (`cargo build --workspace`, or VIPR_BIN).

use std::{
    fmt::Write as _,
    net::{Ipv4Addr, SocketAddr, SocketAddrV4},
    sync::atomic::{AtomicBool, AtomicUsize, Ordering},
    time::Duration,
};

use anyhow::Result;
use testbed::{
    exchange, http, locate_vipr, wait_for, write_atomically, Check, ClusterIpService, Endpoint, Frontend,
    Lab, LabConfig, LeafSpec, Protocol,
};

const CLIENT: Ipv4Addr = Ipv4Addr::new(10, 10, 0, 2);
/// The node's address toward the client.
const NODE: Ipv4Addr = Ipv4Addr::new(10, 10, 0, 1);
const BACKEND: Ipv4Addr = Ipv4Addr::new(10, 20, 1, 2);
/// The canary: `default/web`.
const CANARY: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
/// A good Service applied beside each bad object.
const BESIDE: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 99);
/// vipr's default `--healthz-bind-address`, seen from inside the node.
const HEALTHZ: SocketAddr = SocketAddr::new(std::net::IpAddr::V4(Ipv4Addr::LOCALHOST), 10256);
const TIMEOUT: Duration = Duration::from_secs(20);
const SERVICES_MAX: u32 = 512;
const BACKENDS_MAX: u32 = 2048;
const SOURCE_RANGES_MAX: u32 = 512;
const MAGLEV_TABLE: u32 = 251;

/// A Service `namespace/name` with `ports` TCP ports from 1000 up, `extra` spec fields (YAML
/// flow mappings' members), and a slice per `endpoints` chunk of 500 addresses.
fn service(
    namespace: &str,
    name: &str,
    cluster_ip: Ipv4Addr,
    ports: u16,
    extra: &str,
    endpoints: &[Ipv4Addr],
) -> String {
    let ports_yaml: Vec<String> = (0..ports)
        .map(|i| format!("{{name: p{i}, port: {}, targetPort: 8080, protocol: TCP}}", 1000 + i))
        .collect();
    let mut text = format!(
        "---\napiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: {namespace}}}\n\
         spec: {{clusterIP: {cluster_ip}, ports: [{}]{extra}}}\n",
        ports_yaml.join(", ")
    );
    let slice_ports: Vec<String> =
        (0..ports).map(|i| format!("{{name: p{i}, port: 8080, protocol: TCP}}")).collect();
    for (chunk, addresses) in endpoints.chunks(500).enumerate() {
        let addresses: Vec<String> = addresses
            .iter()
            .map(|ip| format!("{{addresses: [{ip}], conditions: {{ready: true}}}}"))
            .collect();
        write!(
            text,
            "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\n\
             metadata: {{name: {name}-{chunk}, namespace: {namespace}, labels: {{kubernetes.io/service-name: {name}}}}}\n\
             addressType: IPv4\nendpoints: [{}]\nports: [{}]\n",
            addresses.join(", "),
            slice_ports.join(", ")
        )
        .unwrap();
    }
    text
}

fn addresses(first: [u8; 2], count: usize) -> Vec<Ipv4Addr> {
    (0..count).map(|i| Ipv4Addr::new(first[0], first[1], (i / 250) as u8, (i % 250 + 1) as u8)).collect()
}

/// A bad object: its manifests and the name the log must give it once.
struct Hostile {
    object: &'static str,
    /// Part of the reason the log must give.
    reason: &'static str,
    manifests: String,
}

fn corpus() -> Vec<Hostile> {
    let ranges: Vec<String> = (0..1000).map(|i| format!("192.{}.{}.0/24", 168 + i / 256, i % 256)).collect();
    let external: Vec<String> = addresses([172, 16], 7).iter().map(ToString::to_string).collect();
    vec![
        // Another Service's cluster IP as an external IP, in a namespace that sorts first.
        Hostile {
            object: "Service aaa/hijack",
            reason: "already served by",
            manifests: service("aaa", "hijack", Ipv4Addr::new(10, 96, 1, 1), 0, "", &[])
                .replace("ports: []", &format!("ports: [{{name: http, port: 80, targetPort: 8080}}], externalIPs: [{CANARY}]")),
        },
        Hostile {
            object: "Service aaa/loopback",
            reason: "loopback",
            manifests: service("aaa", "loopback", Ipv4Addr::new(10, 96, 1, 2), 1, ", externalIPs: [127.0.0.1]", &[BACKEND]),
        },
        Hostile {
            object: "Service aaa/special",
            reason: "not a service address",
            manifests: service(
                "aaa",
                "special",
                Ipv4Addr::new(10, 96, 1, 3),
                1,
                ", externalIPs: [0.0.0.0, 224.0.0.1, 169.254.1.1, 255.255.255.255, \"::ffff:10.96.0.10\"]",
                &[BACKEND],
            ),
        },
        // The node's address on its health port.
        Hostile {
            object: "Service aaa/healthport",
            reason: "10256",
            manifests: service("aaa", "healthport", Ipv4Addr::new(10, 96, 1, 9), 0, "", &[]).replace(
                "ports: []",
                &format!("ports: [{{name: h, port: 10256, targetPort: 8080}}], externalIPs: [{NODE}]"),
            ),
        },
        // A name iptables-restore input (and logs) must never carry.
        Hostile {
            object: "Service aaa/bad_name!",
            reason: "bad_name!",
            manifests: service("aaa", "bad_name!", Ipv4Addr::new(10, 96, 1, 10), 1, "", &[BACKEND]),
        },
        // Capacity: 100 ports × 7 external IPs (and the cluster IP): 2,400 services entries.
        Hostile {
            object: "Service aaa/wide",
            reason: "does not fit the eBPF maps",
            manifests: service(
                "aaa",
                "wide",
                Ipv4Addr::new(10, 96, 1, 4),
                100,
                &format!(", externalIPs: [{}]", external.join(", ")),
                &[BACKEND],
            ),
        },
        // 1,000 loadBalancerSourceRanges on a load balancer.
        Hostile {
            object: "Service aaa/ranges",
            reason: "entries of vipr_srcr4_v1",
            manifests: service(
                "aaa",
                "ranges",
                Ipv4Addr::new(10, 96, 1, 5),
                1,
                &format!(
                    ", type: LoadBalancer, loadBalancerSourceRanges: [{}]}}\nstatus: {{loadBalancer: {{ingress: [{{ip: 172.17.0.1}}]}}",
                    ranges.join(", ")
                ),
                &[BACKEND],
            ),
        },
        // 1,000 ports, each its own Maglev table.
        Hostile {
            object: "Service aaa/ports",
            reason: "does not fit the eBPF maps",
            manifests: service("aaa", "ports", Ipv4Addr::new(10, 96, 1, 6), 1000, "", &[BACKEND]),
        },
        // 10 Maglev tables of 251 slots: more than the backends map holds.
        Hostile {
            object: "Service aaa/maglev",
            reason: "entries of vipr_back4_v2",
            manifests: service("aaa", "maglev", Ipv4Addr::new(10, 96, 1, 7), 10, "", &[BACKEND]),
        },
        // More endpoints than the backend-set membership map holds.
        Hostile {
            object: "Service aaa/endpoints",
            reason: "entries of vipr_memb4_v1",
            manifests: service("aaa", "endpoints", Ipv4Addr::new(10, 96, 1, 8), 1, "", &addresses([10, 30], 2100)),
        },
    ]
}

fn frontend(ip: Ipv4Addr, port: u16) -> Frontend {
    Frontend { addr: SocketAddrV4::new(ip, port), protocol: Protocol::Tcp }
}

fn log_lines(lab: &Lab) -> Vec<String> {
    let log = lab.vipr().expect("vipr runs").log_path();
    std::fs::read_to_string(log).unwrap_or_default().lines().map(str::to_owned).collect()
}

#[test]
fn hostile_objects_are_refused_alone_and_named_once() -> Result<()> {
    let web = ClusterIpService::web(CANARY, (8080, 5353), vec![Endpoint::ready(BACKEND, "b1")]);
    let canary = web.frontend_named("http")?;
    let mut lab = Lab::new(LabConfig {
        label: "hostile".to_owned(),
        vipr_binary: locate_vipr()?,
        client: LeafSpec::in_own_slash24("client", CLIENT)?,
        backends: vec![LeafSpec::in_own_slash24("b1", BACKEND)?],
        services: vec![web],
    })?;
    let base = std::fs::read_to_string(lab.services_file())?;
    let services_max = format!("--bpf-services-max={SERVICES_MAX}");
    let backends_max = format!("--bpf-backends-max={BACKENDS_MAX}");
    let ranges_max = format!("--bpf-source-ranges-max={SOURCE_RANGES_MAX}");
    let table = format!("--maglev-table-size={MAGLEV_TABLE}");
    lab.start_vipr_with(&[
        &services_max,
        &backends_max,
        &ranges_max,
        "--lb-algorithm=maglev",
        &table,
        // A sync that keeps failing turns /livez to 503 after twice this.
        "--sync-period=2s",
    ])?;
    // (`Lab::wait_programmed` expects a slot per endpoint, not a Maglev table.)
    lab.wait_for("the canary programmed", |maps| {
        Ok(match maps.services() {
            Ok(services) if services.contains_key(&canary) => Check::Done(()),
            Ok(_) => Check::NotYet("not yet".to_owned()),
            Err(error) => Check::NotYet(format!("{error:#}")),
        })
    })?;
    wait_for("the canary to answer", TIMEOUT, || {
        Ok(match lab.client().run(|| exchange(canary, Duration::from_secs(1))) {
            Ok(_) => Check::Done(()),
            Err(error) => Check::NotYet(format!("{error:#}")),
        })
    })?;

    let stop = AtomicBool::new(false);
    let probes = AtomicUsize::new(0);
    let failures = std::sync::Mutex::new(Vec::<String>::new());
    std::thread::scope(|scope| -> Result<()> {
        let (lab, stop, probes, failures) = (&lab, &stop, &probes, &failures);
        scope.spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                if let Err(error) = lab.client().run(|| exchange(canary, Duration::from_secs(2))) {
                    failures.lock().unwrap().push(format!("canary: {error:#}"));
                }
                match http::get(lab.node(), HEALTHZ, "/livez") {
                    Ok(answer) if answer.status == 200 => {}
                    Ok(answer) => failures.lock().unwrap().push(format!("/livez answered {}", answer.status)),
                    Err(error) => failures.lock().unwrap().push(format!("/livez: {error:#}")),
                }
                probes.fetch_add(1, Ordering::Relaxed);
                // Pacing only: a few hundred connections in a run are plenty.
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        let result = apply_corpus(lab, &base);
        stop.store(true, Ordering::Relaxed);
        result
    })?;
    assert!(probes.load(Ordering::Relaxed) > 0);
    let failures = failures.into_inner().unwrap();
    assert!(failures.is_empty(), "{} failed probes: {failures:?}", failures.len());
    let status = lab.stop_vipr()?;
    assert!(status.success(), "vipr exited before it was stopped, or badly: {status}");
    Ok(())
}

/// Applies each corpus object with a good Service beside it, then removes both.
fn apply_corpus(lab: &Lab, base: &str) -> Result<()> {
    let maps = lab.maps();
    for hostile in corpus() {
        let beside = service("zzz", "beside", BESIDE, 1, "", &[BACKEND]);
        write_atomically(lab.services_file(), &format!("{base}{}{beside}", hostile.manifests))?;
        // Named in the log, and the good Service beside it programmed all the same.
        let named_at = wait_for(&format!("{} named in the log", hostile.object), TIMEOUT, || {
            let lines = log_lines(lab);
            Ok(match lines.iter().position(|line| line.contains(&format!("{}:", hostile.object))) {
                Some(at) => Check::Done(at),
                None => Check::NotYet(lines.iter().rev().take(5).cloned().collect::<Vec<_>>().join("\n")),
            })
        })?;
        wait_for("the Service beside it programmed", TIMEOUT, || {
            Ok(match maps.services() {
                Ok(services) if services.contains_key(&frontend(BESIDE, 1000)) => Check::Done(()),
                Ok(_) => Check::NotYet("not yet".to_owned()),
                Err(error) => Check::NotYet(format!("{error:#}")),
            })
        })?;
        // Two more syncs (periodic ones every 2 s) name it no more.
        wait_for("two more syncs", TIMEOUT, || {
            let later =
                log_lines(lab).iter().skip(named_at + 1).filter(|line| line.contains("synced")).count();
            Ok(if later >= 2 { Check::Done(()) } else { Check::NotYet(format!("{later} syncs")) })
        })?;
        let lines = log_lines(lab);
        let naming: Vec<&String> =
            lines.iter().filter(|line| line.contains(&format!("{}:", hostile.object))).collect();
        assert_eq!(naming.len(), 1, "{} named once: {naming:#?}", hostile.object);
        assert!(
            naming[0].contains(hostile.reason),
            "{} refused for {}: {}",
            hostile.object,
            hostile.reason,
            naming[0]
        );
        eprintln!("{}", naming[0]);
        write_atomically(lab.services_file(), base)?;
        wait_for("the corpus object removed", TIMEOUT, || {
            Ok(match maps.services() {
                Ok(services) if !services.contains_key(&frontend(BESIDE, 1000)) => Check::Done(()),
                Ok(_) => Check::NotYet("not yet".to_owned()),
                Err(error) => Check::NotYet(format!("{error:#}")),
            })
        })?;
    }
    Ok(())
}
