//! Strided layouts: how an array's logical indices map into its storage.
//!
//! The size arithmetic here (strides, offsets, element counts) is
//! unchecked: every shape a layout is made for is within the size limit
//! ([`crate::limits`]), checked where it entered (op inference, tensor
//! creation, file readers), and a layout that a tensor is built over is
//! checked once to stay inside its storage ([`Layout::fits`]). Within
//! those bounds none of these products and sums can overflow.

/// Shape, strides (in elements) and offset into the storage. Strides may be
/// zero (expanded dims); they are never negative.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    pub shape: Vec<usize>,
    pub strides: Vec<usize>,
    pub offset: usize,
}

/// Row-major strides of `shape` (saturating: a shape past the size limit,
/// which no tensor has, gets strides that [`Layout::fits`] refuses rather
/// than wrapped ones).
pub fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![0; shape.len()];
    let mut acc: usize = 1;
    for i in (0..shape.len()).rev() {
        strides[i] = acc;
        acc = acc.saturating_mul(shape[i]);
    }
    strides
}

impl Layout {
    pub fn contiguous(shape: &[usize]) -> Layout {
        Layout {
            shape: shape.to_vec(),
            strides: contiguous_strides(shape),
            offset: 0,
        }
    }

    pub fn rank(&self) -> usize {
        self.shape.len()
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Whether every element's storage offset is below `storage_numel`
    /// (and the shape within the size limit), computed in checked
    /// arithmetic: what makes reading the tensor through this layout safe.
    pub fn fits(&self, storage_numel: usize) -> bool {
        if self.shape.len() != self.strides.len() || crate::limits::extent(&self.shape).is_none() {
            return false;
        }
        if self.shape.contains(&0) {
            return true;
        }
        let last = self
            .shape
            .iter()
            .zip(&self.strides)
            .try_fold(self.offset, |acc, (&n, &s)| {
                acc.checked_add((n - 1).checked_mul(s)?)
            });
        matches!(last, Some(last) if last < storage_numel)
    }

    /// Row-major and dense: element i lives at `offset + i`. Size-1 dims may
    /// have any stride.
    pub fn is_contiguous(&self) -> bool {
        let mut expected = 1;
        for i in (0..self.rank()).rev() {
            if self.shape[i] != 1 && self.strides[i] != expected {
                return false;
            }
            expected *= self.shape[i];
        }
        true
    }

    /// The storage range `offset..offset+numel` when contiguous.
    pub fn contiguous_range(&self) -> Option<std::ops::Range<usize>> {
        self.is_contiguous()
            .then(|| self.offset..self.offset + self.numel())
    }

    pub fn permuted(&self, perm: &[usize]) -> Layout {
        Layout {
            shape: perm.iter().map(|&p| self.shape[p]).collect(),
            strides: perm.iter().map(|&p| self.strides[p]).collect(),
            offset: self.offset,
        }
    }

    /// Broadcast to `shape` (right-aligned; stretched dims get stride 0).
    pub fn expanded(&self, shape: &[usize]) -> Layout {
        let lead = shape.len() - self.rank();
        let strides = (0..shape.len())
            .map(|i| {
                if i < lead || self.shape[i - lead] != shape[i] {
                    0
                } else {
                    self.strides[i - lead]
                }
            })
            .collect();
        Layout {
            shape: shape.to_vec(),
            strides,
            offset: self.offset,
        }
    }

    pub fn sliced(&self, dim: usize, start: usize, len: usize, step: usize) -> Layout {
        let mut out = self.clone();
        if len > 0 {
            out.offset += start * self.strides[dim];
        }
        out.shape[dim] = len;
        out.strides[dim] *= step;
        out
    }

    /// A view with `shape` over the same elements, if the strides allow one
    /// without copying (always for contiguous layouts).
    pub fn reshaped(&self, shape: &[usize]) -> Option<Layout> {
        if self.is_contiguous() {
            return Some(Layout {
                shape: shape.to_vec(),
                strides: contiguous_strides(shape),
                offset: self.offset,
            });
        }
        // Dropping or adding size-1 dims keeps a view of any layout.
        let old: Vec<(usize, usize)> = self
            .shape
            .iter()
            .zip(&self.strides)
            .filter(|(s, _)| **s != 1)
            .map(|(a, b)| (*a, *b))
            .collect();
        let new_non_one: Vec<usize> = shape.iter().copied().filter(|&s| s != 1).collect();
        if old.iter().map(|(s, _)| *s).eq(new_non_one.iter().copied()) {
            let mut it = old.iter();
            let strides = shape
                .iter()
                .map(|&s| if s == 1 { 0 } else { it.next().unwrap().1 })
                .collect();
            return Some(Layout {
                shape: shape.to_vec(),
                strides,
                offset: self.offset,
            });
        }
        None
    }

    /// The storage offset of each element in row-major order, visited in
    /// runs along the last dim: `f(start_offset, stride, len)`.
    pub fn for_each_run(&self, mut f: impl FnMut(usize, usize, usize)) {
        let numel = self.numel();
        if numel == 0 {
            return;
        }
        if self.rank() == 0 {
            f(self.offset, 1, 1);
            return;
        }
        let last = self.rank() - 1;
        let (len, stride) = (self.shape[last], self.strides[last]);
        let mut index = vec![0usize; last];
        let mut base = self.offset;
        for _ in 0..numel / len {
            f(base, stride, len);
            for d in (0..last).rev() {
                index[d] += 1;
                base += self.strides[d];
                if index[d] < self.shape[d] {
                    break;
                }
                base -= self.strides[d] * self.shape[d];
                index[d] = 0;
            }
        }
    }

    /// The storage offset of the `i`-th element in row-major order.
    pub fn offset_of(&self, mut i: usize) -> usize {
        let mut off = self.offset;
        for d in (0..self.rank()).rev() {
            let s = self.shape[d];
            off += (i % s) * self.strides[d];
            i /= s;
        }
        off
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn views_and_runs() {
        let l = Layout::contiguous(&[2, 3]);
        assert!(l.is_contiguous());
        let t = l.permuted(&[1, 0]);
        assert!(!t.is_contiguous());
        let mut offs = Vec::new();
        t.for_each_run(|start, stride, len| offs.extend((0..len).map(|i| start + i * stride)));
        assert_eq!(offs, vec![0, 3, 1, 4, 2, 5]);
        assert_eq!((0..6).map(|i| t.offset_of(i)).collect::<Vec<_>>(), offs);
        assert!(t.reshaped(&[6]).is_none());
        assert_eq!(t.reshaped(&[3, 1, 2]).unwrap().strides, vec![1, 0, 3]);
        let e = Layout::contiguous(&[3, 1]).expanded(&[2, 3, 4]);
        assert_eq!(e.strides, vec![0, 1, 0]);
    }

    #[test]
    fn fits_checks_the_last_element_without_overflowing() {
        let l = Layout::contiguous(&[2, 3]);
        assert!(l.fits(6) && !l.fits(5));
        assert!(l.sliced(1, 1, 2, 1).fits(6));
        assert!(Layout::contiguous(&[0, 3]).fits(0));
        let huge = Layout {
            shape: vec![2, 2],
            strides: vec![usize::MAX / 2, 1],
            offset: usize::MAX / 2,
        };
        assert!(!huge.fits(usize::MAX));
        assert!(!Layout::contiguous(&[1 << 40, 1 << 40]).fits(usize::MAX));
        let ragged = Layout {
            shape: vec![2],
            strides: vec![],
            offset: 0,
        };
        assert!(!ragged.fits(8));
    }
}
