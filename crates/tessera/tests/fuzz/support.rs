//! The fuzz runner: a seeded, bounded loop of generated cases, each run in
//! a child process of this test binary so that an abort or a segfault is a
//! reported failure (with the input that caused it), not a lost test run.
//!
//! A target is a generator (`rng → input`), a checker (`input → Ok or the
//! violated property`) and a printer for its inputs. The parent process:
//!
//! 1. starts this binary again as a child, running only the target's test,
//!    under an address-space limit (`ulimit -v`) so that a huge allocation
//!    fails at once instead of paging the machine to death;
//! 2. the child runs cases `start..cases`, writing the index of the case in
//!    progress to a file before each one (and, through [`note`], the step
//!    in progress); a panic is caught (`catch_unwind`) and recorded, and
//!    the loop goes on; at the end it prints one line per distinct failure;
//! 3. if the child dies of a signal (or exits without its summary, or hangs
//!    [`HANG_GRACE`] past its time limit and is killed), the parent reads
//!    the case in progress from the file, records the crash and starts a
//!    new child after that case, up to [`MAX_CRASHES`] times;
//! 4. the test fails if any case failed, listing each distinct failure once
//!    with its first input and the command that replays it.
//!
//! Case `i` is generated from a generator seeded with `(seed, i)` only, so
//! any case can be regenerated on its own.

use std::fmt::Write as _;
use std::io::{Read, Seek, SeekFrom, Write};
use std::panic::{self, AssertUnwindSafe};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use rand::{Rng as _, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// The seed of CI runs (any fixed value: CI runs the same cases every time).
const DEFAULT_SEED: u64 = 0x7e55_e7a0_f022_0015;

/// Stop starting children after this many crashes (each costs a restart).
const MAX_CRASHES: usize = 100;

/// Distinct failures reported in full (the rest are counted).
const MAX_REPORTED: usize = 12;

/// The address-space limit of a child, in MiB (`TESSERA_FUZZ_MEMORY_MB`).
/// Far above what any generated case needs when tessera works, far below
/// what a size computed wrongly would ask for.
const DEFAULT_MEMORY_MB: u64 = 2048;

/// Characters of an input shown in a failure report.
const MAX_SHOWN: usize = 3000;

/// How to run one target: the fuzz loop's settings, from the environment.
///
/// | variable | meaning |
/// |---|---|
/// | `TESSERA_FUZZ_CASES` | cases per target (default: the target's CI count) |
/// | `TESSERA_FUZZ_SECONDS` | time limit per target (default: 45 s when `TESSERA_FUZZ_CASES` is unset, else none); with `TESSERA_FUZZ_CASES` unset, setting it runs until the time is up |
/// | `TESSERA_FUZZ_SEED` | the base seed (a number, or `random`) |
/// | `TESSERA_FUZZ_REPLAY` | run only this case index, in this process, panics shown |
/// | `TESSERA_FUZZ_MEMORY_MB` | the children's address-space limit |
struct Settings {
    seed: u64,
    cases: u64,
    time_limit: Option<Duration>,
}

fn env_u64(name: &str) -> Option<u64> {
    let text = std::env::var(name).ok()?;
    let text = text.trim();
    let parsed = match text.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => text.parse(),
    };
    Some(parsed.unwrap_or_else(|_| panic!("{name}={text} is not a number")))
}

impl Settings {
    fn from_env(ci_cases: u64) -> Settings {
        let seed = match std::env::var("TESSERA_FUZZ_SEED").as_deref() {
            Ok("random") => {
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap_or_default();
                now.as_nanos() as u64 ^ u64::from(std::process::id())
            }
            _ => env_u64("TESSERA_FUZZ_SEED").unwrap_or(DEFAULT_SEED),
        };
        let cases = env_u64("TESSERA_FUZZ_CASES");
        let seconds = env_u64("TESSERA_FUZZ_SECONDS");
        let (cases, time_limit) = match (cases, seconds) {
            (None, None) => (ci_cases, Some(45)),
            (None, Some(s)) => (u64::MAX, Some(s)),
            (Some(n), s) => (n, s),
        };
        Settings {
            seed,
            cases,
            time_limit: time_limit.map(Duration::from_secs),
        }
    }
}

/// The random source of one case.
pub struct Rng(ChaCha8Rng);

impl Rng {
    /// The generator of case `index` of a run seeded with `seed`.
    pub fn for_case(seed: u64, index: u64) -> Rng {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        rng.set_stream(index);
        Rng(rng)
    }

