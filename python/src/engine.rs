//! `weightsync._native.EngineCore`: the embedded receiver of one inference rank, over
//! [`weightsync_agent::EngineHandle`]. The public `weightsync.Engine` (Python) walks models and
//! wraps the hooks with its own checks.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use weightsync_agent::embed::{
    DstTensor, EmbedError, EngineHandle, EngineOptions, EngineSources, EngineState, EngineStatus,
    Hook, Stage,
};
use weightsync_common::protocol::{SourceBox, TensorSource};

use crate::errors::{embed_error, tls_files};
use crate::foreign_tensor::Access;
use crate::records::{PlannedTensor, Registered, State};
use crate::tensor_list::{self, Entry, Named};
use crate::wait::wait_interruptibly;

/// What an engine registers: CPU tensors, or CUDA tensors of one GPU (a `cuda` build).
enum Destinations {
    Host(Vec<DstTensor>),
    #[cfg(feature = "cuda")]
    Device(Vec<weightsync_agent::embed::DeviceDstTensor>),
}

fn registered(n: &Named) -> Registered {
    Registered {
        name: n.name.clone(),
        address: n.tensor.ptr(),
        bytes: n.tensor.len(),
        kind: n.tensor.kind(),
    }
}

/// The tensors as destinations: all in CPU memory, or all CUDA tensors (a `cuda` build; the
/// engine checks that they are of one GPU); a mix is refused naming one of each.
fn destinations(py: Python<'_>, worker: &str, named: Vec<Named>) -> PyResult<Destinations> {
    let (on_gpu, on_host): (Vec<_>, Vec<_>) =
        named.into_iter().partition(|n| n.tensor.cuda().is_some());
    if let (Some(g), Some(h)) = (on_gpu.first(), on_host.first()) {
        let reason = format!(
            "on cuda:{} while {} is in CPU memory: register the tensors of one device",
            g.tensor.cuda().unwrap_or(0),
            h.name
        );
        return Err(embed_error(
            py,
            EmbedError::Registration {
                worker: worker.to_string(),
                tensor: Some(g.name.clone()),
                reason,
            },
        ));
    }
    #[cfg(feature = "cuda")]
    if !on_gpu.is_empty() {
        let mut dsts = Vec::with_capacity(on_gpu.len());
        for n in on_gpu {
            let (name, dtype, shape) = (n.name, n.tensor.dtype(), n.tensor.shape().to_vec());
            dsts.push(weightsync_agent::embed::DeviceDstTensor {
                name,
                dtype,
                shape,
                memory: n.tensor.into_device_memory()?,
            });
        }
        return Ok(Destinations::Device(dsts));
    }
    let mut dsts = Vec::with_capacity(on_host.len());
    for n in on_host {
        let (name, dtype, shape) = (n.name, n.tensor.dtype(), n.tensor.shape().to_vec());
        dsts.push(DstTensor {
            name,
            dtype,
            shape,
            memory: n.tensor.into_host_memory()?,
        });
    }
    Ok(Destinations::Host(dsts))
}

/// What one tensor is made of, as Python passes it: `(name, dim, parts)`, each part `(trainer
/// tensor, offset, shape)`.
type SourceEntry = (String, u32, Vec<(String, Vec<u64>, Vec<u64>)>);

/// The sources by tensor name; a tensor given two is refused (ValueError naming it).
fn engine_sources(worker: &str, entries: Vec<SourceEntry>) -> PyResult<EngineSources> {
    let mut out = EngineSources::new();
    for (name, dim, parts) in entries {
        let source = TensorSource {
            dim,
            parts: parts
                .into_iter()
                .map(|(tensor, offset, shape)| SourceBox {
                    tensor,
                    offset,
                    shape,
                })
                .collect(),
        };
        if out.insert(name.clone(), source).is_some() {
            return Err(PyValueError::new_err(format!(
                "{worker}: tensor {name}: two sources declared for it"
            )));
        }
    }
    Ok(out)
}

/// One inference rank's connection to the controller.
#[pyclass(frozen, module = "weightsync._native")]
pub(crate) struct EngineCore {
    inner: EngineHandle,
}

