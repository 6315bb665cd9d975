//! The memory planner: liveness of every buffer over a schedule's steps,
//! in-place reuse, an offset per buffer in one arena, and the predicted peak.
//!
//! Time is counted in steps. A buffer is live from the step of the kernel
//! that creates it to the last step that reads it (or the end, for graph
//! outputs): the executor frees values after each step, so within a step
//! every buffer created by its kernels is live at once, together with every
//! buffer still to be read. The predicted peak is the most bytes live in any
//! step, which is exactly what the runtime's allocator counts when kernels
//! allocate their outputs one buffer each (`runtime::cpu::memory_stats`).
//!
//! In place: a fused (elementwise) kernel writes an output into the buffer
//! of an input when the input is dense, of the kernel's shape and dtype,
//! read once by the kernel, and read for the last time in this step by this
//! kernel alone (no concurrent kernel of the step reads it; no view of it
//! is read later; it is not a graph output). The kernel loads each block of
//! its inputs before storing that block of its outputs, so the overwrite
//! never reaches an element still to be read. The output then takes the
//! input's place in the arena.
//!
//! Offsets: buffers (in-place chains merged) are placed largest first, each
//! at the lowest offset that overlaps no placed buffer live at the same
//! time, with sizes rounded up to 64 bytes (the allocator's alignment).
//! [`MemoryPlan::check`] verifies that no two buffers live at the same time
//! overlap; it runs after every plan in debug builds.
//!
//! Values that escape the executable (graph outputs, which include the
//! tensors a forward saves for its backward, and the buffers they view) get
//! no place in the arena: the compiled executor allocates them from the
//! pool, so that they do not keep the arena alive after the run; nor does
//! a kernel write one of them in place of an input. The executor allocates
//! the arena once per run, so what it measures is the arena plus the
//! escaping bytes: [`MemoryPlan::run_peak_bytes`].
//!
//! A buffer planned within a cat's output (`buffers.rs`) holds no bytes of
//! its own: the output is live from the step its first piece is made, and
//! each piece sits at its range of the output's place.
//!
//! Donated inputs (buffer donation, as JAX's `donate_argnums`): a graph
//! input the caller hands over is a buffer live from step 0 to its last
//! read, and an in-place candidate like any other; a graph output may be
//! written over it too (not over an intermediate: escaping values come
//! from the pool), and then lives on in the caller's storage. Like every
//! input, its bytes are the caller's, not the run's: it has no place in
//! the arena, and neither has a value written over it, nor do they count
//! in the peak. So a value written in place of a donated input costs the
//! run nothing — a training step whose new parameters and optimizer state
//! are written over the old ones needs neither their second copy nor the
//! time to allocate it. The executor hands an input over only when the
//! caller's tensor was its only handle and dense; otherwise the output
//! gets its own buffer from the pool, and the memory log says so.

//! Offload and prefetch (`{"offload": true}`, see [`Moves`]): a graph
//! output the caller will hand back to a later graph (a saved activation)
//! may be *offloaded*: moved to host memory after the last step that reads
//! it, its device bytes freed from the next step on. A graph input that
//! arrives in host memory is *prefetched*: copied to the device before the
//! first step that reads it (or a view of it) and freed after the last.
//! The plan lists both ([`MemoryPlan::offloads`], [`MemoryPlan::prefetches`]),
//! the executor runs them through the backend (`Backend::offload_start`,
//! `Backend::prefetch_start`), and the accounting is in two spaces: the
//! steps' device bytes (prefetched copies come from the pool, like escaping
//! values) and [`MemoryPlan::host_bytes`].
//!
//! On a device the copies overlap compute (a copy stream, events): each
//! [`Move`] overlaps the fewest following (offload) or preceding
//! (prefetch) steps whose estimated time covers the copy's (`cost`: bytes
//! over the host bandwidth against the steps' FLOPs and bytes, at most
//! `cost::MAX_OVERLAP_STEPS`). An offload's device bytes are held until
//! the compute waits for its copy, a prefetch's from the step its copy
//! starts: the device bytes of each step count them so. On the CPU the
//! copies are synchronous (overlap 0).

use super::buffers::BufferModel;
use super::cost::{self, DeviceCosts};
use super::Schedule;
use crate::error::{Error, ErrorKind, Result};
use crate::fusion::Plan;
use crate::ir::Op;
use crate::ir::{Graph, NodeId};
use crate::runtime::device::Device;

const ALIGN: usize = 64;

/// One buffer of the plan.
#[derive(Clone, Debug, PartialEq)]
pub struct PlannedBuffer {
    /// The value stored; `None` for a kernel's scratch.
    pub value: Option<NodeId>,
    /// The kernel that creates it.
    pub kernel: usize,
    pub bytes: usize,
    pub offset: usize,
    /// The steps it is live in (inclusive).
    pub first_step: usize,
    pub last_step: usize,
    /// It takes the place of this buffer (in place).
    pub reuses: Option<usize>,
    /// It outlives the run (an output, or viewed by one): not in the arena.
    pub escapes: bool,
    /// It is the bytes at (.1) of buffer (.0), the output of a cat that
    /// copies nothing; its offset is its place in the arena (when the
    /// output escapes: in the output's own block).
    pub within: Option<(usize, usize)>,
    /// It is in the storage of a graph input the caller donated: that
    /// input's own buffer (created by no kernel: `kernel` means nothing,
    /// `reuses` is `None`), or a value written over it in place. No place
    /// in the arena, no bytes of the run.
    pub donated: bool,
}

