//! vipr end to end on the real kernel: a client namespace reaches a ClusterIP service whose
//! endpoints live in three backend namespaces, through a node namespace where vipr runs.
//! Needs root and a built vipr (`cargo build -p proxy-userspace`, or VIPR_BIN).

use std::{
    collections::BTreeSet,
    net::{Ipv4Addr, SocketAddr},
    time::Duration,
};

use testbed::{
    count_by_backend, exchange, exchanges, locate_vipr, tcp_exchange, wait_for, Check, ClusterIpService,
    Endpoint, Frontend, Lab, LabConfig, LeafSpec, Protocol, ServicePort, TcpSession,
};

/// Bound on every connect, request and reply.
const TIMEOUT: Duration = Duration::from_secs(2);
/// Connections (or datagrams) per check: with three backends chosen at random, the chance
/// that one of them gets none of 60 is 3 * (2/3)^60, about 1e-10.
const CONNECTIONS: usize = 60;

const CLIENT: Ipv4Addr = Ipv4Addr::new(10, 10, 0, 2);
const VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const ENDPOINTS: [&str; 3] = ["b1", "b2", "b3"];
/// Runs the same servers as the endpoints but is none: an answer from it means vipr sent a
/// connection somewhere the service does not lead.
const DECOY: &str = "decoy";

fn backend_addr(name: &str) -> Ipv4Addr {
    let index =
        ENDPOINTS.iter().chain([&DECOY]).position(|candidate| *candidate == name).expect("a known backend");
    Ipv4Addr::new(10, 20, u8::try_from(index + 1).expect("few backends"), 2)
}

/// Service `web`: TCP 80 -> 8080 ("http") and UDP 53 -> 5353 ("dns"), served by `endpoints`.
fn web_service(endpoints: &[&str]) -> ClusterIpService {
    let endpoints = endpoints.iter().map(|name| Endpoint::ready(backend_addr(name), name)).collect();
    ClusterIpService::web(VIP, (8080, 5353), endpoints)
}

fn http() -> Frontend {
    web_service(&[]).frontend_named("http").unwrap()
}

fn dns() -> Frontend {
    web_service(&[]).frontend_named("dns").unwrap()
}

/// A lab serving `web` from b1..b3, with vipr started and the service programmed.
fn running_lab(label: &str) -> Lab {
    let mut lab = lab(label);
    lab.start_vipr().unwrap();
    lab.wait_programmed().unwrap();
    lab
}

fn lab(label: &str) -> Lab {
    let backends = ENDPOINTS
        .iter()
        .chain([&DECOY])
        .map(|name| LeafSpec::in_own_slash24(name, backend_addr(name)).unwrap())
        .collect();
    Lab::new(LabConfig {
        label: label.to_owned(),
        vipr_binary: locate_vipr().unwrap(),
        client: LeafSpec::in_own_slash24("client", CLIENT).unwrap(),
        backends,
        services: vec![web_service(&ENDPOINTS)],
    })
    .unwrap()
}

/// `count` new connections (datagrams for UDP) from the client to `frontend`, each checked
/// to be transparent (reply from the frontend, client address preserved); returns the set
/// of backends that answered.
fn backends_reached(lab: &Lab, frontend: Frontend, count: usize) -> BTreeSet<String> {
    try_backends_reached(lab, frontend, count).unwrap()
}

/// [`backends_reached`], an exchange that fails an error: while a change is being served, a
/// connection that reached a backend just removed may be broken off (the reaper), and a poll
/// tries again.
fn try_backends_reached(lab: &Lab, frontend: Frontend, count: usize) -> anyhow::Result<BTreeSet<String>> {
    let exchanges = lab.client().run(|| exchanges(frontend, count, TIMEOUT))?;
    for exchange in &exchanges {
        exchange.verify(frontend, CLIENT)?;
    }
    let counts = count_by_backend(&exchanges);
    eprintln!("{frontend}: {counts:?}");
    Ok(counts.into_keys().collect())
}

fn names(names: &[&str]) -> BTreeSet<String> {
    names.iter().map(|name| (*name).to_owned()).collect()
}

