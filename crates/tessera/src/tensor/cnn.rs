//! The convolutional-network ops of `Tensor`, with PyTorch's names and
//! semantics (`torch.nn.functional`), NCHW.
//!
//! | method | PyTorch | how |
//! |---|---|---|
//! | [`Tensor::conv2d`] | `F.conv2d(x, w, b, stride, padding, dilation, groups)`, `padding="same"`/`"valid"` | the `tessera::conv2d` op (im2col + GEMM) |
//! | [`Tensor::conv1d`] | `F.conv1d` | `conv2d` on `[N, C, 1, L]` |
//! | [`Tensor::conv_transpose2d`] | `F.conv_transpose2d(x, w, b, stride, padding, output_padding, groups, dilation)` | the adjoint of `conv2d` (`tessera::conv2d_backward_input`) |
//! | [`Tensor::max_pool2d`], [`Tensor::max_pool2d_with_indices`] | `F.max_pool2d(…, return_indices)` | `tessera::max_pool2d` (indices: flat in each `H·W` plane) |
//! | [`Tensor::avg_pool2d`] | `F.avg_pool2d(…, ceil_mode, count_include_pad, divisor_override)` | `tessera::avg_pool2d` |
//! | [`Tensor::adaptive_avg_pool2d`] | `F.adaptive_avg_pool2d` | a mean (1×1), `avg_pool2d` (sizes divide), else two matmuls with averaging matrices |
//! | [`Tensor::batch_norm`] | `F.batch_norm` (training: batch statistics and the running update; eval: running statistics) | mean/var ops; eval is `x·scale + shift` per channel |
//! | [`Tensor::group_norm`] | `F.group_norm` | mean/var ops |
//! | [`Tensor::pad`] | `F.pad(x, pad, mode, value)`: constant, reflect, replicate | `cat` (constant), `index_select` (reflect, replicate) |
//! | [`Tensor::interpolate`] | `F.interpolate(x, size, mode)`: nearest, bilinear (`align_corners`) | `index_select` (nearest), two matmuls with interpolation matrices (bilinear) |
//! | [`Tensor::local_response_norm`] | `F.local_response_norm` | squares, `avg_pool2d` over channels, `pow` |
//!
//! Options follow PyTorch's defaults: [`ConvOptions`] (stride 1, padding
//! 0, dilation 1, groups 1) and [`PoolOptions`] (stride = kernel, padding
//! 0, dilation 1, `ceil_mode` false, `count_include_pad` true). Errors (a
//! channel mismatch, a kernel larger than the padded input, groups that do
//! not divide the channels) name the op, the shapes and the user's line.

use super::custom::lookup;
use super::{unwrap_or_panic, Tensor};
use crate::error::{Error, ErrorKind, Result, SourceLoc};
use crate::ir::custom::conv::{
    Activation, Conv2d, Pool2d, AVG_POOL2D, CONV2D, CONV2D_BACKWARD_INPUT, MAX_POOL2D,
};
use crate::ir::DType;

/// A convolution's padding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConvPadding {
    /// `(height, width)` zeros on both sides.
    Explicit([usize; 2]),
    /// PyTorch's `"same"`: the output has the input's size (stride 1
    /// only); an odd total goes to the bottom/right.
    Same,
    /// PyTorch's `"valid"`: no padding.
    Valid,
}

/// The arguments of [`Tensor::conv2d`], [`Tensor::conv1d`] and
/// [`Tensor::conv_transpose2d`] after the tensors, with PyTorch's
/// defaults; pairs are `(height, width)` (`conv1d` reads the width).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConvOptions {
    pub stride: [usize; 2],
    pub padding: ConvPadding,
    pub dilation: [usize; 2],
    pub groups: usize,
    /// `conv_transpose2d` only: extra rows/columns on the output's
    /// bottom/right.
    pub output_padding: [usize; 2],
}

impl Default for ConvOptions {
    fn default() -> ConvOptions {
        ConvOptions {
            stride: [1, 1],
            padding: ConvPadding::Explicit([0, 0]),
            dilation: [1, 1],
            groups: 1,
            output_padding: [0, 0],
        }
    }
}

