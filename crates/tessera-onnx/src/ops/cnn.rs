//! The convolutional ops: Conv, ConvTranspose, MaxPool, AveragePool,
//! LpPool, the global pools, BatchNormalization and LRN, on tessera's
//! built-in `tessera::conv2d`, `tessera::conv2d_backward_input`,
//! `tessera::max_pool2d` and `tessera::avg_pool2d` ops (see
//! `tessera::ir::custom::conv`).
//!
//! - 1-D ops run as 2-D ones on `[N, C, 1, L]`.
//! - 3-D Conv is a sum over the depth taps of 2-D convolutions (each on
//!   every output depth at once, `[N·Do, C, H, W]`); 3-D pools pool each
//!   depth slice in 2-D, then take the max or sum over the depth taps.
//! - ONNX's padding is per side (`pads = [x1_begin, …, x1_end, …]`) and
//!   its `auto_pad` modes are resolved here; where tessera's op has no
//!   such geometry (asymmetric pads, pads over half the window, an average
//!   pool with dilations), the input is padded explicitly (`-inf` for max,
//!   zeros for sums) and an average divides window sums by the count of
//!   the positions ONNX counts (computed when the model is imported).
//! - MaxPool's `Indices` are ONNX's: flat over the whole `N·C·H·W` input,
//!   column-major within a plane when `storage_order` is 1.

use tessera::ir::custom::conv::{
    Activation, Conv2d, Pool2d, AVG_POOL2D, CONV2D, CONV2D_BACKWARD_INPUT, MAX_POOL2D,
};
use tessera::ir::custom::{Attrs, CustomCall};
use tessera::ir::{
    BinaryOp as B, Dim, Literal, LiteralData, NodeId, Op, ReduceOp as R, TensorType, UnaryOp as U,
};
use tessera::{DType, Result};

use super::{one, Converter};
use crate::builder::{Ctx, Val};
use crate::proto::attribute_type as at;

pub(super) fn converter(op: &str) -> Option<Converter> {
    Some(match op {
        "Conv" => conv,
        "ConvTranspose" => conv_transpose,
        "MaxPool" => max_pool,
        "AveragePool" => average_pool,
        "LpPool" => lp_pool,
        "GlobalAveragePool" => |c| global(c, Global::Avg),
        "GlobalMaxPool" => |c| global(c, Global::Max),
        "GlobalLpPool" => |c| global(c, Global::Lp),
        "BatchNormalization" => batch_norm,
        "LRN" => lrn,
        _ => return None,
    })
}

// ---- helpers ----

/// A call of built-in op `name`: its first output and a `custom_output`
/// node per further output.
fn custom(c: &mut Ctx, name: &str, attrs: Attrs, inputs: &[NodeId]) -> Result<Vec<NodeId>> {
    let call = CustomCall::new(name, attrs)?;
    let types: Vec<TensorType> = inputs.iter().map(|&i| c.ty(i).clone()).collect();
    let out = call.op.infer(&call.attrs, &types)?;
    let first = c.add(Op::Custom(call), inputs)?;
    let mut ids = vec![first];
    for (index, ty) in out.iter().enumerate().skip(1) {
        let op = Op::CustomOutput {
            index,
            dtype: ty.dtype,
            shape: ty.shape.clone(),
        };
        ids.push(c.add(op, &[first])?);
    }
    Ok(ids)
}

fn float_input(c: &Ctx, x: NodeId) -> Result<()> {
    match c.dtype(x) {
        DType::F32 | DType::F64 | DType::F16 | DType::BF16 => Ok(()),
        _ => Err(c.unsupported(format!(
            "tessera's convolution and pooling kernels take float tensors, got {}",
            c.ty(x)
        ))),
    }
}

/// The spatial sizes of `x` (`[N, C, D1, …]`, 1 to 3 of them, concrete).
fn spatial(c: &Ctx, x: NodeId) -> Result<Vec<usize>> {
    let dims = c.dims(x);
    if !(3..=5).contains(&dims.len()) {
        return Err(c.unsupported(format!(
            "takes an input [N, C, D1 …] with 1, 2 or 3 spatial dims, got {}",
            c.ty(x)
        )));
    }
    dims[1..]
        .iter()
        .map(|d| d.as_const())
        .collect::<Option<Vec<usize>>>()
        .map(|v| v[1..].to_vec())
        .ok_or_else(|| {
            c.unsupported(format!(
                "needs concrete channels and spatial sizes (only the batch may be symbolic), got {}",
                c.ty(x)
            ))
        })
}

/// The channels of `x` `[N, C, …]` (concrete: the batch alone may be
/// symbolic).
fn channels(c: &Ctx, x: NodeId) -> Result<usize> {
    c.dims(x).get(1).and_then(Dim::as_const).ok_or_else(|| {
        c.unsupported(format!(
            "needs concrete channels (only the batch may be symbolic), got {}",
            c.ty(x)
        ))
    })
}

/// An integer-list attribute of one positive entry per spatial dim.
fn per_axis(c: &Ctx, name: &str, n: usize) -> Result<Vec<usize>> {
    match c.attr_ints(name) {
        None => Ok(vec![1; n]),
        Some(v) if v.len() == n && v.iter().all(|&e| e >= 1) => {
            Ok(v.into_iter().map(|e| e as usize).collect())
        }
        Some(v) => Err(c.bad(format!(
            "attribute `{name}` must hold {n} positive integers (one per spatial dim), got {v:?}"
        ))),
    }
}

/// A number attribute stored as an int or a float (LpPool's `p`).
fn attr_num(c: &Ctx, name: &str, default: f64) -> f64 {
    match c.attr(name) {
        Some(a) if a.r#type == at::FLOAT => a.f as f64,
        Some(a) => a.i as f64,
        None => default,
    }
}

/// A sliding window's geometry along each spatial axis, with ONNX's
/// padding resolved.
#[derive(Clone, Debug)]
struct Window {
    size: Vec<usize>,
    k: Vec<usize>,
    s: Vec<usize>,
    d: Vec<usize>,
    begin: Vec<usize>,
    end: Vec<usize>,
    out: Vec<usize>,
}

impl Window {
    fn span(&self, i: usize) -> usize {
        self.d[i] * (self.k[i] - 1) + 1
    }

