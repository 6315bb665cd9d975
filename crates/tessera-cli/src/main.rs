//! The `tessera` command: runs or inspects a model (a graph file in the
//! IR's text form, or an ONNX model), trains a small model end to end (`tessera train`), or times a GPT
//! training step (`tessera bench gpt`).
//!
//! Every failure on bad input is one line on stderr (`error: …`) and a
//! non-zero exit code; parse errors read `GRAPH.tir:LINE:COL: message`.

mod bench;
mod device;
mod launch;
mod model;
mod seed_table;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use tessera::compile::{compile_graph, CompileOptions};
use tessera::ir::text;
use tessera::ir::EvalError;
use tessera::passes::{PassContext, PassManager};
use tessera::tensor::interpret;
use tessera::tensor::Generator;
use tessera::{DType, Error, ErrorKind, Graph, Tensor};

mod train;

#[derive(Parser)]
#[command(
    name = "tessera",
    version,
    about = "tessera: the seed experiment, graph files, training, benchmarks"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run a graph file (.tir) or an ONNX model (.onnx) on .npy inputs and
    /// write each output as DIR/<name>.npy.
    Run(RunArgs),
    /// Print a graph (a .tir file or an imported .onnx model) and a
    /// summary: node count by op, inputs, outputs; with --passes, the graph
    /// after those passes and what each changed.
    Inspect(InspectArgs),
    /// The seed experiment: sliced attention, eager and compiled, with and
    /// without context hints: working memory, time, compile time, error.
    SeedTable(seed_table::SeedTableArgs),
    /// Train a small transformer to reverse digit strings (a self-checking
    /// synthetic task); write a checkpoint, loss.png and summary.json.
    Train(train::TrainArgs),
    /// Benchmarks printed as JSON lines: `gpt` times a GPT training step
    /// (eager or compiled, f32/bf16/f16, cpu/cuda).
    #[command(subcommand)]
    Bench(bench::BenchCommand),
}

#[derive(Args)]
struct InspectArgs {
    /// The graph file (text form) or ONNX model (.onnx).
    graph: PathBuf,
    /// Optimise the graph first with these passes, run to a fixed point:
    /// comma-separated names, `default` for the default pipeline (e.g.
    /// `default,decompose` or `cse,dce`).
    #[arg(long, value_name = "PASSES")]
    passes: Option<String>,
    /// With --passes: keep float results bit-identical to the unoptimised
    /// graph (no reassociation, hoisting or regrouping).
    #[arg(long)]
    no_reassociation: bool,
    /// With --passes: allow rewrites that are exact only for finite inputs
    /// (x*0 → 0, x-x → 0).
    #[arg(long)]
    unsafe_math: bool,
}

#[derive(Args)]
struct RunArgs {
    /// The graph file (text form) or ONNX model (.onnx).
    graph: PathBuf,
    /// A graph input read from a .npy file; repeat for each input.
    #[arg(long = "input", value_name = "NAME=FILE", value_parser = parse_input)]
    inputs: Vec<(String, PathBuf)>,
    /// The folder for the outputs (created if missing).
    #[arg(long, value_name = "DIR")]
    output_dir: PathBuf,
    /// Generate every input not given with --input, from this seed: float
    /// inputs are standard normal samples, integer and bool inputs zeros.
    #[arg(long, value_name = "SEED")]
    random_inputs: Option<u64>,
    /// cpu or cuda: where the inputs are moved and the graph runs.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Run node by node through the interpreter (the default for .tir
    /// files; an ONNX model is compiled unless this is given).
    #[arg(long, conflicts_with = "compile")]
    interpret: bool,
    /// Compile the graph (passes, fusion, hints, schedule, memory plan)
    /// and run the executable (the default for an ONNX model).
    #[arg(long)]
    compile: bool,
    /// Run in this float type: f32 values (inputs, weights, constants)
    /// become bf16, f16 or f64 (outputs in bf16 are written as f32).
    #[arg(long, value_name = "DTYPE")]
    dtype: Option<String>,
    /// After the first run, time N more: print the median and mean
    /// latency and the peak memory of the device.
    #[arg(long, value_name = "N")]
    bench: Option<usize>,
}

fn parse_input(arg: &str) -> Result<(String, PathBuf), String> {
    match arg.split_once('=') {
        Some((name, file)) if !name.is_empty() && !file.is_empty() => {
            Ok((name.to_string(), PathBuf::from(file)))
        }
        _ => Err(format!("expected NAME=FILE, got `{arg}`")),
    }
}

