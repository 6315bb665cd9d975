//! Control flow unrolled at import: `If` with a condition known when the
//! model is imported takes its branch; `Loop` runs its body once per
//! iteration while the trip count and the condition stay known; `Scan`
//! runs its body once per step of the scanned axis. Each body is converted
//! like the main graph, seeing the enclosing graph's values.

use tessera::ir::{Dim, Literal, LiteralData, NodeId};
use tessera::{DType, Error, ErrorKind, Result};

use super::shape::dims_val;
use crate::builder::{lit_ints, Ctx, DimOrNeg, Val};
use crate::proto::GraphProto;

fn graph_attr(c: &Ctx, name: &str) -> Result<GraphProto> {
    c.attr(name)
        .and_then(|a| a.g.as_deref().cloned())
        .ok_or_else(|| c.bad(format!("no `{name}` graph")))
}

/// Runs `g` with its inputs bound to `args`; returns its outputs. The
/// bindings and the body's values are gone afterwards.
fn run_subgraph(c: &mut Ctx, g: &GraphProto, args: Vec<Val>) -> Result<Vec<Val>> {
    if args.len() != g.input.len() {
        return Err(c.bad(format!(
            "the body `{}` takes {} inputs, given {}",
            g.name,
            g.input.len(),
            args.len()
        )));
    }
    let saved_values = c.values.clone();
    let (node, inputs, meta, sub_line) =
        (c.node.clone(), c.inputs.clone(), c.meta.clone(), c.sub_line);
    c.sub_line = meta.location.as_ref().map(|l| l.line);
    for (vi, v) in g.input.iter().zip(args) {
        c.values.insert(vi.name.clone(), v);
    }
    let result = (|| -> Result<Vec<Val>> {
        for t in &g.initializer {
            let lit = crate::tensor::read_literal(t, None, &format!("initializer `{}`", t.name))?;
            let id = c.constant(lit)?;
            c.values.insert(t.name.clone(), Val::node(id));
        }
        let names: Vec<String> = g.output.iter().map(|o| o.name.clone()).collect();
        super::convert_nodes(c, &g.node, &names)?;
        g.output
            .iter()
            .map(|o| {
                c.values.get(&o.name).cloned().ok_or_else(|| {
                    Error::new(
                        ErrorKind::Parse,
                        format!("the body's output `{}` is computed by no node", o.name),
                    )
                })
            })
            .collect()
    })();
    c.values = saved_values;
    c.node = node;
    c.inputs = inputs;
    c.meta = meta;
    c.sub_line = sub_line;
    result
}

/// The value of `v` when known at import time, as integers.
fn known_ints(c: &mut Ctx, v: &Val, what: &str) -> Result<Vec<i64>> {
    if let Some(ints) = v.dims.as_ref().and_then(|d| d.ints()) {
        return Ok(ints);
    }
    let id = c.materialise(v)?;
    match c.fold(id)? {
        Some(lit) => Ok(lit_ints(&lit)),
        None => Err(c.unsupported(format!(
            "{what} must be known when the model is imported (control flow is unrolled)"
        ))),
    }
}

fn bool_scalar(c: &mut Ctx, b: bool) -> Result<Val> {
    let id = c.constant(Literal {
        dtype: DType::Bool,
        shape: vec![],
        data: LiteralData::Bool(vec![b]),
    })?;
    Ok(Val::node(id))
}

pub(super) fn if_op(c: &mut Ctx) -> Result<Vec<Val>> {
    let cond = c.val(0)?.clone();
    let cond = known_ints(c, &cond, "the condition of If")?;
    let branch = if cond.first().copied().unwrap_or(0) != 0 {
        graph_attr(c, "then_branch")?
    } else {
        graph_attr(c, "else_branch")?
    };
    run_subgraph(c, &branch, Vec::new())
}

/// The most iterations a Loop is unrolled to.
const MAX_ITERATIONS: i64 = 4096;

