//! One simulated worker of `weightsync bench controller`: the control channel's handshake and
//! registration, then a heartbeat every interval the controller's `Welcome` asks for, while
//! everything the controller sends is read and dropped (so its outbox never fills).

use std::net::SocketAddr;
use std::time::Duration;

use weightsync_common::DType;
use weightsync_common::protocol::{
    Blob, DEFAULT_MAX_FRAME, FromWorker, Registration, ToWorker, WorkerId, WorkerRole, WorldSpec,
    auth, read_frame, write_frame,
};

/// The job every simulated worker states.
#[derive(Debug, Clone)]
pub struct Job {
    /// The job.
    pub world: WorldSpec,
}

impl Job {
    /// A small model's job with `trainers` training ranks (fsdp) and `rollouts` inference
    /// ranks (tp=1, dp).
    pub fn new(trainers: u32, rollouts: u32) -> Job {
        Job {
            world: WorldSpec {
                model: "qwen3-0.6b".into(),
                train: format!("fsdp={trainers}"),
                infer: format!("tp=1,dp={rollouts}"),
                dtype: DType::BF16,
                verify: true,
            },
        }
    }
}

/// Handshakes in flight at once: the controller closes unauthenticated connections past 64
/// from one address (all of these come from 127.0.0.1), where a real job's come from many hosts.
pub const HANDSHAKES_AT_ONCE: usize = 32;

/// Registers as `id` (holding a permit of `handshakes` until welcomed), sends `ready` the
/// heartbeat interval, then heartbeats until the controller closes the connection.
pub async fn run(
    control: SocketAddr,
    job: &Job,
    token: &str,
    id: WorkerId,
    handshakes: std::sync::Arc<tokio::sync::Semaphore>,
    ready: std::sync::mpsc::Sender<u64>,
) -> anyhow::Result<()> {
    let permit = handshakes.acquire_owned().await?;
    let s = tokio::net::TcpStream::connect(control).await?;
    let (mut rd, mut wr) = s.into_split();
    let Some(ToWorker::Challenge { nonce }) =
        read_frame::<_, ToWorker>(&mut rd, DEFAULT_MAX_FRAME).await?
    else {
        anyhow::bail!("no challenge");
    };
    let reg = Registration {
        id,
        host: "bench".into(),
        pid: 0,
        world: job.world.clone(),
        fabric_endpoint: Blob(b"127.0.0.1:9".to_vec()),
        regions: if id.role == WorkerRole::Rollout {
            vec![Blob(vec![0; 32])]
        } else {
            Vec::new()
        },
        tensors: Vec::new(),
        placement: None,
        skip: Vec::new(),
    };
    for msg in [
        FromWorker::Hello {
            role: id.role,
            nonce: auth::nonce(),
            proof: auth::prove(token, id.role, &nonce),
        },
        FromWorker::Register(Box::new(reg)),
    ] {
        write_frame(&mut wr, &msg, DEFAULT_MAX_FRAME).await?;
    }
    let heartbeat_ms = loop {
        match read_frame::<_, ToWorker>(&mut rd, DEFAULT_MAX_FRAME).await? {
            Some(ToWorker::Welcome { heartbeat_ms, .. }) => break heartbeat_ms.max(1),
            Some(ToWorker::Rejected { reason, .. }) => anyhow::bail!("rejected: {reason}"),
            Some(_) => {}
            None => anyhow::bail!("the controller closed the connection before its Welcome"),
        }
    };
    drop(permit);
    let _ = ready.send(heartbeat_ms);
    let beats = tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(heartbeat_ms));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        for seq in 1.. {
            tick.tick().await;
            if write_frame(&mut wr, &FromWorker::Heartbeat { seq }, DEFAULT_MAX_FRAME)
                .await
                .is_err()
            {
                break;
            }
        }
    });
    while let Ok(Some(_)) = read_frame::<_, ToWorker>(&mut rd, DEFAULT_MAX_FRAME).await {}
    beats.abort();
    Ok(())
}
