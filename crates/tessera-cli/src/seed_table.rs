//! `tessera seed-table`: the seed experiment's table (see
//! `tessera_apps::seed_table`), printed as a table or as JSON lines.

use anyhow::{bail, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use tessera::DType;
use tessera_apps::seed_table::{self, SeedConfig, SeedRow};

#[derive(Args)]
pub struct SeedTableArgs {
    /// B,H,N,D of q, k and v.
    #[arg(long, default_value = "4,16,512,64", value_parser = parse_shape)]
    shape: [usize; 4],
    /// f32, f64, bf16 or f16.
    #[arg(long, default_value = "f32")]
    dtype: DType,
    /// cpu or cuda: where every tensor of every scenario lives.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Timed repetitions per scenario (the median is reported).
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// The masked (causal) variant.
    #[arg(long)]
    causal: bool,
    /// One JSON object per scenario instead of a table.
    #[arg(long)]
    json: bool,
    /// Only the scenarios whose name contains this text (e.g. "naive graph").
    #[arg(long)]
    only: Option<String>,
}

fn parse_shape(s: &str) -> Result<[usize; 4], String> {
    let dims: Vec<usize> = s
        .split(',')
        .map(|d| {
            d.trim()
                .parse::<usize>()
                .map_err(|_| format!("`{d}` is not a size"))
        })
        .collect::<Result<_, _>>()?;
    match dims[..] {
        [b, h, n, d] if dims.iter().all(|&x| x > 0) => Ok([b, h, n, d]),
        _ => Err(format!("expected four positive sizes B,H,N,D, got `{s}`")),
    }
}

pub fn seed_table(args: &SeedTableArgs) -> Result<()> {
    let device = crate::device::open(&args.device)?;
    if !args.dtype.is_float() {
        bail!("--dtype {}: attention needs a float dtype", args.dtype);
    }
    let config = SeedConfig {
        shape: args.shape,
        dtype: args.dtype,
        causal: args.causal,
        reps: args.reps.max(1),
        seed: 0,
        device,
        only: args.only.clone(),
    };
    let bar = ProgressBar::new(seed_table::SCENARIOS.len() as u64);
    bar.set_style(ProgressStyle::with_template(
        "{bar:30} {pos}/{len} {msg} [{elapsed}]",
    )?);
    let rows = seed_table::run(&config, |i, name| {
        bar.set_position(i as u64);
        bar.set_message(name.to_string());
        // TESSERA_CUDA_PROFILE=1: what the previous scenario spent, by op.
        let report = tessera_cuda::profile::report(12);
        if !report.is_empty() {
            eprintln!("before `{name}`: {report}");
        }
    })?;
    let report = tessera_cuda::profile::report(12);
    if !report.is_empty() {
        eprintln!("last scenario: {report}");
    }
    bar.finish_and_clear();
    if args.json {
        for row in &rows {
            println!("{}", serde_json::to_string(row)?);
        }
    } else {
        print_table(&config, &rows);
    }
    Ok(())
}

fn print_table(config: &SeedConfig, rows: &[SeedRow]) {
    let [b, h, n, d] = config.shape;
    println!(
        "seed experiment: q, k, v = ({b}, {h}, {n}, {d}) {}, {}forward + backward, median of {} reps",
        config.dtype,
        if config.causal { "causal, " } else { "" },
        config.reps
    );
    println!(
        "| {:<40} | {:>12} | {:>8} | {:>10} | {:>11} | {:>11} |",
        "scenario", "working MB", "host MB", "ms", "compile ms", "max |err|"
    );
    println!(
        "|{:-<42}|{:->14}|{:->10}|{:->12}|{:->13}|{:->13}|",
        "", "", "", "", "", ""
    );
    for r in rows {
        println!(
            "| {:<40} | {:>12.1} | {:>8.1} | {:>10.2} | {:>11.1} | {:>11.2e} |",
            r.scenario, r.working_mb, r.host_mb, r.ms_median, r.compile_ms, r.max_abs_err
        );
    }
}
