//! The compiled training step with a dynamic loss scaler
//! (`TrainStep::loss_scaler`) against the eager f16 loop it replaces —
//! `MixedPrecision`/`GradScaler`: scale the loss, backward, unscale, clip,
//! step unless a gradient overflowed, adapt the scale — with the scale,
//! the growth tracker and the optimizer's step counts on the device.

use tessera::compile::{train_step, Backend, TrainStep};
use tessera::nn::{mse, Linear, ParamStore, Parameter};
use tessera::optim::{
    clip_grad_norm, AdamW, AdamWConfig, GradScalerConfig, MixedPrecision, Optimizer, Sgd,
    SgdConfig, TraceableOptimizer,
};
use tessera::tensor::Generator;
use tessera::{autocast, DType, Tensor};

const STEPS: usize = 20;

/// An MLP whose forward runs under f16 autocast (f32 master weights).
struct Mlp {
    store: ParamStore,
    l1: Linear,
    l2: Linear,
}

fn mlp() -> Mlp {
    let mut g = Generator::new(3);
    let mut store = ParamStore::new();
    let l1 = Linear::new(&mut store, "l1", 8, 32, true, &mut g);
    let l2 = Linear::new(&mut store, "l2", 32, 4, true, &mut g);
    Mlp { store, l1, l2 }
}

/// The loss in f16 autocast: f16 matmuls, an f32 loss.
fn mlp_loss(m: &Mlp) -> impl Fn(&[Tensor]) -> Tensor + '_ {
    move |b: &[Tensor]| {
        autocast(DType::F16, || {
            mse(&m.l2.forward(&m.l1.forward(&b[0]).tanh()), &b[1])
        })
    }
}

/// Batch `i`; at the steps of `bad`, one input is inf (every gradient of
/// the first layer's weight is then inf or NaN).
fn mlp_batch(bad: &'static [usize]) -> impl Fn(usize) -> Vec<Tensor> {
    move |i| {
        let mut g = Generator::new(200 + i as u64);
        let mut x = Tensor::randn(&[16, 8], DType::F32, &mut g).to_f64_vec();
        if bad.contains(&i) {
            x[5] = f64::INFINITY;
        }
        vec![
            Tensor::from_vec(x.iter().map(|&v| v as f32).collect(), &[16, 8]),
            Tensor::randn(&[16, 4], DType::F32, &mut g),
        ]
    }
}

fn adamw(store: &ParamStore) -> AdamW {
    let config = AdamWConfig {
        lr: 0.01,
        weight_decay: 0.1,
        ..AdamWConfig::default()
    };
    AdamW::new(store.parameters(), config)
}

fn lr_at(i: usize) -> f64 {
    0.01 * (1.0 - 0.03 * i as f64)
}

/// What a run gave, step by step.
#[derive(Debug, Default, PartialEq)]
struct Run {
    losses: Vec<f64>,
    /// The scale after each step.
    scales: Vec<f64>,
    skipped: usize,
}

/// The eager loop: `MixedPrecision` f16 with `config`'s scaler, clipping
/// at `clip`.
fn eager_run<O: Optimizer>(
    opt: &mut O,
    params: &[Parameter],
    loss_fn: impl Fn(&[Tensor]) -> Tensor,
    batch: impl Fn(usize) -> Vec<Tensor>,
    config: &GradScalerConfig,
    clip: Option<f64>,
) -> Run {
    let mut amp = MixedPrecision::with_scaler(DType::F16, params.to_vec(), config.clone()).unwrap();
    let mut run = Run::default();
    for i in 0..STEPS {
        opt.set_lr(lr_at(i));
        opt.zero_grad();
        let loss = amp.forward(|| loss_fn(&batch(i)));
        amp.backward(&loss).unwrap();
        amp.unscale().unwrap();
        if let Some(max) = clip {
            clip_grad_norm(params, max);
        }
        amp.step(opt).unwrap();
        run.losses.push(loss.item());
        run.scales.push(amp.scaler().unwrap().scale_factor());
    }
    run.skipped = amp.scaler().unwrap().skipped_steps();
    run
}