    /// Padding past `end` that the last window reaches (ceil mode).
    fn overhang(&self, i: usize) -> usize {
        let needed = (self.out[i] - 1) * self.s[i] + self.span(i);
        needed.saturating_sub(self.size[i] + self.begin[i] + self.end[i])
    }

    /// The axes `from..` of this window.
    fn axes(&self, from: usize) -> Window {
        Window {
            size: self.size[from..].to_vec(),
            k: self.k[from..].to_vec(),
            s: self.s[from..].to_vec(),
            d: self.d[from..].to_vec(),
            begin: self.begin[from..].to_vec(),
            end: self.end[from..].to_vec(),
            out: self.out[from..].to_vec(),
        }
    }

    /// A 1-D window as a 2-D one of height 1.
    fn as_2d(&self) -> Window {
        if self.size.len() == 2 {
            return self.clone();
        }
        let two = |v: &Vec<usize>, first: usize| vec![first, v[0]];
        Window {
            size: two(&self.size, 1),
            k: two(&self.k, 1),
            s: two(&self.s, 1),
            d: two(&self.d, 1),
            begin: two(&self.begin, 0),
            end: two(&self.end, 0),
            out: two(&self.out, 1),
        }
    }
}

/// Resolves `auto_pad`, `pads`, `strides` and `dilations` for a kernel
/// `k` over spatial sizes `size` (`ceil`: pooling's `ceil_mode`).
fn window(c: &Ctx, size: &[usize], k: Vec<usize>, ceil: bool) -> Result<Window> {
    let n = size.len();
    if k.len() != n || k.contains(&0) {
        return Err(c.bad(format!(
            "the kernel {k:?} must have one positive size per spatial dim of the input ({size:?})"
        )));
    }
    let s = per_axis(c, "strides", n)?;
    let d = per_axis(c, "dilations", n)?;
    let span: Vec<usize> = (0..n).map(|i| d[i] * (k[i] - 1) + 1).collect();
    let auto = c.attr_s("auto_pad", "NOTSET");
    let (mut begin, mut end, mut out) = (vec![0; n], vec![0; n], vec![0; n]);
    match auto.as_str() {
        "NOTSET" | "" => {
            let pads = c.attr_ints("pads").unwrap_or_else(|| vec![0; 2 * n]);
            if pads.len() != 2 * n || pads.iter().any(|&p| p < 0) {
                return Err(c.bad(format!(
                    "attribute `pads` must hold {} non-negative integers (begin and end per spatial dim), got {pads:?}",
                    2 * n
                )));
            }
            for i in 0..n {
                begin[i] = pads[i] as usize;
                end[i] = pads[n + i] as usize;
                let padded = size[i] + begin[i] + end[i];
                if padded < span[i] {
                    return Err(c.err(
                        tessera::ErrorKind::Shape,
                        format!(
                            "the window of spatial dim {i} (kernel {} with dilation {}: {}) is larger than the padded input ({} + pads {} + {})",
                            k[i], d[i], span[i], size[i], begin[i], end[i]
                        ),
                    ));
                }
                let room = padded - span[i];
                out[i] = if ceil {
                    let o = room.div_ceil(s[i]) + 1;
                    // The last window must start inside the input or the
                    // begin padding.
                    if (o - 1) * s[i] >= size[i] + begin[i] {
                        o - 1
                    } else {
                        o
                    }
                } else {
                    room / s[i] + 1
                };
            }
        }
        "VALID" => {
            for i in 0..n {
                if size[i] < span[i] {
                    return Err(c.err(
                        tessera::ErrorKind::Shape,
                        format!(
                            "the window of spatial dim {i} ({}) is larger than the input ({}) with auto_pad VALID",
                            span[i], size[i]
                        ),
                    ));
                }
                out[i] = (size[i] - span[i]) / s[i] + 1;
            }
        }
        "SAME_UPPER" | "SAME_LOWER" => {
            for i in 0..n {
                out[i] = size[i].div_ceil(s[i]);
                let total = ((out[i] - 1) * s[i] + span[i]).saturating_sub(size[i]);
                let small = total / 2;
                (begin[i], end[i]) = if auto == "SAME_UPPER" {
                    (small, total - small)
                } else {
                    (total - small, small)
                };
            }
        }
        other => {
            return Err(c.bad(format!(
                "attribute `auto_pad` is {other:?}: NOTSET, SAME_UPPER, SAME_LOWER or VALID"
            )))
        }
    }
    Ok(Window {
        size: size.to_vec(),
        k,
        s,
        d,
        begin,
        end,
        out,
    })
}

fn dims_of(v: &[usize]) -> Vec<Dim> {
    v.iter().map(|&d| Dim::Const(d)).collect()
}

/// `x` with `before`/`after` entries of `value` along `dim`.
fn pad_const(
    c: &mut Ctx,
    x: NodeId,
    dim: usize,
    before: usize,
    after: usize,
    value: f64,
) -> Result<NodeId> {
    if before == 0 && after == 0 {
        return Ok(x);
    }
    let v = c.scalar_like(value, x)?;
    let piece = |c: &mut Ctx, count: usize| -> Result<NodeId> {
        let mut s = c.dims(x);
        s[dim] = Dim::Const(count);
        c.expand(v, s)
    };
    let mut parts = Vec::new();
    if before > 0 {
        parts.push(piece(c, before)?);
    }
    parts.push(x);
    if after > 0 {
        parts.push(piece(c, after)?);
    }
    c.cat(&parts, dim)
}

/// `x` `[N, C, L]` as `[N, C, 1, L]` (other ranks unchanged).
fn to_4d(c: &mut Ctx, x: NodeId) -> Result<NodeId> {
    match c.rank(x) {
        3 => c.unsqueeze(x, 2),
        _ => Ok(x),
    }
}

/// A `[N, C, 1, L]` result back to `[N, C, L]` when the input was 1-D.
fn from_4d(c: &mut Ctx, y: NodeId, spatial: usize) -> Result<NodeId> {
    if spatial != 1 {
        return Ok(y);
    }
    let mut d = c.dims(y);
    d.remove(2);
    c.reshape(y, d)
}

// ---- Conv ----

