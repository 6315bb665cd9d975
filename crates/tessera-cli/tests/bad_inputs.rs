//! The corpus of bad inputs (`tests/bad_inputs/`, described in its
//! README.md): graph files and `.npy` files given to the `tessera` binary,
//! and hint JSON given to the hint parser. Each case has a `.expected` file
//! that says how it must fail: exit code 1 (never a signal or a panic's
//! 101), one `error: …` line on stderr that contains given fragments. A
//! case may instead expect success (`exit: 0`): a valid input that once
//! crashed.
//!
//! Every case runs, and the test lists all the cases that fail, with what
//! happened, before it fails.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// A child's address-space limit, in KiB: a bad input must not make
/// tessera ask for more memory than this (the largest valid case needs a
/// few MiB).
const MEMORY_LIMIT_KB: u64 = 2 << 20;

/// The longest a case may take.
const TIMEOUT: Duration = Duration::from_secs(60);

struct Case {
    /// `folder/name`, for messages.
    name: String,
    folder: PathBuf,
    /// The input's file name, inside `folder`.
    file: String,
    /// The `tessera` arguments; `None` for a hint (parsed in-process).
    args: Option<Vec<String>>,
    exit: i32,
    fragments: Vec<String>,
}

fn corpus() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/bad_inputs")
}

/// The cases of one folder of the corpus, in name order.
fn cases(folder: &str) -> Vec<Case> {
    let dir = corpus().join(folder);
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| {
            entry
                .expect("a directory entry")
                .file_name()
                .into_string()
                .expect("UTF-8 names")
        })
        .filter_map(|name| name.strip_suffix(".expected").map(str::to_string))
        .collect();
    names.sort();
    assert!(!names.is_empty(), "no cases in {}", dir.display());
    names
        .into_iter()
        .map(|stem| read_case(&dir, folder, &stem))
        .collect()
}

fn read_case(dir: &Path, folder: &str, stem: &str) -> Case {
    let name = format!("{folder}/{stem}");
    let file = ["tir", "npy", "json"]
        .iter()
        .map(|ext| format!("{stem}.{ext}"))
        .find(|f| dir.join(f).exists())
        .unwrap_or_else(|| panic!("{name}: no {stem}.tir, .npy or .json beside {stem}.expected"));
    let spec = std::fs::read_to_string(dir.join(format!("{stem}.expected"))).expect("readable");
    let mut args = None;
    let mut exit = 1;
    let mut fragments = Vec::new();
    for line in spec
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
    {
        let (key, value) = line
            .split_once(':')
            .unwrap_or_else(|| panic!("{name}.expected: `{line}` is not `key: value`"));
        let value = value.trim();
        match key.trim() {
            "args" => args = Some(value.split_whitespace().map(str::to_string).collect()),
            "exit" => {
                exit = value
                    .parse()
                    .unwrap_or_else(|_| panic!("{name}: exit `{value}`"))
            }
            "error" => fragments.push(value.to_string()),
            other => panic!("{name}.expected: unknown key `{other}`"),
        }
    }
    let default_args = |text: &str| Some(text.split(' ').map(str::to_string).collect());
    let args = match file.rsplit_once('.').map(|(_, ext)| ext) {
        _ if args.is_some() => args,
        Some("tir") => default_args("run {file} --random-inputs 0 --output-dir {out}"),
        Some("npy") => default_args("run input.tir --input x={file} --output-dir {out}"),
        _ => None,
    };
    assert!(
        exit == 0 || !fragments.is_empty(),
        "{name}: a failing case needs at least one `error:` fragment"
    );
    Case {
        name,
        folder: dir.to_path_buf(),
        file,
        args,
        exit,
        fragments,
    }
}

