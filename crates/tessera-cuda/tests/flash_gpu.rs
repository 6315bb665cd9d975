//! Flash attention through the Rust launcher on a real GPU, against an f64 reference
//! computed here on the CPU from the same (dtype-rounded) inputs. Skips, saying why,
//! where there is no CUDA driver or no GPU.
//!
//! Tolerances (relative Frobenius error against f64): f32 1e-4, f16 5e-3, bf16 2e-2
//! (P and dS are rounded to the input type before the tensor-core products).

use cudarc::driver::sys::CUdevice_attribute;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr};
use std::sync::Arc;
use tessera_cuda::flash::{
    backward_plan, backward_split, backward_workspace_bytes, flash_backward, flash_forward,
    flash_forward_variant, forward_workspace_bytes, select, BwdPtrs, FlashDType, FlashDims,
    FwdPtrs, Queue, WgFwd,
};

/// One context for the whole test process: the flash launcher keeps the
/// modules it loads for the process, and a context dropped between two
/// tests releases the primary context and those modules with it (the next
/// test's launches then fail with CUDA_ERROR_INVALID_HANDLE).
fn gpu() -> Option<(Arc<CudaContext>, Arc<CudaStream>)> {
    static CONTEXT: std::sync::OnceLock<Option<Arc<CudaContext>>> = std::sync::OnceLock::new();
    let ctx = CONTEXT
        .get_or_init(|| {
            // SAFETY: only tries to open the library.
            if !unsafe { cudarc::driver::sys::is_culib_present() } {
                println!("skipped: no CUDA driver library");
                return None;
            }
            match CudaContext::new(0) {
                Ok(ctx) => Some(ctx),
                Err(e) => {
                    println!("skipped: no GPU ({e:?})");
                    None
                }
            }
        })
        .clone()?;
    let stream = ctx.default_stream();
    Some((ctx, stream))
}

/// Deterministic standard-normal-ish values (sum of uniforms), different per seed.
fn randn(n: usize, seed: u64) -> Vec<f64> {
    let mut s = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
    let mut u = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 11) as f64 / (1u64 << 53) as f64
    };
    (0..n)
        .map(|_| (0..4).map(|_| u()).sum::<f64>() * 1.732 - 3.464)
        .collect()
}

fn bf16_bits(x: f64) -> u16 {
    let b = (x as f32).to_bits();
    ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16 // round to nearest even
}
fn bf16_val(h: u16) -> f64 {
    f32::from_bits((h as u32) << 16) as f64
}
fn f16_bits(x: f64) -> u16 {
    // Normal-range conversion with round to nearest even (inputs here are |x| < 8).
    let f = x as f32;
    let b = f.to_bits();
    let sign = ((b >> 16) & 0x8000) as u16;
    let a = f.abs();
    if a < 6.103_515_6e-5 {
        return sign | (a / 5.960_464_5e-8).round() as u16; // subnormal
    }
    let exp = ((b >> 23) & 0xff) as i32 - 127 + 15;
    let man = b & 0x7f_ffff;
    let mut h = ((exp as u32) << 10) | (man >> 13);
    let rest = man & 0x1fff;
    if rest > 0x1000 || (rest == 0x1000 && (h & 1) == 1) {
        h += 1;
    }
    sign | h as u16
}
fn f16_val(h: u16) -> f64 {
    let sign = if h & 0x8000 != 0 { -1.0 } else { 1.0 };
    let exp = ((h >> 10) & 0x1f) as i32;
    let man = (h & 0x3ff) as f64;
    match exp {
        0 => sign * man * 2f64.powi(-24),
        31 => f64::NAN,
        _ => sign * (1.0 + man / 1024.0) * 2f64.powi(exp - 15),
    }
}

/// A device buffer of `dtype` holding `vals` rounded to it; returns the rounded values.
enum Buf {
    Half(CudaSlice<u16>),
    Single(CudaSlice<f32>),
}

impl Buf {
    fn upload(stream: &Arc<CudaStream>, dtype: FlashDType, vals: &[f64]) -> (Buf, Vec<f64>) {
        match dtype {
            FlashDType::F32 => {
                let v: Vec<f32> = vals.iter().map(|&x| x as f32).collect();
                let r = v.iter().map(|&x| x as f64).collect();
                (Buf::Single(stream.clone_htod(&v).unwrap()), r)
            }
            FlashDType::BF16 | FlashDType::F16 => {
                let bf = dtype == FlashDType::BF16;
                let to: fn(f64) -> u16 = if bf { bf16_bits } else { f16_bits };
                let from: fn(u16) -> f64 = if bf { bf16_val } else { f16_val };
                let v: Vec<u16> = vals.iter().map(|&x| to(x)).collect();
                let r = v.iter().map(|&h| from(h)).collect();
                (Buf::Half(stream.clone_htod(&v).unwrap()), r)
            }
        }
    }

