//! Foreign tensors: the memory of a Python object (a torch tensor, a DLPack producer, anything
//! with the buffer protocol), described and kept alive for as long as weightsync reads or
//! writes it.
//!
//! Why one module: learning a raw address from a foreign object and handing it to the fabric is
//! the only `unsafe` of this crate. [`ForeignTensor`] is the safe owning type around it: it can
//! only be built from a live Python object, holds a strong reference to that object and to the
//! export that pins its memory (the DLPack capsule, left unconsumed so the producer's deleter
//! runs when we drop it; or the `Py_buffer`, whose export stops a `bytearray` from resizing),
//! and checks before it says anything that the bytes it names lie inside the object's own
//! allocation (torch: the untyped storage; DLPack and buffers: the exporter's extent).
//!
//! The ways in, tried in this order, none of which imports torch:
//! 1. torch tensors (`data_ptr`, `untyped_storage`): parameters require grad, and torch refuses
//!    to export those through DLPack, so they are read through their methods. A `DTensor` is
//!    replaced by its `to_local()` shard. A CUDA tensor (a trainer's source only) is described
//!    the same way, with its device index: registering it needs the extension built with the
//!    `cuda` feature (the trainer then reads it by DMA), and is refused by name otherwise. As an
//!    engine's destination a CUDA tensor (torch, DLPack `kDLCUDA`, `__cuda_array_interface__`)
//!    is refused by name, saying whether the build lacks `cuda` or the embedded engine does not
//!    take device destinations yet.
//! 2. `__dlpack__` (versioned capsule first, then the legacy one): numpy, jax, cupy, ...
//! 3. the buffer protocol: numpy, `bytearray`, `memoryview`, `mmap`.
//!
//! What stays the caller's duty (said in the package docs): not to free or move a tensor's
//! storage behind weightsync's back by other means than dropping it (e.g. torch's
//! `untyped_storage().resize_(0)`). Moves by re-assignment (`p.data = ...`) are caught by name
//! before each sync (the Python layer compares `data_ptr()`), and the old storage stays alive
//! here, so a stale tensor is never freed memory.

use std::ffi::c_void;

use pyo3::buffer::PyUntypedBuffer;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyCapsule, PyCapsuleMethods, PyDict};
use weightsync_agent::embed::HostMemory;
use weightsync_common::DType;

/// What the memory will be used for: sources are only read, destinations are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Access {
    /// A trainer reads it.
    Read,
    /// An engine's tensor: weightsync writes into it.
    Write,
}

/// The export that pins an object's memory while weightsync holds it.
enum Export {
    /// A DLPack capsule, not consumed: dropping it runs the producer's deleter.
    Capsule(#[allow(dead_code)] Py<PyCapsule>),
    /// A buffer-protocol export (`PyBuffer_Release` on drop).
    Buffer(#[allow(dead_code)] PyUntypedBuffer),
}

/// Everything that keeps a foreign tensor's bytes valid: the object itself, the tensor that
/// owns the memory (a `DTensor`'s local shard) and the export. Moved into the fabric's
/// registration as its keep-alive.
struct Keepalive {
    _object: Py<PyAny>,
    _owner: Option<Py<PyAny>>,
    _export: Option<Export>,
}

/// The bytes of one Python tensor-like object, kept alive by a reference to it.
pub(crate) struct ForeignTensor {
    ptr: usize,
    len: usize,
    dtype: DType,
    shape: Vec<u64>,
    kind: &'static str,
    /// The CUDA device index of a tensor in GPU memory (`None`: host memory).
    cuda: Option<usize>,
    keepalive: Keepalive,
}

impl std::fmt::Debug for ForeignTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ForeignTensor")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .field("dtype", &self.dtype)
            .field("shape", &self.shape)
            .field("kind", &self.kind)
            .field("cuda", &self.cuda)
            .finish()
    }
}

impl ForeignTensor {
    /// Reads `obj`'s memory. `dtype` reinterprets the elements (same element size; e.g. a numpy
    /// `uint16` array holding bf16 bits); `None` takes the object's own dtype.
    pub(crate) fn from_object(
        obj: &Bound<'_, PyAny>,
        dtype: Option<DType>,
        access: Access,
    ) -> PyResult<ForeignTensor> {
        let found = if is_torch_tensor(obj)? {
            from_torch(obj, access)?
        } else if access == Access::Write && obj.hasattr("__cuda_array_interface__")? {
            // numba, cupy, ...: device memory by definition.
            return Err(cuda_destination_refused(None));
        } else if obj.hasattr("__dlpack__")? {
            from_dlpack(obj, access)?
        } else {
            from_buffer(obj, access)?
        };
        found.resolve(dtype)
    }

