//! The convolutional nn modules: `Conv1d`/`Conv2d` against the functional
//! ops, `BatchNorm2d`'s running statistics (training updates them, eval
//! uses them; a compiled function and a compiled training step update
//! them as eager code does, a bare trace cannot and says so), the
//! pooling modules, and ResNet-18/50 (small widths) forward + backward,
//! eagerly and compiled in eval mode.

use tessera::nn::{
    cross_entropy, AdaptiveAvgPool2d, AvgPool2d, BatchNorm2d, Block, Conv1d, Conv2d, MaxPool2d,
    ParamStore, ResNet, ResNetConfig,
};
use tessera::tensor::{ConvOptions, Generator, PoolOptions};
use tessera::{compile, DType, Tensor};

fn randn(shape: &[usize], seed: u64) -> Tensor {
    Tensor::randn(shape, DType::F32, &mut Generator::new(seed))
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.shape(), b.shape());
    a.to_f64_vec()
        .iter()
        .zip(b.to_f64_vec())
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

#[test]
fn conv_modules_are_the_functional_ops_with_their_parameters() {
    let mut store = ParamStore::new();
    let mut g = Generator::new(1);
    let opts = ConvOptions::default().stride(2).padding(1).groups(2);
    let conv = Conv2d::new(&mut store, "c", 4, 6, [3, 3], opts, true, &mut g);
    assert_eq!(conv.weight.ty().to_string(), "f32[6,2,3,3]");
    // PyTorch's bound: 1/√(2·3·3).
    let bound = 1.0 / 18f64.sqrt();
    assert!(conv
        .weight
        .get()
        .to_f64_vec()
        .iter()
        .all(|v| v.abs() <= bound));
    let x = randn(&[2, 4, 7, 5], 2);
    let y = conv.forward(&x);
    let want = x.conv2d(
        &conv.weight.get(),
        conv.bias.as_ref().map(|b| b.get()).as_ref(),
        opts,
    );
    assert_eq!(y.shape(), &[2, 6, 4, 3]);
    assert_eq!(max_diff(&y, &want), 0.0);
    let e = conv
        .try_forward(&randn(&[2, 3, 7, 5], 3))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("Conv2d `c`") && e.contains("f32[2,3,7,5]"),
        "{e}"
    );

    let c1 = Conv1d::new(
        &mut store,
        "c1",
        3,
        5,
        3,
        ConvOptions::default().same(),
        false,
        &mut g,
    );
    let y = c1.forward(&randn(&[2, 3, 9], 4));
    assert_eq!(y.shape(), &[2, 5, 9]);

    let x = randn(&[1, 2, 6, 6], 5);
    assert_eq!(
        MaxPool2d::new(PoolOptions::new(2)).forward(&x).shape(),
        &[1, 2, 3, 3]
    );
    assert_eq!(
        AvgPool2d::new(PoolOptions::new(3).stride(1).padding(1))
            .forward(&x)
            .shape(),
        &[1, 2, 6, 6]
    );
    let pooled = AdaptiveAvgPool2d::new([1, 1]).forward(&x);
    assert!(max_diff(&pooled, &x.mean(&[2, 3], true)) < 1e-6);
}

#[test]
fn batch_norm_tracks_running_statistics_and_uses_them_in_eval() {
    let mut store = ParamStore::new();
    let bn = BatchNorm2d::new(&mut store, "bn", 3);
    let x = randn(&[4, 3, 5, 5], 6) * 2.0 + 1.0;
    let y = bn.forward(&x);
    // Training: per-channel mean 0 and biased variance 1.
    let m = y.mean(&[0, 2, 3], false).to_f64_vec();
    assert!(m.iter().all(|v| v.abs() < 1e-5), "{m:?}");
    let stats = bn.running_stats().unwrap();
    let batch_mean = x.mean(&[0, 2, 3], false);
    let want_mean = batch_mean.clone() * 0.1;
    assert!(max_diff(&stats.mean, &want_mean) < 1e-6);
    let centred = &x - &batch_mean.reshape(&[1, 3, 1, 1]);
    let unbiased = (&centred * &centred).sum(&[0, 2, 3], false) / 99.0;
    assert!(max_diff(&stats.var, &(unbiased * 0.1 + 0.9)) < 1e-5);
    // Eval: the running statistics, no update.
    bn.train(false);
    let y = bn.forward(&x);
    let want = (&x - &stats.mean.reshape(&[1, 3, 1, 1]))
        / (stats.var.reshape(&[1, 3, 1, 1]) + 1e-5).sqrt();
    assert!(max_diff(&y, &want) < 1e-5);
    assert_eq!(
        max_diff(&bn.running_stats().unwrap().mean, &stats.mean),
        0.0
    );
    // Under a bare trace (which cannot write the statistics back) training
    // mode is an error, not a silently stale update.
    bn.train(true);
    let e = tessera::tensor::trace::trace("bare", &[("x".to_string(), x.ty())], |a| {
        Ok(vec![("y".to_string(), bn.try_forward(&a[0])?)])
    })
    .err()
    .expect("an error in training mode")
    .to_string();
    assert!(
        e.contains("running statistics") && e.contains("BatchNorm2d `bn`"),
        "{e}"
    );
}

