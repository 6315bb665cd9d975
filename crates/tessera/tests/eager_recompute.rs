//! The `recompute` hint in eager work (issue 20, item 5): the eager tape
//! keeps none of the values a recompute region makes, and the backward
//! recomputes the ones it reads by replaying the region's recorded ops
//! (`tensor::recompute`, PyTorch's `torch.utils.checkpoint`). Values and
//! gradients are the unhinted run's bit for bit (the same kernels on the
//! same inputs). Every test takes [`allocator`]: some read the CPU
//! allocator's global counters, and the replay counter is per thread.

mod common;

use std::sync::{Mutex, MutexGuard};

use tessera::autograd::no_grad;
use tessera::compile::{compile, Backend};
use tessera::hints;
use tessera::nn::{
    LayerNorm, Mlp, MultiHeadAttention, ParamStore, TransformerBlock, TransformerConfig,
};
use tessera::runtime::cpu::{memory_stats, reset_peak};
use tessera::tensor::offload::{self, OffloadStats};
use tessera::tensor::{recompute, Generator};
use tessera::{DType, Tensor};

const RECOMPUTE: &str = r#"{"recompute": true}"#;

fn allocator() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn randn(shape: &[usize], seed: u64) -> Tensor {
    Tensor::randn(shape, DType::F32, &mut Generator::new(seed))
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.to_vec::<f32>()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

/// `body` inside a scope of `hint` (when given).
fn hinted<R>(hint: Option<&str>, body: impl FnOnce() -> R) -> R {
    match hint {
        Some(h) => hints::scope(h, body).unwrap(),
        None => body(),
    }
}

/// A module built from a store and a generator, as a function of its input.
type Build = fn(&mut ParamStore, &mut Generator) -> Box<dyn Fn(&Tensor) -> Tensor>;

/// Builds the module from seed 11, runs it on `x` (shape `shape`, requires
/// grad) inside `hint`'s region, and backpropagates `sum(y * y)` (outside
/// the region): the loss, `y`, `x`'s gradient and every parameter's, as
/// bits, and how many ops the backward replayed.
fn run(build: Build, shape: &[usize], hint: Option<&str>) -> (Vec<Vec<u32>>, usize) {
    let mut g = Generator::new(11);
    let mut store = ParamStore::new();
    let f = build(&mut store, &mut g);
    let x = randn(shape, 3).set_requires_grad(true);
    let y = hinted(hint, || f(&x));
    let loss = (&y * &y).sum(&[], false);
    recompute::reset_replayed();
    loss.backward();
    let mut seen = vec![bits(&loss), bits(&y), bits(&x.grad().unwrap())];
    seen.extend(store.iter().map(|p| bits(&p.grad().expect("a gradient"))));
    (seen, recompute::replayed())
}

const CONFIG: TransformerConfig = TransformerConfig {
    vocab: 16,
    d_model: 16,
    n_heads: 2,
    n_layers: 1,
    d_ff: 64,
    max_len: 8,
    dropout: 0.25,
};

fn mlp(store: &mut ParamStore, g: &mut Generator) -> Box<dyn Fn(&Tensor) -> Tensor> {
    let m = Mlp::new(store, "mlp", 16, 64, g);
    Box::new(move |x| m.forward(x))
}

fn attention(store: &mut ParamStore, g: &mut Generator) -> Box<dyn Fn(&Tensor) -> Tensor> {
    let m = MultiHeadAttention::new(store, "attn", 16, 2, true, g);
    Box::new(move |x| m.forward(x))
}

fn layer_norm(store: &mut ParamStore, _: &mut Generator) -> Box<dyn Fn(&Tensor) -> Tensor> {
    let m = LayerNorm::new(store, "ln", 16, 1e-5, true);
    Box::new(move |x| m.forward(x))
}

/// A pre-norm transformer block (layer norms, causal attention, MLP) with
/// dropout on in training: the masks come from the block's generator.
fn block_with_dropout(store: &mut ParamStore, g: &mut Generator) -> Box<dyn Fn(&Tensor) -> Tensor> {
    let m = TransformerBlock::new(store, "block", &CONFIG, g);
    Box::new(move |x| m.forward(x, true))
}

#[test]
fn blocks_in_a_recompute_region_give_the_unhinted_values_and_gradients_bit_for_bit() {
    let _lock = allocator();
    let cases: [(&str, Build); 4] = [
        ("mlp", mlp),
        ("attention", attention),
        ("layer norm", layer_norm),
        ("transformer block with dropout", block_with_dropout),
    ];
    for (name, build) in cases {
        let (plain, none) = run(build, &[2, 8, 16], None);
        assert_eq!(none, 0, "{name}: nothing to replay without the hint");
        let (checkpointed, replayed) = run(build, &[2, 8, 16], Some(RECOMPUTE));
        assert!(replayed > 0, "{name}: the backward recomputed nothing");
        assert_eq!(checkpointed.len(), plain.len());
        for (i, (a, b)) in plain.iter().zip(&checkpointed).enumerate() {
            assert!(a == b, "{name}: value {i} differs from the unhinted run");
        }
    }
}

/// The dropout masks are the forward's: a replay draws nothing (the masks
/// are made by ops that record nothing, and the region keeps them), so a
/// different mask would show in the gradients, which the test above
/// compares; here the masks are checked to be nontrivial and the
/// generator's state after the step to be the unhinted run's.
#[test]
fn dropout_in_a_recompute_region_keeps_its_masks_and_draws_nothing_more() {
    let _lock = allocator();
    let step = |hint: Option<&str>| {
        let mut g = Generator::new(5);
        let drop = tessera::nn::Dropout::new(0.5, &mut g);
        let w = randn(&[16, 16], 2).set_requires_grad(true);
        let x = randn(&[32, 16], 1);
        let y = hinted(hint, || drop.forward(&x.matmul(&w).tanh(), true).exp());
        y.sum(&[], false).backward();
        // The next mask the module draws: the same when the backward drew none.
        let next = drop.forward(&Tensor::ones(&[64], DType::F32), true);
        (bits(&y), bits(&w.grad().unwrap()), bits(&next))
    };
    let plain = step(None);
    recompute::reset_replayed();
    let checkpointed = step(Some(RECOMPUTE));
    // exp reads its output: recomputed from mul(tanh(matmul)), the kept mask.
    assert_eq!(recompute::replayed(), 4);
    assert_eq!(plain, checkpointed);
    // A dropped element is exp(0) = 1 exactly.
    let dropped = plain.0.iter().filter(|&&b| b == 1f32.to_bits()).count();
    assert!(dropped > 0 && dropped < plain.0.len(), "{dropped} dropped");
}

/// `t = tanh(x @ w)` is read by four rules of the region (tanh's own, the
/// product's two operands, sin's input): the backward recomputes it, and
/// the matmul it needs, once.
#[test]
fn a_value_read_by_several_rules_is_recomputed_once_per_backward() {
    let _lock = allocator();
    let x = randn(&[8, 8], 1);
    let w = randn(&[8, 8], 2).set_requires_grad(true);
    let step = |hint: Option<&str>| {
        w.zero_grad();
        let out = hinted(hint, || {
            let t = x.matmul(&w).tanh();
            &(&t * &t) + &t.sin()
        });
        recompute::reset_replayed();
        out.sum(&[], false).backward();
        (bits(&out), bits(&w.grad().unwrap()), recompute::replayed())
    };
    let (v, g, none) = step(None);
    assert_eq!(none, 0);
    let (vr, gr, replayed) = step(Some(RECOMPUTE));
    assert_eq!((vr, gr), (v, g));
    assert_eq!(replayed, 2, "matmul and tanh, once each");
}

#[test]
fn strict_regions_recompute_by_default_and_recompute_false_keeps() {
    let _lock = allocator();
    let (plain, _) = run(mlp, &[4, 16], None);
    for (hint, replays) in [
        (r#"{"order": "strict"}"#, true),
        (r#"{"order": "strict", "recompute": false}"#, false),
        (r#"{"order": "strict", "offload": true}"#, false),
        (r#"{"recompute": false}"#, false),
    ] {
        let (seen, replayed) = run(mlp, &[4, 16], Some(hint));
        assert_eq!(seen, plain, "{hint}");
        assert_eq!(replayed > 0, replays, "{hint}: {replayed} replayed");
    }
}

#[test]
fn backward_twice_with_retain_graph_recomputes_each_time_and_a_third_errors() {
    let _lock = allocator();
    let steps = |hint: Option<&str>| {
        let mut g = Generator::new(11);
        let mut store = ParamStore::new();
        let f = mlp(&mut store, &mut g);
        let x = randn(&[4, 16], 3).set_requires_grad(true);
        let loss = hinted(hint, || f(&x)).sum(&[], false);
        let mut replays = Vec::new();
        for _ in 0..2 {
            recompute::reset_replayed();
            loss.try_backward_retain_graph(None).unwrap();
            replays.push(recompute::replayed());
        }
        loss.try_backward(None).unwrap();
        let again = loss.try_backward(None).unwrap_err().to_string();
        assert!(
            again.contains("backward through the graph a second time"),
            "{again}"
        );
        let grads: Vec<Vec<u32>> = store.iter().map(|p| bits(&p.grad().unwrap())).collect();
        (grads, bits(&x.grad().unwrap()), replays)
    };
    let (grads, x_grad, none) = steps(None);
    assert_eq!(none, [0, 0]);
    let (grads_r, x_grad_r, replays) = steps(Some(RECOMPUTE));
    assert_eq!((grads_r, x_grad_r), (grads, x_grad));
    assert!(replays[0] > 0 && replays[0] == replays[1], "{replays:?}");
}

#[test]
fn a_region_that_records_nothing_keeps_nothing_and_says_so() {
    let _lock = allocator();
    let x = randn(&[4, 8], 1);
    let w = randn(&[8, 8], 2);
    let region = r#"{"recompute": true, "group_id": 9201}"#;
    let body = |w: &Tensor| hints::scope(region, || x.matmul(w).tanh()).unwrap();
    // No input requires grad; then grad mode off.
    let plain = body(&w);
    let off = no_grad(|| body(&w.set_requires_grad(true)));
    for t in [&plain, &off] {
        assert!(!t.requires_grad() && t.is_leaf());
    }
    let (said, recompute) = common::eager_notes("9201", "recompute");
    assert_eq!(recompute.len(), 1, "{said:?}");
    assert!(recompute[0].contains("record nothing"), "{said:?}");
}

/// One scope that recomputes and offloads: what the region keeps (the
/// matmul's input `x`; the parameter `w` stays) waits in host memory and
/// comes back once for the replay and the rule; nothing else moves.
#[test]
fn a_recompute_region_that_offloads_moves_only_what_it_keeps() {
    let _lock = allocator();
    let x = randn(&[4, 8], 1);
    let forward = |hint: Option<&str>| {
        let w = randn(&[8, 16], 2).set_requires_grad(true);
        let t = hinted(hint, || x.matmul(&w).tanh());
        ((&t * &t).sum(&[], false), w)
    };
    let (loss, w) = forward(None);
    loss.backward();
    let plain = (bits(&loss), bits(&w.grad().unwrap()));
    offload::reset_stats();
    let (loss, w) = forward(Some(r#"{"recompute": true, "offload": true}"#));
    let x_bytes = 4 * 8 * 4;
    assert_eq!(
        offload::stats(),
        OffloadStats {
            values: 1,
            offloaded_bytes: x_bytes,
            prefetched_bytes: 0
        }
    );
    recompute::reset_replayed();
    loss.backward();
    assert_eq!(offload::stats().prefetched_bytes, x_bytes);
    assert_eq!(recompute::replayed(), 2, "matmul and tanh");
    assert_eq!((bits(&loss), bits(&w.grad().unwrap())), plain);
}

/// An offload scope nested in a recompute scope is a region of its own
/// (it recomputes and offloads): its input `h`, made by the outer region,
/// is kept, in host memory; the outer region keeps `t`, made by the inner
/// one, on the device. Only tanh is replayed (its rule reads its output).
#[test]
fn an_offload_scope_nested_in_a_recompute_scope_offloads_its_kept_inputs() {
    let _lock = allocator();
    let x = randn(&[4, 8], 1);
    let step = |nested: bool| {
        let w1 = randn(&[8, 16], 2).set_requires_grad(true);
        let w2 = randn(&[16, 8], 3).set_requires_grad(true);
        let body = || {
            let h = x.matmul(&w1);
            let t = hinted(nested.then_some(r#"{"offload": true}"#), || h.tanh());
            t.matmul(&w2)
        };
        let out = hinted(nested.then_some(RECOMPUTE), body);
        let loss = (&out * &out).sum(&[], false);
        offload::reset_stats();
        recompute::reset_replayed();
        loss.backward();
        let moved = offload::stats();
        let grads = (bits(&w1.grad().unwrap()), bits(&w2.grad().unwrap()));
        (bits(&loss), grads, moved, recompute::replayed())
    };
    let (loss, grads, moved, replayed) = step(false);
    assert_eq!((moved, replayed), (OffloadStats::default(), 0));
    let (loss_n, grads_n, moved_n, replayed_n) = step(true);
    assert_eq!((loss_n, grads_n), (loss, grads));
    let h_bytes = 4 * 16 * 4;
    assert_eq!(moved_n.prefetched_bytes, h_bytes, "{moved_n:?}");
    assert_eq!(replayed_n, 1);
}

// ------------------------------------------------------------- memory

/// The stack measured: `BLOCKS` blocks `x + relu(x @ w1) @ w2` of `ROWS`
/// rows, `WIDTH` wide with `HIDDEN` hidden units.
const BLOCKS: usize = 8;
const ROWS: usize = 256;
const WIDTH: usize = 16;
const HIDDEN: usize = 256;
const F32: usize = 4;

fn stack_params() -> Vec<Tensor> {
    (0..BLOCKS)
        .flat_map(|i| {
            let scale = 1.0 / (WIDTH as f64).sqrt();
            [
                &randn(&[WIDTH, HIDDEN], 10 + i as u64) * scale,
                &randn(&[HIDDEN, WIDTH], 50 + i as u64) * scale,
            ]
        })
        .map(|w| w.set_requires_grad(true))
        .collect()
}

/// The stack on `x`, each block in its own region of `hint`.
fn stack(x: &Tensor, params: &[Tensor], hint: Option<&str>) -> Tensor {
    let mut x = x.clone();
    for w in params.chunks(2) {
        x = hinted(hint, || &x + &x.matmul(&w[0]).relu().matmul(&w[1]));
    }
    x
}

/// The peak of live CPU bytes during the forward and backward of the
/// stack beyond what was live before (inputs, parameters), the bytes live
/// after the forward alone, and the gradients as bits.
fn measured(hint: Option<&str>) -> (usize, usize, Vec<Vec<u32>>) {
    let x = randn(&[ROWS, WIDTH], 1);
    let params = stack_params();
    let before = memory_stats().live_bytes;
    reset_peak();
    let out = stack(&x, &params, hint);
    let loss = (&out * &out).sum(&[], false);
    let after_forward = memory_stats().live_bytes - before;
    loss.backward();
    let peak = memory_stats().peak_bytes - before;
    let grads = params.iter().map(|p| bits(&p.grad().unwrap())).collect();
    (peak, after_forward, grads)
}

/// Bytes of one block's hidden activation, of one block's input, and of
/// all the parameters' gradients.
const HIDDEN_BYTES: usize = ROWS * HIDDEN * F32;
const ROW_BYTES: usize = ROWS * WIDTH * F32;
const PARAM_BYTES: usize = BLOCKS * 2 * WIDTH * HIDDEN * F32;

/// Unhinted, each block keeps its input, `x @ w1` (relu reads it) and
/// `relu(…)` (the second matmul reads it) until the backward: at least
/// `2 · BLOCKS` hidden activations. In recompute regions each keeps only
/// its input; the backward recomputes one block's two hidden activations
/// at a time, next to their two gradients: the peak is bounded by the
/// blocks' inputs, the output, four hidden activations, a few row-sized
/// gradients and the parameters' gradients.
#[test]
fn a_stack_of_recompute_regions_keeps_only_the_blocks_inputs() {
    let _lock = allocator();
    let (plain_peak, plain_kept, plain_grads) = measured(None);
    let (peak, kept, grads) = measured(Some(RECOMPUTE));
    assert_eq!(grads, plain_grads);
    assert!(
        plain_kept >= 2 * BLOCKS * HIDDEN_BYTES,
        "unhinted: {plain_kept} bytes kept after the forward"
    );
    assert!(
        kept <= (BLOCKS + 2) * ROW_BYTES,
        "recompute: {kept} bytes kept after the forward, more than the blocks' inputs \
         and the output ({} each)",
        ROW_BYTES
    );
    let bound = (BLOCKS + 6) * ROW_BYTES + 4 * HIDDEN_BYTES + PARAM_BYTES;
    assert!(
        peak <= bound,
        "recompute: peak {peak} > {bound} (unhinted {plain_peak})"
    );
    assert!(peak * 2 < plain_peak, "{peak} vs unhinted {plain_peak}");
    eprintln!(
        "stack of {BLOCKS} blocks: peak {plain_peak} → {peak} bytes, kept after the \
         forward {plain_kept} → {kept}"
    );
}

// ------------------------------------------------- compile's backends

/// `eager` (the captured ops on the tape) recomputes like plain eager;
/// `aot_eager` recomputes through AOT autograd's partition: after the
/// forward, each keeps the blocks' inputs, not their hidden activations,
/// and the gradients are the unhinted run's.
#[test]
fn the_eager_and_aot_eager_backends_recompute_the_regions() {
    let _lock = allocator();
    for backend in [Backend::Eager, Backend::AotEager] {
        let run = |hint: Option<&'static str>| {
            let f = compile(move |a: &[Tensor]| {
                let out = stack(&a[0], &a[1..], hint);
                vec![(&out * &out).sum(&[], false)]
            })
            .backend(backend);
            let mut inputs = vec![randn(&[ROWS, WIDTH], 1)];
            inputs.extend(stack_params());
            let before = memory_stats().live_bytes;
            recompute::reset_replayed();
            let loss = f.call(&inputs).remove(0);
            let kept = memory_stats().live_bytes - before;
            loss.backward();
            let grads: Vec<Vec<u32>> = inputs[1..]
                .iter()
                .map(|p| bits(&p.grad().unwrap()))
                .collect();
            (bits(&loss), grads, kept, recompute::replayed())
        };
        let (loss, grads, plain_kept, _) = run(None);
        let (loss_r, grads_r, kept, replayed) = run(Some(RECOMPUTE));
        assert_eq!((&loss_r, &grads_r), (&loss, &grads), "{backend:?}");
        assert!(
            plain_kept >= 2 * BLOCKS * HIDDEN_BYTES,
            "{backend:?}: unhinted kept {plain_kept}"
        );
        assert!(
            kept <= (BLOCKS + 2) * ROW_BYTES,
            "{backend:?}: recompute kept {kept} bytes after the forward"
        );
        // The tape replays for `eager`; `aot_eager`'s backward graph holds
        // the recomputation.
        assert_eq!(replayed > 0, backend == Backend::Eager, "{backend:?}");
    }
}
