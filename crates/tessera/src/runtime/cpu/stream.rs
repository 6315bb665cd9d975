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

/// Outputs at least this large are written with non-temporal stores: half
/// the last-level cache (read once from sysfs on Linux; at least 16 MiB,
/// the default elsewhere). A smaller output is better left in that cache
/// for its consumer, and a larger one would be evicted before anyone reads
/// it anyway.
pub(crate) fn stream_min_bytes() -> usize {
    #[cfg(test)]
    if let Some(bytes) = TEST_MIN_BYTES.with(|b| b.get()) {
        return bytes;
    }
    static BYTES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *BYTES.get_or_init(|| {
        last_level_cache_bytes().map_or(DEFAULT_MIN_BYTES, |b| (b / 2).max(DEFAULT_MIN_BYTES))
    })
}

const DEFAULT_MIN_BYTES: usize = 16 << 20;

/// The size of CPU 0's highest-level cache, from
/// `/sys/devices/system/cpu/cpu0/cache/index*/{level,size}` (`266240K`).
fn last_level_cache_bytes() -> Option<usize> {
    let caches = std::fs::read_dir("/sys/devices/system/cpu/cpu0/cache").ok()?;
    let read = |dir: &std::path::Path, file: &str| std::fs::read_to_string(dir.join(file)).ok();
    caches
        .filter_map(|entry| {
            let dir = entry.ok()?.path();
            let level: u32 = read(&dir, "level")?.trim().parse().ok()?;
            let size = read(&dir, "size")?;
            let size = size.trim();
            let (digits, unit) = size.split_at(size.find(|c: char| !c.is_ascii_digit())?);
            let scale = match unit {
                "K" => 1 << 10,
                "M" => 1 << 20,
                "G" => 1 << 30,
                _ => return None,
            };
            Some((level, digits.parse::<usize>().ok()? * scale))
        })
        .max()
        .map(|(_, bytes)| bytes)
}

#[cfg(test)]
thread_local! {
    static TEST_MIN_BYTES: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
}

/// Runs `f` with [`stream_min_bytes`] at `bytes` on this thread (where the
/// kernels decide), so tests reach the streaming paths at modest sizes.
#[cfg(test)]
pub(crate) fn with_stream_min_bytes<R>(bytes: usize, f: impl FnOnce() -> R) -> R {
    TEST_MIN_BYTES.with(|b| b.set(Some(bytes)));
    let out = f();
    TEST_MIN_BYTES.with(|b| b.set(None));
    out
}

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

/// Asks for the cache lines of `bytes` bytes at `ptr` to be loaded into
/// L2 (not L1): for data wanted a while from now, which would only take
/// L1's room meanwhile. A hint, as [`prefetch`].
#[inline(always)]
pub(crate) fn prefetch_l2(ptr: *const u8, bytes: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
        let mut at = 0;
        while at < bytes {
            // SAFETY: as in `prefetch`: a hint that cannot fault.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(ptr.wrapping_add(at) as *const i8) };
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
    stream_copy_unfenced(dst, src);
    store_fence();
}

/// [`stream_copy`] without the fence: for a kernel that streams many
/// pieces and fences once ([`store_fence`]) before it returns. A fence
/// after each piece would wait for that piece to reach memory each time,
/// instead of letting the stores drain while the next block is computed.
pub(crate) fn stream_copy_unfenced<A: Copy>(dst: &mut [A], src: &[A]) {
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

/// Orders the non-temporal stores made so far before any later store:
/// they are weakly ordered, so a kernel fences them before any other
/// thread may be told the data is there (before it returns).
pub(crate) fn store_fence() {
    #[cfg(all(target_arch = "x86_64", target_feature = "avx"))]
    // SAFETY: sfence has no operands and no preconditions.
    unsafe {
        std::arch::x86_64::_mm_sfence()
    }
}

/// # Safety
/// `dst` and `src` are valid for `n` bytes and do not overlap.
unsafe fn stream_bytes(dst: *mut u8, src: *const u8, n: usize) {
    #[cfg(all(target_arch = "x86_64", target_feature = "avx"))]
    {
        use std::arch::x86_64::{__m256i, _mm256_loadu_si256, _mm256_stream_si256};
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
        prefetch_l2(std::ptr::null(), 4096);
        // The threshold: half a last-level cache, never below 16 MiB.
        assert!(stream_min_bytes() >= DEFAULT_MIN_BYTES);
        assert_eq!(with_stream_min_bytes(1 << 20, stream_min_bytes), 1 << 20);
    }
}
