//! The hints that trade speed for memory beyond `order` and `group_id`
//! (issue 20): `max_width` (bounded parallelism), `slice` (the compiler
//! slices a region), `offload` (saved activations wait in host memory).
//! Each changes the schedule or the memory plan as documented, and leaves
//! values and gradients as the unhinted run computes them.

mod schedule_util;

use schedule_util::{assert_valid, planned, traced};
use tessera::compile::compile;
use tessera::hints::{self, Hint};
use tessera::ir::Graph;
use tessera::schedule::Strategy;
use tessera::tensor::Generator;
use tessera::{DType, Tensor};

fn randn(shape: &[usize], seed: u64) -> Tensor {
    Tensor::randn(shape, DType::F32, &mut Generator::new(seed))
}

/// Largest absolute difference of two tensors' values.
fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.shape(), b.shape());
    a.to_f64_vec()
        .iter()
        .zip(b.to_f64_vec())
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

// ---------------------------------------------------------------- max_width

const CHAINS: usize = 6;

/// `CHAINS` independent chains (matmul → softmax → matmul) under `region`,
/// summed outside it.
fn chains_fn(region: Option<Hint>) -> impl Fn(&[Tensor]) -> Vec<Tensor> + Clone {
    move |a: &[Tensor]| {
        let body = || {
            (0..CHAINS)
                .map(|i| {
                    let x = &a[0] * (i as f64 + 1.0);
                    x.matmul(&a[1]).softmax(-1).matmul(&a[0])
                })
                .collect::<Vec<_>>()
        };
        let outs = match &region {
            Some(h) => hints::scope(h, body).unwrap(),
            None => body(),
        };
        let mut sum = outs[0].clone();
        for o in &outs[1..] {
            sum = sum + o;
        }
        vec![sum]
    }
}

fn chains_graph(region: Option<Hint>) -> Graph {
    traced(
        "chains",
        &[randn(&[32, 32], 1), randn(&[32, 32], 2)],
        chains_fn(region),
    )
}

fn region_kernels(graph: &Graph, plan: &tessera::fusion::Plan) -> Vec<usize> {
    (0..plan.kernels.len())
        .filter(|&k| graph.node(plan.kernels[k].members()[0]).meta.hints.is_some())
        .collect()
}

/// The region's kernels in execution order, and the most of them in a step.
fn region_order(width: Option<usize>, order: &str) -> (Vec<usize>, usize, usize) {
    let mut hint = Hint::parse(&format!(r#"{{"order": "{order}"}}"#)).unwrap();
    hint.max_width = width;
    let g = chains_graph(Some(hint));
    let (plan, s) = planned(&g, Strategy::Bfs, None);
    assert_valid(&g, &plan, &s.schedule.steps);
    let region = region_kernels(&g, &plan);
    assert!(region.len() >= 2 * CHAINS, "{} region kernels", region.len());
    let order: Vec<usize> = s
        .schedule
        .order()
        .into_iter()
        .filter(|k| region.contains(k))
        .collect();
    let widest = s
        .schedule
        .steps
        .iter()
        .map(|st| st.iter().filter(|k| region.contains(k)).count())
        .max()
        .unwrap();
    (order, widest, s.memory.peak_bytes)
}

#[test]
fn max_width_one_runs_the_region_in_dfs_order() {
    let (order, widest, peak) = region_order(Some(1), "bfs");
    assert_eq!(widest, 1);
    let (dfs, dfs_widest, dfs_peak) = region_order(None, "dfs");
    assert_eq!(dfs_widest, 1);
    assert_eq!(order, dfs, "K = 1 is the region in dfs order");
    assert_eq!(peak, dfs_peak);
}

#[test]
fn a_wide_max_width_is_bfs() {
    let g = |width| {
        let mut hint = Hint::bfs();
        hint.max_width = width;
        let g = chains_graph(Some(hint));
        let (_, s) = planned(&g, Strategy::Bfs, None);
        (s.schedule.steps, s.memory.peak_bytes)
    };
    let (bfs_steps, bfs_peak) = g(None);
    assert_eq!(g(Some(CHAINS)), (bfs_steps.clone(), bfs_peak));
    assert_eq!(g(Some(100)), (bfs_steps, bfs_peak));
}

#[test]
fn max_width_bounds_each_step_and_the_peak_grows_with_it() {
    let mut peaks = Vec::new();
    for k in [1, 2, 3, CHAINS] {
        let (order, widest, peak) = region_order(Some(k), "bfs");
        assert!(widest <= k, "max_width {k}: {widest} region kernels in a step");
        assert!(!order.is_empty());
        peaks.push((k, peak));
    }
    let (_, widest, _) = region_order(Some(2), "bfs");
    assert_eq!(widest, 2, "two chains in flight at once");
    eprintln!("max_width → predicted peak: {peaks:?}");
    assert!(
        peaks.windows(2).all(|w| w[0].1 <= w[1].1),
        "the peak does not grow with the width: {peaks:?}"
    );
    assert!(peaks[0].1 < peaks[3].1, "{peaks:?}");
}

#[test]
fn max_width_under_a_budget_coarsens_no_wider() {
    let mut hint = Hint::bfs();
    hint.max_width = Some(2);
    let g = chains_graph(Some(hint));
    let (plan, s) = planned(&g, Strategy::Auto, Some(1 << 30));
    assert_valid(&g, &plan, &s.schedule.steps);
    let region = region_kernels(&g, &plan);
    for step in &s.schedule.steps {
        assert!(step.iter().filter(|k| region.contains(k)).count() <= 2);
    }
}

#[test]
fn max_width_keeps_the_values() {
    let inputs = [randn(&[32, 32], 1), randn(&[32, 32], 2)];
    let plain = compile(chains_fn(None)).call(&inputs).remove(0);
    for k in [1, 2, 4] {
        let hinted = compile(chains_fn(Some(Hint::bfs().max_width(k))))
            .call(&inputs)
            .remove(0);
        assert!(max_diff(&plain, &hinted) == 0.0, "max_width {k}");
    }
}
