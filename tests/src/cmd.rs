//! Running the system tools the testbed drives (`ip`, `bpftool`).

use std::process::Command;

use anyhow::{bail, Context, Result};

/// Runs `command` to completion and returns its stdout; a non-zero exit is an error that
/// carries the command line and its stderr.
pub(crate) fn run(command: &mut Command) -> Result<String> {
    let output = command.output().with_context(|| format!("cannot run {command:?}"))?;
    if !output.status.success() {
        bail!("{command:?} failed ({}): {}", output.status, String::from_utf8_lossy(&output.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}
