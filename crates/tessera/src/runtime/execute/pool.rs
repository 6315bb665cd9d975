//! The executor's loop on a rayon worker: why and how (see
//! [`on_pool_worker`]).

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::{Duration, Instant};

use crate::{autograd, logging};

/// The fewest steps for which the loop moves to a pool worker. The hand-off
/// it saves is per kernel; a plan of a few large kernels ran slower on a
/// worker (quiet 2-core run, 64 M-element fused chains: 19.8 → 25.0 ms and
/// 42.2 → 47.9 ms; cause not found), so it stays on the caller's thread.
pub(super) const POOL_WORKER_MIN_STEPS: usize = 32;

/// Runs `f` on a rayon worker, in the caller's grad mode. A strict or dfs
/// order runs hundreds of small parallel kernels one after another: called
/// from outside the pool, each would hand its work to the pool and sleep
/// until woken (a futex round trip per kernel: 94k context switches for
/// the hinted seed table row, 4.7k on a worker); on a worker it does its
/// share itself and goes straight on to the next kernel.
pub(super) fn on_pool_worker<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    if rayon::current_thread_index().is_some() {
        return f();
    }
    let grad = autograd::is_grad_enabled();
    let done = AtomicBool::new(false);
    let threads = rayon::current_num_threads();
    let poll = GOVERNOR.should_poll();
    let start = Usage::now();
    // Rayon's workers run with grad mode on (as the steps' jobs below).
    let result = rayon::scope(|s| {
        if poll {
            for _ in 1..threads {
                s.spawn(|s| poll_for_work(s, &done));
            }
        }
        // Set on the way out, a panic's too: the pollers end only then.
        let _done = SetOnDrop(&done);
        match grad {
            true => f(),
            false => autograd::no_grad(f),
        }
    });
    if poll {
        if let Some(share) = start.cpu_share_since(threads) {
            GOVERNOR.record_polled_run(share);
        }
    }
    result
}

/// Decides whether a loop's spare workers poll, from how much of the
/// cores the process got on the last polled loop. Polling pays on a quiet
/// machine only: where other processes want the cores too, a spinning
/// poller takes the time slice the worker running the loop (or holding a
/// kernel's other half) needs, and a compiled step ran 5x slower (10 →
/// 50 ms per `tessera train` step beside three busy loops; eager 15 → 18).
/// The system's load average cannot tell (a container's does not count
/// its neighbours), but the process's own CPU time can: polling threads
/// use their core all the time, so a polled loop that got much less than
/// `threads × wall` CPU time was crowded out.
///
/// After a crowded loop, the next [`Governor::calm_calls`] loops run
/// without pollers; then one polled loop probes again. Each crowded probe
/// doubles the wait (to [`MAX_WAIT`]); a quiet one resets it.
struct Governor {
    /// Loops left to run without polling.
    skip: AtomicU32,
    /// The wait after the next crowded probe.
    wait: AtomicU32,
}

/// The share of `threads × wall` below which a polled loop counts as
/// crowded out. Alone, a polled loop measures 0.95-1.0 (its pollers spin
/// on every free core); beside one busy process on two cores about 0.5.
const CROWDED_SHARE: f64 = 0.75;
const FIRST_WAIT: u32 = 8;
const MAX_WAIT: u32 = 512;

static GOVERNOR: Governor = Governor::new();

impl Governor {
    const fn new() -> Governor {
        Governor {
            skip: AtomicU32::new(0),
            wait: AtomicU32::new(FIRST_WAIT),
        }
    }

    fn should_poll(&self) -> bool {
        self.skip
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
            .is_err()
    }

    fn record_polled_run(&self, share: f64) {
        if share >= CROWDED_SHARE {
            self.wait.store(FIRST_WAIT, Ordering::Relaxed);
            return;
        }
        let wait = self.wait.load(Ordering::Relaxed);
        self.skip.store(wait, Ordering::Relaxed);
        self.wait.store((wait * 2).min(MAX_WAIT), Ordering::Relaxed);
        logging::log("schedule", || {
            format!(
                "the executor's polling workers got {:.0}% of the cores (other processes want \
                 them): the next {wait} runs without polling",
                share * 100.0
            )
        });
    }
}

/// A point in wall time and this process's CPU time.
struct Usage {
    wall: Instant,
    cpu: Option<Duration>,
}

/// Loops shorter than this say little about contention (a time slice is
/// ~1-4 ms).
const MIN_MEASURED_WALL: Duration = Duration::from_millis(2);

impl Usage {
    fn now() -> Usage {
        Usage {
            wall: Instant::now(),
            cpu: process_cpu_time(),
        }
    }

    /// The CPU time used since `self` over `threads × wall`: None where the
    /// process's CPU time is unknown or the interval too short.
    fn cpu_share_since(&self, threads: usize) -> Option<f64> {
        let wall = self.wall.elapsed();
        let cpu = process_cpu_time()?.checked_sub(self.cpu?)?;
        (wall >= MIN_MEASURED_WALL)
            .then(|| cpu.as_secs_f64() / (wall.as_secs_f64() * threads as f64))
    }
}

