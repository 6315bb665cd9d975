//! Direct (one thread per output element, grid-stride) kernels of the
//! convolution and pooling ops (`tessera::ir::custom::conv`), NCHW,
//! contiguous operands, any float dtype (computed in f32, f64 for f64).
//!
//! - the convolution: each output sums its window over its group's input
//!   channels, adds the bias and applies the ReLU epilogue;
//! - its input gradient gathers, for each input element, the outputs
//!   whose windows hold it (no atomics); its weight gradient sums, for each
//!   weight, over the batch and the output positions;
//! - pooling: max with the flat index of the maximum (a NaN wins, the first
//!   on ties, as the CPU), average with PyTorch's divisor rules; their
//!   gradients gather from the outputs whose windows hold each input.
//!
//! These are the correct baseline, not tuned kernels: no shared-memory
//! tiling, no tensor cores. The fast path is cuDNN (`crate::cudnn`); these
//! kernels run what it cannot (f64, uneven padding, no libcudnn) and when
//! `TESSERA_CUDA_CONV=direct` asks for them. [`conv2d_epilogue`] applies
//! the bias and activation to a cuDNN convolution's output in place.

use tessera::ir::custom::conv::{Activation, Conv2d, Pool2d};
use tessera::DType;

use super::{c_type, convert, grid_for, load, prelude, Compute, Launch, Words, ENTRY};

const BLOCK: u32 = 256;

/// One convolution's sizes and operands' dtype.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ConvShape {
    pub dtype: DType,
    /// Input `[n, c, h, w]`.
    pub input: [usize; 4],
    /// Weight `[o, c/groups, kh, kw]`.
    pub weight: [usize; 4],
    /// Output `[ho, wo]`.
    pub out_hw: [usize; 2],
    pub conv: Conv2d,
}

impl ConvShape {
    fn fields(&self, args: &mut Words) {
        let [n, c, h, w] = self.input;
        let [o, _, kh, kw] = self.weight;
        let [ho, wo] = self.out_hw;
        let cv = &self.conv;
        args.ints(
            [
                n,
                c,
                h,
                w,
                o,
                kh,
                kw,
                ho,
                wo,
                cv.groups,
                cv.stride[0],
                cv.stride[1],
                cv.padding[0],
                cv.padding[2],
                cv.dilation[0],
                cv.dilation[1],
            ]
            .map(|v| v as i64),
        );
    }
}

const CONV_FIELDS: &str = "long long n, c, h, w, o, kh, kw, ho, wo, g, sh, sw, pt, pl, dh, dw;";

/// The grid-stride loop over `total` (a C expression) items `i`.
fn grid_loop(total: &str, body: &str) -> String {
    format!(
        "extern \"C\" __global__ void {ENTRY}(Args a) {{\n\
         long long total_ = {total};\n\
         for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total_; i += (long long)gridDim.x * blockDim.x) {{\n\
         {body}}}\n}}\n"
    )
}

fn launch(source: String, args: Words, total: usize, sms: u32) -> Launch {
    Launch {
        source,
        args,
        grid: grid_for(total, BLOCK, sms),
        block: BLOCK,
    }
}

