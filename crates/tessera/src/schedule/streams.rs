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
//! Buffers outside the arena (escaping values, the pool's) are the device
//! allocator's: while a run uses streams, it holds the blocks freed until
//! the run's end, where every stream joins the run's own (see
//! `runtime::execute`).
//!
//! Waits are pruned: a stream that already follows a kernel of another
//! stream (directly, or through a kernel it waited for) waits for no
//! earlier kernel of it. An event is recorded after a kernel only when
//! another stream waits for it ([`StreamPlan::records`]).

use super::buffers::BufferModel;
use super::hinted::Hints;
use super::memory::MemoryPlan;
use super::Schedule;

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

    /// A kernel on the run's stream whose output reuses the arena place of
    /// a value read on stream 1 waits for that reader, though it reads
    /// nothing of stream 1.
    #[test]
    fn a_place_reused_across_streams_is_waited_for() {
        let g = parse(
            r#"graph g(%x) {
              %x = input : f32[64,64]
              %e = exp(%x) : f32[64,64]
              %m = matmul(%e, %e) : f32[64,64] hints={"stream": 1}
              %n = neg(%x) : f32[64,64]
              %z = matmul(%n, %n) : f32[64,64]
              return %m as m, %z as z
            }"#,
        )
        .unwrap();
        let plan = fuse(&g);
        let options = ScheduleOptions {
            strategy: Strategy::Strict,
            ..ScheduleOptions::default()
        };
        let scheduled = build(&g, &plan, &options).unwrap();
        let sp = scheduled.schedule.streams.clone().unwrap();
        let memory = &scheduled.memory;
        let k = |n: &str| kernel_of(&g, &plan, n);
        let place = |n: &str| {
            memory
                .buffers
                .iter()
                .find(|b| b.value.is_some_and(|v| g.display_name(v) == n))
                .map(|b| (b.offset, b.escapes))
                .unwrap()
        };
        // %e (read by the stream-1 matmul) dies there; %n takes its place.
        assert_eq!(place("e"), place("n"), "{}", memory.describe(&g));
        assert_eq!(sp.stream_of[k("m")], 1);
        assert!(
            sp.waits[k("n")].contains(&k("m")),
            "k(n) = {} must wait for the reader of the place it takes: {sp:?}",
            k("n")
        );
    }
}
