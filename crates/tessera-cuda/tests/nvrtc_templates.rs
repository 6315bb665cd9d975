//! Every kernel template the generator emits, compiled to PTX by NVRTC
//! (for `compute_90`, as the GPU machine's driver loads it). Needs libnvrtc
//! and the CUDA fp16/bf16 headers, not a GPU: CI installs the pinned PyPI
//! wheels (nvidia-cuda-nvrtc 13.0.88, nvidia-cuda-runtime 13.0.96) and sets
//! `TESSERA_NVRTC_TESTS=1`; without that variable the test says so and
//! passes, as there is no NVRTC to test with.

use tessera::ir::kernel::{RowKernel, RowStep, Step, MAX_ROW};
use tessera::ir::{ArgReduceOp, BinaryOp, CompareOp, ReduceOp, UnaryOp};
use tessera::tensor::Layout;
use tessera::DType;
use tessera_cuda::codegen::copy::dense_copy;
use tessera_cuda::codegen::cross_entropy::{self, Rows};
use tessera_cuda::codegen::fused_rows::fused_rows;
use tessera_cuda::codegen::index::{indexed, triangle, IndexCheck, Indexed, Strided};
use tessera_cuda::codegen::int_matmul::{int_matmul, Matrices};
use tessera_cuda::codegen::pointwise::{
    checked_steps, pointwise, pointwise_block, pointwise_checked, ArithCheck, Operand, Output,
};
use tessera_cuda::codegen::rows::{arg_reduce, reduce, reduce_in_parts};
use tessera_cuda::codegen::softmax::softmax;
use tessera_cuda::codegen::{Compute, Launch};
use tessera_cuda::compiler::{compile_uncached, Program};

/// An index check with a stand-in record address.
const CHECK: IndexCheck = IndexCheck {
    bound: 4,
    site: 0,
    report: 3,
};

const FLOATS: [DType; 4] = [DType::F32, DType::F64, DType::F16, DType::BF16];

fn enabled() -> bool {
    let on = std::env::var("TESSERA_NVRTC_TESTS").is_ok_and(|v| v == "1");
    if !on {
        eprintln!("TESSERA_NVRTC_TESTS is not 1: the NVRTC template test does not run here");
    }
    on
}

fn buffer(dtype: DType, layout: Layout) -> Operand {
    Operand::Buffer {
        dtype,
        ptr: 0,
        layout,
    }
}

fn out(step: usize, dtype: DType, shape: &[usize]) -> Output {
    Output {
        step,
        dtype,
        ptr: 0,
        layout: Layout::contiguous(shape),
    }
}

/// One chain per float dtype with every unary, binary and compare op, a
/// where and every rounding; strided and broadcast inputs.
fn float_chains() -> Vec<Launch> {
    FLOATS
        .iter()
        .map(|&d| {
            let shape = [4, 6];
            let x = buffer(d, Layout::contiguous(&[6, 4]).permuted(&[1, 0]));
            let y = buffer(d, Layout::contiguous(&[6]).expanded(&shape));
            let mut steps = vec![Step::Load(0), Step::Load(1), Step::Load(2)];
            let mut last = 0;
            for u in UnaryOp::ALL.into_iter().filter(|u| u.accepts_float()) {
                steps.push(Step::Unary(u, last));
                last = steps.len() - 1;
            }
            for b in BinaryOp::ALL.into_iter().filter(|b| !b.is_bitwise()) {
                steps.push(Step::Binary(b, last, 1));
                last = steps.len() - 1;
            }
            for c in CompareOp::ALL {
                steps.push(Step::Compare(c, last, 2));
            }
            steps.push(Step::Where(steps.len() - 1, last, 1));
            last = steps.len() - 1;
            for r in FLOATS {
                steps.push(Step::Round(r, last));
                last = steps.len() - 1;
            }
            steps.push(Step::Const(0.5));
            let compute = if d == DType::F64 {
                Compute::F64
            } else {
                Compute::F32
            };
            let outs = [
                out(last, d, &shape),
                out(steps.len() - 2, DType::Bool, &shape),
            ];
            pointwise(
                &steps,
                &[x, y, Operand::Scalar(2.0)],
                &outs,
                &shape,
                compute,
                132,
            )
            .unwrap()
        })
        .collect()
}

