//! The seed's experiment: the sliced attention scheduled `bfs` (the
//! default) against the same code under the hint
//! `{"order": "strict", "group_id": 0}`, and the other strategies — the
//! predicted peak of intermediates next to the peak the allocator measured
//! while the schedule ran, and the time of a run.
//!
//! `cargo run --release -p tessera --example hinted_attention -- 2 4 256 32 8`
//! (B H N D slices).

use std::time::Instant;

use tessera::fusion::fuse;
use tessera::hints::hinted_context;
use tessera::passes::{PassContext, PassManager};
use tessera::runtime::cpu::{memory_stats, reset_peak};
use tessera::runtime::execute::run_scheduled;
use tessera::schedule::{self, ScheduleOptions, Strategy};
use tessera::tensor::trace::trace;
use tessera::tensor::Generator;
use tessera::{DType, Graph, Tensor};

/// The seed's sliced attention (`tessera_apps::seed_table::sdpa`, not causal).
fn sliced_attention(q: &Tensor, k: &Tensor, v: &Tensor, slices: usize) -> Tensor {
    tessera_apps::seed_table::sdpa(q, k, v, false, slices)
}

fn graph(args: &[Tensor], slices: usize, hint: Option<&str>) -> Graph {
    let types: Vec<_> = ["q", "k", "v"]
        .iter()
        .zip(args)
        .map(|(n, t)| (n.to_string(), t.ty()))
        .collect();
    let traced = trace("attention", &types, |a| {
        let f = |a: &[Tensor]| sliced_attention(&a[0], &a[1], &a[2], slices);
        let out = match hint {
            Some(h) => hinted_context(f, a, h)?,
            None => f(a),
        };
        Ok(vec![("out".to_string(), out)])
    })
    .expect("traces");
    let mut g = traced.graph;
    // Without the attention pass: the schedules of the composite the
    // seed writes are the point (the pass would make each slice one op).
    PassManager::default_pipeline()
        .without("attention")
        .run(&mut g, &PassContext::default())
        .expect("passes run");
    g
}

fn main() {
    let dims: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("sizes are integers"))
        .collect();
    let [b, h, n, d, slices] = dims[..] else {
        panic!("usage: hinted_attention B H N D SLICES");
    };
    let mut gen = Generator::new(0);
    let args: Vec<Tensor> = (0..3)
        .map(|_| Tensor::randn(&[b, h, n, d], DType::F32, &mut gen))
        .collect();
    let plain = graph(&args, slices, None);
    let hinted = graph(&args, slices, Some(r#"{"order": "strict", "group_id": 0}"#));
    let bfs_peak = schedule::build(&plain, &fuse(&plain), &ScheduleOptions::default())
        .expect("schedules")
        .memory
        .peak_bytes;
    println!("B={b} H={h} N={n} D={d}, {slices} slices");
    println!(
        "{:<30} {:>6} {:>14} {:>14} {:>9}",
        "schedule", "steps", "predicted MiB", "measured MiB", "ms/run"
    );
    let cases: [(&str, &Graph, Strategy, Option<usize>); 6] = [
        ("bfs (default)", &plain, Strategy::Bfs, None),
        ("strict hint, group 0", &hinted, Strategy::Bfs, None),
        ("dfs", &plain, Strategy::Dfs, None),
        ("strict", &plain, Strategy::Strict, None),
        ("auto", &plain, Strategy::Auto, None),
        (
            "budget: a quarter of bfs",
            &plain,
            Strategy::Bfs,
            Some(bfs_peak / 4),
        ),
    ];
    for (name, g, strategy, memory_budget) in cases {
        let options = ScheduleOptions {
            strategy,
            memory_budget,
            ..ScheduleOptions::default()
        };
        run_case(name, g, &options, &args);
    }
}

/// Prints the schedule's steps, predicted and measured peaks, and run time.
fn run_case(name: &str, g: &Graph, options: &ScheduleOptions, args: &[Tensor]) {
    let mib = |bytes: usize| bytes as f64 / (1 << 20) as f64;
    let plan = fuse(g);
    let s = schedule::build(g, &plan, options).expect("schedules");
    let before = memory_stats().live_bytes;
    reset_peak();
    run_scheduled(g, &plan, &s.schedule, &s.memory, args).expect("runs");
    let measured = memory_stats().peak_bytes - before;
    let runs = 5;
    let started = Instant::now();
    for _ in 0..runs {
        run_scheduled(g, &plan, &s.schedule, &s.memory, args).expect("runs");
    }
    let ms = started.elapsed().as_secs_f64() * 1e3 / runs as f64;
    println!(
        "{name:<30} {:>6} {:>14.3} {:>14.3} {ms:>9.2}",
        s.schedule.steps.len(),
        mib(s.memory.run_peak_bytes()),
        mib(measured)
    );
}
