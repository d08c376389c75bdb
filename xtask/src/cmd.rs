//! Running external commands so that a log shows exactly what ran, and a failure names the
//! command that failed.
use std::borrow::Cow;
use std::io::{BufRead as _, BufReader, ErrorKind, Write as _};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::Mutex;

use anyhow::{bail, Context as _, Result};

/// Runs `cmd` with inherited stdio; fails unless it exits successfully.
pub fn run(cmd: &mut Command) -> Result<()> {
    let status = status(cmd)?;
    if !status.success() {
        bail!("command failed ({}): {}", describe(status), shell_line(cmd));
    }
    Ok(())
}

/// Tests counted over every [`run_tests`] of this xtask run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tally {
    pub passed: u64,
    pub failed: u64,
}

static TALLY: Mutex<Tally> = Mutex::new(Tally { passed: 0, failed: 0 });

pub fn tally() -> Tally {
    *TALLY.lock().unwrap_or_else(|poison| poison.into_inner())
}

/// Runs a test runner like [`run`], echoing its stdout while adding up its result lines:
/// libtest's `test result: ok. 5 passed; 1 failed; ...` and the plain `N passed, N failed`.
/// cargo's `Running <binary>` lines (on stderr) name the binary each result line's time
/// belongs to, for [`test_binary_times`].
pub fn run_tests(cmd: &mut Command) -> Result<()> {
    let running = std::sync::Arc::new(Mutex::new(String::new()));
    let running_for_stderr = running.clone();
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    echo(cmd);
    let mut child = cmd.spawn().with_context(|| format!("could not start: {}", shell_line(cmd)))?;
    let stderr = child.stderr.take().context("no stderr pipe")?;
    // cargo prints `Running` before it starts the binary, so it is read well before that
    // binary's result line arrives on stdout.
    let stderr_echo = std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(std::result::Result::ok) {
            eprintln!("{line}");
            if let Some(binary) = running_binary(&line) {
                *running_for_stderr.lock().unwrap_or_else(|poison| poison.into_inner()) = binary.to_owned();
            }
        }
    });
    let outcome = echo_stdout(&mut child, cmd, |line| {
        let Some(counts) = parse_result_line(line) else { return };
        let mut tally = TALLY.lock().unwrap_or_else(|poison| poison.into_inner());
        tally.passed += counts.passed;
        tally.failed += counts.failed;
        if let Some(seconds) = finished_in(line) {
            let binary = running.lock().unwrap_or_else(|poison| poison.into_inner()).clone();
            TIMES.lock().unwrap_or_else(|poison| poison.into_inner()).push((binary, seconds));
        }
    });
    let _ = stderr_echo.join();
    outcome
}

/// How long each test binary of every [`run_tests`] took, in the order they ran.
pub fn test_binary_times() -> Vec<(String, f64)> {
    TIMES.lock().unwrap_or_else(|poison| poison.into_inner()).clone()
}

static TIMES: Mutex<Vec<(String, f64)>> = Mutex::new(Vec::new());

/// `     Running tests/flood.rs (target/debug/deps/flood-0123)` -> `tests/flood.rs`;
/// `Running unittests src/lib.rs (target/debug/deps/vipr-0123)` -> `vipr-0123`'s crate and file.
fn running_binary(line: &str) -> Option<&str> {
    let rest = line.trim_start().strip_prefix("Running ")?;
    let (source, binary) = rest.split_once(" (")?;
    let crate_name = binary.trim_end_matches(')').rsplit('/').next()?;
    Some(if source.starts_with("unittests") { crate_name } else { source })
}

/// libtest's `...; finished in 12.34s` -> 12.34.
fn finished_in(line: &str) -> Option<f64> {
    line.rsplit_once("finished in ")?.1.trim().strip_suffix('s')?.parse().ok()
}

/// Runs a checker like [`run`], echoing its stdout; its failure lines are kept for the summary
/// (see [`failure_lines`]) but its counts are not tests.
pub fn run_checker(cmd: &mut Command) -> Result<()> {
    run_echoing(cmd, |_| {})
}

/// Lines that named a failure, over every [`run_tests`] and [`run_checker`] of this xtask run:
/// a CI log is read from its end, and thousands of lines above it is where a failing flow or
/// test would otherwise be.
pub fn failure_lines() -> Vec<String> {
    FAILURE_LINES.lock().unwrap_or_else(|poison| poison.into_inner()).clone()
}