impl ConvOptions {
    pub fn stride(self, s: usize) -> ConvOptions {
        self.stride_hw(s, s)
    }
    pub fn stride_hw(mut self, h: usize, w: usize) -> ConvOptions {
        self.stride = [h, w];
        self
    }
    pub fn padding(self, p: usize) -> ConvOptions {
        self.padding_hw(p, p)
    }
    pub fn padding_hw(mut self, h: usize, w: usize) -> ConvOptions {
        self.padding = ConvPadding::Explicit([h, w]);
        self
    }
    /// `padding="same"`.
    pub fn same(mut self) -> ConvOptions {
        self.padding = ConvPadding::Same;
        self
    }
    /// `padding="valid"`.
    pub fn valid(mut self) -> ConvOptions {
        self.padding = ConvPadding::Valid;
        self
    }
    pub fn dilation(self, d: usize) -> ConvOptions {
        self.dilation_hw(d, d)
    }
    pub fn dilation_hw(mut self, h: usize, w: usize) -> ConvOptions {
        self.dilation = [h, w];
        self
    }
    pub fn groups(mut self, g: usize) -> ConvOptions {
        self.groups = g;
        self
    }
    pub fn output_padding(mut self, p: usize) -> ConvOptions {
        self.output_padding = [p, p];
        self
    }

    /// The IR geometry for a kernel of `[kh, kw]`.
    fn geometry(&self, op: &str, kernel: [usize; 2]) -> Result<Conv2d> {
        let padding = match self.padding {
            ConvPadding::Explicit([h, w]) => [h, h, w, w],
            ConvPadding::Valid => [0; 4],
            ConvPadding::Same => {
                if self.stride != [1, 1] {
                    return Err(Error::op(
                        ErrorKind::Argument,
                        op,
                        format!(
                            "padding \"same\" is not supported for strided convolutions (stride {:?})",
                            self.stride
                        ),
                    ));
                }
                let total = |a: usize| self.dilation[a] * kernel[a].saturating_sub(1);
                let (th, tw) = (total(0), total(1));
                [th / 2, th - th / 2, tw / 2, tw - tw / 2]
            }
        };
        Ok(Conv2d {
            stride: self.stride,
            padding,
            dilation: self.dilation,
            groups: self.groups,
            activation: Activation::None,
        })
    }
}

/// The arguments of the pooling ops, with PyTorch's defaults (`stride`
/// `None` is the kernel size).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolOptions {
    pub kernel: [usize; 2],
    pub stride: Option<[usize; 2]>,
    pub padding: [usize; 2],
    /// Max pooling only.
    pub dilation: [usize; 2],
    pub ceil_mode: bool,
    /// Average pooling only.
    pub count_include_pad: bool,
    /// Average pooling only.
    pub divisor_override: Option<usize>,
}

impl PoolOptions {
    /// A square `k × k` window.
    pub fn new(k: usize) -> PoolOptions {
        PoolOptions::hw(k, k)
    }
    pub fn hw(kh: usize, kw: usize) -> PoolOptions {
        PoolOptions {
            kernel: [kh, kw],
            stride: None,
            padding: [0, 0],
            dilation: [1, 1],
            ceil_mode: false,
            count_include_pad: true,
            divisor_override: None,
        }
    }
    pub fn stride(self, s: usize) -> PoolOptions {
        self.stride_hw(s, s)
    }
    pub fn stride_hw(mut self, h: usize, w: usize) -> PoolOptions {
        self.stride = Some([h, w]);
        self
    }
    pub fn padding(mut self, p: usize) -> PoolOptions {
        self.padding = [p, p];
        self
    }
    pub fn padding_hw(mut self, h: usize, w: usize) -> PoolOptions {
        self.padding = [h, w];
        self
    }
    pub fn dilation(mut self, d: usize) -> PoolOptions {
        self.dilation = [d, d];
        self
    }
    pub fn ceil_mode(mut self, on: bool) -> PoolOptions {
        self.ceil_mode = on;
        self
    }
    pub fn count_include_pad(mut self, on: bool) -> PoolOptions {
        self.count_include_pad = on;
        self
    }
    pub fn divisor_override(mut self, d: usize) -> PoolOptions {
        self.divisor_override = Some(d);
        self
    }

    fn geometry(&self, max: bool) -> Pool2d {
        Pool2d {
            kernel: self.kernel,
            stride: self.stride.unwrap_or(self.kernel),
            padding: self.padding,
            dilation: if max { self.dilation } else { [1, 1] },
            ceil_mode: self.ceil_mode,
            count_include_pad: self.count_include_pad,
            divisor_override: if max { None } else { self.divisor_override },
        }
    }
}

/// How [`Tensor::pad`] fills.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum PadMode {
    /// With a value.
    Constant(f64),
    /// Mirrored without repeating the edge (`d c b | a b c d | c b a`).
    Reflect,
    /// Repeating the edge.
    Replicate,
}