/// `tessera inspect g.tir | head` closes our stdout early: end as any Unix
/// filter does (killed by SIGPIPE) rather than panic in `println!`. Rust
/// ignores SIGPIPE by default, which turns the write into an error.
fn exit_quietly_on_a_closed_pipe() {
    #[cfg(unix)]
    // SAFETY: restoring the default disposition of one signal at start-up,
    // before any thread exists.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

fn main() -> ExitCode {
    exit_quietly_on_a_closed_pipe();
    report_panics_on_one_line();
    if let Err(e) = check_cpu() {
        eprintln!("error: {e}");
        return ExitCode::FAILURE;
    }
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run(args) => run(&args),
        Command::Inspect(args) => inspect(&args),
        Command::SeedTable(args) => seed_table::seed_table(&args),
        Command::Train(args) => train::run(&args),
        Command::Bench(command) => bench::run(&command),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// The build targets x86-64-v3 (see .cargo/config.toml): refuse clearly on
/// an older CPU rather than dying of an illegal instruction later.
fn check_cpu() -> Result<()> {
    #[cfg(target_arch = "x86_64")]
    if !(std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma"))
    {
        bail!(
            "this build of tessera needs an x86-64-v3 CPU (AVX2 and FMA); \
             rebuild without the target-cpu setting in .cargo/config.toml for this machine"
        );
    }
    Ok(())
}

/// A panic is a bug in tessera, not bad input; still, the user gets one
/// line that says so instead of a backtrace note.
fn report_panics_on_one_line() {
    std::panic::set_hook(Box::new(|info| {
        let payload = info.payload();
        let msg = payload
            .downcast_ref::<&str>()
            .copied()
            .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
            .unwrap_or("panic");
        let at = info
            .location()
            .map(|l| format!(" (at {l})"))
            .unwrap_or_default();
        eprintln!("error: internal error, a bug in tessera: {msg}{at}");
    }));
}

fn run(args: &RunArgs) -> Result<()> {
    let mut named = load_inputs(&args.inputs)?;
    let loaded = model::load(&args.graph, &named)?;
    let mut graph = loaded.graph;
    named.extend(loaded.params);
    if let Some(seed) = args.random_inputs {
        add_random_inputs(&graph, &mut named, seed)?;
    }
    if let Some(name) = &args.dtype {
        let dtype: DType = name
            .parse()
            .map_err(|_| anyhow!("--dtype `{name}`: expected f32, f64, bf16 or f16"))?;
        if !dtype.is_float() {
            bail!("--dtype `{name}`: expected a float type (f32, f64, bf16 or f16)");
        }
        graph = tessera_onnx::convert_float_dtype(&graph, DType::F32, dtype)?;
        for (_, t) in named.iter_mut() {
            if t.dtype() == DType::F32 {
                *t = t.try_cast(dtype)?;
            }
        }
    }
    let on = device::open(&args.device)?;
    let inputs = interpret::inputs_by_name(&graph, named)?
        .iter()
        .map(|t| t.to(on))
        .collect::<tessera::Result<Vec<Tensor>>>()?;
    let compiled = if args.compile || (loaded.onnx && !args.interpret) {
        Some(compile_graph(graph.clone(), CompileOptions::default())?)
    } else {
        None
    };
    let names: Vec<String> = graph.outputs.iter().map(|o| o.name.clone()).collect();
    let run_once = || -> Result<Vec<Tensor>> {
        let outs = match &compiled {
            Some(c) => c.try_call(&inputs)?,
            None => interpret::run_graph(&graph, &inputs)?
                .into_iter()
                .map(|(_, t)| t)
                .collect(),
        };
        tessera::runtime::device::synchronize(on)?;
        Ok(outs)
    };
    let start = Instant::now();
    let outputs = run_once()?;
    let elapsed = start.elapsed();
    let how = if compiled.is_some() {
        "compiled"
    } else {
        "interpreted"
    };
    println!(
        "ran graph `{}` ({how}) in {:.3} ms",
        graph.name,
        elapsed.as_secs_f64() * 1e3
    );
    if let Some(n) = args.bench {
        if n == 0 {
            bail!("--bench needs at least 1 run");
        }
        tessera::runtime::device::reset_peak(on)?;
        let mut times = Vec::with_capacity(n);
        for _ in 0..n {
            let t = Instant::now();
            drop(run_once()?);
            times.push(t.elapsed().as_secs_f64() * 1e3);
        }
        let peak = tessera::runtime::device::memory_stats(on)?.peak_bytes;
        let mean = times.iter().sum::<f64>() / n as f64;
        times.sort_by(f64::total_cmp);
        println!(
            "bench ({how}, {n} runs on {}): median {:.3} ms, mean {mean:.3} ms, min {:.3} ms; peak memory {:.2} MiB",
            args.device,
            times[n / 2],
            times[0],
            peak as f64 / (1024.0 * 1024.0)
        );
    }
    let outputs: Vec<(String, Tensor)> = names.into_iter().zip(outputs).collect();
    write_outputs(&args.output_dir, &outputs)?;
    Ok(())
}

fn inspect(args: &InspectArgs) -> Result<()> {
    let loaded = model::load(&args.graph, &[])?;
    let mut graph = loaded.graph;
    let params: Vec<String> = loaded.params.iter().map(|(n, _)| n.clone()).collect();
    let optimised = match &args.passes {
        Some(spec) => Some(optimise(&mut graph, spec, args)?),
        None => None,
    };
    println!("{}", graph.to_string().trim_end());
    println!();
    println!("{} nodes", graph.len());
    for (op, count) in op_counts(&graph) {
        println!("  {op:<14} {count}");
    }
    println!("inputs:");
    for &id in &graph.inputs {
        let name = graph.display_name(id);
        let note = if params.contains(&name) {
            "  (weight)"
        } else {
            ""
        };
        println!("  {name}: {}{note}", graph.node(id).ty);
    }
    println!("outputs:");
    for out in &graph.outputs {
        println!("  {}: {}", out.name, graph.node(out.node).ty);
    }
    if let Some(summary) = optimised {
        print!("{summary}");
        // The kernels the default backend would run (needs concrete shapes).
        if graph
            .nodes
            .iter()
            .all(|n| n.ty.shape.as_concrete().is_some())
        {
            print!(
                "kernels: {}",
                tessera::fusion::describe(&graph, &tessera::fusion::fuse(&graph))
            );
        }
    }
    Ok(())
}

/// Runs the passes named by `spec` on `graph`; returns what each changed,
/// as printed after the graph.
fn optimise(graph: &mut Graph, spec: &str, args: &InspectArgs) -> Result<String> {
    let pipeline = PassManager::from_names(spec)?;
    let ctx = PassContext {
        allow_reassociation: !args.no_reassociation,
        unsafe_math: args.unsafe_math,
        ..PassContext::default()
    };
    let before = graph.len();
    let report = pipeline.run(graph, &ctx)?;
    let state = match report.converged {
        true => format!("fixed point after {} rounds", report.rounds),
        false => format!("stopped after {} rounds", report.rounds),
    };
    let mut out = format!(
        "passes `{spec}` ({state}): {before} -> {} nodes\n",
        graph.len()
    );
    for (name, changes, delta) in report.changes_by_pass(&pipeline) {
        out += &format!("  {name:<24} changed {changes} times, {delta:+} nodes\n");
    }
    Ok(out)
}

/// Node count per op name, most frequent first.
fn op_counts(graph: &Graph) -> Vec<(&'static str, usize)> {
    let mut counts: Vec<(&'static str, usize)> = Vec::new();
    for node in &graph.nodes {
        match counts.iter_mut().find(|(op, _)| *op == node.op.name()) {
            Some((_, n)) => *n += 1,
            None => counts.push((node.op.name(), 1)),
        }
    }
    counts.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
    counts
}

/// Reads, parses and verifies a graph file.
pub(crate) fn load_graph(path: &Path) -> Result<Graph> {
    let src = std::fs::read_to_string(path).map_err(|e| anyhow!("{}: {e}", path.display()))?;
    let graph = text::parse(&src).map_err(|e| anyhow!(in_file(path, &e)))?;
    graph
        .verify()
        .map_err(|e| anyhow!("{}: invalid graph: {e}", path.display()))?;
    Ok(graph)
}

/// A parse error as `FILE:LINE:COL: message` (its location is a line and
/// column of the file); any other error as `FILE: error`.
fn in_file(path: &Path, e: &Error) -> String {
    match (&e.location, e.kind) {
        (Some(loc), ErrorKind::Parse) => {
            let what = match &e.op {
                Some(op) => format!("{op}: {}", e.message),
                None => e.message.clone(),
            };
            format!("{}:{}:{}: {what}", path.display(), loc.line, loc.column)
        }
        _ => format!("{}: {e}", path.display()),
    }
}

fn load_inputs(given: &[(String, PathBuf)]) -> Result<Vec<(String, Tensor)>> {
    given
        .iter()
        .map(|(name, path)| {
            let t = tessera::io::read_npy(path).with_context(|| format!("input `{name}`"))?;
            Ok((name.clone(), t))
        })
        .collect()
}

/// Appends a generated tensor for every graph input `named` lacks. Symbolic
/// dims take the sizes the given inputs bind.
fn add_random_inputs(graph: &Graph, named: &mut Vec<(String, Tensor)>, seed: u64) -> Result<()> {
    let given: Vec<Option<&Tensor>> = graph
        .inputs
        .iter()
        .map(|&id| {
            let name = graph.display_name(id);
            named.iter().find(|(n, _)| *n == name).map(|(_, t)| t)
        })
        .collect();
    let symbols = interpret::bind_symbols(graph, &given)?;
    let missing: Vec<_> = graph
        .inputs
        .iter()
        .zip(&given)
        .filter(|(_, t)| t.is_none())
        .map(|(&id, _)| id)
        .collect();
    let mut generator = Generator::new(seed);
    for id in missing {
        let (name, ty) = (graph.display_name(id), &graph.node(id).ty);
        let shape = match ty.shape.eval(&symbols) {
            Ok(shape) => shape,
            Err(EvalError::Unbound(_)) => bail!(
                "input `{name}` has type {ty}: its symbolic dims are not fixed by any \
                 --input, so --random-inputs cannot choose a size; pass --input {name}=FILE.npy"
            ),
            Err(e) => bail!("input `{name}` has type {ty}, which has no size here: {e}"),
        };
        let t = if ty.dtype.is_float() {
            Tensor::try_randn(&shape, ty.dtype, &mut generator)
        } else {
            Tensor::try_zeros(&shape, ty.dtype)
        }
        .with_context(|| format!("generating input `{name}`"))?;
        named.push((name, t));
    }
    Ok(())
}

/// A file name for output `name`: characters other than ASCII letters,
/// digits, `_`, `-` and `.` become `_` (ONNX names such as
/// `gpu_0/softmax_1`), and a name that is empty or all dots gets a leading
/// `_`.
fn output_file_stem(name: &str) -> String {
    let safe: String = name
        .chars()
        .map(
            |c| match c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.') {
                true => c,
                false => '_',
            },
        )
        .collect();
    match safe.chars().all(|c| c == '.') {
        true => format!("_{safe}"),
        false => safe,
    }
}

/// The file stem of each output ([`output_file_stem`]); an error when two
/// outputs would share a file.
fn output_file_stems<'a>(names: impl IntoIterator<Item = &'a str>) -> Result<Vec<String>> {
    let mut taken: std::collections::HashMap<String, &str> = std::collections::HashMap::new();
    let mut stems = Vec::new();
    for name in names {
        let stem = output_file_stem(name);
        if let Some(other) = taken.insert(stem.clone(), name) {
            bail!(
                "outputs `{other}` and `{name}` would both be written to {stem}.npy \
                 (characters other than letters, digits, `_`, `-` and `.` become `_`)"
            );
        }
        stems.push(stem);
    }
    Ok(stems)
}

fn write_outputs(dir: &Path, outputs: &[(String, Tensor)]) -> Result<()> {
    let stems = output_file_stems(outputs.iter().map(|(n, _)| n.as_str()))?;
    std::fs::create_dir_all(dir).map_err(|e| anyhow!("{}: {e}", dir.display()))?;
    for ((name, t), stem) in outputs.iter().zip(stems) {
        let path = dir.join(format!("{stem}.npy"));
        // numpy has no bf16; f32 holds every bf16 value exactly.
        let (file_tensor, note) = match t.dtype() {
            DType::BF16 => (bf16_as_f32(t), " (bf16 written as f32)"),
            _ => (t.clone(), ""),
        };
        tessera::io::write_npy(&path, &file_tensor)?;
        println!("{name}  {}  {}{note}", t.ty(), path.display());
    }
    Ok(())
}

fn bf16_as_f32(t: &Tensor) -> Tensor {
    let values: Vec<f32> = t.to_f64_vec().into_iter().map(|v| v as f32).collect();
    Tensor::from_vec(values, t.shape())
}

#[cfg(test)]
mod tests {
    use super::{output_file_stem, output_file_stems};

    #[test]
    fn output_names_map_to_safe_file_names_and_collisions_are_errors() {
        assert_eq!(output_file_stem("gpu_0/softmax_1"), "gpu_0_softmax_1");
        assert_eq!(output_file_stem("a\\b:c d"), "a_b_c_d");
        assert_eq!(output_file_stem("logits.v2-x"), "logits.v2-x");
        assert_eq!(output_file_stem(".."), "_..");
        assert_eq!(output_file_stem(""), "_");
        assert_eq!(output_file_stem("é"), "_");
        let stems = output_file_stems(["gpu_0/softmax_1", "y"]).unwrap();
        assert_eq!(stems, ["gpu_0_softmax_1", "y"]);
        let e = output_file_stems(["a/b", "a_b"]).unwrap_err().to_string();
        assert!(
            e.contains("`a/b` and `a_b`") && e.contains("a_b.npy"),
            "{e}"
        );
    }
}
