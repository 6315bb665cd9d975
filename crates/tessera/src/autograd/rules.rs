//! One vector-Jacobian product rule per op, written with `Tensor` ops so
//! that the same rule runs eagerly and, on traced tensors, builds the
//! backward graph.

use crate::error::Result;
use crate::ir::{BinaryOp, Op, ReduceOp, UnaryOp};
use crate::tensor::Tensor;

/// The gradients of `op`'s inputs given the gradient `g` of its `output`;
/// `None` for inputs that carry no gradient (indices, conditions, ints)
/// and, for products, sums, `where` and elementwise binaries, for inputs
/// that do not require grad (nothing reads them, and the values the
/// gradient would need are not kept: see [`Op::backward_reads`], which
/// lists what each rule here reads).
pub fn vjp(op: &Op, inputs: &[Tensor], output: &Tensor, g: &Tensor) -> Result<Vec<Option<Tensor>>> {
    let x = &inputs[0];
    let needs = |i: usize| inputs[i].requires_grad();
    Ok(match op {
        // Bitwise ops take integers only, which carry no gradient.
        Op::Unary(UnaryOp::BitNot) => vec![None],
        Op::Binary(b) if b.is_bitwise() => vec![None, None],
        Op::Unary(u) => vec![Some(unary(*u, x, output, g)?)],
        Op::Cast(_) => vec![x.dtype().is_float().then(|| g.cast(x.dtype()))],
        Op::BitCast(_) => vec![None],
        Op::Binary(b) => {
            let (ga, gb) = binary(*b, x, &inputs[1], output, g, [needs(0), needs(1)])?;
            vec![
                ga.map(|ga| sum_to_shape(&ga, x.shape())).transpose()?,
                gb.map(|gb| sum_to_shape(&gb, inputs[1].shape()))
                    .transpose()?,
            ]
        }
        Op::Where => {
            let (c, a, b) = (x, &inputs[1], &inputs[2]);
            let zero = Tensor::zeros(&[], g.dtype());
            let ga = needs(1).then(|| sum_to_shape(&Tensor::try_where(c, g, &zero)?, a.shape()));
            let gb = needs(2).then(|| sum_to_shape(&Tensor::try_where(c, &zero, g)?, b.shape()));
            vec![None, ga.transpose()?, gb.transpose()?]
        }
        Op::Reduce { op, dims, keepdim } => vec![Some(reduce(*op, x, output, g, dims, *keepdim)?)],
        Op::Softmax { dim } => vec![Some(softmax_backward(output, g, *dim, false)?)],
        Op::LogSoftmax { dim } => vec![Some(softmax_backward(output, g, *dim, true)?)],
        Op::MatMul => {
            let (ga, gb) = matmul(x, &inputs[1], g, [needs(0), needs(1)])?;
            vec![ga, gb]
        }
        Op::MatMulT {
            transpose_a,
            transpose_b,
        } => {
            // matmul(a', b') with a' = aᵀ or a: the matmul rule gives the
            // gradients of a' and b', transposed back where the op transposed.
            let swap = |t: &Tensor, yes: bool| if yes { t.try_t() } else { Ok(t.clone()) };
            let (a, b) = (swap(x, *transpose_a)?, swap(&inputs[1], *transpose_b)?);
            let (ga, gb) = matmul(&a, &b, g, [needs(0), needs(1)])?;
            vec![
                ga.map(|ga| swap(&ga, *transpose_a)).transpose()?,
                gb.map(|gb| swap(&gb, *transpose_b)).transpose()?,
            ]
        }
        Op::Reshape(_) => vec![Some(g.try_reshape(&signed(x.shape()))?)],
        Op::Permute(perm) => {
            let mut inverse = vec![0isize; perm.len()];
            for (i, &p) in perm.iter().enumerate() {
                inverse[p] = i as isize;
            }
            vec![Some(g.try_permute(&inverse)?)]
        }
        Op::Expand(_) => vec![Some(sum_to_shape(g, x.shape())?)],
        Op::Slice {
            dim, start, step, ..
        } => vec![Some(slice_backward(g, x.shape(), *dim, *start, *step)?)],
        Op::Cat { dim } => {
            let sizes: Vec<usize> = inputs.iter().map(|t| t.shape()[*dim]).collect();
            g.try_split_sizes(&sizes, *dim as isize)?
                .into_iter()
                .map(Some)
                .collect()
        }
        Op::Contiguous => vec![Some(g.clone())],
        Op::Tril { diagonal } => vec![Some(g.try_tril(*diagonal)?)],
        Op::Triu { diagonal } => vec![Some(g.try_triu(*diagonal)?)],
        Op::IndexSelect { dim } => {
            let zeros = Tensor::zeros(x.shape(), x.dtype());
            vec![
                Some(zeros.try_index_add(*dim as isize, &inputs[1], g)?),
                None,
            ]
        }
        Op::Gather { dim } => {
            let zeros = Tensor::zeros(x.shape(), x.dtype());
            vec![
                Some(zeros.try_scatter_add(*dim as isize, &inputs[1], g)?),
                None,
            ]
        }
        Op::IndexAdd { dim } => {
            // d/dbase = g; d/dsrc = the rows of g at the index.
            vec![
                Some(g.clone()),
                None,
                Some(g.try_index_select(*dim as isize, &inputs[1])?),
            ]
        }
        Op::ScatterAdd { dim } => vec![
            Some(g.clone()),
            None,
            Some(g.try_gather(*dim as isize, &inputs[1])?),
        ],
        Op::Input
        | Op::Constant(_)
        | Op::Full { .. }
        | Op::Arange { .. }
        | Op::Rand { .. }
        | Op::Randn { .. }
        | Op::Compare(_)
        | Op::ArgReduce { .. } => vec![None; inputs.len()],
        Op::Custom(_) | Op::CustomOutput { .. } => {
            return Err(crate::error::Error::op(
                crate::error::ErrorKind::Verify,
                op.name(),
                "custom ops are differentiated by their registered backward, not by a rule",
            ))
        }
    })
}

