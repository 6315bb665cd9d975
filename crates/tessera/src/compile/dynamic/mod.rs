//! Automatic dynamic shapes: a captured graph generalised over some of its
//! inputs' dims, so that one executable serves every size of those dims.
//!
//! Tracing needs concrete shapes, so every call still traces with its own
//! sizes; the traced graph is then generalised: the dynamic dims become
//! symbols (one symbol per distinct size, "duck sizing", so that dims equal
//! in the trace stay provably equal), the sizes the trace baked into op
//! attributes (a reshape's target, a mask's shape, a slice's end) are
//! re-expressed over the symbols by value matching ([`matching`]), and
//! every node's type is inferred again and checked against the trace. The
//! cache key is the generalised graph with the dynamic sizes masked, so
//! calls whose traces differ only in those sizes share one executable, and
//! a trace whose structure depends on a size (a size-dependent constant,
//! control flow) gives another key and compiles anew. A graph that does not
//! generalise stays concrete, and the refusal names the node and why.
//!
//! The backward of a symbolic graph is made at *probe* sizes ([`probe`]):
//! AOT autograd traces the graph made concrete at distinctive primes, and
//! the forward and backward it returns are generalised back.
//!
//! Sizes 0 and 1 stay concrete (broadcasting and empty tensors behave
//! differently), as in torch.compile.
//!
//! Fusion needs concrete shapes too: the symbolic executable fuses its
//! graph once per binding of the sizes it is called with, and keeps each
//! plan (`SizedPlans` in `executable.rs`), so every size runs fused
//! without a retrace or a recompile.

use std::collections::BTreeSet;
use std::sync::Arc;

use super::cache::structure_key;
use super::InputGuard;
use crate::ir::{Dim, Graph, TensorType};
use crate::tensor::trace::Traced;

mod matching;
mod probe;

pub use matching::{Binding, Refusal};
pub use probe::{aot_symbolic, trace_symbolic};

/// (user input, dim) pairs that are dynamic.
pub type DynamicDims = BTreeSet<(usize, usize)>;

/// A trace as the cache sees it.
pub struct Generalised {
    pub key: u64,
    /// The generalised trace, when the dynamic dims generalise the graph.
    pub traced: Option<Traced>,
    /// The dims the graph is generalised over (empty when concrete).
    pub dims: DynamicDims,
    /// Why dynamic dims were asked for but the graph stays concrete.
    pub refusal: Option<Refusal>,
}

/// The trace as the cache sees it: generalised over `dims` (when there are
/// any, the trace has no graph breaks and the graph generalises), with its
/// key; else the concrete trace's key.
pub fn view(traced: &Traced, guards: &[InputGuard], dims: &DynamicDims) -> Generalised {
    let general = match traced.breaks.is_empty() {
        true => generalise(&traced.graph, guards, dims),
        false => None,
    };
    let concrete = |refusal| Generalised {
        key: structure_key(&traced.graph, guards, &traced.lifted),
        traced: None,
        dims: DynamicDims::new(),
        refusal,
    };
    match general {
        Some(Ok((graph, masked))) => Generalised {
            key: structure_key(&graph, &masked, &traced.lifted),
            traced: Some(Traced {
                graph,
                lifted: traced.lifted.clone(),
                materialized: Vec::new(),
                breaks: Vec::new(),
                seeds: traced.seeds.clone(),
                state: traced.state.clone(),
            }),
            dims: dims.clone(),
            refusal: None,
        },
        Some(Err(refusal)) => concrete(Some(refusal)),
        None => concrete(None),
    }
}

/// `graph` with the `dims` of its first `guards.len()` inputs symbolic, and
/// the guards with those sizes masked (replaced by their symbol's number);
/// `None` when no dim is generalised, the reason when the graph does not
/// generalise (a size that no expression of the symbols gives).
pub fn generalise(
    graph: &Graph,
    guards: &[InputGuard],
    dims: &DynamicDims,
) -> Option<Result<(Graph, Vec<InputGuard>), Refusal>> {
    let generalises = guards.iter().enumerate().any(|(i, guard)| {
        guard
            .shape
            .iter()
            .enumerate()
            .any(|(d, &size)| size > 1 && dims.contains(&(i, d)))
    });
    if !generalises {
        // Every call asks (no dynamic dims is the common case): no copy.
        return None;
    }
    // Sizes that meet a constant of the same value (a feature dim made
    // symbolic by `dynamic = true` meeting a weight's) are specialised:
    // made concrete again, and the rest generalised anew.
    let mut specialised: Vec<usize> = Vec::new();
    let mut first: Option<Refusal> = None;
    loop {
        let (attempt, symbols) = generalise_except(graph, guards, dims, &specialised);
        let Err(refusal) = attempt else {
            return Some(attempt);
        };
        let suspects: Vec<usize> = symbols
            .iter()
            .filter(|(name, size)| refusal.suspects.contains(name) && !specialised.contains(size))
            .map(|(_, size)| *size)
            .collect();
        // The first refusal says what the user's graph did.
        let first = first.get_or_insert(refusal);
        if suspects.is_empty() {
            return Some(Err(first.clone()));
        }
        specialised.extend(suspects);
    }
}