fn conv(c: &mut Ctx) -> Result<Vec<Val>> {
    let x = c.x(0)?;
    let w = c.x(1)?;
    let bias = if c.has_input(2) { Some(c.x(2)?) } else { None };
    one(conv_of(c, x, w, bias)?)
}

/// The convolution of `x` by `w` (plus `bias`) with the current node's
/// attributes (Conv's, which ConvInteger and QLinearConv share).
pub(super) fn conv_of(c: &mut Ctx, x: NodeId, w: NodeId, bias: Option<NodeId>) -> Result<NodeId> {
    float_input(c, x)?;
    let size = spatial(c, x)?;
    let wd = c.concrete(w, "Conv's weight")?;
    let n = size.len();
    if wd.len() != n + 2 {
        return Err(c.bad(format!(
            "the weight must be [M, C/group, k…] with {n} kernel dims, got {} (input {})",
            c.ty(w),
            c.ty(x)
        )));
    }
    if let Some(ks) = c.attr_ints("kernel_shape") {
        if ks.iter().map(|&k| k as usize).ne(wd[2..].iter().copied()) {
            return Err(c.bad(format!(
                "kernel_shape {ks:?} differs from the weight's kernel {:?}",
                &wd[2..]
            )));
        }
    }
    let groups = c.attr_i("group", 1);
    if groups < 1 {
        return Err(c.bad(format!("group must be positive, got {groups}")));
    }
    let win = window(c, &size, wd[2..].to_vec(), false)?;
    let y = match n {
        1 | 2 => {
            let x4 = to_4d(c, x)?;
            let w4 = to_4d(c, w)?;
            let y = conv2d(c, x4, w4, bias, &win.as_2d(), groups as usize)?;
            from_4d(c, y, n)?
        }
        _ => conv3d(c, x, w, bias, &win, groups as usize)?,
    };
    Ok(y)
}

/// `tessera::conv2d` of `x` `[N, C, H, W]` and `w` `[M, C/g, kh, kw]` with
/// the window's (2-D) geometry.
fn conv2d(
    c: &mut Ctx,
    x: NodeId,
    w: NodeId,
    bias: Option<NodeId>,
    win: &Window,
    groups: usize,
) -> Result<NodeId> {
    let geometry = Conv2d {
        stride: [win.s[0], win.s[1]],
        padding: [win.begin[0], win.end[0], win.begin[1], win.end[1]],
        dilation: [win.d[0], win.d[1]],
        groups,
        activation: Activation::None,
    };
    let mut inputs = vec![x, w];
    inputs.extend(bias);
    Ok(custom(c, CONV2D, geometry.attrs(), &inputs)?[0])
}

/// A 3-D convolution as the sum over the depth taps `j` of 2-D
/// convolutions by `w[:, :, j]`, each over the input depths tap `j`
/// reads for every output depth, batched as `[N·Do, C, H, W]`.
fn conv3d(
    c: &mut Ctx,
    x: NodeId,
    w: NodeId,
    bias: Option<NodeId>,
    win: &Window,
    groups: usize,
) -> Result<NodeId> {
    let xd = c.dims(x);
    let wd = c.concrete(w, "Conv's weight")?;
    let (n, ch) = (xd[0].clone(), xd[1].clone());
    let (m, cg) = (wd[0], wd[1]);
    let out_d = win.out[0];
    let padded = pad_const(c, x, 2, win.begin[0], win.end[0], 0.0)?;
    let plane = win.axes(1);
    let mut sum: Option<NodeId> = None;
    for j in 0..win.k[0] {
        let start = j * win.d[0];
        let taps = c.slice(
            padded,
            2,
            start,
            start + (out_d - 1) * win.s[0] + 1,
            win.s[0],
        )?;
        let t = c.permute(taps, vec![0, 2, 1, 3, 4])?;
        let t = c.add(Op::Contiguous, &[t])?;
        let batch = &n * &Dim::Const(out_d);
        let t = c.reshape(
            t,
            vec![
                batch,
                ch.clone(),
                Dim::Const(win.size[1]),
                Dim::Const(win.size[2]),
            ],
        )?;
        let wj = c.slice(w, 2, j, j + 1, 1)?;
        let wj = c.reshape(wj, dims_of(&[m, cg, wd[3], wd[4]]))?;
        let y = conv2d(c, t, wj, if j == 0 { bias } else { None }, &plane, groups)?;
        sum = Some(match sum {
            None => y,
            Some(s) => c.binary(B::Add, s, y)?,
        });
    }
    let y = sum.expect("a kernel has at least one tap");
    let y = c.reshape(
        y,
        vec![
            n,
            Dim::Const(out_d),
            Dim::Const(m),
            Dim::Const(win.out[1]),
            Dim::Const(win.out[2]),
        ],
    )?;
    c.permute(y, vec![0, 2, 1, 3, 4])
}

// ---- ConvTranspose ----

