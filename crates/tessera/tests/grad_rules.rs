//! Every VJP rule (autograd/rules.rs) against central finite differences.
//!
//! For a case `f(x1, …, xn) -> y` and a random cotangent `c` of `y`'s shape,
//! `y.backward_with(c)` must give `∂/∂xi sum(f(x) * c)` for every input,
//! which [`check`] estimates element by element as
//! `(S(x + ε·e_j) − S(x − ε·e_j)) / 2ε` with `S = sum(f(x) * c)`, all in f64.
//!
//! Each case runs three times: with contiguous inputs (and cotangent), with
//! inputs stored in reversed dim order and viewed back through `permute`,
//! and with inputs that are a step-2 slice at offset 1 of a buffer whose
//! other elements are NaN (a kernel or rule that reads outside the view
//! turns the result into NaN).
//!
//! Inputs avoid the kinks of the functions they feed (abs/relu away from 0,
//! max/min on distinct values); ties and the other non-smooth points have
//! their own tests with exact expected values.

use std::panic::{catch_unwind, AssertUnwindSafe};

use tessera::autograd::{grad, is_grad_enabled, no_grad};
use tessera::tensor::Generator;
use tessera::{DType, Tensor};

/// Finite-difference step. Central differences have an error of O(ε²·f''')
/// from truncation plus O(u·|S|/ε) ≈ 1e-10·|S| from rounding (u = 2.2e-16).
const EPS: f64 = 1e-6;
/// `|analytic − fd| ≤ TOL · (1 + |fd|)`: 1e-6 absolute + relative, far above
/// both error terms for the small, O(1)-valued cases below, far below any
/// real rule error (which shows up at O(1)).
const TOL: f64 = 1e-6;

// ---------------------------------------------------------------------------
// The checker.

/// An input of a case: its shape and its values, row-major.
#[derive(Clone, Debug)]
struct Arg {
    shape: Vec<usize>,
    values: Vec<f64>,
}

/// How the checker stores an input (see the module comment).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Storage {
    Contiguous,
    Transposed,
    Strided,
}

const STORAGES: [Storage; 3] = [Storage::Contiguous, Storage::Transposed, Storage::Strided];

/// A tensor holding `values` with `shape`, stored as `storage` says.
fn make(values: &[f64], shape: &[usize], storage: Storage) -> Tensor {
    let t = Tensor::from_slice(values, shape);
    let rank = shape.len() as isize;
    let out = match storage {
        _ if shape.is_empty() || t.numel() < 2 => t,
        Storage::Transposed if rank >= 2 => {
            let rev: Vec<isize> = (0..rank).rev().collect();
            t.permute(&rev).contiguous().permute(&rev)
        }
        // A rank-1 tensor has no other dim order: use the strided view.
        Storage::Transposed | Storage::Strided => {
            let junk = Tensor::full(shape, f64::NAN, DType::F64);
            let n = shape[shape.len() - 1] as isize;
            Tensor::stack(&[&junk, &t], -1)
                .flatten(-2, -1)
                .slice(-1, 1, 2 * n, 2)
        }
        Storage::Contiguous => t,
    };
    assert_eq!(out.shape(), shape);
    let big_dims = shape.iter().filter(|&&d| d > 1).count();
    let strided = match storage {
        Storage::Contiguous => false,
        Storage::Transposed if rank >= 2 => big_dims >= 2,
        // Every element of the slice is two apart in the buffer.
        _ => out.numel() >= 2,
    };
    assert_eq!(out.is_contiguous(), !strided, "{storage:?} {shape:?}");
    out
}

/// Sources of test values; one seeded generator per test.
struct Rng(Generator);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(Generator::new(seed))
    }

    fn normal(&mut self, n: usize) -> Vec<f64> {
        Tensor::randn(&[n], DType::F64, &mut self.0).to_f64_vec()
    }

    fn unit(&mut self, n: usize) -> Vec<f64> {
        Tensor::rand(&[n], DType::F64, &mut self.0).to_f64_vec()
    }

    /// Standard normal values.
    fn randn(&mut self, shape: &[usize]) -> Arg {
        let values = self.normal(shape.iter().product());
        Arg::new(shape, values)
    }

    /// Uniform in [lo, hi).
    fn uniform(&mut self, shape: &[usize], lo: f64, hi: f64) -> Arg {
        let values = self.unit(shape.iter().product());
        Arg::new(shape, values.iter().map(|u| lo + (hi - lo) * u).collect())
    }

    /// Magnitudes uniform in [lo, hi), random signs: away from 0.
    fn signed(&mut self, shape: &[usize], lo: f64, hi: f64) -> Arg {
        let n = shape.iter().product();
        let (m, s) = (self.unit(n), self.unit(n));
        let values = m
            .iter()
            .zip(&s)
            .map(|(m, s)| (lo + (hi - lo) * m) * if *s < 0.5 { -1.0 } else { 1.0 })
            .collect();
        Arg::new(shape, values)
    }

    /// Distinct values `offset + 0.05·k` for k = 0..n in a random order:
    /// any two differ by ≥ 0.05 ≫ EPS (no ties, no kinks for max/min).
    fn distinct(&mut self, shape: &[usize], offset: f64) -> Arg {
        let n: usize = shape.iter().product();
        let keys = self.normal(n);
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by(|&a, &b| keys[a].total_cmp(&keys[b]));
        let mut values = vec![0.0; n];
        for (k, &i) in order.iter().enumerate() {
            values[i] = offset + 0.05 * (k as f64 - n as f64 / 2.0);
        }
        Arg::new(shape, values)
    }
}

impl Arg {
    fn new(shape: &[usize], values: Vec<f64>) -> Arg {
        assert_eq!(values.len(), shape.iter().product::<usize>());
        Arg {
            shape: shape.to_vec(),
            values,
        }
    }

    /// The same shape with some values replaced: `(flat index, value)`.
    fn with(mut self, at: &[(usize, f64)]) -> Arg {
        for &(i, v) in at {
            self.values[i] = v;
        }
        self
    }
}