impl PlannedBuffer {
    /// It is a donated graph input's own storage (created by no kernel).
    pub fn is_donated_input(&self) -> bool {
        self.donated && self.reuses.is_none()
    }
}

/// A value moved between device and host memory at a step: an offload
/// starts after step `step` (the last that reads the value), a prefetch
/// is ready before step `step` (the first that reads it).
///
/// The copy overlaps `overlap` steps of compute (on a device, where it
/// runs on a copy stream of its own): an offload is waited for before
/// step `step + 1 + overlap` (or at the run's end), and its device bytes
/// are held until then; a prefetch starts before step `step - overlap`,
/// and its device bytes are held from then. 0: the copy is synchronous
/// (the CPU's host pool), done between two steps.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Move {
    pub step: usize,
    pub value: NodeId,
    pub bytes: usize,
    pub overlap: usize,
}

impl Move {
    /// The step before which the compute waits for the copy (an offload:
    /// its bytes are freed there; `steps`, the number of steps, for the
    /// run's end), or the one before which the copy starts (a prefetch).
    pub fn wait_or_start(&self, kind: MoveKind, steps: usize) -> usize {
        match kind {
            MoveKind::Offload => (self.step + 1 + self.overlap).min(steps),
            MoveKind::Prefetch => self.step.saturating_sub(self.overlap),
        }
    }
}

/// Which way a [`Move`] goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MoveKind {
    Offload,
    Prefetch,
}

/// What to move: graph outputs to offload (the values a forward saves for
/// its backward), graph inputs to prefetch (those values, given back to
/// the backward in host memory).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Moves {
    pub offload: Vec<NodeId>,
    pub prefetch: Vec<NodeId>,
}

impl Moves {
    pub fn is_empty(&self) -> bool {
        self.offload.is_empty() && self.prefetch.is_empty()
    }
}

/// Kernel `kernel` writes `output` over its input `input`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Donation {
    pub kernel: usize,
    pub input: NodeId,
    pub output: NodeId,
}

#[derive(Clone, Debug, PartialEq)]
pub struct MemoryPlan {
    pub buffers: Vec<PlannedBuffer>,
    /// Bytes live in each step.
    pub step_bytes: Vec<usize>,
    /// The most bytes live at once: the predicted peak.
    pub peak_bytes: usize,
    pub peak_step: usize,
    /// The buffers live at the peak.
    pub live_at_peak: Vec<usize>,
    /// The arena's size: the end of the highest placed buffer (at least the
    /// peak; more when placement leaves gaps or sizes are rounded up).
    pub arena_bytes: usize,
    /// The in-place writes, by kernel.
    pub donations: Vec<Donation>,
    /// Bytes of the buffers that escape (allocated outside the arena).
    pub escaping_bytes: usize,
    /// Bytes of the values written over donated inputs (in the caller's
    /// storage: neither in the arena nor escaping): what donation saves.
    pub donated_bytes: usize,
    /// The most escaping bytes allocated at once, less the donated
    /// inputs' storage freed by then (what the pool adds to the arena;
    /// `escaping_bytes` without donation).
    pub escaping_peak_bytes: usize,
    /// Per kernel, whether it is a cat that copies nothing (its inputs were
    /// made within its output).
    pub joins: Vec<bool>,
    /// Per kernel, its scratch bytes (the executor asks once per kernel).
    scratch: Vec<usize>,
    /// The device whose kernels' scratch the plan reserves: the plan is
    /// exact only for a run on it.
    pub device: Device,
    /// Outputs moved to host memory after their last read (by step).
    pub offloads: Vec<Move>,
    /// Inputs copied from host memory before their first read (by step).
    pub prefetches: Vec<Move>,
    /// Bytes in host memory at the run's end: the offloaded outputs.
    pub host_bytes: usize,
    /// Values asked to move that do not, and why.
    pub move_notes: Vec<String>,
}

/// Liveness and in-place decisions of a model over some steps: all that
/// the peak needs (the schedule search evaluates many orders this way).
pub(crate) struct Liveness {
    pub first: Vec<usize>,
    pub last: Vec<usize>,
    /// Per buffer, the buffer whose place it takes.
    pub reuses: Vec<Option<usize>>,
    /// (kernel, the input value it overwrites, the output buffer written).
    pub donations: Vec<(usize, NodeId, usize)>,
    /// Per buffer, whether it is in a donated input's storage (that input's
    /// own, or written over it in place).
    pub donated: Vec<bool>,
    pub step_bytes: Vec<usize>,
    /// Per step, the bytes live when it starts (made by earlier steps).
    pub start_bytes: Vec<usize>,
}

