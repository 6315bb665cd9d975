//! Runs the built `tessera` binary on graph files written by the printer.

use std::path::Path;
use std::process::{Command, Output};

use tessera::ir::{Dim, NodeMeta, Op, Shape, TensorType};
use tessera::{DType, Graph, Tensor};

fn tessera(args: &[&str], cwd: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args(args)
        .current_dir(cwd)
        .output()
        .expect("the tessera binary runs")
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// A failure reported as one `error: …` line with a non-zero exit code.
fn assert_one_line_error(out: &Output) -> String {
    let err = stderr(out);
    assert!(!out.status.success(), "expected a failure, stderr: {err}");
    assert!(err.starts_with("error: "), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert!(!err.contains("panicked"), "{err}");
    err
}

fn shape(dims: &[&str]) -> Shape {
    Shape::new(dims.iter().map(|d| Dim::parse(d).unwrap()).collect())
}

fn named(name: &str) -> NodeMeta {
    NodeMeta::named(name)
}

/// `y = x.reshape(s0, 2, 3).permute(0, 2, 1)` with `x: f32[s0,6]`.
fn movement_graph() -> Graph {
    let mut g = Graph::new("moves");
    let ty = TensorType {
        dtype: DType::F32,
        shape: shape(&["s0", "6"]),
    };
    let x = g.add_input("x", ty);
    let r = g
        .add(Op::Reshape(shape(&["s0", "2", "3"])), &[x], named("r"))
        .unwrap();
    let y = g.add(Op::Permute(vec![0, 2, 1]), &[r], named("y")).unwrap();
    g.add_output("y", y);
    g
}

fn write_graph(dir: &Path, g: &Graph) {
    std::fs::write(dir.join("g.tir"), g.to_string()).unwrap();
}

#[test]
fn run_writes_each_output_as_npy() {
    let dir = tempfile::tempdir().unwrap();
    write_graph(dir.path(), &movement_graph());
    let x = Tensor::from_vec((0..12).map(|v| v as f32).collect(), &[2, 6]);
    tessera::io::write_npy(dir.path().join("x.npy"), &x).unwrap();
    let out = tessera(
        &["run", "g.tir", "--input", "x=x.npy", "--output-dir", "out"],
        dir.path(),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.contains("y  f32[2,3,2]"), "{text}");
    assert!(
        text.contains("ran graph `moves` (interpreted) in "),
        "{text}"
    );
    let y = tessera::io::read_npy(dir.path().join("out/y.npy")).unwrap();
    assert_eq!(y.shape(), &[2, 3, 2]);
    assert_eq!(
        y.to_vec::<f32>().unwrap(),
        vec![0., 3., 1., 4., 2., 5., 6., 9., 7., 10., 8., 11.]
    );
}

#[test]
fn random_inputs_are_seeded_and_need_sizes() {
    let dir = tempfile::tempdir().unwrap();
    write_graph(dir.path(), &movement_graph());
    let symbolic = tessera(
        &["run", "g.tir", "--random-inputs", "7", "--output-dir", "o"],
        dir.path(),
    );
    let err = assert_one_line_error(&symbolic);
    assert!(err.contains("input `x` has type f32[s0,6]"), "{err}");

    let mut g = Graph::new("concrete");
    let x = g.add_input("x", TensorType::new(DType::F32, vec![4, 6]));
    let y = g.add(Op::Permute(vec![1, 0]), &[x], named("y")).unwrap();
    g.add_output("y", y);
    write_graph(dir.path(), &g);
    let read = |out_dir: &str| {
        let out = tessera(
            &[
                "run",
                "g.tir",
                "--random-inputs",
                "7",
                "--output-dir",
                out_dir,
            ],
            dir.path(),
        );
        assert!(out.status.success(), "{}", stderr(&out));
        let y = tessera::io::read_npy(dir.path().join(out_dir).join("y.npy")).unwrap();
        assert_eq!(y.shape(), &[6, 4]);
        y.to_vec::<f32>().unwrap()
    };
    let (a, b) = (read("a"), read("b"));
    assert_eq!(a, b, "the same seed gives the same inputs");
    assert!(a.iter().any(|&v| v != a[0]), "samples vary: {a:?}");
}

#[test]
fn missing_inputs_are_listed_with_their_types() {
    let dir = tempfile::tempdir().unwrap();
    write_graph(dir.path(), &movement_graph());
    let out = tessera(&["run", "g.tir", "--output-dir", "out"], dir.path());
    let err = assert_one_line_error(&out);
    assert!(err.contains("missing input `x`"), "{err}");
    assert!(err.contains("x: f32[s0,6]"), "{err}");
}

#[test]
fn inspect_prints_the_graph_and_a_summary() {
    let dir = tempfile::tempdir().unwrap();
    let g = movement_graph();
    write_graph(dir.path(), &g);
    let out = tessera(&["inspect", "g.tir"], dir.path());
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.starts_with(g.to_string().trim_end()), "{text}");
    for line in [
        "3 nodes",
        "  input          1",
        "  permute        1",
        "  reshape        1",
        "  x: f32[s0,6]",
        "  y: f32[s0,3,2]",
    ] {
        assert!(text.contains(line), "missing `{line}` in:\n{text}");
    }
}

#[test]
fn inspect_with_passes_prints_the_optimised_graph_and_the_changes() {
    let dir = tempfile::tempdir().unwrap();
    let src = "graph g(%x, %w) {
  %x = input : f32[4,3]
  %w = input : f32[5,3]
  %wt = permute(%w) {perm=[1,0]} : f32[3,5]
  %h = matmul(%x, %wt) : f32[4,5]
  %one = full {value=1.0, shape=[], dtype=f32} : f32[]
  %y = mul(%h, %one) : f32[4,5]
  return %y as y
}
";
    std::fs::write(dir.path().join("g.tir"), src).unwrap();
    let out = tessera(&["inspect", "g.tir", "--passes", "default"], dir.path());
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    let optimised = "graph g(%x, %w) {
  %x = input : f32[4,3]
  %w = input : f32[5,3]
  %h = matmul_t(%x, %w) {transpose_a=false, transpose_b=true} : f32[4,5]
  return %h as y
}";
    assert!(text.starts_with(optimised), "{text}");
    for line in [
        "passes `default` (fixed point after 2 rounds): 6 -> 3 nodes",
        "  neutral_elements         changed 1 times, -2 nodes",
        "  transpose_matmul         changed 1 times, -1 nodes",
        "  cse                      changed 0 times, +0 nodes",
    ] {
        assert!(text.contains(line), "missing `{line}` in:\n{text}");
    }
    let out = tessera(&["inspect", "g.tir", "--passes", "cse,fold"], dir.path());
    let err = assert_one_line_error(&out);
    assert!(err.contains("unknown pass `fold`"), "{err}");
}

