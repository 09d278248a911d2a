//! GPU preparation and staging (feature `cuda`): NVRTC kernels bit-identical to the CPU
//! kernels, pinned host and device staging with async copies, and GPU source memory (owned,
//! mapped from a CUDA IPC handle exported by the training process, or borrowed from it).
//!
//! Why run-time compilation and dynamic loading: the worker binary must build and run on
//! machines without CUDA (this crate compiles with `--features cuda` anywhere). Every entry point
//! goes through [`GpuDevice::open`], which checks that the driver library can be loaded before
//! any cudarc call and returns [`GpuError::NoDriver`] otherwise (cudarc itself panics when a
//! library is missing). NVRTC is needed only for the kernels: it is looked for (its own loader,
//! [`nvrtc`]) when a kernel is first launched, and a miss is [`GpuError::NoNvrtc`]; pinned
//! staging, copies and IPC work without it.
//!
//! The trainer pipeline uses two streams per device source (review G6): the source-to-staging
//! copies on a copy stream, the preparation (device-to-device input copy, kernel, D2H of the
//! result) on the device's stream; each lease's work ends with an event of its own that the
//! stage waits on, never a whole-stream or whole-buffer wait (see [`device_source`]).
//!
//! # Layout
//! - [`device`]: [`GpuDevice`] (context, stream, lazily compiled kernels) and the launches.
//! - [`kernels`]: the CUDA source, its build options and geometry, the compiled-image cache.
//! - [`nvrtc`]: finding and calling NVRTC; choosing cubin or PTX for the device.
//! - [`staging`]: pinned host staging and device staging with async copies of ranges.
//! - `pending`: events of queued copies that memory must outlive.
//! - [`source`]: [`GpuSource`], the trainer's arena in device memory, and [`IpcExport`].
//! - [`device_source`]: [`DeviceSource`], a [`GpuSource`] as a trainer source: the pipeline's
//!   fill (strided D2H into the pinned lease) and prepare (NVRTC kernels, then D2H) steps.
//! - [`device_destination`]: [`DeviceDestination`], a receiver's regions as pinned bounce
//!   buffers copied to device memory before a version counts as landed (TCP).
//! - [`staged_device`]: [`StagedDeviceRegions`], an engine's CUDA tensors planned into host
//!   staging regions and bound as a [`DeviceDestination`] (the embedded engine's device path).
//! - [`host_pin`]: [`PinnedRegion`], a fabric registration page-locked for DMA.
//! - `dma`: the raw async copies those use.
//! - `kernels.cu`: the CUDA source, mirroring `prepare::convert` step for step.
//! - `check/` (tests): the device checks `worker/gpu-check.sh` runs on a GPU machine.

pub mod device;
pub mod device_destination;
pub mod device_source;
mod dma;
pub mod host_pin;
pub mod kernels;
pub mod nvrtc;
mod pending;
pub mod source;
pub mod staged_device;
pub mod staging;

#[cfg(test)]
mod check;

pub use device::{DeviceInfo, E4m3Conversion, GpuDevice, SelftestReport};
pub use device_destination::DeviceDestination;
pub use device_source::DeviceSource;
pub use host_pin::PinnedRegion;
pub use source::{
    BorrowedDevice, DeviceMemory, GpuSource, IPC_HANDLE_BYTES, IpcExport, IpcMapping,
};
pub use staged_device::StagedDeviceRegions;
pub use staging::{DeviceStaging, PinnedStaging};

use crate::prepare::PrepareError;