/// The small CNN of the batch-norm training tests: two stages of conv,
/// batch norm and relu (the second strided), global average pooling, a
/// linear head.
struct BnNet {
    store: ParamStore,
    c1: Conv2d,
    bn1: BatchNorm2d,
    c2: Conv2d,
    bn2: BatchNorm2d,
    head: tessera::nn::Linear,
}

impl BnNet {
    fn new() -> BnNet {
        let mut store = ParamStore::new();
        let mut g = Generator::new(11);
        let pad = ConvOptions::default().padding(1);
        let c1 = Conv2d::new(&mut store, "c1", 3, 4, [3, 3], pad, false, &mut g);
        let bn1 = BatchNorm2d::new(&mut store, "bn1", 4);
        let c2 = Conv2d::new(&mut store, "c2", 4, 6, [3, 3], pad.stride(2), false, &mut g);
        let bn2 = BatchNorm2d::new(&mut store, "bn2", 6);
        let head = tessera::nn::Linear::new(&mut store, "head", 6, 3, true, &mut g);
        BnNet {
            store,
            c1,
            bn1,
            c2,
            bn2,
            head,
        }
    }

    fn logits(&self, x: &Tensor) -> Tensor {
        let h = self.bn1.forward(&self.c1.forward(x)).relu();
        let h = self.bn2.forward(&self.c2.forward(&h)).relu();
        self.head.forward(&h.mean(&[2, 3], false))
    }

    fn loss(&self, batch: &[Tensor]) -> Tensor {
        cross_entropy(&self.logits(&batch[0]), &batch[1], None)
    }

    fn train(&self, on: bool) {
        self.bn1.train(on);
        self.bn2.train(on);
    }

    fn stats(&self) -> Vec<Tensor> {
        [&self.bn1, &self.bn2]
            .iter()
            .flat_map(|bn| {
                let s = bn.running_stats().unwrap();
                [s.mean, s.var]
            })
            .collect()
    }
}

fn bn_batch(i: usize) -> Vec<Tensor> {
    let x = randn(&[4, 3, 6, 6], 100 + i as u64) * 1.5 + 0.5;
    let y: Vec<i64> = (0..4).map(|j| ((i + j) % 3) as i64).collect();
    vec![x, Tensor::from_vec(y, &[4])]
}

/// The compiled step's passes and fused kernels may reassociate sums (the
/// batch statistics, the convolutions' gradients), so the runs are compared
/// within this relative tolerance; a missing or stale running-statistics
/// update is off by ~momentum·|batch mean| = 1e-2 at once.
const BN_TOLERANCE: f64 = 1e-4;

fn rel_diff(a: &Tensor, b: &Tensor) -> f64 {
    let scale = b.to_f64_vec().iter().fold(0.0f64, |m, v| m.max(v.abs()));
    max_diff(a, b) / (1.0 + scale)
}

#[test]
fn batch_norm_trains_compiled_as_eagerly_running_statistics_included() {
    use tessera::optim::{Optimizer, Sgd, SgdConfig};
    const STEPS: usize = 20;
    let config = SgdConfig {
        lr: 0.1,
        momentum: 0.9,
        weight_decay: 0.0,
    };
    let eager = BnNet::new();
    let mut opt = Sgd::new(eager.store.parameters(), config.clone());
    let mut want = Vec::new();
    for i in 0..STEPS {
        opt.zero_grad();
        let loss = eager.loss(&bn_batch(i));
        loss.backward();
        opt.step();
        want.push(loss.item());
    }

    let net = BnNet::new();
    let mut step = tessera::compile::train_step(
        |b: &[Tensor]| net.loss(b),
        Sgd::new(net.store.parameters(), config),
    );
    let mut got = Vec::new();
    for i in 0..STEPS {
        got.push(step.step(&bn_batch(i)).item());
    }
    assert_eq!(step.stats().compiles, 1, "one executable for the run");
    drop(step);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(
            (g - w).abs() <= BN_TOLERANCE * (1.0 + w.abs()),
            "step {i}: loss {g} compiled, {w} eager"
        );
    }
    assert!(want[STEPS - 1] < want[0], "it trains: {want:?}");
    // The running statistics moved 20 times, as eagerly.
    for (g, w) in net.stats().iter().zip(eager.stats()) {
        assert!(rel_diff(g, &w) < BN_TOLERANCE, "{}", rel_diff(g, &w));
        assert!(max_diff(&w, &Tensor::zeros(w.shape(), DType::F32)) > 1e-2);
    }
    for (g, w) in net.store.iter().zip(eager.store.iter()) {
        assert!(
            rel_diff(&g.get(), &w.get()) < BN_TOLERANCE,
            "{}: {}",
            g.name(),
            rel_diff(&g.get(), &w.get())
        );
    }

    // Eval mode: compiled == eager, and the statistics stay put.
    net.train(false);
    eager.train(false);
    let before = net.stats();
    let f = compile(|a: &[Tensor]| vec![net.logits(&a[0])]);
    let x = bn_batch(99).remove(0);
    let compiled = f.call(std::slice::from_ref(&x))[0].clone();
    let want = eager.logits(&x);
    assert!(rel_diff(&compiled, &want) < BN_TOLERANCE);
    for (a, b) in net.stats().iter().zip(&before) {
        assert_eq!(max_diff(a, b), 0.0);
    }
}

