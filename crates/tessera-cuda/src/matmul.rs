//! Matrix products through cuBLASLt: f32, f16, bf16 (f32 accumulate) and
//! f64, batched, with either operand transposed in memory, and an optional
//! bias + activation epilogue.
//!
//! tessera's matrices are row-major; cuBLASLt's are column-major. A
//! row-major `C = A·B` is the column-major `Cᵀ = Bᵀ·Aᵀ`, and a row-major
//! matrix read as column-major *is* its transpose, so B goes in as
//! cuBLASLt's first operand and A as its second, each with `N` when its
//! rows are contiguous and `T` when its columns are. The plan (descriptors
//! and the algorithm cuBLASLt's heuristic picks) is cached per shape.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Mutex;

use cudarc::cublaslt::{result as lt, sys as lt_sys};
use tessera::DType;

use crate::gpu::Gpu;

/// Workspace handed to cuBLASLt (as PyTorch does on Hopper).
const WORKSPACE: usize = 32 << 20;

/// What is applied to the product before it is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Epilogue {
    #[default]
    None,
    Relu,
    Gelu,
}

/// A matrix of a batch: logical `rows × cols`, element (i, j) of batch b
/// at `ptr + (b·batch_stride + i·row_stride + j·col_stride)·size`.
#[derive(Clone, Copy, Debug)]
pub struct Mat {
    pub ptr: u64,
    pub rows: usize,
    pub cols: usize,
    pub row_stride: usize,
    pub col_stride: usize,
    pub batch_stride: usize,
}

/// How cuBLASLt reads one operand: (transposed, layout rows, cols, ld).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Form {
    trans: bool,
    rows: u64,
    cols: u64,
    ld: i64,
}

impl Mat {
    /// As cuBLASLt's column-major operand of `op(X)` = `selfᵀ`; `None` when
    /// neither rows nor columns are contiguous (the caller copies).
    fn form(&self) -> Option<Form> {
        let (r, c) = (self.rows, self.cols);
        if c <= 1 || self.col_stride == 1 {
            // Rows contiguous: column-major c×r, ld = row stride.
            let ld = if r <= 1 { c.max(1) } else { self.row_stride };
            (ld >= c.max(1)).then_some(Form {
                trans: false,
                rows: c as u64,
                cols: r as u64,
                ld: ld as i64,
            })
        } else if r <= 1 || self.row_stride == 1 {
            // Columns contiguous: column-major r×c read transposed.
            let ld = if c <= 1 { r.max(1) } else { self.col_stride };
            (ld >= r.max(1)).then_some(Form {
                trans: true,
                rows: r as u64,
                cols: c as u64,
                ld: ld as i64,
            })
        } else {
            None
        }
    }

