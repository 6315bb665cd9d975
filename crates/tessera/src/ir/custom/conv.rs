//! The signatures of the built-in convolution and pooling ops (NCHW). Their
//! CPU kernels are `runtime::cpu::conv`'s, their implementation and
//! backward `tensor::custom::conv`'s, the user-facing calls
//! `Tensor::conv2d`, `Tensor::max_pool2d`, … (`tensor::conv`).
//!
//! | op | inputs → outputs | attributes |
//! |---|---|---|
//! | `tessera::conv2d` | `(x [N,C,H,W], w [O,C/g,kh,kw][, b [O]])` → `y [N,O,Ho,Wo]` | [`Conv2d`] |
//! | `tessera::conv2d_backward_input` | `(dy [N,O,Ho,Wo], w)` → `dx [N,C,H,W]` | [`Conv2d`] + `input_hw` |
//! | `tessera::conv2d_backward_weight` | `(x, dy)` → `dw [O,C/g,kh,kw]` | [`Conv2d`] + `kernel_hw` |
//! | `tessera::max_pool2d` | `(x)` → `(y, indices i64)` | [`Pool2d`] |
//! | `tessera::max_pool2d_backward` | `(dy, indices)` → `dx` | [`Pool2d`] + `input_hw` |
//! | `tessera::avg_pool2d` | `(x)` → `y` | [`Pool2d`] |
//! | `tessera::avg_pool2d_backward` | `(dy)` → `dx` | [`Pool2d`] + `input_hw` |
//!
//! `Ho = (H + pad_top + pad_bottom − dilation·(kh − 1) − 1) / stride + 1`
//! (floor; pooling's `ceil_mode` rounds up, as PyTorch, dropping a last
//! window that would start in the padding). The conv's optional
//! `activation` (`"relu"`) is an epilogue applied after the bias, written
//! by the `conv_epilogue` pass; the max-pool indices are flat positions in
//! each `H·W` plane, as PyTorch's. Batch `N` may be symbolic; channels and
//! spatial sizes must be concrete.

use std::sync::Arc;

use serde_json::Value;

use super::{Attrs, Signature};
use crate::error::{op_err, Error, Result};
use crate::ir::{DType, Dim, Shape, TensorType};

pub const CONV2D: &str = "tessera::conv2d";
pub const CONV2D_BACKWARD_INPUT: &str = "tessera::conv2d_backward_input";
pub const CONV2D_BACKWARD_WEIGHT: &str = "tessera::conv2d_backward_weight";
pub const MAX_POOL2D: &str = "tessera::max_pool2d";
pub const MAX_POOL2D_BACKWARD: &str = "tessera::max_pool2d_backward";
pub const AVG_POOL2D: &str = "tessera::avg_pool2d";
pub const AVG_POOL2D_BACKWARD: &str = "tessera::avg_pool2d_backward";

/// The signatures of every op of this module.
pub(super) fn signatures() -> Vec<Signature> {
    let sig = |name: &str, f: fn(&Attrs, &[TensorType]) -> Result<Vec<TensorType>>| {
        Signature::new(name, Arc::new(f)).expect("a valid built-in name")
    };
    vec![
        sig(CONV2D, conv2d_types),
        sig(CONV2D_BACKWARD_INPUT, conv2d_backward_input_types),
        sig(CONV2D_BACKWARD_WEIGHT, conv2d_backward_weight_types),
        sig(MAX_POOL2D, max_pool2d_types),
        sig(MAX_POOL2D_BACKWARD, max_pool2d_backward_types),
        sig(AVG_POOL2D, avg_pool2d_types),
        sig(AVG_POOL2D_BACKWARD, avg_pool2d_backward_types),
    ]
}

/// The epilogue a convolution applies to its output (after the bias).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Activation {
    None,
    Relu,
}

impl Activation {
    pub fn name(self) -> &'static str {
        match self {
            Activation::None => "none",
            Activation::Relu => "relu",
        }
    }
}

/// A 2-D convolution's geometry: stride, padding (top, bottom, left,
/// right: "same" padding of an even kernel is uneven), dilation, groups,
/// and its epilogue.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Conv2d {
    pub stride: [usize; 2],
    pub padding: [usize; 4],
    pub dilation: [usize; 2],
    pub groups: usize,
    pub activation: Activation,
}

