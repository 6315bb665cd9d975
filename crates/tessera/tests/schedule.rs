//! Hints from the user's code to the scheduler: they survive tracing, the
//! pass pipeline and AOT autograd; the orders honour them (strict regions in
//! program order, groups contiguous, bfs steps after their producers); a
//! hint that cannot be honoured says why; budgets choose what fits. And the
//! seed's point: the sliced attention hinted `strict` needs far less memory
//! than `bfs`, which runs every slice's scores at once.

mod schedule_util;

use proptest::prelude::*;
use schedule_util::{
    assert_valid, optimized, planned, producers, random_graph, sliced_attention, traced,
};
use serde_json::Value;
use tessera::autograd::{aot_autograd, Partition};
use tessera::fusion::{fuse, Kernel};
use tessera::hints::{self, hinted_context, Hint};
use tessera::ir::Graph;
use tessera::schedule::{self, ScheduleOptions, Strategy};
use tessera::tensor::Generator;
use tessera::{DType, Tensor};

fn randn(shape: &[usize], seed: u64) -> Tensor {
    Tensor::randn(shape, DType::F32, &mut Generator::new(seed))
}

fn hint_of(graph: &Graph, op: &str) -> Vec<Option<Hint>> {
    graph
        .nodes
        .iter()
        .filter(|n| n.op.name() == op)
        .map(|n| n.meta.hints.as_ref().map(|m| Hint::from_map(m).unwrap().0))
        .collect()
}

/// `exp` outside, `tanh` and `sum` inside a strict group, `+ 1` outside.
fn region_fn(a: &[Tensor]) -> Vec<Tensor> {
    let y = a[0].exp();
    let inside = hinted_context(
        |y: &Tensor| (y * 2.0).tanh().sum(&[-1], false),
        &y,
        r#"{"order": "strict", "group_id": 0, "backward_group_id": 1}"#,
    )
    .unwrap();
    vec![inside + 1.0]
}

#[test]
fn hints_survive_trace_and_passes() {
    let g = traced("region", &[randn(&[4, 8], 0)], region_fn);
    let want = Some(Hint::strict().group(0).backward_group(1));
    assert_eq!(hint_of(&g, "exp"), vec![None]);
    assert_eq!(hint_of(&g, "tanh"), vec![want.clone()]);
    assert_eq!(hint_of(&g, "sum"), vec![want]);
    // `+ 1` is the only add left after the passes, and it is outside.
    assert_eq!(hint_of(&g, "add"), vec![None]);
}