#[test]
fn a_missing_graph_file_is_a_one_line_error() {
    let dir = tempfile::tempdir().unwrap();
    let out = tessera(&["inspect", "nowhere.tir"], dir.path());
    let err = assert_one_line_error(&out);
    assert!(err.starts_with("error: nowhere.tir: "), "{err}");
}

#[test]
fn garbage_is_reported_with_its_line() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("bad.tir"), "this is not a graph\n").unwrap();
    let out = tessera(&["run", "bad.tir", "--output-dir", "out"], dir.path());
    let err = assert_one_line_error(&out);
    assert!(err.starts_with("error: bad.tir:1:"), "{err}");
}

#[test]
fn an_input_without_a_name_is_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let out = tessera(
        &["run", "g.tir", "--input", "x.npy", "--output-dir", "out"],
        dir.path(),
    );
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(err.contains("expected NAME=FILE, got `x.npy`"), "{err}");
}

/// Flags for a run that takes a second or two even in a debug build.
const TINY_RUN: &[&str] = &[
    "train",
    "--digits",
    "4",
    "--steps",
    "30",
    "--batch",
    "32",
    "--lr",
    "1e-2",
    "--warmup",
    "5",
    "--d-model",
    "32",
    "--n-heads",
    "2",
    "--n-layers",
    "1",
    "--d-ff",
    "64",
    "--max-len",
    "8",
    "--eval-every",
    "10",
    "--eval-size",
    "50",
    "--out-dir",
    "run",
];