/// The same steps compiled.
fn compiled_run<O: TraceableOptimizer>(
    step: &mut TrainStep<'_, O>,
    batch: impl Fn(usize) -> Vec<Tensor>,
) -> Run {
    let mut run = Run::default();
    for i in 0..STEPS {
        step.optimizer().set_lr(lr_at(i));
        run.losses.push(step.step(&batch(i)).item());
        run.scales.push(step.loss_scale().unwrap().unwrap());
    }
    run.skipped = step.skipped_steps().unwrap().unwrap();
    run
}

fn values(store: &ParamStore) -> Vec<(String, Vec<f64>)> {
    store
        .iter()
        .map(|p| (p.name().to_string(), p.get().to_f64_vec()))
        .collect()
}

/// Every value within `tol` relative to the larger magnitude (at least
/// `tol` absolute).
fn assert_close(what: &str, got: &[f64], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let scale = g.abs().max(w.abs()).max(1.0);
        assert!(
            (g - w).abs() <= tol * scale,
            "{what}[{i}]: compiled {g:e}, eager {w:e} (tolerance {tol:e})"
        );
    }
}

fn assert_params(compiled: &ParamStore, eager: &ParamStore, tol: f64) {
    for ((name, got), (_, want)) in values(compiled).iter().zip(values(eager)) {
        assert_close(name, got, &want, tol);
    }
}

fn scaler(init_scale: f64, growth_interval: usize) -> GradScalerConfig {
    GradScalerConfig {
        init_scale,
        growth_interval,
        ..GradScalerConfig::default()
    }
}

/// Parameters whose gradients are their inputs (`loss = sum(a·x0) +
/// sum(b·x1)`, f32, no autocast), so the batch decides them exactly.
struct Linearish {
    store: ParamStore,
    a: Parameter,
    b: Parameter,
}

fn linearish() -> Linearish {
    let mut g = Generator::new(7);
    let mut store = ParamStore::new();
    let a = store.normal("a", &[6, 5], 1.0, &mut g);
    let b = store.normal("b", &[11], 1.0, &mut g);
    Linearish { store, a, b }
}

fn linearish_loss(m: &Linearish) -> impl Fn(&[Tensor]) -> Tensor + '_ {
    move |x: &[Tensor]| (m.a.get() * &x[0]).sum(&[], false) + (m.b.get() * &x[1]).sum(&[], false)
}

/// Batch `i` times `size`, with a NaN in it at the steps of `bad`.
fn linearish_batch(size: f64, bad: &'static [usize]) -> impl Fn(usize) -> Vec<Tensor> {
    move |i| {
        let mut g = Generator::new(100 + i as u64);
        let a = Tensor::randn(&[6, 5], DType::F32, &mut g) * size;
        let mut b = (Tensor::randn(&[11], DType::F32, &mut g) * size).to_f64_vec();
        if bad.contains(&i) {
            b[3] = f64::NAN;
        }
        vec![
            a,
            Tensor::from_vec(b.iter().map(|&v| v as f32).collect(), &[11]),
        ]
    }
}

/// Every parameter's value and optimizer state, as values.
fn snapshot<O: TraceableOptimizer>(step: &TrainStep<'_, O>) -> Vec<Vec<f64>> {
    let opt = step.optimizer();
    let n = opt.params().len();
    let values = opt.params().iter().map(|p| p.get().to_f64_vec());
    let states = (0..n).flat_map(|i| opt.state(i)).map(|t| t.to_f64_vec());
    values.chain(states).collect()
}

