//! Generalising a concrete graph over symbols by *value matching*: a graph
//! traced at sizes `s0=8, s1=16` holds those sizes baked into its shape
//! attributes (`reshape [128,64]`, `full [16,16]`, `slice 0..16`); each
//! such size is re-expressed in the symbols whose values it matches
//! (`128 = s0*s1`), and every node's type inferred again.
//!
//! A match is only a hypothesis, so it is checked: every generalised
//! node's type, evaluated at the binding, must be the traced type, which
//! makes the generalised graph at that binding exactly the traced graph. A
//! wrong guess (a static 8 taken for `s0 = 8`) can only make a graph that
//! is right at this binding and other at others; the compile cache keys on
//! the generalised graph of every call's own trace, so another size whose
//! trace generalises differently compiles anew rather than reuse it.
//! Preferring structural matches (an expanded dim is the input's dim) and
//! products whose element count agrees (a reshape's target multiplies out
//! to its input's) keeps such guesses rare.

use std::collections::HashMap;
use std::sync::Arc;

use crate::ir::{Dim, Graph, Node, NodeId, Op, ReduceOp, Scalar, Shape, TensorType};

/// The symbols a graph is generalised over, with their values.
#[derive(Clone, Debug)]
pub struct Binding {
    symbols: Vec<(Arc<str>, usize)>,
    /// `symbols` by name, for evaluating dims (once per node and call).
    values: HashMap<Arc<str>, usize>,
    /// Every product of up to [`MAX_DEGREE`] symbols, with its value,
    /// lowest degree first.
    monomials: Vec<(Dim, usize)>,
    /// `C - s` for each symbol `s` bounded by a concrete size `C` (a slice
    /// `0..s` of `C` rows: its gradient pads `C - s` rows), with its value.
    differences: Vec<(Dim, usize)>,
}

/// Products of at most this many symbols are tried (`s0*s1*s2`).
const MAX_DEGREE: usize = 3;

/// Reshape targets whose matches need more attempts than this stay concrete.
const MAX_RESHAPE_ATTEMPTS: usize = 4096;

impl Binding {
    pub fn new(symbols: Vec<(Arc<str>, usize)>) -> Binding {
        let mut monomials: Vec<(Dim, usize)> = Vec::new();
        let mut frontier: Vec<(Dim, usize, usize)> = vec![(Dim::Const(1), 1, 0)];
        for _ in 0..MAX_DEGREE {
            let mut next = Vec::new();
            for (dim, value, first) in &frontier {
                for (k, (name, v)) in symbols.iter().enumerate().skip(*first) {
                    let Some(value) = value.checked_mul(*v) else {
                        continue;
                    };
                    let product = dim * &Dim::sym(name);
                    monomials.push((product.clone(), value));
                    next.push((product, value, k));
                }
            }
            frontier = next;
        }
        Binding {
            values: symbols.iter().cloned().collect(),
            symbols,
            monomials,
            differences: Vec::new(),
        }
    }

    /// The binding where each `(C, s)` of `bounds` also offers `C - s`.
    pub fn with_differences(mut self, bounds: &[(usize, Arc<str>)]) -> Binding {
        for (c, s) in bounds {
            let Some(&(_, v)) = self.symbols.iter().find(|(name, _)| name == s) else {
                continue;
            };
            if let (Some(value), Some(d)) =
                (c.checked_sub(v), Dim::Const(*c).checked_sub(&Dim::sym(s)))
            {
                self.differences.push((d, value));
            }
        }
        self
    }

    pub fn map(&self) -> &HashMap<Arc<str>, usize> {
        &self.values
    }

    /// `dim` at this binding (`None`: a symbol it does not bind).
    pub fn eval(&self, dim: &Dim) -> Option<usize> {
        dim.eval(&self.values).ok()
    }