/// Waits until no slot of the pinned backends map holds `name`'s address.
fn wait_until_unmapped(lab: &mut Lab, name: &str) {
    let addr = backend_addr(name);
    lab.wait_for(&format!("{name} ({addr}) to leave the backends map"), |maps| {
        Ok(match maps.backends() {
            Ok(slots) if slots.values().all(|backend| *backend.ip() != addr) => Check::Done(()),
            Ok(slots) => Check::NotYet(format!("{slots:?}")),
            Err(error) => Check::NotYet(format!("{error:#}")),
        })
    })
    .unwrap();
}

/// An open connection to `http`, and the backend that answered it first.
struct Session {
    connection: TcpSession,
    backend: String,
}

/// Opens `count` connections to `http` and keeps them open. Several rather than one: if vipr
/// lost their flows, each would be balanced afresh and land elsewhere with a chance of 1/2 or
/// more, so one of them would almost surely notice.
fn open_sessions(lab: &Lab, count: usize) -> Vec<Session> {
    lab.client()
        .run(|| {
            (0..count)
                .map(|_| {
                    let mut connection = TcpSession::connect(http().socket_addr(), TIMEOUT)?;
                    let backend = connection.ask()?.backend;
                    Ok(Session { connection, backend })
                })
                .collect()
        })
        .unwrap()
}

/// Asks every session again; each must still be answered by its first backend, which must
/// still see the client's own address.
fn assert_still_served(sessions: &mut [Session], moment: &str) {
    for Session { connection, backend } in sessions {
        let local = connection.local_addr().unwrap();
        for _ in 0..2 {
            let answer = connection
                .ask()
                .unwrap_or_else(|error| panic!("{moment}: connection from {local} broke: {error:#}"));
            assert_eq!(&answer.backend, backend, "{moment}: connection from {local} moved");
            assert_eq!(answer.observed_client, local, "{moment}: client address rewritten");
        }
    }
}

#[test]
fn spreads_tcp_and_udp_over_all_endpoints_transparently() {
    let lab = running_lab("e2e-spread");
    for frontend in [http(), dns()] {
        assert_eq!(
            backends_reached(&lab, frontend, CONNECTIONS),
            names(&ENDPOINTS),
            "{frontend} must reach every endpoint and nothing else"
        );
    }
}

#[test]
fn a_removed_endpoint_gets_no_new_connections() {
    let mut lab = running_lab("e2e-remove");
    assert_eq!(backends_reached(&lab, http(), CONNECTIONS), names(&ENDPOINTS));

    // No UDP before the change: a new UDP socket may get the source port of an old one, and
    // that would be the old flow rather than a new connection.
    lab.set_services(vec![web_service(&["b1", "b2"])]).unwrap();
    wait_until_unmapped(&mut lab, "b3");
    lab.wait_programmed().unwrap();
    for frontend in [http(), dns()] {
        assert_eq!(
            backends_reached(&lab, frontend, CONNECTIONS),
            names(&["b1", "b2"]),
            "{frontend} after b3 was removed"
        );
    }
}

#[test]
fn an_established_connection_survives_endpoint_changes_and_agent_restarts() {
    let mut lab = running_lab("e2e-restart");
    let mut sessions = open_sessions(&lab, 12);
    assert_still_served(&mut sessions, "right after connecting");

    // Only connections to the endpoints that stay are kept open: what should happen to one
    // whose endpoint goes away is not this test's question.
    let removed = "b3";
    let remaining = ["b1", "b2"];
    sessions.retain(|session| session.backend != removed);
    assert!(sessions.len() >= 2, "hardly any connection went to b1 or b2");
    lab.set_services(vec![web_service(&remaining)]).unwrap();
    wait_until_unmapped(&mut lab, removed);
    assert_still_served(&mut sessions, "after removing b3");

    let status = lab.stop_vipr().unwrap();
    assert!(status.success(), "vipr exited with {status} on SIGTERM");
    assert!(lab.maps().dir().is_dir(), "SIGTERM must leave the datapath pinned");
    assert_still_served(&mut sessions, "while vipr is stopped");
    assert_eq!(
        backends_reached(&lab, http(), CONNECTIONS),
        names(&remaining),
        "new connections while vipr is stopped"
    );

    // A change made while vipr is down shows that the restarted agent took over the pins
    // (the maps still hold the old state, so they cannot show that by themselves).
    lab.set_services(vec![web_service(&ENDPOINTS)]).unwrap();
    lab.start_vipr().unwrap();
    lab.wait_programmed().unwrap();
    assert_still_served(&mut sessions, "after restarting vipr");
    assert_eq!(backends_reached(&lab, http(), CONNECTIONS), names(&ENDPOINTS));
}