fn conv_transpose(c: &mut Ctx) -> Result<Vec<Val>> {
    let x = c.x(0)?;
    let w = c.x(1)?;
    let bias = if c.has_input(2) { Some(c.x(2)?) } else { None };
    float_input(c, x)?;
    let size = spatial(c, x)?;
    let wd = c.concrete(w, "ConvTranspose's weight")?;
    let n = size.len();
    if wd.len() != n + 2 {
        return Err(c.bad(format!(
            "the weight must be [C, M/group, k…] with {n} kernel dims, got {} (input {})",
            c.ty(w),
            c.ty(x)
        )));
    }
    let groups = c.attr_i("group", 1);
    if groups < 1 {
        return Err(c.bad(format!("group must be positive, got {groups}")));
    }
    let k = wd[2..].to_vec();
    if let Some(ks) = c.attr_ints("kernel_shape") {
        if ks.iter().map(|&v| v as usize).ne(k.iter().copied()) {
            return Err(c.bad(format!(
                "kernel_shape {ks:?} differs from the weight's kernel {k:?}"
            )));
        }
    }
    let s = per_axis(c, "strides", n)?;
    let d = per_axis(c, "dilations", n)?;
    let out_pad = match c.attr_ints("output_padding") {
        None => vec![0; n],
        Some(v) if v.len() == n && v.iter().all(|&e| e >= 0) => v,
        Some(v) => {
            return Err(c.bad(format!(
                "output_padding must hold {n} non-negative integers, got {v:?}"
            )))
        }
    };
    let auto = c.attr_s("auto_pad", "NOTSET");
    let pads = c.attr_ints("pads");
    let output_shape = c.attr_ints("output_shape").map(|v| {
        // Either the spatial sizes or the whole shape.
        let skip = v.len().saturating_sub(n);
        v[skip..].to_vec()
    });
    if let Some(p) = &pads {
        if p.len() != 2 * n {
            return Err(c.bad(format!("pads must hold {} integers, got {p:?}", 2 * n)));
        }
    }
    // Each axis: the output is positions begin .. begin + len of the full
    // line (`s·(in − 1) + span` long, zeros past it).
    let mut begin = vec![0i64; n];
    let mut len = vec![0i64; n];
    for i in 0..n {
        let span = (d[i] * (k[i] - 1) + 1) as i64;
        let natural = s[i] as i64 * (size[i] as i64 - 1) + out_pad[i] + span;
        let same = matches!(auto.as_str(), "SAME_UPPER" | "SAME_LOWER");
        match (&pads, &output_shape) {
            (Some(p), _) if !same => {
                begin[i] = p[i];
                len[i] = match &output_shape {
                    Some(o) => o[i],
                    None => natural - p[i] - p[n + i],
                };
            }
            _ if same || output_shape.is_some() => {
                let want = match &output_shape {
                    Some(o) => o[i],
                    None => size[i] as i64 * s[i] as i64,
                };
                let total = natural - want;
                let small = total.div_euclid(2);
                begin[i] = if auto == "SAME_UPPER" {
                    small
                } else {
                    total - small
                };
                len[i] = want;
            }
            _ => {
                if !matches!(auto.as_str(), "NOTSET" | "" | "VALID") {
                    return Err(c.bad(format!(
                        "attribute `auto_pad` is {auto:?}: NOTSET, SAME_UPPER, SAME_LOWER or VALID"
                    )));
                }
                len[i] = natural;
            }
        }
        if len[i] <= 0 {
            return Err(c.err(
                tessera::ErrorKind::Shape,
                format!(
                    "the output of spatial dim {i} would be empty ({}): input {}, weight {}",
                    len[i],
                    c.ty(x),
                    c.ty(w)
                ),
            ));
        }
    }
    let line = Line {
        s,
        d,
        k,
        size,
        begin,
        len,
    };
    let mut y = if n < 3 {
        let x4 = to_4d(c, x)?;
        let w4 = to_4d(c, w)?;
        conv_transpose2d(c, x4, w4, &line.as_2d(), groups as usize)?
    } else {
        conv_transpose3d(c, x, w, &line, groups as usize)?
    };
    if let Some(b) = bias {
        let mut dims = vec![Dim::Const(1); c.rank(y)];
        dims[1] = c.dims(y)[1].clone();
        let b = c.reshape(b, dims)?;
        y = c.binary(B::Add, y, b)?;
    }
    one(from_4d(c, y, n)?)
}

/// A transposed convolution's geometry per spatial axis: the output is
/// positions `begin .. begin + len` of the full line `s·(size − 1) +
/// d·(k − 1) + 1` long (zeros outside it).
struct Line {
    s: Vec<usize>,
    d: Vec<usize>,
    k: Vec<usize>,
    size: Vec<usize>,
    begin: Vec<i64>,
    len: Vec<i64>,
}

impl Line {
    fn full(&self, i: usize) -> i64 {
        (self.s[i] * (self.size[i] - 1) + self.d[i] * (self.k[i] - 1) + 1) as i64
    }

    fn as_2d(&self) -> Line {
        if self.size.len() == 2 {
            return self.axes(0);
        }
        let one = |v: &Vec<usize>| vec![1, v[0]];
        Line {
            s: one(&self.s),
            d: one(&self.d),
            k: one(&self.k),
            size: one(&self.size),
            begin: vec![0, self.begin[0]],
            len: vec![1, self.len[0]],
        }
    }

    fn axes(&self, from: usize) -> Line {
        Line {
            s: self.s[from..].to_vec(),
            d: self.d[from..].to_vec(),
            k: self.k[from..].to_vec(),
            size: self.size[from..].to_vec(),
            begin: self.begin[from..].to_vec(),
            len: self.len[from..].to_vec(),
        }
    }

    /// The part of axis `i`'s output within the full line (`lo..hi`) and
    /// the zeros before and after it.
    fn clip(&self, c: &Ctx, i: usize) -> Result<(usize, usize, usize, usize)> {
        let f = self.full(i);
        let lo = self.begin[i].clamp(0, f);
        let hi = (self.begin[i] + self.len[i]).clamp(0, f);
        if hi <= lo {
            return Err(c.unsupported(format!(
                "the output of a spatial dim lies wholly in the padding (pads begin {}, length {}): tessera's transposed convolution computes at least one position",
                self.begin[i], self.len[i]
            )));
        }
        Ok((
            lo as usize,
            hi as usize,
            (lo - self.begin[i]) as usize,
            (self.begin[i] + self.len[i] - hi) as usize,
        ))
    }
}

/// `tessera::conv2d_backward_input` (positions `lo..hi` of the full line:
/// the adjoint of a convolution of an input `hi − lo` long padded by `lo`
/// and `full − hi`), then the zeros outside the line; no bias.
fn conv_transpose2d(
    c: &mut Ctx,
    x: NodeId,
    w: NodeId,
    line: &Line,
    groups: usize,
) -> Result<NodeId> {
    let (lo0, hi0, b0, a0) = line.clip(c, 0)?;
    let (lo1, hi1, b1, a1) = line.clip(c, 1)?;
    let geometry = Conv2d {
        stride: [line.s[0], line.s[1]],
        padding: [
            lo0,
            line.full(0) as usize - hi0,
            lo1,
            line.full(1) as usize - hi1,
        ],
        dilation: [line.d[0], line.d[1]],
        groups,
        activation: Activation::None,
    };
    let mut attrs = geometry.attrs();
    attrs.insert("input_hw".into(), vec![hi0 - lo0, hi1 - lo1].into());
    let y = custom(c, CONV2D_BACKWARD_INPUT, attrs, &[x, w])?[0];
    let y = pad_const(c, y, 2, b0, a0, 0.0)?;
    pad_const(c, y, 3, b1, a1, 0.0)
}

