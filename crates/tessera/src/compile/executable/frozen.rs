//! Values computed from frozen tensors alone, computed once.
//!
//! A forward-only executable (nothing requires grad: inference) reads the
//! tensors its trace lifted (parameters, buffers) as inputs. What it
//! computes from them alone — a batch norm folded into its convolution's
//! weights and bias (`passes::conv_epilogue`), a weight transposed or cast
//! — is the same on every call while they are the same tensors. [`split`]
//! cuts such values out of the forward graph into a prologue graph whose
//! outputs the forward takes as extra inputs; [`Frozen::values`] runs the
//! prologue at the first call and again only when one of the tensors it
//! reads is another one (a parameter set to a new value). Tensors are
//! immutable, and the cache holds the ones it was computed from, so their
//! buffers can be neither reused nor written over (donation needs the only
//! handle) while it does: the same buffer and layout mean the same values.
//! The cost is memory: the folded weights stay alive between calls (as in
//! an inference engine that folds at load time), and a replaced
//! parameter's old value until the next call refolds.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use super::Program;
use crate::error::Result;
use crate::ir::extract::extract;
use crate::ir::{Graph, NodeId, Op};
use crate::logging::log;
use crate::runtime::device::{self, with_device};
use crate::tensor::Tensor;

/// A forward graph cut in two by [`split`].
pub(super) struct Split {
    /// Computes the frozen values (its outputs) from the inputs `reads`.
    pub prologue: Graph,
    /// The positions of the forward graph's inputs the prologue reads.
    pub reads: Vec<usize>,
    /// The forward graph taking the prologue's outputs as inputs after its
    /// own.
    pub main: Graph,
}

/// Cuts out of `graph` the values computed from its inputs at `frozen`
/// (and constants) alone that the rest of it reads; `None` where there is
/// no such value beyond views (a reshaped weight costs nothing to keep).
/// Random and custom ops stay: they may draw or act on each call.
pub(super) fn split(graph: &Graph, frozen: &[usize]) -> Result<Option<Split>> {
    let n = graph.len();
    // Frozen: a frozen input, a constant, or computed from frozen values.
    let mut is_frozen = vec![false; n];
    let mut computed = vec![false; n];
    for &i in frozen {
        is_frozen[graph.inputs[i].index()] = true;
    }
    for (i, node) in graph.nodes.iter().enumerate() {
        // A value of symbolic shape (a causal mask of `[s0,s0]`) depends
        // on the call's sizes: the prologue, run once, has none to bind.
        if !node.ty.shape.dims().iter().all(|d| d.is_const()) {
            continue;
        }
        match &node.op {
            Op::Constant(_) | Op::Full { .. } | Op::Arange { .. } => is_frozen[i] = true,
            op if hoistable(op) && !node.inputs.is_empty() => {
                computed[i] = node.inputs.iter().all(|x| is_frozen[x.index()]);
                is_frozen[i] |= computed[i];
            }
            _ => {}
        }
    }
    // The computed values read by what is not frozen, or returned.
    let mut frontier: Vec<NodeId> = Vec::new();
    let readers = graph
        .nodes
        .iter()
        .enumerate()
        .filter(|(i, _)| !is_frozen[*i])
        .flat_map(|(_, node)| node.inputs.iter().copied());
    for id in readers.chain(graph.outputs.iter().map(|o| o.node)) {
        if computed[id.index()] && !frontier.contains(&id) && computes(graph, id, &computed) {
            frontier.push(id);
        }
    }
    if frontier.is_empty() {
        return Ok(None);
    }
    let reads: Vec<usize> = (0..graph.inputs.len())
        .filter(|&i| frozen.contains(&i) && feeds(graph, graph.inputs[i], &frontier))
        .collect();
    let named = |id: NodeId| (graph.display_name(id), id);
    let prologue_inputs: Vec<(String, NodeId)> =
        reads.iter().map(|&i| named(graph.inputs[i])).collect();
    let values: Vec<(String, NodeId)> = frontier
        .iter()
        .enumerate()
        .map(|(k, &id)| (format!("frozen{k}"), id))
        .collect();
    let prologue = extract(
        graph,
        &format!("{}_frozen", graph.name),
        &prologue_inputs,
        &values,
    )?;
    let mut main_inputs: Vec<(String, NodeId)> = graph.inputs.iter().map(|&id| named(id)).collect();
    main_inputs.extend(values);
    let outputs: Vec<(String, NodeId)> = graph
        .outputs
        .iter()
        .map(|o| (o.name.clone(), o.node))
        .collect();
    let main = extract(graph, &graph.name, &main_inputs, &outputs)?;
    Ok(Some(Split {
        prologue,
        reads,
        main,
    }))
}

