//! Issue 20's hints on the GPU: `offload` (saved activations downloaded to
//! host memory after their last forward use, uploaded before their first
//! backward use: the same values, a lower device peak), `slice` (the naive
//! attention sliced by the compiler: the unhinted values, a lower device
//! peak) and `stream` (regions on streams of their own, events between:
//! the unhinted values, also recorded in a CUDA graph). Runs only with
//! `TESSERA_CUDA_TESTS=1` (on a GPU machine, by `scripts/gpu-check.sh`);
//! there a missing GPU is a failure, not a skip.

use std::sync::{Mutex, MutexGuard, Once};

use tessera::compile::Compiled;
use tessera::hints;
use tessera::ir::DType;
use tessera::runtime::device::{self, Device};
use tessera::tensor::Generator;
use tessera::{compile, Tensor};

fn gpu() -> bool {
    if std::env::var("TESSERA_CUDA_TESTS").as_deref() != Ok("1") {
        eprintln!("TESSERA_CUDA_TESTS is not 1: CUDA hint tests do not run here");
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

fn randn(shape: &[usize], seed: u64, scale: f64) -> Tensor {
    let t = &Tensor::randn(shape, DType::F32, &mut Generator::new(seed)) * scale;
    t.to(Device::Cuda).unwrap()
}

/// One compiled forward + backward on the GPU: the output and gradients
/// (on the host), and the device peak above what was live before.
fn measured_step<F: Fn(&[Tensor]) -> Vec<Tensor>>(
    f: &Compiled<F>,
    inputs: &[Tensor],
    grad: &Tensor,
) -> (Vec<Vec<f64>>, usize) {
    let (results, memory) = measured_step_memory(f, inputs, grad);
    (results, memory.peak)
}

/// What one step leaves on the device above what was live before it.
struct StepMemory {
    /// Held between the forward and the backward (the output and what
    /// the backward saved).
    after_forward: usize,
    /// The step's peak.
    peak: usize,
}

/// [`measured_step`], also with the bytes held after the forward.
fn measured_step_memory<F: Fn(&[Tensor]) -> Vec<Tensor>>(
    f: &Compiled<F>,
    inputs: &[Tensor],
    grad: &Tensor,
) -> (Vec<Vec<f64>>, StepMemory) {
    let leaves: Vec<Tensor> = inputs.iter().map(|t| t.set_requires_grad(true)).collect();
    let forward = || f.call(&leaves).remove(0);
    let first = forward(); // compiles
    first.backward_with(grad);
    drop(first);
    for t in &leaves {
        t.zero_grad();
    }
    device::synchronize(Device::Cuda).unwrap();
    let before = device::memory_stats(Device::Cuda).unwrap().live_bytes;
    device::reset_peak(Device::Cuda).unwrap();
    let out = forward();
    device::synchronize(Device::Cuda).unwrap();
    let after_forward = device::memory_stats(Device::Cuda).unwrap().live_bytes - before;
    out.backward_with(grad);
    let out = out.detach();
    device::synchronize(Device::Cuda).unwrap();
    let peak = device::memory_stats(Device::Cuda).unwrap().peak_bytes - before;
    let mut results = vec![out.to_f64_vec()];
    results.extend(leaves.iter().map(|t| t.grad().unwrap().to_f64_vec()));
    (
        results,
        StepMemory {
            after_forward,
            peak,
        },
    )
}

const WIDTH: usize = 1024;
const LAYERS: usize = 4;

fn layers(hint: &'static str) -> impl Fn(&[Tensor]) -> Vec<Tensor> {
    move |a: &[Tensor]| {
        let out = hints::scope(hint, || {
            let mut h = a[0].clone();
            for w in &a[1..] {
                h = h.matmul(w).tanh();
            }
            h
        });
        vec![out.unwrap()]
    }
}

#[test]
fn offloaded_activations_leave_the_gpu_and_the_values_stay() {
    if !gpu() {
        return;
    }
    let _lock = allocator();
    let inputs: Vec<Tensor> = (0..=LAYERS as u64)
        .map(|i| randn(&[WIDTH, WIDTH], 10 + i, 0.03))
        .collect();
    let grad = randn(&[WIDTH, WIDTH], 30, 1.0);
    let kept = compile(layers(r#"{"order": "strict", "recompute": false}"#));
    let moved = compile(layers(r#"{"order": "strict", "offload": true}"#));
    let (a, kept_mem) = measured_step_memory(&kept, &inputs, &grad);
    let (b, moved_mem) = measured_step_memory(&moved, &inputs, &grad);
    let (kept_peak, moved_peak) = (kept_mem.peak, moved_mem.peak);
    eprintln!(
        "GPU bytes after the forward: {} kept, {} offloaded; peak of one step: {kept_peak} kept, {moved_peak} offloaded",
        kept_mem.after_forward, moved_mem.after_forward
    );
    assert_eq!(a, b, "offloading changes no value");
    let activation = WIDTH * WIDTH * 4;
    // Between forward and backward the saved tanh outputs of the first
    // three layers wait in host memory.
    assert!(
        moved_mem.after_forward + 2 * activation <= kept_mem.after_forward,
        "device bytes after the forward: {} offloaded vs {} kept",
        moved_mem.after_forward,
        kept_mem.after_forward
    );
    // The step's peak is in the backward, where the weight gradients pile
    // up and the compiled backward frees each saved value at its last read
    // (so keeping them costs less than it did): lower, by about one.
    assert!(
        moved_peak + activation <= kept_peak,
        "device peak {moved_peak} vs {kept_peak} without offload"
    );
    // The copies overlap compute: the plans say how many steps, and what
    // went to page-locked host memory is accounted there.
    let artifacts = moved.last_artifacts();
    let memory = |name: &str| {
        artifacts
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, t)| t.clone())
            .unwrap_or_default()
    };
    let (fwd, bwd) = (memory("forward.memory.txt"), memory("backward.memory.txt"));
    assert!(fwd.contains("overlapping"), "{fwd}");
    assert!(bwd.contains("steps ahead"), "{bwd}");
    let pinned = tessera_cuda::backend().unwrap().host_memory_stats();
    assert!(
        pinned.peak_bytes >= (LAYERS - 1) * activation,
        "page-locked host peak {}",
        pinned.peak_bytes
    );
}

/// Plain eager code under `{"offload": true}` (PyTorch's `save_on_cpu`):
/// the tape keeps what each op saves in page-locked host memory, so the
/// GPU holds less after the forward; the backward brings the values back
/// and gives the unhinted gradients.
#[test]
fn eager_offload_leaves_less_on_the_gpu_after_the_forward() {
    if !gpu() {
        return;
    }
    let _lock = allocator();
    use tessera::tensor::offload;
    let x = randn(&[WIDTH, WIDTH], 60, 1.0);
    let run = |hint: Option<&str>| {
        let params: Vec<Tensor> = (0..LAYERS as u64)
            .map(|i| randn(&[WIDTH, WIDTH], 61 + i, 0.03).set_requires_grad(true))
            .collect();
        device::synchronize(Device::Cuda).unwrap();
        let before = device::memory_stats(Device::Cuda).unwrap().live_bytes;
        offload::reset_stats();
        let body = || {
            let mut h = x.clone();
            for w in &params {
                h = h.matmul(w).tanh();
            }
            h.sum(&[], false)
        };
        let loss = match hint {
            Some(h) => hints::scope(h, body).unwrap(),
            None => body(),
        };
        device::synchronize(Device::Cuda).unwrap();
        let held = device::memory_stats(Device::Cuda).unwrap().live_bytes - before;
        loss.backward();
        let grads: Vec<Vec<f64>> = params
            .iter()
            .map(|p| p.grad().unwrap().to_f64_vec())
            .collect();
        (held, loss.to_f64_vec(), grads, offload::stats())
    };
    let (kept, loss, grads, none) = run(None);
    let (held, loss2, grads2, moved) = run(Some(r#"{"offload": true}"#));
    eprintln!("GPU bytes held after the forward: {kept} kept, {held} offloaded; {moved:?}");
    let activation = WIDTH * WIDTH * 4;
    assert_eq!(none, offload::OffloadStats::default());
    // x and each layer's tanh output (also the next matmul's input: one copy).
    assert_eq!(moved.offloaded_bytes, (LAYERS + 1) * activation);
    assert_eq!(moved.values, 2 * LAYERS);
    assert!(
        held + 2 * activation <= kept,
        "device bytes after the forward: {held} offloaded vs {kept} kept"
    );
    let diff = grads
        .iter()
        .flatten()
        .zip(grads2.iter().flatten())
        .chain(loss.iter().zip(&loss2))
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    assert!(diff <= 1e-6, "gradients differ by {diff}");
}

/// Eager `recompute` on the GPU (`tensor::recompute`): each layer in a
/// region of its own keeps only its input after the forward; the backward
/// replays the layer's ops on the device and gives the unhinted values
/// and gradients bit for bit (the same kernels on the same inputs).
#[test]
fn eager_recompute_keeps_only_region_inputs_on_the_gpu() {
    if !gpu() {
        return;
    }
    let _lock = allocator();
    use tessera::tensor::recompute;
    let x = randn(&[WIDTH, WIDTH], 70, 1.0);
    let run = |hint: Option<&str>| {
        let params: Vec<Tensor> = (0..LAYERS as u64)
            .map(|i| randn(&[WIDTH, WIDTH], 71 + i, 0.03).set_requires_grad(true))
            .collect();
        device::synchronize(Device::Cuda).unwrap();
        let before = device::memory_stats(Device::Cuda).unwrap().live_bytes;
        let mut h = x.clone();
        for w in &params {
            // A layer: two ops whose values the backward reads.
            let layer = || (&h.matmul(w).tanh() * 0.5).exp();
            h = match hint {
                Some(hint) => hints::scope(hint, layer).unwrap(),
                None => layer(),
            };
        }
        let loss = h.sum(&[], false);
        device::synchronize(Device::Cuda).unwrap();
        let held = device::memory_stats(Device::Cuda).unwrap().live_bytes - before;
        recompute::reset_replayed();
        loss.backward();
        let grads: Vec<Vec<u64>> = params
            .iter()
            .map(|p| {
                p.grad()
                    .unwrap()
                    .to_f64_vec()
                    .iter()
                    .map(|v| v.to_bits())
                    .collect()
            })
            .collect();
        (
            held,
            loss.to_f64_vec()[0].to_bits(),
            grads,
            recompute::replayed(),
        )
    };
    let (kept, loss, grads, none) = run(None);
    let (held, loss2, grads2, replayed) = run(Some(r#"{"recompute": true}"#));
    eprintln!("GPU bytes held after the forward: {kept} kept, {held} recomputing; {replayed} ops replayed");
    assert_eq!(none, 0);
    // Each layer's matmul, tanh and scale (read by the next rules) replayed once.
    assert!(replayed >= 2 * LAYERS, "{replayed} ops replayed");
    let activation = WIDTH * WIDTH * 4;
    // Unhinted: tanh's and exp's outputs of each layer (8 activations);
    // recomputing: the layers' inputs and the last output (4).
    assert!(
        held + (LAYERS - 1) * activation <= kept,
        "device bytes after the forward: {held} recomputing vs {kept} kept"
    );
    assert_eq!(loss, loss2, "losses differ");
    assert_eq!(grads, grads2, "gradients differ");
}

/// In the steady state the offloads and prefetches never make the host
/// wait for the device: a forward and backward with offload wait exactly
/// as often as the same step without (the gradients read back at the end).
#[test]
fn offload_and_prefetch_make_no_host_wait() {
    if !gpu() {
        return;
    }
    let _lock = allocator();
    let inputs: Vec<Tensor> = (0..=LAYERS as u64)
        .map(|i| randn(&[WIDTH, WIDTH], 70 + i, 0.03))
        .collect();
    let grad = randn(&[WIDTH, WIDTH], 80, 1.0);
    let backend = tessera_cuda::backend().unwrap();
    let waits = |f: &Compiled<_>| {
        let leaves: Vec<Tensor> = inputs.iter().map(|t| t.set_requires_grad(true)).collect();
        let step = || {
            let out = f.call(&leaves).remove(0);
            out.backward_with(&grad);
        };
        step(); // compiles
        use tessera::runtime::device::Backend;
        let before = backend.host_waits();
        step();
        backend.host_waits() - before
    };
    let kept = waits(&compile(layers(
        r#"{"order": "strict", "recompute": false}"#,
    )));
    let moved = waits(&compile(layers(r#"{"order": "strict", "offload": true}"#)));
    assert_eq!(moved, kept, "host waits of a step with offload vs without");
}

fn attention(hint: Option<String>) -> impl Fn(&[Tensor]) -> Vec<Tensor> {
    move |a: &[Tensor]| {
        let naive = || tessera_apps::seed_table::sdpa(&a[0], &a[1], &a[2], false, 1);
        vec![match &hint {
            Some(h) => hints::scope(h, naive).unwrap(),
            None => naive(),
        }]
    }
}

#[test]
fn the_slice_hint_gives_the_naive_attention_the_sliced_peak() {
    if !gpu() {
        return;
    }
    let _lock = allocator();
    let shape = [2, 8, 512, 64];
    let inputs: Vec<Tensor> = (0..3).map(|i| randn(&shape, 40 + i, 1.0)).collect();
    let grad = randn(&shape, 50, 1.0);
    let plain = compile(attention(None)).fuse_attention(false);
    let hint = tessera_apps::seed_table::slice_hint(16);
    let sliced = compile(attention(Some(hint))).fuse_attention(false);
    let (a, plain_peak) = measured_step(&plain, &inputs, &grad);
    let (b, sliced_peak) = measured_step(&sliced, &inputs, &grad);
    eprintln!("GPU peak: naive {plain_peak} bytes, naive + slice hint {sliced_peak} bytes");
    for (x, y) in a.iter().zip(&b) {
        let d = x
            .iter()
            .zip(y)
            .map(|(p, q)| (p - q).abs())
            .fold(0.0, f64::max);
        assert!(d < 1e-4, "sliced values differ by {d}");
    }
    assert!(
        sliced_peak * 4 < plain_peak,
        "{sliced_peak} vs {plain_peak}"
    );
}

/// Two independent chains, on streams `s1` and `s2` when given, joined
/// on the run's own stream.
fn two_regions(
    s1: Option<&'static str>,
    s2: Option<&'static str>,
) -> impl Fn(&[Tensor]) -> Vec<Tensor> {
    move |a: &[Tensor]| {
        let chain = |w: &Tensor| {
            let mut h = a[0].clone();
            for _ in 0..3 {
                h = h.matmul(w).tanh();
            }
            h
        };
        let run = |hint: Option<&str>, w: &Tensor| match hint {
            Some(h) => hints::scope(h, || chain(w)).unwrap(),
            None => chain(w),
        };
        let (p, q) = (run(s1, &a[1]), run(s2, &a[2]));
        vec![&p + &q]
    }
}

#[test]
fn regions_on_streams_1_and_2_give_the_unhinted_values() {
    if !gpu() {
        return;
    }
    let _lock = allocator();
    let inputs: Vec<Tensor> = (0..3).map(|i| randn(&[512, 512], 60 + i, 0.05)).collect();
    let grad = randn(&[512, 512], 63, 1.0);
    let plain = compile(two_regions(None, None));
    let streams = compile(two_regions(
        Some(r#"{"stream": 1}"#),
        Some(r#"{"stream": 2}"#),
    ));
    let (a, _) = measured_step(&plain, &inputs, &grad);
    let (b, _) = measured_step(&streams, &inputs, &grad);
    assert_eq!(a, b, "streams change no value");
    // The forward's schedule put the regions on their streams.
    let schedule = streams
        .last_artifacts()
        .into_iter()
        .find(|(n, _)| n == "forward.schedule.txt")
        .map(|(_, t)| t)
        .unwrap_or_default();
    assert!(schedule.contains("streams [0, 1, 2]"), "{schedule}");
    assert!(schedule.contains("waits for"), "{schedule}");
    // Under a sequential order the streams still give the same values.
    let strict = compile(two_regions(
        Some(r#"{"stream": 1, "order": "strict"}"#),
        Some(r#"{"stream": 2, "order": "strict"}"#),
    ));
    let (c, _) = measured_step(&strict, &inputs, &grad);
    assert_eq!(a, c, "strict regions on streams");
    // Nothing said the stream hints were ignored on the GPU.
    let said = hints::not_honoured_messages();
    assert!(
        !said.iter().any(|m| m.starts_with("compiled backend")
            && m.contains("hint \"stream\"")
            && m.contains("cuda")),
        "{said:?}"
    );
}

/// Recorded into a CUDA graph (`reduce-overhead`), the side streams fork
/// from the capturing stream and join it through events: the replays give
/// the values of the run without streams.
#[test]
fn streams_are_recorded_and_replayed_in_a_cuda_graph() {
    if !gpu() {
        return;
    }
    let _lock = allocator();
    let inputs: Vec<Tensor> = (0..3).map(|i| randn(&[256, 256], 90 + i, 0.05)).collect();
    let plain = compile(two_regions(None, None));
    let want = plain.call(&inputs)[0].to_f64_vec();
    let f = compile(two_regions(
        Some(r#"{"stream": 1}"#),
        Some(r#"{"stream": 2}"#),
    ))
    .mode(tessera::compile::Mode::ReduceOverhead);
    for _ in 0..4 {
        assert_eq!(f.call(&inputs)[0].to_f64_vec(), want);
    }
    let stats = f.replay_stats();
    assert!(stats.replays >= 2 && stats.fallbacks == 0, "{stats:?}");
}
