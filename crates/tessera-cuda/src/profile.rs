//! `TESSERA_CUDA_PROFILE=1`: the GPU time of every op, by op and input
//! shapes, measured by synchronizing around each one (so it slows the run
//! down; it is for finding the slow op, not for reporting times).

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use tessera::runtime::array::Array;

use crate::CudaBackend;

fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("TESSERA_CUDA_PROFILE").as_deref() == Ok("1"))
}

static TABLE: Mutex<Option<HashMap<String, (usize, Duration)>>> = Mutex::new(None);
/// When the last profiled op finished: the gap to the next one is host
/// time (autograd, dispatch, anything outside the kernels), booked as
/// `host before <op>`.
static LAST_END: Mutex<Option<Instant>> = Mutex::new(None);

/// Runs `f`, timing it when profiling is on.
pub(crate) fn timed<R>(
    backend: &CudaBackend,
    name: impl FnOnce() -> String,
    inputs: &[&Array],
    f: impl FnOnce() -> R,
) -> R {
    if !enabled() {
        return f();
    }
    let _ = backend.gpu.synchronize();
    let t = Instant::now();
    let gap = LAST_END.lock().expect("poisoned").map(|e| t - e);
    let r = f();
    let _ = backend.gpu.synchronize();
    *LAST_END.lock().expect("poisoned") = Some(Instant::now());
    let shapes: Vec<String> = inputs
        .iter()
        .take(3)
        .map(|x| {
            format!(
                "{}{:?}{}",
                x.dtype(),
                x.shape(),
                if x.is_contiguous() { "" } else { "s" }
            )
        })
        .collect();
    let name = name();
    let key = format!("{name} {}", shapes.join(" "));
    let mut table = TABLE.lock().expect("profile poisoned");
    let table = table.get_or_insert_with(HashMap::new);
    let e = table.entry(key).or_default();
    e.0 += 1;
    e.1 += t.elapsed();
    if let Some(gap) = gap.filter(|g| *g < Duration::from_secs(1)) {
        let h = table.entry(format!("host before {name}")).or_default();
        h.0 += 1;
        h.1 += gap;
    }
    r
}

/// The `top` most expensive entries since the last report (then cleared);
/// empty when profiling is off.
pub fn report(top: usize) -> String {
    *LAST_END.lock().expect("poisoned") = None;
    let Some(table) = TABLE.lock().expect("profile poisoned").take() else {
        return String::new();
    };
    let mut rows: Vec<(String, (usize, Duration))> = table.into_iter().collect();
    rows.sort_by_key(|r| std::cmp::Reverse(r.1 .1));
    let total: Duration = rows.iter().map(|r| r.1 .1).sum();
    let mut s = format!(
        "GPU op time (synchronized), total {:.1} ms\n",
        total.as_secs_f64() * 1e3
    );
    for (key, (n, d)) in rows.into_iter().take(top) {
        s.push_str(&format!(
            "{:>10.3} ms {:>6}x  {key}\n",
            d.as_secs_f64() * 1e3,
            n
        ));
    }
    s
}
