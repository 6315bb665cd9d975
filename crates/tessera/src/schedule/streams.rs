//! Streams by hint (`{"stream": N}`): each kernel of a region hinted with
//! a stream runs on that stream, every other kernel on the run's own
//! (stream 0), and a kernel waits, through events, for the kernels of
//! other streams it must follow. The schedule's order stays the order in
//! which kernels are queued; only the device's ordering between streams
//! changes, so independent regions on streams of their own run at once
//! even under a sequential order.
//!
//! A kernel `k` must follow an earlier kernel `h` of another stream when
//! - `k` reads a buffer `h` creates (its value, or a view of it);
//! - `k` creates a buffer in memory that a buffer `h` created or read
//!   occupied before (the memory plan's reuse of the arena: a place
//!   taken by a later buffer, or an output written in place of an input);
//!
//! Two rules keep the run's own stream from waiting early, since a wait
//! holds up all of stream 0's later work: a stream-0 kernel that reads
//! another stream's value (and what depends on it) is queued after all
//! stream-0 work that does not need it (`defer_cross_stream_readers`),
//! and an arena place a kernel of another stream used stays busy, for the
//! memory plan, until stream 0 waits for that kernel anyway (`joined_at`).
//!
//! Buffers outside the arena (escaping values, the pool's) are the device
//! allocator's: while a run uses streams, it holds the blocks freed until
//! the run's end, where every stream joins the run's own (see
//! `runtime::execute`).
//!
//! Waits are pruned: a stream that already follows a kernel of another
//! stream (directly, or through a kernel it waited for) waits for no
//! earlier kernel of it. An event is recorded after a kernel only when
//! another stream waits for it ([`StreamPlan::records`]). The executor
//! may still run a step's stream-0 kernels on several lanes (the device's
//! lanes no stream takes, as it spreads a step without streams); it keeps
//! what the pruning assumes: such a step has no wait on stream 0, and its
//! kernels' events are recorded once all of them are done
//! (`runtime::execute::on_streams`).

use super::buffers::BufferModel;
use super::hinted::Hints;
use super::kernels::KernelGraph;
use super::memory::MemoryPlan;
use super::Schedule;

/// Per kernel, the stream its hints put it on (0: the run's own).
pub(crate) fn kernel_streams(hints: &Hints) -> Vec<usize> {
    hints
        .kernels
        .iter()
        .map(|h| h.stream.unwrap_or(0))
        .collect()
}

/// `steps` with the kernels of the run's own stream (0) that read a value
/// made on another stream, and every kernel that depends on them, moved
/// after all the others (each part in its order). Queued where an order
/// puts it, such a kernel stops stream 0 until the other stream's kernel
/// has finished, and all of stream 0's later work with it: a data-parallel
/// step's parameter update behind its bucket's all-reduce would hold up
/// the rest of the backward, which the all-reduce was meant to overlap.
/// Queued last, stream 0 first runs everything that needs no other stream.
/// Unchanged when a kernel to move has an order or group hint (moving it
/// could break the order or the group asked for).
pub(crate) fn defer_cross_stream_readers(
    steps: Vec<Vec<usize>>,
    kg: &KernelGraph,
    hints: &Hints,
) -> Vec<Vec<usize>> {
    let stream_of = kernel_streams(hints);
    if stream_of.iter().all(|&s| s == 0) {
        return steps;
    }
    let mut deferred = vec![false; kg.len()];
    // Producers come in earlier steps: one pass in order sees them first.
    for &k in steps.iter().flatten() {
        deferred[k] = kg.producers[k]
            .iter()
            .any(|&p| deferred[p] || (stream_of[k] == 0 && stream_of[p] != 0));
    }
    let constrained =
        |k: usize| hints.kernels[k].order.is_some() || hints.kernels[k].group.is_some();
    if (0..kg.len()).any(|k| deferred[k] && constrained(k)) {
        return steps;
    }
    let (mut early, mut late) = (Vec::new(), Vec::new());
    for step in steps {
        let (moved, kept): (Vec<usize>, Vec<usize>) = step.into_iter().partition(|&k| deferred[k]);
        early.extend((!kept.is_empty()).then_some(kept));
        late.extend((!moved.is_empty()).then_some(moved));
    }
    early.extend(late);
    early
}