/// softmax's (`log`: log_softmax's) input gradient from its output `y` and
/// the output gradient `g`. Eagerly, along the last dim, one row kernel
/// over `y` and `g` where the backend runs it (no full-size temporaries:
/// the decomposed rule makes three); traced, the ops, which fusion makes
/// the same row kernel.
fn softmax_backward(y: &Tensor, g: &Tensor, dim: usize, log: bool) -> Result<Tensor> {
    if let Some(dx) = softmax_backward_rows(y, g, dim, log)? {
        return Ok(dx);
    }
    let d = dim as isize;
    Ok(match log {
        false => y * &(g - &(g * y).try_sum(&[d], true)?),
        true => g - &(y.exp() * g.try_sum(&[d], true)?),
    })
}

/// [`softmax_backward`] as one row kernel, when the values are at hand
/// (not traced), of one float dtype, `dim` is the last and the backend
/// takes the kernel; `None` otherwise. In bf16/f16 the kernel computes in
/// f32 and rounds once (as PyTorch's), where the decomposed rule would
/// round three full-size temporaries — and hold them: the seed's naive
/// attention at bf16 on the GPU kept 2 GB more than PyTorch for them.
fn softmax_backward_rows(y: &Tensor, g: &Tensor, dim: usize, log: bool) -> Result<Option<Tensor>> {
    use crate::ir::kernel::{RowKernel, MAX_ROW};
    use crate::ir::DType;
    use crate::runtime::device;
    let (Some(ya), Some(ga)) = (y.try_array(), g.try_array()) else {
        return Ok(None);
    };
    let shape = y.shape();
    let real = matches!(
        y.dtype(),
        DType::F32 | DType::F64 | DType::BF16 | DType::F16
    ) && g.dtype() == y.dtype();
    let len = shape.last().copied().unwrap_or(0);
    if crate::tensor::trace::is_active()
        || !real
        || dim + 1 != shape.len()
        || g.shape() != shape
        || !(1..=MAX_ROW).contains(&len)
    {
        return Ok(None);
    }
    let kernel = RowKernel::softmax_backward(shape[..dim].to_vec(), len, y.dtype(), log);
    let backend = device::backend(device::of_inputs("softmax_backward", &[ya, ga])?)?;
    if backend.row_kernel_refusal(&kernel).is_some() {
        return Ok(None);
    }
    let dx = backend.run_rows(&kernel, &[ya, ga])?.pop();
    Ok(dx.map(Tensor::from_array))
}

