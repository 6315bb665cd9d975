//! Signal ops: window functions (constants of a known size), the DFT as
//! products with cosine and sine matrices computed at import (in f64, as
//! ONNX's reference computes it), and CenterCropPad.

use tessera::ir::{BinaryOp as B, Dim, Literal, LiteralData, NodeId, Op};
use tessera::{DType, Result};

use super::{one, Converter};
use crate::builder::{lit_ints, Ctx, Val};

pub(super) fn converter(op: &str) -> Option<Converter> {
    Some(match op {
        "HannWindow" => |c| window(c, "hann"),
        "HammingWindow" => |c| window(c, "hamming"),
        "BlackmanWindow" => |c| window(c, "blackman"),
        "DFT" => dft,
        "CenterCropPad" => center_crop_pad,
        _ => return None,
    })
}

fn window(c: &mut Ctx, kind: &str) -> Result<Vec<Val>> {
    let size = lit_ints(&c.literal_of(0, "size")?)[0];
    if size < 0 {
        return Err(c.bad(format!("size {size}")));
    }
    let dtype = crate::tensor::dtype_of(c.attr_i("output_datatype", 1) as i32, "output_datatype")
        .map_err(|e| c.unsupported(e.message))?;
    let periodic = c.attr_i("periodic", 1) == 1;
    let n1 = if periodic { size } else { size - 1 } as f64;
    let pi = std::f64::consts::PI;
    let values: Vec<f64> = (0..size)
        .map(|i| {
            let n = i as f64;
            match kind {
                "hann" => (n * pi / n1).sin().powi(2),
                "hamming" => {
                    let a = 25.0 / 46.0;
                    a - (n * pi * 2.0 / n1).cos() * (1.0 - a)
                }
                _ => 0.42 - 0.5 * (n * pi * 2.0 / n1).cos() + 0.08 * (n * pi * 4.0 / n1).cos(),
            }
        })
        .collect();
    let data = if dtype.is_float() {
        LiteralData::Float(values)
    } else {
        LiteralData::Int(values.iter().map(|&v| v as i64).collect())
    };
    one(c.constant(Literal {
        dtype,
        shape: vec![size as usize],
        data,
    })?)
}

/// `x` (…, n) times the `[n, k]` matrix `m`, in f64.
fn times(c: &mut Ctx, x: NodeId, m: Vec<f64>, n: usize, k: usize) -> Result<NodeId> {
    let w = c.constant(Literal {
        dtype: DType::F64,
        shape: vec![n, k],
        data: LiteralData::Float(m),
    })?;
    c.add(Op::MatMul, &[x, w])
}