impl Conv2d {
    /// The attributes of a call.
    pub fn attrs(&self) -> Attrs {
        let mut a = Attrs::new();
        a.insert("stride".into(), self.stride.to_vec().into());
        a.insert("padding".into(), self.padding.to_vec().into());
        a.insert("dilation".into(), self.dilation.to_vec().into());
        a.insert("groups".into(), self.groups.into());
        a.insert("activation".into(), self.activation.name().into());
        a
    }

    /// The geometry a call's attributes describe, checked (strides,
    /// dilations and groups ≥ 1).
    pub fn from_attrs(op: &str, a: &Attrs) -> Result<Conv2d> {
        let activation = match a.get("activation").and_then(Value::as_str) {
            None | Some("none") => Activation::None,
            Some("relu") => Activation::Relu,
            Some(other) => {
                return Err(op_err!(
                    Argument,
                    op,
                    "unknown activation {other:?} (none, relu)"
                ))
            }
        };
        let conv = Conv2d {
            stride: usizes(op, a, "stride")?,
            padding: usizes(op, a, "padding")?,
            dilation: usizes(op, a, "dilation")?,
            groups: usize_attr(op, a, "groups")?,
            activation,
        };
        if conv.stride.contains(&0) || conv.dilation.contains(&0) || conv.groups == 0 {
            return Err(op_err!(
                Argument,
                op,
                "stride, dilation and groups must be positive, got stride {:?}, dilation {:?}, groups {}",
                conv.stride,
                conv.dilation,
                conv.groups
            ));
        }
        Ok(conv)
    }

    /// The output size along one spatial axis (0: height, 1: width) of an
    /// input `size` long and a kernel `k` long; an error when the dilated
    /// kernel is larger than the padded input.
    pub fn out_size(&self, op: &str, axis: usize, size: usize, k: usize) -> Result<usize> {
        let padded = size + self.padding[2 * axis] + self.padding[2 * axis + 1];
        let span = self.dilation[axis]
            .checked_mul(k.saturating_sub(1))
            .and_then(|s| s.checked_add(1))
            .ok_or_else(|| op_err!(Argument, op, "the dilated kernel's size overflows"))?;
        if k == 0 || span > padded {
            return Err(op_err!(
                Shape,
                op,
                "the kernel ({} {k} with dilation {}: {span}) is larger than the padded input ({} {size} + padding {}: {padded})",
                ["height", "width"][axis],
                self.dilation[axis],
                ["height", "width"][axis],
                self.padding[2 * axis] + self.padding[2 * axis + 1]
            ));
        }
        Ok((padded - span) / self.stride[axis] + 1)
    }
}

/// A 2-D pooling window's geometry (max or average).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Pool2d {
    pub kernel: [usize; 2],
    pub stride: [usize; 2],
    /// Symmetric: (height, width).
    pub padding: [usize; 2],
    /// Max pooling only (1 for average pooling).
    pub dilation: [usize; 2],
    pub ceil_mode: bool,
    /// Average pooling: whether padded positions count in the divisor.
    pub count_include_pad: bool,
    /// Average pooling: a divisor used instead of the window's size.
    pub divisor_override: Option<usize>,
}

impl Pool2d {
    pub fn attrs(&self) -> Attrs {
        let mut a = Attrs::new();
        a.insert("kernel".into(), self.kernel.to_vec().into());
        a.insert("stride".into(), self.stride.to_vec().into());
        a.insert("padding".into(), self.padding.to_vec().into());
        a.insert("dilation".into(), self.dilation.to_vec().into());
        a.insert("ceil_mode".into(), self.ceil_mode.into());
        a.insert("count_include_pad".into(), self.count_include_pad.into());
        a.insert(
            "divisor_override".into(),
            self.divisor_override.map_or(Value::Null, Into::into),
        );
        a
    }