/// Equal bits (NaN-free values compared as their bits).
fn assert_bits(what: &str, got: &[Vec<f64>], want: &[Vec<f64>]) {
    let bits = |v: &[Vec<f64>]| -> Vec<Vec<u64>> {
        v.iter()
            .map(|t| t.iter().map(|x| x.to_bits()).collect())
            .collect()
    };
    assert_eq!(bits(got), bits(want), "{what}");
}

// ---------------------------------------------------------------- tests

/// The MLP's f16 autocast forward: the compiled step's fused kernels
/// round its f16 intermediates differently from eager's op-by-op ones
/// (measured on the development machine: losses within 5e-5 relative,
/// parameters within 6e-5), so values agree within `F16_TOL`; the scale
/// sequence and the skipped steps are decided by overflows and agree
/// exactly. A step that counted a skipped step in AdamW's bias correction,
/// or updated on one, is off by ~lr = 1e-2 in the parameters.
const F16_TOL: f64 = 5e-4;

/// The eager MixedPrecision loop on a fresh MLP (AdamW, clipping at 1.0,
/// an inf input at step 9): the model it trained and its run.
fn clipped_eager_mlp_run(config: &GradScalerConfig) -> (Mlp, Run) {
    let eager = mlp();
    let params = eager.store.parameters();
    let want = eager_run(
        &mut adamw(&eager.store),
        &params,
        mlp_loss(&eager),
        mlp_batch(&[9]),
        config,
        Some(1.0),
    );
    (eager, want)
}

#[test]
fn f16_compiled_with_the_scaler_trains_as_the_eager_mixed_precision_loop() {
    // 2^20: the first steps' f16 gradients overflow (the scale backs off
    // to fit), it grows every 4 good steps (and overflows again), and
    // step 9's inf input makes one more bad step.
    let config = scaler(2f64.powi(20), 4);
    let (eager, want) = clipped_eager_mlp_run(&config);
    let compiled = mlp();
    let mut step = train_step(mlp_loss(&compiled), adamw(&compiled.store))
        .clip_grad_norm(1.0)
        .loss_scaler(config.clone());
    let got = compiled_run(&mut step, mlp_batch(&[9]));
    assert!(want.skipped >= 3, "steps overflow: {want:?}");
    let grew = want.scales.windows(2).any(|w| w[1] > w[0]);
    assert!(grew, "the scale grows: {:?}", want.scales);
    assert_eq!(got.scales, want.scales);
    assert_eq!(got.skipped, want.skipped);
    assert_close("losses", &got.losses, &want.losses, F16_TOL);
    assert_params(&compiled.store, &eager.store, F16_TOL);
    let s = step.stats();
    assert_eq!(
        (s.compiles, s.recompiles),
        (1, 0),
        "one compile for the run"
    );
    // The optimizer gets the steps taken back: 20 less the skipped ones.
    let opt = step.into_optimizer();
    for i in 0..opt.params().len() {
        assert_eq!(opt.steps_taken(i), (STEPS - want.skipped) as u64);
    }
}

#[test]
fn the_uncompiled_pipeline_gives_eagers_losses_and_scales() {
    // Backend `AotEager` runs the traced step op by op: eager's ops in
    // eager's order, so the losses and scales are eager's bits; the
    // parameters differ from them only by AdamW's bias corrections, an
    // f64 `pow` of the device's count where eager takes `powi` of its own.
    let config = scaler(2f64.powi(20), 4);
    let (eager, want) = clipped_eager_mlp_run(&config);
    let compiled = mlp();
    let mut step = train_step(mlp_loss(&compiled), adamw(&compiled.store))
        .clip_grad_norm(1.0)
        .loss_scaler(config)
        .backend(Backend::AotEager);
    let got = compiled_run(&mut step, mlp_batch(&[9]));
    assert_eq!(got, want);
    assert_params(&compiled.store, &eager.store, 1e-6);
}