    /// Whether `self` can be read with no copy.
    pub fn direct(&self) -> bool {
        self.form().is_some()
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Key {
    dtype: DType,
    batch: usize,
    m: usize,
    n: usize,
    k: usize,
    a: Form,
    b: Form,
    strides: [usize; 3],
    epilogue: Epilogue,
    bias: bool,
}

struct Plan {
    desc: lt_sys::cublasLtMatmulDesc_t,
    layouts: [lt_sys::cublasLtMatrixLayout_t; 3],
    algo: lt_sys::cublasLtMatmulAlgo_t,
}

struct Handles {
    handle: lt_sys::cublasLtHandle_t,
    /// By lane (the workspaces live as long as the process; they are not
    /// tensors, so they stay out of the accounting).
    workspaces: Vec<u64>,
    plans: HashMap<Key, Plan>,
}

// SAFETY: cuBLASLt handles and descriptors are used under the mutex only.
unsafe impl Send for Handles {}

/// cuBLASLt, opened lazily on the first product.
pub struct Blas {
    inner: Mutex<Option<Handles>>,
}

fn blas_error(what: &str, e: lt::CublasError) -> String {
    format!("cuBLASLt {what} failed: {:?}", e.0)
}

fn data_type(
    dtype: DType,
) -> Option<(
    lt_sys::cudaDataType,
    lt_sys::cublasComputeType_t,
    lt_sys::cudaDataType,
)> {
    use lt_sys::cublasComputeType_t as C;
    use lt_sys::cudaDataType as D;
    Some(match dtype {
        DType::F32 => (D::CUDA_R_32F, C::CUBLAS_COMPUTE_32F, D::CUDA_R_32F),
        DType::F16 => (D::CUDA_R_16F, C::CUBLAS_COMPUTE_32F, D::CUDA_R_32F),
        DType::BF16 => (D::CUDA_R_16BF, C::CUBLAS_COMPUTE_32F, D::CUDA_R_32F),
        DType::F64 => (D::CUDA_R_64F, C::CUBLAS_COMPUTE_64F, D::CUDA_R_64F),
        _ => return None,
    })
}

impl Default for Blas {
    fn default() -> Self {
        Blas {
            inner: Mutex::new(None),
        }
    }
}

impl Blas {
    /// `c = epilogue(a·b + bias)` for a batch of `batch` products, `a`
    /// m×k, `b` k×n, `c` contiguous m×n per batch (batch stride m·n),
    /// `bias` a vector of n elements of `dtype`.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm(
        &self,
        gpu: &Gpu,
        dtype: DType,
        batch: usize,
        a: Mat,
        b: Mat,
        c: u64,
        bias: Option<u64>,
        epilogue: Epilogue,
    ) -> Result<(), String> {
        let (m, k, n) = (a.rows, a.cols, b.cols);
        let (Some(fa), Some(fb)) = (a.form(), b.form()) else {
            return Err("an operand with neither rows nor columns contiguous".into());
        };
        let Some((ty, compute, scale)) = data_type(dtype) else {
            return Err(format!(
                "matmul of {dtype} is not supported on the GPU (f32, f64, f16, bf16 are)"
            ));
        };
        // SAFETY: only tries to open the library.
        if !unsafe { lt_sys::is_culib_present() } {
            return Err("cuBLASLt not found: libcublasLt.so could not be loaded (put the CUDA toolkit's lib64 on LD_LIBRARY_PATH)".into());
        }
        gpu.bind();
        let mut guard = self.inner.lock().expect("cuBLASLt poisoned");
        if guard.is_none() {
            let handle = lt::create_handle().map_err(|e| blas_error("handle creation", e))?;
            *guard = Some(Handles {
                handle,
                workspaces: Vec::new(),
                plans: HashMap::new(),
            });
        }
        let h = guard.as_mut().expect("opened above");
        // One workspace per lane: products on different lanes may run at
        // the same time.
        let lane = gpu.lane();
        while h.workspaces.len() <= lane {
            h.workspaces.push(gpu.alloc_unaccounted(WORKSPACE)?);
        }
        let workspace = h.workspaces[lane];
        let key = Key {
            dtype,
            batch,
            m,
            n,
            k,
            a: fa,
            b: fb,
            strides: [a.batch_stride, b.batch_stride, m * n],
            epilogue,
            bias: bias.is_some(),
        };
        if !h.plans.contains_key(&key) {
            let plan = unsafe { make_plan(h.handle, &key, ty, compute, scale) }?;
            h.plans.insert(key.clone(), plan);
        }
        let plan = &h.plans[&key];
        if let Some(bias) = bias {
            unsafe {
                lt::set_matmul_desc_attribute(
                    plan.desc,
                    lt_sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                    &bias as *const u64 as *const c_void,
                    std::mem::size_of::<u64>(),
                )
            }
            .map_err(|e| blas_error("bias", e))?;
        }
        let (one32, zero32, one64, zero64) = (1.0f32, 0.0f32, 1.0f64, 0.0f64);
        let (alpha, beta): (*const c_void, *const c_void) = if dtype == DType::F64 {
            (&one64 as *const f64 as _, &zero64 as *const f64 as _)
        } else {
            (&one32 as *const f32 as _, &zero32 as *const f32 as _)
        };
        // SAFETY: pointers are live device buffers of the sizes the layouts
        // describe; the plan's descriptors live in the cache.
        unsafe {
            lt::matmul(
                h.handle,
                plan.desc,
                alpha,
                beta,
                b.ptr as *const c_void,
                plan.layouts[0],
                a.ptr as *const c_void,
                plan.layouts[1],
                c as *const c_void,
                plan.layouts[2],
                c as *mut c_void,
                plan.layouts[2],
                &plan.algo,
                workspace as *mut c_void,
                WORKSPACE,
                gpu.stream() as lt_sys::cudaStream_t,
            )
        }
        .map_err(|e| blas_error(&format!("matmul ({batch}×{m}×{k}×{n} {dtype})"), e))
    }
}

/// Descriptors and the heuristic's algorithm for one problem.
///
/// # Safety
/// `handle` is a live cuBLASLt handle.
unsafe fn make_plan(
    handle: lt_sys::cublasLtHandle_t,
    key: &Key,
    ty: lt_sys::cudaDataType,
    compute: lt_sys::cublasComputeType_t,
    scale: lt_sys::cudaDataType,
) -> Result<Plan, String> {
    use lt_sys::cublasLtMatmulDescAttributes_t as DA;
    use lt_sys::cublasLtMatrixLayoutAttribute_t as LA;
    let desc = lt::create_matmul_desc(compute, scale).map_err(|e| blas_error("descriptor", e))?;
    let set = |attr: DA, v: i32| {
        lt::set_matmul_desc_attribute(desc, attr, &v as *const i32 as *const c_void, 4)
            .map_err(|e| blas_error("descriptor", e))
    };
    // cuBLASLt's A is our B, its B our A.
    set(DA::CUBLASLT_MATMUL_DESC_TRANSA, key.b.trans as i32)?;
    set(DA::CUBLASLT_MATMUL_DESC_TRANSB, key.a.trans as i32)?;
    use lt_sys::cublasLtEpilogue_t as E;
    let epilogue = match (key.epilogue, key.bias) {
        (Epilogue::None, false) => E::CUBLASLT_EPILOGUE_DEFAULT,
        (Epilogue::None, true) => E::CUBLASLT_EPILOGUE_BIAS,
        (Epilogue::Relu, false) => E::CUBLASLT_EPILOGUE_RELU,
        (Epilogue::Relu, true) => E::CUBLASLT_EPILOGUE_RELU_BIAS,
        (Epilogue::Gelu, false) => E::CUBLASLT_EPILOGUE_GELU,
        (Epilogue::Gelu, true) => E::CUBLASLT_EPILOGUE_GELU_BIAS,
    };
    set(DA::CUBLASLT_MATMUL_DESC_EPILOGUE, epilogue as i32)?;
    if key.bias {
        set(DA::CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, ty as i32)?;
    }
    let layout = |f: Form, batch_stride: usize| -> Result<_, String> {
        let l = lt::create_matrix_layout(ty, f.rows, f.cols, f.ld)
            .map_err(|e| blas_error("layout", e))?;
        let count = key.batch as i32;
        let stride = batch_stride as i64;
        lt::set_matrix_layout_attribute(
            l,
            LA::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
            &count as *const i32 as _,
            4,
        )
        .map_err(|e| blas_error("layout", e))?;
        lt::set_matrix_layout_attribute(
            l,
            LA::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
            &stride as *const i64 as _,
            8,
        )
        .map_err(|e| blas_error("layout", e))?;
        Ok(l)
    };
    let d = Form {
        trans: false,
        rows: key.n as u64,
        cols: key.m as u64,
        ld: key.n.max(1) as i64,
    };
    let layouts = [
        layout(key.b, key.strides[1])?,
        layout(key.a, key.strides[0])?,
        layout(d, key.strides[2])?,
    ];
    let pref = lt::create_matmul_pref().map_err(|e| blas_error("preference", e))?;
    let ws = WORKSPACE as u64;
    lt::set_matmul_pref_attribute(
        pref,
        lt_sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
        &ws as *const u64 as _,
        8,
    )
    .map_err(|e| blas_error("preference", e))?;
    let heuristic = lt::get_matmul_algo_heuristic(
        handle, desc, layouts[0], layouts[1], layouts[2], layouts[2], pref,
    )
    .map_err(|e| blas_error("algorithm search", e));
    let _ = lt::destroy_matmul_pref(pref);
    Ok(Plan {
        desc,
        layouts,
        algo: heuristic?.algo,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mat(rows: usize, cols: usize, row_stride: usize, col_stride: usize) -> Mat {
        Mat {
            ptr: 0,
            rows,
            cols,
            row_stride,
            col_stride,
            batch_stride: 0,
        }
    }

    #[test]
    fn row_major_goes_in_untransposed_and_column_major_transposed() {
        // A 4×3 row-major: column-major 3×4 with ld 3, op N.
        assert_eq!(
            mat(4, 3, 3, 1).form(),
            Some(Form {
                trans: false,
                rows: 3,
                cols: 4,
                ld: 3
            })
        );
        // The transpose of a 3×4 row-major (a view): column-major 4×3, op T.
        assert_eq!(
            mat(4, 3, 1, 4).form(),
            Some(Form {
                trans: true,
                rows: 4,
                cols: 3,
                ld: 4
            })
        );
        // A slice of columns keeps its parent's row stride.
        assert_eq!(
            mat(4, 2, 8, 1).form(),
            Some(Form {
                trans: false,
                rows: 2,
                cols: 4,
                ld: 8
            })
        );
        // Neither contiguous, or rows overlapping (a broadcast): a copy.
        assert_eq!(mat(4, 3, 6, 2).form(), None);
        assert_eq!(mat(4, 3, 0, 1).form(), None);
    }
}
