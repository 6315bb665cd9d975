//! The compiled executor on the GPU: the planned device arena (predicted
//! peak == measured peak, to the byte), `bfs` levels on several streams
//! (the same bits as one stream, run after run), and `reduce-overhead`'s
//! CUDA-graph replay (the same bits as kernel by kernel, and a logged
//! fallback where capture is impossible). Runs only with
//! `TESSERA_CUDA_TESTS=1` (on a GPU machine, by `scripts/gpu-check.sh`);
//! there a missing GPU is a failure, not a skip.

#[path = "../../tessera/tests/schedule_util/mod.rs"]
mod schedule_util;

use schedule_util::{chain, traced};
use std::sync::{Mutex, MutexGuard, Once};

use tessera::compile::{Compiled, Mode};
use tessera::fusion::{fuse, Plan};
use tessera::ir::{DType, Graph};
use tessera::runtime::device::{self, Device};
use tessera::runtime::execute::{run_plan, run_scheduled};
use tessera::runtime::replay::ReplayStats;
use tessera::schedule::{self, ScheduleOptions, Scheduled, Strategy};
use tessera::tensor::Generator;
use tessera::{compile, Tensor};

fn gpu() -> bool {
    if std::env::var("TESSERA_CUDA_TESTS").as_deref() != Ok("1") {
        eprintln!("TESSERA_CUDA_TESTS is not 1: CUDA executor tests do not run here");
        return false;
    }
    static OPEN: Once = Once::new();
    OPEN.call_once(|| tessera_cuda::register().expect("TESSERA_CUDA_TESTS=1 needs a GPU"));
    true
}

/// The device allocator's counters are global: one test measures at a time.
fn allocator() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn randn(shape: &[usize], dtype: DType, seed: u64) -> Tensor {
    Tensor::randn(shape, DType::F64, &mut Generator::new(seed)).cast(dtype)
}

fn cuda(t: &Tensor) -> Tensor {
    t.to(Device::Cuda).unwrap()
}

fn bits(ts: &[Tensor]) -> Vec<Vec<u64>> {
    ts.iter()
        .map(|t| t.to_f64_vec().iter().map(|v| v.to_bits()).collect())
        .collect()
}

fn planned(graph: &Graph, strategy: Strategy) -> (Plan, Scheduled) {
    let plan = fuse(graph);
    let options = ScheduleOptions {
        strategy,
        memory_budget: None,
        // The plan reserves the GPU kernels' scratch.
        device: Device::Cuda,
    };
    let s = schedule::build(graph, &plan, &options).unwrap();
    (plan, s)
}

/// A matmul with a bias + gelu epilogue, chains written in place, a
/// softmax of a transposed view, a view output and a reduction.
fn mlp(a: &[Tensor]) -> Vec<Tensor> {
    let h = (a[0].matmul(&a[1]) + &a[2]).gelu();
    let g = (&h.softmax(0) * 2.0).tanh() + 1.0;
    let p = g.t().softmax(-1);
    vec![p.reshape(&[-1]), (g.exp() - 1.0).sum(&[0], false)]
}

/// A function of tensors to tensors, as traced.
type Program = fn(&[Tensor]) -> Vec<Tensor>;

fn sliced(a: &[Tensor]) -> Vec<Tensor> {
    vec![tessera_apps::seed_table::sdpa(
        &a[0], &a[1], &a[2], false, 8,
    )]
}

fn mlp_inputs(dtype: DType, seed: u64) -> Vec<Tensor> {
    vec![
        randn(&[64, 128], dtype, seed),
        randn(&[128, 96], dtype, seed + 1),
        randn(&[96], dtype, seed + 2),
    ]
}

fn attention_inputs(dtype: DType, seed: u64) -> Vec<Tensor> {
    (0..3)
        .map(|i| randn(&[2, 4, 256, 64], dtype, seed + i))
        .collect()
}

/// Runs the schedule on the GPU; returns the outputs and the peak of the
/// device bytes the run allocated.
fn measured(graph: &Graph, plan: &Plan, s: &Scheduled, inputs: &[Tensor]) -> (Vec<Tensor>, usize) {
    device::synchronize(Device::Cuda).unwrap();
    let before = device::memory_stats(Device::Cuda).unwrap().live_bytes;
    device::reset_peak(Device::Cuda).unwrap();
    let outs = run_scheduled(graph, plan, &s.schedule, &s.memory, inputs).unwrap();
    device::synchronize(Device::Cuda).unwrap();
    let peak = device::memory_stats(Device::Cuda).unwrap().peak_bytes - before;
    (outs.into_iter().map(|(_, t)| t).collect(), peak)
}

