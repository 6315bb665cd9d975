//! Activation checkpointing in eager work (PyTorch's
//! `torch.utils.checkpoint`): the ops of a region whose hints recompute
//! ([`Hint::recomputes`]: `{"recompute": true}`, the default under
//! `order: "strict"`) keep, for the backward, none of the values made
//! inside the region; the backward recomputes the ones its rules read by
//! replaying the region's recorded ops forward from what they read from
//! outside it (the region's inputs, which they keep), as AOT autograd
//! recomputes such a region in a compiled backward.
//!
//! A recorded node is its own recipe: it knows its op, and its inputs are
//! either kept values or autograd edges to the nodes that made them, so
//! a node of a recompute region keeps an input's values only when the
//! input was not made by an op of the same region (`Recompute`), and
//! never its output. In the backward, `Replays` recomputes a node's
//! output from its inputs (recursively, the region's earlier nodes first)
//! once per backward pass, and forgets it as that node's own backward
//! starts: every node that reads it comes before it in the backward's
//! order.
//!
//! What a region is: the ops made under one open `hints::scope` (they share
//! its hints, one object per scope; an op run from a graph node, by the
//! `eager` compile backend, shares its node's). A value crossing between
//! two regions — consecutive scopes, or a scope nested in another, even
//! one that only adds a `group_id` — is an input of the region that reads
//! it and is kept, like a checkpoint's inputs: each block of a stack in
//! its own scope keeps its input, and its backward recomputes only its own
//! values. A nested scope with `"recompute": false` keeps what its ops'
//! rules read, as outside any region.
//!
//! What a region keeps besides its inputs: values made by ops that record
//! nothing (their inputs do not require grad), such as a dropout mask
//! (made from the generator's seed by `rand` and compares), which the
//! replay reads as they were — so a replay draws nothing and recomputes
//! the same values; the outputs of custom functions (a compiled call, a
//! custom op), whose backward holds what it saved. In a region that also
//! offloads, what it keeps waits in host memory, as there, and comes back
//! once per backward pass (read by the replay and by the rule).
//!
//! Replays run under the backward's mode (no recording, autocast off:
//! autocast's casts are recorded ops, replayed as such) and the same
//! kernels on the same inputs, so they give the forward's values bit for
//! bit. [`replayed`] counts them on the calling thread.

use std::cell::Cell;
use std::collections::HashMap;
use std::panic::Location;
use std::sync::Arc;

use super::tape::{Backward, GradNode, Saved};
use super::{trace, Tensor};
use crate::error::{Error, ErrorKind, Result};
use crate::hints::{Hint, HintMap};
use crate::ir::BackwardReads;

/// How the backward of a node of a recompute region gets its values.
pub(crate) struct Recompute {
    /// The region's hints: its identity (one object per scope), held so
    /// that no later region can reuse its address.
    region: Arc<HintMap>,
    /// Per input: made by an op of the same region, so not kept (a
    /// stand-in with the autograd edge to its node).
    internal: Vec<bool>,
    /// What the node's rule reads.
    reads: BackwardReads,
}

impl Recompute {
    /// The recompute state of a node recording `inputs` → `out` under
    /// `hints` (the forward op's), whose rule reads `reads`: `None`
    /// outside a region that recomputes, and while tracing (a trace has no
    /// values to keep; AOT autograd recomputes the traced graph's regions).
    pub(crate) fn of(
        hints: Option<&Arc<HintMap>>,
        inputs: &[&Tensor],
        reads: &BackwardReads,
        out: &Tensor,
    ) -> Option<Recompute> {
        if out.is_traced() || trace::is_active() {
            return None;
        }
        let region = hints.filter(|h| recomputes(h))?;
        let internal = inputs.iter().map(|t| made_in(t, region)).collect();
        Some(Recompute {
            region: region.clone(),
            internal,
            reads: reads.clone(),
        })
    }

    /// Per input, whether the node keeps it: those made outside the
    /// region (the replay of the node reads all of its inputs).
    pub(crate) fn keeps(&self) -> Vec<bool> {
        self.internal.iter().map(|&i| !i).collect()
    }

    /// Whether the rule reads input `i` and the node did not keep it.
    pub(crate) fn recomputes_input(&self, i: usize) -> bool {
        self.internal[i] && self.reads.inputs[i]
    }

    /// Whether the rule reads the output (never kept).
    pub(crate) fn recomputes_output(&self) -> bool {
        self.reads.output
    }
}

/// Whether hints `map` ask the backward to recompute the region's values
/// (parsed as [`Hint::recomputes`], the rule AOT autograd follows).
fn recomputes(map: &HintMap) -> bool {
    Hint::from_map(map).is_ok_and(|(hint, _)| hint.recomputes())
}

/// Whether `t` was made by an op of `region` (a node that can replay it).
fn made_in(t: &Tensor, region: &Arc<HintMap>) -> bool {
    t.grad_fn().is_some_and(|(node, _)| {
        node.recompute
            .as_ref()
            .is_some_and(|r| Arc::ptr_eq(&r.region, region))
    })
}

