//! Running a sequence of named steps with a header for each and a summary at the end, so a CI
//! log shows at a glance which part failed.
use std::time::{Duration, Instant};

use anyhow::{bail, Result};

use crate::Workspace;

pub struct Step {
    pub name: &'static str,
    pub run: fn(&Workspace) -> Result<()>,
    pub on_failure: OnFailure,
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum OnFailure {
    /// Later steps cannot work without this one (e.g. setup): skip them.
    Stop,
    /// Later steps are independent: run them too, to report every failure in one run.
    Continue,
}

enum Outcome {
    Passed,
    Failed,
    Skipped,
}

/// Runs `steps` in order; fails if any step failed.
pub fn run_all(workspace: &Workspace, steps: &[Step]) -> Result<()> {
    let mut outcomes: Vec<(Outcome, Duration)> = Vec::with_capacity(steps.len());
    let mut stopped_by: Option<&str> = None;
    for (index, step) in steps.iter().enumerate() {
        if stopped_by.is_some() {
            outcomes.push((Outcome::Skipped, Duration::ZERO));
            continue;
        }
        eprintln!();
        eprintln!("==== [{}/{}] {} ====", index + 1, steps.len(), step.name);
        let started = Instant::now();
        let result = (step.run)(workspace);
        let elapsed = started.elapsed();
        match result {
            Ok(()) => outcomes.push((Outcome::Passed, elapsed)),
            Err(err) => {
                eprintln!("==== {} FAILED: {err:#}", step.name);
                outcomes.push((Outcome::Failed, elapsed));
                if step.on_failure == OnFailure::Stop {
                    stopped_by = Some(step.name);
                }
            }
        }
    }

    eprintln!();
    eprintln!("==== summary ====");
    for (step, (outcome, elapsed)) in steps.iter().zip(&outcomes) {
        let label = match outcome {
            Outcome::Passed => "PASS",
            Outcome::Failed => "FAIL",
            Outcome::Skipped => "SKIP",
        };
        eprintln!("{label}  {:>7.1}s  {}", elapsed.as_secs_f64(), step.name);
    }
    if let Some(step) = stopped_by {
        eprintln!("(steps after \"{step}\" were skipped because they depend on it)");
    }

    print_slowest_test_binaries();

    let failed: Vec<&str> = steps
        .iter()
        .zip(&outcomes)
        .filter(|(_, (outcome, _))| matches!(outcome, Outcome::Failed))
        .map(|(step, _)| step.name)
        .collect();
    let failure_lines = crate::cmd::failure_lines();
    if !failure_lines.is_empty() {
        eprintln!("==== what failed (from the output above) ====");
        const SHOWN: usize = 50;
        for line in failure_lines.iter().take(SHOWN) {
            eprintln!("{line}");
        }
        if failure_lines.len() > SHOWN {
            eprintln!("... and {} more", failure_lines.len() - SHOWN);
        }
    }
    let tests = crate::cmd::tally();
    if tests != crate::cmd::Tally::default() {
        // CI reads the last line of the log for the number of tests that ran.
        eprintln!("tests: {} passed, {} failed", tests.passed, tests.failed);
    }
    if !failed.is_empty() {
        bail!("{} of {} steps failed: {}", failed.len(), steps.len(), failed.join(", "));
    }
    Ok(())
}

/// The test binaries that took longest, so a slow suite shows where its time goes.
fn print_slowest_test_binaries() {
    let mut times = crate::cmd::test_binary_times();
    if times.is_empty() {
        return;
    }
    times.sort_by(|a, b| b.1.total_cmp(&a.1));
    const SHOWN: usize = 15;
    eprintln!("==== test binaries, slowest first ({} ran) ====", times.len());
    for (binary, seconds) in times.iter().take(SHOWN) {
        eprintln!("{seconds:>7.1}s  {binary}");
    }
}