/// Integer arithmetic (division and power checked), and a load and a
/// store of every dtype in each compute type (every conversion the
/// generator writes).
fn integer_and_conversions() -> Vec<Launch> {
    let shape = [8];
    let l = Layout::contiguous(&shape);
    let mut v = Vec::new();
    let int_steps = vec![
        Step::Load(0),
        Step::Load(1),
        Step::Binary(BinaryOp::Add, 0, 1),
        Step::Binary(BinaryOp::Sub, 2, 1),
        Step::Binary(BinaryOp::Mul, 3, 0),
        Step::Binary(BinaryOp::Maximum, 4, 0),
        Step::Binary(BinaryOp::Minimum, 5, 1),
        Step::Unary(UnaryOp::Neg, 6),
        Step::Unary(UnaryOp::Abs, 7),
        Step::Unary(UnaryOp::Relu, 8),
        Step::Unary(UnaryOp::BitNot, 9),
        Step::Binary(BinaryOp::BitAnd, 10, 0),
        Step::Binary(BinaryOp::BitOr, 11, 1),
        Step::Binary(BinaryOp::BitXor, 12, 0),
        Step::Binary(BinaryOp::Shl, 13, 1),
        Step::Binary(BinaryOp::Shr, 14, 0),
    ];
    for d in DType::ALL.into_iter().filter(|d| d.is_int()) {
        let ins = [buffer(d, l.clone()), buffer(d, l.clone())];
        v.push(
            pointwise(
                &int_steps,
                &ins,
                &[out(15, d, &shape)],
                &shape,
                Compute::of(d),
                132,
            )
            .unwrap(),
        );
    }
    // Checked division and power (a site each), of a broadcast host scalar
    // and of strided operands.
    let checked_ops = vec![
        Step::Load(0),
        Step::Load(1),
        Step::Load(2),
        Step::Binary(BinaryOp::Div, 0, 1),
        Step::Binary(BinaryOp::Pow, 3, 2),
        Step::Binary(BinaryOp::Div, 4, 2),
    ];
    let sites = checked_steps(&checked_ops, Compute::I64);
    assert_eq!(sites, [3, 4, 5]);
    let check = ArithCheck {
        report: 3,
        sites: vec![0, 1, 2],
    };
    for d in DType::ALL.into_iter().filter(|d| !d.is_float()) {
        let ins = [
            buffer(d, Layout::contiguous(&[4, 2]).permuted(&[1, 0])),
            buffer(d, Layout::contiguous(&[4]).expanded(&[2, 4])),
            Operand::Scalar(3.0),
        ];
        v.push(
            pointwise_checked(
                &checked_ops,
                &ins,
                &[out(5, d, &[2, 4])],
                &[2, 4],
                Compute::of(d),
                132,
                None,
                &check,
            )
            .unwrap(),
        );
    }
    for compute in [Compute::F32, Compute::F64, Compute::I64, Compute::U64] {
        let ins: Vec<Operand> = DType::ALL.iter().map(|&d| buffer(d, l.clone())).collect();
        let steps: Vec<Step> = (0..ins.len()).map(Step::Load).collect();
        let outs: Vec<Output> = DType::ALL
            .iter()
            .enumerate()
            .map(|(i, &d)| out(i, d, &shape))
            .collect();
        v.push(pointwise(&steps, &ins, &outs, &shape, compute, 132).unwrap());
    }
    // Integer products, one per integer dtype.
    let (a, b) = (
        Matrices {
            ptr: 0,
            strides: [12, 4, 1],
        },
        Matrices {
            ptr: 0,
            strides: [0, 1, 4],
        },
    );
    for d in DType::ALL.into_iter().filter(|d| d.is_int()) {
        v.push(int_matmul(d, 2, (3, 4, 5), a, b, 0, 132));
    }
    v
}