/// The ids of the BPF links pinned anywhere under `dir` (the TCX and XDP attachments).
fn pinned_link_ids(dir: &std::path::Path) -> Vec<u64> {
    let mut ids = Vec::new();
    let mut pending = vec![dir.to_owned()];
    while let Some(dir) = pending.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                pending.push(path);
                continue;
            }
            let shown = std::process::Command::new("bpftool")
                .args(["-j", "link", "show", "pinned"])
                .arg(&path)
                .output()
                .unwrap();
            // A map's pin is no link: bpftool refuses it.
            if let Ok(link) = serde_json::from_slice::<serde_json::Value>(&shown.stdout) {
                ids.extend(link["id"].as_u64());
            }
        }
    }
    ids
}

/// Stopping vipr leaves its datapath; the uninstall DaemonSet's command removes all of it:
/// no pin, no link (so no program on a device), no service answered.
#[test]
fn cleanup_detaches_the_datapath_and_removes_the_pins() {
    let mut lab = running_lab("e2e-cleanup");
    for frontend in [http(), dns()] {
        lab.client().run(|| exchange(frontend, TIMEOUT)).unwrap();
    }

    let status = lab.stop_vipr().unwrap();
    assert!(status.success(), "vipr exited with {status} on SIGTERM");
    let pins = lab.maps().dir().to_owned();
    let links = pinned_link_ids(&pins);
    assert!(!links.is_empty(), "no pinned link under {}", pins.display());
    // The uninstall DaemonSet's command (`vipr --cleanup`, without the agent's --devices).
    lab.cleanup_vipr().unwrap();

    assert!(!pins.exists(), "{} survived vipr --cleanup", pins.display());
    for id in links {
        let shown =
            std::process::Command::new("bpftool").args(["link", "show", "id", &id.to_string()]).output();
        assert!(
            !shown.unwrap().status.success(),
            "link {id} (the program on a device) survived vipr --cleanup"
        );
    }
    for frontend in [http(), dns()] {
        if let Ok(exchange) = lab.client().run(|| exchange(frontend, TIMEOUT)) {
            panic!("{frontend} still answers after vipr --cleanup: {exchange:?}");
        }
    }
    // The network itself still works: only the service is gone.
    let b1 = SocketAddr::from((backend_addr("b1"), 8080));
    let direct = lab.client().run(|| tcp_exchange(b1, TIMEOUT)).unwrap();
    assert_eq!(direct.answer.backend, "b1");
}

#[test]
fn without_devices_an_interface_created_later_is_served_too() {
    let mut lab = lab("e2e-devices");
    lab.start_vipr_on_all_devices().unwrap();
    lab.wait_programmed().unwrap();
    // A pod that starts after vipr: its first connections must already be balanced.
    let late_client = Ipv4Addr::new(10, 30, 0, 2);
    let late = lab.add_leaf(LeafSpec::in_own_slash24("late", late_client).unwrap()).unwrap();
    let exchange = wait_for("the new interface to be served", Duration::from_secs(10), || {
        Ok(match late.run(|| tcp_exchange(http().socket_addr(), TIMEOUT)) {
            Ok(exchange) => Check::Done(exchange),
            Err(error) => Check::NotYet(format!("{error:#}")),
        })
    })
    .unwrap();
    exchange.verify(http(), late_client).unwrap();
    assert!(ENDPOINTS.contains(&exchange.answer.backend.as_str()), "{exchange:?}");
}

