//! An upgrade across a change of map layout: the previous version of vipr (built from git by
//! `cargo xtask previous-vipr`, a step of `cargo xtask test`), whose programs serve the
//! previous flows layout, is stopped as a DaemonSet rollout stops it, and the current vipr is
//! started on the same pins, while clients open 20 new connections a second and hold 100
//! long-lived sessions through a service. No connection fails, no session breaks or changes
//! backend (the previous program serves until the new maps hold the first complete sync, and
//! the tracked connections are converted to the new layout), and the maps end consistent
//! (`vipr inspect drift` exits 0). docs/reliability.md, "Upgrades". Needs root and a built
//! vipr.

use std::{
    fs::File,
    net::Ipv4Addr,
    path::Path,
    sync::Mutex,
    thread,
    time::{Duration, Instant},
};

use anyhow::Result;
use proxy_common::{legacy, pins};
use testbed::{
    exchange, load, locate_previous_vipr, locate_vipr, wait_for, Check, ClusterIpService, Endpoint, Lab,
    Vipr, WorkDir,
};

const VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const DEADLINE: Duration = Duration::from_secs(60);

fn pinned(lab: &Lab, name: &str) -> bool {
    lab.maps().dir().join(name).exists()
}

/// Waits until `tally` has tried `more` times beyond `from`, and the agent still runs.
fn wait_tried(what: &str, tally: &Mutex<load::Tally>, from: usize, more: usize) -> Result<usize> {
    wait_for(what, DEADLINE, || {
        let tried = tally.lock().unwrap().tried;
        Ok(if tried >= from + more { Check::Done(tried) } else { Check::NotYet(format!("{tried} tried")) })
    })
}

#[test]
fn an_upgrade_that_changes_a_map_layout_breaks_no_connection() -> Result<()> {
    // Alone: new connections must not fail across the upgrade.
    let _alone = testbed::exclusive();
    upgrade("upgrade", None)
}

/// The new agent killed with SIGKILL at a moment of its start (before, during or after its
/// switch), and started again: the next one finishes the upgrade.
#[test]
fn an_upgrade_cut_short_by_a_kill_is_finished_by_the_next_agent() -> Result<()> {
    // Alone: new connections must not fail across the upgrade.
    let _alone = testbed::exclusive();
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.subsec_nanos();
    let moment = Duration::from_millis(200 + u64::from(nanos % 1_600));
    eprintln!("agent_upgrade: the new agent is killed {moment:?} after its start");
    upgrade("upgrade-kill", Some(Kill::After(moment)))
}

/// The new agent killed in the middle of its switch (its TC programs serve, its socket hooks
/// are being replaced), a window of milliseconds the random moment above seldom hits: the next
/// agent redoes the switch rather than taking the unfinished one for done.
#[test]
fn an_upgrade_killed_while_switching_hooks_is_redone_by_the_next_agent() -> Result<()> {
    let _alone = testbed::exclusive();
    upgrade("upgrade-mid", Some(Kill::AtLog("hook=\"cgroup-recvmsg4\"")))
}