fn reductions() -> Vec<Launch> {
    let mut v = Vec::new();
    for d in DType::ALL {
        for op in ReduceOp::ALL {
            // A row reduction (block per row) and a column one (thread per column).
            v.push(reduce(
                op,
                d,
                &Layout::contiguous(&[64, 32]),
                &[1],
                d,
                0,
                0,
                132,
            ));
            v.push(reduce(
                op,
                d,
                &Layout::contiguous(&[64, 2048]),
                &[0],
                d,
                0,
                0,
                132,
            ));
            let (a, b, _) = reduce_in_parts(
                op,
                d,
                &Layout::contiguous(&[1 << 20]),
                &[0],
                d,
                8,
                0,
                0,
                0,
                132,
            );
            v.extend([a, b]);
            // A column reduction cut into parts (bias gradients).
            let (a, b, _) = reduce_in_parts(
                op,
                d,
                &Layout::contiguous(&[8, 1024, 768]),
                &[0, 1],
                d,
                64,
                0,
                0,
                0,
                132,
            );
            v.extend([a, b]);
            // Two reduced dims walked by steps (batch norm's (0, 2, 3)),
            // whole and cut into parts.
            let nchw = Layout::contiguous(&[32, 4, 56, 56]);
            v.push(reduce(op, d, &nchw, &[0, 2, 3], d, 0, 0, 132));
            let (a, b, _) = reduce_in_parts(op, d, &nchw, &[0, 2, 3], d, 9, 0, 0, 0, 132);
            v.extend([a, b]);
        }
        for op in [ArgReduceOp::ArgMax, ArgReduceOp::ArgMin] {
            v.push(arg_reduce(
                op,
                d,
                &Layout::contiguous(&[3, 5]),
                1,
                0,
                0,
                132,
            ));
        }
    }
    for d in FLOATS {
        for log in [false, true] {
            v.push(softmax(
                d,
                &Layout::contiguous(&[2, 7, 3]),
                1,
                log,
                0,
                0,
                132,
            ));
        }
    }
    v
}

fn indexing() -> Vec<Launch> {
    let mut v = Vec::new();
    for d in DType::ALL {
        v.push(triangle(d, &[2, 3, 3], &[9, 3, 1], 0, 1, true, 0, 0, 132));
        let op = Strided {
            dtype: d,
            ptr: 0,
            offset: 0,
            strides: vec![4, 1],
        };
        for id in [DType::I64, DType::I32] {
            let idx = Strided {
                dtype: id,
                ptr: 0,
                offset: 0,
                strides: vec![1, 0],
            };
            v.push(indexed(Indexed::Read, &[3, 4], &op, &idx, &op, 4, CHECK, 132).unwrap());
            // CUDA has atomic adds of 32- and 64-bit integers only.
            if !matches!(
                d,
                DType::Bool | DType::I16 | DType::I8 | DType::U8 | DType::U16
            ) {
                v.push(indexed(Indexed::Add, &[3, 4], &op, &idx, &op, 4, CHECK, 132).unwrap());
            }
        }
    }
    // The fused cross-entropy, forward and backward, every float dtype,
    // both target dtypes, with and without an ignored value.
    for d in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        for (t, ignore_index) in [(DType::I64, None), (DType::I32, Some(-100))] {
            let rows = Rows {
                logits_dtype: d,
                target_dtype: t,
                n: 3,
                classes: 7,
                stride: 8,
                ignore_index,
            };
            v.push(cross_entropy::forward(&rows, 0, 0, 0, 0, CHECK, 132));
            v.push(cross_entropy::backward(&rows, 0, 0, 0, 0, 0, CHECK, 132));
        }
    }
    v
}

/// The vectorised pointwise loop (contiguous, aligned, 2/4-byte floats):
/// 16-byte packs of each dtype, a mixed-width pair, a broadcast scalar
/// buffer, every unary op and a tuned block size.
fn vectorised() -> Vec<Launch> {
    let shape = [4, 1000];
    let l = Layout::contiguous(&shape);
    let scalar = Layout::contiguous(&[1]).expanded(&shape);
    let mut v = Vec::new();
    for (a, b) in [
        (DType::F32, DType::F32),
        (DType::BF16, DType::BF16),
        (DType::F16, DType::F16),
        (DType::BF16, DType::F32),
        (DType::F16, DType::BF16),
    ] {
        let ins = [buffer(a, l.clone()), buffer(b, scalar.clone())];
        let mut steps = vec![Step::Load(0), Step::Load(1)];
        let mut last = 0;
        for u in UnaryOp::ALL.into_iter().filter(|u| u.accepts_float()) {
            steps.push(Step::Unary(u, last));
            last = steps.len() - 1;
        }
        steps.push(Step::Binary(BinaryOp::Maximum, last, 1));
        let l = pointwise_block(
            &steps,
            &ins,
            &[out(steps.len() - 1, b, &shape), out(last, a, &shape)],
            &shape,
            Compute::F32,
            132,
            Some(1024),
        )
        .unwrap();
        assert!(l.source.contains("Pack<"), "{}", l.source);
        v.push(l);
    }
    // Row reductions on packs, every op.
    for d in [DType::F32, DType::BF16, DType::F16] {
        for op in ReduceOp::ALL {
            let l = reduce(op, d, &Layout::contiguous(&[3, 4096]), &[1], d, 0, 0, 132);
            assert!(l.source.contains("Pack<"), "{}", l.source);
            v.push(l);
        }
    }
    // Softmax rows in registers: a warp per row and a block per row, every
    // 2/4-byte float, softmax and log_softmax.
    for d in [DType::F32, DType::BF16, DType::F16] {
        for (len, log) in [(256, false), (4096, true), (4096, false)] {
            let l = softmax(d, &Layout::contiguous(&[3, len]), 1, log, 0, 0, 132);
            assert!(l.source.contains("row_all<ROW_MAX>"), "{}", l.source);
            v.push(l);
        }
    }
    v
}