static FAILURE_LINES: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// libtest's `test name ... FAILED` and the conformance runner's `... VERDICT FAIL reason`.
fn names_a_failure(line: &str) -> bool {
    (line.starts_with("test ") && line.ends_with(" ... FAILED")) || line.contains(" FAIL ")
}

fn run_echoing(cmd: &mut Command, on_line: impl FnMut(&str)) -> Result<()> {
    echo(cmd);
    let mut child = cmd
        .stdout(Stdio::piped())
        .spawn()
        .with_context(|| format!("could not start: {}", shell_line(cmd)))?;
    echo_stdout(&mut child, cmd, on_line)
}

/// Echoes `child`'s piped stdout line by line, keeping failure lines for the summary, then
/// waits for it; fails unless it exits successfully.
fn echo_stdout(child: &mut std::process::Child, cmd: &Command, mut on_line: impl FnMut(&str)) -> Result<()> {
    let stdout = child.stdout.take().context("no stdout pipe")?;
    let mut out = std::io::stdout();
    for line in BufReader::new(stdout).lines() {
        let line = line.context("reading the runner's output")?;
        writeln!(out, "{line}")?;
        if names_a_failure(&line) {
            FAILURE_LINES.lock().unwrap_or_else(|poison| poison.into_inner()).push(line.clone());
        }
        on_line(&line);
    }
    let status = child.wait().with_context(|| format!("waiting for: {}", shell_line(cmd)))?;
    if !status.success() {
        bail!("command failed ({}): {}", describe(status), shell_line(cmd));
    }
    Ok(())
}

fn parse_result_line(line: &str) -> Option<Tally> {
    let counts = line
        .strip_prefix("test result: ")
        .map_or(line, |rest| rest.split_once(". ").map_or(rest, |(_, c)| c));
    let count = |word: &str| -> Option<u64> {
        counts.split([';', ',']).find_map(|part| part.trim().strip_suffix(word)?.trim().parse().ok())
    };
    Some(Tally { passed: count("passed")?, failed: count("failed")? })
}

/// Runs `cmd` with inherited stdio and returns how it exited, for callers that pass the exit
/// code on instead of treating it as an error.
pub fn status(cmd: &mut Command) -> Result<ExitStatus> {
    echo(cmd);
    cmd.status().with_context(|| format!("could not start: {}", shell_line(cmd)))
}

/// Why a [`probe`] did not succeed.
pub enum ProbeFailure {
    /// The program is not on PATH.
    NotFound,
    /// It could not start, or exited unsuccessfully: a one-line reason for the log.
    Failed(String),
}

impl std::fmt::Display for ProbeFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ProbeFailure::NotFound => f.write_str("not found"),
            ProbeFailure::Failed(reason) => f.write_str(reason),
        }
    }
}

/// Runs a command whose failure is an answer rather than an error ("is this installed?").
/// Returns its stdout on success.
pub fn probe(cmd: &mut Command) -> std::result::Result<String, ProbeFailure> {
    echo(cmd);
    let output = match cmd.stdin(Stdio::null()).output() {
        Ok(output) => output,
        Err(err) if err.kind() == ErrorKind::NotFound => return Err(ProbeFailure::NotFound),
        Err(err) => return Err(ProbeFailure::Failed(format!("could not start: {err}"))),
    };
    if output.status.success() {
        return Ok(String::from_utf8_lossy(&output.stdout).into_owned());
    }
    let stderr = String::from_utf8_lossy(&output.stderr);
    let first_line = stderr.lines().find(|line| !line.trim().is_empty()).unwrap_or("");
    Err(ProbeFailure::Failed(format!("{}: {}", describe(output.status), first_line.trim())))
}

/// Like [`probe`], for probes whose failure is an error after all: the error names the command.
pub fn output(cmd: &mut Command) -> Result<String> {
    probe(cmd).map_err(|failure| anyhow::anyhow!("command failed ({failure}): {}", shell_line(cmd)))
}