/// How [`Tensor::interpolate`] samples.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Interpolation {
    /// PyTorch's `"nearest"`: source `floor(dst · in/out)`.
    Nearest,
    /// PyTorch's `"bilinear"`.
    Bilinear { align_corners: bool },
}

/// Running statistics of [`Tensor::batch_norm`]: per-channel mean and
/// (unbiased) variance.
#[derive(Clone, Debug)]
pub struct BatchNormStats {
    pub mean: Tensor,
    pub var: Tensor,
}

#[track_caller]
fn err(kind: ErrorKind, op: &str, message: String) -> Error {
    Error::op(kind, op, message).at(SourceLoc::caller())
}

/// Calls built-in op `name` at the user's line.
#[track_caller]
fn call(name: &str, attrs: crate::ir::custom::Attrs, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
    let at = SourceLoc::caller();
    lookup(name).map_err(|e| e.at(at))?.call(attrs, inputs)
}

fn shape_isize(s: &[usize]) -> Vec<isize> {
    s.iter().map(|&d| d as isize).collect()
}

/// `[1, C, 1, …]` for a rank-`rank` input: how per-channel vectors broadcast.
fn channel_shape(c: usize, rank: usize) -> Vec<isize> {
    let mut s = vec![1isize; rank];
    s[1] = c as isize;
    s
}

impl Tensor {
    /// `F.conv2d(self [N,C,H,W], weight [O,C/groups,kh,kw], bias [O])`.
    #[track_caller]
    pub fn conv2d(&self, weight: &Tensor, bias: Option<&Tensor>, opts: ConvOptions) -> Tensor {
        unwrap_or_panic(self.try_conv2d(weight, bias, opts))
    }

    /// [`Tensor::conv2d`], returning the error instead of panicking.
    #[track_caller]
    pub fn try_conv2d(
        &self,
        weight: &Tensor,
        bias: Option<&Tensor>,
        opts: ConvOptions,
    ) -> Result<Tensor> {
        if opts.output_padding != [0, 0] {
            return Err(err(
                ErrorKind::Argument,
                CONV2D,
                "output_padding is an argument of conv_transpose2d only".into(),
            ));
        }
        let kernel = match weight.shape() {
            [_, _, kh, kw] => [*kh, *kw],
            _ => {
                return Err(err(
                    ErrorKind::Shape,
                    CONV2D,
                    format!(
                        "the weight must be 4-D [O, C/groups, kh, kw], got {} (input {})",
                        weight.ty(),
                        self.ty()
                    ),
                ))
            }
        };
        let at = SourceLoc::caller();
        let geometry = opts.geometry(CONV2D, kernel).map_err(|e| e.at(at))?;
        let mut inputs = vec![self, weight];
        inputs.extend(bias);
        Ok(call(CONV2D, geometry.attrs(), &inputs)?.remove(0))
    }

    /// `F.conv1d(self [N,C,L], weight [O,C/groups,k], bias [O])`: the
    /// width entries of `opts` apply.
    #[track_caller]
    pub fn conv1d(&self, weight: &Tensor, bias: Option<&Tensor>, opts: ConvOptions) -> Tensor {
        unwrap_or_panic(self.try_conv1d(weight, bias, opts))
    }

    /// [`Tensor::conv1d`], returning the error instead of panicking.
    #[track_caller]
    pub fn try_conv1d(
        &self,
        weight: &Tensor,
        bias: Option<&Tensor>,
        opts: ConvOptions,
    ) -> Result<Tensor> {
        if self.rank() != 3 || weight.rank() != 3 {
            return Err(err(
                ErrorKind::Shape,
                "conv1d",
                format!(
                    "takes input [N, C, L] and weight [O, C/groups, k], got input {}, weight {}",
                    self.ty(),
                    weight.ty()
                ),
            ));
        }
        let opts = ConvOptions {
            stride: [1, opts.stride[1]],
            dilation: [1, opts.dilation[1]],
            padding: match opts.padding {
                ConvPadding::Explicit([_, w]) => ConvPadding::Explicit([0, w]),
                other => other,
            },
            ..opts
        };
        let y = self
            .try_unsqueeze(2)?
            .try_conv2d(&weight.try_unsqueeze(2)?, bias, opts)?;
        y.try_squeeze(2)
    }