/// Fused row kernels: every reduction and softmax over a row computed
/// from a strided f32/f64/f16/bf16 input, a per-row scalar and a host
/// scalar, with row and scalar outputs of every float dtype and a bool;
/// softmax backward on packs; a warp per row, a block per row, the
/// longest row and an odd length.
fn row_kernels() -> Vec<Launch> {
    let mut v = Vec::new();
    for d in FLOATS {
        for (outer, len) in [(vec![2, 3], 40), (vec![5], MAX_ROW), (vec![], 45)] {
            let full: Vec<usize> = outer.iter().copied().chain([len]).collect();
            let t: Vec<usize> = full.iter().rev().copied().collect();
            let perm: Vec<usize> = (0..full.len()).rev().collect();
            let x = buffer(d, Layout::contiguous(&t).permuted(&perm));
            let scalar_shape: Vec<usize> = outer.iter().copied().chain([1]).collect();
            let per_row = buffer(d, Layout::contiguous(&scalar_shape).expanded(&full));
            let mut steps = vec![
                RowStep::Point(Step::Load(0)),
                RowStep::Point(Step::Load(1)),
                RowStep::Point(Step::Load(2)),
                RowStep::Point(Step::Binary(BinaryOp::Mul, 0, 2)),
                RowStep::Point(Step::Binary(BinaryOp::Sub, 3, 1)),
            ];
            let mut is_row = vec![true, false, false, true, true];
            for op in ReduceOp::ALL {
                steps.push(RowStep::Reduce(op, 4));
                is_row.push(false);
            }
            for log in [false, true] {
                steps.push(RowStep::Softmax { log, arg: 4 });
                is_row.push(true);
            }
            let sm = steps.len() - 1;
            steps.push(RowStep::Point(Step::Compare(CompareOp::Gt, sm, 5)));
            is_row.push(true);
            steps.push(RowStep::Point(Step::Round(d, sm)));
            is_row.push(true);
            let mut outputs: Vec<(usize, DType, Vec<usize>)> = (5..10)
                .map(|s| (s, FLOATS[s % 4], scalar_shape.clone()))
                .collect();
            outputs.push((sm, d, full.clone()));
            outputs.push((sm + 1, DType::Bool, full.clone()));
            outputs.push((sm + 2, DType::BF16, full.clone()));
            let k = RowKernel {
                outer: outer.clone(),
                len,
                steps,
                is_row,
                outputs,
                wide: d == DType::F64,
            };
            let ptrs = vec![0x1000; k.outputs.len()];
            v.push(fused_rows(&k, &[x, per_row, Operand::Scalar(0.5)], &ptrs, 132).unwrap());
        }
    }
    // Softmax's and log_softmax's gradient (eager backward's row kernel,
    // what fusion makes of the decomposed rule) on packs: p * (dp - sum(dp
    // * p)) and dp - exp(p) * sum(dp), bf16, f32 and f16.
    for (d, log) in [DType::BF16, DType::F32, DType::F16]
        .into_iter()
        .flat_map(|d| [(d, false), (d, true)])
    {
        let full = [64, 2048];
        let k = RowKernel::softmax_backward(vec![64], 2048, d, log);
        let l = fused_rows(
            &k,
            &[
                buffer(d, Layout::contiguous(&full)),
                buffer(d, Layout::contiguous(&full)),
            ],
            &[0x2000],
            132,
        )
        .unwrap();
        assert!(l.source.contains("Pack<"), "{}", l.source);
        v.push(l);
    }
    v
}

/// Strided views copied a word at a time (16, 8 and 4 bytes).
fn word_copies() -> Vec<Launch> {
    let heads = Layout::contiguous(&[8, 12, 1024, 64]).permuted(&[0, 2, 1, 3]);
    [2usize, 4]
        .into_iter()
        .flat_map(|elem| {
            [
                dense_copy(&heads, elem, 0, 0, 132),
                dense_copy(
                    &Layout::contiguous(&[10, 6]).sliced(1, 0, 2, 1),
                    4,
                    0,
                    0,
                    132,
                ),
                dense_copy(
                    &Layout::contiguous(&[10, 6]).sliced(1, 0, 2, 1),
                    2,
                    0,
                    0,
                    132,
                ),
            ]
        })
        .map(|l| l.expect("a word copy"))
        .collect()
}

