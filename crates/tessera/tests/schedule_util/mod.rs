//! Shared by `schedule.rs`, `schedule_memory.rs`, `device_executor.rs` and
//! tessera-cuda's `executor.rs`: the seed's sliced attention, a chain graph
//! and the path from a traced function to a schedule.
#![allow(dead_code)]

use tessera::fusion::{fuse, Plan};
use tessera::hints::{self, Hint};
use tessera::ir::Graph;
use tessera::passes::{PassContext, PassManager};
use tessera::runtime::device::Device;
use tessera::schedule::{self, ScheduleOptions, Scheduled, Strategy};
use tessera::tensor::trace::trace;
use tessera::tensor::Generator;
use tessera::{DType, Tensor};

/// The seed's sliced attention (`tessera_apps::seed_table::sdpa`, not causal).
pub fn sliced_attention(q: &Tensor, k: &Tensor, v: &Tensor, slices: usize) -> Tensor {
    tessera_apps::seed_table::sdpa(q, k, v, false, slices)
}

/// The graph of `f` on inputs shaped like `args`, after the default passes.
pub fn traced(name: &str, args: &[Tensor], f: impl FnOnce(&[Tensor]) -> Vec<Tensor>) -> Graph {
    let types: Vec<(String, tessera::ir::TensorType)> = args
        .iter()
        .enumerate()
        .map(|(i, t)| (format!("in{i}"), t.ty()))
        .collect();
    let traced = trace(name, &types, |a| {
        Ok(f(a)
            .into_iter()
            .enumerate()
            .map(|(i, t)| (format!("out{i}"), t))
            .collect())
    })
    .unwrap();
    optimized(traced.graph)
}

pub fn optimized(mut graph: Graph) -> Graph {
    // Without the attention pass: the schedules of the composite the
    // seed writes are the point (the pass would make each slice one op).
    PassManager::default_pipeline()
        .without("attention")
        .run(&mut graph, &PassContext::default())
        .unwrap();
    graph
}

pub fn planned(graph: &Graph, strategy: Strategy, budget: Option<usize>) -> (Plan, Scheduled) {
    planned_on(graph, strategy, budget, Device::Cpu)
}

/// [`planned`], the memory plan made for device `on`'s kernels.
pub fn planned_on(
    graph: &Graph,
    strategy: Strategy,
    budget: Option<usize>,
    on: Device,
) -> (Plan, Scheduled) {
    let plan = fuse(graph);
    let options = ScheduleOptions {
        strategy,
        memory_budget: budget,
        device: on,
    };
    let scheduled = schedule::build(graph, &plan, &options).unwrap();
    (plan, scheduled)
}

/// For each kernel, the kernels it reads from.
pub fn producers(graph: &Graph, plan: &Plan) -> Vec<Vec<usize>> {
    let mut kernel_of = vec![None; graph.len()];
    for (k, kernel) in plan.kernels.iter().enumerate() {
        for v in kernel.writes() {
            kernel_of[v.index()] = Some(k);
        }
    }
    plan.kernels
        .iter()
        .map(|kernel| {
            kernel
                .reads(graph)
                .iter()
                .filter_map(|v| kernel_of[v.index()])
                .collect()
        })
        .collect()
}

/// Asserts that `steps` runs every kernel once, each after its producers.
pub fn assert_valid(graph: &Graph, plan: &Plan, steps: &[Vec<usize>]) {
    let mut step_of = vec![None; plan.kernels.len()];
    for (s, step) in steps.iter().enumerate() {
        assert!(!step.is_empty(), "step {s} is empty");
        for &k in step {
            assert!(step_of[k].is_none(), "kernel {k} runs twice");
            step_of[k] = Some(s);
        }
    }
    for (k, ps) in producers(graph, plan).iter().enumerate() {
        let s = step_of[k].unwrap_or_else(|| panic!("kernel {k} never runs"));
        for &p in ps {
            assert!(
                step_of[p].unwrap() < s,
                "kernel {k} (step {s}) runs with or before its producer {p}"
            );
        }
    }
}

/// A random graph over two `[n, n]` inputs: a chain of ops (matmuls,
/// softmax, elementwise, transposes, reductions) with side outputs, the
/// steps where `hinted` is set inside a strict group (0 or 1 by parity).
pub fn random_graph(codes: &[u8], hinted: &[bool], n: usize) -> Graph {
    let mut g = Generator::new(11);
    let args = [
        Tensor::randn(&[n, n], DType::F32, &mut g),
        Tensor::randn(&[n, n], DType::F32, &mut g),
    ];
    traced("random", &args, |a| {
        let mut v = a[0].clone();
        let mut outs = Vec::new();
        for (i, (&c, &h)) in codes.iter().zip(hinted).enumerate() {
            let step = |v: &Tensor| match c % 7 {
                0 => v.matmul(&a[1]),
                1 => v.softmax(-1),
                2 => (v * 0.5).tanh(),
                3 => v.t().matmul(v),
                4 => v.sum(&[0], true) + v,
                5 => v.t().softmax(-1),
                _ => v.exp().minimum(3.0),
            };
            v = if h {
                hints::scope(Hint::strict().group(i as i64 % 2), || step(&v)).unwrap()
            } else {
                step(&v)
            };
            if i % 3 == 1 {
                outs.push(v.clone());
            }
        }
        outs.push(v);
        outs
    })
}

/// Matmuls with an epilogue, a pointwise chain and views: no row kernel,
/// no CPU scratch (f32), so a device takes its plan's arena exactly.
pub fn chain(a: &[Tensor]) -> Vec<Tensor> {
    let h = (a[0].matmul(&a[1]) + &a[2]).gelu();
    let g = (&h * 2.0).tanh() + 1.0;
    vec![g.t().matmul(&h), g.reshape(&[-1])]
}
