//! The memory plan against the runtime: for each graph and each strategy,
//! the plan passes the overlap checker, the peak the planner predicts for a
//! run (its arena plus the escaping outputs) is the peak the allocator
//! measures while `run_scheduled` runs (`memory_stats`, which counts the
//! exact bytes every tensor asks for), and every strategy computes the same
//! bits as the kernels run in plan order without an arena.
//!
//! Tolerance: none — predicted and measured agree to the byte, scratch
//! memory of kernels (softmax and reductions of strided inputs, f16/bf16
//! matmul) and concurrent steps included.
//!
//! The allocator's counters are global, so the tests of this file take one
//! lock: nothing else allocates while a peak is measured.

mod schedule_util;

use std::sync::Mutex;

use proptest::prelude::*;
use schedule_util::{planned, random_graph, sliced_attention, traced};
use tessera::autograd::{aot_autograd, Partition};
use tessera::fusion::{describe, Kernel, Plan};
use tessera::hints::hinted_context;
use tessera::ir::Graph;
use tessera::runtime::cpu::{memory_stats, reset_peak};
use tessera::runtime::execute::{run_plan, run_scheduled};
use tessera::schedule::{Scheduled, Strategy};
use tessera::tensor::Generator;
use tessera::{DType, Tensor};

static ALLOCATOR: Mutex<()> = Mutex::new(());

const STRATEGIES: [Strategy; 4] = [
    Strategy::Bfs,
    Strategy::Dfs,
    Strategy::Strict,
    Strategy::Auto,
];

fn randn(shape: &[usize], dtype: DType, seed: u64) -> Tensor {
    Tensor::randn(shape, dtype, &mut Generator::new(seed))
}

/// Runs the schedule and returns its outputs and the measured peak of the
/// bytes it allocated.
fn measured(graph: &Graph, plan: &Plan, s: &Scheduled, inputs: &[Tensor]) -> (Vec<Tensor>, usize) {
    let before = memory_stats().live_bytes;
    reset_peak();
    let outs = run_scheduled(graph, plan, &s.schedule, &s.memory, inputs).unwrap();
    let peak = memory_stats().peak_bytes - before;
    (outs.into_iter().map(|(_, t)| t).collect(), peak)
}

fn bits(ts: &[Tensor]) -> Vec<Vec<u64>> {
    ts.iter()
        .map(|t| t.to_f64_vec().iter().map(|v| v.to_bits()).collect())
        .collect()
}

/// Every test holds this while it allocates.
fn allocator() -> std::sync::MutexGuard<'static, ()> {
    ALLOCATOR.lock().unwrap_or_else(|e| e.into_inner())
}

/// Predicted == measured and the same values as plan order, for every
/// strategy (and a budget between bfs's peak and strict's); returns the
/// peaks by strategy.
fn check_graph(graph: &Graph, inputs: &[Tensor]) -> Vec<(String, usize)> {
    let plan = tessera::fusion::fuse(graph);
    let reference: Vec<Tensor> = run_plan(graph, &plan, inputs)
        .unwrap()
        .into_iter()
        .map(|(_, t)| t)
        .collect();
    let mut peaks = Vec::new();
    let mut runs: Vec<(String, Option<usize>)> = STRATEGIES
        .iter()
        .map(|s| (s.name().to_string(), None))
        .collect();
    let (_, bfs) = planned(graph, Strategy::Bfs, None);
    let (_, strict) = planned(graph, Strategy::Strict, None);
    let between = (bfs.memory.peak_bytes + strict.memory.peak_bytes) / 2;
    runs.push(("budget".into(), Some(between)));
    for (name, budget) in runs {
        let strategy = Strategy::from_name(&name).unwrap_or(Strategy::Bfs);
        let (plan, s) = planned(graph, strategy, budget);
        s.memory.check().unwrap();
        let (outs, peak) = measured(graph, &plan, &s, inputs);
        assert_eq!(
            peak,
            s.memory.run_peak_bytes(),
            "{name} ({}): measured {peak} bytes, predicted {}\n{}",
            s.schedule.chosen,
            s.memory.run_peak_bytes(),
            s.memory.describe(graph)
        );
        assert_eq!(bits(&outs), bits(&reference), "{name} changed the values");
        peaks.push((name, peak));
    }
    peaks
}