#[test]
fn a_compiled_forward_updates_the_statistics_once_per_call_and_use() {
    // One module used twice in a call: the second use reads the first
    // one's update, compiled as eagerly; two calls, two updates each.
    let mk = || BatchNorm2d::new(&mut ParamStore::new(), "bn", 3);
    let (eager, traced) = (mk(), mk());
    let f = compile(|a: &[Tensor]| {
        let y = traced.forward(&a[0]);
        vec![traced.forward(&(&y * 2.0 + 1.0))]
    });
    for i in 0..2 {
        let x = randn(&[2, 3, 4, 4], 40 + i) * 3.0 - 1.0;
        let y = eager.forward(&x);
        let want = eager.forward(&(&y * 2.0 + 1.0));
        let got = f.call(std::slice::from_ref(&x))[0].clone();
        assert!(rel_diff(&got, &want) < BN_TOLERANCE);
        let (e, t) = (
            eager.running_stats().unwrap(),
            traced.running_stats().unwrap(),
        );
        assert!(rel_diff(&t.mean, &e.mean) < BN_TOLERANCE, "call {i}");
        assert!(rel_diff(&t.var, &e.var) < BN_TOLERANCE, "call {i}");
    }
    assert_eq!(f.stats().compiles, 1);
}

fn small(block: Block, layers: [usize; 4], width: usize) -> ResNetConfig {
    ResNetConfig {
        block,
        layers,
        num_classes: 5,
        width,
        in_channels: 3,
    }
}

fn forward_backward(config: ResNetConfig, expected_params: usize) {
    let mut store = ParamStore::new();
    let model = ResNet::new(&mut store, "", config, &mut Generator::new(7));
    assert_eq!(store.num_parameters(), expected_params);
    let x = randn(&[2, 3, 32, 32], 8);
    let logits = model.forward(&x);
    assert_eq!(logits.shape(), &[2, 5]);
    let loss = cross_entropy(&logits, &Tensor::from_vec(vec![1i64, 3], &[2]), None);
    loss.backward();
    for p in store.iter() {
        let g = p
            .grad()
            .unwrap_or_else(|| panic!("{} has no gradient", p.name()));
        assert!(g.to_f64_vec().iter().all(|v| v.is_finite()), "{}", p.name());
    }
    // Eval mode compiled vs eager.
    model.train(false);
    let f = compile(|a: &[Tensor]| vec![model.forward(&a[0])]);
    let compiled = f.call(std::slice::from_ref(&x))[0].clone();
    let eager = model.forward(&x);
    assert!(
        max_diff(&compiled, &eager) < 1e-4,
        "{}",
        max_diff(&compiled, &eager)
    );
}

#[test]
fn resnet18_forward_and_backward() {
    // torchvision's resnet18 has 11,689,512 parameters; the small one's
    // count is the same architecture's at width 8 and 5 classes.
    let full = {
        let mut s = ParamStore::new();
        let _ = ResNet::new(
            &mut s,
            "",
            ResNetConfig::resnet18(1000),
            &mut Generator::new(0),
        );
        s.num_parameters()
    };
    assert_eq!(full, 11_689_512);
    forward_backward(small(Block::Basic, [2, 2, 2, 2], 8), 177_037);
}

#[test]
fn resnet50_forward_and_backward() {
    let full = {
        let mut s = ParamStore::new();
        let _ = ResNet::new(
            &mut s,
            "",
            ResNetConfig::resnet50(1000),
            &mut Generator::new(0),
        );
        s.num_parameters()
    };
    assert_eq!(full, 25_557_032);
    forward_backward(small(Block::Bottleneck, [3, 4, 6, 3], 4), 96_137);
}
