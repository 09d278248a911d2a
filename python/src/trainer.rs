//! `weightsync._native.TrainerCore`: the embedded trainer of one training rank, over
//! [`weightsync_agent::TrainerHandle`]. The public `weightsync.Trainer` (Python) walks models,
//! checks placements and storage moves, and calls this.

use pyo3::prelude::*;
#[cfg(feature = "cuda")]
use weightsync_agent::embed::DeviceTensor;
use weightsync_agent::embed::{
    DeclaredShard, EmbedError, PushHandle, SourceTensor, SyncOutcome, TrainerHandle, TrainerOptions,
};
use weightsync_agent::trainer::WriteCheck;

use crate::errors::{embed_error, tls_files};
use crate::foreign_tensor::Access;
use crate::records::{Outcome, Registered, Shard};
use crate::tensor_list::{self, Entry};
use crate::wait::wait_interruptibly;

/// One training rank's connection to the controller.
#[pyclass(frozen, module = "weightsync._native")]
pub(crate) struct TrainerCore {
    inner: TrainerHandle,
}

#[pymethods]
impl TrainerCore {
    #[new]
    #[pyo3(signature = (
        controller, rank, job_token = None, listen = None, worker_id = None, run = 0,
        fabric_token = None,
        tls_cert = None, tls_key = None, tls_ca = None,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        controller: String,
        rank: u32,
        job_token: Option<String>,
        listen: Option<String>,
        worker_id: Option<String>,
        run: u64,
        fabric_token: Option<String>,
        tls_cert: Option<std::path::PathBuf>,
        tls_key: Option<std::path::PathBuf>,
        tls_ca: Option<std::path::PathBuf>,
    ) -> PyResult<Self> {
        let tls = tls_files(tls_cert, tls_key, tls_ca)?;
        let opts = TrainerOptions {
            job_token: job_token.map(Into::into),
            fabric_token: fabric_token.map(Into::into),
            listen,
            worker_id,
            run,
            tls,
            ..TrainerOptions::new(controller, rank)
        };
        let inner = py
            .detach(|| TrainerHandle::connect(opts))
            .map_err(|e| embed_error(py, e))?;
        Ok(TrainerCore { inner })
    }

    /// This worker's id, e.g. `trainer-0`.
    #[getter]
    fn worker_id(&self) -> String {
        self.inner.worker_id().to_string()
    }

    /// The job's run this trainer's versions belong to.
    #[getter]
    fn run(&self) -> u64 {
        self.inner.run()
    }

    /// This trainer's versions belong to `run` from now on (larger than the current one).
    fn begin_run(&self, py: Python<'_>, run: u64) -> PyResult<()> {
        self.inner.begin_run(run).map_err(|e| embed_error(py, e))
    }

    /// The shards this rank must register.
    fn layout(&self) -> Vec<Shard> {
        self.inner
            .layout()
            .into_iter()
            .map(|s| Shard {
                name: s.name,
                dtype: s.dtype.name().to_string(),
                global_shape: s.global_shape,
                offset: s.offset,
                shape: s.shape,
            })
            .collect()
    }

    /// Registers `(name, tensor, dtype or None)` entries in place; returns what was registered.
    fn register(&self, py: Python<'_>, tensors: Vec<Entry<'_>>) -> PyResult<Vec<Registered>> {
        let worker = self.inner.worker_id().to_string();
        let named = tensor_list::read(py, &worker, tensors, Access::Read)?;
        let registered: Vec<Registered> = named
            .iter()
            .map(|n| Registered {
                name: n.name.clone(),
                address: n.tensor.ptr(),
                bytes: n.tensor.len(),
                kind: n.tensor.kind(),
            })
            .collect();
        let (on_gpu, on_host): (Vec<_>, Vec<_>) =
            named.into_iter().partition(|n| n.tensor.cuda().is_some());
        let refuse = |tensor: &str, reason: String| {
            embed_error(
                py,
                EmbedError::Registration {
                    worker: worker.clone(),
                    tensor: Some(tensor.to_string()),
                    reason,
                },
            )
        };
        if let (Some(g), Some(h)) = (on_gpu.first(), on_host.first()) {
            return Err(refuse(
                &g.name,
                format!(
                    "on cuda:{} while {} is in CPU memory: register the tensors of one device",
                    g.tensor.cuda().unwrap_or(0),
                    h.name
                ),
            ));
        }
        if let Some(g) = on_gpu.first() {
            #[cfg(feature = "cuda")]
            {
                let _ = g;
                let mut sources = Vec::with_capacity(on_gpu.len());
                for n in on_gpu {
                    let (name, dtype, shape) =
                        (n.name, n.tensor.dtype(), n.tensor.shape().to_vec());
                    let memory = n.tensor.into_device_memory()?;
                    sources.push(DeviceTensor {
                        name,
                        dtype,
                        shape,
                        memory,
                    });
                }
                py.detach(|| self.inner.register_device(sources))
                    .map_err(|e| embed_error(py, e))?;
                return Ok(registered);
            }
            #[cfg(not(feature = "cuda"))]
            return Err(refuse(
                &g.name,
                format!(
                    "a CUDA tensor (cuda:{}): this build of weightsync has no CUDA support; \
                     build the extension with the `cuda` feature, or register CPU tensors",
                    g.tensor.cuda().unwrap_or(0)
                ),
            ));
        }
        let mut sources = Vec::with_capacity(on_host.len());
        for n in on_host {
            sources.push(SourceTensor {
                name: n.name,
                dtype: n.tensor.dtype(),
                shape: n.tensor.shape().to_vec(),
                memory: n.tensor.into_host_memory()?,
            });
        }
        py.detach(|| self.inner.register(sources))
            .map_err(|e| embed_error(py, e))?;
        Ok(registered)
    }

    /// Whether the job's model is declared by its workers (an architecture the planner does
    /// not lay out): register with `declare_and_register`; `layout()` is empty.
    #[getter]
    fn declared(&self) -> bool {
        self.inner.is_declared()
    }

    /// A declared model's shards: `(name, tensor, dtype or None)` entries (CPU tensors, each a
    /// parameter's local shard) and, per entry, `(global_shape, offset)`: the whole
    /// parameter's shape and where the shard starts in it (both empty: the tensor is whole).
    /// Registers them in place and declares them to the controller; returns what was
    /// registered.
    fn declare_and_register(
        &self,
        py: Python<'_>,
        tensors: Vec<Entry<'_>>,
        boxes: Vec<(Vec<u64>, Vec<u64>)>,
    ) -> PyResult<Vec<Registered>> {
        let worker = self.inner.worker_id().to_string();
        if boxes.len() != tensors.len() {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "{worker}: {} tensors but {} boxes",
                tensors.len(),
                boxes.len()
            )));
        }
        let named = tensor_list::read(py, &worker, tensors, Access::Read)?;
        let mut registered = Vec::with_capacity(named.len());
        let mut shards = Vec::with_capacity(named.len());
        for (n, (global_shape, offset)) in named.into_iter().zip(boxes) {
            if let Some(dev) = n.tensor.cuda() {
                return Err(embed_error(
                    py,
                    EmbedError::Registration {
                        worker: worker.clone(),
                        tensor: Some(n.name),
                        reason: format!(
                            "on cuda:{dev}: a declared model's shards register from CPU memory \
                             (device shards are not declared yet)"
                        ),
                    },
                ));
            }
            registered.push(Registered {
                name: n.name.clone(),
                address: n.tensor.ptr(),
                bytes: n.tensor.len(),
                kind: n.tensor.kind(),
            });
            shards.push(DeclaredShard {
                tensor: SourceTensor {
                    name: n.name,
                    dtype: n.tensor.dtype(),
                    shape: n.tensor.shape().to_vec(),
                    memory: n.tensor.into_host_memory()?,
                },
                global_shape,
                offset,
            });
        }
        py.detach(|| self.inner.declare_and_register(shards))
            .map_err(|e| embed_error(py, e))?;
        Ok(registered)
    }

    /// Blocks (GIL released, Ctrl-C honoured) until the controller planned the world this rank
    /// registered in (the plan id), or raises why it could not (a declared model's
    /// disagreement, naming the tensor and both ranks).
    #[pyo3(signature = (timeout = None))]
    fn wait_plan(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<u64> {
        let what = format!("{}'s plan", self.inner.worker_id());
        wait_interruptibly(py, timeout, &what, |slice| {
            self.inner.wait_plan(Some(slice))
        })
    }

    /// Declares that the registered tensors hold `version`; returns the handle of its sync.
    /// `check`, when given, is called (with the GIL) once the sync read every byte: it returns
    /// the name of a registered tensor written since this push, or None.
    #[pyo3(signature = (version, check = None))]
    fn push(&self, py: Python<'_>, version: u64, check: Option<Py<PyAny>>) -> PyResult<PushCore> {
        let unchanged = check.map(write_check);
        let inner = py
            .detach(|| self.inner.push_checked(version, unchanged))
            .map_err(|e| embed_error(py, e))?;
        Ok(PushCore { inner })
    }

    /// Leaves the job (idempotent).
    fn close(&self, py: Python<'_>) {
        py.detach(|| self.inner.close());
    }
}

