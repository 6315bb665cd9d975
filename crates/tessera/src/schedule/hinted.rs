//! The hints of each kernel, read from its nodes' `meta.hints`, and the
//! regions and groups they form.
//!
//! A kernel's hints are its nodes' hints merged. Fusion never mixes nodes of
//! different hints, but a plan made otherwise may: then a key on which the
//! nodes disagree is dropped for the kernel (and logged), a key only some
//! nodes set is taken by the whole kernel.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use super::kernels::KernelGraph;
use super::Strategy;
use crate::fusion::Plan;
use crate::hints::{Hint, HintMap};
use crate::ir::Graph;

/// What the hints ask of one kernel.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct KernelHint {
    pub order: Option<Strategy>,
    pub group: Option<i64>,
    pub budget: Option<usize>,
    /// At most this many of the region's kernels in one step.
    pub max_width: Option<usize>,
    /// The kernel's region: kernels with the same hints form one.
    pub region: Option<usize>,
    /// The stream its region asks for (`schedule::streams`).
    pub stream: Option<usize>,
}

pub(crate) struct Hints {
    pub kernels: Vec<KernelHint>,
    /// Per region, its hints (JSON) for messages.
    pub regions: Vec<String>,
    /// Per group id, its kernels in program order.
    pub groups: BTreeMap<i64, Vec<usize>>,
    /// Hints not honoured, and why.
    pub notes: Vec<String>,
}

impl Hints {
    pub fn read(graph: &Graph, plan: &Plan, kg: &KernelGraph) -> Hints {
        let mut notes = Vec::new();
        let mut regions: Vec<String> = Vec::new();
        let mut region_of: HashMap<String, usize> = HashMap::new();
        let mut kernels = Vec::with_capacity(plan.kernels.len());
        let mut groups: BTreeMap<i64, Vec<usize>> = BTreeMap::new();
        let mut unknown: BTreeSet<String> = BTreeSet::new();
        for k in 0..plan.kernels.len() {
            let hint = kernel_hint(graph, plan, k, &mut notes, &mut unknown);
            let region = (!hint.is_empty()).then(|| {
                let json = hint.to_json();
                *region_of.entry(json.clone()).or_insert_with(|| {
                    regions.push(json);
                    regions.len() - 1
                })
            });
            if let Some(g) = hint.group_id {
                groups.entry(g).or_default().push(k);
            }
            kernels.push(KernelHint {
                order: hint.order,
                group: hint.group_id,
                budget: hint.memory_budget_bytes(),
                max_width: hint.max_width,
                region,
                stream: hint.stream.map(|n| n as usize),
            });
        }
        notes.extend(unknown);
        let mut hints = Hints {
            kernels,
            regions,
            groups,
            notes,
        };
        hints.drop_non_convex_groups(graph, plan, kg);
        hints
    }

    /// A group that some outside kernel runs between (it reads one member
    /// and another member reads it) cannot be one block: its `group_id` is
    /// not honoured.
    fn drop_non_convex_groups(&mut self, graph: &Graph, plan: &Plan, kg: &KernelGraph) {
        let mut dropped = Vec::new();
        for (&g, members) in &self.groups {
            if let Some((outside, from)) = between(kg, members) {
                self.notes.push(format!(
                    "group_id {g} not honoured: kernel k{outside} ({}) is outside the group but reads kernel k{from} of it and is read by the group",
                    super::kernel_label(graph, plan, outside)
                ));
                dropped.push(g);
            }
        }
        for g in dropped {
            for &k in &self.groups[&g] {
                self.kernels[k].group = None;
            }
            self.groups.remove(&g);
        }
    }
}

/// An outside kernel on a path from a member to a member, with the member
/// it descends from.
fn between(kg: &KernelGraph, members: &[usize]) -> Option<(usize, usize)> {
    let n = kg.len();
    let mut inside = vec![false; n];
    for &m in members {
        inside[m] = true;
    }
    // Outside kernels reachable from a member, with that member.
    let mut from: Vec<Option<usize>> = vec![None; n];
    let mut stack: Vec<(usize, usize)> = Vec::new();
    for &m in members {
        for &c in &kg.consumers[m] {
            stack.push((c, m));
        }
    }
    while let Some((k, m)) = stack.pop() {
        if inside[k] || from[k].is_some() {
            continue;
        }
        from[k] = Some(m);
        stack.extend(kg.consumers[k].iter().map(|&c| (c, m)));
    }
    members.iter().find_map(|&m| {
        kg.producers[m]
            .iter()
            .find_map(|&p| from[p].map(|origin| (p, origin)))
    })
}

/// Kernel `k`'s hints; conflicts and bad hints go to `notes`, unknown keys
/// (one note per key for the whole graph) to `unknown`.
fn kernel_hint(
    graph: &Graph,
    plan: &Plan,
    k: usize,
    notes: &mut Vec<String>,
    unknown: &mut BTreeSet<String>,
) -> Hint {
    let mut merged = HintMap::new();
    let mut conflicts: Vec<String> = Vec::new();
    for &m in plan.kernels[k].members() {
        let Some(map) = &graph.node(m).meta.hints else {
            continue;
        };
        for (key, value) in map.iter() {
            match merged.get(key) {
                Some(v) if v != value => {
                    if !conflicts.contains(key) {
                        conflicts.push(key.clone());
                    }
                }
                _ => {
                    merged.insert(key.clone(), value.clone());
                }
            }
        }
    }
    for key in &conflicts {
        merged.remove(key);
        notes.push(format!(
            "hint \"{key}\" of kernel k{k} ({}) not honoured: the kernel was fused from nodes whose \"{key}\" differ",
            super::kernel_label(graph, plan, k)
        ));
    }
    match Hint::from_map(&merged) {
        Ok((hint, warnings)) => {
            unknown.extend(warnings);
            hint
        }
        Err(e) => {
            notes.push(format!(
                "hints of kernel k{k} ({}) not honoured: {e}",
                super::kernel_label(graph, plan, k)
            ));
            Hint::default()
        }
    }
}
