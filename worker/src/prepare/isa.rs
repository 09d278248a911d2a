//! Run-time instruction-set selection for the kernels.
//!
//! Why: Rust's portable x86-64 target is SSE2, and the branch-free conversion loops run 2-3x
//! faster when LLVM may use AVX2 or AVX-512 (wider lanes, signed 32-bit min/compare, one-step
//! narrowing stores). The kernels are written once, as plain Rust, as a [`Kernel`] whose `run`
//! is `#[inline(always)]`; [`vectorised`] calls it inside a function compiled with the best
//! feature set this CPU has, so the whole loop is inlined and vectorised for that ISA. (A
//! closure would not do: LLVM declines to inline a large closure, which then stays SSE2.)
//! Call it at the leaf of the work (inside a rayon task, not around one).
//!
//! Where plain Rust does not vectorise well enough (the fp8 quantiser: a per-lane select
//! between two rounding paths, a 32-to-8-bit narrowing store), a kernel may also supply
//! hand-written AVX-512 or AVX2 code through [`Kernel::run_avx512`] / [`Kernel::run_avx2`]; the
//! [`Avx512`] and [`Avx2`] tokens they receive can only be made here, after the CPU was checked,
//! which is what makes those intrinsics sound.

/// One piece of kernel work. Implementations must mark `run` `#[inline(always)]`.
pub(crate) trait Kernel {
    /// What the work returns.
    type Out;
    /// Does the work.
    fn run(self) -> Self::Out;
    /// Does the work on a CPU with AVX-512 (F, BW, VL): the plain `run` unless overridden.
    #[inline(always)]
    fn run_avx512(self, _isa: Avx512) -> Self::Out
    where
        Self: Sized,
    {
        self.run()
    }
    /// Does the work on a CPU with AVX2 and F16C but not AVX-512: the plain `run` (compiled
    /// for AVX2) unless overridden.
    #[inline(always)]
    fn run_avx2(self, _isa: Avx2) -> Self::Out
    where
        Self: Sized,
    {
        self.run()
    }
}

/// Proof that this CPU has AVX2 and F16C: only [`vectorised`] (and, in tests, [`with_avx2`])
/// makes one, after checking.
#[derive(Debug, Clone, Copy)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) struct Avx2 {
    _checked: (),
}

/// Proof that this CPU has AVX-512 F, BW and VL (and AVX2): only [`vectorised`] makes one,
/// after checking.
#[derive(Debug, Clone, Copy)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) struct Avx512 {
    _checked: (),
}

#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn has_avx512() -> bool {
    use std::arch::is_x86_feature_detected as has;
    has!("avx512f") && has!("avx512bw") && has!("avx512vl") && has!("avx2")
}

/// Runs `f` compiled for the widest vector ISA the CPU supports.
#[inline(always)]
pub(crate) fn vectorised<K: Kernel>(k: K) -> K::Out {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        if has_avx512() {
            // SAFETY: `avx512` only enables features that were detected on this CPU just above.
            return unsafe { avx512(k) };
        }
        if has!("avx2") && has!("f16c") {
            // SAFETY: `avx2_f16c` only enables features that were detected on this CPU just
            // above.
            return unsafe { avx2_f16c(k) };
        }
        if has!("avx2") {
            // SAFETY: `avx2` only enables a feature that was detected on this CPU just above.
            return unsafe { avx2(k) };
        }
    }
    k.run()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
fn avx512<K: Kernel>(k: K) -> K::Out {
    k.run_avx512(Avx512 { _checked: () })
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
fn avx2_f16c<K: Kernel>(k: K) -> K::Out {
    k.run_avx2(Avx2 { _checked: () })
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn avx2<K: Kernel>(k: K) -> K::Out {
    k.run()
}

/// Whether [`with_avx2`] runs anything on this CPU.
#[cfg(test)]
pub(crate) fn avx2_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        has!("avx2") && has!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Runs `k` through its AVX2 code even on a CPU that also has AVX-512 (so tests cover the AVX2
/// path wherever they run); `None` when the CPU lacks AVX2 or F16C.
#[cfg(test)]
pub(crate) fn with_avx2<K: Kernel>(k: K) -> Option<K::Out> {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        if has!("avx2") && has!("f16c") {
            // SAFETY: `avx2_f16c` only enables features that were detected just above.
            return Some(unsafe { avx2_f16c(k) });
        }
    }
    let _ = k;
    None
}
