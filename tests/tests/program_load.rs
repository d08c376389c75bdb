//! Loading vipr's programs while signals keep arriving at the loading thread. The verifier
//! gives up with `EAGAIN` whenever a signal is pending on the thread that loads, and a long
//! verification on a busy machine met one in each of libbpf's five attempts (CI, a fixture
//! test among many). The loader blocks signals on its thread while the kernel verifies. Needs
//! root.

use std::{
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    thread,
    time::Duration,
};

use testbed::fixtures::harness::Harness;

extern "C" fn ignore(_: libc::c_int) {}

#[test]
fn programs_load_while_signals_keep_arriving() {
    // SAFETY: a handler that does nothing, for a signal no other test uses: the signal
    // interrupts a system call without ending the process.
    unsafe { libc::signal(libc::SIGUSR2, ignore as extern "C" fn(libc::c_int) as libc::sighandler_t) };
    // SAFETY: this thread's own id.
    let loader = unsafe { libc::pthread_self() };
    let stop = Arc::new(AtomicBool::new(false));
    let signaller = thread::spawn({
        let stop = stop.clone();
        move || {
            let mut sent = 0u64;
            while !stop.load(Ordering::Relaxed) {
                // SAFETY: `loader` runs until this thread is joined.
                unsafe { libc::pthread_kill(loader, libc::SIGUSR2) };
                sent += 1;
                thread::sleep(Duration::from_micros(200));
            }
            sent
        }
    });
    let loaded = Harness::new();
    stop.store(true, Ordering::Relaxed);
    let sent = signaller.join().unwrap();
    if let Err(error) = loaded {
        panic!("vipr's programs did not load with {sent} signals sent meanwhile: {error:#}");
    }
    assert!(sent > 100, "only {sent} signals were sent during the load");
}