thread_local! {
    static REPLAYED: Cell<usize> = const { Cell::new(0) };
}

/// How many ops backwards on this thread have replayed so far.
pub fn replayed() -> usize {
    REPLAYED.with(Cell::get)
}

/// Starts [`replayed`] again from zero.
pub fn reset_replayed() {
    REPLAYED.with(|r| r.set(0));
}

/// The outputs of recompute regions' nodes recomputed during one backward
/// pass, by node, and their kept inputs brought back from host memory.
#[derive(Default)]
pub(crate) struct Replays {
    values: HashMap<usize, Tensor>,
    /// By (node, input): read by the node's replay and by its rule, copied
    /// back once.
    from_host: HashMap<(usize, usize), Tensor>,
}

impl Replays {
    /// The output of `node` (a node of a recompute region) as its forward
    /// made it: replayed from its inputs the first time in this pass, the
    /// region's earlier nodes it needs first (without recursion: a region
    /// may be thousands of ops long).
    pub(crate) fn output(&mut self, node: &GradNode) -> Result<Tensor> {
        if let Some(t) = self.values.get(&node.id()) {
            return Ok(t.clone());
        }
        let mut stack = self.missing(node);
        while let Some(top) = stack.last().cloned() {
            let before = self.missing(&top);
            if before.is_empty() {
                stack.pop();
                if !self.values.contains_key(&top.id()) {
                    self.replay(&top)?;
                }
            } else {
                stack.extend(before);
            }
        }
        self.replay(node)
    }

    /// The nodes of `node`'s region that made its inputs and whose outputs
    /// this pass has not recomputed yet.
    fn missing(&self, node: &GradNode) -> Vec<Arc<GradNode>> {
        let Some(r) = &node.recompute else {
            return Vec::new();
        };
        node.inputs()
            .iter()
            .zip(&r.internal)
            .filter(|(_, &internal)| internal)
            .filter_map(|(t, _)| t.grad_fn().map(|(n, _)| n.clone()))
            .filter(|n| !self.values.contains_key(&n.id()))
            .collect()
    }

    /// Runs `node`'s op again on its inputs: those it kept, and those made
    /// in its region, already recomputed.
    fn replay(&mut self, node: &GradNode) -> Result<Tensor> {
        let (Backward::Op(op), Some(r)) = (&node.backward, &node.recompute) else {
            return Err(Error::op(
                ErrorKind::Verify,
                node.name(),
                "only a recorded op of a recompute region can be replayed",
            ));
        };
        if node.used_by.lock().expect("used_by lock").is_some() {
            return Err(Error::op(
                ErrorKind::Verify,
                node.name(),
                "its kept inputs were already released by a backward: it cannot be recomputed",
            ));
        }
        let saved = node.saved();
        let inputs = (0..saved.inputs.len())
            .map(|i| match r.internal[i] {
                true => {
                    let (made_by, _) = saved.inputs[i].grad_fn().expect("an edge");
                    Ok(self.values[&made_by.id()].clone())
                }
                false => self.kept_input(node, &saved, i),
            })
            .collect::<Result<Vec<_>>>()?;
        let refs: Vec<&Tensor> = inputs.iter().collect();
        let out = trace::with_origin(&node.origin, || {
            Tensor::apply(op, &refs, Location::caller())
        })?;
        REPLAYED.with(|n| n.set(n.get() + 1));
        self.values.insert(node.id(), out.clone());
        Ok(out)
    }

    /// `node`'s output, out of this pass's values as its own backward
    /// starts (every node that reads it came before, so it goes now):
    /// recomputed if no such node needed it, when its rule reads it
    /// (`read`; `None` otherwise).
    pub(crate) fn take_output(&mut self, node: &GradNode, read: bool) -> Result<Option<Tensor>> {
        let value = match read {
            true => Some(self.output(node)?),
            false => None,
        };
        self.values.remove(&node.id());
        Ok(value)
    }

    /// Input `i` that `node` keeps (`saved`: its saved values), on its
    /// device: an input of a recompute region's node that waits in host
    /// memory is copied back once per pass (its replay and its rule may
    /// both read it).
    pub(crate) fn kept_input(
        &mut self,
        node: &GradNode,
        saved: &Saved,
        i: usize,
    ) -> Result<Tensor> {
        if node.recompute.is_none() || !node.in_host_memory(i) {
            return node.kept_input(saved, i);
        }
        if let Some(t) = self.from_host.get(&(node.id(), i)) {
            return Ok(t.clone());
        }
        let back = node.kept_input(saved, i)?;
        self.from_host.insert((node.id(), i), back.clone());
        Ok(back)
    }

    /// Drops what this pass recomputed or copied back for `node` (whose
    /// backward is done) and still holds: the inputs it copied back, and
    /// its output when the backward went past it without its rule (a
    /// slice's gradient routed as a piece).
    pub(crate) fn forget(&mut self, node: &GradNode) {
        let id = node.id();
        self.values.remove(&id);
        self.from_host.retain(|&(n, _), _| n != id);
    }
}