/// `y = conv(x, w) (+ b) (ReLU)`.
pub fn conv2d_forward(s: &ConvShape, x: u64, w: u64, b: Option<u64>, y: u64, sms: u32) -> Launch {
    let d = s.dtype;
    let cm = Compute::of(d);
    let acc = cm.c_type();
    let bias = match b {
        Some(_) => format!("acc += {};\n", load(d, cm, "a.b", "oc")),
        None => String::new(),
    };
    let relu = match s.conv.activation {
        Activation::Relu => "if (acc < 0) acc = 0;\n",
        Activation::None => "",
    };
    let body = format!(
        "long long ow = i % a.wo, t = i / a.wo; long long oh = t % a.ho; t /= a.ho; long long oc = t % a.o, n = t / a.o;\n\
         long long cg = a.c / a.g, og = a.o / a.g, g = oc / og;\n\
         {acc} acc = 0;\n\
         for (long long ci = 0; ci < cg; ci++) {{\n\
         long long xc = (n * a.c + g * cg + ci) * a.h;\n\
         for (long long ki = 0; ki < a.kh; ki++) {{\n\
         long long ih = oh * a.sh + ki * a.dh - a.pt; if (ih < 0 || ih >= a.h) continue;\n\
         for (long long kj = 0; kj < a.kw; kj++) {{\n\
         long long iw = ow * a.sw + kj * a.dw - a.pl; if (iw < 0 || iw >= a.w) continue;\n\
         acc += {xv} * {wv};\n\
         }}}}}}\n\
         {bias}{relu}\
         (({ct}*)a.y)[i] = {store};\n",
        xv = load(d, cm, "a.x", "(xc + ih) * a.w + iw"),
        wv = load(d, cm, "a.wt", "((oc * cg + ci) * a.kh + ki) * a.kw + kj"),
        ct = c_type(d),
        store = convert(d, cm, "acc"),
    );
    let mut source = prelude(&[d]);
    source.push_str(&format!(
        "struct Args {{ {CONV_FIELDS} const void* x; const void* wt; const void* b; void* y; }};\n"
    ));
    source.push_str(&grid_loop("a.n * a.o * a.ho * a.wo", &body));
    let mut args = Words::default();
    s.fields(&mut args);
    args.ptr(x).ptr(w).ptr(b.unwrap_or(0)).ptr(y);
    let total = s.input[0] * s.weight[0] * s.out_hw[0] * s.out_hw[1];
    launch(source, args, total, sms)
}

/// `y = act(y + b)` in place over an NCHW output `[n, o, hw]`: the bias
/// (per channel) and the activation a cuDNN convolution leaves out — one
/// pass over `y`, as PyTorch's cuDNN path adds its bias.
pub fn conv2d_epilogue(
    dtype: DType,
    sizes: [usize; 3],
    b: Option<u64>,
    activation: Activation,
    y: u64,
    sms: u32,
) -> Launch {
    let d = dtype;
    let cm = Compute::of(d);
    let acc = cm.c_type();
    let bias = match b {
        Some(_) => format!("v += {};\n", load(d, cm, "a.b", "(i / a.hw) % a.o")),
        None => String::new(),
    };
    let relu = match activation {
        Activation::Relu => "if (v < 0) v = 0;\n",
        Activation::None => "",
    };
    let body = format!(
        "{acc} v = {yv};\n{bias}{relu}(({ct}*)a.y)[i] = {store};\n",
        yv = load(d, cm, "a.y", "i"),
        ct = c_type(d),
        store = convert(d, cm, "v"),
    );
    let mut source = prelude(&[d]);
    source.push_str("struct Args { long long n, o, hw; const void* b; void* y; };\n");
    source.push_str(&grid_loop("a.n * a.o * a.hw", &body));
    let mut args = Words::default();
    args.ints(sizes.map(|v| v as i64));
    args.ptr(b.unwrap_or(0)).ptr(y);
    launch(source, args, sizes.iter().product(), sms)
}

