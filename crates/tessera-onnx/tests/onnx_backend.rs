//! The `onnx` Python package's backend test data run through tessera:
//! every case read, interpreted and compiled, its outputs compared with the
//! expected ones. The data comes from `scripts/onnx_test_data.py` (the
//! shipped model cases and the generated node cases) into the folder
//! `TESSERA_ONNX_DATA` names; without it the test generates the data with
//! the first Python that has the `onnx` package (`TESSERA_PYTHON`, the CI
//! venv, `python3`), and fails, saying so, when none has.
//!
//! Prints the pass rate by category, the unsupported cases by op, and every
//! failure. Fails on a failure that `tests/onnx_known_failures.txt` does
//! not list with its reason (for every device, or `cuda:` for CUDA alone),
//! and on a listed case that now passes.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use tessera::runtime::device::Device;
use tessera_onnx::backend_test::{cases, run_case, Outcome};

const KINDS: [&str; 4] = ["node", "pytorch-converted", "pytorch-operator", "simple"];

fn data_dir() -> PathBuf {
    if let Ok(d) = std::env::var("TESSERA_ONNX_DATA") {
        return PathBuf::from(d);
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let out = std::env::temp_dir().join("tessera-onnx-test-data");
    if out.join("node").is_dir() {
        return out;
    }
    let script = root.join("scripts/onnx_test_data.py");
    let venv = std::env::temp_dir().join("tessera-py-venv/bin/python");
    let candidates: Vec<String> = std::env::var("TESSERA_PYTHON")
        .into_iter()
        .chain([venv.display().to_string(), "python3".to_string()])
        .collect();
    for py in &candidates {
        let has_onnx = Command::new(py)
            .args(["-c", "import onnx"])
            .output()
            .is_ok_and(|o| o.status.success());
        if !has_onnx {
            continue;
        }
        let status = Command::new(py).arg(&script).arg(&out).status();
        assert!(
            status.is_ok_and(|s| s.success()),
            "{py} {} {} failed",
            script.display(),
            out.display()
        );
        return out;
    }
    panic!(
        "the ONNX backend test data is missing: no Python among {candidates:?} has the `onnx` \
         package. Install it (`pip install onnx`, as .ci/run does into its venv) or point \
         TESSERA_ONNX_DATA at the output of scripts/onnx_test_data.py"
    );
}

/// The cases listed as failing on `device`, with their reasons: every
/// unprefixed line, and on CUDA the lines prefixed `cuda:` (failures of
/// that device alone); the bool says whether the line is device-specific.
fn known_failures(device: Device) -> BTreeMap<String, (String, bool)> {
    let text = include_str!("onnx_known_failures.txt");
    text.lines()
        .filter(|l| !l.trim().is_empty() && !l.starts_with('#'))
        .filter_map(|l| {
            let (label, why) = l.split_once(char::is_whitespace).unwrap_or((l, ""));
            let (label, own) = match label.strip_prefix("cuda:") {
                Some(rest) if device == Device::Cuda => (rest, true),
                Some(_) => return None,
                None => (label, false),
            };
            Some((label.to_string(), (why.trim().to_string(), own)))
        })
        .collect()
}

#[test]
fn onnx_backend_test_data() {
    run_all(Device::Cpu);
}

/// The same cases with the inputs and weights on the GPU (interpreted and
/// compiled by the CUDA backend). Runs only with `TESSERA_CUDA_TESTS=1`.
#[test]
fn onnx_backend_test_data_on_cuda() {
    if std::env::var("TESSERA_CUDA_TESTS").as_deref() != Ok("1") {
        eprintln!("TESSERA_CUDA_TESTS is not 1: the ONNX cases do not run on CUDA here");
        return;
    }
    tessera_cuda::register().expect("a CUDA device");
    run_all(Device::Cuda);
}

fn run_all(device: Device) {
    let root = data_dir();
    let filter = std::env::var("TESSERA_ONNX_FILTER").ok();
    let known = known_failures(device);
    let mut unsupported_ops: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut unsupported_types: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut unexpected = Vec::new();
    let mut fixed = Vec::new();
    let mut total_cases = 0;
    println!("ONNX backend test data in {} on {device:?}", root.display());
    for kind in KINDS {
        let (mut pass, mut fail, mut unsup) = (0, 0, 0);
        let dirs = cases(&root, kind);
        assert!(
            !dirs.is_empty() || filter.is_some(),
            "no cases in {}/{kind}",
            root.display()
        );
        for dir in dirs {
            let name = dir.file_name().unwrap().to_string_lossy().into_owned();
            if filter.as_ref().is_some_and(|f| !name.contains(f.as_str())) {
                continue;
            }
            total_cases += 1;
            let label = format!("{kind}/{name}");
            match run_case(&dir, device) {
                Outcome::Pass => {
                    pass += 1;
                    // A case every device fails passing here is news only
                    // on the CPU (the list's reference device); one listed
                    // for this device alone, on any.
                    match known.get(&label) {
                        Some((_, own)) if *own || device == Device::Cpu => fixed.push(label),
                        _ => {}
                    }
                }
                Outcome::UnsupportedOps(ops) => {
                    unsup += 1;
                    unsupported_ops
                        .entry(ops.join("+"))
                        .or_default()
                        .push(label);
                }
                Outcome::UnsupportedType(why) => {
                    unsup += 1;
                    let ty = why
                        .split("element type ")
                        .nth(1)
                        .and_then(|s| s.split(',').next())
                        .unwrap_or(&why)
                        .to_string();
                    unsupported_types.entry(ty).or_default().push(label);
                }
                Outcome::Fail(why) => {
                    fail += 1;
                    println!("FAIL {label}: {why}");
                    if !known.contains_key(&label) {
                        unexpected.push(label);
                    }
                }
            }
        }
        let supported = pass + fail;
        let rate = if supported == 0 {
            100.0
        } else {
            100.0 * pass as f64 / supported as f64
        };
        println!(
            "{kind}: {pass}/{supported} supported cases pass ({rate:.1} %), {unsup} unsupported"
        );
    }
    println!("unsupported op types (cases):");
    for (op, cases) in &unsupported_ops {
        println!("  {op}: {}", cases.len());
    }
    println!("unsupported element types (cases):");
    for (ty, cases) in &unsupported_types {
        println!("  {ty}: {}", cases.len());
    }
    assert!(total_cases > 0, "no case ran");
    assert!(
        unexpected.is_empty(),
        "{} cases failed that tests/onnx_known_failures.txt does not list: {unexpected:?}",
        unexpected.len()
    );
    assert!(
        fixed.is_empty() || filter.is_some(),
        "cases listed in tests/onnx_known_failures.txt now pass (remove them): {fixed:?}"
    );
}