/// Joins per-iteration values along a new dim `axis`.
fn stack(c: &mut Ctx, parts: &[Val], axis: i64) -> Result<NodeId> {
    let ids = parts
        .iter()
        .map(|v| c.materialise(v))
        .collect::<Result<Vec<_>>>()?;
    let rank = c.rank(ids[0]);
    let a = if axis < 0 {
        axis + rank as i64 + 1
    } else {
        axis
    };
    if a < 0 || a > rank as i64 {
        return Err(c.bad(format!("scan output axis {axis} for rank {rank}")));
    }
    let a = a as usize;
    let ups = ids
        .iter()
        .map(|&id| c.unsqueeze(id, a))
        .collect::<Result<Vec<_>>>()?;
    c.cat(&ups, a)
}

pub(super) fn loop_op(c: &mut Ctx) -> Result<Vec<Val>> {
    let body = graph_attr(c, "body")?;
    let trips = if c.has_input(0) {
        let v = c.val(0)?.clone();
        known_ints(c, &v, "the trip count of Loop")?[0]
    } else {
        i64::MAX
    };
    let mut cond = if c.has_input(1) {
        let v = c.val(1)?.clone();
        known_ints(c, &v, "the condition of Loop")?[0] != 0
    } else {
        true
    };
    let n_inputs = c.node.input.len();
    let mut carried: Vec<Val> = (2..n_inputs)
        .map(|i| c.val(i).cloned())
        .collect::<Result<_>>()?;
    let n = carried.len();
    let n_scan = body
        .output
        .len()
        .checked_sub(1 + n)
        .ok_or_else(|| c.bad("the body has too few outputs"))?;
    let mut scans: Vec<Vec<Val>> = vec![Vec::new(); n_scan];
    let mut i = 0i64;
    while i < trips && cond {
        if i >= MAX_ITERATIONS {
            return Err(c.unsupported(format!("a Loop of more than {MAX_ITERATIONS} iterations")));
        }
        let iter = dims_val(c, vec![DimOrNeg::Dim(Dim::Const(i as usize))], true);
        let mut args = vec![iter, bool_scalar(c, cond)?];
        args.extend(carried.iter().cloned());
        let outs = run_subgraph(c, &body, args)?;
        cond = known_ints(c, &outs[0], "the condition a Loop body computes")?[0] != 0;
        carried = outs[1..1 + n].to_vec();
        for (k, v) in outs[1 + n..].iter().enumerate() {
            scans[k].push(v.clone());
        }
        i += 1;
    }
    let mut out = carried;
    for s in scans {
        if s.is_empty() {
            return Err(c.unsupported("the scan output of a Loop that runs no iteration"));
        }
        out.push(Val::node(stack(c, &s, 0)?));
    }
    Ok(out)
}

pub(super) fn scan(c: &mut Ctx) -> Result<Vec<Val>> {
    if c.opset < 9 {
        return scan8(c);
    }
    let body = graph_attr(c, "body")?;
    let m = c.attr_i("num_scan_inputs", 0) as usize;
    let total = c.node.input.len();
    let n = total
        .checked_sub(m)
        .ok_or_else(|| c.bad("more scan inputs than inputs"))?;
    let in_axes = c.attr_ints("scan_input_axes").unwrap_or_else(|| vec![0; m]);
    let in_dirs = c
        .attr_ints("scan_input_directions")
        .unwrap_or_else(|| vec![0; m]);
    let mut states: Vec<Val> = (0..n).map(|i| c.val(i).cloned()).collect::<Result<_>>()?;
    let mut seqs = Vec::with_capacity(m);
    let mut len = None;
    for j in 0..m {
        let x = c.x(n + j)?;
        let axis = c.axis(*in_axes.get(j).unwrap_or(&0), c.rank(x))?;
        let l = c.concrete(x, "a scan input")?[axis];
        if len.is_some_and(|v| v != l) {
            return Err(c.bad("scan inputs of different lengths"));
        }
        len = Some(l);
        seqs.push((x, axis, in_dirs.get(j).copied().unwrap_or(0) != 0));
    }
    let len = len.unwrap_or(0);
    let k = body
        .output
        .len()
        .checked_sub(n)
        .ok_or_else(|| c.bad("the body has too few outputs"))?;
    let mut scans: Vec<Vec<Val>> = vec![Vec::new(); k];
    for t in 0..len {
        let mut args = states.clone();
        for &(x, axis, reverse) in &seqs {
            let i = if reverse { len - 1 - t } else { t };
            let s = c.slice(x, axis, i, i + 1, 1)?;
            let mut dims = c.dims(s);
            dims.remove(axis);
            args.push(Val::node(c.reshape(s, dims)?));
        }
        let outs = run_subgraph(c, &body, args)?;
        states = outs[..n].to_vec();
        for (j, v) in outs[n..].iter().enumerate() {
            scans[j].push(v.clone());
        }
    }
    let out_axes = c
        .attr_ints("scan_output_axes")
        .unwrap_or_else(|| vec![0; k]);
    let out_dirs = c
        .attr_ints("scan_output_directions")
        .unwrap_or_else(|| vec![0; k]);
    let mut out = states;
    for (j, mut s) in scans.into_iter().enumerate() {
        if s.is_empty() {
            return Err(c.unsupported("the scan output of an empty scan"));
        }
        if out_dirs.get(j).copied().unwrap_or(0) != 0 {
            s.reverse();
        }
        out.push(Val::node(stack(
            c,
            &s,
            out_axes.get(j).copied().unwrap_or(0),
        )?));
    }
    Ok(out)
}

