//! The list scheduler: builds the steps of one candidate order.
//!
//! A kernel is *eligible* when its producers are done, it is the next of
//! its region's order (a strict or dfs region is a chain: program order or
//! dfs order restricted to the region) and its group allows it (a group
//! runs as one block: it starts once everything its members read from
//! outside is done, and nothing else runs until it is finished). Each step
//! then takes, under the `Bfs` base, every eligible kernel; under a
//! sequential base, the best eligible kernel by the base's rank (program
//! order, dfs order, or least memory added) — with the other eligible
//! kernels of its region when that region is hinted `bfs`.
//!
//! A region hinted `max_width: K` has at most K kernels in a step: of its
//! eligible kernels a step takes the K first in dfs order, so the chains it
//! started are continued before new ones start — at most K independent
//! chains in flight (K = 1: the region in dfs order; K at least the
//! region's widest level: bfs).
//!
//! Constraints can conflict (two regions whose orders cross, a group that
//! waits for work that waits for it): when no kernel is eligible, the
//! constraint that blocks the first ready kernel is dropped, with a note.

use std::collections::BTreeMap;

use super::buffers::BufferModel;
use super::hinted::Hints;
use super::kernels::KernelGraph;
use super::Strategy;

/// How the kernels without an order hint are ordered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Base {
    Bfs,
    Dfs,
    Strict,
    /// One kernel at a time, the one that adds the fewest live bytes
    /// (ties in program order), as tract's memory-minimising order.
    Greedy,
}

impl Base {
    pub fn name(self) -> &'static str {
        match self {
            Base::Bfs => "bfs",
            Base::Dfs => "dfs",
            Base::Strict => "strict",
            Base::Greedy => "greedy",
        }
    }
}

/// Everything a candidate order is built from.
pub(crate) struct Inputs<'a> {
    pub kg: &'a KernelGraph,
    pub hints: &'a Hints,
    pub model: &'a BufferModel,
    /// Per region, how its kernels are ordered (`None`: by the base).
    pub region_order: &'a [Option<Strategy>],
}

/// The steps of `inputs` under `base`, and the hints not honoured.
pub(crate) fn schedule(inputs: &Inputs<'_>, base: Base) -> (Vec<Vec<usize>>, Vec<String>) {
    let mut state = State::new(inputs);
    let mut steps = Vec::new();
    while state.left > 0 {
        let eligible: Vec<usize> = (0..inputs.kg.len())
            .filter(|&k| state.eligible(k))
            .collect();
        if eligible.is_empty() {
            state.relax_for_first_ready();
            continue;
        }
        let picked = state.pick(eligible, base);
        let step = state.limit_width(picked);
        state.finish(&step);
        steps.push(step);
    }
    (steps, state.notes)
}

struct State<'a> {
    inputs: &'a Inputs<'a>,
    left: usize,
    done: Vec<bool>,
    /// Per kernel, producers not done yet.
    waiting: Vec<usize>,
    /// Per region, its chain (strict or dfs) if it has one and it holds.
    chains: Vec<Option<Vec<usize>>>,
    chain_pos: Vec<usize>,
    group_of: Vec<Option<i64>>,
    group_left: BTreeMap<i64, usize>,
    active: Option<i64>,
    /// Per buffer, readers not done yet (for the greedy base).
    readers_left: Vec<usize>,
    notes: Vec<String>,
}