#[test]
fn a_listed_device_created_again_is_served_again() {
    let lab = running_lab("e2e-recreate");
    assert_eq!(backends_reached(&lab, http(), CONNECTIONS), names(&ENDPOINTS));
    // The client's veth goes away and comes back under its name, with a new interface index
    // and without vipr's program.
    lab.topology().rewire_leaf("client").unwrap();
    let exchange = testbed::wait_for("the re-created device to be served", Duration::from_secs(10), || {
        Ok(match lab.client().run(|| tcp_exchange(http().socket_addr(), TIMEOUT)) {
            Ok(exchange) => testbed::Check::Done(exchange),
            Err(error) => testbed::Check::NotYet(format!("{error:#}")),
        })
    })
    .unwrap();
    exchange.verify(http(), CLIENT).unwrap();
    assert_eq!(backends_reached(&lab, http(), CONNECTIONS), names(&ENDPOINTS));
}

/// `vipr inspect ARGS --bpf-root=<the lab's>` in the node namespace: its exit code, stdout and
/// stderr.
fn run_inspect(lab: &Lab, args: &[&str]) -> (Option<i32>, String, String) {
    let output = lab
        .node()
        .command(locate_vipr().unwrap())
        .unwrap()
        .arg("inspect")
        .args(args)
        .arg(format!("--bpf-root={}", lab.bpf_root().display()))
        .output()
        .unwrap();
    let text = |bytes: Vec<u8>| String::from_utf8(bytes).unwrap();
    (output.status.code(), text(output.stdout), text(output.stderr))
}

/// [`run_inspect`] that must succeed: its stdout.
fn inspect(lab: &Lab, args: &[&str]) -> String {
    let (code, stdout, stderr) = run_inspect(lab, args);
    assert_eq!(code, Some(0), "vipr inspect {args:?}: {stderr}");
    stdout
}

#[test]
fn inspect_shows_frontends_backends_maps_and_devices_while_vipr_runs_and_after() {
    let mut lab = running_lab("e2e-inspect");
    let reached = backends_reached(&lab, http(), CONNECTIONS);
    assert_eq!(reached, names(&ENDPOINTS));
    let endpoints: BTreeSet<String> =
        ENDPOINTS.iter().map(|name| SocketAddr::from((backend_addr(name), 8080)).to_string()).collect();

    for running in [true, false] {
        let services: serde_json::Value =
            serde_json::from_str(&inspect(&lab, &["services", "-o", "json", "--frontend", "10.96.0.10:80"]))
                .unwrap();
        let outside = services
            .as_array()
            .unwrap()
            .iter()
            .find(|frontend| frontend["source"] == "outside" && frontend["protocol"] == "TCP")
            .unwrap_or_else(|| panic!("no outside TCP frontend in {services:#}"));
        let backends = outside["backends"].as_array().unwrap();
        let listed: BTreeSet<String> =
            backends.iter().map(|backend| backend["address"].as_str().unwrap().to_owned()).collect();
        assert_eq!(listed, endpoints, "{outside:#}");
        let packets: u64 = backends.iter().map(|backend| backend["packets"].as_u64().unwrap()).sum();
        assert!(packets >= 2 * CONNECTIONS as u64, "the {CONNECTIONS} connections are counted: {outside:#}");

        let text = inspect(&lab, &["services"]);
        assert!(text.lines().any(|line| line.starts_with("TCP") && line.contains("10.96.0.10:80")), "{text}");
        for endpoint in &endpoints {
            assert!(text.contains(&format!("  -> {endpoint}")), "{endpoint} missing:\n{text}");
        }

        let maps: serde_json::Value = serde_json::from_str(&inspect(&lab, &["maps", "-o", "json"])).unwrap();
        let services_map = maps
            .as_array()
            .unwrap()
            .iter()
            .find(|map| map["name"] == proxy_common::pins::SERVICES4)
            .unwrap_or_else(|| panic!("no services map in {maps:#}"));
        // http and dns, for three source classes.
        assert_eq!(services_map["entries"], 6, "{services_map:#}");
        assert!(services_map["capacity"].as_u64().unwrap() >= 6);

        let devices = inspect(&lab, &["devices"]);
        assert!(
            devices.lines().any(|line| line.starts_with("to-client") && line.ends_with("attached")),
            "{devices}"
        );
        if running {
            lab.stop_vipr().unwrap();
        }
    }
}