/// `dx` from `dy` and `w` (also `conv_transpose2d`'s forward).
pub fn conv2d_backward_input(s: &ConvShape, dy: u64, w: u64, dx: u64, sms: u32) -> Launch {
    let d = s.dtype;
    let cm = Compute::of(d);
    let acc = cm.c_type();
    let body = format!(
        "long long iw = i % a.w, t = i / a.w; long long ih = t % a.h; t /= a.h; long long c = t % a.c, n = t / a.c;\n\
         long long cg = a.c / a.g, og = a.o / a.g, g = c / cg, ci = c % cg;\n\
         {acc} acc = 0;\n\
         for (long long oc = g * og; oc < (g + 1) * og; oc++) {{\n\
         for (long long ki = 0; ki < a.kh; ki++) {{\n\
         long long th = ih + a.pt - ki * a.dh; if (th < 0 || th % a.sh != 0) continue; long long oh = th / a.sh; if (oh >= a.ho) continue;\n\
         for (long long kj = 0; kj < a.kw; kj++) {{\n\
         long long tw = iw + a.pl - kj * a.dw; if (tw < 0 || tw % a.sw != 0) continue; long long ow = tw / a.sw; if (ow >= a.wo) continue;\n\
         acc += {dyv} * {wv};\n\
         }}}}}}\n\
         (({ct}*)a.dx)[i] = {store};\n",
        dyv = load(d, cm, "a.dy", "((n * a.o + oc) * a.ho + oh) * a.wo + ow"),
        wv = load(d, cm, "a.wt", "((oc * cg + ci) * a.kh + ki) * a.kw + kj"),
        ct = c_type(d),
        store = convert(d, cm, "acc"),
    );
    let mut source = prelude(&[d]);
    source.push_str(&format!(
        "struct Args {{ {CONV_FIELDS} const void* dy; const void* wt; void* dx; }};\n"
    ));
    source.push_str(&grid_loop("a.n * a.c * a.h * a.w", &body));
    let mut args = Words::default();
    s.fields(&mut args);
    args.ptr(dy).ptr(w).ptr(dx);
    launch(source, args, s.input.iter().product(), sms)
}

/// `dw` from `x` and `dy`.
pub fn conv2d_backward_weight(s: &ConvShape, x: u64, dy: u64, dw: u64, sms: u32) -> Launch {
    let d = s.dtype;
    let cm = Compute::of(d);
    let acc = cm.c_type();
    let body = format!(
        "long long kj = i % a.kw, t = i / a.kw; long long ki = t % a.kh; t /= a.kh; long long cg = a.c / a.g; long long ci = t % cg, oc = t / cg;\n\
         long long og = a.o / a.g, g = oc / og;\n\
         {acc} acc = 0;\n\
         for (long long n = 0; n < a.n; n++) {{\n\
         long long xc = (n * a.c + g * cg + ci) * a.h;\n\
         for (long long oh = 0; oh < a.ho; oh++) {{\n\
         long long ih = oh * a.sh + ki * a.dh - a.pt; if (ih < 0 || ih >= a.h) continue;\n\
         for (long long ow = 0; ow < a.wo; ow++) {{\n\
         long long iw = ow * a.sw + kj * a.dw - a.pl; if (iw < 0 || iw >= a.w) continue;\n\
         acc += {dyv} * {xv};\n\
         }}}}}}\n\
         (({ct}*)a.dw_)[i] = {store};\n",
        dyv = load(d, cm, "a.dy", "((n * a.o + oc) * a.ho + oh) * a.wo + ow"),
        xv = load(d, cm, "a.x", "(xc + ih) * a.w + iw"),
        ct = c_type(d),
        store = convert(d, cm, "acc"),
    );
    let mut source = prelude(&[d]);
    source.push_str(&format!(
        "struct Args {{ {CONV_FIELDS} const void* x; const void* dy; void* dw_; }};\n"
    ));
    source.push_str(&grid_loop("a.o * (a.c / a.g) * a.kh * a.kw", &body));
    let mut args = Words::default();
    s.fields(&mut args);
    args.ptr(x).ptr(dy).ptr(dw);
    launch(source, args, s.weight.iter().product(), sms)
}

/// One pooling's sizes: `planes` (n·c) of `h × w` → `ho × wo`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PoolShape {
    pub dtype: DType,
    pub planes: usize,
    pub hw: [usize; 2],
    pub out_hw: [usize; 2],
    pub pool: Pool2d,
}

const POOL_FIELDS: &str =
    "long long planes, h, w, ho, wo, kh, kw, sh, sw, ph, pw, dh, dw, include_pad, divisor;";

