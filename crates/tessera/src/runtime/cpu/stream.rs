//! Memory-traffic helpers for the streaming kernels (fused pointwise
//! blocks, softmax rows): non-temporal stores and software prefetch.
//!
//! Why: a kernel that reads and writes far more than the caches hold pays
//! for every output line three times with plain stores (a read for
//! ownership, then the write-back). Non-temporal stores write the line
//! without reading it first, so such a kernel moves 2 bytes per byte of
//! output instead of 3. And a kernel that alternates compute with loads
//! stalls on each load unless the next block is already on its way:
//! prefetching it while the current one is computed overlaps the two.

/// Outputs at least this large are written with non-temporal stores: far
/// beyond the L2 caches, so the values would be evicted before anyone
/// reads them anyway.
pub(crate) const STREAM_MIN_BYTES: usize = 16 << 20;

/// Asks for the cache lines of `bytes` bytes at `ptr` to be loaded into
/// L1. A hint only: any address is allowed (nothing is read or faulted).
#[inline(always)]
pub(crate) fn prefetch(ptr: *const u8, bytes: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let mut at = 0;
        while at < bytes {
            // SAFETY: prefetch never dereferences in the language's sense;
            // it is a hint that cannot fault.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(ptr.wrapping_add(at) as *const i8) };
            at += 64;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (ptr, bytes);
}

/// Copies `src` into `dst` (same length) with non-temporal stores where
/// the CPU has them (x86-64 with AVX; the build's baseline is x86-64-v3),
/// else with a plain copy. The bytes written are the same either way.
pub(crate) fn stream_copy<A: Copy>(dst: &mut [A], src: &[A]) {
    assert_eq!(dst.len(), src.len(), "stream_copy of unequal lengths");
    let bytes = std::mem::size_of_val(src);
    // SAFETY: both regions are `bytes` long, valid, and do not overlap
    // (one is borrowed mutably).
    unsafe {
        stream_bytes(
            dst.as_mut_ptr() as *mut u8,
            src.as_ptr() as *const u8,
            bytes,
        )
    }
}

/// # Safety
/// `dst` and `src` are valid for `n` bytes and do not overlap.
unsafe fn stream_bytes(dst: *mut u8, src: *const u8, n: usize) {
    #[cfg(all(target_arch = "x86_64", target_feature = "avx"))]
    {
        use std::arch::x86_64::{__m256i, _mm256_loadu_si256, _mm256_stream_si256, _mm_sfence};
        // Plain copies up to the first 32-byte aligned address (the
        // streaming store needs it) and after the last whole vector.
        let head = (dst.align_offset(32)).min(n);
        std::ptr::copy_nonoverlapping(src, dst, head);
        let body = (n - head) / 32 * 32;
        let mut at = head;
        while at < head + body {
            let v = _mm256_loadu_si256(src.add(at) as *const __m256i);
            _mm256_stream_si256(dst.add(at) as *mut __m256i, v);
            at += 32;
        }
        std::ptr::copy_nonoverlapping(src.add(at), dst.add(at), n - at);
        // Non-temporal stores are weakly ordered: fence them before any
        // other thread may be told the data is there.
        _mm_sfence();
    }
    #[cfg(not(all(target_arch = "x86_64", target_feature = "avx")))]
    std::ptr::copy_nonoverlapping(src, dst, n);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_copy_writes_every_byte_at_any_alignment() {
        let src: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5 - 7.0).collect();
        for offset in 0..9 {
            for len in [0, 1, 7, 8, 9, 63, 64, 65, 500, 1000 - offset] {
                let mut dst = vec![f32::NAN; 1000];
                stream_copy(&mut dst[offset..offset + len], &src[..len]);
                assert_eq!(&dst[offset..offset + len], &src[..len], "{offset} {len}");
                assert!(dst[..offset].iter().all(|v| v.is_nan()), "before untouched");
                assert!(
                    dst[offset + len..].iter().all(|v| v.is_nan()),
                    "after untouched"
                );
            }
        }
        // Prefetch is only a hint, of any address.
        prefetch(std::ptr::null(), 4096);
    }
}
