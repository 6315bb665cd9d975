//! libcudnn, opened by tessera itself: which library, and the entry
//! points [`crate::cudnn`] calls.
//!
//! Why not cudarc's loader: it opens `libcudnn.so` first. In a process
//! that already holds a cuDNN — PyTorch loads its wheel's `libcudnn.so.9`
//! when it is imported — that name can resolve to a second, different
//! cuDNN (seen: the system's 9.14 in `/usr/lib` beside the wheel's 9.19).
//! cuDNN 9 opens its sublibraries (`libcudnn_graph.so.9`, …) by soname, so
//! the two mix, and PyTorch's own calls then fail with
//! `CUDNN_STATUS_SUBLIBRARY_VERSION_MISMATCH`. Here a cuDNN already in the
//! process comes first (the dynamic loader hands back a loaded library
//! whose soname matches), then the versioned sonames, then `libcudnn.so`.
//!
//! Only cudarc's type declarations (`cudarc::cudnn::sys`) are used; no
//! call goes through cudarc's own library handle.

use std::ffi::{c_int, c_void};
use std::sync::OnceLock;

use cudarc::cudnn::sys::{
    cudaStream_t, cudnnConvolutionBwdDataAlgoPerf_t, cudnnConvolutionBwdDataAlgo_t,
    cudnnConvolutionBwdFilterAlgoPerf_t, cudnnConvolutionBwdFilterAlgo_t,
    cudnnConvolutionDescriptor_t, cudnnConvolutionFwdAlgoPerf_t, cudnnConvolutionFwdAlgo_t,
    cudnnConvolutionMode_t, cudnnDataType_t, cudnnFilterDescriptor_t, cudnnHandle_t,
    cudnnMathType_t, cudnnStatus_t, cudnnTensorDescriptor_t, cudnnTensorFormat_t,
};

/// The sonames a cuDNN tessera can use goes by (9 first: the newest).
const SONAMES: [&str; 2] = ["libcudnn.so.9", "libcudnn.so.8"];

/// The development symlink, tried last (it may point anywhere).
const UNVERSIONED: &str = "libcudnn.so";

/// Declares [`EntryPoints`] (one field per cuDNN function) and its loader,
/// from one list, so a signature is written once.
macro_rules! entry_points {
    ($($field:ident = $symbol:literal fn($($arg:ty),* $(,)?) -> $ret:ty;)*) => {
        /// The cuDNN functions tessera calls, resolved in one library.
        #[allow(clippy::type_complexity)]
        pub(crate) struct EntryPoints {
            $(pub $field: unsafe extern "C" fn($($arg),*) -> $ret,)*
        }

        impl EntryPoints {
            /// Resolves every entry point; `Err` names the first missing.
            ///
            /// # Safety
            /// `lib` is a cuDNN, so each symbol has the declared signature.
            unsafe fn resolve(lib: &libloading::Library) -> Result<Self, String> {
                Ok(EntryPoints {
                    $($field: *lib
                        .get::<unsafe extern "C" fn($($arg),*) -> $ret>(
                            concat!($symbol, "\0").as_bytes(),
                        )
                        .map_err(|_| format!("lacks {}", $symbol))?,)*
                })
            }
        }
    };
}

