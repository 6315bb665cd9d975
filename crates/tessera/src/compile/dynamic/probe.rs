//! AOT autograd of a symbolic graph, at probe sizes.
//!
//! The joint graph is traced (autograd runs on traced tensors), and tracing
//! needs concrete shapes. So the symbolic forward is made concrete at
//! *probe* sizes — distinct primes, as large as the graph allows, none
//! dividing any of its static sizes — its forward
//! and backward are traced there, and both are generalised back by value
//! matching (see [`super::matching`]), scalar sizes included (the `1/count`
//! of a mean's gradient). With such values every match is unambiguous.
//!
//! What value matching cannot see — a size folded into some other constant
//! — is caught by doing it twice, at two sets of probes: the two
//! generalised graphs must be the same graph, else the symbolic backward
//! is refused and the caller compiles for the concrete sizes.

use std::sync::Arc;

use super::matching::{generalise_graph, Binding};
use crate::autograd::{aot_autograd, AotGraphs, Partition};
use crate::error::{Error, ErrorKind, Result};
use crate::ir::{Dim, Graph, Op, Shape, TensorType};
use crate::tensor::interpret::{concretise, run_graph};
use crate::tensor::trace::{trace, Traced};

/// Probe sizes are primes at most this (products of three stay far within
/// the size limit even times a wide feature dim).
const MAX_PROBE: usize = 1300;

/// [`aot_autograd`] of a graph with symbolic shapes: its forward and
/// backward, both over the graph's symbols.
pub fn aot_symbolic(graph: &Graph, wrt: &[usize], partition: Partition) -> Result<AotGraphs> {
    let symbols = symbols_of(graph);
    let [a, b] = probe_values(graph, &symbols)?;
    let first = at_probe(graph, wrt, partition, &symbols, &a)?;
    let second = at_probe(graph, wrt, partition, &symbols, &b)?;
    let same = |a: &Graph, b: &Graph| a.to_string() == b.to_string();
    if !same(&first.forward, &second.forward) || !same(&first.backward, &second.backward) {
        return Err(refused(
            graph,
            "its forward or backward depends on the sizes other than through shapes".into(),
        ));
    }
    Ok(first)
}

/// The trace of a graph whose inputs declare symbolic dims (a `.tir`
/// program, a PyTorch graph with dynamic sizes), over those symbols: the
/// graph run by the interpreter under tracing at two sets of probe sizes,
/// each trace generalised back (unambiguous at primes), and the two
/// required to be the same graph. What then runs at any binding of the
/// symbols, compiled once.
pub fn trace_symbolic(graph: &Graph) -> Result<Traced> {
    let symbols = symbols_of(graph);
    let [a, b] = probe_values(graph, &symbols)?;
    let first = trace_at_probe(graph, &symbols, &a)?;
    let second = trace_at_probe(graph, &symbols, &b)?;
    if first.graph.to_string() != second.graph.to_string() {
        return Err(refused(
            graph,
            "its trace depends on the sizes other than through shapes".into(),
        ));
    }
    Ok(first)
}

fn trace_at_probe(graph: &Graph, symbols: &[Arc<str>], primes: &[usize]) -> Result<Traced> {
    let binding = probe_binding(graph, symbols, primes);
    let concrete = concretise(graph, binding.map())?;
    let inputs: Vec<(String, TensorType)> = concrete
        .inputs
        .iter()
        .map(|&id| (concrete.display_name(id), concrete.node(id).ty.clone()))
        .collect();
    let traced = crate::autograd::no_grad(|| {
        trace(&graph.name, &inputs, |args| {
            Ok(run_graph(&concrete, args)?
                .into_iter()
                .map(|(name, t)| (name.to_string(), t))
                .collect())
        })
    })?;
    if !traced.breaks.is_empty() || !traced.lifted.is_empty() || !traced.state.is_empty() {
        return Err(refused(
            graph,
            "its trace reads values or lifts tensors".into(),
        ));
    }
    let general = back_to_symbols(&traced.graph, &binding)?;
    Ok(Traced {
        graph: general,
        ..traced
    })
}

fn probe_binding(graph: &Graph, symbols: &[Arc<str>], primes: &[usize]) -> Binding {
    let bounds: Vec<(usize, Arc<str>)> = symbols
        .iter()
        .filter_map(|s| Some((upper_bound(graph, s)?, s.clone())))
        .collect();
    Binding::new(
        symbols
            .iter()
            .cloned()
            .zip(primes.iter().copied())
            .collect(),
    )
    .with_differences(&bounds)
}