#[test]
fn inspect_flows_lists_each_open_connection_with_its_backend() {
    let lab = running_lab("e2e-flows");
    let sessions = open_sessions(&lab, 6);
    let clients: BTreeSet<String> =
        sessions.iter().map(|session| session.connection.local_addr().unwrap().to_string()).collect();

    let flows: serde_json::Value =
        serde_json::from_str(&inspect(&lab, &["flows", "-o", "json", "--frontend", "10.96.0.10:80"]))
            .unwrap();
    let shown = flows["shown"].as_array().unwrap();
    // The sessions asked and were answered: their handshakes completed.
    let established: BTreeSet<String> = shown
        .iter()
        .filter(|flow| flow["state"] == "established")
        .map(|flow| flow["client"].as_str().unwrap().to_owned())
        .collect();
    assert!(clients.is_subset(&established), "{clients:?} not all established in {flows:#}");
    for session in &sessions {
        let client = session.connection.local_addr().unwrap().to_string();
        let flow = shown.iter().find(|flow| flow["client"] == client.as_str()).unwrap();
        let backend = SocketAddr::from((backend_addr(&session.backend), 8080)).to_string();
        assert_eq!(flow["backend"], backend.as_str(), "{flow:#}");
        assert_eq!(flow["frontend"], "10.96.0.10:80");
    }

    // By backend: only the sessions that went there.
    let first = &sessions[0].backend;
    let backend = SocketAddr::from((backend_addr(first), 8080)).to_string();
    let text = inspect(&lab, &["flows", "--backend", &backend]);
    let to_first = sessions.iter().filter(|session| &session.backend == first).count();
    let rows: Vec<&str> = text.lines().filter(|line| line.starts_with("TCP")).collect();
    assert_eq!(rows.len(), to_first, "{text}");
    assert!(rows.iter().all(|row| row.contains(&backend) && row.contains("established")), "{text}");
    assert!(text.ends_with(&format!("{to_first} of {to_first} matching connections shown\n")), "{text}");
}

#[test]
fn the_first_datagram_of_a_pod_created_after_vipr_started_is_balanced() {
    // Alone: vipr must attach to the new device before the pod's first datagram, a race it
    // wins by hundreds of milliseconds on a quiet node. (Beside other tests, once, a sync that
    // took 641 ms held up the link notification and the datagram went by first.)
    let _alone = testbed::exclusive();
    let mut lab = lab("e2e-first");
    lab.start_vipr_on_all_devices().unwrap();
    lab.wait_programmed().unwrap();
    let late_client = Ipv4Addr::new(10, 30, 0, 3);
    let late = lab.add_leaf(LeafSpec::in_own_slash24("late", late_client).unwrap()).unwrap();
    // No retry and no wait: a pod's first DNS query leaves as soon as its interface is up, and
    // must already find vipr's program there.
    let exchange = late.run(|| exchange(dns(), TIMEOUT)).unwrap();
    exchange.verify(dns(), late_client).unwrap();
    assert!(ENDPOINTS.contains(&exchange.answer.backend.as_str()), "{exchange:?}");
}

/// Sends from `socket` to `frontend` and returns the name of the backend that answered.
fn ask_over(socket: &std::net::UdpSocket, frontend: Frontend) -> anyhow::Result<String> {
    socket.send_to(b"who are you?", frontend.socket_addr())?;
    let mut reply = [0u8; 1500];
    let (len, _) = socket.recv_from(&mut reply)?;
    Ok(std::str::from_utf8(&reply[..len])?.parse::<testbed::Answer>()?.backend)
}