impl Liveness {
    pub fn new(model: &BufferModel, steps: &[Vec<usize>]) -> Liveness {
        let num_kernels = model.created.len();
        let mut step_of = vec![0; num_kernels];
        for (s, step) in steps.iter().enumerate() {
            for &k in step {
                step_of[k] = s;
            }
        }
        let end = steps.len().saturating_sub(1);
        let mut first: Vec<usize> = model
            .buffers
            .iter()
            .map(|b| if b.donated { 0 } else { step_of[b.kernel] })
            .collect();
        for b in &model.buffers {
            if let Some((parent, _)) = b.within {
                first[parent] = first[parent].min(step_of[b.kernel]);
            }
        }
        // A place in the arena that a kernel of another stream uses is
        // busy, as far as stream 0 knows, until stream 0 waits for that
        // kernel: taken by stream 0 before then, it would make stream 0
        // wait early. (A donated input's storage is the caller's, never
        // the arena's: its readers' steps are what in-place writes check.)
        let joined = super::streams::joined_at(model, steps, &step_of, end);
        let busy_until = |k: usize| joined[k].unwrap_or(step_of[k]);
        let last: Vec<usize> = model
            .buffers
            .iter()
            .zip(&first)
            .map(|(b, &f)| match (b.pinned, b.donated) {
                (true, _) => end,
                (false, true) => b.readers.iter().map(|&r| step_of[r]).fold(f, usize::max),
                (false, false) => std::iter::once(b.kernel)
                    .chain(b.readers.iter().copied())
                    .map(busy_until)
                    .fold(f, usize::max),
            })
            .collect();
        let mut live = Liveness {
            first,
            last,
            reuses: vec![None; model.buffers.len()],
            donations: Vec::new(),
            donated: model.buffers.iter().map(|b| b.donated).collect(),
            step_bytes: Vec::new(),
            start_bytes: Vec::new(),
        };
        live.choose_in_place(model, steps, &step_of);
        live.count_bytes(model, steps);
        live
    }

    /// Accepts each in-place candidate whose input buffer dies in the
    /// kernel's step, read there by that kernel alone; a graph output only
    /// over a donated input's storage.
    fn choose_in_place(&mut self, model: &BufferModel, steps: &[Vec<usize>], step_of: &[usize]) {
        let mut taken = vec![false; model.buffers.len()];
        for step in steps {
            for &k in step {
                for c in &model.in_place[k] {
                    let input = &model.buffers[c.buffer];
                    let s = step_of[k];
                    let sole_reader = input.readers.iter().all(|&r| r == k || step_of[r] < s);
                    let output = c.output_buffer;
                    let into_caller = self.donated[c.buffer];
                    if input.pinned
                        || (model.buffers[output].pinned && !into_caller)
                        || model.buffers[output].within.is_some()
                        || input.within.is_some()
                        || self.last[c.buffer] != s
                        || !sole_reader
                        || taken[c.buffer]
                        || self.reuses[output].is_some()
                    {
                        continue;
                    }
                    taken[c.buffer] = true;
                    self.reuses[output] = Some(c.buffer);
                    self.donated[output] = into_caller;
                    self.donations.push((k, c.input, output));
                }
            }
        }
    }

    /// Bytes live in each step: the values live in it (a buffer that takes
    /// another's place adds nothing in the step it takes it), plus what the
    /// kernels with scratch add while they run. Those run first in their
    /// step, one at a time in kernel order (see `runtime::execute`), each
    /// holding its scratch while it allocates its output: kernel i adds
    /// `outputs of the scratch kernels before it + its output + its scratch`
    /// over the step's start, which may exceed all the step's new values.
    /// Donated inputs' storage is the caller's: it counts nothing.
    fn count_bytes(&mut self, model: &BufferModel, steps: &[Vec<usize>]) {
        let mut delta = vec![0isize; steps.len() + 1];
        let mut fresh = vec![0usize; steps.len()];
        for b in self.freed_donations(model) {
            delta[self.last[b] + 1] -= model.buffers[b].bytes as isize;
        }
        for (b, buffer) in model.buffers.iter().enumerate() {
            if buffer.value.is_none() || buffer.within.is_some() || self.donated[b] {
                continue;
            }
            let from = match self.reuses[b] {
                Some(_) => self.first[b] + 1,
                None => self.first[b],
            };
            if self.reuses[b].is_none() {
                fresh[self.first[b]] += buffer.bytes;
            }
            if from <= self.last[b] {
                delta[from] += buffer.bytes as isize;
                delta[self.last[b] + 1] -= buffer.bytes as isize;
            }
        }
        let mut live = 0isize;
        for ((step, d), &fresh) in steps.iter().zip(&delta).zip(&fresh) {
            live += d;
            // Below the run's start once donated inputs are freed.
            let live = live.max(0) as usize;
            self.start_bytes.push(live.saturating_sub(fresh));
            self.step_bytes
                .push(live + scratch_excess(model, step, fresh));
        }
    }