#[test]
fn the_device_arena_peaks_where_the_plan_says() {
    if !gpu() {
        return;
    }
    let _lock = allocator();
    let cases: Vec<(&str, Vec<Tensor>, Program)> = vec![
        ("mlp f32", mlp_inputs(DType::F32, 1), mlp),
        ("chain f32", mlp_inputs(DType::F32, 2), chain),
        ("mlp bf16", mlp_inputs(DType::BF16, 4), mlp),
        (
            "sliced attention f32",
            attention_inputs(DType::F32, 7),
            sliced,
        ),
        (
            "sliced attention bf16",
            attention_inputs(DType::BF16, 10),
            sliced,
        ),
    ];
    let mut arenas = 0;
    for (name, host, f) in cases {
        let graph = traced(name, &host, f);
        let on: Vec<Tensor> = host.iter().map(cuda).collect();
        // Kernel by kernel, one stream, no arena: the reference bits.
        let plan = fuse(&graph);
        let reference: Vec<Tensor> = run_plan(&graph, &plan, &on)
            .unwrap()
            .into_iter()
            .map(|(_, t)| t)
            .collect();
        for strategy in [Strategy::Bfs, Strategy::Dfs, Strategy::Strict] {
            let (plan, s) = planned(&graph, strategy);
            assert!(s.memory.arena_bytes > 0, "{name}: nothing planned");
            let (outs, peak) = measured(&graph, &plan, &s, &on);
            assert_eq!(
                bits(&outs),
                bits(&reference),
                "{name} {}: values differ from the kernel-by-kernel run",
                strategy.name()
            );
            // A plan the device cannot take exactly (CPU scratch, row
            // kernels the GPU refuses) runs without an arena on the GPU
            // (`execute::device_arena_unfit`): only the values are checked.
            if tessera::runtime::execute::device_arena_unfit(&plan, &s.memory, Device::Cuda)
                .is_some()
            {
                eprintln!(
                    "{name} {}: CPU scratch in the plan, no arena",
                    strategy.name()
                );
                continue;
            }
            arenas += 1;
            assert_eq!(
                peak,
                s.memory.run_peak_bytes(),
                "{name} {}: measured {peak} device bytes, predicted {}\n{}",
                strategy.name(),
                s.memory.run_peak_bytes(),
                s.memory.describe(&graph)
            );
            eprintln!(
                "{name} {}: peak {peak} bytes = arena {} + escaping {}",
                strategy.name(),
                s.memory.arena_bytes,
                s.memory.escaping_bytes
            );
        }
    }
    assert!(
        arenas >= 3,
        "the f32 chain graph runs in an arena in every order"
    );
}

#[test]
fn bfs_levels_on_several_streams_compute_the_same_bits() {
    if !gpu() {
        return;
    }
    let _lock = allocator();
    let backend = device::backend(Device::Cuda).unwrap();
    assert!(backend.lanes() > 1, "the CUDA backend runs steps on lanes");
    for dtype in [DType::F32, DType::BF16] {
        let host = attention_inputs(dtype, 20);
        let graph = traced("sliced", &host, sliced);
        let on: Vec<Tensor> = host.iter().map(cuda).collect();
        let (plan, bfs) = planned(&graph, Strategy::Bfs);
        assert!(
            bfs.schedule.steps.iter().any(|s| s.len() > 1),
            "bfs has levels of several kernels"
        );
        let (_, strict) = planned(&graph, Strategy::Strict);
        let one_stream = run_scheduled(&graph, &plan, &strict.schedule, &strict.memory, &on)
            .unwrap()
            .into_iter()
            .map(|(_, t)| t)
            .collect::<Vec<_>>();
        // A missing dependency would show as bits that change between runs.
        for run in 0..5 {
            let lanes: Vec<Tensor> = run_scheduled(&graph, &plan, &bfs.schedule, &bfs.memory, &on)
                .unwrap()
                .into_iter()
                .map(|(_, t)| t)
                .collect();
            assert_eq!(
                bits(&lanes),
                bits(&one_stream),
                "{dtype} run {run}: bfs on lanes differs from strict on one stream"
            );
        }
    }
}

/// `f` compiled twice: with `mode=reduce-overhead` and with the default.
fn both_modes<F: Fn(&[Tensor]) -> Vec<Tensor> + Copy>(f: F) -> (Compiled<F>, Compiled<F>) {
    (compile(f).mode(Mode::ReduceOverhead), compile(f))
}

/// The output and the gradients of every input of `g` at `on`.
fn with_grads<F: Fn(&[Tensor]) -> Vec<Tensor>>(g: &Compiled<F>, on: &[Tensor]) -> Vec<Tensor> {
    let leaves: Vec<Tensor> = on.iter().map(|t| t.set_requires_grad(true)).collect();
    let out = g.call(&leaves).remove(0);
    out.backward();
    let mut r = vec![out.detach()];
    r.extend(leaves.iter().map(|l| l.grad().unwrap()));
    r
}

