//! weightsync-python: the native module (`weightsync._native`) of the `weightsync` Python
//! package.
//!
//! The package is what an RL framework calls: `weightsync.Trainer` in every training rank
//! registers the job's own parameter tensors (FSDP2 `DTensor` shards, plain tensors, numpy
//! arrays) as sources and pushes versions; `weightsync.Engine` in every inference rank
//! registers the engine's own parameters as destinations, with hooks around each landing.
//! The Python half (`python/weightsync/*.py`) walks models and checks what only Python can
//! see (placements, storage moves); this crate turns Python objects into registered memory and
//! calls [`weightsync_agent`]'s embedded trainer and engine.
//!
//! The wheel also carries the rest of weightsync: [`controller`] runs a job's controller in
//! the Python process (`weightsync.Controller`), and [`cli`] is the `weightsync` command line
//! (the wheel's console script), the same Rust code as the binary's.
//!
//! Every wait releases the GIL and honours Ctrl-C ([`wait`]). The only `unsafe` of the crate
//! is in [`foreign_tensor`]: a raw address learnt from a foreign object, owned by a type that
//! holds the object.
//!
//! # Layout
//! - [`foreign_tensor`]: torch / DLPack / buffer-protocol memory, kept alive (the unsafe).
//! - [`tensor_list`]: the `(name, tensor, dtype)` lists `register` takes; [`dtype_name`].
//! - [`trainer`], [`engine`]: the `TrainerCore` / `PushCore` and `EngineCore` classes.
//! - [`wait`]: GIL-free, interruptible waiting; [`errors`]: Rust errors as Python exceptions.
//! - [`records`]: what the module returns (`Outcome`, `State`...), as frozen classes.
//! - [`controller`]: `ControllerCore`, the controller on a runtime thread of its own.
//! - [`cli`]: `cli_main`, the command line.

mod cli;
mod controller;
mod dtype_name;
mod engine;
mod errors;
mod foreign_tensor;
mod records;
mod tensor_list;
mod trainer;
mod wait;

use pyo3::prelude::*;

use crate::foreign_tensor::{Access, ForeignTensor};

/// How weightsync sees a tensor-like object, without registering it (kind `torch`, `dlpack` or
/// `buffer`).
#[pyfunction]
#[pyo3(signature = (obj, dtype = None, writable = false))]
fn tensor_info(
    obj: &Bound<'_, PyAny>,
    dtype: Option<&str>,
    writable: bool,
) -> PyResult<records::TensorMemory> {
    let dtype = dtype.map(dtype_name::parse).transpose()?;
    let access = if writable {
        Access::Write
    } else {
        Access::Read
    };
    let t = ForeignTensor::from_object(obj, dtype, access)?;
    Ok(records::TensorMemory {
        address: t.ptr(),
        bytes: t.len(),
        dtype: t.dtype().name().to_string(),
        shape: t.shape().to_vec(),
        kind: t.kind(),
    })
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<trainer::TrainerCore>()?;
    m.add_class::<trainer::PushCore>()?;
    m.add_class::<engine::EngineCore>()?;
    m.add_class::<records::Outcome>()?;
    m.add_class::<records::TensorMemory>()?;
    m.add_class::<records::Registered>()?;
    m.add_class::<records::Shard>()?;
    m.add_class::<records::PlannedTensor>()?;
    m.add_class::<records::State>()?;
    m.add_class::<controller::ControllerCore>()?;
    m.add_function(wrap_pyfunction!(cli::cli_main, m)?)?;
    m.add_function(wrap_pyfunction!(tensor_info, m)?)?;
    m.add("POLL_SECONDS", wait::POLL.as_secs_f64())?;
    Ok(())
}
