//! Two of the `onnx` package's `light/` models (SqueezeNet and ResNet-50,
//! committed under `crates/tessera-onnx/tests/data/light/`, 95 KB: their
//! weights are ConstantOfShape nodes) with random weights
//! (`tessera_onnx::backend_test::randomise_constant_weights`), imported and
//! run on the GPU, compiled and interpreted, against the CPU's compiled
//! result. The GPU part runs only with `TESSERA_CUDA_TESTS=1` (there a
//! missing GPU is a failure); the CPU part (compiled against interpreted)
//! runs everywhere, a check of the harness itself.
//!
//! The models are found in `TESSERA_ONNX_LIGHT_DIR`, else in the source
//! tree this test was built from, else in `crates/tessera-onnx/tests/data/
//! light` under the working directory (a copy of the tree on a GPU machine).

use std::path::PathBuf;
use std::sync::Once;

use tessera::compile::{compile_graph, CompileOptions};
use tessera::ir::Op;
use tessera::runtime::device::Device;
use tessera::tensor::interpret::run_graph;
use tessera::tensor::Generator;
use tessera::{DType, Tensor};
use tessera_onnx::backend_test::randomise_constant_weights;
use tessera_onnx::{import, ImportOptions, Model};

fn gpu() -> bool {
    if std::env::var("TESSERA_CUDA_TESTS").as_deref() != Ok("1") {
        eprintln!("TESSERA_CUDA_TESTS is not 1: the light models do not run on CUDA here");
        return false;
    }
    static OPEN: Once = Once::new();
    OPEN.call_once(|| tessera_cuda::register().expect("TESSERA_CUDA_TESTS=1 needs a GPU"));
    true
}

fn model_path(file: &str) -> PathBuf {
    let rel = "crates/tessera-onnx/tests/data/light";
    let candidates: Vec<PathBuf> = std::env::var("TESSERA_ONNX_LIGHT_DIR")
        .into_iter()
        .map(PathBuf::from)
        .chain([
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../..")
                .join(rel),
            PathBuf::from(rel),
        ])
        .collect();
    candidates
        .iter()
        .map(|d| d.join(file))
        .find(|p| p.is_file())
        .unwrap_or_else(|| panic!("{file} is in none of {candidates:?}"))
}

/// The model with random weights, its graph inputs (data input then the
/// parameters) on the CPU.
fn prepare(file: &str) -> (tessera_onnx::Imported, Vec<Tensor>) {
    let mut model = Model::load(model_path(file)).unwrap();
    let replaced = randomise_constant_weights(&mut model, 7).unwrap();
    assert!(replaced > 20, "{file}: only {replaced} weights replaced");
    let imported = import(&model, &ImportOptions::default()).unwrap();
    let name = imported.model_inputs[0].clone();
    let ty = imported
        .graph
        .nodes
        .iter()
        .find(|n| matches!(n.op, Op::Input) && n.meta.name.as_deref() == Some(name.as_str()))
        .map(|n| n.ty.clone())
        .expect("the data input");
    let shape = ty.shape.as_concrete().expect("a fixed input shape");
    let x = Tensor::randn(&shape, DType::F32, &mut Generator::new(11));
    let args = imported.inputs(vec![(name, x)]).unwrap();
    (imported, args)
}

fn compiled(imported: &tessera_onnx::Imported, args: &[Tensor]) -> Vec<Tensor> {
    let exe = compile_graph(imported.graph.clone(), CompileOptions::default()).unwrap();
    exe.try_call(args).unwrap()
}

fn interpreted(imported: &tessera_onnx::Imported, args: &[Tensor]) -> Vec<Tensor> {
    run_graph(&imported.graph, args)
        .unwrap()
        .into_iter()
        .map(|(_, t)| t)
        .collect()
}

/// Every element within `rtol` of the reference, relative to the larger of
/// its own magnitude and a thousandth of the output's largest.
fn close(what: &str, got: &[Tensor], want: &[Tensor], rtol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: outputs");
    for (k, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.shape(), w.shape(), "{what}: output {k}");
        let g = g.to(Device::Cpu).unwrap().to_f64_vec();
        let w = w.to_f64_vec();
        let scale = w.iter().fold(0.0f64, |m, v| m.max(v.abs()));
        assert!(
            scale.is_finite() && scale > 0.0,
            "{what}: output {k} scale {scale}"
        );
        for (i, (a, b)) in g.iter().zip(&w).enumerate() {
            assert!(
                (a - b).abs() <= rtol * (b.abs() + 1e-3 * scale),
                "{what}: output {k}[{i}]: {a} vs {b} (scale {scale})"
            );
        }
    }
}

fn check(file: &str) {
    let (imported, args) = prepare(file);
    let cpu = compiled(&imported, &args);
    close(
        &format!("{file} CPU interpreted"),
        &interpreted(&imported, &args),
        &cpu,
        1e-3,
    );
    if !gpu() {
        return;
    }
    let on_gpu: Vec<Tensor> = args.iter().map(|t| t.to(Device::Cuda).unwrap()).collect();
    let out = compiled(&imported, &on_gpu);
    assert!(
        out.iter().all(|t| t.device() == Device::Cuda),
        "{file}: stayed on the GPU"
    );
    close(&format!("{file} CUDA compiled"), &out, &cpu, 1e-3);
    close(
        &format!("{file} CUDA interpreted"),
        &interpreted(&imported, &on_gpu),
        &cpu,
        1e-3,
    );
}

#[test]
fn squeezenet_with_random_weights_on_cuda_matches_the_cpu() {
    check("light_squeezenet.onnx");
}

#[test]
fn resnet50_with_random_weights_on_cuda_matches_the_cpu() {
    check("light_resnet50.onnx");
}