#[test]
fn train_writes_a_checkpoint_a_plot_and_a_summary() {
    let dir = tempfile::tempdir().unwrap();
    let out = tessera(TINY_RUN, dir.path());
    assert!(out.status.success(), "stderr: {}", stderr(&out));
    let text = stdout(&out);
    // Piped output: one line per evaluation and the summary, no bar.
    assert_eq!(text.matches("exact match").count(), 4, "{text}");
    assert!(text.contains("final held-out exact match"), "{text}");

    let run = dir.path().join("run");
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["losses"].as_array().unwrap().len(), 30);
    assert_eq!(summary["evals"].as_array().unwrap().len(), 3);
    assert_eq!(summary["config"]["digits"], 4);
    let accuracy = summary["final_accuracy"].as_f64().unwrap();
    assert!((0.0..=1.0).contains(&accuracy));
    assert!(summary["tokens_per_s"].as_f64().unwrap() > 0.0);
    // Compiled by default, in f32: one compile, its time in the summary.
    assert_eq!(summary["config"]["execution"], "compiled");
    assert_eq!(summary["config"]["dtype"], "f32");
    assert_eq!(summary["compile"]["compiles"], 1);
    assert_eq!(summary["compile"]["recompiles"], 0);
    assert!(summary["compile"]["compile_seconds"].as_f64().unwrap() > 0.0);
    assert!(text.contains("compiled f32"), "{text}");
    assert!(
        text.contains("compile: 1 compile (0 recompiles) in "),
        "{text}"
    );
    let png = std::fs::read(run.join("loss.png")).unwrap();
    assert!(png.starts_with(b"\x89PNG"));
    let checkpoint = tessera::io::load_safetensors(run.join("model.safetensors")).unwrap();
    assert!(checkpoint.iter().any(|(name, _)| name == "head.weight"));
}

/// `--task digits`: a CNN on the real 8×8 digits; 100 steps (well under
/// a second in release) reach the accuracy the README states for the task.
#[test]
fn train_digits_learns_the_real_images() {
    let dir = tempfile::tempdir().unwrap();
    let out = tessera(
        &[
            "train",
            "--task",
            "digits",
            "--steps",
            "100",
            "--out-dir",
            "run",
        ],
        dir.path(),
    );
    assert!(out.status.success(), "stderr: {}", stderr(&out));
    let text = stdout(&out);
    assert_eq!(text.matches("test accuracy").count(), 3, "{text}");
    let run = dir.path().join("run");
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["losses"].as_array().unwrap().len(), 100);
    assert_eq!(summary["test_images"], 300);
    assert_eq!(summary["train_images"], 1497);
    assert_eq!(summary["compile"]["compiles"], 1);
    let accuracy = summary["final_accuracy"].as_f64().unwrap();
    assert!(accuracy >= 0.95, "test accuracy {accuracy}");
    let losses = summary["losses"].as_array().unwrap();
    assert!(losses[99].as_f64().unwrap() < losses[0].as_f64().unwrap() / 5.0);
    assert!(std::fs::read(run.join("loss.png"))
        .unwrap()
        .starts_with(b"\x89PNG"));
    let checkpoint = tessera::io::load_safetensors(run.join("model.safetensors")).unwrap();
    assert!(checkpoint.iter().any(|(name, _)| name == "conv1.weight"));
    // bf16 and the GPU are the reversal task's only.
    let out = tessera(
        &["train", "--task", "digits", "--dtype", "bf16"],
        dir.path(),
    );
    assert!(!out.status.success());
    assert!(stderr(&out).contains("f32 on the cpu"), "{}", stderr(&out));
}

