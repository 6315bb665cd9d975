//! `TESSERA_LOGS=profile`: where a compiled call's time goes, kernel by
//! kernel. Each schedule step is timed on the wall clock and its time
//! shared among its kernels (a step of one kernel is that kernel's time);
//! after the call, the totals by kernel kind and the slowest kernels are
//! logged. On a device that queues kernels (CUDA) each step is waited for
//! before its time is read, so the times are the device's (with the
//! overlap between steps, and any concurrency, given up); with
//! `TESSERA_LOGS=profile,host` they are not waited for, and the times are
//! the host's, queueing them.

use std::collections::HashMap;
use std::time::Duration;

use crate::fusion::Kernel;
use crate::ir::Graph;
use crate::logging;

/// How many of the slowest kernels the summary lists.
const SLOWEST: usize = 25;

/// The times of one call's kernels, when profiling is on.
pub(super) struct Profile {
    /// (kernel index, time) per kernel run.
    times: Vec<(usize, Duration)>,
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

    /// Records a step of `kernels` that took `elapsed`.
    pub(super) fn step(&mut self, kernels: &[usize], elapsed: Duration) {
        let share = elapsed / kernels.len().max(1) as u32;
        self.times.extend(kernels.iter().map(|&k| (k, share)));
    }

    /// Logs the totals by kind and the slowest kernels of `kernels`.
    pub(super) fn report(self, graph: &Graph, kernels: &[Kernel]) {
        logging::log("profile", || self.summary(graph, kernels));
    }

    fn summary(&self, graph: &Graph, kernels: &[Kernel]) -> String {
        let total: Duration = self.times.iter().map(|(_, t)| *t).sum();
        let mut by_kind: HashMap<String, (Duration, usize)> = HashMap::new();
        for &(k, t) in &self.times {
            let entry = by_kind.entry(kind(graph, &kernels[k])).or_default();
            entry.0 += t;
            entry.1 += 1;
        }
        let mut kinds: Vec<_> = by_kind.into_iter().collect();
        kinds.sort_by_key(|k| std::cmp::Reverse(k.1 .0));
        let mut text = format!(
            "graph `{}`: {} kernels in {:.3} ms\n  by kind:\n",
            graph.name,
            self.times.len(),
            ms(total)
        );
        for (name, (t, n)) in kinds {
            text.push_str(&format!(
                "    {:>9.3} ms {:>5.1}%  {n:>4}×  {name}\n",
                ms(t),
                percent(t, total)
            ));
        }
        let mut slowest = self.times.clone();
        slowest.sort_by_key(|k| std::cmp::Reverse(k.1));
        text.push_str("  slowest kernels:\n");
        for (k, t) in slowest.into_iter().take(SLOWEST) {
            text.push_str(&format!(
                "    {:>9.3} ms  k{k} {}\n",
                ms(t),
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

/// The kernel's kind: its fusion kind, or an extern's op.
fn kind(graph: &Graph, kernel: &Kernel) -> String {
    match kernel {
        Kernel::Fused { .. } => "fused".into(),
        Kernel::Rows { .. } => "rows".into(),
        Kernel::Epilogue { .. } => "matmul+epilogue".into(),
        Kernel::MatmulRows { .. } => "matmul+rows".into(),
        Kernel::Extern(id) => format!("extern {}", graph.node(*id).op.name()),
        Kernel::Custom { node, .. } => format!("custom {}", graph.node(*node).op.name()),
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
    let ops: Vec<&str> = members.iter().map(|&m| graph.node(m).op.name()).collect();
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