    /// A uniform integer in `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        self.0.random_range(0..n)
    }

    /// A uniform integer in `lo..=hi`.
    pub fn between(&mut self, lo: i64, hi: i64) -> i64 {
        self.0.random_range(lo..=hi)
    }

    pub fn chance(&mut self, p: f64) -> bool {
        self.0.random_bool(p)
    }

    pub fn u64(&mut self) -> u64 {
        self.0.random()
    }

    pub fn f64(&mut self) -> f64 {
        self.0.random()
    }

    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
}

/// A fuzz target.
pub struct Target<I> {
    /// The name of the `#[test]` function that runs it (the child runs
    /// exactly that test).
    pub test: &'static str,
    /// Cases per CI run: together, the targets stay within about two
    /// minutes on CI's two cores.
    pub ci_cases: u64,
    pub generate: fn(&mut Rng) -> I,
    /// `Err(what went wrong)` when the input breaks a property; panics are
    /// caught and reported by the runner.
    pub check: fn(&I) -> Result<(), String>,
    /// The input as a reproducer (text, bytes in hex, a program).
    pub show: fn(&I) -> String,
}

/// Runs `target` (see the module doc); panics with the report when a case
/// fails.
pub fn fuzz<I>(target: Target<I>) {
    let settings = Settings::from_env(target.ci_cases);
    if std::env::var_os("TESSERA_FUZZ_CHILD").is_some() {
        child(&target, &settings);
    } else if let Some(index) = env_u64("TESSERA_FUZZ_REPLAY") {
        replay(&target, &settings, index);
    } else {
        parent(&target, &settings);
    }
}

fn replay<I>(target: &Target<I>, settings: &Settings, index: u64) {
    let input = (target.generate)(&mut Rng::for_case(settings.seed, index));
    eprintln!(
        "{} case {index} (seed {:#x}):\n{}",
        target.test,
        settings.seed,
        (target.show)(&input)
    );
    if let Err(e) = (target.check)(&input) {
        panic!("{} case {index}: {e}", target.test);
    }
    eprintln!("{} case {index}: passed", target.test);
}

// ------------------------------------------------------------------ child

/// The message and place of the last panic, set by the child's hook.
static LAST_PANIC: Mutex<Option<String>> = Mutex::new(None);

/// Marks the lines of the child's summary on its stdout.
const FAILURE: &str = "TESSERA-FUZZ-FAILURE";
const DONE: &str = "TESSERA-FUZZ-DONE";

fn child<I>(target: &Target<I>, settings: &Settings) {
    let start = env_u64("TESSERA_FUZZ_START").unwrap_or(0);
    if let Some(path) = std::env::var_os("TESSERA_FUZZ_PROGRESS") {
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .expect("the progress file opens");
        *PROGRESS.lock().expect("progress") = Some((file, 0));
    }
    panic::set_hook(Box::new(|info| {
        let payload = info.payload();
        let message = payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic with a non-string payload".into());
        let at = info.location().map(|l| l.to_string()).unwrap_or_default();
        // `#[track_caller]` puts the place of a panic in the caller; the
        // innermost tessera function on the stack says where it happened.
        let inside =
            innermost_tessera_frame(&std::backtrace::Backtrace::force_capture().to_string())
                .map(|f| format!(" in {f}"))
                .unwrap_or_default();
        if let Ok(mut last) = LAST_PANIC.lock() {
            *last = Some(format!("panic at {at}{inside}: {message}"));
        }
    }));
    let began = Instant::now();
    let mut failures: Vec<(String, u64, u64, String)> = Vec::new();
    let mut index = start;
    while index < settings.cases {
        if settings.time_limit.is_some_and(|t| began.elapsed() > t) {
            break;
        }
        if let Some((_, current)) = PROGRESS.lock().expect("progress").as_mut() {
            *current = index;
        }
        note("", "");
        let input = panic::catch_unwind(AssertUnwindSafe(|| {
            (target.generate)(&mut Rng::for_case(settings.seed, index))
        }));
        let Ok(input) = input else {
            let message = take_last_panic().unwrap_or_default();
            // The hook printed nothing: say it here, for the parent.
            eprintln!("the generator panicked (a bug of the fuzz target): {message}");
            panic!("case {index}: the generator panicked: {message}");
        };
        let outcome = panic::catch_unwind(AssertUnwindSafe(|| (target.check)(&input)));
        let failure = match outcome {
            Ok(Ok(())) => None,
            Ok(Err(property)) => Some(property),
            Err(_) => Some(take_last_panic().unwrap_or_else(|| "panic".into())),
        };
        if let Some(message) = failure {
            let key = failure_key(&message);
            match failures.iter_mut().find(|f| f.0 == key) {
                Some(f) => f.2 += 1,
                None => failures.push((key, index, 1, message)),
            }
        }
        index += 1;
    }
    let mut out = std::io::stdout().lock();
    for (_, first, count, message) in &failures {
        writeln!(
            out,
            "{FAILURE}\t{first}\t{count}\t{}",
            message.escape_default()
        )
        .unwrap();
    }
    writeln!(
        out,
        "{DONE}\t{}\t{:.3}",
        index - start,
        began.elapsed().as_secs_f64()
    )
    .unwrap();
}

