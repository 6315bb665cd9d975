//! Runs a graph node by node, on its inputs' device.
//!
//! Each node goes through [`Tensor::apply`], the path eager mode takes, so
//! the interpreter computes exactly what eager execution would: it is the
//! reference that compiled executables are checked against. It belongs to
//! the tensor layer, since it only runs `Tensor::apply`: a graph break runs
//! the pending part of a trace with it (`trace`), and ahead-of-time
//! autograd traces its joint graph through it.
//!
//! Symbolic dims (`s0`) get their values from the concrete input shapes;
//! ops whose attributes hold a symbolic shape (`reshape`, `expand`, `full`,
//! `rand`, `randn`) run with that shape evaluated. Each intermediate is
//! dropped right after its last reader, so memory holds only live values.

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::panic::Location;
use std::sync::Arc;

use super::{custom, offload, trace, Tensor};
use crate::error::{Error, ErrorKind, Result};
use crate::ir::custom::CustomCall;
use crate::ir::{Dim, EvalError, Graph, NodeId, Op, Shape};
use crate::runtime::device::{self, Device};

/// The value of each symbol, bound from the inputs' shapes.
pub type Symbols = HashMap<Arc<str>, usize>;

/// Runs `graph` on `inputs` (one per `graph.inputs`, in that order) and
/// returns its named outputs. The graph is verified first; each input is
/// checked against its declared type (see [`bind_symbols`]).
pub fn run_graph(graph: &Graph, inputs: &[Tensor]) -> Result<Vec<(String, Tensor)>> {
    run_graph_moving(graph, inputs, &HostMoves::default())
}

/// Values a run moves between device and host memory, by position: the
/// outputs it puts in host memory after their last use in the graph (a
/// forward's saved values), and the inputs that arrive there, each
/// brought back to the device before its first use (a backward's).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HostMoves {
    pub offload_outputs: Vec<usize>,
    pub prefetch_inputs: Vec<usize>,
}

/// [`run_graph`] with `moves` made (through [`super::offload`]).
pub fn run_graph_moving(
    graph: &Graph,
    inputs: &[Tensor],
    moves: &HostMoves,
) -> Result<Vec<(String, Tensor)>> {
    graph.verify()?;
    let given: Vec<Option<&Tensor>> = inputs.iter().map(Some).collect();
    let symbols = bind_symbols(graph, &given)?;
    // Nodes without inputs (full, arange …) and random ops with a host
    // seed run on the inputs' device; inputs waiting in host memory come
    // to it.
    let refs: Vec<&Tensor> = inputs
        .iter()
        .enumerate()
        .filter(|(i, _)| !moves.prefetch_inputs.contains(i))
        .map(|(_, t)| t)
        .collect();
    let on = inputs_device(graph, &refs)?;
    device::with_device(on, || {
        run_nodes(graph, inputs, &symbols, &Moving::new(graph, moves, on))
    })
}

/// [`HostMoves`] by node: the values offloaded after each node (their last
/// reader, or themselves when none reads them), and the inputs that come
/// back.
struct Moving {
    on: Device,
    offload_after: HashMap<usize, Vec<NodeId>>,
    prefetch: HashSet<NodeId>,
}

impl Moving {
    fn new(graph: &Graph, moves: &HostMoves, on: Device) -> Moving {
        let mut last: HashMap<NodeId, usize> = moves
            .offload_outputs
            .iter()
            .filter_map(|&o| graph.outputs.get(o))
            .map(|out| (out.node, out.node.index()))
            .collect();
        for (i, node) in graph.nodes.iter().enumerate() {
            for x in &node.inputs {
                if let Some(at) = last.get_mut(x) {
                    *at = i;
                }
            }
        }
        let mut offload_after: HashMap<usize, Vec<NodeId>> = HashMap::new();
        for (value, at) in last {
            offload_after.entry(at).or_default().push(value);
        }
        let prefetch = moves
            .prefetch_inputs
            .iter()
            .filter_map(|&i| graph.inputs.get(i).copied())
            .collect();
        Moving {
            on,
            offload_after,
            prefetch,
        }
    }

