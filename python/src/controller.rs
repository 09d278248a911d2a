//! `weightsync._native.ControllerCore`: the controller of one job inside the Python process,
//! so that `pip install weightsync` is all a job needs (no second toolchain to build and start
//! the `weightsync` binary). It is the same Rust service the binary runs
//! ([`weightsync_controller::run`] over [`ControllerConfig::for_job`] and the production
//! planner), on a tokio runtime of its own in a thread of its own, so it serves workers and
//! HTTP whatever the Python threads do. The public `weightsync.Controller` (Python) generates
//! tokens and calls this.
//!
//! Both addresses are bound before the constructor returns: a taken port or a job the planner
//! refuses is a `weightsync.ControllerError` naming it, and port 0 is a free port whose number
//! the object then tells.

use std::net::{SocketAddr, TcpListener};
use std::sync::Mutex;
use std::thread::JoinHandle;
use std::time::Duration;

use pyo3::prelude::*;
use tokio::sync::oneshot;
use weightsync_common::DType;
use weightsync_common::protocol::WorldSpec;
use weightsync_common::tls::{TlsFiles, TlsServer};
use weightsync_controller::{
    AppState, ControllerConfig, ControllerSecrets, DeltaMode, SchedulesPlanner,
};

use crate::errors::raise;

/// What a running controller's thread ends with.
type Served = std::io::Result<()>;

/// One job's controller, serving until [`ControllerCore::close`].
#[pyclass(frozen, module = "weightsync._native")]
pub(crate) struct ControllerCore {
    control: SocketAddr,
    http: SocketAddr,
    trainers: u32,
    rollouts: u32,
    tls: bool,
    delta: DeltaMode,
    running: Mutex<Option<Running>>,
}

struct Running {
    stop: oneshot::Sender<()>,
    thread: JoinHandle<Served>,
}

/// `weightsync.ControllerError(message, address=...)`.
fn controller_error(py: Python<'_>, message: String, address: Option<&str>) -> PyErr {
    let address = address
        .and_then(|a| a.into_pyobject(py).ok())
        .map(|a| a.into_any().unbind())
        .unwrap_or_else(|| py.None());
    raise(py, "ControllerError", message, &[("address", address)])
}

fn bind(py: Python<'_>, what: &str, address: &str) -> PyResult<TcpListener> {
    let listener = TcpListener::bind(address)
        .and_then(|l| l.set_nonblocking(true).map(|()| l))
        .map_err(|e| {
            controller_error(
                py,
                format!("the controller could not bind its {what} address {address}: {e}"),
                Some(address),
            )
        })?;
    Ok(listener)
}