    /// The buffers in donated inputs' storage that free it (the storage
    /// the caller handed over, released after the read of the last value
    /// it holds): the last of each in-place chain, unless an output. (The
    /// plan is exact when the caller's tensors were their only handles;
    /// one still held elsewhere frees nothing, and its overwrites
    /// allocate.)
    pub fn freed_donations(&self, model: &BufferModel) -> Vec<usize> {
        let mut taken_over = vec![false; model.buffers.len()];
        for r in self.reuses.iter().flatten() {
            taken_over[*r] = true;
        }
        // A donated input no kernel reads is dropped only with the run.
        let unread = |b: usize| model.buffers[b].donated && model.buffers[b].readers.is_empty();
        (0..model.buffers.len())
            .filter(|&b| {
                self.donated[b] && !taken_over[b] && !model.buffers[b].pinned && !unread(b)
            })
            .collect()
    }

    pub fn peak(&self) -> usize {
        self.step_bytes.iter().copied().max().unwrap_or(0)
    }
}

/// How far the scratch kernels of `step` (run first, one at a time) rise
/// above `fresh`, the bytes of all the values the step creates.
fn scratch_excess(model: &BufferModel, step: &[usize], fresh: usize) -> usize {
    let mut before = 0;
    let mut excess = 0;
    for &k in step {
        let (mut scratch, mut output) = (0, 0);
        for &b in &model.created[k] {
            match model.buffers[b].value {
                None => scratch += model.buffers[b].bytes,
                Some(_) if model.buffers[b].within.is_some() => {}
                Some(_) => output += model.buffers[b].bytes,
            }
        }
        if scratch > 0 {
            excess = excess.max((before + output + scratch).saturating_sub(fresh));
            before += output;
        }
    }
    excess
}

impl MemoryPlan {
    /// Plans the buffers of `model` under `schedule`.
    pub(crate) fn from_model(
        graph: &Graph,
        plan: &Plan,
        model: &BufferModel,
        schedule: &Schedule,
        moves: &Moves,
    ) -> Result<MemoryPlan> {
        let mut live = Liveness::new(model, &schedule.steps);
        let offsets = place(model, &live);
        let (offloads, prefetches, pool_deltas, move_notes) =
            plan_moves(graph, plan, model, &schedule.steps, &live, moves);
        // Device bytes: an offloaded output leaves once its copy is waited
        // for, a prefetched input is there from the start of its copy to
        // its last read.
        let n = schedule.steps.len();
        for m in &offloads {
            let from = m.wait_or_start(MoveKind::Offload, n);
            for b in &mut live.step_bytes[from..] {
                *b -= m.bytes;
            }
        }
        for (m, last) in &prefetches {
            let from = m.wait_or_start(MoveKind::Prefetch, n);
            for b in &mut live.step_bytes[from..=*last] {
                *b += m.bytes;
            }
        }
        let (peak_step, peak_bytes) = live
            .step_bytes
            .iter()
            .copied()
            .enumerate()
            .max_by_key(|&(s, b)| (b, std::cmp::Reverse(s)))
            .unwrap_or((0, 0));
        let buffers: Vec<PlannedBuffer> = model
            .buffers
            .iter()
            .enumerate()
            .map(|(b, buffer)| PlannedBuffer {
                value: buffer.value,
                kernel: buffer.kernel,
                bytes: buffer.bytes,
                offset: offsets[b],
                first_step: live.first[b],
                last_step: live.last[b],
                reuses: live.reuses[b],
                escapes: buffer
                    .within
                    .map_or(buffer.pinned, |(p, _)| model.buffers[p].pinned),
                within: buffer.within,
                donated: live.donated[b],
            })
            .collect();
        let escaping_peak_bytes =
            escaping_peak(&buffers, &live.freed_donations(model), &live, &pool_deltas);
        let plan = MemoryPlan {
            escaping_peak_bytes,
            live_at_peak: live_in(&buffers, peak_step),
            arena_bytes: buffers
                .iter()
                .filter(|b| !b.escapes && !b.donated)
                .map(|b| b.offset + b.bytes)
                .max()
                .unwrap_or(0),
            escaping_bytes: buffers
                .iter()
                .filter(|b| b.escapes && b.within.is_none() && !b.donated)
                .map(|b| b.bytes)
                .sum(),
            donated_bytes: buffers
                .iter()
                .filter(|b| b.donated && b.reuses.is_some())
                .map(|b| b.bytes)
                .sum(),
            joins: model.joins.clone(),
            buffers,
            donations: donations(model, &live),
            scratch: scratch_per_kernel(model),
            device: model.device,
            step_bytes: live.step_bytes,
            peak_bytes,
            peak_step,
            host_bytes: offloads.iter().map(|m| m.bytes).sum(),
            offloads,
            prefetches: prefetches.into_iter().map(|(m, _)| m).collect(),
            move_notes,
        };
        if cfg!(debug_assertions) {
            plan.check().map_err(|e| {
                let message = format!(
                    "internal error in the memory plan of `{}`: {}",
                    graph.name, e.message
                );
                Error::new(ErrorKind::Verify, message)
            })?;
        }
        Ok(plan)
    }

    /// The peak the compiled executor measures: its arena, allocated for
    /// the whole run, plus the escaping buffers (all alive at its end),
    /// less the donated inputs' storage freed before they are allocated.
    pub fn run_peak_bytes(&self) -> usize {
        self.arena_bytes + self.escaping_peak_bytes
    }