/// Why a GPU operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GpuError {
    /// The CUDA driver library (libcuda) cannot be loaded on this machine.
    #[error("no CUDA driver library (libcuda.so) can be loaded on this machine")]
    NoDriver,
    /// No NVRTC library can be loaded (the kernels are compiled at run time).
    #[error(
        "no NVRTC library can be loaded (the GPU kernels are compiled at run time); looked for: \
         {searched}{}; set {} to a libnvrtc.so.12 or .13 (e.g. the nvidia-cuda-nvrtc wheel's)",
        if errors.is_empty() { String::new() } else { format!(" ({errors})") },
        nvrtc::NVRTC_ENV
    )]
    NoNvrtc {
        /// Every name and path tried, in order.
        searched: String,
        /// Why the ones that exist did not load.
        errors: String,
    },
    /// NVRTC can target neither this GPU nor any older architecture.
    #[error("NVRTC cannot compile for sm_{arch} (it supports {supported:?}); use an older CUDA")]
    UnsupportedArch {
        /// The device's compute capability, 10 * major + minor.
        arch: u32,
        /// What the NVRTC supports.
        supported: Vec<u32>,
    },
    /// NVRTC rejected the kernels.
    #[error("{nvrtc} failed to compile {name}: {log}")]
    Compile {
        /// The program's name.
        name: String,
        /// Which NVRTC (version and path).
        nvrtc: String,
        /// NVRTC's log.
        log: String,
    },
    /// The driver refused the compiled kernels.
    #[error("the driver could not load {what}: {source}")]
    Load {
        /// What was loaded (target and NVRTC).
        what: String,
        /// The driver's error.
        source: cudarc::driver::DriverError,
    },
    /// A driver call failed.
    #[error("cuda driver: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
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
    /// A device address not aligned as the kernel reads or writes it.
    #[error("{what} at device address {addr:#x} is not {align}-byte aligned")]
    Misaligned {
        /// Which buffer.
        what: &'static str,
        /// Its address.
        addr: u64,
        /// The alignment required.
        align: u64,
    },
    /// A buffer of another context (another GPU, or another context on it).
    #[error("{what} belongs to another CUDA context than the device it was used with")]
    WrongContext {
        /// Which buffer.
        what: &'static str,
    },
    /// Memory that must be host memory is not (e.g. a device region handed to page-locking).
    #[error("{what} is not host memory")]
    NotHostMemory {
        /// Which memory.
        what: &'static str,
    },
    /// The driver refused to page-lock host memory (`cuMemHostRegister`).
    #[error("page-locking {len} bytes of host staging with the CUDA driver failed: {source}")]
    PinHost {
        /// Bytes.
        len: usize,
        /// The driver's error.
        source: cudarc::driver::DriverError,
    },
    /// Device tensors of one destination on more than one GPU.
    #[error(
        "device destinations on cuda:{first} and cuda:{other}: register the tensors of one GPU \
         per engine rank"
    )]
    MixedDevices {
        /// The first tensor's GPU.
        first: usize,
        /// Another tensor's.
        other: usize,
    },
    /// Device tensors that cannot be merged into staged regions.
    #[error(transparent)]
    DevicePlan(#[from] crate::DevicePlanError),
    /// The hardware e4m3 conversion was asked for where it is not known to be exact.
    #[error("the hardware e4m3 conversion is not usable here: {0}")]
    HardwareConversion(String),
}

/// Whether the CUDA driver library can be loaded.
pub fn driver_present() -> bool {
    // SAFETY: `is_culib_present` only tries `dlopen` on the candidate library names and
    // drops what it opened; it calls no CUDA function.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

#[cfg(test)]
mod tests {
    use cudarc::driver::CudaSlice;

    use super::*;

    /// The device, or None after checking that the failure is the clean one for this machine.
    fn device_or_clean_error() -> Option<GpuDevice> {
        match GpuDevice::open(0) {
            Err(GpuError::NoDriver) => {
                assert!(!driver_present());
                None
            }
            Err(e) => {
                // A driver without a usable device (a container without a GPU) is an error
                // too, never a panic.
                assert!(driver_present(), "unexpected error without a driver: {e}");
                None
            }
            Ok(dev) => {
                assert!(driver_present());
                Some(dev)
            }
        }
    }

    #[test]
    fn open_is_a_clean_error_without_a_driver_and_works_with_one() {
        if let Some(dev) = device_or_clean_error() {
            let buf = dev.upload(&[1, 2, 3]).unwrap();
            assert_eq!(dev.download(&buf).unwrap(), vec![1, 2, 3]);
            assert!(dev.info().arch >= 50, "{:?}", dev.info());
        }
    }

    #[test]
    fn every_entry_point_is_reached_through_a_checked_open() {
        // Without a driver nothing below `open` can be called at all; with one, each entry point
        // must answer (an error naming what is missing, e.g. NoNvrtc, is fine) rather than panic.
        let Some(dev) = device_or_clean_error() else {
            assert!(matches!(GpuDevice::open(1), Err(GpuError::NoDriver)));
            assert!(matches!(GpuDevice::count(), Err(GpuError::NoDriver)));
            return;
        };
        let _ = dev.kernel_image();
        let _ = dev.fp8_conversion();
        let src: CudaSlice<u8> = dev.upload(&[0u8; 64]).unwrap();
        let mut dst = dev.alloc(128).unwrap();
        let _ = dev.cast(
            &src,
            weightsync_common::DType::BF16,
            &mut dst,
            weightsync_common::DType::F32,
        );
        let _ = PinnedStaging::new(&dev, 16);
        let _ = IpcExport::new(&dev, 16);
        assert!(GpuDevice::count().unwrap() >= 1);
    }
}