#[test]
fn train_eager_in_bf16_says_so_and_reports_no_compile() {
    let dir = tempfile::tempdir().unwrap();
    let mut args = TINY_RUN.to_vec();
    let steps = args.iter().position(|&a| a == "--steps").unwrap();
    args[steps + 1] = "10";
    args.extend(["--eager", "--dtype", "bf16"]);
    let out = tessera(&args, dir.path());
    assert!(out.status.success(), "stderr: {}", stderr(&out));
    let text = stdout(&out);
    assert!(text.contains("eager bf16"), "{text}");
    assert!(!text.contains("compile:"), "{text}");
    let summary: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join("run/summary.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(summary["config"]["execution"], "eager");
    assert_eq!(summary["config"]["dtype"], "bf16");
    assert!(summary["compile"].is_null());
    assert_eq!(summary["losses"].as_array().unwrap().len(), 10);
}

/// The losses a run wrote to `dir/run/summary.json`, and the summary.
fn run_losses(dir: &Path) -> (Vec<f64>, serde_json::Value) {
    let text = std::fs::read_to_string(dir.join("run/summary.json")).unwrap();
    let summary: serde_json::Value = serde_json::from_str(&text).unwrap();
    let losses = summary["losses"].as_array().unwrap();
    let losses = losses.iter().map(|l| l.as_f64().unwrap()).collect();
    (losses, summary)
}

/// `--ranks 2` (and `--zero`): data parallel on two CPU threads, each on
/// half of every batch, trains as the single run on the whole batch;
/// one rank prints.
#[test]
fn train_on_two_cpu_ranks_gives_the_single_runs_losses() {
    let one = tempfile::tempdir().unwrap();
    let out = tessera(TINY_RUN, one.path());
    assert!(out.status.success(), "stderr: {}", stderr(&out));
    let (alone, _) = run_losses(one.path());
    for zero in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let mut args = TINY_RUN.to_vec();
        args.extend(["--ranks", "2"]);
        if zero {
            args.push("--zero");
        }
        let out = tessera(&args, dir.path());
        assert!(out.status.success(), "stderr: {}", stderr(&out));
        let text = stdout(&out);
        assert_eq!(
            text.matches("final held-out exact match").count(),
            1,
            "{text}"
        );
        assert!(
            text.contains("data parallel over 2 CPU ranks, 16 strings each"),
            "{text}"
        );
        let (losses, summary) = run_losses(dir.path());
        assert_eq!(
            (summary["ranks"].as_u64(), summary["zero"].as_bool()),
            (Some(2), Some(zero))
        );
        assert_eq!(losses.len(), alone.len());
        for (i, (a, b)) in losses.iter().zip(&alone).enumerate() {
            // Stated tolerance: 1e-4 relative (f32; measured 2e-7).
            assert!((a - b).abs() <= 1e-4 * b.abs(), "step {i}: {a} vs {b}");
        }
    }
}

#[test]
fn train_refuses_data_parallel_flags_that_cannot_run() {
    let cases: &[(&[&str], &str)] = &[
        (
            &["--ranks", "2", "--batch", "33"],
            "does not split evenly over 2 ranks",
        ),
        (&["--ranks", "2", "--eager"], "compiled steps"),
        (&["--zero"], "--zero shards the optimizer over ranks"),
        (
            &["--ranks", "2", "--device", "cuda"],
            "--ranks 2 trains on CPU threads",
        ),
        (
            &["--gpus", "2"],
            "--gpus 2 runs one process per GPU: needs --device cuda",
        ),
        (&["--gpus", "2", "--ranks", "2"], "one or the other"),
        (&["--ranks", "0"], "must be at least 1"),
        (
            &["--task", "digits", "--ranks", "2"],
            "--task digits trains on one CPU",
        ),
    ];
    for (flags, want) in cases {
        let dir = tempfile::tempdir().unwrap();
        let mut args = vec!["train", "--out-dir", "run"];
        args.extend_from_slice(flags);
        let err = assert_one_line_error(&tessera(&args, dir.path()));
        assert!(err.contains(want), "{flags:?}: {err}");
        assert!(!dir.path().join("run").exists(), "{flags:?}");
    }
}