    /// The geometry of a call, checked as PyTorch checks it: positive
    /// kernel, stride and dilation, padding at most half the kernel.
    pub fn from_attrs(op: &str, a: &Attrs) -> Result<Pool2d> {
        let bool_attr = |key: &str| {
            a.get(key)
                .and_then(Value::as_bool)
                .ok_or_else(|| op_err!(Argument, op, "needs a boolean attribute `{key}`"))
        };
        let divisor_override = match a.get("divisor_override") {
            None | Some(Value::Null) => None,
            Some(v) => Some(v.as_u64().filter(|&d| d > 0).ok_or_else(|| {
                op_err!(
                    Argument,
                    op,
                    "divisor_override must be a positive integer, got {v}"
                )
            })? as usize),
        };
        let pool = Pool2d {
            kernel: usizes(op, a, "kernel")?,
            stride: usizes(op, a, "stride")?,
            padding: usizes(op, a, "padding")?,
            dilation: usizes(op, a, "dilation")?,
            ceil_mode: bool_attr("ceil_mode")?,
            count_include_pad: bool_attr("count_include_pad")?,
            divisor_override,
        };
        if pool.kernel.contains(&0) || pool.stride.contains(&0) || pool.dilation.contains(&0) {
            return Err(op_err!(
                Argument,
                op,
                "kernel, stride and dilation must be positive, got kernel {:?}, stride {:?}, dilation {:?}",
                pool.kernel,
                pool.stride,
                pool.dilation
            ));
        }
        if (0..2).any(|i| 2 * pool.padding[i] > pool.kernel[i]) {
            return Err(op_err!(
                Argument,
                op,
                "padding should be at most half of the kernel size, got kernel {:?}, padding {:?}",
                pool.kernel,
                pool.padding
            ));
        }
        Ok(pool)
    }

    /// The output size along one axis for an input `size` long.
    pub fn out_size(&self, op: &str, axis: usize, size: usize) -> Result<usize> {
        let (k, s, p, d) = (
            self.kernel[axis],
            self.stride[axis],
            self.padding[axis],
            self.dilation[axis],
        );
        let padded = size + 2 * p;
        let span = d
            .checked_mul(k - 1)
            .and_then(|x| x.checked_add(1))
            .ok_or_else(|| op_err!(Argument, op, "the dilated window's size overflows"))?;
        if span > padded {
            return Err(op_err!(
                Shape,
                op,
                "the window ({} {k} with dilation {d}: {span}) is larger than the padded input ({} {size} + padding 2·{p}: {padded})",
                ["height", "width"][axis],
                ["height", "width"][axis]
            ));
        }
        let room = padded - span;
        let mut out = match self.ceil_mode {
            true => room.div_ceil(s) + 1,
            false => room / s + 1,
        };
        // A last window starting in the right padding is dropped.
        if self.ceil_mode && (out - 1) * s >= size + p {
            out -= 1;
        }
        Ok(out)
    }
}

fn usizes<const K: usize>(op: &str, a: &Attrs, key: &str) -> Result<[usize; K]> {
    let bad = || {
        op_err!(
            Argument,
            op,
            "needs attribute `{key}`: {K} non-negative integers, got {}",
            a.get(key).map_or("nothing".to_string(), |v| v.to_string())
        )
    };
    let list = a.get(key).and_then(Value::as_array).ok_or_else(bad)?;
    if list.len() != K {
        return Err(bad());
    }
    let mut out = [0; K];
    for (o, v) in out.iter_mut().zip(list) {
        *o = v.as_u64().ok_or_else(bad)? as usize;
    }
    Ok(out)
}

fn usize_attr(op: &str, a: &Attrs, key: &str) -> Result<usize> {
    a.get(key)
        .and_then(Value::as_u64)
        .map(|v| v as usize)
        .ok_or_else(|| {
            op_err!(
                Argument,
                op,
                "needs a non-negative integer attribute `{key}`"
            )
        })
}

/// A concrete dim of `t` (spatial sizes and channels must be concrete).
fn concrete(op: &str, t: &TensorType, d: usize) -> Result<usize> {
    t.shape.0[d].as_const().ok_or_else(|| {
        op_err!(
            Unsupported,
            op,
            "needs a concrete size at dim {d} (only the batch may be symbolic), got {t}"
        )
    })
}

fn four_d(op: &str, what: &str, t: &TensorType) -> Result<()> {
    if t.rank() != 4 {
        return Err(op_err!(
            Shape,
            op,
            "{what} must be 4-D (N, C, H, W), got {t}"
        ));
    }
    if !matches!(t.dtype, DType::F32 | DType::F64 | DType::F16 | DType::BF16) {
        return Err(op_err!(DType, op, "takes float tensors, got {what} {t}"));
    }
    Ok(())
}

fn shape4(n: &Dim, c: usize, h: usize, w: usize) -> Shape {
    Shape(vec![n.clone(), Dim::Const(c), Dim::Const(h), Dim::Const(w)])
}

