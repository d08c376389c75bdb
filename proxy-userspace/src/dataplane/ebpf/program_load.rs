//! Loading one of vipr's programs into the kernel, with the loading thread's signals blocked,
//! and again when the verifier gave up with `EAGAIN`.
//!
//! The verifier stops with `EAGAIN` when a signal is pending on the loading thread (it checks
//! between instructions, so that a long verification can be interrupted). The agent's threads
//! and the processes it starts come and go, so a signal can arrive while a program of
//! thousands of instructions is verified. Asking again, as libbpf does (five attempts), was
//! not enough on a busy machine: five verifications of the TC program in a row were
//! interrupted (CI, a fixture test beside many others). So the loading thread blocks every
//! signal while the kernel verifies: a signal for the process goes to another of its threads,
//! one for this thread waits the second or so until the load returns. The retries stay for a
//! load on a thread the caller shares with a signal that cannot wait.
use aya::programs::ProgramError;

/// Attempts before the refusal is returned as it is.
const ATTEMPTS: usize = 5;

/// Runs `load` (a program's `load()`) until it succeeds, fails for another reason than
/// `EAGAIN`, or failed [`ATTEMPTS`] times.
pub fn load_retrying(mut load: impl FnMut() -> Result<(), ProgramError>) -> Result<(), ProgramError> {
    let mut attempt = 1;
    loop {
        let blocked = SignalsBlocked::new();
        let outcome = load();
        drop(blocked);
        match outcome {
            Err(ProgramError::LoadError { io_error, .. })
                if io_error.raw_os_error() == Some(libc::EAGAIN) && attempt < ATTEMPTS =>
            {
                attempt += 1;
            }
            outcome => return outcome,
        }
    }
}

/// Every signal blocked on the current thread while it lives; the thread's mask before is
/// restored on drop. (SIGKILL and SIGSTOP cannot be blocked, and need not be.)
struct SignalsBlocked {
    before: Option<libc::sigset_t>,
}

impl SignalsBlocked {
    fn new() -> Self {
        // SAFETY: plain libc calls on sigset_t values this function owns.
        unsafe {
            let mut all = std::mem::zeroed::<libc::sigset_t>();
            let mut before = std::mem::zeroed::<libc::sigset_t>();
            libc::sigfillset(&mut all);
            // On failure (never, for valid arguments) the load runs unblocked, as before.
            let blocked = libc::pthread_sigmask(libc::SIG_BLOCK, &all, &mut before) == 0;
            Self { before: blocked.then_some(before) }
        }
    }
}

impl Drop for SignalsBlocked {
    fn drop(&mut self) {
        if let Some(before) = &self.before {
            // SAFETY: restores the mask read in `new`; a signal that arrived meanwhile is
            // delivered now.
            unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, before, std::ptr::null_mut()) };
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

    /// Whether the current thread blocks `signal`.
    fn blocks(signal: libc::c_int) -> bool {
        // SAFETY: reads the current thread's mask into a local set.
        unsafe {
            let mut mask = std::mem::zeroed::<libc::sigset_t>();
            libc::pthread_sigmask(libc::SIG_BLOCK, std::ptr::null(), &mut mask);
            libc::sigismember(&mask, signal) == 1
        }
    }

    #[test]
    fn signals_are_blocked_while_the_kernel_verifies_and_unblocked_after() {
        assert!(!blocks(libc::SIGTERM), "the test thread blocks SIGTERM already");
        let mut during = false;
        load_retrying(|| {
            during = blocks(libc::SIGTERM) && blocks(libc::SIGCHLD) && blocks(libc::SIGUSR2);
            Ok(())
        })
        .unwrap();
        assert!(during, "signals were not blocked during the load");
        assert!(!blocks(libc::SIGTERM), "the mask was not restored");
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