/// Per kernel on a stream other than 0, the first step at which a kernel
/// of stream 0 that depends on it runs (`end` if none does): until then
/// stream 0 has not waited for it, so memory it uses is not free for
/// stream 0 (see [`super::memory::Liveness`]). `None` for stream 0's kernels.
pub(crate) fn joined_at(
    model: &BufferModel,
    steps: &[Vec<usize>],
    step_of: &[usize],
    end: usize,
) -> Vec<Option<usize>> {
    let n = model.created.len();
    let mut joined: Vec<Option<usize>> = vec![None; n];
    if model.stream_of.iter().all(|&s| s == 0) {
        return joined;
    }
    let mut consumers: Vec<Vec<usize>> = vec![Vec::new(); n];
    for (c, read) in model.read.iter().enumerate() {
        for &b in read {
            let buffer = &model.buffers[b];
            if !buffer.donated && buffer.kernel != c {
                consumers[buffer.kernel].push(c);
            }
        }
    }
    // Consumers run in later steps: in reverse order they are known first.
    for &k in steps.iter().flatten().rev() {
        if model.stream_of[k] == 0 {
            continue;
        }
        let at = consumers[k]
            .iter()
            .map(|&c| match model.stream_of[c] {
                0 => step_of[c],
                _ => joined[c].unwrap_or(end),
            })
            .fold(end, usize::min);
        joined[k] = Some(at);
    }
    joined
}

/// Which stream each kernel runs on and the events between streams.
#[derive(Clone, Debug, PartialEq)]
pub struct StreamPlan {
    /// Per kernel, its stream: the hint's number, 0 for the run's own.
    pub stream_of: Vec<usize>,
    /// Per kernel, the kernels of other streams whose events it waits for
    /// before it starts (at most one per stream).
    pub waits: Vec<Vec<usize>>,
    /// Per kernel, whether an event is recorded after it.
    pub records: Vec<bool>,
    /// The streams used, ascending.
    pub streams: Vec<usize>,
}

impl StreamPlan {
    /// The plan of `schedule` whose kernels have `hints`, with the places
    /// of `memory` (made of `model`); `None` when no kernel asks for a
    /// stream other than 0.
    pub(crate) fn new(
        model: &BufferModel,
        hints: &Hints,
        schedule: &Schedule,
        memory: &MemoryPlan,
    ) -> Option<StreamPlan> {
        let n = hints.kernels.len();
        let stream_of: Vec<usize> = hints
            .kernels
            .iter()
            .map(|h| h.stream.unwrap_or(0))
            .collect();
        if stream_of.iter().all(|&s| s == 0) {
            return None;
        }
        let mut streams: Vec<usize> = stream_of.clone();
        streams.push(0);
        streams.sort_unstable();
        streams.dedup();
        let index = |s: usize| streams.binary_search(&s).expect("a used stream");
        let order = schedule.order();
        let mut position = vec![usize::MAX; n];
        for (p, &k) in order.iter().enumerate() {
            position[k] = p;
        }
        let hazards = hazards(model, memory, n);
        // Per stream, the latest position of each stream it follows (+1;
        // 0: none), and per kernel that view when it was queued.
        let mut follows = vec![vec![0usize; streams.len()]; streams.len()];
        let mut seen_at: Vec<Vec<usize>> = vec![Vec::new(); n];
        let mut waits = vec![Vec::new(); n];
        let mut records = vec![false; n];
        for &k in &order {
            let s = index(stream_of[k]);
            // The latest hazard on each other stream.
            let mut need = vec![None::<usize>; streams.len()];
            for &h in &hazards[k] {
                let t = index(stream_of[h]);
                if t == s || position[h] >= position[k] {
                    continue;
                }
                if need[t].is_none_or(|p: usize| position[h] > position[p]) {
                    need[t] = Some(h);
                }
            }
            for (t, h) in need.into_iter().enumerate() {
                let Some(h) = h else { continue };
                if follows[s][t] > position[h] {
                    continue;
                }
                waits[k].push(h);
                records[h] = true;
                // Whatever `h` followed, `s` follows now.
                let through = seen_at[h].clone();
                for (u, &p) in through.iter().enumerate() {
                    follows[s][u] = follows[s][u].max(p);
                }
                follows[s][t] = follows[s][t].max(position[h] + 1);
            }
            waits[k].sort_unstable();
            follows[s][s] = position[k] + 1;
            seen_at[k] = follows[s].clone();
        }
        Some(StreamPlan {
            stream_of,
            waits,
            records,
            streams,
        })
    }

