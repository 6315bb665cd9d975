//! RNN, GRU and LSTM unrolled over the sequence: per step, the gates from
//! `X_t·Wᵀ + H_{t−1}·Rᵀ + biases` and the spec's activations (default
//! sigmoid/tanh; `clip`, peepholes, `input_forget`, GRU's
//! `linear_before_reset`), forward, reverse or both directions, `layout`
//! 0 (`[seq, batch, …]`) or 1 (batch first). Sequences shorter than the
//! input (`sequence_lens`) are not mapped.

use tessera::ir::{BinaryOp as B, Dim, NodeId, UnaryOp as U};
use tessera::Result;

use crate::builder::{lit_ints, Ctx, Val};

#[derive(Clone, Copy, PartialEq)]
enum Cell {
    Rnn,
    Gru,
    Lstm,
}

/// An activation by its ONNX name, with its alpha and beta.
fn activate(
    c: &mut Ctx,
    x: NodeId,
    name: &str,
    alpha: Option<f32>,
    beta: Option<f32>,
) -> Result<NodeId> {
    match name.to_ascii_lowercase().as_str() {
        "sigmoid" => c.unary(U::Sigmoid, x),
        "tanh" => c.unary(U::Tanh, x),
        "relu" => c.unary(U::Relu, x),
        "hardsigmoid" => {
            let (a, b) = (alpha.unwrap_or(0.2) as f64, beta.unwrap_or(0.5) as f64);
            let y = c.binary_c(B::Mul, x, a)?;
            let y = c.binary_c(B::Add, y, b)?;
            let y = c.binary_c(B::Minimum, y, 1.0)?;
            c.binary_c(B::Maximum, y, 0.0)
        }
        "leakyrelu" => {
            let a = alpha.unwrap_or(0.01) as f64;
            let neg = c.compare_c(tessera::ir::CompareOp::Lt, x, 0.0)?;
            let ax = c.binary_c(B::Mul, x, a)?;
            c.where_(neg, ax, x)
        }
        "affine" => {
            let y = c.binary_c(B::Mul, x, alpha.unwrap_or(1.0) as f64)?;
            c.binary_c(B::Add, y, beta.unwrap_or(0.0) as f64)
        }
        "scaledtanh" => {
            let y = c.binary_c(B::Mul, x, beta.unwrap_or(1.0) as f64)?;
            let y = c.unary(U::Tanh, y)?;
            c.binary_c(B::Mul, y, alpha.unwrap_or(1.0) as f64)
        }
        "softsign" => {
            let a = c.unary(U::Abs, x)?;
            let d = c.binary_c(B::Add, a, 1.0)?;
            c.binary(B::Div, x, d)
        }
        "softplus" => {
            let e = c.unary(U::Exp, x)?;
            let p = c.binary_c(B::Add, e, 1.0)?;
            c.unary(U::Log, p)
        }
        other => Err(c.unsupported(format!("activation `{other}`"))),
    }
}

/// Rows `[k·h, (k+1)·h)` of dim `dim`.
fn block(c: &mut Ctx, x: NodeId, dim: usize, k: usize, h: usize) -> Result<NodeId> {
    c.slice(x, dim, k * h, (k + 1) * h, 1)
}

/// `x [B, I] · w[gates·H, I]ᵀ`.
fn times_t(c: &mut Ctx, x: NodeId, w: NodeId) -> Result<NodeId> {
    let wt = c.permute(w, vec![1, 0])?;
    c.add(tessera::ir::Op::MatMul, &[x, wt])
}

pub(super) fn rnn(c: &mut Ctx) -> Result<Vec<Val>> {
    cell(c, Cell::Rnn)
}
pub(super) fn gru(c: &mut Ctx) -> Result<Vec<Val>> {
    cell(c, Cell::Gru)
}
pub(super) fn lstm(c: &mut Ctx) -> Result<Vec<Val>> {
    cell(c, Cell::Lstm)
}