/// Steps 0, 1 good, 2 with a NaN gradient, 3 and 4 good, with
/// `optimizer` and `donate`: the bad step leaves every parameter and state
/// bit for bit as it was, halves the scale and counts as skipped; the
/// next step updates again, as the first step after the skipped one.
fn a_bad_step_is_skipped<O: TraceableOptimizer>(
    optimizer: impl Fn(&ParamStore) -> O,
    donate: bool,
) {
    let m = linearish();
    let mut step = train_step(linearish_loss(&m), optimizer(&m.store))
        .loss_scaler(scaler(1024.0, 1000))
        .donate(donate);
    let batch = linearish_batch(1.0, &[2]);
    step.step(&batch(0));
    step.step(&batch(1));
    let before = snapshot(&step);
    assert_eq!(step.loss_scale().unwrap(), Some(1024.0));
    let loss = step.step(&batch(2)).item();
    assert!(loss.is_nan(), "the loss itself is NaN: {loss}");
    assert_bits("after the skipped step", &snapshot(&step), &before);
    assert_eq!(step.loss_scale().unwrap(), Some(512.0), "backed off");
    assert_eq!(step.skipped_steps().unwrap(), Some(1));
    step.step(&batch(3));
    let after = snapshot(&step);
    assert_ne!(after[0], before[0], "the next step updates");
    step.step(&batch(4));
    assert_eq!(step.skipped_steps().unwrap(), Some(1));
    assert_eq!(step.stats().compiles, 1);

    // The eager loop, which skips the same step, gives the same values:
    // the step after the skipped one is the optimizer's third, not its
    // fourth.
    let e = linearish();
    let mut opt = optimizer(&e.store);
    let mut amp =
        MixedPrecision::with_scaler(DType::F16, e.store.parameters(), scaler(1024.0, 1000))
            .unwrap();
    for i in 0..5 {
        opt.zero_grad();
        let loss = linearish_loss(&e)(&batch(i));
        amp.backward(&loss).unwrap();
        assert_eq!(amp.step(&mut opt).unwrap(), i != 2);
    }
    // No autocast (an f32 loss of f32 parameters): the same ops, the same
    // order; only AdamW's bias corrections (f64 pow against powi) may
    // differ in the last bit.
    assert_params(&m.store, &e.store, 1e-6);
}

#[test]
fn an_overflowing_step_changes_no_bit_and_backs_off_the_scale() {
    for donate in [true, false] {
        a_bad_step_is_skipped(adamw, donate);
        a_bad_step_is_skipped(
            |store| {
                let config = SgdConfig {
                    lr: 0.1,
                    momentum: 0.9,
                    weight_decay: 0.01,
                };
                Sgd::new(store.parameters(), config)
            },
            donate,
        );
    }
}

#[test]
fn the_scale_grows_after_the_interval_and_stays_within_f32() {
    // Interval 3, a NaN at step 4: grown after steps 0-2, halved at 4,
    // grown again after 5-7 — as eagerly.
    let config = scaler(1024.0, 3);
    let (eager, compiled) = (linearish(), linearish());
    let batch = linearish_batch(1.0, &[4]);
    let params = eager.store.parameters();
    let no_autocast = |b: &[Tensor]| linearish_loss(&eager)(b);
    let want = eager_run(
        &mut adamw(&eager.store),
        &params,
        no_autocast,
        &batch,
        &config,
        None,
    );
    let mut step =
        train_step(linearish_loss(&compiled), adamw(&compiled.store)).loss_scaler(config.clone());
    let got = compiled_run(&mut step, &batch);
    let k = 1024.0;
    assert_eq!(
        &want.scales[..9],
        &[k, k, 2.0 * k, 2.0 * k, k, k, k, 2.0 * k, 2.0 * k]
    );
    assert_eq!(got.scales, want.scales);
    assert_eq!(got.skipped, 1);

    // At the top, growing keeps f32's largest value (tiny inputs keep the
    // scaled gradients finite); at the bottom, every step bad, backing off
    // keeps the smallest normal f32.
    for (init, size, bad, want) in [
        (
            tessera::optim::MAX_SCALE,
            1e-30,
            &[][..],
            tessera::optim::MAX_SCALE,
        ),
        (
            tessera::optim::MIN_SCALE,
            1.0,
            &[0, 1, 2][..],
            tessera::optim::MIN_SCALE,
        ),
    ] {
        let m = linearish();
        let bad: &'static [usize] = Box::leak(bad.to_vec().into_boxed_slice());
        let mut step = train_step(linearish_loss(&m), adamw(&m.store)).loss_scaler(scaler(init, 1));
        let batch = linearish_batch(size, bad);
        for i in 0..3 {
            step.step(&batch(i));
            assert_eq!(step.loss_scale().unwrap(), Some(want), "step {i}");
        }
        assert_eq!(step.skipped_steps().unwrap(), Some(bad.len()));
    }
}

