//! f32 transcendentals the compiler can vectorise (libm's are calls per
//! element): exp, tanh and erfc within a few ulp, shared by the elementwise,
//! softmax and flash attention kernels.
//!
//! The exponential is written once: the scalar [`exp_f32`] and
//! [`exp_nonpositive_f32`], and the explicit vector forms of the latter
//! ([`avx2::exp_nonpositive`], [`avx512::exp_nonpositive`]) that flash
//! attention's SIMD kernels and the AVX-512 tanh/sigmoid inline; all of
//! them give the scalar's bits (tested).

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

/// Above this e^x overflows to inf; below [`EXP2_UNDER`] it rounds to 0.
const EXP2_OVER: f32 = 88.722_84;
const EXP2_UNDER: f32 = -103.972_08;

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
    if x > EXP2_OVER {
        f32::INFINITY
    } else if x < EXP2_UNDER {
        0.0
    } else {
        y
    }
}

/// Where [`exp_nonpositive_f32`] clamps its argument: e^-150 is below half
/// the smallest subnormal, so the scaling rounds it (and anything less) to 0.
pub(crate) const NONPOSITIVE_EXP_MIN: f32 = -150.0;

/// e^x for x <= 0 (or NaN): what softmax needs after subtracting the max.
/// The same reduction and polynomial as [`exp_f32`] (equal bits down to
/// -103.97), without its range branches: nothing overflows, and with x
/// clamped at -150 the scaling itself rounds results below half the
/// smallest subnormal to 0 (e^-inf too). Right for small positive x as
/// well (up to 88.7, where e^x is still finite): a softmax's `s - max`
/// may round a little above 0.
#[inline(always)]
pub(crate) fn exp_nonpositive_f32(x: f32) -> f32 {
    // `<` rather than `max`, so NaN stays NaN.
    let x = if x < NONPOSITIVE_EXP_MIN {
        NONPOSITIVE_EXP_MIN
    } else {
        x
    };
    let k = x.mul_add(std::f32::consts::LOG2_E, SHIFT);
    let n = k - SHIFT;
    let r = (-n).mul_add(LN2_HI, x);
    exp_reduced(k, (-n).mul_add(LN2_LO, r))
}

/// The polynomial P of Cephes' expf, e^r ≈ 1 + r + r²·P(r) for |r| <= ln2/2,
/// highest power first (shared with the AVX-512 kernels below).
const EXP_POLY: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_5e-1,
    0.5,
];

/// e^r for the reduced argument r (|r| <= ln2/2): 1 + r + r²·P(r).
#[inline(always)]
fn exp_poly(r: f32) -> f32 {
    let q = EXP_POLY[1..]
        .iter()
        .fold(EXP_POLY[0], |q, &c| q.mul_add(r, c));
    q.mul_add(r * r, r) + 1.0
}

/// e^r · 2^n for the reduced argument r (|r| <= ln2/2), with n held in the
/// low mantissa bits of k = n + SHIFT: Cephes' expf polynomial, then the
/// scaling by 2^n in two steps (the first exact) so that subnormal results
/// round once, to the nearest p·2^n (what AVX-512's `vscalefps` computes).
#[inline(always)]
fn exp_reduced(k: f32, r: f32) -> f32 {
    let p = exp_poly(r);
    let ni = (k.to_bits() as i32).wrapping_sub(0x4B40_0000);
    let (n1, n2) = (ni >> 1, ni.wrapping_sub(ni >> 1));
    let pow2 = |e: i32| f32::from_bits((e.wrapping_add(127) as u32) << 23);
    p * pow2(n1) * pow2(n2)
}

/// Where tanh's e^{-2|x|} clamps its argument: below it tanh rounds to ±1
/// either way, and above it the result is a normal float, so one exact
/// scaling by 2^n gives the bits of [`exp_nonpositive_f32`].
const TANH_EXP_MIN: f32 = -20.0;

