//! NVRTC: CUDA C source to a loadable image, cached by source hash on
//! disk (the image, under `$TESSERA_CACHE_DIR` or `~/.cache/tessera/cuda`)
//! and in memory (the module loaded into a context and its functions). Every
//! kernel of the crate goes through here: the generated ones (`gpu.rs`) and
//! flash attention's hand-written ones (`flash`), which differ only in
//! their [`Program`] (a file name, `-D` options).
//!
//! For a device the target is its real architecture (`sm_90` on Hopper;
//! `sm_90a` where flash attention's wgmma kernels need it), so the driver
//! loads machine code (a cubin) with no JIT step. CI, which has no GPU,
//! compiles every template to PTX for `compute_90` with the same function.

use std::collections::HashMap;
use std::ffi::{c_char, c_void, CString};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{result as cu, sys as cu_sys};
use cudarc::nvrtc::{result as nvrtc, sys as nvrtc_sys};
use tessera::logging;

/// What NVRTC compiles: a source, the file name its messages give it, and
/// options beyond those every compilation gets (the target's
/// `--gpu-architecture`, `--std=c++17` and the [`include_dirs`]), such as
/// `-D` defines.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Program<'a> {
    pub source: &'a str,
    pub name: &'a str,
    pub options: &'a [&'a str],
}

impl<'a> Program<'a> {
    /// A generated kernel's source, with no options.
    pub fn new(source: &'a str) -> Program<'a> {
        Program {
            source,
            name: "tessera.cu",
            options: &[],
        }
    }

    /// The cache key of this program compiled for `target`: the
    /// [`source_hash`] of the source and of the target with the options
    /// (for a program without options, that of the source and target).
    pub fn key(&self, target: &str) -> String {
        if self.options.is_empty() {
            source_hash(self.source, target)
        } else {
            source_hash(self.source, &format!("{target} {}", self.options.join(" ")))
        }
    }

    /// NVRTC's options for `target`.
    fn nvrtc_options(&self, target: &str) -> Vec<String> {
        let mut options = vec![
            format!("--gpu-architecture={target}"),
            "--std=c++17".to_string(),
        ];
        options.extend(self.options.iter().map(|o| o.to_string()));
        options.extend(
            include_dirs()
                .into_iter()
                .map(|d| format!("--include-path={d}")),
        );
        options
    }
}

/// Whether libnvrtc can be loaded (cudarc panics on a missing library).
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to open the library.
    unsafe { nvrtc_sys::is_culib_present() }
}

/// Directories searched for `cuda_fp16.h` / `cuda_bf16.h`:
/// `$TESSERA_CUDA_INCLUDE` (`:`-separated), `$CUDA_HOME/include`,
/// `/usr/local/cuda/include`; those that hold `cuda_bf16.h` (empty: the
/// half-precision kernels cannot compile here).
pub fn include_dirs() -> Vec<String> {
    let mut dirs: Vec<String> = std::env::var("TESSERA_CUDA_INCLUDE")
        .map(|v| v.split(':').map(String::from).collect())
        .unwrap_or_default();
    if let Ok(home) = std::env::var("CUDA_HOME") {
        dirs.push(format!("{home}/include"));
    }
    dirs.push("/usr/local/cuda/include".into());
    dirs.retain(|d| !d.is_empty() && std::path::Path::new(d).join("cuda_bf16.h").is_file());
    dirs.dedup();
    dirs
}

/// A stable 128-bit hash (two FNV-1a variants) of the source and target:
/// the cache key, stable across runs and builds.
pub fn source_hash(source: &str, target: &str) -> String {
    let fnv = |seed: u64, prime: u64| {
        let mut h = seed;
        for b in source.bytes().chain([0]).chain(target.bytes()) {
            h ^= b as u64;
            h = h.wrapping_mul(prime);
        }
        h
    };
    format!(
        "{:016x}{:016x}",
        fnv(0xcbf29ce484222325, 0x100000001b3),
        fnv(0x84222325cbf29ce4, 0x1000193)
    )
}

/// Where compiled images are kept on disk; `None` if no folder can be made.
pub fn cache_dir() -> Option<PathBuf> {
    let dir = match std::env::var_os("TESSERA_CACHE_DIR") {
        Some(d) => PathBuf::from(d).join("cuda"),
        None => PathBuf::from(std::env::var_os("HOME")?).join(".cache/tessera/cuda"),
    };
    std::fs::create_dir_all(&dir).ok()?;
    Some(dir)
}

