//! The seed experiment (seeds/000_6388399522242122.txt): scaled dot-product
//! attention written naively and sliced per batch×head, forward + backward,
//! eager and compiled, with and without the user's context hint, with and
//! without the attention pass, and the flash attention op called directly —
//! working memory, time, compile time and error against an f64 reference.

use std::time::Instant;

use tessera::compile::{compile, CompileStats};
use tessera::custom_op::flash_attention::{scaled_dot_product_attention, SdpaOptions};
use tessera::error::Result;
use tessera::hints;
use tessera::ir::DType;
use tessera::runtime::device::{self, Device};
use tessera::tensor::{Generator, Tensor};

/// What to run.
#[derive(Clone, Debug)]
pub struct SeedConfig {
    /// (B, H, N, D).
    pub shape: [usize; 4],
    pub dtype: DType,
    pub causal: bool,
    /// Timed repetitions per scenario (the median is reported).
    pub reps: usize,
    pub seed: u64,
    /// Where every tensor of every scenario lives (working memory is
    /// measured by that device's accounting).
    pub device: Device,
    /// Only the scenarios whose name contains this (all when `None`): one
    /// row at a time for a profiler.
    pub only: Option<String>,
}

impl Default for SeedConfig {
    fn default() -> SeedConfig {
        SeedConfig {
            shape: [4, 16, 512, 64],
            dtype: DType::F32,
            causal: false,
            reps: 5,
            seed: 0,
            device: Device::Cpu,
            only: None,
        }
    }
}

/// One row of the table.
#[derive(Clone, Debug, serde::Serialize)]
pub struct SeedRow {
    pub scenario: String,
    /// Peak bytes during one forward+backward step beyond the inputs, the
    /// output and the three gradients, in MiB.
    pub working_mb: f64,
    /// Peak bytes of offloaded values in host memory during that step
    /// (the backend's pinned pool; the CPU's separately accounted host
    /// pool), in MiB: 0 unless a scenario offloads.
    pub host_mb: f64,
    pub ms_median: f64,
    /// Milliseconds spent compiling (0 for eager scenarios).
    pub compile_ms: f64,
    /// Largest absolute difference of the output and gradients from the
    /// f64 reference.
    pub max_abs_err: f64,
}

/// The seed's `sdpa_fwd`: attention over `slices` parts of the flattened
/// batch×head dim (1: the naive version).
pub fn sdpa(q: &Tensor, k: &Tensor, v: &Tensor, causal: bool, slices: usize) -> Tensor {
    let scale = 1.0 / (q.shape()[3] as f64).sqrt();
    let (qf, kf, vf) = (q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1));
    let (qs, ks, vs) = (
        qf.tensor_split(slices, 0),
        kf.tensor_split(slices, 0),
        vf.tensor_split(slices, 0),
    );
    let outs: Vec<Tensor> = (0..slices)
        .map(|i| {
            let s = qs[i].matmul(&ks[i].transpose(-2, -1)) * scale;
            let s = if causal { causal_mask(&s) } else { s };
            s.softmax(-1).matmul(&vs[i])
        })
        .collect();
    let refs: Vec<&Tensor> = outs.iter().collect();
    // As the seed: (q.shape[0], q.shape[1], v.shape[2], v.shape[3]).
    let shape = [q.shape()[0], q.shape()[1], v.shape()[2], v.shape()[3]].map(|d| d as isize);
    Tensor::cat(&refs, 0).reshape(&shape)
}

/// Scores above the diagonal set to -inf.
pub fn causal_mask(s: &Tensor) -> Tensor {
    let n = s.shape()[s.rank() - 1];
    // The mask is made where the scores are (a no-op scope while tracing).
    let keep = device::with_device(s.device(), || Tensor::ones(&[n, n], DType::Bool).tril(0));
    Tensor::where_(&keep, s, &Tensor::full(&[], f64::NEG_INFINITY, s.dtype()))
}

/// The inputs and the output gradient, and the f64 reference results.
struct Problem {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    grad: Tensor,
    reference: Vec<Vec<f64>>,
}

impl Problem {
    /// The inputs are drawn on the host (the same values for every device)
    /// and moved to the device; the f64 reference runs there too (the
    /// seed's shape is out of the CPU's reach in f64; the device's kernels
    /// are checked against the CPU's by the CUDA differential tests).
    fn new(config: &SeedConfig) -> Result<Problem> {
        let mut g = Generator::new(config.seed);
        let make =
            |g: &mut Generator| Tensor::randn(&config.shape, DType::F64, g).to(config.device);
        let (q, k, v, grad) = (make(&mut g)?, make(&mut g)?, make(&mut g)?, make(&mut g)?);
        let reference = step(
            &sdpa_fn(config.causal, 1),
            &[q.clone(), k.clone(), v.clone()],
            &grad,
        )
        .iter()
        .map(Tensor::to_f64_vec)
        .collect();
        let cast = |t: &Tensor| t.cast(config.dtype);
        Ok(Problem {
            q: cast(&q),
            k: cast(&k),
            v: cast(&v),
            grad: cast(&grad),
            reference,
        })
    }