    /// Brings `node`'s inputs that wait in host memory back to the device.
    fn before(
        &self,
        graph: &Graph,
        id: NodeId,
        values: &mut [Option<Tensor>],
        back: &mut HashSet<NodeId>,
    ) -> Result<()> {
        for x in &graph.node(id).inputs {
            if self.prefetch.contains(x) && back.insert(*x) {
                let slot = &mut values[x.index()];
                let host = slot.as_ref().expect("live until its last use");
                *slot =
                    Some(offload::to_device(host, self.on).map_err(|e| node_error(graph, id, e))?);
            }
        }
        Ok(())
    }

    /// Puts the values whose last use was node `i` in host memory.
    fn after(&self, graph: &Graph, i: usize, values: &mut [Option<Tensor>]) -> Result<()> {
        for &x in self.offload_after.get(&i).into_iter().flatten() {
            let slot = &mut values[x.index()];
            if let Some(t) = slot.as_ref() {
                *slot = Some(offload::to_host(t, self.on).map_err(|e| node_error(graph, x, e))?);
            }
        }
        Ok(())
    }
}

/// The device of a program's inputs (scalars on the host go with any);
/// inputs on different devices are an error naming the program.
pub(crate) fn inputs_device(graph: &Graph, inputs: &[&Tensor]) -> Result<Device> {
    device::of_inputs("input", inputs)
        .map_err(|e| Error::new(e.kind, format!("graph `{}`: {}", graph.name, e.message)))
}

fn run_nodes(
    graph: &Graph,
    inputs: &[Tensor],
    symbols: &Symbols,
    moving: &Moving,
) -> Result<Vec<(String, Tensor)>> {
    let last_use = last_uses(graph);
    let mut values: Vec<Option<Tensor>> = vec![None; graph.len()];
    for (&id, t) in graph.inputs.iter().zip(inputs) {
        values[id.index()] = Some(t.clone());
    }
    // Outputs after the first of custom ops, until their `custom_output`
    // node takes them.
    let mut custom_outputs: HashMap<(NodeId, usize), Tensor> = HashMap::new();
    let mut back = HashSet::new();
    for (i, node) in graph.nodes.iter().enumerate() {
        let id = NodeId(i as u32);
        moving.before(graph, id, &mut values, &mut back)?;
        match &node.op {
            Op::Input => {}
            Op::Custom(call) => {
                let outs = eval_custom(graph, id, call, &values, symbols)?;
                let mut outs = outs.into_iter().enumerate();
                values[i] = outs.next().map(|(_, t)| t);
                custom_outputs.extend(outs.map(|(index, t)| ((id, index), t)));
            }
            Op::CustomOutput { index, .. } => {
                let value = custom_outputs.remove(&(node.inputs[0], *index));
                values[i] = Some(value.expect("a custom op runs before its outputs are read"));
            }
            _ => values[i] = Some(eval_node(graph, id, &values, symbols)?),
        }
        for x in node.inputs.iter().copied().chain([id]) {
            if last_use[x.index()] == i {
                values[x.index()] = None;
            }
        }
        moving.after(graph, i, &mut values)?;
    }
    Ok(graph
        .outputs
        .iter()
        .map(|out| {
            let t = values[out.node.index()].clone();
            (out.name.clone(), t.expect("outputs are never freed"))
        })
        .collect())
}

/// Orders `named` inputs as `graph.inputs` for [`run_graph`]. Errors on an
/// unknown, missing or repeated name, listing the graph's inputs.
pub fn inputs_by_name(graph: &Graph, named: Vec<(String, Tensor)>) -> Result<Vec<Tensor>> {
    let arg_err = |msg: String| {
        Error::new(
            ErrorKind::Argument,
            format!("{msg}; the graph's inputs are {}", describe_inputs(graph)),
        )
    };
    let mut by_name: HashMap<String, Tensor> = HashMap::new();
    for (name, t) in named {
        if !graph
            .inputs
            .iter()
            .any(|&id| graph.display_name(id) == name)
        {
            return Err(arg_err(format!("unknown input `{name}`")));
        }
        if by_name.insert(name.clone(), t).is_some() {
            return Err(arg_err(format!("input `{name}` is given twice")));
        }
    }
    graph
        .inputs
        .iter()
        .map(|&id| {
            let name = graph.display_name(id);
            by_name
                .remove(&name)
                .ok_or_else(|| arg_err(format!("missing input `{name}`")))
        })
        .collect()
}

