//! Loading one of vipr's programs into the kernel, again when the verifier gave up with
//! `EAGAIN`.
//!
//! The verifier stops with `EAGAIN` when a signal is pending on the loading thread (it checks
//! between instructions, so that a long verification can be interrupted). The agent's threads
//! and the processes it starts come and go, so a signal can arrive while a program of
//! thousands of instructions is verified; the load is then simply asked again, as libbpf does
//! (five attempts), instead of failing the agent's start or an attach to a new device.
use aya::programs::ProgramError;

/// Attempts before the refusal is returned as it is.
const ATTEMPTS: usize = 5;

/// Runs `load` (a program's `load()`) until it succeeds, fails for another reason than
/// `EAGAIN`, or failed [`ATTEMPTS`] times.
pub fn load_retrying(mut load: impl FnMut() -> Result<(), ProgramError>) -> Result<(), ProgramError> {
    let mut attempt = 1;
    loop {
        match load() {
            Err(ProgramError::LoadError { io_error, .. })
                if io_error.raw_os_error() == Some(libc::EAGAIN) && attempt < ATTEMPTS =>
            {
                attempt += 1;
            }
            outcome => return outcome,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io;

    use super::*;

    fn refused(errno: i32) -> ProgramError {
        ProgramError::LoadError {
            io_error: io::Error::from_raw_os_error(errno),
            verifier_log: aya_obj::VerifierLog::new(String::new()),
        }
    }

    #[test]
    fn a_load_interrupted_by_a_signal_is_asked_again() {
        let mut calls = 0;
        let outcome = load_retrying(|| {
            calls += 1;
            if calls < 3 {
                Err(refused(libc::EAGAIN))
            } else {
                Ok(())
            }
        });
        assert!(outcome.is_ok(), "{outcome:?}");
        assert_eq!(calls, 3);
    }

    #[test]
    fn other_refusals_and_a_lasting_eagain_are_returned() {
        let mut calls = 0;
        let outcome = load_retrying(|| {
            calls += 1;
            Err(refused(libc::EACCES))
        });
        assert!(matches!(outcome, Err(ProgramError::LoadError { .. })));
        assert_eq!(calls, 1, "a verifier's refusal is final");

        calls = 0;
        let outcome = load_retrying(|| {
            calls += 1;
            Err(refused(libc::EAGAIN))
        });
        assert!(outcome.is_err());
        assert_eq!(calls, ATTEMPTS);
    }
}
