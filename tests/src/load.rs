//! Client load through a service while the agent is killed, restarted or upgraded: new
//! connections at a steady rate and long-lived sessions that must keep their backend
//! (tests/tests/agent_restarts.rs, agent_upgrade.rs). Each runs on a thread of its own, in the
//! client's namespace entered by a file handle, since the lab itself is borrowed mutably
//! meanwhile (agents killed and started).

use std::{
    fs::File,
    net::SocketAddr,
    os::fd::AsRawFd,
    sync::{
        atomic::{AtomicBool, Ordering},
        Mutex,
    },
    thread,
    time::Duration,
};

use anyhow::{Context as _, Result};

use crate::{tcp_exchange, TcpSession};

/// What one kind of load tried, and what failed.
#[derive(Debug, Default)]
pub struct Tally {
    pub tried: usize,
    pub failures: Vec<String>,
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