/// One attempt of [`generalise`], with the dims of the `specialised` sizes
/// kept concrete; also the symbols it used, with their sizes.
#[allow(clippy::type_complexity)]
fn generalise_except(
    graph: &Graph,
    guards: &[InputGuard],
    dims: &DynamicDims,
    specialised: &[usize],
) -> (
    Result<(Graph, Vec<InputGuard>), Refusal>,
    Vec<(Arc<str>, usize)>,
) {
    let (input_types, masked, symbols) = symbolic_inputs(graph, guards, dims, specialised);
    if symbols.is_empty() {
        let refusal = Refusal {
            node: "every input".into(),
            why: format!("each dynamic size meets a constant of its value: {specialised:?}"),
            suspects: Vec::new(),
        };
        return (Err(refusal), symbols);
    }
    let binding = Binding::new(symbols.clone());
    let attempt = matching::generalise_graph(graph, &input_types, &binding, false);
    (attempt.map(|g| (g, masked)), symbols)
}

/// The inputs' types with the dynamic dims symbolic (one symbol per
/// distinct size, "duck sizing"), the guards with those sizes masked, and
/// the symbols with their sizes.
#[allow(clippy::type_complexity)]
fn symbolic_inputs(
    graph: &Graph,
    guards: &[InputGuard],
    dims: &DynamicDims,
    specialised: &[usize],
) -> (Vec<TensorType>, Vec<InputGuard>, Vec<(Arc<str>, usize)>) {
    let mut masked = guards.to_vec();
    let mut symbols: Vec<(Arc<str>, usize)> = Vec::new();
    let mut input_types = Vec::with_capacity(graph.inputs.len());
    for (i, &id) in graph.inputs.iter().enumerate() {
        let mut ty = graph.node(id).ty.clone();
        if let Some(guard) = guards.get(i) {
            for (d, dim) in ty.shape.0.iter_mut().enumerate() {
                let size = guard.shape[d];
                if !dims.contains(&(i, d)) || size <= 1 || specialised.contains(&size) {
                    continue;
                }
                let s = match symbols.iter().position(|(_, v)| *v == size) {
                    Some(s) => s,
                    None => {
                        let name: Arc<str> = Arc::from(format!("s{}", symbols.len()).as_str());
                        symbols.push((name, size));
                        symbols.len() - 1
                    }
                };
                *dim = Dim::sym(&symbols[s].0);
                masked[i].shape[d] = usize::MAX - s;
            }
        }
        input_types.push(ty);
    }
    (input_types, masked, symbols)
}

/// The dims whose sizes differ between two calls' guards (same rank).
pub fn changed_dims(before: &[InputGuard], now: &[InputGuard]) -> DynamicDims {
    let mut dims = DynamicDims::new();
    for (i, (b, n)) in before.iter().zip(now).enumerate() {
        if b.shape.len() != n.shape.len() {
            continue;
        }
        for d in 0..b.shape.len() {
            if b.shape[d] != n.shape[d] {
                dims.insert((i, d));
            }
        }
    }
    dims
}