#[test]
fn sliced_attention_with_and_without_the_strict_hint() {
    let _lock = allocator();
    let inputs: Vec<Tensor> = (0..3)
        .map(|i| randn(&[2, 4, 32, 8], DType::F32, i))
        .collect();
    let plain = traced("attention", &inputs, |a| {
        vec![sliced_attention(&a[0], &a[1], &a[2], 8)]
    });
    let peaks = check_graph(&plain, &inputs);
    eprintln!("sliced attention peaks: {peaks:?}");
    let hinted = traced("attention", &inputs, |a| {
        let hint = r#"{"order": "strict", "group_id": 0}"#;
        vec![hinted_context(
            |a: &[Tensor]| sliced_attention(&a[0], &a[1], &a[2], 8),
            a,
            hint,
        )
        .unwrap()]
    });
    check_graph(&hinted, &inputs);
}

/// Fused chains (in place), softmax of a transposed view (scratch), an
/// output that is a view of an intermediate, a dead-end side output.
fn mlp(a: &[Tensor]) -> Vec<Tensor> {
    // The bias and gelu are the matmul's epilogue; the chain after the
    // softmax over dim 0 (an extern kernel) overwrites its output in place.
    let h = (a[0].matmul(&a[1]) + &a[2]).gelu();
    let g = (&h.softmax(0) * 2.0).tanh() + 1.0;
    let p = g.t().softmax(-1);
    let flat = p.reshape(&[-1]);
    // Summed over dim 0: a sum along the last dim would take the chains
    // into one row kernel (which writes no input in place).
    vec![flat, (g.exp() - 1.0).sum(&[0], false)]
}

#[test]
fn a_small_mlp_with_views_scratch_and_in_place() {
    let _lock = allocator();
    // 12 rows: the softmax of the transpose is over rows of 12, too short
    // for a fused row kernel, so the softmax kernel copies (scratch).
    let inputs = [
        randn(&[12, 32], DType::F32, 3),
        randn(&[32, 24], DType::F32, 4),
        randn(&[24], DType::F32, 5),
    ];
    let g = traced("mlp", &inputs, mlp);
    let (plan, s) = planned(&g, Strategy::Strict, None);
    assert!(
        !s.memory.donations.is_empty(),
        "the elementwise chains run in place"
    );
    assert!(
        (0..plan.kernels.len()).any(|k| s.memory.scratch_bytes(k) > 0),
        "softmax of a transpose copies"
    );
    let output = g.outputs[0].node;
    assert!(
        s.memory.buffers.iter().all(|b| b.value != Some(output)),
        "the reshape is a view, not a buffer"
    );
    check_graph(&g, &inputs);
}

/// The forward and backward graphs of `g` (AOT, saving all), each checked
/// as `check_graph` does; the backward is fed the forward's saved values
/// and tangents of ones. Returns the two graphs.
fn check_forward_and_backward(g: &Graph, inputs: &[Tensor]) -> (Graph, Graph) {
    let wrt: Vec<usize> = (0..inputs.len()).collect();
    let aot = aot_autograd(g, &wrt, Partition::SaveAll).unwrap();
    let fwd = schedule_util::optimized(aot.forward);
    let plan = tessera::fusion::fuse(&fwd);
    let fwd_out: Vec<Tensor> = run_plan(&fwd, &plan, inputs)
        .unwrap()
        .into_iter()
        .map(|(_, t)| t)
        .collect();
    let mut feed: Vec<Tensor> = fwd_out[aot.num_outputs..].to_vec();
    feed.extend(
        fwd_out[..aot.num_outputs]
            .iter()
            .map(|t| Tensor::ones(t.shape(), t.dtype())),
    );
    let bwd = schedule_util::optimized(aot.backward);
    check_graph(&fwd, inputs);
    check_graph(&bwd, &feed);
    (fwd, bwd)
}

#[test]
fn the_backward_of_the_mlp() {
    let _lock = allocator();
    let inputs = [
        randn(&[16, 32], DType::F32, 6),
        randn(&[32, 24], DType::F32, 7),
        randn(&[24], DType::F32, 8),
    ];
    let g = traced("mlp", &inputs, mlp);
    check_forward_and_backward(&g, &inputs);
}