/// The CPU time of every thread of this process.
#[cfg(unix)]
pub(super) fn process_cpu_time() -> Option<Duration> {
    let mut time = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `time` is a valid, writable timespec for the call's duration.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut time) };
    (rc == 0).then(|| Duration::new(time.tv_sec as u64, time.tv_nsec as u32))
}

#[cfg(not(unix))]
pub(super) fn process_cpu_time() -> Option<Duration> {
    None
}

/// Sets its flag when dropped.
struct SetOnDrop<'a>(&'a AtomicBool);

impl Drop for SetOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

/// How long one [`poll_for_work`] job polls before handing over to a fresh
/// one.
const POLL_SLICE: Duration = Duration::from_micros(1000);

/// Polls to take the loop's kernel tasks until `done`. A strict order's
/// kernels are ~0.1 ms each, split over the workers; between two of them an
/// idle rayon worker goes to sleep and the next kernel's tasks wait for its
/// futex wake-up (the hinted seed row scaled 1.54x on two threads against
/// the unhinted row's 1.75x). A polling worker starts them at once.
///
/// A job polls for [`POLL_SLICE`] only and then queues its successor: a
/// worker waiting on a stolen task may pick up a poller, which must not
/// keep it from that task for long (polling until `done` there could
/// deadlock). Long idle, it yields its core to the rest of the machine.
fn poll_for_work<'s>(scope: &rayon::Scope<'s>, done: &'s AtomicBool) {
    let start = Instant::now();
    let mut idle = 0u32;
    while !done.load(Ordering::Acquire) {
        match rayon::yield_now() {
            Some(rayon::Yield::Executed) => idle = 0,
            Some(rayon::Yield::Idle) if idle < 1 << 12 => {
                idle += 1;
                std::hint::spin_loop();
            }
            Some(rayon::Yield::Idle) => std::thread::yield_now(),
            None => return,
        }
        if start.elapsed() > POLL_SLICE {
            scope.spawn(move |s| poll_for_work(s, done));
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use rayon::prelude::*;

    use super::*;

    #[test]
    fn a_crowded_polled_run_stops_polling_for_a_doubling_wait() {
        let governor = Governor::new();
        assert!(governor.should_poll());
        governor.record_polled_run(0.97);
        assert!(governor.should_poll(), "a quiet run keeps polling");
        for wait in [FIRST_WAIT, 2 * FIRST_WAIT] {
            governor.record_polled_run(0.3);
            let skipped = std::iter::repeat_with(|| governor.should_poll())
                .take_while(|poll| !poll)
                .count();
            assert_eq!(skipped as u32, wait, "then one polled probe");
        }
        governor.record_polled_run(0.9);
        governor.record_polled_run(0.3);
        let skipped = std::iter::repeat_with(|| governor.should_poll())
            .take_while(|poll| !poll)
            .count();
        assert_eq!(skipped as u32, FIRST_WAIT, "a quiet probe resets the wait");
    }

    #[test]
    fn the_wait_is_bounded() {
        let governor = Governor::new();
        for _ in 0..20 {
            governor.record_polled_run(0.1);
        }
        assert_eq!(governor.skip.load(Ordering::Relaxed), MAX_WAIT);
    }

    #[cfg(unix)]
    #[test]
    fn a_busy_interval_measures_this_processs_cpu_share() {
        let start = Usage::now();
        let mut x = 0u64;
        while start.wall.elapsed() < 4 * MIN_MEASURED_WALL {
            x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
        }
        let share = start
            .cpu_share_since(1)
            .expect("unix has the process's CPU time");
        // One spinning thread of (at least) one: some CPU time, never more
        // than the test process's threads could use.
        assert!(share > 0.0 && share.is_finite(), "{share}");
    }

    #[test]
    fn the_loop_runs_on_a_pool_worker_in_the_callers_grad_mode() {
        let probe = || {
            on_pool_worker(|| {
                (
                    rayon::current_thread_index().is_some(),
                    autograd::is_grad_enabled(),
                )
            })
        };
        assert_eq!(probe(), (true, true));
        assert_eq!(autograd::no_grad(probe), (true, false));
        // Called on a worker already, it runs right there.
        let (caller, inner) = rayon::scope(|_| {
            let caller = std::thread::current().id();
            (caller, on_pool_worker(|| std::thread::current().id()))
        });
        assert_eq!(caller, inner);
    }

    #[test]
    fn the_pool_workers_loop_returns_its_value_and_passes_a_panic_on() {
        // The pollers run until the loop ends, a panicking one too (else
        // this would hang), and every task the loop spreads is done.
        let sums: Vec<u64> = (0..200u64)
            .map(|i| on_pool_worker(|| (0..1000u64).into_par_iter().map(|x| x * i).sum()))
            .collect();
        assert!(sums.iter().zip(0u64..).all(|(&s, i)| s == 499_500 * i));
        let caught = std::panic::catch_unwind(|| on_pool_worker(|| panic!("inside the loop")));
        assert!(caught.is_err());
    }
}