/// Runs `cmd` and returns its stdout whatever its exit code, for tools that report partial
/// answers through a failing exit code. Its stderr is discarded.
pub fn stdout_regardless_of_status(cmd: &mut Command) -> Result<String> {
    echo(cmd);
    let output = cmd
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .with_context(|| format!("could not start: {}", shell_line(cmd)))?;
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

fn echo(cmd: &Command) {
    eprintln!("+ {}", shell_line(cmd));
}

/// `cmd` as a line that could be pasted into a shell to replay it by hand.
pub fn shell_line(cmd: &Command) -> String {
    let mut words = Vec::new();
    if let Some(dir) = cmd.get_current_dir() {
        words.push(format!("cd {} &&", quote(&dir.to_string_lossy())));
    }
    let mut env_words = Vec::new();
    let mut removed_vars = Vec::new();
    for (name, value) in cmd.get_envs() {
        let name = name.to_string_lossy();
        match value {
            Some(value) => env_words.push(format!("{name}={}", quote(&value.to_string_lossy()))),
            None => removed_vars.push(format!("-u {name}")),
        }
    }
    if !removed_vars.is_empty() {
        words.push(format!("env {}", removed_vars.join(" ")));
    }
    words.extend(env_words);
    words.push(quote(&cmd.get_program().to_string_lossy()).into_owned());
    words.extend(cmd.get_args().map(|arg| quote(&arg.to_string_lossy()).into_owned()));
    words.join(" ")
}

fn quote(word: &str) -> Cow<'_, str> {
    let is_plain = |c: char| c.is_ascii_alphanumeric() || "_-./=:,+@%".contains(c);
    if !word.is_empty() && word.chars().all(is_plain) {
        Cow::Borrowed(word)
    } else {
        Cow::Owned(format!("'{}'", word.replace('\'', r"'\''")))
    }
}

fn describe(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exit code {code}"),
        (None, Some(signal)) => format!("killed by signal {signal}"),
        (None, None) => status.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shell_line_quotes_only_words_a_shell_would_split_or_expand() {
        let mut cmd = Command::new("cargo");
        cmd.current_dir("/work dir")
            .env("RUSTFLAGS", "-C link-arg=-Wl,-rpath,/lib")
            .env_remove("LD_LIBRARY_PATH")
            .args(["+nightly", "it's", "--features", "llvm-22"]);
        assert_eq!(
            shell_line(&cmd),
            "cd '/work dir' && env -u LD_LIBRARY_PATH RUSTFLAGS='-C link-arg=-Wl,-rpath,/lib' \
             cargo +nightly 'it'\\''s' --features llvm-22"
        );
    }

    #[test]
    fn a_failing_command_is_named_in_the_error() {
        let err = run(Command::new("sh").args(["-c", "exit 3"])).unwrap_err();
        assert_eq!(err.to_string(), "command failed (exit code 3): sh -c 'exit 3'");
    }

    #[test]
    fn failure_lines_of_libtest_and_the_conformance_runner_are_recognized() {
        assert!(names_a_failure("test fixture_table ... FAILED"));
        assert!(names_a_failure(r#"a.json "case" "stage" 3:"pod to VIP" DNAT FAIL connection 2: no answer"#));
        assert!(!names_a_failure("test fixture_table ... ok"));
        assert!(!names_a_failure(r#"a.json "case" "stage" 3:"pod to VIP" DNAT PASS 12 connections"#));
        assert!(!names_a_failure("test result: FAILED. 1 passed; 7 failed"));
    }

    #[test]
    fn result_lines_of_libtest_and_plain_runners_are_counted() {
        let tally = |passed, failed| Some(Tally { passed, failed });
        assert_eq!(
            parse_result_line("test result: ok. 20 passed; 0 failed; 1 ignored; 0 measured; 0 filtered out"),
            tally(20, 0)
        );
        assert_eq!(parse_result_line("test result: FAILED. 3 passed; 2 failed; 0 ignored"), tally(3, 2));
        assert_eq!(parse_result_line("12 passed, 1 failed, 4 skipped"), tally(12, 1));
        assert_eq!(parse_result_line("running 5 tests"), None);
    }

    #[test]
    fn test_binaries_and_their_times_are_read_from_cargo_and_libtest() {
        assert_eq!(
            running_binary("     Running tests/flood.rs (target/debug/deps/flood-0123abcd)"),
            Some("tests/flood.rs")
        );
        assert_eq!(
            running_binary("     Running unittests src/lib.rs (target/debug/deps/vipr-0123abcd)"),
            Some("vipr-0123abcd")
        );
        assert_eq!(running_binary("   Compiling vipr v0.1.0"), None);
        let result =
            "test result: ok. 3 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 12.34s";
        assert_eq!(finished_in(result), Some(12.34));
        assert_eq!(finished_in("running 3 tests"), None);
    }

    #[test]
    fn a_missing_program_is_a_probe_answer_not_an_error() {
        // Through a variable: this is no program the project starts (see programs.rs).
        let missing_program = "/nonexistent/vipr-xtask-probe";
        let result = probe(&mut Command::new(missing_program));
        assert!(matches!(result, Err(ProbeFailure::NotFound)));
    }
}