#[test]
fn reduce_overhead_replays_a_cuda_graph_with_the_same_results() {
    if !gpu() {
        return;
    }
    let _lock = allocator();
    let (replayed, plain) = both_modes(|x: &[Tensor]| mlp(x));
    let mut kept: Vec<(Vec<Tensor>, Vec<Vec<u64>>)> = Vec::new();
    for call in 0..5 {
        // Fresh inputs each call (new values, new device buffers).
        let on: Vec<Tensor> = mlp_inputs(DType::F32, 100 + 3 * call)
            .iter()
            .map(cuda)
            .collect();
        let got = replayed.call(&on);
        let want = plain.call(&on);
        assert_eq!(bits(&got), bits(&want), "call {call}: replay differs");
        kept.push((got, bits(&want)));
    }
    // Results of earlier replays are not overwritten by later ones.
    for (call, (got, want)) in kept.iter().enumerate() {
        assert_eq!(&bits(got), want, "call {call}'s result changed later");
    }
    let stats = replayed.replay_stats();
    assert_eq!(
        stats,
        ReplayStats {
            normal_runs: 1,
            recordings: 1,
            replays: 4,
            fallbacks: 0
        },
        "first call warms up, second records, the rest replay"
    );
}

#[test]
fn reduce_overhead_replays_forward_and_backward() {
    if !gpu() {
        return;
    }
    let _lock = allocator();
    let (replayed, plain) = both_modes(|x: &[Tensor]| vec![mlp(x)[1].sum(&[0], false)]);
    for call in 0..4 {
        let on: Vec<Tensor> = mlp_inputs(DType::F32, 200 + 3 * call)
            .iter()
            .map(cuda)
            .collect();
        assert_eq!(
            bits(&with_grads(&replayed, &on)),
            bits(&with_grads(&plain, &on)),
            "call {call}: replayed forward/backward differs"
        );
    }
    let stats = replayed.replay_stats();
    assert_eq!(stats.fallbacks, 0, "{stats:?}");
    assert_eq!(stats.recordings, 2, "forward and backward: {stats:?}");
    assert_eq!(stats.replays, 2 * 3, "{stats:?}");
}

#[test]
fn reduce_overhead_records_gathers_and_reports_a_bad_index_after_a_replay() {
    if !gpu() {
        return;
    }
    let _lock = allocator();
    // The index kernels check their indices on the device: nothing reads
    // them back, so the embedding-like gather records and replays.
    let (replayed, plain) =
        both_modes(|x: &[Tensor]| vec![(x[0].index_select(0, &x[1]) * 2.0).exp()]);
    let idx = Tensor::from_vec(vec![3i64, 0, 2, 2], &[4]);
    for call in 0..4 {
        let on = vec![cuda(&randn(&[5, 8], DType::F32, 300 + call)), cuda(&idx)];
        assert_eq!(
            bits(&replayed.call(&on)),
            bits(&plain.call(&on)),
            "call {call}"
        );
    }
    let stats = replayed.replay_stats();
    assert_eq!((stats.recordings, stats.fallbacks), (1, 0), "{stats:?}");
    // A bad index in a replay is an error when the result is read, naming
    // the op and the value; the next good call is right again.
    let bad = Tensor::from_vec(vec![3i64, 5, 2, 2], &[4]);
    let x = cuda(&randn(&[5, 8], DType::F32, 399));
    let out = replayed.try_call(&[x.clone(), cuda(&bad)]).unwrap();
    let e = out[0].to_vec::<f32>().unwrap_err().to_string();
    assert!(
        e.contains("index_select") && e.contains("index 5 is out of range for a dim of size 5"),
        "{e}"
    );
    let good = vec![x, cuda(&idx)];
    assert_eq!(bits(&replayed.call(&good)), bits(&plain.call(&good)));
}

#[test]
fn reduce_overhead_falls_back_where_capture_is_impossible() {
    if !gpu() {
        return;
    }
    let _lock = allocator();
    // A random op seeded by a device tensor reads its seed on the host: a
    // copy to the host, which a capture cannot hold.
    let (replayed, plain) = both_modes(|x: &[Tensor]| {
        let noise = Tensor::try_rand_seeded(&x[1], &[5, 8], DType::F32).unwrap();
        vec![(&x[0] * 2.0 + noise).exp()]
    });
    let seed = Tensor::from_vec(vec![7i64], &[]);
    for call in 0..4 {
        let on = vec![cuda(&randn(&[5, 8], DType::F32, 300 + call)), cuda(&seed)];
        assert_eq!(
            bits(&replayed.call(&on)),
            bits(&plain.call(&on)),
            "call {call}"
        );
    }
    let stats = replayed.replay_stats();
    assert_eq!(stats.recordings, 0, "{stats:?}");
    assert_eq!(stats.fallbacks, 1, "{stats:?}");
    assert_eq!(stats.normal_runs, 4, "{stats:?}");
}