    /// `F.conv_transpose2d(self [N,Cin,H,W], weight [Cin,Cout/groups,kh,kw],
    /// bias [Cout])`: the adjoint of `conv2d` with the same stride,
    /// padding, dilation and groups; `output_padding` adds rows/columns to
    /// the bottom/right of the output.
    #[track_caller]
    pub fn conv_transpose2d(
        &self,
        weight: &Tensor,
        bias: Option<&Tensor>,
        opts: ConvOptions,
    ) -> Tensor {
        unwrap_or_panic(self.try_conv_transpose2d(weight, bias, opts))
    }

    /// [`Tensor::conv_transpose2d`], returning the error instead of panicking.
    #[track_caller]
    pub fn try_conv_transpose2d(
        &self,
        weight: &Tensor,
        bias: Option<&Tensor>,
        opts: ConvOptions,
    ) -> Result<Tensor> {
        let op = "conv_transpose2d";
        let (x, w) = (self.shape(), weight.shape());
        let (true, true) = (x.len() == 4, w.len() == 4) else {
            return Err(err(
                ErrorKind::Shape,
                op,
                format!(
                    "takes input [N, Cin, H, W] and weight [Cin, Cout/groups, kh, kw], got input {}, weight {}",
                    self.ty(),
                    weight.ty()
                ),
            ));
        };
        let padding = match opts.padding {
            ConvPadding::Explicit(p) => p,
            ConvPadding::Valid => [0, 0],
            ConvPadding::Same => {
                return Err(err(
                    ErrorKind::Argument,
                    op,
                    "padding \"same\" is not supported by conv_transpose2d".into(),
                ))
            }
        };
        if x[1] != w[0] {
            return Err(err(
                ErrorKind::Shape,
                op,
                format!(
                    "the weight's dim 0 must be the input's channels ({}), got input {}, weight {}",
                    x[1],
                    self.ty(),
                    weight.ty()
                ),
            ));
        }
        let mut out = [0usize; 2];
        for a in 0..2 {
            let (s, p, d, op_) = (
                opts.stride[a],
                padding[a],
                opts.dilation[a],
                opts.output_padding[a],
            );
            if op_ >= s.max(d) {
                return Err(err(
                    ErrorKind::Argument,
                    op,
                    format!(
                        "output_padding must be smaller than stride or dilation, got output_padding {:?}, stride {:?}, dilation {:?}",
                        opts.output_padding, opts.stride, opts.dilation
                    ),
                ));
            }
            // (H − 1)·s − 2p + d·(k − 1) + output_padding + 1
            let full = (x[2 + a].max(1) - 1)
                .checked_mul(s)
                .and_then(|v| v.checked_add(d.checked_mul(w[2 + a].max(1) - 1)?))
                .and_then(|v| v.checked_add(op_ + 1));
            out[a] = match full.and_then(|v| v.checked_sub(2 * p)) {
                Some(v) if v > 0 => v,
                _ => {
                    return Err(err(
                        ErrorKind::Shape,
                        op,
                        format!(
                            "the output would be empty: input {}, weight {}, stride {:?}, padding {padding:?}",
                            self.ty(),
                            weight.ty(),
                            opts.stride
                        ),
                    ))
                }
            };
        }
        let geometry = Conv2d {
            stride: opts.stride,
            padding: [padding[0], padding[0], padding[1], padding[1]],
            dilation: opts.dilation,
            groups: opts.groups,
            activation: Activation::None,
        };
        let mut attrs = geometry.attrs();
        attrs.insert("input_hw".into(), out.to_vec().into());
        let y = call(CONV2D_BACKWARD_INPUT, attrs, &[self, weight])?.remove(0);
        match bias {
            Some(b) => y.try_add(&b.try_reshape(&channel_shape(b.numel(), 4))?),
            None => Ok(y),
        }
    }

    /// `F.max_pool2d(self [N,C,H,W], …)`.
    #[track_caller]
    pub fn max_pool2d(&self, opts: PoolOptions) -> Tensor {
        unwrap_or_panic(self.try_max_pool2d(opts))
    }

    /// [`Tensor::max_pool2d`], returning the error instead of panicking.
    #[track_caller]
    pub fn try_max_pool2d(&self, opts: PoolOptions) -> Result<Tensor> {
        Ok(self.try_max_pool2d_with_indices(opts)?.0)
    }

    /// `F.max_pool2d(…, return_indices=True)`: the maxima and their flat
    /// indices (i64) in each `H·W` plane.
    #[track_caller]
    pub fn max_pool2d_with_indices(&self, opts: PoolOptions) -> (Tensor, Tensor) {
        match self.try_max_pool2d_with_indices(opts) {
            Ok(r) => r,
            Err(e) => panic!("{e}"),
        }
    }