/// A 3-D transposed convolution: for each depth tap `j`, the 2-D one by
/// `w[:, :, j]` of every input depth at once (`[N·D, C, H, W]`), its
/// depths spread `s` apart (zeros between) and shifted by `j·d` on the
/// full depth line; the sum cut to the output's depths.
fn conv_transpose3d(
    c: &mut Ctx,
    x: NodeId,
    w: NodeId,
    line: &Line,
    groups: usize,
) -> Result<NodeId> {
    let xd = c.dims(x);
    let wd = c.concrete(w, "ConvTranspose's weight")?;
    let n = xd[0].clone();
    let (ch, depth) = (wd[0], line.size[0]);
    let m = wd[1] * groups;
    let plane = line.axes(1);
    let t = c.permute(x, vec![0, 2, 1, 3, 4])?;
    let t = c.add(Op::Contiguous, &[t])?;
    let t = c.reshape(
        t,
        vec![
            &n * &Dim::Const(depth),
            Dim::Const(ch),
            Dim::Const(line.size[1]),
            Dim::Const(line.size[2]),
        ],
    )?;
    let full = line.full(0) as usize;
    let (s, dil) = (line.s[0], line.d[0]);
    let mut sum: Option<NodeId> = None;
    for j in 0..line.k[0] {
        let wj = c.slice(w, 2, j, j + 1, 1)?;
        let wj = c.reshape(wj, dims_of(&[ch, wd[1], wd[3], wd[4]]))?;
        let z = conv_transpose2d(c, t, wj, &plane, groups)?;
        let zd = c.dims(z);
        let (ho, wo) = (zd[2].clone(), zd[3].clone());
        let mut z = c.reshape(
            z,
            vec![
                n.clone(),
                Dim::Const(depth),
                Dim::Const(m),
                ho.clone(),
                wo.clone(),
            ],
        )?;
        if s > 1 {
            // Depth i at i·s: s − 1 zeros after each.
            let z5 = c.unsqueeze(z, 2)?;
            let z5 = pad_const(c, z5, 2, 0, s - 1, 0.0)?;
            z = c.reshape(
                z5,
                vec![
                    n.clone(),
                    Dim::Const(depth * s),
                    Dim::Const(m),
                    ho.clone(),
                    wo.clone(),
                ],
            )?;
            z = c.slice(z, 1, 0, (depth - 1) * s + 1, 1)?;
        }
        let before = j * dil;
        let after = full - before - ((depth - 1) * s + 1);
        let z = pad_const(c, z, 1, before, after, 0.0)?;
        sum = Some(match sum {
            None => z,
            Some(a) => c.binary(B::Add, a, z)?,
        });
    }
    let y = sum.expect("a kernel has at least one tap");
    let (lo, hi, b, a) = line.clip(c, 0)?;
    let y = c.slice(y, 1, lo, hi, 1)?;
    let y = pad_const(c, y, 1, b, a, 0.0)?;
    c.permute(y, vec![0, 2, 1, 3, 4])
}

// ---- pools ----

#[derive(Clone, Copy, PartialEq)]
enum Reduce {
    Max,
    Sum,
}

/// A 2-D pool of `x` `[N, C, H, W]` (max, or window sums), with its
/// maxima's indices in each `H·W` plane for max (when `indices`; without,
/// no index arithmetic is built): tessera's op with its own
/// padding where the geometry is one it has, else on an explicitly padded
/// input.
fn pool2d(
    c: &mut Ctx,
    x: NodeId,
    win: &Window,
    how: Reduce,
    indices: bool,
) -> Result<(NodeId, Option<NodeId>)> {
    let op = match how {
        Reduce::Max => MAX_POOL2D,
        Reduce::Sum => AVG_POOL2D,
    };
    let base = Pool2d {
        kernel: [win.k[0], win.k[1]],
        stride: [win.s[0], win.s[1]],
        padding: [win.begin[0], win.begin[1]],
        dilation: [win.d[0], win.d[1]],
        ceil_mode: false,
        count_include_pad: true,
        divisor_override: Some(1).filter(|_| how == Reduce::Sum),
    };
    let symmetric = win.begin == win.end && (0..2).all(|i| 2 * win.begin[i] <= win.k[i]);
    let dilated = win.d.iter().any(|&d| d != 1);
    if symmetric && !(how == Reduce::Sum && dilated) {
        for ceil_mode in [false, true] {
            let p = Pool2d { ceil_mode, ..base };
            let fits = (0..2).all(|i| p.out_size(op, i, win.size[i]).ok() == Some(win.out[i]));
            if fits {
                let out = custom(c, op, p.attrs(), &[x])?;
                return Ok((out[0], out.get(1).copied().filter(|_| indices)));
            }
        }
    }
    // Explicit padding: the windows then lie within the input.
    let fill = match how {
        Reduce::Max => f64::NEG_INFINITY,
        Reduce::Sum => 0.0,
    };
    let mut xp = x;
    for i in 0..2 {
        xp = pad_const(
            c,
            xp,
            2 + i,
            win.begin[i],
            win.end[i] + win.overhang(i),
            fill,
        )?;
    }
    let padded: Vec<usize> = (0..2)
        .map(|i| win.size[i] + win.begin[i] + win.end[i] + win.overhang(i))
        .collect();
    let plain = Pool2d {
        padding: [0, 0],
        ..base
    };
    let (y, idx) = if how == Reduce::Sum && dilated {
        // Window sums with dilations: a depthwise convolution by ones.
        let ch = channels(c, x)?;
        let ones = c.constant(Literal {
            dtype: c.dtype(x),
            shape: vec![ch, 1, win.k[0], win.k[1]],
            data: LiteralData::Float(vec![1.0; ch * win.k[0] * win.k[1]]),
        })?;
        let flat = Window {
            size: padded.clone(),
            begin: vec![0, 0],
            end: vec![0, 0],
            ..win.clone()
        };
        (conv2d(c, xp, ones, None, &flat, ch)?, None)
    } else {
        let out = custom(c, op, plain.attrs(), &[xp])?;
        (out[0], out.get(1).copied())
    };
    // Floor sizes of the padded input may hold one window more than ONNX's.
    let mut y = y;
    let mut idx = idx.filter(|_| indices);
    for i in 0..2 {
        let got = c.dims(y)[2 + i].as_const();
        if got != Some(win.out[i]) {
            y = c.slice(y, 2 + i, 0, win.out[i], 1)?;
            idx = idx
                .map(|t| c.slice(t, 2 + i, 0, win.out[i], 1))
                .transpose()?;
        }
    }
    // Indices in the padded plane → the input's plane (integer arithmetic,
    // built only when the caller wants the indices).
    let idx = match idx {
        Some(t) => {
            let wp = c.scalar(padded[1] as f64, DType::I64)?;
            let row = c.binary(B::Div, t, wp)?;
            let back = c.binary(B::Mul, row, wp)?;
            let col = c.binary(B::Sub, t, back)?;
            let row = c.binary_c(B::Sub, row, win.begin[0] as f64)?;
            let col = c.binary_c(B::Sub, col, win.begin[1] as f64)?;
            let row = c.binary_c(B::Mul, row, win.size[1] as f64)?;
            Some(c.binary(B::Add, row, col)?)
        }
        None => None,
    };
    Ok((y, idx))
}