/// Checks a convolution's operands and returns `(conv, [C, H, W], [O, Cg,
/// kh, kw], [Ho, Wo])`.
pub fn check_conv(
    op: &str,
    conv: &Conv2d,
    x: &TensorType,
    w: &TensorType,
) -> Result<([usize; 3], [usize; 4], [usize; 2])> {
    four_d(op, "the input", x)?;
    four_d(op, "the weight", w)?;
    if w.dtype != x.dtype {
        return Err(op_err!(
            DType,
            op,
            "input and weight must have one dtype, got input {x}, weight {w}"
        ));
    }
    let [c, h, wd] = [1, 2, 3].map(|d| concrete(op, x, d));
    let (c, h, wd) = (c?, h?, wd?);
    let [o, cg, kh, kw] = [0, 1, 2, 3].map(|d| concrete(op, w, d));
    let (o, cg, kh, kw) = (o?, cg?, kh?, kw?);
    let g = conv.groups;
    if !c.is_multiple_of(g) || !o.is_multiple_of(g) {
        return Err(op_err!(
            Shape,
            op,
            "groups ({g}) must divide the input channels and the output channels, got input {x}, weight {w}"
        ));
    }
    if cg * g != c {
        return Err(op_err!(
            Shape,
            op,
            "the weight's dim 1 must be the input's channels / groups ({c} / {g} = {}), got input {x}, weight {w}",
            c / g
        ));
    }
    let ho = conv
        .out_size(op, 0, h, kh)
        .map_err(|e| with_shapes(e, x, w))?;
    let wo = conv
        .out_size(op, 1, wd, kw)
        .map_err(|e| with_shapes(e, x, w))?;
    Ok(([c, h, wd], [o, cg, kh, kw], [ho, wo]))
}

fn with_shapes(mut e: Error, x: &TensorType, w: &TensorType) -> Error {
    e.message = format!("{} (input {x}, weight {w})", e.message);
    e
}

/// `(x, w[, b])` → `y`.
fn conv2d_types(a: &Attrs, inputs: &[TensorType]) -> Result<Vec<TensorType>> {
    let conv = Conv2d::from_attrs(CONV2D, a)?;
    let (x, w, b) = match inputs {
        [x, w] => (x, w, None),
        [x, w, b] => (x, w, Some(b)),
        _ => {
            return Err(op_err!(
                Argument,
                CONV2D,
                "takes (input, weight[, bias]), got {} inputs",
                inputs.len()
            ))
        }
    };
    let (_, [o, ..], [ho, wo]) = check_conv(CONV2D, &conv, x, w)?;
    if let Some(b) = b {
        if b.dtype != x.dtype || b.shape != Shape::from_concrete(&[o]) {
            return Err(op_err!(
                Shape,
                CONV2D,
                "the bias must be {}[{o}] (one per output channel), got {b} (input {x}, weight {w})",
                x.dtype
            ));
        }
    }
    Ok(vec![TensorType::new(
        x.dtype,
        shape4(&x.shape.0[0], o, ho, wo),
    )])
}

/// `(dy, w)` → `dx` of the input size `input_hw`.
fn conv2d_backward_input_types(a: &Attrs, inputs: &[TensorType]) -> Result<Vec<TensorType>> {
    let op = CONV2D_BACKWARD_INPUT;
    let conv = Conv2d::from_attrs(op, a)?;
    let [h, wd] = usizes(op, a, "input_hw")?;
    let [dy, w] = inputs else {
        return Err(op_err!(
            Argument,
            op,
            "takes (dy, weight), got {} inputs",
            inputs.len()
        ));
    };
    four_d(op, "the weight", w)?;
    let c = concrete(op, w, 1)? * conv.groups;
    let x = TensorType::new(w.dtype, shape4(&dy.shape.0[0], c, h, wd));
    let (_, [o, ..], [ho, wo]) = check_conv(op, &conv, &x, w)?;
    if dy.dtype != w.dtype || dy.shape != shape4(&dy.shape.0[0], o, ho, wo) {
        return Err(op_err!(
            Shape,
            op,
            "dy must be {}[N,{o},{ho},{wo}], got {dy} (weight {w})",
            w.dtype
        ));
    }
    Ok(vec![x])
}