    /// The ways to write `value`, best first: a product of symbols of that
    /// value, then a constant multiple of one, then a bounded difference
    /// (see [`Binding::with_differences`]), then the constant itself.
    pub fn candidates(&self, value: usize) -> Vec<Dim> {
        let mut out: Vec<Dim> = self
            .monomials
            .iter()
            .filter(|(_, v)| *v == value)
            .map(|(d, _)| d.clone())
            .collect();
        // Multiples, the smallest coefficient first (6*s0*s1 before 6*s1 * s0).
        let mut multiples: Vec<(usize, Dim)> = self
            .monomials
            .iter()
            .filter(|(_, v)| *v >= 2 && value > *v && value.is_multiple_of(*v))
            .map(|(mono, v)| (value / v, &Dim::Const(value / v) * mono))
            .collect();
        multiples.sort_by_key(|(c, _)| *c);
        out.extend(multiples.into_iter().map(|(_, d)| d));
        let differences = self.differences.iter().filter(|(_, v)| *v == value);
        out.extend(differences.map(|(d, _)| d.clone()));
        out.push(Dim::Const(value));
        out
    }

    /// The best way to write `value` as a product of symbols alone, if any.
    pub fn monomial(&self, value: usize) -> Option<Dim> {
        self.monomials
            .iter()
            .find(|(_, v)| *v == value)
            .map(|(d, _)| d.clone())
    }
}

/// Why a graph could not be generalised: the node and the reason.
#[derive(Clone, Debug, PartialEq)]
pub struct Refusal {
    pub node: String,
    pub why: String,
    /// Symbols the node meets as constants of the same value (a feature
    /// dim made symbolic meeting a weight's): made concrete, the graph may
    /// generalise over the others.
    pub suspects: Vec<Arc<str>>,
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.node, self.why)
    }
}

/// `graph` with its inputs' types replaced by `inputs` (symbolic where
/// generalised) and every later node re-expressed over `binding`. With
/// `scalars`, a float scalar constant whose value is a product of symbols
/// (a mean's `1/count` in a backward graph) becomes that product computed
/// from the sizes; otherwise constants stay as traced.
pub fn generalise_graph(
    graph: &Graph,
    inputs: &[TensorType],
    binding: &Binding,
    scalars: bool,
) -> Result<Graph, Refusal> {
    let mut g = Graph::new(&graph.name);
    let mut new_id: Vec<NodeId> = Vec::with_capacity(graph.nodes.len());
    let mut next_input = 0;
    for (k, node) in graph.nodes.iter().enumerate() {
        let id = NodeId(k as u32);
        let mapped: Vec<NodeId> = node.inputs.iter().map(|x| new_id[x.index()]).collect();
        let refuse = |why: String| Refusal {
            node: describe_node(graph, id),
            why,
            suspects: suspects(&g, &mapped, binding),
        };
        if matches!(node.op, Op::Input) {
            let ty = inputs
                .get(next_input)
                .cloned()
                .ok_or_else(|| refuse("more graph inputs than types given".into()))?;
            next_input += 1;
            new_id.push(g.push(Node { ty, ..node.clone() }));
            continue;
        }
        if scalars {
            if let Some(size) = size_scalar(node, binding) {
                new_id.push(push_size_scalar(&mut g, node, size));
                continue;
            }
        }
        let input_types: Vec<TensorType> = mapped.iter().map(|x| g.node(*x).ty.clone()).collect();
        let op = generalise_op(&node.op, &input_types, &node.ty, binding).map_err(&refuse)?;
        let ty = op
            .infer(&input_types)
            .map_err(|e| refuse(format!("does not infer over the symbols: {}", e.message)))?;
        check_same_at_binding(&ty, &node.ty, binding).map_err(&refuse)?;
        new_id.push(g.push(Node {
            op,
            inputs: mapped,
            ty,
            meta: node.meta.clone(),
        }));
    }
    g.inputs = graph.inputs.iter().map(|x| new_id[x.index()]).collect();
    g.outputs = graph.outputs.clone();
    for out in &mut g.outputs {
        out.node = new_id[out.node.index()];
    }
    Ok(g)
}

/// The symbols among `inputs`' dims whose value is also a constant dim of
/// them: the likely cause of a refusal at their node.
fn suspects(g: &Graph, inputs: &[NodeId], binding: &Binding) -> Vec<Arc<str>> {
    let dims = || {
        inputs
            .iter()
            .flat_map(|x| g.node(*x).ty.shape.dims().iter())
    };
    let constants: Vec<usize> = dims().filter_map(Dim::as_const).collect();
    let mut out: Vec<Arc<str>> = Vec::new();
    for (name, value) in &binding.symbols {
        let present = dims().any(|d| d.symbols().contains(name));
        if present && constants.contains(value) && !out.contains(name) {
            out.push(name.clone());
        }
    }
    out
}

