//! The convolution epilogue fusions (`passes::conv_epilogue`) against the
//! unfused eager ops: conv + bias + ReLU as one kernel, batch norm (eval)
//! folded into the preceding conv's weights, conv + squeeze + bias, and a
//! whole ResNet-18 in eval mode — the compiled graph shows the folds, the
//! results match eager, and gradients through a fused forward match too.

use tessera::nn::{BatchNorm2d, Conv2d, ParamStore, ResNet, ResNetConfig};
use tessera::tensor::{BatchNormStats, ConvOptions, Generator};
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

/// The optimised forward graph of the last compile, as text.
fn forward_graph(artifacts: &[(String, String)]) -> String {
    graph_text(artifacts, "forward.tir")
}

/// The graph of the values computed once from the frozen (lifted)
/// tensors: the folded weights and biases.
fn frozen_graph(artifacts: &[(String, String)]) -> String {
    graph_text(artifacts, "frozen.tir")
}

fn graph_text(artifacts: &[(String, String)], file: &str) -> String {
    artifacts
        .iter()
        .find(|(name, _)| name.ends_with(file))
        .map(|(_, text)| text.clone())
        .unwrap_or_else(|| panic!("no {file} among {artifacts:?}"))
}

fn lines_with(text: &str, needle: &str) -> usize {
    text.lines().filter(|l| l.contains(needle)).count()
}

const RELU_EPILOGUE: &str = r#"\"activation\":\"relu\""#;

#[test]
fn conv_bias_relu_is_one_kernel_and_matches_eager() {
    let f = compile(|a: &[Tensor]| {
        let y = a[0].conv2d(&a[1], None, ConvOptions::default().padding(1));
        vec![(y + a[2].reshape(&[1, -1, 1, 1])).relu()]
    });
    let args = [
        randn(&[2, 3, 9, 7], 1),
        randn(&[8, 3, 3, 3], 2),
        randn(&[8], 3),
    ];
    let got = f.call(&args)[0].clone();
    let want = (args[0].conv2d(&args[1], None, ConvOptions::default().padding(1))
        + args[2].reshape(&[1, -1, 1, 1]))
    .relu();
    // The same kernel, the bias added and the ReLU applied in the same
    // order: the same bits.
    assert_eq!(max_diff(&got, &want), 0.0);
    let g = forward_graph(&f.last_artifacts());
    assert_eq!(lines_with(&g, "tessera::conv2d"), 1, "{g}");
    assert_eq!(lines_with(&g, RELU_EPILOGUE), 1, "{g}");
    assert_eq!(lines_with(&g, "relu("), 0, "{g}");
    assert_eq!(lines_with(&g, "add("), 0, "{g}");
}

#[test]
fn eval_batch_norm_folds_into_the_conv_weights() {
    let mut store = ParamStore::new();
    let mut g = Generator::new(4);
    let conv = Conv2d::new(
        &mut store,
        "c",
        3,
        8,
        [3, 3],
        ConvOptions::default().stride(2),
        false,
        &mut g,
    );
    let bn = BatchNorm2d::new(&mut store, "bn", 8);
    bn.set_running_stats(BatchNormStats {
        mean: randn(&[8], 5),
        var: randn(&[8], 6).abs() + 0.5,
    })
    .unwrap();
    let (w, b) = bn.affine.as_ref().unwrap();
    w.set(&randn(&[8], 7));
    b.set(&randn(&[8], 8));
    bn.train(false);
    let model = |x: &Tensor| bn.forward(&conv.forward(x)).relu();
    let f = compile(|a: &[Tensor]| vec![model(&a[0])]);
    let x = randn(&[2, 3, 19, 17], 9);
    let got = f.call(std::slice::from_ref(&x))[0].clone();
    let want = model(&x);
    assert_eq!(got.shape(), &[2, 8, 9, 8]);
    let d = max_diff(&got, &want);
    assert!(d < 1e-5, "{d}");
    let text = forward_graph(&f.last_artifacts());
    // One convolution with bias and ReLU; nothing else touches the
    // activations (only the output has their type).
    assert_eq!(lines_with(&text, "tessera::conv2d"), 1, "{text}");
    assert_eq!(lines_with(&text, RELU_EPILOGUE), 1, "{text}");
    assert_eq!(lines_with(&text, ": f32[2,8,9,8]"), 1, "{text}");
    // The scale multiplies the weights (in the forward graph: the
    // parameters require grad here, and their gradients go through it).
    assert!(
        text.lines()
            .any(|l| l.contains("mul(") && l.contains("f32[8,3,3,3]")),
        "{text}"
    );
}