    /// A buffer poisoned with NaN, so that unwritten elements fail the comparison.
    fn poisoned(stream: &Arc<CudaStream>, dtype: FlashDType, n: usize) -> Buf {
        match dtype {
            FlashDType::F32 => Buf::Single(stream.clone_htod(&vec![f32::NAN; n]).unwrap()),
            _ => Buf::Half(stream.clone_htod(&vec![0xffffu16; n]).unwrap()),
        }
    }

    fn ptr(&self, stream: &Arc<CudaStream>) -> u64 {
        match self {
            Buf::Half(s) => s.device_ptr(stream).0,
            Buf::Single(s) => s.device_ptr(stream).0,
        }
    }

    fn download(&self, stream: &Arc<CudaStream>, dtype: FlashDType) -> Vec<f64> {
        match self {
            Buf::Single(s) => stream
                .clone_dtoh(s)
                .unwrap()
                .into_iter()
                .map(|x| x as f64)
                .collect(),
            Buf::Half(s) => {
                let from = if dtype == FlashDType::BF16 {
                    bf16_val
                } else {
                    f16_val
                };
                stream
                    .clone_dtoh(s)
                    .unwrap()
                    .into_iter()
                    .map(from)
                    .collect()
            }
        }
    }
}

struct Reference {
    out: Vec<f64>,
    lse: Vec<f64>,
    dq: Vec<f64>,
    dk: Vec<f64>,
    dv: Vec<f64>,
}

/// Attention and its gradients in f64, PyTorch's top-left causal convention.
#[allow(clippy::too_many_arguments)]
fn reference(
    d: &FlashDims,
    q: &[f64],
    k: &[f64],
    v: &[f64],
    g: &[f64],
    causal: bool,
    scale: f64,
) -> Reference {
    let (nq, nk, hd) = (d.q_len, d.kv_len, d.head_dim);
    let bh = d.batch * d.heads;
    let mut r = Reference {
        out: vec![0.0; bh * nq * hd],
        lse: vec![0.0; bh * nq],
        dq: vec![0.0; bh * nq * hd],
        dk: vec![0.0; bh * nk * hd],
        dv: vec![0.0; bh * nk * hd],
    };
    for b in 0..bh {
        let (qo, ko) = (b * nq * hd, b * nk * hd);
        for i in 0..nq {
            let keys = if causal { (i + 1).min(nk) } else { nk };
            let s: Vec<f64> = (0..keys)
                .map(|j| {
                    (0..hd)
                        .map(|x| q[qo + i * hd + x] * k[ko + j * hd + x])
                        .sum::<f64>()
                        * scale
                })
                .collect();
            let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let l: f64 = s.iter().map(|x| (x - m).exp()).sum();
            r.lse[b * nq + i] = m + l.ln();
            let p: Vec<f64> = s.iter().map(|x| (x - m).exp() / l).collect();
            for x in 0..hd {
                r.out[qo + i * hd + x] = (0..keys).map(|j| p[j] * v[ko + j * hd + x]).sum();
            }
            let dp: Vec<f64> = (0..keys)
                .map(|j| {
                    (0..hd)
                        .map(|x| g[qo + i * hd + x] * v[ko + j * hd + x])
                        .sum()
                })
                .collect();
            let delta: f64 = (0..keys).map(|j| p[j] * dp[j]).sum();
            for j in 0..keys {
                let ds = p[j] * (dp[j] - delta) * scale;
                for x in 0..hd {
                    r.dq[qo + i * hd + x] += ds * k[ko + j * hd + x];
                    r.dk[ko + j * hd + x] += ds * q[qo + i * hd + x];
                    r.dv[ko + j * hd + x] += p[j] * g[qo + i * hd + x];
                }
            }
        }
    }
    r
}

fn rel(x: &[f64], r: &[f64]) -> f64 {
    if x.iter().any(|v| !v.is_finite()) {
        return f64::NAN;
    }
    let num: f64 = x.iter().zip(r).map(|(a, b)| (a - b) * (a - b)).sum();
    let den: f64 = r.iter().map(|b| b * b).sum();
    (num / den.max(1e-300)).sqrt()
}

