//! f32 transcendentals the compiler can vectorise (libm's are calls per
//! element): exp, tanh and erfc within a few ulp, shared by the elementwise
//! and softmax kernels.

/// Whether this CPU has AVX-512 (F, VL, BW, DQ): hot loops are then also
/// compiled for it and chosen at run time. The results are the same bits
/// (the same IEEE operations, only more lanes at once).
#[inline]
pub(crate) fn has_avx512() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx512f")
            && std::is_x86_feature_detected!("avx512vl")
            && std::is_x86_feature_detected!("avx512bw")
            && std::is_x86_feature_detected!("avx512dq")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Defines `$name`, which runs `$body` (an `#[inline(always)]` generic
/// function) compiled for AVX-512 when the CPU has it, else as built.
/// The body must be inlined for the wide build to apply, hence the macro.
macro_rules! avx512_dispatch {
    ($(#[$m:meta])* $vis:vis fn $name:ident<$A:ident: $bound:path>($($arg:ident: $ty:ty),*) $(-> $ret:ty)? => $body:path) => {
        $(#[$m])*
        $vis fn $name<$A: $bound>($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512vl,avx512bw,avx512dq")]
                unsafe fn wide<$A: $bound>($($arg: $ty),*) $(-> $ret)? {
                    $body($($arg),*)
                }
                if $crate::runtime::cpu::fastmath::has_avx512() {
                    // SAFETY: the CPU has the features `wide` is built for.
                    return unsafe { wide($($arg),*) };
                }
            }
            $body($($arg),*)
        }
    };
}
pub(crate) use avx512_dispatch;

/// e^x: Cody-Waite reduction x = n·ln2 + r (|r| <= ln2/2), Cephes' expf
/// polynomial for e^r, then scaling by 2^n in two steps so that subnormal
/// results round once. NaN propagates; overflow gives inf, underflow 0.
#[inline(always)]
pub(crate) fn exp_f32(x: f32) -> f32 {
    exp2_f32(x, 0.0)
}

// Adding 1.5·2^23 rounds to an integer, which lands in the low mantissa bits.
const SHIFT: f32 = 12_582_912.0;
const LN2_HI: f32 = 0.693_359_4; // = 355/512: n·LN2_HI is exact
const LN2_LO: f32 = -2.121_944_4e-4;

/// e^(hi + lo) for a `hi` that is exact and a small `lo`, without rounding
/// their sum: the reduction subtracts n·ln2 from `hi` first.
#[inline(always)]
fn exp2_f32(hi: f32, lo: f32) -> f32 {
    let x = hi + lo;
    // Fused multiply-adds (x86-64-v3 has FMA): fewer instructions and one
    // rounding per step. `mul_add` is exact by definition, so every build
    // and vector width gives the same bits.
    let k = x
        .clamp(-104.0, 89.0)
        .mul_add(std::f32::consts::LOG2_E, SHIFT);
    let n = k - SHIFT;
    let r = (-n).mul_add(LN2_HI, hi) + lo;
    let y = exp_reduced(k, (-n).mul_add(LN2_LO, r));
    if x > 88.722_84 {
        f32::INFINITY
    } else if x < -103.972_08 {
        0.0
    } else {
        y
    }
}

/// e^x for x <= 0 (or NaN): what softmax needs after subtracting the max.
/// The same reduction and polynomial as [`exp_f32`] (equal bits down to
/// -103.97), without its range branches: nothing overflows, and with x
/// clamped at -150 the scaling itself rounds results below half the
/// smallest subnormal to 0 (e^-inf too).
#[inline(always)]
pub(crate) fn exp_nonpositive_f32(x: f32) -> f32 {
    // `<` rather than `max`, so NaN stays NaN.
    let x = if x < -150.0 { -150.0 } else { x };
    let k = x.mul_add(std::f32::consts::LOG2_E, SHIFT);
    let n = k - SHIFT;
    let r = (-n).mul_add(LN2_HI, x);
    exp_reduced(k, (-n).mul_add(LN2_LO, r))
}

/// e^r · 2^n for the reduced argument r (|r| <= ln2/2), with n held in the
/// low mantissa bits of k = n + SHIFT: Cephes' expf polynomial, then the
/// scaling by 2^n in two steps (the first exact) so that subnormal results
/// round once.
#[inline(always)]
fn exp_reduced(k: f32, r: f32) -> f32 {
    let q = 1.987_569_1e-4f32
        .mul_add(r, 1.398_199_9e-3)
        .mul_add(r, 8.333_452e-3)
        .mul_add(r, 4.166_579_6e-2)
        .mul_add(r, 1.666_666_5e-1)
        .mul_add(r, 0.5);
    let p = q.mul_add(r * r, r) + 1.0;
    let ni = (k.to_bits() as i32).wrapping_sub(0x4B40_0000);
    let (n1, n2) = (ni >> 1, ni.wrapping_sub(ni >> 1));
    let pow2 = |e: i32| f32::from_bits((e.wrapping_add(127) as u32) << 23);
    p * pow2(n1) * pow2(n2)
}

/// tanh: Cephes' tanhf odd polynomial below 0.625, else
/// `1 - 2f / (1 + f)` with f = e^{-2|x|} and x's sign (an exp of a
/// non-positive argument needs no overflow branch).
#[inline(always)]
pub(crate) fn tanh_f32(x: f32) -> f32 {
    let a = x.abs();
    let s = x * x;
    let small =
        ((((-5.704_988_7e-3 * s + 2.063_909e-2) * s - 5.373_971_6e-2) * s + 1.333_144_2e-1) * s
            - 3.333_328e-1)
            * s
            * x
            + x;
    let f = exp_nonpositive_f32(-2.0 * a);
    let big = (1.0 - 2.0 * f / (1.0 + f)).copysign(x);
    if a < 0.625 {
        small
    } else {
        big
    }
}

/// erfc: the Chebyshev fit of Numerical Recipes (`erfcc`, fractional error
/// below 1.2e-7 for all x), `t·e^{-z² + P(t)}` with t = 1/(1 + z/2), z = |x|;
/// `2 - erfc(z)` for x < 0.
#[inline(always)]
pub(crate) fn erfc_f32(x: f32) -> f32 {
    let z = x.abs();
    let t = 1.0 / (1.0 + 0.5 * z);
    let p = -1.265_512_2
        + t * (1.000_023_7
            + t * (0.374_091_96
                + t * (0.096_784_18
                    + t * (-0.186_288_06
                        + t * (0.278_868_07
                            + t * (-1.135_204
                                + t * (1.488_515_9 + t * (-0.822_152_2 + t * 0.170_872_77))))))));
    // -z² rounded to f32 would cost |z²|·2^-24 of relative accuracy (64 ulp
    // at z = 9); zh (z's top 12 bits) squares exactly and (zh - z)(zh + z)
    // is small, as in musl's erfcf.
    let zh = f32::from_bits(z.to_bits() & 0xffff_f000);
    let e = t * exp2_f32(-zh * zh, (zh - z) * (zh + z) + p);
    if x >= 0.0 {
        e
    } else {
        2.0 - e
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The largest error of `f` against the f64 reference over `n` points
    /// of [lo, hi], in units of the f32 epsilon relative to the reference
    /// (absolute below the smallest normal f32, where precision ends).
    fn worst_ulps(lo: f64, hi: f64, n: usize, f: fn(f32) -> f32, reference: fn(f64) -> f64) -> f64 {
        (0..=n)
            .map(|i| {
                let x = (lo + (hi - lo) * i as f64 / n as f64) as f32;
                let (got, want) = (f(x) as f64, reference(x as f64));
                (got - want).abs() / want.abs().max(f32::MIN_POSITIVE as f64) / f32::EPSILON as f64
            })
            .fold(0.0, f64::max)
    }

    #[test]
    fn f32_transcendentals_are_accurate() {
        // References: std's f64 exp/tanh and libm's f64 erfc.
        let exp = worst_ulps(-87.0, 88.7, 200_000, exp_f32, f64::exp);
        assert!(exp < 2.0, "exp: {exp} ulp");
        let tanh = worst_ulps(-10.0, 10.0, 200_000, tanh_f32, f64::tanh);
        assert!(tanh < 2.0, "tanh: {tanh} ulp");
        let tanh_small = worst_ulps(-1e-3, 1e-3, 10_000, tanh_f32, f64::tanh);
        assert!(tanh_small < 2.0, "tanh near 0: {tanh_small} ulp");
        let erfc = worst_ulps(-6.0, 9.0, 200_000, erfc_f32, libm::erfc);
        // Numerical Recipes bounds the fit at 1.2e-7 (2 ulp); f32 evaluation adds ~2.
        assert!(erfc < 5.0, "erfc: {erfc} ulp");
        // Limits: overflow, underflow through the subnormals, NaN.
        assert_eq!(exp_f32(88.8), f32::INFINITY);
        assert_eq!(exp_f32(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp_f32(-104.0), 0.0);
        assert_eq!(exp_f32(f32::NEG_INFINITY), 0.0);
        // e^-100 = 3.720075976020836e-44 (Python) is 26.5 subnormal steps.
        let sub = exp_f32(-100.0) as f64;
        assert!(
            (sub - 3.720075976020836e-44).abs() <= 0.5 * 1.401298464324817e-45,
            "{sub}"
        );
        assert!(
            exp_f32(f32::NAN).is_nan()
                && tanh_f32(f32::NAN).is_nan()
                && erfc_f32(f32::NAN).is_nan()
        );
        assert_eq!((tanh_f32(50.0), tanh_f32(-50.0)), (1.0, -1.0));
        assert_eq!((erfc_f32(-20.0), erfc_f32(20.0)), (2.0, 0.0));
    }

    #[test]
    fn the_nonpositive_exp_is_exp_where_both_apply_and_exact_at_the_ends() {
        for i in 0..=400_000 {
            let x = -103.97 * i as f32 / 400_000.0;
            assert_eq!(
                exp_nonpositive_f32(x).to_bits(),
                exp_f32(x).to_bits(),
                "{x}"
            );
        }
        // Below: e^x rounded to the nearest subnormal step, 0 beyond half a step.
        for x in [
            -103.5f32,
            -103.8,
            -104.0,
            -110.0,
            -150.0,
            -1e4,
            f32::NEG_INFINITY,
        ] {
            let (got, want) = (exp_nonpositive_f32(x) as f64, (x as f64).exp());
            assert!(
                (got - want).abs() <= 0.5 * 1.401298464324817e-45,
                "{x}: {got}"
            );
        }
        assert_eq!(exp_nonpositive_f32(f32::NEG_INFINITY), 0.0);
        assert!(exp_nonpositive_f32(f32::NAN).is_nan());
        let ulps = worst_ulps(-87.0, 0.0, 200_000, exp_nonpositive_f32, f64::exp);
        assert!(ulps < 2.0, "{ulps} ulp");
    }
}