#[test]
fn train_rejects_a_dtype_it_cannot_train_in() {
    let dir = tempfile::tempdir().unwrap();
    let out = tessera(&["train", "--dtype", "f64", "--out-dir", "run"], dir.path());
    let err = assert_one_line_error(&out);
    assert!(
        err.contains("dtype must be f32, bf16 or f16 (the precision of the forward), got f64"),
        "{err}"
    );
    assert!(!dir.path().join("run").exists());
}

#[test]
fn train_rejects_a_sequence_longer_than_max_len() {
    let dir = tempfile::tempdir().unwrap();
    let out = tessera(&["train", "--digits", "9", "--out-dir", "run"], dir.path());
    let err = assert_one_line_error(&out);
    assert!(
        err.contains("max_len 16 is shorter than the 18 tokens the model reads for 9 digits"),
        "{err}"
    );
    assert!(
        !dir.path().join("run").exists(),
        "nothing written on bad flags"
    );
}

#[test]
fn train_rejects_an_unknown_decay() {
    let dir = tempfile::tempdir().unwrap();
    let out = tessera(&["train", "--decay", "exp"], dir.path());
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("unknown decay `exp`: expected cosine, linear or constant"),
        "{err}"
    );
}

/// A `.npy` file of `descr` and `shape` (its header only, then `data`),
/// written by hand: shapes no tensor may have cannot be written by tessera.
fn write_raw_npy(path: &Path, descr: &str, shape: &str, data: &[u8]) {
    let dict = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}");
    // Magic, version 1.0, header length; the header ends in '\n' at a
    // multiple of 64 bytes.
    let unpadded = 10 + dict.len() + 1;
    let header = format!(
        "{dict}{}\n",
        " ".repeat(unpadded.next_multiple_of(64) - unpadded)
    );
    let mut bytes = b"\x93NUMPY\x01\x00".to_vec();
    bytes.extend_from_slice(&(header.len() as u16).to_le_bytes());
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(data);
    std::fs::write(path, bytes).unwrap();
}

/// Exit code 1 and one line naming the problem; no signal, no panic.
fn assert_clean_failure(out: &Output) -> String {
    assert_eq!(out.status.code(), Some(1), "{}", stderr(out));
    assert_one_line_error(out)
}

#[test]
fn an_npy_of_zero_by_two_to_the_62_is_refused_not_a_segfault() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("g.tir"),
        "graph g(%a) {
  %a = input : f32[0,s0]
  %b = full {value=1.0, shape=[s0], dtype=f32} : f32[s0]
  return %b as b
}
",
    )
    .unwrap();
    write_raw_npy(
        &dir.path().join("a.npy"),
        "<f4",
        "(0, 4611686018427387904)",
        &[],
    );
    let out = tessera(
        &["run", "g.tir", "--input", "a=a.npy", "--output-dir", "out"],
        dir.path(),
    );
    let err = assert_clean_failure(&out);
    assert!(
        err.contains("a.npy: shape [0, 4611686018427387904] of f32 is too large")
            && err.contains("2^46"),
        "{err}"
    );
    // A size that fits: the graph runs.
    write_raw_npy(&dir.path().join("a.npy"), "<f4", "(0, 3)", &[]);
    let out = tessera(
        &["run", "g.tir", "--input", "a=a.npy", "--output-dir", "out"],
        dir.path(),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let b = tessera::io::read_npy(dir.path().join("out/b.npy")).unwrap();
    assert_eq!(b.to_vec::<f32>().unwrap(), vec![1.0; 3]);
}

#[test]
fn a_symbolic_size_that_overflows_is_an_error_naming_the_node() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("g.tir"),
        "graph g(%a) {
  %a = input : f32[0,s0]
  %b = full {value=1.0, shape=[s0*s0+1], dtype=f32} : f32[s0*s0+1]  # model.rs:3:7
  return %b as b
}
",
    )
    .unwrap();
    write_raw_npy(&dir.path().join("a.npy"), "<f4", "(0, 4294967296)", &[]);
    let out = tessera(
        &["run", "g.tir", "--input", "a=a.npy", "--output-dir", "out"],
        dir.path(),
    );
    let err = assert_clean_failure(&out);
    assert!(
        err.contains(
            "full: node `b`: shape [s0*s0+1] has no size at s0 = 4294967296: it overflows"
        ) && err.contains("model.rs:3:7"),
        "{err}"
    );
}