/// `%12 reshape (nn/linear.rs:85)`.
fn describe_node(graph: &Graph, id: NodeId) -> String {
    let node = graph.node(id);
    let at = node
        .meta
        .location
        .as_ref()
        .map_or_else(String::new, |l| format!(" at {l}"));
    format!("`{}` ({}{at})", graph.display_name(id), node.op.name())
}

/// The generalised type must be the traced one at the binding.
fn check_same_at_binding(
    general: &TensorType,
    traced: &TensorType,
    binding: &Binding,
) -> Result<(), String> {
    let sizes: Option<Vec<usize>> = general
        .shape
        .dims()
        .iter()
        .map(|d| binding.eval(d))
        .collect();
    let concrete = traced.shape.as_concrete();
    if general.dtype == traced.dtype && sizes.is_some() && sizes == concrete {
        return Ok(());
    }
    Err(format!(
        "its type {general} over the symbols is not the traced {traced} at {}",
        describe(binding)
    ))
}

/// `s0=8, s1=16`.
pub fn describe(binding: &Binding) -> String {
    let parts: Vec<String> = binding
        .symbols
        .iter()
        .map(|(s, v)| format!("{s}={v}"))
        .collect();
    parts.join(", ")
}

/// `op` with its baked sizes re-expressed over the binding (the op itself
/// when it has none).
fn generalise_op(
    op: &Op,
    inputs: &[TensorType],
    traced: &TensorType,
    binding: &Binding,
) -> Result<Op, String> {
    let per_dim = |shape: &Shape| -> Shape {
        Shape(
            shape
                .dims()
                .iter()
                .map(|d| match d.as_const() {
                    Some(v) => binding.candidates(v).swap_remove(0),
                    None => d.clone(),
                })
                .collect(),
        )
    };
    Ok(match op {
        Op::Reshape(target) => Op::Reshape(reshape_target(&inputs[0], target, binding)?),
        Op::Expand(target) => Op::Expand(expand_target(&inputs[0], target, binding)),
        Op::Full {
            value,
            shape,
            dtype,
        } => Op::Full {
            value: *value,
            shape: per_dim(shape),
            dtype: *dtype,
        },
        Op::Rand { shape, dtype } => Op::Rand {
            shape: per_dim(shape),
            dtype: *dtype,
        },
        Op::Randn { shape, dtype } => Op::Randn {
            shape: per_dim(shape),
            dtype: *dtype,
        },
        Op::Slice {
            dim,
            start,
            end,
            step,
        } => Op::Slice {
            dim: *dim,
            start: *start,
            end: slice_end(&inputs[0], *dim, *start, end, *step, binding),
            step: *step,
        },
        Op::CustomOutput {
            index,
            dtype,
            shape,
        } => Op::CustomOutput {
            index: *index,
            dtype: *dtype,
            shape: match traced.shape.as_concrete() {
                Some(_) => per_dim(shape),
                None => shape.clone(),
            },
        },
        other => other.clone(),
    })
}

/// A slice's end: the whole input dim when it is that, else the dim's
/// value matched (symbolic ends are only allowed from 0 with step 1).
fn slice_end(
    x: &TensorType,
    dim: usize,
    start: usize,
    end: &Dim,
    step: usize,
    binding: &Binding,
) -> Dim {
    let Some(value) = end.as_const() else {
        return end.clone();
    };
    let whole = &x.shape.dims()[dim];
    if start == 0 && step == 1 && binding.eval(whole) == Some(value) {
        return whole.clone();
    }
    if start == 0 && step == 1 {
        if let Some(m) = binding.monomial(value) {
            return m;
        }
    }
    end.clone()
}

/// An expand's target: each dim the input already has (not broadcast) is
/// that dim; a new or stretched one is its value matched.
fn expand_target(x: &TensorType, target: &Shape, binding: &Binding) -> Shape {
    let (xs, ts) = (x.shape.dims(), target.dims());
    let offset = ts.len().saturating_sub(xs.len());
    let dims = ts
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let Some(value) = t.as_const() else {
                return t.clone();
            };
            let own = i.checked_sub(offset).map(|j| &xs[j]);
            match own {
                Some(d) if *d != Dim::Const(1) && binding.eval(d) == Some(value) => d.clone(),
                _ => binding.candidates(value).swap_remove(0),
            }
        })
        .collect();
    Shape(dims)
}