    /// Start address.
    pub(crate) fn ptr(&self) -> usize {
        self.ptr
    }

    /// Bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Element type.
    pub(crate) fn dtype(&self) -> DType {
        self.dtype
    }

    /// Logical shape.
    pub(crate) fn shape(&self) -> &[u64] {
        &self.shape
    }

    /// How the memory was found: `torch`, `torch-cuda`, `dlpack` or `buffer`.
    pub(crate) fn kind(&self) -> &'static str {
        self.kind
    }

    /// The CUDA device index of a tensor in GPU memory (`None`: host memory).
    pub(crate) fn cuda(&self) -> Option<usize> {
        self.cuda
    }

    /// Hands the memory of a CUDA tensor to weightsync, with everything that keeps it alive.
    #[cfg(feature = "cuda")]
    pub(crate) fn into_device_memory(self) -> PyResult<weightsync_agent::embed::DeviceMemory> {
        let ForeignTensor {
            ptr,
            len,
            cuda,
            keepalive,
            ..
        } = self;
        let ordinal = cuda.ok_or_else(|| PyValueError::new_err("not a CUDA tensor"))?;
        // SAFETY: `ptr..ptr+len` was checked to lie inside the tensor's CUDA storage on device
        // `ordinal` when this value was built, and `keepalive` holds the tensor and its owner,
        // so the storage stays allocated until the DeviceMemory (and its keepalive) is dropped.
        // The Python layer synchronises the device before each push, so no write by torch is
        // still in flight when a sync reads it, and the caller does not step the optimizer
        // until the sync ended.
        Ok(unsafe {
            weightsync_agent::embed::DeviceMemory::from_raw(
                ordinal,
                ptr as u64,
                len,
                Box::new(keepalive),
            )
        })
    }

    /// Hands the memory to weightsync, with everything that keeps it alive (host memory only:
    /// a CUDA tensor is refused).
    pub(crate) fn into_host_memory(self) -> PyResult<HostMemory> {
        if let Some(d) = self.cuda {
            return Err(PyValueError::new_err(format!(
                "a tensor on cuda:{d} where host memory is needed"
            )));
        }
        let ForeignTensor {
            ptr,
            len,
            keepalive,
            ..
        } = self;
        // SAFETY: `ptr..ptr+len` was checked to lie inside the object's own allocation (the
        // torch storage, the DLPack tensor or the exported buffer) when this value was built,
        // `Access::Write` objects were checked writable, and `keepalive` holds the object, the
        // tensor owning the memory and the export that pins it, so the bytes stay valid until
        // the HostMemory (and with it the keepalive) is dropped. Moves by re-assignment keep
        // the old storage alive through the same references.
        Ok(unsafe { HostMemory::from_raw(ptr as *mut u8, len, Box::new(keepalive)) })
    }
}

/// A tensor as found, before its dtype is settled: its own element type may be one weightsync
/// does not know (a numpy `uint16` array holding bf16 bits), usable with an explicit dtype.
struct Found {
    tensor: ForeignTensor,
    own_dtype: Result<DType, String>,
    item_size: u64,
}

impl Found {
    fn resolve(self, dtype: Option<DType>) -> PyResult<ForeignTensor> {
        let Found {
            mut tensor,
            own_dtype,
            item_size,
        } = self;
        tensor.dtype = match (dtype, own_dtype) {
            (Some(want), _) if want.size() as u64 != item_size => {
                return Err(PyValueError::new_err(format!(
                    "cannot view {}-byte elements as {} ({} bytes each)",
                    item_size,
                    want.name(),
                    want.size()
                )));
            }
            (Some(want), _) => want,
            (None, Ok(own)) => own,
            (None, Err(why)) => {
                return Err(PyTypeError::new_err(format!(
                    "{why}; pass (tensor, \"bf16\") to reinterpret same-size elements"
                )));
            }
        };
        Ok(tensor)
    }
}

/// Why an engine's CUDA tensor is refused as a destination: by name, and what would take it.
/// A build without `cuda` cannot reach device memory at all; a build with it lands device
/// destinations only through the Rust API (`weightsync_worker::gpu::DeviceDestination`, page-
/// locked bounce buffers copied host to device once a version landed), which the embedded
/// engine does not use yet (docs/gpu.md, "Device destinations from Python").
fn cuda_destination_refused(index: Option<usize>) -> PyErr {
    let on = index.map_or_else(|| "cuda".to_string(), |i| format!("cuda:{i}"));
    let why = if cfg!(feature = "cuda") {
        "device destinations are not wired into Engine.register yet"
    } else {
        "this weightsync build has no CUDA support (built without the `cuda` feature)"
    };
    PyValueError::new_err(format!(
        "a CUDA tensor (on {on}) as a destination: {why}; register the engine's tensors in CPU \
         memory (a staged arena: weightsync.vllm / weightsync.sglang stage in host memory and \
         load with the engine's own loader); trainers may register CUDA tensors in builds with \
         `cuda`"
    ))
}

