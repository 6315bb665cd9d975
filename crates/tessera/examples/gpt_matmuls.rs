//! The linear layers' products of a GPT training step (forward `x·W`, the
//! input gradient `dy·Wᵀ` and the weight gradient `xᵀ·dy`) through
//! tessera's matmul, each next to the raw `gemm` crate on the same
//! buffers and strides: best-of-reps ms and GFLOP/s.
//!
//! `cargo run --release -p tessera --example gpt_matmuls [tokens d_model vocab reps]`
//! (defaults: issue 17's GPT, 1024 tokens, d256, vocab 1024, 10 reps).
//! Compare with `torch.mm` on the same shapes.

use std::time::Instant;

use tessera::tensor::Generator;
use tessera::{DType, Tensor};

/// The best of `reps` timings of `f`, in ms.
fn best(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64() * 1e3
        })
        .fold(f64::INFINITY, f64::min)
}

/// `a·b` by the gemm crate, `a` m×k and `b` k×n given by (row, column)
/// strides, into a row-major m×n buffer.
#[allow(clippy::too_many_arguments)]
fn raw_gemm(
    dst: &mut [f32],
    (m, k, n): (usize, usize, usize),
    a: &[f32],
    (a_rs, a_cs): (usize, usize),
    b: &[f32],
    (b_rs, b_cs): (usize, usize),
) {
    assert!(dst.len() == m * n && a.len() >= m * k && b.len() >= k * n);
    // SAFETY: the strides address m×k and k×n elements inside `a` and `b`
    // (both hold whole matrices), `dst` holds m×n at row stride n.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
            false,
            a.as_ptr(),
            a_cs as isize,
            a_rs as isize,
            b.as_ptr(),
            b_cs as isize,
            b_rs as isize,
            0.0f32,
            1.0f32,
            false,
            false,
            false,
            gemm::Parallelism::Rayon(rayon::current_num_threads()),
        )
    }
}

fn main() {
    let arg = |i: usize, default: usize| {
        std::env::args()
            .nth(i)
            .map_or(default, |s| s.parse().expect("arguments are integers"))
    };
    let (tokens, d, vocab, reps) = (arg(1, 1024), arg(2, 256), arg(3, 1024), arg(4, 10));
    let mut g = Generator::new(0);
    let layers = [
        ("qkv", d, 3 * d),
        ("proj", d, d),
        ("fc1", d, 4 * d),
        ("fc2", 4 * d, d),
        ("head", d, vocab),
    ];
    println!("threads {}", rayon::current_num_threads());
    let (mut total_t, mut total_g) = (0.0, 0.0);
    for (name, fan_in, fan_out) in layers {
        let x = Tensor::randn(&[tokens, fan_in], DType::F32, &mut g);
        let w = Tensor::randn(&[fan_in, fan_out], DType::F32, &mut g);
        let dy = Tensor::randn(&[tokens, fan_out], DType::F32, &mut g);
        let host = |t: &Tensor| t.to_vec::<f32>().expect("f32 tensors");
        let (xs, ws, dys) = (host(&x), host(&w), host(&dy));
        let gflop = 2.0 * (tokens * fan_in * fan_out) as f64 / 1e9;
        // (product, tessera, m k n, a and its strides, b and its strides)
        let wt = w.transpose(0, 1);
        let xt = x.transpose(0, 1);
        #[allow(clippy::type_complexity)]
        let cases: [(&str, Box<dyn Fn() -> Tensor>, _, _, _, _, _); 3] = [
            (
                "x·W",
                Box::new(|| x.matmul(&w)),
                (tokens, fan_in, fan_out),
                &xs,
                (fan_in, 1),
                &ws,
                (fan_out, 1),
            ),
            (
                "dy·Wᵀ",
                Box::new(|| dy.matmul(&wt)),
                (tokens, fan_out, fan_in),
                &dys,
                (fan_out, 1),
                &ws,
                (1, fan_out),
            ),
            (
                "xᵀ·dy",
                Box::new(|| xt.matmul(&dy)),
                (fan_in, tokens, fan_out),
                &xs,
                (1, fan_in),
                &dys,
                (fan_out, 1),
            ),
        ];
        for (what, ours, (m, k, n), a, a_st, b, b_st) in cases {
            let t = best(reps, || {
                ours();
            });
            let mut dst = vec![0.0f32; m * n];
            let raw = best(reps, || raw_gemm(&mut dst, (m, k, n), a, a_st, b, b_st));
            total_t += t;
            total_g += raw;
            println!(
                "{name:>5} {what:<7} {m:>5}x{k:>5}x{n:>5}: tessera {t:7.3} ms {:6.1} GFLOP/s | gemm {raw:7.3} ms {:6.1} GFLOP/s",
                gflop / t * 1e3,
                gflop / raw * 1e3
            );
        }
    }
    println!("sum: tessera {total_t:.2} ms, gemm {total_g:.2} ms");
}