/// `(x, dy)` → `dw` of the kernel size `kernel_hw`.
fn conv2d_backward_weight_types(a: &Attrs, inputs: &[TensorType]) -> Result<Vec<TensorType>> {
    let op = CONV2D_BACKWARD_WEIGHT;
    let conv = Conv2d::from_attrs(op, a)?;
    let [kh, kw] = usizes(op, a, "kernel_hw")?;
    let [x, dy] = inputs else {
        return Err(op_err!(
            Argument,
            op,
            "takes (input, dy), got {} inputs",
            inputs.len()
        ));
    };
    four_d(op, "dy", dy)?;
    let o = concrete(op, dy, 1)?;
    let c = concrete(op, x, 1)?;
    let w = TensorType::new(
        x.dtype,
        Shape::from_concrete(&[o, c / conv.groups.max(1), kh, kw]),
    );
    let (_, _, [ho, wo]) = check_conv(op, &conv, x, &w)?;
    if dy.dtype != x.dtype || dy.shape != shape4(&x.shape.0[0], o, ho, wo) {
        return Err(op_err!(
            Shape,
            op,
            "dy must be {}[N,{o},{ho},{wo}], got {dy} (input {x})",
            x.dtype
        ));
    }
    Ok(vec![w])
}

/// Checks a pooling input; returns `([C, H, W], [Ho, Wo])`.
pub fn check_pool(op: &str, pool: &Pool2d, x: &TensorType) -> Result<([usize; 3], [usize; 2])> {
    four_d(op, "the input", x)?;
    let c = concrete(op, x, 1)?;
    let h = concrete(op, x, 2)?;
    let w = concrete(op, x, 3)?;
    let add = |mut e: Error| {
        e.message = format!("{} (input {x})", e.message);
        e
    };
    let ho = pool.out_size(op, 0, h).map_err(add)?;
    let wo = pool.out_size(op, 1, w).map_err(add)?;
    Ok(([c, h, w], [ho, wo]))
}

fn one_input<'a>(op: &str, inputs: &'a [TensorType]) -> Result<&'a TensorType> {
    match inputs {
        [x] => Ok(x),
        _ => Err(op_err!(
            Argument,
            op,
            "takes one input, got {}",
            inputs.len()
        )),
    }
}

/// `(x)` → `(y, indices)`.
fn max_pool2d_types(a: &Attrs, inputs: &[TensorType]) -> Result<Vec<TensorType>> {
    let pool = Pool2d::from_attrs(MAX_POOL2D, a)?;
    let x = one_input(MAX_POOL2D, inputs)?;
    let ([c, ..], [ho, wo]) = check_pool(MAX_POOL2D, &pool, x)?;
    let shape = shape4(&x.shape.0[0], c, ho, wo);
    Ok(vec![
        TensorType::new(x.dtype, shape.clone()),
        TensorType::new(DType::I64, shape),
    ])
}

/// `(x)` → `y`.
fn avg_pool2d_types(a: &Attrs, inputs: &[TensorType]) -> Result<Vec<TensorType>> {
    let pool = Pool2d::from_attrs(AVG_POOL2D, a)?;
    let x = one_input(AVG_POOL2D, inputs)?;
    let ([c, ..], [ho, wo]) = check_pool(AVG_POOL2D, &pool, x)?;
    Ok(vec![TensorType::new(
        x.dtype,
        shape4(&x.shape.0[0], c, ho, wo),
    )])
}

/// The input type of a pooling backward from `dy` and `input_hw`, checked.
fn pool_backward_input(op: &str, a: &Attrs, dy: &TensorType) -> Result<TensorType> {
    let pool = Pool2d::from_attrs(op, a)?;
    let [h, w] = usizes(op, a, "input_hw")?;
    four_d(op, "dy", dy)?;
    let c = concrete(op, dy, 1)?;
    let x = TensorType::new(dy.dtype, shape4(&dy.shape.0[0], c, h, w));
    let (_, [ho, wo]) = check_pool(op, &pool, &x)?;
    if dy.shape != shape4(&dy.shape.0[0], c, ho, wo) {
        return Err(op_err!(
            Shape,
            op,
            "dy must be [N,{c},{ho},{wo}] for an input {x}, got {dy}"
        ));
    }
    Ok(x)
}

/// `(dy, indices)` → `dx`.
fn max_pool2d_backward_types(a: &Attrs, inputs: &[TensorType]) -> Result<Vec<TensorType>> {
    let op = MAX_POOL2D_BACKWARD;
    let [dy, indices] = inputs else {
        return Err(op_err!(
            Argument,
            op,
            "takes (dy, indices), got {} inputs",
            inputs.len()
        ));
    };
    let x = pool_backward_input(op, a, dy)?;
    if indices.dtype != DType::I64 || indices.shape != dy.shape {
        return Err(op_err!(
            Shape,
            op,
            "indices must be i64 of dy's shape, got dy {dy}, indices {indices}"
        ));
    }
    Ok(vec![x])
}

