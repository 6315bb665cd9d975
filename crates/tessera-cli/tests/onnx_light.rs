//! The `onnx` package's `light/` models (ResNet-50, DenseNet-121,
//! Inception v1/v2, ShuffleNet, SqueezeNet; VGG-19, AlexNet and ZFNet with
//! `TESSERA_ONNX_LIGHT_ALL=1`) with random weights, run by the `tessera`
//! binary compiled and interpreted and compared with ONNX Runtime within
//! f32 tolerance: `scripts/onnx_light_models.py` does the work (it writes
//! the randomised models, runs ONNX Runtime and `tessera run`, compares).
//!
//! The default set takes about 20 s on a 2-core machine; the three left
//! out carry 250 to 550 MB of weights each (a few seconds each to run,
//! but written to disk for every run).
//!
//! Needs a Python with `onnx` and `onnxruntime` (`TESSERA_PYTHON`, the CI
//! venv, `python3`, as .ci/run installs them); fails, saying so, when none
//! has them.

use std::path::Path;
use std::process::Command;

const DEFAULT: &str = "squeezenet,shufflenet,inception_v1,inception_v2,densenet121,resnet50";
const ALL: &str = "squeezenet,shufflenet,inception_v1,inception_v2,densenet121,resnet50,bvlc_alexnet,zfnet512,vgg19";

fn python() -> String {
    let venv = std::env::temp_dir().join("tessera-py-venv/bin/python");
    let candidates: Vec<String> = std::env::var("TESSERA_PYTHON")
        .into_iter()
        .chain([venv.display().to_string(), "python3".to_string()])
        .collect();
    for py in &candidates {
        let ok = Command::new(py)
            .args(["-c", "import onnx, onnxruntime"])
            .output()
            .is_ok_and(|o| o.status.success());
        if ok {
            return py.clone();
        }
    }
    panic!(
        "no Python among {candidates:?} has the `onnx` and `onnxruntime` packages: install them \
         (`pip install onnx==1.23.2 onnxruntime`, as .ci/run does into its venv) or point \
         TESSERA_PYTHON at one that has them"
    );
}

#[test]
fn light_models_with_random_weights_match_onnx_runtime() {
    let py = python();
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let script = root.join("scripts/onnx_light_models.py");
    let models = match std::env::var("TESSERA_ONNX_LIGHT_ALL").as_deref() {
        Ok("1") => ALL,
        _ => DEFAULT,
    };
    let out = tempfile::tempdir().unwrap();
    let run = Command::new(&py)
        .arg(&script)
        .args(["--tessera", env!("CARGO_BIN_EXE_tessera")])
        .args(["--models", models])
        .arg("--out")
        .arg(out.path())
        .output()
        .expect("the script runs");
    let stdout = String::from_utf8_lossy(&run.stdout);
    let stderr = String::from_utf8_lossy(&run.stderr);
    println!("{stdout}");
    assert!(
        run.status.success(),
        "{} failed:\n{stdout}\n{stderr}",
        script.display()
    );
    // One PASS line per model, each compiled and interpreted.
    for model in models.split(',') {
        let line = stdout
            .lines()
            .find(|l| l.starts_with(&format!("{model}: ")))
            .unwrap_or_else(|| panic!("no result for {model}:\n{stdout}"));
        assert!(
            line.contains("PASS")
                && line.contains("compiled: pass")
                && line.contains("interpreted: pass"),
            "{line}"
        );
    }
}