/// Every dim of every input (`dynamic = true`).
pub fn all_dims(guards: &[InputGuard]) -> DynamicDims {
    guards
        .iter()
        .enumerate()
        .flat_map(|(i, g)| (0..g.shape.len()).map(move |d| (i, d)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::trace::trace;
    use crate::{DType, Tensor};

    fn traced(n: usize, f: impl FnOnce(&[Tensor]) -> Tensor) -> (Graph, Vec<InputGuard>) {
        let (t, guards) = traced_full(n, f);
        (t.graph, guards)
    }

    #[test]
    fn equal_sizes_share_a_symbol_and_the_types_follow() {
        let f = |a: &[Tensor]| (&a[0] + &a[1]).softmax(-1).sum(&[0], false);
        let (g, guards) = traced(8, f);
        let dims: DynamicDims = [(0, 0), (1, 0)].into();
        let (sym, masked) = generalise(&g, &guards, &dims)
            .unwrap()
            .expect("generalises");
        assert_eq!(sym.node(sym.inputs[0]).ty.shape.to_string(), "[s0,4]");
        assert_eq!(sym.node(sym.inputs[1]).ty.shape.to_string(), "[s0,4]");
        assert_eq!(masked[0].shape, vec![usize::MAX, 4]);
        // The same graph at another size generalises to the same thing.
        let (g16, guards16) = traced(16, f);
        let (sym16, masked16) = generalise(&g16, &guards16, &dims).unwrap().unwrap();
        assert_eq!(sym.to_string(), sym16.to_string());
        assert_eq!(masked, masked16);
    }

    fn traced_full(n: usize, f: impl FnOnce(&[Tensor]) -> Tensor) -> (Traced, Vec<InputGuard>) {
        let x = Tensor::zeros(&[n, 4], DType::F32);
        let y = Tensor::zeros(&[n, 4], DType::F32);
        let t = trace("g", &[("x".into(), x.ty()), ("y".into(), y.ty())], |a| {
            Ok(vec![("out".into(), f(a))])
        })
        .unwrap();
        (t, vec![InputGuard::of(&x), InputGuard::of(&y)])
    }

    #[test]
    fn one_key_serves_every_size_of_a_dynamic_dim() {
        let f = |a: &[Tensor]| (&a[0] * &a[1]).exp();
        let dims: DynamicDims = [(0, 0), (1, 0)].into();
        let (t8, g8) = traced_full(8, f);
        let (t16, g16) = traced_full(16, f);
        let (v8, v16) = (view(&t8, &g8, &dims), view(&t16, &g16, &dims));
        assert_eq!(v8.key, v16.key);
        let general = v8.traced.expect("generalised");
        assert_eq!(
            general
                .graph
                .node(general.graph.inputs[0])
                .ty
                .shape
                .to_string(),
            "[s0,4]"
        );
        assert!(general.breaks.is_empty() && general.materialized.is_empty());
        // Without dynamic dims: the concrete graphs, one key per size.
        let none = DynamicDims::new();
        let (c8, c16) = (view(&t8, &g8, &none), view(&t16, &g16, &none));
        assert!(c8.traced.is_none());
        assert_ne!(c8.key, c16.key);
        assert_eq!(c8.key, structure_key(&t8.graph, &g8, &t8.lifted));
    }

    #[test]
    fn a_trace_with_graph_breaks_stays_concrete() {
        let (mut t, g) = traced_full(8, |a| &a[0] + &a[1]);
        t.breaks.push(crate::error::SourceLoc::caller());
        let v = view(&t, &g, &all_dims(&g));
        assert!(v.traced.is_none());
        assert_eq!(v.key, structure_key(&t.graph, &g, &t.lifted));
    }

    #[test]
    fn changed_and_all_dims() {
        let guard = |s: &[usize]| InputGuard::of(&Tensor::zeros(s, DType::F32));
        let before = [guard(&[8, 4]), guard(&[2])];
        let now = [guard(&[8, 5]), guard(&[2, 2])];
        assert_eq!(changed_dims(&before, &now), DynamicDims::from([(0, 1)]));
        assert!(changed_dims(&before, &before).is_empty());
        assert_eq!(
            all_dims(&now),
            DynamicDims::from([(0, 0), (0, 1), (1, 0), (1, 1)])
        );
    }

    #[test]
    fn baked_sizes_are_matched_and_what_cannot_be_is_refused_at_its_node() {
        // reshape to [8 * 4]: the size the trace baked is 4*s0.
        let (g, guards) = traced(8, |a| a[0].reshape(&[32]) * 2.0);
        let (sym, _) = generalise(&g, &guards, &[(0, 0)].into()).unwrap().unwrap();
        assert!(sym.to_string().contains("shape=[4*s0]"), "{sym}");
        // arange(8) has no symbolic form: the add that meets s0 refuses.
        let (g, guards) = traced(8, |a| {
            let r = Tensor::arange(0.0, 8.0, 1.0, DType::F32).unsqueeze(1);
            &a[0] + &r
        });
        let refusal = generalise(&g, &guards, &[(0, 0)].into())
            .unwrap()
            .unwrap_err();
        assert!(refusal.node.contains("(add"), "{refusal}");
        assert!(refusal.why.contains("does not infer"), "{refusal}");
        // Sizes of 1 are not generalised.
        let (g1, guards1) = traced(1, |a| &a[0] + &a[1]);
        assert!(generalise(&g1, &guards1, &[(0, 0)].into()).is_none());
        // No dynamic dims: nothing to generalise (the common case).
        assert!(generalise(&g, &guards, &DynamicDims::new()).is_none());
    }
}