fn signed(shape: &[usize]) -> Vec<isize> {
    shape.iter().map(|&d| d as isize).collect()
}

/// Sums a broadcast gradient back down to `shape` (the inverse of NumPy
/// broadcasting: leading dims and stretched size-1 dims are summed).
pub fn sum_to_shape(g: &Tensor, shape: &[usize]) -> Result<Tensor> {
    if g.shape() == shape {
        return Ok(g.clone());
    }
    let lead = g.rank() - shape.len();
    let dims: Vec<isize> = (0..g.rank())
        .filter(|&i| i < lead || (shape[i - lead] == 1 && g.shape()[i] != 1))
        .map(|i| i as isize)
        .collect();
    let summed = if dims.is_empty() {
        g.clone()
    } else {
        g.try_sum(&dims, true)?
    };
    summed.try_reshape(&signed(shape))
}

/// 1 where `x > 0`, -1 where `x < 0`, 0 elsewhere.
fn sign(x: &Tensor) -> Result<Tensor> {
    x.try_gt(0.0)?
        .try_cast(x.dtype())?
        .try_sub(x.try_lt(0.0)?.try_cast(x.dtype())?)
}

fn unary(op: UnaryOp, x: &Tensor, y: &Tensor, g: &Tensor) -> Result<Tensor> {
    Ok(match op {
        UnaryOp::Neg => g.neg(),
        UnaryOp::Abs => g * &sign(x)?,
        UnaryOp::Exp => g * y,
        UnaryOp::Log => g / x,
        UnaryOp::Sqrt => g * &(y.reciprocal() * 0.5),
        UnaryOp::Rsqrt => g * &(y / x * -0.5),
        UnaryOp::Reciprocal => -(g * &(y * y)),
        UnaryOp::Sin => g * &x.cos(),
        UnaryOp::Cos => -(g * &x.sin()),
        UnaryOp::Tanh => g * &(1.0 - &(y * y)),
        UnaryOp::Sigmoid => g * &(y * &(1.0 - y)),
        UnaryOp::Relu => g * &x.try_gt(0.0)?.try_cast(x.dtype())?,
        UnaryOp::Gelu => g * &gelu_erf_derivative(x, y)?,
        UnaryOp::GeluTanh => g * &gelu_tanh_derivative(x)?,
        UnaryOp::Silu => {
            let s = x.sigmoid();
            g * &(&s * &(1.0 + &(x * &(1.0 - &s))))
        }
        UnaryOp::Atan => g / &(x * x + 1.0),
        // d asin = 1/√(1−x²), d acos = −1/√(1−x²).
        UnaryOp::Asin => g * &(1.0 - &(x * x)).rsqrt(),
        UnaryOp::Acos => -(g * &(1.0 - &(x * x)).rsqrt()),
        UnaryOp::BitNot => unreachable!("integer ops are handled by `vjp`"),
    })
}

/// d/dx x·Φ(x) = Φ(x) + x·φ(x). Φ(x) is recovered as gelu(x)/x (0.5 at 0),
/// so no separate erf op is needed.
fn gelu_erf_derivative(x: &Tensor, y: &Tensor) -> Result<Tensor> {
    let is_zero = x.try_eq(0.0)?;
    let safe_x = Tensor::try_where(&is_zero, &Tensor::ones(&[], x.dtype()), x)?;
    let cdf = Tensor::try_where(&is_zero, &Tensor::full(&[], 0.5, x.dtype()), &(y / &safe_x))?;
    let pdf = (x * x * -0.5).exp() * (1.0 / (2.0 * std::f64::consts::PI).sqrt());
    Ok(cdf + x * &pdf)
}