entry_points! {
    get_version = "cudnnGetVersion" fn() -> usize;
    create = "cudnnCreate" fn(*mut cudnnHandle_t) -> cudnnStatus_t;
    set_stream = "cudnnSetStream" fn(cudnnHandle_t, cudaStream_t) -> cudnnStatus_t;
    create_tensor_descriptor = "cudnnCreateTensorDescriptor"
        fn(*mut cudnnTensorDescriptor_t) -> cudnnStatus_t;
    set_tensor4d_descriptor = "cudnnSetTensor4dDescriptor" fn(
        cudnnTensorDescriptor_t, cudnnTensorFormat_t, cudnnDataType_t,
        c_int, c_int, c_int, c_int,
    ) -> cudnnStatus_t;
    create_filter_descriptor = "cudnnCreateFilterDescriptor"
        fn(*mut cudnnFilterDescriptor_t) -> cudnnStatus_t;
    set_filter4d_descriptor = "cudnnSetFilter4dDescriptor" fn(
        cudnnFilterDescriptor_t, cudnnDataType_t, cudnnTensorFormat_t,
        c_int, c_int, c_int, c_int,
    ) -> cudnnStatus_t;
    create_convolution_descriptor = "cudnnCreateConvolutionDescriptor"
        fn(*mut cudnnConvolutionDescriptor_t) -> cudnnStatus_t;
    set_convolution2d_descriptor = "cudnnSetConvolution2dDescriptor" fn(
        cudnnConvolutionDescriptor_t, c_int, c_int, c_int, c_int, c_int, c_int,
        cudnnConvolutionMode_t, cudnnDataType_t,
    ) -> cudnnStatus_t;
    set_convolution_group_count = "cudnnSetConvolutionGroupCount"
        fn(cudnnConvolutionDescriptor_t, c_int) -> cudnnStatus_t;
    set_convolution_math_type = "cudnnSetConvolutionMathType"
        fn(cudnnConvolutionDescriptor_t, cudnnMathType_t) -> cudnnStatus_t;
    forward_algorithms = "cudnnGetConvolutionForwardAlgorithm_v7" fn(
        cudnnHandle_t, cudnnTensorDescriptor_t, cudnnFilterDescriptor_t,
        cudnnConvolutionDescriptor_t, cudnnTensorDescriptor_t, c_int, *mut c_int,
        *mut cudnnConvolutionFwdAlgoPerf_t,
    ) -> cudnnStatus_t;
    backward_data_algorithms = "cudnnGetConvolutionBackwardDataAlgorithm_v7" fn(
        cudnnHandle_t, cudnnFilterDescriptor_t, cudnnTensorDescriptor_t,
        cudnnConvolutionDescriptor_t, cudnnTensorDescriptor_t, c_int, *mut c_int,
        *mut cudnnConvolutionBwdDataAlgoPerf_t,
    ) -> cudnnStatus_t;
    backward_filter_algorithms = "cudnnGetConvolutionBackwardFilterAlgorithm_v7" fn(
        cudnnHandle_t, cudnnTensorDescriptor_t, cudnnTensorDescriptor_t,
        cudnnConvolutionDescriptor_t, cudnnFilterDescriptor_t, c_int, *mut c_int,
        *mut cudnnConvolutionBwdFilterAlgoPerf_t,
    ) -> cudnnStatus_t;
    forward_workspace = "cudnnGetConvolutionForwardWorkspaceSize" fn(
        cudnnHandle_t, cudnnTensorDescriptor_t, cudnnFilterDescriptor_t,
        cudnnConvolutionDescriptor_t, cudnnTensorDescriptor_t, cudnnConvolutionFwdAlgo_t,
        *mut usize,
    ) -> cudnnStatus_t;
    backward_data_workspace = "cudnnGetConvolutionBackwardDataWorkspaceSize" fn(
        cudnnHandle_t, cudnnFilterDescriptor_t, cudnnTensorDescriptor_t,
        cudnnConvolutionDescriptor_t, cudnnTensorDescriptor_t, cudnnConvolutionBwdDataAlgo_t,
        *mut usize,
    ) -> cudnnStatus_t;
    backward_filter_workspace = "cudnnGetConvolutionBackwardFilterWorkspaceSize" fn(
        cudnnHandle_t, cudnnTensorDescriptor_t, cudnnTensorDescriptor_t,
        cudnnConvolutionDescriptor_t, cudnnFilterDescriptor_t,
        cudnnConvolutionBwdFilterAlgo_t, *mut usize,
    ) -> cudnnStatus_t;
    forward = "cudnnConvolutionForward" fn(
        cudnnHandle_t, *const c_void, cudnnTensorDescriptor_t, *const c_void,
        cudnnFilterDescriptor_t, *const c_void, cudnnConvolutionDescriptor_t,
        cudnnConvolutionFwdAlgo_t, *mut c_void, usize, *const c_void,
        cudnnTensorDescriptor_t, *mut c_void,
    ) -> cudnnStatus_t;
    backward_data = "cudnnConvolutionBackwardData" fn(
        cudnnHandle_t, *const c_void, cudnnFilterDescriptor_t, *const c_void,
        cudnnTensorDescriptor_t, *const c_void, cudnnConvolutionDescriptor_t,
        cudnnConvolutionBwdDataAlgo_t, *mut c_void, usize, *const c_void,
        cudnnTensorDescriptor_t, *mut c_void,
    ) -> cudnnStatus_t;
    backward_filter = "cudnnConvolutionBackwardFilter" fn(
        cudnnHandle_t, *const c_void, cudnnTensorDescriptor_t, *const c_void,
        cudnnTensorDescriptor_t, *const c_void, cudnnConvolutionDescriptor_t,
        cudnnConvolutionBwdFilterAlgo_t, *mut c_void, usize, *const c_void,
        cudnnFilterDescriptor_t, *mut c_void,
    ) -> cudnnStatus_t;
}