type Fun = Box<dyn Fn(&[Tensor]) -> Tensor>;

/// A named function of float inputs, checked at `args`.
struct Case {
    name: String,
    args: Vec<Arg>,
    f: Fun,
}

fn case(
    name: impl Into<String>,
    args: Vec<Arg>,
    f: impl Fn(&[Tensor]) -> Tensor + 'static,
) -> Case {
    Case {
        name: name.into(),
        args,
        f: Box::new(f),
    }
}

/// `sum(f(inputs) * cot)` without recording anything.
fn weighted_sum(f: &Fun, inputs: &[Tensor], cot: &Tensor) -> f64 {
    no_grad(|| (f(inputs) * cot).sum(&[], false).item())
}

/// The mismatches of one case in one storage, as readable lines.
fn check(case: &Case, storage: Storage, rng: &mut Rng) -> Vec<String> {
    let leaves: Vec<Tensor> = case
        .args
        .iter()
        .map(|a| make(&a.values, &a.shape, storage).set_requires_grad(true))
        .collect();
    let y = (case.f)(&leaves);
    assert_eq!(
        y.dtype(),
        DType::F64,
        "{}: the output must be f64",
        case.name
    );
    assert!(
        y.requires_grad(),
        "{}: the output does not require grad",
        case.name
    );
    let cot = rng.randn(y.shape());
    let cot = make(&cot.values, &cot.shape, storage);
    y.backward_with(&cot);

    let mut errors = Vec::new();
    for (i, (arg, leaf)) in case.args.iter().zip(&leaves).enumerate() {
        let Some(g) = leaf.grad() else {
            errors.push(format!("input {i}: no gradient"));
            continue;
        };
        if g.shape() != arg.shape.as_slice() || g.dtype() != DType::F64 {
            errors.push(format!(
                "input {i}: gradient {:?} for an input {:?}",
                g.ty(),
                leaf.ty()
            ));
            continue;
        }
        let analytic = g.to_f64_vec();
        for j in 0..arg.values.len() {
            let at = |delta: f64| {
                let inputs: Vec<Tensor> = case
                    .args
                    .iter()
                    .enumerate()
                    .map(|(k, a)| {
                        let mut v = a.values.clone();
                        if k == i {
                            v[j] += delta;
                        }
                        make(&v, &a.shape, storage)
                    })
                    .collect();
                weighted_sum(&case.f, &inputs, &cot)
            };
            let fd = (at(EPS) - at(-EPS)) / (2.0 * EPS);
            let an = analytic[j];
            // Written so that a NaN on either side fails.
            let close = (an - fd).abs() <= TOL * (1.0 + fd.abs());
            if !close {
                errors.push(format!(
                    "input {i}[{j}]: backward {an:.9}, finite differences {fd:.9}"
                ));
            }
        }
    }
    errors
}