#[test]
fn donation_on_and_off_give_the_same_bits() {
    let config = scaler(2f64.powi(20), 4);
    let (donating, keeping) = (mlp(), mlp());
    let mut step = train_step(mlp_loss(&donating), adamw(&donating.store))
        .clip_grad_norm(1.0)
        .loss_scaler(config.clone());
    let mut kept = train_step(mlp_loss(&keeping), adamw(&keeping.store))
        .clip_grad_norm(1.0)
        .loss_scaler(config)
        .donate(false);
    let a = compiled_run(&mut step, mlp_batch(&[9]));
    let b = compiled_run(&mut kept, mlp_batch(&[9]));
    assert!(a.skipped >= 3, "{a:?}");
    assert_eq!(a, b);
    assert_bits("parameters and state", &snapshot(&step), &snapshot(&kept));
    assert_eq!(
        (step.stats().compiles, kept.stats().compiles),
        (1, 1),
        "one compile each"
    );
}

#[test]
fn a_bad_scaler_configuration_is_an_error_of_the_step() {
    let m = linearish();
    let mut step = train_step(linearish_loss(&m), adamw(&m.store)).loss_scaler(GradScalerConfig {
        backoff_factor: 2.0,
        ..GradScalerConfig::default()
    });
    let before = values(&m.store);
    let err = step
        .try_step(&linearish_batch(1.0, &[])(0))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("train_step") && err.contains("loss_scaler") && err.contains("backoff_factor"),
        "{err}"
    );
    assert_eq!(values(&m.store), before);
}

#[test]
fn each_parameters_update_is_still_one_fused_kernel() {
    // The check reads each gradient once (a fused kernel and its
    // reduction); the scalars (step number, bias corrections, the next
    // scale) are one kernel after it; each parameter's update — the
    // gradient through the check, AdamW, the selection of old or new
    // values — is one kernel writing p, m and v, as without a scaler.
    let m = linearish();
    let mut step = train_step(linearish_loss(&m), adamw(&m.store)).loss_scaler(scaler(1024.0, 3));
    step.step(&linearish_batch(1.0, &[])(0));
    let artifacts = step.last_artifacts();
    let kernels = &artifacts
        .iter()
        .find(|(name, _)| name == "forward.kernels.txt")
        .expect("the kernel list")
        .1;
    let updates: Vec<&str> = kernels
        .lines()
        .filter(|l| l.contains("fused [") && l.contains("sqrt") && l.ends_with("writes 3"))
        .collect();
    assert_eq!(updates.len(), 2, "{kernels}");
    assert!(
        updates.iter().all(|l| l.matches("where").count() == 4),
        "the gradient and p, m, v selected in the update's kernel:\n{kernels}"
    );
    let wheres = kernels.lines().filter(|l| l.contains("where")).count();
    assert_eq!(wheres, 3, "the updates and the scaler's kernel:\n{kernels}");
    let checks = kernels.lines().filter(|l| l.contains("(min)")).count();
    assert_eq!(checks, 2, "one reduction per gradient:\n{kernels}");
}
