//! A plan's streams (`stream` hints) placed on a device's lanes: which lane
//! each kernel runs on, and which spare lanes each step may spread over.
//! It depends only on the plan and the lane count, so a [`super::Prepared`]
//! builds it at the first run with streams and keeps it (see
//! [`super::Prepared::stream_lanes`]).

use std::collections::HashMap;

use super::prepared::PreparedKernel;
use crate::ir::NodeId;
use crate::schedule::StreamPlan;

/// A run's kernels on the lanes of its streams: stream 0 on lane 0, the
/// others spread over lanes 1.. (two streams may share a lane when the
/// device has fewer; their events still order them). The lanes no stream
/// takes (`spare`) carry stream 0's share of a step of independent
/// kernels, as the lanes of a run without streams do (see
/// `super::on_streams`).
#[derive(Clone, Debug, PartialEq)]
pub(super) struct StreamLanes {
    /// The device's lane count it was made for.
    pub(super) lanes: usize,
    pub(super) lane_of: Vec<usize>,
    /// The lanes used, lane 0 first.
    pub(super) used: Vec<usize>,
    /// The device's lanes no stream takes.
    pub(super) spare: Vec<usize>,
    /// Per value, the kernel that writes it (an offload starts on its lane).
    pub(super) writer: HashMap<NodeId, usize>,
    /// Per step, how many of `spare` its stream-0 kernels spread over.
    spread: Vec<usize>,
}

impl StreamLanes {
    pub(super) fn new(
        plan: &StreamPlan,
        lanes: usize,
        kernels: &[PreparedKernel],
        steps: &[Vec<usize>],
    ) -> StreamLanes {
        let others: Vec<usize> = plan.streams.iter().copied().filter(|&s| s != 0).collect();
        let lane = |s: usize| match others.iter().position(|&o| o == s) {
            None => 0,
            Some(i) => 1 + i % (lanes - 1),
        };
        let lane_of: Vec<usize> = plan.stream_of.iter().map(|&s| lane(s)).collect();
        let mut used: Vec<usize> = lane_of.clone();
        used.push(0);
        used.sort_unstable();
        used.dedup();
        let spare: Vec<usize> = (1..lanes).filter(|l| !used.contains(l)).collect();
        let mut writer = HashMap::new();
        for (k, kernel) in kernels.iter().enumerate() {
            for &w in &kernel.writes {
                writer.insert(w, k);
            }
        }
        let spread = steps
            .iter()
            .map(|step| spread_of(plan, &lane_of, spare.len(), step))
            .collect();
        StreamLanes {
            lanes,
            lane_of,
            used,
            spare,
            writer,
            spread,
        }
    }

    /// The event slots of the spare lanes' fork (the first) and joins
    /// (one per spare lane): after the kernels' own slots.
    pub(super) fn spare_slots(&self, plan: &StreamPlan) -> std::ops::Range<usize> {
        let first = plan.stream_of.len();
        first..first + 1 + self.spare.len()
    }

    /// The spare lanes that step `s`'s stream-0 kernels spread over (none:
    /// they stay on lane 0).
    pub(super) fn spread(&self, s: usize) -> &[usize] {
        &self.spare[..self.spread[s]]
    }
}

/// How many of `spare` spare lanes `step`'s stream-0 kernels may spread
/// over: there are two or more, none waits for another stream (the plan
/// prunes a wait that an earlier kernel of the stream implies, which holds
/// only in stream 0's queue order), and no kernel of the step waits for one
/// of them (their events are recorded at the step's end).
fn spread_of(plan: &StreamPlan, lane_of: &[usize], spare: usize, step: &[usize]) -> usize {
    let on_0: Vec<usize> = step.iter().copied().filter(|&k| lane_of[k] == 0).collect();
    let independent = on_0.iter().all(|&k| plan.waits[k].is_empty())
        && step
            .iter()
            .all(|&k| plan.waits[k].iter().all(|h| !on_0.contains(h)));
    match on_0.len() > 1 && independent {
        true => spare.min(on_0.len() - 1),
        false => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Kernels 0 and 1 on stream 0 (independent), 2 on stream 1 waiting for
    /// 0, 3 on stream 0 waiting for 2.
    fn plan() -> StreamPlan {
        StreamPlan {
            stream_of: vec![0, 0, 1, 0],
            waits: vec![vec![], vec![], vec![0], vec![2]],
            records: vec![true, false, true, false],
            streams: vec![0, 1],
        }
    }

    fn kernel(writes: &[usize]) -> PreparedKernel {
        PreparedKernel {
            reads: Vec::new(),
            writes: writes.iter().map(|&w| NodeId(w as u32)).collect(),
            registers: super::super::prepared::Registers::None,
        }
    }

    #[test]
    fn lanes_and_each_steps_spread_are_derived_once_from_the_plan() {
        let kernels: Vec<PreparedKernel> = (0..4).map(|k| kernel(&[10 + k])).collect();
        let steps = vec![vec![0, 1], vec![2], vec![3], vec![1, 3]];
        let st = StreamLanes::new(&plan(), 4, &kernels, &steps);
        assert_eq!(st.lane_of, [0, 0, 1, 0]);
        assert_eq!(
            (st.used.as_slice(), st.spare.as_slice()),
            (&[0, 1][..], &[2, 3][..])
        );
        assert_eq!(st.writer[&NodeId(12)], 2);
        // Step 0: two independent stream-0 kernels → one spare lane; step
        // 1: none on stream 0; step 2: one kernel; step 3: kernel 3 waits
        // for another stream.
        assert_eq!(st.spread(0), [2]);
        for s in 1..4 {
            assert!(st.spread(s).is_empty(), "step {s}");
        }
        assert_eq!(st.spare_slots(&plan()), 4..7);
        // On two lanes nothing is spare.
        let two = StreamLanes::new(&plan(), 2, &kernels, &steps);
        assert!(two.spare.is_empty() && two.spread(0).is_empty());
    }
}
