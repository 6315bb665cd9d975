//! The `offload` hint in eager work (issue 20, item 5): the eager tape
//! keeps the saved values of a region's ops in host memory and brings them
//! back for the backward (PyTorch's `save_on_cpu`), and the `aot_eager`
//! backend moves its forward's saved values of offload regions op by op.
//! Values and gradients are those of the unhinted run, bit for bit; the
//! thread's offload counters (`tensor::offload::stats`) show what moved.
//! Tests that read the host pool's global counters take [`host_pool`].

mod common;

use std::sync::{Mutex, MutexGuard};

use tessera::compile::{compile, Backend};
use tessera::hints;
use tessera::runtime::cpu::host_memory_stats;
use tessera::tensor::offload::{self, OffloadStats};
use tessera::tensor::Generator;
use tessera::{DType, Tensor};

fn host_pool() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn randn(shape: &[usize], seed: u64) -> Tensor {
    Tensor::randn(shape, DType::F32, &mut Generator::new(seed))
}

/// `x` [4, 8] (no grad), `w` [8, 16] (a parameter).
fn inputs() -> (Tensor, Tensor) {
    (
        randn(&[4, 8], 1),
        randn(&[8, 16], 2).set_requires_grad(true),
    )
}

/// `t = tanh(x @ w)` inside `hint`'s region (when given), then
/// `sum(t * t + t)` outside it.
fn forward(x: &Tensor, w: &Tensor, hint: Option<&str>) -> Tensor {
    let region = || x.matmul(w).tanh();
    let t = match hint {
        Some(h) => hints::scope(h, region).unwrap(),
        None => region(),
    };
    (&(&t * &t) + &t).sum(&[], false)
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.to_vec::<f32>()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

/// The loss and the parameter's gradient, as bits.
fn step(hint: Option<&str>) -> (Vec<u32>, Vec<u32>) {
    let (x, w) = inputs();
    let loss = forward(&x, &w, hint);
    loss.backward();
    (bits(&loss), bits(&w.grad().unwrap()))
}

#[test]
fn the_eager_tape_offloads_what_the_regions_ops_save_and_the_gradients_stay() {
    let _lock = host_pool();
    let plain = step(None);
    offload::reset_stats();
    assert_eq!(step(Some(r#"{"offload": true}"#)), plain);
    // In the region: the matmul saves `x` (4·8 f32; `w` is a parameter and
    // stays), tanh its output (4·16 f32). The ops after it save nothing.
    let saved = (4 * 8 + 4 * 16) * 4;
    assert_eq!(
        offload::stats(),
        OffloadStats {
            values: 2,
            offloaded_bytes: saved,
            prefetched_bytes: saved,
        }
    );
}

#[test]
fn offloaded_values_wait_in_the_host_pool_until_the_graph_goes() {
    let _lock = host_pool();
    let (x, w) = inputs();
    let before = host_memory_stats().live_bytes;
    let loss = forward(&x, &w, Some(r#"{"offload": true}"#));
    let waiting = host_memory_stats().live_bytes - before;
    assert!(
        waiting >= (4 * 8 + 4 * 16) * 4,
        "{waiting} bytes in the host pool"
    );
    loss.backward();
    drop(loss);
    assert_eq!(host_memory_stats().live_bytes, before);
}

#[test]
fn outside_a_region_and_without_grad_nothing_moves_and_the_log_says_why() {
    offload::reset_stats();
    step(None);
    let (x, w) = inputs();
    let region = r#"{"offload": true, "group_id": 9101}"#;
    for _ in 0..2 {
        tessera::autograd::no_grad(|| forward(&x, &w, Some(region)));
    }
    assert_eq!(offload::stats(), OffloadStats::default());
    let (said, offload) = common::eager_notes("9101", "offload");
    assert_eq!(offload.len(), 1, "{said:?}");
    assert!(offload[0].contains("record nothing"), "{said:?}");
    assert_eq!(said.len(), 2, "group_id and offload, once each: {said:?}");
}

#[test]
fn an_offload_region_that_records_says_only_what_it_ignores() {
    let _lock = host_pool();
    let region = r#"{"offload": true, "stream": 3, "group_id": 9102}"#;
    for _ in 0..2 {
        step(Some(region));
    }
    let (said, _) = common::eager_notes("9102", "offload");
    let keys: Vec<bool> = ["stream", "group_id", "offload"]
        .iter()
        .map(|k| said.iter().any(|m| m.contains(&format!("hint \"{k}\""))))
        .collect();
    assert_eq!(keys, [true, true, false], "{said:?}");
    assert_eq!(said.len(), 2, "once per region: {said:?}");
}

#[test]
fn aot_eager_moves_the_saved_values_of_offload_regions() {
    let _lock = host_pool();
    let run = |hint: Option<&'static str>, backend: Backend| {
        let f = compile(move |a: &[Tensor]| vec![forward(&a[0], &a[1], hint)]).backend(backend);
        let (x, w) = inputs();
        offload::reset_stats();
        let loss = f.call(&[x, w.clone()]).remove(0);
        loss.backward();
        (bits(&loss), bits(&w.grad().unwrap()), offload::stats())
    };
    let (loss, grad, moved) = run(None, Backend::Eager);
    assert_eq!(moved, OffloadStats::default());
    for backend in [Backend::AotEager, Backend::Eager] {
        let (l, g, moved) = run(Some(r#"{"offload": true}"#), backend);
        assert_eq!((&l, &g), (&loss, &grad), "{backend:?}");
        assert!(moved.offloaded_bytes > 0, "{backend:?}: {moved:?}");
        assert_eq!(
            moved.prefetched_bytes, moved.offloaded_bytes,
            "{backend:?}: {moved:?}"
        );
    }
    // Without the hint aot_eager moves nothing.
    assert_eq!(run(None, Backend::AotEager).2, OffloadStats::default());
}