/// Compiles `program` for `target` (`sm_90`, `sm_90a`: a cubin;
/// `compute_90`: PTX), reading and filling the disk cache. Errors carry
/// NVRTC's log.
pub fn compile(program: &Program<'_>, target: &str) -> Result<Vec<u8>, String> {
    let key = program.key(target);
    let ext = if target.starts_with("sm_") {
        "cubin"
    } else {
        "ptx"
    };
    let file = cache_dir().map(|d| d.join(format!("{key}.{ext}")));
    if let Some(bytes) = file.as_ref().and_then(|f| std::fs::read(f).ok()) {
        return Ok(bytes);
    }
    let image = compile_uncached(program, target)?;
    if let Some(f) = file {
        // A failed write only costs a recompile next time.
        let tmp = f.with_extension(format!("{ext}.{}", std::process::id()));
        if std::fs::write(&tmp, &image).is_ok() {
            let _ = std::fs::rename(&tmp, &f);
        }
    }
    Ok(image)
}

/// One NVRTC compilation, no cache.
pub fn compile_uncached(program: &Program<'_>, target: &str) -> Result<Vec<u8>, String> {
    if !nvrtc_present() {
        return Err("NVRTC (libnvrtc) not found: install the CUDA toolkit or put libnvrtc on LD_LIBRARY_PATH".into());
    }
    let src = CString::new(program.source)
        .map_err(|_| format!("{}: the source holds a NUL byte", program.name))?;
    let name = CString::new(program.name)
        .map_err(|_| format!("the program name {:?} holds a NUL byte", program.name))?;
    let prog = nvrtc::create_program(&src, Some(&name))
        .map_err(|e| format!("nvrtcCreateProgram for {}: {e:?}", program.name))?;
    let options = program.nvrtc_options(target);
    // SAFETY: `prog` is live until destroyed below.
    let result = unsafe { nvrtc::compile_program(prog, &options) };
    let out = match result {
        Ok(()) => unsafe { image(prog, target.starts_with("sm_")) },
        Err(e) => {
            let log = unsafe { nvrtc::get_program_log(prog) }
                .map(|l| c_chars_to_string(&l))
                .unwrap_or_default();
            let extra = match program.options {
                [] => String::new(),
                o => format!(" with {}", o.join(" ")),
            };
            Err(format!(
                "NVRTC failed ({e:?}) for {target}{extra} ({}):\n{log}",
                program.name
            ))
        }
    };
    // SAFETY: created above, destroyed once.
    unsafe {
        let _ = nvrtc::destroy_program(prog);
    }
    out
}

/// The compiled cubin or PTX (NUL-terminated, as the driver wants it).
///
/// # Safety
/// `prog` was compiled successfully and is not destroyed.
unsafe fn image(prog: nvrtc_sys::nvrtcProgram, cubin: bool) -> Result<Vec<u8>, String> {
    if cubin {
        let mut size = 0usize;
        nvrtc_sys::nvrtcGetCUBINSize(prog, &mut size)
            .result()
            .map_err(|e| format!("{e:?}"))?;
        let mut buf = vec![0 as c_char; size];
        nvrtc_sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr())
            .result()
            .map_err(|e| format!("{e:?}"))?;
        Ok(buf.into_iter().map(|c| c as u8).collect())
    } else {
        let ptx = nvrtc::get_ptx(prog).map_err(|e| format!("{e:?}"))?;
        Ok(ptx.into_iter().map(|c| c as u8).collect())
    }
}