    /// Bytes kernel `k` allocates for its own use while it runs.
    pub fn scratch_bytes(&self, k: usize) -> usize {
        self.scratch[k]
    }

    /// The in-place writes of kernel `k`: (input value, output value).
    pub fn in_place(&self, k: usize) -> impl Iterator<Item = (NodeId, NodeId)> + '_ {
        let from = self.donations.partition_point(|d| d.kernel < k);
        self.donations[from..]
            .iter()
            .take_while(move |d| d.kernel == k)
            .map(|d| (d.input, d.output))
    }

    /// Verifies that no two buffers live at the same time overlap in the
    /// arena, except a buffer and the one whose place it takes (which share
    /// it from the step the first dies in), and that the peak is the most
    /// bytes live in a step.
    pub fn check(&self) -> Result<()> {
        let bad = |m: String| Err(Error::new(ErrorKind::Verify, m));
        for (i, a) in self.buffers.iter().enumerate() {
            if let Some(r) = a.reuses {
                let donor = &self.buffers[r];
                if donor.offset != a.offset
                    || donor.bytes != a.bytes
                    || donor.last_step != a.first_step
                {
                    return bad(format!("buffer {i} reuses buffer {r}, which is not dead where it starts or differs in place or size"));
                }
            }
            for (j, b) in self.buffers.iter().enumerate().skip(i + 1) {
                let nested =
                    a.within.is_some_and(|(p, _)| p == j) || b.within.is_some_and(|(p, _)| p == i);
                if a.escapes || b.escapes || a.donated || b.donated || nested {
                    continue;
                }
                let same_place = self.shares_place(i, j);
                let in_time = a.first_step <= b.last_step && b.first_step <= a.last_step;
                let in_space = a.offset < b.offset + b.bytes && b.offset < a.offset + a.bytes;
                if in_time && in_space && !same_place && a.bytes > 0 && b.bytes > 0 {
                    return bad(format!(
                        "buffers {i} ({} bytes at {}, steps {}..={}) and {j} ({} bytes at {}, steps {}..={}) overlap",
                        a.bytes, a.offset, a.first_step, a.last_step, b.bytes, b.offset, b.first_step, b.last_step
                    ));
                }
            }
        }
        if self.step_bytes.iter().copied().max().unwrap_or(0) != self.peak_bytes {
            return bad("the peak is not the most bytes live in a step".into());
        }
        if self.run_peak_bytes() < self.peak_bytes {
            return bad(format!(
                "an arena of {} bytes and {} escaping bytes cannot hold a peak of {}",
                self.arena_bytes, self.escaping_bytes, self.peak_bytes
            ));
        }
        Ok(())
    }

    /// Whether `a` and `b` are one place: one takes the other's, in a chain.
    fn shares_place(&self, a: usize, b: usize) -> bool {
        let root = |mut x: usize| {
            while let Some(r) = self.buffers[x].reuses {
                x = r;
            }
            x
        };
        root(a) == root(b)
    }

    /// The plan as text: peak, arena, in-place writes, every buffer.
    pub fn describe(&self, graph: &Graph) -> String {
        let name = |b: &PlannedBuffer| match b.value {
            Some(v) => graph.display_name(v),
            None => format!("scratch of k{}", b.kernel),
        };
        let over_donated = self
            .buffers
            .iter()
            .filter(|b| b.donated && b.reuses.is_some())
            .count();
        // CPU plans say nothing of their device.
        let on = match self.device {
            Device::Cpu => String::new(),
            d => format!(" on {d}"),
        };
        let mut text = format!(
            "graph `{}`{on}: {} buffers, predicted peak {} bytes at step {}, arena {} bytes \
             + {} escaping bytes = {} bytes for a run, {} in place \
             ({over_donated} over donated inputs: {} bytes in the caller's storage)\n",
            graph.name,
            self.buffers.len(),
            self.peak_bytes,
            self.peak_step,
            self.arena_bytes,
            self.escaping_peak_bytes,
            self.run_peak_bytes(),
            self.donations.len(),
            self.donated_bytes
        );
        if !self.offloads.is_empty() || !self.prefetches.is_empty() || !self.move_notes.is_empty() {
            text.push_str(&format!(
                "  device bytes: peak {} (arena + pool {}); host bytes: {} offloaded \
                 ({} values), {} values prefetched\n",
                self.peak_bytes,
                self.run_peak_bytes(),
                self.host_bytes,
                self.offloads.len(),
                self.prefetches.len()
            ));
            let n = self.step_bytes.len();
            for m in &self.offloads {
                let overlap = match m.overlap {
                    0 => String::new(),
                    _ => format!(
                        ", overlapping {} steps, waited for before step {}",
                        m.overlap,
                        m.wait_or_start(MoveKind::Offload, n)
                    ),
                };
                text.push_str(&format!(
                    "  offload {} ({} bytes) to host after step {}{overlap}\n",
                    graph.display_name(m.value),
                    m.bytes,
                    m.step
                ));
            }
            for m in &self.prefetches {
                let overlap = match m.overlap {
                    0 => String::new(),
                    _ => format!(
                        ", started before step {} ({} steps ahead)",
                        m.wait_or_start(MoveKind::Prefetch, n),
                        m.overlap
                    ),
                };
                text.push_str(&format!(
                    "  prefetch {} ({} bytes) to the device before step {}{overlap}\n",
                    graph.display_name(m.value),
                    m.bytes,
                    m.step
                ));
            }
            for n in &self.move_notes {
                text.push_str(&format!("  note: {n}\n"));
            }
        }
        let at_peak: Vec<String> = self
            .live_at_peak
            .iter()
            .map(|&b| name(&self.buffers[b]))
            .collect();
        text.push_str(&format!("  live at the peak: {}\n", at_peak.join(", ")));
        for (i, b) in self.buffers.iter().enumerate() {
            let reuse = b
                .reuses
                .map(|r| format!(" in place of buffer {r}"))
                .unwrap_or_default();
            let place = match (b.within, b.escapes) {
                _ if b.is_donated_input() => {
                    "the caller's (a donated input), until its last read".to_string()
                }
                _ if b.donated => "in a donated input's storage".to_string(),
                (Some((p, at)), _) => {
                    format!("within buffer {p} at +{at} (its cat copies nothing)")
                }
                (None, true) => "outside the arena (escapes)".to_string(),
                (None, false) => format!("at offset {}", b.offset),
            };
            let by = match b.is_donated_input() {
                true => "input".to_string(),
                false => format!("k{}", b.kernel),
            };
            text.push_str(&format!(
                "  buffer {i} {}: {} bytes {place}, steps {}..={}, {by}{reuse}\n",
                name(b),
                b.bytes,
                b.first_step,
                b.last_step,
            ));
        }
        text
    }
}

