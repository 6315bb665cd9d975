//! The exact GELU as exporters write it, `x · ½ · (1 + erf(x/√2))` (PyTorch:
//! `Div(x, √2) → Erf → Add 1 → Mul x → Mul ½`, or with `Mul(x, ½)` first),
//! recognised among a graph's nodes and translated to tessera's `gelu` op:
//! the same function, which tessera computes in one fused step rather than
//! through an erf decomposition. Only chains whose intermediate values
//! nothing else reads are taken.

use std::collections::HashMap;

use crate::builder::{lit_floats, Ctx};
use crate::proto::NodeProto;

/// What the node loop does with a node.
#[derive(Clone, Debug, PartialEq)]
pub enum Plan {
    /// Converted as usual.
    Convert,
    /// Part of a recognised chain: nothing to do.
    Skip,
    /// The end of a chain: its output is `gelu(x)`.
    Gelu(String),
}

/// The plan for each of `nodes`; `outputs` are the names read from outside
/// the node list (the graph's outputs).
pub fn plan(ctx: &mut Ctx, nodes: &[NodeProto], outputs: &[String]) -> Vec<Plan> {
    let mut plans = vec![Plan::Convert; nodes.len()];
    let mut producer: HashMap<&str, usize> = HashMap::new();
    let mut readers: HashMap<&str, usize> = HashMap::new();
    for (i, n) in nodes.iter().enumerate() {
        for o in &n.output {
            producer.insert(o.as_str(), i);
        }
        for x in &n.input {
            *readers.entry(x.as_str()).or_default() += 1;
        }
        // A subgraph may read any value: count its reads too.
        for a in &n.attribute {
            for g in a.g.iter().map(|b| &**b).chain(a.graphs.iter()) {
                for sn in &g.node {
                    for x in &sn.input {
                        *readers.entry(x.as_str()).or_default() += 1;
                    }
                }
            }
        }
    }
    for o in outputs {
        *readers.entry(o.as_str()).or_default() += 1;
    }
    // The scalar value of a name: a Constant node's, or a known value.
    let mut scalar = |name: &str| -> Option<f64> {
        if let Some(&i) = producer.get(name) {
            let n = &nodes[i];
            if n.op_type != "Constant" {
                return None;
            }
            let a = n
                .attribute
                .iter()
                .find(|a| a.name == "value" || a.name == "value_float")?;
            if a.name == "value_float" {
                return Some(a.f as f64);
            }
            let lit = crate::tensor::read_literal(a.t.as_ref()?, None, "a constant").ok()?;
            return (lit.data.len() == 1).then(|| lit_floats(&lit)[0]);
        }
        let v = ctx.values.get(name)?.clone();
        let id = v.id?;
        let lit = ctx.fold(id).ok()??;
        (lit.data.len() == 1).then(|| lit_floats(&lit)[0])
    };
    let near = |v: Option<f64>, want: f64| v.is_some_and(|v| (v - want).abs() <= 1e-6 * want.abs());
    let only_read_once = |name: &str| readers.get(name).copied() == Some(1);
    let single =
        |n: &NodeProto, op: &str| n.op_type == op && n.domain.is_empty() && n.output.len() == 1;
    let mut matches = Vec::new();
    for (ei, e) in nodes.iter().enumerate() {
        if !single(e, "Erf") || e.input.len() != 1 {
            continue;
        }
        // x/√2 (or x·(1/√2)).
        let Some(&di) = producer.get(e.input[0].as_str()) else {
            continue;
        };
        let d = &nodes[di];
        if d.input.len() != 2 {
            continue;
        }
        let divided = single(d, "Div") && near(scalar(&d.input[1]), std::f64::consts::SQRT_2);
        let multiplied =
            single(d, "Mul") && near(scalar(&d.input[1]), std::f64::consts::FRAC_1_SQRT_2);
        if !(divided || multiplied) {
            continue;
        }
        let x = d.input[0].clone();
        if !only_read_once(&d.output[0]) || !only_read_once(&e.output[0]) {
            continue;
        }
        // + 1.
        let adds: Vec<usize> = (0..nodes.len())
            .filter(|&i| single(&nodes[i], "Add") && nodes[i].input.contains(&e.output[0]))
            .collect();
        let [ai] = adds[..] else { continue };
        let add = &nodes[ai];
        let other = if add.input[0] == e.output[0] {
            &add.input[1]
        } else {
            &add.input[0]
        };
        if !near(scalar(other), 1.0) || !only_read_once(&add.output[0]) {
            continue;
        }
        // The product with x and ½, in either order.
        let readers_of = |name: &str| -> Vec<usize> {
            (0..nodes.len())
                .filter(|&i| single(&nodes[i], "Mul") && nodes[i].input.iter().any(|v| v == name))
                .collect()
        };
        let [mi] = readers_of(&add.output[0])[..] else {
            continue;
        };
        let m = &nodes[mi];
        let m_other = if m.input[0] == add.output[0] {
            &m.input[1]
        } else {
            &m.input[0]
        };
        let (end, extra) = if *m_other == x {
            // (x·(1 + erf))·½
            if !only_read_once(&m.output[0]) {
                continue;
            }
            let [hi] = readers_of(&m.output[0])[..] else {
                continue;
            };
            let h = &nodes[hi];
            let h_other = if h.input[0] == m.output[0] {
                &h.input[1]
            } else {
                &h.input[0]
            };
            if !near(scalar(h_other), 0.5) {
                continue;
            }
            (hi, mi)
        } else {
            // (x·½)·(1 + erf)
            let Some(&hi) = producer.get(m_other.as_str()) else {
                continue;
            };
            let h = &nodes[hi];
            if !single(h, "Mul") || !only_read_once(&h.output[0]) {
                continue;
            }
            let h_other = if h.input[0] == x {
                &h.input[1]
            } else if h.input[1] == x {
                &h.input[0]
            } else {
                continue;
            };
            if !near(scalar(h_other), 0.5) {
                continue;
            }
            (mi, hi)
        };
        matches.push((x, [di, ei, ai, extra], end));
    }
    for (x, skipped, end) in matches {
        for s in skipped {
            plans[s] = Plan::Skip;
        }
        plans[end] = Plan::Gelu(x);
    }
    plans
}
