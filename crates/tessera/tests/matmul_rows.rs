//! Matmul row kernels (`Kernel::MatmulRows`, fusion round 4): a matmul
//! whose product only a row kernel reads runs with it, the product handed
//! over a block of rows at a time. Compiled programs that hit the fusion
//! give eager's values and gradients (attention forward + backward,
//! batched, sliced and plain matrices, row counts that no block divides),
//! the fusion fires on the seed's attention and not where the product has
//! another reader, and the fused plan computes the unfused kernels' bits.

mod schedule_util;

use schedule_util::traced;
use tessera::autograd::{aot_autograd, Partition};
use tessera::fusion::{describe, fuse, Kernel, Plan};
use tessera::ir::Graph;
use tessera::runtime::execute::run_plan;
use tessera::tensor::interpret::run_graph;
use tessera::tensor::Generator;
use tessera::{DType, Tensor};

fn randn(shape: &[usize], seed: u64) -> Tensor {
    Tensor::randn(shape, DType::F32, &mut Generator::new(seed))
}

fn fed(plan: &Plan) -> usize {
    plan.kernels
        .iter()
        .filter(|k| matches!(k, Kernel::MatmulRows { .. }))
        .count()
}

/// The forward and backward graphs of `g` (AOT, saving all).
fn forward_and_backward(g: &Graph, inputs: usize) -> (Graph, Graph) {
    let wrt: Vec<usize> = (0..inputs).collect();
    let aot = aot_autograd(g, &wrt, Partition::SaveAll).unwrap();
    (
        schedule_util::optimized(aot.forward),
        schedule_util::optimized(aot.backward),
    )
}

/// Attention as the seed writes it: `softmax(q·kᵀ·scale)·v`, over
/// `slices` parts of the flattened leading dims.
fn attention(x: &[Tensor], slices: usize) -> Tensor {
    tessera_apps::seed_table::sdpa(&x[0], &x[1], &x[2], false, slices)
}

/// Plain matrices: `softmax(q·kᵀ / 5)·v`.
fn matrices(x: &[Tensor]) -> Tensor {
    (x[0].matmul(&x[1].transpose(-2, -1)) * 0.2)
        .softmax(-1)
        .matmul(&x[2])
}

/// The output and the inputs' gradients of `f` for output gradient `grad`,
/// compiled or eager.
fn step(f: &dyn Fn(&[Tensor]) -> Tensor, inputs: &[Tensor], grad: &Tensor) -> Vec<Tensor> {
    let leaves: Vec<Tensor> = inputs.iter().map(|t| t.set_requires_grad(true)).collect();
    let out = f(&leaves);
    out.backward_with(grad);
    let mut r = vec![out.detach()];
    r.extend(leaves.iter().map(|l| l.grad().unwrap()));
    r
}

/// `f` compiled against `f` eager, values and gradients, after checking
/// that the fusion fires `forward` / `backward` times in its AOT graphs.
fn compiled_matches_eager(
    name: &str,
    inputs: &[Tensor],
    f: fn(&[Tensor]) -> Tensor,
    (forward, backward): (usize, usize),
) {
    let g = traced(name, inputs, |a| vec![f(a)]);
    let (fwd, bwd) = forward_and_backward(&g, inputs.len());
    let (pf, pb) = (fuse(&fwd), fuse(&bwd));
    assert_eq!(
        (fed(&pf), fed(&pb)),
        (forward, backward),
        "{name}: matmul row kernels\n{}{}",
        describe(&fwd, &pf),
        describe(&bwd, &pb)
    );
    let out_shape = f(inputs).shape().to_vec();
    let grad = randn(&out_shape, 99);
    // Without the attention pass, which would make attention one op.
    let compiled = tessera::compile(move |x: &[Tensor]| vec![f(x)]).fuse_attention(false);
    let got = step(&|x| compiled.call(x).remove(0), inputs, &grad);
    let want = step(&f, inputs, &grad);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g.shape(), w.shape(), "{name} result {i}");
        for (a, b) in g.to_f64_vec().iter().zip(w.to_f64_vec()) {
            assert!(
                (a - b).abs() <= 1e-5 + 1e-5 * b.abs(),
                "{name} result {i}: {a} vs eager {b}"
            );
        }
    }
}

#[test]
fn the_seeds_attention_fuses_scores_with_softmax_and_dp_with_softmax_backward() {
    // One matmul row kernel per slice in each direction: q·kᵀ with the
    // scale and softmax, dO·vᵀ with softmax's backward.
    let inputs: Vec<Tensor> = (0..3).map(|i| randn(&[2, 2, 64, 16], i)).collect();
    for slices in [1, 4] {
        let g = traced("seed", &inputs, |a| vec![attention(a, slices)]);
        let (fwd, bwd) = forward_and_backward(&g, 3);
        let (pf, pb) = (fuse(&fwd), fuse(&bwd));
        assert_eq!(fed(&pf), slices, "forward\n{}", describe(&fwd, &pf));
        assert_eq!(fed(&pb), slices, "backward\n{}", describe(&bwd, &pb));
        // The scores are no value of the forward any more: one kernel
        // less per slice than without the round.
        let text = describe(&fwd, &pf);
        assert!(text.contains("matmul+rows [%"), "{text}");
    }
}