    fn bytes(&self) -> usize {
        self.q.numel() * self.q.dtype().size_bytes()
    }
}

type Forward = Box<dyn Fn(&[Tensor]) -> Vec<Tensor>>;

fn sdpa_fn(causal: bool, slices: usize) -> Forward {
    Box::new(move |x: &[Tensor]| vec![sdpa(&x[0], &x[1], &x[2], causal, slices)])
}

/// One forward + backward: the output and the three gradients.
fn step(
    forward: &dyn Fn(&[Tensor]) -> Vec<Tensor>,
    inputs: &[Tensor],
    grad: &Tensor,
) -> Vec<Tensor> {
    let leaves: Vec<Tensor> = inputs.iter().map(|t| t.set_requires_grad(true)).collect();
    let out = forward(&leaves).remove(0);
    out.backward_with(grad);
    let mut results = vec![out.detach()];
    results.extend(
        leaves
            .iter()
            .map(|l| l.grad().expect("every input gets a gradient")),
    );
    results
}

/// [`measure`] of `forward` compiled (named `name`, the attention pass
/// on or off by `fused`), with its compile statistics.
fn measure_compiled(
    name: &str,
    forward: Forward,
    fused: bool,
    problem: &Problem,
    reps: usize,
) -> Result<SeedRow> {
    let f = compile(forward).name(name).fuse_attention(fused);
    measure(
        name,
        &|x: &[Tensor]| f.call(x),
        &|| f.stats(),
        problem,
        reps,
    )
}

/// Runs one scenario: a first call (compiling, if compiled), then `reps`
/// timed steps with the peak measured on the last.
fn measure(
    name: &str,
    forward: &dyn Fn(&[Tensor]) -> Vec<Tensor>,
    stats: &dyn Fn() -> CompileStats,
    problem: &Problem,
    reps: usize,
) -> Result<SeedRow> {
    let on = problem.q.device();
    let inputs = [problem.q.clone(), problem.k.clone(), problem.v.clone()];
    let first = step(forward, &inputs, &problem.grad);
    let max_abs_err = first
        .iter()
        .zip(&problem.reference)
        .flat_map(|(t, r)| {
            t.to_f64_vec()
                .into_iter()
                .zip(r.iter())
                .map(|(a, b)| (a - b).abs())
                .collect::<Vec<_>>()
        })
        .fold(0.0, f64::max);
    drop(first);
    let mut times = Vec::with_capacity(reps);
    let mut working = 0.0;
    let mut host = 0.0;
    for _ in 0..reps.max(1) {
        device::synchronize(on)?;
        let before = device::memory_stats(on)?.live_bytes;
        device::reset_peak(on)?;
        let t = Instant::now();
        let results = step(forward, &inputs, &problem.grad);
        device::synchronize(on)?;
        times.push(t.elapsed().as_secs_f64() * 1e3);
        let peak = device::memory_stats(on)?.peak_bytes;
        let kept = 4 * problem.bytes(); // the output and three gradients
        working = peak.saturating_sub(before).saturating_sub(kept) as f64 / (1 << 20) as f64;
        host = device::host_memory_stats(on)?.peak_bytes as f64 / (1 << 20) as f64;
        drop(results);
    }
    times.sort_by(f64::total_cmp);
    let s = stats();
    Ok(SeedRow {
        scenario: name.to_string(),
        working_mb: working,
        host_mb: host,
        ms_median: times[times.len() / 2],
        compile_ms: (s.compile_seconds) * 1e3,
        max_abs_err,
    })
}

/// How a scenario runs the seed's attention.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Run {
    /// `sdpa` in `slices` parts (1: naive), eagerly.
    Eager { slices: Slices },
    /// `sdpa` compiled, optionally under [`SEED_HINT`], with or without the
    /// attention pass (`fused`).
    Compiled {
        slices: Slices,
        hinted: bool,
        fused: bool,
    },
    /// The naive `sdpa` compiled under [`SEED_HINT`] with a `slice` of
    /// one part per batch×head: the compiler slices it (issue 20).
    SliceHinted,
    /// The hand-sliced `sdpa` compiled under [`SEED_HINT`] with `offload`:
    /// the saved probabilities wait for the backward in host memory
    /// instead of being recomputed (issue 20).
    Offloaded,
    /// `scaled_dot_product_attention` (the flash attention op), eagerly.
    FlashEager,
}

/// One slice or one per batch×head.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Slices {
    One,
    PerHead,
}