/// Checks the given inputs (`None`: not given, e.g. to be generated later)
/// against their declared types and returns the symbols their shapes bind.
///
/// A dim declared as a plain symbol binds it; every other dim must then
/// equal its declared value. Errors name the input and dim:
/// "input `x`, dim 0: expected 8, got 16".
pub fn bind_symbols(graph: &Graph, inputs: &[Option<&Tensor>]) -> Result<Symbols> {
    if inputs.len() != graph.inputs.len() {
        return Err(Error::new(
            ErrorKind::Argument,
            format!(
                "graph `{}` takes {} inputs ({}), got {}",
                graph.name,
                graph.inputs.len(),
                describe_inputs(graph),
                inputs.len()
            ),
        ));
    }
    let given: Vec<(NodeId, &Tensor)> = graph
        .inputs
        .iter()
        .zip(inputs)
        .filter_map(|(&id, t)| Some((id, (*t)?)))
        .collect();
    let mut symbols = Symbols::new();
    // Where each symbol got its value, for messages about a conflict.
    let mut origin: HashMap<Arc<str>, String> = HashMap::new();
    for &(id, t) in &given {
        check_dtype_and_rank(graph, id, t)?;
        let dims = graph.node(id).ty.shape.dims();
        for (d, (dim, &size)) in dims.iter().zip(t.shape()).enumerate() {
            if let Some(sym) = plain_symbol(dim) {
                if !symbols.contains_key(&sym) {
                    symbols.insert(sym.clone(), size);
                    origin.insert(sym, format!("input `{}`, dim {d}", graph.display_name(id)));
                }
            }
        }
    }
    for &(id, t) in &given {
        let dims = graph.node(id).ty.shape.dims();
        for (d, (dim, &size)) in dims.iter().zip(t.shape()).enumerate() {
            check_dim(graph, id, d, dim, size, &symbols, &origin)?;
        }
    }
    Ok(symbols)
}

fn check_dtype_and_rank(graph: &Graph, id: NodeId, t: &Tensor) -> Result<()> {
    let ty = &graph.node(id).ty;
    if t.dtype() == ty.dtype && t.rank() == ty.rank() {
        return Ok(());
    }
    // Named only for the error: a compiled call checks every input.
    let name = graph.display_name(id);
    if t.dtype() != ty.dtype {
        return Err(Error::new(
            ErrorKind::DType,
            format!("input `{name}`: expected {}, got {}", ty.dtype, t.dtype()),
        ));
    }
    if t.rank() != ty.rank() {
        return Err(Error::new(
            ErrorKind::Shape,
            format!(
                "input `{name}`: expected rank {} ({ty}), got shape {:?}",
                ty.rank(),
                t.shape()
            ),
        ));
    }
    Ok(())
}

/// Checks one dim of an input against its declared value.
fn check_dim(
    graph: &Graph,
    id: NodeId,
    d: usize,
    dim: &Dim,
    size: usize,
    symbols: &Symbols,
    origin: &HashMap<Arc<str>, String>,
) -> Result<()> {
    if dim.as_const() == Some(size) {
        return Ok(());
    }
    // Named only for the error: a compiled call checks every input.
    let at = format!("input `{}`, dim {d}", graph.display_name(id));
    let expected = match dim.eval(symbols) {
        Ok(v) if v == size => return Ok(()),
        Ok(v) => v,
        Err(EvalError::Unbound(_)) => {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!(
                    "{at}: cannot bind the symbols of `{dim}` from a size; \
                     declare a plain symbol (like `s0`) on some input"
                ),
            ))
        }
        Err(e) => {
            return Err(Error::new(
                ErrorKind::Shape,
                format!(
                    "{at}: `{dim}` has no size at {}: {e}",
                    describe_symbols(symbols)
                ),
            ))
        }
    };
    let msg = match (dim, plain_symbol(dim)) {
        (Dim::Const(_), _) => format!("{at}: expected {expected}, got {size}"),
        (_, Some(sym)) => format!(
            "{at}: expected {dim} = {expected} (from {}), got {size}",
            origin[&sym]
        ),
        (_, None) => format!("{at}: expected {dim} = {expected}, got {size}"),
    };
    Err(Error::new(ErrorKind::Shape, msg))
}