/// The progress file of a child and the case it is running.
static PROGRESS: Mutex<Option<(std::fs::File, u64)>> = Mutex::new(None);

/// Records what the case in progress is doing (`what`: a short name, part
/// of a crash's summary line; `detail`: shown under it), so that a crash
/// reports the step that caused it, not only the case.
pub fn note(what: &str, detail: &str) {
    if let Some((file, index)) = PROGRESS.lock().expect("progress").as_mut() {
        let text = format!("{index:020}\n{what}\n{detail}");
        file.seek(SeekFrom::Start(0)).expect("progress file");
        file.write_all(text.as_bytes()).expect("progress file");
        file.set_len(text.len() as u64).expect("progress file");
    }
}

/// The first frame of `backtrace` in the tessera crate (its function).
fn innermost_tessera_frame(backtrace: &str) -> Option<String> {
    backtrace.lines().find_map(|line| {
        let symbol = line.trim_start().split_once(": ")?.1;
        let symbol = symbol.trim();
        (symbol.starts_with("tessera::") || symbol.starts_with("<tessera::")).then(|| {
            symbol
                .rsplit_once("::h")
                .map_or(symbol, |(f, _)| f)
                .to_string()
        })
    })
}

/// The message of the last panic caught in this process (and forgets it).
pub fn take_last_panic() -> Option<String> {
    LAST_PANIC.lock().ok().and_then(|mut p| p.take())
}

/// What makes two failures "the same": the first line of the message with
/// its numbers and the contents of its lists (`[…]`) blanked, cut short (a
/// panic's place stays in it).
fn failure_key(message: &str) -> String {
    let mut key = String::new();
    let mut last_digit = false;
    let mut depth = 0u32;
    let first_line = message.lines().next().unwrap_or_default();
    for c in first_line.chars().take(160) {
        match c {
            '[' => depth += 1,
            ']' => depth = depth.saturating_sub(1),
            _ if depth > 0 => continue,
            _ => {}
        }
        if c.is_ascii_digit() {
            if !last_digit {
                key.push('#');
            }
            last_digit = true;
        } else {
            key.push(c);
            last_digit = false;
        }
    }
    key
}

// ----------------------------------------------------------------- parent

/// A failure as the parent reports it.
struct Failure {
    first: u64,
    count: u64,
    message: String,
}