#[test]
fn batched_attention_forward_and_backward_matches_eager() {
    // 100 rows: blocks of 48, 48 and 4 rows; 6 matrices on rayon's tasks.
    let inputs: Vec<Tensor> = (0..3).map(|i| randn(&[2, 3, 100, 16], 10 + i)).collect();
    compiled_matches_eager("naive", &inputs, |x| attention(x, 1), (1, 1));
}

#[test]
fn sliced_attention_forward_and_backward_matches_eager() {
    // Three slices of two matrices each; 70 rows (48 + 22).
    let inputs: Vec<Tensor> = (0..3).map(|i| randn(&[3, 2, 70, 24], 20 + i)).collect();
    compiled_matches_eager("sliced", &inputs, |x| attention(x, 3), (3, 3));
}

#[test]
fn plain_matrices_and_a_product_too_small_for_threads_match_eager() {
    // One 130 × 70 product (no batch; 130 = 48 + 48 + 34 rows), and one
    // of 20 × 20 × 16 that runs on the calling thread.
    let big = [
        randn(&[130, 24], 30),
        randn(&[70, 24], 31),
        randn(&[70, 8], 32),
    ];
    compiled_matches_eager("matrices", &big, matrices, (1, 1));
    let small = [
        randn(&[20, 16], 33),
        randn(&[20, 16], 34),
        randn(&[20, 16], 35),
    ];
    compiled_matches_eager("small", &small, matrices, (1, 1));
}

#[test]
fn a_product_with_another_reader_is_not_fed() {
    let x: Vec<Tensor> = (0..3).map(|i| randn(&[2, 64, 16], 40 + i)).collect();
    // The scores returned, and read by a second row kernel.
    let returned = traced("returned", &x, |a| {
        let s = a[0].matmul(&a[1].transpose(-2, -1));
        vec![s.softmax(-1).matmul(&a[2]), s]
    });
    let reduced = traced("reduced", &x, |a| {
        let s = a[0].matmul(&a[1].transpose(-2, -1));
        vec![s.softmax(-1).matmul(&a[2]) + s.max(&[-1], true)]
    });
    for g in [&returned, &reduced] {
        let plan = fuse(g);
        assert_eq!(fed(&plan), 0, "{}", describe(g, &plan));
        let want = run_graph(g, &x).unwrap();
        let got = run_plan(g, &plan, &x).unwrap();
        for ((_, a), (_, b)) in got.iter().zip(&want) {
            assert_eq!(a.to_f64_vec(), b.to_f64_vec());
        }
    }
}

#[test]
fn the_fed_row_kernel_computes_the_unfused_kernels_bits() {
    // The product's blocks come from the thin matmul's own tiles and the
    // row kernel is the same code: the fused plan and the interpreter (op
    // by op) agree bit for bit, forward and backward graphs.
    let inputs: Vec<Tensor> = (0..3).map(|i| randn(&[2, 2, 100, 16], 50 + i)).collect();
    let g = traced("bits", &inputs, |a| vec![attention(a, 1)]);
    let (fwd, bwd) = forward_and_backward(&g, 3);
    let plan = fuse(&fwd);
    let outs: Vec<Tensor> = run_plan(&fwd, &plan, &inputs)
        .unwrap()
        .into_iter()
        .map(|(_, t)| t)
        .collect();
    let mut feed: Vec<Tensor> = outs[1..].to_vec();
    feed.push(randn(outs[0].shape(), 59));
    for (graph, args) in [(&fwd, &inputs[..]), (&bwd, &feed[..])] {
        let plan = fuse(graph);
        assert_eq!(fed(&plan), 1);
        let want = run_graph(graph, args).unwrap();
        let got = run_plan(graph, &plan, args).unwrap();
        for ((name, a), (_, b)) in got.iter().zip(&want) {
            assert_eq!(a.to_f64_vec(), b.to_f64_vec(), "{}: {name}", graph.name);
        }
    }
}

/// Two products read by one row kernel: `softmax(q·kᵀ) ⊙ (u·wᵀ)`, `u·wᵀ`
/// made first (so that the product is no newer than the softmax, whose
/// row kernel then takes the product ⊙).
fn two_products(x: &[Tensor]) -> Tensor {
    let uw = x[2].matmul(&x[3].transpose(-2, -1));
    x[0].matmul(&x[1].transpose(-2, -1)).softmax(-1) * uw
}

#[test]
fn a_row_kernel_fed_two_products_matches_eager() {
    // As the hinted seed's backward: the recomputed scores and dP feed
    // softmax's backward together.
    let inputs: Vec<Tensor> = (0..4).map(|i| randn(&[2, 100, 16], 60 + i)).collect();
    let g = traced("two", &inputs, |a| vec![two_products(a)]);
    let plan = fuse(&g);
    let fed_twice = plan
        .kernels
        .iter()
        .filter(|k| matches!(k, Kernel::MatmulRows { matmuls, .. } if matmuls.len() == 2))
        .count();
    assert_eq!(fed_twice, 1, "{}", describe(&g, &plan));
    let want = run_graph(&g, &inputs).unwrap();
    let got = run_plan(&g, &plan, &inputs).unwrap();
    assert_eq!(got[0].1.to_f64_vec(), want[0].1.to_f64_vec());
    compiled_matches_eager("two products", &inputs, two_products, (1, 0));
}