/// e^y for y <= 0 (or NaN), y clamped at [`TANH_EXP_MIN`].
#[inline(always)]
fn exp_tanh(y: f32) -> f32 {
    // `<` rather than `max`, so NaN stays NaN.
    let y = if y < TANH_EXP_MIN { TANH_EXP_MIN } else { y };
    let k = y.mul_add(std::f32::consts::LOG2_E, SHIFT);
    let n = k - SHIFT;
    let r = (-n).mul_add(LN2_HI, y);
    let p = exp_poly((-n).mul_add(LN2_LO, r));
    // k's bits are 0x4B40_0000 + n; shifted by 23 the constant part leaves
    // the word, and n lands in the exponent field.
    p * f32::from_bits((k.to_bits() << 23).wrapping_add(127 << 23))
}

/// Cephes' tanhf odd polynomial: tanh x ≈ x + x³·Q(x²) for |x| < 0.625,
/// highest power first.
const TANH_POLY: [f32; 5] = [
    -5.704_988_7e-3,
    2.063_909e-2,
    -5.373_971_6e-2,
    1.333_144_2e-1,
    -3.333_328e-1,
];
/// Below this |x| tanh takes the polynomial, above it the exponential.
const TANH_SMALL: f32 = 0.625;

/// tanh: Cephes' tanhf odd polynomial below 0.625, else `1 - 2f·(1/(1 + f))`
/// (one fused multiply-add) with f = e^{-2|x|} and x's sign. Both sides are
/// computed and one selected, which keeps loops vectorisable; the
/// reciprocal is a correctly rounded division, which the AVX-512 kernel
/// reproduces without the (slow) vector divider.
#[inline(always)]
pub(crate) fn tanh_f32(x: f32) -> f32 {
    let a = x.abs();
    let s = x * x;
    let q = TANH_POLY[1..]
        .iter()
        .fold(TANH_POLY[0], |q, &c| q.mul_add(s, c));
    let small = (s * x).mul_add(q, x);
    let f = exp_tanh(-2.0 * a);
    let big = (-(f + f)).mul_add(1.0 / (1.0 + f), 1.0).copysign(x);
    if a < TANH_SMALL {
        small
    } else {
        big
    }
}

