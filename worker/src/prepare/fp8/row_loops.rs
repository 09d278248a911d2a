//! What the hand-written row loops ([`super::avx2`], [`super::avx512`]) share: how a segment's
//! elements become f32 lanes, the prefetch hint, and the two ways a CPU token implements
//! [`RowOps`](super::RowOps): with its own intrinsics on x86-64, or (elsewhere, where the token
//! is never made) by handing every call to the portable loops so the code still type-checks.

/// How a segment's elements become f32 lanes (the loops' const generic).
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Widen {
    Bf16,
    F16,
    F32,
}

/// Prefetches, into L2, the cache lines `ahead` bytes past those of `seg`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) fn prefetch_lines(seg: &[u8], ahead: usize) {
    use std::arch::x86_64::{_MM_HINT_T1, _mm_prefetch};
    let p = seg.as_ptr().wrapping_add(ahead);
    for off in (0..seg.len()).step_by(64) {
        // SAFETY: a prefetch is a hint: it neither faults nor reads memory as far as the
        // program is concerned, whatever the address (computed without `add`, so no
        // out-of-bounds pointer arithmetic is claimed either).
        unsafe { _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(off).cast()) };
    }
}

/// `RowOps<E>` for a CPU token on an architecture that never makes it: the portable loops.
macro_rules! portable_stand_in {
    ($token:ty) => {
        #[cfg(not(target_arch = "x86_64"))]
        impl<E: super::Elem> super::RowOps<E> for $token {
            type Acc = <super::Portable as super::RowOps<E>>::Acc;
            fn acc_new(self) -> Self::Acc {
                super::Portable.acc_new()
            }
            fn acc_row(self, acc: Self::Acc, seg: &[u8]) -> Self::Acc {
                super::Portable.acc_row(acc, seg)
            }
            fn acc_key(self, acc: Self::Acc) -> E::Key {
                super::Portable.acc_key(acc)
            }
            fn quantise(self, seg: &[u8], inv: f32, out: &mut [u8]) {
                super::Portable.quantise(seg, inv, out)
            }
        }
    };
}
pub(super) use portable_stand_in;

/// `RowOps<$elem>` for the CPU token `$token` with a running-max vector of type `$acc`, from
/// the invoking module's `zero`, `$max`, `$reduce` and `quantise_row::<W>` (each a
/// `#[target_feature]` function of the features the token proves).
#[cfg(target_arch = "x86_64")]
macro_rules! row_ops {
    ($token:ty, $acc:ty, $elem:ty, $widen:expr_2021, $max:ident, $limit:expr_2021, $reduce:ident) => {
        impl RowOps<$elem> for $token {
            type Acc = $acc;
            #[inline(always)]
            fn acc_new(self) -> $acc {
                // SAFETY: the token exists only on a CPU with the features `zero` enables.
                unsafe { zero() }
            }
            #[inline(always)]
            fn acc_row(self, acc: $acc, seg: &[u8]) -> $acc {
                // SAFETY: the token exists only on a CPU with the features `$max` enables.
                unsafe { $max(acc, seg, $limit) }
            }
            #[inline(always)]
            fn acc_key(self, acc: $acc) -> <$elem as Elem>::Key {
                // SAFETY: the token exists only on a CPU with the features `$reduce` enables.
                unsafe { $reduce(acc) }
            }
            #[inline(always)]
            fn quantise(self, seg: &[u8], inv: f32, out: &mut [u8]) {
                // SAFETY: the token exists only on a CPU with the features `quantise_row`
                // enables.
                unsafe { quantise_row::<{ $widen as u8 }>(seg, inv, out) }
            }
            #[inline(always)]
            fn prefetch(self, seg: &[u8], ahead: usize) {
                super::super::row_loops::prefetch_lines(seg, ahead)
            }
        }
    };
}
#[cfg(target_arch = "x86_64")]
pub(super) use row_ops;