/// A Python callable as the check of a push: its answer names a tensor written since, or is
/// None; a check that raises names what it raised (the sync cannot be vouched for).
fn write_check(callable: Py<PyAny>) -> WriteCheck {
    std::sync::Arc::new(move || {
        Python::attach(|py| match callable.call0(py) {
            Ok(v) => v
                .extract::<Option<String>>(py)
                .unwrap_or_else(|e| Some(format!("<check returned a non-string: {e}>"))),
            Err(e) => Some(format!("<the tensor check raised: {}>", e.value(py))),
        })
    })
}

/// The pending sync of one pushed version.
#[pyclass(frozen, module = "weightsync._native")]
pub(crate) struct PushCore {
    inner: PushHandle,
}

fn outcome(o: SyncOutcome) -> Outcome {
    Outcome {
        version: o.version,
        bytes: o.bytes,
        staged_bytes: o.staged_bytes,
        direct_bytes: o.direct_bytes,
        seconds: o.seconds,
        stages: o.stages,
        superseded: o.superseded,
        path: o.paths.map(|p| p.name()),
        path_bytes: o.paths.map_or_else(Vec::new, |p| {
            vec![
                ("payloads", p.payload_bytes),
                ("process_vm_readv", p.process_vm_readv_bytes),
                ("shared_memory", p.shared_memory_bytes),
            ]
        }),
    }
}

#[pymethods]
impl PushCore {
    /// The version pushed.
    #[getter]
    fn version(&self) -> u64 {
        self.inner.version()
    }

    /// Blocks (GIL released, Ctrl-C honoured) until the sync commits or fails.
    #[pyo3(signature = (timeout = None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Outcome> {
        let what = format!("sync of version {}", self.inner.version());
        wait_interruptibly(py, timeout, &what, |slice| self.inner.wait(Some(slice))).map(outcome)
    }
}