/// Ops whose result depends on their operands alone.
fn hoistable(op: &Op) -> bool {
    !matches!(
        op,
        Op::Input | Op::Rand { .. } | Op::Randn { .. } | Op::Custom(_) | Op::CustomOutput { .. }
    )
}

/// Ops that only view their operand (no work to save).
fn is_view(op: &Op) -> bool {
    matches!(
        op,
        Op::Reshape(_) | Op::Permute(_) | Op::Expand(_) | Op::Slice { .. }
    )
}

/// Whether computing `id` takes any op beyond views (walking back through
/// computed values).
fn computes(graph: &Graph, id: NodeId, computed: &[bool]) -> bool {
    let mut stack = vec![id];
    while let Some(v) = stack.pop() {
        if !computed[v.index()] {
            continue;
        }
        let node = graph.node(v);
        if !is_view(&node.op) {
            return true;
        }
        stack.extend(node.inputs.iter().copied());
    }
    false
}

/// Whether `input` is among what `values` are computed from.
fn feeds(graph: &Graph, input: NodeId, values: &[NodeId]) -> bool {
    let mut seen = vec![false; graph.len()];
    let mut stack = values.to_vec();
    while let Some(v) = stack.pop() {
        if v == input {
            return true;
        }
        if !std::mem::replace(&mut seen[v.index()], true) {
            stack.extend(graph.node(v).inputs.iter().copied());
        }
    }
    false
}

/// The prologue of a split executable and its last results.
pub(super) struct Frozen {
    program: Program,
    /// The positions of the executable's arguments it reads.
    reads: Vec<usize>,
    cache: Mutex<Option<Cached>>,
    /// Times the prologue ran.
    computes: AtomicUsize,
}

struct Cached {
    /// The tensors the values were computed from (held: see the module
    /// doc).
    from: Vec<Tensor>,
    values: Vec<Tensor>,
}

impl Frozen {
    pub(super) fn new(program: Program, reads: Vec<usize>) -> Frozen {
        Frozen {
            program,
            reads,
            cache: Mutex::new(None),
            computes: AtomicUsize::new(0),
        }
    }

    /// The frozen values for the executable's arguments `args`: the cached
    /// ones while the tensors read are the same, else computed now.
    pub(super) fn values(&self, args: &[Tensor]) -> Result<Vec<Tensor>> {
        let from: Vec<Tensor> = self.reads.iter().map(|&i| args[i].clone()).collect();
        // The forward's device: a prologue that reads no input (a causal
        // mask made of constants) would otherwise make its values on the
        // host, beside device inputs.
        let device = device::of_inputs(&self.program.graph.name, &args.iter().collect::<Vec<_>>())?;
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = cache.as_ref() {
            let fresh =
                c.from.len() == from.len() && c.from.iter().zip(&from).all(|(a, b)| same(a, b));
            if fresh && c.values.iter().all(|v| v.device() == device) {
                return Ok(c.values.clone());
            }
        }
        // The old values go before the new ones are made.
        *cache = None;
        let values = with_device(device, || self.program.run(from.clone()))?
            .into_iter()
            .map(|v| v.to(device))
            .collect::<Result<Vec<_>>>()?;
        let runs = self.computes.fetch_add(1, Ordering::Relaxed) + 1;
        log("fusion", || {
            let bytes: usize = values
                .iter()
                .map(|v| v.numel() * v.dtype().size_bytes())
                .sum();
            format!(
                "graph `{}`: {} values computed from {} frozen tensors (run {runs}), \
                 kept until one of them changes ({bytes} bytes)",
                self.program.graph.name,
                values.len(),
                from.len()
            )
        });
        *cache = Some(Cached {
            from,
            values: values.clone(),
        });
        Ok(values)
    }