fn gelu_tanh_derivative(x: &Tensor) -> Result<Tensor> {
    let k = (2.0 / std::f64::consts::PI).sqrt();
    let x2 = x * x;
    let t = ((x + &(&x2 * x * 0.044715)) * k).tanh();
    let dt = (1.0 - &(&t * &t)) * &((&x2 * (3.0 * 0.044715) + 1.0) * k);
    Ok((&t + 1.0) * 0.5 + x * &dt * 0.5)
}

/// Gradients of a binary op before summing away broadcast dims, for the
/// operands that `needs` them.
fn binary(
    op: BinaryOp,
    a: &Tensor,
    b: &Tensor,
    y: &Tensor,
    g: &Tensor,
    needs: [bool; 2],
) -> Result<(Option<Tensor>, Option<Tensor>)> {
    let keep = |(ga, gb): (Tensor, Tensor)| (needs[0].then_some(ga), needs[1].then_some(gb));
    Ok(match op {
        BinaryOp::Add => keep((g.clone(), g.clone())),
        BinaryOp::Sub => (needs[0].then(|| g.clone()), needs[1].then(|| g.neg())),
        BinaryOp::Mul => (needs[0].then(|| g * b), needs[1].then(|| g * a)),
        BinaryOp::Div => (needs[0].then(|| g / b), needs[1].then(|| -(g * &(y / b)))),
        _ => keep(binary_both(op, a, b, y, g)?),
    })
}

/// Both gradients of the binary ops whose two gradients share their work.
fn binary_both(
    op: BinaryOp,
    a: &Tensor,
    b: &Tensor,
    y: &Tensor,
    g: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let float = |mask: Tensor| mask.try_cast(a.dtype());
    Ok(match op {
        BinaryOp::Pow => {
            // d/da a^b = b·a^(b-1), taken as 0 where b == 0 (a^0 is the
            // constant 1, even at a == 0 where the formula gives 0·inf; as
            // torch does).
            let slope = b * &a.try_pow(b - 1.0)?;
            let zero = Tensor::zeros(&[], a.dtype());
            let da = g * &Tensor::try_where(&b.try_eq(0.0)?, &zero, &slope)?;
            // d/db a^b = a^b·ln a, taken as 0 where a == 0 (as torch does).
            let log_a = Tensor::try_where(&a.try_eq(0.0)?, &zero, &a.log())?;
            (da, g * &(y * &log_a))
        }
        BinaryOp::Maximum | BinaryOp::Minimum => {
            // Ties split the gradient evenly, as torch does.
            let a_wins = if op == BinaryOp::Maximum {
                a.try_gt(b)?
            } else {
                a.try_lt(b)?
            };
            let tie = float(a.try_eq(b)?)? * 0.5;
            let wa = float(a_wins)? + &tie;
            let wb = 1.0 - &wa;
            (g * &wa, g * &wb)
        }
        BinaryOp::Add
        | BinaryOp::Sub
        | BinaryOp::Mul
        | BinaryOp::Div
        | BinaryOp::BitAnd
        | BinaryOp::BitOr
        | BinaryOp::BitXor
        | BinaryOp::Shl
        | BinaryOp::Shr => {
            unreachable!("`binary` handles these; integer ops are handled by `vjp`")
        }
    })
}

