//! A pinned map whose size differs from its `--bpf-*-max` flag is migrated at start: vipr
//! restarted with other sizes replaces the flows and services maps with maps of the new
//! capacity, established connections survive, and new connections find the services all the
//! while (the entries are copied before the new program is attached). Needs root and a built
//! vipr (`cargo build --workspace`, or VIPR_BIN).

use std::{
    net::{Ipv4Addr, SocketAddr},
    sync::atomic::{AtomicBool, AtomicUsize, Ordering},
    time::Duration,
};

use anyhow::{Context as _, Result};
use aya::maps::MapData;
use proxy_common::pins;
use testbed::{
    exchange, locate_vipr, wait_for, Check, ClusterIpService, Endpoint, Lab, LabConfig, LeafSpec, TcpSession,
    Vipr, WorkDir,
};

const CLIENT: Ipv4Addr = Ipv4Addr::new(10, 10, 0, 2);
const BACKEND: Ipv4Addr = Ipv4Addr::new(10, 20, 1, 2);
const VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const TIMEOUT: Duration = Duration::from_secs(2);

/// `max_entries` of a pinned map, once no migration is under way.
fn capacity(lab: &Lab, map: &str) -> Result<Check<u32>> {
    let dir = lab.maps().dir().to_owned();
    if std::fs::read_dir(&dir)?
        .flatten()
        .any(|entry| entry.file_name().to_string_lossy().ends_with("_resizing"))
    {
        return Ok(Check::NotYet("a migration is under way".to_owned()));
    }
    Ok(match MapData::from_pin(dir.join(map)) {
        Ok(data) => Check::Done(data.info().context("map info")?.max_entries()),
        Err(error) => Check::NotYet(format!("{error}")),
    })
}

fn wait_capacity(lab: &Lab, map: &str, wanted: u32) -> Result<()> {
    wait_for(&format!("{map} with {wanted} entries"), Duration::from_secs(15), || {
        Ok(match capacity(lab, map)? {
            Check::Done(size) if size == wanted => Check::Done(()),
            Check::Done(size) => Check::NotYet(format!("{size} entries")),
            Check::NotYet(why) => Check::NotYet(why),
        })
    })
}

/// Starts vipr on the lab with `flags`.
fn start(lab: &Lab, logs: &WorkDir, flags: &[&str]) -> Result<Vipr> {
    let log = logs.path().join(format!("vipr-{}.log", flags.join("_").replace(['/', '='], "-")));
    lab.spawn_vipr(flags, &log)
}

#[test]
fn resized_maps_are_migrated_and_connections_survive() {
    // Alone: no new connection may fail across the restarts. (Beside other tests, one run saw
    // a new connection reset during the restart to 2,048 flows.)
    let _alone = testbed::exclusive();
    // A panic keeps the logs for a look.
    migrate().unwrap();
}

fn migrate() -> Result<()> {
    let web = ClusterIpService::web(VIP, (8080, 5353), vec![Endpoint::ready(BACKEND, "b1")]);
    let http = web.frontend_named("http")?;
    let lab = Lab::new(LabConfig {
        label: "resize".to_owned(),
        vipr_binary: locate_vipr()?,
        client: LeafSpec::in_own_slash24("client", CLIENT)?,
        backends: vec![LeafSpec::in_own_slash24("b1", BACKEND)?],
        services: vec![web],
    })?;
    let logs = WorkDir::create("resize-logs")?;
    let mut vipr = start(&lab, &logs, &["--bpf-flows-max=4096", "--bpf-services-max=1024"])?;
    wait_for("the service to answer", Duration::from_secs(15), || {
        vipr.ensure_running()?;
        Ok(match lab.client().run(|| exchange(http, TIMEOUT)) {
            Ok(_) => Check::Done(()),
            Err(error) => Check::NotYet(format!("{error:#}")),
        })
    })?;
    wait_capacity(&lab, pins::FLOWS4, 4096)?;
    let mut session = lab.client().run(|| TcpSession::connect(SocketAddr::V4(http.addr), TIMEOUT))?;
    assert_eq!(session.ask()?.backend, "b1");

    for (flows, services) in [(8192, 2048), (2048, 512)] {
        let status = vipr.stop()?;
        assert!(status.success(), "vipr exited with {status} on SIGTERM");
        // New connections are probed throughout the restart: the new program must never meet
        // an empty services map.
        let stop = AtomicBool::new(false);
        let probes = AtomicUsize::new(0);
        let failures = std::sync::Mutex::new(Vec::<String>::new());
        vipr = std::thread::scope(|scope| -> Result<Vipr> {
            let (client, stop_ref, probes_ref, failures_ref) = (lab.client(), &stop, &probes, &failures);
            scope.spawn(move || {
                while !stop_ref.load(Ordering::Relaxed) {
                    if let Err(error) = client.run(|| exchange(http, TIMEOUT)) {
                        failures_ref.lock().unwrap().push(format!("{error:#}"));
                    }
                    probes_ref.fetch_add(1, Ordering::Relaxed);
                    // Pacing only.
                    std::thread::sleep(Duration::from_millis(5));
                }
            });
            let flows_flag = format!("--bpf-flows-max={flows}");
            let services_flag = format!("--bpf-services-max={services}");
            let started = start(&lab, &logs, &[&flows_flag, &services_flag]).and_then(|mut vipr| {
                let resized = wait_capacity(&lab, pins::FLOWS4, flows)
                    .and_then(|()| wait_capacity(&lab, pins::SERVICES4, services))
                    .and_then(|()| vipr.ensure_running());
                match resized {
                    Ok(()) => Ok(vipr),
                    Err(error) => {
                        let log = std::fs::read_to_string(vipr.log_path()).unwrap_or_default();
                        Err(error.context(format!("vipr's log:\n{log}")))
                    }
                }
            });
            stop.store(true, Ordering::Relaxed);
            started
        })?;
        let failures = failures.into_inner().unwrap();
        assert!(
            failures.is_empty(),
            "new connections failed during the restart to {flows} flows: {failures:?}"
        );
        assert!(probes.load(Ordering::Relaxed) > 0);
        let answer =
            session.ask().with_context(|| format!("the connection opened before, at {flows} flows"))?;
        assert_eq!(answer.backend, "b1");
    }
    vipr.stop()?;
    Ok(())
}
