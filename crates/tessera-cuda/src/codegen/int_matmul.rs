//! Integer matrix products (`int8` … `uint64`), which cuBLASLt does not
//! offer for tessera's operand forms (its int8 path needs int8 inputs in
//! one transposed layout and returns int32; ONNX's MatMulInteger and
//! QLinearMatMul reach the product with int32 operands, the zero points
//! already subtracted).
//!
//! One thread per output element, a plain loop over `k`: integer products
//! are rare in the models tessera runs (quantised ONNX graphs), and the
//! answer must be exact, so the kernel favours being obviously right over
//! speed. The sums wrap in the element type, as on the CPU (and in
//! PyTorch): products and sums are taken in `unsigned long long`, whose
//! wrap-around is defined in C++, and truncated on store.

use tessera::DType;

use super::{c_type, grid_for, prelude, Launch, Words, ENTRY};

/// A batch of matrices: element (i, j) of batch b at element
/// `b·strides[0] + i·strides[1] + j·strides[2]` from the byte address `ptr`.
#[derive(Clone, Copy, Debug)]
pub struct Matrices {
    pub ptr: u64,
    pub strides: [usize; 3],
}

/// `c = a·b` for a batch of `batch` integer products of `dtype`: `a`
/// m×k and `b` k×n read through their strides, `c` at `c_ptr` dense
/// (batch stride m·n).
pub fn int_matmul(
    dtype: DType,
    batch: usize,
    (m, k, n): (usize, usize, usize),
    a: Matrices,
    b: Matrices,
    c_ptr: u64,
    sms: u32,
) -> Launch {
    let t = c_type(dtype);
    let source = format!(
        "{prelude}struct Args {{ long long batch, m, n, k, a_bs, a_rs, a_cs, b_bs, b_rs, b_cs; \
         const void* a; const void* b; void* c; }};\n\
         extern \"C\" __global__ void {ENTRY}(Args g) {{\n\
         const {t}* A = (const {t}*)g.a; const {t}* B = (const {t}*)g.b; {t}* C = ({t}*)g.c;\n\
         long long total = g.batch * g.m * g.n;\n\
         for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total; \
         i += (long long)gridDim.x * blockDim.x) {{\n\
         long long col = i % g.n, r = i / g.n, row = r % g.m, bt = r / g.m;\n\
         const {t}* ap = A + bt * g.a_bs + row * g.a_rs;\n\
         const {t}* bp = B + bt * g.b_bs + col * g.b_cs;\n\
         unsigned long long acc = 0;\n\
         for (long long p = 0; p < g.k; ++p)\n\
         acc += (unsigned long long)(long long)ap[p * g.a_cs] * (unsigned long long)(long long)bp[p * g.b_rs];\n\
         C[i] = ({t})acc;\n\
         }}\n}}\n",
        prelude = prelude(&[dtype]),
    );
    let mut args = Words::default();
    args.ints([batch, m, n, k].map(|v| v as i64))
        .ints(a.strides.map(|v| v as i64))
        .ints(b.strides.map(|v| v as i64))
        .ptr(a.ptr)
        .ptr(b.ptr)
        .ptr(c_ptr);
    let outputs = batch * m * n;
    Launch {
        source,
        args,
        grid: grid_for(outputs, 256, sms),
        block: 256,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_source_names_the_element_type_and_the_arguments_follow_the_struct() {
        // a 3×5 row-major, b 5×4 column-major.
        let a = Matrices {
            ptr: 1024,
            strides: [15, 5, 1],
        };
        let b = Matrices {
            ptr: 1024,
            strides: [20, 1, 5],
        };
        let l = int_matmul(DType::I32, 2, (3, 5, 4), a, b, 4096, 132);
        assert!(l.source.contains("const int* A"), "{}", l.source);
        assert!(l.source.contains("unsigned long long acc"), "{}", l.source);
        // batch, m, n, k, a's strides, b's strides, then the three pointers.
        assert_eq!(&l.args.0[..4], &[2, 3, 4, 5]);
        assert_eq!(&l.args.0[4..10], &[15, 5, 1, 20, 1, 5]);
        assert_eq!(&l.args.0[10..], &[1024, 1024, 4096]);
        let u8s = int_matmul(DType::U8, 1, (3, 5, 4), a, b, 4096, 132);
        assert!(u8s.source.contains("const unsigned char* A"));
    }
}
