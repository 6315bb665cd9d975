//! The hints that trade speed for memory beyond `order` and `group_id`
//! (issue 20): `max_width` (bounded parallelism), `slice` (the compiler
//! slices a region), `offload` (saved activations wait in host memory).
//! Each changes the schedule or the memory plan as documented, and leaves
//! values and gradients as the unhinted run computes them. Every test
//! takes [`ALLOCATOR`]: some measure the allocator's global counters.

mod schedule_util;

use schedule_util::{assert_valid, planned, traced};
use tessera::compile::compile;
use tessera::hints::{self, Hint};
use tessera::ir::Graph;
use tessera::schedule::Strategy;
use tessera::tensor::Generator;
use tessera::{DType, Tensor};

/// The runs that measure the allocator take this (the counters are global).
static ALLOCATOR: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn allocator() -> std::sync::MutexGuard<'static, ()> {
    ALLOCATOR.lock().unwrap_or_else(|e| e.into_inner())
}

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
        .filter(|&k| {
            graph
                .node(plan.kernels[k].members()[0])
                .meta
                .hints
                .is_some()
        })
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
    assert!(
        region.len() >= 2 * CHAINS,
        "{} region kernels",
        region.len()
    );
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
    let _lock = allocator();
    let (order, widest, peak) = region_order(Some(1), "bfs");
    assert_eq!(widest, 1);
    let (dfs, dfs_widest, dfs_peak) = region_order(None, "dfs");
    assert_eq!(dfs_widest, 1);
    assert_eq!(order, dfs, "K = 1 is the region in dfs order");
    assert_eq!(peak, dfs_peak);
}

