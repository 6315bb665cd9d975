//! `Resize` (and `Upsample`, its older form) as one linear map per resized
//! axis: each output position is a weighted sum of input positions, the
//! weights computed when the model is imported exactly as ONNX's reference
//! computes them (coordinate transformation, nearest/linear/cubic
//! coefficients, antialiasing, excluded outside points, extrapolation),
//! then applied as a matrix product along the axis, in f64.

use tessera::ir::{BinaryOp as B, Dim, Literal, LiteralData, NodeId, Op};
use tessera::{DType, Result};

use super::one;
use crate::builder::{lit_floats, Ctx, Val};

struct Settings {
    mode: String,
    nearest_mode: String,
    transform: String,
    cubic_a: f64,
    exclude_outside: bool,
    extrapolation: f64,
    antialias: bool,
}

/// The interpolation coefficients at fractional position `ratio` for an
/// axis scaled by `scale`.
fn coeffs(s: &Settings, ratio: f64, scale: f64) -> Vec<f64> {
    match s.mode.as_str() {
        "nearest" => {
            if ratio.fract() == 0.0 {
                return vec![0.0, 1.0];
            }
            let (a, b) = match s.nearest_mode.as_str() {
                "round_prefer_ceil" => (ratio < 0.5, ratio >= 0.5),
                "floor" => (true, false),
                "ceil" => (false, true),
                _ => (ratio <= 0.5, ratio > 0.5),
            };
            vec![a as u8 as f64, b as u8 as f64]
        }
        "linear" if s.antialias => {
            let scale = scale.min(1.0);
            let start = (-1.0 / scale).floor() as i64 + 1;
            let footprint = 2 - 2 * start;
            let c: Vec<f64> = (start..start + footprint)
                .map(|i| (1.0 - ((i as f64 - ratio) * scale).abs()).clamp(0.0, 1.0))
                .collect();
            let sum: f64 = c.iter().sum();
            c.into_iter().map(|v| v / sum).collect()
        }
        "linear" => vec![1.0 - ratio, ratio],
        _ if s.antialias => {
            let a = s.cubic_a;
            let scale = scale.min(1.0);
            let coeff = |x: f64| {
                let x = x.abs();
                let (x2, x3) = (x * x, x * x * x);
                if x <= 1.0 {
                    (a + 2.0) * x3 - (a + 3.0) * x2 + 1.0
                } else if x < 2.0 {
                    a * x3 - 5.0 * a * x2 + 8.0 * a * x - 4.0 * a
                } else {
                    0.0
                }
            };
            let start = (-2.0 / scale).floor() as i64 + 1;
            let end = 2 - start;
            let c: Vec<f64> = (start..end)
                .map(|i| coeff(scale * (i as f64 - ratio)))
                .collect();
            let sum: f64 = c.iter().sum();
            c.into_iter().map(|v| v / sum).collect()
        }
        _ => {
            let a = s.cubic_a;
            let r = ratio;
            let q = 1.0 - r;
            vec![
                ((a * (r + 1.0) - 5.0 * a) * (r + 1.0) + 8.0 * a) * (r + 1.0) - 4.0 * a,
                ((a + 2.0) * r - (a + 3.0)) * r * r + 1.0,
                ((a + 2.0) * q - (a + 3.0)) * q * q + 1.0,
                ((a * (q + 1.0) - 5.0 * a) * (q + 1.0) + 8.0 * a) * (q + 1.0) - 4.0 * a,
            ]
        }
    }
}

/// Most elements one axis's weight matrix may have (a constant of the
/// graph, made at import): 2^24.
const MAX_WEIGHTS: usize = 1 << 24;