/// The buffers that hold bytes in `step` (one that takes another's place
/// holds none of its own in the step it takes it).
fn live_in(buffers: &[PlannedBuffer], step: usize) -> Vec<usize> {
    (0..buffers.len())
        .filter(|&b| {
            let from = buffers[b].first_step + usize::from(buffers[b].reuses.is_some());
            from <= step
                && step <= buffers[b].last_step
                && buffers[b].within.is_none()
                && !buffers[b].donated
        })
        .collect()
}

/// The most bytes of escaping buffers allocated by a step's end, less the
/// donated storage `freed` before that step.
fn escaping_peak(
    buffers: &[PlannedBuffer],
    freed: &[usize],
    live: &Liveness,
    moves: &[(usize, isize)],
) -> usize {
    let steps = live.step_bytes.len();
    let mut delta = vec![0isize; steps + 1];
    for &(step, bytes) in moves {
        delta[step] += bytes;
    }
    for b in buffers
        .iter()
        .filter(|b| b.escapes && b.within.is_none() && !b.donated)
    {
        delta[b.first_step] += b.bytes as isize;
    }
    for &b in freed {
        delta[live.last[b] + 1] -= buffers[b].bytes as isize;
    }
    let mut now = 0isize;
    let mut peak = 0isize;
    for d in &delta[..steps] {
        now += d;
        peak = peak.max(now);
    }
    peak as usize
}

