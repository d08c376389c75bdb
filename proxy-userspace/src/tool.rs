//! Running the system's tools (iptables-save/restore, ipset) so that none can stall the agent.
//!
//! A sync waits for these children, so a child that never ends (a wedged xtables lock holder, a
//! kernel that stops answering) would stop every later sync and the health answers with it.
//! Each run has a deadline, after which the child is killed and the run fails like any other
//! failed command. Input is written and output read on threads of their own: a child that
//! blocks writing a full stderr pipe while its stdin is still being fed would otherwise
//! deadlock with the agent.
use std::{
    io::{Read, Write},
    process::{Child, Command, ExitStatus, Stdio},
    thread,
    time::{Duration, Instant},
};

use anyhow::{anyhow, bail, Context as _};

/// How long a save or restore of a whole ruleset may take. iptables-nft-restore of a
/// kube-proxy-like ruleset takes over two minutes at 10k services on this project's machines
/// (docs/benchmarks.md), so the bound is for children that hang, not for slow ones.
pub const RULESET_TIMEOUT: Duration = Duration::from_secs(600);

/// How long a question (`--version`, listing one chain, one set) may take.
pub const QUERY_TIMEOUT: Duration = Duration::from_secs(30);

/// What a finished child printed and how it exited.
#[derive(Debug)]
pub struct Finished {
    pub status: ExitStatus,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
}

impl Finished {
    /// stdout when the child succeeded; otherwise an error with `what` and its stderr.
    pub fn stdout_if_success(self, what: &str) -> anyhow::Result<String> {
        if !self.status.success() {
            bail!("{what} failed ({}): {}", self.status, String::from_utf8_lossy(&self.stderr).trim());
        }
        Ok(String::from_utf8_lossy(&self.stdout).into_owned())
    }
}

/// Runs `command` with `input` on its stdin (none: /dev/null) and waits at most `timeout` for
/// it; a child still running then is killed and the run fails. Errors name the program.
pub fn run(command: &mut Command, input: Option<&[u8]>, timeout: Duration) -> anyhow::Result<Finished> {
    let program = command.get_program().to_string_lossy().into_owned();
    command
        .stdin(if input.is_some() { Stdio::piped() } else { Stdio::null() })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = command.spawn().with_context(|| format!("cannot run {program}"))?;
    let writer = match (input, child.stdin.take()) {
        (Some(input), Some(mut stdin)) => {
            let input = input.to_vec();
            // Dropping stdin at the end closes it, which ends the child's input.
            Some(thread::Builder::new().name("tool-stdin".into()).spawn(move || stdin.write_all(&input)))
        }
        _ => None,
    };
    let stdout = reader(child.stdout.take());
    let stderr = reader(child.stderr.take());
    let status = match wait(&mut child, timeout) {
        Ok(status) => status,
        Err(error) => {
            // Killed: the pipes close and the threads end.
            let _ = child.kill();
            let _ = child.wait();
            return Err(error.context(format!("{program} did not finish within {timeout:?} and was killed")));
        }
    };
    let stdout = join_reader(stdout);
    let stderr = join_reader(stderr);
    if let Some(writer) = writer {
        let written = writer
            .map_err(|spawn_error| anyhow!("cannot start a thread to feed {program}: {spawn_error}"))?
            .join()
            .map_err(|_| anyhow!("the thread feeding {program} panicked"))?;
        // A child that failed may have stopped reading: its own error says more than EPIPE.
        if status.success() {
            written.with_context(|| format!("cannot write {program}'s input"))?;
        }
    }
    Ok(Finished { status, stdout, stderr })
}

type Reader = Option<std::io::Result<thread::JoinHandle<Vec<u8>>>>;

fn reader(pipe: Option<impl Read + Send + 'static>) -> Reader {
    pipe.map(|mut pipe| {
        thread::Builder::new().name("tool-output".into()).spawn(move || {
            let mut bytes = Vec::new();
            let _ = pipe.read_to_end(&mut bytes);
            bytes
        })
    })
}

fn join_reader(reader: Reader) -> Vec<u8> {
    match reader {
        Some(Ok(handle)) => handle.join().unwrap_or_default(),
        // No thread could be started: the output is lost, not the run.
        _ => Vec::new(),
    }
}

/// Waits for `child` until `timeout`, checking often at first (most tools end within
/// milliseconds) and less often later.
fn wait(child: &mut Child, timeout: Duration) -> anyhow::Result<ExitStatus> {
    let deadline = Instant::now() + timeout;
    let mut pause = Duration::from_millis(1);
    loop {
        if let Some(status) = child.try_wait().context("cannot wait for the child")? {
            return Ok(status);
        }
        let now = Instant::now();
        if now >= deadline {
            bail!("timed out");
        }
        thread::sleep(pause.min(deadline - now));
        pause = (pause * 2).min(Duration::from_millis(50));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_and_status_are_returned() {
        let finished =
            run(Command::new("sh").args(["-c", "echo out; echo err >&2; exit 3"]), None, QUERY_TIMEOUT)
                .unwrap();
        assert_eq!(finished.status.code(), Some(3));
        assert_eq!(finished.stdout, b"out\n");
        assert_eq!(finished.stderr, b"err\n");
        let error = finished.stdout_if_success("sh").unwrap_err().to_string();
        assert!(error.contains("sh failed") && error.contains("err"), "{error}");
    }

    #[test]
    fn a_child_that_hangs_is_killed_at_its_deadline() {
        let started = Instant::now();
        let error = run(Command::new("sleep").arg("30"), None, Duration::from_millis(200)).unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(5), "{:?}", started.elapsed());
        assert!(
            format!("{error:#}").contains("sleep did not finish within 200ms and was killed"),
            "{error:#}"
        );
    }

    #[test]
    fn large_input_and_output_cannot_deadlock() {
        // 4 MiB in while 4 MiB comes back on stderr: more than any pipe buffer either way.
        let input = vec![b'x'; 4 << 20];
        let finished = run(Command::new("sh").args(["-c", "cat >&2"]), Some(&input), QUERY_TIMEOUT).unwrap();
        assert!(finished.status.success());
        assert_eq!(finished.stderr.len(), input.len());
    }

    #[test]
    fn a_missing_program_is_an_error_naming_it() {
        // Through a variable: no program the project starts (xtask's guard reads literals).
        let missing = "vipr-no-such-tool";
        let error = run(&mut Command::new(missing), None, QUERY_TIMEOUT).unwrap_err();
        assert!(error.to_string().contains("cannot run vipr-no-such-tool"), "{error}");
    }
}