/// A torch tensor or DTensor (duck-typed: no torch import).
fn is_torch_tensor(obj: &Bound<'_, PyAny>) -> PyResult<bool> {
    Ok(obj.hasattr("data_ptr")? && obj.hasattr("untyped_storage")?)
}

/// torch's dtype names, as `str(t.dtype)` spells them.
fn torch_dtype(name: &str) -> Option<DType> {
    Some(match name {
        "torch.bfloat16" => DType::BF16,
        "torch.float16" => DType::F16,
        "torch.float32" => DType::F32,
        "torch.float8_e4m3fn" => DType::F8E4M3,
        _ => return None,
    })
}

fn from_torch(obj: &Bound<'_, PyAny>, access: Access) -> PyResult<Found> {
    // A DTensor: its local shard owns the memory.
    let (local, owner) = if obj.hasattr("to_local")? {
        let local = obj.call_method0("to_local")?;
        (local.clone(), Some(local.unbind()))
    } else {
        (obj.clone(), None)
    };
    let device = local.getattr("device")?;
    let device_type: String = device.getattr("type")?.extract()?;
    let cuda = match device_type.as_str() {
        "cpu" => None,
        "cuda" if access == Access::Read => {
            let index: Option<usize> = device.getattr("index")?.extract()?;
            Some(match index {
                Some(i) => i,
                None => local.call_method0("get_device")?.extract()?,
            })
        }
        "cuda" => {
            let index: Option<usize> = device.getattr("index")?.extract().unwrap_or(None);
            return Err(cuda_destination_refused(index));
        }
        other => {
            return Err(PyValueError::new_err(format!(
                "a tensor on device {other:?}: weightsync reads CPU or CUDA memory"
            )));
        }
    };
    if !local.call_method0("is_contiguous")?.extract::<bool>()? {
        return Err(PyValueError::new_err(
            "a non-contiguous tensor: weightsync registers one contiguous byte range; pass \
             .contiguous() once and keep that tensor",
        ));
    }
    let dtype_name: String = local.getattr("dtype")?.str()?.extract()?;
    let own_dtype = torch_dtype(&dtype_name).ok_or_else(|| {
        format!("dtype {dtype_name}: weightsync moves bfloat16, float16, float32 and float8_e4m3fn")
    });
    let shape: Vec<u64> = local.getattr("shape")?.extract()?;
    let numel: u64 = local.call_method0("numel")?.extract()?;
    let itemsize: u64 = local.call_method0("element_size")?.extract()?;
    let len = usize::try_from(numel * itemsize).map_err(|_| overflow())?;
    let ptr: usize = local.call_method0("data_ptr")?.extract()?;
    let storage = local.call_method0("untyped_storage")?;
    let sptr: usize = storage.call_method0("data_ptr")?.extract()?;
    let snb: usize = storage.call_method0("nbytes")?.extract()?;
    check_inside(ptr, len, sptr, snb, "the tensor's storage")?;
    let tensor = ForeignTensor {
        ptr,
        len,
        dtype: DType::BF16, // settled by `Found::resolve`
        shape,
        kind: if cuda.is_some() {
            "torch-cuda"
        } else {
            "torch"
        },
        cuda,
        keepalive: Keepalive {
            _object: obj.clone().unbind(),
            _owner: owner,
            _export: None,
        },
    };
    Ok(Found {
        tensor,
        own_dtype,
        item_size: itemsize,
    })
}

fn overflow() -> PyErr {
    PyValueError::new_err("tensor size overflows the address space")
}

fn check_inside(ptr: usize, len: usize, base: usize, extent: usize, what: &str) -> PyResult<()> {
    if len == 0 {
        return Err(PyValueError::new_err(
            "an empty tensor (0 elements): empty shards have no part in the layout; leave them \
             out",
        ));
    }
    let end = ptr.checked_add(len).ok_or_else(overflow)?;
    if ptr < base || end > base.saturating_add(extent) {
        return Err(PyValueError::new_err(format!(
            "bytes {ptr:#x}..{end:#x} are not inside {what} ({base:#x}..{:#x})",
            base.saturating_add(extent)
        )));
    }
    Ok(())
}