/// A pool of `x` `[N, C, D…]` with 1 to 3 spatial dims: 2-D pools of each
/// depth slice, then the max or sum over the depth taps.
fn pool_nd(c: &mut Ctx, x: NodeId, win: &Window, how: Reduce) -> Result<NodeId> {
    let n = win.size.len();
    if n < 3 {
        let x4 = to_4d(c, x)?;
        let (y, _) = pool2d(c, x4, &win.as_2d(), how, false)?;
        return from_4d(c, y, n);
    }
    let xd = c.dims(x);
    let ch = channels(c, x)?;
    let (depth, out_d) = (win.size[0], win.out[0]);
    let merged = c.reshape(
        x,
        vec![
            xd[0].clone(),
            Dim::Const(ch * depth),
            Dim::Const(win.size[1]),
            Dim::Const(win.size[2]),
        ],
    )?;
    let (plane, _) = pool2d(c, merged, &win.axes(1), how, false)?;
    let y = c.reshape(
        plane,
        vec![
            xd[0].clone(),
            Dim::Const(ch),
            Dim::Const(depth),
            Dim::Const(win.out[1]),
            Dim::Const(win.out[2]),
        ],
    )?;
    let fill = match how {
        Reduce::Max => f64::NEG_INFINITY,
        Reduce::Sum => 0.0,
    };
    let yp = pad_const(c, y, 2, win.begin[0], win.end[0] + win.overhang(0), fill)?;
    let mut acc: Option<NodeId> = None;
    for j in 0..win.k[0] {
        let start = j * win.d[0];
        let taps = c.slice(yp, 2, start, start + (out_d - 1) * win.s[0] + 1, win.s[0])?;
        acc = Some(match acc {
            None => taps,
            Some(a) => {
                let op = match how {
                    Reduce::Max => B::Maximum,
                    Reduce::Sum => B::Add,
                };
                c.binary(op, a, taps)?
            }
        });
    }
    Ok(acc.expect("a window has at least one tap"))
}

/// The pool attributes every pooling op shares.
fn pool_window(c: &Ctx, x: NodeId) -> Result<Window> {
    let size = spatial(c, x)?;
    let k = c
        .attr_ints("kernel_shape")
        .ok_or_else(|| c.bad("needs attribute `kernel_shape`"))?;
    if k.iter().any(|&v| v < 1) {
        return Err(c.bad(format!("kernel_shape must be positive, got {k:?}")));
    }
    let ceil = c.attr_i("ceil_mode", 0) != 0;
    window(c, &size, k.into_iter().map(|v| v as usize).collect(), ceil)
}

fn max_pool(c: &mut Ctx) -> Result<Vec<Val>> {
    let x = c.x(0)?;
    let dtype = c.dtype(x);
    if dtype.is_int() && dtype.size_bytes() <= 2 {
        // The 8- and 16-bit integers are exact in f32, where the max pool
        // kernel runs; the maxima are cast back. (Indices are unaffected.)
        let xf = c.cast(x, DType::F32)?;
        c.inputs[0] = Some(Val::node(xf));
        let mut outs = max_pool(c)?;
        let y = c.materialise(&outs[0])?;
        outs[0] = Val::node(c.cast(y, dtype)?);
        return Ok(outs);
    }
    float_input(c, x)?;
    let win = pool_window(c, x)?;
    let n = win.size.len();
    let want_indices = c.node.output.get(1).is_some_and(|o| !o.is_empty());
    if !want_indices {
        return one(pool_nd(c, x, &win, Reduce::Max)?);
    }
    if n == 3 {
        return Err(c.unsupported(
            "the Indices output of a 3-D MaxPool: tessera's max pool with indices is 2-D",
        ));
    }
    let storage_order = c.attr_i("storage_order", 0);
    let xd = c.dims(x);
    let batch = xd[0].as_const().ok_or_else(|| {
        c.unsupported(format!(
            "MaxPool's Indices output needs a concrete batch (its indices count across it), got {}",
            c.ty(x)
        ))
    })?;
    let ch = channels(c, x)?;
    let x4 = to_4d(c, x)?;
    let w2 = win.as_2d();
    let (y, idx) = pool2d(c, x4, &w2, Reduce::Max, true)?;
    let mut idx = idx.expect("max pooling gives indices");
    let (h, w) = (w2.size[0], w2.size[1]);
    if storage_order == 1 {
        // Column-major within the plane: h + w·H.
        let wd = c.scalar(w as f64, DType::I64)?;
        let row = c.binary(B::Div, idx, wd)?;
        let back = c.binary(B::Mul, row, wd)?;
        let col = c.binary(B::Sub, idx, back)?;
        let col = c.binary_c(B::Mul, col, h as f64)?;
        idx = c.binary(B::Add, row, col)?;
    }
    let offsets: Vec<i64> = (0..(batch * ch) as i64)
        .map(|p| p * (h * w) as i64)
        .collect();
    let offsets = c.constant(Literal {
        dtype: DType::I64,
        shape: vec![batch, ch, 1, 1],
        data: LiteralData::Int(offsets),
    })?;
    idx = c.binary(B::Add, idx, offsets)?;
    let y = from_4d(c, y, n)?;
    let idx = from_4d(c, idx, n)?;
    Ok(vec![Val::node(y), Val::node(idx)])
}