#[test]
fn nested_scopes_merge_in_traced_nodes() {
    let g = traced("nested", &[randn(&[4, 8], 1)], |a| {
        hints::scope(Hint::strict().group(3), || {
            let t = a[0].tanh();
            let e = hints::scope(r#"{"schedule_policy": "dfs"}"#, || t.exp()).unwrap();
            vec![e.sigmoid()]
        })
        .unwrap()
    });
    assert_eq!(hint_of(&g, "tanh"), vec![Some(Hint::strict().group(3))]);
    assert_eq!(hint_of(&g, "exp"), vec![Some(Hint::dfs().group(3))]);
    assert_eq!(hint_of(&g, "sigmoid"), vec![Some(Hint::strict().group(3))]);
}

#[test]
fn backward_nodes_inherit_the_forward_hints() {
    let g = traced("region", &[randn(&[4, 8], 2)], region_fn);
    let aot = aot_autograd(&g, &[0], Partition::SaveAll).unwrap();
    let fwd = Hint::strict().group(0).backward_group(1);
    let bwd = Hint::strict().group(1).backward_group(1);
    let forward_hints: Vec<Option<Hint>> = hint_of(&aot.forward, "tanh");
    assert_eq!(forward_hints, vec![Some(fwd.clone())]);
    // The backward of tanh (1 - t²) and of sum (an expand) are the region's
    // backward: group 1. The backward of exp (outside) carries no hint.
    // Constants read by the backward are copies of forward nodes (with the
    // forward's hints): only computed nodes count.
    let hinted: Vec<Hint> = aot
        .backward
        .nodes
        .iter()
        .filter(|n| !n.inputs.is_empty())
        .filter_map(|n| n.meta.hints.as_ref())
        .map(|m| Hint::from_map(m).unwrap().0)
        .collect();
    assert!(hinted.len() >= 3, "{}", aot.backward);
    assert!(hinted.iter().all(|h| *h == bwd), "{}", aot.backward);
    assert!(hint_of(&aot.backward, "expand")
        .iter()
        .all(|h| *h == Some(bwd.clone())));
    // Without backward_group_id the backward keeps the forward's group.
    let plain = traced("plain", &[randn(&[4, 8], 2)], |a| {
        vec![hinted_context(|x: &Tensor| x.tanh(), &a[0], Hint::strict().group(0)).unwrap()]
    });
    let aot = aot_autograd(&plain, &[0], Partition::SaveAll).unwrap();
    let groups: Vec<Value> = aot
        .backward
        .nodes
        .iter()
        .filter_map(|n| n.meta.hints.as_ref()?.get("group_id").cloned())
        .collect();
    assert!(!groups.is_empty() && groups.iter().all(|g| g.as_i64() == Some(0)));
}

#[test]
fn backward_hints_survive_the_compiled_backward_passes() {
    let g = traced("region", &[randn(&[4, 8], 3)], region_fn);
    let aot = aot_autograd(&g, &[0], Partition::SaveAll).unwrap();
    let bwd = optimized(aot.backward);
    let plan = fuse(&bwd);
    let groups: Vec<Option<i64>> = plan
        .kernels
        .iter()
        .map(|k| {
            let hints = &bwd.node(k.members()[0]).meta.hints;
            hints
                .as_ref()
                .map(|m| Hint::from_map(m).unwrap().0.group_id.unwrap())
        })
        .collect();
    assert!(
        groups.contains(&Some(1)) && !groups.contains(&Some(0)),
        "{groups:?}"
    );
}

/// Two independent chains (a, b) inside one region, unhinted work beside.
fn two_chains(region: Hint) -> Graph {
    traced(
        "chains",
        &[randn(&[8, 8], 4), randn(&[8, 8], 5)],
        move |a| {
            let (x, y) = hints::scope(region, || {
                let x = a[0].matmul(&a[0]).softmax(-1).matmul(&a[0]);
                let y = a[1].matmul(&a[1]).softmax(-1).matmul(&a[1]);
                (x, y)
            })
            .unwrap();
            let side = a[0].matmul(&a[1]).softmax(-1);
            vec![x + y, side]
        },
    )
}

fn kernels_with(graph: &Graph, plan: &tessera::fusion::Plan, hinted: bool) -> Vec<usize> {
    (0..plan.kernels.len())
        .filter(|&k| {
            graph
                .node(plan.kernels[k].members()[0])
                .meta
                .hints
                .is_some()
                == hinted
        })
        .collect()
}

#[test]
fn a_strict_region_runs_in_program_order_one_kernel_at_a_time() {
    let g = two_chains(Hint::strict());
    let (plan, s) = planned(&g, Strategy::Bfs, None);
    assert_valid(&g, &plan, &s.schedule.steps);
    let region = kernels_with(&g, &plan, true);
    assert!(region.len() >= 6);
    let order = s.schedule.order();
    let positions: Vec<usize> = region
        .iter()
        .map(|k| order.iter().position(|x| x == k).unwrap())
        .collect();
    assert!(
        positions.windows(2).all(|w| w[0] < w[1]),
        "region out of program order: {order:?}"
    );
    let step_of = s.schedule.step_of_kernel(plan.kernels.len());
    let mut steps: Vec<usize> = region.iter().map(|&k| step_of[k]).collect();
    steps.dedup();
    assert_eq!(steps.len(), region.len(), "two region kernels share a step");
    // The unhinted work still runs beside the region (bfs outside it).
    let side = kernels_with(&g, &plan, false);
    assert!(side.iter().any(|&k| s.schedule.steps[step_of[k]].len() > 1));
}

#[test]
fn a_group_runs_as_one_contiguous_block() {
    let g = two_chains(Hint::default().group(7));
    let (plan, s) = planned(&g, Strategy::Bfs, None);
    assert_valid(&g, &plan, &s.schedule.steps);
    let group = kernels_with(&g, &plan, true);
    let order = s.schedule.order();
    let positions: Vec<usize> = group
        .iter()
        .map(|k| order.iter().position(|x| x == k).unwrap())
        .collect();
    let (lo, hi) = (
        *positions.iter().min().unwrap(),
        *positions.iter().max().unwrap(),
    );
    assert_eq!(hi - lo + 1, group.len(), "group not contiguous: {order:?}");
    // Program order inside the group (no order hint: strict).
    assert!(positions.windows(2).all(|w| w[0] < w[1]));
    for step in &s.schedule.steps {
        let inside = step.iter().filter(|k| group.contains(k)).count();
        assert!(
            inside == 0 || inside == step.len(),
            "a step mixes the group with others"
        );
    }
    assert!(s.schedule.notes.is_empty(), "{:?}", s.schedule.notes);
}

#[test]
fn a_bfs_group_runs_its_independent_kernels_together() {
    let g = two_chains(Hint::bfs().group(1));
    let (plan, s) = planned(&g, Strategy::Strict, None);
    assert_valid(&g, &plan, &s.schedule.steps);
    let group = kernels_with(&g, &plan, true);
    assert!(s
        .schedule
        .steps
        .iter()
        .any(|st| st.len() > 1 && st.iter().all(|k| group.contains(k))));
    // Outside the group the base (strict) runs one kernel at a time.
    assert!(s
        .schedule
        .steps
        .iter()
        .all(|st| st.len() == 1 || st.iter().all(|k| group.contains(k))));
}

#[test]
fn bfs_steps_are_levels() {
    let g = two_chains(Hint::default());
    let (plan, s) = planned(&g, Strategy::Bfs, None);
    assert_valid(&g, &plan, &s.schedule.steps);
    let prods = producers(&g, &plan);
    let mut level = vec![0usize; plan.kernels.len()];
    for k in 0..level.len() {
        level[k] = prods[k].iter().map(|&p| level[p] + 1).max().unwrap_or(0);
    }
    let step_of = s.schedule.step_of_kernel(plan.kernels.len());
    assert_eq!(step_of, level);
}

#[test]
fn dfs_and_strict_run_one_kernel_at_a_time() {
    let g = two_chains(Hint::default());
    for strategy in [Strategy::Dfs, Strategy::Strict] {
        let (plan, s) = planned(&g, strategy, None);
        assert_valid(&g, &plan, &s.schedule.steps);
        assert!(s.schedule.steps.iter().all(|st| st.len() == 1));
        if strategy == Strategy::Strict {
            assert_eq!(
                s.schedule.order(),
                (0..plan.kernels.len()).collect::<Vec<_>>()
            );
        }
    }
}

#[test]
fn dfs_finishes_one_chain_before_the_next() {
    // out = a_chain @ b_chain: dfs runs all of one chain, then the other.
    // (A final add would be the epilogue of b's last matmul, one kernel
    // with a part of b's chain that needs a's.)
    let g = traced("dfs", &[randn(&[8, 8], 6), randn(&[8, 8], 7)], |a| {
        let x = a[0].matmul(&a[0]).softmax(-1).matmul(&a[0]);
        let y = a[1].matmul(&a[1]).softmax(-1).matmul(&a[1]);
        vec![x.matmul(&y)]
    });
    let (plan, s) = planned(&g, Strategy::Dfs, None);
    let order = s.schedule.order();
    let reads_input = |k: usize, i: usize| plan.kernels[k].reads(&g).contains(&g.inputs[i]);
    // Either chain may go first; they must not interleave.
    let first = |i: usize| order.iter().position(|&k| reads_input(k, i)).unwrap();
    let last = |i: usize| order.iter().rposition(|&k| reads_input(k, i)).unwrap();
    assert!(last(0) < first(1) || last(1) < first(0), "{order:?}");
}

#[test]
fn a_non_contiguous_group_is_reported() {
    // a (group 0) → b (outside) → c (group 0): the group cannot be a block.
    let g = traced("gap", &[randn(&[8, 8], 8)], |a| {
        let x = hints::scope(Hint::default().group(0), || a[0].matmul(&a[0])).unwrap();
        let y = x.softmax(-1);
        vec![hints::scope(Hint::default().group(0), || y.matmul(&y)).unwrap()]
    });
    let (plan, s) = planned(&g, Strategy::Bfs, None);
    assert_valid(&g, &plan, &s.schedule.steps);
    assert!(
        s.schedule
            .notes
            .iter()
            .any(|n| n.contains("group_id 0 not honoured") && n.contains("softmax")),
        "{:?}",
        s.schedule.notes
    );
}

#[test]
fn a_kernel_fused_from_different_groups_is_reported() {
    let mut g = traced("mixed", &[randn(&[8, 8], 9)], |a| {
        vec![hints::scope(Hint::default().group(0), || (a[0].exp() * 2.0).tanh()).unwrap()]
    });
    let plan = fuse(&g);
    let members = plan
        .kernels
        .iter()
        .find_map(|k| match k {
            Kernel::Fused { members, .. } if members.len() > 1 => Some(members.clone()),
            _ => None,
        })
        .expect("exp, mul and tanh fuse");
    // A plan made elsewhere may mix groups: move one member to group 1.
    g.nodes[members[1].index()].meta.hints =
        Some(std::sync::Arc::new(Hint::default().group(1).to_map()));
    let options = ScheduleOptions::default();
    let s = schedule::build(&g, &plan, &options).unwrap();
    assert!(
        s.schedule
            .notes
            .iter()
            .any(|n| n.contains("\"group_id\"") && n.contains("fused from nodes")),
        "{:?}",
        s.schedule.notes
    );
}

#[test]
fn crossing_orders_are_relaxed_with_a_note() {
    // Strict region A = {a1, a2}, dfs region B = {b1, b2} with b2 → a1 and
    // a2 → b1: program order says a1 before a2, dfs order b1 before b2, and
    // a1 needs b2, b1 needs a2: no order honours both.
    let g = traced("cross", &[randn(&[8, 8], 10)], |a| {
        let x = &a[0];
        let b2 = hints::scope(Hint::dfs(), || x.matmul(x)).unwrap();
        let a1 = hints::scope(Hint::strict(), || b2.softmax(-1)).unwrap();
        let a2 = hints::scope(Hint::strict(), || x.matmul(&x.t())).unwrap();
        let b1 = hints::scope(Hint::dfs(), || a2.softmax(-1)).unwrap();
        // b1 is read first, so dfs order visits b1's chain before b2's.
        vec![b1.matmul(&a1)]
    });
    let (plan, s) = planned(&g, Strategy::Bfs, None);
    assert_valid(&g, &plan, &s.schedule.steps);
    assert!(
        s.schedule.notes.iter().any(|n| n.contains("not honoured")),
        "{:?}",
        s.schedule.notes
    );
}

fn attention_inputs(seed: u64) -> Vec<Tensor> {
    (0..3).map(|i| randn(&[2, 4, 64, 8], seed + i)).collect()
}

fn attention_graph(hint: Option<&str>) -> Graph {
    let hint = hint.map(str::to_string);
    traced("attention", &attention_inputs(0), move |a| match &hint {
        Some(h) => vec![hinted_context(
            |a: &[Tensor]| sliced_attention(&a[0], &a[1], &a[2], 8),
            a,
            h,
        )
        .unwrap()],
        None => vec![sliced_attention(&a[0], &a[1], &a[2], 8)],
    })
}

#[test]
fn the_seeds_point_strict_slices_need_far_less_memory_than_bfs() {
    let score = 64 * 64 * 4;
    let bfs_graph = attention_graph(None);
    let (_, bfs) = planned(&bfs_graph, Strategy::Bfs, None);
    let strict_graph = attention_graph(Some(r#"{"order": "strict", "group_id": 0}"#));
    let (plan, strict) = planned(&strict_graph, Strategy::Bfs, None);
    assert_valid(&strict_graph, &plan, &strict.schedule.steps);
    let (b, s) = (bfs.memory.peak_bytes, strict.memory.peak_bytes);
    eprintln!(
        "sliced attention, 8 slices of 64x64 scores: bfs peak {b} bytes, strict hint {s} bytes"
    );
    // bfs holds all 8 slices' scores (and probabilities) at once; strict at
    // most two score-sized buffers besides the outputs.
    assert!(b >= 8 * score, "bfs peak {b}");
    assert!(s <= 2 * score + 2 * 2 * 4 * 64 * 8 * 4, "strict peak {s}");
    assert!(s * 3 < b, "strict {s} vs bfs {b}");
    // The strict hint on the whole graph gives the same as the strict strategy.
    let (_, strict_strategy) = planned(&bfs_graph, Strategy::Strict, None);
    assert_eq!(strict_strategy.memory.peak_bytes, s);
}

#[test]
fn auto_takes_a_peak_near_the_lowest() {
    let g = attention_graph(None);
    let peak = |s: Strategy| planned(&g, s, None).1.memory.peak_bytes;
    let auto = planned(&g, Strategy::Auto, None).1;
    let lowest = [Strategy::Bfs, Strategy::Dfs, Strategy::Strict]
        .map(peak)
        .into_iter()
        .min()
        .unwrap();
    // The memory plan of the chosen order (scratch, cats in place) may sit
    // a little above the candidates' bound; far below bfs either way.
    let got = auto.memory.peak_bytes;
    assert!(got <= 2 * lowest, "{got} vs {lowest}");
    assert!(2 * got < peak(Strategy::Bfs), "far below bfs");
    // Within that peak, independent kernels still share steps.
    assert!(auto.schedule.steps.iter().any(|st| st.len() > 1));
    assert!(
        auto.schedule.chosen.starts_with("auto: "),
        "{}",
        auto.schedule.chosen
    );
}

#[test]
fn an_auto_region_chooses_its_order() {
    let g = attention_graph(Some(r#"{"order": "auto"}"#));
    let (_, s) = planned(&g, Strategy::Bfs, None);
    assert!(
        s.schedule.notes.iter().any(|n| n.contains("chosen")),
        "{:?}",
        s.schedule.notes
    );
    let (_, bfs) = planned(&attention_graph(None), Strategy::Bfs, None);
    assert!(s.memory.peak_bytes < bfs.memory.peak_bytes);
}

#[test]
fn a_budget_that_fits_keeps_the_requested_order() {
    let g = attention_graph(None);
    let (_, bfs) = planned(&g, Strategy::Bfs, None);
    let (_, s) = planned(&g, Strategy::Bfs, Some(bfs.memory.peak_bytes));
    assert_eq!(s.schedule.steps, bfs.schedule.steps);
    assert!(s.schedule.chosen.contains("fits"), "{}", s.schedule.chosen);
    assert!(s.schedule.warnings.is_empty());
}

#[test]
fn a_tighter_budget_takes_the_most_parallel_order_that_fits() {
    let g = attention_graph(None);
    let (_, bfs) = planned(&g, Strategy::Bfs, None);
    let (_, strict) = planned(&g, Strategy::Strict, None);
    let budget = (bfs.memory.peak_bytes + strict.memory.peak_bytes) / 2;
    let (plan, s) = planned(&g, Strategy::Bfs, Some(budget));
    assert_valid(&g, &plan, &s.schedule.steps);
    assert!(
        s.memory.peak_bytes <= budget,
        "{} > {budget}",
        s.memory.peak_bytes
    );
    assert!(s.schedule.warnings.is_empty());
    // More parallel than one kernel at a time: some steps run several.
    assert!(
        s.schedule.steps.len() < plan.kernels.len(),
        "{}",
        s.schedule.chosen
    );
    assert!(
        s.schedule.chosen.starts_with("budget: "),
        "{}",
        s.schedule.chosen
    );
}

#[test]
fn a_budget_nothing_fits_takes_the_lowest_peak_and_warns() {
    let g = attention_graph(None);
    let (_, s) = planned(&g, Strategy::Bfs, Some(1));
    let lowest = [
        Strategy::Bfs,
        Strategy::Dfs,
        Strategy::Strict,
        Strategy::Auto,
    ]
    .map(|st| planned(&g, st, None).1.memory.peak_bytes)
    .into_iter()
    .min()
    .unwrap();
    assert_eq!(s.memory.peak_bytes, lowest);
    assert_eq!(s.schedule.warnings.len(), 1);
    assert!(s.schedule.warnings[0].contains("no order fits the memory budget of 1 bytes"));
}

#[test]
fn a_region_budget_makes_the_region_sequential() {
    let (_, bfs) = planned(&attention_graph(None), Strategy::Bfs, None);
    // Half of bfs's peak, in MiB.
    let mb = bfs.memory.peak_bytes as f64 / 2.0 / (1 << 20) as f64;
    let g = attention_graph(Some(&format!(r#"{{"memory_budget_mb": {mb}}}"#)));
    let (_, s) = planned(&g, Strategy::Bfs, None);
    assert!(s.memory.peak_bytes * 2 <= bfs.memory.peak_bytes);
    assert!(s.schedule.warnings.is_empty(), "{:?}", s.schedule.warnings);
}

#[test]
fn a_region_budget_its_order_cannot_meet_is_a_warning() {
    let g = attention_graph(Some(r#"{"order": "bfs", "memory_budget_mb": 0.001}"#));
    let (_, s) = planned(&g, Strategy::Bfs, None);
    assert_eq!(s.schedule.warnings.len(), 1, "{:?}", s.schedule.warnings);
    assert!(s.schedule.warnings[0].contains("memory budget of 1048 bytes exceeded"));
}

#[test]
fn symbolic_shapes_are_an_error_not_a_wrong_plan() {
    let src = "graph g(%x) {\n  %x = input : f32[s0,4]\n  %y = exp(%x) : f32[s0,4]\n  return %y as y\n}\n";
    let g = tessera::ir::text::parse(src).unwrap();
    let plan = fuse(&g);
    let e = schedule::build(&g, &plan, &ScheduleOptions::default()).unwrap_err();
    assert!(e.message.contains("concrete shapes"), "{e}");
}

#[test]
fn unknown_and_malformed_hints_in_a_graph_file_are_noted() {
    let src = concat!(
        "graph g(%x) {\n",
        "  %x = input : f32[4]\n",
        "  %y = exp(%x) : f32[4]  hints={\"order\":\"strict\",\"streams\":1,\"stream\":1}\n",
        "  %z = tanh(%y) : f32[4]  hints={\"group_id\":\"a\"}\n",
        "  return %z as z\n",
        "}\n"
    );
    let g = tessera::ir::text::parse(src).unwrap();
    let plan = fuse(&g);
    let s = schedule::build(&g, &plan, &ScheduleOptions::default()).unwrap();
    let notes = s.schedule.notes.join("\n");
    assert!(notes.contains("\"streams\" is not known"), "{notes}");
    // A known key the scheduler honours: the exp kernel on stream 1, the
    // tanh (no stream hint, a malformed one) on the run's own.
    let streams = s.schedule.streams.expect("the stream hint is planned");
    assert_eq!(streams.streams, vec![0, 1]);
    assert!(!notes.contains("hint \"stream\""), "{notes}");
    assert!(
        notes.contains("not honoured") && notes.contains("expected an integer"),
        "{notes}"
    );
}

fn assert_close(a: &Tensor, b: &Tensor) {
    assert_eq!(a.shape(), b.shape());
    for (x, y) in a.to_f64_vec().iter().zip(b.to_f64_vec()) {
        assert!((x - y).abs() <= 1e-5 * (1.0 + y.abs()), "{x} vs {y}");
    }
}

/// The seed's PySDPAHinted: forward group 0, backward group 1, strict.
fn hinted_attention(a: &[Tensor]) -> Vec<Tensor> {
    let hint = Hint::strict().group(0).backward_group(1);
    let out = hinted_context(
        |a: &[Tensor]| sliced_attention(&a[0], &a[1], &a[2], 8),
        a,
        hint,
    );
    vec![out.unwrap().sum(&[], false)]
}

#[test]
fn compiled_functions_take_a_strategy_and_a_budget() {
    let args: Vec<Tensor> = attention_inputs(20)
        .iter()
        .map(|t| t.set_requires_grad(true))
        .collect();
    let eager = hinted_attention(&args);
    eager[0].backward();
    let grads: Vec<Tensor> = args.iter().map(|t| t.grad().unwrap()).collect();
    let compiled = [
        tessera::compile(hinted_attention),
        tessera::compile(hinted_attention).schedule(Strategy::Dfs),
        tessera::compile(hinted_attention).schedule(Strategy::Strict),
        tessera::compile(hinted_attention).schedule(Strategy::Auto),
        tessera::compile(hinted_attention).memory_budget(64 << 10),
    ];
    for f in compiled {
        args.iter().for_each(Tensor::zero_grad);
        let out = f.call(&args);
        assert_close(&out[0], &eager[0]);
        out[0].backward();
        for (t, g) in args.iter().zip(&grads) {
            assert_close(&t.grad().unwrap(), g);
        }
        assert_eq!(f.stats().compiles, 1);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn every_strategy_gives_a_valid_order_and_plan(
        codes in prop::collection::vec(0u8..7, 1..10),
        hinted in prop::collection::vec(any::<bool>(), 10),
        strategy in 0usize..4,
    ) {
        let g = random_graph(&codes, &hinted, 6);
        let strategy = [Strategy::Bfs, Strategy::Dfs, Strategy::Strict, Strategy::Auto][strategy];
        let (plan, s) = planned(&g, strategy, None);
        assert_valid(&g, &plan, &s.schedule.steps);
        prop_assert!(s.memory.check().is_ok());
        prop_assert!(s.memory.run_peak_bytes() >= s.memory.peak_bytes);
    }
}