fn state(s: EngineState) -> State {
    let name = match s.status {
        EngineStatus::Idle => "idle",
        EngineStatus::Landing => "landing",
        EngineStatus::Committed => "committed",
        EngineStatus::Invalid => "invalid",
    };
    State {
        version: s.version,
        run: s.run,
        state: name,
        cause: s.cause,
    }
}

/// A Python callable as a hook: called with the GIL taken; an exception fails the sync with
/// the exception's type and message.
fn hook(callable: Py<PyAny>) -> Hook {
    Box::new(move |version| {
        Python::attach(|py| {
            callable.call1(py, (version,)).map(|_| ()).map_err(|e| {
                let kind = e
                    .get_type(py)
                    .name()
                    .map(|n| n.to_string())
                    .unwrap_or_else(|_| "Exception".into());
                format!("{kind}: {}", e.value(py))
            })
        })
    })
}

#[pymethods]
impl EngineCore {
    #[new]
    #[pyo3(signature = (
        controller, rank, job_token = None, listen = None, worker_id = None, fabric_token = None,
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
        fabric_token: Option<String>,
        tls_cert: Option<std::path::PathBuf>,
        tls_key: Option<std::path::PathBuf>,
        tls_ca: Option<std::path::PathBuf>,
    ) -> PyResult<Self> {
        let tls = tls_files(tls_cert, tls_key, tls_ca)?;
        let opts = EngineOptions {
            job_token: job_token.map(Into::into),
            fabric_token: fabric_token.map(Into::into),
            listen,
            worker_id,
            tls,
            ..EngineOptions::new(controller, rank)
        };
        let inner = py
            .detach(|| EngineHandle::connect(opts))
            .map_err(|e| embed_error(py, e))?;
        Ok(EngineCore { inner })
    }

    /// This worker's id, e.g. `rollout-0`.
    #[getter]
    fn worker_id(&self) -> String {
        self.inner.worker_id().to_string()
    }

    /// The tensors this rank must register (`global_shape` and `offset` None for a tensor that
    /// is not one box of one training parameter).
    fn layout(&self) -> Vec<PlannedTensor> {
        self.inner
            .layout()
            .into_iter()
            .map(|t| PlannedTensor {
                name: t.name,
                dtype: t.dtype.name().to_string(),
                shape: t.shape,
                global_shape: t.global_shape,
                offset: t.offset,
            })
            .collect()
    }

    /// Sets both hooks (None clears one).
    #[pyo3(signature = (before_landing = None, after_commit = None))]
    fn set_hooks(&self, before_landing: Option<Py<PyAny>>, after_commit: Option<Py<PyAny>>) {
        self.inner
            .set_hooks(before_landing.map(hook), after_commit.map(hook));
    }

    /// Registers `(name, tensor, dtype or None)` entries as destinations: CPU tensors, or (a
    /// `cuda` build on a machine with a driver) torch CUDA tensors of one GPU.
    fn register(&self, py: Python<'_>, tensors: Vec<Entry<'_>>) -> PyResult<Vec<Registered>> {
        let worker = self.inner.worker_id().to_string();
        let named = tensor_list::read(py, &worker, tensors, Access::Write)?;
        let registered = named.iter().map(registered).collect();
        let result = match destinations(py, &worker, named)? {
            Destinations::Host(dsts) => py.detach(|| self.inner.register(dsts)),
            #[cfg(feature = "cuda")]
            Destinations::Device(dsts) => py.detach(|| self.inner.register_device(dsts)),
        };
        result.map_err(|e| embed_error(py, e))?;
        Ok(registered)
    }

    /// Whether the job's model is declared by its workers: register with
    /// `declare_and_register`; `layout()` is empty.
    #[getter]
    fn declared(&self) -> bool {
        self.inner.is_declared()
    }

    /// A declared model's destinations: `(name, tensor, dtype or None)` entries, every tensor
    /// the engine holds, `skip`, the names it takes nothing of (a buffer no trainer holds, a
    /// trainer tensor it does not hold), and `sources`, what some tensors are made of:
    /// `(name, dim, [(trainer tensor, offset, shape), ...])`, the parts concatenated along
    /// `dim` (a tensor without one is the trainers' tensor of its name, whole). Registers them
    /// and declares them to the controller; returns what was registered (skipped and empty
    /// tensors are not).
    #[pyo3(signature = (tensors, skip, sources = Vec::new()))]
    fn declare_and_register(
        &self,
        py: Python<'_>,
        tensors: Vec<Entry<'_>>,
        skip: Vec<String>,
        sources: Vec<SourceEntry>,
    ) -> PyResult<Vec<Registered>> {
        let worker = self.inner.worker_id().to_string();
        let sources = engine_sources(&worker, sources)?;
        let named = tensor_list::read(py, &worker, tensors, Access::Write)?;
        let registered = named
            .iter()
            .filter(|n| !skip.contains(&n.name) && n.tensor.len() > 0)
            .map(registered)
            .collect();
        let result = match destinations(py, &worker, named)? {
            Destinations::Host(dsts) => {
                py.detach(|| self.inner.declare_and_register_sources(dsts, skip, sources))
            }
            #[cfg(feature = "cuda")]
            Destinations::Device(dsts) => {
                py.detach(|| self.inner.declare_and_register_device(dsts, skip, sources))
            }
        };
        result.map_err(|e| embed_error(py, e))?;
        Ok(registered)
    }

    /// Blocks (GIL released, Ctrl-C honoured) until the controller planned the world this rank
    /// registered in (the plan id), or raises why it could not.
    #[pyo3(signature = (timeout = None))]
    fn wait_plan(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<u64> {
        let what = format!("{}'s plan", self.inner.worker_id());
        wait_interruptibly(py, timeout, &what, |slice| {
            self.inner.wait_plan(Some(slice))
        })
    }

    /// The state now.
    fn state(&self) -> State {
        state(self.inner.state())
    }

    /// Blocks until a version >= `version` committed (returns the state) or the engine turned
    /// invalid for it (raises SyncFailedError).
    #[pyo3(signature = (version, timeout = None))]
    fn wait_for_version(
        &self,
        py: Python<'_>,
        version: u64,
        timeout: Option<f64>,
    ) -> PyResult<State> {
        let what = format!("{}: version {version}", self.inner.worker_id());
        wait_interruptibly(py, timeout, &what, |slice| {
            self.inner.wait_for_version(version, Some(slice))
        })
        .map(state)
    }

    /// Nanoseconds on this engine's clock (monotonic; zero when it connected).
    fn now_ns(&self) -> u64 {
        self.inner.now_ns()
    }

    /// Reports this engine's own stages of `version`: `(stage, start_ns, end_ns)` with stage
    /// `pause`, `load` or `resume` and times from `now_ns()`. ValueError names what is wrong.
    fn report_stages(
        &self,
        py: Python<'_>,
        version: u64,
        spans: Vec<(String, i64, i64)>,
    ) -> PyResult<()> {
        let worker = self.inner.worker_id();
        let spans = spans
            .iter()
            .enumerate()
            .map(|(i, (name, start, end))| engine_span(worker, i, name, *start, *end))
            .collect::<PyResult<Vec<_>>>()?;
        self.inner
            .report_stages(version, &spans)
            .map_err(|e| embed_error(py, e))
    }

    /// Leaves the job (idempotent).
    fn close(&self, py: Python<'_>) {
        py.detach(|| self.inner.close());
    }
}

/// `spans[i]` of `report_stages` as a stage and two times, or a ValueError naming what is wrong.
fn engine_span(
    worker: &str,
    i: usize,
    name: &str,
    start: i64,
    end: i64,
) -> PyResult<(Stage, u64, u64)> {
    let bad = |what: String| PyValueError::new_err(format!("{worker}: spans[{i}]: {what}"));
    let stage = name
        .parse::<Stage>()
        .ok()
        .filter(|s| s.is_engine())
        .ok_or_else(|| {
            bad(format!(
                "stage {name:?} is not one an engine reports (\"pause\", \"load\" or \"resume\")"
            ))
        })?;
    let time = |what: &str, t: i64| {
        u64::try_from(t).map_err(|_| bad(format!("{what} {t} is negative (use now_ns())")))
    };
    Ok((stage, time("start_ns", start)?, time("end_ns", end)?))
}