    pub(super) fn computes(&self) -> usize {
        self.computes.load(Ordering::Relaxed)
    }

    pub(super) fn artifacts(&self) -> Vec<(String, String)> {
        self.program.artifacts("frozen")
    }
}

/// Whether `a` and `b` are the same values: one buffer read through one
/// layout (a traced tensor has no buffer: never the same).
fn same(a: &Tensor, b: &Tensor) -> bool {
    a.shares_storage(b) && a.layout() == b.layout() && a.dtype() == b.dtype()
}

#[cfg(test)]
mod tests {
    use super::split;
    use crate::ir::text::parse;

    const FOLDED: &str = "graph g(%x, %w, %s, %seed) {
      %x = input : f32[2,4]
      %w = input : f32[4,3]
      %s = input : f32[3]
      %seed = input : i64[]
      %eps = full {value=1e-5, shape=[], dtype=f32} : f32[]
      %a = add(%s, %eps) : f32[3]
      %r = rsqrt(%a) : f32[3]
      %r2 = reshape(%r) {shape=[1,3]} : f32[1,3]
      %ws = mul(%w, %r2) : f32[4,3]
      %wt = permute(%w) {perm=[1,0]} : f32[3,4]
      %y = matmul(%x, %ws) : f32[2,3]
      %z = matmul(%y, %wt) : f32[2,4]
      return %z as z
    }";

    #[test]
    fn the_values_of_frozen_inputs_alone_move_to_the_prologue() {
        let g = parse(FOLDED).unwrap();
        let s = split(&g, &[1, 2]).unwrap().expect("a frozen value");
        assert_eq!(s.reads, vec![1, 2]);
        let pro = s.prologue.to_string();
        assert!(pro.contains("= rsqrt(") && pro.contains("= mul("), "{pro}");
        assert_eq!(s.prologue.outputs.len(), 1, "the scaled weight only: {pro}");
        let main = s.main.to_string();
        assert!(
            !main.contains("= rsqrt(") && !main.contains("= mul("),
            "{main}"
        );
        // The transposed weight is a view: it stays, reading %w.
        assert!(main.contains("permute(%w)"), "{main}");
        assert!(main.contains("matmul(%x"), "{main}");
        assert_eq!(s.main.inputs.len(), 5, "its own four and the frozen value");
    }

    #[test]
    fn values_of_symbolic_shape_stay_in_the_main_graph() {
        let g = parse(
            "graph masked(%x) {
      %x = input : f32[s0,s0]
      %ones = full {value=1.0, shape=[s0,s0], dtype=f32} : f32[s0,s0]
      %mask = tril(%ones) {diagonal=0} : f32[s0,s0]
      %y = mul(%x, %mask) : f32[s0,s0]
      return %y as y
    }",
        )
        .unwrap();
        assert!(split(&g, &[]).unwrap().is_none(), "the mask needs s0");
    }

    #[test]
    fn nothing_moves_without_frozen_inputs_or_beyond_views() {
        let g = parse(FOLDED).unwrap();
        assert!(split(&g, &[]).unwrap().is_none());
        // %w alone: only its view (the permute) is frozen.
        assert!(split(&g, &[1]).unwrap().is_none());
        // Everything frozen: the output itself is a frozen value.
        let s = split(&g, &[0, 1, 2]).unwrap().unwrap();
        assert!(!s.main.to_string().contains("matmul("), "{}", s.main);
        assert_eq!(s.prologue.outputs.len(), 1);
    }
}