/// A reshape's target: per dim a candidate, chosen so that the product is
/// the input's element count as a polynomial (`[s0*s1*64]` from
/// `[s0,s1,64]`); depth-first in candidate order, so products of symbols
/// are preferred to constants.
fn reshape_target(x: &TensorType, target: &Shape, binding: &Binding) -> Result<Shape, String> {
    let want = x
        .shape
        .checked_numel()
        .ok_or_else(|| format!("the element count of {x} overflows"))?;
    let options: Vec<Vec<Dim>> = target
        .dims()
        .iter()
        .map(|d| match d.as_const() {
            Some(v) => binding.candidates(v),
            None => vec![d.clone()],
        })
        .collect();
    let mut chosen = Vec::with_capacity(options.len());
    let mut attempts = 0;
    if search(&options, &want, &mut chosen, &mut attempts) {
        return Ok(Shape(chosen));
    }
    Err(format!(
        "no way to write target {target} over {} with {x}'s element count {want}",
        describe(binding)
    ))
}

fn search(options: &[Vec<Dim>], want: &Dim, chosen: &mut Vec<Dim>, attempts: &mut usize) -> bool {
    let Some((first, rest)) = options.split_first() else {
        let product = chosen.iter().fold(Dim::Const(1), |acc, d| &acc * d);
        return product == *want;
    };
    for candidate in first {
        *attempts += 1;
        if *attempts > MAX_RESHAPE_ATTEMPTS {
            return false;
        }
        chosen.push(candidate.clone());
        if search(rest, want, chosen, attempts) {
            return true;
        }
        chosen.pop();
    }
    false
}

/// A float scalar `full` whose value is a (multiple of a) product of
/// symbols — a mean's element count — as that product.
fn size_scalar(node: &Node, binding: &Binding) -> Option<Dim> {
    let Op::Full {
        value: Scalar::Float(v),
        shape,
        dtype,
    } = &node.op
    else {
        return None;
    };
    if !shape.dims().is_empty() || !dtype.is_float() || v.fract() != 0.0 || *v < 2.0 {
        return None;
    }
    let size = binding.candidates(*v as usize).swap_remove(0);
    (!size.is_const()).then_some(size)
}

