//! Tests that must run alone in the one integration-test binary.
//!
//! libtest runs the tests of every module side by side in one process. Most only need names of
//! their own ([`crate::unique_name`]); a few measure rates or latencies, or load the machine
//! for seconds (floods, connection rates through agent restarts and upgrades, probes under a
//! connection attack), and on a 2-core machine another lab beside them decides their outcome.
//! Such a test takes [`exclusive`] before anything else: it waits until no other test holds a
//! network namespace or a bpffs (every lab starts with one), and until it ends, other tests
//! wait at their first. Tests without a namespace or bpffs (parsers, the in-suite API server)
//! run on beside it: they load nothing.
//!
//! A test that already holds a namespace may create more while an exclusive test waits (the
//! waiting one does not block them, so a lab half built never waits for a test that waits for
//! it); the exclusive test starts once every namespace and bpffs of the others is gone, which
//! happens at the latest between two tests.

use std::{
    sync::{Condvar, Mutex, MutexGuard},
    thread::{self, ThreadId},
};

#[derive(Default)]
struct State {
    /// Namespaces and bpffs mounts alive, of every test.
    shared: usize,
    /// The test thread running alone.
    exclusive: Option<ThreadId>,
}

static STATE: Mutex<State> = Mutex::new(State { shared: 0, exclusive: None });
static CHANGED: Condvar = Condvar::new();

fn state() -> MutexGuard<'static, State> {
    STATE.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Held while a test runs alone; dropping it lets the others on.
#[must_use = "the test runs alone only while the guard lives"]
pub struct Exclusive(());

/// Waits until no other test holds a namespace or a bpffs, then keeps every other test from
/// creating one until the guard drops. Take it first in the test, before its lab, so that the
/// lab goes before the guard does.
pub fn exclusive() -> Exclusive {
    let me = thread::current().id();
    let mut state = state();
    while state.exclusive.is_some() || state.shared > 0 {
        state = CHANGED.wait(state).unwrap_or_else(|poisoned| poisoned.into_inner());
    }
    state.exclusive = Some(me);
    Exclusive(())
}

impl Drop for Exclusive {
    fn drop(&mut self) {
        state().exclusive = None;
        CHANGED.notify_all();
    }
}

/// A namespace's or a bpffs mount's share of the machine: while one lives, no test runs
/// [`exclusive`]ly but the one that created it.
#[derive(Debug)]
pub(crate) struct Shared(());

impl Shared {
    pub(crate) fn take() -> Self {
        let me = thread::current().id();
        let mut state = state();
        while state.exclusive.is_some_and(|owner| owner != me) {
            state = CHANGED.wait(state).unwrap_or_else(|poisoned| poisoned.into_inner());
        }
        state.shared += 1;
        Shared(())
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        state().shared -= 1;
        CHANGED.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use std::{
        sync::{
            atomic::{AtomicBool, Ordering},
            Arc,
        },
        time::Duration,
    };

    use super::*;

    #[test]
    fn an_exclusive_test_waits_for_the_others_and_holds_them_off() {
        let lab = Shared::take();
        let running_alone = Arc::new(AtomicBool::new(false));
        let alone = thread::spawn({
            let running_alone = running_alone.clone();
            move || {
                let _alone = exclusive();
                running_alone.store(true, Ordering::SeqCst);
                // Its own namespaces do not wait for itself.
                let _own = Shared::take();
                thread::sleep(Duration::from_millis(100));
                running_alone.store(false, Ordering::SeqCst);
            }
        });
        // A lab being built goes on while the exclusive test waits.
        let more = Shared::take();
        thread::sleep(Duration::from_millis(100));
        assert!(!running_alone.load(Ordering::SeqCst), "started beside a lab");
        drop((lab, more));
        crate::wait_for("the exclusive test to start", Duration::from_secs(5), || {
            Ok(if running_alone.load(Ordering::SeqCst) || alone.is_finished() {
                crate::Check::Done(())
            } else {
                crate::Check::NotYet("waiting".into())
            })
        })
        .unwrap();
        // A new lab waits until the exclusive test is done.
        let _next = Shared::take();
        assert!(!running_alone.load(Ordering::SeqCst), "a lab was created beside the exclusive test");
        alone.join().unwrap();
    }
}
