//! Random graphs on the GPU against the CPU: the generator of tessera's own
//! differential tests (every op family, broadcasting, views, reductions,
//! softmax, matmul, attention, hints) builds f32 graphs whose compiled
//! function (default backend: passes, fusion, generated kernels, flash
//! attention) runs on CUDA inputs; values and gradients must equal the
//! CPU's compiled run within (rtol 1e-4, atol 1e-4) — the summation order
//! of reductions and matmuls differs. Runs only with `TESSERA_CUDA_TESTS=1`
//! (see `differential.rs`).

#[path = "../../tessera/tests/graph_gen/mod.rs"]
mod graph_gen;

use std::sync::Once;

use graph_gen::*;
use proptest::prelude::*;
use tessera::ir::Graph;
use tessera::runtime::device::Device;
use tessera::tensor::interpret::run_graph;
use tessera::Tensor;

fn gpu() -> bool {
    if std::env::var("TESSERA_CUDA_TESTS").as_deref() != Ok("1") {
        eprintln!("TESSERA_CUDA_TESTS is not 1: CUDA random-graph tests do not run here");
        return false;
    }
    static OPEN: Once = Once::new();
    OPEN.call_once(|| tessera_cuda::register().expect("TESSERA_CUDA_TESTS=1 needs a GPU"));
    true
}

fn body(g: &Graph) -> impl Fn(&[Tensor]) -> Vec<Tensor> {
    let g = g.clone();
    move |args: &[Tensor]| {
        run_graph(&g, args)
            .unwrap_or_else(|e| panic!("{e}"))
            .into_iter()
            .map(|(_, t)| t)
            .collect()
    }
}

fn close(what: &str, cpu: &[f64], gpu: &[f64]) -> Result<(), TestCaseError> {
    prop_assert_eq!(cpu.len(), gpu.len(), "{}: lengths", what);
    for (i, (c, g)) in cpu.iter().zip(gpu).enumerate() {
        let ok = (c.is_nan() && g.is_nan()) || (c - g).abs() <= 1e-4 + 1e-4 * c.abs();
        prop_assert!(ok, "{}[{}]: cpu {}, gpu {}", what, i, c, g);
    }
    Ok(())
}

/// Outputs and input gradients (of a fixed mix of the outputs) of the
/// compiled graph on `device`.
fn run_on(g: &Graph, seed: u64, device: Device) -> (Vec<Vec<f64>>, Vec<Vec<f64>>) {
    let args: Vec<Tensor> = inputs(g, seed)
        .iter()
        .map(|t| t.to(device).unwrap().set_requires_grad(true))
        .collect();
    let f = tessera::compile(body(g));
    let outs = f.call(&args);
    let values = outs.iter().map(|o| o.to_f64_vec()).collect();
    let loss = outs
        .iter()
        .enumerate()
        .map(|(i, o)| (o * (1.0 + i as f64)).sum(&[], false))
        .reduce(|a, b| a + b)
        .expect("graphs have outputs");
    let grads = match loss.try_backward(None) {
        Ok(()) => args
            .iter()
            .map(|a| a.grad().map_or_else(Vec::new, |t| t.to_f64_vec()))
            .collect(),
        Err(_) => Vec::new(),
    };
    (values, grads)
}

fn check(spec: &Spec, seed: u64) -> Result<(), TestCaseError> {
    let g = build(spec);
    prop_assume!(tame(&g, &inputs(&g, seed), 1e3));
    let (cpu_values, cpu_grads) = run_on(&g, seed, Device::Cpu);
    let (gpu_values, gpu_grads) = run_on(&g, seed, Device::Cuda);
    for (i, (c, v)) in cpu_values.iter().zip(&gpu_values).enumerate() {
        close(&format!("output {i}\n{g}"), c, v)?;
    }
    prop_assert_eq!(
        cpu_grads.len(),
        gpu_grads.len(),
        "backward ran on one side only\n{}",
        g
    );
    for (i, (c, v)) in cpu_grads.iter().zip(&gpu_grads).enumerate() {
        close(&format!("grad of input {i}\n{g}"), c, v)?;
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 64,
        max_global_rejects: 4096,
        ..ProptestConfig::default()
    })]

    #[test]
    fn compiled_random_graphs_on_the_gpu_match_the_cpu(spec in spec_strategy(), seed in any::<u64>()) {
        if !gpu() {
            return Ok(());
        }
        check(&spec, seed)?;
    }
}