/// The seed's graphs: the sliced attention's forward and backward, plain
/// and under the seed's hint (whose backward recomputes every slice). Every
/// cat that joins the slices' outputs and the gradients' pieces copies
/// nothing: its inputs are planned within its output — k's gradient pieces
/// included, since `transpose_matmul` writes each transposed product
/// `(qᵀ·dS)ᵀ` as the dense product `dSᵀ·q`.
#[test]
fn the_seed_forward_and_backward_with_and_without_the_hint() {
    let _lock = allocator();
    let inputs: Vec<Tensor> = (0..3)
        .map(|i| randn(&[2, 4, 32, 8], DType::F32, 20 + i))
        .collect();
    for hint in [None, Some(tessera_apps::seed_table::SEED_HINT)] {
        let g = traced("attention", &inputs, |a| {
            let f = |a: &[Tensor]| sliced_attention(&a[0], &a[1], &a[2], 8);
            vec![match hint {
                Some(h) => hinted_context(f, a, h).unwrap(),
                None => f(a),
            }]
        });
        let (fwd, bwd) = check_forward_and_backward(&g, &inputs);
        for graph in [&fwd, &bwd] {
            let cats: Vec<_> = graph
                .nodes
                .iter()
                .filter(|n| n.op.name() == "cat")
                .collect();
            let of_views = cats
                .iter()
                .filter(|n| {
                    n.inputs
                        .iter()
                        .any(|x| graph.node(*x).op.name() == "permute")
                })
                .count();
            let (_, s) = planned(graph, Strategy::Strict, None);
            let joins = s.memory.joins.iter().filter(|&&j| j).count();
            assert!(
                !cats.is_empty() && of_views == 0 && joins == cats.len(),
                "{} cats ({of_views} of strided views), {joins} in place\n{graph}",
                cats.len()
            );
        }
    }
}

#[test]
fn half_precision_matmul_scratch() {
    let _lock = allocator();
    let inputs = [
        randn(&[8, 16], DType::BF16, 9),
        randn(&[16, 8], DType::BF16, 10),
    ];
    let g = traced("bf16", &inputs, |a| {
        let x = a[0].matmul(&a[1]);
        let y = a[1].matmul(&a[0]);
        vec![x.matmul(&x), y]
    });
    let (plan, s) = planned(&g, Strategy::Bfs, None);
    let concurrent_scratch = s.schedule.steps.iter().any(|st| {
        st.iter()
            .filter(|&&k| s.memory.scratch_bytes(k) > 0)
            .count()
            > 1
    });
    assert!(concurrent_scratch && plan.kernels.len() == 3);
    check_graph(&g, &inputs);
}

#[test]
fn reductions_that_copy_a_strided_input() {
    let _lock = allocator();
    // Over dim 0 of [12, 4] (and dim 1 of its transpose): the reduced dim
    // is strided and the kept rows are short, so the kernel folds a dense
    // copy (scratch); over dim 0 of the transpose it folds in place. (Rows
    // of 12 are too short for a fused row kernel, which would load the
    // strided rows directly.)
    let inputs = [randn(&[12, 4], DType::F32, 12)];
    let g = traced("reduce", &inputs, |a| {
        let e = a[0].exp();
        vec![
            e.sum(&[0], true),
            e.t().sum(&[1], false),
            e.max(&[0], false),
            e.t().sum(&[0], false),
        ]
    });
    let (plan, s) = planned(&g, Strategy::Bfs, None);
    let with_scratch = (0..plan.kernels.len())
        .filter(|&k| s.memory.scratch_bytes(k) > 0)
        .count();
    assert_eq!(with_scratch, 3, "{}", s.memory.describe(&g));
    check_graph(&g, &inputs);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    #[test]
    fn random_graphs_predicted_peak_is_measured(
        codes in prop::collection::vec(0u8..7, 1..10),
        hinted in prop::collection::vec(any::<bool>(), 10),
    ) {
        let _lock = allocator();
        let g = random_graph(&codes, &hinted, 6);
        let mut rng = Generator::new(11);
        let inputs = [
            Tensor::randn(&[6, 6], DType::F32, &mut rng),
            Tensor::randn(&[6, 6], DType::F32, &mut rng),
        ];
        check_graph(&g, &inputs);
    }
}

/// Matmul row kernels: a product handed to its row kernel by blocks of
/// rows allocates nothing but the row kernel's outputs; one whose row
/// kernel computes in f64 (an f64 operand) is made whole, as the kernel's
/// scratch.
#[test]
fn matmul_row_kernels_blocked_and_whole() {
    let _lock = allocator();
    let inputs = [
        randn(&[2, 40, 16], DType::F32, 1),
        randn(&[2, 40, 16], DType::F32, 2),
        randn(&[40], DType::F64, 3),
    ];
    let g = traced("fed", &inputs, |a| {
        let s = a[0].matmul(&a[1].transpose(-2, -1));
        let t = a[1].matmul(&a[0].transpose(-2, -1));
        vec![s.softmax(-1), (t.cast(DType::F64) * &a[2]).softmax(-1)]
    });
    let (plan, s) = planned(&g, Strategy::Bfs, None);
    let mut scratch: Vec<usize> = (0..plan.kernels.len())
        .filter(|&k| matches!(plan.kernels[k], Kernel::MatmulRows { .. }))
        .map(|k| s.memory.scratch_bytes(k))
        .collect();
    scratch.sort_unstable();
    assert_eq!(scratch, [0, 2 * 40 * 40 * 4], "{}", describe(&g, &plan));
    check_graph(&g, &inputs);
}