/// How many positions of each window ONNX counts: those in the input, and
/// with `include_pad` those in the declared padding (never the overhang
/// of a last window in ceil mode), as `[1, 1, out…]`.
fn window_counts(win: &Window, include_pad: bool) -> (Vec<usize>, Vec<f64>) {
    let n = win.size.len();
    let per_axis: Vec<Vec<usize>> = (0..n)
        .map(|i| {
            let (lo, hi) = if include_pad {
                (-(win.begin[i] as i64), (win.size[i] + win.end[i]) as i64)
            } else {
                (0, win.size[i] as i64)
            };
            (0..win.out[i])
                .map(|o| {
                    (0..win.k[i])
                        .filter(|&j| {
                            let p = (o * win.s[i] + j * win.d[i]) as i64 - win.begin[i] as i64;
                            p >= lo && p < hi
                        })
                        .count()
                })
                .collect()
        })
        .collect();
    let mut counts = vec![1.0f64];
    for axis in &per_axis {
        counts = counts
            .iter()
            .flat_map(|&a| axis.iter().map(move |&b| a * b as f64))
            .collect();
    }
    let mut shape = vec![1, 1];
    shape.extend(&win.out);
    (shape, counts)
}

/// Window sums divided by the counted positions.
fn average(c: &mut Ctx, x: NodeId, win: &Window, include_pad: bool) -> Result<NodeId> {
    let sum = pool_nd(c, x, win, Reduce::Sum)?;
    let (shape, counts) = window_counts(win, include_pad);
    let first = counts[0];
    let count = if counts.iter().all(|&v| v == first) {
        c.scalar_like(first, x)?
    } else {
        c.constant(Literal {
            dtype: c.dtype(x),
            shape,
            data: LiteralData::Float(counts),
        })?
    };
    c.binary(B::Div, sum, count)
}

fn average_pool(c: &mut Ctx) -> Result<Vec<Val>> {
    let x = c.x(0)?;
    float_input(c, x)?;
    let win = pool_window(c, x)?;
    let include_pad = c.attr_i("count_include_pad", 0) != 0;
    let n = win.size.len();
    // tessera's average pool where its geometry and divisor are ONNX's.
    if n < 3 && win.d.iter().all(|&d| d == 1) {
        let w2 = win.as_2d();
        if w2.begin == w2.end && (0..2).all(|i| 2 * w2.begin[i] <= w2.k[i]) {
            for ceil_mode in [false, true] {
                let p = Pool2d {
                    kernel: [w2.k[0], w2.k[1]],
                    stride: [w2.s[0], w2.s[1]],
                    padding: [w2.begin[0], w2.begin[1]],
                    dilation: [1, 1],
                    ceil_mode,
                    count_include_pad: include_pad,
                    divisor_override: None,
                };
                let fits =
                    (0..2).all(|i| p.out_size(AVG_POOL2D, i, w2.size[i]).ok() == Some(w2.out[i]));
                if fits {
                    let x4 = to_4d(c, x)?;
                    let y = custom(c, AVG_POOL2D, p.attrs(), &[x4])?[0];
                    return one(from_4d(c, y, n)?);
                }
            }
        }
    }
    one(average(c, x, &win, include_pad)?)
}

/// `|x|^p` and its inverse `y^(1/p)`.
fn lp_power(c: &mut Ctx, x: NodeId, p: f64) -> Result<NodeId> {
    if p == 2.0 {
        return c.binary(B::Mul, x, x);
    }
    let a = c.unary(U::Abs, x)?;
    if p == 1.0 {
        return Ok(a);
    }
    c.binary_c(B::Pow, a, p)
}

fn lp_root(c: &mut Ctx, y: NodeId, p: f64) -> Result<NodeId> {
    match p {
        1.0 => Ok(y),
        2.0 => c.unary(U::Sqrt, y),
        _ => c.binary_c(B::Pow, y, 1.0 / p),
    }
}

fn lp_p(c: &Ctx) -> Result<f64> {
    let p = attr_num(c, "p", 2.0);
    if !(p > 0.0 && p.is_finite()) {
        return Err(c.bad(format!("p must be positive, got {p}")));
    }
    Ok(p)
}

fn lp_pool(c: &mut Ctx) -> Result<Vec<Val>> {
    let x = c.x(0)?;
    float_input(c, x)?;
    let win = pool_window(c, x)?;
    let p = lp_p(c)?;
    let powered = lp_power(c, x, p)?;
    let sum = pool_nd(c, powered, &win, Reduce::Sum)?;
    one(lp_root(c, sum, p)?)
}

#[derive(Clone, Copy)]
enum Global {
    Avg,
    Max,
    Lp,
}

fn global(c: &mut Ctx, how: Global) -> Result<Vec<Val>> {
    let x = c.x(0)?;
    let rank = c.rank(x);
    if rank < 3 {
        return Err(c.bad(format!("needs an input [N, C, D1 …], got {}", c.ty(x))));
    }
    let dims: Vec<usize> = (2..rank).collect();
    let reduce = |c: &mut Ctx, op: R, v: NodeId| {
        c.add(
            Op::Reduce {
                op,
                dims: dims.clone(),
                keepdim: true,
            },
            &[v],
        )
    };
    let y = match how {
        Global::Avg => reduce(c, R::Mean, x)?,
        Global::Max => reduce(c, R::Max, x)?,
        Global::Lp => {
            let p = lp_p(c)?;
            let powered = lp_power(c, x, p)?;
            let s = reduce(c, R::Sum, powered)?;
            lp_root(c, s, p)?
        }
    };
    one(y)
}

// ---- BatchNormalization, LRN ----