/// The scalar `size` computed from the sizes: `sum(full(1, [size]))`.
fn push_size_scalar(g: &mut Graph, node: &Node, size: Dim) -> NodeId {
    let dtype = node.ty.dtype;
    let ones = g.push(Node {
        op: Op::Full {
            value: Scalar::Float(1.0),
            shape: Shape(vec![size.clone()]),
            dtype,
        },
        inputs: Vec::new(),
        ty: TensorType {
            dtype,
            shape: Shape(vec![size]),
        },
        meta: node.meta.clone(),
    });
    g.push(Node {
        op: Op::Reduce {
            op: ReduceOp::Sum,
            dims: vec![0],
            keepdim: false,
        },
        inputs: vec![ones],
        ty: node.ty.clone(),
        meta: node.meta.clone(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::DType;

    fn binding(values: &[usize]) -> Binding {
        Binding::new(
            values
                .iter()
                .enumerate()
                .map(|(i, &v)| (Arc::from(format!("s{i}").as_str()), v))
                .collect(),
        )
    }

    fn shape(dims: &[Dim]) -> Shape {
        Shape(dims.to_vec())
    }

    #[test]
    fn candidates_prefer_products_of_symbols_then_multiples_then_the_constant() {
        let b = binding(&[8, 16]);
        let (s0, s1) = (Dim::sym("s0"), Dim::sym("s1"));
        assert_eq!(b.candidates(8)[0], s0);
        assert_eq!(b.candidates(128)[0], &s0 * &s1);
        assert!(b.candidates(128).contains(&(&Dim::Const(16) * &s0)));
        assert_eq!(*b.candidates(128).last().unwrap(), Dim::Const(128));
        assert_eq!(b.candidates(7), vec![Dim::Const(7)]);
        assert_eq!(b.monomial(64), Some(&s0 * &s0));
    }

    #[test]
    fn a_reshape_target_multiplies_out_to_its_input() {
        let b = binding(&[8, 16]);
        let (s0, s1) = (Dim::sym("s0"), Dim::sym("s1"));
        let x = TensorType::new(DType::F32, shape(&[s0.clone(), s1.clone(), Dim::Const(64)]));
        let flat = reshape_target(&x, &Shape::from_concrete(&[128, 64]), &b).unwrap();
        assert_eq!(flat, shape(&[&s0 * &s1, Dim::Const(64)]));
        // Heads of 8 next to a batch of 8: the count rules s0*8 out.
        let heads = reshape_target(&x, &Shape::from_concrete(&[8, 16, 8, 8]), &b).unwrap();
        assert_eq!(
            heads,
            shape(&[s0.clone(), s1.clone(), Dim::Const(8), Dim::Const(8)])
        );
        let err = reshape_target(&x, &Shape::from_concrete(&[64, 128]), &binding(&[3, 5]));
        assert!(err.is_err());
    }

    #[test]
    fn an_expand_keeps_the_inputs_own_dims() {
        let b = binding(&[4]);
        let x = TensorType::new(DType::F32, shape(&[Dim::sym("s0"), Dim::Const(1)]));
        let t = expand_target(&x, &Shape::from_concrete(&[2, 4, 4]), &b);
        assert_eq!(t, shape(&[Dim::Const(2), Dim::sym("s0"), Dim::sym("s0")]));
    }

    #[test]
    fn a_graph_generalises_and_a_size_it_cannot_express_is_refused_with_the_node() {
        let mut g = Graph::new("g");
        let x = g.add_input(
            "x",
            TensorType::new(DType::F32, Shape::from_concrete(&[8, 16])),
        );
        let flat = g
            .add(
                Op::Reshape(Shape::from_concrete(&[128])),
                &[x],
                Default::default(),
            )
            .unwrap();
        g.add_output("y", flat);
        let b = binding(&[8, 16]);
        let sym = TensorType::new(DType::F32, shape(&[Dim::sym("s0"), Dim::sym("s1")]));
        let general = generalise_graph(&g, std::slice::from_ref(&sym), &b, false).unwrap();
        assert_eq!(
            general.node(general.outputs[0].node).ty.shape.to_string(),
            "[s0*s1]"
        );
        // Only s0 symbolic: 128 = 16*s0 is the one way.
        let half = TensorType::new(DType::F32, shape(&[Dim::sym("s0"), Dim::Const(16)]));
        let general = generalise_graph(&g, &[half], &binding(&[8]), false).unwrap();
        assert_eq!(
            general.node(general.outputs[0].node).ty.shape.to_string(),
            "[16*s0]"
        );
        // An input type that does not fit the trace is refused at the node.
        let wrong = TensorType::new(DType::F32, shape(&[Dim::sym("s0"), Dim::Const(3)]));
        let refusal = generalise_graph(&g, &[wrong], &binding(&[8]), false).unwrap_err();
        assert!(refusal.node.contains("reshape"), "{refusal}");
    }

    #[test]
    fn a_size_scalar_becomes_a_sum_of_ones_only_when_asked() {
        let mut g = Graph::new("g");
        let x = g.add_input("x", TensorType::new(DType::F32, Shape::from_concrete(&[6])));
        let count = g
            .add(
                Op::Full {
                    value: Scalar::Float(6.0),
                    shape: Shape::from_concrete(&[]),
                    dtype: DType::F32,
                },
                &[],
                Default::default(),
            )
            .unwrap();
        let y = g
            .add(
                Op::Binary(crate::ir::BinaryOp::Div),
                &[x, count],
                Default::default(),
            )
            .unwrap();
        g.add_output("y", y);
        let b = binding(&[6]);
        let sym = TensorType::new(DType::F32, shape(&[Dim::sym("s0")]));
        let kept = generalise_graph(&g, std::slice::from_ref(&sym), &b, false).unwrap();
        assert_eq!(kept.nodes.len(), 3);
        let sized = generalise_graph(&g, &[sym], &b, true).unwrap();
        assert_eq!(sized.nodes.len(), 4, "{sized}");
        assert!(sized.to_string().contains("shape=[s0]"), "{sized}");
    }
}