/// The `[out, in]` weights of one axis and the extrapolated output rows.
fn axis_weights(
    s: &Settings,
    input: usize,
    output: usize,
    scale: f64,
    roi: Option<(f64, f64)>,
) -> (Vec<f64>, Vec<bool>) {
    let out_w = scale * input as f64;
    let mut w = vec![0.0; output * input];
    let mut extrapolated = vec![false; output];
    for (j, ext) in extrapolated.iter_mut().enumerate() {
        let y = j as f64;
        let x = match s.transform.as_str() {
            "align_corners" => {
                if out_w == 1.0 {
                    0.0
                } else {
                    y * (input as f64 - 1.0) / (out_w - 1.0)
                }
            }
            "asymmetric" => y / scale,
            "tf_crop_and_resize" => {
                let (r0, r1) = roi.unwrap_or((0.0, 1.0));
                let x = if out_w == 1.0 {
                    (r1 - r0) * (input as f64 - 1.0) / 2.0
                } else {
                    y * (r1 - r0) * (input as f64 - 1.0) / (out_w - 1.0)
                } + r0 * (input as f64 - 1.0);
                *ext = x < 0.0 || x > input as f64 - 1.0;
                x
            }
            "pytorch_half_pixel" => {
                if out_w == 1.0 {
                    -0.5
                } else {
                    (y + 0.5) / scale - 0.5
                }
            }
            "half_pixel_symmetric" => {
                let adjustment = output as f64 / out_w;
                let offset = input as f64 / 2.0 * (1.0 - adjustment);
                offset + (y + 0.5) / scale - 0.5
            }
            _ => (y + 0.5) / scale - 0.5,
        };
        let xi = x.floor();
        let ratio = if x == xi { 1.0 } else { x - xi };
        let mut c = coeffs(s, ratio, scale);
        let n = c.len() as i64;
        let pad = (n + 1) / 2;
        let xp = x + pad as f64;
        let p = xp.floor() as i64;
        let frac = xp - p as f64;
        let off = if n % 2 == 0 {
            if frac == 0.0 {
                -(n / 2)
            } else {
                -(n / 2) + 1
            }
        } else {
            let base = -((n - 1) / 2);
            if frac <= 0.5 {
                base
            } else {
                base + 1
            }
        };
        let idx: Vec<i64> = (0..n).map(|k| p + off + k - pad).collect();
        if s.exclude_outside {
            for (ci, &i) in c.iter_mut().zip(&idx) {
                if i < 0 || i >= input as i64 {
                    *ci = 0.0;
                }
            }
            let sum: f64 = c.iter().sum();
            let sum = if sum == 0.0 { 1.0 } else { sum };
            c.iter_mut().for_each(|v| *v /= sum);
        }
        if !*ext {
            for (ci, &i) in c.iter().zip(&idx) {
                let i = i.clamp(0, input as i64 - 1) as usize;
                w[j * input + i] += ci;
            }
        }
    }
    (w, extrapolated)
}

fn resize_with(
    c: &mut Ctx,
    x: NodeId,
    s: Settings,
    scales: Option<Vec<f64>>,
    sizes: Option<Vec<i64>>,
    roi: Option<Vec<f64>>,
    axes: Option<Vec<i64>>,
) -> Result<Vec<Val>> {
    let d = c.concrete(x, "Resize")?;
    let r = d.len();
    let axes: Vec<usize> = match axes {
        Some(a) => a.iter().map(|&v| c.axis(v, r)).collect::<Result<_>>()?,
        None => (0..r).collect(),
    };
    let mut scale = vec![1.0; r];
    let mut out: Vec<usize> = d.clone();
    let mut rois: Vec<Option<(f64, f64)>> = vec![None; r];
    if let Some(roi) = roi.filter(|v| !v.is_empty()) {
        let n = axes.len();
        if roi.len() != 2 * n {
            return Err(c.bad(format!("roi {roi:?} for {n} axes")));
        }
        for (k, &a) in axes.iter().enumerate() {
            rois[a] = Some((roi[k], roi[n + k]));
        }
    }
    match (scales, sizes) {
        (_, Some(sz)) => {
            if sz.len() != axes.len() {
                return Err(c.bad(format!("sizes {sz:?} for {} axes", axes.len())));
            }
            for (k, &a) in axes.iter().enumerate() {
                out[a] = sz[k].max(0) as usize;
                scale[a] = out[a] as f64 / d[a] as f64;
            }
            let policy = c.attr_s("keep_aspect_ratio_policy", "stretch");
            if policy != "stretch" {
                let picked = axes.iter().map(|&a| scale[a]);
                let s = if policy == "not_larger" {
                    picked.fold(f64::INFINITY, f64::min)
                } else {
                    picked.fold(f64::NEG_INFINITY, f64::max)
                };
                for &a in &axes {
                    scale[a] = s;
                    out[a] = (s * d[a] as f64 + 0.5) as usize;
                }
            }
        }
        (Some(sc), None) => {
            if sc.len() != axes.len() {
                return Err(c.bad(format!("scales {sc:?} for {} axes", axes.len())));
            }
            for (k, &a) in axes.iter().enumerate() {
                scale[a] = sc[k];
                out[a] = (sc[k] * d[a] as f64) as usize;
            }
        }
        (None, None) => return Err(c.bad("neither scales nor sizes")),
    }
    let dtype = c.dtype(x);
    let mut y = c.cast(x, DType::F64)?;
    for &a in &axes {
        let identity = (scale[a] - 1.0).abs() < 1e-9
            && out[a] == d[a]
            && rois[a].is_none_or(|(r0, r1)| r0.abs() < 1e-9 && (r1 - 1.0).abs() < 1e-9);
        if identity {
            continue;
        }
        let weights = out[a].checked_mul(d[a]).filter(|&n| n <= MAX_WEIGHTS);
        if weights.is_none() {
            return Err(c.unsupported(format!(
                "resizing dim {a} from {} to {}: its [out, in] weights, computed at import, \
                 would exceed {MAX_WEIGHTS} elements",
                d[a], out[a]
            )));
        }
        let (w, ext) = axis_weights(&s, d[a], out[a], scale[a], rois[a]);
        // y (…, in, …) → move the axis last, multiply by Wᵀ [in, out].
        let mut perm: Vec<usize> = (0..r).filter(|&i| i != a).collect();
        perm.push(a);
        let moved = c.permute(y, perm.clone())?;
        let mut wt = vec![0.0; d[a] * out[a]];
        for j in 0..out[a] {
            for i in 0..d[a] {
                wt[i * out[a] + j] = w[j * d[a] + i];
            }
        }
        let wn = c.constant(Literal {
            dtype: DType::F64,
            shape: vec![d[a], out[a]],
            data: LiteralData::Float(wt),
        })?;
        let mut p = c.add(Op::MatMul, &[moved, wn])?;
        if ext.iter().any(|&e| e) {
            let m = c.constant(Literal {
                dtype: DType::Bool,
                shape: vec![out[a]],
                data: LiteralData::Bool(ext),
            })?;
            let v = c.scalar(s.extrapolation, DType::F64)?;
            p = c.where_(m, v, p)?;
        }
        let mut back = vec![0; r];
        for (i, &pi) in perm.iter().enumerate() {
            back[pi] = i;
        }
        y = c.permute(p, back)?;
        y = c.add(Op::Contiguous, &[y])?;
    }
    if !dtype.is_float() {
        // Integer outputs round to nearest, as a saturating cast of the
        // reference's f64 result would (its values are exact here).
        let h = c.binary_c(B::Add, y, 0.5)?;
        let i = c.cast(h, DType::I64)?;
        return one(c.cast(i, dtype)?);
    }
    let _ = Dim::Const(0);
    one(c.cast(y, dtype)?)
}

