//! Automatic dynamic shapes and fusion: the one symbolic executable that
//! serves every size after a shape recompile runs fused at each size (its
//! plan built at the first call of a size and kept), with results equal to
//! eager and to an f64 reference, and no further compile.

use tessera::tensor::Generator;
use tessera::{compile, DType, Tensor};

/// A pointwise chain with a broadcast weight, then a softmax and another
/// pointwise output of it: one row kernel when fused (the chain its
/// prologue, the sigmoid its epilogue).
fn chain(x: &[Tensor]) -> Vec<Tensor> {
    let h = ((&x[0] * 1.5 + 0.25).tanh() * &x[1] - 0.5).relu();
    vec![h.softmax(-1), h.sigmoid() * 2.0]
}

fn assert_close(got: &Tensor, want: &Tensor, tol: f64) {
    assert_eq!(got.shape(), want.shape());
    for (g, w) in got.to_f64_vec().iter().zip(want.to_f64_vec()) {
        assert!((g - w).abs() <= tol * (1.0 + w.abs()), "{g} vs {w}");
    }
}

/// The kernel count and kinds of one kernels listing.
fn kernels(listing: &str) -> (usize, usize, usize) {
    let head = listing.lines().next().expect("a header line");
    let count = head
        .rsplit("-> ")
        .next()
        .and_then(|t| t.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .expect("`N ops -> K kernels`");
    let fused = listing.lines().filter(|l| l.contains(" fused ")).count();
    let rows = listing.lines().filter(|l| l.contains(" rows ")).count();
    (count, fused, rows)
}

#[test]
fn the_symbolic_executable_runs_fused_at_every_size() {
    let f = compile(chain);
    let w = Tensor::randn(&[48], DType::F32, &mut Generator::new(1));
    let sizes = [8usize, 16, 24, 40, 24];
    for (i, &n) in sizes.iter().enumerate() {
        let x = Tensor::randn(&[n, 48], DType::F32, &mut Generator::new(10 + i as u64));
        let args = [x.clone(), w.clone()];
        let got = f.call(&args);
        let eager = chain(&args);
        let wide: Vec<Tensor> = args.iter().map(|t| t.cast(DType::F64)).collect();
        let reference = chain(&wide);
        for ((g, e), r) in got.iter().zip(&eager).zip(&reference) {
            assert_close(g, e, 1e-6);
            assert_close(g, r, 1e-5);
        }
    }
    let stats = f.stats();
    assert_eq!(
        stats.compiles, 2,
        "static at 8, then one symbolic executable"
    );
    let artifacts = f.last_artifacts();
    let listing = |name: &str| {
        artifacts
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, text)| text.clone())
            .unwrap_or_else(|| {
                let names: Vec<&String> = artifacts.iter().map(|(n, _)| n).collect();
                panic!("no {name} among {names:?}")
            })
    };
    // The symbolic plan itself cannot fuse: every op is its own kernel.
    let (symbolic, fused, rows) = kernels(&listing("forward.kernels.txt"));
    assert_eq!((fused, rows), (0, 0), "{symbolic} unfused kernels");
    assert!(symbolic >= 8, "{symbolic}");
    // Each size it ran at was fused once, into one row kernel (every dim
    // became symbolic after the size change: the width is s1).
    for n in [16, 24, 40] {
        let text = listing(&format!("forward.s0={n},s1=48.kernels.txt"));
        assert_eq!(kernels(&text), (1, 0, 1), "size {n}:\n{text}");
    }
    let sized = artifacts
        .iter()
        .filter(|(n, _)| n.ends_with(".kernels.txt") && n.contains("s0="))
        .count();
    assert_eq!(sized, 3, "24 twice is one plan");
}