fn reduce(
    op: ReduceOp,
    x: &Tensor,
    y: &Tensor,
    g: &Tensor,
    dims: &[usize],
    keepdim: bool,
) -> Result<Tensor> {
    // Put the reduced dims back as size 1 so g and y broadcast against x.
    let kept = |t: &Tensor| -> Result<Tensor> {
        if keepdim {
            return Ok(t.clone());
        }
        let mut shape = signed(x.shape());
        for &d in dims {
            shape[d] = 1;
        }
        t.try_reshape(&shape)
    };
    let (g, y) = (kept(g)?, kept(y)?);
    let count: usize = dims.iter().map(|&d| x.shape()[d]).product();
    let sdims: Vec<isize> = dims.iter().map(|&d| d as isize).collect();
    Ok(match op {
        ReduceOp::Sum => g.try_expand(&signed(x.shape()))?.contiguous(),
        ReduceOp::Mean => (g / count as f64)
            .try_expand(&signed(x.shape()))?
            .contiguous(),
        ReduceOp::Max | ReduceOp::Min => {
            // The gradient goes to the extremal elements, split among ties.
            let hits = x.try_eq(&y)?.try_cast(x.dtype())?;
            let ties = hits.try_sum(&sdims, true)?;
            &hits * &(g / &ties)
        }
        ReduceOp::Prod => {
            // prod of the others = y/x, except at zeros: with exactly one zero
            // in the slice, its gradient is the product of the rest.
            let zero = x.try_eq(0.0)?;
            let ones = Tensor::ones(&[], x.dtype());
            let nonzero_x = Tensor::try_where(&zero, &ones, x)?;
            let prod_rest = nonzero_x.try_prod(&sdims, true)?;
            let zeros_in_slice = zero.try_cast(x.dtype())?.try_sum(&sdims, true)?;
            let at_zero = Tensor::try_where(
                &zeros_in_slice.try_eq(1.0)?,
                &prod_rest,
                &Tensor::zeros(&[], x.dtype()),
            )?;
            let others = Tensor::try_where(&zero, &at_zero, &(&y / &nonzero_x))?;
            g * &others
        }
    })
}

/// `torch.matmul` gradients of the operands that `needs` them, with 1-D
/// operands promoted as the forward does and broadcast batch dims summed
/// away.
fn matmul(
    a: &Tensor,
    b: &Tensor,
    g: &Tensor,
    needs: [bool; 2],
) -> Result<(Option<Tensor>, Option<Tensor>)> {
    let a2 = if a.rank() == 1 {
        a.try_unsqueeze(0)?
    } else {
        a.clone()
    };
    let b2 = if b.rank() == 1 {
        b.try_unsqueeze(-1)?
    } else {
        b.clone()
    };
    let mut g2 = g.clone();
    if a.rank() == 1 {
        g2 = g2.try_unsqueeze(if b.rank() == 1 { 0 } else { -2 })?;
    }
    if b.rank() == 1 {
        g2 = g2.try_unsqueeze(-1)?;
    }
    let ga = needs[0].then(|| -> Result<Tensor> {
        let ga = g2.try_matmul(&b2.try_t()?)?;
        sum_to_shape(&ga, a2.shape())?.try_reshape(&signed(a.shape()))
    });
    let gb = needs[1].then(|| -> Result<Tensor> {
        let gb = a2.try_t()?.try_matmul(&g2)?;
        sum_to_shape(&gb, b2.shape())?.try_reshape(&signed(b.shape()))
    });
    Ok((ga.transpose()?, gb.transpose()?))
}

/// The gradient of a slice: `g` placed at `start, start+step, …` of a zero
/// tensor of the input's shape, built from cat/reshape (no scatter needed).
pub(crate) fn slice_backward(
    g: &Tensor,
    shape: &[usize],
    dim: usize,
    start: usize,
    step: usize,
) -> Result<Tensor> {
    let zeros = |len: usize| {
        let mut s = shape.to_vec();
        s[dim] = len;
        Tensor::zeros(&s, g.dtype())
    };
    let n = g.shape()[dim];
    let d = dim as isize;
    // Interleave step-1 zero rows after each gradient row, then trim.
    let spread = if step > 1 && n > 0 {
        let mut gap_shape = g.shape().to_vec();
        gap_shape.insert(dim + 1, step - 1);
        let gap = Tensor::zeros(&gap_shape, g.dtype());
        let woven = Tensor::try_cat(&[&g.try_unsqueeze(d + 1)?, &gap], d + 1)?;
        let flat = woven.try_flatten(d, d + 1)?;
        flat.try_narrow(d, 0, (n - 1) * step + 1)?
    } else {
        g.clone()
    };
    let used = spread.shape()[dim];
    let after = shape[dim] - start - used;
    Tensor::try_cat(&[&zeros(start), &spread, &zeros(after)], d)
}

