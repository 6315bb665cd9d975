//! Creation kernels: constants, `full`, `arange`, `rand`, `randn`.
//!
//! Values reach their dtype through the cast carrier ([`Wide`]), so creation
//! converts exactly as `cast` does (floats to ints truncate, f16/bf16 round to
//! nearest even).

use rand::{Rng, RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::StandardNormal;
use rayon::prelude::*;

use super::copy::PAR_THRESHOLD;
use super::elementwise::{Castable, Wide, CHUNK};
use super::Storage;
use crate::error::{op_err, Result};
use crate::ir::{DType, Literal, LiteralData, Op, Scalar};
use crate::runtime::array::Array;
use crate::with_dtype;

/// Elements drawn from one random stream. Fixed, so that the values depend
/// only on the seed and the element index, never on the thread count.
const RNG_BLOCK: usize = 4096;

/// The literal's values in its dtype.
pub fn constant(lit: &Literal) -> Result<Array> {
    let numel = crate::limits::check("constant", lit.dtype, &lit.shape)?;
    if lit.data.len() != numel {
        return Err(op_err!(
            Shape,
            "constant",
            "{} values do not fill {}{:?}",
            lit.data.len(),
            lit.dtype,
            lit.shape
        ));
    }
    Ok(with_dtype!(lit.dtype, T => match &lit.data {
        LiteralData::Float(v) => generate(&lit.shape, |i| T::narrow(Wide::F64(v[i]))),
        LiteralData::Int(v) => generate(&lit.shape, |i| T::narrow(Wide::Int(v[i] as i128))),
        LiteralData::Bool(v) => generate(&lit.shape, |i| T::narrow(Wide::Int(v[i] as i128))),
    }))
}

/// `shape` filled with `value` converted to `dtype`.
pub fn full(value: Scalar, dtype: DType, shape: &[usize]) -> Array {
    let wide = match value {
        Scalar::Float(v) => Wide::F64(v),
        Scalar::Int(v) => Wide::Int(v as i128),
        Scalar::Bool(v) => Wide::Int(v as i128),
    };
    with_dtype!(dtype, T => {
        let v = T::narrow(wide);
        generate(shape, |_| v)
    })
}

/// `len` values `start + i * step`, computed in f64 (not by accumulation, so
/// errors do not build up) and then converted to `dtype`.
pub fn arange(start: f64, step: f64, dtype: DType, len: usize) -> Array {
    with_dtype!(dtype, T => generate(&[len], |i| T::narrow(Wide::F64(start + i as f64 * step))))
}

/// The `u64` seed that `seed`, a random op's seed operand (a host `i64[]`
/// scalar, as type inference checks), holds ([`Op::seed_bits`]).
pub fn seed_of(seed: &Array, op: &str) -> Result<u64> {
    match seed.to_vec::<i64>()?.as_slice() {
        [value] => Ok(Op::seed_bits(*value)),
        _ => Err(op_err!(
            Argument,
            op,
            "the seed must be an i64[] scalar, got {}",
            seed.ty()
        )),
    }
}

/// Uniform samples in [0, 1) for `seed`. Each element is a random multiple
/// of 2^-p, p being the dtype's significand bits (24 for f32, 53 for f64, 11
/// for f16, 8 for bf16): exact in the dtype, so rounding can never produce
/// 1.0. Non-float dtypes (rejected by inference) get the f64 samples cast.
pub fn rand(seed: u64, dtype: DType, shape: &[usize]) -> Array {
    let bits = match dtype {
        DType::F32 => 24,
        DType::F16 => 11,
        DType::BF16 => 8,
        _ => 53,
    };
    let scale = 0.5f64.powi(bits);
    with_dtype!(dtype, T => random(seed, shape, |rng| {
        T::narrow(Wide::F64((rng.next_u64() >> (64 - bits)) as f64 * scale))
    }))
}

/// Standard normal samples for `seed`, drawn in f64 and rounded to `dtype`
/// (so one seed gives the same values in every float dtype, up to rounding).
pub fn randn(seed: u64, dtype: DType, shape: &[usize]) -> Array {
    with_dtype!(dtype, T => random(seed, shape, |rng| {
        T::narrow(Wide::F64(rng.sample::<f64, _>(StandardNormal)))
    }))
}

/// A contiguous tensor of `shape` whose element `i` is `f(i)`.
fn generate<T: Castable>(shape: &[usize], f: impl Fn(usize) -> T + Sync) -> Array {
    let mut storage = Storage::new(T::DTYPE, shape.iter().product());
    let fill = |(c, chunk): (usize, &mut [T])| {
        for (j, o) in chunk.iter_mut().enumerate() {
            *o = f(c * CHUNK + j);
        }
    };
    let out = storage.as_mut_slice::<T>();
    if out.len() < PAR_THRESHOLD {
        out.chunks_mut(CHUNK).enumerate().for_each(fill);
    } else {
        out.par_chunks_mut(CHUNK).enumerate().for_each(fill);
    }
    Array::from_storage(storage, shape)
}

/// A contiguous tensor of `shape` filled by `sample`, block `b` of
/// [`RNG_BLOCK`] elements drawing from stream `b` of the ChaCha8 generator
/// seeded with `seed` (counter-based: blocks are independent, so they fill in
/// parallel with the same result on any number of threads).
fn random<T: Castable>(
    seed: u64,
    shape: &[usize],
    sample: impl Fn(&mut ChaCha8Rng) -> T + Sync,
) -> Array {
    let mut storage = Storage::new(T::DTYPE, shape.iter().product());
    let fill = |(b, block): (usize, &mut [T])| {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        rng.set_stream(b as u64);
        for o in block {
            *o = sample(&mut rng);
        }
    };
    let out = storage.as_mut_slice::<T>();
    if out.len() < PAR_THRESHOLD {
        out.chunks_mut(RNG_BLOCK).enumerate().for_each(fill);
    } else {
        out.par_chunks_mut(RNG_BLOCK).enumerate().for_each(fill);
    }
    Array::from_storage(storage, shape)
}

#[cfg(test)]
mod tests {
    use crate::tensor::Tensor;
    use half::{bf16, f16};

    use super::*;

    const FLOATS: [DType; 4] = [DType::F32, DType::F64, DType::F16, DType::BF16];

    fn on_threads<R: Send>(n: usize, f: impl FnOnce() -> R + Send) -> R {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build()
            .unwrap();
        pool.install(f)
    }

    #[test]
    fn constant_from_each_literal_kind() {
        let lit = |dtype, shape: &[usize], data| Literal {
            dtype,
            shape: shape.to_vec(),
            data,
        };
        let t = constant(&lit(
            DType::F16,
            &[2, 2],
            LiteralData::Float(vec![0.5, -1.0, 0.1, 65504.0]),
        ))
        .unwrap();
        assert_eq!((t.dtype(), t.shape()), (DType::F16, &[2usize, 2][..]));
        // 0.1 rounds to the nearest f16, 0.0999755859375.
        assert_eq!(t.to_f64_vec(), [0.5, -1.0, 0.0999755859375, 65504.0]);
        let t = constant(&lit(
            DType::I32,
            &[3],
            LiteralData::Int(vec![-7, 0, i32::MAX.into()]),
        ))
        .unwrap();
        assert_eq!(t.to_vec::<i32>().unwrap(), [-7, 0, i32::MAX]);
        let t = constant(&lit(DType::Bool, &[], LiteralData::Bool(vec![true]))).unwrap();
        assert_eq!((t.shape(), t.to_vec::<u8>().unwrap()), (&[][..], vec![1]));
        let t = constant(&lit(DType::I64, &[0, 4], LiteralData::Int(vec![]))).unwrap();
        assert_eq!(t.shape(), [0, 4]);
        assert!(constant(&lit(DType::F32, &[3], LiteralData::Float(vec![1.0]))).is_err());
    }

    #[test]
    fn full_converts_the_value() {
        for dtype in DType::ALL {
            let t = full(Scalar::Float(2.75), dtype, &[2, 3]);
            assert_eq!((t.dtype(), t.shape()), (dtype, &[2usize, 3][..]));
            // Floats keep 2.75 (exact in all four); ints truncate; bool is != 0.
            let v = match dtype {
                DType::Bool => 1.0,
                d if d.is_int() => 2.0,
                _ => 2.75,
            };
            assert_eq!(t.to_f64_vec(), vec![v; 6], "{dtype}");
        }
        assert_eq!(
            full(Scalar::Int(-3), DType::F32, &[2])
                .to_vec::<f32>()
                .unwrap(),
            [-3.0; 2]
        );
        assert_eq!(
            full(Scalar::Bool(true), DType::I64, &[1])
                .to_vec::<i64>()
                .unwrap(),
            [1]
        );
        assert_eq!(
            full(Scalar::Float(0.0), DType::Bool, &[])
                .to_vec::<u8>()
                .unwrap(),
            [0]
        );
        // Large: the parallel fill.
        let n = PAR_THRESHOLD * 2 + 3;
        let big = full(Scalar::Float(-0.5), DType::BF16, &[n]);
        assert!(big
            .to_vec::<bf16>()
            .unwrap()
            .iter()
            .all(|&v| v == bf16::from_f32(-0.5)));
    }

    #[test]
    fn arange_values() {
        // Hand-derived; lengths as `Tensor::arange` (via inference) computes.
        let t = Tensor::arange(5.0, 0.0, -1.5, DType::F64);
        assert_eq!(t.to_vec::<f64>().unwrap(), [5.0, 3.5, 2.0, 0.5]);
        let t = Tensor::arange(0.0, 1.0, 0.25, DType::F32);
        assert_eq!(t.to_vec::<f32>().unwrap(), [0.0, 0.25, 0.5, 0.75]);
        let t = Tensor::arange(10.0, 0.0, -3.0, DType::I64);
        assert_eq!(t.to_vec::<i64>().unwrap(), [10, 7, 4, 1]);
        // Computed as start + i*step, not accumulated: 0.1*3 is the f64
        // product 0.30000000000000004, which an f32 rounds to 0.3.
        let t = arange(0.0, 0.1, DType::F32, 4);
        assert_eq!(t.to_vec::<f32>().unwrap(), [0.0, 0.1, 0.2, 0.3]);
        let t = arange(-1.0, 0.4, DType::I32, 6);
        // -1, -0.6, -0.2, 0.2, 0.6, 1.0 truncated toward zero.
        assert_eq!(t.to_vec::<i32>().unwrap(), [-1, 0, 0, 0, 0, 1]);
        let t = arange(0.0, 1.0 / 3.0, DType::F16, 4);
        assert_eq!(t.to_vec::<f16>().unwrap()[3], f16::ONE);
        let n = PAR_THRESHOLD + 9;
        let t = arange(3.0, 2.0, DType::I64, n);
        let expected: Vec<i64> = (0..n as i64).map(|i| 3 + 2 * i).collect();
        assert_eq!(t.to_vec::<i64>().unwrap(), expected);
    }

    #[test]
    fn rand_is_deterministic_and_thread_count_independent() {
        // Spans several blocks and the parallel path.
        let shape = [3, PAR_THRESHOLD / 2 + 5];
        for dtype in FLOATS {
            for f in [rand, randn] {
                let a = f(7, dtype, &shape).to_f64_vec();
                assert_eq!(a, f(7, dtype, &shape).to_f64_vec(), "{dtype}");
                assert_eq!(
                    a,
                    on_threads(1, || f(7, dtype, &shape)).to_f64_vec(),
                    "{dtype}"
                );
                assert_eq!(
                    a,
                    on_threads(3, || f(7, dtype, &shape)).to_f64_vec(),
                    "{dtype}"
                );
                let b = f(8, dtype, &shape).to_f64_vec();
                let same = a.iter().zip(&b).filter(|(x, y)| x == y).count();
                // bf16 uniform has only 256 values, so a few coincide.
                assert!(
                    same < a.len() / 100,
                    "{dtype}: seeds 7 and 8 agree on {same}"
                );
                // Blocks draw from different streams, not repeats of one.
                assert_ne!(a[..RNG_BLOCK], a[RNG_BLOCK..2 * RNG_BLOCK]);
            }
        }
        // A prefix of a larger draw is the smaller draw.
        let small = rand(3, DType::F32, &[100]).to_f64_vec();
        assert_eq!(small, rand(3, DType::F32, &[10_000]).to_f64_vec()[..100]);
    }

    #[test]
    fn rand_is_uniform_in_unit_interval() {
        let n = 100_000;
        for dtype in FLOATS {
            let t = rand(11, dtype, &[n]);
            assert_eq!(t.dtype(), dtype);
            let v = t.to_f64_vec();
            assert!(v.iter().all(|&x| (0.0..1.0).contains(&x)), "{dtype}");
            // The mean of n uniforms has sd 1/sqrt(12 n) = 0.0009; allow 5 sd.
            let mean = v.iter().sum::<f64>() / n as f64;
            assert!((mean - 0.5).abs() < 0.0046, "{dtype}: mean {mean}");
            // Both ends of the interval are reached (within 1%).
            let (lo, hi) = v
                .iter()
                .fold((1.0f64, 0.0f64), |(l, h), &x| (l.min(x), h.max(x)));
            assert!(lo < 0.01 && hi > 0.99, "{dtype}: [{lo}, {hi}]");
        }
    }

    #[test]
    fn randn_is_standard_normal() {
        let n = 100_000;
        for dtype in FLOATS {
            let t = randn(5, dtype, &[n]);
            assert_eq!(t.dtype(), dtype);
            let v = t.to_f64_vec();
            let mean = v.iter().sum::<f64>() / n as f64;
            let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
            // Standard errors for n = 1e5: mean 1/sqrt(n) = 0.0032, variance
            // sqrt(2/n) = 0.0045. 5 sd: 0.016 and 0.023 (bf16 rounding adds
            // a relative error below 2^-9 per value, far less).
            assert!(mean.abs() < 0.016, "{dtype}: mean {mean}");
            assert!((var - 1.0).abs() < 0.023, "{dtype}: var {var}");
            // About 68.3% within one sd (binomial sd 0.0015).
            let inside = v.iter().filter(|x| x.abs() < 1.0).count() as f64 / n as f64;
            assert!((inside - 0.6827).abs() < 0.0075, "{dtype}: {inside}");
        }
    }
}