fn cell(c: &mut Ctx, kind: Cell) -> Result<Vec<Val>> {
    let gates = match kind {
        Cell::Rnn => 1,
        Cell::Gru => 3,
        Cell::Lstm => 4,
    };
    let mut x = c.x(0)?;
    let (w, r) = (c.x(1)?, c.x(2)?);
    let opt = |c: &mut Ctx, i: usize| -> Result<Option<NodeId>> {
        if c.has_input(i) {
            Ok(Some(c.x(i)?))
        } else {
            Ok(None)
        }
    };
    let bias = opt(c, 3)?;
    let layout = c.attr_i("layout", 0);
    if layout == 1 {
        x = c.permute(x, vec![1, 0, 2])?;
    }
    let xd = c.concrete(x, "a recurrent layer")?;
    if xd.len() != 3 || c.rank(w) != 3 || c.rank(r) != 3 {
        return Err(c.bad(format!(
            "X, W, R must be 3-D, got {}, {}, {}",
            c.ty(x),
            c.ty(w),
            c.ty(r)
        )));
    }
    let (seq, batch) = (xd[0], xd[1]);
    if c.has_input(4) {
        let lens = lit_ints(&c.literal_of(4, "sequence_lens")?);
        if lens.iter().any(|&l| l != seq as i64) {
            return Err(c.unsupported("sequence_lens shorter than the sequence"));
        }
    }
    let h0 = opt(c, 5)?;
    let c0 = if kind == Cell::Lstm { opt(c, 6)? } else { None };
    let peep = if kind == Cell::Lstm { opt(c, 7)? } else { None };
    let wd = c.concrete(w, "W")?;
    let hidden = wd[1] / gates;
    let rdims = c.concrete(r, "R")?;
    let n_dirs = if c.attr_s("direction", "forward") == "bidirectional" {
        2
    } else {
        1
    };
    if hidden == 0
        || wd != [n_dirs, gates * hidden, xd[2]]
        || rdims != [n_dirs, gates * hidden, hidden]
    {
        return Err(c.bad(format!(
            "W {:?} and R {:?} for X {:?}, {n_dirs} direction(s) and {gates} gate(s)",
            wd, rdims, xd
        )));
    }
    let direction = c.attr_s("direction", "forward");
    let dirs: Vec<bool> = match direction.as_str() {
        "forward" => vec![false],
        "reverse" => vec![true],
        "bidirectional" => vec![false, true],
        other => return Err(c.bad(format!("direction `{other}`"))),
    };
    let names: Vec<String> = c
        .attr("activations")
        .map(|a| {
            a.strings
                .iter()
                .map(|s| String::from_utf8_lossy(s).into_owned())
                .collect()
        })
        .unwrap_or_default();
    let alphas = c
        .attr("activation_alpha")
        .map(|a| a.floats.clone())
        .unwrap_or_default();
    let betas = c
        .attr("activation_beta")
        .map(|a| a.floats.clone())
        .unwrap_or_default();
    let per_dir = match kind {
        Cell::Rnn => 1,
        _ => 3,
    };
    let clip = c.attr("clip").map(|a| a.f as f64);
    let input_forget = c.attr_i("input_forget", 0) != 0;
    let lbr = c.attr_i("linear_before_reset", 0) != 0;
    let dtype = c.dtype(x);
    let mut ys = Vec::new();
    let mut hs = Vec::new();
    let mut cs = Vec::new();
    for (d, &reverse) in dirs.iter().enumerate() {
        let act = |c: &mut Ctx, v: NodeId, k: usize| -> Result<NodeId> {
            let i = d * per_dir + k;
            let default = match (kind, k) {
                (Cell::Rnn, _) => "Tanh",
                (_, 0) => "Sigmoid",
                _ => "Tanh",
            };
            let name = names.get(i).map(String::as_str).unwrap_or(default);
            activate(c, v, name, alphas.get(i).copied(), betas.get(i).copied())
        };
        let pick = |c: &mut Ctx, t: NodeId| -> Result<NodeId> {
            let s = c.slice(t, 0, d, d + 1, 1)?;
            let mut dims = c.dims(s);
            dims.remove(0);
            c.reshape(s, dims)
        };
        let (wd_, rd_) = (pick(c, w)?, pick(c, r)?);
        let (wb, rb) = match bias {
            Some(b) => {
                let b = pick(c, b)?;
                (
                    Some(block(c, b, 0, 0, gates * hidden)?),
                    Some(block(c, b, 0, 1, gates * hidden)?),
                )
            }
            None => (None, None),
        };
        let zeros = || [Dim::Const(batch), Dim::Const(hidden)];
        let mut h = match h0 {
            Some(h) => pick(c, h)?,
            None => {
                let z = c.scalar(0.0, dtype)?;
                c.expand(z, zeros().to_vec())?
            }
        };
        let mut cell_state = match c0 {
            Some(v) => pick(c, v)?,
            None => {
                let z = c.scalar(0.0, dtype)?;
                c.expand(z, zeros().to_vec())?
            }
        };
        let pv = match peep {
            Some(p) => Some(pick(c, p)?),
            None => None,
        };
        let mut outs = vec![None; seq];
        for step in 0..seq {
            let t = if reverse { seq - 1 - step } else { step };
            let xt = c.slice(x, 0, t, t + 1, 1)?;
            let xt = c.reshape(xt, vec![Dim::Const(batch), Dim::Const(xd[2])])?;
            let mut xw = times_t(c, xt, wd_)?;
            if let Some(b) = wb {
                xw = c.binary(B::Add, xw, b)?;
            }
            let mut hr = times_t(c, h, rd_)?;
            if let Some(b) = rb {
                hr = c.binary(B::Add, hr, b)?;
            }
            let clipped = |c: &mut Ctx, v: NodeId| -> Result<NodeId> {
                match clip {
                    Some(k) => {
                        let y = c.binary_c(B::Minimum, v, k)?;
                        c.binary_c(B::Maximum, y, -k)
                    }
                    None => Ok(v),
                }
            };
            h = match kind {
                Cell::Rnn => {
                    let s = c.binary(B::Add, xw, hr)?;
                    let s = clipped(c, s)?;
                    act(c, s, 0)?
                }
                Cell::Gru => {
                    // Gates z, r, h.
                    let g = |c: &mut Ctx, v: NodeId, k: usize| block(c, v, 1, k, hidden);
                    let (xz, xr, xh) = (g(c, xw, 0)?, g(c, xw, 1)?, g(c, xw, 2)?);
                    let (hz, hrr, hh) = (g(c, hr, 0)?, g(c, hr, 1)?, g(c, hr, 2)?);
                    let z = c.binary(B::Add, xz, hz)?;
                    let z = clipped(c, z)?;
                    let z = act(c, z, 0)?;
                    let rg = c.binary(B::Add, xr, hrr)?;
                    let rg = clipped(c, rg)?;
                    let rg = act(c, rg, 0)?;
                    let cand = if lbr {
                        // r ⊙ (H·Rhᵀ + Rbh)
                        let p = c.binary(B::Mul, rg, hh)?;
                        c.binary(B::Add, xh, p)?
                    } else {
                        // (r ⊙ H)·Rhᵀ + Rbh
                        let rh = c.binary(B::Mul, rg, h)?;
                        let rhh = block(c, rd_, 0, 2, hidden)?;
                        let mut p = times_t(c, rh, rhh)?;
                        if let Some(b) = rb {
                            let bh = block(c, b, 0, 2, hidden)?;
                            p = c.binary(B::Add, p, bh)?;
                        }
                        c.binary(B::Add, xh, p)?
                    };
                    let cand = clipped(c, cand)?;
                    let cand = act(c, cand, 1)?;
                    // (1 − z) ⊙ h̃ + z ⊙ H
                    let one_ = c.scalar(1.0, dtype)?;
                    let omz = c.binary(B::Sub, one_, z)?;
                    let a = c.binary(B::Mul, omz, cand)?;
                    let b = c.binary(B::Mul, z, h)?;
                    c.binary(B::Add, a, b)?
                }
                Cell::Lstm => {
                    // Gates i, o, f, c.
                    let s = c.binary(B::Add, xw, hr)?;
                    let g = |c: &mut Ctx, k: usize| block(c, s, 1, k, hidden);
                    let (gi, go, gf, gc) = (g(c, 0)?, g(c, 1)?, g(c, 2)?, g(c, 3)?);
                    let peep_of = |c: &mut Ctx, k: usize| -> Result<Option<NodeId>> {
                        match pv {
                            Some(p) => Ok(Some(block(c, p, 0, k, hidden)?)),
                            None => Ok(None),
                        }
                    };
                    let (pi, po, pf) = (peep_of(c, 0)?, peep_of(c, 1)?, peep_of(c, 2)?);
                    let with_peep =
                        |c: &mut Ctx, v: NodeId, p: Option<NodeId>, st: NodeId| -> Result<NodeId> {
                            match p {
                                Some(p) => {
                                    let m = c.binary(B::Mul, p, st)?;
                                    c.binary(B::Add, v, m)
                                }
                                None => Ok(v),
                            }
                        };
                    let gi = with_peep(c, gi, pi, cell_state)?;
                    let gi = clipped(c, gi)?;
                    let i = act(c, gi, 0)?;
                    let f = if input_forget {
                        let one_ = c.scalar(1.0, dtype)?;
                        c.binary(B::Sub, one_, i)?
                    } else {
                        let gf = with_peep(c, gf, pf, cell_state)?;
                        let gf = clipped(c, gf)?;
                        act(c, gf, 0)?
                    };
                    let gc = clipped(c, gc)?;
                    let cand = act(c, gc, 1)?;
                    let fc = c.binary(B::Mul, f, cell_state)?;
                    let ic = c.binary(B::Mul, i, cand)?;
                    cell_state = c.binary(B::Add, fc, ic)?;
                    let go = with_peep(c, go, po, cell_state)?;
                    let go = clipped(c, go)?;
                    let o = act(c, go, 0)?;
                    let hc = act(c, cell_state, 2)?;
                    c.binary(B::Mul, o, hc)?
                }
            };
            outs[t] = Some(h);
        }
        // Y for this direction: [seq, 1, batch, hidden].
        let steps: Vec<NodeId> = outs
            .into_iter()
            .map(|o| {
                let o = o.expect("every step ran");
                c.reshape(
                    o,
                    vec![
                        Dim::Const(1),
                        Dim::Const(1),
                        Dim::Const(batch),
                        Dim::Const(hidden),
                    ],
                )
            })
            .collect::<Result<_>>()?;
        ys.push(c.cat(&steps, 0)?);
        hs.push(c.reshape(
            h,
            vec![Dim::Const(1), Dim::Const(batch), Dim::Const(hidden)],
        )?);
        cs.push(c.reshape(
            cell_state,
            vec![Dim::Const(1), Dim::Const(batch), Dim::Const(hidden)],
        )?);
    }
    let mut y = c.cat(&ys, 1)?;
    let mut yh = c.cat(&hs, 0)?;
    let mut yc = c.cat(&cs, 0)?;
    if layout == 1 {
        // Y [batch, seq, dirs, hidden]; Y_h, Y_c [batch, dirs, hidden].
        y = c.permute(y, vec![2, 0, 1, 3])?;
        yh = c.permute(yh, vec![1, 0, 2])?;
        yc = c.permute(yc, vec![1, 0, 2])?;
    }
    let mut out = vec![Val::node(y), Val::node(yh)];
    if kind == Cell::Lstm {
        out.push(Val::node(yc));
    }
    Ok(out)
}