/// Runs the binary under the memory limit and the timeout; `None` status
/// when it timed out (and was killed).
fn run_tessera(args: &[String], cwd: &Path) -> (Option<ExitStatus>, String) {
    let mut cmd = if Path::new("/bin/sh").exists() {
        let mut cmd = Command::new("/bin/sh");
        cmd.arg("-c")
            .arg(format!(
                "ulimit -c 0; ulimit -S -v {MEMORY_LIMIT_KB} 2>/dev/null; exec \"$0\" \"$@\""
            ))
            .arg(env!("CARGO_BIN_EXE_tessera"));
        cmd
    } else {
        Command::new(env!("CARGO_BIN_EXE_tessera"))
    };
    let stderr_path = std::env::temp_dir().join(format!(
        "tessera-bad-input-{}-{}.stderr",
        std::process::id(),
        args.join("_")
            .replace(['/', ' '], "_")
            .chars()
            .take(80)
            .collect::<String>()
    ));
    let stderr_file = std::fs::File::create(&stderr_path).expect("a stderr file");
    let mut child = cmd
        .args(args)
        .current_dir(cwd)
        .env_remove("RUST_BACKTRACE")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(stderr_file)
        .spawn()
        .expect("the tessera binary starts");
    let began = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("waiting for tessera") {
            break Some(status);
        }
        if began.elapsed() > TIMEOUT {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let stderr = std::fs::read_to_string(&stderr_path).unwrap_or_default();
    let _ = std::fs::remove_file(&stderr_path);
    (status, stderr)
}

fn describe(status: &Option<ExitStatus>) -> String {
    let Some(status) = status else {
        return format!("timed out after {} s", TIMEOUT.as_secs());
    };
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(signal) = status.signal() {
            return format!("killed by signal {signal}");
        }
    }
    format!("exit code {}", status.code().unwrap_or(-1))
}

/// What is wrong with running `case` through the binary, if anything.
fn check_cli(case: &Case, args: &[String]) -> Option<String> {
    let out = tempfile::tempdir().expect("a temp dir");
    let out_dir = out.path().join("out").display().to_string();
    let args: Vec<String> = args
        .iter()
        .map(|a| a.replace("{file}", &case.file).replace("{out}", &out_dir))
        .collect();
    let (status, stderr) = run_tessera(&args, &case.folder);
    let got = format!(
        "`tessera {}`: {}, stderr:\n      {}",
        args.join(" "),
        describe(&status),
        stderr.trim_end().replace('\n', "\n      ")
    );
    let code = status.and_then(|s| s.code());
    if case.exit == 0 {
        return (code != Some(0) || stderr.contains("error"))
            .then(|| format!("expected success; {got}"));
    }
    let lines: Vec<&str> = stderr.trim_end().lines().collect();
    let problem = if code != Some(case.exit) {
        format!("expected exit code {}", case.exit)
    } else if lines.len() != 1 || !lines[0].starts_with("error: ") {
        "expected one `error: …` line on stderr".to_string()
    } else if stderr.contains("internal error") || stderr.contains("panicked") {
        "expected a clean error, not an internal one".to_string()
    } else if let Some(missing) = case.fragments.iter().find(|f| !stderr.contains(f.as_str())) {
        format!("expected the error to contain `{missing}`")
    } else {
        return None;
    };
    Some(format!("{problem}; {got}"))
}

/// What is wrong with the hint parser's verdict on `case`, if anything.
fn check_hint(case: &Case) -> Option<String> {
    let text = std::fs::read_to_string(case.folder.join(&case.file)).expect("readable");
    let text = text.strip_suffix('\n').unwrap_or(&text).to_string();
    let verdict = std::panic::catch_unwind(|| tessera::hints::Hint::parse_with_warnings(&text));
    let problem = match &verdict {
        Err(_) => "expected an error, the parser panicked".to_string(),
        Ok(Ok(hint)) => format!("expected an error, got {hint:?}"),
        Ok(Err(e)) if e.kind != tessera::ErrorKind::Parse => {
            format!("expected a Parse error, got {:?}: {e}", e.kind)
        }
        Ok(Err(e)) => match case
            .fragments
            .iter()
            .find(|f| !e.message.contains(f.as_str()))
        {
            Some(missing) => format!("expected the error to contain `{missing}`, got: {e}"),
            None => return None,
        },
    };
    Some(format!("{problem} (input: {text})"))
}

fn check_folder(folder: &str) {
    let cases = cases(folder);
    let failures: Vec<String> = cases
        .iter()
        .filter_map(|case| {
            let problem = match &case.args {
                Some(args) => check_cli(case, args),
                None => check_hint(case),
            };
            problem.map(|p| format!("  {}: {p}", case.name))
        })
        .collect();
    assert!(
        failures.is_empty(),
        "{} of the {} cases of bad_inputs/{folder} fail:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

#[test]
fn graph_files() {
    check_folder("ir");
}

#[test]
fn npy_files() {
    check_folder("npy");
}

#[test]
fn hint_json() {
    check_folder("hints");
}