// DLPack (https://dmlc.github.io/dlpack/latest/c_api.html), the parts read here.
#[repr(C)]
struct DLDevice {
    device_type: i32,
    device_id: i32,
}
#[repr(C)]
struct DLDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}
#[repr(C)]
struct DLTensor {
    data: *mut c_void,
    device: DLDevice,
    ndim: i32,
    dtype: DLDataType,
    shape: *const i64,
    strides: *const i64,
    byte_offset: u64,
}
#[repr(C)]
struct DLPackVersion {
    major: u32,
    minor: u32,
}
#[repr(C)]
struct DLManagedTensorVersioned {
    version: DLPackVersion,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensorVersioned)>,
    flags: u64,
    dl_tensor: DLTensor,
}
const DL_CPU: i32 = 1;
const DL_CUDA: i32 = 2;
const DL_CUDA_HOST: i32 = 3;
const DLPACK_FLAG_READ_ONLY: u64 = 1;

fn dlpack_dtype(code: u8, bits: u8, lanes: u16) -> Option<DType> {
    Some(match (code, bits, lanes) {
        (4, 16, 1) => DType::BF16,
        (2, 16, 1) => DType::F16,
        (2, 32, 1) => DType::F32,
        (10, 8, 1) => DType::F8E4M3,
        _ => return None,
    })
}

/// The tensor a DLPack capsule describes, copied out, and whether it is read-only.
struct DlView {
    data: usize,
    device: i32,
    dtype: (u8, u8, u16),
    shape: Vec<i64>,
    strides: Option<Vec<i64>>,
    read_only: bool,
}

fn read_capsule(cap: &Bound<'_, PyCapsule>) -> PyResult<DlView> {
    let name = cap
        .name()?
        // SAFETY: the capsule is alive (borrowed) and its name pointer is valid while it is.
        .map(|n| unsafe { n.as_cstr() }.to_string_lossy().into_owned())
        .unwrap_or_default();
    let (t, read_only): (&DLTensor, bool) = match name.as_str() {
        "dltensor_versioned" => {
            let p = cap
                .pointer_checked(Some(c"dltensor_versioned"))?
                .cast::<DLManagedTensorVersioned>();
            // SAFETY: a capsule named "dltensor_versioned" holds a DLManagedTensorVersioned
            // (the DLPack contract), alive until the capsule (borrowed here) is destroyed.
            let m = unsafe { &*p.as_ptr() };
            (&m.dl_tensor, m.flags & DLPACK_FLAG_READ_ONLY != 0)
        }
        "dltensor" => {
            let p = cap.pointer_checked(Some(c"dltensor"))?.cast::<DLTensor>();
            // SAFETY: a capsule named "dltensor" holds a DLManagedTensor, which starts with
            // its DLTensor; alive until the capsule (borrowed here) is destroyed.
            (unsafe { &*p.as_ptr() }, false)
        }
        other => {
            return Err(PyValueError::new_err(format!(
                "__dlpack__ returned a capsule named {other:?} (a consumed or foreign capsule)"
            )));
        }
    };
    let nd = usize::try_from(t.ndim).map_err(|_| PyValueError::new_err("negative ndim"))?;
    let shape = if nd == 0 {
        Vec::new()
    } else {
        // SAFETY: DLPack: `shape` points at `ndim` int64s owned by the producer, alive with
        // the capsule.
        unsafe { std::slice::from_raw_parts(t.shape, nd) }.to_vec()
    };
    let strides = (!t.strides.is_null() && nd > 0)
        // SAFETY: DLPack: non-null `strides` points at `ndim` int64s, alive with the capsule.
        .then(|| unsafe { std::slice::from_raw_parts(t.strides, nd) }.to_vec());
    let data = (t.data as usize)
        .checked_add(usize::try_from(t.byte_offset).map_err(|_| overflow())?)
        .ok_or_else(overflow)?;
    Ok(DlView {
        data,
        device: t.device.device_type,
        dtype: (t.dtype.code, t.dtype.bits, t.dtype.lanes),
        shape,
        strides,
        read_only,
    })
}