/// The symbol a dim is, when it is exactly one symbol (`s0`, not `2*s0`).
fn plain_symbol(dim: &Dim) -> Option<Arc<str>> {
    match dim.symbols().as_slice() {
        [s] if *dim == Dim::sym(s) => Some(s.clone()),
        _ => None,
    }
}

/// `x: f32[s0,3], y: i64[4]`.
fn describe_inputs(graph: &Graph) -> String {
    if graph.inputs.is_empty() {
        return "(none)".to_string();
    }
    graph
        .inputs
        .iter()
        .map(|&id| format!("{}: {}", graph.display_name(id), graph.node(id).ty))
        .collect::<Vec<_>>()
        .join(", ")
}

/// For each node, the index of the last node that reads it: itself when no
/// node does (dropped at once), `usize::MAX` for outputs (kept to the end).
fn last_uses(graph: &Graph) -> Vec<usize> {
    let mut last: Vec<usize> = (0..graph.len()).collect();
    // Nodes are in SSA order, so the last reader seen is the last one.
    for (i, node) in graph.nodes.iter().enumerate() {
        for &x in &node.inputs {
            last[x.index()] = i;
        }
    }
    for out in &graph.outputs {
        last[out.node.index()] = usize::MAX;
    }
    last
}

fn eval_node(
    graph: &Graph,
    id: NodeId,
    values: &[Option<Tensor>],
    symbols: &Symbols,
) -> Result<Tensor> {
    let node = graph.node(id);
    let op = concrete_op(&node.op, symbols).map_err(|e| node_error(graph, id, e))?;
    let args: Vec<&Tensor> = node
        .inputs
        .iter()
        .map(|x| values[x.index()].as_ref().expect("live until its last use"))
        .collect();
    // A late error (a CUDA kernel's) names the node's line, not this one.
    let out = crate::error::dispatching_node(node.meta.location.as_ref(), || {
        trace::with_origin(&node.meta, || Tensor::apply(&op, &args, Location::caller()))
    })
    .map_err(|e| node_error(graph, id, e))?;
    let declared = eval_shape(&node.ty.shape, symbols).map_err(|e| node_error(graph, id, e))?;
    if out.shape() != declared.as_slice() || out.dtype() != node.ty.dtype {
        return Err(node_error(
            graph,
            id,
            Error::new(
                ErrorKind::Verify,
                format!(
                    "computed {} but the graph declares {} = {declared:?}",
                    out.ty(),
                    node.ty
                ),
            ),
        ));
    }
    Ok(out)
}

/// Every output of a `custom` node, checked against the declared types.
fn eval_custom(
    graph: &Graph,
    id: NodeId,
    call: &CustomCall,
    values: &[Option<Tensor>],
    symbols: &Symbols,
) -> Result<Vec<Tensor>> {
    let node = graph.node(id);
    let args: Vec<&Tensor> = node
        .inputs
        .iter()
        .map(|x| values[x.index()].as_ref().expect("live until its last use"))
        .collect();
    let outs = trace::with_origin(&node.meta, || {
        custom::apply(call, &args, Location::caller())
    })
    .map_err(|e| node_error(graph, id, e))?;
    let declared = eval_shape(&node.ty.shape, symbols).map_err(|e| node_error(graph, id, e))?;
    if outs[0].shape() != declared.as_slice() || outs[0].dtype() != node.ty.dtype {
        let msg = format!(
            "computed {} but the graph declares {}",
            outs[0].ty(),
            node.ty
        );
        return Err(node_error(graph, id, Error::new(ErrorKind::Verify, msg)));
    }
    Ok(outs)
}