    /// [`Tensor::max_pool2d_with_indices`], returning the error instead of
    /// panicking.
    #[track_caller]
    pub fn try_max_pool2d_with_indices(&self, opts: PoolOptions) -> Result<(Tensor, Tensor)> {
        let mut out = call(MAX_POOL2D, opts.geometry(true).attrs(), &[self])?;
        let indices = out.pop().expect("two outputs");
        Ok((out.pop().expect("two outputs"), indices))
    }

    /// `F.avg_pool2d(self [N,C,H,W], …)`.
    #[track_caller]
    pub fn avg_pool2d(&self, opts: PoolOptions) -> Tensor {
        unwrap_or_panic(self.try_avg_pool2d(opts))
    }

    /// [`Tensor::avg_pool2d`], returning the error instead of panicking.
    #[track_caller]
    pub fn try_avg_pool2d(&self, opts: PoolOptions) -> Result<Tensor> {
        Ok(call(AVG_POOL2D, opts.geometry(false).attrs(), &[self])?.remove(0))
    }

    /// `F.adaptive_avg_pool2d(self [N,C,H,W], (oh, ow))`: output cell `i`
    /// averages input rows `floor(i·H/oh) .. ceil((i+1)·H/oh)` (likewise
    /// columns).
    #[track_caller]
    pub fn adaptive_avg_pool2d(&self, output: [usize; 2]) -> Tensor {
        unwrap_or_panic(self.try_adaptive_avg_pool2d(output))
    }

    /// [`Tensor::adaptive_avg_pool2d`], returning the error instead of panicking.
    #[track_caller]
    pub fn try_adaptive_avg_pool2d(&self, output: [usize; 2]) -> Result<Tensor> {
        let op = "adaptive_avg_pool2d";
        let s = self.shape();
        if s.len() != 4 || output.contains(&0) || !self.dtype().is_float() {
            return Err(err(
                ErrorKind::Shape,
                op,
                format!(
                    "takes a float [N, C, H, W] input and a positive output size, got {} and {output:?}",
                    self.ty()
                ),
            ));
        }
        let (h, w) = (s[2], s[3]);
        if output == [1, 1] {
            return self.try_mean(&[2, 3], true);
        }
        if h.is_multiple_of(output[0]) && w.is_multiple_of(output[1]) {
            let k = [h / output[0], w / output[1]];
            return self.try_avg_pool2d(PoolOptions::hw(k[0], k[1]));
        }
        // Separable: rows then columns, each a product with an averaging
        // matrix.
        let rows = averaging(output[0], h, self.dtype())?; // [oh, h]
        let cols = averaging(output[1], w, self.dtype())?.try_t()?; // [w, ow]
        rows.try_matmul(&self.try_matmul(&cols)?)
    }

    /// `F.batch_norm(self [N, C, …], running_mean, running_var, weight,
    /// bias, training, momentum, eps)`. Training (or no running
    /// statistics) normalises with the batch's mean and biased variance
    /// over every dim but 1, and, with running statistics, also returns
    /// their update `(1 − momentum)·running + momentum·batch` (the variance
    /// unbiased), which PyTorch writes in place. Eval uses the running
    /// statistics: `x·scale + shift` with `scale = weight/√(var + eps)` per
    /// channel (the form the compiler folds into a preceding conv).
    #[track_caller]
    #[allow(clippy::too_many_arguments)]
    pub fn batch_norm(
        &self,
        running: Option<&BatchNormStats>,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        training: bool,
        momentum: f64,
        eps: f64,
    ) -> (Tensor, Option<BatchNormStats>) {
        match self.try_batch_norm(running, weight, bias, training, momentum, eps) {
            Ok(r) => r,
            Err(e) => panic!("{e}"),
        }
    }