/// `(dy)` → `dx`.
fn avg_pool2d_backward_types(a: &Attrs, inputs: &[TensorType]) -> Result<Vec<TensorType>> {
    let op = AVG_POOL2D_BACKWARD;
    let dy = one_input(op, inputs)?;
    Ok(vec![pool_backward_input(op, a, dy)?])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(dims: &[usize]) -> TensorType {
        TensorType::new(DType::F32, Shape::from_concrete(dims))
    }

    fn conv(stride: usize, pad: usize, dil: usize, groups: usize) -> Conv2d {
        Conv2d {
            stride: [stride; 2],
            padding: [pad; 4],
            dilation: [dil; 2],
            groups,
            activation: Activation::None,
        }
    }

    #[test]
    fn conv_output_sizes_and_errors() {
        let out = conv2d_types(
            &conv(2, 1, 1, 1).attrs(),
            &[t(&[2, 3, 7, 8]), t(&[4, 3, 3, 3])],
        )
        .unwrap();
        assert_eq!(out, vec![t(&[2, 4, 4, 4])]);
        let out = conv2d_types(
            &conv(1, 0, 2, 3).attrs(),
            &[t(&[1, 6, 9, 9]), t(&[3, 2, 3, 3])],
        )
        .unwrap();
        assert_eq!(out, vec![t(&[1, 3, 5, 5])]);
        let e = conv2d_types(
            &conv(1, 0, 1, 1).attrs(),
            &[t(&[1, 3, 5, 5]), t(&[4, 2, 3, 3])],
        )
        .unwrap_err();
        assert!(e.to_string().contains("f32[4,2,3,3]"), "{e}");
        let e = conv2d_types(
            &conv(1, 0, 1, 2).attrs(),
            &[t(&[1, 3, 5, 5]), t(&[4, 1, 3, 3])],
        )
        .unwrap_err();
        assert!(e.to_string().contains("groups (2) must divide"), "{e}");
        let e = conv2d_types(
            &conv(1, 0, 1, 1).attrs(),
            &[t(&[1, 3, 2, 5]), t(&[4, 3, 3, 3])],
        )
        .unwrap_err();
        assert!(
            e.to_string().contains("larger than the padded input"),
            "{e}"
        );
        let e = conv2d_types(
            &conv(1, 0, 1, 1).attrs(),
            &[t(&[1, 3, 5, 5]), t(&[4, 3, 3, 3]), t(&[3])],
        )
        .unwrap_err();
        assert!(e.to_string().contains("bias"), "{e}");
        let e = conv2d_types(
            &conv(0, 0, 1, 1).attrs(),
            &[t(&[1, 3, 5, 5]), t(&[4, 3, 3, 3])],
        )
        .unwrap_err();
        assert!(e.to_string().contains("positive"), "{e}");
    }

    #[test]
    fn pool_sizes_follow_pytorch_ceil_mode() {
        let pool = |k, s, p, ceil| Pool2d {
            kernel: [k; 2],
            stride: [s; 2],
            padding: [p; 2],
            dilation: [1; 2],
            ceil_mode: ceil,
            count_include_pad: true,
            divisor_override: None,
        };
        // torch: max_pool2d(3, 2, 1) on 112 → 56; ceil_mode: k2 s2 on 5 → 3, k3 s2 p1 on 6 → 4.
        assert_eq!(pool(3, 2, 1, false).out_size("p", 0, 112).unwrap(), 56);
        assert_eq!(pool(2, 2, 0, true).out_size("p", 0, 5).unwrap(), 3);
        assert_eq!(pool(3, 2, 1, true).out_size("p", 0, 6).unwrap(), 4);
        let e = Pool2d::from_attrs("p", &pool(2, 2, 2, false).attrs()).unwrap_err();
        assert!(e.to_string().contains("at most half"), "{e}");
        let y = max_pool2d_types(&pool(2, 2, 0, false).attrs(), &[t(&[1, 2, 5, 4])]).unwrap();
        assert_eq!(
            y[1],
            TensorType::new(DType::I64, Shape::from_concrete(&[1, 2, 2, 2]))
        );
    }
}