/// Applies tanh or sigmoid to a block with the explicit AVX-512 kernels
/// where the CPU has them; false (nothing written) otherwise. The results
/// are the bits of [`tanh_f32`] and of the sigmoid of `elementwise`
/// (`1 / (1 + e)` for v >= 0, `e · (1 / (1 + e))` below, with e = e^-|v|
/// from [`exp_nonpositive_f32`]): the kernels perform
/// the same IEEE operations, except two that AVX-512 does faster with the
/// same result (tested): the 2^n scaling by `vscalefps` and the correctly
/// rounded reciprocal of a value in [1, 2] by `vrcp14ps` and Newton steps
/// (one division per element alone took ~0.2 ns per element in an in-L1
/// microbenchmark here, against ~0.3 ns for the whole sigmoid).
pub(crate) fn unary_simd_f32(op: crate::ir::UnaryOp, src: &[f32], dst: &mut [f32]) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use crate::ir::UnaryOp;
        assert_eq!(src.len(), dst.len(), "unary block lengths");
        if !has_avx512() {
            return false;
        }
        // SAFETY: the CPU has AVX-512 F/VL/BW/DQ; the slices have equal lengths.
        match op {
            UnaryOp::Tanh => unsafe { avx512::map::<avx512::Tanh>(src, dst) },
            UnaryOp::Sigmoid => unsafe { avx512::map::<avx512::Sigmoid>(src, dst) },
            UnaryOp::Gelu => unsafe { avx512::map::<avx512::Gelu>(src, dst) },
            _ => return false,
        }
        true
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (op, src, dst);
        false
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    //! The AVX2 form of [`super::exp_nonpositive_f32`], 8 lanes at a time,
    //! operation for operation the scalar one (flash attention's AVX2
    //! kernels inline it).

    use super::*;
    use std::arch::x86_64::*;

    #[inline(always)]
    unsafe fn splat(c: f32) -> __m256 {
        _mm256_set1_ps(c)
    }

    /// [`super::exp_poly`]: 1 + r + r²·P(r).
    #[inline(always)]
    unsafe fn exp_poly(r: __m256) -> __m256 {
        let mut q = splat(EXP_POLY[0]);
        for &c in &EXP_POLY[1..] {
            q = _mm256_fmadd_ps(q, r, splat(c));
        }
        _mm256_add_ps(_mm256_fmadd_ps(q, _mm256_mul_ps(r, r), r), splat(1.0))
    }

    /// 2^e for an exponent `e` of a normal float, per lane.
    #[inline(always)]
    unsafe fn pow2(e: __m256i) -> __m256 {
        _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(
            e,
            _mm256_set1_epi32(127),
        )))
    }

    /// e^y for y <= 0 (or a little above, see the scalar one) clamped at
    /// `lo` (NaN stays NaN): [`super::exp_nonpositive_f32`]'s reduction,
    /// polynomial and two-step scaling (the first step exact), so subnormal
    /// results round once and every lane has the scalar's bits.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA (the caller is compiled with them, so that
    /// this inlines).
    #[inline(always)]
    pub(crate) unsafe fn exp_nonpositive(y: __m256, lo: f32) -> __m256 {
        // vmaxps returns its second operand when either is NaN.
        let y = _mm256_max_ps(splat(lo), y);
        let k = _mm256_fmadd_ps(y, splat(std::f32::consts::LOG2_E), splat(SHIFT));
        let n = _mm256_sub_ps(k, splat(SHIFT));
        let r = _mm256_fnmadd_ps(n, splat(LN2_HI), y);
        let p = exp_poly(_mm256_fnmadd_ps(n, splat(LN2_LO), r));
        // n is k's low mantissa bits: k's bits minus those of SHIFT.
        let ni = _mm256_sub_epi32(_mm256_castps_si256(k), _mm256_set1_epi32(0x4B40_0000));
        let n1 = _mm256_srai_epi32::<1>(ni);
        let n2 = _mm256_sub_epi32(ni, n1);
        _mm256_mul_ps(_mm256_mul_ps(p, pow2(n1)), pow2(n2))
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512 {
    //! The AVX-512 forms of [`super::exp_nonpositive_f32`], of
    //! [`super::tanh_f32`] and of `elementwise`'s sigmoid, 16 lanes at a
    //! time, operation for operation the scalar ones.

    use super::*;
    use std::arch::x86_64::*;

    /// A lane-wise f32 function on 16 lanes.
    pub(super) trait Lanes {
        /// # Safety
        /// The CPU has AVX-512 F/VL/BW/DQ.
        unsafe fn apply(x: __m512) -> __m512;
    }

    pub(super) struct Tanh;
    pub(super) struct Sigmoid;
    pub(super) struct Gelu;

    /// `dst[i] = F(src[i])`: four vectors per iteration (independent
    /// dependency chains for the core to overlap), the tail masked.
    ///
    /// # Safety
    /// The CPU has AVX-512 F/VL/BW/DQ; `src.len() == dst.len()`.
    #[target_feature(enable = "avx512f,avx512vl,avx512bw,avx512dq")]
    pub(super) unsafe fn map<F: Lanes>(src: &[f32], dst: &mut [f32]) {
        let n = src.len();
        let (s, d) = (src.as_ptr(), dst.as_mut_ptr());
        let mut i = 0;
        while i + 64 <= n {
            let x0 = F::apply(_mm512_loadu_ps(s.add(i)));
            let x1 = F::apply(_mm512_loadu_ps(s.add(i + 16)));
            let x2 = F::apply(_mm512_loadu_ps(s.add(i + 32)));
            let x3 = F::apply(_mm512_loadu_ps(s.add(i + 48)));
            _mm512_storeu_ps(d.add(i), x0);
            _mm512_storeu_ps(d.add(i + 16), x1);
            _mm512_storeu_ps(d.add(i + 32), x2);
            _mm512_storeu_ps(d.add(i + 48), x3);
            i += 64;
        }
        while i < n {
            let m: __mmask16 = if n - i >= 16 {
                0xffff
            } else {
                (1u16 << (n - i)) - 1
            };
            let v = F::apply(_mm512_maskz_loadu_ps(m, s.add(i)));
            _mm512_mask_storeu_ps(d.add(i), m, v);
            i += 16;
        }
    }

    #[inline(always)]
    unsafe fn splat(c: f32) -> __m512 {
        _mm512_set1_ps(c)
    }

    /// `y` where `y >= lo` or NaN, else `lo` (the scalar `if y < lo`).
    #[inline(always)]
    unsafe fn clamp_below(y: __m512, lo: f32) -> __m512 {
        // vmaxps returns its second operand when either is NaN.
        _mm512_max_ps(splat(lo), y)
    }

    /// [`super::exp_poly`]: 1 + r + r²·P(r).
    #[inline(always)]
    unsafe fn exp_poly(r: __m512) -> __m512 {
        let mut q = splat(EXP_POLY[0]);
        for &c in &EXP_POLY[1..] {
            q = _mm512_fmadd_ps(q, r, splat(c));
        }
        _mm512_add_ps(_mm512_fmadd_ps(q, _mm512_mul_ps(r, r), r), splat(1.0))
    }

    /// e^y for y <= 0 (or a little above, see the scalar one) clamped at
    /// `lo` (NaN stays NaN): the reduction of the scalar code, then p·2^n
    /// rounded once by `vscalefps`, which is what the scalar two-step
    /// scaling (and, for normal results, the one-step one) gives. Uses
    /// AVX-512 F only, so it inlines into callers built for just that
    /// (flash attention's kernels).
    ///
    /// # Safety
    /// The CPU has AVX-512 F (the caller is compiled with it).
    #[inline(always)]
    pub(crate) unsafe fn exp_nonpositive(y: __m512, lo: f32) -> __m512 {
        let y = clamp_below(y, lo);
        let k = _mm512_fmadd_ps(y, splat(std::f32::consts::LOG2_E), splat(SHIFT));
        let n = _mm512_sub_ps(k, splat(SHIFT));
        let r = _mm512_fnmadd_ps(n, splat(LN2_HI), y);
        let r = _mm512_fnmadd_ps(n, splat(LN2_LO), r);
        _mm512_scalef_ps(exp_poly(r), n)
    }

    /// 1 / d correctly rounded, for d in [1, 2] (or NaN): `vrcp14ps`
    /// (relative error below 2^-14), a Newton step to within an ulp, and
    /// Markstein's final step y + y·(1 - d·y), whose fused evaluation rounds
    /// to the nearest (checked against division for every d). The Newton
    /// step is biased up by 2^-26 (relative, more than its own error of
    /// ~2^-28): from below, the final step meets an exact tie at
    /// d = 2 - 2^-23 (y = 1/2, the theorem's all-ones exception) and rounds
    /// it to even, under the true 1/d; from above it does not.
    #[inline(always)]
    pub(super) unsafe fn recip_1_2(d: __m512) -> __m512 {
        const BIAS: f32 = 1.0 / (1u32 << 26) as f32;
        let one = splat(1.0);
        let y = _mm512_rcp14_ps(d);
        let e = _mm512_add_ps(_mm512_fnmadd_ps(d, y, one), splat(BIAS));
        let y = _mm512_fmadd_ps(y, e, y);
        _mm512_fmadd_ps(y, _mm512_fnmadd_ps(d, y, one), y)
    }

    impl Lanes for Tanh {
        #[inline(always)]
        unsafe fn apply(x: __m512) -> __m512 {
            let a = _mm512_abs_ps(x);
            let s = _mm512_mul_ps(x, x);
            let mut q = splat(TANH_POLY[0]);
            for &c in &TANH_POLY[1..] {
                q = _mm512_fmadd_ps(q, s, splat(c));
            }
            let small = _mm512_fmadd_ps(_mm512_mul_ps(s, x), q, x);
            let f = exp_nonpositive(_mm512_mul_ps(splat(-2.0), a), TANH_EXP_MIN);
            let r = recip_1_2(_mm512_add_ps(splat(1.0), f));
            // -(f + f)·r + 1, then x's sign (a bit select: the sign bit
            // from x, the others from big).
            let big = _mm512_fnmadd_ps(_mm512_add_ps(f, f), r, splat(1.0));
            let big = _mm512_castsi512_ps(_mm512_ternarylogic_epi32::<0xCA>(
                _mm512_set1_epi32(i32::MIN),
                _mm512_castps_si512(x),
                _mm512_castps_si512(big),
            ));
            // Where a < 0.625 (false for NaN, as in the scalar code): small.
            let m = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(a, splat(TANH_SMALL));
            _mm512_mask_blend_ps(m, big, small)
        }
    }

    /// [`super::exp2_f32`]: e^(hi + lo), its range branches included; the
    /// two-step scaling is `vscalefps` (one rounding, as for
    /// [`exp_nonpositive`]).
    #[inline(always)]
    unsafe fn exp2(hi: __m512, lo: __m512) -> __m512 {
        let x = _mm512_add_ps(hi, lo);
        // clamp(x, -104, 89) with NaN kept: vminps/vmaxps return their
        // second operand when either is NaN.
        let c = _mm512_max_ps(splat(-104.0), _mm512_min_ps(splat(89.0), x));
        let k = _mm512_fmadd_ps(c, splat(std::f32::consts::LOG2_E), splat(SHIFT));
        let n = _mm512_sub_ps(k, splat(SHIFT));
        let r = _mm512_add_ps(_mm512_fnmadd_ps(n, splat(LN2_HI), hi), lo);
        let y = _mm512_scalef_ps(exp_poly(_mm512_fnmadd_ps(n, splat(LN2_LO), r)), n);
        let over = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(x, splat(EXP2_OVER));
        let under = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, splat(EXP2_UNDER));
        let y = _mm512_mask_blend_ps(over, y, splat(f32::INFINITY));
        _mm512_mask_blend_ps(under, y, _mm512_setzero_ps())
    }

    /// [`super::erfc_f32`], operation for operation: its polynomial's
    /// separate products and sums, the division, the split square.
    #[inline(always)]
    unsafe fn erfc(x: __m512) -> __m512 {
        let z = _mm512_abs_ps(x);
        let t = _mm512_div_ps(
            splat(1.0),
            _mm512_add_ps(splat(1.0), _mm512_mul_ps(splat(0.5), z)),
        );
        let mut p = splat(ERFC_POLY[ERFC_POLY.len() - 1]);
        for &c in ERFC_POLY[..ERFC_POLY.len() - 1].iter().rev() {
            p = _mm512_add_ps(splat(c), _mm512_mul_ps(t, p));
        }
        let zh = _mm512_castsi512_ps(_mm512_and_si512(
            _mm512_castps_si512(z),
            _mm512_set1_epi32(0xffff_f000u32 as i32),
        ));
        let hi = _mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), zh), zh);
        let lo = _mm512_add_ps(_mm512_mul_ps(_mm512_sub_ps(zh, z), _mm512_add_ps(zh, z)), p);
        let e = _mm512_mul_ps(t, exp2(hi, lo));
        // Where x >= 0 (false for NaN, as in the scalar code): e.
        let m = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(x, _mm512_setzero_ps());
        _mm512_mask_blend_ps(m, _mm512_sub_ps(splat(2.0), e), e)
    }

    impl Lanes for Gelu {
        /// `elementwise`'s gelu: v · 0.5 · erfc(-(v / √2)).
        #[inline(always)]
        unsafe fn apply(v: __m512) -> __m512 {
            let scaled = _mm512_mul_ps(v, splat(std::f64::consts::FRAC_1_SQRT_2 as f32));
            let negated = _mm512_xor_ps(scaled, splat(-0.0));
            _mm512_mul_ps(_mm512_mul_ps(v, splat(0.5)), erfc(negated))
        }
    }

    impl Lanes for Sigmoid {
        #[inline(always)]
        unsafe fn apply(v: __m512) -> __m512 {
            // -|v|: v with its sign bit set.
            let e = exp_nonpositive(_mm512_or_ps(v, splat(-0.0)), NONPOSITIVE_EXP_MIN);
            let s = recip_1_2(_mm512_add_ps(splat(1.0), e));
            // Where v >= 0 (false for NaN, as in the scalar code): s.
            let m = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(v, _mm512_setzero_ps());
            _mm512_mask_blend_ps(m, _mm512_mul_ps(e, s), s)
        }
    }
}

