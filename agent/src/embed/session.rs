//! What both embedded workers share: their runtime, learning the job, the agent session they
//! start once their memory is registered, and the ends of syncs as the controller announces
//! them (kept per version, so a waiter finds its answer whenever it looks).

use std::collections::BTreeMap;
use std::future::Future;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use tokio::runtime::Runtime;
use tokio::sync::mpsc;
use weightsync_common::fabric::{Fabric, FabricConfig};
use weightsync_common::protocol::{Failure, FromWorker, WorkerId, WorldSpec};

use super::EmbedError;
use weightsync_common::secret::Secret;
use weightsync_common::tls::{TlsClient, TlsFiles};

use crate::control::{AgentConfig, AgentEvent, AgentLink, fetch_job_over, run_agent_with};
use crate::driver::SyncDriver;

/// How an embedded worker reaches its controller.
#[derive(Debug, Clone)]
pub(crate) struct Reach {
    pub controller: String,
    pub token: Secret,
    /// The fabric's secret (`WEIGHTSYNC_FABRIC_TOKEN`, else `token`).
    pub fabric_token: Secret,
    pub listen: Option<String>,
    pub id: WorkerId,
    pub name: String,
    /// TLS to the controller; `None`: plain TCP.
    pub tls: Option<TlsClient>,
}

impl Reach {
    pub(crate) fn new(
        controller: &str,
        token: Option<&Secret>,
        fabric_token: Option<&Secret>,
        listen: Option<&str>,
        id: WorkerId,
        name: Option<&str>,
        tls: Option<&TlsFiles>,
    ) -> Result<Reach, EmbedError> {
        let name = name.map_or_else(|| id.to_string(), str::to_string);
        let env = |k: &str| std::env::var(k).ok();
        let refused = |reason: String| EmbedError::Connect {
            worker: name.clone(),
            reason,
        };
        let token = match token {
            Some(t) => t.clone(),
            None => crate::config::role_secret(id.role, &env)
                .map_err(|e| refused(e.to_string()))?
                .unwrap_or_else(|| Secret::from("")),
        };
        let tls = match tls {
            Some(files) => {
                use weightsync_common::tls::{CRL_VAR, SERVER_NAME_VAR};
                let var = |k: &str| env(k).filter(|v| !v.is_empty());
                // Files given in code, the name and a CRL (when they name none) from the
                // environment, as a worker started from its variables would read them.
                let files = TlsFiles {
                    crl: files.crl.clone().or_else(|| var(CRL_VAR).map(Into::into)),
                    ..files.clone()
                };
                TlsClient::new(&files, var(SERVER_NAME_VAR).as_deref()).map(Some)
            }
            None => TlsClient::from_env(&env),
        }
        .map_err(|e| refused(e.to_string()))?;
        // With TLS the controller hands out the fabric key: no shared fabric token is needed.
        let fabric_token = match fabric_token {
            Some(t) => t.clone(),
            None => match crate::config::fabric_secret(&env, &token) {
                Ok(t) => t,
                Err(_) if tls.is_some() => token.clone(),
                Err(e) => return Err(refused(e.to_string())),
            },
        };
        Ok(Reach {
            tls,
            controller: controller.to_string(),
            token,
            fabric_token,
            listen: listen.map(str::to_string),
            id,
            name,
        })
    }

    pub(crate) fn connect_error(&self, reason: impl std::fmt::Display) -> EmbedError {
        EmbedError::Connect {
            worker: self.name.clone(),
            reason: reason.to_string(),
        }
    }

    /// The fabric settings of this worker: two lanes per peer, its listen address, and
    /// same-host pulls unless `WEIGHTSYNC_SAME_HOST` turns them off ([`start`] refuses a value
    /// that is neither true nor false, naming the variable).
    pub(crate) fn fabric_config(&self) -> FabricConfig {
        let mut cfg = FabricConfig::loopback(self.fabric_token.expose(), 2);
        if let Some(l) = &self.listen {
            cfg.listen = l.clone();
        }
        if let Ok(Some(on)) = crate::config::same_host_from_env() {
            cfg.same_host = on;
        }
        cfg
    }
}