fn check(
    stream: &Arc<CudaStream>,
    dtype: FlashDType,
    d: FlashDims,
    causal: bool,
    seed: u64,
    variant: Option<WgFwd>,
) -> Vec<String> {
    let scale = 1.0 / (d.head_dim as f64).sqrt();
    let (bh, nq, nk, hd) = (d.batch * d.heads, d.q_len, d.kv_len, d.head_dim);
    let (q, qv) = Buf::upload(stream, dtype, &randn(bh * nq * hd, seed));
    let (k, kv) = Buf::upload(stream, dtype, &randn(bh * nk * hd, seed + 1));
    let (v, vv) = Buf::upload(stream, dtype, &randn(bh * nk * hd, seed + 2));
    let (g, gv) = Buf::upload(stream, dtype, &randn(bh * nq * hd, seed + 3));
    let out = Buf::poisoned(stream, dtype, bh * nq * hd);
    let lse = Buf::poisoned(stream, FlashDType::F32, bh * nq);
    let (dq, dk, dv) = (
        Buf::poisoned(stream, dtype, bh * nq * hd),
        Buf::poisoned(stream, dtype, bh * nk * hd),
        Buf::poisoned(stream, dtype, bh * nk * hd),
    );
    let ctx = stream.context();
    let ws = Buf::poisoned(
        stream,
        FlashDType::F32,
        backward_workspace_bytes(ctx, dtype, &d).unwrap() / 4,
    );
    let fwd_ws = Buf::poisoned(
        stream,
        FlashDType::F32,
        forward_workspace_bytes(ctx, dtype, &d)
            .unwrap()
            .div_ceil(4)
            .max(1),
    );
    let p = |b: &Buf| b.ptr(stream);
    // SAFETY: every buffer above is live on this stream's context with the sizes the
    // launcher documents for `d`.
    unsafe {
        flash_forward_variant(
            Queue::from(stream),
            dtype,
            d,
            causal,
            scale as f32,
            FwdPtrs {
                q: p(&q),
                k: p(&k),
                v: p(&v),
                out: p(&out),
                lse: p(&lse),
                workspace: p(&fwd_ws),
            },
            variant,
        )
        .unwrap();
        flash_backward(
            Queue::from(stream),
            dtype,
            d,
            causal,
            scale as f32,
            BwdPtrs {
                q: p(&q),
                k: p(&k),
                v: p(&v),
                out: p(&out),
                d_out: p(&g),
                lse: p(&lse),
                dq: p(&dq),
                dk: p(&dk),
                dv: p(&dv),
                workspace: p(&ws),
            },
        )
        .unwrap();
    }
    stream.synchronize().unwrap();
    let r = reference(&d, &qv, &kv, &vv, &gv, causal, scale);
    let tol = match dtype {
        FlashDType::F32 => 1e-4,
        FlashDType::F16 => 5e-3,
        FlashDType::BF16 => 2e-2,
    };
    let errs = [
        ("out", rel(&out.download(stream, dtype), &r.out)),
        ("lse", rel(&lse.download(stream, FlashDType::F32), &r.lse)),
        ("dq", rel(&dq.download(stream, dtype), &r.dq)),
        ("dk", rel(&dk.download(stream, dtype), &r.dk)),
        ("dv", rel(&dv.download(stream, dtype), &r.dv)),
    ];
    println!("{dtype:?} {d:?} causal={causal} {variant:?}: {errs:?}");
    errs.iter()
        .filter(|(_, e)| e.is_nan() || *e > tol)
        .map(|(n, e)| {
            format!("{dtype:?} {d:?} causal={causal} {variant:?}: {n} error {e:.2e} > {tol:.0e}")
        })
        .collect()
}

// The cases are split over several tests so that a slow checker
// (compute-sanitizer's racecheck) can run them one at a time by name.