/// The convolution and pooling kernels in every float dtype, with and
/// without bias and ReLU.
fn conv_kernels() -> Vec<Launch> {
    use tessera::ir::custom::conv::{Activation, Conv2d, Pool2d};
    use tessera_cuda::codegen::conv::{self, ConvShape, PoolShape};
    FLOATS
        .iter()
        .flat_map(|&dtype| {
            let s = |activation| ConvShape {
                dtype,
                input: [2, 4, 7, 6],
                weight: [6, 2, 3, 3],
                out_hw: [4, 6],
                conv: Conv2d {
                    stride: [2, 1],
                    padding: [1, 1, 1, 1],
                    dilation: [1, 1],
                    groups: 2,
                    activation,
                },
            };
            let p = PoolShape {
                dtype,
                planes: 8,
                hw: [7, 6],
                out_hw: [4, 3],
                pool: Pool2d {
                    kernel: [3, 3],
                    stride: [2, 2],
                    padding: [1, 1],
                    dilation: [1, 1],
                    ceil_mode: false,
                    count_include_pad: true,
                    divisor_override: None,
                },
            };
            vec![
                conv::conv2d_forward(&s(Activation::Relu), 0, 0, Some(0), 0, 132),
                conv::conv2d_forward(&s(Activation::None), 0, 0, None, 0, 132),
                conv::conv2d_backward_input(&s(Activation::None), 0, 0, 0, 132),
                conv::conv2d_backward_weight(&s(Activation::None), 0, 0, 0, 132),
                conv::conv2d_epilogue(dtype, [2, 6, 12], Some(0), Activation::Relu, 0, 132),
                conv::conv2d_epilogue(dtype, [2, 6, 12], None, Activation::None, 0, 132),
                conv::max_pool2d_forward(&p, 0, 0, 0, 132),
                conv::max_pool2d_backward(&p, 0, 0, 0, 132),
                conv::avg_pool2d_forward(&p, 0, 0, 132),
                conv::avg_pool2d_backward(&p, 0, 0, 132),
            ]
        })
        .collect()
}

#[test]
fn every_template_compiles_to_ptx() {
    if !enabled() {
        return;
    }
    let launches: Vec<Launch> = [
        float_chains(),
        integer_and_conversions(),
        reductions(),
        indexing(),
        vectorised(),
        word_copies(),
        row_kernels(),
        conv_kernels(),
    ]
    .into_iter()
    .flatten()
    .collect();
    let mut failures = Vec::new();
    for l in &launches {
        match compile_uncached(&Program::new(&l.source), "compute_90") {
            Ok(ptx) => assert!(
                String::from_utf8_lossy(&ptx).contains(".entry tessera_kernel"),
                "PTX without the entry point"
            ),
            Err(e) => failures.push(format!("{e}\n--- source ---\n{}", l.source)),
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} kernels failed:\n{}",
        failures.len(),
        launches.len(),
        failures.join("\n\n")
    );
    eprintln!("{} kernels compiled to PTX", launches.len());
}

/// A program's options reach NVRTC (flash attention's `-D`s go this way), and
/// a failure names the program, its options and the target, with NVRTC's log.
#[test]
fn options_reach_nvrtc_and_failures_say_where() {
    if !enabled() {
        return;
    }
    let source = "#ifdef TF_PROBE_FAIL\n#error the probe was told to fail\n#endif\n\
                  extern \"C\" __global__ void probe(float* x) { x[0] = 1.0f; }\n";
    let plain = Program {
        source,
        name: "probe.cu",
        options: &[],
    };
    let ptx = compile_uncached(&plain, "compute_90").unwrap_or_else(|e| panic!("{e}"));
    assert!(String::from_utf8_lossy(&ptx).contains(".entry probe("));
    let failing = Program {
        options: &["-DTF_PROBE_FAIL"],
        ..plain
    };
    assert_ne!(failing.key("compute_90"), plain.key("compute_90"));
    let e = compile_uncached(&failing, "compute_90").unwrap_err();
    for part in [
        "probe.cu",
        "-DTF_PROBE_FAIL",
        "compute_90",
        "the probe was told to fail",
    ] {
        assert!(e.contains(part), "{part} missing from: {e}");
    }
}