#[cfg(test)]
mod tests {
    use std::panic::Location;

    use crate::ir::{ArgReduceOp, BinaryOp, CompareOp, DType, Op, ReduceOp, UnaryOp};
    use crate::tensor::{Generator, Tensor};

    /// The eager row kernel of softmax's and log_softmax's gradient gives
    /// the decomposed rule's values (the traced form, which fusion turns
    /// into the same kernel), in f32 and f64, over rows of several
    /// lengths, also for a strided output gradient; a dim that is not the
    /// last takes the decomposed rule.
    #[test]
    fn the_softmax_gradient_row_kernel_gives_the_decomposed_rules_values() {
        let mut gen = Generator::new(7);
        for (dtype, tol) in [(DType::F32, 1e-6), (DType::F64, 1e-13)] {
            for shape in [vec![3usize, 5, 40], vec![2, 1], vec![4, 300]] {
                let last = shape.len() - 1;
                let x = Tensor::randn(&shape, dtype, &mut gen);
                let g = Tensor::randn(&shape, dtype, &mut gen);
                // A transposed view made contiguous twice: strided, same values.
                let g_strided = g.transpose(0, 1).contiguous().transpose(0, 1);
                for log in [false, true] {
                    let y = if log {
                        x.log_softmax(-1)
                    } else {
                        x.softmax(-1)
                    };
                    let d = last as isize;
                    let want = match log {
                        false => &y * &(&g - &(&g * &y).sum(&[d], true)),
                        true => &g - &(y.exp() * g.sum(&[d], true)),
                    };
                    for g in [&g, &g_strided] {
                        let got = super::softmax_backward_rows(&y, g, last, log)
                            .unwrap()
                            .expect("the CPU runs the row kernel");
                        assert_eq!((got.shape(), got.dtype()), (want.shape(), dtype));
                        for (a, b) in got.to_f64_vec().iter().zip(want.to_f64_vec()) {
                            assert!((a - b).abs() <= tol * (1.0 + b.abs()), "{a} vs {b}");
                        }
                    }
                }
                if last > 0 {
                    let y = x.softmax(0);
                    assert!(super::softmax_backward_rows(&y, &g, 0, false)
                        .unwrap()
                        .is_none());
                }
            }
        }
    }

    /// In bf16 and f16 the row kernel computes in f32 and rounds once: its
    /// values are the f64 rule's on the same (rounded) inputs to the
    /// dtype's rounding.
    #[test]
    fn the_softmax_gradient_row_kernel_runs_half_precision_in_f32() {
        let mut gen = Generator::new(9);
        for (dtype, tol) in [(DType::BF16, 8e-3), (DType::F16, 1e-3)] {
            for shape in [vec![3usize, 5, 40], vec![4, 300]] {
                let last = shape.len() - 1;
                let x = Tensor::randn(&shape, DType::F32, &mut gen).cast(dtype);
                let g = Tensor::randn(&shape, DType::F32, &mut gen).cast(dtype);
                for log in [false, true] {
                    let y = if log {
                        x.log_softmax(-1)
                    } else {
                        x.softmax(-1)
                    };
                    let (y64, g64) = (y.cast(DType::F64), g.cast(DType::F64));
                    let d = last as isize;
                    let want = match log {
                        false => &y64 * &(&g64 - &(&g64 * &y64).sum(&[d], true)),
                        true => &g64 - &(y64.exp() * g64.sum(&[d], true)),
                    };
                    let got = super::softmax_backward_rows(&y, &g, last, log)
                        .unwrap()
                        .expect("the CPU runs the row kernel");
                    assert_eq!(got.dtype(), dtype);
                    for (a, b) in got.to_f64_vec().iter().zip(want.to_f64_vec()) {
                        assert!(
                            (a - b).abs() <= tol * (1.0 + b.abs()),
                            "{dtype} log={log}: {a} vs {b}"
                        );
                    }
                }
            }
        }
    }