#[test]
fn flash_attention_matches_an_f64_reference_on_the_gpu() {
    let Some((_ctx, stream)) = gpu() else { return };
    let mut failures = Vec::new();
    let mut seed = 1;
    for dtype in [FlashDType::BF16, FlashDType::F16, FlashDType::F32] {
        let dims_list: &[usize] = if dtype == FlashDType::F32 {
            &[64, 96, 128]
        } else {
            &[64, 128]
        };
        for &head_dim in dims_list {
            for (batch, heads, q_len, kv_len) in
                [(2, 3, 77, 130), (1, 2, 150, 61), (1, 1, 300, 300)]
            {
                for causal in [false, true] {
                    let d = FlashDims {
                        batch,
                        heads,
                        q_len,
                        kv_len,
                        head_dim,
                    };
                    failures.extend(check(&stream, dtype, d, causal, seed, None));
                    seed += 10;
                }
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn wgmma_flash_attention_matches_an_f64_reference_split_and_whole() {
    let Some((_ctx, stream)) = gpu() else { return };
    let mut failures = Vec::new();
    let mut seed = 1001;
    // The wgmma kernels (Hopper, bf16/f16, head dim 128) both ways: every item split
    // (1 x 2 heads of 1000 x 700 leave an H100/H200 mostly idle) and whole; 400 heads of
    // 130 queries also run the backward in two groups (341 + 59: ACC_BUDGET).
    for dtype in [FlashDType::BF16, FlashDType::F16] {
        for (batch, heads, q_len, kv_len) in [(1, 2, 1000, 700), (4, 100, 130, 77)] {
            for causal in [false, true] {
                let d = FlashDims {
                    batch,
                    heads,
                    q_len,
                    kv_len,
                    head_dim: 128,
                };
                failures.extend(check(&stream, dtype, d, causal, seed, None));
                seed += 10;
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn wgmma_backward_splits_the_items_past_its_last_wave_and_runs_groups_on_two_lanes() {
    let Some((_ctx, stream)) = gpu() else { return };
    let mut failures = Vec::new();
    let mut seed = 2001;
    // The wgmma backward with the items past its last whole wave split by query tiles
    // (their dK/dV summed by each item's last block): sms / 4 + 1 heads of 4 key blocks
    // are a few items more than one wave on this GPU (132 SMs: 136 items, the last 4 in
    // 2 pieces each; causal: nothing split, checked too).
    let ctx = stream.context();
    let cc = ctx.compute_capability().unwrap();
    let sms = ctx
        .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .unwrap() as u32;
    if cc == (9, 0) {
        let d = FlashDims {
            batch: 1,
            heads: sms as usize / 4 + 1,
            q_len: 256,
            kv_len: 500,
            head_dim: 128,
        };
        let sel = select(FlashDType::BF16, 128, cc).unwrap();
        assert!(backward_split(&sel, &d, sms, false).split_items() > 0);
        for causal in [false, true] {
            failures.extend(check(&stream, FlashDType::BF16, d, causal, seed, None));
            seed += 10;
        }
    }
    // The backward's groups on two lanes (streams and workspaces) with the last group's
    // items past the last whole wave split: k x sms + 4 heads of 256 queries and one key
    // block, k the fewest that pass ACC_BUDGET (groups of 128 heads; on 132 SMs 268
    // heads, 128 + 128 + 12, the last 4 items in 2 pieces each).
    if cc == (9, 0) {
        let heads = (256 / sms as usize + 1) * sms as usize + 4;
        let d = FlashDims {
            batch: 1,
            heads,
            q_len: 256,
            kv_len: 100,
            head_dim: 128,
        };
        let sel = select(FlashDType::BF16, 128, cc).unwrap();
        let plan = backward_plan(&sel, &d, sms, false);
        assert_eq!(plan.lanes, 2);
        assert!(plan.groups.len() >= 3, "{plan:?}");
        assert!(
            plan.groups.last().unwrap().split.split_items() > 0,
            "{plan:?}"
        );
        for causal in [false, true] {
            failures.extend(check(&stream, FlashDType::BF16, d, causal, seed, None));
            seed += 10;
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn every_wgmma_forward_variant_matches_an_f64_reference() {
    let Some((_ctx, stream)) = gpu() else { return };
    let mut failures = Vec::new();
    let mut seed = 3001;
    // Every variant of the unsplit wgmma forward (what max-autotune chooses among):
    // 80 blocks of 256 queries over 9 key tiles go round the ring's 4 stages twice.
    for variant in WgFwd::ALL {
        for causal in [false, true] {
            let d = FlashDims {
                batch: 2,
                heads: 40,
                q_len: 130,
                kv_len: 530,
                head_dim: 128,
            };
            failures.extend(check(
                &stream,
                FlashDType::BF16,
                d,
                causal,
                seed,
                Some(variant),
            ));
            seed += 10;
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn unsupported_head_dim_is_an_error_before_any_launch() {
    let Some((_ctx, stream)) = gpu() else { return };
    let d = FlashDims {
        batch: 1,
        heads: 1,
        q_len: 4,
        kv_len: 4,
        head_dim: 80,
    };
    let ptrs = FwdPtrs {
        q: 0,
        k: 0,
        v: 0,
        out: 0,
        lse: 0,
        workspace: 0,
    };
    // SAFETY: the call fails in selection, before anything touches the (null) pointers.
    let e = unsafe { flash_forward(Queue::from(&stream), FlashDType::BF16, d, false, 1.0, ptrs) }
        .unwrap_err();
    assert!(e.to_string().contains("head dim 80 with bf16"), "{e}");
}