#[test]
fn connections_of_an_endpoint_that_is_gone_are_broken_off_and_udp_moves_on() {
    let mut lab = running_lab("e2e-gone");
    // Connections (TCP sessions, UDP sockets with their source port) until some lead to b3.
    let mut sessions = open_sessions(&lab, 12);
    while !sessions.iter().any(|session| session.backend == "b3") {
        assert!(sessions.len() < 120, "no connection ever reached b3");
        sessions.extend(open_sessions(&lab, 12));
    }
    let udp_to_b3 = lab
        .client()
        .run(|| {
            for _ in 0..120 {
                let socket = std::net::UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))?;
                socket.set_read_timeout(Some(TIMEOUT))?;
                if ask_over(&socket, dns())? == "b3" {
                    return Ok(socket);
                }
            }
            anyhow::bail!("no UDP flow ever reached b3")
        })
        .unwrap();

    lab.set_services(vec![web_service(&["b1", "b2"])]).unwrap();
    wait_until_unmapped(&mut lab, "b3");

    // b3 still runs its servers, so only vipr forgetting its flows can change the answers.
    let moved_to = wait_for("the UDP flow to leave b3, which is gone", Duration::from_secs(10), || {
        let backend = ask_over(&udp_to_b3, dns())?;
        Ok(if backend == "b3" { Check::NotYet(backend) } else { Check::Done(backend) })
    })
    .unwrap();
    eprintln!("the UDP flow moved from b3 to {moved_to}");
    let (mut gone, mut kept): (Vec<Session>, Vec<Session>) =
        sessions.into_iter().partition(|session| session.backend == "b3");
    for Session { connection, .. } in &mut gone {
        let asked = std::time::Instant::now();
        let error = connection.ask().expect_err("a connection to b3 still works after b3 is gone");
        assert!(asked.elapsed() < TIMEOUT, "broken off only by a timeout ({error:#}), not actively");
    }
    assert_still_served(&mut kept, "after b3 was removed");
}

/// A second cluster IP, programmed after the lab's echo servers started (so none listens on
/// its target ports): `refused` (UDP 54 -> 5454) has no listener at all, `big` (UDP 55 ->
/// 7777) is answered by a test's own echo socket in b1.
fn probe_service() -> ClusterIpService {
    let port = |name: &str, port, target_port| ServicePort {
        name: name.to_owned(),
        protocol: Protocol::Udp,
        port,
        target_port,
    };
    ClusterIpService {
        namespace: "default".to_owned(),
        name: "probe".to_owned(),
        cluster_ip: Ipv4Addr::new(10, 96, 0, 11),
        ports: vec![port("refused", 54, 5454), port("big", 55, 7777)],
        endpoints: vec![Endpoint::ready(backend_addr("b1"), "b1")],
    }
}

/// A UDP socket of the client connected to `dst`: it gets only datagrams from `dst`, and the
/// ICMP errors about its own.
fn connected_udp(dst: SocketAddr) -> anyhow::Result<std::net::UdpSocket> {
    let socket = std::net::UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))?;
    socket.set_read_timeout(Some(TIMEOUT))?;
    socket.connect(dst)?;
    Ok(socket)
}