fn parent<I>(target: &Target<I>, settings: &Settings) {
    let progress = progress_path(target.test);
    let exe = std::env::current_exe().expect("the test binary's path");
    let memory_mb = env_u64("TESSERA_FUZZ_MEMORY_MB").unwrap_or(DEFAULT_MEMORY_MB);
    let began = Instant::now();
    let mut failures: Vec<Failure> = Vec::new();
    let mut crashes = 0;
    let mut ran = 0u64;
    let mut start = 0u64;
    loop {
        let _ = std::fs::remove_file(&progress);
        let left = settings
            .time_limit
            .map(|t| t.saturating_sub(began.elapsed()).as_secs().max(1));
        let mut cmd = limited_command(&exe, memory_mb);
        cmd.args([target.test, "--exact", "--nocapture", "--test-threads=1"])
            .env("TESSERA_FUZZ_CHILD", "1")
            .env("TESSERA_FUZZ_SEED", settings.seed.to_string())
            .env("TESSERA_FUZZ_CASES", settings.cases.to_string())
            .env("TESSERA_FUZZ_START", start.to_string())
            .env("TESSERA_FUZZ_PROGRESS", &progress)
            .env("MALLOC_ARENA_MAX", "2")
            .env_remove("TESSERA_FUZZ_REPLAY")
            .env_remove("RUST_BACKTRACE")
            .stdin(Stdio::null());
        match left {
            Some(s) => cmd.env("TESSERA_FUZZ_SECONDS", s.to_string()),
            None => cmd.env_remove("TESSERA_FUZZ_SECONDS"),
        };
        let deadline = left.map(|s| Duration::from_secs(s) + HANG_GRACE);
        let out = run_with_deadline(cmd, deadline);
        let stdout = String::from_utf8_lossy(&out.stdout);
        let mut done = None;
        for line in stdout.lines() {
            // libtest may have written `test name ... ` on the same line.
            let start = [FAILURE, DONE].iter().filter_map(|m| line.find(m)).min();
            let Some(start) = start else { continue };
            let fields: Vec<&str> = line[start..].split('\t').collect();
            match fields.as_slice() {
                [FAILURE, first, count, message] => failures.push(Failure {
                    first: first.parse().expect("case index"),
                    count: count.parse().expect("count"),
                    message: unescape(message),
                }),
                [DONE, cases, _] => done = Some(cases.parse::<u64>().expect("case count")),
                _ => {}
            }
        }
        if let (Some(cases), Some(true)) = (done, out.status.map(|s| s.success())) {
            ran += cases;
            break;
        }
        // The child died in a case: which one is in the progress file.
        let (at, what, detail) = read_progress(&progress);
        let stderr = String::from_utf8_lossy(&out.stderr);
        let tail = stderr_tail(&stderr);
        let message = format!(
            "the process died ({}){}: {}\n{}{}",
            match &out.status {
                Some(status) => describe_status(status),
                None => format!(
                    "killed after hanging past its time limit by {} s",
                    HANG_GRACE.as_secs()
                ),
            },
            match what.is_empty() {
                true => String::new(),
                false => format!(" in `{what}`"),
            },
            tail.last().copied().unwrap_or("(nothing on stderr)"),
            match detail.is_empty() {
                true => String::new(),
                false => format!("  while running: {detail}\n"),
            },
            indent(&tail.join("\n"))
        );
        let Some(at) = at else {
            panic!(
                "{}: the fuzz child failed before its first case: {message}\nstdout:\n{stdout}",
                target.test
            );
        };
        ran += at + 1 - start;
        let key = failure_key(&message);
        match failures.iter_mut().find(|f| failure_key(&f.message) == key) {
            Some(f) => f.count += 1,
            None => failures.push(Failure {
                first: at,
                count: 1,
                message,
            }),
        }
        crashes += 1;
        start = at + 1;
        if crashes >= MAX_CRASHES || start >= settings.cases {
            break;
        }
        if settings.time_limit.is_some_and(|t| began.elapsed() > t) {
            break;
        }
    }
    let _ = std::fs::remove_file(&progress);
    let elapsed = began.elapsed().as_secs_f64();
    eprintln!(
        "fuzz {}: {ran} cases in {elapsed:.1} s (seed {:#x}), {} distinct failures",
        target.test,
        settings.seed,
        failures.len()
    );
    if failures.is_empty() {
        return;
    }
    panic!("{}", report(target, settings, &failures, crashes));
}

fn report<I>(
    target: &Target<I>,
    settings: &Settings,
    failures: &[Failure],
    crashes: usize,
) -> String {
    let mut text = format!(
        "fuzz target `{}` found {} distinct failures (seed {:#x}){}:\n",
        target.test,
        failures.len(),
        settings.seed,
        if crashes >= MAX_CRASHES {
            format!("; stopped after {MAX_CRASHES} crashed processes")
        } else {
            String::new()
        }
    );
    for f in failures.iter().take(MAX_REPORTED) {
        let input = (target.generate)(&mut Rng::for_case(settings.seed, f.first));
        let mut shown = (target.show)(&input);
        if shown.chars().count() > MAX_SHOWN {
            shown = shown.chars().take(MAX_SHOWN).collect::<String>() + "…";
        }
        let _ = write!(
            text,
            "\n--- case {} ({} case{} like it): {}\n{}\n    replay: TESSERA_FUZZ_SEED={:#x} TESSERA_FUZZ_REPLAY={} \
             cargo test --release -p {} --test {} {} -- --exact --nocapture\n",
            f.first,
            f.count,
            if f.count == 1 { "" } else { "s" },
            f.message,
            indent(&shown),
            settings.seed,
            f.first,
            env!("CARGO_PKG_NAME"),
            env!("CARGO_CRATE_NAME"),
            target.test,
        );
    }
    if failures.len() > MAX_REPORTED {
        let _ = writeln!(text, "\n… and {} more", failures.len() - MAX_REPORTED);
    }
    text
}

