//! ResNet convolutions and the max pool, eager and compiled, in one
//! process: the wall time (best of `REPS`, default 5) and the CPU time of
//! the best run, per shape and way:
//!
//! - `eager`: the op called from this thread;
//! - `worker`: the same call inside `rayon::scope` (so on a pool worker,
//!   as the compiled executor's loop runs);
//! - `compiled`: `tessera::compile` of the op plus a per-channel scale
//!   (a folded batch norm) and ReLU, under `no_grad`;
//! - `nhwc` (1×1 convolutions): the same product channels-last, one
//!   matmul of `[n·h·w, c]` by `[c, o]`.
//!
//! With `RESNET=50` (or 18): that ResNet in eval mode at batch `batch`
//! (224²), eager and compiled, alternated `REPS` times.
//!
//! `RAYON_NUM_THREADS=2 cargo run --release -p tessera --example conv_probe [batch]`
mod common;
use std::time::Instant;

use common::cpu_ms;
use tessera::nn::{ParamStore, ResNet, ResNetConfig};
use tessera::tensor::{ConvOptions, Generator, PoolOptions};
use tessera::{autograd, compile, DType, Tensor};

/// A convolution: input channels and side, output channels, then kernel,
/// stride and padding.
type Shape = ([usize; 2], usize, usize, usize, usize);

/// (label, shape)
const CONVS: &[(&str, Shape)] = &[
    ("stem 7x7/2 3->64 @224", ([3, 224], 64, 7, 2, 3)),
    ("3x3 64->64 @56", ([64, 56], 64, 3, 1, 1)),
    ("1x1 64->256 @56", ([64, 56], 256, 1, 1, 0)),
    ("3x3 128->128 @28", ([128, 28], 128, 3, 1, 1)),
    ("3x3 256->256 @14", ([256, 14], 256, 3, 1, 1)),
    ("1x1 1024->256 @14", ([1024, 14], 256, 1, 1, 0)),
    ("3x3 512->512 @7", ([512, 7], 512, 3, 1, 1)),
    ("1x1 512->2048 @7", ([512, 7], 2048, 1, 1, 0)),
];

/// The best wall time (ms) of `reps` runs of `f` and that run's CPU time.
fn best(reps: usize, mut f: impl FnMut() -> Tensor) -> (f64, f64) {
    let mut out = (f64::INFINITY, 0.0);
    for _ in 0..reps {
        let (c, t) = (cpu_ms(), Instant::now());
        let y = f();
        std::hint::black_box(&y);
        let ms = t.elapsed().as_secs_f64() * 1e3;
        if ms < out.0 {
            out = (ms, cpu_ms() - c);
        }
    }
    out
}

fn main() {
    if let Ok(depth) = std::env::var("RESNET") {
        return resnet(depth.parse().expect("RESNET=18 or 50"));
    }
    let n: usize = std::env::args()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or(8);
    let reps: usize = std::env::var("REPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5);
    let mut g = Generator::new(0);
    println!("batch {n}, {} threads", rayon::current_num_threads());
    for &(label, ([c, h], o, k, s, p)) in CONVS {
        let x = Tensor::randn(&[n, c, h, h], DType::F32, &mut g);
        let w = Tensor::randn(&[o, c, k, k], DType::F32, &mut g);
        let scale = Tensor::randn(&[1, o, 1, 1], DType::F32, &mut g);
        let opts = ConvOptions::default().stride(s).padding(p);
        let eager = best(reps, || x.conv2d(&w, None, opts));
        let worker = best(reps, || rayon::scope(|_| x.conv2d(&w, None, opts)));
        let f = compile(move |a: &[Tensor]| vec![(a[0].conv2d(&a[1], None, opts) * &a[2]).relu()]);
        let args = [x.clone(), w.clone(), scale.clone()];
        let compiled = best(reps, || autograd::no_grad(|| f.call(&args)[0].clone()));
        let mut ways = vec![("eager", eager), ("worker", worker), ("compiled", compiled)];
        if k == 1 && s == 1 && p == 0 {
            ways.push(("nhwc", nhwc_pointwise(&x, &w, reps)));
        }
        report(label, &ways);
    }
    let x = Tensor::randn(&[n, 64, 112, 112], DType::F32, &mut g);
    let pool = PoolOptions::new(3).stride(2).padding(1);
    let eager = best(reps, || x.max_pool2d(pool));
    let worker = best(reps, || rayon::scope(|_| x.max_pool2d(pool)));
    let f = compile(move |a: &[Tensor]| vec![a[0].max_pool2d(pool)]);
    let compiled = best(reps, || {
        autograd::no_grad(|| f.call(std::slice::from_ref(&x))[0].clone())
    });
    report(
        "max_pool 3x3/2 @112",
        &[("eager", eager), ("worker", worker), ("compiled", compiled)],
    );
}

/// A 1×1 convolution channels-last: the `[n·h·w, c]` input times the
/// `[c, o]` weight, one GEMM (the layouts made outside the timing), for
/// the NCHW kernel's per-sample `[o, c] · [c, h·w]` to be compared with.
fn nhwc_pointwise(x: &Tensor, w: &Tensor, reps: usize) -> (f64, f64) {
    let (n, c, h, wd) = (x.shape()[0], x.shape()[1], x.shape()[2], x.shape()[3]);
    let o = w.shape()[0];
    let rows = x
        .permute(&[0, 2, 3, 1])
        .contiguous()
        .reshape(&[(n * h * wd) as isize, c as isize]);
    let wt = w
        .reshape(&[o as isize, c as isize])
        .permute(&[1, 0])
        .contiguous();
    best(reps, || rows.matmul(&wt))
}

fn report(label: &str, ways: &[(&str, (f64, f64))]) {
    let cols: Vec<String> = ways
        .iter()
        .map(|(w, (ms, cpu))| format!("{w} {ms:7.2} ms (cpu {cpu:7.2})"))
        .collect();
    println!("{label:<22} {}", cols.join("  "));
}

fn resnet(depth: usize) {
    let n: usize = std::env::args()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or(8);
    let reps: usize = std::env::var("REPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    let config = match depth {
        18 => ResNetConfig::resnet18(1000),
        _ => ResNetConfig::resnet50(1000),
    };
    let mut store = ParamStore::new();
    let mut g = Generator::new(0);
    let model = ResNet::new(&mut store, "", config, &mut g);
    model.train(false);
    let x = Tensor::randn(&[n, 3, 224, 224], DType::F32, &mut g);
    let f = compile(|a: &[Tensor]| vec![model.forward(&a[0])]);
    let run = |compiled: bool| {
        autograd::no_grad(|| match compiled {
            true => f.call(std::slice::from_ref(&x))[0].clone(),
            false => model.forward(&x),
        })
    };
    let want = run(false);
    let got = run(true);
    let diff = want
        .to_f64_vec()
        .iter()
        .zip(got.to_f64_vec())
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    println!("resnet{depth} batch {n}: max |eager - compiled| {diff:.3e}");
    for _ in 0..reps {
        let eager = best(1, || run(false));
        let compiled = best(1, || run(true));
        report("forward", &[("eager", eager), ("compiled", compiled)]);
    }
}