    /// The plan as the schedule log prints it: each wait.
    pub fn describe(&self) -> String {
        let mut text = format!("  streams {:?}; kernels by stream:", self.streams);
        for &s in &self.streams {
            let ks: Vec<String> = (0..self.stream_of.len())
                .filter(|&k| self.stream_of[k] == s)
                .map(|k| format!("k{k}"))
                .collect();
            text.push_str(&format!(" {s}: [{}]", ks.join(" ")));
        }
        text.push('\n');
        for (k, w) in self.waits.iter().enumerate() {
            for &h in w {
                text.push_str(&format!(
                    "  k{k} (stream {}) waits for k{h} (stream {})\n",
                    self.stream_of[k], self.stream_of[h]
                ));
            }
        }
        text
    }
}

/// Per kernel, the kernels it must follow whatever their streams (see the
/// module docs): producers of what it reads, and the kernels that used
/// the memory its buffers take.
fn hazards(model: &BufferModel, memory: &MemoryPlan, n: usize) -> Vec<Vec<usize>> {
    let buffers = &memory.buffers;
    let creator = |b: usize| (!buffers[b].is_donated_input()).then_some(buffers[b].kernel);
    // Who touched buffer b: its creator and its readers.
    let users = |b: usize| -> Vec<usize> {
        creator(b)
            .into_iter()
            .chain(model.buffers[b].readers.iter().copied())
            .collect()
    };
    let mut hazards: Vec<Vec<usize>> = vec![Vec::new(); n];
    for (k, read) in model.read.iter().enumerate() {
        for &b in read {
            hazards[k].extend(creator(b));
        }
    }
    let in_arena = |b: usize| !buffers[b].escapes && !buffers[b].donated && buffers[b].bytes > 0;
    for (c, buffer) in buffers.iter().enumerate() {
        let Some(k) = creator(c) else { continue };
        // Written in place of another buffer: that one's users first.
        if let Some(r) = buffer.reuses {
            hazards[k].extend(users(r));
        }
        if !in_arena(c) {
            continue;
        }
        let (lo, hi) = (buffer.offset, buffer.offset + buffer.bytes);
        for (b, other) in buffers.iter().enumerate() {
            let overlaps = other.offset < hi && lo < other.offset + other.bytes;
            if b != c && in_arena(b) && overlaps && other.last_step < buffer.first_step {
                hazards[k].extend(users(b));
            }
        }
    }
    for (k, h) in hazards.iter_mut().enumerate() {
        h.retain(|&x| x != k);
        h.sort_unstable();
        h.dedup();
    }
    hazards
}

#[cfg(test)]
mod tests {
    use crate::fusion::fuse;
    use crate::ir::text::parse;
    use crate::schedule::{build, ScheduleOptions, Strategy};