/// The offloads and prefetches `moves` asks for under `steps` (each
/// prefetch with the last step that reads its copy), the pool's byte
/// changes by step they make (what the executor allocates outside the
/// arena), and why a value asked for does not move.
#[allow(clippy::type_complexity)]
fn plan_moves(
    graph: &Graph,
    plan: &Plan,
    model: &BufferModel,
    steps: &[Vec<usize>],
    live: &Liveness,
    moves: &Moves,
) -> (
    Vec<Move>,
    Vec<(Move, usize)>,
    Vec<(usize, isize)>,
    Vec<String>,
) {
    let (mut offloads, mut prefetches, mut deltas, mut notes) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    if moves.is_empty() || steps.is_empty() {
        return (offloads, prefetches, deltas, notes);
    }
    let mut step_of = vec![0; plan.kernels.len()];
    for (s, step) in steps.iter().enumerate() {
        for &k in step {
            step_of[k] = s;
        }
    }
    let end = steps.len() - 1;
    // On a device, copies run beside the compute: each overlaps the steps
    // whose estimated time covers its own (see `cost`); on the CPU they
    // are synchronous copies between two steps.
    let costs = DeviceCosts::of(model.device);
    let seconds = match model.device {
        Device::Cpu => Vec::new(),
        _ => cost::step_seconds(graph, plan, steps, &costs),
    };
    let after = |step: usize, bytes: usize| match model.device {
        Device::Cpu => 0,
        _ => cost::overlap_steps(
            costs.transfer_seconds(bytes),
            seconds[step + 1..].iter().copied(),
        ),
    };
    let before = |step: usize, bytes: usize| match model.device {
        Device::Cpu => 0,
        _ => cost::overlap_steps(
            costs.transfer_seconds(bytes),
            seconds[..step].iter().rev().copied(),
        ),
    };
    let mut outputs_of_buffer = vec![0usize; model.buffers.len()];
    for o in &graph.outputs {
        if let Some(b) = model.value_buffer[o.node.index()] {
            outputs_of_buffer[b] += 1;
        }
    }
    for &v in &moves.offload {
        let name = graph.display_name(v);
        let Some(b) = model.value_buffer[v.index()] else {
            notes.push(format!(
                "{name} not offloaded: it is no buffer of the run (an input or a constant)"
            ));
            continue;
        };
        let buffer = &model.buffers[b];
        if buffer.value != Some(v) || buffer.within.is_some() || live.donated[b] {
            notes.push(format!(
                "{name} not offloaded: it is a view of, or within, another value"
            ));
            continue;
        }
        if outputs_of_buffer[b] > 1 {
            notes.push(format!(
                "{name} not offloaded: another output shares its buffer"
            ));
            continue;
        }
        let step = buffer
            .readers
            .iter()
            .map(|&k| step_of[k])
            .fold(live.first[b], usize::max);
        if step == end {
            notes.push(format!("{name} not offloaded: it is read by the last step"));
            continue;
        }
        let m = Move {
            step,
            value: v,
            bytes: buffer.bytes,
            overlap: after(step, buffer.bytes),
        };
        offloads.push(m);
        deltas.push((
            m.wait_or_start(MoveKind::Offload, steps.len()),
            -(buffer.bytes as isize),
        ));
    }
    for &v in &moves.prefetch {
        // The input and the views of it the kernels make.
        let mut of_it = vec![false; graph.len()];
        of_it[v.index()] = true;
        let (mut first, mut last) = (None::<usize>, 0);
        for (k, kernel) in plan.kernels.iter().enumerate() {
            if !kernel.reads(graph).iter().any(|x| of_it[x.index()]) {
                continue;
            }
            first = Some(first.map_or(step_of[k], |f| f.min(step_of[k])));
            last = last.max(step_of[k]);
            let members = kernel.members();
            let view = members.len() == 1
                && matches!(
                    graph.node(members[0]).op,
                    Op::Reshape(_) | Op::Permute(_) | Op::Expand(_) | Op::Slice { .. }
                );
            if view {
                for w in kernel.writes() {
                    of_it[w.index()] = true;
                }
            }
        }
        if graph.outputs.iter().any(|o| of_it[o.node.index()]) {
            last = end;
        }
        let Some(first) = first else {
            notes.push(format!(
                "{} not prefetched: no kernel reads it",
                graph.display_name(v)
            ));
            continue;
        };
        let ty = &graph.node(v).ty;
        let numel: usize = ty.shape.as_concrete().map_or(0, |s| s.iter().product());
        let bytes = numel * ty.dtype.size_bytes();
        let m = Move {
            step: first,
            value: v,
            bytes,
            overlap: before(first, bytes),
        };
        prefetches.push((m, last));
        deltas.push((
            m.wait_or_start(MoveKind::Prefetch, steps.len()),
            bytes as isize,
        ));
        deltas.push((last + 1, -(bytes as isize)));
    }
    offloads.sort_by_key(|m| m.step);
    prefetches.sort_by_key(|(m, _)| m.step);
    (offloads, prefetches, deltas, notes)
}

/// The in-place writes, by kernel.
fn donations(model: &BufferModel, live: &Liveness) -> Vec<Donation> {
    let value = |b: usize| {
        model.buffers[b]
            .value
            .expect("an in-place buffer holds a value")
    };
    let mut donations: Vec<Donation> = live
        .donations
        .iter()
        .map(|&(kernel, input, output)| Donation {
            kernel,
            input,
            output: value(output),
        })
        .collect();
    donations.sort_by_key(|d| d.kernel);
    donations
}

fn scratch_per_kernel(model: &BufferModel) -> Vec<usize> {
    let mut scratch = vec![0; model.created.len()];
    for b in model.buffers.iter().filter(|b| b.value.is_none()) {
        scratch[b.kernel] += b.bytes;
    }
    scratch
}

