//! `tessera bench gpt` at a tiny size on the CPU: one JSON line with
//! gpt_torch.py's keys, finite losses, and the same first loss eagerly and
//! compiled (same seed: same weights, same batch); bad flags are one-line
//! errors.

use std::process::{Command, Output};

use serde_json::Value;

fn tessera(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args(args)
        .output()
        .expect("the tessera binary runs")
}

const TINY: [&str; 18] = [
    "bench",
    "gpt",
    "--layers",
    "2",
    "--d-model",
    "32",
    "--heads",
    "2",
    "--vocab",
    "64",
    "--batch",
    "2",
    "--seq",
    "16",
    "--steps",
    "3",
    "--warmup",
    "1",
];

/// Runs the tiny benchmark with `extra` flags; its one JSON line.
fn bench(extra: &[&str]) -> Value {
    let args: Vec<&str> = TINY.iter().chain(extra).copied().collect();
    let out = tessera(&args);
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{args:?} failed: {stderr}");
    assert_eq!(stdout.lines().count(), 1, "one JSON line: {stdout}");
    assert!(
        stderr.contains("step   4/4"),
        "progress on stderr: {stderr}"
    );
    serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout}"))
}

fn number(line: &Value, key: &str) -> f64 {
    line[key]
        .as_f64()
        .unwrap_or_else(|| panic!("`{key}` is not a number in {line}"))
}

#[test]
fn bench_gpt_prints_one_json_line_and_both_modes_start_from_the_same_loss() {
    let eager = bench(&["--mode", "eager"]);
    let compiled = bench(&[]);
    for (line, mode) in [(&eager, "eager"), (&compiled, "compiled")] {
        assert_eq!(line["system"], "tessera", "{line}");
        assert_eq!(line["mode"], mode, "{line}");
        assert_eq!(line["dtype"], "f32", "{line}");
        assert_eq!(line["device"], "cpu", "{line}");
        // gpt_torch.py's count for this shape: embeddings 64·32 + 16·32,
        // 2 blocks of 12704, the final norm 64 and the head 32·64.
        assert_eq!(line["params"], 30080, "{line}");
        for key in [
            "ms_median",
            "tokens_per_s",
            "peak_mb",
            "base_mb",
            "first_step_s",
            "loss_first",
            "loss_last",
        ] {
            let v = number(line, key);
            assert!(v.is_finite() && v >= 0.0, "`{key}` = {v} in {line}");
        }
        assert!(number(line, "ms_median") > 0.0, "{line}");
        assert!(number(line, "peak_mb") >= number(line, "base_mb"), "{line}");
        let steps = line["step_ms"].as_array().expect("step_ms is a list");
        assert_eq!(steps.len(), 3, "{line}");
        // Random tokens over 64 ids: the first loss is near ln 64 = 4.16,
        // and three AdamW steps on the same batch lower it.
        let (first, last) = (number(line, "loss_first"), number(line, "loss_last"));
        assert!((first - 64f64.ln()).abs() < 0.5, "{line}");
        assert!(last < first, "{line}");
    }
    assert!(eager["compile_s"].is_null(), "{eager}");
    assert!(eager["trace_s"].is_null(), "{eager}");
    assert!(number(&compiled, "compile_s") > 0.0, "{compiled}");
    assert!(number(&compiled, "trace_s") > 0.0, "{compiled}");
    assert_eq!(number(&compiled, "tokens_per_s").fract(), 0.0, "{compiled}");
    assert_eq!(compiled["compiles"], 1, "{compiled}");
    let (a, b) = (
        number(&eager, "loss_first"),
        number(&compiled, "loss_first"),
    );
    assert!((a - b).abs() <= 1e-4, "eager {a} vs compiled {b}");
    let (a, b) = (number(&eager, "loss_last"), number(&compiled, "loss_last"));
    assert!((a - b).abs() <= 1e-3, "last: eager {a} vs compiled {b}");
}

#[test]
fn bench_gpt_in_bf16_compiled_runs_under_autocast() {
    let line = bench(&["--dtype", "bf16", "--schedule", "dfs"]);
    assert_eq!(line["dtype"], "bf16", "{line}");
    assert_eq!(line["schedule"], "dfs", "{line}");
    assert!(number(&line, "loss_last").is_finite(), "{line}");
}

#[test]
fn bench_gpt_in_f16_compiled_runs_with_the_steps_loss_scaler() {
    let line = bench(&["--dtype", "f16"]);
    assert_eq!(
        (&line["dtype"], &line["mode"]),
        (&"f16".into(), &"compiled".into()),
        "{line}"
    );
    assert_eq!(line["compiles"], 1, "{line}");
    let (first, last) = (number(&line, "loss_first"), number(&line, "loss_last"));
    assert!(last < first, "it learns: {line}");
    // PyTorch's initial scale, halved per skipped step.
    let skipped = number(&line, "skipped_steps");
    assert_eq!(
        number(&line, "loss_scale"),
        65536.0 / 2f64.powf(skipped),
        "{line}"
    );
}

/// A failure reported as one `error: …` line, exit code 1, no panic.
fn assert_one_line_error(args: &[&str], fragment: &str) {
    let out = tessera(args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
    assert!(err.starts_with("error: "), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert!(
        err.contains(fragment),
        "{args:?}: expected `{fragment}` in {err}"
    );
    assert!(out.stdout.is_empty(), "no JSON on failure");
}

#[test]
fn bench_gpt_refuses_bad_flags_in_one_line() {
    assert_one_line_error(
        &["bench", "gpt", "--d-model", "30", "--heads", "4"],
        "d_model 30 must be a multiple of heads 4",
    );
    assert_one_line_error(
        &["bench", "gpt", "--layers", "0", "--seq", "0"],
        "layers must be at least 1, got 0; seq must be at least 1",
    );
    assert_one_line_error(
        &["bench", "gpt", "--dtype", "i64", "--mode", "eager"],
        "dtype must be f32, bf16 or f16, got i64",
    );
    assert_one_line_error(
        &["bench", "gpt", "--mode", "eager", "--schedule", "dfs"],
        "not with --mode eager",
    );
    // Sizes past what a usize counts, and a model past any memory: errors,
    // not an overflow or an allocation abort.
    assert_one_line_error(
        &[
            "bench",
            "gpt",
            "--batch",
            "4294967296",
            "--seq",
            "4294967296",
        ],
        "logits are more than a usize counts",
    );
    let out = tessera(
        &"bench gpt --vocab 100000000000 --layers 1 --d-model 8 --heads 1 --seq 4 --batch 1"
            .split(' ')
            .collect::<Vec<_>>(),
    );
    // Past the checks of the flags: the run's header line, then the error.
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    let lines: Vec<&str> = err.trim_end().lines().collect();
    assert_eq!(lines.len(), 2, "{err}");
    assert!(lines[0].starts_with("bench gpt: 1 layers"), "{err}");
    assert!(
        lines[1].starts_with("error: bench gpt: the model's 1600000000920 f32 parameters")
            && lines[1].contains("do not fit on this device"),
        "{err}"
    );
    assert!(!err.contains("internal error"), "{err}");
    assert!(out.stdout.is_empty(), "no JSON on failure");
}

/// Without a GPU (CI's machines), `--device cuda` says so.
#[test]
fn bench_gpt_on_cuda_without_a_gpu_is_an_error() {
    if tessera_cuda::register().is_ok() {
        eprintln!("a GPU is here: --device cuda opens, nothing to refuse");
        return;
    }
    let mut args = TINY.to_vec();
    args.extend(["--device", "cuda"]);
    assert_one_line_error(&args, "--device cuda");
}