/// ICMP errors and IPv4 fragments through a VIP: the port unreachable of an endpoint without
/// a listener reaches the client's connected socket as ECONNREFUSED (reverse-NATed to the
/// frontend, or the socket would not match it), and a 4000-byte datagram crosses 1500-byte
/// veths in fragments, arrives whole at the endpoint, and its echo returns whole.
#[test]
fn icmp_errors_and_fragments_cross_the_vip() {
    let mut lab = running_lab("e2e-icmp-frag");
    lab.set_services(vec![web_service(&ENDPOINTS), probe_service()]).unwrap();
    lab.wait_programmed().unwrap();
    let refused = probe_service().frontend_named("refused").unwrap().socket_addr();
    let big = probe_service().frontend_named("big").unwrap().socket_addr();
    for netns in [lab.client(), &lab.topology().leaf("b1").unwrap().netns] {
        let link = netns.ip(&["link", "show", "eth0"]).unwrap();
        assert!(link.contains("mtu 1500"), "the test needs 1500-byte links: {link}");
    }

    let error = lab
        .client()
        .run(|| {
            let socket = connected_udp(refused)?;
            socket.send(b"anyone?")?;
            let mut reply = [0u8; 64];
            Ok(socket.recv(&mut reply).expect_err("an answer from a port nobody listens on"))
        })
        .unwrap();
    assert_eq!(error.kind(), std::io::ErrorKind::ConnectionRefused, "{refused}: {error}");

    // The endpoint's echo, bound in b1 before the datagram is sent; it answers one datagram.
    let echo = lab
        .topology()
        .leaf("b1")
        .unwrap()
        .netns
        .run(|| Ok(std::net::UdpSocket::bind((backend_addr("b1"), 7777))?))
        .unwrap();
    echo.set_read_timeout(Some(TIMEOUT)).unwrap();
    let server = std::thread::spawn(move || -> std::io::Result<Vec<u8>> {
        let mut datagram = vec![0u8; 65536];
        let (len, peer) = echo.recv_from(&mut datagram)?;
        datagram.truncate(len);
        echo.send_to(&datagram, peer)?;
        Ok(datagram)
    });
    let sent: Vec<u8> = (0..4000u32).map(|i| (i * 7 % 251) as u8).collect();
    let echoed = lab
        .client()
        .run(|| {
            let socket = connected_udp(big)?;
            socket.send(&sent)?;
            let mut reply = vec![0u8; 65536];
            let len = socket.recv(&mut reply)?;
            reply.truncate(len);
            Ok(reply)
        })
        .unwrap();
    let received = server.join().unwrap().expect("b1 received the datagram");
    assert!(received == sent, "b1 received {} bytes, not the 4000 sent", received.len());
    assert!(echoed == sent, "the echo came back as {} bytes, not the 4000 sent", echoed.len());
}

/// After the first sync the agent records a sync's changes in the record's journal, not the
/// whole state: `vipr inspect drift` replays it, so each endpoint change still finds no drift.
#[test]
fn inspect_drift_follows_syncs_that_changed_a_few_entries() {
    let mut lab = running_lab("e2e-drift-journal");
    let record = vipr::dataplane::ebpf::record::path(
        std::path::Path::new(vipr::inspect::DEFAULT_STATE_DIR),
        lab.bpf_root(),
    );
    let mut journal = record.into_os_string();
    journal.push(".journal");
    let no_drift = |lab: &Lab, moment: &str| {
        testbed::wait_for(&format!("no drift {moment}"), Duration::from_secs(10), || {
            let (code, stdout, stderr) = run_inspect(lab, &["drift"]);
            Ok(match code {
                Some(0) => Check::Done(()),
                other => Check::NotYet(format!("exit {other:?}: {stdout}{stderr}")),
            })
        })
        .unwrap();
    };
    no_drift(&lab, "after the first sync");
    for endpoints in [&["b1", "b2"][..], &["b2"], &["b1", "b3"]] {
        lab.set_services(vec![web_service(endpoints)]).unwrap();
        let wanted: BTreeSet<String> = endpoints.iter().map(|name| name.to_string()).collect();
        testbed::wait_for("the change to be served", Duration::from_secs(10), || {
            Ok(match try_backends_reached(&lab, http(), CONNECTIONS) {
                Ok(reached) if reached == wanted => Check::Done(()),
                Ok(reached) => Check::NotYet(format!("{reached:?}")),
                Err(error) => Check::NotYet(format!("{error:#}")),
            })
        })
        .unwrap();
        no_drift(&lab, &format!("with endpoints {endpoints:?}"));
    }
    let journaled = std::fs::metadata(&journal).map_or(0, |metadata| metadata.len());
    assert!(journaled > 0, "the changes were not journaled: {} is empty", journal.to_string_lossy());
}