/// When the first new agent is killed.
#[derive(Clone, Copy)]
enum Kill {
    After(Duration),
    /// As soon as its log has this text.
    AtLog(&'static str),
}

/// Waits, polling closely (the window may last milliseconds), until the log at `path` has
/// `text`.
fn wait_for_log(path: &Path, text: &str, agent: &mut Vipr) -> Result<()> {
    let deadline = Instant::now() + DEADLINE;
    while !std::fs::read_to_string(path).unwrap_or_default().contains(text) {
        agent.ensure_running()?;
        anyhow::ensure!(Instant::now() < deadline, "{} has no {text} after {DEADLINE:?}", path.display());
        thread::sleep(Duration::from_micros(200));
    }
    Ok(())
}

/// The previous vipr serving the load, then the current one started on its pins; with
/// `kill`, that one is killed at that moment of its start and another started.
fn upgrade(label: &str, kill: Option<Kill>) -> Result<()> {
    let previous = locate_previous_vipr()?;
    let web = ClusterIpService::web(
        VIP,
        (8080, 5353),
        load::BACKENDS.iter().map(|(name, addr)| Endpoint::ready(*addr, name)).collect(),
    );
    let http = web.frontend_named("http")?;
    let lab = load::lab(label, vec![web])?;
    let logs = WorkDir::create(&format!("{label}-logs"))?;

    let mut old = lab.spawn_vipr_binary(&previous, &[], &logs.path().join("vipr-previous.log"))?;
    wait_for("the previous vipr to serve", DEADLINE, || {
        old.ensure_running()?;
        Ok(match lab.client().run(|| exchange(http, load::TIMEOUT)) {
            Ok(_) => Check::Done(()),
            Err(error) => Check::NotYet(format!("{error:#}")),
        })
    })?;
    assert!(
        pinned(&lab, legacy::FLOWS4_V3) && !pinned(&lab, pins::FLOWS4),
        "the previous vipr ({}) does not serve the previous flows layout {}: move xtask's previous::COMMIT",
        previous.display(),
        legacy::FLOWS4_V3
    );

    let client = File::open(lab.client().path())?;
    let target = http.socket_addr();
    let (upgraded, tallies) = load::during(
        &client,
        || target,
        target,
        |tallies| {
            // Every session opened and asked once through the previous program.
            wait_tried("the sessions to be asked once", &tallies.sessions, 0, load::SESSIONS)?;
            let status = old.stop()?;
            anyhow::ensure!(status.success(), "the previous vipr exited with {status} on SIGTERM");
            let first_log = logs.path().join("vipr-current.log");
            let mut new = lab.spawn_vipr(&[], &first_log)?;
            if let Some(kill) = kill {
                match kill {
                    // The moment of the kill, not a wait for an outcome.
                    Kill::After(moment) => thread::sleep(moment),
                    Kill::AtLog(text) => wait_for_log(&first_log, text, &mut new)?,
                }
                new.kill()?;
                new = lab.spawn_vipr(&[], &logs.path().join("vipr-current-2.log"))?;
            }
            wait_for("the new vipr to switch to its programs", DEADLINE, || {
                new.ensure_running()?;
                Ok(if pinned(&lab, legacy::FLOWS4_V3) || !pinned(&lab, pins::FLOWS4) {
                    Check::NotYet("the previous flows map is still pinned".to_owned())
                } else {
                    Check::Done(())
                })
            })?;
            // Two rounds of every session and a second of new connections through the new
            // program.
            let asked = tallies.sessions.lock().unwrap().tried;
            wait_tried("two more rounds of the sessions", &tallies.sessions, asked, 2 * load::SESSIONS)?;
            let opened = tallies.connections.lock().unwrap().tried;
            wait_tried("new connections through the new program", &tallies.connections, opened, 20)?;
            new.ensure_running()?;
            // The switch is in the log of the agent that made it (the first one, when it was
            // killed after it).
            let mut log = String::new();
            for name in ["vipr-current.log", "vipr-current-2.log"] {
                log += &std::fs::read_to_string(logs.path().join(name)).unwrap_or_default();
            }
            let drift = wait_for("no drift after the upgrade", DEADLINE, || {
                let output = lab
                    .node()
                    .command(locate_vipr()?)?
                    .arg("inspect")
                    .arg("drift")
                    .arg(format!("--bpf-root={}", lab.bpf_root().display()))
                    .output()?;
                let text = String::from_utf8_lossy(&output.stdout).into_owned()
                    + &String::from_utf8_lossy(&output.stderr);
                Ok(if output.status.success() { Check::Done(text) } else { Check::NotYet(text) })
            })?;
            new.stop()?;
            Ok(format!("{drift}\n{log}"))
        },
    )?;
    for line in upgraded.lines().filter(|line| {
        [
            "keep serving",
            "carr",
            "copied into",
            "serve now",
            "retired",
            "attached",
            "socket level",
            "WARN",
            "ERROR",
        ]
        .iter()
        .any(|word| line.contains(word))
    }) {
        eprintln!("agent_upgrade: {line}");
    }

    eprintln!(
        "agent_upgrade: {} new connections, {} session answers",
        tallies.connections.lock().unwrap().tried,
        tallies.sessions.lock().unwrap().tried
    );
    tallies.assert_nothing_failed();
    assert!(
        upgraded.contains("the new programs serve now"),
        "the new vipr never logged its switch:\n{upgraded}"
    );
    Ok(())
}