fn floats_input(c: &mut Ctx, i: usize, what: &str) -> Result<Option<Vec<f64>>> {
    if !c.has_input(i) {
        return Ok(None);
    }
    let id = c.x(i)?;
    if c.dims(id).contains(&Dim::Const(0)) {
        return Ok(None);
    }
    Ok(Some(lit_floats(&c.literal_of(i, what)?)))
}

pub(super) fn resize(c: &mut Ctx) -> Result<Vec<Val>> {
    let x = c.x(0)?;
    let legacy = c.opset < 11;
    let s = Settings {
        mode: c.attr_s("mode", "nearest"),
        nearest_mode: if legacy {
            "floor".into()
        } else {
            c.attr_s("nearest_mode", "round_prefer_floor")
        },
        transform: if legacy {
            "asymmetric".into()
        } else {
            c.attr_s("coordinate_transformation_mode", "half_pixel")
        },
        cubic_a: c.attr_f("cubic_coeff_a", -0.75),
        exclude_outside: c.attr_i("exclude_outside", 0) != 0,
        extrapolation: c.attr_f("extrapolation_value", 0.0),
        antialias: c.attr_i("antialias", 0) != 0,
    };
    let (roi, scales, sizes) = if legacy {
        (None, floats_input(c, 1, "scales")?, None)
    } else {
        let roi = floats_input(c, 1, "roi")?;
        let scales = floats_input(c, 2, "scales")?;
        let sizes = if c.has_input(3) {
            Some(c.ints(3, "sizes")?)
        } else {
            None
        };
        (roi, scales, sizes)
    };
    let axes = c.attr_ints("axes");
    resize_with(c, x, s, scales, sizes, roi, axes)
}

pub(super) fn upsample(c: &mut Ctx) -> Result<Vec<Val>> {
    let x = c.x(0)?;
    let scales = if c.opset >= 9 {
        floats_input(c, 1, "scales")?
    } else {
        c.attr("scales")
            .map(|a| a.floats.iter().map(|&v| v as f64).collect())
    };
    let s = Settings {
        mode: c.attr_s("mode", "nearest"),
        nearest_mode: "floor".into(),
        transform: "asymmetric".into(),
        cubic_a: -0.75,
        exclude_outside: false,
        extrapolation: 0.0,
        antialias: false,
    };
    resize_with(c, x, s, scales, None, None, None)
}