/// Whether one allocation of `bytes` is refused by this system (Linux's
/// default heuristic overcommit refuses more than RAM + swap).
fn refuses_beyond_memory(bytes: u64) -> bool {
    let mode = std::fs::read_to_string("/proc/sys/vm/overcommit_memory").unwrap_or_default();
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let kb = |key: &str| -> u64 {
        meminfo
            .lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
            .unwrap_or(u64::MAX / 2048)
    };
    matches!(mode.trim(), "0" | "2") && bytes / 1024 > kb("MemTotal:") + kb("SwapTotal:")
}

#[test]
fn full_of_a_million_by_a_million_is_out_of_memory_not_an_abort() {
    let dir = tempfile::tempdir().unwrap();
    // 4 TB of f32 where the system refuses it; else 2^49 bytes of f64, more
    // than a 47-bit address space, refused everywhere.
    let (shape, dtype, bytes) = match refuses_beyond_memory(4_000_000_000_000) {
        true => ("[1000000,1000000]", "f32", "4000000000000 bytes (4.0 TB)"),
        false => ("[8388608,8388608]", "f64", "562949953421312 bytes"),
    };
    std::fs::write(
        dir.path().join("g.tir"),
        format!(
            "graph g() {{
  %big = full {{value=0.5, shape={shape}, dtype={dtype}}} : {dtype}{shape}  # model.rs:2:11
  return %big as big
}}
"
        ),
    )
    .unwrap();
    let out = tessera(&["run", "g.tir", "--output-dir", "out"], dir.path());
    let err = assert_clean_failure(&out);
    assert!(
        err.contains(&format!("full: node `big`: out of memory: {bytes}"))
            && err.contains("model.rs:2:11"),
        "{err}"
    );
    assert!(!err.contains("internal error"), "{err}");
}

/// A small ONNX model with a dynamic batch: y = relu(x @ w) (w: 4x20, a
/// weight the model carries), and `t`, the transposed input.
fn onnx_model(dir: &Path) {
    use tessera_onnx::build::{f32_tensor, model, node, value, D};
    use tessera_onnx::proto::data_type::FLOAT;
    let w: Vec<f32> = (0..80).map(|i| (i % 7) as f32 - 3.0).collect();
    let bytes = model(
        17,
        vec![
            node("MatMul", &["x", "w"], &["h"], vec![]),
            node("Relu", &["h"], &["y"], vec![]),
            node("Transpose", &["x"], &["t"], vec![]),
        ],
        vec![value("x", FLOAT, &[D::Param("batch"), D::Size(4)])],
        vec![
            value("y", FLOAT, &[D::Param("batch"), D::Size(20)]),
            value("t", FLOAT, &[D::Size(4), D::Param("batch")]),
        ],
        vec![f32_tensor("w", &[4, 20], &w)],
    );
    std::fs::write(dir.join("m.onnx"), bytes).unwrap();
}

