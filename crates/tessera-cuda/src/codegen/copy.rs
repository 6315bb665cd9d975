//! A strided view copied into a dense buffer a word at a time.
//!
//! The general copy is a pointwise kernel (`Step::Load(0)`): one element
//! per thread, an index decomposition per element. A view whose innermost
//! dim is contiguous (a head split or merge, `[B, T, H, D]` ↔ `[B, H, T,
//! D]`, a slice of the last dim's whole rows) moves whole words instead:
//! 16, 8 or 4 bytes per load and store, one decomposition per word, with
//! the view's dims merged wherever its strides allow. At GPT-2's head merge
//! (bf16 `[8, 1024, 12, 64]`) that is 8 elements a thread.

use tessera::tensor::Layout;

use super::{grid_for, index_type, Launch, Words, ENTRY};

/// The word copy of `src` (elements of `elem_bytes`, storage at `x`) into
/// the dense buffer at `y`, or `None` when no word wider than an element
/// divides the contiguous inner run, every other stride, the offset and
/// both addresses (then the element-wise copy runs).
pub fn dense_copy(src: &Layout, elem_bytes: usize, x: u64, y: u64, sms: u32) -> Option<Launch> {
    let word = word_bytes(src, elem_bytes, x, y)?;
    let (shape, strides) = nontrivial(src);
    let inner = *shape.last()?;
    let per_word = word / elem_bytes;
    // The view in words: the inner dim shrinks, the other strides too.
    let mut dims: Vec<(usize, usize)> = shape
        .iter()
        .zip(&strides)
        .map(|(&n, &s)| (n, s / per_word))
        .collect();
    let last = dims.len() - 1;
    dims[last] = (inner / per_word, 1);
    let dims = merge(&dims);
    let n: usize = dims.iter().map(|d| d.0).product();
    let rank = dims.len();
    let idx = index_type(n);
    let word_type = match word {
        16 => "uint4",
        8 => "uint2",
        _ => "unsigned int",
    };
    let source = format!(
        "struct Args {{ long long n; long long off; long long shape[{rank}]; long long str[{rank}]; const void* x; void* y; }};\n\
         extern \"C\" __global__ void {ENTRY}(Args a) {{\n\
         for ({idx} i = blockIdx.x * blockDim.x + threadIdx.x; i < ({idx})a.n; i += gridDim.x * blockDim.x) {{\n\
         {idx} r = i; long long src = a.off;\n\
         #pragma unroll\n\
         for (int d = {rank} - 1; d > 0; --d) {{ {idx} n = ({idx})a.shape[d]; {idx} q = r / n; src += (long long)(r - q * n) * a.str[d]; r = q; }}\n\
         src += (long long)r * a.str[0];\n\
         (({word_type}*)a.y)[i] = ((const {word_type}*)a.x)[src];\n\
         }}\n}}\n"
    );
    let mut args = Words::default();
    args.int(n as i64)
        .int((src.offset / per_word) as i64)
        .ints(dims.iter().map(|d| d.0 as i64))
        .ints(dims.iter().map(|d| d.1 as i64))
        .ptr(x)
        .ptr(y);
    Some(Launch {
        source,
        args,
        grid: grid_for(n, 256, sms),
        block: 256,
    })
}

/// The word [`dense_copy`] would move (16, 8 or 4 bytes), without
/// generating its source; `None` when no word wider than an element fits.
pub fn word_bytes(src: &Layout, elem_bytes: usize, x: u64, y: u64) -> Option<usize> {
    let (shape, strides) = nontrivial(src);
    let (&inner, &inner_stride) = (shape.last()?, strides.last()?);
    if inner_stride != 1 {
        return None;
    }
    [16usize, 8, 4].into_iter().find(|&w| {
        w > elem_bytes
            && (inner * elem_bytes).is_multiple_of(w)
            && strides[..strides.len() - 1]
                .iter()
                .all(|&s| (s * elem_bytes).is_multiple_of(w))
            && (x as usize + src.offset * elem_bytes).is_multiple_of(w)
            && (y as usize).is_multiple_of(w)
    })
}

/// The dims of size > 1 (at least one), with their strides.
fn nontrivial(layout: &Layout) -> (Vec<usize>, Vec<usize>) {
    let dims: Vec<(usize, usize)> = layout
        .shape
        .iter()
        .zip(&layout.strides)
        .filter(|(&n, _)| n != 1)
        .map(|(&n, &s)| (n, s))
        .collect();
    match dims.is_empty() {
        true => (vec![1], vec![1]),
        false => dims.into_iter().unzip(),
    }
}

/// Neighbouring dims merged where the outer one's stride is the inner
/// one's whole extent (row-major order kept, so the dense output's index
/// is unchanged).
fn merge(dims: &[(usize, usize)]) -> Vec<(usize, usize)> {
    let mut out: Vec<(usize, usize)> = Vec::with_capacity(dims.len());
    for &(n, s) in dims {
        match out.last_mut() {
            Some((pn, ps)) if *ps == s * n => {
                *pn *= n;
                *ps = s;
            }
            _ => out.push((n, s)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The head merge of GPT-2 in bf16: `[B, H, T, D]` permuted to
    /// `[B, T, H, D]` moves 16-byte words, 8 elements each.
    #[test]
    fn a_head_merge_moves_16_byte_words() {
        let heads = Layout::contiguous(&[8, 12, 1024, 64]).permuted(&[0, 2, 1, 3]);
        let launch = dense_copy(&heads, 2, 256, 512, 132).expect("a word copy");
        assert!(launch.source.contains("uint4"), "{}", launch.source);
        // n, off, then shape [8, 1024, 12, 8] and strides in words.
        let w = &launch.args.0;
        assert_eq!(w[0], 8 * 1024 * 12 * 8);
        assert_eq!(&w[2..6], &[8, 1024, 12, 8]);
        assert_eq!(&w[6..10], &[12 * 1024 * 8, 8, 1024 * 8, 1]);
    }

    #[test]
    fn mergeable_dims_merge_and_narrow_runs_take_narrow_words() {
        // A slice of whole rows: one dim after merging.
        let rows = Layout::contiguous(&[64, 32]);
        let launch = dense_copy(&rows, 4, 0, 0, 132).expect("a word copy");
        assert!(launch.source.contains("shape[1]"), "{}", launch.source);
        // Inner runs of 2 f32: 8-byte words.
        let pairs = Layout::contiguous(&[10, 6]).sliced(1, 0, 2, 1);
        let launch = dense_copy(&pairs, 4, 0, 0, 132).expect("a word copy");
        assert!(launch.source.contains("uint2"), "{}", launch.source);
    }

    #[test]
    fn no_word_copy_without_a_contiguous_aligned_inner_run() {
        // A transpose: the inner dim is strided.
        let t = Layout::contiguous(&[64, 64]).permuted(&[1, 0]);
        assert!(dense_copy(&t, 4, 0, 0, 132).is_none());
        // Odd runs of f32 (3 × 4 bytes) fit no word.
        let odd = Layout::contiguous(&[10, 7]).sliced(1, 0, 3, 1);
        assert!(dense_copy(&odd, 4, 0, 0, 132).is_none());
        // A misaligned address.
        let rows = Layout::contiguous(&[64, 32]);
        assert!(dense_copy(&rows, 4, 2, 0, 132).is_none());
        // f64: a 16-byte word is 2 elements; an 8-byte one is no gain.
        let d = Layout::contiguous(&[10, 8]).permuted(&[0, 1]);
        assert!(dense_copy(&d, 8, 0, 0, 132).is_some());
    }
}