#[test]
fn folded_weights_are_computed_once_and_again_when_a_parameter_changes() {
    let mut store = ParamStore::new();
    let mut g = Generator::new(40);
    let conv = Conv2d::new(
        &mut store,
        "c",
        3,
        4,
        [3, 3],
        ConvOptions::default().padding(1),
        true,
        &mut g,
    );
    let bn = BatchNorm2d::new(&mut store, "bn", 4);
    bn.set_running_stats(BatchNormStats {
        mean: randn(&[4], 41),
        var: randn(&[4], 42).abs() + 0.5,
    })
    .unwrap();
    bn.train(false);
    let model = |x: &Tensor| bn.forward(&conv.forward(x)).relu();
    let f = compile(|a: &[Tensor]| vec![model(&a[0])]);
    let check = |seed: u64| {
        let x = randn(&[2, 3, 7, 6], seed);
        let got = tessera::autograd::no_grad(|| f.call(std::slice::from_ref(&x))[0].clone());
        let d = max_diff(&got, &model(&x));
        assert!(d < 1e-5, "{d}");
    };
    check(43);
    check(44);
    assert_eq!(f.frozen_computes(), 1, "the same parameters: folded once");
    // Under no_grad nothing needs the parameters' gradients: the scaled
    // weights and the bias are computed apart, the forward reads them.
    let (text, frozen) = (
        forward_graph(&f.last_artifacts()),
        frozen_graph(&f.last_artifacts()),
    );
    assert_eq!(lines_with(&text, "tessera::conv2d"), 1, "{text}");
    assert_eq!(lines_with(&text, "rsqrt("), 0, "{text}");
    assert_eq!(lines_with(&text, "mul("), 0, "{text}");
    assert_eq!(lines_with(&frozen, "rsqrt("), 1, "{frozen}");
    assert!(
        frozen
            .lines()
            .any(|l| l.contains("mul(") && l.contains("f32[4,3,3,3]")),
        "{frozen}"
    );
    // A new value for the batch norm's scale and the conv's weight: the
    // next call folds them again (and matches eager with them).
    let (w, _) = bn.affine.as_ref().unwrap();
    w.set(&randn(&[4], 45));
    check(46);
    assert_eq!(f.frozen_computes(), 2);
    conv.weight.set(&randn(&[4, 3, 3, 3], 47));
    check(48);
    check(49);
    assert_eq!(f.frozen_computes(), 3);
}

#[test]
fn conv_squeeze_bias_folds() {
    let f = compile(|a: &[Tensor]| {
        let y = a[0].conv2d(&a[1], None, ConvOptions::default());
        vec![y.reshape(&[2, 6]) + &a[2]]
    });
    let args = [
        randn(&[2, 4, 3, 3], 10),
        randn(&[6, 4, 3, 3], 11),
        randn(&[6], 12),
    ];
    let got = f.call(&args)[0].clone();
    let want = args[0]
        .conv2d(&args[1], None, ConvOptions::default())
        .reshape(&[2, 6])
        + &args[2];
    assert_eq!(max_diff(&got, &want), 0.0);
    let text = forward_graph(&f.last_artifacts());
    assert_eq!(lines_with(&text, "add("), 0, "{text}");
}

#[test]
fn gradients_through_a_fused_forward_match_eager() {
    let f = compile(|a: &[Tensor]| {
        let y = a[0].conv2d(&a[1], None, ConvOptions::default().padding(1).groups(2));
        vec![(y + a[2].reshape(&[1, -1, 1, 1])).relu()]
    });
    let make = || {
        [
            randn(&[2, 4, 6, 5], 13),
            randn(&[6, 2, 3, 3], 14),
            randn(&[6], 15),
        ]
        .map(|t| t.set_requires_grad(true))
    };
    let (a, b) = (make(), make());
    let cot = randn(&[2, 6, 6, 5], 16);
    (&f.call(&a)[0] * &cot).sum(&[], false).backward();
    let eager = (b[0].conv2d(&b[1], None, ConvOptions::default().padding(1).groups(2))
        + b[2].reshape(&[1, -1, 1, 1]))
    .relu();
    (&eager * &cot).sum(&[], false).backward();
    for i in 0..3 {
        let d = max_diff(&a[i].grad().unwrap(), &b[i].grad().unwrap());
        assert!(d < 1e-4, "input {i}: {d}");
    }
}

#[test]
fn resnet18_in_eval_mode_is_conv_kernels_with_epilogues() {
    let mut store = ParamStore::new();
    let config = ResNetConfig {
        width: 8,
        num_classes: 10,
        ..ResNetConfig::resnet18(10)
    };
    let model = ResNet::new(&mut store, "", config, &mut Generator::new(17));
    // Non-trivial running statistics: a few training batches.
    for s in 0..2 {
        model.forward(&randn(&[4, 3, 32, 32], 18 + s));
    }
    model.train(false);
    let f = compile(|a: &[Tensor]| vec![model.forward(&a[0])]);
    let x = randn(&[2, 3, 32, 32], 30);
    let got = f.call(std::slice::from_ref(&x))[0].clone();
    let want = model.forward(&x);
    let d = max_diff(&got, &want);
    assert!(d < 1e-4, "{d}");
    let text = forward_graph(&f.last_artifacts());
    // 20 convolutions (17 + 3 downsampling); the stem's and each block's
    // first carry the ReLU (9); the block outputs' ReLUs follow the
    // residual add (8).
    assert_eq!(lines_with(&text, "tessera::conv2d"), 20, "{text}");
    assert_eq!(lines_with(&text, RELU_EPILOGUE), 9, "{text}");
    assert_eq!(lines_with(&text, "relu("), 8, "{text}");
    assert_eq!(
        lines_with(&text, "rsqrt("),
        20,
        "one per batch norm, on its [C] vector: {text}"
    );
}