/// Checks every case in every storage; fails listing all mismatches.
fn run(cases: Vec<Case>, seed: u64) {
    let mut rng = Rng::new(seed);
    let mut failures = Vec::new();
    for case in &cases {
        for storage in STORAGES {
            let errors = check(case, storage, &mut rng);
            if !errors.is_empty() {
                let shown: Vec<&str> = errors.iter().take(6).map(String::as_str).collect();
                failures.push(format!(
                    "{} ({storage:?}): {} mismatches\n    {}",
                    case.name,
                    errors.len(),
                    shown.join("\n    ")
                ));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} failing cases:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

fn ids(values: &[i64]) -> Tensor {
    Tensor::from_slice(values, &[values.len()])
}

fn ids2(values: &[i64], shape: &[usize]) -> Tensor {
    Tensor::from_slice(values, shape)
}

fn assert_close(got: &Tensor, want: &[f64], what: &str) {
    let got = got.to_f64_vec();
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= 1e-12, "{what}[{i}]: {g} vs {w}");
    }
}

// ---------------------------------------------------------------------------
// The cases.

const S: [usize; 3] = [3, 5, 7];

#[test]
fn unary_ops() {
    let mut r = Rng::new(1);
    let smooth = |r: &mut Rng| r.randn(&S);
    let cases = vec![
        case("neg", vec![smooth(&mut r)], |x| x[0].neg()),
        case("-x (operator)", vec![smooth(&mut r)], |x| -&x[0]),
        case("exp", vec![smooth(&mut r)], |x| x[0].exp()),
        case("sin", vec![smooth(&mut r)], |x| x[0].sin()),
        case("cos", vec![smooth(&mut r)], |x| x[0].cos()),
        case("tanh", vec![smooth(&mut r)], |x| x[0].tanh()),
        case("sigmoid", vec![smooth(&mut r)], |x| x[0].sigmoid()),
        case("silu", vec![smooth(&mut r)], |x| x[0].silu()),
        // Exact zeros: the rule's Φ(x) = gelu(x)/x has a special case there.
        case(
            "gelu",
            vec![smooth(&mut r).with(&[(0, 0.0), (17, 0.0), (50, -4.0), (51, -9.0), (104, 8.0)])],
            |x| x[0].gelu(),
        ),
        case(
            "gelu_tanh",
            vec![smooth(&mut r).with(&[(3, 0.0), (50, 3.5)])],
            |x| x[0].gelu_tanh(),
        ),
        case("abs", vec![r.signed(&S, 0.1, 2.0)], |x| x[0].abs()),
        case("relu", vec![r.signed(&S, 0.1, 2.0)], |x| x[0].relu()),
        case("log", vec![r.uniform(&S, 0.3, 3.0)], |x| x[0].log()),
        case("sqrt", vec![r.uniform(&S, 0.3, 3.0)], |x| x[0].sqrt()),
        case("rsqrt", vec![r.uniform(&S, 0.3, 3.0)], |x| x[0].rsqrt()),
        case("reciprocal", vec![r.signed(&S, 0.4, 2.0)], |x| {
            x[0].reciprocal()
        }),
        case("cast f64→f64", vec![smooth(&mut r)], |x| {
            x[0].cast(DType::F64).exp()
        }),
        case("chain: tanh(exp(x)·sin x)", vec![smooth(&mut r)], |x| {
            (x[0].exp() * x[0].sin()).tanh()
        }),
        case("0-d input", vec![r.randn(&[])], |x| {
            x[0].sigmoid() * x[0].exp()
        }),
    ];
    run(cases, 101);
}

/// Casts between float dtypes pass the gradient back cast to the input's
/// dtype. Rounding to f16/bf16 is not differentiable by finite differences
/// at ε = 1e-6, so these are exact checks of `grad = cot.cast(x.dtype)`.
#[test]
fn float_casts_pass_the_gradient_back_in_the_input_dtype() {
    let mut r = Rng::new(2);
    for (from, to) in [
        (DType::F64, DType::F32),
        (DType::F64, DType::F16),
        (DType::F64, DType::BF16),
        (DType::F32, DType::F64),
        (DType::F32, DType::BF16),
        (DType::F16, DType::F32),
    ] {
        let x = Tensor::from_vec(r.randn(&[3, 4]).values, &[3, 4])
            .cast(from)
            .set_requires_grad(true);
        let y = x.cast(to);
        assert_eq!(y.dtype(), to);
        let cot = Tensor::from_vec(r.randn(&[3, 4]).values, &[3, 4]).cast(to);
        y.backward_with(&cot);
        let g = x.grad().expect("a gradient");
        assert_eq!(g.dtype(), from, "{from}→{to}");
        assert_eq!(g.to_f64_vec(), cot.cast(from).to_f64_vec(), "{from}→{to}");
    }
    // Through f32 and back: the gradient is the cotangent rounded to f32.
    let x = Tensor::from_vec(r.randn(&[5]).values, &[5]).set_requires_grad(true);
    let cot = Tensor::from_vec(r.randn(&[5]).values, &[5]);
    x.cast(DType::F32).cast(DType::F64).backward_with(&cot);
    assert_eq!(
        x.grad().unwrap().to_f64_vec(),
        cot.cast(DType::F32).cast(DType::F64).to_f64_vec()
    );
}

#[test]
fn binary_ops_with_broadcasting() {
    let mut r = Rng::new(3);
    type Op = fn(&Tensor, &Tensor) -> Tensor;
    let ops: [(&str, Op); 7] = [
        ("add", |a, b| a + b),
        ("sub", |a, b| a - b),
        ("mul", |a, b| a * b),
        ("div", |a, b| a / b),
        ("pow", |a, b| a.pow(b)),
        ("maximum", |a, b| a.maximum(b)),
        ("minimum", |a, b| a.minimum(b)),
    ];
    // Both directions: b broadcast into a, a into b, both stretched, a 0-d operand.
    let shapes: [(&[usize], &[usize]); 5] = [
        (&[3, 5, 7], &[3, 5, 7]),
        (&[3, 5, 7], &[5, 1]),
        (&[5, 1], &[3, 5, 7]),
        (&[3, 1, 7], &[5, 1]),
        (&[3, 5, 7], &[]),
    ];
    let mut cases = Vec::new();
    for (name, op) in ops {
        for (sa, sb) in shapes {
            let (a, b) = match name {
                // Divide away from 0.
                "div" => (r.randn(sa), r.signed(sb, 0.5, 2.0)),
                // A positive base (ln a is real) and the exponent differentiated.
                "pow" => (r.uniform(sa, 0.5, 2.0), r.uniform(sb, -1.5, 2.5)),
                // a on the grid 0.05k, b on 0.05k + 0.025: never within ε.
                "maximum" | "minimum" => (r.distinct(sa, 0.0), r.distinct(sb, 0.025)),
                _ => (r.randn(sa), r.randn(sb)),
            };
            cases.push(case(
                format!("{name} {sa:?} {sb:?}"),
                vec![a, b],
                move |x| op(&x[0], &x[1]),
            ));
        }
    }
    cases.push(case(
        "scalar operands: (3 - x·2)/4 + 1/x",
        vec![r.signed(&S, 0.5, 2.0)],
        |x| (3.0 - &x[0] * 2.0) / 4.0 + 1.0 / &x[0],
    ));
    cases.push(case("x^3 (constant exponent)", vec![r.randn(&S)], |x| {
        x[0].pow(3.0)
    }));
    cases.push(case(
        "the same tensor twice: x·x + x/x",
        vec![r.signed(&S, 0.5, 2.0)],
        |x| &x[0] * &x[0] + &x[0] / &x[0],
    ));
    run(cases, 103);
}

/// At a tie maximum/minimum split the gradient evenly (as torch does); the
/// two halves add up to the derivative along (1, 1), which is well defined.
#[test]
fn maximum_and_minimum_ties_split_the_gradient() {
    let a = Tensor::from_vec(vec![1.0, 2.0, 3.0, -1.0], &[4]).set_requires_grad(true);
    let b = Tensor::from_vec(vec![1.0, 5.0, 0.0, -1.0], &[4]).set_requires_grad(true);
    let cot = Tensor::from_vec(vec![2.0, 3.0, 5.0, 7.0], &[4]);
    a.maximum(&b).backward_with(&cot);
    assert_close(&a.grad().unwrap(), &[1.0, 0.0, 5.0, 3.5], "maximum d/da");
    assert_close(&b.grad().unwrap(), &[1.0, 3.0, 0.0, 3.5], "maximum d/db");
    a.zero_grad();
    b.zero_grad();
    a.minimum(&b).backward_with(&cot);
    assert_close(&a.grad().unwrap(), &[1.0, 3.0, 0.0, 3.5], "minimum d/da");
    assert_close(&b.grad().unwrap(), &[1.0, 0.0, 5.0, 3.5], "minimum d/db");
    // A tie under broadcasting: b's single element ties with two of a's.
    let a = Tensor::from_vec(vec![4.0, 1.0, 4.0], &[3]).set_requires_grad(true);
    let b = Tensor::from_vec(vec![4.0], &[1]).set_requires_grad(true);
    a.maximum(&b).sum(&[], false).backward();
    assert_close(&a.grad().unwrap(), &[0.5, 0.0, 0.5], "broadcast tie d/da");
    assert_close(&b.grad().unwrap(), &[2.0], "broadcast tie d/db");
}

/// d/db a^b = a^b·ln a is taken as 0 at a = 0 (torch's convention), not NaN.
#[test]
fn pow_at_a_zero_base() {
    let a = Tensor::from_vec(vec![0.0, 2.0], &[2]).set_requires_grad(true);
    let b = Tensor::from_vec(vec![2.0, 3.0], &[2]).set_requires_grad(true);
    a.pow(&b).sum(&[], false).backward();
    assert_close(&a.grad().unwrap(), &[0.0, 12.0], "d/da");
    assert_close(&b.grad().unwrap(), &[0.0, 8.0 * 2f64.ln()], "d/db");
}

/// d/da a^0 is 0 everywhere, also at a = 0 where b·a^(b-1) is 0·inf
/// (torch's convention), not NaN.
#[test]
fn pow_with_a_zero_exponent() {
    let a = Tensor::from_vec(vec![0.0, 2.0, -3.0], &[3]).set_requires_grad(true);
    let b = Tensor::from_vec(vec![0.0, -0.0, 0.0], &[3]).set_requires_grad(true);
    a.pow(&b).sum(&[], false).backward();
    assert_close(&a.grad().unwrap(), &[0.0, 0.0, 0.0], "d/da");
}

#[test]
fn where_with_broadcasting() {
    let mut r = Rng::new(4);
    let cond = |shape: &[usize], r: &mut Rng| {
        let u = r.unit(shape.iter().product());
        Tensor::from_vec(u, shape).gt(0.5)
    };
    let c1 = cond(&S, &mut r);
    let c2 = cond(&[5, 1], &mut r);
    let c3 = cond(&[3, 1, 1], &mut r);
    let cases = vec![
        case(
            "where same shapes",
            vec![r.randn(&S), r.randn(&S)],
            move |x| Tensor::where_(&c1, &x[0], &x[1]),
        ),
        case(
            "where cond and b broadcast",
            vec![r.randn(&S), r.randn(&[7])],
            {
                let c2 = c2.clone();
                move |x| Tensor::where_(&c2, &x[0], &x[1])
            },
        ),
        case(
            "where a and b broadcast by cond",
            vec![r.randn(&[5, 7]), r.randn(&[])],
            move |x| Tensor::where_(&c3, &x[0], &x[1]),
        ),
        case("where with a 0-d branch", vec![r.randn(&[])], move |x| {
            Tensor::where_(&c2, &x[0], &Tensor::zeros(&[5, 7], DType::F64))
        }),
    ];
    run(cases, 104);
}

#[test]
fn reductions() {
    let mut r = Rng::new(5);
    type Red = fn(&Tensor, &[isize], bool) -> Tensor;
    let ops: [(&str, Red); 5] = [
        ("sum", |x, d, k| x.sum(d, k)),
        ("mean", |x, d, k| x.mean(d, k)),
        ("max", |x, d, k| x.max(d, k)),
        ("min", |x, d, k| x.min(d, k)),
        ("prod", |x, d, k| x.prod(d, k)),
    ];
    let dims: [&'static [isize]; 6] = [&[-1], &[0], &[1], &[0, 2], &[2, 0, 1], &[]];
    let mut cases = Vec::new();
    for (name, op) in ops {
        for d in dims {
            for keepdim in [false, true] {
                let x = match name {
                    "max" | "min" => r.distinct(&S, 0.3),
                    // Magnitudes near 1 keep a product of up to 105 factors O(1).
                    "prod" => r.signed(&S, 0.8, 1.25),
                    _ => r.randn(&S),
                };
                cases.push(case(
                    format!("{name} dims {d:?} keepdim {keepdim}"),
                    vec![x],
                    move |x| op(&x[0], d, keepdim),
                ));
            }
        }
    }
    cases.push(case(
        "sum over a size-1 dim",
        vec![r.randn(&[3, 1, 7])],
        |x| x[0].sum(&[1], false),
    ));
    cases.push(case(
        "max over a size-1 dim",
        vec![r.randn(&[3, 1, 7])],
        |x| x[0].max(&[1], true),
    ));
    cases.push(case("mean of a 0-d", vec![r.randn(&[])], |x| {
        x[0].mean(&[], false)
    }));
    run(cases, 105);
}

/// prod is a polynomial, so finite differences hold at zeros too: one zero in
/// a slice (the zero's gradient is the product of the rest), two zeros (all
/// gradients 0 in that slice, though a naive y/x says NaN).
#[test]
fn prod_with_zeros() {
    let mut r = Rng::new(6);
    // Rows: no zero; one zero; two zeros; one zero at the end.
    let x = r
        .signed(&[4, 5], 0.5, 1.5)
        .with(&[(6, 0.0), (10, 0.0), (13, 0.0), (19, 0.0)]);
    let cube = r
        .signed(&S, 0.5, 1.5)
        .with(&[(0, 0.0), (8, 0.0), (36, 0.0), (37, 0.0), (38, 0.0)]);
    let cases = vec![
        case("prod rows with zeros", vec![x.clone()], |x| {
            x[0].prod(&[1], false)
        }),
        case("prod rows with zeros, keepdim", vec![x.clone()], |x| {
            x[0].prod(&[-1], true)
        }),
        case(
            "prod columns (non-trailing) with zeros",
            vec![x.clone()],
            |x| x[0].prod(&[0], false),
        ),
        case("prod all with zeros", vec![x], |x| x[0].prod(&[], false)),
        case("prod dims [0, 2] with zeros", vec![cube.clone()], |x| {
            x[0].prod(&[0, 2], true)
        }),
        case("prod dim 1 with zeros", vec![cube], |x| {
            x[0].prod(&[1], false)
        }),
    ];
    run(cases, 106);
    // The two-zero slice exactly: every gradient 0, none NaN.
    let x = Tensor::from_vec(vec![0.0, 2.0, 0.0, 3.0], &[4]).set_requires_grad(true);
    x.prod(&[], false).backward();
    assert_close(&x.grad().unwrap(), &[0.0, 0.0, 0.0, 0.0], "two zeros");
    let x = Tensor::from_vec(vec![0.0, 2.0, 5.0, 3.0], &[4]).set_requires_grad(true);
    x.prod(&[], false).backward();
    assert_close(&x.grad().unwrap(), &[30.0, 0.0, 0.0, 0.0], "one zero");
}

/// max/min over a slice with tied extremes split the gradient among them.
#[test]
fn max_and_min_reductions_split_ties() {
    let x = Tensor::from_vec(vec![1.0, 3.0, 3.0, 2.0, 2.0, 2.0], &[2, 3]).set_requires_grad(true);
    let cot = Tensor::from_vec(vec![6.0, 9.0], &[2]);
    x.max(&[1], false).backward_with(&cot);
    assert_close(
        &x.grad().unwrap(),
        &[0.0, 3.0, 3.0, 3.0, 3.0, 3.0],
        "max ties",
    );
    x.zero_grad();
    x.min(&[], true)
        .backward_with(&Tensor::from_vec(vec![4.0], &[1, 1]));
    assert_close(
        &x.grad().unwrap(),
        &[4.0, 0.0, 0.0, 0.0, 0.0, 0.0],
        "min of all",
    );
}

#[test]
fn softmax_and_log_softmax() {
    let mut r = Rng::new(7);
    let mut cases = Vec::new();
    for dim in [-1isize, 0, 1] {
        cases.push(case(
            format!("softmax dim {dim}"),
            vec![r.randn(&S)],
            move |x| x[0].softmax(dim),
        ));
        cases.push(case(
            format!("log_softmax dim {dim}"),
            vec![r.randn(&S)],
            move |x| x[0].log_softmax(dim),
        ));
    }
    cases.push(case("softmax of a row", vec![r.randn(&[6])], |x| {
        x[0].softmax(0)
    }));
    cases.push(case(
        "softmax over a size-1 dim",
        vec![r.randn(&[3, 1])],
        |x| x[0].softmax(1) * &x[0],
    ));
    cases.push(case(
        "log_softmax with large logits",
        vec![r.randn(&[4, 5]).with(&[(0, 40.0), (7, -35.0)])],
        |x| x[0].log_softmax(-1),
    ));
    run(cases, 107);
}

#[test]
fn matmul_shapes() {
    let mut r = Rng::new(8);
    let shapes: [(&[usize], &[usize]); 9] = [
        (&[3, 4], &[4, 5]),
        (&[4], &[4, 5]),
        (&[3, 4], &[4]),
        (&[4], &[4]),
        (&[2, 3, 4], &[2, 4, 5]),
        (&[2, 1, 3, 4], &[5, 4, 6]),
        (&[3, 4], &[2, 4, 5]),
        (&[2, 3, 4], &[4]),
        (&[4], &[2, 4, 5]),
    ];
    let cases = shapes
        .iter()
        .map(|(sa, sb)| {
            case(
                format!("matmul {sa:?} @ {sb:?}"),
                vec![r.randn(sa), r.randn(sb)],
                |x| x[0].matmul(&x[1]),
            )
        })
        .collect();
    run(cases, 108);
}

#[test]
fn views_and_layout_ops() {
    let mut r = Rng::new(9);
    let cases = vec![
        case("reshape [5, 21]", vec![r.randn(&S)], |x| {
            x[0].reshape(&[5, -1])
        }),
        case("reshape [-1]", vec![r.randn(&S)], |x| x[0].reshape(&[-1])),
        case("reshape of a transposed view", vec![r.randn(&S)], |x| {
            x[0].transpose(0, 2).reshape(&[7, 15])
        }),
        case("view", vec![r.randn(&S)], |x| {
            x[0].contiguous().view(&[15, 7])
        }),
        case("permute [2, 0, 1]", vec![r.randn(&S)], |x| {
            x[0].permute(&[2, 0, 1])
        }),
        case("permute [1, 2, 0] twice", vec![r.randn(&S)], |x| {
            x[0].permute(&[1, 2, 0]).permute(&[1, 2, 0])
        }),
        case("transpose(0, 2)", vec![r.randn(&S)], |x| {
            x[0].transpose(0, -1)
        }),
        case("t", vec![r.randn(&[4, 6])], |x| x[0].t()),
        case(
            "expand [3,1,7] → [2,3,5,7]",
            vec![r.randn(&[3, 1, 7])],
            |x| x[0].expand(&[2, 3, 5, -1]),
        ),
        case("broadcast_to [5] → [3,4,5]", vec![r.randn(&[5])], |x| {
            x[0].broadcast_to(&[3, 4, 5])
        }),
        case("expand 0-d", vec![r.randn(&[])], |x| x[0].expand(&[3, 2])),
        case("contiguous of a transpose", vec![r.randn(&S)], |x| {
            x[0].transpose(0, 1).contiguous()
        }),
        case("contiguous", vec![r.randn(&S)], |x| x[0].contiguous()),
        case("flatten(0, 1)", vec![r.randn(&S)], |x| x[0].flatten(0, 1)),
        case("flatten(1, 2) of a permute", vec![r.randn(&S)], |x| {
            x[0].permute(&[2, 1, 0]).flatten(1, 2)
        }),
        case("unsqueeze(1)", vec![r.randn(&S)], |x| x[0].unsqueeze(1)),
        case("unsqueeze(-1)", vec![r.randn(&S)], |x| x[0].unsqueeze(-1)),
        case("squeeze", vec![r.randn(&[3, 1, 7])], |x| x[0].squeeze(1)),
        case("squeeze_all", vec![r.randn(&[1, 5, 1])], |x| {
            x[0].squeeze_all()
        }),
    ];
    run(cases, 109);
}

#[test]
fn slices() {
    let mut r = Rng::new(10);
    let x = |r: &mut Rng| r.randn(&[3, 11, 4]);
    let cases = vec![
        case("slice dim 1 [2:10:3]", vec![x(&mut r)], |x| {
            x[0].slice(1, 2, 10, 3)
        }),
        case(
            "slice dim 1 [1:11:4] (ends one before the end)",
            vec![x(&mut r)],
            |x| x[0].slice(1, 1, 11, 4),
        ),
        case(
            "slice dim 1 [3:100:2] (end clamped)",
            vec![x(&mut r)],
            |x| x[0].slice(1, 3, 100, 2),
        ),
        case(
            "slice dim -1 [-3:4:2] (negative start)",
            vec![x(&mut r)],
            |x| x[0].slice(-1, -3, 4, 2),
        ),
        case("slice dim 0 [0:3:2]", vec![x(&mut r)], |x| {
            x[0].slice(0, 0, 3, 2)
        }),
        case("slice dim 1 [4:5] (one row)", vec![x(&mut r)], |x| {
            x[0].slice(1, 4, 5, 1)
        }),
        case("slice dim 1 [5:5] (empty) + x", vec![x(&mut r)], |x| {
            x[0].slice(1, 5, 5, 1).sum(&[1], false) + x[0].sum(&[1], false)
        }),
        case("narrow dim 2", vec![x(&mut r)], |x| x[0].narrow(2, 1, 2)),
        case("slice of a slice", vec![x(&mut r)], |x| {
            x[0].slice(1, 1, 11, 2).slice(1, 1, 5, 3)
        }),
        case("overlapping slices added", vec![x(&mut r)], |x| {
            x[0].slice(1, 0, 8, 1) + x[0].slice(1, 3, 11, 1)
        }),
    ];
    run(cases, 110);
}

#[test]
fn joining_and_splitting() {
    let mut r = Rng::new(11);
    let cases = vec![
        case(
            "cat of 3 along dim 1",
            vec![
                r.randn(&[3, 2, 7]),
                r.randn(&[3, 5, 7]),
                r.randn(&[3, 1, 7]),
            ],
            |x| Tensor::cat(&[&x[0], &x[1], &x[2]], 1),
        ),
        case(
            "cat of 3 along dim 0",
            vec![r.randn(&[2, 4]), r.randn(&[1, 4]), r.randn(&[3, 4])],
            |x| Tensor::cat(&[&x[0], &x[1], &x[2]], 0),
        ),
        case(
            "cat of 3 along dim -1",
            vec![r.randn(&[3, 2]), r.randn(&[3, 4]), r.randn(&[3, 1])],
            |x| Tensor::cat(&[&x[0], &x[1], &x[2]], -1),
        ),
        case("cat of a tensor with itself", vec![r.randn(&[3, 2])], |x| {
            Tensor::cat(&[&x[0], &x[0].exp(), &x[0]], 0)
        }),
        case(
            "stack of 3 along dim 0",
            vec![r.randn(&[3, 4]), r.randn(&[3, 4]), r.randn(&[3, 4])],
            |x| Tensor::stack(&[&x[0], &x[1], &x[2]], 0),
        ),
        case(
            "stack of 3 along dim 1",
            vec![r.randn(&[3, 4]), r.randn(&[3, 4]), r.randn(&[3, 4])],
            |x| Tensor::stack(&[&x[0], &x[1], &x[2]], 1),
        ),
        case(
            "stack of 3 along dim -1",
            vec![r.randn(&[3, 4]), r.randn(&[3, 4]), r.randn(&[3, 4])],
            |x| Tensor::stack(&[&x[0], &x[1], &x[2]], -1),
        ),
        case(
            "tensor_split 10 → 4+3+3 on dim 1, reordered",
            vec![r.randn(&[3, 10])],
            |x| {
                let p = x[0].tensor_split(3, 1);
                Tensor::cat(&[&(&p[2] * 2.0), &p[0], &p[1].exp()], 1)
            },
        ),
        case(
            "tensor_split 5 → 2+2+1 on dim 0, one part",
            vec![r.randn(&[5, 3])],
            |x| x[0].tensor_split(3, 0)[1].clone(),
        ),
        case("chunk and split", vec![r.randn(&[6, 4])], |x| {
            let c = x[0].chunk(2, 1);
            let s = x[0].split(4, 0);
            c[0].sum(&[1], false) * c[1].sum(&[1], false)
                + Tensor::cat(&[&s[1], &s[0]], 0).sum(&[1], false)
        }),
    ];
    run(cases, 111);
}

#[test]
fn tril_and_triu() {
    let mut r = Rng::new(12);
    let mut cases = Vec::new();
    for diagonal in [0i64, 1, -2] {
        cases.push(case(
            format!("tril({diagonal})"),
            vec![r.randn(&[2, 4, 5])],
            move |x| x[0].tril(diagonal),
        ));
        cases.push(case(
            format!("triu({diagonal})"),
            vec![r.randn(&[2, 4, 5])],
            move |x| x[0].triu(diagonal),
        ));
    }
    run(cases, 112);
}

#[test]
fn indexing_ops() {
    let mut r = Rng::new(13);
    let cases = vec![
        case(
            "index_select dim 0, repeated indices",
            vec![r.randn(&[5, 4])],
            |x| x[0].index_select(0, &ids(&[0, 2, 2, 4, 0, 2])),
        ),
        case(
            "index_select dim 1, repeated indices",
            vec![r.randn(&[3, 5, 4])],
            |x| x[0].index_select(1, &ids(&[3, 3, 1])),
        ),
        case("index_select i32 indices", vec![r.randn(&[5, 4])], |x| {
            x[0].index_select(-1, &Tensor::from_slice(&[1i32, 1, 0], &[3]))
        }),
        case("gather dim 1, repeats", vec![r.randn(&[4, 5])], |x| {
            x[0].gather(1, &ids2(&[0, 4, 4, 1, 1, 1, 2, 3, 0, 4, 0, 2], &[4, 3]))
        }),
        case("gather dim 0", vec![r.randn(&[4, 5])], |x| {
            x[0].gather(0, &ids2(&[3, 0, 1, 1, 2, 0, 0, 3, 2, 1], &[2, 5]))
        }),
        case(
            "gather with a smaller non-gathered dim",
            vec![r.randn(&[4, 5])],
            |x| x[0].gather(1, &ids2(&[0, 4, 2, 2, 1, 3], &[3, 2])),
        ),
        case(
            "index_add dim 0 (base and src)",
            vec![r.randn(&[5, 4]), r.randn(&[3, 4])],
            |x| x[0].index_add(0, &ids(&[1, 3, 1]), &x[1]),
        ),
        case(
            "index_add dim 1",
            vec![r.randn(&[3, 5]), r.randn(&[3, 4])],
            |x| x[0].index_add(1, &ids(&[4, 0, 0, 2]), &x[1]),
        ),
        case(
            "scatter_add dim 1 (base and src)",
            vec![r.randn(&[4, 5]), r.randn(&[4, 3])],
            |x| {
                x[0].scatter_add(
                    1,
                    &ids2(&[0, 4, 4, 1, 1, 1, 2, 3, 0, 4, 0, 2], &[4, 3]),
                    &x[1],
                )
            },
        ),
        case(
            "scatter_add dim 0",
            vec![r.randn(&[3, 4]), r.randn(&[2, 4])],
            |x| x[0].scatter_add(0, &ids2(&[2, 0, 2, 1, 2, 0, 0, 1], &[2, 4]), &x[1]),
        ),
        case("embedding, repeated ids", vec![r.randn(&[6, 4])], |x| {
            x[0].embedding(&ids2(&[1, 5, 1, 0, 1, 3], &[2, 3]))
        }),
    ];
    run(cases, 113);
}

/// A few compositions that make one tensor feed several ops, so the engine's
/// accumulation of partial gradients is exercised.
#[test]
fn compositions() {
    let mut r = Rng::new(14);
    let cases = vec![
        case(
            "layer-norm-like",
            vec![r.randn(&[4, 6]), r.randn(&[6])],
            |x| {
                let mean = x[0].mean(&[-1], true);
                let d = &x[0] - &mean;
                let var = (&d * &d).mean(&[-1], true);
                &d * &(var + 1e-5).rsqrt() * &x[1]
            },
        ),
        case(
            "attention-like",
            vec![
                r.randn(&[2, 3, 4]),
                r.randn(&[2, 5, 4]),
                r.randn(&[2, 5, 4]),
            ],
            |x| {
                let s = x[0].matmul(&x[1].transpose(1, 2)) * 0.5;
                s.softmax(-1).matmul(&x[2])
            },
        ),
        case("diamond: sigmoid(x)·tanh(x) + x", vec![r.randn(&S)], |x| {
            x[0].sigmoid() * x[0].tanh() + &x[0]
        }),
    ];
    run(cases, 114);
}

// ---------------------------------------------------------------------------
// The engine.

#[test]
fn gradients_accumulate_across_backward_calls() {
    let x = Tensor::from_vec(vec![1.0, 2.0, 3.0], &[3]).set_requires_grad(true);
    (&x * &x).sum(&[], false).backward();
    assert_close(&x.grad().unwrap(), &[2.0, 4.0, 6.0], "after one backward");
    (&x * 3.0).sum(&[], false).backward();
    assert_close(&x.grad().unwrap(), &[5.0, 7.0, 9.0], "after two");
    // A clone of the leaf shares its gradient.
    let alias = x.clone();
    alias.sum(&[], false).backward();
    assert_close(&x.grad().unwrap(), &[6.0, 8.0, 10.0], "through a clone");
    x.zero_grad();
    assert!(x.grad().is_none());
    // The same graph twice: an error, as in PyTorch, naming both lines;
    // the gradient of the first backward stays, nothing is added.
    let y = (&x * &x).sum(&[], false);
    y.backward();
    let err = y.try_backward(None).unwrap_err().to_string();
    assert!(
        err.contains("Trying to backward through the graph a second time")
            && err.contains("grad_rules.rs")
            && err.contains("backward_retain_graph()"),
        "{err}"
    );
    assert_close(
        &x.grad().unwrap(),
        &[2.0, 4.0, 6.0],
        "the failed one adds nothing",
    );
    // Another output sharing part of the graph cannot go through it either.
    x.zero_grad();
    let h = &x * &x;
    h.sum(&[], false).backward();
    assert!(h.mean(&[], false).try_backward(None).is_err());
    // Retaining the graph allows a second backward: twice the gradient.
    x.zero_grad();
    let y = (&x * &x).sum(&[], false);
    y.backward_retain_graph();
    y.backward();
    assert_close(
        &x.grad().unwrap(),
        &[4.0, 8.0, 12.0],
        "one retained graph, two backward calls",
    );
    // `grad` retains the graph, but cannot use one a backward consumed.
    let y = (&x * &x).sum(&[], false);
    let one = Tensor::scalar(1.0, DType::F64);
    grad(
        std::slice::from_ref(&y),
        std::slice::from_ref(&one),
        std::slice::from_ref(&x),
    )
    .unwrap();
    y.backward_retain_graph();
    y.backward();
    assert!(grad(
        std::slice::from_ref(&y),
        std::slice::from_ref(&one),
        std::slice::from_ref(&x)
    )
    .is_err());
    x.zero_grad();
    x.exp().sum(&[], false).backward();
    assert_close(
        &x.grad().unwrap(),
        &[1f64.exp(), 2f64.exp(), 3f64.exp()],
        "after zero_grad",
    );
}

#[test]
fn grad_returns_without_accumulating() {
    let x = Tensor::from_vec(vec![1.0, 2.0], &[2]).set_requires_grad(true);
    let w = Tensor::from_vec(vec![3.0, 4.0], &[2]).set_requires_grad(true);
    let h = &x * &w;
    let y = h.sum(&[], false);
    let g = grad(
        &[y],
        &[Tensor::scalar(2.0, DType::F64)],
        &[x.clone(), h.clone(), w.clone()],
    )
    .unwrap();
    assert_close(g[0].as_ref().unwrap(), &[6.0, 8.0], "d/dx");
    assert_close(
        g[1].as_ref().unwrap(),
        &[2.0, 2.0],
        "d/dh (an intermediate)",
    );
    assert_close(g[2].as_ref().unwrap(), &[2.0, 4.0], "d/dw");
    assert!(
        x.grad().is_none() && w.grad().is_none(),
        "grad() must not accumulate"
    );
    // An input the output does not depend on gets None.
    let unused = Tensor::from_vec(vec![1.0], &[1]).set_requires_grad(true);
    let g = grad(
        &[x.exp().sum(&[], false)],
        &[Tensor::scalar(1.0, DType::F64)],
        &[unused],
    )
    .unwrap();
    assert!(g[0].is_none());
}

#[test]
fn no_grad_records_nothing() {
    let x = Tensor::from_vec(vec![1.0, 2.0], &[2]).set_requires_grad(true);
    let y = no_grad(|| {
        assert!(!is_grad_enabled());
        x.exp() * 2.0
    });
    assert!(is_grad_enabled());
    assert!(!y.requires_grad());
    // Mixed: only the part recorded with grad enabled contributes.
    let z = (&x * &y).sum(&[], false);
    z.backward();
    assert_close(
        &x.grad().unwrap(),
        &[2.0 * 1f64.exp(), 2.0 * 2f64.exp()],
        "y is a constant",
    );
    // no_grad restores the flag after a panic inside it.
    let r = catch_unwind(|| no_grad(|| panic!("inside")));
    assert!(r.is_err());
    assert!(is_grad_enabled());
}

#[test]
fn detach_cuts_the_graph() {
    let x = Tensor::from_vec(vec![1.0, 2.0, 3.0], &[3]).set_requires_grad(true);
    let d = x.detach();
    assert!(!d.requires_grad());
    // d(x · stop(x))/dx = stop(x), not 2x.
    (&x * &d).sum(&[], false).backward();
    assert_close(&x.grad().unwrap(), &[1.0, 2.0, 3.0], "x·detach(x)");
    // Detaching an intermediate: the detached branch is a constant.
    x.zero_grad();
    let h = x.exp();
    (&h + &h.detach().sin()).sum(&[], false).backward();
    assert_close(
        &x.grad().unwrap(),
        &[1f64.exp(), 2f64.exp(), 3f64.exp()],
        "exp(x) + sin(detach(exp(x)))",
    );
    // set_requires_grad(false) also detaches.
    assert!(!x.exp().set_requires_grad(false).requires_grad());
}

fn error_text(f: impl FnOnce()) -> String {
    let err = catch_unwind(AssertUnwindSafe(f)).expect_err("expected a panic");
    err.downcast_ref::<String>()
        .cloned()
        .or_else(|| err.downcast_ref::<&str>().map(|s| s.to_string()))
        .expect("a string panic")
}

#[test]
fn backward_errors_name_the_op_and_the_shapes() {
    let x = Tensor::from_vec(vec![1.0; 15], &[3, 5]).set_requires_grad(true);
    let y = x.exp();

    // A non-scalar output without a gradient.
    let e = y.try_backward(None).unwrap_err();
    let text = e.to_string();
    assert!(text.starts_with("backward: "), "{text}");
    assert!(
        text.contains("f64[3,5]") && text.contains("scalar"),
        "{text}"
    );
    assert!(
        text.contains("grad_rules.rs"),
        "the error points at the caller: {text}"
    );
    let panic = error_text(|| y.backward());
    assert!(
        panic.contains("backward: ")
            && panic.contains("f64[3,5]")
            && panic.contains("grad_rules.rs"),
        "{panic}"
    );

    // A tensor that does not require grad.
    let c = Tensor::from_vec(vec![1.0, 2.0], &[2]).exp().sum(&[], false);
    let text = c.try_backward(None).unwrap_err().to_string();
    assert!(
        text.starts_with("backward: ")
            && text.contains("f64[]")
            && text.contains("does not require grad"),
        "{text}"
    );
    let under_no_grad = no_grad(|| x.exp().sum(&[], false));
    assert!(under_no_grad.try_backward(None).is_err());

    // A gradient of the wrong shape, and of the wrong dtype.
    let text = y
        .try_backward(Some(&Tensor::ones(&[5, 3], DType::F64)))
        .unwrap_err()
        .to_string();
    assert!(
        text.starts_with("backward: ") && text.contains("f64[5,3]") && text.contains("f64[3,5]"),
        "{text}"
    );
    let panic = error_text(|| y.backward_with(&Tensor::ones(&[15], DType::F64)));
    assert!(
        panic.contains("backward: ") && panic.contains("f64[15]") && panic.contains("f64[3,5]"),
        "{panic}"
    );
    let text = y
        .try_backward(Some(&Tensor::ones(&[3, 5], DType::F32)))
        .unwrap_err()
        .to_string();
    assert!(
        text.contains("f32[3,5]") && text.contains("f64[3,5]"),
        "{text}"
    );

    // A failed backward leaves no partial gradient behind.
    assert!(x.grad().is_none());

    // requires_grad on an integer tensor names the op and the type.
    let panic = error_text(|| {
        ids(&[1, 2]).set_requires_grad(true);
    });
    assert!(
        panic.contains("requires_grad") && panic.contains("i64[2]"),
        "{panic}"
    );
}