impl PoolShape {
    fn fields(&self, args: &mut Words) {
        let p = &self.pool;
        args.ints(
            [
                self.planes,
                self.hw[0],
                self.hw[1],
                self.out_hw[0],
                self.out_hw[1],
                p.kernel[0],
                p.kernel[1],
                p.stride[0],
                p.stride[1],
                p.padding[0],
                p.padding[1],
                p.dilation[0],
                p.dilation[1],
                usize::from(p.count_include_pad),
                p.divisor_override.unwrap_or(0),
            ]
            .map(|v| v as i64),
        );
    }

    fn outputs(&self) -> usize {
        self.planes * self.out_hw[0] * self.out_hw[1]
    }

    fn inputs(&self) -> usize {
        self.planes * self.hw[0] * self.hw[1]
    }
}

/// The range of outputs along one axis whose windows may hold input `i`
/// (`lo..=hi`, clipped to the output): C code defining `{v}0`, `{v}1`.
fn window_range(v: &str, i: &str, k: &str, s: &str, p: &str, d: &str, out: &str) -> String {
    format!(
        "long long {v}lo_ = {i} + a.{p} - (a.{k} - 1) * a.{d};\n\
         long long {v}0 = {v}lo_ <= 0 ? 0 : ({v}lo_ + a.{s} - 1) / a.{s};\n\
         long long {v}1 = ({i} + a.{p}) / a.{s}; if ({v}1 > a.{out} - 1) {v}1 = a.{out} - 1;\n"
    )
}

/// Max pooling: `y` and the flat index (i64) of each maximum.
pub fn max_pool2d_forward(s: &PoolShape, x: u64, y: u64, idx: u64, sms: u32) -> Launch {
    let d = s.dtype;
    let cm = Compute::of(d);
    let acc = cm.c_type();
    let body = format!(
        "long long ow = i % a.wo, t = i / a.wo; long long oh = t % a.ho, pl = t / a.ho;\n\
         {acc} best = -({acc})TS_INF; long long at = -1;\n\
         for (long long ki = 0; ki < a.kh; ki++) {{\n\
         long long ih = oh * a.sh - a.ph + ki * a.dh; if (ih < 0 || ih >= a.h) continue;\n\
         for (long long kj = 0; kj < a.kw; kj++) {{\n\
         long long iw = ow * a.sw - a.pw + kj * a.dw; if (iw < 0 || iw >= a.w) continue;\n\
         long long f = ih * a.w + iw; {acc} v = {xv};\n\
         if (at < 0 || v > best || (v != v && best == best)) {{ best = v; at = f; }}\n\
         }}}}\n\
         (({ct}*)a.y)[i] = {store}; ((long long*)a.idx)[i] = at;\n",
        xv = load(d, cm, "a.x", "pl * a.h * a.w + f"),
        ct = c_type(d),
        store = convert(d, cm, "best"),
    );
    let mut source = prelude(&[d]);
    source.push_str(&format!(
        "struct Args {{ {POOL_FIELDS} const void* x; void* y; void* idx; }};\n"
    ));
    source.push_str(&grid_loop("a.planes * a.ho * a.wo", &body));
    let mut args = Words::default();
    s.fields(&mut args);
    args.ptr(x).ptr(y).ptr(idx);
    launch(source, args, s.outputs(), sms)
}