#[pymethods]
impl ControllerCore {
    #[new]
    #[pyo3(signature = (
        model, train, infer, job_token, api_token, dtype = "bf16", http = "127.0.0.1:0",
        control = "127.0.0.1:0", verify = true, heartbeat_timeout = 5.0, sync_timeout = 300.0,
        history = 200, trainer_token = None, engine_token = None, read_token = None,
        tls_cert = None, tls_key = None, tls_ca = None, tls_crl = None, delta = "auto",
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        model: String,
        train: String,
        infer: String,
        job_token: String,
        api_token: String,
        dtype: &str,
        http: &str,
        control: &str,
        verify: bool,
        heartbeat_timeout: f64,
        sync_timeout: f64,
        history: usize,
        trainer_token: Option<String>,
        engine_token: Option<String>,
        read_token: Option<String>,
        tls_cert: Option<std::path::PathBuf>,
        tls_key: Option<std::path::PathBuf>,
        tls_ca: Option<std::path::PathBuf>,
        tls_crl: Option<std::path::PathBuf>,
        delta: &str,
    ) -> PyResult<Self> {
        let seconds = |name: &str, v: f64| {
            Duration::try_from_secs_f64(v)
                .ok()
                .filter(|d| !d.is_zero())
                .ok_or_else(|| {
                    pyo3::exceptions::PyValueError::new_err(format!(
                        "{name} must be a positive number of seconds, got {v}"
                    ))
                })
        };
        let delta = delta
            .parse::<DeltaMode>()
            .map_err(|e| pyo3::exceptions::PyValueError::new_err(e.to_string()))?;
        let heartbeat_timeout = seconds("heartbeat_timeout", heartbeat_timeout)?;
        let sync_timeout = seconds("sync_timeout", sync_timeout)?;
        if job_token.is_empty() || api_token.is_empty() {
            return Err(pyo3::exceptions::PyValueError::new_err(
                "job_token and api_token must not be empty",
            ));
        }
        let dtype = dtype
            .parse::<DType>()
            .map_err(|e| controller_error(py, format!("the job's dtype {dtype:?}: {e}"), None))?;
        let world = WorldSpec {
            model: model.clone(),
            train: train.clone(),
            infer: infer.clone(),
            dtype,
            verify,
        };
        // Each worker role proves its own secret where one is given, else the job token.
        let secrets = ControllerSecrets {
            trainer: trainer_token.unwrap_or_else(|| job_token.clone()).into(),
            rollout: engine_token.unwrap_or_else(|| job_token.clone()).into(),
            api: api_token.clone().into(),
            read: read_token.map(Into::into),
        };
        let mut cfg = ControllerConfig::for_job(
            world,
            job_token.into(),
            api_token.into(),
            heartbeat_timeout,
            sync_timeout,
            history,
        )
        .map_err(|e| {
            controller_error(
                py,
                format!(
                    "the controller cannot run the job (model {model}, train {train}, infer {infer}): {e}"
                ),
                None,
            )
        })?;
        cfg.secrets = secrets;
        cfg.delta = delta;
        // TLS on the control channel (workers' certificates checked against `tls_ca`, and
        // against `tls_crl` where given) and HTTP.
        cfg.tls = TlsFiles::from_parts_with_crl(tls_cert, tls_key, tls_ca, tls_crl)
            .and_then(|files| files.map(|f| TlsServer::new(&f)).transpose())
            .map_err(|e| controller_error(py, e.to_string(), None))?;
        let tls = cfg.tls.is_some();
        let control_listener = bind(py, "control", control)?;
        let http_listener = bind(py, "HTTP", http)?;
        let addr = |l: &TcpListener, what: &str, given: &str| {
            l.local_addr().map_err(|e| {
                controller_error(py, format!("the {what} address {given}: {e}"), Some(given))
            })
        };
        let control_addr = addr(&control_listener, "control", control)?;
        let http_addr = addr(&http_listener, "HTTP", http)?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("weightsync-controller")
            .enable_all()
            .build()
            .map_err(|e| {
                controller_error(py, format!("starting the controller's runtime: {e}"), None)
            })?;
        let (trainers, rollouts) = (cfg.coordinator.trainers, cfg.coordinator.rollouts);
        let (stop, stopped) = oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("weightsync-controller".into())
            .spawn(move || -> Served {
                runtime.block_on(async move {
                    let h = tokio::net::TcpListener::from_std(http_listener)?;
                    let c = tokio::net::TcpListener::from_std(control_listener)?;
                    let state = AppState::new(cfg, Box::new(SchedulesPlanner));
                    weightsync_controller::run(h, c, state, async {
                        let _ = stopped.await;
                    })
                    .await
                })
            })
            .map_err(|e| {
                controller_error(py, format!("starting the controller's thread: {e}"), None)
            })?;
        Ok(ControllerCore {
            control: control_addr,
            http: http_addr,
            trainers,
            rollouts,
            tls,
            delta,
            running: Mutex::new(Some(Running { stop, thread })),
        })
    }

    /// The control-channel address workers connect to, e.g. `127.0.0.1:41234`.
    #[getter]
    fn control_address(&self) -> String {
        self.control.to_string()
    }

    /// The HTTP API's address, e.g. `127.0.0.1:41235`.
    #[getter]
    fn http_address(&self) -> String {
        self.http.to_string()
    }

    /// The job's delta mode: `auto`, `on` or `off`.
    #[getter]
    fn delta(&self) -> String {
        self.delta.to_string()
    }

    /// Whether the control channel and the HTTP API are served over TLS.
    #[getter]
    fn tls(&self) -> bool {
        self.tls
    }

    /// Training ranks the job expects.
    #[getter]
    fn trainers(&self) -> u32 {
        self.trainers
    }

    /// Inference ranks the job expects.
    #[getter]
    fn rollouts(&self) -> u32 {
        self.rollouts
    }

    /// Whether it still serves (false after `close()`, or if the service ended on an error).
    fn is_running(&self) -> bool {
        self.lock()
            .as_ref()
            .is_some_and(|r| !r.thread.is_finished())
    }

    /// Stops serving (workers' connections close, in-flight HTTP calls end) and joins the
    /// controller's thread, with the GIL released. Idempotent.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let Some(running) = self.lock().take() else {
            return Ok(());
        };
        match py.detach(|| running.stop_and_join()) {
            Ok(()) => Ok(()),
            Err(e) => Err(controller_error(
                py,
                format!(
                    "the controller on {} ended with an error: {e}",
                    self.control
                ),
                None,
            )),
        }
    }
}

impl ControllerCore {
    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Running>> {
        self.running.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Running {
    fn stop_and_join(self) -> Served {
        // A service that already ended dropped the receiver: nothing to tell.
        let _ = self.stop.send(());
        match self.thread.join() {
            Ok(served) => served,
            Err(_) => Err(std::io::Error::other("the controller's thread panicked")),
        }
    }
}

impl Drop for ControllerCore {
    fn drop(&mut self) {
        // A controller dropped without close() still stops: its thread must not outlive it.
        if let Some(running) = self.lock().take() {
            let _ = running.stop_and_join();
        }
    }
}
