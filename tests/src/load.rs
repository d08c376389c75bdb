//! Client load through a service while the agent is killed, restarted or upgraded: new
//! connections at a steady rate and long-lived sessions that must keep their backend
//! (tests/tests/agent_restarts.rs, agent_upgrade.rs). Each runs on a thread of its own, in the
//! client's namespace entered by a file handle, since the lab itself is borrowed mutably
//! meanwhile (agents killed and started).

use std::{
    fs::File,
    net::{Ipv4Addr, SocketAddr},
    os::fd::AsRawFd,
    sync::{
        atomic::{AtomicBool, Ordering},
        Mutex,
    },
    thread,
    time::Duration,
};

use anyhow::{Context as _, Result};

use crate::{locate_vipr, tcp_exchange, ClusterIpService, Lab, LabConfig, LeafSpec, TcpSession};

/// The backends of [`lab`]: a name and an address each.
pub const BACKENDS: [(&str, Ipv4Addr); 2] =
    [("b1", Ipv4Addr::new(10, 20, 1, 2)), ("b2", Ipv4Addr::new(10, 20, 2, 2))];

/// The lab the load runs through: a client (10.10.0.2) and [`BACKENDS`], serving `services`
/// (no vipr started yet).
pub fn lab(label: &str, services: Vec<ClusterIpService>) -> Result<Lab> {
    Lab::new(LabConfig {
        label: label.to_owned(),
        vipr_binary: locate_vipr()?,
        client: LeafSpec::in_own_slash24("client", Ipv4Addr::new(10, 10, 0, 2))?,
        backends: BACKENDS
            .iter()
            .map(|(name, addr)| LeafSpec::in_own_slash24(name, *addr))
            .collect::<Result<_>>()?,
        services,
    })
}

/// Long-lived sessions [`during`] holds.
pub const SESSIONS: usize = 100;
/// 20 new connections a second.
pub const NEW_CONNECTION_PAUSE: Duration = Duration::from_millis(50);
/// How often each long-lived session is asked who answers.
pub const SESSION_ROUND: Duration = Duration::from_millis(300);
/// Bound on a connect and on each answer. Generous: on a loaded 2-core machine an answer
/// straight from a backend, vipr or no vipr, was once seen to take over 2 s; a connection
/// whose flow is lost never answers (or is reset), which this still catches.
pub const TIMEOUT: Duration = Duration::from_secs(10);

/// What one kind of load tried, and what failed.
#[derive(Debug, Default)]
pub struct Tally {
    pub tried: usize,
    pub failures: Vec<String>,
}

/// What the two kinds of load of [`during`] have tried so far.
#[derive(Debug, Default)]
pub struct Tallies {
    pub connections: Mutex<Tally>,
    pub sessions: Mutex<Tally>,
}

impl Tallies {
    /// Panics, listing them, if any new connection failed or any session broke or moved.
    pub fn assert_nothing_failed(self) {
        let (connections, sessions) =
            (self.connections.into_inner().unwrap(), self.sessions.into_inner().unwrap());
        assert!(
            connections.failures.is_empty(),
            "{} of {} new connections failed: {:#?}",
            connections.failures.len(),
            connections.tried,
            connections.failures
        );
        assert!(sessions.failures.is_empty(), "sessions failed: {:#?}", sessions.failures);
    }
}

/// Runs `work` while, from the namespace `client` (a handle on its file, so that `work` may
/// borrow the lab mutably), one thread opens new connections to
/// `next_target()` ([`open_connections`], 20 a second) and another holds [`SESSIONS`]
/// sessions to `session_target` ([`hold_sessions`]); stops both when `work` returns. `work`
/// sees the tallies grow; they are returned with its outcome.
pub fn during<T>(
    client: &File,
    next_target: impl FnMut() -> SocketAddr + Send,
    session_target: SocketAddr,
    work: impl FnOnce(&Tallies) -> Result<T>,
) -> Result<(T, Tallies)> {
    let stop = AtomicBool::new(false);
    let tallies = Tallies::default();
    let outcome = thread::scope(|scope| -> Result<T> {
        let opener = scope.spawn(|| {
            open_connections(client, next_target, NEW_CONNECTION_PAUSE, TIMEOUT, &stop, &tallies.connections)
        });
        let holder = scope.spawn(|| {
            hold_sessions(client, session_target, SESSIONS, SESSION_ROUND, TIMEOUT, &stop, &tallies.sessions)
        });
        let outcome = work(&tallies);
        stop.store(true, Ordering::Relaxed);
        opener.join().expect("the connection opener panicked")?;
        holder.join().expect("the session holder panicked")?;
        outcome
    })?;
    Ok((outcome, tallies))
}

/// Moves the calling thread into the network namespace `namespace` (a handle on its file).
pub fn enter(namespace: &File) -> Result<()> {
    // SAFETY: plain system call on a descriptor we own; it changes only this thread.
    if unsafe { libc::setns(namespace.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(std::io::Error::last_os_error()).context("setns");
    }
    Ok(())
}

/// New connections from the namespace `client` to `next_target()`, one each `pause`, each an
/// exchange bounded by `timeout`, until `stop`.
pub fn open_connections(
    client: &File,
    mut next_target: impl FnMut() -> SocketAddr,
    pause: Duration,
    timeout: Duration,
    stop: &AtomicBool,
    tally: &Mutex<Tally>,
) -> Result<()> {
    enter(client)?;
    while !stop.load(Ordering::Relaxed) {
        let target = next_target();
        let outcome = tcp_exchange(target, timeout);
        let mut tally = tally.lock().unwrap();
        tally.tried += 1;
        if let Err(error) = outcome {
            tally.failures.push(format!("new connection to {target}: {error:#}"));
        }
        drop(tally);
        thread::sleep(pause);
    }
    Ok(())
}

/// `count` sessions from the namespace `client` to `target`, each asked every `round` until
/// `stop`: each must keep answering, from the backend that answered first.
pub fn hold_sessions(
    client: &File,
    target: SocketAddr,
    count: usize,
    round: Duration,
    timeout: Duration,
    stop: &AtomicBool,
    tally: &Mutex<Tally>,
) -> Result<()> {
    enter(client)?;
    let mut sessions = Vec::new();
    for _ in 0..count {
        let mut session = TcpSession::connect(target, timeout)?;
        let first = session.ask()?.backend;
        sessions.push((session, first, true));
    }
    while !stop.load(Ordering::Relaxed) {
        for (i, (session, first, alive)) in sessions.iter_mut().enumerate().filter(|(_, s)| s.2) {
            let outcome = session.ask();
            let mut tally = tally.lock().unwrap();
            tally.tried += 1;
            match outcome {
                Ok(answer) if answer.backend == *first => {}
                Ok(answer) => {
                    tally.failures.push(format!("session {i} moved from {first} to {}", answer.backend));
                    *alive = false;
                }
                Err(error) => {
                    tally.failures.push(format!("session {i} broke: {error:#}"));
                    *alive = false;
                }
            }
        }
        thread::sleep(round);
    }
    Ok(())
}