fn c_chars_to_string(chars: &[c_char]) -> String {
    let bytes: Vec<u8> = chars
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

// ---------------------------------------------------------------------------
// Loaded modules
// ---------------------------------------------------------------------------

/// A raw driver handle in the module map: used only under its locks, in
/// its own context.
#[derive(Clone, Copy)]
struct Handle<T>(T);
// SAFETY: driver handles may be used from any thread once their context is
// current there (the callers of [`module`] make it so).
unsafe impl<T> Send for Handle<T> {}
unsafe impl<T> Sync for Handle<T> {}

/// A program loaded into a context: its module and the functions taken
/// from it so far. Never unloaded (the kernels serve the whole process).
pub struct Module {
    handle: Handle<cu_sys::CUmodule>,
    /// By entry point: the function and the dynamic shared memory it has
    /// been allowed (0: the default 48 KB).
    functions: Mutex<HashMap<String, (Handle<cu_sys::CUfunction>, u32)>>,
}

impl Module {
    /// The entry point `entry`, allowed `smem` bytes of dynamic shared
    /// memory (above 48 KB a function gets them only after opting in: its
    /// limit is raised the first time a launch asks for more).
    pub fn function(&self, entry: &str, smem: u32) -> Result<cu_sys::CUfunction, String> {
        let mut functions = self.functions.lock().unwrap_or_else(|p| p.into_inner());
        let (f, allowed) = match functions.get(entry) {
            Some(&(f, allowed)) => (f, allowed),
            None => {
                let name = CString::new(entry)
                    .map_err(|_| format!("kernel name {entry:?} holds a NUL byte"))?;
                // SAFETY: the module is loaded and never unloaded.
                let f = unsafe { cu::module::get_function(self.handle.0, name) }
                    .map_err(|e| crate::driver_error(&format!("kernel lookup of {entry}"), e))?;
                (Handle(f), 0)
            }
        };
        let allowed = if smem > 48 * 1024 && smem > allowed {
            // SAFETY: a live function of a loaded module.
            unsafe {
                cu::function::set_function_attribute(
                    f.0,
                    cu_sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    smem as i32,
                )
            }
            .map_err(|e| crate::driver_error(&format!("shared memory limit of {entry}"), e))?;
            smem
        } else {
            allowed
        };
        functions.insert(entry.to_string(), (f, allowed));
        Ok(f.0)
    }
}

/// Loaded modules by context, then by [`Program::key`].
type Modules = HashMap<usize, HashMap<String, Arc<Module>>>;

fn modules() -> &'static Mutex<Modules> {
    static MODULES: OnceLock<Mutex<Modules>> = OnceLock::new();
    MODULES.get_or_init(Default::default)
}

/// `program` compiled for `target` and loaded into `ctx`, which must be
/// current on this thread. `key` is `program.key(target)`, which a caller
/// that launches often computes once (hashing flash attention's source on
/// every launch would cost more than some of its launches). Compiled
/// (through the disk cache) and loaded on first use, its source printed
/// under `TESSERA_LOGS=output_code`; then from memory.
pub fn module(
    ctx: cu_sys::CUcontext,
    key: &str,
    program: &Program<'_>,
    target: &str,
) -> Result<Arc<Module>, String> {
    let find = |all: &Modules| all.get(&(ctx as usize))?.get(key).cloned();
    if let Some(m) = find(&modules().lock().unwrap_or_else(|p| p.into_inner())) {
        return Ok(m);
    }
    // Compiled outside the lock: other kernels need not wait for this one.
    logging::log("output_code", || {
        format!(
            "kernel {key} ({}) for {target}:\n{}",
            program.name, program.source
        )
    });
    let mut image = compile(program, target)?;
    image.push(0);
    // SAFETY: a complete cubin (or NUL-terminated PTX) image; `ctx` is
    // current (the caller's promise).
    let handle = unsafe { cu::module::load_data(image.as_ptr() as *const c_void) }
        .map_err(|e| crate::driver_error(&format!("module load of {}", program.name), e))?;
    let mut all = modules().lock().unwrap_or_else(|p| p.into_inner());
    if let Some(m) = find(&all) {
        // Another thread loaded it meanwhile: keep theirs.
        // SAFETY: loaded above, used by nobody else.
        let _ = unsafe { cu::module::unload(handle) };
        return Ok(m);
    }
    let m = Arc::new(Module {
        handle: Handle(handle),
        functions: Mutex::new(HashMap::new()),
    });
    all.entry(ctx as usize)
        .or_default()
        .insert(key.to_string(), m.clone());
    Ok(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_key_covers_the_options_and_keeps_plain_sources_keys() {
        let plain = Program::new("x");
        assert_eq!(plain.key("sm_90"), source_hash("x", "sm_90"));
        let defined = Program {
            options: &["-DA"],
            ..plain
        };
        let other = Program {
            options: &["-DB"],
            ..plain
        };
        assert_ne!(defined.key("sm_90"), plain.key("sm_90"));
        assert_ne!(defined.key("sm_90"), other.key("sm_90"));
        assert_ne!(defined.key("sm_90"), defined.key("sm_90a"));
        assert_eq!(
            defined.nvrtc_options("sm_90a")[..3],
            [
                "--gpu-architecture=sm_90a".to_string(),
                "--std=c++17".to_string(),
                "-DA".to_string()
            ]
        );
    }

    #[test]
    fn the_hash_depends_on_source_and_target_and_is_stable() {
        let a = source_hash("x", "sm_90");
        assert_eq!(a, source_hash("x", "sm_90"));
        assert_ne!(a, source_hash("x", "sm_80"));
        assert_ne!(a, source_hash("y", "sm_90"));
        assert_eq!(a.len(), 32);
    }
}
