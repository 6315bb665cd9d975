//! One vector-Jacobian product rule per op, written with `Tensor` ops so
//! that the same rule runs eagerly and, on traced tensors, builds the
//! backward graph.

use crate::error::Result;
use crate::ir::{BinaryOp, Op, ReduceOp, UnaryOp};
use crate::tensor::Tensor;

/// The gradients of `op`'s inputs given the gradient `g` of its `output`;
/// `None` for inputs that carry no gradient (indices, conditions, ints).
pub fn vjp(op: &Op, inputs: &[Tensor], output: &Tensor, g: &Tensor) -> Result<Vec<Option<Tensor>>> {
    let x = &inputs[0];
    Ok(match op {
        // Bitwise ops take integers only, which carry no gradient.
        Op::Unary(UnaryOp::BitNot) => vec![None],
        Op::Binary(b) if b.is_bitwise() => vec![None, None],
        Op::Unary(u) => vec![Some(unary(*u, x, output, g)?)],
        Op::Cast(_) => vec![x.dtype().is_float().then(|| g.cast(x.dtype()))],
        Op::BitCast(_) => vec![None],
        Op::Binary(b) => {
            let (ga, gb) = binary(*b, x, &inputs[1], output, g)?;
            vec![
                Some(sum_to_shape(&ga, x.shape())?),
                Some(sum_to_shape(&gb, inputs[1].shape())?),
            ]
        }
        Op::Where => {
            let (c, a, b) = (x, &inputs[1], &inputs[2]);
            let zero = Tensor::zeros(&[], g.dtype());
            vec![
                None,
                Some(sum_to_shape(&Tensor::try_where(c, g, &zero)?, a.shape())?),
                Some(sum_to_shape(&Tensor::try_where(c, &zero, g)?, b.shape())?),
            ]
        }
        Op::Reduce { op, dims, keepdim } => vec![Some(reduce(*op, x, output, g, dims, *keepdim)?)],
        Op::Softmax { dim } => {
            let d = *dim as isize;
            vec![Some(output * &(g - &(g * output).try_sum(&[d], true)?))]
        }
        Op::LogSoftmax { dim } => {
            let d = *dim as isize;
            vec![Some(g - &(output.exp() * g.try_sum(&[d], true)?))]
        }
        Op::MatMul => {
            let (ga, gb) = matmul(x, &inputs[1], g)?;
            vec![Some(ga), Some(gb)]
        }
        Op::MatMulT {
            transpose_a,
            transpose_b,
        } => {
            // matmul(a', b') with a' = aᵀ or a: the matmul rule gives the
            // gradients of a' and b', transposed back where the op transposed.
            let swap = |t: &Tensor, yes: bool| if yes { t.try_t() } else { Ok(t.clone()) };
            let (a, b) = (swap(x, *transpose_a)?, swap(&inputs[1], *transpose_b)?);
            let (ga, gb) = matmul(&a, &b, g)?;
            vec![
                Some(swap(&ga, *transpose_a)?),
                Some(swap(&gb, *transpose_b)?),
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

/// Gradients of a binary op before summing away broadcast dims.
fn binary(
    op: BinaryOp,
    a: &Tensor,
    b: &Tensor,
    y: &Tensor,
    g: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let float = |mask: Tensor| mask.try_cast(a.dtype());
    Ok(match op {
        BinaryOp::Add => (g.clone(), g.clone()),
        BinaryOp::Sub => (g.clone(), g.neg()),
        BinaryOp::Mul => (g * b, g * a),
        BinaryOp::Div => (g / b, -(g * &(y / b))),
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
        BinaryOp::BitAnd | BinaryOp::BitOr | BinaryOp::BitXor | BinaryOp::Shl | BinaryOp::Shr => {
            unreachable!("integer ops are handled by `vjp`")
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

/// `torch.matmul` gradients, with 1-D operands promoted as the forward does
/// and broadcast batch dims summed away.
fn matmul(a: &Tensor, b: &Tensor, g: &Tensor) -> Result<(Tensor, Tensor)> {
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
    let ga = g2.try_matmul(&b2.try_t()?)?;
    let gb = a2.try_t()?.try_matmul(&g2)?;
    let ga = sum_to_shape(&ga, a2.shape())?.try_reshape(&signed(a.shape()))?;
    let gb = sum_to_shape(&gb, b2.shape())?.try_reshape(&signed(b.shape()))?;
    Ok((ga, gb))
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

    use crate::ir::{ArgReduceOp, CompareOp, DType, Op, UnaryOp};
    use crate::tensor::{Generator, Tensor};

    /// The tape records an op only when the IR's table says it has a
    /// gradient (`Op::has_gradient`); the rules agree: an op without one
    /// gives no input gradient, one with one does.
    #[test]
    fn the_irs_gradient_table_agrees_with_the_rules() {
        let x = Tensor::from_vec(vec![1.0f32, -2.0, 3.0], &[3]);
        let y = Tensor::from_vec(vec![0.5f32, 0.5, 0.5], &[3]);
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

    /// `Op::gradient_reads` (what the eager tape keeps of an offloaded
    /// op) agrees with the rules: each rule gives the same gradients, bit
    /// for bit, with the values the table says it does not read poisoned
    /// (NaN: a rule that read one would show it).
    #[test]
    fn the_rules_read_only_what_the_irs_table_says() {
        use crate::ir::{BinaryOp, ReduceOp, Shape};
        let mut gen = Generator::new(5);
        // In (0.1, 0.9): inside every unary op's domain, no ties.
        let pos =
            |shape: &[usize], g: &mut Generator| &(&Tensor::rand(shape, DType::F64, g) * 0.8) + 0.1;
        let (x, y) = (pos(&[3, 4], &mut gen), pos(&[3, 4], &mut gen));
        let m = pos(&[4, 2], &mut gen);
        let cond = x.try_gt(0.5).unwrap();
        let rows = Tensor::from_vec(vec![2i64, 0], &[2]);
        let at = Tensor::from_vec(vec![0i64, 2, 1, 0, 1, 2, 0, 1, 2, 0, 0, 1], &[3, 4]);
        let src = pos(&[2, 4], &mut gen);
        let shape = |s: &[usize]| Shape::from(s);
        let mut cases: Vec<(Op, Vec<&Tensor>)> = UnaryOp::ALL
            .iter()
            .filter(|&&u| u != UnaryOp::BitNot)
            .map(|&u| (Op::Unary(u), vec![&x]))
            .collect();
        for b in [
            BinaryOp::Add,
            BinaryOp::Sub,
            BinaryOp::Mul,
            BinaryOp::Div,
            BinaryOp::Pow,
            BinaryOp::Maximum,
            BinaryOp::Minimum,
        ] {
            cases.push((Op::Binary(b), vec![&x, &y]));
        }
        for r in [
            ReduceOp::Sum,
            ReduceOp::Mean,
            ReduceOp::Max,
            ReduceOp::Min,
            ReduceOp::Prod,
        ] {
            let dims = vec![1];
            cases.push((
                Op::Reduce {
                    op: r,
                    dims,
                    keepdim: false,
                },
                vec![&x],
            ));
        }
        cases.extend([
            (Op::Where, vec![&cond, &x, &y]),
            (Op::Softmax { dim: 1 }, vec![&x]),
            (Op::LogSoftmax { dim: 1 }, vec![&x]),
            (Op::MatMul, vec![&x, &m]),
            (
                Op::MatMulT {
                    transpose_a: false,
                    transpose_b: true,
                },
                vec![&x, &y],
            ),
            (Op::Reshape(shape(&[4, 3])), vec![&x]),
            (Op::Permute(vec![1, 0]), vec![&x]),
            (Op::Expand(shape(&[2, 3, 4])), vec![&x]),
            (
                Op::Slice {
                    dim: 1,
                    start: 1,
                    end: 4usize.into(),
                    step: 2,
                },
                vec![&x],
            ),
            (Op::Cat { dim: 0 }, vec![&x, &y]),
            (Op::Contiguous, vec![&x]),
            (Op::Tril { diagonal: 0 }, vec![&x]),
            (Op::Triu { diagonal: 1 }, vec![&x]),
            (Op::Cast(DType::F32), vec![&x]),
            (Op::IndexSelect { dim: 0 }, vec![&x, &rows]),
            (Op::Gather { dim: 0 }, vec![&x, &at]),
            (Op::IndexAdd { dim: 0 }, vec![&x, &rows, &src]),
            (Op::ScatterAdd { dim: 0 }, vec![&x, &at, &y]),
        ]);
        let poison = |t: &Tensor| match t.dtype().is_float() {
            true => Tensor::full(t.shape(), f64::NAN, t.dtype()),
            false => Tensor::zeros(t.shape(), t.dtype()),
        };
        let bits = |grads: Vec<Option<Tensor>>| -> Vec<Option<Vec<u64>>> {
            grads
                .into_iter()
                .map(|g| g.map(|g| g.to_f64_vec().iter().map(|v| v.to_bits()).collect()))
                .collect()
        };
        for (op, inputs) in cases {
            let out = Tensor::apply(&op, &inputs, Location::caller()).unwrap();
            let g = pos(out.shape(), &mut gen).cast(out.dtype());
            let owned: Vec<Tensor> = inputs.iter().map(|&t| t.clone()).collect();
            let want = bits(super::vjp(&op, &owned, &out, &g).unwrap());
            let kept: Vec<Tensor> = owned
                .iter()
                .enumerate()
                .map(|(i, t)| match op.gradient_reads(Some(i)) {
                    true => t.clone(),
                    false => poison(t),
                })
                .collect();
            let out_kept = match op.gradient_reads(None) {
                true => out.clone(),
                false => poison(&out),
            };
            let got = bits(super::vjp(&op, &kept, &out_kept, &g).unwrap());
            assert_eq!(got, want, "{}", op.name());
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