#[test]
fn run_and_inspect_read_onnx_models() {
    let dir = tempfile::tempdir().unwrap();
    onnx_model(dir.path());
    let x = Tensor::from_vec((0..12).map(|v| v as f32 - 5.0).collect(), &[3, 4]);
    tessera::io::write_npy(dir.path().join("x.npy"), &x).unwrap();
    let mut results = Vec::new();
    for mode in [&[][..], &["--interpret"][..], &["--bench", "2"][..]] {
        let mut args = vec!["run", "m.onnx", "--input", "x=x.npy", "--output-dir", "out"];
        args.extend(mode);
        let out = tessera(&args, dir.path());
        assert!(out.status.success(), "{}", stderr(&out));
        let text = stdout(&out);
        let how = if mode.contains(&"--interpret") {
            "interpreted"
        } else {
            "compiled"
        };
        assert!(text.contains(&format!("ran graph `g` ({how})")), "{text}");
        assert!(
            text.contains("y  f32[3,20]") && text.contains("t  f32[4,3]"),
            "{text}"
        );
        if mode.contains(&"--bench") {
            assert!(
                text.contains("median") && text.contains("peak memory"),
                "{text}"
            );
        }
        results.push(
            tessera::io::read_npy(dir.path().join("out/y.npy"))
                .unwrap()
                .to_vec::<f32>()
                .unwrap(),
        );
    }
    let xv = x.to_vec::<f32>().unwrap();
    let want: Vec<f32> = (0..3)
        .flat_map(|r| {
            let xv = &xv;
            (0..20).map(move |j| {
                (0..4)
                    .map(|k| xv[r * 4 + k] * (((k * 20 + j) % 7) as f32 - 3.0))
                    .sum::<f32>()
                    .max(0.0)
            })
        })
        .collect();
    for got in &results {
        assert_eq!(got, &want);
    }
    // In bf16 (compiled, and interpreted): written as f32, within bf16
    // rounding.
    let out = tessera(
        &[
            "run",
            "m.onnx",
            "--input",
            "x=x.npy",
            "--output-dir",
            "o16",
            "--dtype",
            "bf16",
        ],
        dir.path(),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains("y  bf16[3,20]"), "{}", stdout(&out));
    let y16 = tessera::io::read_npy(dir.path().join("o16/y.npy"))
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    for (a, b) in y16.iter().zip(&want) {
        assert!((a - b).abs() <= 0.02 * b.abs().max(1.0), "{a} vs {b}");
    }
    let out = tessera(
        &[
            "run",
            "m.onnx",
            "--input",
            "x=x.npy",
            "--output-dir",
            "o16i",
            "--dtype",
            "bf16",
            "--interpret",
        ],
        dir.path(),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let y16i = tessera::io::read_npy(dir.path().join("o16i/y.npy"))
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    assert_eq!(y16i, y16);
    let out = tessera(&["inspect", "m.onnx"], dir.path());
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.contains("x: f32[batch,4]"), "{text}");
    assert!(text.contains("w: f32[4,20]  (weight)"), "{text}");
    let out = tessera(&["inspect", "m.onnx", "--passes", "default"], dir.path());
    assert!(out.status.success(), "{}", stderr(&out));
    // .tir files take the compiled path too.
    write_graph(dir.path(), &movement_graph());
    let x6 = Tensor::from_vec((0..12).map(|v| v as f32).collect(), &[2, 6]);
    tessera::io::write_npy(dir.path().join("x6.npy"), &x6).unwrap();
    let out = tessera(
        &[
            "run",
            "g.tir",
            "--input",
            "x=x6.npy",
            "--output-dir",
            "o",
            "--compile",
        ],
        dir.path(),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains("(compiled)"), "{}", stdout(&out));
}

#[test]
fn onnx_errors_are_one_line() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("bad.onnx"), b"not protobuf at all").unwrap();
    let err = assert_one_line_error(&tessera(&["inspect", "bad.onnx"], dir.path()));
    assert!(err.contains("not an ONNX model"), "{err}");
    onnx_model(dir.path());
    let err = assert_one_line_error(&tessera(
        &["run", "m.onnx", "--random-inputs", "1", "--output-dir", "o"],
        dir.path(),
    ));
    assert!(err.contains("input `x` has type f32[batch,4]"), "{err}");
}

#[test]
fn onnx_output_names_with_slashes_become_file_names() {
    // ONNX's light ResNet-50 names its output `gpu_0/softmax_1`.
    let model = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tessera-onnx/tests/data/light/light_resnet50.onnx");
    let dir = tempfile::tempdir().unwrap();
    let out = tessera(
        &[
            "run",
            model.to_str().unwrap(),
            "--random-inputs",
            "0",
            "--output-dir",
            "o",
        ],
        dir.path(),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.contains("gpu_0/softmax_1  f32[1,1000]"), "{text}");
    let y = tessera::io::read_npy(dir.path().join("o/gpu_0_softmax_1.npy")).unwrap();
    assert_eq!(y.shape(), &[1, 1000]);
}