/// Two probe sizes per symbol: distinct primes, as large as the symbol's
/// bounds allow (a slice `0..s1` of a table of 16 rows needs `s1 <= 16`),
/// none dividing a constant dim of the graph (so no static size is a
/// multiple of one).
fn probe_values(graph: &Graph, symbols: &[Arc<str>]) -> Result<[Vec<usize>; 2]> {
    let constants: Vec<usize> = graph
        .nodes
        .iter()
        .flat_map(|n| n.ty.shape.dims().iter().filter_map(Dim::as_const))
        .filter(|&c| c >= 2)
        .collect();
    let mut used: Vec<usize> = Vec::new();
    let mut rounds = [Vec::new(), Vec::new()];
    for s in symbols {
        let bound = upper_bound(graph, s).unwrap_or(MAX_PROBE).min(MAX_PROBE);
        let mut found = (2..=bound)
            .rev()
            .filter(|&p| is_prime(p) && !used.contains(&p))
            .filter(|&p| constants.iter().all(|c| !c.is_multiple_of(p)));
        let (Some(x), Some(y)) = (found.next(), found.next()) else {
            return Err(refused(
                graph,
                format!("no two probe sizes for {s} within its bound {bound}"),
            ));
        };
        used.extend([x, y]);
        rounds[0].push(x);
        rounds[1].push(y);
    }
    Ok(rounds)
}

/// The least size a slice `0..s` of a concrete dim allows `s`, if any
/// slice bounds it.
fn upper_bound(graph: &Graph, symbol: &Arc<str>) -> Option<usize> {
    graph
        .nodes
        .iter()
        .filter_map(|n| match &n.op {
            Op::Slice { dim, end, .. } if *end == Dim::sym(symbol) => {
                graph.node(n.inputs[0]).ty.shape.dims()[*dim].as_const()
            }
            _ => None,
        })
        .min()
}

fn is_prime(n: usize) -> bool {
    n >= 2
        && (2..)
            .take_while(|k| k * k <= n)
            .all(|k| !n.is_multiple_of(k))
}

/// The symbols of `graph`'s inputs, in order of first appearance.
fn symbols_of(graph: &Graph) -> Vec<Arc<str>> {
    let mut out: Vec<Arc<str>> = Vec::new();
    for &id in &graph.inputs {
        for dim in graph.node(id).ty.shape.dims() {
            for s in dim.symbols() {
                if !out.contains(&s) {
                    out.push(s);
                }
            }
        }
    }
    out
}

fn at_probe(
    graph: &Graph,
    wrt: &[usize],
    partition: Partition,
    symbols: &[Arc<str>],
    primes: &[usize],
) -> Result<AotGraphs> {
    let binding = probe_binding(graph, symbols, primes);
    let concrete = concretise(graph, binding.map())?;
    let aot = aot_autograd(&concrete, wrt, partition)?;
    let forward = back_to_symbols(&aot.forward, &binding)?;
    let backward = back_to_symbols(&aot.backward, &binding)?;
    Ok(AotGraphs {
        forward,
        backward,
        ..aot
    })
}

/// `graph`, traced at the probe `binding`, over the symbols again: every
/// input dim that is a (multiple of a) product of probe values is that.
fn back_to_symbols(graph: &Graph, binding: &Binding) -> Result<Graph> {
    let inputs: Vec<TensorType> = graph
        .inputs
        .iter()
        .map(|&id| {
            let ty = &graph.node(id).ty;
            let dims = ty
                .shape
                .dims()
                .iter()
                .map(|d| match d.as_const() {
                    Some(v) => binding.candidates(v).swap_remove(0),
                    None => d.clone(),
                })
                .collect::<Vec<Dim>>();
            TensorType::new(ty.dtype, Shape(dims))
        })
        .collect();
    generalise_graph(graph, &inputs, binding, true).map_err(|r| {
        refused(
            graph,
            format!("at {}: {r}", super::matching::describe(binding)),
        )
    })
}

fn refused(graph: &Graph, why: String) -> Error {
    Error::new(
        ErrorKind::Unsupported,
        format!("the symbolic graph of `{}` is not built: {why}", graph.name),
    )
}