impl<'a> State<'a> {
    fn new(inputs: &'a Inputs<'a>) -> State<'a> {
        let kg = inputs.kg;
        let n = kg.len();
        let mut chains: Vec<Option<Vec<usize>>> = vec![None; inputs.region_order.len()];
        for (r, order) in inputs.region_order.iter().enumerate() {
            let members = || (0..n).filter(move |&k| inputs.hints.kernels[k].region == Some(r));
            chains[r] = match order {
                Some(Strategy::Strict) => Some(members().collect()),
                Some(Strategy::Dfs) => {
                    let mut m: Vec<usize> = members().collect();
                    m.sort_by_key(|&k| kg.dfs_rank[k]);
                    Some(m)
                }
                _ => None,
            };
        }
        let group_of: Vec<Option<i64>> = inputs.hints.kernels.iter().map(|h| h.group).collect();
        State {
            inputs,
            left: n,
            done: vec![false; n],
            waiting: kg.producers.iter().map(Vec::len).collect(),
            chain_pos: vec![0; chains.len()],
            chains,
            group_left: inputs
                .hints
                .groups
                .iter()
                .map(|(&g, m)| (g, m.len()))
                .collect(),
            group_of,
            active: None,
            readers_left: inputs
                .model
                .buffers
                .iter()
                .map(|b| b.readers.len())
                .collect(),
            notes: Vec::new(),
        }
    }

    fn ready(&self, k: usize) -> bool {
        !self.done[k] && self.waiting[k] == 0
    }

    fn eligible(&self, k: usize) -> bool {
        self.ready(k) && self.chain_allows(k) && self.group_allows(k)
    }

    /// The region's next kernel in its chain, if the region has one.
    fn chain_head(&self, k: usize) -> Option<usize> {
        let r = self.inputs.hints.kernels[k].region?;
        let chain = self.chains[r].as_ref()?;
        chain.get(self.chain_pos[r]).copied()
    }

    fn chain_allows(&self, k: usize) -> bool {
        self.chain_head(k).is_none_or(|head| head == k)
    }

    fn group_allows(&self, k: usize) -> bool {
        match (self.group_of[k], self.active) {
            (Some(g), Some(a)) => g == a,
            (Some(g), None) => self.gate_open(g),
            (None, Some(_)) => false,
            (None, None) => true,
        }
    }

    /// Whether everything group `g`'s kernels read from outside it is done.
    fn gate_open(&self, g: i64) -> bool {
        self.inputs.hints.groups[&g].iter().all(|&m| {
            self.inputs.kg.producers[m]
                .iter()
                .all(|&p| self.done[p] || self.group_of[p] == Some(g))
        })
    }

    fn pick(&mut self, mut eligible: Vec<usize>, base: Base) -> Vec<usize> {
        if base == Base::Bfs {
            if self.active.is_none() {
                // A group starts as soon as it can, alone.
                if let Some(g) = eligible.iter().find_map(|&k| self.group_of[k]) {
                    self.active = Some(g);
                    eligible.retain(|&k| self.group_of[k] == Some(g));
                }
            }
            return eligible;
        }
        let leader = self.leader(&eligible, base);
        if self.active.is_none() {
            self.active = self.group_of[leader];
        }
        let region = self.inputs.hints.kernels[leader].region;
        let bfs_region = region.is_some_and(|r| self.inputs.region_order[r] == Some(Strategy::Bfs));
        if !bfs_region {
            return vec![leader];
        }
        eligible.retain(|&k| {
            self.inputs.hints.kernels[k].region == region
                && self.group_of[k] == self.group_of[leader]
        });
        eligible
    }

    /// `step` with at most `max_width` kernels of each region that has
    /// one: those first in dfs order (never empty when `step` is not).
    fn limit_width(&self, step: Vec<usize>) -> Vec<usize> {
        let hints = &self.inputs.hints.kernels;
        if step.iter().all(|&k| hints[k].max_width.is_none()) {
            return step;
        }
        let mut by_rank = step.clone();
        by_rank.sort_by_key(|&k| self.inputs.kg.dfs_rank[k]);
        let mut taken: BTreeMap<usize, usize> = BTreeMap::new();
        let mut keep = vec![false; self.inputs.kg.len()];
        for k in by_rank {
            match (hints[k].region, hints[k].max_width) {
                (Some(r), Some(width)) => {
                    let n = taken.entry(r).or_insert(0);
                    if *n < width {
                        *n += 1;
                        keep[k] = true;
                    }
                }
                _ => keep[k] = true,
            }
        }
        step.into_iter().filter(|&k| keep[k]).collect()
    }

    fn leader(&self, eligible: &[usize], base: Base) -> usize {
        let kg = self.inputs.kg;
        let first = |key: &dyn Fn(usize) -> (isize, usize)| {
            *eligible
                .iter()
                .min_by_key(|&&k| key(k))
                .expect("eligible is not empty")
        };
        match base {
            Base::Strict | Base::Bfs => first(&|k| (0, k)),
            Base::Dfs => first(&|k| (0, kg.dfs_rank[k])),
            Base::Greedy => first(&|k| (self.added_bytes(k), k)),
        }
    }

    /// Bytes live after running `k` minus bytes live before.
    fn added_bytes(&self, k: usize) -> isize {
        let model = self.inputs.model;
        let mut added = 0isize;
        for &b in &model.created[k] {
            let buffer = &model.buffers[b];
            if buffer.value.is_some() && (buffer.pinned || !buffer.readers.is_empty()) {
                added += buffer.bytes as isize;
            }
        }
        for &b in &model.read[k] {
            let buffer = &model.buffers[b];
            if !buffer.pinned && self.readers_left[b] == 1 {
                added -= buffer.bytes as isize;
            }
        }
        added
    }

    fn finish(&mut self, step: &[usize]) {
        for &k in step {
            self.done[k] = true;
            self.left -= 1;
            for &c in &self.inputs.kg.consumers[k] {
                self.waiting[c] -= 1;
            }
            for &b in &self.inputs.model.read[k] {
                self.readers_left[b] -= 1;
            }
            if let Some(r) = self.inputs.hints.kernels[k].region {
                if self.chains[r].is_some() {
                    self.chain_pos[r] += 1;
                }
            }
            if let Some(g) = self.group_of[k] {
                let left = self.group_left.get_mut(&g).expect("a known group");
                *left -= 1;
                if *left == 0 && self.active == Some(g) {
                    self.active = None;
                }
            }
        }
    }

    /// No kernel is eligible: drops the constraint that blocks the first
    /// ready kernel (there is one: the kernel graph is acyclic).
    fn relax_for_first_ready(&mut self) {
        let r = (0..self.inputs.kg.len())
            .find(|&k| self.ready(k))
            .expect("an unfinished acyclic graph has a ready kernel");
        if let Some(head) = self.chain_head(r).filter(|&h| h != r) {
            let region = self.inputs.hints.kernels[r]
                .region
                .expect("a chained kernel has a region");
            self.notes.push(format!(
                "order of hints {} not honoured from kernel k{r} on: the next kernel in that order, k{head}, waits for kernels that wait for this region (conflicting hints)",
                self.inputs.hints.regions[region]
            ));
            self.chains[region] = None;
            return;
        }
        let stuck = self
            .active
            .or(self.group_of[r])
            .expect("a group blocks the kernel");
        self.notes.push(format!(
            "group_id {stuck} not run as one block: kernel k{r} is ready, but the group waits for kernels outside it that wait for it"
        ));
        for g in self.group_of.iter_mut().filter(|g| **g == Some(stuck)) {
            *g = None;
        }
        if self.active == Some(stuck) {
            self.active = None;
        }
    }
}