/// The scenarios, in the table's order. The first five are issue 5's and
/// run without the attention pass; the next two turn it on.
const RUNS: [(&str, Run); 10] = [
    (
        "naive eager",
        Run::Eager {
            slices: Slices::One,
        },
    ),
    (
        "sliced eager",
        Run::Eager {
            slices: Slices::PerHead,
        },
    ),
    (
        "sliced graph (compiled)",
        Run::Compiled {
            slices: Slices::PerHead,
            hinted: false,
            fused: false,
        },
    ),
    (
        "hinted sliced graph (compiled)",
        Run::Compiled {
            slices: Slices::PerHead,
            hinted: true,
            fused: false,
        },
    ),
    (
        "naive graph (compiled)",
        Run::Compiled {
            slices: Slices::One,
            hinted: false,
            fused: false,
        },
    ),
    (
        "fused attention (naive code, compiled)",
        Run::Compiled {
            slices: Slices::One,
            hinted: false,
            fused: true,
        },
    ),
    (
        "hinted sliced graph + fused attention",
        Run::Compiled {
            slices: Slices::PerHead,
            hinted: true,
            fused: true,
        },
    ),
    ("naive code + slice hint (compiled)", Run::SliceHinted),
    ("hinted sliced graph + offload (compiled)", Run::Offloaded),
    ("flash attention op (eager)", Run::FlashEager),
];

/// The scenarios' names, in the table's order.
pub const SCENARIOS: [&str; 10] = {
    let mut names = [""; 10];
    let mut i = 0;
    while i < RUNS.len() {
        names[i] = RUNS[i].0;
        i += 1;
    }
    names
};

/// The seed's hint: the forward in program order as group 0, the backward
/// as group 1 (PySDPAHinted).
pub const SEED_HINT: &str = r#"{"order": "strict", "group_id": 0, "backward_group_id": 1}"#;

fn hinted_sdpa_fn(causal: bool, slices: usize) -> Forward {
    Box::new(move |x: &[Tensor]| {
        let out = hints::scope(SEED_HINT, || sdpa(&x[0], &x[1], &x[2], causal, slices));
        vec![out.expect("the seed hint is valid")]
    })
}

/// [`SEED_HINT`] with a `slice` hint of `parts` parts along the flattened
/// batch×head dim: the naive code sliced by the compiler.
pub fn slice_hint(parts: usize) -> String {
    hints::Hint::parse(SEED_HINT)
        .expect("the seed hint is valid")
        .slice(0, parts)
        .to_json()
}

fn slice_hinted_fn(causal: bool, parts: usize) -> Forward {
    let hint = slice_hint(parts);
    Box::new(move |x: &[Tensor]| {
        let out = hints::scope(&hint, || sdpa(&x[0], &x[1], &x[2], causal, 1));
        vec![out.expect("the slice hint is valid")]
    })
}

/// [`SEED_HINT`] with `offload`: the region's saved values go to host
/// memory after their last forward use and come back for the backward.
pub fn offload_hint() -> String {
    hints::Hint::parse(SEED_HINT)
        .expect("the seed hint is valid")
        .offload(true)
        .to_json()
}

fn offloaded_fn(causal: bool, slices: usize) -> Forward {
    let hint = offload_hint();
    Box::new(move |x: &[Tensor]| {
        let out = hints::scope(&hint, || sdpa(&x[0], &x[1], &x[2], causal, slices));
        vec![out.expect("the offload hint is valid")]
    })
}

fn flash_fn(causal: bool) -> Forward {
    Box::new(move |x: &[Tensor]| {
        let options = SdpaOptions {
            causal,
            ..SdpaOptions::default()
        };
        vec![scaled_dot_product_attention(&x[0], &x[1], &x[2], options)]
    })
}

/// Runs every scenario (or those [`SeedConfig::only`] names);
/// `progress(i, name)` is called before scenario `i`.
pub fn run(config: &SeedConfig, mut progress: impl FnMut(usize, &str)) -> Result<Vec<SeedRow>> {
    let problem = Problem::new(config)?;
    let count = |slices| match slices {
        Slices::One => 1,
        Slices::PerHead => config.shape[0] * config.shape[1],
    };
    let no_stats = || CompileStats::default();
    let mut rows = Vec::new();
    let chosen = |name: &str| {
        config
            .only
            .as_ref()
            .is_none_or(|o| name.contains(o.as_str()))
    };
    for (i, &(name, how)) in RUNS.iter().enumerate().filter(|(_, r)| chosen(r.0)) {
        progress(i, name);
        let row = match how {
            Run::Eager { slices } => measure(
                name,
                &*sdpa_fn(config.causal, count(slices)),
                &no_stats,
                &problem,
                config.reps,
            ),
            Run::SliceHinted => {
                let forward = slice_hinted_fn(config.causal, count(Slices::PerHead));
                measure_compiled(name, forward, false, &problem, config.reps)
            }
            Run::Offloaded => {
                let forward = offloaded_fn(config.causal, count(Slices::PerHead));
                measure_compiled(name, forward, false, &problem, config.reps)
            }
            Run::FlashEager => measure(
                name,
                &*flash_fn(config.causal),
                &no_stats,
                &problem,
                config.reps,
            ),
            Run::Compiled {
                slices,
                hinted,
                fused,
            } => {
                let forward = match hinted {
                    true => hinted_sdpa_fn(config.causal, count(slices)),
                    false => sdpa_fn(config.causal, count(slices)),
                };
                measure_compiled(name, forward, fused, &problem, config.reps)
            }
        }?;
        rows.push(row);
    }
    Ok(rows)
}