/// Scan-8: a batch dim first in every state and scan input, the sequence
/// on dim 1 (`sequence_lens`, input 0, must be absent or full); the body
/// runs per batch entry and step.
fn scan8(c: &mut Ctx) -> Result<Vec<Val>> {
    let body = graph_attr(c, "body")?;
    let m = c.attr_i("num_scan_inputs", 0) as usize;
    let total = c.node.input.len();
    let n = total
        .checked_sub(m + 1)
        .ok_or_else(|| c.bad("more scan inputs than inputs"))?;
    if c.attr_ints("directions")
        .is_some_and(|d| d.iter().any(|&v| v != 0))
    {
        return Err(c.unsupported("Scan-8 in reverse"));
    }
    let states: Vec<NodeId> = (1..=n).map(|i| c.x(i)).collect::<Result<_>>()?;
    let seqs: Vec<NodeId> = (n + 1..total).map(|i| c.x(i)).collect::<Result<_>>()?;
    let first = *seqs.first().ok_or_else(|| c.bad("no scan input"))?;
    let sd = c.concrete(first, "a scan input")?;
    let (batch, len) = (sd[0], sd[1]);
    if c.has_input(0) {
        let v = c.val(0)?.clone();
        let lens = known_ints(c, &v, "sequence_lens")?;
        if lens.iter().any(|&l| l != len as i64) {
            return Err(c.unsupported("Scan-8 with sequences shorter than the scan axis"));
        }
    }
    let k = body
        .output
        .len()
        .checked_sub(n)
        .ok_or_else(|| c.bad("the body has too few outputs"))?;
    let pick = |c: &mut Ctx, x: NodeId, dim: usize, i: usize| -> Result<NodeId> {
        let s = c.slice(x, dim, i, i + 1, 1)?;
        let mut dims = c.dims(s);
        dims.remove(dim);
        c.reshape(s, dims)
    };
    let mut final_states: Vec<Vec<Val>> = vec![Vec::new(); n];
    let mut scans: Vec<Vec<Val>> = vec![Vec::new(); k];
    for b in 0..batch {
        let mut st: Vec<Val> = states
            .iter()
            .map(|&x| pick(c, x, 0, b).map(Val::node))
            .collect::<Result<_>>()?;
        let mut per_b: Vec<Vec<Val>> = vec![Vec::new(); k];
        for t in 0..len {
            let mut args = st.clone();
            for &x in &seqs {
                let xb = pick(c, x, 0, b)?;
                args.push(Val::node(pick(c, xb, 0, t)?));
            }
            let outs = run_subgraph(c, &body, args)?;
            st = outs[..n].to_vec();
            for (j, v) in outs[n..].iter().enumerate() {
                per_b[j].push(v.clone());
            }
        }
        for (j, v) in st.into_iter().enumerate() {
            final_states[j].push(v);
        }
        for (j, s) in per_b.into_iter().enumerate() {
            if s.is_empty() {
                return Err(c.unsupported("the scan output of an empty scan"));
            }
            scans[j].push(Val::node(stack(c, &s, 0)?));
        }
    }
    let mut out = Vec::new();
    for s in final_states.into_iter().chain(scans) {
        out.push(Val::node(stack(c, &s, 0)?));
    }
    Ok(out)
}