fn from_dlpack(obj: &Bound<'_, PyAny>, access: Access) -> PyResult<Found> {
    let py = obj.py();
    let kw = PyDict::new(py);
    kw.set_item("max_version", (1, 0))?;
    let cap = match obj.call_method("__dlpack__", (), Some(&kw)) {
        Ok(c) => c,
        // A producer older than DLPack 1.0 does not take max_version.
        Err(e) if e.is_instance_of::<PyTypeError>(py) => obj.call_method0("__dlpack__")?,
        Err(e) => return Err(e),
    };
    let cap = cap
        .cast_into::<PyCapsule>()
        .map_err(|_| PyTypeError::new_err("__dlpack__ did not return a capsule"))?;
    let v = read_capsule(&cap)?;
    if v.device == DL_CUDA && access == Access::Write {
        return Err(cuda_destination_refused(None));
    }
    if v.device != DL_CPU && v.device != DL_CUDA_HOST {
        return Err(PyValueError::new_err(format!(
            "a DLPack tensor on device type {}: only CPU memory is wired in yet",
            v.device
        )));
    }
    if access == Access::Write && v.read_only {
        return Err(PyValueError::new_err(
            "a read-only DLPack tensor cannot receive weights",
        ));
    }
    let own_dtype = dlpack_dtype(v.dtype.0, v.dtype.1, v.dtype.2).ok_or_else(|| {
        format!(
            "DLPack dtype (code {}, {} bits, {} lanes) is not bf16, f16, f32 or f8_e4m3",
            v.dtype.0, v.dtype.1, v.dtype.2
        )
    });
    let itemsize = u64::from(v.dtype.1).div_ceil(8) * u64::from(v.dtype.2);
    let shape: Vec<u64> = v
        .shape
        .iter()
        .map(|&d| u64::try_from(d).map_err(|_| PyValueError::new_err("negative dimension")))
        .collect::<PyResult<_>>()?;
    if let Some(strides) = &v.strides {
        let mut want = 1i64;
        for (d, s) in shape.iter().zip(strides).rev() {
            if *d > 1 && *s != want {
                return Err(PyValueError::new_err(
                    "a non-contiguous DLPack tensor: weightsync registers one contiguous byte \
                     range",
                ));
            }
            want = want.saturating_mul(i64::try_from(*d).unwrap_or(i64::MAX));
        }
    }
    let numel: u64 = shape.iter().product();
    let len = usize::try_from(numel * itemsize).map_err(|_| overflow())?;
    check_inside(v.data, len, v.data, len, "the DLPack tensor")?;
    let tensor = ForeignTensor {
        ptr: v.data,
        len,
        dtype: DType::BF16, // settled by `Found::resolve`
        shape,
        kind: "dlpack",
        cuda: None,
        keepalive: Keepalive {
            _object: obj.clone().unbind(),
            _owner: None,
            _export: Some(Export::Capsule(cap.unbind())),
        },
    };
    Ok(Found {
        tensor,
        own_dtype,
        item_size: itemsize,
    })
}

/// Buffer-protocol format codes (struct module syntax, optional byte-order prefix).
fn buffer_dtype(format: &str) -> Option<DType> {
    let code = format.trim_start_matches(['@', '=', '<', '!']);
    Some(match code {
        "e" => DType::F16,
        "f" => DType::F32,
        _ => return None,
    })
}

fn from_buffer(obj: &Bound<'_, PyAny>, access: Access) -> PyResult<Found> {
    let buf = PyUntypedBuffer::get(obj).map_err(|_| {
        PyTypeError::new_err(format!(
            "{} is not a tensor: expected a torch tensor, a DLPack producer or an object with \
             the buffer protocol",
            obj.get_type()
                .name()
                .map(|n| n.to_string())
                .unwrap_or_default()
        ))
    })?;
    if !buf.is_c_contiguous() {
        return Err(PyValueError::new_err(
            "a non-contiguous buffer: weightsync registers one contiguous byte range",
        ));
    }
    if access == Access::Write && buf.readonly() {
        return Err(PyValueError::new_err(
            "a read-only buffer cannot receive weights",
        ));
    }
    let format = buf.format().to_string_lossy().into_owned();
    let shape: Vec<u64> = buf.shape().iter().map(|&d| d as u64).collect();
    let ptr = buf.buf_ptr() as usize;
    let len = buf.len_bytes();
    check_inside(ptr, len, ptr, len, "the buffer")?;
    let own_dtype = buffer_dtype(&format).ok_or_else(|| {
        format!(
            "buffer format {format:?} ({}-byte elements) is not f16 or f32",
            buf.item_size()
        )
    });
    let item_size = buf.item_size() as u64;
    let tensor = ForeignTensor {
        ptr,
        len,
        dtype: DType::BF16, // settled by `Found::resolve`
        shape,
        kind: "buffer",
        cuda: None,
        keepalive: Keepalive {
            _object: obj.clone().unbind(),
            _owner: None,
            _export: Some(Export::Buffer(buf)),
        },
    };
    Ok(Found {
        tensor,
        own_dtype,
        item_size,
    })
}