/// Max pooling's gradient: each input sums the `dy` of the outputs whose
/// maximum it is.
pub fn max_pool2d_backward(s: &PoolShape, dy: u64, idx: u64, dx: u64, sms: u32) -> Launch {
    let d = s.dtype;
    let cm = Compute::of(d);
    let acc = cm.c_type();
    let body = format!(
        "long long iw = i % a.w, t = i / a.w; long long ih = t % a.h, pl = t / a.h; long long f = ih * a.w + iw;\n\
         {rows}{cols}\
         {acc} acc = 0;\n\
         for (long long oh = oh0; oh <= oh1; oh++) for (long long ow = ow0; ow <= ow1; ow++) {{\n\
         long long o = (pl * a.ho + oh) * a.wo + ow;\n\
         if (((const long long*)a.idx)[o] == f) acc += {dyv};\n\
         }}\n\
         (({ct}*)a.dx)[i] = {store};\n",
        rows = window_range("oh", "ih", "kh", "sh", "ph", "dh", "ho"),
        cols = window_range("ow", "iw", "kw", "sw", "pw", "dw", "wo"),
        dyv = load(d, cm, "a.dy", "o"),
        ct = c_type(d),
        store = convert(d, cm, "acc"),
    );
    let mut source = prelude(&[d]);
    source.push_str(&format!(
        "struct Args {{ {POOL_FIELDS} const void* dy; const void* idx; void* dx; }};\n"
    ));
    source.push_str(&grid_loop("a.planes * a.h * a.w", &body));
    let mut args = Words::default();
    s.fields(&mut args);
    args.ptr(dy).ptr(idx).ptr(dx);
    launch(source, args, s.inputs(), sms)
}

/// The divisor of output `(oh, ow)`, as `divisor_` (C code).
const AVG_DIVISOR: &str = "long long hs = oh * a.sh - a.ph, ws = ow * a.sw - a.pw;\n\
     long long he = hs + a.kh < a.h + a.ph ? hs + a.kh : a.h + a.ph, we = ws + a.kw < a.w + a.pw ? ws + a.kw : a.w + a.pw;\n\
     long long pool_ = (he - hs) * (we - ws);\n\
     long long hs0 = hs < 0 ? 0 : hs, ws0 = ws < 0 ? 0 : ws, he0 = he < a.h ? he : a.h, we0 = we < a.w ? we : a.w;\n\
     long long divisor_ = a.divisor > 0 ? a.divisor : (a.include_pad ? pool_ : (he0 - hs0) * (we0 - ws0));\n";

/// Average pooling.
pub fn avg_pool2d_forward(s: &PoolShape, x: u64, y: u64, sms: u32) -> Launch {
    let d = s.dtype;
    let cm = Compute::of(d);
    let acc = cm.c_type();
    let body = format!(
        "long long ow = i % a.wo, t = i / a.wo; long long oh = t % a.ho, pl = t / a.ho;\n\
         {AVG_DIVISOR}\
         {acc} acc = 0;\n\
         for (long long ih = hs0; ih < he0; ih++) for (long long iw = ws0; iw < we0; iw++) acc += {xv};\n\
         (({ct}*)a.y)[i] = {store};\n",
        xv = load(d, cm, "a.x", "(pl * a.h + ih) * a.w + iw"),
        ct = c_type(d),
        store = convert(d, cm, &format!("acc / ({acc})divisor_")),
    );
    let mut source = prelude(&[d]);
    source.push_str(&format!(
        "struct Args {{ {POOL_FIELDS} const void* x; void* y; }};\n"
    ));
    source.push_str(&grid_loop("a.planes * a.ho * a.wo", &body));
    let mut args = Words::default();
    s.fields(&mut args);
    args.ptr(x).ptr(y);
    launch(source, args, s.outputs(), sms)
}