/// DFT: the signal `[…, N, 1]` (real) or `[…, N, 2]` (complex) along
/// `axis` (an attribute before opset 20, an input from it on), zero-padded
/// or cut to `dft_length`; forward, inverse (÷ n), one-sided forward (the
/// first n/2 + 1 frequencies) and one-sided inverse (a real signal from
/// Hermitian-symmetric frequencies).
fn dft(c: &mut Ctx) -> Result<Vec<Val>> {
    let x = c.x(0)?;
    let d = c.concrete(x, "DFT")?;
    let rank = d.len();
    if rank < 2 || !(d[rank - 1] == 1 || d[rank - 1] == 2) {
        return Err(c.bad(format!("needs [.., N, 1 or 2], got {}", c.ty(x))));
    }
    let axis = if c.opset >= 20 {
        if c.has_input(2) {
            c.int_scalar(2, "axis")?
        } else {
            -2
        }
    } else {
        c.attr_i("axis", 1)
    };
    let axis = c.axis(axis, rank)?;
    if axis == rank - 1 {
        return Err(c.bad("the axis is the complex dim"));
    }
    let (inverse, onesided) = (c.attr_i("inverse", 0) != 0, c.attr_i("onesided", 0) != 0);
    let n_in = d[axis];
    let n = match c.has_input(1)
        && c.x(1)
            .map(|id| c.dims(id) != vec![Dim::Const(0)])
            .unwrap_or(false)
    {
        true => lit_ints(&c.literal_of(1, "dft_length")?)[0] as usize,
        false if inverse && onesided => 2 * (n_in - 1),
        false => n_in,
    };
    let dtype = c.dtype(x);
    let x64 = c.cast(x, DType::F64)?;
    // Real and imaginary parts with the axis last: [.., N].
    let mut perm: Vec<usize> = (0..rank - 1).filter(|&i| i != axis).collect();
    perm.push(axis);
    let part = |c: &mut Ctx, i: usize| -> Result<NodeId> {
        let p = c.slice(x64, rank - 1, i, i + 1, 1)?;
        let mut dims = c.dims(p);
        dims.pop();
        let p = c.reshape(p, dims)?;
        c.permute(p, perm.clone())
    };
    let a = part(c, 0)?;
    let b = if d[rank - 1] == 2 {
        Some(part(c, 1)?)
    } else {
        None
    };
    let tau = 2.0 * std::f64::consts::PI;
    let angle = |t: usize, k: usize| tau * ((k * t) % n.max(1)) as f64 / n as f64;
    let (re, im) = if inverse && onesided {
        // Real output of length n from the first n/2 + 1 frequencies.
        let kmax = (n / 2 + 1).min(n_in);
        let weight = |k: usize| {
            if k == 0 || (n % 2 == 0 && k == n / 2) {
                1.0
            } else {
                2.0
            }
        };
        let mut cm = vec![0.0; n_in * n];
        let mut sm = vec![0.0; n_in * n];
        for k in 0..kmax {
            for t in 0..n {
                cm[k * n + t] = weight(k) * angle(t, k).cos() / n as f64;
                sm[k * n + t] = -weight(k) * angle(t, k).sin() / n as f64;
            }
        }
        let mut re = times(c, a, cm, n_in, n)?;
        if let Some(b) = b {
            let bs = times(c, b, sm, n_in, n)?;
            re = c.binary(B::Add, re, bs)?;
        }
        (re, None)
    } else {
        let k_out = if onesided && !inverse { n / 2 + 1 } else { n };
        let rows = n_in;
        let sign = if inverse { 1.0 } else { -1.0 };
        let scale = if inverse { 1.0 / n as f64 } else { 1.0 };
        let mut cm = vec![0.0; rows * k_out];
        let mut sm = vec![0.0; rows * k_out];
        for t in 0..rows.min(n) {
            for k in 0..k_out {
                cm[t * k_out + k] = angle(t, k).cos() * scale;
                sm[t * k_out + k] = sign * angle(t, k).sin() * scale;
            }
        }
        // (a + ib)(cos + i·sign·sin) = a·cos − b·sign·sin + i(a·sign·sin + b·cos).
        let ac = times(c, a, cm.clone(), rows, k_out)?;
        let as_ = times(c, a, sm.clone(), rows, k_out)?;
        match b {
            Some(b) => {
                let bs = times(c, b, sm, rows, k_out)?;
                let bc = times(c, b, cm, rows, k_out)?;
                (c.binary(B::Sub, ac, bs)?, Some(c.binary(B::Add, as_, bc)?))
            }
            None => (ac, Some(as_)),
        }
    };
    let mut back = vec![0; rank - 1];
    for (i, &p) in perm.iter().enumerate() {
        back[p] = i;
    }
    let finish = |c: &mut Ctx, v: NodeId| -> Result<NodeId> {
        let v = c.permute(v, back.clone())?;
        let r = c.rank(v);
        c.unsqueeze(v, r)
    };
    let re = finish(c, re)?;
    let out = match im {
        Some(im) => {
            let im = finish(c, im)?;
            c.cat(&[re, im], rank - 1)?
        }
        None => re,
    };
    let out = c.add(Op::Contiguous, &[out])?;
    one(c.cast(out, dtype)?)
}

fn center_crop_pad(c: &mut Ctx) -> Result<Vec<Val>> {
    let x = c.x(0)?;
    let target = c.ints(1, "shape")?;
    let d = c.concrete(x, "CenterCropPad")?;
    let rank = d.len();
    let axes: Vec<usize> = match c.attr_ints("axes") {
        Some(a) => a.iter().map(|&v| c.axis(v, rank)).collect::<Result<_>>()?,
        None => (0..rank).collect(),
    };
    if target.len() != axes.len() {
        return Err(c.bad(format!("shape {target:?} for {} axes", axes.len())));
    }
    let mut y = x;
    for (&a, &t) in axes.iter().zip(&target) {
        let (dim, t) = (d[a], t.max(0) as usize);
        if t < dim {
            let start = (dim - t) / 2;
            y = c.slice(y, a, start, start + t, 1)?;
        } else if t > dim {
            let before = (t - dim) / 2;
            let after = t - dim - before;
            let z = c.scalar_like(0.0, y)?;
            let mut parts = Vec::new();
            for count in [before, after] {
                let mut s = c.dims(y);
                s[a] = Dim::Const(count);
                parts.push(c.expand(z, s)?);
            }
            y = c.cat(&[parts[0], y, parts[1]], a)?;
        }
    }
    one(y)
}
