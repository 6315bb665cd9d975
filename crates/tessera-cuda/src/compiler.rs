//! NVRTC: CUDA C source to a loadable image, cached by source hash in
//! memory (the loaded function, see `gpu.rs`) and on disk (the image, under
//! `$TESSERA_CACHE_DIR` or `~/.cache/tessera/cuda`).
//!
//! For a device the target is its real architecture (`sm_90` on Hopper),
//! so the driver loads machine code (a cubin) with no JIT step. CI, which
//! has no GPU, compiles every template to PTX for `compute_90` with the
//! same function.

use std::ffi::{c_char, CString};
use std::path::PathBuf;

use cudarc::nvrtc::{result as nvrtc, sys as nvrtc_sys};

/// Whether libnvrtc can be loaded (cudarc panics on a missing library).
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to open the library.
    unsafe { nvrtc_sys::is_culib_present() }
}

/// Directories searched for `cuda_fp16.h` / `cuda_bf16.h`:
/// `$TESSERA_CUDA_INCLUDE` (`:`-separated), `$CUDA_HOME/include`,
/// `/usr/local/cuda/include`; those that exist.
pub fn include_dirs() -> Vec<String> {
    let mut dirs: Vec<String> = std::env::var("TESSERA_CUDA_INCLUDE")
        .map(|v| v.split(':').map(String::from).collect())
        .unwrap_or_default();
    if let Ok(home) = std::env::var("CUDA_HOME") {
        dirs.push(format!("{home}/include"));
    }
    dirs.push("/usr/local/cuda/include".into());
    dirs.retain(|d| !d.is_empty() && std::path::Path::new(d).is_dir());
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

/// Compiles `source` for `target` (`sm_90`: a cubin; `compute_90`: PTX),
/// reading and filling the disk cache. Errors carry NVRTC's log.
pub fn compile(source: &str, target: &str) -> Result<Vec<u8>, String> {
    let key = source_hash(source, target);
    let ext = if target.starts_with("sm_") {
        "cubin"
    } else {
        "ptx"
    };
    let file = cache_dir().map(|d| d.join(format!("{key}.{ext}")));
    if let Some(bytes) = file.as_ref().and_then(|f| std::fs::read(f).ok()) {
        return Ok(bytes);
    }
    let image = compile_uncached(source, target)?;
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
pub fn compile_uncached(source: &str, target: &str) -> Result<Vec<u8>, String> {
    if !nvrtc_present() {
        return Err("NVRTC (libnvrtc) not found: install the CUDA toolkit or put libnvrtc on LD_LIBRARY_PATH".into());
    }
    let src = CString::new(source).map_err(|_| "the source holds a NUL byte".to_string())?;
    let prog = nvrtc::create_program(&src, Some(c"tessera.cu")).map_err(|e| format!("{e:?}"))?;
    let mut options = vec![
        format!("--gpu-architecture={target}"),
        "--std=c++17".to_string(),
    ];
    options.extend(
        include_dirs()
            .into_iter()
            .map(|d| format!("--include-path={d}")),
    );
    // SAFETY: `prog` is live until destroyed below.
    let result = unsafe { nvrtc::compile_program(prog, &options) };
    let out = match result {
        Ok(()) => unsafe { image(prog, target.starts_with("sm_")) },
        Err(e) => {
            let log = unsafe { nvrtc::get_program_log(prog) }
                .map(|l| c_chars_to_string(&l))
                .unwrap_or_default();
            Err(format!("NVRTC failed ({e:?}) for {target}:\n{log}"))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hash_depends_on_source_and_target_and_is_stable() {
        let a = source_hash("x", "sm_90");
        assert_eq!(a, source_hash("x", "sm_90"));
        assert_ne!(a, source_hash("x", "sm_80"));
        assert_ne!(a, source_hash("y", "sm_90"));
        assert_eq!(a.len(), 32);
    }
}