fn indent(text: &str) -> String {
    text.lines()
        .map(|l| format!("    | {l}"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// How long past its time limit a child may run before it is taken for
/// hung and killed.
const HANG_GRACE: Duration = Duration::from_secs(60);

/// What a child left: its exit status (`None`: killed at the deadline),
/// stdout and stderr.
struct ChildOutput {
    status: Option<std::process::ExitStatus>,
    stdout: Vec<u8>,
    stderr: Vec<u8>,
}

/// Runs `cmd` to its end, or kills it at `deadline`.
fn run_with_deadline(mut cmd: Command, deadline: Option<Duration>) -> ChildOutput {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the fuzz child starts");
    let drain = |pipe: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            if let Some(mut pipe) = pipe {
                let _ = pipe.read_to_end(&mut bytes);
            }
            bytes
        })
    };
    let stdout = drain(
        child
            .stdout
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let stderr = drain(
        child
            .stderr
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let began = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("waiting for the fuzz child") {
            break Some(status);
        }
        if deadline.is_some_and(|d| began.elapsed() > d) {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    ChildOutput {
        status,
        stdout: stdout.join().unwrap_or_default(),
        stderr: stderr.join().unwrap_or_default(),
    }
}

/// A command that runs `exe` with its address space limited to `mb` MiB
/// (through the shell's `ulimit -v`, where there is one).
fn limited_command(exe: &std::path::Path, mb: u64) -> Command {
    if cfg!(unix) && std::path::Path::new("/bin/sh").exists() {
        let mut cmd = Command::new("/bin/sh");
        cmd.arg("-c")
            .arg(format!(
                "ulimit -c 0; ulimit -S -v {} 2>/dev/null; exec \"$0\" \"$@\"",
                mb * 1024
            ))
            .arg(exe);
        cmd
    } else {
        Command::new(exe)
    }
}

fn progress_path(test: &str) -> PathBuf {
    std::env::temp_dir().join(format!(
        "tessera-fuzz-{}-{test}.progress",
        std::process::id()
    ))
}

/// The case a child was running, with its last [`note`].
fn read_progress(path: &PathBuf) -> (Option<u64>, String, String) {
    let mut text = String::new();
    if let Ok(mut file) = std::fs::File::open(path) {
        let _ = file.read_to_string(&mut text);
    }
    let mut parts = text.splitn(3, '\n');
    let index = parts.next().and_then(|i| i.trim().parse().ok());
    let what = parts.next().unwrap_or_default().to_string();
    (index, what, parts.next().unwrap_or_default().to_string())
}

fn describe_status(status: &std::process::ExitStatus) -> String {
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(signal) = status.signal() {
            let name = match signal {
                4 => "SIGILL",
                6 => "SIGABRT",
                7 => "SIGBUS",
                8 => "SIGFPE",
                9 => "SIGKILL",
                11 => "SIGSEGV",
                _ => "signal",
            };
            return format!("killed by {name} ({signal})");
        }
    }
    match status.code() {
        Some(code) => format!("exit code {code}"),
        None => "no exit code".to_string(),
    }
}

/// The last lines of a dead child's stderr, without backtraces and
/// tessera's warnings.
fn stderr_tail(stderr: &str) -> Vec<&str> {
    let lines: Vec<&str> = stderr
        .lines()
        .filter(|l| {
            let t = l.trim_start();
            !(t.is_empty()
                || t.starts_with("tessera: warning")
                || t.starts_with("stack backtrace")
                || t.starts_with("note:")
                || t.starts_with("at ")
                || t.split(':')
                    .next()
                    .is_some_and(|n| n.chars().all(|c| c.is_ascii_digit())))
        })
        .collect();
    lines[lines.len().saturating_sub(6)..].to_vec()
}

/// Undoes `str::escape_default` (the child's one-line messages).
fn unescape(text: &str) -> String {
    let mut out = String::new();
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('n') => out.push('\n'),
            Some('t') => out.push('\t'),
            Some('r') => out.push('\r'),
            Some('u') => {
                let hex: String = chars
                    .by_ref()
                    .skip_while(|&c| c == '{')
                    .take_while(|&c| c != '}')
                    .collect();
                if let Some(c) = u32::from_str_radix(&hex, 16).ok().and_then(char::from_u32) {
                    out.push(c);
                }
            }
            Some(other) => out.push(other),
            None => {}
        }
    }
    out
}