    /// [`Tensor::batch_norm`], returning the error instead of panicking.
    #[track_caller]
    pub fn try_batch_norm(
        &self,
        running: Option<&BatchNormStats>,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        training: bool,
        momentum: f64,
        eps: f64,
    ) -> Result<(Tensor, Option<BatchNormStats>)> {
        let op = "batch_norm";
        let s = self.shape().to_vec();
        let at = SourceLoc::caller();
        if s.len() < 2 || !self.dtype().is_float() {
            return Err(err(
                ErrorKind::Shape,
                op,
                format!("takes a float input [N, C, …], got {}", self.ty()),
            ));
        }
        let c = s[1];
        let per_channel = [
            running.map(|r| &r.mean),
            running.map(|r| &r.var),
            weight,
            bias,
        ];
        for (t, name) in per_channel
            .iter()
            .zip(["running_mean", "running_var", "weight", "bias"])
        {
            if let Some(t) = t {
                if t.shape() != [c] {
                    return Err(err(
                        ErrorKind::Shape,
                        op,
                        format!(
                            "{name} must have {c} elements (one per channel), got {} (input {})",
                            t.ty(),
                            self.ty()
                        ),
                    ));
                }
            }
        }
        let bshape = channel_shape(c, s.len());
        let per = |t: &Tensor| t.try_reshape(&bshape);
        let dims: Vec<isize> = (0..s.len() as isize).filter(|&d| d != 1).collect();
        let count: usize = s
            .iter()
            .enumerate()
            .filter(|(d, _)| *d != 1)
            .map(|(_, n)| n)
            .product();
        if !training {
            if let Some(r) = running {
                // Eval: one scale and shift per channel.
                let inv = r.var.try_add(eps)?.try_rsqrt()?;
                let scale = match weight {
                    Some(w) => inv.try_mul(w)?,
                    None => inv,
                };
                let shift = r.mean.try_mul(&scale)?.try_neg()?;
                let shift = match bias {
                    Some(b) => shift.try_add(b)?,
                    None => shift,
                };
                let y = self.try_mul(&per(&scale)?)?.try_add(&per(&shift)?)?;
                return Ok((y, None));
            }
        }
        if count <= 1 && training {
            return Err(Error::op(
                ErrorKind::Shape,
                op,
                format!(
                    "expected more than 1 value per channel when training, got input {}",
                    self.ty()
                ),
            )
            .at(at));
        }
        let mean = self.try_mean(&dims, true)?;
        let centred = self.try_sub(&mean)?;
        let var = centred.try_mul(&centred)?.try_mean(&dims, true)?;
        let mut y = centred.try_mul(&var.try_add(eps)?.try_rsqrt()?)?;
        if let Some(w) = weight {
            y = y.try_mul(&per(w)?)?;
        }
        if let Some(b) = bias {
            y = y.try_add(&per(b)?)?;
        }
        let update = match (training, running) {
            (true, Some(r)) => {
                let batch_mean = mean.detach().try_reshape(&[c as isize])?;
                let unbiased = count as f64 / (count as f64 - 1.0);
                let batch_var = var.detach().try_reshape(&[c as isize])?.try_mul(unbiased)?;
                let blend = |old: &Tensor, new: &Tensor| -> Result<Tensor> {
                    old.detach()
                        .try_mul(1.0 - momentum)?
                        .try_add(&new.try_mul(momentum)?)
                };
                Some(BatchNormStats {
                    mean: blend(&r.mean, &batch_mean)?,
                    var: blend(&r.var, &batch_var)?,
                })
            }
            _ => None,
        };
        Ok((y, update))
    }

    /// `F.group_norm(self [N, C, …], num_groups, weight, bias, eps)`.
    #[track_caller]
    pub fn group_norm(
        &self,
        num_groups: usize,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        eps: f64,
    ) -> Tensor {
        unwrap_or_panic(self.try_group_norm(num_groups, weight, bias, eps))
    }

    /// [`Tensor::group_norm`], returning the error instead of panicking.
    #[track_caller]
    pub fn try_group_norm(
        &self,
        num_groups: usize,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        eps: f64,
    ) -> Result<Tensor> {
        let s = self.shape().to_vec();
        if s.len() < 2
            || num_groups == 0
            || !s[1].is_multiple_of(num_groups)
            || !self.dtype().is_float()
        {
            return Err(err(
                ErrorKind::Shape,
                "group_norm",
                format!(
                    "takes a float input [N, C, …] whose channels num_groups ({num_groups}) divides, got {}",
                    self.ty()
                ),
            ));
        }
        let g = self.try_reshape(&[s[0] as isize, num_groups as isize, -1])?;
        let mean = g.try_mean(&[2], true)?;
        let centred = g.try_sub(&mean)?;
        let var = centred.try_mul(&centred)?.try_mean(&[2], true)?;
        let y = centred
            .try_mul(&var.try_add(eps)?.try_rsqrt()?)?
            .try_reshape(&shape_isize(&s))?;
        let bshape = channel_shape(s[1], s.len());
        let y = match weight {
            Some(w) => y.try_mul(&w.try_reshape(&bshape)?)?,
            None => y,
        };
        match bias {
            Some(b) => y.try_add(&b.try_reshape(&bshape)?),
            None => Ok(y),
        }
    }