/// The job as learned from the controller, and this worker's runtime and fabric.
pub(crate) struct Started {
    pub rt: Runtime,
    pub world: WorldSpec,
    pub model_config: Option<String>,
    pub fabric: Fabric,
}

/// Starts the runtime, learns the job, starts the fabric.
pub(crate) fn start(reach: &Reach) -> Result<Started, EmbedError> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name(format!("weightsync-{}", reach.name))
        .enable_all()
        .build()
        .map_err(|e| reach.connect_error(format!("cannot start a runtime: {e}")))?;
    let job = rt
        .block_on(fetch_job_over(
            &reach.controller,
            reach.tls.as_ref(),
            &reach.token,
            reach.id,
            crate::AGENT_MAX_FRAME,
        ))
        .map_err(|e| reach.connect_error(e))?;
    crate::config::same_host_from_env().map_err(|e| reach.connect_error(e))?;
    let mut fabric_config = reach.fabric_config();
    if let Some(key) = &job.fabric_key {
        // A controller with TLS hands every worker the fabric key over mutual TLS.
        fabric_config.job_token = key.token();
    }
    let (world, model_config) = (job.world, job.model_config);
    let fabric = rt
        .block_on(Fabric::start(&fabric_config))
        .map_err(|e| reach.connect_error(format!("cannot start the fabric: {e}")))?;
    Ok(Started {
        rt,
        world,
        model_config,
        fabric,
    })
}

/// How a sync of one version ended, as announced.
#[derive(Debug, Clone)]
pub(crate) enum End {
    Committed {
        at: Instant,
    },
    Aborted {
        reason: String,
        failure: Option<Failure>,
    },
}

#[derive(Debug, Default)]
pub(crate) struct EndsState {
    pub registered: bool,
    /// Registrations so far (more than one: the controller was lost and found again).
    pub registrations: u32,
    /// A trainer's last push, `(version, run)`: re-sent after a re-registration while it has
    /// no end (a restarted controller knows nothing of the pushes made before its crash).
    pub outstanding: Option<(u64, u64)>,
    /// The last plan heard of: its id, or why it failed.
    pub plan: Option<Result<u64, String>>,
    pub by_version: BTreeMap<u64, End>,
    pub stopped: Option<String>,
}

/// The ends of syncs and the session's life, with a condition variable to wait on.
#[derive(Debug, Default)]
pub(crate) struct Ends {
    pub state: Mutex<EndsState>,
    pub changed: Condvar,
}

impl Ends {
    /// Waits until `ready` gives an answer, or `timeout` passes (`None`).
    pub(crate) fn wait<T>(
        &self,
        timeout: Option<Duration>,
        mut ready: impl FnMut(&EndsState) -> Option<T>,
    ) -> Option<T> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut st = self.state.lock();
        loop {
            if let Some(r) = ready(&st) {
                return Some(r);
            }
            match deadline {
                Some(d) => {
                    if self.changed.wait_until(&mut st, d).timed_out() {
                        return ready(&st);
                    }
                }
                None => self.changed.wait(&mut st),
            }
        }
    }

    fn record(&self, ev: AgentEvent) {
        let mut st = self.state.lock();
        match ev {
            AgentEvent::Registered => {
                st.registered = true;
                st.registrations += 1;
            }
            AgentEvent::Committed { version, .. } => {
                let at = Instant::now();
                st.by_version.insert(version, End::Committed { at });
            }
            AgentEvent::Aborted {
                version,
                reason,
                failure,
                ..
            } => {
                st.by_version
                    .insert(version, End::Aborted { reason, failure });
            }
            AgentEvent::Assigned { plan_id } => st.plan = Some(Ok(plan_id)),
            AgentEvent::PlanFailed { reason, .. } => st.plan = Some(Err(reason)),
            AgentEvent::Stopped { reason } => st.stopped = Some(reason),
        }
        // Old versions are kept a while: a waiter may look late.
        while st.by_version.len() > 1024 {
            st.by_version.pop_first();
        }
        drop(st);
        self.changed.notify_all();
    }
}

/// A running agent session: where to send extra messages, and the ends it announces.
pub(crate) struct Session {
    pub outbox: mpsc::Sender<FromWorker>,
    pub ends: std::sync::Arc<Ends>,
}