/// Average pooling's gradient: each input sums `dy / divisor` of the
/// outputs whose windows hold it.
pub fn avg_pool2d_backward(s: &PoolShape, dy: u64, dx: u64, sms: u32) -> Launch {
    let d = s.dtype;
    let cm = Compute::of(d);
    let acc = cm.c_type();
    let body = format!(
        "long long iw = i % a.w, t = i / a.w; long long ih = t % a.h, pl = t / a.h;\n\
         {rows}{cols}\
         {acc} acc = 0;\n\
         for (long long oh = oh0; oh <= oh1; oh++) for (long long ow = ow0; ow <= ow1; ow++) {{\n\
         {AVG_DIVISOR}\
         acc += {dyv} / ({acc})divisor_;\n\
         }}\n\
         (({ct}*)a.dx)[i] = {store};\n",
        rows = window_range("oh", "ih", "kh", "sh", "ph", "dh", "ho"),
        cols = window_range("ow", "iw", "kw", "sw", "pw", "dw", "wo"),
        dyv = load(d, cm, "a.dy", "(pl * a.ho + oh) * a.wo + ow"),
        ct = c_type(d),
        store = convert(d, cm, "acc"),
    );
    let mut source = prelude(&[d]);
    source.push_str(&format!(
        "struct Args {{ {POOL_FIELDS} const void* dy; void* dx; }};\n"
    ));
    source.push_str(&grid_loop("a.planes * a.h * a.w", &body));
    let mut args = Words::default();
    s.fields(&mut args);
    args.ptr(dy).ptr(dx);
    launch(source, args, s.inputs(), sms)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(dtype: DType, relu: bool) -> ConvShape {
        ConvShape {
            dtype,
            input: [2, 4, 7, 6],
            weight: [6, 2, 3, 3],
            out_hw: [4, 6],
            conv: Conv2d {
                stride: [2, 1],
                padding: [1, 1, 1, 1],
                dilation: [1, 1],
                groups: 2,
                activation: if relu {
                    Activation::Relu
                } else {
                    Activation::None
                },
            },
        }
    }

    #[test]
    fn conv_kernels_pack_their_sizes_and_epilogue() {
        let l = conv2d_forward(&shape(DType::BF16, true), 1, 2, Some(3), 4, 132);
        assert!(
            l.source.contains("__bfloat162float") && l.source.contains("if (acc < 0) acc = 0;")
        );
        assert!(
            l.source
                .contains("acc += (float)__bfloat162float(((const __nv_bfloat16*)a.b)[oc])"),
            "{}",
            l.source
        );
        // 16 sizes, then x, w, b, y.
        assert_eq!(l.args.0.len(), 20);
        assert_eq!(&l.args.0[16..], &[1, 2, 3, 4]);
        assert_eq!(l.args.0[9], 2, "groups");
        let l = conv2d_forward(&shape(DType::F32, false), 1, 2, None, 4, 132);
        assert!(!l.source.contains("a.b)[oc]") && !l.source.contains("if (acc < 0)"));
        assert_eq!(l.args.0[18], 0, "no bias");
        let l = conv2d_backward_input(&shape(DType::F64, false), 1, 2, 3, 132);
        assert!(l.source.contains("double acc"));
        let l = conv2d_backward_weight(&shape(DType::F32, false), 1, 2, 3, 132);
        assert_eq!(l.grid, 1, "6·2·3·3 = 108 weights: one block");
        let l = conv2d_epilogue(DType::F16, [2, 6, 24], Some(5), Activation::Relu, 7, 132);
        assert!(l.source.contains("(i / a.hw) % a.o") && l.source.contains("if (v < 0) v = 0;"));
        assert_eq!(l.args.0, vec![2, 6, 24, 5, 7]);
        let l = conv2d_epilogue(DType::F32, [2, 6, 24], None, Activation::None, 7, 132);
        assert!(!l.source.contains("a.b)") && !l.source.contains("v < 0"));
    }

    #[test]
    fn pool_kernels_pack_their_sizes() {
        let s = PoolShape {
            dtype: DType::F16,
            planes: 6,
            hw: [7, 6],
            out_hw: [4, 3],
            pool: Pool2d {
                kernel: [3, 3],
                stride: [2, 2],
                padding: [1, 1],
                dilation: [1, 1],
                ceil_mode: false,
                count_include_pad: false,
                divisor_override: Some(5),
            },
        };
        let l = max_pool2d_forward(&s, 1, 2, 3, 132);
        assert!(l.source.contains("__half2float"));
        assert_eq!(l.args.0.len(), 15 + 3);
        assert_eq!((l.args.0[13], l.args.0[14]), (0, 5));
        let l = avg_pool2d_backward(&s, 1, 2, 132);
        assert!(l.source.contains("divisor_"));
    }
}