    /// Two independent chains (matmul + tanh each) on streams 1 and 2,
    /// joined by an add on the run's own stream.
    const TWO_REGIONS: &str = r#"graph g(%x, %a, %b) {
      %x = input : f32[16,16]
      %a = input : f32[16,16]
      %b = input : f32[16,16]
      %p = matmul(%x, %a) : f32[16,16] hints={"stream": 1}
      %q = tanh(%p) : f32[16,16] hints={"stream": 1}
      %r = matmul(%x, %b) : f32[16,16] hints={"stream": 2}
      %s = tanh(%r) : f32[16,16] hints={"stream": 2}
      %t = add(%q, %s) : f32[16,16]
      return %t as t
    }"#;

    fn kernel_of(graph: &crate::ir::Graph, plan: &crate::fusion::Plan, name: &str) -> usize {
        let id = (0..graph.len())
            .map(|i| crate::ir::NodeId(i as u32))
            .find(|&id| graph.display_name(id) == name)
            .unwrap();
        plan.kernels
            .iter()
            .position(|k| k.members().contains(&id))
            .unwrap()
    }

    #[test]
    fn regions_get_their_streams_and_the_join_waits_for_both() {
        let g = parse(TWO_REGIONS).unwrap();
        let plan = fuse(&g);
        for strategy in [Strategy::Bfs, Strategy::Strict, Strategy::Dfs] {
            let options = ScheduleOptions {
                strategy,
                ..ScheduleOptions::default()
            };
            let scheduled = build(&g, &plan, &options).unwrap();
            let sp = scheduled.schedule.streams.clone().expect("streams planned");
            let k = |n: &str| kernel_of(&g, &plan, n);
            assert_eq!(sp.streams, vec![0, 1, 2]);
            assert_eq!(sp.stream_of[k("p")], 1);
            assert_eq!(sp.stream_of[k("r")], 2);
            assert_eq!(sp.stream_of[k("t")], 0);
            // The join waits for the last kernel of each region, once.
            let mut waits = sp.waits[k("t")].clone();
            waits.sort_unstable();
            let mut want = vec![k("q"), k("s")];
            want.sort_unstable();
            want.dedup();
            assert_eq!(waits, want, "{strategy}: {sp:?}");
            assert!(sp.records[k("q")] && sp.records[k("s")]);
            // The regions never wait for each other: they run at once,
            // whatever the order the kernels are queued in, and within a
            // stream nothing waits.
            for r in ["p", "q", "r", "s"] {
                assert!(sp.waits[k(r)].is_empty(), "{strategy} {r}: {sp:?}");
            }
            let text = crate::schedule::describe(&g, &plan, &scheduled.schedule, &scheduled.memory);
            assert!(text.contains("waits for"), "{text}");
        }
    }

    #[test]
    fn a_graph_without_stream_hints_has_no_stream_plan() {
        let g = parse(
            &TWO_REGIONS
                .replace(r#" hints={"stream": 1}"#, "")
                .replace(r#" hints={"stream": 2}"#, ""),
        )
        .unwrap();
        let plan = fuse(&g);
        let scheduled = build(&g, &plan, &ScheduleOptions::default()).unwrap();
        assert_eq!(scheduled.schedule.streams, None);
    }

    /// The place of a value read on stream 1 stays busy until stream 0
    /// waits for its reader (here: the run's end): a kernel of the run's
    /// stream does not take it, and so waits for nothing.
    #[test]
    fn a_place_read_on_another_stream_is_not_taken_by_stream_0() {
        let (g, plan, scheduled) = strict(
            r#"graph g(%x) {
              %x = input : f32[64,64]
              %e = exp(%x) : f32[64,64]
              %m = matmul(%e, %e) : f32[64,64] hints={"stream": 1}
              %n = neg(%x) : f32[64,64]
              %z = matmul(%n, %n) : f32[64,64]
              return %m as m, %z as z
            }"#,
        );
        let (sp, memory) = (
            scheduled.schedule.streams.clone().unwrap(),
            &scheduled.memory,
        );
        let k = |n: &str| kernel_of(&g, &plan, n);
        assert_eq!(sp.stream_of[k("m")], 1);
        assert_ne!(
            place(&g, memory, "e"),
            place(&g, memory, "n"),
            "{}",
            memory.describe(&g)
        );
        assert!(sp.waits[k("n")].is_empty(), "{sp:?}");
        assert!(sp.waits[k("z")].is_empty(), "{sp:?}");
    }

    /// A kernel on stream 1 whose output takes the arena place of a value
    /// stream 0 made and read waits for that reader, though it reads
    /// nothing of stream 0's.
    #[test]
    fn a_place_reused_across_streams_is_waited_for() {
        let (g, plan, scheduled) = strict(
            r#"graph g(%x) {
              %x = input : f32[64,64]
              %n = neg(%x) : f32[64,64]
              %z = matmul(%n, %n) : f32[64,64]
              %e = exp(%x) : f32[64,64] hints={"stream": 1}
              %m = matmul(%e, %e) : f32[64,64] hints={"stream": 1}
              return %m as m, %z as z
            }"#,
        );
        let (sp, memory) = (
            scheduled.schedule.streams.clone().unwrap(),
            &scheduled.memory,
        );
        let k = |n: &str| kernel_of(&g, &plan, n);
        // %n dies in %z's step; %e, made after it, takes its place.
        assert_eq!(
            place(&g, memory, "n"),
            place(&g, memory, "e"),
            "{}",
            memory.describe(&g)
        );
        assert_eq!(sp.stream_of[k("e")], 1);
        assert!(
            sp.waits[k("e")].contains(&k("z")),
            "k(e) = {} must wait for the reader of the place it takes: {sp:?}",
            k("e")
        );
    }

    /// A kernel of the run's stream that reads stream 1's value runs after
    /// all of stream 0's work that does not depend on it, whatever the
    /// order asked for: queued earlier, it would hold that work up until
    /// stream 1 finished.
    #[test]
    fn readers_of_another_streams_values_are_queued_after_the_rest() {
        let g = parse(
            r#"graph g(%x) {
              %x = input : f32[64,64]
              %a = matmul(%x, %x) : f32[64,64] hints={"stream": 1}
              %b = tanh(%a) : f32[64,64]
              %c = neg(%x) : f32[64,64]
              %d = matmul(%c, %c) : f32[64,64]
              %e = exp(%d) : f32[64,64]
              return %b as b, %e as e
            }"#,
        )
        .unwrap();
        let plan = fuse(&g);
        for strategy in [
            Strategy::Strict,
            Strategy::Dfs,
            Strategy::Bfs,
            Strategy::Auto,
        ] {
            let options = ScheduleOptions {
                strategy,
                ..ScheduleOptions::default()
            };
            let scheduled = build(&g, &plan, &options).unwrap();
            let order = scheduled.schedule.order();
            let at = |n: &str| {
                let k = kernel_of(&g, &plan, n);
                order.iter().position(|&o| o == k).unwrap()
            };
            let sp = scheduled.schedule.streams.clone().unwrap();
            // The tanh reading %a comes after the whole independent chain.
            assert!(
                at("b") > at("d") && at("b") > at("c"),
                "{strategy}: {order:?}\n{}",
                crate::fusion::describe(&g, &plan)
            );
            let waiting: Vec<usize> = (0..order.len())
                .filter(|&k| !sp.waits[k].is_empty())
                .collect();
            let b = kernel_of(&g, &plan, "b");
            assert!(
                waiting.iter().all(|&k| k == b || sp.stream_of[k] == 1),
                "{strategy}: only the reader of %a waits on stream 0: {sp:?}"
            );
        }
    }

    /// `text` parsed, fused and scheduled in program order.
    fn strict(
        text: &str,
    ) -> (
        crate::ir::Graph,
        crate::fusion::Plan,
        crate::schedule::Scheduled,
    ) {
        let g = parse(text).unwrap();
        let plan = fuse(&g);
        let options = ScheduleOptions {
            strategy: Strategy::Strict,
            ..ScheduleOptions::default()
        };
        let scheduled = build(&g, &plan, &options).unwrap();
        (g, plan, scheduled)
    }

    /// A value's arena place (offset, whether it escapes the arena).
    fn place(g: &crate::ir::Graph, memory: &crate::schedule::MemoryPlan, n: &str) -> (usize, bool) {
        memory
            .buffers
            .iter()
            .find(|b| b.value.is_some_and(|v| g.display_name(v) == n))
            .map(|b| (b.offset, b.escapes))
            .unwrap()
    }
}