    /// `F.pad(self, pad, mode, value)`: `pad` lists (before, after) pairs
    /// from the last dim backwards, as PyTorch's.
    #[track_caller]
    pub fn pad(&self, pad: &[usize], mode: PadMode) -> Tensor {
        unwrap_or_panic(self.try_pad(pad, mode))
    }

    /// [`Tensor::pad`], returning the error instead of panicking.
    #[track_caller]
    pub fn try_pad(&self, pad: &[usize], mode: PadMode) -> Result<Tensor> {
        let op = "pad";
        let rank = self.rank();
        if !pad.len().is_multiple_of(2) || pad.len() / 2 > rank {
            return Err(err(
                ErrorKind::Argument,
                op,
                format!(
                    "pad must list (before, after) pairs for at most {rank} dims, got {pad:?} for {}",
                    self.ty()
                ),
            ));
        }
        let mut x = self.clone();
        for (i, pair) in pad.chunks(2).enumerate() {
            let dim = rank - 1 - i;
            let (before, after) = (pair[0], pair[1]);
            if before == 0 && after == 0 {
                continue;
            }
            let size = x.shape()[dim];
            x = match mode {
                PadMode::Constant(value) => {
                    let part = |n: usize| {
                        let mut shape = x.shape().to_vec();
                        shape[dim] = n;
                        Tensor::try_full(&shape, value, x.dtype())
                    };
                    let mut parts = Vec::new();
                    if before > 0 {
                        parts.push(part(before)?);
                    }
                    parts.push(x.clone());
                    if after > 0 {
                        parts.push(part(after)?);
                    }
                    Tensor::try_cat(&parts.iter().collect::<Vec<_>>(), dim as isize)?
                }
                PadMode::Reflect | PadMode::Replicate => {
                    let reflect = mode == PadMode::Reflect;
                    if size == 0 || (reflect && (before >= size || after >= size)) {
                        return Err(err(
                            ErrorKind::Argument,
                            op,
                            format!(
                                "{} padding ({before}, {after}) of dim {dim} must be smaller than its size, got {}",
                                if reflect { "reflect" } else { "replicate" },
                                self.ty()
                            ),
                        ));
                    }
                    let last = size as i64 - 1;
                    let index: Vec<i64> = (-(before as i64)..size as i64 + after as i64)
                        .map(|i| match reflect {
                            true if i < 0 => -i,
                            true if i > last => 2 * last - i,
                            _ => i.clamp(0, last),
                        })
                        .collect();
                    let n = index.len();
                    x.try_index_select(dim as isize, &Tensor::try_from_vec(index, &[n])?)?
                }
            };
        }
        Ok(x)
    }

    /// `F.interpolate(self [N,C,H,W], size=(oh, ow), mode)`.
    #[track_caller]
    pub fn interpolate(&self, size: [usize; 2], mode: Interpolation) -> Tensor {
        unwrap_or_panic(self.try_interpolate(size, mode))
    }

    /// [`Tensor::interpolate`], returning the error instead of panicking.
    #[track_caller]
    pub fn try_interpolate(&self, size: [usize; 2], mode: Interpolation) -> Result<Tensor> {
        let s = self.shape();
        if s.len() != 4 || size.contains(&0) || s[2] == 0 || s[3] == 0 || !self.dtype().is_float() {
            return Err(err(
                ErrorKind::Shape,
                "interpolate",
                format!(
                    "takes a float [N, C, H, W] input and a positive size, got {} and {size:?}",
                    self.ty()
                ),
            ));
        }
        let (h, w) = (s[2], s[3]);
        match mode {
            Interpolation::Nearest => {
                let index = |n_in: usize, n_out: usize| -> Result<Tensor> {
                    let scale = n_in as f32 / n_out as f32;
                    let idx: Vec<i64> = (0..n_out)
                        .map(|o| ((o as f32 * scale).floor() as i64).min(n_in as i64 - 1))
                        .collect();
                    Tensor::try_from_vec(idx, &[n_out])
                };
                self.try_index_select(2, &index(h, size[0])?)?
                    .try_index_select(3, &index(w, size[1])?)
            }
            Interpolation::Bilinear { align_corners } => {
                let rows = linear_weights(h, size[0], align_corners, self.dtype())?; // [oh, h]
                let cols = linear_weights(w, size[1], align_corners, self.dtype())?.try_t()?; // [w, ow]
                rows.try_matmul(&self.try_matmul(&cols)?)
            }
        }
    }