/// The opened cuDNN: its entry points, where it came from, its version.
pub(crate) struct Cudnn {
    pub api: EntryPoints,
    /// The name it was opened by, and whether it was already loaded.
    pub origin: String,
    /// `cudnnGetVersion` (e.g. 91900 for 9.19.0).
    pub version: usize,
    /// Keeps the entry points valid for the life of the process.
    _lib: libloading::Library,
}

/// The process's cuDNN, opened on first use; `Err` says why there is none
/// (no library, a missing symbol, too old: see [`open`]).
pub(crate) fn cudnn(min_version: usize) -> Result<&'static Cudnn, String> {
    static LIB: OnceLock<Result<Cudnn, String>> = OnceLock::new();
    LIB.get_or_init(|| open(min_version))
        .as_ref()
        .map_err(Clone::clone)
}

/// Opens the library [`find`] picks and resolves its entry points.
fn open(min_version: usize) -> Result<Cudnn, String> {
    let (lib, origin) = find()?;
    // SAFETY: a library named libcudnn is cuDNN.
    let api = unsafe { EntryPoints::resolve(&lib) }.map_err(|why| format!("{origin} {why}"))?;
    // SAFETY: resolved above; takes no arguments.
    let version = unsafe { (api.get_version)() };
    if version < min_version {
        return Err(format!(
            "{origin} is cuDNN {version}, older than {min_version}"
        ));
    }
    Ok(Cudnn {
        api,
        origin,
        version,
        _lib: lib,
    })
}

/// A cuDNN already in the process (by soname, without loading one), else
/// the first of the sonames and then `libcudnn.so` the loader finds.
fn find() -> Result<(libloading::Library, String), String> {
    for name in SONAMES {
        if let Some(lib) = already_loaded(name) {
            return Ok((lib, format!("{name} (already loaded in this process)")));
        }
    }
    for name in SONAMES.iter().chain([&UNVERSIONED]) {
        // SAFETY: loading cuDNN runs no initialiser with preconditions.
        if let Ok(lib) = unsafe { libloading::Library::new(*name) } {
            return Ok((lib, name.to_string()));
        }
    }
    Err(format!(
        "none of {} could be loaded (put cuDNN's lib folder on LD_LIBRARY_PATH, e.g. the nvidia-cudnn wheel's nvidia/cudnn/lib)",
        SONAMES.join(", ") + ", " + UNVERSIONED
    ))
}

/// `name`'s library when the process already holds it (`RTLD_NOLOAD`:
/// never loads one).
fn already_loaded(name: &str) -> Option<libloading::Library> {
    use libloading::os::unix::Library;
    // SAFETY: with RTLD_NOLOAD nothing is loaded, so no initialiser runs.
    unsafe { Library::open(Some(name), libc::RTLD_NOLOAD | libc::RTLD_LAZY) }
        .ok()
        .map(Into::into)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_library_not_in_the_process_is_not_loaded_by_the_probe() {
        // libc is in every Rust process on Linux, a made-up name in none.
        assert!(already_loaded("libtessera-no-such-library.so.1").is_none());
        assert!(already_loaded("libc.so.6").is_some());
    }

    #[test]
    fn a_missing_cudnn_is_an_error_naming_the_names_tried() {
        if find().is_ok() {
            eprintln!("cuDNN is present here: the missing-library path is not exercised");
            return;
        }
        let why = cudnn(8000).err().expect("no cuDNN here");
        assert!(
            why.contains("libcudnn.so.9") && why.contains("LD_LIBRARY_PATH"),
            "{why}"
        );
    }
}