/// Two products of one row kernel that do not split into the same blocks
/// of rows (the second's right operand is shared by the batch, which
/// folds the batch into its rows): both are made whole, one after the
/// other in the kernel's scratch.
#[test]
fn a_matmul_row_kernel_with_products_split_differently() {
    let _lock = allocator();
    let inputs = [
        randn(&[2, 40, 16], DType::F32, 4),
        randn(&[2, 40, 16], DType::F32, 5),
        randn(&[40, 16], DType::F32, 6),
    ];
    let g = traced("unlike", &inputs, |a| {
        let shared = a[0].matmul(&a[2].transpose(-2, -1));
        vec![a[0].matmul(&a[1].transpose(-2, -1)).softmax(-1) * shared]
    });
    let (plan, s) = planned(&g, Strategy::Bfs, None);
    let fed: Vec<usize> = (0..plan.kernels.len())
        .filter(|&k| matches!(&plan.kernels[k], Kernel::MatmulRows { matmuls, .. } if matmuls.len() == 2))
        .collect();
    assert_eq!(fed.len(), 1, "{}", describe(&g, &plan));
    assert_eq!(s.memory.scratch_bytes(fed[0]), 2 * (2 * 40 * 40 * 4));
    check_graph(&g, &inputs);
}

/// A fused kernel with two outputs whose input is a reshape view of an
/// intermediate that dies there (the local-response-normalisation shape):
/// the plan writes an output over the intermediate's buffer, and the
/// donation names the value the kernel reads — the view — so the executor
/// hands it over instead of allocating the output in another output's
/// slot (issue 15, defect 2: later kernels overwrote `y`).
#[test]
fn in_place_write_through_a_reshape_view() {
    let _lock = allocator();
    let inputs = vec![
        randn(&[8, 5], DType::F32, 1),
        randn(&[5, 6], DType::F32, 2),
        randn(&[1, 8], DType::F32, 3),
        randn(&[8, 8], DType::F32, 4),
    ];
    let graph = traced("reshape_in_place", &inputs, |a| {
        let y = a[0].matmul(&a[1]).reshape(&[6, 8]).relu();
        let s = (&y * &y).sum(&[1], true);
        let m = s.matmul(&a[2]);
        vec![(m.exp().matmul(&a[3]) + &y) * &m]
    });
    check_graph(&graph, &inputs);
    let (_, s) = planned(&graph, Strategy::Bfs, None);
    let reshape = graph
        .nodes
        .iter()
        .position(|n| n.op.name() == "reshape")
        .map(|i| tessera::ir::NodeId(i as u32))
        .expect("the graph reshapes");
    assert!(
        s.memory.donations.iter().any(|d| d.input == reshape),
        "the relu is written over the reshaped buffer, read through the view: {:?}\n{}",
        s.memory.donations,
        s.memory.describe(&graph)
    );
}

/// `index_add` and `scatter_add` read a strided index or source through a
/// dense copy: the kernel's scratch, planned and measured, instead of a
/// `Vec` the allocator never saw. Contiguous ones are read in place (no
/// copy at all).
#[test]
fn scatter_kernels_count_their_copies_of_strided_inputs() {
    let _lock = allocator();
    let inputs = [
        randn(&[6, 4], DType::F32, 21),
        randn(&[4, 3], DType::F32, 22),
        Tensor::from_vec(vec![5i64, 0, 2, 4, 1, 3], &[6]),
        Tensor::from_vec((0..12).map(|i| i % 6).collect::<Vec<i64>>(), &[4, 3]),
    ];
    let g = traced("scatter", &inputs, |a| {
        let base = a[0].exp();
        // A strided index ([5, 2, 1]) and a transposed source.
        let idx = a[2].slice(0, 0, 6, 2);
        let src = a[1].exp().t();
        vec![
            base.index_add(0, &idx, &src),
            base.scatter_add(0, &a[3].t(), &src),
            base.index_add(0, &idx.contiguous(), &src.contiguous()),
        ]
    });
    let (plan, s) = planned(&g, Strategy::Bfs, None);
    let scratch: Vec<usize> = (0..plan.kernels.len())
        .map(|k| s.memory.scratch_bytes(k))
        .filter(|&b| b > 0)
        .collect();
    // index_add: the index (3 i64) and the source (12 f32), each piece
    // 64-byte aligned; scatter_add: its index and source (12 of each).
    assert_eq!(
        scratch,
        vec![64 + 64, 128 + 64],
        "{}",
        s.memory.describe(&g)
    );
    check_graph(&g, &inputs);
}