    /// `F.local_response_norm(self [N, C, …], size, alpha, beta, k)`:
    /// `x / (k + alpha/size · Σ x²)^beta` over `size` neighbouring channels.
    #[track_caller]
    pub fn local_response_norm(&self, size: usize, alpha: f64, beta: f64, k: f64) -> Tensor {
        unwrap_or_panic(self.try_local_response_norm(size, alpha, beta, k))
    }

    /// [`Tensor::local_response_norm`], returning the error instead of panicking.
    #[track_caller]
    pub fn try_local_response_norm(
        &self,
        size: usize,
        alpha: f64,
        beta: f64,
        k: f64,
    ) -> Result<Tensor> {
        let s = self.shape().to_vec();
        if s.len() < 3 || size == 0 || !self.dtype().is_float() {
            return Err(err(
                ErrorKind::Shape,
                "local_response_norm",
                format!(
                    "takes a float input [N, C, …] and size > 0, got {} and size {size}",
                    self.ty()
                ),
            ));
        }
        let sq = self
            .try_mul(self)?
            .try_reshape(&[s[0] as isize, 1, s[1] as isize, -1])?
            .try_pad(&[0, 0, size / 2, (size - 1) / 2], PadMode::Constant(0.0))?;
        let avg = sq.try_avg_pool2d(PoolOptions::hw(size, 1).stride(1))?;
        let div = avg
            .try_reshape(&shape_isize(&s))?
            .try_mul(alpha)?
            .try_add(k)?
            .try_pow(beta)?;
        self.try_div(&div)
    }
}

/// `[out, len]`: row `i` averages `floor(i·len/out) .. ceil((i+1)·len/out)`.
fn averaging(out: usize, len: usize, dtype: DType) -> Result<Tensor> {
    let mut m = vec![0.0f64; out * len];
    for i in 0..out {
        let (start, end) = (i * len / out, ((i + 1) * len).div_ceil(out));
        for j in start..end {
            m[i * len + j] = 1.0 / (end - start) as f64;
        }
    }
    Tensor::try_from_vec(m, &[out, len])?.try_cast(dtype)
}

/// `[out, len]`: PyTorch's linear-interpolation weights (source index
/// `(dst + ½)·len/out − ½` clamped at 0, or `dst·(len−1)/(out−1)` with
/// `align_corners`), in the arithmetic of its kernels: f64 for f64, else f32.
fn linear_weights(len: usize, out: usize, align_corners: bool, dtype: DType) -> Result<Tensor> {
    let m = match dtype {
        DType::F64 => linear_matrix::<f64>(len, out, align_corners),
        _ => linear_matrix::<f32>(len, out, align_corners),
    };
    Tensor::try_from_vec(m, &[out, len])?.try_cast(dtype)
}

fn linear_matrix<T>(len: usize, out: usize, align_corners: bool) -> Vec<f64>
where
    T: Copy
        + Into<f64>
        + PartialOrd
        + std::ops::Add<Output = T>
        + std::ops::Sub<Output = T>
        + std::ops::Mul<Output = T>
        + std::ops::Div<Output = T>,
    f64: AsT<T>,
{
    let t = |v: f64| -> T { v.to_t() };
    let mut m = vec![0.0f64; out * len];
    for o in 0..out {
        let src = match align_corners {
            true if out > 1 => (t(len as f64) - t(1.0)) / (t(out as f64) - t(1.0)) * t(o as f64),
            true => t(0.0),
            false => {
                let s = (t(len as f64) / t(out as f64)) * (t(o as f64) + t(0.5)) - t(0.5);
                if s < t(0.0) {
                    t(0.0)
                } else {
                    s
                }
            }
        };
        let i0 = (src.into() as usize).min(len - 1);
        let i1 = if i0 < len - 1 { i0 + 1 } else { i0 };
        let l1 = src - t(i0 as f64);
        let l0 = t(1.0) - l1;
        m[o * len + i0] += l0.into();
        m[o * len + i1] += l1.into();
    }
    m
}

/// `f64 as T` for the float types the interpolation weights use.
trait AsT<T> {
    fn to_t(self) -> T;
}

impl AsT<f32> for f64 {
    fn to_t(self) -> f32 {
        self as f32
    }
}

impl AsT<f64> for f64 {
    fn to_t(self) -> f64 {
        self
    }
}
