//! `mode=max-autotune` on the GPU: a compiled run tunes each generated
//! kernel's block (a fused pointwise chain, a softmax on register rows)
//! and the flash attention forward's variant once, caches the choice in
//! memory and on disk, reuses it without timing on later calls, and
//! computes what the default mode computes. Runs only with
//! `TESSERA_CUDA_TESTS=1` (on a GPU machine, by `scripts/gpu-check.sh`);
//! there a missing GPU is a failure, not a skip. The selection and cache
//! logic itself is unit-tested without a GPU (`src/autotune.rs`).

use std::sync::Once;

use tessera::compile::Mode;
use tessera::custom_op::flash_attention::{scaled_dot_product_attention, SdpaOptions};
use tessera::ir::DType;
use tessera::runtime::device::Device;
use tessera::tensor::Generator;
use tessera::{compile, Tensor};
use tessera_cuda::autotune::Tuner;

fn gpu() -> bool {
    if std::env::var("TESSERA_CUDA_TESTS").as_deref() != Ok("1") {
        eprintln!("TESSERA_CUDA_TESTS is not 1: CUDA autotune tests do not run here");
        return false;
    }
    static OPEN: Once = Once::new();
    OPEN.call_once(|| tessera_cuda::register().expect("TESSERA_CUDA_TESTS=1 needs a GPU"));
    true
}

fn randn(shape: &[usize], dtype: DType, seed: u64) -> Tensor {
    Tensor::randn(shape, DType::F64, &mut Generator::new(seed))
        .cast(dtype)
        .to(Device::Cuda)
        .unwrap()
}

/// Choices made so far, by timing or read from disk.
fn choices(t: &Tuner) -> usize {
    t.timed() + t.from_disk()
}

#[test]
fn max_autotune_tunes_once_caches_and_computes_what_the_default_mode_does() {
    if !gpu() {
        return;
    }
    // A fused pointwise chain, a softmax over rows of 1024 f32 (register rows:
    // 32 to 1024 threads a row fit), and attention whose forward runs unsplit
    // (80 blocks of 256 queries), so its three variants are candidates.
    let f = |x: &[Tensor]| {
        let chain = ((&x[0] * 1.5 + 0.25).tanh() * &x[0]).relu();
        let soft = (&x[0] * 0.5).softmax(-1);
        let att = scaled_dot_product_attention(&x[1], &x[2], &x[3], SdpaOptions::default());
        vec![chain, soft, att]
    };
    let args = [
        randn(&[256, 1024], DType::F32, 1),
        randn(&[2, 40, 130, 128], DType::BF16, 2),
        randn(&[2, 40, 530, 128], DType::BF16, 3),
        randn(&[2, 40, 530, 128], DType::BF16, 4),
    ];
    let tuner = Tuner::global();
    let start = choices(tuner);
    let plain = compile(f).call(&args);
    assert_eq!(choices(tuner), start, "the default mode tunes nothing");

    let tuned_fn = compile(f).mode(Mode::MaxAutotune);
    let tuned = tuned_fn.call(&args);
    let made = choices(tuner) - start;
    println!(
        "choices made: {made} (timed {}, from disk {}); cache {:?}",
        tuner.timed(),
        tuner.from_disk(),
        tuner.dir()
    );
    assert!(
        made >= 3,
        "the pointwise block, the softmax threads and the flash variant: {made} choices"
    );
    // Cached in memory: a second call times nothing and reads no file.
    let again = tuned_fn.call(&args);
    assert_eq!(
        choices(tuner) - start,
        made,
        "the second call reuses the choices"
    );
    // And on disk: one file per choice, its first line the choice.
    let dir = tuner.dir().expect("a cache folder");
    for (key, choice) in tuner.entries() {
        let text = std::fs::read_to_string(dir.join(format!("{key}.txt")))
            .unwrap_or_else(|e| panic!("choice {key} not on disk: {e}"));
        assert_eq!(text.lines().next(), Some(choice.as_str()), "{key}");
    }

    // A block size or a forward variant only cuts the work differently: the
    // pointwise chain and attention give the same bits; a softmax row summed
    // by another number of threads adds in another order.
    let bits = |t: &Tensor| -> Vec<u64> { t.to_f64_vec().iter().map(|v| v.to_bits()).collect() };
    for outs in [&tuned, &again] {
        assert_eq!(bits(&outs[0]), bits(&plain[0]), "pointwise chain");
        assert_eq!(bits(&outs[2]), bits(&plain[2]), "attention");
        let (a, b) = (outs[1].to_f64_vec(), plain[1].to_f64_vec());
        let worst = a
            .iter()
            .zip(&b)
            .map(|(x, y)| ((x - y) / y.abs().max(1e-30)).abs())
            .fold(0.0, f64::max);
        assert!(worst < 1e-5, "softmax differs by {worst:.2e} (relative)");
    }
}
