//! The agent killed with SIGKILL at random moments, mid-sync of 3,000 changing services
//! included, while clients open 20 new connections a second and hold 100 long-lived sessions
//! through a service: no connection fails, no session breaks or changes backend, and after
//! each restart the maps hold exactly what the services file says (docs/reliability.md,
//! "Faults"). The datapath is pinned and serves on its own while no agent runs; what this
//! holds is that a sync cut short leaves no entry half-written (a frontend whose backend set
//! is not filled yet) and that the next agent finishes the work.
//! Needs root and a built vipr.

use std::{
    collections::BTreeMap,
    fs::File,
    net::{Ipv4Addr, SocketAddr, SocketAddrV4},
    thread,
    time::{Duration, Instant, SystemTime},
};

use anyhow::{Context as _, Result};
use testbed::{load, wait_for, Check, ClusterIpService, Endpoint, Frontend, Lab, Protocol, ServicePort};

const SERVICES: usize = 3_000;
const KILLS: usize = 5;
const CANARY: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const TARGET_PORT: u16 = 8080;
const CONSISTENT_DEADLINE: Duration = Duration::from_secs(90);

fn tenant_ip(index: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 97, (index / 250) as u8, (index % 250 + 1) as u8)
}

/// The canary (both backends) and 2,999 tenant services whose endpoints all move with each
/// generation, so that every generation is a sync of thousands of entries.
fn services(generation: usize) -> Vec<ClusterIpService> {
    let endpoint = |i: usize| Endpoint::ready(load::BACKENDS[i].1, load::BACKENDS[i].0);
    let http =
        ServicePort { name: "http".to_owned(), protocol: Protocol::Tcp, port: 80, target_port: TARGET_PORT };
    let mut services =
        vec![ClusterIpService::web(CANARY, (TARGET_PORT, 5353), vec![endpoint(0), endpoint(1)])];
    services.extend((0..SERVICES - 1).map(|i| ClusterIpService {
        namespace: "tenant".to_owned(),
        name: format!("svc-{i}"),
        cluster_ip: tenant_ip(i),
        ports: vec![http.clone()],
        endpoints: match (i + generation) % 3 {
            0 => vec![endpoint(0)],
            1 => vec![endpoint(1)],
            _ => vec![endpoint(0), endpoint(1)],
        },
    }));
    services
}

/// Waits until the services map holds exactly the lab's services (no frontend missing, none
/// left over) and each leads to exactly its endpoints; reads each map once per look, since
/// [`Lab::wait_programmed`] reads them once per frontend.
fn wait_consistent(lab: &mut Lab) -> Result<()> {
    let expected: BTreeMap<Frontend, Vec<SocketAddrV4>> = lab
        .services()
        .iter()
        .flat_map(|service| {
            service.ports.iter().map(|port| (service.frontend(port), service.expected_backends(port)))
        })
        .collect();
    let maps = lab.maps();
    let check = || -> Result<Check<()>> {
        let (services, slots) = match (maps.services(), maps.backends()) {
            (Ok(services), Ok(slots)) => (services, slots),
            (Err(error), _) | (_, Err(error)) => return Ok(Check::NotYet(format!("{error:#}"))),
        };
        let mut wrong = Vec::new();
        for (frontend, backends) in &expected {
            let Some(service) = services.get(frontend) else {
                wrong.push(format!("{frontend} missing"));
                continue;
            };
            let mut programmed: Vec<_> = (0..service.backend_count)
                .map(|slot| slots.get(&(service.backend_set, slot)).copied())
                .collect();
            programmed.sort();
            let want: Vec<_> = backends.iter().copied().map(Some).collect();
            if programmed != want {
                wrong.push(format!("{frontend} -> {programmed:?}, want {backends:?}"));
            }
        }
        wrong.extend(
            services.keys().filter(|frontend| !expected.contains_key(frontend)).map(|f| format!("{f} extra")),
        );
        Ok(match wrong.len() {
            0 => Check::Done(()),
            n => Check::NotYet(format!("{n} frontends wrong, e.g. {:?}", &wrong[..n.min(3)])),
        })
    };
    // The agent is a debug build and adopting then syncing 3,000 services takes it seconds,
    // more on a loaded machine: a deadline well above the lab's usual one.
    wait_for("the maps to hold exactly the services file", CONSISTENT_DEADLINE, || {
        lab.vipr_mut().context("no agent")?.ensure_running()?;
        check()
    })
}

/// A cheap pseudo-random sequence (xorshift), seeded from the clock and printed, so that a
/// failing run can be told from another.
struct Random(u64);

impl Random {
    fn seeded() -> Self {
        let seed =
            SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64) | 1;
        eprintln!("agent_restarts: seed {seed}");
        Self(seed)
    }

    fn below(&mut self, bound: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % bound
    }
}

#[test]
fn killing_the_agent_mid_sync_breaks_no_connection_and_the_next_one_finishes_the_sync() -> Result<()> {
    // Alone: new connections must not fail while thousands of entries are synced.
    let _alone = testbed::exclusive();
    let mut lab = load::lab("restarts", services(0))?;
    lab.start_vipr()?;
    wait_consistent(&mut lab)?;

    let mut random = Random::seeded();
    let mut targets = Random(random.below(u64::MAX) | 1);
    let next_target = move || {
        let target = match targets.below(2) {
            0 => CANARY,
            _ => tenant_ip(targets.below(SERVICES as u64 - 1) as usize),
        };
        SocketAddr::from((target, 80))
    };
    let client = File::open(lab.client().path())?;
    let (kills, tallies) = load::during(&client, next_target, SocketAddr::from((CANARY, 80)), |_| {
        let mut kills = Vec::new();
        for generation in 1..=KILLS {
            lab.set_services(services(generation))?;
            // The file source sees the file within ~0.6 s (its 200 ms polls, twice the
            // same content) and the sync of ~6,000 changed entries takes a fraction of a
            // second more: a moment in [0.3 s, 1.5 s) falls before, during or after it.
            let moment = Duration::from_millis(300 + random.below(1_200));
            thread::sleep(moment);
            let started = Instant::now();
            lab.kill_vipr().context("kill -9")?;
            lab.start_vipr()?;
            wait_consistent(&mut lab).with_context(|| format!("after the kill at {moment:?}"))?;
            kills.push(format!(
                "{moment:?} after the change, consistent {:?} after the kill",
                started.elapsed()
            ));
        }
        Ok(kills)
    })?;
    eprintln!("agent_restarts: kills: {kills:#?}");

    let (tried, asked) = (tallies.connections.lock().unwrap().tried, tallies.sessions.lock().unwrap().tried);
    assert!(tried >= 20 * KILLS, "only {tried} new connections were tried");
    assert!(asked >= load::SESSIONS * KILLS, "the sessions were asked only {asked} times");
    tallies.assert_nothing_failed();
    Ok(())
}