#[test]
fn a_wide_max_width_is_bfs() {
    let _lock = allocator();
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
    let _lock = allocator();
    let mut peaks = Vec::new();
    for k in [1, 2, 3, CHAINS] {
        let (order, widest, peak) = region_order(Some(k), "bfs");
        assert!(
            widest <= k,
            "max_width {k}: {widest} region kernels in a step"
        );
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
    let _lock = allocator();
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
    let _lock = allocator();
    let inputs = [randn(&[32, 32], 1), randn(&[32, 32], 2)];
    let plain = compile(chains_fn(None)).call(&inputs).remove(0);
    for k in [1, 2, 4] {
        let hinted = compile(chains_fn(Some(Hint::bfs().max_width(k))))
            .call(&inputs)
            .remove(0);
        assert!(max_diff(&plain, &hinted) == 0.0, "max_width {k}");
    }
}

// -------------------------------------------------------------------- slice

/// (B, H, N, D) of the attention tests: B·H = 8 slices at most.
const ATT: [usize; 4] = [2, 4, 64, 16];

fn naive(a: &[Tensor]) -> Tensor {
    schedule_util::sliced_attention(&a[0], &a[1], &a[2], 1)
}

fn slice_hint(parts: usize) -> String {
    format!(r#"{{"order": "strict", "slice": {{"dim": 0, "parts": {parts}}}}}"#)
}

/// The seed's naive attention under `hint` (none: unhinted).
fn attention_fn(hint: Option<String>) -> impl Fn(&[Tensor]) -> Vec<Tensor> + Clone {
    move |a: &[Tensor]| match &hint {
        Some(h) => vec![hints::scope(h, || naive(a)).unwrap()],
        None => vec![naive(a)],
    }
}

fn attention_inputs(dtype: DType) -> Vec<Tensor> {
    let mut g = Generator::new(7);
    (0..3).map(|_| Tensor::randn(&ATT, dtype, &mut g)).collect()
}

fn attention_graph(hint: Option<String>) -> Graph {
    traced(
        "attention",
        &attention_inputs(DType::F32),
        attention_fn(hint),
    )
}

fn count(graph: &Graph, op: &str) -> usize {
    graph.nodes.iter().filter(|n| n.op.name() == op).count()
}

/// The output and the three gradients of a compiled forward + backward.
fn forward_backward(f: impl Fn(&[Tensor]) -> Vec<Tensor> + Clone + 'static) -> Vec<Tensor> {
    let compiled = compile(f);
    let inputs: Vec<Tensor> = attention_inputs(DType::F64)
        .iter()
        .map(|t| t.set_requires_grad(true))
        .collect();
    let out = compiled.call(&inputs).remove(0);
    let grad = Tensor::randn(&ATT, DType::F64, &mut Generator::new(9));
    out.backward_with(&grad);
    let mut results = vec![out.detach()];
    results.extend(inputs.iter().map(|t| t.grad().unwrap()));
    results
}

#[test]
fn the_number_of_slices_is_the_knob() {
    let _lock = allocator();
    assert_eq!(count(&attention_graph(None), "softmax"), 1);
    for parts in [2, 3, 8] {
        let g = attention_graph(Some(slice_hint(parts)));
        assert_eq!(count(&g, "softmax"), parts, "{g}");
        assert!(
            g.nodes.iter().all(|n| n
                .meta
                .hints
                .as_ref()
                .is_none_or(|h| !h.contains_key("slice"))),
            "the slice key is consumed"
        );
    }
}

#[test]
fn sliced_values_and_gradients_equal_the_unhinted_run() {
    let _lock = allocator();
    let plain = forward_backward(attention_fn(None));
    // 3 does not divide B·H = 8: slices of 3, 3 and 2.
    for parts in [2, 3, 8] {
        let sliced = forward_backward(attention_fn(Some(slice_hint(parts))));
        for (i, (a, b)) in plain.iter().zip(&sliced).enumerate() {
            let d = max_diff(a, b);
            assert!(d < 1e-12, "{parts} parts, result {i}: differs by {d}");
        }
    }
}

/// Predicted peaks of the forward graph and of the AOT backward graph.
fn peaks(graph: &Graph) -> (usize, usize) {
    let (_, fwd) = planned(graph, Strategy::Bfs, None);
    let aot =
        tessera::autograd::aot_autograd(graph, &[0, 1, 2], tessera::autograd::Partition::SaveAll)
            .unwrap();
    let bwd = schedule_util::optimized(aot.backward);
    let (_, b) = planned(&bwd, Strategy::Bfs, None);
    (fwd.memory.peak_bytes, b.memory.peak_bytes)
}

#[test]
fn the_peak_falls_with_the_number_of_slices_to_the_hand_sliced_one() {
    let _lock = allocator();
    let mut seen = Vec::new();
    for parts in [1, 2, 4, 8] {
        seen.push((parts, peaks(&attention_graph(Some(slice_hint(parts))))));
    }
    eprintln!("slices → (forward peak, backward peak): {seen:?}");
    for w in seen.windows(2) {
        assert!(w[1].1 .0 < w[0].1 .0, "forward: {seen:?}");
        assert!(w[1].1 .1 < w[0].1 .1, "backward: {seen:?}");
    }
    // As the seed's hand-sliced code under its hint.
    let hand = traced("hand", &attention_inputs(DType::F32), |a| {
        vec![hints::scope(r#"{"order": "strict"}"#, || {
            schedule_util::sliced_attention(&a[0], &a[1], &a[2], 8)
        })
        .unwrap()]
    });
    let (hand_fwd, hand_bwd) = peaks(&hand);
    let (fwd, bwd) = seen[3].1;
    eprintln!("hand-sliced: forward {hand_fwd}, backward {hand_bwd}");
    assert!(fwd * 10 <= hand_fwd * 11, "{fwd} vs hand-sliced {hand_fwd}");
    assert!(bwd * 10 <= hand_bwd * 11, "{bwd} vs hand-sliced {hand_bwd}");
}

#[test]
fn more_parts_than_elements_are_refused_clearly() {
    let _lock = allocator();
    let g = attention_graph(Some(slice_hint(100)));
    assert_eq!(count(&g, "softmax"), 1);
    let said = hints::not_honoured_messages();
    assert!(
        said.iter()
            .any(|m| m.contains("slice pass") && m.contains("100 parts of a dim of 8 elements")),
        "{said:?}"
    );
}

#[test]
fn a_softmax_along_the_sliced_dim_is_refused_naming_the_op() {
    let _lock = allocator();
    let g = traced("along", &[randn(&[8, 4], 3)], |a| {
        let h = r#"{"slice": {"dim": 0, "parts": 2}}"#;
        vec![hints::scope(h, || a[0].softmax(0).exp()).unwrap()]
    });
    assert_eq!(count(&g, "softmax"), 1);
    let said = hints::not_honoured_messages();
    assert!(
        said.iter()
            .any(|m| m.contains("`softmax`") && m.contains("normalises along dim 0")),
        "{said:?}"
    );
}

#[test]
fn a_row_sliced_mlp_reads_its_weights_whole() {
    let _lock = allocator();
    // x [8, 16] @ w [16, 32]: rows of x sliced, w whole; the bias
    // broadcasts. Values equal the unhinted run.
    let f = |hint: Option<&'static str>| {
        move |a: &[Tensor]| {
            let body = || (a[0].matmul(&a[1]) + &a[2]).relu().sum(&[1], false);
            vec![match hint {
                Some(h) => hints::scope(h, body).unwrap(),
                None => body(),
            }]
        }
    };
    let inputs = [randn(&[8, 16], 4), randn(&[16, 32], 5), randn(&[32], 6)];
    let g = traced(
        "mlp",
        &inputs,
        f(Some(r#"{"slice": {"dim": 0, "parts": 4}}"#)),
    );
    assert_eq!(count(&g, "matmul"), 4, "{g}");
    let plain = compile(f(None)).call(&inputs).remove(0);
    let sliced = compile(f(Some(r#"{"slice": {"dim": 0, "parts": 4}}"#)))
        .call(&inputs)
        .remove(0);
    assert!(max_diff(&plain, &sliced) < 1e-5);
}

// ------------------------------------------------------------------ offload

const WIDTH: usize = 128;
const LAYERS: usize = 4;

/// `LAYERS` layers of `tanh(h @ w)` under `hint`: each saves a
/// `WIDTH`×`WIDTH` activation for the backward.
fn layers_fn(hint: Option<&'static str>) -> impl Fn(&[Tensor]) -> Vec<Tensor> + Clone {
    move |a: &[Tensor]| {
        let body = || {
            let mut h = a[0].clone();
            for w in &a[1..] {
                h = h.matmul(w).tanh();
            }
            h
        };
        vec![match hint {
            Some(hint) => hints::scope(hint, body).unwrap(),
            None => body(),
        }]
    }
}

fn layer_inputs() -> Vec<Tensor> {
    (0..=LAYERS as u64)
        .map(|i| &randn(&[WIDTH, WIDTH], 20 + i) * 0.1)
        .collect()
}

/// One compiled forward + backward: the output and gradients, and the
/// device (allocator) and host-pool peaks above what was live before.
fn measured_step<F: Fn(&[Tensor]) -> Vec<Tensor> + Clone + 'static>(
    compiled: &tessera::compile::Compiled<F>,
) -> (Vec<Tensor>, usize, usize) {
    use tessera::runtime::cpu::{host_memory_stats, memory_stats, reset_peak};
    let inputs: Vec<Tensor> = layer_inputs()
        .iter()
        .map(|t| t.set_requires_grad(true))
        .collect();
    let grad = randn(&[WIDTH, WIDTH], 40);
    let step = || {
        let out = compiled.call(&inputs).remove(0);
        out.backward_with(&grad);
        out.detach()
    };
    drop(step()); // compiles
    for t in &inputs {
        t.zero_grad();
    }
    let (before, host_before) = (memory_stats().live_bytes, host_memory_stats().live_bytes);
    reset_peak();
    let out = step();
    let peak = memory_stats().peak_bytes - before;
    let host = host_memory_stats().peak_bytes - host_before;
    let mut results = vec![out];
    results.extend(inputs.iter().map(|t| t.grad().unwrap()));
    (results, peak, host)
}

#[test]
fn offloaded_activations_leave_the_device_and_the_values_stay() {
    let _lock = allocator();
    // In program order (as the seed's strict hint), so that the backward
    // brings each activation back just before it needs it; strict alone
    // would recompute instead, so the baseline keeps its activations.
    let kept = r#"{"order": "strict", "recompute": false}"#;
    let (plain, plain_peak, plain_host) = measured_step(&compile(layers_fn(Some(kept))));
    let offload = r#"{"order": "strict", "offload": true}"#;
    let (moved, peak, host) = measured_step(&compile(layers_fn(Some(offload))));
    eprintln!("device peak {plain_peak} → {peak} bytes, host pool {plain_host} → {host} bytes");
    for (i, (a, b)) in plain.iter().zip(&moved).enumerate() {
        assert_eq!(a.to_f64_vec(), b.to_f64_vec(), "result {i}");
    }
    let activation = WIDTH * WIDTH * 4;
    assert_eq!(plain_host, 0);
    assert!(host >= (LAYERS - 1) * activation, "host pool peak {host}");
    assert!(
        peak + 2 * activation <= plain_peak,
        "device peak {peak} vs {plain_peak} without offload"
    );
}

#[test]
fn the_memory_plans_list_the_moves_and_account_both_spaces() {
    let _lock = allocator();
    use tessera::autograd::{aot_autograd, Partition};
    use tessera::schedule::{build_moving, Donations, Moves, ScheduleOptions};
    let g = traced(
        "layers",
        &layer_inputs(),
        layers_fn(Some(r#"{"offload": true}"#)),
    );
    let aot = aot_autograd(&g, &[0, 1, 2, 3, 4], Partition::SaveAll).unwrap();
    assert!(aot.offloaded.len() >= LAYERS - 1, "{:?}", aot.offloaded);
    assert!(aot.offloaded.iter().all(|i| aot.offloadable.contains(i)));
    let plan_of = |graph: &Graph, moves: &Moves| {
        let plan = tessera::fusion::fuse(graph);
        build_moving(
            graph,
            &plan,
            &ScheduleOptions::default(),
            &Donations::default(),
            moves,
        )
        .unwrap()
        .memory
    };
    let fwd = &aot.forward;
    let offload = Moves {
        offload: aot
            .offloaded
            .iter()
            .map(|&i| fwd.outputs[aot.num_outputs + i].node)
            .collect(),
        prefetch: Vec::new(),
    };
    let (kept, moved) = (plan_of(fwd, &Moves::default()), plan_of(fwd, &offload));
    // Saved views (the transposes a matmul's backward reads) stay: each
    // has a note saying why.
    assert!(moved.offloads.len() >= LAYERS - 1, "{:?}", moved.offloads);
    assert_eq!(
        moved.offloads.len() + moved.move_notes.len(),
        aot.offloaded.len(),
        "{:?}",
        moved.move_notes
    );
    assert_eq!(kept.host_bytes, 0);
    assert_eq!(
        moved.host_bytes,
        moved.offloads.iter().map(|m| m.bytes).sum::<usize>()
    );
    assert!(
        moved.peak_bytes < kept.peak_bytes,
        "{} vs {}",
        moved.peak_bytes,
        kept.peak_bytes
    );
    assert!(moved.run_peak_bytes() < kept.run_peak_bytes());
    let text = moved.describe(fwd);
    assert!(
        text.contains("host bytes") && text.contains("offload "),
        "{text}"
    );
    let bwd = &aot.backward;
    let prefetch = Moves {
        offload: Vec::new(),
        prefetch: aot.offloaded.iter().map(|&i| bwd.inputs[i]).collect(),
    };
    let back = plan_of(bwd, &prefetch);
    assert!(back.prefetches.len() >= LAYERS - 1);
    assert_eq!(
        back.prefetches.len() + back.move_notes.len(),
        aot.offloaded.len()
    );
    // Each prefetch comes before a step that reads it, in order.
    assert!(back.prefetches.windows(2).all(|w| w[0].step <= w[1].step));
}

#[test]
fn a_budget_no_order_meets_offloads_every_activation() {
    let _lock = allocator();
    let (plain, _, _) = measured_step(&compile(layers_fn(None)));
    let (moved, _, host) = measured_step(&compile(layers_fn(None)).memory_budget(1));
    assert!(
        host >= (LAYERS - 1) * WIDTH * WIDTH * 4,
        "host pool peak {host}"
    );
    for (a, b) in plain.iter().zip(&moved) {
        assert_eq!(a.to_f64_vec(), b.to_f64_vec());
    }
}

// -------------------------------------------------- what backends ignore

#[test]
fn eager_and_aot_eager_say_which_hints_they_ignore() {
    let _lock = allocator();
    use tessera::compile::Backend;
    let hint = r#"{"order": "dfs", "slice": {"dim": 0, "parts": 2}, "stream": 1, "offload": true}"#;
    let inputs = layer_inputs();
    for (backend, stage) in [
        (Backend::Eager, "eager backend"),
        (Backend::AotEager, "aot_eager backend"),
        (Backend::Default, "compiled backend"),
    ] {
        let f = compile(layers_fn(Some(hint))).backend(backend);
        let plain = compile(layers_fn(None)).backend(backend);
        assert!(max_diff(&f.call(&inputs)[0], &plain.call(&inputs)[0]) < 1e-6);
        let said = hints::not_honoured_messages();
        let says = |key: &str| {
            said.iter()
                .any(|m| m.starts_with(stage) && m.contains(&format!("hint \"{key}\"")))
        };
        assert!(says("stream"), "{stage}: {said:?}");
        match backend {
            Backend::Default => {
                // Honoured: the slice; offload needs a backward (none here).
                assert!(
                    !says("slice") && !says("order") && says("offload"),
                    "{said:?}"
                );
            }
            _ => assert!(
                says("slice") && says("order") && says("offload"),
                "{said:?}"
            ),
        }
    }
    // Known keys: no "not known" warning for stream or offload.
    let (_, warnings) = Hint::parse_with_warnings(hint).unwrap();
    assert!(warnings.is_empty(), "{warnings:?}");
}

#[test]
fn plain_eager_says_once_per_region_which_hints_it_ignores() {
    let _lock = allocator();
    let inputs = layer_inputs();
    let hint = r#"{"order": "bfs", "stream": 5, "offload": true, "group_id": 41}"#;
    let body = layers_fn(Some(hint));
    let plain = layers_fn(None)(&inputs);
    for _ in 0..3 {
        let out = body(&inputs);
        assert_eq!(out[0].to_f64_vec(), plain[0].to_f64_vec());
    }
    let said: Vec<String> = hints::not_honoured_messages()
        .into_iter()
        .filter(|m| m.starts_with("eager:") && m.contains("\"group_id\":41"))
        .collect();
    for key in ["order", "stream", "offload", "group_id"] {
        let n = said
            .iter()
            .filter(|m| m.contains(&format!("hint \"{key}\"")))
            .count();
        assert_eq!(n, 1, "{key}: {said:?}");
    }
}