/// `graph` with `symbols` substituted: every node's type and shape
/// attribute concrete (a symbolic program at one binding of its sizes).
pub(crate) fn concretise(graph: &Graph, symbols: &Symbols) -> Result<Graph> {
    let mut g = graph.clone();
    for i in 0..g.nodes.len() {
        let id = NodeId(i as u32);
        let fixed = concrete_op(&g.nodes[i].op, symbols).map_err(|e| node_error(graph, id, e))?;
        if let Cow::Owned(op) = fixed {
            // A slice to a symbolic end could only be bounds-checked now.
            if matches!(op, Op::Slice { .. }) {
                let x = g.nodes[i].inputs[0];
                op.infer(&[g.node(x).ty.clone()])
                    .map_err(|e| node_error(graph, id, e))?;
            }
            g.nodes[i].op = op;
        }
        let sizes =
            eval_shape(&g.nodes[i].ty.shape, symbols).map_err(|e| node_error(graph, id, e))?;
        g.nodes[i].ty.shape = Shape::from_concrete(&sizes);
    }
    Ok(g)
}

/// `op` with its symbolic shape attribute (if any) evaluated.
fn concrete_op<'a>(op: &'a Op, symbols: &Symbols) -> Result<Cow<'a, Op>> {
    let fix = |s: &Shape| eval_shape(s, symbols).map(|d| Shape::from_concrete(&d));
    let symbolic = |s: &Shape| s.as_concrete().is_none();
    Ok(match op {
        Op::Full {
            value,
            shape,
            dtype,
        } if symbolic(shape) => Cow::Owned(Op::Full {
            value: *value,
            shape: fix(shape)?,
            dtype: *dtype,
        }),
        Op::Rand { shape, dtype } if symbolic(shape) => Cow::Owned(Op::Rand {
            shape: fix(shape)?,
            dtype: *dtype,
        }),
        Op::Randn { shape, dtype } if symbolic(shape) => Cow::Owned(Op::Randn {
            shape: fix(shape)?,
            dtype: *dtype,
        }),
        Op::Reshape(shape) if symbolic(shape) => Cow::Owned(Op::Reshape(fix(shape)?)),
        Op::Expand(shape) if symbolic(shape) => Cow::Owned(Op::Expand(fix(shape)?)),
        Op::Slice {
            dim,
            start,
            end: end @ Dim::Sym(_),
            step,
        } => Cow::Owned(Op::Slice {
            dim: *dim,
            start: *start,
            end: Dim::Const(eval_shape(&Shape(vec![end.clone()]), symbols)?[0]),
            step: *step,
        }),
        _ => Cow::Borrowed(op),
    })
}

/// The concrete sizes of `shape`, within the size limit
/// ([`crate::limits`]), or why there are none.
pub(crate) fn eval_shape(shape: &Shape, symbols: &Symbols) -> Result<Vec<usize>> {
    let err = match shape.eval(symbols) {
        Ok(sizes) if crate::limits::extent(&sizes).is_some() => return Ok(sizes),
        Ok(sizes) => format!(
            "shape {shape} is {sizes:?} at {}: more than the limit of 2^46 = {} elements",
            describe_symbols(symbols),
            crate::limits::MAX_ELEMENTS
        ),
        Err(EvalError::Unbound(_)) => {
            let unbound: HashSet<Arc<str>> = shape
                .dims()
                .iter()
                .flat_map(Dim::symbols)
                .filter(|s| !symbols.contains_key(s))
                .collect();
            let mut names: Vec<&str> = unbound.iter().map(|s| &**s).collect();
            names.sort();
            format!(
                "shape {shape} uses {}, which no input binds",
                names.join(", ")
            )
        }
        Err(e) => format!(
            "shape {shape} has no size at {}: {e}",
            describe_symbols(symbols)
        ),
    };
    Err(Error::new(ErrorKind::Shape, err))
}