/// `v` (`[C]`, or `[C, D…]` with `spatial = 0` before opset 9) broadcast
/// over `[N, C, D…]`.
fn channel_view(c: &mut Ctx, v: NodeId, rank: usize) -> Result<NodeId> {
    let mut dims = vec![Dim::Const(1)];
    dims.extend(c.dims(v));
    while dims.len() < rank {
        dims.push(Dim::Const(1));
    }
    c.reshape(v, dims)
}

fn batch_norm(c: &mut Ctx) -> Result<Vec<Val>> {
    let x = c.x(0)?;
    let (scale, bias, mean, var) = (c.x(1)?, c.x(2)?, c.x(3)?, c.x(4)?);
    let rank = c.rank(x);
    if rank < 2 || !c.dtype(x).is_float() {
        return Err(c.bad(format!("needs a float input [N, C, …], got {}", c.ty(x))));
    }
    let eps = c.attr_f("epsilon", 1e-5);
    let outputs = c.node.output.iter().filter(|o| !o.is_empty()).count();
    let training = if c.opset >= 14 {
        c.attr_i("training_mode", 0) != 0
    } else {
        // Before 14 the further outputs (saved statistics) exist only when
        // training.
        outputs > 1
    };
    if training && c.opset < 14 {
        return Err(c.unsupported(format!(
            "BatchNormalization in training mode before opset 14 (its {outputs} outputs include saved statistics): only the inference form and opset 14's training_mode are mapped"
        )));
    }
    let dtype = c.dtype(x);
    let stats = |c: &mut Ctx, v: NodeId| -> Result<NodeId> {
        let v = c.cast(v, dtype)?;
        channel_view(c, v, rank)
    };
    if !training {
        // y = x·(scale/√(var + ε)) + (bias − mean·scale/√(var + ε)): the
        // per-channel form tessera folds into a preceding convolution.
        let v = c.binary_c(B::Add, var, eps)?;
        let inv = c.unary(U::Rsqrt, v)?;
        let k = c.binary(B::Mul, scale, inv)?;
        let mk = c.binary(B::Mul, mean, k)?;
        let shift = c.binary(B::Sub, bias, mk)?;
        let k = stats(c, k)?;
        let shift = stats(c, shift)?;
        let y = c.binary(B::Mul, x, k)?;
        return one(c.binary(B::Add, y, shift)?);
    }
    // Training (opset 14+): the batch's mean and biased variance, and the
    // running statistics' update.
    let momentum = c.attr_f("momentum", 0.9);
    let dims: Vec<usize> = (0..rank).filter(|&d| d != 1).collect();
    let red = |c: &mut Ctx, v: NodeId| {
        c.add(
            Op::Reduce {
                op: R::Mean,
                dims: dims.clone(),
                keepdim: true,
            },
            &[v],
        )
    };
    let bmean = red(c, x)?;
    let centred = c.binary(B::Sub, x, bmean)?;
    let sq = c.binary(B::Mul, centred, centred)?;
    let bvar = red(c, sq)?;
    let v = c.binary_c(B::Add, bvar, eps)?;
    let inv = c.unary(U::Rsqrt, v)?;
    let nrm = c.binary(B::Mul, centred, inv)?;
    let s = stats(c, scale)?;
    let b = stats(c, bias)?;
    let y = c.binary(B::Mul, nrm, s)?;
    let y = c.binary(B::Add, y, b)?;
    let ch = c.dims(x)[1].clone();
    let flat = |c: &mut Ctx, v: NodeId| c.reshape(v, vec![ch.clone()]);
    let bmean = flat(c, bmean)?;
    let bvar = flat(c, bvar)?;
    let blend = |c: &mut Ctx, old: NodeId, new: NodeId| -> Result<NodeId> {
        let old = c.binary_c(B::Mul, old, momentum)?;
        let new = c.binary_c(B::Mul, new, 1.0 - momentum)?;
        c.binary(B::Add, old, new)
    };
    let rm = blend(c, mean, bmean)?;
    let rv = blend(c, var, bvar)?;
    Ok(vec![Val::node(y), Val::node(rm), Val::node(rv)])
}

/// LRN: `x / (bias + α/size · Σ x²)^β`, the sum over channels
/// `c − ⌊(size−1)/2⌋ ..= c + ⌈(size−1)/2⌉`, as a window sum over `[N, 1,
/// C, rest]`.
fn lrn(c: &mut Ctx) -> Result<Vec<Val>> {
    let x = c.x(0)?;
    float_input(c, x)?;
    let d = c.dims(x);
    if d.len() < 3 {
        return Err(c.bad(format!("needs an input [N, C, D1 …], got {}", c.ty(x))));
    }
    let size = c.attr_i("size", 0);
    if size < 1 {
        return Err(c.bad(format!("size must be positive, got {size}")));
    }
    let size = size as usize;
    let (alpha, beta, bias) = (
        c.attr_f("alpha", 1e-4),
        c.attr_f("beta", 0.75),
        c.attr_f("bias", 1.0),
    );
    let ch = d[1]
        .as_const()
        .ok_or_else(|| c.unsupported(format!("LRN needs concrete channels, got {}", c.ty(x))))?;
    let rest: usize = d[2..]
        .iter()
        .map(|v| v.as_const())
        .product::<Option<usize>>()
        .ok_or_else(|| {
            c.unsupported(format!("LRN needs concrete spatial sizes, got {}", c.ty(x)))
        })?;
    let sq = c.binary(B::Mul, x, x)?;
    let sq = c.reshape(
        sq,
        vec![
            d[0].clone(),
            Dim::Const(1),
            Dim::Const(ch),
            Dim::Const(rest),
        ],
    )?;
    let win = Window {
        size: vec![ch, rest],
        k: vec![size, 1],
        s: vec![1, 1],
        d: vec![1, 1],
        begin: vec![(size - 1) / 2, 0],
        end: vec![size / 2, 0],
        out: vec![ch, rest],
    };
    let (sum, _) = pool2d(c, sq, &win, Reduce::Sum, false)?;
    let sum = c.reshape(sum, d)?;
    let t = c.binary_c(B::Mul, sum, alpha / size as f64)?;
    let t = c.binary_c(B::Add, t, bias)?;
    let t = c.binary_c(B::Pow, t, beta)?;
    one(c.binary(B::Div, x, t)?)
}
