//! `TESSERA_LOGS=profile`: where a compiled call's time goes, kernel by
//! kernel. Each schedule step is timed on the wall clock and its time
//! shared among its kernels (a step of one kernel is that kernel's time);
//! after the call, the totals by kernel kind and the slowest kernels are
//! logged. On a device that queues kernels (CUDA) each step is waited for
//! before its time is read, so the times are the device's (with the
//! overlap between steps, and any concurrency, given up); with
//! `TESSERA_LOGS=profile,host` they are not waited for, and the times are
//! the host's, queueing them.
//!
//! Beside each wall time the process's CPU time over the step (all its
//! threads): on a shared, loaded machine the wall time says more about the
//! other processes than about the kernel, the CPU time less so (a kernel
//! that waits, or leaves a core idle, shows a wall time well above its CPU
//! time over the threads). Spinning pool workers (`execute::pool`) count
//! in it too.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::fusion::Kernel;
use crate::ir::{Graph, NodeId, Op};
use crate::logging;

/// How many of the slowest kernels the summary lists.
const SLOWEST: usize = 25;

/// The times of one call's kernels, when profiling is on.
pub(super) struct Profile {
    /// (kernel index, wall time, CPU time) per kernel run.
    times: Vec<(usize, Duration, Duration)>,
}

/// A step's start: the wall clock and the process's CPU time.
pub(super) struct Clock {
    wall: Instant,
    cpu: Option<Duration>,
}

impl Clock {
    pub(super) fn now() -> Clock {
        Clock {
            wall: Instant::now(),
            cpu: super::pool::process_cpu_time(),
        }
    }

    /// (wall, CPU) time since `self` (CPU zero where unknown).
    fn elapsed(&self) -> (Duration, Duration) {
        let cpu = super::pool::process_cpu_time()
            .zip(self.cpu)
            .and_then(|(now, then)| now.checked_sub(then));
        (self.wall.elapsed(), cpu.unwrap_or_default())
    }
}

impl Profile {
    /// A profile if `TESSERA_LOGS` has `profile`.
    pub(super) fn start() -> Option<Profile> {
        logging::enabled("profile").then(|| Profile { times: Vec::new() })
    }

    /// Whether the times are the host's queueing times (`TESSERA_LOGS`
    /// has `host` too): on a device the steps are then not waited for, so
    /// each time is what the host spent queueing the step's kernels.
    pub(super) fn host_times(&self) -> bool {
        logging::enabled("host")
    }

    /// Records a step of `kernels` that started at `started`.
    pub(super) fn step(&mut self, kernels: &[usize], started: &Clock) {
        let (wall, cpu) = started.elapsed();
        let n = kernels.len().max(1) as u32;
        self.times
            .extend(kernels.iter().map(|&k| (k, wall / n, cpu / n)));
    }

    /// Logs the totals by kind and the slowest kernels of `kernels`.
    pub(super) fn report(self, graph: &Graph, kernels: &[Kernel]) {
        logging::log("profile", || self.summary(graph, kernels));
    }

    fn summary(&self, graph: &Graph, kernels: &[Kernel]) -> String {
        let total: Duration = self.times.iter().map(|t| t.1).sum();
        let total_cpu: Duration = self.times.iter().map(|t| t.2).sum();
        let mut by_kind: HashMap<String, (Duration, Duration, usize)> = HashMap::new();
        for &(k, t, cpu) in &self.times {
            let entry = by_kind.entry(kind(graph, &kernels[k])).or_default();
            entry.0 += t;
            entry.1 += cpu;
            entry.2 += 1;
        }
        let mut kinds: Vec<_> = by_kind.into_iter().collect();
        kinds.sort_by_key(|k| std::cmp::Reverse(k.1 .0));
        let mut text = format!(
            "graph `{}`: {} kernels in {:.3} ms (CPU time {:.3} ms)\n  by kind (wall, share, CPU):\n",
            graph.name,
            self.times.len(),
            ms(total),
            ms(total_cpu)
        );
        for (name, (t, cpu, n)) in kinds {
            text.push_str(&format!(
                "    {:>9.3} ms {:>5.1}%  cpu {:>9.3} ms  {n:>4}×  {name}\n",
                ms(t),
                percent(t, total),
                ms(cpu)
            ));
        }
        let mut slowest = self.times.clone();
        slowest.sort_by_key(|k| std::cmp::Reverse(k.1));
        text.push_str("  slowest kernels (wall, CPU):\n");
        for (k, t, cpu) in slowest.into_iter().take(SLOWEST) {
            text.push_str(&format!(
                "    {:>9.3} ms  cpu {:>9.3} ms  k{k} {}\n",
                ms(t),
                ms(cpu),
                label(graph, &kernels[k])
            ));
        }
        text
    }
}

fn ms(t: Duration) -> f64 {
    t.as_secs_f64() * 1e3
}

fn percent(part: Duration, whole: Duration) -> f64 {
    100.0 * part.as_secs_f64() / whole.as_secs_f64().max(f64::MIN_POSITIVE)
}

/// A node's op; a custom op's own name (`tessera::conv2d`).
fn op_name(graph: &Graph, id: NodeId) -> &str {
    match &graph.node(id).op {
        Op::Custom(call) => call.name(),
        op => op.name(),
    }
}

/// The kernel's kind: its fusion kind, or an extern's op.
fn kind(graph: &Graph, kernel: &Kernel) -> String {
    match kernel {
        Kernel::Fused { .. } => "fused".into(),
        Kernel::Rows { .. } => "rows".into(),
        Kernel::Epilogue { .. } => "matmul+epilogue".into(),
        Kernel::MatmulRows { .. } => "matmul+rows".into(),
        Kernel::Extern(id) => format!("extern {}", op_name(graph, *id)),
        Kernel::Custom { node, .. } => format!("custom {}", op_name(graph, *node)),
    }
}

/// The kernel's kind, its first few ops and the type of what it writes
/// first.
fn label(graph: &Graph, kernel: &Kernel) -> String {
    let members: Vec<_> = match kernel {
        Kernel::Fused { members, .. }
        | Kernel::Rows { members, .. }
        | Kernel::Epilogue { members, .. }
        | Kernel::MatmulRows { members, .. } => members.clone(),
        Kernel::Extern(id) | Kernel::Custom { node: id, .. } => vec![*id],
    };
    let ops: Vec<&str> = members.iter().map(|&m| op_name(graph, m)).collect();
    let shown = ops.len().min(6);
    let more = match ops.len() - shown {
        0 => String::new(),
        n => format!(" +{n}"),
    };
    let written = kernel
        .writes()
        .first()
        .map(|&w| graph.node(w).ty.to_string())
        .unwrap_or_default();
    format!(
        "{} [{}{more}] -> {written}",
        kind(graph, kernel),
        ops[..shown].join(" ")
    )
}
