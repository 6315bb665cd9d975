//! The executor's loop on a rayon worker: why and how (see
//! [`on_pool_worker`]).

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::autograd;

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
    // Rayon's workers run with grad mode on (as the steps' jobs below).
    rayon::scope(|s| {
        for _ in 1..rayon::current_num_threads() {
            s.spawn(|s| poll_for_work(s, &done));
        }
        // Set on the way out, a panic's too: the pollers end only then.
        let _done = SetOnDrop(&done);
        match grad {
            true => f(),
            false => autograd::no_grad(f),
        }
    })
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
