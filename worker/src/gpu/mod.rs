//! GPU preparation and staging (feature `cuda`): NVRTC kernels bit-identical to the CPU
//! kernels, device staging filled by async H2D copies from pinned host memory, and GPU source
//! memory (owned, or mapped from a CUDA IPC handle exported by the training process).
//!
//! Why run-time compilation and dynamic loading: the worker binary must build and run on
//! machines without CUDA (this crate compiles with `--features cuda` anywhere). Before any
//! cudarc call, [`GpuDevice::open`] checks that the driver and NVRTC libraries can be loaded
//! and returns [`GpuError::NoDriver`] / [`GpuError::NoNvrtc`] otherwise: cudarc itself panics
//! when a library is missing, so that check is what keeps a CPU-only host from crashing.
//!
//! # Layout
//! - [`device`]: [`GpuDevice`] (context, stream, compiled kernels) and the kernel launches.
//! - [`staging`]: pinned host staging and device staging with async H2D copies.
//! - [`source`]: [`GpuSource`], the trainer's arena in device memory or behind an IPC handle.
//! - `kernels.cu`: the CUDA source, mirroring `prepare::convert` step for step.

pub mod device;
pub mod source;
pub mod staging;

#[cfg(test)]
mod check;

pub use device::GpuDevice;
pub use source::{GpuSource, IpcMapping};
pub use staging::{DeviceStaging, PinnedStaging};

use crate::prepare::PrepareError;

/// Why a GPU operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GpuError {
    /// The CUDA driver library (libcuda) cannot be loaded on this machine.
    #[error("no CUDA driver library (libcuda.so) can be loaded on this machine")]
    NoDriver,
    /// The NVRTC library cannot be loaded (the kernels are compiled at run time).
    #[error(
        "no NVRTC library (libnvrtc.so) can be loaded; the GPU kernels are compiled at run time"
    )]
    NoNvrtc,
    /// A driver call failed.
    #[error("cuda driver: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
    /// NVRTC rejected the kernels.
    #[error("nvrtc: {0}")]
    Compile(String),
    /// Lengths, shapes or dtypes do not fit (checked before any launch).
    #[error(transparent)]
    Prepare(#[from] PrepareError),
    /// A range outside a device buffer or mapping.
    #[error("{what}: range {offset}+{len} outside {have} bytes")]
    OutOfBounds {
        /// Which buffer.
        what: &'static str,
        /// Start.
        offset: usize,
        /// Length.
        len: usize,
        /// Buffer size.
        have: usize,
    },
}

/// Whether the CUDA driver library can be loaded.
pub fn driver_present() -> bool {
    // SAFETY: `is_culib_present` only tries `dlopen` on the candidate library names and
    // drops what it opened; it calls no CUDA function.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Whether the NVRTC library can be loaded.
pub fn nvrtc_present() -> bool {
    // SAFETY: as for `driver_present`: `dlopen` attempts only.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn open_is_a_clean_error_without_a_driver_and_works_with_one() {
        match GpuDevice::open(0) {
            Err(GpuError::NoDriver) => assert!(!driver_present()),
            Err(GpuError::NoNvrtc) => assert!(driver_present() && !nvrtc_present()),
            Err(e) => {
                // A driver without a usable device (e.g. no GPU in a container) is also an
                // error, never a panic.
                assert!(driver_present(), "unexpected error without a driver: {e}");
            }
            Ok(dev) => {
                assert!(driver_present() && nvrtc_present());
                let buf = dev.upload(&[1, 2, 3]).unwrap();
                assert_eq!(dev.download(&buf).unwrap(), vec![1, 2, 3]);
            }
        }
    }
}