/// `s0 = 4, s1 = 8`, sorted by name.
fn describe_symbols(symbols: &Symbols) -> String {
    let mut pairs: Vec<(&str, usize)> = symbols.iter().map(|(k, &v)| (&**k, v)).collect();
    pairs.sort();
    pairs
        .iter()
        .map(|(k, v)| format!("{k} = {v}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Names the node in `e` and points it at the node's source line.
pub(crate) fn node_error(graph: &Graph, id: NodeId, mut e: Error) -> Error {
    let node = graph.node(id);
    e.message = format!("node `{}`: {}", graph.display_name(id), e.message);
    e.op.get_or_insert_with(|| node.op.name().to_string());
    // `apply` stamps the interpreter's own line; the user's line is the node's.
    e.location = node.meta.location.clone();
    e
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::SourceLoc;
    use crate::ir::{DType, NodeMeta, Scalar, TensorType};

    fn sym_shape(dims: &[&str]) -> Shape {
        Shape::new(dims.iter().map(|d| Dim::parse(d).unwrap()).collect())
    }

    fn named(name: &str) -> NodeMeta {
        NodeMeta::named(name)
    }

    /// x: f32[s0,6] -> reshape [s0,2,3] -> permute [0,2,1] -> slice dim 1
    /// 1..3 -> contiguous; and b: f32[1,2] expanded to [s0,3,2].
    fn movement_graph() -> Graph {
        let mut g = Graph::new("moves");
        let ty = |dims: &[&str]| TensorType {
            dtype: DType::F32,
            shape: sym_shape(dims),
        };
        let x = g.add_input("x", ty(&["s0", "6"]));
        let b = g.add_input("b", ty(&["1", "2"]));
        let r = g
            .add(Op::Reshape(sym_shape(&["s0", "2", "3"])), &[x], named("r"))
            .unwrap();
        let p = g.add(Op::Permute(vec![0, 2, 1]), &[r], named("p")).unwrap();
        let slice = Op::Slice {
            dim: 1,
            start: 1,
            end: Dim::Const(3),
            step: 1,
        };
        let s = g.add(slice, &[p], named("s")).unwrap();
        let c = g.add(Op::Contiguous, &[s], named("c")).unwrap();
        let e = g
            .add(Op::Expand(sym_shape(&["s0", "3", "2"])), &[b], named("e"))
            .unwrap();
        g.add_output("c", c);
        g.add_output("p", p);
        g.add_output("e", e);
        g
    }

    fn run(g: &Graph, inputs: &[Tensor]) -> Vec<(String, Vec<f32>, Vec<usize>)> {
        run_graph(g, inputs)
            .unwrap()
            .into_iter()
            .map(|(n, t)| (n, t.to_vec::<f32>().unwrap(), t.shape().to_vec()))
            .collect()
    }

    #[test]
    fn movement_ops_with_a_bound_symbol() {
        let g = movement_graph();
        let x = Tensor::from_vec((0..12).map(|v| v as f32).collect(), &[2, 6]);
        let b = Tensor::from_vec(vec![10.0f32, 20.0], &[1, 2]);
        let out = run(&g, &[x, b]);
        // p[k][i][j] = x[k][3*j + i]; c is p's rows 1 and 2.
        assert_eq!(out[0].0, "c");
        assert_eq!(out[0].2, vec![2, 2, 2]);
        assert_eq!(out[0].1, vec![1., 4., 2., 5., 7., 10., 8., 11.]);
        assert_eq!(out[1].2, vec![2, 3, 2]);
        assert_eq!(
            out[1].1,
            vec![0., 3., 1., 4., 2., 5., 6., 9., 7., 10., 8., 11.]
        );
        assert_eq!(out[2].2, vec![2, 3, 2]);
        assert_eq!(out[2].1, [10., 20.].repeat(6));
    }

    #[test]
    fn the_same_graph_serves_another_size() {
        let g = movement_graph();
        let x = Tensor::from_vec((0..6).map(|v| v as f32).collect(), &[1, 6]);
        let b = Tensor::from_vec(vec![1.0f32, 2.0], &[1, 2]);
        let out = run(&g, &[x, b]);
        assert_eq!(out[0].2, vec![1, 2, 2]);
        assert_eq!(out[0].1, vec![1., 4., 2., 5.]);
        assert_eq!(out[2].2, vec![1, 3, 2]);
    }

    #[test]
    fn a_view_of_an_input_is_returned_without_copy() {
        let g = movement_graph();
        let x = Tensor::from_vec(vec![0.0f32; 18], &[3, 6]);
        let b = Tensor::from_vec(vec![1.0f32, 2.0], &[1, 2]);
        let out = run_graph(&g, &[x.clone(), b]).unwrap();
        assert!(out[1].1.shares_storage(&x), "permute is a view");
        assert!(
            !out[0].1.shares_storage(&x),
            "contiguous copies a strided view"
        );
    }

    /// rand and randn of a symbolic shape, seeded by an input: each size
    /// draws what eager `rand_seeded` draws at that size.
    #[test]
    fn random_ops_of_a_symbolic_shape_run_at_each_size() {
        let mut g = Graph::new("noise");
        let x = g.add_input("x", TensorType::new(DType::F32, sym_shape(&["s0", "3"])));
        let seed = g.add_input("seed", TensorType::new(Op::SEED_DTYPE, Shape::scalar()));
        let shape = sym_shape(&["s0", "3"]);
        let rand = Op::Rand {
            shape: shape.clone(),
            dtype: DType::F32,
        };
        let u = g.add(rand, &[seed], named("u")).unwrap();
        let randn = Op::Randn {
            shape,
            dtype: DType::F32,
        };
        let n = g.add(randn, &[seed], named("n")).unwrap();
        let ux = g.add(Op::Binary(crate::ir::BinaryOp::Add), &[u, x], named("ux"));
        g.add_output("ux", ux.unwrap());
        g.add_output("n", n);
        for rows in [2, 5] {
            let x = Tensor::zeros(&[rows, 3], DType::F32);
            let seed = crate::tensor::Generator::new(rows as u64).next_seed_tensor();
            let out = run(&g, &[x, seed.clone()]);
            let eager_u = Tensor::rand_seeded(&seed, &[rows, 3], DType::F32);
            let eager_n = Tensor::randn_seeded(&seed, &[rows, 3], DType::F32);
            assert_eq!(out[0].2, vec![rows, 3]);
            assert_eq!(out[0].1, eager_u.to_vec::<f32>().unwrap());
            assert_eq!(out[1].1, eager_n.to_vec::<f32>().unwrap());
        }
    }

    fn two_input_graph() -> Graph {
        let mut g = Graph::new("two");
        let x = g.add_input(
            "x",
            TensorType {
                dtype: DType::F32,
                shape: sym_shape(&["s0", "3"]),
            },
        );
        let y = g.add_input(
            "y",
            TensorType {
                dtype: DType::F32,
                shape: sym_shape(&["s0"]),
            },
        );
        g.add_output("x", x);
        g.add_output("y", y);
        g
    }

    fn err_of(g: &Graph, inputs: &[Tensor]) -> String {
        run_graph(g, inputs).unwrap_err().to_string()
    }

    #[test]
    fn a_symbol_bound_twice_to_different_sizes_is_an_error() {
        let g = two_input_graph();
        let x = Tensor::from_vec(vec![0.0f32; 6], &[2, 3]);
        let y = Tensor::from_vec(vec![0.0f32; 5], &[5]);
        assert_eq!(
            err_of(&g, &[x, y]),
            "input `y`, dim 0: expected s0 = 2 (from input `x`, dim 0), got 5"
        );
    }

    #[test]
    fn input_mismatches_name_the_input_and_dim() {
        let g = two_input_graph();
        let y = Tensor::from_vec(vec![0.0f32; 2], &[2]);
        let wide = Tensor::from_vec(vec![0.0f32; 8], &[2, 4]);
        assert_eq!(
            err_of(&g, &[wide, y.clone()]),
            "input `x`, dim 1: expected 3, got 4"
        );
        let ints = Tensor::from_vec(vec![0i64; 6], &[2, 3]);
        assert_eq!(
            err_of(&g, &[ints, y.clone()]),
            "input `x`: expected f32, got i64"
        );
        let flat = Tensor::from_vec(vec![0.0f32; 6], &[6]);
        assert_eq!(
            err_of(&g, &[flat, y.clone()]),
            "input `x`: expected rank 2 (f32[s0,3]), got shape [6]"
        );
        assert_eq!(
            err_of(&g, &[y]),
            "graph `two` takes 2 inputs (x: f32[s0,3], y: f32[s0]), got 1"
        );
    }

    #[test]
    fn a_compound_dim_is_checked_against_its_value() {
        let mut g = Graph::new("g");
        let ty = |dims: &[&str]| TensorType {
            dtype: DType::F32,
            shape: sym_shape(dims),
        };
        let x = g.add_input("x", ty(&["s0"]));
        let y = g.add_input("y", ty(&["2*s0"]));
        g.add_output("x", x);
        g.add_output("y", y);
        let x = Tensor::from_vec(vec![0.0f32; 3], &[3]);
        let y = Tensor::from_vec(vec![0.0f32; 6], &[6]);
        run_graph(&g, &[x.clone(), y]).unwrap();
        let y = Tensor::from_vec(vec![0.0f32; 5], &[5]);
        assert_eq!(
            err_of(&g, &[x, y]),
            "input `y`, dim 0: expected 2*s0 = 6, got 5"
        );
    }

    #[test]
    fn node_errors_name_the_node_op_and_location() {
        let mut g = Graph::new("g");
        let meta = NodeMeta {
            name: Some("noise".into()),
            location: Some(SourceLoc {
                file: Arc::from("model.rs"),
                line: 7,
                column: 3,
            }),
            hints: None,
        };
        let full = Op::Full {
            value: Scalar::Float(1.0),
            shape: sym_shape(&["s9", "2"]),
            dtype: DType::F32,
        };
        let f = g.add(full, &[], meta).unwrap();
        g.add_output("noise", f);
        let e = run_graph(&g, &[]).unwrap_err();
        assert_eq!(e.op.as_deref(), Some("full"));
        assert_eq!(
            e.to_string(),
            "full: node `noise`: shape [s9,2] uses s9, which no input binds (at model.rs:7:3)"
        );
    }

    #[test]
    fn inputs_bind_by_name() {
        let g = two_input_graph();
        let x = Tensor::from_vec(vec![0.0f32; 6], &[2, 3]);
        let y = Tensor::from_vec(vec![1.0f32; 2], &[2]);
        let ordered =
            inputs_by_name(&g, vec![("y".into(), y.clone()), ("x".into(), x.clone())]).unwrap();
        assert!(ordered[0].shares_storage(&x) && ordered[1].shares_storage(&y));
        let err = |named: Vec<(String, Tensor)>| inputs_by_name(&g, named).unwrap_err().to_string();
        let inputs = "the graph's inputs are x: f32[s0,3], y: f32[s0]";
        assert_eq!(
            err(vec![("z".into(), y.clone())]),
            format!("unknown input `z`; {inputs}")
        );
        assert_eq!(
            err(vec![("x".into(), x.clone())]),
            format!("missing input `y`; {inputs}")
        );
        assert_eq!(
            err(vec![("x".into(), x.clone()), ("x".into(), x)]),
            format!("input `x` is given twice; {inputs}")
        );
    }

    #[test]
    fn intermediates_die_after_their_last_reader() {
        let g = movement_graph();
        // Nodes x b r p s c e: x dies at r, b at e, r at p, s at c; p, c
        // and e are outputs.
        assert_eq!(
            last_uses(&g),
            vec![2, 6, 3, usize::MAX, 5, usize::MAX, usize::MAX]
        );
        let mut unused = Graph::new("u");
        let x = unused.add_input("x", TensorType::new(DType::F32, vec![2]));
        unused
            .add(Op::Permute(vec![0]), &[x], NodeMeta::default())
            .unwrap();
        assert_eq!(last_uses(&unused), vec![1, 1]);
    }
}