/// How long leaving waits for the agent to write what was queued and stop.
pub(crate) const LEAVE_WITHIN: Duration = Duration::from_secs(2);

impl Session {
    /// Leaves the job: the outbox closes, so the agent writes what is still queued (an engine's
    /// last stage report, a trainer's last push) and then closes its connection. Waits up to
    /// `within` for that; a runtime shut down at once would drop the queue unsent.
    pub(crate) fn leave(self, within: Duration) {
        let Session { outbox, ends } = self;
        drop(outbox);
        ends.wait(Some(within), |st| st.stopped.as_ref().map(|_| ()));
    }
}

/// Waits until the controller sent this worker its part of a plan (its id), or said the plan
/// failed (why), or `timeout` passed.
pub(crate) fn wait_plan(
    s: &Session,
    worker: &str,
    timeout: Option<Duration>,
) -> Result<u64, EmbedError> {
    let got = s.ends.wait(timeout, |st| match &st.plan {
        Some(p) => Some(p.clone().map_err(|reason| (reason, false))),
        None => st.stopped.clone().map(|r| Err((r, true))),
    });
    match got {
        Some(Ok(id)) => Ok(id),
        Some(Err((reason, false))) => Err(EmbedError::PlanFailed {
            worker: worker.to_string(),
            reason,
        }),
        Some(Err(_)) => Err(EmbedError::Closed {
            worker: worker.to_string(),
        }),
        None => Err(EmbedError::Timeout {
            what: format!("{worker}'s plan"),
        }),
    }
}

/// Starts the agent with `driver` on `rt` and waits (up to `within`) until it registered.
pub(crate) fn run_session<D: SyncDriver>(
    rt: &Runtime,
    reach: &Reach,
    world: WorldSpec,
    driver: D,
    within: Duration,
) -> Result<Session, EmbedError> {
    let cfg = AgentConfig {
        controller: reach.controller.clone(),
        job_token: reach.token.clone(),
        id: reach.id,
        host: std::env::var("HOSTNAME").unwrap_or_else(|_| "localhost".into()),
        world,
        reconnect_for: Duration::from_secs(60),
        max_frame: crate::AGENT_MAX_FRAME,
        tls: reach.tls.clone(),
    };
    let (out_tx, out_rx) = mpsc::channel(256);
    let (ev_tx, mut ev_rx) = mpsc::unbounded_channel();
    let ends = std::sync::Arc::new(Ends::default());
    let link = AgentLink {
        outbox: Some(out_rx),
        events: Some(ev_tx),
    };
    spawn_quiet(rt, run_agent_with(cfg, driver, link));
    let pump = ends.clone();
    // Weak: a strong sender here would keep the outbox open, and leaving waits for it to close.
    let resend = out_tx.downgrade();
    rt.spawn(async move {
        while let Some(ev) = ev_rx.recv().await {
            let again = matches!(ev, AgentEvent::Registered);
            pump.record(ev);
            if !again {
                continue;
            }
            let push = {
                let st = pump.state.lock();
                st.outstanding
                    .filter(|(v, _)| st.registrations > 1 && !st.by_version.contains_key(v))
            };
            if let Some((version, run)) = push {
                tracing::info!(
                    "re-sending the push of version {version} (run {run}) after re-registering"
                );
                if let Some(tx) = resend.upgrade() {
                    let _ = tx.try_send(FromWorker::Push { version, run });
                }
            }
        }
    });
    let joined = ends.wait(Some(within), |st| {
        if st.registered {
            Some(Ok(()))
        } else {
            st.stopped.clone().map(Err)
        }
    });
    match joined {
        Some(Ok(())) => Ok(Session {
            outbox: out_tx,
            ends,
        }),
        Some(Err(reason)) => Err(EmbedError::Registration {
            worker: reach.name.clone(),
            tensor: None,
            reason,
        }),
        None => Err(EmbedError::Timeout {
            what: format!("{} to register with the controller", reach.name),
        }),
    }
}

/// Runs an agent whose result the events already report.
fn spawn_quiet<T: Send + 'static>(rt: &Runtime, fut: impl Future<Output = T> + Send + 'static) {
    rt.spawn(async move {
        let _ = fut.await;
    });
}