#[test]
fn inspect_drift_is_empty_when_synced_and_names_entries_changed_behind_the_agent() {
    use aya::maps::{HashMap, Map, MapData};
    use proxy_common::{pins, source_class, Backend4, BackendSlot, Service, ServiceKey4};

    let mut lab = running_lab("e2e-drift");
    // The agent records its desired state after the sync that programmed the maps.
    let report = testbed::wait_for("no drift on the synced node", Duration::from_secs(10), || {
        let (code, stdout, stderr) = run_inspect(&lab, &["drift", "-o", "json"]);
        Ok(match code {
            Some(0) => Check::Done(stdout),
            other => Check::NotYet(format!("exit {other:?}: {stdout}{stderr}")),
        })
    })
    .unwrap();
    let report: serde_json::Value = serde_json::from_str(&report).unwrap();
    assert_eq!(report["differences"], serde_json::json!([]), "{report:#}");
    // http and dns for three source classes, and the cluster IP's reject entry at least.
    assert!(report["wanted_entries"].as_u64().unwrap() >= 7, "{report:#}");
    assert!(inspect(&lab, &["drift"]).contains("No drift"));

    // Behind the stopped agent's back: one entry deleted, one backend slot pointed elsewhere.
    lab.stop_vipr().unwrap();
    let open = |map: &str| MapData::from_pin(lab.maps().path(map)).unwrap();
    let mut services: HashMap<_, ServiceKey4, Service> =
        HashMap::try_from(Map::HashMap(open(pins::SERVICES4))).unwrap();
    let key = |port, proto, source_class| ServiceKey4 { addr: VIP.octets(), port, proto, source_class };
    services.remove(&key(80, proxy_common::proto::TCP, source_class::POD)).unwrap();
    let dns = services.get(&key(53, proxy_common::proto::UDP, source_class::OUTSIDE), 0).unwrap();
    let mut backends: HashMap<_, BackendSlot, Backend4> =
        HashMap::try_from(Map::HashMap(open(pins::BACKENDS4))).unwrap();
    let slot = BackendSlot { backend_set: dns.backend_set, slot: 0 };
    let mut backend = backends.get(&slot, 0).unwrap();
    backend.addr = backend_addr(DECOY).octets();
    backends.insert(slot, backend, 0).unwrap();

    let (code, stdout, stderr) = run_inspect(&lab, &["drift", "-o", "json"]);
    assert_eq!(code, Some(1), "drift exits 1: {stdout}{stderr}");
    let report: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    let differences = report["differences"].as_array().unwrap();
    let found = |key: &str| {
        differences
            .iter()
            .find(|difference| difference["key"] == key)
            .unwrap_or_else(|| panic!("{key} not in {report:#}"))
    };
    let missing = found("TCP 10.96.0.10:80 from pod");
    assert_eq!(missing["kind"], "missing", "{missing:#}");
    assert!(missing["kernel"].is_null());
    // Every entry sharing the set sees the decoy now.
    let decoy = SocketAddr::from((backend_addr(DECOY), 5353)).to_string();
    for source in ["outside", "pod", "node"] {
        let changed = found(&format!("UDP 10.96.0.10:53 from {source}"));
        assert_eq!(changed["kind"], "different", "{changed:#}");
        assert!(changed["kernel"].as_str().unwrap().contains(&decoy), "{changed:#}");
        assert!(!changed["wanted"].as_str().unwrap().contains(&decoy), "{changed:#}");
    }
    assert_eq!(differences.len(), 4, "nothing else differs: {report:#}");

    let (code, text, _) = run_inspect(&lab, &["drift"]);
    assert_eq!(code, Some(1));
    assert!(
        text.lines().any(|line| line.starts_with("missing") && line.contains("TCP 10.96.0.10:80 from pod")),
        "{text}"
    );

    // A restarted agent repairs the maps: no drift again.
    lab.start_vipr().unwrap();
    lab.wait_programmed().unwrap();
    testbed::wait_for("the restarted agent to repair the drift", Duration::from_secs(10), || {
        let (code, stdout, stderr) = run_inspect(&lab, &["drift"]);
        Ok(if code == Some(0) { Check::Done(()) } else { Check::NotYet(format!("{stdout}{stderr}")) })
    })
    .unwrap();
}