    /// The tape records an op only when the IR's table says it has a
    /// gradient (`Op::has_gradient`); the rules agree: an op without one
    /// gives no input gradient, one with one does.
    #[test]
    fn the_irs_gradient_table_agrees_with_the_rules() {
        let x = Tensor::from_vec(vec![1.0f32, -2.0, 3.0], &[3]).set_requires_grad(true);
        let y = Tensor::from_vec(vec![0.5f32, 0.5, 0.5], &[3]).set_requires_grad(true);
        let cases: [(Op, Vec<&Tensor>); 3] = [
            (Op::Compare(CompareOp::Gt), vec![&x, &y]),
            (
                Op::ArgReduce {
                    op: ArgReduceOp::ArgMax,
                    dim: 0,
                    keepdim: false,
                },
                vec![&x],
            ),
            (Op::Unary(UnaryOp::Exp), vec![&x]),
        ];
        for (op, inputs) in cases {
            let out = Tensor::apply(&op, &inputs, Location::caller()).unwrap();
            let owned: Vec<Tensor> = inputs.iter().map(|&t| t.clone()).collect();
            let g = Tensor::ones(out.shape(), DType::F32);
            let grads = super::vjp(&op, &owned, &out, &g).unwrap();
            assert_eq!(grads.len(), inputs.len(), "{}", op.name());
            let any = grads.iter().any(Option::is_some);
            assert_eq!(any, op.has_gradient(), "{}", op.name());
        }
    }

    /// The ops with a rule, each with inputs in every rule's domain (`x`
    /// in (0.1, 0.9): log, sqrt, asin and acos are finite there).
    fn every_rule() -> Vec<(Op, Vec<Tensor>)> {
        let mut gen = Generator::new(11);
        let mut unit = |shape: &[usize]| Tensor::rand(shape, DType::F64, &mut gen) * 0.8 + 0.1;
        let (a, b, m, n) = (unit(&[3, 4]), unit(&[3, 4]), unit(&[4, 5]), unit(&[4]));
        let cond = a.gt(&b);
        let index = Tensor::from_vec(vec![2i64, 0, 2], &[3]);
        let gather_index = Tensor::from_vec(vec![1i64, 0, 3, 3, 2, 1, 0, 0, 1, 2, 3, 0], &[3, 4]);
        let src = unit(&[3, 4]);
        let mut cases: Vec<(Op, Vec<Tensor>)> = UnaryOp::ALL
            .into_iter()
            .filter(|&u| u != UnaryOp::BitNot)
            .map(|u| (Op::Unary(u), vec![a.clone()]))
            .collect();
        for op in BinaryOp::ALL.into_iter().filter(|b| !b.is_bitwise()) {
            cases.push((Op::Binary(op), vec![a.clone(), b.clone()]));
            // A broadcast operand.
            cases.push((Op::Binary(op), vec![a.clone(), n.clone()]));
        }
        for op in ReduceOp::ALL {
            let reduce = Op::Reduce {
                op,
                dims: vec![1],
                keepdim: false,
            };
            cases.push((reduce, vec![a.clone()]));
        }
        let t = |transpose_a, transpose_b| Op::MatMulT {
            transpose_a,
            transpose_b,
        };
        cases.extend([
            (Op::Softmax { dim: 1 }, vec![a.clone()]),
            (Op::LogSoftmax { dim: 1 }, vec![a.clone()]),
            (Op::MatMul, vec![a.clone(), m.clone()]),
            (Op::MatMul, vec![a.clone(), n.clone()]),
            (t(true, false), vec![a.clone(), b.clone()]),
            (t(false, true), vec![a.clone(), b.clone()]),
            (Op::Where, vec![cond, a.clone(), n.clone()]),
            (Op::IndexSelect { dim: 1 }, vec![a.clone(), index.clone()]),
            (Op::Gather { dim: 1 }, vec![a.clone(), gather_index.clone()]),
            (
                Op::IndexAdd { dim: 1 },
                vec![a.clone(), index.clone(), src.narrow(1, 0, 3)],
            ),
            (
                Op::ScatterAdd { dim: 1 },
                vec![a.clone(), gather_index, src],
            ),
        ]);
        cases
    }

