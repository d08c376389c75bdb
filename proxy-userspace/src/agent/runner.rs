//! When to sync: kube-proxy's BoundedFrequencyRunner as a clock-driven state machine.
//!
//! - A change asks for a sync ([`SyncRunner::request`]); it runs as soon as the last sync
//!   started at least `min_interval` ago, so a burst of changes costs one sync per interval.
//! - Without changes, a sync still runs `max_interval` after the last one, to repair the
//!   dataplane if something else changed it.
//! - A sync that fails is retried after a backoff that doubles from [`RETRY_INITIAL`] up to
//!   `max_interval`, and never sooner than `min_interval`.
//! - Nothing runs before the first request: there is no desired state to apply yet.
//!
//! It holds no clock and no work: the agent asks [`SyncRunner::time_until_due`] when to wake and
//! reports each run with [`SyncRunner::ran`], which keeps it unit-testable.
use std::time::{Duration, Instant};

/// The first retry delay after a failed sync.
pub const RETRY_INITIAL: Duration = Duration::from_secs(1);

#[derive(Debug)]
pub struct SyncRunner {
    min_interval: Duration,
    max_interval: Duration,
    /// When the last run started.
    last_run: Option<Instant>,
    /// A change arrived since the last run started.
    requested: bool,
    /// The failed run's retry delay; `None` after a success.
    backoff: Option<Duration>,
}

/// How a run ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Succeeded,
    Failed,
}

impl SyncRunner {
    pub fn new(min_interval: Duration, max_interval: Duration) -> Self {
        Self { min_interval, max_interval, last_run: None, requested: false, backoff: None }
    }

    /// Something changed: run as soon as the minimum interval allows.
    pub fn request(&mut self) {
        self.requested = true;
    }

    /// How long from `now` until the next run is due (zero: due now); `None` while nothing
    /// was ever requested.
    pub fn time_until_due(&self, now: Instant) -> Option<Duration> {
        let Some(last_run) = self.last_run else {
            return self.requested.then_some(Duration::ZERO);
        };
        let after_last = |delay: Duration| last_run + delay.max(self.min_interval);
        let periodic = after_last(self.max_interval);
        let requested = self.requested.then(|| after_last(Duration::ZERO));
        let retry = self.backoff.map(after_last);
        let due = [Some(periodic), requested, retry].into_iter().flatten().min()?;
        Some(due.saturating_duration_since(now))
    }

    pub fn is_due(&self, now: Instant) -> bool {
        self.time_until_due(now) == Some(Duration::ZERO)
    }

    /// Records a run that started at `started`.
    pub fn ran(&mut self, started: Instant, outcome: Outcome) {
        self.last_run = Some(started);
        self.requested = false;
        self.backoff = match outcome {
            Outcome::Succeeded => None,
            Outcome::Failed => Some(match self.backoff {
                None => RETRY_INITIAL.min(self.max_interval),
                Some(previous) => (previous * 2).min(self.max_interval),
            }),
        };
    }

    /// The delay before the next retry, while runs are failing.
    pub fn retry_delay(&self) -> Option<Duration> {
        self.backoff.map(|delay| delay.max(self.min_interval))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: Duration = Duration::from_secs(1);
    const MAX: Duration = Duration::from_secs(30);

    fn secs(n: u64) -> Duration {
        Duration::from_secs(n)
    }

    #[test]
    fn nothing_runs_before_the_first_request_then_it_runs_at_once() {
        let t0 = Instant::now();
        let mut runner = SyncRunner::new(MIN, MAX);
        assert_eq!(runner.time_until_due(t0), None);
        assert!(!runner.is_due(t0 + secs(3600)));
        runner.request();
        assert!(runner.is_due(t0));
    }

    #[test]
    fn changes_run_at_most_once_per_min_interval() {
        let t0 = Instant::now();
        let mut runner = SyncRunner::new(MIN, MAX);
        runner.request();
        runner.ran(t0, Outcome::Succeeded);
        runner.request();
        assert_eq!(runner.time_until_due(t0), Some(MIN));
        assert!(!runner.is_due(t0 + Duration::from_millis(999)));
        assert!(runner.is_due(t0 + MIN));
        // A change long after the last run goes at once.
        let later = t0 + secs(10);
        runner.ran(t0 + MIN, Outcome::Succeeded);
        runner.request();
        assert!(runner.is_due(later));
    }

    #[test]
    fn without_changes_it_runs_every_max_interval() {
        let t0 = Instant::now();
        let mut runner = SyncRunner::new(MIN, MAX);
        runner.request();
        runner.ran(t0, Outcome::Succeeded);
        assert_eq!(runner.time_until_due(t0), Some(MAX));
        runner.ran(t0 + MAX, Outcome::Succeeded);
        assert_eq!(runner.time_until_due(t0 + MAX), Some(MAX));
    }

    #[test]
    fn failures_retry_with_doubling_backoff_capped_at_max_interval() {
        let t0 = Instant::now();
        let mut runner = SyncRunner::new(MIN, secs(5));
        runner.request();
        let mut at = t0;
        let mut delays = Vec::new();
        for _ in 0..5 {
            runner.ran(at, Outcome::Failed);
            let delay = runner.time_until_due(at).unwrap();
            delays.push(delay);
            at += delay;
        }
        assert_eq!(delays, [secs(1), secs(2), secs(4), secs(5), secs(5)]);
        runner.ran(at, Outcome::Succeeded);
        assert_eq!(runner.time_until_due(at), Some(secs(5)), "back to the periodic sync");
        runner.ran(at, Outcome::Failed);
        assert_eq!(runner.retry_delay(), Some(secs(1)), "a success resets the backoff");
    }

    #[test]
    fn retries_respect_the_min_interval() {
        let t0 = Instant::now();
        let mut runner = SyncRunner::new(secs(3), MAX);
        runner.request();
        runner.ran(t0, Outcome::Failed);
        assert_eq!(runner.time_until_due(t0), Some(secs(3)));
    }

    #[test]
    fn a_zero_min_interval_runs_every_change_at_once() {
        let t0 = Instant::now();
        let mut runner = SyncRunner::new(Duration::ZERO, MAX);
        runner.request();
        runner.ran(t0, Outcome::Succeeded);
        runner.request();
        assert_eq!(runner.time_until_due(t0), Some(Duration::ZERO));
    }
}