/// The Chebyshev coefficients of [`erfc_f32`]'s exponent, lowest first.
const ERFC_POLY: [f32; 10] = [
    -1.265_512_2,
    1.000_023_7,
    0.374_091_96,
    0.096_784_18,
    -0.186_288_06,
    0.278_868_07,
    -1.135_204,
    1.488_515_9,
    -0.822_152_2,
    0.170_872_77,
];

/// erfc: the Chebyshev fit of Numerical Recipes (`erfcc`, fractional error
/// below 1.2e-7 for all x), `t·e^{-z² + P(t)}` with t = 1/(1 + z/2), z = |x|;
/// `2 - erfc(z)` for x < 0.
#[inline(always)]
pub(crate) fn erfc_f32(x: f32) -> f32 {
    let z = x.abs();
    let t = 1.0 / (1.0 + 0.5 * z);
    // Horner from the highest coefficient, each step a product then a sum
    // (two roundings: the AVX-512 form repeats them).
    let last = ERFC_POLY.len() - 1;
    let p = ERFC_POLY[..last]
        .iter()
        .rev()
        .fold(ERFC_POLY[last], |p, &c| c + t * p);
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

    /// The logistic function in f64, without overflow.
    fn sigmoid64(x: f64) -> f64 {
        if x >= 0.0 {
            1.0 / (1.0 + (-x).exp())
        } else {
            x.exp() / (1.0 + x.exp())
        }
    }

    /// `elementwise`'s gelu for f32, as written there.
    fn gelu(v: f32) -> f32 {
        v * 0.5 * erfc_f32(-(v * std::f64::consts::FRAC_1_SQRT_2 as f32))
    }

    fn sigmoid(x: f32) -> f32 {
        super::super::elementwise::sigmoid(x)
    }

    #[test]
    fn tanh_and_sigmoid_are_accurate_over_the_whole_range() {
        for (lo, hi) in [(-10.0, 10.0), (-0.7, 0.7), (0.6, 0.65), (-1e-3, 1e-3)] {
            let ulps = worst_ulps(lo, hi, 200_000, tanh_f32, f64::tanh);
            assert!(ulps < 2.0, "tanh on [{lo}, {hi}]: {ulps} ulp");
        }
        // Down to -87.3 the results are normal floats; below, subnormal
        // ones, where the error is absolute (relative to the smallest
        // normal): the rounding to a subnormal step is all that is left.
        for (lo, hi) in [(-20.0, 20.0), (-87.3, -20.0), (-104.0, -87.3)] {
            let ulps = worst_ulps(lo, hi, 200_000, sigmoid, sigmoid64);
            assert!(ulps < 2.0, "sigmoid on [{lo}, {hi}]: {ulps} ulp");
        }
        let (inf, nan) = (f32::INFINITY, f32::NAN);
        assert_eq!((tanh_f32(inf), tanh_f32(-inf)), (1.0, -1.0));
        assert_eq!((tanh_f32(1e30), tanh_f32(-9.5)), (1.0, -1.0));
        assert_eq!((sigmoid(inf), sigmoid(-inf)), (1.0, 0.0));
        assert_eq!((sigmoid(200.0), sigmoid(-200.0)), (1.0, 0.0));
        assert!(tanh_f32(nan).is_nan() && sigmoid(nan).is_nan());
        // e^-100 / (1 + e^-100) = 3.720075976020836e-44: a subnormal, to
        // half a step.
        let sub = sigmoid(-100.0) as f64;
        assert!((sub - 3.720075976020836e-44).abs() <= 0.5 * 1.401298464324817e-45);
    }

    /// `f32::to_bits`, with every NaN the same (kernels may differ in which
    /// NaN they give, never in whether).
    fn bits(x: f32) -> u32 {
        if x.is_nan() {
            f32::NAN.to_bits()
        } else {
            x.to_bits()
        }
    }

    /// Inputs that cover every f32 class: a stride through all bit patterns
    /// (both signs, subnormals, infinities, NaNs), a dense sweep over where
    /// tanh and sigmoid change form (|x| < 110), and the edges themselves.
    fn all_kinds_of_f32() -> Vec<f32> {
        let mut xs: Vec<f32> = (0..=u32::MAX / 1021)
            .map(|i| f32::from_bits(i * 1021))
            .collect();
        xs.extend((0..=400_000).map(|i| -110.0 + 220.0 * i as f32 / 400_000.0));
        xs.extend([
            0.0,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::MIN_POSITIVE,
            -f32::MIN_POSITIVE,
            1e-45,
            -1e-45,
            f32::MAX,
            f32::MIN,
            0.625,
            -0.625,
            10.0,
            -10.0,
            -87.33655,
            -103.97208,
            -150.0,
            -150.1,
        ]);
        xs
    }

    #[test]
    fn the_avx512_kernels_give_the_scalar_bits() {
        let xs = all_kinds_of_f32();
        // Odd lengths and offsets: the masked tail and every lane position.
        for (op, f) in [
            (crate::ir::UnaryOp::Tanh, tanh_f32 as fn(f32) -> f32),
            (crate::ir::UnaryOp::Sigmoid, sigmoid),
            (crate::ir::UnaryOp::Gelu, gelu),
        ] {
            for skip in [0, 5] {
                let src = &xs[skip..];
                let mut dst = vec![0.0f32; src.len()];
                if !unary_simd_f32(op, src, &mut dst) {
                    assert!(!has_avx512(), "no kernel on an AVX-512 CPU");
                    eprintln!("no AVX-512 here: the kernels are not exercised");
                    return;
                }
                for (&x, &y) in src.iter().zip(&dst) {
                    assert_eq!(bits(y), bits(f(x)), "{op:?}({x:e}): {y:e} vs {:e}", f(x));
                }
            }
        }
        // Other ops have no kernel: nothing written.
        let mut dst = [7.0f32; 3];
        assert!(!unary_simd_f32(
            crate::ir::UnaryOp::Exp,
            &[1.0; 3],
            &mut dst
        ));
        assert_eq!(dst, [7.0; 3]);
    }

    /// `exp_nonpositive` of each of `xs`, clamped at `lo`, by every vector
    /// form this CPU runs, with its name.
    fn vector_exps(xs: &[f32], lo: f32) -> Vec<(&'static str, Vec<f32>)> {
        #[allow(unused_mut)]
        let mut out = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::*;
            /// # Safety
            /// The CPU has AVX2 and FMA.
            #[target_feature(enable = "avx2,fma")]
            unsafe fn by_avx2(xs: &[f32], lo: f32) -> Vec<f32> {
                let mut out = xs.to_vec();
                out.resize(xs.len().next_multiple_of(8), 0.0);
                let mut i = 0;
                while i < out.len() {
                    let p = out.as_mut_ptr().add(i);
                    _mm256_storeu_ps(p, avx2::exp_nonpositive(_mm256_loadu_ps(p), lo));
                    i += 8;
                }
                out.truncate(xs.len());
                out
            }
            /// # Safety
            /// The CPU has AVX-512 F (and only that is enabled: flash
            /// attention's kernels are built so).
            #[target_feature(enable = "avx512f")]
            unsafe fn by_avx512(xs: &[f32], lo: f32) -> Vec<f32> {
                let mut out = xs.to_vec();
                out.resize(xs.len().next_multiple_of(16), 0.0);
                let mut i = 0;
                while i < out.len() {
                    let p = out.as_mut_ptr().add(i);
                    _mm512_storeu_ps(p, avx512::exp_nonpositive(_mm512_loadu_ps(p), lo));
                    i += 16;
                }
                out.truncate(xs.len());
                out
            }
            if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                // SAFETY: the CPU has AVX2 and FMA.
                out.push(("avx2", unsafe { by_avx2(xs, lo) }));
            }
            if std::is_x86_feature_detected!("avx512f") {
                // SAFETY: the CPU has AVX-512 F.
                out.push(("avx512", unsafe { by_avx512(xs, lo) }));
            }
        }
        if out.is_empty() {
            eprintln!("no AVX2 or AVX-512 here: the vector exps are not exercised");
        }
        out
    }

    #[test]
    fn the_vector_exps_give_the_scalar_bits() {
        // Every kind of f32 up to 88 (above, e^x overflows: the scalar
        // wraps the exponent, vscalefps saturates; no caller gets there).
        let xs: Vec<f32> = all_kinds_of_f32()
            .into_iter()
            .filter(|x| x.is_nan() || *x <= 88.0)
            .collect();
        for lo in [NONPOSITIVE_EXP_MIN, TANH_EXP_MIN] {
            let clamped = |x: f32| exp_nonpositive_f32(if x < lo { lo } else { x });
            for (isa, got) in vector_exps(&xs, lo) {
                for (&x, &y) in xs.iter().zip(&got) {
                    let want = clamped(x);
                    assert_eq!(
                        bits(y),
                        bits(want),
                        "{isa} exp({x:e}) at {lo}: {y:e} vs {want:e}"
                    );
                }
            }
        }
    }

    #[test]
    fn the_vector_exps_are_accurate_over_the_softmax_range() {
        // Against f64 exp over what softmax and flash attention ask
        // (arguments <= ~0, a little above by rounding): within 2 ulp down
        // to the smallest normal result, then to half a subnormal step; 0
        // for -inf and far below; NaN stays NaN.
        let xs: Vec<f32> = (0..=200_000)
            .map(|i| -87.3 + 90.0 * i as f32 / 200_000.0)
            .collect();
        let edges = [
            -87.4f32,
            -100.0,
            -103.9,
            -1e30,
            f32::NEG_INFINITY,
            f32::NAN,
            0.0,
        ];
        let subnormal_step = 1.401298464324817e-45;
        let scalar = (
            "scalar",
            xs.iter()
                .chain(&edges)
                .map(|&x| exp_nonpositive_f32(x))
                .collect(),
        );
        let all: Vec<f32> = xs.iter().chain(&edges).copied().collect();
        for (isa, got) in std::iter::once(scalar).chain(vector_exps(&all, NONPOSITIVE_EXP_MIN)) {
            for (&x, &y) in xs.iter().zip(&got) {
                let want = (x as f64).exp();
                let ulps = (y as f64 - want).abs() / want / f32::EPSILON as f64;
                assert!(
                    ulps < 2.0,
                    "{isa}: exp({x}) = {y}, want {want} ({ulps:.1} ulp)"
                );
            }
            let edge = &got[xs.len()..];
            for (&x, &y) in edges[..3].iter().zip(edge) {
                let want = (x as f64).exp();
                assert!(
                    y > 0.0 && (y as f64 - want).abs() <= 0.5 * subnormal_step,
                    "{isa}: exp({x}) = {y:e}, want {want:e}"
                );
            }
            assert_eq!(&edge[3..5], &[0.0, 0.0], "{isa}");
            assert!(edge[5].is_nan() && edge[6] == 1.0, "{isa}: {edge:?}");
        }
    }

    #[test]
    fn the_avx512_reciprocal_is_the_division_for_every_value_in_1_to_2() {
        #[cfg(target_arch = "x86_64")]
        {
            if !has_avx512() {
                eprintln!("no AVX-512 here: the reciprocal is not exercised");
                return;
            }
            /// # Safety
            /// The CPU has AVX-512 F.
            #[target_feature(enable = "avx512f,avx512vl,avx512bw,avx512dq")]
            unsafe fn recip16(d: &[f32; 16]) -> [f32; 16] {
                use std::arch::x86_64::*;
                let mut out = [0.0f32; 16];
                let r = avx512::recip_1_2(_mm512_loadu_ps(d.as_ptr()));
                _mm512_storeu_ps(out.as_mut_ptr(), r);
                out
            }
            // Every f32 in [1, 2]: 2^23 + 1 values, 16 at a time.
            let (one, two) = (1.0f32.to_bits(), 2.0f32.to_bits());
            for base in (one..=two).step_by(16) {
                let d: [f32; 16] =
                    std::array::from_fn(|i| f32::from_bits((base + i as u32).min(two)));
                // SAFETY: the CPU has AVX-512 (checked above).
                let r = unsafe { recip16(&d) };
                for (&d, &r) in d.iter().zip(&r) {
                    assert_eq!(r.to_bits(), (1.0 / d).to_bits(), "1/{d:e}: {r:e}");
                }
            }
        }
    }
}