    /// The eager tape keeps only the values `Op::backward_reads` names (the
    /// others as NaN stand-ins): for every op with a rule and every choice
    /// of which float inputs require grad, the gradients through the tape
    /// are those of the rule run on all the values.
    #[test]
    fn the_tape_keeps_every_value_a_rule_reads() {
        for (op, values) in every_rule() {
            let floats: Vec<usize> = (0..values.len())
                .filter(|&i| values[i].dtype().is_float())
                .collect();
            for mask in 1u32..(1 << floats.len()) {
                let wants = |i: usize| {
                    floats
                        .iter()
                        .position(|&f| f == i)
                        .is_some_and(|p| mask >> p & 1 == 1)
                };
                let inputs: Vec<Tensor> = (0..values.len())
                    .map(|i| values[i].set_requires_grad(wants(i)))
                    .collect();
                let refs: Vec<&Tensor> = inputs.iter().collect();
                let out = Tensor::apply(&op, &refs, Location::caller()).unwrap();
                let g = Tensor::ones(out.shape(), out.dtype());
                let full = super::vjp(&op, &inputs, &out.detach(), &g).unwrap();
                out.backward_with(&g);
                for (i, input) in inputs.iter().enumerate() {
                    let what = format!("{} input {i}, requiring {mask:b}", op.name());
                    let through_tape = input.grad().map(|t| t.to_f64_vec());
                    let expected = full[i]
                        .as_ref()
                        .filter(|_| wants(i))
                        .map(|t| t.to_f64_vec());
                    assert_eq!(through_tape.is_some(), expected.is_some(), "{what}");
                    if let (Some(got), Some(want)) = (through_tape, expected) {
                        assert!(got.iter().all(|v| v.is_finite()), "{what}: {got:?}");
                        assert_eq!(got, want, "{what}");
                    }
                }
            }
        }
    }

    /// `matmul_t`'s gradients are those of the matmul of explicit transposes.
    #[test]
    fn matmul_t_gradients_match_matmul_of_permutes() {
        let mut gen = Generator::new(3);
        let a = Tensor::randn(&[2, 4, 3], DType::F64, &mut gen);
        let b = Tensor::randn(&[5, 4], DType::F64, &mut gen);
        let grads = |fused: bool| {
            let (a, b) = (a.set_requires_grad(true), b.set_requires_grad(true));
            let y = if fused {
                let op = Op::MatMulT {
                    transpose_a: true,
                    transpose_b: true,
                };
                Tensor::apply(&op, &[&a, &b], Location::caller()).unwrap()
            } else {
                a.t().matmul(&b.t())
            };
            (y.sin()).sum(&[], false).backward();
            (
                a.grad().unwrap().to_f64_vec(),
                b.grad().unwrap().to_f64_vec(),
            )
        };
        let (fused, plain) = (grads(true), grads(false));
        assert_eq!(fused.0.len(), 24);
        assert_eq!(fused.1.len(), 20);
        for (f, p) in fused
            .0
            .iter()
            .chain(&fused.1)
            .zip(plain.0.iter().chain(&plain.1))
        {
            assert!((f - p).abs() < 1e-12, "{f} vs {p}");
        }
    }
}