/// Offsets: in-place chains share one place; places go largest first to the
/// lowest offset free over their lifetime.
fn place(model: &BufferModel, live: &Liveness) -> Vec<usize> {
    let n = model.buffers.len();
    let root = |mut b: usize| {
        while let Some(r) = live.reuses[b] {
            b = r;
        }
        b
    };
    // Per place (its root buffer): size and lifetime over the chain.
    let mut span: Vec<Option<(usize, usize, usize)>> = vec![None; n];
    let placed_alone = |b: usize| {
        !model.buffers[b].pinned && model.buffers[b].within.is_none() && !live.donated[b]
    };
    for b in (0..n).filter(|&b| placed_alone(b)) {
        let r = root(b);
        let size = model.buffers[b].bytes.div_ceil(ALIGN) * ALIGN;
        span[r] = Some(match span[r] {
            None => (size, live.first[b], live.last[b]),
            Some((s, f, l)) => (s.max(size), f.min(live.first[b]), l.max(live.last[b])),
        });
    }
    let mut places: Vec<(usize, (usize, usize, usize))> = span
        .iter()
        .enumerate()
        .filter_map(|(r, s)| s.map(|s| (r, s)))
        .collect();
    places.sort_by_key(|&(r, (size, first, _))| (std::cmp::Reverse(size), first, r));
    let mut offset_of = vec![0usize; n];
    let mut placed: Vec<(usize, usize, usize, usize)> = Vec::new(); // offset, size, first, last
    for (r, (size, first, last)) in places {
        let mut busy: Vec<(usize, usize)> = placed
            .iter()
            .filter(|p| p.2 <= last && first <= p.3 && p.1 > 0)
            .map(|p| (p.0, p.1))
            .collect();
        busy.sort_unstable();
        let mut offset = 0;
        for (o, s) in busy {
            if offset + size <= o {
                break;
            }
            offset = offset.max(o + s);
        }
        offset_of[r] = offset;
        placed.push((offset, size, first, last));
    }
    (0..n)
        .map(|b| match model.buffers[b].within {
            Some((parent, at)) => offset_of[root(parent)] + at,
            None => offset_of[root(b)],
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn buffer(
        bytes: usize,
        offset: usize,
        steps: (usize, usize),
        reuses: Option<usize>,
    ) -> PlannedBuffer {
        PlannedBuffer {
            value: None,
            kernel: 0,
            bytes,
            offset,
            first_step: steps.0,
            last_step: steps.1,
            reuses,
            escapes: false,
            within: None,
            donated: false,
        }
    }

    fn plan(buffers: Vec<PlannedBuffer>, step_bytes: Vec<usize>) -> MemoryPlan {
        let peak_bytes = step_bytes.iter().copied().max().unwrap_or(0);
        MemoryPlan {
            arena_bytes: buffers
                .iter()
                .map(|b| b.offset + b.bytes)
                .max()
                .unwrap_or(0),
            buffers,
            step_bytes,
            peak_bytes,
            peak_step: 0,
            live_at_peak: Vec::new(),
            donations: Vec::new(),
            escaping_bytes: 0,
            donated_bytes: 0,
            escaping_peak_bytes: 0,
            joins: Vec::new(),
            scratch: Vec::new(),
            device: Device::Cpu,
            offloads: Vec::new(),
            prefetches: Vec::new(),
            host_bytes: 0,
            move_notes: Vec::new(),
        }
    }

    #[test]
    fn a_donated_input_takes_an_output_and_one_read_elsewhere_is_freed() {
        use crate::fusion::fuse;
        use crate::ir::text::parse;
        use crate::schedule::{build, build_donating, Donations, ScheduleOptions};
        // %x is overwritten by the fused kernel's output; %w is read by
        // the matmul alone (not in place) and freed after it.
        let g = parse(
            "graph g(%x, %w) {
              %x = input : f32[4,4]
              %w = input : f32[4,4]
              %m = matmul(%w, %w) : f32[4,4]
              %e = exp(%x) : f32[4,4]
              %t = tanh(%e) : f32[4,4]
              return %t as t, %m as m
            }",
        )
        .unwrap();
        let plan = fuse(&g);
        let options = ScheduleOptions::default();
        let plain = build(&g, &plan, &options).unwrap().memory;
        let donating = build_donating(&g, &plan, &options, &Donations::inputs(&[0, 1]))
            .unwrap()
            .memory;
        assert_eq!(plain.check(), Ok(()));
        assert_eq!(donating.check(), Ok(()));
        // Both outputs escape: 2 × 64 bytes from the pool without donation.
        assert_eq!(plain.run_peak_bytes(), plain.arena_bytes + 128);
        assert_eq!(plain.donated_bytes, 0);
        let (x, t) = (g.inputs[0], g.outputs[0].node);
        assert!(
            donating
                .donations
                .iter()
                .any(|d| d.input == x && d.output == t),
            "{:?}",
            donating.donations
        );
        assert_eq!(donating.donated_bytes, 64);
        // %m still comes from the pool, but %w (64 bytes) is freed after
        // the matmul; whichever runs first, at most 64 escaping bytes.
        assert_eq!(donating.escaping_bytes, 64);
        assert!(donating.escaping_peak_bytes <= 64);
        assert!(donating.run_peak_bytes() < plain.run_peak_bytes());
        let text = donating.describe(&g);
        assert!(text.contains("1 over donated inputs: 64 bytes"), "{text}");
        assert!(text.contains("a donated input"), "{text}");
    }

    #[test]
    fn the_checker_accepts_reuse_of_dead_buffers() {
        // 0 and 1 live together; 2 starts after 0 died and takes its place;
        // 3 takes 1's place in place (1 dies in the step 3 starts).
        let ok = plan(
            vec![
                buffer(64, 0, (0, 1), None),
                buffer(64, 64, (0, 2), None),
                buffer(64, 0, (2, 3), None),
                buffer(64, 64, (2, 3), Some(1)),
            ],
            vec![128, 128, 128, 128],
        );
        assert_eq!(ok.check(), Ok(()));
    }

    #[test]
    fn the_checker_finds_live_buffers_that_overlap() {
        let overlap = plan(
            vec![buffer(64, 0, (0, 2), None), buffer(64, 32, (2, 3), None)],
            vec![64, 64, 128, 64],
        );
        let e = overlap.check().unwrap_err();
        assert!(e.message.contains("overlap"), "{e}");
        // In place only from the step the donor dies in.
        let early = plan(
            vec![buffer(64, 0, (0, 2), None), buffer(64, 0, (1, 3), Some(0))],
            vec![64, 64, 64, 64],
        );
        assert!(early.check().is_err());
    }
}
